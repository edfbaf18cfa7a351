//! The communicator: the public handle, its lifecycle, the one entry point
//! of operations and group calls.

pub(crate) mod communicator;
pub(crate) mod flusher;
pub(crate) mod group;
pub(crate) mod watch;

pub use communicator::Communicator;
pub use group::Group;
