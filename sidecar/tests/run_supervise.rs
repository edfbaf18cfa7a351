//! `weft run` supervision: exit codes, stopping the others, signals, timeouts,
//! no orphans, shared-memory cleanup.

mod common;

use std::time::{Duration, Instant};

use common::*;

#[test]
fn all_ranks_succeed_exit_zero() {
    let run = weft(&["run", "-n", "3", "true"]);
    assert_eq!(run.code, Some(0));
    assert!(run.stderr.is_empty(), "{}", run.err());
}

#[test]
fn first_failing_code_propagates_and_others_are_stopped() {
    let script = "if [ $WEFT_RANK = 2 ]; then sleep 0.3; exit 3; fi; sleep 30";
    let run = weft(&["run", "-n", "4", "--", "sh", "-c", script]);
    assert_eq!(run.code, Some(3), "{}", run.err());
    assert!(
        run.elapsed < Duration::from_secs(10),
        "took {:?}",
        run.elapsed
    );
    let err = run.err();
    assert!(
        err.contains("weft run: rank 2 (pid ")
            && err.contains(") exited with code 3; stopping the other 3 ranks"),
        "{err}"
    );
}

/// Shell that waits until `n` files `g<rank>` exist in `dir` (all ranks ready).
fn wait_all(dir: &std::path::Path, n: usize) -> String {
    format!(
        "until [ $(ls {} | grep -c '^g[0-9]*$') -ge {n} ]; do sleep 0.02; done",
        dir.display()
    )
}

#[test]
fn rank_ignoring_sigterm_is_killed_after_grace() {
    // Rank 0 fails only once rank 1 ignores SIGTERM, so only SIGKILL can end rank 1.
    let dir = scratch("grace");
    let script = format!(
        "if [ $RANK = 0 ]; then {}; exit 5; fi; trap '' TERM; touch {}/g1; sleep 30",
        wait_all(&dir, 1),
        dir.display()
    );
    let run = weft(&[
        "run", "-n", "2", "--grace", "0.5", "--", "sh", "-c", &script,
    ]);
    let _ = std::fs::remove_dir_all(dir);
    assert_eq!(run.code, Some(5));
    assert!(
        run.elapsed >= Duration::from_millis(500),
        "grace not honoured: {:?}",
        run.elapsed
    );
    assert!(
        run.elapsed < Duration::from_secs(10),
        "took {:?}",
        run.elapsed
    );
    assert!(run.err().contains("SIGKILL"), "{}", run.err());
}

#[test]
fn rank_killed_by_sigkill_gives_137() {
    let script = "if [ $RANK = 1 ]; then kill -9 $$; fi; sleep 30";
    let run = weft(&["run", "-n", "3", "--", "sh", "-c", script]);
    assert_eq!(run.code, Some(137), "{}", run.err());
    assert!(run.elapsed < Duration::from_secs(10));
    assert!(run.err().contains("rank 1 (pid "), "{}", run.err());
    assert!(
        run.err().contains("killed by signal 9 (SIGKILL)"),
        "{}",
        run.err()
    );
}

#[test]
fn timeout_stops_everything_with_124() {
    let run = weft(&["run", "-n", "2", "--timeout", "0.5", "--", "sleep", "30"]);
    assert_eq!(run.code, Some(124));
    assert!(
        run.elapsed < Duration::from_secs(10),
        "took {:?}",
        run.elapsed
    );
    assert!(run.err().contains("timed out"), "{}", run.err());
}

#[test]
fn missing_command_is_127() {
    let run = weft(&["run", "-n", "2", "--", "weft-no-such-command", "x"]);
    assert_eq!(run.code, Some(127));
    assert!(
        run.err()
            .contains("weft run: cannot start 'weft-no-such-command': No such file or directory"),
        "{}",
        run.err()
    );
}

/// Starts `weft run` whose ranks write `<dir>/<rank>` with their pid when ready.
fn start_ready(
    n: &str,
    grace: &str,
    body: &str,
) -> (std::process::Child, std::path::PathBuf, Instant) {
    let dir = scratch("ready");
    let script = format!(
        "{body}; echo $$ > {}/r$RANK.tmp; mv {0}/r$RANK.tmp {0}/r$RANK; while :; do sleep 0.05; done",
        dir.display()
    );
    let child = weft_cmd(&["run", "-n", n, "--grace", grace, "--", "sh", "-c", &script])
        .spawn()
        .unwrap();
    (child, dir, Instant::now())
}

fn pids_in(files: Vec<String>) -> Vec<i32> {
    files.iter().map(|s| s.trim().parse().unwrap()).collect()
}

#[test]
fn sigterm_to_weft_is_forwarded_to_ranks() {
    let (child, dir, start) = start_ready("3", "10", "trap 'echo got-term; exit 0' TERM");
    let _ = wait_files(&dir, 3);
    // SAFETY: signalling our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let run = finish(child, start);
    assert_eq!(run.code, Some(128 + libc::SIGTERM), "{}", run.err());
    for rank in 0..3 {
        assert!(
            run.out().contains(&format!("[{rank}] got-term")),
            "rank {rank}: {}",
            run.out()
        );
    }
    assert!(run.err().contains("received SIGTERM"), "{}", run.err());
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn second_sigint_kills_ranks_that_ignore_the_first() {
    // Ranks ignore INT and TERM; grace is 20 s, so only the escalation can end them quickly.
    let (child, dir, start) = start_ready("2", "20", "trap '' INT TERM");
    let pids = pids_in(wait_files(&dir, 2));
    let pid = child.id() as i32;
    // SAFETY: signalling our own child.
    unsafe { libc::kill(pid, libc::SIGINT) };
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        pids.iter().all(|&p| alive(p)),
        "the first SIGINT is ignored by the ranks"
    );
    unsafe { libc::kill(pid, libc::SIGINT) };
    let run = finish(child, start);
    assert_eq!(run.code, Some(130), "{}", run.err());
    assert!(run.elapsed < Duration::from_secs(10));
    assert_all_gone(&pids);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn no_orphans_when_a_rank_fails() {
    // Every rank leaves a grandchild in its process group; rank 1 then fails.
    let dir = scratch("orphans");
    let script = format!(
        "sleep 60 & echo $! > {d}/g$RANK.tmp; mv {d}/g$RANK.tmp {d}/g$RANK; \
         if [ $RANK = 1 ]; then {}; exit 4; fi; wait",
        wait_all(&dir, 3),
        d = dir.display()
    );
    let run = weft(&["run", "-n", "3", "--", "sh", "-c", &script]);
    assert_eq!(run.code, Some(4), "{}", run.err());
    let pids = pids_in(wait_files(&dir, 3));
    assert_all_gone(&pids);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn background_children_of_a_successful_rank_are_killed() {
    let dir = scratch("bg");
    let script = format!("sleep 60 & echo $! > {}/g$RANK", dir.display());
    let run = weft(&["run", "-n", "2", "--", "sh", "-c", &script]);
    assert_eq!(run.code, Some(0), "{}", run.err());
    assert!(
        run.elapsed < Duration::from_secs(10),
        "weft waited for the background child"
    );
    let pids = pids_in(wait_files(&dir, 2));
    assert_all_gone(&pids);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn ranks_die_when_weft_is_sigkilled() {
    let (mut child, dir, _) = start_ready("2", "3", "true");
    let pids = pids_in(wait_files(&dir, 2));
    child.kill().unwrap(); // SIGKILL: weft cannot clean up, PDEATHSIG must.
    child.wait().unwrap();
    assert_all_gone(&pids);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn shared_memory_of_the_job_is_removed() {
    let shm = std::path::Path::new("/dev/shm");
    if !shm.is_dir() {
        // Every Linux CI machine has it: there a missing /dev/shm fails.
        weft_testkit::skip_outside_ci(
            false,
            "shared_memory_of_the_job_is_removed: no /dev/shm here",
        );
        return;
    }
    let job = format!("shmtest{}", std::process::id());
    let other = shm.join(format!("weft-other{job}-keep"));
    std::fs::write(&other, b"x").unwrap();
    // Each rank makes a segment-like file; rank 0 then dies by SIGKILL, as a crash would.
    let script = "echo data > /dev/shm/weft-$WEFT_JOB-seg$RANK; \
                  if [ $RANK = 0 ]; then sleep 0.2; kill -9 $$; fi; sleep 30";
    let run = weft(&["run", "-n", "2", "--job", &job, "--", "sh", "-c", script]);
    assert_eq!(run.code, Some(137), "{}", run.err());
    let prefix = format!("weft-{job}-");
    let left: Vec<_> = std::fs::read_dir(shm)
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with(&prefix))
        .map(|e| e.path())
        .collect();
    assert!(left.is_empty(), "left behind: {left:?}");
    assert!(other.exists(), "another job's segment was removed");
    std::fs::remove_file(other).unwrap();
}

#[test]
fn processes_that_escaped_the_process_group_are_killed() {
    // `setsid` moves the grandchild into a new session and process group, out of
    // reach of the group kill; weft, as subreaper, must still end it. The
    // grandchild writes its pid file itself, from inside the new session: with
    // `$!` written by the rank, a loaded machine could let rank 1 exit before
    // the grandchild had left the group, so the group kill ended it and weft
    // found no leftover (seen once in CI).
    let dir = scratch("escaped");
    let script = format!(
        "setsid sh -c 'echo $$ > {d}/g$RANK.tmp; mv {d}/g$RANK.tmp {d}/g$RANK; exec sleep 60' \
         > /dev/null 2>&1 & if [ $RANK = 1 ]; then {}; exit 6; fi; sleep 30",
        wait_all(&dir, 2),
        d = dir.display()
    );
    let run = weft(&["run", "-n", "2", "--", "sh", "-c", &script]);
    assert_eq!(run.code, Some(6), "{}", run.err());
    let pids = pids_in(wait_files(&dir, 2));
    assert_all_gone(&pids);
    assert!(run.err().contains("leftover"), "{}", run.err());
    let _ = std::fs::remove_dir_all(dir);
}
