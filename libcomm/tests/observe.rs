//! The observer hook as an observer sees it: calls spaced out are each
//! timed and reported as started/completed events; a tight loop is
//! sampled (one timed call in `SAMPLE_EVERY`, or `SAMPLE_EVERY_VERY_FAST`), the rest are counted in
//! the untimed words the observer lent the communicator; every call is
//! accounted for exactly once. One test: the observer is process-wide.

use libcomm::OpKind;
use libcomm::observe::{
    self, CommEvent, CounterWords, Observer, OpEvent, OpName, Phase, UntimedWords,
};
use libcomm::{Communicator, ReduceOp};
use std::collections::BTreeSet;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex};
use std::time::Duration;

#[derive(Default)]
struct Seen {
    /// (phase, seq, op, has a time) of every event.
    events: Vec<(Phase, u64, &'static str, bool)>,
}

/// The events, and the untimed words lent to the (one) communicator.
#[derive(Default)]
struct Watch {
    seen: Arc<Mutex<Seen>>,
    untimed: Arc<UntimedWords>,
}

impl Observer for Watch {
    fn on_op(&self, ev: &OpEvent<'_>) {
        let stamped = ev.time > std::time::UNIX_EPOCH;
        self.seen
            .lock()
            .unwrap()
            .events
            .push((ev.phase, ev.seq, ev.op, stamped));
    }
    fn on_comm(&self, _: CommEvent) {}
    fn counter(&self, _: &str, _: usize) -> Option<CounterWords> {
        Some(CounterWords::in_memory(self.untimed.clone()))
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
    let watch = Arc::new(Watch::default());
    let (seen, untimed) = (watch.seen.clone(), watch.untimed.clone());
    assert!(observe::set_observer(watch));
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
        assert_eq!(untimed.started.load(Relaxed), 0, "none untimed");
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
    let ar = OpName::from(OpKind::AllReduce).index();
    let counted = untimed.counts[ar][0].load(Relaxed);
    let last_untimed = untimed.completed.load(Relaxed);
    assert_eq!(
        untimed.started.load(Relaxed),
        last_untimed,
        "the last counted call started and completed"
    );
    assert_eq!(untimed.completed_op.load(Relaxed), ar as u64);
    assert!(!timed.contains(&last_untimed) && last_untimed > SPACED);
    // Every call once: timed (its own number) or counted, and the last
    // one of the loop is the last number.
    assert_eq!(timed.len() as u64 + counted, TIGHT);
    assert!(timed.iter().all(|q| *q <= SPACED + TIGHT));
    assert_eq!(
        timed.last().copied().unwrap_or(0).max(last_untimed),
        SPACED + TIGHT
    );
    assert_eq!(untimed.counts[ar][1].load(Relaxed), 8 * counted);
    let others: u64 = (0..OpName::COUNT)
        .filter(|i| *i != ar)
        .map(|i| untimed.counts[i][0].load(Relaxed))
        .sum();
    assert_eq!(others, 0);
    // A loaded test machine can stretch a window past the limits (and
    // time every call in it), but most of a tight loop goes untimed.
    assert!(
        counted >= TIGHT / 2,
        "{counted} of {TIGHT} counted, {} timed",
        timed.len()
    );
    assert!(
        // One in SAMPLE_EVERY, or in SAMPLE_EVERY_VERY_FAST above 500,000
        // calls a second.
        timed.len() as u64 >= TIGHT / observe::SAMPLE_EVERY_VERY_FAST - 1,
        "{}",
        timed.len()
    );
}
