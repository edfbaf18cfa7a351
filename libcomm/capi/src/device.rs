//! Device memory in the C ABI: operations on CUDA buffers go to libcomm's
//! CUDA backend (`libcomm::cuda::batch`: kernels on the caller's stream, or
//! staging through host memory where no kernel path exists).

use crate::errors::{CResult, Fail, Level, log};
use crate::handles::CommEntry;
use libcomm::GroupOp;
use libcomm::cuda;
use std::ffi::c_void;
use std::sync::{Arc, Once};

/// One operation of a batch.
pub struct DevOp {
    pub entry: Arc<CommEntry>,
    pub op: GroupOp,
    /// `cudaStream_t` as an address.
    pub stream: usize,
    /// The device of its buffers (None: host memory).
    pub device: Option<i32>,
    pub what: &'static str,
}

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

fn route_logs() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        cuda::set_logger(|warn, line| log(if warn { Level::Warn } else { Level::Info }, line))
    });
}

/// Runs a batch of operations (one call, or an outermost group's).
pub fn run(ops: Vec<DevOp>) -> CResult<()> {
    route_logs();
    let batch: Vec<cuda::DeviceOp<'_>> = ops
        .iter()
        .map(|o| cuda::DeviceOp {
            comm: &o.entry.comm,
            op: o.op,
            stream: o.stream as *mut c_void,
            device: o.device,
        })
        .collect();
    // SAFETY: the C caller's pointers, as NCCL's contract requires.
    unsafe { cuda::run(&batch) }.map_err(|e| {
        let what: Vec<&str> = ops.iter().map(|o| o.what).collect();
        let mut what_u = what.clone();
        what_u.dedup();
        Fail::from(e).context(what_u.join(", "))
    })
}
