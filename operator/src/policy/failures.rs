//! The rank failures of the current epoch: a failed container, a failed pod,
//! or a pod deleted behind the operator's back (it never deletes pods of the
//! current epoch without moving to a new epoch, a final phase or a
//! replacement first).

use super::Observed;
use super::cleanup::being_replaced;
use crate::crd::{RankFailure, RankRecovery};
use crate::resources::pod_name;
use crate::status::{PodState, PodView};

/// A failed pod of the current epoch (or a missing one).
pub(super) struct Failed {
    pub index: Option<i32>,
    /// The failed pod's incarnation (0 when it is missing).
    pub incarnation: i32,
    /// The pod exists and is not being deleted yet.
    pub present: bool,
    pub failure: RankFailure,
}

/// Every failure of the current epoch, in replica order; pods being replaced
/// are not failures.
pub(super) fn collect(obs: &Observed, replacing: &[RankRecovery]) -> Vec<Failed> {
    let mut failures: Vec<Failed> = obs
        .current
        .iter()
        .filter(|v| !being_replaced(v, replacing))
        .filter_map(|v| failed_pod(v, obs.epoch))
        .collect();
    failures.extend(vanished_pods(obs, replacing));
    failures
}

fn failed_pod(v: &PodView, epoch: i32) -> Option<Failed> {
    let deleted = v.terminating && !matches!(v.state, PodState::Failed(_) | PodState::Succeeded);
    let failure = if deleted {
        pod_deleted(
            v.name.clone(),
            "pod was deleted while the job was running",
            epoch,
        )
    } else {
        v.failure(epoch)?
    };
    Some(Failed {
        index: v.index,
        incarnation: v.incarnation,
        present: !v.terminating,
        failure,
    })
}

/// Replicas of a launched epoch with no pod at all and no replacement under
/// way: their pods were deleted and are already gone.
fn vanished_pods<'a>(
    obs: &'a Observed,
    replacing: &'a [RankRecovery],
) -> impl Iterator<Item = Failed> + 'a {
    let launched = obs.old.launched_epoch == Some(obs.epoch);
    (0..obs.job.spec.replicas)
        .filter(move |_| launched)
        .filter(|i| !obs.current.iter().any(|v| v.index == Some(*i)))
        .filter(|i| !replacing.iter().any(|r| r.replica_index == *i))
        .map(|i| Failed {
            index: Some(i),
            incarnation: 0,
            present: false,
            failure: pod_deleted(
                pod_name(obs.job, i),
                "pod disappeared while the job was running",
                obs.epoch,
            ),
        })
}

fn pod_deleted(pod: String, message: &str, epoch: i32) -> RankFailure {
    RankFailure {
        pod,
        container: None,
        exit_code: None,
        reason: "PodDeleted".into(),
        message: message.into(),
        epoch,
    }
}
