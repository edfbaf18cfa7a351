//! Surviving lost ranks: reconfiguring a communicator (revoke, shrink,
//! grow) and the training loop built on it.

pub(crate) mod recovery;
pub mod resilient;

pub use recovery::ShrinkMode;
