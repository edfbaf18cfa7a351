//! OpenTelemetry: one span per collective and group, parented under a
//! job-level trace, exported over OTLP/gRPC to `OTEL_EXPORTER_OTLP_ENDPOINT`
//! (the exporter reads the standard OTEL_* variables itself).
//!
//! The one place where a finished collective becomes a span: the sidecar
//! (`weft sidecar`, and the engine Rust ranks run in embedded mode) and a
//! rank without the sidecar's crate ([`crate::spans_only`], the drop-in
//! `libnccl.so.2`) both read the telemetry ring's records through
//! [`ProcessSpans`] (the export policy of `crate::export`: every collective
//! at low rates; aggregates, failures and slow calls above the budget) and
//! export through [`SpanExporter`], so their spans carry the same name,
//! attributes and trace. Its input is a [`SpanRecord`], by value, whatever
//! produced it.
//!
//! Collectives never wait for telemetry: records go through a bounded queue
//! to one span-building thread; when it is full the record is dropped and
//! counted (the caller's `on_drop`). The SDK's batch processor behind it has
//! its own bounded queue.

use crate::export::{AggKey, Aggregate, Export, Policy};
use crate::ring::slots;
use crate::ring::{CommKey, Record, Segment, codes};
use opentelemetry::trace::{
    Span, SpanContext, SpanId, SpanKind, TraceContextExt, TraceFlags, TraceId, TraceState, Tracer,
    TracerProvider as _,
};
use opentelemetry::{Context, KeyValue};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::{
    BatchConfigBuilder, BatchSpanProcessor, SdkTracer, SdkTracerProvider,
};
use sha2::{Digest, Sha256};
use std::sync::Mutex;
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::time::{Duration, Instant, UNIX_EPOCH};

/// Records waiting for the span thread; beyond this they are dropped (and counted).
const QUEUE: usize = 1 << 16;

/// A finished operation (or an aggregate of many), everything by value
/// (no shared context to mix up).
#[derive(Debug, Clone)]
pub struct SpanRecord {
    pub job: String,
    pub comm_id: String,
    pub rank: u32,
    pub nranks: u32,
    pub op: String,
    pub dtype: String,
    pub bytes: u64,
    pub algo: String,
    pub seq: u64,
    pub outcome: String,
    pub group: bool,
    pub pid: u32,
    pub host: String,
    pub start_ns: u64,
    pub end_ns: u64,
    /// Why it is exported (`Export::label`: span, failure, slow, aggregate).
    pub export: &'static str,
    /// Operations it stands for: 1, or an aggregate's count.
    pub count: u64,
    /// An aggregate's latencies and failures.
    pub aggregate: Option<AggregateStats>,
}

/// What an aggregate span adds: latency minimum, mean and maximum (ns) and
/// how many of its operations failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AggregateStats {
    pub min_ns: u64,
    pub mean_ns: u64,
    pub max_ns: u64,
    pub errors: u64,
}

/// The process a record came from.
#[derive(Debug, Clone)]
pub struct Origin {
    pub job: String,
    pub pid: u32,
    pub host: String,
}

impl SpanRecord {
    /// The span of one ring record: `label` is its communicator's full
    /// label, `outcome` "ok" or the error's text.
    pub fn of_record(
        r: &Record,
        o: &Origin,
        label: String,
        outcome: String,
        e: Export,
    ) -> SpanRecord {
        SpanRecord {
            job: o.job.clone(),
            comm_id: label,
            rank: r.rank,
            nranks: r.nranks,
            op: r.op_name().to_string(),
            dtype: codes::dtype_name(r.dtype).to_string(),
            bytes: r.bytes,
            algo: codes::algo_name(r.algo).to_string(),
            seq: r.seq,
            outcome,
            group: r.group,
            pid: o.pid,
            host: o.host.clone(),
            start_ns: r.start_ns,
            end_ns: r.end_ns,
            export: e.label(),
            count: 1,
            aggregate: None,
        }
    }

    /// The span of an interval's aggregate (named `weft.<op>.aggregate`).
    pub fn of_aggregate(k: &AggKey, a: &Aggregate, o: &Origin, label: String) -> SpanRecord {
        SpanRecord {
            job: o.job.clone(),
            comm_id: label,
            rank: k.rank,
            nranks: k.nranks,
            op: codes::op_name(k.op).to_string(),
            dtype: codes::dtype_name(a.dtype).to_string(),
            bytes: a.bytes,
            algo: codes::algo_name(a.algo).to_string(),
            seq: 0,
            outcome: if a.errors == 0 { "ok" } else { "error" }.into(),
            group: false,
            pid: o.pid,
            host: o.host.clone(),
            start_ns: a.first_start_ns,
            end_ns: a.last_end_ns,
            export: Export::Aggregated.label(),
            count: a.count,
            aggregate: Some(AggregateStats {
                min_ns: a.min_ns,
                mean_ns: a.mean_ns(),
                max_ns: a.max_ns,
                errors: a.errors,
            }),
        }
    }
}

/// "ok", or the error text the rank left in the record's slot ("error"
/// when it is not there any more).
pub fn outcome_text(r: &Record, seg: &Segment) -> String {
    if r.ok() {
        return "ok".into();
    }
    slots::error_text(seg, r.slot, r.seq).unwrap_or_else(|| "error".into())
}

/// One process's records through the export policy into spans: the path
/// the sidecar and the in-process exporter share.
pub struct ProcessSpans {
    pub origin: Origin,
    pub policy: Policy,
}

impl ProcessSpans {
    pub fn new(origin: Origin, now: Instant) -> ProcessSpans {
        ProcessSpans {
            origin,
            policy: Policy::from_env(now),
        }
    }

    /// Where `r` goes, and its span unless it was aggregated. `label`
    /// gives a communicator's full label from its key.
    pub fn record(
        &mut self,
        r: &Record,
        seg: &Segment,
        label: &dyn Fn(&CommKey) -> String,
        now: Instant,
    ) -> (Export, Option<SpanRecord>) {
        let e = self.policy.decide(r, now);
        let span = (e != Export::Aggregated).then(|| {
            SpanRecord::of_record(r, &self.origin, label(&r.comm), outcome_text(r, seg), e)
        });
        (e, span)
    }

    /// The aggregates' spans, once an interval has passed (at once with
    /// `force`: the process has gone, or the exporter stops).
    pub fn flush(
        &mut self,
        label: &dyn Fn(&CommKey) -> String,
        now: Instant,
        force: bool,
    ) -> Vec<SpanRecord> {
        if !force && !self.policy.due(now) {
            return Vec::new();
        }
        self.policy
            .flush(now)
            .iter()
            .map(|(k, a)| SpanRecord::of_aggregate(k, a, &self.origin, label(&k.comm)))
            .collect()
    }
}

/// Called once for every record the exporter had to drop.
pub type OnDrop = Box<dyn Fn() + Send + Sync>;

/// Turns [`SpanRecord`]s into spans and exports them.
pub struct SpanExporter {
    tx: Mutex<Option<SyncSender<SpanRecord>>>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
    provider: SdkTracerProvider,
    on_drop: OnDrop,
}

/// The job's trace: every process of a job derives the same trace id and
/// parent span id from the job name, so all spans land in one trace.
pub fn job_parent(job: &str) -> SpanContext {
    let h = Sha256::digest(format!("weft-trace\0{job}"));
    let mut tid = [0u8; 16];
    let mut sid = [0u8; 8];
    tid.copy_from_slice(&h[..16]);
    sid.copy_from_slice(&h[16..24]);
    SpanContext::new(
        TraceId::from_bytes(tid),
        SpanId::from_bytes(sid),
        TraceFlags::SAMPLED,
        true,
        TraceState::default(),
    )
}

impl SpanExporter {
    /// Starts the exporter of service `service`. Must be called inside a
    /// tokio runtime that keeps running while spans are exported (the tonic
    /// channel's worker runs on it).
    pub fn start(service: &str, on_drop: OnDrop) -> Result<SpanExporter, String> {
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .build()
            .map_err(|e| format!("OTLP exporter: {e}"))?;
        let bsp = BatchSpanProcessor::builder(exporter)
            .with_batch_config(
                BatchConfigBuilder::default()
                    .with_max_queue_size(QUEUE)
                    .with_max_export_batch_size(512)
                    .with_scheduled_delay(Duration::from_millis(200))
                    .build(),
            )
            .build();
        let provider = SdkTracerProvider::builder()
            .with_span_processor(bsp)
            .with_resource(
                Resource::builder()
                    .with_service_name(service.to_string())
                    .build(),
            )
            .build();
        let tracer = provider.tracer("weft");
        let (tx, rx) = sync_channel(QUEUE);
        let thread = std::thread::Builder::new()
            .name("weft-spans".into())
            .spawn(move || span_loop(tracer, rx))
            .map_err(|e| format!("spawning the span thread: {e}"))?;
        Ok(SpanExporter {
            tx: Mutex::new(Some(tx)),
            thread: Mutex::new(Some(thread)),
            provider,
            on_drop,
        })
    }

    /// Never blocks: a full queue (or a stopped exporter) drops the record
    /// and counts it.
    pub fn record(&self, r: SpanRecord) {
        let sent = match &*self.tx.lock().unwrap_or_else(|e| e.into_inner()) {
            Some(tx) => tx.try_send(r).is_ok(),
            None => return,
        };
        if !sent {
            (self.on_drop)();
        }
    }

    /// Flushes and stops. Blocks: call it off the async runtime's threads.
    pub fn shutdown(&self) {
        self.tx.lock().unwrap_or_else(|e| e.into_inner()).take();
        let t = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(t) = t {
            let _ = t.join();
        }
        let _ = self.provider.force_flush();
        let _ = self.provider.shutdown();
    }
}

fn at(ns: u64) -> std::time::SystemTime {
    UNIX_EPOCH + Duration::from_nanos(ns)
}

fn span_loop(tracer: SdkTracer, rx: Receiver<SpanRecord>) {
    let mut parents: Option<(String, Context)> = None;
    while let Ok(r) = rx.recv() {
        let cx = match &parents {
            Some((job, cx)) if *job == r.job => cx.clone(),
            _ => {
                let cx = Context::new().with_remote_span_context(job_parent(&r.job));
                parents = Some((r.job.clone(), cx.clone()));
                cx
            }
        };
        let (start, end) = (at(r.start_ns), at(r.end_ns.max(r.start_ns)));
        let name = if r.aggregate.is_some() {
            format!("weft.{}.aggregate", r.op)
        } else {
            format!("weft.{}", r.op)
        };
        let mut span = tracer
            .span_builder(name)
            .with_kind(SpanKind::Internal)
            .with_start_time(start)
            .with_attributes(attributes(r))
            .start_with_context(&tracer, &cx);
        span.end_with_timestamp(end);
    }
}

/// A span's attributes: what a trace viewer filters collectives by.
fn attributes(r: SpanRecord) -> Vec<KeyValue> {
    let mut v = Vec::with_capacity(19);
    if let Some(a) = r.aggregate {
        v.extend([
            KeyValue::new("weft.latency_min_ns", a.min_ns as i64),
            KeyValue::new("weft.latency_mean_ns", a.mean_ns as i64),
            KeyValue::new("weft.latency_max_ns", a.max_ns as i64),
            KeyValue::new("weft.errors", a.errors as i64),
        ]);
    }
    v.extend([
        KeyValue::new("weft.export", r.export),
        KeyValue::new("weft.count", r.count as i64),
        KeyValue::new("weft.job", r.job),
        KeyValue::new("weft.comm_id", r.comm_id),
        KeyValue::new("weft.rank", r.rank as i64),
        KeyValue::new("weft.world_size", r.nranks as i64),
        KeyValue::new("weft.op", r.op),
        KeyValue::new("weft.dtype", r.dtype),
        KeyValue::new("weft.bytes", r.bytes as i64),
        KeyValue::new("weft.algorithm", r.algo),
        KeyValue::new("weft.seq", r.seq as i64),
        KeyValue::new("weft.outcome", r.outcome),
        KeyValue::new("weft.group", r.group),
        KeyValue::new("process.pid", r.pid as i64),
        KeyValue::new("host.name", r.host),
    ]);
    v
}

#[cfg(test)]
mod tests {
    use super::job_parent;

    /// Every process of a job lands in one trace, another job in another.
    #[test]
    fn a_jobs_processes_share_one_parent() {
        let (a, b) = (job_parent("train-7"), job_parent("train-7"));
        assert_eq!(a, b);
        assert!(a.is_valid() && a.is_remote() && a.is_sampled());
        let c = job_parent("train-8");
        assert_ne!(a.trace_id(), c.trace_id());
        assert_ne!(a.span_id(), c.span_id());
    }
}
