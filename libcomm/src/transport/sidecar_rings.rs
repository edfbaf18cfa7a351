//! The third transport: peers on other hosts through the pod's sidecar
//! (contract: `crate::transport::sidecar_link`). A channel is a pair of SPSC rings in a memfd
//! segment this rank creates and the sidecar maps: the same rings and
//! message stepping as shared memory between local ranks, with the sidecar
//! as the other end. The sidecar moves the bytes between the rings and its
//! one connection per peer host.

use super::ShmChan;
use super::shm::{Mapping, RingEnd};
use crate::bootstrap::ctx::Ctx;
use crate::error::{Error, Result};
use crate::transport::sidecar_link::{
    self as link, KIND_ERR, KIND_OK, KIND_OPEN, OpenMsg, ProxyPeer,
};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

pub(crate) static CHANNELS_OPENED: AtomicU64 = AtomicU64::new(0);

/// One communicator-rank's link to the sidecar proxy.
pub(crate) struct ProxyLink {
    // Dropping the socket tells the sidecar we are gone.
    sock: UnixStream,
    rings: Arc<Mapping>,
    doorbell: Arc<Mapping>,
    path: PathBuf,
}

/// Ring capacity per direction and remote peer: `WEFT_PROXY_RING_BYTES`, else
/// 8 MiB in all per communicator-rank, 64 KiB..2 MiB per ring.
fn ring_capacity(nremote: usize) -> usize {
    if let Some(c) = weft_contract::params::WEFT_PROXY_RING_BYTES
        .get()
        .filter(|c| c.is_power_of_two())
    {
        return c.clamp(link::MIN_RING, link::MAX_RING);
    }
    let per = (8usize << 20) / (2 * nremote.max(1));
    let pow2 = if per.is_power_of_two() {
        per
    } else {
        per.next_power_of_two() / 2
    };
    pow2.clamp(64 << 10, 2 << 20)
}

impl ProxyLink {
    /// Creates the rings for `remotes` (in this order) and hands them to the
    /// sidecar at `path` together with our control block `own`.
    pub fn open(
        path: &Path,
        ctx: &Ctx,
        own: &Mapping,
        remotes: &[usize],
        deadline: Instant,
    ) -> Result<ProxyLink> {
        let cap = ring_capacity(remotes.len());
        let what = format!("the proxy rings of comm {}", ctx.label);
        let (rings, rings_fd) = Mapping::create_memfd(&what, 2 * remotes.len(), cap)?;
        let own_fd = own
            .fd()
            .ok_or_else(|| Error::Internal("own segment has no descriptor".into()))?;
        let me = &ctx.peers[ctx.rank];
        let msg = OpenMsg {
            job: ctx.job.clone(),
            comm: ctx.id,
            rank: ctx.rank as u32,
            nranks: ctx.nranks as u32,
            pid: std::process::id(),
            ring_cap: cap as u32,
            addr: me.addr,
            peers: remotes
                .iter()
                .map(|&r| ProxyPeer {
                    rank: r as u32,
                    addr: ctx.peers[r].addr,
                    host: ctx.peers[r].hostname.clone(),
                })
                .collect(),
        };
        let lost = |e: String| Error::Remote {
            comm: ctx.label.clone(),
            rank: ctx.rank,
            detail: format!(
                "the sidecar proxy at {} (host {}): {e}",
                path.display(),
                me.hostname
            ),
        };
        let sock = UnixStream::connect(path).map_err(|e| lost(format!("connect: {e}")))?;
        let fd = sock.as_raw_fd();
        link::send_msg(
            fd,
            KIND_OPEN,
            &msg.encode(),
            &[rings_fd.as_raw_fd(), own_fd.as_raw_fd()],
        )
        .map_err(|e| lost(format!("sending the open: {e}")))?;
        let wait = deadline
            .saturating_duration_since(Instant::now())
            .max(std::time::Duration::from_millis(100));
        link::set_read_timeout(fd, wait);
        let (kind, payload, fds) = link::recv_msg(fd).map_err(|e| lost(e.to_string()))?;
        link::set_read_timeout(fd, std::time::Duration::ZERO);
        match kind {
            KIND_OK if fds.len() == 1 => {}
            KIND_ERR => {
                return Err(lost(format!(
                    "refused: {}",
                    String::from_utf8_lossy(&payload[..payload.len().min(1024)])
                )));
            }
            _ => return Err(lost("unexpected answer".into())),
        }
        let doorbell = Mapping::control_from_fd(&fds[0], "the sidecar's doorbell")?;
        CHANNELS_OPENED.fetch_add(remotes.len() as u64, Ordering::Relaxed);
        Ok(ProxyLink {
            sock,
            rings: Arc::new(rings),
            doorbell: Arc::new(doorbell),
            path: path.to_path_buf(),
        })
    }

    /// The channel to remote peer number `i` (in the order given to `open`).
    pub fn chan(&self, i: usize) -> ShmChan {
        ShmChan {
            send: RingEnd::new(&self.rings, 2 * i, &self.doorbell, true),
            recv: RingEnd::new(&self.rings, 2 * i + 1, &self.doorbell, false),
        }
    }

    /// `Err` once the sidecar is gone (its end of the link closed).
    pub fn check(&self) -> std::result::Result<(), String> {
        let mut b = [0u8; 1];
        let n = unsafe {
            libc::recv(
                self.sock.as_raw_fd(),
                b.as_mut_ptr().cast(),
                1,
                libc::MSG_PEEK | libc::MSG_DONTWAIT,
            )
        };
        let gone = n == 0
            || (n < 0 && std::io::Error::last_os_error().kind() != std::io::ErrorKind::WouldBlock);
        if gone {
            Err(format!(
                "lost the sidecar proxy at {}: its connection closed",
                self.path.display()
            ))
        } else {
            Ok(())
        }
    }
}
