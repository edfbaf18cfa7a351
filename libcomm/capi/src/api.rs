//! Every exported NCCL function. Each `pncclX` is the implementation and
//! `ncclX` calls it, as in NCCL (where `ncclX` is a weak alias of `pncclX`):
//! a profiler that interposes `ncclX` forwards to `pncclX` without recursion.
//!
//! Every call is wrapped so that a panic becomes `ncclInternalError` instead of
//! unwinding into C, and every failure records `ncclGetLastError`'s message
//! (function, communicator, what happened) and logs it with NCCL_DEBUG=WARN.

// Every function here is an FFI entry point whose body works on caller-provided
// pointers, checked for NULL first; marking each dereference would add noise only.
#![allow(
    non_camel_case_types,
    clippy::missing_safety_doc,
    unsafe_op_in_unsafe_fn
)]

use crate::config::{self, NcclConfig, SIM_INFO_MAGIC, SimInfo};
use crate::errors::{
    self, CResult, Fail, IN_PROGRESS, INTERNAL_ERROR, Level, NcclResult, SUCCESS, SYSTEM_ERROR,
};
use crate::group;
use crate::handles::{self, CommEntry, Ended};
use crate::lifecycle::{
    adopt, barrier, do_split, finalized_error, log_ready, register, settle, state_code,
};
use libcomm::{CommState, Communicator, DataType, Memory, Op, ShrinkMode, UniqueId};
use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// `ncclComm_t`: a checked handle (see `handles`), passed as a pointer-sized value.
pub type ncclComm_t = *mut c_void;
pub type cudaStream_t = *mut c_void;

/// `ncclUniqueId`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ncclUniqueId {
    pub internal: [c_char; 128],
}

fn guard(f: impl FnOnce() -> CResult<NcclResult>) -> CResult<NcclResult> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|p| {
        let what = p
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default();
        Err(Fail::new(
            INTERNAL_ERROR,
            format!("internal error (a bug in Weft, please report it): panic: {what}"),
        ))
    })
}

/// Defines `pncclX` (the implementation) and `ncclX` (calling it).
macro_rules! nccl_api {
    ($(#[$m:meta])* fn $name:ident / $pname:ident ( $($a:ident : $t:ty),* $(,)? ) $body:block) => {
        $(#[$m])*
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $pname($($a: $t),*) -> NcclResult {
            let r = guard(|| -> CResult<NcclResult> { #[allow(unused_unsafe)] unsafe { $body } });
            errors::finish(stringify!($name), r)
        }
        #[doc = concat!("`", stringify!($name), "`: see [`", stringify!($pname), "`].")]
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name($($a: $t),*) -> NcclResult {
            unsafe { $pname($($a),*) }
        }
    };
}

fn h(c: ncclComm_t) -> usize {
    c as usize
}

fn non_null<T>(p: *const T, what: &str) -> CResult<()> {
    if p.is_null() {
        return Err(Fail::arg(format!("{what} is NULL")));
    }
    Ok(())
}

fn dtype(d: c_int) -> CResult<DataType> {
    DataType::from_raw(d).map_err(Fail::from)
}

fn rank_arg(v: c_int, what: &str, n: usize) -> CResult<usize> {
    if v < 0 {
        return Err(Fail::arg(format!(
            "{what} {v} is out of range for {n} ranks (valid: 0..={})",
            n.saturating_sub(1)
        )));
    }
    Ok(v as usize)
}

// ---------------------------------------------------------------------------
// Version, ids, errors

nccl_api! {
    /// Writes `NCCL_VERSION_CODE` (22803: the NCCL 2.28 API).
    fn ncclGetVersion / pncclGetVersion(version: *mut c_int) {
        non_null(version, "version")?;
        *version = libcomm::NCCL_COMPAT_VERSION;
        Ok(SUCCESS)
    }
}

nccl_api! {
    /// A fresh id, or with `NCCL_COMM_ID`/`WEFT_BOOTSTRAP` set the job's id,
    /// identical on every rank (rank 0 then serves the bootstrap there).
    fn ncclGetUniqueId / pncclGetUniqueId(unique_id: *mut ncclUniqueId) {
        non_null(unique_id, "uniqueId")?;
        use weft_contract::{env::BootstrapEnv, params::process_env};
        let id = if BootstrapEnv::is_set_in(&process_env) {
            UniqueId::from_env()
        } else {
            UniqueId::new()
        }
        .map_err(Fail::from)?;
        let b = id.to_bytes();
        std::ptr::copy_nonoverlapping(b.as_ptr(), (*unique_id).internal.as_mut_ptr().cast::<u8>(), 128);
        errors::log(Level::Info, &format!("ncclGetUniqueId: bootstrap root {}", id.root_addr()));
        Ok(SUCCESS)
    }
}

/// `ncclGetErrorString`.
#[unsafe(no_mangle)]
pub extern "C" fn pncclGetErrorString(result: NcclResult) -> *const c_char {
    errors::error_string(result)
}
/// `ncclGetErrorString`: see [`pncclGetErrorString`].
#[unsafe(no_mangle)]
pub extern "C" fn ncclGetErrorString(result: NcclResult) -> *const c_char {
    pncclGetErrorString(result)
}

/// `ncclGetLastError`: this thread's last failure message ("" when none);
/// `comm` is accepted for signature compatibility (it may be NULL or dead).
#[unsafe(no_mangle)]
pub extern "C" fn pncclGetLastError(_comm: ncclComm_t) -> *const c_char {
    errors::last_ptr()
}
/// `ncclGetLastError`: see [`pncclGetLastError`].
#[unsafe(no_mangle)]
pub extern "C" fn ncclGetLastError(comm: ncclComm_t) -> *const c_char {
    pncclGetLastError(comm)
}

// ---------------------------------------------------------------------------
// Communicator creation

unsafe fn init_rank(
    out: *mut ncclComm_t,
    nranks: c_int,
    id: &ncclUniqueId,
    rank: c_int,
    config: *const NcclConfig,
) -> CResult<NcclResult> {
    non_null(out, "comm (the ncclComm_t* to fill)")?;
    *out = std::ptr::null_mut();
    if nranks < 1 {
        return Err(Fail::arg(format!("nranks {nranks} must be at least 1")));
    }
    if rank < 0 || rank >= nranks {
        return Err(Fail::arg(format!(
            "rank {rank} is out of range for {nranks} ranks (valid: 0..={})",
            nranks - 1
        )));
    }
    let (cfg, blocking) = config::resolve(config, None)?;
    crate::attach::ensure();
    let bytes: &[u8] = std::slice::from_raw_parts(id.internal.as_ptr().cast(), 128);
    let uid = UniqueId::from_bytes(bytes).map_err(Fail::from)?;
    let (n, r) = (nranks as usize, rank as usize);
    if group::in_group() {
        // Started now in the background; the outermost ncclGroupEnd waits for it.
        let c = Communicator::init_with_config(&uid, n, r, cfg.clone().blocking(false))
            .map_err(Fail::from)?;
        let (hd, e) = register(c, blocking, cfg)?;
        group::add_init(e);
        *out = hd as ncclComm_t;
        return Ok(SUCCESS);
    }
    let c = Communicator::init_with_config(&uid, n, r, cfg.clone())
        .map_err(|e| Fail::from(e).context(format!("rank {rank} of {nranks}")))?;
    let code = state_code(&c);
    let (hd, e) = register(c, blocking, cfg)?;
    // Only blocking communicators (the same choice on every rank, so every
    // rank runs the barrier): a non-blocking one may be ready on some ranks
    // and not others, and its next collective belongs to the application.
    if blocking {
        settle(hd, &e)?;
        log_ready(&e);
    }
    *out = hd as ncclComm_t;
    Ok(code)
}

nccl_api! {
    fn ncclCommInitRank / pncclCommInitRank(comm: *mut ncclComm_t, nranks: c_int, comm_id: ncclUniqueId, rank: c_int) {
        init_rank(comm, nranks, &comm_id, rank, std::ptr::null())
    }
}

nccl_api! {
    /// With `config->blocking == 0` returns `ncclInProgress`; poll
    /// `ncclCommGetAsyncError` until it reports `ncclSuccess` or an error.
    fn ncclCommInitRankConfig / pncclCommInitRankConfig(comm: *mut ncclComm_t, nranks: c_int, comm_id: ncclUniqueId, rank: c_int, config: *mut NcclConfig) {
        init_rank(comm, nranks, &comm_id, rank, config)
    }
}

nccl_api! {
    /// Several ids speed up NCCL's bootstrap at scale; Weft's bootstrap needs
    /// one: `commIds[0]` is used (all `nId` ids must be valid ids).
    fn ncclCommInitRankScalable / pncclCommInitRankScalable(newcomm: *mut ncclComm_t, nranks: c_int, myrank: c_int, n_id: c_int, comm_ids: *mut ncclUniqueId, config: *mut NcclConfig) {
        non_null(comm_ids, "commIds")?;
        if n_id < 1 {
            return Err(Fail::arg(format!("nId {n_id} must be at least 1")));
        }
        for i in 0..n_id as usize {
            let b: &[u8] = std::slice::from_raw_parts((*comm_ids.add(i)).internal.as_ptr().cast(), 128);
            UniqueId::from_bytes(b).map_err(|e| Fail::from(e).context(format!("commIds[{i}]")))?;
        }
        init_rank(newcomm, nranks, &*comm_ids, myrank, config)
    }
}

nccl_api! {
    /// Host mode: `ndev` ranks in this process (one thread each during init);
    /// `devlist` names no devices here and is ignored.
    fn ncclCommInitAll / pncclCommInitAll(comm: *mut ncclComm_t, ndev: c_int, devlist: *const c_int) {
        let _ = devlist;
        non_null(comm, "comm (array of ndev ncclComm_t)")?;
        if ndev < 1 {
            return Err(Fail::arg(format!("ndev {ndev} must be at least 1")));
        }
        crate::attach::ensure();
        let comms = Communicator::init_all(ndev as usize).map_err(Fail::from)?;
        let mut handles_out = Vec::with_capacity(comms.len());
        let mut entries = Vec::with_capacity(comms.len());
        for c in comms {
            c.wait_ready(None).map_err(Fail::from)?;
            let cfg = c.config().clone();
            let (hd, e) = register(c, true, cfg.blocking(true))?;
            log_ready(&e);
            handles_out.push(hd);
            entries.push(e);
        }
        barrier(&entries).inspect_err(|_| {
            for hd in &handles_out {
                if let Ok(e) = handles::remove(*hd, Ended::Destroyed, "the end-of-init barrier") {
                    let _ = e.comm.abort();
                    let _ = e.comm.destroy();
                }
            }
        })?;
        for (i, hd) in handles_out.into_iter().enumerate() {
            *comm.add(i) = hd as ncclComm_t;
        }
        Ok(SUCCESS)
    }
}

/// Makes a communicator with `run` now, writing its handle to `newcomm`;
/// inside ncclGroupStart/End the call is deferred to ncclGroupEnd instead
/// (as NCCL does for split, shrink and grow), which writes the handle then.
unsafe fn make_now_or_at_group_end(
    parent: Option<Arc<CommEntry>>,
    newcomm: *mut ncclComm_t,
    run: impl FnOnce() -> CResult<(usize, NcclResult)> + Send + 'static,
) -> CResult<NcclResult> {
    if group::in_group() {
        group::add_comm(group::PendingComm {
            parent,
            out: newcomm as usize,
            run: Box::new(run),
        });
        return Ok(SUCCESS);
    }
    let (hd, code) = run()?;
    unsafe { *newcomm = hd as ncclComm_t };
    Ok(code)
}

unsafe fn split_impl(
    comm: ncclComm_t,
    color: Option<u32>,
    key: c_int,
    newcomm: *mut ncclComm_t,
    config: *const NcclConfig,
    what: &'static str,
) -> CResult<NcclResult> {
    let parent = handles::get(h(comm), what)?;
    non_null(newcomm, "newcomm")?;
    *newcomm = std::ptr::null_mut();
    let (cfg, blocking) = config::resolve(config, Some(&parent.cfg))?;
    let p = parent.clone();
    make_now_or_at_group_end(Some(parent), newcomm, move || {
        do_split(&p, color, key, cfg, blocking, what)
    })
}

nccl_api! {
    /// Every rank of `comm` must call it. `NCCL_SPLIT_NOCOLOR` (-1) yields NULL.
    /// A NULL config inherits the parent's. With a non-blocking config the
    /// exchange with the parent's ranks completes before returning and the
    /// child may still be initialising: `ncclInProgress`, poll the child.
    /// Allowed on a revoked communicator once this rank is quiescent (see
    /// `ncclCommRevoke`). Inside a group it runs at `ncclGroupEnd`.
    fn ncclCommSplit / pncclCommSplit(comm: ncclComm_t, color: c_int, key: c_int, newcomm: *mut ncclComm_t, config: *mut NcclConfig) {
        let color = match color {
            -1 => None,
            c if c < 0 => {
                return Err(Fail::arg(format!(
                    "color {c} is negative (use a color >= 0, or NCCL_SPLIT_NOCOLOR)"
                )));
            }
            c => Some(c as u32),
        };
        split_impl(comm, color, key, newcomm, config, "ncclCommSplit")
    }
}

/// Makes `parent`'s child with `make` (a shrink or a grow, given the
/// parent's communicator and the child's config, `config` resolved against
/// the parent's) now or at ncclGroupEnd, and registers it.
unsafe fn make_child(
    parent: Arc<CommEntry>,
    newcomm: *mut ncclComm_t,
    config: *const NcclConfig,
    what: &'static str,
    make: impl FnOnce(&Communicator, libcomm::Config) -> libcomm::Result<Communicator> + Send + 'static,
) -> CResult<NcclResult> {
    let (cfg, blocking) = config::resolve(config, Some(&parent.cfg))?;
    let run = {
        let parent = parent.clone();
        move || {
            let child = make(&parent.comm, cfg.clone())
                .map_err(|e| Fail::from(e).context(parent.describe()))?;
            let origin = format!("made from {}", parent.describe());
            adopt(child, blocking, cfg, what, &origin)
        }
    };
    make_now_or_at_group_end(Some(parent), newcomm, run)
}

nccl_api! {
    /// Called by the survivors only: ranks not in `excludeRanksList` form the
    /// new communicator, renumbered in their order; excluded (dead or
    /// departing) ranks never call it. Every caller passes the same list.
    /// The parent may be healthy (`NCCL_SHRINK_DEFAULT`: no operation in
    /// flight on it) or broken by a lost rank (`NCCL_SHRINK_ABORT` revokes it
    /// first, so operations still running anywhere return). A NULL config
    /// inherits the parent's; a non-blocking one returns `ncclInProgress`
    /// with the child still initialising. A survivor that dies meanwhile
    /// fails the others' shrink (`ncclRemoteError`, bounded by
    /// `WEFT_INIT_TIMEOUT_MS`): shrink the parent again without it. Between
    /// `ncclGroupStart` and `ncclGroupEnd` the arguments are checked at once
    /// and the shrink runs at `ncclGroupEnd` (concurrently with the group's
    /// other shrinks, grows and splits of other communicators), which writes
    /// `*newcomm`: one thread can shrink several ranks of one communicator.
    fn ncclCommShrink / pncclCommShrink(comm: ncclComm_t, exclude_ranks_list: *mut c_int, exclude_ranks_count: c_int, newcomm: *mut ncclComm_t, config: *mut NcclConfig, shrink_flags: c_int) {
        let parent = handles::get(h(comm), "ncclCommShrink")?;
        non_null(newcomm, "newcomm")?;
        *newcomm = std::ptr::null_mut();
        let mode = match shrink_flags {
            0 => ShrinkMode::Default,
            1 => ShrinkMode::Abort,
            f => return Err(Fail::arg(format!("shrinkFlags {f:#x} is not NCCL_SHRINK_DEFAULT (0) or NCCL_SHRINK_ABORT (1)"))),
        };
        let n = parent.comm.count();
        if exclude_ranks_count < 0 {
            return Err(Fail::arg(format!("excludeRanksCount {exclude_ranks_count} is negative")));
        }
        if exclude_ranks_count > 0 {
            non_null(exclude_ranks_list, "excludeRanksList")?;
        }
        let mut excluded = Vec::with_capacity(exclude_ranks_count as usize);
        for i in 0..exclude_ranks_count as usize {
            let r = *exclude_ranks_list.add(i);
            if r < 0 || r as usize >= n {
                return Err(Fail::arg(format!(
                    "excludeRanksList[{i}] = {r} is out of range for {n} ranks"
                )));
            }
            excluded.push(r as usize);
        }
        if excluded.contains(&parent.comm.rank()) {
            return Err(Fail::usage(format!(
                "{}: this rank is in excludeRanksList; excluded ranks do not call ncclCommShrink (only the survivors do)",
                parent.describe()
            )));
        }
        make_child(parent, newcomm, config, "ncclCommShrink", move |comm, cfg| {
            comm.shrink(&excluded, Some(cfg), mode)
        })
    }
}

nccl_api! {
    /// Stops the operations in flight on `comm`, on this rank and on every
    /// rank of it (theirs return `ncclRemoteError` naming this rank), and
    /// refuses new ones. `ncclCommGetAsyncError` reports `ncclInProgress`
    /// until this rank is quiescent, then `ncclSuccess`; then only
    /// `ncclCommSplit` (every rank calls it, as any split: the colors are
    /// exchanged on a temporary communicator of all the ranks, not on the
    /// revoked one), `ncclCommShrink` and `ncclCommDestroy`/`ncclCommAbort`
    /// are allowed (`ncclCommFinalize` is refused). A split before this rank
    /// is quiescent returns `ncclInProgress` and makes nothing (`*newcomm`
    /// NULL): split again once `ncclCommGetAsyncError` reads `ncclSuccess`.
    /// `revokeFlags` must be `NCCL_REVOKE_DEFAULT` (0).
    fn ncclCommRevoke / pncclCommRevoke(comm: ncclComm_t, revoke_flags: c_int) {
        let e = handles::get(h(comm), "ncclCommRevoke")?;
        if revoke_flags != 0 {
            return Err(Fail::arg(format!("revokeFlags {revoke_flags:#x} is not NCCL_REVOKE_DEFAULT (0)")));
        }
        e.comm.revoke().map_err(|err| Fail::from(err).context(e.describe()))?;
        errors::log(Level::Warn, &format!("{} revoked", e.describe()));
        Ok(if e.comm.async_error().is_err() { IN_PROGRESS } else { SUCCESS })
    }
}

nccl_api! {
    /// An id for `ncclCommGrow`, whose bootstrap root this process serves.
    /// One at a time: a second call before a grow consumed the first is
    /// `ncclInvalidUsage`.
    fn ncclCommGetUniqueId / pncclCommGetUniqueId(comm: ncclComm_t, unique_id: *mut ncclUniqueId) {
        let e = handles::get(h(comm), "ncclCommGetUniqueId")?;
        non_null(unique_id, "uniqueId")?;
        let id = e.comm.grow_unique_id().map_err(|err| Fail::from(err).context(e.describe()))?;
        let b = id.to_bytes();
        std::ptr::copy_nonoverlapping(b.as_ptr(), (*unique_id).internal.as_mut_ptr().cast::<u8>(), 128);
        Ok(SUCCESS)
    }
}

nccl_api! {
    /// Existing ranks: `comm`, `rank` -1, and `uniqueId` NULL except on the
    /// rank that called `ncclCommGetUniqueId`; they keep their ranks. New
    /// ranks: `comm` NULL, the id, and `rank` from the old size to
    /// `nRanks - 1`. A new rank that never arrives fails the grow with
    /// `ncclRemoteError` after `WEFT_INIT_TIMEOUT_MS` (or at once when the
    /// non-blocking child is aborted); `comm` stays usable. Between
    /// `ncclGroupStart` and `ncclGroupEnd` the arguments are checked at once
    /// and the grow runs at `ncclGroupEnd`, which writes `*newcomm`: one
    /// thread can grow several ranks, existing and new, of one communicator.
    fn ncclCommGrow / pncclCommGrow(comm: ncclComm_t, n_ranks: c_int, unique_id: *const ncclUniqueId, rank: c_int, newcomm: *mut ncclComm_t, config: *mut NcclConfig) {
        non_null(newcomm, "newcomm")?;
        *newcomm = std::ptr::null_mut();
        if n_ranks < 1 {
            return Err(Fail::arg(format!("nRanks {n_ranks} must be at least 1")));
        }
        let uid = if unique_id.is_null() {
            None
        } else {
            let b: &[u8] = std::slice::from_raw_parts((*unique_id).internal.as_ptr().cast(), 128);
            Some(UniqueId::from_bytes(b).map_err(Fail::from)?)
        };
        if comm.is_null() {
            let Some(uid) = uid else {
                return Err(Fail::arg("a new rank (comm NULL) must pass the uniqueId from ncclCommGetUniqueId"));
            };
            if rank < 0 || rank >= n_ranks {
                return Err(Fail::arg(format!("rank {rank} is out of range for {n_ranks} ranks")));
            }
            let (cfg, blocking) = config::resolve(config, None)?;
            crate::attach::ensure();
            let run = move || {
                let c = Communicator::join(&uid, n_ranks as usize, rank as usize, cfg.clone())
                    .map_err(|e| Fail::from(e).context(format!("ncclCommGrow: new rank {rank} of {n_ranks}")))?;
                adopt(c, blocking, cfg, "ncclCommGrow", "made from a unique id")
            };
            return make_now_or_at_group_end(None, newcomm, run);
        }
        let parent = handles::get(h(comm), "ncclCommGrow")?;
        if rank != -1 {
            return Err(Fail::arg(format!(
                "{}: existing ranks pass rank -1 to ncclCommGrow (they keep their ranks), not {rank}",
                parent.describe()
            )));
        }
        make_child(parent, newcomm, config, "ncclCommGrow", move |comm, cfg| {
            comm.grow(n_ranks as usize, uid.as_ref(), Some(cfg))
        })
    }
}

// ---------------------------------------------------------------------------
// Communicator lifecycle and queries

nccl_api! {
    /// Host mode runs every operation to completion before returning, so
    /// there is nothing left to flush: finalize marks the communicator
    /// finalized (later operations are refused) and returns `ncclSuccess`,
    /// also for non-blocking communicators (whose async error then reads
    /// `ncclSuccess`). A failed or aborted communicator (a dead peer, or
    /// the parent that `ncclCommShrink` with `NCCL_SHRINK_ABORT` revoked)
    /// has nothing to flush either: its operations ended with the failure,
    /// which its calls and `ncclCommGetAsyncError` reported. Finalize
    /// accepts it, so a teardown that finalizes then destroys goes through
    /// (torch's `shrink_group` does that to the parent; refused, torch
    /// logged the error with a formatter that imports torch._dynamo: 4.5 s
    /// of the survivors' recovery). Still initializing, or a second
    /// finalize: `ncclInvalidUsage`.
    fn ncclCommFinalize / pncclCommFinalize(comm: ncclComm_t) {
        let e = handles::get(h(comm), "ncclCommFinalize")?;
        let st = e.comm.state();
        if st == CommState::Initializing {
            return Err(Fail::usage(format!(
                "{} is still initializing: poll ncclCommGetAsyncError until ncclSuccess before finalizing",
                e.describe()
            )));
        }
        if e.finalized.swap(true, Ordering::AcqRel) {
            return Err(Fail::usage(format!("{} was already finalized", e.describe())));
        }
        let how = match st {
            CommState::Ready => String::new(),
            st => format!(" ({st}: nothing left to flush; destroy it next)"),
        };
        errors::log(Level::Info, &format!("{} finalized{how}", e.describe()));
        Ok(SUCCESS)
    }
}

nccl_api! {
    /// Frees the communicator; its handle is dead afterwards. A second
    /// destroy, or any use after destroy, is `ncclInvalidArgument` with a
    /// message naming the communicator and when it was destroyed. NULL is
    /// refused too (`ncclInvalidArgument`), stricter than NCCL.
    fn ncclCommDestroy / pncclCommDestroy(comm: ncclComm_t) {
        end_comm(comm, Ended::Destroyed, "ncclCommDestroy")
    }
}

nccl_api! {
    /// Aborts (every other rank's pending and later operations on it fail
    /// with `ncclRemoteError`) and frees the communicator, like NCCL.
    fn ncclCommAbort / pncclCommAbort(comm: ncclComm_t) {
        end_comm(comm, Ended::Aborted, "ncclCommAbort")
    }
}

/// Destroy and abort: the handle dies (`how`), the line is logged, the
/// communicator is aborted (abort only), then freed.
fn end_comm(comm: ncclComm_t, how: Ended, what: &str) -> CResult<NcclResult> {
    let e = handles::remove(h(comm), how, what)?;
    let (level, done) = match how {
        Ended::Destroyed => (Level::Info, "destroyed"),
        Ended::Aborted => (Level::Warn, "aborted by the application"),
    };
    errors::log(level, &format!("{} {done}", e.describe()));
    let in_context = |err: libcomm::Error| Fail::from(err).context(e.describe());
    if how == Ended::Aborted {
        e.comm.abort().map_err(in_context)?;
    }
    e.comm.destroy().map_err(in_context)?;
    Ok(SUCCESS)
}

nccl_api! {
    /// Returns `ncclSuccess` and writes the communicator's state:
    /// `ncclInProgress` while (non-blocking) init/split runs, `ncclSuccess`
    /// when usable, otherwise the error that broke it (also recorded for
    /// `ncclGetLastError`).
    fn ncclCommGetAsyncError / pncclCommGetAsyncError(comm: ncclComm_t, async_error: *mut NcclResult) {
        let e = handles::get(h(comm), "ncclCommGetAsyncError")?;
        non_null(async_error, "asyncError")?;
        *async_error = match e.comm.async_error() {
            Ok(()) => SUCCESS,
            Err(err) => {
                let f = Fail::from(err);
                if f.code != IN_PROGRESS {
                    let msg = format!("ncclCommGetAsyncError: {}: {}", e.describe(), f.msg);
                    errors::set_last(&msg);
                    errors::log(Level::Warn, &msg);
                }
                f.code
            }
        };
        Ok(SUCCESS)
    }
}

nccl_api! {
    fn ncclCommCount / pncclCommCount(comm: ncclComm_t, count: *mut c_int) {
        let e = handles::get(h(comm), "ncclCommCount")?;
        non_null(count, "count")?;
        *count = e.comm.count() as c_int;
        Ok(SUCCESS)
    }
}

nccl_api! {
    fn ncclCommUserRank / pncclCommUserRank(comm: ncclComm_t, rank: *mut c_int) {
        let e = handles::get(h(comm), "ncclCommUserRank")?;
        non_null(rank, "rank")?;
        *rank = e.comm.rank() as c_int;
        Ok(SUCCESS)
    }
}

nccl_api! {
    /// The CUDA device of the communicator's device side (set up by its first
    /// operation on device memory), else the device current on this thread;
    /// `ncclInvalidUsage` in host mode (no CUDA driver loaded).
    fn ncclCommCuDevice / pncclCommCuDevice(comm: ncclComm_t, device: *mut c_int) {
        let e = handles::get(h(comm), "ncclCommCuDevice")?;
        non_null(device, "device")?;
        if let Some(d) = crate::device::comm_device(&e).or_else(libcomm::cuda::current_device) {
            *device = d;
            return Ok(SUCCESS);
        }
        Err(Fail::usage(format!(
            "{} runs in host mode (no CUDA driver loaded in this process), so it has no CUDA device number",
            e.describe()
        )))
    }
}

// ---------------------------------------------------------------------------
// Memory and registration

static ALLOCS: Mutex<Option<HashMap<usize, usize>>> = Mutex::new(None);
const PAGE: usize = 4096;
/// Marks a device allocation in `ALLOCS` (sizes are far below 2^62).
const DEVICE_ALLOC: usize = 1 << 62;

nccl_api! {
    /// Host mode: page-aligned host memory (size rounded up to a page).
    fn ncclMemAlloc / pncclMemAlloc(ptr: *mut *mut c_void, size: usize) {
        non_null(ptr, "ptr")?;
        if size == 0 {
            return Err(Fail::arg("size is 0"));
        }
        let rounded = size
            .checked_add(PAGE - 1)
            .map(|s| s / PAGE * PAGE)
            .filter(|s| *s <= isize::MAX as usize)
            .ok_or_else(|| Fail::arg(format!("size {size} overflows the address space")))?;
        // With CUDA in use (a context current on this thread), NCCL's
        // ncclMemAlloc returns device memory: so does this one.
        if let Some(r) = libcomm::cuda::alloc_current(rounded) {
            let p = r.map_err(|e| Fail::new(crate::errors::UNHANDLED_CUDA_ERROR, format!("ncclMemAlloc({size} bytes): {e}")))?;
            ALLOCS.lock().unwrap_or_else(|e| e.into_inner()).get_or_insert_with(HashMap::new).insert(p as usize, rounded | DEVICE_ALLOC);
            *ptr = p as usize as *mut c_void;
            return Ok(SUCCESS);
        }
        let mut p: *mut c_void = std::ptr::null_mut();
        let r = libc::posix_memalign(&mut p, PAGE, rounded);
        if r != 0 || p.is_null() {
            return Err(Fail::new(SYSTEM_ERROR, format!("posix_memalign({rounded} bytes) failed: {}", std::io::Error::from_raw_os_error(r))));
        }
        ALLOCS.lock().unwrap_or_else(|e| e.into_inner()).get_or_insert_with(HashMap::new).insert(p as usize, rounded);
        *ptr = p;
        Ok(SUCCESS)
    }
}

nccl_api! {
    /// Frees memory from `ncclMemAlloc`; anything else (NULL, a foreign or
    /// already freed pointer) is `ncclInvalidArgument`.
    fn ncclMemFree / pncclMemFree(ptr: *mut c_void) {
        non_null(ptr, "ptr")?;
        let known = ALLOCS.lock().unwrap_or_else(|e| e.into_inner()).get_or_insert_with(HashMap::new).remove(&(ptr as usize));
        let Some(size) = known else {
            return Err(Fail::arg(format!("{ptr:p} was not allocated by ncclMemAlloc (or was already freed)")));
        };
        if size & DEVICE_ALLOC != 0 {
            libcomm::cuda::free(ptr as u64).map_err(|e| Fail::new(crate::errors::UNHANDLED_CUDA_ERROR, format!("ncclMemFree: {e}")))?;
            return Ok(SUCCESS);
        }
        libc::free(ptr);
        Ok(SUCCESS)
    }
}

static NEXT_REG: AtomicU64 = AtomicU64::new(1);
const REG_TAG: u64 = 0x57e6;

nccl_api! {
    /// Host mode needs no registration: the buffer is recorded and an opaque
    /// handle returned (for `ncclCommDeregister`); operations do not need it.
    fn ncclCommRegister / pncclCommRegister(comm: ncclComm_t, buff: *mut c_void, size: usize, handle: *mut *mut c_void) {
        let e = handles::get(h(comm), "ncclCommRegister")?;
        non_null(handle, "handle")?;
        if buff.is_null() && size > 0 {
            return Err(Fail::arg(format!("buff is NULL but size is {size}")));
        }
        let id = NEXT_REG.fetch_add(1, Ordering::Relaxed) & 0xffff_ffff_ffff;
        e.registrations.lock().unwrap_or_else(|e| e.into_inner()).push(id);
        *handle = ((REG_TAG << 48) | id) as usize as *mut c_void;
        Ok(SUCCESS)
    }
}

nccl_api! {
    fn ncclCommDeregister / pncclCommDeregister(comm: ncclComm_t, handle: *mut c_void) {
        let e = handles::get(h(comm), "ncclCommDeregister")?;
        let v = handle as usize as u64;
        let mut regs = e.registrations.lock().unwrap_or_else(|e| e.into_inner());
        let pos = (v >> 48 == REG_TAG)
            .then(|| regs.iter().position(|&r| r == v & 0xffff_ffff_ffff))
            .flatten();
        match pos {
            Some(i) => {
                regs.swap_remove(i);
                Ok(SUCCESS)
            }
            None => Err(Fail::arg(format!(
                "{handle:p} is not a registration of {} (not from ncclCommRegister on it, or already deregistered)",
                e.describe()
            ))),
        }
    }
}

// ---------------------------------------------------------------------------
// Reduction operators

nccl_api! {
    fn ncclRedOpCreatePreMulSum / pncclRedOpCreatePreMulSum(op: *mut c_int, scalar: *mut c_void, datatype: c_int, residence: c_int, comm: ncclComm_t) {
        let e = handles::get(h(comm), "ncclRedOpCreatePreMulSum")?;
        non_null(op, "op")?;
        let dt = dtype(datatype)?;
        *op = e.redops.create(scalar.cast(), dt, residence).map_err(|f| f.context(e.describe()))?;
        Ok(SUCCESS)
    }
}

nccl_api! {
    fn ncclRedOpDestroy / pncclRedOpDestroy(op: c_int, comm: ncclComm_t) {
        let e = handles::get(h(comm), "ncclRedOpDestroy")?;
        e.redops.destroy(op).map_err(|f| f.context(e.describe()))?;
        Ok(SUCCESS)
    }
}

// ---------------------------------------------------------------------------
// Collectives and point-to-point

/// Runs (or, inside a group, records) one operation. Inside a group, any
/// failure (bad handle included) also fails the group's `ncclGroupEnd`.
unsafe fn enqueue(
    stream: cudaStream_t,
    what: &'static str,
    comm: ncclComm_t,
    buffers: &[(*const c_void, &str)],
    build: impl FnOnce(&CommEntry) -> CResult<Op>,
) -> CResult<NcclResult> {
    let r = (|| -> CResult<NcclResult> {
        let e = handles::get(h(comm), what)?;
        let run = || -> CResult<NcclResult> {
            if e.finalized.load(Ordering::Acquire) {
                return Err(finalized_error(&e, what));
            }
            let op = build(&e)?;
            // Nothing to move, in a group or not (NCCL returns at once too;
            // buffers may be NULL).
            if op.is_empty() {
                return Ok(SUCCESS);
            }
            // Device memory makes it a device operation: libcomm's core hands
            // it to the CUDA backend (kernels on `stream`, or staging through
            // host memory); host memory stays on the host path.
            let ptrs: Vec<*const c_void> = buffers.iter().map(|b| b.0).collect();
            let device = crate::device::device_of(&ptrs);
            let op = match device {
                Some(d) => op.on(Memory::Device(d), stream),
                None => op,
            };
            if group::in_group() {
                group::add_op(e.clone(), op, what)?;
                return Ok(SUCCESS);
            }
            if device.is_some() {
                crate::device::route_logs();
                e.comm
                    .submit(op)
                    .map_err(|err| Fail::from(err).context(what))?;
                return Ok(SUCCESS);
            }
            e.comm.submit(op).map_err(Fail::from)?;
            Ok(SUCCESS)
        };
        run().map_err(|f| f.context(e.describe()))
    })();
    if let Err(f) = &r {
        group::record_error(f);
    }
    r
}

nccl_api! {
    fn ncclAllReduce / pncclAllReduce(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: c_int, op: c_int, comm: ncclComm_t, stream: cudaStream_t) {
        enqueue(stream, "ncclAllReduce", comm, &[(sendbuff, "sendbuff"), (recvbuff, "recvbuff")], |e| {
            let dtype = dtype(datatype)?;
            Ok(Op::all_reduce(sendbuff.cast(), recvbuff.cast(), count, dtype, e.redops.resolve(op, dtype, stream as usize)?))
        })
    }
}

nccl_api! {
    fn ncclBroadcast / pncclBroadcast(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: c_int, root: c_int, comm: ncclComm_t, stream: cudaStream_t) {
        enqueue(stream, "ncclBroadcast", comm, &[(sendbuff, "sendbuff"), (recvbuff, "recvbuff")], |e| {
            Ok(Op::broadcast(sendbuff.cast(), recvbuff.cast(), count, dtype(datatype)?, rank_arg(root, "root", e.comm.count())?))
        })
    }
}

nccl_api! {
    /// In-place broadcast (deprecated in NCCL, still exported).
    fn ncclBcast / pncclBcast(buff: *mut c_void, count: usize, datatype: c_int, root: c_int, comm: ncclComm_t, stream: cudaStream_t) {
        enqueue(stream, "ncclBcast", comm, &[(buff, "buff")], |e| {
            Ok(Op::broadcast(buff.cast_const().cast(), buff.cast(), count, dtype(datatype)?, rank_arg(root, "root", e.comm.count())?))
        })
    }
}

nccl_api! {
    fn ncclReduce / pncclReduce(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: c_int, op: c_int, root: c_int, comm: ncclComm_t, stream: cudaStream_t) {
        enqueue(stream, "ncclReduce", comm, &[(sendbuff, "sendbuff"), (recvbuff, "recvbuff")], |e| {
            let dtype = dtype(datatype)?;
            Ok(Op::reduce(sendbuff.cast(), recvbuff.cast(), count, dtype, e.redops.resolve(op, dtype, stream as usize)?, rank_arg(root, "root", e.comm.count())?))
        })
    }
}

nccl_api! {
    fn ncclAllGather / pncclAllGather(sendbuff: *const c_void, recvbuff: *mut c_void, sendcount: usize, datatype: c_int, comm: ncclComm_t, stream: cudaStream_t) {
        enqueue(stream, "ncclAllGather", comm, &[(sendbuff, "sendbuff"), (recvbuff, "recvbuff")], |_| {
            Ok(Op::all_gather(sendbuff.cast(), recvbuff.cast(), sendcount, dtype(datatype)?))
        })
    }
}

nccl_api! {
    fn ncclReduceScatter / pncclReduceScatter(sendbuff: *const c_void, recvbuff: *mut c_void, recvcount: usize, datatype: c_int, op: c_int, comm: ncclComm_t, stream: cudaStream_t) {
        enqueue(stream, "ncclReduceScatter", comm, &[(sendbuff, "sendbuff"), (recvbuff, "recvbuff")], |e| {
            let dtype = dtype(datatype)?;
            Ok(Op::reduce_scatter(sendbuff.cast(), recvbuff.cast(), recvcount, dtype, e.redops.resolve(op, dtype, stream as usize)?))
        })
    }
}

nccl_api! {
    fn ncclAlltoAll / pncclAlltoAll(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: c_int, comm: ncclComm_t, stream: cudaStream_t) {
        enqueue(stream, "ncclAlltoAll", comm, &[(sendbuff, "sendbuff"), (recvbuff, "recvbuff")], |_| {
            Ok(Op::all_to_all(sendbuff.cast(), recvbuff.cast(), count, dtype(datatype)?))
        })
    }
}

nccl_api! {
    fn ncclGather / pncclGather(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: c_int, root: c_int, comm: ncclComm_t, stream: cudaStream_t) {
        enqueue(stream, "ncclGather", comm, &[(sendbuff, "sendbuff"), (recvbuff, "recvbuff")], |e| {
            Ok(Op::gather(sendbuff.cast(), recvbuff.cast(), count, dtype(datatype)?, rank_arg(root, "root", e.comm.count())?))
        })
    }
}

nccl_api! {
    fn ncclScatter / pncclScatter(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: c_int, root: c_int, comm: ncclComm_t, stream: cudaStream_t) {
        enqueue(stream, "ncclScatter", comm, &[(sendbuff, "sendbuff"), (recvbuff, "recvbuff")], |e| {
            Ok(Op::scatter(sendbuff.cast(), recvbuff.cast(), count, dtype(datatype)?, rank_arg(root, "root", e.comm.count())?))
        })
    }
}

nccl_api! {
    fn ncclSend / pncclSend(sendbuff: *const c_void, count: usize, datatype: c_int, peer: c_int, comm: ncclComm_t, stream: cudaStream_t) {
        enqueue(stream, "ncclSend", comm, &[(sendbuff, "sendbuff")], |e| {
            Ok(Op::send(sendbuff.cast(), count, dtype(datatype)?, rank_arg(peer, "peer", e.comm.count())?))
        })
    }
}

nccl_api! {
    fn ncclRecv / pncclRecv(recvbuff: *mut c_void, count: usize, datatype: c_int, peer: c_int, comm: ncclComm_t, stream: cudaStream_t) {
        enqueue(stream, "ncclRecv", comm, &[(recvbuff, "recvbuff")], |e| {
            Ok(Op::recv(recvbuff.cast(), count, dtype(datatype)?, rank_arg(peer, "peer", e.comm.count())?))
        })
    }
}

// ---------------------------------------------------------------------------
// Groups

nccl_api! {
    fn ncclGroupStart / pncclGroupStart() {
        group::start()
    }
}

nccl_api! {
    /// At the outermost level: waits for blocking inits started in the group,
    /// runs deferred splits, then the recorded operations. Returns
    /// `ncclInProgress` while a non-blocking communicator created in the group
    /// is still initialising.
    fn ncclGroupEnd / pncclGroupEnd() {
        group::end(false).map(|(code, _)| code)
    }
}

nccl_api! {
    /// Ends the group like `ncclGroupEnd` but runs none of its operations
    /// (inits and splits do run); `simInfo->estimatedTime` receives a host-mode
    /// estimate in microseconds: 10 µs per operation plus its bytes per rank at
    /// 5 GB/s. `simInfo` must come from `NCCL_SIM_INFO_INITIALIZER`.
    fn ncclGroupSimulateEnd / pncclGroupSimulateEnd(sim_info: *mut SimInfo) {
        non_null(sim_info, "simInfo")?;
        let size = std::ptr::read_unaligned(sim_info.cast::<usize>());
        let magic = (*sim_info).magic;
        if magic != SIM_INFO_MAGIC {
            return Err(Fail::arg(format!("simInfo: magic is {magic:#x}, expected {SIM_INFO_MAGIC:#x}: initialise it with NCCL_SIM_INFO_INITIALIZER")));
        }
        let (code, t) = group::end(true)?;
        if size >= std::mem::offset_of!(SimInfo, estimated_time) + 4 {
            (*sim_info).estimated_time = t;
        }
        Ok(code)
    }
}
