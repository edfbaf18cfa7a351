//! The CUDA backend: device memory for every collective.
//!
//! Everything goes through `cudarc` with dynamic loading: the build needs no
//! CUDA toolkit, and without a GPU [`driver`] reports "no CUDA driver" (host
//! mode stays available). Three data paths:
//!
//! - **Kernels** ([`DevComm`]): every rank of a communicator owns a
//!   peer-visible scratch + flag area on its GPU. Ranks in one process (as
//!   nccl-tests `-g N` runs them) map each other's areas directly (CUDA P2P
//!   over NVLink/PCIe, `cuCtxEnablePeerAccess`); ranks in other processes of
//!   the host open them with CUDA IPC (`cuIpcOpenMemHandle`). Collectives are
//!   one kernel launch on the caller's stream (asynchronous, stream-ordered, no
//!   host round trip): stage the input into scratch, a flag barrier with the
//!   peers, read/reduce the peers' scratch (see `kernels/collectives.cu` at
//!   the repository's top level). Send/recv, gather and scatter are fused
//!   point-to-point kernels (`p2p.rs`); a batch of sends only is eager: copied
//!   into staging on the caller's stream and sent from a side stream, so it
//!   never waits there for the peer's receive (`eager.rs`).
//! - **Staging** ([`Staging`]): the correct but slow fallback for everything
//!   else (PreMulSum, point-to-point spread over several streams, peers that
//!   cannot map each other, no kernels for the GPU): synchronize the stream,
//!   copy device buffers to host, run the host algorithm, copy back on the
//!   stream (communicators within one host only).
//! - **Across hosts** ([`ProxySide`]): ranks of different host identities
//!   never map each other's memory; such a communicator's operations are
//!   enqueued on the caller's stream (copies to pinned buffers, a `ready`
//!   flag, a wait for `done`, copies back) and run by its progress thread on
//!   the host path: asynchronous and stream-ordered, no wait on the caller's
//!   thread.
//!
//! # Where things are
//!
//! | file | its one job |
//! |---|---|
//! | `batch.rs` | [`CudaBackend`], the device backend the core hands batches to (`crate::op::backend::Backend`): set up communicators' device sides together, route each operation to a kernel, fused point-to-point kernels or staging |
//! | `devcomm.rs` | [`DevComm`], one rank's device side of a communicator (the state kept between calls), abort and kernel errors, naming the rank a stalled wait waits for |
//! | `mapping.rs` | allocating a rank's peer-visible area, the descriptor exchange, mapping peers (P2P / IPC, never across hosts), release |
//! | `plan.rs` | which kernel and algorithm a collective runs ([`Plan`]) |
//! | `tuning.rs` | every `WEFT_CUDA_*` variable, read once into `Tuning`, and the size rules |
//! | `ll.rs` | the LL one-shot's reuse of its area (`LlHistory`) and its model test |
//! | `abort_model.rs` | the CPU model of the kernels' abort protocol: a rank dies, freezes or aborts at every wait point (a test) |
//! | `p2p.rs` | send/recv/gather/scatter as point-to-point pieces and rounds |
//! | `eager.rs` | sends that do not wait for the peer's receive: staging copy on the caller's stream, the send kernel on a side stream (the design and why it does not race) |
//! | `side_stream.rs` | the side stream, event and staging pool of eager sends (`SideStream`) |
//! | `launch.rs` | kernel arguments and `cuLaunchKernel` for plans and point-to-point rounds |
//! | `abi.rs` | the Rust mirror of the kernels' argument structs, codes and area layout |
//! | `kernels.rs` | kernel lookup, the one place launches get kernels from: which kernel a collective runs, loading it per device from the build's cubin, else its PTX, else NVRTC |
//! | `kernel_set.rs` | which kernels exist and how each is compiled (shared with `libcomm/build.rs`) |
//! | `embedded.rs` | the kernels the build compiled, as the library carries them, and which image serves a compute capability |
//! | `kernel_archive.rs` | the compressed container of one architecture's kernels (shared with the build) |
//! | `cubin.rs` | a cubin's architecture and kernels, from its ELF header and symbols (shared with the build) |
//! | `nvrtc.rs` | the run-time fallback: compiling a kernel with NVRTC, cached on disk |
//! | `staging.rs` | the host-memory fallback, which device an operation's buffers are on, an operation's device regions |
//! | `proxy.rs` | [`ProxySide`]: device operations of a communicator spanning hosts, through pinned buffers and a progress thread |
//! | `pinned_plan.rs` | what a device job across hosts copies into its pinned buffers and out, in place and cut in slices |
//! | `near_cpus.rs` | the CPUs near a GPU, where the cross-host path starts its threads and pins its buffers (`WEFT_CPU_AFFINITY`) |
//! | `pinned.rs` | the pinned, device-mapped buffers and flag words a stream and the progress thread meet on |
//! | `driver.rs` | loading the driver, pointer queries, contexts, device attributes |
//! | `mem.rs` | device memory and streams for tests and tools |
//! | `error.rs` | [`CudaError`], this backend's error type |
//! | `logger.rs` | where the backend's log lines go ([`set_logger`]) |
//!
//! `DeviceSlot` and `DevComm` differ as a slot and what it holds: the
//! communicator's lifecycle record owns a `crate::op::backend::DeviceSlot`
//! (`Unset` until its first operation on device memory, then `Off(device)`
//! when some rank could not map its peers, or `On(DevComm)` behind the
//! `DeviceSide` trait), and the `DevComm` inside is the kernel path's state.
//!
//! This backend sees the communicator core only through `crate::backend`
//! (`Comms`: rank, size, the slot, a host exchange, the observer) and reads
//! operations as `crate::op::Op` descriptors; it imports `op`, `backend`,
//! `types`, `error` and the tuner's device algorithm names, none of which
//! import `cuda/` back.

mod abi;
#[cfg(test)]
mod abort_model;
pub mod batch;
#[cfg(test)] // and the build script's
mod cubin;
mod devcomm;
mod driver;
mod eager;
mod embedded;
mod error;
mod kernel_archive;
mod kernel_set;
pub mod kernels;
mod launch;
mod ll;
mod logger;
mod mapping;
pub mod mem;
mod near_cpus;
mod nvrtc;
mod p2p;
mod pinned;
mod pinned_copy;
mod pinned_pipe;
mod pinned_plan;
mod plan;
mod proxy;
mod proxy_trace;
mod scratch;
mod side_stream;
mod staging;
mod tuning;

pub use abi::MAX_RANKS;
pub use batch::CudaBackend;
pub use devcomm::DevComm;
pub use driver::{
    ContextGuard, alloc_current, compute_capability, current_device, device_at, device_count,
    driver, driver_loaded, free, nvlink_class, pci_location, pointer_device, stream_capturing,
    use_device,
};
pub use error::{CudaError, CudaResult, check};
pub use kernel_set::PTX_ARCH;
pub use kernels::compile_single;
pub use logger::{Logger, set_logger};
pub use mapping::DESCRIPTOR_BYTES;
pub use p2p::{P2p, p2p_pieces};
pub use plan::Plan;
pub use proxy::ProxySide;
pub use staging::{Staging, op_device};
