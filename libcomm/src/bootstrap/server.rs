//! A small poll(2)-based accept loop shared by the bootstrap root and the
//! per-process peer endpoint.
//!
//! Why not one blocking handshake at a time: a stray or slow client would stall
//! every rank behind it. Here each connection gets a fresh challenge, has a
//! total deadline and a small size bound for its first frame (read before
//! anything is authenticated, so a few KiB at most), and is handled only once
//! that frame is complete. Unauthenticated connections are capped per source
//! address and in all; at a cap the oldest pending handshake (of that source,
//! else of all) is dropped to make room, so silent clients can delay nobody:
//! a real peer answers its challenge within a round trip. Nothing on this
//! thread blocks on a client (challenges and refusals are written
//! non-blocking, once).

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

/// Drops pending handshake `i` to make room; returns it closed.
fn evict(pending: &mut Vec<Pending>, per_source: &mut HashMap<IpAddr, usize>, i: usize) {
    let p = pending.swap_remove(i);
    forget_source(per_source, p.peer.ip());
    // Closed without an answer: a silent client gets nothing to read.
}

fn forget_source(per_source: &mut HashMap<IpAddr, usize>, ip: IpAddr) {
    if let Some(n) = per_source.get_mut(&ip) {
        *n -= 1;
        if *n == 0 {
            per_source.remove(&ip);
        }
    }
}

/// The oldest pending handshake (from `ip` when given).
fn oldest(pending: &[Pending], ip: Option<IpAddr>) -> Option<usize> {
    pending
        .iter()
        .enumerate()
        .filter(|(_, p)| ip.is_none_or(|ip| p.peer.ip() == ip))
        .min_by_key(|(_, p)| p.deadline)
        .map(|(i, _)| i)
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
    let mut pending: Vec<Pending> = Vec::new();
    let mut per_source: HashMap<IpAddr, usize> = HashMap::new();
    let mut evicted_since_log = 0u64;
    let mut last_evict_log = Instant::now();
    loop {
        if handler.tick() {
            return;
        }
        let mut fds = Vec::with_capacity(pending.len() + 1);
        fds.push(libc::pollfd {
            fd: listener.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        });
        for p in &pending {
            fds.push(libc::pollfd {
                fd: p.stream.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            });
        }
        let rc = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, 100) };
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
        for i in (0..pending.len()).rev() {
            let readable = fds[i + 1].revents != 0;
            let mut outcome: Option<Result<Frame, String>> = None;
            if readable {
                outcome = read_some(&mut pending[i], limits.max_payload);
            }
            if outcome.is_none() && now >= pending[i].deadline {
                counters.timed_out.fetch_add(1, Relaxed);
                outcome = Some(Err(format!(
                    "handshake timed out ({} ms)",
                    limits.handshake_timeout.as_millis()
                )));
            }
            if let Some(res) = outcome {
                let p = pending.swap_remove(i);
                forget_source(&mut per_source, p.peer.ip());
                settle(p, res, what, counters, handler);
            }
        }
        // Accept everything queued; at a cap, the oldest handshake of that
        // source (else of all) makes room.
        loop {
            match listener.accept() {
                Ok((stream, peer)) => {
                    counters.accepted.fetch_add(1, Relaxed);
                    let ip = peer.ip();
                    let victim =
                        if per_source.get(&ip).copied().unwrap_or(0) >= limits.max_per_source {
                            oldest(&pending, Some(ip))
                        } else if pending.len() >= limits.max_pending {
                            oldest(&pending, None)
                        } else {
                            None
                        };
                    if let Some(i) = victim {
                        // Only the silent are dropped: one whose frame has
                        // arrived meanwhile is handled as usual.
                        let mut p = pending.swap_remove(i);
                        forget_source(&mut per_source, p.peer.ip());
                        match read_some(&mut p, limits.max_payload) {
                            Some(res) => settle(p, res, what, counters, handler),
                            None => {
                                counters.evicted.fetch_add(1, Relaxed);
                                evicted_since_log += 1;
                            }
                        }
                    }
                    let Ok(challenge) = crate::handshake::challenge() else {
                        continue;
                    };
                    let mut s = stream;
                    if s.set_nonblocking(true).is_err() {
                        continue;
                    }
                    let _ = s.set_nodelay(true);
                    let hello = wire::encode(Kind::Challenge, &challenge, &[0u8; 32], b"");
                    // A fresh socket's send buffer takes 64 bytes at once.
                    if !matches!(s.write(&hello), Ok(n) if n == hello.len()) {
                        continue;
                    }
                    *per_source.entry(ip).or_default() += 1;
                    pending.push(Pending {
                        stream: s,
                        fb: FrameBuf::default(),
                        challenge,
                        deadline: Instant::now() + limits.handshake_timeout,
                        peer,
                    });
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => {
                    // EMFILE and friends: free a descriptor held by the oldest
                    // unauthenticated client, and back off instead of spinning.
                    warn_log!("{what}: accept failed: {e}");
                    if let Some(i) = oldest(&pending, None) {
                        evict(&mut pending, &mut per_source, i);
                        counters.evicted.fetch_add(1, Relaxed);
                        evicted_since_log += 1;
                    }
                    std::thread::sleep(Duration::from_millis(20));
                    break;
                }
            }
        }
        if evicted_since_log > 0 && last_evict_log.elapsed() >= Duration::from_secs(1) {
            warn_log!(
                "{what}: dropped {evicted_since_log} silent unauthenticated connection(s) to stay under {} pending ({} per source address); {} pending now from {} address(es)",
                limits.max_pending,
                limits.max_per_source,
                pending.len(),
                per_source.len()
            );
            evicted_since_log = 0;
            last_evict_log = Instant::now();
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
