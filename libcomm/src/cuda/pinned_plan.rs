//! What a device job across hosts copies into its pinned buffers and out
//! again, and what its progress thread runs there (`proxy.rs` enqueues it).
//!
//! Two rules keep the copies few and let them overlap the network:
//!
//! - **In place on one pinned copy.** A single collective of device memory
//!   is staged as its in-place form (NCCL's layouts: an all-gather's input at
//!   `recv + rank * count`, a reduce-scatter's output at `send + rank *
//!   count`): one pinned region of the output's size (the input's for a
//!   reduce-scatter), the input copied into its place, the host algorithm
//!   run in place, the result copied out. An out-of-place all-reduce of N
//!   bytes then holds N pinned bytes, not 2N, and its reducing receives read
//!   and write one buffer. A broadcast root's own copy is a device-to-device
//!   copy on the stream (the GPU's, not a host `memcpy` beside the network),
//!   and nothing comes back to the root; a reduce's other ranks copy nothing
//!   back either.
//! - **Slices.** An all-reduce, broadcast or reduce of at least twice
//!   `WEFT_CROSSHOST_SLICE_BYTES` (an all-gather or reduce-scatter whose
//!   whole data is: the same slice of every rank's block in one job, see
//!   [`gathered_slice`]) is cut into up to [`MAX_SLICES`] slices,
//!   each its own job (its own buffer and words): the stream copies every
//!   slice in before it waits for the first, so slice k+1's copy in and
//!   slice k-1's copy out run while slice k is on the network. Every rank
//!   cuts alike (the count and the setting are the same on every rank).
//!
//! - **Sends and receives.** A group of sends and receives of device memory
//!   stages each piece in its own pinned region (a receive in place over its
//!   own send, as nccl-tests' in-place send/recv, must not share one), cut
//!   alike into slices: each op of at least twice `WEFT_CROSSHOST_SLICE_BYTES`
//!   into up to [`MAX_SLICES`] pieces, job k holding every op's piece k.
//!   Both ends of a message cut it alike (the same bytes, the same
//!   setting), so job k of every rank holds matching pieces. A single
//!   all-to-all becomes such a group (a send and a receive per other rank)
//!   plus its own block, copied on the GPU: nothing of it goes through host
//!   memory, and the host part moves only what crosses to other ranks.
//!
//! - **Exchanges.** On at most `MAX_RANKS` ranks a reduce-scatter (reduced
//!   on the GPU, [`reduce_scatter_on_gpu`]) and an all-gather
//!   ([`all_gather_exchanged`]), whole or per slice, and an all-reduce from
//!   2 MiB ([`all_reduce_on_gpu`]; on two ranks below 2 MiB as one
//!   exchange of the whole buffer, [`all_reduce_of_two`]) are staged as a send and a receive of a
//!   part per other rank, each part in its own pinned region: only what
//!   crosses to other ranks is copied, and parts of 256 KiB and more go
//!   on the cross-host engine's striped connections.
//!
//! Everything else (other groups, gather, scatter, host buffers in a device
//! call) is staged as before: every device region the job touches, read
//! ones copied in, written ones copied out, the operations unchanged.

use super::abi::MAX_RANKS;
use super::pinned::ALIGN;
use super::staging::{DevRegion, host_op};
use crate::data::types::{DataType, ReduceOp};
use crate::op::{Op, OpKind};

/// The most slices one collective is cut into (each is a job: a few stream
/// operations on the calling thread, a pinned buffer, a wake-up of the
/// progress thread).
pub(super) const MAX_SLICES: usize = 8;

/// Slice boundaries fall on this many bytes (a multiple of every element
/// size, and page-aligned copies run at full speed).
pub(super) const SLICE_ALIGN: usize = 4096;

/// A copy between device memory at `dev` and the job's pinned buffer at
/// offset `off`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Copy {
    pub dev: u64,
    pub off: usize,
    pub bytes: usize,
}

/// One job as staged: run `dtod`, copy `to_host` in, signal, run `ops` on
/// the pinned buffer (pointers moved through `map`), copy `to_device` out.
#[derive(Debug, Clone)]
pub(super) struct Staged {
    /// Bytes of pinned buffer the job needs.
    pub bytes: usize,
    /// `(dst, src, bytes)` device-to-device copies on the stream first.
    pub dtod: Vec<(u64, u64, usize)>,
    pub to_host: Vec<Copy>,
    pub to_device: Vec<Copy>,
    /// `(device address, bytes, offset)`: a pointer of `ops` inside the
    /// device range lives at that offset of the pinned buffer.
    pub map: Vec<(u64, usize, usize)>,
    /// The operations, still with device pointers (and host ones).
    pub ops: Vec<Op>,
    /// `map[i]` is op i's own region, and only op i's (sends and receives,
    /// whose regions may overlap in the device's address space).
    pub per_op: bool,
    /// The stream copies this job in only after the previous job's copy
    /// out (it reads what that one wrote: an all-reduce's gathered half,
    /// [`all_reduce_on_gpu`]); such a call's jobs are enqueued one after
    /// the other, copies in, wait, copies out.
    pub after_previous: bool,
    /// After `done`, besides `to_device`: a reduction the GPU runs from
    /// device memory and the pinned buffer into device memory (a
    /// reduce-scatter's received blocks, see [`reduce_scatter_on_gpu`]).
    pub reduce_out: Option<ReduceOut>,
}

/// `dst = op(own, pinned[from[0]], pinned[from[1]], ...)`: what a job's
/// copy out reduces on the GPU.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct ReduceOut {
    pub dst: u64,
    /// This rank's own contribution, in device memory.
    pub own: u64,
    pub received: Received,
}

/// The other ranks' contributions a job received into its pinned buffer
/// and how they combine with this rank's: `count` elements of `dtype` at
/// each offset of `from`, reduced with `op`.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Received {
    pub from: Vec<usize>,
    pub count: usize,
    pub dtype: DataType,
    pub op: ReduceOp,
}

impl Staged {
    fn new(ops: Vec<Op>) -> Staged {
        Staged {
            bytes: 0,
            dtod: Vec::new(),
            to_host: Vec::new(),
            to_device: Vec::new(),
            map: Vec::new(),
            ops,
            per_op: false,
            after_previous: false,
            reduce_out: None,
        }
    }

    /// `map` with the pinned buffer at `base`: what `staging::host_op` takes.
    fn host_map(&self, base: u64) -> Vec<(u64, usize, u64)> {
        self.map
            .iter()
            .map(|&(d, n, off)| (d, n, base + off as u64))
            .collect()
    }

    /// The operations as the progress thread runs them, on the pinned
    /// buffer at host address `base`.
    pub fn host_ops(&self, base: u64) -> Vec<Op> {
        let map = self.host_map(base);
        if self.per_op {
            return self
                .ops
                .iter()
                .zip(&map)
                .map(|(o, m)| host_op(o, std::slice::from_ref(m)))
                .collect();
        }
        self.ops.iter().map(|o| host_op(o, &map)).collect()
    }
}

/// How many slices a collective of `bytes` is cut into with smallest slice
/// `slice_bytes` (0: never cut).
pub(super) fn slice_count(bytes: usize, slice_bytes: usize) -> usize {
    if slice_bytes == 0 {
        return 1;
    }
    (bytes / slice_bytes).clamp(1, MAX_SLICES)
}

/// `(byte offset, bytes)` of each slice of `bytes` cut into `k` parts on
/// [`SLICE_ALIGN`] boundaries (fewer when the parts round up past the end).
pub(super) fn slices(bytes: usize, k: usize) -> Vec<(usize, usize)> {
    let per = bytes
        .div_ceil(k)
        .next_multiple_of(SLICE_ALIGN)
        .max(SLICE_ALIGN);
    (0..bytes)
        .step_by(per)
        .map(|o| (o, per.min(bytes - o)))
        .collect()
}

/// Whether the in-place staging applies to `op` (its kind; every buffer it
/// touches on this rank in device memory).
fn in_place_kind(op: &Op) -> bool {
    matches!(
        op.kind,
        OpKind::AllReduce
            | OpKind::Broadcast
            | OpKind::Reduce
            | OpKind::AllGather
            | OpKind::ReduceScatter
    )
}

/// What the staging asks of the device and the settings.
pub(super) struct DeviceCan<'a> {
    /// Whether address `p` is device memory.
    pub on_device: &'a dyn Fn(u64) -> bool,
    /// Whether a reduce-scatter or all-reduce of this type and op is
    /// staged as an exchange whose copy out reduces ([`exchanges`]): the
    /// same answer on every rank, since it decides what the ranks send.
    pub reduce: &'a dyn Fn(DataType, ReduceOp) -> bool,
}

/// Whether a reduce-scatter or all-reduce of `dtype` with `op` across
/// hosts is staged as an exchange whose copy out reduces
/// ([`reduce_scatter_on_gpu`], [`all_reduce_on_gpu`]): unless
/// `WEFT_CROSSHOST_REDUCE=host`, for every op but PreMulSum and every type
/// but the fp8 ones. The answer changes what the ranks send each other,
/// so it rests only on what every rank shares (the setting, the type, the
/// op), never on this rank's GPU or copier: a rank that cannot run the
/// reducing kernel reduces on its CPU instead ([`reduced_on_host`]) and
/// sends the same messages.
pub(super) fn exchanges(dtype: DataType, op: ReduceOp) -> bool {
    weft_contract::params::WEFT_CROSSHOST_REDUCE.value() != "host"
        && !matches!(dtype, DataType::F8E4M3 | DataType::F8E5M2)
        && !matches!(op, ReduceOp::PreMulSum(_))
}

/// A job's reducing copy out done by the progress thread instead, on the
/// pinned buffer, after the network part ([`reduced_on_host`]): offsets of
/// the buffer.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct HostReduce {
    /// This rank's own part, copied in; the result is left here.
    pub into: usize,
    pub received: Received,
}

/// Job `s` whose copy out reduces ([`Staged::reduce_out`]) for a rank that
/// cannot launch the reducing kernel (the copy engines' path, or no kernel
/// for its GPU): the same sends and receives, its own part copied into
/// the pinned buffer too, reduced there by the progress thread with what
/// arrived ([`HostReduce`]), and copied out like any result.
pub(super) fn reduced_on_host(mut s: Staged) -> (Staged, Option<HostReduce>) {
    let Some(r) = s.reduce_out.take() else {
        return (s, None);
    };
    let (into, bytes) = (s.bytes, r.received.count * r.received.dtype.size());
    s.to_host.push(Copy {
        dev: r.own,
        off: into,
        bytes,
    });
    s.to_device.push(Copy {
        dev: r.dst,
        off: into,
        bytes,
    });
    s.bytes += bytes.next_multiple_of(ALIGN);
    let host = HostReduce {
        into,
        received: r.received,
    };
    (s, Some(host))
}

/// Stages the job `ops` of rank `rank` of `nranks`. `regions`: the generic
/// path's device regions of a list of operations (`staging::device_regions`).
pub(super) fn stage(
    ops: &[Op],
    rank: usize,
    nranks: usize,
    slice_bytes: usize,
    can: &DeviceCan,
    regions: &dyn Fn(&[Op]) -> Vec<DevRegion>,
) -> Vec<Staged> {
    let on_device = can.on_device;
    if let [op] = ops
        && in_place_kind(op)
        && op.count > 0
        && op.buffers(rank, nranks).iter().all(|b| on_device(b.ptr))
    {
        if matches!(op.kind, OpKind::AllGather | OpKind::ReduceScatter) {
            let cut = slices(
                op.bytes(),
                gathered_slice_count(op.bytes(), nranks, slice_bytes),
            );
            // Each slice (or the whole) as an exchange where the ranks
            // are few enough (a reduce-scatter: where it reduces on the
            // GPU), else in place on one pinned region.
            type Slice = fn(&Op, usize, usize, usize, usize) -> Staged;
            let exchange: Option<Slice> = match op.kind {
                _ if nranks > MAX_RANKS => None,
                OpKind::AllGather => Some(all_gather_exchanged),
                _ if op.redop.is_some_and(|r| (can.reduce)(op.dtype, r)) => {
                    Some(reduce_scatter_on_gpu)
                }
                _ => None,
            };
            let each: Slice = match (exchange, cut.len()) {
                (Some(f), _) => f,
                (None, 1) => return vec![in_place(op, rank, nranks)],
                (None, _) => gathered_slice,
            };
            return cut
                .into_iter()
                .map(|(off, bytes)| each(op, rank, nranks, off, bytes))
                .collect();
        }
        let k = slice_count(op.bytes(), slice_bytes);
        let reduces_on_gpu = op.redop.is_some_and(|r| (can.reduce)(op.dtype, r));
        if op.kind == OpKind::AllReduce
            && nranks == 2
            && k == 1
            && op.bytes() < ALL_REDUCE_ON_GPU_MIN_BYTES
            && reduces_on_gpu
        {
            return vec![all_reduce_of_two(op, rank)];
        }
        if op.kind == OpKind::AllReduce
            && k == 1
            && op.bytes() >= ALL_REDUCE_ON_GPU_MIN_BYTES
            && (2..=MAX_RANKS).contains(&nranks)
            && op.count >= nranks
            && reduces_on_gpu
        {
            return all_reduce_on_gpu(op, rank, nranks);
        }
        let es = op.dtype.size();
        return slices(op.bytes(), k)
            .into_iter()
            .map(|(off, bytes)| {
                let mut s = *op;
                s.send = op.send.wrapping_add(off);
                s.recv = op.recv.wrapping_add(off);
                s.count = bytes / es;
                in_place(&s, rank, nranks)
            })
            .collect();
    }
    if let [op] = ops
        && op.kind == OpKind::AllToAll
        && op.count > 0
        && op.buffers(rank, nranks).iter().all(|b| on_device(b.ptr))
    {
        return all_to_all(op, rank, nranks, slice_bytes);
    }
    if ops
        .iter()
        .all(|o| o.is_send_recv() && o.count > 0 && on_device(o.p2p_buf() as u64))
    {
        return sends_and_receives(ops, slice_bytes);
    }
    vec![generic(ops, regions(ops))]
}

/// A group of sends and receives of device memory, each piece in its own
/// region, cut alike into slices (see the module docs).
fn sends_and_receives(ops: &[Op], slice_bytes: usize) -> Vec<Staged> {
    let cuts: Vec<Vec<(usize, usize)>> = ops
        .iter()
        .map(|o| slices(o.bytes(), slice_count(o.bytes(), slice_bytes)))
        .collect();
    let jobs = cuts.iter().map(Vec::len).max().unwrap_or(1);
    (0..jobs)
        .map(|k| {
            let mut s = Staged::new(Vec::new());
            s.per_op = true;
            for (o, cut) in ops.iter().zip(&cuts) {
                let Some(&(off, bytes)) = cut.get(k) else {
                    continue;
                };
                let dev = o.p2p_buf() as u64 + off as u64;
                let c = Copy {
                    dev,
                    off: s.bytes,
                    bytes,
                };
                let mut piece = *o;
                piece.count = bytes / o.dtype.size();
                if o.kind == OpKind::Send {
                    piece.send = dev as *const u8;
                    s.to_host.push(c);
                } else {
                    piece.recv = dev as *mut u8;
                    s.to_device.push(c);
                }
                s.map.push((dev, bytes, s.bytes));
                s.ops.push(piece);
                s.bytes += bytes.next_multiple_of(ALIGN);
            }
            s
        })
        .collect()
}

/// An all-to-all of device memory: a send and a receive of a block per
/// other rank (staged as [`sends_and_receives`]), the own block copied on
/// the GPU.
fn all_to_all(op: &Op, rank: usize, nranks: usize, slice_bytes: usize) -> Vec<Staged> {
    let block = op.bytes();
    let at = |p: u64, r: usize| p + (r * block) as u64;
    let (send, recv) = (op.send as u64, op.recv as u64);
    let group = op.all_to_all_as_sends_and_receives(nranks, |p| p == rank);
    let mut jobs = sends_and_receives(&group, slice_bytes);
    if jobs.is_empty() {
        jobs.push(Staged::new(Vec::new()));
    }
    if at(send, rank) != at(recv, rank) {
        jobs[0].dtod.push((at(recv, rank), at(send, rank), block));
    }
    jobs
}

/// One collective in place on one pinned region (see the module docs).
fn in_place(op: &Op, rank: usize, nranks: usize) -> Staged {
    let (send, recv) = (op.send as u64, op.recv as u64);
    let n = op.bytes();
    let at_root = rank == op.root;
    let whole = |dev: u64| Copy {
        dev,
        off: 0,
        bytes: n,
    };
    let mut s = Staged {
        bytes: n,
        ..Staged::new(Vec::new())
    };
    // `region`: the device range the pinned buffer stands for; the op runs
    // with both pointers inside it.
    let (region, op_send, op_recv) = match op.kind {
        OpKind::AllReduce => {
            s.to_host.push(whole(send));
            s.to_device.push(whole(recv));
            (recv, recv, recv)
        }
        OpKind::Broadcast if at_root => {
            if send != recv {
                s.dtod.push((recv, send, n));
            }
            s.to_host.push(whole(send));
            (send, send, send)
        }
        OpKind::Broadcast => {
            s.to_device.push(whole(recv));
            (recv, recv, recv)
        }
        OpKind::Reduce if at_root => {
            s.to_host.push(whole(send));
            s.to_device.push(whole(recv));
            (recv, recv, recv)
        }
        OpKind::Reduce => {
            s.to_host.push(whole(send));
            (send, send, send)
        }
        OpKind::AllGather => {
            let own = rank * n;
            s.bytes = nranks * n;
            s.to_host.push(Copy {
                dev: send,
                off: own,
                bytes: n,
            });
            s.to_device.push(Copy {
                dev: recv,
                off: 0,
                bytes: nranks * n,
            });
            (recv, recv + own as u64, recv)
        }
        OpKind::ReduceScatter => {
            let own = rank * n;
            s.bytes = nranks * n;
            s.to_host.push(Copy {
                dev: send,
                off: 0,
                bytes: nranks * n,
            });
            s.to_device.push(Copy {
                dev: recv,
                off: own,
                bytes: n,
            });
            (send, send, send + own as u64)
        }
        _ => unreachable!("in_place_kind admits only these"),
    };
    s.map.push((region, s.bytes, 0));
    let mut o = *op;
    o.send = op_send as *const u8;
    o.recv = op_recv as *mut u8;
    s.ops.push(o);
    s
}

/// How many slices an all-gather or reduce-scatter of `bytes` a rank on
/// `nranks` ranks is cut into: by its whole data (`nranks * bytes`, as an
/// all-reduce by its buffer), and at most [`MAX_GATHERED_COPIES`] block
/// copies in all (a slice copies a block per rank).
fn gathered_slice_count(bytes: usize, nranks: usize, slice_bytes: usize) -> usize {
    let k = slice_count(bytes.saturating_mul(nranks), slice_bytes);
    k.min(MAX_GATHERED_COPIES / nranks.max(1)).max(1)
}

/// The most block copies the slices of one all-gather or reduce-scatter
/// take (each a piece of the copy kernel's launch or an engine call on the
/// calling thread).
const MAX_GATHERED_COPIES: usize = 4 * MAX_SLICES;

/// Slice `[off, off + bytes)` of every rank's block of an all-gather or a
/// reduce-scatter (blocks of `op.bytes()`), as one job: its pinned region
/// holds the slice of each rank's block, rank order, so the job is the
/// plain collective of `bytes` a rank in place on it (NCCL's in-place
/// layout). All-gather: this rank's slice in (its own block of the output
/// copied on the GPU when out of place), the other ranks' slices out.
/// Reduce-scatter: every block's slice in, this rank's out. Why: unsliced,
/// a 256 MiB all-gather on 2 hosts copied its input in, ran the network,
/// then copied the whole output out, one after the other (2.8-3.8 GB/s
/// busbw where an all-reduce, sliced, reached 5.8-6.7).
fn gathered_slice(op: &Op, rank: usize, nranks: usize, off: usize, bytes: usize) -> Staged {
    let (send, recv, block) = (op.send as u64, op.recv as u64, op.bytes());
    let at = |base: u64, r: usize| base + (r * block + off) as u64;
    let mut s = Staged {
        bytes: nranks * bytes,
        ..Staged::new(Vec::new())
    };
    let piece = |dev: u64, r: usize| Copy {
        dev,
        off: r * bytes,
        bytes,
    };
    // The pinned region as the op addresses it: a range that stands for it
    // (the host path's pointers are moved into the buffer through `map`;
    // the device never reads it there).
    let region = recv;
    let mut o = *op;
    o.count = bytes / op.dtype.size();
    if op.kind == OpKind::AllGather {
        // This rank's slice of its input (a block: `send` is one).
        let own = send + off as u64;
        s.to_host.push(piece(own, rank));
        if own != at(recv, rank) {
            s.dtod.push((at(recv, rank), own, bytes));
        }
        s.to_device.extend(
            (0..nranks)
                .filter(|&r| r != rank)
                .map(|r| piece(at(recv, r), r)),
        );
        o.send = (region + (rank * bytes) as u64) as *const u8;
        o.recv = region as *mut u8;
    } else {
        s.to_host.extend((0..nranks).map(|r| piece(at(send, r), r)));
        s.to_device.push(piece(recv + off as u64, rank));
        o.send = region as *const u8;
        o.recv = (region + (rank * bytes) as u64) as *mut u8;
    }
    s.map.push((region, s.bytes, 0));
    s.ops.push(o);
    s
}

/// Slice `[off, off + bytes)` of every rank's block of a reduce-scatter
/// (blocks of `op.bytes()`), reduced on the GPU ([`exchange_reduced`]):
/// the other ranks' slices of this rank's input go out, their slices of
/// this rank's block come in, and the copy out reduces this rank's own
/// slice, still in device memory, with the received ones into the output.
/// Against the in-place staging ([`gathered_slice`]: every block copied
/// in, the host algorithm reducing on the progress thread's CPUs as it
/// receives, the result copied out): `nranks - 1` slices copied in instead
/// of `nranks`, no reduction on the CPU. Reduce-scatter was the slowest
/// collective across hosts at 1-4 MiB (0.7-1.4x NCCL's socket transport
/// where all-gather read 0.9-2.2x, 2 x H200 as 2 hosts x 1); reduced on the
/// GPU it read 1.3-2.5x (docs/PERFORMANCE-GPU.md, "Across hosts").
fn reduce_scatter_on_gpu(op: &Op, rank: usize, nranks: usize, off: usize, bytes: usize) -> Staged {
    let (send, recv, block) = (op.send as u64, op.recv as u64, op.bytes());
    let at = |r: usize| send + (r * block + off) as u64;
    exchange_reduced(
        op,
        rank,
        nranks,
        |p| (at(p), bytes),
        at(rank),
        recv + off as u64,
    )
}

/// All-reduces of at least this many bytes reduce on the GPU
/// ([`all_reduce_on_gpu`]); smaller ones on two ranks too, as one exchange
/// ([`all_reduce_of_two`]); smaller ones on more ranks run the host algorithm on one
/// pinned copy: one round trip between GPU and host, not two, where the
/// round trip weighs more than the reduction. On 2 x H200 as 2 hosts x 1
/// (two runs each, 100 calls) reduced on the GPU read 3.1-3.4 GB/s at
/// 1 MiB against 3.8-3.9 on the host, and 5.3-5.6 against 3.8 at 2 MiB.
const ALL_REDUCE_ON_GPU_MIN_BYTES: usize = 2 << 20;

/// An all-reduce between two ranks as one exchange whose copy out reduces
/// ([`exchange_reduced`]): each rank sends the other its whole buffer and
/// reduces what arrives with its own, still in device memory, into the
/// output. On two ranks this puts as many bytes
/// on the network as the reduce-scatter and all-gather pair
/// ([`all_reduce_on_gpu`]: half the buffer each way, twice) or the host
/// ring on one pinned copy, in one round trip and one job instead of two,
/// with no reduction on the progress thread's CPU (the host ring reduced
/// half the buffer there between its two steps). On 2 x H200 as 2 hosts x 1
/// the host ring's 1 MiB all-reduce read 0.96x NCCL's socket transport
/// while a send/recv of the same size read 2.2x (docs/PERFORMANCE-GPU.md,
/// "Across hosts"); as one exchange it read 1.3-1.5x the host ring at
/// 1 MiB, 2x at 512 KiB. On three ranks and more it would send each rank's
/// whole buffer to every other one: not used there. Only below
/// [`ALL_REDUCE_ON_GPU_MIN_BYTES`]: from there the pair of jobs was as fast
/// under nccl-tests and faster in a DDP step of a 404M-parameter
/// transformer (25 MB buckets: 253-276 ms against 341-373 ms a step), its
/// reducing copy out (the kernel reading the received bytes from pinned
/// memory across PCIe) covering half the buffer, not all of it.
fn all_reduce_of_two(op: &Op, rank: usize) -> Staged {
    let (send, recv) = (op.send as u64, op.recv as u64);
    exchange_reduced(op, rank, 2, |_| (send, op.bytes()), send, recv)
}

/// Part `p` of `count` elements cut into `n` parts, the first `count % n`
/// one element longer: `(first element, elements)`.
fn part(count: usize, n: usize, p: usize) -> (usize, usize) {
    let (base, rem) = (count / n, count % n);
    (p * base + p.min(rem), base + usize::from(p < rem))
}

/// An all-reduce as a reduce-scatter reduced on the GPU and an
/// all-gather, two jobs, the second after the first's copy out (each rank
/// owns part `rank` of the buffer, [`part`]):
///
/// 1. the other ranks' parts of the input go out, their contributions to
///    this rank's part come in, and the copy out reduces this rank's part
///    of the input (device memory) with them into its part of the output;
/// 2. that reduced part is copied in (the stream runs it after 1's copy
///    out) and goes to every other rank, their reduced parts come in and
///    are copied out to their places.
///
/// Against the in-place staging (the whole buffer copied in, the host
/// algorithm's reduce-scatter and all-gather on the pinned copy with the
/// reductions on the progress thread's CPUs, the whole buffer copied back):
/// the same bytes on the network, `(n - 1) / n` of the buffer copied in and
/// back plus `1 / n` each way, no reduction on the CPU, one more round trip
/// between GPU and host. In place the input's other parts are read (job 1's
/// copies in) before anything writes them (job 2's copies out).
fn all_reduce_on_gpu(op: &Op, rank: usize, nranks: usize) -> Vec<Staged> {
    let (send, recv, es) = (op.send as u64, op.recv as u64, op.dtype.size());
    let at = |base: u64, p: usize| base + (part(op.count, nranks, p).0 * es) as u64;
    let len = |p: usize| part(op.count, nranks, p).1 * es;
    let reduce = exchange_reduced(
        op,
        rank,
        nranks,
        |p| (at(send, p), len(p)),
        at(send, rank),
        at(recv, rank),
    );
    let mut gather = exchange_gathered(op, rank, nranks, |p| (at(recv, p), len(p)), at(recv, rank));
    gather.after_previous = true;
    vec![reduce, gather]
}

/// Slice `[off, off + bytes)` of every rank's block of an all-gather
/// (blocks of `op.bytes()`) as an exchange ([`exchange_gathered`]): this
/// rank's slice of its input goes to every other rank, theirs come in and
/// are copied out to their places; this rank's own, out of place, is
/// copied on the GPU. Against the in-place staging ([`gathered_slice`]:
/// the host algorithm's ring on the pinned copy, through the flat path's
/// transport): the same bytes, as sends and receives, which from 256 KiB
/// go on the cross-host engine's striped connections, as the
/// reduce-scatter's pieces do. On 2 x H200 as 2 hosts x 1 under
/// nccl-tests the in-place all-gather of 2 MiB took 376 us where the
/// reduce-scatter's exchange of the same bytes took 201 us.
fn all_gather_exchanged(op: &Op, rank: usize, nranks: usize, off: usize, bytes: usize) -> Staged {
    let (send, recv, block) = (op.send as u64, op.recv as u64, op.bytes());
    let at = |r: usize| recv + (r * block + off) as u64;
    let own = send + off as u64;
    let mut s = exchange_gathered(op, rank, nranks, |p| (at(p), bytes), own);
    if own != at(rank) {
        s.dtod.push((at(rank), own, bytes));
    }
    s
}

/// One job that sends every other rank this rank's piece (`own`, device
/// memory of `piece(rank)`'s size, copied in once) and receives rank `p`'s
/// piece into `piece(p)` (address, bytes; copied out from its own pinned
/// region): a send and a receive per other rank, in ring order from this
/// rank's successor, as an all-to-all's pieces (each end lists the pair
/// alike, so they meet on the same transport).
fn exchange_gathered(
    op: &Op,
    rank: usize,
    nranks: usize,
    piece: impl Fn(usize) -> (u64, usize),
    own: u64,
) -> Staged {
    let es = op.dtype.size();
    let own_bytes = piece(rank).1;
    let mut s = Staged::new(Vec::new());
    s.per_op = true;
    s.to_host.push(Copy {
        dev: own,
        off: 0,
        bytes: own_bytes,
    });
    s.bytes = own_bytes.next_multiple_of(ALIGN);
    for p in (1..nranks).map(|k| (rank + k) % nranks) {
        s.map.push((own, own_bytes, 0));
        s.ops
            .push(Op::send(own as *const u8, own_bytes / es, op.dtype, p).on(op.memory, op.stream));
        let (theirs, bytes) = piece(p);
        s.map.push((theirs, bytes, s.bytes));
        s.ops
            .push(Op::recv(theirs as *mut u8, bytes / es, op.dtype, p).on(op.memory, op.stream));
        s.to_device.push(Copy {
            dev: theirs,
            off: s.bytes,
            bytes,
        });
        s.bytes += bytes.next_multiple_of(ALIGN);
    }
    s
}

/// One job that sends every other rank `p` the device bytes `piece(p)`
/// (address, bytes), receives from each as many bytes as `piece(rank)`
/// has, and whose copy out reduces `own` (device memory, `piece(rank)`'s
/// size) with what it received into `dst` on the GPU: a send and a receive
/// per other rank, as an all-to-all's pieces (each end lists the pair
/// alike, so they meet on the same transport).
fn exchange_reduced(
    op: &Op,
    rank: usize,
    nranks: usize,
    piece: impl Fn(usize) -> (u64, usize),
    own: u64,
    dst: u64,
) -> Staged {
    let (es, dtype) = (op.dtype.size(), op.dtype);
    let mine = piece(rank).1;
    let mut s = Staged::new(Vec::new());
    s.per_op = true;
    let mut from = Vec::with_capacity(nranks - 1);
    // Peers in ring order from this rank's successor, so the ranks do not
    // all send to rank 0 first.
    for p in (1..nranks).map(|k| (rank + k) % nranks) {
        let (dev, bytes) = piece(p);
        s.to_host.push(Copy {
            dev,
            off: s.bytes,
            bytes,
        });
        s.map.push((dev, bytes, s.bytes));
        s.ops
            .push(Op::send(dev as *const u8, bytes / es, dtype, p).on(op.memory, op.stream));
        s.bytes += bytes.next_multiple_of(ALIGN);
        // The receive's address stands for its pinned region only (its
        // own map entry); nothing is copied back from it as such.
        s.map.push((dst, mine, s.bytes));
        s.ops
            .push(Op::recv(dst as *mut u8, mine / es, dtype, p).on(op.memory, op.stream));
        from.push(s.bytes);
        s.bytes += mine.next_multiple_of(ALIGN);
    }
    s.reduce_out = Some(ReduceOut {
        dst,
        own,
        received: Received {
            from,
            count: mine / es,
            dtype,
            op: op.redop.expect("a reducing collective has its op"),
        },
    });
    s
}

/// Every device region of the job, read ones copied in and written ones
/// copied out, the operations as they are.
fn generic(ops: &[Op], regions: Vec<DevRegion>) -> Staged {
    let mut s = Staged::new(ops.to_vec());
    for r in regions {
        let c = Copy {
            dev: r.dev,
            off: s.bytes,
            bytes: r.bytes,
        };
        // Outputs the operation fills whole are not copied in.
        if r.read {
            s.to_host.push(c);
        }
        if r.write {
            s.to_device.push(c);
        }
        s.map.push((r.dev, r.bytes, s.bytes));
        s.bytes += r.bytes.next_multiple_of(ALIGN);
    }
    s
}

#[cfg(test)]
#[path = "pinned_plan_tests.rs"]
pub(super) mod tests;

#[cfg(test)]
#[path = "pinned_exchange_tests.rs"]
mod exchange_tests;
