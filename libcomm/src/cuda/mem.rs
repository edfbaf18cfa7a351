//! Test and tool helpers: device memory and streams on a device, synchronous
//! copies (the C API's tests, `weft bench --device cuda`). The collectives
//! never use these: they take the caller's buffers and stream.

use super::driver::use_device;
use super::error::{CudaResult, check};
use cudarc::driver::sys;
use std::ffi::c_void;

pub fn alloc(dev: i32, bytes: usize) -> CudaResult<u64> {
    use_device(dev)?;
    let mut p: sys::CUdeviceptr = 0;
    unsafe { check(sys::cuMemAlloc_v2(&mut p, bytes.max(1)), "cuMemAlloc")? };
    Ok(p)
}

pub fn free(dev: i32, p: u64) -> CudaResult<()> {
    use_device(dev)?;
    unsafe { check(sys::cuMemFree_v2(p), "cuMemFree") }
}

pub fn htod(dev: i32, dst: u64, src: &[u8]) -> CudaResult<()> {
    use_device(dev)?;
    unsafe {
        check(
            sys::cuMemcpyHtoD_v2(dst, src.as_ptr().cast(), src.len()),
            "cuMemcpyHtoD",
        )?;
        check(sys::cuCtxSynchronize(), "cuCtxSynchronize")
    }
}

pub fn dtoh(dev: i32, dst: &mut [u8], src: u64) -> CudaResult<()> {
    use_device(dev)?;
    unsafe {
        check(sys::cuCtxSynchronize(), "cuCtxSynchronize")?;
        check(
            sys::cuMemcpyDtoH_v2(dst.as_mut_ptr().cast(), src, dst.len()),
            "cuMemcpyDtoH",
        )
    }
}

/// Copies `dst.len()` bytes from `src` once the work already enqueued on
/// `stream` (a raw handle; null: the legacy default stream) is done, so
/// what that work wrote is what is read. Waits for that stream only,
/// never the whole device: other streams' kernels may be waiting on peers
/// this thread has yet to launch.
pub fn dtoh_after(dev: i32, dst: &mut [u8], src: u64, stream: *mut c_void) -> CudaResult<()> {
    use_device(dev)?;
    unsafe {
        check(
            sys::cuStreamSynchronize(stream as sys::CUstream),
            "cuStreamSynchronize",
        )?;
        check(
            sys::cuMemcpyDtoH_v2(dst.as_mut_ptr().cast(), src, dst.len()),
            "cuMemcpyDtoH",
        )
    }
}

/// Waits for all work on device `dev`.
pub fn sync(dev: i32) -> CudaResult<()> {
    use_device(dev)?;
    unsafe { check(sys::cuCtxSynchronize(), "cuCtxSynchronize") }
}

/// A new non-blocking stream on device `dev` (not ordered with the
/// legacy default stream), as a raw handle for the C API.
pub fn stream(dev: i32) -> CudaResult<u64> {
    use_device(dev)?;
    let mut s: sys::CUstream = std::ptr::null_mut();
    unsafe {
        check(
            sys::cuStreamCreate(&mut s, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32),
            "cuStreamCreate",
        )?
    };
    Ok(s as u64)
}

pub fn stream_destroy(dev: i32, s: u64) -> CudaResult<()> {
    use_device(dev)?;
    unsafe {
        check(
            sys::cuStreamDestroy_v2(s as sys::CUstream),
            "cuStreamDestroy",
        )
    }
}
