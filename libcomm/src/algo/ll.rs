//! The latency path for small host all-reduces, reduce-scatters and
//! all-gathers with every rank on one host: the LL idea on the CPU.
//!
//! Each rank's shared-memory segment carries two buffers (even and odd
//! operations) of an input slot and an output slot (`transport/shm.rs`,
//! [`SlotHdr`]). Only the owner writes its slots; peers read them in place.
//! A slot is published by one release store of the operation's epoch (and
//! its length) after the data: a reader that sees the epoch it waits for sees
//! the data, with no ring, no header exchange, no doorbell and no system call
//! on the fast path.
//!
//! - **One shot** ([`Algo::Ll`](crate::op::tuner::Algo::Ll)): every rank copies
//!   its input into its input slot, then reduces the n input slots straight
//!   into its output buffer, in rank order (bit-identical results on every
//!   rank). One copy in, one reduction pass reading n buffers; in place and
//!   out of place cost the same (the input is in the slot before the output
//!   is written).
//! - **Two shots** ([`Algo::Ll2`](crate::op::tuner::Algo::Ll2)): reduce-scatter in
//!   one step (rank r reduces chunk r of the n input slots into its output
//!   slot), then all-gather in one step (every rank copies chunk p out of
//!   rank p's output slot). Reads 2x the buffer instead of n x.
//! - **Reduce-scatter** in one step: every rank copies its n blocks into its
//!   input slot, then reduces block r of the n input slots straight into its
//!   output buffer, in rank order.
//! - **All-gather** in one step: every rank copies its block into its input
//!   slot, then copies block p out of rank p's input slot.
//!
//! In place and out of place cost the same in every one of them: the input
//! is in the slot before the output buffer is written.
//!
//! Reuse without acknowledgements: a slot of buffer `e mod 2` is rewritten
//! at epoch e+2 only. Before that its owner has waited, at epoch e+1, for
//! every peer's input of e+1, which each peer publishes only after finishing
//! epoch e (all its reads of our slots included). So every epoch waits for
//! every peer's input slot, and the release/acquire pair orders the peer's
//! reads of epoch e before our writes of e+2.
//!
//! Waiting: spin (no system call) for up to 50 us while the ranks have a
//! core each (a running peer answers well within that); with more local
//! ranks than cores, or once the spin is over, yield a few times (a spinning
//! rank would hold the core its peer needs); then sleep on this rank's futex
//! doorbell, which a publisher rings only if someone sleeps.
//! Raised failures are checked as the engine does, peer liveness and
//! `WEFT_TIMEOUT_MS` every 100 ms, and pending eager sends keep moving.

use crate::data::reduce;
use crate::data::types::{DataType, ReduceOp};
use crate::error::{Error, Result};
use crate::op::Op;
use crate::progress::resources::{PeerKind, Resources};
use crate::progress::xfer::Wait;
use crate::transport::futex;
use crate::transport::shm::{LL_SLOT_BYTES, Mapping, SlotHdr};
use std::sync::atomic::{AtomicU32, Ordering, fence};
use std::time::{Duration, Instant};

/// What runs through the latency slots: it travels in the top bits of each
/// published slot's tag, so ranks that chose differently get an error, not
/// a hang or a wrong result.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Kind {
    AllReduce = 0,
    AllReduce2 = 1,
    ReduceScatter = 2,
    AllGather = 3,
}

impl Kind {
    const SHIFT: u32 = 60;

    fn name(self) -> &'static str {
        match self {
            Kind::AllReduce => "an all-reduce (one shot)",
            Kind::AllReduce2 => "an all-reduce (two shots)",
            Kind::ReduceScatter => "a reduce-scatter",
            Kind::AllGather => "an all-gather",
        }
    }

    fn of_tag(tag: u64) -> &'static str {
        match tag >> Kind::SHIFT {
            0 => Kind::AllReduce.name(),
            1 => Kind::AllReduce2.name(),
            2 => Kind::ReduceScatter.name(),
            3 => Kind::AllGather.name(),
            _ => "an unknown operation",
        }
    }

    fn tag(self, bytes: usize) -> u64 {
        bytes as u64 | (self as u64) << Kind::SHIFT
    }
}

/// Whether the latency slots can carry an operation that publishes `bytes`
/// per rank on `c` (the all-reduce or reduce-scatter input, the all-gather block).
pub(crate) fn usable(c: &Resources, bytes: usize) -> bool {
    let n = c.ctx.nranks;
    bytes <= LL_SLOT_BYTES
        && n >= 2
        && c.fault.own.has_ll()
        && (0..n).all(|p| matches!(c.kinds[p], PeerKind::Me | PeerKind::Shm))
}

/// Records a collective that may run through the latency slots (all-reduce,
/// reduce-scatter, all-gather: `kind` says which, `AllReduce` for every
/// all-reduce) of `bytes` per rank, whatever its algorithm, where local peers
/// waiting in the slots can see it (see [`Mapping::ll_call`]).
pub(crate) fn note_call(c: &Resources, kind: Kind, bytes: usize) {
    let own = &c.fault.own;
    if own.has_ll() {
        let (seq, len) = own.ll_call();
        len.store(kind.tag(bytes), Ordering::Relaxed);
        seq.store(seq.load(Ordering::Relaxed) + 1, Ordering::Release);
    }
}

/// How long an idle wait spins (one core per rank) before it yields, then
/// sleeps on the doorbell: a running peer answers within microseconds, so a
/// longer wait means it lost its core (a loaded machine), and spinning on
/// would keep it off (measured: 2 ms of spinning cost 2 ms per call with 2
/// ranks on a loaded 2-core machine). With more ranks than cores it yields
/// at once. It yields as many times as the engine does (`WEFT_YIELD_ITERS`:
/// 8, or 32 with more ranks than cores), then sleeps: a sleeping rank hands
/// its core to a peer far more surely than a yielding one.
/// Adaptive: after two waits in a row that the spin did not end (the peers
/// share our core: a loaded machine, or the scheduler packed them), spin only
/// `SPIN_SHORT` until a spin ends a wait again.
const SPIN_FOR: Duration = Duration::from_micros(50);
const SPIN_SHORT: Duration = Duration::from_micros(2);
static SPIN_MISSES: AtomicU32 = AtomicU32::new(0);
const SLICE: Duration = Duration::from_millis(100);
const SLEEP: Duration = Duration::from_millis(10);

/// One rank's all-reduce through the latency slots (the caller checked
/// [`usable`]). `two_shot` picks reduce-scatter + all-gather.
pub(crate) fn all_reduce(c: &mut Resources, o: &Op, two_shot: bool) -> Result<()> {
    all_reduce_inner(c, o, two_shot).map_err(|e| c.fail(e))
}

/// Every rank's segment, by rank (ours for ourselves), without borrowing
/// `c`: the waits below need it mutably (pending eager sends), and the
/// mappings live, unchanged, as long as `c`.
#[derive(Clone, Copy)]
struct Maps {
    peers: *const Option<std::sync::Arc<Mapping>>,
    own: *const Mapping,
    me: usize,
    n: usize,
}

impl Maps {
    fn of(c: &Resources) -> Maps {
        Maps {
            peers: c.local_maps.as_ptr(),
            own: std::sync::Arc::as_ptr(&c.fault.own),
            me: c.ctx.rank,
            n: c.ctx.nranks,
        }
    }

    #[inline]
    fn get<'a>(self, p: usize) -> &'a Mapping {
        assert!(p < self.n);
        // SAFETY: see the type; `usable` checked every peer is local.
        unsafe {
            match &*self.peers.add(p) {
                Some(m) if p != self.me => m,
                _ => &*self.own,
            }
        }
    }
}

fn all_reduce_inner(c: &mut Resources, o: &Op, two_shot: bool) -> Result<()> {
    c.check_raised()?;
    let (send, recv, count, dt, op) = (o.send, o.recv, o.count, o.dtype, super::redop(o)?);
    let (n, r, es) = (c.ctx.nranks, c.ctx.rank, dt.size());
    let bytes = count * es;
    debug_assert!(usable(c, bytes));
    let comb = op.combine();
    let kind = if two_shot {
        Kind::AllReduce2
    } else {
        Kind::AllReduce
    };
    let mut st = Start::new(c, kind);
    let Start { maps, e, b, .. } = st;
    let map = |p: usize| maps.get(p);
    let own = map(r);

    // Publish our input.
    let (hdr, mine) = own.ll_slot(b, false);
    unsafe { fill_slot(mine, send, count, dt, op) };
    let tag = kind.tag(bytes);
    publish(maps, hdr, e, tag);

    if !two_shot {
        // Reduce the n inputs in rank order straight into `recv`.
        return reduce_slots_in_rank_order(c, &mut st, o, bytes, 0);
    }
    let w = &mut st.w;

    // Two shots. Reduce-scatter: our chunk of every input into our output slot.
    let lo = |p: usize| super::bound(p, count, n);
    let (mlo, mlen) = (lo(r), lo(r + 1) - lo(r));
    let (ohdr, out) = own.ll_slot(b, true);
    let acc = unsafe { out.add(mlo * es) };
    for p in 0..n {
        let (h, d) = map(p).ll_slot(b, false);
        w.wait(c, maps, h, e, bytes, p)?;
        if mlen == 0 {
            continue;
        }
        let d = unsafe { d.add(mlo * es) };
        match p {
            0 => {}
            1 => unsafe {
                let (_, d0) = map(0).ll_slot(b, false);
                reduce::combine(dt, comb, acc, d0.add(mlo * es), d, mlen)
            },
            _ => unsafe { reduce::combine(dt, comb, acc, acc, d, mlen) },
        }
    }
    if op == ReduceOp::Avg && mlen > 0 {
        unsafe { reduce::divide(dt, acc, mlen, n) };
    }
    publish(maps, ohdr, e, tag);
    // All-gather: chunk p from rank p's output slot, ours last.
    for k in 1..=n {
        let p = (r + k) % n;
        let (h, d) = map(p).ll_slot(b, true);
        w.wait(c, maps, h, e, bytes, p)?;
        let (plo, plen) = (lo(p), lo(p + 1) - lo(p));
        unsafe { std::ptr::copy_nonoverlapping(d.add(plo * es), recv.add(plo * es), plen * es) };
    }
    Ok(())
}

/// One rank's reduce-scatter through the latency slots (the caller checked
/// [`usable`] for the n blocks): `send` holds n blocks of `count` elements,
/// `recv` gets the reduction of block r (it may be block r of `send`).
pub(crate) fn reduce_scatter(c: &mut Resources, o: &Op) -> Result<()> {
    reduce_scatter_inner(c, o).map_err(|e| c.fail(e))
}

/// The next epoch of our latency slots and its buffer (0 or 1).
fn next_epoch(own: &Mapping) -> (u64, usize) {
    let ep = own.ll_epoch();
    let e = ep.load(Ordering::Relaxed) + 1;
    ep.store(e, Ordering::Relaxed);
    (e, (e & 1) as usize)
}

/// What every operation through the slots starts with: the mappings (they
/// live as long as `c`, which drops them; raw pointers let the waits borrow
/// `c` mutably for eager sends), this operation's epoch `e` and slot buffer
/// `b` (even or odd), and its waiter.
struct Start {
    maps: Maps,
    e: u64,
    b: usize,
    w: Waiter,
}

impl Start {
    fn new(c: &Resources, kind: Kind) -> Start {
        let maps = Maps::of(c);
        let (e, b) = next_epoch(maps.get(c.ctx.rank));
        Start {
            maps,
            e,
            b,
            w: Waiter::new(c, kind),
        }
    }
}

/// Copies `count` elements of `send` into a slot, scaled by the rank's
/// factor for PreMulSum.
unsafe fn fill_slot(mine: *mut u8, send: *const u8, count: usize, dt: DataType, op: ReduceOp) {
    match op {
        ReduceOp::PreMulSum(s) => unsafe { reduce::scale(dt, mine, send, count, s) },
        _ => unsafe { std::ptr::copy_nonoverlapping(send, mine, count * dt.size()) },
    }
}

/// Waits for each rank's input slot of the operation `st` started
/// (`published` bytes) in turn and reduces `o.count` elements at `offset` of
/// them into `o.recv` in rank order, so every rank computes bit-identical
/// results; divides for Avg.
fn reduce_slots_in_rank_order(
    c: &mut Resources,
    st: &mut Start,
    o: &Op,
    published: usize,
    offset: usize,
) -> Result<()> {
    let (recv, count, dt, op) = (o.recv, o.count, o.dtype, super::redop(o)?);
    let Start { maps, e, b, .. } = *st;
    let w = &mut st.w;
    let n = c.ctx.nranks;
    let comb = op.combine();
    let input = |p: usize| {
        let (h, d) = maps.get(p).ll_slot(b, false);
        (h, unsafe { d.add(offset) })
    };
    w.wait(c, maps, input(0).0, e, published, 0)?;
    for p in 1..n {
        w.wait(c, maps, input(p).0, e, published, p)?;
        let a = if p == 1 { input(0).1 } else { recv };
        unsafe { reduce::combine(dt, comb, recv, a, input(p).1, count) };
    }
    if op == ReduceOp::Avg {
        unsafe { reduce::divide(dt, recv, count, n) };
    }
    Ok(())
}

fn reduce_scatter_inner(c: &mut Resources, o: &Op) -> Result<()> {
    c.check_raised()?;
    let (send, count, dt, op) = (o.send, o.count, o.dtype, super::redop(o)?);
    let (n, r, es) = (c.ctx.nranks, c.ctx.rank, dt.size());
    let (bytes, total) = (count * es, count * es * n);
    debug_assert!(usable(c, total));
    let kind = Kind::ReduceScatter;
    let mut st = Start::new(c, kind);
    let Start { maps, e, b, .. } = st;

    // Publish our n blocks (in place, `recv` is one of them: it is read here,
    // before it is written below).
    let (hdr, mine) = maps.get(r).ll_slot(b, false);
    unsafe { fill_slot(mine, send, count * n, dt, op) };
    publish(maps, hdr, e, kind.tag(total));

    // Block r of the n inputs, in rank order, straight into `recv`.
    reduce_slots_in_rank_order(c, &mut st, o, total, r * bytes)
}

/// One rank's all-gather through the latency slots (the caller checked
/// [`usable`] for one block of `bytes`): block p of `recv` comes from rank
/// p, ours from `send` (which may be block r of `recv`).
pub(crate) fn all_gather(c: &mut Resources, o: &Op) -> Result<()> {
    all_gather_inner(c, o).map_err(|e| c.fail(e))
}

fn all_gather_inner(c: &mut Resources, o: &Op) -> Result<()> {
    c.check_raised()?;
    let (send, recv, bytes) = (o.send, o.recv, o.bytes());
    let (n, r) = (c.ctx.nranks, c.ctx.rank);
    debug_assert!(usable(c, bytes));
    let kind = Kind::AllGather;
    let Start { maps, e, b, mut w } = Start::new(c, kind);
    let map = |p: usize| maps.get(p);
    let own = map(r);

    let (hdr, mine) = own.ll_slot(b, false);
    unsafe { std::ptr::copy_nonoverlapping(send, mine, bytes) };
    publish(maps, hdr, e, kind.tag(bytes));
    // Our own block while the peers copy theirs in (nothing in place).
    super::copy(unsafe { recv.add(r * bytes) }, send, bytes);
    // Then block p from rank p's slot, starting after us (the peers publish
    // in no particular order; starting at r+1 spreads the readers).
    for k in 1..n {
        let p = (r + k) % n;
        let (h, d) = map(p).ll_slot(b, false);
        w.wait(c, maps, h, e, bytes, p)?;
        unsafe { std::ptr::copy_nonoverlapping(d, recv.add(p * bytes), bytes) };
    }
    Ok(())
}

/// Publishes a slot of ours for epoch `e`, then wakes the peers that sleep.
/// `tag` is the length and the [`Kind`].
fn publish(maps: Maps, hdr: &SlotHdr, e: u64, tag: u64) {
    hdr.len.store(tag, Ordering::Relaxed);
    hdr.epoch.store(e, Ordering::Release);
    // Pairs with the sleeper's fence: either it sees the epoch or we see it
    // counted among the sleepers.
    fence(Ordering::SeqCst);
    for p in (0..maps.n).filter(|&p| p != maps.me) {
        let ctl = maps.get(p).control();
        if ctl.sleepers.load(Ordering::Relaxed) != 0 {
            ctl.ring();
        }
    }
}

/// The waiting state of one operation.
struct Waiter {
    oversubscribed: bool,
    yields: u32,
    timeout: Option<Duration>,
    kind: Kind,
}

impl Waiter {
    fn new(c: &Resources, kind: Kind) -> Waiter {
        Waiter {
            oversubscribed: c.oversubscribed,
            yields: c.wait_budget().1,
            timeout: c.ctx.cfg.timeout,
            kind,
        }
    }

    /// Waits until rank `peer`'s slot `h` holds epoch `e`, with `bytes` bytes.
    fn wait(
        &mut self,
        c: &mut Resources,
        maps: Maps,
        h: &SlotHdr,
        e: u64,
        bytes: usize,
        peer: usize,
    ) -> Result<()> {
        if self.ready(h, e, bytes, peer, c)? {
            return Ok(());
        }
        let start = Instant::now();
        let mut last_check = start;
        let mut i: u32 = 0;
        // The iteration at which spinning ended (None while spinning).
        let mut spun: Option<u32> = None;
        let spin_for = if SPIN_MISSES.load(Ordering::Relaxed) >= 2 {
            SPIN_SHORT
        } else {
            SPIN_FOR
        };
        loop {
            i = i.saturating_add(1);
            if self.ready(h, e, bytes, peer, c)? {
                if spun.is_none() && !self.oversubscribed {
                    SPIN_MISSES.store(0, Ordering::Relaxed);
                }
                return Ok(());
            }
            if i.is_multiple_of(64) {
                c.check_raised()?;
                if !c.eager.pending.is_empty() {
                    c.exec_with(&mut [], Wait::NoSleep { until: None })?;
                }
            }
            if !self.oversubscribed && spun.is_none() {
                if start.elapsed() < spin_for {
                    std::hint::spin_loop();
                    continue;
                }
                spun = Some(i);
                SPIN_MISSES.fetch_add(1, Ordering::Relaxed);
            }
            if i - spun.unwrap_or(0) <= self.yields {
                std::thread::yield_now();
                continue;
            }
            // A long wait: sleep on our doorbell until a publisher rings it.
            let ctrl = c.fault.own.control();
            let seen = ctrl.doorbell.load(Ordering::SeqCst);
            ctrl.sleepers.fetch_add(1, Ordering::SeqCst);
            fence(Ordering::SeqCst);
            if h.epoch.load(Ordering::Acquire) != e {
                futex::wait(&ctrl.doorbell, seen, SLEEP);
            }
            ctrl.sleepers.fetch_sub(1, Ordering::SeqCst);
            // An abort rings the doorbell: notice it at once.
            c.check_raised()?;
            if last_check.elapsed() >= SLICE {
                last_check = Instant::now();
                if self.ready(h, e, bytes, peer, c)? {
                    return Ok(());
                }
                c.check_peers(std::iter::once(peer))?;
                // The peer in this same collective with another size took
                // another algorithm: it will never publish.
                let (mseq, mlen) = c.fault.own.ll_call();
                let (pseq, plen) = maps.get(peer).ll_call();
                let ps = pseq.load(Ordering::Acquire);
                let pl = plen.load(Ordering::Relaxed);
                let ml = mlen.load(Ordering::Relaxed);
                if ps == mseq.load(Ordering::Relaxed)
                    && pl != ml
                    && pseq.load(Ordering::Acquire) == ps
                {
                    let size = |t: u64| t & ((1 << Kind::SHIFT) - 1);
                    return Err(c.peer_error(
                        peer,
                        &format!(
                            "the peer runs {} of {} bytes where this rank runs {} of {}: count, data type or collective differs between ranks",
                            Kind::of_tag(pl),
                            size(pl),
                            Kind::of_tag(ml),
                            size(ml)
                        ),
                    ));
                }
                if let Some(t) = self.timeout
                    && start.elapsed() >= t
                {
                    return Err(Error::Timeout {
                        comm: c.ctx.label.clone(),
                        rank: c.ctx.rank,
                        after_ms: t.as_millis() as u64,
                        waiting_for: format!(
                            "rank {peer} ({} through the latency slots)",
                            self.kind.name()
                        ),
                    });
                }
            }
        }
    }

    #[inline]
    fn ready(&self, h: &SlotHdr, e: u64, bytes: usize, peer: usize, c: &Resources) -> Result<bool> {
        let got = h.epoch.load(Ordering::Acquire);
        if got == e {
            let tag = h.len.load(Ordering::Relaxed);
            let len = (tag & ((1 << Kind::SHIFT) - 1)) as usize;
            if tag >> Kind::SHIFT != self.kind as u64 {
                return Err(c.peer_error(
                    peer,
                    &format!(
                        "the peer ran {} through the latency slots where this rank ran {}: set WEFT_ALGO alike on every rank, and issue the same collectives in the same order",
                        Kind::of_tag(tag),
                        self.kind.name()
                    ),
                ));
            }
            if len != bytes {
                return Err(c.peer_error(
                    peer,
                    &format!(
                        "the peer published {len} bytes where this rank expected {bytes}: count or data type differs between ranks"
                    ),
                ));
            }
            return Ok(true);
        }
        if got > e {
            return Err(c.peer_error(
                peer,
                "the peer is ahead in the latency path: the ranks issued different sequences of operations",
            ));
        }
        Ok(false)
    }
}
