//! The CUDA backend: device memory for every collective.
//!
//! Everything goes through `cudarc` with dynamic loading: the build needs no
//! CUDA toolkit, and without a GPU [`driver`] reports "no CUDA driver" (host
//! mode stays available). Two data paths:
//!
//! - **Kernels** ([`DevComm`]): every rank of a communicator owns a
//!   peer-visible scratch + flag area on its GPU. Ranks in one process (as
//!   nccl-tests `-g N` runs them) map each other's areas directly (CUDA P2P
//!   over NVLink/PCIe, `cuCtxEnablePeerAccess`); ranks in other processes of
//!   the host open them with CUDA IPC (`cuIpcOpenMemHandle`). Collectives are
//!   one kernel launch on the caller's stream (asynchronous, stream-ordered, no
//!   host round trip): stage the input into scratch, a flag barrier with the
//!   peers, read/reduce the peers' scratch (see `kernels/collectives.cu`).
//! - **Staging** ([`Staging`]): the correct but slow fallback for everything
//!   else (gather, scatter, send/recv, PreMulSum, peers that cannot map each
//!   other, no NVRTC): synchronize the stream, copy device buffers to host,
//!   run the host algorithm, copy back on the stream.

pub mod kernels;

use crate::op::{Buf, Memory, Op};
use cudarc::driver::sys;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Mutex, OnceLock};

/// A CUDA error as text.
pub type CudaResult<T> = std::result::Result<T, String>;

fn err_str(r: sys::CUresult) -> String {
    let mut p: *const std::ffi::c_char = std::ptr::null();
    unsafe {
        if sys::cuGetErrorString(r, &mut p) == sys::CUresult::CUDA_SUCCESS && !p.is_null() {
            return std::ffi::CStr::from_ptr(p).to_string_lossy().into_owned();
        }
    }
    format!("{r:?}")
}

/// Turns a driver result into a `CudaResult`, naming the call.
pub fn check(r: sys::CUresult, what: &str) -> CudaResult<()> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(format!("{what} failed: {} ({r:?})", err_str(r)))
    }
}

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

/// Loads and initialises the CUDA driver once; Err("no CUDA driver ...") on
/// a machine without one (never panics).
pub fn driver() -> CudaResult<()> {
    static D: OnceLock<CudaResult<()>> = OnceLock::new();
    D.get_or_init(|| unsafe {
        if !sys::is_culib_present() {
            return Err("no CUDA driver (libcuda.so.1 not found): host mode only".into());
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

/// Test and tool helpers: device memory and streams on `dev`, synchronous
/// copies.
pub mod mem {
    use super::*;

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

// ---------------------------------------------------------------------------
// Buffers an operation touches

/// The device of the first device buffer of `op` (None: all host memory).
pub fn op_device(op: &Op, rank: usize, nranks: usize) -> Option<i32> {
    op.buffers(rank, nranks)
        .iter()
        .find_map(|b| pointer_device(b.ptr as *const c_void))
}

// ---------------------------------------------------------------------------
// Staging through host memory (the fallback)

struct Region {
    dev: u64,
    bytes: usize,
    host: Vec<u128>,
    write: bool,
}

/// An operation whose device buffers were copied to host memory: run
/// [`Staging::op`] on the host, then [`Staging::finish`].
pub struct Staging {
    regions: Vec<Region>,
    stream: sys::CUstream,
    device: i32,
    /// The operation with host pointers in place of device ones (host memory).
    pub op: Op,
}

unsafe impl Send for Staging {}

impl Staging {
    /// Waits for the op's stream, copies its device buffers to host memory
    /// (overlapping buffers, as in place, share one host region).
    ///
    /// # Safety
    /// The op's stream must be a valid stream (or NULL) of its buffers' device.
    pub unsafe fn begin(op: &Op, rank: usize, nranks: usize) -> CudaResult<Staging> {
        let device = match op.memory {
            Memory::Device(d) => d,
            Memory::Host => 0,
        };
        use_device(device)?;
        let stream = op.stream as sys::CUstream;
        let mut bufs: Vec<Buf> = op
            .buffers(rank, nranks)
            .into_iter()
            .filter(|b| pointer_device(b.ptr as *const c_void).is_some())
            .collect();
        bufs.sort_by_key(|b| b.ptr);
        let mut regions: Vec<Region> = Vec::new();
        for b in bufs {
            if let Some(last) = regions.last_mut()
                && b.ptr < last.dev + last.bytes as u64
            {
                let end = (b.ptr + b.bytes as u64).max(last.dev + last.bytes as u64);
                last.bytes = (end - last.dev) as usize;
                last.write |= b.write;
                continue;
            }
            regions.push(Region {
                dev: b.ptr,
                bytes: b.bytes,
                host: Vec::new(),
                write: b.write,
            });
        }
        for r in &mut regions {
            r.host = vec![0u128; r.bytes.div_ceil(16)];
            unsafe {
                check(
                    sys::cuMemcpyDtoHAsync_v2(r.host.as_mut_ptr().cast(), r.dev, r.bytes, stream),
                    "cuMemcpyDtoHAsync",
                )?;
            }
        }
        unsafe { check(sys::cuStreamSynchronize(stream), "cuStreamSynchronize")? };
        let map: Vec<(u64, usize, u64)> = regions
            .iter()
            .map(|r| (r.dev, r.bytes, r.host.as_ptr() as u64))
            .collect();
        let op = op
            .map_ptrs(|p| {
                for &(d, n, h) in &map {
                    if p >= d && p < d + n as u64 {
                        return h + (p - d);
                    }
                }
                p
            })
            .on(Memory::Host, std::ptr::null_mut());
        Ok(Staging {
            regions,
            stream,
            device,
            op,
        })
    }

    /// Copies the written regions back on the stream and waits for them.
    pub fn finish(self) -> CudaResult<()> {
        use_device(self.device)?;
        for r in &self.regions {
            if r.write {
                unsafe {
                    check(
                        sys::cuMemcpyHtoDAsync_v2(
                            r.dev,
                            r.host.as_ptr().cast(),
                            r.bytes,
                            self.stream,
                        ),
                        "cuMemcpyHtoDAsync",
                    )?;
                }
            }
        }
        unsafe { check(sys::cuStreamSynchronize(self.stream), "cuStreamSynchronize") }
    }
}

pub mod batch;
mod devcomm;
pub use batch::{CudaBackend, set_logger};
pub use devcomm::{DESCRIPTOR_BYTES, DevComm, MAX_RANKS, P2p, Plan, compile_single, p2p_pieces};
