//! The bootstrap root: collects one authenticated `Hello` per rank, then sends
//! everyone the full table and exits. Bad connections (garbage, wrong secret,
//! another job's id, a duplicate or out-of-range rank) are refused one by one
//! with an error frame; they never disturb the rendezvous.

use super::server::{self, Accepted, Handler};
use super::wire::{self, Kind};
use super::{Hello, PeerInfo, encode_table};
use crate::bootstrap::handshake::random;
use crate::bootstrap::unique_id::{UniqueId, advertised_ip, listen_addr};
use crate::error::{Error, Result};
use crate::log::{info_log, warn_log};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};
use weft_contract::params;

// `UniqueId::new` lives beside the root it starts, so `unique_id` (the 128-byte
// token and its encoding) needs nothing from the bootstrap.
impl UniqueId {
    /// A fresh id whose bootstrap root is served by a thread of this process
    /// (NCCL's `ncclGetUniqueId`). The root serves one rendezvous, then exits.
    pub fn new() -> Result<UniqueId> {
        // Bound to the one address the id advertises (WEFT_LISTEN_ADDR, else
        // the address of the route out), not to every interface.
        Self::new_at(advertised_ip())
    }

    /// [`UniqueId::new`] advertising `ip` (`WEFT_LISTEN_ADDR` still wins):
    /// a grow's id is served where the communicator's ranks already reach
    /// this rank.
    pub fn new_at(ip: IpAddr) -> Result<UniqueId> {
        let ip = listen_addr().unwrap_or(ip);
        let bind = SocketAddr::new(ip, 0);
        let listener = TcpListener::bind(bind)
            .or_else(|e| {
                if params::WEFT_LISTEN_ADDR.raw().is_some() {
                    return Err(e);
                }
                TcpListener::bind(SocketAddr::new(unspecified(ip), 0))
            })
            .map_err(|e| Error::sys(format!("bootstrap root: bind {bind}"), e))?;
        let port = listener
            .local_addr()
            .map_err(|e| Error::sys("getsockname", e))?
            .port();
        let id = UniqueId {
            root: SocketAddr::new(ip, port),
            nonce: random()?,
            secret: random()?,
            rank0_serves: false,
            root_named: false,
        };
        spawn(listener, id.clone())?;
        Ok(id)
    }
}

/// How long a single connection may take to send its hello, in all.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// What the bootstrap roots of this process have seen.
pub(crate) static COUNTERS: server::Counters = server::Counters::new();

fn unspecified(like: IpAddr) -> IpAddr {
    match like {
        IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
    }
}

struct Arrived {
    stream: TcpStream,
    client_nonce: [u8; 16],
    info: PeerInfo,
}

struct Root {
    id: UniqueId,
    nranks: Option<u32>,
    ranks: Vec<Option<Arrived>>,
    arrived: usize,
    deadline: Instant,
    done: bool,
}

impl Root {
    fn refuse(&self, a: Accepted, reason: String) {
        server::reject(a.stream, a.peer, "bootstrap root", &reason);
    }

    fn finish(&mut self) {
        let table: Vec<PeerInfo> = self
            .ranks
            .iter()
            .map(|r| r.as_ref().expect("all arrived").info.clone())
            .collect();
        let comm_id: [u8; 16] = random().unwrap_or(self.id.nonce);
        let payload = encode_table(&comm_id, &table);
        let deadline = Instant::now() + Duration::from_secs(10);
        for (rank, r) in self.ranks.iter_mut().enumerate() {
            let r = r.take().expect("all arrived");
            let msg = wire::encode(Kind::Table, &payload, &self.id.secret, &r.client_nonce);
            let mut s = r.stream;
            if let Err(e) = wire::write_all(&mut s, &msg, deadline) {
                warn_log!("bootstrap root: could not send the table to rank {rank}: {e}");
            }
        }
        info_log!(
            "bootstrap root {}: {} ranks connected",
            self.id.root,
            table.len()
        );
        self.done = true;
    }
}

impl Handler for Root {
    fn on_frame(&mut self, a: Accepted) {
        if a.frame.kind != Kind::Hello {
            let k = a.frame.kind;
            return self.refuse(a, format!("expected a hello, got {k:?}"));
        }
        if let Err(e) = a.frame.verify(&self.id.secret, &a.challenge) {
            COUNTERS
                .unauthenticated
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            return self.refuse(a, e.to_string());
        }
        let hello = match Hello::decode(&a.frame.payload) {
            Ok(h) => h,
            Err(e) => return self.refuse(a, e.to_string()),
        };
        if hello.nonce != self.id.nonce {
            return self.refuse(
                a,
                "this hello belongs to another unique id (another communicator or job)".into(),
            );
        }
        let n = *self.nranks.get_or_insert(hello.nranks);
        if hello.nranks != n {
            return self.refuse(
                a,
                format!(
                    "rank {} says the communicator has {} ranks, but others said {n}",
                    hello.rank, hello.nranks
                ),
            );
        }
        if self.ranks.is_empty() {
            self.ranks.resize_with(n as usize, || None);
        }
        let r = hello.rank as usize;
        if r >= n as usize {
            return self.refuse(a, format!("rank {r} is out of range for {n} ranks"));
        }
        if self.ranks[r].is_some() {
            return self.refuse(
                a,
                format!("rank {r} joined twice (two processes were given the same rank)"),
            );
        }
        self.ranks[r] = Some(Arrived {
            stream: a.stream,
            client_nonce: hello.client_nonce,
            info: hello.info,
        });
        self.arrived += 1;
        if self.arrived == n as usize {
            self.finish();
        }
    }

    fn tick(&mut self) -> bool {
        if self.done {
            return true;
        }
        if Instant::now() >= self.deadline {
            let missing: Vec<usize> = (0..self.ranks.len())
                .filter(|&r| self.ranks[r].is_none())
                .collect();
            let reason = if self.ranks.is_empty() {
                "bootstrap root timed out: no rank connected".to_string()
            } else {
                format!(
                    "bootstrap timed out: ranks {missing:?} of {} never connected",
                    self.ranks.len()
                )
            };
            warn_log!("{reason}");
            for a in self.ranks.iter_mut().filter_map(Option::take) {
                let peer = a
                    .stream
                    .peer_addr()
                    .unwrap_or_else(|_| ([0, 0, 0, 0], 0).into());
                server::reject(a.stream, peer, "bootstrap root", &reason);
            }
            return true;
        }
        false
    }
}

fn root_timeout() -> Duration {
    crate::config::Config::from_env()
        .map(|c| c.init_timeout)
        .unwrap_or(Duration::from_secs(120))
}

/// Serves one rendezvous on `listener` from a background thread.
pub(crate) fn spawn(listener: TcpListener, id: UniqueId) -> Result<()> {
    crate::sys::sockets::set_backlog(&listener, 1024);
    let mut root = Root {
        id,
        nranks: None,
        ranks: Vec::new(),
        arrived: 0,
        deadline: Instant::now() + root_timeout(),
        done: false,
    };
    std::thread::Builder::new()
        .name("weft-bootstrap-root".into())
        .spawn(move || {
            // A hello is a few hundred bytes: nothing larger is read before
            // its MAC is checked (the 16 MiB bound is for the table ranks read).
            server::serve(
                listener,
                "bootstrap root",
                server::Limits::new(HANDSHAKE_TIMEOUT),
                &COUNTERS,
                &mut root,
            )
        })
        .map(|_| ())
        .map_err(|e| Error::sys("spawning the bootstrap root thread", e))
}

/// Where rank 0 binds the root of an environment id: `WEFT_LISTEN_ADDR`
/// when set; else, when `WEFT_BOOTSTRAP`/`NCCL_COMM_ID` names an IP
/// literal (or `localhost`) that is one of this host's, that address
/// (127.0.0.1 stays on loopback); else every interface (a host name, which
/// other hosts may resolve differently, or an address this host does not
/// hold, such as a Service's).
fn root_bind(id: &UniqueId) -> SocketAddr {
    let port = id.root.port();
    if let Some(ip) = listen_addr() {
        return SocketAddr::new(ip, port);
    }
    let ip = id.root.ip();
    if id.root_named {
        // Other hosts may resolve the name to another address of this one.
        return SocketAddr::new(unspecified(ip), port);
    }
    if ip.is_loopback() || ip.is_unspecified() || is_local(ip) {
        SocketAddr::new(ip, port)
    } else {
        info_log!(
            "bootstrap root: {ip} (from WEFT_BOOTSTRAP/NCCL_COMM_ID) is not an address of this host: listening on every interface"
        );
        SocketAddr::new(unspecified(ip), port)
    }
}

/// Whether `ip` is an address of this host (binding it works).
fn is_local(ip: IpAddr) -> bool {
    match TcpListener::bind(SocketAddr::new(ip, 0)) {
        Ok(_) => true,
        Err(e) => e.raw_os_error() != Some(libc::EADDRNOTAVAIL),
    }
}

/// Rank 0's side of an environment id: serve the root at the id's port.
pub(crate) fn serve_at(id: &UniqueId, nranks: usize) -> Result<()> {
    let bind = root_bind(id);
    let deadline = Instant::now() + Duration::from_secs(5);
    // The previous rendezvous on this port may still be closing: retry briefly.
    let listener = loop {
        match TcpListener::bind(bind) {
            Ok(l) => break l,
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(50))
            }
            Err(e) => {
                return Err(Error::sys(
                    format!(
                        "rank 0 cannot serve the bootstrap root at {bind} (from WEFT_BOOTSTRAP/NCCL_COMM_ID)"
                    ),
                    e,
                ));
            }
        }
    };
    crate::sys::sockets::set_backlog(&listener, nranks * 2);
    spawn(listener, id.clone())
}
