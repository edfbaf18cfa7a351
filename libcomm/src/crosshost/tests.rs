//! The plans executed for real: ranks as threads, the engine over loopback
//! TCP between hosts, the host board within them; every collective in every
//! shape it can take, odd counts, random data, every reduction, checked
//! against the reference of `testing.rs`.

use super::plan::{Coll, Shape};
use super::runner::CrossHost;
use super::testing::{assert_matches, input, on_all, reference, world};
use crate::data::types::{DataType, ReduceOp};
use std::time::Duration;

const ALL_OPS: [ReduceOp; 6] = [
    ReduceOp::Sum,
    ReduceOp::Prod,
    ReduceOp::Max,
    ReduceOp::Min,
    ReduceOp::Avg,
    ReduceOp::PreMulSum(0.0), // scalar set per rank below
];

/// Rank `r`'s op (PreMulSum with a scalar of its own).
fn op_of(op: ReduceOp, r: usize) -> ReduceOp {
    match op {
        ReduceOp::PreMulSum(_) => ReduceOp::PreMulSum((r % 3 + 1) as f64),
        o => o,
    }
}

/// (type, op) cases: every op on three types, sum and max on the rest.
fn cases() -> Vec<(DataType, ReduceOp)> {
    let mut v = Vec::new();
    for dt in DataType::ALL {
        let ops: &[ReduceOp] = if matches!(dt, DataType::F32 | DataType::I32 | DataType::Bf16) {
            &ALL_OPS
        } else {
            &[ReduceOp::Sum, ReduceOp::Max]
        };
        v.extend(ops.iter().map(|&op| (dt, op)));
    }
    v
}

fn shapes(coll: Coll, layout: &super::Layout) -> Vec<Shape> {
    [Shape::Rails, Shape::Leaders, Shape::Direct]
        .into_iter()
        .filter(|s| s.fits(coll, layout))
        .collect()
}

/// What rank `me` must end with, computed from every rank's input.
fn expected(
    coll: Coll,
    dt: DataType,
    op: ReduceOp,
    inputs: &[Vec<u8>],
    count: usize,
    me: usize,
    before: &[u8],
) -> Vec<u8> {
    let n = inputs.len();
    let es = dt.size();
    let ops: Vec<ReduceOp> = (0..n).map(|r| op_of(op, r)).collect();
    match coll {
        Coll::AllReduce => reference(dt, &ops, inputs, count),
        Coll::Reduce { root } if me == root => reference(dt, &ops, inputs, count),
        Coll::Reduce { .. } => before.to_vec(),
        Coll::Broadcast { root } => inputs[root].clone(),
        Coll::AllGather => inputs.concat(),
        Coll::ReduceScatter => {
            let mine: Vec<Vec<u8>> = inputs
                .iter()
                .map(|x| x[me * count * es..(me + 1) * count * es].to_vec())
                .collect();
            reference(dt, &ops, &mine, count)
        }
        Coll::AllToAll => inputs
            .iter()
            .flat_map(|x| x[me * count * es..(me + 1) * count * es].to_vec())
            .collect(),
    }
}

/// Runs every collective, shape, count and case on `hosts`, checks every rank.
fn matrix(hosts: Vec<Vec<usize>>) {
    let mut ranks = world(hosts, 2, Some(Duration::from_secs(30)));
    let layout = ranks[0].layout().clone();
    let n = layout.n();
    let colls = [
        Coll::AllReduce,
        Coll::ReduceScatter,
        Coll::Reduce { root: n - 1 },
        Coll::AllGather,
        Coll::Broadcast { root: n / 2 },
        Coll::AllToAll,
    ];
    let mut seed = 1u64;
    let mut runs = 0;
    for coll in colls {
        let reduces = matches!(
            coll,
            Coll::AllReduce | Coll::ReduceScatter | Coll::Reduce { .. }
        );
        let cases: Vec<(DataType, ReduceOp)> = if reduces {
            cases()
        } else {
            vec![
                (DataType::F32, ReduceOp::Sum),
                (DataType::U8, ReduceOp::Sum),
                (DataType::F64, ReduceOp::Sum),
            ]
        };
        for shape in shapes(coll, &layout) {
            for count in [7usize, 1001] {
                for &(dt, op) in &cases {
                    seed += 1;
                    // Small chunks: many in flight, pipelines several deep.
                    let chunk = if count > 100 { 512 } else { 8 };
                    let what = format!(
                        "{} {} {count} x {} {} on {}",
                        coll.name(),
                        shape.name(),
                        dt.name(),
                        op.name(),
                        layout.describe()
                    );
                    let case = (dt, op);
                    check_on_all(
                        &mut ranks,
                        coll,
                        Some(shape),
                        chunk,
                        count,
                        case,
                        seed,
                        &what,
                    );
                    runs += 1;
                }
            }
        }
    }
    eprintln!("{}: {runs} checked operations", layout.describe());
}

#[test]
fn two_hosts_of_one_two_and_three_ranks() {
    for k in 1..=3 {
        matrix((0..2).map(|h| (h * k..(h + 1) * k).collect()).collect());
    }
}

#[test]
fn three_hosts_of_one_two_and_three_ranks() {
    for k in 1..=3 {
        matrix((0..3).map(|h| (h * k..(h + 1) * k).collect()).collect());
    }
}

#[test]
fn hosts_with_different_numbers_of_ranks_and_interleaved_ranks() {
    matrix(vec![vec![0, 1], vec![2]]);
    matrix(vec![vec![0, 3, 4], vec![1], vec![2, 5]]);
    // One rank per host, hosts not in rank order: the ring's blocks are
    // its members' (the plans for one rank per host work on the caller's
    // buffers in rank order).
    matrix(vec![vec![2], vec![0], vec![1]]);
}

/// Chunks of 1 MiB: every reducing receive is reduced by several threads
/// (`data::reduce::combine_split`; unit tests split on any machine), out
/// of place and in place, on one and two ranks per host.
#[test]
fn large_chunks_are_reduced_by_several_threads() {
    for hosts in [vec![vec![0], vec![1]], vec![vec![0, 1], vec![2, 3]]] {
        let mut ranks = world(hosts, 2, Some(Duration::from_secs(30)));
        let n = ranks[0].layout().n();
        let (dt, op, count) = (DataType::F32, ReduceOp::Sum, 600_001usize);
        for (i, coll) in [
            Coll::AllReduce,
            Coll::ReduceScatter,
            Coll::Reduce { root: n - 1 },
        ]
        .into_iter()
        .enumerate()
        {
            let what = format!("{} of {count} with 1 MiB chunks on {n} ranks", coll.name());
            let seed = 77 + i as u64;
            check_on_all(
                &mut ranks,
                coll,
                None,
                1 << 20,
                count,
                (dt, op),
                seed,
                &what,
            );
        }
    }
}

/// Runs `coll` of `count` elements on every rank (inputs seeded with
/// `seed`; shape `shape`, else the tuner's; chunks of `chunk` bytes) and
/// checks every rank's output against the reference; `what` names it.
#[allow(clippy::too_many_arguments)]
fn check_on_all(
    ranks: &mut [CrossHost],
    coll: Coll,
    shape: Option<Shape>,
    chunk: usize,
    count: usize,
    (dt, op): (DataType, ReduceOp),
    seed: u64,
    what: &str,
) {
    let n = ranks.len();
    let (ns, nr) = coll.sizes(count, n);
    let inputs: Vec<Vec<u8>> = (0..n).map(|r| input(dt, op, ns, seed, r)).collect();
    let before = vec![0x5Au8; nr * dt.size()];
    let outs = on_all(ranks, |x| {
        if shape.is_some() {
            x.shape = shape;
        }
        x.chunk = Some(chunk);
        let me = x.rank();
        let mut out = before.clone();
        let r = unsafe {
            x.collective(
                coll,
                inputs[me].as_ptr(),
                out.as_mut_ptr(),
                count,
                dt,
                op_of(op, me),
            )
        };
        (r, out)
    });
    for (me, (r, out)) in outs.into_iter().enumerate() {
        let what = format!("{what}, rank {me}");
        r.unwrap_or_else(|e| panic!("{what}: {e}"));
        let want = expected(coll, dt, op, &inputs, count, me, &before);
        assert_matches(dt, &out, &want, &what);
    }
}

#[test]
fn in_place_operations_match() {
    // Two ranks per host, and one per host with hosts out of rank order
    // (the ring then runs on the caller's buffer itself).
    in_place_on(vec![vec![0, 2], vec![1, 3]]);
    in_place_on(vec![vec![3], vec![1], vec![0], vec![2]]);
}

fn in_place_on(hosts: Vec<Vec<usize>>) {
    let mut ranks = world(hosts, 1, Some(Duration::from_secs(30)));
    let n = 4;
    let (dt, count) = (DataType::I32, 37usize);
    for (seed, coll) in [
        Coll::AllReduce,
        Coll::ReduceScatter,
        Coll::Reduce { root: 1 },
        Coll::AllGather,
        Coll::Broadcast { root: 2 },
        Coll::AllToAll,
    ]
    .into_iter()
    .enumerate()
    {
        for shape in shapes(coll, ranks[0].layout()) {
            let (ns, nr) = coll.sizes(count, n);
            let inputs: Vec<Vec<u8>> = (0..n)
                .map(|r| input(dt, ReduceOp::Sum, ns, seed as u64, r))
                .collect();
            let outs = on_all(&mut ranks, |x| {
                x.shape = Some(shape);
                let me = x.rank();
                let es = dt.size();
                // NCCL's in-place layouts: the input is the rank's block of
                // the output (all-gather), the output the rank's block of
                // the input (reduce-scatter), else the same buffer.
                let mut buf = vec![0u8; ns.max(nr) * es];
                let (send_at, recv_at) = match coll {
                    Coll::AllGather => (me * count * es, 0),
                    Coll::ReduceScatter => (0, me * count * es),
                    _ => (0, 0),
                };
                buf[send_at..send_at + ns * es].copy_from_slice(&inputs[me]);
                let p = buf.as_mut_ptr();
                let r = unsafe {
                    x.collective(
                        coll,
                        p.add(send_at),
                        p.add(recv_at),
                        count,
                        dt,
                        ReduceOp::Sum,
                    )
                };
                (r, buf[recv_at..recv_at + nr * es].to_vec())
            });
            for (me, (r, out)) in outs.into_iter().enumerate() {
                let what = format!("in place {} {}, rank {me}", coll.name(), shape.name());
                r.unwrap_or_else(|e| panic!("{what}: {e}"));
                if matches!(coll, Coll::Reduce { root } if root != me) {
                    continue; // a non-root's buffer is its input, untouched or not
                }
                let want = expected(coll, dt, ReduceOp::Sum, &inputs, count, me, &[]);
                assert_matches(dt, &out, &want, &what);
            }
        }
    }
}

#[test]
fn sends_and_receives_across_and_within_hosts_and_to_self() {
    let mut ranks = world(
        vec![vec![0, 1], vec![2, 3]],
        2,
        Some(Duration::from_secs(30)),
    );
    let n = 4;
    let count = 3001usize;
    let data = |from: usize, to: usize| {
        input(
            DataType::F32,
            ReduceOp::Sum,
            count,
            (from * 10 + to) as u64,
            from,
        )
    };
    // Every rank sends to every rank (itself included) and receives from each.
    let outs = on_all(&mut ranks, |x| {
        x.chunk = Some(1024);
        let me = x.rank();
        let sends: Vec<Vec<u8>> = (0..n).map(|to| data(me, to)).collect();
        let mut recvs: Vec<Vec<u8>> = (0..n).map(|_| vec![0u8; count * 4]).collect();
        let s: Vec<(usize, *const u8, usize)> = sends
            .iter()
            .enumerate()
            .map(|(to, b)| (to, b.as_ptr(), count))
            .collect();
        let r: Vec<(usize, *mut u8, usize)> = recvs
            .iter_mut()
            .enumerate()
            .map(|(from, b)| (from, b.as_mut_ptr(), count))
            .collect();
        let res = unsafe { x.send_recv(&s, &r, DataType::F32) };
        (res, recvs)
    });
    for (me, (r, recvs)) in outs.into_iter().enumerate() {
        r.unwrap();
        for (from, got) in recvs.iter().enumerate() {
            assert!(*got == data(from, me), "rank {me} from {from}");
        }
    }
}

#[test]
fn the_tuner_picks_a_shape_that_fits_and_results_do_not_depend_on_it() {
    let mut ranks = world(
        vec![vec![0, 1], vec![2, 3]],
        2,
        Some(Duration::from_secs(30)),
    );
    for count in [3usize, 300_001] {
        let inputs: Vec<Vec<u8>> = (0..4)
            .map(|r| input(DataType::F32, ReduceOp::Sum, count, count as u64, r))
            .collect();
        let outs = on_all(&mut ranks, |x| {
            let me = x.rank();
            let mut out = vec![0u8; count * 4];
            let c = x.choose(Coll::AllReduce, count, DataType::F32);
            let r = unsafe {
                x.collective(
                    Coll::AllReduce,
                    inputs[me].as_ptr(),
                    out.as_mut_ptr(),
                    count,
                    DataType::F32,
                    ReduceOp::Sum,
                )
            };
            (r, out, c.shape)
        });
        let ops = [ReduceOp::Sum; 4];
        let want = reference(DataType::F32, &ops, &inputs, count);
        for (r, out, shape) in outs {
            r.unwrap();
            assert_eq!(out, want);
            assert_eq!(
                shape,
                if count > 1000 {
                    Shape::Rails
                } else {
                    Shape::Leaders
                }
            );
        }
    }
}
