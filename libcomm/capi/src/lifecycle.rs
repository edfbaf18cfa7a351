//! Communicator lifecycle shared by the C ABI's entry points (`api.rs`) and
//! its deferred group work (`group.rs`): registering a new handle, the
//! end-of-init barrier, splitting, the refusal after finalize. Both import
//! this module; it imports neither, so `api` and `group` no longer import
//! each other.

use crate::errors::{self, CResult, Fail, IN_PROGRESS, Level, NcclResult, SUCCESS};
use crate::handles::{self, CommEntry, Ended};
use crate::redop::RedOps;
use libcomm::{CommState, Communicator, Config, DataType, Op};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

pub fn log_ready(e: &CommEntry) {
    errors::log(
        Level::Info,
        &format!(
            "{} is ready ({} rank(s), host mode)",
            e.describe(),
            e.comm.count()
        ),
    );
}

pub fn register(
    comm: Communicator,
    blocking: bool,
    cfg: Config,
) -> CResult<(usize, Arc<CommEntry>)> {
    let entry = CommEntry {
        serial: handles::next_serial(),
        comm,
        blocking,
        cfg,
        finalized: AtomicBool::new(false),
        redops: RedOps::default(),
        registrations: Mutex::new(Vec::new()),
    };
    let hd = handles::insert(entry)?;
    let e = handles::get(hd, "register")?;
    errors::log(
        Level::Info,
        &format!(
            "{} created ({}, handle {hd:#x})",
            e.describe(),
            if blocking { "blocking" } else { "non-blocking" }
        ),
    );
    Ok((hd, e))
}

/// A one-byte all-reduce on each of `comms` (concurrently, so one thread can
/// hold several ranks of one communicator). Run when a blocking init or split
/// completes, like NCCL's end-of-init bootstrap barrier: afterwards every rank
/// has finished connecting, so an immediate `ncclCommDestroy` on one rank can
/// no longer remove shared memory that a slower peer is still about to map
/// (libcomm's `Resources::build` returns before its peers have mapped its
/// segment, and destroy unlinks it; see the capi report).
pub fn barrier(comms: &[Arc<CommEntry>]) -> CResult<()> {
    if comms.is_empty() {
        return Ok(());
    }
    let mut bufs = vec![0u8; comms.len()];
    let mut g = libcomm::Group::new();
    for (e, b) in comms.iter().zip(bufs.iter_mut()) {
        let p = b as *mut u8;
        let op = Op::all_reduce(p, p, 1, DataType::U8, libcomm::ReduceOp::Max);
        unsafe { g.push(&e.comm, op) }.map_err(|err| Fail::from(err).context(e.describe()))?;
    }
    g.execute()
        .map_err(|err| Fail::from(err).context("end-of-init barrier"))
}

/// The barrier for one new blocking communicator; when it fails, the
/// communicator is released (the caller never gets its handle).
pub fn settle(hd: usize, e: &Arc<CommEntry>) -> CResult<()> {
    barrier(std::slice::from_ref(e)).inspect_err(|_| {
        if let Ok(e) = handles::remove(hd, Ended::Destroyed, "the end-of-init barrier") {
            let _ = e.comm.abort();
            let _ = e.comm.destroy();
        }
    })
}

pub fn state_code(c: &Communicator) -> NcclResult {
    if c.state() == CommState::Initializing {
        IN_PROGRESS
    } else {
        SUCCESS
    }
}

/// Splits now (outside a group, or at ncclGroupEnd): returns the child's
/// handle (0 for NCCL_SPLIT_NOCOLOR) and SUCCESS / IN_PROGRESS.
pub fn do_split(
    parent: &Arc<CommEntry>,
    color: Option<u32>,
    key: i32,
    cfg: Config,
    blocking: bool,
    what: &str,
) -> CResult<(usize, NcclResult)> {
    if parent.finalized.load(Ordering::Acquire) {
        return Err(finalized_error(parent, what));
    }
    let child = parent
        .comm
        .split_with_config(color, key, cfg.clone())
        .map_err(|e| {
            let revoking = e.kind() == libcomm::ErrorKind::InProgress;
            let f = Fail::from(e).context(parent.describe());
            if revoking {
                // A revoked communicator not quiescent yet: nothing was made.
                f.context(format!(
                    "{what}: the revoke of this communicator is still in progress (ncclCommGetAsyncError reads ncclInProgress); split again once it reads ncclSuccess"
                ))
            } else {
                f
            }
        })?;
    let Some(c) = child else {
        return Ok((0, SUCCESS));
    };
    adopt(
        c,
        blocking,
        cfg,
        what,
        &format!("split from {}", parent.describe()),
    )
}

/// Registers a communicator made by split, shrink or grow (blocking ones
/// pass the end-of-init barrier, as after init); `origin` ends the log line
/// ("split from ...", "made from ...").
pub fn adopt(
    c: Communicator,
    blocking: bool,
    cfg: Config,
    what: &str,
    origin: &str,
) -> CResult<(usize, NcclResult)> {
    let code = state_code(&c);
    let (hd, e) = register(c, blocking, cfg)?;
    if blocking {
        settle(hd, &e)?;
    }
    errors::log(Level::Info, &format!("{what}: {} {origin}", e.describe()));
    Ok((hd, code))
}

pub fn finalized_error(e: &CommEntry, what: &str) -> Fail {
    Fail::usage(format!(
        "{} was finalized (ncclCommFinalize); {what} is not allowed after finalize, only ncclCommDestroy",
        e.describe()
    ))
}
