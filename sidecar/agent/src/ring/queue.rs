//! The ring as a bounded multi-producer, single-consumer queue (Vyukov):
//! entry `i` of ticket `t` is free for that ticket when its sequence word is
//! `t`, published when it is `t + 1`, and given back for ticket `t +
//! capacity` by the consumer. Producers (any thread of the rank) take
//! tickets with a compare-and-swap on the tail: no lock, no system call,
//! and a full ring drops the record and counts it instead of waiting.
//!
//! The consumer trusts nothing it reads: every loop is bounded by the
//! number of records asked for, and an entry claimed but never published (a
//! producer killed mid-write, or garbage) is skipped after [`STALL`] and
//! counted, so one bad entry cannot stop the ring.

use super::layout;
use super::record::{Record, WORDS};
use super::segment::Segment;
use std::sync::Arc;
use std::sync::atomic::Ordering::{Acquire, Relaxed, Release};
use std::time::{Duration, Instant};

/// Attempts a producer makes before it counts its record dropped: bounds a
/// loop over words another process can write.
const MAX_TRIES: usize = 64;
/// An entry claimed but unpublished this long is given up (its record lost).
pub const STALL: Duration = Duration::from_millis(500);

/// Publishes `r`, or drops it and counts the drop when the ring is full.
/// Never waits; returns whether it was published.
pub fn push(seg: &Segment, r: &Record) -> bool {
    let g = seg.geometry();
    let mask = g.records - 1;
    let tail = seg.word(layout::H_TAIL);
    let mut pos = tail.load(Relaxed);
    for _ in 0..MAX_TRIES {
        let base = g.record_word((pos & mask) as usize);
        let seq = seg.word(base).load(Acquire);
        let ahead = seq.wrapping_sub(pos) as i64;
        if ahead == 0 {
            match tail.compare_exchange_weak(pos, pos.wrapping_add(1), Relaxed, Relaxed) {
                Ok(_) => {
                    for (i, w) in r.encode().iter().enumerate() {
                        seg.word(base + 1 + i).store(*w, Relaxed);
                    }
                    seg.word(base).store(pos.wrapping_add(1), Release);
                    return true;
                }
                Err(now) => pos = now,
            }
        } else if ahead < 0 {
            break; // the entry still holds a record of the previous round: full
        } else {
            pos = tail.load(Relaxed); // another producer took this ticket
        }
    }
    seg.word(layout::H_DROPPED).fetch_add(1, Relaxed);
    false
}

/// The consumer's side of one segment.
pub struct Drainer {
    seg: Arc<Segment>,
    head: u64,
    /// The entry at `head` when it was first seen claimed but unpublished.
    stalled: Option<(u64, Instant)>,
    skipped: u64,
}

impl Drainer {
    /// Goes on where the last consumer of `seg` stopped (its head in the
    /// header), or at the producers' tail when that position makes no sense.
    pub fn new(seg: Arc<Segment>) -> Drainer {
        let head = seg.word(layout::H_HEAD).load(Acquire);
        let tail = seg.produced();
        let head = if tail.wrapping_sub(head) > seg.geometry().records {
            tail
        } else {
            head
        };
        Drainer {
            seg,
            head,
            stalled: None,
            skipped: 0,
        }
    }

    pub fn segment(&self) -> &Arc<Segment> {
        &self.seg
    }

    /// Entries given up because they were never published.
    pub fn skipped(&self) -> u64 {
        self.skipped
    }

    /// Appends up to `max` published records to `out` (in ticket order);
    /// returns how many. At most `max` entries are looked at.
    pub fn drain(&mut self, out: &mut Vec<Record>, max: usize, now: Instant) -> usize {
        let g = self.seg.geometry();
        let mask = g.records - 1;
        let mut n = 0;
        for _ in 0..max {
            let pos = self.head;
            let base = g.record_word((pos & mask) as usize);
            let seq = self.seg.word(base).load(Acquire);
            if seq == pos.wrapping_add(1) {
                let mut w = [0u64; WORDS];
                for (i, x) in w.iter_mut().enumerate() {
                    *x = self.seg.word(base + 1 + i).load(Relaxed);
                }
                out.push(Record::decode(&w));
                self.seg
                    .word(base)
                    .store(pos.wrapping_add(g.records), Release);
                self.head = pos.wrapping_add(1);
                self.stalled = None;
                n += 1;
                continue;
            }
            if self.seg.produced() == pos {
                break; // nothing claimed beyond what we read
            }
            // Claimed (or garbage) but not published.
            match self.stalled {
                Some((p, since)) if p == pos => {
                    if now.saturating_duration_since(since) < STALL {
                        break;
                    }
                    self.seg
                        .word(base)
                        .store(pos.wrapping_add(g.records), Release);
                    self.head = pos.wrapping_add(1);
                    self.stalled = None;
                    self.skipped += 1;
                }
                _ => {
                    self.stalled = Some((pos, now));
                    break;
                }
            }
        }
        self.seg.word(layout::H_HEAD).store(self.head, Release);
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ring::layout::Geometry;
    use crate::ring::record::CommKey;

    fn rec(seq: u64) -> Record {
        Record {
            comm: CommKey::of("c"),
            rank: 1,
            nranks: 2,
            op: 1,
            dtype: 2,
            algo: 3,
            group: false,
            outcome: 0,
            slot: 0,
            bytes: 8,
            seq,
            start_ns: seq,
            end_ns: seq + 1,
        }
    }

    fn seg(records: u64) -> Arc<Segment> {
        Arc::new(Segment::create(Geometry::with_records(records)).unwrap())
    }

    #[test]
    fn records_come_out_in_order_and_a_full_ring_drops_and_counts() {
        let s = seg(64);
        let mut d = Drainer::new(s.clone());
        for i in 0..70 {
            assert_eq!(push(&s, &rec(i)), i < 64, "record {i}");
        }
        assert_eq!((s.produced(), s.dropped()), (64, 6));
        let mut out = Vec::new();
        assert_eq!(d.drain(&mut out, 10, Instant::now()), 10);
        assert_eq!(d.drain(&mut out, 1000, Instant::now()), 54);
        assert_eq!(
            out.iter().map(|r| r.seq).collect::<Vec<_>>(),
            (0..64).collect::<Vec<_>>()
        );
        // The entries are free again: the ring goes round.
        for i in 0..100 {
            assert!(push(&s, &rec(i)));
            out.clear();
            assert_eq!(d.drain(&mut out, 8, Instant::now()), 1);
            assert_eq!(out[0], rec(i));
        }
    }

    /// Several threads publish at once: every record arrives exactly once
    /// or is counted as dropped.
    #[test]
    fn concurrent_producers_lose_nothing_uncounted() {
        let s = seg(256);
        let mut d = Drainer::new(s.clone());
        let threads: Vec<_> = (0..4u64)
            .map(|t| {
                let s = s.clone();
                std::thread::spawn(move || {
                    for i in 0..20_000u64 {
                        let mut r = rec(i);
                        r.rank = t as u32;
                        push(&s, &r);
                    }
                })
            })
            .collect();
        let mut got = vec![Vec::new(); 4];
        let mut out = Vec::new();
        let mut finished = false;
        while !finished {
            finished = threads.iter().all(|t| t.is_finished());
            out.clear();
            d.drain(&mut out, 1 << 20, Instant::now());
            for r in &out {
                got[r.rank as usize].push(r.seq);
            }
        }
        let total: usize = got.iter().map(Vec::len).sum();
        assert_eq!(total as u64 + s.dropped(), 80_000);
        assert_eq!(s.produced(), total as u64);
        for g in &got {
            assert!(g.windows(2).all(|w| w[0] < w[1]), "per thread in order");
        }
    }

    /// An entry claimed and never published (a producer killed mid-write)
    /// stops the consumer for STALL at most, then is skipped.
    #[test]
    fn an_unpublished_entry_is_skipped_after_the_stall() {
        let s = seg(64);
        let mut d = Drainer::new(s.clone());
        // Claim ticket 0 without publishing it, then publish ticket 1.
        s.word(layout::H_TAIL).store(1, Relaxed);
        assert!(push(&s, &rec(1)));
        let t0 = Instant::now();
        let mut out = Vec::new();
        assert_eq!(d.drain(&mut out, 100, t0), 0);
        assert_eq!(d.drain(&mut out, 100, t0 + STALL / 2), 0);
        assert_eq!(d.drain(&mut out, 100, t0 + STALL), 1);
        assert_eq!((out[0].seq, d.skipped()), (1, 1));
    }

    /// Garbage in every word: the consumer's loop stays bounded and
    /// nothing panics.
    #[test]
    fn garbage_words_keep_the_consumer_bounded() {
        let s = seg(64);
        let g = s.geometry();
        for i in 0..g.words() {
            if i != layout::H_MAGIC {
                s.word(i)
                    .store(0x9e37_79b9_7f4a_7c15u64.wrapping_mul(i as u64 + 1), Relaxed);
            }
        }
        let mut d = Drainer::new(s.clone());
        let mut out = Vec::new();
        let t0 = Instant::now();
        for k in 0..20u32 {
            d.drain(&mut out, 1000, t0 + STALL * k);
        }
        assert!(out.len() <= 20 * 1000);
    }
}
