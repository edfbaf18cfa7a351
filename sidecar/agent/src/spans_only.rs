//! Embedded mode for a rank without the sidecar's crate (the drop-in
//! `libnccl.so.2`): no sidecar to attach to, OTLP export asked for, so the
//! process exports its own collectives' spans. Of the sidecar's engine it
//! keeps only that: no registry, RAS snapshots or metrics, and none of the
//! sidecar's servers.
//!
//! It reads the process's telemetry segment as the sidecar would, on a
//! timer, through the same [`ProcessSpans`] (export policy and span
//! builder) into the shared [`SpanExporter`], so these spans are those the
//! sidecar exports.

use crate::agent::{Commands, Embedded};
use crate::ring::queue::Drainer;
use crate::ring::tally::Tally;
use crate::ring::{CommKey, Record, Segment};
use crate::rpc::{Hello, rank_message::Msg};
use crate::spans::{Origin, ProcessSpans, SpanExporter};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The OpenTelemetry service name of a rank's own spans (as in the engine's
/// embedded mode).
const SERVICE: &str = "weft-rank";
/// How often the segment is read.
const PERIOD: Duration = Duration::from_millis(5);
/// Records read per pass, at most.
const BATCH: usize = 1 << 14;

/// Installs the agent in this mode (or returns the agent already installed,
/// attached or not). An error when the exporter cannot start (a malformed
/// endpoint, say) or, with `WEFT_SIDECAR_SOCKET` set, when the sidecar
/// cannot be reached.
pub fn install_from_env() -> Result<Arc<crate::Agent>, String> {
    crate::install_from_env(Some(Box::new(start)))
}

/// Starts the exporter and the reading task on the agent's runtime (the
/// exporter's gRPC channel runs there too).
fn start(
    hello: Hello,
    _commands: Commands,
    seg: Option<Arc<Segment>>,
) -> Result<Arc<dyn Embedded>, String> {
    let dropped = Arc::new(AtomicU64::new(0));
    let counter = dropped.clone();
    let exporter = SpanExporter::start(
        SERVICE,
        Box::new(move || {
            counter.fetch_add(1, Ordering::Relaxed);
        }),
    )?;
    let origin = Origin {
        job: hello.job,
        pid: hello.pid,
        host: hello.hostname,
    };
    let me = Arc::new(SpansOnly {
        exporter,
        reader: Mutex::new(seg.map(|s| Reader {
            drainer: Drainer::new(s),
            tally: Tally::default(),
            spans: ProcessSpans::new(origin, Instant::now()),
            batch: Vec::with_capacity(BATCH),
        })),
        dropped,
    });
    let m = me.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(PERIOD);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            if !m.pass(false) {
                break;
            }
        }
    });
    Ok(me)
}

struct Reader {
    drainer: Drainer,
    tally: Tally,
    spans: ProcessSpans,
    batch: Vec<Record>,
}

struct SpansOnly {
    exporter: SpanExporter,
    /// None without a segment, or once shut down.
    reader: Mutex<Option<Reader>>,
    /// Records the exporter's full queue refused: said once, at shutdown.
    dropped: Arc<AtomicU64>,
}

/// Without a registry the key is the label (exact for labels up to 16 bytes).
fn label(k: &CommKey) -> String {
    k.text()
}

impl SpansOnly {
    /// Reads what the segment holds into spans; with `last`, also the
    /// aggregates not yet due. Returns whether there is a segment to read.
    fn pass(&self, last: bool) -> bool {
        let mut g = self.reader.lock().unwrap_or_else(|e| e.into_inner());
        let Some(r) = g.as_mut() else {
            return false;
        };
        let now = Instant::now();
        let seg = r.drainer.segment().clone();
        // Counters before the ring (`ring::tally`); only their unrecorded
        // rest matters here (no metrics in process).
        r.tally.read(&seg, 0..seg.slots_used());
        loop {
            r.batch.clear();
            let n = r.drainer.drain(&mut r.batch, BATCH, now);
            for rec in &r.batch {
                r.tally.recorded(rec, seg.geometry().slots);
                if let (_, Some(span)) = r.spans.record(rec, &seg, &label, now) {
                    self.exporter.record(span);
                }
            }
            if n < BATCH {
                break;
            }
        }
        let now_ns = crate::report::nanos(std::time::SystemTime::now());
        for t in r.tally.unrecorded() {
            r.spans.policy.fold(&t, now_ns);
        }
        for span in r.spans.flush(&label, now, last) {
            self.exporter.record(span);
        }
        true
    }
}

impl Embedded for SpansOnly {
    fn on_message(&self, _m: Msg) {}

    fn shutdown(&self) {
        self.pass(true);
        self.reader.lock().unwrap_or_else(|e| e.into_inner()).take();
        self.exporter.shutdown();
        let n = self.dropped.load(Ordering::Relaxed);
        if n > 0 {
            eprintln!("weft: {n} span(s) of this process were dropped (the span queue was full)");
        }
    }
}
