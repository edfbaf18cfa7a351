//! The `weft` command line, the top of the crate: each subcommand is a
//! variant of [`Command`] whose argument struct and handler live in the
//! subcommand's module ([`mod@crate::run`], [`mod@crate::bench`],
//! [`crate::startup`] for `weft sidecar`, [`crate::ras`]); [`dispatch`] hands
//! down to the handler and returns the process exit code. Nothing below
//! imports this module.

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "weft",
    version,
    about = "Weft: Kubernetes-native collective communication"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Start N ranks of a command on this machine, as the operator would in pods.
    #[command(after_help = crate::run::HELP)]
    Run(crate::run::RunArgs),
    /// Measure a collective across N local ranks (nccl-tests' table).
    #[command(after_help = crate::bench::args::HELP)]
    Bench(crate::bench::BenchArgs),
    /// The per-pod engine: serves the pod's ranks on a Unix socket (RAS, telemetry, lifecycle).
    Sidecar(crate::startup::SidecarArgs),
    /// Report the job's health from the sidecar's snapshot.
    Ras(crate::ras::RasArgs),
    /// One rank of `weft bench` (started by it, not by hand).
    #[command(name = "bench-rank", hide = true)]
    BenchRank(crate::bench::BenchArgs),
}

/// Runs the parsed command line; returns the exit code.
pub fn dispatch(cli: Cli) -> i32 {
    match cli.command {
        Command::Run(args) => crate::run::run(args),
        Command::Bench(args) => crate::bench::run(args),
        Command::BenchRank(args) => crate::bench::rank(args),
        Command::Sidecar(args) => crate::startup::run(args),
        Command::Ras(args) => crate::ras::run(args),
    }
}
