//! A communicator's device side: peer-visible scratch + flags on every rank's
//! GPU, mapped by every other rank (P2P in one process, IPC across processes),
//! and the kernel launches that use them.

use super::{
    CudaResult, check, compute_capability, device_at, kernels, nvlink_class, pci_location,
    use_device,
};
use crate::algo::tuner::DEVICE_ALGOS;
use crate::op::{Op, OpKind};
use crate::types::{DataType, ReduceOp};
use cudarc::driver::sys;
use std::collections::HashMap;
use std::ffi::{CString, c_void};
use std::sync::{Mutex, OnceLock};

pub const MAX_RANKS: usize = 8;
pub const MAX_BLOCKS: usize = 128;
const FLAG_AREA: usize = 128 << 10;
/// Bytes of the lines area after the scratch (see `lines_chain` in
/// collectives.cu): every warp's window of the lines chain.
const LINES_AREA: usize = 32 << 20;
/// Wire bytes of one warp iteration of the lines chain (`LINES_ITER_WORDS`),
/// and the data they carry (120 of every 128 bytes).
const LINES_ITER_BYTES: usize = 4096;
const LINES_ITER_DATA: usize = LINES_ITER_BYTES / 128 * 120;
/// Warps of a lines kernel at most (`WEFT_LINES_MAX_WARPS`: credit words).
const LINES_MAX_WARPS: usize = 2048;
/// Window of a lines warp in iterations at most.
const LINES_MAX_WINDOW: usize = 16;
/// Wire bytes per sender in each parity half of the LL area
/// (`WEFT_LL_SLOT` in collectives.cu): a line of 16 bytes carries 8.
const LL_SLOT: usize = 512 << 10;
/// Bytes of the LL area after the lines area: two parity halves of one slot
/// per sender (see `ll_oneshot` in collectives.cu).
const LL_AREA: usize = 2 * MAX_RANKS * LL_SLOT;
/// Bytes of one part an LL operation carries at most.
const LL_MAX_BYTES: usize = LL_SLOT / 2;
/// Parts up to this many bytes run as LL one-shots across processes by
/// default (see [`Tuning::ll`]): all the slots hold. On 4 x H200 (mpirun,
/// docs/PERFORMANCE-GPU.md) LL beat the staged path at every size up to
/// there (all-reduce 128 KiB: 10.9 us against 18.6, NCCL 11.4).
const LL_DEFAULT_MAX: usize = LL_MAX_BYTES;
/// `Args::chain` (`WEFT_CHAIN_*` in collectives.cu).
const CHAIN_FIFO: i32 = 1;
const CHAIN_LINES: i32 = 2;
/// Bytes of one rank's descriptor in the init exchange.
pub const DESCRIPTOR_BYTES: usize = 128;

const K_ALLREDUCE: i32 = 0;
const K_ALLREDUCE_2SHOT: i32 = 1;
const K_REDUCE: i32 = 2;
const K_REDUCESCATTER: i32 = 3;
const K_ALLGATHER: i32 = 4;
const K_BROADCAST: i32 = 5;
const K_ALLTOALL: i32 = 6;

/// Must match `struct Args` in kernels/collectives.cu.
#[repr(C)]
#[derive(Clone, Copy)]
struct Args {
    scratch: [u64; MAX_RANKS],
    flags: [u64; MAX_RANKS],
    input: u64,
    output: u64,
    count: u64,
    chunk: u64,
    seq_base: u64,
    rank: i32,
    nranks: i32,
    kind: i32,
    root: i32,
    parity_bytes: u64,
    direct: i32,
    push: i32,
    status: u64,
    exit_barrier: i32,
    bcast: i32,
    step: u64,
    chain: i32,
    slots: u64,
    ll: u64,
    ll_off: u64,
    ll_check: u64,
    ll_need: u64,
}

/// Must match `struct Status` in kernels/collectives.cu: host memory mapped
/// into every device.
#[repr(C)]
struct Status {
    abort: u32,
    error: u32,
    detail: u64,
}

const ERR_P2P_SIZE: u32 = 1;
const ERR_P2P_SIZE_SEND: u32 = 2;

/// Must match `struct P2pOp` / `struct P2pArgs` in kernels/collectives.cu.
const MAX_P2P: usize = 16;
const P2P_SEND: i32 = 0;
const P2P_RECV: i32 = 1;
const P2P_COPY: i32 = 2;
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct P2pOp {
    ptr: u64,
    src: u64,
    bytes: u64,
    seq: u64,
    base: u64,
    peer: i32,
    kind: i32,
    block0: i32,
    nblocks: i32,
}
#[repr(C)]
#[derive(Clone, Copy)]
struct P2pArgs {
    flags: [u64; MAX_RANKS],
    status: u64,
    rank: i32,
    nops: i32,
    ops: [P2pOp; MAX_P2P],
    scratch: [u64; MAX_RANKS],
    region: u64,
    step: u64,
    slots: u64,
    direct: i32,
}

/// Blocks per op at most across processes (`WEFT_P2P_FIFO_MAXB`).
const P2P_FIFO_MAXB: usize = 64;

/// How point-to-point streams through a receiver's scratch across processes
/// (every rank computes the same, so sender and receiver agree).
#[derive(Clone, Copy, Debug, PartialEq)]
struct P2pFifo {
    /// Bytes of a receiver's scratch per sender.
    region: usize,
    /// Blocks per send or receive: a round holds at most one send and one
    /// receive per peer, so about 128 blocks in all, which stay resident
    /// together (a block spinning on a peer must not keep the block that
    /// would answer it from running).
    blocks: usize,
    step: usize,
    slots: usize,
}

impl P2pFifo {
    fn new(scratch: usize, nranks: usize) -> P2pFifo {
        let n = nranks.max(1);
        let region = scratch / n / 16 * 16;
        let blocks = (128 / (2 * n)).clamp(1, P2P_FIFO_MAXB);
        let slots = 4;
        let step = (region / blocks / slots / 16 * 16).max(16);
        P2pFifo {
            region,
            blocks,
            step,
            slots,
        }
    }
}

/// One point-to-point piece of a group on this rank.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum P2p {
    Send { peer: usize, ptr: u64, bytes: usize },
    Recv { peer: usize, ptr: u64, bytes: usize },
    Copy { dst: u64, src: u64, bytes: usize },
}

/// Send, receive, gather and scatter: what [`p2p_pieces`] takes apart.
pub fn is_p2p(op: &Op) -> bool {
    matches!(
        op.kind,
        OpKind::Send | OpKind::Recv | OpKind::Gather | OpKind::Scatter
    )
}

/// The point-to-point pieces of `op` on rank `rank` of `n` (send/recv,
/// gather and scatter, as NCCL builds them), or None for other operations.
/// A send to or receive from oneself is returned as is: [`DevComm::launch_p2p`]
/// pairs them into copies.
pub fn p2p_pieces(op: &Op, rank: usize, n: usize) -> Option<Vec<P2p>> {
    let mut v = Vec::new();
    let (send, recv, bytes, root) = (op.send as u64, op.recv as u64, op.bytes(), op.root);
    match op.kind {
        OpKind::Send => v.push(P2p::Send {
            peer: root,
            ptr: send,
            bytes,
        }),
        OpKind::Recv => v.push(P2p::Recv {
            peer: root,
            ptr: recv,
            bytes,
        }),
        OpKind::Gather | OpKind::Scatter => {
            // The root moves one block per rank (its own by a copy); every
            // other rank one block to or from the root.
            let gather = op.kind == OpKind::Gather;
            if rank != root {
                v.push(if gather {
                    P2p::Send {
                        peer: root,
                        ptr: send,
                        bytes,
                    }
                } else {
                    P2p::Recv {
                        peer: root,
                        ptr: recv,
                        bytes,
                    }
                });
            } else {
                for r in 0..n {
                    let at = (r * bytes) as u64;
                    v.push(match (r == rank, gather) {
                        (true, true) => P2p::Copy {
                            dst: recv + at,
                            src: send,
                            bytes,
                        },
                        (true, false) => P2p::Copy {
                            dst: recv,
                            src: send + at,
                            bytes,
                        },
                        (false, true) => P2p::Recv {
                            peer: r,
                            ptr: recv + at,
                            bytes,
                        },
                        (false, false) => P2p::Send {
                            peer: r,
                            ptr: send + at,
                            bytes,
                        },
                    });
                }
            }
        }
        _ => return None,
    }
    Some(v)
}

/// Splits a group's pieces into rounds: a round holds at most one send to and
/// one receive from each peer (the i-th send to a peer goes into round i, and
/// so does the peer's i-th receive from us, which is what makes the rounds
/// of all ranks match). Sends to and receives from oneself pair up, in order,
/// into copies.
fn p2p_rounds(pieces: &[P2p], me: usize) -> Result<Vec<Vec<P2p>>, String> {
    let mut rounds: Vec<Vec<P2p>> = Vec::new();
    let put = |rounds: &mut Vec<Vec<P2p>>, i: usize, p: P2p| {
        while rounds.len() <= i {
            rounds.push(Vec::new());
        }
        rounds[i].push(p);
    };
    let self_sends: Vec<(u64, usize)> = pieces
        .iter()
        .filter_map(|p| match *p {
            P2p::Send { peer, ptr, bytes } if peer == me => Some((ptr, bytes)),
            _ => None,
        })
        .collect();
    let self_recvs: Vec<(u64, usize)> = pieces
        .iter()
        .filter_map(|p| match *p {
            P2p::Recv { peer, ptr, bytes } if peer == me => Some((ptr, bytes)),
            _ => None,
        })
        .collect();
    if self_sends.len() != self_recvs.len() {
        return Err(format!(
            "{} sends to this rank itself but {} receives from it in one group",
            self_sends.len(),
            self_recvs.len()
        ));
    }
    let mut copies = 0;
    for (&(src, sb), &(dst, rb)) in self_sends.iter().zip(&self_recvs) {
        if sb != rb {
            return Err(format!(
                "a send to itself of {sb} bytes meets a receive of {rb} bytes"
            ));
        }
        put(
            &mut rounds,
            copies,
            P2p::Copy {
                dst,
                src,
                bytes: sb,
            },
        );
        copies += 1;
    }
    let mut sends: HashMap<usize, usize> = HashMap::new();
    let mut recvs: HashMap<usize, usize> = HashMap::new();
    for p in pieces {
        match *p {
            P2p::Send { peer, .. } | P2p::Recv { peer, .. } if peer == me => {}
            P2p::Copy { .. } => {
                put(&mut rounds, copies, *p);
                copies += 1;
            }
            P2p::Send { peer, .. } => {
                let i = sends.entry(peer).or_insert(0);
                put(&mut rounds, *i, *p);
                *i += 1;
            }
            P2p::Recv { peer, .. } => {
                let i = recvs.entry(peer).or_insert(0);
                put(&mut rounds, *i, *p);
                *i += 1;
            }
        }
    }
    // Copies are local: they may sit in any round; spread so none overflows.
    for r in &rounds {
        if r.len() > MAX_P2P {
            return Err(format!(
                "{} point-to-point pieces in one round (at most {MAX_P2P})",
                r.len()
            ));
        }
    }
    Ok(rounds)
}

/// A random token naming this process (pids repeat across containers).
fn process_token() -> u64 {
    static T: OnceLock<u64> = OnceLock::new();
    *T.get_or_init(|| {
        let mut b = [0u8; 8];
        let _ = getrandom::fill(&mut b);
        u64::from_le_bytes(b) ^ std::process::id() as u64
    })
}

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A size given in KiB by `name`, in bytes; None when unset or unparsable.
fn env_kb(name: &str) -> Option<usize> {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .map(|kb| kb << 10)
}

/// Direct broadcast algorithms (keep in sync with WEFT_BCAST_* in
/// collectives.cu).
const BCAST_RING: i32 = 0;
const BCAST_SCATTER: i32 = 1;

/// Kernel knobs read once per communicator from the environment (as NCCL
/// reads its variables at init; every rank of a direct-mode communicator is
/// in one process, so they agree). The defaults are what measured fastest on
/// 4 x H200 (docs/PERFORMANCE-GPU.md).
#[derive(Clone, Copy, Debug)]
struct Tuning {
    /// `WEFT_CUDA_ALGO`, else `WEFT_ALGO` when it names a device algorithm.
    algo: Option<&'static str>,
    /// `WEFT_CUDA_ONESHOT_MAX`: one-shot all-reduce up to this many bytes.
    oneshot_max: usize,
    /// `WEFT_CUDA_THREADS`: threads per block of the collective kernels.
    threads: usize,
    /// `WEFT_CUDA_P2P_BLOCKS`: blocks per receive in point-to-point kernels.
    p2p_blocks: usize,
    /// `WEFT_CUDA_PUSH`: direct copies write into the peers' buffers (`1`
    /// for every copying collective, `0` for none); unset, all-gather only
    /// (it measured faster pushing, 0.97 against 0.94 of NCCL at 2 GB on
    /// 4 x H200; all-to-all too, but pushing into a peer's buffer races with
    /// that peer reading the same place when the call is in place).
    push: Option<bool>,
    /// `WEFT_CUDA_BCAST`: ring | scatter; unset, by size.
    bcast: Option<i32>,
    /// `WEFT_CUDA_BCAST_RING_MB`: direct broadcasts from this size use the ring.
    ring_from: usize,
    /// `WEFT_CUDA_BCAST_STEP`: pipeline step in bytes; 0 = by size.
    step: usize,
    /// `WEFT_CUDA_REDUCE_CHUNK`: bytes per chunk of a direct reduce, at most.
    reduce_chunk: usize,
    /// `WEFT_CUDA_BLOCKS`: blocks per kernel at most; 0 = by collective.
    blocks: usize,
    /// `WEFT_CUDA_CHAIN_MIN_KB`: broadcast and reduce of at least this many
    /// bytes run as a chain through FIFO slots; None = by mode and
    /// collective (see [`Tuning::chain`]).
    chain_min: Option<usize>,
    /// `WEFT_CUDA_CHAIN_STEP_KB`: bytes per chain slot, at most.
    chain_step: usize,
    /// `WEFT_CUDA_CHAIN_DEPTH`: steps per block the slot size aims for.
    chain_depth: usize,
    /// `WEFT_CUDA_CHAIN_SLOTS`: slots per block, at most.
    chain_slots: usize,
    /// `WEFT_CUDA_CHAIN_BLOCKS`: blocks of a chain kernel.
    chain_blocks: usize,
    /// `WEFT_CUDA_LINES=0` turns the lines chain off.
    lines: bool,
    /// `WEFT_CUDA_LINES_MIN_KB` / `WEFT_CUDA_LINES_MAX_KB`: broadcast and
    /// reduce with at least `lines_min` and less than `lines_max` bytes run
    /// as a lines chain where every link allows it; None = by mode (see
    /// [`Tuning::lines`]).
    lines_min: Option<usize>,
    lines_max: Option<usize>,
    /// `WEFT_CUDA_LINES_BLOCKS`: blocks of a lines kernel at most (128: the
    /// link stays busy only with about 2048 warps' windows in flight; 64
    /// blocks measured 0.88 of NCCL at 128 MB - 2 GB, 128 blocks 0.92-0.95).
    lines_blocks: usize,
    /// `WEFT_CUDA_LINES_WINDOW`: iterations in flight per warp at most
    /// (2 - 16; small ones make senders wait for credits, as tests want).
    lines_window: usize,
    /// `WEFT_CUDA_LL_MAX_KB`: operations whose parts are at most this many
    /// bytes run as an LL one-shot (at most `LL_MAX_BYTES`); None = by mode
    /// (see [`Tuning::ll`]).
    ll_max: Option<usize>,
}

/// How a chain kernel cuts the work (every rank computes the same).
#[derive(Clone, Copy, Debug, PartialEq)]
struct ChainShape {
    blocks: usize,
    step: usize,
    slots: usize,
}

impl Tuning {
    fn from_env() -> Tuning {
        let bcast = match std::env::var("WEFT_CUDA_BCAST").as_deref() {
            Ok("ring") => Some(BCAST_RING),
            Ok("scatter") => Some(BCAST_SCATTER),
            _ => None,
        };
        Tuning {
            algo: algo_override(),
            oneshot_max: env_usize("WEFT_CUDA_ONESHOT_MAX", 256 << 10),
            threads: env_usize("WEFT_CUDA_THREADS", 512).clamp(32, 512),
            p2p_blocks: env_usize("WEFT_CUDA_P2P_BLOCKS", 32).clamp(1, MAX_BLOCKS),
            push: std::env::var("WEFT_CUDA_PUSH").ok().map(|v| v == "1"),
            bcast,
            ring_from: env_usize("WEFT_CUDA_BCAST_RING_MB", 256) << 20,
            step: env_usize("WEFT_CUDA_BCAST_STEP", 0),
            reduce_chunk: env_usize("WEFT_CUDA_REDUCE_CHUNK", 256 << 10).max(512) / 16 * 16,
            blocks: env_usize("WEFT_CUDA_BLOCKS", 0).min(MAX_BLOCKS),
            chain_min: env_kb("WEFT_CUDA_CHAIN_MIN_KB"),
            chain_step: (env_usize("WEFT_CUDA_CHAIN_STEP_KB", 128) << 10).max(16),
            chain_depth: env_usize("WEFT_CUDA_CHAIN_DEPTH", 8).max(1),
            chain_slots: env_usize("WEFT_CUDA_CHAIN_SLOTS", 8).max(2),
            chain_blocks: env_usize("WEFT_CUDA_CHAIN_BLOCKS", 128).clamp(1, MAX_BLOCKS),
            lines: std::env::var("WEFT_CUDA_LINES").map_or(true, |v| v != "0"),
            lines_min: env_kb("WEFT_CUDA_LINES_MIN_KB"),
            lines_max: env_kb("WEFT_CUDA_LINES_MAX_KB"),
            lines_blocks: env_usize("WEFT_CUDA_LINES_BLOCKS", 128).clamp(1, MAX_BLOCKS),
            lines_window: env_usize("WEFT_CUDA_LINES_WINDOW", LINES_MAX_WINDOW)
                .clamp(2, LINES_MAX_WINDOW),
            ll_max: env_kb("WEFT_CUDA_LL_MAX_KB"),
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
    fn ll(&self, bytes: usize, nranks: usize, direct: bool) -> bool {
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
    fn lines(&self, kind: i32, bytes: usize, nranks: usize, capable: bool) -> bool {
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
    fn lines_shape(&self, bytes: usize, threads: usize) -> (usize, usize) {
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
    fn chain(&self, kind: i32, bytes: usize, nranks: usize, direct: bool) -> bool {
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
    fn chain_shape(&self, bytes: usize, scratch: usize) -> ChainShape {
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
    /// measured no faster. Scratch mode (ranks in other processes) keeps 64,
    /// as measured there. Every rank must launch the same number (block b
    /// waits on block b of its peers): `WEFT_CUDA_BLOCKS` must be set alike.
    fn max_blocks(&self, kind: i32, bcast: i32, direct: bool) -> usize {
        if self.blocks > 0 {
            return self.blocks;
        }
        match kind {
            _ if !direct => 64,
            K_REDUCE | K_ALLGATHER | K_ALLTOALL => 128,
            K_BROADCAST if bcast == BCAST_SCATTER => 128,
            _ => 64,
        }
    }

    fn bcast_algo(&self, bytes: usize) -> i32 {
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
    fn bcast_step(&self, bytes: usize, blocks: usize, nranks: usize, bcast: i32) -> usize {
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
    fn reduce_chunk(&self, bytes: usize, blocks: usize, nranks: usize) -> usize {
        let share = bytes.div_ceil(blocks.max(1) * nranks.saturating_sub(1).max(1));
        (share.div_ceil(16) * 16).clamp(512, self.reduce_chunk)
    }
}

/// The device algorithm override: `WEFT_CUDA_ALGO`, else `WEFT_ALGO` when it
/// names a device algorithm (oneshot | twoshot | ll | staged; the host algorithm
/// names of `WEFT_ALGO`, such as ring, only steer host memory).
fn algo_override() -> Option<&'static str> {
    ["WEFT_CUDA_ALGO", "WEFT_ALGO"]
        .iter()
        .filter_map(|v| std::env::var(v).ok())
        .find_map(|s| {
            let s = s.trim().to_ascii_lowercase();
            DEVICE_ALGOS.iter().copied().find(|a| *a == s)
        })
}

/// The ranks an LL operation of `kind` on rank `me` of `n` pushes to and
/// receives from, as bit masks.
fn ll_peers(kind: i32, root: usize, me: usize, n: usize) -> (u64, u64) {
    let others = ((1u64 << n) - 1) & !(1 << me);
    match kind {
        K_BROADCAST if me == root => (others, 0),
        K_BROADCAST => (0, 1 << root),
        K_REDUCE if me == root => (0, others),
        K_REDUCE => (1 << root, 0),
        _ => (others, others),
    }
}

/// What this rank knows about its peers' use of the LL area. Operation k
/// writes parity half k % 2, so a peer must have finished operation k - 2
/// before this rank pushes into it again. Having received that peer's data
/// in operation k - 1 proves it (the peer pushed it after its kernel k - 2
/// ended); for any other peer pushed to, the kernel reads the peer's count of
/// finished LL blocks until it reaches the blocks of operations 0 ..= k - 2
/// (every rank launches the same blocks per operation).
#[derive(Debug, Default, Clone, PartialEq)]
struct LlHistory {
    /// LL operations so far.
    ops: u64,
    /// Blocks of all of them, and of the last one.
    blocks: u64,
    last_blocks: u64,
    /// Peers the last one received data from.
    last_received: u64,
}

impl LlHistory {
    /// Records the next operation (pushing to `sends`, receiving from
    /// `receives`, `blocks` blocks) and returns the peers its kernel must ask
    /// and the count they must have reached.
    fn next(&mut self, sends: u64, receives: u64, blocks: u64) -> (u64, u64) {
        let check = if self.ops >= 2 {
            sends & !self.last_received
        } else {
            0
        };
        let need = self.blocks - self.last_blocks;
        self.ops += 1;
        self.blocks += blocks;
        self.last_blocks = blocks;
        self.last_received = receives;
        (check, if check == 0 { 0 } else { need })
    }
}

/// How one operation runs on the kernel path.
#[derive(Clone, Copy, Debug)]
pub struct Plan {
    kind: i32,
    func: &'static str,
    input: u64,
    output: u64,
    count: usize,
    elem: usize,
    root: i32,
    parts: usize,
    /// Broadcast or reduce as a chain: 0 no, else `CHAIN_FIFO` (slots and a
    /// flag per step) or `CHAIN_LINES` (lines with their own flags).
    chain: i32,
    /// An LL one-shot (see [`Tuning::ll`]).
    ll: bool,
}

impl Plan {
    pub fn algorithm(&self) -> &'static str {
        match self.kind {
            _ if self.ll => "ll",
            _ if self.chain == CHAIN_LINES => "lines",
            _ if self.chain == CHAIN_FIFO => "chain",
            K_ALLREDUCE => "one-shot",
            K_ALLREDUCE_2SHOT => "two-shot",
            _ => "direct",
        }
    }
}

/// The C++ type behind a kernel type name.
fn c_type(t: &str) -> &'static str {
    match t {
        "i8" => "i8",
        "u8" => "u8",
        "i32" => "i32",
        "u32" => "u32",
        "i64" => "i64",
        "u64" => "u64",
        "f16" => "Half",
        "f32" => "float",
        "f64" => "double",
        "bf16" => "Bf16",
        "f8e4m3" => "E4M3",
        _ => "E5M2",
    }
}

fn op_struct(o: &str) -> &'static str {
    match o {
        "sum" => "OpSum",
        "prod" => "OpProd",
        "max" => "OpMax",
        "min" => "OpMin",
        _ => "OpAvg",
    }
}

/// A kernel on device `dev`: compiled alone (NVRTC, cached in the process and
/// on disk) and loaded on first use.
fn function(dev: i32, name: &'static str) -> CudaResult<sys::CUfunction> {
    static FUNCS: Mutex<Option<HashMap<(i32, &'static str), usize>>> = Mutex::new(None);
    let mut g = FUNCS.lock().unwrap_or_else(|e| e.into_inner());
    let funcs = g.get_or_insert_with(HashMap::new);
    if let Some(f) = funcs.get(&(dev, name)) {
        return Ok(*f as sys::CUfunction);
    }
    let src = single_source(name);
    let (a, b) = compute_capability(dev)?;
    let arch = format!("compute_{a}{b}");
    let ptx = kernels::compile(name, &src, &arch)?;
    let c = CString::new(ptx).map_err(|_| "PTX holds a NUL byte".to_string())?;
    let mut m: sys::CUmodule = std::ptr::null_mut();
    use_device(dev)?;
    unsafe {
        check(
            sys::cuModuleLoadData(&mut m, c.as_ptr().cast()),
            "cuModuleLoadData",
        )?
    };
    let cname = CString::new(name).unwrap();
    let mut f: sys::CUfunction = std::ptr::null_mut();
    unsafe {
        check(
            sys::cuModuleGetFunction(&mut f, m, cname.as_ptr()),
            "cuModuleGetFunction",
        )?
    };
    funcs.insert((dev, name), f as usize);
    Ok(f)
}

/// Compiles one kernel the way [`function`] does, without a device (tests).
pub fn compile_single(name: &str, arch: &str) -> CudaResult<String> {
    kernels::compile_uncached(name, &single_source(name), arch)
}

/// The source that defines exactly the kernel `name`: `weft_p2p`, or
/// `weft_coll_<type>_<op>`.
fn single_source(name: &str) -> String {
    if name == "weft_p2p" {
        return format!(
            "#define WEFT_SINGLE 1\n#define WEFT_P2P_KERNEL 1\n{}",
            kernels::COLLECTIVES
        );
    }
    let rest = name.strip_prefix("weft_coll_").unwrap_or(name);
    let (t, o) = rest.rsplit_once('_').unwrap_or((rest, "sum"));
    format!(
        "#define WEFT_SINGLE 1\n{}\nWEFT_KERNEL({t}, {}, {o}, {})\n",
        kernels::COLLECTIVES,
        c_type(t),
        op_struct(o)
    )
}

fn type_name(dt: DataType) -> &'static str {
    match dt {
        DataType::I8 => "i8",
        DataType::U8 => "u8",
        DataType::I32 => "i32",
        DataType::U32 => "u32",
        DataType::I64 => "i64",
        DataType::U64 => "u64",
        DataType::F16 => "f16",
        DataType::F32 => "f32",
        DataType::F64 => "f64",
        DataType::Bf16 => "bf16",
        DataType::F8E4M3 => "f8e4m3",
        DataType::F8E5M2 => "f8e5m2",
    }
}

fn func_name(dt: DataType, op: Option<ReduceOp>) -> Option<&'static str> {
    let o = match op {
        None | Some(ReduceOp::Sum) => "sum",
        Some(ReduceOp::Prod) => "prod",
        Some(ReduceOp::Max) => "max",
        Some(ReduceOp::Min) => "min",
        Some(ReduceOp::Avg) => "avg",
        Some(ReduceOp::PreMulSum(_)) => return None,
    };
    static NAMES: Mutex<Option<HashMap<(u8, &'static str), &'static str>>> = Mutex::new(None);
    let mut g = NAMES.lock().unwrap_or_else(|e| e.into_inner());
    let m = g.get_or_insert_with(HashMap::new);
    Some(
        m.entry((dt as u8, o)).or_insert_with(|| {
            Box::leak(format!("weft_coll_{}_{o}", type_name(dt)).into_boxed_str())
        }),
    )
}

/// One rank's device side of a communicator.
pub struct DevComm {
    rank: usize,
    nranks: usize,
    dev: i32,
    cc: (i32, i32),
    base: u64,
    parity_bytes: usize,
    peers: Vec<u64>,
    seq: u64,
    usable: bool,
    /// Every rank is in this process: kernels read peers' buffers in place.
    direct: bool,
    /// Every link of this rank may carry the lines chain (NVLink-class).
    lines_capable: bool,
    /// Every rank agreed it is (see `set_lines`).
    lines: bool,
    /// Pinned host memory mapped into the device (abort word, kernel errors).
    status: *mut Status,
    tuning: Tuning,
    /// LL operations launched (their flags and parity halves), and what the
    /// next one needs to know to reuse a half (see [`LlHistory`]).
    ll: LlHistory,
    /// Point-to-point sequence numbers per peer, and receive blocks finished.
    send_seq: Vec<u64>,
    recv_seq: Vec<u64>,
    recv_blocks: Vec<u64>,
    /// Peer areas opened with CUDA IPC (closed at finalize).
    imported: Vec<u64>,
}

unsafe impl Send for DevComm {}

impl DevComm {
    /// Phase 1: allocates this rank's area on `dev` and describes it for the
    /// peers (`DESCRIPTOR_BYTES`).
    pub fn create(rank: usize, nranks: usize, dev: i32) -> CudaResult<(DevComm, Vec<u8>)> {
        let ctx = use_device(dev)?;
        let _ = ctx;
        let cc = compute_capability(dev)?;
        let parity_bytes = env_usize("WEFT_CUDA_SCRATCH_MB", 32).max(1) << 20;
        let total = FLAG_AREA + 2 * parity_bytes + LINES_AREA + LL_AREA;
        let mut base: sys::CUdeviceptr = 0;
        let mut status: *mut c_void = std::ptr::null_mut();
        unsafe {
            check(
                sys::cuMemHostAlloc(
                    &mut status,
                    std::mem::size_of::<Status>(),
                    sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP,
                ),
                "cuMemHostAlloc (the communicator's abort word)",
            )?;
            std::ptr::write_bytes(status.cast::<u8>(), 0, std::mem::size_of::<Status>());
            if let Err(e) = check(sys::cuMemAlloc_v2(&mut base, total), "cuMemAlloc") {
                let _ = sys::cuMemFreeHost(status);
                return Err(format!(
                    "{e} ({} MiB of scratch on GPU {dev}; WEFT_CUDA_SCRATCH_MB sets it)",
                    total >> 20
                ));
            }
            check(sys::cuMemsetD8_v2(base, 0, FLAG_AREA), "cuMemsetD8")?;
            // No line may carry a valid flag before a lines chain wrote it.
            let lines = base + (FLAG_AREA + 2 * parity_bytes) as u64;
            check(sys::cuMemsetD8_v2(lines, 0, LINES_AREA), "cuMemsetD8")?;
            // Nor an LL line before an LL operation wrote it (flags start at 1).
            let ll = lines + LINES_AREA as u64;
            check(sys::cuMemsetD8_v2(ll, 0, LL_AREA), "cuMemsetD8")?;
            check(sys::cuCtxSynchronize(), "cuCtxSynchronize")?;
        }
        let mut d = vec![0u8; DESCRIPTOR_BYTES];
        d[0..8].copy_from_slice(&process_token().to_le_bytes());
        d[8..12].copy_from_slice(&dev.to_le_bytes());
        d[16..24].copy_from_slice(&base.to_le_bytes());
        d[24..32].copy_from_slice(&(parity_bytes as u64).to_le_bytes());
        let mut h = sys::CUipcMemHandle_st { reserved: [0; 64] };
        let ipc_ok = unsafe { sys::cuIpcGetMemHandle(&mut h, base) } == sys::CUresult::CUDA_SUCCESS;
        d[32] = ipc_ok as u8;
        for (i, v) in pci_location(dev)?.iter().enumerate() {
            d[40 + 4 * i..44 + 4 * i].copy_from_slice(&v.to_le_bytes());
        }
        for (i, c) in h.reserved.iter().enumerate() {
            d[64 + i] = *c as u8;
        }
        Ok((
            DevComm {
                rank,
                nranks,
                dev,
                cc,
                base,
                parity_bytes,
                peers: vec![0; nranks],
                seq: 0,
                usable: false,
                direct: false,
                lines_capable: false,
                lines: false,
                status: status.cast(),
                tuning: Tuning::from_env(),
                ll: LlHistory::default(),
                send_seq: vec![0; nranks],
                recv_seq: vec![0; nranks],
                recv_blocks: vec![0; nranks],
                imported: Vec::new(),
            },
            d,
        ))
    }

    /// Phase 2: maps every peer's area from the gathered descriptors
    /// (`nranks * DESCRIPTOR_BYTES`). Ok(false): some peer cannot be mapped
    /// (the reason is returned for the log); the kernel path must then be off
    /// on every rank, which the caller agrees on with the peers.
    pub fn connect(&mut self, all: &[u8]) -> CudaResult<()> {
        if self.nranks > MAX_RANKS {
            return Err(format!(
                "{} ranks: the kernel path supports at most {MAX_RANKS}",
                self.nranks
            ));
        }
        let ctx = use_device(self.dev)?;
        let _ = ctx;
        let me = process_token();
        self.direct = std::env::var("WEFT_CUDA_DIRECT")
            .map(|v| v != "0")
            .unwrap_or(true)
            && (0..self.nranks)
                .all(|r| all[r * DESCRIPTOR_BYTES..r * DESCRIPTOR_BYTES + 8] == me.to_le_bytes());
        for r in 0..self.nranks {
            let d = &all[r * DESCRIPTOR_BYTES..(r + 1) * DESCRIPTOR_BYTES];
            let token = u64::from_le_bytes(d[0..8].try_into().unwrap());
            let dev = i32::from_le_bytes(d[8..12].try_into().unwrap());
            let base = u64::from_le_bytes(d[16..24].try_into().unwrap());
            let pb = u64::from_le_bytes(d[24..32].try_into().unwrap()) as usize;
            if pb != self.parity_bytes {
                return Err(format!(
                    "rank {r} has {pb} bytes of scratch per parity, this rank {} (set WEFT_CUDA_SCRATCH_MB alike everywhere)",
                    self.parity_bytes
                ));
            }
            if r == self.rank {
                self.peers[r] = self.base;
                continue;
            }
            if token == me {
                if dev != self.dev {
                    let peer_ctx = use_device(dev)?;
                    use_device(self.dev)?;
                    let (mut a, mut pd) = (0i32, 0);
                    unsafe {
                        let mut md = 0;
                        check(sys::cuDeviceGet(&mut md, self.dev), "cuDeviceGet")?;
                        check(sys::cuDeviceGet(&mut pd, dev), "cuDeviceGet")?;
                        check(
                            sys::cuDeviceCanAccessPeer(&mut a, md, pd),
                            "cuDeviceCanAccessPeer",
                        )?;
                        if a == 0 {
                            return Err(format!(
                                "GPU {} cannot access GPU {dev} directly (no P2P)",
                                self.dev
                            ));
                        }
                        let r = sys::cuCtxEnablePeerAccess(peer_ctx, 0);
                        if r != sys::CUresult::CUDA_SUCCESS
                            && r != sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED
                        {
                            check(r, "cuCtxEnablePeerAccess")?;
                        }
                    }
                }
                self.peers[r] = base;
            } else {
                if d[32] == 0 {
                    return Err(format!(
                        "rank {r} could not export its scratch (cuIpcGetMemHandle)"
                    ));
                }
                let mut h = sys::CUipcMemHandle_st { reserved: [0; 64] };
                for i in 0..64 {
                    h.reserved[i] = d[64 + i] as _;
                }
                let mut p: sys::CUdeviceptr = 0;
                unsafe {
                    check(
                        sys::cuIpcOpenMemHandle_v2(&mut p, h, 1),
                        "cuIpcOpenMemHandle (CUDA IPC to a rank in another process)",
                    )?
                };
                self.peers[r] = p;
                self.imported.push(p);
            }
        }
        self.lines_capable = self.cc.0 >= 8
            && (0..self.nranks).filter(|&r| r != self.rank).all(|r| {
                let d = &all[r * DESCRIPTOR_BYTES..(r + 1) * DESCRIPTOR_BYTES];
                let word = |i: usize| i32::from_le_bytes(d[i..i + 4].try_into().unwrap());
                let peer = if d[0..8] == me.to_le_bytes() {
                    Some(word(8))
                } else {
                    device_at([word(40), word(44), word(48)])
                };
                peer.is_some_and(|p| nvlink_class(self.dev, p))
            });
        Ok(())
    }

    /// Whether every link of this rank can carry the lines chain (to be
    /// agreed with the peers: see `set_lines`).
    pub fn lines_capable(&self) -> bool {
        self.lines_capable
    }

    /// Sets whether every rank found its links lines-capable (the caller's
    /// agreement: all ranks must pick the same algorithms).
    pub fn set_lines(&mut self, lines: bool) {
        self.lines = lines;
    }

    /// Sets whether every rank connected (the caller's agreement).
    pub fn set_usable(&mut self, usable: bool) {
        self.usable = usable;
    }

    pub fn usable(&self) -> bool {
        self.usable
    }

    pub fn device(&self) -> i32 {
        self.dev
    }

    /// Every rank of the communicator is in this process (P2P, buffers read
    /// in place); false: some are in other processes (CUDA IPC, staging
    /// through scratch).
    pub fn direct(&self) -> bool {
        self.direct
    }

    /// Makes every kernel of this communicator, running or to come, return
    /// (ncclCommAbort): spin loops poll the word.
    pub fn abort(&self) {
        // SAFETY: `status` is live pinned host memory until finalize.
        unsafe { std::ptr::write_volatile(&raw mut (*self.status).abort, 1) };
    }

    /// An error a kernel reported (asynchronously), as text.
    pub fn kernel_error(&self) -> Option<String> {
        // SAFETY: as in `abort`.
        let (err, detail) = unsafe {
            (
                std::ptr::read_volatile(&raw const (*self.status).error),
                std::ptr::read_volatile(&raw const (*self.status).detail),
            )
        };
        match err {
            0 => None,
            ERR_P2P_SIZE => Some(format!(
                "a receive from rank {} expected a different size than the {} bytes that rank sent: send and receive counts or types differ",
                detail >> 56,
                detail & ((1 << 56) - 1)
            )),
            ERR_P2P_SIZE_SEND => Some(format!(
                "a send to rank {} has a different size than the {} bytes that rank's receive expects: send and receive counts or types differ",
                detail >> 56,
                detail & ((1 << 56) - 1)
            )),
            e => Some(format!("kernel error code {e}")),
        }
    }

    /// Releases the device side after the communicator's last operation:
    /// waits for this rank's device, closes the peers' IPC mappings and frees
    /// this rank's area. Ranks in other processes are past the exit barrier of
    /// every kernel that touched it once this device is idle; ranks of this
    /// process read each other's areas without one, so their areas are freed
    /// together when the last of them finalizes. Not after an abort (a kernel
    /// of a peer may still be spinning on our flags): that memory is left to
    /// the process's end.
    pub fn finalize(self) -> CudaResult<()> {
        use_device(self.dev)?;
        unsafe { check(sys::cuCtxSynchronize(), "cuCtxSynchronize")? };
        for p in &self.imported {
            unsafe { check(sys::cuIpcCloseMemHandle(*p), "cuIpcCloseMemHandle")? };
        }
        if !self.direct {
            unsafe {
                check(sys::cuMemFree_v2(self.base), "cuMemFree")?;
                check(sys::cuMemFreeHost(self.status.cast()), "cuMemFreeHost")?;
            }
            return Ok(());
        }
        // Same process: free when every rank of the group has finalized.
        type Retired = HashMap<u64, Vec<(i32, u64, usize)>>;
        static RETIRED: Mutex<Option<Retired>> = Mutex::new(None);
        let done = {
            let mut g = RETIRED.lock().unwrap_or_else(|e| e.into_inner());
            let m = g.get_or_insert_with(HashMap::new);
            let key = self.peers[0];
            let v = m.entry(key).or_default();
            v.push((self.dev, self.base, self.status as usize));
            if v.len() == self.nranks {
                m.remove(&key)
            } else {
                None
            }
        };
        for (dev, base, status) in done.unwrap_or_default() {
            use_device(dev)?;
            unsafe {
                check(sys::cuCtxSynchronize(), "cuCtxSynchronize")?;
                check(sys::cuMemFree_v2(base), "cuMemFree")?;
                check(sys::cuMemFreeHost(status as *mut c_void), "cuMemFreeHost")?;
            }
        }
        Ok(())
    }

    /// How `op` runs on the kernel path, or None (staging).
    pub fn plan(&self, op: &Op) -> Option<Plan> {
        if !self.usable || !kernels::nvrtc_available() {
            return None;
        }
        let algo = self.tuning.algo;
        if algo == Some("staged") {
            return None;
        }
        let n = self.nranks;
        let (send, recv, count, dtype, rop) = (op.send, op.recv, op.count, op.dtype, op.redop);
        let (kind, root, parts) = match op.kind {
            OpKind::AllReduce => {
                let bytes = count * dtype.size();
                let one = match algo {
                    Some("oneshot") => true,
                    Some("twoshot") => false,
                    _ => bytes <= self.tuning.oneshot_max || n <= 2,
                };
                let k = if one { K_ALLREDUCE } else { K_ALLREDUCE_2SHOT };
                (k, 0, 1)
            }
            OpKind::Reduce => (K_REDUCE, op.root, 1),
            OpKind::ReduceScatter => (K_REDUCESCATTER, 0, n),
            OpKind::AllGather => (K_ALLGATHER, 0, 1),
            OpKind::Broadcast => (K_BROADCAST, op.root, 1),
            OpKind::AllToAll => (K_ALLTOALL, 0, n),
            _ => return None,
        };
        if matches!(dtype, DataType::F8E4M3 | DataType::F8E5M2) && self.cc < (8, 9) {
            return None;
        }
        let bytes = count * dtype.size();
        let ll = self.tuning.ll(bytes, n, self.direct);
        // The LL kernel is a one-shot whatever the size rule picked.
        let kind = if ll && kind == K_ALLREDUCE_2SHOT {
            K_ALLREDUCE
        } else {
            kind
        };
        Some(Plan {
            kind,
            func: func_name(dtype, rop)?,
            input: send as u64,
            output: recv as u64,
            count,
            elem: dtype.size(),
            root: root as i32,
            parts,
            ll,
            chain: if ll {
                0
            } else if self.tuning.lines(kind, bytes, n, self.lines) {
                CHAIN_LINES
            } else if self.tuning.chain(kind, bytes, n, self.direct) {
                CHAIN_FIFO
            } else {
                0
            },
        })
    }

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
        let threads = self.tuning.threads;
        let mut params = [(&mut a as *mut Args).cast::<c_void>()];
        unsafe {
            check(
                sys::cuLaunchKernel(
                    f,
                    blocks as u32,
                    1,
                    1,
                    threads as u32,
                    1,
                    1,
                    0,
                    stream as sys::CUstream,
                    params.as_mut_ptr(),
                    std::ptr::null_mut(),
                ),
                "cuLaunchKernel",
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
        let blocks = vecs.div_ceil(512).clamp(1, 32);
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
        let max_blocks = self
            .tuning
            .max_blocks(p.kind, bcast, direct)
            .clamp(1, MAX_BLOCKS);
        let blocks = (m * p.elem * p.parts)
            .div_ceil(32 << 10)
            .clamp(1, max_blocks);
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

    /// Whether a group's point-to-point pieces can run as kernels here: in
    /// one process the receiver reads the sender's buffer in place, across
    /// processes the sender streams through the receiver's scratch.
    pub fn p2p_ok(&self) -> bool {
        self.usable && kernels::nvrtc_available() && self.tuning.algo != Some("staged")
    }

    /// Enqueues a group's point-to-point pieces on `stream`: one kernel per
    /// round (see `p2p_rounds`).
    ///
    /// # Safety
    /// As [`DevComm::launch`]; every peer must post the matching pieces.
    pub unsafe fn launch_p2p(&mut self, pieces: &[P2p], stream: *mut c_void) -> CudaResult<()> {
        let rounds = p2p_rounds(pieces, self.rank)?;
        if rounds.iter().all(|r| r.is_empty()) {
            return Ok(());
        }
        let f = function(self.dev, "weft_p2p")?;
        use_device(self.dev)?;
        let max_per = self.tuning.p2p_blocks;
        let fifo = P2pFifo::new(2 * self.parity_bytes, self.nranks);
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
            let cap = (160 / movers).clamp(1, max_per);
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
            let mut params = [(&mut a as *mut P2pArgs).cast::<c_void>()];
            unsafe {
                check(
                    sys::cuLaunchKernel(
                        f,
                        blocks as u32,
                        1,
                        1,
                        512,
                        1,
                        1,
                        0,
                        stream as sys::CUstream,
                        params.as_mut_ptr(),
                        std::ptr::null_mut(),
                    ),
                    "cuLaunchKernel (weft_p2p)",
                )?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The runtime's one-kernel-at-a-time compilation works for every type
    /// family (skips, saying why, without libnvrtc).
    #[test]
    fn single_kernels_compile() {
        if !kernels::nvrtc_available() {
            eprintln!(
                "SKIPPED single_kernels_compile: libnvrtc not found (see libcomm/kernels/ci-nvrtc.sh)"
            );
            return;
        }
        for name in [
            "weft_coll_f8e4m3_max",
            "weft_coll_bf16_avg",
            "weft_coll_i64_prod",
            "weft_p2p",
        ] {
            let ptx = compile_single(name, "compute_90").unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(ptx.matches(".entry").count(), 1, "{name}");
            assert!(ptx.contains(&format!(".entry {name}(")), "{name}");
        }
    }

    #[test]
    fn args_layout_matches_the_kernel() {
        // struct Args in collectives.cu: 16 u64, 5 u64, 4 i32, 1 u64,
        // 2 i32, 1 u64, 2 i32, 1 u64, 1 i32 (padded), 5 u64.
        assert_eq!(
            std::mem::size_of::<Args>(),
            16 * 8 + 5 * 8 + 4 * 4 + 8 + 8 + 8 + 8 + 8 + 8 + 5 * 8
        );
        // struct P2pOp: 5 u64 + 4 i32; struct P2pArgs: 8 u64, 1 u64, 2 i32,
        // 16 ops, 8 u64, 3 u64, 1 i32 (padded).
        assert_eq!(std::mem::size_of::<P2pOp>(), 56);
        assert_eq!(
            std::mem::size_of::<P2pArgs>(),
            8 * 8 + 8 + 8 + 16 * 56 + 8 * 8 + 3 * 8 + 8
        );
        assert_eq!(std::mem::size_of::<Status>(), 16);
    }

    /// The defaults `Tuning::from_env` gives with no WEFT_CUDA_* set.
    fn defaults() -> Tuning {
        Tuning {
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
        }
    }

    #[test]
    fn tuning_defaults_pick_by_size_and_keep_every_block_busy() {
        let t = defaults();
        assert_eq!(t.bcast_algo(32 << 20), BCAST_SCATTER);
        assert_eq!(t.bcast_algo(256 << 20), BCAST_RING);
        assert_eq!(t.max_blocks(K_BROADCAST, BCAST_SCATTER, true), 128);
        assert_eq!(t.max_blocks(K_BROADCAST, BCAST_RING, true), 64);
        assert_eq!(t.max_blocks(K_ALLREDUCE, BCAST_RING, true), 64);
        assert_eq!(t.max_blocks(K_REDUCE, BCAST_RING, false), 64);
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
        assert_eq!(forced.max_blocks(K_REDUCE, BCAST_RING, false), 7);
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
        let src = kernels::COLLECTIVES;
        assert!(src.contains(&format!("#define WEFT_LL_SLOT ({} << 10)", LL_SLOT >> 10)));
    }

    /// A peer is asked whether it finished the LL operation two back exactly
    /// when the operation in between brought nothing from it.
    #[test]
    fn ll_history_asks_only_peers_that_gave_no_sign() {
        let n = 4;
        // Rank 0 all-reduces: every peer's data arrives each time.
        let mut h = LlHistory::default();
        for b in [1, 3, 2, 5] {
            let (s, r) = ll_peers(K_ALLREDUCE, 0, 0, n);
            assert_eq!(h.next(s, r, b), (0, 0));
        }
        // Rank 0 broadcasts from itself after that: nothing comes back.
        let (s, r) = ll_peers(K_BROADCAST, 0, 0, n);
        assert_eq!((s, r), (0b1110, 0));
        // Op 4: the last op (an all-reduce) received from everyone.
        assert_eq!(h.next(s, r, 4), (0, 0));
        // Op 5: ask every peer for ops 0..=3 (1 + 3 + 2 + 5 blocks).
        assert_eq!(h.next(s, r, 4), (0b1110, 11));
        // Op 6: ops 0..=4.
        assert_eq!(h.next(s, r, 1), (0b1110, 15));
        // Its receivers only receive: they never ask.
        let mut g = LlHistory::default();
        for _ in 0..4 {
            let (s, r) = ll_peers(K_BROADCAST, 0, 2, n);
            assert_eq!((s, r), (0, 0b0001));
            assert_eq!(g.next(s, r, 2), (0, 0));
        }
        // Reduce to rank 3: rank 1 pushes to the root only and asks it from
        // the third op on.
        let mut h = LlHistory::default();
        let (s, r) = ll_peers(K_REDUCE, 3, 1, n);
        assert_eq!((s, r), (0b1000, 0));
        assert_eq!(h.next(s, r, 2), (0, 0));
        assert_eq!(h.next(s, r, 2), (0, 0));
        assert_eq!(h.next(s, r, 2), (0b1000, 2));
    }

    /// The next value of a xorshift64 generator (state never 0).
    fn xorshift(state: &mut u64) -> u64 {
        *state ^= *state << 13;
        *state ^= *state >> 7;
        *state ^= *state << 17;
        *state
    }

    /// A model of the LL area's reuse across processes: ranks run the same
    /// LL operations at their own pace (any interleaving a random schedule
    /// picks), each one checking, pushing and receiving as the kernel does
    /// with the `LlHistory` of its rank. Returns the first slot overwritten
    /// before its receiver read it, or a deadlock.
    fn ll_model(n: usize, ops: &[(i32, usize, u64)], seed: u64, check: bool) -> Result<(), String> {
        #[derive(Clone, Copy, PartialEq)]
        enum Phase {
            Check,
            Push,
            Receive,
        }
        // slot[receiver][parity][sender] = (operation, read yet)
        let mut slot = vec![[[None::<(usize, bool)>; MAX_RANKS]; 2]; n];
        let mut count = vec![0u64; n];
        let mut pc = vec![0usize; n];
        let mut phase = vec![Phase::Check; n];
        let mut hist = vec![LlHistory::default(); n];
        // (sends, receives, peers to ask, their count) of each rank's current op.
        let mut plan = vec![None::<(u64, u64, u64, u64)>; n];
        let mut rng = seed | 1;
        loop {
            let live: Vec<usize> = (0..n).filter(|&r| pc[r] < ops.len()).collect();
            if live.is_empty() {
                return Ok(());
            }
            // Every rank that can move, in a random order; none: deadlock.
            let mut moved = false;
            let start = xorshift(&mut rng) as usize;
            for i in 0..live.len() {
                let r = live[(start + i) % live.len()];
                let k = pc[r];
                let (kind, root, blocks) = ops[k];
                let par = k % 2;
                match phase[r] {
                    Phase::Check => {
                        let (_, _, c, need) = *plan[r].get_or_insert_with(|| {
                            let (sends, receives) = ll_peers(kind, root, r, n);
                            let (c, need) = hist[r].next(sends, receives, blocks);
                            (sends, receives, if check { c } else { 0 }, need)
                        });
                        if (0..n).all(|d| c >> d & 1 == 0 || count[d] >= need) {
                            phase[r] = Phase::Push;
                            moved = true;
                        }
                    }
                    Phase::Push => {
                        let sends = plan[r].unwrap().0;
                        for d in (0..n).filter(|d| sends >> d & 1 == 1) {
                            if let Some((j, false)) = slot[d][par][r] {
                                return Err(format!(
                                    "rank {r} overwrote op {j}'s data for rank {d} (op {k}) before it was read"
                                ));
                            }
                            slot[d][par][r] = Some((k, false));
                        }
                        phase[r] = Phase::Receive;
                        moved = true;
                    }
                    Phase::Receive => {
                        let receives = plan[r].unwrap().1;
                        let from: Vec<usize> = (0..n).filter(|s| receives >> s & 1 == 1).collect();
                        if from
                            .iter()
                            .all(|&s| matches!(slot[r][par][s], Some((j, _)) if j == k))
                        {
                            for s in from {
                                slot[r][par][s] = Some((k, true));
                            }
                            count[r] += blocks;
                            pc[r] += 1;
                            plan[r] = None;
                            phase[r] = Phase::Check;
                            moved = true;
                        }
                    }
                }
                if moved {
                    break;
                }
            }
            if !moved {
                return Err(format!("deadlock at {pc:?}"));
            }
        }
    }

    /// The reuse rule holds under random schedules for random sequences of
    /// every kind of LL operation, and the model has teeth: without the
    /// count check a broadcast root overwrites unread data (the hang the
    /// first GPU build had).
    #[test]
    fn ll_reuse_never_overwrites_unread_data() {
        let mut rng = 0x2545_f491_4f6c_dd1du64;
        let mut next = move |m: u64| xorshift(&mut rng) % m;
        let kinds = [
            K_ALLREDUCE,
            K_BROADCAST,
            K_REDUCE,
            K_ALLGATHER,
            K_REDUCESCATTER,
            K_ALLTOALL,
        ];
        for case in 0..300 {
            let n = 2 + next(7) as usize;
            let ops: Vec<(i32, usize, u64)> = (0..2 + next(12))
                .map(|_| {
                    (
                        kinds[next(6) as usize],
                        next(n as u64) as usize,
                        1 + next(32),
                    )
                })
                .collect();
            for seed in 0..8 {
                if let Err(e) = ll_model(n, &ops, case * 8 + seed + 1, true) {
                    panic!("case {case} (n={n}, ops={ops:?}, seed {seed}): {e}");
                }
            }
        }
        for unchecked in [[(K_BROADCAST, 0usize, 2u64); 6], [(K_REDUCE, 2, 1); 6]] {
            let caught = (1..50).any(|seed| ll_model(3, &unchecked, seed, false).is_err());
            assert!(
                caught,
                "without the check the model should find the overwrite"
            );
        }
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

    #[test]
    fn p2p_fifo_fits_each_receivers_scratch() {
        // Scratch is at least 2 MiB (WEFT_CUDA_SCRATCH_MB >= 1, two parities).
        for scratch in [64usize << 20, 2 << 20] {
            for n in 1..=MAX_RANKS {
                let f = P2pFifo::new(scratch, n);
                // One region per sender, one FIFO per block in it.
                assert!(f.region * n <= scratch, "{scratch} {n}: {f:?}");
                assert!(
                    f.blocks * f.slots * f.step <= f.region,
                    "{scratch} {n}: {f:?}"
                );
                assert!(f.step.is_multiple_of(16) && f.step >= 16 && f.slots >= 2);
                // A round (one send and one receive per peer) stays within
                // about 128 blocks, and within the kernel's flag arrays.
                assert!(2 * n * f.blocks <= 128 || f.blocks == 1);
                assert!(f.blocks <= P2P_FIFO_MAXB);
            }
        }
        let f = P2pFifo::new(64 << 20, 4);
        assert_eq!(
            (f.region, f.blocks, f.step, f.slots),
            (16 << 20, 16, 256 << 10, 4)
        );
    }

    fn send(peer: usize, ptr: u64) -> P2p {
        P2p::Send {
            peer,
            ptr,
            bytes: 8,
        }
    }
    fn recv(peer: usize, ptr: u64) -> P2p {
        P2p::Recv {
            peer,
            ptr,
            bytes: 8,
        }
    }

    /// Rounds: one send per peer and direction each, self pairs as copies.
    #[test]
    fn p2p_rounds_split_repeated_peers_and_pair_self() {
        let r = p2p_rounds(
            &[
                send(1, 10),
                recv(2, 20),
                send(1, 11),
                recv(0, 30),
                send(0, 31),
            ],
            0,
        )
        .unwrap();
        assert_eq!(r.len(), 2);
        assert_eq!(
            r[0],
            vec![
                P2p::Copy {
                    dst: 30,
                    src: 31,
                    bytes: 8
                },
                send(1, 10),
                recv(2, 20)
            ]
        );
        assert_eq!(r[1], vec![send(1, 11)]);
        assert!(
            p2p_rounds(&[send(0, 1)], 0)
                .unwrap_err()
                .contains("sends to this rank itself")
        );
    }

    /// Gather and scatter become NCCL's pieces.
    #[test]
    fn gather_and_scatter_pieces() {
        let g = Op::gather(100 as *const u8, 1000 as *mut u8, 2, DataType::F32, 1);
        assert_eq!(
            p2p_pieces(&g, 1, 3).unwrap(),
            vec![
                recv8(0, 1000),
                P2p::Copy {
                    dst: 1008,
                    src: 100,
                    bytes: 8
                },
                recv8(2, 1016)
            ]
        );
        assert_eq!(p2p_pieces(&g, 0, 3).unwrap(), vec![send(1, 100)]);
        let sc = Op::scatter(100 as *const u8, 1000 as *mut u8, 2, DataType::F32, 0);
        assert_eq!(p2p_pieces(&sc, 2, 3).unwrap(), vec![recv(0, 1000)]);
        assert_eq!(p2p_pieces(&sc, 0, 3).unwrap()[2], send(2, 116));
    }

    fn recv8(peer: usize, ptr: u64) -> P2p {
        recv(peer, ptr)
    }
}
