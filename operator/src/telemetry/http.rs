//! `/metrics` (Prometheus), `/healthz` (liveness) and `/readyz` (readiness,
//! see [`Readiness`]).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;

use super::metrics::Metrics;

#[derive(Clone)]
pub struct HttpState {
    pub metrics: Arc<Metrics>,
    pub readiness: Arc<Readiness>,
}

/// What `/readyz` answers.
///
/// - The leader is ready while its CollectiveJob watch works (listed, no
///   error since): a leader that cannot see jobs is not doing its work.
/// - A standby is ready while it can reach the API server (its last Lease
///   poll succeeded): it is healthy and able to take over, so a Deployment of
///   2 replicas is Available and a rollout of 1 replica (surge pod = standby)
///   finishes.
/// - Nobody is ready after SIGTERM.
#[derive(Debug, Default)]
pub struct Readiness {
    pub leading: AtomicBool,
    pub standby_ok: AtomicBool,
    pub watch_ok: AtomicBool,
    pub stopping: AtomicBool,
}

impl Readiness {
    /// Ok(what) when ready, Err(why not) otherwise.
    pub fn check(&self) -> Result<&'static str, &'static str> {
        let get = |b: &AtomicBool| b.load(Ordering::Relaxed);
        if get(&self.stopping) {
            Err("shutting down")
        } else if get(&self.leading) {
            if get(&self.watch_ok) {
                Ok("leader: watching CollectiveJobs")
            } else {
                Err("leader: the CollectiveJob watch is not established")
            }
        } else if get(&self.standby_ok) {
            Ok("standby: polling the leader Lease")
        } else {
            Err("cannot reach the API server")
        }
    }
}

pub fn router(state: HttpState) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .with_state(state)
}

async fn metrics(State(s): State<HttpState>) -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        s.metrics.encode(),
    )
}

async fn readyz(State(s): State<HttpState>) -> impl IntoResponse {
    match s.readiness.check() {
        Ok(what) => (StatusCode::OK, what),
        Err(why) => (StatusCode::SERVICE_UNAVAILABLE, why),
    }
}

pub async fn serve(addr: SocketAddr, state: HttpState) -> std::io::Result<()> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    tracing::info!(%addr, "serving /metrics, /healthz, /readyz");
    axum::serve(listener, router(state)).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn endpoints_answer() {
        let ready = Arc::new(Readiness::default());
        let state = HttpState {
            metrics: Arc::new(Metrics::default()),
            readiness: ready.clone(),
        };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, router(state)).await });
        // A plain blocking HTTP/1.1 client keeps tokio's io-util out of the build.
        let get = |path: &'static str| async move {
            tokio::task::spawn_blocking(move || {
                use std::io::{Read, Write};
                let mut s = std::net::TcpStream::connect(addr).unwrap();
                let req = format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
                s.write_all(req.as_bytes()).unwrap();
                let mut out = String::new();
                s.read_to_string(&mut out).unwrap();
                out
            })
            .await
            .unwrap()
        };
        assert!(get("/healthz").await.starts_with("HTTP/1.1 200"));
        assert!(get("/readyz").await.starts_with("HTTP/1.1 503"));
        // issue 19 (3): a healthy standby is ready (rollouts finish)
        ready.standby_ok.store(true, Ordering::Relaxed);
        let r = get("/readyz").await;
        assert!(
            r.starts_with("HTTP/1.1 200") && r.contains("standby"),
            "{r}"
        );
        // issue 19 (1): a leader is ready only while its watch works
        ready.leading.store(true, Ordering::Relaxed);
        let r = get("/readyz").await;
        assert!(r.starts_with("HTTP/1.1 503") && r.contains("watch"), "{r}");
        ready.watch_ok.store(true, Ordering::Relaxed);
        assert!(get("/readyz").await.starts_with("HTTP/1.1 200"));
        ready.stopping.store(true, Ordering::Relaxed);
        assert!(get("/readyz").await.starts_with("HTTP/1.1 503"));
        let m = get("/metrics").await;
        assert!(m.starts_with("HTTP/1.1 200"));
        assert!(m.contains("weft_operator_reconciles_total"));
    }
}
