//! All-gather and reduce-scatter on hosts that are not rank ranges (ranks
//! placed round-robin, or a host's ranks interleaved with another's): the
//! plan of the same layout renumbered host-major, on a copy of the
//! buffer in host-major block order (see [`permuted`]).

use super::{Among, At, Coll, DevicePlan, Step, plan, step};
use crate::crosshost::layout::Layout;
use crate::op::OpKind;

/// The layout with its ranks renumbered host-major (host h's ranks become
/// one range, after the ranks of hosts before it, in local order), and
/// `order[j]`: the rank that host-major position `j` stands for. Hosts and
/// local indices stay as they are, so the renumbered layout's steps run on
/// the same host-local and rail communicators.
pub(super) fn host_major_order(layout: &Layout) -> (Layout, Vec<usize>) {
    let order: Vec<usize> = (0..layout.nhosts())
        .flat_map(|h| layout.members(h).iter().copied())
        .collect();
    let mut start = 0;
    let hosts = (0..layout.nhosts())
        .map(|h| {
            let k = layout.members(h).len();
            start += k;
            (start - k..start).collect()
        })
        .collect();
    let renumbered = Layout::from_hosts(hosts).expect("a partition by construction");
    (renumbered, order)
}

/// An all-gather or reduce-scatter of `c` for rank `me` of `layout`, whose
/// hosts are not rank ranges: a host's blocks of the rank-ordered buffer
/// are not one range, which the host-major plans need (a host-local
/// all-gather writes its ranks' blocks one after the other). So the plan
/// of the renumbered layout ([`host_major_order`]) runs on a scratch
/// holding the buffer in host-major block order, and copies on this rank
/// alone (`Among::Me`) move the blocks between that order and rank order:
/// - all-gather: the plan gathers into the scratch; then block `j` of the
///   scratch is copied to block `order[j]` of the output;
/// - reduce-scatter: block `order[j]` of the input is first copied to
///   block `j` of the scratch, which the plan then reduces and scatters
///   (a rank's block of the renumbered layout is its own: host and local
///   index are kept).
///
/// The cost against a host-major layout is one copy of the whole buffer
/// in device memory (fast next to the network) and a scratch of its size
/// for the call, and the steps' traffic is the host-major plan's: the
/// local part stays on the NVLink kernels.
/// Runs of blocks that stay in order are copied as one.
pub(super) fn permuted(c: Coll, layout: &Layout, me: usize) -> Option<DevicePlan> {
    let (renumbered, order) = host_major_order(layout);
    let me2 = order.iter().position(|&r| r == me)?;
    let inner = plan(c.kind, c.count, c.redop, 0, &renumbered, me2)?;
    // The host-major copy of the buffer, after the inner plan's scratch.
    let base = inner.scratch;
    let whole = layout.n() * c.count;
    let copies = runs(&order).into_iter().map(|(j, r, len)| {
        let (host_major, rank_order) = (base + j * c.count, r * c.count);
        (host_major, rank_order, len * c.count)
    });
    let mut steps = Vec::new();
    match c.kind {
        OpKind::AllGather => {
            steps.extend(inner.steps.iter().map(|s| moved(s, c.kind, base)));
            steps.extend(copies.map(|(hm, ro, len)| copy(At::Scratch(hm), At::Recv(ro), len)));
        }
        OpKind::ReduceScatter => {
            steps.extend(copies.map(|(hm, ro, len)| copy(At::Send(ro), At::Scratch(hm), len)));
            steps.extend(inner.steps.iter().map(|s| moved(s, c.kind, base)));
        }
        _ => return None,
    }
    Some(DevicePlan {
        steps,
        scratch: base + whole,
    })
}

/// A step of the inner plan with the buffer it holds in host-major order
/// (an all-gather's output, a reduce-scatter's input) moved to the copy at
/// `base` of the scratch.
fn moved(s: &Step, kind: OpKind, base: usize) -> Step {
    let at = |a: At| match (kind, a) {
        (OpKind::AllGather, At::Recv(o)) | (OpKind::ReduceScatter, At::Send(o)) => {
            At::Scratch(base + o)
        }
        (_, a) => a,
    };
    Step {
        send: at(s.send),
        recv: at(s.recv),
        ..*s
    }
}

/// A copy of `len` elements on this rank alone: a broadcast among one rank.
fn copy(from: At, to: At, len: usize) -> Step {
    step(Among::Me, OpKind::Broadcast, from, to, len, None, 0)
}

/// `order` as runs `(j, order[j], len)` of consecutive positions whose
/// ranks are consecutive too (each run one copy).
fn runs(order: &[usize]) -> Vec<(usize, usize, usize)> {
    let mut out: Vec<(usize, usize, usize)> = Vec::new();
    for (j, &r) in order.iter().enumerate() {
        match out.last_mut() {
            Some((j0, r0, len)) if *j0 + *len == j && *r0 + *len == r => *len += 1,
            _ => out.push((j, r, 1)),
        }
    }
    out
}
