//! The kernel ABI: the Rust mirror of what `kernels/collectives.cu` declares.
//!
//! The argument structs a launch passes (`Args`, `P2pArgs`), the status word
//! the host shares with every kernel (`Status`), the collective kinds and
//! algorithm codes, and the layout of each rank's peer-visible area (flags,
//! scratch, lines, LL). Each item names its counterpart in the CUDA source;
//! a change on one side must be made on the other (the layout test below
//! checks the struct sizes, the LL test in `tuning.rs` the LL slot).

/// Ranks of a communicator the kernel path serves at most.
pub const MAX_RANKS: usize = 8;
/// Blocks of a collective kernel at most.
pub const MAX_BLOCKS: usize = 128;
/// Bytes of the flag area at the start of every rank's area.
pub(super) const FLAG_AREA: usize = 128 << 10;
/// Bytes of the lines area after the scratch (see `lines_chain` in
/// collectives.cu): every warp's window of the lines chain.
pub(super) const LINES_AREA: usize = 32 << 20;
/// Wire bytes of one warp iteration of the lines chain (`LINES_ITER_WORDS`),
/// and the data they carry (120 of every 128 bytes).
pub(super) const LINES_ITER_BYTES: usize = 4096;
pub(super) const LINES_ITER_DATA: usize = LINES_ITER_BYTES / 128 * 120;
/// Warps of a lines kernel at most (`WEFT_LINES_MAX_WARPS`: credit words).
pub(super) const LINES_MAX_WARPS: usize = 2048;
/// Window of a lines warp in iterations at most.
pub(super) const LINES_MAX_WINDOW: usize = 16;
/// Wire bytes per sender in each parity half of the LL area
/// (`WEFT_LL_SLOT` in collectives.cu): a line of 16 bytes carries 8.
pub(super) const LL_SLOT: usize = 512 << 10;
/// Bytes of the LL area after the lines area: two parity halves of one slot
/// per sender (see `ll_oneshot` in collectives.cu).
pub(super) const LL_AREA: usize = 2 * MAX_RANKS * LL_SLOT;
/// Bytes of one part an LL operation carries at most.
pub(super) const LL_MAX_BYTES: usize = LL_SLOT / 2;
/// `Args::chain` (`WEFT_CHAIN_*` in collectives.cu).
pub(super) const CHAIN_FIFO: i32 = 1;
pub(super) const CHAIN_LINES: i32 = 2;

/// Collective kinds (`Args::kind`; keep in sync with collectives.cu).
pub(super) const K_ALLREDUCE: i32 = 0;
pub(super) const K_ALLREDUCE_2SHOT: i32 = 1;
pub(super) const K_REDUCE: i32 = 2;
pub(super) const K_REDUCESCATTER: i32 = 3;
pub(super) const K_ALLGATHER: i32 = 4;
pub(super) const K_BROADCAST: i32 = 5;
pub(super) const K_ALLTOALL: i32 = 6;
/// A local reduction of `nranks` sources (`Args::scratch`) into `output`.
pub(super) const K_LOCAL_REDUCE: i32 = 7;

/// Direct broadcast algorithms (keep in sync with WEFT_BCAST_* in
/// collectives.cu).
pub(super) const BCAST_RING: i32 = 0;
pub(super) const BCAST_SCATTER: i32 = 1;

/// Must match `struct Args` in kernels/collectives.cu. `Default`: every
/// field 0 (no peers, no algorithm options).
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(super) struct Args {
    pub(super) scratch: [u64; MAX_RANKS],
    pub(super) flags: [u64; MAX_RANKS],
    pub(super) input: u64,
    pub(super) output: u64,
    pub(super) count: u64,
    pub(super) chunk: u64,
    pub(super) seq_base: u64,
    pub(super) rank: i32,
    pub(super) nranks: i32,
    pub(super) kind: i32,
    pub(super) root: i32,
    pub(super) parity_bytes: u64,
    pub(super) direct: i32,
    pub(super) push: i32,
    pub(super) status: u64,
    pub(super) exit_barrier: i32,
    pub(super) bcast: i32,
    pub(super) step: u64,
    pub(super) chain: i32,
    pub(super) slots: u64,
    pub(super) ll: u64,
    pub(super) ll_off: u64,
    pub(super) ll_check: u64,
    pub(super) ll_need: u64,
}

/// Must match `struct Status` in kernels/collectives.cu: host memory mapped
/// into every device. `abort` first (the `AbortWord` points at it) and
/// `timeout_ms` next to it (the kernels read both in one 8-byte load).
#[repr(C)]
pub(super) struct Status {
    /// Set by the host: every spin loop returns.
    pub(super) abort: u32,
    /// `WEFT_TIMEOUT_MS` (0: waits never time out), set by the host.
    pub(super) timeout_ms: u32,
    /// `ERR_*`, reported by a kernel.
    pub(super) error: u32,
    pub(super) pad: u32,
    pub(super) detail: u64,
    /// The address a wait polled for `timeout_ms` without progress (0: none).
    pub(super) stalled: u64,
}

/// Offsets in the flag area (`WEFT_*_OFF`, `WEFT_P2P_*`, `WEFT_LL_COUNT` in
/// collectives.cu), for naming what a stalled wait polls (`stall_site`).
pub(super) const P2P_READY: usize = 8 << 10;
pub(super) const P2P_DONE: usize = 10 << 10;
pub(super) const P2P_TAIL: usize = 12 << 10;
pub(super) const P2P_CRED: usize = 16 << 10;
pub(super) const P2P_RREADY: usize = 20 << 10;
pub(super) const LL_COUNT: usize = 24 << 10;
pub(super) const PROG_OFF: usize = 48 << 10;
pub(super) const CHAIN_TAIL_OFF: usize = 50 << 10;
pub(super) const CHAIN_CRED_OFF: usize = 52 << 10;
pub(super) const LINES_CRED_OFF: usize = 64 << 10;

/// `Status::error` codes (`WEFT_ERR_*`).
pub(super) const ERR_P2P_SIZE: u32 = 1;
pub(super) const ERR_P2P_SIZE_SEND: u32 = 2;

/// Must match `struct P2pOp` / `struct P2pArgs` in kernels/collectives.cu.
pub(super) const MAX_P2P: usize = 16;
pub(super) const P2P_SEND: i32 = 0;
pub(super) const P2P_RECV: i32 = 1;
pub(super) const P2P_COPY: i32 = 2;
/// The cross-host path's sequential copies with per-block flags (the
/// kernel's `P2P_COPY_SEQ`; `pinned_copy.rs`).
pub(super) const P2P_COPY_SEQ: i32 = 3;
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(super) struct P2pOp {
    pub(super) ptr: u64,
    pub(super) src: u64,
    pub(super) bytes: u64,
    pub(super) seq: u64,
    pub(super) base: u64,
    pub(super) peer: i32,
    pub(super) kind: i32,
    pub(super) block0: i32,
    pub(super) nblocks: i32,
    /// `P2P_COPY_SEQ`: the device address of a u32 word to wait on
    /// (>= `seq`) before this op; 0: none.
    pub(super) wait: u64,
}
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct P2pArgs {
    pub(super) flags: [u64; MAX_RANKS],
    pub(super) status: u64,
    pub(super) rank: i32,
    pub(super) nops: i32,
    pub(super) ops: [P2pOp; MAX_P2P],
    pub(super) scratch: [u64; MAX_RANKS],
    pub(super) region: u64,
    pub(super) step: u64,
    pub(super) slots: u64,
    pub(super) direct: i32,
}

/// Blocks per op at most across processes (`WEFT_P2P_FIFO_MAXB`).
pub(super) const P2P_FIFO_MAXB: usize = 64;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn args_layout_matches_the_kernel() {
        // struct Args in collectives.cu: 16 u64, 5 u64, 4 i32, 1 u64,
        // 2 i32, 1 u64, 2 i32, 1 u64, 1 i32 (padded), 5 u64.
        assert_eq!(
            std::mem::size_of::<Args>(),
            16 * 8 + 5 * 8 + 4 * 4 + 8 + 8 + 8 + 8 + 8 + 8 + 5 * 8
        );
        // struct P2pOp: 5 u64 + 4 i32 + 1 u64; struct P2pArgs: 8 u64, 1
        // u64, 2 i32, 16 ops, 8 u64, 3 u64, 1 i32 (padded).
        assert_eq!(std::mem::size_of::<P2pOp>(), 64);
        assert_eq!(
            std::mem::size_of::<P2pArgs>(),
            8 * 8 + 8 + 8 + 16 * 64 + 8 * 8 + 3 * 8 + 8
        );
        assert_eq!(std::mem::size_of::<Status>(), 32);
        assert_eq!(std::mem::offset_of!(Status, abort), 0);
        assert_eq!(std::mem::offset_of!(Status, timeout_ms), 4);
        assert_eq!(std::mem::offset_of!(Status, error), 8);
        assert_eq!(std::mem::offset_of!(Status, detail), 16);
        assert_eq!(std::mem::offset_of!(Status, stalled), 24);
    }
}
