//! [`DevComm`]: one rank's device side of a communicator, the state the
//! kernel path keeps between calls.
//!
//! Not to be confused with `crate::backend::DeviceSlot`, the communicator's
//! slot that holds it: a `DeviceSlot` says whether the device side was set
//! up yet and whether the kernel path is on (`Unset`, `Off(device)`,
//! `On(DevComm)`, held as a `DeviceSide`);
//! a `DevComm` exists only where it was set up, and owns the mapped peer
//! areas, the sequence numbers and the tuning. Its methods live with their
//! concern: setup and release in `mapping.rs`, planning in `plan.rs`, launch
//! in `launch.rs`; this file holds the struct, its flags and the status word
//! (abort, kernel errors).

use super::abi::{ERR_P2P_SIZE, ERR_P2P_SIZE_SEND, Status};
use super::eager::Eager;
use super::ll::LlHistory;
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
    pub(super) word: std::sync::Arc<crate::backend::AbortWord>,
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
    pub(super) eager: Option<Eager>,
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
