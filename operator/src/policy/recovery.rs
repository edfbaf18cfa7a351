//! Replacements of failed pods (onRankFailure: ReplaceRank) as recorded in
//! `status.recoveries`: started, recovered once the new pod is ready,
//! abandoned when the whole job restarts, fails or is suspended.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;

use super::decision::rank_range;
use super::failures::Failed;
use super::{COND_REPLACING, MAX_RECOVERY_RECORDS, Observed, Plan};
use crate::crd::{CollectiveJobStatus, RankRecovery, RecoveryState};
use crate::status::set_condition;

/// The replacements under way in `epoch`.
pub(super) fn in_progress(recoveries: &[RankRecovery], epoch: i32) -> Vec<RankRecovery> {
    recoveries
        .iter()
        .filter(|r| r.state == RecoveryState::Replacing && r.epoch == epoch)
        .cloned()
        .collect()
}

/// The job restarts, fails or is suspended: replacements in progress end.
pub(super) fn abandon_recoveries(
    st: &mut CollectiveJobStatus,
    now: Timestamp,
    generation: Option<i64>,
) {
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

/// Replaces each failed pod (deleting it if it is still there); the others
/// keep running.
pub(super) fn start_replacements(obs: &Observed, to_replace: &[&Failed], p: &mut Plan) {
    for fl in to_replace {
        start_replacement(obs, fl, p);
    }
    trim_recoveries(&mut p.status);
}

fn start_replacement(obs: &Observed, fl: &Failed, p: &mut Plan) {
    let (epoch, rpr) = (obs.epoch, obs.job.spec.ranks_per_replica);
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
            r.ended_at = Some(Time(obs.now));
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
        failed_at: Time(obs.now),
        ended_at: None,
        time_lost_seconds: None,
    });
    st.last_failure = Some(f.clone());
    let note = format!(
        "replacing pod {} (ranks {}) with incarnation {incarnation}, replacement {}/{}; the other pods keep running",
        f.pod,
        rank_range(i, rpr),
        st.replacements,
        obs.job.spec.failure_policy.max_replacements
    );
    p.event(false, "ReplacingRank", "ReplaceRank", note);
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

/// A replacement that is ready ends its recovery.
pub(super) fn mark_recovered(obs: &Observed, p: &mut Plan) {
    let rpr = obs.job.spec.ranks_per_replica;
    let mut notes = vec![];
    for r in p.status.recoveries.iter_mut() {
        if r.state != RecoveryState::Replacing || r.epoch != obs.epoch {
            continue;
        }
        let back = obs.current.iter().any(|v| {
            v.index == Some(r.replica_index) && v.incarnation >= r.incarnation && v.ready()
        });
        if back {
            let lost = obs.now.as_second() - r.failed_at.0.as_second();
            r.state = RecoveryState::Recovered;
            r.ended_at = Some(Time(obs.now));
            r.time_lost_seconds = Some(lost);
            notes.push(format!(
                "pod {} (ranks {}) is back: incarnation {} ready {lost}s after the failure ({})",
                r.pod,
                rank_range(r.replica_index, rpr),
                r.incarnation,
                r.reason
            ));
        }
    }
    for note in notes {
        p.event(false, "RankReplaced", "ReplaceRank", note);
    }
}

/// The Replacing condition: true while a replacement is under way, false
/// ("Recovered") once the last one is ready. Returns the pods still being
/// replaced, as "name (incarnation n)".
pub(super) fn set_replacing_condition(obs: &Observed, p: &mut Plan) -> Vec<String> {
    let still_replacing: Vec<String> = in_progress(&p.status.recoveries, obs.epoch)
        .iter()
        .map(|r| format!("{} (incarnation {})", r.pod, r.incarnation))
        .collect();
    let conds = &mut p.status.conditions;
    if !still_replacing.is_empty() {
        set_condition(
            conds,
            COND_REPLACING,
            true,
            "RankFailed",
            format!(
                "replacing pod(s) {}; the other pods keep running",
                still_replacing.join(", ")
            ),
            obs.now,
            obs.generation,
        );
    } else if crate::status::condition(conds, COND_REPLACING).is_some_and(|c| c.status == "True") {
        set_condition(
            conds,
            COND_REPLACING,
            false,
            "Recovered",
            "every replaced pod is ready",
            obs.now,
            obs.generation,
        );
    }
    still_replacing
}
