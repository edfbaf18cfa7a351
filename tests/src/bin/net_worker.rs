//! One rank of the cross-host tests (`tests/tests/crosshost.rs`): the
//! hierarchical plans run by `libcomm::crosshost` over the TCP byte mover
//! between network-namespace hosts, the host-local phases over a host-local
//! libcomm communicator. Started with the launcher's environment (plus
//! `WEFT_TEST_NETNS`, the namespace to enter first); the first argument
//! names the scenario. Prints `@ key=value` facts and exits non-zero on any
//! unexpected result.

use libcomm::CommMover;
use libcomm::crosshost::{Coll, CrossHost, Layout, Links, Shape};
use libcomm::net::tcp::{self, TcpConfig, TcpNet};
use libcomm::net::{MemKind, RecvBuf, Request};
use libcomm::{Communicator, Config, DataType, ReduceOp};
use std::path::PathBuf;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use weft_tests::data::{
    Val, decode, encode, input_seed, matches, premul_scalar, reduce_ref, value,
};

fn fail(msg: impl std::fmt::Display) -> ! {
    eprintln!("FAIL: {msg}");
    std::process::exit(1);
}

fn ok<T, E: std::fmt::Display>(r: Result<T, E>, what: &str) -> T {
    r.unwrap_or_else(|e| fail(format!("{what}: {e}")))
}

fn arg(i: usize, default: &str) -> String {
    std::env::args()
        .nth(i)
        .unwrap_or_else(|| default.to_string())
}

fn now_ms() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis()
}

fn ctl() -> PathBuf {
    PathBuf::from(
        std::env::var("WEFT_TEST_CTL").unwrap_or_else(|_| fail("WEFT_TEST_CTL is not set")),
    )
}

fn main() {
    if let Ok(ns) = std::env::var("WEFT_TEST_NETNS") {
        weft_tests::netns::enter(&ns).unwrap_or_else(|e| fail(e));
    }
    match arg(1, "").as_str() {
        "coll" => mode_coll(),
        "loop" => mode_loop(false),
        "commloop" => mode_loop(true),
        "commabort" => mode_abort(),
        "hostile" => mode_hostile(),
        "bw" => mode_bw(),
        "arbw" => mode_collbw(Coll::AllReduce),
        "agbw" => mode_collbw(Coll::AllGather),
        "rsbw" => mode_collbw(Coll::ReduceScatter),
        "bcbw" => mode_collbw(Coll::Broadcast { root: 0 }),
        "a2abw" => mode_collbw(Coll::AllToAll),
        "exec" => mode_exec(),
        other => fail(format!("unknown mode '{other}'")),
    }
}

/// The job's communicator, its layout, and connections to every rank on
/// another host over the byte mover.
fn connect(world: &Communicator) -> (Layout, Links) {
    let layout = ok(Layout::gather(world), "layout");
    let me = world.rank();
    let net = ok(TcpNet::new(ok(TcpConfig::for_job(), "net config")), "net");
    let deadline = Instant::now() + Duration::from_secs(60);
    let links = ok(
        Links::connect(net, world, me, &layout.remote(me), deadline),
        "connecting",
    );
    (layout, links)
}

/// This rank's cross-host executor; also its listener's connect handle.
fn cross_host(world: &Communicator) -> (CrossHost, Vec<u8>) {
    let (layout, links) = connect(world);
    let me = world.rank();
    let handle = links.handles[me].as_bytes().to_vec();
    let h = layout.host(me);
    let local = ok(world.split(Some(h as u32), me as i32), "host split")
        .unwrap_or_else(|| fail("no host-local communicator"));
    let mover = CommMover::new(local, layout.members(h).to_vec());
    let timeout = ok(Config::from_env(), "config").timeout;
    let x = ok(
        CrossHost::new(layout, links, Box::new(mover), "net-worker", timeout),
        "engine",
    );
    (x, handle)
}

/// The element rank `r` holds at `i` in case `case`.
fn elem(dt: DataType, op: ReduceOp, seed: u64, case: u64, r: usize, i: usize) -> Val {
    value(dt, Some(op), input_seed(seed, case, r), i)
}

/// Runs one checked collective; Err names the first wrong element.
#[allow(clippy::too_many_arguments)]
fn check(
    x: &mut CrossHost,
    coll: Coll,
    dt: DataType,
    op: ReduceOp,
    count: usize,
    seed: u64,
    case: u64,
) -> Result<(), String> {
    let (n, me, es) = (x.layout().n(), x.rank(), dt.size());
    let (ns, nr) = coll.sizes(count, n);
    let mut send = vec![0u8; ns * es];
    for i in 0..ns {
        encode(
            dt,
            elem(dt, op, seed, case, me, i),
            &mut send[i * es..(i + 1) * es],
        );
    }
    let poison = 0xA5u8;
    let mut recv = vec![poison; nr * es];
    let my_op = match op {
        ReduceOp::PreMulSum(_) => ReduceOp::PreMulSum(premul_scalar(dt, me)),
        o => o,
    };
    unsafe { x.collective(coll, send.as_ptr(), recv.as_mut_ptr(), count, dt, my_op) }
        .map_err(|e| e.to_string())?;
    let reduced = |at: usize| reduce_ref(dt, op, n, |r| elem(dt, op, seed, case, r, at));
    for i in 0..nr {
        let got = &recv[i * es..(i + 1) * es];
        let (want, tol) = match coll {
            Coll::AllReduce => reduced(i),
            Coll::Reduce { root } if root == me => reduced(i),
            Coll::Reduce { .. } => {
                if got.iter().any(|&b| b != poison) {
                    return Err(format!("a non-root's output was written at {i}"));
                }
                continue;
            }
            Coll::ReduceScatter => reduced(me * count + i),
            Coll::AllGather => (elem(dt, op, seed, case, i / count, i % count), 0.0),
            Coll::Broadcast { root } => (elem(dt, op, seed, case, root, i), 0.0),
            Coll::AllToAll => (
                elem(dt, op, seed, case, i / count, me * count + i % count),
                0.0,
            ),
        };
        if !matches(decode(dt, got), want, tol) {
            return Err(format!(
                "element {i}: {:?}, expected {want:?} (tolerance {tol})",
                decode(dt, got)
            ));
        }
    }
    Ok(())
}

/// `coll SEED`: every collective in every shape that fits (and the tuner's
/// choice), several types, every reduction, counts 1, 1023 and 262147;
/// then a ring of sends and receives.
fn mode_coll() {
    let seed: u64 = ok(arg(2, "1").parse(), "seed");
    let world = ok(Communicator::from_env(), "init");
    let (mut x, _) = cross_host(&world);
    let n = x.layout().n();
    let colls = [
        Coll::AllReduce,
        Coll::ReduceScatter,
        Coll::Reduce { root: n - 1 },
        Coll::AllGather,
        Coll::Broadcast { root: 1 },
        Coll::AllToAll,
    ];
    let mut case = 0u64;
    for coll in colls {
        let reduces = matches!(
            coll,
            Coll::AllReduce | Coll::ReduceScatter | Coll::Reduce { .. }
        );
        let mut shapes: Vec<Option<Shape>> = [Shape::Rails, Shape::Leaders, Shape::Direct]
            .into_iter()
            .filter(|s| s.fits(coll, x.layout()))
            .map(Some)
            .collect();
        shapes.push(None);
        for shape in shapes {
            x.shape = shape;
            for count in [1usize, 1023, 262_147] {
                let types: &[DataType] = if count > 1023 {
                    &[DataType::F32]
                } else {
                    &[
                        DataType::F32,
                        DataType::I32,
                        DataType::Bf16,
                        DataType::F8E4M3,
                    ]
                };
                for &dt in types {
                    let ops: Vec<ReduceOp> = if !reduces {
                        vec![ReduceOp::Sum]
                    } else if count > 1023 {
                        vec![ReduceOp::Sum, ReduceOp::Avg]
                    } else {
                        let mut v = ReduceOp::BUILTIN.to_vec();
                        v.push(ReduceOp::PreMulSum(0.0));
                        v
                    };
                    for op in ops {
                        case += 1;
                        if let Err(e) = check(&mut x, coll, dt, op, count, seed, case) {
                            fail(format!(
                                "{} {} {count} x {} {op}: {e}",
                                coll.name(),
                                shape.map_or("tuned", Shape::name),
                                dt.name()
                            ));
                        }
                    }
                }
            }
        }
    }
    // A ring of sends and receives, and one to the next rank on this host.
    let me = world.rank();
    let count = 100_003;
    let data = |from: usize, to: usize| -> Vec<u8> {
        (0..count * 4)
            .map(|i| (i * 7 + from * 31 + to) as u8)
            .collect()
    };
    let (next, prev) = ((me + 1) % n, (me + n - 1) % n);
    let out = data(me, next);
    let mut got = vec![0u8; count * 4];
    let r = unsafe {
        x.send_recv(
            &[(next, out.as_ptr(), count)],
            &[(prev, got.as_mut_ptr(), count)],
            DataType::F32,
        )
    };
    ok(r, "send/recv ring");
    if got != data(prev, me) {
        fail("send/recv ring: wrong data");
    }
    println!("@ checked={case}");
    drop(x);
    ok(world.destroy(), "destroy");
}

/// `loop COUNT`: all-reduces of COUNT floats until one fails (a peer was
/// killed or stopped); touches `running.<rank>` after the first. On the
/// error prints `@ error=...` (spaces as `_`) and `@ at_ms=` (epoch).
/// `commloop COUNT`: the same through the communicator's own all-reduce
/// (its cross-host engine when `WEFT_CROSSHOST_MIN_BYTES` says so).
fn mode_loop(through_comm: bool) {
    let count: usize = ok(arg(2, "1000000").parse(), "count");
    let world = ok(Communicator::from_env(), "init");
    let me = world.rank();
    // Through the communicator its own engine runs them
    // (`WEFT_CROSSHOST_MIN_BYTES`); else the engine is driven directly.
    let mut x = (!through_comm).then(|| cross_host(&world).0);
    let n = world.count() as f32;
    let send = vec![1.0f32; count];
    let mut recv = vec![0.0f32; count];
    let started = Instant::now();
    for i in 0.. {
        let r = match x.as_mut() {
            Some(x) => x.all_reduce(&send, &mut recv, ReduceOp::Sum),
            None => world.all_reduce(&send, &mut recv, ReduceOp::Sum),
        };
        match r {
            Ok(()) => {
                if recv[count / 2] != n {
                    fail(format!(
                        "iteration {i}: {} where {n} was expected",
                        recv[count / 2]
                    ));
                }
                if i == 0 {
                    ok(
                        std::fs::write(ctl().join(format!("running.{me}")), b""),
                        "marker",
                    );
                }
            }
            Err(e) => {
                println!("@ at_ms={} iterations={i}", now_ms());
                println!("@ error={}", e.to_string().replace(' ', "_"));
                std::process::exit(0);
            }
        }
        if started.elapsed() > Duration::from_secs(90) {
            fail("no failure within 90 s");
        }
    }
}

/// `commabort`: a large all-reduce through the communicator (on its
/// cross-host engine) that the last rank never joins; every other rank
/// aborts its communicator from another thread after 500 ms. Prints how
/// long after the abort the call returned and its error.
fn mode_abort() {
    let world = ok(Communicator::from_env(), "init");
    let n = world.count();
    let mut v = vec![1.0f32; 1 << 20];
    // A first call builds the engine everywhere (the last rank too).
    ok(
        world.all_reduce_in_place(&mut v, ReduceOp::Sum),
        "first all-reduce",
    );
    if world.rank() == n - 1 {
        std::thread::sleep(Duration::from_secs(3));
        std::process::exit(0);
    }
    let at = std::sync::Mutex::new(None);
    std::thread::scope(|sc| {
        sc.spawn(|| {
            std::thread::sleep(Duration::from_millis(500));
            *at.lock().unwrap() = Some(Instant::now());
            ok(world.abort(), "abort");
        });
        let r = world.all_reduce_in_place(&mut v, ReduceOp::Sum);
        let t = at.lock().unwrap().map(|t| t.elapsed());
        match (r, t) {
            (Err(e), Some(t)) => {
                println!("@ after_ms={}", t.as_millis());
                println!("@ error={}", e.to_string().replace(' ', "_"));
            }
            (Err(e), None) => fail(format!("failed before the abort: {e}")),
            (Ok(()), _) => fail("the call without the last rank succeeded"),
        }
    });
}

/// `hostile ROUNDS`: publishes this rank's connect handle (hex, in
/// `handle.<rank>`), waits for `go`, then runs ROUNDS checked all-reduces
/// across hosts and prints what the listener refused.
fn mode_hostile() {
    let rounds: usize = ok(arg(2, "20").parse(), "rounds");
    let world = ok(Communicator::from_env(), "init");
    let me = world.rank();
    let (mut x, handle) = cross_host(&world);
    let dir = ctl();
    let hex: String = handle.iter().map(|b| format!("{b:02x}")).collect();
    ok(
        std::fs::write(dir.join(format!("handle.{me}")), hex),
        "handle file",
    );
    let t = Instant::now();
    while !dir.join("go").exists() {
        if t.elapsed() > Duration::from_secs(60) {
            fail("never told to go");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let n = x.layout().n() as f32;
    for i in 0..rounds {
        let send = vec![1.0f32; 65_537 + i];
        let mut recv = vec![0.0f32; send.len()];
        ok(x.all_reduce(&send, &mut recv, ReduceOp::Sum), "all_reduce");
        if recv.iter().any(|&v| v != n) {
            fail(format!("round {i}: wrong sum"));
        }
    }
    let s = tcp::listener_stats();
    println!(
        "@ rounds={rounds} accepted={} refused={} unauthenticated={} evicted={}",
        s.accepted, s.refused, s.unauthenticated, s.evicted
    );
    drop(x);
    ok(world.destroy(), "destroy");
}

/// `ITERS BYTES...` from the arguments.
fn iters_and_sizes() -> (usize, Vec<usize>) {
    let iters = ok(arg(2, "4").parse(), "iters");
    let sizes = std::env::args()
        .skip(3)
        .map(|s| ok(s.parse(), "size"))
        .collect();
    (iters, sizes)
}

/// The best of three runs of `f` (each after a barrier), in seconds: the
/// slowest rank's time of each run.
fn best_of_three(world: &Communicator, mut f: impl FnMut() -> f64) -> f64 {
    let mut best = f64::MAX;
    for _ in 0..3 {
        ok(
            world.all_reduce_in_place(&mut [0u8; 8], ReduceOp::Max),
            "barrier",
        );
        let mut secs = [f()];
        ok(world.all_reduce_in_place(&mut secs, ReduceOp::Max), "time");
        best = best.min(secs[0]);
    }
    best
}

/// Posts `iters` requests on `comm` with `post`, two in flight, each
/// waited with `done` (which says whether it completed).
fn pump<C: ?Sized>(
    iters: usize,
    comm: &mut C,
    post: impl Fn(&mut C) -> Request,
    done: impl Fn(&mut C, Request) -> bool,
) {
    let mut inflight = std::collections::VecDeque::new();
    for _ in 0..iters {
        if inflight.len() >= 2 {
            let r = inflight.pop_front().unwrap();
            while !done(comm, r) {}
        }
        inflight.push_back(post(comm));
    }
    for r in inflight {
        while !done(comm, r) {}
    }
}

/// `bw ITERS BYTES...` (2 ranks): rank 0 sends ITERS messages of each size
/// to rank 1 over one byte mover connection (`WEFT_NET_SOCKETS` sockets),
/// two in flight; rank 0 prints `@ gbs_<bytes>=` (GB/s, the slower side's
/// clock: first post to last completion, best of three).
fn mode_bw() {
    let (iters, sizes) = iters_and_sizes();
    let world = ok(Communicator::from_env(), "init");
    let me = world.rank();
    let (_, mut links) = connect(&world);
    let peer = 1 - me;
    let max = sizes.iter().copied().max().unwrap_or(0);
    // One buffer for every message: only the bytes' movement is measured.
    let mut buf = vec![1u8; max];
    let at = buf.as_mut_ptr();
    for &bytes in &sizes {
        let best = best_of_three(&world, || {
            let t = Instant::now();
            if me == 0 {
                let c = links.send.get_mut(&peer).unwrap().as_mut();
                let mr = ok(c.reg_mr(at, bytes, MemKind::Host), "reg");
                pump(
                    iters,
                    c,
                    |c| {
                        ok(unsafe { c.isend(&mr, at, bytes, 0) }, "isend")
                            .unwrap_or_else(|| fail("isend: busy"))
                    },
                    |c, r| ok(c.test(r), "send").is_some(),
                );
                ok(c.dereg_mr(&mr), "dereg");
            } else {
                let c = links.recv.get_mut(&peer).unwrap().as_mut();
                let mr = ok(c.reg_mr(at, bytes, MemKind::Host), "reg");
                let b = RecvBuf {
                    mr: &mr,
                    ptr: at,
                    len: bytes,
                    tag: 0,
                };
                pump(
                    iters,
                    c,
                    |c| {
                        ok(unsafe { c.irecv(&[b]) }, "irecv").unwrap_or_else(|| fail("irecv: busy"))
                    },
                    |c, r| ok(c.test(r), "recv").is_some(),
                );
                ok(c.dereg_mr(&mr), "dereg");
            }
            t.elapsed().as_secs_f64()
        });
        if me == 0 {
            println!("@ gbs_{bytes}={:.3}", (bytes * iters) as f64 / best / 1e9);
        }
    }
    drop(links);
    drop(buf);
    ok(world.destroy(), "destroy");
}

/// `arbw|agbw|rsbw|bcbw|a2abw ITERS BYTES...`: the engine's all-reduce,
/// all-gather, reduce-scatter, broadcast (root 0) or all-to-all (f32, sum,
/// the tuner's shape) of each size (nccl-tests' size: the larger buffer),
/// ITERS calls timed after one warm-up, best of three; rank 0 prints
/// `@ busbw_<bytes>=` (GB/s, nccl-tests' bus bandwidth).
fn mode_collbw(coll: Coll) {
    let (iters, sizes) = iters_and_sizes();
    let world = ok(Communicator::from_env(), "init");
    let (mut x, _) = cross_host(&world);
    let n = x.layout().n();
    for &bytes in &sizes {
        // `bytes`: nccl-tests' size (the larger of input and output).
        let (ns, nr) = coll.sizes(1, n);
        let count = bytes / 4 / ns.max(nr);
        let send = vec![1.0f32; count * ns];
        let mut recv = vec![0.0f32; count * nr];
        let mut once = |x: &mut CrossHost| unsafe {
            x.collective(
                coll,
                send.as_ptr().cast(),
                recv.as_mut_ptr().cast(),
                count,
                DataType::F32,
                ReduceOp::Sum,
            )
        };
        ok(once(&mut x), "warm-up");
        let best = best_of_three(&world, || {
            let t = Instant::now();
            for _ in 0..iters {
                ok(once(&mut x), coll.name());
            }
            t.elapsed().as_secs_f64() / iters as f64
        });
        if world.rank() == 0 {
            // nccl-tests' bus bandwidth factors.
            let factor = match coll {
                Coll::AllReduce => 2.0 * (n - 1) as f64 / n as f64,
                Coll::Broadcast { .. } | Coll::Reduce { .. } => 1.0,
                _ => (n - 1) as f64 / n as f64,
            };
            println!("@ busbw_{bytes}={:.3}", bytes as f64 * factor / best / 1e9);
        }
    }
    drop(x);
    ok(world.destroy(), "destroy");
}

/// `exec PROGRAM ARGS...`: runs PROGRAM inside this rank's namespace (how
/// the tests start `weft bench-rank` on namespace hosts).
fn mode_exec() {
    use std::os::unix::process::CommandExt;
    let args: Vec<String> = std::env::args().skip(2).collect();
    let Some((prog, rest)) = args.split_first() else {
        fail("exec: no program");
    };
    let e = std::process::Command::new(prog).args(rest).exec();
    fail(format!("exec {prog}: {e}"));
}
