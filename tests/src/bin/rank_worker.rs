//! One rank of a multi-process test. Started by the tests in `tests/tests/`
//! with the launcher's environment; the first argument names the scenario.
//! Prints `@ key=value` facts for the test to check and exits non-zero on any
//! unexpected result.

use libcomm::{CommState, Communicator, Config, DataType, Error, Group, Op, ReduceOp, UniqueId};
use std::io::{Read, Write};
use std::time::{Duration, Instant};
use weft_tests::matrix::{self, COLLS, Coll};

#[path = "sidecar/modes.rs"]
mod sidecar_modes;
#[path = "recovery/train.rs"]
mod train;

fn fail(msg: impl std::fmt::Display) -> ! {
    eprintln!("FAIL: {msg}");
    std::process::exit(1);
}

fn ok<T>(r: libcomm::Result<T>, what: &str) -> T {
    r.unwrap_or_else(|e| fail(format!("{what}: {e}")))
}

fn world() -> Communicator {
    ok(Communicator::from_env(), "init from env")
}

fn arg(i: usize, default: &str) -> String {
    std::env::args()
        .nth(i)
        .unwrap_or_else(|| default.to_string())
}

fn main() {
    let mode = arg(1, "");
    match mode.as_str() {
        "matrix" => mode_matrix(),
        "split" => mode_split(),
        "nbsplit" => mode_nbsplit(),
        "abort" => mode_abort(),
        "kill" => mode_kill(),
        "idle_kill" => mode_idle_kill(),
        "alltoall" => mode_alltoall(),
        "badinput" => mode_badinput(),
        "mismatch" => mode_mismatch(),
        "eager_ring" => mode_eager_ring(),
        "eager_idle" => mode_eager_idle(),
        "eager_destroy" => mode_eager_destroy(),
        "eager_cap" => mode_eager_cap(),
        "hostile" => mode_hostile(),
        "sc_traced" => sidecar_modes::traced(),
        "sc_storm" => sidecar_modes::storm(),
        "sc_exit" => sidecar_modes::exit_without_close(),
        "sc_hang" => sidecar_modes::hang(),
        "sc_behind" => sidecar_modes::behind(),
        "sc_payload" => sidecar_modes::payload(),
        "sc_bw" => sidecar_modes::bandwidth(),
        "sc_hol" => sidecar_modes::head_of_line(),
        "sc_capi" => sidecar_modes::capi(),
        "sc_flood" => sidecar_modes::flood(),
        "sc_quick_exit" => sidecar_modes::quick_exit(),
        "sc_cut" => sidecar_modes::cut(),
        "train" => {
            let a: Vec<String> = std::env::args().skip(2).collect();
            if let Err(e) = train::run(&a) {
                fail(e)
            }
        }
        other => fail(format!("unknown mode '{other}'")),
    }
}

/// Every collective x type x op x count, in place and out of place.
fn mode_matrix() {
    let comm = world();
    let seed: u64 = arg(2, "1").parse().unwrap();
    let only: Vec<Coll> = match std::env::args().nth(3).filter(|a| a != "all") {
        None => Vec::new(),
        Some(list) => list
            .split(',')
            .map(|s| {
                *COLLS
                    .iter()
                    .find(|c| format!("{c:?}").eq_ignore_ascii_case(s))
                    .unwrap_or_else(|| fail(format!("no collective {s}")))
            })
            .collect(),
    };
    let types: Vec<DataType> = match std::env::args().nth(4) {
        None => Vec::new(),
        Some(list) => list
            .split(',')
            .map(|t| t.parse().unwrap_or_else(|e| fail(e)))
            .collect(),
    };
    let (cases, fails) = matrix::run_all(&comm, seed, &only, &types);
    for f in &fails {
        eprintln!("{f}");
    }
    println!("@ cases={cases} failures={}", fails.len());
    ok(comm.destroy(), "destroy");
    if !fails.is_empty() {
        std::process::exit(1);
    }
}

fn sum_check(c: &Communicator, expect: i64, what: &str) {
    let mut v = [c.rank() as i64 + 1, 7];
    ok(c.all_reduce_in_place(&mut v, ReduceOp::Sum), what);
    if v != [expect, 7 * c.count() as i64] {
        fail(format!(
            "{what}: got {v:?}, want [{expect}, {}]",
            7 * c.count()
        ));
    }
}

/// Colors and keys, NO_COLOR, nested splits, and a split of a split used
/// concurrently with its parent.
fn mode_split() {
    let w = world();
    let (n, r) = (w.count(), w.rank());
    // Two colors, keys reversing the order, rank 0 opting out.
    let color = if r == 0 { None } else { Some((r % 2) as u32) };
    let child = ok(w.split(color, -(r as i32)), "split");
    match (&child, color) {
        (None, None) => {}
        (Some(c), Some(col)) => {
            let members: Vec<usize> = (1..n).filter(|x| x % 2 == col as usize).collect();
            // key = -rank: the highest parent rank becomes child rank 0.
            let want_rank = members.iter().rev().position(|&x| x == r).unwrap();
            if c.rank() != want_rank || c.count() != members.len() {
                fail(format!(
                    "child rank {} of {}, want {want_rank} of {}",
                    c.rank(),
                    c.count(),
                    members.len()
                ));
            }
            let mut v = [r as i64];
            ok(
                c.all_reduce_in_place(&mut v, ReduceOp::Sum),
                "child all_reduce",
            );
            if v[0] != members.iter().map(|&x| x as i64).sum::<i64>() {
                fail(format!("child sum {} wrong", v[0]));
            }
        }
        _ => fail("NO_COLOR must give no communicator and a color must give one"),
    }
    // Equal keys: ordered by parent rank. Nested: split the world by halves,
    // then each half again; use the grandchild and the world concurrently.
    let half = ok(w.split(Some((r * 2 / n) as u32), 0), "split halves").unwrap();
    let quarter = ok(
        half.split(Some((half.rank() % 2) as u32), 0),
        "nested split",
    )
    .unwrap();
    let expect_q: i64 = {
        let hm: Vec<usize> = (0..n).filter(|x| x * 2 / n == r * 2 / n).collect();
        hm.iter()
            .enumerate()
            .filter(|(i, _)| i % 2 == half.rank() % 2)
            .map(|(_, &x)| x as i64 + 1)
            .sum()
    };
    let rounds = 200;
    std::thread::scope(|s| {
        s.spawn(|| {
            for i in 0..rounds {
                let mut v = [r as i64 + 1, 7];
                ok(
                    quarter.all_reduce_in_place(&mut v, ReduceOp::Sum),
                    "grandchild all_reduce",
                );
                if v[0] != expect_q {
                    fail(format!("grandchild round {i}: {} != {expect_q}", v[0]));
                }
            }
        });
        s.spawn(|| {
            for _ in 0..rounds {
                sum_check(&w, (n * (n + 1) / 2) as i64, "world all_reduce");
            }
        });
    });
    for c in [quarter, half] {
        ok(c.destroy(), "destroy child");
    }
    if let Some(c) = child {
        ok(c.destroy(), "destroy");
    }
    println!("@ split=ok");
}

/// Non-blocking init of several communicators, then splits issued from
/// several threads at once with collectives in between; repeated.
fn mode_nbsplit() {
    let w = world();
    let reps: usize = arg(2, "10").parse().unwrap();
    let threads: usize = arg(3, "4").parse().unwrap();
    let (n, r) = (w.count(), w.rank());
    for rep in 0..reps {
        // Rank 0 makes one fresh id per thread and shares them over the world.
        let mut ids = vec![0u8; 128 * threads];
        if r == 0 {
            for t in 0..threads {
                ids[t * 128..(t + 1) * 128]
                    .copy_from_slice(&ok(UniqueId::new(), "unique id").to_bytes());
            }
        }
        ok(w.broadcast_in_place(&mut ids, 0), "share ids");
        let nb = Config::from_env().unwrap().blocking(false);
        let comms: Vec<Communicator> = (0..threads)
            .map(|t| {
                let id = ok(UniqueId::from_bytes(&ids[t * 128..(t + 1) * 128]), "id");
                ok(
                    Communicator::init_with_config(&id, n, r, nb.clone()),
                    "non-blocking init",
                )
            })
            .collect();
        std::thread::scope(|s| {
            for (t, c) in comms.iter().enumerate() {
                let nb = nb.clone();
                s.spawn(move || {
                    // Poll like an NCCL program would.
                    let start = Instant::now();
                    while c.state() == CommState::Initializing {
                        match c.async_error() {
                            Err(Error::InProgress) => std::thread::yield_now(),
                            Err(e) => fail(format!("rep {rep} thread {t}: init failed: {e}")),
                            Ok(()) => break,
                        }
                        if start.elapsed() > Duration::from_secs(60) {
                            fail("init never finished");
                        }
                    }
                    sum_check(c, (n * (n + 1) / 2) as i64, "collective before split");
                    let child = ok(
                        c.split_with_config(Some((r % 2) as u32), r as i32, nb),
                        "split",
                    )
                    .unwrap();
                    ok(
                        child.wait_ready(Some(Duration::from_secs(60))),
                        "child ready",
                    );
                    // sum_check contributes child ranks + 1.
                    let m = (0..n).filter(|x| x % 2 == r % 2).count() as i64;
                    sum_check(&child, m * (m + 1) / 2, "collective on child");
                    sum_check(c, (n * (n + 1) / 2) as i64, "collective after split");
                    ok(child.destroy(), "destroy child");
                });
            }
            // The world keeps working meanwhile, from the main thread.
            sum_check(&w, (n * (n + 1) / 2) as i64, "world during splits");
        });
        for c in comms {
            ok(c.destroy(), "destroy");
        }
    }
    println!("@ reps={reps} threads={threads}");
}

/// Rank 0 aborts while every other rank is blocked in a collective it never
/// joins; with `thread` as argument, rank 1 also aborts its own communicator
/// from a second thread while its main thread waits.
fn mode_abort() {
    let w = world();
    let r = w.rank();
    let mut buf = vec![1.0f32; 1 << 20];
    if r == 0 {
        std::thread::sleep(Duration::from_millis(500));
        let t = Instant::now();
        ok(w.abort(), "abort");
        println!("@ aborted_ms={}", t.elapsed().as_millis());
        match w.all_reduce_in_place(&mut buf, ReduceOp::Sum) {
            Err(Error::InvalidState {
                state: CommState::Aborted,
                ..
            }) => {}
            other => fail(format!("use after abort gave {other:?}")),
        }
        ok(w.destroy(), "destroy after abort");
        return;
    }
    let t = Instant::now();
    let e = w
        .all_reduce_in_place(&mut buf, ReduceOp::Sum)
        .expect_err("must fail");
    println!(
        "@ error_ms={} aborted_by={}",
        t.elapsed().as_millis(),
        match e {
            Error::Aborted { by: Some(b), .. } => b.to_string(),
            ref other => format!("other:{other}").replace(' ', "_"),
        }
    );
    // Later calls fail at once too.
    if w.all_reduce_in_place(&mut buf, ReduceOp::Sum).is_ok() {
        fail("a later call succeeded");
    }
}

/// One rank SIGKILLs itself in the middle of a stream of collectives; the
/// others must fail within the configured time.
fn mode_kill() {
    let w = world();
    let victim = std::env::var("WEFT_TEST_VICTIM")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(w.count() - 1);
    let mut buf = vec![1.0f32; 4 << 20];
    if w.rank() == victim {
        std::thread::spawn(|| {
            std::thread::sleep(Duration::from_millis(300));
            unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
        });
    }
    let mut last_ok = Instant::now();
    for i in 0.. {
        match w.all_reduce_in_place(&mut buf, ReduceOp::Sum) {
            Ok(()) => last_ok = Instant::now(),
            Err(e) => {
                println!(
                    "@ iteration={i} detect_ms={} kind={:?}",
                    last_ok.elapsed().as_millis(),
                    e.kind()
                );
                eprintln!("error: {e}");
                break;
            }
        }
        buf.iter_mut().for_each(|x| *x = 1.0);
    }
    // Every later call fails immediately.
    let t = Instant::now();
    if w.all_reduce_in_place(&mut buf, ReduceOp::Sum).is_ok()
        || t.elapsed() > Duration::from_secs(1)
    {
        fail("call after failure did not fail at once");
    }
}

/// The last rank is SIGKILLed while every rank is idle (no operation in
/// flight, as when a survivor's work sits in a GPU kernel): the survivors
/// learn it only by polling `async_error` (ncclCommGetAsyncError, what
/// PyTorch's watchdog calls), which must name the dead rank.
fn mode_idle_kill() {
    let w = world();
    let victim = w.count() - 1;
    let mut buf = vec![1.0f32; 1024];
    ok(w.all_reduce_in_place(&mut buf, ReduceOp::Sum), "all_reduce");
    // Every rank is done with it (outside the library: a failure raised
    // while a peer still finishes the all-reduce would fail that instead).
    let dir = std::path::PathBuf::from(
        std::env::var("WEFT_TEST_CTL").unwrap_or_else(|_| fail("WEFT_TEST_CTL is not set")),
    );
    publish(&dir.join(format!("done.{}", w.rank())), "");
    if w.rank() == victim {
        for r in 0..w.count() {
            wait_file(&dir.join(format!("done.{r}")));
        }
        unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
    }
    let t = Instant::now();
    loop {
        if let Err(e) = w.async_error() {
            let msg = e.to_string();
            println!(
                "@ detect_ms={} kind={:?} names_victim={}",
                t.elapsed().as_millis(),
                e.kind(),
                msg.contains(&format!("rank {victim} "))
            );
            eprintln!("error: {msg}");
            break;
        }
        if t.elapsed() > Duration::from_secs(15) {
            fail("async_error still Ok 15 s after the peer was killed");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// All-to-all built from grouped send/recv, repeated.
fn mode_alltoall() {
    let w = world();
    let reps: usize = arg(2, "3").parse().unwrap();
    let count: usize = arg(3, "16").parse().unwrap();
    let (n, r) = (w.count(), w.rank());
    let t = Instant::now();
    for rep in 0..reps {
        let send: Vec<u32> = (0..n * count)
            .map(|i| ((r * 1_000_003 + i) as u32) ^ rep as u32)
            .collect();
        let mut recv = vec![u32::MAX; n * count];
        {
            let mut g = Group::new();
            for (p, chunk) in recv.chunks_mut(count).enumerate() {
                ok(g.recv(&w, chunk, p).map(|_| ()), "post recv");
            }
            for p in 0..n {
                ok(
                    g.send(&w, &send[p * count..(p + 1) * count], p).map(|_| ()),
                    "post send",
                );
            }
            ok(g.execute(), "grouped all-to-all");
        }
        for p in 0..n {
            for i in 0..count {
                let want = ((p * 1_000_003 + r * count + i) as u32) ^ rep as u32;
                if recv[p * count + i] != want {
                    fail(format!(
                        "rep {rep}: from {p} element {i}: {} != {want}",
                        recv[p * count + i]
                    ));
                }
            }
        }
    }
    println!("@ alltoall_ms={}", t.elapsed().as_millis());
    ok(w.destroy(), "destroy");
}

fn expect_err<T: std::fmt::Debug>(
    r: libcomm::Result<T>,
    kind: libcomm::ErrorKind,
    words: &str,
    what: &str,
) {
    match r {
        Err(e) if e.kind() == kind && e.to_string().contains(words) => {}
        Err(e) => fail(format!(
            "{what}: got {:?} '{e}', want {kind:?} containing '{words}'",
            e.kind()
        )),
        Ok(v) => fail(format!("{what}: succeeded ({v:?}), want {kind:?}")),
    }
}

/// Bad input of every kind gets a clear error, and the job's communicators
/// keep working.
fn mode_badinput() {
    use libcomm::ErrorKind::*;
    let w = world();
    let (n, r) = (w.count(), w.rank());
    let a = [1.0f32; 10];
    let mut b = [0.0f32; 9];
    expect_err(
        w.all_reduce(&a, &mut b, ReduceOp::Sum),
        InvalidArgument,
        "10 elements",
        "length mismatch",
    );
    let mut big = vec![0.0f32; 10 * n + 1];
    expect_err(
        w.all_gather(&a, &mut big),
        InvalidArgument,
        "receive must hold",
        "all_gather sizes",
    );
    unsafe {
        expect_err(
            w.submit(Op::all_reduce(
                std::ptr::null(),
                b.as_mut_ptr().cast(),
                5,
                DataType::F32,
                ReduceOp::Sum,
            )),
            InvalidArgument,
            "NULL",
            "null send",
        );
        expect_err(
            w.submit(Op::all_reduce(
                a.as_ptr().cast(),
                std::ptr::null_mut(),
                5,
                DataType::F32,
                ReduceOp::Sum,
            )),
            InvalidArgument,
            "NULL",
            "null recv",
        );
        expect_err(
            w.submit(Op::all_reduce(
                a.as_ptr().cast(),
                b.as_mut_ptr().cast(),
                usize::MAX / 2,
                DataType::F64,
                ReduceOp::Sum,
            )),
            InvalidArgument,
            "overflow",
            "overflowing count",
        );
        expect_err(
            w.submit(Op::all_reduce(
                a.as_ptr().cast(),
                (a.as_ptr() as *mut u8).add(4),
                5,
                DataType::F32,
                ReduceOp::Sum,
            )),
            InvalidArgument,
            "overlap",
            "partial overlap",
        );
    }
    expect_err(
        w.send(&a, n),
        InvalidArgument,
        "out of range",
        "peer out of range",
    );
    expect_err(
        w.broadcast_in_place(&mut b, n + 3),
        InvalidArgument,
        "out of range",
        "root out of range",
    );
    expect_err(
        DataType::from_raw(12),
        InvalidArgument,
        "unknown data type",
        "bad dtype",
    );
    expect_err(
        "bogus".parse::<ReduceOp>(),
        InvalidArgument,
        "unknown reduction",
        "bad op",
    );
    let id = ok(UniqueId::new(), "unique id");
    expect_err(
        Communicator::init(&id, 4, 4),
        InvalidArgument,
        "out of range",
        "rank >= nranks",
    );
    expect_err(
        Communicator::init(&id, 0, 0),
        InvalidArgument,
        "at least 1",
        "zero ranks",
    );
    let mut bytes = id.to_bytes();
    bytes[50] ^= 0x10;
    expect_err(
        UniqueId::from_bytes(&bytes),
        InvalidArgument,
        "corrupted",
        "corrupted id",
    );
    expect_err(
        UniqueId::from_bytes(&[0u8; 128]),
        InvalidArgument,
        "not a Weft unique id",
        "foreign id",
    );

    // A fresh communicator whose root faces stray clients and impostors first.
    let mut shared = [0u8; 128];
    if r == 0 {
        shared = ok(UniqueId::new(), "unique id").to_bytes();
    }
    ok(w.broadcast_in_place(&mut shared, 0), "share id");
    let id2 = ok(UniqueId::from_bytes(&shared), "id");
    if r == 0 {
        // Garbage, a silent client holding its connection, an impostor with the
        // right address but the wrong secret: each refused, none disturbs init.
        let mut garbage = std::net::TcpStream::connect(id2.root_addr()).expect("connect root");
        garbage
            .write_all(b"GET / HTTP/1.1\r\nHost: weft\r\n\r\n")
            .unwrap();
        garbage
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        let mut reply = Vec::new();
        let _ = garbage.read_to_end(&mut reply);
        if !String::from_utf8_lossy(&reply).contains("not a Weft bootstrap message") {
            fail(format!(
                "garbage was not answered with a clear error: {:?}",
                String::from_utf8_lossy(&reply)
            ));
        }
        let _silent = std::net::TcpStream::connect(id2.root_addr()).expect("connect root");
        let impostor = UniqueId::from_parts(
            &id2.root_addr().to_string(),
            "impostor",
            "0",
            Some("wrong"),
            Duration::ZERO,
        )
        .unwrap();
        let cfg = Config::from_env()
            .unwrap()
            .init_timeout(Duration::from_secs(5));
        // Rank 1's identity, so the impostor does not try to serve the root itself.
        expect_err(
            Communicator::init_with_config(&impostor, n, 1, cfg),
            RemoteError,
            "authentication failed",
            "impostor",
        );
    }
    let c2 = ok(Communicator::init(&id2, n, r), "init despite stray clients");
    sum_check(&c2, (n * (n + 1) / 2) as i64, "new communicator");
    sum_check(&w, (n * (n + 1) / 2) as i64, "world still fine");
    ok(c2.destroy(), "destroy");
    expect_err(
        c2.destroy(),
        InvalidUsage,
        "second destroy",
        "double destroy",
    );
    expect_err(
        c2.all_reduce_in_place(&mut b, ReduceOp::Sum),
        InvalidUsage,
        "destroyed",
        "use after destroy",
    );
    println!("@ badinput=ok");
}

/// Ranks disagree on the count of one collective on a duplicate communicator:
/// every rank gets an error, and the world is unaffected.
fn mode_mismatch() {
    let w = world();
    let (n, r) = (w.count(), w.rank());
    let dup = ok(w.split(Some(0), 0), "dup").unwrap();
    // WEFT_TEST_MISMATCH_BIG: the other ranks' count takes another algorithm
    // (rank 0's goes through the latency slots, theirs through the rings).
    let big = std::env::var_os("WEFT_TEST_MISMATCH_BIG").is_some();
    let count = match (r, big) {
        (0, _) => 1000,
        (_, false) => 2000,
        (_, true) => 1 << 20,
    };
    let mut v = vec![1i32; count];
    let t = Instant::now();
    let e = dup
        .all_reduce_in_place(&mut v, ReduceOp::Sum)
        .expect_err("mismatch must fail");
    println!(
        "@ mismatch_ms={} kind={:?}",
        t.elapsed().as_millis(),
        e.kind()
    );
    eprintln!("mismatch error: {e}");
    sum_check(&w, (n * (n + 1) / 2) as i64, "world after the mismatch");
    println!("@ world=ok");
}

/// Rank `rank`'s message `round` for the eager point-to-point modes: random
/// (seeded by `WEFT_TEST_SEED`), never zero.
fn eager_data(round: u64, rank: usize, n: usize) -> Vec<f32> {
    use weft_tests::data::splitmix;
    let seed: u64 = std::env::var("WEFT_TEST_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(7);
    let base = splitmix(seed ^ splitmix(round * 1_000_003 + rank as u64));
    (0..n)
        .map(|i| 1.0 + (splitmix(base ^ i as u64) >> 40) as f32 / (1u64 << 24) as f32 * 1000.0)
        .collect()
}

/// Unbatched `send(next)` then `recv(prev)`, each call blocking.
fn eager_ring_step(w: &Communicator, round: u64, count: usize, what: &str) {
    let (n, r) = (w.count(), w.rank());
    let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
    let mine = eager_data(round, r, count);
    let mut got = vec![0f32; count];
    ok(
        w.send(&mine, next),
        &format!("{what}: send {count} floats to {next}"),
    );
    // The rest of the message was copied: the buffer may go at once.
    drop(mine);
    ok(
        w.recv(&mut got, prev),
        &format!("{what}: recv {count} floats from {prev}"),
    );
    if got != eager_data(round, prev, count) {
        fail(format!(
            "{what}: wrong data from rank {prev} ({count} floats)"
        ));
    }
}

/// The ring of unbatched sends as the first operation of the communicator
/// (argument: its size in floats), then a grouped exchange, then the ring
/// at 333 floats, 1 Mi floats and 16 Mi floats (64 MiB).
fn mode_eager_ring() {
    let first: usize = arg(2, "333").parse().unwrap();
    let w = world();
    let (n, r) = (w.count(), w.rank());
    let t = Instant::now();
    eager_ring_step(&w, 0, first, "first operation");
    let a = eager_data(1, r, 4096);
    let mut b = vec![0f32; 4096];
    {
        let mut g = Group::new();
        ok(g.send(&w, &a, (r + 1) % n).map(|_| ()), "group send");
        ok(
            g.recv(&w, &mut b, (r + n - 1) % n).map(|_| ()),
            "group recv",
        );
        ok(g.execute(), "grouped exchange");
    }
    if b != eager_data(1, (r + n - 1) % n, 4096) {
        fail("grouped exchange: wrong data");
    }
    for (k, count) in [333usize, 1 << 20, 16 << 20].into_iter().enumerate() {
        eager_ring_step(&w, 2 + k as u64, count, "after a grouped exchange");
    }
    ok(w.destroy(), "destroy");
    println!("@ ring=ok ring_ms={}", t.elapsed().as_millis());
}

/// Rank 0 sends 64 MiB to rank 1, then makes no libcomm call for 4 s: its
/// background flusher must deliver while it sleeps.
fn mode_eager_idle() {
    let count = 16 << 20;
    let w = world();
    match w.rank() {
        0 => {
            ok(w.send(&eager_data(0, 0, count), 1), "send");
            std::thread::sleep(Duration::from_secs(4));
        }
        1 => {
            let t = Instant::now();
            let mut got = vec![0f32; count];
            ok(w.recv(&mut got, 0), "recv");
            println!("@ recv_ms={}", t.elapsed().as_millis());
            if got != eager_data(0, 0, count) {
                fail("wrong data from rank 0");
            }
        }
        _ => {}
    }
    ok(w.destroy(), "destroy");
}

/// Rank 0 sends 64 MiB that rank 1 never receives, then destroys: destroy
/// must return an error naming rank 1 within the timeout (WEFT_TIMEOUT_MS),
/// not hang. Rank 1 later finds rank 0 gone.
fn mode_eager_destroy() {
    let count = 16 << 20;
    let w = world();
    match w.rank() {
        0 => {
            ok(w.send(&eager_data(0, 0, count), 1), "send");
            let t = Instant::now();
            match w.destroy() {
                Err(e) if e.to_string().contains("rank 1") => {
                    eprintln!("destroy: {e}");
                    println!("@ destroy_ms={} destroy=error", t.elapsed().as_millis());
                }
                other => fail(format!("destroy with an undelivered send gave {other:?}")),
            }
        }
        1 => {
            std::thread::sleep(Duration::from_secs(4));
            let mut got = vec![0f32; count];
            match w.recv(&mut got, 0) {
                Err(e) => {
                    eprintln!("recv: {e}");
                    println!("@ late_recv=error");
                }
                Ok(()) => fail("a receive from a destroyed peer succeeded"),
            }
            let _ = w.destroy();
        }
        _ => {}
    }
}

/// Rank 0 sends 64 MiB to rank 1, which posts its receive only after 1.5 s:
/// the send returns at once (eager), unless WEFT_EAGER_MAX_BYTES is smaller
/// than the message, when it waits for the receive.
fn mode_eager_cap() {
    let count = 16 << 20;
    let w = world();
    match w.rank() {
        0 => {
            let t = Instant::now();
            ok(w.send(&eager_data(0, 0, count), 1), "send");
            println!("@ send_ms={}", t.elapsed().as_millis());
        }
        1 => {
            std::thread::sleep(Duration::from_millis(1500));
            let mut got = vec![0f32; count];
            ok(w.recv(&mut got, 0), "recv");
            if got != eager_data(0, 0, count) {
                fail("wrong data from rank 0");
            }
        }
        _ => {}
    }
    ok(w.destroy(), "destroy");
}

/// Waits (bounded) until the test creates `path`.
fn wait_file(path: &std::path::Path) {
    let t = Instant::now();
    while !path.exists() {
        if t.elapsed() > Duration::from_secs(90) {
            fail(format!("{} never appeared", path.display()));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Writes `text` to `path` at once (the test polls for it).
fn publish(path: &std::path::Path, text: &str) {
    let tmp = std::path::PathBuf::from(format!("{}.tmp", path.display()));
    std::fs::write(&tmp, text).unwrap_or_else(|e| fail(format!("writing {tmp:?}: {e}")));
    std::fs::rename(&tmp, path).unwrap_or_else(|e| fail(format!("renaming {tmp:?}: {e}")));
}

/// `rounds` splits of the world, each used once and destroyed: milliseconds.
fn timed_splits(w: &Communicator, rounds: usize) -> u128 {
    let n = w.count();
    let t = Instant::now();
    for _ in 0..rounds {
        let c = ok(w.split(Some(0), 0), "split").unwrap_or_else(|| fail("no child"));
        sum_check(&c, (n * (n + 1) / 2) as i64, "child all_reduce");
        ok(c.destroy(), "destroy child");
    }
    t.elapsed().as_millis()
}

/// `iters` all-reduces of 1 Mi floats (the job's throughput), in ms; the
/// best of three runs, so one scheduling hiccup on a loaded machine does
/// not count as the attack's doing.
fn timed_allreduces(w: &Communicator, iters: usize) -> u128 {
    let mut buf = vec![1.0f32; 1 << 20];
    (0..3)
        .map(|_| {
            let t = Instant::now();
            for _ in 0..iters {
                ok(w.all_reduce_in_place(&mut buf, ReduceOp::Max), "all_reduce");
            }
            t.elapsed().as_millis()
        })
        .min()
        .unwrap()
}

/// For the attack tests (tests/tests/hostile.rs): timed splits before and
/// after the test attacks this job's ports. The test and the ranks meet
/// through files in `WEFT_TEST_CTL`: a rank with `WEFT_TEST_WAIT_FILE`
/// starts its init only once that file exists; every rank publishes
/// `port.<rank>` (its peer endpoint's port and pid) and `ready.<rank>`
/// after the baseline, then waits for `go`.
fn mode_hostile() {
    let rounds: usize = arg(2, "10").parse().unwrap();
    let dir = std::path::PathBuf::from(
        std::env::var("WEFT_TEST_CTL").unwrap_or_else(|_| fail("WEFT_TEST_CTL is not set")),
    );
    if let Ok(f) = std::env::var("WEFT_TEST_WAIT_FILE") {
        wait_file(&dir.join(f));
    }
    let w = world();
    let (n, r) = (w.count(), w.rank());
    sum_check(&w, (n * (n + 1) / 2) as i64, "world all_reduce");
    let stats = libcomm::listener_stats();
    let port = stats
        .endpoint_ports
        .first()
        .map(|(_, p)| *p)
        .unwrap_or_else(|| fail("no peer endpoint"));
    publish(
        &dir.join(format!("port.{r}")),
        &format!("{port} {}", std::process::id()),
    );
    let baseline = timed_splits(&w, rounds);
    let baseline_ar = timed_allreduces(&w, 10);
    publish(&dir.join(format!("ready.{r}")), &baseline.to_string());
    wait_file(&dir.join("go"));
    let attacked = timed_splits(&w, rounds);
    let attacked_ar = timed_allreduces(&w, 10);
    let s = libcomm::listener_stats();
    println!(
        "@ baseline_ms={baseline} attacked_ms={attacked} baseline_ar_ms={baseline_ar} attacked_ar_ms={attacked_ar} unauthenticated={} evicted={} refused={} parked={} root_refused={} root_unauthenticated={}",
        s.endpoint_unauthenticated,
        s.endpoint_evicted,
        s.endpoint_refused,
        s.endpoint_parked,
        s.root_refused,
        s.root_unauthenticated
    );
    ok(w.destroy(), "destroy");
}
