//! The reader's side of the slot counters (`slots::count`): what each
//! communicator rank has completed since the last pass, and how much of it
//! never arrived as a record (at high rates the rank records only a sample,
//! failures and slow calls: `slots::record_due`).
//!
//! A pass reads the counters first and drains the ring after: the rank
//! publishes a record before it counts the operation, so every counted
//! operation's record has been read by the end of the same pass, and "counted
//! minus recorded" never takes an operation for unrecorded that still has a
//! record on the way. Records of operations not yet counted only make the
//! difference smaller for one pass.
//!
//! Nothing read from the segment is trusted: counters that go backwards
//! (garbage, or a slot reused) or forwards faster than any rank can
//! ([`MAX_OPS_PER_SEC`], [`MAX_BYTES_PER_OP`]) start a new baseline
//! instead of a huge delta, so a hostile process cannot blow up the
//! sidecar's metrics.

use super::codes;
use super::record::{CommKey, NO_SLOT, Record};
use super::segment::Segment;
use super::slots::{self, OpCount};
use std::collections::HashMap;
use std::time::Instant;

const OPS: usize = codes::OPS.len();
/// More operations than this per second and slot are garbage (an 8-byte
/// all-reduce on one rank takes about 50 ns).
pub const MAX_OPS_PER_SEC: u64 = 100_000_000;
/// More bytes than this per operation are garbage (1 TiB).
pub const MAX_BYTES_PER_OP: u64 = 1 << 40;

/// Per operation code of one slot: cumulative counts.
#[derive(Debug, Clone, Copy, Default)]
struct OpTally {
    /// What the counters said at the last read.
    counted: OpCount,
    /// What arrived as records.
    recorded: OpCount,
    /// What was already handed out as unrecorded.
    folded: OpCount,
}

#[derive(Debug, Clone)]
struct SlotTally {
    /// `None` while known only from a record (its counters not read yet).
    generation: Option<u32>,
    key: CommKey,
    rank: u32,
    nranks: u32,
    ops: [OpTally; OPS],
}

/// Operations of one communicator rank and op code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tallied {
    pub comm: CommKey,
    pub rank: u32,
    pub nranks: u32,
    pub op: u8,
    pub count: OpCount,
}

/// One segment's counters as a reader has seen them.
#[derive(Debug, Default)]
pub struct Tally {
    slots: HashMap<u16, SlotTally>,
    /// When the counters were last read.
    last_read: Option<Instant>,
}

fn minus(a: OpCount, b: OpCount) -> OpCount {
    OpCount {
        ops: a.ops.saturating_sub(b.ops),
        bytes: a.bytes.saturating_sub(b.bytes),
        busy_ns: a.busy_ns.saturating_sub(b.busy_ns),
        timed: a.timed.saturating_sub(b.timed),
    }
}

fn plus(a: OpCount, b: OpCount) -> OpCount {
    OpCount {
        ops: a.ops.saturating_add(b.ops),
        bytes: a.bytes.saturating_add(b.bytes),
        busy_ns: a.busy_ns.saturating_add(b.busy_ns),
        timed: a.timed.saturating_add(b.timed),
    }
}

impl Tally {
    /// Reads the counters of slots `indexes`; returns what each communicator
    /// rank and op code completed since the last read (for exact metrics).
    pub fn read(&mut self, seg: &Segment, indexes: impl IntoIterator<Item = u16>) -> Vec<Tallied> {
        let mut out = Vec::new();
        let now = Instant::now();
        // What a rank could have done since the last read (a second's worth
        // the first time: a new slot's counters start at 0).
        let secs = self.last_read.map_or(1.0, |t| {
            now.saturating_duration_since(t).as_secs_f64() + 0.01
        });
        self.last_read = Some(now);
        let max_ops = (secs * MAX_OPS_PER_SEC as f64) as u64;
        for index in indexes {
            let (Some(v), Some(counts)) = (slots::read(seg, index), slots::counts(seg, index))
            else {
                continue;
            };
            if v.generation == 0 {
                continue; // never opened
            }
            let fresh = || SlotTally {
                generation: Some(v.generation),
                key: v.key,
                rank: v.rank,
                nranks: v.nranks,
                ops: [OpTally::default(); OPS],
            };
            let t = self.slots.entry(index).or_insert_with(fresh);
            if (t.key, t.rank) != (v.key, v.rank) || t.generation.is_some_and(|g| g != v.generation)
            {
                // Reused for another communicator: its counters began at 0.
                *t = fresh();
            }
            t.generation = Some(v.generation);
            for (op, (c, seen)) in t.ops.iter_mut().zip(counts).enumerate() {
                let delta = minus(seen, c.counted);
                if seen.ops < c.counted.ops
                    || delta.ops > max_ops
                    || delta.bytes / delta.ops.max(1) > MAX_BYTES_PER_OP
                {
                    // Not what a rank does: start again here.
                    *c = OpTally {
                        counted: seen,
                        recorded: seen,
                        folded: OpCount::default(),
                    };
                    continue;
                }
                c.counted = seen;
                if delta.ops > 0 {
                    out.push(Tallied {
                        comm: t.key,
                        rank: t.rank,
                        nranks: t.nranks,
                        op: op as u8,
                        count: delta,
                    });
                }
            }
        }
        out
    }

    /// A record read from the ring (a slot's record, read after the
    /// counters): it will not be handed out as unrecorded. `max_slots`
    /// bounds the slot numbers taken from records (the segment's table).
    pub fn recorded(&mut self, r: &Record, max_slots: u64) {
        if r.slot == NO_SLOT || u64::from(r.slot) >= max_slots {
            return;
        }
        // A slot opened after this pass read the counters: known from its
        // record until the next pass reads them.
        let t = self.slots.entry(r.slot).or_insert_with(|| SlotTally {
            generation: None,
            key: r.comm,
            rank: r.rank,
            nranks: r.nranks,
            ops: [OpTally::default(); OPS],
        });
        if t.key != r.comm || t.rank != r.rank {
            return;
        }
        let o = &mut t.ops[(r.op as usize).min(OPS - 1)];
        o.recorded = plus(
            o.recorded,
            OpCount {
                ops: 1,
                bytes: r.bytes,
                busy_ns: r.duration_ns(),
                // The rank's rule: an untimed operation that failed is a
                // record without a duration, and not timed in the counters.
                timed: u64::from(r.duration_ns() > 0),
            },
        );
    }

    /// Operations counted but never recorded since the last call (to be
    /// folded into aggregates).
    pub fn unrecorded(&mut self) -> Vec<Tallied> {
        let mut out = Vec::new();
        for t in self.slots.values_mut() {
            for (op, o) in t.ops.iter_mut().enumerate() {
                let due = minus(minus(o.counted, o.recorded), o.folded);
                if due.ops == 0 {
                    continue;
                }
                o.folded = plus(o.folded, due);
                out.push(Tallied {
                    comm: t.key,
                    rank: t.rank,
                    nranks: t.nranks,
                    op: op as u8,
                    count: due,
                });
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::Reporter;
    use crate::report::tests::ev;
    use crate::ring::layout::Geometry;
    use crate::ring::queue::Drainer;
    use libcomm::observe::Phase;
    use std::sync::Arc;
    use std::time::Instant;

    /// One operation of communicator "c" rank 0: started at `t0`, lasting `d` ns.
    fn op(r: &Reporter, seq: u64, t0: u64, d: u64, failed: bool) {
        r.op(&ev("c", 0, seq, Phase::Started, t0, false));
        r.op(&ev("c", 0, seq, Phase::Completed, t0 + d, failed));
    }

    /// A reader's pass as the sidecar makes it: counters, then the ring.
    fn pass(t: &mut Tally, d: &mut Drainer, seg: &Segment) -> (Vec<Tallied>, Vec<Record>) {
        let counted = t.read(seg, 0..seg.slots_used());
        let mut recs = Vec::new();
        d.drain(&mut recs, 1 << 20, Instant::now());
        for r in &recs {
            t.recorded(r, seg.geometry().slots);
        }
        (counted, recs)
    }

    /// 100,000 operations 1 us apart (a million a second): the counters
    /// have every one; records are the first second's burst cut to the
    /// rate, plus every failure and every slow call; counted = recorded +
    /// unrecorded, exactly, across passes taken while operations go on.
    #[test]
    fn at_high_rates_every_operation_is_counted_and_a_sample_recorded() {
        let seg = Arc::new(Segment::create(Geometry::with_records(1 << 15)).unwrap());
        let r = Reporter::new(seg.clone());
        r.opened("c", 0, 2).unwrap();
        let (mut t, mut d) = (Tally::default(), Drainer::new(seg.clone()));
        let (mut counted, mut records, mut unrecorded, mut failed, mut slow) = (0, 0, 0, 0, 0);
        let t0 = 1_000_000_000_000;
        for i in 0..100_000u64 {
            let failing = i % 10_007 == 5;
            let dur = if i % 9_973 == 7 { 300_000 } else { 200 };
            op(&r, i + 1, t0 + i * 1_000, dur, failing);
            if i % 4_096 == 0 || i == 99_999 {
                let (c, recs) = pass(&mut t, &mut d, &seg);
                counted += c.iter().map(|x| x.count.ops).sum::<u64>();
                records += recs.len() as u64;
                failed += recs.iter().filter(|x| !x.ok()).count() as u64;
                slow += recs.iter().filter(|x| x.duration_ns() >= 300_000).count() as u64;
                unrecorded += t.unrecorded().iter().map(|x| x.count.ops).sum::<u64>();
            }
        }
        assert_eq!(counted, 100_000, "the counters are exact");
        assert_eq!(records + unrecorded, counted, "each operation once");
        assert_eq!(failed, 10, "every failure is a record");
        assert_eq!(slow, 11, "every slow call is a record");
        // 0.1 s of operations: the full burst of 20,000, then 20,000/s.
        let rate_bound = slots::RECORDS_PER_SEC + slots::RECORDS_PER_SEC / 10 + 21 + 2;
        assert!(
            records <= rate_bound && records >= slots::RECORDS_PER_SEC,
            "{records}"
        );
        assert_eq!(seg.dropped(), 0);
    }

    /// At a low rate every operation is a record, and none is unrecorded.
    #[test]
    fn at_low_rates_every_operation_is_a_record() {
        let seg = Arc::new(Segment::create(Geometry::with_records(1 << 10)).unwrap());
        let r = Reporter::new(seg.clone());
        r.opened("c", 0, 2).unwrap();
        let (mut t, mut d) = (Tally::default(), Drainer::new(seg.clone()));
        for i in 0..500u64 {
            // 1,000 a second for half a second, after a long burst's worth.
            op(&r, i + 1, 5_000_000_000 + i * 1_000_000, 5_000, false);
        }
        let (c, recs) = pass(&mut t, &mut d, &seg);
        assert_eq!(c.iter().map(|x| x.count.ops).sum::<u64>(), 500);
        assert_eq!(recs.len(), 500);
        assert!(t.unrecorded().is_empty());
    }

    /// Garbage counters (going backwards) start a new baseline, never a
    /// huge delta; slot numbers from records are bounded by the table.
    #[test]
    fn counters_that_go_backwards_and_bad_slots_are_contained() {
        let seg = Arc::new(Segment::create(Geometry::with_records(64)).unwrap());
        let r = Reporter::new(seg.clone());
        let s = r.opened("c", 0, 2).unwrap();
        let mut t = Tally::default();
        for _ in 0..5 {
            slots::count(&seg, s, 1, 8, Some(100));
        }
        assert_eq!(t.read(&seg, [s.index])[0].count.ops, 5);
        // Another writer scribbles op 1's count back to 1: a new baseline.
        slots::counter_word(&seg, s, 1).store(1, std::sync::atomic::Ordering::Relaxed);
        assert!(t.read(&seg, [s.index]).is_empty());
        assert!(t.unrecorded().is_empty());
        slots::count(&seg, s, 1, 8, Some(100));
        assert_eq!(t.read(&seg, [s.index])[0].count.ops, 1);
        // Forwards faster than any rank: ignored as well.
        slots::counter_word(&seg, s, 1).store(1 << 50, std::sync::atomic::Ordering::Relaxed);
        assert!(t.read(&seg, [s.index]).is_empty());
        assert!(t.unrecorded().is_empty());
        let mut bad = Record {
            comm: CommKey::of("c"),
            rank: 0,
            nranks: 2,
            op: 1,
            dtype: 0,
            algo: 0,
            group: false,
            outcome: codes::OK,
            slot: u16::MAX - 1,
            bytes: 8,
            seq: 1,
            start_ns: 0,
            end_ns: 10,
        };
        t.recorded(&bad, seg.geometry().slots);
        assert_eq!(t.slots.len(), 1, "a slot beyond the table is ignored");
        bad.slot = s.index;
        bad.comm = CommKey::of("other");
        t.recorded(&bad, seg.geometry().slots);
        assert!(t.read(&seg, [s.index]).is_empty());
        assert!(t.unrecorded().iter().all(|x| x.comm == CommKey::of("c")));
    }
}
