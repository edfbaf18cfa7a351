//! Whole-job transitions: fail, suspend, and the cleanup of a finished job
//! (`cleanPodPolicy`, `ttlSecondsAfterFinished`).

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::{SignedDuration, Timestamp};

use super::recovery::abandon_recoveries;
use super::{
    COND_FAILED, COND_READY, COND_RESTARTING, COND_SUSPENDED, Plan, PlannedEvent, secs_until,
};
use crate::crd::{CleanPodPolicy, CollectiveJob, CollectiveJobStatus, JobPhase};
use crate::status::{PodState, PodView, rank_table, set_condition};

pub(super) fn fail(p: &mut Plan, reason: &str, msg: &str, now: Timestamp, generation: Option<i64>) {
    let st = &mut p.status;
    abandon_recoveries(st, now, generation);
    st.phase = Some(JobPhase::Failed);
    st.completion_time = Some(Time(now));
    set_condition(
        &mut st.conditions,
        COND_FAILED,
        true,
        reason,
        msg,
        now,
        generation,
    );
    mark_finished(st, now, generation);
    st.ready_replicas = 0;
    // READY of `kubectl get cjob`: a failed job has no ready pods.
    let total = st
        .ready
        .as_deref()
        .and_then(|r| r.split_once('/'))
        .map(|(_, t)| t.to_string())
        .or_else(|| (!st.ranks.is_empty()).then(|| st.ranks.len().to_string()));
    if let Some(total) = total {
        st.ready = Some(format!("0/{total}"));
    }
    p.event(true, reason, "Fail", format!("Job failed: {msg}"));
}

pub(super) fn suspend(
    job: &CollectiveJob,
    views: &[PodView],
    old_phase: Option<JobPhase>,
    now: Timestamp,
    p: &mut Plan,
) {
    let generation = job.metadata.generation;
    let st = &mut p.status;
    abandon_recoveries(st, now, generation);
    for v in views {
        if !v.terminating {
            p.delete_pods.push(v.name.clone());
        }
    }
    if old_phase != Some(JobPhase::Suspended) {
        // Resumed pods are a new incarnation: give them a new epoch so no
        // straggler of the old set can join their rendezvous.
        if st.launched_epoch.is_some() || !views.is_empty() {
            st.restart_epoch += 1;
        }
        st.launched_epoch = None;
        // As for batch Jobs, the deadline clock restarts on resume.
        st.start_time = None;
        p.events.push(PlannedEvent {
            warning: false,
            reason: "Suspended".into(),
            action: "Suspend".into(),
            note: format!("Job suspended; deleting {} pod(s)", p.delete_pods.len()),
        });
    }
    st.phase = Some(JobPhase::Suspended);
    st.ready_replicas = 0;
    st.ready = Some(format!("0/{}", job.spec.replicas));
    st.ranks = rank_table(job, &[]);
    set_condition(
        &mut st.conditions,
        COND_SUSPENDED,
        true,
        "Suspended",
        "runPolicy.suspend is set",
        now,
        generation,
    );
    set_condition(
        &mut st.conditions,
        COND_READY,
        false,
        "Suspended",
        "job is suspended",
        now,
        generation,
    );
}

/// Terminal phase: clean pods per `cleanPodPolicy`, honour the TTL.
pub(super) fn finish(job: &CollectiveJob, views: &[PodView], now: Timestamp, p: &mut Plan) {
    let rp = &job.spec.run_policy;
    for v in views {
        if v.terminating || p.delete_pods.contains(&v.name) {
            continue;
        }
        let delete = match rp.clean_pod_policy {
            CleanPodPolicy::All => true,
            CleanPodPolicy::Running => {
                matches!(v.state, PodState::Pending | PodState::Running { .. })
            }
            CleanPodPolicy::None => false,
        };
        if delete {
            p.delete_pods.push(v.name.clone());
        }
    }
    if let (Some(ttl), Some(done)) = (rp.ttl_seconds_after_finished, &p.status.completion_time) {
        let expiry = done.0 + SignedDuration::from_secs(ttl as i64);
        if now >= expiry {
            p.delete_job = true;
            p.event(
                false,
                "TTLExpired",
                "Delete",
                format!("Deleting job {ttl}s after it finished (ttlSecondsAfterFinished)"),
            );
        } else {
            p.requeue_at_most(secs_until(expiry, now));
        }
    }
}

/// A finished job (Succeeded or Failed) is not ready and not restarting.
pub(super) fn mark_finished(st: &mut CollectiveJobStatus, now: Timestamp, generation: Option<i64>) {
    set_condition(
        &mut st.conditions,
        COND_READY,
        false,
        "Finished",
        "job finished",
        now,
        generation,
    );
    clear_restarting(st, now, generation);
}

pub(super) fn clear_restarting(
    st: &mut CollectiveJobStatus,
    now: Timestamp,
    generation: Option<i64>,
) {
    if crate::status::condition(&st.conditions, COND_RESTARTING).is_some_and(|c| c.status == "True")
    {
        set_condition(
            &mut st.conditions,
            COND_RESTARTING,
            false,
            "Recovered",
            "all pods of the new epoch are running",
            now,
            generation,
        );
    }
}
