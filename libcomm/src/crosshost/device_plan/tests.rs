use super::simulate::reduce_group;
use super::*;

/// Random-looking, never zero, distinct per rank and element.
fn inputs(n: usize, len: usize, seed: u64) -> Vec<Vec<f64>> {
    let mut x = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            (0..len)
                .map(|_| {
                    x = x
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    ((x >> 33) % 1000) as f64 + 1.0
                })
                .collect()
        })
        .collect()
}

/// The reference: one flat collective of every rank.
fn reduce_all(ins: &[Vec<f64>], op: Option<ReduceOp>) -> Vec<f64> {
    reduce_group(op, ins)
}

/// Equal up to rounding (the levels add in another order than one flat
/// reduction; an average divides twice).
fn close(got: &[f64], want: &[f64]) -> bool {
    got.len() == want.len()
        && got
            .iter()
            .zip(want)
            .all(|(g, w)| (g - w).abs() <= 1e-9 * w.abs().max(1.0))
}

/// Product, average and pre-multiplied sum, which the levels must not
/// apply twice or weigh unevenly: all-reduce, reduce-scatter and reduce on
/// hosts of one size (an average of equal-sized groups' averages is the
/// average) and of different sizes (an average is not planned there),
/// against one flat reduction.
#[test]
fn product_average_and_pre_multiplied_sum_match_the_reference_at_every_level() {
    let mut all = layouts();
    all.extend(uneven_layouts());
    let ops = [ReduceOp::Prod, ReduceOp::Avg, ReduceOp::PreMulSum(0.375)];
    for layout in &all {
        let n = layout.n();
        let even = layout.per_host().is_some();
        for op in ops {
            for count in [1usize, 7, 64] {
                // Products of up to 16 values under 1000 stay exact enough.
                let ins = inputs(n, n * count, count as u64 + 5);
                let want = reduce_all(&ins, Some(op));
                let planned_here = even || op != ReduceOp::Avg;
                let ar = simulate(OpKind::AllReduce, count, Some(op), 0, layout, &ins, count);
                assert_eq!(
                    ar.is_some(),
                    planned_here && (!even || count >= layout.per_host().unwrap()),
                    "{layout:?} {op:?} all_reduce {count} planned"
                );
                for (r, o) in ar.iter().flatten().enumerate() {
                    assert!(
                        close(o, &want[..count]),
                        "{layout:?} {op:?} all_reduce {count} rank {r}"
                    );
                }
                for root in [0, n - 1] {
                    let rd = simulate(OpKind::Reduce, count, Some(op), root, layout, &ins, count);
                    if let Some(outs) = rd {
                        assert!(
                            close(&outs[root], &want[..count]),
                            "{layout:?} {op:?} reduce root {root}"
                        );
                    } else {
                        assert!(
                            !planned_here
                                || (even && layout.local(root) >= layout.per_host().unwrap()),
                            "{layout:?} {op:?} reduce root {root} not planned"
                        );
                    }
                }
                let rs = simulate(
                    OpKind::ReduceScatter,
                    count,
                    Some(op),
                    0,
                    layout,
                    &ins,
                    count,
                );
                for (r, o) in rs.iter().flatten().enumerate() {
                    assert!(
                        close(o, &want[r * count..(r + 1) * count]),
                        "{layout:?} {op:?} reduce_scatter {count} rank {r}"
                    );
                }
            }
        }
    }
}

fn layouts() -> Vec<Layout> {
    vec![
        Layout::uniform(2, 2),
        Layout::uniform(2, 3),
        Layout::uniform(3, 2),
        Layout::uniform(4, 4),
        // Interleaved hosts (ranks placed round-robin: 0, 2, 4 on one
        // host): all-gather and reduce-scatter through the host-major copy.
        Layout::from_hosts(vec![vec![0, 2, 4], vec![1, 3, 5]]).unwrap(),
        Layout::from_hosts(vec![vec![0, 3], vec![1, 2]]).unwrap(),
    ]
}

#[test]
fn hierarchical_all_reduce_matches_the_reference_for_odd_sizes() {
    for layout in layouts() {
        let (n, k) = (layout.n(), layout.per_host().unwrap());
        for count in [k, k + 1, 7 * k - 1, 1000, 1023] {
            for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min] {
                let ins = inputs(n, count, count as u64);
                let outs = simulate(OpKind::AllReduce, count, Some(op), 0, &layout, &ins, count)
                    .expect("planned");
                let want = reduce_all(&ins, Some(op));
                for (r, o) in outs.iter().enumerate() {
                    assert_eq!(o, &want, "{layout:?} count {count} {op:?} rank {r}");
                }
            }
        }
    }
}

#[test]
fn hierarchical_broadcast_matches_from_every_root() {
    for layout in layouts() {
        let n = layout.n();
        for root in 0..n {
            let count = 37;
            let ins = inputs(n, count, root as u64 + 5);
            let outs =
                simulate(OpKind::Broadcast, count, None, root, &layout, &ins, count).unwrap();
            for (r, o) in outs.iter().enumerate() {
                assert_eq!(o, &ins[root], "{layout:?} root {root} rank {r}");
            }
        }
    }
}

#[test]
fn hierarchical_reduce_matches_at_every_root() {
    for layout in layouts() {
        let n = layout.n();
        for root in 0..n {
            for count in [1, 33] {
                let ins = inputs(n, count, root as u64 + 17);
                for op in [ReduceOp::Sum, ReduceOp::Max] {
                    let outs =
                        simulate(OpKind::Reduce, count, Some(op), root, &layout, &ins, count)
                            .unwrap();
                    assert_eq!(
                        outs[root],
                        reduce_all(&ins, Some(op)),
                        "{layout:?} root {root}"
                    );
                }
            }
        }
    }
}

#[test]
fn hierarchical_all_gather_and_reduce_scatter_match_on_every_layout() {
    for layout in layouts() {
        let n = layout.n();
        for count in [1, 5, 64] {
            let ins = inputs(n, count, 9);
            let ag = simulate(OpKind::AllGather, count, None, 0, &layout, &ins, count * n);
            let ins_rs = inputs(n, count * n, 11);
            let rs = simulate(
                OpKind::ReduceScatter,
                count,
                Some(ReduceOp::Sum),
                0,
                &layout,
                &ins_rs,
                count,
            );
            let want_ag: Vec<f64> = ins.concat();
            for (r, o) in ag.unwrap().iter().enumerate() {
                assert_eq!(o, &want_ag, "{layout:?} all-gather rank {r}");
            }
            let sum = reduce_all(&ins_rs, Some(ReduceOp::Sum));
            for (r, o) in rs.unwrap().iter().enumerate() {
                assert_eq!(
                    o[..],
                    sum[r * count..(r + 1) * count],
                    "{layout:?} rs rank {r}"
                );
            }
        }
    }
}

#[test]
fn what_is_not_planned_is_staged_whole() {
    let l = Layout::uniform(2, 2);
    assert!(plan(OpKind::AllToAll, 64, None, 0, &l, 0).is_none());
    assert!(plan(OpKind::Send, 64, None, 1, &l, 0).is_none());
    // Fewer elements than ranks per host: nothing to scatter.
    assert!(plan(OpKind::AllReduce, 1, Some(ReduceOp::Sum), 0, &l, 0).is_none());
    // One rank per host, one host: nothing local to do.
    for layout in [Layout::uniform(2, 1), Layout::uniform(1, 4)] {
        let p = plan(OpKind::AllReduce, 64, Some(ReduceOp::Sum), 0, &layout, 0);
        assert!(p.is_none(), "{layout:?}");
    }
}

/// Hosts that are not rank ranges: all-gather and reduce-scatter run the
/// host-major plan on a scratch copy, with copies on the rank alone
/// between the orders (runs of blocks in order copied as one), nothing of
/// the caller's buffers written by the inner steps, the scratch sized for
/// the copy; on contiguous hosts no copy at all.
#[test]
fn interleaved_hosts_gather_and_scatter_through_a_host_major_copy() {
    let count = 10;
    // Host-major order [0, 1, 3, 2]: blocks 0-1 one run, then 3, then 2.
    let l = Layout::from_hosts(vec![vec![0, 1, 3], vec![2]]).unwrap();
    let ag = plan(OpKind::AllGather, count, None, 0, &l, 1).unwrap();
    let copies: Vec<&Step> = ag.steps.iter().filter(|s| s.among == Among::Me).collect();
    let want = [(0, 0, 2), (2, 3, 1), (3, 2, 1)];
    assert_eq!(copies.len(), want.len(), "{:?}", ag.steps);
    let inner = ag.scratch - 4 * count;
    for (c, (j, r, len)) in copies.iter().zip(want) {
        assert_eq!((c.kind, c.count), (OpKind::Broadcast, len * count));
        assert_eq!(c.send, At::Scratch(inner + j * count));
        assert_eq!(c.recv, At::Recv(r * count));
    }
    // The copies come last, and no step before them writes the output.
    assert!(ag.steps.iter().rev().take(3).all(|s| s.among == Among::Me));
    assert!(
        ag.steps
            .iter()
            .all(|s| s.among == Among::Me || !matches!(s.recv, At::Recv(_)))
    );
    let rs = plan(OpKind::ReduceScatter, count, Some(ReduceOp::Sum), 0, &l, 1).unwrap();
    assert!(rs.steps.iter().take(3).all(|s| s.among == Among::Me));
    assert!(
        rs.steps
            .iter()
            .skip(3)
            .all(|s| !matches!(s.send, At::Send(_)))
    );
    for contiguous in [
        Layout::uniform(2, 2),
        Layout::from_hosts(vec![vec![0], vec![1, 2]]).unwrap(),
    ] {
        for kind in [OpKind::AllGather, OpKind::ReduceScatter] {
            let p = plan(kind, count, Some(ReduceOp::Sum), 0, &contiguous, 0).unwrap();
            assert!(
                p.steps.iter().all(|s| s.among != Among::Me),
                "{kind:?} {contiguous:?}"
            );
        }
    }
}

/// Hosts of different sizes, contiguous or interleaved, one of them a
/// single rank: all-reduce (leaders), broadcast and reduce from every
/// root, odd sizes, Sum/Max/Min, every rank's output against the
/// reference; a reduce's non-roots' outputs untouched.
#[test]
fn uneven_hosts_all_reduce_broadcast_and_reduce_match_the_reference() {
    for layout in &uneven_layouts() {
        assert!(layout.per_host().is_none());
        let n = layout.n();
        for count in [1usize, 7, 1023] {
            for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min] {
                let ins = inputs(n, count, count as u64 + 3);
                let outs = simulate(OpKind::AllReduce, count, Some(op), 0, layout, &ins, count)
                    .expect("planned on uneven hosts");
                let want = reduce_all(&ins, Some(op));
                for (r, o) in outs.iter().enumerate() {
                    assert_eq!(o, &want, "{layout:?} count {count} {op:?} rank {r}");
                }
            }
            for root in 0..n {
                let ins = inputs(n, count, root as u64 + 11);
                let outs = simulate(OpKind::Broadcast, count, None, root, layout, &ins, count)
                    .expect("broadcast planned from every root");
                for (r, o) in outs.iter().enumerate() {
                    assert_eq!(o, &ins[root], "{layout:?} root {root} rank {r}");
                }
                for op in [ReduceOp::Sum, ReduceOp::Max] {
                    let outs = simulate(OpKind::Reduce, count, Some(op), root, layout, &ins, count)
                        .expect("reduce planned to every root");
                    assert_eq!(
                        outs[root],
                        reduce_all(&ins, Some(op)),
                        "{layout:?} reduce {op:?} root {root}"
                    );
                    for (r, o) in outs.iter().enumerate().filter(|(r, _)| *r != root) {
                        assert!(o.iter().all(|x| x.is_nan()), "{layout:?} rank {r} written");
                    }
                }
            }
        }
    }
}

/// Hosts of different sizes, as rank ranges or interleaved (through the
/// host-major copy): all-gather and reduce-scatter (Sum/Max/Min) by the
/// leaders, odd counts, every rank's output against the reference.
#[test]
fn uneven_hosts_all_gather_and_reduce_scatter_match_the_reference() {
    for layout in &uneven_layouts() {
        let n = layout.n();
        for count in [1usize, 5, 333] {
            let ins = inputs(n, count, count as u64 + 41);
            let outs = simulate(OpKind::AllGather, count, None, 0, layout, &ins, n * count)
                .expect("all-gather planned on uneven hosts");
            let want: Vec<f64> = ins.iter().flatten().copied().collect();
            for (r, o) in outs.iter().enumerate() {
                assert_eq!(o, &want, "{layout:?} all_gather {count} rank {r}");
            }
            for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min] {
                let ins = inputs(n, n * count, count as u64 + 43);
                let outs = simulate(
                    OpKind::ReduceScatter,
                    count,
                    Some(op),
                    0,
                    layout,
                    &ins,
                    count,
                )
                .expect("reduce-scatter planned on uneven hosts");
                let all = reduce_all(&ins, Some(op));
                for (r, o) in outs.iter().enumerate() {
                    let want = &all[r * count..(r + 1) * count];
                    assert_eq!(o, want, "{layout:?} reduce_scatter {count} {op:?} rank {r}");
                }
            }
        }
    }
}

/// Hosts of different sizes: three contiguous (one a single rank), one
/// interleaved.
fn uneven_layouts() -> Vec<Layout> {
    vec![
        Layout::from_hosts(vec![vec![0, 1, 2], vec![3, 4]]).unwrap(),
        Layout::from_hosts(vec![vec![0], vec![1, 2, 3]]).unwrap(),
        Layout::from_hosts(vec![vec![0, 1], vec![2], vec![3, 4, 5]]).unwrap(),
        Layout::from_hosts(vec![vec![0, 2, 3], vec![1]]).unwrap(),
    ]
}

#[test]
fn a_pre_multiplied_sum_scales_once_then_adds() {
    let l = Layout::uniform(2, 2);
    let p = plan(
        OpKind::AllReduce,
        8,
        Some(ReduceOp::PreMulSum(0.5)),
        0,
        &l,
        1,
    )
    .unwrap();
    assert_eq!(p.steps[0].redop, Some(ReduceOp::PreMulSum(0.5)));
    assert_eq!(p.steps[1].redop, Some(ReduceOp::Sum));
    let p = plan(
        OpKind::ReduceScatter,
        8,
        Some(ReduceOp::PreMulSum(0.5)),
        0,
        &l,
        1,
    )
    .unwrap();
    assert!(
        p.steps[..2]
            .iter()
            .all(|s| s.redop == Some(ReduceOp::PreMulSum(0.5)))
    );
    assert_eq!(p.steps[2].redop, Some(ReduceOp::Sum));
    // On hosts of different sizes a mean per level is not the mean (the
    // lone rank of a host would weigh as much as a host of two): never
    // planned there, whatever the collective.
    let uneven = Layout::from_hosts(vec![vec![0], vec![1, 2]]).unwrap();
    for kind in [OpKind::AllReduce, OpKind::Reduce, OpKind::ReduceScatter] {
        for me in 0..3 {
            assert!(
                plan(kind, 64, Some(ReduceOp::Avg), 0, &uneven, me).is_none(),
                "{kind:?} Avg planned on uneven hosts"
            );
            assert!(plan(kind, 64, Some(ReduceOp::Sum), 0, &uneven, me).is_some());
        }
    }
    // Avg averages per level: the mean of equal-sized means is the mean.
    let p = plan(OpKind::AllReduce, 8, Some(ReduceOp::Avg), 0, &l, 1).unwrap();
    assert!(
        p.steps
            .iter()
            .take(2)
            .all(|s| s.redop == Some(ReduceOp::Avg))
    );
}
