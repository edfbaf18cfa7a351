//! Revoke, survivor-only shrink and grow (NCCL 2.27-2.29 semantics), with
//! ranks as threads of this process, and their failure classes: concurrent
//! calls, a member that never arrives, a grow whose new rank never comes,
//! destroy of the parent while a child is in use. Every wait is bounded.
//! (Processes that really die: tests/tests/recovery.rs.)

use libcomm::{CommState, Communicator, Config, ErrorKind, ReduceOp, ShrinkMode, UniqueId};
use std::thread;

mod common;
use common::{comms, each};
use std::time::{Duration, Instant};

fn cfg() -> Config {
    Config::default()
        .timeout(Some(Duration::from_secs(30)))
        .init_timeout(Duration::from_secs(30))
}

/// All-reduce of (rank + 1) on every communicator given, checked.
fn check_sum(cs: &[&Communicator]) {
    let n = cs.len();
    thread::scope(|s| {
        for c in cs {
            s.spawn(move || {
                let mut v = vec![c.rank() as f64 + 1.0; 1000];
                c.all_reduce_in_place(&mut v, ReduceOp::Sum).unwrap();
                let want = (n * (n + 1) / 2) as f64;
                assert!(
                    v.iter().all(|&x| x == want),
                    "{} got {}",
                    c.describe(),
                    v[0]
                );
            });
        }
    });
}

#[test]
fn survivors_shrink_around_an_aborted_rank_without_it() {
    let cs = comms(4, cfg());
    // Rank 2 "dies": it aborts (its peers' operations fail) and never
    // takes part again.
    cs[2].abort().unwrap();
    let survivors: Vec<&Communicator> = [0, 1, 3].iter().map(|&r| &cs[r]).collect();
    let children: Vec<Communicator> = thread::scope(|s| {
        let hs: Vec<_> = survivors
            .iter()
            .map(|c| {
                s.spawn(move || {
                    let mut v = [1.0f32; 16];
                    let e = c.all_reduce_in_place(&mut v, ReduceOp::Sum).unwrap_err();
                    assert_eq!(e.kind(), ErrorKind::RemoteError, "{e}");
                    c.shrink(&[2], None, ShrinkMode::Abort).unwrap()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    // Renumbered in order: old 0, 1, 3 -> 0, 1, 2.
    assert_eq!(
        children
            .iter()
            .map(|c| (c.rank(), c.count()))
            .collect::<Vec<_>>(),
        vec![(0, 3), (1, 3), (2, 3)]
    );
    check_sum(&children.iter().collect::<Vec<_>>());
    // The parent refuses operations, not management.
    assert!(
        cs[0]
            .all_reduce_in_place(&mut [0f32; 4], ReduceOp::Sum)
            .is_err()
    );
}

#[test]
fn shrink_of_a_healthy_comm_leaves_it_usable_and_nonblocking_works() {
    let cs = comms(4, cfg());
    let children: Vec<Communicator> = thread::scope(|s| {
        let hs: Vec<_> = cs[..3]
            .iter()
            .map(|c| {
                s.spawn(move || {
                    c.shrink(&[3], Some(cfg().blocking(false)), ShrinkMode::Default)
                        .unwrap()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for c in &children {
        c.wait_ready(Some(Duration::from_secs(30))).unwrap();
    }
    check_sum(&children.iter().collect::<Vec<_>>());
    check_sum(&cs.iter().collect::<Vec<_>>());
}

#[test]
fn shrink_arguments_are_checked() {
    let cs = comms(2, cfg());
    let e = cs[0].shrink(&[0], None, ShrinkMode::Default).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    let e = cs[0].shrink(&[5], None, ShrinkMode::Default).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
}

#[test]
fn a_second_shrink_from_another_thread_is_refused_while_one_runs() {
    let cs = comms(3, cfg());
    thread::scope(|s| {
        let first = s.spawn(|| cs[0].shrink(&[2], None, ShrinkMode::Default));
        thread::sleep(Duration::from_millis(200));
        let e = cs[0].shrink(&[2], None, ShrinkMode::Default).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidUsage, "{e}");
        assert!(e.to_string().contains("already running"), "{e}");
        // Rank 1 arrives: the first shrink completes.
        let other = s.spawn(|| cs[1].shrink(&[2], None, ShrinkMode::Default));
        let a = first.join().unwrap().unwrap();
        let b = other.join().unwrap().unwrap();
        check_sum(&[&a, &b]);
    });
}

#[test]
fn a_survivor_that_never_arrives_fails_the_shrink_in_bounded_time() {
    let short = cfg().init_timeout(Duration::from_millis(1500));
    let cs = comms(4, short);
    cs[3].abort().unwrap();
    // Ranks 0 and 1 shrink; rank 2 (a second failure) never does.
    let t0 = Instant::now();
    each(&cs[..2], |c| {
        let e = c.shrink(&[3], None, ShrinkMode::Abort).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::RemoteError, "{e}");
    });
    assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
    // Shrinking again without rank 2 as well works.
    let children: Vec<Communicator> = thread::scope(|s| {
        let hs: Vec<_> = cs[..2]
            .iter()
            .map(|c| s.spawn(move || c.shrink(&[2, 3], Some(cfg()), ShrinkMode::Abort).unwrap()))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    check_sum(&children.iter().collect::<Vec<_>>());
}

#[test]
fn revoke_stops_a_collective_waiting_for_the_revoker_and_allows_shrink() {
    let cs = comms(3, cfg());
    thread::scope(|s| {
        for c in &cs[1..] {
            s.spawn(move || {
                let mut v = vec![1.0f32; 1 << 16];
                let e = c.all_reduce_in_place(&mut v, ReduceOp::Sum).unwrap_err();
                assert_eq!(e.kind(), ErrorKind::RemoteError, "{e}");
            });
        }
        thread::sleep(Duration::from_millis(100));
        cs[0].revoke().unwrap();
    });
    assert!(cs[0].is_revoked());
    assert_eq!(cs[0].state(), CommState::Failed);
    // Quiescent: async error reads success; operations are refused.
    cs[0].async_error().unwrap();
    cs[0].revoke().unwrap();
    let e = cs[0]
        .all_reduce_in_place(&mut [0f32; 4], ReduceOp::Sum)
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidUsage, "{e}");
    let children: Vec<Communicator> = thread::scope(|s| {
        let hs: Vec<_> = cs
            .iter()
            .map(|c| s.spawn(move || c.shrink(&[], None, ShrinkMode::Default).unwrap()))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    check_sum(&children.iter().collect::<Vec<_>>());
}

#[test]
fn grow_adds_a_new_rank_after_the_existing_ones() {
    let cs = comms(3, cfg());
    let id = cs[0].grow_unique_id().unwrap();
    // One id at a time.
    assert_eq!(
        cs[0].grow_unique_id().unwrap_err().kind(),
        ErrorKind::InvalidUsage
    );
    let grown: Vec<Communicator> = thread::scope(|s| {
        let mut hs: Vec<_> = cs
            .iter()
            .map(|c| {
                let id = (c.rank() == 0).then(|| id.clone());
                s.spawn(move || c.grow(4, id.as_ref(), None).unwrap())
            })
            .collect();
        let id2 = id.clone();
        hs.push(s.spawn(move || Communicator::join(&id2, 4, 3, cfg()).unwrap()));
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(
        grown
            .iter()
            .map(|c| (c.rank(), c.count()))
            .collect::<Vec<_>>(),
        vec![(0, 4), (1, 4), (2, 4), (3, 4)]
    );
    check_sum(&grown.iter().collect::<Vec<_>>());
    // The id was consumed: a new one may be made.
    cs[0].grow_unique_id().unwrap();
}

#[test]
fn grow_arguments_are_checked() {
    let cs = comms(2, cfg());
    let e = cs[0].grow(2, None, None).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    let foreign = UniqueId::new().unwrap();
    let e = cs[0].grow(3, Some(&foreign), None).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidUsage, "{e}");
}

#[test]
fn a_grow_whose_new_rank_never_comes_fails_bounded_and_the_parent_stays_usable() {
    let cs = comms(2, cfg());
    let id = cs[0].grow_unique_id().unwrap();
    let t0 = Instant::now();
    thread::scope(|s| {
        for c in &cs {
            let id = (c.rank() == 0).then(|| id.clone());
            s.spawn(move || {
                let short = cfg().init_timeout(Duration::from_millis(1500));
                let e = c.grow(3, id.as_ref(), Some(short)).unwrap_err();
                assert_eq!(e.kind(), ErrorKind::RemoteError, "{e}");
            });
        }
    });
    assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
    check_sum(&cs.iter().collect::<Vec<_>>());
}

#[test]
fn a_nonblocking_grow_aborted_while_waiting_returns_at_once() {
    let cs = comms(2, cfg());
    let id = cs[0].grow_unique_id().unwrap();
    let grown: Vec<Communicator> = thread::scope(|s| {
        let hs: Vec<_> = cs
            .iter()
            .map(|c| {
                let id = (c.rank() == 0).then(|| id.clone());
                s.spawn(move || c.grow(3, id.as_ref(), Some(cfg().blocking(false))).unwrap())
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    thread::sleep(Duration::from_millis(100));
    let t0 = Instant::now();
    for g in &grown {
        assert_eq!(g.state(), CommState::Initializing);
        g.abort().unwrap();
    }
    assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
    check_sum(&cs.iter().collect::<Vec<_>>());
}

#[test]
fn destroying_the_parent_leaves_a_shrunk_child_working() {
    let cs = comms(3, cfg());
    let children: Vec<Communicator> = thread::scope(|s| {
        let hs: Vec<_> = cs[..2]
            .iter()
            .map(|c| s.spawn(move || c.shrink(&[2], None, ShrinkMode::Default).unwrap()))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for c in &cs {
        c.destroy().unwrap();
    }
    check_sum(&children.iter().collect::<Vec<_>>());
    // Shrink of a destroyed parent is a typed error.
    let e = cs[0].shrink(&[2], None, ShrinkMode::Default).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidUsage, "{e}");
}

#[test]
fn a_nonblocking_grow_then_a_blocking_split_of_it() {
    let cs = comms(2, cfg());
    let id = cs[0].grow_unique_id().unwrap();
    let grown: Vec<Communicator> = thread::scope(|s| {
        let mut hs: Vec<_> = cs
            .iter()
            .map(|c| {
                let id = (c.rank() == 0).then(|| id.clone());
                s.spawn(move || c.grow(3, id.as_ref(), Some(cfg().blocking(false))).unwrap())
            })
            .collect();
        let id2 = id.clone();
        hs.push(s.spawn(move || Communicator::join(&id2, 3, 2, cfg().blocking(false)).unwrap()));
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for g in &grown {
        g.wait_ready(Some(Duration::from_secs(30))).unwrap();
    }
    let ordered: Vec<Communicator> = thread::scope(|s| {
        let hs: Vec<_> = grown
            .iter()
            .map(|g| {
                s.spawn(move || {
                    g.split_with_config(Some(0), 2 - g.rank() as i32, cfg())
                        .unwrap()
                        .unwrap()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for o in &ordered {
        assert_eq!(o.state(), CommState::Ready);
    }
    check_sum(&ordered.iter().collect::<Vec<_>>());
}

/// A small deterministic generator (splitmix64) for the random data.
fn random(seed: u64, n: usize) -> Vec<u64> {
    let mut x = seed;
    (0..n)
        .map(|_| {
            x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        })
        .collect()
}

/// Revokes `c` and waits (bounded) until this rank is quiescent.
fn revoke_and_settle(c: &Communicator) {
    c.revoke().unwrap();
    let until = Instant::now() + Duration::from_secs(30);
    loop {
        match c.async_error() {
            Ok(()) => return,
            Err(e) if e.kind() == ErrorKind::InProgress && Instant::now() < until => {
                thread::sleep(Duration::from_millis(1))
            }
            Err(e) => panic!("{}: revoke did not settle: {e}", c.describe()),
        }
    }
}

/// Split by parity (odd ranks in reverse order, by key) of the parents
/// given, one thread per rank; returns (parent rank, child).
fn split_by_parity(parents: &[Communicator], cfg: Config) -> Vec<(usize, Communicator)> {
    thread::scope(|s| {
        let hs: Vec<_> = parents
            .iter()
            .map(|c| {
                let cfg = cfg.clone();
                s.spawn(move || {
                    let r = c.rank();
                    let key = if r % 2 == 1 { -(r as i32) } else { r as i32 };
                    let child = c
                        .split_with_config(Some((r % 2) as u32), key, cfg)
                        .unwrap()
                        .unwrap();
                    (r, child)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// The children of `split_by_parity` of `n` ranks have the expected ranks
/// and sizes, and an all-reduce (sum of random i64, max of random f32) on
/// each equals the reference computed here.
fn check_parity_children(n: usize, children: &[(usize, Communicator)], seed: u64) {
    let evens: Vec<usize> = (0..n).filter(|r| r % 2 == 0).collect();
    let odds: Vec<usize> = (0..n).filter(|r| r % 2 == 1).rev().collect();
    for (r, c) in children {
        let group = if r % 2 == 0 { &evens } else { &odds };
        assert_eq!(c.count(), group.len(), "{}", c.describe());
        let want = group.iter().position(|x| x == r).unwrap();
        assert_eq!(c.rank(), want, "parent rank {r}: {}", c.describe());
        c.wait_ready(Some(Duration::from_secs(30))).unwrap();
    }
    const LEN: usize = 4099;
    let ints = |r: usize| -> Vec<i64> {
        random(seed ^ (r as u64 * 7919), LEN)
            .into_iter()
            .map(|x| (x >> 33) as i64 - (1 << 30))
            .collect()
    };
    let floats = |r: usize| -> Vec<f32> {
        random(seed.wrapping_add(r as u64 * 104_729), LEN)
            .into_iter()
            .map(|x| (x >> 40) as f32 / 1024.0 - 8192.0)
            .collect()
    };
    thread::scope(|s| {
        for (r, c) in children {
            let group = if r % 2 == 0 { &evens } else { &odds };
            let (ints, floats) = (&ints, &floats);
            s.spawn(move || {
                let mut want_sum = vec![0i64; LEN];
                let mut want_max = vec![f32::MIN; LEN];
                for &g in group {
                    for (w, x) in want_sum.iter_mut().zip(ints(g)) {
                        *w += x;
                    }
                    for (w, x) in want_max.iter_mut().zip(floats(g)) {
                        *w = w.max(x);
                    }
                }
                let mut got = vec![0i64; LEN];
                c.all_reduce(&ints(*r), &mut got, ReduceOp::Sum).unwrap();
                assert_eq!(got, want_sum, "sum on {}", c.describe());
                let mut gotf = floats(*r);
                c.all_reduce_in_place(&mut gotf, ReduceOp::Max).unwrap();
                assert_eq!(gotf, want_max, "max on {}", c.describe());
            });
        }
    });
}

#[test]
fn split_after_revoke_by_parity_on_every_rank() {
    let n = 5;
    let cs = comms(n, cfg());
    // A collective in flight on ranks 1.. when rank 0 revokes: it returns.
    thread::scope(|s| {
        for c in &cs[1..] {
            s.spawn(move || {
                let mut v = vec![1.0f32; 1 << 14];
                let e = c.all_reduce_in_place(&mut v, ReduceOp::Sum).unwrap_err();
                assert_eq!(e.kind(), ErrorKind::RemoteError, "{e}");
            });
        }
        thread::sleep(Duration::from_millis(100));
        revoke_and_settle(&cs[0]);
    });
    // Every rank revokes (idempotent on rank 0), then splits.
    each(&cs, revoke_and_settle);
    // Operations are refused: with the revoke (rank 0) or with the error
    // that broke the others' collective first.
    for c in &cs {
        assert!(c.is_revoked());
        let e = c
            .all_reduce_in_place(&mut [0f32; 4], ReduceOp::Sum)
            .unwrap_err();
        let want = if c.rank() == 0 {
            ErrorKind::InvalidUsage
        } else {
            ErrorKind::RemoteError
        };
        assert_eq!(e.kind(), want, "{e}");
    }
    let children = split_by_parity(&cs, cfg());
    check_parity_children(n, &children, 0x5eed_0001);
    // A second split of the same revoked parent makes other communicators
    // (non-blocking ones this time); the first children stay usable.
    let again = split_by_parity(&cs, cfg().blocking(false));
    for ((_, a), (_, b)) in children.iter().zip(&again) {
        assert_ne!(a.id(), b.id());
    }
    check_parity_children(n, &again, 0x5eed_0002);
    check_parity_children(n, &children, 0x5eed_0003);
    // The parent is still revoked: operations refused, destroy allowed.
    for c in &cs {
        c.destroy().unwrap();
    }
}

#[test]
fn split_after_revoke_with_nocolor_ranks_and_a_destroyed_parent() {
    let cs = comms(4, cfg());
    let kids: Vec<Option<Communicator>> = thread::scope(|s| {
        let hs: Vec<_> = cs
            .iter()
            .map(|c| {
                s.spawn(move || {
                    revoke_and_settle(c);
                    // Ranks 1 and 2 take part without a communicator.
                    let color = matches!(c.rank(), 0 | 3).then_some(7);
                    c.split(color, 0).unwrap()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(kids[1].is_none() && kids[2].is_none());
    let pair: Vec<&Communicator> = [&kids[0], &kids[3]]
        .into_iter()
        .map(|k| k.as_ref().unwrap())
        .collect();
    assert_eq!((pair[0].rank(), pair[1].rank()), (0, 1));
    for c in &cs {
        c.destroy().unwrap();
    }
    check_sum(&pair);
}

#[test]
fn split_after_revoke_with_a_rank_that_never_calls_fails_bounded() {
    let short = cfg().init_timeout(Duration::from_millis(1500));
    let cs = comms(3, short);
    // Rank 2 is lost; the others revoke and split, and fail in bounded time
    // with a remote error naming the missing caller, as any split would.
    cs[2].abort().unwrap();
    let t0 = Instant::now();
    each(&cs[..2], |c| {
        revoke_and_settle(c);
        let e = c.split(Some(0), 0).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::RemoteError, "{e}");
    });
    assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
    // Shrinking without it still works.
    let children: Vec<Communicator> = thread::scope(|s| {
        let hs: Vec<_> = cs[..2]
            .iter()
            .map(|c| s.spawn(move || c.shrink(&[2], Some(cfg()), ShrinkMode::Default).unwrap()))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    check_sum(&children.iter().collect::<Vec<_>>());
}

#[test]
fn split_of_a_failed_communicator_that_was_not_revoked_is_refused() {
    let cs = comms(2, cfg());
    cs[1].abort().unwrap();
    let mut v = [1.0f32; 4];
    let e = cs[0]
        .all_reduce_in_place(&mut v, ReduceOp::Sum)
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::RemoteError, "{e}");
    let e = cs[0].split(Some(0), 0).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::RemoteError, "{e}");
}
