//! Communicator lifecycle across processes: splits, non-blocking init with
//! concurrent splits, abort, a killed rank, mismatched calls, bad input.

mod common;

use common::num;
use std::collections::HashMap;
use std::time::Duration;
use weft_tests::job::{self, JobRun, JobSpec};

#[test]
fn split_colors_keys_nocolor_nested_and_concurrent_with_parent() {
    let run =
        job::run(JobSpec::new(common::worker(), 6, &["split"]).timeout(Duration::from_secs(120)));
    run.assert_success();
    for r in 0..6 {
        assert_eq!(run.facts(r)["split"], "ok");
    }
    assert!(run.leaked_shm.is_empty(), "{:?}", run.leaked_shm);
}

/// The DESIGN.md failure: non-blocking init, then splits from several threads
/// at once with collectives in between, many times.
#[test]
fn nonblocking_init_and_concurrent_splits_repeated() {
    let run = job::run(
        JobSpec::new(common::worker(), 4, &["nbsplit", "25", "4"])
            .timeout(Duration::from_secs(300)),
    );
    run.assert_success();
    for r in 0..4 {
        assert_eq!(num(&run.facts(r), "reps"), 25);
    }
    assert!(run.leaked_shm.is_empty(), "{:?}", run.leaked_shm);
}

#[test]
fn abort_fails_every_rank_within_seconds() {
    let run =
        job::run(JobSpec::new(common::worker(), 4, &["abort"]).timeout(Duration::from_secs(60)));
    run.assert_success();
    assert!(num(&run.facts(0), "aborted_ms") < 2000);
    for r in 1..4 {
        let f = run.facts(r);
        assert_eq!(f["aborted_by"], "0", "rank {r}: {}", run.dump());
        // Blocked since the start; rank 0 aborts after 500 ms.
        assert!(
            num(&f, "error_ms") < 3500,
            "rank {r} took {} ms",
            f["error_ms"]
        );
    }
}

/// The last rank of `run` was SIGKILLed and every other one survived it,
/// reporting a `RemoteError`: returns the survivors' facts, by rank.
fn survivors_of_a_killed_last_rank(run: &JobRun) -> Vec<HashMap<String, String>> {
    let victim = run.ranks.len() - 1;
    assert_eq!(
        run.ranks[victim].signal,
        Some(libc::SIGKILL),
        "{}",
        run.dump()
    );
    (0..victim)
        .map(|r| {
            assert_eq!(run.ranks[r].code, Some(0), "survivor {r}:\n{}", run.dump());
            let f = run.facts(r);
            assert_eq!(f["kind"], "RemoteError", "rank {r}: {}", run.dump());
            f
        })
        .collect()
}

fn killed_rank(n: usize, transport: &str) {
    let run = job::run(
        JobSpec::new(common::worker(), n, &["kill"])
            .env("WEFT_TRANSPORT", transport)
            .env("WEFT_PEER_TIMEOUT_MS", "2000")
            .timeout(Duration::from_secs(60)),
    );
    for (r, f) in survivors_of_a_killed_last_rank(&run).iter().enumerate() {
        assert!(
            num(f, "detect_ms") < 4000,
            "rank {r} needed {} ms",
            f["detect_ms"]
        );
    }
    assert!(
        run.elapsed < Duration::from_secs(20),
        "job took {:?}",
        run.elapsed
    );
    assert!(run.leaked_shm.is_empty(), "{:?}", run.leaked_shm);
}

#[test]
fn sigkilled_rank_fails_survivors_shm() {
    killed_rank(4, "shm");
}

#[test]
fn sigkilled_rank_fails_survivors_tcp() {
    killed_rank(3, "tcp");
}

/// The `mismatch` worker on 3 ranks: the mismatched collective fails on
/// every rank within 3 s, and the world communicator still works after.
fn mismatched_counts_fail(spec: JobSpec) {
    let run = job::run(spec.timeout(Duration::from_secs(60)));
    run.assert_success();
    for r in 0..3 {
        let f = run.facts(r);
        assert!(num(&f, "mismatch_ms") < 3000, "{}", run.dump());
        assert_eq!(f["world"], "ok");
    }
}

#[test]
fn mismatched_counts_fail_that_communicator_only() {
    mismatched_counts_fail(JobSpec::new(common::worker(), 3, &["mismatch"]));
}

/// Counts so different that rank 0 all-reduces through the latency slots and
/// the others through the rings: still an error on every rank, not a hang.
#[test]
fn mismatched_counts_across_algorithms_fail() {
    mismatched_counts_fail(
        JobSpec::new(common::worker(), 3, &["mismatch"]).env("WEFT_TEST_MISMATCH_BIG", "1"),
    );
}

#[test]
fn bad_input_gets_clear_errors() {
    let run =
        job::run(JobSpec::new(common::worker(), 3, &["badinput"]).timeout(Duration::from_secs(90)));
    run.assert_success();
    for r in 0..3 {
        assert_eq!(run.facts(r)["badinput"], "ok", "{}", run.dump());
    }
}

/// A misspelt `WEFT_*` variable is named once per rank process, with the
/// declared variable it is closest to, when the communicator initialises.
#[test]
fn init_warns_once_about_a_misspelt_variable() {
    let run = job::run(
        JobSpec::new(common::worker(), 2, &["alltoall", "1", "16"])
            // Spelt in two parts: the contract's scan takes whole literals
            // for variables the code reads.
            .env(concat!("WEFT_", "CUDA_THREAD"), "64")
            .timeout(Duration::from_secs(60)),
    );
    run.assert_success();
    let want = "weft: unknown variable WEFT_CUDA_THREAD; did you mean WEFT_CUDA_THREADS?";
    for r in &run.ranks {
        assert_eq!(r.stderr.matches(want).count(), 1, "{}", run.dump());
    }
}

/// A rank killed while its peers are idle (their work on a GPU has no host
/// waiter): polling ncclCommGetAsyncError notices it and names the rank.
#[test]
fn a_peer_killed_while_idle_shows_in_async_error_shm() {
    let n = 3;
    let ctl = std::env::temp_dir().join(format!("weft-idle-kill-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&ctl);
    std::fs::create_dir_all(&ctl).unwrap();
    let run = job::run(
        JobSpec::new(common::worker(), n, &["idle_kill"])
            .env("WEFT_TRANSPORT", "shm")
            .env("WEFT_TEST_CTL", &ctl.display().to_string())
            .timeout(Duration::from_secs(60)),
    );
    let _ = std::fs::remove_dir_all(&ctl);
    for (r, f) in survivors_of_a_killed_last_rank(&run).iter().enumerate() {
        assert_eq!(f["names_victim"], "true", "rank {r}: {}", run.dump());
        assert!(num(f, "detect_ms") < 3000, "rank {r}: {}", run.dump());
    }
}

/// Over TCP the survivors blame the rank that died, not a healthy rank whose
/// connection closed because it saw the failure first (4 ranks, rank 2 of
/// 4 SIGKILLed, repeated: which survivor notices first varies).
#[test]
fn survivors_over_tcp_blame_the_dead_rank() {
    for round in 0..3 {
        let run = job::run(
            JobSpec::new(common::worker(), 4, &["kill"])
                .env("WEFT_TRANSPORT", "tcp")
                .env("WEFT_TEST_VICTIM", "2")
                .env("WEFT_PEER_TIMEOUT_MS", "2000")
                .timeout(Duration::from_secs(60)),
        );
        assert_eq!(run.ranks[2].signal, Some(libc::SIGKILL), "{}", run.dump());
        for r in [0, 1, 3] {
            assert_eq!(run.ranks[r].code, Some(0), "survivor {r}:\n{}", run.dump());
            let err = run.ranks[r]
                .stderr
                .lines()
                .find(|l| l.contains("error:"))
                .unwrap_or_else(|| {
                    panic!("round {round}: rank {r} printed no error:\n{}", run.dump())
                })
                .to_string();
            assert!(
                err.contains("rank 2 "),
                "round {round}: rank {r} blames someone else: {err}\n{}",
                run.dump()
            );
            for healthy in [0, 1, 3] {
                assert!(
                    !err.contains(&format!("rank {healthy} (pid"))
                        && !err.contains(&format!("rank {healthy} failed")),
                    "round {round}: rank {r} names healthy rank {healthy}: {err}"
                );
            }
        }
    }
}
