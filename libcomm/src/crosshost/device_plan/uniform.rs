//! Hosts of the same size: rails and host-local steps (see [`uniform`]).

use super::{Among, At, Coll, DevicePlan, Step, host_major, later, step};
use crate::crosshost::layout::Layout;
use crate::op::OpKind;

/// Hosts of the same size k >= 2 (see the module docs); broadcast and
/// reduce on any layout whose hosts all have the root's local index.
pub(super) fn uniform(c: Coll, layout: &Layout, me: usize) -> Option<DevicePlan> {
    let Coll {
        kind,
        count,
        redop,
        root,
    } = c;
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
