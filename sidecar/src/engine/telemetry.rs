//! OpenTelemetry: one span per collective and group on every rank, parented
//! under a job-level trace, exported over OTLP/gRPC to
//! `OTEL_EXPORTER_OTLP_ENDPOINT` (the exporter reads the standard OTEL_*
//! variables itself).
//!
//! Collectives never wait for telemetry: completed operations go through a
//! bounded queue to one span-building thread; when it is full the span is
//! dropped and counted (`weft_spans_dropped_total`). The SDK's batch processor
//! behind it has its own bounded queue.

use opentelemetry::trace::{
    Span, SpanContext, SpanId, SpanKind, TraceContextExt, TraceFlags, TraceId, TraceState, Tracer,
    TracerProvider as _,
};
use opentelemetry::{Context, KeyValue};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::{BatchConfigBuilder, BatchSpanProcessor, SdkTracerProvider};
use prometheus_client::metrics::counter::Counter;
use sha2::{Digest, Sha256};
use std::sync::Mutex;
use std::sync::mpsc::{Receiver, SyncSender, TrySendError, sync_channel};
use std::time::{Duration, UNIX_EPOCH};

/// Spans waiting for the span thread; beyond this they are dropped (and counted).
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

pub struct Telemetry {
    tx: Mutex<Option<SyncSender<SpanRecord>>>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
    provider: SdkTracerProvider,
    dropped: Counter,
}

/// The job's trace: every sidecar of a job derives the same trace id and
/// parent span id from the job name, so all spans land in one trace.
pub fn job_parent(job: &str) -> SpanContext {
    let h = Sha256::digest(format!("weft-trace\0{job}"));
    let tid: [u8; 16] = h[..16].try_into().unwrap();
    let sid: [u8; 8] = h[16..24].try_into().unwrap();
    SpanContext::new(
        TraceId::from_bytes(tid),
        SpanId::from_bytes(sid),
        TraceFlags::SAMPLED,
        true,
        TraceState::default(),
    )
}

/// Whether the standard variables ask for trace export.
pub fn enabled() -> bool {
    use weft_contract::params::{
        OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, OTEL_SDK_DISABLED, Param,
    };
    let set = |p: Param<String>| p.raw().is_some_and(|v| !v.is_empty());
    // OTel's rule: only "true" (any case) disables.
    let disabled = OTEL_SDK_DISABLED
        .raw()
        .is_some_and(|v| v.eq_ignore_ascii_case("true"));
    !disabled && (set(OTEL_EXPORTER_OTLP_ENDPOINT) || set(OTEL_EXPORTER_OTLP_TRACES_ENDPOINT))
}

impl Telemetry {
    /// Must be called inside the tokio runtime (the tonic channel's worker runs on it).
    pub fn start(service: &str, dropped: Counter) -> Result<Telemetry, String> {
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
        Ok(Telemetry {
            tx: Mutex::new(Some(tx)),
            thread: Mutex::new(Some(thread)),
            provider,
            dropped,
        })
    }

    /// Never blocks: a full queue drops the span and counts it.
    pub fn record(&self, r: SpanRecord) {
        if let Some(tx) = &*self.tx.lock().unwrap_or_else(|e| e.into_inner()) {
            match tx.try_send(r) {
                Ok(()) => {}
                Err(TrySendError::Full(_)) | Err(TrySendError::Disconnected(_)) => {
                    self.dropped.inc();
                }
            }
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

fn span_loop(tracer: opentelemetry_sdk::trace::SdkTracer, rx: Receiver<SpanRecord>) {
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
        let name = format!("weft.{}", r.op);
        let attrs = vec![
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
        ];
        let mut span = tracer
            .span_builder(name)
            .with_kind(SpanKind::Internal)
            .with_start_time(at(r.start_ns))
            .with_attributes(attrs)
            .start_with_context(&tracer, &cx);
        span.end_with_timestamp(at(r.end_ns.max(r.start_ns)));
    }
}
