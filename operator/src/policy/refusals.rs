//! Plans the API server refused to carry out: the plan is rewritten to say
//! why (a failed job for a permanent refusal, a Pending job that retries for
//! one that may pass).

use std::time::Duration;

use k8s_openapi::jiff::Timestamp;

use super::lifecycle::fail;
use super::{COND_READY, Plan};
use crate::crd::{CollectiveJob, JobPhase};
use crate::status::set_condition;

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
