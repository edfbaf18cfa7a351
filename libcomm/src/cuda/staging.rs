//! Staging through host memory, the correct but slow fallback for what the
//! kernel path does not run (gather, scatter, send/recv across streams,
//! PreMulSum, peers that cannot map each other, no NVRTC): wait for the
//! stream, copy the operation's device buffers to host memory, let the host
//! algorithm run on the copies, copy the written ones back. What an
//! operation touches is the descriptor's (`Op::buffers`).

use super::driver::{pointer_device, use_device};
use super::error::{CudaResult, check};
use crate::op::{Buf, Memory, Op};
use cudarc::driver::sys;
use std::ffi::c_void;

/// The device of the first device buffer of `op` (None: all host memory).
pub fn op_device(op: &Op, rank: usize, nranks: usize) -> Option<i32> {
    op.buffers(rank, nranks)
        .iter()
        .find_map(|b| pointer_device(b.ptr as *const c_void))
}

/// A span of device memory an operation (or a job of several) touches:
/// overlapping buffers, as in place, are one region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct DevRegion {
    pub dev: u64,
    pub bytes: usize,
    /// Some buffer in it is written.
    pub write: bool,
    /// Some buffer in it is read: a region that is only written (an
    /// output the operation fills whole) need not be copied in.
    pub read: bool,
}

/// The device regions of `bufs` (buffers in host memory are left out),
/// sorted, overlaps merged.
pub(super) fn device_regions(bufs: Vec<Buf>) -> Vec<DevRegion> {
    let mut bufs: Vec<Buf> = bufs
        .into_iter()
        .filter(|b| b.bytes > 0 && pointer_device(b.ptr as *const c_void).is_some())
        .collect();
    bufs.sort_by_key(|b| b.ptr);
    let mut regions: Vec<DevRegion> = Vec::new();
    for b in bufs {
        if let Some(last) = regions.last_mut()
            && b.ptr < last.dev + last.bytes as u64
        {
            let end = (b.ptr + b.bytes as u64).max(last.dev + last.bytes as u64);
            last.bytes = (end - last.dev) as usize;
            last.write |= b.write;
            last.read |= !b.write;
            continue;
        }
        regions.push(DevRegion {
            dev: b.ptr,
            bytes: b.bytes,
            write: b.write,
            read: !b.write,
        });
    }
    regions
}

/// `op` on host memory: every pointer inside a region `(device, bytes,
/// host)` of `map` moved to its host copy.
pub(super) fn host_op(op: &Op, map: &[(u64, usize, u64)]) -> Op {
    op.map_ptrs(|p| {
        for &(d, n, h) in map {
            if p >= d && p < d + n as u64 {
                return h + (p - d);
            }
        }
        p
    })
    .on(Memory::Host, std::ptr::null_mut())
}

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
        let mut regions: Vec<Region> = device_regions(op.buffers(rank, nranks))
            .into_iter()
            .map(|r| Region {
                dev: r.dev,
                bytes: r.bytes,
                host: Vec::new(),
                write: r.write,
            })
            .collect();
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
        let op = host_op(op, &map);
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
