//! The cross-host engine with ranks as real processes on network-namespace
//! hosts (`weft_tests::netns`: veth into a bridge, an address each): every
//! collective of the hierarchical plans checked against the reference, a
//! rank killed or stopped mid-transfer (every survivor fails naming it,
//! within the bound), hostile clients on the engine's listener, the same
//! through each host's `weft sidecar` proxy (`WEFT_CROSSHOST_NET=proxy`),
//! and (ignored, run by hand) the byte mover's throughput beside the TCP
//! transport's and through the proxy.
//! Skipped, with the reason printed, where `ip netns` is not permitted.

mod common;

use common::now_ms;
use std::path::PathBuf;
use std::time::{Duration, Instant};
use weft_tests::job::{self, JobRun, JobSpec};
use weft_tests::netns::Net;
use weft_tests::sidecar::Sidecar;

const BOOT_PORT: u16 = 7300;
/// The sidecars' peer port (their proxies' host connections).
const PEER_PORT: u16 = 7310;

fn worker() -> &'static std::path::Path {
    std::path::Path::new(env!("CARGO_BIN_EXE_net-worker"))
}

/// A directory the ranks and the test signal each other through.
struct Ctl(PathBuf);

impl Ctl {
    fn new(name: &str) -> Ctl {
        let d = std::env::temp_dir().join(format!("weft-crosshost-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        Ctl(d)
    }

    /// Waits (bounded) until every file of `names` exists; their contents.
    fn wait_all(&self, names: &[String]) -> Vec<String> {
        let t = Instant::now();
        names
            .iter()
            .map(|f| {
                loop {
                    if let Ok(s) = std::fs::read_to_string(self.0.join(f)) {
                        break s;
                    }
                    assert!(t.elapsed() < Duration::from_secs(90), "{f} never appeared");
                    std::thread::sleep(Duration::from_millis(10));
                }
            })
            .collect()
    }
}

impl Drop for Ctl {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A job of `placement[h]` ranks on host h (host-major rank order).
fn spec<'a>(net: &'a Net, placement: &[usize], args: &[&str], ctl: &Ctl) -> JobSpec<'a> {
    spec_with(net, placement, args, ctl, |_| Vec::new())
}

/// [`spec`], with `extra(rank)` added to each rank's environment.
fn spec_with<'a>(
    net: &'a Net,
    placement: &[usize],
    args: &[&str],
    ctl: &Ctl,
    extra: impl Fn(usize) -> Vec<(String, String)> + 'a,
) -> JobSpec<'a> {
    spec_full(net, placement, args, ctl, extra, true)
}

/// [`spec_with`]; without `listen`, no rank is told its address
/// (`WEFT_LISTEN_ADDR`): it finds it as in a pod, and these hosts have no
/// default route, as pods may not.
fn spec_full<'a>(
    net: &'a Net,
    placement: &[usize],
    args: &[&str],
    ctl: &Ctl,
    extra: impl Fn(usize) -> Vec<(String, String)> + 'a,
    listen: bool,
) -> JobSpec<'a> {
    let host_of: Vec<usize> = placement
        .iter()
        .enumerate()
        .flat_map(|(h, &k)| std::iter::repeat_n(h, k))
        .collect();
    let boot = format!("{}:{BOOT_PORT}", net.addrs[0]);
    let dir = ctl.0.display().to_string();
    JobSpec::new(worker(), host_of.len(), args)
        .env("WEFT_BOOTSTRAP", &boot)
        .env("NCCL_COMM_ID", &boot)
        .env("WEFT_TEST_CTL", &dir)
        .env("WEFT_PEER_TIMEOUT_MS", "10000")
        .per_rank(move |r| {
            let h = host_of[r];
            let mut v = vec![
                ("WEFT_TEST_NETNS".into(), net.hosts[h].clone()),
                ("WEFT_HOSTNAME".into(), net.hosts[h].clone()),
            ];
            if listen {
                v.push(("WEFT_LISTEN_ADDR".into(), net.addrs[h].clone()));
            }
            v.extend(extra(r));
            v
        })
        .timeout(Duration::from_secs(240))
}

/// A `weft sidecar` with its network proxy on each host of `net` (one job),
/// once each has heard from all the others.
fn sidecars(net: &Net) -> Vec<Sidecar> {
    let mut all: Vec<Sidecar> = Vec::new();
    for h in 0..net.hosts.len() {
        let peers: Vec<String> = (0..net.hosts.len())
            .filter(|&k| k != h)
            .map(|k| format!("{}:{PEER_PORT}", net.addrs[k]))
            .collect();
        let extra = [
            "--peer-listen".to_string(),
            format!("{}:{PEER_PORT}", net.addrs[h]),
            "--peers".to_string(),
            peers.join(","),
        ];
        let sc = Sidecar::start_with(common::cli(), Some(&net.hosts[h]), &extra, &[], all.first());
        all.push(sc);
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let t = Instant::now();
    for sc in &all {
        loop {
            let s = rt.block_on(weft::ras::fetch(sc.socket.clone())).unwrap();
            if s.hosts.len() == net.hosts.len() - 1 && s.hosts.iter().all(|h| h.state == "up") {
                break;
            }
            assert!(
                t.elapsed() < Duration::from_secs(20),
                "sidecars never saw each other: {:?}",
                s.hosts
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    all
}

/// [`spec`] with each rank attached to its host's sidecar (one of
/// `sidecars`, host-major as `placement`) and the engine's bytes through
/// the sidecars' proxies.
fn proxied_spec<'a>(
    net: &'a Net,
    placement: &[usize],
    args: &[&str],
    ctl: &Ctl,
    sidecars: &'a [Sidecar],
) -> JobSpec<'a> {
    let host_of: Vec<usize> = placement
        .iter()
        .enumerate()
        .flat_map(|(h, &k)| std::iter::repeat_n(h, k))
        .collect();
    spec_with(net, placement, args, ctl, move |r| {
        vec![(
            "WEFT_SIDECAR_SOCKET".into(),
            sidecars[host_of[r]].socket.display().to_string(),
        )]
    })
    .env("WEFT_JOB", &sidecars[0].job)
    .env("WEFT_JOB_SECRET", &sidecars[0].secret)
    .env("WEFT_PROXY", "1")
    .env("WEFT_CROSSHOST_NET", "proxy")
}

/// A `weft bench-rank --check` job (`what` it ran) succeeded and its table
/// says no value was wrong.
fn assert_checked(run: &JobRun, what: &str) {
    run.assert_success();
    assert!(
        run.ranks[0].stdout.contains("Out of bounds values : 0 OK"),
        "{what}: {}",
        run.dump()
    );
}

/// Every rank's output (stdout and stderr) contains each of `said`.
fn assert_every_rank_said(run: &JobRun, what: &str, said: &[&str]) {
    for (r, rank) in run.ranks.iter().enumerate() {
        let log = format!("{}{}", rank.stdout, rank.stderr);
        assert!(
            said.iter().all(|s| log.contains(s)),
            "{what}: rank {r} did not say {said:?}:\n{log}"
        );
    }
}

/// `net-worker exec weft bench-rank OP -n N` over `sizes` (min, max,
/// factor), one warm-up and `iters` timed calls a size, `--check` when
/// `check`.
fn bench_rank<'a>(
    op: &'a str,
    n: &'a str,
    sizes: [&'a str; 3],
    iters: &'a str,
    check: bool,
) -> Vec<&'a str> {
    let [b, e, f] = sizes;
    let mut v = vec![
        "exec",
        env!("CARGO_BIN_EXE_weft-cli"),
        "bench-rank",
        op,
        "-n",
        n,
        "-b",
        b,
        "-e",
        e,
        "-f",
        f,
        "-w",
        "1",
        "-i",
        iters,
    ];
    if check {
        v.push("--check");
    }
    v
}

#[test]
fn every_collective_across_namespace_hosts_matches_the_reference() {
    for placement in [vec![2, 2], vec![1, 1, 1], vec![2, 1]] {
        let Some(net) = common::netns_hosts(placement.len()) else {
            return;
        };
        let ctl = Ctl::new("coll");
        let seed = common::seed().to_string();
        let t = Instant::now();
        let run = job::run(spec(&net, &placement, &["coll", &seed], &ctl));
        run.assert_success();
        let checked = common::num(&run.facts(0), "checked");
        eprintln!(
            "hosts of {placement:?} ranks: {checked} checked operations per rank in {:.1?}",
            t.elapsed()
        );
        assert!(checked > 100);
    }
}

/// The communicator's own collectives across namespace hosts on the
/// cross-host engine (`WEFT_CROSSHOST_MIN_BYTES`, `comm/cross_engine.rs`):
/// every collective the engine takes (and broadcast and reduce, which stay
/// flat), at sizes below and above the threshold, checked on random data
/// by `weft bench-rank --check`, on
/// 2 hosts x 2 ranks and 3 hosts x 1 (a threshold of 16 KiB), and on 2
/// hosts x 1 with a threshold of 1 byte (the collectives that build the
/// engine qualify too: they must take the flat path, not wait for the
/// engine they build); each rank logs that the engine runs its large
/// collectives.
#[test]
fn communicator_collectives_across_hosts_run_on_the_engine_and_check() {
    for (placement, min) in [
        (vec![2, 2], "16384"),
        (vec![1, 1, 1], "16384"),
        (vec![1, 1], "1"),
    ] {
        let Some(net) = common::netns_hosts(placement.len()) else {
            return;
        };
        let ctl = Ctl::new("engine");
        let n = placement.iter().sum::<usize>().to_string();
        for op in [
            "all_reduce",
            "all_gather",
            "reduce_scatter",
            "alltoall",
            "broadcast",
            "reduce",
        ] {
            let args = bench_rank(op, &n, ["4K", "1M", "16"], "2", true);
            let run = job::run(
                spec(&net, &placement, &args, &ctl)
                    .env("WEFT_PROXY", "0")
                    .env("WEFT_CROSSHOST_MIN_BYTES", min)
                    .env("WEFT_DEBUG", "INFO"),
            );
            assert_checked(&run, &format!("{op} on {placement:?}"));
            let said = format!("{}{}", run.ranks[0].stdout, run.ranks[0].stderr);
            eprintln!(
                "{op} on {placement:?}: checked; rank 0: {}",
                said.lines()
                    .find(|l| l.contains("cross-host engine"))
                    .unwrap_or("(no engine line)")
            );
            // Broadcast and reduce stay flat (the bench's own small
            // all-reduces may still build the engine at a 1-byte threshold).
            if matches!(op, "broadcast" | "reduce") {
                continue;
            }
            assert_every_rank_said(
                &run,
                &format!("{op} on {placement:?}"),
                &["run on the cross-host engine"],
            );
        }
    }
}

/// Jobs whose ranks have more remote ranks than `WEFT_CROSSHOST_MAX_PEERS`
/// on hosts of equal size: with 1 on 2 hosts x 2 and 2 on 3 hosts x 2 the
/// engine connects each rank to its rail only (one rank per other host) and
/// runs every collective on rails; with 1 on 4 hosts x 1 (3 on the rail)
/// to its two ring neighbours only, all-to-all then on the flat path. Every
/// collective checks on random data, and every rank says how it connected.
#[test]
fn an_engine_that_reaches_its_rail_or_ring_only_runs_on_rails_and_checks() {
    for (placement, max, says) in [
        (vec![2, 2], "1", "to 1 remote rank(s): its rail only"),
        (vec![2, 2, 2], "2", "to 2 remote rank(s): its rail only"),
        (
            vec![1, 1, 1, 1],
            "1",
            "to 2 remote rank(s): its ring neighbours on its rail only",
        ),
    ] {
        let Some(net) = common::netns_hosts(placement.len()) else {
            return;
        };
        let ctl = Ctl::new("rails");
        let n = placement.iter().sum::<usize>().to_string();
        for op in ["all_reduce", "all_gather", "reduce_scatter", "alltoall"] {
            let args = bench_rank(op, &n, ["4K", "1M", "16"], "2", true);
            let run = job::run(
                spec(&net, &placement, &args, &ctl)
                    .env("WEFT_PROXY", "0")
                    .env("WEFT_CROSSHOST_MIN_BYTES", "16384")
                    .env("WEFT_CROSSHOST_MAX_PEERS", max)
                    .env("WEFT_DEBUG", "INFO"),
            );
            assert_checked(&run, &format!("{op} on {placement:?}"));
            assert_every_rank_said(&run, &format!("{op} on {placement:?}"), &[says]);
            eprintln!("{op} on {placement:?} (WEFT_CROSSHOST_MAX_PEERS={max}, {says}): checked");
        }
    }
}

/// Ranks told no address of their own (`WEFT_LISTEN_ADDR` unset, as in a
/// pod) on hosts without a default route: the engine's byte mover
/// advertises the address the communicator's peers reach, not loopback. On
/// a real cluster it advertised 127.0.0.1 and every rank of another pod
/// dialled its own loopback (the engine was never built across pods).
#[test]
fn the_engine_connects_across_hosts_without_a_listen_address() {
    let Some(net) = common::netns_hosts(2) else {
        return;
    };
    let ctl = Ctl::new("nolisten");
    let args = bench_rank("all_reduce", "4", ["64K", "1M", "16"], "2", true);
    let run = job::run(
        spec_full(&net, &[2, 2], &args, &ctl, |_| Vec::new(), false)
            .env("WEFT_PROXY", "0")
            .env("WEFT_CROSSHOST_MIN_BYTES", "16384")
            .env("WEFT_DEBUG", "INFO"),
    );
    assert_checked(&run, "all_reduce without WEFT_LISTEN_ADDR");
    assert_every_rank_said(
        &run,
        "all_reduce without WEFT_LISTEN_ADDR",
        &["run on the cross-host engine"],
    );
}

/// The communicator's engine with its bytes through each host's sidecar
/// proxy (`WEFT_CROSSHOST_NET=proxy`: `net/proxy/`): the collectives the
/// engine takes, below and above a 16 KiB threshold, checked on random data
/// by `weft bench-rank --check`, on 2 hosts x 2 ranks (rails: two proxied
/// channels per host pair at once, local phases over shared memory) and 3
/// hosts x 1; every rank logs that its engine moves through the proxy.
#[test]
fn communicator_collectives_on_the_engine_through_the_sidecar_proxy_check() {
    for (placement, ops) in [
        (
            vec![2, 2],
            &["all_reduce", "all_gather", "reduce_scatter", "alltoall"][..],
        ),
        (vec![1, 1, 1], &["all_reduce", "alltoall"][..]),
    ] {
        let Some(net) = common::netns_hosts(placement.len()) else {
            return;
        };
        let sc = sidecars(&net);
        let ctl = Ctl::new("proxied");
        let n = placement.iter().sum::<usize>().to_string();
        for op in ops {
            let args = bench_rank(op, &n, ["4K", "1M", "16"], "2", true);
            let run = job::run(
                proxied_spec(&net, &placement, &args, &ctl, &sc)
                    .env("WEFT_CROSSHOST_MIN_BYTES", "16384")
                    .env("WEFT_DEBUG", "INFO"),
            );
            assert_checked(&run, &format!("{op} on {placement:?}"));
            assert_every_rank_said(
                &run,
                &format!("{op} on {placement:?}"),
                &[
                    "run on the cross-host engine",
                    "between hosts through the sidecar proxy",
                ],
            );
            eprintln!("{op} on {placement:?} through the sidecar proxy: checked");
        }
    }
}

/// A rank that cannot build its part of the engine (here: a bad
/// `WEFT_NET_SOCKETS` on rank 1 only) keeps every rank on the flat path:
/// the collectives still check, no rank says it runs on the engine, and
/// rank 1 says why.
#[test]
fn one_rank_without_an_engine_keeps_every_rank_on_the_flat_path() {
    let Some(net) = common::netns_hosts(2) else {
        return;
    };
    let ctl = Ctl::new("noengine");
    let args = bench_rank("all_reduce", "2", ["64K", "1M", "16"], "2", true);
    let bad = |r: usize| {
        if r == 1 {
            vec![("WEFT_NET_SOCKETS".to_string(), "0".to_string())]
        } else {
            Vec::new()
        }
    };
    let run = job::run(
        spec_with(&net, &[1, 1], &args, &ctl, bad)
            .env("WEFT_PROXY", "0")
            .env("WEFT_CROSSHOST_MIN_BYTES", "16384")
            .env("WEFT_DEBUG", "INFO"),
    );
    assert_checked(&run, "all_reduce");
    for rank in &run.ranks {
        let log = format!("{}{}", rank.stdout, rank.stderr);
        assert!(
            !log.contains("run on the cross-host engine"),
            "{}",
            run.dump()
        );
    }
    let why = format!("{}{}", run.ranks[1].stdout, run.ranks[1].stderr);
    assert!(why.contains("was not built"), "{}", run.dump());
}

/// `WEFT_CROSSHOST_NET=proxy` where it cannot hold: with no sidecar at
/// all, and on one rank only of a job whose sidecars proxy (the others
/// `tcp`: their handles cannot meet). Every rank keeps the flat path, the
/// collectives check, and a rank that could not build its part says why.
#[test]
fn a_proxy_byte_mover_that_cannot_be_built_keeps_every_rank_on_the_flat_path() {
    let Some(net) = common::netns_hosts(2) else {
        return;
    };
    let args = bench_rank("all_reduce", "4", ["64K", "1M", "16"], "2", true);
    let check = |run: &JobRun, why: &str| {
        assert_checked(run, "all_reduce");
        let logs: Vec<String> = run
            .ranks
            .iter()
            .map(|r| format!("{}{}", r.stdout, r.stderr))
            .collect();
        assert!(
            logs.iter()
                .all(|l| !l.contains("run on the cross-host engine")),
            "{}",
            run.dump()
        );
        let said = logs
            .iter()
            .flat_map(|l| l.lines())
            .find(|l| l.contains("was not built") && l.contains(why));
        assert!(said.is_some(), "no rank said why ({why}):\n{}", run.dump());
        eprintln!("flat path kept: {}", said.unwrap_or_default());
    };
    // No sidecar anywhere.
    let ctl = Ctl::new("noproxy");
    let run = job::run(
        spec(&net, &[2, 2], &args, &ctl)
            .env("WEFT_CROSSHOST_NET", "proxy")
            .env("WEFT_CROSSHOST_MIN_BYTES", "16384")
            .env("WEFT_DEBUG", "INFO"),
    );
    check(&run, "no sidecar proxy is offered");
    // Sidecars, but rank 3 alone asks for the proxy.
    let sc = sidecars(&net);
    let ctl = Ctl::new("mixedproxy");
    let host_of = [0, 0, 1, 1];
    let run = job::run(
        spec_with(&net, &[2, 2], &args, &ctl, |r| {
            vec![
                (
                    "WEFT_SIDECAR_SOCKET".into(),
                    sc[host_of[r]].socket.display().to_string(),
                ),
                (
                    "WEFT_CROSSHOST_NET".into(),
                    if r == 3 { "proxy" } else { "tcp" }.into(),
                ),
            ]
        })
        .env("WEFT_JOB", &sc[0].job)
        .env("WEFT_JOB_SECRET", &sc[0].secret)
        .env("WEFT_CROSSHOST_MIN_BYTES", "16384")
        .env("WEFT_DEBUG", "INFO"),
    );
    check(&run, "connect");
}

/// Every survivor's error and when it came.
fn survivors(run: &JobRun, victim: usize) -> Vec<(usize, String, u128)> {
    (0..run.ranks.len())
        .filter(|&r| r != victim)
        .map(|r| {
            let f = run.facts(r);
            let e = f
                .get("error")
                .cloned()
                .unwrap_or_else(|| panic!("rank {r} reported no error:\n{}", run.dump()));
            (r, e.replace('_', " "), common::num(&f, "at_ms") as u128)
        })
        .collect()
}

/// Starts a loop of all-reduces on `placement` (the worker's `mode`:
/// `loop` on the engine itself, `commloop` through the communicator with
/// `WEFT_CROSSHOST_MIN_BYTES`), waits until every rank ran one, signals
/// `victim` with `sig`, and checks that every survivor fails naming it
/// within `bound` of the signal.
fn fault(
    mode: &str,
    placement: &[usize],
    victim: usize,
    sig: i32,
    timeout_ms: u64,
    bound: Duration,
) {
    fault_on(mode, placement, victim, sig, timeout_ms, bound, false)
}

/// [`fault`], with the engine's bytes through each host's sidecar proxy
/// when `via_proxy`.
fn fault_on(
    mode: &str,
    placement: &[usize],
    victim: usize,
    sig: i32,
    timeout_ms: u64,
    bound: Duration,
    via_proxy: bool,
) {
    let Some(net) = common::netns_hosts(placement.len()) else {
        return;
    };
    let sc = if via_proxy {
        sidecars(&net)
    } else {
        Vec::new()
    };
    let ctl = Ctl::new(if sig == libc::SIGKILL { "kill" } else { "stop" });
    let n: usize = placement.iter().sum();
    let timeout = timeout_ms.to_string();
    let args = [mode, "2000000"];
    let spec = if via_proxy {
        proxied_spec(&net, placement, &args, &ctl, &sc)
    } else {
        spec(&net, placement, &args, &ctl)
    }
    .env("WEFT_TIMEOUT_MS", &timeout)
    .env("WEFT_CROSSHOST_MIN_BYTES", "65536");
    let job = job::spawn(spec);
    ctl.wait_all(&(0..n).map(|r| format!("running.{r}")).collect::<Vec<_>>());
    std::thread::sleep(Duration::from_millis(100));
    let at = now_ms();
    job.signal(victim, sig);
    if sig == libc::SIGSTOP {
        // The stopped rank never ends by itself: kill it once the survivors
        // had their bound to notice.
        std::thread::sleep(bound + Duration::from_secs(1));
        job.signal(victim, libc::SIGKILL);
    }
    let run = job.wait();
    let seen = survivors(&run, victim);
    for (r, e, t) in &seen {
        let after = Duration::from_millis(t.saturating_sub(at) as u64);
        eprintln!("rank {r} after {after:?}: {e}");
    }
    for (r, e, t) in seen {
        let after = Duration::from_millis(t.saturating_sub(at) as u64);
        assert!(
            e.contains(&format!("rank {victim} ")),
            "rank {r}'s error does not name rank {victim}: {e}"
        );
        assert!(
            after <= bound,
            "rank {r} took {after:?} (bound {bound:?}): {e}"
        );
    }
}

#[test]
fn a_rank_killed_mid_transfer_fails_every_survivor_naming_it() {
    // Rank 2 is local rank 0 of host 1: its host's survivor meets it in a
    // local phase, the others over the network.
    for mode in ["loop", "commloop"] {
        fault(mode, &[2, 2], 2, libc::SIGKILL, 0, Duration::from_secs(3));
        fault(
            mode,
            &[1, 1, 1],
            1,
            libc::SIGKILL,
            0,
            Duration::from_secs(3),
        );
    }
}

#[test]
fn a_rank_stopped_mid_transfer_fails_every_survivor_naming_it() {
    let timeout = 2000;
    let bound = Duration::from_millis(timeout) + Duration::from_secs(3);
    for mode in ["loop", "commloop"] {
        fault(mode, &[2, 2], 2, libc::SIGSTOP, timeout, bound);
        fault(mode, &[1, 1, 1], 1, libc::SIGSTOP, timeout, bound);
    }
}

/// Through the sidecars' proxies: a rank SIGKILLed or SIGSTOPped while the
/// communicator's engine moves its all-reduces through the proxy fails
/// every survivor naming it, within the same bounds as direct TCP.
#[test]
fn a_rank_killed_or_stopped_fails_every_survivor_through_the_proxy() {
    fault_on(
        "commloop",
        &[2, 2],
        2,
        libc::SIGKILL,
        0,
        Duration::from_secs(3),
        true,
    );
    let timeout = 2000;
    let bound = Duration::from_millis(timeout) + Duration::from_secs(3);
    fault_on("commloop", &[2, 2], 2, libc::SIGSTOP, timeout, bound, true);
}

/// A host's sidecar SIGKILLed while the communicator's engine moves its
/// all-reduces through the proxies: every rank fails within 3 s, its error
/// naming the lost sidecar or the host behind it (the ranks of that host
/// see their link close; the others hear it from their own sidecar, whose
/// connection to the dead one dropped).
#[test]
fn a_sidecar_killed_under_the_proxied_engine_fails_every_rank() {
    let Some(net) = common::netns_hosts(2) else {
        return;
    };
    let sc = sidecars(&net);
    let ctl = Ctl::new("sckill");
    let spec = proxied_spec(&net, &[2, 2], &["commloop", "2000000"], &ctl, &sc)
        .env("WEFT_CROSSHOST_MIN_BYTES", "65536");
    let job = job::spawn(spec);
    ctl.wait_all(&(0..4).map(|r| format!("running.{r}")).collect::<Vec<_>>());
    std::thread::sleep(Duration::from_millis(100));
    let at = now_ms();
    sc[1].signal(libc::SIGKILL);
    let run = job.wait();
    for (r, e, t) in survivors(&run, usize::MAX) {
        let after = Duration::from_millis(t.saturating_sub(at) as u64);
        eprintln!("rank {r} after {after:?}: {e}");
        assert!(
            e.contains("sidecar") || net.hosts.iter().any(|h| e.contains(h.as_str())),
            "rank {r}'s error names neither the sidecar nor a host: {e}"
        );
        assert!(
            after <= Duration::from_secs(3),
            "rank {r} took {after:?}: {e}"
        );
    }
}

/// An abort of the communicator (from another thread) releases a call
/// waiting in its cross-host engine for a rank that never joins: every
/// aborting rank's call returns an error within a second.
#[test]
fn an_abort_releases_a_call_waiting_in_the_communicators_engine() {
    let Some(net) = common::netns_hosts(2) else {
        return;
    };
    let ctl = Ctl::new("abort");
    let run = job::run(
        spec(&net, &[2, 1], &["commabort"], &ctl).env("WEFT_CROSSHOST_MIN_BYTES", "65536"),
    );
    run.assert_success();
    for r in 0..2 {
        let f = run.facts(r);
        let after = common::num(&f, "after_ms");
        eprintln!("rank {r}: {after} ms after its abort: {}", f["error"]);
        assert!(after < 1000, "rank {r}: {after} ms:\n{}", run.dump());
    }
}

#[test]
fn hostile_clients_on_the_engine_listener_are_refused_and_the_job_goes_on() {
    use std::io::{Read, Write};
    let Some(net) = common::netns_hosts(2) else {
        return;
    };
    let ctl = Ctl::new("hostile");
    let job = job::spawn(spec(&net, &[1, 1], &["hostile", "20"], &ctl));
    let hex = ctl.wait_all(&["handle.0".to_string()]).remove(0);
    let bytes: Vec<u8> = (0..hex.len() / 2)
        .map(|i| u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap())
        .collect();
    let handle = libcomm::net::ConnectHandle::from_bytes(&bytes).unwrap();
    let target = libcomm::net::tcp::wire::Handle::decode(&handle)
        .unwrap()
        .addr;
    // From host 1: garbage, a frame header claiming 4 GiB, a hello MAC'd
    // with the wrong secret, and silent connections; each must be closed.
    weft_tests::netns::within(&net.hosts[1], move || {
        let closed = |bytes: &[u8]| {
            let mut c = std::net::TcpStream::connect(target).unwrap();
            c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            let _ = c.write_all(bytes);
            let t = Instant::now();
            let mut sink = Vec::new();
            let _ = c.read_to_end(&mut sink);
            assert!(
                t.elapsed() < Duration::from_secs(10),
                "a hostile connection was kept"
            );
        };
        closed(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n");
        let mut huge = *b"WFTB\x01\x05\0\0\xff\xff\xff\xff\0\0\0\0";
        huge[8..12].copy_from_slice(&u32::MAX.to_be_bytes());
        closed(&huge);
        let silent: Vec<_> = (0..50)
            .map(|_| std::net::TcpStream::connect(target).unwrap())
            .collect();
        let wrong = libcomm::net::tcp::TcpNet::new(libcomm::net::tcp::TcpConfig {
            bind: "10.200.0.2".parse().unwrap(),
            advertise: "10.200.0.2".parse().unwrap(),
            ..libcomm::net::tcp::TcpConfig::loopback([3; 32], 1)
        })
        .unwrap();
        use libcomm::net::Net;
        let me = libcomm::net::Peer { rank: 0, stream: 0 };
        let r = wrong.connect(
            0,
            &handle,
            me,
            Instant::now() + Duration::from_secs(10),
            &|| false,
        );
        let e = r.err().expect("refused");
        assert!(e.to_string().contains("authentication failed"), "{e}");
        drop(silent);
    });
    std::fs::write(ctl.0.join("go"), b"").unwrap();
    let run = job.wait();
    run.assert_success();
    let f = run.facts(0);
    assert_eq!(common::num(&f, "rounds"), 20);
    assert!(common::num(&f, "refused") >= 2, "{f:?}");
    assert!(common::num(&f, "unauthenticated") >= 1, "{f:?}");
}

/// One rank per host on 2 namespace hosts: the byte mover's throughput with
/// 1, 2, 4 and 8 sockets (GB/s one way), the engine's all-reduce and `weft
/// bench`'s host all-reduce over the direct TCP transport (bus bandwidth:
/// for 2 ranks the bytes each way per second, comparable), in one run (docs/PERFORMANCE.md,
/// "Cross-host byte mover"). Release build recommended:
/// `cargo nextest run --release -p weft-tests --test crosshost measure --run-ignored only --no-capture`
#[test]
#[ignore = "a measurement, run by hand"]
fn measure_byte_mover_beside_the_tcp_transport() {
    let Some(net) = common::netns_hosts(2) else {
        return;
    };
    let ctl = Ctl::new("bw");
    let sizes: Vec<String> = [1usize << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let mut args = vec!["bw", "4"];
    args.extend(sizes.iter().map(String::as_str));
    let mut rows: Vec<(String, Vec<String>)> = Vec::new();
    for sockets in ["1", "2", "4", "8"] {
        let run = job::run(spec(&net, &[1, 1], &args, &ctl).env("WEFT_NET_SOCKETS", sockets));
        run.assert_success();
        let f = run.facts(0);
        rows.push((
            format!("byte mover, {sockets} socket(s)"),
            sizes
                .iter()
                .map(|s| f[&format!("gbs_{s}")].clone())
                .collect(),
        ));
    }
    let mut args = vec!["arbw", "4"];
    args.extend(sizes.iter().map(String::as_str));
    let run = job::run(spec(&net, &[1, 1], &args, &ctl));
    run.assert_success();
    let f = run.facts(0);
    rows.push((
        format!(
            "cross-host engine all_reduce busbw ({} sockets)",
            libcomm::net::tcp::DEFAULT_SOCKETS
        ),
        sizes
            .iter()
            .map(|s| f[&format!("busbw_{s}")].clone())
            .collect(),
    ));
    let bench = bench_rank("all_reduce", "2", ["1M", "256M", "4"], "4", false);
    // `weft bench`'s all-reduce: the flat host path over the TCP transport,
    // then the communicator's own cross-host engine (`WEFT_CROSSHOST_MIN_BYTES`).
    for (name, engine) in [
        ("transport/tcp.rs all_reduce busbw (weft bench)", None),
        (
            "communicator all_reduce on its engine (weft bench, WEFT_CROSSHOST_MIN_BYTES=1)",
            Some("1"),
        ),
    ] {
        let mut spec = spec(&net, &[1, 1], &bench, &ctl).env("WEFT_PROXY", "0");
        if let Some(min) = engine {
            spec = spec.env("WEFT_CROSSHOST_MIN_BYTES", min);
        }
        let run = job::run(spec);
        run.assert_success();
        let busbw: Vec<String> = run.ranks[0]
            .stdout
            .lines()
            .filter_map(|l| {
                let c: Vec<&str> = l.split_whitespace().collect();
                (c.len() > 8 && c[0].parse::<usize>().is_ok()).then(|| c[7].to_string())
            })
            .collect();
        rows.push((name.into(), busbw));
    }
    println!(
        "| path | {} |",
        sizes
            .iter()
            .map(|s| format!("{} MiB", s.parse::<usize>().unwrap() >> 20))
            .collect::<Vec<_>>()
            .join(" | ")
    );
    println!("|---|{}", "---:|".repeat(sizes.len()));
    for (name, v) in rows {
        println!("| {name} | {} |", v.join(" | "));
    }
}

/// The communicator's all-reduce with each host's sidecar attached, on 2
/// hosts x 1 and 2 x 2 ranks: the flat path through the proxy (what runs
/// by default in a pod for host memory), the engine over the rank's own TCP
/// connections (`WEFT_CROSSHOST_NET=tcp`, the default), and the engine
/// through the proxy (`WEFT_CROSSHOST_NET=proxy`); `weft bench`'s
/// out-of-place bus bandwidth, GB/s (docs/PERFORMANCE.md, "The cross-host
/// engine through the sidecar proxy"). Release build recommended:
/// `cargo nextest run --release -p weft-tests --test crosshost measure_engine --run-ignored only --no-capture`
#[test]
#[ignore = "a measurement, run by hand"]
fn measure_engine_through_the_proxy_beside_its_own_tcp() {
    for placement in [vec![1, 1], vec![2, 2]] {
        let Some(net) = common::netns_hosts(placement.len()) else {
            return;
        };
        let sc = sidecars(&net);
        let ctl = Ctl::new("proxybw");
        let n = placement.iter().sum::<usize>().to_string();
        let bench = bench_rank("all_reduce", &n, ["64K", "256M", "4"], "4", false);
        let mut rows: Vec<(&str, Vec<(String, String)>)> = Vec::new();
        for (name, min, via) in [
            ("flat path through the proxy", None, "proxy"),
            ("engine, its own TCP", Some("1"), "tcp"),
            ("engine through the proxy", Some("1"), "proxy"),
        ] {
            let mut spec =
                proxied_spec(&net, &placement, &bench, &ctl, &sc).env("WEFT_CROSSHOST_NET", via);
            if let Some(min) = min {
                spec = spec.env("WEFT_CROSSHOST_MIN_BYTES", min);
            }
            let run = job::run(spec);
            run.assert_success();
            let cells = run.ranks[0]
                .stdout
                .lines()
                .filter_map(|l| {
                    let c: Vec<&str> = l.split_whitespace().collect();
                    (c.len() > 8 && c[0].parse::<usize>().is_ok())
                        .then(|| (c[0].to_string(), c[7].to_string()))
                })
                .collect();
            rows.push((name, cells));
        }
        println!("{placement:?} ranks per host, all_reduce busbw GB/s");
        println!(
            "| path | {} |",
            rows[0]
                .1
                .iter()
                .map(|(b, _)| b.clone())
                .collect::<Vec<_>>()
                .join(" | ")
        );
        println!("|---|{}", "---:|".repeat(rows[0].1.len()));
        for (name, v) in &rows {
            println!(
                "| {name} | {} |",
                v.iter()
                    .map(|c| c.1.clone())
                    .collect::<Vec<_>>()
                    .join(" | ")
            );
        }
    }
}
