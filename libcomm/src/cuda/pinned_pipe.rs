//! A device job across hosts whose copies overlap its own network part:
//! the copy kernel puts the input into the pinned buffer in pieces, each
//! piece marked as it lands, and the progress thread's engine sends each
//! chunk once its bytes are there; on the other side the engine tells how
//! far the output is final as chunks arrive, and the copy kernel's blocks
//! copy each piece out once it is (`crosshost/stream_words.rs` translates
//! between the pieces and the engine's chunks).
//!
//! Without it a job's copies in, network part and copies out run one after
//! the other: on 2 x H200 as 2 hosts x 1 a 1 MiB broadcast spent about as
//! long in its two copies as on the network. Slices (`pinned_plan.rs`)
//! overlap them too, but each slice is a job of its own (a wake-up of the
//! progress thread, an engine call, a handshake of the ranks): cut into
//! 256-512 KiB slices, 1-8 MiB broadcasts got slower, not faster.
//!
//! The words: a job takes one sequence number per piece (the last is the
//! job's own). Piece k of the input is in place once every block of the
//! copy kernel wrote piece k's number into its `ready` word (blocks copy
//! the pieces in order); the progress thread writes piece k's number into
//! the job's `done` word once the output's first k + 1 pieces are final,
//! and the block copying piece k waits for that number. The job's own
//! number in `done` (its end, a failure, an abort) releases every piece.
//!
//! Which jobs: a single device broadcast of at least [`MIN_BYTES`] (its
//! input the root's one copy in, its output the others' one copy out, both
//! the whole region), staged whole (not in slices) and copied by the
//! kernel; `WEFT_CROSSHOST_PIPELINE=0` turns it off. The SMs it holds: the
//! copy-out launch's [`SLOTS`](super::pinned::SLOTS) blocks wait for the
//! network from the moment the stream reaches the job, as NCCL's kernels
//! hold their channels' SMs.

use super::logger::log;
use super::pinned::JobFlags;
use super::pinned_plan::{Copy, Staged, slice_count, slices};
use crate::op::OpKind;
use crate::op::backend::JobProgress;
use crate::sys::backoff::Backoff;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::Instant;

/// A broadcast pipelines from this many bytes. Measured on 2 x H200 as 2
/// hosts x 1 (nccl-tests against the same build with
/// `WEFT_CROSSHOST_PIPELINE=0`, several runs in three calls): +19-24% busbw
/// at 4 MiB, +19-22% at 8 MiB, even from 16 MiB, but 9-14% lower at 1-2 MiB
/// with pieces of 256 KiB; pieces of 1 MiB from 2 MiB did no better at 2 MiB
/// (even with it off) and worse at 4-8 MiB. Why small ones lose is not known.
pub(super) const MIN_BYTES: usize = 4 << 20;
/// The smallest piece (a job has at most `pinned_plan::MAX_SLICES`, cut as slices
/// are: `pinned_plan::slices`): each piece costs the kernel's blocks a
/// fence and a word, and the copy out a wait.
const PIECE_BYTES: usize = 256 << 10;

/// Whether `s`, the only job of its call, pipelines.
pub(super) fn pipelines(s: &Staged) -> bool {
    let whole = |c: &[Copy]| c.len() <= 1 && c.iter().all(|c| c.off == 0 && c.bytes == s.bytes);
    matches!(s.ops.as_slice(), [op] if op.kind == OpKind::Broadcast)
        && s.bytes >= MIN_BYTES
        && s.reduce_out.is_none()
        && !s.after_previous
        && whole(&s.to_host)
        && whole(&s.to_device)
}

/// `(offset, bytes)` of the pieces of a job of `bytes`: slices of at
/// least [`PIECE_BYTES`] on page boundaries.
pub(super) fn pieces(bytes: usize) -> Vec<(usize, usize)> {
    slices(bytes, slice_count(bytes, PIECE_BYTES))
}

/// A pipelined job's pieces and their sequence numbers (the last is the
/// job's).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Pipe {
    /// `(offset, bytes, number)` per piece, in order.
    pub pieces: Vec<(usize, usize, u32)>,
}

impl Pipe {
    /// The pieces of a job of `bytes`, numbered by `next` (called once per
    /// piece, in order).
    pub fn new(bytes: usize, mut next: impl FnMut() -> u32) -> Pipe {
        Pipe {
            pieces: pieces(bytes)
                .into_iter()
                .map(|(o, n)| (o, n, next()))
                .collect(),
        }
    }

    /// The job's own number.
    pub fn seq(&self) -> u32 {
        self.pieces.last().map_or(0, |p| p.2)
    }
}

/// How far a pipelined job's stream has gone, as its progress thread
/// reads it (see the module docs).
pub(super) struct StreamProgress {
    flags: JobFlags,
    pipe: Pipe,
    total: usize,
    /// Whether the job puts input into the buffer (else it is all there).
    has_input: bool,
    /// Input pieces already seen in place (the engine asks on every
    /// pass: only the pieces after them are read again).
    seen: AtomicUsize,
    /// Output pieces already released to the stream.
    released: AtomicUsize,
    /// When the input was first whole and each output piece was released
    /// (for `WEFT_DEBUG=TRACE`'s line per job, `trace`).
    input_whole: OnceLock<Instant>,
    released_at: Mutex<Vec<Instant>>,
    /// The job must not wait any longer (an abort, a failure, a close).
    stop: Box<dyn Fn() -> bool + Send + Sync>,
}

impl StreamProgress {
    pub fn new(
        flags: JobFlags,
        pipe: Pipe,
        total: usize,
        has_input: bool,
        stop: Box<dyn Fn() -> bool + Send + Sync>,
    ) -> StreamProgress {
        StreamProgress {
            flags,
            pipe,
            total,
            has_input,
            seen: AtomicUsize::new(0),
            released: AtomicUsize::new(0),
            input_whole: OnceLock::new(),
            released_at: Mutex::new(Vec::new()),
            stop,
        }
    }

    /// When, counted from `from`, the input was whole and each output
    /// piece was released (microseconds; for `WEFT_DEBUG=TRACE`).
    pub fn trace(&self, from: Instant) -> String {
        let us = |t: &Instant| {
            format!(
                "{:.1}",
                t.saturating_duration_since(from).as_secs_f64() * 1e6
            )
        };
        let outs: Vec<String> = self
            .released_at
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .map(us)
            .collect();
        format!(
            "input whole at {} us, output pieces released at [{}] us",
            self.input_whole.get().map_or("-".into(), us),
            outs.join(", ")
        )
    }

    /// Whether the stream has reached the job: its first piece is in
    /// place (a job without input: its launch marked it ready).
    pub fn started(&self) -> bool {
        match self.has_input {
            true => self
                .pipe
                .pieces
                .first()
                .is_none_or(|p| self.flags.ready(p.2)),
            false => self.flags.ready(self.pipe.seq()),
        }
    }
}

impl JobProgress for StreamProgress {
    fn input_ready(&self) -> usize {
        if !self.has_input {
            return self.total;
        }
        let pieces = &self.pipe.pieces;
        let mut k = self.seen.load(Ordering::Acquire);
        while k < pieces.len() && self.flags.ready(pieces[k].2) {
            k += 1;
        }
        self.seen.fetch_max(k, Ordering::AcqRel);
        let ready = k.checked_sub(1).map_or(0, |i| pieces[i].0 + pieces[i].1);
        if ready == self.total {
            self.input_whole.get_or_init(Instant::now);
        }
        ready
    }

    fn wait_input(&self) -> bool {
        let mut wait = Backoff::new();
        while self.input_ready() < self.total {
            if (self.stop)() {
                return false;
            }
            wait.snooze();
        }
        true
    }

    fn output_final(&self, bytes: usize) {
        let k = self
            .pipe
            .pieces
            .iter()
            .take_while(|p| p.0 + p.1 <= bytes)
            .count();
        // Only ever raised (the engine reports growing prefixes).
        if k > self.released.fetch_max(k, Ordering::AcqRel) {
            self.flags.set_done(self.pipe.pieces[k - 1].2);
            let mut at = self.released_at.lock().unwrap_or_else(|e| e.into_inner());
            let now = Instant::now();
            at.resize(k, now);
        }
    }
}

/// Says once per process that a job pipelined.
pub(super) fn log_pipelined_once(describe: &str, bytes: usize, pieces: usize) {
    static SAID: AtomicBool = AtomicBool::new(false);
    if !SAID.swap(true, Ordering::Relaxed) {
        log(
            false,
            &format!(
                "{describe}: a broadcast of {bytes} B across hosts pipelined: copied in and out in {pieces} pieces that overlap its network part (WEFT_CROSSHOST_PIPELINE)"
            ),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::pinned_plan::tests::{DEV, ON_CPU, dev_op, no_regions, p};
    use crate::cuda::pinned_plan::{MAX_SLICES, SLICE_ALIGN, stage};
    use crate::data::types::{DataType, ReduceOp};
    use crate::op::Op;

    #[test]
    fn pieces_cover_the_job_in_order_on_page_boundaries() {
        for bytes in [512 << 10, (1 << 20) + 36, 3 << 20, (64 << 20) - 4] {
            let p = pieces(bytes);
            assert!((2..=MAX_SLICES).contains(&p.len()), "{bytes}: {p:?}");
            assert_eq!(p[0].0, 0);
            assert!(
                p.windows(2)
                    .all(|w| w[0].0 + w[0].1 == w[1].0 && w[1].0 % SLICE_ALIGN == 0)
            );
            assert_eq!(p.last().map(|l| l.0 + l.1), Some(bytes));
        }
        assert_eq!(pieces(100 << 10), [(0, 100 << 10)]);
    }

    #[test]
    fn only_a_whole_broadcast_of_four_mebibytes_and_more_pipelines() {
        let (send, recv) = (DEV, DEV + (1 << 32));
        let staged = |op: Op, rank: usize, slice: usize| {
            stage(&[dev_op(op)], rank, 3, slice, &ON_CPU, &no_regions).remove(0)
        };
        let bcast = |count: usize| Op::broadcast(p(send), p(recv), count, DataType::F32, 1);
        // The root (its copy in) and another rank (its copy out).
        assert!(pipelines(&staged(bcast(1 << 20), 1, 64 << 20)));
        assert!(pipelines(&staged(bcast(1 << 20), 0, 64 << 20)));
        let under = staged(bcast((1 << 20) - 1), 0, 64 << 20);
        assert!(!pipelines(&under), "under 4 MiB");
        // Cut in slices: each slice is a job of its own.
        let sliced = stage(
            &[dev_op(bcast(1 << 21))],
            0,
            3,
            4 << 20,
            &ON_CPU,
            &no_regions,
        );
        assert!(sliced.len() > 1);
        let ar = Op::all_reduce(p(send), p(recv), 1 << 20, DataType::F32, ReduceOp::Sum);
        assert!(!pipelines(&staged(ar, 0, 64 << 20)));
        let mut part = staged(bcast(1 << 20), 0, 64 << 20);
        part.to_device[0].bytes /= 2;
        assert!(!pipelines(&part), "a copy of part of the region");
    }

    /// The pipe of a 1 MiB job whose pieces take the numbers after `last`.
    fn pipe_numbered_after(mut last: u32) -> Pipe {
        Pipe::new(1 << 20, || {
            last += 1;
            last
        })
    }

    /// A header as the kernel and the thread share it.
    fn header() -> Vec<u32> {
        vec![0u32; 512 / 4]
    }

    #[test]
    fn the_input_is_in_place_piece_by_piece_once_every_block_said_so() {
        let mut h = header();
        let flags = JobFlags::with_slots(h.as_mut_ptr(), 4);
        let pipe = pipe_numbered_after(40);
        assert_eq!(pipe.pieces.len(), 4);
        assert_eq!(pipe.seq(), 44);
        let p = StreamProgress::new(flags, pipe, 1 << 20, true, Box::new(|| false));
        assert!(!p.started());
        assert_eq!(p.input_ready(), 0);
        // Blocks 0-2 finished piece 0, block 3 not yet.
        JobFlags::write_slots_for_test(&mut h, 0..3, 41);
        assert_eq!(p.input_ready(), 0);
        JobFlags::write_slots_for_test(&mut h, 3..4, 41);
        assert!(p.started());
        assert_eq!(p.input_ready(), 256 << 10);
        JobFlags::write_slots_for_test(&mut h, 0..4, 43);
        assert_eq!(p.input_ready(), 768 << 10);
        JobFlags::write_slots_for_test(&mut h, 0..4, 44);
        assert_eq!(p.input_ready(), 1 << 20);
        assert!(p.wait_input());
    }

    #[test]
    fn the_output_is_released_piece_by_piece_and_never_lowered() {
        let mut h = header();
        let flags = JobFlags::with_slots(h.as_mut_ptr(), 4);
        let pipe = pipe_numbered_after(0);
        let p = StreamProgress::new(flags, pipe, 1 << 20, false, Box::new(|| false));
        assert_eq!(p.input_ready(), 1 << 20, "no input: all of it is there");
        p.output_final(100);
        assert_eq!(flags.done(), 0, "no piece is whole yet");
        p.output_final(600 << 10);
        assert_eq!(flags.done(), 2);
        p.output_final(300 << 10);
        assert_eq!(flags.done(), 2, "a smaller prefix lowers nothing");
        p.output_final(1 << 20);
        assert_eq!(flags.done(), 4);
    }

    #[test]
    fn a_stopped_job_gives_up_its_wait_for_input() {
        let mut h = header();
        let flags = JobFlags::with_slots(h.as_mut_ptr(), 4);
        let pipe = Pipe::new(1 << 20, || 9);
        let p = StreamProgress::new(flags, pipe, 1 << 20, true, Box::new(|| true));
        assert!(!p.wait_input());
    }
}
