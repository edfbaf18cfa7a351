//! Point-to-point channels between two ranks of a communicator, and the
//! message stepping both transports share.
//!
//! A channel carries, in each direction, a stream of messages each prefixed by
//! an 8-byte header (payload length, sequence number), so a rank whose counts
//! or types differ from its peer's gets a clear error instead of corrupt data
//! or a hang. Steps never block: they move what fits and report progress; the
//! caller (`progress/exec.rs`) decides when to wait. The three transports:
//! `shm.rs` (shared memory within a host), `tcp.rs` (across hosts) and
//! `sidecar_rings.rs` (through the pod's sidecar, contract in
//! `sidecar_link.rs`); `futex.rs` holds the doorbells they sleep on.

pub(crate) mod futex;
pub(crate) mod shm;
pub mod sidecar_link;
pub(crate) mod sidecar_rings;
pub(crate) mod tcp;

use crate::data::reduce;
use crate::data::types::{Combine, DataType};
use crate::error::Error;
use shm::{MSG_HDR, RingEnd};
use std::io::{ErrorKind, Read};
use std::net::TcpStream;
use std::os::fd::AsRawFd;

/// At most this many bytes per step, so one big transfer cannot starve the
/// others progressing in the same loop.
const PIECE: usize = 256 << 10;
const TCP_PIECE: usize = 4 << 20;

#[derive(Clone, Copy)]
pub(crate) struct Reduce {
    pub dtype: DataType,
    pub op: Combine,
    /// `dst[i] = other[i] op incoming[i]` (`other` may equal `dst`).
    pub other: *const u8,
}

/// Progress of one message in one direction.
#[derive(Default, Clone, Copy)]
pub(crate) struct Progress {
    /// Stream bytes moved (header and padding included).
    pub pos: usize,
    /// Payload bytes delivered (receiver) or sent (sender).
    pub payload: usize,
    pub seq: u32,
    pub done: bool,
}

impl Progress {
    /// Whether all `total` stream bytes of the message moved; marks it done
    /// once they have.
    fn check_done(&mut self, total: usize) -> bool {
        let all = self.pos >= total;
        self.done |= all;
        all
    }
}

pub(crate) fn pad8(n: usize) -> usize {
    n.next_multiple_of(8)
}

fn header(len: usize, seq: u32) -> [u8; 8] {
    let mut h = [0u8; 8];
    h[..4].copy_from_slice(&(len as u32).to_le_bytes());
    h[4..].copy_from_slice(&seq.to_le_bytes());
    h
}

fn check_header(h: [u8; 8], len: usize, seq: u32) -> std::result::Result<(), String> {
    let got_len = u32::from_le_bytes(h[..4].try_into().unwrap()) as usize;
    let got_seq = u32::from_le_bytes(h[4..].try_into().unwrap());
    if got_seq != seq {
        return Err(format!(
            "message #{got_seq} arrived where #{seq} was expected: the ranks issued different sequences of operations"
        ));
    }
    if got_len != len {
        return Err(format!(
            "the peer sent {got_len} bytes where this rank expected {len}: count or data type differs between ranks"
        ));
    }
    Ok(())
}

/// Moves received bytes into place: a copy, or a reduction with `other`.
///
/// # Safety
/// `dst + off .. + n` and (for reductions) `other + off .. + n` must be valid.
#[inline]
unsafe fn deliver(dst: *mut u8, off: usize, src: *const u8, n: usize, red: Option<Reduce>) {
    if n == 0 {
        return;
    }
    unsafe {
        match red {
            None => std::ptr::copy_nonoverlapping(src, dst.add(off), n),
            Some(r) => {
                let es = r.dtype.size();
                reduce::combine(r.dtype, r.op, dst.add(off), r.other.add(off), src, n / es)
            }
        }
    }
}

pub(crate) struct ShmChan {
    pub send: RingEnd,
    pub recv: RingEnd,
}

pub(crate) struct TcpChan {
    pub sock: TcpStream,
    hdr_in: [u8; 8],
    bounce: Vec<u8>,
    fill: usize,
}

pub(crate) enum Chan {
    Shm(ShmChan),
    Tcp(TcpChan),
    /// Rings shared with the sidecar proxy: stepped exactly as `Shm`.
    Proxy(ShmChan),
}

/// Per-direction message counters of a channel (for the header sequence check).
#[derive(Default)]
pub(crate) struct Seqs {
    pub send: u32,
    pub recv: u32,
}

impl TcpChan {
    pub fn new(sock: TcpStream) -> TcpChan {
        TcpChan {
            sock,
            hdr_in: [0; 8],
            bounce: Vec::new(),
            fill: 0,
        }
    }
}

pub(crate) type StepResult = std::result::Result<bool, String>;

impl Chan {
    pub fn is_tcp(&self) -> bool {
        matches!(self, Chan::Tcp(_))
    }

    pub fn fd(&self) -> Option<i32> {
        match self {
            Chan::Tcp(t) => Some(t.sock.as_raw_fd()),
            Chan::Shm(_) | Chan::Proxy(_) => None,
        }
    }

    /// Sends more of a message whose first `limit` payload bytes are ready.
    ///
    /// # Safety
    /// `src .. + len` must stay valid until the message is done.
    pub unsafe fn send_step(
        &mut self,
        src: *const u8,
        len: usize,
        limit: usize,
        p: &mut Progress,
    ) -> StepResult {
        match self {
            Chan::Shm(c) | Chan::Proxy(c) => unsafe { shm_send(&mut c.send, src, len, limit, p) },
            Chan::Tcp(c) => unsafe { tcp_send(c, src, len, limit, p) },
        }
    }

    /// Receives more of a message into `dst` (copying or reducing).
    ///
    /// # Safety
    /// `dst .. + len` (and the reduction operand) must stay valid until done.
    pub unsafe fn recv_step(
        &mut self,
        dst: *mut u8,
        len: usize,
        red: Option<Reduce>,
        p: &mut Progress,
    ) -> StepResult {
        match self {
            Chan::Shm(c) | Chan::Proxy(c) => unsafe { shm_recv(&mut c.recv, dst, len, red, p) },
            Chan::Tcp(c) => unsafe { tcp_recv(c, dst, len, red, p) },
        }
    }
}

fn internal(e: Error) -> String {
    e.to_string()
}

unsafe fn shm_send(
    ring: &mut RingEnd,
    src: *const u8,
    len: usize,
    limit: usize,
    p: &mut Progress,
) -> StepResult {
    let total = MSG_HDR + pad8(len);
    if p.check_done(total) {
        return Ok(false);
    }
    let mut space = ring.space().map_err(internal)?;
    let mut wrote = 0;
    if p.pos == 0 {
        if space < MSG_HDR {
            return Ok(false);
        }
        ring.write_at(0, header(len, p.seq).as_ptr(), MSG_HDR);
        wrote = MSG_HDR;
        space -= MSG_HDR;
        p.pos = MSG_HDR;
    }
    let off = p.pos - MSG_HDR;
    let ready_end = if limit >= len { pad8(len) } else { limit & !7 };
    let n = space.min(ready_end.saturating_sub(off)).min(PIECE) & !7;
    if n > 0 {
        let copy = (off + n).min(len).saturating_sub(off);
        ring.write_at(wrote, unsafe { src.add(off) }, copy);
        wrote += n;
        p.pos += n;
        p.payload = (off + n).min(len);
    }
    if wrote > 0 {
        ring.publish(wrote);
    }
    p.check_done(total);
    Ok(wrote > 0)
}

unsafe fn shm_recv(
    ring: &mut RingEnd,
    dst: *mut u8,
    len: usize,
    red: Option<Reduce>,
    p: &mut Progress,
) -> StepResult {
    let total = MSG_HDR + pad8(len);
    if p.check_done(total) {
        return Ok(false);
    }
    let mut avail = ring.available().map_err(internal)?;
    if avail == 0 {
        return Ok(false);
    }
    let mut consumed = 0;
    if p.pos == 0 {
        let mut h = [0u8; 8];
        let [(a, la), (b, lb)] = ring.regions(0, MSG_HDR);
        unsafe {
            std::ptr::copy_nonoverlapping(a, h.as_mut_ptr(), la);
            std::ptr::copy_nonoverlapping(b, h.as_mut_ptr().add(la), lb);
        }
        check_header(h, len, p.seq)?;
        consumed = MSG_HDR;
        avail -= MSG_HDR;
        p.pos = MSG_HDR;
    }
    let off = p.pos - MSG_HDR;
    let n = avail.min(pad8(len) - off).min(PIECE);
    if n > 0 {
        let useful = (off + n).min(len).saturating_sub(off);
        let [(a, la), (b, lb)] = ring.regions(consumed, useful);
        unsafe {
            deliver(dst, off, a, la, red);
            deliver(dst, off + la, b, lb, red);
        }
        consumed += n;
        p.pos += n;
        p.payload = (off + n).min(len);
    }
    if consumed > 0 {
        ring.consume(consumed);
    }
    p.check_done(total);
    Ok(consumed > 0)
}

fn io_err(e: std::io::Error) -> String {
    match e.kind() {
        ErrorKind::ConnectionReset | ErrorKind::BrokenPipe | ErrorKind::UnexpectedEof => {
            "connection closed by the peer (its process exited or aborted)".into()
        }
        ErrorKind::TimedOut => "peer unreachable: TCP keepalive/user timeout expired".into(),
        _ => format!("socket error: {e}"),
    }
}

/// `send(2)` with MSG_NOSIGNAL: a closed peer must be an error, not SIGPIPE
/// killing a C program that links us.
fn send_nosignal(s: &TcpStream, bufs: &[&[u8]]) -> std::io::Result<usize> {
    let iov: Vec<libc::iovec> = bufs
        .iter()
        .filter(|b| !b.is_empty())
        .map(|b| libc::iovec {
            iov_base: b.as_ptr() as *mut _,
            iov_len: b.len(),
        })
        .collect();
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov.as_ptr() as *mut _;
    msg.msg_iovlen = iov.len() as _;
    let n = unsafe { libc::sendmsg(s.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
    if n < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

unsafe fn tcp_send(
    c: &mut TcpChan,
    src: *const u8,
    len: usize,
    limit: usize,
    p: &mut Progress,
) -> StepResult {
    let total = MSG_HDR + len;
    let mut made = false;
    while p.pos < total {
        let off = p.pos.saturating_sub(MSG_HDR);
        let ready = limit.min(len);
        let body_end = ready.min(off + TCP_PIECE);
        let body =
            unsafe { std::slice::from_raw_parts(src.add(off), body_end.saturating_sub(off)) };
        let h = header(len, p.seq);
        let hdr: &[u8] = if p.pos < MSG_HDR { &h[p.pos..] } else { &[] };
        if hdr.is_empty() && body.is_empty() {
            break; // waiting for gated data
        }
        match send_nosignal(&c.sock, &[hdr, body]) {
            Ok(0) => return Err("connection closed by the peer".into()),
            Ok(n) => {
                p.pos += n;
                made = true;
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => break,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(io_err(e)),
        }
    }
    p.payload = p.pos.saturating_sub(MSG_HDR);
    p.done = p.pos >= total;
    Ok(made)
}

unsafe fn tcp_recv(
    c: &mut TcpChan,
    dst: *mut u8,
    len: usize,
    red: Option<Reduce>,
    p: &mut Progress,
) -> StepResult {
    let mut made = false;
    while p.pos < MSG_HDR {
        match (&c.sock).read(&mut c.hdr_in[p.pos..]) {
            Ok(0) => return Err(io_err(ErrorKind::UnexpectedEof.into())),
            Ok(n) => {
                p.pos += n;
                made = true;
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(made),
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(io_err(e)),
        }
        if p.pos == MSG_HDR {
            check_header(c.hdr_in, len, p.seq)?;
        }
    }
    match red {
        None => {
            while p.payload < len {
                let n = (len - p.payload).min(TCP_PIECE);
                let buf = unsafe { std::slice::from_raw_parts_mut(dst.add(p.payload), n) };
                match (&c.sock).read(buf) {
                    Ok(0) => return Err(io_err(ErrorKind::UnexpectedEof.into())),
                    Ok(k) => {
                        p.payload += k;
                        p.pos += k;
                        made = true;
                    }
                    Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == ErrorKind::Interrupted => {}
                    Err(e) => return Err(io_err(e)),
                }
            }
        }
        Some(r) => {
            let es = r.dtype.size();
            if c.bounce.len() < PIECE {
                c.bounce.resize(PIECE, 0);
            }
            while p.payload < len {
                let want = (len - p.payload - c.fill).min(PIECE - c.fill);
                if want == 0 {
                    break;
                }
                match (&c.sock).read(&mut c.bounce[c.fill..c.fill + want]) {
                    Ok(0) => return Err(io_err(ErrorKind::UnexpectedEof.into())),
                    Ok(k) => {
                        c.fill += k;
                        p.pos += k;
                        made = true;
                        let whole = c.fill / es * es;
                        unsafe { deliver(dst, p.payload, c.bounce.as_ptr(), whole, red) };
                        p.payload += whole;
                        c.bounce.copy_within(whole..c.fill, 0);
                        c.fill -= whole;
                    }
                    Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == ErrorKind::Interrupted => {}
                    Err(e) => return Err(io_err(e)),
                }
            }
        }
    }
    p.done = p.payload >= len && p.pos >= MSG_HDR;
    Ok(made)
}
