//! The sidecar's HTTP port: Prometheus /metrics, /healthz, /readyz, and the
//! RAS report as plain text (/ras) and JSON (/ras.json). Every handler reads
//! the published snapshot only.

use super::Engine;
use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use std::sync::Arc;
use std::sync::atomic::Ordering;

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
    crate::ras::render(&e.status())
}

async fn ras_json(State(e): State<Arc<Engine>>) -> impl IntoResponse {
    e.metrics.status_queries.inc();
    (
        [(header::CONTENT_TYPE, "application/json")],
        serde_json::to_string_pretty(&e.status()).unwrap_or_default(),
    )
}
