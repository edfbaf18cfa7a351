//! What `e2e/run.sh` relies on, checked without docker or a cluster: the
//! image build (docker/build-release.sh builds packages of this workspace
//! and copies artifacts that cargo produces; the Dockerfile and
//! docker/rootfs-images.sh put the same files at the same paths), the chart
//! values it sets, the manifests it applies and the edits it makes to them,
//! the programs those manifests run being in their images, the short name
//! and status fields its kubectl commands use, and the rollout settings.

use std::collections::BTreeSet;
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

/// Shell text with `\`-continued lines joined.
fn joined(text: &str) -> String {
    text.replace("\\\n", " ")
}

fn unquote(w: &str) -> &str {
    w.trim_matches(|c| c == '"' || c == '\'')
}

/// The files docker/build-release.sh leaves in its output directory.
fn release_outputs() -> BTreeSet<String> {
    let script = joined(&read("docker/build-release.sh"));
    let mut out = BTreeSet::new();
    for line in script.lines() {
        let words: Vec<&str> = line.split_whitespace().map(unquote).collect();
        let base = |p: &str| p.rsplit('/').next().unwrap().to_string();
        match words.first() {
            Some(&"cp") if words.len() >= 3 => {
                let dest = words[words.len() - 1];
                if dest == "$out/" {
                    out.extend(words[1..words.len() - 1].iter().map(|a| base(a)));
                } else if let Some(name) = dest.strip_prefix("$out/") {
                    out.insert(name.to_string());
                }
            }
            Some(&"cc") => {
                let o = words.iter().position(|w| *w == "-o").expect("cc -o");
                let name = words[o + 1].strip_prefix("$out/").expect("cc -o $out/...");
                out.insert(name.to_string());
            }
            _ => {}
        }
    }
    out
}

#[test]
fn release_build_builds_what_the_workspace_produces() {
    let script = joined(&read("docker/build-release.sh"));
    let ws = workspace();
    let mut built = 0;
    for line in script.lines().filter(|l| l.contains("cargo build")) {
        let words: Vec<&str> = line.split_whitespace().collect();
        let mut packages = vec![];
        for w in words.windows(2) {
            if w[0] == "-p" {
                let p = ws
                    .iter()
                    .find(|(name, _)| name == w[1])
                    .unwrap_or_else(|| panic!("-p {} is not a workspace package", w[1]));
                packages.push(p);
                built += 1;
            }
        }
        for w in words.windows(2).filter(|w| w[0] == "--bin") {
            assert!(
                packages.iter().any(|(_, a)| a.iter().any(|b| b == w[1])),
                "--bin {} is not a binary of {packages:?}",
                w[1]
            );
        }
    }
    assert!(
        built >= 4,
        "operator, weft, the NCCL library and the examples are built"
    );
    let produced: Vec<&str> = ws
        .iter()
        .flat_map(|(_, a)| a.iter().map(String::as_str))
        .collect();
    let mut copied = vec![];
    for w in script.split_whitespace().map(unquote) {
        if let Some(artifact) = w.strip_prefix("$target/release/") {
            if w.ends_with("release/") {
                continue; // -L "$target/release"
            }
            assert!(
                produced.contains(&artifact),
                "copies target/release/{artifact}, which no build produces ({produced:?})"
            );
            copied.push(artifact);
        }
    }
    for want in [
        "weft-operator",
        "weft",
        "libnccl.so",
        "resilient-train",
        "otlp-sink",
    ] {
        assert!(
            copied.contains(&want),
            "build-release.sh does not copy {want}"
        );
    }
    let outputs = release_outputs();
    for want in [
        "weft-operator",
        "weft",
        "libnccl.so.2",
        "resilient-train",
        "otlp-sink",
        "nccl-dropin",
    ] {
        assert!(
            outputs.contains(want),
            "{want} not in the output ({outputs:?})"
        );
    }
    // The NCCL program is the unmodified test source, built on our header.
    assert!(script.contains("libcomm/capi/tests/c/dropin.c"));
    assert!(root().join("libcomm/capi/tests/c/dropin.c").exists());
    assert!(script.contains("-I libcomm/include"));
    assert!(root().join("libcomm/include/nccl.h").exists());
}

/// `COPY --from=builder /out/NAME DEST` of the Dockerfile, as (NAME, DEST).
fn dockerfile_files() -> BTreeSet<(String, String)> {
    read("docker/Dockerfile")
        .lines()
        .filter(|l| l.starts_with("COPY --from=builder"))
        .map(|l| {
            let w: Vec<&str> = l.split_whitespace().collect();
            let name = w[2].strip_prefix("/out/").expect("copies from /out");
            (name.to_string(), w[3].to_string())
        })
        .collect()
}

/// `put "$dir" "$bin/NAME" DEST MODE` of docker/rootfs-images.sh.
fn rootfs_files() -> BTreeSet<(String, String)> {
    read("docker/rootfs-images.sh")
        .lines()
        .map(str::trim)
        .filter(|l| l.starts_with("put "))
        .map(|l| {
            let w: Vec<&str> = l.split_whitespace().map(unquote).collect();
            let name = w[2].strip_prefix("$bin/").expect("puts a built file");
            (name.to_string(), w[3].to_string())
        })
        .collect()
}

#[test]
fn dockerfile_and_rootfs_images_hold_the_same_files() {
    let docker = read("docker/Dockerfile");
    assert!(
        docker.contains("docker/build-release.sh /out"),
        "the builder runs build-release.sh"
    );
    for stage in [
        "AS weft-operator",
        "AS weft\n",
        "FROM weft AS weft-examples",
    ] {
        assert!(docker.contains(stage), "Dockerfile has no stage {stage:?}");
    }
    let outputs = release_outputs();
    let from_docker = dockerfile_files();
    for (name, _) in &from_docker {
        assert!(outputs.contains(name), "{name} is not built ({outputs:?})");
    }
    assert_eq!(from_docker.len(), 6, "{from_docker:?}");
    assert_eq!(
        rootfs_files(),
        from_docker,
        "docker/rootfs-images.sh and docker/Dockerfile put different files in the images"
    );
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

/// Every shell file of e2e/ and docker/, relative to the root.
fn scripts() -> Vec<String> {
    let mut v = vec![];
    for dir in ["e2e", "e2e/scenarios", "docker"] {
        let mut files: Vec<String> = std::fs::read_dir(root().join(dir))
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".sh"))
            .map(|n| format!("{dir}/{n}"))
            .collect();
        files.sort();
        v.extend(files);
    }
    v
}

/// The e2e scripts' text, continuation lines joined.
fn e2e_text() -> String {
    scripts()
        .iter()
        .filter(|s| s.starts_with("e2e/"))
        .map(|s| joined(&read(s)))
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn e2e_scripts_use_what_exists() {
    let scripts = scripts();
    assert!(scripts.len() >= 8, "{scripts:?}");
    for s in &scripts {
        bash_n(s);
    }
    let run = e2e_text();
    let values: serde_yaml::Value = serde_yaml::from_str(&read("charts/weft/values.yaml")).unwrap();
    // every --set KEY=... names a chart value
    let words: Vec<&str> = run.split_whitespace().map(unquote).collect();
    let mut sets = 0;
    for w in words.windows(2) {
        if w[0] == "--set" || w[0] == "(--set" {
            let key = w[1].split('=').next().unwrap();
            let mut v = &values;
            for part in key.split('.') {
                v = v
                    .get(part)
                    .unwrap_or_else(|| panic!("e2e sets {key}, not in values.yaml"));
            }
            sets += 1;
        }
    }
    assert!(sets >= 6, "{sets} --set");
    // files it uses
    for w in &words {
        if let Some(rel) = w.strip_prefix("$ROOT/") {
            let rel = rel.trim_end_matches(['"', ')', ';']);
            if rel.contains('*') {
                continue;
            }
            assert!(
                root().join(rel).exists(),
                "e2e uses {rel}, which is missing"
            );
        }
    }
    // every scenario run.sh lists is defined, and every defined one listed
    let all = run
        .lines()
        .find_map(|l| l.trim().strip_prefix("ALL=("))
        .expect("ALL=(...) in run.sh")
        .trim_end_matches(')');
    let listed: BTreeSet<String> = all
        .split_whitespace()
        .map(|s| s.replace('-', "_"))
        .collect();
    let defined: BTreeSet<String> = run
        .lines()
        .filter_map(|l| l.strip_prefix("scenario_"))
        .filter_map(|l| l.split("()").next())
        .map(str::to_string)
        .collect();
    assert_eq!(listed, defined, "scenarios listed in ALL vs defined");
    // the short name it uses is the CRD's (cj is CronJob's)
    let crd = CollectiveJob::crd();
    let short = crd.spec.names.short_names.clone().unwrap();
    assert_eq!(short, ["cjob"]);
    for bad in [" cj ", " cj/", "get cj "] {
        assert!(!run.contains(bad), "e2e uses the short name cj ({bad:?})");
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
        if field.is_empty() || field == "containerStatuses" {
            continue; // a pod's status, not the job's
        }
        assert!(
            status.get(&field).is_some(),
            "e2e reads .status.{field}, not a CollectiveJob status field"
        );
        fields += 1;
    }
    assert!(fields >= 15, "{fields} status reads");
    // labels it selects pods by
    assert!(run.contains(weft_operator::resources::LABEL_JOB));
    assert!(run.contains(&weft_operator::resources::LABEL_EPOCH.replace('.', "\\.")));
    assert!(run.contains(&weft_operator::resources::LABEL_INCARNATION.replace('.', "\\.")));
}

/// The manifests e2e applies: every CollectiveJob in them.
const MANIFESTS: &[&str] = &[
    "e2e/restart-job.yaml",
    "e2e/nccl-dropin.yaml",
    "e2e/telemetry-job.yaml",
    "examples/bench-allreduce.yaml",
    "examples/replace-rank.yaml",
    "examples/pytorch-ddp.yaml",
];

/// (image stage, files it holds under /usr/local/bin) from the Dockerfile.
fn programs_of(stage: &str) -> Vec<String> {
    let files = dockerfile_files();
    let own = |wanted: &[&str]| -> Vec<String> {
        files
            .iter()
            .filter(|(n, _)| wanted.contains(&n.as_str()))
            .filter_map(|(_, dest)| dest.strip_prefix("/usr/local/bin/").map(str::to_string))
            .collect()
    };
    match stage {
        "weft" => own(&["weft"]),
        // FROM weft
        "weft-examples" => own(&["weft", "resilient-train", "nccl-dropin", "otlp-sink"]),
        "weft-operator" => own(&["weft-operator"]),
        other => panic!("no stage {other}"),
    }
}

#[test]
fn manifests_applied_by_e2e_decode_validate_and_run_what_their_image_holds() {
    let mut jobs = 0;
    for rel in MANIFESTS {
        let text = read(rel);
        assert!(
            !text.contains("transport: tcp"),
            "{rel}: manifests use the proxy (transport auto); e2e's TCP run edits it"
        );
        for doc in serde_yaml::Deserializer::from_str(&text) {
            let v = serde_yaml::Value::deserialize(doc).unwrap();
            if v.get("kind").and_then(|k| k.as_str()) != Some("CollectiveJob") {
                continue;
            }
            let mut job: CollectiveJob =
                serde_yaml::from_value(v).unwrap_or_else(|e| panic!("{rel}: {e}"));
            job.metadata.uid = Some("uid".into());
            weft_operator::resources::validate(&job).unwrap_or_else(|e| panic!("{rel}: {e}"));
            jobs += 1;
            let spec = job.spec.template.spec.as_ref().unwrap();
            for c in &spec.containers {
                let image = c.image.clone().unwrap_or_default();
                let Some(stage) = image
                    .strip_prefix("ghcr.io/weft-dev/")
                    .and_then(|s| s.strip_suffix(":0.1.0"))
                else {
                    continue; // not one of ours (PyTorch's)
                };
                // What runs: the command, or the one `weft run ... --` starts.
                let argv = c.command.clone().unwrap_or_default();
                let mut progs = vec![argv[0].clone()];
                if let Some(i) = argv.iter().position(|w| w == "--") {
                    progs.push(argv[i + 1].clone());
                }
                let held = programs_of(stage);
                for p in progs
                    .iter()
                    .filter(|p| !["sleep", "sh"].contains(&p.as_str()))
                {
                    assert!(
                        held.contains(p),
                        "{rel}: {p} is not in image {stage} ({held:?})"
                    );
                }
            }
        }
    }
    assert_eq!(jobs, MANIFESTS.len());
    // The e2e swaps these images for the locally built ones.
    assert!(
        read("e2e/lib.sh").contains(r"s#ghcr.io/weft-dev/\(weft[a-z-]*\):0.1.0#$REPO/\1:$TAG#g")
    );
}

/// The edits the scenarios make to the manifests they apply still match
/// lines of those manifests: `apply "$ROOT/FILE" 's/^LINE$/...'`.
#[test]
fn e2e_edits_match_their_manifests() {
    let text = e2e_text();
    let mut edits = 0;
    for line in text.lines() {
        let Some(i) = line.find("apply \"$ROOT/") else {
            continue;
        };
        let rest = &line[i + "apply \"$ROOT/".len()..];
        let file = rest.split('"').next().unwrap();
        let manifest = read(file);
        for arg in rest.split(['"', '\'']).skip(1) {
            if let Some(pat) = arg.strip_prefix("s/^").and_then(|a| a.split("$/").next()) {
                assert!(
                    manifest.lines().any(|l| l == pat),
                    "{file} has no line {pat:?} for the edit {arg:?}"
                );
                edits += 1;
            } else if arg.starts_with("s|\\\"resilient-train\\\", ") || arg.starts_with("s|") {
                assert!(
                    manifest
                        .lines()
                        .any(|l| l.contains("\"resilient-train\", ") && l.ends_with(']')),
                    "{file}: no one-line command running resilient-train to edit"
                );
                edits += 1;
            } else if let Some(pat) = arg.strip_prefix("s#").and_then(|a| a.split('#').next()) {
                assert!(manifest.contains(pat), "{file} has no {pat:?} for {arg:?}");
                edits += 1;
            }
        }
    }
    assert!(edits >= 8, "only {edits} edits found");
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
    ];
    for dir in ["docs", "examples", "e2e", "e2e/scenarios"] {
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
    assert!(checked >= 12, "only {checked} files checked");
    let crd = read("crds/collectivejob.yaml");
    assert!(crd.contains("shortNames:\n    - cjob\n"), "committed CRD");
}
