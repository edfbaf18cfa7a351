//! The network proxy: the sidecar moves its pod's ranks' bytes to and from
//! other hosts (contract with the ranks: `libcomm::sidecar_link`).
//!
//! - `ranks`: the Unix socket ranks open channels on (one connection per
//!   communicator-rank; its rings are mapped here).
//! - `hosts`: ONE authenticated TCP connection per pair of hosts (the lower
//!   address dials), shared by every rank and communicator of the pod; its
//!   receive thread writes each data frame straight into the destination
//!   rank's ring.
//! - `tx`: the progress thread: rank rings -> sockets (straight out of the
//!   ring memory), credits and pings.
//!
//! Flow control is per channel, with credits: a sender sidecar writes only
//! as much as the receiving ring has room for (the receiver grants
//! "consumed + capacity"). A data frame therefore always fits when it
//! arrives, the receive thread never waits for a rank, and one slow channel
//! cannot block the others sharing the connection (no head-of-line blocking,
//! hence no cross-channel deadlock).
//!
//! All of this runs on plain threads with its own small mutex; the status
//! path reads atomics only. The proxy knows nothing of the engine: it is
//! given its [`Config`], the metrics, and where to report a lost host
//! ([`JobEvents`]); it offers a [`ConnectionHandler`] for its connections on
//! the peer port and [`HostViews`] for the status (`crate::seams`).

pub mod hosts;
pub mod ranks;
pub mod tx;
pub mod wire;

use crate::log::log;
use crate::metrics::Metrics;
use crate::seams::{ConnectionHandler, Handover, HostView, HostViews, JobEvents, Route};
use arc_swap::ArcSwap;
use libcomm::sidecar_link::{Attached, Doorbell, InRing, OutRing};
use prometheus_client::metrics::counter::Counter;
use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};
use wire::Key;

/// Credits for channels not opened here yet, kept at most this long / many.
const PENDING_TTL: Duration = Duration::from_secs(120);
const MAX_PENDING: usize = 1 << 16;
/// A closed rank's unsent bytes are drained at most this long.
pub const DRAIN_LIMIT: Duration = Duration::from_secs(30);

pub const CONNECTING: u8 = 0;
pub const UP: u8 = 1;
pub const LOST: u8 = 2;

/// Per host connection counters (also exported to Prometheus).
#[derive(Default)]
pub struct Stats {
    pub tx_bytes: AtomicU64,
    pub rx_bytes: AtomicU64,
    pub tx_frames: AtomicU64,
    pub rx_frames: AtomicU64,
    pub connects: AtomicU64,
}

/// The connection to one peer host.
pub struct HostConn {
    pub ip: IpAddr,
    pub port: u16,
    /// The peer's host name (from the handshake, or what ranks call it).
    pub name: Mutex<String>,
    pub state: AtomicU8,
    pub sock: OnceLock<TcpStream>,
    pub lost_reason: Mutex<String>,
    pub stats: Stats,
    pub tx: Mutex<tx::TxState>,
    /// Milliseconds since the proxy started, of the last frame sent.
    pub last_tx_ms: AtomicU64,
    prom: [Counter; 4],
}

impl HostConn {
    pub fn up(&self) -> bool {
        self.state.load(Ordering::Acquire) == UP
    }
    pub fn label(&self) -> String {
        let n = self.name.lock().unwrap_or_else(|e| e.into_inner()).clone();
        if n.is_empty() {
            self.ip.to_string()
        } else {
            format!("{n} ({})", self.ip)
        }
    }
    pub fn count_tx(&self, bytes: u64) {
        self.stats.tx_bytes.fetch_add(bytes, Ordering::Relaxed);
        self.prom[0].inc_by(bytes);
    }
    pub fn count_tx_frame(&self) {
        self.stats.tx_frames.fetch_add(1, Ordering::Relaxed);
        self.prom[2].inc();
    }
    pub fn count_rx(&self, bytes: u64) {
        self.stats.rx_bytes.fetch_add(bytes, Ordering::Relaxed);
        self.stats.rx_frames.fetch_add(1, Ordering::Relaxed);
        self.prom[1].inc_by(bytes);
        self.prom[3].inc();
    }
}

/// A rank's send ring to a peer on another host.
pub struct SendChan {
    pub key: Key,
    pub conn: Arc<HostConn>,
    pub ring: Mutex<OutRing>,
    /// Credit: the stream position the receiving ring has room up to.
    pub window: AtomicU64,
    pub att: Arc<Attached>,
    /// The rank has gone: drain, then forget.
    pub closed_at: OnceLock<Instant>,
}

/// A rank's receive ring from a peer on another host.
pub struct RecvChan {
    pub key: Key,
    pub conn: Arc<HostConn>,
    pub ring: Mutex<InRing>,
    /// The last window granted to the sender.
    pub granted: AtomicU64,
    pub att: Arc<Attached>,
}

/// One opened communicator-rank: failures cross hosts through it.
pub struct RankLink {
    pub comm: [u8; 16],
    pub rank: u32,
    pub att: Arc<Attached>,
    /// The connections to the hosts of its remote peers.
    pub conns: Vec<Arc<HostConn>>,
    /// Its failure has been passed on (or came from there).
    pub told: std::sync::atomic::AtomicBool,
}

#[derive(Default)]
pub struct Reg {
    pub send: HashMap<Key, Arc<SendChan>>,
    pub recv: HashMap<Key, Arc<RecvChan>>,
    pub links: HashMap<([u8; 16], u32), Arc<RankLink>>,
    /// Ranks gone without destroying: their peers elsewhere are told once
    /// what they sent has drained (as TCP delivers before its FIN).
    pub dying: Vec<Arc<RankLink>>,
    pub pending: HashMap<Key, (u64, Instant)>,
    pub conns: HashMap<IpAddr, Arc<HostConn>>,
}

/// What the progress thread iterates (rebuilt on every change).
#[derive(Default)]
pub struct Snap {
    pub conns: Vec<(Arc<HostConn>, Vec<Arc<SendChan>>)>,
    pub recv: Vec<Arc<RecvChan>>,
    pub links: Vec<Arc<RankLink>>,
    pub dying: bool,
}

/// What the proxy is told at start.
#[derive(Debug, Clone)]
pub struct Config {
    pub job: String,
    /// The job secret (empty without one).
    pub secret: String,
    /// This host's name (sent in the handshake).
    pub host: String,
    /// Peer sidecars' addresses (`--peers`), to find a host's port.
    pub peers: Vec<String>,
    /// Our peer port (other hosts' when `peers` does not name them).
    pub own_port: u16,
    /// A host connection silent this long is lost.
    pub timeout: Duration,
}

pub struct Proxy {
    pub cfg: Config,
    pub metrics: Arc<Metrics>,
    events: Arc<dyn JobEvents>,
    pub doorbell: Doorbell,
    pub reg: Mutex<Reg>,
    pub snap: ArcSwap<Snap>,
    pub started: Instant,
    pub socket_path: std::path::PathBuf,
    /// Refusals a flood could repeat are logged at most every 10 s per source.
    pub log: crate::log::RateLog,
}

impl Proxy {
    pub fn lock(&self) -> std::sync::MutexGuard<'_, Reg> {
        self.reg.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn now_ms(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }

    /// Publishes the progress thread's view of `reg` and wakes it.
    pub fn rebuild(&self, reg: &Reg) {
        let mut conns: Vec<(Arc<HostConn>, Vec<Arc<SendChan>>)> = reg
            .conns
            .values()
            .map(|c| (c.clone(), Vec::new()))
            .collect();
        for s in reg.send.values() {
            if let Some(e) = conns.iter_mut().find(|(c, _)| Arc::ptr_eq(c, &s.conn)) {
                e.1.push(s.clone());
            }
        }
        self.snap.store(Arc::new(Snap {
            conns,
            recv: reg.recv.values().cloned().collect(),
            links: reg.links.values().cloned().collect(),
            dying: !reg.dying.is_empty(),
        }));
        self.metrics
            .proxy_channels
            .set((reg.send.len() + reg.recv.len()) as i64);
        self.doorbell.ring();
    }

    /// The connection to `ip`, made on first use (the lower address dials).
    pub fn conn(
        self: &Arc<Self>,
        reg: &mut Reg,
        ip: IpAddr,
        my_ip: IpAddr,
        name: &str,
    ) -> Arc<HostConn> {
        if let Some(c) = reg.conns.get(&ip) {
            return c.clone();
        }
        let c = self.new_conn(ip, name);
        reg.conns.insert(ip, c.clone());
        if my_ip < ip {
            hosts::dial(self.clone(), c.clone(), my_ip);
        } else {
            hosts::await_accept(self.clone(), c.clone());
        }
        c
    }

    pub fn new_conn(&self, ip: IpAddr, name: &str) -> Arc<HostConn> {
        let label = |dir: &str, what: &str| {
            use crate::metrics::ProxyLabel;
            self.metrics
                .proxy(what)
                .get_or_create(&ProxyLabel {
                    peer: ip.to_string(),
                    direction: dir.into(),
                })
                .clone()
        };
        Arc::new(HostConn {
            ip,
            port: self.port_for(ip),
            name: Mutex::new(name.chars().take(256).collect()),
            state: AtomicU8::new(CONNECTING),
            sock: OnceLock::new(),
            lost_reason: Mutex::new(String::new()),
            stats: Stats::default(),
            tx: Mutex::new(tx::TxState::default()),
            last_tx_ms: AtomicU64::new(0),
            prom: [
                label("tx", "bytes"),
                label("rx", "bytes"),
                label("tx", "frames"),
                label("rx", "frames"),
            ],
        })
    }

    /// The peer port of the host at `ip`: from `--peers`, else ours.
    fn port_for(&self, ip: IpAddr) -> u16 {
        use std::net::ToSocketAddrs;
        self.cfg
            .peers
            .iter()
            .filter_map(|p| p.to_socket_addrs().ok())
            .flatten()
            .find(|a: &SocketAddr| a.ip() == ip)
            .map(|a| a.port())
            .unwrap_or(self.cfg.own_port)
    }

    /// Tells the hosts of a rank's remote peers that it failed (`what`: 0
    /// failed, 1 aborted, 2 exited without destroying), once. Direct TCP
    /// gets this from the closing connection; shared connections need it.
    pub fn tell_failed(&self, l: &RankLink, what: u64, why: &str) {
        if l.told.swap(true, Ordering::AcqRel) {
            return;
        }
        let mut n = why.len().min(wire::MAX_REASON);
        while !why.is_char_boundary(n) {
            n -= 1;
        }
        for c in l.conns.iter().filter(|c| c.up()) {
            c.tx.lock().unwrap_or_else(|e| e.into_inner()).queue_with(
                wire::Frame {
                    kind: wire::KIND_FAIL,
                    key: (l.comm, l.rank, 0),
                    len: 0,
                    value: what,
                },
                &why.as_bytes()[..n],
            );
        }
        self.doorbell.ring();
    }

    /// A peer host says a rank of `comm` failed: fail our ranks of it.
    pub fn on_fail(&self, c: &HostConn, comm: [u8; 16], rank: u32, what: u64, why: &str) {
        let what = match what {
            1 => "aborted",
            2 => "exited without destroying the communicator",
            _ => "failed",
        };
        let why: String = why.chars().filter(|c| !c.is_control()).collect();
        let reason = if why.is_empty() {
            format!("rank {rank} on host {} {what}", c.label())
        } else {
            format!("rank {rank} on host {} {what}: {why}", c.label())
        };
        let links: Vec<Arc<RankLink>> = self
            .lock()
            .links
            .values()
            .filter(|l| l.comm == comm)
            .cloned()
            .collect();
        for l in links {
            l.told.store(true, Ordering::Release);
            l.att.fail(&reason);
        }
    }

    /// Credits that arrived before their channel was opened here.
    pub fn park_credit(&self, reg: &mut Reg, key: Key, window: u64) {
        if reg.pending.len() >= MAX_PENDING {
            reg.pending.retain(|_, (_, t)| t.elapsed() < PENDING_TTL);
        }
        if reg.pending.len() < MAX_PENDING {
            let e = reg.pending.entry(key).or_insert((0, Instant::now()));
            e.0 = e.0.max(window);
        } else {
            log("proxy: too many credits for unknown channels; dropping one");
        }
    }

    /// The connection to a host is gone: fail every rank with a channel to
    /// it (raised in their control blocks: they see it in their next wait
    /// iteration), and tell the job (which fails the rest of it here unless
    /// it outlives a lost pod).
    pub fn lose(&self, c: &Arc<HostConn>, why: &str) {
        let was = c.state.swap(LOST, Ordering::AcqRel);
        if was == LOST {
            return;
        }
        if was == UP {
            self.metrics.proxy_up.dec();
        }
        if let Some(s) = c.sock.get() {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
        let reason = format!("lost host {}: {why}", c.label());
        *c.lost_reason.lock().unwrap_or_else(|e| e.into_inner()) = reason.clone();
        log(&format!("proxy: {reason}"));
        self.metrics.proxy_lost.inc();
        let atts: Vec<Arc<Attached>> = {
            let reg = self.lock();
            reg.send
                .values()
                .filter(|s| Arc::ptr_eq(&s.conn, c))
                .map(|s| s.att.clone())
                .chain(
                    reg.recv
                        .values()
                        .filter(|r| Arc::ptr_eq(&r.conn, c))
                        .map(|r| r.att.clone()),
                )
                .collect()
        };
        for a in atts {
            a.fail(&reason);
        }
        self.events.host_connection_lost(&reason);
        self.rebuild(&self.lock());
    }
}

/// Starts the proxy: the ranks' socket (`<socket>.proxy`) and the progress
/// thread. Host connections start when ranks need them.
pub fn start(
    cfg: Config,
    socket: &std::path::Path,
    metrics: Arc<Metrics>,
    events: Arc<dyn JobEvents>,
) -> std::io::Result<Arc<Proxy>> {
    let mut path = socket.as_os_str().to_owned();
    path.push(".proxy");
    let path = std::path::PathBuf::from(path);
    let doorbell = Doorbell::create().map_err(|e| std::io::Error::other(e.to_string()))?;
    let p = Arc::new(Proxy {
        cfg,
        metrics,
        events,
        doorbell,
        reg: Mutex::new(Reg::default()),
        snap: ArcSwap::from_pointee(Snap::default()),
        started: Instant::now(),
        socket_path: path.clone(),
        log: crate::log::RateLog::default(),
    });
    let listener = libcomm::sockets::bind_unix_owner_only(&path)?;
    let p2 = p.clone();
    std::thread::Builder::new()
        .name("weft-proxy-ranks".into())
        .spawn(move || ranks::serve(p2, listener))?;
    let p2 = p.clone();
    std::thread::Builder::new()
        .name("weft-proxy-tx".into())
        .spawn(move || tx::run(p2))?;
    Ok(p)
}

/// Takes the proxy's connections from the peer port's listener.
struct PeerAcceptor(Arc<Proxy>);

impl ConnectionHandler for PeerAcceptor {
    fn handle(&self, conn: Handover) {
        hosts::accept(self.0.clone(), conn);
    }
}

/// The peer port's route for proxy connections: to `proxy`, or refused
/// when this sidecar runs none.
pub fn route(proxy: Option<&Arc<Proxy>>) -> Route {
    Route {
        name: "proxy",
        preface: *wire::PREFACE,
        handler: proxy.map(|p| Arc::new(PeerAcceptor(p.clone())) as Arc<dyn ConnectionHandler>),
    }
}

impl HostViews for Proxy {
    fn host_views(&self) -> Vec<HostView> {
        let snap = self.snap.load();
        snap.conns
            .iter()
            .map(|(c, _)| HostView {
                ip: c.ip,
                name: c.name.lock().unwrap_or_else(|e| e.into_inner()).clone(),
                state: match c.state.load(Ordering::Acquire) {
                    UP => "up",
                    LOST => "down",
                    _ => "connecting",
                },
                tx_bytes: c.stats.tx_bytes.load(Ordering::Relaxed),
                rx_bytes: c.stats.rx_bytes.load(Ordering::Relaxed),
                connects: c.stats.connects.load(Ordering::Relaxed),
            })
            .collect()
    }
}

/// Whether the drain of a closed rank's send channel is over.
pub fn drained_or_stale(s: &SendChan) -> bool {
    match s.closed_at.get() {
        None => false,
        Some(t) => {
            t.elapsed() > DRAIN_LIMIT
                || !s.conn.up()
                || s.ring
                    .try_lock()
                    .map(|r| r.available().map(|n| n == 0).unwrap_or(true))
                    .unwrap_or(false)
        }
    }
}
