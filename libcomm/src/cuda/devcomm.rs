//! [`DevComm`]: one rank's device side of a communicator, the state the
//! kernel path keeps between calls.
//!
//! Not to be confused with `crate::op::backend::DeviceSlot`, the communicator's
//! slot that holds it: a `DeviceSlot` says whether the device side was set
//! up yet and whether the kernel path is on (`Unset`, `Off(device)`,
//! `On(DevComm)`, held as a `DeviceSide`);
//! a `DevComm` exists only where it was set up, and owns the mapped peer
//! areas, the sequence numbers and the tuning. Its methods live with their
//! concern: setup and release in `mapping.rs`, planning in `plan.rs`, launch
//! in `launch.rs`; this file holds the struct, its flags and the status word
//! (abort, kernel errors).

use super::abi::{
    CHAIN_CRED_OFF, CHAIN_TAIL_OFF, ERR_P2P_SIZE, ERR_P2P_SIZE_SEND, FLAG_AREA, LINES_AREA,
    LINES_CRED_OFF, LL_AREA, LL_COUNT, LL_SLOT, MAX_BLOCKS, MAX_RANKS, P2P_CRED, P2P_DONE,
    P2P_FIFO_MAXB, P2P_READY, P2P_RREADY, P2P_TAIL, PROG_OFF, Status,
};
use super::ll::LlHistory;
use super::side_stream::SideStream;
use super::tuning::Tuning;

/// One rank's device side of a communicator.
pub struct DevComm {
    pub(super) rank: usize,
    pub(super) nranks: usize,
    pub(super) dev: i32,
    pub(super) cc: (i32, i32),
    pub(super) base: u64,
    pub(super) parity_bytes: usize,
    pub(super) peers: Vec<u64>,
    pub(super) seq: u64,
    pub(super) usable: bool,
    /// Every rank is in this process: kernels read peers' buffers in place.
    pub(super) direct: bool,
    /// Every link of this rank may carry the lines chain (NVLink-class).
    pub(super) lines_capable: bool,
    /// Every rank agreed it is (see `set_lines`).
    pub(super) lines: bool,
    /// Pinned host memory mapped into the device (abort word, kernel errors).
    pub(super) status: *mut Status,
    /// `status.abort`, shared with the core (ncclCommAbort, the device watch);
    /// retired before `status` is freed.
    pub(super) word: std::sync::Arc<crate::op::backend::AbortWord>,
    pub(super) tuning: Tuning,
    /// LL operations launched (their flags and parity halves), and what the
    /// next one needs to know to reuse a half (see [`LlHistory`]).
    pub(super) ll: LlHistory,
    /// Point-to-point sequence numbers per peer, and receive blocks finished.
    pub(super) send_seq: Vec<u64>,
    pub(super) recv_seq: Vec<u64>,
    pub(super) recv_blocks: Vec<u64>,
    /// Peer areas opened with CUDA IPC (closed at finalize).
    pub(super) imported: Vec<u64>,
    /// The devices of this process's other ranks that are not ours (they
    /// read an eager send's staging in place: see `eager.rs`).
    pub(super) peer_devs: Vec<i32>,
    /// The side stream and staging pool of eager sends, once used.
    pub(super) eager: Option<SideStream>,
    /// Creating them failed once: sends stay rendezvous.
    pub(super) eager_off: bool,
}

unsafe impl Send for DevComm {}

impl DevComm {
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
        self.word.fire();
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
}

/// What a kernel of `rank` (of `nranks`) waits for when it polls `addr`
/// (a `Status::stalled` report): whose write, from the layout of the areas
/// (`abi.rs`; the offsets in collectives.cu). `peers[r]`: rank r's area as
/// mapped here. Most waits poll this rank's own memory, written by the rank
/// they wait for; the LL reuse check polls the peer's count.
pub(super) fn stall_site(
    addr: u64,
    rank: usize,
    nranks: usize,
    peers: &[u64],
    parity_bytes: usize,
) -> String {
    let total = (FLAG_AREA + 2 * parity_bytes + LINES_AREA + LL_AREA) as u64;
    let Some(owner) = (0..nranks.min(peers.len()))
        .find(|&r| peers[r] != 0 && addr >= peers[r] && addr - peers[r] < total)
    else {
        return format!("address {addr:#x} (outside the communicator's areas)");
    };
    let off = (addr - peers[owner]) as usize;
    let n = nranks.max(1);
    let (pred, succ) = ((rank + n - 1) % n, (rank + 1) % n);
    if owner != rank {
        return if (LL_COUNT..LL_COUNT + 8).contains(&off) {
            format!("rank {owner} (it has not finished the LL operation two back)")
        } else {
            format!("rank {owner} (offset {off:#x} of its area)")
        };
    }
    let peer_at = |base: usize, stride: usize| (off - base) / stride;
    let lines = FLAG_AREA + 2 * parity_bytes;
    let ll = lines + LINES_AREA;
    match off {
        o if o < MAX_BLOCKS * MAX_RANKS * 8 => format!(
            "rank {} (the barrier of block {})",
            (o / 8) % MAX_RANKS,
            o / 8 / MAX_RANKS
        ),
        o if (P2P_READY..P2P_READY + MAX_RANKS * 8).contains(&o) => {
            format!("rank {} (a send to this rank)", peer_at(P2P_READY, 8))
        }
        o if (P2P_DONE..P2P_DONE + MAX_RANKS * 8).contains(&o) => {
            format!(
                "rank {} (the receive of this rank's send)",
                peer_at(P2P_DONE, 8)
            )
        }
        o if (P2P_TAIL..P2P_CRED).contains(&o) => format!(
            "rank {} (the next step of a send to this rank)",
            peer_at(P2P_TAIL, 8 * P2P_FIFO_MAXB)
        ),
        o if (P2P_CRED..P2P_RREADY).contains(&o) => format!(
            "rank {} (room in its receive buffer)",
            peer_at(P2P_CRED, 8 * P2P_FIFO_MAXB)
        ),
        o if (P2P_RREADY..P2P_RREADY + MAX_RANKS * 8).contains(&o) => format!(
            "rank {} (the receive matching this rank's send)",
            peer_at(P2P_RREADY, 8)
        ),
        o if (PROG_OFF..CHAIN_TAIL_OFF).contains(&o) => {
            format!("the root or rank {pred} (a broadcast pipeline step)")
        }
        o if (CHAIN_TAIL_OFF..CHAIN_CRED_OFF).contains(&o) => {
            format!("rank {pred} (the next step of the chain)")
        }
        o if (CHAIN_CRED_OFF..CHAIN_CRED_OFF + MAX_BLOCKS * 8).contains(&o) => {
            format!("rank {succ} (room in its chain slots)")
        }
        o if (LINES_CRED_OFF..FLAG_AREA).contains(&o) => {
            format!("rank {succ} (room in its lines window)")
        }
        o if (lines..ll).contains(&o) => format!("rank {pred} (lines of the lines chain)"),
        o if o >= ll => format!(
            "rank {} (an LL line)",
            (o - ll) % (MAX_RANKS * LL_SLOT) / LL_SLOT
        ),
        o => format!("offset {o:#x} of this rank's area"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stalled_address_names_the_rank_waited_for() {
        let pb = 1 << 20;
        let total = (FLAG_AREA + 2 * pb + LINES_AREA + LL_AREA) as u64;
        // Rank 1 of 4; areas 1 GiB apart as mapped here.
        let peers: Vec<u64> = (0..4).map(|r| (r + 1) << 30).collect();
        let me = peers[1];
        let site = |a: u64| stall_site(a, 1, 4, &peers, pb);
        // Barrier flag [block 3][rank 2].
        assert_eq!(
            site(me + (3 * 8 + 2) * 8),
            "rank 2 (the barrier of block 3)"
        );
        assert!(site(me + (P2P_READY + 3 * 8) as u64).starts_with("rank 3 (a send"));
        assert!(site(me + P2P_DONE as u64).starts_with("rank 0 (the receive"));
        assert!(
            site(me + (P2P_TAIL + 2 * 512 + 5 * 8) as u64)
                .starts_with("rank 2 (the next step of a send")
        );
        assert!(site(me + (P2P_CRED + 3 * 512) as u64).starts_with("rank 3 (room"));
        assert!(site(me + (P2P_RREADY + 2 * 8) as u64).starts_with("rank 2 (the receive matching"));
        assert!(
            site(me + (CHAIN_TAIL_OFF + 8 * 7) as u64)
                .starts_with("rank 0 (the next step of the chain")
        );
        assert!(site(me + CHAIN_CRED_OFF as u64).starts_with("rank 2 (room in its chain"));
        assert!(
            site(me + (LINES_CRED_OFF + 8 * 100) as u64).starts_with("rank 2 (room in its lines")
        );
        assert!(site(me + (FLAG_AREA + 2 * pb + 4096) as u64).starts_with("rank 0 (lines"));
        let ll = (FLAG_AREA + 2 * pb + LINES_AREA) as u64;
        // Parity half 1, sender 3's slot.
        let at = me + ll + (MAX_RANKS * LL_SLOT + 3 * LL_SLOT + 16) as u64;
        assert_eq!(site(at), "rank 3 (an LL line)");
        assert!(site(me + PROG_OFF as u64).contains("broadcast pipeline"));
        // The LL reuse check polls a peer's count.
        assert!(site(peers[3] + LL_COUNT as u64).starts_with("rank 3 (it has not finished"));
        assert!(site(peers[3] + total + 8).contains("outside"));
        // Rank 0's predecessor wraps around.
        assert!(
            stall_site(peers[0] + CHAIN_TAIL_OFF as u64, 0, 4, &peers, pb).starts_with("rank 3 ")
        );
    }
}
