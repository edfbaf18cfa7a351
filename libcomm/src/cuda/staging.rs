//! Staging through host memory, the correct but slow fallback for what the
//! kernel path does not run (gather, scatter, send/recv across streams,
//! PreMulSum, peers that cannot map each other, no NVRTC): wait for the
//! stream, copy the operation's device buffers to host memory, let the host
//! algorithm run on the copies, copy the written ones back. Also what an
//! operation touches ([`buffers`]), which the device lookup uses.

use super::driver::{pointer_device, use_device};
use super::error::{CudaResult, check};
use crate::group::GroupOp;
use crate::types::DataType;
use cudarc::driver::sys;
use std::ffi::c_void;

/// One buffer of an operation on this rank: pointer, bytes, written or read.
#[derive(Clone, Copy, Debug)]
pub struct Buf {
    pub ptr: u64,
    pub bytes: usize,
    pub write: bool,
}

/// The buffers `op` reads and writes on rank `rank` of `nranks` (NCCL's rules:
/// a root-only buffer is not touched elsewhere).
pub fn buffers(op: &GroupOp, rank: usize, nranks: usize) -> Vec<Buf> {
    let b = |p: *const u8, n: usize, dt: DataType, write: bool| Buf {
        ptr: p as u64,
        bytes: n * dt.size(),
        write,
    };
    let mut v = Vec::new();
    match *op {
        GroupOp::AllReduce {
            send,
            recv,
            count,
            dtype,
            ..
        } => {
            v.push(b(send, count, dtype, false));
            v.push(b(recv, count, dtype, true));
        }
        GroupOp::Broadcast {
            send,
            recv,
            count,
            dtype,
            root,
        } => {
            if rank == root {
                v.push(b(send, count, dtype, false));
            }
            v.push(b(recv, count, dtype, true));
        }
        GroupOp::Reduce {
            send,
            recv,
            count,
            dtype,
            root,
            ..
        } => {
            v.push(b(send, count, dtype, false));
            if rank == root {
                v.push(b(recv, count, dtype, true));
            }
        }
        GroupOp::AllGather {
            send,
            recv,
            count,
            dtype,
        } => {
            v.push(b(send, count, dtype, false));
            v.push(b(recv, count * nranks, dtype, true));
        }
        GroupOp::ReduceScatter {
            send,
            recv,
            count,
            dtype,
            ..
        } => {
            v.push(b(send, count * nranks, dtype, false));
            v.push(b(recv, count, dtype, true));
        }
        GroupOp::AllToAll {
            send,
            recv,
            count,
            dtype,
        } => {
            v.push(b(send, count * nranks, dtype, false));
            v.push(b(recv, count * nranks, dtype, true));
        }
        GroupOp::Gather {
            send,
            recv,
            count,
            dtype,
            root,
        } => {
            v.push(b(send, count, dtype, false));
            if rank == root {
                v.push(b(recv, count * nranks, dtype, true));
            }
        }
        GroupOp::Scatter {
            send,
            recv,
            count,
            dtype,
            root,
        } => {
            if rank == root {
                v.push(b(send, count * nranks, dtype, false));
            }
            v.push(b(recv, count, dtype, true));
        }
        GroupOp::Send {
            buf, count, dtype, ..
        } => v.push(b(buf, count, dtype, false)),
        GroupOp::Recv {
            buf, count, dtype, ..
        } => v.push(b(buf.cast_const(), count, dtype, true)),
    }
    v.retain(|b| b.bytes > 0 && b.ptr != 0);
    v
}

/// Rewrites every buffer pointer of `op` through `f`.
pub fn map_ptrs(op: &GroupOp, f: impl Fn(u64) -> u64) -> GroupOp {
    let m = |p: *const u8| f(p as u64) as *const u8;
    let mm = |p: *mut u8| f(p as u64) as *mut u8;
    let mut o = *op;
    match &mut o {
        GroupOp::AllReduce { send, recv, .. }
        | GroupOp::Broadcast { send, recv, .. }
        | GroupOp::Reduce { send, recv, .. }
        | GroupOp::AllGather { send, recv, .. }
        | GroupOp::ReduceScatter { send, recv, .. }
        | GroupOp::AllToAll { send, recv, .. }
        | GroupOp::Gather { send, recv, .. }
        | GroupOp::Scatter { send, recv, .. } => {
            *send = m(*send);
            *recv = mm(*recv);
        }
        GroupOp::Send { buf, .. } => *buf = m(*buf),
        GroupOp::Recv { buf, .. } => *buf = mm(*buf),
    }
    o
}

/// The device of the first device buffer of `op` (None: all host memory).
pub fn op_device(op: &GroupOp, rank: usize, nranks: usize) -> Option<i32> {
    buffers(op, rank, nranks)
        .iter()
        .find_map(|b| pointer_device(b.ptr as *const c_void))
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
    /// The operation with host pointers in place of device ones.
    pub op: GroupOp,
}

unsafe impl Send for Staging {}

impl Staging {
    /// Waits for the stream, copies the op's device buffers to host memory
    /// (overlapping buffers, as in place, share one host region).
    ///
    /// # Safety
    /// `stream` must be a valid stream (or NULL) of the buffers' device.
    pub unsafe fn begin(
        op: &GroupOp,
        rank: usize,
        nranks: usize,
        stream: *mut c_void,
        device: i32,
    ) -> CudaResult<Staging> {
        use_device(device)?;
        let stream = stream as sys::CUstream;
        let mut bufs: Vec<Buf> = buffers(op, rank, nranks)
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
        let op = map_ptrs(op, |p| {
            for &(d, n, h) in &map {
                if p >= d && p < d + n as u64 {
                    return h + (p - d);
                }
            }
            p
        });
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
