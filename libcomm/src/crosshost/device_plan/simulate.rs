//! The plans run on host arrays against each collective's reference
//! semantics: CI's check of the steps (it has no GPU).

use super::{Among, At, DevicePlan, Step, plan};
use crate::crosshost::layout::Layout;
use crate::data::types::ReduceOp;
use crate::op::OpKind;

/// Runs every rank's plan on host arrays of `f64`, step by step with the
/// reference semantics of each collective among its ranks, and returns
/// every rank's output: what the device path computes, for tests (CI has
/// no GPU). `inputs[r]` is rank r's input (send buffer), `out_len` the
/// output's elements; every reduction ([`reduce_group`]).
pub fn simulate(
    kind: OpKind,
    count: usize,
    redop: Option<ReduceOp>,
    root: usize,
    layout: &Layout,
    inputs: &[Vec<f64>],
    out_len: usize,
) -> Option<Vec<Vec<f64>>> {
    let n = layout.n();
    let plans: Vec<DevicePlan> = (0..n)
        .map(|r| plan(kind, count, redop, root, layout, r))
        .collect::<Option<_>>()?;
    let mut bufs: Vec<[Vec<f64>; 3]> = (0..n)
        .map(|r| {
            [
                inputs[r].clone(),
                vec![f64::NAN; out_len],
                vec![f64::NAN; plans[r].scratch],
            ]
        })
        .collect();
    let nsteps = plans[0].steps.len();
    // Ranks of a rail may have fewer steps (broadcast): run step i of
    // every rank whose plan has a step of that kind at that place, group
    // by group, in each rank's own order.
    let mut next = vec![0usize; n];
    for _round in 0..nsteps * 2 + 2 {
        // Find a group whose members all have the same next step.
        let mut progressed = false;
        for r in 0..n {
            let Some(st) = plans[r].steps.get(next[r]).copied() else {
                continue;
            };
            let members: Vec<usize> = match st.among {
                Among::Host => layout.members(layout.host(r)).to_vec(),
                Among::Rail => layout.rail(layout.local(r)),
                Among::All => (0..n).collect(),
                Among::Me => vec![r],
            };
            if !members.iter().all(|&p| {
                plans[p].steps.get(next[p]).map(|s| (s.among, s.kind)) == Some((st.among, st.kind))
            }) {
                continue;
            }
            let steps: Vec<Step> = members.iter().map(|&p| plans[p].steps[next[p]]).collect();
            run_group(&members, &steps, &mut bufs);
            for &p in &members {
                next[p] += 1;
            }
            progressed = true;
        }
        if !progressed {
            break;
        }
    }
    if (0..n).any(|r| next[r] != plans[r].steps.len()) {
        panic!("the plans' steps do not match across ranks: {next:?}");
    }
    Some(bufs.into_iter().map(|[_, o, _]| o).collect())
}

fn read(b: &[Vec<f64>; 3], at: At, len: usize) -> Vec<f64> {
    let (i, o) = slot(at);
    b[i][o..o + len].to_vec()
}

fn write(b: &mut [Vec<f64>; 3], at: At, v: &[f64]) {
    let (i, o) = slot(at);
    b[i][o..o + v.len()].copy_from_slice(v);
}

fn slot(at: At) -> (usize, usize) {
    match at {
        At::Send(o) => (0, o),
        At::Recv(o) => (1, o),
        At::Scratch(o) => (2, o),
    }
}

/// One reduction of `operands` (each a member's values) as a collective of
/// that many ranks computes it: an average divides by the group's size, a
/// pre-multiplied sum scales every operand once.
pub(super) fn reduce_group(op: Option<ReduceOp>, operands: &[Vec<f64>]) -> Vec<f64> {
    let g = operands.len() as f64;
    (0..operands[0].len())
        .map(|i| {
            let xs = operands.iter().map(|v| v[i]);
            match op {
                Some(ReduceOp::Max) => xs.fold(f64::MIN, f64::max),
                Some(ReduceOp::Min) => xs.fold(f64::MAX, f64::min),
                Some(ReduceOp::Prod) => xs.product(),
                Some(ReduceOp::Avg) => xs.sum::<f64>() / g,
                Some(ReduceOp::PreMulSum(s)) => xs.map(|x| x * s).sum(),
                Some(ReduceOp::Sum) | None => xs.sum(),
            }
        })
        .collect()
}

/// One collective among `members` (in their rank order among them).
fn run_group(members: &[usize], steps: &[Step], bufs: &mut [[Vec<f64>; 3]]) {
    let g = members.len();
    let st = steps[0];
    let c = st.count;
    let reduce = |len: usize, bufs: &[[Vec<f64>; 3]]| -> Vec<f64> {
        let operands: Vec<Vec<f64>> = members
            .iter()
            .enumerate()
            .map(|(i, &p)| read(&bufs[p], steps[i].send, len))
            .collect();
        reduce_group(st.redop, &operands)
    };
    match st.kind {
        OpKind::AllReduce => {
            let sum = reduce(c, bufs);
            for (i, &p) in members.iter().enumerate() {
                write(&mut bufs[p], steps[i].recv, &sum);
            }
        }
        OpKind::ReduceScatter => {
            let sum = reduce(c * g, bufs);
            for (i, &p) in members.iter().enumerate() {
                write(&mut bufs[p], steps[i].recv, &sum[i * c..(i + 1) * c]);
            }
        }
        OpKind::AllGather => {
            let all: Vec<f64> = members
                .iter()
                .enumerate()
                .flat_map(|(i, &p)| read(&bufs[p], steps[i].send, c))
                .collect();
            for (i, &p) in members.iter().enumerate() {
                write(&mut bufs[p], steps[i].recv, &all);
            }
        }
        OpKind::Reduce => {
            let sum = reduce(c, bufs);
            write(&mut bufs[members[st.root]], steps[st.root].recv, &sum);
        }
        OpKind::Broadcast => {
            let v = read(&bufs[members[st.root]], steps[st.root].send, c);
            for (i, &p) in members.iter().enumerate() {
                write(&mut bufs[p], steps[i].recv, &v);
            }
        }
        OpKind::Scatter => {
            let v = read(&bufs[members[st.root]], steps[st.root].send, c * g);
            for (i, &p) in members.iter().enumerate() {
                write(&mut bufs[p], steps[i].recv, &v[i * c..(i + 1) * c]);
            }
        }
        k => panic!("no step of kind {k:?} is planned"),
    }
}
