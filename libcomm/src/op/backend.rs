//! The data-plane backend seam.
//!
//! The communicator core validates an operation ([`Op::validate`]), checks
//! the communicator's state, then hands it to the backend of its memory kind
//! ([`crate::op::Memory`]): host memory runs on the core's own host
//! algorithms; device memory goes to the [`Backend`] the core constructed for
//! it (the CUDA backend, `cuda/`). A backend sees the communicators of a batch
//! only through [`Comms`]: rank and size, a description for messages, the
//! communicator's [`DeviceSlot`], a host-memory exchange with the peers
//! (descriptors, agreement), and the observer. It never reaches into
//! `Communicator` or `Group`.
//!
//! Dependencies point one way: `backend` imports only `op`, `error` and the
//! tuner's `Decision`; the
//! CUDA backend imports `backend`, `op` and the neutral modules (`types`,
//! `error`, `algo::tuner`'s name list) and nothing that imports it back.

use crate::error::Result;
use crate::op::Op;
use crate::op::tuner::Decision;
use std::any::Any;
use std::ffi::c_void;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

/// The word a communicator's kernels poll to stop waiting on peers (a `u32`
/// in pinned host memory mapped into the device), reachable without the
/// communicator's device slot: an operation may hold that slot's lock while
/// the kernels it launched spin on a dead peer, and the abort must still get
/// through (ncclCommAbort, the device watch in `comm/watch.rs`). The backend
/// retires it before it frees the memory; firing a retired word does nothing.
///
/// It also carries the kernels' progress timeout (`WEFT_TIMEOUT_MS`): the
/// backend says where the timeout and the stall report live
/// ([`AbortWord::watch_stalls`]), the core sets the timeout
/// ([`AbortWord::set_timeout`]) and its device watch asks whether a wait
/// stalled ([`AbortWord::stalled`]), all without the slot's lock.
pub struct AbortWord {
    at: Mutex<usize>,
    stall: OnceLock<Stall>,
}

/// Where a device reports stalled waits (see [`AbortWord::watch_stalls`]).
struct Stall {
    timeout_ms: usize,
    stalled: usize,
    describe: Box<dyn Fn(u64) -> String + Send + Sync>,
}

impl AbortWord {
    /// `at`: live, writable memory until [`AbortWord::retire`].
    pub fn new(at: *mut u32) -> Arc<AbortWord> {
        Arc::new(AbortWord {
            at: Mutex::new(at as usize),
            stall: OnceLock::new(),
        })
    }

    /// The device's progress timeout lives at `timeout_ms` (milliseconds, 0
    /// = none, read by the kernels) and a kernel whose wait made no progress
    /// for that long writes the address it polls at `stalled`; `describe`
    /// names what waits there ("rank 2 (its barrier flag)"). Both in the
    /// memory `at` points into, so live until [`AbortWord::retire`]. Once.
    pub fn watch_stalls(
        &self,
        timeout_ms: *mut u32,
        stalled: *const u64,
        describe: Box<dyn Fn(u64) -> String + Send + Sync>,
    ) {
        let _ = self.stall.set(Stall {
            timeout_ms: timeout_ms as usize,
            stalled: stalled as usize,
            describe,
        });
    }

    /// Sets the kernels' progress timeout (None: waits never time out).
    pub fn set_timeout(&self, t: Option<std::time::Duration>) {
        let ms = t.map_or(0, |t| t.as_millis().clamp(1, u32::MAX as u128) as u32);
        let g = self.at.lock().unwrap_or_else(|e| e.into_inner());
        if let (true, Some(s)) = (*g != 0, self.stall.get()) {
            // SAFETY: live until `retire`, which takes the same lock.
            unsafe { std::ptr::write_volatile(s.timeout_ms as *mut u32, ms) };
        }
    }

    /// What a kernel waits on that made no progress for the timeout, if one
    /// reported so (None once retired).
    pub fn stalled(&self) -> Option<String> {
        let g = self.at.lock().unwrap_or_else(|e| e.into_inner());
        let s = self.stall.get()?;
        if *g == 0 {
            return None;
        }
        // SAFETY: as in `set_timeout`.
        let at = unsafe { std::ptr::read_volatile(s.stalled as *const u64) };
        (at != 0).then(|| (s.describe)(at))
    }

    /// Makes every kernel polling the word return. False once retired.
    pub fn fire(&self) -> bool {
        let g = self.at.lock().unwrap_or_else(|e| e.into_inner());
        if *g == 0 {
            return false;
        }
        // SAFETY: live until `retire`, which takes the same lock.
        unsafe { std::ptr::write_volatile(*g as *mut u32, 1) };
        true
    }

    /// Whether the word was fired (false once retired).
    #[cfg(test)]
    pub fn fired(&self) -> bool {
        let g = self.at.lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: as in `fire`.
        *g != 0 && unsafe { std::ptr::read_volatile(*g as *const u32) } != 0
    }

    /// The memory is about to be freed: later `fire`s do nothing.
    pub fn retire(&self) {
        *self.at.lock().unwrap_or_else(|e| e.into_inner()) = 0;
    }
}

/// A communicator's state inside the device backend (allocated peer areas,
/// mappings, sequence numbers), owned by the communicator's lifecycle record
/// so that abort and destroy reach it without knowing the backend.
pub trait DeviceSide: Send {
    /// The CUDA device it lives on.
    fn device(&self) -> i32;
    /// An error a kernel of this communicator reported, if any.
    fn kernel_error(&self) -> Option<String>;
    /// Makes kernels spinning on peers return (abort).
    fn abort(&self);
    /// The word `abort` sets, for callers that must not take the slot's lock.
    fn abort_word(&self) -> Arc<AbortWord>;
    /// Releases it (destroy; not after an abort: a peer's kernel may still touch it).
    fn finalize(self: Box<Self>) -> std::result::Result<(), String>;
    /// The backend's own type, for the backend only.
    fn as_any_mut(&mut self) -> &mut dyn Any;
    /// Lets work this side runs on its own threads end before the
    /// communicator's resources go (destroy; NCCL's destroy also completes
    /// the operations in flight). Bounded; nothing to do for kernels.
    fn drain(&self) {}
}

/// A communicator's host path as a thread other than the caller's may use
/// it: what the device path across hosts runs on staged copies (its
/// progress thread, `cuda/proxy.rs`). Holds the communicator weakly: a
/// destroyed communicator makes [`HostRunner::run`] fail, never keeps it.
pub trait HostRunner: Send + Sync {
    /// Runs host-memory operations of this communicator as one group (its
    /// sends and receives fused, its collectives in order); a failure that
    /// breaks the communicator is recorded as its async error.
    ///
    /// # Safety
    /// As [`Comms::run_host`].
    unsafe fn run(&self, ops: &[Op]) -> Result<()>;

    /// As [`run`](Self::run) for one collective whose input the stream is
    /// still putting in place and whose output the stream copies out as it
    /// becomes final (the cross-host pipeline, `cuda/pinned_pipe.rs`): it
    /// reads no input byte before `progress` says it is in place and tells
    /// `progress` how much of the output is final as it goes. A runner that
    /// cannot (this default) waits for the whole input first and leaves the
    /// output to the job's end; when that wait is given up (the job is
    /// released: an abort) nothing runs.
    ///
    /// # Safety
    /// As [`run`](Self::run).
    unsafe fn run_progressive(&self, ops: &[Op], progress: Arc<dyn JobProgress>) -> Result<()> {
        match progress.wait_input() {
            true => unsafe { self.run(ops) },
            false => Ok(()),
        }
    }

    /// Whether this communicator's host path fails a wait that made no
    /// progress for a while (`WEFT_TIMEOUT_MS`). A device job that reads
    /// nothing from its stream may start its network part before the
    /// stream reaches it only where nothing times out: that clock would
    /// also count the stream's backlog (a long kernel before the call), not
    /// only the peers'. This default says it may time out.
    fn times_out(&self) -> bool {
        true
    }
}

/// How far a device job's stream has gone, chunk by chunk, as the host
/// part of a job across hosts sees it: the input is the collective's send
/// buffer, the output its receive buffer (the job's pinned copies), both
/// counted in bytes from their start, in order.
pub trait JobProgress: Send + Sync {
    /// Bytes of the input in place (only grows).
    fn input_ready(&self) -> usize;
    /// Waits until the whole input is in place; false when the job is
    /// released instead (an abort, an earlier failure, a close).
    fn wait_input(&self) -> bool;
    /// The first `bytes` of the output are final: the stream may copy
    /// them out (called with growing values).
    fn output_final(&self, bytes: usize);
}

/// A communicator's device side.
#[derive(Default)]
pub enum DeviceSlot {
    /// No operation on device memory yet.
    #[default]
    Unset,
    /// Set up on this device; the kernel path is off (some rank could not
    /// map its peers).
    Off(i32),
    /// Set up, kernel path on.
    On(Box<dyn DeviceSide>),
}

impl DeviceSlot {
    /// The device it was set up on, if any.
    pub fn device(&self) -> Option<i32> {
        match self {
            DeviceSlot::On(d) => Some(d.device()),
            DeviceSlot::Off(d) => Some(*d),
            DeviceSlot::Unset => None,
        }
    }
}

/// Whether `host_ids` (every rank's, by rank: [`Comms::host_ids`]) name
/// more than one host: such a communicator runs its device operations on
/// the cross-host path (the backend and the core decide alike from it).
pub fn spans_hosts(host_ids: &[u64]) -> bool {
    host_ids.windows(2).any(|w| w[0] != w[1])
}

/// One operation of a batch: `comm` indexes the batch's communicators in [`Comms`].
#[derive(Debug, Clone, Copy)]
pub struct Item {
    pub comm: usize,
    pub op: Op,
}

/// What the core lends a backend for one batch: its communicators, by index.
pub trait Comms {
    fn rank(&self, c: usize) -> usize;
    fn nranks(&self, c: usize) -> usize;
    /// "communicator <id> (rank r of n)", for messages.
    fn describe(&self, c: usize) -> String;
    /// The communicator's device side.
    fn device_slot(&self, c: usize) -> MutexGuard<'_, DeviceSlot>;
    /// Runs host-memory operations through the core, as one group (sends and
    /// receives of a communicator fused, communicators concurrently): the
    /// exchange of descriptors with peers, agreement, staged operations.
    ///
    /// # Safety
    /// As [`Backend::run`], for host memory.
    unsafe fn run_host(&self, items: &[Item]) -> Result<()>;
    /// Every rank's host identity (`WEFT_HOSTNAME`, else hostname, boot id
    /// and network namespace, as the bootstrap exchanged them), by rank:
    /// ranks whose identities differ never map each other's memory.
    fn host_ids(&self, c: usize) -> Vec<u64>;
    /// The communicator's host path for other threads (see [`HostRunner`]).
    fn host_runner(&self, c: usize) -> Arc<dyn HostRunner>;
    /// Runs `f` inside the observer's span of `ops` on communicator `c`
    /// (one operation, or a group when `group`), recording the backend's
    /// decision (`Decision::Device`: the kernel it planned).
    fn observed(
        &self,
        c: usize,
        ops: &[Op],
        group: bool,
        decision: Decision,
        f: &mut dyn FnMut() -> Result<()>,
    ) -> Result<()>;
}

/// A data-plane backend for one memory kind.
pub trait Backend: Sync {
    /// Runs a batch (one call, or a group's operations; host-memory
    /// operations may be part of it). The core has validated every
    /// operation and checked every communicator's state.
    ///
    /// # Safety
    /// Every operation's pointers must be valid for the sizes it names until
    /// its stream reaches it; every rank of each communicator must submit the
    /// matching operations.
    unsafe fn run(&self, comms: &dyn Comms, items: &[Item]) -> Result<()>;

    /// Sets up the device side of each `(communicator, device)` still
    /// without one, as its first device operation would (a collective of
    /// each: every rank calls this at the same point of its calls): the
    /// host-local communicator of a hierarchy is set up when the hierarchy
    /// is built, where every rank of the parent is, not at its first own
    /// operation, which for sends and receives not every local rank makes.
    ///
    /// # Safety
    /// Every device is a valid device of this process.
    unsafe fn set_up(&self, comms: &dyn Comms, devices: &[(usize, i32)]) -> Result<()>;

    /// `bytes` of memory on `device` for work enqueued on `stream` after
    /// this call, until [`free_scratch`](Self::free_scratch) on the same
    /// stream (stream-ordered: no wait for the GPU, and memory freed on
    /// one stream is reused by another only once that free has run): the
    /// intermediate blocks of a hierarchical collective across hosts.
    ///
    /// # Safety
    /// `stream` is a live stream of `device` (or NULL).
    unsafe fn alloc_scratch(&self, device: i32, bytes: usize, stream: *mut c_void) -> Result<u64>;

    /// Gives back what [`alloc_scratch`](Self::alloc_scratch) returned,
    /// once the work enqueued on `stream` so far is done with it.
    ///
    /// # Safety
    /// `ptr` came from `alloc_scratch` on `device` and is not used after
    /// the work enqueued on `stream` before this call.
    unsafe fn free_scratch(&self, device: i32, ptr: u64, stream: *mut c_void) -> Result<()>;

    /// Copies `bytes` from `src` to `dst`, both memory of `device`, on
    /// `stream` (after the work enqueued on it so far, without waiting
    /// for it): a hierarchical plan's step on the rank alone (blocks moved
    /// between rank order and host order).
    ///
    /// # Safety
    /// `stream` is a live stream of `device` (or NULL); both ranges are
    /// valid device memory, apart, until the stream passes the copy.
    unsafe fn copy_on_stream(
        &self,
        device: i32,
        dst: u64,
        src: u64,
        bytes: usize,
        stream: *mut c_void,
    ) -> Result<()>;
}

#[cfg(test)]
mod tests {
    use super::{AbortWord, spans_hosts};

    #[test]
    fn a_communicator_with_two_host_identities_spans_hosts() {
        // Identities as the bootstrap gives them (`sys::topology::host_id`
        // of each half's WEFT_HOSTNAME; its own tests show they differ).
        let (a, b) = (0x5157_a000_u64, 0x5157_b000_u64);
        assert!(spans_hosts(&[a, a, b, b]));
        assert!(spans_hosts(&[a, b]));
        assert!(!spans_hosts(&[a, a, a]));
        assert!(!spans_hosts(&[a]));
        assert!(!spans_hosts(&[]));
    }

    #[test]
    fn a_word_fires_until_retired() {
        let mut cell = Box::new(0u32);
        let w = AbortWord::new(&mut *cell);
        assert!(!w.fired());
        assert!(w.fire());
        assert!(w.fired());
        assert_eq!(*cell, 1);
        *cell = 0;
        w.retire();
        assert!(!w.fire(), "a retired word must not be written");
        assert_eq!(*cell, 0);
        assert!(!w.fired());
    }

    #[test]
    fn a_stall_is_reported_and_the_timeout_written_until_retired() {
        // abort, timeout_ms, stalled (as the CUDA backend's Status).
        let mut cell = Box::new((0u32, 0u32, 0u64));
        let w = AbortWord::new(&mut cell.0);
        assert_eq!(w.stalled(), None, "no stall watch yet");
        w.watch_stalls(
            &mut cell.1,
            &cell.2,
            Box::new(|a| format!("waits at {a:#x}")),
        );
        w.set_timeout(Some(std::time::Duration::from_millis(1500)));
        assert_eq!(cell.1, 1500);
        w.set_timeout(Some(std::time::Duration::from_micros(10)));
        assert_eq!(cell.1, 1, "a timeout below 1 ms is not 0 (never)");
        w.set_timeout(None);
        assert_eq!(cell.1, 0);
        assert_eq!(w.stalled(), None);
        cell.2 = 0x1000;
        assert_eq!(w.stalled().as_deref(), Some("waits at 0x1000"));
        w.retire();
        assert_eq!(w.stalled(), None, "a retired word reads nothing");
        w.set_timeout(Some(std::time::Duration::from_secs(1)));
        assert_eq!(cell.1, 0, "a retired word writes nothing");
    }
}
