//! Attacks on a running job's ports from a client without the job secret,
//! on loopback: forged connects, silent connections, oversized bootstrap
//! frames; and a rank SIGKILLed in the middle of init. Each case is bounded
//! in count and time and checks that the job keeps working (its splits stay
//! within 2x their own baseline), that the attacked rank's memory and
//! descriptors stay bounded, that every attack is counted, and that the
//! listeners are bound to loopback (a job whose root is on 127.0.0.1 is
//! not reachable at 127.0.0.2).

mod common;

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::time::{Duration, Instant};
use weft_testkit::Rng;
use weft_tests::job::{self, JobRun, JobSpec, Running};

/// Ranks of the attacked jobs, each on its own simulated host (TCP between
/// them), so the last rank accepts connections from all the others.
const RANKS: usize = 4;
/// Splits timed before and during an attack.
const ROUNDS: &str = "10";
/// How much the attacked rank's memory may grow under an attack.
const RSS_BOUND: u64 = 64 << 20;

struct Ctl(PathBuf);

impl Ctl {
    fn new(name: &str) -> Ctl {
        let d = std::env::temp_dir().join(format!("weft-hostile-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        Ctl(d)
    }
    fn touch(&self, f: &str) {
        std::fs::write(self.0.join(f), b"").unwrap();
    }
    /// Waits for `f` (bounded), with the job's output on failure.
    fn wait(&self, f: &str, job: &mut Option<Running>) -> String {
        let t = Instant::now();
        loop {
            if let Ok(s) = std::fs::read_to_string(self.0.join(f)) {
                return s;
            }
            if t.elapsed() > Duration::from_secs(60) {
                let run = job.take().unwrap().wait();
                panic!("{f} never appeared:\n{}", run.dump());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Ctl {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn spec<'a>(ctl: &'a Ctl, ranks: usize, hosts: impl Fn(usize) -> String + 'a) -> JobSpec<'a> {
    let dir = ctl.0.display().to_string();
    JobSpec::new(common::worker(), ranks, &["hostile", ROUNDS])
        .env("WEFT_PROXY", "0")
        .env("WEFT_DEBUG", "WARN")
        .per_rank(move |r| {
            vec![
                ("WEFT_HOSTNAME".into(), hosts(r)),
                ("WEFT_TEST_CTL".into(), dir.clone()),
            ]
        })
        .timeout(Duration::from_secs(150))
}

/// `VmRSS` or `VmHWM` of a process, in bytes.
fn mem(pid: u32, key: &str) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    s.lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map(|kb| kb * 1024)
        .unwrap_or(0)
}

fn fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0)
}

/// Port and pid a rank published.
fn port_pid(s: &str) -> (u16, u32) {
    let mut it = s.split_whitespace();
    (
        it.next().unwrap().parse().unwrap(),
        it.next().unwrap().parse().unwrap(),
    )
}

/// A bootstrap-protocol frame as an attacker makes it: a valid header,
/// `payload`, and a made-up tag.
fn frame(kind: u8, declared_len: u32, payload: &[u8], rng: &mut Rng) -> Vec<u8> {
    let mut f = Vec::new();
    f.extend_from_slice(b"WFTB");
    f.extend_from_slice(&[1, kind, 0, 0]);
    f.extend_from_slice(&declared_len.to_be_bytes());
    f.extend_from_slice(&[0; 4]);
    f.extend_from_slice(payload);
    f.extend_from_slice(&rng.bytes(32));
    f
}

/// The splits of every rank under attack stay within 2x their baseline
/// (plus 250 ms for scheduling noise on a loaded machine), and its
/// all-reduce throughput within 30% of it.
fn assert_splits_in_time(run: &JobRun) {
    for r in 0..run.ranks.len() {
        let f = run.facts(r);
        eprintln!("rank {r}: {f:?}");
        let base = common::num(&f, "baseline_ms");
        let hit = common::num(&f, "attacked_ms");
        assert!(
            hit <= 2 * base + 250,
            "rank {r}: {ROUNDS} splits took {hit} ms under attack, {base} ms before\n{}",
            run.dump()
        );
        // Throughput within 30% of the baseline: time at most 1/0.7 of it
        // (plus 20 ms of scheduling noise on a loaded machine).
        let base = common::num(&f, "baseline_ar_ms");
        let hit = common::num(&f, "attacked_ar_ms");
        assert!(
            hit * 7 <= base * 10 + 140,
            "rank {r}: all-reduce throughput fell by more than 30% under attack: {hit} ms vs {base} ms\n{}",
            run.dump()
        );
    }
}

/// Whether `addr` accepts a TCP connection.
fn reachable(addr: SocketAddr) -> bool {
    TcpStream::connect_timeout(&addr, Duration::from_secs(2)).is_ok()
}

/// Issue 23, item 1: thousands of Connect frames with made-up MACs for
/// random communicator ids, from a client without the job secret. They
/// are refused at once (never parked: no descriptor or memory kept),
/// counted, and the job's next splits work in their usual time.
#[test]
fn forged_connects_are_refused_before_anything_is_kept() {
    let ctl = Ctl::new("forged");
    let mut job = Some(job::spawn(spec(&ctl, RANKS, |r| format!("h{r}"))));
    for r in 0..RANKS {
        ctl.wait(&format!("ready.{r}"), &mut job);
    }
    let (port, pid) = port_pid(&ctl.wait(&format!("port.{}", RANKS - 1), &mut job));
    let (rss0, fd0) = (mem(pid, "VmRSS:"), fds(pid));
    let target: SocketAddr = ([127, 0, 0, 1], port).into();
    let mut rng = Rng::new(0x5eed_0001);
    let t = Instant::now();
    let mut held = Vec::new();
    for _ in 0..4200 {
        let mut s = TcpStream::connect_timeout(&target, Duration::from_secs(5)).unwrap();
        // comm id, src, dst, client nonce: all made up, as is the tag.
        let _ = s.write_all(&frame(5, 40, &rng.bytes(40), &mut rng));
        held.push(s);
    }
    eprintln!("4200 forged connects sent in {:?}", t.elapsed());
    // The endpoint closes them: every attacker connection sees its end.
    for s in held.iter_mut().step_by(42) {
        s.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
        let mut sink = Vec::new();
        let r = s.read_to_end(&mut sink);
        assert!(
            !matches!(&r, Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut)),
            "a forged connect was kept open (parked) by the endpoint"
        );
    }
    // Nothing kept: the descriptors and memory of the attacked rank stay put.
    let t = Instant::now();
    while fds(pid) > fd0 + 100 && t.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(50));
    }
    let (fd1, rss1) = (fds(pid), mem(pid, "VmRSS:"));
    drop(held);
    ctl.touch("go");
    let run = job.take().unwrap().wait();
    run.assert_success();
    assert!(
        fd1 <= fd0 + 100,
        "the attacked rank holds {fd1} descriptors (before: {fd0})"
    );
    assert!(
        rss1 < rss0 + RSS_BOUND,
        "the attacked rank grew from {rss0} to {rss1} bytes"
    );
    let f = run.facts(RANKS - 1);
    assert!(
        common::num(&f, "unauthenticated") >= 4000,
        "forged connects not counted: {f:?}"
    );
    assert_eq!(common::num(&f, "parked"), 0, "{f:?}");
    // Logged with their source (rate-limited: a few lines, not 4,200).
    let err = &run.ranks[RANKS - 1].stderr;
    let lines = err
        .lines()
        .filter(|l| l.contains("peer endpoint: rejected connection from 127.0.0.1:"))
        .count();
    assert!((1..=100).contains(&lines), "{lines} refusal lines:\n{err}");
    assert_splits_in_time(&run);
}

/// Issue 23, item 2: 1,100 connections that never say anything hold no
/// slot a real peer needs: the job's splits stay within 2x their baseline.
#[test]
fn silent_connections_do_not_delay_splits() {
    let ctl = Ctl::new("silent");
    let mut job = Some(job::spawn(spec(&ctl, RANKS, |r| format!("h{r}"))));
    for r in 0..RANKS {
        ctl.wait(&format!("ready.{r}"), &mut job);
    }
    let (port, pid) = port_pid(&ctl.wait(&format!("port.{}", RANKS - 1), &mut job));
    let rss0 = mem(pid, "VmRSS:");
    let target: SocketAddr = ([127, 0, 0, 1], port).into();
    let held: Vec<TcpStream> = (0..1100)
        .map(|_| TcpStream::connect_timeout(&target, Duration::from_secs(5)).unwrap())
        .collect();
    std::thread::sleep(Duration::from_millis(200));
    let rss1 = mem(pid, "VmRSS:");
    ctl.touch("go");
    let run = job.take().unwrap().wait();
    drop(held);
    run.assert_success();
    assert!(
        rss1 < rss0 + RSS_BOUND,
        "the attacked rank grew from {rss0} to {rss1} bytes"
    );
    assert_splits_in_time(&run);
    // All but the 128 a source may hold are dropped (after their 50 ms).
    let f = run.facts(RANKS - 1);
    assert!(
        common::num(&f, "evicted") >= 900,
        "silent connections not dropped and counted: {f:?}"
    );
    let err = &run.ranks[RANKS - 1].stderr;
    assert!(
        err.contains("silent unauthenticated connection(s)"),
        "evictions not logged:\n{err}"
    );
}

/// Issue 23, item 3: the bootstrap root reads a few KiB at most before it
/// checks a MAC (32 connections announcing 16 MiB frames and sending them
/// leave rank 0's memory where it was), and it listens on the address
/// NCCL_COMM_ID names (127.0.0.1: not 127.0.0.2); so do the peer endpoints
/// of a job whose ranks are all on this host.
#[test]
fn bootstrap_root_reads_little_before_the_mac_and_binds_loopback() {
    let ctl = Ctl::new("root");
    let mut job = Some(job::spawn(spec(&ctl, 2, |r| format!("h{r}")).per_rank({
        let dir = ctl.0.display().to_string();
        move |r| {
            let mut v = vec![
                ("WEFT_HOSTNAME".into(), format!("h{r}")),
                ("WEFT_TEST_CTL".into(), dir.clone()),
            ];
            if r == 1 {
                v.push(("WEFT_TEST_WAIT_FILE".into(), "start".into()));
            }
            v
        }
    })));
    let running = job.as_ref().unwrap();
    let root: SocketAddr = running.bootstrap.parse().unwrap();
    let pid0 = running.pids()[0];
    // Rank 0 serves the root and waits for rank 1.
    let t = Instant::now();
    while !reachable(root) {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "the root never came up"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let rss0 = mem(pid0, "VmRSS:");
    let attackers: Vec<_> = (0..32u64)
        .map(|i| {
            std::thread::spawn(move || {
                let mut rng = Rng::new(0x5eed_0300 + i);
                let Ok(mut s) = TcpStream::connect_timeout(&root, Duration::from_secs(5)) else {
                    return;
                };
                s.set_write_timeout(Some(Duration::from_secs(10))).unwrap();
                let len = (16u32 << 20) - 64;
                if s.write_all(&frame(2, len, &[], &mut rng)[..16]).is_err() {
                    return;
                }
                let chunk = vec![0u8; 64 << 10];
                let mut sent = 0usize;
                while sent < len as usize + 32 {
                    match s.write(&chunk) {
                        Ok(n) => sent += n,
                        Err(_) => return,
                    }
                }
                // Everything sent: wait for the root's verdict.
                s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
                let _ = s.read_to_end(&mut Vec::new());
            })
        })
        .collect();
    for a in attackers {
        a.join().unwrap();
    }
    let peak = mem(pid0, "VmHWM:");
    let other_loopback = SocketAddr::new([127, 0, 0, 2].into(), root.port());
    let root_elsewhere = reachable(other_loopback);
    ctl.touch("start");
    for r in 0..2 {
        ctl.wait(&format!("ready.{r}"), &mut job);
    }
    let mut endpoints_elsewhere = Vec::new();
    for r in 0..2 {
        let (port, _) = port_pid(&ctl.wait(&format!("port.{r}"), &mut job));
        assert!(reachable(([127, 0, 0, 1], port).into()));
        if reachable(([127, 0, 0, 2], port).into()) {
            endpoints_elsewhere.push(r);
        }
    }
    ctl.touch("go");
    let run = job.take().unwrap().wait();
    run.assert_success();
    assert!(
        peak < rss0 + RSS_BOUND,
        "rank 0 went from {rss0} to a peak of {peak} bytes under 32 oversized hellos"
    );
    assert!(
        !root_elsewhere,
        "the root of a job on 127.0.0.1 accepts connections at {other_loopback}"
    );
    assert!(
        endpoints_elsewhere.is_empty(),
        "peer endpoints of ranks {endpoints_elsewhere:?} of a single-host job are reachable at 127.0.0.2"
    );
    let f = run.facts(0);
    assert!(
        common::num(&f, "root_refused") >= 32,
        "oversized hellos not counted: {f:?}"
    );
    assert!(
        run.ranks[0]
            .stderr
            .contains("bootstrap root: rejected connection from 127.0.0.1:"),
        "oversized hellos not logged:\n{}",
        run.ranks[0].stderr
    );
}

/// Socket inodes of a process.
fn socket_inodes(pid: u32) -> Vec<String> {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| {
            d.filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
                .filter_map(|l| {
                    let l = l.to_string_lossy().into_owned();
                    Some(
                        l.strip_prefix("socket:[")?
                            .trim_end_matches(']')
                            .to_string(),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

/// Whether the process has an established TCP connection to `port`.
fn connected_to(pid: u32, port: u16) -> bool {
    let inodes = socket_inodes(pid);
    let tcp = std::fs::read_to_string(format!("/proc/{pid}/net/tcp")).unwrap_or_default();
    tcp.lines().skip(1).any(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        f.len() > 9
            && f[3] == "01"
            && f[2].rsplit(':').next() == Some(&format!("{port:04X}"))
            && inodes.iter().any(|i| i == f[9])
    })
}

/// Whether init of `pid` reached its shared memory: a /dev/shm file of the
/// job, or a memfd of it.
fn shm_created(pid: u32, job: &str) -> bool {
    let prefix = format!("weft-{job}-");
    let in_dev_shm = std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.filter_map(|e| e.ok())
                .any(|e| e.file_name().to_string_lossy().starts_with(&prefix))
        })
        .unwrap_or(false);
    let memfd = format!("/memfd:{prefix}");
    in_dev_shm
        || std::fs::read_dir(format!("/proc/{pid}/fd"))
            .map(|d| {
                d.filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
                    .any(|l| l.to_string_lossy().starts_with(&memfd))
            })
            .unwrap_or(false)
}

/// Issue 23, item 8: every rank SIGKILLed while init waits for a local
/// peer (after this rank made its shared memory, before the peer mapped
/// it), without `weft run` to clean up: nothing is left in /dev/shm.
///
/// The stop of rank 1 must land after its hello reached the root; the test
/// sees only that its connection is up, and on a loaded machine the stop
/// can land between the connect and the hello (the root then rejects it
/// after its 10 s handshake bound and the rendezvous never completes). Such
/// an attempt is retried (up to 3); the leak check holds for every attempt
/// that reached the state.
#[test]
fn sigkill_during_init_leaves_nothing_in_dev_shm() {
    for attempt in 1..=3 {
        match sigkill_during_init_attempt(attempt) {
            Some(()) => return,
            None => eprintln!("attempt {attempt}: rank 1 stopped before its hello; again"),
        }
    }
    panic!(
        "in 3 attempts rank 0 never made its shared memory (rank 1 always stopped before its hello)"
    );
}

/// One attempt; None when rank 0 never made its shared memory (see above).
fn sigkill_during_init_attempt(attempt: usize) -> Option<()> {
    let ctl = Ctl::new(&format!("shm{attempt}"));
    // Ranks 0 and 1 share a host; rank 2 (another host) starts late.
    let hosts = |r: usize| {
        if r < 2 {
            "a".to_string()
        } else {
            "b".to_string()
        }
    };
    let mut job = Some(job::spawn(spec(&ctl, 3, hosts).per_rank({
        let dir = ctl.0.display().to_string();
        move |r| {
            let mut v = vec![
                ("WEFT_HOSTNAME".into(), hosts(r)),
                ("WEFT_TEST_CTL".into(), dir.clone()),
            ];
            if r == 2 {
                v.push(("WEFT_TEST_WAIT_FILE".into(), "start".into()));
            }
            v
        }
    })));
    let running = job.as_ref().unwrap();
    let root: SocketAddr = running.bootstrap.parse().unwrap();
    let pids = running.pids();
    // Rank 1 has said hello to the root: stop it there, so that once the
    // table arrives rank 0 makes its segment and waits for rank 1's.
    let t = Instant::now();
    while !connected_to(pids[1], root.port()) {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "rank 1 never reached the root"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    // Time for the challenge and the hello (microseconds when idle).
    std::thread::sleep(Duration::from_millis(50));
    running.signal(1, libc::SIGSTOP);
    ctl.touch("start");
    let t = Instant::now();
    while !shm_created(pids[0], running.job()) {
        // Past the root's handshake bound (10 s): rank 1's hello never came.
        if t.elapsed() > Duration::from_secs(12) {
            for r in 0..3 {
                running.signal(r, libc::SIGKILL);
            }
            let _ = job.take().unwrap().wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    for r in 0..3 {
        running.signal(r, libc::SIGKILL);
    }
    let run = job.take().unwrap().wait();
    assert!(
        run.ranks.iter().all(|r| r.signal == Some(libc::SIGKILL)),
        "{}",
        run.dump()
    );
    assert!(
        run.leaked_shm.is_empty(),
        "a SIGKILL during init left {:?}",
        run.leaked_shm
    );
    Some(())
}
