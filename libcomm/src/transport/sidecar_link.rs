//! The contract between a rank and its pod's sidecar *proxy*: the sidecar
//! moves this rank's bytes to and from ranks on other hosts.
//!
//! - **Offer.** A sidecar that proxies listens on a second Unix socket next
//!   to its control socket: `$WEFT_SIDECAR_SOCKET.proxy` (or
//!   `WEFT_PROXY_SOCKET`). A rank with `WEFT_SIDECAR_SOCKET` set uses it when
//!   it exists, unless `WEFT_PROXY=0`; `WEFT_PROXY=1` makes its absence an
//!   error. Without a sidecar (embedded mode) a rank keeps direct TCP: the
//!   process is its own proxy.
//! - **Open.** For each communicator with ranks on other hosts, the rank
//!   opens one connection to that socket and sends one [`OpenMsg`] with two
//!   descriptors (SCM_RIGHTS): its ring segment (a memfd: two SPSC rings per
//!   remote peer, send ring `2i` and receive ring `2i+1`) and its own
//!   control block (doorbell, failure flag). The sidecar answers `OK` with
//!   one descriptor, its doorbell (a control block), or `ERR` with a reason.
//! - **Data.** The rings carry exactly the byte stream a shared-memory
//!   channel carries (8-byte message headers with length and sequence
//!   number), so the receiving rank checks headers as always. The rank rings
//!   the sidecar's doorbell after publishing or consuming; the sidecar rings
//!   the rank's.
//! - **Failure.** The sidecar raises a failure (with a reason naming the lost
//!   host) in the rank's control block; the rank sees it in its next wait
//!   iteration. The connection closing means the other side is gone: the
//!   sidecar forgets the rank's channels (after draining what it sent), the
//!   rank fails its communicator ("lost the sidecar proxy").
//!
//! Everything read from the socket is bounded; nothing read from shared
//! memory is trusted for addressing (see `transport::shm`).

use crate::bootstrap::wire::{Dec, Enc};
use crate::error::{Error, Result};
use crate::transport::shm::{FAIL_ABORT, FAIL_ERROR, Mapping, RingEnd, ST_DESTROYED};
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::time::Duration;

pub const MAGIC: [u8; 4] = *b"WFTP";
pub const VERSION: u8 = 1;
/// Message header on the Unix socket: magic, version, kind, 2 reserved, length.
pub const HEADER: usize = 12;
/// Largest message either side accepts (an Open listing ~10k remote peers).
pub const MAX_MSG: usize = 4 << 20;
/// Most descriptors a message may carry.
pub const MAX_FDS: usize = 2;
/// Most remote peers one Open may list.
pub const MAX_PEERS: usize = 1 << 16;
/// Ring capacities the sidecar accepts (powers of two).
pub const MIN_RING: usize = 4 << 10;
pub const MAX_RING: usize = 16 << 20;

pub const KIND_OPEN: u8 = 1;
pub const KIND_OK: u8 = 2;
pub const KIND_ERR: u8 = 3;

/// The proxy socket to use, if any (see the module docs).
pub fn socket_path() -> Result<Option<PathBuf>> {
    use weft_contract::params::{WEFT_PROXY, WEFT_PROXY_SOCKET, WEFT_SIDECAR_SOCKET};
    let knob = WEFT_PROXY.raw().unwrap_or_default();
    let knob = knob.trim().to_ascii_lowercase();
    if matches!(knob.as_str(), "0" | "off" | "false" | "no") {
        return Ok(None);
    }
    let forced = matches!(knob.as_str(), "1" | "on" | "true" | "yes");
    let path = match WEFT_PROXY_SOCKET.raw_os().filter(|s| !s.is_empty()) {
        Some(p) => Some(PathBuf::from(p)),
        None => WEFT_SIDECAR_SOCKET
            .raw_os()
            .filter(|s| !s.is_empty())
            .map(|s| {
                let mut p = s;
                p.push(".proxy");
                PathBuf::from(p)
            }),
    };
    match path {
        Some(p) if p.exists() => Ok(Some(p)),
        p if forced => Err(Error::InvalidUsage(format!(
            "WEFT_PROXY=1 but no sidecar proxy socket exists{}",
            p.map(|p| format!(" at {}", p.display()))
                .unwrap_or_else(|| " (WEFT_SIDECAR_SOCKET is not set)".into())
        ))),
        _ => Ok(None),
    }
}

/// Whether a rank with `cfg` sends to other hosts through its sidecar's
/// proxy (what it tells its peers at bootstrap).
pub(crate) fn would_proxy(cfg: &crate::config::Config) -> bool {
    cfg.transport != crate::config::TransportPref::Tcp && matches!(socket_path(), Ok(Some(_)))
}

/// A remote peer of an opening rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProxyPeer {
    pub rank: u32,
    /// The peer's advertised address (its host's IP: the peer sidecar's too).
    pub addr: SocketAddr,
    pub host: String,
}

/// A rank opening proxied channels for one communicator.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OpenMsg {
    pub job: String,
    pub comm: [u8; 16],
    pub rank: u32,
    pub nranks: u32,
    pub pid: u32,
    /// Capacity of every ring in the segment (a power of two).
    pub ring_cap: u32,
    /// This rank's own advertised address.
    pub addr: SocketAddr,
    /// In ring order: peer `i` uses rings `2i` (send) and `2i+1` (receive).
    pub peers: Vec<ProxyPeer>,
}

impl OpenMsg {
    pub fn encode(&self) -> Vec<u8> {
        let mut e = Enc::default();
        e.str(&self.job)
            .bytes(&self.comm)
            .u32(self.rank)
            .u32(self.nranks)
            .u32(self.pid)
            .u32(self.ring_cap)
            .addr(self.addr)
            .u32(self.peers.len() as u32);
        for p in &self.peers {
            e.u32(p.rank).addr(p.addr).str(&p.host);
        }
        e.0
    }

    /// Decodes and validates (sizes, ranks, capacity) an Open.
    pub fn decode(b: &[u8]) -> Result<OpenMsg> {
        if b.len() > MAX_MSG {
            return Err(Error::InvalidArgument(
                "proxy open message too large".into(),
            ));
        }
        let mut d = Dec::new(b, "proxy open");
        let job = d.str(256)?;
        let comm = d.array()?;
        let rank = d.u32()?;
        let nranks = d.u32()?;
        let pid = d.u32()?;
        let ring_cap = d.u32()?;
        let addr = d.addr()?;
        let n = d.u32()? as usize;
        if n == 0 || n > MAX_PEERS || n >= nranks as usize || rank >= nranks {
            return Err(Error::InvalidArgument(format!(
                "proxy open: {n} remote peers, rank {rank} of {nranks}"
            )));
        }
        let cap = ring_cap as usize;
        if !cap.is_power_of_two() || !(MIN_RING..=MAX_RING).contains(&cap) {
            return Err(Error::InvalidArgument(format!(
                "proxy open: ring capacity {cap} is not a power of two in {MIN_RING}..={MAX_RING}"
            )));
        }
        let mut peers = Vec::with_capacity(n.min(1024));
        for _ in 0..n {
            let p = ProxyPeer {
                rank: d.u32()?,
                addr: d.addr()?,
                host: d.str(255)?,
            };
            if p.rank >= nranks || p.rank == rank {
                return Err(Error::InvalidArgument(format!(
                    "proxy open: peer rank {} out of range",
                    p.rank
                )));
            }
            peers.push(p);
        }
        d.finish()?;
        Ok(OpenMsg {
            job,
            comm,
            rank,
            nranks,
            pid,
            ring_cap,
            addr,
            peers,
        })
    }
}

fn header(kind: u8, len: usize) -> [u8; HEADER] {
    let mut h = [0u8; HEADER];
    h[..4].copy_from_slice(&MAGIC);
    h[4] = VERSION;
    h[5] = kind;
    h[8..].copy_from_slice(&(len as u32).to_be_bytes());
    h
}

/// Checks a message header: `(kind, payload length)`.
pub fn decode_header(h: &[u8; HEADER]) -> Result<(u8, usize)> {
    if h[..4] != MAGIC {
        return Err(Error::InvalidArgument(
            "not a Weft proxy message (bad magic)".into(),
        ));
    }
    if h[4] != VERSION {
        return Err(Error::InvalidArgument(format!(
            "proxy protocol version {} (this side speaks {VERSION})",
            h[4]
        )));
    }
    let kind = h[5];
    if !matches!(kind, KIND_OPEN | KIND_OK | KIND_ERR) {
        return Err(Error::InvalidArgument(format!(
            "unknown proxy message kind {kind}"
        )));
    }
    let len = u32::from_be_bytes(h[8..].try_into().unwrap()) as usize;
    if len > MAX_MSG {
        return Err(Error::InvalidArgument(format!(
            "proxy message of {len} bytes exceeds {MAX_MSG}"
        )));
    }
    Ok((kind, len))
}

/// Sends one message with descriptors attached to its first byte.
pub fn send_msg(fd: RawFd, kind: u8, payload: &[u8], fds: &[RawFd]) -> std::io::Result<()> {
    assert!(fds.len() <= MAX_FDS);
    let h = header(kind, payload.len());
    let total = HEADER + payload.len();
    let n = crate::sys::fdpass::send(fd, &[&h, payload], fds)?;
    // The rest (rare: a large Open) without descriptors.
    let mut done = n as usize;
    while done < total {
        let (buf, off) = if done < HEADER {
            (&h[..], done)
        } else {
            (payload, done - HEADER)
        };
        let k = unsafe {
            libc::send(
                fd,
                buf[off..].as_ptr().cast(),
                buf.len() - off,
                libc::MSG_NOSIGNAL,
            )
        };
        if k < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        done += k as usize;
    }
    Ok(())
}

/// Receives one message (blocking; bound it with SO_RCVTIMEO): kind,
/// payload and the descriptors that came with it.
pub fn recv_msg(fd: RawFd) -> Result<(u8, Vec<u8>, Vec<OwnedFd>)> {
    let mut h = [0u8; HEADER];
    let got = crate::sys::fdpass::recv(fd, &mut h)
        .map_err(|e| Error::sys("reading from the proxy socket", e))?;
    let (n, fds) = (got.len, got.fds);
    if n == 0 {
        return Err(Error::InvalidArgument("the proxy socket closed".into()));
    }
    if got.truncated || fds.len() > MAX_FDS {
        return Err(Error::InvalidArgument(
            "too many descriptors in a proxy message".into(),
        ));
    }
    read_exact(fd, &mut h[n..])?;
    let (kind, len) = decode_header(&h)?;
    let mut payload = vec![0u8; len];
    read_exact(fd, &mut payload)?;
    Ok((kind, payload, fds))
}

fn read_exact(fd: RawFd, mut b: &mut [u8]) -> Result<()> {
    while !b.is_empty() {
        let n = unsafe { libc::read(fd, b.as_mut_ptr().cast(), b.len()) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(Error::sys("reading from the proxy socket", e));
        }
        if n == 0 {
            return Err(Error::InvalidArgument(
                "the proxy socket closed mid-message".into(),
            ));
        }
        b = &mut b[n as usize..];
    }
    Ok(())
}

/// Bounds blocking reads on `fd` (the handshake must not hang either side).
pub use crate::sys::sockets::set_read_timeout;

// ---- The sidecar's side -------------------------------------------------

/// The sidecar's doorbell: one control block every attached rank rings.
pub struct Doorbell {
    map: Mapping,
    fd: OwnedFd,
}

impl Doorbell {
    pub fn create() -> Result<Doorbell> {
        let (map, fd) = Mapping::create_memfd("the sidecar proxy's doorbell", 0, 0)?;
        Ok(Doorbell { map, fd })
    }
    /// The descriptor to send to an opening rank.
    pub fn fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
    pub fn seen(&self) -> u32 {
        self.map.control().doorbell.load(Ordering::SeqCst)
    }
    /// Sleeps until rung after `seen` was read, at most `t`.
    pub fn wait(&self, seen: u32, t: Duration) {
        let c = self.map.control();
        c.sleepers.fetch_add(1, Ordering::SeqCst);
        crate::transport::futex::wait(&c.doorbell, seen, t);
        c.sleepers.fetch_sub(1, Ordering::SeqCst);
    }
    /// Wakes the thread waiting in [`Doorbell::wait`].
    pub fn ring(&self) {
        self.map.control().ring();
    }
}

/// A rank's segments as the sidecar maps them.
pub struct Attached {
    rings: Mapping,
    own: Mapping,
    rank: u32,
    npeers: usize,
}

unsafe impl Send for Attached {}
unsafe impl Sync for Attached {}

impl Attached {
    /// Maps what an Open sent: `fds[0]` the ring segment (its size must be
    /// exactly right), `fds[1]` the rank's control block.
    pub fn map(open: &OpenMsg, fds: &[OwnedFd]) -> Result<Attached> {
        if fds.len() != 2 {
            return Err(Error::InvalidArgument(format!(
                "proxy open carried {} descriptors, 2 expected",
                fds.len()
            )));
        }
        let npeers = open.peers.len();
        let rings = Mapping::from_fd(
            &fds[0],
            2 * npeers,
            open.ring_cap as usize,
            "the rank's proxy rings",
        )?;
        let own = Mapping::control_from_fd(&fds[1], "the rank's control block")?;
        Ok(Attached {
            rings,
            own,
            rank: open.rank,
            npeers,
        })
    }

    /// The sidecar's reading end of the rank's send ring to peer `i`.
    pub fn out_ring(self: &std::sync::Arc<Self>, i: usize) -> OutRing {
        assert!(i < self.npeers);
        OutRing {
            end: RingEnd::new(&self.rings, 2 * i, &self.own, false),
            _keep: self.clone(),
        }
    }

    /// The sidecar's writing end of the rank's receive ring from peer `i`.
    pub fn in_ring(self: &std::sync::Arc<Self>, i: usize) -> InRing {
        assert!(i < self.npeers);
        InRing {
            end: RingEnd::new(&self.rings, 2 * i + 1, &self.own, true),
            cap: self.rings.cap() as u64,
            _keep: self.clone(),
        }
    }

    /// Fails the rank's communicator with `reason` (unless it already failed).
    pub fn fail(&self, reason: &str) {
        let c = self.own.control();
        if c.failure().is_none() {
            c.set_reason(reason);
            c.raise(self.rank as usize, FAIL_ERROR);
        }
    }

    pub fn failed(&self) -> bool {
        self.own.control().failure().is_some()
    }

    /// The failure the rank's communicator holds, if any: (origin rank,
    /// aborted, reason — known only when the rank itself raised it).
    pub fn raised(&self) -> Option<(u32, bool, String)> {
        let c = self.own.control();
        let (origin, kind) = c.failure()?;
        let reason = if origin == self.rank as usize {
            c.reason()
        } else {
            String::new()
        };
        Some((origin as u32, kind == FAIL_ABORT, reason))
    }

    /// The rank destroyed its communicator (a clean end, not a crash).
    pub fn destroyed(&self) -> bool {
        self.own.control().state.load(Ordering::Acquire) == ST_DESTROYED
    }

    pub fn rank(&self) -> u32 {
        self.rank
    }
}

/// Bytes a rank sent, read straight out of its ring.
pub struct OutRing {
    end: RingEnd,
    _keep: std::sync::Arc<Attached>,
}

unsafe impl Send for OutRing {}

impl OutRing {
    /// Bytes published and not yet taken (a multiple of 8).
    pub fn available(&self) -> Result<usize> {
        self.end.available()
    }
    /// The ring memory holding the next `n` available bytes (up to two pieces).
    pub fn regions(&self, offset: usize, n: usize) -> [(*mut u8, usize); 2] {
        self.end.regions(offset, n)
    }
    /// Frees `n` bytes (a multiple of 8) and wakes the rank.
    pub fn consume(&mut self, n: usize) {
        self.end.consume(n)
    }
    /// Stream position: bytes taken so far.
    pub fn pos(&self) -> u64 {
        self.end.pos()
    }
}

/// Bytes for a rank, written straight into its ring.
pub struct InRing {
    end: RingEnd,
    cap: u64,
    _keep: std::sync::Arc<Attached>,
}

unsafe impl Send for InRing {}

impl InRing {
    /// Free bytes.
    pub fn space(&self) -> Result<usize> {
        self.end.space()
    }
    pub fn regions(&self, n: usize) -> [(*mut u8, usize); 2] {
        self.end.regions(0, n)
    }
    /// Publishes `n` bytes (a multiple of 8) and wakes the rank.
    pub fn publish(&mut self, n: usize) {
        self.end.publish(n)
    }
    /// How far the sender may write (stream position): consumed + capacity.
    pub fn window_end(&self) -> Result<u64> {
        Ok(self.end.pos() + self.end.space()? as u64)
    }
    /// Everything written has been read by the rank.
    pub fn drained(&self) -> bool {
        self.end
            .space()
            .map(|s| s as u64 == self.cap)
            .unwrap_or(false)
    }
    pub fn cap(&self) -> u64 {
        self.cap
    }
    /// Stream position: bytes written so far.
    pub fn pos(&self) -> u64 {
        self.end.pos()
    }
}
