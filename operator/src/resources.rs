//! Desired state: pure functions from a `CollectiveJob` to the Service, Secret
//! and Pods that should exist. No I/O here, so every shape is unit-tested.

use std::collections::BTreeMap;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::api::core::v1::{
    Capabilities, Container, ContainerPort, EmptyDirVolumeSource, EnvVar, HTTPGetAction, Pod,
    PodSpec, Probe, ResourceRequirements, SecretVolumeSource, SecurityContext, Service,
    ServicePort, ServiceSpec, Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta, OwnerReference};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::{Resource, ResourceExt};
use weft_contract::env::{PodEnv, TorchRunEnv, names};

use crate::crd::{CollectiveJob, FailureAction, TORCH_MASTER_PORT, Transport};

/// Label carrying the job name on every owned object (pods are selected by it).
pub const LABEL_JOB: &str = "weft.dev/job-name";
/// Label carrying the replica index of a pod.
pub const LABEL_INDEX: &str = "weft.dev/replica-index";
/// Label carrying the restart epoch of a pod.
pub const LABEL_EPOCH: &str = "weft.dev/restart-epoch";
/// Label carrying the incarnation of a pod in its epoch (0, then bumped by
/// each in-place replacement).
pub const LABEL_INCARNATION: &str = "weft.dev/incarnation";
pub const LABEL_MANAGED_BY: &str = "app.kubernetes.io/managed-by";
pub const MANAGER: &str = "weft-operator";
pub const KUEUE_QUEUE: &str = "kueue.x-k8s.io/queue-name";
pub const KUEUE_POD_GROUP: &str = "kueue.x-k8s.io/pod-group-name";
pub const KUEUE_GROUP_COUNT: &str = "kueue.x-k8s.io/pod-group-total-count";

pub const SIDECAR_NAME: &str = "weft-sidecar";
pub const SOCKET_DIR: &str = "/run/weft";
/// The pod's recovery board under `onRankFailure: ReplaceRank`, in the
/// volume the sidecar shares with the workload (it relays it to the others).
pub const BOARD_DIR: &str = "/run/weft/board";
pub const SOCKET_PATH: &str = "/run/weft/sidecar.sock";
pub const SECRET_DIR: &str = "/etc/weft/secret";
pub const SECRET_KEY: &str = "token";
pub const GPU_RESOURCE: &str = "nvidia.com/gpu";
const VOL_SOCKET: &str = "weft-socket";
const VOL_SHM: &str = "weft-shm";
const VOL_SECRET: &str = "weft-secret";

/// Operator-wide settings (from the Helm values, via flags/env).
#[derive(Clone, Debug)]
pub struct OperatorConfig {
    /// Sidecar image used when `spec.sidecar.image` is unset.
    pub sidecar_image: String,
    /// OTLP endpoint used when `spec.telemetry` is unset.
    pub otlp_endpoint: Option<String>,
}

impl Default for OperatorConfig {
    fn default() -> Self {
        Self {
            sidecar_image: weft_contract::params::WEFT_SIDECAR_IMAGE
                .fixed_default()
                .into(),
            otlp_endpoint: None,
        }
    }
}

pub fn namespace(job: &CollectiveJob) -> String {
    job.namespace().unwrap_or_else(|| "default".into())
}

pub fn service_name(job: &CollectiveJob) -> String {
    job.name_any()
}

/// `<job>-weft-token-<uid prefix>`: the uid part keeps a job deleted and
/// re-created under the same name from adopting its predecessor's Secret
/// (owned by the old uid, so garbage-collected under the new pods). The
/// operator only creates Secrets, it never reads them, so "already exists"
/// must mean "ours".
pub fn secret_name(job: &CollectiveJob) -> String {
    let uid: String = job
        .uid()
        .unwrap_or_default()
        .chars()
        .filter(|c| c.is_ascii_alphanumeric())
        .map(|c| c.to_ascii_lowercase())
        .take(8)
        .collect();
    format!("{}-weft-token-{uid}", job.name_any())
}

pub fn pod_name(job: &CollectiveJob, index: i32) -> String {
    format!("{}-{index}", job.name_any())
}

/// DNS name of pod `index` through the headless Service.
pub fn pod_dns(job: &CollectiveJob, index: i32) -> String {
    format!(
        "{}.{}.{}.svc",
        pod_name(job, index),
        service_name(job),
        namespace(job)
    )
}

/// `WEFT_BOOTSTRAP`: pod 0's sidecar.
pub fn bootstrap_endpoint(job: &CollectiveJob) -> String {
    format!("{}:{}", pod_dns(job, 0), job.spec.sidecar.bootstrap_port)
}

pub fn world_size(job: &CollectiveJob) -> i32 {
    job.spec.replicas * job.spec.ranks_per_replica
}

/// Label selector string for every pod of the job.
pub fn pod_selector(job: &CollectiveJob) -> String {
    format!("{LABEL_JOB}={}", job.name_any())
}

fn owner_ref(job: &CollectiveJob) -> OwnerReference {
    // controller=true: the job is the managing controller, and the garbage
    // collector deletes pods, Service and Secret with it. blockOwnerDeletion is
    // left unset: it would need update rights on collectivejobs/finalizers.
    job.controller_owner_ref(&())
        .expect("a stored CollectiveJob has a name and uid")
}

fn base_labels(job: &CollectiveJob) -> BTreeMap<String, String> {
    BTreeMap::from([
        (LABEL_JOB.to_string(), job.name_any()),
        (LABEL_MANAGED_BY.to_string(), MANAGER.to_string()),
        ("app.kubernetes.io/name".to_string(), "weft".to_string()),
    ])
}

fn meta(job: &CollectiveJob, name: String) -> ObjectMeta {
    ObjectMeta {
        name: Some(name),
        namespace: Some(namespace(job)),
        labels: Some(base_labels(job)),
        owner_references: Some(vec![owner_ref(job)]),
        ..ObjectMeta::default()
    }
}

/// Headless Service giving every pod a stable DNS name. Not-ready addresses
/// are published so ranks can resolve pod 0 before the pods are Ready (the
/// sidecar only becomes ready once the rendezvous it serves has happened).
pub fn desired_service(job: &CollectiveJob) -> Service {
    let port = |name: &str, port: i32| ServicePort {
        name: Some(name.into()),
        port,
        target_port: Some(IntOrString::Int(port)),
        protocol: Some("TCP".into()),
        ..ServicePort::default()
    };
    Service {
        metadata: meta(job, service_name(job)),
        spec: Some(ServiceSpec {
            cluster_ip: Some("None".into()),
            publish_not_ready_addresses: Some(true),
            selector: Some(BTreeMap::from([(LABEL_JOB.to_string(), job.name_any())])),
            ports: Some(vec![
                port("bootstrap", job.spec.sidecar.bootstrap_port),
                port("weft-peer", job.spec.sidecar.peer_port),
                port("torch-master", TORCH_MASTER_PORT),
            ]),
            ..ServiceSpec::default()
        }),
        ..Service::default()
    }
}

/// Secret with the per-job token that authenticates bootstrap traffic. It is
/// created once and never updated (a new token would split the job).
pub fn desired_secret(job: &CollectiveJob, token: &str) -> Secret {
    Secret {
        metadata: meta(job, secret_name(job)),
        type_: Some("Opaque".into()),
        data: Some(BTreeMap::from([(
            SECRET_KEY.to_string(),
            ByteString(token.as_bytes().to_vec()),
        )])),
        immutable: Some(true),
        ..Secret::default()
    }
}

/// 32 random bytes, hex encoded.
pub fn random_token() -> String {
    let mut bytes = [0u8; 32];
    getrandom::fill(&mut bytes).expect("OS random source");
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn env(name: &str, value: impl Into<String>) -> EnvVar {
    EnvVar {
        name: name.into(),
        value: Some(value.into()),
        ..EnvVar::default()
    }
}

/// A count from the spec (the schema keeps them non-negative).
fn count(n: i32) -> u32 {
    n.max(0) as u32
}

/// Whether the job replaces failed pods in place (`onRankFailure:
/// ReplaceRank`): its pods keep a recovery board and share one process
/// namespace (the sidecar stops a frozen rank).
pub fn replaces_ranks(job: &CollectiveJob) -> bool {
    job.spec.failure_policy.on_rank_failure == FailureAction::ReplaceRank
}

/// The operator -> pod environment contract (`weft_contract::env::PodEnv`),
/// for pod `index` in `epoch`, first incarnation.
pub fn pod_env(job: &CollectiveJob, index: i32, epoch: i32, cfg: &OperatorConfig) -> PodEnv {
    pod_env_incarnation(job, index, epoch, 0, cfg)
}

/// [`pod_env`] for incarnation `incarnation` of pod `index` (a replacement
/// when > 0).
pub fn pod_env_incarnation(
    job: &CollectiveJob,
    index: i32,
    epoch: i32,
    incarnation: i32,
    cfg: &OperatorConfig,
) -> PodEnv {
    let s = &job.spec;
    PodEnv {
        job: job.name_any(),
        namespace: namespace(job),
        world_size: count(world_size(job)),
        rank_offset: count(index * s.ranks_per_replica),
        local_ranks: count(s.ranks_per_replica),
        nnodes: count(s.replicas),
        node_rank: count(index),
        bootstrap: bootstrap_endpoint(job),
        sidecar_socket: SOCKET_PATH.into(),
        secret_file: format!("{SECRET_DIR}/{SECRET_KEY}"),
        restart_epoch: count(epoch),
        incarnation: count(incarnation),
        recovery_dir: replaces_ranks(job).then(|| BOARD_DIR.to_string()),
        transport: s.network.transport.as_str().into(),
        net_if: s.network.interface.clone(),
        otlp_endpoint: s
            .telemetry
            .as_ref()
            .map(|t| t.otlp_endpoint.clone())
            .or_else(|| cfg.otlp_endpoint.clone()),
        torch: TorchRunEnv {
            nnodes: count(s.replicas),
            node_rank: count(index),
            nproc_per_node: count(s.ranks_per_replica),
            master_addr: pod_dns(job, 0),
            master_port: TORCH_MASTER_PORT as u16,
        },
    }
}

/// [`pod_env`] as container variables.
pub fn contract_env(
    job: &CollectiveJob,
    index: i32,
    epoch: i32,
    incarnation: i32,
    cfg: &OperatorConfig,
) -> Vec<EnvVar> {
    pod_env_incarnation(job, index, epoch, incarnation, cfg)
        .to_vars()
        .into_iter()
        .map(|(k, v)| env(k, v))
        .collect()
}

/// Replaces the template's variables of the same name: the contract wins,
/// because a stale WEFT_WORLD_SIZE baked into a template would hang the job.
fn with_contract_env(existing: Option<Vec<EnvVar>>, contract: &[EnvVar]) -> Vec<EnvVar> {
    let mut out: Vec<EnvVar> = existing
        .unwrap_or_default()
        .into_iter()
        .filter(|e| !contract.iter().any(|c| c.name == e.name))
        .collect();
    out.extend_from_slice(contract);
    out
}

fn mount(name: &str, path: &str, read_only: bool) -> VolumeMount {
    VolumeMount {
        name: name.into(),
        mount_path: path.into(),
        read_only: read_only.then_some(true),
        ..VolumeMount::default()
    }
}

/// The mounts every container gets (skipping paths the template already mounts).
fn add_mounts(existing: Option<Vec<VolumeMount>>) -> Vec<VolumeMount> {
    let mut out = existing.unwrap_or_default();
    for m in [
        mount(VOL_SOCKET, SOCKET_DIR, false),
        mount(VOL_SHM, "/dev/shm", false),
        mount(VOL_SECRET, SECRET_DIR, true),
    ] {
        if !out.iter().any(|e| e.mount_path == m.mount_path) {
            out.push(m);
        }
    }
    out
}

/// Size of /dev/shm: explicit, else per local rank (GPU transports stage
/// through larger host buffers than TCP).
pub fn shm_size(job: &CollectiveJob) -> Quantity {
    if let Some(q) = &job.spec.network.shm_size {
        return q.clone();
    }
    let per_rank_mib = match job.spec.network.transport {
        Transport::Tcp => 512,
        Transport::Auto | Transport::Ib => 1024,
    };
    let mib = (per_rank_mib * job.spec.ranks_per_replica).max(1024) + 256;
    Quantity(format!("{mib}Mi"))
}

/// GPUs a container asks for (requests, else limits).
pub fn container_gpus(c: &Container) -> i64 {
    let get = |m: Option<&BTreeMap<String, Quantity>>| {
        m.and_then(|m| m.get(GPU_RESOURCE))
            .and_then(|q| q.0.parse::<i64>().ok())
    };
    let r = c.resources.as_ref();
    get(r.and_then(|r| r.requests.as_ref()))
        .or_else(|| get(r.and_then(|r| r.limits.as_ref())))
        .unwrap_or(0)
}

/// Extended resources must have requests == limits; a template that names GPUs
/// in only one of them gets both, so schedulers and quota (Kueue) see them.
fn normalise_gpus(c: &mut Container) {
    let n = container_gpus(c);
    if n == 0 {
        return;
    }
    let r = c
        .resources
        .get_or_insert_with(ResourceRequirements::default);
    let q = Quantity(n.to_string());
    r.requests
        .get_or_insert_with(BTreeMap::new)
        .insert(GPU_RESOURCE.into(), q.clone());
    r.limits
        .get_or_insert_with(BTreeMap::new)
        .insert(GPU_RESOURCE.into(), q);
}

/// A lost pod is noticed by the other pods' sidecars after this long without
/// an answer (libcomm's own `WEFT_PEER_TIMEOUT_MS` default is the same).
pub const PEER_TIMEOUT_MS: u64 = 10_000;
/// A pod whose sidecar never answered yet (still pulling its image, still
/// pending) counts as lost only after this long.
pub const PEER_STARTUP_GRACE_MS: u64 = 600_000;

/// `weft sidecar` for replica `index`: HTTP (metrics, probes, RAS) and the
/// peer port on every interface, the other replicas' sidecars as peers
/// (heartbeats, job-wide RAS, the network proxy).
pub fn sidecar_command(job: &CollectiveJob, index: i32) -> Vec<String> {
    let sc = &job.spec.sidecar;
    let mut cmd = vec![
        "weft".to_string(),
        "sidecar".into(),
        "--http".into(),
        format!("0.0.0.0:{}", sc.metrics_port),
        "--peer-listen".into(),
        format!("0.0.0.0:{}", sc.peer_port),
        "--peer-timeout-ms".into(),
        PEER_TIMEOUT_MS.to_string(),
        "--peer-startup-grace-ms".into(),
        PEER_STARTUP_GRACE_MS.to_string(),
    ];
    let peers: Vec<String> = (0..job.spec.replicas)
        .filter(|&i| i != index)
        .map(|i| format!("{}:{}", pod_dns(job, i), sc.peer_port))
        .collect();
    if !peers.is_empty() {
        cmd.push("--peers".into());
        cmd.push(peers.join(","));
    }
    cmd
}

fn sidecar_container(
    job: &CollectiveJob,
    index: i32,
    env: Vec<EnvVar>,
    cfg: &OperatorConfig,
) -> Container {
    let sc = &job.spec.sidecar;
    let mut env = env;
    env.push(self::env(names::WEFT_LOG, sc.log_level.as_str()));
    let resources = sc
        .resources
        .clone()
        .unwrap_or_else(|| ResourceRequirements {
            requests: Some(BTreeMap::from([
                ("cpu".to_string(), Quantity("100m".into())),
                ("memory".to_string(), Quantity("128Mi".into())),
            ])),
            ..ResourceRequirements::default()
        });
    let port = |name: &str, p: i32| ContainerPort {
        name: Some(name.into()),
        container_port: p,
        protocol: Some("TCP".into()),
        ..ContainerPort::default()
    };
    Container {
        name: SIDECAR_NAME.into(),
        image: Some(
            sc.image
                .clone()
                .unwrap_or_else(|| cfg.sidecar_image.clone()),
        ),
        image_pull_policy: sc.image_pull_policy.clone(),
        command: Some(sidecar_command(job, index)),
        env: Some(env),
        ports: Some(vec![
            port("bootstrap", sc.bootstrap_port),
            port("metrics", sc.metrics_port),
            port("weft-peer", sc.peer_port),
        ]),
        // Native sidecar: an init container that keeps running; the kubelet
        // starts it before the workload and stops it after the workload exits,
        // so it never keeps a finished pod alive.
        restart_policy: Some("Always".into()),
        // Workload containers start only once the sidecar serves HTTP (its
        // Unix socket and proxy exist by then). Not the bootstrap port: rank
        // 0, in the workload container, serves that.
        startup_probe: Some(Probe {
            http_get: Some(HTTPGetAction {
                path: Some("/healthz".into()),
                port: IntOrString::Int(sc.metrics_port),
                ..HTTPGetAction::default()
            }),
            period_seconds: Some(1),
            failure_threshold: Some(120),
            ..Probe::default()
        }),
        resources: Some(resources),
        // RDMA registers (pins) memory; the default memlock limit is too small.
        security_context: (job.spec.network.transport == Transport::Ib).then(|| SecurityContext {
            capabilities: Some(Capabilities {
                add: Some(vec!["IPC_LOCK".into()]),
                ..Capabilities::default()
            }),
            ..SecurityContext::default()
        }),
        volume_mounts: Some(add_mounts(None)),
        ..Container::default()
    }
}

/// The Pod for replica `index` of restart epoch `epoch`.
pub fn desired_pod(job: &CollectiveJob, index: i32, epoch: i32, cfg: &OperatorConfig) -> Pod {
    desired_pod_incarnation(job, index, epoch, 0, cfg)
}

/// [`desired_pod`] for incarnation `incarnation`: a replacement (> 0) of a
/// failed pod has the same name, hostname, subdomain and ranks, and differs
/// only in the `weft.dev/incarnation` label and `WEFT_INCARNATION`.
pub fn desired_pod_incarnation(
    job: &CollectiveJob,
    index: i32,
    epoch: i32,
    incarnation: i32,
    cfg: &OperatorConfig,
) -> Pod {
    let name = pod_name(job, index);
    let tmpl_meta = job.spec.template.metadata.clone().unwrap_or_default();
    let mut labels = tmpl_meta.labels.unwrap_or_default();
    labels.extend(base_labels(job));
    labels.insert(LABEL_INDEX.into(), index.to_string());
    labels.insert(LABEL_EPOCH.into(), epoch.to_string());
    labels.insert(LABEL_INCARNATION.into(), incarnation.to_string());
    let mut annotations = tmpl_meta.annotations.unwrap_or_default();
    if let Some(q) = &job.spec.scheduling.queue {
        // Kueue plain-pod groups: the pods of one epoch are admitted together.
        labels.insert(KUEUE_QUEUE.into(), q.clone());
        labels.insert(
            KUEUE_POD_GROUP.into(),
            format!("{}-{epoch}", job.name_any()),
        );
        annotations.insert(KUEUE_GROUP_COUNT.into(), job.spec.replicas.to_string());
    }

    let contract = contract_env(job, index, epoch, incarnation, cfg);
    let mut spec: PodSpec = job.spec.template.spec.clone().unwrap_or_default();
    for c in spec.containers.iter_mut() {
        c.env = Some(with_contract_env(c.env.take(), &contract));
        c.volume_mounts = Some(add_mounts(c.volume_mounts.take()));
        normalise_gpus(c);
    }
    let mut init = vec![sidecar_container(job, index, contract.clone(), cfg)];
    for mut c in spec.init_containers.take().unwrap_or_default() {
        c.env = Some(with_contract_env(c.env.take(), &contract));
        c.volume_mounts = Some(add_mounts(c.volume_mounts.take()));
        init.push(c);
    }
    spec.init_containers = Some(init);

    let mut volumes = spec.volumes.take().unwrap_or_default();
    volumes.extend([
        Volume {
            name: VOL_SOCKET.into(),
            empty_dir: Some(EmptyDirVolumeSource::default()),
            ..Volume::default()
        },
        Volume {
            name: VOL_SHM.into(),
            empty_dir: Some(EmptyDirVolumeSource {
                medium: Some("Memory".into()),
                size_limit: Some(shm_size(job)),
                ..EmptyDirVolumeSource::default()
            }),
            ..Volume::default()
        },
        Volume {
            name: VOL_SECRET.into(),
            secret: Some(SecretVolumeSource {
                secret_name: Some(secret_name(job)),
                default_mode: Some(0o444),
                ..SecretVolumeSource::default()
            }),
            ..Volume::default()
        },
    ]);
    spec.volumes = Some(volumes);

    // The operator restarts the whole job; a kubelet restarting one rank in
    // place would rejoin a world that no longer exists.
    spec.restart_policy = Some("Never".into());
    // Under ReplaceRank the sidecar SIGKILLs a frozen (stopped) rank that a
    // survivor's timeout reported, so its pod is replaced: it must see the
    // workload's processes. A template that says false keeps false.
    if replaces_ranks(job) && spec.share_process_namespace.is_none() {
        spec.share_process_namespace = Some(true);
    }
    spec.hostname = Some(name.clone());
    spec.subdomain = Some(service_name(job));

    let sched = &job.spec.scheduling;
    if sched.scheduler_name.is_some() {
        spec.scheduler_name = sched.scheduler_name.clone();
    }
    if sched.priority_class_name.is_some() {
        spec.priority_class_name = sched.priority_class_name.clone();
    }
    if !sched.node_selector.is_empty() {
        spec.node_selector
            .get_or_insert_with(BTreeMap::new)
            .extend(sched.node_selector.clone());
    }
    if !sched.tolerations.is_empty() {
        spec.tolerations
            .get_or_insert_with(Vec::new)
            .extend(sched.tolerations.clone());
    }
    if !sched.topology_spread_constraints.is_empty() {
        let selector = LabelSelector {
            match_labels: Some(BTreeMap::from([(LABEL_JOB.to_string(), job.name_any())])),
            ..LabelSelector::default()
        };
        let tsc = spec
            .topology_spread_constraints
            .get_or_insert_with(Vec::new);
        for mut c in sched.topology_spread_constraints.clone() {
            if c.label_selector.is_none() {
                c.label_selector = Some(selector.clone());
            }
            tsc.push(c);
        }
    }

    Pod {
        metadata: ObjectMeta {
            name: Some(name),
            namespace: Some(namespace(job)),
            labels: Some(labels),
            annotations: (!annotations.is_empty()).then_some(annotations),
            owner_references: Some(vec![owner_ref(job)]),
            ..ObjectMeta::default()
        },
        spec: Some(spec),
        status: None,
    }
}

/// Checks the schema cannot express; a violation fails the job with reason
/// `InvalidSpec` instead of creating pods that can never work.
pub fn validate(job: &CollectiveJob) -> Result<(), String> {
    let name = job.name_any();
    // The pod hostname `<job>-<index>` must be a DNS label (<= 63 chars), and
    // the job name is the headless Service's name (a DNS-1035 label).
    let longest = pod_name(job, job.spec.replicas.max(1) - 1);
    if longest.len() > 63 {
        return Err(format!(
            "job name {name:?} is too long: pod hostname {longest:?} exceeds 63 characters"
        ));
    }
    if !name.starts_with(|c: char| c.is_ascii_lowercase()) {
        return Err(format!(
            "job name {name:?} must start with a lowercase letter (it names the headless Service)"
        ));
    }
    // A CollectiveJob may be named like any object (a DNS subdomain: dots
    // allowed), but its Service and pod hostnames must be DNS-1035 labels.
    if let Some(bad) = name
        .chars()
        .find(|c| !(c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '-'))
    {
        return Err(format!(
            "job name {name:?} contains {bad:?}: it names the headless Service and the pod hostnames, \
             which must be DNS-1035 labels (lowercase letters, digits and '-'); rename the job"
        ));
    }
    if name.ends_with('-') {
        return Err(format!(
            "job name {name:?} must end with a letter or digit (it names the headless Service)"
        ));
    }
    let Some(spec) = job.spec.template.spec.as_ref() else {
        return Err("spec.template.spec is required".into());
    };
    if spec.containers.is_empty() {
        return Err("spec.template.spec.containers must not be empty".into());
    }
    if let Some(rp) = &spec.restart_policy
        && rp != "Never"
    {
        return Err(format!(
            "spec.template.spec.restartPolicy {rp:?} is not supported: use Never (the operator restarts the whole job)"
        ));
    }
    for c in spec
        .containers
        .iter()
        .chain(spec.init_containers.iter().flatten())
    {
        if c.name == SIDECAR_NAME {
            return Err(format!("container name {SIDECAR_NAME} is reserved"));
        }
    }
    for v in spec.volumes.iter().flatten() {
        if v.name.starts_with("weft-") {
            return Err(format!(
                "volume name {:?} is reserved (weft- prefix)",
                v.name
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::crd::{CollectiveJobSpec, TelemetrySpec};
    use k8s_openapi::api::core::v1::{PodTemplateSpec, Toleration, TopologySpreadConstraint};

    /// A stored job (has a uid) with `replicas` pods of `rpr` ranks.
    pub fn job(name: &str, replicas: i32, rpr: i32) -> CollectiveJob {
        let spec: CollectiveJobSpec = serde_json::from_value(serde_json::json!({
            "replicas": replicas,
            "ranksPerReplica": rpr,
            "template": {"spec": {"containers": [{
                "name": "main",
                "image": "weft:test",
                "command": ["weft", "bench", "all_reduce"],
                "env": [{"name": "WEFT_WORLD_SIZE", "value": "999"}, {"name": "KEEP", "value": "me"}]
            }]}}
        }))
        .unwrap();
        let mut j = CollectiveJob::new(name, spec);
        j.metadata.namespace = Some("ml".into());
        j.metadata.uid = Some("uid-1".into());
        j.metadata.generation = Some(1);
        j
    }

    fn env_of(c: &Container) -> BTreeMap<String, String> {
        c.env
            .iter()
            .flatten()
            .map(|e| (e.name.clone(), e.value.clone().unwrap_or_default()))
            .collect()
    }

    #[test]
    fn service_is_headless_and_publishes_not_ready() {
        let j = job("train", 4, 8);
        let s = desired_service(&j);
        assert_eq!(s.metadata.name.as_deref(), Some("train"));
        let spec = s.spec.unwrap();
        assert_eq!(spec.cluster_ip.as_deref(), Some("None"));
        assert_eq!(spec.publish_not_ready_addresses, Some(true));
        assert_eq!(spec.selector.unwrap()[LABEL_JOB], "train");
        let ports: Vec<i32> = spec.ports.unwrap().iter().map(|p| p.port).collect();
        assert_eq!(ports, [29400, 29401, 29500]);
        let owner = &s.metadata.owner_references.unwrap()[0];
        assert_eq!(owner.kind, "CollectiveJob");
        assert_eq!(owner.controller, Some(true));
    }

    #[test]
    fn secret_holds_token_and_is_owned() {
        let j = job("train", 2, 1);
        let t = random_token();
        assert_eq!(t.len(), 64);
        assert_ne!(t, random_token());
        let s = desired_secret(&j, &t);
        assert_eq!(s.metadata.name.as_deref(), Some("train-weft-token-uid1"));
        assert_eq!(s.data.unwrap()["token"].0, t.as_bytes());
        assert_eq!(s.metadata.owner_references.unwrap()[0].uid, "uid-1");
    }

    #[test]
    fn env_contract_for_many_shapes() {
        for (replicas, rpr) in [(1, 1), (2, 1), (1, 8), (4, 8), (16, 2), (3, 5)] {
            let j = job("shape", replicas, rpr);
            for index in 0..replicas {
                let pod = desired_pod(&j, index, 7, &OperatorConfig::default());
                let spec = pod.spec.unwrap();
                let e = env_of(&spec.containers[0]);
                assert_eq!(e["WEFT_JOB"], "shape");
                assert_eq!(e["WEFT_JOB_NAMESPACE"], "ml");
                assert_eq!(e["WEFT_WORLD_SIZE"], (replicas * rpr).to_string());
                assert_eq!(e["WEFT_RANK_OFFSET"], (index * rpr).to_string());
                assert_eq!(e["WEFT_LOCAL_RANKS"], rpr.to_string());
                assert_eq!(e["WEFT_NNODES"], replicas.to_string());
                assert_eq!(e["WEFT_NODE_RANK"], index.to_string());
                assert_eq!(e["WEFT_BOOTSTRAP"], "shape-0.shape.ml.svc:29400");
                assert_eq!(e["WEFT_SIDECAR_SOCKET"], "/run/weft/sidecar.sock");
                assert_eq!(e["WEFT_JOB_SECRET_FILE"], "/etc/weft/secret/token");
                assert_eq!(e["WEFT_RESTART_EPOCH"], "7");
                assert_eq!(e["WEFT_TRANSPORT"], "auto");
                assert!(!e.contains_key("WEFT_NET_IF"));
                assert!(!e.contains_key("OTEL_EXPORTER_OTLP_ENDPOINT"));
                assert_eq!(e["PET_NNODES"], replicas.to_string());
                assert_eq!(e["PET_NODE_RANK"], index.to_string());
                assert_eq!(e["PET_NPROC_PER_NODE"], rpr.to_string());
                assert_eq!(e["PET_MASTER_ADDR"], "shape-0.shape.ml.svc");
                assert_eq!(e["PET_MASTER_PORT"], "29500");
                // the template's own variable survives, its stale copy does not
                assert_eq!(e["KEEP"], "me");
                let n = spec.containers[0]
                    .env
                    .iter()
                    .flatten()
                    .filter(|v| v.name == "WEFT_WORLD_SIZE")
                    .count();
                assert_eq!(n, 1);
                // the sidecar gets the same contract
                let sc = &spec.init_containers.as_ref().unwrap()[0];
                let se = env_of(sc);
                for (k, v) in &e {
                    if k != "KEEP" {
                        assert_eq!(&se[k], v, "sidecar env {k}");
                    }
                }
                assert_eq!(se["WEFT_LOG"], "info");
            }
        }
    }

    #[test]
    fn ranks_partition_the_world() {
        let j = job("p", 5, 3);
        let mut seen = vec![];
        for i in 0..5 {
            let e = env_of(
                &desired_pod(&j, i, 0, &OperatorConfig::default())
                    .spec
                    .unwrap()
                    .containers[0],
            );
            let off: i32 = e["WEFT_RANK_OFFSET"].parse().unwrap();
            seen.extend(off..off + 3);
        }
        assert_eq!(seen, (0..15).collect::<Vec<_>>());
    }

    #[test]
    fn optional_env_network_and_telemetry() {
        let mut j = job("n", 2, 1);
        j.spec.network.transport = Transport::Ib;
        j.spec.network.interface = Some("ib0".into());
        j.spec.telemetry = Some(TelemetrySpec {
            otlp_endpoint: "http://otel:4317".into(),
        });
        let cfg = OperatorConfig {
            otlp_endpoint: Some("http://default:4317".into()),
            ..OperatorConfig::default()
        };
        let spec = desired_pod(&j, 1, 0, &cfg).spec.unwrap();
        let e = env_of(&spec.containers[0]);
        assert_eq!(e["WEFT_TRANSPORT"], "ib");
        assert_eq!(e["WEFT_NET_IF"], "ib0");
        assert_eq!(e["OTEL_EXPORTER_OTLP_ENDPOINT"], "http://otel:4317");
        let sc = &spec.init_containers.unwrap()[0];
        let caps = sc
            .security_context
            .as_ref()
            .unwrap()
            .capabilities
            .as_ref()
            .unwrap();
        assert_eq!(caps.add.as_ref().unwrap(), &["IPC_LOCK"]);
        // operator default endpoint when the job has none
        j.spec.telemetry = None;
        let e = env_of(&desired_pod(&j, 0, 0, &cfg).spec.unwrap().containers[0]);
        assert_eq!(e["OTEL_EXPORTER_OTLP_ENDPOINT"], "http://default:4317");
    }

    #[test]
    fn pod_identity_dns_labels_and_owner() {
        let j = job("train", 3, 2);
        let pod = desired_pod(&j, 2, 4, &OperatorConfig::default());
        assert_eq!(pod.metadata.name.as_deref(), Some("train-2"));
        assert_eq!(pod.metadata.namespace.as_deref(), Some("ml"));
        let l = pod.metadata.labels.unwrap();
        assert_eq!(l[LABEL_JOB], "train");
        assert_eq!(l[LABEL_INDEX], "2");
        assert_eq!(l[LABEL_EPOCH], "4");
        assert_eq!(l[LABEL_MANAGED_BY], "weft-operator");
        assert!(!l.contains_key(KUEUE_QUEUE));
        let o = &pod.metadata.owner_references.unwrap()[0];
        assert_eq!((o.name.as_str(), o.controller), ("train", Some(true)));
        let spec = pod.spec.unwrap();
        assert_eq!(spec.hostname.as_deref(), Some("train-2"));
        assert_eq!(spec.subdomain.as_deref(), Some("train"));
        assert_eq!(spec.restart_policy.as_deref(), Some("Never"));
    }

    #[test]
    fn sidecar_is_native_with_startup_probe() {
        let mut j = job("s", 1, 1);
        j.spec.sidecar.image = Some("weft:custom".into());
        j.spec.sidecar.bootstrap_port = 31000;
        let spec = desired_pod(&j, 0, 0, &OperatorConfig::default())
            .spec
            .unwrap();
        let init = spec.init_containers.unwrap();
        assert_eq!(init.len(), 1);
        let sc = &init[0];
        assert_eq!(sc.name, SIDECAR_NAME);
        assert_eq!(sc.image.as_deref(), Some("weft:custom"));
        assert_eq!(sc.restart_policy.as_deref(), Some("Always"));
        assert_eq!(
            sc.command.as_ref().unwrap(),
            &[
                "weft",
                "sidecar",
                "--http",
                "0.0.0.0:9464",
                "--peer-listen",
                "0.0.0.0:29401",
                "--peer-timeout-ms",
                "10000",
                "--peer-startup-grace-ms",
                "600000"
            ]
        );
        let probe = sc.startup_probe.as_ref().unwrap();
        let get = probe.http_get.as_ref().unwrap();
        assert_eq!(
            (get.path.as_deref(), &get.port),
            (Some("/healthz"), &IntOrString::Int(9464))
        );
        assert_eq!(env_of(sc)["WEFT_BOOTSTRAP"], "s-0.s.ml.svc:31000");
        let reqs = sc.resources.as_ref().unwrap().requests.as_ref().unwrap();
        assert_eq!(reqs["cpu"].0, "100m");
        // default image from the operator config
        let j = job("s", 1, 1);
        let cfg = OperatorConfig {
            sidecar_image: "registry/weft:1.0".into(),
            otlp_endpoint: None,
        };
        let spec = desired_pod(&j, 0, 0, &cfg).spec.unwrap();
        assert_eq!(
            spec.init_containers.unwrap()[0].image.as_deref(),
            Some("registry/weft:1.0")
        );
    }

    /// Every sidecar lists the other replicas' sidecars as peers (heartbeats,
    /// job-wide RAS, the proxy), at their stable DNS names and peer port.
    #[test]
    fn sidecars_peer_with_the_other_replicas() {
        let mut j = job("p", 3, 2);
        j.spec.sidecar.peer_port = 30001;
        let cmd = sidecar_command(&j, 1);
        let at = |flag: &str| {
            let i = cmd.iter().position(|a| a == flag).unwrap();
            cmd[i + 1].clone()
        };
        assert_eq!(at("--peer-listen"), "0.0.0.0:30001");
        assert_eq!(at("--peers"), "p-0.p.ml.svc:30001,p-2.p.ml.svc:30001");
        let pod = desired_pod(&j, 2, 0, &OperatorConfig::default());
        let sc = &pod.spec.unwrap().init_containers.unwrap()[0];
        let ports: Vec<i32> = sc
            .ports
            .as_ref()
            .unwrap()
            .iter()
            .map(|p| p.container_port)
            .collect();
        assert_eq!(ports, [29400, 9464, 30001]);
        let peers = sc.command.as_ref().unwrap().last().unwrap();
        assert_eq!(peers, "p-0.p.ml.svc:30001,p-1.p.ml.svc:30001");
    }

    /// ReplaceRank pods keep a recovery board (both containers name it) and
    /// share one process namespace; RestartJob pods do neither.
    #[test]
    fn replace_rank_pods_keep_a_board_and_share_processes() {
        let mut j = job("rr", 3, 1);
        let cfg = OperatorConfig::default();
        let plain = desired_pod(&j, 1, 0, &cfg).spec.unwrap();
        assert_eq!(plain.share_process_namespace, None);
        assert!(!env_of(&plain.containers[0]).contains_key("WEFT_RECOVERY_DIR"));
        j.spec.failure_policy.on_rank_failure = FailureAction::ReplaceRank;
        let pod = desired_pod_incarnation(&j, 1, 0, 2, &cfg).spec.unwrap();
        assert_eq!(pod.share_process_namespace, Some(true));
        let sidecar = &pod.init_containers.as_ref().unwrap()[0];
        for c in [&pod.containers[0], sidecar] {
            let e = env_of(c);
            assert_eq!(e["WEFT_RECOVERY_DIR"], BOARD_DIR);
            assert_eq!(e["WEFT_INCARNATION"], "2");
            assert!(BOARD_DIR.starts_with(SOCKET_DIR), "in the shared volume");
        }
        // A template that turns the shared namespace off keeps it off.
        j.spec
            .template
            .spec
            .as_mut()
            .unwrap()
            .share_process_namespace = Some(false);
        let pod = desired_pod(&j, 0, 0, &cfg).spec.unwrap();
        assert_eq!(pod.share_process_namespace, Some(false));
    }

    #[test]
    fn volumes_socket_shm_secret() {
        for (t, rpr, want) in [
            (Transport::Tcp, 1, "1280Mi"),
            (Transport::Tcp, 4, "2304Mi"),
            (Transport::Auto, 8, "8448Mi"),
            (Transport::Ib, 2, "2304Mi"),
        ] {
            let mut j = job("v", 1, rpr);
            j.spec.network.transport = t;
            let spec = desired_pod(&j, 0, 0, &OperatorConfig::default())
                .spec
                .unwrap();
            let vols = spec.volumes.unwrap();
            let shm = vols.iter().find(|v| v.name == "weft-shm").unwrap();
            let ed = shm.empty_dir.as_ref().unwrap();
            assert_eq!(ed.medium.as_deref(), Some("Memory"));
            assert_eq!(ed.size_limit.as_ref().unwrap().0, want, "{t:?} x{rpr}");
            assert!(
                vols.iter()
                    .any(|v| v.name == "weft-socket" && v.empty_dir.is_some())
            );
            let sec = vols.iter().find(|v| v.name == "weft-secret").unwrap();
            assert_eq!(
                sec.secret.as_ref().unwrap().secret_name.as_deref(),
                Some("v-weft-token-uid1")
            );
            for c in spec
                .containers
                .iter()
                .chain(spec.init_containers.iter().flatten())
            {
                let paths: Vec<_> = c
                    .volume_mounts
                    .iter()
                    .flatten()
                    .map(|m| m.mount_path.as_str())
                    .collect();
                assert_eq!(
                    paths,
                    ["/run/weft", "/dev/shm", "/etc/weft/secret"],
                    "{}",
                    c.name
                );
            }
        }
        let mut j = job("v", 1, 1);
        j.spec.network.shm_size = Some(Quantity("16Gi".into()));
        assert_eq!(shm_size(&j).0, "16Gi");
    }

    #[test]
    fn template_mounts_and_volumes_are_kept() {
        let mut j = job("k", 1, 1);
        let spec = j.spec.template.spec.as_mut().unwrap();
        spec.volumes = Some(vec![Volume {
            name: "data".into(),
            empty_dir: Some(EmptyDirVolumeSource::default()),
            ..Volume::default()
        }]);
        spec.containers[0].volume_mounts = Some(vec![mount("data", "/dev/shm", false)]);
        let spec = desired_pod(&j, 0, 0, &OperatorConfig::default())
            .spec
            .unwrap();
        let mounts = spec.containers[0].volume_mounts.as_ref().unwrap();
        // the user's /dev/shm wins, ours is not added twice
        assert_eq!(
            mounts.iter().filter(|m| m.mount_path == "/dev/shm").count(),
            1
        );
        assert_eq!(mounts[0].name, "data");
        assert_eq!(spec.volumes.unwrap().len(), 4);
    }

    #[test]
    fn gpu_requests_follow_the_template() {
        let mut j = job("g", 2, 8);
        j.spec.template.spec.as_mut().unwrap().containers[0].resources =
            Some(ResourceRequirements {
                limits: Some(BTreeMap::from([(
                    GPU_RESOURCE.into(),
                    Quantity("8".into()),
                )])),
                ..ResourceRequirements::default()
            });
        let spec = desired_pod(&j, 1, 0, &OperatorConfig::default())
            .spec
            .unwrap();
        let r = spec.containers[0].resources.as_ref().unwrap();
        assert_eq!(r.requests.as_ref().unwrap()[GPU_RESOURCE].0, "8");
        assert_eq!(r.limits.as_ref().unwrap()[GPU_RESOURCE].0, "8");
        // no GPUs asked for, none added
        let spec = desired_pod(&job("c", 1, 1), 0, 0, &OperatorConfig::default())
            .spec
            .unwrap();
        assert!(spec.containers[0].resources.is_none());
        let sc = &spec.init_containers.unwrap()[0];
        assert!(
            !sc.resources
                .as_ref()
                .unwrap()
                .requests
                .as_ref()
                .unwrap()
                .contains_key(GPU_RESOURCE)
        );
    }

    #[test]
    fn scheduling_and_kueue() {
        let mut j = job("q", 4, 1);
        j.spec.scheduling.queue = Some("team-a".into());
        j.spec.scheduling.scheduler_name = Some("volcano".into());
        j.spec.scheduling.priority_class_name = Some("high".into());
        j.spec.scheduling.node_selector = BTreeMap::from([("gpu".to_string(), "h100".to_string())]);
        j.spec.scheduling.tolerations = vec![Toleration {
            key: Some("nvidia.com/gpu".into()),
            operator: Some("Exists".into()),
            ..Toleration::default()
        }];
        j.spec.scheduling.topology_spread_constraints = vec![TopologySpreadConstraint {
            max_skew: 1,
            topology_key: "kubernetes.io/hostname".into(),
            when_unsatisfiable: "DoNotSchedule".into(),
            ..TopologySpreadConstraint::default()
        }];
        let pod = desired_pod(&j, 0, 3, &OperatorConfig::default());
        let l = pod.metadata.labels.unwrap();
        assert_eq!(l[KUEUE_QUEUE], "team-a");
        assert_eq!(l[KUEUE_POD_GROUP], "q-3");
        assert_eq!(pod.metadata.annotations.unwrap()[KUEUE_GROUP_COUNT], "4");
        let spec = pod.spec.unwrap();
        assert_eq!(spec.scheduler_name.as_deref(), Some("volcano"));
        assert_eq!(spec.priority_class_name.as_deref(), Some("high"));
        assert_eq!(spec.node_selector.unwrap()["gpu"], "h100");
        assert_eq!(spec.tolerations.unwrap().len(), 1);
        let tsc = &spec.topology_spread_constraints.unwrap()[0];
        assert_eq!(
            tsc.label_selector
                .as_ref()
                .unwrap()
                .match_labels
                .as_ref()
                .unwrap()[LABEL_JOB],
            "q"
        );
    }

    #[test]
    fn template_labels_and_init_containers_are_kept() {
        let mut j = job("t", 1, 1);
        j.spec.template = serde_json::from_value(serde_json::json!({
            "metadata": {"labels": {"team": "ml"}, "annotations": {"a": "b"}},
            "spec": {
                "initContainers": [{"name": "fetch", "image": "busybox"}],
                "containers": [{"name": "a", "image": "x"}, {"name": "b", "image": "y"}]
            }
        }))
        .unwrap();
        let _: &PodTemplateSpec = &j.spec.template;
        let pod = desired_pod(&j, 0, 0, &OperatorConfig::default());
        assert_eq!(pod.metadata.labels.unwrap()["team"], "ml");
        assert_eq!(pod.metadata.annotations.unwrap()["a"], "b");
        let spec = pod.spec.unwrap();
        let init: Vec<_> = spec
            .init_containers
            .unwrap()
            .iter()
            .map(|c| c.name.clone())
            .collect();
        assert_eq!(init, [SIDECAR_NAME, "fetch"]);
        for c in &spec.containers {
            assert_eq!(env_of(c)["WEFT_WORLD_SIZE"], "1");
        }
    }

    #[test]
    fn validation_rejects_what_the_schema_cannot() {
        assert!(validate(&job("ok", 2, 1)).is_ok());
        let long = "a".repeat(60);
        assert!(validate(&job(&long, 2, 1)).is_ok());
        let err = validate(&job(&long, 1000, 1)).unwrap_err();
        assert!(err.contains("exceeds 63"), "{err}");
        let mut j = job("rp", 1, 1);
        j.spec.template.spec.as_mut().unwrap().restart_policy = Some("OnFailure".into());
        assert!(validate(&j).unwrap_err().contains("restartPolicy"));
        let mut j = job("rp", 1, 1);
        j.spec.template.spec.as_mut().unwrap().containers[0].name = SIDECAR_NAME.into();
        assert!(validate(&j).unwrap_err().contains("reserved"));
        let mut j = job("rp", 1, 1);
        j.spec.template.spec.as_mut().unwrap().containers.clear();
        assert!(validate(&j).is_err());
        // Issue 19 (4): `a.b` is a valid object name but not a Service name.
        let err = validate(&job("a.b", 1, 1)).unwrap_err();
        assert!(err.contains("DNS-1035") && err.contains("'.'"), "{err}");
        assert!(validate(&job("a_b", 1, 1)).is_err());
        assert!(validate(&job("ab-", 1, 1)).is_err());
        assert!(validate(&job("a-1b", 1, 1)).is_ok());
    }
}
