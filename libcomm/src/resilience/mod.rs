//! Surviving lost ranks, on top of the communicator: reconfiguring one with
//! NCCL's semantics (`recovery.rs`: revoke, shrink, grow) and the training
//! loop built on it (`resilient.rs`: shrink, redo the step, grow back, with
//! the launcher's recovery board). See docs/FAULT-TOLERANCE.md.

pub(crate) mod recovery;
pub mod resilient;

pub use recovery::ShrinkMode;
