//! The C ABI end to end: C programs compiled with `cc` against our header and
//! the built `libnccl.so` (installed as `libnccl.so.2` + `libnccl.so` in a
//! temporary prefix), run as several processes through `weft::launch` (what
//! `weft run` does), plus checks of the library's exported symbols and SONAME.
//!
//! Every run has a hard time limit; the launcher kills every rank's process
//! group on timeout or failure, and single-process runs are killed on timeout.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use weft::{LaunchSpec, launch};
use weft_testkit::run_bounded;

/// Every NCCL function the issue requires; each is exported with a `p` twin.
const FUNCTIONS: &[&str] = &[
    "ncclGetVersion",
    "ncclGetUniqueId",
    "ncclCommInitRank",
    "ncclCommInitAll",
    "ncclCommInitRankConfig",
    "ncclCommInitRankScalable",
    "ncclCommSplit",
    "ncclCommShrink",
    "ncclCommRevoke",
    "ncclCommGetUniqueId",
    "ncclCommGrow",
    "ncclCommFinalize",
    "ncclCommDestroy",
    "ncclCommAbort",
    "ncclCommGetAsyncError",
    "ncclCommCount",
    "ncclCommCuDevice",
    "ncclCommUserRank",
    "ncclGetErrorString",
    "ncclGetLastError",
    "ncclMemAlloc",
    "ncclMemFree",
    "ncclCommRegister",
    "ncclCommDeregister",
    "ncclRedOpCreatePreMulSum",
    "ncclRedOpDestroy",
    "ncclAllReduce",
    "ncclBroadcast",
    "ncclBcast",
    "ncclReduce",
    "ncclAllGather",
    "ncclReduceScatter",
    "ncclAlltoAll",
    "ncclGather",
    "ncclScatter",
    "ncclSend",
    "ncclRecv",
    "ncclGroupStart",
    "ncclGroupEnd",
    "ncclGroupSimulateEnd",
];

mod common;
use common::{built_library, crate_dir, include_dir};

// The receiver the sidecar's tests use (crate weft-tests, which depends on
// this crate and so cannot be a dependency of its tests).
#[path = "../../../tests/src/otlp.rs"]
mod otlp;

/// A temporary install prefix made by `install.sh`: `lib/libnccl.so.2` (a
/// copy of the build), `lib/libnccl.so -> libnccl.so.2`, `lib/libweft_nccl.so`
/// and `include/nccl.h`, as a package would install them.
/// It lives under the target dir (`<target>/capi-test/<pid>`); prefixes left
/// by earlier test processes that are gone are removed first.
fn install_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let base = built_library()
            .parent()
            .map(|d| {
                if d.ends_with("deps") {
                    d.parent().unwrap().to_path_buf()
                } else {
                    d.to_path_buf()
                }
            })
            .unwrap()
            .join("capi-test");
        if let Ok(entries) = std::fs::read_dir(&base) {
            for e in entries.flatten() {
                let alive = e
                    .file_name()
                    .to_str()
                    .and_then(|n| n.parse::<i32>().ok())
                    .is_some_and(|pid| unsafe { libc::kill(pid, 0) } == 0);
                if !alive {
                    let _ = std::fs::remove_dir_all(e.path());
                }
            }
        }
        let root = base.join(std::process::id().to_string());
        let _ = std::fs::remove_dir_all(&root);
        // The documented install script, as a user would run it.
        let mut cmd = Command::new("sh");
        cmd.arg(crate_dir().join("install.sh"))
            .arg(&root)
            .arg(built_library());
        let o = run_bounded(&mut cmd, Duration::from_secs(30));
        assert!(
            o.status.success(),
            "install.sh failed: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        std::fs::create_dir_all(root.join("bin")).unwrap();
        root
    })
}

/// Compiles `tests/c/<name>.c` against our header and the installed library.
/// `plain`: only `-lnccl` and a library path, as a program built for NVIDIA's
/// NCCL would be (no rpath; the loader finds it through LD_LIBRARY_PATH).
fn compile(name: &str, plain: bool) -> PathBuf {
    // Tests run in parallel threads: compile each program once.
    static BUILT: Mutex<Vec<(String, bool, PathBuf)>> = Mutex::new(Vec::new());
    let mut built = BUILT.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, _, p)) = built.iter().find(|(n, pl, _)| n == name && *pl == plain) {
        return p.clone();
    }
    let p = compile_now(name, plain);
    built.push((name.to_string(), plain, p.clone()));
    p
}

fn compile_now(name: &str, plain: bool) -> PathBuf {
    let dir = install_dir();
    let lib = dir.join("lib");
    let out = dir.join("bin").join(if plain {
        format!("{name}-plain")
    } else {
        name.to_string()
    });
    let src = crate_dir().join("tests/c").join(format!("{name}.c"));
    let mut cmd = Command::new("cc");
    cmd.arg("-std=gnu11")
        .args(["-Wall", "-Wextra", "-Werror", "-g"])
        .arg("-I")
        .arg(dir.join("include"))
        .arg("-I")
        .arg(crate_dir().join("tests/c"))
        .arg(&src)
        .arg("-o")
        .arg(&out)
        .arg(format!("-L{}", lib.display()))
        .arg("-lnccl");
    if !plain {
        cmd.arg(format!("-Wl,-rpath,{}", lib.display()))
            .args(["-lpthread", "-lm"]);
    }
    let o = run_bounded(&mut cmd, Duration::from_secs(120));
    assert!(
        o.status.success(),
        "compiling {name}.c failed:\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    out
}

/// Runs `prog` as `ranks` processes through the launcher; asserts every rank
/// exits 0 within `limit`. Returns each rank's stdout.
fn run_ranks(
    prog: &Path,
    ranks: usize,
    args: &[&str],
    env: &[(&str, &str)],
    limit: Duration,
) -> Vec<String> {
    run_ranks_full(prog, ranks, args, env, limit)
        .into_iter()
        .map(|(out, _)| out)
        .collect()
}

/// As [`run_ranks`]; returns each rank's (stdout, stderr).
fn run_ranks_full(
    prog: &Path,
    ranks: usize,
    args: &[&str],
    env: &[(&str, &str)],
    limit: Duration,
) -> Vec<(String, String)> {
    let mut spec = LaunchSpec::new(ranks, prog.as_os_str());
    spec.args = args.iter().map(Into::into).collect();
    spec.capture = true;
    spec.timeout = Some(limit);
    spec.grace = Duration::from_secs(2);
    spec.env_extra = env
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let o = launch(&spec).expect("launch");
    let outputs: Vec<String> = o
        .ranks
        .iter()
        .map(|r| {
            format!(
                "--- rank {} ({:?}) stdout:\n{}--- stderr:\n{}",
                r.rank,
                r.status,
                String::from_utf8_lossy(&r.output.stdout),
                String::from_utf8_lossy(&r.output.stderr)
            )
        })
        .collect();
    assert!(
        o.success(),
        "{} failed ({:?}, exit {}):\n{}",
        prog.display(),
        o.stop,
        o.exit_code(),
        outputs.join("\n")
    );
    o.ranks
        .iter()
        .map(|r| {
            (
                String::from_utf8_lossy(&r.output.stdout).into_owned(),
                String::from_utf8_lossy(&r.output.stderr).into_owned(),
            )
        })
        .collect()
}

#[test]
fn abi_matches_nccl_header() {
    let bin = compile("abi_check", false);
    let o = run_bounded(&mut Command::new(&bin), Duration::from_secs(30));
    assert!(
        o.status.success(),
        "abi_check failed:\n{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&o.stdout), "abi ok\n");
}

#[test]
fn header_compiles_as_cxx_and_after_cuda_style_typedef() {
    let dir = install_dir().join("cxx");
    std::fs::create_dir_all(&dir).unwrap();
    let src = dir.join("t.cc");
    // A CUDA runtime header included first declares cudaStream_t itself.
    std::fs::write(
        &src,
        "#define __CUDA_RUNTIME_H__\nstruct CUstream_st;\ntypedef struct CUstream_st* cudaStream_t;\n#include <nccl.h>\nstatic_assert(sizeof(ncclUniqueId) == 128, \"id\");\nint main() { ncclConfig_t c = NCCL_CONFIG_INITIALIZER; return c.magic == 0xcafebeef ? 0 : 1; }\n",
    )
    .unwrap();
    let mut cmd = Command::new("c++");
    cmd.args(["-std=c++17", "-Wall", "-Werror", "-fsyntax-only", "-I"])
        .arg(include_dir())
        .arg(&src);
    let o = run_bounded(&mut cmd, Duration::from_secs(60));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

#[test]
fn library_exports_every_function_and_its_p_twin_with_nccl_soname() {
    let lib = install_dir().join("lib/libnccl.so.2");
    let o = run_bounded(
        Command::new("nm").args(["-D", "--defined-only"]).arg(&lib),
        Duration::from_secs(30),
    );
    assert!(o.status.success(), "nm failed");
    let text = String::from_utf8_lossy(&o.stdout);
    let exported: std::collections::HashSet<&str> = text
        .lines()
        .filter_map(|l| {
            let mut it = l.split_whitespace();
            let (_, kind, name) = (it.next()?, it.next()?, it.next()?);
            (kind == "T").then_some(name)
        })
        .collect();
    let mut missing = Vec::new();
    for f in FUNCTIONS {
        for name in [f.to_string(), format!("p{f}")] {
            if !exported.contains(name.as_str()) {
                missing.push(name);
            }
        }
    }
    assert!(missing.is_empty(), "not exported: {missing:?}");
    let o = run_bounded(
        Command::new("readelf").arg("-d").arg(&lib),
        Duration::from_secs(30),
    );
    let dynamic = String::from_utf8_lossy(&o.stdout);
    assert!(
        dynamic.contains("Library soname: [libnccl.so.2]"),
        "SONAME is not libnccl.so.2:\n{dynamic}"
    );
}

#[test]
fn every_collective_with_result_checks_4_ranks() {
    let bin = compile("collectives", false);
    let out = run_ranks(&bin, 4, &[], &[], Duration::from_secs(120));
    for (r, o) in out.iter().enumerate() {
        assert!(o.contains(&format!("rank {r}: collectives ok")), "{o}");
    }
}

#[test]
fn every_collective_with_result_checks_3_ranks_tcp() {
    let bin = compile("collectives", false);
    run_ranks(
        &bin,
        3,
        &[],
        &[("WEFT_TRANSPORT", "tcp")],
        Duration::from_secs(120),
    );
}

#[test]
fn survivors_shrink_around_a_dead_rank_then_grow_back_and_revoke() {
    let bin = compile("shrink_grow", false);
    for outs in [
        run_ranks(&bin, 4, &[], &[], Duration::from_secs(60)),
        run_ranks(
            &bin,
            3,
            &[],
            &[("WEFT_TRANSPORT", "tcp")],
            Duration::from_secs(60),
        ),
    ] {
        let n = outs.len();
        for (r, out) in outs.iter().enumerate().take(n - 1) {
            assert!(out.contains(&format!("rank {r}: shrink_grow ok")), "{out}");
        }
    }
}

/// Shrink, grow and split after revoke inside groups, one thread holding
/// two ranks (blocking configurations: without the deferral to
/// ncclGroupEnd the first shrink would wait for its own thread's second
/// rank until the init timeout, bounded here to 20 s).
#[test]
fn one_thread_shrinks_grows_and_splits_several_ranks_in_groups() {
    let bin = compile("group_reconf", false);
    let shm = [("WEFT_INIT_TIMEOUT_MS", "20000")];
    let tcp = [("WEFT_INIT_TIMEOUT_MS", "20000"), ("WEFT_TRANSPORT", "tcp")];
    for (p, env) in [(2, &shm[..]), (1, &shm[..]), (2, &tcp[..])] {
        let out = run_ranks(&bin, p, &[], env, Duration::from_secs(90));
        for (r, o) in out.iter().enumerate() {
            assert!(o.contains(&format!("rank {r}: group_reconf ok")), "{o}");
        }
    }
}

#[test]
fn unsupported_functions_fail_cleanly_and_windows_come_back_null() {
    let bin = compile("unsupported", false);
    let o = run_bounded(&mut Command::new(&bin), Duration::from_secs(60));
    assert!(
        o.status.success(),
        "unsupported failed:\n{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&o.stdout), "unsupported ok\n");
}

#[test]
fn misuse_gets_exact_codes_and_informative_last_error() {
    let bin = compile("errors", false);
    let out = run_ranks_full(
        &bin,
        3,
        &[],
        &[("NCCL_DEBUG", "WARN")],
        Duration::from_secs(120),
    );
    for (r, (o, e)) in out.iter().enumerate() {
        assert!(o.contains(&format!("rank {r}: errors ok")), "{o}");
        // NCCL_DEBUG=WARN: each failure logged with host:pid:tid, rank and communicator.
        let line = e
            .lines()
            .find(|l| l.contains("weft WARN ncclCommDestroy: communicator"))
            .unwrap_or_else(|| panic!("no WARN line for the double destroy:\n{e}"));
        assert!(
            line.contains(&format!("rank {r} of 3")) && line.contains("second destroy"),
            "{line}"
        );
        assert!(
            line.split(' ').next().unwrap().split(':').count() == 3,
            "{line}"
        );
        assert!(
            !e.contains(" weft INFO "),
            "INFO lines with NCCL_DEBUG=WARN:\n{e}"
        );
    }
}

#[test]
fn nccl_debug_info_logs_lifecycle_with_rank_and_communicator() {
    let bin = compile("dropin", false);
    let out = run_ranks_full(
        &bin,
        2,
        &[],
        &[("NCCL_DEBUG", "INFO")],
        Duration::from_secs(60),
    );
    for (r, (_, e)) in out.iter().enumerate() {
        for what in ["created (blocking", "is ready", "destroyed"] {
            assert!(
                e.lines().any(|l| l.contains(" weft INFO communicator ")
                    && l.contains(&format!("rank {r} of 2"))
                    && l.contains(what)),
                "no INFO line '{what}' for rank {r}:\n{e}"
            );
        }
    }
}

#[test]
fn nonblocking_split_from_several_threads_config() {
    let bin = compile("split_threads", false);
    let out = run_ranks(&bin, 3, &["config"], &[], Duration::from_secs(120));
    for (r, o) in out.iter().enumerate() {
        assert!(o.contains(&format!("rank {r}: split_threads ok")), "{o}");
    }
}

#[test]
fn nonblocking_split_from_several_threads_env() {
    let bin = compile("split_threads", false);
    run_ranks(
        &bin,
        4,
        &["env"],
        &[("NCCL_COMM_BLOCKING", "0")],
        Duration::from_secs(120),
    );
}

#[test]
fn one_thread_drives_several_ranks_with_groups() {
    let bin = compile("groups", false);
    let out = run_ranks(&bin, 2, &[], &[], Duration::from_secs(120));
    for (r, o) in out.iter().enumerate() {
        assert!(o.contains(&format!("rank {r}: groups ok")), "{o}");
    }
    // One process holding every rank.
    run_ranks(&bin, 1, &[], &[], Duration::from_secs(60));
}

#[test]
fn drop_in_program_links_with_plain_lnccl() {
    let bin = compile("dropin", true);
    let lib = install_dir().join("lib");
    // The executable asks for NCCL's SONAME, like one built against NVIDIA's NCCL.
    let o = run_bounded(
        Command::new("readelf").arg("-d").arg(&bin),
        Duration::from_secs(30),
    );
    let dynamic = String::from_utf8_lossy(&o.stdout);
    assert!(
        dynamic.contains("Shared library: [libnccl.so.2]"),
        "the program does not need libnccl.so.2:\n{dynamic}"
    );
    assert!(!dynamic.contains("RPATH") && !dynamic.contains("RUNPATH"));
    // Found through LD_LIBRARY_PATH, as an installed libnccl.so.2 would be.
    let o = run_bounded(
        Command::new(&bin)
            .env("LD_LIBRARY_PATH", &lib)
            .env_remove("RANK")
            .env_remove("WORLD_SIZE"),
        Duration::from_secs(60),
    );
    assert!(
        o.status.success(),
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(String::from_utf8_lossy(&o.stdout).starts_with("dropin ok (NCCL version code 22803)"));
    // And as several processes under the launcher (NCCL_COMM_ID, RANK, WORLD_SIZE).
    let out = run_ranks(
        &bin,
        3,
        &[],
        &[("LD_LIBRARY_PATH", lib.to_str().unwrap())],
        Duration::from_secs(60),
    );
    assert!(out.iter().all(|o| o.starts_with("dropin ok")));
}

#[test]
fn nccl_comm_id_alone_is_honoured_without_the_launcher() {
    // As under a launcher that knows nothing of Weft (mpirun, torchrun):
    // only NCCL_COMM_ID, RANK and WORLD_SIZE; no WEFT_* variables, no secret.
    let bin = compile("dropin", false);
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let mut children: Vec<std::process::Child> = (0..2)
        .map(|r| {
            let mut cmd = Command::new(&bin);
            for (k, _) in std::env::vars() {
                if k.starts_with("WEFT_") || k.starts_with("NCCL_") {
                    cmd.env_remove(k);
                }
            }
            cmd.env("NCCL_COMM_ID", format!("127.0.0.1:{port}"))
                .env("RANK", r.to_string())
                .env("WORLD_SIZE", "2")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let start = Instant::now();
    while children.iter_mut().any(|c| c.try_wait().unwrap().is_none()) {
        if start.elapsed() > Duration::from_secs(60) {
            for c in &mut children {
                let _ = c.kill();
            }
            panic!("ranks did not finish within 60 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    for c in children {
        let o = c.wait_with_output().unwrap();
        assert!(
            o.status.success() && String::from_utf8_lossy(&o.stdout).starts_with("dropin ok"),
            "{}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
    }
}

/// The communicator a rank's `NCCL_DEBUG=INFO` log says is ready: its pid
/// and communicator id (`HOST:PID:TID weft INFO communicator N (id ID, rank
/// R of N, job J) is ready ...`).
fn ready_communicator(stderr: &str) -> (String, String) {
    let line = stderr
        .lines()
        .find(|l| l.contains(" weft INFO communicator ") && l.contains(") is ready"))
        .unwrap_or_else(|| panic!("no 'is ready' line:\n{stderr}"));
    let pid = line.split(':').nth(1).unwrap_or_default().to_string();
    let id = line
        .split_once("(id ")
        .and_then(|(_, rest)| rest.split_once(','))
        .map(|(id, _)| id.to_string())
        .unwrap_or_else(|| panic!("no id in {line}"));
    (pid, id)
}

/// An unmodified NCCL program (plain `-lnccl`, found through
/// LD_LIBRARY_PATH), no sidecar, `OTEL_EXPORTER_OTLP_ENDPOINT` set: the
/// library exports each rank's spans itself (the agent's exporter, not the
/// sidecar's crate), flushed at the normal exit, to a real OTLP receiver;
/// each rank's all-reduce carries that rank, its communicator, the size,
/// type, bytes, algorithm and its duration, in the job's one trace.
#[test]
fn without_a_sidecar_the_library_exports_every_ranks_spans() {
    const RANKS: usize = 3;
    let recv = otlp::Receiver::default();
    let (port, _srv) = otlp::start(recv.clone());
    let endpoint = format!("http://127.0.0.1:{port}");
    let bin = compile("dropin", true);
    let lib = install_dir().join("lib");
    let out = run_ranks_full(
        &bin,
        RANKS,
        &[],
        &[
            ("LD_LIBRARY_PATH", lib.to_str().unwrap()),
            ("WEFT_SIDECAR_SOCKET", ""),
            ("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint),
            ("NCCL_DEBUG", "INFO"),
        ],
        Duration::from_secs(60),
    );
    // The program's all-reduce: 256 floats (the init barrier's is 1 byte).
    let is_programs =
        |g: &otlp::Got| g.name == "weft.all_reduce" && g.attrs["weft.bytes"] == "1024";
    let spans = recv.spans_when(
        |s| s.iter().filter(|g| is_programs(g)).count() >= RANKS,
        Duration::from_secs(10),
    );
    let trace = spans
        .first()
        .map(|g| g.trace_id.clone())
        .unwrap_or_default();
    for (rank, (_, stderr)) in out.iter().enumerate() {
        let (pid, comm) = ready_communicator(stderr);
        let mine: Vec<&otlp::Got> = spans
            .iter()
            .filter(|g| is_programs(g) && g.attrs["weft.rank"] == rank.to_string())
            .collect();
        assert_eq!(mine.len(), 1, "rank {rank}: {spans:#?}\n{stderr}");
        let (g, a) = (mine[0], &mine[0].attrs);
        assert_eq!(a["weft.comm_id"], comm, "{g:?}");
        assert_eq!(a["process.pid"], pid, "{g:?}");
        assert_eq!(a["weft.world_size"], RANKS.to_string(), "{g:?}");
        assert_eq!(a["weft.op"], "all_reduce", "{g:?}");
        assert_eq!(a["weft.dtype"], "float", "{g:?}");
        assert_eq!(a["weft.outcome"], "ok", "{g:?}");
        assert!(!a["weft.algorithm"].is_empty(), "{g:?}");
        assert!(
            g.start_ns > 0 && g.end_ns >= g.start_ns,
            "a span with its duration: {g:?}"
        );
        assert_eq!(g.trace_id, trace, "one trace for the job");
        assert!(!g.parent.is_empty(), "parented under the job span");
    }
}
