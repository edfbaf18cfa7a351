//! The `CollectiveJob` custom resource (group `weft.dev`, version `v1alpha1`).
//!
//! The Rust types are the single source of truth: `crds/collectivejob.yaml` is
//! generated from them by `weft-operator crd` and a test fails when the
//! committed file is stale. Validation that the API server can do itself
//! (minimums, enums, CEL rules, defaults) lives in the schema so that a bad
//! spec is refused at `kubectl apply` time instead of surfacing later as a
//! failed job.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    PodTemplateSpec, ResourceRequirements, Toleration, TopologySpreadConstraint,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::json;

/// Group of every Weft API.
pub const GROUP: &str = "weft.dev";
/// Version of the `CollectiveJob` API.
pub const VERSION: &str = "v1alpha1";
/// Default port of the sidecar's bootstrap (rendezvous) listener, fixed by the
/// operator -> pod contract.
pub const DEFAULT_BOOTSTRAP_PORT: i32 = 29400;
/// Port torchrun uses for its own rendezvous; kept distinct from the bootstrap port.
pub const TORCH_MASTER_PORT: i32 = 29500;
/// Default port of the sidecar's Prometheus endpoint.
pub const DEFAULT_SIDECAR_METRICS_PORT: i32 = 9464;
/// Default port sidecars reach each other on (heartbeats, job-wide status,
/// the network proxy's one connection per pair of pods).
pub const DEFAULT_SIDECAR_PEER_PORT: i32 = 29401;

/// A distributed job whose ranks talk through Weft.
///
/// `replicas` pods are created, each running `ranksPerReplica` ranks (usually
/// one per GPU) next to a Weft sidecar. Pod `i` owns the global ranks
/// `[i * ranksPerReplica, (i + 1) * ranksPerReplica)`.
// Several printcolumns share a `type_`: not a duplicated attribute.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "weft.dev",
    version = "v1alpha1",
    kind = "CollectiveJob",
    namespaced,
    shortname = "cjob",
    category = "weft",
    status = "CollectiveJobStatus",
    derive = "PartialEq",
    printcolumn(name = "Phase", type_ = "string", json_path = ".status.phase"),
    printcolumn(
        name = "Ranks",
        type_ = "integer",
        description = "World size (replicas x ranksPerReplica)",
        json_path = ".status.worldSize"
    ),
    printcolumn(
        name = "Ready",
        type_ = "string",
        description = "Ready pods / replicas",
        json_path = ".status.ready"
    ),
    printcolumn(name = "Restarts", type_ = "integer", json_path = ".status.restarts"),
    printcolumn(
        name = "Replaced",
        type_ = "integer",
        description = "Failed pods replaced in place (onRankFailure: ReplaceRank)",
        json_path = ".status.replacements"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {
        "rule": "self.replicas * self.ranksPerReplica <= 65536",
        "message": "world size (replicas * ranksPerReplica) must be at most 65536"
    }
]))]
pub struct CollectiveJobSpec {
    /// Number of pods. Immutable: the world size is fixed for the life of the job.
    #[serde(default = "one")]
    #[schemars(range(min = 1, max = 4096))]
    #[schemars(extend("x-kubernetes-validations" = [{"rule": "self == oldSelf", "message": "replicas is immutable"}]))]
    pub replicas: i32,

    /// Ranks (processes, usually one per GPU) per pod. Immutable.
    #[serde(default = "one")]
    #[schemars(range(min = 1, max = 64))]
    #[schemars(extend("x-kubernetes-validations" = [{"rule": "self == oldSelf", "message": "ranksPerReplica is immutable"}]))]
    pub ranks_per_replica: i32,

    /// The workload's pod template. Every container in it gets the Weft
    /// environment; the Weft sidecar is added as a native sidecar.
    #[schemars(schema_with = "pod_template_schema")]
    pub template: PodTemplateSpec,

    /// The Weft sidecar injected into every pod.
    #[serde(default)]
    pub sidecar: SidecarSpec,

    /// How ranks reach each other.
    #[serde(default)]
    pub network: NetworkSpec,

    /// What happens when a rank fails.
    #[serde(default)]
    pub failure_policy: FailurePolicy,

    /// Suspension, deadlines and cleanup.
    #[serde(default)]
    pub run_policy: RunPolicy,

    /// Where and how the pods are scheduled.
    #[serde(default)]
    pub scheduling: SchedulingSpec,

    /// OpenTelemetry export; the operator's default endpoint is used when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub telemetry: Option<TelemetrySpec>,
}

fn one() -> i32 {
    1
}

/// Schema for `spec.template`: the real core/v1 PodTemplateSpec schema from
/// k8s-openapi, so that the API server refuses a template of the wrong shape
/// (`command: "sleep 1"` instead of a list) at `kubectl apply` time, instead of
/// the operator meeting an object it cannot decode.
///
/// The generated schema is trimmed to stay far below the 256 KiB annotation
/// limit of client-side `kubectl apply`: descriptions are dropped (they are
/// most of its size), `ephemeralContainers` (never set at creation) and the
/// template's `metadata` (only labels and annotations are used) are reduced.
/// Lists and names that CEL rules look at carry maxItems/maxLength because the
/// API server refuses a CRD whose rules have an unbounded estimated cost.
fn pod_template_schema(generator: &mut schemars::SchemaGenerator) -> schemars::Schema {
    let pod_spec = generator.subschema_for::<k8s_openapi::api::core::v1::PodSpec>();
    let mut spec = serde_json::to_value(pod_spec).expect("schema serialises");
    strip_descriptions(&mut spec);
    let props = spec["properties"]
        .as_object_mut()
        .expect("PodSpec schema has properties");
    props.remove("ephemeralContainers");
    let name = json!({"type": "string", "minLength": 1, "maxLength": 63});
    for list in ["containers", "initContainers"] {
        let l = &mut props[list];
        l["maxItems"] = json!(32);
        l["items"]["properties"]["name"] = name.clone();
    }
    props["containers"]["minItems"] = json!(1);
    props["containers"]["x-kubernetes-validations"] = json!([
        {"rule": "self.all(c, self.exists_one(d, d.name == c.name))", "message": "container names must be unique"},
        {"rule": "self.all(c, c.name != 'weft-sidecar')", "message": "the container name weft-sidecar is reserved for the injected sidecar"}
    ]);
    props["volumes"]["maxItems"] = json!(128);
    props["volumes"]["items"]["properties"]["name"] = json!({"type": "string", "maxLength": 63});
    props["volumes"]["items"]["x-kubernetes-validations"] = json!([
        {"rule": "!self.name.startsWith('weft-')", "message": "volume names starting with weft- are reserved for the operator"}
    ]);
    props["restartPolicy"] = json!({"type": "string", "enum": ["Never"], "description": "Only Never is accepted (and is the default): the operator handles a failed rank (failurePolicy)."});
    let string_map = json!({"type": "object", "additionalProperties": {"type": "string"}});
    schemars::Schema::try_from(json!({
        "description": "Pod template of the workload (a core/v1 PodTemplateSpec). restartPolicy is forced to Never: the operator handles a failed rank (failurePolicy) instead.",
        "type": "object",
        "required": ["spec"],
        "properties": {
            "metadata": {
                "type": "object",
                "properties": {"labels": string_map, "annotations": string_map},
                "x-kubernetes-preserve-unknown-fields": true
            },
            "spec": spec,
        }
    }))
    .expect("static schema is an object")
}

/// Drops every `description` of a generated schema (but not a property that
/// happens to be called "description").
fn strip_descriptions(v: &mut serde_json::Value) {
    match v {
        serde_json::Value::Object(m) => {
            if m.get("description").is_some_and(|d| d.is_string()) {
                m.remove("description");
            }
            for (k, child) in m.iter_mut() {
                if k == "properties" {
                    if let serde_json::Value::Object(props) = child {
                        props.values_mut().for_each(strip_descriptions);
                    }
                } else {
                    strip_descriptions(child);
                }
            }
        }
        serde_json::Value::Array(a) => a.iter_mut().for_each(strip_descriptions),
        _ => {}
    }
}

/// Log verbosity of the sidecar.
#[derive(Deserialize, Serialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum LogLevel {
    Error,
    Warn,
    #[default]
    Info,
    Debug,
    Trace,
}

impl LogLevel {
    pub fn as_str(self) -> &'static str {
        match self {
            LogLevel::Error => "error",
            LogLevel::Warn => "warn",
            LogLevel::Info => "info",
            LogLevel::Debug => "debug",
            LogLevel::Trace => "trace",
        }
    }
}

/// The Weft sidecar (`weft sidecar`), one per pod.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {"rule": "self.bootstrapPort != self.metricsPort", "message": "sidecar.bootstrapPort and sidecar.metricsPort must differ"},
    {"rule": "self.peerPort != self.bootstrapPort && self.peerPort != self.metricsPort", "message": "sidecar.peerPort must differ from sidecar.bootstrapPort and sidecar.metricsPort"},
    {"rule": "self.bootstrapPort != 29500 && self.metricsPort != 29500 && self.peerPort != 29500", "message": "port 29500 is reserved for torchrun (PET_MASTER_PORT)"}
]))]
pub struct SidecarSpec {
    /// Sidecar image; the operator's default (Helm value `sidecar.image`) when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    /// Image pull policy of the sidecar.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("enum" = ["Always", "IfNotPresent", "Never"]))]
    pub image_pull_policy: Option<String>,
    /// Resources of the sidecar container; 100m CPU / 128Mi requested when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceRequirements>,
    /// Port of the bootstrap listener (pod 0's is the job's rendezvous point).
    #[serde(default = "default_bootstrap_port")]
    #[schemars(range(min = 1024, max = 65535))]
    pub bootstrap_port: i32,
    /// Port of the sidecar's Prometheus endpoint (also /healthz, /readyz, /ras).
    #[serde(default = "default_metrics_port")]
    #[schemars(range(min = 1024, max = 65535))]
    pub metrics_port: i32,
    /// Port the pods' sidecars reach each other on: heartbeats, job-wide RAS
    /// and the network proxy (inter-pod traffic of the ranks).
    #[serde(default = "default_peer_port")]
    #[schemars(range(min = 1024, max = 65535))]
    pub peer_port: i32,
    /// Log level of the sidecar (`WEFT_LOG`).
    #[serde(default)]
    pub log_level: LogLevel,
}

fn default_bootstrap_port() -> i32 {
    DEFAULT_BOOTSTRAP_PORT
}
fn default_metrics_port() -> i32 {
    DEFAULT_SIDECAR_METRICS_PORT
}
fn default_peer_port() -> i32 {
    DEFAULT_SIDECAR_PEER_PORT
}

impl Default for SidecarSpec {
    fn default() -> Self {
        Self {
            image: None,
            image_pull_policy: None,
            resources: None,
            bootstrap_port: DEFAULT_BOOTSTRAP_PORT,
            metrics_port: DEFAULT_SIDECAR_METRICS_PORT,
            peer_port: DEFAULT_SIDECAR_PEER_PORT,
            log_level: LogLevel::Info,
        }
    }
}

/// Inter-pod transport.
#[derive(Deserialize, Serialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Transport {
    /// Pick the best available (RDMA when present, else TCP).
    #[default]
    Auto,
    Tcp,
    /// RDMA verbs (InfiniBand / RoCE).
    Ib,
}

impl Transport {
    pub fn as_str(self) -> &'static str {
        match self {
            Transport::Auto => "auto",
            Transport::Tcp => "tcp",
            Transport::Ib => "ib",
        }
    }
}

/// Network settings.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NetworkSpec {
    /// Transport between pods (`WEFT_TRANSPORT`).
    #[serde(default)]
    pub transport: Transport,
    /// Network interface to use (`WEFT_NET_IF`), e.g. `eth0` or `ib0`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 15))]
    pub interface: Option<String>,
    /// Size of the /dev/shm memory volume; derived from the transport and
    /// ranksPerReplica when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shm_size: Option<k8s_openapi::apimachinery::pkg::api::resource::Quantity>,
}

/// What to do when a rank fails.
#[derive(Deserialize, Serialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum FailureAction {
    /// Delete every pod and start them again with a new restart epoch.
    #[default]
    RestartJob,
    /// Mark the job Failed at the first rank failure.
    FailJob,
    /// Keep the job running: delete only the failed pod and create it again
    /// with the same name, replica index and ranks (a new `WEFT_INCARNATION`,
    /// the same `WEFT_RESTART_EPOCH`); the other pods are not touched. For
    /// programs that survive a lost rank (shrink, then grow back when the
    /// replacement joins). After `maxReplacements` replacements a failure
    /// restarts the whole job as `RestartJob` does (bounded by `maxRestarts`).
    ReplaceRank,
}

/// Failure handling. With `RestartJob` (the default) and `FailJob` a failure
/// acts on the whole job; with `ReplaceRank` on the failed pod only.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {"rule": "self.permanentExitCodes.all(c, c >= 1 && c <= 255)", "message": "permanentExitCodes must be between 1 and 255"}
]))]
pub struct FailurePolicy {
    /// How many times the whole job may be restarted before it is Failed.
    #[serde(default = "default_max_restarts")]
    #[schemars(range(min = 0, max = 1000))]
    pub max_restarts: i32,
    /// Action on a rank failure.
    #[serde(default)]
    pub on_rank_failure: FailureAction,
    /// With `onRankFailure: ReplaceRank`: how many failed pods may be replaced
    /// in place over the life of the job. A failure beyond it restarts the
    /// whole job (counted against `maxRestarts`; with `maxRestarts: 0` the
    /// job fails instead).
    #[serde(default = "default_max_replacements")]
    #[schemars(range(min = 0, max = 1000))]
    pub max_replacements: i32,
    /// Exit codes that mean "this will fail again": the job is Failed at once
    /// without using up restarts (e.g. a bad argument).
    #[serde(default)]
    #[schemars(length(max = 64))]
    pub permanent_exit_codes: Vec<i32>,
}

fn default_max_restarts() -> i32 {
    3
}

fn default_max_replacements() -> i32 {
    3
}

impl Default for FailurePolicy {
    fn default() -> Self {
        Self {
            max_restarts: default_max_restarts(),
            on_rank_failure: FailureAction::RestartJob,
            max_replacements: default_max_replacements(),
            permanent_exit_codes: Vec::new(),
        }
    }
}

/// Which pods to delete when the job finishes.
#[derive(Deserialize, Serialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum CleanPodPolicy {
    /// Keep every pod (for logs).
    None,
    /// Delete pods that are still running (e.g. the survivors of a failure).
    #[default]
    Running,
    /// Delete every pod.
    All,
}

/// Run policy.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RunPolicy {
    /// Suspend the job: its pods are deleted, and recreated (with a new epoch) on resume.
    #[serde(default)]
    pub suspend: bool,
    /// Fail the job when it has been running (not suspended) this long.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub active_deadline_seconds: Option<i64>,
    /// Delete the finished job (and with it its pods) this long after it finished.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub ttl_seconds_after_finished: Option<i32>,
    /// Pods to delete when the job finishes.
    #[serde(default)]
    pub clean_pod_policy: CleanPodPolicy,
}

/// Scheduling.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SchedulingSpec {
    /// Scheduler for the pods (e.g. a gang scheduler).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scheduler_name: Option<String>,
    /// PriorityClass of the pods.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority_class_name: Option<String>,
    /// Kueue LocalQueue: sets `kueue.x-k8s.io/queue-name` and makes the pods
    /// one Kueue pod group, admitted all together.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 63))]
    pub queue: Option<String>,
    /// Node selector merged into the template's.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub node_selector: BTreeMap<String, String>,
    /// Tolerations added to the template's.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tolerations: Vec<Toleration>,
    /// Topology spread constraints added to the template's. A `labelSelector`
    /// left empty selects this job's pods.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub topology_spread_constraints: Vec<TopologySpreadConstraint>,
}

/// Telemetry.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TelemetrySpec {
    /// OTLP endpoint (`OTEL_EXPORTER_OTLP_ENDPOINT`), e.g. `http://otel-collector.monitoring:4317`.
    #[schemars(length(min = 1))]
    pub otlp_endpoint: String,
}

/// Phase of a job.
#[derive(Deserialize, Serialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum JobPhase {
    /// Pods are being created or are not all running yet.
    Pending,
    /// Every pod is running; or, with `onRankFailure: ReplaceRank`, a failed
    /// pod is being replaced while the others keep running.
    Running,
    /// A rank failed; pods are being replaced with a new epoch.
    Restarting,
    /// Every workload container exited 0.
    Succeeded,
    /// The job failed for good (see the Failed condition).
    Failed,
    /// `runPolicy.suspend` is set; no pods exist.
    Suspended,
}

impl JobPhase {
    pub fn is_terminal(self) -> bool {
        matches!(self, JobPhase::Succeeded | JobPhase::Failed)
    }
    pub fn as_str(self) -> &'static str {
        match self {
            JobPhase::Pending => "Pending",
            JobPhase::Running => "Running",
            JobPhase::Restarting => "Restarting",
            JobPhase::Succeeded => "Succeeded",
            JobPhase::Failed => "Failed",
            JobPhase::Suspended => "Suspended",
        }
    }
}

/// One row of the rank table: which pod holds which ranks.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RankEntry {
    pub pod: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    pub first_rank: i32,
    pub ranks: i32,
    pub ready: bool,
    /// Pod phase as seen by the operator (`Missing` when it does not exist,
    /// `Replacing` while a failed pod's replacement is awaited).
    pub phase: String,
    /// The pod's incarnation in this epoch (`WEFT_INCARNATION`): bumped by
    /// each replacement (onRankFailure: ReplaceRank).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub incarnation: i32,
}

fn is_zero(n: &i32) -> bool {
    *n == 0
}

/// Where an in-place recovery (onRankFailure: ReplaceRank) stands.
#[derive(Deserialize, Serialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum RecoveryState {
    /// The failed pod is being deleted or its replacement is not ready yet.
    Replacing,
    /// The replacement pod is ready.
    Recovered,
    /// The replacement failed before it was ready; a new recovery follows
    /// (or the job restarts).
    ReplacementFailed,
    /// The job restarted, failed or was suspended before the replacement was ready.
    Abandoned,
}

/// One in-place recovery: a failed pod replaced by a new incarnation of the
/// same replica (same name, DNS name and ranks) while the others kept running.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RankRecovery {
    /// The pod (its name does not change).
    pub pod: String,
    pub replica_index: i32,
    /// The pod's first global rank, and how many ranks it holds.
    pub first_rank: i32,
    pub ranks: i32,
    /// Restart epoch in which it happened.
    pub epoch: i32,
    /// Incarnation of the replacement (`WEFT_INCARNATION`).
    pub incarnation: i32,
    /// Which replacement of the job this is (1 for the first; compare
    /// `failurePolicy.maxReplacements`).
    pub count: i32,
    /// Why the pod was replaced (`Error`, `OOMKilled`, `Evicted`, `PodDeleted`, ...).
    pub reason: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub message: String,
    pub state: RecoveryState,
    /// When the operator saw the failure.
    pub failed_at: Time,
    /// When the recovery ended (replacement ready, or given up).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ended_at: Option<Time>,
    /// Seconds from the failure to the replacement being ready (`Recovered` only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub time_lost_seconds: Option<i64>,
}

/// The rank failure that decided the last restart, replacement or the failure of the job.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RankFailure {
    pub pod: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
    /// Short machine-readable reason (`Error`, `OOMKilled`, `Evicted`, `PodDeleted`, ...).
    pub reason: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub message: String,
    /// Restart epoch in which it happened.
    pub epoch: i32,
}

/// Observed state of a `CollectiveJob`.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CollectiveJobStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<JobPhase>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    /// replicas x ranksPerReplica.
    #[serde(default)]
    pub world_size: i32,
    /// Pods whose Ready condition is true.
    #[serde(default)]
    pub ready_replicas: i32,
    /// `readyReplicas/replicas`, for `kubectl get`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready: Option<String>,
    /// Whole-job restarts so far.
    #[serde(default)]
    pub restarts: i32,
    /// Failed pods replaced in place so far (onRankFailure: ReplaceRank),
    /// over the life of the job.
    #[serde(default)]
    pub replacements: i32,
    /// In-place recoveries: every one in progress and the latest ended ones
    /// (at most 20 records; `replacements` keeps the count).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub recoveries: Vec<RankRecovery>,
    /// Epoch of the current set of pods (`WEFT_RESTART_EPOCH`); bumped by every
    /// restart and every suspension.
    #[serde(default)]
    pub restart_epoch: i32,
    /// Epoch whose pods have all been created. A pod of this epoch that
    /// disappears was deleted behind our back and counts as a rank failure.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub launched_epoch: Option<i32>,
    /// Pod -> rank assignment.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ranks: Vec<RankEntry>,
    /// `WEFT_BOOTSTRAP` given to every pod.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bootstrap_endpoint: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_failure: Option<RankFailure>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_time: Option<Time>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completion_time: Option<Time>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
}

impl CollectiveJob {
    pub fn phase(&self) -> Option<JobPhase> {
        self.status.as_ref().and_then(|s| s.phase)
    }
}

/// The CRD's OpenAPI v3 schema as JSON: what the API server validates a
/// CollectiveJob against and evaluates its CEL rules on.
pub fn crd_schema() -> serde_json::Value {
    use kube::CustomResourceExt;
    let crd = CollectiveJob::crd();
    let schema = crd.spec.versions[0].schema.as_ref();
    serde_json::to_value(&schema.expect("the CRD has a schema").open_api_v3_schema)
        .expect("the schema serialises")
}

/// The CRD as YAML, exactly as committed in `crds/collectivejob.yaml`.
pub fn crd_yaml() -> String {
    use kube::CustomResourceExt;
    let body = serde_yaml::to_string(&CollectiveJob::crd()).expect("CRD serialises");
    format!(
        "# Generated by `weft-operator crd` from operator/src/crd.rs. Do not edit by hand.\n{body}"
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::CustomResourceExt;

    #[test]
    fn crd_identity() {
        let crd = CollectiveJob::crd();
        assert_eq!(crd.spec.group, "weft.dev");
        assert_eq!(crd.spec.scope, "Namespaced");
        assert_eq!(crd.spec.names.kind, "CollectiveJob");
        assert_eq!(crd.spec.names.plural, "collectivejobs");
        assert_eq!(crd.spec.names.short_names, Some(vec!["cjob".to_string()]));
        let v = &crd.spec.versions[0];
        assert_eq!(v.name, "v1alpha1");
        assert!(v.subresources.as_ref().unwrap().status.is_some());
        let cols: Vec<_> = v
            .additional_printer_columns
            .as_ref()
            .unwrap()
            .iter()
            .map(|c| c.name.as_str())
            .collect();
        assert_eq!(
            cols,
            ["Phase", "Ranks", "Ready", "Restarts", "Replaced", "Age"]
        );
    }

    #[test]
    fn schema_has_minimums_enums_defaults_and_cel() {
        let s = crd_schema();
        let spec = &s["properties"]["spec"];
        assert_eq!(
            spec["properties"]["replicas"]["minimum"].as_f64(),
            Some(1.0)
        );
        assert_eq!(spec["properties"]["replicas"]["default"], 1);
        assert_eq!(
            spec["properties"]["ranksPerReplica"]["minimum"].as_f64(),
            Some(1.0)
        );
        let mut transports: Vec<_> =
            spec["properties"]["network"]["properties"]["transport"]["enum"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_str().unwrap())
                .collect();
        transports.sort();
        assert_eq!(transports, ["auto", "ib", "tcp"]);
        assert_eq!(
            spec["properties"]["failurePolicy"]["properties"]["onRankFailure"]["enum"],
            json!(["RestartJob", "FailJob", "ReplaceRank"])
        );
        let fp = &spec["properties"]["failurePolicy"]["properties"];
        assert_eq!(fp["maxReplacements"]["default"], 3);
        assert_eq!(fp["maxReplacements"]["minimum"].as_f64(), Some(0.0));
        assert_eq!(
            spec["properties"]["runPolicy"]["properties"]["cleanPodPolicy"]["default"],
            "Running"
        );
        assert_eq!(
            spec["properties"]["sidecar"]["properties"]["bootstrapPort"]["default"],
            29400
        );
        assert_eq!(spec["required"], json!(["template"]));
        let text = s.to_string();
        for rule in [
            "self.replicas * self.ranksPerReplica <= 65536",
            "self.bootstrapPort != self.metricsPort",
            "replicas is immutable",
            "container names must be unique",
        ] {
            assert!(text.contains(rule), "missing CEL rule {rule}");
        }
    }

    /// Issue 19 (1): `command: "sleep 1"` (a string, not a list) was accepted
    /// by the API server and then broke the operator's list of every job.
    #[test]
    fn pod_template_is_typed() {
        let s = crd_schema();
        let tmpl = &s["properties"]["spec"]["properties"]["template"];
        let pod = &tmpl["properties"]["spec"];
        assert!(
            pod.get("x-kubernetes-preserve-unknown-fields").is_none(),
            "the pod spec is typed, not preserved: {pod}"
        );
        let c = &pod["properties"]["containers"];
        assert_eq!(c["type"], "array");
        assert_eq!(c["minItems"], 1);
        let props = &c["items"]["properties"];
        assert_eq!(props["command"]["type"], "array");
        assert_eq!(props["command"]["items"]["type"], "string");
        assert_eq!(props["args"]["type"], "array");
        assert_eq!(props["image"]["type"], "string");
        assert_eq!(
            props["env"]["items"]["properties"]["value"]["type"],
            "string"
        );
        assert_eq!(
            props["resources"]["properties"]["limits"]["additionalProperties"]["x-kubernetes-int-or-string"],
            true,
            "quantities accept 1 as well as \"1\""
        );
        assert_eq!(
            pod["properties"]["initContainers"]["items"]["properties"]["command"]["type"],
            "array"
        );
        assert_eq!(
            pod["properties"]["volumes"]["items"]["properties"]["emptyDir"]["type"],
            "object"
        );
        assert_eq!(pod["properties"]["restartPolicy"]["enum"], json!(["Never"]));
        assert_eq!(pod["required"], json!(["containers"]));
        // CEL rules need bounded lists and names.
        assert_eq!(c["maxItems"], 32);
        assert_eq!(props["name"]["maxLength"], 63);
        assert!(!s.to_string().contains("\"$ref\""), "schema is inlined");
    }

    #[test]
    fn spec_defaults_from_minimal_yaml() {
        let job: CollectiveJob = serde_yaml::from_str(
            r#"
apiVersion: weft.dev/v1alpha1
kind: CollectiveJob
metadata: {name: j, namespace: ns}
spec:
  template:
    spec:
      containers: [{name: main, image: busybox}]
"#,
        )
        .unwrap();
        assert_eq!(job.spec.replicas, 1);
        assert_eq!(job.spec.ranks_per_replica, 1);
        assert_eq!(job.spec.sidecar.bootstrap_port, 29400);
        assert_eq!(job.spec.failure_policy.max_restarts, 3);
        assert_eq!(job.spec.failure_policy.max_replacements, 3);
        assert_eq!(
            job.spec.failure_policy.on_rank_failure,
            FailureAction::RestartJob
        );
        assert_eq!(
            job.spec.run_policy.clean_pod_policy,
            CleanPodPolicy::Running
        );
        assert_eq!(job.spec.network.transport, Transport::Auto);
    }

    #[test]
    fn crd_is_small_enough_for_client_side_apply() {
        // kubectl apply (client side) stores the object in a 256 KiB annotation.
        assert!(
            crd_yaml().len() < 200 * 1024,
            "CRD is {} bytes",
            crd_yaml().len()
        );
    }
}
