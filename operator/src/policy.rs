//! The reconcile decision as a pure function: (job, its pods, now) -> a plan of
//! writes and the new status. The controller only executes plans, so every
//! lifecycle rule (restart, fail, suspend, deadline, TTL, cleanup) is tested
//! here without an API server.

use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::ResourceExt;

use crate::crd::{
    CleanPodPolicy, CollectiveJob, CollectiveJobStatus, FailureAction, FailurePolicy, JobPhase,
    RankFailure, RankRecovery, RecoveryState,
};
use crate::resources::{bootstrap_endpoint, pod_name, validate, world_size};
use crate::status::{PodState, PodView, classify, rank_table, set_condition};

/// Grace beyond a pod's own termination grace period before an old-epoch pod
/// is force-deleted.
pub const FORCE_DELETE_AFTER_SECS: i64 = 60;

pub const COND_READY: &str = "Ready";
pub const COND_RESTARTING: &str = "Restarting";
pub const COND_SUSPENDED: &str = "Suspended";
pub const COND_SUCCEEDED: &str = "Succeeded";
pub const COND_FAILED: &str = "Failed";
pub const COND_REPLACING: &str = "Replacing";

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

/// Outcome of a rank failure under the job's failure policy.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    Restart,
    /// Replace the failed pod only (ReplaceRank within maxReplacements).
    Replace,
    Fail {
        reason: &'static str,
    },
}

/// A failed pod of the current epoch (or a missing one).
struct Failed {
    index: Option<i32>,
    /// The failed pod's incarnation (0 when it is missing).
    incarnation: i32,
    /// The pod exists and is not being deleted yet.
    present: bool,
    failure: RankFailure,
}

/// The decision for one failure, given the restarts and replacements so far.
/// With `ReplaceRank`, a failure beyond `maxReplacements` is handled as
/// `RestartJob`.
pub fn on_rank_failure(
    policy: &FailurePolicy,
    restarts: i32,
    replacements: i32,
    f: &RankFailure,
) -> Decision {
    if let Some(code) = f.exit_code
        && policy.permanent_exit_codes.contains(&code)
    {
        return Decision::Fail {
            reason: "PermanentExitCode",
        };
    }
    match policy.on_rank_failure {
        FailureAction::FailJob => Decision::Fail {
            reason: "RankFailed",
        },
        FailureAction::ReplaceRank if replacements < policy.max_replacements => Decision::Replace,
        FailureAction::RestartJob | FailureAction::ReplaceRank
            if restarts >= policy.max_restarts =>
        {
            Decision::Fail {
                reason: "MaxRestartsExceeded",
            }
        }
        FailureAction::RestartJob | FailureAction::ReplaceRank => Decision::Restart,
    }
}

/// "2-3" (or "2" for a pod of one rank).
fn rank_range(index: i32, ranks_per_replica: i32) -> String {
    let first = index * ranks_per_replica;
    if ranks_per_replica == 1 {
        first.to_string()
    } else {
        format!("{first}-{}", first + ranks_per_replica - 1)
    }
}

/// A terminating pod well past its grace period (typically on a lost node).
fn stuck_terminating(v: &PodView, now: Timestamp) -> bool {
    v.terminating
        && v.delete_deadline
            .is_some_and(|d| now >= d + SignedDuration::from_secs(FORCE_DELETE_AFTER_SECS))
}

/// The job restarts, fails or is suspended: replacements in progress end.
fn abandon_recoveries(st: &mut CollectiveJobStatus, now: Timestamp, generation: Option<i64>) {
    for r in st.recoveries.iter_mut() {
        if r.state == RecoveryState::Replacing {
            r.state = RecoveryState::Abandoned;
            r.ended_at = Some(Time(now));
        }
    }
    if crate::status::condition(&st.conditions, COND_REPLACING).is_some_and(|c| c.status == "True")
    {
        set_condition(
            &mut st.conditions,
            COND_REPLACING,
            false,
            "Abandoned",
            "the job restarted, failed or was suspended before the replacement was ready",
            now,
            generation,
        );
    }
}

/// Drops the oldest ended recovery records beyond [`MAX_RECOVERY_RECORDS`].
fn trim_recoveries(st: &mut CollectiveJobStatus) {
    while st.recoveries.len() > MAX_RECOVERY_RECORDS {
        match st
            .recoveries
            .iter()
            .position(|r| r.state != RecoveryState::Replacing)
        {
            Some(i) => {
                st.recoveries.remove(i);
            }
            None => break,
        }
    }
}

/// "pod j-1 (container main, exit code 3, Error)".
pub fn describe_failure(f: &RankFailure) -> String {
    let mut parts = vec![];
    if let Some(c) = &f.container {
        parts.push(format!("container {c}"));
    }
    if let Some(code) = f.exit_code {
        parts.push(format!("exit code {code}"));
    }
    parts.push(f.reason.clone());
    let mut s = format!("pod {} ({})", f.pod, parts.join(", "));
    if !f.message.is_empty() {
        s.push_str(": ");
        s.push_str(&f.message);
    }
    s
}

fn secs_until(t: Timestamp, now: Timestamp) -> i64 {
    t.as_second() - now.as_second()
}

/// Computes the plan for `job` given all pods that carry its label and are
/// owned by it.
pub fn plan(job: &CollectiveJob, pods: &[Pod], now: Timestamp) -> Plan {
    let old = job.status.clone().unwrap_or_default();
    let generation = job.metadata.generation;
    let mut p = Plan {
        status: old.clone(),
        ..Plan::default()
    };
    let views: Vec<PodView> = pods.iter().map(classify).collect();
    {
        let st = &mut p.status;
        st.world_size = world_size(job);
        st.bootstrap_endpoint = Some(bootstrap_endpoint(job));
        st.observed_generation = generation;
        // The job decodes (we are here): drop the controller's mark.
        st.conditions.retain(|c| c.type_ != COND_DECODABLE);
    }

    if old.phase.is_some_and(JobPhase::is_terminal) {
        finish(job, &views, now, &mut p);
        return p;
    }
    if let Err(msg) = validate(job) {
        fail(&mut p, "InvalidSpec", &msg, now, generation);
        finish(job, &views, now, &mut p);
        return p;
    }

    if job.spec.run_policy.suspend {
        suspend(job, &views, old.phase, now, &mut p);
        return p;
    }
    if old.phase == Some(JobPhase::Suspended) {
        set_condition(
            &mut p.status.conditions,
            COND_SUSPENDED,
            false,
            "Resumed",
            "runPolicy.suspend was cleared",
            now,
            generation,
        );
        p.event(
            false,
            "Resumed",
            "Resume",
            "Job resumed; pods are recreated",
        );
    }

    // Deadline: counts time since the pods of the (last resumed) run were first created.
    if let (Some(limit), Some(start)) =
        (job.spec.run_policy.active_deadline_seconds, &old.start_time)
    {
        let deadline = start.0 + SignedDuration::from_secs(limit);
        if now >= deadline {
            let msg = format!("job ran longer than activeDeadlineSeconds ({limit}s)");
            fail(&mut p, "DeadlineExceeded", &msg, now, generation);
            finish(job, &views, now, &mut p);
            return p;
        }
        p.requeue_at_most(secs_until(deadline, now));
    }

    let epoch = old.restart_epoch;
    let (mut current, stale): (Vec<&PodView>, Vec<&PodView>) =
        views.iter().partition(|v| v.epoch == Some(epoch));
    current.sort_by_key(|v| v.index);

    // Pods of older epochs: leftovers of a restart or suspension.
    for s in &stale {
        if !s.terminating {
            p.delete_pods.push(s.name.clone());
        } else if stuck_terminating(s, now) {
            // A pod on a lost node stays Terminating until its kubelet returns,
            // and it holds the name the new epoch's pod needs.
            p.force_delete_pods.push(s.name.clone());
        }
    }

    // Replacements in progress (onRankFailure: ReplaceRank): the pod of an
    // older incarnation is on its way out (deleted now if an earlier delete
    // was lost, force-deleted when stuck on a lost node); it is not a failure.
    let replacing: Vec<RankRecovery> = old
        .recoveries
        .iter()
        .filter(|r| r.state == RecoveryState::Replacing && r.epoch == epoch)
        .cloned()
        .collect();
    let being_replaced = |v: &PodView| {
        replacing
            .iter()
            .any(|r| Some(r.replica_index) == v.index && v.incarnation < r.incarnation)
    };
    for v in current.iter().filter(|v| being_replaced(v)) {
        if !v.terminating {
            p.delete_pods.push(v.name.clone());
        } else if stuck_terminating(v, now) {
            p.force_delete_pods.push(v.name.clone());
        }
    }

    // Rank failures: a failed container, a failed pod, or a pod of this epoch
    // deleted behind our back (the operator never deletes pods of the current
    // epoch without moving to a new epoch, a final phase or a replacement
    // first), in replica order.
    let mut failures: Vec<Failed> = current
        .iter()
        .filter(|v| !being_replaced(v))
        .filter_map(|v| {
            let f =
                if v.terminating && !matches!(v.state, PodState::Failed(_) | PodState::Succeeded) {
                    Some(RankFailure {
                        pod: v.name.clone(),
                        container: None,
                        exit_code: None,
                        reason: "PodDeleted".into(),
                        message: "pod was deleted while the job was running".into(),
                        epoch,
                    })
                } else {
                    v.failure(epoch)
                }?;
            Some(Failed {
                index: v.index,
                incarnation: v.incarnation,
                present: !v.terminating,
                failure: f,
            })
        })
        .collect();
    if old.launched_epoch == Some(epoch) {
        for i in 0..job.spec.replicas {
            let absent = !current.iter().any(|v| v.index == Some(i));
            if absent && !replacing.iter().any(|r| r.replica_index == i) {
                failures.push(Failed {
                    index: Some(i),
                    incarnation: 0,
                    present: false,
                    failure: RankFailure {
                        pod: pod_name(job, i),
                        container: None,
                        exit_code: None,
                        reason: "PodDeleted".into(),
                        message: "pod disappeared while the job was running".into(),
                        epoch,
                    },
                });
            }
        }
    }

    if !failures.is_empty() {
        // Replace what the policy allows, in replica order; the first failure
        // it does not allow decides for the whole job.
        let policy = &job.spec.failure_policy;
        let mut replacements = old.replacements;
        let mut to_replace: Vec<&Failed> = vec![];
        let mut verdict: Option<(Decision, &Failed)> = None;
        for fl in &failures {
            match on_rank_failure(policy, old.restarts, replacements, &fl.failure) {
                Decision::Replace if fl.index.is_some() => {
                    replacements += 1;
                    to_replace.push(fl);
                }
                // A pod without a replica index cannot be replaced.
                Decision::Replace => {
                    let d = on_rank_failure(policy, old.restarts, i32::MAX, &fl.failure);
                    verdict = Some((d, fl));
                    break;
                }
                d => {
                    verdict = Some((d, fl));
                    break;
                }
            }
        }
        let reported: Vec<&Failed> = match &verdict {
            Some((_, fl)) => vec![*fl],
            None => to_replace.clone(),
        };
        for fl in &reported {
            p.event(
                true,
                "RankFailed",
                "DetectFailure",
                format!("Rank failure in {}", describe_failure(&fl.failure)),
            );
        }
        if let Some((decision, fl)) = verdict {
            let f = fl.failure.clone();
            let what = describe_failure(&f);
            p.status.last_failure = Some(f.clone());
            let exhausted = policy.on_rank_failure == FailureAction::ReplaceRank
                && replacements >= policy.max_replacements
                && decision
                    != Decision::Fail {
                        reason: "PermanentExitCode",
                    };
            if exhausted {
                p.event(
                    true,
                    "ReplacementsExhausted",
                    "ReplaceRank",
                    format!(
                        "the failure of pod {} is beyond maxReplacements {} ({} pod(s) replaced so far): it acts on the whole job",
                        f.pod, policy.max_replacements, old.replacements
                    ),
                );
            }
            abandon_recoveries(&mut p.status, now, generation);
            match decision {
                Decision::Restart | Decision::Replace => {
                    for v in &current {
                        if !v.terminating {
                            p.delete_pods.push(v.name.clone());
                        }
                    }
                    let st = &mut p.status;
                    st.restarts += 1;
                    st.restart_epoch += 1;
                    st.phase = Some(JobPhase::Restarting);
                    st.ready_replicas = 0;
                    st.ready = Some(format!("0/{}", job.spec.replicas));
                    let mut msg = format!(
                        "restart {}/{} after rank failure in {what}; new epoch {}",
                        st.restarts, policy.max_restarts, st.restart_epoch
                    );
                    if exhausted {
                        msg.push_str(&format!(
                            " (maxReplacements {} used up)",
                            policy.max_replacements
                        ));
                    }
                    set_condition(
                        &mut st.conditions,
                        COND_RESTARTING,
                        true,
                        "RankFailed",
                        &msg,
                        now,
                        generation,
                    );
                    set_condition(
                        &mut st.conditions,
                        COND_READY,
                        false,
                        "Restarting",
                        &msg,
                        now,
                        generation,
                    );
                    p.event(false, "Restarting", "RestartJob", msg);
                }
                Decision::Fail { reason } => {
                    let mut msg = match reason {
                        "MaxRestartsExceeded" => format!(
                            "rank failure in {what} after {} restarts (maxRestarts {})",
                            old.restarts, policy.max_restarts
                        ),
                        "PermanentExitCode" => {
                            format!("rank failure in {what}: exit code is permanent")
                        }
                        _ => format!("rank failure in {what} (onRankFailure: FailJob)"),
                    };
                    if exhausted {
                        msg.push_str(&format!(
                            " and {} replacements (maxReplacements {})",
                            old.replacements, policy.max_replacements
                        ));
                    }
                    fail(&mut p, reason, &msg, now, generation);
                    p.status.ranks = rank_table(job, &owned(&current));
                    finish(job, &views, now, &mut p);
                }
            }
            return p;
        }

        // Replace each failed pod; the others keep running.
        let rpr = job.spec.ranks_per_replica;
        for fl in to_replace {
            let f = &fl.failure;
            let i = fl.index.expect("only indexed pods are replaced");
            if fl.present {
                p.delete_pods.push(f.pod.clone());
            }
            let st = &mut p.status;
            // The replacement of this replica failed itself before it was ready.
            for r in st.recoveries.iter_mut() {
                if r.state == RecoveryState::Replacing && r.epoch == epoch && r.replica_index == i {
                    r.state = RecoveryState::ReplacementFailed;
                    r.ended_at = Some(Time(now));
                }
            }
            let incarnation = st
                .recoveries
                .iter()
                .filter(|r| r.epoch == epoch && r.replica_index == i)
                .map(|r| r.incarnation)
                .chain([fl.incarnation])
                .max()
                .unwrap_or(0)
                + 1;
            st.replacements += 1;
            st.recoveries.push(RankRecovery {
                pod: f.pod.clone(),
                replica_index: i,
                first_rank: i * rpr,
                ranks: rpr,
                epoch,
                incarnation,
                count: st.replacements,
                reason: f.reason.clone(),
                container: f.container.clone(),
                exit_code: f.exit_code,
                message: f.message.clone(),
                state: RecoveryState::Replacing,
                failed_at: Time(now),
                ended_at: None,
                time_lost_seconds: None,
            });
            st.last_failure = Some(f.clone());
            let note = format!(
                "replacing pod {} (ranks {}) with incarnation {incarnation}, replacement {}/{}; the other pods keep running",
                f.pod,
                rank_range(i, rpr),
                st.replacements,
                job.spec.failure_policy.max_replacements
            );
            p.event(false, "ReplacingRank", "ReplaceRank", note);
        }
        trim_recoveries(&mut p.status);
    }

    // The pods being replaced and the replacements.
    let replacing_now: Vec<RankRecovery> = p
        .status
        .recoveries
        .iter()
        .filter(|r| r.state == RecoveryState::Replacing && r.epoch == epoch)
        .cloned()
        .collect();
    let is_replacement = |i: i32| replacing_now.iter().any(|r| r.replica_index == i);
    // Create missing pods of this epoch, once no older pod holds their names.
    let missing: Vec<i32> = (0..job.spec.replicas)
        .filter(|i| !current.iter().any(|v| v.index == Some(*i)))
        .collect();
    p.ensure_base = true;
    if !missing.is_empty() {
        let blocked = missing
            .iter()
            .any(|i| stale.iter().any(|s| s.name == pod_name(job, *i)));
        if blocked {
            // The deletion of the old pods will trigger the next reconcile;
            // the requeue is a safety net.
            p.requeue_at_most(5);
        } else {
            p.create_pods = missing.clone();
            let (replacements, fresh): (Vec<i32>, Vec<i32>) =
                missing.iter().partition(|i| is_replacement(**i));
            p.replacements_only = fresh.is_empty();
            p.status.launched_epoch = Some(epoch);
            if p.status.start_time.is_none() {
                p.status.start_time = Some(Time(now));
                if let Some(limit) = job.spec.run_policy.active_deadline_seconds {
                    p.requeue_at_most(limit);
                }
            }
            if !fresh.is_empty() {
                p.event(
                    false,
                    "PodsCreated",
                    "CreatePods",
                    format!(
                        "Created {} pod(s) for epoch {epoch} (world size {}, bootstrap {})",
                        fresh.len(),
                        world_size(job),
                        bootstrap_endpoint(job)
                    ),
                );
            }
            for i in replacements {
                p.event(
                    false,
                    "ReplacementCreated",
                    "CreatePods",
                    format!(
                        "Created pod {} (ranks {}) of epoch {epoch}, incarnation {}, to replace the failed one",
                        pod_name(job, i),
                        rank_range(i, job.spec.ranks_per_replica),
                        p.incarnation(i)
                    ),
                );
            }
            // Allowed (e.g. several ranks sharing a GPU), but usually a typo.
            let gpus = pod_gpus(job);
            if !fresh.is_empty() && gpus > 0 && gpus != job.spec.ranks_per_replica as i64 {
                p.event(
                    true,
                    "GPUCountMismatch",
                    "CreatePods",
                    format!(
                        "each pod requests {gpus} nvidia.com/gpu but runs ranksPerReplica={} ranks",
                        job.spec.ranks_per_replica
                    ),
                );
            }
        }
    }

    // A replacement that is ready ends its recovery.
    let rpr = job.spec.ranks_per_replica;
    for r in p.status.recoveries.iter_mut() {
        if r.state != RecoveryState::Replacing || r.epoch != epoch {
            continue;
        }
        let back = current.iter().any(|v| {
            v.index == Some(r.replica_index) && v.incarnation >= r.incarnation && v.ready()
        });
        if back {
            let lost = now.as_second() - r.failed_at.0.as_second();
            r.state = RecoveryState::Recovered;
            r.ended_at = Some(Time(now));
            r.time_lost_seconds = Some(lost);
            let note = format!(
                "pod {} (ranks {}) is back: incarnation {} ready {lost}s after the failure ({})",
                r.pod,
                rank_range(r.replica_index, rpr),
                r.incarnation,
                r.reason
            );
            p.events.push(PlannedEvent {
                warning: false,
                reason: "RankReplaced".into(),
                action: "ReplaceRank".into(),
                note,
            });
        }
    }
    let still_replacing: Vec<String> = p
        .status
        .recoveries
        .iter()
        .filter(|r| r.state == RecoveryState::Replacing && r.epoch == epoch)
        .map(|r| format!("{} (incarnation {})", r.pod, r.incarnation))
        .collect();
    if !still_replacing.is_empty() {
        set_condition(
            &mut p.status.conditions,
            COND_REPLACING,
            true,
            "RankFailed",
            format!(
                "replacing pod(s) {}; the other pods keep running",
                still_replacing.join(", ")
            ),
            now,
            generation,
        );
    } else if crate::status::condition(&p.status.conditions, COND_REPLACING)
        .is_some_and(|c| c.status == "True")
    {
        set_condition(
            &mut p.status.conditions,
            COND_REPLACING,
            false,
            "Recovered",
            "every replaced pod is ready",
            now,
            generation,
        );
    }

    let cur = owned(&current);
    let st = &mut p.status;
    st.ranks = rank_table(job, &cur);
    for (i, row) in st.ranks.iter_mut().enumerate() {
        let pending = replacing_now.iter().find(|r| r.replica_index == i as i32);
        if p.create_pods.iter().any(|i| pod_name(job, *i) == row.pod) {
            row.phase = "Creating".into();
        } else if let Some(r) = pending
            && row.phase == "Missing"
        {
            row.phase = "Replacing".into();
            row.incarnation = r.incarnation;
        }
        if let Some(r) = pending
            && p.create_pods.contains(&r.replica_index)
        {
            row.incarnation = r.incarnation;
        }
    }
    st.ready_replicas = cur.iter().filter(|v| v.ready()).count() as i32;
    st.ready = Some(format!("{}/{}", st.ready_replicas, job.spec.replicas));
    let complete = missing.is_empty() && cur.len() == job.spec.replicas as usize;

    if complete && cur.iter().all(|v| v.state == PodState::Succeeded) {
        st.phase = Some(JobPhase::Succeeded);
        st.completion_time = Some(Time(now));
        let msg = format!(
            "all {} pods' workload containers exited 0",
            job.spec.replicas
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
        p.event(
            false,
            "Succeeded",
            "Complete",
            format!("Job succeeded: {msg}"),
        );
        finish(job, &views, now, &mut p);
        return p;
    }

    let running = complete
        && cur
            .iter()
            .all(|v| matches!(v.state, PodState::Running { .. } | PodState::Succeeded));
    let new_phase = if running {
        JobPhase::Running
    } else if old.phase == Some(JobPhase::Restarting) {
        JobPhase::Restarting
    } else if old.phase == Some(JobPhase::Running) && !still_replacing.is_empty() {
        // ReplaceRank: the job keeps running while a failed pod is replaced.
        JobPhase::Running
    } else {
        JobPhase::Pending
    };
    st.phase = Some(new_phase);
    let all_ready = st.ready_replicas == job.spec.replicas;
    let (reason, msg) = if all_ready {
        (
            "AllPodsReady",
            format!("all {} pods are ready", job.spec.replicas),
        )
    } else {
        let mut msg = format!("{} of {} pods ready", st.ready_replicas, job.spec.replicas);
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
        now,
        generation,
    );
    if new_phase == JobPhase::Running {
        clear_restarting(st, now, generation);
    }
    if old.phase != Some(new_phase) && new_phase == JobPhase::Running {
        p.event(
            false,
            "Running",
            "Run",
            format!(
                "All {} pods running (world size {}, epoch {epoch})",
                job.spec.replicas,
                world_size(job)
            ),
        );
    }
    p
}

/// GPUs requested by one pod of the job (sum over its workload containers).
fn pod_gpus(job: &CollectiveJob) -> i64 {
    job.spec
        .template
        .spec
        .as_ref()
        .map(|s| {
            s.containers
                .iter()
                .map(crate::resources::container_gpus)
                .sum()
        })
        .unwrap_or(0)
}

fn owned(v: &[&PodView]) -> Vec<PodView> {
    v.iter().map(|p| (*p).clone()).collect()
}

fn clear_restarting(st: &mut CollectiveJobStatus, now: Timestamp, generation: Option<i64>) {
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

/// The API server refused, for good (400 Bad Request, 422 Invalid), an object
/// built from the job (`what`: "Pod", "Service", ...): the job fails with the
/// server's message instead of retrying a request that cannot succeed.
pub fn api_refused(
    job: &CollectiveJob,
    p: &mut Plan,
    what: &str,
    api_message: &str,
    now: Timestamp,
) {
    p.create_pods.clear();
    p.events.retain(|e| e.action != "CreatePods");
    p.status.launched_epoch = None;
    let msg = format!("the API server refused the job's {what}: {api_message}");
    fail(p, "InvalidSpec", &msg, now, job.metadata.generation);
}

/// The API server refused a Pod built from the template (the CRD checks only
/// the template's outline).
pub fn pod_refused(job: &CollectiveJob, p: &mut Plan, api_message: &str, now: Timestamp) {
    api_refused(job, p, "Pod", api_message, now);
}

/// Creating the job's objects failed for a reason that may pass (403 from a
/// ResourceQuota or a missing PriorityClass, 409, 429, ...). The gang is
/// all-or-nothing: the controller deleted the pods of this epoch it had
/// created (`rolled_back`), so the next attempt uses a new epoch and no pod
/// of a partial gang holds quota meanwhile. The job stays Pending with the
/// server's message in its Ready condition and a Warning event; it is retried
/// after `retry_in`.
pub fn creation_blocked(
    job: &CollectiveJob,
    p: &mut Plan,
    reason: &str,
    api_message: &str,
    rolled_back: usize,
    retry_in: Duration,
    now: Timestamp,
) {
    let old = job.status.clone().unwrap_or_default();
    p.create_pods.clear();
    p.events.retain(|e| e.action != "CreatePods");
    let st = &mut p.status;
    st.launched_epoch = old.launched_epoch;
    if rolled_back > 0 {
        // The deleted pods are of an abandoned epoch, not rank failures.
        st.restart_epoch = old.restart_epoch.max(st.restart_epoch) + 1;
    }
    for row in st.ranks.iter_mut() {
        if row.phase == "Creating" {
            row.phase = "Missing".into();
        }
    }
    if st.phase.is_none() {
        st.phase = Some(JobPhase::Pending);
    }
    let mut msg = format!("cannot create the job's pods: {api_message}");
    if rolled_back > 0 {
        msg.push_str(&format!(
            "; deleted the {rolled_back} pod(s) already created (all-or-nothing)"
        ));
    }
    msg.push_str(&format!("; retrying in {}s", retry_in.as_secs()));
    set_condition(
        &mut st.conditions,
        COND_READY,
        false,
        reason,
        &msg,
        now,
        job.metadata.generation,
    );
    p.event(true, "CreatePodsFailed", "CreatePods", msg);
    p.requeue_at_most(retry_in.as_secs() as i64);
}

/// Condition set on a CollectiveJob the operator cannot decode (written by the
/// controller from the raw object); removed once the job decodes again.
pub const COND_DECODABLE: &str = "Decodable";

fn fail(p: &mut Plan, reason: &str, msg: &str, now: Timestamp, generation: Option<i64>) {
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

fn suspend(
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
fn finish(job: &CollectiveJob, views: &[PodView], now: Timestamp, p: &mut Plan) {
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
    let _ = job.name_any();
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resources::{OperatorConfig, desired_pod, tests::job};
    use crate::status::tests::{cs_exited, cs_running, with_status};

    fn t(s: i64) -> Timestamp {
        Timestamp::from_second(1_800_000_000 + s).unwrap()
    }

    /// Applies a plan the way the API server would (pods created/deleted at
    /// once, status stored), returning the job and its pods.
    fn apply(mut j: CollectiveJob, mut pods: Vec<Pod>, p: &Plan) -> (CollectiveJob, Vec<Pod>) {
        pods.retain(|x| !p.delete_pods.contains(&x.name_any()));
        for i in &p.create_pods {
            pods.push(crate::resources::desired_pod_incarnation(
                &j,
                *i,
                p.status.restart_epoch,
                p.incarnation(*i),
                &OperatorConfig::default(),
            ));
        }
        j.status = Some(p.status.clone());
        (j, pods)
    }

    fn set_all(pods: Vec<Pod>, phase: &str, ready: bool, code: Option<i32>) -> Vec<Pod> {
        pods.into_iter()
            .map(|p| {
                let cs = match code {
                    Some(c) => cs_exited("main", c),
                    None => cs_running("main"),
                };
                with_status(p, phase, ready, vec![cs])
            })
            .collect()
    }

    fn phase(p: &Plan) -> JobPhase {
        p.status.phase.unwrap()
    }

    fn reasons(p: &Plan) -> Vec<&str> {
        p.events.iter().map(|e| e.reason.as_str()).collect()
    }

    #[test]
    fn fresh_job_creates_all_pods_and_base() {
        let j = job("a", 3, 2);
        let p = plan(&j, &[], t(0));
        assert!(p.ensure_base);
        assert_eq!(p.create_pods, [0, 1, 2]);
        assert_eq!(phase(&p), JobPhase::Pending);
        assert_eq!(p.status.launched_epoch, Some(0));
        assert_eq!(p.status.world_size, 6);
        assert_eq!(
            p.status.bootstrap_endpoint.as_deref(),
            Some("a-0.a.ml.svc:29400")
        );
        assert_eq!(p.status.start_time, Some(Time(t(0))));
        assert_eq!(p.status.observed_generation, Some(1));
        assert_eq!(p.status.ranks.len(), 3);
        assert!(p.status.ranks.iter().all(|r| r.phase == "Creating"));
        assert_eq!(reasons(&p), ["PodsCreated"]);
    }

    #[test]
    fn gpu_count_mismatch_is_a_warning_event() {
        use k8s_openapi::api::core::v1::ResourceRequirements;
        use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
        let with_gpus = |rpr: i32, gpus: &str| {
            let mut j = job("g", 1, rpr);
            j.spec.template.spec.as_mut().unwrap().containers[0].resources =
                Some(ResourceRequirements {
                    limits: Some([("nvidia.com/gpu".to_string(), Quantity(gpus.into()))].into()),
                    ..ResourceRequirements::default()
                });
            j
        };
        let p = plan(&with_gpus(8, "8"), &[], t(0));
        assert_eq!(reasons(&p), ["PodsCreated"]);
        let p = plan(&with_gpus(8, "4"), &[], t(0));
        assert_eq!(reasons(&p), ["PodsCreated", "GPUCountMismatch"]);
        assert!(p.events[1].warning);
        assert_eq!(p.create_pods, [0], "a warning, not a refusal");
    }

    #[test]
    fn steady_state_is_idempotent() {
        let j = job("a", 2, 1);
        let p = plan(&j, &[], t(0));
        let (j, pods) = apply(j, vec![], &p);
        let pods = set_all(pods, "Running", true, None);
        let p1 = plan(&j, &pods, t(1));
        assert_eq!(phase(&p1), JobPhase::Running);
        assert_eq!(p1.status.ready.as_deref(), Some("2/2"));
        assert_eq!(reasons(&p1), ["Running"]);
        let (j, pods) = apply(j, pods, &p1);
        let p2 = plan(&j, &pods, t(2));
        assert!(p2.create_pods.is_empty() && p2.delete_pods.is_empty());
        assert!(p2.events.is_empty());
        assert_eq!(
            Some(&p2.status),
            j.status.as_ref(),
            "no status change, no write"
        );
    }

    #[test]
    fn success_when_every_workload_exits_zero() {
        let j = job("a", 2, 1);
        let p = plan(&j, &[], t(0));
        let (j, pods) = apply(j, vec![], &p);
        let mut pods = set_all(pods, "Running", true, None);
        pods[0] = with_status(
            pods[0].clone(),
            "Succeeded",
            false,
            vec![cs_exited("main", 0)],
        );
        let p = plan(&j, &pods, t(5));
        assert_eq!(phase(&p), JobPhase::Running);
        let pods = set_all(pods, "Succeeded", false, Some(0));
        let p = plan(&j, &pods, t(9));
        assert_eq!(phase(&p), JobPhase::Succeeded);
        assert_eq!(p.status.completion_time, Some(Time(t(9))));
        assert!(reasons(&p).contains(&"Succeeded"));
        // cleanPodPolicy Running: finished pods are kept
        assert!(p.delete_pods.is_empty());
    }

    #[test]
    fn failure_restarts_with_new_epoch_then_recreates() {
        let j = job("a", 2, 4);
        let p = plan(&j, &[], t(0));
        let (j, pods) = apply(j, vec![], &p);
        let mut pods = set_all(pods, "Running", true, None);
        pods[1] = with_status(
            pods[1].clone(),
            "Failed",
            false,
            vec![cs_exited("main", 137)],
        );
        let p = plan(&j, &pods, t(3));
        assert_eq!(phase(&p), JobPhase::Restarting);
        assert_eq!(p.status.restarts, 1);
        assert_eq!(p.status.restart_epoch, 1);
        assert_eq!(p.delete_pods, ["a-0", "a-1"]);
        assert!(
            p.create_pods.is_empty(),
            "names still taken by the old pods"
        );
        let f = p.status.last_failure.as_ref().unwrap();
        assert_eq!(
            (f.pod.as_str(), f.container.as_deref(), f.exit_code),
            ("a-1", Some("main"), Some(137))
        );
        assert_eq!(reasons(&p), ["RankFailed", "Restarting"]);
        // old pods gone: new epoch created
        let (j, pods) = apply(j, pods, &p);
        assert!(pods.is_empty());
        let p = plan(&j, &pods, t(4));
        assert_eq!(p.create_pods, [0, 1]);
        assert_eq!(phase(&p), JobPhase::Restarting);
        assert_eq!(p.status.launched_epoch, Some(1));
        let (j, pods) = apply(j, pods, &p);
        let env = &pods[0].spec.as_ref().unwrap().containers[0]
            .env
            .as_ref()
            .unwrap();
        assert!(
            env.iter()
                .any(|e| e.name == "WEFT_RESTART_EPOCH" && e.value.as_deref() == Some("1"))
        );
        let pods = set_all(pods, "Running", true, None);
        let p = plan(&j, &pods, t(5));
        assert_eq!(phase(&p), JobPhase::Running);
        let c = crate::status::condition(&p.status.conditions, COND_RESTARTING).unwrap();
        assert_eq!(
            (c.status.as_str(), c.reason.as_str()),
            ("False", "Recovered")
        );
    }

    #[test]
    fn stale_terminating_pods_block_recreation() {
        let j = job("a", 2, 1);
        let p = plan(&j, &[], t(0));
        let (mut j, pods) = apply(j, vec![], &p);
        // restart decided: epoch 1, old pods still terminating
        let mut st = j.status.clone().unwrap();
        st.restart_epoch = 1;
        st.phase = Some(JobPhase::Restarting);
        j.status = Some(st);
        let pods: Vec<Pod> = pods
            .into_iter()
            .map(|mut p| {
                p.metadata.deletion_timestamp = Some(Time(t(1)));
                p
            })
            .collect();
        let p = plan(&j, &pods, t(2));
        assert!(p.create_pods.is_empty());
        assert!(p.delete_pods.is_empty(), "already terminating");
        assert_eq!(phase(&p), JobPhase::Restarting);
        assert!(p.requeue_after.is_some());
    }

    #[test]
    fn old_pods_stuck_terminating_are_force_deleted() {
        let j = job("a", 1, 1);
        let p = plan(&j, &[], t(0));
        let (mut j, pods) = apply(j, vec![], &p);
        let mut st = j.status.clone().unwrap();
        st.restart_epoch = 1;
        st.phase = Some(JobPhase::Restarting);
        j.status = Some(st);
        let mut pod = pods[0].clone();
        pod.metadata.deletion_timestamp = Some(Time(t(30)));
        let p = plan(&j, std::slice::from_ref(&pod), t(60));
        assert!(p.force_delete_pods.is_empty(), "still within grace");
        let p = plan(
            &j,
            std::slice::from_ref(&pod),
            t(30 + FORCE_DELETE_AFTER_SECS),
        );
        assert_eq!(p.force_delete_pods, ["a-0"]);
        assert!(p.create_pods.is_empty());
    }

    #[test]
    fn max_restarts_then_failed_naming_pod_container_code() {
        let mut j = job("a", 2, 1);
        j.spec.failure_policy.max_restarts = 1;
        let p = plan(&j, &[], t(0));
        let (j, pods) = apply(j, vec![], &p);
        let mut pods = set_all(pods, "Running", true, None);
        pods[0] = with_status(
            pods[0].clone(),
            "Running",
            false,
            vec![cs_exited("main", 2)],
        );
        let p = plan(&j, &pods, t(1));
        assert_eq!(phase(&p), JobPhase::Restarting);
        let (j, pods) = apply(j, pods, &p);
        let p = plan(&j, &pods, t(2));
        let (j, pods) = apply(j, pods, &p);
        let mut pods = set_all(pods, "Running", true, None);
        pods[1] = with_status(pods[1].clone(), "Failed", false, vec![cs_exited("main", 9)]);
        let p = plan(&j, &pods, t(3));
        assert_eq!(phase(&p), JobPhase::Failed);
        assert_eq!(p.status.restarts, 1);
        let c = crate::status::condition(&p.status.conditions, COND_FAILED).unwrap();
        assert_eq!(c.reason, "MaxRestartsExceeded");
        assert!(
            c.message.contains("pod a-1")
                && c.message.contains("container main")
                && c.message.contains("exit code 9"),
            "{}",
            c.message
        );
        // cleanPodPolicy Running: the surviving running pod is deleted, the failed one kept
        assert_eq!(p.delete_pods, ["a-0"]);
        assert_eq!(p.status.completion_time, Some(Time(t(3))));
        // terminal is sticky
        let (j, pods) = apply(j, pods, &p);
        let p = plan(&j, &pods, t(4));
        assert_eq!(phase(&p), JobPhase::Failed);
        assert!(p.create_pods.is_empty() && p.events.is_empty());
    }

    #[test]
    fn restart_decisions() {
        let f = |code| RankFailure {
            pod: "p".into(),
            container: Some("c".into()),
            exit_code: code,
            reason: "Error".into(),
            message: String::new(),
            epoch: 0,
        };
        let mut pol = FailurePolicy::default();
        assert_eq!(on_rank_failure(&pol, 0, 0, &f(Some(1))), Decision::Restart);
        assert_eq!(on_rank_failure(&pol, 2, 0, &f(None)), Decision::Restart);
        assert_eq!(
            on_rank_failure(&pol, 3, 0, &f(Some(1))),
            Decision::Fail {
                reason: "MaxRestartsExceeded"
            }
        );
        pol.permanent_exit_codes = vec![42];
        assert_eq!(
            on_rank_failure(&pol, 0, 0, &f(Some(42))),
            Decision::Fail {
                reason: "PermanentExitCode"
            }
        );
        assert_eq!(on_rank_failure(&pol, 0, 0, &f(Some(41))), Decision::Restart);
        pol.on_rank_failure = FailureAction::ReplaceRank;
        pol.max_replacements = 2;
        assert_eq!(on_rank_failure(&pol, 0, 0, &f(Some(1))), Decision::Replace);
        assert_eq!(on_rank_failure(&pol, 0, 1, &f(None)), Decision::Replace);
        assert_eq!(on_rank_failure(&pol, 0, 2, &f(Some(1))), Decision::Restart);
        assert_eq!(
            on_rank_failure(&pol, 3, 2, &f(Some(1))),
            Decision::Fail {
                reason: "MaxRestartsExceeded"
            }
        );
        assert_eq!(
            on_rank_failure(&pol, 0, 0, &f(Some(42))),
            Decision::Fail {
                reason: "PermanentExitCode"
            }
        );
        pol.on_rank_failure = FailureAction::FailJob;
        assert_eq!(
            on_rank_failure(&pol, 0, 0, &f(Some(1))),
            Decision::Fail {
                reason: "RankFailed"
            }
        );
        pol = FailurePolicy {
            max_restarts: 0,
            ..FailurePolicy::default()
        };
        assert_eq!(
            on_rank_failure(&pol, 0, 0, &f(Some(1))),
            Decision::Fail {
                reason: "MaxRestartsExceeded"
            }
        );
    }

    #[test]
    fn permanent_exit_code_fails_without_restart() {
        let mut j = job("a", 1, 1);
        j.spec.failure_policy.permanent_exit_codes = vec![64];
        let p = plan(&j, &[], t(0));
        let (j, pods) = apply(j, vec![], &p);
        let pods = set_all(pods, "Failed", false, Some(64));
        let p = plan(&j, &pods, t(1));
        assert_eq!(phase(&p), JobPhase::Failed);
        assert_eq!(p.status.restarts, 0);
        assert!(reasons(&p).contains(&"PermanentExitCode"));
    }

    #[test]
    fn pod_deleted_by_hand_is_a_failure_not_silently_recreated() {
        let j = job("a", 3, 1);
        let p = plan(&j, &[], t(0));
        let (j, pods) = apply(j, vec![], &p);
        let mut pods = set_all(pods, "Running", true, None);
        pods.remove(1);
        let p = plan(&j, &pods, t(1));
        assert!(p.create_pods.is_empty());
        assert_eq!(phase(&p), JobPhase::Restarting);
        let f = p.status.last_failure.unwrap();
        assert_eq!((f.pod.as_str(), f.reason.as_str()), ("a-1", "PodDeleted"));
        // also while it is still terminating
        let (j, _) = apply(job("a", 1, 1), vec![], &plan(&job("a", 1, 1), &[], t(0)));
        let mut pod = desired_pod(&j, 0, 0, &OperatorConfig::default());
        pod = with_status(pod, "Running", true, vec![cs_running("main")]);
        pod.metadata.deletion_timestamp = Some(Time(t(1)));
        let p = plan(&j, &[pod], t(1));
        assert_eq!(p.status.last_failure.unwrap().reason, "PodDeleted");
    }

    #[test]
    fn partially_created_epoch_is_completed_not_failed() {
        // controller crashed after creating pod 0 of 2, before writing status
        let j = job("a", 2, 1);
        let pod0 = desired_pod(&j, 0, 0, &OperatorConfig::default());
        let p = plan(&j, &[pod0], t(0));
        assert_eq!(p.create_pods, [1]);
        assert!(p.status.last_failure.is_none());
    }

    #[test]
    fn suspend_and_resume() {
        let j = job("a", 2, 1);
        let p = plan(&j, &[], t(0));
        let (mut j, pods) = apply(j, vec![], &p);
        let pods = set_all(pods, "Running", true, None);
        j.spec.run_policy.suspend = true;
        let p = plan(&j, &pods, t(1));
        assert_eq!(phase(&p), JobPhase::Suspended);
        assert_eq!(p.delete_pods, ["a-0", "a-1"]);
        assert_eq!(p.status.restart_epoch, 1);
        assert_eq!(p.status.restarts, 0, "a suspension is not a restart");
        assert_eq!(p.status.launched_epoch, None);
        assert_eq!(p.status.start_time, None);
        assert_eq!(reasons(&p), ["Suspended"]);
        let (mut j, pods) = apply(j, pods, &p);
        let p = plan(&j, &pods, t(2));
        assert!(p.events.is_empty() && p.delete_pods.is_empty());
        j.spec.run_policy.suspend = false;
        let p = plan(&j, &pods, t(3));
        assert_eq!(p.create_pods, [0, 1]);
        assert_eq!(phase(&p), JobPhase::Pending);
        assert_eq!(reasons(&p), ["Resumed", "PodsCreated"]);
        let c = crate::status::condition(&p.status.conditions, COND_SUSPENDED).unwrap();
        assert_eq!(c.status, "False");
        let (_, pods) = apply(j, pods, &p);
        assert_eq!(
            pods[0].metadata.labels.as_ref().unwrap()["weft.dev/restart-epoch"],
            "1"
        );
    }

    #[test]
    fn suspended_at_creation_creates_nothing() {
        let mut j = job("a", 2, 1);
        j.spec.run_policy.suspend = true;
        let p = plan(&j, &[], t(0));
        assert_eq!(phase(&p), JobPhase::Suspended);
        assert!(p.create_pods.is_empty());
        assert_eq!(p.status.restart_epoch, 0);
    }

    #[test]
    fn active_deadline() {
        let mut j = job("a", 1, 1);
        j.spec.run_policy.active_deadline_seconds = Some(60);
        let p = plan(&j, &[], t(0));
        assert_eq!(p.requeue_after, Some(Duration::from_secs(60)));
        let (j, pods) = apply(j, vec![], &p);
        let pods = set_all(pods, "Running", true, None);
        let p = plan(&j, &pods, t(30));
        assert_eq!(phase(&p), JobPhase::Running);
        assert_eq!(p.requeue_after, Some(Duration::from_secs(30)));
        let p = plan(&j, &pods, t(60));
        assert_eq!(phase(&p), JobPhase::Failed);
        assert!(reasons(&p).contains(&"DeadlineExceeded"));
        assert_eq!(p.delete_pods, ["a-0"]);
    }

    #[test]
    fn ttl_after_finished_deletes_job() {
        let mut j = job("a", 1, 1);
        j.spec.run_policy.ttl_seconds_after_finished = Some(100);
        let p = plan(&j, &[], t(0));
        let (j, pods) = apply(j, vec![], &p);
        let pods = set_all(pods, "Succeeded", false, Some(0));
        let p = plan(&j, &pods, t(10));
        assert_eq!(phase(&p), JobPhase::Succeeded);
        assert_eq!(p.requeue_after, Some(Duration::from_secs(100)));
        assert!(!p.delete_job);
        let (j, pods) = apply(j, pods, &p);
        assert!(!plan(&j, &pods, t(109)).delete_job);
        let p = plan(&j, &pods, t(110));
        assert!(p.delete_job);
        assert_eq!(reasons(&p), ["TTLExpired"]);
    }

    #[test]
    fn clean_pod_policies() {
        for (policy, want) in [
            (CleanPodPolicy::None, vec![]),
            (CleanPodPolicy::Running, vec!["a-0"]),
            (CleanPodPolicy::All, vec!["a-0", "a-1"]),
        ] {
            let mut j = job("a", 2, 1);
            j.spec.failure_policy.on_rank_failure = FailureAction::FailJob;
            j.spec.run_policy.clean_pod_policy = policy;
            let p = plan(&j, &[], t(0));
            let (j, pods) = apply(j, vec![], &p);
            let mut pods = set_all(pods, "Running", true, None);
            pods[1] = with_status(pods[1].clone(), "Failed", false, vec![cs_exited("main", 1)]);
            let p = plan(&j, &pods, t(1));
            assert_eq!(phase(&p), JobPhase::Failed, "{policy:?}");
            assert_eq!(p.delete_pods, want, "{policy:?}");
        }
    }

    #[test]
    fn invalid_spec_fails_with_reason() {
        let mut j = job("a", 1, 1);
        j.spec.template.spec.as_mut().unwrap().restart_policy = Some("Always".into());
        let p = plan(&j, &[], t(0));
        assert_eq!(phase(&p), JobPhase::Failed);
        assert!(p.create_pods.is_empty());
        assert_eq!(reasons(&p), ["InvalidSpec"]);
    }

    #[test]
    fn ready_condition_names_what_the_kubelet_is_stuck_on() {
        use k8s_openapi::api::core::v1::{ContainerState, ContainerStateWaiting, ContainerStatus};
        let j = job("a", 1, 1);
        let p = plan(&j, &[], t(0));
        let (j, pods) = apply(j, vec![], &p);
        let stuck = ContainerStatus {
            name: "main".into(),
            state: Some(ContainerState {
                waiting: Some(ContainerStateWaiting {
                    reason: Some("ErrImagePull".into()),
                    message: None,
                }),
                ..ContainerState::default()
            }),
            ..ContainerStatus::default()
        };
        let pods = vec![with_status(pods[0].clone(), "Pending", false, vec![stuck])];
        let p = plan(&j, &pods, t(1));
        let c = crate::status::condition(&p.status.conditions, COND_READY).unwrap();
        assert_eq!(
            c.message,
            "0 of 1 pods ready; pod a-0: container main: ErrImagePull"
        );
    }

    #[test]
    fn pending_until_all_running() {
        let j = job("a", 2, 1);
        let p = plan(&j, &[], t(0));
        let (j, pods) = apply(j, vec![], &p);
        let mut pods = set_all(pods, "Running", false, None);
        pods[1].status.as_mut().unwrap().phase = Some("Pending".into());
        let p = plan(&j, &pods, t(1));
        assert_eq!(phase(&p), JobPhase::Pending);
        assert_eq!(p.status.ready.as_deref(), Some("0/2"));
        assert_eq!(p.status.ranks[0].phase, "Running");
        assert_eq!(p.status.ranks[1].phase, "Pending");
        let c = crate::status::condition(&p.status.conditions, COND_READY).unwrap();
        assert_eq!(c.message, "0 of 2 pods ready");
    }
    fn replace_job(name: &str, replicas: i32, rpr: i32, max_replacements: i32) -> CollectiveJob {
        let mut j = job(name, replicas, rpr);
        j.spec.failure_policy.on_rank_failure = FailureAction::ReplaceRank;
        j.spec.failure_policy.max_replacements = max_replacements;
        j
    }

    /// A job of `replicas` pods, all running and ready, at t(1).
    fn running(j: CollectiveJob) -> (CollectiveJob, Vec<Pod>) {
        let p = plan(&j, &[], t(0));
        let (j, pods) = apply(j, vec![], &p);
        let pods = set_all(pods, "Running", true, None);
        let p = plan(&j, &pods, t(1));
        assert_eq!(phase(&p), JobPhase::Running);
        apply(j, pods, &p)
    }

    fn fail_pod(pods: &mut [Pod], i: usize, code: i32) {
        pods[i] = with_status(
            pods[i].clone(),
            "Failed",
            false,
            vec![cs_exited("main", code)],
        );
    }

    fn pod_of<'a>(pods: &'a [Pod], name: &str) -> &'a Pod {
        pods.iter().find(|p| p.name_any() == name).unwrap()
    }

    fn env_of(pod: &Pod) -> std::collections::BTreeMap<String, String> {
        pod.spec.as_ref().unwrap().containers[0]
            .env
            .iter()
            .flatten()
            .map(|e| (e.name.clone(), e.value.clone().unwrap_or_default()))
            .collect()
    }

    #[test]
    fn replace_rank_replaces_only_the_failed_pod() {
        let (j, mut pods) = running(replace_job("a", 3, 2, 3));
        let uid0 = pods[0].metadata.clone();
        fail_pod(&mut pods, 1, 137);
        let p = plan(&j, &pods, t(10));
        assert_eq!(phase(&p), JobPhase::Running, "the job keeps running");
        assert_eq!(p.delete_pods, ["a-1"], "only the failed pod");
        assert!(p.create_pods.is_empty(), "its name is still taken");
        assert_eq!((p.status.restarts, p.status.restart_epoch), (0, 0));
        assert_eq!(p.status.replacements, 1);
        let r = &p.status.recoveries[0];
        assert_eq!(
            (r.pod.as_str(), r.replica_index, r.first_rank, r.ranks),
            ("a-1", 1, 2, 2)
        );
        assert_eq!((r.epoch, r.incarnation, r.count), (0, 1, 1));
        assert_eq!((r.reason.as_str(), r.exit_code), ("Error", Some(137)));
        assert_eq!(r.state, RecoveryState::Replacing);
        assert_eq!(r.failed_at, Time(t(10)));
        assert_eq!(reasons(&p), ["RankFailed", "ReplacingRank"]);
        assert!(
            p.events[1].note.contains("ranks 2-3"),
            "{}",
            p.events[1].note
        );
        let c = crate::status::condition(&p.status.conditions, COND_REPLACING).unwrap();
        assert_eq!(
            (c.status.as_str(), c.reason.as_str()),
            ("True", "RankFailed")
        );

        // The failed pod is gone: its replacement is created, same name and ranks.
        let (j, pods) = apply(j, pods, &p);
        let p = plan(&j, &pods, t(11));
        assert_eq!(p.create_pods, [1]);
        assert!(p.replacements_only);
        assert_eq!(p.incarnation(1), 1);
        assert_eq!(p.incarnation(0), 0);
        assert!(p.delete_pods.is_empty());
        assert_eq!(phase(&p), JobPhase::Running);
        assert_eq!(reasons(&p), ["ReplacementCreated"]);
        assert_eq!(
            (
                p.status.ranks[1].phase.as_str(),
                p.status.ranks[1].incarnation
            ),
            ("Creating", 1)
        );
        let (j, pods) = apply(j, pods, &p);
        assert_eq!(pods[0].metadata, uid0, "the survivors are untouched");
        let new = pod_of(&pods, "a-1");
        let e = env_of(new);
        assert_eq!(e["WEFT_INCARNATION"], "1");
        assert_eq!(e["WEFT_RANK_OFFSET"], "2");
        assert_eq!(e["WEFT_RESTART_EPOCH"], "0");
        assert_eq!(e["WEFT_WORLD_SIZE"], "6");
        assert_eq!(env_of(&pods[0])["WEFT_INCARNATION"], "0");
        let spec = new.spec.as_ref().unwrap();
        assert_eq!(
            (spec.hostname.as_deref(), spec.subdomain.as_deref()),
            (Some("a-1"), Some("a"))
        );
        assert_eq!(
            new.metadata.labels.as_ref().unwrap()["weft.dev/incarnation"],
            "1"
        );

        // Not ready yet: still replacing, the job still Running.
        let p = plan(&j, &pods, t(12));
        assert_eq!(phase(&p), JobPhase::Running);
        assert!(p.events.is_empty());
        let ready = crate::status::condition(&p.status.conditions, COND_READY).unwrap();
        assert_eq!(ready.status, "False");
        assert!(ready.message.contains("replacing a-1"), "{}", ready.message);

        // Ready: the recovery ends, with the time it cost.
        let (j, mut pods) = apply(j, pods, &p);
        let i = pods.iter().position(|p| p.name_any() == "a-1").unwrap();
        pods[i] = with_status(pods[i].clone(), "Running", true, vec![cs_running("main")]);
        let p = plan(&j, &pods, t(25));
        assert_eq!(phase(&p), JobPhase::Running);
        let r = &p.status.recoveries[0];
        assert_eq!(r.state, RecoveryState::Recovered);
        assert_eq!(
            (r.ended_at.clone(), r.time_lost_seconds),
            (Some(Time(t(25))), Some(15))
        );
        assert_eq!(reasons(&p), ["RankReplaced"]);
        let c = crate::status::condition(&p.status.conditions, COND_REPLACING).unwrap();
        assert_eq!(
            (c.status.as_str(), c.reason.as_str()),
            ("False", "Recovered")
        );
        let ready = crate::status::condition(&p.status.conditions, COND_READY).unwrap();
        assert_eq!(ready.status, "True");
        assert_eq!(p.status.ranks[1].incarnation, 1);
        assert_eq!(p.status.ready.as_deref(), Some("3/3"));
        // Settled: nothing more happens.
        let (j, pods) = apply(j, pods, &p);
        let p2 = plan(&j, &pods, t(30));
        assert!(p2.events.is_empty() && p2.delete_pods.is_empty() && p2.create_pods.is_empty());
        assert_eq!(p2.status.recoveries, p.status.recoveries);
    }

    #[test]
    fn replace_rank_bound_falls_back_to_restart_then_fail() {
        let mut j = replace_job("a", 2, 1, 1);
        j.spec.failure_policy.max_restarts = 1;
        let (j, mut pods) = running(j);
        fail_pod(&mut pods, 0, 1);
        let p = plan(&j, &pods, t(5));
        assert_eq!(p.status.replacements, 1);
        let (j, pods) = apply(j, pods, &p);
        let p = plan(&j, &pods, t(6));
        let (j, pods) = apply(j, pods, &p);
        let mut pods = set_all(pods, "Running", true, None);
        let p = plan(&j, &pods, t(7));
        assert_eq!(p.status.recoveries[0].state, RecoveryState::Recovered);
        let (j, _) = apply(j, pods.clone(), &p);

        // The second failure is beyond maxReplacements: the whole job restarts.
        fail_pod(&mut pods, 1, 1);
        let p = plan(&j, &pods, t(8));
        assert_eq!(phase(&p), JobPhase::Restarting);
        assert_eq!((p.status.restarts, p.status.restart_epoch), (1, 1));
        assert_eq!(p.status.replacements, 1);
        assert_eq!(p.delete_pods, ["a-0", "a-1"]);
        assert_eq!(
            reasons(&p),
            ["RankFailed", "ReplacementsExhausted", "Restarting"]
        );
        let c = crate::status::condition(&p.status.conditions, COND_RESTARTING).unwrap();
        assert!(c.message.contains("maxReplacements 1"), "{}", c.message);

        // The new epoch: pods are incarnation 0 again; the budget is used up
        // for the life of the job, and maxRestarts 1 is used up too: Failed.
        let (j, pods) = apply(j, pods, &p);
        let p = plan(&j, &pods, t(9));
        assert_eq!(p.create_pods, [0, 1]);
        assert_eq!(p.incarnation(0), 0);
        let (j, pods) = apply(j, pods, &p);
        let mut pods = set_all(pods, "Running", true, None);
        let p = plan(&j, &pods, t(10));
        let (j, _) = apply(j, pods.clone(), &p);
        fail_pod(&mut pods, 0, 1);
        let p = plan(&j, &pods, t(11));
        assert_eq!(phase(&p), JobPhase::Failed);
        let c = crate::status::condition(&p.status.conditions, COND_FAILED).unwrap();
        assert_eq!(c.reason, "MaxRestartsExceeded");
        assert!(c.message.contains("maxReplacements 1"), "{}", c.message);
    }

    #[test]
    fn max_replacements_zero_behaves_as_restart_job() {
        let (j, mut pods) = running(replace_job("a", 2, 1, 0));
        fail_pod(&mut pods, 1, 1);
        let p = plan(&j, &pods, t(5));
        assert_eq!(phase(&p), JobPhase::Restarting);
        assert_eq!(p.status.replacements, 0);
        assert!(p.status.recoveries.is_empty());
    }

    #[test]
    fn second_failure_while_a_pod_is_replaced() {
        let (j, mut pods) = running(replace_job("a", 3, 1, 5));
        fail_pod(&mut pods, 1, 1);
        let p = plan(&j, &pods, t(5));
        let (j, mut pods) = apply(j, pods, &p);
        // a-1 is gone, not yet recreated; now a-2 fails too.
        let i = pods.iter().position(|p| p.name_any() == "a-2").unwrap();
        fail_pod(&mut pods, i, 2);
        let p = plan(&j, &pods, t(6));
        assert_eq!(phase(&p), JobPhase::Running);
        assert_eq!(p.delete_pods, ["a-2"]);
        assert_eq!(p.create_pods, [1]);
        assert_eq!(p.status.replacements, 2);
        let live: Vec<(i32, i32, i32)> = p
            .status
            .recoveries
            .iter()
            .filter(|r| r.state == RecoveryState::Replacing)
            .map(|r| (r.replica_index, r.incarnation, r.count))
            .collect();
        assert_eq!(live, [(1, 1, 1), (2, 1, 2)]);
        assert_eq!(
            reasons(&p),
            ["RankFailed", "ReplacingRank", "ReplacementCreated"]
        );
        let (j, pods) = apply(j, pods, &p);
        let p = plan(&j, &pods, t(7));
        assert_eq!(p.create_pods, [2]);
        assert_eq!(p.incarnation(2), 1);
        let (j, pods) = apply(j, pods, &p);

        // The replacement of a-1 fails before it is ready: replaced again,
        // with the next incarnation; the first record says so.
        let mut pods = pods;
        let i = pods.iter().position(|p| p.name_any() == "a-1").unwrap();
        fail_pod(&mut pods, i, 3);
        let p = plan(&j, &pods, t(8));
        assert_eq!(phase(&p), JobPhase::Running);
        assert_eq!(p.delete_pods, ["a-1"]);
        assert_eq!(p.status.replacements, 3);
        let states: Vec<(i32, i32, RecoveryState)> = p
            .status
            .recoveries
            .iter()
            .map(|r| (r.replica_index, r.incarnation, r.state))
            .collect();
        assert_eq!(
            states,
            [
                (1, 1, RecoveryState::ReplacementFailed),
                (2, 1, RecoveryState::Replacing),
                (1, 2, RecoveryState::Replacing)
            ]
        );
        let (j, pods) = apply(j, pods, &p);
        let p = plan(&j, &pods, t(9));
        assert_eq!(p.create_pods, [1]);
        assert_eq!(p.incarnation(1), 2);
        let (j, pods) = apply(j, pods, &p);
        assert_eq!(env_of(pod_of(&pods, "a-1"))["WEFT_INCARNATION"], "2");
        let pods = set_all(pods, "Running", true, None);
        let p = plan(&j, &pods, t(20));
        assert_eq!(phase(&p), JobPhase::Running);
        assert_eq!(reasons(&p), ["RankReplaced", "RankReplaced"]);
        assert!(
            p.status
                .recoveries
                .iter()
                .all(|r| r.state != RecoveryState::Replacing)
        );
        assert_eq!(p.status.recoveries[2].time_lost_seconds, Some(12));
        assert_eq!(p.status.restarts, 0);
    }

    #[test]
    fn replacing_pod_deleted_by_hand_waits_for_it_then_recreates() {
        let (j, mut pods) = running(replace_job("a", 2, 1, 3));
        pods[1].metadata.deletion_timestamp = Some(Time(t(5)));
        let p = plan(&j, &pods, t(5));
        assert_eq!(phase(&p), JobPhase::Running);
        assert!(p.delete_pods.is_empty(), "already terminating");
        assert_eq!(p.status.recoveries[0].reason, "PodDeleted");
        let (j, _) = apply(j, pods.clone(), &p);
        // Still terminating: no new failure, nothing created.
        let p = plan(&j, &pods, t(6));
        assert!(p.events.is_empty() && p.create_pods.is_empty());
        assert_eq!(p.status.replacements, 1);
        assert_eq!(p.status.ranks[1].phase, "Terminating");
        // Stuck on a lost node: force-deleted.
        let p = plan(&j, &pods, t(5 + FORCE_DELETE_AFTER_SECS));
        assert_eq!(p.force_delete_pods, ["a-1"]);
        // Gone: recreated.
        pods.remove(1);
        let p = plan(&j, &pods, t(70));
        assert_eq!(p.create_pods, [1]);
        assert!(p.status.last_failure.is_some());
        assert_eq!(p.status.replacements, 1);
        // A pod that vanished entirely is replaced too.
        let (j, pods) = running(replace_job("b", 2, 1, 3));
        let p = plan(&j, &pods[..1], t(5));
        assert_eq!(phase(&p), JobPhase::Running);
        assert_eq!(p.create_pods, [1]);
        assert_eq!(p.incarnation(1), 1);
        assert_eq!(
            reasons(&p),
            ["RankFailed", "ReplacingRank", "ReplacementCreated"]
        );
        assert_eq!(p.status.ranks[1].phase, "Creating");
    }

    #[test]
    fn replace_rank_permanent_exit_code_fails_the_job() {
        let mut j = replace_job("a", 2, 1, 3);
        j.spec.failure_policy.permanent_exit_codes = vec![64];
        let (j, mut pods) = running(j);
        fail_pod(&mut pods, 0, 64);
        let p = plan(&j, &pods, t(5));
        assert_eq!(phase(&p), JobPhase::Failed);
        assert_eq!(p.status.replacements, 0);
        assert!(!reasons(&p).contains(&"ReplacementsExhausted"));
    }

    #[test]
    fn deadline_during_a_replacement_abandons_it() {
        let mut j = replace_job("a", 2, 1, 3);
        j.spec.run_policy.active_deadline_seconds = Some(60);
        let (j, mut pods) = running(j);
        fail_pod(&mut pods, 0, 1);
        let p = plan(&j, &pods, t(5));
        let (j, pods) = apply(j, pods, &p);
        let p = plan(&j, &pods, t(60));
        assert_eq!(phase(&p), JobPhase::Failed);
        assert_eq!(p.status.recoveries[0].state, RecoveryState::Abandoned);
        let c = crate::status::condition(&p.status.conditions, COND_REPLACING).unwrap();
        assert_eq!(
            (c.status.as_str(), c.reason.as_str()),
            ("False", "Abandoned")
        );
    }

    #[test]
    fn recovery_history_is_bounded() {
        let (mut j, pods) = running(replace_job("a", 1, 1, 1000));
        let mut pods = pods;
        for k in 0..(MAX_RECOVERY_RECORDS as i64 + 5) {
            fail_pod(&mut pods, 0, 1);
            let p = plan(&j, &pods, t(10 + 3 * k));
            let (j2, pods2) = apply(j, pods, &p);
            let p = plan(&j2, &pods2, t(11 + 3 * k));
            let (j2, pods2) = apply(j2, pods2, &p);
            let pods2 = set_all(pods2, "Running", true, None);
            let p = plan(&j2, &pods2, t(12 + 3 * k));
            assert_eq!(phase(&p), JobPhase::Running);
            (j, pods) = apply(j2, pods2, &p);
        }
        let st = j.status.unwrap();
        assert_eq!(st.replacements, MAX_RECOVERY_RECORDS as i32 + 5);
        assert_eq!(st.recoveries.len(), MAX_RECOVERY_RECORDS);
        assert_eq!(st.recoveries.last().unwrap().count, st.replacements);
        assert_eq!(st.ranks[0].incarnation, st.replacements);
    }
}
