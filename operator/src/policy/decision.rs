//! The failure policy's verdict on one rank failure, and how failures are
//! named in events and conditions.

use crate::crd::{FailureAction, FailurePolicy, RankFailure};

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
pub(super) fn rank_range(index: i32, ranks_per_replica: i32) -> String {
    let first = index * ranks_per_replica;
    if ranks_per_replica == 1 {
        first.to_string()
    } else {
        format!("{first}-{}", first + ranks_per_replica - 1)
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
