//! Eager host point-to-point with ranks as threads of one process: an
//! unbatched `send(next); recv(prev)` on every rank of a ring completes at
//! every size (shared memory and TCP), a rank that sends and then makes no
//! more calls still delivers, destroy with a send nobody receives returns an
//! error in bounded time. The same across processes: `tests/tests/p2p.rs`.

use libcomm::{Config, Error, Group, TransportPref};
use std::thread;

mod common;
use common::{comms, each};
use std::time::{Duration, Instant};

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = x;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn seed() -> u64 {
    let s = std::env::var("WEFT_TEST_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
        });
    eprintln!("data seed {s} (rerun with WEFT_TEST_SEED={s})");
    s
}

/// Rank `rank`'s message in round `round`: random, never zero.
fn data(seed: u64, round: u64, rank: usize, n: usize) -> Vec<f32> {
    let base = splitmix(seed ^ splitmix(round * 1_000_003 + rank as u64));
    (0..n)
        .map(|i| {
            let r = splitmix(base ^ i as u64);
            1.0 + (r >> 40) as f32 / (1u64 << 24) as f32 * 1000.0
        })
        .collect()
}

const SIZES: [usize; 3] = [333, 1 << 20, 16 << 20];

/// Unbatched `send(next)` then `recv(prev)` on every rank, each size, as the
/// first operation of a fresh communicator, then after a grouped exchange.
fn ring(n: usize, cfg: Config) {
    let seed = seed();
    for (k, &count) in SIZES.iter().enumerate() {
        let cs = comms(n, cfg.clone());
        let t = Instant::now();
        each(&cs, |c| {
            let (r, n) = (c.rank(), c.count());
            let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
            // First operation between the ranks.
            let mine = data(seed, k as u64, r, count);
            let mut got = vec![0f32; count];
            c.send(&mine, next).unwrap();
            c.recv(&mut got, prev).unwrap();
            assert!(
                got == data(seed, k as u64, prev, count),
                "n={n} count={count} rank {r}: wrong data from {prev} (first op)"
            );
            // A grouped exchange, then the unbatched ring again.
            let a = data(seed, 100 + k as u64, r, 1000);
            let mut b = vec![0f32; 1000];
            let mut g = Group::new();
            g.send(c, &a, next).unwrap().recv(c, &mut b, prev).unwrap();
            g.execute().unwrap();
            assert!(b == data(seed, 100 + k as u64, prev, 1000));
            let mine = data(seed, 200 + k as u64, r, count);
            c.send(&mine, next).unwrap();
            // The caller may reuse its buffer at once: the rest was copied.
            drop(mine);
            c.recv(&mut got, prev).unwrap();
            assert!(
                got == data(seed, 200 + k as u64, prev, count),
                "n={n} count={count} rank {r}: wrong data from {prev} (after a group)"
            );
        });
        for c in &cs {
            c.destroy().unwrap();
        }
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "n={n} count={count}: {:?}",
            t.elapsed()
        );
    }
}

fn bounded() -> Config {
    Config::default().timeout(Some(Duration::from_secs(60)))
}

fn tcp() -> Config {
    let mut c = bounded();
    c.transport = TransportPref::Tcp;
    c
}

#[test]
fn unbatched_ring_2_threads_shm() {
    ring(2, bounded());
}

#[test]
fn unbatched_ring_3_threads_shm() {
    ring(3, bounded());
}

#[test]
fn unbatched_ring_2_threads_tcp() {
    ring(2, tcp());
}

#[test]
fn unbatched_ring_3_threads_tcp() {
    ring(3, tcp());
}

/// Rank 0 sends 64 MiB and then makes no libcomm call for a while: its
/// background flusher delivers, so rank 1's receive completes meanwhile.
fn send_then_idle(cfg: Config) {
    let seed = seed();
    let count = 16 << 20;
    let cs = comms(2, cfg);
    thread::scope(|s| {
        let c0 = &cs[0];
        s.spawn(move || {
            let mine = data(seed, 1, 0, count);
            c0.send(&mine, 1).unwrap();
            drop(mine);
            thread::sleep(Duration::from_secs(4));
        });
        let t = Instant::now();
        let mut got = vec![0f32; count];
        cs[1].recv(&mut got, 0).unwrap();
        assert!(got == data(seed, 1, 0, count));
        assert!(
            t.elapsed() < Duration::from_secs(3),
            "the receive waited for the sender's next call: {:?}",
            t.elapsed()
        );
    });
    for c in &cs {
        c.destroy().unwrap();
    }
}

#[test]
fn send_then_idle_delivers_shm() {
    send_then_idle(bounded());
}

#[test]
fn send_then_idle_delivers_tcp() {
    send_then_idle(tcp());
}

/// A send nobody receives: destroy gives up within the timeout and names
/// the peer.
#[test]
fn destroy_with_a_send_never_received_returns_an_error() {
    let cs = comms(
        2,
        Config::default().timeout(Some(Duration::from_millis(1500))),
    );
    let big = vec![1.5f32; 4 << 20];
    cs[0].send(&big, 1).unwrap();
    let t = Instant::now();
    let e = cs[0].destroy().unwrap_err();
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    let msg = e.to_string();
    assert!(msg.contains("rank 1"), "{msg}");
    assert!(msg.contains("never fully received"), "{msg}");
    // The peer sees rank 0 gone, not a hang.
    let mut got = vec![0f32; 4 << 20];
    let e = cs[1].recv(&mut got, 0).unwrap_err();
    assert!(matches!(e, Error::Remote { .. }), "{e}");
    let _ = cs[1].destroy();
}

/// The peer destroys without receiving while the sender is idle: the
/// sender's async error (NCCL's ncclCommGetAsyncError) says so.
#[test]
fn peer_destroyed_before_receiving_is_the_async_error() {
    let cs = comms(2, bounded());
    let big = vec![2.5f32; 4 << 20];
    cs[0].send(&big, 1).unwrap();
    cs[1].destroy().unwrap();
    let t = Instant::now();
    let e = loop {
        if let Err(e) = cs[0].async_error() {
            break e;
        }
        assert!(t.elapsed() < Duration::from_secs(10), "no async error");
        thread::sleep(Duration::from_millis(20));
    };
    let msg = e.to_string();
    assert!(msg.contains("rank 1"), "{msg}");
    assert!(msg.contains("destroyed its communicator"), "{msg}");
    let _ = cs[0].destroy();
}

/// Abort drops pending sends at once.
#[test]
fn abort_drops_pending_sends() {
    let cs = comms(2, bounded());
    let big = vec![3.5f32; 4 << 20];
    cs[0].send(&big, 1).unwrap();
    let t = Instant::now();
    cs[0].abort().unwrap();
    cs[0].destroy().unwrap();
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    let _ = cs[1].destroy();
}

/// Many eager sends to one peer keep their order; `flush` waits for them.
#[test]
fn many_eager_sends_keep_order_and_flush() {
    let seed = seed();
    let cs = comms(2, bounded());
    let sizes = [100usize, 300_000, 7, 1 << 20, 0, 5000];
    thread::scope(|s| {
        let c0 = &cs[0];
        s.spawn(move || {
            for (k, &n) in sizes.iter().enumerate() {
                c0.send(&data(seed, k as u64, 0, n), 1).unwrap();
            }
            c0.flush().unwrap();
        });
        thread::sleep(Duration::from_millis(300));
        for (k, &n) in sizes.iter().enumerate() {
            let mut got = vec![0f32; n];
            cs[1].recv(&mut got, 0).unwrap();
            assert!(got == data(seed, k as u64, 0, n), "message {k}");
        }
    });
    for c in &cs {
        c.destroy().unwrap();
    }
}
