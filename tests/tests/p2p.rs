//! Point-to-point that does not need the peer's receive to be posted first
//! (eager host sends), ranks as processes over shared memory and over TCP:
//! an unbatched `send(next); recv(prev)` on every rank of a ring completes at
//! 333 floats, 1 Mi floats and 16 Mi floats (64 MiB), as the first operation
//! and after a grouped exchange; a rank that sends then sleeps still
//! delivers; destroy with a send nobody receives returns an error in time.
//! The same with ranks as threads: `libcomm/tests/eager.rs`.

mod common;

use common::num;
use std::time::Duration;
use weft_tests::job::{self, JobSpec};

fn ring(n: usize, transport: &str) {
    let seed = common::seed().to_string();
    for first in ["333", "1048576", "16777216"] {
        let run = job::run(
            JobSpec::new(common::worker(), n, &["eager_ring", first])
                .env("WEFT_TRANSPORT", transport)
                .env("WEFT_TEST_SEED", &seed)
                .env("WEFT_TIMEOUT_MS", "60000")
                .timeout(Duration::from_secs(120)),
        );
        run.assert_success();
        for r in 0..n {
            assert_eq!(run.facts(r)["ring"], "ok", "{}", run.dump());
        }
        assert!(run.leaked_shm.is_empty(), "{:?}", run.leaked_shm);
    }
}

#[test]
fn unbatched_ring_2_ranks_shm() {
    ring(2, "shm");
}

#[test]
fn unbatched_ring_3_ranks_shm() {
    ring(3, "shm");
}

#[test]
fn unbatched_ring_2_ranks_tcp() {
    ring(2, "tcp");
}

#[test]
fn unbatched_ring_3_ranks_tcp() {
    ring(3, "tcp");
}

fn send_then_idle(transport: &str) {
    let run = job::run(
        JobSpec::new(common::worker(), 2, &["eager_idle"])
            .env("WEFT_TRANSPORT", transport)
            .env("WEFT_TEST_SEED", &common::seed().to_string())
            .timeout(Duration::from_secs(60)),
    );
    run.assert_success();
    // Rank 0 sleeps 4 s after its send: the receive must not wait for it.
    let ms = num(&run.facts(1), "recv_ms");
    assert!(ms < 3000, "the receive took {ms} ms:\n{}", run.dump());
}

#[test]
fn send_then_idle_delivers_shm() {
    send_then_idle("shm");
}

#[test]
fn send_then_idle_delivers_tcp() {
    send_then_idle("tcp");
}

fn destroy_pending(transport: &str) {
    let run = job::run(
        JobSpec::new(common::worker(), 2, &["eager_destroy"])
            .env("WEFT_TRANSPORT", transport)
            .env("WEFT_TIMEOUT_MS", "1500")
            .timeout(Duration::from_secs(60)),
    );
    run.assert_success();
    let f = run.facts(0);
    assert_eq!(f["destroy"], "error", "{}", run.dump());
    assert!(num(&f, "destroy_ms") < 4000, "{}", run.dump());
    assert_eq!(run.facts(1)["late_recv"], "error", "{}", run.dump());
    assert!(run.leaked_shm.is_empty(), "{:?}", run.leaked_shm);
}

#[test]
fn destroy_with_a_send_never_received_shm() {
    destroy_pending("shm");
}

#[test]
fn destroy_with_a_send_never_received_tcp() {
    destroy_pending("tcp");
}

/// `WEFT_EAGER_MAX_BYTES`: below the message size a send waits for its
/// receive (as every host send did before); by default it returns at once.
#[test]
fn eager_bytes_cap_makes_a_send_wait() {
    for (cap, waits) in [(None, false), (Some("1048576"), true)] {
        let mut spec = JobSpec::new(common::worker(), 2, &["eager_cap"])
            .env("WEFT_TEST_SEED", &common::seed().to_string())
            .timeout(Duration::from_secs(60));
        if let Some(c) = cap {
            spec = spec.env("WEFT_EAGER_MAX_BYTES", c);
        }
        let run = job::run(spec);
        run.assert_success();
        let ms = num(&run.facts(0), "send_ms");
        if waits {
            assert!(ms >= 1000, "cap {cap:?}: the send returned after {ms} ms");
        } else {
            assert!(ms < 1000, "no cap: the send took {ms} ms");
        }
    }
}
