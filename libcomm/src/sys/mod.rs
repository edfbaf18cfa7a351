//! The operating system: socket options in one place (`sockets.rs`),
//! descriptors over Unix sockets (`fdpass.rs`), host identity, process
//! liveness and cores (`topology.rs`).

pub mod fdpass;
pub mod sockets;
pub(crate) mod topology;
