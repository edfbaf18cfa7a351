//! The engine's words of one [`CrossHost`](super::CrossHost): its `done`
//! word, and the two words through which a device job's stream and the
//! engine meet chunk by chunk (the cross-host pipeline: `cuda/pinned_pipe.rs`
//! puts the input in place and copies the output out in pieces).
//!
//! The stream's side is a [`JobProgress`] (bytes of input in place, bytes
//! of output final); the schedule's side is counted in chunks
//! (`schedule.rs`: a step reading input chunk j waits for `ready >= base +
//! j + 1`; each landing step raises `landed` by one, in step order). This
//! file translates: while a call of a job runs, [`READY`] reads as the
//! number of input chunks whose bytes are all in place, and every rise of
//! [`LANDED`] tells the job how long the output's final prefix has become.
//! Between such calls (every host collective, and device jobs that do not
//! pipeline) the two words are unused.

use super::flags::{Flags, TERMINAL};
use super::program::Step;
use crate::op::backend::JobProgress;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

/// The word the engine raises when a call is done.
pub const DONE: usize = 0;
/// Input chunks in place (read only).
pub const READY: usize = 1;
/// Output chunks landed (written only).
pub const LANDED: usize = 2;

/// What one pipelined call translates between.
struct Piped {
    progress: Arc<dyn JobProgress>,
    /// `READY`'s value before the call.
    ready_base: u64,
    /// `need[j]`: input bytes (from its start) that chunks 0..=j read,
    /// growing with j.
    need: Vec<usize>,
    /// `LANDED`'s value before the call.
    landed_base: u64,
    /// `finals[k]`: the output's final prefix in bytes once k + 1 landing
    /// steps are done in step order.
    finals: Vec<usize>,
}

/// The words of one engine (see the module docs).
#[derive(Default)]
pub struct StreamWords {
    done: AtomicU64,
    job: Mutex<Option<Piped>>,
}

impl StreamWords {
    fn job(&self) -> MutexGuard<'_, Option<Piped>> {
        self.job.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// From now until [`end`](Self::end), the words stand for `progress`:
    /// `steps` are the call's, scheduled with `ready_base` and
    /// `landed_base`; `input` and `output` are the call-buffer addresses
    /// (and lengths) of the collective's send and receive buffers.
    pub fn begin(
        &self,
        progress: Arc<dyn JobProgress>,
        steps: &[Step],
        bufs: &[usize],
        (ready_base, input): (u64, (usize, usize)),
        (landed_base, output): (u64, (usize, usize)),
    ) {
        let within = |(at, len): (usize, usize), s: &Step| {
            let start = bufs[s.buf] + s.off;
            (
                start.saturating_sub(at).min(len),
                (start + s.len).saturating_sub(at).min(len),
            )
        };
        let mut need: Vec<usize> = Vec::new();
        let mut landings: Vec<(usize, usize)> = Vec::new();
        for s in steps {
            if let Some((READY, v)) = s.ready {
                let j = (v - ready_base - 1) as usize;
                if need.len() <= j {
                    need.resize(j + 1, 0);
                }
                need[j] = need[j].max(within(input, s).1);
            }
            if let Some((LANDED, _)) = s.publish {
                landings.push(within(output, s));
            }
        }
        // Chunk j is ready once every chunk before it is (the words count
        // chunks in order).
        for j in 1..need.len() {
            need[j] = need[j].max(need[j - 1]);
        }
        *self.job() = Some(Piped {
            progress,
            ready_base,
            need,
            landed_base,
            finals: final_prefixes(&landings),
        });
    }

    /// The call is over: the words stand for nothing again.
    pub fn end(&self) {
        *self.job() = None;
    }
}

/// The final prefix of the output after each landing in turn: the longest
/// `[0, x)` that the landed ranges cover together.
fn final_prefixes(landings: &[(usize, usize)]) -> Vec<usize> {
    let mut pending: BTreeMap<usize, usize> = BTreeMap::new();
    let mut prefix = 0;
    landings
        .iter()
        .map(|&(start, end)| {
            if end > start {
                let e = pending.entry(start).or_insert(end);
                *e = (*e).max(end);
            }
            while let Some((&s, &e)) = pending.range(..=prefix).next() {
                pending.remove(&s);
                prefix = prefix.max(e);
            }
            prefix
        })
        .collect()
}

impl Flags for StreamWords {
    fn len(&self) -> usize {
        3
    }

    fn load(&self, w: usize) -> u64 {
        match w {
            DONE => self.done.load(Ordering::Acquire),
            READY => match &*self.job() {
                Some(p) => {
                    let bytes = p.progress.input_ready();
                    p.ready_base + p.need.partition_point(|&n| n <= bytes) as u64
                }
                None => 0,
            },
            _ => 0,
        }
    }

    fn store(&self, w: usize, v: u64) {
        match w {
            DONE => self.done.store(v, Ordering::Release),
            // TERMINAL (a failure, an abort): the job's own end releases
            // its stream (`done`), not a landed count.
            LANDED if v != TERMINAL => {
                if let Some(p) = &*self.job() {
                    let k = v.saturating_sub(p.landed_base) as usize;
                    if let Some(&bytes) = k.checked_sub(1).and_then(|i| p.finals.get(i)) {
                        p.progress.output_final(bytes);
                    }
                }
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crosshost::program::StepOp;
    use std::sync::atomic::AtomicUsize;

    #[derive(Default)]
    struct Seen {
        ready: AtomicUsize,
        finals: Mutex<Vec<usize>>,
    }

    impl JobProgress for Seen {
        fn input_ready(&self) -> usize {
            self.ready.load(Ordering::Acquire)
        }
        fn wait_input(&self) -> bool {
            true
        }
        fn output_final(&self, bytes: usize) {
            self.finals.lock().unwrap().push(bytes);
        }
    }

    fn step(buf: usize, off: usize, len: usize) -> Step {
        Step::new(1, StepOp::Send, buf, off, len)
    }

    #[test]
    fn ready_counts_the_chunks_whose_bytes_are_all_in_place() {
        // Input at address 1000 of call buffer 0 (at 1000), chunks of 100
        // bytes with positions 0..3, the last one short.
        let mut steps: Vec<Step> = (0..4)
            .map(|j| {
                let mut s = step(0, j * 100, if j == 3 { 50 } else { 100 });
                s.ready = Some((READY, 7 + j as u64 + 1));
                s
            })
            .collect();
        // A step that does not read the input waits for nothing.
        steps.push(step(0, 0, 100));
        let seen = Arc::new(Seen::default());
        let w = StreamWords::default();
        w.begin(
            seen.clone(),
            &steps,
            &[1000],
            (7, (1000, 350)),
            (0, (1000, 350)),
        );
        for (bytes, chunks) in [
            (0, 0),
            (99, 0),
            (100, 1),
            (299, 2),
            (300, 3),
            (349, 3),
            (350, 4),
        ] {
            seen.ready.store(bytes, Ordering::Release);
            assert_eq!(w.load(READY), 7 + chunks, "{bytes} bytes in place");
        }
        w.end();
        assert_eq!(w.load(READY), 0, "no job: nothing is ready");
    }

    #[test]
    fn landings_tell_the_final_prefix_even_out_of_order() {
        // Output at 0 of buffer 1 (at 5000): landings of [100, 200), then
        // [0, 100), then [300, 400), then [200, 300).
        let order = [100, 0, 300, 200];
        let steps: Vec<Step> = order
            .iter()
            .enumerate()
            .map(|(k, &off)| {
                let mut s = step(1, off, 100);
                s.publish = Some((LANDED, 40 + k as u64 + 1));
                s
            })
            .collect();
        let seen = Arc::new(Seen::default());
        let w = StreamWords::default();
        w.begin(
            seen.clone(),
            &steps,
            &[0, 5000],
            (0, (0, 0)),
            (40, (5000, 400)),
        );
        for v in 41..=44 {
            w.store(LANDED, v);
        }
        w.store(LANDED, TERMINAL);
        assert_eq!(*seen.finals.lock().unwrap(), [0, 200, 200, 400]);
        w.store(DONE, 9);
        assert_eq!(w.load(DONE), 9);
    }

    #[test]
    fn prefixes_merge_overlapping_and_empty_ranges() {
        assert_eq!(
            final_prefixes(&[(0, 0), (50, 120), (0, 60), (120, 120), (200, 300)]),
            [0, 0, 120, 120, 120]
        );
    }
}
