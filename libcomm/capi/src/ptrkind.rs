//! Which kind of memory a buffer pointer names: detected, never guessed.
//!
//! Host mode: when the CUDA driver (`libcuda.so.1`) is not loaded in this
//! process, no pointer can be device memory, so every pointer is host memory.
//! When it is loaded (the program uses CUDA), each pointer is asked about with
//! `cuPointerGetAttribute(CU_POINTER_ATTRIBUTE_MEMORY_TYPE)` (libcomm's CUDA
//! backend, `libcomm::cuda::pointer_device`): host and managed (unified)
//! memory are host-accessible and stay on the host path; device memory goes to
//! the CUDA backend (`crate::device`).

use std::ffi::c_void;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PtrKind {
    /// Host memory (or CUDA managed memory, host-accessible).
    Host,
    /// CUDA device memory.
    Device,
}

/// Classifies one pointer.
pub fn classify(p: *const c_void) -> PtrKind {
    if libcomm::cuda::driver_loaded() && libcomm::cuda::pointer_device(p).is_some() {
        PtrKind::Device
    } else {
        PtrKind::Host
    }
}
