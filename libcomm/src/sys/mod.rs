//! The operating system: socket options in one place (`sockets.rs`),
//! descriptors over Unix sockets (`fdpass.rs`), host identity, process
//! liveness and cores (`topology.rs`), how a thread waits microseconds
//! (`backoff.rs`), which CPUs a thread runs on (`affinity.rs`); and a mutex lock that outlives a panicked holder.

pub(crate) mod affinity;
pub(crate) mod backoff;
pub mod fdpass;
pub mod sockets;
pub(crate) mod topology;

use std::sync::{Mutex, MutexGuard};

/// Locks `m`, past a panic of another holder (the data stays consistent:
/// every holder leaves it so).
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
