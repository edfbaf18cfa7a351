//! The progress thread's protocol on plain memory (no GPU): the words a
//! stream would write are written by the test.

use super::*;
use crate::cuda::pinned_plan::Received;
use crate::data::types::DataType;
use crate::error::{Error, Result};
use crate::op::backend::JobProgress;

/// Records each job's first count; fails the job whose count is `fail`.
/// A pipelined job's: the input in place when it started, then it
/// waits for the rest and makes the whole output final.
struct Recorder {
    ran: Mutex<Vec<usize>>,
    fail: usize,
}

impl HostRunner for Recorder {
    unsafe fn run(&self, ops: &[Op]) -> Result<()> {
        locked(&self.ran).push(ops[0].count);
        if ops[0].count == self.fail {
            return Err(Error::Remote {
                comm: "test".into(),
                rank: 0,
                detail: "rank 3 went away".into(),
            });
        }
        Ok(())
    }

    unsafe fn run_progressive(&self, ops: &[Op], p: Arc<dyn JobProgress>) -> Result<()> {
        locked(&self.ran).push(p.input_ready());
        assert!(p.wait_input());
        p.output_final(usize::MAX);
        unsafe { self.run(ops) }
    }
}

fn side(fail: usize) -> (ProxySide, Arc<Recorder>) {
    let rec = Arc::new(Recorder {
        ran: Mutex::new(Vec::new()),
        fail,
    });
    let px = ProxySide::new(
        0,
        2,
        2,
        0,
        0,
        Copier::ENGINES,
        true,
        rec.clone(),
        "test".into(),
    )
    .unwrap();
    (px, rec)
}

/// Queues a job of one all-reduce of `count` whose words are `words`.
fn push(px: &mut ProxySide, words: &mut [u32; 4], count: usize) -> (u32, JobFlags) {
    push_reducing(px, words, count, None)
}

/// [`push`] with a reduction on the host after the job's operations.
fn push_reducing(
    px: &mut ProxySide,
    words: &mut [u32; 4],
    count: usize,
    host_reduce: Option<(usize, HostReduce)>,
) -> (u32, JobFlags) {
    let seq = px.next_seq();
    let flags = JobFlags::on(words.as_mut_ptr());
    let op = Op::all_reduce(
        std::ptr::null(),
        std::ptr::null_mut(),
        count,
        DataType::F32,
        ReduceOp::Sum,
    );
    let mut q = locked(&px.shared.queue);
    q.jobs.push_back(Job {
        seq,
        flags,
        ops: vec![op],
        host_reduce,
        progress: None,
        early: false,
    });
    px.shared.changed.notify_all();
    (seq, flags)
}

fn wait_done(f: JobFlags, seq: u32) {
    let until = Instant::now() + Duration::from_secs(10);
    while !super::super::pinned::cyclic_geq(f.done(), seq) {
        assert!(Instant::now() < until, "job {seq} was never released");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Three f32 of this rank's own at offset 0 reduced with `op` with two
/// received parts at 64 and 128.
fn own_and_two_received(op: ReduceOp) -> HostReduce {
    HostReduce {
        into: 0,
        received: Received {
            from: vec![64, 128],
            count: 3,
            dtype: DataType::F32,
            op,
        },
    }
}

/// A job whose rank cannot launch the reducing kernel: after its
/// operations the progress thread combines its own part with each
/// received one in the pinned buffer, an average divided once by the
/// ranks (own + received), as the kernel does; a failed job's is not
/// run (its stream is released, its result is not one).
#[test]
fn a_job_reduced_on_the_host_combines_after_its_operations_and_averages_once() {
    let floats = |v: &[f32]| v.iter().flat_map(|x| x.to_ne_bytes()).collect::<Vec<u8>>();
    // Own part at 0, two received parts at 64 and 128.
    let mut buf = vec![0u8; 192];
    buf[..12].copy_from_slice(&floats(&[1.0, 2.0, -3.0]));
    buf[64..76].copy_from_slice(&floats(&[3.0, 4.0, 5.0]));
    buf[128..140].copy_from_slice(&floats(&[5.0, 6.0, 7.0]));
    let read = |b: &[u8]| -> Vec<f32> {
        b[..12]
            .chunks_exact(4)
            .map(|c| f32::from_ne_bytes(c.try_into().unwrap()))
            .collect()
    };
    for (op, want) in [
        (ReduceOp::Avg, vec![3.0, 4.0, 3.0]),
        (ReduceOp::Max, vec![5.0, 6.0, 7.0]),
    ] {
        let mut b = buf.clone();
        let r = own_and_two_received(op);
        unsafe { reduce_in_pinned(b.as_mut_ptr() as usize, &r) };
        assert_eq!(read(&b), want, "{op:?}");
        assert_eq!(&b[64..76], &buf[64..76], "the received parts are read only");
    }
    // Through the progress thread: run after the operations, not
    // after a failed job.
    let (mut px, rec) = side(10);
    // (A failed job releases the later ones without running them:
    // the one that succeeds goes first.)
    for (count, reduced) in [(20, true), (10, false)] {
        let mut b = buf.clone();
        let mut words = [0u32; 4];
        let host_reduce = own_and_two_received(ReduceOp::Sum);
        let at = b.as_mut_ptr() as usize;
        let (seq, flags) = push_reducing(&mut px, &mut words, count, Some((at, host_reduce)));
        flags.set_ready(seq);
        wait_done(flags, seq);
        let sum = vec![9.0, 12.0, 9.0];
        assert_eq!(read(&b) == sum, reduced, "job of {count}");
        assert!(locked(&rec.ran).contains(&count));
    }
    px.drain();
}

#[test]
fn jobs_run_in_call_order_once_their_stream_made_them_ready() {
    let (mut px, rec) = side(usize::MAX);
    let (mut w1, mut w2) = ([0u32; 4], [0u32; 4]);
    let (s1, f1) = push(&mut px, &mut w1, 10);
    let (s2, f2) = push(&mut px, &mut w2, 20);
    // The second job's stream is ahead: it still waits for the first.
    f2.set_ready(s2);
    std::thread::sleep(Duration::from_millis(50));
    assert!(
        locked(&rec.ran).is_empty(),
        "nothing runs before job 1 is ready"
    );
    assert_eq!(f2.done(), 0);
    f1.set_ready(s1);
    wait_done(f1, s1);
    wait_done(f2, s2);
    assert_eq!(*locked(&rec.ran), vec![10, 20]);
    assert_eq!(px.kernel_error(), None);
    px.drain();
}

#[test]
fn a_failed_job_releases_its_stream_and_every_later_one_without_running_it() {
    let (mut px, rec) = side(10);
    let (mut w1, mut w2) = ([0u32; 4], [0u32; 4]);
    let (s1, f1) = push(&mut px, &mut w1, 10);
    let (s2, f2) = push(&mut px, &mut w2, 20);
    f1.set_ready(s1);
    wait_done(f1, s1);
    // Job 2 is never made ready: released anyway, not run.
    wait_done(f2, s2);
    assert_eq!(*locked(&rec.ran), vec![10]);
    let e = px.kernel_error().expect("the failure is the side's error");
    assert!(e.contains("rank 3"), "{e}");
}

#[test]
fn an_abort_releases_every_queued_job_at_once() {
    let (mut px, rec) = side(usize::MAX);
    let mut words = [[0u32; 4]; 3];
    let jobs: Vec<(u32, JobFlags)> = words.iter_mut().map(|w| push(&mut px, w, 1)).collect();
    // No stream ever reaches them; the device watch (or ncclCommAbort)
    // fires the word.
    let t = Instant::now();
    assert!(px.abort_word().fire());
    for &(s, f) in &jobs {
        wait_done(f, s);
    }
    assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
    assert!(locked(&rec.ran).is_empty());
    // The thread ended: later work is refused and its stream released.
    let t = px.thread.take().unwrap();
    t.join().unwrap();
    assert!(locked(&px.shared.queue).closed);
}

#[test]
fn a_drain_bounded_by_a_stream_that_never_comes_releases_the_jobs() {
    let (mut px, rec) = side(usize::MAX);
    let mut w = [0u32; 4];
    let (s, f) = push(&mut px, &mut w, 7);
    let t = Instant::now();
    px.drain_for(Duration::from_millis(100));
    assert!(t.elapsed() < Duration::from_secs(2));
    wait_done(f, s);
    assert!(locked(&rec.ran).is_empty());
}

/// A pipelined job runs from its first piece on (not its whole
/// input), and its `done` ends at its own number.
#[test]
fn a_pipelined_job_starts_at_its_first_piece() {
    let (mut px, rec) = side(0);
    let mut header = vec![0u32; 128];
    let flags = JobFlags::with_slots(header.as_mut_ptr(), 4);
    let pipe = Pipe::new(1 << 20, || px.next_seq());
    let (first, seq) = (pipe.pieces[0].2, pipe.seq());
    let stop = Box::new(|| false);
    let progress = Arc::new(StreamProgress::new(flags, pipe, 1 << 20, true, stop));
    locked(&px.shared.queue).jobs.push_back(Job {
        seq,
        flags,
        ops: vec![Op::broadcast(
            std::ptr::null(),
            std::ptr::null_mut(),
            1 << 18,
            DataType::F32,
            0,
        )],
        host_reduce: None,
        progress: Some(progress),
        early: false,
    });
    px.shared.changed.notify_all();
    std::thread::sleep(Duration::from_millis(20));
    assert!(
        locked(&rec.ran).is_empty(),
        "ran before the stream reached it"
    );
    JobFlags::write_slots_for_test(&mut header, 0..4, first);
    let until = Instant::now() + Duration::from_secs(10);
    while locked(&rec.ran).is_empty() {
        assert!(Instant::now() < until, "never started");
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(
        *locked(&rec.ran),
        [256 << 10],
        "started with the first piece only"
    );
    JobFlags::write_slots_for_test(&mut header, 0..4, seq);
    wait_done(flags, seq);
    assert_eq!(*locked(&rec.ran), [256 << 10, 1 << 18]);
}

/// A job that reads nothing from its stream runs as soon as the thread
/// takes it, in call order, before its stream made it ready (its
/// stream's copies out still wait for its `done`); the next job, which
/// reads its input from the stream, still waits for `ready`.
#[test]
fn a_job_that_reads_nothing_from_its_stream_starts_before_the_stream_reaches_it() {
    let (mut px, rec) = side(usize::MAX);
    let (mut w1, mut w2) = ([0u32; 4], [0u32; 4]);
    let (s1, f1) = push(&mut px, &mut w1, 10);
    locked(&px.shared.queue).jobs.back_mut().unwrap().early = true;
    let (s2, f2) = push(&mut px, &mut w2, 20);
    wait_done(f1, s1);
    assert!(!f1.ready(s1), "job 1 ran before its stream reached it");
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(*locked(&rec.ran), vec![10], "job 2 waits for its stream");
    f2.set_ready(s2);
    wait_done(f2, s2);
    assert_eq!(*locked(&rec.ran), vec![10, 20]);
    px.drain();
}

/// Which jobs may start before their stream: the ones with no copies
/// in, of calls whose every buffer is device memory; never while the
/// host path may time out (the clock would count the stream's backlog).
#[test]
fn only_jobs_that_copy_nothing_in_from_device_buffers_start_early_and_not_with_a_timeout() {
    use crate::cuda::pinned_plan::tests::{DEV, ON_CPU, dev_op, no_regions, p};
    let bcast = dev_op(Op::broadcast(p(DEV), p(DEV), 1 << 18, DataType::F32, 0));
    let staged = |op: &Op, rank: usize| stage(&[*op], rank, 2, 0, &ON_CPU, &no_regions);
    let early = |op: &Op, rank: usize| {
        staged(op, rank)
            .iter()
            .all(|s| starts_before_its_stream(s, (rank, 2)))
    };
    assert!(early(&bcast, 1), "a broadcast's receiving rank");
    assert!(!early(&bcast, 0), "its root copies its input in");
    let recv = dev_op(Op::recv(p(DEV), 1 << 18, DataType::F32, 0));
    assert!(early(&recv, 1), "a receive alone");
    let send = dev_op(Op::send(p(DEV), 1 << 18, DataType::F32, 1));
    assert!(!early(&send, 0), "a send copies in");
    let ar = dev_op(Op::all_reduce(
        p(DEV),
        p(DEV),
        1 << 18,
        DataType::F32,
        ReduceOp::Sum,
    ));
    assert!(!early(&ar, 0), "an all-reduce copies in");
    // A receive into host memory, or a call with a host-memory op.
    let host_recv = dev_op(Op::recv(p(4096), 1 << 18, DataType::F32, 0));
    let s = stage(&[recv], 1, 2, 0, &ON_CPU, &no_regions);
    let with = |extra: Op| {
        let mut j = s[0].clone();
        j.ops.push(extra);
        starts_before_its_stream(&j, (1, 2))
    };
    assert!(!with(host_recv));
    assert!(!with(Op::recv(p(4096), 16, DataType::F32, 0)));
    // The side starts jobs early only where nothing times out.
    let (px, _) = side(usize::MAX);
    assert!(!px.early, "the Recorder's host path may time out");
    drop(px);
    struct NoTimeout;
    impl HostRunner for NoTimeout {
        unsafe fn run(&self, _: &[Op]) -> Result<()> {
            Ok(())
        }
        fn times_out(&self) -> bool {
            false
        }
    }
    let px = ProxySide::new(
        0,
        2,
        2,
        0,
        0,
        Copier::ENGINES,
        true,
        Arc::new(NoTimeout),
        "t".into(),
    )
    .unwrap();
    assert!(px.early);
}
