//! The per-pod sidecar: tracing context, RAS polling storm, pod lifecycle
//! (SIGTERM, a SIGKILLed rank), and hostile input on every listening port.
//! Every test is bounded in time and kills what it started.

mod common;

use common::{cli, now_ms, num};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use weft::rpc;
use weft_tests::job::{self, JobRun, JobSpec};
use weft_tests::otlp;
use weft_tests::sidecar::Sidecar;

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

fn status(sc: &Sidecar) -> rpc::Status {
    rt().block_on(weft::ras::fetch(sc.socket.clone()))
        .unwrap_or_else(|e| panic!("status: {e}"))
}

fn with_env<'a>(spec: JobSpec<'a>, env: &[(String, String)]) -> JobSpec<'a> {
    env.iter().fold(spec, |s, (k, v)| s.env(k, v))
}

/// Runs the job on a thread (so the test can act while it runs).
fn spawn_job(
    spec_args: Vec<String>,
    ranks: usize,
    env: Vec<(String, String)>,
    limit: Duration,
) -> std::thread::JoinHandle<JobRun> {
    std::thread::spawn(move || {
        let args: Vec<&str> = spec_args.iter().map(String::as_str).collect();
        job::run(with_env(JobSpec::new(common::worker(), ranks, &args), &env).timeout(limit))
    })
}

// ---------------------------------------------------------------- tracing

/// One sidecar serving 4 ranks, each running N collectives on the world and
/// N on a split half: the receiver gets every span, and each span's rank and
/// communicator are those of the process that issued it (checked against
/// the pid the sidecar knows from the connection and the ids the rank printed).
#[test]
fn tracing_context_every_span_arrives_with_its_own_rank_and_comm() {
    const N: usize = 500;
    let recv = otlp::Receiver::default();
    let (port, _srv) = otlp::start(recv.clone());
    let endpoint = format!("http://127.0.0.1:{port}");
    let mut sc = Sidecar::start(cli(), &[("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint)]);
    let t = Instant::now();
    let run = job::run(
        with_env(
            JobSpec::new(common::worker(), 4, &["sc_traced", &N.to_string()]),
            &sc.rank_env(),
        )
        .timeout(Duration::from_secs(240)),
    );
    run.assert_success();
    let job_time = t.elapsed();
    // SIGTERM flushes the exporter; the sidecar exits 0.
    sc.signal(libc::SIGTERM);
    let st = sc
        .wait(Duration::from_secs(10))
        .expect("sidecar exits after SIGTERM");
    assert!(st.success(), "sidecar exit {st:?}\n{}", sc.log());
    let spans = recv.0.lock().unwrap().clone();
    const GROUPS: usize = 10; // as in the rank worker's sc_traced
    let expected = 4 * (2 * N + GROUPS);
    eprintln!(
        "tracing: {} spans received of {expected}, job {:.2?} ({:.0} collectives/s)",
        spans.len(),
        job_time,
        expected as f64 / job_time.as_secs_f64()
    );
    assert_eq!(spans.len(), expected, "every span arrives\n{}", sc.log());
    // Ground truth per process: (comm id, rank, size) for its two communicators.
    let mut truth: BTreeMap<String, Vec<(String, String, String)>> = BTreeMap::new();
    for r in 0..4 {
        let f = run.facts(r);
        truth.insert(
            run.ranks[r].pid.to_string(),
            vec![
                (f["world_comm"].clone(), r.to_string(), "4".into()),
                (
                    f["split_comm"].clone(),
                    f["split_rank"].clone(),
                    f["split_n"].clone(),
                ),
            ],
        );
        assert_eq!(num(&f, "dropped"), 0, "no event dropped by rank {r}");
    }
    let trace = spans[0].trace_id.clone();
    let parent = spans[0].parent.clone();
    let mut seqs: BTreeMap<(String, String), BTreeSet<u64>> = BTreeMap::new();
    let ops = ["all_reduce", "all_gather", "broadcast"];
    for s in &spans {
        let a = &s.attrs;
        assert_eq!(s.trace_id, trace, "one job-level trace");
        assert_eq!(s.parent, parent, "parented under the job span");
        assert!(!parent.is_empty());
        assert_eq!(a["weft.job"], sc.job);
        assert_eq!(a["weft.outcome"], "ok");
        let pid = &a["process.pid"];
        let mine = &truth[pid];
        let ctx = (
            a["weft.comm_id"].clone(),
            a["weft.rank"].clone(),
            a["weft.world_size"].clone(),
        );
        assert!(
            mine.contains(&ctx),
            "span {ctx:?} came from pid {pid} whose communicators are {mine:?}"
        );
        let seq: u64 = a["weft.seq"].parse().unwrap();
        if seq as usize > N {
            assert_eq!(a["weft.op"], "group", "seq {seq} is a group call");
            assert_eq!(a["weft.world_size"], "4", "groups run on the world");
        } else {
            assert_eq!(a["weft.op"], ops[(seq as usize - 1) % 3], "op of seq {seq}");
        }
        assert_eq!(s.name, format!("weft.{}", a["weft.op"]));
        for k in ["weft.dtype", "weft.bytes", "weft.algorithm"] {
            assert!(!a[k].is_empty(), "{k} set");
        }
        assert!(
            seqs.entry((ctx.0, ctx.1)).or_default().insert(seq),
            "duplicate seq {seq}"
        );
    }
    assert_eq!(seqs.len(), 8, "4 ranks x 2 communicators");
    for (k, v) in &seqs {
        let n = if v.len() > N { N + GROUPS } else { N };
        assert_eq!(v.len(), n, "{k:?}");
        assert_eq!(
            (*v.first().unwrap(), *v.last().unwrap()),
            (1, n as u64),
            "{k:?}"
        );
    }
    let world_groups = seqs.values().filter(|v| v.len() == N + GROUPS).count();
    assert_eq!(
        world_groups, 4,
        "every rank's world communicator has its groups"
    );
}

// ---------------------------------------------------------------- RAS storm

/// Several clients query status as fast as they can (gRPC and the HTTP
/// page) while 4 ranks init, split, run checked collectives and abort.
#[test]
fn ras_polling_storm_during_init_splits_collectives_and_aborts() {
    let sc = Sidecar::start(cli(), &[]);
    let stop = Arc::new(AtomicBool::new(false));
    let (queries, errors) = (
        Arc::new(AtomicU64::new(0)),
        Arc::new(Mutex::new(Vec::<String>::new())),
    );
    let mut clients = Vec::new();
    for c in 0..4 {
        let (stop, q, errs, sock) = (
            stop.clone(),
            queries.clone(),
            errors.clone(),
            sc.socket.clone(),
        );
        clients.push(std::thread::spawn(move || {
            rt().block_on(async move {
                let mut cl = weft::client::sidecar(sock).await.expect("connect");
                let mut last = 0;
                while !stop.load(Ordering::Relaxed) {
                    match cl.get_status(rpc::StatusRequest::default()).await {
                        Ok(s) => {
                            let s = s.into_inner();
                            // Snapshots are published in order and never torn.
                            if s.snapshot_seq < last {
                                errs.lock()
                                    .unwrap()
                                    .push(format!("client {c}: snapshot went back"));
                            }
                            last = s.snapshot_seq;
                            q.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(e) => errs.lock().unwrap().push(format!("client {c}: {e}")),
                    }
                }
            })
        }));
    }
    {
        let (stop, q, errs, sc_http) = (
            stop.clone(),
            queries.clone(),
            errors.clone(),
            sc.http.clone(),
        );
        clients.push(std::thread::spawn(move || {
            use std::io::{Read, Write};
            while !stop.load(Ordering::Relaxed) {
                let r = std::net::TcpStream::connect(&sc_http).and_then(|mut s| {
                    s.write_all(b"GET /ras HTTP/1.0\r\n\r\n")?;
                    let mut b = String::new();
                    s.read_to_string(&mut b)?;
                    Ok(b)
                });
                match r {
                    Ok(b) if b.starts_with("HTTP/1.0 200") || b.starts_with("HTTP/1.1 200") => {
                        q.fetch_add(1, Ordering::Relaxed);
                    }
                    Ok(b) => errs
                        .lock()
                        .unwrap()
                        .push(format!("http: {}", b.lines().next().unwrap_or(""))),
                    Err(e) => errs.lock().unwrap().push(format!("http: {e}")),
                }
            }
        }));
    }
    let t = Instant::now();
    let run = job::run(
        with_env(
            JobSpec::new(common::worker(), 4, &["sc_storm", "30", "40"]),
            &sc.rank_env(),
        )
        .timeout(Duration::from_secs(240)),
    );
    let secs = t.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    for c in clients {
        c.join().unwrap();
    }
    run.assert_success();
    let q = queries.load(Ordering::Relaxed);
    let errs = errors.lock().unwrap().clone();
    let collectives: u64 = (0..4).map(|r| num(&run.facts(r), "collectives")).sum();
    eprintln!(
        "storm: {q} status queries in {secs:.2} s = {:.0}/s, {} client errors, {collectives} collectives checked",
        q as f64 / secs,
        errs.len()
    );
    assert!(
        errs.is_empty(),
        "client errors: {:?}",
        &errs[..errs.len().min(10)]
    );
    assert!(q as f64 / secs > 1000.0, "{:.0} queries/s", q as f64 / secs);
    // The sidecar is still healthy and saw every communicator leave.
    let s = status(&sc);
    assert!(s.comms.is_empty(), "{:?}", s.comms);
    assert_eq!(sc.http_get("/healthz").unwrap().0, 200);
}

/// Ranks that finish and return from main without closing their agent
/// (as `weft bench` and resilient-train do) are not taken for dead: their
/// last messages arrive and the stream ends cleanly (issue 31 (8): on a
/// cluster, a sidecar declared such a rank dead with "h2 protocol error").
#[test]
fn ranks_exiting_without_close_are_not_declared_dead() {
    let sc = Sidecar::start(cli(), &[]);
    for round in 0..5 {
        let run = job::run(
            with_env(
                JobSpec::new(common::worker(), 4, &["sc_exit", "30"]),
                &sc.rank_env(),
            )
            .timeout(Duration::from_secs(60)),
        );
        run.assert_success();
        let t = Instant::now();
        let s = loop {
            let s = status(&sc);
            if s.comms.is_empty() || t.elapsed() > Duration::from_secs(5) {
                break s;
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        assert!(
            s.async_errors.iter().all(|e| !e.contains("died")),
            "round {round}: a clean exit taken for a death: {:?}\n{}",
            s.async_errors,
            sc.log()
        );
        assert!(s.comms.is_empty(), "round {round}: {:?}", s.comms);
        assert!(
            s.processes.iter().all(|p| p.state != "dead"),
            "round {round}: {:?}",
            s.processes
        );
    }
}

// ---------------------------------------------------------------- lifecycle

fn wait_running(sc: &Sidecar, ranks: usize) {
    let t = Instant::now();
    loop {
        let s = status(sc);
        let busy = s
            .comms
            .iter()
            .any(|c| c.ranks.len() == ranks && c.ranks.iter().all(|r| r.last_completed_seq >= 5));
        if busy {
            return;
        }
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "ranks never ran: {s:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// SIGTERM to the sidecar while collectives run: every rank's pending call
/// returns an error within 2 s, the sidecar exits 0, nothing is left running.
#[test]
fn sigterm_to_the_sidecar_fails_every_rank_within_2s_and_exits_0() {
    let mut sc = Sidecar::start(cli(), &[]);
    let h = spawn_job(
        vec!["sc_hang".into()],
        4,
        sc.rank_env(),
        Duration::from_secs(90),
    );
    wait_running(&sc, 4);
    let t0 = now_ms();
    sc.signal(libc::SIGTERM);
    let st = sc
        .wait(Duration::from_secs(5))
        .expect("sidecar exits within its grace");
    let exit_ms = now_ms() - t0;
    let run = h.join().unwrap();
    assert!(st.success(), "sidecar exit {st:?}\n{}", sc.log());
    let mut worst = 0;
    for r in &run.ranks {
        assert_eq!(
            r.code,
            Some(3),
            "rank {} must fail with an error\n{}",
            r.rank,
            run.dump()
        );
        let f = run.facts(r.rank);
        let at: u128 = f["failed_at_ms"].parse().unwrap();
        worst = worst.max(at.saturating_sub(t0));
        assert_eq!(f["kind"], "RemoteError", "{f:?}");
        assert!(f["error"].contains("terminating"), "{f:?}");
    }
    eprintln!(
        "sigterm: slowest rank failed {worst} ms after SIGTERM; sidecar exited after {exit_ms} ms"
    );
    assert!(worst < 2000, "slowest rank took {worst} ms");
    assert!(sc.log().contains("SIGTERM: aborting"), "{}", sc.log());
    for r in &run.ranks {
        assert!(
            unsafe { libc::kill(r.pid as i32, 0) } != 0,
            "rank {} left running",
            r.rank
        );
    }
}

/// A rank SIGKILLed mid-collective: the sidecar notices its stream close,
/// marks it dead in RAS (with pid), and every other rank fails within 2 s.
#[test]
fn sigkill_of_a_rank_is_marked_dead_and_fails_its_peers() {
    let sc = Sidecar::start(cli(), &[]);
    let mut env = sc.rank_env();
    env.push(("WEFT_TEST_VICTIM".into(), "3".into()));
    let run = job::run(
        with_env(JobSpec::new(common::worker(), 4, &["sc_hang"]), &env)
            .timeout(Duration::from_secs(90)),
    );
    let victim = &run.ranks[3];
    assert_eq!(victim.signal, Some(libc::SIGKILL), "{}", run.dump());
    for r in &run.ranks[..3] {
        assert_eq!(r.code, Some(3), "rank {} must fail\n{}", r.rank, run.dump());
    }
    // RAS: the victim's process is dead, and the async error names it.
    let t = Instant::now();
    let s = loop {
        let s = status(&sc);
        if s.processes
            .iter()
            .any(|p| p.pid == victim.pid && p.state == "dead")
        {
            break s;
        }
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "victim not marked dead: {s:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    let why = s
        .async_errors
        .iter()
        .find(|e| e.contains(&format!("pid {}", victim.pid)) && e.contains("died"))
        .unwrap_or_else(|| panic!("no async error names the victim: {:?}", s.async_errors));
    eprintln!("sigkill: RAS says: {why}");
    let (code, text) = sc.http_get("/ras").unwrap();
    assert_eq!(code, 200);
    assert!(text.contains("dead"), "{text}");
}

/// A hang shows in RAS: the ranks waiting in a collective are `stuck` with
/// a higher started sequence number than the one rank that is behind.
#[test]
fn ras_shows_which_rank_is_behind_in_a_hang() {
    let sc = Sidecar::start(cli(), &[("WEFT_RAS_STUCK_MS", "300")]);
    let h = spawn_job(
        vec!["sc_behind".into()],
        4,
        sc.rank_env(),
        Duration::from_secs(60),
    );
    let t = Instant::now();
    let comm = loop {
        let s = status(&sc);
        let hung = s.comms.iter().find(|c| {
            c.ranks.len() == 4 && c.ranks.iter().filter(|r| r.state == "stuck").count() == 3
        });
        if let Some(c) = hung {
            break c.clone();
        }
        assert!(t.elapsed() < Duration::from_secs(20), "no hang seen: {s:?}");
        std::thread::sleep(Duration::from_millis(20));
    };
    let behind: Vec<u32> = comm
        .ranks
        .iter()
        .filter(|r| {
            r.last_started_seq < comm.ranks.iter().map(|r| r.last_started_seq).max().unwrap()
        })
        .map(|r| r.rank)
        .collect();
    assert_eq!(behind, vec![3], "{comm:?}");
    let (_, text) = sc.http_get("/ras").unwrap();
    eprintln!("the hang as `weft ras` shows it:\n{text}");
    assert!(text.contains("BEHIND by 1"), "{text}");
    h.join().unwrap().assert_success();
}

// ---------------------------------------------------------------- hostile input

/// Wrong job secret, garbage and oversized messages on the socket and the
/// HTTP port: each refused with a log line and a counter; the job keeps running.
#[test]
fn wrong_secret_garbage_and_oversized_input_are_rejected_and_the_job_runs_on() {
    use std::io::{Read, Write};
    let sc = Sidecar::start_with(
        cli(),
        None,
        &["--peer-listen".to_string(), "127.0.0.1:0".to_string()],
        &[],
        None,
    );
    let h = spawn_job(
        vec!["sc_traced".into(), "300".into()],
        2,
        sc.rank_env(),
        Duration::from_secs(120),
    );

    // 1. A rank with the wrong job secret is refused.
    let mut bad = sc.rank_env();
    bad.retain(|(k, _)| k != "WEFT_JOB_SECRET");
    bad.push(("WEFT_JOB_SECRET".into(), "not-the-secret".into()));
    let intruder = job::run(
        with_env(JobSpec::new(common::worker(), 1, &["sc_traced", "1"]), &bad)
            .timeout(Duration::from_secs(30)),
    );
    assert_eq!(intruder.ranks[0].code, Some(1), "{}", intruder.dump());
    assert!(
        intruder.ranks[0].stderr.contains("wrong job secret"),
        "{}",
        intruder.dump()
    );

    // 2. Garbage on the Unix socket.
    let mut u = std::os::unix::net::UnixStream::connect(&sc.socket).unwrap();
    let _ = u.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n\x00\xff garbage garbage");
    let mut sink = Vec::new();
    u.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let _ = u.read_to_end(&mut sink);

    // 3. An authenticated attach that then sends a 2 MiB message.
    let (sock, job, secret) = (sc.socket.clone(), sc.job.clone(), sc.secret.clone());
    let oversized = rt().block_on(async move {
        let mut c = weft::client::sidecar(sock).await.unwrap();
        let pid = std::process::id();
        let hello = rpc::Hello {
            pid,
            hostname: "test".into(),
            job: job.clone(),
            auth: weft::engine::auth::hello_mac(&secret, &job, pid),
            ..Default::default()
        };
        let big = rpc::AsyncError {
            comm_id: "x".into(),
            rank: 0,
            error: "A".repeat(2 << 20),
        };
        let msgs = vec![
            rpc::RankMessage {
                msg: Some(rpc::rank_message::Msg::Hello(hello)),
            },
            rpc::RankMessage {
                msg: Some(rpc::rank_message::Msg::Error(big)),
            },
        ];
        let mut s = c
            .attach(tokio_stream::iter(msgs))
            .await
            .unwrap()
            .into_inner();
        tokio::time::timeout(Duration::from_secs(10), s.message()).await
    });
    eprintln!("oversized: the stream ended with {oversized:?}");

    // 4. Garbage and an oversized header on the HTTP port.
    let mut t = std::net::TcpStream::connect(&sc.http).unwrap();
    let _ = t.write_all(b"\x16\x03\x01 not http at all\r\n\r\n");
    let mut resp = String::new();
    t.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let _ = t.read_to_string(&mut resp);
    assert!(
        resp.is_empty() || resp.starts_with("HTTP/1.1 400"),
        "{resp}"
    );
    let mut t = std::net::TcpStream::connect(&sc.http).unwrap();
    let _ = write!(
        t,
        "GET /ras HTTP/1.1\r\nX-Big: {}\r\n\r\n",
        "B".repeat(1 << 20)
    );
    let mut resp = String::new();
    let _ = t.read_to_string(&mut resp);
    assert!(
        !resp.starts_with("HTTP/1.1 200"),
        "an oversized header is refused: {resp:.80}"
    );

    // 5. The peer port: garbage, a wrong secret, and a replayed request.
    let mut t = std::net::TcpStream::connect(&sc.peer).unwrap();
    let _ = t.write_all(b"HELO garbage on the peer port\r\n\r\n-----");
    let mut sink = Vec::new();
    t.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let _ = t.read_to_end(&mut sink);
    let (peer, job, secret) = (sc.peer.clone(), sc.job.clone(), sc.secret.clone());
    let codes = rt().block_on(async move {
        let mut c = rpc::sidecar_client::SidecarClient::new(
            tonic::transport::Endpoint::from_shared(format!("http://{peer}"))
                .unwrap()
                .connect()
                .await
                .unwrap(),
        );
        let ts = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_millis() as u64;
        let req = |secret: &str| {
            let mut r = tonic::Request::new(rpc::HeartbeatRequest::default());
            // One nonce for all three: the third is a byte-for-byte replay
            // of the second.
            let mac = weft::engine::peer_rpc::peer_mac(secret, &job, ts, "5eed");
            r.metadata_mut()
                .insert(weft::engine::peer_rpc::AUTH_HEADER, mac.parse().unwrap());
            r.metadata_mut().insert(
                weft::engine::peer_rpc::NONCE_HEADER,
                "5eed".parse().unwrap(),
            );
            r.metadata_mut().insert(
                weft::engine::peer_rpc::TS_HEADER,
                ts.to_string().parse().unwrap(),
            );
            r
        };
        let wrong = c
            .heartbeat(req("not-the-secret"))
            .await
            .map(|_| ())
            .map_err(|e| e.code());
        let right = c
            .heartbeat(req(&secret))
            .await
            .map(|_| ())
            .map_err(|e| e.code());
        let replay = c
            .heartbeat(req(&secret))
            .await
            .map(|_| ())
            .map_err(|e| e.code());
        (wrong, right, replay)
    });
    assert_eq!(codes.0, Err(tonic::Code::Unauthenticated));
    assert_eq!(codes.1, Ok(()));
    assert_eq!(
        codes.2,
        Err(tonic::Code::Unauthenticated),
        "a replay is refused"
    );

    let run = h.join().unwrap();
    run.assert_success();
    let log = sc.log();
    assert!(
        log.contains("rejected a connection on the peer port"),
        "{log}"
    );
    assert!(log.contains("rejected a peer request"), "{log}");
    assert!(log.contains("replayed request"), "{log}");
    eprintln!("sidecar log:\n{log}");
    assert!(log.contains("wrong job secret"), "{log}");
    assert!(log.contains("not gRPC"), "{log}");
    assert!(log.contains("rejected a message"), "{log}");
    let (code, metrics) = sc.http_get("/metrics").unwrap();
    assert_eq!(code, 200);
    for reason in ["auth", "garbage", "oversized"] {
        assert!(
            metrics.contains(&format!("reason=\"{reason}\"")),
            "metric for {reason}:\n{metrics}"
        );
    }
    assert!(metrics.contains("weft_collectives_total"), "{metrics}");
    assert_eq!(sc.http_get("/readyz").unwrap().0, 200);
}

/// Without WEFT_SIDECAR_SOCKET the same engine runs inside each rank.
#[test]
fn embedded_mode_runs_without_a_sidecar() {
    let run = job::run(
        JobSpec::new(common::worker(), 2, &["sc_traced", "30"])
            .env("WEFT_SIDECAR_SOCKET", "")
            .timeout(Duration::from_secs(60)),
    );
    run.assert_success();
    assert_eq!(run.facts(0)["done"], "1");
}

/// `weft ras --json` prints the snapshot.
#[test]
fn weft_ras_json_reports_the_sidecar() {
    let sc = Sidecar::start(cli(), &[]);
    let out = std::process::Command::new(cli())
        .args(["ras", "--json", "--socket"])
        .arg(&sc.socket)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["job"], sc.job.as_str());
}

/// A program that only uses the NCCL C ABI (never the Rust agent) attaches
/// to the sidecar through `WEFT_SIDECAR_SOCKET` by itself: its communicator
/// and operations show in RAS, and a normal exit is not taken for a death.
#[test]
fn c_abi_programs_attach_to_the_sidecar() {
    let sc = Sidecar::start(cli(), &[]);
    let release = sc.dir.join("release");
    let mut env = sc.rank_env();
    env.push(("WEFT_TEST_RELEASE".into(), release.display().to_string()));
    let h = spawn_job(vec!["sc_capi".into()], 3, env, Duration::from_secs(60));
    let t = Instant::now();
    let comm = loop {
        let s = status(&sc);
        if let Some(c) = s.comms.iter().find(|c| {
            c.nranks == 3
                && c.ranks.len() == 3
                && c.ranks.iter().all(|r| r.last_completed_seq >= 20)
        }) {
            break c.clone();
        }
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "the C ABI ranks never showed in RAS: {s:?}\n{}",
            sc.log()
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    for r in &comm.ranks {
        assert_eq!(r.last_completed_op, "all_reduce", "{r:?}");
        assert_eq!(r.last_outcome, "ok", "{r:?}");
    }
    std::fs::write(&release, b"go").unwrap();
    let run = h.join().unwrap();
    for r in &run.ranks {
        assert_eq!(r.code, Some(0), "rank {}\n{}", r.rank, run.dump());
    }
    let pids: Vec<u32> = run.ranks.iter().map(|r| r.pid).collect();
    let s = status(&sc);
    let dead: Vec<_> = s
        .processes
        .iter()
        .filter(|p| pids.contains(&p.pid) && p.state == "dead")
        .collect();
    assert!(
        dead.is_empty(),
        "a clean exit was taken for a death: {dead:?}"
    );
    eprintln!(
        "C ABI attach: communicator {} with 3 ranks in RAS after {:?}",
        comm.comm_id,
        t.elapsed()
    );
}

/// A program that only uses the NCCL C ABI, without a sidecar, with
/// `OTEL_EXPORTER_OTLP_ENDPOINT` set: it exports its own spans (the agent's
/// exporter, `weft_agent::spans_only`, runs in the process), flushed at its
/// normal exit. It once exported none and said nothing.
#[test]
fn c_abi_programs_without_a_sidecar_export_spans() {
    let recv = otlp::Receiver::default();
    let (port, _srv) = otlp::start(recv.clone());
    let dir = std::env::temp_dir().join(format!("weft-capi-otlp-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let release = dir.join("release");
    std::fs::write(&release, b"go").unwrap();
    let run = job::run(
        JobSpec::new(common::worker(), 3, &["sc_capi"])
            .env("WEFT_SIDECAR_SOCKET", "")
            .env("WEFT_TEST_RELEASE", &release.display().to_string())
            .env(
                "OTEL_EXPORTER_OTLP_ENDPOINT",
                &format!("http://127.0.0.1:{port}"),
            )
            .timeout(Duration::from_secs(60)),
    );
    let _ = std::fs::remove_dir_all(&dir);
    run.assert_success();
    let spans = recv.spans_when(|s| s.len() >= 60, Duration::from_secs(5));
    let mut per_rank: BTreeMap<String, usize> = BTreeMap::new();
    for s in spans.iter().filter(|s| s.name == "weft.all_reduce") {
        assert_eq!(s.attrs["weft.outcome"], "ok", "{s:?}");
        assert_eq!(s.attrs["weft.world_size"], "3", "{s:?}");
        *per_rank.entry(s.attrs["weft.rank"].clone()).or_default() += 1;
    }
    let want: BTreeMap<String, usize> = (0..3).map(|r| (r.to_string(), 20)).collect();
    assert_eq!(
        per_rank,
        want,
        "20 all-reduce spans per rank\n{}",
        run.dump()
    );
}
