//! The memory of a telemetry segment: created by the rank (a sealed memfd)
//! or mapped by the sidecar from the descriptor the rank passed, after the
//! checks that make every later access safe: the file is sealed against
//! shrinking and growing (no access can fault), its size is exactly what its
//! header's geometry needs, and the geometry is within bounds.

use super::layout::{self, Geometry};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicU64, Ordering};

/// Why a segment could not be created or was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentError(pub String);

impl std::fmt::Display for SegmentError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for SegmentError {}

fn os(what: &str) -> SegmentError {
    SegmentError(format!("{what}: {}", std::io::Error::last_os_error()))
}

fn refused(why: impl Into<String>) -> SegmentError {
    SegmentError(why.into())
}

/// One mapped segment. Every access to its memory is atomic (the other
/// process writes it concurrently).
pub struct Segment {
    map: Map,
    geometry: Geometry,
    fd: OwnedFd,
    /// (device, inode) of the memfd: the same segment passed again.
    identity: (u64, u64),
}

/// A shared mapping of the first `words` words of a file.
struct Map {
    base: *const AtomicU64,
    words: usize,
}

// SAFETY: the mapping is shared memory accessed only through atomics; the
// pointer stays valid until drop (the file cannot shrink: sealed).
unsafe impl Send for Map {}
unsafe impl Sync for Map {}

impl Map {
    /// Maps `words` words of `fd`, whose file the caller checked is at
    /// least that long (and sealed, so it stays that long).
    fn new(fd: RawFd, words: usize) -> Result<Map, SegmentError> {
        // SAFETY: a shared mapping of a checked, sealed file.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                words * 8,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(os("mapping the telemetry ring"));
        }
        Ok(Map {
            base: p as *const AtomicU64,
            words,
        })
    }

    fn word(&self, i: usize) -> &AtomicU64 {
        assert!(i < self.words, "telemetry ring word {i} of {}", self.words);
        // SAFETY: in bounds of a live mapping; the page-aligned mapping's
        // words have AtomicU64's alignment.
        unsafe { &*self.base.add(i) }
    }

    fn words<const N: usize>(&self, i: usize) -> &[AtomicU64; N] {
        assert!(
            i.checked_add(N).is_some_and(|end| end <= self.words),
            "telemetry ring words {i}+{N} of {}",
            self.words
        );
        // SAFETY: as `word`, for N words in bounds; [AtomicU64; N] has
        // AtomicU64's layout and alignment.
        unsafe { &*(self.base.add(i) as *const [AtomicU64; N]) }
    }
}

impl Drop for Map {
    fn drop(&mut self) {
        // SAFETY: unmapping what `new` mapped, once.
        unsafe { libc::munmap(self.base as *mut libc::c_void, self.words * 8) };
    }
}

const SEALS: libc::c_int = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW;

impl Segment {
    /// Creates a fresh segment of `geometry` for this process.
    pub fn create(geometry: Geometry) -> Result<Segment, SegmentError> {
        if !geometry.valid() {
            return Err(refused(format!("invalid geometry {geometry:?}")));
        }
        let name = c"weft-telemetry";
        // SAFETY: plain system calls on a descriptor we own.
        let raw = unsafe {
            libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING)
        };
        if raw < 0 {
            return Err(os("memfd_create for the telemetry ring"));
        }
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let bytes = geometry.bytes();
        if unsafe { libc::ftruncate(raw, bytes as libc::off_t) } != 0 {
            return Err(os("sizing the telemetry ring"));
        }
        if unsafe { libc::fcntl(raw, libc::F_ADD_SEALS, SEALS | libc::F_SEAL_SEAL) } != 0 {
            return Err(os("sealing the telemetry ring"));
        }
        let s = Segment::with_map(fd, geometry)?;
        let h = |w: usize, v: u64| s.word(w).store(v, Ordering::Relaxed);
        h(layout::H_VERSION, layout::VERSION);
        h(layout::H_CAPACITY, geometry.records);
        h(layout::H_SLOTS, geometry.slots);
        h(
            layout::H_SHAPE,
            layout::RECORD_WORDS as u64 | (layout::SLOT_WORDS as u64) << 32,
        );
        h(layout::H_SEGMENT_ID, random_id());
        h(layout::H_PID, std::process::id() as u64);
        // Entry i is free for ticket i (the queue's sequence protocol).
        for i in 0..geometry.records as usize {
            s.word(geometry.record_word(i))
                .store(i as u64, Ordering::Relaxed);
        }
        s.word(layout::H_MAGIC)
            .store(layout::MAGIC, Ordering::Release);
        Ok(s)
    }

    /// Maps a segment another process passed us, refusing anything that is
    /// not a sealed file of exactly the size its (valid) header describes.
    pub fn from_fd(fd: OwnedFd) -> Result<Segment, SegmentError> {
        let raw = fd.as_raw_fd();
        let st = fstat(raw)?;
        if st.st_mode & libc::S_IFMT != libc::S_IFREG {
            return Err(refused("the telemetry ring is not a memory file"));
        }
        let size = st.st_size as u64;
        let min = Geometry {
            records: layout::MIN_RECORDS,
            slots: 1,
        }
        .bytes() as u64;
        let max = Geometry {
            records: layout::MAX_RECORDS,
            slots: layout::MAX_SLOTS,
        }
        .bytes() as u64;
        if !(min..=max).contains(&size) {
            return Err(refused(format!(
                "the telemetry ring is {size} bytes, not within {min}..={max}"
            )));
        }
        // SAFETY: fcntl on a descriptor we own.
        let seals = unsafe { libc::fcntl(raw, libc::F_GET_SEALS) };
        if seals < 0 || seals & SEALS != SEALS {
            return Err(refused("the telemetry ring is not sealed against resizing"));
        }
        // Read the header through a one-page mapping of the checked file.
        let head = Map::new(raw, layout::HEADER_WORDS)?;
        let w = |i: usize| head.word(i).load(Ordering::Acquire);
        if w(layout::H_MAGIC) != layout::MAGIC {
            return Err(refused("the telemetry ring has a bad magic number"));
        }
        if w(layout::H_VERSION) != layout::VERSION {
            return Err(refused(format!(
                "telemetry ring version {} (this sidecar reads {})",
                w(layout::H_VERSION),
                layout::VERSION
            )));
        }
        let shape = layout::RECORD_WORDS as u64 | (layout::SLOT_WORDS as u64) << 32;
        if w(layout::H_SHAPE) != shape {
            return Err(refused("the telemetry ring's record or slot size differs"));
        }
        let g = Geometry {
            records: w(layout::H_CAPACITY),
            slots: w(layout::H_SLOTS),
        };
        drop(head);
        if !g.valid() || g.bytes() as u64 != size {
            return Err(refused(format!(
                "the telemetry ring's geometry ({} records, {} slots) does not match its {size} bytes",
                g.records, g.slots
            )));
        }
        Segment::with_map(fd, g)
    }

    /// Maps all of `geometry` (whose size the caller checked) of `fd`.
    fn with_map(fd: OwnedFd, geometry: Geometry) -> Result<Segment, SegmentError> {
        let st = fstat(fd.as_raw_fd())?;
        Ok(Segment {
            map: Map::new(fd.as_raw_fd(), geometry.words())?,
            geometry,
            fd,
            identity: (st.st_dev, st.st_ino),
        })
    }

    /// Word `i` of the segment. Callers compute `i` from the validated
    /// geometry; anything else is a bug, caught rather than read out of
    /// bounds.
    pub fn word(&self, i: usize) -> &AtomicU64 {
        self.map.word(i)
    }

    /// Words `i..i + N`: one bounds check for a group of words used
    /// together (a slot, on every operation).
    pub fn words<const N: usize>(&self, i: usize) -> &[AtomicU64; N] {
        self.map.words(i)
    }

    pub fn geometry(&self) -> Geometry {
        self.geometry
    }

    /// The descriptor to pass to the sidecar.
    pub fn fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    /// The same memory file as `other` (a process passing its segment again).
    pub fn same_file(&self, other: &Segment) -> bool {
        self.identity == other.identity
    }

    pub fn segment_id(&self) -> u64 {
        self.word(layout::H_SEGMENT_ID).load(Ordering::Relaxed)
    }

    /// Records ever claimed by producers.
    pub fn produced(&self) -> u64 {
        self.word(layout::H_TAIL).load(Ordering::Acquire)
    }

    /// Records dropped because the ring was full.
    pub fn dropped(&self) -> u64 {
        self.word(layout::H_DROPPED).load(Ordering::Relaxed)
    }

    /// Slots the process ever opened (the rest were never used), bounded
    /// by the geometry whatever the word says.
    pub fn slots_used(&self) -> u16 {
        self.word(layout::H_SLOTS_USED)
            .load(Ordering::Relaxed)
            .min(self.geometry().slots)
            .min(u16::MAX as u64) as u16
    }

    /// The process says it is exiting normally (its agent closed).
    pub fn mark_closing(&self) {
        self.word(layout::H_FLAGS)
            .fetch_or(layout::FLAG_CLOSING, Ordering::Release);
    }

    pub fn closing(&self) -> bool {
        self.word(layout::H_FLAGS).load(Ordering::Acquire) & layout::FLAG_CLOSING != 0
    }
}

fn fstat(fd: RawFd) -> Result<libc::stat, SegmentError> {
    // SAFETY: fstat into a zeroed struct we own.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    if unsafe { libc::fstat(fd, &mut st) } != 0 {
        return Err(os("fstat of the telemetry ring"));
    }
    Ok(st)
}

/// A random 64-bit id (the std hasher's per-process random keys).
fn random_id() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dup(s: &Segment) -> OwnedFd {
        // SAFETY: dup of a live descriptor.
        unsafe { OwnedFd::from_raw_fd(libc::dup(s.fd())) }
    }

    #[test]
    fn a_created_segment_maps_again_from_its_descriptor() {
        let s = Segment::create(Geometry::with_records(256)).unwrap();
        let m = Segment::from_fd(dup(&s)).unwrap();
        assert_eq!(m.geometry(), s.geometry());
        assert!(m.same_file(&s));
        assert_eq!(m.segment_id(), s.segment_id());
        s.mark_closing();
        assert!(m.closing(), "both map the same memory");
    }

    fn memfd(bytes: usize, seal: bool) -> OwnedFd {
        let raw = unsafe {
            libc::memfd_create(c"t".as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING)
        };
        assert!(raw >= 0);
        unsafe { libc::ftruncate(raw, bytes as libc::off_t) };
        if seal {
            unsafe { libc::fcntl(raw, libc::F_ADD_SEALS, SEALS) };
        }
        unsafe { OwnedFd::from_raw_fd(raw) }
    }

    /// Garbage, unsealed, wrongly sized or not-a-file descriptors are
    /// refused with a reason, never mapped.
    #[test]
    fn hostile_descriptors_are_refused() {
        let g = Geometry::with_records(256);
        let e = Segment::from_fd(memfd(g.bytes(), false)).err().unwrap();
        assert!(e.0.contains("not sealed"), "{e}");
        let e = Segment::from_fd(memfd(g.bytes(), true)).err().unwrap();
        assert!(e.0.contains("magic"), "{e}");
        let e = Segment::from_fd(memfd(100, true)).err().unwrap();
        assert!(e.0.contains("not within"), "{e}");
        let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
        let e = Segment::from_fd(OwnedFd::from(a)).err().unwrap();
        assert!(e.0.contains("not a memory file"), "{e}");
        // A valid header whose geometry claims more than the file holds.
        let s = Segment::create(g).unwrap();
        s.word(layout::H_CAPACITY).store(512, Ordering::Relaxed);
        let e = Segment::from_fd(dup(&s)).err().unwrap();
        assert!(e.0.contains("does not match"), "{e}");
        s.word(layout::H_CAPACITY).store(300, Ordering::Relaxed);
        let e = Segment::from_fd(dup(&s)).err().unwrap();
        assert!(e.0.contains("does not match"), "{e}");
    }
}
