//! One rank of `weft bench` (the hidden `weft bench-rank` command): joins the
//! communicator from the launcher's environment, times every size out of
//! place and in place, checks results when asked, and on rank 0 prints the
//! table.
//!
//! Timing, per size and placement: `-w` warm-up calls, a barrier (a
//! one-element all-reduce), then `--iters` back-to-back calls timed with a
//! monotonic clock; time per call = elapsed / iters on each rank, averaged
//! over ranks (nccl-tests' default `-a 1`). With `--check`, one more call on
//! freshly filled random data is checked afterwards (not timed).

use std::io::Write;
use std::time::Instant;

use libcomm::cuda::{self, mem};
use libcomm::{Communicator, DataType, ReduceOp};

use super::args::{BenchArgs, Device};
use super::ops::{BenchOp, Layout};
use super::report::{self, Header, Measure, Row};
use super::sizes;
use weft_contract::params;

/// Where rank 0 reports the total of wrong elements to `weft bench`.
pub const RESULT_ENV: &str = params::WEFT_BENCH_RESULT.name();

/// Runs one rank; returns its exit code. Under `weft bench` the first rank
/// of the machine reports the wrong values to it ([`RESULT_ENV`]); a rank
/// that another launcher started exits 1 itself when a value was wrong.
pub fn main(args: &BenchArgs) -> i32 {
    let rank = params::WEFT_RANK.raw().unwrap_or_else(|| "?".into());
    let fail = |e: &str| {
        let _ = writeln!(std::io::stderr(), "weft bench: rank {rank}: {e}");
        1
    };
    match run(args) {
        Ok(wrong) => match params::WEFT_BENCH_RESULT.raw_os() {
            Some(path) if params::WEFT_LOCAL_RANK.get().unwrap_or(0) == 0 => {
                match std::fs::write(&path, format!("wrong={wrong}\n")) {
                    Ok(()) => 0,
                    Err(e) => fail(&format!("writing {}: {e}", path.to_string_lossy())),
                }
            }
            Some(_) => 0,
            None if wrong > 0 => fail(&format!("{wrong} wrong values")),
            None => 0,
        },
        Err(e) => fail(&e),
    }
}

/// A buffer of `bytes` bytes, 8-byte aligned.
struct Buf(Vec<u64>);

impl Buf {
    fn new(bytes: usize) -> Buf {
        Buf(vec![0u64; bytes.div_ceil(8).max(1)])
    }
    fn bytes(&mut self) -> &mut [u8] {
        let len = self.0.len() * 8;
        // SAFETY: u64 storage viewed as bytes; any bit pattern is valid for both.
        unsafe { std::slice::from_raw_parts_mut(self.0.as_mut_ptr().cast::<u8>(), len) }
    }
    fn ptr(&mut self) -> *mut u8 {
        self.0.as_mut_ptr().cast()
    }
}

/// Device buffers of `--device cuda` (the host `Buf`s then only stage data
/// for `--check`).
struct Gpu {
    dev: i32,
    send: u64,
    recv: u64,
    bytes: usize,
}

impl Gpu {
    /// This rank's GPU: local rank modulo the GPUs the process sees.
    fn open(rank: usize, bytes: usize) -> Result<Gpu, String> {
        cuda::driver().map_err(|e| format!("--device cuda: {e}"))?;
        let ngpu = cuda::device_count();
        if ngpu == 0 {
            return Err("--device cuda: the CUDA driver sees no GPU".into());
        }
        let local = params::WEFT_LOCAL_RANK.get().unwrap_or(rank);
        let dev = (local % ngpu as usize) as i32;
        let bytes = bytes.max(16);
        let send = mem::alloc(dev, bytes).map_err(|e| format!("--device cuda: GPU {dev}: {e}"))?;
        let recv = mem::alloc(dev, bytes).map_err(|e| format!("--device cuda: GPU {dev}: {e}"))?;
        Ok(Gpu {
            dev,
            send,
            recv,
            bytes,
        })
    }

    fn sync(&self) -> Result<(), String> {
        mem::sync(self.dev).map_err(|e| format!("waiting for GPU {}: {e}", self.dev))
    }
}

impl Drop for Gpu {
    fn drop(&mut self) {
        let _ = mem::free(self.dev, self.send);
        let _ = mem::free(self.dev, self.recv);
    }
}

struct Bench<'a> {
    comm: &'a Communicator,
    args: &'a BenchArgs,
    rank: usize,
    n: usize,
    send: Buf,
    recv: Buf,
    gpu: Option<Gpu>,
}

fn err(what: &str, e: libcomm::Error) -> String {
    format!("{what}: {e}")
}

/// The host this rank reports in the header: `WEFT_HOSTNAME` when set (as
/// libcomm's host identity), else the machine's (in a pod, the pod's) name.
fn hostname() -> String {
    if let Some(h) = params::WEFT_HOSTNAME.raw().filter(|h| !h.is_empty()) {
        return h;
    }
    let mut b = [0u8; 256];
    // SAFETY: the buffer is valid for its length.
    let r = unsafe { libc::gethostname(b.as_mut_ptr().cast(), b.len()) };
    if r != 0 {
        return "localhost".into();
    }
    let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
    String::from_utf8_lossy(&b[..end]).into_owned()
}

impl Bench<'_> {
    fn barrier(&self) -> Result<(), String> {
        let mut x = [1.0f32];
        self.comm
            .all_reduce_in_place(&mut x, ReduceOp::Sum)
            .map_err(|e| err("barrier", e))
    }

    fn sum_f64(&self, v: f64) -> Result<f64, String> {
        let mut x = [v];
        self.comm
            .all_reduce_in_place(&mut x, ReduceOp::Sum)
            .map_err(|e| err("combining times", e))?;
        Ok(x[0])
    }

    fn sum_u64(&self, v: u64) -> Result<u64, String> {
        let mut x = [v];
        self.comm
            .all_reduce_in_place(&mut x, ReduceOp::Sum)
            .map_err(|e| err("combining error counts", e))?;
        Ok(x[0])
    }

    /// The send and receive pointers of one call.
    fn ptrs(&mut self, l: &Layout, in_place: bool) -> (*const u8, *mut u8) {
        let ts = self.args.dtype.size();
        let (send, recv) = match &self.gpu {
            Some(g) => (g.send as *mut u8, g.recv as *mut u8),
            None => (self.send.ptr(), self.recv.ptr()),
        };
        if in_place {
            let (so, ro) = self.args.coll.inplace_offsets(l, self.rank);
            // Address arithmetic only (device pointers are never dereferenced
            // here); offsets stay within the receive buffer.
            (
                recv.wrapping_add(so * ts).cast_const(),
                recv.wrapping_add(ro * ts),
            )
        } else {
            (send.cast_const(), recv)
        }
    }

    /// Waits for the GPU's queued work (nothing on the host path).
    fn drain(&self) -> Result<(), String> {
        self.gpu.as_ref().map_or(Ok(()), Gpu::sync)
    }

    fn call(&mut self, l: &Layout, in_place: bool) -> Result<(), String> {
        let (s, r) = self.ptrs(l, in_place);
        let a = self.args;
        let mut ops = a.coll.group_ops(
            self.rank,
            self.n,
            s,
            r,
            l,
            a.dtype,
            a.redop,
            a.root as usize,
        );
        if let Some(g) = &self.gpu {
            ops = ops
                .into_iter()
                .map(|op| op.on(libcomm::Memory::Device(g.dev), std::ptr::null_mut()))
                .collect();
        }
        // SAFETY: both buffers (host, or device sized alike) hold
        // `buffer_elems` of the largest layout; the in-place offsets are
        // those the collective documents.
        unsafe { super::ops::submit_ops(self.comm, ops) }.map_err(|e| err(a.coll.name(), e))
    }

    /// Times one size in one placement; checks it with `--check`.
    fn measure(&mut self, l: &Layout, in_place: bool, seed: u64) -> Result<Measure, String> {
        let a = self.args;
        for _ in 0..a.warmup {
            self.call(l, in_place)?;
        }
        self.drain()?;
        self.barrier()?;
        let t0 = Instant::now();
        for _ in 0..a.iters {
            self.call(l, in_place)?;
        }
        self.drain()?;
        let secs = t0.elapsed().as_secs_f64() / a.iters as f64;
        let secs = self.sum_f64(secs)? / self.n as f64;
        let algbw = a.coll.algbw(l, a.dtype, self.n, secs);
        let wrong = if a.check && (!in_place || a.coll.checks_in_place()) {
            Some(self.check(l, in_place, seed)?)
        } else {
            None
        };
        Ok(Measure {
            time_us: secs * 1e6,
            algbw,
            busbw: algbw * a.coll.busbw_factor(self.n),
            wrong,
        })
    }

    /// One call on random data; returns the wrong elements summed over ranks.
    fn check(&mut self, l: &Layout, in_place: bool, seed: u64) -> Result<u64, String> {
        let a = self.args;
        let ts = a.dtype.size();
        let d = a.coll.data(a.dtype, a.redop, self.n, seed);
        let (so, ro) = if in_place {
            a.coll.inplace_offsets(l, self.rank)
        } else {
            (0, 0)
        };
        let send_len = l.send_elems * ts;
        if in_place {
            let buf = self.recv.bytes();
            d.fill_sentinel(&mut buf[..l.buffer_elems() * ts]);
            d.fill(self.rank, 0, &mut buf[so * ts..so * ts + send_len]);
        } else {
            d.fill_sentinel(&mut self.recv.bytes()[..l.recv_elems * ts]);
            d.fill(self.rank, 0, &mut self.send.bytes()[..send_len]);
        }
        if let Some(g) = &self.gpu {
            let span = l.buffer_elems() * ts;
            let up = |dst: u64, b: &mut Buf, n: usize| mem::htod(g.dev, dst, &b.bytes()[..n]);
            up(g.recv, &mut self.recv, span.max(l.recv_elems * ts))
                .and_then(|_| up(g.send, &mut self.send, send_len))
                .map_err(|e| format!("copying check data to GPU {}: {e}", g.dev))?;
        }
        self.call(l, in_place)?;
        if let Some(g) = &self.gpu {
            g.sync()?;
            let n = l.buffer_elems() * ts;
            let (dev, recv) = (g.dev, g.recv);
            mem::dtoh(dev, &mut self.recv.bytes()[..n], recv)
                .map_err(|e| format!("copying results from GPU {dev}: {e}"))?;
        }
        let out = &self.recv.bytes()[ro * ts..ro * ts + l.recv_elems * ts];
        let wrong = a.coll.wrong(&d, self.rank, a.root as usize, l, out);
        self.sum_u64(wrong)
    }
}

/// Bytes of a host name in the header's gather (Linux's HOST_NAME_MAX is 64).
const HOST_BYTES: usize = 64;

/// Every rank's pid and host name, gathered for the header.
fn who_is_where(comm: &Communicator) -> Result<Vec<(u32, String)>, String> {
    let n = comm.count();
    let mut mine = [0u8; 8 + HOST_BYTES];
    mine[..8].copy_from_slice(&u64::from(std::process::id()).to_le_bytes());
    let host = hostname();
    let len = host.len().min(HOST_BYTES);
    mine[8..8 + len].copy_from_slice(&host.as_bytes()[..len]);
    let mut all = vec![0u8; n * mine.len()];
    comm.all_gather(&mine, &mut all)
        .map_err(|e| err("gathering rank information", e))?;
    Ok(all
        .chunks(mine.len())
        .map(|c| {
            let pid = u64::from_le_bytes(c[..8].try_into().unwrap_or_default());
            let name = &c[8..];
            let end = name.iter().position(|&b| b == 0).unwrap_or(name.len());
            (
                pid as u32,
                String::from_utf8_lossy(&name[..end]).into_owned(),
            )
        })
        .collect())
}

/// The benchmark on this rank; returns the wrong values over all ranks.
fn run(args: &BenchArgs) -> Result<u64, String> {
    // Under `weft run --sidecar` (or in a pod) report to the sidecar; the
    // embedded engine is not worth its thread for a benchmark.
    if params::WEFT_SIDECAR_SOCKET
        .raw_os()
        .is_some_and(|s| !s.is_empty())
    {
        crate::embedded::install_from_env()?;
    }
    let comm = Communicator::from_env().map_err(|e| err("joining the communicator", e))?;
    let rank = comm.rank();
    let n = comm.count();
    if let Some(asked) = args.nranks
        && n != asked as usize
    {
        return Err(format!("started with {n} ranks but -n {asked} was asked"));
    }
    let coll: BenchOp = args.coll;
    let dt: DataType = args.dtype;
    let sizes = sizes::sweep(args.min_bytes, args.max_bytes, args.factor);
    let largest = sizes
        .iter()
        .map(|&s| coll.layout(s, dt, n).buffer_elems())
        .max()
        .unwrap_or(0);
    let bytes = largest * dt.size();
    let gpu = match args.device {
        Device::Cuda => Some(Gpu::open(rank, bytes)?),
        Device::Host => None,
    };
    let mut b = Bench {
        comm: &comm,
        args,
        rank,
        n,
        send: Buf::new(bytes),
        recv: Buf::new(bytes),
        gpu,
    };
    // Valid, finite values of the type in both buffers (never NaN or
    // subnormal patterns, which would time the FPU rather than the fabric).
    let init = coll.data(dt, args.redop, n, 0);
    let init = super::check::Data {
        op: Some(args.redop),
        ..init
    };
    init.fill(rank, 0, &mut b.send.bytes()[..bytes]);
    init.fill(rank, 0, &mut b.recv.bytes()[..bytes]);
    if let Some(g) = &b.gpu {
        let n = bytes.min(g.bytes);
        mem::htod(g.dev, g.send, &b.send.bytes()[..n])
            .and_then(|_| mem::htod(g.dev, g.recv, &b.recv.bytes()[..n]))
            .map_err(|e| format!("filling GPU {}: {e}", g.dev))?;
    }

    let header = Header {
        op: coll.name(),
        nranks: n,
        min_bytes: args.min_bytes,
        max_bytes: args.max_bytes,
        factor: args.factor,
        warmup: args.warmup,
        iters: args.iters,
        check: args.check,
        device: match args.device {
            Device::Cuda => "cuda",
            Device::Host => "host",
        },
        algo: args.algo.clone(),
        ranks: who_is_where(&comm)?,
    };
    let mut out = std::io::stdout();
    let print = rank == 0 && !args.json;
    if print {
        let _ = out.write_all(report::header(&header).as_bytes());
        let _ = out.flush();
    }
    let redop = if coll.has_redop() {
        args.redop.name()
    } else {
        "none"
    };
    let root = if coll.has_root() {
        args.root as i64
    } else {
        -1
    };
    let mut rows = Vec::with_capacity(sizes.len());
    for (i, &size) in sizes.iter().enumerate() {
        let l = coll.layout(size, dt, n);
        let seed = 0x5eed_0000 + 2 * i as u64;
        let oop = b.measure(&l, false, seed)?;
        let ip = b.measure(&l, true, seed + 1)?;
        let row = Row {
            size: l.bytes(dt),
            count: l.count,
            dtype: dt.name(),
            redop,
            root,
            out_of_place: oop,
            in_place: ip,
        };
        if print {
            let _ = out.write_all(report::row(&row).as_bytes());
            let _ = out.flush();
        }
        rows.push(row);
    }
    if rank == 0 {
        let text = if args.json {
            report::json(&header, dt.name(), redop, root, &rows)
        } else {
            report::footer(coll.name(), &rows)
        };
        let _ = out.write_all(text.as_bytes());
        let _ = out.flush();
    }
    comm.destroy()
        .map_err(|e| err("destroying the communicator", e))?;
    drop(b);
    // Every rank holds the sum over ranks (the checks all-reduce it).
    Ok(report::total_wrong(&rows))
}
