//! The sidecar's telemetry rings and death rule at the speed of the
//! collectives (issue 30): a flood of a million tiny collectives, ranks
//! exiting right after their last one, a control stream cut while its rank
//! lives, a SIGKILLed rank, and hostile telemetry segments. Every test is
//! bounded in time and kills what it started.

mod common;

use common::{cli, num};
use std::collections::{BTreeMap, BTreeSet};
use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};
use weft::rpc;
use weft_agent::ring::layout::{self, Geometry};
use weft_agent::ring::{Segment, queue};
use weft_tests::job::{self, JobRun, JobSpec};
use weft_tests::otlp;
use weft_tests::sidecar::Sidecar;

fn run_job(
    sc: &Sidecar,
    ranks: usize,
    args: &[&str],
    extra: &[(&str, &str)],
    t: Duration,
) -> JobRun {
    let mut spec = JobSpec::new(common::worker(), ranks, args).timeout(t);
    for (k, v) in sc.rank_env() {
        spec = spec.env(&k, &v);
    }
    for (k, v) in extra {
        spec = spec.env(k, v);
    }
    job::run(spec)
}

/// Lines of the sidecar's log that would mean a rank was taken for dead,
/// a stream was refused or a communicator aborted.
fn alarms(log: &str) -> Vec<&str> {
    log.lines()
        .filter(|l| {
            [
                "died",
                "GOAWAY",
                "ENHANCE_YOUR_CALM",
                "rejected a message",
                "aborting comm",
                "named dead",
            ]
            .iter()
            .any(|w| l.contains(w))
        })
        .collect()
}

/// Waits (at most 10 s) until the sidecar has judged every process gone:
/// their rings have been read for the last time.
fn settle(sc: &Sidecar) {
    let t = Instant::now();
    while !sc.status().processes.is_empty() && t.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// SIGTERM (which flushes the exporter), then the exit.
fn stop(sc: &mut Sidecar) {
    sc.signal(libc::SIGTERM);
    let st = sc
        .wait(Duration::from_secs(20))
        .expect("sidecar exits after SIGTERM");
    assert!(st.success(), "sidecar exit {st:?}\n{}", sc.log());
}

// ---------------------------------------------------------------- flood

/// 4 ranks, 250,000 8-byte all-reduces each, one sidecar, a span budget of
/// 200 a second: the job succeeds with no false death, no GOAWAY, no
/// aborted communicator; every operation is counted exactly once in the
/// metrics (from the slot counters, whether it also came as a record, was
/// sampled out or its record was dropped) and exported exactly once, alone
/// or in an aggregate; the aggregates carry the right rank and communicator.
#[test]
fn a_flood_of_a_million_collectives_is_counted_and_kills_nothing() {
    const N: u64 = 250_000;
    let recv = otlp::Receiver::default();
    let (port, _srv) = otlp::start(recv.clone());
    let endpoint = format!("http://127.0.0.1:{port}");
    let mut sc = Sidecar::start(
        cli(),
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint),
            ("WEFT_SPANS_PER_SEC", "200"),
        ],
    );
    let t = Instant::now();
    let run = run_job(
        &sc,
        4,
        &["sc_flood", &N.to_string()],
        &[],
        Duration::from_secs(400),
    );
    run.assert_success();
    let took = t.elapsed();
    let (mut issued, mut dropped, mut records) = (0, 0, 0);
    let mut pids = BTreeMap::new();
    for r in 0..4 {
        let f = run.facts(r);
        assert_eq!(num(&f, "issued"), N);
        assert!(
            num(&f, "reported") + num(&f, "dropped") <= N,
            "rank {r}: at most one record per operation"
        );
        issued += N;
        records += num(&f, "reported");
        dropped += num(&f, "dropped");
        pids.insert(run.ranks[r].pid.to_string(), r.to_string());
    }
    // The sidecar has read every ring by the time each process is judged gone.
    settle(&sc);
    let s = sc.status();
    assert!(s.async_errors.is_empty(), "{:?}", s.async_errors);
    assert!(
        s.processes.iter().all(|p| p.state != "dead"),
        "{:?}",
        s.processes
    );
    let read = sc.metric("weft_collectives_total");
    let lost = sc.metric("weft_events_dropped_total");
    eprintln!(
        "flood: {issued} collectives in {took:.1?} ({:.0}/s), {read} counted, {records} records, {lost} records dropped (ranks say {dropped})",
        issued as f64 / took.as_secs_f64()
    );
    assert_eq!(read, issued as f64, "every operation counted");
    assert_eq!(lost, dropped as f64);
    assert_eq!(
        s.dropped_events as f64, lost,
        "RAS counts the drops of exited processes too"
    );
    assert_eq!(
        sc.metric("weft_span_records_total"),
        read,
        "each operation exported once"
    );
    assert!(alarms(&sc.log()).is_empty(), "{}", sc.log());
    assert_eq!(sc.metric("weft_stream_breaks_total"), 0.0);
    let spans_dropped = sc.metric("weft_spans_dropped_total");
    stop(&mut sc);
    let spans = recv.spans_when(
        |s| {
            s.iter()
                .map(|x| x.attrs["weft.count"].parse::<f64>().unwrap())
                .sum::<f64>()
                + spans_dropped
                >= read
        },
        Duration::from_secs(20),
    );
    let counted: f64 = spans
        .iter()
        .map(|x| x.attrs["weft.count"].parse::<f64>().unwrap())
        .sum();
    assert_eq!(
        counted + spans_dropped,
        read,
        "the spans account for every operation"
    );
    let aggs: Vec<_> = spans
        .iter()
        .filter(|x| x.attrs["weft.export"] == "aggregate")
        .collect();
    assert!(!aggs.is_empty(), "beyond the budget, aggregates");
    for a in &aggs {
        assert_eq!(a.name, "weft.all_reduce.aggregate");
        let pid = &a.attrs["process.pid"];
        assert_eq!(
            a.attrs["weft.rank"], pids[pid],
            "an aggregate carries its process's rank"
        );
        assert_eq!(a.attrs["weft.world_size"], "4");
        let (min, mean, max) = (
            num_attr(a, "weft.latency_min_ns"),
            num_attr(a, "weft.latency_mean_ns"),
            num_attr(a, "weft.latency_max_ns"),
        );
        assert!(min <= mean && mean <= max, "{a:?}");
    }
    let comms: BTreeSet<_> = spans
        .iter()
        .map(|x| x.attrs["weft.comm_id"].clone())
        .collect();
    assert_eq!(comms.len(), 1, "one communicator: {comms:?}");
}

fn num_attr(s: &otlp::Got, k: &str) -> u64 {
    s.attrs[k]
        .parse()
        .unwrap_or_else(|_| panic!("{k} in {s:?}"))
}

// ---------------------------------------------------------------- clean exits

/// 50 times: 4 ranks run 3 collectives, destroy and exit at once (no
/// agent close: the process's end races its last messages). Never a death,
/// nothing on the recovery board, every job succeeds.
#[test]
fn ranks_exiting_right_after_their_last_collective_are_never_dead() {
    const ROUNDS: usize = 50;
    let board = std::env::temp_dir().join(format!("weft-board-quick-{}", std::process::id()));
    std::fs::create_dir_all(&board).unwrap();
    let sc = Sidecar::start(
        cli(),
        &[
            ("WEFT_RECOVERY_DIR", board.to_str().unwrap()),
            ("WEFT_RANK_OFFSET", "0"),
            ("WEFT_LOCAL_RANKS", "4"),
            ("WEFT_WORLD_SIZE", "4"),
        ],
    );
    let t = Instant::now();
    for round in 0..ROUNDS {
        let run = run_job(
            &sc,
            4,
            &["sc_quick_exit", "3"],
            &[],
            Duration::from_secs(60),
        );
        assert!(
            run.ranks.iter().all(|r| r.code == Some(0)),
            "round {round}\n{}",
            run.dump()
        );
    }
    settle(&sc);
    let s = sc.status();
    eprintln!("clean exits: {ROUNDS} rounds in {:.1?}", t.elapsed());
    assert!(
        s.processes.is_empty(),
        "every process exited cleanly: {:?}",
        s.processes
    );
    assert!(s.async_errors.is_empty(), "{:?}", s.async_errors);
    assert!(alarms(&sc.log()).is_empty(), "{}", sc.log());
    let dead: Vec<_> = std::fs::read_dir(&board)
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("dead"))
        .collect();
    assert!(dead.is_empty(), "nothing on the board: {dead:?}");
    let _ = std::fs::remove_dir_all(&board);
}

// ---------------------------------------------------------------- a cut stream

/// Rank 1's control connection is cut half-way (the agent's test hook)
/// while it lives: the sidecar logs the break, keeps its communicator,
/// the agent attaches again, nobody is failed, and every span arrives,
/// those after the cut too, with the right rank and communicator.
#[test]
fn a_stream_cut_while_its_rank_lives_is_no_death_and_spans_keep_coming() {
    const N: usize = 200;
    let recv = otlp::Receiver::default();
    let (port, _srv) = otlp::start(recv.clone());
    let endpoint = format!("http://127.0.0.1:{port}");
    let mut sc = Sidecar::start(cli(), &[("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint)]);
    let run = run_job(
        &sc,
        4,
        &["sc_cut", &N.to_string()],
        &[("WEFT_TEST_VICTIM", "1")],
        Duration::from_secs(120),
    );
    run.assert_success();
    let f = run.facts(1);
    assert_eq!(num(&f, "reconnects"), 1, "{}", run.dump());
    let cut_at = num(&f, "cut_at_seq");
    settle(&sc);
    // (Its old stream's end is logged as a break unless it attached again first.)
    let log = sc.log();
    assert!(log.contains("attached again"), "{log}");
    assert!(alarms(&log).is_empty(), "{log}");
    assert_eq!(sc.metric("weft_stream_breaks_total"), 1.0);
    let s = sc.status();
    assert!(s.async_errors.is_empty(), "{:?}", s.async_errors);
    stop(&mut sc);
    let spans = recv.spans_when(|s| s.len() >= 4 * N, Duration::from_secs(20));
    assert_eq!(spans.len(), 4 * N, "every span arrives");
    let victim_pid = run.ranks[1].pid.to_string();
    let comm = f["comm"].clone();
    let after: Vec<_> = spans
        .iter()
        .filter(|s| s.attrs["process.pid"] == victim_pid)
        .inspect(|s| {
            assert_eq!(s.attrs["weft.rank"], "1");
            assert_eq!(s.attrs["weft.comm_id"], comm);
        })
        .filter(|s| num_attr(s, "weft.seq") > cut_at)
        .collect();
    assert_eq!(
        after.len(),
        N - cut_at as usize,
        "spans after the cut arrive"
    );
}

// ---------------------------------------------------------------- SIGKILL

/// A rank SIGKILLs itself mid-collective: every survivor fails within 2 s
/// of the kill, and the sidecar names the dead rank in RAS.
#[test]
fn a_sigkilled_rank_is_still_reported_in_time() {
    let sc = Sidecar::start(cli(), &[]);
    let run = run_job(
        &sc,
        4,
        &["sc_hang"],
        &[("WEFT_TEST_VICTIM", "3")],
        Duration::from_secs(90),
    );
    let victim = &run.ranks[3];
    assert_eq!(victim.signal, Some(libc::SIGKILL), "{}", run.dump());
    let killed = num(&run.facts(3), "killed_at_ms");
    for r in &run.ranks[..3] {
        assert_eq!(r.code, Some(3), "rank {} must fail\n{}", r.rank, run.dump());
        let at = num(&run.facts(r.rank), "failed_at_ms");
        assert!(
            at.saturating_sub(killed) < 2000,
            "rank {} failed {} ms after the kill",
            r.rank,
            at.saturating_sub(killed)
        );
    }
    let t = Instant::now();
    loop {
        let s = sc.status();
        let named = s
            .async_errors
            .iter()
            .any(|e| e.contains(&format!("pid {}", victim.pid)) && e.contains("died"));
        if named {
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(5), "not named: {s:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(sc.log().contains("of comm"), "{}", sc.log());
}

// ---------------------------------------------------------------- hostile rings

fn memfd(bytes: usize, seal: bool) -> OwnedFd {
    // SAFETY: plain system calls on a descriptor we then own.
    let raw = unsafe {
        libc::memfd_create(
            c"hostile".as_ptr(),
            libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
        )
    };
    assert!(raw >= 0);
    unsafe { libc::ftruncate(raw, bytes as libc::off_t) };
    if seal {
        unsafe {
            libc::fcntl(
                raw,
                libc::F_ADD_SEALS,
                libc::F_SEAL_SHRINK | libc::F_SEAL_GROW,
            )
        };
    }
    unsafe { OwnedFd::from_raw_fd(raw) }
}

fn dup(fd: std::os::fd::RawFd) -> OwnedFd {
    // SAFETY: dup of a live descriptor.
    unsafe { OwnedFd::from_raw_fd(libc::dup(fd)) }
}

/// Attaches to `sc` passing what `fds` gives, with a valid Hello; the
/// stream (kept open) or the refusal.
async fn attach_passing(
    sc: &Sidecar,
    fds: impl Fn() -> Vec<OwnedFd> + Send + Sync + 'static,
    then: Vec<rpc::rank_message::Msg>,
) -> Result<
    (
        tokio::sync::mpsc::Sender<rpc::RankMessage>,
        tonic::Streaming<rpc::SidecarCommand>,
    ),
    tonic::Status,
> {
    let fds: weft_agent::client::PassFds = Arc::new(fds);
    let ch = weft_agent::client::connect_passing(sc.socket.clone(), Some(fds))
        .await
        .expect("connect");
    let pid = std::process::id();
    let hello = rpc::Hello {
        pid,
        hostname: "hostile".into(),
        job: sc.job.clone(),
        auth: weft_agent::auth::hello_mac(&sc.secret, &sc.job, pid),
        ..Default::default()
    };
    let (tx, rx) = tokio::sync::mpsc::channel(16);
    tx.send(rpc::RankMessage {
        msg: Some(rpc::rank_message::Msg::Hello(hello)),
    })
    .await
    .unwrap();
    for m in then {
        tx.send(rpc::RankMessage { msg: Some(m) }).await.unwrap();
    }
    let r = weft_agent::client::client(ch)
        .attach(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await?;
    Ok((tx, r.into_inner()))
}

/// Segments that are not sealed, of the wrong size, or not files are
/// refused (counted, logged); a valid segment then filled with garbage,
/// and one with an entry claimed and never published, are read without
/// harm; all the while a real job runs on the same sidecar and succeeds,
/// and RAS answers.
#[test]
fn hostile_telemetry_segments_leave_the_sidecar_serving() {
    /// Makes the descriptors one hostile attach passes.
    type Descriptors = dyn Fn() -> Vec<OwnedFd> + Send + Sync;
    let sc = Sidecar::start(cli(), &[]);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let g = Geometry::with_records(1024);
    // Refused: unsealed, sealed but garbage, a socket, two segments.
    let refusals: Vec<(&str, Box<Descriptors>)> = vec![
        ("unsealed", Box::new(move || vec![memfd(g.bytes(), false)])),
        ("garbage", Box::new(move || vec![memfd(g.bytes(), true)])),
        ("tiny", Box::new(|| vec![memfd(64, true)])),
        (
            "socket",
            Box::new(|| {
                let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
                vec![OwnedFd::from(a)]
            }),
        ),
    ];
    let n_refused = refusals.len();
    for (what, fds) in refusals {
        let r = rt.block_on(attach_passing(&sc, fds, vec![]));
        let e = r.err().unwrap_or_else(|| panic!("{what}: attached"));
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{what}: {e:?}");
    }
    assert_eq!(
        sc.metric("weft_rejected_connections_total"),
        n_refused as f64,
        "{}",
        sc.log()
    );
    // Accepted, then garbage: a valid segment, a communicator with a slot,
    // then random words everywhere and a ticket claimed but never published.
    let seg = Arc::new(Segment::create(g).unwrap());
    let s2 = seg.clone();
    let register = rpc::rank_message::Msg::Register(rpc::Register {
        comm_id: "hostile".into(),
        rank: 0,
        nranks: 2,
        slot: 1,
        slot_generation: 1,
    });
    let (tx, _cmds) = rt
        .block_on(attach_passing(
            &sc,
            move || vec![dup(s2.fd())],
            vec![register],
        ))
        .expect("a valid segment is accepted");
    let job = std::thread::spawn({
        let env = sc.rank_env();
        move || {
            let mut spec = JobSpec::new(common::worker(), 2, &["sc_traced", "300"])
                .timeout(Duration::from_secs(120));
            for (k, v) in env {
                spec = spec.env(&k, &v);
            }
            job::run(spec)
        }
    });
    let mut x = 0x2545_f491_4f6c_dd1du64;
    let t = Instant::now();
    while !job.is_finished() && t.elapsed() < Duration::from_secs(120) {
        for _ in 0..4096 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let w = (x as usize) % g.words();
            if w != layout::H_MAGIC {
                seg.word(w).store(x, Ordering::Relaxed);
            }
        }
        let _ = sc.status();
        std::thread::sleep(Duration::from_millis(2));
    }
    job.join().unwrap().assert_success();
    // A producer that never publishes: the sidecar skips the entry, later
    // records still arrive.
    let fresh = Arc::new(Segment::create(g).unwrap());
    let f2 = fresh.clone();
    let (_tx2, _cmds2) = rt
        .block_on(attach_passing(&sc, move || vec![dup(f2.fd())], vec![]))
        .expect("attached");
    let before = sc.metric("weft_collectives_total");
    fresh.word(layout::H_TAIL).store(1, Ordering::Relaxed);
    let rec = weft_agent::ring::Record {
        comm: weft_agent::ring::CommKey::of("stalled"),
        rank: 0,
        nranks: 1,
        op: 1,
        dtype: 9,
        algo: 1,
        group: false,
        outcome: 0,
        slot: weft_agent::ring::record::NO_SLOT,
        bytes: 8,
        seq: 2,
        start_ns: 1,
        end_ns: 2,
    };
    assert!(queue::push(&fresh, &rec));
    // (The garbage segment's last counters may still move the metric: wait
    // for the stalled entry's drop, which only this segment makes.)
    let t = Instant::now();
    while sc.metric("weft_events_dropped_total") < 1.0
        || sc.metric("weft_collectives_total") == before
    {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "the stalled entry was not skipped and counted, or the record after it never came"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let s = sc.status();
    assert!(
        s.comms.iter().any(|c| c.comm_id == "hostile"),
        "RAS answers: {s:?}"
    );
    assert!(sc.http_get("/healthz").unwrap().0 == 200);
    drop(tx);
}
