//! TCP between hosts.
//!
//! One [`Endpoint`] per process: a registry served by one listener per bind
//! address (loopback for communicators whose ranks are all on this host,
//! every interface otherwise), each with the bounded, backpressured accept
//! loop of `bootstrap::server`. Connections are made lazily, on a pair's
//! first transfer: the lower rank connects and proves it holds the
//! communicator's secret (HMAC over the endpoint's challenge); the higher
//! rank picks the connection up from the endpoint's registry.
//!
//! A connection that arrives before its communicator exists in this process
//! (a fast peer after a split) is parked, but only once its MAC checks out
//! against a secret this process holds (the secret of a communicator it has
//! or is creating): a client without the job's secret is refused, logged
//! and counted before anything is kept for it, so it can never fill the
//! parking lot. Parked connections are bounded in number and age.

use crate::bootstrap::client::connect_retry;
use crate::bootstrap::ctx::CommId;
use crate::bootstrap::server::{self, Accepted, Counters, Handler, Limits};
use crate::bootstrap::wire::{self, Dec, Enc, Kind};
use crate::error::{Error, Result};
use crate::log::{info_log, warn_log};
use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Condvar, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

/// Data connections this process has opened or accepted (for tests and stats).
pub(crate) static CONNECTIONS_OPENED: std::sync::atomic::AtomicU64 =
    std::sync::atomic::AtomicU64::new(0);
/// Authenticated connections waiting for their communicator, at most.
pub(crate) const MAX_PARKED: usize = 1024;
/// How long an authenticated connection waits for its communicator (the
/// other rank registers it right after the split or rendezvous that made it).
pub(crate) const PARK_TTL: Duration = Duration::from_secs(60);
/// Total time a client has to answer the endpoint's challenge (a peer
/// answers within a round trip).
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// Secrets of communicators this process created or is creating, kept for
/// authenticating early connections (one per unique id, so a handful).
const MAX_TRUSTED: usize = 64;

/// What the peer endpoint of this process has seen.
pub(crate) static COUNTERS: Counters = Counters::new();

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
    /// Secrets of communicators being created here (most recent last).
    trusted: Vec<[u8; 32]>,
    parked: HashMap<(CommId, u32, u32), Parked>,
    ready: HashMap<(CommId, u32, u32), TcpStream>,
    /// Where a peer's failure notice for a communicator is raised.
    faults: HashMap<CommId, Weak<dyn NoticeSink>>,
}

impl Registry {
    /// Whether `f` was made with a secret this process holds.
    fn authentic(&self, f: &wire::Frame, challenge: &[u8]) -> bool {
        self.trusted
            .iter()
            .rev()
            .chain(self.secrets.values())
            .any(|s| f.verify(s, challenge).is_ok())
    }
}

pub(crate) struct Endpoint {
    reg: Mutex<Registry>,
    arrived: Condvar,
    /// Port of the listener for each bind address.
    listeners: Mutex<HashMap<IpAddr, u16>>,
}

/// What a rank sends an endpoint to open a data connection (MAC'd).
pub(crate) struct ConnectMsg {
    pub comm: CommId,
    pub src: u32,
    pub dst: u32,
    pub client_nonce: [u8; 16],
}

impl ConnectMsg {
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut e = Enc::default();
        e.bytes(&self.comm)
            .u32(self.src)
            .u32(self.dst)
            .bytes(&self.client_nonce);
        e.0
    }
    pub(crate) fn decode(b: &[u8]) -> Result<ConnectMsg> {
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

/// The process's endpoint registry (listeners start on demand, see
/// [`Endpoint::listen_for`]).
pub(crate) fn endpoint() -> Result<Arc<Endpoint>> {
    static EP: OnceLock<Arc<Endpoint>> = OnceLock::new();
    Ok(EP
        .get_or_init(|| {
            raise_fd_limit();
            Arc::new(Endpoint {
                reg: Mutex::new(Registry::default()),
                arrived: Condvar::new(),
                listeners: Mutex::new(HashMap::new()),
            })
        })
        .clone())
}

/// The address the peer endpoint binds for a communicator whose bootstrap
/// root is `root`: `WEFT_LISTEN_ADDR` when set; loopback when the root is
/// a loopback address given as such (every rank reached it there, so every
/// rank is on this host); every interface otherwise.
pub(crate) fn bind_ip(root: SocketAddr, root_named: bool) -> IpAddr {
    if let Some(ip) = weft_contract::params::WEFT_LISTEN_ADDR
        .raw()
        .and_then(|a| a.parse::<IpAddr>().ok())
    {
        return ip;
    }
    match root.ip() {
        // A host name that resolves to loopback here may not elsewhere.
        IpAddr::V4(_) if root_named => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        IpAddr::V6(_) if root_named => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
        IpAddr::V4(v4) if v4.is_loopback() => IpAddr::V4(Ipv4Addr::LOCALHOST),
        IpAddr::V6(v6) if v6.is_loopback() => IpAddr::V6(Ipv6Addr::LOCALHOST),
        IpAddr::V6(v6) if v6.to_ipv4_mapped().is_some_and(|v4| v4.is_loopback()) => {
            IpAddr::V4(Ipv4Addr::LOCALHOST)
        }
        IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
    }
}

impl Endpoint {
    /// The port of the listener bound to `ip`, started on first use.
    pub fn listen_for(self: &Arc<Self>, ip: IpAddr) -> Result<u16> {
        let mut ls = self.listeners.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(&port) = ls.get(&ip) {
            return Ok(port);
        }
        let bind = SocketAddr::new(ip, 0);
        let l = TcpListener::bind(bind)
            .map_err(|e| Error::sys(format!("peer endpoint: bind {bind}"), e))?;
        crate::sys::sockets::set_backlog(&l, 4096);
        let port = l
            .local_addr()
            .map_err(|e| Error::sys("getsockname", e))?
            .port();
        let mut h = EndpointHandler { ep: self.clone() };
        std::thread::Builder::new()
            .name("weft-endpoint".into())
            .spawn(move || {
                server::serve(
                    l,
                    "peer endpoint",
                    Limits::new(HANDSHAKE_TIMEOUT),
                    &COUNTERS,
                    &mut h,
                )
            })
            .map_err(|e| Error::sys("spawning the endpoint thread", e))?;
        info_log!("peer endpoint listening on {ip} port {port}");
        ls.insert(ip, port);
        Ok(port)
    }

    /// Ports this process listens on, by bind address.
    pub fn ports(&self) -> Vec<(IpAddr, u16)> {
        let ls = self.listeners.lock().unwrap_or_else(|e| e.into_inner());
        ls.iter().map(|(ip, p)| (*ip, *p)).collect()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Registry> {
        self.reg.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Connections made with `secret` may be parked before their
    /// communicator registers (called before a rendezvous that uses it).
    pub fn trust(&self, secret: [u8; 32]) {
        let mut r = self.lock();
        r.trusted.retain(|s| *s != secret);
        if r.trusted.len() >= MAX_TRUSTED {
            r.trusted.remove(0);
        }
        r.trusted.push(secret);
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

    /// Failure notices for `comm` (from its remote peers) go to `sink`.
    pub fn watch_failures(&self, comm: CommId, sink: Weak<dyn NoticeSink>) {
        self.lock().faults.insert(comm, sink);
    }

    pub fn unregister(&self, comm: CommId) {
        let mut r = self.lock();
        r.faults.remove(&comm);
        r.secrets.remove(&comm);
        r.ready.retain(|k, _| k.0 != comm);
        r.parked.retain(|k, _| k.0 != comm);
    }

    /// Connections parked now (authenticated, waiting for their communicator).
    pub fn parked(&self) -> usize {
        self.lock().parked.len()
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

fn unauthenticated(p: Parked) {
    COUNTERS.unauthenticated.fetch_add(1, Relaxed);
    server::reject(
        p.stream,
        p.peer,
        "peer endpoint",
        "authentication failed: the peer does not hold this job's secret (wrong job, wrong WEFT_JOB_SECRET, or a stray client)",
    );
}

fn accept_verified(p: Parked, secret: &[u8; 32]) -> Option<TcpStream> {
    if p.frame.verify(secret, &p.challenge).is_err() {
        unauthenticated(p);
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

impl EndpointHandler {
    /// A remote peer's failure notice: authenticated with the
    /// communicator's secret, raised in its fault domain, then closed.
    fn on_fail(&mut self, a: Accepted) {
        let refuse = |a: Accepted, why: &str| {
            COUNTERS.refused.fetch_add(1, Relaxed);
            server::reject(a.stream, a.peer, "peer endpoint", why)
        };
        let m = match FailMsg::decode(&a.frame.payload) {
            Ok(m) => m,
            Err(e) => return refuse(a, &e.to_string()),
        };
        let (secret, fault) = {
            let r = self.ep.lock();
            (
                r.secrets.get(&m.comm).copied(),
                r.faults.get(&m.comm).and_then(|w| w.upgrade()),
            )
        };
        let Some(secret) = secret else {
            return refuse(a, "a failure notice for a communicator not here");
        };
        if a.frame.verify(&secret, &a.challenge).is_err() {
            COUNTERS.unauthenticated.fetch_add(1, Relaxed);
            return server::reject(
                a.stream,
                a.peer,
                "peer endpoint",
                "a failure notice without the communicator's secret",
            );
        }
        if let Some(f) = fault {
            f.learn(m.origin as usize, m.kind, &m.reason);
        }
    }
}

/// Where the endpoint hands a remote peer's failure notice, once its MAC
/// checked out: the communicator's failure domain (`progress/fault.rs`,
/// which builds on this module and is never named here).
pub(crate) trait NoticeSink: Send + Sync {
    /// Rank `origin` raised a failure of `kind` for `reason`.
    fn learn(&self, origin: usize, kind: u32, reason: &str);
}

/// Why a communicator failed, as its origin tells remote peers.
pub(crate) struct FailMsg {
    pub comm: CommId,
    pub origin: u32,
    pub kind: u32,
    pub reason: String,
}

/// At most this much of a reason travels (the control block keeps 255 bytes).
const FAIL_REASON_MAX: usize = 512;

impl FailMsg {
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut end = self.reason.len().min(FAIL_REASON_MAX);
        while !self.reason.is_char_boundary(end) {
            end -= 1;
        }
        let mut e = Enc::default();
        e.bytes(&self.comm)
            .u32(self.origin)
            .u32(self.kind)
            .str(&self.reason[..end]);
        e.0
    }
    pub(crate) fn decode(b: &[u8]) -> Result<FailMsg> {
        let mut d = Dec::new(b, "failure notice");
        let m = FailMsg {
            comm: d.array()?,
            origin: d.u32()?,
            kind: d.u32()?,
            reason: d.str(FAIL_REASON_MAX)?,
        };
        d.finish()?;
        Ok(m)
    }
}

/// How a rank tells its remote peers why a communicator failed: one short,
/// authenticated connection to each peer's endpoint, all at once, bounded by
/// [`NOTICE_DEADLINE`] in all. Sent before the rank's connections close (so
/// a peer that sees the close already knows why) and before `raise`
/// returns (a process that exits right after its error must not take the
/// notices with it).
pub(crate) struct FailNotify {
    pub comm: CommId,
    pub secret: [u8; 32],
    /// Endpoints of the ranks reached over TCP.
    pub peers: Vec<SocketAddr>,
}

/// All notices of one failure are sent within this (a lost host's endpoint
/// never answers: it costs the failure's spread this much at most).
const NOTICE_DEADLINE: Duration = Duration::from_millis(250);
/// Notices in flight at once.
const NOTICE_PARALLEL: usize = 16;

impl FailNotify {
    pub(crate) fn send(&self, origin: u32, kind: u32, reason: &str) {
        if self.peers.is_empty() {
            return;
        }
        let msg = FailMsg {
            comm: self.comm,
            origin,
            kind,
            reason: reason.to_string(),
        }
        .encode();
        let deadline = Instant::now() + NOTICE_DEADLINE;
        let next = std::sync::atomic::AtomicUsize::new(0);
        std::thread::scope(|s| {
            for _ in 0..NOTICE_PARALLEL.min(self.peers.len()) {
                s.spawn(|| {
                    while let Some(&addr) = self.peers.get(next.fetch_add(1, Relaxed)) {
                        let _ = send_notice(addr, &msg, &self.secret, deadline);
                    }
                });
            }
        });
    }
}

fn send_notice(addr: SocketAddr, msg: &[u8], secret: &[u8; 32], deadline: Instant) -> Result<()> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Ok(());
    }
    let mut s = TcpStream::connect_timeout(&addr, left)
        .map_err(|e| Error::Bootstrap(format!("failure notice to {addr}: {e}")))?;
    let ch = wire::read_frame(&mut s, 64, deadline)?;
    if ch.kind != Kind::Challenge {
        return Ok(());
    }
    wire::write_all(
        &mut s,
        &wire::encode(Kind::Fail, msg, secret, &ch.payload),
        deadline,
    )
}

impl Handler for EndpointHandler {
    fn on_frame(&mut self, a: Accepted) {
        if a.frame.kind == Kind::Fail {
            return self.on_fail(a);
        }
        if a.frame.kind != Kind::Connect {
            let k = a.frame.kind;
            COUNTERS.refused.fetch_add(1, Relaxed);
            return server::reject(
                a.stream,
                a.peer,
                "peer endpoint",
                &format!("expected a connect, got {k:?}"),
            );
        }
        let m = match ConnectMsg::decode(&a.frame.payload) {
            Ok(m) => m,
            Err(e) => {
                COUNTERS.refused.fetch_add(1, Relaxed);
                return server::reject(a.stream, a.peer, "peer endpoint", &e.to_string());
            }
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
                // Authenticate before keeping anything: without one of our
                // secrets a connect for an unknown communicator is refused.
                if !r.authentic(&parked.frame, &parked.challenge) {
                    drop(r);
                    return unauthenticated(parked);
                }
                if r.parked.len() >= MAX_PARKED {
                    drop(r);
                    COUNTERS.refused.fetch_add(1, Relaxed);
                    return server::reject(
                        parked.stream,
                        parked.peer,
                        "peer endpoint",
                        "too many connections for communicators not created here yet",
                    );
                }
                r.parked.insert(key, parked);
            }
        }
    }

    fn tick(&mut self) -> bool {
        let mut r = self.ep.lock();
        let before = r.parked.len();
        r.parked.retain(|_, p| p.since.elapsed() < PARK_TTL);
        let expired = before - r.parked.len();
        if expired > 0 {
            warn_log!(
                "peer endpoint: {expired} connection(s) for a communicator never created here expired after {} s",
                PARK_TTL.as_secs()
            );
        }
        false
    }
}

/// What this process's peer endpoint and bootstrap roots have refused so
/// far, and what the endpoint holds now (for tests, RAS and monitoring).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ListenerStats {
    /// Peer endpoint ports, by bind address.
    pub endpoint_ports: Vec<(IpAddr, u16)>,
    pub endpoint_accepted: u64,
    /// Refused before authentication (garbage, oversized, timed out).
    pub endpoint_refused: u64,
    /// Refused because the MAC matched no secret of this process.
    pub endpoint_unauthenticated: u64,
    /// Silent unauthenticated connections dropped to stay under the caps.
    pub endpoint_evicted: u64,
    /// Authenticated connections waiting for their communicator now.
    pub endpoint_parked: usize,
    pub root_refused: u64,
    pub root_unauthenticated: u64,
    pub root_evicted: u64,
}

pub(crate) fn listener_stats() -> ListenerStats {
    let ep = endpoint().ok();
    let root = &crate::bootstrap::root::COUNTERS;
    ListenerStats {
        endpoint_ports: ep.as_ref().map(|e| e.ports()).unwrap_or_default(),
        endpoint_accepted: COUNTERS.accepted.load(Relaxed),
        endpoint_refused: COUNTERS.refused.load(Relaxed),
        endpoint_unauthenticated: COUNTERS.unauthenticated.load(Relaxed),
        endpoint_evicted: COUNTERS.evicted.load(Relaxed),
        endpoint_parked: ep.map(|e| e.parked()).unwrap_or(0),
        root_refused: root.refused.load(Relaxed),
        root_unauthenticated: root.unauthenticated.load(Relaxed),
        root_evicted: root.evicted.load(Relaxed),
    }
}

/// Connects to `addr` as rank `src` of `comm` and waits for the acceptance
/// (again, a few times, if the endpoint dropped the connection before it
/// read our connect: an accept loop at its cap does that).
pub(crate) fn connect(
    addr: SocketAddr,
    comm: CommId,
    secret: &[u8; 32],
    src: u32,
    dst: u32,
    deadline: Instant,
    cancelled: &dyn Fn() -> Option<Error>,
) -> Result<TcpStream> {
    use crate::bootstrap::client::{DROP_WINDOW, HANDSHAKE_RETRIES, dropped};
    for tries in 0.. {
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
        let client_nonce: [u8; 16] = crate::bootstrap::handshake::random()?;
        let msg = ConnectMsg {
            comm,
            src,
            dst,
            client_nonce,
        };
        let sent = Instant::now();
        let wrote = wire::write_all(
            &mut s,
            &wire::encode(Kind::Connect, &msg.encode(), secret, &ch.payload),
            deadline,
        );
        let mut why = wrote.err().map(|e| e.to_string());
        while why.is_none() {
            if let Some(e) = cancelled() {
                return Err(e);
            }
            if wire::wait_readable(&s, Duration::from_millis(100)) {
                if sent.elapsed() < DROP_WINDOW {
                    why = dropped(&s);
                    if why.is_some() {
                        break;
                    }
                }
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
        let why = why.unwrap_or_default();
        if tries >= HANDSHAKE_RETRIES {
            return Err(Error::Bootstrap(format!(
                "rank {dst}'s endpoint at {addr} dropped our connection before reading it ({why})"
            )));
        }
        info_log!(
            "rank {dst}'s endpoint at {addr} dropped our connection ({why}); connecting again"
        );
        std::thread::sleep(Duration::from_millis(10 << tries));
    }
    unreachable!()
}

/// Prepares an established data connection: non-blocking, no Nagle, and
/// keepalive/user timeouts so a vanished host is noticed within `peer_timeout`.
pub(crate) fn tune(s: &TcpStream, peer_timeout: Duration) -> Result<()> {
    CONNECTIONS_OPENED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    crate::sys::sockets::tune_data(
        s,
        &crate::sys::sockets::DataOpts::between_hosts(peer_timeout),
    )
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

/// Whether a process still listens at `addr`: it accepts within `timeout`.
/// Refused (the process is gone) and no answer (the host is gone) are both
/// false. The probe sends nothing and closes at once.
pub(crate) fn answers(addr: SocketAddr, timeout: Duration) -> bool {
    TcpStream::connect_timeout(&addr, timeout).is_ok()
}

#[cfg(test)]
mod fail_msg_tests {
    use super::FailMsg;

    #[test]
    fn a_failure_notice_round_trips_and_caps_its_reason() {
        let m = FailMsg {
            comm: [5; 16],
            origin: 7,
            kind: 2,
            reason: "é".repeat(400),
        };
        let d = FailMsg::decode(&m.encode()).unwrap();
        assert_eq!((d.comm, d.origin, d.kind), ([5; 16], 7, 2));
        assert!(d.reason.len() <= super::FAIL_REASON_MAX && d.reason.starts_with("éé"));
        assert!(FailMsg::decode(&m.encode()[..20]).is_err());
    }
}
