//! Pinned host buffers mapped into the device: where a stream and the
//! cross-host progress thread (`proxy.rs`) meet. Each buffer starts with a
//! header of three 32-bit flag words, then holds the staged copies of one
//! job's device buffers:
//!
//! - `ready`: the stream writes the job's sequence number once its copies
//!   to the buffer are done (`cuStreamWriteValue32`); the thread waits for it;
//! - `done`: the thread writes it once the job ran (or failed, or was
//!   released by an abort); the stream waits for it (`cuStreamWaitValue32`,
//!   GEQ) before it copies the results back;
//! - `released`: the stream writes it after the copies back; until then the
//!   buffer is not reused.
//!
//! With the copy kernel (`pinned_copy.rs`) `ready` and `released` are not
//! single words: each block of the kernel's launch (up to [`SLOTS`]) writes
//! its own word once its part of the copies is done (no driver call on the
//! calling thread for them, no atomics across PCIe), and the job is ready
//! (the buffer released) once every block's word reached the sequence
//! number.
//!
//! Words compare cyclically, as CUDA's GEQ wait does (`(i32)(word - value)
//! >= 0`), so sequence numbers may wrap.

use super::driver::use_device;
use super::error::{CudaError, CudaResult, check};
use super::logger::warn;
use cudarc::driver::sys;
use std::ffi::c_void;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// Bytes before the data (the flag words, padded: regions start aligned).
const HEADER: usize = 512;
const READY: usize = 0;
const DONE: usize = 4;
const RELEASED: usize = 8;
/// The copy kernel's blocks (a launch has exactly this many): one `ready`
/// and one `released` word each.
pub(super) const SLOTS: usize = 32;
const READY_SLOTS: usize = 64;
const RELEASED_SLOTS: usize = READY_SLOTS + 4 * SLOTS;
const _: () = assert!(RELEASED_SLOTS + 4 * SLOTS <= HEADER);
/// A job that copies nothing out: its buffer is released when the
/// progress thread is done with it (its `done` word), and its stream
/// never waits for the network (the `released_slots` of such a job).
pub(super) const RELEASED_BY_DONE: usize = usize::MAX;
/// Alignment of each staged region inside a buffer.
pub(super) const ALIGN: usize = 256;
/// The smallest buffer allocated, and the unit of sizes (small jobs share
/// buffers).
const MIN_BYTES: usize = 1 << 20;
/// Pinned memory a communicator's pool grows to before new jobs wait for
/// a buffer to be released (a few large jobs in flight; nccl-tests queues
/// 20 iterations without waiting).
const POOL_BYTES: usize = 2 << 30;
/// How long a job waits for a buffer at the cap before it allocates anyway
/// (a stream that never reaches its jobs must not hang the caller).
const PRESSURE_BOUND: Duration = Duration::from_secs(10);
/// Buffers large enough for a job that may be in use at once before the
/// job waits for one of them to be released instead of pinning another:
/// enough to keep a few jobs on the network and a few being copied while
/// the caller runs ahead. Without it a caller that queues many small
/// operations (nccl-tests queues 20 and more) pinned a new buffer for each
/// inside its timed loop, 1.5-4 ms apiece on 2 x H200 (the calling thread
/// blocked, and the process's sockets slowed while pages were pinned).
const BUSY_FITTING: usize = 8;

/// `a >= b` as CUDA's `CU_STREAM_WAIT_VALUE_GEQ` compares.
pub(super) fn cyclic_geq(a: u32, b: u32) -> bool {
    (a.wrapping_sub(b) as i32) >= 0
}

/// One buffer: host address, its device address, data capacity.
pub(super) struct Pinned {
    host: *mut u8,
    dev: u64,
    cap: usize,
    /// The sequence number of the last job given it (0: never used).
    last: u32,
    /// How that job signals its copies in and its release (0 or a block
    /// count, or [`RELEASED_BY_DONE`]: see [`JobFlags`]).
    last_ready_slots: usize,
    last_released_slots: usize,
    /// A job's enqueue failed half way: the stream may still use it, so it
    /// is never reused (freed at finalize with the rest).
    poisoned: bool,
}

impl Pinned {
    fn alloc(dev: i32, cap: usize) -> CudaResult<Pinned> {
        use_device(dev)?;
        // Pinned on the GPU's NUMA node: the pages come from the node of
        // the thread that pins them (`near_cpus.rs`).
        let _near = super::near_cpus::run_near(dev);
        let mut host: *mut c_void = std::ptr::null_mut();
        let mut dptr: sys::CUdeviceptr = 0;
        unsafe {
            check(
                sys::cuMemHostAlloc(
                    &mut host,
                    HEADER + cap,
                    sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP,
                ),
                "cuMemHostAlloc (pinned buffers of the cross-host path)",
            )?;
            std::ptr::write_bytes(host.cast::<u8>(), 0, HEADER);
            if let Err(e) = check(
                sys::cuMemHostGetDevicePointer_v2(&mut dptr, host, 0),
                "cuMemHostGetDevicePointer",
            ) {
                let _ = sys::cuMemFreeHost(host);
                return Err(e);
            }
        }
        Ok(Pinned {
            host: host.cast(),
            dev: dptr,
            cap,
            last: 0,
            last_ready_slots: 0,
            last_released_slots: 0,
            poisoned: false,
        })
    }

    /// Whether the stream released job `last`, so the buffer can be
    /// reused.
    fn reusable(&self) -> bool {
        !self.poisoned
            && (self.last == 0
                || self
                    .flags(self.last_ready_slots, self.last_released_slots)
                    .released(self.last))
    }

    /// Device address of the data (its mapping into the device).
    fn dev_data(&self) -> u64 {
        self.dev + HEADER as u64
    }

    /// Host address of the data.
    pub(super) fn data(&self) -> *mut u8 {
        // SAFETY: inside the allocation.
        unsafe { self.host.add(HEADER) }
    }

    /// Device addresses of the three words (ready, done, released).
    pub(super) fn dev_words(&self) -> (u64, u64, u64) {
        (
            self.dev + READY as u64,
            self.dev + DONE as u64,
            self.dev + RELEASED as u64,
        )
    }

    /// The words as the progress thread (and the pool) read them.
    pub(super) fn flags(&self, ready_slots: usize, released_slots: usize) -> JobFlags {
        JobFlags {
            header: self.host as usize,
            ready_slots,
            released_slots,
        }
    }

    /// Never reuse it (see `poisoned`).
    pub(super) fn poison(&mut self) {
        self.poisoned = true;
    }
}

/// A job's flag words for the progress thread. Raw: the buffer outlives
/// the job (the pool frees it only once `released` passed the job, or at
/// finalize after the thread ended).
#[derive(Debug, Clone, Copy)]
pub(super) struct JobFlags {
    header: usize,
    /// 0: `ready` is a single word the stream writes; else the copy
    /// kernel's per-block words, this many.
    ready_slots: usize,
    /// The same for `released`.
    released_slots: usize,
}

impl JobFlags {
    fn word(&self, at: usize) -> &AtomicU32 {
        // SAFETY: see the type's docs.
        unsafe { &*((self.header + at) as *const AtomicU32) }
    }

    /// Whether the word at `single` (`slots` 0) or every one of `slots`
    /// words from `slots_at` reached `seq`.
    fn reached(&self, single: usize, slots_at: usize, slots: usize, seq: u32) -> bool {
        if slots == 0 {
            return cyclic_geq(self.word(single).load(Ordering::Acquire), seq);
        }
        (0..slots).all(|b| cyclic_geq(self.word(slots_at + 4 * b).load(Ordering::Acquire), seq))
    }

    /// The stream's copies into the buffer for job `seq` are done.
    pub(super) fn ready(&self, seq: u32) -> bool {
        self.reached(READY, READY_SLOTS, self.ready_slots, seq)
    }

    /// The stream's copies out of the buffer for job `seq` are done (a
    /// job that copies nothing out: the progress thread is done with it
    /// and the stream's copies in are over; a job released without
    /// running, by an abort or an earlier failure, has `done` before its
    /// stream may have copied in).
    fn released(&self, seq: u32) -> bool {
        if self.released_slots == RELEASED_BY_DONE {
            return cyclic_geq(self.word(DONE).load(Ordering::Acquire), seq) && self.ready(seq);
        }
        self.reached(RELEASED, RELEASED_SLOTS, self.released_slots, seq)
    }

    /// Lets the stream go on past job `seq` (its results are in place, or
    /// it failed and the stream must not wait for ever).
    pub(super) fn set_done(&self, seq: u32) {
        self.word(DONE).store(seq, Ordering::Release);
    }

    /// Flags on plain memory of at least 12 bytes (tests of the thread).
    #[cfg(test)]
    pub(super) fn on(header: *mut u32) -> JobFlags {
        JobFlags {
            header: header as usize,
            ready_slots: 0,
            released_slots: 0,
        }
    }

    /// Flags on plain memory of a whole header whose `ready` and
    /// `released` are `slots` per-block words (tests).
    #[cfg(test)]
    pub(super) fn with_slots(header: *mut u32, slots: usize) -> JobFlags {
        JobFlags {
            header: header as usize,
            ready_slots: slots,
            released_slots: slots,
        }
    }

    /// Writes `value` into the `ready` words of `blocks`, as those blocks
    /// of the copy kernel do (tests).
    #[cfg(test)]
    pub(super) fn write_slots_for_test(
        header: &mut [u32],
        blocks: std::ops::Range<usize>,
        value: u32,
    ) {
        for b in blocks {
            header[READY_SLOTS / 4 + b] = value;
        }
    }

    /// `done` as the stream would read it (tests).
    #[cfg(test)]
    pub(super) fn done(&self) -> u32 {
        self.word(DONE).load(Ordering::Acquire)
    }

    /// For host-only use of a buffer (tests): marks `ready` as a stream would.
    #[cfg(test)]
    pub(super) fn set_ready(&self, seq: u32) {
        self.word(READY).store(seq, Ordering::Release);
    }
}

/// A communicator's pinned buffers, reused once the stream released them.
/// A buffer [`Pool::take`] gave a job: where its data and words are. The
/// buffer stays the pool's (it may move in the pool's list).
#[derive(Debug, Clone, Copy)]
pub(super) struct Lease {
    pub data: *mut u8,
    /// The data as the device addresses it (a kernel's copies).
    pub dev_data: u64,
    /// `ready`, `done` and `released` as the stream addresses them.
    pub words: (u64, u64, u64),
    /// The copy kernel's `ready` and `released` slot arrays as the device
    /// addresses them.
    pub slot_words: (u64, u64),
    pub flags: JobFlags,
}

/// Whether a job that found no reusable buffer pins a new one (else it
/// waits for a release): the pool holds fewer than two, or it stays under
/// [`POOL_BYTES`] (`held_after`: with the new one) with fewer than
/// [`BUSY_FITTING`] buffers that fit in use, or the job has waited past
/// [`PRESSURE_BOUND`].
fn pins_another(bufs: usize, held_after: usize, busy_fitting: usize, waited: Duration) -> bool {
    bufs < 2 || (held_after <= POOL_BYTES && busy_fitting < BUSY_FITTING) || waited > PRESSURE_BOUND
}

pub(super) struct Pool {
    dev: i32,
    bufs: Vec<Pinned>,
}

// The raw pointers are pinned host memory owned by the pool.
unsafe impl Send for Pool {}

impl Pool {
    pub(super) fn new(dev: i32) -> Pool {
        Pool {
            dev,
            bufs: Vec::new(),
        }
    }

    /// A buffer of at least `bytes` for job `seq`: the smallest reusable one
    /// that fits, else a new one (a multiple of 1 MiB) while the pool holds
    /// less than [`POOL_BYTES`] and fewer than [`BUSY_FITTING`] buffers
    /// that fit are in use (and always a second one, so one job can be
    /// staged while another runs). Otherwise the caller waits for a buffer
    /// to be released (back pressure, as NCCL's full work FIFO blocks its
    /// caller): the streams and the progress thread release them without
    /// this thread, and reusable buffers too small are freed first.
    ///
    /// `slots`: how job `seq` signals `ready` and `released`: 0, single
    /// words the stream writes; else the copy kernel's per-block words,
    /// that many (at most [`SLOTS`]).
    ///
    /// `stop`: asked while waiting; true ends the wait with an error (the
    /// communicator failed or was aborted: its streams may never release
    /// a buffer, and the caller must hear of the failure, not wait).
    pub(super) fn take(
        &mut self,
        bytes: usize,
        seq: u32,
        (ready_slots, released_slots): (usize, usize),
        stop: &dyn Fn() -> bool,
    ) -> CudaResult<Lease> {
        debug_assert!(
            ready_slots <= SLOTS && (released_slots <= SLOTS || released_slots == RELEASED_BY_DONE)
        );
        let cap = bytes.max(MIN_BYTES).next_multiple_of(MIN_BYTES);
        let started = Instant::now();
        let i = loop {
            let fit = self
                .bufs
                .iter()
                .enumerate()
                .filter(|(_, b)| b.cap >= bytes && b.reusable())
                .min_by_key(|(_, b)| b.cap)
                .map(|(i, _)| i);
            if let Some(i) = fit {
                break i;
            }
            let held: usize = self.bufs.iter().map(|b| b.cap).sum();
            let busy_fitting = self
                .bufs
                .iter()
                .filter(|b| b.cap >= bytes && !b.poisoned)
                .count();
            if pins_another(self.bufs.len(), held + cap, busy_fitting, started.elapsed()) {
                self.bufs.push(Pinned::alloc(self.dev, cap)?);
                break self.bufs.len() - 1;
            }
            // At the byte cap, reusable buffers too small give their memory
            // back for a bigger one (at the count of busy ones, a release
            // is what is waited for).
            let over_bytes = held + cap > POOL_BYTES;
            if let Some(j) = self.bufs.iter().position(|b| over_bytes && b.reusable()) {
                let b = self.bufs.swap_remove(j);
                use_device(self.dev)?;
                unsafe { check(sys::cuMemFreeHost(b.host.cast()), "cuMemFreeHost")? };
                continue;
            }
            if stop() {
                return Err(CudaError::Unsupported(
                    "the communicator failed or was aborted while this operation waited for a pinned buffer of the cross-host path".into(),
                ));
            }
            std::thread::sleep(Duration::from_micros(20));
        };
        let b = &mut self.bufs[i];
        b.last = seq;
        b.last_ready_slots = ready_slots;
        b.last_released_slots = released_slots;
        Ok(Lease {
            data: b.data(),
            dev_data: b.dev_data(),
            words: b.dev_words(),
            slot_words: (b.dev + READY_SLOTS as u64, b.dev + RELEASED_SLOTS as u64),
            flags: b.flags(ready_slots, released_slots),
        })
    }

    /// The buffer of `lease` is never reused (a stream may still copy into
    /// it).
    pub(super) fn poison(&mut self, lease: &Lease) {
        if let Some(b) = self.bufs.iter_mut().find(|b| b.data() == lease.data) {
            b.poison();
        }
    }

    /// Frees every buffer once the stream released it, waiting up to
    /// `wait`; a buffer the stream may still use is left allocated (to
    /// the process's end) rather than freed under it.
    pub(super) fn free(self, wait: Duration) -> CudaResult<()> {
        let until = Instant::now() + wait;
        while !self.bufs.iter().all(|b| b.poisoned || b.reusable()) && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(1));
        }
        use_device(self.dev)?;
        let mut left = 0;
        for b in &self.bufs {
            if b.poisoned {
                // Its stream work is over once the device is idle.
                unsafe { check(sys::cuCtxSynchronize(), "cuCtxSynchronize")? };
            } else if !b.reusable() {
                left += 1;
                continue;
            }
            unsafe {
                check(sys::cuMemFreeHost(b.host.cast()), "cuMemFreeHost")?;
            }
        }
        if left > 0 {
            warn(&format!(
                "{left} pinned buffer(s) of the cross-host path are still in use by a stream after {wait:?}: left allocated"
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_compare_as_cuda_geq_does() {
        assert!(cyclic_geq(5, 5));
        assert!(cyclic_geq(6, 5));
        assert!(!cyclic_geq(4, 5));
        assert!(!cyclic_geq(0, 1), "a fresh word is below the first job");
        // Across the wrap: 2 is after u32::MAX - 1.
        assert!(cyclic_geq(2, u32::MAX - 1));
        assert!(!cyclic_geq(u32::MAX - 1, 2));
    }

    #[test]
    fn with_the_copy_kernel_a_job_is_ready_once_every_block_said_so() {
        let mut header = vec![0u32; HEADER / 4];
        // The copies in by 32 blocks, out by 8.
        let f = JobFlags {
            header: header.as_mut_ptr() as usize,
            ready_slots: SLOTS,
            released_slots: 8,
        };
        let (ready, released) = (READY_SLOTS / 4, RELEASED_SLOTS / 4);
        for b in 0..SLOTS - 1 {
            header[ready + b] = 7;
        }
        assert!(!f.ready(7), "one block is still copying");
        header[ready + SLOTS - 1] = 7;
        assert!(f.ready(7) && !f.ready(8));
        // The single words mean nothing in this mode.
        header[RELEASED / 4] = 7;
        assert!(!f.released(7));
        for b in 0..7 {
            header[released + b] = 7;
        }
        assert!(!f.released(7));
        header[released + 7] = 7;
        assert!(f.released(7), "8 blocks copy out");
    }

    #[test]
    fn a_job_waits_for_a_release_once_enough_fitting_buffers_are_busy() {
        let (mib, none) = (1 << 20, Duration::ZERO);
        assert!(pins_another(1, 64 * mib, 1, none), "always a second buffer");
        assert!(pins_another(5, 8 * mib, BUSY_FITTING - 1, none));
        assert!(
            !pins_another(9, 9 * mib, BUSY_FITTING, none),
            "eight small jobs in flight"
        );
        assert!(
            !pins_another(3, POOL_BYTES + mib, 1, none),
            "at the byte cap"
        );
        assert!(
            pins_another(9, 9 * mib, BUSY_FITTING, PRESSURE_BOUND * 2),
            "a stream that never came"
        );
    }

    #[test]
    fn a_job_that_copies_nothing_out_is_released_by_its_done() {
        let mut header = vec![0u32; HEADER / 4];
        let f = JobFlags {
            header: header.as_mut_ptr() as usize,
            ready_slots: SLOTS,
            released_slots: RELEASED_BY_DONE,
        };
        assert!(!f.released(3));
        header[RELEASED / 4] = 3;
        assert!(!f.released(3), "the stream's word means nothing here");
        f.set_done(3);
        assert!(
            !f.released(3),
            "released without running: the stream may still copy in"
        );
        for b in 0..SLOTS {
            header[READY_SLOTS / 4 + b] = 3;
        }
        assert!(f.released(3) && !f.released(4));
    }

    #[test]
    fn job_flags_rise_with_the_sequence() {
        let mut header = vec![0u32; HEADER / 4];
        let f = JobFlags {
            header: header.as_mut_ptr() as usize,
            ready_slots: 0,
            released_slots: 0,
        };
        assert!(!f.ready(1));
        f.set_ready(1);
        assert!(f.ready(1) && !f.ready(2));
        f.set_done(1);
        assert_eq!(header[DONE / 4], 1);
    }
}
