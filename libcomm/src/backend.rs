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

use crate::algo::tuner::Decision;
use crate::error::Result;
use crate::op::Op;
use std::any::Any;
use std::sync::{Arc, Mutex, MutexGuard};

/// The word a communicator's kernels poll to stop waiting on peers (a `u32`
/// in pinned host memory mapped into the device), reachable without the
/// communicator's device slot: an operation may hold that slot's lock while
/// the kernels it launched spin on a dead peer, and the abort must still get
/// through (ncclCommAbort, the device watch in `watch.rs`). The backend
/// retires it before it frees the memory; firing a retired word does nothing.
pub struct AbortWord {
    at: Mutex<usize>,
}

impl AbortWord {
    /// `at`: live, writable memory until [`AbortWord::retire`].
    pub fn new(at: *mut u32) -> Arc<AbortWord> {
        Arc::new(AbortWord {
            at: Mutex::new(at as usize),
        })
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
}

#[cfg(test)]
mod tests {
    use super::AbortWord;

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
}
