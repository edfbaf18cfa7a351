//! Which kind of memory a buffer pointer names: detected, never guessed.
//!
//! Host mode: when the CUDA driver (`libcuda.so.1`) is not loaded in this
//! process, no pointer can be device memory, so every pointer is host memory.
//! When it is loaded (the program uses CUDA), each pointer is asked about with
//! `cuPointerGetAttribute(CU_POINTER_ATTRIBUTE_MEMORY_TYPE)`: host and
//! managed (unified) memory are host-accessible and handled here; device
//! memory needs the CUDA backend, which this build does not have yet, so the
//! call is refused with `ncclInvalidUsage` (never a silent wrong result).
//! The CUDA backend slots in at [`classify`].

use crate::errors::{CResult, Fail};
use std::ffi::c_void;
use std::sync::OnceLock;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PtrKind {
    /// Host memory (or CUDA managed memory, host-accessible).
    Host,
    /// CUDA device memory.
    Device,
}

type CuPointerGetAttribute = unsafe extern "C" fn(*mut c_void, i32, u64) -> i32;
const CU_POINTER_ATTRIBUTE_MEMORY_TYPE: i32 = 2;
const CU_MEMORYTYPE_DEVICE: u32 = 2;
const CU_MEMORYTYPE_ARRAY: u32 = 3;

/// `cuPointerGetAttribute` when the CUDA driver is already loaded in this process.
fn driver() -> Option<CuPointerGetAttribute> {
    static F: OnceLock<Option<usize>> = OnceLock::new();
    let f = *F.get_or_init(|| unsafe {
        // RTLD_NOLOAD: only look, never load the driver ourselves.
        let h = libc::dlopen(
            c"libcuda.so.1".as_ptr(),
            libc::RTLD_LAZY | libc::RTLD_NOLOAD,
        );
        if h.is_null() {
            return None;
        }
        let s = libc::dlsym(h, c"cuPointerGetAttribute".as_ptr());
        (!s.is_null()).then_some(s as usize)
    });
    f.map(|a| unsafe { std::mem::transmute::<usize, CuPointerGetAttribute>(a) })
}

/// Classifies one pointer.
pub fn classify(p: *const c_void) -> PtrKind {
    if p.is_null() {
        return PtrKind::Host;
    }
    let Some(get) = driver() else {
        return PtrKind::Host;
    };
    let mut ty: u32 = 0;
    let r = unsafe {
        get(
            (&mut ty as *mut u32).cast(),
            CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
            p as u64,
        )
    };
    // An error (CUDA_ERROR_INVALID_VALUE) means CUDA does not know the pointer: plain host memory.
    if r == 0 && (ty == CU_MEMORYTYPE_DEVICE || ty == CU_MEMORYTYPE_ARRAY) {
        PtrKind::Device
    } else {
        PtrKind::Host
    }
}

/// Refuses buffers that this build cannot reach.
pub fn require_host(ptrs: &[(*const c_void, &str)]) -> CResult<()> {
    for &(p, name) in ptrs {
        if classify(p) == PtrKind::Device {
            return Err(Fail::usage(format!(
                "{name} {p:p} is CUDA device memory; this Weft build has no CUDA backend yet (host mode): pass host memory"
            )));
        }
    }
    Ok(())
}
