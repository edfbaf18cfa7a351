//! The proxy's progress thread: moves bytes from the ranks' send rings to
//! the host connections (writev straight out of the ring memory, no copy),
//! grants credits for the receive rings, sends pings on idle connections.
//! Sockets are non-blocking: a connection whose socket is full waits alone.
//! Idle, the thread sleeps on the sidecar's doorbell, which ranks ring
//! after publishing into or consuming from their rings.

use super::wire::{self, FRAME_HEADER, Frame};
use super::{HostConn, Proxy, SendChan};
use crate::error::SidecarError;
use std::io::ErrorKind;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// Idle iterations spent spinning, then yielding, before sleeping.
const SPIN: u32 = 200;
const YIELDS: u32 = 20;
/// At most this much per connection per pass (fairness between hosts).
const PASS_BUDGET: usize = 4 << 20;

/// A data frame being written.
struct Cur {
    chan: Arc<SendChan>,
    hdr: [u8; FRAME_HEADER],
    /// Header and payload bytes written.
    written: usize,
    len: usize,
    /// Payload bytes already released from the ring (a multiple of 8).
    consumed: usize,
}

#[derive(Default)]
pub struct TxState {
    ctrl: Vec<u8>,
    ctrl_off: usize,
    cur: Option<Cur>,
    rr: usize,
}

impl TxState {
    pub fn queue(&mut self, f: Frame) {
        self.ctrl.extend_from_slice(&f.encode());
    }
    /// A control frame with a (small) payload: `f.len` is set from it.
    pub fn queue_with(&mut self, mut f: Frame, payload: &[u8]) {
        f.len = payload.len() as u32;
        self.ctrl.extend_from_slice(&f.encode());
        self.ctrl.extend_from_slice(payload);
    }
    fn idle(&self) -> bool {
        self.cur.is_none() && self.ctrl_off >= self.ctrl.len()
    }
}

fn writev(fd: i32, bufs: &[(*const u8, usize)]) -> std::io::Result<usize> {
    let iov: Vec<libc::iovec> = bufs
        .iter()
        .filter(|b| b.1 > 0)
        .map(|b| libc::iovec {
            iov_base: b.0 as *mut _,
            iov_len: b.1,
        })
        .collect();
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov.as_ptr() as *mut _;
    msg.msg_iovlen = iov.len() as _;
    let n = unsafe { libc::sendmsg(fd, &msg, libc::MSG_NOSIGNAL) };
    if n < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

fn io_err(e: std::io::Error) -> SidecarError {
    SidecarError::Lost(match e.kind() {
        ErrorKind::ConnectionReset | ErrorKind::BrokenPipe => {
            "its sidecar reset the connection".into()
        }
        ErrorKind::TimedOut => "the connection timed out (link down?)".into(),
        _ => format!("connection error: {e}"),
    })
}

/// Writes what it can on one connection: `(moved anything, socket full)`.
fn pump(
    c: &HostConn,
    chans: &[Arc<SendChan>],
    t: &mut TxState,
) -> Result<(bool, bool), SidecarError> {
    let Some(sock) = c.sock.get() else {
        return Ok((false, false));
    };
    let fd = sock.as_raw_fd();
    let mut moved = false;
    let mut budget = PASS_BUDGET;
    loop {
        if let Some(cur) = t.cur.as_mut() {
            let mut ring = cur.chan.ring.lock().unwrap_or_else(|e| e.into_inner());
            let hdr_done = cur.written.min(FRAME_HEADER);
            let pay_done = cur.written - hdr_done;
            let [(a, la), (b, lb)] = ring.regions(pay_done - cur.consumed, cur.len - pay_done);
            let r = writev(
                fd,
                &[
                    (cur.hdr[hdr_done..].as_ptr(), FRAME_HEADER - hdr_done),
                    (a, la),
                    (b, lb),
                ],
            );
            match r {
                Ok(n) => {
                    moved = true;
                    cur.written += n;
                    let pay = cur.written.saturating_sub(FRAME_HEADER);
                    c.count_tx((pay - pay_done) as u64);
                    budget = budget.saturating_sub(n);
                    let release = (pay & !7) - cur.consumed;
                    if release > 0 {
                        ring.consume(release);
                        cur.consumed += release;
                    }
                    if pay == cur.len {
                        drop(ring);
                        c.count_tx_frame();
                        t.cur = None;
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok((moved, true)),
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(io_err(e)),
            }
        } else if t.ctrl_off < t.ctrl.len() {
            match writev(
                fd,
                &[(t.ctrl[t.ctrl_off..].as_ptr(), t.ctrl.len() - t.ctrl_off)],
            ) {
                Ok(n) => {
                    moved = true;
                    t.ctrl_off += n;
                    if t.ctrl_off == t.ctrl.len() {
                        t.ctrl.clear();
                        t.ctrl_off = 0;
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok((moved, true)),
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(io_err(e)),
            }
        } else {
            // The next channel (round robin) with bytes and credit.
            let n = chans.len();
            let mut next = None;
            for k in 0..n {
                let i = (t.rr + k) % n;
                let s = &chans[i];
                let ring = s.ring.lock().unwrap_or_else(|e| e.into_inner());
                let avail = ring.available().unwrap_or(0);
                if avail == 0 {
                    continue;
                }
                let pos = ring.pos();
                let credit = s.window.load(Ordering::Acquire).saturating_sub(pos) as usize;
                let len = avail.min(credit).min(wire::MAX_FRAME) & !7;
                if len > 0 {
                    let f = Frame {
                        kind: wire::KIND_DATA,
                        key: s.key,
                        len: len as u32,
                        value: pos,
                    };
                    next = Some((i, f, len));
                    break;
                }
            }
            let Some((i, f, len)) = next else {
                return Ok((moved, false));
            };
            t.rr = i + 1;
            t.cur = Some(Cur {
                chan: chans[i].clone(),
                hdr: f.encode(),
                written: 0,
                len,
                consumed: 0,
            });
        }
        if budget == 0 {
            return Ok((moved, false));
        }
    }
}

/// Grants credit to the senders of receive rings with new room.
fn grant(p: &Proxy) {
    let snap = p.snap.load();
    for rc in &snap.recv {
        if !rc.conn.up() {
            continue;
        }
        let Ok(ring) = rc.ring.try_lock() else {
            continue; // the receive thread is writing into it: next pass
        };
        let Ok(end) = ring.window_end() else { continue };
        let g = rc.granted.load(Ordering::Acquire);
        // Small steps only when the ring is empty (the sender may be waiting
        // for exactly that room); otherwise in eighths, to keep frames few.
        if end > g && (g == 0 || end - g >= ring.cap() / 8 || ring.drained()) {
            drop(ring);
            rc.granted.store(end, Ordering::Release);
            rc.conn
                .tx
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .queue(Frame {
                    kind: wire::KIND_CREDIT,
                    key: rc.key,
                    len: 0,
                    value: end,
                });
        }
    }
}

pub fn run(p: Arc<Proxy>) {
    let ping_every = (p.cfg.timeout / 4).max(Duration::from_millis(20));
    let mut idle = 0u32;
    let mut last_sweep = Instant::now();
    loop {
        let seen = p.doorbell.seen();
        grant(&p);
        let snap = p.snap.load_full();
        // A rank whose communicator failed: its remote peers must hear it.
        for l in &snap.links {
            if !l.told.load(Ordering::Acquire)
                && let Some((origin, aborted, why)) = l.att.raised()
            {
                // Raised by a local peer: its reason, when it is ours too.
                let why = if origin == l.rank {
                    why
                } else {
                    snap.links
                        .iter()
                        .find(|o| o.comm == l.comm && o.rank == origin)
                        .and_then(|o| o.att.raised())
                        .map(|x| x.2)
                        .filter(|s| !s.is_empty())
                        .map(|s| format!("rank {origin} failed: {s}"))
                        .unwrap_or_else(|| format!("rank {origin} failed"))
                };
                p.tell_failed(l, aborted as u64, &why);
            }
        }
        let mut progress = false;
        let mut blocked: Vec<libc::pollfd> = Vec::new();
        let now = p.now_ms();
        let mut closing = false;
        for (c, chans) in &snap.conns {
            closing |= chans.iter().any(|s| s.closed_at.get().is_some());
            if !c.up() {
                continue;
            }
            let mut t = c.tx.lock().unwrap_or_else(|e| e.into_inner());
            if t.idle()
                && now.saturating_sub(c.last_tx_ms.load(Ordering::Relaxed))
                    >= ping_every.as_millis() as u64
            {
                t.queue(Frame {
                    kind: wire::KIND_PING,
                    key: ([0; 16], 0, 0),
                    len: 0,
                    value: 0,
                });
            }
            match pump(c, chans, &mut t) {
                Ok((moved, full)) => {
                    if moved {
                        progress = true;
                        c.last_tx_ms.store(now, Ordering::Relaxed);
                    }
                    if full && let Some(s) = c.sock.get() {
                        blocked.push(libc::pollfd {
                            fd: s.as_raw_fd(),
                            events: libc::POLLOUT,
                            revents: 0,
                        });
                    }
                }
                Err(e) => {
                    drop(t);
                    p.lose(c, &e.to_string());
                }
            }
        }
        // Forget closed ranks' send channels once drained (or hopeless).
        if (closing || snap.dying) && last_sweep.elapsed() >= Duration::from_millis(20) {
            last_sweep = Instant::now();
            let mut reg = p.lock();
            let before = (reg.send.len(), reg.dying.len());
            reg.send.retain(|_, s| !super::drained_or_stale(s));
            let dying = std::mem::take(&mut reg.dying);
            let (done, wait): (Vec<_>, Vec<_>) = dying
                .into_iter()
                .partition(|l| !reg.send.keys().any(|k| k.0 == l.comm && k.1 == l.rank));
            reg.dying = wait;
            if (reg.send.len(), reg.dying.len()) != before {
                p.rebuild(&reg);
            }
            drop(reg);
            for l in done {
                p.tell_failed(&l, 2, "");
            }
        }
        if progress {
            idle = 0;
            continue;
        }
        idle += 1;
        if idle < SPIN {
            std::hint::spin_loop();
        } else if idle < SPIN + YIELDS {
            std::thread::yield_now();
        } else if !blocked.is_empty() {
            unsafe { libc::poll(blocked.as_mut_ptr(), blocked.len() as libc::nfds_t, 1) };
        } else {
            p.doorbell
                .wait(seen, ping_every.min(Duration::from_millis(50)));
        }
    }
}
