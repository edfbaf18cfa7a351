//! The copies of a device job across hosts between its device buffers and
//! its pinned buffer (`proxy.rs` enqueues them, `pinned_plan.rs` lists
//! them): the copy kernel (the point-to-point kernel's sequential copy
//! ops: one launch for every slice's copies in, one per slice out), or the
//! copy engines (`cuMemcpyAsync`, one call per copy).
//!
//! Why a kernel by default: what a copy-engine copy costs the calling
//! thread grows with its size (the driver cuts it up: 12-20 us per 64 MiB
//! from device to host on an H200, so 25-39 us for the 128 MiB rail part
//! of a 256 MiB all-reduce on 2 hosts x 2 GPUs), and such a call must
//! return within 100 us (issue 32). A launch costs a few microseconds at
//! any size, and the kernel writes the jobs' `ready` and `released` words
//! itself (per block: `pinned.rs`), so a 256 MiB all-reduce in 4 slices
//! costs 1 + 4 launches and 4 waits instead of 16 driver calls. The
//! price: the copies run on [`SLOTS`] SMs while they last, as NCCL's
//! kernels copy into its network buffers.
//! By default (`WEFT_CROSSHOST_COPY=auto`) only jobs of 16 MiB or more
//! take the kernel ([`KERNEL_MIN_BYTES`]: below, the engines were faster
//! and cheap to enqueue); `kernel` and `engine` force one for all; a
//! library without kernels (no cubin, no NVRTC) always uses the engines.

use super::abi::{MAX_P2P, MAX_RANKS, P2P_COPY_SEQ, P2pArgs, P2pOp};
use super::driver::compute_capability;
use super::error::{CudaResult, check};
use super::kernels::{P2P_KERNEL, available_for, function};
use super::pinned::{Lease, SLOTS};
use super::pinned_plan::Staged;
use cudarc::driver::sys;
use std::ffi::c_void;

/// `WEFT_CROSSHOST_COPY=auto`: jobs of at least this many bytes take the
/// kernel, smaller ones the engines. On 2 x H200 as 2 hosts x 1 the kernel
/// cost 1 MiB operations a quarter to a half of their bandwidth (its reads
/// of pinned memory across PCIe; the engines were faster there), was even
/// from 16 MiB, and a small copy's enqueue is cheap for the engines too.
const KERNEL_MIN_BYTES: usize = 16 << 20;

/// Which hardware moves a job's bytes between device and pinned memory:
/// the copy kernel for jobs of at least `kernel_from` bytes (every such
/// job's copies in one launch, each one's copies out one launch; its
/// blocks flag `ready` and `released`), the copy engines (one
/// `cuMemcpyAsync` per copy, stream memory operations for the words) for
/// the others.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Copier {
    /// None: the engines for every job.
    kernel_from: Option<usize>,
}

/// Which hardware one job's copies take.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mover {
    Kernel,
    Engine,
}

impl Copier {
    /// The engines for every job.
    pub const ENGINES: Copier = Copier { kernel_from: None };

    /// What `setting` (`WEFT_CROSSHOST_COPY`: `auto`, `kernel` or
    /// `engine`) gives on device `dev`: the kernel only where the library
    /// has it for the device.
    pub fn choose(setting: &str, dev: i32) -> Copier {
        let has_kernel = || compute_capability(dev).is_ok_and(|cc| available_for(cc, P2P_KERNEL));
        let kernel_from = match setting {
            "engine" => None,
            "kernel" => Some(0),
            _ => Some(KERNEL_MIN_BYTES),
        };
        Copier {
            kernel_from: kernel_from.filter(|_| has_kernel()),
        }
    }

    pub fn describe(self) -> String {
        match self.kernel_from {
            None => "the copy engines".into(),
            Some(0) => "the copy kernel".into(),
            Some(b) => format!(
                "the copy kernel from {} MiB a job, else the copy engines",
                b >> 20
            ),
        }
    }

    fn mover(self, job_bytes: usize) -> Mover {
        match self.kernel_from {
            Some(b) if job_bytes >= b => Mover::Kernel,
            _ => Mover::Engine,
        }
    }

    /// How a job of `bytes` signals `ready` and `released` (`Pool::take`).
    pub(super) fn slots_for(self, bytes: usize) -> usize {
        match self.mover(bytes) {
            Mover::Kernel => SLOTS,
            Mover::Engine => 0,
        }
    }

    /// Enqueues on `stream` the copies of `jobs` (each: what it stages,
    /// its buffer, its sequence number) into their pinned buffers (and a
    /// broadcast root's own device-to-device copy), each followed by its
    /// `ready` signal, in job order: the first job's bytes are all in
    /// place first, so its network part starts while the next ones copy.
    ///
    /// # Safety
    /// The jobs' device addresses are valid device memory of `dev` until
    /// the stream passes the copies; each buffer holds its job's bytes.
    pub(super) unsafe fn copy_in(
        self,
        dev: i32,
        jobs: &[(&Staged, &Lease, u32)],
        stream: sys::CUstream,
    ) -> CudaResult<()> {
        let mut pieces = Vec::new();
        for &(s, buf, seq) in jobs {
            let how = self.mover(s.bytes);
            let first = pieces.len();
            pieces.extend(s.dtod.iter().map(|&(dst, src, bytes)| Piece {
                dst,
                src,
                bytes,
                from_pinned: false,
                how,
                signal: None,
            }));
            pieces.extend(s.to_host.iter().map(|c| Piece {
                dst: buf.at(c.off, how),
                src: c.dev,
                bytes: c.bytes,
                from_pinned: false,
                how,
                signal: None,
            }));
            let (ready, _, _) = buf.words;
            let signal = match how {
                Mover::Kernel => Signal::Slots(buf.slot_words.0, seq),
                Mover::Engine => Signal::Word(ready, seq),
            };
            signal_after(&mut pieces, first, how, signal);
        }
        unsafe { enqueue(dev, &pieces, stream) }
    }

    /// Enqueues on `stream` job `seq`'s copies out of its pinned buffer
    /// `buf` back to the device (after the stream's wait for its `done`),
    /// then its `released` signal.
    ///
    /// # Safety
    /// As [`copy_in`](Self::copy_in).
    pub(super) unsafe fn copy_out(
        self,
        dev: i32,
        s: &Staged,
        buf: &Lease,
        seq: u32,
        stream: sys::CUstream,
    ) -> CudaResult<()> {
        let how = self.mover(s.bytes);
        let mut pieces: Vec<Piece> = s
            .to_device
            .iter()
            .map(|c| Piece {
                dst: c.dev,
                src: buf.at(c.off, how),
                bytes: c.bytes,
                from_pinned: true,
                how,
                signal: None,
            })
            .collect();
        let (_, _, released) = buf.words;
        let signal = match how {
            Mover::Kernel => Signal::Slots(buf.slot_words.1, seq),
            Mover::Engine => Signal::Word(released, seq),
        };
        signal_after(&mut pieces, 0, how, signal);
        unsafe { enqueue(dev, &pieces, stream) }
    }
}

/// Enqueues `pieces` in order: each run of kernel pieces as launches, the
/// engines' one by one.
unsafe fn enqueue(dev: i32, pieces: &[Piece], stream: sys::CUstream) -> CudaResult<()> {
    for run in pieces.chunk_by(|a, b| a.how == b.how) {
        match run[0].how {
            Mover::Kernel => unsafe { launch_copies(dev, run, stream)? },
            Mover::Engine => {
                for p in run {
                    unsafe { engine_copy(p, stream)? };
                }
            }
        }
    }
    Ok(())
}

impl Lease {
    /// The address of byte `off` of the buffer's data as `how` addresses
    /// it: the kernel through the device mapping, the engines through the
    /// host address.
    fn at(&self, off: usize, how: Mover) -> u64 {
        match how {
            Mover::Kernel => self.dev_data + off as u64,
            Mover::Engine => self.data as u64 + off as u64,
        }
    }
}

/// How the end of a job's copies is made known to the progress thread
/// and the pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Signal {
    /// The stream writes `seq` to this word (`cuStreamWriteValue32`, whose
    /// default is preceded by a system-scope fence of the stream's work).
    Word(u64, u32),
    /// Every block of the copy kernel writes `seq` into its word of this
    /// array once its part of the job's copies is done.
    Slots(u64, u32),
}

/// One copy as a launch or an engine call takes it; `signal`: the job's
/// copies end with it.
#[derive(Clone, Copy, Debug)]
struct Piece {
    dst: u64,
    src: u64,
    bytes: usize,
    /// The source is pinned memory the CPU wrote (cache-bypassing loads).
    from_pinned: bool,
    how: Mover,
    signal: Option<Signal>,
}

/// Puts `signal` on the last of the job's pieces from `first` on (an
/// empty copy carries it where the job copies nothing this way).
fn signal_after(pieces: &mut Vec<Piece>, first: usize, how: Mover, signal: Signal) {
    if pieces.len() == first {
        pieces.push(Piece {
            dst: 0,
            src: 0,
            bytes: 0,
            from_pinned: false,
            how,
            signal: None,
        });
    }
    if let Some(last) = pieces.last_mut() {
        last.signal = Some(signal);
    }
}

unsafe fn engine_copy(p: &Piece, stream: sys::CUstream) -> CudaResult<()> {
    unsafe {
        if p.bytes > 0 {
            check(
                sys::cuMemcpyAsync(p.dst, p.src, p.bytes, stream),
                "cuMemcpyAsync (between device memory and the cross-host pinned buffer)",
            )?;
        }
        match p.signal {
            Some(Signal::Word(word, seq)) => check(
                sys::cuStreamWriteValue32_v2(stream, word, seq, 0),
                "cuStreamWriteValue32 (a cross-host job's ready or released word)",
            ),
            Some(Signal::Slots(..)) => unreachable!("the engines signal with words"),
            None => Ok(()),
        }
    }
}

/// The copy kernel's ops for `pieces` (at most [`MAX_P2P`]): every block
/// takes its part of each in turn (`P2P_COPY_SEQ`).
fn copy_ops(pieces: &[Piece]) -> Vec<P2pOp> {
    pieces
        .iter()
        .map(|p| {
            let (base, seq) = match p.signal {
                Some(Signal::Slots(at, seq)) => (at, seq as u64),
                Some(Signal::Word(..)) => unreachable!("the kernel signals with slots"),
                None => (0, 0),
            };
            P2pOp {
                ptr: p.dst,
                src: p.src,
                bytes: p.bytes as u64,
                seq,
                base,
                peer: p.from_pinned as i32,
                kind: P2P_COPY_SEQ,
                block0: 0,
                nblocks: SLOTS as i32,
            }
        })
        .collect()
}

/// One launch of the point-to-point kernel of [`SLOTS`] blocks per
/// [`MAX_P2P`] pieces.
unsafe fn launch_copies(dev: i32, pieces: &[Piece], stream: sys::CUstream) -> CudaResult<()> {
    let f = function(dev, P2P_KERNEL)?;
    for chunk in pieces.chunks(MAX_P2P) {
        let ops = copy_ops(chunk);
        let mut a = P2pArgs {
            flags: [0; MAX_RANKS],
            status: 0,
            rank: 0,
            nops: ops.len() as i32,
            ops: [P2pOp::default(); MAX_P2P],
            scratch: [0; MAX_RANKS],
            region: 0,
            step: 0,
            slots: 0,
            direct: 1,
        };
        a.ops[..ops.len()].copy_from_slice(&ops);
        let mut params = [(&mut a as *mut P2pArgs).cast::<c_void>()];
        unsafe {
            check(
                sys::cuLaunchKernel(
                    f,
                    SLOTS as u32,
                    1,
                    1,
                    512,
                    1,
                    1,
                    0,
                    stream,
                    params.as_mut_ptr(),
                    std::ptr::null_mut(),
                ),
                "cuLaunchKernel (weft_p2p: the cross-host path's copies)",
            )?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn piece(bytes: usize) -> Piece {
        Piece {
            dst: 0x1000,
            src: 0x2000,
            bytes,
            from_pinned: false,
            how: Mover::Kernel,
            signal: None,
        }
    }

    #[test]
    fn auto_gives_large_jobs_the_kernel_and_small_ones_the_engines() {
        let auto = Copier {
            kernel_from: Some(KERNEL_MIN_BYTES),
        };
        assert_eq!(auto.mover(KERNEL_MIN_BYTES), Mover::Kernel);
        assert_eq!(auto.mover(KERNEL_MIN_BYTES - 1), Mover::Engine);
        assert_eq!(auto.slots_for(64 << 20), SLOTS);
        assert_eq!(auto.slots_for(1 << 20), 0);
        assert_eq!(Copier::ENGINES.slots_for(1 << 30), 0);
        let kernel = Copier {
            kernel_from: Some(0),
        };
        assert_eq!(kernel.slots_for(1), SLOTS);
    }

    #[test]
    fn each_job_signals_after_its_last_copy_even_with_none() {
        let mut pieces = vec![piece(1), piece(2)];
        signal_after(&mut pieces, 0, Mover::Kernel, Signal::Slots(0xa0, 5));
        // A job that copies nothing this way (a broadcast's other ranks in)
        // still signals: an empty copy carries it.
        signal_after(&mut pieces, 2, Mover::Kernel, Signal::Slots(0xb0, 6));
        let signals: Vec<_> = pieces.iter().map(|p| p.signal).collect();
        assert_eq!(
            signals,
            vec![
                None,
                Some(Signal::Slots(0xa0, 5)),
                Some(Signal::Slots(0xb0, 6))
            ]
        );
        assert_eq!(pieces[2].bytes, 0);
    }

    #[test]
    fn kernel_ops_take_every_block_in_turn_and_flag_the_jobs_slots() {
        let mut pieces = vec![piece(3 << 20), piece(1 << 20)];
        pieces[1].from_pinned = true;
        signal_after(&mut pieces, 0, Mover::Kernel, Signal::Slots(0xc0, 9));
        let ops = copy_ops(&pieces);
        assert!(
            ops.iter()
                .all(|o| o.kind == P2P_COPY_SEQ && o.block0 == 0 && o.nblocks == SLOTS as i32)
        );
        assert_eq!(
            (ops[0].base, ops[0].peer),
            (0, 0),
            "no flag before the job's end"
        );
        assert_eq!((ops[1].base, ops[1].seq, ops[1].peer), (0xc0, 9, 1));
        assert_eq!(
            (ops[0].ptr, ops[0].src, ops[0].bytes),
            (0x1000, 0x2000, 3 << 20)
        );
    }
}
