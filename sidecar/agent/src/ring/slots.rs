//! The communicator table of a segment: one slot per communicator rank of
//! the process, written by the rank synchronously (the slot says
//! `destroyed` before `destroy` returns), read by the sidecar at any time,
//! also after the process has gone. It is the truth about which
//! communicators a vanished process had destroyed (a clean exit) and the
//! RAS view of what each one has started and completed.
//!
//! ```text
//! word 0      state | generation << 32
//! word 1..=2  communicator key
//! word 3      rank | nranks << 32
//! word 4      last started sequence number
//! word 5      its start, ns since the Unix epoch (0: not timed)
//! word 6      last completed sequence number
//! word 7      started op | completed op << 8 | outcome << 16
//! word 8      sequence number of the last failed operation
//! word 9      length of its error text
//! word 10     record credit, ns (the rank's own: see `record_due`)
//! word 11     when the credit was last topped up, ns since the Unix epoch
//! word 16..   per operation code: operations completed, bytes, busy ns
//!             of the timed ones, how many were timed
//! word 64..   the error text (256 bytes)
//! word 96..   the untimed operations, written by libcomm itself
//!             (`libcomm::observe::UntimedWords`: last started and
//!             completed, per operation name: operations and bytes)
//! ```
//!
//! Words 4-7 and 16.. are the agent's, for timed operations (all of them
//! at low rates); words 96.. are libcomm's, for the others (at high rates
//! libcomm times one in 32 or 256: `libcomm::observe` `sample.rs`). [`read`] and
//! [`counts`] merge the two: the sequence numbers are one series, so the
//! later of the two "last started" is the last started. The counters
//! are exact: every completed operation of the communicator rank adds to
//! one of them, whether or not it also went into the ring as a record. Busy time covers the timed operations only (at high
//! rates libcomm times one in 32 or 256: `libcomm::observe` `sample.rs`), so a
//! mean is busy over timed. At high rates only some operations become records
//! (`record_due`), and the reader learns about the others from the
//! counters alone: one cache line written per operation, in memory the
//! rank owns, instead of a ring entry the reader takes away each time.
//!
//! A slot is reused (with the next generation) only after its communicator
//! was destroyed, and never-used slots go first, so the sidecar has as long
//! as possible to see `destroyed` before a slot changes hands; a slot whose
//! generation moved on was destroyed.

use super::codes;
use super::layout::SLOT_WORDS;
use super::record::{CommKey, KEY_WORDS};
use super::segment::Segment;
use libcomm::observe::{OpName, UntimedWords};
use std::collections::VecDeque;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::{Acquire, Relaxed, Release};

pub const FREE: u32 = 0;
pub const LIVE: u32 = 1;
pub const FAILED: u32 = 2;
pub const ABORTED: u32 = 3;
pub const DESTROYED: u32 = 4;

const W_STATE: usize = 0;
const W_KEY: usize = 1;
const W_RANK: usize = W_KEY + KEY_WORDS;
const W_STARTED: usize = W_RANK + 1;
const W_STARTED_AT: usize = W_STARTED + 1;
const W_COMPLETED: usize = W_STARTED_AT + 1;
const W_OPS: usize = W_COMPLETED + 1;
const W_ERR_SEQ: usize = W_OPS + 1;
const W_ERR_LEN: usize = W_ERR_SEQ + 1;
const W_CREDIT: usize = W_ERR_LEN + 1;
const W_CREDIT_AT: usize = W_CREDIT + 1;
/// On their own cache lines: written at every operation, read by the sidecar
/// once per drain.
const W_COUNTS: usize = 16;
/// Counter words per operation code: completed, bytes, busy ns, timed.
const COUNT_WORDS: usize = 4;
const W_ERR: usize = (W_COUNTS + codes::OPS.len() * COUNT_WORDS).next_multiple_of(8);
/// libcomm's untimed operations (`UntimedWords`), on their own cache lines.
const W_UNTIMED: usize = 96;
/// Bytes of error text a slot keeps.
pub const ERROR_BYTES: usize = (W_UNTIMED - W_ERR) * 8;
const _: () = assert!(W_UNTIMED + UntimedWords::WORDS <= SLOT_WORDS);

/// A slot's place and generation: what a `Register` names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotRef {
    pub index: u16,
    pub generation: u32,
}

fn w(seg: &Segment, slot: u16, word: usize) -> &AtomicU64 {
    &words(seg, slot)[word]
}

/// All of slot `index`'s words, with one bounds check: what the
/// per-operation writers use (a constant index into the array needs none).
fn words(seg: &Segment, index: u16) -> &[AtomicU64; SLOT_WORDS] {
    seg.words(seg.geometry().slot_word(index as usize))
}

/// Slot `index`'s untimed-operation words, which libcomm writes.
pub fn untimed(seg: &Segment, index: u16) -> &UntimedWords {
    let w: &[AtomicU64; UntimedWords::WORDS] =
        seg.words(seg.geometry().slot_word(index as usize) + W_UNTIMED);
    // SAFETY: UntimedWords is repr(C), of UntimedWords::WORDS AtomicU64s
    // (libcomm asserts its size and alignment): the same layout as `w`.
    unsafe { &*(w as *const [AtomicU64; UntimedWords::WORDS]).cast::<UntimedWords>() }
}

/// The rank's side: which slots are free (process-local; the table itself
/// is in the segment).
pub struct Allocator {
    never_used: u16,
    capacity: u16,
    reusable: VecDeque<u16>,
}

impl Allocator {
    pub fn new(seg: &Segment) -> Allocator {
        Allocator {
            never_used: 0,
            capacity: seg.geometry().slots.min(u16::MAX as u64 - 1) as u16,
            reusable: VecDeque::new(),
        }
    }

    /// Takes a slot for communicator `key`, rank `rank` of `nranks` and
    /// publishes it live; `None` when every slot is in use.
    pub fn open(
        &mut self,
        seg: &Segment,
        key: &CommKey,
        rank: u32,
        nranks: u32,
    ) -> Option<SlotRef> {
        let index = if self.never_used < self.capacity {
            self.never_used += 1;
            self.never_used - 1
        } else {
            self.reusable.pop_front()?
        };
        let generation = (w(seg, index, W_STATE).load(Relaxed) >> 32) as u32 + 1;
        for (i, k) in key.words().iter().enumerate() {
            w(seg, index, W_KEY + i).store(*k, Relaxed);
        }
        w(seg, index, W_RANK).store(rank as u64 | (nranks as u64) << 32, Relaxed);
        for word in [
            W_STARTED,
            W_STARTED_AT,
            W_COMPLETED,
            W_OPS,
            W_ERR_SEQ,
            W_ERR_LEN,
            W_CREDIT_AT,
        ]
        .into_iter()
        .chain(W_COUNTS..W_COUNTS + codes::OPS.len() * COUNT_WORDS)
        .chain(W_UNTIMED..W_UNTIMED + UntimedWords::WORDS)
        {
            w(seg, index, word).store(0, Relaxed);
        }
        w(seg, index, W_CREDIT).store(RECORD_BURST_NS, Relaxed);
        seg.word(super::layout::H_SLOTS_USED)
            .fetch_max(index as u64 + 1, Relaxed);
        w(seg, index, W_STATE).store(LIVE as u64 | (generation as u64) << 32, Release);
        Some(SlotRef { index, generation })
    }

    /// The communicator of `s` was destroyed: say so, and let the slot be reused later.
    pub fn destroyed(&mut self, seg: &Segment, s: SlotRef) {
        set_state(seg, s, DESTROYED);
        self.reusable.push_back(s.index);
    }
}

/// Sets the state of slot `s` (kept with its generation).
pub fn set_state(seg: &Segment, s: SlotRef, state: u32) {
    w(seg, s.index, W_STATE).store(state as u64 | (s.generation as u64) << 32, Release);
}

/// An operation started (one writer per communicator rank).
pub fn started(seg: &Segment, s: SlotRef, seq: u64, at_ns: u64, op: u8) {
    let sw = words(seg, s.index);
    sw[W_STARTED_AT].store(at_ns, Relaxed);
    // The same operation as last time (a training loop): nothing to write.
    let ops = sw[W_OPS].load(Relaxed);
    if ops & 0xff != op as u64 {
        sw[W_OPS].store((ops & !0xff) | op as u64, Relaxed);
    }
    sw[W_STARTED].store(seq, Release);
}

/// The start time of operation `seq`, if it is the last one started here
/// and was timed.
pub fn started_at(seg: &Segment, s: SlotRef, seq: u64) -> Option<u64> {
    (w(seg, s.index, W_STARTED).load(Acquire) == seq)
        .then(|| w(seg, s.index, W_STARTED_AT).load(Relaxed))
        .filter(|t| *t != 0)
}

/// Operation `seq` completed with `outcome`; a failure's text is kept
/// (cut to [`ERROR_BYTES`]) before the completion is published.
pub fn completed(seg: &Segment, s: SlotRef, seq: u64, op: u8, outcome: u16, error: Option<&str>) {
    let sw = words(seg, s.index);
    if let Some(text) = error {
        let b = text.as_bytes();
        let n = b.len().min(ERROR_BYTES);
        for (word, c) in sw[W_ERR..].iter().zip(b[..n].chunks(8)) {
            let mut bytes = [0u8; 8];
            bytes[..c.len()].copy_from_slice(c);
            word.store(u64::from_le_bytes(bytes), Relaxed);
        }
        sw[W_ERR_LEN].store(n as u64, Relaxed);
        sw[W_ERR_SEQ].store(seq, Release);
    }
    let ops = sw[W_OPS].load(Relaxed);
    let now = (ops & 0xff) | (op as u64) << 8 | (outcome as u64) << 16;
    if now != ops {
        sw[W_OPS].store(now, Relaxed);
    }
    sw[W_COMPLETED].store(seq, Release);
}

/// Records a communicator rank sends through the ring per second at most,
/// beside failures and calls slower than [`RECORD_SLOWER_THAN_NS`]: far
/// above what becomes a span (`WEFT_SPANS_PER_SEC`, 1,000 by default) and
/// enough for the sidecar's recent medians, yet 2% of 1.2 million 8-byte
/// all-reduces a second, so the ring's cost (a cache line the sidecar takes
/// away per record) is off the small collectives' path.
pub const RECORDS_PER_SEC: u64 = 20_000;
const RECORD_COST_NS: u64 = 1_000_000_000 / RECORDS_PER_SEC;
/// One second of records: a job's first 20,000 operations are all records
/// (and so spans, within the sidecar's own burst of 10 s x 1,000).
const RECORD_BURST_NS: u64 = RECORDS_PER_SEC * RECORD_COST_NS;
/// A call at least this long is always a record (the export policy's floor
/// for a slow call: only such calls can be slow).
pub const RECORD_SLOWER_THAN_NS: u64 = 200_000;

/// Whether the operation that completed at `now_ns` in slot `s` becomes a
/// ring record: a token bucket of [`RECORDS_PER_SEC`] in the slot's own
/// words (one writer: the communicator rank's thread of the moment).
pub fn record_due(seg: &Segment, s: SlotRef, now_ns: u64) -> bool {
    let credit = w(seg, s.index, W_CREDIT);
    let at = w(seg, s.index, W_CREDIT_AT);
    let mut c = credit.load(Relaxed);
    let last = at.load(Relaxed);
    if now_ns > last {
        c = c.saturating_add(now_ns - last).min(RECORD_BURST_NS);
        at.store(now_ns, Relaxed);
    }
    let due = c >= RECORD_COST_NS;
    credit.store(if due { c - RECORD_COST_NS } else { c }, Relaxed);
    due
}

/// Adds one completed operation of code `op` to slot `s`'s counters:
/// `busy_ns` when it was timed.
pub fn count(seg: &Segment, s: SlotRef, op: u8, bytes: u64, busy_ns: Option<u64>) {
    let base = W_COUNTS + (op as usize).min(codes::OPS.len() - 1) * COUNT_WORDS;
    let c: &[AtomicU64; COUNT_WORDS] = words(seg, s.index)[base..base + COUNT_WORDS]
        .try_into()
        .expect("COUNT_WORDS words");
    let add = |word: &AtomicU64, n: u64| word.store(word.load(Relaxed).wrapping_add(n), Relaxed);
    add(&c[0], 1);
    add(&c[1], bytes);
    if let Some(ns) = busy_ns {
        add(&c[2], ns);
        add(&c[3], 1);
    }
}

/// The operation counter of code `op` in slot `s` (for tests that write
/// garbage into it).
#[cfg(test)]
pub(crate) fn counter_word(seg: &Segment, s: SlotRef, op: u8) -> &std::sync::atomic::AtomicU64 {
    w(seg, s.index, W_COUNTS + op as usize * COUNT_WORDS)
}

/// One operation code's counters in a slot (they only grow, and wrap).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OpCount {
    pub ops: u64,
    pub bytes: u64,
    /// Of the timed operations.
    pub busy_ns: u64,
    pub timed: u64,
}

/// The counters of slot `index`, by operation code (`None` beyond the table).
pub fn counts(seg: &Segment, index: u16) -> Option<[OpCount; codes::OPS.len()]> {
    if index as u64 >= seg.geometry().slots {
        return None;
    }
    let mut out = [OpCount::default(); codes::OPS.len()];
    for (op, c) in out.iter_mut().enumerate() {
        let base = W_COUNTS + op * COUNT_WORDS;
        *c = OpCount {
            ops: w(seg, index, base).load(Relaxed),
            bytes: w(seg, index, base + 1).load(Relaxed),
            busy_ns: w(seg, index, base + 2).load(Relaxed),
            timed: w(seg, index, base + 3).load(Relaxed),
        };
    }
    // libcomm's untimed operations: counted, never timed.
    let u = untimed(seg, index);
    for name in 0..OpName::COUNT {
        let c = &mut out[codes::op_code_at(name) as usize];
        c.ops = c.ops.wrapping_add(u.counts[name][0].load(Relaxed));
        c.bytes = c.bytes.wrapping_add(u.counts[name][1].load(Relaxed));
    }
    Some(out)
}

/// Whether slot `s` is still communicator `key`'s rank `rank` (not
/// destroyed, not reused): the rank's check of its per-thread cache.
pub fn holds(seg: &Segment, s: SlotRef, key: &CommKey, rank: u32) -> bool {
    if s.index as u64 >= seg.geometry().slots {
        return false;
    }
    let st = w(seg, s.index, W_STATE).load(Acquire);
    let k = key.words();
    (st >> 32) as u32 == s.generation
        && matches!(st as u32, LIVE | FAILED | ABORTED)
        && w(seg, s.index, W_RANK).load(Relaxed) as u32 == rank
        && (0..KEY_WORDS).all(|i| w(seg, s.index, W_KEY + i).load(Relaxed) == k[i])
}

/// A slot as the sidecar reads it (any bit pattern is a valid view).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotView {
    pub state: u32,
    pub generation: u32,
    pub key: CommKey,
    pub rank: u32,
    pub nranks: u32,
    pub started_seq: u64,
    pub started_ns: u64,
    pub started_op: u8,
    pub completed_seq: u64,
    pub completed_op: u8,
    pub outcome: u16,
}

impl SlotView {
    /// Whether the communicator `key` rank `rank` that registered this slot
    /// with generation `generation` is destroyed: the slot says so, or it
    /// has changed hands (only a destroyed communicator's slot is reused).
    pub fn destroyed_for(&self, generation: u32, key: &CommKey, rank: u32) -> bool {
        self.generation != generation
            || self.key != *key
            || self.rank != rank
            || matches!(self.state, FREE | DESTROYED)
    }
}

/// Reads slot `index` (`None` beyond the table). A view torn by a
/// concurrent writer is read again, a few times at most.
pub fn read(seg: &Segment, index: u16) -> Option<SlotView> {
    if index as u64 >= seg.geometry().slots {
        return None;
    }
    let mut view = None;
    for _ in 0..4 {
        let s0 = w(seg, index, W_STATE).load(Acquire);
        let mut key = [0u64; KEY_WORDS];
        for (i, k) in key.iter_mut().enumerate() {
            *k = w(seg, index, W_KEY + i).load(Relaxed);
        }
        let rank = w(seg, index, W_RANK).load(Relaxed);
        let completed_seq = w(seg, index, W_COMPLETED).load(Acquire);
        let started_seq = w(seg, index, W_STARTED).load(Acquire);
        let started_ns = w(seg, index, W_STARTED_AT).load(Relaxed);
        let ops = w(seg, index, W_OPS).load(Relaxed);
        let mut v = SlotView {
            state: s0 as u32,
            generation: (s0 >> 32) as u32,
            key: CommKey::from_words(&key),
            rank: rank as u32,
            nranks: (rank >> 32) as u32,
            started_seq,
            started_ns,
            started_op: ops as u8,
            completed_seq,
            completed_op: (ops >> 8) as u8,
            outcome: (ops >> 16) as u16,
        };
        merge_untimed(&mut v, untimed(seg, index));
        view = Some(v);
        if w(seg, index, W_STATE).load(Acquire) == s0 {
            break;
        }
    }
    view
}

/// The later of libcomm's untimed operations and the timed ones is the
/// last (one series of sequence numbers): an untimed start's time is
/// unknown (0), an untimed completion succeeded.
fn merge_untimed(v: &mut SlotView, u: &UntimedWords) {
    let code = |w: &AtomicU64| {
        OpName::from_index(w.load(Relaxed)).map_or(0, |n| codes::op_code_at(n.index()))
    };
    let completed = u.completed.load(Acquire);
    if completed > v.completed_seq {
        v.completed_seq = completed;
        v.completed_op = code(&u.completed_op);
        v.outcome = codes::OK;
    }
    let started = u.started.load(Acquire);
    if started > v.started_seq {
        v.started_seq = started;
        v.started_ns = 0;
        v.started_op = code(&u.started_op);
    }
}

/// The error text of operation `seq` in slot `index`, if that is the last
/// failure the slot holds.
pub fn error_text(seg: &Segment, index: u16, seq: u64) -> Option<String> {
    if index as u64 >= seg.geometry().slots || w(seg, index, W_ERR_SEQ).load(Acquire) != seq {
        return None;
    }
    let n = (w(seg, index, W_ERR_LEN).load(Relaxed) as usize).min(ERROR_BYTES);
    let mut b = Vec::with_capacity(n);
    for i in 0..n.div_ceil(8) {
        b.extend_from_slice(&w(seg, index, W_ERR + i).load(Relaxed).to_le_bytes());
    }
    b.truncate(n);
    Some(String::from_utf8_lossy(&b).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ring::layout::Geometry;

    #[test]
    fn a_slot_tells_live_from_destroyed_and_keeps_progress() {
        let seg = Segment::create(Geometry::with_records(64)).unwrap();
        let mut a = Allocator::new(&seg);
        let key = CommKey::of("c1");
        let s = a.open(&seg, &key, 2, 4).unwrap();
        started(&seg, s, 7, 1000, 1);
        assert_eq!(started_at(&seg, s, 7), Some(1000));
        assert_eq!(started_at(&seg, s, 6), None);
        completed(&seg, s, 7, 1, 1, Some("peer 3 is gone"));
        let v = read(&seg, s.index).unwrap();
        assert_eq!((v.state, v.rank, v.nranks, v.key), (LIVE, 2, 4, key));
        assert_eq!(
            (
                v.started_seq,
                v.started_ns,
                v.started_op,
                v.completed_seq,
                v.outcome
            ),
            (7, 1000, 1, 7, 1)
        );
        assert_eq!(
            error_text(&seg, s.index, 7).as_deref(),
            Some("peer 3 is gone")
        );
        assert_eq!(error_text(&seg, s.index, 8), None);
        assert!(!v.destroyed_for(s.generation, &key, 2));
        a.destroyed(&seg, s);
        assert!(
            read(&seg, s.index)
                .unwrap()
                .destroyed_for(s.generation, &key, 2)
        );
        assert!(read(&seg, 60000).is_none());
    }

    /// Never-used slots go first; a destroyed one is reused with the next
    /// generation, so the old registration reads as destroyed.
    #[test]
    fn slots_are_reused_only_when_the_table_is_full() {
        let seg = Segment::create(Geometry {
            records: 64,
            slots: 2,
        })
        .unwrap();
        let mut a = Allocator::new(&seg);
        let (k1, k2, k3) = (CommKey::of("a"), CommKey::of("b"), CommKey::of("a"));
        let s1 = a.open(&seg, &k1, 0, 2).unwrap();
        a.destroyed(&seg, s1);
        let s2 = a.open(&seg, &k2, 0, 2).unwrap();
        assert_ne!(s2.index, s1.index, "a never-used slot first");
        let s3 = a.open(&seg, &k3, 0, 2).unwrap();
        assert_eq!((s3.index, s3.generation), (s1.index, s1.generation + 1));
        assert!(a.open(&seg, &k3, 1, 2).is_none(), "full");
        let v = read(&seg, s1.index).unwrap();
        assert!(
            v.destroyed_for(s1.generation, &k1, 0),
            "same label, new generation"
        );
        assert!(!v.destroyed_for(s3.generation, &k3, 0));
    }

    /// libcomm's untimed words and the agent's timed ones read as one
    /// slot: the later start or completion is the last, an untimed start
    /// has no time, the counters add up; a reopened slot starts from zero.
    #[test]
    fn untimed_words_merge_with_the_timed_ones() {
        let seg = Segment::create(Geometry::with_records(64)).unwrap();
        let mut a = Allocator::new(&seg);
        let key = CommKey::of("c1");
        let s = a.open(&seg, &key, 0, 2).unwrap();
        let u = untimed(&seg, s.index);
        let (ar, ag) = (
            OpName::from(libcomm::OpKind::AllReduce),
            OpName::from(libcomm::OpKind::AllGather),
        );
        started(&seg, s, 1, 5000, codes::op_code("all_reduce"));
        completed(&seg, s, 1, codes::op_code("all_reduce"), codes::OK, None);
        count(&seg, s, codes::op_code("all_reduce"), 8, Some(300));
        for seq in 2..=5 {
            u.started(seq, ar);
            u.completed(seq, ar, 8);
        }
        u.started(6, ag);
        let v = read(&seg, s.index).unwrap();
        assert_eq!(
            (v.started_seq, v.started_ns, v.started_op, v.completed_seq),
            (6, 0, codes::op_code("all_gather"), 5)
        );
        assert_eq!(
            (v.completed_op, v.outcome),
            (codes::op_code("all_reduce"), codes::OK)
        );
        let n = counts(&seg, s.index).unwrap()[codes::op_code("all_reduce") as usize];
        assert_eq!((n.ops, n.bytes, n.busy_ns, n.timed), (5, 40, 300, 1));
        // A timed failure after them is the last completion.
        started(&seg, s, 7, 9000, codes::op_code("all_reduce"));
        completed(&seg, s, 7, codes::op_code("all_reduce"), 3, Some("x"));
        let v = read(&seg, s.index).unwrap();
        assert_eq!(
            (v.started_seq, v.started_ns, v.completed_seq, v.outcome),
            (7, 9000, 7, 3)
        );
        // Garbage in the untimed words is a view, not a crash.
        u.started_op.store(u64::MAX, Relaxed);
        u.started.store(u64::MAX, Relaxed);
        assert_eq!(read(&seg, s.index).unwrap().started_op, 0);
        a.destroyed(&seg, s);
        let mut b = Allocator::new(&seg);
        let again = b.open(&seg, &key, 0, 2).unwrap();
        assert_eq!(again.index, s.index);
        let v = read(&seg, again.index).unwrap();
        assert_eq!((v.started_seq, v.completed_seq), (0, 0));
        assert!(
            counts(&seg, again.index)
                .unwrap()
                .iter()
                .all(|c| c.ops == 0)
        );
    }

    #[test]
    fn long_error_texts_are_cut() {
        let seg = Segment::create(Geometry::with_records(64)).unwrap();
        let mut a = Allocator::new(&seg);
        let s = a.open(&seg, &CommKey::of("c"), 0, 1).unwrap();
        completed(&seg, s, 1, 1, 1, Some(&"x".repeat(1000)));
        assert_eq!(error_text(&seg, s.index, 1).unwrap().len(), ERROR_BYTES);
    }
}
