//! Sidecar to sidecar: heartbeats over TCP gRPC, authenticated with the job
//! secret; a peer that stops answering for `--peer-timeout-ms` is a lost
//! host: every local communicator is aborted with a reason naming it. On
//! SIGTERM the peers are told (their ranks fail too).

use super::Engine;
use crate::rpc::{self, sidecar_client::SidecarClient};
use crate::seams::JobEvents;
use libcomm::handshake::{self, HandshakeError, ReplayGuard};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tonic::transport::{Channel, Endpoint};

/// Requests older or newer than this (clock skew included) are refused.
const MAX_SKEW_MS: u64 = 30_000;
pub const AUTH_HEADER: &str = "weft-peer-auth";
pub const TS_HEADER: &str = "weft-peer-ts";

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// HMAC-SHA256(secret, "weft-peer\0" job "\0" ts), hex.
pub fn peer_mac(secret: &str, job: &str, ts: u64) -> String {
    handshake::tag_hex(
        secret.as_bytes(),
        &[format!("weft-peer\0{job}\0{ts}").as_bytes()],
    )
}

/// Adds our credentials to a request to a peer.
pub fn sign<T>(e: &Engine, mut req: tonic::Request<T>) -> tonic::Request<T> {
    let ts = now_ms();
    let mac = peer_mac(e.auth.secret.as_deref().unwrap_or(""), &e.auth.job, ts);
    if let (Ok(m), Ok(t)) = (mac.parse(), ts.to_string().parse()) {
        req.metadata_mut().insert(AUTH_HEADER, m);
        req.metadata_mut().insert(TS_HEADER, t);
    }
    req
}

/// Each MAC is accepted once within the skew window (a recorded request
/// cannot be replayed); the memory is bounded by the window and a cap.
static SEEN: ReplayGuard = ReplayGuard::new(MAX_SKEW_MS, 100_000);

/// Checks a peer request's timestamp and MAC: fresh, of this job's secret,
/// not seen before.
fn check_request(e: &Engine, ts: u64, mac: &str) -> Result<(), HandshakeError> {
    let now = now_ms();
    handshake::check_fresh(ts, now, MAX_SKEW_MS)?;
    let secret = e.auth.secret.as_deref().unwrap_or("");
    let label = format!("weft-peer\0{}\0{ts}", e.auth.job);
    handshake::check_hex(secret.as_bytes(), &[label.as_bytes()], mac)?;
    SEEN.first_use(mac, ts, now)
}

/// The TCP port's interceptor: only holders of the job secret get through.
pub fn check(e: &Engine, req: &tonic::Request<()>) -> Result<(), tonic::Status> {
    let md = req.metadata();
    let ts: Option<u64> = md
        .get(TS_HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok());
    let mac = md.get(AUTH_HEADER).and_then(|v| v.to_str().ok());
    let why = match (ts, mac) {
        (Some(ts), Some(mac)) => match check_request(e, ts, mac) {
            Ok(()) => None,
            Err(HandshakeError::BadTag) => Some("wrong job secret (HMAC mismatch)"),
            Err(HandshakeError::Stale) => Some("stale or future timestamp"),
            Err(_) => Some("replayed request"),
        },
        _ => Some("no credentials"),
    };
    let info = req.extensions().get::<super::listen::ConnInfo>();
    match why {
        None => {
            // Authenticated: the connection is never evicted for a newer one.
            if let Some(i) = info {
                i.slot.hold(true);
            }
            Ok(())
        }
        Some(w) => {
            let from = info
                .and_then(|i| i.from)
                .or_else(|| req.remote_addr())
                .map_or_else(|| "?".into(), |a| a.to_string());
            e.metrics.reject("peer", "auth");
            super::log(&format!("rejected a peer request from {from}: {w}"));
            Err(tonic::Status::unauthenticated(w))
        }
    }
}

struct Peer {
    addr: String,
    client: Option<SidecarClient<Channel>>,
}

async fn client(addr: &str) -> Option<SidecarClient<Channel>> {
    let ep = Endpoint::from_shared(format!("http://{addr}"))
        .ok()?
        .connect_timeout(Duration::from_secs(1))
        .timeout(Duration::from_secs(1));
    Some(SidecarClient::new(ep.connect_lazy()))
}

/// Heartbeats every peer every `period`; declares a host lost after
/// `timeout` without an answer (`first` for a peer that never answered).
pub async fn heartbeat_loop(
    e: Arc<Engine>,
    addrs: Vec<String>,
    period: Duration,
    timeout: Duration,
    first: Duration,
) {
    let mut peers: Vec<Peer> = addrs
        .into_iter()
        .map(|addr| Peer { addr, client: None })
        .collect();
    // A heartbeat may take at most a third of the timeout: a cut link is
    // noticed within about timeout + timeout/3 of the last answer.
    let rpc_limit = (timeout / 3).clamp(Duration::from_millis(50), Duration::from_secs(1));
    loop {
        for p in peers.iter_mut() {
            if p.client.is_none() {
                p.client = client(&p.addr).await;
            }
            let Some(c) = p.client.as_mut() else { continue };
            let req = sign(
                &e,
                tonic::Request::new(rpc::HeartbeatRequest {
                    from_host: e.state.host.clone(),
                    job: e.auth.job.clone(),
                    time_unix_nano: super::state::now_nanos(),
                }),
            );
            match tokio::time::timeout(rpc_limit, c.heartbeat(req)).await {
                Ok(Ok(r)) => e.state.peer_seen(&p.addr, &r.into_inner().host),
                _ => {
                    // Silence counts from the last answer (or the first attempt, so
                    // a peer that never came is lost too).
                    if let Some(host) = e.state.peer_silent(&p.addr, timeout, first) {
                        let reason = format!(
                            "lost host {host}: its sidecar at {} has not answered for {} ms",
                            p.addr,
                            timeout.as_millis()
                        );
                        super::log(&reason);
                        e.host_lost(&reason);
                    }
                }
            }
        }
        tokio::time::sleep(period).await;
    }
}

/// Tells every peer that this host is going away (their ranks fail now
/// rather than at their peer timeout). Bounded: 1 s in all.
pub async fn tell_peers(e: &Arc<Engine>, addrs: &[String], reason: &str) {
    let calls = addrs.iter().map(|a| {
        let (e, a, reason) = (e.clone(), a.clone(), reason.to_string());
        async move {
            if let Some(mut c) = client(&a).await {
                let req = sign(
                    &e,
                    tonic::Request::new(rpc::AbortRequest {
                        comm_id: String::new(),
                        reason,
                        fail: true,
                    }),
                );
                let _ = c.abort(req).await;
            }
        }
    });
    let all = futures_join(calls.collect());
    let _ = tokio::time::timeout(Duration::from_secs(1), all).await;
}

async fn futures_join(fs: Vec<impl std::future::Future<Output = ()> + Send + 'static>) {
    let hs: Vec<_> = fs.into_iter().map(tokio::spawn).collect();
    for h in hs {
        let _ = h.await;
    }
}

/// The peers' own snapshots (not job-wide: no recursion), each bounded by 1 s;
/// a peer that does not answer is left out (its host shows as lost or unknown).
pub async fn peer_statuses(e: &Arc<Engine>) -> Vec<rpc::Status> {
    let addrs = e.peers.get().cloned().unwrap_or_default();
    let calls: Vec<_> = addrs
        .into_iter()
        .map(|a| {
            let e = e.clone();
            tokio::spawn(async move {
                let mut c = client(&a).await?;
                let req = sign(
                    &e,
                    tonic::Request::new(rpc::StatusRequest { job_wide: false }),
                );
                tokio::time::timeout(Duration::from_secs(1), c.get_status(req))
                    .await
                    .ok()?
                    .ok()
                    .map(|r| r.into_inner())
            })
        })
        .collect();
    let mut out = Vec::new();
    for h in calls {
        if let Ok(Some(s)) = h.await {
            out.push(s);
        }
    }
    out
}
