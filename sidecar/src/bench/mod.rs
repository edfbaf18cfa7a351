//! `weft bench`: an nccl-tests-style benchmark of Weft's collectives.
//!
//! `weft bench OP -n N ...` launches N copies of this same binary through
//! [`mod@crate::launch`] with the hidden `weft bench-rank` command ([`worker`]);
//! rank 0 prints the table, the other ranks print only errors. In a pod of a
//! CollectiveJob it launches the pod's share of the job, and under a launcher
//! it is one rank ([`placement`]). Modules: [`args`] (options), [`sizes`]
//! (size parsing and sweep), [`ops`] (one collective each: layout, bandwidth
//! factor, call, check), [`check`] (random data and the host reference),
//! [`report`] (table and JSON) and [`worker`].

pub mod args;
pub mod check;
pub mod ops;
pub mod placement;
pub mod report;
pub mod sizes;
pub mod worker;

use std::io::Write;

pub use args::BenchArgs;
pub use ops::BenchOp;

use crate::launch::{self, LaunchSpec};
use placement::Placement;

fn say(msg: &str) {
    let _ = writeln!(std::io::stderr(), "weft bench: {msg}");
}

/// `weft bench`: validate, launch the ranks (or be one), and exit 0 only
/// when every rank succeeded and no result was wrong.
pub fn run(mut args: BenchArgs) -> i32 {
    let place = match Placement::detect(args.nranks, &weft_contract::params::process_env) {
        Ok(p) => p,
        Err(e) => {
            say(&e);
            return 2;
        }
    };
    args.nranks = Some(place.world());
    if let Err(e) = args.validate() {
        say(&e);
        return 2;
    }
    match place {
        Placement::Rank { .. } => worker::main(&args),
        Placement::Local { .. } | Placement::Pod { .. } => launch_ranks(&args, &place),
    }
}

/// Starts this machine's (or pod's) ranks and collects the result that the
/// first of them reports.
fn launch_ranks(args: &BenchArgs, place: &Placement) -> i32 {
    let exe = match std::env::current_exe() {
        Ok(p) => p,
        Err(e) => {
            say(&format!("cannot find the weft binary to start ranks: {e}"));
            return 1;
        }
    };
    let result = std::env::temp_dir().join(format!(
        "weft-bench-{}-{}.result",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0)
    ));
    let _ = std::fs::remove_file(&result);

    let mut spec = LaunchSpec::new(place.to_start() as usize, exe.into_os_string());
    spec.args = args.to_rank_argv();
    spec.prefix = false;
    spec.capture = false;
    spec.timeout = args.timeout;
    spec.forward_signals = true;
    spec.subreaper = true;
    spec.label = "weft bench".into();
    spec.env_extra.push((
        worker::RESULT_ENV.into(),
        result.to_string_lossy().into_owned(),
    ));
    if let Some(a) = &args.algo {
        spec.env_extra.push(("WEFT_ALGO".into(), a.clone()));
    }

    let code = match launch::launch(&spec) {
        Ok(outcome) => outcome.exit_code(),
        Err(e) => {
            say(&e.to_string());
            e.exit_code()
        }
    };
    let report = std::fs::read_to_string(&result);
    let _ = std::fs::remove_file(&result);
    if code != 0 {
        return code;
    }
    let wrong = report.ok().and_then(|s| {
        s.trim()
            .strip_prefix("wrong=")
            .and_then(|w| w.parse::<u64>().ok())
    });
    match wrong {
        Some(0) => {
            // Rank 0 printed the table in its pod; say in the others' logs
            // that their ranks finished too.
            if let Placement::Pod {
                world,
                local,
                first,
            } = *place
                && first > 0
            {
                say(&format!(
                    "ranks {first}..{} of {world} finished{} (rank 0's pod prints the table)",
                    first + local - 1,
                    if args.check { ", no wrong values" } else { "" }
                ));
            }
            0
        }
        Some(w) => {
            say(&format!("{w} wrong values"));
            1
        }
        None => {
            say("the first rank ended without reporting a result");
            1
        }
    }
}

/// `weft bench-rank`: one rank (started by `weft bench`).
pub fn rank(args: BenchArgs) -> i32 {
    worker::main(&args)
}
