//! Reporting operations: a started and a completed event per operation
//! (or group) on one rank, sharing a sequence number per communicator.
//! Timed operations (all of them at low rates: `sample.rs`) go to the
//! observer as [`OpEvent`]s with their clock stamps; untimed ones are only
//! counted in the communicator's [`UntimedWords`](super::UntimedWords),
//! unless they fail (a failure is always an event).

use super::event::{OpEvent, Phase};
use super::sample::Sampler;
use super::untimed::{CounterWords, OpName, UntimedWords};
use super::{clock, observer};
use crate::error::Result;
use crate::op::Op;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::SystemTime;

/// Per communicator rank: its operations' sequence numbers, which of them
/// are timed, and the observer's counter for the others.
#[derive(Default)]
pub(crate) struct Meter {
    seq: AtomicU64,
    /// Set once a second thread may report this communicator's operations.
    two_threads: AtomicBool,
    sampler: Sampler,
    /// Set once the communicator is Ready (`None`: every operation timed).
    counter: OnceLock<Option<CounterWords>>,
}

impl std::fmt::Debug for Meter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Meter")
            .field("seq", &self.seq)
            .field("two_threads", &self.two_threads)
            .field("sampler", &self.sampler)
            .finish_non_exhaustive()
    }
}

impl Meter {
    /// Asks the observer for communicator `comm_id` rank `rank`'s counter
    /// (after its Ready event).
    pub(crate) fn attach(&self, comm_id: &str, rank: usize) {
        if let Some(o) = observer() {
            let _ = self.counter.set(o.counter(comm_id, rank));
        }
    }

    /// From now on a second thread may report operations of this
    /// communicator (the device backend's progress thread running its
    /// host part, `cuda/proxy.rs`): sequence numbers become atomic
    /// increments. Called on the thread that reported until now, before
    /// the second one can start.
    pub(crate) fn reported_from_two_threads(&self) {
        self.two_threads.store(true, Ordering::Relaxed);
    }

    /// The next sequence number: unique and rising. One thread per
    /// communicator at a time is NCCL's rule, so a plain load and store (a
    /// locked increment costs 2-9 ns, about 1% of an 8-byte all-reduce on
    /// some machines) unless [`reported_from_two_threads`](Self::reported_from_two_threads).
    fn next(&self) -> u64 {
        if self.two_threads.load(Ordering::Relaxed) {
            return self.seq.fetch_add(1, Ordering::Relaxed) + 1;
        }
        let n = self.seq.load(Ordering::Relaxed) + 1;
        self.seq.store(n, Ordering::Relaxed);
        n
    }

    /// Where this operation is counted, when it goes untimed.
    fn untimed(&self) -> Option<&UntimedWords> {
        let c = self.counter.get()?.as_ref()?;
        self.sampler.untimed().then(|| c.words())
    }
}

/// One running operation (or group) on one rank: what its events say,
/// built into an [`OpEvent`] only when one is sent (an untimed operation
/// that succeeds sends none).
pub(crate) struct Started<'a> {
    comm_id: &'a str,
    rank: usize,
    nranks: usize,
    op: OpName,
    dtype: &'static str,
    bytes: u64,
    algo: &'static str,
    seq: u64,
    group: bool,
    /// Untimed: where its completion is counted.
    counter: Option<&'a UntimedWords>,
}

impl<'a> Started<'a> {
    fn event(&self, phase: Phase, time: SystemTime) -> OpEvent<'a> {
        static JOB: OnceLock<&'static str> = OnceLock::new();
        OpEvent {
            job: JOB.get_or_init(|| Box::leak(crate::bootstrap::ctx::job_label().into_boxed_str())),
            comm_id: self.comm_id,
            rank: self.rank,
            nranks: self.nranks,
            op: self.op.as_str(),
            dtype: self.dtype,
            bytes: self.bytes,
            algo: self.algo,
            seq: self.seq,
            group: self.group,
            phase,
            outcome: None,
            time,
        }
    }
}

pub(crate) struct Who<'a> {
    pub comm_id: &'a str,
    pub rank: usize,
    pub nranks: usize,
    pub meter: &'a Meter,
}

/// Reports the start of `ops` (one op, or a group when `group`), labelled
/// with the decision that runs it (the tuner's, the device backend's, or
/// `group`): recorded as made, never decided again here.
pub(crate) fn start<'a>(
    who: &Who<'a>,
    ops: &[Op],
    group: bool,
    algo: &'static str,
) -> Option<Started<'a>> {
    let o = observer()?;
    let (op, dtype, bytes) = if group || ops.len() != 1 {
        let bytes = ops.iter().map(|op| op.bytes() as u64).sum();
        let d0 = ops.first().map(|op| op.dtype.name()).unwrap_or("");
        let same = ops.iter().all(|op| op.dtype.name() == d0);
        (OpName::GROUP, if same { d0 } else { "" }, bytes)
    } else {
        (
            ops[0].kind.into(),
            ops[0].dtype.name(),
            ops[0].bytes() as u64,
        )
    };
    let mut s = Started {
        comm_id: who.comm_id,
        rank: who.rank,
        nranks: who.nranks,
        op,
        dtype,
        bytes,
        algo,
        seq: who.meter.next(),
        group,
        counter: who.meter.untimed(),
    };
    if let Some(c) = s.counter {
        c.started(s.seq, op);
        return Some(s);
    }
    let ns = clock::now_ns();
    who.meter.sampler.timed(s.seq, ns);
    o.on_op(&s.event(Phase::Started, clock::at(ns)));
    s.counter = None;
    Some(s)
}

/// Reports the completion of what [`start`] reported.
pub(crate) fn finish<R>(s: Option<Started<'_>>, r: &Result<R>) {
    let Some(s) = s else {
        return;
    };
    if let (Some(c), Ok(_)) = (s.counter, r) {
        c.completed(s.seq, s.op, s.bytes);
        return;
    }
    let Some(o) = observer() else {
        return;
    };
    let mut ev = s.event(Phase::Completed, clock::now());
    ev.outcome = Some(r.as_ref().map(|_| ()).map_err(|e| e.to_string()));
    o.on_op(&ev);
}
