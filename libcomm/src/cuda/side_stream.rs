//! The side stream of eager sends (see `eager.rs`): one communicator's
//! device side keeps a non-blocking stream, an event and a stream-ordered
//! memory pool for the staging of its sends, created on the first eager
//! send and released at finalize. Its own module because the device side
//! (`devcomm.rs`) owns it while the eager path (`eager.rs`) drives it.

use super::error::{CudaResult, check};
use cudarc::driver::sys;

/// The side stream, its event and the staging pool of one communicator's
/// device side (created on the first eager send).
pub(super) struct SideStream {
    pub(super) stream: sys::CUstream,
    pub(super) event: sys::CUevent,
    pub(super) pool: sys::CUmemoryPool,
}

impl SideStream {
    /// Creates the side stream, the event and a memory pool on `dev` that
    /// devices `peers` (ranks of this process on other GPUs) may read.
    pub(super) fn create(dev: i32, peers: &[i32]) -> CudaResult<SideStream> {
        let mut e = SideStream {
            stream: std::ptr::null_mut(),
            event: std::ptr::null_mut(),
            pool: std::ptr::null_mut(),
        };
        let r = unsafe { e.init(dev, peers) };
        if r.is_err() {
            e.destroy();
        }
        r.map(|_| e)
    }

    unsafe fn init(&mut self, dev: i32, peers: &[i32]) -> CudaResult<()> {
        unsafe {
            check(
                sys::cuStreamCreate(
                    &mut self.stream,
                    sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32,
                ),
                "cuStreamCreate (the side stream of eager sends)",
            )?;
            check(
                sys::cuEventCreate(
                    &mut self.event,
                    sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32,
                ),
                "cuEventCreate",
            )?;
            self.pool =
                super::scratch::create_pool(dev, "cuMemPoolCreate (staging of eager sends)")?;
            for &p in peers {
                let mut desc: sys::CUmemAccessDesc = std::mem::zeroed();
                desc.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
                desc.location.id = p;
                desc.flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
                check(
                    sys::cuMemPoolSetAccess(self.pool, &desc, 1),
                    "cuMemPoolSetAccess (a rank of this process on another GPU reads the staging)",
                )?;
            }
        }
        Ok(())
    }

    /// Releases what exists. The caller synchronized the device first (or
    /// the stream's work is abandoned, after an abort): a pool destroyed
    /// with allocations outstanding is released when they are freed.
    pub(super) fn destroy(&mut self) {
        unsafe {
            if !self.stream.is_null() {
                let _ = sys::cuStreamDestroy_v2(self.stream);
            }
            if !self.event.is_null() {
                let _ = sys::cuEventDestroy_v2(self.event);
            }
            if !self.pool.is_null() {
                let _ = sys::cuMemPoolDestroy(self.pool);
            }
        }
        self.stream = std::ptr::null_mut();
        self.event = std::ptr::null_mut();
        self.pool = std::ptr::null_mut();
    }
}
