//! The Unix socket: created owner-only (0600), and every connection must
//! open with the HTTP/2 preface before it reaches gRPC, so garbage is refused
//! with a log line and a counter instead of vanishing inside the HTTP/2 stack.
//! Connections that open with the preface of another protocol sharing the
//! port are handed to the [`Route`] given for it.

use super::Engine;
use crate::seams::{PREFACE_LEN, Route};
use std::io;
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream, UnixListener, UnixStream};
use tokio::sync::mpsc;

const PREFACE: &[u8; PREFACE_LEN] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// A client that connects and sends nothing is dropped after this.
const PREFACE_TIMEOUT: Duration = Duration::from_secs(5);

/// A socket of either listener.
pub enum Io {
    Unix(UnixStream),
    Tcp(TcpStream),
}

/// A connection whose first bytes (the preface we checked) are replayed to the server.
pub struct Conn {
    pre: &'static [u8],
    io: Io,
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
    type ConnectInfo = ();
    fn connect_info(&self) -> Self::ConnectInfo {}
}

impl AsyncRead for Conn {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if !self.pre.is_empty() {
            let n = self.pre.len().min(buf.remaining());
            buf.put_slice(&self.pre[..n]);
            self.pre = &self.pre[n..];
            return Poll::Ready(Ok(()));
        }
        both!(self, s => Pin::new(s).poll_read(cx, buf))
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
    async fn accept(&self) -> io::Result<(Io, String)> {
        match self {
            Listener::Unix(l) => l
                .accept()
                .await
                .map(|(s, _)| (Io::Unix(s), "socket".into())),
            Listener::Tcp(l) => l
                .accept()
                .await
                .map(|(s, a)| (Io::Tcp(s), format!("peer port (from {a})"))),
        }
    }
}

/// Accepts connections, checks each one's preface, hands gRPC ones to `tx`
/// and those of another protocol to its route's handler.
pub async fn accept_loop(
    l: Listener,
    engine: Arc<Engine>,
    routes: Arc<[Route]>,
    tx: mpsc::Sender<io::Result<Conn>>,
) {
    let port = match &l {
        Listener::Unix(_) => "socket",
        Listener::Tcp(_) => "peer",
    };
    loop {
        let (mut s, from) = match l.accept().await {
            Ok(x) => x,
            Err(e) => {
                super::log(&format!("accept on the {port} failed: {e}"));
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let (tx, engine, routes) = (tx.clone(), engine.clone(), routes.clone());
        tokio::spawn(async move {
            let mut buf = [0u8; PREFACE_LEN];
            let r = match &mut s {
                Io::Unix(u) => tokio::time::timeout(PREFACE_TIMEOUT, u.read_exact(&mut buf)).await,
                Io::Tcp(t) => tokio::time::timeout(PREFACE_TIMEOUT, t.read_exact(&mut buf)).await,
            };
            let route = routes.iter().find(|r| r.preface == buf);
            let why = match (r, route) {
                (Ok(Ok(_)), _) if &buf == PREFACE => {
                    let _ = tx
                        .send(Ok(Conn {
                            pre: PREFACE,
                            io: s,
                        }))
                        .await;
                    return;
                }
                (Ok(Ok(_)), Some(r)) => {
                    // Another protocol sharing the port.
                    match (s, &r.handler) {
                        (Io::Tcp(t), Some(h)) => {
                            let from = t.peer_addr();
                            match (t.into_std(), from) {
                                (Ok(t), Ok(from)) => {
                                    h.handle(t, from);
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
                (Ok(Ok(_)), None) => ("garbage", "not gRPC (bad HTTP/2 preface)".into()),
                (Ok(Err(_)), _) => ("short", "closed before the HTTP/2 preface".into()),
                (Err(_), _) => ("timeout", "no HTTP/2 preface within 5 s".into()),
            };
            engine.metrics.reject(port, why.0);
            super::log(&format!("rejected a connection on the {from}: {}", why.1));
        });
    }
}
