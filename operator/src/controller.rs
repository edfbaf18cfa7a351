//! The controller: watches CollectiveJobs and the Pods, Services and Secrets
//! they own, and executes the plans computed by `policy::plan`.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{ObjectReference, Pod, Secret, Service};
use k8s_openapi::api::events::v1::{Event as K8sEvent, EventSeries};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams,
};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::finalizer::{Event as Finalizer, finalizer};
use kube::runtime::{WatchStreamExt, reflector, watcher};
use kube::{Client, Resource, ResourceExt};
use serde_json::json;
use tracing::{info, warn};

use crate::crd::{CollectiveJob, JobPhase};
use crate::policy::{self, Plan};
use crate::resources::{
    self, LABEL_MANAGED_BY, MANAGER, OperatorConfig, desired_pod_incarnation, desired_secret,
    desired_service,
};
use crate::telemetry::http::Readiness;
use crate::telemetry::metrics::Metrics;

/// Finalizer on every CollectiveJob: its pods are deleted (releasing GPUs at
/// once) and an event recorded before the job goes away.
pub const FINALIZER: &str = "weft.dev/cleanup";
/// Field manager of every server-side apply.
pub const FIELD_MANAGER: &str = "weft-operator";

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    #[error("finalizer: {0}")]
    Finalizer(#[source] Box<kube::runtime::finalizer::Error<Error>>),
    #[error("CollectiveJob has no namespace")]
    MissingNamespace,
}

impl Error {
    /// Short label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            Error::Kube(_) => "kube",
            Error::Finalizer(e) => match e.as_ref() {
                kube::runtime::finalizer::Error::ApplyFailed(_) => "apply",
                kube::runtime::finalizer::Error::CleanupFailed(_) => "cleanup",
                _ => "finalizer",
            },
            Error::MissingNamespace => "namespace",
        }
    }
}

pub type Clock = Arc<dyn Fn() -> Timestamp + Send + Sync>;

/// Shared by every reconciliation.
pub struct Context {
    pub client: Client,
    pub events: Events,
    pub config: OperatorConfig,
    pub metrics: Arc<Metrics>,
    /// Injected so that tests can move time (deadlines, TTL).
    pub clock: Clock,
    /// `/readyz`: the controller marks whether its CollectiveJob watch works.
    pub readiness: Arc<Readiness>,
    /// Failed gang creations per job uid (retry backoff).
    create_failures: Mutex<HashMap<String, CreateBackoff>>,
    /// (uid, resourceVersion) of undecodable jobs already reported.
    reported_undecodable: Mutex<HashSet<(String, String)>>,
}

impl Context {
    pub fn new(client: Client, config: OperatorConfig, metrics: Arc<Metrics>) -> Self {
        let instance = weft_contract::params::POD_NAME
            .raw()
            .unwrap_or_else(|| "weft-operator".into());
        Self::with_clock(client, config, metrics, Arc::new(Timestamp::now), instance)
    }

    pub fn with_clock(
        client: Client,
        config: OperatorConfig,
        metrics: Arc<Metrics>,
        clock: Clock,
        instance: String,
    ) -> Self {
        Self {
            events: Events::new(client.clone(), instance),
            client,
            config,
            metrics,
            clock,
            readiness: Arc::default(),
            create_failures: Mutex::default(),
            reported_undecodable: Mutex::default(),
        }
    }

    /// Records a failed gang creation; returns the delay before the next
    /// attempt (5 s after the first failure, doubling, at most 5 min).
    fn backoff(&self, job: &CollectiveJob) -> Duration {
        let mut m = self.create_failures.lock().unwrap();
        let b = m
            .entry(job.uid().unwrap_or_default())
            .or_insert(CreateBackoff {
                failures: 0,
                generation: job.metadata.generation,
                retry_at: (self.clock)(),
            });
        b.failures += 1;
        b.generation = job.metadata.generation;
        let delay = Duration::from_secs((5u64 << (b.failures - 1).min(6)).min(300));
        b.retry_at = Timestamp::from_second((self.clock)().as_second() + delay.as_secs() as i64)
            .unwrap_or_else(|_| (self.clock)());
        delay
    }

    /// While a failed gang creation backs off: the time left. A spec change
    /// (new generation) ends the backoff at once.
    fn backing_off(&self, job: &CollectiveJob) -> Option<Duration> {
        let m = self.create_failures.lock().unwrap();
        let b = m.get(&job.uid().unwrap_or_default())?;
        if b.generation != job.metadata.generation {
            return None;
        }
        let left = b.retry_at.as_second() - (self.clock)().as_second();
        (left > 0).then(|| Duration::from_secs(left as u64))
    }

    fn reset_backoff(&self, uid: &str) {
        self.create_failures.lock().unwrap().remove(uid);
    }
}

/// Backoff state of a job whose gang could not be created.
struct CreateBackoff {
    failures: u32,
    /// The job's generation at the last failure.
    generation: Option<i64>,
    /// No new attempt before this time.
    retry_at: Timestamp,
}

/// Kubernetes Events (events.k8s.io/v1) on the objects the operator manages.
///
/// Unlike kube's `Recorder`, which folds every repeat of a reason into one
/// Event and so keeps its first note ("RankFailed x3" naming the first failure
/// only), an Event here is a series only while its note is identical: a new
/// note is a new Event.
pub struct Events {
    client: Client,
    controller: String,
    instance: String,
    cache: tokio::sync::Mutex<HashMap<EventKey, (String, i32, Timestamp)>>,
}

/// (object uid, type, reason, note) of an Event series; the cache maps it to
/// (event name, count, last seen).
type EventKey = (String, String, String, String);

/// How long a repeated Event is counted in the same series (as client-go).
const EVENT_SERIES_WINDOW_SECS: i64 = 6 * 60;

impl Events {
    pub fn new(client: Client, instance: String) -> Self {
        Self {
            client,
            controller: "weft.dev/weft-operator".into(),
            instance,
            cache: tokio::sync::Mutex::default(),
        }
    }

    pub async fn publish(
        &self,
        regarding: &ObjectReference,
        warning: bool,
        reason: &str,
        action: &str,
        note: &str,
    ) -> Result<(), kube::Error> {
        let now = Timestamp::now();
        let ns = regarding
            .namespace
            .clone()
            .unwrap_or_else(|| "default".into());
        let api: Api<K8sEvent> = Api::namespaced(self.client.clone(), &ns);
        let type_ = if warning { "Warning" } else { "Normal" };
        let note: String = note.chars().take(1000).collect();
        let key = (
            regarding.uid.clone().unwrap_or_default(),
            type_.to_string(),
            reason.to_string(),
            note.clone(),
        );
        let mut cache = self.cache.lock().await;
        cache.retain(|_, (_, _, t)| now.as_second() - t.as_second() < EVENT_SERIES_WINDOW_SECS);
        if let Some((name, count, when)) = cache.get_mut(&key) {
            *count += 1;
            *when = now;
            let patch = json!({"series": EventSeries {
                count: *count,
                last_observed_time: MicroTime(now),
            }});
            api.patch(name, &PatchParams::default(), &Patch::Merge(&patch))
                .await?;
            return Ok(());
        }
        let name = format!(
            "{}.{:x}",
            regarding.name.as_deref().unwrap_or("weft-operator"),
            now.as_nanosecond()
        );
        let ev = K8sEvent {
            metadata: ObjectMeta {
                name: Some(name.clone()),
                namespace: Some(ns),
                ..ObjectMeta::default()
            },
            event_time: Some(MicroTime(now)),
            action: Some(action.into()),
            reason: Some(reason.into()),
            note: Some(note),
            regarding: Some(regarding.clone()),
            reporting_controller: Some(self.controller.clone()),
            reporting_instance: Some(self.instance.clone()),
            type_: Some(type_.into()),
            ..K8sEvent::default()
        };
        api.create(&PostParams::default(), &ev).await?;
        cache.insert(key, (name, 1, now));
        Ok(())
    }
}

pub async fn reconcile(job: Arc<CollectiveJob>, ctx: Arc<Context>) -> Result<Action, Error> {
    let _timer = ctx.metrics.reconcile_started();
    let ns = job.namespace().ok_or(Error::MissingNamespace)?;
    let jobs: Api<CollectiveJob> = Api::namespaced(ctx.client.clone(), &ns);
    let res = finalizer(&jobs, FINALIZER, job, |event| async {
        match event {
            Finalizer::Apply(job) => apply(&job, &ctx).await,
            Finalizer::Cleanup(job) => cleanup(&job, &ctx).await,
        }
    })
    .await;
    use kube::runtime::finalizer::Error as FinErr;
    match res {
        Ok(a) => Ok(a),
        // The job is already gone (a second reconcile of a deleted job, queued
        // from a cache that still had it): nothing left to do, not an error.
        Err(
            FinErr::RemoveFinalizer(kube::Error::Api(s))
            | FinErr::AddFinalizer(kube::Error::Api(s)),
        ) if s.is_not_found() => Ok(Action::await_change()),
        Err(e) => Err(Error::Finalizer(Box::new(e))),
    }
}

pub fn error_policy(job: Arc<CollectiveJob>, error: &Error, ctx: Arc<Context>) -> Action {
    warn!(job = %job.name_any(), %error, "reconcile failed");
    ctx.metrics.reconcile_failed(error.kind());
    Action::requeue(Duration::from_secs(15))
}

/// Pods carrying the job's label that it actually owns (a job deleted and
/// recreated under the same name must not adopt its predecessor's pods).
async fn owned_pods(job: &CollectiveJob, pods: &Api<Pod>) -> Result<Vec<Pod>, kube::Error> {
    let uid = job.uid();
    let list = pods
        .list(&ListParams::default().labels(&resources::pod_selector(job)))
        .await?;
    Ok(list
        .items
        .into_iter()
        .filter(|p| {
            p.owner_references()
                .iter()
                .any(|o| Some(&o.uid) == uid.as_ref())
        })
        .collect())
}

/// How an API error from creating the job's objects is handled.
#[derive(Debug, PartialEq, Eq)]
pub enum ApiErrorClass {
    /// 400, 422: the object built from the job is wrong; retrying cannot
    /// help. The job fails with the server's message.
    Permanent,
    /// 403 (ResourceQuota, a missing PriorityClass, an admission webhook),
    /// 404 (namespace being deleted), 409 (a conflict that is not "already
    /// exists"), 429: may pass. Condition + event, then retry with backoff.
    Blocked(&'static str),
    /// Anything else (5xx, timeouts, connection errors): a plain reconcile
    /// error, retried by the controller.
    Retry,
}

pub fn classify_api_error(e: &kube::Error) -> ApiErrorClass {
    let kube::Error::Api(s) = e else {
        return ApiErrorClass::Retry;
    };
    match s.code {
        400 | 422 => ApiErrorClass::Permanent,
        403 if s.message.contains("exceeded quota") => ApiErrorClass::Blocked("QuotaExceeded"),
        403 => ApiErrorClass::Blocked("Forbidden"),
        404 => ApiErrorClass::Blocked("NotFound"),
        409 => ApiErrorClass::Blocked("Conflict"),
        429 => ApiErrorClass::Blocked("TooManyRequests"),
        _ => ApiErrorClass::Retry,
    }
}

/// A failed write while executing a plan: which object, and the pods this
/// pass had already created (the gang to roll back).
struct ExecError {
    what: &'static str,
    error: kube::Error,
    created: Vec<String>,
}

async fn apply(cached: &CollectiveJob, ctx: &Context) -> Result<Action, Error> {
    let ns = resources::namespace(cached);
    let name = cached.name_any();
    let uid = cached.uid().unwrap_or_default();
    // Decide from the job as it is now, not as the watch cache last saw it: a
    // stale status (an epoch behind, startTime not yet seen) would delete the
    // current pods or erase fields. The status write below is conditional on
    // this read's resourceVersion, which closes the remaining window.
    let jobs: Api<CollectiveJob> = Api::namespaced(ctx.client.clone(), &ns);
    let fresh = match jobs.get_opt(&name).await? {
        Some(j) if j.uid() == cached.uid() => j,
        // Deleted, or re-created under the same name: its own event follows.
        _ => return Ok(Action::await_change()),
    };
    let job = &fresh;
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), &ns);
    let current = owned_pods(job, &pods).await?;
    let mut plan = policy::plan(job, &current, (ctx.clock)());
    let creating = !plan.create_pods.is_empty();
    // The last attempt to create the gang was refused and rolled back: wait
    // out the backoff. Without this gate the rollback's own pod deletions and
    // status write would trigger the next attempt at once, in a tight loop.
    if creating && let Some(left) = ctx.backing_off(job) {
        return Ok(Action::requeue(left));
    }

    let executed = async {
        if plan.ensure_base {
            ensure_base(job, ctx, creating)
                .await
                .map_err(|(what, error)| ExecError {
                    what,
                    error,
                    created: vec![],
                })?;
        }
        execute_pods(job, ctx, &pods, &plan).await
    }
    .await;
    match executed {
        Ok(()) => {
            if creating {
                ctx.reset_backoff(&uid);
            }
        }
        Err(ExecError {
            what,
            error,
            created,
        }) => {
            let class = classify_api_error(&error);
            if class == ApiErrorClass::Retry {
                // Nothing is known to be wrong with the job: retried as a
                // reconcile error; a partial gang is completed next time.
                return Err(error.into());
            }
            let message = match &error {
                kube::Error::Api(s) => s.message.clone(),
                e => e.to_string(),
            };
            // All-or-nothing: no partial gang holds quota or GPUs. A
            // replacement of a failed pod is not a gang: the running pods stay.
            let rolled_back = if creating && !plan.replacements_only {
                rollback_gang(job, ctx, &pods, &current, &created).await
            } else {
                0
            };
            warn!(job = %name, namespace = %ns, object = what, error = %message, "the API server refused a write");
            match class {
                ApiErrorClass::Permanent => {
                    policy::api_refused(job, &mut plan, what, &message, (ctx.clock)())
                }
                ApiErrorClass::Blocked(reason) => {
                    let retry_in = ctx.backoff(job);
                    let message = format!("{what}: {message}");
                    policy::creation_blocked(
                        job,
                        &mut plan,
                        reason,
                        &message,
                        rolled_back,
                        retry_in,
                        (ctx.clock)(),
                    );
                }
                ApiErrorClass::Retry => unreachable!(),
            }
        }
    }

    let old_phase = job.phase();
    if job.status.as_ref() != Some(&plan.status) {
        // resourceVersion makes the apply conditional: a plan computed from a
        // stale view of the job (an old cache entry) cannot overwrite a newer
        // status, e.g. erase startTime and launchedEpoch written meanwhile.
        let mut patch = json!({
            "apiVersion": format!("{}/{}", crate::crd::GROUP, crate::crd::VERSION),
            "kind": "CollectiveJob",
            "status": plan.status,
        });
        if let Some(rv) = job.resource_version() {
            patch["metadata"] = json!({ "resourceVersion": rv });
        }
        match jobs
            .patch_status(
                &name,
                &PatchParams::apply(FIELD_MANAGER).force(),
                &Patch::Apply(&patch),
            )
            .await
        {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.is_conflict() => {
                info!(job = %name, namespace = %ns, "job changed since it was read; reconciling again");
                return Ok(Action::requeue(Duration::from_secs(1)));
            }
            Err(e) => return Err(e.into()),
        }
    }
    if let Some(new) = plan.status.phase
        && old_phase != Some(new)
    {
        info!(job = %name, namespace = %ns, from = ?old_phase, to = ?new, "phase transition");
        ctx.metrics
            .phase_transitions
            .get_or_create(&crate::telemetry::metrics::PhaseLabels {
                phase: new.as_str().into(),
            })
            .inc();
        if new == JobPhase::Restarting {
            ctx.metrics.job_restarts.inc();
        }
    }
    let old_replacements = job.status.as_ref().map_or(0, |s| s.replacements);
    if plan.status.replacements > old_replacements {
        ctx.metrics
            .rank_replacements
            .inc_by((plan.status.replacements - old_replacements) as u64);
    }
    publish(job, ctx, &plan).await;

    if plan.delete_job {
        match jobs.delete(&name, &DeleteParams::background()).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.is_not_found() => {}
            Err(e) => return Err(e.into()),
        }
        return Ok(Action::await_change());
    }
    Ok(Action::requeue(
        plan.requeue_after.unwrap_or(Duration::from_secs(300)),
    ))
}

/// Deletes the pods of the gang being created: those this pass created and
/// those of the same (incomplete) epoch left by an earlier pass. Returns how
/// many were deleted. Best effort: a pod that cannot be deleted now is an old
/// epoch's pod on the next pass, which deletes it.
async fn rollback_gang(
    job: &CollectiveJob,
    ctx: &Context,
    pods: &Api<Pod>,
    current: &[Pod],
    created: &[String],
) -> usize {
    let epoch = job
        .status
        .as_ref()
        .map_or(0, |s| s.restart_epoch)
        .to_string();
    let mut names: Vec<String> = created.to_vec();
    for p in current {
        let same_epoch = p.labels().get(resources::LABEL_EPOCH) == Some(&epoch);
        if same_epoch && p.metadata.deletion_timestamp.is_none() && !names.contains(&p.name_any()) {
            names.push(p.name_any());
        }
    }
    let mut deleted = 0;
    for n in &names {
        match pods.delete(n, &DeleteParams::background()).await {
            Ok(_) => {
                deleted += 1;
                ctx.metrics.pods_deleted.inc();
            }
            Err(kube::Error::Api(s)) if s.is_not_found() => {}
            Err(e) => warn!(pod = %n, error = %e, "could not delete a pod of a partial gang"),
        }
    }
    deleted
}

/// Headless Service (server-side apply, so edits by others to fields we do
/// not own survive) and, before pods are created, the job Secret. The Secret
/// is create-only (a new token would split a running job); its name carries
/// the job's uid, so "already exists" means it is this job's, and the
/// operator needs no read access to Secrets.
async fn ensure_base(
    job: &CollectiveJob,
    ctx: &Context,
    creating_pods: bool,
) -> Result<(), (&'static str, kube::Error)> {
    let ns = resources::namespace(job);
    let services: Api<Service> = Api::namespaced(ctx.client.clone(), &ns);
    let svc = desired_service(job);
    services
        .patch(
            &resources::service_name(job),
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(&svc),
        )
        .await
        .map_err(|e| ("Service", e))?;
    if creating_pods {
        let secrets: Api<Secret> = Api::namespaced(ctx.client.clone(), &ns);
        let secret = desired_secret(job, &resources::random_token());
        match secrets.create(&PostParams::default(), &secret).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.is_already_exists() => {}
            Err(e) => return Err(("Secret", e)),
        }
    }
    Ok(())
}

async fn execute_pods(
    job: &CollectiveJob,
    ctx: &Context,
    pods: &Api<Pod>,
    plan: &Plan,
) -> Result<(), ExecError> {
    let fail = |error, created: &[String]| ExecError {
        what: "Pod",
        error,
        created: created.to_vec(),
    };
    for name in &plan.delete_pods {
        match pods.delete(name, &DeleteParams::background()).await {
            Ok(_) => {
                ctx.metrics.pods_deleted.inc();
            }
            Err(kube::Error::Api(s)) if s.is_not_found() => {}
            Err(e) => return Err(fail(e, &[])),
        }
    }
    for name in &plan.force_delete_pods {
        warn!(pod = %name, "force-deleting a pod stuck terminating (lost node?)");
        let dp = DeleteParams {
            grace_period_seconds: Some(0),
            ..DeleteParams::background()
        };
        match pods.delete(name, &dp).await {
            Ok(_) => {
                ctx.metrics.pods_deleted.inc();
            }
            Err(kube::Error::Api(s)) if s.is_not_found() => {}
            Err(e) => return Err(fail(e, &[])),
        }
    }
    let mut created = vec![];
    for index in &plan.create_pods {
        let pod = desired_pod_incarnation(
            job,
            *index,
            plan.status.restart_epoch,
            plan.incarnation(*index),
            &ctx.config,
        );
        match pods.create(&PostParams::default(), &pod).await {
            Ok(_) => {
                ctx.metrics.pods_created.inc();
                created.push(pod.name_any());
            }
            // Created by a previous, interrupted reconcile: the next one sees it.
            Err(kube::Error::Api(s)) if s.is_already_exists() => {}
            Err(e) => return Err(fail(e, &created)),
        }
    }
    Ok(())
}

/// Events are best effort: a failed publish is logged, never retried by
/// failing the reconcile (the status is the record of truth).
async fn publish(job: &CollectiveJob, ctx: &Context, plan: &Plan) {
    let oref = job.object_ref(&());
    for ev in &plan.events {
        if let Err(e) = ctx
            .events
            .publish(&oref, ev.warning, &ev.reason, &ev.action, &ev.note)
            .await
        {
            warn!(job = %job.name_any(), reason = %ev.reason, error = %e, "could not publish event");
        }
    }
}

async fn cleanup(job: &CollectiveJob, ctx: &Context) -> Result<Action, Error> {
    ctx.reset_backoff(&job.uid().unwrap_or_default());
    let ns = resources::namespace(job);
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), &ns);
    let current = owned_pods(job, &pods).await?;
    let mut deleted = 0;
    for p in current
        .iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
    {
        match pods
            .delete(&p.name_any(), &DeleteParams::background())
            .await
        {
            Ok(_) => deleted += 1,
            Err(kube::Error::Api(s)) if s.is_not_found() => {}
            Err(e) => return Err(e.into()),
        }
    }
    ctx.metrics.pods_deleted.inc_by(deleted);
    let plan = Plan {
        events: vec![policy::PlannedEvent {
            warning: false,
            reason: "Deleting".into(),
            action: "Cleanup".into(),
            note: format!("CollectiveJob deleted; deleted {deleted} pod(s)"),
        }],
        ..Plan::default()
    };
    publish(job, ctx, &plan).await;
    Ok(Action::await_change())
}

/// Decodes one watched object. A CollectiveJob that does not decode (e.g.
/// created before the CRD typed the pod template, or by a newer operator)
/// is reported on the object itself and left out; it never stops the watch
/// of the others, which a typed `Api<CollectiveJob>` list would.
fn decode(obj: DynamicObject, ctx: &Arc<Context>, report: bool) -> Option<CollectiveJob> {
    let value = match serde_json::to_value(&obj) {
        Ok(v) => v,
        Err(e) => {
            warn!(error = %e, "cannot serialise a watched object");
            return None;
        }
    };
    match serde_json::from_value::<CollectiveJob>(value) {
        Ok(job) => Some(job),
        Err(e) if report => {
            let ctx = ctx.clone();
            let msg = e.to_string();
            tokio::spawn(async move { report_undecodable(&ctx, &obj, &msg).await });
            None
        }
        Err(e) => {
            warn!(job = %obj.name_any(), error = %e, "cannot decode a deleted CollectiveJob");
            None
        }
    }
}

/// Marks an undecodable job: a `Decodable=False` condition with the decode
/// error (merge patch of the status subresource, which needs no decoding) and
/// a Warning event. Once per resourceVersion, and not again while the
/// condition already says the same.
pub async fn report_undecodable(ctx: &Context, obj: &DynamicObject, error: &str) {
    let name = obj.name_any();
    let ns = obj.namespace().unwrap_or_else(|| "default".into());
    let uid = obj.uid().unwrap_or_default();
    let rv = obj.resource_version().unwrap_or_default();
    if !ctx
        .reported_undecodable
        .lock()
        .unwrap()
        .insert((uid.clone(), rv))
    {
        return;
    }
    let message = format!(
        "the operator cannot read this CollectiveJob, so it is not run: {error}. \
         Fix the spec (kubectl edit) or delete and re-create it."
    );
    warn!(job = %name, namespace = %ns, %error, "cannot decode a CollectiveJob; skipping it");
    ctx.metrics.reconcile_failed("decode");
    let mut conditions: Vec<serde_json::Value> = obj.data["status"]["conditions"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let already = conditions.iter().any(|c| {
        c["type"] == policy::COND_DECODABLE && c["message"].as_str() == Some(message.as_str())
    });
    if already {
        // Reported before (this is the update our own status patch caused).
        return;
    }
    conditions.retain(|c| c["type"] != policy::COND_DECODABLE);
    conditions.push(json!({
        "type": policy::COND_DECODABLE,
        "status": "False",
        "reason": "InvalidObject",
        "message": message,
        "lastTransitionTime": (ctx.clock)().to_string(),
        "observedGeneration": obj.metadata.generation,
    }));
    let api: Api<DynamicObject> = Api::namespaced_with(
        ctx.client.clone(),
        &ns,
        &ApiResource::erase::<CollectiveJob>(&()),
    );
    let patch = json!({"status": {"conditions": conditions}});
    match api
        .patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
    {
        // The watch will deliver this new version: it is reported already.
        Ok(patched) => {
            if let Some(rv) = patched.resource_version() {
                ctx.reported_undecodable
                    .lock()
                    .unwrap()
                    .insert((uid.clone(), rv));
            }
        }
        Err(e) => warn!(job = %name, error = %e, "could not mark an undecodable CollectiveJob"),
    }
    let oref = ObjectReference {
        api_version: Some(format!("{}/{}", crate::crd::GROUP, crate::crd::VERSION)),
        kind: Some("CollectiveJob".into()),
        name: Some(name.clone()),
        namespace: Some(ns),
        uid: Some(uid),
        ..ObjectReference::default()
    };
    if let Err(e) = ctx
        .events
        .publish(&oref, true, "InvalidObject", "Decode", &message)
        .await
    {
        warn!(job = %name, error = %e, "could not publish event");
    }
}

/// Runs the controller until `shutdown` resolves (in-flight reconciles finish).
///
/// CollectiveJobs are watched as untyped objects and decoded one by one (see
/// [`decode`]); `ctx.readiness` is told whether that watch works (listed, no
/// error since), which `/readyz` reports.
///
/// `watch_secrets`: also watch the job Secrets, like the other owned kinds, so
/// any change to them triggers a reconcile. (A missing Secret is recreated
/// only together with pods: a new token under running pods would split the
/// job.) It needs list/watch on Secrets cluster-wide, which RBAC cannot narrow
/// by label, so the chart can turn it off (`rbac.watchSecrets`); a watch
/// refused by RBAC would otherwise be retried in a loop.
pub async fn run(
    client: Client,
    ctx: Arc<Context>,
    watch_secrets: bool,
    shutdown: impl std::future::Future<Output = ()> + Send + Sync + 'static,
) {
    let ar = ApiResource::erase::<CollectiveJob>(&());
    let raw_jobs: Api<DynamicObject> = Api::all_with(client.clone(), &ar);
    let (reader, writer) = reflector::store::<CollectiveJob>();
    let dctx = ctx.clone();
    let events = watcher(raw_jobs, watcher::Config::default().any_semantic())
        .default_backoff()
        .filter_map(move |ev| {
            let ctx = dctx.clone();
            let out = match ev {
                Ok(ev) => {
                    let ok = &ctx.readiness.watch_ok;
                    Some(Ok(match ev {
                        watcher::Event::Init => watcher::Event::Init,
                        watcher::Event::InitDone => {
                            ok.store(true, Ordering::Relaxed);
                            watcher::Event::InitDone
                        }
                        watcher::Event::InitApply(o) => match decode(o, &ctx, true) {
                            Some(j) => watcher::Event::InitApply(j),
                            None => return futures::future::ready(None),
                        },
                        watcher::Event::Apply(o) => {
                            ok.store(true, Ordering::Relaxed);
                            match decode(o, &ctx, true) {
                                Some(j) => watcher::Event::Apply(j),
                                None => return futures::future::ready(None),
                            }
                        }
                        watcher::Event::Delete(o) => match decode(o, &ctx, false) {
                            Some(j) => watcher::Event::Delete(j),
                            None => return futures::future::ready(None),
                        },
                    }))
                }
                Err(e) => {
                    warn!(error = %e, "CollectiveJob watch failed; retrying");
                    ctx.readiness.watch_ok.store(false, Ordering::Relaxed);
                    Some(Err(e))
                }
            };
            futures::future::ready(out)
        });
    let jobs = reflector(writer, events).applied_objects();
    // Only our own children are watched (metadata only), to keep caches small.
    let owned = watcher::Config::default().labels(&format!("{LABEL_MANAGED_BY}={MANAGER}"));
    let mut controller = Controller::for_stream(jobs, reader)
        .owns(Api::<Pod>::all(client.clone()), owned.clone())
        .owns(Api::<Service>::all(client.clone()), owned.clone());
    if watch_secrets {
        controller = controller.owns(Api::<Secret>::all(client), owned);
    }
    controller
        .graceful_shutdown_on(shutdown)
        .run(reconcile, error_policy, ctx.clone())
        .for_each(|res| async move {
            match res {
                Ok((obj, _)) => tracing::debug!(job = %obj.name, "reconciled"),
                Err(e) => tracing::debug!(error = %e, "reconcile error"),
            }
        })
        .await;
    ctx.readiness.watch_ok.store(false, Ordering::Relaxed);
}

#[cfg(test)]
#[path = "controller_tests.rs"]
mod tests;
