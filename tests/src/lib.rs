//! Shared helpers of the multi-process tests: deterministic random data with
//! an independent reference ([`data`]), a bounded launcher ([`job`]), and a
//! real OTLP trace receiver ([`otlp`]).

pub mod data;
pub mod job;
pub mod matrix;
pub mod netns;
pub mod otlp;
pub mod sidecar;
