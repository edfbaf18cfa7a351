//! What the failure policy makes of a round's rank failures: replace the
//! failed pods (ReplaceRank within its bound), or let the first failure it
//! does not allow to be replaced decide for the whole job (restart or fail).

use super::decision::{Decision, describe_failure, on_rank_failure};
use super::failures::Failed;
use super::lifecycle::{fail, finish};
use super::recovery::{abandon_recoveries, start_replacements};
use super::{COND_READY, COND_RESTARTING, Observed, Plan};
use crate::crd::{FailureAction, JobPhase, RankFailure};
use crate::status::{rank_table, set_condition};

/// How the failures were handled.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Acted {
    /// The job restarts or fails: the plan is complete.
    OnTheJob,
    /// The failed pods are replaced; the others keep running.
    ByReplacing,
}

/// The policy's reading of the failures, taken root cause first.
struct Judgement<'f> {
    to_replace: Vec<&'f Failed>,
    /// The first failure the policy does not allow to be replaced.
    verdict: Option<(Decision, &'f Failed)>,
    /// Replacements used, counting those in `to_replace`.
    replacements: i32,
}

fn judge<'f>(obs: &Observed, failures: &'f [Failed]) -> Judgement<'f> {
    let policy = &obs.job.spec.failure_policy;
    let restarts = obs.old.restarts;
    let mut j = Judgement {
        to_replace: vec![],
        verdict: None,
        replacements: obs.old.replacements,
    };
    for fl in failures {
        match on_rank_failure(policy, restarts, j.replacements, &fl.failure) {
            Decision::Replace if fl.index.is_some() => {
                j.replacements += 1;
                j.to_replace.push(fl);
            }
            // A pod without a replica index cannot be replaced.
            Decision::Replace => {
                let d = on_rank_failure(policy, restarts, i32::MAX, &fl.failure);
                j.verdict = Some((d, fl));
                break;
            }
            d => {
                j.verdict = Some((d, fl));
                break;
            }
        }
    }
    j
}

/// Acts on a non-empty list of failures.
pub(super) fn act(obs: &Observed, failures: &[Failed], p: &mut Plan) -> Acted {
    let j = judge(obs, failures);
    let reported: Vec<&Failed> = match &j.verdict {
        Some((_, fl)) => vec![*fl],
        None => j.to_replace.clone(),
    };
    for fl in &reported {
        p.event(
            true,
            "RankFailed",
            "DetectFailure",
            format!("Rank failure in {}", describe_failure(&fl.failure)),
        );
    }
    match j.verdict {
        Some((decision, fl)) => {
            on_the_job(obs, decision, &fl.failure, j.replacements, p);
            Acted::OnTheJob
        }
        None => {
            start_replacements(obs, &j.to_replace, p);
            Acted::ByReplacing
        }
    }
}

/// One failure decides for the whole job: it restarts or fails.
fn on_the_job(
    obs: &Observed,
    decision: Decision,
    f: &RankFailure,
    replacements: i32,
    p: &mut Plan,
) {
    let policy = &obs.job.spec.failure_policy;
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
                f.pod, policy.max_replacements, obs.old.replacements
            ),
        );
    }
    abandon_recoveries(&mut p.status, obs.now, obs.generation);
    match decision {
        Decision::Restart | Decision::Replace => restart(obs, f, exhausted, p),
        Decision::Fail { reason } => fail_job(obs, reason, f, exhausted, p),
    }
}

/// Every pod of the epoch goes; the next epoch recreates them all.
fn restart(obs: &Observed, f: &RankFailure, exhausted: bool, p: &mut Plan) {
    let policy = &obs.job.spec.failure_policy;
    for v in &obs.current {
        if !v.terminating {
            p.delete_pods.push(v.name.clone());
        }
    }
    let st = &mut p.status;
    st.restarts += 1;
    st.restart_epoch += 1;
    st.phase = Some(JobPhase::Restarting);
    st.ready_replicas = 0;
    st.ready = Some(format!("0/{}", obs.job.spec.replicas));
    let mut msg = format!(
        "restart {}/{} after rank failure in {}; new epoch {}",
        st.restarts,
        policy.max_restarts,
        describe_failure(f),
        st.restart_epoch
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
        obs.now,
        obs.generation,
    );
    set_condition(
        &mut st.conditions,
        COND_READY,
        false,
        "Restarting",
        &msg,
        obs.now,
        obs.generation,
    );
    p.event(false, "Restarting", "RestartJob", msg);
}

fn fail_job(obs: &Observed, reason: &'static str, f: &RankFailure, exhausted: bool, p: &mut Plan) {
    let policy = &obs.job.spec.failure_policy;
    let what = describe_failure(f);
    let mut msg = match reason {
        "MaxRestartsExceeded" => format!(
            "rank failure in {what} after {} restarts (maxRestarts {})",
            obs.old.restarts, policy.max_restarts
        ),
        "PermanentExitCode" => format!("rank failure in {what}: exit code is permanent"),
        _ => format!("rank failure in {what} (onRankFailure: FailJob)"),
    };
    if exhausted {
        msg.push_str(&format!(
            " and {} replacements (maxReplacements {})",
            obs.old.replacements, policy.max_replacements
        ));
    }
    fail(p, reason, &msg, obs.now, obs.generation);
    p.status.ranks = rank_table(obs.job, &obs.current_owned());
    finish(obs.job, obs.all, obs.now, p);
}
