//! Which operations are timed. A timed operation costs two clock reads, its
//! events and a ring record now and then: 80 ns on the development VM,
//! 250-300 ns on the GPU machines we measure on, where an 8-byte host
//! all-reduce takes 0.8-0.9 us and a one-GPU device all-reduce 4.5-5.5 us.
//! So a communicator rank that runs operations back to back times only one
//! in [`SAMPLE_EVERY`] of them; the others it counts itself in the
//! observer's untimed words (`untimed.rs`) with no clock read and no call.
//!
//! The rule, per communicator rank, decided at each timed operation from
//! the window since the previous timed one: when its operations started on
//! average less than [`FAST_MEAN_NS`] apart (more than 40,000 a second:
//! timing each would cost about 1% or more of the time between them) and
//! the window held no slow call, the next `SAMPLE_EVERY - 1` operations go
//! untimed (`SAMPLE_EVERY_VERY_FAST - 1` above 500,000 a second);
//! otherwise every operation is timed. A window holds a slow call
//! when it took [`SLOW_EXCESS_NS`] (the rank's "slow call" floor, 200 us)
//! more than its operations would have at the previous window's pace: a
//! slow call switches back to timing every call, so a job that calls a
//! collective every 25 us or more slowly has every call timed (a span
//! each), and a slow call after a tight loop is seen on its own soon
//! after. What sampling gives up: a slow call among the untimed ones is
//! seen as its window, not on its own.
//!
//! While sampling, the timed operations are those whose sequence number
//! is a multiple of the period ([`SAMPLE_EVERY`] or
//! [`SAMPLE_EVERY_VERY_FAST`]): every rank of a communicator numbers
//! its collectives alike, so the ranks time the same collective. With
//! each rank timing a different one, a collective of n ranks could wait
//! for n timed calls (each rank's delays its peers) instead of one.
//!
//! The state is plain loads and stores, never a read-modify-write: one
//! thread per communicator at a time is NCCL's rule, and where two report
//! at once (a communicator spanning hosts: the caller's enqueue and its
//! progress thread) a lost update only times one call more or fewer.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// While sampling, one operation in this many is timed.
pub const SAMPLE_EVERY: u64 = 32;
/// Above 500,000 operations a second (a mean under [`VERY_FAST_MEAN_NS`]),
/// one in this many: a timed call costs 250-300 ns on the GPU machine, so
/// one in 32 is still 1% of a 0.85 us 4-rank host all-reduce, and the
/// spans of a loop that fast are as telling at one in 256 (4,000 a second
/// and more). A multiple of [`SAMPLE_EVERY`], so ranks in either mode
/// still time common collectives.
pub const SAMPLE_EVERY_VERY_FAST: u64 = 256;
/// See [`SAMPLE_EVERY_VERY_FAST`].
pub const VERY_FAST_MEAN_NS: u64 = 2_000;
/// Sample only operations that start less than this far apart on average
/// (more than 40,000 a second).
pub const FAST_MEAN_NS: u64 = 25_000;
/// A window this much longer than its operations took at the previous
/// window's pace held a slow call (or a pause): time every call.
pub const SLOW_EXCESS_NS: u64 = 200_000;

#[derive(Debug, Default)]
pub(crate) struct Sampler {
    /// Operations still to run untimed before the next timed one.
    untimed_left: AtomicU64,
    /// The last timed operation's start (ns) and sequence number (0: none).
    last_ns: AtomicU64,
    last_seq: AtomicU64,
    /// The previous window's mean time between starts, ns (0: none).
    pace_ns: AtomicU64,
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
        let ordered = last_seq != 0 && ops > 0 && ns >= last_ns;
        let window = ns.saturating_sub(last_ns);
        let pace = self.pace_ns.load(Relaxed);
        let slow = window.saturating_sub(ops.saturating_mul(pace)) >= SLOW_EXCESS_NS;
        let mean = if ordered { window / ops } else { 0 };
        let fast = ordered && pace > 0 && !slow && mean < FAST_MEAN_NS;
        // Untimed up to the next multiple of the period (the same
        // collective on every rank).
        let every = if mean < VERY_FAST_MEAN_NS {
            SAMPLE_EVERY_VERY_FAST
        } else {
            SAMPLE_EVERY
        };
        let left = every - 1 - seq % every;
        self.untimed_left
            .store(if fast { left } else { 0 }, Relaxed);
        self.pace_ns.store(mean, Relaxed);
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
        assert_eq!(run(&s, &mut seq, &mut t, 1000, 30_000), 1000);
        // A device collective every 5-10 us (100,000-200,000 a second) is a
        // tight loop too.
        let timed = run(&s, &mut seq, &mut t, 3200, 8_000);
        assert!((100..=102).contains(&timed), "{timed} of 3200 timed");
        let timed = run(&s, &mut seq, &mut t, 32_000, 3_000);
        assert!((1000..=1002).contains(&timed), "{timed} of 32000 timed");
        // Above 500,000 a second, one in 256.
        let timed = run(&s, &mut seq, &mut t, 25_600, 1_000);
        assert!((100..=108).contains(&timed), "{timed} of 25600 timed");
        // One call of 300 us: the window holding it (ended by the next
        // timed call, at most 256 calls later) is slow (its excess over the
        // 1 us pace), so the call after that one is timed too.
        t += 300_000;
        let timed_after = run(&s, &mut seq, &mut t, 300, 1_000);
        assert!(timed_after >= 2, "{timed_after}");
        // Back to a high rate: sampled again.
        let timed = run(&s, &mut seq, &mut t, 3200, 1_000);
        assert!(timed <= 102, "{timed}");
        // Once sampling, the timed operations are the multiples of
        // SAMPLE_EVERY, whichever operation the sampling started at: ranks
        // that started sampling at different calls time the same ones.
        for start in [7, 64, 100] {
            let s = Sampler::default();
            let (mut seq, mut t) = (start, 1_000_000);
            let mut timed = Vec::new();
            for _ in 0..200 {
                seq += 1;
                t += 3_000;
                if !s.untimed() {
                    s.timed(seq, t);
                    timed.push(seq);
                }
            }
            let aligned: Vec<u64> = timed.iter().copied().skip(3).collect();
            assert!(
                aligned.iter().all(|q| q % SAMPLE_EVERY == 0),
                "from {start}: timed {timed:?}"
            );
            assert!(aligned.len() >= 4, "from {start}: timed {timed:?}");
        }
        // A clock that went backwards never starts sampling.
        let s = Sampler::default();
        s.timed(1, 5_000_000);
        s.timed(2, 1_000);
        assert!(!s.untimed());
    }
}
