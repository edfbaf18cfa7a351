//! Device collectives across hosts, on one GPU: 2 simulated hosts x 2 ranks,
//! each rank a process of this test binary with its host's
//! `WEFT_HOSTNAME` (`sim-a`: ranks 0, 1; `sim-b`: ranks 2, 3; round-robin
//! with `WEFT_XHOST_HOSTS=interleaved`), all on GPU 0.
//! Ranks of different host identities never map each other's memory, so
//! these run the cross-host path (`libcomm/src/cuda/proxy.rs`) exactly as
//! two machines would, with loopback TCP between the halves.
//!
//! - every collective, send/recv and all-to-all on random data of odd
//!   sizes, checked element by element against a reference every rank
//!   computes from the inputs' seed;
//! - the calling thread's time inside a 256 MiB `ncclAllReduce` (< 100 us:
//!   the call only enqueues), one process per GPU as pods run (2 hosts x 1
//!   on 2 GPUs, 2 x 2 on 4; it needs 2 GPUs or more);
//! - the same staged whole (`WEFT_CROSSHOST_HIER=0`): with two ranks a
//!   host, all-reduce, all-gather, reduce-scatter and broadcast otherwise
//!   run hierarchically (`libcomm/src/comm/hier.rs`: the local part on the
//!   GPU kernels, the rail through pinned memory);
//! - SIGKILL and SIGSTOP of rank 3 (the other host from ranks 0, 1) during
//!   device all-reduces, hierarchical and staged whole: every survivor's stream drains and its
//!   `ncclCommGetAsyncError` names rank 3 within a bound.
//!
//! The parent test spawns the ranks (this binary again, running the
//! ignored `rank_process` test with `WEFT_XHOST_SCENARIO` set) and reads
//! their `@ key=value` lines. `WEFT_XHOST_GPU_PER_HOST=1` (2 GPUs) puts
//! each simulated host on its own GPU. On the GPU machine:
//! `cargo test -p weft-nccl --test cuda_crosshost -- --ignored --test-threads=1`.

use libcomm::cuda::{self, mem};
use nccl::api::*;
use std::ffi::{CStr, c_void};
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

const I32: i32 = 2;
const F32: i32 = 7;
const F64: i32 = 8;
const BF16: i32 = 9;
const SUM: i32 = 0;
const PROD: i32 = 1;
const MAX: i32 = 2;
const MIN: i32 = 3;
const AVG: i32 = 4;
/// Ranks of a scenario unless it says otherwise (`WEFT_XHOST_NRANKS`).
const NRANKS: usize = 4;
const TIMEOUT_MS: u64 = 3000;

/// The first half of the ranks on one simulated host, the rest on the
/// other; with `WEFT_XHOST_HOSTS=interleaved` (in this process or in
/// `env`), round-robin: even ranks on one, odd ones on the other.
fn host_index(rank: usize, n: usize, env: &[(&str, &str)]) -> usize {
    let interleaved = env
        .iter()
        .find(|(k, _)| *k == "WEFT_XHOST_HOSTS")
        .map(|(_, v)| v.to_string())
        .or_else(|| std::env::var("WEFT_XHOST_HOSTS").ok())
        .is_some_and(|v| v == "interleaved");
    if interleaved {
        rank % 2
    } else {
        usize::from(rank >= n / 2)
    }
}

fn host_of(rank: usize, n: usize, env: &[(&str, &str)]) -> &'static str {
    ["sim-a", "sim-b"][host_index(rank, n, env)]
}

/// Rank `q`'s input element `i` for `seed`: a small integer (sums are exact
/// in any order), from splitmix64.
fn value(seed: u64, q: usize, i: usize) -> f32 {
    let mut z = seed
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add(((q as u64) << 40) ^ i as u64);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    (z % 17) as f32 - 8.0
}

fn now_ms() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis()
}

// ---------------------------------------------------------------- parent

/// The rank processes of one scenario, their `@` lines on a channel.
struct Ranks {
    children: Vec<Child>,
    lines: mpsc::Receiver<(usize, String)>,
    /// Every rank's standard error (its log lines), as they come.
    logs: std::sync::Arc<std::sync::Mutex<Vec<(usize, String)>>>,
}

impl Ranks {
    /// With `env` added to every rank's environment (`WEFT_XHOST_NRANKS`
    /// there: that many ranks, else [`NRANKS`]).
    fn start_with(scenario: &str, env: &[(&str, &str)]) -> Ranks {
        let n = env
            .iter()
            .find(|(k, _)| *k == "WEFT_XHOST_NRANKS")
            .map_or(NRANKS, |(_, v)| v.parse().unwrap());
        let mut id = std::mem::MaybeUninit::<ncclUniqueId>::zeroed();
        assert_eq!(unsafe { pncclGetUniqueId(id.as_mut_ptr()) }, 0);
        let id = unsafe { id.assume_init() };
        let hex: String = id
            .internal
            .iter()
            .map(|&c| format!("{:02x}", c as u8))
            .collect();
        let (tx, lines) = mpsc::channel();
        let logs = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let exe = std::env::current_exe().unwrap();
        let children = (0..n)
            .map(|r| {
                let mut c = Command::new(&exe)
                    .args(["--exact", "rank_process", "--ignored", "--nocapture"])
                    .env("WEFT_XHOST_SCENARIO", scenario)
                    .env("WEFT_XHOST_RANK", r.to_string())
                    .env("WEFT_XHOST_ID", &hex)
                    .env("WEFT_HOSTNAME", host_of(r, n, env))
                    .env("WEFT_TIMEOUT_MS", TIMEOUT_MS.to_string())
                    .envs(env.iter().copied())
                    .stdout(Stdio::piped())
                    .stderr(Stdio::piped())
                    .spawn()
                    .expect("spawning a rank");
                let err = c.stderr.take().unwrap();
                let log = logs.clone();
                std::thread::spawn(move || {
                    for line in BufReader::new(err).lines().map_while(Result::ok) {
                        eprintln!("[rank {r}] {line}");
                        log.lock().unwrap().push((r, line));
                    }
                });
                let out = c.stdout.take().unwrap();
                let tx = tx.clone();
                std::thread::spawn(move || {
                    for line in BufReader::new(out).lines().map_while(Result::ok) {
                        println!("[rank {r}] {line}");
                        if let Some(l) = line.strip_prefix("@ ") {
                            let _ = tx.send((r, l.to_string()));
                        }
                    }
                });
                c
            })
            .collect();
        Ranks {
            children,
            lines,
            logs,
        }
    }

    /// The next `@` line, or None after `within`.
    fn next(&self, within: Duration) -> Option<(usize, String)> {
        self.lines.recv_timeout(within).ok()
    }

    /// Waits for every rank in `which` to exit, up to `within`; their codes.
    fn wait(&mut self, which: &[usize], within: Duration) -> Vec<Option<i32>> {
        let until = Instant::now() + within;
        let mut codes = vec![None; self.children.len()];
        loop {
            let mut all = true;
            for &r in which {
                if codes[r].is_none() {
                    match self.children[r].try_wait() {
                        Ok(Some(st)) => codes[r] = Some(st.code().unwrap_or(-1)),
                        _ => all = false,
                    }
                }
            }
            if all || Instant::now() > until {
                return which.iter().map(|&r| codes[r]).collect();
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn signal(&self, rank: usize, sig: i32) {
        unsafe { libc::kill(self.children[rank].id() as i32, sig) };
    }
}

impl Drop for Ranks {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn gpu_or_panic(name: &str) {
    if let Err(e) = cuda::driver() {
        panic!("{name} needs a CUDA GPU: {e}");
    }
    assert!(cuda::device_count() > 0, "{name} needs a CUDA GPU");
}

#[test]
#[ignore = "needs a GPU: cargo test -p weft-nccl --test cuda_crosshost -- --ignored --test-threads=1"]
fn every_collective_across_two_simulated_hosts_matches_the_reference() {
    gpu_or_panic("every_collective_across_two_simulated_hosts_matches_the_reference");
    let ranks = collectives_checked_with(&[
        ("NCCL_DEBUG", "INFO"),
        ("WEFT_CROSSHOST_HIER_MIN_BYTES", "0"),
    ]);
    // Two ranks a host: all-reduce, all-gather, reduce-scatter and
    // broadcast ran hierarchically (the local part on the GPU kernels), at
    // every size (the threshold at 0).
    said_hierarchical(
        &ranks,
        NRANKS,
        &["all_reduce", "all_gather", "reduce_scatter", "broadcast"],
    );
    // The 16 MiB broadcast's rail parts (8 MiB, one rank a host each)
    // pipelined: sends read the root's pieces as they landed, the others
    // copied pieces out as they arrived (`WEFT_CROSSHOST_PIPELINE`).
    let logs = ranks.logs.lock().unwrap();
    for host in ["sim-a", "sim-b"] {
        assert!(
            logs.iter()
                .any(|(who, l)| host_of(*who, NRANKS, &[]) == host
                    && l.contains("a device job pipelined")),
            "no rank on {host} ran a pipelined job"
        );
    }
}

/// Every one of `n` ranks logged that each of `colls` ran hierarchically.
fn said_hierarchical(ranks: &Ranks, n: usize, colls: &[&str]) {
    let logs = ranks.logs.lock().unwrap();
    for r in 0..n {
        for coll in colls {
            assert!(
                logs.iter().any(|(who, l)| *who == r
                    && l.contains(&format!("{coll} on device memory across"))
                    && l.contains("hierarchical")),
                "rank {r} never said {coll} ran hierarchically"
            );
        }
    }
}

/// `WEFT_CROSSHOST_HIER=0`: every collective staged whole through pinned
/// host memory (the path before the hierarchy, and the one of layouts it
/// does not cover): every result still against the reference.
#[test]
#[ignore = "needs a GPU: cargo test -p weft-nccl --test cuda_crosshost -- --ignored --test-threads=1"]
fn every_collective_staged_whole_matches_the_reference() {
    gpu_or_panic("every_collective_staged_whole_matches_the_reference");
    let ranks = collectives_checked_with(&[("WEFT_CROSSHOST_HIER", "0"), ("NCCL_DEBUG", "INFO")]);
    let logs = ranks.logs.lock().unwrap();
    assert!(
        !logs
            .iter()
            .any(|(_, l)| l.contains("hierarchical, within the host")),
        "WEFT_CROSSHOST_HIER=0 still ran hierarchically"
    );
}

/// The "collectives" scenario with `env` added: every rank checks every
/// result against the reference and exits 0 (9 checks per size, 4 sizes);
/// the ranks, for their logs.
fn collectives_checked_with(env: &[(&str, &str)]) -> Ranks {
    let n = env
        .iter()
        .find(|(k, _)| *k == "WEFT_XHOST_NRANKS")
        .map_or(NRANKS, |(_, v)| v.parse().unwrap());
    let mut ranks = Ranks::start_with("collectives", env);
    let all: Vec<usize> = (0..n).collect();
    let codes = ranks.wait(&all, Duration::from_secs(300));
    let mut checked = 0;
    while let Some((_, l)) = ranks.next(Duration::from_millis(500)) {
        checked += l.starts_with("ok ") as usize;
    }
    assert_eq!(
        codes,
        vec![Some(0); n],
        "every rank checks its results and exits 0"
    );
    assert!(checked >= n * 9 * 4, "{checked} checks reported");
    ranks
}

/// Three ranks on hosts of one and two (`sim-a`: rank 0; `sim-b`: 1, 2),
/// as after a shrink: all-reduce, all-gather and reduce-scatter by the
/// hosts' leaders, broadcast and reduce (root 2: a local index the small
/// host lacks) hierarchically at every size, the rest by host or staged;
/// every result against the reference, and every rank says those five
/// ran hierarchically.
#[test]
#[ignore = "needs a GPU: cargo test -p weft-nccl --test cuda_crosshost -- --ignored --test-threads=1"]
fn every_collective_on_hosts_of_different_sizes_matches_the_reference() {
    gpu_or_panic("every_collective_on_hosts_of_different_sizes_matches_the_reference");
    let ranks = collectives_checked_with(&[
        ("WEFT_XHOST_NRANKS", "3"),
        ("NCCL_DEBUG", "INFO"),
        ("WEFT_CROSSHOST_HIER_MIN_BYTES", "0"),
    ]);
    said_hierarchical(
        &ranks,
        3,
        &[
            "all_reduce",
            "all_gather",
            "reduce_scatter",
            "broadcast",
            "reduce",
        ],
    );
}

/// Four ranks placed round-robin on the two simulated hosts (`sim-a`:
/// ranks 0, 2; `sim-b`: 1, 3), so a host's blocks of an all-gather or
/// reduce-scatter are not one range: those two run hierarchically through
/// a host-major copy in device scratch (`device_plan/permuted.rs`), the
/// others hierarchically as on any layout; every result against the
/// reference, and every rank says all four ran hierarchically.
#[test]
#[ignore = "needs a GPU: cargo test -p weft-nccl --test cuda_crosshost -- --ignored --test-threads=1"]
fn every_collective_on_interleaved_hosts_matches_the_reference() {
    gpu_or_panic("every_collective_on_interleaved_hosts_matches_the_reference");
    let ranks = collectives_checked_with(&[
        ("WEFT_XHOST_HOSTS", "interleaved"),
        ("NCCL_DEBUG", "INFO"),
        ("WEFT_CROSSHOST_HIER_MIN_BYTES", "0"),
    ]);
    said_hierarchical(
        &ranks,
        NRANKS,
        &["all_reduce", "all_gather", "reduce_scatter", "broadcast"],
    );
}

/// A program of sends and receives alone (pipeline stages across hosts:
/// no collective ever builds anything): its first device operation builds
/// the hierarchy, so the pieces between ranks of one host go over the
/// host-local communicator's GPU kernels, the rest across. Rings both ways
/// and a pair exchange within each host, odd sizes up to 16 MiB, every
/// element against the reference; every rank says its sends and receives
/// went by host.
#[test]
#[ignore = "needs a GPU: cargo test -p weft-nccl --test cuda_crosshost -- --ignored --test-threads=1"]
fn sends_and_receives_alone_go_by_host_and_match_the_reference() {
    gpu_or_panic("sends_and_receives_alone_go_by_host_and_match_the_reference");
    let mut ranks = Ranks::start_with("sendrecv_only", &[("NCCL_DEBUG", "INFO")]);
    let codes = ranks.wait(&[0, 1, 2, 3], Duration::from_secs(300));
    let mut checked = 0;
    while let Some((_, l)) = ranks.next(Duration::from_millis(500)) {
        checked += l.starts_with("ok ") as usize;
    }
    assert_eq!(
        codes,
        vec![Some(0); NRANKS],
        "every rank checks and exits 0"
    );
    assert!(checked >= NRANKS * 3 * 4, "{checked} checks reported");
    let logs = ranks.logs.lock().unwrap();
    for r in 0..NRANKS {
        assert!(
            logs.iter().any(|(who, l)| *who == r
                && l.contains("sends and receives on device memory across")
                && l.contains("by host")),
            "rank {r} never said its sends and receives went by host"
        );
    }
}

/// With `WEFT_CROSSHOST_MIN_BYTES=4096` (unset: from 1 MiB), the host part
/// of the device collectives runs on the cross-host engine (built on the caller's thread
/// at the first device operation, run by the progress thread): still every
/// result against the reference, and every rank says the engine is on.
#[test]
#[ignore = "needs a GPU: cargo test -p weft-nccl --test cuda_crosshost -- --ignored --test-threads=1"]
fn device_collectives_on_the_cross_host_engine_match_the_reference() {
    gpu_or_panic("device_collectives_on_the_cross_host_engine_match_the_reference");
    let ranks =
        collectives_checked_with(&[("WEFT_CROSSHOST_MIN_BYTES", "4096"), ("NCCL_DEBUG", "INFO")]);
    let logs = ranks.logs.lock().unwrap();
    for r in 0..NRANKS {
        assert!(
            logs.iter()
                .any(|(who, l)| *who == r && l.contains("run on the cross-host engine")),
            "rank {r} never said the cross-host engine was on"
        );
    }
}

/// With `WEFT_CROSSHOST_SLICE_BYTES=4194304` the largest size (16 MiB and
/// an odd tail) of all-reduce, broadcast and reduce is cut into 4 slices,
/// each its own job: every result still against the reference.
#[test]
#[ignore = "needs a GPU: cargo test -p weft-nccl --test cuda_crosshost -- --ignored --test-threads=1"]
fn device_collectives_cut_in_slices_match_the_reference() {
    gpu_or_panic("device_collectives_cut_in_slices_match_the_reference");
    collectives_checked_with(&[("WEFT_CROSSHOST_SLICE_BYTES", "4194304")]);
}

/// With `WEFT_CROSSHOST_REDUCE=host` a reduce-scatter reduces in place
/// on its pinned copy, on the progress thread as it receives (the path
/// before the GPU reduced what it received): every result still against
/// the reference.
#[test]
#[ignore = "needs a GPU: cargo test -p weft-nccl --test cuda_crosshost -- --ignored --test-threads=1"]
fn device_reduce_scatters_reduced_on_the_host_match_the_reference() {
    gpu_or_panic("device_reduce_scatters_reduced_on_the_host_match_the_reference");
    collectives_checked_with(&[("WEFT_CROSSHOST_REDUCE", "host")]);
}

#[test]
#[ignore = "needs a GPU: cargo test -p weft-nccl --test cuda_crosshost -- --ignored --test-threads=1"]
fn a_256_mib_all_reduce_across_hosts_returns_within_100_us() {
    gpu_or_panic("a_256_mib_all_reduce_across_hosts_returns_within_100_us");
    // One process per GPU, as pods run: 2 hosts x 1 on 2 GPUs, 2 x 2 on 4
    // (the hierarchical path). Ranks sharing a GPU pay for it at every
    // call (the first launch on an idle stream took 20-45 us with two to
    // four processes time-sliced on one H200), which no deployment does.
    let gpus = cuda::device_count() as usize;
    assert!(
        gpus >= 2,
        "the call-time bound is for one process per GPU: needs 2 or more GPUs (found {gpus})"
    );
    let n = if gpus >= 4 { 4 } else { 2 };
    let n_text = n.to_string();
    let mut ranks = Ranks::start_with(
        "enqueue_time",
        &[
            ("WEFT_XHOST_NRANKS", n_text.as_str()),
            ("WEFT_XHOST_GPU_PER_HOST", "rank"),
        ],
    );
    let all: Vec<usize> = (0..n).collect();
    let codes = ranks.wait(&all, Duration::from_secs(300));
    let mut medians = Vec::new();
    while let Some((r, l)) = ranks.next(Duration::from_millis(500)) {
        if let Some(us) = l.strip_prefix("median_call_us=") {
            medians.push((r, us.parse::<f64>().unwrap()));
        }
    }
    assert_eq!(codes, vec![Some(0); n]);
    assert_eq!(medians.len(), n, "{medians:?}");
    for (r, us) in medians {
        assert!(
            us < 100.0,
            "rank {r} of {n} (one per GPU, 2 hosts): the calling thread spent {us} us inside ncclAllReduce of 256 MiB"
        );
    }
}

/// Rank 3 gets `sig` while every rank loops on device all-reduces; every
/// survivor must see an error within `bound` of the signal, naming rank 3
/// on every survivor (`all_name_it`) or on at least one (a frozen rank:
/// the host path's timeout names the rank a survivor waits for, which may
/// be a survivor that waits for rank 3).
fn a_signalled_remote_rank_fails_the_survivors(
    sig: i32,
    bound: Duration,
    all_name_it: bool,
    env: &[(&str, &str)],
) {
    let mut ranks = Ranks::start_with("loop", env);
    let mut looping = [false; NRANKS];
    while looping.iter().any(|l| !l) {
        let (r, l) = ranks
            .next(Duration::from_secs(120))
            .expect("every rank starts looping");
        if l == "looping" {
            looping[r] = true;
        }
    }
    std::thread::sleep(Duration::from_millis(300));
    let at = now_ms();
    ranks.signal(3, sig);
    let codes = ranks.wait(&[0, 1, 2], bound + Duration::from_secs(20));
    let mut seen = Vec::new();
    while let Some((r, l)) = ranks.next(Duration::from_millis(500)) {
        if let Some(rest) = l.strip_prefix("failed_at_ms=") {
            let (ms, msg) = rest.split_once(' ').unwrap();
            let after = ms.parse::<u128>().unwrap().saturating_sub(at);
            seen.push((r, after, msg.to_string()));
        }
    }
    ranks.signal(3, libc::SIGKILL);
    assert_eq!(
        codes,
        vec![Some(0); 3],
        "every survivor reports and exits 0: {seen:?}"
    );
    assert_eq!(seen.len(), 3, "{seen:?}");
    for (r, after, msg) in &seen {
        assert!(
            *after <= bound.as_millis(),
            "rank {r} failed {after} ms after the signal (bound {bound:?}): {msg}"
        );
        assert!(
            !all_name_it || msg.contains("rank 3"),
            "rank {r}: the error names rank 3: {msg}"
        );
    }
    assert!(
        seen.iter().any(|(_, _, m)| m.contains("rank 3")),
        "some survivor names rank 3: {seen:?}"
    );
}

#[test]
#[ignore = "needs a GPU: cargo test -p weft-nccl --test cuda_crosshost -- --ignored --test-threads=1"]
fn a_killed_remote_rank_fails_the_survivors_in_bounded_time() {
    gpu_or_panic("a_killed_remote_rank_fails_the_survivors_in_bounded_time");
    a_signalled_remote_rank_fails_the_survivors(libc::SIGKILL, Duration::from_secs(5), true, HIER);
}

/// The loop's all-reduces (1 MiB) hierarchical, whatever the threshold.
const HIER: &[(&str, &str)] = &[("WEFT_CROSSHOST_HIER_MIN_BYTES", "0")];
/// ... or staged whole.
const STAGED: &[(&str, &str)] = &[("WEFT_CROSSHOST_HIER", "0")];
/// Staged whole, the loop's collectives in the exchange form (a
/// reduce-scatter and a 2 MiB all-reduce in turn: sends and receives,
/// the reduction on the GPU).
const EXCHANGE: &[(&str, &str)] = &[
    ("WEFT_CROSSHOST_HIER", "0"),
    ("WEFT_XHOST_LOOP", "exchange"),
];

#[test]
#[ignore = "needs a GPU: cargo test -p weft-nccl --test cuda_crosshost -- --ignored --test-threads=1"]
fn a_killed_remote_rank_fails_the_survivors_exchanging_parts() {
    gpu_or_panic("a_killed_remote_rank_fails_the_survivors_exchanging_parts");
    a_signalled_remote_rank_fails_the_survivors(
        libc::SIGKILL,
        Duration::from_secs(5),
        true,
        EXCHANGE,
    );
}

#[test]
#[ignore = "needs a GPU: cargo test -p weft-nccl --test cuda_crosshost -- --ignored --test-threads=1"]
fn a_frozen_remote_rank_fails_the_survivors_exchanging_parts() {
    gpu_or_panic("a_frozen_remote_rank_fails_the_survivors_exchanging_parts");
    a_signalled_remote_rank_fails_the_survivors(
        libc::SIGSTOP,
        Duration::from_millis(TIMEOUT_MS) + Duration::from_secs(5),
        false,
        EXCHANGE,
    );
}

#[test]
#[ignore = "needs a GPU: cargo test -p weft-nccl --test cuda_crosshost -- --ignored --test-threads=1"]
fn a_killed_remote_rank_fails_the_survivors_staged_whole() {
    gpu_or_panic("a_killed_remote_rank_fails_the_survivors_staged_whole");
    a_signalled_remote_rank_fails_the_survivors(
        libc::SIGKILL,
        Duration::from_secs(5),
        true,
        STAGED,
    );
}

#[test]
#[ignore = "needs a GPU: cargo test -p weft-nccl --test cuda_crosshost -- --ignored --test-threads=1"]
fn a_frozen_remote_rank_fails_the_survivors_staged_whole() {
    gpu_or_panic("a_frozen_remote_rank_fails_the_survivors_staged_whole");
    a_signalled_remote_rank_fails_the_survivors(
        libc::SIGSTOP,
        Duration::from_millis(TIMEOUT_MS) + Duration::from_secs(5),
        false,
        STAGED,
    );
}

#[test]
#[ignore = "needs a GPU: cargo test -p weft-nccl --test cuda_crosshost -- --ignored --test-threads=1"]
fn a_frozen_remote_rank_fails_the_survivors_after_the_timeout() {
    gpu_or_panic("a_frozen_remote_rank_fails_the_survivors_after_the_timeout");
    a_signalled_remote_rank_fails_the_survivors(
        libc::SIGSTOP,
        Duration::from_millis(TIMEOUT_MS) + Duration::from_secs(5),
        false,
        HIER,
    );
}

// ------------------------------------------------------------------ rank

/// One rank of a scenario (see the module docs); does nothing unless the
/// parent set `WEFT_XHOST_SCENARIO`.
#[test]
#[ignore = "a rank process of the tests above, started by them"]
fn rank_process() {
    let Ok(scenario) = std::env::var("WEFT_XHOST_SCENARIO") else {
        return;
    };
    let rank: usize = std::env::var("WEFT_XHOST_RANK").unwrap().parse().unwrap();
    let hex = std::env::var("WEFT_XHOST_ID").unwrap();
    let mut id = ncclUniqueId { internal: [0; 128] };
    for (i, c) in id.internal.iter_mut().enumerate() {
        *c = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap() as _;
    }
    let n: usize = std::env::var("WEFT_XHOST_NRANKS").map_or(NRANKS, |v| v.parse().unwrap());
    // WEFT_XHOST_GPU_PER_HOST=1 (with 2 GPUs): each simulated host on its
    // own GPU; `rank`: each rank on its own; else every rank on GPU 0.
    let dev = match std::env::var("WEFT_XHOST_GPU_PER_HOST").as_deref() {
        Ok("1") => host_index(rank, n, &[]) as i32,
        Ok("rank") => rank as i32,
        _ => 0,
    };
    cuda::use_device(dev).unwrap();
    let mut comm: ncclComm_t = std::ptr::null_mut();
    assert_eq!(
        unsafe { pncclCommInitRank(&mut comm, n as i32, id, rank as i32) },
        0,
        "rank {rank}: init"
    );
    let r = Rank {
        rank,
        nranks: n,
        comm,
        dev,
        stream: mem::stream(dev).unwrap(),
    };
    match scenario.as_str() {
        "collectives" => r.collectives(),
        "enqueue_time" => r.enqueue_time(),
        "sendrecv_only" => r.sends_and_receives_only(),
        "loop" => r.loop_until_failure(),
        s => panic!("unknown scenario {s}"),
    }
}

struct Rank {
    rank: usize,
    nranks: usize,
    comm: ncclComm_t,
    dev: i32,
    stream: u64,
}

impl Rank {
    fn st(&self) -> *mut c_void {
        self.stream as *mut c_void
    }

    fn sync(&self) {
        let rc = unsafe {
            cudarc::driver::sys::cuStreamSynchronize(self.stream as cudarc::driver::sys::CUstream)
        };
        assert_eq!(rc, cudarc::driver::sys::CUresult::CUDA_SUCCESS);
    }

    fn upload(&self, v: &[f32]) -> u64 {
        let b = mem::alloc(self.dev, v.len().max(1) * 4).unwrap();
        let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        mem::htod(self.dev, b, &bytes).unwrap();
        b
    }

    fn download(&self, b: u64, n: usize) -> Vec<f32> {
        let mut bytes = vec![0u8; n * 4];
        mem::dtoh(self.dev, &mut bytes, b).unwrap();
        bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect()
    }

    /// Enqueues an in-place sum of `count` f32 at `buf`; the return code.
    fn sum_in_place(&self, buf: u64, count: usize) -> i32 {
        let p = buf as *mut c_void;
        unsafe { pncclAllReduce(p, p, count, F32, SUM, self.comm, self.st()) }
    }

    fn check(&self, what: &str, count: usize, got: &[f32], want: impl Fn(usize) -> f32) {
        for (i, g) in got.iter().enumerate() {
            let w = want(i);
            assert_eq!(*g, w, "rank {}: {what} of {count}: element {i}", self.rank);
        }
        println!("@ ok {what} count={count}");
    }

    fn collectives(&self) {
        let n = self.nranks;
        let me = self.rank;
        let p = |b: u64| b as *mut c_void;
        for (k, count) in [1usize, 1023, 262_147, 4_194_311].into_iter().enumerate() {
            let seed = 1000 + k as u64;
            let v = |q: usize, i: usize| value(seed, q, i);
            let input: Vec<f32> = (0..n * count).map(|i| v(me, i)).collect();
            let send = self.upload(&input);
            let out = self.upload(&vec![f32::NAN; n * count]);
            let run = |f: &dyn Fn() -> i32| {
                assert_eq!(f(), 0, "rank {me}: enqueue");
                self.sync();
            };
            run(&|| unsafe {
                pncclAllReduce(p(send), p(out), count, F32, SUM, self.comm, self.st())
            });
            self.check("all_reduce", count, &self.download(out, count), |i| {
                (0..n).map(|q| v(q, i)).sum()
            });
            run(&|| unsafe { pncclAllGather(p(send), p(out), count, F32, self.comm, self.st()) });
            self.check("all_gather", count, &self.download(out, n * count), |i| {
                v(i / count, i % count)
            });
            run(&|| unsafe {
                pncclReduceScatter(p(send), p(out), count, F32, SUM, self.comm, self.st())
            });
            self.check("reduce_scatter", count, &self.download(out, count), |i| {
                (0..n).map(|q| v(q, me * count + i)).sum()
            });
            self.reduce_scatter_kinds(seed, count);
            // Root 2: on the other host from ranks 0 and 1.
            run(&|| unsafe {
                pncclBroadcast(p(send), p(out), count, F32, 2, self.comm, self.st())
            });
            self.check("broadcast", count, &self.download(out, count), |i| v(2, i));
            // In place: the root's buffer stays as it is, the others get it.
            let inp = self.upload(&input[..count]);
            run(&|| unsafe { pncclBroadcast(p(inp), p(inp), count, F32, 1, self.comm, self.st()) });
            self.check(
                "broadcast in place",
                count,
                &self.download(inp, count),
                |i| v(1, i),
            );
            run(&|| unsafe {
                pncclAllReduce(p(inp), p(inp), count, F32, SUM, self.comm, self.st())
            });
            self.check(
                "all_reduce in place",
                count,
                &self.download(inp, count),
                |i| v(1, i) * n as f32,
            );
            mem::free(self.dev, inp).unwrap();
            run(&|| unsafe {
                pncclReduce(p(send), p(out), count, F32, MAX, 1, self.comm, self.st())
            });
            if me == 1 {
                self.check("reduce", count, &self.download(out, count), |i| {
                    (0..n).map(|q| v(q, i)).fold(f32::MIN, f32::max)
                });
            } else {
                println!("@ ok reduce count={count} (not the root)");
            }
            // Gather to the last rank (the other host from rank 0), then
            // scatter its gathered blocks from it: sends and receives by host.
            let last = n - 1;
            run(&|| unsafe {
                pncclGather(
                    p(send),
                    p(out),
                    count,
                    F32,
                    last as i32,
                    self.comm,
                    self.st(),
                )
            });
            if me == last {
                self.check("gather", count, &self.download(out, n * count), |i| {
                    v(i / count, i % count)
                });
            } else {
                println!("@ ok gather count={count} (not the root)");
            }
            let back = self.upload(&vec![f32::NAN; count]);
            run(&|| unsafe {
                pncclScatter(
                    p(out),
                    p(back),
                    count,
                    F32,
                    last as i32,
                    self.comm,
                    self.st(),
                )
            });
            self.check("scatter", count, &self.download(back, count), |i| v(me, i));
            mem::free(self.dev, back).unwrap();
            run(&|| unsafe { pncclAlltoAll(p(send), p(out), count, F32, self.comm, self.st()) });
            self.check("alltoall", count, &self.download(out, n * count), |i| {
                v(i / count, me * count + i % count)
            });
            // A ring of sends and receives in one group.
            let (next, prev) = ((me + 1) % n, (me + n - 1) % n);
            self.group(count, &[(next, send)], &[(prev, out)]);
            self.check("sendrecv", count, &self.download(out, count), |i| {
                v(prev, i)
            });
            mem::free(self.dev, send).unwrap();
            mem::free(self.dev, out).unwrap();
        }
        assert_eq!(unsafe { pncclCommDestroy(self.comm) }, 0);
    }

    /// Reduce-scatter beyond f32 sums (it reduces on the GPU what it
    /// received, `WEFT_CROSSHOST_REDUCE`): in place (NCCL's layout: the
    /// output is this rank's block of the input), int32 products, f64
    /// minima, bf16 sums and f32 averages, every element against the
    /// reference computed here.
    fn reduce_scatter_kinds(&self, seed: u64, count: usize) {
        let (n, me) = (self.nranks, self.rank);
        let v = |q: usize, i: usize| value(seed ^ 0x5eed, q, i);
        let p = |b: u64| b as *mut c_void;
        let run = |f: &dyn Fn() -> i32| {
            assert_eq!(f(), 0, "rank {me}: enqueue");
            self.sync();
        };
        // In place.
        let input: Vec<f32> = (0..n * count).map(|i| v(me, i)).collect();
        let buf = self.upload(&input);
        let mine = buf + (me * count * 4) as u64;
        run(&|| unsafe {
            pncclReduceScatter(p(buf), p(mine), count, F32, SUM, self.comm, self.st())
        });
        let want = |i: usize| (0..n).map(|q| v(q, me * count + i)).sum::<f32>();
        let got = self.download(buf, n * count);
        self.check(
            "reduce_scatter in place",
            count,
            &got[me * count..(me + 1) * count],
            want,
        );
        mem::free(self.dev, buf).unwrap();
        // Average: sums of small integers are exact, so is the division.
        let buf = self.upload(&input);
        let out = self.upload(&vec![f32::NAN; count]);
        run(&|| unsafe {
            pncclReduceScatter(p(buf), p(out), count, F32, AVG, self.comm, self.st())
        });
        self.check(
            "reduce_scatter avg",
            count,
            &self.download(out, count),
            |i| want(i) / n as f32,
        );
        mem::free(self.dev, buf).unwrap();
        mem::free(self.dev, out).unwrap();
        // Other types, as raw bytes: (type, op, element bytes, rank q's
        // element i, the reduction of the ranks' elements).
        type Enc = fn(f32) -> Vec<u8>;
        type Reduce = fn(&[f32]) -> f32;
        let cases: [(&str, i32, i32, usize, Enc, Reduce); 3] = [
            (
                "int32 prod",
                I32,
                PROD,
                4,
                |x| ((x as i32).rem_euclid(3) + 1).to_le_bytes().to_vec(),
                |xs| {
                    xs.iter()
                        .map(|&x| ((x as i32).rem_euclid(3) + 1) as f32)
                        .product()
                },
            ),
            (
                "f64 min",
                F64,
                MIN,
                8,
                |x| (x as f64).to_le_bytes().to_vec(),
                |xs| xs.iter().copied().fold(f32::MAX, f32::min),
            ),
            (
                "bf16 sum",
                BF16,
                SUM,
                2,
                |x| ((x.to_bits() >> 16) as u16).to_le_bytes().to_vec(),
                |xs| xs.iter().sum(),
            ),
        ];
        for (what, ty, op, es, enc, reduce) in cases {
            let bytes: Vec<u8> = (0..n * count).flat_map(|i| enc(v(me, i))).collect();
            let send = mem::alloc(self.dev, bytes.len()).unwrap();
            mem::htod(self.dev, send, &bytes).unwrap();
            let out = mem::alloc(self.dev, count * es).unwrap();
            run(&|| unsafe {
                pncclReduceScatter(p(send), p(out), count, ty, op, self.comm, self.st())
            });
            let mut got = vec![0u8; count * es];
            mem::dtoh(self.dev, &mut got, out).unwrap();
            for i in 0..count {
                let xs: Vec<f32> = (0..n).map(|q| v(q, me * count + i)).collect();
                // The products are of the encoded factors already.
                let want = match ty {
                    I32 => (reduce(&xs) as i32).to_le_bytes().to_vec(),
                    _ => enc(reduce(&xs)),
                };
                assert_eq!(
                    &got[i * es..(i + 1) * es],
                    &want[..],
                    "rank {me}: reduce_scatter {what} of {count}: element {i}"
                );
            }
            println!("@ ok reduce_scatter {what} count={count}");
            mem::free(self.dev, send).unwrap();
            mem::free(self.dev, out).unwrap();
        }
    }

    /// One group of sends and receives on device memory: `sends` (peer,
    /// buffer) and `recvs`, each of `count` f32.
    fn group(&self, count: usize, sends: &[(usize, u64)], recvs: &[(usize, u64)]) {
        let p = |b: u64| b as *mut c_void;
        unsafe {
            assert_eq!(pncclGroupStart(), 0);
            for &(to, b) in sends {
                assert_eq!(
                    pncclSend(p(b), count, F32, to as i32, self.comm, self.st()),
                    0
                );
            }
            for &(from, b) in recvs {
                assert_eq!(
                    pncclRecv(p(b), count, F32, from as i32, self.comm, self.st()),
                    0
                );
            }
            assert_eq!(pncclGroupEnd(), 0, "rank {}: group", self.rank);
        }
        self.sync();
    }

    /// The "sendrecv_only" scenario: no collective at all.
    fn sends_and_receives_only(&self) {
        let n = NRANKS;
        let me = self.rank;
        let (next, prev) = ((me + 1) % n, (me + n - 1) % n);
        // Ranks 0, 1 on one host, 2, 3 on the other: the partner is local.
        let partner = me ^ 1;
        for (k, count) in [1usize, 1023, 262_147, 4_194_311].into_iter().enumerate() {
            let seed = 2000 + k as u64;
            // What rank `from` sends rank `to`: distinct per pair.
            let v = |from: usize, to: usize, i: usize| value(seed + to as u64 * 17, from, i);
            let mine =
                |to: usize| self.upload(&(0..count).map(|i| v(me, to, i)).collect::<Vec<_>>());
            let (to_next, to_prev, to_partner) = (mine(next), mine(prev), mine(partner));
            let nan = vec![f32::NAN; count];
            let (from_prev, from_next, from_partner) =
                (self.upload(&nan), self.upload(&nan), self.upload(&nan));
            self.group(count, &[(next, to_next)], &[(prev, from_prev)]);
            self.check(
                "ring forward",
                count,
                &self.download(from_prev, count),
                |i| v(prev, me, i),
            );
            self.group(count, &[(prev, to_prev)], &[(next, from_next)]);
            self.check(
                "ring backward",
                count,
                &self.download(from_next, count),
                |i| v(next, me, i),
            );
            self.group(count, &[(partner, to_partner)], &[(partner, from_partner)]);
            self.check(
                "pair within the host",
                count,
                &self.download(from_partner, count),
                |i| v(partner, me, i),
            );
            for b in [
                to_next,
                to_prev,
                to_partner,
                from_prev,
                from_next,
                from_partner,
            ] {
                mem::free(self.dev, b).unwrap();
            }
        }
        assert_eq!(unsafe { pncclCommDestroy(self.comm) }, 0);
    }

    fn enqueue_time(&self) {
        let count = 64 << 20; // 256 MiB of f32
        let buf = mem::alloc(self.dev, count * 4).unwrap();
        let call = || {
            let t = Instant::now();
            let rc = self.sum_in_place(buf, count);
            let us = t.elapsed().as_secs_f64() * 1e6;
            assert_eq!(rc, 0);
            us
        };
        // Warm: the device side, the pinned buffer, the connections.
        for _ in 0..2 {
            call();
            self.sync();
        }
        let mut times: Vec<f64> = (0..5)
            .map(|_| {
                let us = call();
                self.sync();
                us
            })
            .collect();
        println!("@ call_us={times:?}");
        times.sort_by(f64::total_cmp);
        println!("@ median_call_us={}", times[times.len() / 2]);
        assert_eq!(unsafe { pncclCommDestroy(self.comm) }, 0);
    }

    /// Device all-reduces of 1 MiB in a loop (`WEFT_XHOST_LOOP=exchange`:
    /// a reduce-scatter and an all-reduce of 2 MiB in turn, the forms
    /// that exchange their parts and reduce on the GPU) until one fails;
    /// then abort.
    fn loop_until_failure(&self) {
        let exchange = std::env::var("WEFT_XHOST_LOOP").is_ok_and(|v| v == "exchange");
        let count = if exchange { 1 << 19 } else { 1 << 18 };
        let buf = mem::alloc(self.dev, count * 4).unwrap();
        let out = mem::alloc(self.dev, count * 4).unwrap();
        let started = Instant::now();
        let mut i = 0u64;
        while started.elapsed() < Duration::from_secs(120) {
            let rc = match exchange && i % 2 == 1 {
                true => unsafe {
                    let blocks = count / self.nranks;
                    pncclReduceScatter(
                        buf as *mut c_void,
                        out as *mut c_void,
                        blocks,
                        F32,
                        SUM,
                        self.comm,
                        self.st(),
                    )
                },
                false => self.sum_in_place(buf, count),
            };
            if rc == 0 {
                self.sync();
            }
            let mut err = 0;
            assert_eq!(unsafe { pncclCommGetAsyncError(self.comm, &mut err) }, 0);
            if rc != 0 || err != 0 {
                let msg = unsafe { CStr::from_ptr(pncclGetLastError(self.comm)) }
                    .to_string_lossy()
                    .replace('\n', " ");
                println!("@ failed_at_ms={} rc={rc} async={err}: {msg}", now_ms());
                // Abort returns at once and releases every GPU wait.
                let t = Instant::now();
                assert_eq!(unsafe { pncclCommAbort(self.comm) }, 0);
                assert!(
                    t.elapsed() < Duration::from_secs(2),
                    "abort took {:?}",
                    t.elapsed()
                );
                return;
            }
            i += 1;
            if i == 3 {
                println!("@ looping");
            }
        }
        panic!("rank {}: no failure within 120 s", self.rank);
    }
}
