//! A real OTLP/gRPC trace receiver for the tests (the OpenTelemetry
//! collector's `TraceService`, served by tonic on 127.0.0.1): it keeps every
//! span it is sent, with its attributes as text. The `otlp-sink` program
//! serves the same receiver in a cluster (e2e).
//!
//! Self-contained (it uses only tonic, tokio and opentelemetry-proto) so
//! that the C ABI's tests (`libcomm/capi/tests/capi.rs`), which cannot
//! depend on this crate, include this same file.

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// One span as received.
#[derive(Debug, Clone)]
pub struct Got {
    pub name: String,
    pub trace_id: Vec<u8>,
    pub parent: Vec<u8>,
    pub start_ns: u64,
    pub end_ns: u64,
    pub attrs: BTreeMap<String, String>,
}

/// Every span received so far.
#[derive(Clone, Default)]
pub struct Receiver(pub Arc<Mutex<Vec<Got>>>);

impl Receiver {
    /// The spans received, once `enough` says they are all there or `limit`
    /// has passed (an exporter flushes at its process's exit; the receiver
    /// records a moment later).
    pub fn spans_when(&self, enough: impl Fn(&[Got]) -> bool, limit: Duration) -> Vec<Got> {
        let t = Instant::now();
        loop {
            let spans = self.0.lock().unwrap().clone();
            if enough(&spans) || t.elapsed() > limit {
                return spans;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

fn text(v: Option<&Value>) -> String {
    match v {
        Some(Value::StringValue(s)) => s.clone(),
        Some(Value::IntValue(i)) => i.to_string(),
        Some(Value::BoolValue(b)) => b.to_string(),
        other => format!("{other:?}"),
    }
}

#[tonic::async_trait]
impl TraceService for Receiver {
    async fn export(
        &self,
        req: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut out = self.0.lock().unwrap();
        for rs in req.into_inner().resource_spans {
            for ss in rs.scope_spans {
                for sp in ss.spans {
                    let attrs = sp
                        .attributes
                        .iter()
                        .map(|kv| {
                            let v = kv.value.as_ref().and_then(|v| v.value.as_ref());
                            (kv.key.clone(), text(v))
                        })
                        .collect();
                    out.push(Got {
                        name: sp.name,
                        trace_id: sp.trace_id,
                        parent: sp.parent_span_id,
                        start_ns: sp.start_time_unix_nano,
                        end_ns: sp.end_time_unix_nano,
                        attrs,
                    });
                }
            }
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

/// Serves `r` on a bound listener until the process ends.
pub async fn serve(r: Receiver, l: std::net::TcpListener) -> std::io::Result<()> {
    l.set_nonblocking(true)?;
    let l = tokio::net::TcpListener::from_std(l)?;
    tonic::transport::Server::builder()
        .add_service(TraceServiceServer::new(r))
        .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(l))
        .await
        .map_err(std::io::Error::other)
}

/// Serves the receiver on 127.0.0.1 on a thread of its own; returns its port.
pub fn start(r: Receiver) -> (u16, std::thread::JoinHandle<()>) {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let h = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let _ = rt.block_on(serve(r, l));
    });
    (port, h)
}
