//! `weft-operator uninstall`: what the chart's pre-delete hook runs before
//! `helm uninstall` removes the operator, so that nothing it leaves behind
//! needs an operator to go away.
//!
//! CollectiveJobs outlive the operator, as Helm keeps the CRD: their pods
//! keep running, unsupervised, and an operator installed later adopts them
//! again. What would otherwise hang is their deletion: the `weft.dev/cleanup`
//! finalizer waits for an operator that is gone. So, in this order:
//! 1. stop the operator (delete its Deployment, waiting until its pods are
//!    gone: foreground deletion), so that no reconcile adds the finalizer
//!    back, and while its RBAC still exists, so that it releases the Lease;
//! 2. remove the finalizer from every CollectiveJob (deleting a job then
//!    takes its pods, Service and Secret with it by garbage collection);
//! 3. delete the leader Lease, the one object the operator created for itself.

use std::time::Duration;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::coordination::v1::Lease;
use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, ListParams, Patch, PatchParams};
use kube::{Client, ResourceExt};
use serde_json::{Value, json};
use tracing::{info, warn};

use crate::controller::FINALIZER;
use crate::crd::CollectiveJob;

#[derive(Clone, Debug)]
pub struct UninstallConfig {
    /// The operator's namespace (the Helm release's).
    pub namespace: String,
    /// The operator's Deployment.
    pub deployment: String,
    /// The leader Lease in `namespace`.
    pub lease: String,
    /// How long to wait for the operator's pods to be gone.
    pub stop_timeout: Duration,
    /// Between two looks at the Deployment.
    pub poll_every: Duration,
}

#[derive(Debug, thiserror::Error)]
pub enum UninstallError {
    #[error("kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    #[error(
        "the operator Deployment {0} still exists {1:?} after its deletion (foreground: \
         its pods are still terminating, or no garbage collector runs); CollectiveJob \
         finalizers are left in place, since a running operator would add them back"
    )]
    OperatorStillRunning(String, Duration),
    #[error("CollectiveJob {0}: the finalizer could not be removed: {1}")]
    Finalizer(String, kube::Error),
}

/// What `uninstall` did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Report {
    /// The operator's Deployment existed and was deleted.
    pub operator_stopped: bool,
    /// "namespace/name" of the jobs whose finalizer was removed.
    pub released: Vec<String>,
    /// Every CollectiveJob left, as "namespace/name".
    pub jobs_left: Vec<String>,
    /// The leader Lease existed and was deleted.
    pub lease_deleted: bool,
}

pub async fn uninstall(client: Client, cfg: &UninstallConfig) -> Result<Report, UninstallError> {
    let mut report = Report {
        operator_stopped: stop_operator(&client, cfg).await?,
        ..Report::default()
    };
    let jobs: Api<DynamicObject> =
        Api::all_with(client.clone(), &ApiResource::erase::<CollectiveJob>(&()));
    // Untyped: a job this operator version cannot decode is released too.
    for job in jobs.list(&ListParams::default()).await?.items {
        let id = format!("{}/{}", job.namespace().unwrap_or_default(), job.name_any());
        if release_job(&client, &job).await? {
            report.released.push(id.clone());
        }
        report.jobs_left.push(id);
    }
    let leases: Api<Lease> = Api::namespaced(client, &cfg.namespace);
    report.lease_deleted = deleted(leases.delete(&cfg.lease, &DeleteParams::default()).await)?;
    info!(
        operator_stopped = report.operator_stopped,
        released = ?report.released,
        jobs_left = ?report.jobs_left,
        lease_deleted = report.lease_deleted,
        "uninstall: CollectiveJobs left behind keep running without an operator; \
         `kubectl delete cjob` deletes them with their pods"
    );
    Ok(report)
}

/// Deletes the operator's Deployment and waits until it is gone. With
/// foreground deletion it is gone only once its ReplicaSets and pods are:
/// every operator process has stopped. False when there was none.
async fn stop_operator(client: &Client, cfg: &UninstallConfig) -> Result<bool, UninstallError> {
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), &cfg.namespace);
    let existed = deleted(
        deployments
            .delete(&cfg.deployment, &DeleteParams::foreground())
            .await,
    )?;
    if existed {
        info!(deployment = %cfg.deployment, "uninstall: stopping the operator");
    }
    let give_up = tokio::time::Instant::now() + cfg.stop_timeout;
    while deployments.get_opt(&cfg.deployment).await?.is_some() {
        if tokio::time::Instant::now() >= give_up {
            return Err(UninstallError::OperatorStillRunning(
                cfg.deployment.clone(),
                cfg.stop_timeout,
            ));
        }
        tokio::time::sleep(cfg.poll_every).await;
    }
    Ok(existed)
}

/// Removes the operator's finalizer from one job, keeping any other; true
/// when there was one. A JSON patch tests the list it rewrites, so a
/// concurrent change makes it fail (422) and the job is read again.
async fn release_job(client: &Client, job: &DynamicObject) -> Result<bool, UninstallError> {
    let ns = job.namespace().unwrap_or_default();
    let api: Api<DynamicObject> = Api::namespaced_with(
        client.clone(),
        &ns,
        &ApiResource::erase::<CollectiveJob>(&()),
    );
    let name = job.name_any();
    let mut current = job.clone();
    for _ in 0..5 {
        let finalizers = current.finalizers().to_vec();
        if !finalizers.iter().any(|f| f == FINALIZER) {
            return Ok(false);
        }
        let kept: Vec<&String> = finalizers.iter().filter(|f| *f != FINALIZER).collect();
        let patch = finalizers_patch(json!(finalizers), json!(kept));
        match api
            .patch(&name, &PatchParams::default(), &Patch::Json::<()>(patch))
            .await
        {
            Ok(_) => return Ok(true),
            // Deleted meanwhile (its finalizer removed by someone else).
            Err(kube::Error::Api(s)) if s.is_not_found() => return Ok(false),
            Err(kube::Error::Api(s)) if s.code == 422 || s.is_conflict() => {
                warn!(job = %name, namespace = %ns, "uninstall: the job changed meanwhile; reading it again");
                match api.get_opt(&name).await? {
                    Some(j) => current = j,
                    None => return Ok(false),
                }
            }
            Err(e) => return Err(UninstallError::Finalizer(format!("{ns}/{name}"), e)),
        }
    }
    let e = kube::Error::Api(Box::new(
        kube::core::Status::failure("the job kept changing", "Conflict").with_code(409),
    ));
    Err(UninstallError::Finalizer(format!("{ns}/{name}"), e))
}

/// Replaces the finalizer list, only if it is still `was`.
fn finalizers_patch(was: Value, now: Value) -> json_patch::Patch {
    use json_patch::jsonptr::PointerBuf;
    use json_patch::{PatchOperation, ReplaceOperation, TestOperation};
    let path = || PointerBuf::from_tokens(["metadata", "finalizers"]);
    json_patch::Patch(vec![
        PatchOperation::Test(TestOperation {
            path: path(),
            value: was,
        }),
        PatchOperation::Replace(ReplaceOperation {
            path: path(),
            value: now,
        }),
    ])
}

/// Ok(true) for a deletion done, Ok(false) for an object already gone.
fn deleted<T>(r: Result<T, kube::Error>) -> Result<bool, UninstallError> {
    match r {
        Ok(_) => Ok(true),
        Err(kube::Error::Api(s)) if s.is_not_found() => Ok(false),
        Err(e) => Err(e.into()),
    }
}
