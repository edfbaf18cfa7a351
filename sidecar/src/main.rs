//! The `weft` binary: parse the command line and hand off to [`weft::cli`].

use clap::Parser;

fn main() {
    let cli = weft::cli::Cli::parse();
    // A misspelt WEFT_* variable would otherwise be ignored without a word.
    // The ranks `weft bench` starts inherit its environment: it warned already.
    if !matches!(cli.command, weft::cli::Command::BenchRank(_)) {
        weft_contract::params::warn_unknown_once();
    }
    std::process::exit(weft::cli::dispatch(cli));
}
