//! The local launcher behind `weft run`: start N ranks of a program on this
//! machine with the environment the operator gives pods, pass their output
//! through, and supervise them so that one failure stops the job and nothing
//! is left behind.
//!
//! ```no_run
//! use std::time::Duration;
//! let mut spec = weft::LaunchSpec::new(4, "sh");
//! spec.args = vec!["-c".into(), "echo rank $WEFT_RANK".into()];
//! spec.capture = true;
//! spec.timeout = Some(Duration::from_secs(30));
//! let outcome = weft::launch(&spec).unwrap();
//! assert_eq!(outcome.exit_code(), 0);
//! assert_eq!(outcome.ranks[2].output.stdout, b"rank 2\n");
//! ```
//!
//! Modules: [`mod@env`] (the rank environment contract), [`mps`] (a private
//! MPS daemon when ranks share a GPU), `process` (spawning a
//! rank in its own process group), `output` (prefixing lines), `signals`
//! (forwarding), [`shm`] (leftover segment cleanup) and `supervise` (the
//! loop that watches the ranks); this file holds the public types and ties
//! the pieces together.

pub mod env;
pub mod mps;
pub(crate) mod output;
pub mod preload;
mod process;
pub mod shm;
mod signals;
mod supervise;

use std::ffi::OsString;
use std::io;
use std::path::PathBuf;
use std::process::ExitStatus;
use std::time::{Duration, Instant};

pub use output::RankOutput;
use output::diag;
pub use supervise::{Replaced, StopReason};

/// What to launch and how. Build with [`LaunchSpec::new`] and set fields.
#[derive(Debug, Clone)]
pub struct LaunchSpec {
    /// Number of ranks (>= 1), all on this machine.
    pub ranks: usize,
    /// Program to run for each rank (looked up in `PATH` when it has no `/`).
    pub program: OsString,
    /// Its arguments.
    pub args: Vec<OsString>,
    /// Extra variables for every rank, set last (they override the contract).
    pub env_extra: Vec<(String, String)>,
    /// Prefix each printed line with `[rank] ` (ignored when capturing).
    pub prefix: bool,
    /// Collect each rank's output into [`RankResult::output`] instead of printing it.
    pub capture: bool,
    /// Time between SIGTERM and SIGKILL when stopping ranks.
    pub grace: Duration,
    /// Stop everything when the job runs longer than this (exit code 124).
    pub timeout: Option<Duration>,
    /// `WEFT_JOB`; default `local-<launcher pid>`.
    pub job: Option<String>,
    /// `WEFT_BOOTSTRAP` as `HOST:PORT`; default 127.0.0.1 and a free port.
    pub bootstrap: Option<String>,
    /// Catch SIGINT/SIGTERM/SIGHUP while running and forward them to the ranks.
    /// Process-wide: at most one launch at a time may set this.
    pub forward_signals: bool,
    /// Become the subreaper of the ranks' descendants and, at the end, kill any
    /// that escaped their rank's process group (`setsid`, daemons).
    /// Process-wide and it makes every other child of the caller look like an
    /// escapee: only for a process that does nothing but launch (the CLI).
    pub subreaper: bool,
    /// Start of our own messages on stderr, e.g. `weft run`.
    pub label: String,
    /// `--replace-failed[=N]`: restart a failed rank's process with the same
    /// rank, at most N times in all, instead of stopping the job; the ranks
    /// get a recovery board (`WEFT_RECOVERY_DIR`, docs/FAULT-TOLERANCE.md).
    pub replace_failed: Option<usize>,
}

impl LaunchSpec {
    /// `ranks` copies of `program` with no arguments, prefixed output, 3 s
    /// grace, no timeout, no signal forwarding.
    pub fn new(ranks: usize, program: impl Into<OsString>) -> Self {
        LaunchSpec {
            ranks,
            program: program.into(),
            args: Vec::new(),
            env_extra: Vec::new(),
            prefix: true,
            capture: false,
            grace: Duration::from_secs(3),
            timeout: None,
            job: None,
            bootstrap: None,
            forward_signals: false,
            subreaper: false,
            label: "weft run".into(),
            replace_failed: None,
        }
    }
}

/// How one rank ended.
#[derive(Debug, Clone)]
pub struct RankResult {
    pub rank: usize,
    pub pid: u32,
    pub status: ExitStatus,
    /// Its output when [`LaunchSpec::capture`] was set, else empty.
    pub output: RankOutput,
}

/// How the whole launch ended. Every rank has been reaped.
#[derive(Debug, Clone)]
pub struct LaunchOutcome {
    pub job: String,
    pub bootstrap: String,
    /// Indexed by rank.
    pub ranks: Vec<RankResult>,
    /// `None` when every rank ran to its own end.
    pub stop: Option<StopReason>,
    /// Leftover `/dev/shm/weft-<job>-*` files that were removed.
    pub shm_removed: Vec<PathBuf>,
    pub elapsed: Duration,
    /// Processes replaced under [`LaunchSpec::replace_failed`], in order.
    pub replaced: Vec<Replaced>,
}

impl LaunchOutcome {
    /// The first rank that failed, if one did before any signal or timeout.
    pub fn first_failure(&self) -> Option<&RankResult> {
        match self.stop {
            Some(StopReason::RankFailed { rank, .. }) => self.ranks.get(rank),
            _ => None,
        }
    }

    /// What `weft run` exits with: the first failing rank's code (128 + signal
    /// when it was killed), 124 on timeout, 128 + signal when the launcher was
    /// signalled, 0 when every rank succeeded.
    pub fn exit_code(&self) -> i32 {
        match &self.stop {
            Some(StopReason::RankFailed { status, .. }) => process::exit_code_of(status),
            Some(StopReason::Timeout(_)) => 124,
            Some(StopReason::Signal(sig)) => 128 + sig,
            None => self
                .ranks
                .iter()
                .map(|r| process::exit_code_of(&r.status))
                .find(|&c| c != 0)
                .unwrap_or(0),
        }
    }

    /// True when the job ran to completion and every rank exited 0.
    pub fn success(&self) -> bool {
        self.exit_code() == 0
    }
}

/// Why a launch could not run.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    /// The spec is unusable (0 ranks, bad job name or bootstrap address).
    #[error("{0}")]
    InvalidSpec(String),
    /// A rank's program could not be started; the ranks already started were killed.
    #[error("cannot start '{program}': {}", os_message(source))]
    Spawn {
        rank: usize,
        program: String,
        #[source]
        source: io::Error,
    },
    /// Setting up the launch failed (ports, randomness, signal handlers).
    #[error("{what}: {source}")]
    Setup {
        what: &'static str,
        #[source]
        source: io::Error,
    },
}

impl LaunchError {
    /// Shell conventions: 2 usage, 127 command not found, 126 not executable, 1 otherwise.
    pub fn exit_code(&self) -> i32 {
        match self {
            LaunchError::InvalidSpec(_) => 2,
            LaunchError::Spawn { source, .. } if source.kind() == io::ErrorKind::NotFound => 127,
            LaunchError::Spawn { .. } => 126,
            LaunchError::Setup { .. } => 1,
        }
    }
}

/// `"No such file or directory"` rather than `"... (os error 2)"`.
fn os_message(e: &io::Error) -> String {
    let s = e.to_string();
    match s.find(" (os error ") {
        Some(i) => s[..i].to_string(),
        None => s,
    }
}

/// The operator's pod contract, when `weft run` runs inside one of its pods.
pub(crate) fn pod_env() -> Result<Option<weft_contract::env::PodEnv>, LaunchError> {
    env::operator_pod(&weft_contract::params::process_env)
        .map_err(|e| LaunchError::InvalidSpec(format!("inside an operator pod: {e}")))
}

/// Inside a pod the ranks are the pod's slice of the job: the job's name,
/// world, rendezvous and secret (file) come from the operator, and the rank
/// of each process is the pod's offset plus its local index; its incarnation
/// and recovery board (`ReplaceRank`) are inherited as they are.
fn pod_job_env(
    spec: &LaunchSpec,
    pod: weft_contract::env::PodEnv,
) -> Result<env::JobEnv, LaunchError> {
    // A rank of the pod (WEFT_RANK set) that starts a launcher would start
    // the pod's ranks a second time, with the same numbers.
    if let Some(rank) = env::launched_rank(&weft_contract::params::process_env) {
        return Err(LaunchError::InvalidSpec(format!(
            "this process is already rank {rank} of the pod's job (WEFT_RANK is set: a launcher started it); run the program directly, not under another launcher"
        )));
    }
    if spec.ranks != pod.local_ranks as usize {
        return Err(LaunchError::InvalidSpec(format!(
            "-n {} inside a pod of {} rank(s) per replica (WEFT_LOCAL_RANKS): start exactly the pod's ranks, e.g. -n $(WEFT_LOCAL_RANKS)",
            spec.ranks, pod.local_ranks
        )));
    }
    if spec.replace_failed.is_some() && pod.nnodes > 1 {
        return Err(LaunchError::InvalidSpec(
            "--replace-failed inside a pod of a several-pod job: the operator replaces a failed pod (failurePolicy.onRankFailure: ReplaceRank) and the sidecars relay the recovery board".into(),
        ));
    }
    Ok(env::JobEnv {
        job: pod.job,
        world_size: spec.ranks,
        bootstrap: pod.bootstrap,
        master_port: pod.torch.master_port,
        secret: None,
        pod: Some(env::PodPlace {
            global_world: pod.world_size as usize,
            rank_offset: pod.rank_offset as usize,
            nnodes: pod.nnodes as usize,
            node_rank: pod.node_rank as usize,
            master_addr: pod.torch.master_addr,
        }),
    })
}

/// Works out the job-wide environment from the spec.
fn job_env(spec: &LaunchSpec) -> Result<env::JobEnv, LaunchError> {
    if spec.ranks == 0 {
        return Err(LaunchError::InvalidSpec(
            "the number of ranks must be at least 1".into(),
        ));
    }
    if spec.job.is_none()
        && spec.bootstrap.is_none()
        && let Some(pod) = pod_env()?
    {
        return pod_job_env(spec, pod);
    }
    let job = spec
        .job
        .clone()
        .unwrap_or_else(|| format!("local-{}", std::process::id()));
    env::validate_job(&job).map_err(LaunchError::InvalidSpec)?;
    let setup = |what| move |source| LaunchError::Setup { what, source };
    let given_port = match &spec.bootstrap {
        Some(b) => Some(env::parse_bootstrap(b).map_err(LaunchError::InvalidSpec)?),
        None => None,
    };
    let wanted = if given_port.is_some() { 1 } else { 2 };
    let ports = env::free_ports(wanted, given_port).map_err(setup("finding free ports"))?;
    let bootstrap = match &spec.bootstrap {
        Some(b) => b.clone(),
        None => format!("{}:{}", env::LOCALHOST, ports[1]),
    };
    let secret = match weft_contract::params::WEFT_JOB_SECRET.raw_os() {
        Some(_) => None,
        None => Some(env::fresh_secret().map_err(setup("generating the job secret"))?),
    };
    Ok(env::JobEnv {
        job,
        world_size: spec.ranks,
        bootstrap,
        master_port: ports[0],
        secret,
        pod: None,
    })
}

/// Runs the job described by `spec` to its end and reports how it ended.
///
/// Blocks the calling thread, which must not exit before this returns (it is
/// the ranks' parent for PDEATHSIG). Output is printed as it comes (or
/// captured). When a rank fails, the others get SIGTERM and, after
/// `spec.grace`, SIGKILL. Each rank's process group is SIGKILLed when its
/// leader exits, so a rank's leftover children die with it. On return every
/// rank is reaped and the job's `/dev/shm/weft-<job>-*` files are removed.
pub fn launch(spec: &LaunchSpec) -> Result<LaunchOutcome, LaunchError> {
    let job = job_env(spec)?;
    let label = spec.label.as_str();
    let signals = if spec.forward_signals {
        Some(
            signals::SignalGuard::install().map_err(|source| LaunchError::Setup {
                what: "installing signal handlers",
                source,
            })?,
        )
    } else {
        None
    };
    let old_subreaper = if spec.subreaper {
        Some(
            process::become_subreaper().map_err(|source| LaunchError::Setup {
                what: "becoming the subreaper of the ranks",
                source,
            })?,
        )
    } else {
        None
    };
    let mps = mps::maybe_start(
        mps::Mode::from_env(),
        spec.ranks,
        &mps::Host::probe(),
        &job.job,
        &mut |m| diag(label, m),
    )
    .map_err(LaunchError::InvalidSpec)?;
    let mps_vars = mps.as_ref().map(|d| d.vars()).unwrap_or_default();
    let start = Instant::now();

    // The recovery board of --replace-failed: a private directory.
    let board = match spec.replace_failed {
        Some(_) => Some(
            recovery_board(&job.job).map_err(|source| LaunchError::Setup {
                what: "creating the recovery board",
                source,
            })?,
        ),
        None => None,
    };
    let rank_vars = |rank: usize, inc: u32| {
        let mut vars = job.rank_vars(rank);
        vars.extend(mps_vars.iter().cloned());
        if let Some(b) = &board {
            vars.push((
                weft_contract::params::WEFT_RECOVERY_DIR.name().into(),
                b.to_string_lossy().into_owned(),
            ));
            vars.push((
                weft_contract::params::WEFT_INCARNATION.name().into(),
                inc.to_string(),
            ));
        }
        vars.extend(spec.env_extra.iter().cloned());
        vars
    };
    let mut live: Vec<libc::pid_t> = Vec::with_capacity(spec.ranks);
    let mut pipes = Vec::with_capacity(spec.ranks);
    for rank in 0..spec.ranks {
        let vars = rank_vars(rank, 0);
        match process::spawn_rank(&spec.program, &spec.args, &vars) {
            Ok(s) => {
                live.push(s.pid);
                pipes.push((s.stdout, s.stderr));
            }
            Err(source) => {
                // Never leave the ranks already started behind.
                for &pid in &live {
                    process::signal_group(pid, libc::SIGKILL);
                    process::reap(pid);
                }
                if let Some(old) = old_subreaper {
                    process::kill_orphans();
                    process::set_subreaper(old);
                }
                drop(pipes);
                return Err(LaunchError::Spawn {
                    rank,
                    program: spec.program.to_string_lossy().into_owned(),
                    source,
                });
            }
        }
    }
    let sink = if spec.capture {
        output::Sink::Capture
    } else {
        output::Sink::Print {
            prefix: spec.prefix,
        }
    };
    let pump = output::Pump::start(pipes, sink);

    let pids = live.clone();
    let mut supervisor = supervise::Supervisor::new(label, spec.grace, spec.timeout, start, pids);
    if let (Some(budget), Some(b)) = (spec.replace_failed, &board) {
        let pump = &pump;
        let rank_vars = &rank_vars;
        supervisor.replacer = Some(supervise::Replacer {
            budget,
            board: b.clone(),
            spawn: Box::new(move |rank, inc| {
                let s = process::spawn_rank(&spec.program, &spec.args, &rank_vars(rank, inc))?;
                pump.add(rank, s.stdout, s.stderr);
                Ok(s.pid)
            }),
            incarnations: vec![0; spec.ranks],
            deaths: Vec::new(),
            replaced: Vec::new(),
        });
    }
    let (statuses, stop, replaced, live) = supervisor.run(signals.as_ref());
    // Every rank is reaped: the daemon has no clients left. Stop it before
    // the subreaper's sweep, which would otherwise kill it as an escapee.
    drop(mps);

    if let Some(old) = old_subreaper {
        let n = process::kill_orphans();
        if n > 0 {
            diag(
                label,
                &format!(
                    "killed {n} leftover process(es) that had left their rank's process group"
                ),
            );
        }
        process::set_subreaper(old);
    }
    let outputs = pump.finish();
    let shm_removed = shm::remove_job_segments(std::path::Path::new(shm::SHM_DIR), &job.job);
    if let Some(b) = &board {
        let _ = std::fs::remove_dir_all(b);
    }
    drop(signals);
    let ranks = live
        .into_iter()
        .zip(statuses)
        .zip(outputs)
        .enumerate()
        .map(|(rank, ((pid, status), output))| RankResult {
            rank,
            pid: pid as u32,
            status,
            output,
        })
        .collect();
    Ok(LaunchOutcome {
        job: job.job,
        bootstrap: job.bootstrap,
        ranks,
        stop,
        shm_removed,
        elapsed: start.elapsed(),
        replaced,
    })
}

/// A fresh private directory (0700) for the recovery board.
fn recovery_board(job: &str) -> io::Result<PathBuf> {
    use std::os::unix::fs::DirBuilderExt;
    let base = std::env::temp_dir();
    for i in 0..100u32 {
        let d = base.join(format!("weft-recovery-{job}-{}-{i}", std::process::id()));
        match std::fs::DirBuilder::new().mode(0o700).create(&d) {
            Ok(()) => return Ok(d),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(e),
        }
    }
    Err(io::Error::other("no free name for the recovery board"))
}
