//! The CUDA backend's error type.
//!
//! Every fallible function of `cuda/` returns [`CudaResult`]: a driver call
//! that failed (with the call's name and its `CUresult`), NVRTC missing or
//! rejecting a kernel (with its log), or a setup that cannot work here. The
//! texts are the ones users and tests have always seen; at the boundary to
//! the communicator (`batch.rs`, `comm/`) they become [`Error::Cuda`] with
//! the operation and communicator in front.

use crate::error::Error;
use cudarc::driver::sys;

/// The result of every fallible call of the CUDA backend.
pub type CudaResult<T> = std::result::Result<T, CudaError>;

/// What went wrong in the CUDA backend.
#[derive(Debug, Clone, thiserror::Error)]
pub enum CudaError {
    /// `libcuda.so.1` cannot be loaded: host mode only.
    #[error("no CUDA driver (libcuda.so.1 not found): host mode only")]
    NoDriver,
    /// A driver call returned something other than `CUDA_SUCCESS`.
    #[error("{call} failed: {} ({result:?})", result_text(*result))]
    Driver {
        /// The call (and, where it helps, what it was for).
        call: &'static str,
        result: sys::CUresult,
    },
    /// `libnvrtc.so` cannot be loaded: no kernel can be compiled.
    #[error(
        "NVRTC (libnvrtc.so) is not available: install it (pip install nvidia-cuda-nvrtc==13.0.88) and put its lib folder on LD_LIBRARY_PATH"
    )]
    NvrtcMissing,
    /// NVRTC rejected a kernel source; `log` is what it said.
    #[error("NVRTC failed to compile {name} for {arch}: {log}")]
    Compile {
        name: String,
        arch: String,
        log: String,
    },
    /// NVRTC produced PTX the driver cannot take as a C string.
    #[error("PTX holds a NUL byte")]
    InvalidPtx,
    /// The ranks asked for something inconsistent (settings that differ
    /// between ranks, unmatched sends to oneself).
    #[error("{0}")]
    InvalidUsage(String),
    /// The kernel path cannot serve this here (too many ranks, no P2P or
    /// IPC between two GPUs, too many pieces in one kernel).
    #[error("{0}")]
    Unsupported(String),
    /// `source`, with what was being done when it happened.
    #[error("{source} ({context})")]
    Context {
        source: Box<CudaError>,
        context: String,
    },
}

impl CudaError {
    /// This error with `context` after it, in parentheses.
    pub fn context(self, context: impl Into<String>) -> CudaError {
        CudaError::Context {
            source: Box::new(self),
            context: context.into(),
        }
    }
}

/// A CUDA failure reaching the communicator: [`Error::Cuda`] with the same
/// text (callers that know the operation put it in front themselves).
impl From<CudaError> for Error {
    fn from(e: CudaError) -> Error {
        Error::Cuda(e.to_string())
    }
}

/// The driver's description of `r` (its enum name when it has none).
fn result_text(r: sys::CUresult) -> String {
    let mut p: *const std::ffi::c_char = std::ptr::null();
    unsafe {
        if sys::cuGetErrorString(r, &mut p) == sys::CUresult::CUDA_SUCCESS && !p.is_null() {
            return std::ffi::CStr::from_ptr(p).to_string_lossy().into_owned();
        }
    }
    format!("{r:?}")
}

/// Turns a driver result into a [`CudaResult`], naming the call.
pub fn check(r: sys::CUresult, call: &'static str) -> CudaResult<()> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(CudaError::Driver { call, result: r })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The texts users saw when these were strings.
    #[test]
    fn messages_keep_their_text() {
        assert_eq!(
            CudaError::NoDriver.to_string(),
            "no CUDA driver (libcuda.so.1 not found): host mode only"
        );
        assert_eq!(
            CudaError::InvalidUsage("rank 1 differs".into()).to_string(),
            "rank 1 differs"
        );
        assert_eq!(
            CudaError::Compile {
                name: "k.cu".into(),
                arch: "compute_90".into(),
                log: "oops".into()
            }
            .to_string(),
            "NVRTC failed to compile k.cu for compute_90: oops"
        );
        assert_eq!(
            CudaError::Unsupported("no P2P".into())
                .context("64 MiB of scratch")
                .to_string(),
            "no P2P (64 MiB of scratch)"
        );
        let e: Error = CudaError::InvalidPtx.into();
        assert!(matches!(&e, Error::Cuda(m) if m == "PTX holds a NUL byte"));
    }
}
