//! A minimal OpenTelemetry trace receiver (the collector's OTLP/gRPC
//! `TraceService`): the sidecar tests collect spans with it, and the
//! `otlp-sink` program serves it in a cluster (e2e), printing every span.

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use std::collections::BTreeMap;
use std::io::Write;
use std::sync::{Arc, Mutex};

/// One received span: its name, trace and parent ids, and attributes as text.
#[derive(Debug, Clone)]
pub struct Got {
    pub name: String,
    pub trace_id: Vec<u8>,
    pub parent: Vec<u8>,
    pub attrs: BTreeMap<String, String>,
}

impl Got {
    /// One line of JSON: `{"name":..., "attrs":{...}}`.
    pub fn json(&self) -> String {
        serde_json::json!({"name": self.name, "attrs": self.attrs}).to_string()
    }
}

/// Keeps every span it receives; with `print`, also writes each as a JSON
/// line to stdout as it arrives.
#[derive(Clone, Default)]
pub struct Receiver {
    pub spans: Arc<Mutex<Vec<Got>>>,
    pub print: bool,
}

impl Receiver {
    /// The spans received so far.
    pub fn spans(&self) -> Vec<Got> {
        self.spans.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

fn text(v: Option<&Value>) -> String {
    match v {
        Some(Value::StringValue(s)) => s.clone(),
        Some(Value::IntValue(i)) => i.to_string(),
        Some(Value::BoolValue(b)) => b.to_string(),
        Some(Value::DoubleValue(d)) => d.to_string(),
        other => format!("{other:?}"),
    }
}

#[tonic::async_trait]
impl TraceService for Receiver {
    async fn export(
        &self,
        req: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut got = Vec::new();
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
                    got.push(Got {
                        name: sp.name,
                        trace_id: sp.trace_id,
                        parent: sp.parent_span_id,
                        attrs,
                    });
                }
            }
        }
        if self.print {
            let mut out = std::io::stdout().lock();
            for g in &got {
                let _ = writeln!(out, "{}", g.json());
            }
            let _ = out.flush();
        }
        self.spans
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .extend(got);
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

/// Serves `r` on 127.0.0.1 on a thread of its own; returns the port.
pub fn start(r: Receiver) -> (u16, std::thread::JoinHandle<()>) {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port on 127.0.0.1");
    let port = l.local_addr().expect("its address").port();
    let h = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a tokio runtime");
        let _ = rt.block_on(serve(r, l));
    });
    (port, h)
}
