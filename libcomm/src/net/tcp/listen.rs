//! The TCP byte mover's listeners: one TCP listener per bind address per
//! process, served by the bounded accept loop every Weft listener uses
//! (`bootstrap::server`: a fresh challenge per connection, the first frame
//! bounded in size and time, caps on unauthenticated connections). Each
//! [`Net::listen`](crate::net::Net::listen) registers a listen id with the
//! secret that authenticates its connectors; a socket's first frame
//! ([`Hello`]) names the listen id, and its MAC must check out against that
//! listener's secret before anything is kept for it. Sockets of one
//! connection (same connection id) are grouped until all have arrived, then
//! the connection waits in its listener's queue for `accept`. Incomplete
//! groups are bounded in number and expire.

use super::wire::{ConnId, Hello, ListenId};
use crate::bootstrap::server::{self, Accepted, Counters, Handler, Limits};
use crate::bootstrap::wire::{self, Kind};
use crate::log::{info_log, warn_log};
use crate::net::{NetError, Peer};
use std::collections::{HashMap, VecDeque};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

/// Time a client has to deliver its hello (a peer answers within a round trip).
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// Incomplete connections (some sockets arrived) per listener, at most.
const MAX_GROUPS: usize = 1024;
/// How long the sockets of a connection may take to all arrive.
const GROUP_TTL: Duration = Duration::from_secs(10);
/// Complete connections waiting for `accept` per listener, at most.
const MAX_READY: usize = 4096;

/// What the byte mover's listeners have seen.
pub(crate) static COUNTERS: Counters = Counters::new();

/// A connection whose sockets have all arrived.
pub(super) struct Arrived {
    pub socks: Vec<TcpStream>,
    pub peer: Peer,
    pub from: SocketAddr,
}

struct Group {
    peer: Peer,
    from: SocketAddr,
    socks: Vec<Option<TcpStream>>,
    since: Instant,
}

struct Listening {
    secret: [u8; 32],
    groups: HashMap<ConnId, Group>,
    ready: VecDeque<Arrived>,
}

#[derive(Default)]
struct Registry {
    listening: HashMap<ListenId, Listening>,
}

/// The process's byte mover listeners.
pub(super) struct Service {
    reg: Mutex<Registry>,
    arrived: Condvar,
    ports: Mutex<HashMap<IpAddr, u16>>,
}

pub(super) fn service() -> Arc<Service> {
    static S: OnceLock<Arc<Service>> = OnceLock::new();
    S.get_or_init(|| {
        Arc::new(Service {
            reg: Mutex::new(Registry::default()),
            arrived: Condvar::new(),
            ports: Mutex::new(HashMap::new()),
        })
    })
    .clone()
}

impl Service {
    fn lock(&self) -> MutexGuard<'_, Registry> {
        self.reg.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The port of the listener bound to `ip`, started on first use.
    pub fn port_for(self: &Arc<Self>, ip: IpAddr) -> Result<u16, NetError> {
        let mut ports = self.ports.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(&p) = ports.get(&ip) {
            return Ok(p);
        }
        let bind = SocketAddr::new(ip, 0);
        let l = TcpListener::bind(bind)
            .map_err(|e| NetError::sys(format!("net listener: bind {bind}"), e))?;
        crate::sys::sockets::set_backlog(&l, 4096);
        let port = l
            .local_addr()
            .map_err(|e| NetError::sys("getsockname", e))?
            .port();
        let mut h = ServiceHandler { svc: self.clone() };
        std::thread::Builder::new()
            .name("weft-net-listen".into())
            .spawn(move || {
                server::serve(
                    l,
                    "net listener",
                    Limits::new(HANDSHAKE_TIMEOUT),
                    &COUNTERS,
                    &mut h,
                )
            })
            .map_err(|e| NetError::sys("spawning the net listener thread", e))?;
        info_log!("net listener on {ip} port {port}");
        ports.insert(ip, port);
        Ok(port)
    }

    /// A new listen id whose connectors must hold `secret`.
    pub fn open(&self, secret: [u8; 32]) -> Result<ListenId, NetError> {
        let id: ListenId =
            crate::bootstrap::handshake::random_bytes().map_err(|e| NetError::System {
                context: "listen id".into(),
                why: e.to_string(),
            })?;
        self.lock().listening.insert(
            id,
            Listening {
                secret,
                groups: HashMap::new(),
                ready: VecDeque::new(),
            },
        );
        Ok(id)
    }

    pub fn close(&self, id: &ListenId) {
        self.lock().listening.remove(id);
    }

    /// The next complete connection of listener `id`, waiting until `deadline`.
    pub fn next(&self, id: &ListenId, deadline: Instant) -> Result<Option<Arrived>, NetError> {
        let mut r = self.lock();
        loop {
            let l = r.listening.get_mut(id).ok_or(NetError::Closed)?;
            if let Some(a) = l.ready.pop_front() {
                return Ok(Some(a));
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(None);
            }
            r = self
                .arrived
                .wait_timeout(r, left.min(Duration::from_millis(100)))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

struct ServiceHandler {
    svc: Arc<Service>,
}

fn refuse(a: Accepted, why: &str) {
    COUNTERS.refused.fetch_add(1, Relaxed);
    server::reject(a.stream, a.peer, "net listener", why);
}

impl Handler for ServiceHandler {
    fn on_frame(&mut self, a: Accepted) {
        if a.frame.kind != Kind::Connect {
            let k = a.frame.kind;
            return refuse(a, &format!("expected a connect, got {k:?}"));
        }
        let h = match Hello::decode(&a.frame.payload) {
            Ok(h) => h,
            Err(e) => return refuse(a, &e.to_string()),
        };
        let Some(secret) = self.svc.lock().listening.get(&h.listen).map(|l| l.secret) else {
            return refuse(a, "no such listener (closed, or a stale handle)");
        };
        if a.frame.verify(&secret, &a.challenge).is_err() {
            COUNTERS.unauthenticated.fetch_add(1, Relaxed);
            return server::reject(
                a.stream,
                a.peer,
                "net listener",
                "authentication failed: the peer does not hold this job's secret",
            );
        }
        let mut s = a.stream;
        let ack = wire::encode(Kind::Accept, &[], &secret, &h.client_nonce);
        if let Err(e) = wire::write_all(&mut s, &ack, Instant::now() + Duration::from_secs(5)) {
            warn_log!("net listener: lost {} while accepting: {e}", a.peer);
            return;
        }
        let mut r = self.svc.lock();
        let Some(l) = r.listening.get_mut(&h.listen) else {
            return; // closed meanwhile
        };
        if !l.groups.contains_key(&h.conn) && l.groups.len() >= MAX_GROUPS {
            drop(r);
            return refuse_stream(s, a.peer, "too many connections under way");
        }
        let g = l.groups.entry(h.conn).or_insert_with(|| Group {
            peer: h.peer,
            from: a.peer,
            socks: (0..h.nsocks).map(|_| None).collect(),
            since: Instant::now(),
        });
        let consistent = g.peer == h.peer && g.socks.len() == h.nsocks as usize;
        match g.socks.get_mut(h.index as usize) {
            Some(slot @ None) if consistent => *slot = Some(s),
            _ => {
                drop(r);
                return refuse_stream(s, a.peer, "a socket that does not fit its connection");
            }
        }
        if g.socks.iter().all(Option::is_some) {
            let g = l.groups.remove(&h.conn).expect("present");
            if l.ready.len() >= MAX_READY {
                drop(r);
                warn_log!("net listener: too many connections never accepted; dropping one");
                return;
            }
            l.ready.push_back(Arrived {
                socks: g.socks.into_iter().flatten().collect(),
                peer: g.peer,
                from: g.from,
            });
            drop(r);
            self.svc.arrived.notify_all();
        }
    }

    fn tick(&mut self) -> bool {
        let mut r = self.svc.lock();
        let mut expired = 0;
        for l in r.listening.values_mut() {
            let before = l.groups.len();
            l.groups.retain(|_, g| g.since.elapsed() < GROUP_TTL);
            expired += before - l.groups.len();
        }
        drop(r);
        if expired > 0 {
            warn_log!(
                "net listener: {expired} connection(s) whose sockets did not all arrive within {} s dropped",
                GROUP_TTL.as_secs()
            );
        }
        false
    }
}

fn refuse_stream(s: TcpStream, peer: SocketAddr, why: &str) {
    COUNTERS.refused.fetch_add(1, Relaxed);
    server::log_refusal("net listener", peer, why);
    let _ = s.shutdown(std::net::Shutdown::Both);
}
