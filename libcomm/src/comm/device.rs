//! Operations on device memory: one call, or a batch (a group's, host
//! memory included), handed to the device backend (`op/backend.rs`) after
//! every operation's checks; the backend sees the communicators only as
//! [`Comms`] and hands host-memory work back to the host path (`host.rs`).
//! This module is the only one of the core that names `cuda/` (in
//! `device_backend`), and `cuda/` never imports it.

use crate::comm::communicator::Communicator;
use crate::comm::host::run_host;
use crate::comm::shared::CommShared;
use crate::comm::shared::lock;
use crate::error::{Error, Result};
use crate::observe;
use crate::op::backend::{Backend, Comms, DeviceSlot, HostRunner, Item, JobProgress, spans_hosts};
use crate::op::tuner::Decision;
use crate::op::{Memory, Op, OpKind};
use std::mem::ManuallyDrop;
use std::sync::{Arc, MutexGuard, Weak};

/// The backend for device memory: the one place the core names `cuda/`
/// (which never imports this module back).
pub(super) fn device_backend() -> &'static dyn Backend {
    &crate::cuda::CudaBackend
}

/// Runs a batch holding device-memory operations (one call, or a group's
/// operations, host memory included) on the device backend, after the
/// checks of every operation.
///
/// # Safety
/// As [`Backend::run`].
pub(crate) unsafe fn run_device(ops: &[(&Communicator, Op)]) -> Result<()> {
    // TRACE: a per-phase timing further down (the cross-host enqueue's)
    // counts from here, for single calls and groups alike.
    crate::log::mark_call();
    check_all(ops)?;
    // A communicator's first device operation (of any kind: sends and
    // receives too) builds its hierarchy where it has one, then, if it
    // spans hosts, its own cross-host path (whose engine is built by a
    // collective of all its ranks), before anything else of the batch:
    // every rank makes its first device operation at the same point of
    // its calls (`hier.rs`). Later, a send or receive between some of the
    // ranks, or a collective the hierarchy takes whole, may be the first
    // to reach the parent's own device side: set up lazily there, its
    // engine would wait for ranks that never come (a gather's sends on
    // hosts of 1 and 2 ranks timed out so).
    let mut first_seen: Vec<*const Communicator> = Vec::new();
    for &(c, op) in ops {
        if let Memory::Device(dev) = op.memory
            && !op.is_empty()
            && !first_seen.contains(&(c as *const _))
            && matches!(*lock(&c.s.dev), DeviceSlot::Unset)
        {
            first_seen.push(c);
            c.prepare_hierarchy(Some(dev));
            if spans_hosts(&c.s.host_ids()) {
                set_up_device(c, dev)?;
            }
        }
    }
    // A gather or scatter across hosts is the sends and receives it means,
    // so that it goes by host and over the engine's connections as they
    // do (staged whole, its local part would move through host memory).
    // Most batches have none: they are used as they are.
    let expands = |c: &Communicator, op: &Op| {
        matches!(op.kind, OpKind::Gather | OpKind::Scatter)
            && matches!(op.memory, Memory::Device(_))
            && !op.is_empty()
            && spans_hosts(&c.s.host_ids())
    };
    let expanded: Vec<(&Communicator, Op)>;
    let ops = if ops.iter().any(|&(c, op)| expands(c, &op)) {
        expanded = ops
            .iter()
            .flat_map(|&(c, op)| {
                if expands(c, &op) {
                    op.gather_or_scatter_as_sends_and_receives(c.s.rank, c.s.nranks)
                        .into_iter()
                        .map(|o| (c, o))
                        .collect()
                } else {
                    vec![(c, op)]
                }
            })
            .collect();
        &expanded[..]
    } else {
        ops
    };
    // Collectives of communicators spanning hosts with several ranks a
    // host go hierarchical (`hier.rs`), each on its own, enqueued before
    // the rest of the batch on their streams.
    let mut rest = Vec::with_capacity(ops.len());
    let mut first: Option<Error> = None;
    for &(c, op) in ops {
        match unsafe { c.run_hierarchical(&op) } {
            Some(Err(e)) => {
                first.get_or_insert(e);
            }
            Some(Ok(())) => {}
            None => rest.push((c, op)),
        }
    }
    // The sends and receives of such a communicator, as one group each:
    // this host's pieces over its host-local communicator (`hier_p2p.rs`).
    let mut tried: Vec<*const Communicator> = Vec::new();
    let mut taken: Vec<*const Communicator> = Vec::new();
    for &(c, op) in &rest {
        if !is_device_p2p(&op) || tried.contains(&(c as *const _)) {
            continue;
        }
        tried.push(c);
        let group: Vec<Op> = rest
            .iter()
            .filter(|(x, o)| std::ptr::eq(*x, c) && is_device_p2p(o))
            .map(|&(_, o)| o)
            .collect();
        if let Some(r) = unsafe { c.run_hier_p2p(&group) } {
            taken.push(c);
            if let Err(e) = r {
                first.get_or_insert(e);
            }
        }
    }
    rest.retain(|&(c, o)| !(is_device_p2p(&o) && taken.contains(&(c as *const _))));
    let r = if rest.is_empty() {
        Ok(())
    } else {
        unsafe { run_backend(&rest) }
    };
    match first {
        Some(e) => Err(e),
        None => r,
    }
}

/// Sets up `c`'s device side on `dev` now (a collective of `c`: every rank
/// calls it at the same point), as its first device operation would.
pub(super) fn set_up_device(c: &Communicator, dev: i32) -> Result<()> {
    let lent = Lent { comms: vec![c] };
    // SAFETY: `dev` is the device of an operation the caller was given.
    unsafe { device_backend().set_up(&lent, &[(0, dev)]) }
}

/// A send or receive of device memory (what `run_hier_p2p` may take).
fn is_device_p2p(op: &Op) -> bool {
    op.is_send_recv() && matches!(op.memory, Memory::Device(_))
}

/// [`run_device`] without the hierarchy: for the hierarchy's own steps.
///
/// # Safety
/// As [`Backend::run`].
pub(super) unsafe fn run_flat(ops: &[(&Communicator, Op)]) -> Result<()> {
    check_all(ops)?;
    unsafe { run_backend(ops) }
}

/// Every operation's checks, and an earlier failure on the GPU.
fn check_all(ops: &[(&Communicator, Op)]) -> Result<()> {
    for (c, op) in ops {
        c.admit(op)?;
        if let DeviceSlot::On(dc) = &*lock(&c.s.dev)
            && let Some(e) = dc.kernel_error()
        {
            return Err(Error::InvalidUsage(format!(
                "{}: an earlier operation failed on the GPU: {e}",
                c.describe()
            )));
        }
    }
    Ok(())
}

/// Hands the batch to the device backend and watches the communicators
/// that got a device side.
unsafe fn run_backend(ops: &[(&Communicator, Op)]) -> Result<()> {
    let mut lent = Lent { comms: Vec::new() };
    let mut items = Vec::with_capacity(ops.len());
    for (c, op) in ops {
        let i = match lent.comms.iter().position(|x| std::ptr::eq(*x, *c)) {
            Some(i) => i,
            None => {
                lent.comms.push(c);
                lent.comms.len() - 1
            }
        };
        items.push(Item { comm: i, op: *op });
    }
    let r = unsafe { device_backend().run(&lent, &items) };
    for c in &lent.comms {
        if c.s.device_word().is_none() {
            let word = match &*lock(&c.s.dev) {
                DeviceSlot::On(dc) => Some(dc.abort_word()),
                _ => None,
            };
            if let Some(w) = word {
                c.s.watch_device(w);
            }
        }
    }
    r
}

/// Lets device work the backend queued on its own threads for `c` (a
/// communicator spanning hosts: its progress thread) run before a
/// host-memory operation called after it; nothing for kernels. Never waits
/// for the slot: a thread holding it is enqueueing, not running.
pub(crate) fn drain_device_work(c: &Communicator) {
    if let Ok(slot) = c.s.dev.try_lock()
        && let DeviceSlot::On(dc) = &*slot
    {
        dc.drain();
    }
}

/// The communicators of one batch, as a backend sees them ([`Comms`]).
struct Lent<'a> {
    comms: Vec<&'a Communicator>,
}

impl Comms for Lent<'_> {
    fn rank(&self, c: usize) -> usize {
        self.comms[c].s.rank
    }

    fn nranks(&self, c: usize) -> usize {
        self.comms[c].s.nranks
    }

    fn describe(&self, c: usize) -> String {
        self.comms[c].describe()
    }

    fn device_slot(&self, c: usize) -> MutexGuard<'_, DeviceSlot> {
        lock(&self.comms[c].s.dev)
    }

    unsafe fn run_host(&self, items: &[Item]) -> Result<()> {
        let mut ops = Vec::with_capacity(items.len());
        for it in items {
            debug_assert_eq!(it.op.memory, Memory::Host);
            let comm = self.comms[it.comm];
            comm.validate(&it.op)?;
            ops.push((comm, it.op));
        }
        // SAFETY: `Comms::run_host`'s contract (as `Group::push`'s).
        unsafe { run_host(ops) }
    }

    fn host_ids(&self, c: usize) -> Vec<u64> {
        self.comms[c].s.host_ids()
    }

    fn host_runner(&self, c: usize) -> Arc<dyn HostRunner> {
        let comm = self.comms[c];
        // Its thread reports the host parts while this one reports the calls.
        comm.s.meter.reported_from_two_threads();
        // Its thread cannot build the cross-host engine (collectives of the
        // communicator, while it holds a device job): built here, on the
        // caller's thread, at the same call on every rank (the first device
        // operation), when configured.
        comm.prepare_cross_engine(true);
        Arc::new(SharedRunner(Arc::downgrade(&comm.s)))
    }

    fn observed(
        &self,
        c: usize,
        ops: &[Op],
        group: bool,
        decision: Decision,
        f: &mut dyn FnMut() -> Result<()>,
    ) -> Result<()> {
        let obs = observe::start(&self.comms[c].s.who(), ops, group, decision.name());
        let r = f();
        observe::finish(obs, &r);
        r
    }
}

/// The host path of a communicator for the device backend's threads.
struct SharedRunner(Weak<CommShared>);

impl HostRunner for SharedRunner {
    fn times_out(&self) -> bool {
        self.0.upgrade().is_none_or(|s| s.cfg.timeout.is_some())
    }

    unsafe fn run(&self, ops: &[Op]) -> Result<()> {
        let Some(s) = self.0.upgrade() else {
            return Err(Error::Internal(
                "the communicator was destroyed with device work in flight".into(),
            ));
        };
        // A second handle on the same record, which must not destroy it on
        // drop (the user's handle owns the communicator): its reference is
        // given back by hand below.
        let comm = ManuallyDrop::new(Communicator { s });
        let r = ops
            .iter()
            .try_for_each(|op| comm.validate(op))
            .and_then(|()| match ops {
                // A large collective on the cross-host engine, when it was
                // built (`host_runner`).
                [op] if comm.cross_engine_ready_for(op) => comm.run_on_cross_engine(op, true),
                // Sends and receives (a group's, an all-to-all's): the
                // large ones over the engine's connections, then the rest
                // flat (each end splits its pieces alike).
                _ if let Some((on, flat)) = comm.cross_engine_p2p_split(ops) => {
                    // SAFETY: the caller's (HostRunner::run's contract).
                    unsafe { comm.run_p2p_on_cross_engine(&on) }.and_then(|()| {
                        if flat.is_empty() {
                            return Ok(());
                        }
                        // SAFETY: as above.
                        unsafe { run_host(flat.iter().map(|op| (&*comm, *op)).collect()) }
                    })
                }
                // SAFETY: the caller's (HostRunner::run's contract).
                _ => unsafe { run_host(ops.iter().map(|op| (&*comm, *op)).collect()) },
            });
        // SAFETY: read once, and `comm` is never dropped or used again.
        drop(unsafe { std::ptr::read(&comm.s) });
        r
    }

    unsafe fn run_progressive(&self, ops: &[Op], progress: Arc<dyn JobProgress>) -> Result<()> {
        let Some(s) = self.0.upgrade() else {
            return Err(Error::Internal(
                "the communicator was destroyed with device work in flight".into(),
            ));
        };
        // As in `run`: a second handle that must not destroy the record.
        let comm = ManuallyDrop::new(Communicator { s });
        let r = match ops {
            // A collective on the cross-host engine reads its input and
            // lands its output chunk by chunk.
            [op] if comm.validate(op).is_ok() && comm.cross_engine_ready_for(op) => {
                comm.run_on_cross_engine_progressive(op, progress)
            }
            // Anything else runs on the whole input, as `run` does.
            _ if !progress.wait_input() => Ok(()),
            // SAFETY: the caller's (HostRunner::run_progressive's contract).
            _ => unsafe { self.run(ops) },
        };
        // SAFETY: read once, and `comm` is never dropped or used again.
        drop(unsafe { std::ptr::read(&comm.s) });
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::types::{DataType, ReduceOp};

    /// `f(rank, communicator)` on a thread per rank; the results in rank
    /// order.
    fn per_rank<T: Send>(
        comms: &[Communicator],
        f: impl Fn(usize, &Communicator) -> T + Sync,
    ) -> Vec<T> {
        std::thread::scope(|s| {
            let f = &f;
            let hs: Vec<_> = comms
                .iter()
                .enumerate()
                .map(|(r, c)| s.spawn(move || f(r, c)))
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    /// Runs `ops` through `runner` on another thread, as the progress
    /// thread runs a device job's host part.
    ///
    /// # Safety
    /// Every buffer of `ops` lives until this returns.
    unsafe fn run_as_progress_thread(runner: &Arc<dyn HostRunner>, ops: Vec<Op>) -> Result<()> {
        /// The job, as the progress thread gets it.
        struct Job(Vec<Op>);
        // SAFETY: its buffers outlive the thread (joined below).
        unsafe impl Send for Job {}
        let job = Job(ops);
        std::thread::scope(|t| {
            t.spawn(move || {
                let job = job;
                // SAFETY: the caller's.
                unsafe { runner.run(&job.0) }
            })
            .join()
            .unwrap()
        })
    }

    /// What the first device operation of a communicator spanning hosts
    /// does (`cuda/batch.rs`): its host runner, taken on the caller's
    /// thread, builds the cross-host engine when configured, and a large
    /// collective the runner then runs on another thread (the progress
    /// thread's job) goes over the engine. Four ranks in this process on
    /// two simulated hosts (their configurations' host names), created
    /// non-blocking as the C ABI creates those made inside a group
    /// (nccl-tests'): the engine's own host-local split must still be ready
    /// before its first use.
    #[test]
    fn a_host_runner_builds_the_cross_host_engine_for_its_thread() {
        let comms = Communicator::init_on_simulated_hosts(4, 2, |c| {
            crate::config::Config {
                cross_engine_min_bytes: Some(4096),
                // A rank that fails must not leave the others waiting.
                timeout: Some(std::time::Duration::from_secs(20)),
                ..c
            }
            .blocking(false)
        });
        let n = 20_000;
        let outs: Vec<Vec<f32>> = per_rank(&comms, |r, c| {
            let runner = Lent { comms: vec![c] }.host_runner(0);
            let send: Vec<f32> = (0..n).map(|i| ((r + 1) * (i % 7 + 1)) as f32).collect();
            let mut recv = vec![0f32; n];
            let op = Op::all_reduce(
                send.as_ptr().cast(),
                recv.as_mut_ptr().cast(),
                n,
                DataType::F32,
                ReduceOp::Sum,
            );
            assert!(c.cross_engine_ready_for(&op), "rank {r}: no engine");
            let small = Op { count: 16, ..op };
            assert!(!c.cross_engine_ready_for(&small), "under the threshold");
            // SAFETY: both buffers live until it returns.
            unsafe { run_as_progress_thread(&runner, vec![op]) }.unwrap();
            recv
        });
        let want: Vec<f32> = (0..n).map(|i| (10 * (i % 7 + 1)) as f32).collect();
        for (r, out) in outs.iter().enumerate() {
            assert!(out == &want, "rank {r}: wrong sum");
        }
    }

    /// A device job of sends and receives (what a send/recv group or an
    /// all-to-all of device memory across hosts becomes): the progress
    /// thread's runner moves the large pieces over the engine, to the other
    /// host directly and within the host through the engine's host-local
    /// communicator, and the small ones flat; every byte lands where it
    /// should. Four ranks on two simulated hosts, host memory.
    #[test]
    fn a_host_runner_runs_large_sends_and_receives_on_the_engine_and_small_ones_flat() {
        let comms = Communicator::init_on_simulated_hosts(4, 2, |c| crate::config::Config {
            cross_engine_min_bytes: Some(4096),
            // A rank that fails must not leave the others waiting.
            timeout: Some(std::time::Duration::from_secs(20)),
            ..c
        });
        let big = 30_001; // f32: above the threshold
        let small = 17;
        let value = |from: usize, to: usize, i: usize| (from * 1000 + to * 100 + i % 97) as f32;
        let outs: Vec<Vec<Vec<f32>>> = per_rank(&comms, |r, c| {
            let runner = Lent { comms: vec![c] }.host_runner(0);
            // Remote partner (other host), local partner (same host).
            let (remote, local) = ((r + 2) % 4, r ^ 1);
            let plan = [(remote, big), (local, big), (remote, small)];
            let sends: Vec<Vec<f32>> = plan
                .iter()
                .map(|&(to, n)| (0..n).map(|i| value(r, to, i)).collect())
                .collect();
            let mut recvs: Vec<Vec<f32>> = plan.iter().map(|&(_, n)| vec![0f32; n]).collect();
            let mut ops = Vec::new();
            for ((&(peer, n), snd), rcv) in plan.iter().zip(&sends).zip(recvs.iter_mut()) {
                ops.push(Op::send(snd.as_ptr().cast(), n, DataType::F32, peer));
                ops.push(Op::recv(rcv.as_mut_ptr().cast(), n, DataType::F32, peer));
            }
            let (on, flat) = c
                .cross_engine_p2p_split(&ops)
                .unwrap_or_else(|| panic!("rank {r}: no engine part"));
            assert_eq!((on.len(), flat.len()), (4, 2), "rank {r}");
            // SAFETY: every buffer lives until it returns.
            unsafe { run_as_progress_thread(&runner, ops) }.unwrap();
            recvs
        });
        for (r, got) in outs.iter().enumerate() {
            let (remote, local) = ((r + 2) % 4, r ^ 1);
            for (k, &(from, n)) in [(remote, big), (local, big), (remote, small)]
                .iter()
                .enumerate()
            {
                let want: Vec<f32> = (0..n).map(|i| value(from, r, i)).collect();
                assert!(
                    got[k] == want,
                    "rank {r}: piece {k} from rank {from} is wrong"
                );
            }
        }
    }

    /// Unset, a device job's send or receive takes the engine from its own
    /// per-piece threshold, below the collectives' (an all-to-all of 1 MiB
    /// on 2 hosts is two pieces of 512 KiB): a piece of exactly 256 KiB
    /// goes on the engine, one a single element
    /// shorter flat, and both arrive whole. Two ranks on two simulated
    /// hosts, host memory.
    #[test]
    fn device_sends_and_receives_take_the_engine_from_their_own_threshold() {
        // The documented default (`cross_engine::DEVICE_P2P_MIN_BYTES`,
        // named here by value: this file may not import that one).
        const DEVICE_P2P_MIN_BYTES: usize = 256 << 10;
        let comms = Communicator::init_on_simulated_hosts(2, 1, |c| crate::config::Config {
            // The default, whatever the environment says.
            cross_engine_min_bytes: None,
            // A rank that fails must not leave the other waiting.
            timeout: Some(std::time::Duration::from_secs(20)),
            ..c
        });
        let on = DEVICE_P2P_MIN_BYTES / 4; // f32
        let sizes = [on, on - 1];
        let value = |from: usize, k: usize, i: usize| (from * 1000 + k * 100 + i % 89) as f32;
        let outs: Vec<Vec<Vec<f32>>> = per_rank(&comms, |r, c| {
            let runner = Lent { comms: vec![c] }.host_runner(0);
            let peer = 1 - r;
            let sends: Vec<Vec<f32>> = sizes
                .iter()
                .enumerate()
                .map(|(k, &n)| (0..n).map(|i| value(r, k, i)).collect())
                .collect();
            let mut recvs: Vec<Vec<f32>> = sizes.iter().map(|&n| vec![0f32; n]).collect();
            let mut ops = Vec::new();
            for ((&n, snd), rcv) in sizes.iter().zip(&sends).zip(recvs.iter_mut()) {
                ops.push(Op::send(snd.as_ptr().cast(), n, DataType::F32, peer));
                ops.push(Op::recv(rcv.as_mut_ptr().cast(), n, DataType::F32, peer));
            }
            let (engine, flat) = c
                .cross_engine_p2p_split(&ops)
                .unwrap_or_else(|| panic!("rank {r}: no engine part"));
            assert_eq!((engine.len(), flat.len()), (2, 2), "rank {r}");
            assert!(engine.iter().all(|o| o.bytes() == DEVICE_P2P_MIN_BYTES));
            // SAFETY: every buffer lives until it returns.
            unsafe { run_as_progress_thread(&runner, ops) }.unwrap();
            recvs
        });
        for (r, got) in outs.iter().enumerate() {
            for (k, &n) in sizes.iter().enumerate() {
                let want: Vec<f32> = (0..n).map(|i| value(1 - r, k, i)).collect();
                assert!(got[k] == want, "rank {r}: piece {k} is wrong");
            }
        }
    }

    /// A lone large send meets a lone large receive on the engine (the
    /// ranks of one host send, the other host's receive, as a ring's
    /// remote hop is after the hierarchy split it): each end cuts the
    /// message alike although it knows only its own side.
    #[test]
    fn a_lone_send_meets_a_lone_receive_on_the_engine() {
        let comms = Communicator::init_on_simulated_hosts(4, 2, |c| crate::config::Config {
            cross_engine_min_bytes: Some(4096),
            // A rank that fails must not leave the others waiting.
            timeout: Some(std::time::Duration::from_secs(20)),
            ..c
        });
        let n = 3 << 18; // 3 MiB of f32: several chunks
        let outs: Vec<Vec<f32>> = per_rank(&comms, |r, c| {
            let runner = Lent { comms: vec![c] }.host_runner(0);
            let peer = (r + 2) % 4;
            let send: Vec<f32> = (0..n).map(|i| (r * 7 + i % 1009) as f32).collect();
            let mut recv = vec![0f32; n];
            let op = if r < 2 {
                Op::send(send.as_ptr().cast(), n, DataType::F32, peer)
            } else {
                Op::recv(recv.as_mut_ptr().cast(), n, DataType::F32, peer)
            };
            assert!(c.cross_engine_p2p_split(&[op]).is_some(), "rank {r}: flat");
            // SAFETY: both buffers live until it returns.
            unsafe { run_as_progress_thread(&runner, vec![op]) }.unwrap();
            recv
        });
        for (r, got) in outs.iter().enumerate().skip(2) {
            let from = r - 2;
            let want: Vec<f32> = (0..n).map(|i| (from * 7 + i % 1009) as f32).collect();
            assert!(got == &want, "rank {r}: wrong data from rank {from}");
        }
    }

    /// The runner the cross-host path's progress thread uses: host
    /// operations from another thread, on the communicator's host path,
    /// without destroying it when done, and failing once it is gone.
    #[test]
    fn a_host_runner_runs_on_another_thread_and_never_owns_the_communicator() {
        let comms = Communicator::init_all(2).unwrap();
        let runners: Vec<Arc<dyn HostRunner>> = comms
            .iter()
            .map(|c| {
                let lent = Lent { comms: vec![c] };
                lent.host_runner(0)
            })
            .collect();
        let lent = Lent {
            comms: comms.iter().collect(),
        };
        assert_eq!(lent.host_ids(0), lent.host_ids(1), "one process, one host");
        let outs: Vec<[f32; 5]> = std::thread::scope(|s| {
            let hs: Vec<_> = runners
                .iter()
                .enumerate()
                .map(|(r, runner)| {
                    s.spawn(move || {
                        let send = [r as f32 + 1.0; 5];
                        let mut recv = [0f32; 5];
                        let op = Op::all_reduce(
                            send.as_ptr().cast(),
                            recv.as_mut_ptr().cast(),
                            5,
                            DataType::F32,
                            ReduceOp::Sum,
                        );
                        // SAFETY: both buffers live until run returns.
                        unsafe { runner.run(&[op]) }.unwrap();
                        recv
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(outs, vec![[3.0f32; 5]; 2]);
        // The runners' handles did not destroy the communicators.
        for c in &comms {
            assert_eq!(c.state(), crate::state::CommState::Ready);
        }
        drop(lent);
        drop(comms);
        let mut x = [0f32; 1];
        let op = Op::all_reduce(
            x.as_ptr().cast(),
            x.as_mut_ptr().cast(),
            1,
            DataType::F32,
            ReduceOp::Sum,
        );
        let e = unsafe { runners[0].run(&[op]) }.unwrap_err();
        assert!(e.to_string().contains("destroyed"), "{e}");
    }
}
