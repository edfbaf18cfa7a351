//! Embedded mode for a rank without the sidecar's crate (the drop-in
//! `libnccl.so.2`): no sidecar to attach to, OTLP export asked for, so the
//! process exports its own collectives' spans. Of the sidecar's engine it
//! keeps only that: no registry, RAS snapshots or metrics, and none of the
//! sidecar's servers.
//!
//! It consumes the agent's messages as the sidecar's engine would (the
//! [`Embedded`] seam): it pairs each operation's started and completed
//! events into one [`SpanRecord`] and hands it to the shared
//! [`SpanExporter`], so these spans are those the sidecar exports.

use crate::agent::{Commands, Embedded};
use crate::rpc::{self, Hello, rank_message::Msg};
use crate::spans::{SpanExporter, SpanRecord};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// The OpenTelemetry service name of a rank's own spans (as in the engine's
/// embedded mode).
const SERVICE: &str = "weft-rank";

/// Installs the agent in this mode (or returns the agent already installed,
/// attached or not). An error when the exporter cannot start (a malformed
/// endpoint, say) or, with `WEFT_SIDECAR_SOCKET` set, when the sidecar
/// cannot be reached.
pub fn install_from_env() -> Result<Arc<crate::Agent>, String> {
    crate::install_from_env(Some(Box::new(start)))
}

/// Starts the exporter on the agent's runtime (its gRPC channel runs there).
fn start(hello: Hello, _commands: Commands) -> Result<Arc<dyn Embedded>, String> {
    let dropped = Arc::new(AtomicU64::new(0));
    let counter = dropped.clone();
    let exporter = SpanExporter::start(
        SERVICE,
        Box::new(move || {
            counter.fetch_add(1, Ordering::Relaxed);
        }),
    )?;
    Ok(Arc::new(SpansOnly {
        exporter,
        pairs: Pairs::default(),
        pid: hello.pid,
        host: hello.hostname,
        dropped,
    }))
}

struct SpansOnly {
    exporter: SpanExporter,
    pairs: Pairs,
    pid: u32,
    host: String,
    /// Records the exporter's full queue refused: said once, at shutdown.
    dropped: Arc<AtomicU64>,
}

impl Embedded for SpansOnly {
    fn on_message(&self, m: Msg) {
        match m {
            Msg::Op(ev) => {
                if let Some(r) = self.pairs.complete(ev, self.pid, &self.host) {
                    self.exporter.record(r);
                }
            }
            Msg::Deregister(d) => self.pairs.forget(&d.comm_id, d.rank),
            _ => {}
        }
    }

    fn shutdown(&self) {
        self.exporter.shutdown();
        let n = self.dropped.load(Ordering::Relaxed);
        if n > 0 {
            eprintln!("weft: {n} span(s) of this process were dropped (the span queue was full)");
        }
    }
}

/// The started event of each rank's operation in flight, by (communicator,
/// rank): a rank runs one operation at a time, so one slot each.
#[derive(Default)]
struct Pairs(Mutex<HashMap<(String, u32), Started>>);

struct Started {
    seq: u64,
    time_unix_nano: u64,
}

impl Pairs {
    /// Notes a started event (`None`), or turns a completed one into its
    /// record. A completed event whose start was not seen is a span of no
    /// duration, as in the sidecar.
    fn complete(&self, ev: rpc::OpEvent, pid: u32, host: &str) -> Option<SpanRecord> {
        let mut open = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let key = (ev.comm_id.clone(), ev.rank);
        if ev.phase == rpc::Phase::Started as i32 {
            open.insert(
                key,
                Started {
                    seq: ev.seq,
                    time_unix_nano: ev.time_unix_nano,
                },
            );
            return None;
        }
        let start_ns = match open.remove(&key) {
            Some(s) if s.seq == ev.seq => s.time_unix_nano,
            _ => ev.time_unix_nano,
        };
        Some(SpanRecord {
            job: ev.job,
            comm_id: ev.comm_id,
            rank: ev.rank,
            nranks: ev.nranks,
            op: ev.op,
            dtype: ev.dtype,
            bytes: ev.bytes,
            algo: ev.algo,
            seq: ev.seq,
            outcome: ev.outcome,
            group: ev.group,
            pid,
            host: host.to_string(),
            start_ns,
            end_ns: ev.time_unix_nano,
        })
    }

    /// A destroyed communicator's rank: nothing of it stays.
    fn forget(&self, comm_id: &str, rank: u32) {
        let mut open = self.0.lock().unwrap_or_else(|e| e.into_inner());
        open.remove(&(comm_id.to_string(), rank));
    }
}

#[cfg(test)]
mod tests {
    use super::Pairs;
    use crate::rpc::{OpEvent, Phase};

    fn ev(comm: &str, rank: u32, seq: u64, phase: Phase, t: u64) -> OpEvent {
        OpEvent {
            comm_id: comm.into(),
            rank,
            nranks: 4,
            op: "all_reduce".into(),
            dtype: "f32".into(),
            bytes: 4096,
            algo: "ring".into(),
            seq,
            phase: phase as i32,
            outcome: if phase == Phase::Completed {
                "ok".into()
            } else {
                String::new()
            },
            time_unix_nano: t,
            group: false,
            pid: 7,
            job: "j".into(),
        }
    }

    /// Started and completed of one operation make one record spanning
    /// both; interleaved ranks and communicators are never mixed up.
    #[test]
    fn started_and_completed_pair_per_comm_and_rank() {
        let p = Pairs::default();
        assert!(
            p.complete(ev("a", 0, 1, Phase::Started, 100), 7, "h")
                .is_none()
        );
        assert!(
            p.complete(ev("a", 1, 1, Phase::Started, 150), 7, "h")
                .is_none()
        );
        assert!(
            p.complete(ev("b", 0, 1, Phase::Started, 170), 7, "h")
                .is_none()
        );
        let r = p.complete(ev("a", 1, 1, Phase::Completed, 400), 7, "h");
        let r = r.expect("a record");
        assert_eq!((r.comm_id.as_str(), r.rank), ("a", 1));
        assert_eq!((r.start_ns, r.end_ns), (150, 400));
        assert_eq!(
            (r.op.as_str(), r.bytes, r.algo.as_str()),
            ("all_reduce", 4096, "ring")
        );
        assert_eq!((r.pid, r.host.as_str(), r.outcome.as_str()), (7, "h", "ok"));
        let r = p.complete(ev("b", 0, 1, Phase::Completed, 500), 7, "h");
        assert_eq!(r.map(|r| (r.comm_id, r.start_ns)), Some(("b".into(), 170)));
        let r = p.complete(ev("a", 0, 1, Phase::Completed, 600), 7, "h");
        assert_eq!(r.map(|r| (r.comm_id, r.start_ns)), Some(("a".into(), 100)));
    }

    /// A completed event without its start (another seq, or never seen)
    /// has no duration; a destroyed rank's open start is gone.
    #[test]
    fn an_unmatched_completion_has_no_duration() {
        let p = Pairs::default();
        p.complete(ev("a", 0, 1, Phase::Started, 100), 7, "h");
        let r = p.complete(ev("a", 0, 2, Phase::Completed, 300), 7, "h");
        assert_eq!(r.map(|r| (r.start_ns, r.end_ns)), Some((300, 300)));
        p.complete(ev("a", 0, 3, Phase::Started, 400), 7, "h");
        p.forget("a", 0);
        let r = p.complete(ev("a", 0, 3, Phase::Completed, 500), 7, "h");
        assert_eq!(r.map(|r| r.start_ns), Some(500));
    }
}
