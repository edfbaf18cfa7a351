//! The Unix socket: created owner-only (0600), and every connection must
//! open with the HTTP/2 preface before it reaches gRPC, so garbage is refused
//! with a log line and a counter instead of vanishing inside the HTTP/2 stack.
//! Connections that open with the preface of another protocol sharing the
//! port are handed to the [`Route`] given for it.

use super::Engine;
use super::authority::Rewriter;
use super::limits::{Gate, Slot, Ticket};
use crate::seams::{Admission, Handover, PREFACE_LEN, Route};
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream, UnixListener, UnixStream};
use tokio::sync::mpsc;

const PREFACE: &[u8; PREFACE_LEN] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// An HTTP/2 frame header: the client's SETTINGS must follow the preface.
const FRAME_HEADER: usize = 9;
const SETTINGS: u8 = 4;
/// The bytes checked before a connection reaches the gRPC server.
const OPENING: usize = PREFACE_LEN + FRAME_HEADER;

/// A socket of either listener.
pub enum Io {
    Unix(UnixStream),
    Tcp(TcpStream),
}

/// What the gRPC handlers learn about their connection (in each request's
/// extensions): its gate slot (an authenticated attach or peer holds it,
/// so it is never evicted) and the peer's address on TCP.
#[derive(Clone)]
pub struct ConnInfo {
    pub slot: Arc<Slot>,
    pub from: Option<SocketAddr>,
    /// A Unix connection's process as this sidecar's pid namespace sees it
    /// (SO_PEERCRED; none when it is in another namespace). Only this pid
    /// may be signalled: the one a process claims in its Hello is its own view.
    pub peer_pid: Option<u32>,
    /// Descriptors that came with the connection's first bytes (a rank's
    /// telemetry segment and lifeline), for its attach to take.
    pub passed: Arc<std::sync::Mutex<Vec<OwnedFd>>>,
}

impl ConnInfo {
    /// The descriptors passed with the opening (the first caller gets them).
    pub fn take_passed(&self) -> Vec<OwnedFd> {
        std::mem::take(&mut *self.passed.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

/// Descriptors kept from a connection's opening; more are closed.
const MAX_PASSED: usize = 2;

/// A connection whose first bytes (the preface and frame header we
/// checked) are replayed to the server.
pub struct Conn {
    pre: [u8; OPENING],
    pos: usize,
    io: Io,
    info: ConnInfo,
    _ticket: Ticket,
    /// On the Unix socket: the client's `:authority` made acceptable.
    fix: Option<Box<Rewriter>>,
    /// `fix` has passed on the end of the client's stream.
    eof: bool,
}

/// Reads the replayed opening, then the socket.
fn read_raw(
    pre: &[u8; OPENING],
    pos: &mut usize,
    io: &mut Io,
    cx: &mut Context<'_>,
    buf: &mut ReadBuf<'_>,
) -> Poll<io::Result<()>> {
    if *pos < OPENING {
        let n = (OPENING - *pos).min(buf.remaining());
        buf.put_slice(&pre[*pos..*pos + n]);
        *pos += n;
        return Poll::Ready(Ok(()));
    }
    match io {
        Io::Unix(s) => Pin::new(s).poll_read(cx, buf),
        Io::Tcp(s) => Pin::new(s).poll_read(cx, buf),
    }
}

macro_rules! both {
    ($self:ident, $s:ident => $e:expr) => {
        match &mut $self.io {
            Io::Unix($s) => $e,
            Io::Tcp($s) => $e,
        }
    };
}

impl tonic::transport::server::Connected for Conn {
    type ConnectInfo = ConnInfo;
    fn connect_info(&self) -> Self::ConnectInfo {
        self.info.clone()
    }
}

impl AsyncRead for Conn {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        let Some(fix) = this.fix.as_mut() else {
            return read_raw(&this.pre, &mut this.pos, &mut this.io, cx, buf);
        };
        loop {
            if !fix.out.is_empty() {
                let n = fix.out.len().min(buf.remaining());
                buf.put_slice(&fix.out[..n]);
                fix.out.drain(..n);
                return Poll::Ready(Ok(()));
            }
            if this.eof {
                return Poll::Ready(Ok(()));
            }
            let mut tmp = [0u8; 16 << 10];
            let mut rb = ReadBuf::new(&mut tmp);
            std::task::ready!(read_raw(
                &this.pre,
                &mut this.pos,
                &mut this.io,
                cx,
                &mut rb
            ))?;
            if rb.filled().is_empty() {
                fix.finish();
                this.eof = true;
            } else {
                fix.feed(rb.filled());
            }
        }
    }
}

impl AsyncWrite for Conn {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        both!(self, s => Pin::new(s).poll_write(cx, buf))
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        both!(self, s => Pin::new(s).poll_flush(cx))
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        both!(self, s => Pin::new(s).poll_shutdown(cx))
    }
}

/// Binds `path` with mode 0600 (umask while binding, so there is no window
/// in which the socket is more open).
pub fn bind(path: &Path) -> io::Result<UnixListener> {
    let l = libcomm::sockets::bind_unix_owner_only(path)?;
    l.set_nonblocking(true)?;
    UnixListener::from_std(l)
}

/// Either listener.
pub enum Listener {
    Unix(UnixListener),
    Tcp(TcpListener),
}

impl Listener {
    async fn accept(&self) -> io::Result<(Io, Option<SocketAddr>)> {
        match self {
            Listener::Unix(l) => l.accept().await.map(|(s, _)| (Io::Unix(s), None)),
            Listener::Tcp(l) => l.accept().await.map(|(s, a)| (Io::Tcp(s), Some(a))),
        }
    }
}

/// The caps and the deadline of one listener.
#[derive(Clone)]
pub struct PortLimits {
    /// Every open connection of the port.
    pub gate: Arc<Gate>,
    /// Connections handed to another protocol (the proxy) while they
    /// authenticate: each holds a thread until it has.
    pub handshakes: Arc<Gate>,
    /// From accept to the end of the opening (HTTP/2 preface and SETTINGS,
    /// or the whole proxy handshake).
    pub handshake: Duration,
}

/// What a route's handler holds while it authenticates: the connection's
/// places in the listener's gates.
struct Held(Ticket, Ticket);

impl Admission for Held {
    fn evicted(&self) -> bool {
        self.0.slot.evicted() || self.1.slot.evicted()
    }
}

/// Reads `buf` full by `deadline`: `Ok(false)` when the deadline passed.
/// On a Unix socket, descriptors that come with the bytes (SCM_RIGHTS)
/// are kept in `fds` (at most [`MAX_PASSED`]; others are closed).
async fn read_by(
    s: &mut Io,
    buf: &mut [u8],
    deadline: Instant,
    fds: &mut Vec<OwnedFd>,
) -> io::Result<bool> {
    let r = match s {
        Io::Unix(u) => tokio::time::timeout_at(deadline.into(), read_unix(u, buf, fds)).await,
        Io::Tcp(t) => tokio::time::timeout_at(deadline.into(), t.read_exact(buf))
            .await
            .map(|r| r.map(|_| ())),
    };
    match r {
        Ok(Ok(())) => Ok(true),
        Ok(Err(e)) => Err(e),
        Err(_) => Ok(false),
    }
}

/// Reads `buf` full with recvmsg(2), collecting passed descriptors.
async fn read_unix(u: &UnixStream, buf: &mut [u8], fds: &mut Vec<OwnedFd>) -> io::Result<()> {
    let mut got = 0;
    while got < buf.len() {
        u.readable().await?;
        let sock = u.as_raw_fd();
        match u.try_io(tokio::io::Interest::READABLE, || {
            libcomm::fdpass::recv(sock, &mut buf[got..])
        }) {
            Ok(r) => {
                if r.len == 0 {
                    return Err(io::ErrorKind::UnexpectedEof.into());
                }
                got += r.len;
                let room = MAX_PASSED.saturating_sub(fds.len());
                fds.extend(r.fds.into_iter().take(room));
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Accepts connections (within the port's caps), checks each one's opening
/// by the handshake deadline, hands gRPC ones to `tx` and those of another
/// protocol to its route's handler.
pub async fn accept_loop(
    l: Listener,
    engine: Arc<Engine>,
    routes: Arc<[Route]>,
    tx: mpsc::Sender<io::Result<Conn>>,
    lim: PortLimits,
) {
    let port = match &l {
        Listener::Unix(_) => "socket",
        Listener::Tcp(_) => "peer",
    };
    let secs = lim.handshake.as_secs_f64();
    loop {
        let (mut s, from) = match l.accept().await {
            Ok(x) => x,
            Err(e) => {
                // Out of descriptors, most likely: say so (rate-limited), back off.
                engine.metrics.reject(port, "accept");
                lim.gate.log.log(port, "accept", None, || {
                    format!("accept on the {port} failed: {e}")
                });
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let deadline = Instant::now() + lim.handshake;
        let source: Option<IpAddr> = from.map(|a| a.ip());
        let fd = match &s {
            Io::Unix(u) => u.as_fd(),
            Io::Tcp(t) => t.as_fd(),
        };
        let Some(ticket) = lim.gate.admit(fd, source) else {
            continue; // refused (counted, logged): dropping it closes it
        };
        let (tx, routes, lim) = (tx.clone(), routes.clone(), lim.clone());
        tokio::spawn(async move {
            let mut buf = [0u8; OPENING];
            let mut passed = Vec::new();
            let r = read_by(&mut s, &mut buf[..PREFACE_LEN], deadline, &mut passed).await;
            let route = routes.iter().find(|r| r.preface[..] == buf[..PREFACE_LEN]);
            let why: (&'static str, String) = match (r, route) {
                (Ok(true), _) if buf[..PREFACE_LEN] == PREFACE[..] => {
                    match read_by(&mut s, &mut buf[PREFACE_LEN..], deadline, &mut passed).await {
                        Ok(true) if is_settings(&buf[PREFACE_LEN..]) => {
                            let peer_pid = match &s {
                                Io::Unix(u) => u
                                    .peer_cred()
                                    .ok()
                                    .and_then(|c| c.pid())
                                    .and_then(|p| u32::try_from(p).ok())
                                    .filter(|&p| p > 0),
                                Io::Tcp(_) => None,
                            };
                            let info = ConnInfo {
                                slot: ticket.slot.clone(),
                                from,
                                peer_pid,
                                passed: Arc::new(std::sync::Mutex::new(passed)),
                            };
                            let fix = matches!(s, Io::Unix(_)).then(Box::default);
                            let _ = tx
                                .send(Ok(Conn {
                                    pre: buf,
                                    pos: 0,
                                    io: s,
                                    info,
                                    _ticket: ticket,
                                    fix,
                                    eof: false,
                                }))
                                .await;
                            return;
                        }
                        Ok(true) => (
                            "garbage",
                            "not gRPC (no SETTINGS frame after the HTTP/2 preface)".into(),
                        ),
                        Ok(false) => (
                            "timeout",
                            format!("sent the HTTP/2 preface but no SETTINGS within {secs} s"),
                        ),
                        Err(_) => ("short", "closed after the HTTP/2 preface".into()),
                    }
                }
                (Ok(true), Some(r)) => {
                    // Another protocol sharing the port.
                    match (s, &r.handler) {
                        (Io::Tcp(t), Some(h)) => {
                            let fd = t.as_fd();
                            let Some(hs) = lim.handshakes.admit(fd, source) else {
                                return; // refused (counted, logged)
                            };
                            match (t.into_std(), from) {
                                (Ok(t), Some(from)) => {
                                    h.handle(Handover {
                                        stream: t,
                                        from,
                                        deadline,
                                        admission: Box::new(Held(ticket, hs)),
                                    });
                                    return;
                                }
                                _ => ("short", format!("lost before the {} handshake", r.name)),
                            }
                        }
                        _ => (
                            "garbage",
                            format!("a {0} connection, but this sidecar runs no {0}", r.name),
                        ),
                    }
                }
                (Ok(true), None) => ("garbage", "not gRPC (bad HTTP/2 preface)".into()),
                (Err(_), _) => ("short", "closed before the HTTP/2 preface".into()),
                (Ok(false), _) => ("timeout", format!("sent no HTTP/2 preface within {secs} s")),
            };
            if ticket.slot.evicted() {
                return; // counted and logged as such
            }
            lim.gate.refused(source, why.0, &why.1);
        });
    }
}

/// Whether `h` is the header of a client's first SETTINGS frame (not an
/// acknowledgement, stream 0, whole settings).
fn is_settings(h: &[u8]) -> bool {
    let len = u32::from_be_bytes([0, h[0], h[1], h[2]]);
    let stream = u32::from_be_bytes([h[5], h[6], h[7], h[8]]) & 0x7fff_ffff;
    h[3] == SETTINGS && h[4] & 1 == 0 && stream == 0 && len.is_multiple_of(6) && len <= 16 * 1024
}
