//! The `weft` command line, built inside this package so tests can run
//! `weft sidecar` (Cargo gives tests the paths of their own package's binaries only).

use clap::Parser;

fn main() {
    std::process::exit(weft::cli::dispatch(weft::cli::Cli::parse()));
}
