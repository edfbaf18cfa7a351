//! Issue 19 (1): the operator binary against a minimal fake API server
//! that holds one CollectiveJob the operator cannot decode and never answers
//! watches. The operator must still become ready (its watch works: the bad
//! job is skipped, not fatal) and must exit promptly on SIGTERM, within its
//! shutdown timeout, whatever is still pending.

mod common;

use std::time::Duration;

use common::{Operator, Reply, empty_list, start_api};

const BAD_JOB: &str = r#"{"apiVersion":"weft.dev/v1alpha1","kind":"CollectiveJob",
 "metadata":{"name":"bad","namespace":"ml","uid":"u1","resourceVersion":"5","generation":1},
 "spec":{"template":{"spec":{"containers":[{"name":"main","image":"busybox","command":"sleep 1"}]}}}}"#;

#[test]
fn ready_despite_an_undecodable_job_and_exits_on_sigterm() {
    let api_port = start_api(|r| {
        let path = r.path();
        if r.is_watch() {
            // A watch: never answered, as a frozen connection.
            Reply::Hold
        } else if path.ends_with("/collectivejobs") {
            Reply::Json(
                200,
                format!(
                    r#"{{"apiVersion":"weft.dev/v1alpha1","kind":"CollectiveJobList","metadata":{{"resourceVersion":"7"}},"items":[{BAD_JOB}]}}"#
                ),
            )
        } else if path.ends_with('s') && !path.contains("/events") {
            empty_list()
        } else {
            Reply::Json(200, "{}".into())
        }
    });
    let mut op = Operator::start(
        "sigterm",
        api_port,
        &["--leader-elect", "false", "--shutdown-timeout-secs", "3"],
    );
    op.wait_ready(Duration::from_secs(30));

    op.sigterm();
    op.wait_exit(Duration::from_secs(10), "SIGTERM (shutdown timeout 3 s)");
    let err = op.log();
    assert!(err.contains("SIGTERM received"), "{err}");
    assert!(
        err.contains("cannot decode a CollectiveJob"),
        "the bad job is reported, not fatal:\n{err}"
    );
}
