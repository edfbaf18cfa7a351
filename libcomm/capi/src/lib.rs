//! Weft's NCCL-compatible C ABI: libcomm built as a drop-in `libnccl.so.2`.
//!
//! The header is `libcomm/include/nccl.h` (ABI-identical to NCCL 2.28's).
//! Modules, one job each:
//! - [`api`]: every exported function (`ncclX` and its `pncclX` twin);
//! - [`handles`]: the checked-handle registry behind `ncclComm_t`;
//! - [`config`]: `ncclConfig_t` (v22800) and `ncclSimInfo_t`, older sizes accepted;
//! - [`errors`]: result codes, error strings, last error, NCCL_DEBUG logging;
//! - [`group`]: `ncclGroupStart`/`ncclGroupEnd` per thread;
//! - [`lifecycle`]: registering handles, the end-of-init barrier, splits
//!   (shared by `api` and `group`, which do not import each other);
//! - [`redop`]: `ncclRedOpCreatePreMulSum` operators;
//! - [`ptrkind`]: host/device pointer classification (host mode);
//! - [`device`]: finds an operation's CUDA device and routes the CUDA
//!   backend's log lines (every operation, host or device, is a libcomm
//!   `Op` submitted through `Communicator::submit` or a `Group`);
//! - [`attach`]: registers the process with the pod's sidecar;
//! - [`unsupported`]: the rest of NCCL's exported API (up to 2.32): windows
//!   (NULL), `nccl*Config` collectives, and the functions not implemented yet
//!   (`ncclInvalidUsage`, last error set).

pub mod api;
pub mod attach;
pub mod config;
pub mod device;
pub mod errors;
pub mod group;
pub mod handles;
pub mod lifecycle;
pub mod ptrkind;
pub mod redop;
pub mod unsupported;
