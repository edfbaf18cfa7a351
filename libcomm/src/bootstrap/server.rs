//! A small poll(2)-based accept loop shared by the bootstrap root and the
//! per-process peer endpoint.
//!
//! Why not one blocking handshake at a time: a stray or slow client would stall
//! every rank behind it. Here each connection gets a fresh challenge, has a
//! deadline and a size bound for its first frame, and is handled only once that
//! frame is complete. Accepting stops while too many handshakes are pending,
//! which pushes back into the (job-sized) listen backlog instead of failing.

use super::wire::{self, Frame, FrameBuf, Kind};
use crate::log::warn_log;
use std::io::Read;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

pub(crate) const MAX_PENDING: usize = 1024;

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

pub(crate) fn reject(mut stream: TcpStream, peer: SocketAddr, what: &str, reason: &str) {
    if reason.starts_with("closed before") {
        // Liveness probes and port scanners: nothing to answer, nothing to report.
        crate::log::info_log!("{what}: connection from {peer} {reason}");
        return;
    }
    warn_log!("{what}: rejected connection from {peer}: {reason}");
    let msg = wire::encode(Kind::Error, reason.as_bytes(), &[0u8; 32], b"");
    let _ = stream.set_nonblocking(false);
    let _ = wire::write_all(
        &mut stream,
        &msg,
        Instant::now() + Duration::from_millis(200),
    );
}

pub(crate) fn serve(
    listener: TcpListener,
    what: &str,
    max_payload: usize,
    handshake_timeout: Duration,
    handler: &mut dyn Handler,
) {
    if let Err(e) = listener.set_nonblocking(true) {
        warn_log!("{what}: cannot make listener non-blocking: {e}");
        return;
    }
    let mut pending: Vec<Pending> = Vec::new();
    loop {
        if handler.tick() {
            return;
        }
        let mut fds = Vec::with_capacity(pending.len() + 1);
        let accepting = pending.len() < MAX_PENDING;
        fds.push(libc::pollfd {
            fd: listener.as_raw_fd(),
            events: if accepting { libc::POLLIN } else { 0 },
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
        // Accept everything queued (bounded by MAX_PENDING).
        while accepting && pending.len() < MAX_PENDING {
            match listener.accept() {
                Ok((stream, peer)) => {
                    let challenge = match crate::handshake::challenge() {
                        Ok(c) => c,
                        Err(_) => continue,
                    };
                    let _ = stream.set_nodelay(true);
                    let mut s = stream;
                    let hello = wire::encode(Kind::Challenge, &challenge, &[0u8; 32], b"");
                    if wire::write_all(&mut s, &hello, Instant::now() + Duration::from_millis(500))
                        .is_err()
                    {
                        continue;
                    }
                    if s.set_nonblocking(true).is_err() {
                        continue;
                    }
                    pending.push(Pending {
                        stream: s,
                        fb: FrameBuf::default(),
                        challenge,
                        deadline: Instant::now() + handshake_timeout,
                        peer,
                    });
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) => {
                    // EMFILE and friends: back off instead of spinning.
                    warn_log!("{what}: accept failed: {e}");
                    std::thread::sleep(Duration::from_millis(20));
                    break;
                }
            }
        }
        // Progress pending handshakes. fds[1..=polled] belongs to pending[..polled]
        // (those accepted just now come after); walking backwards keeps
        // swap_remove from moving an unvisited entry.
        let polled = fds.len() - 1;
        let now = Instant::now();
        for i in (0..pending.len()).rev() {
            let readable = i < polled && fds[i + 1].revents != 0;
            let mut outcome: Option<Result<Frame, String>> = None;
            if readable {
                outcome = read_some(&mut pending[i], max_payload);
            }
            if outcome.is_none() && now >= pending[i].deadline {
                outcome = Some(Err("handshake timed out".into()));
            }
            if let Some(res) = outcome {
                let p = pending.swap_remove(i);
                let _ = p.stream.set_nonblocking(false);
                match res {
                    Ok(frame) => handler.on_frame(Accepted {
                        stream: p.stream,
                        challenge: p.challenge,
                        frame,
                        peer: p.peer,
                    }),
                    Err(reason) => reject(p.stream, p.peer, what, &reason),
                }
            }
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
