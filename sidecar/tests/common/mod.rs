//! Helpers shared by the `weft run` integration tests: run the built binary
//! with a hard time bound, scratch directories, process liveness checks.
#![allow(dead_code)]

use std::io::Read;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// No single `weft run` in these tests may take longer than this.
pub const BOUND: Duration = Duration::from_secs(30);

pub struct Run {
    pub code: Option<i32>,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    pub elapsed: Duration,
}

impl Run {
    pub fn out(&self) -> String {
        String::from_utf8_lossy(&self.stdout).into_owned()
    }
    pub fn err(&self) -> String {
        String::from_utf8_lossy(&self.stderr).into_owned()
    }
}

pub fn weft_cmd(args: &[&str]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_weft"));
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    cmd
}

/// Runs `weft ARGS` to its end (killed and failed past [`BOUND`]).
pub fn weft(args: &[&str]) -> Run {
    run_cmd(weft_cmd(args))
}

pub fn run_cmd(mut cmd: Command) -> Run {
    let start = Instant::now();
    let child = cmd.spawn().expect("start weft");
    finish(child, start)
}

/// Collects a started child's output and status, bounded by [`BOUND`].
pub fn finish(mut child: Child, start: Instant) -> Run {
    let reader = |mut r: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut v = Vec::new();
            let _ = r.read_to_end(&mut v);
            v
        })
    };
    let out = reader(Box::new(child.stdout.take().unwrap()));
    let err = reader(Box::new(child.stderr.take().unwrap()));
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if start.elapsed() > BOUND {
            let _ = child.kill();
            let _ = child.wait();
            panic!("weft did not finish within {BOUND:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let elapsed = start.elapsed();
    Run {
        code: status.code(),
        stdout: out.join().unwrap(),
        stderr: err.join().unwrap(),
        elapsed,
    }
}

/// A fresh empty directory for one test.
pub fn scratch(name: &str) -> PathBuf {
    static N: AtomicUsize = AtomicUsize::new(0);
    let dir = std::env::temp_dir().join(format!(
        "weft-run-test-{}-{}-{name}",
        std::process::id(),
        N.fetch_add(1, Ordering::SeqCst)
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Waits (bounded) until `n` files exist in `dir`; returns their contents.
pub fn wait_files(dir: &PathBuf, n: usize) -> Vec<String> {
    let start = Instant::now();
    loop {
        let files: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .flatten()
            .filter_map(|e| std::fs::read_to_string(e.path()).ok())
            .filter(|s| s.ends_with('\n'))
            .collect();
        if files.len() >= n {
            return files;
        }
        assert!(
            start.elapsed() < BOUND,
            "only {} of {n} files in {dir:?}",
            files.len()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// True while `pid` is a live (non-zombie) process.
pub fn alive(pid: i32) -> bool {
    // SAFETY: signal 0 only checks existence.
    if unsafe { libc::kill(pid, 0) } != 0 {
        return false;
    }
    // A zombie still answers kill(0) until its (new) parent reaps it.
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => {
            let state = stat
                .rsplit_once(')')
                .map(|(_, r)| r.trim_start().chars().next());
            !matches!(state, Some(Some('Z' | 'X')))
        }
        Err(_) => false,
    }
}

/// Asserts every pid is gone within a few seconds.
pub fn assert_all_gone(pids: &[i32]) {
    let start = Instant::now();
    while pids.iter().any(|&p| alive(p)) {
        let left: Vec<_> = pids.iter().filter(|&&p| alive(p)).collect();
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "still alive: {left:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `[i] rest` -> `(i, rest)`; rank numbers may be space-padded.
pub fn split_prefix(line: &str) -> Option<(usize, &str)> {
    let rest = line.strip_prefix('[')?;
    let (num, rest) = rest.split_once("] ")?;
    Some((num.trim().parse().ok()?, rest))
}
