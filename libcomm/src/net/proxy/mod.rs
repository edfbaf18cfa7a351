//! The byte mover through the pod's sidecar proxy: the cross-host engine's
//! data connections ride the proxy's rings (`transport::sidecar_link`), so
//! in a pod the sidecar moves the engine's bytes between hosts, over its
//! one connection per host pair, as it moves the flat path's.
//!
//! - **Rings.** `ProxyNet::open` opens one more set of proxied channels
//!   for the communicator (its id with [`ENGINE_ID_BIT`] flipped, so the
//!   sidecar keeps them apart from the flat path's): a send and a receive
//!   ring per rank on another host, in a memfd the sidecar maps, and a
//!   control block of its own that the sidecar raises a failure in.
//! - **Messages.** Each message on a ring is an 8-byte header (payload
//!   length, the sender's tag) and the payload padded to 8 bytes. The
//!   sender's thread copies a posted send into the ring as space frees up
//!   (in `isend` and `test`); the receiver's thread copies it out into the
//!   posted receive, checking tag and size first. The sidecar moves ring
//!   bytes to its host connection and back (`sidecar/src/proxy/tx.rs`).
//!   Every byte thus passes through memory once more on each host than
//!   over [`super::tcp`] (user buffer -> ring -> socket and back), the
//!   price of one connection per host pair and of the sidecar seeing and
//!   policing all traffic (docs/PERFORMANCE.md, "The cross-host engine
//!   through the sidecar proxy").
//! - **Control.** Connections of any stream but the data stream (failure
//!   notices, "waits for" notices: a few bytes, after a failure) go over
//!   the direct TCP byte mover given to `ProxyNet::open`; they reach the
//!   ranks of this host too, which no proxied channel does.
//! - **Failure.** A peer that dies, or whose host is lost, is raised in
//!   this link's control block by the sidecar (with a reason naming it); a
//!   sidecar that dies closes the link's socket. Either fails every later
//!   `isend`, `irecv` and `test` with [`NetError::Peer`]. Dropping the last
//!   comm marks the link destroyed before closing it, so the sidecar
//!   forgets it quietly instead of reporting a crashed rank.
//!
//! Host memory only: registering device memory returns
//! [`NetError::Unsupported`], as on TCP.

mod comm;
#[cfg(test)]
mod tests;

use super::{
    Accepted, ConnectHandle, HANDLE_MAX, ListenComm, Net, NetError, Peer, Properties, PtrSupport,
    SendComm,
};
use crate::bootstrap::ctx::Ctx;
use crate::error::{Error, Result};
use crate::transport::shm::{Mapping, RingEnd, ST_DESTROYED};
use crate::transport::sidecar_rings::ProxyLink;
use comm::{ProxyRecv, ProxySend};
use std::collections::{BTreeMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// The bit of the communicator's id flipped for the engine's channels
/// (ids are random: another communicator with exactly that id is as likely
/// as any collision of 128 random bits).
pub const ENGINE_ID_BIT: u8 = 0x80;
/// A connect handle's first bytes: this magic, then the rank's number (4,
/// little-endian), then the control byte mover's handle.
const HANDLE_MAGIC: &[u8; 4] = b"WFPX";
/// What a peer whose handle is not ours most likely did.
const MIXED: &str = "is WEFT_CROSSHOST_NET the same on every rank?";
/// Bytes before every message on a ring: payload length, tag.
const HDR: usize = 8;
/// Requests one comm holds at once (NCCL's `NCCL_NET_MAX_REQUESTS`).
const MAX_REQUESTS: usize = 32;
/// How often a waiting comm looks whether the sidecar is still there (a
/// system call), in nanoseconds.
const SIDECAR_CHECK_NS: u64 = 10_000_000;

/// The engine's proxied channels of one communicator-rank, shared by its
/// comms; dropped with the last of them.
struct Attachment {
    own: Mapping,
    /// `None` only in the unit tests (a ring with no sidecar behind it).
    link: Option<ProxyLink>,
    path: PathBuf,
    rank: usize,
    /// When [`Attachment::health`] last asked the socket (ns since `t0`).
    last_check: AtomicU64,
    t0: Instant,
}

// SAFETY: the mappings are shared memory used through atomics and the ring
// protocol (one writer per ring end); the socket is only peeked at.
unsafe impl Send for Attachment {}
unsafe impl Sync for Attachment {}

impl Attachment {
    /// `Err` once the sidecar raised a failure in our control block or went
    /// away (its socket is looked at most every [`SIDECAR_CHECK_NS`]).
    fn health(&self) -> std::result::Result<(), NetError> {
        let c = self.own.control();
        if let Some((origin, _)) = c.failure() {
            // The sidecar raises in our name, with a reason naming the
            // rank or host it lost; a rank's own failure (another rank
            // raising) has no reason here.
            let why = c.reason();
            return Err(NetError::Peer {
                peer: if origin == self.rank {
                    "the sidecar proxy".into()
                } else {
                    format!("rank {origin}")
                },
                what: if why.is_empty() {
                    "failed (the sidecar proxy reported it)".into()
                } else {
                    why
                },
            });
        }
        let Some(link) = &self.link else {
            return Ok(());
        };
        let now = self.t0.elapsed().as_nanos() as u64;
        let last = self.last_check.load(Ordering::Relaxed);
        if now.saturating_sub(last) >= SIDECAR_CHECK_NS {
            self.last_check.store(now, Ordering::Relaxed);
            // `what` names the socket ("lost the sidecar proxy at ...").
            link.check().map_err(|what| NetError::Peer {
                peer: "this host's sidecar".into(),
                what,
            })?;
        }
        Ok(())
    }
}

impl Drop for Attachment {
    fn drop(&mut self) {
        // Ended on purpose (the socket closes right after, with `link`):
        // the sidecar forgets the channels instead of failing the peers.
        if self.own.control().failure().is_none() {
            self.own
                .control()
                .state
                .store(ST_DESTROYED, Ordering::Release);
        }
    }
}

fn ring_err(peer: &str) -> impl Fn(Error) -> NetError + '_ {
    move |e| NetError::Peer {
        peer: peer.to_string(),
        what: e.to_string(),
    }
}

/// The engine's byte mover through the sidecar proxy (see the module docs).
pub struct ProxyNet {
    /// Connections of streams other than `data_stream`.
    control: Arc<dyn Net>,
    data_stream: u32,
    me: u32,
    att: Arc<Attachment>,
    /// Each remote rank's send ring, taken by the first data connect to it.
    sends: Mutex<BTreeMap<u32, RingEnd>>,
    /// Every remote rank's receive ring, taken by the first listen.
    recvs: Mutex<Vec<(u32, RingEnd)>>,
    hosts: BTreeMap<u32, String>,
}

impl ProxyNet {
    /// Opens the engine's channels of `ctx`'s rank to `remotes` (ranks on
    /// other hosts, every rank listing its own alike) through the sidecar
    /// proxy at `path`; connections of other streams than `data_stream` go
    /// over `control`.
    pub(crate) fn open(
        path: &Path,
        ctx: &Ctx,
        remotes: &[usize],
        control: Arc<dyn Net>,
        data_stream: u32,
        deadline: Instant,
    ) -> Result<Arc<ProxyNet>> {
        let mut id = ctx.id;
        id[15] ^= ENGINE_ID_BIT;
        let engine_ctx = Ctx {
            id,
            label: format!("{} (cross-host engine)", ctx.label),
            rank: ctx.rank,
            nranks: ctx.nranks,
            secret: ctx.secret,
            peers: ctx.peers.clone(),
            cfg: ctx.cfg.clone(),
            job: ctx.job.clone(),
        };
        let what = format!("weft-{}-xh-{}", ctx.job, ctx.rank);
        let own = Mapping::create_control_memfd(&what)?;
        let link = ProxyLink::open(path, &engine_ctx, &own, remotes, deadline)?;
        let mut sends = BTreeMap::new();
        let mut recvs = Vec::new();
        for (i, &r) in remotes.iter().enumerate() {
            let chan = link.chan(i);
            sends.insert(r as u32, chan.send);
            recvs.push((r as u32, chan.recv));
        }
        let hosts = remotes
            .iter()
            .map(|&r| (r as u32, ctx.peers[r].hostname.clone()))
            .collect();
        Ok(Arc::new(ProxyNet {
            control,
            data_stream,
            me: ctx.rank as u32,
            att: Arc::new(Attachment {
                own,
                link: Some(link),
                path: path.to_path_buf(),
                rank: ctx.rank,
                last_check: AtomicU64::new(0),
                t0: Instant::now(),
            }),
            sends: Mutex::new(sends),
            recvs: Mutex::new(recvs),
            hosts,
        }))
    }

    fn peer_name(&self, rank: u32) -> String {
        match self.hosts.get(&rank) {
            Some(h) => format!("rank {rank} (host {h}, through the sidecar proxy)"),
            None => format!("rank {rank}"),
        }
    }
}

impl Net for ProxyNet {
    fn name(&self) -> &'static str {
        "sidecar-proxy"
    }

    fn devices(&self) -> usize {
        1
    }

    fn properties(&self, dev: usize) -> std::result::Result<Properties, NetError> {
        if dev != 0 {
            return Err(NetError::InvalidArgument(format!(
                "device {dev}: the sidecar proxy has one"
            )));
        }
        Ok(Properties {
            name: format!("sidecar-proxy:{}", self.att.path.display()),
            ptr_support: PtrSupport {
                host: true,
                device: false,
                dmabuf: false,
            },
            reg_is_global: true,
            speed_mbps: 0,
            latency_us: 0.0,
            max_comms: usize::MAX,
            max_recvs: 1,
            max_requests: MAX_REQUESTS,
            max_message: u32::MAX as usize,
        })
    }

    /// The handle: `HANDLE_MAGIC`, this rank's number, then the control
    /// byte mover's.
    fn listen(
        &self,
        dev: usize,
    ) -> std::result::Result<(ConnectHandle, Box<dyn ListenComm>), NetError> {
        let (inner, control) = self.control.listen(dev)?;
        let mut b = HANDLE_MAGIC.to_vec();
        b.extend_from_slice(&self.me.to_le_bytes());
        b.extend_from_slice(inner.as_bytes());
        let handle = ConnectHandle::from_bytes(&b)?;
        let data: VecDeque<(u32, ProxyRecv)> = std::mem::take(&mut *lock(&self.recvs))
            .into_iter()
            .map(|(r, ring)| (r, ProxyRecv::new(self.att.clone(), ring, self.peer_name(r))))
            .collect();
        Ok((
            handle,
            Box::new(ProxyListen {
                data,
                data_stream: self.data_stream,
                control,
            }),
        ))
    }

    fn connect(
        &self,
        dev: usize,
        handle: &ConnectHandle,
        me: Peer,
        deadline: Instant,
        cancelled: &dyn Fn() -> bool,
    ) -> std::result::Result<Box<dyn SendComm>, NetError> {
        let b = handle.as_bytes();
        if b.len() < 8 || b.len() > HANDLE_MAX || &b[..4] != HANDLE_MAGIC {
            return Err(NetError::InvalidArgument(format!(
                "not a sidecar-proxy connect handle ({} bytes): {MIXED}",
                b.len()
            )));
        }
        let rank = u32::from_le_bytes(b[4..8].try_into().unwrap());
        if me.stream != self.data_stream {
            let inner = ConnectHandle::from_bytes(&b[8..])?;
            return self.control.connect(dev, &inner, me, deadline, cancelled);
        }
        let ring = lock(&self.sends).remove(&rank).ok_or_else(|| {
            NetError::InvalidArgument(format!(
                "rank {rank} is not a rank on another host with a free proxied channel"
            ))
        })?;
        Ok(Box::new(ProxySend::new(
            self.att.clone(),
            ring,
            self.peer_name(rank),
        )))
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The data connections exist once the link is open: accepting hands out
/// each remote rank's receive end once, then the control listener's.
struct ProxyListen {
    data: VecDeque<(u32, ProxyRecv)>,
    data_stream: u32,
    control: Box<dyn ListenComm>,
}

impl ListenComm for ProxyListen {
    fn accept(&mut self, deadline: Instant) -> std::result::Result<Option<Accepted>, NetError> {
        if let Some((rank, c)) = self.data.pop_front() {
            let who = Peer {
                rank,
                stream: self.data_stream,
            };
            return Ok(Some((Box::new(c), who)));
        }
        self.control.accept(deadline)
    }
}
