//! Ranks as threads of one process (NCCL's CommInitAll shape): fast checks of
//! the core paths. The full matrix runs as separate processes in `tests/`.

use libcomm::{CommState, Communicator, Error, Group, ReduceOp};
use std::thread;

fn each<F>(comms: &[Communicator], f: F)
where
    F: Fn(&Communicator) + Sync,
{
    thread::scope(|s| {
        for c in comms {
            let f = &f;
            s.spawn(move || f(c));
        }
    });
}

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
