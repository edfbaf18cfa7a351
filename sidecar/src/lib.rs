//! Weft's per-pod side: the `weft` command line and the libraries behind it.
//!
//! Today this holds the local launcher ([`mod@launch`], used by `weft run`, by
//! `weft bench` and by multi-process tests) and the command-line definition
//! ([`cli`]). The sidecar engine (proxy, RAS, telemetry) lands here as further
//! modules and subcommands.

pub mod agent;
pub mod bench;
pub mod cli;
pub mod client;
pub mod engine;
pub mod error;
pub mod launch;
pub mod log;
pub mod metrics;
pub mod proxy;
pub mod ras;
pub mod rpc;
pub mod seams;
pub mod startup;

pub use launch::{
    LaunchError, LaunchOutcome, LaunchSpec, RankOutput, RankResult, StopReason, launch,
};
