//! The built-in transport of the byte mover seam: TCP, host memory.
//!
//! - Listening: one TCP listener per bind address per process
//!   (`listen.rs`), shared by every listen comm, each with its own secret.
//! - Connecting: a comm is `WEFT_NET_SOCKETS` sockets ([`TcpConfig::sockets`]),
//!   each authenticated like every Weft connection (the listener's challenge,
//!   a hello MAC'd with the job secret, an acceptance MAC'd over our nonce;
//!   `handshake.rs` through `bootstrap::wire`), then tuned like the direct
//!   TCP transport's (`sockets::DataOpts::between_hosts`: no Nagle, 4 MiB
//!   buffers, keepalive and `TCP_USER_TIMEOUT` from the peer timeout).
//! - Moving: messages striped over the sockets by helper threads (`stripe.rs`).

mod io;
pub(crate) mod listen;
mod stripe;
#[cfg(test)]
mod tests;
pub mod wire;

use super::{
    Accepted, ConnectHandle, ListenComm, Net, NetError, Peer, Properties, PtrSupport, SendComm,
};
use crate::bootstrap::client::{DROP_WINDOW, HANDSHAKE_RETRIES, connect_retry, dropped};
use crate::bootstrap::wire::{self as bwire, Kind};
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};
use wire::{Handle, Hello, ListenId};

pub use stripe::MAX_REQUESTS;

/// Sockets per connection when `WEFT_NET_SOCKETS` is not set (measured on
/// loopback: docs/PERFORMANCE.md, "Cross-host byte mover").
pub const DEFAULT_SOCKETS: usize = 4;
/// Smallest piece a message is cut into for striping.
pub const MIN_TASK: usize = 64 << 10;

/// How a [`TcpNet`] connects.
#[derive(Clone)]
pub struct TcpConfig {
    /// The job secret every connection proves (`UniqueId`'s).
    pub secret: [u8; 32],
    /// Sockets per connection (1..=64).
    pub sockets: usize,
    /// Address the listener binds.
    pub bind: IpAddr,
    /// Address put into connect handles (what peers dial).
    pub advertise: IpAddr,
    /// A silent peer is noticed within this (keepalive, `TCP_USER_TIMEOUT`).
    pub peer_timeout: Duration,
    /// Smallest piece of a striped message.
    pub min_task: usize,
}

impl TcpConfig {
    /// From the environment: `WEFT_NET_SOCKETS`, `WEFT_NET_MIN_PIECE_BYTES`,
    /// `WEFT_PEER_TIMEOUT_MS`, and
    /// the address rules of the peer endpoint (`WEFT_LISTEN_ADDR`, else the
    /// address of the default route, bound on every interface).
    pub fn from_env(secret: [u8; 32]) -> Result<TcpConfig, NetError> {
        let sockets = weft_contract::params::WEFT_NET_SOCKETS
            .try_get()
            .map_err(|e| NetError::InvalidArgument(e.to_string()))?
            .unwrap_or(DEFAULT_SOCKETS);
        let min_task = weft_contract::params::WEFT_NET_MIN_PIECE_BYTES
            .try_get()
            .map_err(|e| NetError::InvalidArgument(e.to_string()))?
            .unwrap_or(MIN_TASK);
        let cfg = crate::config::Config::from_env()
            .map_err(|e| NetError::InvalidArgument(e.to_string()))?;
        let advertise = crate::bootstrap::unique_id::advertised_ip();
        let bind = crate::bootstrap::unique_id::listen_addr().unwrap_or(match advertise {
            IpAddr::V4(_) => IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED),
            IpAddr::V6(_) => IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED),
        });
        Self::checked(TcpConfig {
            secret,
            sockets,
            bind,
            advertise,
            peer_timeout: cfg.peer_timeout,
            min_task,
        })
    }

    /// [`TcpConfig::from_env`] with the job's secret (`WEFT_JOB_SECRET` or
    /// `WEFT_JOB_SECRET_FILE`, through the job's unique id), for ranks
    /// started by a launcher.
    pub fn for_job() -> Result<TcpConfig, NetError> {
        let id = crate::bootstrap::unique_id::UniqueId::from_env()
            .map_err(|e| NetError::InvalidArgument(e.to_string()))?;
        Self::from_env(id.secret)
    }

    /// The same, advertising `ip` (what peers dial): a communicator's own
    /// endpoint address, which the bootstrap learned from the interface
    /// that reaches the root. The default route's address is no guide where
    /// there is none: a Kubernetes pod without one advertised loopback, and
    /// every peer in another pod dialled its own (found on a real cluster).
    /// A listener bound to every interface stays so, in `ip`'s family.
    pub fn advertising(mut self, ip: IpAddr) -> TcpConfig {
        if self.bind.is_unspecified() {
            self.bind = match ip {
                IpAddr::V4(_) => IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED),
                IpAddr::V6(_) => IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED),
            };
        }
        self.advertise = ip;
        self
    }

    /// Loopback only (tests, one host).
    pub fn loopback(secret: [u8; 32], sockets: usize) -> TcpConfig {
        let lo = IpAddr::V4(std::net::Ipv4Addr::LOCALHOST);
        TcpConfig {
            secret,
            sockets,
            bind: lo,
            advertise: lo,
            peer_timeout: Duration::from_secs(10),
            min_task: MIN_TASK,
        }
    }

    fn checked(self) -> Result<TcpConfig, NetError> {
        if self.sockets == 0 || self.sockets > wire::MAX_SOCKETS as usize {
            return Err(NetError::InvalidArgument(format!(
                "WEFT_NET_SOCKETS={}: expected 1 to {}",
                self.sockets,
                wire::MAX_SOCKETS
            )));
        }
        Ok(self)
    }
}

/// What this process's byte mover listeners have seen.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ListenerStats {
    pub accepted: u64,
    /// Refused before authentication (garbage, oversized, timed out, a
    /// socket that fits no connection).
    pub refused: u64,
    /// Refused because the MAC did not match the listener's secret.
    pub unauthenticated: u64,
    /// Silent unauthenticated connections dropped to stay under the caps.
    pub evicted: u64,
}

pub fn listener_stats() -> ListenerStats {
    use std::sync::atomic::Ordering::Relaxed;
    let c = &listen::COUNTERS;
    ListenerStats {
        accepted: c.accepted.load(Relaxed),
        refused: c.refused.load(Relaxed),
        unauthenticated: c.unauthenticated.load(Relaxed),
        evicted: c.evicted.load(Relaxed),
    }
}

/// The TCP transport: one device (the host's network stack).
pub struct TcpNet {
    cfg: TcpConfig,
}

impl TcpNet {
    pub fn new(cfg: TcpConfig) -> Result<Arc<TcpNet>, NetError> {
        Ok(Arc::new(TcpNet {
            cfg: cfg.checked()?,
        }))
    }

    pub fn config(&self) -> &TcpConfig {
        &self.cfg
    }

    fn check_dev(&self, dev: usize) -> Result<(), NetError> {
        if dev == 0 {
            Ok(())
        } else {
            Err(NetError::InvalidArgument(format!(
                "TCP has one device (0), not {dev}"
            )))
        }
    }

    fn tune(&self, s: &TcpStream) -> Result<(), NetError> {
        crate::sys::sockets::tune_data(
            s,
            &crate::sys::sockets::DataOpts::between_hosts(self.cfg.peer_timeout),
        )
        .map_err(|e| NetError::sys("tuning a net socket", e))
    }

    /// One authenticated socket of connection `hello.conn`.
    fn open_socket(
        &self,
        addr: SocketAddr,
        hello: &Hello,
        deadline: Instant,
        cancelled: &dyn Fn() -> bool,
    ) -> Result<TcpStream, NetError> {
        let peer = addr.to_string();
        let lost = |what: String| NetError::Peer {
            peer: peer.clone(),
            what,
        };
        let cancel = || cancelled().then(|| crate::error::Error::InvalidUsage("closed".into()));
        for tries in 0.. {
            let mut s =
                connect_retry(addr, deadline, "a net listener", true, &cancel).map_err(|e| {
                    match Instant::now() >= deadline {
                        true => NetError::ConnectTimeout {
                            peer: peer.clone(),
                            what: e.to_string(),
                        },
                        false if cancelled() => NetError::Closed,
                        false => lost(e.to_string()),
                    }
                })?;
            let ch = bwire::read_frame(&mut s, 64, deadline).map_err(|e| lost(e.to_string()))?;
            if ch.kind != Kind::Challenge || ch.payload.len() != 16 {
                return Err(lost("not a Weft net listener".into()));
            }
            let sent = Instant::now();
            bwire::write_all(
                &mut s,
                &bwire::encode(
                    Kind::Connect,
                    &hello.encode(),
                    &self.cfg.secret,
                    &ch.payload,
                ),
                deadline,
            )
            .map_err(|e| lost(e.to_string()))?;
            // An accept loop at its cap may drop a handshake unread: again.
            if !bwire::wait_readable(&s, deadline.saturating_duration_since(Instant::now())) {
                return Err(NetError::ConnectTimeout {
                    peer,
                    what: "no answer to our hello".into(),
                });
            }
            if sent.elapsed() < DROP_WINDOW
                && let Some(why) = dropped(&s)
            {
                if tries >= HANDSHAKE_RETRIES {
                    return Err(lost(format!("dropped our connection ({why})")));
                }
                std::thread::sleep(Duration::from_millis(10 << tries));
                continue;
            }
            let f = bwire::read_frame(&mut s, 1024, deadline).map_err(|e| lost(e.to_string()))?;
            return match f.kind {
                Kind::Accept => {
                    f.verify(&self.cfg.secret, &hello.client_nonce)
                        .map_err(|e| lost(e.to_string()))?;
                    self.tune(&s)?;
                    Ok(s)
                }
                Kind::Error => Err(lost(format!(
                    "refused the connection: {}",
                    String::from_utf8_lossy(&f.payload)
                ))),
                k => Err(lost(format!("unexpected {k:?}"))),
            };
        }
        unreachable!("the loop returns")
    }
}

fn random16() -> Result<[u8; 16], NetError> {
    crate::bootstrap::handshake::random_bytes().map_err(|e| NetError::System {
        context: "randomness".into(),
        why: e.to_string(),
    })
}

impl Net for TcpNet {
    fn name(&self) -> &'static str {
        "tcp"
    }

    fn devices(&self) -> usize {
        1
    }

    fn properties(&self, dev: usize) -> Result<Properties, NetError> {
        self.check_dev(dev)?;
        Ok(Properties {
            name: format!("tcp:{}", self.cfg.advertise),
            ptr_support: PtrSupport {
                host: true,
                device: false,
                dmabuf: false,
            },
            reg_is_global: false,
            speed_mbps: 0,
            latency_us: 0.0,
            max_comms: 65536,
            max_recvs: 1,
            max_requests: MAX_REQUESTS,
            max_message: u32::MAX as usize * wire::MAX_SOCKETS as usize,
        })
    }

    fn listen(&self, dev: usize) -> Result<(ConnectHandle, Box<dyn ListenComm>), NetError> {
        self.check_dev(dev)?;
        let svc = listen::service();
        let port = svc.port_for(self.cfg.bind)?;
        let id = svc.open(self.cfg.secret)?;
        let handle = Handle {
            addr: SocketAddr::new(self.cfg.advertise, port),
            listen: id,
        };
        Ok((
            handle.encode(),
            Box::new(TcpListenComm {
                id,
                peer_timeout: self.cfg.peer_timeout,
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
    ) -> Result<Box<dyn SendComm>, NetError> {
        self.check_dev(dev)?;
        let h = Handle::decode(handle)?;
        let conn = random16()?;
        let mut socks = Vec::with_capacity(self.cfg.sockets);
        for index in 0..self.cfg.sockets {
            let hello = Hello {
                listen: h.listen,
                conn,
                index: index as u16,
                nsocks: self.cfg.sockets as u16,
                peer: me,
                client_nonce: random16()?,
            };
            socks.push(self.open_socket(h.addr, &hello, deadline, cancelled)?);
        }
        Ok(Box::new(stripe::TcpSendComm::new(
            h.addr.to_string(),
            socks,
            self.cfg.min_task,
        )?))
    }
}

/// One listen id of the process's listener.
struct TcpListenComm {
    id: ListenId,
    peer_timeout: Duration,
}

impl ListenComm for TcpListenComm {
    fn accept(&mut self, deadline: Instant) -> Result<Option<Accepted>, NetError> {
        let Some(a) = listen::service().next(&self.id, deadline)? else {
            return Ok(None);
        };
        for s in &a.socks {
            crate::sys::sockets::tune_data(
                s,
                &crate::sys::sockets::DataOpts::between_hosts(self.peer_timeout),
            )
            .map_err(|e| NetError::sys("tuning a net socket", e))?;
        }
        let comm = stripe::TcpRecvComm::new(a.from.to_string(), a.socks)?;
        Ok(Some((Box::new(comm), a.peer)))
    }
}

impl Drop for TcpListenComm {
    fn drop(&mut self) {
        listen::service().close(&self.id);
    }
}
