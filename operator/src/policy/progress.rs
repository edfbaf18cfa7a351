//! Where a job that neither restarts nor fails stands: the rank table, the
//! ready count, its phase (Pending, Running, Restarting or Succeeded) and
//! the Ready condition.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use super::lifecycle::{clear_restarting, finish, mark_finished};
use super::{COND_READY, COND_SUCCEEDED, Observed, Plan};
use crate::crd::{JobPhase, RankRecovery};
use crate::resources::{pod_name, world_size};
use crate::status::{PodState, PodView, rank_table, set_condition};

/// Updates the status from the pods of the current epoch. `missing`: the
/// replicas without a pod; `still_replacing`: the pods being replaced.
pub(super) fn update(
    obs: &Observed,
    replacing_now: &[RankRecovery],
    missing: &[i32],
    still_replacing: &[String],
    p: &mut Plan,
) {
    let job = obs.job;
    let cur = obs.current_owned();
    fill_rank_table(obs, &cur, replacing_now, p);
    let st = &mut p.status;
    st.ready_replicas = cur.iter().filter(|v| v.ready()).count() as i32;
    st.ready = Some(format!("{}/{}", st.ready_replicas, job.spec.replicas));
    let complete = missing.is_empty() && cur.len() == job.spec.replicas as usize;
    if complete && cur.iter().all(|v| v.state == PodState::Succeeded) {
        succeed(obs, p);
        return;
    }

    let running = complete
        && cur
            .iter()
            .all(|v| matches!(v.state, PodState::Running { .. } | PodState::Succeeded));
    let old_phase = obs.old.phase;
    let new_phase = if running {
        JobPhase::Running
    } else if old_phase == Some(JobPhase::Restarting) {
        JobPhase::Restarting
    } else if old_phase == Some(JobPhase::Running) && !still_replacing.is_empty() {
        // ReplaceRank: the job keeps running while a failed pod is replaced.
        JobPhase::Running
    } else {
        JobPhase::Pending
    };
    p.status.phase = Some(new_phase);
    set_ready_condition(obs, &cur, still_replacing, p);
    if new_phase == JobPhase::Running {
        clear_restarting(&mut p.status, obs.now, obs.generation);
    }
    if old_phase != Some(new_phase) && new_phase == JobPhase::Running {
        p.event(
            false,
            "Running",
            "Run",
            format!(
                "All {} pods running (world size {}, epoch {})",
                job.spec.replicas,
                world_size(job),
                obs.epoch
            ),
        );
    }
}

/// One row per replica; pods about to be created read "Creating", replicas
/// whose replacement is not created yet "Replacing".
fn fill_rank_table(obs: &Observed, cur: &[PodView], replacing_now: &[RankRecovery], p: &mut Plan) {
    let job = obs.job;
    let create_pods = &p.create_pods;
    let st = &mut p.status;
    st.ranks = rank_table(job, cur);
    for (i, row) in st.ranks.iter_mut().enumerate() {
        let pending = replacing_now.iter().find(|r| r.replica_index == i as i32);
        if create_pods.iter().any(|i| pod_name(job, *i) == row.pod) {
            row.phase = "Creating".into();
        } else if let Some(r) = pending
            && row.phase == "Missing"
        {
            row.phase = "Replacing".into();
            row.incarnation = r.incarnation;
        }
        if let Some(r) = pending
            && create_pods.contains(&r.replica_index)
        {
            row.incarnation = r.incarnation;
        }
    }
}

/// Every pod's workload exited 0: the job succeeded.
fn succeed(obs: &Observed, p: &mut Plan) {
    let (now, generation) = (obs.now, obs.generation);
    let st = &mut p.status;
    st.phase = Some(JobPhase::Succeeded);
    st.completion_time = Some(Time(now));
    let msg = format!(
        "all {} pods' workload containers exited 0",
        obs.job.spec.replicas
    );
    set_condition(
        &mut st.conditions,
        COND_SUCCEEDED,
        true,
        "AllRanksSucceeded",
        &msg,
        now,
        generation,
    );
    mark_finished(st, now, generation);
    p.event(
        false,
        "Succeeded",
        "Complete",
        format!("Job succeeded: {msg}"),
    );
    finish(obs.job, obs.all, now, p);
}

/// Ready: all pods ready, or how many are and what holds the others up.
fn set_ready_condition(obs: &Observed, cur: &[PodView], still_replacing: &[String], p: &mut Plan) {
    let replicas = obs.job.spec.replicas;
    let st = &mut p.status;
    let all_ready = st.ready_replicas == replicas;
    let (reason, msg) = if all_ready {
        ("AllPodsReady", format!("all {replicas} pods are ready"))
    } else {
        let mut msg = format!("{} of {replicas} pods ready", st.ready_replicas);
        // Surface the first thing the kubelet is stuck on (bad image, missing
        // ConfigMap, ...), so `kubectl describe cjob` says why it is not running.
        if let Some((pod, why)) = cur
            .iter()
            .find_map(|v| Some((&v.name, v.waiting.as_ref()?)))
        {
            msg.push_str(&format!("; pod {pod}: {why}"));
        }
        if !still_replacing.is_empty() {
            msg.push_str(&format!("; replacing {}", still_replacing.join(", ")));
        }
        ("PodsNotReady", msg)
    };
    set_condition(
        &mut st.conditions,
        COND_READY,
        all_ready,
        reason,
        msg,
        obs.now,
        obs.generation,
    );
}
