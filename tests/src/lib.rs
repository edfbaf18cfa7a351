//! Shared helpers of the multi-process tests: deterministic random data,
//! independent reference implementations, and a bounded launcher.
