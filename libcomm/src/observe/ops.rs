//! Reporting operations: a started and a completed event per operation
//! (or group) on one rank, sharing a sequence number per communicator.

use super::event::{OpEvent, Phase};
use super::observer;
use crate::error::Result;
use crate::op::Op;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

/// Per communicator: the sequence counter of its operations.
#[derive(Debug, Default)]
pub(crate) struct Seq(AtomicU64);

/// The context of one running operation; `None` everywhere when no observer is set.
pub(crate) struct Started<'a> {
    ev: OpEvent<'a>,
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
        ("group", if same { d0 } else { "" }, bytes)
    } else {
        (ops[0].name(), ops[0].dtype.name(), ops[0].bytes() as u64)
    };
    static JOB: OnceLock<&'static str> = OnceLock::new();
    let ev = OpEvent {
        job: JOB.get_or_init(|| Box::leak(crate::bootstrap::ctx::job_label().into_boxed_str())),
        comm_id: who.comm_id,
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
        time: super::clock::now(),
    };
    o.on_op(&ev);
    Some(Started { ev })
}

/// Reports the completion of what [`start`] reported.
pub(crate) fn finish<R>(s: Option<Started<'_>>, r: &Result<R>) {
    let (Some(s), Some(o)) = (s, observer()) else {
        return;
    };
    let mut ev = s.ev;
    ev.phase = Phase::Completed;
    ev.outcome = Some(r.as_ref().map(|_| ()).map_err(|e| e.to_string()));
    ev.time = super::clock::now();
    o.on_op(&ev);
}
