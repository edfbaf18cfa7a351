//! The kernel path's tuning: every `WEFT_CUDA_*` variable (and the device
//! algorithm `WEFT_ALGO` names, through the tuner's one parser of it,
//! `tuner::device_override`), read in one place into [`Tuning`],
//! and the size rules that pick an algorithm and cut the work (LL, lines
//! chain, FIFO chain, broadcast pipeline, blocks per kernel).
//!
//! A `Tuning` is built once per communicator, when its device side is created
//! (as NCCL reads its variables at init). The rules are pure functions of it,
//! so every rank that sees the same environment decides the same.

use crate::op::tuner;
use weft_contract::params::{self, Param};

use super::abi::{
    BCAST_RING, BCAST_SCATTER, K_ALLGATHER, K_ALLTOALL, K_BROADCAST, K_REDUCE, LINES_AREA,
    LINES_ITER_BYTES, LINES_ITER_DATA, LINES_MAX_WARPS, LINES_MAX_WINDOW, LL_MAX_BYTES, MAX_BLOCKS,
};

/// Parts up to this many bytes run as LL one-shots across processes by
/// default (see [`Tuning::ll`]): all the slots hold. On 4 x H200 (mpirun,
/// docs/PERFORMANCE-GPU.md) LL beat the staged path at every size up to
/// there (all-reduce 128 KiB: 10.9 us against 18.6, NCCL 11.4).
const LL_DEFAULT_MAX: usize = LL_MAX_BYTES;

/// A size given in KiB by `p`, in bytes; None when unset or unparsable (a
/// bad value is reported once on stderr).
fn env_kb(p: Param<usize>) -> Option<usize> {
    p.get().map(|kb| kb << 10)
}

/// Kernel knobs read once per communicator from the environment (as NCCL
/// reads its variables at init; every rank of a direct-mode communicator is
/// in one process, so they agree). The defaults are what measured fastest on
/// 4 x H200 (docs/PERFORMANCE-GPU.md).
#[derive(Clone, Copy, Debug)]
pub(super) struct Tuning {
    /// `WEFT_CUDA_SCRATCH_MB` (32, at least 1), in bytes: scratch per parity
    /// half of each rank's area (set alike on every rank).
    pub(super) parity_bytes: usize,
    /// `WEFT_CUDA_DIRECT=0` keeps ranks of one process from reading each
    /// other's buffers in place (they then stage through scratch as across
    /// processes).
    pub(super) allow_direct: bool,
    /// `WEFT_CUDA_ALGO`, else `WEFT_ALGO` when it names a device algorithm.
    pub(super) algo: Option<&'static str>,
    /// `WEFT_CUDA_ONESHOT_MAX`: one-shot all-reduce up to this many bytes.
    pub(super) oneshot_max: usize,
    /// `WEFT_CUDA_THREADS`: threads per block of the collective kernels.
    pub(super) threads: usize,
    /// `WEFT_CUDA_P2P_BLOCKS`: blocks per receive in point-to-point kernels.
    pub(super) p2p_blocks: usize,
    /// `WEFT_CUDA_PUSH`: direct copies write into the peers' buffers (`1`
    /// for every copying collective, `0` for none); unset, all-gather only
    /// (it measured faster pushing, 0.97 against 0.94 of NCCL at 2 GB on
    /// 4 x H200; all-to-all too, but pushing into a peer's buffer races with
    /// that peer reading the same place when the call is in place).
    pub(super) push: Option<bool>,
    /// `WEFT_CUDA_BCAST`: ring | scatter; unset, by size.
    pub(super) bcast: Option<i32>,
    /// `WEFT_CUDA_BCAST_RING_MB`: direct broadcasts from this size use the ring.
    pub(super) ring_from: usize,
    /// `WEFT_CUDA_BCAST_STEP`: pipeline step in bytes; 0 = by size.
    pub(super) step: usize,
    /// `WEFT_CUDA_REDUCE_CHUNK`: bytes per chunk of a direct reduce, at most.
    pub(super) reduce_chunk: usize,
    /// `WEFT_CUDA_BLOCKS`: blocks per kernel at most; 0 = by collective.
    pub(super) blocks: usize,
    /// `WEFT_CUDA_CHAIN_MIN_KB`: broadcast and reduce of at least this many
    /// bytes run as a chain through FIFO slots; None = by mode and
    /// collective (see [`Tuning::chain`]).
    pub(super) chain_min: Option<usize>,
    /// `WEFT_CUDA_CHAIN_STEP_KB`: bytes per chain slot, at most.
    pub(super) chain_step: usize,
    /// `WEFT_CUDA_CHAIN_DEPTH`: steps per block the slot size aims for.
    pub(super) chain_depth: usize,
    /// `WEFT_CUDA_CHAIN_SLOTS`: slots per block, at most.
    pub(super) chain_slots: usize,
    /// `WEFT_CUDA_CHAIN_BLOCKS`: blocks of a chain kernel.
    pub(super) chain_blocks: usize,
    /// `WEFT_CUDA_LINES=0` turns the lines chain off.
    pub(super) lines: bool,
    /// `WEFT_CUDA_LINES_MIN_KB` / `WEFT_CUDA_LINES_MAX_KB`: broadcast and
    /// reduce with at least `lines_min` and less than `lines_max` bytes run
    /// as a lines chain where every link allows it; None = by mode (see
    /// [`Tuning::lines`]).
    pub(super) lines_min: Option<usize>,
    pub(super) lines_max: Option<usize>,
    /// `WEFT_CUDA_LINES_BLOCKS`: blocks of a lines kernel at most (128: the
    /// link stays busy only with about 2048 warps' windows in flight; 64
    /// blocks measured 0.88 of NCCL at 128 MB - 2 GB, 128 blocks 0.92-0.95).
    pub(super) lines_blocks: usize,
    /// `WEFT_CUDA_LINES_WINDOW`: iterations in flight per warp at most
    /// (2 - 16; small ones make senders wait for credits, as tests want).
    pub(super) lines_window: usize,
    /// `WEFT_CUDA_LL_MAX_KB`: operations whose parts are at most this many
    /// bytes run as an LL one-shot (at most `LL_MAX_BYTES`); None = by mode
    /// (see [`Tuning::ll`]).
    pub(super) ll_max: Option<usize>,
    /// Blocks of any kernel at most: `MAX_BLOCKS`, less where several ranks
    /// of the communicator share a GPU in one process (their kernels must
    /// all be resident at once: see `residency_cap` in `mapping.rs`). Not a
    /// variable: every rank derives it from the gathered descriptors.
    pub(super) block_cap: usize,
}

/// How a chain kernel cuts the work (every rank computes the same).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct ChainShape {
    pub(super) blocks: usize,
    pub(super) step: usize,
    pub(super) slots: usize,
}

impl Tuning {
    pub(super) fn from_env() -> Tuning {
        // Case-sensitive, as it always was.
        let bcast = match params::WEFT_CUDA_BCAST.raw().as_deref() {
            Some("ring") => Some(BCAST_RING),
            Some("scatter") => Some(BCAST_SCATTER),
            _ => None,
        };
        Tuning {
            parity_bytes: params::WEFT_CUDA_SCRATCH_MB.value().max(1) << 20,
            allow_direct: params::WEFT_CUDA_DIRECT.get().unwrap_or(true),
            algo: tuner::device_override(),
            oneshot_max: params::WEFT_CUDA_ONESHOT_MAX.value(),
            threads: params::WEFT_CUDA_THREADS.value().clamp(32, 512),
            p2p_blocks: params::WEFT_CUDA_P2P_BLOCKS.value().clamp(1, MAX_BLOCKS),
            // Set but empty (or any value but 1): Some(false).
            push: params::WEFT_CUDA_PUSH.raw().map(|v| v == "1"),
            bcast,
            ring_from: params::WEFT_CUDA_BCAST_RING_MB.value() << 20,
            step: params::WEFT_CUDA_BCAST_STEP.value(),
            reduce_chunk: params::WEFT_CUDA_REDUCE_CHUNK.value().max(512) / 16 * 16,
            blocks: params::WEFT_CUDA_BLOCKS.value().min(MAX_BLOCKS),
            chain_min: env_kb(params::WEFT_CUDA_CHAIN_MIN_KB),
            chain_step: (params::WEFT_CUDA_CHAIN_STEP_KB.value() << 10).max(16),
            chain_depth: params::WEFT_CUDA_CHAIN_DEPTH.value().max(1),
            chain_slots: params::WEFT_CUDA_CHAIN_SLOTS.value().max(2),
            chain_blocks: params::WEFT_CUDA_CHAIN_BLOCKS.value().clamp(1, MAX_BLOCKS),
            lines: params::WEFT_CUDA_LINES.get().unwrap_or(true),
            lines_min: env_kb(params::WEFT_CUDA_LINES_MIN_KB),
            lines_max: env_kb(params::WEFT_CUDA_LINES_MAX_KB),
            lines_blocks: params::WEFT_CUDA_LINES_BLOCKS.value().clamp(1, MAX_BLOCKS),
            lines_window: params::WEFT_CUDA_LINES_WINDOW
                .value()
                .clamp(2, LINES_MAX_WINDOW),
            ll_max: env_kb(params::WEFT_CUDA_LL_MAX_KB),
            block_cap: MAX_BLOCKS,
        }
    }

    /// Caps the blocks of every kernel at `cap` (see `block_cap`).
    pub(super) fn cap_blocks(&mut self, cap: usize) {
        let cap = cap.clamp(1, MAX_BLOCKS);
        self.block_cap = cap;
        self.chain_blocks = self.chain_blocks.min(cap);
        self.lines_blocks = self.lines_blocks.min(cap);
        self.p2p_blocks = self.p2p_blocks.min(cap);
        if self.blocks > 0 {
            self.blocks = self.blocks.min(cap);
        }
    }

    /// Whether an operation whose parts are `bytes` each runs as an LL
    /// one-shot (`ll_oneshot` in collectives.cu: one push of lines that carry
    /// their own flags, no barrier). By default for ranks in other processes,
    /// up to `LL_DEFAULT_MAX`, where the staged path's barrier round, remote
    /// read and exit barrier cost more than the data; ranks in one process
    /// read each other's buffers in place (no staging copy to save) and keep
    /// the direct kernels unless `WEFT_CUDA_LL_MAX_KB` or `WEFT_ALGO=ll` says
    /// otherwise. Any other algorithm override turns it off.
    pub(super) fn ll(&self, bytes: usize, nranks: usize, direct: bool) -> bool {
        let max = match self.algo {
            Some("ll") => LL_MAX_BYTES,
            Some(_) => return false,
            None => self
                .ll_max
                .unwrap_or(if direct { 0 } else { LL_DEFAULT_MAX }),
        };
        nranks >= 2 && bytes > 0 && bytes <= max.min(LL_MAX_BYTES)
    }

    /// Whether a broadcast or reduce of `bytes` runs as a lines chain, given
    /// that every link allows it (`capable`, agreed by all ranks): below
    /// 256 MiB by default. On 4 x H200 it beat every other algorithm there
    /// (about 20 us up to 2 MB against NCCL's 24-36; 0.95 of NCCL at 128 MB,
    /// against 0.85-0.87 for the FIFO chain and the in-place algorithms),
    /// while its 8 flag bytes per 128 cap it at 120/128 of the link: from
    /// 512 MB the FIFO chain is faster (340 against 332 GB/s).
    pub(super) fn lines(&self, kind: i32, bytes: usize, nranks: usize, capable: bool) -> bool {
        let min = self.lines_min.unwrap_or(0);
        let max = self.lines_max.unwrap_or(256 << 20);
        capable
            && self.lines
            && matches!(kind, K_BROADCAST | K_REDUCE)
            && nranks >= 2
            && (min..max).contains(&bytes)
    }

    /// Blocks and window (iterations per warp) of a lines chain over `bytes`
    /// with `threads` threads per block: as many warps as there are
    /// iterations, up to `lines_blocks` blocks and `LINES_MAX_WARPS` warps,
    /// each warp's window an equal share of the lines area (at most
    /// `lines_window` iterations, at least 2).
    pub(super) fn lines_shape(&self, bytes: usize, threads: usize) -> (usize, usize) {
        let warps_per_block = (threads / 32).max(1);
        let iters = bytes.div_ceil(LINES_ITER_DATA).max(1);
        let blocks = iters
            .div_ceil(warps_per_block)
            .min(self.lines_blocks)
            .min(LINES_MAX_WARPS / warps_per_block)
            .max(1);
        let window = (LINES_AREA / (blocks * warps_per_block) / LINES_ITER_BYTES)
            .clamp(2, self.lines_window);
        (blocks, window)
    }

    /// Whether a broadcast or reduce of `bytes` runs as a FIFO chain (asked
    /// only when the lines chain is not taken: see [`Tuning::lines`]). Ranks in
    /// other processes chain from 8 MiB (at 256 MB the chain measured 0.88-0.91
    /// of NCCL against 0.34 staging through the root's scratch; both about
    /// 0.5 at 8 MB, staging ahead below). Ranks in one process chain where it measured
    /// faster than reading the user buffers in place on 4 x H200
    /// (docs/PERFORMANCE-GPU.md): broadcast from 64 MiB (32 MB: 209 against
    /// 228 GB/s, 128 MB: 284 against 267), reduce from 256 MiB (128 MB: 277
    /// against 295, 512 MB: 336 against 311); below, the chain's fixed cost
    /// (55-75 us over NCCL, not explained by the one-step-per-hop fill:
    /// step ramps measured slower) outweighs what it saves.
    pub(super) fn chain(&self, kind: i32, bytes: usize, nranks: usize, direct: bool) -> bool {
        let min = self.chain_min.unwrap_or(match (direct, kind) {
            (false, _) => 8 << 20,
            (true, K_BROADCAST) => 64 << 20,
            (true, _) => 256 << 20,
        });
        matches!(kind, K_BROADCAST | K_REDUCE) && nranks >= 2 && bytes >= min
    }

    /// Blocks, slot size and slots of a chain over `bytes`, with `scratch`
    /// bytes of scratch per rank: `chain_depth` (8) steps per block (the
    /// pipeline fills in one step per hop; 16 or more measured slower: each
    /// step costs a fence and a flag hand-off) of at most `chain_step`
    /// (128 KiB), 128 blocks (the link stays busy only with about 16 MB in
    /// flight: 64 blocks reached 332 GB/s at 2 GB, 128 358); slots as many
    /// as fit, at most `chain_slots`, at least two.
    pub(super) fn chain_shape(&self, bytes: usize, scratch: usize) -> ChainShape {
        let blocks = self.chain_blocks.min(bytes.div_ceil(4 << 10)).max(1);
        let per_block = scratch / blocks;
        let step = (bytes / blocks / self.chain_depth)
            .clamp(4 << 10, self.chain_step.max(4 << 10))
            .min(per_block / 2)
            / 16
            * 16;
        let step = step.max(16);
        let slots = (per_block / step).clamp(2, self.chain_slots);
        ChainShape {
            blocks,
            step,
            slots,
        }
    }

    /// Blocks per kernel at most. In direct mode the copying collectives
    /// and reduce use every SM's worth (128 measured 3-6% faster than 64 at
    /// 512 MB - 2 GB); all-reduce, reduce-scatter and the ring broadcast
    /// measured no faster. In scratch mode (ranks in other processes) every
    /// block reads each peer's scratch, so what keeps NVLink busy is blocks
    /// x peers: 64 blocks with 3 peers measured best on 4 x H200, while with
    /// one peer (two ranks) 64 left it idle: on 2 x H200, one process per
    /// GPU, 128 blocks moved 7-17% more from 16 MiB to 1 GiB (all-reduce 1
    /// GiB 300-304 against 280-285 GB/s, all-gather 256 MiB 281-283 against
    /// 245, reduce-scatter 253-258 against 224; docs/PERFORMANCE-GPU.md).
    /// Every rank must launch the same number (block b waits on block b of
    /// its peers): `WEFT_CUDA_BLOCKS` must be set alike.
    pub(super) fn max_blocks(&self, kind: i32, bcast: i32, direct: bool, nranks: usize) -> usize {
        if self.blocks > 0 {
            return self.blocks;
        }
        let by_kind = match kind {
            _ if !direct && nranks <= 2 => 128,
            _ if !direct => 64,
            K_REDUCE | K_ALLGATHER | K_ALLTOALL => 128,
            K_BROADCAST if bcast == BCAST_SCATTER => 128,
            _ => 64,
        };
        by_kind.min(self.block_cap)
    }

    /// Blocks of a direct or staged kernel moving `bytes` per chunk (all
    /// its parts): one per 32 KiB up to 64 blocks, and in scratch mode
    /// beyond 64 (two ranks: [`Tuning::max_blocks`]) only as blocks of at
    /// least 64 KiB each: at 4 MiB, 128 blocks of 32 KiB measured 5% slower
    /// than 64 (reduce-scatter, all-to-all; each block pays its barriers).
    pub(super) fn blocks(
        &self,
        kind: i32,
        bcast: i32,
        direct: bool,
        nranks: usize,
        bytes: usize,
    ) -> usize {
        let most = self
            .max_blocks(kind, bcast, direct, nranks)
            .clamp(1, MAX_BLOCKS);
        let by_32k = bytes.div_ceil(32 << 10).clamp(1, most);
        if direct || self.blocks > 0 || most <= 64 {
            return by_32k;
        }
        by_32k.min(64).max(bytes.div_ceil(64 << 10).min(most))
    }

    pub(super) fn bcast_algo(&self, bytes: usize) -> i32 {
        self.bcast.unwrap_or(if bytes >= self.ring_from {
            BCAST_RING
        } else {
            BCAST_SCATTER
        })
    }

    /// The broadcast pipeline step for `bytes` over `blocks` blocks: about
    /// eight steps per block and piece (the pipeline fills in one step per
    /// hop), between 16 and 256 KiB (each step costs a flag hand-off; on
    /// 4 x H200 larger steps measured slower at every size, e.g. the ring at
    /// 2 GB: 318 GB/s with 256 KiB, 298 with 566 KiB).
    pub(super) fn bcast_step(
        &self,
        bytes: usize,
        blocks: usize,
        nranks: usize,
        bcast: i32,
    ) -> usize {
        if self.step > 0 {
            return self.step.div_ceil(16) * 16;
        }
        let pieces = if bcast == BCAST_SCATTER {
            nranks.saturating_sub(1).max(1)
        } else {
            1
        };
        (bytes / blocks.max(1) / pieces / 8 / 16 * 16).clamp(16 << 10, 256 << 10)
    }

    /// The chunk of a direct reduce: `WEFT_CUDA_REDUCE_CHUNK` (256 KiB)
    /// once every block of every helper has a chunk, smaller before (at
    /// 128 KiB - 2 MiB whole 256 KiB chunks left most blocks idle: 2-3x
    /// NCCL's time), never under 512 bytes.
    pub(super) fn reduce_chunk(&self, bytes: usize, blocks: usize, nranks: usize) -> usize {
        let share = bytes.div_ceil(blocks.max(1) * nranks.saturating_sub(1).max(1));
        (share.div_ceil(16) * 16).clamp(512, self.reduce_chunk)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::abi::{K_ALLREDUCE, LL_AREA, LL_SLOT, MAX_RANKS};
    use crate::cuda::kernel_set;

    /// The defaults `Tuning::from_env` gives with no WEFT_CUDA_* set.
    fn defaults() -> Tuning {
        Tuning {
            parity_bytes: 32 << 20,
            allow_direct: true,
            algo: None,
            oneshot_max: 256 << 10,
            threads: 512,
            p2p_blocks: 32,
            push: None,
            bcast: None,
            ring_from: 256 << 20,
            step: 0,
            reduce_chunk: 256 << 10,
            blocks: 0,
            chain_min: None,
            chain_step: 128 << 10,
            chain_depth: 8,
            chain_slots: 8,
            chain_blocks: 128,
            lines: true,
            lines_min: None,
            lines_max: None,
            lines_blocks: 128,
            lines_window: LINES_MAX_WINDOW,
            ll_max: None,
            block_cap: MAX_BLOCKS,
        }
    }

    #[test]
    fn a_block_cap_bounds_every_kernel_shape() {
        let mut t = defaults();
        t.cap_blocks(20);
        for kind in [K_ALLREDUCE, K_REDUCE, K_BROADCAST] {
            for bcast in [BCAST_RING, BCAST_SCATTER] {
                for nranks in [2, 4] {
                    assert!(t.max_blocks(kind, bcast, true, nranks) <= 20);
                    assert!(t.max_blocks(kind, bcast, false, nranks) <= 20);
                    assert!(t.blocks(kind, bcast, false, nranks, 1 << 30) <= 20);
                }
            }
        }
        for bytes in [4 << 10, 1 << 20, 256 << 20, 2 << 30] {
            assert!(t.chain_shape(bytes, 64 << 20).blocks <= 20);
            assert!(t.lines_shape(bytes, 512).0 <= 20);
        }
        assert!(t.p2p_blocks <= 20);
        let mut forced = defaults();
        forced.blocks = 100;
        forced.cap_blocks(7);
        assert_eq!(forced.max_blocks(K_REDUCE, BCAST_RING, false, 4), 7);
        let mut none = defaults();
        none.cap_blocks(MAX_BLOCKS);
        assert_eq!(
            none.max_blocks(K_REDUCE, BCAST_RING, true, 4),
            128,
            "no cap, no change"
        );
    }

    /// The registry's declared defaults are the ones `defaults()` spells out
    /// (skipped when the environment sets a knob).
    #[test]
    fn from_env_without_knobs_is_the_defaults() {
        // Run-time knobs only: WEFT_NVRTC is in the Cuda group but read by the
        // build alone (CI sets it to name the NVRTC it installed).
        let knob = |s: &params::ParamSpec| {
            let runtime = s.parts.contains(&params::Part::Cuda);
            (s.group == params::Group::Cuda && runtime) || s.name == params::WEFT_ALGO.name()
        };
        if params::all().iter().any(|s| knob(s) && s.raw().is_some()) {
            // CI sets none of them: there this check must run, not skip.
            weft_testkit::skip_outside_ci(false, "a WEFT_CUDA_* or WEFT_ALGO variable is set");
            return;
        }
        assert_eq!(
            format!("{:?}", Tuning::from_env()),
            format!("{:?}", defaults())
        );
    }

    #[test]
    fn tuning_defaults_pick_by_size_and_keep_every_block_busy() {
        let t = defaults();
        assert_eq!(t.bcast_algo(32 << 20), BCAST_SCATTER);
        assert_eq!(t.bcast_algo(256 << 20), BCAST_RING);
        assert_eq!(t.max_blocks(K_BROADCAST, BCAST_SCATTER, true, 4), 128);
        assert_eq!(t.max_blocks(K_BROADCAST, BCAST_RING, true, 4), 64);
        assert_eq!(t.max_blocks(K_ALLREDUCE, BCAST_RING, true, 4), 64);
        assert_eq!(t.max_blocks(K_REDUCE, BCAST_RING, false, 4), 64);
        assert_eq!(t.max_blocks(K_ALLREDUCE, BCAST_RING, false, 2), 128);
        // Steps: multiples of 16 within [16 KiB, 256 KiB].
        for bytes in [300_001usize, 32 << 20, 2 << 30] {
            for algo in [BCAST_RING, BCAST_SCATTER] {
                let st = t.bcast_step(bytes, 64, 4, algo);
                assert!(
                    st.is_multiple_of(16) && (16 << 10..=256 << 10).contains(&st),
                    "{bytes}: {st}"
                );
            }
        }
        assert_eq!(t.bcast_step(2 << 30, 64, 4, BCAST_RING), 256 << 10);
        // Reduce: every block of every helper gets a chunk while chunks are
        // small; 256 KiB at most.
        for (bytes, blocks) in [(128usize << 10, 4usize), (2 << 20, 64), (32 << 20, 128)] {
            let c = t.reduce_chunk(bytes, blocks, 4);
            assert!(c.is_multiple_of(16) && c >= 512);
            assert!(bytes.div_ceil(c) >= blocks * 3, "{bytes}: {c}");
        }
        assert_eq!(t.reduce_chunk(2 << 30, 128, 4), 256 << 10);
        let forced = Tuning {
            bcast: Some(BCAST_RING),
            step: 1000,
            blocks: 7,
            ..t
        };
        assert_eq!(forced.bcast_algo(1 << 20), BCAST_RING);
        assert_eq!(forced.bcast_step(1 << 30, 64, 4, BCAST_RING), 1008);
        assert_eq!(forced.max_blocks(K_REDUCE, BCAST_RING, false, 4), 7);
        assert_eq!(forced.blocks(K_ALLREDUCE, BCAST_RING, false, 2, 1 << 30), 7);
    }

    /// Scratch mode with one peer goes past 64 blocks only with 64 KiB or
    /// more per block; with more peers, and in direct mode, one block per
    /// 32 KiB up to the kind's cap, as before.
    #[test]
    fn blocks_grow_past_64_only_for_two_ranks_across_processes_and_large_chunks() {
        let t = defaults();
        let b = |direct, nranks, bytes| t.blocks(K_ALLREDUCE, BCAST_RING, direct, nranks, bytes);
        assert_eq!(b(false, 2, 8), 1);
        assert_eq!(b(false, 2, 1 << 20), 32);
        assert_eq!(b(false, 2, 4 << 20), 64, "128 x 32 KiB measured slower");
        assert_eq!(b(false, 2, 6 << 20), 96);
        assert_eq!(b(false, 2, 8 << 20), 128);
        assert_eq!(b(false, 2, 32 << 20), 128);
        assert_eq!(b(false, 4, 32 << 20), 64, "three peers: 64 as measured");
        assert_eq!(b(true, 2, 32 << 20), 64, "direct all-reduce: its own cap");
        assert_eq!(
            t.blocks(K_ALLGATHER, BCAST_RING, true, 2, 4 << 20),
            128,
            "direct all-gather: one block per 32 KiB up to 128, as before"
        );
    }

    #[test]
    fn ll_is_for_small_parts_across_processes_unless_asked() {
        let t = defaults();
        // Across processes: up to the default, never 0 bytes or one rank.
        assert!(t.ll(8, 4, false));
        assert!(t.ll(256 << 10, 4, false));
        assert!(!t.ll((256 << 10) + 1, 4, false));
        assert!(!t.ll(0, 4, false));
        assert!(!t.ll(8, 1, false));
        // In one process: off unless asked.
        assert!(!t.ll(8, 4, true));
        let asked = Tuning {
            ll_max: Some(100 << 20),
            ..t
        };
        assert!(asked.ll(LL_MAX_BYTES, 4, true));
        assert!(!asked.ll(LL_MAX_BYTES + 1, 4, true), "capped by the slots");
        let forced = Tuning {
            algo: Some("ll"),
            ..t
        };
        assert!(forced.ll(LL_MAX_BYTES, 2, true) && !forced.ll(LL_MAX_BYTES + 16, 2, false));
        let other = Tuning {
            algo: Some("twoshot"),
            ..t
        };
        assert!(!other.ll(8, 4, false));
        // The area holds both parity halves of every sender's largest part.
        assert_eq!(LL_AREA, 2 * MAX_RANKS * 2 * LL_MAX_BYTES);
        let src = kernel_set::COLLECTIVES;
        assert!(src.contains(&format!("#define WEFT_LL_SLOT ({} << 10)", LL_SLOT >> 10)));
    }

    #[test]
    fn lines_shape_fits_the_area_and_the_credit_words() {
        let t = defaults();
        for threads in [32, 256, 512] {
            let warps = threads / 32;
            for bytes in [1usize, 3840, 3841, 1 << 20, 32 << 20, 2 << 30] {
                let (blocks, window) = t.lines_shape(bytes, threads);
                assert!((1..=t.lines_blocks).contains(&blocks), "{bytes}: {blocks}");
                assert!(blocks * warps <= LINES_MAX_WARPS);
                assert!((2..=LINES_MAX_WINDOW).contains(&window));
                assert!(blocks * warps * window * LINES_ITER_BYTES <= LINES_AREA);
                // Enough warps for every iteration of a small message, at
                // once; never more blocks than it has iterations for.
                let iters = bytes.div_ceil(LINES_ITER_DATA);
                assert!(blocks * warps >= iters.min(t.lines_blocks * warps));
                assert!((blocks - 1) * warps < iters.max(1));
            }
        }
        let small = Tuning {
            lines_window: 2,
            lines_blocks: 200,
            ..t
        };
        assert_eq!(small.lines_shape(2 << 30, 512), (128, 2));
        assert_eq!(t.lines_shape(2 << 30, 512), (128, 4));
        // Only broadcast and reduce, only where every link allows it.
        assert!(t.lines(K_BROADCAST, 8, 4, true));
        assert!(t.lines(K_REDUCE, (256 << 20) - 1, 2, true));
        assert!(!t.lines(K_REDUCE, 256 << 20, 2, true));
        assert!(!t.lines(K_REDUCE, 1 << 20, 4, false));
        assert!(!t.lines(K_ALLREDUCE, 1 << 20, 4, true));
        assert!(!t.lines(K_BROADCAST, 1 << 20, 1, true));
        let off = Tuning { lines: false, ..t };
        assert!(!off.lines(K_BROADCAST, 1 << 20, 4, true));
        let band = Tuning {
            lines_min: Some(1 << 10),
            lines_max: Some(1 << 20),
            ..t
        };
        assert!(!band.lines(K_BROADCAST, 1023, 4, true));
        assert!(band.lines(K_BROADCAST, 1 << 10, 4, true));
        assert!(!band.lines(K_BROADCAST, 1 << 20, 4, true));
    }

    #[test]
    fn chain_shape_fits_scratch_and_pipelines() {
        let t = defaults();
        // By mode and collective: ranks in other processes chain from
        // 8 MiB; in one process broadcast from 64 MiB, reduce from 256 MiB;
        // never other collectives or one rank.
        assert!(!t.chain(K_BROADCAST, 256 << 10, 4, false));
        assert!(t.chain(K_BROADCAST, 8 << 20, 4, false));
        assert!(t.chain(K_REDUCE, 8 << 20, 4, false));
        assert!(!t.chain(K_BROADCAST, 32 << 20, 4, true));
        assert!(t.chain(K_BROADCAST, 64 << 20, 4, true));
        assert!(!t.chain(K_REDUCE, 128 << 20, 2, true));
        assert!(t.chain(K_REDUCE, 256 << 20, 2, true));
        assert!(!t.chain(K_ALLREDUCE, 1 << 30, 4, true));
        assert!(!t.chain(K_REDUCE, 1 << 30, 1, true));
        let scratch = 64 << 20;
        for bytes in [256usize << 10, 300_001 * 4, 32 << 20, 2 << 30] {
            let c = t.chain_shape(bytes, scratch);
            assert!(c.step.is_multiple_of(16) && c.step >= 4 << 10 && c.step <= 128 << 10);
            assert!(c.slots >= 2 && c.slots <= 8);
            assert!(c.blocks * c.slots * c.step <= scratch, "{bytes}: {c:?}");
        }
        assert_eq!(
            t.chain_shape(2 << 30, scratch),
            ChainShape {
                blocks: 128,
                step: 128 << 10,
                slots: 4
            }
        );
        // About eight steps per block while steps are under the maximum.
        assert_eq!(t.chain_shape(64 << 20, scratch).step, 64 << 10);
        // A small scratch (WEFT_CUDA_SCRATCH_MB=1) still gets two slots per
        // block.
        let c = t.chain_shape(2 << 30, 2 << 20);
        assert!(
            c.slots == 2 && c.blocks * c.slots * c.step <= 2 << 20,
            "{c:?}"
        );
        let forced = Tuning {
            chain_min: Some(0),
            ..t
        };
        assert!(forced.chain(K_BROADCAST, 4, 2, true));
    }
}
