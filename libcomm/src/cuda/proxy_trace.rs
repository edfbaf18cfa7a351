//! `WEFT_DEBUG=TRACE`'s timing of the cross-host path (`proxy.rs`): where
//! the calling thread's time inside one enqueue goes, and a line per job on
//! the progress thread. Nothing is timed otherwise (one load of the level).

use super::logger::log;
use super::pinned_pipe::StreamProgress;
use std::time::{Duration, Instant};

/// With `WEFT_DEBUG=TRACE`, a line per job on the progress thread: how
/// long after it was taken the stream reached it, how long it ran, and a
/// pipelined job's timeline (`pinned_pipe.rs`).
pub(super) fn trace_job(
    describe: &str,
    (seq, progress): (u32, Option<&StreamProgress>),
    taken: Instant,
    reached: Instant,
) {
    if crate::log::level() < crate::log::Level::Trace {
        return;
    }
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    let piped = progress.map_or(String::new(), |p| {
        format!("; from its start: {}", p.trace(reached))
    });
    log(
        false,
        &format!(
            "{describe}: job {}: the stream reached it {:.1} us after it was taken, it ran {:.1} us{piped}",
            seq,
            us(reached - taken),
            us(reached.elapsed())
        ),
    );
}

/// With `WEFT_DEBUG=TRACE`, where the calling thread's time inside one
/// enqueue goes (the bound on it: a 256 MiB all-reduce returns within
/// 100 us): one line per call, microseconds per phase. Otherwise nothing
/// is timed (one load of the level).
pub(super) struct Phases {
    pub(super) at: Option<Instant>,
    pub(super) spent: Vec<(&'static str, Duration)>,
}

impl Phases {
    pub(super) fn start() -> Phases {
        let on = crate::log::level() >= crate::log::Level::Trace;
        let mut p = Phases {
            at: on.then(Instant::now),
            spent: Vec::new(),
        };
        // From the device call's start in the core (`log::mark_call` in
        // `run_device`): the core's and the backend's part before this
        // enqueue.
        if let (Some(now), Some(began)) = (p.at, crate::log::call_began()) {
            p.spent
                .push(("before", now.saturating_duration_since(began)));
        }
        p
    }

    /// The phase `name` ended now.
    pub(super) fn mark(&mut self, name: &'static str) {
        if let Some(at) = self.at {
            let now = Instant::now();
            self.spent.push((name, now - at));
            self.at = Some(now);
        }
    }

    pub(super) fn log(&self, what: impl FnOnce() -> String) {
        if self.at.is_none() {
            return;
        }
        let total: Duration = self.spent.iter().map(|p| p.1).sum();
        let parts: Vec<String> = self
            .spent
            .iter()
            .map(|(n, d)| format!("{n} {:.1}", d.as_secs_f64() * 1e6))
            .collect();
        log(
            false,
            &format!(
                "{}: {:.1} us ({})",
                what(),
                total.as_secs_f64() * 1e6,
                parts.join(", ")
            ),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The enqueue's timing: nothing recorded unless tracing, each mark
    /// the time since the one before, in order.
    #[test]
    fn phases_time_each_mark_only_when_tracing() {
        let mut off = Phases {
            at: None,
            spent: Vec::new(),
        };
        off.mark("stage");
        assert!(off.spent.is_empty());
        let mut on = Phases {
            at: Some(Instant::now()),
            spent: Vec::new(),
        };
        std::thread::sleep(Duration::from_millis(2));
        on.mark("stage");
        on.mark("queue");
        let names: Vec<&str> = on.spent.iter().map(|p| p.0).collect();
        assert_eq!(names, ["stage", "queue"]);
        assert!(on.spent[0].1 >= Duration::from_millis(2));
        assert!(on.spent[1].1 < on.spent[0].1);
    }
}
