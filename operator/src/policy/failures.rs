//! The rank failures of the current epoch: a failed container, a failed pod,
//! or a pod deleted behind the operator's back (it never deletes pods of the
//! current epoch without moving to a new epoch, a final phase or a
//! replacement first).
//!
//! They are listed root cause first, since the first one the policy does not
//! allow to be replaced names the failure in the event and `lastFailure`.
//! When one rank dies, its peers notice within moments and exit with an
//! error of their own (usually exit code 1): the rank ended from outside (a
//! signal, the OOM killer, an eviction, a deletion) is the cause, and among
//! equals the one that ended first.

use k8s_openapi::jiff::Timestamp;

use super::cleanup::being_replaced;
use super::{FAILURE_GATHER_SECS, Observed};
use crate::crd::{RankFailure, RankRecovery};
use crate::resources::pod_name;
use crate::status::{FailureDetail, PodState, PodView};

/// Exit codes of a process ended by SIGKILL (`kill -9`, the OOM killer) or
/// SIGTERM: 128 + the signal number.
const KILLED_EXIT_CODES: [i32; 2] = [128 + 9, 128 + 15];

/// A failed pod of the current epoch (or a missing one).
pub(super) struct Failed {
    pub index: Option<i32>,
    /// The failed pod's incarnation (0 when it is missing).
    pub incarnation: i32,
    /// The pod exists and is not being deleted yet.
    pub present: bool,
    pub failure: RankFailure,
    blame: Blame,
}

/// Sorts failures root cause first (derived order: field by field).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Blame {
    /// The rank exited with an error of its own, which may be a reaction to
    /// a peer's death (false: it was ended from outside).
    exited: bool,
    /// When it ended; an unknown time sorts last.
    ended: Timestamp,
}

impl Blame {
    /// A pod that was deleted, evicted or vanished: ended from outside, at a
    /// time the pod does not tell.
    const FROM_OUTSIDE: Blame = Blame {
        exited: false,
        ended: Timestamp::MAX,
    };

    fn of(d: &FailureDetail) -> Blame {
        let from_outside = d.exit_code.is_none_or(|c| KILLED_EXIT_CODES.contains(&c))
            || d.signal.is_some()
            || d.reason == "OOMKilled";
        Blame {
            exited: !from_outside,
            ended: d.finished_at.unwrap_or(Timestamp::MAX),
        }
    }
}

/// Every failure of the current epoch, root cause first (then in replica
/// order); pods being replaced are not failures.
pub(super) fn collect(obs: &Observed, replacing: &[RankRecovery]) -> Vec<Failed> {
    let mut failures: Vec<Failed> = obs
        .current
        .iter()
        .filter(|v| !being_replaced(v, replacing))
        .filter_map(|v| failed_pod(v, obs.epoch))
        .collect();
    failures.extend(vanished_pods(obs, replacing));
    // Stable: failures alike stay in replica order.
    failures.sort_by_key(|f| f.blame);
    failures
}

/// Seconds to hold still before acting on `failures` (root cause first):
/// while the likeliest cause is a rank that exited with an error less than
/// [`FAILURE_GATHER_SECS`] ago, the failure that made it exit may not be
/// reported yet. None when there is nothing to wait for: a rank ended from
/// outside, an unknown end time, or one ahead of `now` (a node clock ahead
/// of ours must not stall the job).
pub(super) fn gather_time_left(failures: &[Failed], now: Timestamp) -> Option<i64> {
    let first = failures.first()?;
    if !first.blame.exited || first.blame.ended > now {
        return None;
    }
    let left = first.blame.ended.as_second() + FAILURE_GATHER_SECS - now.as_second();
    (left > 0).then_some(left)
}

fn failed_pod(v: &PodView, epoch: i32) -> Option<Failed> {
    let deleted = v.terminating && !matches!(v.state, PodState::Failed(_) | PodState::Succeeded);
    let (failure, blame) = match &v.state {
        _ if deleted => (
            pod_deleted(
                v.name.clone(),
                "pod was deleted while the job was running",
                epoch,
            ),
            Blame::FROM_OUTSIDE,
        ),
        PodState::Failed(d) => (v.failure(epoch)?, Blame::of(d)),
        _ => return None,
    };
    Some(Failed {
        index: v.index,
        incarnation: v.incarnation,
        present: !v.terminating,
        failure,
        blame,
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
            blame: Blame::FROM_OUTSIDE,
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
