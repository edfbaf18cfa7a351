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
//! `WEFT_CROSSHOST_COPY=engine` keeps the SMs free; a library without
//! kernels (no cubin, no NVRTC) always uses the engines.

use super::abi::{MAX_P2P, MAX_RANKS, P2P_COPY_SEQ, P2pArgs, P2pOp};
use super::driver::compute_capability;
use super::error::{CudaResult, check};
use super::kernels::{P2P_KERNEL, available_for, function};
use super::pinned::{Lease, SLOTS};
use super::pinned_plan::Staged;
use cudarc::driver::sys;
use std::ffi::c_void;

/// Which hardware moves a job's bytes between device and pinned memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Copier {
    /// The copy kernel: every slice's copies in one launch, each slice's
    /// copies out one launch; its blocks flag `ready` and `released`.
    Kernel,
    /// The copy engines (one `cuMemcpy*Async` per copy) and the stream's
    /// memory operations for the words.
    Engine,
}

impl Copier {
    /// What `setting` (`WEFT_CROSSHOST_COPY`: `kernel` or `engine`) gives on
    /// device `dev`: the kernel only where the library has it for the
    /// device.
    pub fn choose(setting: &str, dev: i32) -> Copier {
        let has_kernel = || compute_capability(dev).is_ok_and(|cc| available_for(cc, P2P_KERNEL));
        if setting != "engine" && has_kernel() {
            Copier::Kernel
        } else {
            Copier::Engine
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Copier::Kernel => "the copy kernel",
            Copier::Engine => "the copy engines",
        }
    }

    /// How the pinned buffers' `ready` and `released` look (`Pool::new`).
    pub(super) fn slots(self) -> usize {
        match self {
            Copier::Kernel => SLOTS,
            Copier::Engine => 0,
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
            let first = pieces.len();
            pieces.extend(s.dtod.iter().map(|&(dst, src, bytes)| Piece {
                dst,
                src,
                bytes,
                from_pinned: false,
                signal: None,
            }));
            pieces.extend(s.to_host.iter().map(|c| Piece {
                dst: buf.at(c.off, self),
                src: c.dev,
                bytes: c.bytes,
                from_pinned: false,
                signal: None,
            }));
            let (ready, _, _) = buf.words;
            let signal = match self {
                Copier::Kernel => Signal::Slots(buf.slot_words.0, seq),
                Copier::Engine => Signal::Word(ready, seq),
            };
            signal_after(&mut pieces, first, signal);
        }
        unsafe { self.enqueue(dev, &pieces, stream) }
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
        let mut pieces: Vec<Piece> = s
            .to_device
            .iter()
            .map(|c| Piece {
                dst: c.dev,
                src: buf.at(c.off, self),
                bytes: c.bytes,
                from_pinned: true,
                signal: None,
            })
            .collect();
        let (_, _, released) = buf.words;
        let signal = match self {
            Copier::Kernel => Signal::Slots(buf.slot_words.1, seq),
            Copier::Engine => Signal::Word(released, seq),
        };
        signal_after(&mut pieces, 0, signal);
        unsafe { self.enqueue(dev, &pieces, stream) }
    }

    unsafe fn enqueue(self, dev: i32, pieces: &[Piece], stream: sys::CUstream) -> CudaResult<()> {
        match self {
            Copier::Kernel => unsafe { launch_copies(dev, pieces, stream) },
            Copier::Engine => pieces
                .iter()
                .try_for_each(|p| unsafe { engine_copy(p, stream) }),
        }
    }
}

impl Lease {
    /// The address of byte `off` of the buffer's data as `how` addresses
    /// it: the kernel through the device mapping, the engines through the
    /// host address.
    fn at(&self, off: usize, how: Copier) -> u64 {
        match how {
            Copier::Kernel => self.dev_data + off as u64,
            Copier::Engine => self.data as u64 + off as u64,
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
    signal: Option<Signal>,
}

/// Puts `signal` on the last of the job's pieces from `first` on (an
/// empty copy carries it where the job copies nothing this way).
fn signal_after(pieces: &mut Vec<Piece>, first: usize, signal: Signal) {
    if pieces.len() == first {
        pieces.push(Piece {
            dst: 0,
            src: 0,
            bytes: 0,
            from_pinned: false,
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
            signal: None,
        }
    }

    #[test]
    fn each_job_signals_after_its_last_copy_even_with_none() {
        let mut pieces = vec![piece(1), piece(2)];
        signal_after(&mut pieces, 0, Signal::Slots(0xa0, 5));
        // A job that copies nothing this way (a broadcast's other ranks in)
        // still signals: an empty copy carries it.
        signal_after(&mut pieces, 2, Signal::Slots(0xb0, 6));
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
        signal_after(&mut pieces, 0, Signal::Slots(0xc0, 9));
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
