//! The reconcile decision as a pure function: (job, its pods, now) -> a plan of
//! writes and the new status. The controller only executes plans, so every
//! lifecycle rule (restart, fail, suspend, deadline, TTL, cleanup) is tested
//! here without an API server.
//!
//! [`plan`] runs the phases of one reconcile in order, each in its own module:
//! - `gates`: a finished, invalid, suspended or overdue job is decided before
//!   anything else (with `lifecycle`: fail, suspend, finish);
//! - `cleanup`: pods of older epochs and pods being replaced are deleted;
//! - `failures`: the rank failures of the current epoch, root cause first
//!   (held a moment while the cause may not be reported yet);
//! - `verdict`: what the failure policy makes of them (restart, fail or
//!   replace, with `recovery` for the replacement records);
//! - `gang`: the missing pods of the current epoch are created;
//! - `progress`: rank table, ready count, phase and conditions.
//!
//! `refusals` adjusts a plan the API server refused to carry out.

use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::Timestamp;

use crate::crd::{CollectiveJob, CollectiveJobStatus, RecoveryState};
use crate::resources::{bootstrap_endpoint, world_size};
use crate::status::{PodView, classify};

mod cleanup;
mod decision;
mod failures;
mod gang;
mod gates;
mod lifecycle;
mod progress;
mod recovery;
mod refusals;
mod verdict;

pub use decision::{Decision, describe_failure, on_rank_failure};
pub use refusals::{api_refused, creation_blocked, pod_refused};

/// Grace beyond a pod's own termination grace period before an old-epoch pod
/// is force-deleted.
pub const FORCE_DELETE_AFTER_SECS: i64 = 60;

/// How long after a rank exits with an error its failure waits for those of
/// its peers, so that the cause (a rank killed a moment earlier, reported a
/// moment later) is the one named: peers of a dead rank exit with errors of
/// their own within a second, and the kubelet reports each pod on its own.
pub const FAILURE_GATHER_SECS: i64 = 3;

pub const COND_READY: &str = "Ready";
pub const COND_RESTARTING: &str = "Restarting";
pub const COND_SUSPENDED: &str = "Suspended";
pub const COND_SUCCEEDED: &str = "Succeeded";
pub const COND_FAILED: &str = "Failed";
pub const COND_REPLACING: &str = "Replacing";
/// Condition set on a CollectiveJob the operator cannot decode (written by the
/// controller from the raw object); removed once the job decodes again.
pub const COND_DECODABLE: &str = "Decodable";

/// Recovery records kept in the status (every one in progress is kept).
pub const MAX_RECOVERY_RECORDS: usize = 20;

/// An event to publish on the job.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlannedEvent {
    pub warning: bool,
    pub reason: String,
    pub action: String,
    pub note: String,
}

/// What one reconcile should do, in this order: ensure Service + Secret,
/// delete pods, create pods, publish events, write status, delete the job.
#[derive(Clone, Debug, Default)]
pub struct Plan {
    pub ensure_base: bool,
    pub delete_pods: Vec<String>,
    /// Pods of an old epoch stuck terminating well past their grace period
    /// (typically on a lost node): deleted with grace period 0.
    pub force_delete_pods: Vec<String>,
    /// Replica indices to create, in epoch `status.restart_epoch`, each in
    /// incarnation [`Plan::incarnation`].
    pub create_pods: Vec<i32>,
    /// Every pod in `create_pods` replaces a failed one (ReplaceRank): a
    /// refused creation must not roll back the running pods as a gang.
    pub replacements_only: bool,
    pub delete_job: bool,
    pub status: CollectiveJobStatus,
    pub events: Vec<PlannedEvent>,
    pub requeue_after: Option<Duration>,
}

impl Plan {
    /// Incarnation of the pod to create for replica `index`: that of its
    /// replacement in progress, else 0.
    pub fn incarnation(&self, index: i32) -> i32 {
        self.status
            .recoveries
            .iter()
            .filter(|r| {
                r.state == RecoveryState::Replacing
                    && r.epoch == self.status.restart_epoch
                    && r.replica_index == index
            })
            .map(|r| r.incarnation)
            .max()
            .unwrap_or(0)
    }
    fn event(&mut self, warning: bool, reason: &str, action: &str, note: impl Into<String>) {
        self.events.push(PlannedEvent {
            warning,
            reason: reason.into(),
            action: action.into(),
            note: note.into(),
        });
    }
    fn requeue_at_most(&mut self, secs: i64) {
        let d = Duration::from_secs(secs.max(1) as u64);
        self.requeue_after = Some(self.requeue_after.map_or(d, |r| r.min(d)));
    }
}

/// What the phases read: the job, its status as read, the time, and its pods
/// (all of them, and split by epoch).
struct Observed<'a> {
    job: &'a CollectiveJob,
    /// The status as read (the plan's status is the one being written).
    old: &'a CollectiveJobStatus,
    now: Timestamp,
    generation: Option<i64>,
    /// The current restart epoch (`old.restart_epoch`).
    epoch: i32,
    /// Every pod of the job, for the cleanup of a finished job.
    all: &'a [PodView],
    /// Pods of the current epoch, in replica order.
    current: Vec<&'a PodView>,
    /// Pods of older epochs: leftovers of a restart or suspension.
    stale: Vec<&'a PodView>,
}

impl<'a> Observed<'a> {
    fn new(
        job: &'a CollectiveJob,
        old: &'a CollectiveJobStatus,
        all: &'a [PodView],
        now: Timestamp,
    ) -> Self {
        let epoch = old.restart_epoch;
        let (mut current, stale): (Vec<&PodView>, Vec<&PodView>) =
            all.iter().partition(|v| v.epoch == Some(epoch));
        current.sort_by_key(|v| v.index);
        Self {
            job,
            old,
            now,
            generation: job.metadata.generation,
            epoch,
            all,
            current,
            stale,
        }
    }

    /// The pods of the current epoch, owned (for the rank table).
    fn current_owned(&self) -> Vec<PodView> {
        self.current.iter().map(|v| (*v).clone()).collect()
    }
}

/// Computes the plan for `job` given all pods that carry its label and are
/// owned by it.
pub fn plan(job: &CollectiveJob, pods: &[Pod], now: Timestamp) -> Plan {
    let old = job.status.clone().unwrap_or_default();
    let mut p = Plan {
        status: old.clone(),
        ..Plan::default()
    };
    let views: Vec<PodView> = pods.iter().map(classify).collect();
    refresh_spec_fields(job, &mut p.status);
    let obs = Observed::new(job, &old, &views, now);
    if gates::decided(&obs, &mut p) {
        return p;
    }

    cleanup::stale_pods(&obs, &mut p);
    let replacing = recovery::in_progress(&old.recoveries, obs.epoch);
    cleanup::replaced_pods(&obs, &replacing, &mut p);
    let failures = failures::collect(&obs, &replacing);
    if let Some(left) = failures::gather_time_left(&failures, now) {
        p.requeue_at_most(left);
        return p;
    }
    if !failures.is_empty() && verdict::act(&obs, &failures, &mut p) == verdict::Acted::OnTheJob {
        return p;
    }

    let replacing_now = recovery::in_progress(&p.status.recoveries, obs.epoch);
    let missing = gang::create_missing(&obs, &replacing_now, &mut p);
    recovery::mark_recovered(&obs, &mut p);
    let still_replacing = recovery::set_replacing_condition(&obs, &mut p);
    progress::update(&obs, &replacing_now, &missing, &still_replacing, &mut p);
    p
}

/// Status fields that follow from the spec alone.
fn refresh_spec_fields(job: &CollectiveJob, st: &mut CollectiveJobStatus) {
    st.world_size = world_size(job);
    st.bootstrap_endpoint = Some(bootstrap_endpoint(job));
    st.observed_generation = job.metadata.generation;
    // The job decodes (we are here): drop the controller's mark.
    st.conditions.retain(|c| c.type_ != COND_DECODABLE);
}

fn secs_until(t: Timestamp, now: Timestamp) -> i64 {
    t.as_second() - now.as_second()
}

#[cfg(test)]
mod tests;
