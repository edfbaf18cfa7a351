//! Device memory in the C ABI: an operation's buffers on a CUDA device make
//! its descriptor's memory kind `Memory::Device`, and libcomm's core hands it
//! to the CUDA backend (kernels on the caller's stream, or staging through
//! host memory where no kernel path exists).

use crate::errors::{Level, log};
use crate::handles::CommEntry;
use libcomm::cuda;
use std::ffi::c_void;
use std::sync::Once;

/// The CUDA device a communicator's device side lives on, if any.
pub fn comm_device(e: &CommEntry) -> Option<i32> {
    e.comm.cuda_device()
}

/// The device of an operation's buffers, when it has device buffers.
pub fn device_of(ptrs: &[*const c_void]) -> Option<i32> {
    if !cuda::driver_loaded() {
        return None;
    }
    ptrs.iter().find_map(|&p| cuda::pointer_device(p))
}

/// Routes the CUDA backend's log lines to NCCL_DEBUG (before its first operation).
pub fn route_logs() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        cuda::set_logger(|warn, line| log(if warn { Level::Warn } else { Level::Info }, line))
    });
}
