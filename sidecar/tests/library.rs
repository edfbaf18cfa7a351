//! The launcher as a library (`weft::launch`), as `weft bench` and tests use it.

use std::time::Duration;

use weft::{LaunchError, LaunchSpec, StopReason, launch};

fn sh(ranks: usize, script: &str) -> LaunchSpec {
    let mut spec = LaunchSpec::new(ranks, "sh");
    spec.args = vec!["-c".into(), script.into()];
    spec.capture = true;
    spec.timeout = Some(Duration::from_secs(30));
    spec
}

#[test]
fn captures_each_ranks_output() {
    let mut spec = sh(3, "echo out$WEFT_RANK; printf err$RANK >&2; echo $EXTRA");
    spec.env_extra = vec![("EXTRA".into(), "x".into())];
    spec.job = Some("libtest".into());
    let o = launch(&spec).unwrap();
    assert_eq!(o.exit_code(), 0);
    assert!(o.success());
    assert_eq!(o.stop, None);
    assert_eq!(o.job, "libtest");
    assert_eq!(o.ranks.len(), 3);
    for (i, r) in o.ranks.iter().enumerate() {
        assert_eq!(r.rank, i);
        assert!(r.status.success());
        assert!(r.pid > 0);
        assert_eq!(r.output.stdout, format!("out{i}\nx\n").into_bytes());
        assert_eq!(
            r.output.stderr,
            format!("err{i}").into_bytes(),
            "raw bytes, no newline added"
        );
    }
}

#[test]
fn reports_the_first_failure() {
    let o = launch(&sh(3, "if [ $RANK = 1 ]; then exit 7; fi; sleep 30")).unwrap();
    assert_eq!(o.exit_code(), 7);
    assert!(o.elapsed < Duration::from_secs(10));
    let f = o.first_failure().unwrap();
    assert_eq!(f.rank, 1);
    assert_eq!(f.status.code(), Some(7));
    assert!(matches!(
        o.stop,
        Some(StopReason::RankFailed { rank: 1, .. })
    ));
}

/// Rank 3 is SIGKILLed; the others notice at once (as libcomm's peers do
/// within milliseconds) and exit with a code of their own, usually within
/// the launcher's polling tick. The killed rank is the one to blame, not
/// the lowest-numbered rank that exited (which it was before).
#[test]
fn a_killed_rank_is_blamed_over_peers_that_exit_in_reaction() {
    let dir = std::env::temp_dir().join(format!("weft-blame-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let dead = dir.join("dead");
    // Rank 3 names itself and is killed; the others exit as soon as it is
    // dead (a zombie counts, as libcomm's liveness check does), like peers
    // that notice the death: often in the same tick of the launcher.
    let script = format!(
        "if [ $WEFT_RANK = 3 ]; then echo $$ > {d}.tmp; mv {d}.tmp {d}; kill -9 $$; fi; \
         while [ ! -s {d} ]; do :; done; p=$(cat {d}); \
         while [ -e /proc/$p ] && ! grep -q '^State:.*Z' /proc/$p/status 2>/dev/null; do :; done; \
         exit 5",
        d = dead.display()
    );
    for round in 0..5 {
        let _ = std::fs::remove_file(&dead);
        let o = launch(&sh(4, &script)).unwrap();
        assert!(
            matches!(o.stop, Some(StopReason::RankFailed { rank: 3, .. })),
            "round {round}: {:?}",
            o.stop
        );
        assert_eq!(o.exit_code(), 137, "round {round}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn spawn_errors_are_typed() {
    let err = launch(&LaunchSpec::new(2, "/nonexistent/weft-test")).unwrap_err();
    assert!(matches!(err, LaunchError::Spawn { rank: 0, .. }), "{err:?}");
    assert_eq!(err.exit_code(), 127);
    assert_eq!(
        err.to_string(),
        "cannot start '/nonexistent/weft-test': No such file or directory"
    );
    let err = launch(&LaunchSpec::new(0, "true")).unwrap_err();
    assert!(matches!(err, LaunchError::InvalidSpec(_)));
    assert_eq!(err.exit_code(), 2);
}
