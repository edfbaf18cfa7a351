//! Where the backend's log lines go: a logger the embedding program
//! installs (the C ABI routes the lines to `NCCL_DEBUG`), stderr for
//! warnings otherwise. Its own module because every part of the backend
//! logs, and none of them should import the batch router to do so.

use std::sync::OnceLock;

/// Where the backend's informational lines go (the C ABI routes them to
/// NCCL_DEBUG); `warn` marks warnings.
pub type Logger = fn(warn: bool, line: &str);
static LOGGER: OnceLock<Logger> = OnceLock::new();

/// Installs the logger (first call wins). Without one, warnings go to stderr
/// when `WEFT_DEBUG` is set.
pub fn set_logger(f: Logger) {
    let _ = LOGGER.set(f);
}

/// One line for the log; `warn` marks a warning.
pub(super) fn log(warn: bool, line: &str) {
    match LOGGER.get() {
        Some(f) => f(warn, line),
        None if warn && weft_contract::params::WEFT_DEBUG.raw_os().is_some() => {
            eprintln!("weft WARN {line}")
        }
        None => {}
    }
}

/// A warning for the log (NCCL_DEBUG=WARN through the C ABI).
pub(super) fn warn(line: &str) {
    log(true, line)
}
