//! `resilient-train STEPS [SCENARIO VICTIM STEP] [--step-ms=N]`: a data-parallel training
//! loop on the CPU that survives the loss of a rank (libcomm's `Resilient`):
//! the workload of examples/replace-rank.yaml and of the e2e ReplaceRank
//! scenarios. Started by `weft run` (in a pod: `weft run -n
//! $(WEFT_LOCAL_RANKS) -- resilient-train ...`); a replacement pod
//! (`WEFT_INCARNATION` > 0) joins the running job. It prints `@ kill`,
//! `@ shrunk`, `@ grown` with their times, and at the end `@ final w=HEX`
//! (the weights, equal to a run without failure) and `@ steps=N size=N`.
//! `--step-ms=N` pauses after each step and reports progress (a job that runs
//! long enough to lose a pod on purpose); recovery/train.rs has the scenarios.

#[path = "recovery/train.rs"]
mod train;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let Err(e) = train::run(&args) {
        eprintln!("resilient-train: {e}");
        std::process::exit(1);
    }
}
