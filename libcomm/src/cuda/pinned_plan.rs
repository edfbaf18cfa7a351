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
//! Everything else (other groups, gather, scatter, host buffers in a device
//! call) is staged as before: every device region the job touches, read
//! ones copied in, written ones copied out, the operations unchanged.

use super::pinned::ALIGN;
use super::staging::{DevRegion, host_op};
use crate::op::{Op, OpKind};

/// The most slices one collective is cut into (each is a job: a few stream
/// operations on the calling thread, a pinned buffer, a wake-up of the
/// progress thread).
pub(super) const MAX_SLICES: usize = 8;

/// Slice boundaries fall on this many bytes (a multiple of every element
/// size, and page-aligned copies run at full speed).
const SLICE_ALIGN: usize = 4096;

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
fn slices(bytes: usize, k: usize) -> Vec<(usize, usize)> {
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

/// Stages the job `ops` of rank `rank` of `nranks`. `on_device(p)`: whether
/// address `p` is device memory; `regions`: the generic path's device
/// regions of a list of operations (`staging::device_regions`).
pub(super) fn stage(
    ops: &[Op],
    rank: usize,
    nranks: usize,
    slice_bytes: usize,
    on_device: &dyn Fn(u64) -> bool,
    regions: &dyn Fn(&[Op]) -> Vec<DevRegion>,
) -> Vec<Staged> {
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
            if cut.len() > 1 {
                return cut
                    .into_iter()
                    .map(|(off, bytes)| gathered_slice(op, rank, nranks, off, bytes))
                    .collect();
            }
            return vec![in_place(op, rank, nranks)];
        }
        let k = slice_count(op.bytes(), slice_bytes);
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
mod tests {
    use super::*;
    use crate::data::types::{DataType, ReduceOp};
    use crate::op::Memory;

    const MIB: usize = 1 << 20;

    /// Device addresses in these tests are at or above this.
    const DEV: u64 = 1 << 40;

    fn on_device(p: u64) -> bool {
        p >= DEV
    }

    fn no_regions(_: &[Op]) -> Vec<DevRegion> {
        panic!("the generic path was not expected")
    }

    fn dev_op(mut op: Op) -> Op {
        op = op.on(Memory::Device(0), std::ptr::null_mut());
        op
    }

    fn p(a: u64) -> *mut u8 {
        a as *mut u8
    }

    /// The element at device address `a`, in the pinned buffer of `s`: its
    /// offset there.
    fn pinned_at(s: &Staged, a: u64) -> usize {
        let &(d, n, off) = s
            .map
            .iter()
            .find(|&&(d, n, _)| a >= d && a < d + n as u64)
            .unwrap_or_else(|| panic!("{a:#x} is not staged: {:?}", s.map));
        assert!(off + n <= s.bytes);
        off + (a - d) as usize
    }

    #[test]
    fn slices_cover_the_collective_on_aligned_bounds() {
        assert_eq!(slice_count(100 * MIB, 0), 1, "0: never cut");
        assert_eq!(slice_count(100 * MIB, 64 * MIB), 1);
        assert_eq!(slice_count(128 * MIB, 64 * MIB), 2);
        assert_eq!(slice_count(1 << 30, 64 * MIB), MAX_SLICES);
        for (bytes, k) in [
            (128 * MIB + 12, 2),
            (3 * SLICE_ALIGN + 4, 3),
            (1 << 30, 8),
            (5, 1),
        ] {
            let s = slices(bytes, k);
            assert!(s.len() <= k && !s.is_empty(), "{bytes} {k}: {s:?}");
            let mut at = 0;
            for &(o, n) in &s {
                assert_eq!(o, at, "contiguous");
                assert_eq!(o % SLICE_ALIGN, 0);
                assert!(n > 0);
                at += n;
            }
            assert_eq!(at, bytes, "{s:?}");
        }
    }

    #[test]
    fn an_out_of_place_all_reduce_runs_in_place_on_one_pinned_copy_cut_in_slices() {
        let (send, recv) = (DEV, DEV + (1 << 32));
        let count = (160 * MIB + 4096) / 4;
        let op = dev_op(Op::all_reduce(
            p(send),
            p(recv),
            count,
            DataType::F32,
            ReduceOp::Sum,
        ));
        let staged = stage(&[op], 0, 2, 64 * MIB, &on_device, &no_regions);
        assert_eq!(staged.len(), 2);
        let mut covered = 0;
        for s in &staged {
            let o = s.ops[0];
            assert_eq!(o.send, o.recv.cast_const(), "in place");
            assert_eq!(s.bytes, o.count * 4, "one copy, not two");
            let off = o.recv as u64 - recv;
            assert_eq!(
                s.to_host,
                vec![Copy {
                    dev: send + off,
                    off: 0,
                    bytes: s.bytes
                }]
            );
            assert_eq!(
                s.to_device,
                vec![Copy {
                    dev: recv + off,
                    off: 0,
                    bytes: s.bytes
                }]
            );
            assert_eq!(pinned_at(s, o.recv as u64), 0);
            assert!(s.dtod.is_empty());
            covered += o.count;
        }
        assert_eq!(covered, count);
    }

    #[test]
    fn a_broadcast_root_copies_its_output_on_the_device_and_nothing_back() {
        let (send, recv) = (DEV, DEV + (1 << 32));
        let op = dev_op(Op::broadcast(p(send), p(recv), 1000, DataType::F64, 1));
        let root = &stage(&[op], 1, 3, 64 * MIB, &on_device, &no_regions)[0];
        assert_eq!(root.dtod, vec![(recv, send, 8000)]);
        assert_eq!(
            root.to_host,
            vec![Copy {
                dev: send,
                off: 0,
                bytes: 8000
            }]
        );
        assert!(root.to_device.is_empty());
        assert_eq!(root.ops[0].send, root.ops[0].recv.cast_const());
        let other = &stage(&[op], 0, 3, 64 * MIB, &on_device, &no_regions)[0];
        assert!(other.dtod.is_empty() && other.to_host.is_empty());
        assert_eq!(
            other.to_device,
            vec![Copy {
                dev: recv,
                off: 0,
                bytes: 8000
            }]
        );
        // In place at the root: no device copy either.
        let inp = dev_op(Op::broadcast(p(send), p(send), 1000, DataType::F64, 1));
        assert!(
            stage(&[inp], 1, 3, 0, &on_device, &no_regions)[0]
                .dtod
                .is_empty()
        );
    }

    #[test]
    fn a_reduce_copies_back_at_the_root_only() {
        let (send, recv) = (DEV, DEV + (1 << 32));
        let op = dev_op(Op::reduce(
            p(send),
            p(recv),
            77,
            DataType::I32,
            ReduceOp::Max,
            2,
        ));
        let root = &stage(&[op], 2, 4, 0, &on_device, &no_regions)[0];
        assert_eq!(
            root.to_device,
            vec![Copy {
                dev: recv,
                off: 0,
                bytes: 308
            }]
        );
        assert_eq!(root.ops[0].send, root.ops[0].recv.cast_const());
        let other = &stage(&[op], 0, 4, 0, &on_device, &no_regions)[0];
        assert!(other.to_device.is_empty());
        assert_eq!(
            other.to_host,
            vec![Copy {
                dev: send,
                off: 0,
                bytes: 308
            }]
        );
    }

    #[test]
    fn all_gather_and_reduce_scatter_take_nccls_in_place_layouts() {
        let (send, recv) = (DEV, DEV + (1 << 32));
        let (n, c) = (3usize, 1001usize);
        let ag = dev_op(Op::all_gather(p(send), p(recv), c, DataType::F32));
        let s = &stage(&[ag], 1, n, 8, &on_device, &no_regions);
        assert_eq!(s.len(), 1, "a block under one slice's alignment is not cut");
        let s = &s[0];
        assert_eq!(s.bytes, n * c * 4);
        let o = s.ops[0];
        assert_eq!(
            o.send as u64,
            recv + (c * 4) as u64,
            "input at recv + rank*count"
        );
        assert_eq!(
            s.to_host,
            vec![Copy {
                dev: send,
                off: c * 4,
                bytes: c * 4
            }]
        );
        assert_eq!(pinned_at(s, o.send as u64), c * 4);
        assert_eq!(
            s.to_device,
            vec![Copy {
                dev: recv,
                off: 0,
                bytes: n * c * 4
            }]
        );

        let rs = dev_op(Op::reduce_scatter(
            p(send),
            p(recv),
            c,
            DataType::F32,
            ReduceOp::Sum,
        ));
        let s = &stage(&[rs], 2, n, 8, &on_device, &no_regions)[0];
        let o = s.ops[0];
        assert_eq!(
            o.recv as u64,
            send + (2 * c * 4) as u64,
            "output at send + rank*count"
        );
        assert_eq!(
            s.to_host,
            vec![Copy {
                dev: send,
                off: 0,
                bytes: n * c * 4
            }]
        );
        assert_eq!(
            s.to_device,
            vec![Copy {
                dev: recv,
                off: 2 * c * 4,
                bytes: c * 4
            }]
        );
    }

    /// Every rank's jobs of a sliced all-gather and reduce-scatter run as
    /// the GPU and the progress thread would (the device's copies, the
    /// collective on each job's pinned region, the copies back), in and out
    /// of place, odd block sizes: every rank's output against the
    /// reference, and no job copies more than its slice of each block.
    #[test]
    // Job j of every rank, rank r of every job: indices read plainer here.
    #[allow(clippy::needless_range_loop)]
    fn sliced_all_gather_and_reduce_scatter_move_every_block_once_and_match_the_reference() {
        const MEM: usize = 1 << 20;
        let n = 3;
        // A block of 5 pages and 3 floats: six slices, the last of 12 bytes.
        let count = 5 * 1024 + 3;
        let block = count * 4;
        let value = |r: usize, i: usize| ((r * 31 + i * 7) % 97 + 1) as f32;
        for kind in [OpKind::AllGather, OpKind::ReduceScatter] {
            for in_place_op in [false, true] {
                // Device memory of each rank: the send buffer at DEV, the
                // receive buffer at DEV + MEM (in place: NCCL's layouts).
                let mut mem: Vec<Vec<f32>> = (0..n)
                    .map(|r| {
                        let mut m = vec![f32::NAN; 2 * MEM / 4];
                        let inputs = if kind == OpKind::AllGather {
                            count
                        } else {
                            n * count
                        };
                        let at = match (kind, in_place_op) {
                            (OpKind::AllGather, true) => MEM / 4 + r * count,
                            _ => 0,
                        };
                        for i in 0..inputs {
                            m[at + i] = value(r, i);
                        }
                        m
                    })
                    .collect();
                let ops: Vec<Op> = (0..n)
                    .map(|r| {
                        let recv = DEV + MEM as u64;
                        let (sp, rp) = match (kind, in_place_op) {
                            (OpKind::AllGather, true) => (recv + (r * block) as u64, recv),
                            (OpKind::AllGather, false) => (DEV, recv),
                            (_, true) => (DEV, DEV + (r * block) as u64),
                            (_, false) => (DEV, recv),
                        };
                        let op = if kind == OpKind::AllGather {
                            Op::all_gather(p(sp), p(rp), count, DataType::F32)
                        } else {
                            Op::reduce_scatter(p(sp), p(rp), count, DataType::F32, ReduceOp::Sum)
                        };
                        dev_op(op)
                    })
                    .collect();
                let jobs: Vec<Vec<Staged>> = (0..n)
                    .map(|r| stage(&[ops[r]], r, n, 8192, &on_device, &no_regions))
                    .collect();
                assert_eq!(jobs[0].len(), 6, "{kind:?}: cut in six slices");
                let idx = |a: u64| (a - DEV) as usize / 4;
                for j in 0..jobs[0].len() {
                    // Copies in (and the GPU's own copies), per rank.
                    let mut pinned: Vec<Vec<f32>> = Vec::new();
                    for r in 0..n {
                        let s = &jobs[r][j];
                        for &(dst, src, bytes) in &s.dtod {
                            let v = mem[r][idx(src)..idx(src) + bytes / 4].to_vec();
                            mem[r][idx(dst)..idx(dst) + bytes / 4].copy_from_slice(&v);
                        }
                        let mut b = vec![f32::NAN; s.bytes / 4];
                        for c in &s.to_host {
                            assert!(c.bytes <= 4096, "{kind:?}: a slice of a block at most");
                            b[c.off / 4..(c.off + c.bytes) / 4]
                                .copy_from_slice(&mem[r][idx(c.dev)..idx(c.dev) + c.bytes / 4]);
                        }
                        pinned.push(b);
                    }
                    // The collective of the slice on the pinned regions.
                    let o = jobs[0][j].ops[0];
                    let c = o.count;
                    let before = pinned.clone();
                    for r in 0..n {
                        let s = &jobs[r][j];
                        let (so, ro) = (
                            pinned_at(s, s.ops[0].send as u64) / 4,
                            pinned_at(s, s.ops[0].recv as u64) / 4,
                        );
                        for q in 0..n {
                            if kind == OpKind::AllGather {
                                let sq = &jobs[q][j];
                                let qo = pinned_at(sq, sq.ops[0].send as u64) / 4;
                                let v = before[q][qo..qo + c].to_vec();
                                pinned[r][ro + q * c..ro + (q + 1) * c].copy_from_slice(&v);
                            }
                        }
                        if kind == OpKind::ReduceScatter {
                            for i in 0..c {
                                pinned[r][ro + i] = (0..n).map(|q| before[q][so + r * c + i]).sum();
                            }
                        }
                    }
                    // Copies back.
                    for r in 0..n {
                        for cp in &jobs[r][j].to_device {
                            assert!(cp.bytes <= 4096, "{kind:?}: a slice of a block at most");
                            let v = pinned[r][cp.off / 4..(cp.off + cp.bytes) / 4].to_vec();
                            mem[r][idx(cp.dev)..idx(cp.dev) + cp.bytes / 4].copy_from_slice(&v);
                        }
                    }
                }
                for r in 0..n {
                    let out = idx(ops[r].recv as u64);
                    if kind == OpKind::AllGather {
                        for i in 0..n * count {
                            let want = value(i / count, i % count);
                            assert_eq!(
                                mem[r][out + i],
                                want,
                                "all_gather in place {in_place_op} rank {r} at {i}"
                            );
                        }
                    } else {
                        for i in 0..count {
                            let want: f32 = (0..n).map(|q| value(q, r * count + i)).sum();
                            assert_eq!(
                                mem[r][out + i],
                                want,
                                "reduce_scatter in place {in_place_op} rank {r} at {i}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn groups_host_buffers_and_other_kinds_take_the_generic_staging() {
        let (a, b) = (DEV, DEV + (1 << 32));
        let regions = |ops: &[Op]| {
            assert!(!ops.is_empty());
            vec![
                DevRegion {
                    dev: a,
                    bytes: 100,
                    write: false,
                    read: true,
                },
                DevRegion {
                    dev: b,
                    bytes: 300,
                    write: true,
                    read: false,
                },
            ]
        };
        let a2a = dev_op(Op::all_to_all(p(a), p(b), 25, DataType::F32));
        let host = dev_op(Op::all_reduce(
            p(4096),
            p(b),
            25,
            DataType::F32,
            ReduceOp::Sum,
        ));
        let send = dev_op(Op::send(p(a), 25, DataType::F32, 1));
        for job in [vec![host], vec![send, a2a]] {
            let s = stage(&job, 0, 2, 8, &on_device, &regions);
            assert_eq!(s.len(), 1);
            let s = &s[0];
            assert_eq!(s.ops.len(), job.len());
            assert_eq!(
                s.to_host,
                vec![Copy {
                    dev: a,
                    off: 0,
                    bytes: 100
                }]
            );
            assert_eq!(
                s.to_device,
                vec![Copy {
                    dev: b,
                    off: 256,
                    bytes: 300
                }]
            );
            assert_eq!(s.bytes, 256 + 512);
            assert_eq!(
                s.host_map(1 << 20),
                vec![(a, 100, 1 << 20), (b, 300, (1 << 20) + 256)]
            );
        }
    }

    /// Where op `i` of `s` points once staged at pinned base `base`.
    fn host_ptrs(s: &Staged, base: u64) -> Vec<u64> {
        s.host_ops(base)
            .iter()
            .map(|o| o.p2p_buf() as u64)
            .collect()
    }

    #[test]
    fn sends_and_receives_stage_each_piece_apart_cut_alike_on_both_ends() {
        let (a, b) = (DEV, DEV + (1 << 32));
        // In place, as nccl-tests' send/recv: the receive over its own send.
        let mine = vec![
            dev_op(Op::send(p(a), 3 * MIB / 4, DataType::F32, 1)),
            dev_op(Op::recv(p(a), 3 * MIB / 4, DataType::F32, 1)),
            dev_op(Op::recv(p(b), (MIB + 12) / 4, DataType::F32, 2)),
        ];
        let jobs = stage(&mine, 0, 3, MIB, &on_device, &no_regions);
        // 3 MiB in 3 slices of 1 MiB; the 1 MiB + 12 receive is not cut.
        assert_eq!(jobs.len(), 3);
        for (k, s) in jobs.iter().enumerate() {
            let piece = (k * MIB) as u64;
            assert_eq!(
                s.to_host,
                vec![Copy {
                    dev: a + piece,
                    off: 0,
                    bytes: MIB
                }]
            );
            let mut want = vec![Copy {
                dev: a + piece,
                off: MIB,
                bytes: MIB,
            }];
            if k == 0 {
                want.push(Copy {
                    dev: b,
                    off: 2 * MIB,
                    bytes: MIB + 12,
                });
            }
            assert_eq!(s.to_device, want, "job {k}");
            // The send and the receive over it get their own regions.
            let base = 1 << 30;
            let ptrs = host_ptrs(s, base);
            assert_eq!(ptrs[..2], [base, base + MIB as u64], "job {k}");
            assert!(
                s.ops
                    .iter()
                    .all(|o| o.count == MIB / 4 || o.count == (MIB + 12) / 4)
            );
            assert!(s.host_ops(base).iter().all(|o| o.memory == Memory::Host));
        }
        // The other end's matching ops are cut alike: job k moves piece k.
        let theirs = vec![
            dev_op(Op::recv(p(b), 3 * MIB / 4, DataType::F32, 0)),
            dev_op(Op::send(p(b), 3 * MIB / 4, DataType::F32, 0)),
        ];
        let other = stage(&theirs, 1, 3, MIB, &on_device, &no_regions);
        assert_eq!(other.len(), 3);
        for (k, s) in other.iter().enumerate() {
            assert_eq!(
                s.ops.iter().map(|o| o.bytes()).collect::<Vec<_>>(),
                vec![MIB, MIB]
            );
            assert_eq!(s.to_device[0].dev, b + (k * MIB) as u64);
        }
    }

    #[test]
    fn an_all_to_all_sends_only_the_other_ranks_blocks_and_copies_its_own_on_the_gpu() {
        let (snd, rcv) = (DEV, DEV + (1 << 32));
        let count = 1000; // 4000 bytes a block
        let op = dev_op(Op::all_to_all(p(snd), p(rcv), count, DataType::F32));
        let jobs = stage(&[op], 1, 3, 0, &on_device, &no_regions);
        assert_eq!(jobs.len(), 1);
        let s = &jobs[0];
        assert_eq!(
            s.dtod,
            vec![(rcv + 4000, snd + 4000, 4000)],
            "the own block, on the GPU"
        );
        let peers: Vec<(OpKind, usize, u64)> = s
            .ops
            .iter()
            .map(|o| (o.kind, o.peer(), o.p2p_buf() as u64))
            .collect();
        assert_eq!(
            peers,
            vec![
                (OpKind::Send, 0, snd),
                (OpKind::Recv, 0, rcv),
                (OpKind::Send, 2, snd + 8000),
                (OpKind::Recv, 2, rcv + 8000),
            ]
        );
        let devs = |c: &[Copy]| c.iter().map(|c| (c.dev, c.bytes)).collect::<Vec<_>>();
        assert_eq!(devs(&s.to_host), vec![(snd, 4000), (snd + 8000, 4000)]);
        assert_eq!(devs(&s.to_device), vec![(rcv, 4000), (rcv + 8000, 4000)]);
        assert_eq!(s.bytes, 4 * 4096);
        // In place: no own copy at all.
        let inplace = dev_op(Op::all_to_all(p(snd), p(snd), count, DataType::F32));
        let jobs = stage(&[inplace], 1, 3, 0, &on_device, &no_regions);
        assert!(jobs[0].dtod.is_empty());
        assert_eq!(jobs[0].ops.len(), 4);
    }
}
