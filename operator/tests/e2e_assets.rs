//! What `e2e/run.sh` relies on, checked without docker or a cluster:
//! the image build (docker/Dockerfile names packages of this workspace and
//! copies artifacts that cargo produces), the chart values it sets, the
//! manifests it applies, the short name and status fields its kubectl
//! commands use, and the rollout settings it exercises.

use std::path::PathBuf;
use std::process::Command;

use kube::CustomResourceExt;
use serde::Deserialize;
use weft_operator::crd::CollectiveJob;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(root().join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

/// (package name, artifacts of a release build) of a workspace member.
fn artifacts(member: &str) -> (String, Vec<String>) {
    let text = read(&format!("{member}/Cargo.toml"));
    let mut section = String::new();
    let mut package = None;
    let mut lib_name = None;
    let mut cdylib = false;
    let mut bins = vec![];
    for line in text.lines().map(str::trim) {
        if line.starts_with('[') {
            section = line.to_string();
            continue;
        }
        let value = |l: &str| l.split('"').nth(1).map(str::to_string);
        if line.starts_with("name =") || line.starts_with("name=") {
            match section.as_str() {
                "[package]" => package = value(line),
                "[lib]" => lib_name = value(line),
                "[[bin]]" => bins.extend(value(line)),
                _ => {}
            }
        }
        if section == "[lib]" && line.starts_with("crate-type") && line.contains("cdylib") {
            cdylib = true;
        }
    }
    let package = package.expect("package name");
    if bins.is_empty() && root().join(member).join("src/main.rs").exists() {
        bins.push(package.clone());
    }
    if cdylib {
        let lib = lib_name.unwrap_or_else(|| package.replace('-', "_"));
        bins.push(format!("lib{lib}.so"));
    }
    (package, bins)
}

fn workspace() -> Vec<(String, Vec<String>)> {
    let text = read("Cargo.toml");
    let members = text
        .lines()
        .find(|l| l.trim_start().starts_with("members"))
        .expect("workspace members");
    members
        .split('"')
        .skip(1)
        .step_by(2)
        .map(artifacts)
        .collect()
}

#[test]
fn dockerfile_builds_what_the_workspace_produces() {
    let docker = read("docker/Dockerfile");
    let ws = workspace();
    let packages: Vec<&str> = ws.iter().map(|(p, _)| p.as_str()).collect();
    let produced: Vec<&str> = ws
        .iter()
        .flat_map(|(_, a)| a.iter().map(String::as_str))
        .collect();
    let words: Vec<&str> = docker.split_whitespace().collect();
    let mut built = 0;
    // `-p PACKAGE` of the cargo commands (not `mkdir -p`).
    let joined = docker.replace("\\\n", " ");
    let cargo_words: Vec<&str> = joined
        .lines()
        .flat_map(|l| l.split("&&"))
        .filter(|seg| seg.contains("cargo build"))
        .flat_map(str::split_whitespace)
        .collect();
    for w in cargo_words.windows(2) {
        if w[0] == "-p" {
            assert!(
                packages.contains(&w[1]),
                "Dockerfile builds -p {} which is not a workspace package ({packages:?})",
                w[1]
            );
            built += 1;
        }
    }
    assert!(built >= 3, "operator, weft and the NCCL library are built");
    let mut copied = vec![];
    for w in &words {
        if let Some(artifact) = w.strip_prefix("target/release/") {
            assert!(
                produced.contains(&artifact),
                "Dockerfile copies target/release/{artifact}, which the build does not produce \
                 (it produces {produced:?})"
            );
            copied.push(artifact);
        }
    }
    for want in ["weft-operator", "weft", "libnccl.so"] {
        assert!(copied.contains(&want), "Dockerfile does not copy {want}");
    }
    // Files the final stages take from the builder were put in /out by a cp.
    let mut outputs: Vec<String> = vec![];
    for seg in joined.lines().flat_map(|l| l.split("&&")) {
        let args: Vec<&str> = seg.split_whitespace().collect();
        if args.first() != Some(&"cp") || args.len() < 3 {
            continue;
        }
        let dest = args[args.len() - 1];
        let base = |p: &str| p.rsplit('/').next().unwrap().to_string();
        if dest.ends_with('/') {
            outputs.extend(args[1..args.len() - 1].iter().map(|a| base(a)));
        } else {
            outputs.push(base(dest));
        }
    }
    let mut taken = 0;
    for line in docker
        .lines()
        .filter(|l| l.starts_with("COPY --from=builder"))
    {
        let src = line.split_whitespace().nth(2).unwrap();
        let name = src.strip_prefix("/out/").expect("copies from /out");
        assert!(
            outputs.iter().any(|o| o == name),
            "{name} not put in /out ({outputs:?})"
        );
        taken += 1;
    }
    assert_eq!(taken, 3, "operator, weft, libnccl.so.2");
    for stage in ["AS weft-operator", "AS weft"] {
        assert!(docker.contains(stage), "Dockerfile has no stage {stage}");
    }
    // The build context is the repository root; these must exist in it.
    for line in docker
        .lines()
        .filter(|l| l.starts_with("COPY ") && !l.contains("--from"))
    {
        let src = line.split_whitespace().nth(1).unwrap();
        assert!(root().join(src).exists(), "COPY source {src} missing");
    }
}

fn bash_n(rel: &str) {
    let ok = Command::new("bash")
        .arg("-n")
        .arg(root().join(rel))
        .status()
        .expect("bash")
        .success();
    assert!(ok, "bash -n {rel}");
}

#[test]
fn run_sh_uses_what_exists() {
    bash_n("e2e/run.sh");
    let run = read("e2e/run.sh");
    let values: serde_yaml::Value = serde_yaml::from_str(&read("charts/weft/values.yaml")).unwrap();
    // every --set KEY=... names a chart value
    let words: Vec<&str> = run.split_whitespace().collect();
    let mut sets = 0;
    for w in words.windows(2) {
        if w[0] == "--set" {
            let key = w[1].split('=').next().unwrap();
            let mut v = &values;
            for part in key.split('.') {
                v = v
                    .get(part)
                    .unwrap_or_else(|| panic!("run.sh sets {key}, not in values.yaml"));
            }
            sets += 1;
        }
    }
    assert!(sets >= 5);
    // files it applies
    for w in &words {
        let w = w.trim_matches('"');
        if let Some(rel) = w.strip_prefix("$ROOT/") {
            assert!(
                root().join(rel).exists(),
                "run.sh uses {rel}, which is missing"
            );
        }
    }
    // the short name it uses is the CRD's (cj is CronJob's)
    let crd = CollectiveJob::crd();
    let short = crd.spec.names.short_names.clone().unwrap();
    assert_eq!(short, ["cjob"]);
    for bad in [" cj ", " cj/", "cj/", "get cj "] {
        assert!(
            !run.contains(bad),
            "run.sh uses the short name cj ({bad:?})"
        );
    }
    assert!(run.contains("cjob/"));
    // every .status.FIELD it reads is a status field of the CRD
    let schema = serde_json::to_value(&crd.spec.versions[0].schema).unwrap();
    let status = &schema["openAPIV3Schema"]["properties"]["status"]["properties"];
    let mut fields = 0;
    for (i, _) in run.match_indices(".status.") {
        let field: String = run[i + 8..]
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric())
            .collect();
        assert!(
            status.get(&field).is_some(),
            "run.sh reads .status.{field}, not a CollectiveJob status field"
        );
        fields += 1;
    }
    assert!(fields >= 10);
    // labels it selects pods by
    assert!(run.contains(weft_operator::resources::LABEL_JOB));
    assert!(run.contains(&weft_operator::resources::LABEL_EPOCH.replace('.', "\\.")));
}

#[test]
fn manifests_applied_by_e2e_decode_and_validate() {
    let mut jobs = 0;
    for rel in [
        "e2e/restart-job.yaml",
        "examples/bench-allreduce.yaml",
        "examples/pytorch-ddp.yaml",
    ] {
        for doc in serde_yaml::Deserializer::from_str(&read(rel)) {
            let v = serde_yaml::Value::deserialize(doc).unwrap();
            if v.get("kind").and_then(|k| k.as_str()) != Some("CollectiveJob") {
                continue;
            }
            let mut job: CollectiveJob =
                serde_yaml::from_value(v).unwrap_or_else(|e| panic!("{rel}: {e}"));
            job.metadata.uid = Some("uid".into());
            weft_operator::resources::validate(&job).unwrap_or_else(|e| panic!("{rel}: {e}"));
            jobs += 1;
        }
    }
    assert_eq!(jobs, 3);
    // run.sh swaps this image for the locally built one
    assert!(read("e2e/restart-job.yaml").contains("ghcr.io/weft-dev/weft:0.1.0"));
    assert!(read("examples/bench-allreduce.yaml").contains("ghcr.io/weft-dev/weft:0.1.0"));
    assert!(read("e2e/run.sh").contains("s#ghcr.io/weft-dev/weft:0.1.0#weft:$TAG#"));
}

/// Issue 19 (3): rollouts finish with 1 and 2 replicas, and the kubelet's
/// grace period covers the operator's own shutdown timeout.
#[test]
fn chart_rolls_out_and_shuts_down_in_time() {
    let dep = read("charts/weft/templates/deployment.yaml");
    assert!(dep.contains("maxUnavailable: 0"), "{dep}");
    assert!(dep.contains("maxSurge: 1"), "{dep}");
    assert!(dep.contains("path: /readyz"));
    let grace: u64 = dep
        .lines()
        .find_map(|l| l.trim().strip_prefix("terminationGracePeriodSeconds:"))
        .expect("terminationGracePeriodSeconds")
        .trim()
        .parse()
        .unwrap();
    let main = read("operator/src/main.rs");
    let i = main
        .find("shutdown_timeout_secs")
        .expect("shutdown timeout flag");
    let before = &main[..i];
    let default: u64 = before
        .rsplit("default_value_t = ")
        .next()
        .unwrap()
        .split(')')
        .next()
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert!(
        default + 5 <= grace,
        "operator shutdown timeout {default}s vs grace period {grace}s"
    );
}

/// Issue 19 (7): `cj` is CronJob's short name (`kubectl get cj` lists
/// CronJobs), so no doc, example, chart note or script may tell users to
/// use it for CollectiveJobs.
#[test]
fn docs_and_examples_use_the_cjob_short_name() {
    let mut files = vec![
        "README.md".to_string(),
        "charts/weft/templates/NOTES.txt".to_string(),
        "charts/weft/README.md".to_string(),
        "e2e/run.sh".to_string(),
        "e2e/README.md".to_string(),
    ];
    for dir in ["docs", "examples", "e2e"] {
        for e in std::fs::read_dir(root().join(dir)).unwrap().flatten() {
            let p = e.path();
            if p.is_file() {
                files.push(format!(
                    "{dir}/{}",
                    p.file_name().unwrap().to_string_lossy()
                ));
            }
        }
    }
    let mut checked = 0;
    for rel in files {
        let Ok(text) = std::fs::read_to_string(root().join(&rel)) else {
            continue;
        };
        checked += 1;
        for (n, line) in text.lines().enumerate() {
            let words: Vec<&str> = line
                .split(|c: char| !(c.is_ascii_alphanumeric() || c == '-' || c == '/'))
                .collect();
            for w in words.windows(2) {
                let verb = ["get", "describe", "wait", "delete", "edit", "patch", "logs"];
                let bad = (verb.contains(&w[0]) && w[1] == "cj") || w[1].starts_with("cj/");
                assert!(
                    !bad,
                    "{rel}:{}: uses the short name cj (CronJob's); use cjob: {line}",
                    n + 1
                );
            }
        }
    }
    assert!(checked >= 8, "only {checked} files checked");
    let crd = read("crds/collectivejob.yaml");
    assert!(crd.contains("shortNames:\n    - cjob\n"), "committed CRD");
}
