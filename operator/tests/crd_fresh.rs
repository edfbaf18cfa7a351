//! The committed CRD files must be exactly what the Rust types generate.

use std::path::PathBuf;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

#[test]
fn committed_crds_are_fresh() {
    let fresh = weft_operator::crd::crd_yaml();
    for rel in [
        "crds/collectivejob.yaml",
        "charts/weft/crds/collectivejob.yaml",
    ] {
        let path = root().join(rel);
        let committed = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(
            committed == fresh,
            "{rel} is stale or missing. Regenerate both copies with:\n  \
             cargo run -p weft-operator -- crd > crds/collectivejob.yaml && \
             cp crds/collectivejob.yaml charts/weft/crds/collectivejob.yaml"
        );
    }
}

#[test]
fn crd_subcommand_prints_the_crd() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_weft-operator"))
        .arg("crd")
        .output()
        .expect("run weft-operator crd");
    assert!(out.status.success());
    assert_eq!(
        String::from_utf8(out.stdout).unwrap(),
        weft_operator::crd::crd_yaml()
    );
}

#[test]
fn run_flags_parse_with_and_without_the_subcommand() {
    for args in [
        &["run", "--leader-elect", "false", "--help"][..],
        &["--watch-secrets", "false", "--help"][..],
    ] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_weft-operator"))
            .args(args)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(text.contains("--sidecar-image"), "{args:?}: {text}");
    }
}

#[test]
fn render_subcommand_prints_what_the_operator_creates() {
    let example = root().join("examples/bench-allreduce.yaml");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_weft-operator"))
        .args(["render", "--namespace", "team-a"])
        .arg(&example)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    let kinds: Vec<String> = text
        .lines()
        .filter_map(|l| l.strip_prefix("kind: "))
        .map(String::from)
        .collect();
    assert_eq!(kinds, ["Service", "Secret", "Pod", "Pod"]);
    assert!(text.contains("value: bench-allreduce-0.bench-allreduce.team-a.svc:29400"));
    assert!(text.contains("name: bench-allreduce-1"));
}

/// The chart's uninstall hook calls `weft-operator uninstall` with flags the
/// binary has, and its Role names the Lease the operator elects on.
#[test]
fn uninstall_hook_matches_the_subcommand_and_the_lease() {
    let hook =
        std::fs::read_to_string(root().join("charts/weft/templates/uninstall-hook.yaml")).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_weft-operator"))
        .args(["uninstall", "--help"])
        .output()
        .unwrap();
    assert!(out.status.success());
    let help = String::from_utf8(out.stdout).unwrap();
    for flag in ["--deployment", "--stop-timeout-secs", "--namespace"] {
        assert!(help.contains(flag), "{help}");
    }
    for arg in ["- uninstall", "- --deployment=", "- --stop-timeout-secs="] {
        assert!(hook.contains(arg), "{arg} not in the hook");
    }
    assert!(
        hook.contains(&format!(
            "resourceNames: [\"{}\"]",
            weft_operator::leader::LEASE_NAME
        )),
        "{hook}"
    );
}
