//! Chart, CRD and example checks (charts/check.py) as a cargo test, so that
//! `cargo test` / `cargo nextest run --workspace` runs them in CI.
//!
//! Python packages (helm-python-sdk: Helm v4 as a library, kubernetes-validate,
//! jsonschema, PyYAML) go into a venv under target/ that is reused between
//! runs. The test is skipped, loudly, only when pip cannot reach the package
//! index; any other problem fails it.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use kube::ResourceExt;
use weft_operator::crd::CollectiveJob;
use weft_operator::resources::{OperatorConfig, desired_pod, desired_secret, desired_service};
use weft_testkit::run_bounded;

const REQUIREMENTS: &[&str] = &[
    "helm-python-sdk==0.2.2",
    "kubernetes-validate==1.37.0",
    "jsonschema==4.26.0",
    "PyYAML==6.0.3",
];

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Runs a command with a deadline, returning (success, stdout+stderr).
fn run(cmd: &mut Command, limit: Duration) -> (bool, String) {
    let out = run_bounded(cmd, limit);
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

fn network_failure(pip_output: &str) -> bool {
    [
        "Failed to establish a new connection",
        "Temporary failure in name resolution",
        "Network is unreachable",
        "Connection refused",
        "ConnectTimeoutError",
        "ReadTimeoutError",
        "ProxyError",
        "Could not fetch URL",
        "No matching distribution found",
    ]
    .iter()
    .any(|s| pip_output.contains(s))
}

/// The venv's python, installing the packages when the cache is missing or stale.
fn venv() -> Option<PathBuf> {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("chart-venv");
    let python = dir.join("bin/python");
    let stamp = dir.join("weft-requirements.txt");
    let want = REQUIREMENTS.join("\n");
    if python.exists() && std::fs::read_to_string(&stamp).ok().as_deref() == Some(&want) {
        return Some(python);
    }
    let _ = std::fs::remove_dir_all(&dir);
    let (ok, out) = run(
        Command::new("python3").args(["-m", "venv"]).arg(&dir),
        Duration::from_secs(120),
    );
    assert!(ok, "python3 -m venv failed:\n{out}");
    let (ok, out) = run(
        Command::new(&python)
            .args([
                "-m",
                "pip",
                "install",
                "--disable-pip-version-check",
                "--timeout",
                "30",
                "-q",
            ])
            .args(REQUIREMENTS),
        Duration::from_secs(600),
    );
    if !ok {
        if network_failure(&out) {
            weft_testkit::skip_outside_ci(
                false,
                &format!("chart checks: pip cannot reach the package index:\n{out}"),
            );
            return None;
        }
        panic!("pip install failed (not a network problem):\n{out}");
    }
    std::fs::write(&stamp, want).unwrap();
    Some(python)
}

/// What the operator would create for every example job, for schema validation.
fn render_operator_objects(out: &Path) {
    let _ = std::fs::remove_dir_all(out);
    std::fs::create_dir_all(out).unwrap();
    let mut n = 0;
    for entry in std::fs::read_dir(root().join("examples")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().and_then(|e| e.to_str()) != Some("yaml") {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap();
        for doc in serde_yaml::Deserializer::from_str(&text) {
            let value = serde_yaml::Value::deserialize(doc).unwrap();
            if value.get("kind").and_then(|k| k.as_str()) != Some("CollectiveJob") {
                continue;
            }
            let mut job: CollectiveJob = serde_yaml::from_value(value)
                .unwrap_or_else(|e| panic!("{}: not a CollectiveJob: {e}", path.display()));
            job.metadata.namespace = Some("default".into());
            job.metadata.uid = Some("00000000-0000-0000-0000-000000000001".into());
            weft_operator::resources::validate(&job).unwrap();
            let mut docs = vec![
                serde_yaml::to_string(&desired_service(&job)).unwrap(),
                serde_yaml::to_string(&desired_secret(&job, "0123abcd")).unwrap(),
            ];
            for i in 0..job.spec.replicas {
                docs.push(
                    serde_yaml::to_string(&desired_pod(&job, i, 0, &OperatorConfig::default()))
                        .unwrap(),
                );
            }
            std::fs::write(
                out.join(format!("{}.yaml", job.name_any())),
                docs.join("---\n"),
            )
            .unwrap();
            n += 1;
        }
    }
    assert!(n >= 2, "expected at least two example CollectiveJobs");
}

use serde::Deserialize;

#[test]
fn chart_crd_and_examples_validate_offline() {
    let Some(python) = venv() else { return };
    let rendered = Path::new(env!("CARGO_TARGET_TMPDIR")).join("operator-rendered");
    render_operator_objects(&rendered);
    let (ok, out) = run(
        Command::new(python)
            .arg(root().join("charts/check.py"))
            .arg("--rendered")
            .arg(&rendered)
            .current_dir(root()),
        Duration::from_secs(300),
    );
    println!("{out}");
    assert!(ok, "charts/check.py failed:\n{out}");
}
