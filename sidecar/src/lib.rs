//! Weft's per-pod side: the `weft` command line and the libraries behind it.
//!
//! Today this holds the local launcher ([`mod@launch`], used by `weft run`, by
//! `weft bench` and by multi-process tests) and the command-line definition
//! ([`cli`]). The sidecar engine (proxy, RAS, telemetry) lands here as further
//! modules and subcommands.

pub mod bench;
pub mod cli;
pub mod embedded;
pub mod engine;
pub mod error;
pub mod launch;
pub mod log;
pub mod metrics;
pub mod proxy;
pub mod ras;
pub mod seams;
pub mod startup;

/// The rank side (crate `weft-agent`): [`agent::install_from_env`] attaches
/// this process to its pod's sidecar, or runs the sidecar's engine in-process
/// ([`mod@embedded`]).
pub mod agent {
    pub use crate::embedded::install_from_env;
    pub use weft_agent::{Agent, installed};
}
/// The sidecar's gRPC client (crate `weft-agent`).
pub use weft_agent::client;
/// The `weft.v1` protocol, generated once in crate `weft-agent`.
pub use weft_agent::rpc;

pub use launch::{
    LaunchError, LaunchOutcome, LaunchSpec, RankOutput, RankResult, StopReason, launch,
};
