//! The sidecar's HTTP port: Prometheus /metrics, /healthz, /readyz, and the
//! RAS report as plain text (/ras) and JSON (/ras.json). Every handler reads
//! the published snapshot only.
//!
//! Served by hyper's HTTP/1 server directly (not `axum::serve`), so that the
//! port has caps and timeouts: a request's header must arrive within the
//! handshake timeout (also the limit of a kept-alive connection between
//! requests), a connection that moves no byte either way for the idle
//! timeout is closed, and connections are capped in all and per source by a
//! [`Gate`] where a connection without a request in progress is evictable:
//! a flood of slow or silent connections cannot keep a liveness probe out.
//! Refused requests (400, 431, a header too slow) are counted and logged.

use super::Engine;
use super::limits::Gate;
use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use std::io;
use std::os::fd::AsFd;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tower::Service;

pub fn router(engine: Arc<Engine>) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/ras", get(ras_text))
        .route("/ras.json", get(ras_json))
        .with_state(engine)
}

async fn metrics(State(e): State<Arc<Engine>>) -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        e.metrics.encode(),
    )
}

async fn readyz(State(e): State<Arc<Engine>>) -> impl IntoResponse {
    if e.state.terminating.load(Ordering::Relaxed) {
        (StatusCode::SERVICE_UNAVAILABLE, "terminating\n")
    } else {
        (StatusCode::OK, "ready\n")
    }
}

async fn ras_text(State(e): State<Arc<Engine>>) -> impl IntoResponse {
    e.metrics.status_queries.inc();
    crate::ras_report::render(&e.status())
}

async fn ras_json(State(e): State<Arc<Engine>>) -> impl IntoResponse {
    e.metrics.status_queries.inc();
    (
        [(header::CONTENT_TYPE, "application/json")],
        serde_json::to_string_pretty(&e.status()).unwrap_or_default(),
    )
}

/// The HTTP port's limits.
#[derive(Clone)]
pub struct HttpLimits {
    pub gate: Arc<Gate>,
    /// A request's header must be complete this long after the connection
    /// opened or the previous response.
    pub header: Duration,
    /// A connection that moves no byte either way for this long is closed.
    pub idle: Duration,
}

/// A connection that records when it last moved a byte.
struct Tracked {
    s: TcpStream,
    t0: Instant,
    last_ms: Arc<AtomicU64>,
}

impl Tracked {
    fn touch(&self) {
        self.last_ms
            .store(self.t0.elapsed().as_millis() as u64, Ordering::Relaxed);
    }
}

impl AsyncRead for Tracked {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.s).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.touch();
        }
        r
    }
}

impl AsyncWrite for Tracked {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.s).poll_write(cx, buf);
        if matches!(r, Poll::Ready(Ok(n)) if n > 0) {
            self.touch();
        }
        r
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.s).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.s).poll_shutdown(cx)
    }
}

/// Serves `router` on `l` until `stop` turns true.
pub async fn serve(
    l: TcpListener,
    router: Router,
    lim: HttpLimits,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    loop {
        let accepted = tokio::select! {
            a = l.accept() => a,
            _ = stop.wait_for(|s| *s) => return,
        };
        let (s, from) = match accepted {
            Ok(x) => x,
            Err(e) => {
                // Out of descriptors, most likely: say so (rate-limited), back off.
                lim.gate
                    .refused(None, "accept", &format!("accept failed: {e}"));
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Some(ticket) = lim.gate.admit(s.as_fd(), Some(from.ip())) else {
            continue; // refused (counted, logged): dropping it closes it
        };
        let (router, lim) = (router.clone(), lim.clone());
        tokio::spawn(async move {
            let last_ms = Arc::new(AtomicU64::new(0));
            let io = Tracked {
                s,
                t0: Instant::now(),
                last_ms: last_ms.clone(),
            };
            let served = Arc::new(AtomicU64::new(0));
            let (slot, served2) = (ticket.slot.clone(), served.clone());
            let svc = hyper::service::service_fn(move |req: axum::http::Request<Incoming>| {
                // A request in progress is never evicted.
                slot.hold(true);
                served2.fetch_add(1, Ordering::Relaxed);
                let (mut r, slot) = (router.clone(), slot.clone());
                async move {
                    let resp = r.call(req).await;
                    slot.hold(false);
                    resp
                }
            });
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(lim.header)
                .max_buf_size(64 << 10)
                .serve_connection(TokioIo::new(io), svc);
            tokio::pin!(conn);
            let t0 = Instant::now();
            let tick = (lim.idle / 4).max(Duration::from_millis(50));
            let why: Option<(&'static str, String)> = loop {
                tokio::select! {
                    r = conn.as_mut() => break match r {
                        Ok(()) => None,
                        Err(e) => classify(&e, served.load(Ordering::Relaxed), lim.header),
                    },
                    _ = tokio::time::sleep(tick) => {
                        let last = Duration::from_millis(last_ms.load(Ordering::Relaxed));
                        if t0.elapsed().saturating_sub(last) >= lim.idle {
                            break Some((
                                "idle",
                                format!("no byte either way for {} s", lim.idle.as_secs_f64()),
                            ));
                        }
                    }
                }
            };
            if let Some((reason, why)) = why
                && !ticket.slot.evicted()
            {
                lim.gate.refused(Some(from.ip()), reason, &why);
            }
        });
    }
}

/// What a failed HTTP connection counts as (`None`: an ordinary end).
fn classify(e: &hyper::Error, served: u64, header: Duration) -> Option<(&'static str, String)> {
    if e.is_parse_too_large() {
        Some((
            "oversized",
            "request header too large (answered 431)".into(),
        ))
    } else if e.is_parse() || e.is_parse_status() {
        Some(("garbage", format!("not HTTP/1 (answered 400): {e}")))
    } else if e.is_timeout() && served == 0 {
        // After a response, the same timeout ends an idle kept-alive connection.
        Some((
            "timeout",
            format!(
                "no complete request header within {} s",
                header.as_secs_f64()
            ),
        ))
    } else {
        None
    }
}
