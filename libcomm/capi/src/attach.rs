//! Attaches C programs to the pod's sidecar, as Rust programs do with
//! `weft::agent::install_from_env()` (both through crate `weft-agent`, the
//! client alone: this library links none of the sidecar's server stack): with
//! `WEFT_SIDECAR_SOCKET` set, the first communicator created in the process
//! registers the process with the sidecar, and every communicator and
//! operation is reported to it (RAS, OpenTelemetry spans, Prometheus metrics,
//! pod-lifecycle abort). Without the variable nothing is started (a plain
//! NCCL program gets no extra thread).

use crate::errors::{Level, log};
use std::sync::Once;

/// Attaches once per process (later calls return at once). A sidecar that
/// cannot be reached is a warning, not an error: the collectives still work,
/// only the pod's view of this process is missing.
pub fn ensure() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let Some(path) = weft_contract::params::WEFT_SIDECAR_SOCKET
            .raw_os()
            .filter(|s| !s.is_empty())
        else {
            return;
        };
        let path = path.to_string_lossy().into_owned();
        match weft_agent::install_from_env(None) {
            Ok(_) => {
                // Flush queued events and end the stream cleanly at a normal
                // exit, so the sidecar does not take this process for dead.
                // SAFETY: registering a plain extern "C" function.
                unsafe { libc::atexit(close_at_exit) };
                log(Level::Info, &format!("attached to the sidecar at {path}"));
            }
            Err(e) => log(
                Level::Warn,
                &format!(
                    "cannot attach to the sidecar at {path} (WEFT_SIDECAR_SOCKET): {e}; collectives still run, but RAS, tracing and pod-lifecycle abort will not see this process"
                ),
            ),
        }
    });
}

extern "C" fn close_at_exit() {
    if let Some(a) = weft_agent::installed() {
        a.close();
    }
}
