//! Which operations are timed. Two clock reads per operation cost more than
//! 5% of an 8-byte all-reduce on the machines we measure on (a TSC read
//! is 10-20 ns there, the all-reduce 0.4-0.9 us), so a communicator that
//! runs operations back to back at a high rate times only one in
//! [`SAMPLE_EVERY`] of them; the others are counted (operations, bytes) by
//! the observer's [`OpCounter`](super::OpCounter) without any clock read.
//!
//! The rule, per communicator rank, decided at each timed operation from
//! the window since the previous timed one: when its operations started
//! on average less than [`FAST_MEAN_NS`] apart and the whole window took
//! less than [`SLOW_WINDOW_NS`], the next `SAMPLE_EVERY - 1` operations go
//! untimed; otherwise every operation is timed. So a job that calls a
//! collective every few microseconds or more slowly has every call timed
//! (a span each, as before), and a window that held a slow call (200 us
//! or more: the rank's "slow call" floor) switches back to timing every
//! call. What sampling gives up: a slow call among the untimed ones is seen
//! as its window, not on its own.
//!
//! The state is plain loads and stores, never a read-modify-write: one
//! thread per communicator at a time is NCCL's rule, and where two report
//! at once (a communicator spanning hosts: the caller's enqueue and its
//! progress thread) a lost update only times one call more or fewer.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// While sampling, one operation in this many is timed.
pub const SAMPLE_EVERY: u64 = 32;
/// Sample only operations that start less than this far apart on average
/// (more than 200,000 a second).
pub const FAST_MEAN_NS: u64 = 5_000;
/// A window this long held a slow call (or a pause): time every call.
pub const SLOW_WINDOW_NS: u64 = 200_000;

#[derive(Debug, Default)]
pub(crate) struct Sampler {
    /// Operations still to run untimed before the next timed one.
    untimed_left: AtomicU64,
    /// The last timed operation's start (ns) and sequence number (0: none).
    last_ns: AtomicU64,
    last_seq: AtomicU64,
}

impl Sampler {
    /// Whether the next operation goes untimed (and one fewer after it).
    pub(crate) fn untimed(&self) -> bool {
        let left = self.untimed_left.load(Relaxed);
        if left == 0 {
            return false;
        }
        self.untimed_left.store(left - 1, Relaxed);
        true
    }

    /// Operation `seq` is timed and started at `ns`: how many of the next
    /// ones go untimed.
    pub(crate) fn timed(&self, seq: u64, ns: u64) {
        let (last_seq, last_ns) = (self.last_seq.load(Relaxed), self.last_ns.load(Relaxed));
        let ops = seq.saturating_sub(last_seq);
        let window = ns.saturating_sub(last_ns);
        let fast = last_seq != 0
            && ops > 0
            && ns >= last_ns
            && window < SLOW_WINDOW_NS
            && window / ops < FAST_MEAN_NS;
        self.untimed_left
            .store(if fast { SAMPLE_EVERY - 1 } else { 0 }, Relaxed);
        self.last_seq.store(seq, Relaxed);
        self.last_ns.store(ns, Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `n` operations starting `gap_ns` apart from `seq`/`t`; returns
    /// how many were timed.
    fn run(s: &Sampler, seq: &mut u64, t: &mut u64, n: u64, gap_ns: u64) -> u64 {
        let mut timed = 0;
        for _ in 0..n {
            *seq += 1;
            *t += gap_ns;
            if !s.untimed() {
                s.timed(*seq, *t);
                timed += 1;
            }
        }
        timed
    }

    /// Slow callers are timed every call; a tight loop is sampled one in
    /// SAMPLE_EVERY; a slow call in the loop brings back timing every call
    /// until the rate is high again.
    #[test]
    fn tight_loops_are_sampled_and_slow_windows_time_every_call() {
        let s = Sampler::default();
        let (mut seq, mut t) = (0, 1_000_000);
        assert_eq!(run(&s, &mut seq, &mut t, 1000, 20_000), 1000);
        let timed = run(&s, &mut seq, &mut t, 32_000, 1_000);
        assert!((1000..=1002).contains(&timed), "{timed} of 32000 timed");
        // One call of 300 us: the window holding it is slow, so the next
        // call is timed, and the one after it (1 us later) too.
        t += 300_000;
        let timed_after = run(&s, &mut seq, &mut t, 40, 1_000);
        assert!(timed_after >= 2, "{timed_after}");
        // Back to a high rate: sampled again.
        let timed = run(&s, &mut seq, &mut t, 3200, 1_000);
        assert!(timed <= 102, "{timed}");
        // A clock that went backwards never starts sampling.
        let s = Sampler::default();
        s.timed(1, 5_000_000);
        s.timed(2, 1_000);
        assert!(!s.untimed());
    }
}
