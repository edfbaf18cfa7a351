//! What reporting an operation costs the rank (issue 30's target: a few
//! hundred nanoseconds, no system call): `cargo bench -p weft-agent --bench
//! report`. Prints nanoseconds per operation for
//!
//! - `push`: one ring record (the queue alone);
//! - `report`: the agent's observer for one collective (its started and
//!   completed events: slot update and ring record), with 1 and 4 threads
//!   reporting at once (4 communicators of one process), while a consumer
//!   drains the ring as the sidecar does;
//! - `libcomm`: an 8-byte all-reduce on a one-rank communicator (a copy),
//!   without and with the agent's observer installed: the whole cost a
//!   rank pays, libcomm's event building included.

use libcomm::observe::{CommEvent, Observer, OpEvent, Phase};
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

/// Drains `seg` until `stop`: every 2 ms as the sidecar does, or, with
/// `busy`, without pause (so a producer faster than any sidecar is timed
/// publishing, not dropping).
fn consumer(seg: Arc<Segment>, stop: Arc<AtomicBool>, busy: bool) -> std::thread::JoinHandle<u64> {
    std::thread::spawn(move || {
        let mut d = Drainer::new(seg);
        let mut out = Vec::with_capacity(1 << 14);
        let mut n = 0;
        while !stop.load(Ordering::Relaxed) {
            out.clear();
            n += d.drain(&mut out, 1 << 14, Instant::now()) as u64;
            if !busy {
                std::thread::sleep(Duration::from_millis(2));
            }
        }
        n
    })
}

fn push_alone() {
    let seg = segment();
    let stop = Arc::new(AtomicBool::new(false));
    let c = consumer(seg.clone(), stop.clone(), true);
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
    let t = Instant::now();
    for _ in 0..OPS {
        queue::push(&seg, &r);
    }
    let ns = t.elapsed().as_nanos() as f64 / OPS as f64;
    stop.store(true, Ordering::Relaxed);
    let read = c.join().unwrap_or(0);
    println!(
        "push     1 thread : {ns:6.1} ns/record  (dropped {} of {OPS}, read {read})",
        seg.dropped()
    );
}

fn event(comm: &str, seq: u64, phase: Phase) -> OpEvent {
    OpEvent {
        job: "bench",
        comm_id: comm.into(),
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

/// The agent's observer on `threads` threads, one communicator each.
fn report(threads: usize) {
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
    let read = c.join().unwrap_or(0);
    println!(
        "report   {threads} thread{}: {ns:6.1} ns/collective per thread, 2 clock reads included  (dropped {} of {}, read {read})",
        if threads == 1 { " " } else { "s" },
        seg.dropped(),
        per * threads as u64
    );
}

/// The agent's reporter as libcomm's observer (the bench's stand-in for
/// `Agent`, without its sidecar connection); `on` off: an observer that
/// does nothing (libcomm's own cost of building the events).
struct Observe {
    rep: Reporter,
    on: AtomicBool,
}

impl Observer for Observe {
    fn on_op(&self, ev: &OpEvent) {
        if self.on.load(Ordering::Relaxed) {
            self.rep.op(ev);
        }
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

fn libcomm_path() {
    let n = OPS / 4;
    let plain = Communicator::init_all(1).expect("a one-rank communicator");
    all_reduce_ns(&plain[0], n / 10);
    let before = all_reduce_ns(&plain[0], n);
    let seg = segment();
    let obs = Arc::new(Observe {
        rep: Reporter::new(seg.clone()),
        on: AtomicBool::new(false),
    });
    libcomm::observe::set_observer(obs.clone());
    let stop = Arc::new(AtomicBool::new(false));
    let c = consumer(seg.clone(), stop.clone(), false);
    // A communicator created after the observer: it has its slot.
    let seen = Communicator::init_all(1).expect("a one-rank communicator");
    all_reduce_ns(&seen[0], n / 10);
    let events = all_reduce_ns(&seen[0], n);
    obs.on.store(true, Ordering::Relaxed);
    all_reduce_ns(&seen[0], n / 10);
    let after = all_reduce_ns(&seen[0], n);
    stop.store(true, Ordering::Relaxed);
    let _ = c.join();
    println!(
        "libcomm  1 thread : all_reduce 8 B on one rank {before:6.1} ns plain, {events:6.1} ns with libcomm's events only, {after:6.1} ns reported (+{:.1} ns per collective in all: {:.1} libcomm's events, {:.1} the agent; dropped {})",
        after - before,
        events - before,
        after - events,
        seg.dropped()
    );
}

fn main() {
    // `cargo bench` passes --bench; nothing else is taken.
    push_alone();
    report(1);
    report(4);
    libcomm_path();
}
