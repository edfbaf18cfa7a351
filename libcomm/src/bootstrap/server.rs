//! A small poll(2)-based accept loop shared by the bootstrap root and the
//! per-process peer endpoint.
//!
//! Why not one blocking handshake at a time: a stray or slow client would stall
//! every rank behind it. Here each connection gets a fresh challenge, has a
//! total deadline and a small size bound for its first frame (read before
//! anything is authenticated, so a few KiB at most), and is handled only once
//! that frame is complete. Unauthenticated connections are capped per source
//! address and in all; at a cap the oldest pending handshake (of that source,
//! else of all) that has had [`GRACE`] to answer is dropped to make room, so
//! silent clients delay nobody for long: a real peer answers its challenge
//! within a round trip (and its client retries if it was dropped anyway).
//! Nothing on this thread blocks on a client (challenges and refusals are
//! written non-blocking, once).

use super::wire::{self, Frame, FrameBuf, Kind};
use crate::log::warn_log;
use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

/// Unauthenticated connections (handshakes under way) in all.
pub(crate) const MAX_PENDING: usize = 1024;
/// Unauthenticated connections from one source address.
pub(crate) const MAX_PENDING_PER_SOURCE: usize = 128;
/// Bytes a client may send before it is authenticated: its first frame's
/// payload, at most (a hello or a connect is a few hundred bytes).
pub(crate) const MAX_PREAUTH_PAYLOAD: usize = 4096;

/// The bounds of one listener.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Limits {
    /// Largest first-frame payload read before authentication.
    pub max_payload: usize,
    /// Total time a connection has to deliver its first frame.
    pub handshake_timeout: Duration,
    pub max_pending: usize,
    pub max_per_source: usize,
}

impl Limits {
    pub const fn new(handshake_timeout: Duration) -> Limits {
        Limits {
            max_payload: MAX_PREAUTH_PAYLOAD,
            handshake_timeout,
            max_pending: MAX_PENDING,
            max_per_source: MAX_PENDING_PER_SOURCE,
        }
    }
}

/// What a listener has seen (monotonic counters).
#[derive(Default)]
pub(crate) struct Counters {
    /// Connections accepted.
    pub accepted: AtomicU64,
    /// Refused before authentication: garbage, oversized, truncated, timed
    /// out, closed early.
    pub refused: AtomicU64,
    /// Refused because the MAC did not match any secret we hold.
    pub unauthenticated: AtomicU64,
    /// Dropped unanswered to make room under a cap (silent clients).
    pub evicted: AtomicU64,
    /// Of the refused: the handshake deadline passed.
    pub timed_out: AtomicU64,
}

impl Counters {
    pub const fn new() -> Counters {
        Counters {
            accepted: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            unauthenticated: AtomicU64::new(0),
            evicted: AtomicU64::new(0),
            timed_out: AtomicU64::new(0),
        }
    }
}

pub(crate) struct Accepted {
    pub stream: TcpStream,
    pub challenge: [u8; 16],
    pub frame: Frame,
    pub peer: SocketAddr,
}

pub(crate) trait Handler {
    /// A connection delivered its first complete frame (not yet authenticated:
    /// the handler knows which secret applies).
    fn on_frame(&mut self, a: Accepted);
    /// Called at least every 100 ms; return true to stop serving.
    fn tick(&mut self) -> bool;
}

struct Pending {
    stream: TcpStream,
    fb: FrameBuf,
    challenge: [u8; 16],
    since: Instant,
    deadline: Instant,
    peer: SocketAddr,
}

/// Rate limit of refusal warnings: a flood logs a few lines and then one
/// summary a second, not one line per connection.
struct LogGate {
    window: Instant,
    logged: u32,
    suppressed: u64,
}

static GATE: Mutex<Option<LogGate>> = Mutex::new(None);
const LOG_PER_SECOND: u32 = 10;

/// Says how many refusals were left out of the log, once their second is
/// over (called by the accept loop, so a flood that stops is summed up too).
fn flush_refusals(what: &str) {
    let mut g = GATE.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(gate) = g.as_mut()
        && gate.suppressed > 0
        && gate.window.elapsed() >= Duration::from_secs(1)
    {
        warn_log!(
            "{what}: {} more connections refused in the last second (not logged one by one)",
            gate.suppressed
        );
        *gate = LogGate {
            window: Instant::now(),
            logged: 0,
            suppressed: 0,
        };
    }
}

/// Logs a refusal unless too many were logged this second (then counts it
/// and says how many were left out, once the second is over).
pub(crate) fn log_refusal(what: &str, peer: SocketAddr, reason: &str) {
    let mut g = GATE.lock().unwrap_or_else(|e| e.into_inner());
    let now = Instant::now();
    let gate = g.get_or_insert(LogGate {
        window: now,
        logged: 0,
        suppressed: 0,
    });
    if now.duration_since(gate.window) >= Duration::from_secs(1) {
        if gate.suppressed > 0 {
            warn_log!(
                "{what}: {} more connections refused in the last second (not logged one by one)",
                gate.suppressed
            );
        }
        *gate = LogGate {
            window: now,
            logged: 0,
            suppressed: 0,
        };
    }
    if gate.logged < LOG_PER_SECOND {
        gate.logged += 1;
        drop(g);
        warn_log!("{what}: rejected connection from {peer}: {reason}");
    } else {
        gate.suppressed += 1;
    }
}

/// Refuses a connection: logged (rate-limited) with its source, answered
/// with an error frame written once, without blocking, then closed.
pub(crate) fn reject(mut stream: TcpStream, peer: SocketAddr, what: &str, reason: &str) {
    if reason.starts_with("closed before") {
        // Liveness probes and port scanners: nothing to answer, nothing to report.
        crate::log::info_log!("{what}: connection from {peer} {reason}");
        return;
    }
    log_refusal(what, peer, reason);
    let msg = wire::encode(Kind::Error, reason.as_bytes(), &[0u8; 32], b"");
    let _ = stream.set_nonblocking(true);
    let _ = stream.write(&msg);
}

fn forget_source(per_source: &mut HashMap<IpAddr, usize>, ip: IpAddr) {
    if let Some(n) = per_source.get_mut(&ip) {
        *n -= 1;
        if *n == 0 {
            per_source.remove(&ip);
        }
    }
}

/// How long a new connection is safe from eviction: a real peer answers
/// its challenge well within it (and retries if it was dropped anyway).
pub(crate) const GRACE: Duration = Duration::from_millis(50);

/// The oldest pending handshake (from `ip` when given), if it has had
/// [`GRACE`] to answer.
fn evictable(pending: &[Pending], ip: Option<IpAddr>, now: Instant) -> Option<usize> {
    pending
        .iter()
        .enumerate()
        .filter(|(_, p)| ip.is_none_or(|ip| p.peer.ip() == ip))
        .min_by_key(|(_, p)| p.since)
        .filter(|(_, p)| now.duration_since(p.since) >= GRACE)
        .map(|(i, _)| i)
}

struct Loop<'a> {
    what: &'a str,
    limits: Limits,
    counters: &'a Counters,
    pending: Vec<Pending>,
    per_source: HashMap<IpAddr, usize>,
    evicted_since_log: u64,
}

impl Loop<'_> {
    fn remove(&mut self, i: usize) -> Pending {
        let p = self.pending.swap_remove(i);
        forget_source(&mut self.per_source, p.peer.ip());
        p
    }

    /// Drops pending handshake `i` to make room, unless its frame has
    /// arrived meanwhile (then it is handled as usual).
    fn evict(&mut self, i: usize, handler: &mut dyn Handler) {
        let mut p = self.remove(i);
        match read_some(&mut p, self.limits.max_payload) {
            Some(res) => settle(p, res, self.what, self.counters, handler),
            None => {
                // Closed without an answer: a silent client gets nothing to read.
                self.counters.evicted.fetch_add(1, Relaxed);
                self.evicted_since_log += 1;
            }
        }
    }

    /// Drops the oldest handshakes (past their grace) of every source
    /// over its cap, down to the cap.
    fn trim_sources(&mut self, handler: &mut dyn Handler) {
        let cap = self.limits.max_per_source;
        let over: Vec<IpAddr> = self
            .per_source
            .iter()
            .filter(|(_, n)| **n > cap)
            .map(|(ip, _)| *ip)
            .collect();
        for ip in over {
            while self.per_source.get(&ip).copied().unwrap_or(0) > cap {
                match evictable(&self.pending, Some(ip), Instant::now()) {
                    Some(i) => self.evict(i, handler),
                    None => break,
                }
            }
        }
    }

    /// Whether another connection may be accepted now (making room under
    /// the total cap when an old enough handshake can go).
    fn room(&mut self, handler: &mut dyn Handler) -> bool {
        if self.pending.len() < self.limits.max_pending {
            return true;
        }
        match evictable(&self.pending, None, Instant::now()) {
            Some(i) => {
                self.evict(i, handler);
                true
            }
            None => false,
        }
    }

    fn admit(&mut self, stream: TcpStream, peer: SocketAddr, handler: &mut dyn Handler) {
        self.counters.accepted.fetch_add(1, Relaxed);
        let ip = peer.ip();
        // Over the per-source cap, that source's oldest handshake makes room
        // (if all are within their grace, the cap is exceeded for a moment).
        if self.per_source.get(&ip).copied().unwrap_or(0) >= self.limits.max_per_source
            && let Some(i) = evictable(&self.pending, Some(ip), Instant::now())
        {
            self.evict(i, handler);
        }
        let Ok(challenge) = crate::bootstrap::handshake::challenge() else {
            return;
        };
        let mut s = stream;
        if s.set_nonblocking(true).is_err() {
            return;
        }
        let _ = s.set_nodelay(true);
        let hello = wire::encode(Kind::Challenge, &challenge, &[0u8; 32], b"");
        // A fresh socket's send buffer takes 64 bytes at once.
        if !matches!(s.write(&hello), Ok(n) if n == hello.len()) {
            return;
        }
        *self.per_source.entry(ip).or_default() += 1;
        let now = Instant::now();
        self.pending.push(Pending {
            stream: s,
            fb: FrameBuf::default(),
            challenge,
            since: now,
            deadline: now + self.limits.handshake_timeout,
            peer,
        });
    }
}

pub(crate) fn serve(
    listener: TcpListener,
    what: &str,
    limits: Limits,
    counters: &Counters,
    handler: &mut dyn Handler,
) {
    if let Err(e) = listener.set_nonblocking(true) {
        warn_log!("{what}: cannot make listener non-blocking: {e}");
        return;
    }
    let mut lp = Loop {
        what,
        limits,
        counters,
        pending: Vec::new(),
        per_source: HashMap::new(),
        evicted_since_log: 0,
    };
    let mut last_evict_log: Option<Instant> = None;
    loop {
        if handler.tick() {
            return;
        }
        flush_refusals(what);
        // At the total cap with every handshake still in its grace, new
        // connections wait in the backlog until the oldest can go.
        let full = lp.pending.len() >= limits.max_pending;
        let mut timeout_ms = 100;
        if full && let Some(p) = lp.pending.iter().min_by_key(|p| p.since) {
            let left = GRACE.saturating_sub(p.since.elapsed());
            timeout_ms = (left.as_millis() as i32).clamp(1, 100);
        }
        let mut fds = Vec::with_capacity(lp.pending.len() + 1);
        fds.push(libc::pollfd {
            fd: listener.as_raw_fd(),
            events: if full { 0 } else { libc::POLLIN },
            revents: 0,
        });
        for p in &lp.pending {
            fds.push(libc::pollfd {
                fd: p.stream.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            });
        }
        let rc = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout_ms) };
        if rc < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::Interrupted {
                warn_log!("{what}: poll failed: {e}");
                std::thread::sleep(Duration::from_millis(10));
            }
            continue;
        }
        // Progress pending handshakes first (fds[1..] matches pending as
        // polled); walking backwards keeps swap_remove from moving an
        // unvisited entry.
        let now = Instant::now();
        for i in (0..lp.pending.len()).rev() {
            let readable = fds[i + 1].revents != 0;
            let mut outcome: Option<Result<Frame, String>> = None;
            if readable {
                outcome = read_some(&mut lp.pending[i], limits.max_payload);
            }
            if outcome.is_none() && now >= lp.pending[i].deadline {
                counters.timed_out.fetch_add(1, Relaxed);
                outcome = Some(Err(format!(
                    "handshake timed out ({} ms)",
                    limits.handshake_timeout.as_millis()
                )));
            }
            if let Some(res) = outcome {
                let p = lp.remove(i);
                settle(p, res, what, counters, handler);
            }
        }
        // Sources over their cap lose their oldest handshakes once these
        // have had their grace.
        lp.trim_sources(handler);
        // Accept everything queued, within the caps.
        while lp.room(handler) {
            match listener.accept() {
                Ok((stream, peer)) => lp.admit(stream, peer, handler),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => {
                    // EMFILE and friends: free a descriptor held by the oldest
                    // unauthenticated client, and back off instead of spinning.
                    warn_log!("{what}: accept failed: {e}");
                    if let Some(i) = evictable(&lp.pending, None, Instant::now()) {
                        lp.evict(i, handler);
                    }
                    std::thread::sleep(Duration::from_millis(20));
                    break;
                }
            }
        }
        if lp.evicted_since_log > 0
            && last_evict_log.is_none_or(|t| t.elapsed() >= Duration::from_secs(1))
        {
            warn_log!(
                "{what}: dropped {} silent unauthenticated connection(s) to stay under {} pending ({} per source address); {} pending now from {} address(es)",
                lp.evicted_since_log,
                limits.max_pending,
                limits.max_per_source,
                lp.pending.len(),
                lp.per_source.len()
            );
            lp.evicted_since_log = 0;
            last_evict_log = Some(Instant::now());
        }
    }
}

/// Hands a complete first frame to the handler, or refuses the connection.
fn settle(
    p: Pending,
    res: Result<Frame, String>,
    what: &str,
    counters: &Counters,
    handler: &mut dyn Handler,
) {
    match res {
        Ok(frame) => {
            let _ = p.stream.set_nonblocking(false);
            handler.on_frame(Accepted {
                stream: p.stream,
                challenge: p.challenge,
                frame,
                peer: p.peer,
            })
        }
        Err(reason) => {
            if !reason.starts_with("closed before") {
                counters.refused.fetch_add(1, Relaxed);
            }
            reject(p.stream, p.peer, what, &reason)
        }
    }
}

/// Reads what is available; Some(result) once the first frame is complete or broken.
fn read_some(p: &mut Pending, max_payload: usize) -> Option<Result<Frame, String>> {
    let mut buf = [0u8; 4096];
    loop {
        let need = match p.fb.need(max_payload) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) => return Some(Err(e.to_string())),
        };
        let want = need.min(buf.len());
        match p.stream.read(&mut buf[..want]) {
            Ok(0) => return Some(Err("closed before completing the handshake".into())),
            Ok(n) => p.fb.extend(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return None,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Some(Err(format!("read error: {e}"))),
        }
    }
    match p.fb.take(max_payload) {
        Ok(Some(f)) => Some(Ok(f)),
        Ok(None) => None,
        Err(e) => Some(Err(e.to_string())),
    }
}
