//! Weft's per-pod side: the `weft` command line and the libraries behind it.
//!
//! The modules stand in layers, each importing only from the layers below:
//!
//! 1. [`cli`]: the command line, which dispatches to a command;
//! 2. the commands: [`mod@run`] (`weft run`), [`mod@bench`] (`weft bench`),
//!    [`startup`] (`weft sidecar`: composes the engine and the proxy),
//!    [`ras`] (`weft ras`);
//! 3. what they run: [`mod@launch`] (the local launcher, also a library for
//!    tests), [`engine`] (the per-pod engine), [`proxy`] (the network
//!    proxy), [`mod@embedded`] (the engine inside a rank process);
//! 4. leaves: [`seams`] (the interfaces between engine and proxy),
//!    [`metrics`], [`log`], [`error`], [`ras_report`] (the report as text),
//!    [`arg_values`] (parsers of command-line values).
//!
//! The re-exports below are for users of the crate; its own modules name
//! the crate `weft-agent` directly.

pub mod arg_values;
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
pub mod ras_report;
pub mod run;
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
