//! Creating the missing pods of the current epoch: the whole gang of a new
//! epoch, or the replacement of a failed pod, once no older pod holds their
//! names.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use super::decision::rank_range;
use super::{Observed, Plan};
use crate::crd::{CollectiveJob, RankRecovery};
use crate::resources::{bootstrap_endpoint, pod_name, world_size};

/// Plans the creation of every replica of the current epoch without a pod
/// (with the job's Service and Secret); returns those replicas.
pub(super) fn create_missing(
    obs: &Observed,
    replacing_now: &[RankRecovery],
    p: &mut Plan,
) -> Vec<i32> {
    let job = obs.job;
    let missing: Vec<i32> = (0..job.spec.replicas)
        .filter(|i| !obs.current.iter().any(|v| v.index == Some(*i)))
        .collect();
    p.ensure_base = true;
    if missing.is_empty() {
        return missing;
    }
    let blocked = missing
        .iter()
        .any(|i| obs.stale.iter().any(|s| s.name == pod_name(job, *i)));
    if blocked {
        // The deletion of the old pods will trigger the next reconcile;
        // the requeue is a safety net.
        p.requeue_at_most(5);
        return missing;
    }
    p.create_pods = missing.clone();
    let (replacements, fresh): (Vec<i32>, Vec<i32>) = missing
        .iter()
        .partition(|i| replacing_now.iter().any(|r| r.replica_index == **i));
    p.replacements_only = fresh.is_empty();
    p.status.launched_epoch = Some(obs.epoch);
    if p.status.start_time.is_none() {
        p.status.start_time = Some(Time(obs.now));
        if let Some(limit) = job.spec.run_policy.active_deadline_seconds {
            p.requeue_at_most(limit);
        }
    }
    announce(job, obs.epoch, &fresh, &replacements, p);
    missing
}

/// Events for the pods about to be created.
fn announce(job: &CollectiveJob, epoch: i32, fresh: &[i32], replacements: &[i32], p: &mut Plan) {
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
    for &i in replacements {
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
