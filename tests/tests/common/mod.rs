//! Helpers shared by the multi-process test files.
#![allow(dead_code)]

use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

pub fn worker() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_rank-worker"))
}

/// The test build of the `weft` command line (its `weft-cli` binary).
pub fn cli() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_weft-cli"))
}

/// Wall-clock milliseconds since the Unix epoch: the clock the ranks stamp
/// their facts with (`failed_at_ms`, ...), so times compare across processes.
pub fn now_ms() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis()
}

/// The data seed: `WEFT_TEST_SEED` to reproduce a failure, else fresh per run
/// (printed, so every failure names it).
pub fn seed() -> u64 {
    let s = std::env::var("WEFT_TEST_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| {
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
                % 1_000_000_007
        });
    eprintln!("data seed {s} (rerun with WEFT_TEST_SEED={s})");
    s
}

pub fn num(facts: &std::collections::HashMap<String, String>, key: &str) -> u64 {
    facts
        .get(key)
        .unwrap_or_else(|| panic!("rank did not report {key}: {facts:?}"))
        .parse()
        .unwrap_or_else(|_| panic!("{key} is not a number: {facts:?}"))
}

/// `n` network-namespace hosts, or `None` (the test skips) where `ip netns`
/// is not permitted; CI installs iproute2 and runs as root, so there a
/// missing namespace is a failure.
pub fn netns_hosts(n: usize) -> Option<weft_tests::netns::Net> {
    match weft_tests::netns::Net::create(n) {
        Ok(net) => Some(net),
        Err(e) => {
            weft_testkit::skip_outside_ci(
                false,
                &format!("cannot create network namespaces here ({e})"),
            );
            None
        }
    }
}
