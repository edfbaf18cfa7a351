//! OpenTelemetry: one span per collective and group on every rank of the pod,
//! parented under a job-level trace, exported over OTLP/gRPC to
//! `OTEL_EXPORTER_OTLP_ENDPOINT`.
//!
//! The exporter is the agent crate's ([`weft_agent::spans`]), the same one a
//! rank without a sidecar exports its own spans with, so the two never
//! differ; here it counts the spans it drops in `weft_spans_dropped_total`.

use prometheus_client::metrics::counter::Counter;
use weft_agent::spans::SpanExporter;

pub use weft_agent::spans::SpanRecord;

/// Whether the standard variables ask for trace export.
pub fn enabled() -> bool {
    weft_contract::env::otlp_endpoint().is_some()
}

pub struct Telemetry(SpanExporter);

impl Telemetry {
    /// Must be called inside the tokio runtime (the tonic channel's worker runs on it).
    pub fn start(service: &str, dropped: Counter) -> Result<Telemetry, String> {
        SpanExporter::start(
            service,
            Box::new(move || {
                dropped.inc();
            }),
        )
        .map(Telemetry)
    }

    /// Never blocks: a full queue drops the span and counts it.
    pub fn record(&self, r: SpanRecord) {
        self.0.record(r);
    }

    /// Flushes and stops. Blocks: call it off the async runtime's threads.
    pub fn shutdown(&self) {
        self.0.shutdown();
    }
}
