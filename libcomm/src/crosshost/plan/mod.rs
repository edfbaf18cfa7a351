//! The hierarchical plans: pure functions from (collective, count, layout,
//! rank, shape) to the phases one rank runs.
//!
//! A phase is a collective among the ranks of this rank's host
//! ([`LocalStep`]: on GPUs the NVLink kernels of a host-local
//! sub-communicator, in the host executor copies through shared memory), a
//! network collective among ranks of different hosts ([`NetColl`], which
//! `schedule.rs` cuts into chunks for the engine), or a copy, scaling or
//! division within this rank. Regions are counted in elements of the
//! operation's type.
//!
//! Shapes ([`Shape`]):
//! - **Rails** (every host has k ranks): local rank l of every host forms
//!   rail l. All-reduce: local reduce-scatter (rank l keeps part l, 1/k of
//!   the data), an all-reduce of part l on rail l (a ring through the hosts),
//!   local all-gather. Every rail carries 1/k of the traffic between hosts,
//!   as NCCL's rings do with one NIC per GPU. The other collectives follow
//!   the same pattern (below).
//! - **Leaders** (any layout, and the fallback for hosts with different
//!   numbers of ranks): one rank per host (the root on the root's host)
//!   gathers or reduces its host's data, the leaders run one ring (or chain)
//!   through all hosts carrying everything, and the host's result is
//!   scattered or broadcast locally. Fewer, larger messages than rails:
//!   the choice for small sizes.
//! - **Direct** (all-to-all, send/recv): every pair of ranks on different
//!   hosts exchanges its data itself; pairs on one host locally.

mod alone;
use super::layout::Layout;

/// A buffer a plan names: the operation's send and receive buffers (index 0
/// for a collective; one per operation for a group of sends and receives)
/// or a scratch buffer the executor allocates ([`RankPlan::scratch`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Buf {
    Send(u16),
    Recv(u16),
    Scratch(u16),
}

/// A run of `count` elements at element `off` of a buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Region {
    pub buf: Buf,
    pub off: usize,
    pub count: usize,
}

impl Region {
    pub fn new(buf: Buf, off: usize, count: usize) -> Region {
        Region { buf, off, count }
    }

    /// The part `p` of this region.
    pub fn part(&self, p: Part) -> Region {
        debug_assert!(p.off + p.count <= self.count);
        Region::new(self.buf, self.off + p.off, p.count)
    }

    pub fn at(&self, off: usize, count: usize) -> Region {
        self.part(Part { off, count })
    }
}

/// A run of elements relative to a region: one rank's (or one block's) share.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Part {
    pub off: usize,
    pub count: usize,
}

/// `n` elements in `k` contiguous parts as equal as can be (the first `n %
/// k` one longer).
pub fn split(n: usize, k: usize) -> Vec<Part> {
    let (q, rem) = (n / k, n % k);
    let mut off = 0;
    (0..k)
        .map(|i| {
            let count = q + usize::from(i < rem);
            let p = Part { off, count };
            off += count;
            p
        })
        .collect()
}

/// `k` parts of `each` elements, one after another.
pub fn even(k: usize, each: usize) -> Vec<Part> {
    (0..k)
        .map(|i| Part {
            off: i * each,
            count: each,
        })
        .collect()
}

/// A collective among the ranks of this rank's host, in local rank order
/// (`parts[j]`, `root`: local ranks). Reductions use the operation's
/// reduction, contributions combined in local rank order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LocalStep {
    /// Local rank j's `dst` (`parts[j].count` elements) = the reduction
    /// over the host of `src.part(parts[j])`.
    ReduceScatter {
        src: Region,
        parts: Vec<Part>,
        dst: Region,
    },
    /// `dst.part(parts[j])` = local rank j's `src` on every rank.
    AllGather {
        src: Region,
        parts: Vec<Part>,
        dst: Region,
    },
    /// The root's `dst` = the reduction over the host of `src`.
    Reduce {
        src: Region,
        dst: Region,
        root: usize,
    },
    /// Every rank's `buf` = the root's.
    Broadcast { buf: Region, root: usize },
    /// The root's `dst.part(parts[j])` = local rank j's `src`.
    Gather {
        src: Region,
        parts: Vec<Part>,
        dst: Region,
        root: usize,
    },
    /// Local rank j's `dst` = the root's `src.part(parts[j])`.
    Scatter {
        src: Region,
        parts: Vec<Part>,
        dst: Region,
        root: usize,
    },
    /// This rank sends `src.part(out[j])` to local rank j and receives
    /// from it into `dst.part(inp[j])` (this rank's own part is a copy).
    AllToAll {
        src: Region,
        out: Vec<Part>,
        dst: Region,
        inp: Vec<Part>,
    },
    /// Point to point within the host: to and from local ranks.
    SendRecv {
        sends: Vec<(usize, Region)>,
        recvs: Vec<(usize, Region)>,
    },
}

/// A collective among ranks of different hosts (world ranks).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NetColl {
    /// Ring reduce-scatter then all-gather of `region` (split evenly) over
    /// `group`, in ring order. `input`: where this rank's contribution is
    /// when it is not already in `region` (out of place: read there, never
    /// written; `region` is then output only).
    AllReduce {
        group: Vec<usize>,
        region: Region,
        input: Option<Region>,
    },
    /// Ring reduce-scatter: the rank at index i of `group` ends with
    /// `region.part(blocks[i])` reduced over the group. In place, or from
    /// `input` (as for `AllReduce`; `region` is then the working buffer);
    /// `output`: where the own block's sums go instead (its size).
    ReduceScatter {
        group: Vec<usize>,
        region: Region,
        blocks: Vec<Part>,
        input: Option<Region>,
        output: Option<Region>,
    },
    /// Ring all-gather in place: `region.part(blocks[i])` of the rank at
    /// index i reaches every rank of the group. `input`: where the own
    /// block is sent from instead (its size; the plan puts it into
    /// `region` itself, meanwhile).
    AllGather {
        group: Vec<usize>,
        region: Region,
        blocks: Vec<Part>,
        input: Option<Region>,
    },
    /// Pipelined chain from `chain[0]` through the others in order.
    /// `input`: where the first sends from instead of `region`.
    Broadcast {
        chain: Vec<usize>,
        region: Region,
        input: Option<Region>,
    },
    /// Pipelined chain towards the last rank: each adds its `region` to what
    /// its predecessor sends and forwards the sum; the last holds the total.
    /// `input`: this rank's contribution when it is not in `region` (which
    /// is then written only, by the ranks after the first).
    Reduce {
        chain: Vec<usize>,
        region: Region,
        input: Option<Region>,
    },
    /// Direct messages: each send to its rank, each receive from its rank.
    Exchange {
        sends: Vec<(usize, Region)>,
        recvs: Vec<(usize, Region)>,
    },
}

impl NetColl {
    /// A number naming the kind, for message tags.
    pub fn kind(&self) -> u8 {
        match self {
            NetColl::AllReduce { .. } => 1,
            NetColl::ReduceScatter { .. } => 2,
            NetColl::AllGather { .. } => 3,
            NetColl::Broadcast { .. } => 4,
            NetColl::Reduce { .. } => 5,
            NetColl::Exchange { .. } => 6,
        }
    }
}

/// One phase of a rank's plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Phase {
    Local(LocalStep),
    /// Handed to the engine; `wait: false` lets the following phases run
    /// meanwhile (they touch none of its regions): the next network phase,
    /// or the plan's end, waits.
    Net {
        coll: NetColl,
        wait: bool,
    },
    /// Within this rank (overlapping regions allowed).
    Copy {
        src: Region,
        dst: Region,
    },
    /// Every element divided by `by` (average).
    Divide {
        region: Region,
        by: usize,
    },
    /// `dst = src x` this rank's pre-multiplication scalar (PreMulSum).
    Scale {
        src: Region,
        dst: Region,
    },
}

/// What one rank runs for one operation.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RankPlan {
    /// Element counts of the scratch buffers (`Buf::Scratch(i)`).
    pub scratch: Vec<usize>,
    pub phases: Vec<Phase>,
}

/// The collectives the planner knows (counts as in NCCL: the all-reduce,
/// broadcast and reduce buffer; one rank's all-gather input; one rank's
/// reduce-scatter output; the all-to-all block per peer).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Coll {
    AllReduce,
    AllGather,
    ReduceScatter,
    Broadcast { root: usize },
    Reduce { root: usize },
    AllToAll,
}

impl Coll {
    pub fn name(self) -> &'static str {
        match self {
            Coll::AllReduce => "allreduce",
            Coll::AllGather => "allgather",
            Coll::ReduceScatter => "reducescatter",
            Coll::Broadcast { .. } => "broadcast",
            Coll::Reduce { .. } => "reduce",
            Coll::AllToAll => "alltoall",
        }
    }

    /// A number naming the collective, for message tags.
    pub fn id(self) -> u8 {
        match self {
            Coll::AllReduce => 1,
            Coll::AllGather => 2,
            Coll::ReduceScatter => 3,
            Coll::Broadcast { .. } => 4,
            Coll::Reduce { .. } => 5,
            Coll::AllToAll => 6,
        }
    }

    /// (send, receive) buffer elements for `count` on `n` ranks.
    pub fn sizes(self, count: usize, n: usize) -> (usize, usize) {
        match self {
            Coll::AllReduce | Coll::Broadcast { .. } | Coll::Reduce { .. } => (count, count),
            Coll::AllGather => (count, count * n),
            Coll::ReduceScatter => (count * n, count),
            Coll::AllToAll => (count * n, count * n),
        }
    }
}

/// How ranks of different hosts exchange data.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Shape {
    Rails,
    Leaders,
    Direct,
}

impl Shape {
    pub fn name(self) -> &'static str {
        match self {
            Shape::Rails => "rails",
            Shape::Leaders => "leaders",
            Shape::Direct => "direct",
        }
    }

    /// Whether `coll` can run in this shape on `layout`.
    pub fn fits(self, coll: Coll, layout: &Layout) -> bool {
        match self {
            Shape::Rails => layout.per_host().is_some(),
            Shape::Leaders => coll != Coll::AllToAll,
            Shape::Direct => coll == Coll::AllToAll,
        }
    }
}

/// The reduction's extra steps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Scaling {
    /// Each rank scales its input first (PreMulSum).
    pub premul: bool,
    /// The result is divided by the rank count (Avg).
    pub avg: bool,
}

/// Builds a plan: scratch buffers and phases.
struct Builder {
    plan: RankPlan,
}

impl Builder {
    fn new() -> Builder {
        Builder {
            plan: RankPlan::default(),
        }
    }
    fn scratch(&mut self, count: usize) -> Region {
        self.plan.scratch.push(count);
        Region::new(Buf::Scratch(self.plan.scratch.len() as u16 - 1), 0, count)
    }
    fn push(&mut self, p: Phase) {
        self.plan.phases.push(p);
    }
    fn local(&mut self, s: LocalStep) {
        self.push(Phase::Local(s));
    }
    fn net(&mut self, coll: NetColl) {
        self.push(Phase::Net { coll, wait: true });
    }
    fn copy(&mut self, src: Region, dst: Region) {
        if src.count > 0 {
            self.push(Phase::Copy { src, dst });
        }
    }
    /// Divides `region` by the rank count `n` for an average.
    fn average(&mut self, sc: Scaling, region: Region, n: usize) {
        if sc.avg {
            self.push(Phase::Divide { region, by: n });
        }
    }

    /// The input, scaled into scratch first for PreMulSum.
    fn input(&mut self, src: Region, sc: Scaling) -> Region {
        if !sc.premul {
            return src;
        }
        let t = self.scratch(src.count);
        self.push(Phase::Scale { src, dst: t });
        t
    }
}

/// `group` rotated so that it starts at index `first`.
fn rotated(group: &[usize], first: usize) -> Vec<usize> {
    (0..group.len())
        .map(|i| group[(first + i) % group.len()])
        .collect()
}

/// The plan of rank `me` for `coll` of `count` elements on `layout` in
/// `shape` (which must fit: [`Shape::fits`]). `in_place`: the send and
/// receive buffers are NCCL's in-place arrangement.
pub fn plan(
    coll: Coll,
    count: usize,
    sc: Scaling,
    layout: &Layout,
    me: usize,
    shape: Shape,
    in_place: bool,
) -> RankPlan {
    assert!(
        shape.fits(coll, layout),
        "{shape:?} for {coll:?} on {layout:?}"
    );
    let mut b = Builder::new();
    let p = Ctx {
        layout,
        me,
        h: layout.host(me),
        l: layout.local(me),
        hosts: layout.nhosts(),
        n: layout.n(),
    };
    let one_per_host = layout.per_host() == Some(1);
    match (coll, shape) {
        (Coll::AllReduce, _) if one_per_host => p.all_reduce_alone(&mut b, count, sc, in_place),
        (Coll::AllGather, _) if one_per_host => p.all_gather_alone(&mut b, count),
        (Coll::ReduceScatter, _) if one_per_host => p.reduce_scatter_alone(&mut b, count, sc),
        (Coll::Broadcast { root }, _) if one_per_host => p.broadcast_alone(&mut b, count, root),
        (Coll::Reduce { root }, _) if one_per_host => p.reduce_alone(&mut b, count, sc, root),
        (Coll::AllReduce, Shape::Rails) => p.all_reduce_rails(&mut b, count, sc),
        (Coll::AllReduce, _) => p.all_reduce_leaders(&mut b, count, sc),
        (Coll::AllGather, Shape::Rails) => p.all_gather_rails(&mut b, count),
        (Coll::AllGather, _) => p.all_gather_leaders(&mut b, count),
        (Coll::ReduceScatter, Shape::Rails) => p.reduce_scatter_rails(&mut b, count, sc),
        (Coll::ReduceScatter, _) => p.reduce_scatter_leaders(&mut b, count, sc),
        (Coll::Broadcast { root }, Shape::Rails) => p.broadcast_rails(&mut b, count, root),
        (Coll::Broadcast { root }, _) => p.broadcast_leaders(&mut b, count, root),
        (Coll::Reduce { root }, Shape::Rails) => p.reduce_rails(&mut b, count, sc, root),
        (Coll::Reduce { root }, _) => p.reduce_leaders(&mut b, count, sc, root),
        (Coll::AllToAll, Shape::Rails) => p.all_to_all_rails(&mut b, count),
        (Coll::AllToAll, _) => p.all_to_all_direct(&mut b, count, in_place),
    }
    b.plan
}

/// The plan of rank `me` for a group of sends (`sends[i]`: peer and count,
/// from `Buf::Send(i)`) and receives (into `Buf::Recv(i)`): remote peers
/// over the network, ranks of this host locally, itself by copies (the i-th
/// send to itself into the i-th receive from itself). Sends to one peer
/// meet that peer's receives from this rank in order.
pub fn plan_p2p(
    layout: &Layout,
    me: usize,
    sends: &[(usize, usize)],
    recvs: &[(usize, usize)],
) -> RankPlan {
    let mut b = Builder::new();
    let (mut net_s, mut net_r, mut loc_s, mut loc_r) = (vec![], vec![], vec![], vec![]);
    let mut self_s = Vec::new();
    let mut self_r = Vec::new();
    let host = layout.host(me);
    for (i, &(peer, count)) in sends.iter().enumerate() {
        let r = Region::new(Buf::Send(i as u16), 0, count);
        match peer {
            p if p == me => self_s.push(r),
            p if layout.host(p) == host => loc_s.push((layout.local(p), r)),
            p => net_s.push((p, r)),
        }
    }
    for (i, &(peer, count)) in recvs.iter().enumerate() {
        let r = Region::new(Buf::Recv(i as u16), 0, count);
        match peer {
            p if p == me => self_r.push(r),
            p if layout.host(p) == host => loc_r.push((layout.local(p), r)),
            p => net_r.push((p, r)),
        }
    }
    // The network goes first and runs while the host's ranks exchange.
    if !net_s.is_empty() || !net_r.is_empty() {
        b.push(Phase::Net {
            coll: NetColl::Exchange {
                sends: net_s,
                recvs: net_r,
            },
            wait: false,
        });
    }
    for (s, r) in self_s.into_iter().zip(self_r) {
        b.copy(s, Region::new(r.buf, r.off, s.count.min(r.count)));
    }
    if !loc_s.is_empty() || !loc_r.is_empty() {
        b.local(LocalStep::SendRecv {
            sends: loc_s,
            recvs: loc_r,
        });
    }
    b.plan
}

/// One rank's view of the layout.
struct Ctx<'a> {
    layout: &'a Layout,
    me: usize,
    h: usize,
    l: usize,
    hosts: usize,
    n: usize,
}

impl Ctx<'_> {
    fn k(&self) -> usize {
        self.layout.per_host().expect("rails need a uniform layout")
    }

    fn send(&self, count: usize) -> Region {
        Region::new(Buf::Send(0), 0, count)
    }

    fn recv(&self, count: usize) -> Region {
        Region::new(Buf::Recv(0), 0, count)
    }

    /// The leaders of every host, in host order (`root` leads its host).
    fn leaders(&self, root: Option<usize>) -> Vec<usize> {
        (0..self.hosts)
            .map(|h| self.layout.leader(h, root))
            .collect()
    }

    /// (first rank index in host order, ranks) of each host: where a host's
    /// ranks sit when data is ordered by host, then local rank.
    fn host_offsets(&self) -> Vec<(usize, usize)> {
        let mut off = 0;
        (0..self.hosts)
            .map(|h| {
                let k = self.layout.members(h).len();
                off += k;
                (off - k, k)
            })
            .collect()
    }

    /// Each host's blocks of `c` elements when data is ordered by host.
    fn host_blocks(&self, c: usize) -> Vec<Part> {
        self.host_offsets()
            .iter()
            .map(|&(o, k)| Part {
                off: o * c,
                count: k * c,
            })
            .collect()
    }

    /// Copies the `c`-element blocks of every rank between rank order
    /// (`by_rank`: rank r's at r c) and rail order (`rails`: the block of
    /// local rank j of host g at (j hosts + g) c), towards the rails when
    /// `to_rails`.
    fn rail_order(
        &self,
        b: &mut Builder,
        by_rank: Region,
        rails: Region,
        c: usize,
        to_rails: bool,
    ) {
        for j in 0..self.k() {
            for g in 0..self.hosts {
                let r = self.layout.members(g)[j];
                let (x, y) = (by_rank.at(r * c, c), rails.at((j * self.hosts + g) * c, c));
                if to_rails { b.copy(x, y) } else { b.copy(y, x) }
            }
        }
    }

    /// The same between rank order and host order (`by_host`: the block of
    /// local rank j of host g at (first of g + j) c).
    fn host_order(
        &self,
        b: &mut Builder,
        by_rank: Region,
        by_host: Region,
        c: usize,
        to_hosts: bool,
    ) {
        for (g, &(o, _)) in self.host_offsets().iter().enumerate() {
            for (j, &r) in self.layout.members(g).iter().enumerate() {
                let (x, y) = (by_rank.at(r * c, c), by_host.at((o + j) * c, c));
                if to_hosts { b.copy(x, y) } else { b.copy(y, x) }
            }
        }
    }

    /// The rails' first phase: the input reduced over the host, part l
    /// (of k) into scratch on local rank l. Returns the parts and mine.
    fn host_reduce_scatter(&self, b: &mut Builder, n: usize, sc: Scaling) -> (Vec<Part>, Region) {
        let parts = split(n, self.k());
        let src = b.input(self.send(n), sc);
        let mine = b.scratch(parts[self.l].count);
        b.local(LocalStep::ReduceScatter {
            src,
            parts: parts.clone(),
            dst: mine,
        });
        (parts, mine)
    }

    fn all_reduce_rails(&self, b: &mut Builder, n: usize, sc: Scaling) {
        let (parts, mine) = self.host_reduce_scatter(b, n, sc);
        if self.hosts > 1 {
            b.net(NetColl::AllReduce {
                group: self.layout.rail(self.l),
                region: mine,
                input: None,
            });
        }
        b.average(sc, mine, self.n);
        b.local(LocalStep::AllGather {
            src: mine,
            parts,
            dst: self.recv(n),
        });
    }

    fn all_reduce_leaders(&self, b: &mut Builder, n: usize, sc: Scaling) {
        let src = b.input(self.send(n), sc);
        let leader = self.layout.leader(self.h, None);
        let sum = b.scratch(n);
        b.local(LocalStep::Reduce {
            src,
            dst: sum,
            root: self.layout.local(leader),
        });
        if self.me == leader {
            if self.hosts > 1 {
                b.net(NetColl::AllReduce {
                    group: self.leaders(None),
                    region: sum,
                    input: None,
                });
            }
            b.average(sc, sum, self.n);
            b.copy(sum, self.recv(n));
        }
        b.local(LocalStep::Broadcast {
            buf: self.recv(n),
            root: self.layout.local(leader),
        });
    }

    fn all_gather_rails(&self, b: &mut Builder, c: usize) {
        let (k, hosts) = (self.k(), self.hosts);
        let rail = b.scratch(hosts * c);
        b.copy(self.send(c), rail.at(self.h * c, c));
        if hosts > 1 {
            b.net(NetColl::AllGather {
                group: self.layout.rail(self.l),
                region: rail,
                blocks: even(hosts, c),
                input: None,
            });
        }
        let all = b.scratch(k * hosts * c);
        b.local(LocalStep::AllGather {
            src: rail,
            parts: even(k, hosts * c),
            dst: all,
        });
        // `all` is ordered by local rank, then host; the output by rank.
        for j in 0..k {
            for g in 0..hosts {
                let r = self.layout.members(g)[j];
                b.copy(
                    all.at((j * hosts + g) * c, c),
                    self.recv(self.n * c).at(r * c, c),
                );
            }
        }
    }

    fn all_gather_leaders(&self, b: &mut Builder, c: usize) {
        let leader = self.layout.leader(self.h, None);
        let offs = self.host_offsets();
        let (my_off, my_k) = offs[self.h];
        let host = b.scratch(my_k * c);
        b.local(LocalStep::Gather {
            src: self.send(c),
            parts: even(my_k, c),
            dst: host,
            root: self.layout.local(leader),
        });
        let out = self.recv(self.n * c);
        if self.me == leader {
            let all = b.scratch(self.n * c);
            b.copy(host, all.at(my_off * c, my_k * c));
            if self.hosts > 1 {
                b.net(NetColl::AllGather {
                    group: self.leaders(None),
                    region: all,
                    blocks: self.host_blocks(c),
                    input: None,
                });
            }
            self.host_order(b, out, all, c, false);
        }
        b.local(LocalStep::Broadcast {
            buf: out,
            root: self.layout.local(leader),
        });
    }

    fn reduce_scatter_rails(&self, b: &mut Builder, c: usize, sc: Scaling) {
        let (k, hosts) = (self.k(), self.hosts);
        let src = b.input(self.send(self.n * c), sc);
        // In rail order: part j is what rail j reduces.
        let packed = b.scratch(self.n * c);
        self.rail_order(b, src, packed, c, true);
        let rail = b.scratch(hosts * c);
        b.local(LocalStep::ReduceScatter {
            src: packed,
            parts: even(k, hosts * c),
            dst: rail,
        });
        if hosts > 1 {
            b.net(NetColl::ReduceScatter {
                group: self.layout.rail(self.l),
                region: rail,
                blocks: even(hosts, c),
                input: None,
                output: None,
            });
        }
        let mine = rail.at(self.h * c, c);
        b.average(sc, mine, self.n);
        b.copy(mine, self.recv(c));
    }

    fn reduce_scatter_leaders(&self, b: &mut Builder, c: usize, sc: Scaling) {
        let leader = self.layout.leader(self.h, None);
        let offs = self.host_offsets();
        let src = b.input(self.send(self.n * c), sc);
        let packed = b.scratch(self.n * c);
        self.host_order(b, src, packed, c, true);
        let sum = b.scratch(self.n * c);
        b.local(LocalStep::Reduce {
            src: packed,
            dst: sum,
            root: self.layout.local(leader),
        });
        let (my_off, my_k) = offs[self.h];
        let host = sum.at(my_off * c, my_k * c);
        if self.me == leader {
            if self.hosts > 1 {
                b.net(NetColl::ReduceScatter {
                    group: self.leaders(None),
                    region: sum,
                    blocks: self.host_blocks(c),
                    input: None,
                    output: None,
                });
            }
            b.average(sc, host, self.n);
        }
        b.local(LocalStep::Scatter {
            src: host,
            parts: even(my_k, c),
            dst: self.recv(c),
            root: self.layout.local(leader),
        });
    }

    /// A broadcast's first phase: the root's input reaches every rank of
    /// its host (the receive buffer of `n` elements, returned).
    fn broadcast_on_root_host(&self, b: &mut Builder, n: usize, root: usize) -> Region {
        let out = self.recv(n);
        if self.me == root {
            b.copy(self.send(n), out);
        }
        if self.h == self.layout.host(root) {
            b.local(LocalStep::Broadcast {
                buf: out,
                root: self.layout.local(root),
            });
        }
        out
    }

    fn broadcast_rails(&self, b: &mut Builder, n: usize, root: usize) {
        let hr = self.layout.host(root);
        let out = self.broadcast_on_root_host(b, n, root);
        let parts = split(n, self.k());
        if self.hosts > 1 {
            b.net(NetColl::Broadcast {
                chain: rotated(&self.layout.rail(self.l), hr),
                region: out.part(parts[self.l]),
                input: None,
            });
        }
        if self.h != hr {
            b.local(LocalStep::AllGather {
                src: out.part(parts[self.l]),
                parts,
                dst: out,
            });
        }
    }

    fn broadcast_leaders(&self, b: &mut Builder, n: usize, root: usize) {
        let hr = self.layout.host(root);
        let out = self.broadcast_on_root_host(b, n, root);
        let leader = self.layout.leader(self.h, Some(root));
        if self.me == leader && self.hosts > 1 {
            b.net(NetColl::Broadcast {
                chain: rotated(&self.leaders(Some(root)), hr),
                region: out,
                input: None,
            });
        }
        if self.h != hr {
            b.local(LocalStep::Broadcast {
                buf: out,
                root: self.layout.local(leader),
            });
        }
    }

    fn reduce_rails(&self, b: &mut Builder, n: usize, sc: Scaling, root: usize) {
        let hr = self.layout.host(root);
        let (parts, mine) = self.host_reduce_scatter(b, n, sc);
        if self.hosts > 1 {
            // Ends at the root's host.
            b.net(NetColl::Reduce {
                chain: rotated(&self.layout.rail(self.l), hr + 1),
                region: mine,
                input: None,
            });
        }
        if self.h == hr {
            b.average(sc, mine, self.n);
            b.local(LocalStep::Gather {
                src: mine,
                parts,
                dst: self.recv(n),
                root: self.layout.local(root),
            });
        }
    }

    fn reduce_leaders(&self, b: &mut Builder, n: usize, sc: Scaling, root: usize) {
        let hr = self.layout.host(root);
        let leader = self.layout.leader(self.h, Some(root));
        let src = b.input(self.send(n), sc);
        let sum = b.scratch(n);
        b.local(LocalStep::Reduce {
            src,
            dst: sum,
            root: self.layout.local(leader),
        });
        if self.me == leader && self.hosts > 1 {
            b.net(NetColl::Reduce {
                chain: rotated(&self.leaders(Some(root)), hr + 1),
                region: sum,
                input: None,
            });
        }
        if self.me == root {
            b.average(sc, sum, self.n);
            b.copy(sum, self.recv(n));
        }
    }

    fn all_to_all_rails(&self, b: &mut Builder, c: usize) {
        let (k, hosts, n) = (self.k(), self.hosts, self.n);
        // By destination local rank, then destination host.
        let packed = b.scratch(n * c);
        for j in 0..k {
            for g in 0..hosts {
                let r = self.layout.members(g)[j];
                b.copy(
                    self.send(n * c).at(r * c, c),
                    packed.at((j * hosts + g) * c, c),
                );
            }
        }
        // After: block (j, g) came from local rank j, for rank (g, me's l).
        let mixed = b.scratch(n * c);
        b.local(LocalStep::AllToAll {
            src: packed,
            out: even(k, hosts * c),
            dst: mixed,
            inp: even(k, hosts * c),
        });
        // By destination host, then source local rank: one message per host.
        let out = b.scratch(n * c);
        for j in 0..k {
            for g in 0..hosts {
                b.copy(mixed.at((j * hosts + g) * c, c), out.at((g * k + j) * c, c));
            }
        }
        let got = b.scratch(n * c);
        let rail = self.layout.rail(self.l);
        let others = (0..hosts).filter(|&g| g != self.h);
        if hosts > 1 {
            b.net(NetColl::Exchange {
                sends: others
                    .clone()
                    .map(|g| (rail[g], out.at(g * k * c, k * c)))
                    .collect(),
                recvs: others
                    .map(|g| (rail[g], got.at(g * k * c, k * c)))
                    .collect(),
            });
        }
        b.copy(out.at(self.h * k * c, k * c), got.at(self.h * k * c, k * c));
        // In host order of the sources.
        self.host_order(b, self.recv(n * c), got, c, false);
    }

    fn all_to_all_direct(&self, b: &mut Builder, c: usize, in_place: bool) {
        let n = self.n;
        let mut src = self.send(n * c);
        if in_place {
            let t = b.scratch(n * c);
            b.copy(src, t);
            src = t;
        }
        let dst = self.recv(n * c);
        let remote = self.layout.remote(self.me);
        if !remote.is_empty() {
            b.push(Phase::Net {
                coll: NetColl::Exchange {
                    sends: remote.iter().map(|&r| (r, src.at(r * c, c))).collect(),
                    recvs: remote.iter().map(|&r| (r, dst.at(r * c, c))).collect(),
                },
                wait: false,
            });
        }
        let mine: Vec<Part> = self
            .layout
            .members(self.h)
            .iter()
            .map(|&r| Part {
                off: r * c,
                count: c,
            })
            .collect();
        b.local(LocalStep::AllToAll {
            src,
            out: mine.clone(),
            dst,
            inp: mine,
        });
    }
}

#[cfg(test)]
mod tests;
