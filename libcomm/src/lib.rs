//! libcomm: Weft's communication library.
//!
//! Communicators over ranks (processes or threads) with the collectives of
//! NCCL — all-reduce, all-gather, reduce-scatter, broadcast, reduce,
//! all-to-all, gather, scatter, send/recv and group calls — on host memory,
//! over shared memory within a host and TCP across hosts. Its lifecycle is an
//! explicit state machine; every failure is a typed error, never a hang or a
//! crash. See `docs/ARCHITECTURE.md` in the repository.
//!
//! ```no_run
//! use libcomm::{Communicator, ReduceOp};
//! // Started by `weft run -n 4 -- my_program`:
//! let comm = Communicator::from_env()?;
//! let mut grads = vec![1.0f32; 1024];
//! comm.all_reduce_in_place(&mut grads, ReduceOp::Avg)?;
//! comm.destroy()?;
//! # Ok::<(), libcomm::Error>(())
//! ```

mod algo;
mod bootstrap;
mod comm;
mod config;
pub mod crosshost;
pub mod cuda;
mod data;
mod error;
#[cfg(test)]
mod fuzz;
pub(crate) mod log;
pub mod net;
pub mod observe;
mod op;
mod progress;
mod resilience;
mod state;
mod sys;
mod transport;

pub use bootstrap::handshake;
pub use bootstrap::unique_id::{UNIQUE_ID_BYTES, UniqueId};
pub use comm::cross_mover::CommMover;
pub use comm::{Communicator, Group};
pub use config::{Config, TransportPref};
pub use data::types::{DataType, Element, F8E4M3, F8E5M2, ReduceOp};
pub use error::{Error, ErrorKind, Result};
/// The log level `WEFT_DEBUG` / `NCCL_DEBUG` set (read once per process).
pub use log::{Level as LogLevel, level as log_level, line as log_line};
pub use op::tuner::{Algo, AlgoOverride, Coll, Decision};
pub use op::{Buf, Memory, Op, OpKind};
pub use resilience::{ShrinkMode, resilient};
pub use state::CommState;
pub use sys::{fdpass, sockets};
pub use transport::sidecar_link;

/// Version as NCCL encodes it (major*10000 + minor*100 + patch): we implement
/// the API of NCCL 2.28.
pub const NCCL_COMPAT_VERSION: i32 = 22803;

/// How this process's communicators reached peers on other hosts so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TransportStats {
    /// Direct TCP data connections opened (embedded mode, or `WEFT_PROXY=0`).
    pub tcp_connections: u64,
    /// Channels opened through the sidecar proxy.
    pub proxy_channels: u64,
}

pub fn transport_stats() -> TransportStats {
    use std::sync::atomic::Ordering::Relaxed;
    TransportStats {
        tcp_connections: transport::tcp::CONNECTIONS_OPENED.load(Relaxed),
        proxy_channels: transport::sidecar_rings::CHANNELS_OPENED.load(Relaxed),
    }
}

/// What this process's listeners (the peer endpoint, bootstrap roots) have
/// refused, and what they hold now: see docs/ARCHITECTURE.md, "Hostile
/// networks".
pub use transport::tcp::ListenerStats;

pub fn listener_stats() -> ListenerStats {
    transport::tcp::listener_stats()
}

/// Weft's own version.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
