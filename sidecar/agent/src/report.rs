//! The rank's hot path: each operation libcomm reports becomes a slot
//! update (started) and, completed, counts in its slot and at times a ring
//! record in the telemetry segment. Operations libcomm does not time (tight
//! loops: `libcomm::observe`'s sampling) never come here: libcomm counts
//! them itself in words of the communicator's slot ([`Reporter::counter`]
//! lends them). No lock, no allocation and no system call per operation: the
//! communicator's slot is found through a per-thread cache (checked against
//! the slot's own words), names become codes through a per-thread memo.
//! Lifecycle (a communicator opened, failed, aborted, destroyed) takes a
//! mutex: it is rare.

use crate::ring::queue;
use crate::ring::slots::{self, Allocator, SlotRef};
use crate::ring::{CommKey, Record, Segment, codes, record};
use libcomm::observe::{CounterWords, OpEvent, Phase};
use std::cell::Cell;
use std::collections::HashMap;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

/// Recently used slots per thread.
const CACHED: usize = 4;

thread_local! {
    /// (segment id, slot) of the communicators this thread used last.
    static SLOTS: Cell<[(u64, u16, u32); CACHED]> = const { Cell::new([(0, 0, 0); CACHED]) };
    /// Name pointer -> code, for op, dtype and algorithm.
    static CODES: Cell<[(usize, u8); 3]> = const { Cell::new([(0, 0); 3]) };
    /// The last operation started without a slot: (key hash, rank, seq, ns).
    static LAST_START: Cell<(u64, u32, u64, u64)> = const { Cell::new((0, 0, 0, 0)) };
}

pub struct Reporter {
    seg: Arc<Segment>,
    id: u64,
    table: Mutex<Table>,
    /// Records of communicators without a slot: none when the table has room.
    unslotted: AtomicU64,
}

#[derive(Default)]
struct Table {
    alloc: Option<Allocator>,
    live: HashMap<(String, u32), SlotRef>,
}

pub fn nanos(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

/// The code of `name` in `table`, memoized per thread by the name's address
/// (libcomm's names are `&'static str`s: the same address every time).
fn memo(which: usize, name: &'static str, lookup: fn(&str) -> u8) -> u8 {
    CODES.with(|c| {
        let mut m = c.get();
        let addr = name.as_ptr() as usize ^ name.len();
        if m[which].0 == addr {
            return m[which].1;
        }
        let code = lookup(name);
        m[which] = (addr, code);
        c.set(m);
        code
    })
}

impl Reporter {
    pub fn new(seg: Arc<Segment>) -> Reporter {
        let alloc = Allocator::new(&seg);
        Reporter {
            id: seg.segment_id(),
            seg,
            table: Mutex::new(Table {
                alloc: Some(alloc),
                live: HashMap::new(),
            }),
            unslotted: AtomicU64::new(0),
        }
    }

    pub fn segment(&self) -> &Arc<Segment> {
        &self.seg
    }

    fn table(&self) -> std::sync::MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A communicator became ready: its slot (none when the table is full).
    pub fn opened(&self, comm: &str, rank: u32, nranks: u32) -> Option<SlotRef> {
        let mut t = self.table();
        let Table { alloc, live } = &mut *t;
        let s = alloc
            .as_mut()?
            .open(&self.seg, &CommKey::of(comm), rank, nranks)?;
        live.insert((comm.to_string(), rank), s);
        Some(s)
    }

    /// A communicator failed or was aborted (`slots::FAILED`, `slots::ABORTED`).
    pub fn state(&self, comm: &str, rank: u32, state: u32) {
        if let Some(s) = self.table().live.get(&(comm.to_string(), rank)) {
            slots::set_state(&self.seg, *s, state);
        }
    }

    /// A communicator was destroyed: its slot says so before this returns.
    pub fn destroyed(&self, comm: &str, rank: u32) {
        let mut t = self.table();
        let Table { alloc, live } = &mut *t;
        if let (Some(s), Some(a)) = (live.remove(&(comm.to_string(), rank)), alloc.as_mut()) {
            a.destroyed(&self.seg, s);
        }
    }

    /// The slots of the live communicators (to register them again after
    /// a reconnection).
    pub fn live(&self) -> Vec<((String, u32), SlotRef)> {
        self.table()
            .live
            .iter()
            .map(|(k, s)| (k.clone(), *s))
            .collect()
    }

    /// Where communicator `comm` rank `rank` counts its untimed operations:
    /// its slot's untimed words (`None` without a slot: then libcomm times
    /// them all).
    pub fn counter(&self, comm: &str, rank: u32) -> Option<CounterWords> {
        let slot = *self.table().live.get(&(comm.to_string(), rank))?;
        let words = NonNull::from(slots::untimed(&self.seg, slot.index));
        // SAFETY: the words are in the segment's mapping, which the Arc
        // keeps; the slot stays this communicator's until it is destroyed,
        // and libcomm writes no operation after that.
        Some(unsafe { CounterWords::new(self.seg.clone(), words) })
    }

    /// Records of communicators that had no slot (the table was full).
    pub fn unslotted(&self) -> u64 {
        self.unslotted.load(Ordering::Relaxed)
    }

    /// The slot of `key` rank `rank`: from this thread's cache when its
    /// words still say so, else from the table (and cached).
    fn slot(&self, key: &CommKey, comm: &str, rank: u32) -> Option<SlotRef> {
        let cached = SLOTS.with(Cell::get);
        for (id, index, generation) in cached {
            if id == self.id {
                let s = SlotRef { index, generation };
                if slots::holds(&self.seg, s, key, rank) {
                    return Some(s);
                }
            }
        }
        let s = *self.table().live.get(&(comm.to_string(), rank))?;
        SLOTS.with(|c| {
            let mut m = c.get();
            m.rotate_right(1);
            m[0] = (self.id, s.index, s.generation);
            c.set(m);
        });
        Some(s)
    }

    /// Reports one event of an operation.
    pub fn op(&self, ev: &OpEvent<'_>) {
        let key = CommKey::of(ev.comm_id);
        let rank = ev.rank as u32;
        let slot = self.slot(&key, ev.comm_id, rank);
        let at = nanos(ev.time);
        let op = memo(0, ev.op, codes::op_code);
        if ev.phase == Phase::Started {
            match slot {
                Some(s) => slots::started(&self.seg, s, ev.seq, at, op),
                None => LAST_START.with(|l| l.set((hash(&key), rank, ev.seq, at))),
            }
            return;
        }
        // None for an untimed operation that failed: it has no start.
        let started = match slot {
            Some(s) => slots::started_at(&self.seg, s, ev.seq),
            None => {
                self.unslotted.fetch_add(1, Ordering::Relaxed);
                let (h, r, seq, t) = LAST_START.with(Cell::get);
                (h == hash(&key) && r == rank && seq == ev.seq).then_some(t)
            }
        };
        let start = started.unwrap_or(at);
        let error = match &ev.outcome {
            Some(Err(e)) => Some(e.as_str()),
            _ => None,
        };
        let outcome = if error.is_some() {
            codes::ERROR
        } else {
            codes::OK
        };
        if let Some(s) = slot {
            slots::completed(&self.seg, s, ev.seq, op, outcome, error);
        }
        let busy = at.saturating_sub(start);
        // Failures, slow calls, communicators without a slot and, at high
        // rates, a sample: the rest are only counted (below).
        let record = slot.is_none_or(|s| {
            error.is_some()
                || busy >= slots::RECORD_SLOWER_THAN_NS
                || slots::record_due(&self.seg, s, at)
        });
        // Recorded first, counted second: a reader that reads the counters
        // before the ring has every counted operation's record.
        if record {
            queue::push(
                &self.seg,
                &Record {
                    comm: key,
                    rank,
                    nranks: ev.nranks as u32,
                    op,
                    dtype: memo(1, ev.dtype, codes::dtype_code),
                    algo: memo(2, ev.algo, codes::algo_code),
                    group: ev.group,
                    outcome,
                    slot: slot.map_or(record::NO_SLOT, |s| s.index),
                    bytes: ev.bytes,
                    seq: ev.seq,
                    start_ns: start,
                    end_ns: at,
                },
            );
        }
        if let Some(s) = slot {
            // Timed: a start and a duration (the rule `Tally::recorded` applies).
            let timed = started.is_some() && busy > 0;
            slots::count(&self.seg, s, op, ev.bytes, timed.then_some(busy));
        }
    }
}

fn hash(k: &CommKey) -> u64 {
    k.words().iter().fold(0u64, |h, w| {
        h.rotate_left(5) ^ w.wrapping_mul(0x9e37_79b9_7f4a_7c15)
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::ring::layout::Geometry;
    use crate::ring::queue::Drainer;
    use libcomm::observe::OpName;
    use std::time::{Duration, Instant};

    /// An event of a 4-rank 4 KiB all-reduce at `t` ns (failed with `err`).
    pub(crate) fn ev(
        comm: &str,
        rank: usize,
        seq: u64,
        phase: Phase,
        t: u64,
        err: bool,
    ) -> OpEvent<'_> {
        OpEvent {
            job: "j",
            comm_id: comm,
            rank,
            nranks: 4,
            op: "all_reduce",
            dtype: "float",
            bytes: 4096,
            algo: "ring",
            seq,
            group: false,
            phase,
            outcome: (phase == Phase::Completed).then(|| {
                if err {
                    Err("peer 2 went away".to_string())
                } else {
                    Ok(())
                }
            }),
            time: UNIX_EPOCH + Duration::from_nanos(t),
        }
    }

    /// Started and completed become one record with both times; the slot
    /// keeps the progress and the error text; a destroyed communicator's
    /// slot says so at once.
    #[test]
    fn an_operation_becomes_one_record_and_slot_progress() {
        let seg = Arc::new(Segment::create(Geometry::with_records(64)).unwrap());
        let r = Reporter::new(seg.clone());
        let s = r.opened("c", 1, 4).unwrap();
        r.op(&ev("c", 1, 1, Phase::Started, 100, false));
        let v = slots::read(&seg, s.index).unwrap();
        assert_eq!((v.started_seq, v.started_ns, v.completed_seq), (1, 100, 0));
        r.op(&ev("c", 1, 1, Phase::Completed, 350, true));
        let mut d = Drainer::new(seg.clone());
        let mut out = Vec::new();
        d.drain(&mut out, 10, Instant::now());
        assert_eq!(out.len(), 1);
        let rec = out[0];
        assert_eq!((rec.start_ns, rec.end_ns, rec.seq), (100, 350, 1));
        assert_eq!((rec.rank, rec.nranks, rec.bytes), (1, 4, 4096));
        assert_eq!(rec.comm, CommKey::of("c"));
        assert_eq!(
            (
                codes::op_name(rec.op),
                codes::dtype_name(rec.dtype),
                codes::algo_name(rec.algo)
            ),
            ("all_reduce", "float", "ring")
        );
        assert!(!rec.ok());
        assert_eq!(rec.slot, s.index);
        assert_eq!(
            slots::error_text(&seg, s.index, 1).as_deref(),
            Some("peer 2 went away")
        );
        r.destroyed("c", 1);
        let v = slots::read(&seg, s.index).unwrap();
        assert!(v.destroyed_for(s.generation, &CommKey::of("c"), 1));
        assert!(r.live().is_empty());
    }

    /// Untimed operations (libcomm's sampling), which libcomm counts in the
    /// slot's untimed words: counted, their start seen without a time, no record; an
    /// untimed one that fails is a record without a duration, counted but
    /// not timed; a timed one adds its busy time.
    #[test]
    fn untimed_operations_are_counted_in_their_slot() {
        let seg = Arc::new(Segment::create(Geometry::with_records(64)).unwrap());
        let r = Reporter::new(seg.clone());
        let s = r.opened("c", 0, 4).unwrap();
        let c = r.counter("c", 0).unwrap();
        let c = c.words();
        assert!(r.counter("c", 1).is_none());
        let ar = OpName::from(libcomm::OpKind::AllReduce);
        c.started(1, ar);
        let v = slots::read(&seg, s.index).unwrap();
        assert_eq!((v.started_seq, v.started_ns, v.completed_seq), (1, 0, 0));
        assert_eq!(slots::started_at(&seg, s, 1), None);
        c.completed(1, ar, 4096);
        c.started(2, ar);
        r.op(&ev("c", 0, 2, Phase::Completed, 900, true));
        r.op(&ev("c", 0, 3, Phase::Started, 1000, false));
        r.op(&ev("c", 0, 3, Phase::Completed, 1700, false));
        let ar = codes::op_code("all_reduce") as usize;
        let n = slots::counts(&seg, s.index).unwrap()[ar];
        assert_eq!((n.ops, n.bytes, n.busy_ns, n.timed), (3, 3 * 4096, 700, 1));
        let mut out = Vec::new();
        Drainer::new(seg.clone()).drain(&mut out, 10, Instant::now());
        let got: Vec<_> = out
            .iter()
            .map(|r| (r.seq, r.ok(), r.duration_ns()))
            .collect();
        assert_eq!(got, [(2, false, 0), (3, true, 700)]);
    }

    /// A communicator with no slot (a full table) still gets its records,
    /// with its start time from the thread's last start.
    #[test]
    fn without_a_slot_records_still_flow() {
        let seg = Arc::new(
            Segment::create(Geometry {
                records: 64,
                slots: 1,
            })
            .unwrap(),
        );
        let r = Reporter::new(seg.clone());
        assert!(r.opened("a", 0, 4).is_some());
        assert!(r.opened("b", 0, 4).is_none());
        r.op(&ev("b", 0, 9, Phase::Started, 10, false));
        r.op(&ev("b", 0, 9, Phase::Completed, 30, false));
        let mut out = Vec::new();
        Drainer::new(seg).drain(&mut out, 10, Instant::now());
        assert_eq!(
            (out[0].start_ns, out[0].end_ns, out[0].slot),
            (10, 30, record::NO_SLOT)
        );
        assert!(out[0].ok());
        assert_eq!(r.unslotted(), 1);
    }
}
