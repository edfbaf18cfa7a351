//! The observer hook: one process-wide callback receiving every operation's
//! start and completion and every communicator's lifecycle, each event with
//! its full context *by value* (job, communicator, rank, size, op, dtype,
//! bytes, algorithm, sequence number, outcome). A proxy serving many ranks
//! therefore can never attribute an event to the wrong rank: nothing is looked
//! up later from shared state.
//!
//! The sidecar client (`weft::agent`) installs an observer that forwards
//! events to `weft sidecar` (or to the same engine in-process). Without an
//! observer the cost is one atomic load per operation.

use crate::op::Op;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::SystemTime;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    Started,
    Completed,
}

/// One collective, point-to-point operation or group on one rank.
#[derive(Debug, Clone)]
pub struct OpEvent {
    /// The job's label (read once per process).
    pub job: &'static str,
    pub comm_id: String,
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

pub trait Observer: Send + Sync {
    /// Called on the thread running the operation: must not block. By
    /// reference: the started event is the completed one's too, built
    /// once per operation.
    fn on_op(&self, ev: &OpEvent);
    fn on_comm(&self, ev: CommEvent);
}

static OBSERVER: OnceLock<Arc<dyn Observer>> = OnceLock::new();

/// Installs the process-wide observer; only the first call wins (`false` after).
pub fn set_observer(o: Arc<dyn Observer>) -> bool {
    OBSERVER.set(o).is_ok()
}

pub(crate) fn observer() -> Option<&'static Arc<dyn Observer>> {
    OBSERVER.get()
}

/// What an [`AbortHandle`] pulls: implemented by the communicator's
/// lifecycle record (`comm.rs`), so this module never imports the communicator.
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

/// Per communicator: the sequence counter of its operations.
#[derive(Debug, Default)]
pub(crate) struct Seq(AtomicU64);

/// The context of one running operation; `None` everywhere when no observer is set.
pub(crate) struct Started {
    ev: OpEvent,
}

pub(crate) struct Who<'a> {
    pub comm_id: &'a str,
    pub rank: usize,
    pub nranks: usize,
    pub seq: &'a Seq,
}

/// Reports the start of `ops` (one op, or a group when `group`), labelled
/// with the decision that runs it (the tuner's, the device backend's, or
/// `group`): recorded as made, never decided again here.
pub(crate) fn start(who: &Who<'_>, ops: &[Op], group: bool, algo: &'static str) -> Option<Started> {
    let o = observer()?;
    let (op, dtype, bytes) = if group || ops.len() != 1 {
        let bytes = ops.iter().map(|op| op.bytes() as u64).sum();
        let d0 = ops.first().map(|op| op.dtype.name()).unwrap_or("");
        let same = ops.iter().all(|op| op.dtype.name() == d0);
        ("group", if same { d0 } else { "" }, bytes)
    } else {
        (ops[0].name(), ops[0].dtype.name(), ops[0].bytes() as u64)
    };
    static JOB: OnceLock<&'static str> = OnceLock::new();
    let ev = OpEvent {
        job: JOB.get_or_init(|| Box::leak(crate::core::job_label().into_boxed_str())),
        comm_id: who.comm_id.to_string(),
        rank: who.rank,
        nranks: who.nranks,
        op,
        dtype,
        bytes,
        algo,
        seq: who.seq.0.fetch_add(1, Ordering::Relaxed) + 1,
        group,
        phase: Phase::Started,
        outcome: None,
        time: SystemTime::now(),
    };
    o.on_op(&ev);
    Some(Started { ev })
}

/// Reports the completion of what [`start`] reported.
pub(crate) fn finish<R>(s: Option<Started>, r: &crate::error::Result<R>) {
    let (Some(s), Some(o)) = (s, observer()) else {
        return;
    };
    let mut ev = s.ev;
    ev.phase = Phase::Completed;
    ev.outcome = Some(r.as_ref().map(|_| ()).map_err(|e| e.to_string()));
    ev.time = SystemTime::now();
    o.on_op(&ev);
}

pub(crate) fn comm(ev: impl FnOnce() -> CommEvent) {
    if let Some(o) = observer() {
        o.on_comm(ev());
    }
}
