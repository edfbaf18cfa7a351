//! Observability of the operator itself: Prometheus metrics and the small
//! HTTP server for `/metrics`, `/healthz` and `/readyz`.

pub mod http;
pub mod metrics;
