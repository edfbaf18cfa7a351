//! The sidecar's log lines (stderr), and a rate limit for those a flood
//! could repeat.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

pub fn log(msg: &str) {
    eprintln!("weft sidecar: {msg}");
}

/// A source's refusals of one kind on a port are logged at most this often.
pub const LOG_EVERY: Duration = Duration::from_secs(10);

/// (port, reason, source)
type Key = (&'static str, &'static str, Option<IpAddr>);

/// Logs a line per (port, reason, source) at most every [`LOG_EVERY`]; the lines
/// suppressed in between are counted in the next one.
pub struct RateLog {
    every: Duration,
    seen: Mutex<HashMap<Key, (Instant, u64)>>,
}

impl Default for RateLog {
    fn default() -> Self {
        RateLog::new(LOG_EVERY)
    }
}

impl RateLog {
    pub fn new(every: Duration) -> RateLog {
        RateLog {
            every,
            seen: Mutex::new(HashMap::new()),
        }
    }

    /// Logs `line()` unless this (port, reason, source) logged within the interval.
    /// Returns whether it logged.
    pub fn log(
        &self,
        port: &'static str,
        reason: &'static str,
        source: Option<IpAddr>,
        line: impl FnOnce() -> String,
    ) -> bool {
        let now = Instant::now();
        let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        if seen.len() > 4096 {
            let every = self.every;
            seen.retain(|_, (t, _)| now.duration_since(*t) < every);
            if seen.len() > 4096 {
                seen.clear();
            }
        }
        let e = seen
            .entry((port, reason, source))
            .or_insert((now - self.every * 2, 0));
        if now.duration_since(e.0) < self.every {
            e.1 += 1;
            return false;
        }
        let more = std::mem::replace(e, (now, 0)).1;
        drop(seen);
        let mut l = line();
        if more > 0 {
            l.push_str(&format!(
                "; {more} more from this source since the last such line"
            ));
        }
        log(&l);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv4Addr;

    #[test]
    fn the_log_is_rate_limited_per_source() {
        let r = RateLog::new(Duration::from_secs(3600));
        let a = Some(IpAddr::V4(Ipv4Addr::LOCALHOST));
        assert!(r.log("http", "cap", a, || "one".into()));
        assert!(!r.log("http", "cap", a, || "two".into()));
        assert!(r.log("peer", "cap", a, || "other port".into()));
        assert!(r.log("http", "timeout", a, || "other reason".into()));
        assert!(r.log("http", "cap", None, || "other source".into()));
    }
}
