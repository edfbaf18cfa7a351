//! TCP between hosts.
//!
//! One [`Endpoint`] per process: a listener bound once, served by one thread
//! with the bounded, backpressured accept loop of `bootstrap::server`.
//! Connections are made lazily, on a pair's first transfer: the lower rank
//! connects and proves it holds the communicator's secret (HMAC over the
//! endpoint's challenge); the higher rank picks the connection up from the
//! endpoint's registry. A connection that arrives before its communicator
//! exists in this process (a fast peer after a split) is parked, bounded in
//! number and age, and verified when the communicator registers.

use crate::bootstrap::client::connect_retry;
use crate::bootstrap::server::{self, Accepted, Handler};
use crate::bootstrap::wire::{self, Dec, Enc, Kind};
use crate::error::{Error, Result};
use crate::log::{info_log, warn_log};
use std::collections::HashMap;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

pub(crate) type CommId = [u8; 16];
/// Data connections this process has opened or accepted (for tests and stats).
pub(crate) static CONNECTIONS_OPENED: std::sync::atomic::AtomicU64 =
    std::sync::atomic::AtomicU64::new(0);
const MAX_PARKED: usize = 4096;
const PARK_TTL: Duration = Duration::from_secs(600);

struct Parked {
    stream: TcpStream,
    challenge: [u8; 16],
    frame: wire::Frame,
    client_nonce: [u8; 16],
    peer: SocketAddr,
    since: Instant,
}

#[derive(Default)]
struct Registry {
    secrets: HashMap<CommId, [u8; 32]>,
    parked: HashMap<(CommId, u32, u32), Parked>,
    ready: HashMap<(CommId, u32, u32), TcpStream>,
}

pub(crate) struct Endpoint {
    pub port: u16,
    reg: Mutex<Registry>,
    arrived: Condvar,
}

struct ConnectMsg {
    comm: CommId,
    src: u32,
    dst: u32,
    client_nonce: [u8; 16],
}

impl ConnectMsg {
    fn encode(&self) -> Vec<u8> {
        let mut e = Enc::default();
        e.bytes(&self.comm)
            .u32(self.src)
            .u32(self.dst)
            .bytes(&self.client_nonce);
        e.0
    }
    fn decode(b: &[u8]) -> Result<ConnectMsg> {
        let mut d = Dec::new(b, "connect");
        let m = ConnectMsg {
            comm: d.array()?,
            src: d.u32()?,
            dst: d.u32()?,
            client_nonce: d.array()?,
        };
        d.finish()?;
        Ok(m)
    }
}

/// The process's endpoint, started on first use.
pub(crate) fn endpoint() -> Result<Arc<Endpoint>> {
    static EP: OnceLock<std::result::Result<Arc<Endpoint>, Error>> = OnceLock::new();
    EP.get_or_init(Endpoint::start).clone()
}

impl Endpoint {
    fn start() -> Result<Arc<Endpoint>> {
        raise_fd_limit();
        let bind = weft_contract::params::WEFT_LISTEN_ADDR
            .raw()
            .map(|a| format!("{a}:0"))
            .unwrap_or_else(|| "0.0.0.0:0".into());
        let l = TcpListener::bind(&bind)
            .map_err(|e| Error::sys(format!("peer endpoint: bind {bind}"), e))?;
        crate::sockets::set_backlog(&l, 4096);
        let port = l
            .local_addr()
            .map_err(|e| Error::sys("getsockname", e))?
            .port();
        let ep = Arc::new(Endpoint {
            port,
            reg: Mutex::new(Registry::default()),
            arrived: Condvar::new(),
        });
        let mut h = EndpointHandler { ep: ep.clone() };
        std::thread::Builder::new()
            .name("weft-endpoint".into())
            .spawn(move || server::serve(l, "peer endpoint", 1024, Duration::from_secs(10), &mut h))
            .map_err(|e| Error::sys("spawning the endpoint thread", e))?;
        info_log!("peer endpoint listening on port {port}");
        Ok(ep)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Registry> {
        self.reg.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Makes connections for `comm` acceptable (and verifies any parked ones).
    pub fn register(&self, comm: CommId, secret: [u8; 32]) {
        let mut r = self.lock();
        r.secrets.insert(comm, secret);
        let keys: Vec<_> = r.parked.keys().filter(|k| k.0 == comm).copied().collect();
        for k in keys {
            let p = r.parked.remove(&k).unwrap();
            if let Some(s) = accept_verified(p, &secret) {
                r.ready.insert(k, s);
            }
        }
        drop(r);
        self.arrived.notify_all();
    }

    pub fn unregister(&self, comm: CommId) {
        let mut r = self.lock();
        r.secrets.remove(&comm);
        r.ready.retain(|k, _| k.0 != comm);
        r.parked.retain(|k, _| k.0 != comm);
    }

    /// Waits for rank `src` to connect to us (`dst`) on `comm`.
    pub fn wait_for(
        &self,
        comm: CommId,
        src: u32,
        dst: u32,
        mut check: impl FnMut(Duration) -> Result<()>,
    ) -> Result<TcpStream> {
        let start = Instant::now();
        let mut r = self.lock();
        loop {
            if let Some(s) = r.ready.remove(&(comm, src, dst)) {
                return Ok(s);
            }
            r = self
                .arrived
                .wait_timeout(r, Duration::from_millis(100))
                .unwrap_or_else(|e| e.into_inner())
                .0;
            drop(r);
            check(start.elapsed())?;
            r = self.lock();
        }
    }
}

fn accept_verified(p: Parked, secret: &[u8; 32]) -> Option<TcpStream> {
    if let Err(e) = p.frame.verify(secret, &p.challenge) {
        server::reject(p.stream, p.peer, "peer endpoint", &e.to_string());
        return None;
    }
    let mut s = p.stream;
    let ack = wire::encode(Kind::Accept, &[], secret, &p.client_nonce);
    match wire::write_all(&mut s, &ack, Instant::now() + Duration::from_secs(5)) {
        Ok(()) => Some(s),
        Err(e) => {
            warn_log!(
                "peer endpoint: lost connection from {} while accepting: {e}",
                p.peer
            );
            None
        }
    }
}

struct EndpointHandler {
    ep: Arc<Endpoint>,
}

impl Handler for EndpointHandler {
    fn on_frame(&mut self, a: Accepted) {
        if a.frame.kind != Kind::Connect {
            let k = a.frame.kind;
            return server::reject(
                a.stream,
                a.peer,
                "peer endpoint",
                &format!("expected a connect, got {k:?}"),
            );
        }
        let m = match ConnectMsg::decode(&a.frame.payload) {
            Ok(m) => m,
            Err(e) => return server::reject(a.stream, a.peer, "peer endpoint", &e.to_string()),
        };
        let key = (m.comm, m.src, m.dst);
        let parked = Parked {
            stream: a.stream,
            challenge: a.challenge,
            frame: a.frame,
            client_nonce: m.client_nonce,
            peer: a.peer,
            since: Instant::now(),
        };
        let mut r = self.ep.lock();
        match r.secrets.get(&m.comm).copied() {
            Some(secret) => {
                drop(r);
                if let Some(s) = accept_verified(parked, &secret) {
                    self.ep.lock().ready.insert(key, s);
                    self.ep.arrived.notify_all();
                }
            }
            None => {
                if r.parked.len() >= MAX_PARKED {
                    drop(r);
                    return server::reject(
                        parked.stream,
                        parked.peer,
                        "peer endpoint",
                        "too many connections for unknown communicators",
                    );
                }
                r.parked.insert(key, parked);
            }
        }
    }

    fn tick(&mut self) -> bool {
        let mut r = self.ep.lock();
        r.parked.retain(|_, p| p.since.elapsed() < PARK_TTL);
        false
    }
}

/// Connects to `addr` as rank `src` of `comm` and waits for the acceptance.
pub(crate) fn connect(
    addr: SocketAddr,
    comm: CommId,
    secret: &[u8; 32],
    src: u32,
    dst: u32,
    deadline: Instant,
    cancelled: &dyn Fn() -> Option<Error>,
) -> Result<TcpStream> {
    let mut s = connect_retry(
        addr,
        deadline,
        &format!("rank {dst}'s endpoint"),
        true,
        cancelled,
    )?;
    let ch = wire::read_frame(&mut s, 64, deadline)?;
    if ch.kind != Kind::Challenge || ch.payload.len() != 16 {
        return Err(Error::Bootstrap(format!(
            "{addr} is not a Weft peer endpoint"
        )));
    }
    let client_nonce: [u8; 16] = crate::handshake::random()?;
    let msg = ConnectMsg {
        comm,
        src,
        dst,
        client_nonce,
    };
    wire::write_all(
        &mut s,
        &wire::encode(Kind::Connect, &msg.encode(), secret, &ch.payload),
        deadline,
    )?;
    loop {
        if let Some(e) = cancelled() {
            return Err(e);
        }
        if wire::wait_readable(&s, Duration::from_millis(100)) {
            let f = wire::read_frame(&mut s, 1024, deadline)?;
            return match f.kind {
                Kind::Accept => {
                    f.verify(secret, &client_nonce)?;
                    Ok(s)
                }
                Kind::Error => Err(Error::Bootstrap(format!(
                    "rank {dst} refused the connection: {}",
                    String::from_utf8_lossy(&f.payload)
                ))),
                k => Err(Error::Bootstrap(format!(
                    "unexpected {k:?} from rank {dst}"
                ))),
            };
        }
        if Instant::now() >= deadline {
            return Err(Error::Bootstrap(format!(
                "rank {dst} at {addr} did not accept our connection in time"
            )));
        }
    }
}

/// Prepares an established data connection: non-blocking, no Nagle, and
/// keepalive/user timeouts so a vanished host is noticed within `peer_timeout`.
pub(crate) fn tune(s: &TcpStream, peer_timeout: Duration) -> Result<()> {
    CONNECTIONS_OPENED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    crate::sockets::tune_data(s, &crate::sockets::DataOpts::between_hosts(peer_timeout))
        .map_err(|e| Error::sys("fcntl", e))
}

/// Raises the soft fd limit to the hard one (as MPI runtimes do), once.
fn raise_fd_limit() {
    let mut rl = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut rl) == 0 && rl.rlim_cur < rl.rlim_max {
            rl.rlim_cur = rl.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &rl);
        }
    }
}

/// Checks up front that `needed` more descriptors fit under the limit.
pub(crate) fn check_fd_budget(needed: usize) -> Result<()> {
    raise_fd_limit();
    let mut rl = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut rl) } != 0 {
        return Ok(());
    }
    let open = std::fs::read_dir("/proc/self/fd")
        .map(|d| d.count())
        .unwrap_or(0);
    let limit = rl.rlim_cur as usize;
    let reserve = 32;
    if open + needed + reserve > limit {
        return Err(Error::InvalidUsage(format!(
            "this communicator may need {needed} more connections, but {open} of {limit} file descriptors are in use (ulimit -n): raise the limit (ulimit -n {}) or use fewer ranks per process",
            (open + needed + reserve).next_power_of_two()
        )));
    }
    Ok(())
}

/// Liveness probe: can we still reach a peer's endpoint at all?
pub(crate) fn probe(addr: SocketAddr) -> bool {
    match TcpStream::connect_timeout(&addr, Duration::from_secs(2)) {
        Ok(_) => true,
        Err(e) => e.kind() != std::io::ErrorKind::ConnectionRefused,
    }
}
