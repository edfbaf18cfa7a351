//! Pre-multiply-sum reduction operators (`ncclRedOpCreatePreMulSum`).
//!
//! Each communicator hands out `ncclRedOp_t` values from `ncclNumOps` (5) up;
//! an operator is valid only on the communicator that created it and only for
//! the data type it was created with (as in NCCL). The scalar is read per
//! `ncclScalarResidence_t`: `ncclScalarHostImmediate` before the create call
//! returns; `ncclScalarDevice` each time a collective using the operator is
//! called: device memory (detected, see `ptrkind`) after the work already on
//! the call's stream is done, so a scalar computed on that stream is seen, as
//! NCCL's kernels see it; host memory (host mode) directly.

use crate::errors::{CResult, Fail, UNHANDLED_CUDA_ERROR};
use libcomm::{DataType, F8E4M3, F8E5M2, ReduceOp};
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Mutex;

/// `ncclNumOps`: the first value of a created operator.
pub const NUM_BUILTIN: i32 = 5;
pub const SCALAR_DEVICE: i32 = 0;
pub const SCALAR_HOST_IMMEDIATE: i32 = 1;

#[derive(Clone, Copy, Debug)]
enum Scalar {
    Value(f64),
    /// Address read when a collective runs.
    At(usize),
}

#[derive(Clone, Copy, Debug)]
struct PreMul {
    dtype: DataType,
    scalar: Scalar,
}

#[derive(Default)]
pub struct RedOps {
    ops: Mutex<(i32, HashMap<i32, PreMul>)>,
}

/// Reads one element of `dtype` at `p` as f64.
///
/// # Safety
/// `p` must be readable for one element of `dtype`.
pub unsafe fn read_scalar(p: *const u8, dtype: DataType) -> f64 {
    unsafe {
        match dtype {
            DataType::I8 => p.cast::<i8>().read_unaligned() as f64,
            DataType::U8 => p.read_unaligned() as f64,
            DataType::I32 => p.cast::<i32>().read_unaligned() as f64,
            DataType::U32 => p.cast::<u32>().read_unaligned() as f64,
            DataType::I64 => p.cast::<i64>().read_unaligned() as f64,
            DataType::U64 => p.cast::<u64>().read_unaligned() as f64,
            DataType::F16 => half::f16::from_bits(p.cast::<u16>().read_unaligned()).to_f64(),
            DataType::Bf16 => half::bf16::from_bits(p.cast::<u16>().read_unaligned()).to_f64(),
            DataType::F32 => p.cast::<f32>().read_unaligned() as f64,
            DataType::F64 => p.cast::<f64>().read_unaligned(),
            DataType::F8E4M3 => F8E4M3(p.read_unaligned()).to_f32() as f64,
            DataType::F8E5M2 => F8E5M2(p.read_unaligned()).to_f32() as f64,
        }
    }
}

/// Reads an `ncclScalarDevice` scalar: device memory through the driver,
/// after `stream`'s earlier work; anything else (host mode) directly.
///
/// # Safety
/// `at` must be readable for one element of `dtype` (device or host memory).
unsafe fn read_scalar_at(at: usize, dtype: DataType, stream: usize) -> CResult<f64> {
    let Some(dev) = libcomm::cuda::pointer_device(at as *const c_void) else {
        return Ok(unsafe { read_scalar(at as *const u8, dtype) });
    };
    let mut b = [0u8; 8];
    libcomm::cuda::mem::dtoh_after(
        dev,
        &mut b[..dtype.size()],
        at as u64,
        stream as *mut c_void,
    )
    .map_err(|e| {
        Fail::new(
            UNHANDLED_CUDA_ERROR,
            format!(
                "reading the ncclScalarDevice scalar of a PreMulSum operator on GPU {dev}: {e}"
            ),
        )
    })?;
    Ok(unsafe { read_scalar(b.as_ptr(), dtype) })
}

impl RedOps {
    /// Creates an operator; returns its `ncclRedOp_t` value.
    ///
    /// # Safety
    /// `scalar` must be readable for one element of `dtype` (now, and for
    /// `ncclScalarDevice` whenever the operator is used).
    pub unsafe fn create(
        &self,
        scalar: *const u8,
        dtype: DataType,
        residence: i32,
    ) -> CResult<i32> {
        if scalar.is_null() {
            return Err(Fail::arg("scalar is NULL"));
        }
        let s = match residence {
            SCALAR_HOST_IMMEDIATE => Scalar::Value(unsafe { read_scalar(scalar, dtype) }),
            SCALAR_DEVICE => Scalar::At(scalar as usize),
            r => {
                return Err(Fail::arg(format!(
                    "residence {r} is not an ncclScalarResidence_t (0 = ncclScalarDevice, 1 = ncclScalarHostImmediate)"
                )));
            }
        };
        let mut g = self.ops.lock().unwrap_or_else(|e| e.into_inner());
        let (next, map) = &mut *g;
        if *next < NUM_BUILTIN {
            *next = NUM_BUILTIN;
        }
        // Find a free value (values are recycled after ncclRedOpDestroy).
        let mut v = *next;
        let mut tries = 0u64;
        while map.contains_key(&v) {
            v = if v == i32::MAX { NUM_BUILTIN } else { v + 1 };
            tries += 1;
            if tries > (i32::MAX - NUM_BUILTIN) as u64 {
                return Err(Fail::usage(
                    "no free ncclRedOp_t values left on this communicator",
                ));
            }
        }
        *next = if v == i32::MAX { NUM_BUILTIN } else { v + 1 };
        map.insert(v, PreMul { dtype, scalar: s });
        Ok(v)
    }

    pub fn destroy(&self, op: i32) -> CResult<()> {
        if (0..NUM_BUILTIN).contains(&op) {
            return Err(Fail::arg(format!(
                "op {op} is a built-in operator; only operators from ncclRedOpCreatePreMulSum can be destroyed"
            )));
        }
        let mut g = self.ops.lock().unwrap_or_else(|e| e.into_inner());
        match g.1.remove(&op) {
            Some(_) => Ok(()),
            None => Err(Fail::arg(format!(
                "op {op} was not created on this communicator by ncclRedOpCreatePreMulSum (or was already destroyed)"
            ))),
        }
    }

    /// The libcomm operator for a raw `ncclRedOp_t` used with `dtype` in a
    /// call on `stream` (the caller's `cudaStream_t`, as an address: only
    /// handed to the driver).
    pub fn resolve(&self, op: i32, dtype: DataType, stream: usize) -> CResult<ReduceOp> {
        match op {
            0 => return Ok(ReduceOp::Sum),
            1 => return Ok(ReduceOp::Prod),
            2 => return Ok(ReduceOp::Max),
            3 => return Ok(ReduceOp::Min),
            4 => return Ok(ReduceOp::Avg),
            _ => {}
        }
        let g = self.ops.lock().unwrap_or_else(|e| e.into_inner());
        let Some(p) = g.1.get(&op).copied() else {
            return Err(Fail::arg(format!(
                "unknown reduction op {op} (valid: ncclSum 0, ncclProd 1, ncclMax 2, ncclMin 3, ncclAvg 4, or an op from ncclRedOpCreatePreMulSum on this communicator)"
            )));
        };
        if p.dtype != dtype {
            return Err(Fail::arg(format!(
                "reduction op {op} was created for data type {} but is used with {}",
                p.dtype, dtype
            )));
        }
        let s = match p.scalar {
            Scalar::Value(v) => v,
            Scalar::At(a) => unsafe { read_scalar_at(a, dtype, stream) }?,
        };
        Ok(ReduceOp::PreMulSum(s))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn create_resolve_destroy() {
        let r = RedOps::default();
        let two = 2.0f32;
        let op = unsafe { r.create((&two as *const f32).cast(), DataType::F32, 1) }.unwrap();
        assert_eq!(op, 5);
        assert!(matches!(r.resolve(op, DataType::F32, 0), Ok(ReduceOp::PreMulSum(s)) if s == 2.0));
        assert_eq!(r.resolve(op, DataType::F64, 0).unwrap_err().code, 4);
        assert_eq!(r.resolve(99, DataType::F32, 0).unwrap_err().code, 4);
        r.destroy(op).unwrap();
        assert_eq!(r.destroy(op).unwrap_err().code, 4);
        assert_eq!(r.destroy(0).unwrap_err().code, 4);
    }
}
