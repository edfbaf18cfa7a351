//! The operating system: socket options, descriptor passing, host identity
//! and processes.

pub(crate) mod fdpass;
pub mod sockets;
pub(crate) mod topology;
