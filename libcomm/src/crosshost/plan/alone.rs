//! The plans for one rank per host (a GPU per node; the simulated 2 x 1
//! split): no local phase, so the ring or chain runs on the caller's
//! buffers themselves, with no scratch and no copies in or out. The rails'
//! plans copy the input into rail order and back, and with one rank per
//! host those copies cost as much as the network (docs/PERFORMANCE-GPU.md,
//! "Across hosts").

use super::{Builder, Ctx, NetColl, Part, Phase, Scaling, rotated};

impl Ctx<'_> {
    /// Blocks of `c` elements in rank order, listed in `group`'s order (a
    /// ring's block i is its i-th member's).
    pub(super) fn blocks_of(group: &[usize], c: usize) -> Vec<Part> {
        group
            .iter()
            .map(|&r| Part {
                off: r * c,
                count: c,
            })
            .collect()
    }

    /// All-reduce, one rank per host: the ring reads the input where it is
    /// and writes the output.
    pub(super) fn all_reduce_alone(&self, b: &mut Builder, n: usize, sc: Scaling, in_place: bool) {
        let out = self.recv(n);
        let src = b.input(self.send(n), sc);
        let input = (!in_place || sc.premul).then_some(src);
        if self.hosts > 1 {
            b.net(NetColl::AllReduce {
                group: self.layout.rail(0),
                region: out,
                input,
            });
        } else if let Some(i) = input {
            b.copy(i, out);
        }
        b.average(sc, out, self.n);
    }

    /// All-gather, one rank per host: the ring sends the own block from
    /// the input while this thread copies it into place (nothing to do in
    /// place; the ring never touches that block of the output).
    pub(super) fn all_gather_alone(&self, b: &mut Builder, c: usize) {
        let out = self.recv(self.n * c);
        if self.hosts > 1 {
            let group = self.layout.rail(0);
            b.push(Phase::Net {
                coll: NetColl::AllGather {
                    blocks: Self::blocks_of(&group, c),
                    group,
                    region: out,
                    input: Some(self.send(c)),
                },
                wait: false,
            });
        }
        b.copy(self.send(c), out.at(self.me * c, c));
    }

    /// Reduce-scatter, one rank per host: the ring reads the input where it
    /// is, reduces the blocks it forwards in a working buffer and the own
    /// block straight into the output.
    pub(super) fn reduce_scatter_alone(&self, b: &mut Builder, c: usize, sc: Scaling) {
        let src = b.input(self.send(self.n * c), sc);
        let out = self.recv(c);
        if self.hosts > 1 {
            let group = self.layout.rail(0);
            let work = b.scratch(self.n * c);
            b.net(NetColl::ReduceScatter {
                blocks: Self::blocks_of(&group, c),
                group,
                region: work,
                input: Some(src),
                output: Some(out),
            });
        } else {
            b.copy(src.at(self.me * c, c), out);
        }
        b.average(sc, out, self.n);
    }

    /// Broadcast, one rank per host: the root sends from its input while
    /// it copies it into its output; the others receive and forward.
    pub(super) fn broadcast_alone(&self, b: &mut Builder, n: usize, root: usize) {
        let out = self.recv(n);
        if self.hosts > 1 {
            b.push(Phase::Net {
                coll: NetColl::Broadcast {
                    chain: rotated(&self.layout.rail(0), self.layout.host(root)),
                    region: out,
                    input: (self.me == root).then(|| self.send(n)),
                },
                wait: false,
            });
        }
        if self.me == root {
            b.copy(self.send(n), out);
        }
    }

    /// Reduce, one rank per host: the chain ends at the root, which reduces
    /// into its output; the others into a working buffer (the first sends
    /// its input as it is).
    pub(super) fn reduce_alone(&self, b: &mut Builder, n: usize, sc: Scaling, root: usize) {
        let src = b.input(self.send(n), sc);
        let region = if self.me == root {
            self.recv(n)
        } else {
            b.scratch(n)
        };
        if self.hosts > 1 {
            b.net(NetColl::Reduce {
                chain: rotated(&self.layout.rail(0), self.layout.host(root) + 1),
                region,
                input: Some(src),
            });
        } else {
            b.copy(src, region);
        }
        if self.me == root {
            b.average(sc, region, self.n);
        }
    }
}
