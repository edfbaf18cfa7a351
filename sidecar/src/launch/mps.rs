//! A private CUDA MPS daemon for ranks that share a GPU.
//!
//! Without MPS, the CUDA contexts of different processes on one GPU run by
//! time-slicing: only one process's kernels are on the GPU at a time, and a
//! collective kernel that spins waiting for a peer in another process holds
//! its whole slice (about 2 ms). Two ranks on one H100 then take ~2.3 ms per
//! all_reduce at 8 B instead of ~6 us (measured: docs/PERFORMANCE-GPU.md,
//! "Ranks sharing one GPU"). Under MPS the processes' kernels run side by
//! side, as threads of one process would.
//!
//! So when more local ranks than visible GPUs are launched, `weft run` and
//! `weft bench` start `nvidia-cuda-mps-control -d` with a pipe and log
//! directory of their own (only processes given those two variables use
//! that daemon: other jobs and a system-wide MPS are unaffected), give the
//! ranks the variables, and stop the daemon when the job ends.
//! `WEFT_MPS`: `auto` (default; also when the daemon cannot start: a
//! warning, and the ranks time-slice), `on` (fail the launch if it cannot
//! start), `off`.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The MPS control program (looked up in `PATH`).
pub const CONTROL: &str = "nvidia-cuda-mps-control";
const PIPE_VAR: &str = "CUDA_MPS_PIPE_DIRECTORY";
const LOG_VAR: &str = "CUDA_MPS_LOG_DIRECTORY";
/// Where a system-wide daemon listens when no pipe directory is set.
const SYSTEM_PIPE: &str = "/tmp/nvidia-mps/control";

/// `WEFT_MPS`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Auto,
    On,
    Off,
}

impl Mode {
    pub fn from_env() -> Mode {
        match weft_contract::params::WEFT_MPS.get().as_deref() {
            Some("on") => Mode::On,
            Some("off") => Mode::Off,
            _ => Mode::Auto,
        }
    }
}

/// What the decision looks at, gathered once (pure data, so it is testable).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Host {
    /// GPUs the ranks can see (`CUDA_VISIBLE_DEVICES`, else the driver's list).
    pub gpus: usize,
    /// An MPS daemon the ranks would already use (a pipe directory in the
    /// environment, or the system daemon's pipe).
    pub mps_running: bool,
}

impl Host {
    pub fn probe() -> Host {
        Host {
            gpus: visible_gpus(
                std::env::var("CUDA_VISIBLE_DEVICES").ok().as_deref(),
                Path::new("/proc/driver/nvidia/gpus"),
            ),
            mps_running: std::env::var_os(PIPE_VAR).is_some() || Path::new(SYSTEM_PIPE).exists(),
        }
    }
}

/// GPUs the ranks see: the entries of `CUDA_VISIBLE_DEVICES` when set
/// (CUDA stops at the first invalid one, "-1" hides all), else one per
/// directory under the driver's `/proc/driver/nvidia/gpus` (0 without a driver).
pub fn visible_gpus(cuda_visible: Option<&str>, driver_gpus: &Path) -> usize {
    let driver = std::fs::read_dir(driver_gpus)
        .map(|d| d.filter_map(|e| e.ok()).count())
        .unwrap_or(0);
    match cuda_visible {
        Some(list) => list
            .split(',')
            .map(str::trim)
            .take_while(|e| !e.is_empty() && !e.starts_with('-'))
            .count()
            .min(driver),
        None => driver,
    }
}

/// Whether a launch of `ranks` local ranks should start a private daemon.
pub fn wanted(mode: Mode, ranks: usize, host: &Host) -> bool {
    mode != Mode::Off && !host.mps_running && host.gpus > 0 && ranks > host.gpus
}

/// A running private daemon; stopped (and its directories removed) on drop.
#[derive(Debug)]
pub struct Daemon {
    dir: PathBuf,
    program: String,
    /// `-d` succeeded: there is a daemon to tell to quit.
    running: bool,
}

impl Daemon {
    /// Starts `program -d` with its own directories under `base`.
    pub fn start(program: &str, base: &Path, job: &str) -> Result<Daemon, String> {
        let dir = base.join(format!("weft-mps-{job}-{}", std::process::id()));
        for sub in ["pipe", "log"] {
            std::fs::create_dir_all(dir.join(sub))
                .map_err(|e| format!("cannot create {}: {e}", dir.join(sub).display()))?;
        }
        let mut d = Daemon {
            dir,
            program: program.into(),
            running: false,
        };
        let started = d
            .command()
            .arg("-d")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .output();
        let failed = match started {
            Ok(out) if out.status.success() => None,
            Ok(out) => Some(format!(
                "{program} -d failed ({}): {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            )),
            Err(e) => Some(format!("cannot run {program}: {e}")),
        };
        if let Some(why) = failed {
            // Dropping `d` removes the directories (nothing runs to quit).
            return Err(why);
        }
        d.running = true;
        Ok(d)
    }

    fn command(&self) -> Command {
        let mut c = Command::new(&self.program);
        c.env(PIPE_VAR, self.dir.join("pipe"))
            .env(LOG_VAR, self.dir.join("log"));
        c
    }

    /// The variables that make a rank use this daemon.
    pub fn vars(&self) -> Vec<(String, String)> {
        [(PIPE_VAR, "pipe"), (LOG_VAR, "log")]
            .into_iter()
            .map(|(k, sub)| (k.to_string(), self.dir.join(sub).display().to_string()))
            .collect()
    }

    /// Asks the daemon to quit (it waits for its clients, which have all
    /// been reaped by now), bounded so a wedged daemon cannot hold the
    /// launcher; then removes the directories.
    fn stop(&self) {
        if !self.running {
            let _ = std::fs::remove_dir_all(&self.dir);
            return;
        }
        let child = self
            .command()
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn();
        if let Ok(mut child) = child {
            if let Some(mut stdin) = child.stdin.take() {
                let _ = stdin.write_all(b"quit\n");
            }
            let deadline = Instant::now() + Duration::from_secs(10);
            while Instant::now() < deadline {
                if let Ok(Some(_)) = child.try_wait() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        // The daemon removes its pipes when it exits; give it a moment.
        let pipe = self.dir.join("pipe").join("control");
        let deadline = Instant::now() + Duration::from_secs(5);
        while pipe.exists() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Starts a private daemon when `mode` and the host call for one. `Ok(None)`:
/// not needed, or `auto` and it could not start (the warning went to `warn`).
pub fn maybe_start(
    mode: Mode,
    ranks: usize,
    host: &Host,
    job: &str,
    warn: &mut dyn FnMut(&str),
) -> Result<Option<Daemon>, String> {
    if !wanted(mode, ranks, host) {
        return Ok(None);
    }
    match Daemon::start(CONTROL, &std::env::temp_dir(), job) {
        Ok(d) => Ok(Some(d)),
        Err(e) if mode == Mode::On => Err(format!("WEFT_MPS=on: {e}")),
        Err(e) => {
            warn(&format!(
                "{ranks} ranks share {} GPU(s) and no MPS daemon could start ({e}); \
                 their kernels will time-slice (~2 ms per collective). Install MPS \
                 (`{CONTROL}`) or set WEFT_MPS=off to silence this.",
                host.gpus
            ));
            Ok(None)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fresh directory under the temp dir, removed on drop.
    struct TestDir(PathBuf);
    impl TestDir {
        fn new(name: &str) -> TestDir {
            let p =
                std::env::temp_dir().join(format!("weft-mps-test-{name}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&p);
            std::fs::create_dir_all(&p).unwrap();
            TestDir(p)
        }
        fn path(&self) -> &Path {
            &self.0
        }
    }
    impl Drop for TestDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn host(gpus: usize, mps_running: bool) -> Host {
        Host { gpus, mps_running }
    }

    #[test]
    fn a_daemon_only_when_ranks_outnumber_gpus_and_none_runs() {
        assert!(wanted(Mode::Auto, 2, &host(1, false)));
        assert!(wanted(Mode::On, 3, &host(2, false)));
        assert!(!wanted(Mode::Auto, 2, &host(2, false)), "one GPU each");
        assert!(!wanted(Mode::Auto, 4, &host(0, false)), "no GPU");
        assert!(!wanted(Mode::Auto, 2, &host(1, true)), "MPS already runs");
        assert!(!wanted(Mode::Off, 8, &host(1, false)));
    }

    #[test]
    fn visible_gpus_follow_cuda_visible_devices_and_the_driver() {
        let d = TestDir::new("gpus");
        for g in ["0000:18:00.0", "0000:2a:00.0"] {
            std::fs::create_dir(d.path().join(g)).unwrap();
        }
        assert_eq!(visible_gpus(None, d.path()), 2);
        assert_eq!(visible_gpus(Some("1"), d.path()), 1);
        assert_eq!(
            visible_gpus(Some("0,1,2"), d.path()),
            2,
            "at most the driver's"
        );
        assert_eq!(
            visible_gpus(Some("0,-1,1"), d.path()),
            1,
            "CUDA stops at -1"
        );
        assert_eq!(visible_gpus(Some(""), d.path()), 0);
        assert_eq!(visible_gpus(None, &d.path().join("absent")), 0);
    }

    /// A stand-in control program (no GPU here) that records how it was
    /// called: `-d` with the private directories, then `quit` on stdin.
    #[test]
    fn the_daemon_gets_private_directories_and_is_told_to_quit() {
        let d = TestDir::new("fake");
        let record = d.path().join("calls");
        let fake = d.path().join("mps-control");
        std::fs::write(
            &fake,
            format!(
                "#!/bin/sh\nif [ \"$1\" = -d ]; then echo \"start $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY\" >> {r}; \
                 touch \"$CUDA_MPS_PIPE_DIRECTORY/control\"; else read cmd; echo \"$cmd\" >> {r}; \
                 rm -f \"$CUDA_MPS_PIPE_DIRECTORY/control\"; fi\n",
                r = record.display()
            ),
        )
        .unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
        let daemon = Daemon::start(fake.to_str().unwrap(), d.path(), "t1").unwrap();
        let vars = daemon.vars();
        assert_eq!(vars[0].0, "CUDA_MPS_PIPE_DIRECTORY");
        assert!(Path::new(&vars[0].1).join("control").exists());
        let dir = daemon.dir.clone();
        drop(daemon);
        let calls = std::fs::read_to_string(&record).unwrap();
        let lines: Vec<&str> = calls.lines().collect();
        assert_eq!(lines.len(), 2, "{calls}");
        assert_eq!(lines[0], format!("start {} {}", vars[0].1, vars[1].1));
        assert_eq!(lines[1], "quit");
        assert!(!dir.exists(), "directories removed");
    }

    #[test]
    fn a_failing_control_program_is_an_error_that_says_why() {
        let d = TestDir::new("fail");
        let e = Daemon::start("/nonexistent/mps-control", d.path(), "t2").unwrap_err();
        assert!(e.contains("cannot run /nonexistent/mps-control"), "{e}");
    }
}
