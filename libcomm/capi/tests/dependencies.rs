//! What `libnccl.so.2` links: every program that loads NCCL loads it, so it
//! holds the agent's client and span exporter and none of the sidecar's
//! server stack (crate `weft`: its HTTP and gRPC servers, Prometheus, the
//! command line). Read from cargo's own resolution (`cargo tree`) of the
//! library's normal dependencies in its default build, offline and against
//! the committed lock file, so a clean clone that has built its tests
//! answers it without the network.

use std::process::Command;

/// Crates that belong to the sidecar, never to the library.
const SIDECAR_ONLY: &[&str] = &["weft", "axum", "clap", "prometheus-client"];

/// The distinct crate names of `cargo tree` for this crate, normal
/// dependencies only, with `args` added.
fn linked_crates(args: &[&str]) -> Vec<String> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let manifest = concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml");
    let out = Command::new(&cargo)
        .args(["tree", "--offline", "--locked", "--manifest-path", manifest])
        .args([
            "-p",
            env!("CARGO_PKG_NAME"),
            "-e",
            "normal",
            "--prefix",
            "none",
        ])
        .args(["--format", "{p}"])
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cargo} tree: {e}"));
    assert!(
        out.status.success(),
        "cargo tree failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut names: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_string)
        .collect();
    names.sort();
    names.dedup();
    names
}

#[test]
fn the_library_links_the_agent_and_nothing_of_the_sidecar() {
    for (build, args) in [
        ("default", &[][..]),
        ("--no-default-features", &["--no-default-features"][..]),
    ] {
        let crates = linked_crates(args);
        for must in ["weft-agent", "weft-libcomm", "weft-contract"] {
            assert!(
                crates.iter().any(|c| c == must),
                "{build} build: {must} missing from {crates:?}"
            );
        }
        let stray: Vec<&String> = crates
            .iter()
            .filter(|c| SIDECAR_ONLY.contains(&c.as_str()))
            .collect();
        assert!(
            stray.is_empty(),
            "{build} build links the sidecar's {stray:?}: {crates:?}"
        );
    }
    // The default build exports spans without a sidecar: the OTLP client is in.
    assert!(linked_crates(&[]).iter().any(|c| c == "opentelemetry-otlp"));
}
