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
            merge_host_views(&mut s.hosts, p.host_views());
        }
        s
    }
}

/// Puts the proxy's view of each peer host on that host's heartbeat entry.
/// A heartbeat entry is keyed by the `--peers` address, which in a pod is a
/// DNS name (`job-1.job.ns.svc:29401`) where the proxy knows the IP: the
/// entry is the one with that IP or, failing that, with the host name the
/// peer reported to both. Only a host that heartbeats do not know gets an
/// entry of its own.
fn merge_host_views(hosts: &mut Vec<rpc::HostStatus>, views: Vec<crate::seams::HostView>) {
    for v in views {
        let ip = v.ip.to_string();
        let same_ip = |h: &rpc::HostStatus| {
            h.addr
                .rsplit_once(':')
                .map(|x| x.0.trim_matches(['[', ']']))
                == Some(&ip)
        };
        let same_name = |h: &rpc::HostStatus| !v.name.is_empty() && h.host == v.name;
        let i = match hosts
            .iter()
            .position(same_ip)
            .or_else(|| hosts.iter().position(same_name))
        {
            Some(i) => i,
            None => {
                hosts.push(rpc::HostStatus {
                    host: v.name.clone(),
                    addr: ip.clone(),
                    state: "unknown".into(),
                    ..Default::default()
                });
                hosts.len() - 1
            }
        };
        let h = &mut hosts[i];
        h.proxy = v.state.into();
        h.proxy_tx_bytes = v.tx_bytes;
        h.proxy_rx_bytes = v.rx_bytes;
        h.proxy_connects = v.connects;
    }
}

impl JobEvents for Engine {
    fn host_lost(&self, reason: &str) {
        self.state.lock().push_error(reason.to_string());
        self.state.publish(&self.state.lock());
        self.fail_comm("", reason, 0);
    }

    /// Under `ReplaceRank` (a recovery board) the job outlives a lost pod:
    /// the proxy has failed the ranks with a channel to it, the pod's own
    /// sidecar (terminating) or the heartbeats (a silent peer, `peers.rs`)
    /// name its ranks dead on the board, and the survivors shrink around
    /// them. Failing every communicator here would also fail the ones they
    /// built without it (a deleted pod's sidecar closes its connections
    /// after its ranks' deaths were known and the survivors had shrunk).
    /// Without a board a lost host fails the whole job here.
    fn host_connection_lost(&self, reason: &str) {
        if self.board.get().is_none() {
            return self.host_lost(reason);
        }
        self.state.lock().push_error(reason.to_string());
        self.state.publish(&self.state.lock());
        log(&format!(
            "{reason}: only its channels fail (the recovery board names its ranks dead)"
        ));
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::seams::HostView;

    /// An engine with one attached rank of communicator `c`; returns the
    /// queue its commands (aborts) arrive on.
    type Commands = tokio::sync::mpsc::Receiver<Result<rpc::SidecarCommand, tonic::Status>>;

    fn engine_with_a_rank() -> (Arc<Engine>, Commands) {
        let e = Engine::new("j".into(), "h".into(), None);
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        let hello = rpc::Hello {
            pid: 7,
            hostname: "h".into(),
            job: "j".into(),
            ..Default::default()
        };
        let conn = e.add_proc(hello, None, tx, None, liveness::Liveness::Unknown);
        e.on_message(
            conn,
            rpc::rank_message::Msg::Register(rpc::Register {
                comm_id: "c".into(),
                rank: 0,
                nranks: 2,
                ..Default::default()
            }),
        );
        (e, rx)
    }

    /// Issue 31: a deleted pod's sidecar closed its proxy connections after
    /// the survivors had shrunk around its ranks, and the lost connection
    /// failed their new communicator. Under ReplaceRank (a board) it fails
    /// only the proxy's channels to that host; otherwise the whole job.
    #[test]
    fn a_lost_connection_fails_the_job_only_without_a_recovery_board() {
        let (e, mut rx) = engine_with_a_rank();
        e.host_connection_lost("lost host p-1 (10.0.0.2): its sidecar closed the connection");
        assert!(
            rx.try_recv().is_ok(),
            "without a board every communicator fails"
        );

        let (e, mut rx) = engine_with_a_rank();
        let dir = std::env::temp_dir().join(format!("weft-engine-board-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let me = board::PodRanks {
            offset: 0,
            count: 1,
            incarnation: 0,
        };
        let b = board::Board::new(dir.clone(), me, 2).unwrap();
        assert!(e.board.set(Arc::new(b)).is_ok());
        e.host_connection_lost("lost host p-1 (10.0.0.2): its sidecar closed the connection");
        assert!(
            rx.try_recv().is_err(),
            "with a board no communicator is failed for it"
        );
        assert_eq!(e.status().async_errors.len(), 1, "the loss is recorded");
        let _ = std::fs::remove_dir_all(&dir);
    }

    fn heartbeat(addr: &str, host: &str) -> rpc::HostStatus {
        rpc::HostStatus {
            host: host.into(),
            addr: addr.into(),
            state: "up".into(),
            ..Default::default()
        }
    }

    fn view(ip: &str, name: &str) -> HostView {
        HostView {
            ip: ip.parse().unwrap(),
            name: name.into(),
            state: "connected",
            tx_bytes: 10,
            rx_bytes: 20,
            connects: 1,
        }
    }

    /// In a pod the peer is named by DNS; the proxy knows its IP: one entry.
    #[test]
    fn a_peer_named_by_dns_is_listed_once() {
        let mut hosts = vec![heartbeat("bench-1.bench.ns.svc:29401", "bench-1")];
        merge_host_views(&mut hosts, vec![view("10.88.0.7", "bench-1")]);
        assert_eq!(hosts.len(), 1, "{hosts:?}");
        assert_eq!(hosts[0].addr, "bench-1.bench.ns.svc:29401");
        assert_eq!(
            (hosts[0].proxy.as_str(), hosts[0].proxy_rx_bytes),
            ("connected", 20)
        );
    }

    #[test]
    fn a_peer_named_by_ip_matches_its_ip() {
        let mut hosts = vec![
            heartbeat("10.0.0.1:29401", "a"),
            heartbeat("[fd00::2]:29401", "b"),
        ];
        merge_host_views(
            &mut hosts,
            vec![view("fd00::2", "other-name"), view("10.0.0.1", "")],
        );
        assert_eq!(hosts.len(), 2, "{hosts:?}");
        assert!(hosts.iter().all(|h| h.proxy == "connected"));
    }

    /// A host only the proxy knows (no heartbeat entry yet) is listed too.
    #[test]
    fn a_host_only_the_proxy_knows_gets_its_own_entry() {
        let mut hosts = vec![heartbeat("bench-1.bench.ns.svc:29401", "bench-1")];
        merge_host_views(&mut hosts, vec![view("10.88.0.9", "bench-2")]);
        assert_eq!(hosts.len(), 2);
        assert_eq!(
            (
                hosts[1].host.as_str(),
                hosts[1].addr.as_str(),
                hosts[1].state.as_str()
            ),
            ("bench-2", "10.88.0.9", "unknown")
        );
        assert_eq!(hosts[0].proxy, "", "the other entry is untouched");
    }
}
