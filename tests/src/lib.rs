//! Shared helpers of the multi-process tests: deterministic random data with
//! an independent reference ([`data`]), and a bounded launcher ([`job`]).

pub mod data;
pub mod job;
pub mod matrix;
pub mod netns;
pub mod sidecar;
