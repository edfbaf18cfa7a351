//! The hierarchical shape of a device collective across hosts: which
//! collectives run within a host (on the host-local communicator, whose
//! device side is the NVLink kernel path) and which between hosts (on the
//! rank's rail: the ranks of the same local index, one per host, whose
//! device side is the stream-ordered pinned path), on which parts of the
//! caller's buffers and of a device scratch. A pure function of the
//! operation and the layout, so every rank derives the same steps (they
//! are collectives of the sub-communicators) and CI checks the steps by
//! running them on host arrays ([`simulate`]) against the reference.
//!
//! The shapes (H hosts of k ranks, this rank local index l on host h):
//! - all-reduce of n (n >= k): reduce-scatter within the host (block l of
//!   n/k lands in place in the output), all-reduce of that block on the
//!   rail, all-gather within the host; the last n mod k elements, if any,
//!   as one all-reduce of the whole communicator. Each rail carries 1/k of
//!   the data between hosts, as NCCL's rings on rails do.
//! - broadcast: the root's rail broadcasts between hosts (into the
//!   output), then every host broadcasts from its rank on that rail.
//! - reduce: within each host to its rank on the root's rail (into the
//!   output at the root, into scratch elsewhere), then on that rail to the
//!   root.
//! - all-gather (hosts are contiguous rank ranges): all-gather on the rail
//!   into scratch (block h' of the scratch: rank (h', l)'s input), then one
//!   all-gather within the host per host h', from scratch block h' into the
//!   output's range of host h'.
//! - reduce-scatter (contiguous hosts): one reduce-scatter within the host
//!   per host h', of the input's range of host h', into scratch block h';
//!   then a reduce-scatter on the rail of the scratch into the output.
//!
//! Hosts of different sizes: leaders (see [`uneven`]) for all-reduce,
//! all-gather, reduce-scatter and the broadcasts and reduces whose root's
//! local index some host lacks; the root's rail for broadcast and reduce
//! where every host has it.
//!
//! Everything else (gather, scatter, all-to-all, send/recv; all-gather and
//! reduce-scatter on hosts that are not rank ranges) is not planned here:
//! the caller stages the whole operation (gather, scatter, all-to-all and
//! send/recv go by host in `comm/hier_p2p.rs`).

use super::layout::Layout;
use crate::data::types::ReduceOp;
use crate::op::OpKind;

/// Which communicator a step runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Among {
    /// The ranks of this host (local rank = the layout's local index).
    Host,
    /// The ranks of this rank's local index on every host (rail rank = host index).
    Rail,
    /// Every rank (the whole communicator).
    All,
}

/// A place in one of a step's buffers, in elements from its start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum At {
    Send(usize),
    Recv(usize),
    Scratch(usize),
}

/// One collective of the plan, on one communicator.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Step {
    pub among: Among,
    pub kind: OpKind,
    pub send: At,
    pub recv: At,
    /// As the collective's own count (per rank for all-gather and
    /// reduce-scatter).
    pub count: usize,
    pub redop: Option<ReduceOp>,
    /// The root among `among`'s ranks (broadcast).
    pub root: usize,
}

/// The steps, in stream order, and the scratch they need (elements).
#[derive(Debug, Clone, PartialEq)]
pub struct DevicePlan {
    pub steps: Vec<Step>,
    pub scratch: usize,
}

/// The reduction of a later level: a pre-multiplied sum scales the inputs
/// once, in the first level; the levels after it only add.
fn later(op: Option<ReduceOp>) -> Option<ReduceOp> {
    match op {
        Some(ReduceOp::PreMulSum(_)) => Some(ReduceOp::Sum),
        o => o,
    }
}

/// Whether every host is a contiguous range of ranks of the same size (the
/// layout numbers hosts by their lowest rank, so host h is `h*k..(h+1)*k`).
pub fn host_major(layout: &Layout) -> bool {
    layout
        .per_host()
        .is_some_and(|k| *layout == Layout::uniform(layout.nhosts(), k))
}

/// The plan of `kind` (count, reduction, root as the operation's) for rank
/// `me` of `layout`; None where the operation is staged whole instead (see
/// the module docs). Only for layouts of two hosts or more, one of them
/// with two ranks or more (hosts of different sizes: [`uneven`]).
pub fn plan(
    kind: OpKind,
    count: usize,
    redop: Option<ReduceOp>,
    root: usize,
    layout: &Layout,
    me: usize,
) -> Option<DevicePlan> {
    let sizes = (0..layout.nhosts()).map(|h| layout.members(h).len());
    let (smallest, largest) = (sizes.clone().min()?, sizes.max()?);
    if layout.nhosts() < 2 || largest < 2 || count == 0 {
        return None;
    }
    match layout.per_host() {
        Some(_) => uniform(kind, count, redop, root, layout, me),
        None => uneven(kind, count, redop, root, layout, me, smallest),
    }
}

fn step(
    among: Among,
    kind: OpKind,
    send: At,
    recv: At,
    count: usize,
    redop: Option<ReduceOp>,
    root: usize,
) -> Step {
    Step {
        among,
        kind,
        send,
        recv,
        count,
        redop,
        root,
    }
}

/// Hosts of different sizes (after a shrink, or pods of different GPU
/// counts): each host's first rank (its leader, rail 0: every host has
/// one) carries the traffic between hosts, the rest stays on the host's
/// NVLink kernels.
/// - All-reduce: reduce to the leader, all-reduce among the leaders,
///   broadcast from the leader.
/// - Broadcast and reduce whose root's local index every host has: on the
///   root's rail, as on even hosts. A broadcast from a higher local index:
///   within the root's host first, then among the leaders, then within
///   each other host. A reduce to one: to the leaders, among them to the
///   root's host's leader, then within that host to the root (a host
///   broadcast: the kernels have no single copy between two ranks).
/// - All-gather and reduce-scatter on contiguous hosts (a host's blocks
///   are one range, host h' from rank s' for k' ranks): all-gather within
///   the host into place; the leaders broadcast each host's range to each
///   other; each leader broadcasts the other hosts' ranges within its host.
///   Reduce-scatter: reduce the whole input to the leader (a scratch);
///   among the leaders, reduce each host's range to that host's leader;
///   scatter the host's range from the leader. Every byte between hosts
///   crosses once per host, as a flat ring would; hosts interleaved in
///   rank order are staged whole.
fn uneven(
    kind: OpKind,
    count: usize,
    redop: Option<ReduceOp>,
    root: usize,
    layout: &Layout,
    me: usize,
    smallest: usize,
) -> Option<DevicePlan> {
    use At::{Recv, Scratch, Send};
    use OpKind::{AllGather, AllReduce, Broadcast, Reduce, ReduceScatter, Scatter};
    let (h, l) = (layout.host(me), layout.local(me));
    let (rh, rl) = (layout.host(root), layout.local(root));
    // Within the host, in place in the output, from its rank `from`.
    let host_broadcast = |from| step(Among::Host, Broadcast, Recv(0), Recv(0), count, None, from);
    // Host h' as a range of a rank-ordered buffer of `count`-element
    // blocks: (first element, elements).
    let range = |hh: usize| {
        let m = layout.members(hh);
        (m[0] * count, m.len() * count)
    };
    let mut scratch = 0;
    let steps = match kind {
        AllReduce => {
            let mut s = vec![step(Among::Host, Reduce, Send(0), Recv(0), count, redop, 0)];
            if l == 0 {
                s.push(step(
                    Among::Rail,
                    AllReduce,
                    Recv(0),
                    Recv(0),
                    count,
                    later(redop),
                    0,
                ));
            }
            s.push(host_broadcast(0));
            s
        }
        Broadcast | Reduce if rl < smallest => {
            return uniform(kind, count, redop, root, layout, me);
        }
        Broadcast => {
            let mut s = Vec::new();
            if h == rh {
                s.push(step(
                    Among::Host,
                    Broadcast,
                    Send(0),
                    Recv(0),
                    count,
                    None,
                    rl,
                ));
            }
            if l == 0 {
                // The root's host's leader has the data now (in its output).
                let from = if h == rh { Recv(0) } else { Send(0) };
                s.push(step(Among::Rail, Broadcast, from, Recv(0), count, None, rh));
            }
            if h != rh {
                s.push(host_broadcast(0));
            }
            s
        }
        Reduce => {
            // The partial sums in a scratch at the leaders and, for the
            // last step, at every rank of the root's host but the root
            // (their outputs are not theirs to use: NCCL's reduce leaves a
            // non-root's receive buffer alone).
            let at_root = me == root;
            if l == 0 || (h == rh && !at_root) {
                scratch = count;
            }
            let mid = if l == 0 { Scratch(0) } else { Recv(0) };
            let mut s = vec![step(Among::Host, Reduce, Send(0), mid, count, redop, 0)];
            if l == 0 {
                s.push(step(
                    Among::Rail,
                    Reduce,
                    Scratch(0),
                    Scratch(0),
                    count,
                    later(redop),
                    rh,
                ));
            }
            if h == rh {
                let to = if at_root { Recv(0) } else { Scratch(0) };
                s.push(step(Among::Host, Broadcast, Scratch(0), to, count, None, 0));
            }
            s
        }
        AllGather if layout.contiguous_hosts() => {
            let (mine, _) = range(h);
            let mut s = vec![step(
                Among::Host,
                AllGather,
                Send(0),
                Recv(mine),
                count,
                None,
                0,
            )];
            if l == 0 {
                s.extend((0..layout.nhosts()).map(|hh| {
                    let (at, len) = range(hh);
                    step(Among::Rail, Broadcast, Recv(at), Recv(at), len, None, hh)
                }));
            }
            // The other hosts' ranges: before this host's and after it.
            let (at, len) = range(h);
            let end = layout.n() * count;
            for (from, len) in [(0, at), (at + len, end - at - len)] {
                if len > 0 {
                    s.push(step(
                        Among::Host,
                        Broadcast,
                        Recv(from),
                        Recv(from),
                        len,
                        None,
                        0,
                    ));
                }
            }
            s
        }
        ReduceScatter if layout.contiguous_hosts() => {
            let whole = layout.n() * count;
            let mut s = Vec::new();
            if l == 0 {
                scratch = whole;
                s.push(step(
                    Among::Host,
                    Reduce,
                    Send(0),
                    Scratch(0),
                    whole,
                    redop,
                    0,
                ));
                s.extend((0..layout.nhosts()).map(|hh| {
                    let (at, len) = range(hh);
                    let op = later(redop);
                    step(Among::Rail, Reduce, Scratch(at), Scratch(at), len, op, hh)
                }));
                let (at, _) = range(h);
                s.push(step(
                    Among::Host,
                    Scatter,
                    Scratch(at),
                    Recv(0),
                    count,
                    None,
                    0,
                ));
            } else {
                // A non-root's reduce output and scatter input are unused.
                s.push(step(Among::Host, Reduce, Send(0), Recv(0), whole, redop, 0));
                s.push(step(Among::Host, Scatter, Send(0), Recv(0), count, None, 0));
            }
            s
        }
        _ => return None,
    };
    Some(DevicePlan { steps, scratch })
}

/// Hosts of the same size k >= 2 (see the module docs); broadcast and
/// reduce on any layout whose hosts all have the root's local index.
fn uniform(
    kind: OpKind,
    count: usize,
    redop: Option<ReduceOp>,
    root: usize,
    layout: &Layout,
    me: usize,
) -> Option<DevicePlan> {
    let nh = layout.nhosts();
    let l = layout.local(me);
    use At::{Recv, Scratch, Send};
    use OpKind::{AllGather, AllReduce, Broadcast, Reduce, ReduceScatter};
    let steps = match kind {
        AllReduce => {
            let k = layout.per_host()?;
            let m = count / k;
            if m == 0 {
                return None;
            }
            let mut s = vec![
                step(
                    Among::Host,
                    ReduceScatter,
                    Send(0),
                    Recv(l * m),
                    m,
                    redop,
                    0,
                ),
                step(
                    Among::Rail,
                    AllReduce,
                    Recv(l * m),
                    Recv(l * m),
                    m,
                    later(redop),
                    0,
                ),
                step(Among::Host, AllGather, Recv(l * m), Recv(0), m, None, 0),
            ];
            let tail = count - k * m;
            if tail > 0 {
                s.push(step(
                    Among::All,
                    AllReduce,
                    Send(k * m),
                    Recv(k * m),
                    tail,
                    redop,
                    0,
                ));
            }
            s
        }
        Broadcast => {
            let (rh, rl) = (layout.host(root), layout.local(root));
            let mut s = Vec::new();
            if l == rl {
                s.push(step(
                    Among::Rail,
                    Broadcast,
                    Send(0),
                    Recv(0),
                    count,
                    None,
                    rh,
                ));
            }
            s.push(step(
                Among::Host,
                Broadcast,
                Recv(0),
                Recv(0),
                count,
                None,
                rl,
            ));
            s
        }
        Reduce => {
            // Within each host to its rank on the root's rail (into the
            // output at the root, a scratch elsewhere), then on that rail
            // to the root (in place at the root).
            let (rh, rl) = (layout.host(root), layout.local(root));
            let at_root = me == root;
            // The partial result: the root's output, a scratch on the other
            // ranks of its rail; unused elsewhere (a reduce's non-root
            // output, as the caller passed it).
            let mid = if l == rl && !at_root {
                Scratch(0)
            } else {
                Recv(0)
            };
            let mut s = vec![step(Among::Host, Reduce, Send(0), mid, count, redop, rl)];
            if l == rl {
                s.push(step(
                    Among::Rail,
                    Reduce,
                    mid,
                    Recv(0),
                    count,
                    later(redop),
                    rh,
                ));
                if !at_root {
                    return Some(DevicePlan {
                        steps: s,
                        scratch: count,
                    });
                }
            }
            s
        }
        AllGather if host_major(layout) => {
            let k = layout.per_host()?;
            let mut s = vec![step(
                Among::Rail,
                AllGather,
                Send(0),
                Scratch(0),
                count,
                None,
                0,
            )];
            s.extend((0..nh).map(|h| {
                step(
                    Among::Host,
                    AllGather,
                    Scratch(h * count),
                    Recv(h * k * count),
                    count,
                    None,
                    0,
                )
            }));
            return Some(DevicePlan {
                steps: s,
                scratch: nh * count,
            });
        }
        ReduceScatter if host_major(layout) => {
            let k = layout.per_host()?;
            let mut s: Vec<Step> = (0..nh)
                .map(|h| {
                    step(
                        Among::Host,
                        ReduceScatter,
                        Send(h * k * count),
                        Scratch(h * count),
                        count,
                        redop,
                        0,
                    )
                })
                .collect();
            s.push(step(
                Among::Rail,
                ReduceScatter,
                Scratch(0),
                Recv(0),
                count,
                later(redop),
                0,
            ));
            return Some(DevicePlan {
                steps: s,
                scratch: nh * count,
            });
        }
        _ => return None,
    };
    Some(DevicePlan { steps, scratch: 0 })
}

/// Runs every rank's plan on host arrays of `f64`, step by step with the
/// reference semantics of each collective among its ranks, and returns
/// every rank's output: what the device path computes, for tests (CI has
/// no GPU). `inputs[r]` is rank r's input (send buffer), `out_len` the
/// output's elements; Sum, Max and Min only.
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

fn combine(op: Option<ReduceOp>, a: f64, b: f64) -> f64 {
    match op {
        Some(ReduceOp::Max) => a.max(b),
        Some(ReduceOp::Min) => a.min(b),
        _ => a + b,
    }
}

/// One collective among `members` (in their rank order among them).
fn run_group(members: &[usize], steps: &[Step], bufs: &mut [[Vec<f64>; 3]]) {
    let g = members.len();
    let st = steps[0];
    let c = st.count;
    let reduce = |len: usize, bufs: &[[Vec<f64>; 3]]| -> Vec<f64> {
        let mut acc = read(&bufs[members[0]], steps[0].send, len);
        for (i, &p) in members.iter().enumerate().skip(1) {
            let v = read(&bufs[p], steps[i].send, len);
            for (a, b) in acc.iter_mut().zip(v) {
                *a = combine(st.redop, *a, b);
            }
        }
        acc
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

#[cfg(test)]
mod tests {
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

    fn reduce_all(ins: &[Vec<f64>], op: Option<ReduceOp>) -> Vec<f64> {
        let mut acc = ins[0].clone();
        for v in &ins[1..] {
            for (a, b) in acc.iter_mut().zip(v) {
                *a = combine(op, *a, *b);
            }
        }
        acc
    }

    fn layouts() -> Vec<Layout> {
        vec![
            Layout::uniform(2, 2),
            Layout::uniform(2, 3),
            Layout::uniform(3, 2),
            Layout::uniform(4, 4),
            // Interleaved hosts (ranks 0, 2, 4 on one host): all-reduce and
            // broadcast still plan, all-gather and reduce-scatter do not.
            Layout::from_hosts(vec![vec![0, 2, 4], vec![1, 3, 5]]).unwrap(),
        ]
    }

    #[test]
    fn hierarchical_all_reduce_matches_the_reference_for_odd_sizes() {
        for layout in layouts() {
            let (n, k) = (layout.n(), layout.per_host().unwrap());
            for count in [k, k + 1, 7 * k - 1, 1000, 1023] {
                for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min] {
                    let ins = inputs(n, count, count as u64);
                    let outs =
                        simulate(OpKind::AllReduce, count, Some(op), 0, &layout, &ins, count)
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
    fn hierarchical_all_gather_and_reduce_scatter_match_on_contiguous_hosts() {
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
                if !host_major(&layout) {
                    assert!(ag.is_none() && rs.is_none(), "{layout:?}: staged whole");
                    continue;
                }
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
        // One rank per host, one host, uneven hosts: nothing local to do.
        assert!(
            plan(
                OpKind::AllReduce,
                64,
                Some(ReduceOp::Sum),
                0,
                &Layout::uniform(2, 1),
                0
            )
            .is_none()
        );
        assert!(
            plan(
                OpKind::AllReduce,
                64,
                Some(ReduceOp::Sum),
                0,
                &Layout::uniform(1, 4),
                0
            )
            .is_none()
        );
        // Hosts of different sizes interleaved in rank order: all-gather
        // and reduce-scatter are staged whole (a host's blocks are not one
        // range); contiguous, they are planned.
        let interleaved = Layout::from_hosts(vec![vec![0, 2, 3], vec![1]]).unwrap();
        let contiguous = Layout::from_hosts(vec![vec![0], vec![1, 2]]).unwrap();
        for (layout, planned) in [(&interleaved, false), (&contiguous, true)] {
            for kind in [OpKind::AllGather, OpKind::ReduceScatter] {
                let p = plan(kind, 64, Some(ReduceOp::Sum), 0, layout, 0);
                assert_eq!(p.is_some(), planned, "{kind:?} on {layout:?}");
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
                        let outs =
                            simulate(OpKind::Reduce, count, Some(op), root, layout, &ins, count)
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

    /// Hosts of different sizes as rank ranges: all-gather and
    /// reduce-scatter (Sum/Max/Min) by the leaders, odd counts, every
    /// rank's output against the reference.
    #[test]
    fn uneven_contiguous_hosts_all_gather_and_reduce_scatter_match_the_reference() {
        for layout in uneven_layouts().iter().filter(|l| l.contiguous_hosts()) {
            let n = layout.n();
            for count in [1usize, 5, 333] {
                let ins = inputs(n, count, count as u64 + 41);
                let outs = simulate(OpKind::AllGather, count, None, 0, layout, &ins, n * count)
                    .expect("all-gather planned on contiguous uneven hosts");
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
                    .expect("reduce-scatter planned on contiguous uneven hosts");
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
        // Avg averages per level: the mean of equal-sized means is the mean.
        let p = plan(OpKind::AllReduce, 8, Some(ReduceOp::Avg), 0, &l, 1).unwrap();
        assert!(
            p.steps
                .iter()
                .take(2)
                .all(|s| s.redop == Some(ReduceOp::Avg))
        );
    }
}
