//! A bounded harness that starts ranks as real processes with the launcher's
//! environment contract, collects each rank's output and exit status, and
//! kills everything it started when the deadline passes or it is dropped.
//!
//! Unlike `weft run`, it does not stop the other ranks when one fails: the
//! fault tests need the survivors to report the error they got.

use std::collections::HashMap;
use std::io::Read;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use weft::launch::env::{JobEnv, free_ports, fresh_secret};

#[derive(Debug, Clone)]
pub struct RankRun {
    pub rank: usize,
    pub pid: u32,
    /// Exit code, or None when killed by a signal.
    pub code: Option<i32>,
    pub signal: Option<i32>,
    pub stdout: String,
    pub stderr: String,
}

#[derive(Debug)]
pub struct JobRun {
    pub job: String,
    pub ranks: Vec<RankRun>,
    pub timed_out: bool,
    pub elapsed: Duration,
    /// /dev/shm segments of this job still present after every rank ended.
    pub leaked_shm: Vec<PathBuf>,
}

impl JobRun {
    /// Panics with every rank's output unless all ranks exited 0 in time.
    pub fn assert_success(&self) -> &Self {
        if self.timed_out || self.ranks.iter().any(|r| r.code != Some(0)) {
            panic!(
                "job {} failed (timed out: {}):\n{}",
                self.job,
                self.timed_out,
                self.dump()
            );
        }
        self
    }

    pub fn dump(&self) -> String {
        let mut s = String::new();
        for r in &self.ranks {
            s += &format!(
                "--- rank {} (pid {}) code {:?} signal {:?}\n[stdout]\n{}[stderr]\n{}",
                r.rank, r.pid, r.code, r.signal, r.stdout, r.stderr
            );
        }
        s
    }

    /// `key=value` pairs a rank printed on lines starting with `@ `.
    pub fn facts(&self, rank: usize) -> HashMap<String, String> {
        self.ranks[rank]
            .stdout
            .lines()
            .filter_map(|l| l.strip_prefix("@ "))
            .flat_map(|l| l.split_whitespace())
            .filter_map(|kv| kv.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }
}

/// Extra environment per rank.
pub type PerRankEnv<'a> = Box<dyn Fn(usize) -> Vec<(String, String)> + 'a>;

/// What to run.
pub struct JobSpec<'a> {
    pub program: &'a Path,
    pub ranks: usize,
    pub args: Vec<String>,
    pub env: Vec<(String, String)>,
    /// Extra variables for one rank.
    pub per_rank_env: Option<PerRankEnv<'a>>,
    pub timeout: Duration,
}

impl<'a> JobSpec<'a> {
    pub fn new(program: &'a Path, ranks: usize, args: &[&str]) -> Self {
        JobSpec {
            program,
            ranks,
            args: args.iter().map(|s| s.to_string()).collect(),
            env: Vec::new(),
            per_rank_env: None,
            timeout: Duration::from_secs(120),
        }
    }
    pub fn env(mut self, k: &str, v: &str) -> Self {
        self.env.push((k.into(), v.into()));
        self
    }
    pub fn timeout(mut self, t: Duration) -> Self {
        self.timeout = t;
        self
    }
    pub fn per_rank(mut self, f: impl Fn(usize) -> Vec<(String, String)> + 'a) -> Self {
        self.per_rank_env = Some(Box::new(f));
        self
    }
}

struct Guard(Vec<Child>);

impl Drop for Guard {
    fn drop(&mut self) {
        for c in &mut self.0 {
            unsafe { libc::kill(-(c.id() as i32), libc::SIGKILL) };
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn drain(mut r: impl Read + Send + 'static) -> JoinHandle<String> {
    std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = r.read_to_end(&mut v);
        String::from_utf8_lossy(&v).into_owned()
    })
}

static JOBS: AtomicUsize = AtomicUsize::new(0);

/// Runs the job to completion (or its deadline) and reports every rank.
pub fn run(spec: JobSpec<'_>) -> JobRun {
    spawn(spec).wait()
}

/// A job whose ranks are running: the test may act on them (attack their
/// ports, stop or kill them) before [`Running::wait`].
pub struct Running {
    job: String,
    /// `WEFT_BOOTSTRAP` of the job (rank 0 serves the root there).
    pub bootstrap: String,
    guard: Guard,
    outs: Vec<(JoinHandle<String>, JoinHandle<String>)>,
    start: Instant,
    timeout: Duration,
}

/// Starts every rank of the job.
pub fn spawn(spec: JobSpec<'_>) -> Running {
    let ports = free_ports(2, None).expect("free ports");
    let job = format!(
        "t{}x{}",
        std::process::id(),
        JOBS.fetch_add(1, Ordering::Relaxed)
    );
    let env = JobEnv {
        job: job.clone(),
        world_size: spec.ranks,
        bootstrap: format!("127.0.0.1:{}", ports[0]),
        master_port: ports[1],
        secret: Some(fresh_secret().expect("randomness")),
        pod: None,
    };
    let start = Instant::now();
    let mut guard = Guard(Vec::new());
    let mut outs = Vec::new();
    for r in 0..spec.ranks {
        let mut cmd = Command::new(spec.program);
        cmd.args(&spec.args)
            .envs(env.rank_vars(r))
            .envs(spec.env.iter().cloned())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if let Some(f) = &spec.per_rank_env {
            cmd.envs(f(r));
        }
        unsafe {
            cmd.pre_exec(|| {
                // Own process group (killed as a whole), and die with the test.
                libc::setpgid(0, 0);
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let mut child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("spawning rank {r}: {e}"));
        outs.push((
            drain(child.stdout.take().unwrap()),
            drain(child.stderr.take().unwrap()),
        ));
        guard.0.push(child);
    }
    Running {
        job,
        bootstrap: env.bootstrap,
        guard,
        outs,
        start,
        timeout: spec.timeout,
    }
}

impl Running {
    /// The job's name (its /dev/shm files would start with `weft-<job>-`).
    pub fn job(&self) -> &str {
        &self.job
    }

    /// Process id of each rank.
    pub fn pids(&self) -> Vec<u32> {
        self.guard.0.iter().map(|c| c.id()).collect()
    }

    /// Sends `sig` to one rank's process group.
    pub fn signal(&self, rank: usize, sig: i32) {
        unsafe { libc::kill(-(self.guard.0[rank].id() as i32), sig) };
    }

    /// Waits for every rank to exit (or kills the rest at the deadline).
    pub fn wait(self) -> JobRun {
        let Running {
            job,
            mut guard,
            outs,
            start,
            timeout,
            ..
        } = self;
        let deadline = start + timeout;
        let mut status = vec![None; guard.0.len()];
        let mut timed_out = false;
        while status.iter().any(Option::is_none) {
            for (r, c) in guard.0.iter_mut().enumerate() {
                if status[r].is_none()
                    && let Ok(Some(st)) = c.try_wait()
                {
                    status[r] = Some(st);
                }
            }
            if Instant::now() >= deadline {
                timed_out = true;
                for (r, c) in guard.0.iter_mut().enumerate() {
                    if status[r].is_none() {
                        unsafe { libc::kill(-(c.id() as i32), libc::SIGKILL) };
                        status[r] = c.wait().ok();
                    }
                }
                break;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let elapsed = start.elapsed();
        let pids: Vec<u32> = guard.0.iter().map(|c| c.id()).collect();
        drop(guard);
        let ranks = outs
            .into_iter()
            .enumerate()
            .map(|(r, (o, e))| {
                let st = status[r];
                RankRun {
                    rank: r,
                    pid: pids[r],
                    code: st.and_then(|s| s.code()),
                    signal: st.and_then(|s| s.signal()),
                    stdout: o.join().unwrap_or_default(),
                    stderr: e.join().unwrap_or_default(),
                }
            })
            .collect();
        let prefix = format!("weft-{job}-");
        let leaked_shm: Vec<PathBuf> = std::fs::read_dir("/dev/shm")
            .map(|d| {
                d.filter_map(|e| e.ok())
                    .filter(|e| e.file_name().to_string_lossy().starts_with(&prefix))
                    .map(|e| e.path())
                    .collect()
            })
            .unwrap_or_default();
        for p in &leaked_shm {
            let _ = std::fs::remove_file(p);
        }
        JobRun {
            job,
            ranks,
            timed_out,
            elapsed,
            leaked_shm,
        }
    }
}
