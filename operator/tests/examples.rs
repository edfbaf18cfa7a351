//! Every example in examples/ parses into the CRD type, passes the operator's
//! validation and the CRD's CEL rules, and renders its pods; offline (the
//! chart check in chart_check.rs validates them again against the Kubernetes
//! schemas when pip can reach its index). The examples must include the
//! PyTorch jobs: torchrun with Weft preloaded, and `weft run`.

use std::path::PathBuf;

use k8s_openapi::api::core::v1::Container;
use serde::Deserialize;
use weft_operator::crd::{CollectiveJob, crd_schema};
use weft_operator::resources::{OperatorConfig, desired_pod, validate};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// (file name, the job) for every CollectiveJob document of every example.
fn example_jobs() -> Vec<(String, serde_yaml::Value, CollectiveJob)> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(root().join("examples"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().and_then(|e| e.to_str()) == Some("yaml"))
        .collect();
    files.sort();
    let mut out = Vec::new();
    for path in files {
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let text = std::fs::read_to_string(&path).unwrap();
        for doc in serde_yaml::Deserializer::from_str(&text) {
            let value = serde_yaml::Value::deserialize(doc)
                .unwrap_or_else(|e| panic!("{name}: not YAML: {e}"));
            if value.get("kind").and_then(|k| k.as_str()) != Some("CollectiveJob") {
                continue;
            }
            let job: CollectiveJob = serde_yaml::from_value(value.clone())
                .unwrap_or_else(|e| panic!("{name}: not a CollectiveJob: {e}"));
            out.push((name.clone(), value, job));
        }
    }
    out
}

fn containers(job: &CollectiveJob) -> Vec<Container> {
    let spec = job.spec.template.spec.as_ref().expect("a pod spec");
    spec.containers.clone()
}

/// The container's command and args as one list of words.
fn argv(c: &Container) -> Vec<String> {
    let mut v = c.command.clone().unwrap_or_default();
    v.extend(c.args.clone().unwrap_or_default());
    v
}

#[test]
fn every_example_parses_validates_and_renders() {
    let jobs = example_jobs();
    assert!(
        jobs.len() >= 3,
        "expected at least three example CollectiveJobs"
    );
    let schema = crd_schema();
    for (file, value, mut job) in jobs {
        let json: serde_json::Value = serde_json::to_value(&value).unwrap();
        kube_cel::Validator::new()
            .validate(&schema, &json, None)
            .unwrap_or_else(|e| panic!("{file}: the CRD's CEL rules refuse it: {e}"));
        job.metadata.namespace = Some("default".into());
        job.metadata.uid = Some("00000000-0000-0000-0000-000000000001".into());
        validate(&job).unwrap_or_else(|e| panic!("{file}: {e}"));
        for i in 0..job.spec.replicas {
            let pod = desired_pod(&job, i, 0, &OperatorConfig::default());
            let spec = pod.spec.expect("a rendered pod spec");
            assert!(
                !spec.containers.is_empty(),
                "{file}: pod {i} has no containers"
            );
        }
    }
}

#[test]
fn examples_include_pytorch_jobs() {
    let jobs = example_jobs();
    let torch: Vec<_> = jobs
        .iter()
        .filter(|(_, _, j)| {
            containers(j).iter().any(|c| {
                argv(c)
                    .iter()
                    .any(|w| w.contains("torchrun") || w.contains("python"))
            })
        })
        .collect();
    // torchrun with the library preloaded.
    assert!(
        torch.iter().any(|(_, _, j)| containers(j).iter().any(|c| {
            argv(c).iter().any(|w| w == "torchrun")
                && c.env.iter().flatten().any(|e| {
                    e.name == "LD_PRELOAD"
                        && e.value.as_deref().unwrap_or("").ends_with("libnccl.so.2")
                })
        })),
        "no example runs torchrun with Weft's libnccl.so.2 preloaded"
    );
    // `weft run -n $(WEFT_LOCAL_RANKS) -- ... LD_PRELOAD=...libnccl.so.2 python ...`.
    let weft_run = torch.iter().find(|(_, _, j)| {
        containers(j).iter().any(|c| {
            let a = argv(c);
            a.len() > 2 && a[0].ends_with("weft") && a[1] == "run"
        })
    });
    let (file, _, job) = weft_run.expect("no example runs a PyTorch script under `weft run`");
    let c = containers(job)
        .into_iter()
        .find(|c| argv(c).get(1).map(String::as_str) == Some("run"))
        .unwrap();
    let a = argv(&c);
    let n = a.iter().position(|w| w == "-n").expect("weft run -n");
    assert_eq!(
        a[n + 1],
        "$(WEFT_LOCAL_RANKS)",
        "{file}: -n must be the pod's rank count"
    );
    let dashdash = a.iter().position(|w| w == "--").expect("weft run ... --");
    let rest = &a[dashdash + 1..];
    assert!(
        rest.iter()
            .any(|w| w.starts_with("LD_PRELOAD=") && w.ends_with("libnccl.so.2")),
        "{file}: the ranks must preload Weft's libnccl.so.2: {rest:?}"
    );
    assert!(
        rest.iter().any(|w| w.starts_with("python")),
        "{file}: {rest:?}"
    );
}

/// CPU in millicores of a Kubernetes quantity ("100m", "1", "0.5").
fn millicores(q: &str) -> u64 {
    match q.strip_suffix('m') {
        Some(m) => m.parse().unwrap_or_else(|_| panic!("cpu {q}")),
        None => (q.parse::<f64>().unwrap_or_else(|_| panic!("cpu {q}")) * 1000.0) as u64,
    }
}

/// Issue 31 (2): the CPU examples (no GPU asked) schedule on a 2-CPU node
/// (a laptop's kind cluster, e2e's local cluster) next to the operator: a
/// whole job's CPU requests, the injected sidecar included, stay within one
/// CPU, and every workload container caps its memory.
#[test]
fn cpu_examples_fit_a_two_cpu_node() {
    let mut checked = 0;
    for (file, _, mut job) in example_jobs() {
        let wants_gpu = containers(&job).iter().any(|c| {
            let r = c.resources.clone().unwrap_or_default();
            [r.requests, r.limits]
                .iter()
                .flatten()
                .any(|m| m.contains_key("nvidia.com/gpu"))
        });
        if wants_gpu {
            continue;
        }
        job.metadata.namespace = Some("default".into());
        job.metadata.uid = Some("00000000-0000-0000-0000-000000000001".into());
        let mut cpu = 0;
        for i in 0..job.spec.replicas {
            let spec = desired_pod(&job, i, 0, &OperatorConfig::default())
                .spec
                .expect("a pod spec");
            for c in spec
                .containers
                .iter()
                .chain(spec.init_containers.iter().flatten())
            {
                let requests = c.resources.clone().unwrap_or_default().requests;
                if let Some(q) = requests.as_ref().and_then(|r| r.get("cpu")) {
                    cpu += millicores(&q.0);
                }
            }
        }
        assert!(
            cpu <= 1000,
            "{file}: the job requests {cpu}m CPU with its sidecars; keep it within 1000m so it fits a 2-CPU node"
        );
        for c in containers(&job) {
            let limits = c.resources.clone().unwrap_or_default().limits;
            assert!(
                limits.is_some_and(|l| l.contains_key("memory")),
                "{file}: container {} has no memory limit",
                c.name
            );
        }
        checked += 1;
    }
    assert!(checked >= 2, "only {checked} CPU examples");
}
