//! OpenTelemetry: one span per collective and group, parented under a
//! job-level trace, exported over OTLP/gRPC to `OTEL_EXPORTER_OTLP_ENDPOINT`
//! (the exporter reads the standard OTEL_* variables itself).
//!
//! The one place where a finished collective becomes a span: the sidecar
//! (`weft sidecar`, and the engine Rust ranks run in embedded mode) and a
//! rank without the sidecar's crate ([`crate::spans_only`], the drop-in
//! `libnccl.so.2`) both export through [`SpanExporter`], so their spans carry
//! the same name, attributes and trace. Its input is a [`SpanRecord`], by
//! value, whatever produced it.
//!
//! Collectives never wait for telemetry: records go through a bounded queue
//! to one span-building thread; when it is full the record is dropped and
//! counted (the caller's `on_drop`). The SDK's batch processor behind it has
//! its own bounded queue.

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
use std::time::{Duration, UNIX_EPOCH};

/// Records waiting for the span thread; beyond this they are dropped (and counted).
const QUEUE: usize = 1 << 16;

/// A finished operation, everything by value (no shared context to mix up).
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
        let mut span = tracer
            .span_builder(format!("weft.{}", r.op))
            .with_kind(SpanKind::Internal)
            .with_start_time(start)
            .with_attributes(attributes(r))
            .start_with_context(&tracer, &cx);
        span.end_with_timestamp(end);
    }
}

/// A span's attributes: what a trace viewer filters collectives by.
fn attributes(r: SpanRecord) -> Vec<KeyValue> {
    vec![
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
    ]
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
