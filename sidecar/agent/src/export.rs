//! What becomes a span: the export policy the sidecar and the in-process
//! exporter apply to each process's records (docs/sidecar.md, "Export at
//! high rates").
//!
//! At low rates every collective is its own span. Each process has a
//! budget of `WEFT_SPANS_PER_SEC` spans a second (a token bucket holding
//! ten seconds' worth, so a job's start or a short run exports everything).
//! A failure or a slow call (at least [`SLOW_FACTOR`] times the recent
//! median of its communicator, op and size class, and [`SLOW_FLOOR`] above
//! it) is always exported, from a second budget of the same size. What no
//! budget covers is folded into an aggregate per communicator, rank and
//! operation, exported once per [`INTERVAL`] (count, bytes, latency
//! minimum, mean and maximum, errors). Operations the rank only counted
//! (above 20,000 a second per communicator it records a sample, besides
//! every failure and every call of 200 us or more: `ring::slots`; above
//! 40,000 a second libcomm times one call in 32 or 256 and counts the rest) are
//! folded into the same aggregates ([`Policy::fold`]). So every operation
//! lands in exactly one exported span: the sum of `weft.count` over the
//! spans is the number of operations completed, and metrics (read from
//! the counters) stay exact whatever is exported.

use crate::ring::slots::OpCount;
use crate::ring::tally::Tallied;
use crate::ring::{CommKey, Record};
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// How often aggregates are exported.
pub const INTERVAL: Duration = Duration::from_secs(1);
/// A call this many times its recent median is slow...
pub const SLOW_FACTOR: u64 = 8;
/// ...and at least this much above it (scheduling noise is not slowness).
pub const SLOW_FLOOR: Duration = Duration::from_micros(200);
/// Seconds of budget a bucket holds.
const BURST_SECS: f64 = 10.0;
/// Latencies kept per (communicator, rank, op, size class) for the median.
const WINDOW: usize = 32;
/// Keys kept per process in each map (aggregates, medians).
const MAX_KEYS: usize = 4096;
/// Medians not fed for this long are forgotten.
const FORGET: Duration = Duration::from_secs(60);

/// Where one record went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Export {
    /// Its own span, within the budget.
    Span,
    /// Its own span: it failed.
    Failure,
    /// Its own span: it was slow.
    Slow,
    /// Folded into its aggregate.
    Aggregated,
}

impl Export {
    /// The `weft.export` attribute of its span.
    pub fn label(self) -> &'static str {
        match self {
            Export::Span => "span",
            Export::Failure => "failure",
            Export::Slow => "slow",
            Export::Aggregated => "aggregate",
        }
    }
}

/// The aggregate's key: one per communicator, rank and operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AggKey {
    pub comm: CommKey,
    pub rank: u32,
    pub nranks: u32,
    pub op: u8,
}

/// The operations of one key in one interval: those that came as records
/// and those only counted. Minimum and maximum are over the records and the
/// mean of the counted rest; since every timed call of 200 us or more is a
/// record (`slots::RECORD_SLOWER_THAN_NS`), a maximum that matters is exact
/// while libcomm times every call (below 200,000 calls a second per
/// communicator: `libcomm::observe`'s sampling).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Aggregate {
    pub count: u64,
    pub bytes: u64,
    pub errors: u64,
    /// Over the operations whose time is known (`timed`).
    pub min_ns: u64,
    pub max_ns: u64,
    pub total_ns: u64,
    /// Operations whose time `total_ns` holds: records with a duration,
    /// and counted-only operations of a pass that timed some (libcomm
    /// times one in 32 or 256 in tight loops), at those ones' mean.
    pub timed: u64,
    pub first_start_ns: u64,
    pub last_end_ns: u64,
    /// The last record's type and algorithm (usually the only ones).
    pub dtype: u8,
    pub algo: u8,
}

impl Aggregate {
    pub fn mean_ns(&self) -> u64 {
        self.total_ns / self.timed.max(1)
    }

    /// `n` operations that took `each_ns` each.
    fn time(&mut self, each_ns: u64, n: u64) {
        if self.timed == 0 {
            (self.min_ns, self.max_ns) = (each_ns, each_ns);
        }
        self.timed += n;
        self.min_ns = self.min_ns.min(each_ns);
        self.max_ns = self.max_ns.max(each_ns);
        self.total_ns = self.total_ns.saturating_add(each_ns.saturating_mul(n));
    }

    fn add(&mut self, r: &Record) {
        let d = r.duration_ns();
        if self.count == 0 {
            self.first_start_ns = r.start_ns;
        }
        self.count += 1;
        self.bytes = self.bytes.saturating_add(r.bytes);
        self.errors += u64::from(!r.ok());
        // Timed: a duration (an untimed operation that failed is a record
        // without one), the rule of the slot counters and `Tally::recorded`.
        if d > 0 {
            self.time(d, 1);
        }
        self.first_start_ns = self.first_start_ns.min(r.start_ns);
        self.last_end_ns = self.last_end_ns.max(r.end_ns);
        self.dtype = r.dtype;
        self.algo = r.algo;
    }

    /// Adds operations known only by their counters, read at `now_ns`:
    /// their busy time is the timed ones' (`c.timed`), at whose mean the
    /// rest are taken; a pass that timed none adds no time.
    fn fold(&mut self, c: &OpCount, now_ns: u64) {
        let mean = (c.timed > 0).then(|| c.busy_ns / c.timed);
        let began = now_ns.saturating_sub(mean.map_or(0, |m| m.saturating_mul(c.ops)));
        if self.count == 0 {
            self.first_start_ns = began;
        }
        self.count += c.ops;
        self.bytes = self.bytes.saturating_add(c.bytes);
        if let Some(m) = mean {
            self.time(m, c.ops);
        }
        self.first_start_ns = self.first_start_ns.min(began);
        self.last_end_ns = self.last_end_ns.max(now_ns);
    }
}

/// Counts of where records went, since the policy started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    pub spans: u64,
    pub failures: u64,
    pub slow: u64,
    pub aggregated: u64,
}

impl Counts {
    pub fn total(&self) -> u64 {
        self.spans + self.failures + self.slow + self.aggregated
    }
}

/// A token bucket of `rate` a second holding [`BURST_SECS`] of it.
struct Bucket {
    tokens: f64,
    rate: f64,
}

impl Bucket {
    fn new(rate: f64) -> Bucket {
        Bucket {
            tokens: rate * BURST_SECS,
            rate,
        }
    }

    fn refill(&mut self, secs: f64) {
        self.tokens = (self.tokens + secs * self.rate).min(self.rate * BURST_SECS);
    }

    fn take(&mut self) -> bool {
        let ok = self.tokens >= 1.0;
        if ok {
            self.tokens -= 1.0;
        }
        ok
    }
}

/// Recent latencies of one key, and their median.
struct Window {
    recent: [u64; WINDOW],
    n: usize,
    median: Option<u64>,
    fed: Instant,
}

impl Window {
    fn new(now: Instant) -> Window {
        Window {
            recent: [0; WINDOW],
            n: 0,
            median: None,
            fed: now,
        }
    }

    /// Whether `d` is slow against the median so far; then takes it in
    /// (the median is recomputed every `WINDOW` calls).
    fn slow_then_add(&mut self, d: u64, now: Instant) -> bool {
        let slow = self.median.is_some_and(|m| {
            d >= m.saturating_mul(SLOW_FACTOR) && d >= m + SLOW_FLOOR.as_nanos() as u64
        });
        self.recent[self.n % WINDOW] = d;
        self.n += 1;
        if self.n.is_multiple_of(WINDOW) {
            let mut s = self.recent;
            s.sort_unstable();
            self.median = Some(s[WINDOW / 2]);
        }
        self.fed = now;
        slow
    }
}

type WinKey = (CommKey, u32, u8, u8);

/// The policy's state for one process.
pub struct Policy {
    spans: Bucket,
    extra: Bucket,
    last: Instant,
    interval_start: Instant,
    aggregates: HashMap<AggKey, Aggregate>,
    windows: HashMap<WinKey, Window>,
    counts: Counts,
}

/// The aggregate key records go to once the map is full.
fn overflow_key() -> AggKey {
    AggKey {
        comm: CommKey::of("(other communicators)"),
        rank: 0,
        nranks: 0,
        op: 0,
    }
}

impl Policy {
    /// A policy of `per_sec` spans a second (0: aggregates only).
    pub fn new(per_sec: u64, now: Instant) -> Policy {
        let rate = per_sec as f64;
        Policy {
            spans: Bucket::new(rate),
            extra: Bucket::new(rate),
            last: now,
            interval_start: now,
            aggregates: HashMap::new(),
            windows: HashMap::new(),
            counts: Counts::default(),
        }
    }

    /// The policy of `WEFT_SPANS_PER_SEC`.
    pub fn from_env(now: Instant) -> Policy {
        Policy::new(weft_contract::params::WEFT_SPANS_PER_SEC.value(), now)
    }

    pub fn counts(&self) -> Counts {
        self.counts
    }

    /// Where record `r` goes (an aggregated one is added to its aggregate).
    pub fn decide(&mut self, r: &Record, now: Instant) -> Export {
        let secs = now.saturating_duration_since(self.last).as_secs_f64();
        self.last = now;
        self.spans.refill(secs);
        self.extra.refill(secs);
        let slow = self.slow(r, now);
        let e = if !r.ok() && self.extra.take() {
            Export::Failure
        } else if slow && self.extra.take() {
            Export::Slow
        } else if self.spans.take() {
            Export::Span
        } else {
            self.aggregate(AggKey {
                comm: r.comm,
                rank: r.rank,
                nranks: r.nranks,
                op: r.op,
            })
            .add(r);
            Export::Aggregated
        };
        let c = &mut self.counts;
        match e {
            Export::Span => c.spans += 1,
            Export::Failure => c.failures += 1,
            Export::Slow => c.slow += 1,
            Export::Aggregated => c.aggregated += 1,
        }
        e
    }

    /// Operations the rank only counted (`ring::tally`: no record of them
    /// came), folded into their aggregate at `now_ns` (ns since the Unix
    /// epoch).
    pub fn fold(&mut self, t: &Tallied, now_ns: u64) {
        if t.count.ops == 0 {
            return;
        }
        self.aggregate(AggKey {
            comm: t.comm,
            rank: t.rank,
            nranks: t.nranks,
            op: t.op,
        })
        .fold(&t.count, now_ns);
        self.counts.aggregated += t.count.ops;
    }

    /// The aggregate of `key` this interval (the overflow key's once the
    /// map is full).
    fn aggregate(&mut self, key: AggKey) -> &mut Aggregate {
        let key = if self.aggregates.len() < MAX_KEYS || self.aggregates.contains_key(&key) {
            key
        } else {
            overflow_key()
        };
        self.aggregates.entry(key).or_default()
    }

    fn slow(&mut self, r: &Record, now: Instant) -> bool {
        let class = (64 - r.bytes.leading_zeros()) as u8;
        let key = (r.comm, r.rank, r.op, class);
        if !self.windows.contains_key(&key) && self.windows.len() >= MAX_KEYS {
            return false;
        }
        self.windows
            .entry(key)
            .or_insert_with(|| Window::new(now))
            .slow_then_add(r.duration_ns(), now)
    }

    /// Whether an interval has passed since the last [`flush`](Self::flush).
    pub fn due(&self, now: Instant) -> bool {
        now.saturating_duration_since(self.interval_start) >= INTERVAL
    }

    /// The interval's aggregates (taken: the next interval starts empty);
    /// medians not fed for a minute are forgotten.
    pub fn flush(&mut self, now: Instant) -> Vec<(AggKey, Aggregate)> {
        self.interval_start = now;
        self.windows
            .retain(|_, w| now.saturating_duration_since(w.fed) < FORGET);
        self.aggregates.drain().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ring::codes;

    fn rec(comm: &str, d: u64, ok: bool) -> Record {
        Record {
            comm: CommKey::of(comm),
            rank: 0,
            nranks: 2,
            op: codes::op_code("all_reduce"),
            dtype: 9,
            algo: 1,
            group: false,
            outcome: if ok { codes::OK } else { codes::ERROR },
            slot: 0,
            bytes: 8,
            seq: 1,
            start_ns: 1000,
            end_ns: 1000 + d,
        }
    }

    /// Within the budget everything is a span; beyond it records are
    /// aggregated, failures still exported; every record is counted once.
    #[test]
    fn beyond_the_budget_records_are_aggregated_failures_are_not() {
        let t = Instant::now();
        let mut p = Policy::new(10, t); // 100 spans of burst
        for _ in 0..100 {
            assert_eq!(p.decide(&rec("a", 1000, true), t), Export::Span);
        }
        assert_eq!(p.decide(&rec("a", 1000, true), t), Export::Aggregated);
        assert_eq!(p.decide(&rec("a", 1000, false), t), Export::Failure);
        for _ in 0..50 {
            p.decide(&rec("a", 1000, true), t);
            p.decide(&rec("b", 3000, true), t);
        }
        // One second later: 10 more tokens.
        let t1 = t + Duration::from_secs(1);
        assert_eq!(p.decide(&rec("a", 1000, true), t1), Export::Span);
        assert!(p.due(t1));
        let aggs = p.flush(t1);
        let a = aggs
            .iter()
            .find(|(k, _)| k.comm == CommKey::of("a"))
            .unwrap()
            .1;
        let b = aggs
            .iter()
            .find(|(k, _)| k.comm == CommKey::of("b"))
            .unwrap()
            .1;
        assert_eq!(
            (a.count, a.bytes, a.min_ns, a.max_ns),
            (51, 408, 1000, 1000)
        );
        assert_eq!((b.count, b.mean_ns()), (50, 3000));
        let c = p.counts();
        assert_eq!(c.total(), 100 + 1 + 1 + 100 + 1);
        assert_eq!((c.spans, c.failures, c.aggregated), (101, 1, 101), "{c:?}");
        assert!(p.flush(t1).is_empty(), "taken");
    }

    /// A call far above its key's recent median is exported as slow, even
    /// with no span budget left.
    #[test]
    fn slow_calls_are_exported() {
        let t = Instant::now();
        let mut p = Policy::new(1, t);
        for _ in 0..(WINDOW * 2) {
            p.decide(&rec("a", 10_000, true), t);
        }
        assert_eq!(p.decide(&rec("a", 10_000_000, true), t), Export::Slow);
        // 8x but not 200 us above: noise, not slow.
        assert_ne!(p.decide(&rec("a", 80_001, true), t), Export::Slow);
        // Another communicator has no history yet.
        assert_ne!(p.decide(&rec("b", 10_000_000, true), t), Export::Slow);
    }

    /// Operations only counted join their key's aggregate: count, bytes and
    /// mean over all of them (the untimed ones at the timed ones' mean);
    /// min and max over the records and the rest's mean.
    #[test]
    fn counted_operations_are_folded_into_the_aggregates() {
        let t = Instant::now();
        let mut p = Policy::new(0, t);
        assert_eq!(p.decide(&rec("a", 1000, true), t), Export::Aggregated);
        let counted = Tallied {
            comm: CommKey::of("a"),
            rank: 0,
            nranks: 2,
            op: codes::op_code("all_reduce"),
            count: OpCount {
                ops: 99,
                bytes: 99 * 8,
                busy_ns: 3 * 3000,
                timed: 3,
            },
        };
        p.fold(&counted, 5_000_000);
        let aggs = p.flush(t);
        assert_eq!(aggs.len(), 1);
        let a = aggs[0].1;
        assert_eq!(
            (a.count, a.bytes, a.min_ns, a.max_ns),
            (100, 800, 1000, 3000)
        );
        assert_eq!(a.mean_ns(), (1000 + 99 * 3000) / 100);
        assert_eq!(a.last_end_ns, 5_000_000);
        assert_eq!(p.counts().aggregated, 100);
    }

    /// Garbage keys cannot grow the maps without bound.
    #[test]
    fn maps_stay_bounded() {
        let t = Instant::now();
        let mut p = Policy::new(0, t);
        for i in 0..(MAX_KEYS + 100) {
            assert_eq!(
                p.decide(&rec(&format!("c{i}"), 5, true), t),
                Export::Aggregated
            );
        }
        assert!(p.windows.len() <= MAX_KEYS);
        let aggs = p.flush(t);
        assert_eq!(aggs.len(), MAX_KEYS + 1);
        let other = aggs.iter().find(|(k, _)| *k == overflow_key()).unwrap().1;
        assert_eq!(other.count, 100);
    }
}
