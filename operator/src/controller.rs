//! The controller: watches CollectiveJobs and the Pods, Services and Secrets
//! they own, and executes the plans computed by `policy::plan`: `execute`
//! carries out one plan, `events` publishes Kubernetes Events, `undecodable`
//! reports CollectiveJobs the operator cannot read.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Pod, Secret, Service};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, ListParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::finalizer::{Event as Finalizer, finalizer};
use kube::runtime::{WatchStreamExt, reflector, watcher};
use kube::{Client, ResourceExt};
use tracing::warn;

use crate::crd::CollectiveJob;
use crate::policy::{self, Plan};
use crate::resources::{self, LABEL_MANAGED_BY, MANAGER, OperatorConfig};
use crate::telemetry::http::Readiness;
use crate::telemetry::metrics::Metrics;

mod events;
mod execute;
mod undecodable;

pub use events::Events;
pub use execute::{ApiErrorClass, classify_api_error};
use execute::{apply, publish};
use undecodable::decode;
pub use undecodable::report_undecodable;

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
