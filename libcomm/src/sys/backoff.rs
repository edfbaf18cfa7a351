//! How a thread waits for what another thread, a peer or the GPU will do
//! in microseconds: spin, then yield, then sleep in short steps.
//!
//! By time, not by count: a count of spins or yields lasts from a few
//! microseconds to a hundred depending on the CPU, and a wait that falls
//! into the sleeps pays their granularity (a 50 us sleep is 60-110 us on
//! Linux) on every hand-off. The waits this serves (the cross-host engine's
//! thread between chunks, a call waiting for the engine, the device
//! path's progress thread waiting for the stream's copies) each end within
//! tens to hundreds of microseconds while data moves, so they yield for
//! [`YIELD_FOR`] before sleeping: a thread that yields gives its core to
//! any runnable thread, and one that waits longer (a late peer, a busy
//! stream) sleeps and costs nothing.

use std::time::{Duration, Instant};

/// Spinning (no system call) this long first.
pub const SPIN_FOR: Duration = Duration::from_micros(10);
/// Then yielding the core this long, counted from the first wait.
pub const YIELD_FOR: Duration = Duration::from_micros(300);
/// Then sleeping this long per wait.
pub const SLEEP: Duration = Duration::from_micros(50);

/// One waiter's state: [`snooze`](Backoff::snooze) once per unsuccessful
/// poll, [`reset`](Backoff::reset) after progress.
#[derive(Debug, Default)]
pub struct Backoff {
    since: Option<Instant>,
    polls: u32,
}

/// What one wait step did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    Spun,
    Yielded,
    /// The caller's sleep ran (see [`Backoff::snooze_with`]).
    Slept,
}

impl Backoff {
    pub fn new() -> Backoff {
        Backoff::default()
    }

    /// Progress was made: the next wait starts over with spinning.
    pub fn reset(&mut self) {
        self.since = None;
        self.polls = 0;
    }

    /// Unsuccessful polls since the last reset (for checks every so many).
    pub fn polls(&self) -> u32 {
        self.polls
    }

    /// One wait step, sleeping with `std::thread::sleep`.
    pub fn snooze(&mut self) -> Step {
        self.snooze_with(std::thread::sleep)
    }

    /// One wait step; the sleep phase calls `sleep(SLEEP)` (a thread that
    /// can be woken early parks instead).
    pub fn snooze_with(&mut self, sleep: impl FnOnce(Duration)) -> Step {
        self.polls = self.polls.wrapping_add(1);
        let since = *self.since.get_or_insert_with(Instant::now);
        let waited = since.elapsed();
        if waited < SPIN_FOR {
            std::hint::spin_loop();
            Step::Spun
        } else if waited < YIELD_FOR {
            std::thread::yield_now();
            Step::Yielded
        } else {
            sleep(SLEEP);
            Step::Slept
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The phases never go back (spin, then yield, then sleep) and a wait
    /// long enough ends in sleeps; a reset starts over. (Only the order is
    /// asserted: on a loaded machine a preemption may skip a phase.)
    #[test]
    fn a_wait_spins_then_yields_then_sleeps_and_starts_over_after_progress() {
        let mut b = Backoff::new();
        let until = Instant::now() + Duration::from_secs(10);
        let mut steps = Vec::new();
        loop {
            let s = b.snooze_with(|_| {});
            steps.push(s);
            if s == Step::Slept {
                break;
            }
            assert!(Instant::now() < until, "never slept: {steps:?}");
        }
        let phase = |s: &Step| match s {
            Step::Spun => 0,
            Step::Yielded => 1,
            Step::Slept => 2,
        };
        assert!(
            steps.windows(2).all(|w| phase(&w[0]) <= phase(&w[1])),
            "phases went back: {steps:?}"
        );
        assert!(b.since.unwrap().elapsed() >= YIELD_FOR);
        assert_eq!(b.polls() as usize, steps.len());
        b.reset();
        assert_eq!((b.polls(), b.since), (0, None));
    }
}
