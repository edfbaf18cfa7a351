//! Device operations of a communicator that spans hosts: stream-ordered and
//! asynchronous, through pinned host memory and a progress thread.
//!
//! Ranks of different hosts never map each other's memory (`mapping.rs`),
//! so the kernels cannot run such a communicator. Each call (or a group's
//! operations on it: one *job*) is enqueued on the caller's stream and the
//! call returns at once:
//!
//! 1. the job's device buffers are copied into a pinned, device-mapped
//!    buffer (`pinned.rs`), and the job is marked `ready`;
//! 2. the stream waits for the `done` word (`cuStreamWaitValue32`, GEQ);
//! 3. the written buffers are copied back and the buffer is marked
//!    `released`.
//!
//! A job that writes nothing back (a broadcast's root, a reduce's other
//! ranks, sends alone) has neither 2 nor 3: its stream goes on after its
//! copies in, and its buffer is released by `done`. A single broadcast of
//! 4 MiB and more does 1 and 3 in pieces that overlap its own network part
//! (`pinned_pipe.rs`).
//!
//! The copies and marks are the copy kernel's (`pinned_copy.rs`: for a
//! sliced call one launch for every slice's copies in and out, whose
//! blocks write the words and wait for `done`; a single job's copies out
//! after the stream's wait) or the copy engines' with stream memory
//! operations (`WEFT_CROSSHOST_COPY=engine`, or no kernels in the library).
//!
//! The communicator's progress thread takes jobs in call order (the order
//! every rank issues them in), waits for `ready` (a pipelined job: its
//! first piece; a job that reads nothing from its stream, such as a
//! broadcast's receiving rank, does not wait where nothing times out:
//! [`starts_before_its_stream`]), runs the job's operations
//! on the pinned copies through the communicator's host path (shared memory
//! within a host, TCP between hosts, the host algorithms and their tuner)
//! and writes `done`. The calling thread never waits for the GPU or the
//! network: a 256 MiB all-reduce (4 slices) costs it one launch.
//!
//! **Failures.** A job that fails (a dead peer, `WEFT_TIMEOUT_MS`: the host
//! path's errors name the rank) is recorded as the communicator's async
//! error (and as this side's `kernel_error`, which the next call returns),
//! and `done` is written all the same, so the GPU never waits for ever;
//! later jobs are released without running. An abort (`ncclCommAbort`, the
//! device watch) fires the side's abort word: the thread releases every
//! queued job at once and ends.
//!
//! Groups: one job per communicator; several streams in it join the first
//! (events) and wait for its end. Host-memory operations of a group on such
//! a communicator ride in its job (in order with the device ones).

use super::driver::pointer_device;
use super::driver::use_device;
use super::error::{CudaError, CudaResult, check};
use super::logger::{log, warn};
use super::pinned::{JobFlags, Lease, Pool};
use super::pinned_copy::{Copier, Copies};
use super::pinned_pipe::{Pipe, StreamProgress, log_pipelined_once, pipelines};
use super::pinned_plan::{DeviceCan, HostReduce, Staged, exchanges, reduced_on_host, stage};
use super::proxy_trace::{Phases, trace_job};
use super::staging::device_regions;
use crate::data::reduce;
use crate::data::types::ReduceOp;
use crate::op::Op;
use crate::op::backend::{AbortWord, DeviceSide, HostRunner};
use crate::sys::backoff::Backoff;
use cudarc::driver::sys;
use std::any::Any;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long destroy waits for jobs still queued (their streams must reach
/// them: a destroy before the stream work is a caller's bug, bounded here).
const DRAIN_BOUND: Duration = Duration::from_secs(60);

/// One job as the progress thread sees it.
struct Job {
    seq: u32,
    flags: JobFlags,
    /// The operations on the pinned copies (and host memory).
    ops: Vec<Op>,
    /// A reduction to run on the pinned buffer (at `.0`) after the
    /// operations (`pinned_plan::reduced_on_host`).
    host_reduce: Option<(usize, HostReduce)>,
    /// A pipelined job's stream, piece by piece (`pinned_pipe.rs`).
    progress: Option<Arc<StreamProgress>>,
    /// The job's network part may start before its stream reaches it
    /// ([`starts_before_its_stream`]).
    early: bool,
}

// The operations' pointers are pinned buffers the pool keeps until the
// stream released the job, and the caller's host memory (valid until the
// stream reaches the job: `Backend::run`'s contract).
unsafe impl Send for Job {}

#[derive(Default)]
struct Queue {
    jobs: VecDeque<Job>,
    /// A job is being run (taken from `jobs`, `done` not yet written).
    running: bool,
    /// No more jobs: finalize (after a drain) or an abort.
    closed: bool,
}

/// What the calling threads and the progress thread share.
struct Shared {
    queue: Mutex<Queue>,
    changed: Condvar,
    /// The abort word (`AbortWord` points here; nonzero: aborted).
    abort: Box<AtomicU32>,
    word: Arc<AbortWord>,
    /// Set with `Queue::closed`, readable without the lock: a job waiting
    /// for its stream is released too.
    closing: AtomicBool,
    /// The first failure of a job.
    error: Mutex<Option<String>>,
    runner: Arc<dyn HostRunner>,
    describe: String,
}

impl Drop for Shared {
    fn drop(&mut self) {
        // The word's memory goes with us: later fires must do nothing.
        self.word.retire();
    }
}

fn locked<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Shared {
    fn aborted(&self) -> bool {
        self.abort.load(Ordering::Acquire) != 0
    }

    fn failed(&self) -> bool {
        locked(&self.error).is_some()
    }

    /// Releases every queued job and the one waiting for its stream (their
    /// streams go on; a job already running ends first) and takes no more.
    fn close(&self, q: &mut Queue) {
        q.closed = true;
        self.closing.store(true, Ordering::Release);
        for j in q.jobs.drain(..) {
            j.flags.set_done(j.seq);
        }
        self.changed.notify_all();
    }

    /// Whether a job must be released without running (abort, an earlier
    /// failure, a close).
    fn stopping(&self) -> bool {
        self.aborted() || self.failed() || self.closing.load(Ordering::Acquire)
    }

    /// Waits until the stream made job `job` ready (a pipelined job: its
    /// first piece); false when the job must be released without running.
    fn wait_ready(&self, job: &Job) -> bool {
        // Spin and yield while a small job's copies take microseconds,
        // then sleep in short steps: the thread must not eat a core while
        // the stream is busy elsewhere (`sys/backoff.rs`).
        let mut wait = Backoff::new();
        loop {
            if self.stopping() {
                return false;
            }
            let ready = match &job.progress {
                _ if job.early => true,
                Some(p) => p.started(),
                None => job.flags.ready(job.seq),
            };
            if ready {
                return true;
            }
            wait.snooze();
        }
    }

    /// The progress thread: jobs in call order until closed.
    fn run(self: Arc<Shared>) {
        loop {
            let job = {
                let mut q = locked(&self.queue);
                loop {
                    if self.aborted() {
                        self.close(&mut q);
                    }
                    if let Some(j) = q.jobs.pop_front() {
                        q.running = true;
                        break j;
                    }
                    if q.closed {
                        return;
                    }
                    q = self
                        .changed
                        .wait_timeout(q, Duration::from_millis(20))
                        .unwrap_or_else(|e| e.into_inner())
                        .0;
                }
            };
            let taken = Instant::now();
            if self.wait_ready(&job) {
                let reached = Instant::now();
                // SAFETY: the job's pointers are valid until `done` (above).
                let ran = match &job.progress {
                    Some(p) => unsafe { self.runner.run_progressive(&job.ops, p.clone()) },
                    None => unsafe { self.runner.run(&job.ops) },
                };
                let ran = ran.map(|()| {
                    if let Some((base, r)) = &job.host_reduce {
                        // SAFETY: the buffer holds the job's staged regions.
                        unsafe { reduce_in_pinned(*base, r) };
                    }
                });
                trace_job(
                    &self.describe,
                    (job.seq, job.progress.as_deref()),
                    taken,
                    reached,
                );
                if let Err(e) = ran {
                    warn(&format!(
                        "{}: a device operation across hosts failed: {e}",
                        self.describe
                    ));
                    locked(&self.error).get_or_insert_with(|| e.to_string());
                }
            }
            job.flags.set_done(job.seq);
            let mut q = locked(&self.queue);
            q.running = false;
            self.changed.notify_all();
        }
    }
}

/// A communicator's device side when it spans hosts (see the module docs).
pub struct ProxySide {
    rank: usize,
    nranks: usize,
    /// Hosts the communicator spans (for the log).
    hosts: usize,
    dev: i32,
    /// The smallest slice of a collective cut in slices
    /// (`WEFT_CROSSHOST_SLICE_BYTES`; 0: never cut).
    slice_bytes: usize,
    /// What moves the bytes between device and pinned memory.
    copier: Copier,
    /// Whether a single job overlaps its copies with its network part
    /// where it can (`WEFT_CROSSHOST_PIPELINE`, `pinned_pipe.rs`).
    pipeline: bool,
    /// Jobs that read nothing from their stream may start before it
    /// reaches them: nothing times out on the host path
    /// ([`HostRunner::times_out`], [`starts_before_its_stream`]).
    early: bool,
    seq: u32,
    pool: Pool,
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl ProxySide {
    /// Starts the progress thread of this rank's side on `dev`; the
    /// communicator spans `hosts` hosts; collectives of `slice_bytes` and
    /// more are cut in slices (0: never); `copier` moves the bytes between
    /// device and pinned memory; `pipeline`: a single job may overlap its
    /// copies with its network part.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        rank: usize,
        nranks: usize,
        hosts: usize,
        dev: i32,
        slice_bytes: usize,
        copier: Copier,
        pipeline: bool,
        runner: Arc<dyn HostRunner>,
        describe: String,
    ) -> CudaResult<ProxySide> {
        let early = !runner.times_out();
        let abort = Box::new(AtomicU32::new(0));
        let word = AbortWord::new(abort.as_ptr());
        let shared = Arc::new(Shared {
            queue: Mutex::new(Queue::default()),
            changed: Condvar::new(),
            abort,
            word,
            closing: AtomicBool::new(false),
            error: Mutex::new(None),
            runner,
            describe,
        });
        let s = shared.clone();
        let thread = std::thread::Builder::new()
            .name(format!("weft-xhost-{rank}"))
            .spawn(crate::sys::affinity::placed(move || s.run()))
            .map_err(|e| CudaError::Unsupported(format!("starting the progress thread: {e}")))?;
        Ok(ProxySide {
            rank,
            nranks,
            hosts,
            dev,
            slice_bytes,
            copier,
            pipeline,
            early,
            seq: 0,
            pool: Pool::new(dev),
            shared,
            thread: Some(thread),
        })
    }

    /// Hosts the communicator spans.
    pub fn hosts(&self) -> usize {
        self.hosts
    }

    fn next_seq(&mut self) -> u32 {
        self.seq = self.seq.wrapping_add(1);
        if self.seq == 0 {
            // 0 is every fresh word's value: never a job's.
            self.seq = 1;
        }
        self.seq
    }

    /// Enqueues one call's (or one group's) operations on this communicator
    /// on the stream of its first device operation, as one job or, cut in
    /// slices, several (`pinned_plan.rs`); returns without waiting for the
    /// GPU.
    ///
    /// The stream gets every job's copies in and `ready` first, then every
    /// job's wait for `done` and copies out: slice k+1 is copied in while
    /// slice k is on the network, and slice k is copied out while k+1 is.
    ///
    /// # Safety
    /// As `Backend::run`: the pointers are valid until the stream reaches
    /// the job; the streams are valid streams of this side's device.
    pub unsafe fn enqueue(&mut self, ops: &[Op]) -> CudaResult<()> {
        if let Some(e) = locked(&self.shared.error).clone() {
            return Err(CudaError::Unsupported(format!(
                "an earlier operation across hosts failed: {e}"
            )));
        }
        use_device(self.dev)?;
        let mut phases = Phases::start();
        let (rank, n) = (self.rank, self.nranks);
        let stream = ops
            .iter()
            .find(|o| o.memory != crate::op::Memory::Host)
            .map_or(std::ptr::null_mut(), |o| o.stream) as sys::CUstream;
        let mut others: Vec<sys::CUstream> = Vec::new();
        for o in ops {
            let s = o.stream as sys::CUstream;
            if o.memory != crate::op::Memory::Host && s != stream && !others.contains(&s) {
                others.push(s);
            }
        }
        for &s in &others {
            unsafe { join(stream, s)? };
        }
        let on_device = |p: u64| pointer_device(p as *const std::ffi::c_void).is_some();
        let regions =
            |ops: &[Op]| device_regions(ops.iter().flat_map(|o| o.buffers(rank, n)).collect());
        let can = DeviceCan {
            on_device: &on_device,
            reduce: &exchanges,
        };
        // Where this rank cannot launch a job's reducing kernel, its
        // progress thread reduces (the messages are the same).
        let (copier, dev) = (self.copier, self.dev);
        let (staged, host_reduces): (Vec<Staged>, Vec<Option<HostReduce>>) =
            stage(ops, rank, n, self.slice_bytes, &can, &regions)
                .into_iter()
                .map(|s| match s.reduce_out.as_ref().map(|r| &r.received) {
                    Some(r) if !copier.reduces_here(dev, r.dtype, r.op) => reduced_on_host(s),
                    _ => (s, None),
                })
                .unzip();
        phases.mark("stage");
        // A buffer per job, then every job's copies in and `ready`. Up to
        // the waits nothing the stream does needs the thread; a failure
        // leaves jobs that never run (their buffers are not reused: a
        // stream may still copy).
        let mut jobs: Vec<(Job, Lease, &Staged)> = Vec::with_capacity(staged.len());
        // A job that reads what the one before wrote makes the call's
        // copies go job by job (each job's copies as a call of one job's).
        let one_by_one = staged.iter().any(|s| s.after_previous);
        let per_call = if one_by_one { 1 } else { staged.len() };
        // A single job may overlap its copies with its network part: one
        // sequence number per piece, the last the job's.
        let mut pipe = match staged.as_slice() {
            [s] if self.pipeline
                && self.copier.is_kernel()
                && host_reduces[0].is_none()
                && pipelines(s) =>
            {
                Some(Pipe::new(s.bytes, || self.next_seq()))
            }
            _ => None,
        };
        if let Some(p) = &pipe {
            log_pipelined_once(&self.shared.describe, staged[0].bytes, p.pieces.len());
        }
        for (s, host_reduce) in staged.iter().zip(host_reduces) {
            let seq = match &pipe {
                Some(p) => p.seq(),
                None => self.next_seq(),
            };
            let slots = self.copier.slots_for(s, per_call);
            let shared = &self.shared;
            match self.pool.take(s.bytes, seq, slots, &|| shared.stopping()) {
                Ok(buf) => {
                    let mut job = job_on(s, seq, &buf, host_reduce);
                    job.early = self.early && starts_before_its_stream(s, (rank, n));
                    if let Some(p) = &pipe {
                        let shared = Arc::downgrade(&self.shared);
                        job.progress = Some(Arc::new(StreamProgress::new(
                            buf.flags,
                            p.clone(),
                            s.bytes,
                            !s.to_host.is_empty(),
                            Box::new(move || shared.upgrade().is_none_or(|sh| sh.stopping())),
                        )));
                    }
                    jobs.push((job, buf, s))
                }
                Err(e) => {
                    for &(_, b, _) in &jobs {
                        self.pool.poison(&b);
                    }
                    return Err(e);
                }
            }
        }
        phases.mark("buffers");
        let ins: Vec<(&Staged, &Lease, u32)> = jobs
            .iter()
            .map(|(job, buf, s)| (*s, buf, job.seq))
            .collect();
        // Every job's copies in first (with a sliced call's copies out,
        // where they fit one launch of the copy kernel), then every job's
        // waits and copies out; or job by job.
        let plans: Vec<Copies> = match (pipe.take(), one_by_one) {
            (Some(p), _) => vec![self.copier.pipelined(jobs[0].2, &jobs[0].1, &p)],
            (None, true) => ins.chunks(1).map(|j| self.copier.copies(j)).collect(),
            (None, false) => vec![self.copier.copies(&ins)],
        };
        let loaded = plans.iter().try_for_each(|c| c.load_kernels(self.dev));
        phases.mark("plan");
        let first = loaded.and_then(|()| unsafe { plans[0].enqueue_in(self.dev, stream) });
        if let Err(e) = first {
            for &(_, b, _) in &jobs {
                self.pool.poison(&b);
            }
            return Err(e);
        }
        phases.mark("copies in");
        // Waits and copies out. After the first wait a failure must release
        // every wait itself (no job runs: they are not queued).
        let out = || -> CudaResult<()> {
            for (k, c) in plans.iter().enumerate() {
                if k > 0 {
                    unsafe { c.enqueue_in(self.dev, stream)? };
                }
                unsafe { c.enqueue_out(self.dev, stream)? };
            }
            for &s in &others {
                unsafe { join(s, stream)? };
            }
            Ok(())
        };
        if let Err(e) = out() {
            for (job, buf, _) in &jobs {
                self.pool.poison(buf);
                job.flags.set_done(job.seq);
            }
            return Err(e);
        }
        phases.mark("waits and copies out");
        let njobs = jobs.len();
        let mut q = locked(&self.shared.queue);
        if q.closed || self.shared.aborted() {
            for (job, _, _) in &jobs {
                job.flags.set_done(job.seq);
            }
            return Err(CudaError::Unsupported(
                "the communicator was aborted: its progress thread takes no more work".into(),
            ));
        }
        q.jobs.extend(jobs.into_iter().map(|(job, _, _)| job));
        self.shared.changed.notify_all();
        drop(q);
        phases.mark("queue");
        phases.log(|| format!("{}: enqueue of {njobs} job(s)", self.shared.describe));
        Ok(())
    }

    /// Waits (bounded by `bound`) until every queued job ran; after the
    /// bound, releases what is left (the streams go on, the jobs do not run).
    fn drain_for(&self, bound: Duration) {
        let until = Instant::now() + bound;
        let mut q = locked(&self.shared.queue);
        while !q.jobs.is_empty() || q.running {
            let now = Instant::now();
            if now >= until {
                warn(&format!(
                    "{}: {} device operation(s) across hosts were still queued after {bound:?} (their streams never reached them): released without running",
                    self.shared.describe,
                    q.jobs.len()
                ));
                self.shared.close(&mut q);
                return;
            }
            q = self
                .shared
                .changed
                .wait_timeout(q, until - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

/// Job `seq` of `s` as the progress thread runs it: its operations on the
/// pinned copies in `buf`, then `host_reduce` there.
fn job_on(s: &Staged, seq: u32, buf: &Lease, host_reduce: Option<HostReduce>) -> Job {
    Job {
        seq,
        flags: buf.flags,
        ops: s.host_ops(buf.data as u64),
        host_reduce: host_reduce.map(|r| (buf.data as usize, r)),
        progress: None,
        early: false,
    }
}

/// Whether job `s` (of rank `me.0` of `me.1`) may start its network part
/// as soon as the progress thread takes it, before its stream reaches it:
/// it reads nothing the stream puts in place (no copies in: a broadcast's
/// or a reduce's receiving ranks, receives alone), and every buffer of its
/// operations is device memory staged in its pinned buffer (inside a
/// region of its map: so nothing it writes is the caller's host memory,
/// which only the stream's order may hand over; `stage` asked the driver
/// already, so this asks nothing). Its pinned buffer is free (the pool
/// leases only buffers their stream released) and its copies out still
/// wait for `done`. The receiving rank of a 1 MiB broadcast waited 34-38
/// us per call for its stream (the previous call's copies out) before its
/// receive could start (docs/PERFORMANCE-GPU.md, "Across hosts"); now the
/// two overlap.
fn starts_before_its_stream(s: &Staged, (rank, n): (usize, usize)) -> bool {
    let staged = |ptr: u64, bytes: usize| {
        s.map
            .iter()
            .any(|&(dev, len, _)| ptr >= dev && ptr + bytes as u64 <= dev + len as u64)
    };
    s.to_host.is_empty()
        && s.ops.iter().all(|o| {
            o.memory != crate::op::Memory::Host
                && o.buffers(rank, n).iter().all(|b| staged(b.ptr, b.bytes))
        })
}

/// `r` on the pinned buffer at `base`: this rank's part combined with
/// each received one in turn, an average divided once at the end (as the
/// reducing kernel does).
///
/// # Safety
/// The buffer holds `r`'s regions.
unsafe fn reduce_in_pinned(base: usize, r: &HostReduce) {
    let (into, got) = ((base + r.into) as *mut u8, &r.received);
    for &off in &got.from {
        let from = (base + off) as *const u8;
        unsafe { reduce::combine(got.dtype, got.op.combine(), into, into, from, got.count) };
    }
    if got.op == ReduceOp::Avg {
        unsafe { reduce::divide(got.dtype, into, got.count, got.from.len() + 1) };
    }
}

/// Makes `waiter` wait for the work enqueued on `on` so far (an event).
unsafe fn join(waiter: sys::CUstream, on: sys::CUstream) -> CudaResult<()> {
    let mut ev: sys::CUevent = std::ptr::null_mut();
    unsafe {
        check(
            sys::cuEventCreate(
                &mut ev,
                sys::CUevent_flags_enum::CU_EVENT_DISABLE_TIMING as u32,
            ),
            "cuEventCreate",
        )?;
        let r = check(sys::cuEventRecord(ev, on), "cuEventRecord")
            .and_then(|()| check(sys::cuStreamWaitEvent(waiter, ev, 0), "cuStreamWaitEvent"));
        // Destroying a recorded event is fine: it is released once complete.
        let _ = sys::cuEventDestroy_v2(ev);
        r
    }
}

impl DeviceSide for ProxySide {
    fn device(&self) -> i32 {
        self.dev
    }
    fn kernel_error(&self) -> Option<String> {
        locked(&self.shared.error).clone()
    }
    fn abort(&self) {
        self.shared.word.fire();
    }
    fn abort_word(&self) -> Arc<AbortWord> {
        self.shared.word.clone()
    }
    fn drain(&self) {
        self.drain_for(DRAIN_BOUND);
    }
    fn finalize(mut self: Box<Self>) -> std::result::Result<(), String> {
        self.drain_for(DRAIN_BOUND);
        {
            let mut q = locked(&self.shared.queue);
            self.shared.close(&mut q);
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let pool = std::mem::replace(&mut self.pool, Pool::new(self.dev));
        // The streams' copies back end soon after the last `done`.
        pool.free(Duration::from_secs(10))
            .map_err(|e| e.to_string())
    }
    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}

impl Drop for ProxySide {
    fn drop(&mut self) {
        // Dropped without finalize (after an abort): the thread must still
        // end; the pinned buffers are left to the process's end (a stream
        // may still copy from them).
        {
            let mut q = locked(&self.shared.queue);
            self.shared.close(&mut q);
        }
        std::mem::forget(std::mem::replace(&mut self.pool, Pool::new(self.dev)));
    }
}

/// Logs once per collective how the path runs it (the "tuner" of this
/// path: the host path's own tuner picks the algorithm per operation and
/// logs at `WEFT_DEBUG=INFO`).
pub(super) fn log_choice(describe: impl FnOnce() -> String, op: &Op, hosts: usize) {
    static SEEN: Mutex<Vec<&'static str>> = Mutex::new(Vec::new());
    let mut seen = locked(&SEEN);
    if seen.contains(&op.name()) {
        return;
    }
    seen.push(op.name());
    log(
        false,
        &format!(
            "{}: {} on device memory across {hosts} hosts: stream-ordered through pinned host memory (a single all-reduce, broadcast, reduce, all-gather or reduce-scatter in place on one pinned copy, except on up to 8 ranks an all-gather (this rank's block sent to every other rank, theirs received and copied out) and a reduce-scatter and an all-reduce from 2 MiB unless WEFT_CROSSHOST_REDUCE=host: the other ranks' parts sent and theirs received, reduced with this rank's own on the GPU, an all-reduce's reduced parts then gathered; an all-to-all as sends and receives to the other ranks, its own block copied on the GPU; all-reduce, broadcast, reduce, all-gather, reduce-scatter and sends and receives from twice WEFT_CROSSHOST_SLICE_BYTES cut into slices whose copies overlap the network; a single broadcast from 4 MiB copied in and out in pieces that overlap its own network part unless WEFT_CROSSHOST_PIPELINE=0); the progress thread runs the host algorithm (shared memory within a host, the cross-host engine or TCP between hosts; sends and receives of WEFT_CROSSHOST_MIN_BYTES each over the engine)",
            describe(),
            op.name()
        ),
    );
}

#[cfg(test)]
#[path = "proxy_tests.rs"]
mod tests;
