//! `weft run`: start N ranks of a command on this machine, as the operator
//! would in pods ([`mod@crate::launch`] does the work), with `--sidecar` a
//! local `weft sidecar` for them ([`local_sidecar`]).

pub mod local_sidecar;

use std::ffi::OsString;
use std::time::Duration;

use clap::Args;

use crate::arg_values::parse_secs;
use crate::launch::{self, LaunchSpec};

/// `weft run --help`, after the options.
pub const HELP: &str = "\
Each rank gets WEFT_RANK, WEFT_LOCAL_RANK, WEFT_WORLD_SIZE, WEFT_LOCAL_RANKS,
WEFT_RANK_OFFSET, WEFT_NNODES, WEFT_NODE_RANK, WEFT_BOOTSTRAP, NCCL_COMM_ID,
WEFT_JOB, WEFT_JOB_SECRET, RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT and torchrun's PET_* variables.

Inside a pod of a CollectiveJob (the operator's pod contract, WEFT_RESTART_EPOCH
and the rest, in the environment) -n must equal WEFT_LOCAL_RANKS, and the ranks
are the pod's share of the job: rank WEFT_RANK_OFFSET + i of WEFT_WORLD_SIZE,
the job's rendezvous, name and secret file; WEFT_INCARNATION and
WEFT_RECOVERY_DIR pass through.

When a rank fails the others get SIGTERM, then SIGKILL after --grace; with
--replace-failed the rank's process is started again with the same rank
(WEFT_INCARNATION counts them) and the job goes on.
SIGINT/SIGTERM/SIGHUP are forwarded to every rank; a second SIGINT kills them.

Exit status: 0 when every rank exits 0; else the first failing rank's code
(128+N when killed by signal N); 124 on --timeout; 128+N when weft run itself
got signal N; 127 when CMD cannot be found; 2 for bad arguments.";

/// `weft run -n N [options] [--] CMD [ARGS...]`
#[derive(Debug, Args)]
pub struct RunArgs {
    /// Number of ranks to start.
    #[arg(short = 'n', long = "nproc", visible_alias = "ranks", value_name = "N",
          value_parser = clap::value_parser!(u32).range(1..))]
    pub nproc: u32,
    /// Print ranks' output as is, without `[rank] ` prefixes.
    #[arg(long)]
    pub no_prefix: bool,
    /// Seconds between SIGTERM and SIGKILL when stopping ranks.
    #[arg(long, value_name = "SECS", default_value = "3", value_parser = parse_secs)]
    pub grace: Duration,
    /// Stop every rank and exit 124 when the job runs longer than this.
    #[arg(long, value_name = "SECS", value_parser = parse_secs)]
    pub timeout: Option<Duration>,
    #[arg(
        long,
        value_name = "NAME",
        help = "Job name (WEFT_JOB); default local-<pid>"
    )]
    pub job: Option<String>,
    #[arg(
        long,
        value_name = "HOST:PORT",
        help = "Rendezvous address (WEFT_BOOTSTRAP, NCCL_COMM_ID); default 127.0.0.1:<free port>"
    )]
    pub bootstrap: Option<String>,
    /// Start a `weft sidecar` for the ranks (WEFT_SIDECAR_SOCKET), stopped with SIGTERM after them.
    #[arg(long)]
    pub sidecar: bool,
    /// Restart a failed rank's process with the same rank, at most N times in
    /// all (default 3), and keep the job running: ranks that use libcomm's
    /// `Resilient` shrink around it and grow back when it is up
    /// (docs/FAULT-TOLERANCE.md).
    #[arg(long, value_name = "N", num_args = 0..=1, require_equals = true,
          default_missing_value = "3")]
    pub replace_failed: Option<u32>,
    /// The command each rank runs, and its arguments.
    #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true,
          value_name = "CMD", value_parser = clap::value_parser!(OsString))]
    pub command: Vec<OsString>,
}

impl RunArgs {
    /// The library spec for these arguments.
    pub fn to_spec(&self) -> LaunchSpec {
        let mut spec = LaunchSpec::new(self.nproc as usize, self.command[0].clone());
        spec.args = self.command[1..].to_vec();
        spec.prefix = !self.no_prefix;
        spec.grace = self.grace;
        spec.timeout = self.timeout;
        spec.job = self.job.clone();
        spec.bootstrap = self.bootstrap.clone();
        spec.forward_signals = true;
        spec.subreaper = true;
        spec.replace_failed = self.replace_failed.map(|n| n as usize);
        spec
    }
}

/// `weft run`: launch, wait, and exit like the first failing rank.
pub fn run(args: RunArgs) -> i32 {
    let mut spec = args.to_spec();
    let _sidecar = if args.sidecar {
        // The orphan sweep would kill the sidecar (our child) before it can
        // be stopped in order; ranks still die with their process groups.
        spec.subreaper = false;
        match local_sidecar::start(&mut spec) {
            Ok(s) => Some(s),
            Err(e) => {
                let _ = launch::output::write_all(2, format!("weft run: {e}\n").as_bytes());
                return 1;
            }
        }
    } else {
        None
    };
    match launch::preload::rank_var() {
        Ok(Some(var)) => spec.env_extra.push(var),
        Ok(None) => {}
        Err(e) => {
            let _ = launch::output::write_all(2, format!("weft run: {e}\n").as_bytes());
            return 2;
        }
    }
    match launch::launch(&spec) {
        Ok(outcome) => outcome.exit_code(),
        Err(e) => {
            let _ = launch::output::write_all(2, format!("weft run: {e}\n").as_bytes());
            e.exit_code()
        }
    }
}
