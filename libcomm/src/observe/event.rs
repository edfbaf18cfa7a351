//! What the observer receives: an operation's or a communicator's event,
//! with its full context by value, and the lever a Ready event carries.

use std::sync::Weak;
use std::time::SystemTime;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    Started,
    Completed,
}

/// One collective, point-to-point operation or group on one rank.
///
/// Borrowed from the communicator: building it costs the operation no
/// allocation (an observer that keeps it copies what it needs).
#[derive(Debug, Clone)]
pub struct OpEvent<'a> {
    /// The job's label (read once per process).
    pub job: &'static str,
    pub comm_id: &'a str,
    pub rank: usize,
    pub nranks: usize,
    /// `all_reduce`, ..., `send`, `recv`, or `group`.
    pub op: &'static str,
    /// Empty for a group of mixed types.
    pub dtype: &'static str,
    pub bytes: u64,
    /// The algorithm the tuner picks (`p2p` for send/recv, `group` for groups).
    pub algo: &'static str,
    /// 1, 2, ... per communicator and rank; a started and its completed event share it.
    pub seq: u64,
    pub group: bool,
    pub phase: Phase,
    /// For completed events: `Ok` or the error's text.
    pub outcome: Option<Result<(), String>>,
    pub time: SystemTime,
}

/// A communicator's lifecycle, as seen by one rank.
#[derive(Debug, Clone)]
pub enum CommEvent {
    /// Init finished: the communicator runs. `handle` aborts it (the sidecar's lever).
    Ready {
        comm_id: String,
        rank: usize,
        nranks: usize,
        handle: AbortHandle,
    },
    /// Init or an operation failed; the communicator is unusable.
    Failed {
        comm_id: String,
        rank: usize,
        error: String,
    },
    Aborted {
        comm_id: String,
        rank: usize,
    },
    Destroyed {
        comm_id: String,
        rank: usize,
    },
}

/// What an [`AbortHandle`] pulls: implemented by the communicator's
/// lifecycle record (`comm/shared.rs`), so this module never imports the communicator.
pub(crate) trait Lever: Send + Sync {
    fn abort(&self, reason: &str);
    fn fail(&self, reason: &str);
}

/// Aborts a communicator from outside its owner's code (weak: it never keeps
/// a destroyed communicator alive).
#[derive(Clone)]
pub struct AbortHandle(pub(crate) Weak<dyn Lever>);

impl std::fmt::Debug for AbortHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AbortHandle")
    }
}

impl AbortHandle {
    /// Aborts with `reason` (shown in every rank's error). Returns whether
    /// the communicator still existed.
    pub fn abort(&self, reason: &str) -> bool {
        match self.0.upgrade() {
            Some(s) => {
                s.abort(reason);
                true
            }
            None => false,
        }
    }
}

impl AbortHandle {
    /// Fails the communicator with `reason` (a lost host, a dead rank): its
    /// pending and later calls return `Error::Remote` carrying the reason
    /// (`ncclRemoteError`), and its peers see the failure as usual. Before
    /// init has finished this is an abort.
    pub fn fail(&self, reason: &str) -> bool {
        match self.0.upgrade() {
            Some(s) => {
                s.fail(reason);
                true
            }
            None => false,
        }
    }
}
