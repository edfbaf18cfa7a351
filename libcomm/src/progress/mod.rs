//! A Ready communicator's live resources and the engine that drives its
//! transfers to completion.

pub(crate) mod eager;
pub(crate) mod exec;
pub(crate) mod fault;
pub(crate) mod resources;
pub(crate) mod xfer;
