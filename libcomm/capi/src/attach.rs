//! Attaches C programs to the pod's sidecar, as Rust programs do with
//! `weft::agent::install_from_env()` (both through crate `weft-agent`): with
//! `WEFT_SIDECAR_SOCKET` set, the first communicator created in the process
//! registers the process with the sidecar, and every communicator and
//! operation is reported to it (RAS, OpenTelemetry spans, Prometheus metrics,
//! pod-lifecycle abort). Without the variable nothing is started (a plain
//! NCCL program gets no extra thread), unless OpenTelemetry export is asked
//! for (`OTEL_EXPORTER_OTLP_ENDPOINT` or `..._TRACES_ENDPOINT`, and not
//! `OTEL_SDK_DISABLED=true`): then this process exports its spans itself
//! (embedded mode, `weft_agent::spans_only`: the sidecar's span exporter
//! without the sidecar; feature `embedded-spans`, on by default), flushed at
//! a normal exit. Built without the feature, one warning says that no spans
//! are exported, and how to get them.

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
            if let Some((name, url)) = weft_contract::env::otlp_endpoint() {
                embedded_spans(name, &url);
            }
            return;
        };
        let path = path.to_string_lossy().into_owned();
        match weft_agent::install_from_env(None) {
            // The agent flushes its queue and ends the stream cleanly at a
            // normal exit (its own atexit), so the sidecar does not take this
            // process for dead.
            Ok(_) => log(Level::Info, &format!("attached to the sidecar at {path}")),
            Err(e) => log(
                Level::Warn,
                &format!(
                    "cannot attach to the sidecar at {path} (WEFT_SIDECAR_SOCKET): {e}; collectives still run, but RAS, tracing and pod-lifecycle abort will not see this process"
                ),
            ),
        }
    });
}

/// Without a sidecar, OTLP export asked for: this process exports its spans.
#[cfg(feature = "embedded-spans")]
fn embedded_spans(name: &str, url: &str) {
    match weft_agent::spans_only::install_from_env() {
        // Flushed at a normal exit by the agent's own atexit.
        Ok(_) => {
            log(
                Level::Info,
                &format!(
                    "no sidecar (WEFT_SIDECAR_SOCKET is not set): this process exports its spans to {url} ({name}) itself"
                ),
            );
        }
        Err(e) => warn_always(&format!(
            "{name}={url} is set, but the in-process span exporter did not start: {e}; no spans are exported"
        )),
    }
}

/// Built without the engine: say so, once.
#[cfg(not(feature = "embedded-spans"))]
fn embedded_spans(name: &str, url: &str) {
    warn_always(&spans_without_sidecar(name, url));
}

/// The warning of a build without the span exporter, for `name`=`url`.
pub fn spans_without_sidecar(name: &str, url: &str) -> String {
    format!(
        "{name}={url} is set, but this process has no sidecar (WEFT_SIDECAR_SOCKET is not set) and this \
         libnccl.so.2 was built without its span exporter (feature embedded-spans): none of this \
         process's collectives are traced. Run it under `weft run --sidecar`, or start `weft sidecar \
         --socket PATH` (it reads the OTEL_* variables) and set WEFT_SIDECAR_SOCKET=PATH"
    )
}

/// A warning shown whatever the log level (once per process, by the caller).
fn warn_always(msg: &str) {
    use std::io::Write;
    let line = libcomm::log_line("WARN", format_args!("{msg}"));
    let _ = std::io::stderr().write_all(line.as_bytes());
}

#[cfg(test)]
mod tests {
    use super::spans_without_sidecar;

    /// The warning of a build without the exporter names the variable and
    /// the way to get spans.
    #[test]
    fn the_warning_without_the_exporter_says_how_to_get_spans() {
        let w = spans_without_sidecar("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4317");
        assert!(
            w.contains("OTEL_EXPORTER_OTLP_ENDPOINT=http://c:4317"),
            "{w}"
        );
        assert!(w.contains("weft run --sidecar"), "{w}");
    }
}
