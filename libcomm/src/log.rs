//! Minimal levelled logging to stderr, controlled by `WEFT_DEBUG` or NCCL's
//! `NCCL_DEBUG` (`WARN`, `INFO`, `TRACE`). Every line names host, pid and the
//! communicator/rank it concerns, so logs from many ranks can be merged.

use std::sync::OnceLock;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    Off = 0,
    Warn = 1,
    Info = 2,
    Trace = 3,
}

pub fn level() -> Level {
    static LEVEL: OnceLock<Level> = OnceLock::new();
    *LEVEL.get_or_init(|| {
        use weft_contract::params::{NCCL_DEBUG, WEFT_DEBUG};
        // Set at all (even empty), WEFT_DEBUG wins; unknown levels are off
        // (NCCL_DEBUG=VERSION is NCCL's, not an error).
        let v = WEFT_DEBUG
            .raw()
            .or_else(|| NCCL_DEBUG.raw())
            .unwrap_or_default();
        match v.to_ascii_uppercase().as_str() {
            "WARN" => Level::Warn,
            "INFO" => Level::Info,
            "TRACE" | "ALL" => Level::Trace,
            _ => Level::Off,
        }
    })
}

pub fn host() -> &'static str {
    static HOST: OnceLock<String> = OnceLock::new();
    HOST.get_or_init(crate::sys::topology::system_hostname)
}

#[doc(hidden)]
pub fn emit(lvl: Level, args: std::fmt::Arguments<'_>) {
    use std::io::Write;
    let tag = match lvl {
        Level::Warn => "WARN",
        Level::Info => "INFO",
        _ => "TRACE",
    };
    let line = format!(
        "{}:{}:{} weft {tag} {args}\n",
        host(),
        std::process::id(),
        crate::sys::topology::gettid()
    );
    let _ = std::io::stderr().write_all(line.as_bytes());
}

macro_rules! warn_log {
    ($($t:tt)*) => { if $crate::log::level() >= $crate::log::Level::Warn { $crate::log::emit($crate::log::Level::Warn, format_args!($($t)*)) } };
}
macro_rules! info_log {
    ($($t:tt)*) => { if $crate::log::level() >= $crate::log::Level::Info { $crate::log::emit($crate::log::Level::Info, format_args!($($t)*)) } };
}
pub(crate) use {info_log, warn_log};
