//! The `weft` binary: parse the command line and hand off to [`weft::cli`].

use clap::Parser;

fn main() {
    let cli = weft::cli::Cli::parse();
    std::process::exit(weft::cli::dispatch(cli));
}
