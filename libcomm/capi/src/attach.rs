//! Attaches C programs to the pod's sidecar, as Rust programs do with
//! `weft::agent::install_from_env()` (both through crate `weft-agent`, the
//! client alone: this library links none of the sidecar's server stack): with
//! `WEFT_SIDECAR_SOCKET` set, the first communicator created in the process
//! registers the process with the sidecar, and every communicator and
//! operation is reported to it (RAS, OpenTelemetry spans, Prometheus metrics,
//! pod-lifecycle abort). Without the variable nothing is started (a plain
//! NCCL program gets no extra thread); if OpenTelemetry export is asked for
//! all the same (`OTEL_EXPORTER_OTLP_ENDPOINT`), one warning says that this
//! library exports spans only through a sidecar, and how to start one.

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
            if let Some(w) = spans_without_sidecar(|name| std::env::var(name).ok()) {
                warn_always(&w);
            }
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

/// The warning for a process that asks for OTLP span export but has no
/// sidecar (`None` when it does not ask). This library links no
/// OpenTelemetry exporter (only the sidecar's client): spans leave a
/// process through its sidecar. `raw` reads a variable by name.
pub fn spans_without_sidecar(raw: impl Fn(&'static str) -> Option<String>) -> Option<String> {
    use weft_contract::params::{
        OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, OTEL_SDK_DISABLED,
    };
    // OTel's rule: only "true" (any case) disables.
    let disabled = raw(OTEL_SDK_DISABLED.name()).is_some_and(|v| v.eq_ignore_ascii_case("true"));
    let endpoint = [
        OTEL_EXPORTER_OTLP_TRACES_ENDPOINT,
        OTEL_EXPORTER_OTLP_ENDPOINT,
    ]
    .into_iter()
    .find_map(|p| {
        raw(p.name())
            .filter(|v| !v.is_empty())
            .map(|v| (p.name(), v))
    });
    let (name, url) = endpoint.filter(|_| !disabled)?;
    Some(format!(
        "{name}={url} is set, but this process has no sidecar (WEFT_SIDECAR_SOCKET is not set): \
         libnccl.so.2 exports no OpenTelemetry spans itself, so none of this process's collectives \
         are traced. Run it under `weft run --sidecar`, or start `weft sidecar --socket PATH` \
         (it reads the OTEL_* variables) and set WEFT_SIDECAR_SOCKET=PATH"
    ))
}

/// A warning shown whatever the log level (once per process, by the caller).
fn warn_always(msg: &str) {
    use std::io::Write;
    let line = format!(
        "{}:{} weft WARN {msg}\n",
        crate::errors::host(),
        std::process::id()
    );
    let _ = std::io::stderr().write_all(line.as_bytes());
}

#[cfg(test)]
mod tests {
    use super::spans_without_sidecar;

    fn env(vars: &[(&str, &str)]) -> impl Fn(&'static str) -> Option<String> {
        let vars: Vec<(String, String)> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |p| vars.iter().find(|(k, _)| k == p).map(|(_, v)| v.clone())
    }

    /// OTLP export asked for without a sidecar: a warning naming the
    /// endpoint, why nothing is exported and what to do (it said nothing).
    #[test]
    fn otlp_without_a_sidecar_is_warned_about() {
        let w = spans_without_sidecar(env(&[(
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            "http://collector:4317",
        )]))
        .expect("a warning");
        assert!(
            w.contains("OTEL_EXPORTER_OTLP_ENDPOINT=http://collector:4317"),
            "{w}"
        );
        assert!(w.contains("WEFT_SIDECAR_SOCKET is not set"), "{w}");
        assert!(w.contains("weft run --sidecar"), "{w}");
        assert!(spans_without_sidecar(env(&[])).is_none());
        assert!(spans_without_sidecar(env(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "")])).is_none());
        assert!(
            spans_without_sidecar(env(&[
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4317"),
                ("OTEL_SDK_DISABLED", "TRUE"),
            ]))
            .is_none()
        );
        let w = spans_without_sidecar(env(&[(
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
            "http://t:4317",
        )]))
        .expect("a warning");
        assert!(
            w.contains("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=http://t:4317"),
            "{w}"
        );
    }
}
