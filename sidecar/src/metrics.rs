//! Prometheus metrics of one sidecar (served on its HTTP port at /metrics).

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OpLabel {
    pub op: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ExportLabel {
    pub export: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ProxyLabel {
    pub peer: String,
    pub direction: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WhyLabel {
    pub port: String,
    pub reason: String,
}

fn latency_histogram() -> Histogram {
    // 10 us .. ~40 s
    Histogram::new(exponential_buckets(1e-5, 4.0, 12))
}

pub struct Metrics {
    pub registry: Registry,
    pub collectives: Family<OpLabel, Counter>,
    pub bytes: Family<OpLabel, Counter>,
    pub errors: Family<OpLabel, Counter>,
    pub latency: Family<OpLabel, Histogram, fn() -> Histogram>,
    pub peers_up: Gauge,
    pub rejected: Family<WhyLabel, Counter>,
    pub events_dropped: Counter,
    pub span_records: Family<ExportLabel, Counter>,
    pub stream_breaks: Counter,
    pub spans_dropped: Counter,
    pub status_queries: Counter,
    pub proxy_bytes: Family<ProxyLabel, Counter>,
    pub proxy_frames: Family<ProxyLabel, Counter>,
    pub proxy_up: Gauge,
    pub proxy_connections: Counter,
    pub proxy_lost: Counter,
    pub proxy_channels: Gauge,
}

impl Metrics {
    pub fn new() -> Metrics {
        let mut registry = Registry::with_prefix("weft");
        let m = Metrics {
            collectives: Family::default(),
            bytes: Family::default(),
            errors: Family::default(),
            latency: Family::new_with_constructor(latency_histogram as fn() -> Histogram),
            peers_up: Gauge::default(),
            rejected: Family::default(),
            events_dropped: Counter::default(),
            span_records: Family::default(),
            stream_breaks: Counter::default(),
            spans_dropped: Counter::default(),
            status_queries: Counter::default(),
            proxy_bytes: Family::default(),
            proxy_frames: Family::default(),
            proxy_up: Gauge::default(),
            proxy_connections: Counter::default(),
            proxy_lost: Counter::default(),
            proxy_channels: Gauge::default(),
            registry: Registry::default(),
        };
        registry.register(
            "collectives",
            "Collectives and groups completed",
            m.collectives.clone(),
        );
        registry.register("bytes", "Bytes moved by collectives", m.bytes.clone());
        registry.register("errors", "Collectives that failed", m.errors.clone());
        registry.register(
            "collective_latency_seconds",
            "Collective latency",
            m.latency.clone(),
        );
        registry.register(
            "peers_up",
            "Rank processes attached and alive",
            m.peers_up.clone(),
        );
        registry.register(
            "rejected_connections",
            "Connections or messages refused (bad secret, garbage, oversized)",
            m.rejected.clone(),
        );
        registry.register(
            "events_dropped",
            "Operations ranks could not report: their telemetry ring was full",
            m.events_dropped.clone(),
        );
        registry.register(
            "span_records",
            "Operations read from the ranks, by how they were exported (span, failure, slow, aggregate)",
            m.span_records.clone(),
        );
        registry.register(
            "stream_breaks",
            "Control streams that ended while their rank process lived on (it attaches again)",
            m.stream_breaks.clone(),
        );
        registry.register(
            "spans_dropped",
            "Spans dropped because the trace exporter was slow",
            m.spans_dropped.clone(),
        );
        registry.register(
            "status_queries",
            "RAS status queries served",
            m.status_queries.clone(),
        );
        registry.register(
            "proxy_bytes",
            "Payload bytes the proxy moved per peer host and direction",
            m.proxy_bytes.clone(),
        );
        registry.register(
            "proxy_frames",
            "Data frames the proxy moved per peer host and direction",
            m.proxy_frames.clone(),
        );
        registry.register(
            "proxy_connections_up",
            "Proxy connections to peer hosts that are up",
            m.proxy_up.clone(),
        );
        registry.register(
            "proxy_connections",
            "Proxy connections to peer hosts established",
            m.proxy_connections.clone(),
        );
        registry.register(
            "proxy_hosts_lost",
            "Proxy connections lost (each fails the job)",
            m.proxy_lost.clone(),
        );
        registry.register(
            "proxy_channels",
            "Proxied channel directions open (rank rings mapped)",
            m.proxy_channels.clone(),
        );
        Metrics { registry, ..m }
    }

    /// The per-host counter family `what` ("bytes" or "frames").
    pub fn proxy(&self, what: &str) -> &Family<ProxyLabel, Counter> {
        if what == "frames" {
            &self.proxy_frames
        } else {
            &self.proxy_bytes
        }
    }

    pub fn reject(&self, port: &str, reason: &str) {
        self.rejected
            .get_or_create(&WhyLabel {
                port: port.into(),
                reason: reason.into(),
            })
            .inc();
    }

    pub fn encode(&self) -> String {
        let mut s = String::new();
        let _ = prometheus_client::encoding::text::encode(&mut s, &self.registry);
        s
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}
