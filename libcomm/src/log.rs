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

thread_local! {
    static CALL_BEGAN: std::cell::Cell<Option<std::time::Instant>> = const { std::cell::Cell::new(None) };
}

/// With `TRACE`: a public call began on this thread now (a per-phase
/// timing further down the call, such as the cross-host enqueue's, counts
/// its first phase from here). Otherwise nothing.
pub fn mark_call() {
    if level() >= Level::Trace {
        CALL_BEGAN.with(|c| c.set(Some(std::time::Instant::now())));
    }
}

/// When the call [`mark_call`] marked began (taken: once per call).
pub fn call_began() -> Option<std::time::Instant> {
    CALL_BEGAN.with(|c| c.take())
}

pub fn host() -> &'static str {
    static HOST: OnceLock<String> = OnceLock::new();
    HOST.get_or_init(crate::sys::topology::system_hostname)
}

/// One log line: `host:pid:tid HH:MM:SS.uuuuuu weft TAG message` (UTC time
/// of day, microseconds: lines of many ranks merge in order, and the phases
/// of a recovery can be timed from them). The C ABI writes its lines with
/// this too.
pub fn line(tag: &str, msg: std::fmt::Arguments<'_>) -> String {
    format!(
        "{}:{}:{} {} weft {tag} {msg}\n",
        host(),
        std::process::id(),
        crate::sys::topology::gettid(),
        time_of_day(std::time::SystemTime::now())
    )
}

/// `HH:MM:SS.uuuuuu`, UTC.
fn time_of_day(t: std::time::SystemTime) -> String {
    let d = t.duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    let s = d.as_secs() % 86_400;
    format!(
        "{:02}:{:02}:{:02}.{:06}",
        s / 3600,
        s / 60 % 60,
        s % 60,
        d.subsec_micros()
    )
}

#[doc(hidden)]
pub fn emit(lvl: Level, args: std::fmt::Arguments<'_>) {
    use std::io::Write;
    let tag = match lvl {
        Level::Warn => "WARN",
        Level::Info => "INFO",
        _ => "TRACE",
    };
    let _ = std::io::stderr().write_all(line(tag, args).as_bytes());
}

macro_rules! warn_log {
    ($($t:tt)*) => { if $crate::log::level() >= $crate::log::Level::Warn { $crate::log::emit($crate::log::Level::Warn, format_args!($($t)*)) } };
}
macro_rules! info_log {
    ($($t:tt)*) => { if $crate::log::level() >= $crate::log::Level::Info { $crate::log::emit($crate::log::Level::Info, format_args!($($t)*)) } };
}
pub(crate) use {info_log, warn_log};

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, UNIX_EPOCH};

    #[test]
    fn a_line_carries_the_utc_time_of_day_to_the_microsecond() {
        let t = UNIX_EPOCH + Duration::from_micros(86_400 * 3 * 1_000_000 + 3_723_000_042);
        assert_eq!(time_of_day(t), "01:02:03.000042");
        let l = line("INFO", format_args!("comm x rank {}", 1));
        let (head, tail) = l.split_once(" weft INFO ").unwrap();
        assert_eq!(tail, "comm x rank 1\n");
        let stamp = head.rsplit(' ').next().unwrap();
        assert_eq!(stamp.len(), "00:00:00.000000".len(), "{l}");
        assert!(head.starts_with(&format!("{}:{}:", host(), std::process::id())));
    }
}
