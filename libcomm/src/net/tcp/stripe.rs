//! One TCP connection of the byte mover: a message striped over several
//! sockets, each driven by a helper thread of its own.
//!
//! A send cuts its message into pieces ([`pieces`]: at least the minimum
//! piece size, at most one per socket) and queues each, behind a
//! [`TaskHeader`], to its socket's thread, which writes it whole. A
//! receiving socket's thread reads a header, finds the posted receive of
//! that sequence number (waiting for it to be posted, as data waits in the
//! socket buffer), checks the piece against it (tag, size, bounds) and reads
//! the payload straight into the receive's buffer; the receive is done once
//! its bytes have all arrived. Sockets are independent, so a slow one never
//! holds another's pieces, and the receiver needs no size exchange first.
//!
//! NCCL's socket transport has the same shape (`NCCL_NSOCKS_PERTHREAD` x
//! `NCCL_SOCKET_NTHREADS` sockets, helper threads); here every socket has
//! its own thread.
//!
//! Failures: the first error of any socket (EOF, reset, `TCP_USER_TIMEOUT`,
//! a protocol violation) stops the comm; `test` then returns it, naming the
//! peer. Dropping the comm stops its threads (sockets shut down, so blocked
//! polls return at once) and joins them.

use super::io::{self, IoEnd};
use super::wire::{TASK_HEADER, TaskHeader, pieces};
use crate::net::{MemKind, Mr, NetError, RecvBuf, RecvComm, Request, SendComm};
use std::collections::{BTreeMap, HashMap};
use std::net::TcpStream;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

/// Requests in flight per comm, at most (past it `isend`/`irecv` say "not now").
pub const MAX_REQUESTS: usize = 64;

/// What the sockets of one comm share.
struct Shared {
    peer: String,
    stop: AtomicBool,
    err: Mutex<Option<NetError>>,
    /// Sockets the peer closed between messages, and how many there are.
    closed: AtomicUsize,
    nsocks: usize,
}

impl Shared {
    fn new(peer: String, nsocks: usize) -> Arc<Shared> {
        Arc::new(Shared {
            peer,
            stop: AtomicBool::new(false),
            err: Mutex::new(None),
            closed: AtomicUsize::new(0),
            nsocks,
        })
    }

    fn fail(&self, what: String) {
        let mut e = self.err.lock().unwrap_or_else(|e| e.into_inner());
        if e.is_none() && !self.stop.load(Ordering::Acquire) {
            *e = Some(NetError::Peer {
                peer: self.peer.clone(),
                what,
            });
        }
        drop(e);
        self.stop.store(true, Ordering::Release);
    }

    /// The peer closed one socket between two messages (a peer that is
    /// done closes them all: its last messages may still be arriving on
    /// the others). The comm fails once every socket is closed, which is
    /// when a receive still waiting can never complete.
    fn closed_cleanly(&self) {
        if self.closed.fetch_add(1, Ordering::AcqRel) + 1 == self.nsocks {
            let mut e = self.err.lock().unwrap_or_else(|e| e.into_inner());
            if e.is_none() && !self.stop.load(Ordering::Acquire) {
                *e = Some(NetError::Peer {
                    peer: self.peer.clone(),
                    what: "connection closed by the peer".into(),
                });
            }
        }
    }

    fn error(&self) -> Option<NetError> {
        self.err.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn io_failed(&self, e: IoEnd, doing: &str) {
        match e {
            IoEnd::Stopped => {}
            IoEnd::Eof { .. } => self.fail(format!("connection closed by the peer while {doing}")),
            IoEnd::Failed(why) => self.fail(format!("{why} while {doing}")),
        }
    }
}

/// The sockets and threads of a comm, stopped and joined on drop.
struct Sockets {
    shared: Arc<Shared>,
    socks: Vec<TcpStream>,
    threads: Vec<JoinHandle<()>>,
}

impl Drop for Sockets {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        for s in &self.socks {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// Registrations of one comm: host memory only.
#[derive(Default)]
struct Mrs {
    next: u64,
    live: HashMap<u64, (usize, usize)>,
}

impl Mrs {
    fn reg(&mut self, base: *const u8, len: usize, kind: MemKind) -> Result<Mr, NetError> {
        if let MemKind::Device(dev) = kind {
            return Err(NetError::Unsupported {
                net: "tcp",
                what: format!(
                    "registering memory of GPU {dev}: TCP moves host memory only (stage through pinned host memory)"
                ),
            });
        }
        self.next += 1;
        self.live.insert(self.next, (base as usize, len));
        Ok(Mr {
            id: self.next,
            base: base as usize,
            len,
            kind,
        })
    }

    fn dereg(&mut self, mr: &Mr) -> Result<(), NetError> {
        self.live.remove(&mr.id).map(|_| ()).ok_or_else(|| {
            NetError::InvalidArgument(format!("memory region {} is not registered here", mr.id))
        })
    }

    /// `mr` is one of ours and covers the bytes.
    fn check(&self, mr: &Mr, ptr: usize, len: usize) -> Result<(), NetError> {
        match self.live.get(&mr.id) {
            Some(&(b, l)) if b == mr.base && l == mr.len && mr.covers(ptr, len) => Ok(()),
            Some(_) => Err(NetError::InvalidArgument(format!(
                "{len} bytes at {ptr:#x} lie outside memory region {} ({} bytes at {:#x})",
                mr.id, mr.len, mr.base
            ))),
            None => Err(NetError::InvalidArgument(format!(
                "memory region {} is not registered here",
                mr.id
            ))),
        }
    }
}

// ------------------------------------------------------------------ send

struct SendReq {
    /// Pieces not yet written.
    left: AtomicUsize,
    bytes: usize,
}

struct Task {
    req: Arc<SendReq>,
    hdr: [u8; TASK_HEADER],
    ptr: usize,
    len: usize,
}

// SAFETY: `ptr` points into memory the `isend` caller keeps valid until the
// request is done; only the socket's thread reads it.
unsafe impl Send for Task {}

/// The sending end: [`SendComm`] over striped sockets.
pub struct TcpSendComm {
    sockets: Sockets,
    queues: Vec<mpsc::Sender<Task>>,
    seq: u64,
    next_req: u64,
    inflight: HashMap<u64, Arc<SendReq>>,
    mrs: Mrs,
    min_task: usize,
}

impl TcpSendComm {
    /// Takes over connected, tuned, non-blocking sockets.
    pub(super) fn new(
        peer: String,
        socks: Vec<TcpStream>,
        min_task: usize,
    ) -> Result<TcpSendComm, NetError> {
        let shared = Shared::new(peer, socks.len());
        let mut queues = Vec::new();
        let mut threads = Vec::new();
        for (i, s) in socks.iter().enumerate() {
            let (tx, rx) = mpsc::channel::<Task>();
            let (fd, sh) = (s.as_raw_fd(), shared.clone());
            let t = std::thread::Builder::new()
                .name(format!("weft-net-tx{i}"))
                .spawn(crate::sys::affinity::placed(move || send_loop(fd, rx, &sh)))
                .map_err(|e| NetError::sys("spawning a net send thread", e))?;
            queues.push(tx);
            threads.push(t);
        }
        Ok(TcpSendComm {
            sockets: Sockets {
                shared,
                socks,
                threads,
            },
            queues,
            seq: 0,
            next_req: 0,
            inflight: HashMap::new(),
            mrs: Mrs::default(),
            min_task,
        })
    }
}

fn send_loop(fd: RawFd, rx: mpsc::Receiver<Task>, sh: &Shared) {
    loop {
        let t = match rx.recv_timeout(Duration::from_millis(100)) {
            Ok(t) => t,
            Err(mpsc::RecvTimeoutError::Timeout) if !sh.stop.load(Ordering::Acquire) => continue,
            Err(_) => return,
        };
        if sh.stop.load(Ordering::Acquire) {
            return;
        }
        // SAFETY: see `Task`.
        let payload = unsafe { std::slice::from_raw_parts(t.ptr as *const u8, t.len) };
        if let Err(e) = io::write_all(fd, [&t.hdr, payload], &sh.stop) {
            return sh.io_failed(e, "sending");
        }
        t.req.left.fetch_sub(1, Ordering::Release);
    }
}

/// The methods [`SendComm`] and [`RecvComm`] share, alike on both ends:
/// the peer's name from the sockets, registrations in `mrs`.
macro_rules! endpoint_methods {
    () => {
        fn peer(&self) -> &str {
            &self.sockets.shared.peer
        }

        fn reg_mr(&mut self, base: *const u8, len: usize, kind: MemKind) -> Result<Mr, NetError> {
            self.mrs.reg(base, len, kind)
        }

        fn dereg_mr(&mut self, mr: &Mr) -> Result<(), NetError> {
            self.mrs.dereg(mr)
        }
    };
}

impl SendComm for TcpSendComm {
    endpoint_methods!();

    unsafe fn isend(
        &mut self,
        mr: &Mr,
        data: *const u8,
        len: usize,
        tag: u32,
    ) -> Result<Option<Request>, NetError> {
        if let Some(e) = self.sockets.shared.error() {
            return Err(e);
        }
        self.mrs.check(mr, data as usize, len)?;
        if self.inflight.len() >= MAX_REQUESTS {
            return Ok(None);
        }
        let seq = self.seq;
        self.seq += 1;
        let parts = pieces(seq, len, self.queues.len(), self.min_task);
        let req = Arc::new(SendReq {
            left: AtomicUsize::new(parts.len()),
            bytes: len,
        });
        for (sock, off, plen) in parts {
            let hdr = TaskHeader {
                seq,
                total: len as u64,
                offset: off as u64,
                len: plen as u32,
                tag,
            };
            let task = Task {
                req: req.clone(),
                hdr: hdr.encode(),
                ptr: data as usize + off,
                len: plen,
            };
            if self.queues[sock].send(task).is_err() {
                return Err(self.sockets.shared.error().unwrap_or(NetError::Closed));
            }
        }
        self.next_req += 1;
        self.inflight.insert(self.next_req, req);
        Ok(Some(Request(self.next_req)))
    }

    fn test(&mut self, req: Request) -> Result<Option<usize>, NetError> {
        let r = self
            .inflight
            .get(&req.0)
            .ok_or_else(|| NetError::InvalidArgument(format!("no send request {}", req.0)))?;
        if r.left.load(Ordering::Acquire) == 0 {
            let bytes = r.bytes;
            self.inflight.remove(&req.0);
            return Ok(Some(bytes));
        }
        match self.sockets.shared.error() {
            Some(e) => Err(e),
            None => Ok(None),
        }
    }
}

// ------------------------------------------------------------------ receive

struct RecvReq {
    ptr: usize,
    cap: usize,
    tag: u32,
    /// The message's size once its first piece arrived (u64::MAX before).
    total: AtomicU64,
    got: AtomicU64,
    done: AtomicBool,
}

/// Receives posted and not finished, by sequence number.
#[derive(Default)]
struct Posted {
    reqs: BTreeMap<u64, Arc<RecvReq>>,
    /// Sequence numbers below this were posted.
    next: u64,
}

struct RecvSide {
    posted: Mutex<Posted>,
    more: Condvar,
}

/// The receiving end: [`RecvComm`] over striped sockets.
pub struct TcpRecvComm {
    sockets: Sockets,
    side: Arc<RecvSide>,
    next_req: u64,
    inflight: HashMap<u64, Arc<RecvReq>>,
    mrs: Mrs,
}

impl TcpRecvComm {
    pub(super) fn new(peer: String, socks: Vec<TcpStream>) -> Result<TcpRecvComm, NetError> {
        let shared = Shared::new(peer, socks.len());
        let side = Arc::new(RecvSide {
            posted: Mutex::new(Posted::default()),
            more: Condvar::new(),
        });
        let mut threads = Vec::new();
        for (i, s) in socks.iter().enumerate() {
            let (fd, sh, side) = (s.as_raw_fd(), shared.clone(), side.clone());
            let t = std::thread::Builder::new()
                .name(format!("weft-net-rx{i}"))
                .spawn(crate::sys::affinity::placed(move || {
                    recv_loop(fd, &sh, &side)
                }))
                .map_err(|e| NetError::sys("spawning a net receive thread", e))?;
            threads.push(t);
        }
        Ok(TcpRecvComm {
            sockets: Sockets {
                shared,
                socks,
                threads,
            },
            side,
            next_req: 0,
            inflight: HashMap::new(),
            mrs: Mrs::default(),
        })
    }
}

impl RecvSide {
    /// The posted receive of message `seq`, waiting for it to be posted.
    fn find(&self, seq: u64, sh: &Shared) -> Result<Arc<RecvReq>, String> {
        let mut p = self.posted.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(r) = p.reqs.get(&seq) {
                return Ok(r.clone());
            }
            if seq < p.next {
                return Err(format!(
                    "a piece of message {seq}, which is complete already"
                ));
            }
            if sh.stop.load(Ordering::Acquire) {
                return Err(String::new());
            }
            p = self
                .more
                .wait_timeout(p, Duration::from_millis(100))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    fn finish(&self, seq: u64) {
        self.posted
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .reqs
            .remove(&seq);
    }
}

/// Checks a piece against the receive it belongs to.
fn admit(h: &TaskHeader, r: &RecvReq) -> Result<(), String> {
    if h.tag != r.tag {
        return Err(format!(
            "message {} has tag {:#x}, the receive posted for it {:#x} (the ranks disagree about which operation runs)",
            h.seq, h.tag, r.tag
        ));
    }
    if h.total > r.cap as u64 {
        return Err(format!(
            "message {} has {} bytes, the receive posted for it only {}",
            h.seq, h.total, r.cap
        ));
    }
    match r
        .total
        .compare_exchange(u64::MAX, h.total, Ordering::AcqRel, Ordering::Acquire)
    {
        Ok(_) => Ok(()),
        Err(t) if t == h.total => Ok(()),
        Err(t) => Err(format!(
            "pieces of message {} disagree about its size ({t} and {} bytes)",
            h.seq, h.total
        )),
    }
}

fn recv_loop(fd: RawFd, sh: &Shared, side: &RecvSide) {
    loop {
        let mut hb = [0u8; TASK_HEADER];
        // SAFETY: a local array.
        match unsafe { io::read_exact(fd, hb.as_mut_ptr(), TASK_HEADER, &sh.stop) } {
            Ok(()) => {}
            Err(IoEnd::Eof { got: 0 }) => return sh.closed_cleanly(),
            Err(e) => return sh.io_failed(e, "receiving"),
        }
        let h = match TaskHeader::decode(&hb) {
            Ok(h) => h,
            Err(why) => return sh.fail(why),
        };
        let r = match side.find(h.seq, sh) {
            Ok(r) => r,
            Err(why) if why.is_empty() => return,
            Err(why) => return sh.fail(why),
        };
        if let Err(why) = admit(&h, &r) {
            return sh.fail(why);
        }
        // SAFETY: offset + len <= total <= cap (decode and admit), and the
        // receive's buffer is valid until it is done.
        let dst = (r.ptr + h.offset as usize) as *mut u8;
        if let Err(e) = unsafe { io::read_exact(fd, dst, h.len as usize, &sh.stop) } {
            return sh.io_failed(e, "receiving");
        }
        let got = r.got.fetch_add(h.len as u64, Ordering::AcqRel) + h.len as u64;
        if got > h.total {
            return sh.fail(format!("message {} got more bytes than its size", h.seq));
        }
        if got == h.total {
            side.finish(h.seq);
            r.done.store(true, Ordering::Release);
        }
    }
}

impl RecvComm for TcpRecvComm {
    endpoint_methods!();

    unsafe fn irecv(&mut self, bufs: &[RecvBuf<'_>]) -> Result<Option<Request>, NetError> {
        if let Some(e) = self.sockets.shared.error() {
            return Err(e);
        }
        let [b] = bufs else {
            return Err(NetError::InvalidArgument(format!(
                "the TCP transport receives into one buffer at a time, not {}",
                bufs.len()
            )));
        };
        self.mrs.check(b.mr, b.ptr as usize, b.len)?;
        if self.inflight.len() >= MAX_REQUESTS {
            return Ok(None);
        }
        let r = Arc::new(RecvReq {
            ptr: b.ptr as usize,
            cap: b.len,
            tag: b.tag,
            total: AtomicU64::new(u64::MAX),
            got: AtomicU64::new(0),
            done: AtomicBool::new(false),
        });
        {
            let mut p = self.side.posted.lock().unwrap_or_else(|e| e.into_inner());
            let seq = p.next;
            p.next += 1;
            p.reqs.insert(seq, r.clone());
        }
        self.side.more.notify_all();
        self.next_req += 1;
        self.inflight.insert(self.next_req, r);
        Ok(Some(Request(self.next_req)))
    }

    fn test(&mut self, req: Request) -> Result<Option<Vec<usize>>, NetError> {
        let r = self
            .inflight
            .get(&req.0)
            .ok_or_else(|| NetError::InvalidArgument(format!("no receive request {}", req.0)))?;
        if r.done.load(Ordering::Acquire) {
            let n = r.total.load(Ordering::Acquire) as usize;
            self.inflight.remove(&req.0);
            return Ok(Some(vec![n]));
        }
        match self.sockets.shared.error() {
            Some(e) => Err(e),
            None => Ok(None),
        }
    }
}
