//! Helpers shared by the tests of several Weft crates, kept tiny and free of
//! dependencies (every user takes it as a dev-dependency only):
//!
//! - [`run_bounded`]: run a command to its end within a time limit, its
//!   output collected, killing it (and failing the test) past the limit;
//! - [`Rng`]: a small deterministic generator, so a failure replays;
//! - [`skip_outside_ci`]: a prerequisite missing on a developer's machine
//!   skips (said on stderr), but fails where CI must have provided it.

use std::io::Read;
use std::process::{Command, Output, Stdio};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Runs `cmd` to its end with stdout and stderr collected; past `limit` it
/// is killed and the test panics with what it wrote. The pipes are read
/// while it runs, so a chatty command cannot stall on a full pipe.
pub fn run_bounded(cmd: &mut Command, limit: Duration) -> Output {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {cmd:?}: {e}"));
    let stdout = drain(child.stdout.take());
    let stderr = drain(child.stderr.take());
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for the child") {
            break status;
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "{cmd:?} ran longer than {limit:?} and was killed\nstdout:\n{}\nstderr:\n{}",
                String::from_utf8_lossy(&stdout.join().unwrap_or_default()),
                String::from_utf8_lossy(&stderr.join().unwrap_or_default())
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    Output {
        status,
        stdout: stdout.join().unwrap_or_default(),
        stderr: stderr.join().unwrap_or_default(),
    }
}

/// Reads a pipe to its end on a thread of its own.
fn drain(pipe: Option<impl Read + Send + 'static>) -> JoinHandle<Vec<u8>> {
    std::thread::spawn(move || {
        let mut v = Vec::new();
        if let Some(mut p) = pipe {
            let _ = p.read_to_end(&mut v);
        }
        v
    })
}

/// A small deterministic generator (xorshift64): the same seed gives the
/// same values on every run, so a failing case can be replayed.
pub struct Rng(u64);

impl Rng {
    /// A generator seeded with `seed` (not 0: xorshift never leaves 0).
    pub fn new(seed: u64) -> Rng {
        assert_ne!(seed, 0, "a xorshift seed must not be 0");
        Rng(seed)
    }

    /// The next value (never 0).
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// `n` random bytes.
    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next_u64() as u8).collect()
    }
}

/// A test's prerequisite is missing: under `CI=true` (or when `required`:
/// e.g. `WEFT_REQUIRE_NVRTC=1`) that is a failure, since .ci/run provides
/// it; elsewhere the test prints `SKIPPED: <why>` and the caller returns.
pub fn skip_outside_ci(required: bool, why: &str) {
    assert!(
        !required && std::env::var("CI").as_deref() != Ok("true"),
        "{why}: CI (or the setting that requires it) should have provided it"
    );
    eprintln!("SKIPPED: {why}");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_command_runs_to_its_end_with_its_output() {
        let out = run_bounded(
            Command::new("sh").args(["-c", "echo out; echo err >&2; exit 3"]),
            Duration::from_secs(10),
        );
        assert_eq!(out.status.code(), Some(3));
        assert_eq!(out.stdout, b"out\n");
        assert_eq!(out.stderr, b"err\n");
    }

    #[test]
    fn output_larger_than_a_pipe_does_not_stall_the_command() {
        let out = run_bounded(
            Command::new("sh").args(["-c", "head -c 1000000 /dev/zero"]),
            Duration::from_secs(10),
        );
        assert!(out.status.success());
        assert_eq!(out.stdout.len(), 1_000_000);
    }

    #[test]
    #[should_panic(expected = "ran longer than")]
    fn a_command_past_its_limit_is_killed() {
        run_bounded(Command::new("sleep").arg("10"), Duration::from_millis(200));
    }

    #[test]
    fn the_generator_replays_its_seed() {
        let (mut a, mut b) = (Rng::new(7), Rng::new(7));
        let first: Vec<u64> = (0..4).map(|_| a.next_u64()).collect();
        assert_eq!(first, (0..4).map(|_| b.next_u64()).collect::<Vec<_>>());
        assert!(first.iter().all(|&v| v != 0));
        assert_eq!(
            Rng::new(7).bytes(3),
            first[..3].iter().map(|&v| v as u8).collect::<Vec<_>>()
        );
    }
}
