//! `weft sidecar`: the per-pod engine. It serves the pod's rank processes over
//! a Unix socket (gRPC `weft.v1.Sidecar`) and reads their telemetry segments
//! (`drain.rs`), holds the job state RAS reports, turns every collective
//! into Prometheus metrics and OpenTelemetry spans (every one at low rates,
//! aggregates beyond a budget), and ties the ranks to the pod's lifecycle
//! (SIGTERM aborts them; a rank is dead only when its process is:
//! `ended.rs`).

pub mod auth;
pub mod authority;
pub mod board;
pub mod board_relay;
pub mod drain;
pub mod ended;
pub mod http;
pub mod limits;
pub mod listen;
pub mod liveness;
pub mod peer_rpc;
pub mod peers;
pub mod service;
pub mod state;
pub mod telemetry;

use crate::metrics::Metrics;
use crate::seams::{HostViews, JobEvents};
use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};
use weft_agent::rpc;

pub use crate::log::log;

/// Largest gRPC message the sidecar decodes (status replies are built, not decoded).
pub const MAX_MESSAGE: usize = 1 << 20;

pub struct Engine {
    pub state: Arc<state::State>,
    pub metrics: Arc<Metrics>,
    pub auth: auth::Auth,
    pub telemetry: OnceLock<telemetry::Telemetry>,
    /// Peer sidecars' addresses (`--peers`), for job-wide status.
    pub peers: OnceLock<Vec<String>>,
    /// The network proxy's connections to other hosts (with
    /// `--peer-listen`, unless `--no-proxy`), for the status.
    pub host_views: OnceLock<Arc<dyn HostViews>>,
    /// This pod's recovery board, relayed to the peers (`WEFT_RECOVERY_DIR`
    /// set: `onRankFailure: ReplaceRank`).
    pub board: OnceLock<Arc<board::Board>>,
}

impl Engine {
    pub fn new(job: String, host: String, secret: Option<String>) -> Arc<Engine> {
        Arc::new(Engine {
            state: state::State::new(job.clone(), host),
            metrics: Arc::new(Metrics::new()),
            auth: auth::Auth { job, secret },
            telemetry: OnceLock::new(),
            peers: OnceLock::new(),
            host_views: OnceLock::new(),
            board: OnceLock::new(),
        })
    }

    /// The published snapshot with the proxy's live counters per host
    /// (atomics: no lock shared with anything).
    pub fn status(&self) -> rpc::Status {
        let mut s = (*self.state.snapshot()).clone();
        if let Some(p) = self.host_views.get() {
            for v in p.host_views() {
                let ip = v.ip.to_string();
                let i = match s.hosts.iter().position(|h| {
                    h.addr
                        .rsplit_once(':')
                        .map(|x| x.0.trim_matches(['[', ']']))
                        == Some(&ip)
                }) {
                    Some(i) => i,
                    None => {
                        s.hosts.push(rpc::HostStatus {
                            host: v.name.clone(),
                            addr: ip.clone(),
                            state: "unknown".into(),
                            ..Default::default()
                        });
                        s.hosts.len() - 1
                    }
                };
                let h = &mut s.hosts[i];
                h.proxy = v.state.into();
                h.proxy_tx_bytes = v.tx_bytes;
                h.proxy_rx_bytes = v.rx_bytes;
                h.proxy_connects = v.connects;
            }
        }
        s
    }
}

impl JobEvents for Engine {
    fn host_lost(&self, reason: &str) {
        self.state.lock().push_error(reason.to_string());
        self.state.publish(&self.state.lock());
        self.fail_comm("", reason, 0);
    }
}

/// Proxy handshakes in progress on the peer port, in all and per source
/// (each holds a thread until it ends, at most the handshake timeout).
pub const MAX_PROXY_HANDSHAKES: usize = 32;
pub const MAX_PROXY_HANDSHAKES_PER_SOURCE: usize = 8;
/// Concurrent HTTP/2 streams per gRPC connection.
pub const MAX_STREAMS: u32 = 64;
/// HTTP/2 flow-control window of a gRPC connection and of each stream
/// (see `startup::grpc_server`).
pub const CONNECTION_WINDOW: u32 = 1 << 20;
/// An unanswered HTTP/2 keepalive ping closes the connection after this
/// long (at most the idle timeout).
pub const KEEPALIVE_ACK: Duration = Duration::from_secs(20);

/// This machine's host name (the rank side's, shared).
pub use weft_agent::host_name;

/// Drains the ranks' telemetry rings until the process ends, on a thread
/// of its own (reading a full ring is a few milliseconds of work the async
/// runtime's two workers need not wait for).
pub fn start_draining(engine: &Arc<Engine>) {
    let e = Arc::downgrade(engine);
    let _ = std::thread::Builder::new()
        .name("weft-drain".into())
        .spawn(move || {
            let mut period = drain::PERIOD_MAX;
            while let Some(e) = e.upgrade() {
                let n = e.drain_all();
                drop(e);
                period = drain::next_period(n, period);
                std::thread::sleep(period);
            }
        });
}

/// Pod termination: abort every communicator of every attached process, wait
/// (bounded) until they have gone, then let the servers stop.
pub async fn terminate(engine: &Arc<Engine>, sig: &str, grace: Duration) {
    engine.state.terminating.store(true, Ordering::Relaxed);
    engine.state.publish(&engine.state.lock());
    let reason = format!(
        "the sidecar of host {} is terminating ({sig}: pod shutdown)",
        engine.state.host
    );
    // Failed rather than aborted: a call that starts after this (not only
    // one in flight) returns the remote error with this reason, not a usage error.
    let n = engine.fail_comm("", &reason, 0);
    log(&format!(
        "{sig}: aborting the communicators of {n} process(es)"
    ));
    // Ranks acknowledge by aborting (their streams stay open until they exit);
    // half the grace is enough for the abort commands to be read.
    let deadline = Instant::now() + grace / 2;
    while Instant::now() < deadline {
        let live = engine
            .state
            .lock()
            .procs
            .values()
            .filter(|p| p.alive)
            .count();
        if live == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
