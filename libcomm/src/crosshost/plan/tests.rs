use super::*;

#[test]
fn split_is_balanced_and_covers() {
    let p = split(7, 3);
    assert_eq!(
        p.iter().map(|p| (p.off, p.count)).collect::<Vec<_>>(),
        vec![(0, 3), (3, 2), (5, 2)]
    );
    assert_eq!(split(2, 3).iter().map(|p| p.count).sum::<usize>(), 2);
}

/// Elements each rank sends over the network in a plan (by the regions
/// its network phases name; a ring moves about twice its region).
fn net_elems(p: &RankPlan) -> usize {
    p.phases
        .iter()
        .map(|ph| match ph {
            Phase::Net {
                coll: NetColl::AllReduce { region, .. },
                ..
            } => region.count,
            _ => 0,
        })
        .sum()
}

#[test]
fn rails_carry_one_kth_each_and_leaders_everything() {
    let l = Layout::uniform(2, 4);
    let n = 4000;
    for me in 0..8 {
        let rails = plan(
            Coll::AllReduce,
            n,
            Scaling::default(),
            &l,
            me,
            Shape::Rails,
            false,
        );
        assert_eq!(net_elems(&rails), n / 4, "rank {me}");
        let leaders = plan(
            Coll::AllReduce,
            n,
            Scaling::default(),
            &l,
            me,
            Shape::Leaders,
            false,
        );
        assert_eq!(net_elems(&leaders), if me % 4 == 0 { n } else { 0 });
    }
}

/// With one rank per host nothing but the network touches the data (what
/// made the engine faster than the flat path: docs/PERFORMANCE-GPU.md,
/// "Across hosts"): no local phase, out of place no copy of the whole
/// input, and a scratch buffer only for reduce-scatter's forwarded sums
/// and a non-root's reduce.
#[test]
fn one_rank_per_host_runs_on_the_callers_buffers() {
    let l = Layout::from_hosts(vec![vec![2], vec![0], vec![1]]).unwrap();
    let n = 999;
    let colls = [
        Coll::AllReduce,
        Coll::AllGather,
        Coll::ReduceScatter,
        Coll::Broadcast { root: 1 },
        Coll::Reduce { root: 1 },
    ];
    for coll in colls {
        for me in 0..3 {
            for shape in [Shape::Rails, Shape::Leaders] {
                let p = plan(coll, n, Scaling::default(), &l, me, shape, false);
                let what = format!("{coll:?} {shape:?} rank {me}: {:?}", p.phases);
                assert!(
                    !p.phases.iter().any(|ph| matches!(ph, Phase::Local(_))),
                    "{what}"
                );
                // The only copies: an all-gather's own block and a
                // broadcast root's input (both while the network runs).
                let copied: usize = p
                    .phases
                    .iter()
                    .map(|ph| match ph {
                        Phase::Copy { src, .. } => src.count,
                        _ => 0,
                    })
                    .sum();
                let allowed = match coll {
                    Coll::AllGather => n,
                    Coll::Broadcast { root } if root == me => n,
                    _ => 0,
                };
                assert_eq!(copied, allowed, "{what}");
                let scratch = match coll {
                    Coll::ReduceScatter => 1,
                    Coll::Reduce { root } if root != me => 1,
                    _ => 0,
                };
                assert_eq!(p.scratch.len(), scratch, "{what}");
                // Out of place, the ring reads the input where it is.
                if let Some(Phase::Net {
                    coll: NetColl::AllReduce { input, region, .. },
                    ..
                }) = p.phases.first()
                {
                    assert_eq!(region.buf, Buf::Recv(0), "{what}");
                    assert_eq!(input.map(|r| r.buf), Some(Buf::Send(0)), "{what}");
                }
            }
        }
    }
}

/// The ranks `me` sends to or receives from in `p`'s network phases.
fn net_peers(p: &RankPlan, me: usize) -> Vec<usize> {
    let around = |v: &[usize], ring: bool| -> Vec<usize> {
        let Some(i) = v.iter().position(|&r| r == me) else {
            return Vec::new();
        };
        let n = v.len();
        let mut out = Vec::new();
        if ring || i > 0 {
            out.push(v[(i + n - 1) % n]);
        }
        if ring || i + 1 < n {
            out.push(v[(i + 1) % n]);
        }
        out
    };
    let mut peers: Vec<usize> = p
        .phases
        .iter()
        .flat_map(|ph| match ph {
            Phase::Net { coll, .. } => match coll {
                NetColl::AllReduce { group, .. }
                | NetColl::ReduceScatter { group, .. }
                | NetColl::AllGather { group, .. } => around(group, true),
                NetColl::Broadcast { chain, .. } | NetColl::Reduce { chain, .. } => {
                    around(chain, false)
                }
                NetColl::Exchange { sends, recvs } => {
                    sends.iter().chain(recvs).map(|(r, _)| *r).collect()
                }
            },
            _ => Vec::new(),
        })
        .filter(|&r| r != me)
        .collect();
    peers.sort();
    peers.dedup();
    peers
}

/// What the communicator's engine relies on when it connects a rank to its
/// rail alone, or to its ring neighbours on it (`comm/cross_engine.rs`):
/// every rails plan talks over the network to ranks of its rail only, and
/// all but all-to-all to its ring neighbours only (rings and chains are
/// rotations of the rail in host order), for every collective, root and
/// rank, on hosts whose ranks are out of rank order too.
#[test]
fn rails_plans_talk_to_the_rail_and_all_but_all_to_all_to_ring_neighbours() {
    let layouts = [
        Layout::uniform(2, 2),
        Layout::uniform(4, 1),
        Layout::uniform(5, 3),
        Layout::from_hosts(vec![vec![5, 0], vec![3, 7], vec![1, 6], vec![2, 4]]).unwrap(),
    ];
    for l in &layouts {
        let n = l.n();
        let mut colls = vec![
            Coll::AllReduce,
            Coll::AllGather,
            Coll::ReduceScatter,
            Coll::AllToAll,
        ];
        for root in 0..n {
            colls.push(Coll::Broadcast { root });
            colls.push(Coll::Reduce { root });
        }
        for &coll in &colls {
            for me in 0..n {
                for in_place in [false, true] {
                    let p = plan(coll, 97, Scaling::default(), l, me, Shape::Rails, in_place);
                    let peers = net_peers(&p, me);
                    let allowed = if coll == Coll::AllToAll {
                        l.rail_peers(me)
                    } else {
                        l.ring_peers(me)
                    };
                    if coll == Coll::AllReduce {
                        assert!(!peers.is_empty(), "{l:?}, rank {me}: no network peer");
                    }
                    assert!(
                        peers.iter().all(|q| allowed.contains(q)),
                        "{coll:?} on {l:?}, rank {me}: talks to {peers:?}, may to {allowed:?}"
                    );
                }
            }
        }
    }
}
