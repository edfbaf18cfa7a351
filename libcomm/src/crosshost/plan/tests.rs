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
