//! Hosts of different sizes: the leaders' plans (see [`uneven`]).

use super::{Among, At, Coll, DevicePlan, later, step, uniform};
use crate::crosshost::layout::Layout;
use crate::data::types::ReduceOp;
use crate::op::OpKind;

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
/// - An average (`Avg`) is staged whole: a mean per level is the mean only
///   of groups of one size.
pub(super) fn uneven(c: Coll, layout: &Layout, me: usize, smallest: usize) -> Option<DevicePlan> {
    let Coll {
        kind,
        count,
        redop,
        root,
    } = c;
    use At::{Recv, Scratch, Send};
    use OpKind::{AllGather, AllReduce, Broadcast, Reduce, ReduceScatter, Scatter};
    // An average per level is the mean only of equal-sized groups: on
    // hosts of 1 and 2 ranks it would weigh the lone rank twice. Staged
    // whole, the average is of every rank at once.
    if redop == Some(ReduceOp::Avg) {
        return None;
    }
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
            return uniform(c, layout, me);
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
            let (at, len) = range(h);
            let mut s = vec![step(
                Among::Host,
                AllGather,
                Send(0),
                Recv(at),
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
