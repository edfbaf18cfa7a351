//! The rest of NCCL's exported API (2.28 up to 2.32): every function a real
//! `libnccl.so.2` exports that Weft does not implement yet, so that binaries
//! linked against NCCL (PyTorch among them) load and fall back at run time.
//!
//! - Not implemented: the call returns `ncclInvalidUsage`, sets
//!   `ncclGetLastError` to `"<function>: not supported by Weft yet ..."`, logs
//!   it with NCCL_DEBUG=WARN, and writes none of its output arguments.
//! - Symmetric-memory windows: `ncclCommWindowRegister` succeeds with a NULL
//!   window (what NCCL does where symmetric memory is unavailable), so callers
//!   take their normal path; `ncclCommWindowDeregister(comm, NULL)` succeeds.
//! - `nccl<Collective>Config` (2.32's per-call config): with a NULL config, or
//!   one carrying only tuning hints, it is the plain collective; an algorithm
//!   selection or a launch-completion event is not supported yet.
//! - Device-API host helpers (`ncclDevComm*`, `ncclTeam*`, `ncclGin*`,
//!   `ncclLsa*`, `ncclLLA2A*`, `ncclGet*DevicePointer`, `ncclGet*LeInfo`,
//!   `ncclCommQueryProperties`), declared in NCCL's `nccl_device/` headers,
//!   not in `nccl.h`: exported with the same ABI; the ones returning
//!   `ncclResult_t` are unsupported as above, `ncclTeam*` return an empty team
//!   `{0, 0, 0}` and the `int` ones -1, each setting the last error.
//!
//! Each `ncclX` calls its `pncclX` twin, as in [`crate::api`].

#![allow(non_camel_case_types, clippy::missing_safety_doc)]

use crate::api::{self, cudaStream_t, ncclComm_t};
use crate::errors::{self, Fail, INVALID_ARGUMENT, Level, NcclResult, SUCCESS};
use std::ffi::{c_char, c_int, c_uint, c_void};

/// `ncclWindow_t`: NCCL's opaque window pointer (Weft hands out none).
pub type ncclWindow_t = *mut c_void;

/// `ncclTeam_t`, passed and returned by value: `struct ncclTeam { int nRanks,
/// rank, stride; }` (NCCL's `nccl_device/core.h`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ncclTeam_t {
    pub n_ranks: c_int,
    pub rank: c_int,
    pub stride: c_int,
}

/// `ncclMultimemHandle_t`, passed by value: `struct ncclMultimemHandle { void*
/// mcBasePtr; }` (NCCL's `nccl_device/impl/core__types.h`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ncclMultimemHandle_t {
    pub mc_base_ptr: *mut c_void,
}

/// `ncclCollConfig_t` (v23200), exactly as NCCL 2.32's `nccl.h` lays it out.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ncclCollConfig_t {
    pub size: usize,
    pub magic: c_uint,
    pub version: c_uint,
    pub ext: *mut c_void,
    pub min_ctas: c_int,
    pub max_ctas: c_int,
    pub nvls_ctas: c_int,
    pub cga_cluster_size: c_int,
    pub alg_selection: *const c_char,
    pub force_alg_selection: c_int,
    pub cta_policy: c_int,
    pub user_profiler_tag: u64,
    pub launch_completion_event: *mut c_void,
}

const API_MAGIC: c_uint = 0xcafe_beef;

/// The message every unsupported call leaves in `ncclGetLastError`.
const NOT_SUPPORTED: &str =
    "not supported by Weft yet (see libcomm/capi/README.md, \"Exported, not implemented yet\")";

/// Records `func`'s failure (last error, WARN log) and returns `ncclInvalidUsage`.
pub fn not_supported(func: &str) -> NcclResult {
    errors::finish(func, Err(Fail::usage(NOT_SUPPORTED)))
}

/// Defines `pncclX` returning `ncclInvalidUsage` (nothing written) and `ncclX`
/// calling it.
macro_rules! unsupported {
    ($(fn $name:ident / $pname:ident ( $($a:ident : $t:ty),* $(,)? );)*) => {$(
        #[doc = concat!("`", stringify!($name), "`: not supported by Weft yet: `ncclInvalidUsage`, last error set, outputs untouched.")]
        #[unsafe(no_mangle)]
        #[allow(unused_variables)]
        pub unsafe extern "C" fn $pname($($a: $t),*) -> NcclResult {
            not_supported(stringify!($name))
        }
        #[doc = concat!("`", stringify!($name), "`: see [`", stringify!($pname), "`].")]
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name($($a: $t),*) -> NcclResult {
            unsafe { $pname($($a),*) }
        }
    )*};
}

// Opaque pointer arguments (handles, requirement structs, descriptors) are
// `*mut c_void` / `*const c_void`: the same ABI as NCCL's typed pointers.
unsupported! {
    // Communicator management newer than Weft's implementation.
    fn ncclCommSuspend / pncclCommSuspend(comm: ncclComm_t, flags: c_int);
    fn ncclCommResume / pncclCommResume(comm: ncclComm_t);
    fn ncclCommMemStats / pncclCommMemStats(comm: ncclComm_t, stat: c_int, value: *mut u64);
    fn ncclCommQueryProperties / pncclCommQueryProperties(comm: ncclComm_t, props: *mut c_void);
    fn ncclWinGetUserPtr / pncclWinGetUserPtr(comm: ncclComm_t, win: ncclWindow_t, out_user_ptr: *mut *mut c_void);
    // One-sided operations on windows.
    fn ncclPutSignal / pncclPutSignal(localbuff: *const c_void, count: usize, datatype: c_int, peer: c_int, peer_win: ncclWindow_t, peer_win_offset: usize, sig_idx: c_int, ctx: c_int, flags: c_uint, comm: ncclComm_t, stream: cudaStream_t);
    fn ncclSignal / pncclSignal(peer: c_int, sig_idx: c_int, ctx: c_int, flags: c_uint, comm: ncclComm_t, stream: cudaStream_t);
    fn ncclWaitSignal / pncclWaitSignal(n_desc: c_int, signal_descs: *mut c_void, comm: ncclComm_t, stream: cudaStream_t);
    // Encryption of bootstrap sockets (Weft authenticates with WEFT_JOB_SECRET instead).
    fn ncclSetEncryption / pncclSetEncryption(config: *const c_void);
    // Parameter access.
    fn ncclParamBind / pncclParamBind(out: *mut *mut c_void, key: *const c_char);
    fn ncclParamGetI8 / pncclParamGetI8(h: *mut c_void, out: *mut i8);
    fn ncclParamGetI16 / pncclParamGetI16(h: *mut c_void, out: *mut i16);
    fn ncclParamGetI32 / pncclParamGetI32(h: *mut c_void, out: *mut i32);
    fn ncclParamGetI64 / pncclParamGetI64(h: *mut c_void, out: *mut i64);
    fn ncclParamGetU8 / pncclParamGetU8(h: *mut c_void, out: *mut u8);
    fn ncclParamGetU16 / pncclParamGetU16(h: *mut c_void, out: *mut u16);
    fn ncclParamGetU32 / pncclParamGetU32(h: *mut c_void, out: *mut u32);
    fn ncclParamGetU64 / pncclParamGetU64(h: *mut c_void, out: *mut u64);
    fn ncclParamGetStr / pncclParamGetStr(h: *mut c_void, out: *mut *const c_char);
    fn ncclParamGet / pncclParamGet(h: *mut c_void, out: *mut c_void, max_len: c_int, len: *mut c_int);
    fn ncclParamGetParameter / pncclParamGetParameter(key: *const c_char, value: *mut *const c_char, value_len: *mut c_int);
    fn ncclParamGetAllParameterKeys / pncclParamGetAllParameterKeys(table: *mut *mut *const c_char, table_len: *mut c_int);
    // Device API (nccl_device/*.h): host-side setup of device communicators.
    fn ncclDevCommCreate / pncclDevCommCreate(comm: ncclComm_t, reqs: *const c_void, out_dev_comm: *mut c_void);
    fn ncclDevCommDestroy / pncclDevCommDestroy(comm: ncclComm_t, dev_comm: *const c_void);
    fn ncclGetLsaMultimemDevicePointer / pncclGetLsaMultimemDevicePointer(window: ncclWindow_t, offset: usize, out_ptr: *mut *mut c_void);
    fn ncclGetLsaDevicePointer / pncclGetLsaDevicePointer(window: ncclWindow_t, offset: usize, lsa_rank: c_int, out_ptr: *mut *mut c_void);
    fn ncclGetMultimemDevicePointer / pncclGetMultimemDevicePointer(window: ncclWindow_t, offset: usize, multimem: ncclMultimemHandle_t, out_ptr: *mut *mut c_void);
    fn ncclGetPeerDevicePointer / pncclGetPeerDevicePointer(window: ncclWindow_t, offset: usize, peer: c_int, out_ptr: *mut *mut c_void);
    fn ncclGetMultimemDeviceLeInfo / pncclGetMultimemDeviceLeInfo(window: ncclWindow_t, offset: usize, le_id: *mut u32, le_offset: *mut usize);
    fn ncclGetCftDeviceLeInfo / pncclGetCftDeviceLeInfo(window: ncclWindow_t, offset: usize, peer_cft: c_int, cft_team: ncclTeam_t, le_id: *mut u32, le_offset: *mut usize);
    fn ncclGetPeerDeviceLeInfo / pncclGetPeerDeviceLeInfo(window: ncclWindow_t, offset: usize, peer_world: c_int, le_id: *mut u32, le_offset: *mut usize);
    fn ncclLsaBarrierCreateRequirement / pncclLsaBarrierCreateRequirement(team: ncclTeam_t, n_barriers: c_int, out_handle: *mut c_void, out_req: *mut c_void);
    fn ncclGinBarrierCreateRequirement / pncclGinBarrierCreateRequirement(comm: ncclComm_t, team: ncclTeam_t, n_barriers: c_int, out_handle: *mut c_void, out_req: *mut c_void);
    fn ncclGinOutboxCreateRequirement / pncclGinOutboxCreateRequirement(n_blocks: c_int, size_log2: c_int, out_handle: *mut c_void, out_req: *mut c_void);
    fn ncclGinInboxA2ACreateRequirement / pncclGinInboxA2ACreateRequirement(peers: ncclTeam_t, n_blocks: c_int, size_log2: c_int, out_handle: *mut c_void, out_req: *mut c_void);
    fn ncclLLA2ACreateRequirement / pncclLLA2ACreateRequirement(n_blocks: c_int, n_slots: c_int, out_handle: *mut c_void, out_req: *mut c_void);
}

// ---------------------------------------------------------------------------
// Symmetric-memory windows: a NULL window, so callers fall back.

/// `ncclCommWindowRegister`: Weft has no symmetric-memory windows yet; like
/// NCCL where symmetric memory is unavailable, `*win` is set to NULL and the
/// call succeeds, so callers (PyTorch) take their non-symmetric path. The last
/// error says so; NULL `win` -> `ncclInvalidArgument`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn pncclCommWindowRegister(
    _comm: ncclComm_t,
    _buff: *mut c_void,
    _size: usize,
    win: *mut ncclWindow_t,
    _win_flags: c_int,
) -> NcclResult {
    const F: &str = "ncclCommWindowRegister";
    if win.is_null() {
        return errors::finish(F, Err(Fail::arg("win is NULL")));
    }
    unsafe { *win = std::ptr::null_mut() };
    let msg = format!(
        "{F}: symmetric memory windows are {NOT_SUPPORTED}; returned a NULL window (use the buffer without a window)"
    );
    errors::log(Level::Info, &msg);
    errors::set_last(&msg);
    SUCCESS
}
/// `ncclCommWindowRegister`: see [`pncclCommWindowRegister`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommWindowRegister(
    comm: ncclComm_t,
    buff: *mut c_void,
    size: usize,
    win: *mut ncclWindow_t,
    win_flags: c_int,
) -> NcclResult {
    unsafe { pncclCommWindowRegister(comm, buff, size, win, win_flags) }
}

/// `ncclCommWindowDeregister`: a NULL window (what `ncclCommWindowRegister`
/// hands out) succeeds; any other window was not made by Weft ->
/// `ncclInvalidArgument`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn pncclCommWindowDeregister(
    _comm: ncclComm_t,
    win: ncclWindow_t,
) -> NcclResult {
    const F: &str = "ncclCommWindowDeregister";
    if win.is_null() {
        return SUCCESS;
    }
    errors::finish(
        F,
        Err(Fail::new(
            INVALID_ARGUMENT,
            format!(
                "window {win:p} was not registered by Weft (Weft's ncclCommWindowRegister returns NULL windows)"
            ),
        )),
    )
}
/// `ncclCommWindowDeregister`: see [`pncclCommWindowDeregister`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommWindowDeregister(
    comm: ncclComm_t,
    win: ncclWindow_t,
) -> NcclResult {
    unsafe { pncclCommWindowDeregister(comm, win) }
}

// ---------------------------------------------------------------------------
// Functions without a result code.

/// Records `func`'s "not supported" in the last error and the WARN log.
fn note_unsupported(func: &str) {
    let _ = not_supported(func);
}

/// `ncclParamDumpAll`: not supported yet (nothing is printed; last error set).
#[unsafe(no_mangle)]
pub extern "C" fn pncclParamDumpAll() {
    note_unsupported("ncclParamDumpAll");
}
/// `ncclParamDumpAll`: see [`pncclParamDumpAll`].
#[unsafe(no_mangle)]
pub extern "C" fn ncclParamDumpAll() {
    pncclParamDumpAll()
}

/// `ncclResetDebugInit` (deprecated in NCCL): a no-op; Weft reads
/// `NCCL_DEBUG`/`WEFT_DEBUG` once per process.
#[unsafe(no_mangle)]
pub extern "C" fn pncclResetDebugInit() {}
/// `ncclResetDebugInit`: see [`pncclResetDebugInit`].
#[unsafe(no_mangle)]
pub extern "C" fn ncclResetDebugInit() {
    pncclResetDebugInit()
}
/// `ncclResetDebugInitInternal` (exported by NCCL, in no header): a no-op.
#[unsafe(no_mangle)]
pub extern "C" fn pncclResetDebugInitInternal() {}
/// `ncclResetDebugInitInternal`: see [`pncclResetDebugInitInternal`].
#[unsafe(no_mangle)]
pub extern "C" fn ncclResetDebugInitInternal() {
    pncclResetDebugInitInternal()
}

/// Defines the device API's team helpers, which return a value instead of a
/// result code: the empty value, with the last error set.
macro_rules! unsupported_value {
    ($(fn $name:ident / $pname:ident ( $($a:ident : $t:ty),* ) -> $ret:ty = $val:expr;)*) => {$(
        #[doc = concat!("`", stringify!($name), "`: not supported by Weft yet: returns `", stringify!($val), "`, last error set.")]
        #[unsafe(no_mangle)]
        #[allow(unused_variables)]
        pub extern "C" fn $pname($($a: $t),*) -> $ret {
            note_unsupported(stringify!($name));
            $val
        }
        #[doc = concat!("`", stringify!($name), "`: see [`", stringify!($pname), "`].")]
        #[unsafe(no_mangle)]
        pub extern "C" fn $name($($a: $t),*) -> $ret {
            $pname($($a),*)
        }
    )*};
}

const NO_TEAM: ncclTeam_t = ncclTeam_t {
    n_ranks: 0,
    rank: 0,
    stride: 0,
};

unsupported_value! {
    fn ncclTeamWorld / pncclTeamWorld(comm: ncclComm_t) -> ncclTeam_t = NO_TEAM;
    fn ncclTeamLsa / pncclTeamLsa(comm: ncclComm_t) -> ncclTeam_t = NO_TEAM;
    fn ncclTeamRail / pncclTeamRail(comm: ncclComm_t) -> ncclTeam_t = NO_TEAM;
    fn ncclTeamCft / pncclTeamCft(comm: ncclComm_t, mode: c_int) -> ncclTeam_t = NO_TEAM;
    fn ncclTeamCftMultimem / pncclTeamCftMultimem(comm: ncclComm_t) -> ncclTeam_t = NO_TEAM;
    fn ncclTeamRankToWorld / pncclTeamRankToWorld(comm: ncclComm_t, team: ncclTeam_t, rank: c_int) -> c_int = -1;
    fn ncclTeamRankToLsa / pncclTeamRankToLsa(comm: ncclComm_t, team: ncclTeam_t, rank: c_int) -> c_int = -1;
    fn ncclLLA2ACalcSlots / pncclLLA2ACalcSlots(max_elts: c_int, max_elt_size: c_int) -> c_int = -1;
}

// ---------------------------------------------------------------------------
// nccl<Collective>Config: the plain collective when the config asks nothing
// Weft cannot do.

/// Checks a per-collective config: NULL, or initialised with
/// `NCCL_COLLCONFIG_INITIALIZER` and carrying only tuning hints (CTA counts,
/// CTA policy, profiler tag, vendor extensions), which Weft ignores.
/// Errors are recorded under `func`.
unsafe fn coll_config_ok(func: &str, config: *const ncclCollConfig_t) -> Result<(), NcclResult> {
    if config.is_null() {
        return Ok(());
    }
    let c = unsafe { std::ptr::read_unaligned(config) };
    if c.magic != API_MAGIC {
        return Err(errors::finish(
            func,
            Err(Fail::arg(format!(
                "config: magic is {:#x}, expected {API_MAGIC:#x}: initialise it with NCCL_COLLCONFIG_INITIALIZER",
                c.magic
            ))),
        ));
    }
    let has = |end: usize| c.size >= end;
    let alg_end =
        std::mem::offset_of!(ncclCollConfig_t, alg_selection) + std::mem::size_of::<usize>();
    let alg = has(alg_end) && !c.alg_selection.is_null() && unsafe { *c.alg_selection } != 0;
    let event_end = std::mem::offset_of!(ncclCollConfig_t, launch_completion_event)
        + std::mem::size_of::<usize>();
    let event = has(event_end) && !c.launch_completion_event.is_null();
    if alg || event {
        let what = if alg {
            "algSelection"
        } else {
            "launchCompletionEvent"
        };
        return Err(errors::finish(
            func,
            Err(Fail::usage(format!("config.{what} is {NOT_SUPPORTED}"))),
        ));
    }
    Ok(())
}

/// Defines `pncclXConfig` (config checked, then `pncclX`) and `ncclXConfig`.
macro_rules! with_config {
    ($(fn $name:ident / $pname:ident => $plain:ident ( $($a:ident : $t:ty),* );)*) => {$(
        #[doc = concat!("`", stringify!($name), "`: `", stringify!($plain), "` when `config` is NULL or holds only tuning hints; an algorithm selection or launch-completion event -> `ncclInvalidUsage` (not supported yet).")]
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $pname($($a: $t,)* config: *const ncclCollConfig_t) -> NcclResult {
            match unsafe { coll_config_ok(stringify!($name), config) } {
                Ok(()) => unsafe { api::$plain($($a),*) },
                Err(code) => code,
            }
        }
        #[doc = concat!("`", stringify!($name), "`: see [`", stringify!($pname), "`].")]
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name($($a: $t,)* config: *const ncclCollConfig_t) -> NcclResult {
            unsafe { $pname($($a,)* config) }
        }
    )*};
}

with_config! {
    fn ncclAllReduceConfig / pncclAllReduceConfig => pncclAllReduce(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: c_int, op: c_int, comm: ncclComm_t, stream: cudaStream_t);
    fn ncclBroadcastConfig / pncclBroadcastConfig => pncclBroadcast(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: c_int, root: c_int, comm: ncclComm_t, stream: cudaStream_t);
    fn ncclReduceConfig / pncclReduceConfig => pncclReduce(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: c_int, op: c_int, root: c_int, comm: ncclComm_t, stream: cudaStream_t);
    fn ncclAllGatherConfig / pncclAllGatherConfig => pncclAllGather(sendbuff: *const c_void, recvbuff: *mut c_void, sendcount: usize, datatype: c_int, comm: ncclComm_t, stream: cudaStream_t);
    fn ncclReduceScatterConfig / pncclReduceScatterConfig => pncclReduceScatter(sendbuff: *const c_void, recvbuff: *mut c_void, recvcount: usize, datatype: c_int, op: c_int, comm: ncclComm_t, stream: cudaStream_t);
    fn ncclAlltoAllConfig / pncclAlltoAllConfig => pncclAlltoAll(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: c_int, comm: ncclComm_t, stream: cudaStream_t);
    fn ncclGatherConfig / pncclGatherConfig => pncclGather(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: c_int, root: c_int, comm: ncclComm_t, stream: cudaStream_t);
    fn ncclScatterConfig / pncclScatterConfig => pncclScatter(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: c_int, root: c_int, comm: ncclComm_t, stream: cudaStream_t);
}
