//! Weft's configuration, in one place.
//!
//! - [`params`]: every environment variable any part of Weft reads (libcomm,
//!   the C ABI, the CUDA path, the sidecar, `weft run`/`weft bench`, the
//!   operator), declared once with its type, default, help and readers (NCCL's
//!   `NCCL_PARAM` idea), with typed accessors. It is the only code that reads
//!   the process environment; README.md's configuration table is generated
//!   from it ([`params::readme_table`]); [`params::warn_unknown_once`] names
//!   the closest known variable for a misspelt `WEFT_*` one.
//! - [`mod@env`]: the environment contract between the operator, a launcher
//!   (`weft run`, the pod) and each rank process, as typed structs.
//! - [`board`]: the recovery board's protocol between the launcher, the
//!   sidecars and libcomm's `Resilient` ranks: file names, the `dead` line,
//!   the bounds a peer's post must keep, the atomic write.
//!
//! The crate has no dependencies: everything that runs Weft links it.

pub mod board;
pub mod env;
pub mod params;

/// A lookup over a fixed table of variables, for the tests' `*_from(lookup)` calls.
#[cfg(test)]
pub(crate) fn test_table(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> + use<> {
    let m: std::collections::HashMap<String, String> = vars
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    move |k| m.get(k).cloned()
}
