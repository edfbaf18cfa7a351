//! A communicator's device side: peer-visible scratch + flags on every rank's
//! GPU, mapped by every other rank (P2P in one process, IPC across processes),
//! and the kernel launches that use them.

use super::{CudaResult, check, compute_capability, kernels, use_device};
use crate::group::GroupOp;
use crate::types::{DataType, ReduceOp};
use cudarc::driver::sys;
use std::collections::HashMap;
use std::ffi::{CString, c_void};
use std::sync::{Mutex, OnceLock};

pub const MAX_RANKS: usize = 8;
pub const MAX_BLOCKS: usize = 128;
const FLAG_AREA: usize = 64 << 10;
/// Bytes of one rank's descriptor in the init exchange.
pub const DESCRIPTOR_BYTES: usize = 128;

const K_ALLREDUCE: i32 = 0;
const K_ALLREDUCE_2SHOT: i32 = 1;
const K_REDUCE: i32 = 2;
const K_REDUCESCATTER: i32 = 3;
const K_ALLGATHER: i32 = 4;
const K_BROADCAST: i32 = 5;
const K_ALLTOALL: i32 = 6;

/// Must match `struct Args` in kernels/collectives.cu.
#[repr(C)]
#[derive(Clone, Copy)]
struct Args {
    scratch: [u64; MAX_RANKS],
    flags: [u64; MAX_RANKS],
    input: u64,
    output: u64,
    count: u64,
    chunk: u64,
    seq_base: u64,
    rank: i32,
    nranks: i32,
    kind: i32,
    root: i32,
    parity_bytes: u64,
    direct: i32,
    pad: i32,
}

/// A random token naming this process (pids repeat across containers).
fn process_token() -> u64 {
    static T: OnceLock<u64> = OnceLock::new();
    *T.get_or_init(|| {
        let mut b = [0u8; 8];
        let _ = getrandom::fill(&mut b);
        u64::from_le_bytes(b) ^ std::process::id() as u64
    })
}

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The device algorithm override: `WEFT_CUDA_ALGO` = oneshot | twoshot | staged.
fn algo_override() -> Option<String> {
    std::env::var("WEFT_CUDA_ALGO")
        .ok()
        .filter(|s| !s.is_empty())
        .map(|s| s.to_ascii_lowercase())
}

/// How one operation runs on the kernel path.
#[derive(Clone, Copy, Debug)]
pub struct Plan {
    kind: i32,
    func: &'static str,
    input: u64,
    output: u64,
    count: usize,
    elem: usize,
    root: i32,
    parts: usize,
}

impl Plan {
    pub fn algorithm(&self) -> &'static str {
        match self.kind {
            K_ALLREDUCE => "one-shot",
            K_ALLREDUCE_2SHOT => "two-shot",
            _ => "direct",
        }
    }
}

/// The C++ type behind a kernel type name.
fn c_type(t: &str) -> &'static str {
    match t {
        "i8" => "i8",
        "u8" => "u8",
        "i32" => "i32",
        "u32" => "u32",
        "i64" => "i64",
        "u64" => "u64",
        "f16" => "Half",
        "f32" => "float",
        "f64" => "double",
        "bf16" => "Bf16",
        "f8e4m3" => "E4M3",
        _ => "E5M2",
    }
}

fn op_struct(o: &str) -> &'static str {
    match o {
        "sum" => "OpSum",
        "prod" => "OpProd",
        "max" => "OpMax",
        "min" => "OpMin",
        _ => "OpAvg",
    }
}

/// A kernel on device `dev`: compiled alone (NVRTC, cached in the process and
/// on disk) and loaded on first use.
fn function(dev: i32, name: &str) -> CudaResult<sys::CUfunction> {
    static FUNCS: Mutex<Option<HashMap<(i32, String), usize>>> = Mutex::new(None);
    let mut g = FUNCS.lock().unwrap_or_else(|e| e.into_inner());
    let funcs = g.get_or_insert_with(HashMap::new);
    if let Some(f) = funcs.get(&(dev, name.to_string())) {
        return Ok(*f as sys::CUfunction);
    }
    // weft_coll_<type>_<op>
    let rest = name.strip_prefix("weft_coll_").unwrap_or(name);
    let (t, o) = rest.rsplit_once('_').unwrap_or((rest, "sum"));
    let src = format!(
        "#define WEFT_SINGLE 1\n{}\nWEFT_KERNEL({t}, {}, {o}, {})\n",
        kernels::COLLECTIVES,
        c_type(t),
        op_struct(o)
    );
    let (a, b) = compute_capability(dev)?;
    let arch = format!("compute_{a}{b}");
    let ptx = kernels::compile(name, &src, &arch)?;
    let c = CString::new(ptx).map_err(|_| "PTX holds a NUL byte".to_string())?;
    let mut m: sys::CUmodule = std::ptr::null_mut();
    use_device(dev)?;
    unsafe {
        check(
            sys::cuModuleLoadData(&mut m, c.as_ptr().cast()),
            "cuModuleLoadData",
        )?
    };
    let cname = CString::new(name).unwrap();
    let mut f: sys::CUfunction = std::ptr::null_mut();
    unsafe {
        check(
            sys::cuModuleGetFunction(&mut f, m, cname.as_ptr()),
            "cuModuleGetFunction",
        )?
    };
    funcs.insert((dev, name.to_string()), f as usize);
    Ok(f)
}

/// Compiles one kernel the way [`function`] does, without a device (tests).
pub fn compile_single(name: &str, arch: &str) -> CudaResult<String> {
    let rest = name.strip_prefix("weft_coll_").unwrap_or(name);
    let (t, o) = rest.rsplit_once('_').unwrap_or((rest, "sum"));
    let src = format!(
        "#define WEFT_SINGLE 1\n{}\nWEFT_KERNEL({t}, {}, {o}, {})\n",
        kernels::COLLECTIVES,
        c_type(t),
        op_struct(o)
    );
    kernels::compile_uncached(name, &src, arch)
}

fn type_name(dt: DataType) -> &'static str {
    match dt {
        DataType::I8 => "i8",
        DataType::U8 => "u8",
        DataType::I32 => "i32",
        DataType::U32 => "u32",
        DataType::I64 => "i64",
        DataType::U64 => "u64",
        DataType::F16 => "f16",
        DataType::F32 => "f32",
        DataType::F64 => "f64",
        DataType::Bf16 => "bf16",
        DataType::F8E4M3 => "f8e4m3",
        DataType::F8E5M2 => "f8e5m2",
    }
}

fn func_name(dt: DataType, op: Option<ReduceOp>) -> Option<&'static str> {
    let o = match op {
        None | Some(ReduceOp::Sum) => "sum",
        Some(ReduceOp::Prod) => "prod",
        Some(ReduceOp::Max) => "max",
        Some(ReduceOp::Min) => "min",
        Some(ReduceOp::Avg) => "avg",
        Some(ReduceOp::PreMulSum(_)) => return None,
    };
    static NAMES: Mutex<Option<HashMap<(u8, &'static str), &'static str>>> = Mutex::new(None);
    let mut g = NAMES.lock().unwrap_or_else(|e| e.into_inner());
    let m = g.get_or_insert_with(HashMap::new);
    Some(
        m.entry((dt as u8, o)).or_insert_with(|| {
            Box::leak(format!("weft_coll_{}_{o}", type_name(dt)).into_boxed_str())
        }),
    )
}

/// One rank's device side of a communicator.
pub struct DevComm {
    rank: usize,
    nranks: usize,
    dev: i32,
    cc: (i32, i32),
    base: u64,
    parity_bytes: usize,
    peers: Vec<u64>,
    seq: u64,
    usable: bool,
    /// Every rank is in this process: kernels read peers' buffers in place.
    direct: bool,
}

unsafe impl Send for DevComm {}

impl DevComm {
    /// Phase 1: allocates this rank's area on `dev` and describes it for the
    /// peers (`DESCRIPTOR_BYTES`).
    pub fn create(rank: usize, nranks: usize, dev: i32) -> CudaResult<(DevComm, Vec<u8>)> {
        let ctx = use_device(dev)?;
        let _ = ctx;
        let cc = compute_capability(dev)?;
        let parity_bytes = env_usize("WEFT_CUDA_SCRATCH_MB", 32).max(1) << 20;
        let total = FLAG_AREA + 2 * parity_bytes;
        let mut base: sys::CUdeviceptr = 0;
        unsafe {
            check(sys::cuMemAlloc_v2(&mut base, total), "cuMemAlloc")?;
            check(sys::cuMemsetD8_v2(base, 0, FLAG_AREA), "cuMemsetD8")?;
            check(sys::cuCtxSynchronize(), "cuCtxSynchronize")?;
        }
        let mut d = vec![0u8; DESCRIPTOR_BYTES];
        d[0..8].copy_from_slice(&process_token().to_le_bytes());
        d[8..12].copy_from_slice(&dev.to_le_bytes());
        d[16..24].copy_from_slice(&base.to_le_bytes());
        d[24..32].copy_from_slice(&(parity_bytes as u64).to_le_bytes());
        let mut h = sys::CUipcMemHandle_st { reserved: [0; 64] };
        let ipc_ok = unsafe { sys::cuIpcGetMemHandle(&mut h, base) } == sys::CUresult::CUDA_SUCCESS;
        d[32] = ipc_ok as u8;
        for (i, c) in h.reserved.iter().enumerate() {
            d[64 + i] = *c as u8;
        }
        Ok((
            DevComm {
                rank,
                nranks,
                dev,
                cc,
                base,
                parity_bytes,
                peers: vec![0; nranks],
                seq: 0,
                usable: false,
                direct: false,
            },
            d,
        ))
    }

    /// Phase 2: maps every peer's area from the gathered descriptors
    /// (`nranks * DESCRIPTOR_BYTES`). Ok(false): some peer cannot be mapped
    /// (the reason is returned for the log); the kernel path must then be off
    /// on every rank, which the caller agrees on with the peers.
    pub fn connect(&mut self, all: &[u8]) -> CudaResult<()> {
        if self.nranks > MAX_RANKS {
            return Err(format!(
                "{} ranks: the kernel path supports at most {MAX_RANKS}",
                self.nranks
            ));
        }
        let ctx = use_device(self.dev)?;
        let _ = ctx;
        let me = process_token();
        self.direct = std::env::var("WEFT_CUDA_DIRECT")
            .map(|v| v != "0")
            .unwrap_or(true)
            && (0..self.nranks)
                .all(|r| all[r * DESCRIPTOR_BYTES..r * DESCRIPTOR_BYTES + 8] == me.to_le_bytes());
        for r in 0..self.nranks {
            let d = &all[r * DESCRIPTOR_BYTES..(r + 1) * DESCRIPTOR_BYTES];
            let token = u64::from_le_bytes(d[0..8].try_into().unwrap());
            let dev = i32::from_le_bytes(d[8..12].try_into().unwrap());
            let base = u64::from_le_bytes(d[16..24].try_into().unwrap());
            let pb = u64::from_le_bytes(d[24..32].try_into().unwrap()) as usize;
            if pb != self.parity_bytes {
                return Err(format!(
                    "rank {r} has {pb} bytes of scratch per parity, this rank {} (set WEFT_CUDA_SCRATCH_MB alike everywhere)",
                    self.parity_bytes
                ));
            }
            if r == self.rank {
                self.peers[r] = self.base;
                continue;
            }
            if token == me {
                if dev != self.dev {
                    let peer_ctx = use_device(dev)?;
                    use_device(self.dev)?;
                    let (mut a, mut pd) = (0i32, 0);
                    unsafe {
                        let mut md = 0;
                        check(sys::cuDeviceGet(&mut md, self.dev), "cuDeviceGet")?;
                        check(sys::cuDeviceGet(&mut pd, dev), "cuDeviceGet")?;
                        check(
                            sys::cuDeviceCanAccessPeer(&mut a, md, pd),
                            "cuDeviceCanAccessPeer",
                        )?;
                        if a == 0 {
                            return Err(format!(
                                "GPU {} cannot access GPU {dev} directly (no P2P)",
                                self.dev
                            ));
                        }
                        let r = sys::cuCtxEnablePeerAccess(peer_ctx, 0);
                        if r != sys::CUresult::CUDA_SUCCESS
                            && r != sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED
                        {
                            check(r, "cuCtxEnablePeerAccess")?;
                        }
                    }
                }
                self.peers[r] = base;
            } else {
                if d[32] == 0 {
                    return Err(format!(
                        "rank {r} could not export its scratch (cuIpcGetMemHandle)"
                    ));
                }
                let mut h = sys::CUipcMemHandle_st { reserved: [0; 64] };
                for i in 0..64 {
                    h.reserved[i] = d[64 + i] as _;
                }
                let mut p: sys::CUdeviceptr = 0;
                unsafe {
                    check(
                        sys::cuIpcOpenMemHandle_v2(&mut p, h, 1),
                        "cuIpcOpenMemHandle (CUDA IPC to a rank in another process)",
                    )?
                };
                self.peers[r] = p;
            }
        }
        Ok(())
    }

    /// Sets whether every rank connected (the caller's agreement).
    pub fn set_usable(&mut self, usable: bool) {
        self.usable = usable;
    }

    pub fn usable(&self) -> bool {
        self.usable
    }

    pub fn device(&self) -> i32 {
        self.dev
    }

    /// How `op` runs on the kernel path, or None (staging).
    pub fn plan(&self, op: &GroupOp) -> Option<Plan> {
        if !self.usable || !kernels::nvrtc_available() {
            return None;
        }
        let algo = algo_override();
        if algo.as_deref() == Some("staged") {
            return None;
        }
        let n = self.nranks;
        let (kind, send, recv, count, dtype, rop, root, parts) = match *op {
            GroupOp::AllReduce {
                send,
                recv,
                count,
                dtype,
                op,
            } => {
                let bytes = count * dtype.size();
                let one = match algo.as_deref() {
                    Some("oneshot") => true,
                    Some("twoshot") => false,
                    _ => bytes <= env_usize("WEFT_CUDA_ONESHOT_MAX", 256 << 10) || n <= 2,
                };
                let k = if one { K_ALLREDUCE } else { K_ALLREDUCE_2SHOT };
                (k, send, recv, count, dtype, Some(op), 0, 1)
            }
            GroupOp::Reduce {
                send,
                recv,
                count,
                dtype,
                op,
                root,
            } => (K_REDUCE, send, recv, count, dtype, Some(op), root, 1),
            GroupOp::ReduceScatter {
                send,
                recv,
                count,
                dtype,
                op,
            } => (K_REDUCESCATTER, send, recv, count, dtype, Some(op), 0, n),
            GroupOp::AllGather {
                send,
                recv,
                count,
                dtype,
            } => (K_ALLGATHER, send, recv, count, dtype, None, 0, 1),
            GroupOp::Broadcast {
                send,
                recv,
                count,
                dtype,
                root,
            } => (K_BROADCAST, send, recv, count, dtype, None, root, 1),
            GroupOp::AllToAll {
                send,
                recv,
                count,
                dtype,
            } => (K_ALLTOALL, send, recv, count, dtype, None, 0, n),
            _ => return None,
        };
        if matches!(dtype, DataType::F8E4M3 | DataType::F8E5M2) && self.cc < (8, 9) {
            return None;
        }
        Some(Plan {
            kind,
            func: func_name(dtype, rop)?,
            input: send as u64,
            output: recv as u64,
            count,
            elem: dtype.size(),
            root: root as i32,
            parts,
        })
    }

    /// Enqueues the plan's kernel on `stream` (asynchronous).
    ///
    /// # Safety
    /// The plan's buffers must be device memory of this rank's device, valid
    /// until the stream reaches the kernel's end; every rank must launch the
    /// same sequence of plans.
    pub unsafe fn launch(&mut self, p: &Plan, stream: *mut c_void) -> CudaResult<()> {
        if p.count == 0 {
            return Ok(());
        }
        let f = function(self.dev, p.func)?;
        use_device(self.dev)?;
        let direct = self.direct && p.kind != K_ALLREDUCE;
        let chunk = (self.parity_bytes / p.parts / p.elem) / 16 * 16;
        let chunk = chunk.max(16);
        // A direct kernel uses three barrier values: two sequence numbers.
        let nchunks = if direct {
            2
        } else {
            p.count.div_ceil(chunk) as u64
        };
        let m = if direct { p.count } else { p.count.min(chunk) };
        let max_blocks = env_usize("WEFT_CUDA_BLOCKS", 64).clamp(1, MAX_BLOCKS);
        let blocks = (m * p.elem * p.parts)
            .div_ceil(32 << 10)
            .clamp(1, max_blocks);
        let threads = env_usize("WEFT_CUDA_THREADS", 512).clamp(32, 512);
        let mut a = Args {
            scratch: [0; MAX_RANKS],
            flags: [0; MAX_RANKS],
            input: p.input,
            output: p.output,
            count: p.count as u64,
            chunk: chunk as u64,
            seq_base: self.seq + 1,
            rank: self.rank as i32,
            nranks: self.nranks as i32,
            kind: p.kind,
            root: p.root,
            parity_bytes: self.parity_bytes as u64,
            direct: direct as i32,
            pad: 0,
        };
        for r in 0..self.nranks {
            a.flags[r] = self.peers[r];
            a.scratch[r] = self.peers[r] + FLAG_AREA as u64;
        }
        self.seq += nchunks;
        let mut params = [(&mut a as *mut Args).cast::<c_void>()];
        unsafe {
            check(
                sys::cuLaunchKernel(
                    f,
                    blocks as u32,
                    1,
                    1,
                    threads as u32,
                    1,
                    1,
                    0,
                    stream as sys::CUstream,
                    params.as_mut_ptr(),
                    std::ptr::null_mut(),
                ),
                "cuLaunchKernel",
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The runtime's one-kernel-at-a-time compilation works for every type
    /// family (skips, saying why, without libnvrtc).
    #[test]
    fn single_kernels_compile() {
        if !kernels::nvrtc_available() {
            eprintln!(
                "SKIPPED single_kernels_compile: libnvrtc not found (see libcomm/kernels/ci-nvrtc.sh)"
            );
            return;
        }
        for name in [
            "weft_coll_f8e4m3_max",
            "weft_coll_bf16_avg",
            "weft_coll_i64_prod",
        ] {
            let ptx = compile_single(name, "compute_90").unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(ptx.matches(".entry").count(), 1, "{name}");
            assert!(ptx.contains(&format!(".entry {name}(")), "{name}");
        }
    }

    #[test]
    fn args_layout_matches_the_kernel() {
        // struct Args in collectives.cu: 16 u64, 5 u64, 4 i32, 1 u64.
        assert_eq!(std::mem::size_of::<Args>(), 16 * 8 + 5 * 8 + 4 * 4 + 8 + 8);
    }
}
