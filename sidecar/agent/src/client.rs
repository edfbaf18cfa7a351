//! A gRPC channel to a sidecar over its Unix socket; for an attach, one
//! that passes descriptors (the telemetry segment and the lifeline) with
//! its first bytes (SCM_RIGHTS), so they arrive bound to the connection
//! whose `Hello` the job secret authenticates: no second socket, no second
//! handshake, and every reconnection passes them again.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};
use tokio::io::{AsyncRead, AsyncWrite, Interest, ReadBuf};
use tokio::net::UnixStream;
use tonic::transport::{Channel, Endpoint, Uri};

/// Descriptors to pass on each new connection (fresh duplicates, closed
/// once sent).
pub type PassFds = Arc<dyn Fn() -> Vec<OwnedFd> + Send + Sync>;

pub async fn connect(path: PathBuf) -> Result<Channel, tonic::transport::Error> {
    connect_passing(path, None).await
}

/// A channel whose connections send `fds` with their first bytes.
pub async fn connect_passing(
    path: PathBuf,
    fds: Option<PassFds>,
) -> Result<Channel, tonic::transport::Error> {
    // The URI is a placeholder: the connector below ignores it.
    Endpoint::from_static("http://weft.sidecar")
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let (p, fds) = (path.clone(), fds.clone());
            async move {
                let s = UnixStream::connect(p).await?;
                let pending = fds.map(|f| f()).unwrap_or_default();
                Ok::<_, io::Error>(hyper_util::rt::TokioIo::new(Passing { s, pending }))
            }
        }))
        .await
}

pub async fn sidecar(
    path: PathBuf,
) -> Result<crate::rpc::sidecar_client::SidecarClient<Channel>, tonic::transport::Error> {
    Ok(client(connect(path).await?))
}

/// The client of `channel`, with the decoding limit replies need.
pub fn client(channel: Channel) -> crate::rpc::sidecar_client::SidecarClient<Channel> {
    crate::rpc::sidecar_client::SidecarClient::new(channel).max_decoding_message_size(64 << 20)
}

/// A Unix stream whose first write carries `pending` (SCM_RIGHTS).
struct Passing {
    s: UnixStream,
    pending: Vec<OwnedFd>,
}

impl AsyncRead for Passing {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.s).poll_read(cx, buf)
    }
}

impl AsyncWrite for Passing {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.pending.is_empty() || buf.is_empty() {
            return Pin::new(&mut this.s).poll_write(cx, buf);
        }
        let fds: Vec<RawFd> = this.pending.iter().map(AsRawFd::as_raw_fd).collect();
        loop {
            ready!(this.s.poll_write_ready(cx))?;
            let sock = this.s.as_raw_fd();
            match this.s.try_io(Interest::WRITABLE, || {
                libcomm::fdpass::send(sock, &[buf], &fds)
            }) {
                Ok(n) => {
                    this.pending.clear(); // sent with the first byte: ours to close
                    return Poll::Ready(Ok(n));
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.s).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.s).poll_shutdown(cx)
    }
}
