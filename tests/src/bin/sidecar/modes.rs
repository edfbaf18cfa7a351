//! Rank scenarios of the sidecar tests (`tests/tests/sidecar.rs`). Each one
//! attaches to the sidecar (or the embedded engine) through
//! `weft::agent::install_from_env` before creating communicators.

use libcomm::{Communicator, ReduceOp};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

fn fail(msg: impl std::fmt::Display) -> ! {
    eprintln!("FAIL: {msg}");
    std::process::exit(1);
}

fn ok<T>(r: libcomm::Result<T>, what: &str) -> T {
    r.unwrap_or_else(|e| fail(format!("{what}: {e}")))
}

fn arg(i: usize, default: &str) -> usize {
    std::env::args()
        .nth(i)
        .unwrap_or_else(|| default.to_string())
        .parse()
        .unwrap_or_else(|_| fail("bad number argument"))
}

fn attach() -> std::sync::Arc<weft::agent::Agent> {
    // Multi-host tests: each host is a network namespace.
    if let Ok(ns) = std::env::var("WEFT_TEST_NETNS") {
        weft_tests::netns::enter(&ns).unwrap_or_else(|e| fail(e));
    }
    weft::agent::install_from_env().unwrap_or_else(|e| fail(format!("attaching: {e}")))
}

fn now_ms() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis()
}

/// Longer than libcomm's sampling threshold: collectives closer together
/// are a tight loop that libcomm only samples (one timed call in 32), and
/// the scenarios that use `step` check that every call is a span.
const PAUSE: Duration = Duration::from_nanos(2 * libcomm::observe::FAST_MEAN_NS);

/// One checked collective of the pattern, picked by `i` (all ranks agree),
/// after a [`PAUSE`].
fn step(c: &Communicator, i: usize) {
    std::thread::sleep(PAUSE);
    let (n, r) = (c.count(), c.rank());
    match i % 3 {
        0 => {
            let mut v = [r as i64 + 1, i as i64];
            ok(c.all_reduce_in_place(&mut v, ReduceOp::Sum), "all_reduce");
            let want = [(n * (n + 1) / 2) as i64, (i * n) as i64];
            if v != want {
                fail(format!("all_reduce #{i}: got {v:?}, want {want:?}"));
            }
        }
        1 => {
            let send = [r as u32 * 3 + i as u32];
            let mut recv = vec![0u32; n];
            ok(c.all_gather(&send, &mut recv), "all_gather");
            for (k, v) in recv.iter().enumerate() {
                if *v != k as u32 * 3 + i as u32 {
                    fail(format!("all_gather #{i}: slot {k} = {v}"));
                }
            }
        }
        _ => {
            let root = i % n;
            let mut v = [if r == root { i as f32 } else { -1.0 }; 4];
            ok(c.broadcast_in_place(&mut v, root), "broadcast");
            if v != [i as f32; 4] {
                fail(format!("broadcast #{i}: got {v:?}"));
            }
        }
    }
}

/// Group calls at the end of `sc_traced`.
pub const GROUPS: usize = 10;

/// `sc_traced N`: N collectives on the world and N on a split half,
/// interleaved, then [`GROUPS`] group calls on the world.
pub fn traced() {
    let agent = attach();
    let n_ops = arg(2, "1000");
    let w = ok(Communicator::from_env(), "init");
    let half = ok(w.split(Some((w.rank() % 2) as u32), 0), "split").unwrap();
    println!(
        "@ rank={} world_comm={} world_n={} split_comm={} split_rank={} split_n={}",
        w.rank(),
        w.id(),
        w.count(),
        half.id(),
        half.rank(),
        half.count()
    );
    for i in 0..n_ops {
        step(&w, i);
        step(&half, i);
    }
    // Then GROUPS group calls on the world (one span each, op "group").
    for g in 0..GROUPS {
        std::thread::sleep(PAUSE); // as in `step`
        let mut a = [w.rank() as u64, g as u64];
        let mut b = [1u64];
        let mut grp = libcomm::Group::new();
        ok(
            grp.all_reduce_in_place(&w, &mut a, ReduceOp::Sum)
                .map(|_| ()),
            "group add",
        );
        ok(
            grp.all_reduce_in_place(&w, &mut b, ReduceOp::Sum)
                .map(|_| ()),
            "group add",
        );
        ok(grp.execute(), "group");
        let n = w.count() as u64;
        if a != [n * (n - 1) / 2, g as u64 * n] || b != [n] {
            fail(format!("group #{g}: {a:?} {b:?}"));
        }
    }
    ok(half.destroy(), "destroy split");
    ok(w.destroy(), "destroy");
    agent.close();
    println!("@ done=1 dropped={}", agent.dropped());
}

/// `sc_exit OPS`: checked collectives on the world, the communicator
/// destroyed, and a return from main without `Agent::close`, as programs
/// that attach do (`weft bench`, resilient-train): the agent's own exit
/// hook must end the control stream cleanly.
pub fn exit_without_close() {
    let _agent = attach();
    let w = ok(Communicator::from_env(), "init");
    for i in 0..arg(2, "30") {
        step(&w, i);
    }
    ok(w.destroy(), "destroy");
    println!("@ done=1");
}

/// `sc_storm ROUNDS OPS`: rounds of split, checked collectives, and (every
/// third round) abort of the split, while the test polls status.
pub fn storm() {
    let agent = attach();
    let rounds = arg(2, "10");
    let ops = arg(3, "50");
    let w = ok(Communicator::from_env(), "init");
    let mut total = 0;
    for round in 0..rounds {
        let child = ok(w.split(Some((w.rank() % 2) as u32), round as i32), "split").unwrap();
        for i in 0..ops {
            step(&child, i);
            step(&w, i);
            total += 2;
        }
        if round % 3 == 2 {
            // An all-reduce on the world completes only once every rank has
            // finished its split's collectives: then aborting the split
            // cannot cut a peer's last receive short.
            step(&w, 0);
            total += 1;
            ok(child.abort(), "abort");
        }
        let _ = child.destroy();
    }
    ok(w.destroy(), "destroy");
    agent.close();
    println!("@ collectives={total}");
}

/// `sc_hang`: collectives until one fails (the sidecar's SIGTERM, a killed
/// rank); prints when and how, exits 3. `VICTIM` (env) SIGKILLs itself after 500 ms.
pub fn hang() {
    let _agent = attach();
    let w = ok(Communicator::from_env(), "init");
    if std::env::var("WEFT_TEST_VICTIM").ok().as_deref() == Some(&w.rank().to_string()) {
        std::thread::spawn(|| {
            std::thread::sleep(Duration::from_millis(500));
            println!("@ killed_at_ms={}", now_ms());
            unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
        });
    }
    transport_facts();
    println!("@ running=1");
    let mut buf = vec![1.0f32; 1 << 16];
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut i = 0u64;
    while Instant::now() < deadline {
        if let Err(e) = w.all_reduce_in_place(&mut buf, ReduceOp::Sum) {
            println!(
                "@ failed_at_ms={} iteration={i} kind={:?}",
                now_ms(),
                e.kind()
            );
            println!("@ error={}", e.to_string().replace(' ', "_"));
            let _ = w.destroy();
            std::process::exit(3);
        }
        buf.iter_mut().for_each(|x| *x = 1.0);
        i += 1;
    }
    fail("no failure within 60 s");
}

/// `sc_behind`: 5 collectives, then the last rank sleeps 3 s before the
/// 6th while the others wait in it: RAS must show who is behind.
pub fn behind() {
    let agent = attach();
    let w = ok(Communicator::from_env(), "init");
    for i in 0..5 {
        step(&w, 3 * i); // all-reduces
    }
    if w.rank() == w.count() - 1 {
        std::thread::sleep(Duration::from_secs(3));
    }
    step(&w, 0);
    ok(w.destroy(), "destroy");
    agent.close();
    println!("@ done=1");
}

/// How this process reached other hosts (the proxy tests check it).
fn transport_facts() {
    let t = libcomm::transport_stats();
    println!(
        "@ tcp_conns={} proxy_chans={}",
        t.tcp_connections, t.proxy_channels
    );
}

/// `sc_payload ELEMS ITERS`: ITERS checked all-reduces of ELEMS f32 on the
/// world and the split half, plus the mixed small collectives of `step`.
pub fn payload() {
    let agent = attach();
    let elems = arg(2, "1024");
    let iters = arg(3, "10");
    let w = ok(Communicator::from_env(), "init");
    let half = ok(w.split(Some((w.rank() % 2) as u32), 0), "split").unwrap();
    for c in [&w, &half] {
        let n = c.count();
        for i in 0..iters {
            let mut v: Vec<f32> = (0..elems).map(|k| (c.rank() + k % 7 + i) as f32).collect();
            ok(c.all_reduce_in_place(&mut v, ReduceOp::Sum), "all_reduce");
            for (k, x) in v.iter().enumerate() {
                let want = (n * (n - 1) / 2 + n * (k % 7 + i)) as f32;
                if *x != want {
                    fail(format!("all_reduce #{i}: [{k}] = {x}, want {want}"));
                }
            }
            step(c, i);
        }
    }
    transport_facts();
    ok(half.destroy(), "destroy split");
    ok(w.destroy(), "destroy");
    agent.close();
    println!("@ done=1");
}

/// `sc_bw ITERS BYTES...`: all-reduce (f32 sum) timings, median of ITERS
/// after 2 warm-ups, per size: `@ us_<bytes>=<microseconds>`.
pub fn bandwidth() {
    let agent = attach();
    let iters = arg(2, "20");
    let sizes: Vec<usize> = std::env::args()
        .skip(3)
        .map(|s| s.parse().unwrap_or_else(|_| fail("bad size")))
        .collect();
    let w = ok(Communicator::from_env(), "init");
    for bytes in sizes {
        let mut v = vec![1.0f32; (bytes / 4).max(1)];
        let mut times = Vec::new();
        for i in 0..iters + 2 {
            ok(
                w.all_reduce_in_place(&mut [0u8; 8], ReduceOp::Max),
                "barrier",
            );
            let t = Instant::now();
            ok(w.all_reduce_in_place(&mut v, ReduceOp::Sum), "all_reduce");
            if i >= 2 {
                times.push(t.elapsed().as_secs_f64() * 1e6);
            }
            v.iter_mut().for_each(|x| *x = 1.0);
        }
        times.sort_by(|a, b| a.partial_cmp(b).unwrap());
        println!("@ us_{bytes}={:.1}", times[times.len() / 2]);
    }
    transport_facts();
    ok(w.destroy(), "destroy");
    agent.close();
}

/// A file that says rank `r` of this job got somewhere (`sc_hol`).
fn marker(r: usize) -> std::path::PathBuf {
    let job = std::env::var("WEFT_JOB").unwrap_or_default();
    std::env::temp_dir().join(format!("weft-hol-{job}-{r}"))
}

/// `sc_hol` (2 hosts x 2 ranks; ranks 0,1 on one host, 2,3 on the other):
/// rank 0 sends 32 MiB to rank 2, which receives only once ranks 1 and 3
/// have finished 300 checked all-reduces over the same pair of sidecars,
/// so that channel stalls with full rings all the while. Prints when each
/// part finished, for the test to compare.
pub fn head_of_line() {
    let agent = attach();
    let w = ok(Communicator::from_env(), "init");
    let pair = ok(w.split(Some((w.rank() % 2) as u32), 0), "split").unwrap();
    ok(
        w.all_reduce_in_place(&mut [0u8; 8], ReduceOp::Max),
        "barrier",
    );
    const N: usize = 8 << 20; // u32s: 32 MiB
    match w.rank() {
        0 => {
            let v: Vec<u32> = (0..N as u32).collect();
            ok(pair.send(&v, 1), "send");
            // Host sends are eager (they return once the rest is copied):
            // the transfer is complete when the flush returns.
            ok(pair.flush(), "flush");
            println!("@ big_sent_ms={}", now_ms());
        }
        2 => {
            // Receive only once ranks 1 and 3 are done (or after 20 s: then
            // they were blocked behind this stalled channel, and the test
            // sees it in the timestamps).
            let deadline = Instant::now() + Duration::from_secs(20);
            while Instant::now() < deadline && !(marker(1).exists() && marker(3).exists()) {
                std::thread::sleep(Duration::from_millis(10));
            }
            let _ = std::fs::remove_file(marker(1));
            let _ = std::fs::remove_file(marker(3));
            println!("@ recv_start_ms={}", now_ms());
            let mut v = vec![0u32; N];
            ok(pair.recv(&mut v, 0), "recv");
            if let Some(k) = (0..N).find(|&k| v[k] != k as u32) {
                fail(format!("big message: [{k}] = {}", v[k]));
            }
        }
        _ => {
            // Give rank 0's transfer time to fill every buffer on its way.
            std::thread::sleep(Duration::from_millis(300));
            for i in 0..300 {
                step(&pair, 3 * i);
            }
            println!("@ small_done_ms={}", now_ms());
            let _ = std::fs::write(marker(w.rank()), b"done");
        }
    }
    ok(
        w.all_reduce_in_place(&mut [0u8; 8], ReduceOp::Max),
        "barrier",
    );
    transport_facts();
    ok(pair.destroy(), "destroy pair");
    ok(w.destroy(), "destroy");
    agent.close();
}

/// `sc_capi`: a rank that only uses the NCCL C ABI (as a C or PyTorch
/// program does): it never installs the agent itself. 20 checked all-reduces,
/// then it waits for `WEFT_TEST_RELEASE` (bounded) so the test can read RAS,
/// destroys its communicator and exits normally.
pub fn capi() {
    use nccl::api::*;
    let env = |k: &str| -> i32 {
        std::env::var(k)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| fail(format!("{k} is not set")))
    };
    let (rank, n) = (env("WEFT_RANK"), env("WEFT_WORLD_SIZE"));
    let mut id = ncclUniqueId { internal: [0; 128] };
    let mut comm: ncclComm_t = std::ptr::null_mut();
    unsafe {
        if pncclGetUniqueId(&mut id) != 0 || pncclCommInitRank(&mut comm, n, id, rank) != 0 {
            fail("ncclCommInitRank failed");
        }
    }
    let mut buf = vec![0f32; 1000];
    for i in 0..20 {
        buf.iter_mut().for_each(|x| *x = (rank + i) as f32);
        let p = buf.as_mut_ptr().cast::<std::ffi::c_void>();
        let rc = unsafe { pncclAllReduce(p, p, buf.len(), 7, 0, comm, std::ptr::null_mut()) };
        let want = (0..n).map(|r| (r + i) as f32).sum::<f32>();
        if rc != 0 || buf.iter().any(|&x| x != want) {
            fail(format!(
                "all-reduce {i}: rc {rc}, got {} want {want}",
                buf[0]
            ));
        }
    }
    println!("@ done=20");
    let release = std::env::var("WEFT_TEST_RELEASE").unwrap_or_default();
    let t = Instant::now();
    while !std::path::Path::new(&release).exists() {
        if t.elapsed() > Duration::from_secs(30) {
            fail("not released within 30 s");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    unsafe { pncclCommDestroy(comm) };
}

/// `sc_flood N`: N checked-at-the-end 8-byte all-reduces on the world as
/// fast as they go (the sidecar's telemetry under a flood), then destroy
/// and close. Prints what it issued and what its ring took or dropped.
pub fn flood() {
    let agent = attach();
    let n = arg(2, "1000");
    let w = ok(Communicator::from_env(), "init");
    let mut v = [0u64; 1];
    for i in 0..n {
        v[0] = 1;
        ok(w.all_reduce_in_place(&mut v, ReduceOp::Sum), "all_reduce");
        if i % 4096 == 0 && v[0] != w.count() as u64 {
            fail(format!("all_reduce #{i}: got {}", v[0]));
        }
    }
    ok(w.destroy(), "destroy");
    let (reported, dropped) = (agent.reported(), agent.dropped());
    agent.close();
    println!("@ issued={n} reported={reported} dropped={dropped}");
}

/// `sc_quick_exit OPS`: OPS all-reduces, destroy, and exit at once: no
/// `close`, so the process's end races its last messages to the sidecar.
pub fn quick_exit() {
    let _agent = attach();
    let ops = arg(2, "3");
    let w = ok(Communicator::from_env(), "init");
    for i in 0..ops {
        step(&w, 3 * i);
    }
    ok(w.destroy(), "destroy");
    std::process::exit(0);
}

/// `sc_cut N`: N collectives; half-way the rank `WEFT_TEST_VICTIM` cuts
/// its control connection (the agent's test hook) and goes on once it has
/// attached again (at most 20 s), as do the others.
pub fn cut() {
    let agent = attach();
    let n = arg(2, "200");
    let w = ok(Communicator::from_env(), "init");
    println!("@ rank={} comm={}", w.rank(), w.id());
    let victim = std::env::var("WEFT_TEST_VICTIM").ok().as_deref() == Some(&w.rank().to_string());
    for i in 0..n {
        if i == n / 2 && victim {
            agent.cut_connection();
            let t = Instant::now();
            while agent.reconnects() == 0 {
                if t.elapsed() > Duration::from_secs(20) {
                    fail("not attached again within 20 s");
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            println!("@ cut_at_seq={}", i + 1);
        }
        step(&w, 3 * i);
    }
    ok(w.destroy(), "destroy");
    let reconnects = agent.reconnects();
    agent.close();
    println!("@ reconnects={reconnects} dropped={}", agent.dropped());
}
