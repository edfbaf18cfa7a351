//! The observer hook as an observer sees it: calls spaced out are each
//! timed and reported as started/completed events; a tight loop is
//! sampled (one timed call in `SAMPLE_EVERY`), the rest go to the
//! communicator's counter; every call is accounted for exactly once, with
//! its own sequence number. One test: the observer is process-wide.

use libcomm::observe::{self, CommEvent, Observer, OpCounter, OpEvent, Phase};
use libcomm::{Communicator, ReduceOp};
use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

#[derive(Default)]
struct Seen {
    /// (phase, seq, op, has a time) of every event.
    events: Vec<(Phase, u64, &'static str, bool)>,
    /// Sequence numbers the counter saw start and complete, bytes counted.
    started: Vec<u64>,
    completed: Vec<u64>,
    bytes: u64,
}

#[derive(Default)]
struct Watch(Arc<Mutex<Seen>>);

struct Counter(Arc<Mutex<Seen>>);

impl OpCounter for Counter {
    fn started(&self, seq: u64, op: &'static str) {
        assert_eq!(op, "all_reduce");
        self.0.lock().unwrap().started.push(seq);
    }
    fn completed(&self, seq: u64, op: &'static str, bytes: u64) {
        assert_eq!(op, "all_reduce");
        let mut s = self.0.lock().unwrap();
        s.completed.push(seq);
        s.bytes += bytes;
    }
}

impl Observer for Watch {
    fn on_op(&self, ev: &OpEvent<'_>) {
        let stamped = ev.time > std::time::UNIX_EPOCH;
        self.0
            .lock()
            .unwrap()
            .events
            .push((ev.phase, ev.seq, ev.op, stamped));
    }
    fn on_comm(&self, _: CommEvent) {}
    fn counter(&self, _: &str, _: usize) -> Option<Arc<dyn OpCounter>> {
        Some(Arc::new(Counter(self.0.clone())))
    }
}

fn timed_completions(s: &Seen) -> Vec<u64> {
    s.events
        .iter()
        .filter(|e| e.0 == Phase::Completed)
        .map(|e| e.1)
        .collect()
}

#[test]
fn spaced_calls_are_each_timed_and_tight_loops_sampled_with_every_call_accounted() {
    let seen = Arc::new(Mutex::new(Seen::default()));
    assert!(observe::set_observer(Arc::new(Watch(seen.clone()))));
    let comms = Communicator::init_all(1).unwrap();
    let c = &comms[0];
    let mut v = [3u64];

    // Spaced out (well above FAST_MEAN_NS apart): every call timed.
    const SPACED: u64 = 40;
    for _ in 0..SPACED {
        std::thread::sleep(Duration::from_micros(100));
        c.all_reduce_in_place(&mut v, ReduceOp::Sum).unwrap();
    }
    {
        let s = seen.lock().unwrap();
        assert_eq!(timed_completions(&s), (1..=SPACED).collect::<Vec<_>>());
        assert_eq!(
            s.events.len() as u64,
            2 * SPACED,
            "a start and a completion each"
        );
        assert!(
            s.events.iter().all(|e| e.2 == "all_reduce" && e.3),
            "stamped"
        );
        assert!(s.started.is_empty() && s.completed.is_empty());
    }

    // Back to back: sampled.
    const TIGHT: u64 = 64 * observe::SAMPLE_EVERY;
    for _ in 0..TIGHT {
        c.all_reduce_in_place(&mut v, ReduceOp::Sum).unwrap();
    }
    assert_eq!(v, [3]);
    let s = seen.lock().unwrap();
    let timed: BTreeSet<u64> = timed_completions(&s)
        .into_iter()
        .filter(|q| *q > SPACED)
        .collect();
    let counted: BTreeSet<u64> = s.completed.iter().copied().collect();
    assert_eq!(
        s.started, s.completed,
        "each counted call started and completed"
    );
    assert_eq!(counted.len(), s.completed.len(), "counted once each");
    assert!(timed.is_disjoint(&counted));
    let all: Vec<u64> = timed.union(&counted).copied().collect();
    assert_eq!(all, (SPACED + 1..=SPACED + TIGHT).collect::<Vec<_>>());
    assert_eq!(s.bytes, 8 * counted.len() as u64);
    // A loaded test machine can stretch a window past the limits (and
    // time every call in it), but most of a tight loop goes untimed.
    assert!(
        counted.len() as u64 >= TIGHT / 2,
        "{} of {TIGHT} counted, {} timed",
        counted.len(),
        timed.len()
    );
    assert!(
        timed.len() as u64 >= TIGHT / observe::SAMPLE_EVERY - 1,
        "{}",
        timed.len()
    );
}
