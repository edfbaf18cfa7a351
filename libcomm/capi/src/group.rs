//! Group semantics of the C ABI (`ncclGroupStart` / `ncclGroupEnd`), per thread.
//!
//! Inside a group (depth > 0):
//! - `ncclCommInitRank*` starts the communicator's bootstrap at once, in the
//!   background (libcomm non-blocking init), and hands out its handle; the
//!   outermost `ncclGroupEnd` waits for the blocking ones (so one thread can
//!   create several ranks, as nccl-tests does) and returns `ncclInProgress`
//!   while a non-blocking one is still initialising.
//! - `ncclCommSplit`, `ncclCommShrink` and `ncclCommGrow` are checked at call
//!   time (a bad argument is refused then), recorded, and run at
//!   `ncclGroupEnd`: in order for one parent, concurrently across parents and
//!   for each new rank of a grow (one thread each), so one thread can
//!   reconfigure several ranks of one communicator, even with a blocking
//!   configuration; `*newcomm` is NULL until then and written then (NULL for
//!   one that failed). With a non-blocking configuration `ncclGroupEnd`
//!   returns `ncclInProgress` while a new communicator still initialises
//!   (poll it with `ncclCommGetAsyncError`).
//! - collectives and send/recv are validated at call time (a bad argument is
//!   refused then, and also makes `ncclGroupEnd` fail and discard the group, as
//!   in NCCL), recorded, and run at `ncclGroupEnd` through libcomm's `Group`:
//!   operations on different communicators run concurrently, sends and
//!   receives within a communicator are fused, so matched pairs never deadlock;
//!   a group holding device memory goes whole to libcomm's device backend.
//!
//! Deferred work is completed only here, at the outermost `ncclGroupEnd` of the
//! thread that recorded it: no other thread ever completes another's group job.

use crate::errors::{CResult, Fail, IN_PROGRESS, NcclResult, SUCCESS};
use crate::handles::CommEntry;
use libcomm::{CommState, Group, Memory, Op, OpKind};
use std::cell::RefCell;
use std::sync::Arc;

/// A split, shrink or grow recorded in a group, run at `ncclGroupEnd`.
pub struct PendingComm {
    /// The communicator it is made from (`None`: a new rank of a grow): the
    /// calls on one parent run in order, on one thread.
    pub parent: Option<Arc<CommEntry>>,
    /// Where to write the new handle (`ncclComm_t*`, as an address).
    pub out: usize,
    /// Makes the communicator: its handle (0 for none, as
    /// `NCCL_SPLIT_NOCOLOR`) and `ncclSuccess` / `ncclInProgress`.
    pub run: Box<dyn FnOnce() -> CResult<(usize, NcclResult)> + Send>,
}

struct PendingOp {
    entry: Arc<CommEntry>,
    /// Its memory kind and stream included.
    op: Op,
    what: &'static str,
}

#[derive(Default)]
struct State {
    depth: u32,
    inits: Vec<Arc<CommEntry>>,
    comms: Vec<PendingComm>,
    ops: Vec<PendingOp>,
    error: Option<Fail>,
}

thread_local! {
    static G: RefCell<State> = RefCell::new(State::default());
}

pub fn in_group() -> bool {
    G.with(|g| g.borrow().depth > 0)
}

pub fn start() -> CResult<NcclResult> {
    G.with(|g| {
        let mut g = g.borrow_mut();
        g.depth = g
            .depth
            .checked_add(1)
            .ok_or_else(|| Fail::usage("ncclGroupStart nested too deeply"))?;
        Ok(SUCCESS)
    })
}

/// Remembers the first error of the group (it fails `ncclGroupEnd`).
pub fn record_error(f: &Fail) {
    G.with(|g| {
        let mut g = g.borrow_mut();
        if g.depth > 0 && g.error.is_none() {
            g.error = Some(f.clone());
        }
    })
}

pub fn add_init(e: Arc<CommEntry>) {
    G.with(|g| g.borrow_mut().inits.push(e))
}

/// Records a split, shrink or grow for `ncclGroupEnd`.
pub fn add_comm(p: PendingComm) {
    G.with(|g| g.borrow_mut().comms.push(p))
}

/// Validates `op` on `entry` now and records it for `ncclGroupEnd`.
///
/// # Safety
/// The op's buffers must stay valid until the group ends.
pub unsafe fn add_op(entry: Arc<CommEntry>, op: Op, what: &'static str) -> CResult<()> {
    op.validate(entry.comm.rank(), entry.comm.count())
        .map_err(Fail::from)?;
    G.with(|g| g.borrow_mut().ops.push(PendingOp { entry, op, what }));
    Ok(())
}

/// `ncclGroupEnd` (and, with `simulate`, `ncclGroupSimulateEnd`: operations are
/// not run, their estimated time in microseconds is returned).
pub fn end(simulate: bool) -> CResult<(NcclResult, f32)> {
    let taken = G.with(|g| {
        let mut g = g.borrow_mut();
        if g.depth == 0 {
            return Err(Fail::usage(
                "ncclGroupEnd without a matching ncclGroupStart on this thread",
            ));
        }
        g.depth -= 1;
        if g.depth > 0 {
            return Ok(None);
        }
        Ok(Some(std::mem::take(&mut *g)))
    })?;
    let Some(st) = taken else {
        return Ok((SUCCESS, 0.0));
    };
    let State {
        inits,
        comms,
        ops,
        error,
        ..
    } = st;
    if let Some(e) = error {
        // NCCL semantics: an error inside the group fails the whole group; nothing runs.
        return Err(Fail::new(
            e.code,
            format!(
                "the group was discarded because a call inside it failed ({}); none of its {} operation(s) ran",
                e.msg,
                ops.len()
            ),
        ));
    }
    let mut first: Option<Fail> = None;
    let mut in_progress = false;

    // 1. Splits, shrinks and grows, concurrently across parents
    //    (sequentially for one parent).
    if !comms.is_empty() {
        match run_comms(comms) {
            Ok(p) => in_progress |= p,
            Err(e) => {
                first.get_or_insert(e);
            }
        }
    }

    // 2. Inits started at call time: wait for the blocking ones, then a
    //    barrier across all of them (concurrently: this thread may hold
    //    several ranks of one communicator).
    let mut ready = Vec::new();
    for e in &inits {
        if e.blocking {
            if let Err(err) = e.comm.wait_ready(None) {
                first.get_or_insert(Fail::from(err).context(e.describe()));
            } else {
                ready.push(e.clone());
            }
        } else if e.comm.state() == CommState::Initializing {
            in_progress = true;
        }
    }
    if first.is_none() {
        match crate::lifecycle::barrier(&ready) {
            Ok(()) => ready.iter().for_each(|e| crate::lifecycle::log_ready(e)),
            Err(e) => {
                first.get_or_insert(e);
            }
        }
    }

    // 3. Operations.
    let mut estimate = 0.0f32;
    if simulate {
        estimate = ops
            .iter()
            .map(|p| estimate_us(p.entry.comm.count(), &p.op))
            .sum();
    } else if !ops.is_empty() && first.is_none() {
        // One group, whatever the memory: libcomm runs a group holding device
        // memory on its device backend (kernels for what it can, host staging
        // + host ops for the rest), a host-only group on the host path.
        let device = ops.iter().any(|p| p.op.memory != Memory::Host);
        if device {
            crate::device::route_logs();
        }
        let whats = || {
            let mut what: Vec<&str> = ops.iter().map(|p| p.what).collect();
            what.dedup();
            what.join(", ")
        };
        let mut g = Group::new();
        let mut bad = None;
        for p in &ops {
            if let Err(e) = unsafe { g.push(&p.entry.comm, p.op) } {
                bad = Some(if device {
                    Fail::from(e).context(whats())
                } else {
                    Fail::from(e).context(format!("{} on {}", p.what, p.entry.describe()))
                });
                break;
            }
        }
        match bad {
            Some(b) => {
                first.get_or_insert(b);
            }
            None => {
                if let Err(e) = g.execute() {
                    let f = if device {
                        Fail::from(e).context(whats())
                    } else {
                        let comms: Vec<String> = ops.iter().map(|p| p.entry.describe()).collect();
                        let mut comms_u = comms.clone();
                        comms_u.dedup();
                        Fail::from(e).context(format!(
                            "group of {} operation(s) on {}",
                            ops.len(),
                            comms_u.join(", ")
                        ))
                    };
                    first.get_or_insert(f);
                }
            }
        }
    }
    match first {
        Some(f) => Err(f),
        None if in_progress => Ok((IN_PROGRESS, estimate)),
        None => Ok((SUCCESS, estimate)),
    }
}

/// A documented cost model for `ncclGroupSimulateEnd` in host mode: each
/// operation costs 10 µs plus its bytes moved per rank at 5 GB/s.
fn estimate_us(nranks: usize, op: &Op) -> f32 {
    let factor = match op.kind {
        OpKind::AllReduce => 2.0,
        OpKind::Broadcast | OpKind::Reduce | OpKind::Send | OpKind::Recv => 1.0,
        OpKind::AllGather
        | OpKind::ReduceScatter
        | OpKind::AllToAll
        | OpKind::Gather
        | OpKind::Scatter => nranks as f64,
    };
    let bytes = op.count as f64 * op.dtype.size() as f64 * factor;
    (10.0 + bytes / 5e9 * 1e6) as f32
}

struct SendPtr(usize);

/// Runs deferred splits, shrinks and grows; returns whether a non-blocking
/// child is still initialising.
fn run_comms(comms: Vec<PendingComm>) -> CResult<bool> {
    // Group by parent, preserving order; each new rank of a grow alone.
    let mut by_parent: Vec<Vec<PendingComm>> = Vec::new();
    for p in comms {
        let same = |v: &Vec<PendingComm>| match (&v[0].parent, &p.parent) {
            (Some(a), Some(b)) => Arc::ptr_eq(a, b),
            _ => false,
        };
        match by_parent.iter_mut().find(|v| same(v)) {
            Some(v) => v.push(p),
            None => by_parent.push(vec![p]),
        }
    }
    let results: Vec<CResult<bool>> = std::thread::scope(|sc| {
        let hs: Vec<_> = by_parent
            .into_iter()
            .map(|v| {
                sc.spawn(move || -> CResult<bool> {
                    let mut pending = false;
                    let mut first = None;
                    for p in v {
                        let out = SendPtr(p.out);
                        match (p.run)() {
                            Ok((h, code)) => {
                                pending |= code == IN_PROGRESS;
                                unsafe { *(out.0 as *mut usize) = h };
                            }
                            Err(e) => {
                                unsafe { *(out.0 as *mut usize) = 0 };
                                first.get_or_insert(e);
                            }
                        }
                    }
                    first.map_or(Ok(pending), Err)
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| {
                    Err(Fail::new(
                        crate::errors::INTERNAL_ERROR,
                        "a thread of ncclGroupEnd making a communicator panicked",
                    ))
                })
            })
            .collect()
    });
    let mut pending = false;
    for r in results {
        pending |= r?;
    }
    Ok(pending)
}

#[allow(dead_code)]
fn assert_send_sync() {
    fn s<T: Send + Sync>() {}
    s::<CommEntry>();
}
