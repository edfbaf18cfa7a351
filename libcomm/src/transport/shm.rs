//! Shared memory between the ranks of one host.
//!
//! Each rank of a communicator owns one segment in /dev/shm holding its
//! control block (state, failure flag, doorbell) and one single-producer
//! single-consumer ring per local peer *sending to it*. Every local rank maps
//! every other's segment at init, so a sender writes straight into the
//! receiver's ring and rings the receiver's doorbell; the receiver frees space
//! and rings the sender's. Segments are unlinked as soon as every local rank
//! has mapped them, so a killed job leaves nothing behind in /dev/shm.
//!
//! Rings carry a byte stream of messages: an 8-byte header (payload length,
//! per-channel sequence number) and the payload padded to 8 bytes. Positions
//! are u64 byte counters that never wrap; every published amount is a multiple
//! of 8, so an element (at most 8 bytes) never straddles the ring's end.
//! Nothing read from shared memory is trusted for addressing: positions are
//! masked, lengths are checked against what this rank expects.

use super::futex;
use crate::error::{Error, Result};
use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

const MAGIC_READY: u64 = 0x5745_4654_5348_4d31; // "WEFTSHM1"
const CTRL_BYTES: usize = 4096;
const RING_HDR_BYTES: usize = 128;
pub(crate) const MSG_HDR: usize = 8;

/// Peer state words (`Control::state`; 0 = active).
pub(crate) const ST_DESTROYED: u32 = 1;

/// Kinds of failure raised in `Control::fail_kind`.
pub(crate) const FAIL_ABORT: u32 = 1;
pub(crate) const FAIL_ERROR: u32 = 2;

#[repr(C)]
pub(crate) struct Control {
    magic: AtomicU64,
    pub pid: AtomicU32,
    pub rank: AtomicU32,
    pub state: AtomicU32,
    /// 0, or 1 + the rank that raised a failure/abort for this communicator.
    pub fail_flag: AtomicU32,
    pub fail_kind: AtomicU32,
    /// How many local peers have mapped this segment (the last one unlinks it).
    pub opened: AtomicU32,
    _pad0: [u8; 32],
    pub doorbell: AtomicU32,
    _pad1: [u8; 60],
    pub sleepers: AtomicU32,
    _pad2: [u8; 124],
    /// NUL-terminated reason written by this rank before it raises a failure.
    reason: [AtomicU64; 32],
}

const _: () = assert!(std::mem::size_of::<Control>() <= CTRL_BYTES);

impl Control {
    /// Wakes this rank if it sleeps (called after publishing something for it).
    #[inline]
    pub fn ring(&self) {
        self.doorbell.fetch_add(1, Ordering::SeqCst);
        if self.sleepers.load(Ordering::SeqCst) != 0 {
            futex::wake_all(&self.doorbell);
        }
    }

    pub fn set_reason(&self, s: &str) {
        let mut bytes = [0u8; 256];
        let n = s.len().min(255);
        bytes[..n].copy_from_slice(&s.as_bytes()[..n]);
        for (i, w) in self.reason.iter().enumerate() {
            w.store(
                u64::from_ne_bytes(bytes[i * 8..i * 8 + 8].try_into().unwrap()),
                Ordering::Relaxed,
            );
        }
        std::sync::atomic::fence(Ordering::Release);
    }

    pub fn reason(&self) -> String {
        std::sync::atomic::fence(Ordering::Acquire);
        let mut bytes = Vec::with_capacity(256);
        for w in &self.reason {
            bytes.extend_from_slice(&w.load(Ordering::Relaxed).to_ne_bytes());
        }
        let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
        String::from_utf8_lossy(&bytes[..end]).into_owned()
    }

    /// Marks this communicator failed, first writer wins. Returns whether we won.
    pub fn raise(&self, origin: usize, kind: u32) -> bool {
        if self
            .fail_flag
            .compare_exchange(0, origin as u32 + 1, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
        {
            self.fail_kind.store(kind, Ordering::SeqCst);
            self.ring();
            true
        } else {
            false
        }
    }

    /// (origin rank, kind) of a raised failure, if any.
    #[inline]
    pub fn failure(&self) -> Option<(usize, u32)> {
        match self.fail_flag.load(Ordering::Acquire) {
            0 => None,
            v => {
                // The kind is stored right after the flag; wait briefly for it.
                let mut k = self.fail_kind.load(Ordering::Acquire);
                for _ in 0..1000 {
                    if k != 0 {
                        break;
                    }
                    std::hint::spin_loop();
                    k = self.fail_kind.load(Ordering::Acquire);
                }
                Some((v as usize - 1, if k == 0 { FAIL_ERROR } else { k }))
            }
        }
    }
}

#[repr(C)]
struct RingHeader {
    /// Bytes ever published by the sender.
    tail: AtomicU64,
    _pad: [u8; 56],
    /// Bytes ever consumed by the receiver.
    head: AtomicU64,
}

/// A mapping of one rank's segment.
pub(crate) struct Mapping {
    base: *mut u8,
    len: usize,
    nlocal: usize,
    cap: usize,
    /// The backing file, kept only where another process (the sidecar's
    /// proxy) must map this segment too.
    fd: Option<OwnedFd>,
}

unsafe impl Send for Mapping {}
unsafe impl Sync for Mapping {}

impl Drop for Mapping {
    fn drop(&mut self) {
        unsafe { libc::munmap(self.base.cast(), self.len) };
    }
}

pub(crate) fn layout(nlocal: usize, cap: usize) -> (usize, usize) {
    let hdrs = (nlocal * RING_HDR_BYTES).next_multiple_of(4096);
    let data_off = CTRL_BYTES + hdrs;
    (data_off, data_off + nlocal * cap)
}

fn shm_error(what: &str, name: &str) -> Error {
    Error::last_os(format!("{what} shared memory segment /dev/shm{name}"))
}

impl Mapping {
    /// Creates this rank's segment, fully backed (posix_fallocate) so a full
    /// /dev/shm is a clear error now instead of SIGBUS later.
    ///
    /// With `keep_fd` the backing file stays open (see [`Mapping::fd`]); a
    /// rank alone on its host then gets a memfd instead of anonymous memory.
    pub fn create(
        name: &str,
        nlocal: usize,
        cap: usize,
        rank: usize,
        keep_fd: bool,
    ) -> Result<Mapping> {
        let (_, len) = layout(nlocal, cap);
        let mut kept = None;
        let base = if nlocal <= 1 && keep_fd {
            let (m, fd) = Mapping::create_memfd(name, nlocal, cap)?;
            kept = Some(fd);
            let b = m.base;
            std::mem::forget(m); // the mapping moves into the one built below
            b
        } else if nlocal <= 1 {
            // Alone on this host: only the control block is needed, privately.
            let p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_SHARED | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                )
            };
            if p == libc::MAP_FAILED {
                return Err(Error::last_os("mmap of the control block"));
            }
            p.cast::<u8>()
        } else {
            let cname =
                CString::new(name).map_err(|_| Error::Internal("NUL in shm name".into()))?;
            let fd = unsafe {
                libc::shm_open(
                    cname.as_ptr(),
                    libc::O_CREAT | libc::O_EXCL | libc::O_RDWR,
                    0o600,
                )
            };
            if fd < 0 {
                return Err(shm_error("cannot create", name));
            }
            let close_unlink = |e: Error| {
                unsafe {
                    libc::close(fd);
                    libc::shm_unlink(cname.as_ptr());
                }
                e
            };
            if unsafe { libc::ftruncate(fd, len as libc::off_t) } != 0 {
                return Err(close_unlink(shm_error("cannot size", name)));
            }
            let rc = unsafe { libc::posix_fallocate(fd, 0, len as libc::off_t) };
            if rc != 0 {
                let free = free_shm_bytes();
                return Err(close_unlink(Error::sys(
                    format!(
                        "cannot reserve {} KiB of /dev/shm for {name} ({} KiB free): mount a larger /dev/shm (Kubernetes: an emptyDir with medium Memory) or lower WEFT_SHM_RING_BYTES",
                        len / 1024,
                        free / 1024
                    ),
                    std::io::Error::from_raw_os_error(rc),
                )));
            }
            let p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_SHARED,
                    fd,
                    0,
                )
            };
            if keep_fd {
                kept = Some(unsafe { OwnedFd::from_raw_fd(fd) });
            } else {
                unsafe { libc::close(fd) };
            }
            if p == libc::MAP_FAILED {
                unsafe { libc::shm_unlink(cname.as_ptr()) };
                return Err(shm_error("cannot map", name));
            }
            p.cast::<u8>()
        };
        let m = Mapping {
            base,
            len,
            nlocal,
            cap,
            fd: kept,
        };
        let c = m.control();
        c.pid.store(std::process::id(), Ordering::Relaxed);
        c.rank.store(rank as u32, Ordering::Relaxed);
        c.magic.store(MAGIC_READY, Ordering::Release);
        Ok(m)
    }

    /// Maps a local peer's segment, waiting (bounded) for it to be created.
    pub fn open(
        name: &str,
        nlocal: usize,
        cap: usize,
        deadline: Instant,
        peer_pid: u32,
    ) -> Result<Mapping> {
        let (_, len) = layout(nlocal, cap);
        let cname = CString::new(name).map_err(|_| Error::Internal("NUL in shm name".into()))?;
        let mut backoff = Duration::from_micros(200);
        loop {
            let fd = unsafe { libc::shm_open(cname.as_ptr(), libc::O_RDWR, 0) };
            if fd >= 0 {
                let mut st: libc::stat = unsafe { std::mem::zeroed() };
                let ok = unsafe { libc::fstat(fd, &mut st) } == 0 && st.st_size as usize == len;
                if ok {
                    let p = unsafe {
                        libc::mmap(
                            std::ptr::null_mut(),
                            len,
                            libc::PROT_READ | libc::PROT_WRITE,
                            libc::MAP_SHARED,
                            fd,
                            0,
                        )
                    };
                    unsafe { libc::close(fd) };
                    if p == libc::MAP_FAILED {
                        return Err(shm_error("cannot map", name));
                    }
                    let m = Mapping {
                        base: p.cast(),
                        len,
                        nlocal,
                        cap,
                        fd: None,
                    };
                    if m.control().magic.load(Ordering::Acquire) == MAGIC_READY {
                        return Ok(m);
                    }
                    drop(m); // still initialising: try again
                } else {
                    unsafe { libc::close(fd) };
                    if st.st_size as usize > len
                        || (st.st_size != 0
                            && st.st_size as usize != len
                            && Instant::now() >= deadline)
                    {
                        return Err(Error::Internal(format!(
                            "shared memory segment {name} has size {} but {len} was expected (ranks disagree about the layout: mixed Weft versions or settings?)",
                            st.st_size
                        )));
                    }
                }
            } else {
                let e = std::io::Error::last_os_error();
                if e.raw_os_error() != Some(libc::ENOENT) {
                    return Err(Error::sys(
                        format!("cannot open shared memory segment /dev/shm{name}"),
                        e,
                    ));
                }
            }
            if !crate::topology::pid_alive(peer_pid) {
                return Err(Error::Remote {
                    comm: String::new(),
                    rank: 0,
                    detail: format!(
                        "local peer process {peer_pid} exited before its shared memory {name} appeared"
                    ),
                });
            }
            if Instant::now() >= deadline {
                return Err(Error::Bootstrap(format!(
                    "timed out waiting for the shared memory segment {name} of local peer pid {peer_pid}"
                )));
            }
            std::thread::sleep(backoff);
            backoff = (backoff * 2).min(Duration::from_millis(20));
        }
    }

    /// A segment that exists only as an open file (memfd): no name to
    /// unlink, so a SIGKILLed process leaks nothing. Fully backed, as `create`.
    pub fn create_memfd(what: &str, nlocal: usize, cap: usize) -> Result<(Mapping, OwnedFd)> {
        let (_, len) = layout(nlocal, cap);
        let cname = CString::new("weft-proxy").unwrap();
        let raw = unsafe { libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC) };
        if raw < 0 {
            return Err(Error::last_os(format!("memfd_create for {what}")));
        }
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        if unsafe { libc::ftruncate(raw, len as libc::off_t) } != 0 {
            return Err(Error::last_os(format!("sizing the memfd for {what}")));
        }
        let rc = unsafe { libc::posix_fallocate(raw, 0, len as libc::off_t) };
        if rc != 0 {
            return Err(Error::sys(
                format!("cannot reserve {} KiB of memory for {what}", len / 1024),
                std::io::Error::from_raw_os_error(rc),
            ));
        }
        let m = Mapping::map_fd(&fd, len, nlocal, cap, what)?;
        m.control().magic.store(MAGIC_READY, Ordering::Release);
        Ok((m, fd))
    }

    /// Maps a segment another process created and sent us (SCM_RIGHTS).
    /// The file's size must be exactly what `nlocal` rings of `cap` need:
    /// nothing in it is trusted for addressing.
    pub fn from_fd(fd: &OwnedFd, nlocal: usize, cap: usize, what: &str) -> Result<Mapping> {
        let (_, len) = layout(nlocal, cap);
        Mapping::map_fd(fd, len, nlocal, cap, what)
    }

    /// Maps only the control block (first page) of a segment.
    pub fn control_from_fd(fd: &OwnedFd, what: &str) -> Result<Mapping> {
        Mapping::map_fd_min(fd, CTRL_BYTES, 0, 0, what)
    }

    fn map_fd(fd: &OwnedFd, len: usize, nlocal: usize, cap: usize, what: &str) -> Result<Mapping> {
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
            return Err(Error::last_os(format!("fstat of {what}")));
        }
        if st.st_size as usize != len {
            return Err(Error::Internal(format!(
                "{what} has {} bytes where {len} were expected",
                st.st_size
            )));
        }
        Mapping::map_fd_min(fd, len, nlocal, cap, what)
    }

    fn map_fd_min(
        fd: &OwnedFd,
        len: usize,
        nlocal: usize,
        cap: usize,
        what: &str,
    ) -> Result<Mapping> {
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 || (st.st_size as usize) < len {
            return Err(Error::Internal(format!(
                "{what} is smaller than {len} bytes"
            )));
        }
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(Error::last_os(format!("mmap of {what}")));
        }
        Ok(Mapping {
            base: p.cast(),
            len,
            nlocal,
            cap,
            fd: None,
        })
    }

    /// Ring capacity of this segment.
    pub fn cap(&self) -> usize {
        self.cap
    }

    /// The backing file, if it was kept (`create(.., keep_fd = true)`).
    pub fn fd(&self) -> Option<&OwnedFd> {
        self.fd.as_ref()
    }

    pub fn control(&self) -> &Control {
        unsafe { &*(self.base as *const Control) }
    }

    fn ring_header(&self, sender_local: usize) -> &RingHeader {
        assert!(sender_local < self.nlocal);
        unsafe {
            &*(self.base.add(CTRL_BYTES + sender_local * RING_HDR_BYTES) as *const RingHeader)
        }
    }

    fn ring_data(&self, sender_local: usize) -> *mut u8 {
        assert!(sender_local < self.nlocal);
        let (data_off, _) = layout(self.nlocal, self.cap);
        unsafe { self.base.add(data_off + sender_local * self.cap) }
    }
}

pub(crate) fn free_shm_bytes() -> u64 {
    let mut s: libc::statvfs = unsafe { std::mem::zeroed() };
    let p = CString::new("/dev/shm").unwrap();
    if unsafe { libc::statvfs(p.as_ptr(), &mut s) } == 0 {
        s.f_bavail as u64 * s.f_frsize as u64
    } else {
        0
    }
}

pub(crate) fn unlink(name: &str) {
    if let Ok(c) = CString::new(name) {
        unsafe { libc::shm_unlink(c.as_ptr()) };
    }
}

/// One direction of a ring: the view a sender or a receiver has of it.
pub(crate) struct RingEnd {
    hdr: *const RingHeader,
    data: *mut u8,
    mask: u64,
    /// Our cached copy of our own counter (tail for senders, head for receivers).
    pos: u64,
    /// The doorbell to ring after we move our counter.
    other: *const Control,
}

unsafe impl Send for RingEnd {}

impl RingEnd {
    /// The ring in `receiver`'s segment written by local index `sender_local`.
    pub fn new(
        receiver: &Mapping,
        sender_local: usize,
        to_wake: &Mapping,
        sending: bool,
    ) -> RingEnd {
        let hdr = receiver.ring_header(sender_local);
        let pos = if sending {
            hdr.tail.load(Ordering::Acquire)
        } else {
            hdr.head.load(Ordering::Acquire)
        };
        RingEnd {
            hdr,
            data: receiver.ring_data(sender_local),
            mask: receiver.cap as u64 - 1,
            pos,
            other: to_wake.control(),
        }
    }

    /// Our own counter: bytes published (sender) or consumed (receiver) so far.
    pub fn pos(&self) -> u64 {
        self.pos
    }

    fn hdr(&self) -> &RingHeader {
        unsafe { &*self.hdr }
    }

    fn cap(&self) -> u64 {
        self.mask + 1
    }

    /// Sender: bytes free in the ring.
    #[inline]
    pub fn space(&self) -> Result<usize> {
        let head = self.hdr().head.load(Ordering::Acquire);
        let used = self.pos.wrapping_sub(head);
        if used > self.cap() {
            return Err(Error::Internal(
                "shared memory ring corrupted (head beyond tail)".into(),
            ));
        }
        Ok((self.cap() - used) as usize)
    }

    /// Receiver: bytes published and not yet consumed.
    #[inline]
    pub fn available(&self) -> Result<usize> {
        let tail = self.hdr().tail.load(Ordering::Acquire);
        let avail = tail.wrapping_sub(self.pos);
        if avail > self.cap() || !avail.is_multiple_of(8) {
            return Err(Error::Internal(
                "shared memory ring corrupted (tail beyond capacity)".into(),
            ));
        }
        Ok(avail as usize)
    }

    /// The (up to two) contiguous pieces of ring memory at our position for `n` bytes.
    #[inline]
    pub fn regions(&self, offset: usize, n: usize) -> [(*mut u8, usize); 2] {
        let start = (self.pos + offset as u64) & self.mask;
        let first = (self.cap() - start).min(n as u64) as usize;
        unsafe {
            [
                (self.data.add(start as usize), first),
                (self.data, n - first),
            ]
        }
    }

    /// Sender: publish `n` more bytes (a multiple of 8).
    #[inline]
    pub fn publish(&mut self, n: usize) {
        debug_assert!(n.is_multiple_of(8));
        self.pos += n as u64;
        self.hdr().tail.store(self.pos, Ordering::Release);
        unsafe { (*self.other).ring() };
    }

    /// Receiver: release `n` bytes (a multiple of 8) back to the sender.
    #[inline]
    pub fn consume(&mut self, n: usize) {
        debug_assert!(n.is_multiple_of(8));
        self.pos += n as u64;
        self.hdr().head.store(self.pos, Ordering::Release);
        unsafe { (*self.other).ring() };
    }

    /// Copies `src` into the ring at `offset` bytes past our position.
    pub fn write_at(&self, offset: usize, src: *const u8, n: usize) {
        let [(a, la), (b, lb)] = self.regions(offset, n);
        unsafe {
            std::ptr::copy_nonoverlapping(src, a, la);
            std::ptr::copy_nonoverlapping(src.add(la), b, lb);
        }
    }
}

/// Ring capacity: large enough to stream well, small enough that 64 local
/// ranks (63 inbound rings each) stay within ~16 MiB of /dev/shm per rank.
pub(crate) fn ring_capacity(nlocal: usize, configured: Option<usize>) -> usize {
    if let Some(c) = configured {
        return c;
    }
    let per_peer = (16usize << 20) / nlocal.saturating_sub(1).max(1);
    let pow2 = if per_peer.is_power_of_two() {
        per_peer
    } else {
        per_peer.next_power_of_two() / 2
    };
    pow2.clamp(64 << 10, 1 << 20)
}
