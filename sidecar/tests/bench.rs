//! `weft bench`: every collective runs across local ranks, prints nccl-tests'
//! table and finds no wrong element on random data.

mod common;

use common::*;

/// Data rows of the table (lines not starting with `#`), split into columns.
fn rows(out: &str) -> Vec<Vec<String>> {
    out.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| l.split_whitespace().map(str::to_string).collect())
        .collect()
}

/// Runs `weft bench ARGS`, asserts success, the table's shape and #wrong 0.
fn bench_ok(args: &[&str], op: &str, sizes: &[u64], redop: &str, root: &str) {
    let mut all = vec!["bench"];
    all.extend_from_slice(args);
    all.extend_from_slice(&["--timeout", "25"]);
    let run = weft(&all);
    let out = run.out();
    assert_eq!(
        run.code,
        Some(0),
        "weft {}\nstdout:\n{out}\nstderr:\n{}",
        all.join(" "),
        run.err()
    );
    let lines: Vec<&str> = out.lines().collect();
    assert!(lines[0].starts_with("# weft bench"), "{out}");
    assert_eq!(lines[1], format!("# Collective test starting: {op}"));
    assert!(out.contains("out-of-place"), "{out}");
    assert!(out.contains("in-place"), "{out}");
    assert!(
        out.lines()
            .any(|l| l.starts_with("#       size         count")),
        "{out}"
    );
    assert!(out.contains("# Out of bounds values : 0 OK\n"), "{out}");
    assert!(out.contains("# Avg bus bandwidth    : "), "{out}");
    assert!(
        out.ends_with(&format!("# Collective test concluded: {op}\n")),
        "{out}"
    );
    let rows = rows(&out);
    let got: Vec<u64> = rows.iter().map(|r| r[0].parse().unwrap()).collect();
    assert_eq!(got, sizes, "{out}");
    for r in &rows {
        assert_eq!(r.len(), 13, "{r:?}");
        assert_eq!(r[2], "float");
        assert_eq!(r[3], redop);
        assert_eq!(r[4], root);
        for c in [5, 6, 7, 9, 10, 11] {
            let v: f64 = r[c]
                .parse()
                .unwrap_or_else(|_| panic!("column {c} of {r:?}"));
            assert!(v >= 0.0);
        }
        assert_eq!(r[8], "0", "out-of-place #wrong in {r:?}");
        // Send/recv in place is undefined (one buffer both sent from and
        // received into), so it is timed but not checked, as nccl-tests.
        let in_place_wrong = if op == "sendrecv" { "N/A" } else { "0" };
        assert_eq!(r[12], in_place_wrong, "in-place #wrong in {r:?}");
    }
    // Only rank 0 prints: one table.
    assert_eq!(out.matches("Collective test starting").count(), 1);
}

#[test]
fn all_reduce_three_ranks_checked() {
    bench_ok(
        &[
            "all_reduce",
            "-n",
            "3",
            "-b",
            "8",
            "-e",
            "64K",
            "-f",
            "8",
            "--check",
        ],
        "all_reduce",
        &[8, 64, 512, 4096, 32768],
        "sum",
        "-1",
    );
}

#[test]
fn every_other_collective_checked() {
    let common = [
        "-n", "3", "-b", "1K", "-e", "64K", "-f", "8", "-w", "1", "-i", "2", "--check",
    ];
    for (op, name, sizes, redop, root) in [
        (
            "all_gather",
            "all_gather",
            [1008, 8160, 65520],
            "none",
            "-1",
        ),
        (
            "reducescatter",
            "reduce_scatter",
            [1008, 8160, 65520],
            "sum",
            "-1",
        ),
        ("broadcast", "broadcast", [1024, 8192, 65536], "none", "1"),
        ("reduce", "reduce", [1024, 8192, 65536], "sum", "1"),
        ("alltoall", "alltoall", [1008, 8160, 65520], "none", "-1"),
        ("sendrecv", "sendrecv", [1024, 8192, 65536], "none", "-1"),
    ] {
        let mut args = vec![op];
        args.extend_from_slice(&common);
        args.extend_from_slice(&["-r", "1"]);
        bench_ok(&args, name, &sizes, redop, root);
    }
}

#[test]
fn json_output() {
    let run = weft(&[
        "bench",
        "allreduce",
        "-n",
        "2",
        "-b",
        "8",
        "-e",
        "64",
        "-f",
        "8",
        "--json",
        "--check",
        "-a",
        "ring",
        "--timeout",
        "25",
    ]);
    assert_eq!(run.code, Some(0), "{}", run.err());
    let out = run.out();
    assert!(out.starts_with("{\n"), "{out}");
    assert!(out.contains("\"op\": \"all_reduce\""), "{out}");
    assert!(out.contains("\"algo\": \"ring\""), "{out}");
    assert_eq!(out.matches("\"size\": ").count(), 2, "{out}");
    assert!(out.contains("\"out_of_bounds\": 0"), "{out}");
}

/// `--device cuda` without a GPU: each rank fails with a clear message and
/// the launcher exits 1. (On a GPU machine the run is the test below.)
#[test]
fn cuda_device_without_a_gpu_says_why_not() {
    if libcomm::cuda::driver().is_ok() && libcomm::cuda::device_count() > 0 {
        // A GPU is here: `cuda_device_runs_every_collective` is the check.
        return;
    }
    let run = weft(&[
        "bench",
        "all_reduce",
        "-n",
        "2",
        "--device",
        "cuda",
        "--timeout",
        "25",
    ]);
    assert_eq!(run.code, Some(1), "{}", run.err());
    assert!(
        run.err().contains("--device cuda: no CUDA driver")
            || run
                .err()
                .contains("--device cuda: the CUDA driver sees no GPU"),
        "{}",
        run.err()
    );
}

/// `--device cuda` on a GPU machine: every collective runs on device memory
/// across processes (CUDA IPC) with #wrong 0.
#[test]
#[ignore = "needs a CUDA GPU: on the GPU machine, cargo test -p weft --test bench -- --ignored cuda_device_runs_every_collective"]
fn cuda_device_runs_every_collective() {
    assert!(
        libcomm::cuda::driver().is_ok() && libcomm::cuda::device_count() > 0,
        "cuda_device_runs_every_collective needs a CUDA GPU"
    );
    let n = libcomm::cuda::device_count().clamp(2, 4).to_string();
    for (name, redop, root) in [
        ("all_reduce", "sum", "-1"),
        ("all_gather", "none", "-1"),
        ("reduce_scatter", "sum", "-1"),
        ("broadcast", "none", "0"),
        ("reduce", "sum", "0"),
        ("alltoall", "none", "-1"),
        ("sendrecv", "none", "-1"),
    ] {
        bench_ok(
            &[
                name, "-n", &n, "-b", "1K", "-e", "4M", "-f", "64", "--check", "--device", "cuda",
            ],
            name,
            &[1024, 65536, 4194304],
            redop,
            root,
        );
    }
}

#[test]
fn bad_arguments() {
    let run = weft(&["bench", "all_reduce", "-n", "2", "-r", "2"]);
    assert_eq!(run.code, Some(2), "{}", run.err());
    let run = weft(&["bench", "allreducee"]);
    assert_eq!(run.code, Some(2), "{}", run.err());
}
