//! Collective algorithms on host memory, written as sequences of
//! point-to-point steps run by the progress engine (`progress/exec.rs`).
//!
//! Each collective takes its operation descriptor ([`Op`]: buffers, count,
//! type, reduction, root) and the tuner's algorithm for it, decided once by
//! the caller ([`run`] takes the whole [`Decision`]). Conventions inside:
//! buffers are raw pointers (they may alias for in-place operations: `send ==
//! recv`, or the send block inside the receive buffer); sizes are in
//! elements of `dt` unless named `bytes`. Every rank computes the same chunk
//! boundaries, so no sizes are exchanged; the transports' message headers
//! still check them, turning a mismatch between ranks into an error.

mod ll;

use crate::data::reduce;
use crate::data::types::{Combine, DataType, ReduceOp};
use crate::error::{Error, Result};
use crate::op::tuner::{self, Algo, Decision};
use crate::op::{Op, OpKind};
use crate::progress::resources::Resources;
use crate::progress::xfer::Xfer;
use crate::transport::Reduce;
use crate::transport::shm::LL_SLOT_BYTES;

/// Runs a validated host-memory operation on the live resources, with the
/// tuner's decision for it.
pub(crate) fn run(c: &mut Resources, op: &Op, d: Decision) -> Result<()> {
    c.coll_seq += 1;
    let a = d.algo();
    match op.kind {
        OpKind::AllReduce => all_reduce(c, op, a),
        OpKind::Broadcast => broadcast(c, op, a),
        OpKind::Reduce => reduce(c, op, a),
        OpKind::AllGather => all_gather(c, op, a),
        OpKind::ReduceScatter => reduce_scatter(c, op, a),
        OpKind::AllToAll => all_to_all(c, op, a),
        OpKind::Gather => gather(c, op),
        OpKind::Scatter => scatter(c, op),
        OpKind::Send => c.exec(&mut [Xfer::send(op.root, op.send, op.bytes())]),
        OpKind::Recv => c.exec(&mut [Xfer::recv(op.root, op.recv, op.bytes())]),
    }
}

/// Balanced split of `count` elements into `n` chunks: chunk `c` is
/// `[bound(c), bound(c+1))`.
#[inline]
fn bound(c: usize, count: usize, n: usize) -> usize {
    ((c as u128 * count as u128) / n as u128) as usize
}

fn red(dt: DataType, op: Combine, other: *const u8) -> Reduce {
    Reduce {
        dtype: dt,
        op,
        other,
    }
}

/// The input a reduction really combines: pre-multiplied by the rank's scalar
/// for `PreMulSum` (into `hold`), the user's buffer otherwise.
fn prepared_input(
    op: ReduceOp,
    dt: DataType,
    src: *const u8,
    count: usize,
    hold: &mut Vec<u8>,
) -> *const u8 {
    match op {
        ReduceOp::PreMulSum(s) => {
            hold.resize(count * dt.size(), 0);
            unsafe { reduce::scale(dt, hold.as_mut_ptr(), src, count, s) };
            hold.as_ptr()
        }
        _ => src,
    }
}

/// Final scaling of an average.
fn finish_avg(op: ReduceOp, dt: DataType, buf: *mut u8, count: usize, n: usize) {
    if op == ReduceOp::Avg && count > 0 {
        unsafe { reduce::divide(dt, buf, count, n) };
    }
}

/// The reduction of a reducing operation (a validated one carries it).
fn redop(o: &Op) -> Result<ReduceOp> {
    o.redop
        .ok_or_else(|| Error::Internal(format!("{} without a reduction operator", o.name())))
}

/// A ring's view of a buffer of `count` elements of `dt`: n chunks cut by
/// [`bound`], rank r starting with chunk `(r + k) mod n`.
#[derive(Clone, Copy)]
struct Chunks {
    count: usize,
    dt: DataType,
    k: usize,
}

/// This rank's place on a ring over [`Chunks`]: its neighbours, and where
/// each chunk lies in the buffer, in bytes.
struct RingPlace {
    n: usize,
    r: usize,
    right: usize,
    left: usize,
    count: usize,
    es: usize,
}

impl RingPlace {
    fn new(c: &Resources, ring: Chunks) -> RingPlace {
        let (n, r) = (c.ctx.nranks, c.ctx.rank);
        RingPlace {
            n,
            r,
            right: (r + 1) % n,
            left: (r + n - 1) % n,
            count: ring.count,
            es: ring.dt.size(),
        }
    }

    /// Byte offset of chunk `ch`.
    fn at(&self, ch: usize) -> usize {
        bound(ch, self.count, self.n) * self.es
    }

    /// Bytes of chunk `ch`.
    fn len(&self, ch: usize) -> usize {
        (bound(ch + 1, self.count, self.n) - bound(ch, self.count, self.n)) * self.es
    }
}

fn copy(dst: *mut u8, src: *const u8, bytes: usize) {
    if bytes > 0 && !std::ptr::eq(dst, src) {
        unsafe { std::ptr::copy(src, dst, bytes) };
    }
}

/// `send`/`recv` hold `count` elements (they may be equal: in place).
pub(crate) fn all_reduce(c: &mut Resources, o: &Op, algo: Algo) -> Result<()> {
    let (send, recv, count, dt, op) = (o.send, o.recv, o.count, o.dtype, redop(o)?);
    let n = c.ctx.nranks;
    ll::note_call(c, ll::Kind::AllReduce, count * dt.size());
    if matches!(algo, Algo::Ll | Algo::Ll2) && ll::usable(c, count * dt.size()) {
        return ll::all_reduce(c, o, algo == Algo::Ll2);
    }
    let mut hold = Vec::new();
    let src = prepared_input(op, dt, send, count, &mut hold);
    if n == 1 {
        copy(recv, src, count * dt.size());
        finish_avg(op, dt, recv, count, n);
        return Ok(());
    }
    // The descriptor with its input prepared, for the algorithms below.
    let prepared = Op { send: src, ..*o };
    match algo {
        Algo::RecursiveDoubling => all_reduce_rd(c, &prepared, op),
        Algo::Direct | Algo::Ll => all_reduce_direct(c, &prepared, op),
        _ if op == ReduceOp::Avg => {
            // The owned chunk is divided between the two halves.
            let ring = Chunks { count, dt, k: 1 };
            let owned = ring_reduce_scatter(c, src, recv, ring, op.combine())?;
            let (lo, hi) = (bound(owned, count, n), bound(owned + 1, count, n));
            finish_avg(op, dt, unsafe { recv.add(lo * dt.size()) }, hi - lo, n);
            ring_all_gather_chunks(c, recv, ring)
        }
        _ => {
            // Both halves in one batch: the all-gather forwards this rank's
            // chunk as its last reduce-scatter receive completes it. In
            // place, an all-gather receive writes chunk (r+k-1) after the
            // reduce-scatter's first send read it: its bytes come back round
            // the ring only after that send put them on their way.
            let ring = Chunks { count, dt, k: 1 };
            let mut xs = Vec::with_capacity(4 * (n - 1));
            ring_reduce_scatter_steps(c, &mut xs, src, recv, ring, op.combine());
            let last = xs.len() - 1;
            ring_all_gather_steps(c, &mut xs, recv, ring, Some(last));
            c.exec(&mut xs)
        }
    }
}

impl Resources {
    /// What the tuner knows of this communicator.
    pub(crate) fn shape(&self) -> tuner::Shape {
        let nlocal = self
            .kinds
            .iter()
            .filter(|k| {
                matches!(
                    k,
                    crate::progress::resources::PeerKind::Me
                        | crate::progress::resources::PeerKind::Shm
                )
            })
            .count();
        tuner::Shape::local(self.ctx.nranks, nlocal).with_slots(LL_SLOT_BYTES)
    }
}

/// One step: every rank sends its buffer to every other rank, then combines
/// all n buffers in rank order (so every rank computes bit-identical results).
/// One round of wake-ups instead of log2(n): the latency path for tiny buffers.
/// `o`'s input is prepared (see [`prepared_input`]); `op` is its reduction.
fn all_reduce_direct(c: &mut Resources, o: &Op, op: ReduceOp) -> Result<()> {
    let (src, recv, count, dt) = (o.send, o.recv, o.count, o.dtype);
    let (n, r, es) = (c.ctx.nranks, c.ctx.rank, dt.size());
    let bytes = count * es;
    let tmp = c.scratch(bytes * n);
    let mut xs = Vec::with_capacity(2 * (n - 1));
    for p in (0..n).filter(|&p| p != r) {
        xs.push(Xfer::send(p, src, bytes));
        xs.push(Xfer::recv(p, unsafe { tmp.add(p * bytes) }, bytes));
    }
    c.exec(&mut xs)?;
    let tmp = c.scratch(bytes * n);
    // Our own block joins the others before `recv` (which may alias `src`) is written.
    copy(unsafe { tmp.add(r * bytes) }, src, bytes);
    copy(recv, tmp, bytes);
    for p in 1..n {
        unsafe { reduce::combine(dt, op.combine(), recv, recv, tmp.add(p * bytes), count) };
    }
    finish_avg(op, dt, recv, count, n);
    Ok(())
}

/// Ring reduce-scatter over `work` (which must be writable for the whole
/// buffer): after n-1 steps rank r holds the full reduction of chunk
/// `(r + k) mod n` in `work`. Returns that chunk's index.
///
/// All steps are one batch: the send of step s+1 forwards the chunk that
/// step s's receive reduced, gated on the bytes reduced so far, so a slice
/// moves on while it is still in cache and no rank waits at a step
/// boundary for the slowest. Safe in place (`src == work`): the receives
/// write n-1 distinct chunks, none of which a send still has to read (a
/// send reads chunk (k+r-1) from `src`, never received, or the previous
/// receive's chunk, only as far as that receive got).
fn ring_reduce_scatter(
    c: &mut Resources,
    src: *const u8,
    work: *mut u8,
    ring: Chunks,
    op: Combine,
) -> Result<usize> {
    let mut xs = Vec::with_capacity(2 * (c.ctx.nranks - 1));
    let owned = ring_reduce_scatter_steps(c, &mut xs, src, work, ring, op);
    c.exec(&mut xs)?;
    Ok(owned)
}

/// The transfers of [`ring_reduce_scatter`], appended to `xs`; returns the
/// chunk this rank ends up owning (its last receive, the last of `xs`).
fn ring_reduce_scatter_steps(
    c: &Resources,
    xs: &mut Vec<Xfer>,
    src: *const u8,
    work: *mut u8,
    ring: Chunks,
    op: Combine,
) -> usize {
    let p = RingPlace::new(c, ring);
    let (n, r, k) = (p.n, p.r, ring.k);
    for s in 0..n - 1 {
        let sc = (k + r + 2 * n - 1 - s) % n;
        let rc = (k + r + 2 * n - 2 - s) % n;
        let send = if s == 0 {
            Xfer::send(p.right, unsafe { src.add(p.at(sc)) }, p.len(sc))
        } else {
            // The previous receive (just pushed) reduced this chunk.
            let gate = xs.len() - 1;
            Xfer::send(
                p.right,
                unsafe { work.add(p.at(sc)) as *const u8 },
                p.len(sc),
            )
            .gated(gate)
        };
        xs.push(send);
        let other = unsafe { src.add(p.at(rc)) };
        xs.push(Xfer::recv_reduce(
            p.left,
            unsafe { work.add(p.at(rc)) },
            p.len(rc),
            red(ring.dt, op, other),
        ));
    }
    (k + r) % n
}

/// Ring all-gather of the chunks of a `count`-element buffer where rank r
/// starts with chunk `(r + k) mod n` in place. One batch, each forward
/// gated on the receive before it (as in [`ring_reduce_scatter`]).
fn ring_all_gather_chunks(c: &mut Resources, buf: *mut u8, ring: Chunks) -> Result<()> {
    let mut xs = Vec::with_capacity(2 * (c.ctx.nranks - 1));
    ring_all_gather_steps(c, &mut xs, buf, ring, None);
    c.exec(&mut xs)
}

/// The transfers of [`ring_all_gather_chunks`], appended to `xs`; the first
/// send is gated on `xs[first_gate]` when given (the receive that completes
/// this rank's chunk, in a batch that reduce-scatters first).
fn ring_all_gather_steps(
    c: &Resources,
    xs: &mut Vec<Xfer>,
    buf: *mut u8,
    ring: Chunks,
    first_gate: Option<usize>,
) {
    let p = RingPlace::new(c, ring);
    let (n, r, k) = (p.n, p.r, ring.k);
    for s in 0..n - 1 {
        let sc = (k + r + n - s) % n;
        let rc = (k + r + 2 * n - 1 - s) % n;
        let send = Xfer::send(p.right, unsafe { buf.add(p.at(sc)) }, p.len(sc));
        let gate = if s == 0 {
            first_gate
        } else {
            Some(xs.len() - 1)
        };
        xs.push(match gate {
            Some(g) => send.gated(g),
            None => send,
        });
        xs.push(Xfer::recv(p.left, unsafe { buf.add(p.at(rc)) }, p.len(rc)));
    }
}

/// Recursive doubling, with the usual fold of the ranks beyond the largest
/// power of two into their neighbours first. Every combine is commutative, so
/// every rank ends with bit-identical results. `o`'s input is prepared
/// (see [`prepared_input`]); `op` is its reduction.
fn all_reduce_rd(c: &mut Resources, o: &Op, op: ReduceOp) -> Result<()> {
    let (src, recv, count, dt) = (o.send, o.recv, o.count, o.dtype);
    let (n, r, es) = (c.ctx.nranks, c.ctx.rank, dt.size());
    let bytes = count * es;
    let comb = op.combine();
    copy(recv, src, bytes);
    let p = 1usize << (usize::BITS - 1 - n.leading_zeros());
    let rem = n - p;
    if r < 2 * rem {
        if r % 2 == 0 {
            c.exec(&mut [Xfer::send(r + 1, recv, bytes)])?;
        } else {
            c.exec(&mut [Xfer::recv_reduce(r - 1, recv, bytes, red(dt, comb, recv))])?;
        }
    }
    let newrank = if r < 2 * rem {
        (r % 2 == 1).then_some(r / 2)
    } else {
        Some(r - rem)
    };
    if let Some(nr) = newrank {
        let tmp = c.scratch(bytes);
        let mut mask = 1;
        while mask < p {
            let pn = nr ^ mask;
            let partner = if pn < rem { pn * 2 + 1 } else { pn + rem };
            c.exec(&mut [
                Xfer::send(partner, recv, bytes),
                Xfer::recv(partner, tmp, bytes),
            ])?;
            unsafe { reduce::combine(dt, comb, recv, recv, tmp, count) };
            mask <<= 1;
        }
    }
    if r < 2 * rem {
        if r % 2 == 1 {
            c.exec(&mut [Xfer::send(r - 1, recv, bytes)])?;
        } else {
            c.exec(&mut [Xfer::recv(r + 1, recv, bytes)])?;
        }
    }
    finish_avg(op, dt, recv, count, n);
    Ok(())
}

/// The root's `send` (`count` elements) lands in every rank's `recv`.
pub(crate) fn broadcast(c: &mut Resources, o: &Op, algo: Algo) -> Result<()> {
    let (send, recv, bytes, root) = (o.send, o.recv, o.bytes(), o.root);
    let (n, r) = (c.ctx.nranks, c.ctx.rank);
    if r == root {
        copy(recv, send, bytes);
    }
    if n == 1 {
        return Ok(());
    }
    let vr = (r + n - root) % n;
    let real = |v: usize| (v + root) % n;
    match algo {
        Algo::Tree => {
            let mut mask = 1;
            while mask < n {
                if vr & mask != 0 {
                    c.exec(&mut [Xfer::recv(real(vr - mask), recv, bytes)])?;
                    break;
                }
                mask <<= 1;
            }
            let mut sends = Vec::new();
            mask >>= 1;
            while mask > 0 {
                if vr + mask < n {
                    sends.push(Xfer::send(real(vr + mask), recv, bytes));
                }
                mask >>= 1;
            }
            c.exec(&mut sends)
        }
        _ => {
            // Pipelined chain: each rank forwards what it has received so far.
            let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
            if vr == 0 {
                c.exec(&mut [Xfer::send(next, recv, bytes)])
            } else if vr == n - 1 {
                c.exec(&mut [Xfer::recv(prev, recv, bytes)])
            } else {
                c.exec(&mut [
                    Xfer::recv(prev, recv, bytes),
                    Xfer::send(next, recv, bytes).gated(0),
                ])
            }
        }
    }
}

/// The reduction of every rank's `send` (`count` elements) lands in the
/// root's `recv`.
pub(crate) fn reduce(c: &mut Resources, o: &Op, algo: Algo) -> Result<()> {
    let (send, recv, count, dt, op, root) = (o.send, o.recv, o.count, o.dtype, redop(o)?, o.root);
    let (n, r, es) = (c.ctx.nranks, c.ctx.rank, dt.size());
    let bytes = count * es;
    let mut hold = Vec::new();
    let src = prepared_input(op, dt, send, count, &mut hold);
    let comb = op.combine();
    if n == 1 {
        copy(recv, src, bytes);
        finish_avg(op, dt, recv, count, n);
        return Ok(());
    }
    // Non-roots accumulate in scratch: their receive buffer is not theirs to use.
    let mut own_scratch = Vec::new();
    match algo {
        Algo::Tree => {
            let acc = if r == root {
                recv
            } else {
                own_scratch.resize(bytes, 0);
                own_scratch.as_mut_ptr()
            };
            copy(acc, src, bytes);
            let vr = (r + n - root) % n;
            let real = |v: usize| (v + root) % n;
            let mut mask = 1;
            while mask < n {
                if vr & mask == 0 {
                    if vr | mask < n {
                        c.exec(&mut [Xfer::recv_reduce(
                            real(vr | mask),
                            acc,
                            bytes,
                            red(dt, comb, acc),
                        )])?;
                    }
                } else {
                    c.exec(&mut [Xfer::send(real(vr & !mask), acc, bytes)])?;
                    break;
                }
                mask <<= 1;
            }
        }
        _ => {
            let work = if r == root {
                recv
            } else {
                own_scratch.resize(bytes, 0);
                own_scratch.as_mut_ptr()
            };
            let owned = ring_reduce_scatter(c, src, work, Chunks { count, dt, k: 1 }, comb)?;
            let at = |ch: usize| bound(ch, count, n) * es;
            let len = |ch: usize| (bound(ch + 1, count, n) - bound(ch, count, n)) * es;
            if r == root {
                let mut xs: Vec<Xfer> = (0..n)
                    .filter(|&p| p != root)
                    .map(|p| {
                        let ch = (p + 1) % n;
                        Xfer::recv(p, unsafe { recv.add(at(ch)) }, len(ch))
                    })
                    .collect();
                c.exec(&mut xs)?;
            } else {
                c.exec(&mut [Xfer::send(root, unsafe { work.add(at(owned)) }, len(owned))])?;
            }
        }
    }
    if r == root {
        finish_avg(op, dt, recv, count, n);
    }
    Ok(())
}

/// `recv` holds n blocks of `count` elements; rank r's block comes from `send`.
pub(crate) fn all_gather(c: &mut Resources, o: &Op, algo: Algo) -> Result<()> {
    let (send, recv, bytes) = (o.send, o.recv, o.bytes());
    let (n, r) = (c.ctx.nranks, c.ctx.rank);
    ll::note_call(c, ll::Kind::AllGather, bytes);
    if algo == Algo::Ll && ll::usable(c, bytes) {
        return ll::all_gather(c, o);
    }
    copy(unsafe { recv.add(r * bytes) }, send, bytes);
    if n == 1 {
        return Ok(());
    }
    match algo {
        Algo::Direct | Algo::Ll => {
            let mut xs = Vec::with_capacity(2 * n);
            for p in (0..n).filter(|&p| p != r) {
                xs.push(Xfer::send(p, unsafe { recv.add(r * bytes) }, bytes));
                xs.push(Xfer::recv(p, unsafe { recv.add(p * bytes) }, bytes));
            }
            c.exec(&mut xs)
        }
        _ => {
            // Byte-typed chunks of exactly `bytes` each: rank r starts with chunk r.
            let ring = Chunks {
                count: bytes * n,
                dt: DataType::U8,
                k: 0,
            };
            ring_all_gather_chunks(c, recv, ring)
        }
    }
}

/// `send` holds n blocks of `count` elements; rank r receives the reduction of block r.
pub(crate) fn reduce_scatter(c: &mut Resources, o: &Op, algo: Algo) -> Result<()> {
    let (send, recv, count, dt, op) = (o.send, o.recv, o.count, o.dtype, redop(o)?);
    let (n, r, es) = (c.ctx.nranks, c.ctx.rank, dt.size());
    let bytes = count * es;
    ll::note_call(c, ll::Kind::ReduceScatter, bytes * n);
    if algo == Algo::Ll && ll::usable(c, bytes * n) {
        return ll::reduce_scatter(c, o);
    }
    let mut hold = Vec::new();
    let src = prepared_input(op, dt, send, count * n, &mut hold);
    let comb = op.combine();
    if n == 1 {
        copy(recv, src, bytes);
        finish_avg(op, dt, recv, count, n);
        return Ok(());
    }
    match algo {
        Algo::Direct | Algo::Ll => {
            // Receive every peer's block, then combine in rank order so the
            // result does not depend on arrival order.
            let tmp = c.scratch(bytes * n);
            let mut xs = Vec::with_capacity(2 * n);
            for p in (0..n).filter(|&p| p != r) {
                xs.push(Xfer::send(p, unsafe { src.add(p * bytes) }, bytes));
                xs.push(Xfer::recv(p, unsafe { tmp.add(p * bytes) }, bytes));
            }
            c.exec(&mut xs)?;
            let tmp = c.scratch(bytes * n);
            copy(
                unsafe { tmp.add(r * bytes) },
                unsafe { src.add(r * bytes) },
                bytes,
            );
            let acc = unsafe { tmp.add(r * bytes) };
            for p in (0..n).filter(|&p| p != r) {
                unsafe { reduce::combine(dt, comb, acc, acc, tmp.add(p * bytes), count) };
            }
            copy(recv, acc, bytes);
        }
        _ => {
            // Chunks of the ring are exactly the n blocks; rank r ends owning block r.
            let work = c.scratch(bytes * n);
            let ring = Chunks {
                count: count * n,
                dt,
                k: 0,
            };
            let owned = ring_reduce_scatter(c, src, work, ring, comb)?;
            debug_assert_eq!(owned, r);
            let work = c.scratch(bytes * n);
            copy(recv, unsafe { work.add(r * bytes) }, bytes);
        }
    }
    finish_avg(op, dt, recv, count, n);
    Ok(())
}

/// Block p of `send` goes to rank p; block p of `recv` comes from rank p.
pub(crate) fn all_to_all(c: &mut Resources, o: &Op, algo: Algo) -> Result<()> {
    let (send, recv, bytes) = (o.send, o.recv, o.bytes());
    let (n, r) = (c.ctx.nranks, c.ctx.rank);
    // In place, blocks would be overwritten before they are sent: send from a copy.
    let mut hold = Vec::new();
    let src = if std::ptr::eq(send, recv) && n > 1 {
        hold.extend_from_slice(unsafe { std::slice::from_raw_parts(send, bytes * n) });
        hold.as_ptr()
    } else {
        send
    };
    copy(
        unsafe { recv.add(r * bytes) },
        unsafe { src.add(r * bytes) },
        bytes,
    );
    match algo {
        Algo::Direct => {
            let mut xs = Vec::with_capacity(2 * n);
            for p in (0..n).filter(|&p| p != r) {
                xs.push(Xfer::send(p, unsafe { src.add(p * bytes) }, bytes));
                xs.push(Xfer::recv(p, unsafe { recv.add(p * bytes) }, bytes));
            }
            c.exec(&mut xs)
        }
        _ => {
            for s in 1..n {
                let (to, from) = ((r + s) % n, (r + n - s) % n);
                c.exec(&mut [
                    Xfer::send(to, unsafe { src.add(to * bytes) }, bytes),
                    Xfer::recv(from, unsafe { recv.add(from * bytes) }, bytes),
                ])?;
            }
            Ok(())
        }
    }
}

/// Root gathers n blocks of `count` elements (NCCL's ncclGather).
pub(crate) fn gather(c: &mut Resources, o: &Op) -> Result<()> {
    let (send, recv, bytes, root) = (o.send, o.recv, o.bytes(), o.root);
    let (n, r) = (c.ctx.nranks, c.ctx.rank);
    if r == root {
        copy(unsafe { recv.add(r * bytes) }, send, bytes);
        let mut xs: Vec<Xfer> = (0..n)
            .filter(|&p| p != r)
            .map(|p| Xfer::recv(p, unsafe { recv.add(p * bytes) }, bytes))
            .collect();
        c.exec(&mut xs)
    } else {
        c.exec(&mut [Xfer::send(root, send, bytes)])
    }
}

/// Root scatters n blocks of `count` elements (NCCL's ncclScatter).
pub(crate) fn scatter(c: &mut Resources, o: &Op) -> Result<()> {
    let (send, recv, bytes, root) = (o.send, o.recv, o.bytes(), o.root);
    let (n, r) = (c.ctx.nranks, c.ctx.rank);
    if r == root {
        let mut xs: Vec<Xfer> = (0..n)
            .filter(|&p| p != r)
            .map(|p| Xfer::send(p, unsafe { send.add(p * bytes) }, bytes))
            .collect();
        c.exec(&mut xs)?;
        copy(recv, unsafe { send.add(r * bytes) }, bytes);
        Ok(())
    } else {
        c.exec(&mut [Xfer::recv(root, recv, bytes)])
    }
}
