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
use std::sync::MutexGuard;

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
