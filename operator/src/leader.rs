//! Leader election on a `coordination.k8s.io/v1` Lease, so that two operator
//! replicas never reconcile at the same time.
//!
//! The protocol is client-go's: the holder renews `renewTime` every
//! `renew_every`; a candidate may take the lease only once
//! `renewTime + leaseDurationSeconds` has passed. Every write is a `replace`
//! carrying the `resourceVersion` that was read, so of two candidates racing
//! for an expired lease exactly one wins (the other gets 409 Conflict).
//! Every Lease call has a request timeout, and a leader that has not renewed
//! within the renew deadline (10 s, below the 15 s lease duration) stops
//! reconciling (it reports `weft_operator_leader 0`, turns unready and the
//! process exits) before anyone else may take over. A leader whose connection
//! to the API server is frozen therefore steps down on its own; without the
//! timeouts one hung request kept it acting for up to a minute after a standby
//! had taken the Lease.
//!
//! A Lease call the API server refuses for good (401, 403, 404: the
//! operator's ServiceAccount, RBAC or namespace is gone, as during `helm
//! uninstall` without its hook) is not retried: the leader steps down at once
//! and a standby gives up, each saying why; retrying would only hide it.

use std::sync::atomic::Ordering;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::api::{Api, PostParams};
use tracing::{error, info, warn};

use crate::telemetry::http::Readiness;
use crate::telemetry::metrics::Metrics;

/// The Lease the replicas elect their leader on, in the operator's namespace.
pub const LEASE_NAME: &str = "weft-operator-leader";

#[derive(Clone, Debug)]
pub struct LeaseConfig {
    pub name: String,
    pub namespace: String,
    pub identity: String,
    /// How long a lease is valid after its last renewal (for the others).
    pub lease_duration: Duration,
    /// The leader steps down when it has not renewed for this long.
    pub renew_deadline: Duration,
    /// Time between renewals (and between a standby's polls).
    pub renew_every: Duration,
    /// Limit of each Lease request.
    pub request_timeout: Duration,
}

impl LeaseConfig {
    /// client-go's defaults: 15 s lease, 10 s renew deadline, 2 s retry.
    pub fn new(namespace: &str, identity: &str) -> Self {
        Self {
            name: LEASE_NAME.into(),
            namespace: namespace.into(),
            identity: identity.into(),
            lease_duration: Duration::from_secs(15),
            renew_deadline: Duration::from_secs(10),
            renew_every: Duration::from_secs(2),
            request_timeout: Duration::from_secs(5),
        }
    }

    /// The leader must have stopped before the lease can expire for the
    /// others, with a margin for clock rate differences.
    pub fn check(&self) -> Result<(), String> {
        if self.request_timeout > self.renew_deadline {
            return Err("the Lease request timeout must not exceed the renew deadline".into());
        }
        if self.renew_every >= self.renew_deadline {
            return Err("renewals must be more frequent than the renew deadline".into());
        }
        if self.renew_deadline.as_secs_f64() > 0.8 * self.lease_duration.as_secs_f64() {
            return Err("the renew deadline must be well below the lease duration".into());
        }
        Ok(())
    }
}

#[derive(Debug, thiserror::Error)]
pub enum LeaseError {
    #[error(transparent)]
    Kube(#[from] kube::Error),
    #[error("Lease request timed out after {0:?}")]
    Timeout(Duration),
}

impl LeaseError {
    /// The API server refused the call for good: the credentials (401), the
    /// permission (403) or the namespace (404) is gone. Waiting cannot help.
    pub fn refused(&self) -> bool {
        matches!(self, LeaseError::Kube(kube::Error::Api(s)) if matches!(s.code, 401 | 403 | 404))
    }
}

/// Logs a refused Lease call in words an operator of the cluster can act on.
fn log_refused(e: &LeaseError, cfg: &LeaseConfig, doing: &str) {
    error!(
        error = %e,
        lease = %cfg.name,
        namespace = %cfg.namespace,
        "leader election: the API server refuses to let us {doing} the Lease; the operator's \
         ServiceAccount, RBAC (Role and RoleBinding for leases) or namespace is missing, \
         e.g. because `helm uninstall` is removing them, or the Lease was deleted"
    );
}

async fn bounded<T>(
    limit: Duration,
    f: impl std::future::Future<Output = Result<T, kube::Error>>,
) -> Result<T, LeaseError> {
    match tokio::time::timeout(limit, f).await {
        Ok(r) => Ok(r?),
        Err(_) => Err(LeaseError::Timeout(limit)),
    }
}

/// What a candidate should do with the lease it read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LeaseAction {
    /// No lease exists: create it, holding it.
    Create,
    /// Free or expired: take it (a new transition).
    TakeOver,
    /// We hold it: renew.
    Renew,
    /// Someone else holds a live lease.
    Wait { holder: String },
}

pub fn decide(
    lease: Option<&Lease>,
    identity: &str,
    now: Timestamp,
    default_duration: i32,
) -> LeaseAction {
    let Some(lease) = lease else {
        return LeaseAction::Create;
    };
    let spec = lease.spec.clone().unwrap_or_default();
    let holder = spec.holder_identity.unwrap_or_default();
    if holder == identity {
        return LeaseAction::Renew;
    }
    if holder.is_empty() {
        return LeaseAction::TakeOver;
    }
    let duration = spec.lease_duration_seconds.unwrap_or(default_duration) as i64;
    let last = spec.renew_time.or(spec.acquire_time).map(|t| t.0);
    match last {
        Some(t) if t + SignedDuration::from_secs(duration) > now => LeaseAction::Wait { holder },
        _ => LeaseAction::TakeOver,
    }
}

/// The lease to write for `action` (None for `Wait`).
pub fn next_lease(
    old: Option<&Lease>,
    action: &LeaseAction,
    cfg: &LeaseConfig,
    now: Timestamp,
) -> Option<Lease> {
    let now = MicroTime(now);
    let mut lease = old.cloned().unwrap_or_else(|| Lease {
        metadata: ObjectMeta {
            name: Some(cfg.name.clone()),
            namespace: Some(cfg.namespace.clone()),
            ..ObjectMeta::default()
        },
        spec: Some(LeaseSpec::default()),
    });
    let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
    match action {
        LeaseAction::Wait { .. } => return None,
        LeaseAction::Renew => {}
        LeaseAction::Create | LeaseAction::TakeOver => {
            spec.acquire_time = Some(now.clone());
            if matches!(action, LeaseAction::TakeOver) {
                spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
            } else {
                spec.lease_transitions = Some(0);
            }
        }
    }
    spec.holder_identity = Some(cfg.identity.clone());
    spec.lease_duration_seconds = Some(cfg.lease_duration.as_secs() as i32);
    spec.renew_time = Some(now);
    Some(lease)
}

/// One acquire-or-renew attempt; Ok(true) while we hold the lease.
pub async fn try_acquire_or_renew(api: &Api<Lease>, cfg: &LeaseConfig) -> Result<bool, LeaseError> {
    let current = bounded(cfg.request_timeout, api.get_opt(&cfg.name)).await?;
    let action = decide(
        current.as_ref(),
        &cfg.identity,
        Timestamp::now(),
        cfg.lease_duration.as_secs() as i32,
    );
    let Some(lease) = next_lease(current.as_ref(), &action, cfg, Timestamp::now()) else {
        return Ok(false);
    };
    let res = match action {
        LeaseAction::Create => {
            bounded(
                cfg.request_timeout,
                api.create(&PostParams::default(), &lease),
            )
            .await
        }
        _ => {
            bounded(
                cfg.request_timeout,
                api.replace(&cfg.name, &PostParams::default(), &lease),
            )
            .await
        }
    };
    match res {
        Ok(_) => {
            if action != LeaseAction::Renew {
                info!(identity = %cfg.identity, lease = %cfg.name, "acquired leadership");
            }
            Ok(true)
        }
        // Lost a race with another candidate: not an error.
        Err(LeaseError::Kube(kube::Error::Api(s))) if s.is_conflict() || s.is_already_exists() => {
            Ok(false)
        }
        Err(e) => Err(e),
    }
}

/// Blocks until this replica holds the lease. `polled(ok)` after every
/// attempt: whether the API server answered (a standby's readiness). Returns
/// the error when the API server refuses the Lease for good.
pub async fn acquire(
    api: &Api<Lease>,
    cfg: &LeaseConfig,
    polled: impl Fn(bool),
) -> Result<(), LeaseError> {
    loop {
        match try_acquire_or_renew(api, cfg).await {
            Ok(true) => return Ok(()),
            Ok(false) => polled(true),
            Err(e) if e.refused() => {
                polled(false);
                log_refused(&e, cfg, "read or take");
                return Err(e);
            }
            Err(e) => {
                polled(false);
                warn!(error = %e, "leader election: cannot read or write the lease");
            }
        }
        tokio::time::sleep(cfg.renew_every).await;
    }
}

/// Why a leader stopped leading.
#[derive(Debug)]
pub enum StepDown {
    /// Another replica holds the lease.
    TakenOver,
    /// No renewal succeeded within the renew deadline.
    RenewDeadline,
    /// The API server refused the renewal for good (see [`LeaseError::refused`]).
    Refused(LeaseError),
}

/// Renews until leadership is lost: another holder, a refusal, or no
/// successful renewal within the renew deadline (each attempt is cut off at
/// that deadline, so a hung connection cannot keep us waiting).
pub async fn hold(api: &Api<Lease>, cfg: &LeaseConfig) -> StepDown {
    let mut last_ok = tokio::time::Instant::now();
    loop {
        tokio::time::sleep(cfg.renew_every).await;
        let deadline = last_ok + cfg.renew_deadline;
        match tokio::time::timeout_at(deadline, try_acquire_or_renew(api, cfg)).await {
            Ok(Ok(true)) => last_ok = tokio::time::Instant::now(),
            Ok(Ok(false)) => {
                warn!("leader election: the lease was taken by another replica");
                return StepDown::TakenOver;
            }
            Ok(Err(e)) if e.refused() => {
                log_refused(&e, cfg, "renew");
                return StepDown::Refused(e);
            }
            Ok(Err(e)) => {
                warn!(error = %e, "leader election: renewal failed");
                if tokio::time::Instant::now() + cfg.renew_every >= deadline {
                    warn!(deadline = ?cfg.renew_deadline, "leader election: could not renew within the renew deadline");
                    return StepDown::RenewDeadline;
                }
            }
            Err(_) => {
                warn!(deadline = ?cfg.renew_deadline, "leader election: could not renew within the renew deadline");
                return StepDown::RenewDeadline;
            }
        }
    }
}

/// Leads until the lease is lost, then stops acting as leader in what others
/// can see: `weft_operator_leader 0` and `/readyz` false. The caller exits
/// the process (which stops the controller) right after.
pub async fn lead(
    api: &Api<Lease>,
    cfg: &LeaseConfig,
    metrics: &Metrics,
    readiness: &Readiness,
) -> StepDown {
    metrics.leader.set(1);
    readiness.leading.store(true, Ordering::Relaxed);
    let why = hold(api, cfg).await;
    metrics.leader.set(0);
    readiness.leading.store(false, Ordering::Relaxed);
    readiness.standby_ok.store(false, Ordering::Relaxed);
    why
}

/// What [`release`] did.
#[derive(Debug)]
pub enum Released {
    /// The holder is cleared: a standby takes over at its next poll.
    Released,
    /// Someone else (or no one) holds the lease: nothing to hand back.
    NotHolder(Option<String>),
    /// The lease could not be read or written; it expires by itself.
    Failed(LeaseError),
}

/// Hands the lease back on shutdown so a standby takes over at once. Every
/// outcome is logged: a release that fails leaves the Lease to expire, which
/// delays the next leader by up to the lease duration.
pub async fn release(api: &Api<Lease>, cfg: &LeaseConfig) -> Released {
    let outcome = try_release(api, cfg).await;
    match &outcome {
        Released::Released => info!(lease = %cfg.name, "released leadership"),
        Released::NotHolder(holder) => {
            info!(lease = %cfg.name, holder = ?holder, "the lease is not ours; nothing to release")
        }
        Released::Failed(e) if e.refused() => log_refused(e, cfg, "release"),
        Released::Failed(e) => warn!(
            error = %e,
            lease = %cfg.name,
            expires_in = ?cfg.lease_duration,
            "could not release the leader lease; it expires by itself"
        ),
    }
    outcome
}

async fn try_release(api: &Api<Lease>, cfg: &LeaseConfig) -> Released {
    let mut lease = match bounded(cfg.request_timeout, api.get_opt(&cfg.name)).await {
        Ok(Some(lease)) => lease,
        Ok(None) => return Released::NotHolder(None),
        Err(e) => return Released::Failed(e),
    };
    let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
    if spec.holder_identity.as_deref() != Some(cfg.identity.as_str()) {
        return Released::NotHolder(spec.holder_identity.clone());
    }
    spec.holder_identity = None;
    spec.renew_time = None;
    match bounded(
        cfg.request_timeout,
        api.replace(&cfg.name, &PostParams::default(), &lease),
    )
    .await
    {
        Ok(_) => Released::Released,
        Err(e) => Released::Failed(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(s: i64) -> Timestamp {
        Timestamp::from_second(1_800_000_000 + s).unwrap()
    }

    fn lease(holder: Option<&str>, renewed: i64) -> Lease {
        Lease {
            metadata: ObjectMeta {
                name: Some("weft-operator-leader".into()),
                resource_version: Some("7".into()),
                ..ObjectMeta::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: holder.map(String::from),
                lease_duration_seconds: Some(15),
                renew_time: Some(MicroTime(t(renewed))),
                lease_transitions: Some(2),
                ..LeaseSpec::default()
            }),
        }
    }

    /// Issue 19 (2): the renew deadline is below the lease duration and every
    /// request is bounded by it.
    #[test]
    fn default_deadlines_step_down_before_the_lease_expires() {
        let c = LeaseConfig::new("ns", "a");
        c.check().unwrap();
        assert!(c.renew_deadline < c.lease_duration);
        assert!(c.request_timeout <= c.renew_deadline);
        let bad = LeaseConfig {
            renew_deadline: c.lease_duration,
            ..c.clone()
        };
        assert!(bad.check().is_err());
    }

    #[test]
    fn decisions() {
        assert_eq!(decide(None, "a", t(0), 15), LeaseAction::Create);
        assert_eq!(
            decide(Some(&lease(Some("a"), 0)), "a", t(100), 15),
            LeaseAction::Renew
        );
        assert_eq!(
            decide(Some(&lease(Some("b"), 0)), "a", t(14), 15),
            LeaseAction::Wait { holder: "b".into() }
        );
        assert_eq!(
            decide(Some(&lease(Some("b"), 0)), "a", t(15), 15),
            LeaseAction::TakeOver
        );
        assert_eq!(
            decide(Some(&lease(None, 0)), "a", t(1), 15),
            LeaseAction::TakeOver
        );
    }

    #[test]
    fn takeover_keeps_resource_version_and_counts_transition() {
        let cfg = LeaseConfig::new("weft-system", "a");
        let old = lease(Some("b"), 0);
        let new = next_lease(Some(&old), &LeaseAction::TakeOver, &cfg, t(20)).unwrap();
        assert_eq!(
            new.metadata.resource_version.as_deref(),
            Some("7"),
            "optimistic lock"
        );
        let s = new.spec.unwrap();
        assert_eq!(s.holder_identity.as_deref(), Some("a"));
        assert_eq!(s.lease_transitions, Some(3));
        assert_eq!(s.acquire_time, Some(MicroTime(t(20))));
        assert_eq!(s.renew_time, Some(MicroTime(t(20))));
        assert!(
            next_lease(
                Some(&old),
                &LeaseAction::Wait { holder: "b".into() },
                &cfg,
                t(1)
            )
            .is_none()
        );
        let created = next_lease(None, &LeaseAction::Create, &cfg, t(0)).unwrap();
        assert_eq!(created.metadata.namespace.as_deref(), Some("weft-system"));
        assert_eq!(created.spec.unwrap().lease_duration_seconds, Some(15));
    }
}
