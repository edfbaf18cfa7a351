//! From a network collective ([`NetColl`]) to the engine's chunk steps for
//! one rank: rings, chains and direct exchanges, pipelined.
//!
//! Every region is cut into chunks of at most `chunk` elements, alike on
//! every rank, so the i-th send on a lane and the peer's i-th receive have
//! the same size. Dependencies make the pipeline: a ring forwards chunk c
//! of a step as soon as chunk c of the previous step arrived (and was
//! reduced); a chain forwards each chunk as it arrives; a receive that
//! overwrites a block waits until this rank's send of that block's old
//! contents is done.
//!
//! The device side plugs in through two optional words: `ready` (the
//! producer has made the first j chunks of the input region ready: a step
//! reading or reducing into chunk j waits for `ready >= base + j + 1`, in
//! region order) and `landed` (raised by one for each chunk whose final
//! value is in place, in step order; [`Schedule::landed`] says how many).

use super::plan::{NetColl, Part, Region};
use super::program::{Step, StepOp};

/// How one rank's steps are cut and tied to its flags.
pub struct Cut<'a> {
    pub me: usize,
    /// Elements per chunk (at least 1).
    pub chunk: usize,
    /// Bytes per element.
    pub esize: usize,
    /// Where a region is: (call buffer index, byte offset).
    pub locate: &'a dyn Fn(&Region) -> (usize, usize),
    /// The producer's word and its value before this call.
    pub ready: Option<(usize, u64)>,
    /// The consumer's word and its value before this call.
    pub landed: Option<(usize, u64)>,
}

/// The steps of one rank, and how far they raise the landed word.
#[derive(Debug, Default)]
pub struct Schedule {
    pub steps: Vec<Step>,
    pub landed: u64,
}

/// A chunk: elements `[off, off + count)` of a region, and its position in
/// the region's chunk order.
#[derive(Clone, Copy)]
struct Chunk {
    region: Region,
    pos: usize,
}

/// The step indices of a ring reduce-scatter: per ring step, per chunk.
struct RingSteps {
    recvs: Vec<Vec<usize>>,
    sends: Vec<Vec<usize>>,
}

struct Builder<'a, 'b> {
    cut: &'b Cut<'a>,
    out: Schedule,
}

impl Builder<'_, '_> {
    /// The chunks of block `b` of `region` (cut into `blocks`, in order);
    /// positions count chunks from the region's first block.
    fn chunks(&self, region: &Region, blocks: &[Part], b: usize) -> Vec<Chunk> {
        let c = self.cut.chunk.max(1);
        let first: usize = blocks[..b].iter().map(|p| p.count.div_ceil(c)).sum();
        let part = blocks[b];
        let mut v = Vec::new();
        let mut off = 0;
        while off < part.count {
            let n = c.min(part.count - off);
            v.push(Chunk {
                region: region.at(part.off + off, n),
                pos: first + v.len(),
            });
            off += n;
        }
        v
    }

    fn step(
        &mut self,
        peer: usize,
        op: StepOp,
        ch: Chunk,
        after: Option<usize>,
        reads_input: bool,
    ) -> usize {
        let (buf, off) = (self.cut.locate)(&ch.region);
        let mut s = Step::new(peer, op, buf, off, ch.region.count * self.cut.esize);
        s.after = after;
        if reads_input && let Some((w, base)) = self.cut.ready {
            s.ready = Some((w, base + ch.pos as u64 + 1));
        }
        self.out.steps.push(s);
        self.out.steps.len() - 1
    }

    /// Marks step `i` as landing final data.
    fn lands(&mut self, i: usize) {
        if let Some((w, base)) = self.cut.landed {
            self.out.landed += 1;
            self.out.steps[i].publish = Some((w, base + self.out.landed));
        }
    }

    /// The chunk of `target` (a region the size of block `part`) at `ch`'s
    /// place in that block of `region`.
    fn block_chunk(region: &Region, part: Part, target: &Region, ch: Chunk) -> Chunk {
        Chunk {
            region: target.at(ch.region.off - region.off - part.off, ch.region.count),
            pos: ch.pos,
        }
    }

    /// The chunk of `input` at `ch`'s place in `region` (the same elements
    /// of this rank's contribution when it lies elsewhere).
    fn input_chunk(region: &Region, input: &Region, ch: Chunk) -> Chunk {
        Self::block_chunk(
            region,
            Part {
                off: 0,
                count: region.count,
            },
            input,
            ch,
        )
    }

    /// What a first send of `ch` reads: the input's chunk when the input
    /// lies elsewhere, else `ch` itself.
    fn send_from(region: &Region, input: Option<&Region>, ch: Chunk, first: bool) -> Chunk {
        match input {
            Some(inp) if first => Self::input_chunk(region, inp, ch),
            _ => ch,
        }
    }

    /// Gives reducing receive `k` its other operand, chunk `w`.
    fn reduce_with(&mut self, k: usize, w: Chunk) {
        self.out.steps[k].with = Some((self.cut.locate)(&w.region));
    }

    /// Ring reduce-scatter. With `input` (out of place), the first step
    /// sends from it and every reducing receive reads its own operand there
    /// (each block is reduced once per rank in a ring reduce-scatter, the
    /// first time this rank touches it), so `region` is written only. With
    /// `output`, the own block's sums go there instead of into `region`.
    #[allow(clippy::too_many_arguments)]
    fn ring_rs(
        &mut self,
        group: &[usize],
        i: usize,
        region: &Region,
        input: Option<&Region>,
        output: Option<&Region>,
        blocks: &[Part],
        land: bool,
    ) -> RingSteps {
        let g = group.len();
        let (next, prev) = (group[(i + 1) % g], group[(i + g - 1) % g]);
        let (mut recvs, mut sends): (Vec<Vec<usize>>, Vec<Vec<usize>>) = (vec![], vec![]);
        for s in 0..g - 1 {
            let sb = (i + 2 * g - 1 - s) % g;
            let rb = (i + 2 * g - 2 - s) % g;
            let mut sv = Vec::new();
            for (c, ch) in self.chunks(region, blocks, sb).into_iter().enumerate() {
                let after = (s > 0).then(|| recvs[s - 1][c]);
                let from = Self::send_from(region, input, ch, s == 0);
                sv.push(self.step(next, StepOp::Send, from, after, s == 0));
            }
            let mut rv = Vec::new();
            for ch in self.chunks(region, blocks, rb) {
                let own = (s == g - 2).then_some(output).flatten();
                let dst = match own {
                    Some(o) => Self::block_chunk(region, blocks[rb], o, ch),
                    None => ch,
                };
                let k = self.step(prev, StepOp::RecvReduce, dst, None, true);
                // The other operand: the input's, or the chunk's own old
                // value (in place; also when the sums go to the output).
                let with = match input {
                    Some(inp) => Some(Self::input_chunk(region, inp, ch)),
                    None => own.is_some().then_some(ch),
                };
                if let Some(w) = with {
                    self.reduce_with(k, w);
                }
                if land && s == g - 2 {
                    self.lands(k);
                }
                rv.push(k);
            }
            sends.push(sv);
            recvs.push(rv);
        }
        RingSteps { recvs, sends }
    }

    /// Ring all-gather; after a reduce-scatter (`rs`: its receives and
    /// sends) the own block's sends wait for its last reduction, and every
    /// receive for the send of its block's partial sums. `input`: where
    /// the own block is sent from (its size), when not from `region`.
    fn ring_ag(
        &mut self,
        group: &[usize],
        i: usize,
        region: &Region,
        blocks: &[Part],
        rs: Option<&RingSteps>,
        input: Option<&Region>,
    ) {
        let g = group.len();
        let (next, prev) = (group[(i + 1) % g], group[(i + g - 1) % g]);
        let mut last: Vec<usize> = Vec::new();
        for s in 0..g - 1 {
            let sb = (i + g - s) % g;
            let rb = (i + 2 * g - 1 - s) % g;
            for (c, ch) in self.chunks(region, blocks, sb).into_iter().enumerate() {
                let after = match (s, rs) {
                    (0, Some(rs)) => rs.recvs.last().map(|v| v[c]),
                    (0, None) => None,
                    _ => Some(last[c]),
                };
                let from = match input {
                    Some(inp) if s == 0 => Self::block_chunk(region, blocks[sb], inp, ch),
                    _ => ch,
                };
                self.step(next, StepOp::Send, from, after, s == 0 && rs.is_none());
            }
            let mut got = Vec::new();
            for (c, ch) in self.chunks(region, blocks, rb).into_iter().enumerate() {
                // Not before the send of this block's partial sums is done.
                let after = rs.map(|rs| rs.sends[s][c]);
                let k = self.step(prev, StepOp::Recv, ch, after, false);
                self.lands(k);
                got.push(k);
            }
            last = got;
        }
    }
}

/// A region as one block.
fn whole(r: &Region) -> [Part; 1] {
    [Part {
        off: 0,
        count: r.count,
    }]
}

/// The steps of `coll` for `cut.me`.
pub fn schedule(coll: &NetColl, cut: &Cut<'_>) -> Schedule {
    let mut b = Builder {
        cut,
        out: Schedule::default(),
    };
    let me = cut.me;
    let index = |group: &[usize]| {
        group
            .iter()
            .position(|&r| r == me)
            .expect("this rank is in the group")
    };
    // This rank's index in a ring `group`; None when the ring is this rank
    // alone (nothing to move).
    let ring_index = |group: &[usize]| (group.len() > 1).then(|| index(group));
    match coll {
        NetColl::AllReduce {
            group,
            region,
            input,
        } => {
            if let Some(i) = ring_index(group) {
                let blocks = super::plan::split(region.count, group.len());
                let rs = b.ring_rs(group, i, region, input.as_ref(), None, &blocks, true);
                b.ring_ag(group, i, region, &blocks, Some(&rs), None);
            }
        }
        NetColl::ReduceScatter {
            group,
            region,
            blocks,
            input,
            output,
        } => {
            if let Some(i) = ring_index(group) {
                b.ring_rs(
                    group,
                    i,
                    region,
                    input.as_ref(),
                    output.as_ref(),
                    blocks,
                    true,
                );
            }
        }
        NetColl::AllGather {
            group,
            region,
            blocks,
            input,
        } => {
            if let Some(i) = ring_index(group) {
                b.ring_ag(group, i, region, blocks, None, input.as_ref());
            }
        }
        NetColl::Broadcast {
            chain,
            region,
            input,
        } => {
            let p = index(chain);
            for ch in b.chunks(region, &whole(region), 0) {
                let got = (p > 0).then(|| {
                    let k = b.step(chain[p - 1], StepOp::Recv, ch, None, false);
                    b.lands(k);
                    k
                });
                if p + 1 < chain.len() {
                    let from = Builder::send_from(region, input.as_ref(), ch, p == 0);
                    b.step(chain[p + 1], StepOp::Send, from, got, p == 0);
                }
            }
        }
        NetColl::Reduce {
            chain,
            region,
            input,
        } => {
            let p = index(chain);
            for ch in b.chunks(region, &whole(region), 0) {
                let got = (p > 0).then(|| {
                    let k = b.step(chain[p - 1], StepOp::RecvReduce, ch, None, true);
                    if let Some(inp) = input {
                        b.reduce_with(k, Builder::input_chunk(region, inp, ch));
                    }
                    if p + 1 == chain.len() {
                        b.lands(k);
                    }
                    k
                });
                if p + 1 < chain.len() {
                    let from = Builder::send_from(region, input.as_ref(), ch, p == 0);
                    b.step(chain[p + 1], StepOp::Send, from, got, p == 0);
                }
            }
        }
        NetColl::Exchange { sends, recvs } => {
            for (peer, r) in sends {
                for ch in b.chunks(r, &whole(r), 0) {
                    b.step(*peer, StepOp::Send, ch, None, false);
                }
            }
            for (peer, r) in recvs {
                for ch in b.chunks(r, &whole(r), 0) {
                    let k = b.step(*peer, StepOp::Recv, ch, None, false);
                    b.lands(k);
                }
            }
        }
    }
    b.out
}
