//! Several hosts on one machine: each host a network namespace with its own
//! address, its own `weft sidecar` (heartbeating the others) and 2 ranks
//! that talk TCP across hosts. Skipped, with the reason printed, where
//! `ip netns` is not permitted. Every test deletes its namespaces.

mod common;

use common::{cli, now_ms};
use std::thread::{Scope, ScopedJoinHandle};
use std::time::{Duration, Instant};
use weft_tests::job::{self, JobRun, JobSpec};
use weft_tests::netns::Net;
use weft_tests::sidecar::Sidecar;

const PEER_PORT: u16 = 7100;
const BOOT_PORT: u16 = 7200;
const PER_HOST: usize = 2;

struct Cluster {
    sidecars: Vec<Sidecar>,
    net: Net,
    per_host: usize,
}

fn cluster(hosts: usize, peer_timeout_ms: u64) -> Option<Cluster> {
    cluster_with(hosts, PER_HOST, peer_timeout_ms)
}

fn cluster_with(hosts: usize, per_host: usize, peer_timeout_ms: u64) -> Option<Cluster> {
    cluster_full(hosts, per_host, peer_timeout_ms, true)
}

/// Without `heartbeats` the sidecars get no `--peers`: only the proxy's own
/// pings and silence timeout watch the hosts.
fn cluster_full(
    hosts: usize,
    per_host: usize,
    peer_timeout_ms: u64,
    heartbeats: bool,
) -> Option<Cluster> {
    let net = common::netns_hosts(hosts)?;
    let mut sidecars: Vec<Sidecar> = Vec::new();
    for h in 0..hosts {
        let peers: Vec<String> = (0..hosts)
            .filter(|k| *k != h)
            .map(|k| format!("{}:{PEER_PORT}", net.addrs[k]))
            .collect();
        let mut extra = vec![
            "--peer-listen".to_string(),
            format!("{}:{PEER_PORT}", net.addrs[h]),
            "--peer-timeout-ms".to_string(),
            peer_timeout_ms.to_string(),
        ];
        if heartbeats {
            extra.extend(["--peers".to_string(), peers.join(",")]);
        }
        let sc = Sidecar::start_with(cli(), Some(&net.hosts[h]), &extra, &[], sidecars.first());
        sidecars.push(sc);
    }
    if heartbeats {
        // Every sidecar has heard from every peer before the job starts.
        let t = Instant::now();
        for sc in &sidecars {
            loop {
                let s = weft_tests_rt()
                    .block_on(weft::ras::fetch(sc.socket.clone()))
                    .unwrap();
                if s.hosts.len() == hosts - 1 && s.hosts.iter().all(|h| h.state == "up") {
                    break;
                }
                let logs: Vec<String> = sidecars.iter().map(|s| s.log()).collect();
                assert!(
                    t.elapsed() < Duration::from_secs(20),
                    "peers never up: {:?}\n{logs:?}",
                    s.hosts
                );
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }
    Some(Cluster {
        sidecars,
        net,
        per_host,
    })
}

impl Cluster {
    fn spec<'a>(&'a self, args: &[&str], limit: Duration) -> JobSpec<'a> {
        let boot = format!("{}:{BOOT_PORT}", self.net.addrs[0]);
        let s0 = &self.sidecars[0];
        let per_host = self.per_host;
        JobSpec::new(common::worker(), per_host * self.sidecars.len(), args)
            .env("WEFT_JOB", &s0.job)
            .env("WEFT_JOB_SECRET", &s0.secret)
            .env("WEFT_BOOTSTRAP", &boot)
            .env("NCCL_COMM_ID", &boot)
            .env("WEFT_PEER_TIMEOUT_MS", "20000")
            .per_rank(move |r| {
                let h = r / per_host;
                vec![
                    ("WEFT_TEST_NETNS".into(), self.net.hosts[h].clone()),
                    ("WEFT_HOSTNAME".into(), self.net.hosts[h].clone()),
                    (
                        "WEFT_SIDECAR_SOCKET".into(),
                        self.sidecars[h].socket.display().to_string(),
                    ),
                ]
            })
            .timeout(limit)
    }

    /// Starts the `sc_hang` job in `scope` (its ranks run collectives until
    /// one fails) and returns once every rank runs.
    fn start_hang<'scope>(
        &'scope self,
        scope: &'scope Scope<'scope, '_>,
    ) -> ScopedJoinHandle<'scope, JobRun> {
        let h = scope.spawn(|| job::run(self.spec(&["sc_hang"], Duration::from_secs(90))));
        self.wait_running();
        h
    }

    fn wait_running(&self) {
        let t = Instant::now();
        for sc in &self.sidecars {
            loop {
                let s = weft_tests_rt()
                    .block_on(weft::ras::fetch(sc.socket.clone()))
                    .unwrap();
                if s.comms.iter().any(|c| {
                    c.ranks.len() == self.per_host
                        && c.ranks.iter().all(|r| r.last_completed_seq >= 3)
                }) {
                    break;
                }
                assert!(
                    t.elapsed() < Duration::from_secs(60),
                    "ranks never ran: {s:?}"
                );
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
}

fn weft_tests_rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

fn errors(run: &JobRun) -> Vec<String> {
    (0..run.ranks.len())
        .map(|r| {
            run.facts(r)
                .get("error")
                .cloned()
                .unwrap_or_default()
                .replace('_', " ")
        })
        .collect()
}

/// Every rank of `run` failed (the worker's exit code 3); returns how long
/// after `t0` (ms since the epoch) the last one did.
fn every_rank_failed(run: &JobRun, t0: u128) -> u128 {
    let mut worst = 0;
    for r in &run.ranks {
        assert_eq!(r.code, Some(3), "rank {} must fail\n{}", r.rank, run.dump());
        let at: u128 = run.facts(r.rank)["failed_at_ms"].parse().unwrap();
        worst = worst.max(at.saturating_sub(t0));
    }
    worst
}

/// No rank of `run` opened a TCP connection of its own: every byte to
/// another host went through the sidecars' proxy.
fn assert_proxied(run: &JobRun) {
    for r in &run.ranks {
        let f = run.facts(r.rank);
        assert_eq!(common::num(&f, "tcp_conns"), 0, "proxied: {f:?}");
    }
}

/// Cuts host 1's link while the `sc_hang` job `hang` runs on the 2 hosts
/// of `c`: every rank fails within twice the peer timeout `timeout_ms`,
/// its error naming the host it lost. Returns the run and the errors.
fn cut_the_link(
    c: &Cluster,
    hang: ScopedJoinHandle<'_, JobRun>,
    timeout_ms: u64,
    what: &str,
) -> (JobRun, Vec<String>) {
    let t0 = now_ms();
    c.net.cut(1);
    let run = hang.join().unwrap();
    let errs = errors(&run);
    let worst = every_rank_failed(&run, t0);
    for r in &run.ranks {
        let lost = &c.net.hosts[1 - r.rank / PER_HOST];
        assert!(
            errs[r.rank].contains(lost.as_str()),
            "rank {}'s error names {lost}: {}",
            r.rank,
            errs[r.rank]
        );
    }
    eprintln!(
        "{what}: every rank failed within {worst} ms (peer timeout {timeout_ms} ms); errors: {errs:?}"
    );
    assert!(worst < (timeout_ms as u128) * 2, "{worst} ms");
    (run, errs)
}

#[test]
fn collectives_across_2_3_and_4_namespace_hosts_are_right() {
    for hosts in [2, 3, 4] {
        let Some(c) = cluster(hosts, 5000) else {
            return;
        };
        let t = Instant::now();
        let run = job::run(c.spec(&["sc_traced", "60"], Duration::from_secs(120)));
        run.assert_success();
        eprintln!(
            "{hosts} hosts x {PER_HOST} ranks: 240 checked collectives per rank in {:.2?}",
            t.elapsed()
        );
        let s = weft_tests_rt()
            .block_on(weft::ras::fetch(c.sidecars[0].socket.clone()))
            .unwrap();
        let logs: Vec<String> = c.sidecars.iter().map(|s| s.log()).collect();
        assert_eq!(s.hosts.len(), hosts - 1, "{s:?}\n{logs:?}");
        assert!(
            s.hosts.iter().all(|h| h.state == "up"),
            "{:?}\n{logs:?}",
            s.hosts
        );
    }
}

#[test]
fn cutting_a_link_fails_every_rank_naming_the_lost_host() {
    const TIMEOUT_MS: u64 = 1500;
    let Some(c) = cluster(2, TIMEOUT_MS) else {
        return;
    };
    std::thread::scope(|sc| {
        let h = c.start_hang(sc);
        // Job-wide RAS from host 0's sidecar: every rank of the job, none missing.
        let s = weft_tests_rt()
            .block_on(weft::ras::fetch_with(c.sidecars[0].socket.clone(), true))
            .unwrap();
        let world = s
            .comms
            .iter()
            .find(|x| x.nranks == 4)
            .expect("the world communicator");
        assert_eq!(world.ranks.len(), 4, "{world:?}");
        assert!(world.missing.is_empty(), "{world:?}");
        assert_eq!(s.processes.len(), 4, "{:?}", s.processes);
        let local = weft_tests_rt()
            .block_on(weft::ras::fetch(c.sidecars[0].socket.clone()))
            .unwrap();
        let lw = local.comms.iter().find(|x| x.nranks == 4).unwrap();
        assert_eq!(
            lw.missing,
            vec![2, 3],
            "host 0 alone sees ranks 2 and 3 missing"
        );
        let (run, _) = cut_the_link(&c, h, TIMEOUT_MS, "link cut");
        assert_proxied(&run);
    });
}

#[test]
fn killing_a_hosts_sidecar_fails_every_rank() {
    const TIMEOUT_MS: u64 = 1500;
    let Some(mut c) = cluster(2, TIMEOUT_MS) else {
        return;
    };
    let run = std::thread::scope(|sc| {
        let h = c.start_hang(sc);
        let t0 = now_ms();
        c.sidecars[1].signal(libc::SIGKILL);
        let run = h.join().unwrap();
        let worst = every_rank_failed(&run, t0);
        assert_proxied(&run);
        let errs = errors(&run);
        eprintln!("sidecar killed: every rank failed within {worst} ms; errors: {errs:?}");
        assert!(worst < (TIMEOUT_MS as u128) * 2, "{worst} ms");
        // Each error names where the failure was seen: the lost sidecar, or
        // the host of the peer whose connection dropped.
        for (r, e) in errs.iter().enumerate() {
            assert!(
                e.contains("lost the sidecar")
                    || c.net.hosts.iter().any(|h| e.contains(h.as_str())),
                "rank {r}: {e}"
            );
        }
        run
    });
    drop(run);
    // The surviving sidecar marks the host lost.
    let t = Instant::now();
    loop {
        let s = weft_tests_rt()
            .block_on(weft::ras::fetch(c.sidecars[0].socket.clone()))
            .unwrap();
        if s.hosts.iter().any(|h| h.state == "lost") {
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(10), "{:?}", s.hosts);
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = c.sidecars[1].wait(Duration::from_secs(1));
}

/// Pod termination on one host: SIGTERM to its sidecar aborts its ranks and
/// tells the peer sidecars, so every rank of the job fails within 2 s, and
/// the sidecar exits 0.
#[test]
fn sigterm_to_one_hosts_sidecar_fails_the_whole_job_within_2s() {
    let Some(mut c) = cluster(2, 5000) else {
        return;
    };
    let (run, t0) = std::thread::scope(|sc| {
        let h = c.start_hang(sc);
        let t0 = now_ms();
        c.sidecars[1].signal(libc::SIGTERM);
        (h.join().unwrap(), t0)
    });
    let st = c.sidecars[1]
        .wait(Duration::from_secs(5))
        .expect("sidecar exits");
    assert!(st.success(), "{st:?}\n{}", c.sidecars[1].log());
    let worst = every_rank_failed(&run, t0);
    eprintln!(
        "sigterm on host 1: every rank failed within {worst} ms; errors: {:?}",
        errors(&run)
    );
    assert!(worst < 2000, "{worst} ms");
}

/// Sum over a sidecar's peer hosts of (proxy bytes sent + received), and
/// each host's (proxy state, connects).
fn proxy_counters(sc: &Sidecar) -> (u64, Vec<(String, String, u64)>) {
    let s = weft_tests_rt()
        .block_on(weft::ras::fetch(sc.socket.clone()))
        .unwrap();
    let bytes = s
        .hosts
        .iter()
        .map(|h| h.proxy_tx_bytes + h.proxy_rx_bytes)
        .sum();
    let hosts = s
        .hosts
        .iter()
        .map(|h| (h.host.clone(), h.proxy.clone(), h.proxy_connects))
        .collect();
    (bytes, hosts)
}

/// Established TCP connections inside a host's namespace between its
/// address and `other`'s (any ports), from `ss`.
fn tcp_between(c: &Cluster, h: usize, other: usize) -> usize {
    let out = std::process::Command::new("ip")
        .args([
            "netns",
            "exec",
            &c.net.hosts[h],
            "ss",
            "-Htn",
            "state",
            "established",
        ])
        .output()
        .expect("running ss");
    let (a, b) = (&c.net.addrs[h], &c.net.addrs[other]);
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.contains(&format!("{a}:")) && l.contains(&format!("{b}:")))
        .count()
}

/// The proxy carries every byte between hosts: 2, 3 and 4 namespace hosts
/// with 4, 3 and 2 ranks each run checked all-reduces (world and split)
/// of a small and then a 64x larger payload. Every rank opened proxy
/// channels and no direct TCP data connection; each sidecar has exactly one
/// proxy connection per peer host, established once, and its byte counters
/// grow with the payload.
#[test]
fn proxy_carries_all_inter_host_traffic_over_one_connection_per_host_pair() {
    for (hosts, per_host) in [(2, 4), (3, 3), (4, 2)] {
        let Some(c) = cluster_with(hosts, per_host, 5000) else {
            return;
        };
        let mut totals = Vec::new();
        for elems in ["1024", "65536"] {
            let t = Instant::now();
            let run = job::run(c.spec(&["sc_payload", elems, "6"], Duration::from_secs(120)));
            run.assert_success();
            for r in &run.ranks {
                let f = run.facts(r.rank);
                assert_eq!(common::num(&f, "tcp_conns"), 0, "rank {}: {f:?}", r.rank);
                assert!(common::num(&f, "proxy_chans") > 0, "rank {}: {f:?}", r.rank);
            }
            let bytes: Vec<u64> = c.sidecars.iter().map(|s| proxy_counters(s).0).collect();
            eprintln!(
                "{hosts} hosts x {per_host} ranks, {elems} f32: job {:.2?}, proxied bytes per sidecar (cumulative) {bytes:?}",
                t.elapsed()
            );
            totals.push(bytes);
        }
        for (k, sc) in c.sidecars.iter().enumerate() {
            let small = totals[0][k];
            let large = totals[1][k] - totals[0][k];
            assert!(small > 0, "sidecar {k} proxied nothing");
            assert!(
                large > 8 * small,
                "sidecar {k}: {large} bytes for 64x the payload vs {small}"
            );
            let (_, peers) = proxy_counters(sc);
            assert_eq!(peers.len(), hosts - 1, "{peers:?}");
            for (name, state, connects) in &peers {
                assert_eq!(state, "up", "{name}: {peers:?}");
                assert_eq!(*connects, 1, "{name}: {peers:?}");
            }
            // One data connection per pair, plus the heartbeat/RAS gRPC
            // channels (one each way, idle-closed ones may be gone).
            for other in (0..hosts).filter(|o| *o != k) {
                let n = tcp_between(&c, k, other);
                assert!(
                    (1..=3).contains(&n),
                    "host {k} - host {other}: {n} TCP connections"
                );
            }
        }
    }
}

/// Impostors on the proxy port: a wrong job secret, garbage after the
/// proxy preface, an oversized handshake message. Each is refused, logged
/// and counted while a job across both hosts keeps running to success.
#[test]
fn wrong_secret_garbage_and_oversized_on_the_proxy_port_are_rejected() {
    use std::io::{Read, Write};
    use weft::proxy::wire;
    let Some(c) = cluster(2, 5000) else {
        return;
    };
    std::thread::scope(|sc| {
        let h = sc.spawn(|| job::run(c.spec(&["sc_traced", "150"], Duration::from_secs(120))));
        c.wait_running();
        let peer = c.sidecars[0].peer.clone();
        let job = c.sidecars[0].job.clone();
        weft_tests::netns::within(&c.net.hosts[1], move || {
            let connect = || {
                let mut s = std::net::TcpStream::connect(&peer).unwrap();
                s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
                s.write_all(wire::PREFACE).unwrap();
                s
            };
            let framed = |b: &[u8]| {
                let mut v = (b.len() as u32).to_be_bytes().to_vec();
                v.extend_from_slice(b);
                v
            };
            // 1. The right job, a made-up proof.
            let mut s = connect();
            let hello = wire::Hello {
                nonce: [7; 16],
                job,
                host: "impostor".into(),
                addr: "10.200.0.2".into(),
            };
            s.write_all(&framed(&hello.encode())).unwrap();
            let mut len = [0u8; 4];
            s.read_exact(&mut len).unwrap();
            let mut ch = vec![0u8; wire::decode_len(len).unwrap()];
            s.read_exact(&mut ch).unwrap();
            s.write_all(&framed(&[0x42; 32])).unwrap();
            let mut rest = Vec::new();
            let _ = s.read_to_end(&mut rest);
            assert!(rest.is_empty(), "no acknowledgement for a bad proof");
            // 2. Garbage.
            let mut s = connect();
            s.write_all(&framed(b"\xff\xfe garbage garbage")).unwrap();
            let _ = s.read_to_end(&mut rest);
            // 3. Oversized.
            let mut s = connect();
            s.write_all(&(1u32 << 30).to_be_bytes()).unwrap();
            let _ = s.read_to_end(&mut rest);
        });
        let run = h.join().unwrap();
        run.assert_success();
    });
    let http = c.sidecars[0].http.clone();
    let metrics = weft_tests::netns::within(&c.net.hosts[0], move || {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(&http).unwrap();
        write!(s, "GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n").unwrap();
        let mut r = String::new();
        s.read_to_string(&mut r).unwrap();
        r
    });
    let log = c.sidecars[0].log();
    for reason in ["auth", "garbage", "oversized"] {
        let line =
            format!("weft_rejected_connections_total{{port=\"proxy\",reason=\"{reason}\"}} 1");
        assert!(metrics.contains(&line), "{line} in\n{metrics}\n{log}");
    }
    assert!(log.contains("rejected a proxy connection"), "{log}");
    assert!(
        metrics.contains("weft_proxy_connections_total 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains("weft_proxy_hosts_lost_total 0"),
        "{metrics}"
    );
    // Proxied bytes and frames per peer host and direction.
    let peer = &c.net.addrs[1];
    for m in ["bytes", "frames"] {
        for dir in ["tx", "rx"] {
            let key = format!("weft_proxy_{m}_total{{peer=\"{peer}\",direction=\"{dir}\"}} ");
            let v: u64 = metrics
                .lines()
                .find_map(|l| l.strip_prefix(key.as_str()))
                .unwrap_or_else(|| panic!("{key} in\n{metrics}"))
                .trim()
                .parse()
                .unwrap();
            assert!(v > 0, "{key}{v}");
        }
    }
    // `weft ras` shows the proxy connection and its bytes.
    let s = weft_tests_rt()
        .block_on(weft::ras::fetch(c.sidecars[0].socket.clone()))
        .unwrap();
    let text = weft::ras_report::render(&s);
    assert!(text.contains("; proxy up (sent "), "{text}");
}

/// Measurement, not a check (run on demand, ideally `--release`): all-reduce
/// latency/bandwidth across 2 namespace hosts x 2 ranks, through the
/// sidecar proxy and with direct TCP (`WEFT_PROXY=0`).
#[test]
#[ignore]
fn measure_proxy_vs_direct_tcp() {
    let Some(c) = cluster(2, 5000) else {
        return;
    };
    let sizes = ["8", "4096", "65536", "1048576", "16777216"];
    let mut args = vec!["sc_bw", "20"];
    args.extend(sizes);
    let mut rows = Vec::new();
    for (name, proxy) in [("proxy", "1"), ("direct", "0")] {
        let run = job::run(
            c.spec(&args, Duration::from_secs(300))
                .env("WEFT_PROXY", proxy),
        );
        run.assert_success();
        let f = run.facts(0);
        rows.push((name, f));
    }
    println!("| bytes | proxy us | proxy algbw GB/s | direct us | direct algbw GB/s |");
    println!("|---:|---:|---:|---:|---:|");
    for s in sizes {
        let key = format!("us_{s}");
        let p: f64 = rows[0].1[&key].parse().unwrap();
        let d: f64 = rows[1].1[&key].parse().unwrap();
        let b: f64 = s.parse().unwrap();
        println!(
            "| {s} | {p:.1} | {:.3} | {d:.1} | {:.3} |",
            b / p / 1e3,
            b / d / 1e3
        );
    }
    println!(
        "proxy ranks: {:?}; direct ranks: {:?}",
        rows[0].1.get("proxy_chans"),
        rows[1].1.get("tcp_conns")
    );
}

/// A rank SIGKILLed on host 0: its local peer sees the process gone, and
/// the ranks on host 1 hear it through the proxy (the connection they share
/// with every other rank stays up): every survivor fails, none hangs.
#[test]
fn sigkill_of_a_rank_fails_the_ranks_on_other_hosts_through_the_proxy() {
    let Some(c) = cluster(2, 5000) else {
        return;
    };
    let t = Instant::now();
    let run = job::run(
        c.spec(&["sc_hang"], Duration::from_secs(90))
            .env("WEFT_TEST_VICTIM", "1"),
    );
    assert_eq!(run.ranks[1].signal, Some(libc::SIGKILL), "{}", run.dump());
    let errs = errors(&run);
    let mut at = Vec::new();
    for r in [0, 2, 3] {
        assert_eq!(
            run.ranks[r].code,
            Some(3),
            "rank {r} must fail\n{}",
            run.dump()
        );
        let f = run.facts(r);
        assert_eq!(common::num(&f, "tcp_conns"), 0, "proxied: {f:?}");
        at.push(f["failed_at_ms"].parse::<u128>().unwrap());
    }
    for r in [2, 3] {
        assert!(
            errs[r].contains(&c.net.hosts[0])
                || errs[r].contains("rank 2 failed")
                || errs[r].contains("rank 2 reported a failure"),
            "rank {r}: {}",
            errs[r]
        );
    }
    let spread = at.iter().max().unwrap() - at.iter().min().unwrap();
    eprintln!(
        "rank 1 killed: survivors failed within {spread} ms of each other, job over in {:.2?}; errors: {errs:?}",
        t.elapsed()
    );
    assert!(spread < 2000, "{spread} ms");
    // The host connection survives a rank's death.
    let (_, peers) = proxy_counters(&c.sidecars[0]);
    assert!(peers.iter().all(|p| p.1 == "up"), "{peers:?}");
}

/// Two free ports, one per loopback alias, with the same number.
fn free_port_on(ips: &[&str]) -> u16 {
    for _ in 0..50 {
        let l = std::net::TcpListener::bind(format!("{}:0", ips[0])).unwrap();
        let port = l.local_addr().unwrap().port();
        if ips[1..]
            .iter()
            .all(|ip| std::net::TcpListener::bind(format!("{ip}:{port}")).is_ok())
        {
            return port;
        }
    }
    panic!("no common free port on {ips:?}");
}

/// Two "hosts" without network namespaces (runs anywhere, no privileges):
/// two loopback addresses with a sidecar each; 2 ranks per host (distinct
/// WEFT_HOSTNAME, WEFT_LISTEN_ADDR) run `args`, `extra(rank)` added.
fn loopback_job(
    args: &[&str],
    extra: impl Fn(usize) -> Vec<(String, String)>,
) -> (JobRun, Vec<Sidecar>) {
    let ips = ["127.0.0.11", "127.0.0.12"];
    let port = free_port_on(&ips);
    let mut sidecars: Vec<Sidecar> = Vec::new();
    for h in 0..2 {
        let extra = vec![
            "--peer-listen".to_string(),
            format!("{}:{port}", ips[h]),
            "--peers".to_string(),
            format!("{}:{port}", ips[1 - h]),
        ];
        let sc = Sidecar::start_with(cli(), None, &extra, &[], sidecars.first());
        sidecars.push(sc);
    }
    let boot = format!("{}:{}", ips[0], free_port_on(&ips[..1]));
    let s0 = &sidecars[0];
    let spec = JobSpec::new(common::worker(), 4, args)
        .env("WEFT_JOB", &s0.job)
        .env("WEFT_JOB_SECRET", &s0.secret)
        .env("WEFT_BOOTSTRAP", &boot)
        .env("NCCL_COMM_ID", &boot)
        .per_rank(|r| {
            let h = r / 2;
            let mut v = vec![
                ("WEFT_HOSTNAME".into(), format!("loop{h}")),
                ("WEFT_LISTEN_ADDR".into(), ips[h].to_string()),
                (
                    "WEFT_SIDECAR_SOCKET".into(),
                    sidecars[h].socket.display().to_string(),
                ),
            ];
            v.extend(extra(r));
            v
        })
        .timeout(Duration::from_secs(120));
    let run = job::run(spec);
    (run, sidecars)
}

/// The proxy without network namespaces: checked collectives pass between
/// two loopback "hosts", every rank is proxied, one connection joins the
/// two sidecars.
#[test]
fn proxy_between_two_sidecars_on_loopback_addresses() {
    let t = Instant::now();
    let (run, sidecars) = loopback_job(&["sc_payload", "16384", "6"], |_| Vec::new());
    run.assert_success();
    for r in &run.ranks {
        let f = run.facts(r.rank);
        assert_eq!(common::num(&f, "tcp_conns"), 0, "rank {}: {f:?}", r.rank);
        assert!(common::num(&f, "proxy_chans") > 0, "rank {}: {f:?}", r.rank);
    }
    for (k, sc) in sidecars.iter().enumerate() {
        let (bytes, peers) = proxy_counters(sc);
        assert!(bytes > 4 * 16384 * 6, "sidecar {k}: {bytes} bytes");
        assert_eq!(peers.len(), 1, "{peers:?}\n{}", sc.log());
        assert_eq!((peers[0].1.as_str(), peers[0].2), ("up", 1), "{peers:?}");
    }
    eprintln!("loopback hosts: {:.2?}", t.elapsed());
}

/// Ranks that disagree about the proxy (WEFT_PROXY=0 on one host only)
/// fail at init with an error saying so, instead of waiting on paths the
/// other side never uses.
#[test]
fn ranks_that_disagree_about_the_proxy_fail_at_init_with_a_clear_error() {
    let (run, _sidecars) = loopback_job(&["sc_payload", "16", "1"], |r| {
        if r < 2 {
            vec![("WEFT_PROXY".into(), "0".into())]
        } else {
            Vec::new()
        }
    });
    assert!(!run.timed_out, "{}", run.dump());
    const WHY: &str = "every rank of a job must make the same choice";
    for r in &run.ranks {
        assert_ne!(r.code, Some(0), "rank {} must fail\n{}", r.rank, run.dump());
        // A rank still in bootstrap when rank 0 (serving the root) exits
        // fails there instead.
        assert!(
            r.stderr.contains(WHY) || r.stderr.contains("bootstrap"),
            "rank {}: {}",
            r.rank,
            r.stderr
        );
    }
    assert!(
        run.ranks.iter().any(|r| r.stderr.contains(WHY)),
        "{}",
        run.dump()
    );
    eprintln!("disagreeing ranks failed in {:.2?}", run.elapsed);
}

/// The proxy alone notices a cut link (no heartbeats configured): its
/// pings stop arriving, and after the timeout every rank fails with an
/// error naming the lost host.
#[test]
fn cutting_a_link_is_noticed_by_the_proxy_alone() {
    const TIMEOUT_MS: u64 = 1500;
    let Some(c) = cluster_full(2, PER_HOST, TIMEOUT_MS, false) else {
        return;
    };
    std::thread::scope(|sc| {
        let h = c.start_hang(sc);
        let (_, errs) = cut_the_link(&c, h, TIMEOUT_MS, "link cut, proxy alone");
        for (r, e) in errs.iter().enumerate() {
            assert!(e.contains("lost host"), "rank {r}: {e}");
        }
    });
}

/// No head-of-line blocking on the shared connection: while one channel
/// stalls with full rings (rank 2 receives rank 0's 32 MiB only after
/// ranks 1 and 3 are done, or after 20 s), ranks 1 and 3 — same two
/// sidecars, same connection — finish 300 all-reduces, and the stalled
/// transfer completes intact afterwards.
#[test]
fn a_stalled_channel_does_not_block_others_on_the_shared_connection() {
    let Some(c) = cluster(2, 5000) else {
        return;
    };
    let t0 = now_ms();
    let run = job::run(c.spec(&["sc_hol"], Duration::from_secs(120)));
    run.assert_success();
    let fact = |r: usize, k: &str| -> u128 { run.facts(r)[k].parse().unwrap() };
    let recv_start = fact(2, "recv_start_ms");
    // Rank 0's send (returned at once, eager) could be flushed only once
    // rank 2 received: it was stalled the whole time ranks 1 and 3 ran.
    let big_sent = fact(0, "big_sent_ms");
    assert!(big_sent >= recv_start, "{big_sent} < {recv_start}");
    for r in [1, 3] {
        let done = fact(r, "small_done_ms");
        // The same millisecond is possible: rank 2 starts right after the
        // marker written after this timestamp.
        assert!(
            done <= recv_start,
            "rank {r} finished at {done}, after the stalled receive began at {recv_start}"
        );
        eprintln!(
            "rank {r}: 300 all-reduces done {} ms after the job started, while the stalled channel waited",
            done - t0
        );
    }
    assert!(recv_start - t0 < 15_000, "ranks 1 and 3 never finished");
    for r in 0..4 {
        assert_eq!(common::num(&run.facts(r), "tcp_conns"), 0);
    }
    let (_, peers) = proxy_counters(&c.sidecars[0]);
    assert_eq!(peers[0].2, 1, "{peers:?}");
}
