//! Connection setup at scale (the DESIGN.md failure: a custom all-to-all of
//! isend/irecv at 32+ ranks failing on accept): 64 processes on this 2-core
//! machine, an all-to-all of grouped send/recv, repeated, over shared memory
//! and over TCP (lazily connected, 2016 connections).

mod common;

use std::time::Duration;
use weft_tests::job::{self, JobSpec};

fn alltoall(n: usize, transport: &str, reps: &str) {
    let run = job::run(
        JobSpec::new(common::worker(), n, &["alltoall", reps, "16"])
            .env("WEFT_TRANSPORT", transport)
            .timeout(Duration::from_secs(240)),
    );
    run.assert_success();
    for r in 0..n {
        assert!(
            run.facts(r).contains_key("alltoall_ms"),
            "rank {r} did not finish:\n{}",
            run.dump()
        );
    }
    let errors: Vec<_> = run
        .ranks
        .iter()
        .filter(|r| r.stderr.contains("WARN") || r.stderr.contains("rror"))
        .collect();
    assert!(errors.is_empty(), "ranks reported errors:\n{}", run.dump());
    assert!(run.leaked_shm.is_empty(), "{:?}", run.leaked_shm);
    eprintln!("{n} ranks over {transport}: {:.1?}", run.elapsed);
}

#[test]
fn alltoall_64_ranks_shm() {
    alltoall(64, "auto", "5");
}

#[test]
fn alltoall_64_ranks_tcp() {
    alltoall(64, "tcp", "3");
}
