//! `weft run` gives each rank the environment contract of DESIGN.md.

mod common;

use std::collections::{BTreeMap, BTreeSet};

use common::*;

/// Every rank's `env`, parsed from the prefixed output.
fn rank_envs(run: &Run, n: usize) -> Vec<BTreeMap<String, String>> {
    let mut envs = vec![BTreeMap::new(); n];
    for line in run.out().lines() {
        if let Some((rank, kv)) = split_prefix(line)
            && let Some((k, v)) = kv.split_once('=')
        {
            envs[rank].insert(k.to_string(), v.to_string());
        }
    }
    envs
}

#[test]
fn every_rank_gets_the_contract() {
    let n = 3;
    let mut cmd = weft_cmd(&["run", "-n", "3", "--job", "envtest", "--", "env"]);
    cmd.env_remove("WEFT_JOB_SECRET");
    cmd.env("WEFT_TEST_INHERITED", "kept");
    let run = run_cmd(cmd);
    assert_eq!(run.code, Some(0), "stderr: {}", run.err());
    let envs = rank_envs(&run, n);

    let bootstrap = envs[0]["WEFT_BOOTSTRAP"].clone();
    let (host, port) = bootstrap.rsplit_once(':').unwrap();
    assert_eq!(host, "127.0.0.1");
    let port: u16 = port.parse().unwrap();
    let secret = envs[0]["WEFT_JOB_SECRET"].clone();
    assert_eq!(secret.len(), 64);
    assert!(secret.chars().all(|c| c.is_ascii_hexdigit()));

    let mut ranks = BTreeSet::new();
    for (i, env) in envs.iter().enumerate() {
        let get = |k: &str| {
            env.get(k)
                .unwrap_or_else(|| panic!("rank {i}: no {k}"))
                .as_str()
        };
        let i_s = i.to_string();
        for k in ["WEFT_RANK", "WEFT_LOCAL_RANK", "RANK", "LOCAL_RANK"] {
            assert_eq!(get(k), i_s, "{k} of rank {i}");
        }
        for k in [
            "WEFT_WORLD_SIZE",
            "WEFT_LOCAL_RANKS",
            "WORLD_SIZE",
            "LOCAL_WORLD_SIZE",
        ] {
            assert_eq!(get(k), "3", "{k} of rank {i}");
        }
        assert_eq!(get("PET_NPROC_PER_NODE"), "3");
        for k in ["WEFT_RANK_OFFSET", "WEFT_NODE_RANK", "PET_NODE_RANK"] {
            assert_eq!(get(k), "0", "{k}");
        }
        assert_eq!(get("WEFT_NNODES"), "1");
        assert_eq!(get("PET_NNODES"), "1");
        assert_eq!(get("WEFT_BOOTSTRAP"), bootstrap, "same bootstrap for all");
        assert_eq!(get("NCCL_COMM_ID"), bootstrap);
        assert_eq!(get("WEFT_JOB"), "envtest");
        assert_eq!(get("WEFT_JOB_SECRET"), secret, "one secret per job");
        assert_eq!(get("MASTER_ADDR"), "127.0.0.1");
        assert_eq!(get("PET_MASTER_ADDR"), "127.0.0.1");
        let master: u16 = get("MASTER_PORT").parse().unwrap();
        assert_ne!(master, port, "MASTER_PORT distinct from the bootstrap port");
        assert_ne!(master, 0);
        assert_eq!(get("PET_MASTER_PORT"), get("MASTER_PORT"));
        assert_eq!(get("WEFT_TEST_INHERITED"), "kept", "launcher env inherited");
        ranks.insert(get("WEFT_RANK").to_string());
    }
    assert_eq!(ranks.len(), n, "unique ranks");
}

#[test]
fn secret_is_fresh_per_run_unless_inherited() {
    let secret_of = |inherit: Option<&str>| {
        let mut cmd = weft_cmd(&["run", "-n", "1", "--", "sh", "-c", "echo $WEFT_JOB_SECRET"]);
        match inherit {
            Some(s) => cmd.env("WEFT_JOB_SECRET", s),
            None => cmd.env_remove("WEFT_JOB_SECRET"),
        };
        let run = run_cmd(cmd);
        assert_eq!(run.code, Some(0));
        run.out().trim().strip_prefix("[0] ").unwrap().to_string()
    };
    let a = secret_of(None);
    let b = secret_of(None);
    assert_eq!(a.len(), 64);
    assert_ne!(a, b, "a fresh secret per run");
    assert_eq!(secret_of(Some("given-secret")), "given-secret");
}

#[test]
fn bootstrap_override_and_default_job_name() {
    let cmd = weft_cmd(&[
        "run",
        "--bootstrap",
        "10.1.2.3:29400",
        "-n",
        "2",
        "--",
        "sh",
        "-c",
        "echo $WEFT_BOOTSTRAP $NCCL_COMM_ID $MASTER_PORT $WEFT_JOB",
    ]);
    let start = std::time::Instant::now();
    let child = { cmd }.spawn().unwrap();
    let pid = child.id();
    let run = finish(child, start);
    assert_eq!(run.code, Some(0), "{}", run.err());
    for line in run.out().lines() {
        let (_, rest) = split_prefix(line).unwrap();
        let f: Vec<&str> = rest.split(' ').collect();
        assert_eq!(f[0], "10.1.2.3:29400");
        assert_eq!(f[1], "10.1.2.3:29400");
        assert_ne!(f[2], "29400");
        assert_eq!(f[3], format!("local-{pid}"));
    }
}

#[test]
fn bad_arguments_are_usage_errors() {
    for args in [
        &["run", "-n", "0", "true"][..],
        &["run", "-n", "2"],
        &["run", "true"],
        &["run", "-n", "x", "true"],
        &["run", "-n", "2", "--bootstrap", "nonsense", "true"],
        &["run", "-n", "2", "--job", "a/b", "true"],
    ] {
        let run = weft(args);
        assert_eq!(run.code, Some(2), "{args:?}: {}", run.err());
    }
}

/// `WEFT_PRELOAD` puts a library in front of the ranks' loader (PyTorch's
/// wheels find their own NCCL by RPATH, which only LD_PRELOAD overrides),
/// keeps the user's LD_PRELOAD after it, and refuses a path that is not there.
#[test]
fn weft_preload_reaches_the_ranks_first() {
    // Any real shared library will do; libc is on every machine.
    let lib = [
        "/lib/x86_64-linux-gnu/libc.so.6",
        "/lib64/libc.so.6",
        "/usr/lib/libc.so.6",
    ]
    .into_iter()
    .find(|p| std::path::Path::new(p).exists())
    .expect("a libc.so.6 to preload");
    let lib = std::fs::canonicalize(lib).unwrap();
    let mut cmd = weft_cmd(&["run", "-n", "2", "--", "env"]);
    cmd.env("WEFT_PRELOAD", &lib);
    cmd.env("LD_PRELOAD", "");
    let run = run_cmd(cmd);
    assert_eq!(run.code, Some(0), "stderr: {}", run.err());
    for env in rank_envs(&run, 2) {
        assert_eq!(env["LD_PRELOAD"], lib.display().to_string());
    }

    let mut cmd = weft_cmd(&["run", "-n", "1", "--", "env"]);
    cmd.env("WEFT_PRELOAD", "off");
    cmd.env("LD_PRELOAD", &lib);
    let run = run_cmd(cmd);
    assert_eq!(run.code, Some(0), "stderr: {}", run.err());
    assert_eq!(
        rank_envs(&run, 1)[0]["LD_PRELOAD"],
        lib.display().to_string()
    );

    let mut cmd = weft_cmd(&["run", "-n", "1", "--", "true"]);
    cmd.env("WEFT_PRELOAD", "/nonexistent/libnccl.so.2");
    let run = run_cmd(cmd);
    assert_eq!(run.code, Some(2), "stderr: {}", run.err());
    assert!(
        run.err().contains("/nonexistent/libnccl.so.2"),
        "{}",
        run.err()
    );
}
