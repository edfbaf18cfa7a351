//! What reporting an operation costs the rank (issue 30's target: a few
//! hundred nanoseconds, no system call): `cargo bench -p weft-agent --bench
//! report`. Prints nanoseconds per operation for
//!
//! - `push`: one ring record (the queue alone, into an empty ring);
//! - `report`: the agent's observer for one collective (its started and
//!   completed events: slot update and ring record), with 1 and 4 threads
//!   reporting at once (4 communicators of one process), while a consumer
//!   drains the ring as the sidecar does;
//! - `libcomm`: an 8-byte all-reduce on a one-rank communicator (a copy),
//!   without an observer, with one whose events do nothing (libcomm's own
//!   cost: its events, and counting the untimed calls in the slot's words)
//!   and with the agent's: the whole cost a rank pays. Back to back, so
//!   libcomm times one call in 32 and counts the rest itself
//!   (`libcomm::observe` sampling).
//!
//! Each figure is the least and the median of 5 rounds: on a shared
//! machine the least is the cost, the median shows the noise. A consumer
//! starved of CPU lets the ring fill; drops are printed (a dropped record
//! costs less than a published one). `cargo bench -p weft-agent --bench
//! report -- libcomm` runs only the `libcomm` line, over 15 rounds.

use libcomm::observe::{CommEvent, CounterWords, Observer, OpEvent, Phase};
use libcomm::{Communicator, ReduceOp};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime};
use weft_agent::report::Reporter;
use weft_agent::ring::layout::Geometry;
use weft_agent::ring::queue::{self, Drainer};
use weft_agent::ring::{CommKey, Record, Segment};

const OPS: u64 = 2_000_000;

fn segment() -> Arc<Segment> {
    Arc::new(Segment::create(Geometry::with_records(1 << 14)).expect("a segment"))
}

/// Drains `seg` until `stop`: every millisecond (the sidecar: every 2-5),
/// or, with `busy`, without pause.
fn consumer(seg: Arc<Segment>, stop: Arc<AtomicBool>, busy: bool) -> std::thread::JoinHandle<u64> {
    std::thread::spawn(move || {
        let mut d = Drainer::new(seg);
        let mut out = Vec::with_capacity(1 << 14);
        let mut n = 0;
        while !stop.load(Ordering::Relaxed) {
            out.clear();
            n += d.drain(&mut out, 1 << 18, Instant::now()) as u64;
            if !busy {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        n
    })
}

/// Publishing alone: bursts of a ring's worth into an empty ring, each
/// drained (untimed) before the next.
fn push_alone() -> f64 {
    let seg = segment();
    let mut d = Drainer::new(seg.clone());
    let mut out = Vec::with_capacity(1 << 15);
    let r = Record {
        comm: CommKey::of("9f3a11c0"),
        rank: 1,
        nranks: 4,
        op: 1,
        dtype: 9,
        algo: 1,
        group: false,
        outcome: 0,
        slot: 0,
        bytes: 8,
        seq: 0,
        start_ns: 1,
        end_ns: 2,
    };
    let burst = seg.geometry().records;
    let mut best = f64::MAX;
    for _ in 0..(OPS / burst).max(1) {
        let t = Instant::now();
        for _ in 0..burst {
            queue::push(&seg, &r);
        }
        best = best.min(t.elapsed().as_nanos() as f64 / burst as f64);
        out.clear();
        d.drain(&mut out, burst as usize, Instant::now());
    }
    assert_eq!(seg.dropped(), 0);
    best
}

fn event(comm: &str, seq: u64, phase: Phase) -> OpEvent<'_> {
    OpEvent {
        job: "bench",
        comm_id: comm,
        rank: 0,
        nranks: 4,
        op: "all_reduce",
        dtype: "float",
        bytes: 8,
        algo: "ll",
        seq,
        group: false,
        phase,
        outcome: (phase == Phase::Completed).then_some(Ok(())),
        time: SystemTime::now(),
    }
}

/// The agent's observer on `threads` threads, one communicator each:
/// (ns per collective per thread, records dropped).
fn report(threads: usize) -> (f64, u64) {
    let seg = segment();
    let rep = Arc::new(Reporter::new(seg.clone()));
    let stop = Arc::new(AtomicBool::new(false));
    let c = consumer(seg.clone(), stop.clone(), false);
    let per = OPS / threads as u64;
    let t = Instant::now();
    let hs: Vec<_> = (0..threads)
        .map(|i| {
            let rep = rep.clone();
            std::thread::spawn(move || {
                let comm = format!("comm{i:04x}");
                rep.opened(&comm, 0, 4);
                // The events built once (libcomm's share of the cost is the
                // `libcomm` line's), their sequence number and clock set
                // per operation as libcomm sets them.
                let (mut s, mut c) = (
                    event(&comm, 0, Phase::Started),
                    event(&comm, 0, Phase::Completed),
                );
                for seq in 1..=per {
                    s.seq = seq;
                    s.time = SystemTime::now();
                    rep.op(&s);
                    c.seq = seq;
                    c.time = SystemTime::now();
                    rep.op(&c);
                }
            })
        })
        .collect();
    for h in hs {
        let _ = h.join();
    }
    let ns = t.elapsed().as_nanos() as f64 / per as f64;
    stop.store(true, Ordering::Relaxed);
    let _ = c.join();
    (ns, seg.dropped())
}

/// The agent's reporter as libcomm's observer (the bench's stand-in for
/// `Agent`, without its sidecar connection); `on` off: an observer that
/// does nothing (libcomm's own cost of building the events).
struct Observe {
    rep: Reporter,
    on: Arc<AtomicBool>,
}

impl Observer for Observe {
    fn on_op(&self, ev: &OpEvent<'_>) {
        if self.on.load(Ordering::Relaxed) {
            self.rep.op(ev);
        }
    }
    // Not switched: libcomm writes the untimed words itself either way.
    fn counter(&self, comm_id: &str, rank: usize) -> Option<CounterWords> {
        self.rep.counter(comm_id, rank as u32)
    }
    fn on_comm(&self, ev: CommEvent) {
        if let CommEvent::Ready {
            comm_id,
            rank,
            nranks,
            ..
        } = ev
        {
            self.rep.opened(&comm_id, rank as u32, nranks as u32);
        }
    }
}

fn all_reduce_ns(c: &Communicator, n: u64) -> f64 {
    let mut v = [1u64];
    let t = Instant::now();
    for _ in 0..n {
        c.all_reduce_in_place(&mut v, ReduceOp::Sum)
            .expect("all-reduce");
    }
    t.elapsed().as_nanos() as f64 / n as f64
}

/// An 8-byte all-reduce on a one-rank communicator: (plain, libcomm's
/// events to an observer that does nothing, reported by the agent), ns,
/// the least of `rounds` (the others interleaved), and the records the
/// ring dropped (a consumer starved of CPU).
fn libcomm_path(rounds: usize) -> (f64, f64, f64, u64) {
    let n = OPS / 8;
    let plain = Communicator::init_all(1).expect("a one-rank communicator");
    all_reduce_ns(&plain[0], n / 10);
    let before = (0..rounds)
        .map(|_| all_reduce_ns(&plain[0], n))
        .fold(f64::MAX, f64::min);
    let seg = segment();
    let obs = Arc::new(Observe {
        rep: Reporter::new(seg.clone()),
        on: Arc::new(AtomicBool::new(false)),
    });
    libcomm::observe::set_observer(obs.clone());
    let stop = Arc::new(AtomicBool::new(false));
    let c = consumer(seg.clone(), stop.clone(), false);
    // A communicator created after the observer: it has its slot.
    let seen = Communicator::init_all(1).expect("a one-rank communicator");
    all_reduce_ns(&seen[0], n / 10);
    let (mut events, mut after) = (f64::MAX, f64::MAX);
    for _ in 0..rounds {
        obs.on.store(false, Ordering::Relaxed);
        events = events.min(all_reduce_ns(&seen[0], n));
        obs.on.store(true, Ordering::Relaxed);
        after = after.min(all_reduce_ns(&seen[0], n));
    }
    stop.store(true, Ordering::Relaxed);
    let _ = c.join();
    (before, events, after, seg.dropped())
}

/// The least and the median of `f` over `rounds` runs.
fn rounds(k: usize, mut f: impl FnMut() -> f64) -> (f64, f64) {
    let mut v: Vec<f64> = (0..k).map(|_| f()).collect();
    v.sort_by(f64::total_cmp);
    (v[0], v[k / 2])
}

fn main() {
    // `cargo bench` passes --bench; `-- libcomm` runs only the last line
    // (more rounds: the whole cost a rank pays, the figure that matters).
    let only_libcomm = std::env::args().skip(1).any(|a| a == "libcomm");
    const R: usize = 5;
    if only_libcomm {
        return print_libcomm(3 * R);
    }
    println!("least / median of {R} rounds, ns");
    let (a, b) = rounds(R, push_alone);
    println!("push     1 thread : {a:6.1} / {b:6.1} per record (into an empty ring)");
    for threads in [1, 4] {
        let mut dropped = 0;
        let (a, b) = rounds(R, || {
            let (ns, d) = report(threads);
            dropped += d;
            ns
        });
        println!(
            "report   {threads} thread{}: {a:6.1} / {b:6.1} per collective per thread, 2 clock reads included (a consumer draining every ms; {dropped} dropped)",
            if threads == 1 { " " } else { "s" }
        );
    }
    print_libcomm(R);
}

fn print_libcomm(rounds: usize) {
    let (plain, events, after, dropped) = libcomm_path(rounds);
    println!(
        "libcomm  1 thread : all_reduce 8 B on one rank {plain:6.1} plain, {events:6.1} with libcomm's events, {after:6.1} reported: +{:.1} per collective ({:.1} libcomm's events, {:.1} the agent; {dropped} dropped)",
        after - plain,
        events - plain,
        after - events
    );
}
