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
