//! Executing a plan: read the job afresh, plan, write pods, Service and
//! Secret, fold a refusal by the API server back into the plan, write the
//! status, count, publish events.

use std::time::Duration;

use k8s_openapi::api::core::v1::{Pod, Secret, Service};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::runtime::controller::Action;
use kube::{Resource, ResourceExt};
use serde_json::json;
use tracing::{info, warn};

use super::{Context, Error, FIELD_MANAGER, owned_pods};
use crate::crd::CollectiveJob;
use crate::policy::{self, Plan};
use crate::resources::{self, desired_pod_incarnation, desired_secret, desired_service};
use crate::telemetry::metrics::PhaseLabels;

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

/// One reconcile of a live job, in its phases.
pub(super) async fn apply(cached: &CollectiveJob, ctx: &Context) -> Result<Action, Error> {
    let ns = resources::namespace(cached);
    let jobs: Api<CollectiveJob> = Api::namespaced(ctx.client.clone(), &ns);
    let Some(job) = read_fresh(&jobs, cached).await? else {
        // Deleted, or re-created under the same name: its own event follows.
        return Ok(Action::await_change());
    };
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), &ns);
    let current = owned_pods(&job, &pods).await?;
    let mut plan = policy::plan(&job, &current, (ctx.clock)());
    // The last attempt to create the gang was refused and rolled back: wait
    // out the backoff. Without this gate the rollback's own pod deletions and
    // status write would trigger the next attempt at once, in a tight loop.
    if !plan.create_pods.is_empty()
        && let Some(left) = ctx.backing_off(&job)
    {
        return Ok(Action::requeue(left));
    }
    execute(&job, ctx, &pods, &current, &mut plan).await?;
    if let Some(again) = write_status(&jobs, &job, &plan).await? {
        return Ok(again);
    }
    record_metrics(&job, ctx, &plan);
    publish(&job, ctx, &plan).await;
    if plan.delete_job {
        match jobs
            .delete(&job.name_any(), &DeleteParams::background())
            .await
        {
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

/// The job as it is now, not as the watch cache last saw it: a stale status
/// (an epoch behind, startTime not yet seen) would delete the current pods or
/// erase fields. The status write is conditional on this read's
/// resourceVersion, which closes the remaining window. None when the job is
/// gone or is another job of the same name.
async fn read_fresh(
    jobs: &Api<CollectiveJob>,
    cached: &CollectiveJob,
) -> Result<Option<CollectiveJob>, Error> {
    Ok(jobs
        .get_opt(&cached.name_any())
        .await?
        .filter(|j| j.uid() == cached.uid()))
}

/// Carries out the plan's writes. A refusal that retrying at once cannot fix
/// is folded into the plan (the job fails, or waits with backoff); any other
/// error fails the reconcile.
async fn execute(
    job: &CollectiveJob,
    ctx: &Context,
    pods: &Api<Pod>,
    current: &[Pod],
    plan: &mut Plan,
) -> Result<(), Error> {
    let creating = !plan.create_pods.is_empty();
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
        execute_pods(job, ctx, pods, plan).await
    }
    .await;
    match executed {
        Ok(()) => {
            if creating {
                ctx.reset_backoff(&job.uid().unwrap_or_default());
            }
            Ok(())
        }
        Err(e) => absorb_refusal(job, ctx, pods, current, plan, e).await,
    }
}

/// A write was refused: a permanent refusal fails the job with the server's
/// message; one that may pass rolls back a partial gang and retries with
/// backoff; anything else is a reconcile error.
async fn absorb_refusal(
    job: &CollectiveJob,
    ctx: &Context,
    pods: &Api<Pod>,
    current: &[Pod],
    plan: &mut Plan,
    ExecError {
        what,
        error,
        created,
    }: ExecError,
) -> Result<(), Error> {
    let blocked = match classify_api_error(&error) {
        // Nothing is known to be wrong with the job: retried as a reconcile
        // error; a partial gang is completed next time.
        ApiErrorClass::Retry => return Err(error.into()),
        ApiErrorClass::Permanent => None,
        ApiErrorClass::Blocked(reason) => Some(reason),
    };
    let message = match &error {
        kube::Error::Api(s) => s.message.clone(),
        e => e.to_string(),
    };
    // All-or-nothing: no partial gang holds quota or GPUs. A replacement of
    // a failed pod is not a gang: the running pods stay.
    let rolled_back = if !plan.create_pods.is_empty() && !plan.replacements_only {
        rollback_gang(job, ctx, pods, current, &created).await
    } else {
        0
    };
    warn!(job = %job.name_any(), namespace = %resources::namespace(job), object = what, error = %message, "the API server refused a write");
    let now = (ctx.clock)();
    match blocked {
        None => policy::api_refused(job, plan, what, &message, now),
        Some(reason) => {
            let retry_in = ctx.backoff(job);
            let message = format!("{what}: {message}");
            policy::creation_blocked(job, plan, reason, &message, rolled_back, retry_in, now);
        }
    }
    Ok(())
}

/// Writes the plan's status when it changed. Some(action) when the job
/// changed since it was read: the write is refused and the job reconciled
/// again.
async fn write_status(
    jobs: &Api<CollectiveJob>,
    job: &CollectiveJob,
    plan: &Plan,
) -> Result<Option<Action>, Error> {
    if job.status.as_ref() == Some(&plan.status) {
        return Ok(None);
    }
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
    let params = PatchParams::apply(FIELD_MANAGER).force();
    match jobs
        .patch_status(&job.name_any(), &params, &Patch::Apply(&patch))
        .await
    {
        Ok(_) => Ok(None),
        Err(kube::Error::Api(s)) if s.is_conflict() => {
            info!(job = %job.name_any(), namespace = %resources::namespace(job), "job changed since it was read; reconciling again");
            Ok(Some(Action::requeue(Duration::from_secs(1))))
        }
        Err(e) => Err(e.into()),
    }
}

/// Phase transitions, restarts and replacements, once the status that
/// records them is written.
fn record_metrics(job: &CollectiveJob, ctx: &Context, plan: &Plan) {
    let old = job.status.clone().unwrap_or_default();
    if let Some(new) = plan.status.phase
        && old.phase != Some(new)
    {
        info!(job = %job.name_any(), namespace = %resources::namespace(job), from = ?old.phase, to = ?new, "phase transition");
        ctx.metrics
            .phase_transitions
            .get_or_create(&PhaseLabels {
                phase: new.as_str().into(),
            })
            .inc();
    }
    // Every restart (a new epoch after a rank failure) counts, also one
    // decided while the job is still Restarting from the previous one.
    ctx.metrics
        .job_restarts
        .inc_by(growth(old.restarts, plan.status.restarts));
    ctx.metrics
        .rank_replacements
        .inc_by(growth(old.replacements, plan.status.replacements));
}

/// How much a status counter grew (it never shrinks; 0 if it seems to).
fn growth(old: i32, new: i32) -> u64 {
    u64::try_from(i64::from(new) - i64::from(old)).unwrap_or(0)
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
pub(super) async fn publish(job: &CollectiveJob, ctx: &Context, plan: &Plan) {
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
