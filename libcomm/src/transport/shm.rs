//! Shared memory between the ranks of one host.
//!
//! Each rank of a communicator owns one segment in /dev/shm holding its
//! control block (state, failure flag, doorbell) and one single-producer
//! single-consumer ring per local peer *sending to it*. Every local rank maps
//! every other's segment at init, so a sender writes straight into the
//! receiver's ring and rings the receiver's doorbell; the receiver frees space
//! and rings the sender's. A segment never has a name in /dev/shm: it is a
//! memfd, handed to the local peers (SCM_RIGHTS) over an abstract Unix
//! socket of its owner ([`Offer`]), which vanishes with the process. So a
//! rank killed at any point, init included, leaves nothing behind.
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
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

const MAGIC_READY: u64 = 0x5745_4654_5348_4d31; // "WEFTSHM1"
const CTRL_BYTES: usize = 4096;
/// Room for a failure's reason in a rank's control block: a cross-host
/// timeout's chain of waits runs to 400-500 bytes, and the end of it names
/// the stuck rank (256 bytes cut it off).
const REASON_BYTES: usize = 1024;
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
    reason: [AtomicU64; REASON_BYTES / 8],
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
        let mut bytes = [0u8; REASON_BYTES];
        let n = s.len().min(REASON_BYTES - 1);
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
        let mut bytes = Vec::with_capacity(REASON_BYTES);
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

/// Bytes of one latency slot (see [`SlotHdr`]): the largest host all-reduce
/// the latency path (`algo/ll.rs`) carries.
pub(crate) const LL_SLOT_BYTES: usize = 64 << 10;
const LL_LINE: usize = 64;

/// The latency area of a rank segment shared with local peers: one line
/// holding the owner's epoch counter, then two buffers (even and odd epochs)
/// of an input slot and an output slot, each a header line and
/// [`LL_SLOT_BYTES`] of data. Only the owner writes its slots; local peers
/// read them. None for a rank alone on its host.
pub(crate) fn ll_area(nlocal: usize) -> usize {
    if nlocal > 1 {
        LL_LINE + 4 * (LL_LINE + LL_SLOT_BYTES)
    } else {
        0
    }
}

/// The header of a latency slot: the owner writes the data, then `len`,
/// then `epoch` with release ordering; a reader that loads `epoch` with
/// acquire ordering and finds the epoch it waits for sees the data. The flag
/// travels with the data it guards (one store after the copy, no separate
/// doorbell, no system call); on the CPU, release/acquire gives the ordering
/// that NCCL's LL protocol gets on the GPU by interleaving a flag in every
/// 8 bytes.
#[repr(C)]
pub(crate) struct SlotHdr {
    pub epoch: AtomicU64,
    pub len: AtomicU64,
}

/// A mapping of one rank's segment.
pub(crate) struct Mapping {
    base: *mut u8,
    len: usize,
    nlocal: usize,
    cap: usize,
    /// Offset of the latency area ([`ll_area`]), 0 when there is none.
    ll_off: usize,
    /// The backing file, kept where another process (a local peer, the
    /// sidecar's proxy) must map this segment too.
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

impl Mapping {
    /// Creates this rank's segment, fully backed (posix_fallocate) so a
    /// memory limit is a clear error now instead of SIGBUS later.
    ///
    /// Shared with local peers (`nlocal > 1`), it is a memfd whose
    /// descriptor is kept (see [`Mapping::fd`], [`Offer`]); alone on its
    /// host, a rank gets anonymous memory, or a memfd with `keep_fd` (the
    /// sidecar's proxy maps it too).
    pub fn create(
        name: &str,
        nlocal: usize,
        cap: usize,
        rank: usize,
        keep_fd: bool,
    ) -> Result<Mapping> {
        let (_, mut len) = layout(nlocal, cap);
        let mut kept = None;
        let mut ll_off = 0;
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
            // Shared with local peers through its descriptor only (see Offer).
            let (m, fd) = Mapping::create_memfd_with(name, nlocal, cap, ll_area(nlocal))?;
            kept = Some(fd);
            let b = m.base;
            len = m.len;
            ll_off = m.ll_off;
            std::mem::forget(m);
            b
        };
        let m = Mapping {
            base,
            len,
            nlocal,
            cap,
            ll_off,
            fd: kept,
        };
        let c = m.control();
        c.pid.store(std::process::id(), Ordering::Relaxed);
        c.rank.store(rank as u32, Ordering::Relaxed);
        c.magic.store(MAGIC_READY, Ordering::Release);
        Ok(m)
    }

    /// Maps a local peer's segment, waiting (bounded) for its owner to
    /// offer it (see [`Offer`]).
    pub fn open(
        name: &str,
        nlocal: usize,
        cap: usize,
        deadline: Instant,
        peer_pid: u32,
    ) -> Result<Mapping> {
        let addr = abstract_addr(name)?;
        let mut backoff = Duration::from_micros(200);
        loop {
            match UnixStream::connect_addr(&addr) {
                Ok(s) => {
                    let fd = receive_segment(&s, name, deadline)?;
                    let m = Mapping::from_fd_with(
                        &fd,
                        nlocal,
                        cap,
                        ll_area(nlocal),
                        &format!("the segment {name}"),
                    )
                        .map_err(|e| match e {
                            Error::Internal(m) => Error::Internal(format!(
                                "{m} (ranks disagree about the layout: mixed Weft versions or settings?)"
                            )),
                            e => e,
                        })?;
                    if m.control().magic.load(Ordering::Acquire) != MAGIC_READY {
                        return Err(Error::Internal(format!(
                            "the segment {name} was offered before it was initialised"
                        )));
                    }
                    return Ok(m);
                }
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::ConnectionRefused | std::io::ErrorKind::NotFound
                    ) => {}
                Err(e) => {
                    return Err(Error::sys(
                        format!("cannot reach the shared memory offer {name}"),
                        e,
                    ));
                }
            }
            if !crate::sys::topology::pid_alive(peer_pid) {
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
        Mapping::create_memfd_with(what, nlocal, cap, 0)
    }

    /// A control block alone (no rings) in a memfd it keeps, to send to
    /// another process (a rank's own block for the sidecar proxy).
    pub fn create_control_memfd(what: &str) -> Result<Mapping> {
        let (mut m, fd) = Mapping::create_memfd(what, 0, 0)?;
        m.fd = Some(fd);
        Ok(m)
    }

    /// [`create_memfd`](Self::create_memfd) with `extra` bytes (a latency
    /// area) after the rings.
    fn create_memfd_with(
        what: &str,
        nlocal: usize,
        cap: usize,
        extra: usize,
    ) -> Result<(Mapping, OwnedFd)> {
        let (_, rings) = layout(nlocal, cap);
        let len = rings + extra;
        let cname = CString::new(what.trim_start_matches('/'))
            .unwrap_or_else(|_| CString::new("weft").unwrap());
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
                format!(
                    "cannot reserve {} KiB of memory for {what} (lower WEFT_SHM_RING_BYTES, or raise the memory limit)",
                    len / 1024
                ),
                std::io::Error::from_raw_os_error(rc),
            ));
        }
        let mut m = Mapping::map_fd(&fd, len, nlocal, cap, what)?;
        if extra > 0 {
            m.ll_off = rings;
        }
        m.control().magic.store(MAGIC_READY, Ordering::Release);
        Ok((m, fd))
    }

    /// Maps a segment another process created and sent us (SCM_RIGHTS).
    /// The file's size must be exactly what `nlocal` rings of `cap` need:
    /// nothing in it is trusted for addressing.
    pub fn from_fd(fd: &OwnedFd, nlocal: usize, cap: usize, what: &str) -> Result<Mapping> {
        Mapping::from_fd_with(fd, nlocal, cap, 0, what)
    }

    /// [`from_fd`](Self::from_fd) for a segment with `extra` bytes (its
    /// latency area) after the rings.
    fn from_fd_with(
        fd: &OwnedFd,
        nlocal: usize,
        cap: usize,
        extra: usize,
        what: &str,
    ) -> Result<Mapping> {
        let (_, rings) = layout(nlocal, cap);
        let mut m = Mapping::map_fd(fd, rings + extra, nlocal, cap, what)?;
        if extra > 0 {
            m.ll_off = rings;
        }
        Ok(m)
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
            ll_off: 0,
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

    /// Whether this segment has a latency area.
    pub fn has_ll(&self) -> bool {
        self.ll_off != 0
    }

    /// The owner's count of latency-path operations (only the owner uses it).
    pub fn ll_epoch(&self) -> &AtomicU64 {
        assert!(self.has_ll());
        unsafe { &*(self.base.add(self.ll_off) as *const AtomicU64) }
    }

    /// The owner's count of host all-reduces (every algorithm) and the bytes
    /// of the latest: a peer that waits long in the latency slots compares
    /// them with its own to tell a mismatch (different counts on different
    /// ranks send some through the slots, others through the rings) from a
    /// slow rank.
    pub fn ll_call(&self) -> (&AtomicU64, &AtomicU64) {
        assert!(self.has_ll());
        unsafe {
            let p = self.base.add(self.ll_off) as *const AtomicU64;
            (&*p.add(1), &*p.add(2))
        }
    }

    /// Latency slot `buf` (0 or 1), input (`out` false) or output: its
    /// header and its [`LL_SLOT_BYTES`] of data.
    pub fn ll_slot(&self, buf: usize, out: bool) -> (&SlotHdr, *mut u8) {
        assert!(self.has_ll() && buf < 2);
        let i = buf * 2 + out as usize;
        unsafe {
            let line = self
                .base
                .add(self.ll_off + LL_LINE + i * (LL_LINE + LL_SLOT_BYTES));
            (&*(line as *const SlotHdr), line.add(LL_LINE))
        }
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

/// The abstract Unix socket address of a segment's offer: no file, and it
/// vanishes with the process that binds it (Linux; scoped to the network
/// namespace, which local ranks share).
fn abstract_addr(name: &str) -> Result<std::os::unix::net::SocketAddr> {
    std::os::unix::net::SocketAddr::from_abstract_name(name.trim_start_matches('/').as_bytes())
        .map_err(|e| Error::sys(format!("abstract socket name {name}"), e))
}

/// The user on the other end of a Unix socket.
fn peer_uid(fd: RawFd) -> Option<u32> {
    let mut c: libc::ucred = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    let rc = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut c as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    (rc == 0).then_some(c.uid)
}

fn same_user(fd: RawFd) -> bool {
    peer_uid(fd) == Some(unsafe { libc::geteuid() })
}

/// Sends a segment's descriptor (one byte with SCM_RIGHTS).
fn send_segment(s: &UnixStream, fd: RawFd) -> std::io::Result<()> {
    match crate::sys::fdpass::send(s.as_raw_fd(), &[&[1u8]], &[fd])? {
        1 => Ok(()),
        _ => Err(std::io::Error::new(
            std::io::ErrorKind::WriteZero,
            "the segment's descriptor was not sent",
        )),
    }
}

/// Receives the descriptor an [`Offer`] sends, before `deadline`.
fn receive_segment(s: &UnixStream, name: &str, deadline: Instant) -> Result<OwnedFd> {
    if !same_user(s.as_raw_fd()) {
        return Err(Error::InvalidUsage(format!(
            "the shared memory offer {name} is held by another user's process: refused"
        )));
    }
    let left = deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1));
    let _ = s.set_read_timeout(Some(left));
    let mut byte = [0u8; 1];
    let got = crate::sys::fdpass::recv(s.as_raw_fd(), &mut byte)
        .map_err(|e| Error::sys(format!("receiving the shared memory segment {name}"), e))?;
    let (n, mut fds) = (got.len, got.fds);
    if n != 1 || fds.len() != 1 {
        return Err(Error::Internal(format!(
            "the offer of the shared memory segment {name} sent no descriptor"
        )));
    }
    Ok(fds.pop().unwrap())
}

/// A rank's segment offered to its local peers: a thread answers each
/// connection to the segment's abstract socket (from a process of the same
/// user) with the segment's descriptor, until `want` peers have mapped it,
/// the deadline passes or the offer is dropped. Nothing is left in any
/// file system, whatever kills the process.
pub(crate) struct Offer {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Offer {
    pub fn start(
        name: &str,
        own: std::sync::Arc<Mapping>,
        want: u32,
        deadline: Instant,
    ) -> Result<Offer> {
        let seg = own
            .fd()
            .ok_or_else(|| Error::Internal("a shared segment without its descriptor".into()))?
            .try_clone()
            .map_err(|e| Error::sys("dup", e))?;
        let l = UnixListener::bind_addr(&abstract_addr(name)?).map_err(|e| {
            Error::sys(
                format!(
                    "cannot offer the shared memory segment {name} (another process holds its name: two ranks with one rank number?)"
                ),
                e,
            )
        })?;
        l.set_nonblocking(true)
            .map_err(|e| Error::sys("fcntl", e))?;
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stop2 = stop.clone();
        let what = name.to_string();
        let thread = std::thread::Builder::new()
            .name("weft-shm-offer".into())
            .spawn(move || {
                while !stop2.load(Ordering::Acquire)
                    && own.control().opened.load(Ordering::Acquire) < want
                    && Instant::now() < deadline
                {
                    let _ = crate::sys::sockets::wait_readable(
                        l.as_raw_fd(),
                        Duration::from_millis(20),
                    );
                    while let Ok((s, _)) = l.accept() {
                        if !same_user(s.as_raw_fd()) {
                            crate::log::warn_log!(
                                "shared memory offer {what}: refused a process of another user"
                            );
                            continue;
                        }
                        let _ = s.set_nonblocking(false);
                        let _ = s.set_write_timeout(Some(Duration::from_millis(500)));
                        if let Err(e) = send_segment(&s, seg.as_raw_fd()) {
                            crate::log::info_log!(
                                "shared memory offer {what}: a local peer left before receiving it: {e}"
                            );
                        }
                    }
                }
            })
            .map_err(|e| Error::sys("spawning the shared memory offer thread", e))?;
        Ok(Offer {
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for Offer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
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
