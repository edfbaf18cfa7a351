//! Ranks as threads of one process (NCCL's CommInitAll shape): fast checks of
//! the core paths. The full matrix runs as separate processes in `tests/`.

use libcomm::{CommState, Communicator, Error, Group, ReduceOp};
use std::thread;

mod common;
use common::{comms, each};

#[test]
fn all_reduce_sum_in_threads() {
    for n in [1, 2, 3, 4] {
        let comms = Communicator::init_all(n).unwrap();
        for count in [0usize, 1, 7, 1000, 300_000] {
            each(&comms, |c| {
                let send: Vec<f64> = (0..count).map(|i| (i * (c.rank() + 1)) as f64).collect();
                let mut recv = vec![-1.0f64; count];
                c.all_reduce(&send, &mut recv, ReduceOp::Sum).unwrap();
                let tri = (n * (n + 1) / 2) as f64;
                for (i, v) in recv.iter().enumerate() {
                    assert_eq!(*v, i as f64 * tri, "n={n} count={count} i={i}");
                }
            });
        }
    }
}

#[test]
fn split_and_double_destroy() {
    let comms = Communicator::init_all(4).unwrap();
    each(&comms, |c| {
        let color = if c.rank() == 3 {
            None
        } else {
            Some((c.rank() % 2) as u32)
        };
        let child = c.split(color, -(c.rank() as i32)).unwrap();
        match child {
            None => assert_eq!(c.rank(), 3),
            Some(ch) => {
                let mut v = [c.rank() as i32];
                ch.all_reduce_in_place(&mut v, ReduceOp::Sum).unwrap();
                assert_eq!(v[0], if c.rank() % 2 == 0 { 2 } else { 1 });
                // key = -rank: higher parent rank gets the lower child rank.
                let expect_rank = if c.rank() % 2 == 0 {
                    1 - c.rank() / 2
                } else {
                    0
                };
                assert_eq!(ch.rank(), expect_rank);
                ch.destroy().unwrap();
                assert!(matches!(ch.destroy(), Err(Error::AlreadyDestroyed { .. })));
                let mut w = [0i32];
                let e = ch.all_reduce_in_place(&mut w, ReduceOp::Sum).unwrap_err();
                assert!(e.to_string().contains("destroyed"), "{e}");
            }
        }
    });
}

#[test]
fn group_across_communicators_from_one_thread() {
    let comms = Communicator::init_all(3).unwrap();
    let mut bufs: Vec<Vec<f32>> = (0..3).map(|r| vec![r as f32 + 1.0; 1001]).collect();
    let mut g = Group::new();
    for (c, b) in comms.iter().zip(bufs.iter_mut()) {
        g.all_reduce_in_place(c, b, ReduceOp::Max).unwrap();
    }
    g.execute().unwrap();
    for b in &bufs {
        assert!(b.iter().all(|&x| x == 3.0));
    }
}

#[test]
fn abort_wakes_a_blocked_peer() {
    let comms = Communicator::init_all(2).unwrap();
    thread::scope(|s| {
        let c1 = &comms[1];
        let h = s.spawn(move || {
            let mut b = vec![0u8; 10];
            c1.recv(&mut b, 0)
        });
        thread::sleep(std::time::Duration::from_millis(200));
        comms[0].abort().unwrap();
        let e = h.join().unwrap().unwrap_err();
        assert!(matches!(e, Error::Aborted { by: Some(0), .. }), "{e}");
    });
    assert_eq!(comms[0].state(), CommState::Aborted);
    assert_eq!(comms[1].state(), CommState::Failed);
}

/// Communicators of `n` ranks as threads with `algo` as `WEFT_ALGO`.
fn init_with_algo(n: usize, algo: &str) -> Vec<Communicator> {
    comms(
        n,
        libcomm::Config {
            algo: algo.parse().unwrap(),
            timeout: Some(std::time::Duration::from_secs(30)),
            ..Default::default()
        },
    )
}

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// Reduce-scatter and all-gather through the latency slots (one step) and
/// by the tuner's default (the slots at these sizes), in place and out of
/// place, on random integers (exact for every op) at odd counts and odd and
/// even rank counts, against a reference.
#[test]
fn reduce_scatter_and_all_gather_through_latency_slots_in_threads() {
    for algo in ["reducescatter:ll,allgather:ll", ""] {
        for n in [3, 4, 5] {
            let comms = init_with_algo(n, algo);
            for count in [0usize, 1, 7, 1023, 3000] {
                let input = |r: usize, i: usize| -> i64 {
                    (splitmix((count * 131 + r) as u64 * 1_000_003 + i as u64) % 2001) as i64 - 1000
                };
                for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min, ReduceOp::Prod] {
                    let want: Vec<i64> = (0..n * count)
                        .map(|i| {
                            (1..n).fold(input(0, i), |a, r| {
                                let b = input(r, i);
                                match op {
                                    ReduceOp::Sum => a.wrapping_add(b),
                                    ReduceOp::Max => a.max(b),
                                    ReduceOp::Min => a.min(b),
                                    _ => a.wrapping_mul(b),
                                }
                            })
                        })
                        .collect();
                    each(&comms, |c| {
                        let r = c.rank();
                        let send: Vec<i64> = (0..n * count).map(|i| input(r, i)).collect();
                        let mine = &want[r * count..(r + 1) * count];
                        let mut recv = vec![-7i64; count];
                        c.reduce_scatter(&send, &mut recv, op).unwrap();
                        assert_eq!(recv, mine, "{algo}: n={n} count={count} {op:?}");
                        let mut buf = send.clone();
                        c.reduce_scatter_in_place(&mut buf, op).unwrap();
                        assert_eq!(
                            &buf[r * count..(r + 1) * count],
                            mine,
                            "{algo}: in place n={n} count={count} {op:?}"
                        );
                    });
                }
                let want: Vec<i64> = (0..n)
                    .flat_map(|r| (0..count).map(move |i| input(r, i)))
                    .collect();
                each(&comms, |c| {
                    let r = c.rank();
                    let mine: Vec<i64> = (0..count).map(|i| input(r, i)).collect();
                    let mut recv = vec![-7i64; n * count];
                    c.all_gather(&mine, &mut recv).unwrap();
                    assert_eq!(recv, want, "{algo}: all-gather n={n} count={count}");
                    let mut buf = vec![-7i64; n * count];
                    buf[r * count..(r + 1) * count].copy_from_slice(&mine);
                    c.all_gather_in_place(&mut buf).unwrap();
                    assert_eq!(buf, want, "{algo}: in-place all-gather n={n} count={count}");
                });
            }
        }
    }
}

/// Counts that differ between ranks, so that some reduce-scatter through
/// the latency slots and the others through the rings, or with another size
/// through the slots: an error on every rank, soon, not a hang.
#[test]
fn mismatched_reduce_scatter_through_latency_slots_fails() {
    for other in [1 << 16, 100] {
        let comms = init_with_algo(3, "");
        let t = std::time::Instant::now();
        each(&comms, |c| {
            let count = if c.rank() == 0 { 10 } else { other };
            let send = vec![1i32; 3 * count];
            let mut recv = vec![0i32; count];
            let e = c.reduce_scatter(&send, &mut recv, ReduceOp::Sum);
            assert!(e.is_err(), "rank {}: a mismatch must fail", c.rank());
        });
        assert!(t.elapsed().as_secs() < 10, "took {:?}", t.elapsed());
    }
}
