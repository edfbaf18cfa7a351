//! The CUDA driver as the backend uses it: loading it (dynamically: the build
//! needs no toolkit, a machine without a GPU gets "no CUDA driver"), asking
//! what a pointer is, making a device's primary context current, and the
//! device attributes the kernel path decides by (compute capability, PCI
//! location, NVLink-class links). Nothing here knows about communicators.

use super::error::{CudaError, CudaResult, check};
use cudarc::driver::sys;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Mutex, OnceLock};

/// The driver library is loaded in this process already (the program uses
/// CUDA). Host-only programs never load it through us. Asked on every call
/// with a buffer, so a yes is remembered (a loaded driver stays loaded) and
/// only a no asks the loader again (`dlopen` takes the loader's lock).
pub fn driver_loaded() -> bool {
    use std::sync::atomic::{AtomicBool, Ordering};
    static LOADED: AtomicBool = AtomicBool::new(false);
    if LOADED.load(Ordering::Relaxed) {
        return true;
    }
    let loaded = unsafe {
        let h = libc::dlopen(
            c"libcuda.so.1".as_ptr(),
            libc::RTLD_LAZY | libc::RTLD_NOLOAD,
        );
        if !h.is_null() {
            // NOLOAD still counts a reference: give it back.
            libc::dlclose(h);
        }
        !h.is_null()
    };
    if loaded {
        LOADED.store(true, Ordering::Relaxed);
    }
    loaded
}

/// Loads and initialises the CUDA driver once; [`CudaError::NoDriver`] on a
/// machine without one (never panics).
pub fn driver() -> CudaResult<()> {
    static D: OnceLock<CudaResult<()>> = OnceLock::new();
    D.get_or_init(|| unsafe {
        if !sys::is_culib_present() {
            return Err(CudaError::NoDriver);
        }
        check(sys::cuInit(0), "cuInit")
    })
    .clone()
}

/// The device ordinal of a device-memory pointer; None for host, managed or
/// unknown memory (and whenever the driver is not loaded in this process).
pub fn pointer_device(p: *const c_void) -> Option<i32> {
    if p.is_null() || !driver_loaded() || driver().is_err() {
        return None;
    }
    // One driver call for both attributes; unlike cuPointerGetAttribute it
    // answers host memory with defaults (type 0) instead of an error.
    let mut ty: u32 = 0;
    let mut dev: i32 = -1;
    let mut attrs = [
        sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
        sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
    ];
    let mut data = [
        (&mut ty as *mut u32).cast::<c_void>(),
        (&mut dev as *mut i32).cast::<c_void>(),
    ];
    let r =
        unsafe { sys::cuPointerGetAttributes(2, attrs.as_mut_ptr(), data.as_mut_ptr(), p as u64) };
    // 2 = CU_MEMORYTYPE_DEVICE, 3 = CU_MEMORYTYPE_ARRAY.
    (r == sys::CUresult::CUDA_SUCCESS && (ty == 2 || ty == 3) && dev >= 0).then_some(dev)
}

/// Whether `stream` is being captured into a CUDA graph. Only a capture the
/// driver confirms counts: a failed query lets the operation go on, as it did
/// before this check existed.
pub fn stream_capturing(stream: *mut c_void) -> bool {
    let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    let r = unsafe { sys::cuStreamIsCapturing(stream as sys::CUstream, &mut status) };
    r == sys::CUresult::CUDA_SUCCESS
        && status == sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE
}

#[derive(Clone, Copy)]
struct Ctx(sys::CUcontext);
unsafe impl Send for Ctx {}
unsafe impl Sync for Ctx {}

/// Makes device `dev`'s primary context (the CUDA runtime's) current on this
/// thread and returns it.
pub fn use_device(dev: i32) -> CudaResult<sys::CUcontext> {
    driver()?;
    static CTXS: Mutex<Option<HashMap<i32, Ctx>>> = Mutex::new(None);
    let ctx = {
        let mut g = CTXS.lock().unwrap_or_else(|e| e.into_inner());
        let m = g.get_or_insert_with(HashMap::new);
        match m.get(&dev) {
            Some(c) => c.0,
            None => unsafe {
                let mut d: sys::CUdevice = 0;
                check(sys::cuDeviceGet(&mut d, dev), "cuDeviceGet")?;
                let mut c: sys::CUcontext = std::ptr::null_mut();
                check(
                    sys::cuDevicePrimaryCtxRetain(&mut c, d),
                    "cuDevicePrimaryCtxRetain",
                )?;
                m.insert(dev, Ctx(c));
                c
            },
        }
    };
    unsafe { check(sys::cuCtxSetCurrent(ctx), "cuCtxSetCurrent")? };
    Ok(ctx)
}

/// The device of the context current on this thread (None without a driver
/// loaded in the process or without a current context).
pub fn current_device() -> Option<i32> {
    if !driver_loaded() || driver().is_err() {
        return None;
    }
    let mut d: sys::CUdevice = 0;
    unsafe { (sys::cuCtxGetDevice(&mut d) == sys::CUresult::CUDA_SUCCESS).then_some(d) }
}

/// Allocates `bytes` of device memory in the context current on this thread
/// (NCCL's `ncclMemAlloc` with CUDA): None when no driver is loaded or no
/// context is current (host mode), Err when the allocation fails.
pub fn alloc_current(bytes: usize) -> Option<CudaResult<u64>> {
    current_device()?;
    let mut p: sys::CUdeviceptr = 0;
    Some(unsafe { check(sys::cuMemAlloc_v2(&mut p, bytes), "cuMemAlloc").map(|_| p) })
}

/// Frees memory from [`alloc_current`].
pub fn free(p: u64) -> CudaResult<()> {
    unsafe { check(sys::cuMemFree_v2(p), "cuMemFree") }
}

/// Number of CUDA devices (0 without a driver).
pub fn device_count() -> i32 {
    if driver().is_err() {
        return 0;
    }
    let mut n = 0;
    unsafe {
        if sys::cuDeviceGetCount(&mut n) != sys::CUresult::CUDA_SUCCESS {
            return 0;
        }
    }
    n
}

/// Restores the calling thread's current CUDA context when dropped: the
/// backend switches contexts per device, the caller's stays as it was.
pub struct ContextGuard(Option<sys::CUcontext>);

impl ContextGuard {
    /// Remembers the current context (nothing without a driver).
    pub fn save() -> ContextGuard {
        if !driver_loaded() || driver().is_err() {
            return ContextGuard(None);
        }
        let mut c: sys::CUcontext = std::ptr::null_mut();
        let ok = unsafe { sys::cuCtxGetCurrent(&mut c) } == sys::CUresult::CUDA_SUCCESS;
        ContextGuard(ok.then_some(c))
    }
}

impl Drop for ContextGuard {
    fn drop(&mut self) {
        if let Some(c) = self.0 {
            unsafe {
                let _ = sys::cuCtxSetCurrent(c);
            }
        }
    }
}

/// Attributes `attrs` of device `dev`, in order.
fn device_attributes<const N: usize>(
    dev: i32,
    attrs: [sys::CUdevice_attribute; N],
) -> CudaResult<[i32; N]> {
    driver()?;
    let mut out = [0; N];
    unsafe {
        let mut d: sys::CUdevice = 0;
        check(sys::cuDeviceGet(&mut d, dev), "cuDeviceGet")?;
        for (v, attr) in out.iter_mut().zip(attrs) {
            check(
                sys::cuDeviceGetAttribute(v, attr, d),
                "cuDeviceGetAttribute",
            )?;
        }
    }
    Ok(out)
}

/// Compute capability (major, minor) of device `dev`.
pub fn compute_capability(dev: i32) -> CudaResult<(i32, i32)> {
    use sys::CUdevice_attribute::*;
    let [major, minor] = device_attributes(
        dev,
        [
            CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
            CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
        ],
    )?;
    Ok((major, minor))
}

/// Streaming multiprocessors of device `dev`.
pub fn sm_count(dev: i32) -> CudaResult<i32> {
    use sys::CUdevice_attribute::*;
    let [n] = device_attributes(dev, [CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT])?;
    Ok(n)
}

/// Where device `dev` sits on the PCI bus: (domain, bus, device), the same
/// in every process whatever its device numbering.
pub fn pci_location(dev: i32) -> CudaResult<[i32; 3]> {
    use sys::CUdevice_attribute::*;
    device_attributes(
        dev,
        [
            CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID,
            CU_DEVICE_ATTRIBUTE_PCI_BUS_ID,
            CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID,
        ],
    )
}

/// This process's ordinal of the device at PCI location `loc`, if visible.
pub fn device_at(loc: [i32; 3]) -> Option<i32> {
    (0..device_count()).find(|&d| pci_location(d).is_ok_and(|l| l == loc))
}

/// Whether the link from device `a` to device `b` is NVLink-class: the
/// driver reports native atomics over it (NVLink and NVSwitch do, PCIe
/// peer access does not). A warp's 128-byte store then lands whole at the
/// peer, which the lines chain relies on (as NCCL's LL128 does).
pub fn nvlink_class(a: i32, b: i32) -> bool {
    if a == b {
        return true;
    }
    let mut v = 0;
    unsafe {
        let (mut da, mut db): (sys::CUdevice, sys::CUdevice) = (0, 0);
        sys::cuDeviceGet(&mut da, a) == sys::CUresult::CUDA_SUCCESS
            && sys::cuDeviceGet(&mut db, b) == sys::CUresult::CUDA_SUCCESS
            && sys::cuDeviceGetP2PAttribute(
                &mut v,
                sys::CUdevice_P2PAttribute::CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED,
                da,
                db,
            ) == sys::CUresult::CUDA_SUCCESS
            && v == 1
    }
}
