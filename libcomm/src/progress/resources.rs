//! [`Resources`]: the live resources of a Ready communicator: its table of
//! peers, the shared-memory segments of its local ranks, its channels and the
//! failure domain. Owned by the communicator's lifecycle record
//! (`comm/shared.rs`'s `CommShared`) behind one mutex, so every operation on a
//! communicator is serialized; everything lock-free (abort, status) goes
//! through [`Fault`] instead. [`Ctx`] (`bootstrap/ctx.rs`) holds the immutable facts it was built
//! from.

use crate::bootstrap::ctx::{CommId, Ctx};
use crate::bootstrap::unique_id::hex;
use crate::config::TransportPref;
use crate::error::{Error, Result};
use crate::log::info_log;
use crate::progress::fault::Fault;
use crate::progress::xfer::Queue;
use crate::transport::shm::{self, Mapping, RingEnd, ST_DESTROYED};
use crate::transport::sidecar_rings::ProxyLink;
use crate::transport::tcp::{self, Endpoint};
use crate::transport::{Chan, Seqs, ShmChan, TcpChan};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PeerKind {
    Me,
    Shm,
    Tcp,
    /// Another host, through the sidecar proxy.
    Proxy,
}

/// The live resources of a Ready communicator (see the module docs).
pub(crate) struct Resources {
    // Field order matters for Drop: channels (raw ring pointers) go before the mappings.
    pub chans: Vec<Option<Chan>>,
    /// The sidecar proxy link (rings) behind the `Proxy` channels.
    pub proxy: Option<ProxyLink>,
    pub seqs: Vec<Seqs>,
    pub fault: Arc<Fault>,
    pub local_maps: Vec<Option<Arc<Mapping>>>,
    pub kinds: Vec<PeerKind>,
    pub ctx: Arc<Ctx>,
    pub endpoint: Arc<Endpoint>,
    pub oversubscribed: bool,
    /// Reused scratch memory for algorithms that need it.
    pub scratch: Vec<u8>,
    /// Reused by the progress engine (one byte per peer).
    pub busy: Vec<u8>,
    /// Host sends that returned before their peer had everything (`eager.rs`).
    pub eager: Queue,
    /// Number of collectives issued (for diagnostics).
    pub coll_seq: u64,
    split_count: u64,
}

/// The name of a rank's segment: its memfd's label and its offer's abstract
/// socket (nothing of it is in /dev/shm).
fn segment_name(job: &str, id: &CommId, rank: usize) -> String {
    format!("/weft-{job}-{}-{rank}", hex(&id[..8]))
}

impl Resources {
    pub fn build(ctx: Arc<Ctx>, endpoint: Arc<Endpoint>, deadline: Instant) -> Result<Resources> {
        let (me, n) = (ctx.rank, ctx.nranks);
        let my_host = ctx.peers[me].host_id;
        let kinds: Vec<PeerKind> = (0..n)
            .map(|r| {
                if r == me {
                    PeerKind::Me
                } else if ctx.cfg.transport != TransportPref::Tcp && ctx.peers[r].host_id == my_host
                {
                    PeerKind::Shm
                } else {
                    PeerKind::Tcp
                }
            })
            .collect();
        if ctx.cfg.transport == TransportPref::Shm
            && let Some(r) = kinds.iter().position(|k| *k == PeerKind::Tcp)
        {
            return Err(Error::InvalidUsage(format!(
                "WEFT_TRANSPORT=shm, but rank {r} is on another host ({}) than rank {me} ({})",
                ctx.peers[r].hostname, ctx.peers[me].hostname
            )));
        }
        // Other hosts go through the pod's sidecar when it offers a proxy
        // (WEFT_TRANSPORT=tcp keeps every peer on direct TCP).
        let proxy_path =
            if ctx.cfg.transport != TransportPref::Tcp && kinds.contains(&PeerKind::Tcp) {
                crate::transport::sidecar_link::socket_path()?
            } else {
                None
            };
        // Both ends of a channel must agree on how it goes: a mismatch would
        // leave each side waiting on a path the other never uses.
        if let Some(r) = (0..n)
            .find(|&r| kinds[r] == PeerKind::Tcp && ctx.peers[r].proxied != proxy_path.is_some())
        {
            let how = |p: bool| {
                if p {
                    "through its sidecar's proxy"
                } else {
                    "directly over TCP"
                }
            };
            return Err(Error::InvalidUsage(format!(
                "rank {r} on host {} reaches other hosts {} but rank {me} on host {} {}: every rank of a job must make the same choice (WEFT_PROXY, WEFT_SIDECAR_SOCKET, WEFT_TRANSPORT, the sidecars' --no-proxy)",
                ctx.peers[r].hostname,
                how(ctx.peers[r].proxied),
                ctx.peers[me].hostname,
                how(proxy_path.is_some())
            )));
        }
        let mut kinds = kinds;
        if proxy_path.is_some() {
            for k in kinds.iter_mut().filter(|k| **k == PeerKind::Tcp) {
                *k = PeerKind::Proxy;
            }
        }
        let remotes: Vec<usize> = (0..n).filter(|&r| kinds[r] == PeerKind::Proxy).collect();
        let locals: Vec<usize> = (0..n)
            .filter(|&r| matches!(kinds[r], PeerKind::Me | PeerKind::Shm))
            .collect();
        let nlocal = locals.len();
        let local_index = |r: usize| locals.iter().position(|&x| x == r).expect("local rank");
        let cap = shm::ring_capacity(nlocal, ctx.cfg.shm_ring_bytes);
        let own_name = segment_name(&ctx.job, &ctx.id, me);
        let own = Arc::new(Mapping::create(
            &own_name,
            nlocal,
            cap,
            me,
            proxy_path.is_some(),
        )?);
        // Our segment has no name anywhere: local peers get its descriptor
        // from this offer (an abstract socket, gone with the process), so a
        // kill at any point of init leaves nothing in /dev/shm.
        let offer = if nlocal > 1 {
            Some(shm::Offer::start(
                &own_name,
                own.clone(),
                nlocal as u32 - 1,
                deadline,
            )?)
        } else {
            None
        };
        let mut local_maps: Vec<Option<Arc<Mapping>>> = vec![None; n];
        for &r in locals.iter().filter(|&&r| r != me) {
            let name = segment_name(&ctx.job, &ctx.id, r);
            let m = Mapping::open(&name, nlocal, cap, deadline, ctx.peers[r].pid)?;
            m.control().opened.fetch_add(1, Ordering::AcqRel);
            local_maps[r] = Some(Arc::new(m));
        }
        // Local barrier: return only once every local peer has mapped our
        // segment (then the offer can go), so that destroying right after
        // init can never leave a slower peer without it (NCCL ends init
        // with a bootstrap barrier for the same reason).
        if nlocal > 1 {
            wait_all_mapped(&own, nlocal, &locals, &ctx, deadline)?;
        }
        drop(offer);
        let mut chans: Vec<Option<Chan>> = (0..n).map(|_| None).collect();
        for &r in locals.iter().filter(|&&r| r != me) {
            let peer = local_maps[r].as_ref().unwrap();
            chans[r] = Some(Chan::Shm(ShmChan {
                send: RingEnd::new(peer, local_index(me), peer, true),
                recv: RingEnd::new(&own, local_index(r), peer, false),
            }));
        }
        let ntcp = kinds.iter().filter(|k| **k == PeerKind::Tcp).count();
        if ntcp > 0 {
            tcp::check_fd_budget(ntcp)?;
        }
        let proxy = match &proxy_path {
            Some(path) => match ProxyLink::open(path, &ctx, &own, &remotes, deadline) {
                Ok(link) => {
                    for (i, &r) in remotes.iter().enumerate() {
                        chans[r] = Some(Chan::Proxy(link.chan(i)));
                    }
                    Some(link)
                }
                Err(e) => return Err(e),
            },
            None => None,
        };
        endpoint.register(ctx.id, ctx.secret);
        let fault = Arc::new(Fault {
            rank: me,
            own: own.clone(),
            locals: locals
                .iter()
                .filter(|&&r| r != me)
                .map(|&r| (r, local_maps[r].clone().unwrap()))
                .collect(),
            tcp: Default::default(),
            next_scan_ns: Default::default(),
            notify: Some(tcp::FailNotify {
                comm: ctx.id,
                secret: ctx.secret,
                peers: (0..n)
                    .filter(|&r| kinds[r] == PeerKind::Tcp)
                    .map(|r| ctx.peers[r].addr)
                    .collect(),
            }),
        });
        // Notices from remote peers raise in this failure domain.
        let sink = Arc::downgrade(&fault);
        endpoint.watch_failures(ctx.id, sink);
        info_log!(
            "comm {} rank {me}/{n}: {} local rank(s) over shared memory (ring {} KiB), {ntcp} over TCP, {} through the sidecar proxy",
            ctx.label,
            nlocal,
            cap / 1024,
            remotes.len()
        );
        Ok(Resources {
            chans,
            proxy,
            seqs: (0..n).map(|_| Seqs::default()).collect(),
            fault,
            local_maps,
            kinds,
            oversubscribed: nlocal > crate::sys::topology::online_cpus(),
            endpoint,
            ctx,
            scratch: Vec::new(),
            busy: Vec::new(),
            eager: Default::default(),
            coll_seq: 0,
            split_count: 0,
        })
    }

    /// The channel to `peer`, connecting it on first use (TCP).
    pub(crate) fn chan(&mut self, peer: usize) -> Result<()> {
        if self.chans[peer].is_some() {
            return Ok(());
        }
        debug_assert_eq!(self.kinds[peer], PeerKind::Tcp);
        let ctx = self.ctx.clone();
        let me = ctx.rank;
        let fault = self.fault.clone();
        let label = ctx.label.clone();
        let cancelled = || {
            fault.check().map(|r| Error::Remote {
                comm: label.clone(),
                rank: me,
                detail: format!("rank {} failed while connecting: {}", r.origin, r.reason),
            })
        };
        let info = &ctx.peers[peer];
        let stream = if me < peer {
            let deadline = Instant::now() + ctx.cfg.init_timeout;
            tcp::connect(
                info.addr,
                ctx.id,
                &ctx.secret,
                me as u32,
                peer as u32,
                deadline,
                &cancelled,
            )
            .map_err(|e| Error::Remote {
                comm: label.clone(),
                rank: me,
                detail: format!(
                    "connecting to rank {peer} at {} ({}): {e}",
                    info.addr, info.hostname
                ),
            })?
        } else {
            let peer_timeout = ctx.cfg.peer_timeout;
            let mut next_probe = peer_timeout;
            self.endpoint
                .wait_for(ctx.id, peer as u32, me as u32, |waited| {
                    if let Some(e) = cancelled() {
                        return Err(e);
                    }
                    if waited >= next_probe {
                        next_probe = waited + peer_timeout;
                        if !tcp::probe(info.addr) {
                            return Err(Error::Remote {
                                comm: label.clone(),
                                rank: me,
                                detail: format!(
                                    "rank {peer} at {} ({}) is unreachable: its process has exited",
                                    info.addr, info.hostname
                                ),
                            });
                        }
                    }
                    Ok(())
                })?
        };
        tcp::tune(&stream, ctx.cfg.peer_timeout)?;
        if let Ok(c) = stream.try_clone() {
            self.fault
                .tcp
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(c);
        }
        self.chans[peer] = Some(Chan::Tcp(TcpChan::new(stream)));
        Ok(())
    }

    /// A per-communicator split counter (identical on every rank, since
    /// operations on a communicator are ordered the same everywhere).
    pub(crate) fn split_seq(&mut self) -> u64 {
        self.split_count += 1;
        self.split_count
    }

    pub(crate) fn scratch(&mut self, bytes: usize) -> *mut u8 {
        if self.scratch.len() < bytes {
            self.scratch.resize(bytes, 0);
        }
        self.scratch.as_mut_ptr()
    }
}

impl Drop for Resources {
    fn drop(&mut self) {
        // Tell local peers we are gone (they stop waiting for us), release the
        // endpoint registration; the mappings unmap as they drop.
        self.fault
            .own
            .control()
            .state
            .store(ST_DESTROYED, Ordering::Release);
        for (_, m) in &self.fault.locals {
            m.control().ring();
        }
        self.endpoint.unregister(self.ctx.id);
        self.chans.clear();
        // Closing the link tells the sidecar (after the rings' users are gone).
        self.proxy = None;
    }
}

/// Waits until `nlocal - 1` peers have counted themselves into our segment.
fn wait_all_mapped(
    own: &Mapping,
    nlocal: usize,
    locals: &[usize],
    ctx: &Ctx,
    deadline: Instant,
) -> Result<()> {
    let want = nlocal as u32 - 1;
    let mut backoff = Duration::from_micros(50);
    let mut next_liveness = Instant::now() + Duration::from_millis(100);
    while own.control().opened.load(Ordering::Acquire) < want {
        let now = Instant::now();
        if now >= deadline {
            return Err(Error::Bootstrap(format!(
                "timed out waiting for {} local rank(s) to map this rank's shared memory",
                want - own.control().opened.load(Ordering::Acquire)
            )));
        }
        if now >= next_liveness {
            next_liveness = now + Duration::from_millis(100);
            for &r in locals.iter().filter(|&&r| r != ctx.rank) {
                if !crate::sys::topology::pid_alive(ctx.peers[r].pid) {
                    return Err(Error::Remote {
                        comm: ctx.label.clone(),
                        rank: ctx.rank,
                        detail: format!(
                            "local rank {r} (pid {}) exited during init",
                            ctx.peers[r].pid
                        ),
                    });
                }
            }
        }
        std::thread::sleep(backoff);
        backoff = (backoff * 2).min(Duration::from_millis(2));
    }
    Ok(())
}
