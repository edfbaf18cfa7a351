//! The copies of a device job across hosts between its device buffers and
//! its pinned buffer (`proxy.rs` enqueues them, `pinned_plan.rs` lists
//! them): the copy kernel (the point-to-point kernel's sequential copy
//! ops: for a call of several slices one launch for all their copies in
//! and back, else one for the copies in and one out), or the copy engines
//! (`cuMemcpyAsync`, one call per copy).
//!
//! Why a kernel by default: what a copy-engine copy costs the calling
//! thread grows with its size (the driver cuts it up: 12-20 us per 64 MiB
//! from device to host on an H200, so 25-39 us for the 128 MiB rail part
//! of a 256 MiB all-reduce on 2 hosts x 2 GPUs), and such a call must
//! return within 100 us (issue 32). A launch costs a few microseconds at
//! any size, and the kernel writes the jobs' `ready` and `released` words
//! itself (per block: `pinned.rs`) and, for a call of several jobs, waits
//! for their `done` itself, so a 256 MiB all-reduce in 4 slices costs one
//! launch instead of 16 driver calls. The price: the copies in run on
//! [`SLOTS`] SMs while they last, and a sliced call's copies back hold
//! [`OUT_BLOCKS`] SMs while its network part runs, as NCCL's kernels hold
//! theirs.
//! By default (`WEFT_CROSSHOST_COPY=auto`) every job takes the kernel
//! where the library has it for the device: on 2 x H200 as 2 hosts x 1
//! under torch (2026-11-30, three runs) it was ahead of the engines from
//! 1 MiB to 4 MiB too (all-reduce 3.2-3.8 against 2.1-3.0 GB/s at 1 MiB,
//! all-gather 3.5-3.8 against 1.3-2.7), about even at 64-256 KiB and from
//! 16 MiB; an earlier build, whose single jobs copied back on 8 blocks and
//! whose waits slept in 50 us steps, had measured the engines faster at
//! 1 MiB. `engine` forces the engines; a library without kernels (no
//! cubin, no NVRTC) always uses them.

use super::abi::{MAX_P2P, MAX_RANKS, P2P_COPY_SEQ, P2pArgs, P2pOp};
use super::driver::compute_capability;
use super::error::{CudaResult, check};
use super::kernels::{P2P_KERNEL, available_for, func_name, function};
use super::launch::{MAX_THREADS, launch_kernel, launch_local_reduce};
use super::pinned::{Lease, RELEASED_BY_DONE, SLOTS};
use super::pinned_pipe::Pipe;
#[cfg(test)]
use super::pinned_plan::Received;
use super::pinned_plan::{ReduceOut, Staged};
use crate::data::types::{DataType, ReduceOp};
use cudarc::driver::sys;

/// Blocks of the copy kernel's launch out when a call has several jobs
/// (slices): one launch copies every job back, its blocks waiting (spinning
/// on the jobs' `done` words, as NCCL's kernels hold their channels' SMs)
/// for the network the whole call, so few of them: a job's copy back then
/// overlaps the network of the next. A single job's copy back is on the
/// critical path, so it waits on the stream and copies with [`SLOTS`]
/// blocks: with 8 blocks for single jobs too, broadcasts of 16-64 MiB fell
/// from 9.2-10.1 to 6.3-7.1 GB/s (2 x H200 as 2 hosts x 1).
const OUT_BLOCKS: usize = 8;

/// Blocks of the kernel's copies back in a call of `jobs` jobs (see
/// [`OUT_BLOCKS`]); also how many `released` words each job's blocks write.
fn out_blocks(jobs: usize) -> usize {
    if jobs > 1 { OUT_BLOCKS } else { SLOTS }
}

/// Which hardware moves a job's bytes between device and pinned memory:
/// the copy kernel (every job's copies in one launch, each one's copies
/// out one launch; its blocks flag `ready` and `released`), or the copy
/// engines (one `cuMemcpyAsync` per copy, stream memory operations for
/// the words).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Copier(Mover);

/// Which hardware one job's copies take.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mover {
    Kernel,
    Engine,
}

impl Copier {
    /// The engines for every job.
    pub const ENGINES: Copier = Copier(Mover::Engine);
    /// The copy kernel for every job.
    const KERNEL: Copier = Copier(Mover::Kernel);

    /// What `setting` (`WEFT_CROSSHOST_COPY`: `auto`, `kernel` or
    /// `engine`) gives on device `dev`: the kernel (`auto` and `kernel`
    /// alike) only where the library has it for the device.
    pub fn choose(setting: &str, dev: i32) -> Copier {
        let has_kernel = || compute_capability(dev).is_ok_and(|cc| available_for(cc, P2P_KERNEL));
        match setting != "engine" && has_kernel() {
            true => Copier::KERNEL,
            false => Copier::ENGINES,
        }
    }

    /// Whether every job takes the copy kernel.
    pub fn is_kernel(self) -> bool {
        self.0 == Mover::Kernel
    }

    pub fn describe(self) -> String {
        match self.0 {
            Mover::Engine => "the copy engines".into(),
            Mover::Kernel => "the copy kernel".into(),
        }
    }

    fn mover(self) -> Mover {
        self.0
    }

    /// Whether this rank's copy out can reduce values of `dtype` with `op`
    /// on device `dev` (`Staged::reduce_out`): on the copy kernel's path
    /// (the engines only copy), where the library has the type's reducing
    /// kernel for the device. Where not, the progress thread reduces
    /// (`pinned_plan::reduced_on_host`): the messages stay the same.
    pub fn reduces_here(self, dev: i32, dtype: DataType, op: ReduceOp) -> bool {
        self.mover() == Mover::Kernel
            && func_name(dtype, Some(op), true)
                .is_some_and(|f| compute_capability(dev).is_ok_and(|cc| available_for(cc, f)))
    }

    /// How job `s` in a call of `jobs` jobs signals `ready` and
    /// `released` (`Pool::take`): the copy kernel's per-block words (its
    /// launches' blocks in and out), or single words (0): the engines',
    /// and a reducing copy out's (the stream writes it after the launch).
    /// A job that copies nothing out is released by its `done`
    /// ([`RELEASED_BY_DONE`]).
    pub(super) fn slots_for(self, s: &Staged, jobs: usize) -> (usize, usize) {
        let ready = match self.mover() {
            Mover::Kernel => SLOTS,
            Mover::Engine => 0,
        };
        let released = match self.mover() {
            _ if copies_nothing_out(s) => RELEASED_BY_DONE,
            Mover::Kernel if s.reduce_out.is_some() => 0,
            Mover::Kernel => out_blocks(jobs),
            Mover::Engine => 0,
        };
        (ready, released)
    }

    /// The copies of `jobs` (each: what it stages, its buffer, its
    /// sequence number), planned once for [`Copies::enqueue_in`] and
    /// [`Copies::enqueue_out`].
    ///
    /// A call of several jobs (slices) all on the kernel, whose copies fit
    /// one launch, is one launch of the copy kernel: the copies back ride
    /// at the end, on its first [`OUT_BLOCKS`] blocks, which wait for each
    /// job's `done` as their own launch would (a job's `done` comes after
    /// its `ready`, which every block writes once its copies in are done,
    /// so none copies back early); the other blocks end after the copies
    /// in. One launch instead of two: the calling thread's cost of a
    /// 256 MiB all-reduce.
    pub(super) fn copies(self, jobs: &[(&Staged, &Lease, u32)]) -> Copies {
        let ins = self.in_pieces(jobs);
        let (outs, out_blocks) = self.out_pieces(jobs);
        let all_kernel = ins
            .iter()
            .chain(&outs)
            .all(|p| p.how == Mover::Kernel && p.reduce.is_none());
        let at_once = out_blocks == OUT_BLOCKS && all_kernel && ins.len() + outs.len() <= MAX_P2P;
        Copies {
            ins,
            outs,
            out_blocks,
            at_once,
        }
    }

    /// The copies of `s`, the only job of its call, in `pipe`'s pieces
    /// (`pinned_pipe.rs`): each piece in marks `ready` with its number,
    /// each piece out waits for its number in `done`; a job that copies
    /// nothing out (the root) has no copies out and no wait.
    /// The kernel's (`pinned_pipe::pipelines` asks for the kernel).
    pub(super) fn pipelined(self, s: &Staged, buf: &Lease, pipe: &Pipe) -> Copies {
        let how = Mover::Kernel;
        let seq = pipe.seq();
        let (_, done, _) = buf.words;
        let mut ins: Vec<Piece> = s
            .dtod
            .iter()
            .map(|&(dst, src, bytes)| Piece::copy(dst, src, bytes, false, how))
            .collect();
        match s.to_host.first() {
            Some(c) => ins.extend(pipe.pieces.iter().map(|&(off, bytes, number)| Piece {
                signal: Some(Signal::Slots(buf.slot_words.0, number)),
                ..Piece::copy(buf.at(off, how), c.dev + off as u64, bytes, false, how)
            })),
            None => signal_after(&mut ins, 0, how, Signal::Slots(buf.slot_words.0, seq)),
        }
        let outs = match s.to_device.first() {
            Some(c) => {
                let mut outs: Vec<Piece> = pipe
                    .pieces
                    .iter()
                    .map(|&(off, bytes, number)| Piece {
                        wait: Some((done, number)),
                        ..Piece::copy(c.dev + off as u64, buf.at(off, how), bytes, true, how)
                    })
                    .collect();
                if let Some(last) = outs.last_mut() {
                    last.signal = Some(Signal::Slots(buf.slot_words.1, seq));
                }
                outs
            }
            None => self.out_pieces(&[(s, buf, seq)]).0,
        };
        Copies {
            ins,
            outs,
            out_blocks: SLOTS,
            at_once: false,
        }
    }

    /// Every job's copies into its pinned buffer (and a broadcast root's
    /// own device-to-device copy), each job's followed by its `ready`
    /// signal, in job order: the first job's bytes are all in place first,
    /// so its network part starts while the next ones copy.
    fn in_pieces(self, jobs: &[(&Staged, &Lease, u32)]) -> Vec<Piece> {
        let mut pieces = Vec::new();
        for &(s, buf, seq) in jobs {
            let how = self.mover();
            let first = pieces.len();
            pieces.extend(
                s.dtod
                    .iter()
                    .map(|&(dst, src, bytes)| Piece::copy(dst, src, bytes, false, how)),
            );
            pieces.extend(
                s.to_host
                    .iter()
                    .map(|c| Piece::copy(buf.at(c.off, how), c.dev, c.bytes, false, how)),
            );
            let (ready, _, _) = buf.words;
            let signal = match how {
                Mover::Kernel => Signal::Slots(buf.slot_words.0, seq),
                Mover::Engine => Signal::Word(ready, seq),
            };
            signal_after(&mut pieces, first, how, signal);
        }
        pieces
    }

    /// For every job in order, a wait for its `done` (the progress
    /// thread's), its copies out of its pinned buffer back to the device,
    /// then its `released` signal; and the kernel's blocks. With several
    /// jobs the copy kernel waits for `done` itself ([`OUT_BLOCKS`] blocks);
    /// a single job and the engines' jobs wait on the stream
    /// (`cuStreamWaitValue32`). A job that copies nothing out
    /// ([`copies_nothing_out`]) has none of them: its stream goes on once
    /// its copies in are done.
    fn out_pieces(self, jobs: &[(&Staged, &Lease, u32)]) -> (Vec<Piece>, usize) {
        let blocks = out_blocks(jobs.len());
        let mut pieces = Vec::new();
        // A job that copies nothing out adds nothing: its stream does not
        // wait for its network part (its buffer is released by `done`).
        for &(s, buf, seq) in jobs.iter().filter(|j| !copies_nothing_out(j.0)) {
            let how = self.mover();
            let (_, done, released) = buf.words;
            if let Some(r) = &s.reduce_out {
                // The stream waits, the reducing kernel runs, the stream
                // flags the release (whatever the other jobs do).
                pieces.push(Piece {
                    wait: Some((done, seq)),
                    ..Piece::copy(0, 0, 0, false, Mover::Engine)
                });
                pieces.push(Piece {
                    reduce: Some(Reduction::of(r, buf)),
                    signal: Some(Signal::Word(released, seq)),
                    ..Piece::copy(r.dst, 0, 0, true, Mover::Kernel)
                });
                continue;
            }
            if how == Mover::Kernel && blocks == SLOTS {
                // The stream waits (an empty engine piece carries it).
                pieces.push(Piece {
                    wait: Some((done, seq)),
                    ..Piece::copy(0, 0, 0, false, Mover::Engine)
                });
            }
            let first = pieces.len();
            pieces.extend(
                s.to_device
                    .iter()
                    .map(|c| Piece::copy(c.dev, buf.at(c.off, how), c.bytes, true, how)),
            );
            let signal = match how {
                Mover::Kernel => Signal::Slots(buf.slot_words.1, seq),
                Mover::Engine => Signal::Word(released, seq),
            };
            signal_after(&mut pieces, first, how, signal);
            if how == Mover::Engine || blocks == OUT_BLOCKS {
                pieces[first].wait = Some((done, seq));
            }
        }
        (pieces, blocks)
    }
}

/// A call's copies between device and pinned memory ([`Copier::copies`]).
pub(super) struct Copies {
    ins: Vec<Piece>,
    outs: Vec<Piece>,
    /// The kernel's blocks for the copies out.
    out_blocks: usize,
    /// Ins and outs are one launch (enqueued by `enqueue_in`).
    at_once: bool,
}

impl Copies {
    /// Looks up (loads) the kernels of the copies out that are not the
    /// copy kernel: before the stream holds anything of the call. A kernel
    /// loaded after the stream's wait for a job's `done` could wait for
    /// that wait, which only the caller's queueing of the job ends (the
    /// first reduce-scatter of a process hung so, on 2 x H200).
    pub(super) fn load_kernels(&self, dev: i32) -> CudaResult<()> {
        for r in self.outs.iter().filter_map(|p| p.reduce) {
            function(dev, r.func)?;
        }
        Ok(())
    }

    /// Enqueues the copies in and the `ready` signals (and, as one launch,
    /// the copies out where they go with them).
    ///
    /// # Safety
    /// The jobs' device addresses are valid device memory of `dev` until
    /// the stream passes the copies; each buffer holds its job's bytes.
    pub(super) unsafe fn enqueue_in(&self, dev: i32, stream: sys::CUstream) -> CudaResult<()> {
        if self.at_once {
            return unsafe { launch_ops(dev, &self.ops_at_once(), SLOTS, stream) };
        }
        unsafe { enqueue(dev, &self.ins, SLOTS, stream) }
    }

    /// The one launch's ops: the copies in on every block, then the
    /// copies out on the first [`OUT_BLOCKS`].
    fn ops_at_once(&self) -> Vec<P2pOp> {
        let mut ops = copy_ops(&self.ins, SLOTS);
        ops.extend(copy_ops(&self.outs, OUT_BLOCKS));
        ops
    }

    /// Enqueues the waits for `done`, the copies out and the `released`
    /// signals, unless `enqueue_in` did.
    ///
    /// # Safety
    /// As [`enqueue_in`](Self::enqueue_in).
    pub(super) unsafe fn enqueue_out(&self, dev: i32, stream: sys::CUstream) -> CudaResult<()> {
        if self.at_once {
            return Ok(());
        }
        unsafe { enqueue(dev, &self.outs, self.out_blocks, stream) }
    }
}

/// Enqueues `pieces` in order: each run of kernel pieces as launches of
/// `blocks` blocks, the engines' one by one.
unsafe fn enqueue(
    dev: i32,
    pieces: &[Piece],
    blocks: usize,
    stream: sys::CUstream,
) -> CudaResult<()> {
    let alone = |p: &Piece| p.reduce.is_some();
    for run in pieces.chunk_by(|a, b| a.how == b.how && !alone(a) && !alone(b)) {
        if let Some(r) = run[0].reduce {
            unsafe {
                launch_local_reduce(
                    dev,
                    r.func,
                    &r.srcs[..r.n],
                    r.dst,
                    r.count,
                    r.blocks,
                    stream,
                )?;
                signal_on_stream(run[0].signal, stream)?;
            }
            continue;
        }
        match run[0].how {
            Mover::Kernel => unsafe { launch_copies(dev, run, blocks, stream)? },
            Mover::Engine => {
                for p in run {
                    unsafe { engine_copy(p, stream)? };
                }
            }
        }
    }
    Ok(())
}

impl Lease {
    /// The address of byte `off` of the buffer's data as `how` addresses
    /// it: the kernel through the device mapping, the engines through the
    /// host address.
    fn at(&self, off: usize, how: Mover) -> u64 {
        match how {
            Mover::Kernel => self.dev_data + off as u64,
            Mover::Engine => self.data as u64 + off as u64,
        }
    }
}

/// A job's reducing copy out as one launch takes it (`Staged::reduce_out`
/// with the buffer's device addresses): `dst = op(srcs[0..n])`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Reduction {
    /// The type's and op's reducing kernel.
    func: &'static str,
    dst: u64,
    /// This rank's own part (device memory), then the received parts
    /// (the pinned buffer, device-mapped).
    srcs: [u64; MAX_RANKS],
    n: usize,
    count: usize,
    /// One block per [`REDUCE_BLOCK_BYTES`] of output, [`SLOTS`] at most.
    blocks: usize,
}

/// Output bytes per block of a reducing copy out, at least (small ones
/// stay on few SMs; 1 MiB and more take [`SLOTS`], as the copies do).
const REDUCE_BLOCK_BYTES: usize = 32 << 10;

impl Reduction {
    fn of(r: &ReduceOut, buf: &Lease) -> Reduction {
        let got = &r.received;
        let mut srcs = [0; MAX_RANKS];
        srcs[0] = r.own;
        for (i, &off) in got.from.iter().enumerate() {
            srcs[i + 1] = buf.at(off, Mover::Kernel);
        }
        Reduction {
            func: func_name(got.dtype, Some(got.op), true)
                .expect("staged only where the kernel exists (Copier::reduces_here)"),
            dst: r.dst,
            srcs,
            n: got.from.len() + 1,
            count: got.count,
            blocks: (got.count * got.dtype.size())
                .div_ceil(REDUCE_BLOCK_BYTES)
                .clamp(1, SLOTS),
        }
    }
}

/// How the end of a job's copies is made known to the progress thread
/// and the pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Signal {
    /// The stream writes `seq` to this word (`cuStreamWriteValue32`, whose
    /// default is preceded by a system-scope fence of the stream's work).
    Word(u64, u32),
    /// Every block of the copy kernel writes `seq` into its word of this
    /// array once its part of the job's copies is done.
    Slots(u64, u32),
}

/// One copy as a launch or an engine call takes it; `signal`: the job's
/// copies end with it.
#[derive(Clone, Copy, Debug)]
struct Piece {
    dst: u64,
    src: u64,
    bytes: usize,
    /// The source is pinned memory the CPU wrote (cache-bypassing loads).
    from_pinned: bool,
    how: Mover,
    /// Wait first until this word (device address) reaches this value.
    wait: Option<(u64, u32)>,
    signal: Option<Signal>,
    /// Not a copy: this reduction, a launch of its own (its wait is the
    /// piece before, its signal a word the stream writes).
    reduce: Option<Reduction>,
}

impl Piece {
    /// A copy of `bytes` (0: none, a carrier of a wait or a signal), no
    /// wait, no signal.
    fn copy(dst: u64, src: u64, bytes: usize, from_pinned: bool, how: Mover) -> Piece {
        Piece {
            dst,
            src,
            bytes,
            from_pinned,
            how,
            wait: None,
            signal: None,
            reduce: None,
        }
    }
}

/// Puts `signal` on the last of the job's pieces from `first` on (an
/// empty copy carries it where the job copies nothing this way).
fn signal_after(pieces: &mut Vec<Piece>, first: usize, how: Mover, signal: Signal) {
    if pieces.len() == first {
        pieces.push(Piece::copy(0, 0, 0, false, how));
    }
    if let Some(last) = pieces.last_mut() {
        last.signal = Some(signal);
    }
}

unsafe fn engine_copy(p: &Piece, stream: sys::CUstream) -> CudaResult<()> {
    unsafe {
        if let Some((word, value)) = p.wait {
            check(
                sys::cuStreamWaitValue32_v2(
                    stream,
                    word,
                    value,
                    sys::CUstreamWaitValue_flags_enum::CU_STREAM_WAIT_VALUE_GEQ as u32,
                ),
                "cuStreamWaitValue32 (a cross-host job's done word)",
            )?;
        }
        if p.bytes > 0 {
            check(
                sys::cuMemcpyAsync(p.dst, p.src, p.bytes, stream),
                "cuMemcpyAsync (between device memory and the cross-host pinned buffer)",
            )?;
        }
        signal_on_stream(p.signal, stream)
    }
}

/// The stream writes a job's word (after its work before: the default
/// flags fence it system-wide).
unsafe fn signal_on_stream(signal: Option<Signal>, stream: sys::CUstream) -> CudaResult<()> {
    match signal {
        Some(Signal::Word(word, seq)) => check(
            unsafe { sys::cuStreamWriteValue32_v2(stream, word, seq, 0) },
            "cuStreamWriteValue32 (a cross-host job's ready or released word)",
        ),
        Some(Signal::Slots(..)) => unreachable!("the stream signals with words"),
        None => Ok(()),
    }
}

/// The copy kernel's ops for `pieces` (at most [`MAX_P2P`]): every block
/// takes its part of each in turn (`P2P_COPY_SEQ`).
fn copy_ops(pieces: &[Piece], blocks: usize) -> Vec<P2pOp> {
    pieces
        .iter()
        .map(|p| {
            let (base, flag) = match p.signal {
                Some(Signal::Slots(at, seq)) => (at, seq),
                Some(Signal::Word(..)) => unreachable!("the kernel signals with slots"),
                None => (0, 0),
            };
            let (wait, until) = p.wait.unwrap_or((0, flag));
            // One value per op: a job's wait and its flag are its sequence
            // number (an op with both is a whole job's).
            debug_assert!(p.wait.is_none() || p.signal.is_none() || until == flag);
            let seq = if p.wait.is_some() { until } else { flag } as u64;
            P2pOp {
                ptr: p.dst,
                src: p.src,
                bytes: p.bytes as u64,
                seq,
                base,
                peer: p.from_pinned as i32,
                kind: P2P_COPY_SEQ,
                block0: 0,
                nblocks: blocks as i32,
                wait,
            }
        })
        .collect()
}

/// Whether job `s` writes nothing back to device memory (a broadcast's
/// root, a reduce's other ranks, sends alone): its stream has no reason
/// to wait for the network, as NCCL's kernels end once their data is in
/// the network's buffers.
pub(super) fn copies_nothing_out(s: &Staged) -> bool {
    s.to_device.is_empty() && s.reduce_out.is_none()
}

/// One launch of the point-to-point kernel of `blocks` blocks per
/// [`MAX_P2P`] pieces.
unsafe fn launch_copies(
    dev: i32,
    pieces: &[Piece],
    blocks: usize,
    stream: sys::CUstream,
) -> CudaResult<()> {
    for chunk in pieces.chunks(MAX_P2P) {
        unsafe { launch_ops(dev, &copy_ops(chunk, blocks), blocks, stream)? };
    }
    Ok(())
}

/// One launch of the point-to-point kernel of `blocks` blocks running
/// `ops` (at most [`MAX_P2P`]).
unsafe fn launch_ops(
    dev: i32,
    ops: &[P2pOp],
    blocks: usize,
    stream: sys::CUstream,
) -> CudaResult<()> {
    let f = function(dev, P2P_KERNEL)?;
    let mut a = P2pArgs {
        flags: [0; MAX_RANKS],
        status: 0,
        rank: 0,
        nops: ops.len() as i32,
        ops: [P2pOp::default(); MAX_P2P],
        scratch: [0; MAX_RANKS],
        region: 0,
        step: 0,
        slots: 0,
        direct: 1,
    };
    a.ops[..ops.len()].copy_from_slice(ops);
    unsafe {
        launch_kernel(
            f,
            blocks as u32,
            MAX_THREADS,
            &mut a,
            stream,
            "cuLaunchKernel (weft_p2p: the cross-host path's copies)",
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn piece(bytes: usize) -> Piece {
        Piece::copy(0x1000, 0x2000, bytes, false, Mover::Kernel)
    }

    #[test]
    fn the_kernel_signals_per_block_and_the_engines_with_single_words() {
        let kernel = Copier::KERNEL;
        let (copy, reducing) = (job(1 << 20), reducing_job());
        assert_eq!(kernel.slots_for(&copy, 4), (SLOTS, OUT_BLOCKS));
        assert_eq!(kernel.slots_for(&copy, 1), (SLOTS, SLOTS));
        assert_eq!(Copier::ENGINES.slots_for(&copy, 4), (0, 0));
        assert_eq!(Copier::ENGINES.slots_for(&copy, 1), (0, 0));
        // A reducing copy out: its copies in per block, its release a word
        // the stream writes after the reduction.
        assert_eq!(kernel.slots_for(&reducing, 4), (SLOTS, 0));
        assert_eq!(kernel.slots_for(&reducing, 1), (SLOTS, 0));
        assert_eq!(Copier::choose("engine", 0), Copier::ENGINES);
    }

    /// The engines never reduce (their rank reduces on the host), nor
    /// does the kernel's path without a reducing kernel (PreMulSum).
    #[test]
    fn the_engines_and_premulsum_leave_the_reduction_to_the_host() {
        assert!(!Copier::ENGINES.reduces_here(0, DataType::F32, ReduceOp::Sum));
        assert!(!Copier::KERNEL.reduces_here(0, DataType::F32, ReduceOp::PreMulSum(2.0)));
    }

    /// A job that reduces on the GPU, in a call of one job or of several:
    /// the stream waits for its done, one launch of the reducing kernel
    /// (its own part in device memory first, then the received parts at
    /// their pinned offsets through the device mapping), then the stream
    /// writes the release word; never inside the copy kernel's one launch.
    #[test]
    fn a_reducing_copy_out_waits_on_the_stream_reduces_then_writes_its_release() {
        let kernel = Copier::KERNEL;
        let r = reducing_job();
        let (la, lb) = (lease(1), lease(2));
        for jobs in [vec![(&r, &la, 5)], vec![(&r, &la, 5), (&r, &lb, 6)]] {
            let (pieces, _) = kernel.out_pieces(&jobs);
            assert_eq!(pieces.len(), 2 * jobs.len());
            for (k, &(_, l, seq)) in jobs.iter().enumerate() {
                let (wait, red) = (&pieces[2 * k], &pieces[2 * k + 1]);
                assert_eq!(
                    (wait.how, wait.bytes, wait.wait, wait.reduce),
                    (Mover::Engine, 0, Some((l.words.1, seq)), None)
                );
                let x = red.reduce.expect("the reduction");
                assert_eq!(x.func, "weft_coll_f32_sum");
                assert_eq!(x.n, 3);
                assert_eq!(
                    &x.srcs[..3],
                    &[0x7000, l.dev_data + 4096, l.dev_data + 12288]
                );
                assert_eq!((x.dst, x.count), (0x9000, 1000));
                assert_eq!(x.blocks, 1, "4000 bytes: one block");
                assert_eq!(red.signal, Some(Signal::Word(l.words.2, seq)));
                assert_eq!(red.wait, None);
            }
            assert!(!kernel.copies(&jobs).at_once);
        }
        let mut big = reducing_job();
        big.reduce_out.as_mut().unwrap().received.count = 64 << 20;
        let (pieces, _) = kernel.out_pieces(&[(&big, &la, 9)]);
        assert_eq!(pieces[1].reduce.unwrap().blocks, SLOTS);
    }

    /// A pipelined broadcast: the root copies its pieces in, each marking
    /// `ready` with its own number, and waits for `done` on the stream
    /// before its buffer is released; another rank marks its job ready at
    /// once and copies each piece out after its number in `done`, the
    /// last also marking the release.
    #[test]
    fn a_pipelined_job_marks_and_waits_piece_by_piece() {
        use crate::cuda::pinned_plan::Copy;
        let kernel = Copier::KERNEL;
        let bytes = 1 << 20;
        let whole = |dev| Copy { dev, off: 0, bytes };
        let root = Staged {
            bytes,
            dtod: vec![(0x5000, 0x7000, bytes)],
            to_host: vec![whole(0x7000)],
            to_device: Vec::new(),
            ..job(0)
        };
        let other = Staged {
            bytes,
            to_device: vec![whole(0x9000)],
            ..job(0)
        };
        let l = lease(3);
        let mut n = 20;
        let pipe = Pipe::new(bytes, || {
            n += 1;
            n
        });
        assert_eq!(pipe.pieces.len(), 4);
        let c = kernel.pipelined(&root, &l, &pipe);
        assert!(!c.at_once && c.out_blocks == SLOTS);
        assert_eq!(
            (c.ins[0].dst, c.ins[0].signal),
            (0x5000, None),
            "its own copy first"
        );
        for (k, p) in c.ins[1..].iter().enumerate() {
            let off = (k << 18) as u64;
            assert_eq!(
                (p.dst, p.src, p.bytes),
                (l.dev_data + off, 0x7000 + off, 1 << 18)
            );
            assert_eq!(p.signal, Some(Signal::Slots(l.slot_words.0, 21 + k as u32)));
        }
        assert!(
            c.outs.is_empty(),
            "the root's stream does not wait for the network"
        );
        let c = kernel.pipelined(&other, &l, &pipe);
        assert_eq!(c.ins.len(), 1);
        assert_eq!(
            (c.ins[0].bytes, c.ins[0].signal),
            (0, Some(Signal::Slots(l.slot_words.0, 24)))
        );
        assert_eq!(c.outs.len(), 4);
        for (k, p) in c.outs.iter().enumerate() {
            let off = (k << 18) as u64;
            assert_eq!(
                (p.dst, p.src, p.bytes),
                (0x9000 + off, l.dev_data + off, 1 << 18)
            );
            assert_eq!(p.wait, Some((l.words.1, 21 + k as u32)));
            assert!(p.from_pinned && p.how == Mover::Kernel);
        }
        assert_eq!(c.outs[3].signal, Some(Signal::Slots(l.slot_words.1, 24)));
        // As the kernel runs them: each piece waits for its own number.
        let ops = copy_ops(&c.outs, SLOTS);
        let waits: Vec<(u64, u64)> = ops.iter().map(|o| (o.wait, o.seq)).collect();
        assert_eq!(
            waits,
            [
                (l.words.1, 21),
                (l.words.1, 22),
                (l.words.1, 23),
                (l.words.1, 24)
            ]
        );
        assert_eq!(ops[3].base, l.slot_words.1);
        assert!(ops[..3].iter().all(|o| o.base == 0));
    }

    /// A job that writes nothing back (a broadcast's root, a reduce's
    /// other ranks, sends alone) neither waits for `done` on its stream
    /// nor signals `released`: its buffer is released by `done`, and in a
    /// call of several jobs only the others wait.
    #[test]
    fn a_job_that_copies_nothing_out_lets_its_stream_go_on() {
        let root = Staged {
            to_host: job(1 << 20).to_device.clone(),
            to_device: Vec::new(),
            ..job(1 << 20)
        };
        let other = job(1 << 20);
        let (la, lb) = (lease(1), lease(2));
        for copier in [Copier::KERNEL, Copier::ENGINES] {
            assert_eq!(copier.slots_for(&root, 1).1, RELEASED_BY_DONE);
            assert_ne!(copier.slots_for(&other, 1).1, RELEASED_BY_DONE);
            assert!(copier.out_pieces(&[(&root, &la, 5)]).0.is_empty());
            let (outs, _) = copier.out_pieces(&[(&root, &la, 5), (&other, &lb, 6)]);
            assert!(!outs.is_empty());
            assert!(
                outs.iter()
                    .all(|p| p.wait.is_none_or(|w| w == (lb.words.1, 6)))
            );
            assert!(outs.iter().any(|p| p.wait == Some((lb.words.1, 6))));
        }
        // The copy kernel's one launch of a sliced call: the root's jobs'
        // copies in only.
        let c = Copier::KERNEL.copies(&[(&root, &la, 5), (&root, &lb, 6)]);
        assert!(c.outs.is_empty());
    }

    #[test]
    fn each_job_signals_after_its_last_copy_even_with_none() {
        let mut pieces = vec![piece(1), piece(2)];
        signal_after(&mut pieces, 0, Mover::Kernel, Signal::Slots(0xa0, 5));
        // A job that copies nothing this way (a broadcast's other ranks in)
        // still signals: an empty copy carries it.
        signal_after(&mut pieces, 2, Mover::Kernel, Signal::Slots(0xb0, 6));
        let signals: Vec<_> = pieces.iter().map(|p| p.signal).collect();
        assert_eq!(
            signals,
            vec![
                None,
                Some(Signal::Slots(0xa0, 5)),
                Some(Signal::Slots(0xb0, 6))
            ]
        );
        assert_eq!(pieces[2].bytes, 0);
    }

    #[test]
    fn kernel_ops_take_every_block_in_turn_and_flag_the_jobs_slots() {
        let mut pieces = vec![piece(3 << 20), piece(1 << 20)];
        pieces[1].from_pinned = true;
        signal_after(&mut pieces, 0, Mover::Kernel, Signal::Slots(0xc0, 9));
        let ops = copy_ops(&pieces, SLOTS);
        assert!(
            ops.iter()
                .all(|o| o.kind == P2P_COPY_SEQ && o.block0 == 0 && o.nblocks == SLOTS as i32)
        );
        assert!(
            ops.iter().all(|o| o.wait == 0),
            "copies in wait for nothing"
        );
        assert_eq!(
            (ops[0].base, ops[0].peer),
            (0, 0),
            "no flag before the job's end"
        );
        assert_eq!((ops[1].base, ops[1].seq, ops[1].peer), (0xc0, 9, 1));
        assert_eq!(
            (ops[0].ptr, ops[0].src, ops[0].bytes),
            (0x1000, 0x2000, 3 << 20)
        );
    }

    #[test]
    fn copies_out_wait_for_their_jobs_done_then_flag_its_release() {
        // Two jobs out: one of two copies, one of none (a reduce's non-root).
        let mut pieces = vec![piece(1 << 20), piece(2 << 20)];
        signal_after(&mut pieces, 0, Mover::Kernel, Signal::Slots(0xa0, 5));
        pieces[0].wait = Some((0xd0, 5));
        signal_after(&mut pieces, 2, Mover::Kernel, Signal::Slots(0xb0, 6));
        pieces[2].wait = Some((0xe0, 6));
        let ops = copy_ops(&pieces, OUT_BLOCKS);
        let got: Vec<(u64, u64, u64)> = ops.iter().map(|o| (o.wait, o.seq, o.base)).collect();
        assert_eq!(
            got,
            vec![(0xd0, 5, 0), (0, 5, 0xa0), (0xe0, 6, 0xb0)],
            "the first copy waits for done, the last flags the release, one value per job"
        );
        assert!(ops.iter().all(|o| o.nblocks == OUT_BLOCKS as i32));
    }

    /// A job of `bytes` copied back from offset 0 of its buffer to 0x9000.
    fn job(bytes: usize) -> Staged {
        Staged {
            bytes,
            dtod: Vec::new(),
            to_host: Vec::new(),
            to_device: vec![crate::cuda::pinned_plan::Copy {
                dev: 0x9000,
                off: 0,
                bytes,
            }],
            map: Vec::new(),
            ops: Vec::new(),
            per_op: false,
            after_previous: false,
            reduce_out: None,
        }
    }

    /// A job whose copy out reduces 1000 f32 of its own at 0x7000 with two
    /// received parts at offsets 4096 and 12288 of its buffer into 0x9000.
    fn reducing_job() -> Staged {
        Staged {
            to_device: Vec::new(),
            reduce_out: Some(ReduceOut {
                dst: 0x9000,
                own: 0x7000,
                received: Received {
                    from: vec![4096, 12288],
                    count: 1000,
                    dtype: DataType::F32,
                    op: ReduceOp::Sum,
                },
            }),
            ..job(16384)
        }
    }

    fn lease(k: u64) -> Lease {
        Lease {
            data: std::ptr::null_mut(),
            dev_data: k << 20,
            words: (k << 20, (k << 20) + 4, (k << 20) + 8),
            slot_words: ((k << 20) + 64, (k << 20) + 192),
            flags: crate::cuda::pinned::JobFlags::on(std::ptr::null_mut()),
        }
    }

    #[test]
    fn several_jobs_copy_back_in_one_waiting_launch_a_single_one_after_the_streams_wait() {
        let kernel = Copier::KERNEL;
        let (a, b) = (job(64 << 20), job(64 << 20));
        let (la, lb) = (lease(1), lease(2));
        // Slices: one launch of OUT_BLOCKS blocks, each job's first copy
        // waiting for its done word, its release flagged by as many blocks
        // as Pool::take was told.
        let (pieces, blocks) = kernel.out_pieces(&[(&a, &la, 5), (&b, &lb, 6)]);
        assert_eq!(blocks, OUT_BLOCKS);
        assert_eq!(kernel.slots_for(&a, 2).1, blocks);
        assert!(pieces.iter().all(|p| p.how == Mover::Kernel));
        let waits: Vec<_> = pieces.iter().map(|p| p.wait).collect();
        assert_eq!(waits, vec![Some((la.words.1, 5)), Some((lb.words.1, 6))]);
        // One job: the stream waits (an empty engine piece), then SLOTS
        // blocks copy without waiting themselves.
        let (pieces, blocks) = kernel.out_pieces(&[(&a, &la, 7)]);
        assert_eq!(blocks, SLOTS);
        assert_eq!(kernel.slots_for(&a, 1).1, blocks);
        assert_eq!(
            (pieces[0].how, pieces[0].bytes, pieces[0].wait),
            (Mover::Engine, 0, Some((la.words.1, 7)))
        );
        assert_eq!((pieces[1].how, pieces[1].wait), (Mover::Kernel, None));
        assert_eq!(pieces[1].signal, Some(Signal::Slots(la.slot_words.1, 7)));
    }

    /// A sliced call on the kernel is one launch: every job's copies in on
    /// all SLOTS blocks (each flagging its ready slot), then its copies
    /// back on the first OUT_BLOCKS blocks only, each waiting for its job's
    /// done; a single job, the engines, or more pieces than one launch
    /// holds go as before.
    #[test]
    fn a_sliced_calls_copies_in_and_back_are_one_launch_when_they_fit() {
        let kernel = Copier::KERNEL;
        let mut to_host = job(64 << 20);
        to_host.to_host = to_host.to_device.clone();
        let (a, b) = (to_host.clone(), to_host.clone());
        let (la, lb) = (lease(1), lease(2));
        let jobs = [(&a, &la, 5), (&b, &lb, 6)];
        let c = kernel.copies(&jobs);
        assert!(c.at_once, "one launch");
        let ops = c.ops_at_once();
        let kinds: Vec<(i32, u64, u64)> = ops.iter().map(|o| (o.nblocks, o.wait, o.seq)).collect();
        assert_eq!(
            kinds,
            vec![
                (SLOTS as i32, 0, 5),
                (SLOTS as i32, 0, 6),
                (OUT_BLOCKS as i32, la.words.1, 5),
                (OUT_BLOCKS as i32, lb.words.1, 6),
            ]
        );
        // Ins flag the ready slots, outs the released ones.
        assert_eq!(ops[0].base, la.slot_words.0);
        assert_eq!(ops[3].base, lb.slot_words.1);
        // A single job: no.
        assert!(!kernel.copies(&jobs[..1]).at_once);
        // The engines: no.
        let engines = Copier::ENGINES;
        assert!(!engines.copies(&jobs).at_once);
        // More pieces than one launch holds: no.
        let mut wide = to_host.clone();
        wide.to_host = vec![wide.to_host[0]; MAX_P2P];
        assert!(!kernel.copies(&[(&wide, &la, 5), (&b, &lb, 6)]).at_once);
    }
}
