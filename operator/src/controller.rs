//! The controller: watches CollectiveJobs and the Pods, Services and Secrets
//! they own, and executes the plans computed by `policy::plan`.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Pod, Secret, Service};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::finalizer::{Event as Finalizer, finalizer};
use kube::runtime::watcher;
use kube::{Client, Resource, ResourceExt};
use serde_json::json;
use tracing::{info, warn};

use crate::crd::{CollectiveJob, JobPhase};
use crate::policy::{self, Plan};
use crate::resources::{
    self, LABEL_MANAGED_BY, MANAGER, OperatorConfig, desired_pod, desired_secret, desired_service,
};
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
    pub recorder: Recorder,
    pub config: OperatorConfig,
    pub metrics: Arc<Metrics>,
    /// Injected so that tests can move time (deadlines, TTL).
    pub clock: Clock,
}

impl Context {
    pub fn new(client: Client, config: OperatorConfig, metrics: Arc<Metrics>) -> Self {
        let reporter = Reporter {
            controller: "weft-operator".into(),
            instance: weft_contract::params::POD_NAME.raw(),
        };
        Self {
            recorder: Recorder::new(client.clone(), reporter),
            client,
            config,
            metrics,
            clock: Arc::new(Timestamp::now),
        }
    }
}

pub async fn reconcile(job: Arc<CollectiveJob>, ctx: Arc<Context>) -> Result<Action, Error> {
    let _timer = ctx.metrics.reconcile_started();
    let ns = job.namespace().ok_or(Error::MissingNamespace)?;
    let jobs: Api<CollectiveJob> = Api::namespaced(ctx.client.clone(), &ns);
    finalizer(&jobs, FINALIZER, job, |event| async {
        match event {
            Finalizer::Apply(job) => apply(&job, &ctx).await,
            Finalizer::Cleanup(job) => cleanup(&job, &ctx).await,
        }
    })
    .await
    .map_err(|e| Error::Finalizer(Box::new(e)))
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

async fn apply(job: &CollectiveJob, ctx: &Context) -> Result<Action, Error> {
    let ns = resources::namespace(job);
    let name = job.name_any();
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), &ns);
    let current = owned_pods(job, &pods).await?;
    let mut plan = policy::plan(job, &current, (ctx.clock)());

    if plan.ensure_base {
        ensure_base(job, ctx, !plan.create_pods.is_empty()).await?;
    }
    match execute_pods(job, ctx, &pods, &plan).await {
        Ok(()) => {}
        // 422: the Pod itself is invalid (e.g. a template error the CRD schema
        // does not check); retrying cannot help, so the job fails with the
        // server's message. Pods created before the refusal are cleaned up
        // by cleanPodPolicy on the next pass.
        Err(kube::Error::Api(s)) if s.is_invalid() => {
            policy::pod_refused(job, &mut plan, &s.message, (ctx.clock)());
        }
        Err(e) => return Err(e.into()),
    }

    let old_phase = job.phase();
    if job.status.as_ref() != Some(&plan.status) {
        let jobs: Api<CollectiveJob> = Api::namespaced(ctx.client.clone(), &ns);
        let patch = json!({
            "apiVersion": format!("{}/{}", crate::crd::GROUP, crate::crd::VERSION),
            "kind": "CollectiveJob",
            "status": plan.status,
        });
        jobs.patch_status(
            &name,
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(&patch),
        )
        .await?;
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
    publish(job, ctx, &plan).await;

    if plan.delete_job {
        let jobs: Api<CollectiveJob> = Api::namespaced(ctx.client.clone(), &ns);
        jobs.delete(&name, &DeleteParams::background()).await?;
        return Ok(Action::await_change());
    }
    Ok(Action::requeue(
        plan.requeue_after.unwrap_or(Duration::from_secs(300)),
    ))
}

/// Headless Service (server-side apply, so edits by others to fields we do
/// not own survive) and, before pods are created, the job Secret. The Secret
/// is create-only (a new token would split a running job), and "already
/// exists" is success, so the operator needs no read access to Secrets.
async fn ensure_base(
    job: &CollectiveJob,
    ctx: &Context,
    creating_pods: bool,
) -> Result<(), kube::Error> {
    let ns = resources::namespace(job);
    let services: Api<Service> = Api::namespaced(ctx.client.clone(), &ns);
    let svc = desired_service(job);
    services
        .patch(
            &resources::service_name(job),
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(&svc),
        )
        .await?;
    if creating_pods {
        let secrets: Api<Secret> = Api::namespaced(ctx.client.clone(), &ns);
        let secret = desired_secret(job, &resources::random_token());
        match secrets.create(&PostParams::default(), &secret).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.is_already_exists() => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

async fn execute_pods(
    job: &CollectiveJob,
    ctx: &Context,
    pods: &Api<Pod>,
    plan: &Plan,
) -> Result<(), kube::Error> {
    for name in &plan.delete_pods {
        match pods.delete(name, &DeleteParams::background()).await {
            Ok(_) => {
                ctx.metrics.pods_deleted.inc();
            }
            Err(kube::Error::Api(s)) if s.is_not_found() => {}
            Err(e) => return Err(e),
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
            Err(e) => return Err(e),
        }
    }
    for index in &plan.create_pods {
        let pod = desired_pod(job, *index, plan.status.restart_epoch, &ctx.config);
        match pods.create(&PostParams::default(), &pod).await {
            Ok(_) => {
                ctx.metrics.pods_created.inc();
            }
            // Created by a previous, interrupted reconcile: the next one sees it.
            Err(kube::Error::Api(s)) if s.is_already_exists() => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Events are best effort: a failed publish is logged, never retried by
/// failing the reconcile (the status is the record of truth).
async fn publish(job: &CollectiveJob, ctx: &Context, plan: &Plan) {
    let oref = job.object_ref(&());
    for ev in &plan.events {
        let event = Event {
            type_: if ev.warning {
                EventType::Warning
            } else {
                EventType::Normal
            },
            reason: ev.reason.clone(),
            note: Some(ev.note.chars().take(1000).collect()),
            action: ev.action.clone(),
            secondary: None,
        };
        if let Err(e) = ctx.recorder.publish(&event, &oref).await {
            warn!(job = %job.name_any(), reason = %ev.reason, error = %e, "could not publish event");
        }
    }
}

async fn cleanup(job: &CollectiveJob, ctx: &Context) -> Result<Action, Error> {
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

/// Runs the controller until `shutdown` resolves (in-flight reconciles finish).
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
    let jobs = Api::<CollectiveJob>::all(client.clone());
    // Only our own children are watched (metadata only), to keep caches small.
    let owned = watcher::Config::default().labels(&format!("{LABEL_MANAGED_BY}={MANAGER}"));
    let mut controller = Controller::new(jobs, watcher::Config::default().any_semantic())
        .owns(Api::<Pod>::all(client.clone()), owned.clone())
        .owns(Api::<Service>::all(client.clone()), owned.clone());
    if watch_secrets {
        controller = controller.owns(Api::<Secret>::all(client), owned);
    }
    controller
        .graceful_shutdown_on(shutdown)
        .run(reconcile, error_policy, ctx)
        .for_each(|res| async move {
            match res {
                Ok((obj, _)) => tracing::debug!(job = %obj.name, "reconciled"),
                Err(e) => tracing::debug!(error = %e, "reconcile error"),
            }
        })
        .await;
}

#[cfg(test)]
#[path = "controller_tests.rs"]
mod tests;
