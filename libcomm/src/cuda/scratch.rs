//! Stream-ordered device memory pools ([`create_pool`], also the eager
//! sends' staging pool of `side_stream.rs`) and the scratch of the
//! hierarchical collectives across hosts (`Backend::alloc_scratch`): one
//! pool per device for the process, created on first use, that keeps what
//! it holds so a steady stream of collectives allocates without driver
//! work, and never makes one stream wait for a free pending on another
//! (that free may follow a collective still waiting for peers).

use super::driver::{ContextGuard, use_device};
use super::error::{CudaResult, check};
use cudarc::driver::sys;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Mutex;

/// A pool handle, owned by the process for its lifetime.
struct Pool(sys::CUmemoryPool);
// SAFETY: a driver handle, usable from any thread.
unsafe impl Send for Pool {}

static POOLS: Mutex<Option<HashMap<i32, Pool>>> = Mutex::new(None);

/// The scratch pool of `dev` (its context current on this thread).
fn pool(dev: i32) -> CudaResult<sys::CUmemoryPool> {
    let mut g = POOLS.lock().unwrap_or_else(|e| e.into_inner());
    let m = g.get_or_insert_with(HashMap::new);
    if let Some(p) = m.get(&dev) {
        return Ok(p.0);
    }
    let pool = create_pool(dev, "cuMemPoolCreate (scratch of hierarchical collectives)")?;
    m.insert(dev, Pool(pool));
    Ok(pool)
}

/// A stream-ordered pool of device memory on `dev` (`create`: the call
/// as errors name it, with what the pool is for) that keeps what it holds (release threshold: never) and never
/// makes an allocation on one stream wait for a free still pending on
/// another (that free may follow a kernel waiting for a peer: the waits
/// would chain across ranks); reuse of a free that already completed
/// (opportunistic) stays on. Also the eager sends' staging pool
/// (`side_stream.rs`).
pub(super) fn create_pool(dev: i32, create: &'static str) -> CudaResult<sys::CUmemoryPool> {
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    unsafe {
        let mut props: sys::CUmemPoolProps = std::mem::zeroed();
        props.allocType = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        props.handleTypes = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE;
        props.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        props.location.id = dev;
        check(sys::cuMemPoolCreate(&mut pool, &props), create)?;
        let mut keep = u64::MAX;
        let mut no: i32 = 0;
        let set = check(
            sys::cuMemPoolSetAttribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                (&mut keep as *mut u64).cast::<c_void>(),
            ),
            "cuMemPoolSetAttribute (release threshold)",
        )
        .and_then(|_| {
            check(
                sys::cuMemPoolSetAttribute(
                    pool,
                    sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES,
                    (&mut no as *mut i32).cast::<c_void>(),
                ),
                "cuMemPoolSetAttribute (no internal dependencies)",
            )
        });
        if let Err(e) = set {
            let _ = sys::cuMemPoolDestroy(pool);
            return Err(e);
        }
    }
    Ok(pool)
}

/// `bytes` on `dev` for work on `stream` from now on.
///
/// # Safety
/// `stream` is a live stream of `dev` (or NULL).
pub unsafe fn alloc(dev: i32, bytes: usize, stream: *mut c_void) -> CudaResult<u64> {
    let _ctx = ContextGuard::save();
    use_device(dev)?;
    let pool = pool(dev)?;
    let mut p: sys::CUdeviceptr = 0;
    unsafe {
        check(
            sys::cuMemAllocFromPoolAsync(&mut p, bytes.max(1), pool, stream as sys::CUstream),
            "cuMemAllocFromPoolAsync (scratch of a hierarchical collective)",
        )?;
    }
    Ok(p)
}

/// Copies `bytes` from `src` to `dst` on `dev`'s `stream`.
///
/// # Safety
/// Both ranges are device memory of `dev`, apart, valid until the stream
/// passes the copy; `stream` is a live stream of `dev` (or NULL).
pub unsafe fn copy(
    dev: i32,
    dst: u64,
    src: u64,
    bytes: usize,
    stream: *mut c_void,
) -> CudaResult<()> {
    let _ctx = ContextGuard::save();
    use_device(dev)?;
    unsafe {
        check(
            sys::cuMemcpyDtoDAsync_v2(dst, src, bytes, stream as sys::CUstream),
            "cuMemcpyDtoDAsync (a hierarchical collective's blocks between rank and host order)",
        )
    }
}

/// Frees `p` once `stream`'s work so far is done with it.
///
/// # Safety
/// `p` came from [`alloc`] on `dev`.
pub unsafe fn free(dev: i32, p: u64, stream: *mut c_void) -> CudaResult<()> {
    let _ctx = ContextGuard::save();
    use_device(dev)?;
    unsafe {
        check(
            sys::cuMemFreeAsync(p, stream as sys::CUstream),
            "cuMemFreeAsync",
        )
    }
}
