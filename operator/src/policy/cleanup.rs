//! Pods on their way out: those of older epochs (leftovers of a restart or a
//! suspension) and those an in-progress replacement supersedes.

use k8s_openapi::jiff::{SignedDuration, Timestamp};

use super::{FORCE_DELETE_AFTER_SECS, Observed, Plan};
use crate::crd::RankRecovery;
use crate::status::PodView;

/// Pods of older epochs are deleted; a pod on a lost node stays Terminating
/// until its kubelet returns, and it holds the name the new epoch's pod
/// needs, so it is force-deleted once well past its grace period.
pub(super) fn stale_pods(obs: &Observed, p: &mut Plan) {
    for s in &obs.stale {
        retire(s, obs.now, p);
    }
}

/// Replacements in progress (onRankFailure: ReplaceRank): the pod of an
/// older incarnation is on its way out (deleted now if an earlier delete was
/// lost, force-deleted when stuck on a lost node); it is not a failure.
pub(super) fn replaced_pods(obs: &Observed, replacing: &[RankRecovery], p: &mut Plan) {
    for v in obs.current.iter().filter(|v| being_replaced(v, replacing)) {
        retire(v, obs.now, p);
    }
}

/// `v` is an older incarnation of a replica whose replacement is under way.
pub(super) fn being_replaced(v: &PodView, replacing: &[RankRecovery]) -> bool {
    replacing
        .iter()
        .any(|r| Some(r.replica_index) == v.index && v.incarnation < r.incarnation)
}

fn retire(v: &PodView, now: Timestamp, p: &mut Plan) {
    if !v.terminating {
        p.delete_pods.push(v.name.clone());
    } else if stuck_terminating(v, now) {
        p.force_delete_pods.push(v.name.clone());
    }
}

/// A terminating pod well past its grace period (typically on a lost node).
fn stuck_terminating(v: &PodView, now: Timestamp) -> bool {
    v.terminating
        && v.delete_deadline
            .is_some_and(|d| now >= d + SignedDuration::from_secs(FORCE_DELETE_AFTER_SECS))
}
