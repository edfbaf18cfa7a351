//! `weft run` and `weft bench` inside pods of a CollectiveJob, without
//! Kubernetes: each "pod" is a process given the operator's pod contract
//! (WEFT_RESTART_EPOCH, WEFT_WORLD_SIZE, WEFT_RANK_OFFSET, WEFT_LOCAL_RANKS,
//! the job's rendezvous and secret file, ...) as the operator writes it
//! (`weft_contract::env::PodEnv`), and a host name of its own (so its ranks
//! reach the other pod's over TCP, as across pods). The pod's command is the
//! examples': `weft bench ...` alone, or under `weft run -n $(WEFT_LOCAL_RANKS)`.

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;
use std::time::Instant;

use common::*;
use weft_contract::env::{PodEnv, TorchRunEnv};

const JOB: &str = "podtest";

/// The job both pods belong to: its rendezvous and secret file.
struct Job {
    pods: u32,
    per_pod: u32,
    bootstrap: String,
    secret_file: String,
}

impl Job {
    fn new(pods: u32, per_pod: u32) -> Job {
        let dir = scratch("pod-contract");
        let secret = dir.join("token");
        std::fs::write(&secret, weft::launch::env::fresh_secret().unwrap()).unwrap();
        let port = weft::launch::env::free_ports(1, None).unwrap()[0];
        Job {
            pods,
            per_pod,
            bootstrap: format!("127.0.0.1:{port}"),
            secret_file: secret.to_string_lossy().into_owned(),
        }
    }

    /// What the operator puts into pod `index`.
    fn contract(&self, index: u32) -> PodEnv {
        PodEnv {
            job: JOB.into(),
            namespace: "ns".into(),
            world_size: self.pods * self.per_pod,
            rank_offset: index * self.per_pod,
            local_ranks: self.per_pod,
            nnodes: self.pods,
            node_rank: index,
            bootstrap: self.bootstrap.clone(),
            // No sidecar in this test: ranks run its engine in-process.
            sidecar_socket: String::new(),
            secret_file: self.secret_file.clone(),
            restart_epoch: 0,
            incarnation: 0,
            recovery_dir: None,
            transport: "auto".into(),
            net_if: None,
            otlp_endpoint: None,
            torch: TorchRunEnv {
                nnodes: self.pods,
                node_rank: index,
                nproc_per_node: self.per_pod,
                master_addr: "127.0.0.1".into(),
                master_port: 29500,
            },
        }
    }

    /// `weft ARGS` as the command of pod `index`.
    fn pod_cmd(&self, index: u32, args: &[&str]) -> Command {
        let mut cmd = weft_cmd(args);
        for k in [
            "WEFT_JOB_SECRET",
            "WEFT_RANK",
            "RANK",
            "WORLD_SIZE",
            "WEFT_WORLD_SIZE",
        ] {
            cmd.env_remove(k);
        }
        for (k, v) in self.contract(index).to_vars() {
            cmd.env(k, v);
        }
        cmd.env("WEFT_HOSTNAME", format!("pod-{index}"));
        cmd
    }

    /// Runs `weft ARGS` in every pod at once, with `env` on top of the pod
    /// contract; returns each pod's run.
    fn run_pods(&self, args: &[&str], env: &[(&str, &str)]) -> Vec<Run> {
        let start = Instant::now();
        let children: Vec<_> = (0..self.pods)
            .map(|i| {
                let mut cmd = self.pod_cmd(i, args);
                cmd.envs(env.iter().copied());
                cmd.spawn().expect("start weft")
            })
            .collect();
        children.into_iter().map(|c| finish(c, start)).collect()
    }
}

/// Every rank's `env` from a pod's prefixed output.
fn rank_envs(run: &Run) -> BTreeMap<usize, BTreeMap<String, String>> {
    let mut envs: BTreeMap<usize, BTreeMap<String, String>> = BTreeMap::new();
    for line in run.out().lines() {
        if let Some((local, kv)) = split_prefix(line)
            && let Some((k, v)) = kv.split_once('=')
        {
            envs.entry(local)
                .or_default()
                .insert(k.to_string(), v.to_string());
        }
    }
    envs
}

#[test]
fn run_in_a_pod_starts_the_pods_ranks_of_the_job() {
    let job = Job::new(3, 2);
    let run = run_cmd(job.pod_cmd(1, &["run", "-n", "2", "--", "env"]));
    assert_eq!(run.code, Some(0), "{}", run.err());
    let envs = rank_envs(&run);
    assert_eq!(envs.len(), 2);
    for (local, env) in &envs {
        let global = (2 + local).to_string();
        for (k, want) in [
            ("WEFT_RANK", global.as_str()),
            ("RANK", &global),
            ("WEFT_LOCAL_RANK", &local.to_string()),
            ("WEFT_WORLD_SIZE", "6"),
            ("WORLD_SIZE", "6"),
            ("WEFT_LOCAL_RANKS", "2"),
            ("WEFT_RANK_OFFSET", "2"),
            ("WEFT_NNODES", "3"),
            ("WEFT_NODE_RANK", "1"),
            ("WEFT_BOOTSTRAP", &job.bootstrap),
            ("NCCL_COMM_ID", &job.bootstrap),
            ("WEFT_JOB", JOB),
            ("WEFT_JOB_SECRET_FILE", &job.secret_file),
        ] {
            assert_eq!(
                env.get(k).map(String::as_str),
                Some(want),
                "{k} of local rank {local}"
            );
        }
        assert!(
            !env.contains_key("WEFT_JOB_SECRET"),
            "the secret stays in its file"
        );
    }
}

#[test]
fn run_in_a_pod_refuses_a_count_other_than_the_pods() {
    let job = Job::new(2, 2);
    let run = run_cmd(job.pod_cmd(0, &["run", "-n", "4", "--", "true"]));
    assert_eq!(run.code, Some(2), "{}", run.err());
    assert!(run.err().contains("WEFT_LOCAL_RANKS"), "{}", run.err());
}

/// A launcher inside a rank of a pod would start the pod's ranks again, with
/// the same numbers ("rank 1 joined twice"): it is refused.
#[test]
fn a_launcher_inside_a_rank_of_a_pod_is_refused() {
    let job = Job::new(2, 2);
    let mut cmd = job.pod_cmd(0, &["run", "-n", "2", "--", "true"]);
    cmd.env("WEFT_RANK", "1");
    let run = run_cmd(cmd);
    assert_eq!(run.code, Some(2), "{}", run.err());
    assert!(run.err().contains("already rank 1"), "{}", run.err());
}

/// Checks the two pods' runs of a `weft bench` job of 2 x 2 ranks: both
/// succeeded, and rank 0's pod alone printed one table of 4 ranks without a
/// wrong value. Returns that table.
fn assert_one_table_of_four(runs: &[Run]) -> String {
    for (i, r) in runs.iter().enumerate() {
        assert_eq!(
            r.code,
            Some(0),
            "pod {i}\nstdout:\n{}\nstderr:\n{}",
            r.out(),
            r.err()
        );
    }
    let table = runs[0].out();
    assert!(table.contains("# nRanks 4 "), "{table}");
    assert_eq!(
        table.matches("Collective test starting").count(),
        1,
        "{table}"
    );
    assert!(table.contains("# Out of bounds values : 0 OK\n"), "{table}");
    assert_eq!(runs[1].out(), "", "only rank 0 prints the table");
    table
}

/// Checks the two pods' runs of plain `weft bench all_reduce` on 2 x 2
/// ranks: one table (rows of `sizes`), naming each rank's own host; the
/// other pod says its ranks finished.
fn assert_one_job_of_four(runs: &[Run], sizes: &[&str]) {
    let table = assert_one_table_of_four(runs);
    for (rank, host) in [(0, "pod-0"), (1, "pod-0"), (2, "pod-1"), (3, "pod-1")] {
        let line = table
            .lines()
            .find(|l| l.starts_with(&format!("#  Rank {rank:>2} ")))
            .unwrap_or_else(|| panic!("no header line of rank {rank}:\n{table}"));
        assert!(line.contains(&format!(" on {host:>10} ")), "{line}");
    }
    let rows: Vec<&str> = table
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| l.split_whitespace().next().unwrap())
        .collect();
    assert_eq!(rows, sizes, "{table}");
    assert!(
        runs[1]
            .err()
            .contains("ranks 2..3 of 4 finished, no wrong values"),
        "{}",
        runs[1].err()
    );
}

const BENCH: &[&str] = &[
    "all_reduce",
    "-b",
    "1K",
    "-e",
    "64K",
    "-f",
    "8",
    "-w",
    "1",
    "-i",
    "2",
    "--check",
    "--timeout",
    "25",
];

/// The example's command: plain `weft bench` in each pod.
#[test]
fn bench_in_each_pod_is_one_job_over_the_pods() {
    let job = Job::new(2, 2);
    let mut args = vec!["bench"];
    args.extend_from_slice(BENCH);
    assert_one_job_of_four(&job.run_pods(&args, &[]), &["1024", "8192", "65536"]);
}

/// examples/bench-allreduce.yaml's own command (its sweep cut at 64K to
/// keep the test short) in pods of the example's shape.
#[test]
fn the_bench_examples_command_runs_in_its_pods() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let example = std::fs::read_to_string(root.join("examples/bench-allreduce.yaml")).unwrap();
    let number = |key: &str| -> u32 {
        example
            .lines()
            .find_map(|l| l.strip_prefix(&format!("  {key}: ")))
            .unwrap_or_else(|| panic!("no {key} in the example"))
            .parse()
            .unwrap()
    };
    assert_eq!((number("replicas"), number("ranksPerReplica")), (2, 2));
    // The command is one line, a flow sequence: JSON.
    let line = example
        .lines()
        .find_map(|l| l.trim().strip_prefix("command: "))
        .expect("the example's command");
    let mut argv: Vec<String> = serde_json::from_str(line).expect("a one-line command");
    assert_eq!(
        &argv[..2],
        ["weft", "bench"],
        "the example runs plain weft bench"
    );
    let e = argv.iter().position(|a| a == "-e").expect("-e");
    argv[e + 1] = "64K".into();
    argv.extend(["--timeout".into(), "25".into()]);
    let args: Vec<&str> = argv[1..].iter().map(String::as_str).collect();
    let runs = Job::new(2, 2).run_pods(&args, &[]);
    assert_one_job_of_four(&runs, &["1024", "4096", "16384", "65536"]);
}

/// `weft run -n $(WEFT_LOCAL_RANKS) -- weft bench ...`: each rank is a rank.
#[test]
fn bench_under_weft_run_in_each_pod_is_one_job_over_the_pods() {
    let job = Job::new(2, 2);
    let mut args = vec!["run", "-n", "2", "--no-prefix", "--", "weft", "bench"];
    args.extend_from_slice(BENCH);
    let weft_dir = Path::new(env!("CARGO_BIN_EXE_weft")).parent().unwrap();
    let path = format!(
        "{}:{}",
        weft_dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    assert_one_table_of_four(&job.run_pods(&args, &[("PATH", &path)]));
}

#[test]
fn bench_in_a_pod_refuses_a_world_other_than_the_jobs() {
    let job = Job::new(2, 2);
    let run = run_cmd(job.pod_cmd(0, &["bench", "all_reduce", "-n", "2"]));
    assert_eq!(run.code, Some(2), "{}", run.err());
    assert!(
        run.err().contains("has 4 ranks (WEFT_WORLD_SIZE)"),
        "{}",
        run.err()
    );
}
