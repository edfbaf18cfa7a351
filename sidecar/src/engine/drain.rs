//! Reading the ranks' telemetry segments (`weft_agent::ring`): every few
//! milliseconds (2-5, sooner while records flow) the engine reads each
//! process's slot counters, then drains its ring in batches. The counters
//! make the operation and byte metrics (exact: every operation counts,
//! recorded or not); records make the error counts and the latency
//! histogram (every failure and every call of 200 us or more; at high rates
//! a sample of the rest) and go through the export policy into spans
//! (`weft_agent::spans::ProcessSpans`, shared with the in-process
//! exporter); the RAS view of each communicator rank is refreshed from its
//! slot in the segment; operations that were only counted are folded into
//! the export policy's aggregates (`weft_agent::ring::tally`); the ring's
//! drop counter becomes
//! `weft_events_dropped_total` and the process's `dropped_events`.
//!
//! A process's ring is drained before any of its lifecycle messages is
//! handled and before its departure is judged, so a span never arrives
//! after its communicator's `Deregister`.

use super::Engine;
use crate::metrics::{ExportLabel, Metrics, OpLabel};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::histogram::Histogram;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime};
use weft_agent::export::Export;
use weft_agent::report::nanos;
use weft_agent::ring::queue::Drainer;
use weft_agent::ring::record::NO_SLOT;
use weft_agent::ring::slots::{self, SlotRef, SlotView};
use weft_agent::ring::tally::Tally;
use weft_agent::ring::{CommKey, Record, Segment, codes};
use weft_agent::spans::{Origin, ProcessSpans};

/// Records read from one ring per pass, at most (then the next ring).
const BATCH: usize = 1 << 14;
/// Drain period: the shortest while records flow, growing to the longest
/// while they do not.
pub const PERIOD_MIN: Duration = Duration::from_millis(2);
pub const PERIOD_MAX: Duration = Duration::from_millis(5);
/// Labels and slots kept per process (a churn of communicators is bounded).
const MAX_REGISTERED: usize = 4096;

/// The next drain period after a pass that read `n` records.
pub fn next_period(n: usize, last: Duration) -> Duration {
    if n > 0 {
        PERIOD_MIN
    } else {
        (last + Duration::from_millis(1)).min(PERIOD_MAX)
    }
}

/// A communicator rank of the process that registered a slot.
struct Registered {
    label: String,
    rank: u32,
    key: CommKey,
    slot: SlotRef,
}

/// The metric handles of one operation (looked up once, not per record).
#[derive(Clone)]
struct OpMetrics {
    collectives: Counter,
    bytes: Counter,
    errors: Counter,
    latency: Histogram,
}

impl OpMetrics {
    fn of(m: &Metrics, op: &str) -> OpMetrics {
        let l = OpLabel { op: op.into() };
        OpMetrics {
            collectives: m.collectives.get_or_create(&l).clone(),
            bytes: m.bytes.get_or_create(&l).clone(),
            errors: m.errors.get_or_create(&l).clone(),
            latency: m.latency.get_or_create(&l).clone(),
        }
    }
}

/// One process's segment and what reading it needs.
pub struct ProcRing {
    pub seg: Arc<Segment>,
    inner: Mutex<Inner>,
}

struct Inner {
    drainer: Drainer,
    tally: Tally,
    spans: ProcessSpans,
    batch: Vec<Record>,
    /// Full labels of the process's communicators, by key.
    labels: HashMap<CommKey, String>,
    registered: Vec<Registered>,
    /// Ring drops and skipped entries already counted in the metric.
    lost_counted: u64,
    ops: Vec<Option<OpMetrics>>,
    exports: HashMap<&'static str, Counter>,
}

impl Inner {
    /// The metric handles of op code `op` (looked up once per process).
    fn op_metrics(&mut self, m: &Metrics, op: u8) -> &OpMetrics {
        let op = (op as usize).min(self.ops.len() - 1);
        self.ops[op].get_or_insert_with(|| OpMetrics::of(m, codes::op_name(op as u8)))
    }
}

impl ProcRing {
    pub fn new(seg: Arc<Segment>, origin: Origin) -> ProcRing {
        ProcRing {
            inner: Mutex::new(Inner {
                drainer: Drainer::new(seg.clone()),
                tally: Tally::default(),
                spans: ProcessSpans::new(origin, Instant::now()),
                batch: Vec::with_capacity(1024),
                labels: HashMap::new(),
                registered: Vec::new(),
                lost_counted: 0,
                ops: vec![None; codes::OPS.len()],
                exports: HashMap::new(),
            }),
            seg,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A `Register` of this process: its label, and its slot if it has one
    /// (index + 1 and generation, as the message carries them).
    pub fn register(&self, label: &str, rank: u32, slot: u32, generation: u32) {
        let mut i = self.lock();
        if i.labels.len() >= MAX_REGISTERED {
            return;
        }
        let key = CommKey::of(label);
        i.labels.insert(key, label.to_string());
        i.registered
            .retain(|r| !(r.label == label && r.rank == rank));
        if slot > 0 && u64::from(slot) <= self.seg.geometry().slots {
            i.registered.push(Registered {
                label: label.to_string(),
                rank,
                key,
                slot: SlotRef {
                    index: (slot - 1) as u16,
                    generation,
                },
            });
        }
    }

    /// A `Deregister`: the records before it have been read.
    pub fn deregister(&self, label: &str, rank: u32) {
        let mut i = self.lock();
        i.registered
            .retain(|r| !(r.label == label && r.rank == rank));
        if !i.registered.iter().any(|r| r.label == label) {
            i.labels.remove(&CommKey::of(label));
        }
    }

    /// Whether the segment says communicator `label` rank `rank` was
    /// destroyed (`None`: it has no slot, the segment cannot say).
    pub fn destroyed(&self, label: &str, rank: u32) -> Option<bool> {
        let i = self.lock();
        let r = i
            .registered
            .iter()
            .find(|r| r.label == label && r.rank == rank)?;
        let v = slots::read(&self.seg, r.slot.index)?;
        Some(v.destroyed_for(r.slot.generation, &r.key, r.rank))
    }

    /// Communicator ranks the segment says are not destroyed, registered
    /// or not (a process can end before its `Register` is read): their
    /// labels (the key's text when never registered) and ranks.
    pub fn live_slots(&self) -> Vec<(String, u32)> {
        let labels = self.lock().labels.clone();
        (0..self.seg.geometry().slots.min(u16::MAX as u64) as u16)
            .filter_map(|i| slots::read(&self.seg, i))
            .filter(|v| matches!(v.state, slots::LIVE | slots::FAILED | slots::ABORTED))
            .map(|v| {
                let label = labels.get(&v.key).cloned().unwrap_or_else(|| v.key.text());
                (label, v.rank)
            })
            .collect()
    }

    /// Whether the process ever had a communicator ready (per its segment).
    pub fn opened_any(&self) -> bool {
        (0..self.seg.geometry().slots.min(u16::MAX as u64) as u16)
            .filter_map(|i| slots::read(&self.seg, i))
            .any(|v| v.generation > 0)
    }

    /// The slot views of the registered communicator ranks.
    fn progress(&self) -> Vec<(String, u32, SlotView, Option<String>)> {
        let i = self.lock();
        i.registered
            .iter()
            .filter_map(|r| {
                let v = slots::read(&self.seg, r.slot.index)?;
                if v.generation != r.slot.generation || v.key != r.key || v.rank != r.rank {
                    return None;
                }
                let err = (v.outcome != codes::OK)
                    .then(|| slots::error_text(&self.seg, r.slot.index, v.completed_seq))
                    .flatten();
                Some((r.label.clone(), r.rank, v, err))
            })
            .collect()
    }

    /// Reads everything published (in batches), counts and exports it;
    /// with `last`, also the aggregates not yet due (the process is gone).
    /// Returns the records read.
    pub fn drain(&self, e: &Engine, last: bool) -> usize {
        let mut g = self.lock();
        let i = &mut *g;
        let now = Instant::now();
        let mut total = 0;
        // Counters before the ring (`ring::tally` says why).
        for t in i.tally.read(&self.seg, 0..self.seg.slots_used()) {
            let m = i.op_metrics(&e.metrics, t.op);
            m.collectives.inc_by(t.count.ops);
            m.bytes.inc_by(t.count.bytes);
        }
        let max_slots = self.seg.geometry().slots;
        loop {
            i.batch.clear();
            let n = i.drainer.drain(&mut i.batch, BATCH, now);
            total += n;
            for k in 0..n {
                let r = i.batch[k]; // a copy: `i` is borrowed again below
                let m = i.op_metrics(&e.metrics, r.op);
                if r.slot == NO_SLOT {
                    // Counted nowhere else: its communicator has no slot.
                    m.collectives.inc();
                    m.bytes.inc_by(r.bytes);
                }
                if !r.ok() {
                    m.errors.inc();
                }
                m.latency.observe(r.duration_ns() as f64 / 1e9);
                i.tally.recorded(&r, max_slots);
                let labels = &i.labels;
                let label = |k: &CommKey| labels.get(k).cloned().unwrap_or_else(|| k.text());
                let (how, span) = i.spans.record(&r, &self.seg, &label, now);
                count_export(&mut i.exports, &e.metrics, how, 1);
                if let (Some(s), Some(t)) = (span, e.telemetry.get()) {
                    t.record(s);
                }
            }
            if n < BATCH {
                break;
            }
        }
        let now_ns = nanos(SystemTime::now());
        for t in i.tally.unrecorded() {
            i.spans.policy.fold(&t, now_ns);
            count_export(&mut i.exports, &e.metrics, Export::Aggregated, t.count.ops);
        }
        let labels = &i.labels;
        let label = |k: &CommKey| labels.get(k).cloned().unwrap_or_else(|| k.text());
        for s in i.spans.flush(&label, now, last) {
            if let Some(t) = e.telemetry.get() {
                t.record(s);
            }
        }
        // Drops in the ring and entries given up: operations not reported.
        let lost = self.seg.dropped() + i.drainer.skipped();
        if lost > i.lost_counted {
            e.metrics.events_dropped.inc_by(lost - i.lost_counted);
            i.lost_counted = lost;
        }
        total
    }

    /// Operations this process could not report.
    pub fn lost(&self) -> u64 {
        self.seg.dropped() + self.lock().drainer.skipped()
    }
}

fn count_export(cache: &mut HashMap<&'static str, Counter>, m: &Metrics, how: Export, n: u64) {
    cache
        .entry(how.label())
        .or_insert_with(|| {
            m.span_records
                .get_or_create(&ExportLabel {
                    export: how.label().into(),
                })
                .clone()
        })
        .inc_by(n);
}

impl Engine {
    /// Drains every process's ring once; returns the records read.
    pub fn drain_all(&self) -> usize {
        let rings: Vec<(u64, Arc<ProcRing>)> = self
            .state
            .lock()
            .procs
            .iter()
            .filter_map(|(c, p)| p.ring.clone().map(|r| (*c, r)))
            .collect();
        rings
            .iter()
            .map(|(conn, r)| self.drain_ring(*conn, r, false))
            .sum()
    }

    /// Drains the ring of connection `conn` (if it has one); with `last`,
    /// its pending aggregates too.
    pub fn drain_conn(&self, conn: u64, last: bool) {
        let ring = self
            .state
            .lock()
            .procs
            .get(&conn)
            .and_then(|p| p.ring.clone());
        if let Some(r) = ring {
            self.drain_ring(conn, &r, last);
        }
    }

    fn drain_ring(&self, conn: u64, r: &ProcRing, last: bool) -> usize {
        let n = r.drain(self, last);
        self.refresh_progress(conn, r);
        n
    }

    /// The RAS view of `conn`'s communicator ranks, from their slots.
    fn refresh_progress(&self, conn: u64, r: &ProcRing) {
        let views = r.progress();
        let lost = r.lost();
        let mut reg = self.state.lock();
        let mut changed = false;
        if let Some(p) = reg.procs.get_mut(&conn)
            && p.ring_dropped != lost
        {
            p.ring_dropped = lost;
            changed = true;
        }
        for (label, rank, v, err) in views {
            let Some(e) = reg
                .comms
                .get_mut(&label)
                .and_then(|c| c.ranks.get_mut(&rank))
                .filter(|e| e.conn == conn)
            else {
                continue;
            };
            changed |= e.apply_slot(&v, err);
        }
        drop(reg);
        if changed {
            self.state.touch();
        }
    }
}
