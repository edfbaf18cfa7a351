//! Where the progress engine meets its "device side": 64-bit counter words.
//!
//! A producer (the GPU's copy engine or a kernel in production, host code in
//! CI) publishes how far a send buffer is ready by raising a word; the
//! engine publishes how far a receive buffer has landed (or been reduced) by
//! raising another, which the consumer waits on with a `>=` compare. Words
//! only grow (values are absolute: whoever enqueues work knows the targets,
//! as `launch.rs` knows sequence numbers), so a stale value never satisfies
//! a wait.
//!
//! On failure or abort the engine writes [`TERMINAL`] into every word: a
//! consumer waiting with `>=` is released (a GPU stream in
//! `cuStreamWaitValue64(GEQ)` included: CUDA compares cyclically, as
//! `(int64_t)(*addr - value) >= 0`, and `TERMINAL - v` stays positive for
//! every value below [`MAX_VALUE`]), then learns from the engine's status
//! that it was released by a failure.
//!
//! The words are plain memory: [`FlagWords`] owns them, or
//! ([`FlagWords::from_raw`]) sits on memory someone else provides, pinned
//! host memory mapped into a GPU (`cuMemHostAlloc(DEVICEMAP)`) or a memfd
//! mapping shared with the pod's sidecar.

use std::sync::atomic::{AtomicU64, Ordering};

/// Written into every word when the engine fails or is aborted.
pub const TERMINAL: u64 = i64::MAX as u64;
/// Counter values stay below this (so [`TERMINAL`] releases every wait, even
/// under CUDA's cyclic comparison).
pub const MAX_VALUE: u64 = 1 << 62;

/// The words the engine polls and raises. Implemented by [`FlagWords`]; a
/// device side with other needs (a doorbell to ring after a store, words in
/// two memories) implements it itself.
pub trait Flags: Send + Sync {
    /// Number of words.
    fn len(&self) -> usize;
    /// Reads word `w` (acquire: data published before it is visible).
    fn load(&self, w: usize) -> u64;
    /// Raises word `w` to `v` (release: the data it covers is visible first).
    fn store(&self, w: usize, v: u64);
    /// After stores a waiter may sleep on (a futex doorbell); nothing by default
    /// (a GPU stream polls the word itself).
    fn wake(&self) {}
    /// Releases every waiter: [`TERMINAL`] into every word.
    fn release_all(&self) {
        for w in 0..self.len() {
            self.store(w, TERMINAL);
        }
        self.wake();
    }
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Words in memory owned here or provided by the caller.
pub struct FlagWords {
    words: *const AtomicU64,
    len: usize,
    _owned: Option<Box<[AtomicU64]>>,
}

// SAFETY: the words are atomics; the memory lives as long as `self` (owned,
// or promised by `from_raw`'s caller).
unsafe impl Send for FlagWords {}
unsafe impl Sync for FlagWords {}

impl FlagWords {
    /// `len` words, all zero, owned.
    pub fn new(len: usize) -> FlagWords {
        let owned: Box<[AtomicU64]> = (0..len).map(|_| AtomicU64::new(0)).collect();
        FlagWords {
            words: owned.as_ptr(),
            len,
            _owned: Some(owned),
        }
    }

    /// Words at `at` (8-byte aligned), e.g. pinned host memory a GPU writes
    /// with `cuStreamWriteValue64`, or a memfd mapping shared with a sidecar.
    ///
    /// # Safety
    /// `at..at + len` must be valid, 8-byte aligned, and outlive the result;
    /// others may write the words only atomically (whole 8-byte stores).
    pub unsafe fn from_raw(at: *mut u64, len: usize) -> FlagWords {
        FlagWords {
            words: at as *const AtomicU64,
            len,
            _owned: None,
        }
    }

    fn word(&self, w: usize) -> &AtomicU64 {
        assert!(w < self.len, "flag word {w} of {}", self.len);
        // SAFETY: in bounds, live (see the constructors).
        unsafe { &*self.words.add(w) }
    }
}

impl Flags for FlagWords {
    fn len(&self) -> usize {
        self.len
    }
    fn load(&self, w: usize) -> u64 {
        self.word(w).load(Ordering::Acquire)
    }
    fn store(&self, w: usize, v: u64) {
        self.word(w).store(v, Ordering::Release)
    }
}

/// How a [`wait_geq`] ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Waited {
    /// The word reached the target.
    Reached,
    /// The word was released with [`TERMINAL`] (ask the engine why).
    Released,
    /// The caller's `give_up` said so.
    GaveUp,
}

/// Waits (spin, yield, then short sleeps) until word `w` reaches `target`,
/// is released, or `give_up` (asked every few milliseconds) says so.
pub fn wait_geq(
    flags: &dyn Flags,
    w: usize,
    target: u64,
    mut give_up: impl FnMut() -> bool,
) -> Waited {
    let mut wait = crate::sys::backoff::Backoff::new();
    loop {
        let v = flags.load(w);
        if v == TERMINAL {
            return Waited::Released;
        }
        if v >= target {
            return Waited::Reached;
        }
        let step = wait.snooze();
        if step == crate::sys::backoff::Step::Slept && wait.polls().is_multiple_of(64) && give_up()
        {
            return Waited::GaveUp;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn terminal_releases_every_wait_even_compared_cyclically() {
        for v in [0u64, 1, 12345, MAX_VALUE - 1] {
            // CUDA's GEQ: (int64_t)(*addr - value) >= 0.
            assert!((TERMINAL.wrapping_sub(v) as i64) >= 0, "{v}");
        }
        let f = FlagWords::new(3);
        f.store(1, 7);
        assert_eq!(wait_geq(&f, 1, 7, || false), Waited::Reached);
        f.release_all();
        assert_eq!(wait_geq(&f, 0, 5, || false), Waited::Released);
        assert!((0..3).all(|w| f.load(w) == TERMINAL));
    }

    #[test]
    fn words_on_foreign_memory_are_shared_with_their_owner() {
        let mut mem = vec![0u64; 4];
        let f = unsafe { FlagWords::from_raw(mem.as_mut_ptr(), 4) };
        f.store(2, 42);
        drop(f);
        assert_eq!(mem[2], 42);
    }

    #[test]
    fn a_wait_gives_up_when_asked() {
        let f = FlagWords::new(1);
        let t = std::time::Instant::now();
        assert_eq!(
            wait_geq(&f, 0, 1, || t.elapsed().as_millis() > 20),
            Waited::GaveUp
        );
    }
}
