//! The checks that come before the pods are looked at: a finished job only
//! cleans up, an invalid spec fails, a suspended job deletes its pods, a
//! resumed one says so, and a job past its deadline fails.

use k8s_openapi::jiff::SignedDuration;

use super::lifecycle::{fail, finish, suspend};
use super::{COND_SUSPENDED, Observed, Plan, secs_until};
use crate::crd::JobPhase;
use crate::resources::validate;
use crate::status::set_condition;

/// Applies the gates; true when one of them decided the whole plan.
pub(super) fn decided(obs: &Observed, p: &mut Plan) -> bool {
    let Observed {
        job,
        old,
        all: views,
        now,
        generation,
        ..
    } = *obs;
    if old.phase.is_some_and(JobPhase::is_terminal) {
        finish(job, views, now, p);
        return true;
    }
    if let Err(msg) = validate(job) {
        fail(p, "InvalidSpec", &msg, now, generation);
        finish(job, views, now, p);
        return true;
    }
    if job.spec.run_policy.suspend {
        suspend(job, views, old.phase, now, p);
        return true;
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
    deadline_passed(obs, p)
}

/// The deadline counts time since the pods of the (last resumed) run were
/// first created. Fails the job once it has passed, else makes sure the job
/// is reconciled when it does.
fn deadline_passed(obs: &Observed, p: &mut Plan) -> bool {
    let now = obs.now;
    let (Some(limit), Some(start)) = (
        obs.job.spec.run_policy.active_deadline_seconds,
        &obs.old.start_time,
    ) else {
        return false;
    };
    let deadline = start.0 + SignedDuration::from_secs(limit);
    if now >= deadline {
        let msg = format!("job ran longer than activeDeadlineSeconds ({limit}s)");
        fail(p, "DeadlineExceeded", &msg, now, obs.generation);
        finish(obs.job, obs.all, now, p);
        return true;
    }
    p.requeue_at_most(secs_until(deadline, now));
    false
}
