//! Kernel launch: turns a [`Plan`] (or a round of point-to-point pieces)
//! into the kernel's arguments and enqueues it on the caller's stream. The
//! only place that advances a communicator's sequence numbers, LL history
//! and point-to-point counters, which every rank must advance alike.

use super::abi::{
    Args, CHAIN_FIFO, CHAIN_LINES, FLAG_AREA, K_ALLGATHER, K_ALLREDUCE, K_BROADCAST,
    K_LOCAL_REDUCE, K_REDUCE, LINES_AREA, LL_SLOT, MAX_BLOCKS, MAX_P2P, MAX_RANKS, P2P_COPY,
    P2P_RECV, P2P_SEND, P2pArgs, P2pOp,
};
use super::devcomm::DevComm;
use super::driver::use_device;
use super::error::{CudaResult, check};
use super::kernels::{P2P_KERNEL, function};
use super::ll::ll_peers;
use super::p2p::{P2p, P2pFifo, p2p_rounds};
use super::plan::Plan;
use cudarc::driver::sys;
use std::ffi::c_void;

impl DevComm {
    /// Enqueues the plan's kernel on `stream` (asynchronous).
    ///
    /// # Safety
    /// The plan's buffers must be device memory of this rank's device, valid
    /// until the stream reaches the kernel's end; every rank must launch the
    /// same sequence of plans.
    pub unsafe fn launch(&mut self, p: &Plan, stream: *mut c_void) -> CudaResult<()> {
        if p.count == 0 {
            return Ok(());
        }
        if p.copy {
            return unsafe { self.launch_copy(p, stream) };
        }
        let f = function(self.dev, p.func)?;
        use_device(self.dev)?;
        let (blocks, mut a, seqs) = if p.ll {
            self.ll_args(p)
        } else if p.chain == CHAIN_LINES {
            self.lines_args(p)
        } else if p.chain == CHAIN_FIFO {
            self.chain_args(p)
        } else {
            self.direct_or_staged_args(p)
        };
        self.seq += seqs;
        let threads = self.tuning.threads as u32;
        unsafe {
            launch_kernel(
                f,
                blocks as u32,
                threads,
                &mut a,
                stream as sys::CUstream,
                "cuLaunchKernel",
            )
        }
    }

    /// A one-rank collective: the input copied to the output on `stream`
    /// (nothing in place). No kernel, so no sequence number is used.
    unsafe fn launch_copy(&mut self, p: &Plan, stream: *mut c_void) -> CudaResult<()> {
        if p.input == p.output {
            return Ok(());
        }
        use_device(self.dev)?;
        unsafe {
            check(
                sys::cuMemcpyDtoDAsync_v2(
                    p.output,
                    p.input,
                    p.count * p.elem,
                    stream as sys::CUstream,
                ),
                "cuMemcpyDtoDAsync (one-rank collective)",
            )
        }
    }

    /// Arguments of a chain kernel: (blocks, args, sequence numbers used).
    /// One sequence number: the entry barrier's value and the tag of the
    /// tails and credits.
    fn chain_args(&self, p: &Plan) -> (usize, Args, u64) {
        let bytes = p.count * p.elem;
        let shape = self.tuning.chain_shape(bytes, 2 * self.parity_bytes);
        let mut a = self.args(p, false, false);
        a.chain = CHAIN_FIFO;
        a.step = shape.step as u64;
        a.slots = shape.slots as u64;
        (shape.blocks, a, 1)
    }

    /// Arguments of an LL one-shot: no sequence number (it has no barrier),
    /// the next LL flag and parity half; a block per 512 vectors of 16 data
    /// bytes of a part, at most 32 (all resident at once: a thread waits only
    /// for its peers' pushes, never for another block of its own). The count
    /// ignores `WEFT_CUDA_THREADS` (the kernel strides over the vectors with
    /// whatever it gets), so every rank launches the same blocks, which the
    /// reuse check (`LlHistory`) counts.
    fn ll_args(&mut self, p: &Plan) -> (usize, Args, u64) {
        let vecs = (p.count * p.elem).div_ceil(16);
        let blocks = vecs.div_ceil(512).clamp(1, 32.min(self.tuning.block_cap));
        let k = self.ll.ops;
        let (sends, receives) = ll_peers(p.kind, p.root as usize, self.rank, self.nranks);
        let (check, need) = self.ll.next(sends, receives, blocks as u64);
        let mut a = self.args(p, false, false);
        // Never 0 (the area's initial zeros); consecutive values differ.
        a.ll = k % u32::MAX as u64 + 1;
        a.ll_off =
            (2 * self.parity_bytes + LINES_AREA + (k as usize & 1) * MAX_RANKS * LL_SLOT) as u64;
        a.ll_check = check;
        a.ll_need = need;
        (blocks, a, 0)
    }

    /// Arguments of a lines chain: one sequence number, the tag of its flags
    /// and credits (no barrier).
    fn lines_args(&self, p: &Plan) -> (usize, Args, u64) {
        let (blocks, window) = self
            .tuning
            .lines_shape(p.count * p.elem, self.tuning.threads);
        let mut a = self.args(p, false, false);
        a.chain = CHAIN_LINES;
        a.slots = window as u64;
        (blocks, a, 1)
    }

    /// Arguments of the other kernels: direct (every rank in this process,
    /// user buffers in place) or staged through scratch in chunks.
    fn direct_or_staged_args(&self, p: &Plan) -> (usize, Args, u64) {
        let direct = self.direct && p.kind != K_ALLREDUCE;
        // Ranks in other processes read our scratch: end with a barrier so the
        // area is reusable (and can be freed) once the stream is done.
        let exit_barrier = !self.direct && !direct;
        let chunk = (self.parity_bytes / p.parts / p.elem) / 16 * 16;
        let chunk = chunk.max(16);
        // A direct kernel uses three barrier values: two sequence numbers.
        let seqs = if direct {
            2
        } else {
            p.count.div_ceil(chunk) as u64 + exit_barrier as u64
        };
        let m = if direct { p.count } else { p.count.min(chunk) };
        let bytes = p.count * p.elem;
        let bcast = self.tuning.bcast_algo(bytes);
        let blocks = self
            .tuning
            .blocks(p.kind, bcast, direct, self.nranks, m * p.elem * p.parts);
        let mut a = self.args(p, direct, exit_barrier);
        a.chunk = chunk as u64;
        a.bcast = bcast;
        a.step = match p.kind {
            K_REDUCE => self.tuning.reduce_chunk(bytes, blocks, self.nranks),
            K_BROADCAST => self.tuning.bcast_step(bytes, blocks, self.nranks, bcast),
            _ => 0,
        } as u64;
        (blocks, a, seqs)
    }

    /// The arguments every kernel shares: buffers, ranks, sequence, flags.
    fn args(&self, p: &Plan, direct: bool, exit_barrier: bool) -> Args {
        let (flags, scratch) = self.peer_areas();
        Args {
            scratch,
            flags,
            input: p.input,
            output: p.output,
            count: p.count as u64,
            chunk: 0,
            seq_base: self.seq + 1,
            rank: self.rank as i32,
            nranks: self.nranks as i32,
            kind: p.kind,
            root: p.root,
            parity_bytes: self.parity_bytes as u64,
            direct: direct as i32,
            push: self.tuning.push.unwrap_or(p.kind == K_ALLGATHER) as i32,
            status: self.status as u64,
            exit_barrier: exit_barrier as i32,
            bcast: 0,
            step: 0,
            chain: 0,
            slots: 0,
            ll: 0,
            ll_off: 0,
            ll_check: 0,
            ll_need: 0,
        }
    }

    /// Every rank's flag area and scratch as mapped here (kernel arguments).
    fn peer_areas(&self) -> ([u64; MAX_RANKS], [u64; MAX_RANKS]) {
        let mut flags = [0; MAX_RANKS];
        let mut scratch = [0; MAX_RANKS];
        for r in 0..self.nranks {
            flags[r] = self.peers[r];
            scratch[r] = self.peers[r] + FLAG_AREA as u64;
        }
        (flags, scratch)
    }

    /// Enqueues a group's point-to-point pieces on `stream`: one kernel per
    /// round (see `p2p_rounds` in `p2p.rs`).
    ///
    /// # Safety
    /// As [`DevComm::launch`]; every peer must post the matching pieces.
    pub unsafe fn launch_p2p(&mut self, pieces: &[P2p], stream: *mut c_void) -> CudaResult<()> {
        let rounds = p2p_rounds(pieces, self.rank)?;
        if rounds.iter().all(|r| r.is_empty()) {
            return Ok(());
        }
        let f = function(self.dev, P2P_KERNEL)?;
        use_device(self.dev)?;
        let max_per = self.tuning.p2p_blocks;
        let fifo = P2pFifo::new(2 * self.parity_bytes, self.nranks, self.tuning.block_cap);
        let (flags, scratch) = self.peer_areas();
        for round in rounds {
            let mut a = P2pArgs {
                flags,
                status: self.status as u64,
                rank: self.rank as i32,
                nops: 0,
                ops: [P2pOp::default(); MAX_P2P],
                scratch,
                region: fifo.region as u64,
                step: fifo.step as u64,
                slots: fifo.slots as u64,
                direct: self.direct as i32,
            };
            let movers = round
                .iter()
                .filter(|p| !matches!(p, P2p::Send { .. }))
                .count()
                .max(1);
            // Receives and copies share about 160 blocks (or the cap).
            let cap = (160.min(self.tuning.block_cap) / movers).clamp(1, max_per);
            let mut blocks = 0i32;
            for p in &round {
                let op = match *p {
                    P2p::Send { peer, ptr, bytes } => {
                        self.send_seq[peer] += 1;
                        P2pOp {
                            ptr,
                            bytes: bytes as u64,
                            seq: self.send_seq[peer],
                            peer: peer as i32,
                            kind: P2P_SEND,
                            // Across processes the sender does the copying.
                            nblocks: if self.direct { 1 } else { fifo.blocks as i32 },
                            ..Default::default()
                        }
                    }
                    P2p::Recv { peer, ptr, bytes } => {
                        self.recv_seq[peer] += 1;
                        // Across processes both sides use the same blocks (a
                        // sender's block b fills receiver block b's slots),
                        // whatever the size, so a size mismatch is detected
                        // instead of waited on.
                        let nb = if self.direct {
                            bytes.div_ceil(256 << 10).clamp(1, cap)
                        } else {
                            fifo.blocks
                        };
                        let base = self.recv_blocks[peer];
                        if self.direct {
                            self.recv_blocks[peer] += nb as u64;
                        }
                        P2pOp {
                            ptr,
                            bytes: bytes as u64,
                            seq: self.recv_seq[peer],
                            base,
                            peer: peer as i32,
                            kind: P2P_RECV,
                            nblocks: nb as i32,
                            ..Default::default()
                        }
                    }
                    P2p::Copy { dst, src, bytes } => P2pOp {
                        ptr: dst,
                        src,
                        bytes: bytes as u64,
                        kind: P2P_COPY,
                        nblocks: bytes.div_ceil(256 << 10).clamp(1, cap) as i32,
                        ..Default::default()
                    },
                };
                let i = a.nops as usize;
                a.ops[i] = P2pOp {
                    block0: blocks,
                    ..op
                };
                blocks += op.nblocks;
                a.nops += 1;
            }
            unsafe {
                launch_kernel(
                    f,
                    blocks as u32,
                    MAX_THREADS,
                    &mut a,
                    stream as sys::CUstream,
                    "weft_p2p",
                )?
            };
        }
        Ok(())
    }
}

/// Threads of a block at most: every kernel's `__launch_bounds__(512)`
/// (kernels/collectives.cu); the point-to-point, copy and local-reduction
/// launches take all of them.
pub(super) const MAX_THREADS: u32 = 512;

/// Launches reducing kernel `func` on `stream` as a local reduction
/// (`K_LOCAL_REDUCE`): `dst[i] = op(srcs[0][i], srcs[1][i], ...)` for
/// `count` elements, on `blocks` blocks of [`MAX_THREADS`]. The sources
/// may be device memory or device-mapped pinned memory: the cross-host
/// path's reduce-scatter and all-reduce (`pinned_copy.rs`).
///
/// # Safety
/// Every address is valid for `count` elements until the stream passes
/// the kernel; `srcs` holds 1 to [`MAX_RANKS`] of them.
pub(super) unsafe fn launch_local_reduce(
    dev: i32,
    func: &'static str,
    srcs: &[u64],
    dst: u64,
    count: usize,
    blocks: usize,
    stream: sys::CUstream,
) -> CudaResult<()> {
    debug_assert!((1..=MAX_RANKS).contains(&srcs.len()));
    if count == 0 {
        return Ok(());
    }
    let f = function(dev, func)?;
    let mut scratch = [0u64; MAX_RANKS];
    scratch[..srcs.len()].copy_from_slice(srcs);
    let blocks = blocks.clamp(1, MAX_BLOCKS);
    let mut a = Args {
        scratch,
        output: dst,
        count: count as u64,
        nranks: srcs.len() as i32,
        kind: K_LOCAL_REDUCE,
        ..Args::default()
    };
    unsafe {
        launch_kernel(
            f,
            blocks as u32,
            MAX_THREADS,
            &mut a,
            stream,
            "cuLaunchKernel (a cross-host reduce-scatter's reduction on the GPU)",
        )
    }
}

/// Launches kernel `f` with its one argument struct `a` (`Args` or
/// `P2pArgs`, by value as the kernel declares it) on `stream`: `blocks`
/// blocks of `threads` threads, no dynamic shared memory; `what` is the
/// call as an error names it. The one place a kernel is launched.
///
/// # Safety
/// `a` is the kernel's argument type and describes memory valid until the
/// stream passes the kernel.
pub(super) unsafe fn launch_kernel<A>(
    f: sys::CUfunction,
    blocks: u32,
    threads: u32,
    a: &mut A,
    stream: sys::CUstream,
    what: &'static str,
) -> CudaResult<()> {
    let mut params = [(a as *mut A).cast::<c_void>()];
    unsafe {
        check(
            sys::cuLaunchKernel(
                f,
                blocks,
                1,
                1,
                threads,
                1,
                1,
                0,
                stream,
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            ),
            what,
        )
    }
}
