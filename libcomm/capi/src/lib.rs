//! Weft's NCCL-compatible C ABI: libcomm built as a drop-in `libnccl.so.2`.
//!
//! The header is `libcomm/include/nccl.h` (ABI-identical to NCCL 2.28's).
//! Modules, one job each:
//! - [`api`]: every exported function (`ncclX` and its `pncclX` twin);
//! - [`handles`]: the checked-handle registry behind `ncclComm_t`;
//! - [`config`]: `ncclConfig_t` (v22800) and `ncclSimInfo_t`, older sizes accepted;
//! - [`errors`]: result codes, error strings, last error, NCCL_DEBUG logging;
//! - [`group`]: `ncclGroupStart`/`ncclGroupEnd` per thread;
//! - [`redop`]: `ncclRedOpCreatePreMulSum` operators;
//! - [`ptrkind`]: host/device pointer classification (host mode);
//! - [`device`]: hands operations on device memory to libcomm's CUDA backend;
//! - [`attach`]: registers the process with the pod's sidecar.

pub mod api;
pub mod attach;
pub mod config;
pub mod device;
pub mod errors;
pub mod group;
pub mod handles;
pub mod ptrkind;
pub mod redop;
