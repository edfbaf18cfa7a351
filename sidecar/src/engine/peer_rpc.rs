//! Calls between sidecars over the peer port: the gRPC client of a peer,
//! the signature every request carries (HMAC-SHA256 of the job secret, a
//! timestamp and a nonce) and the port's check of it, which accepts each
//! signature once. Used by the heartbeats ([`super::peers`]) and the
//! recovery board's relay ([`super::board`]).

use super::Engine;
use libcomm::handshake::{self, HandshakeError, ReplayGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tonic::transport::{Channel, Endpoint};
use weft_agent::rpc::sidecar_client::SidecarClient;

/// Requests older or newer than this (clock skew included) are refused.
const MAX_SKEW_MS: u64 = 30_000;
pub const AUTH_HEADER: &str = "weft-peer-auth";
pub const TS_HEADER: &str = "weft-peer-ts";
/// A random value per request: requests signed within the same millisecond
/// (a heartbeat and a board post) differ, so the replay guard refuses only
/// true replays.
pub const NONCE_HEADER: &str = "weft-peer-nonce";

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// HMAC-SHA256(secret, "weft-peer\0" job "\0" ts "\0" nonce), hex.
pub fn peer_mac(secret: &str, job: &str, ts: u64, nonce: &str) -> String {
    handshake::tag_hex(secret.as_bytes(), &[peer_label(job, ts, nonce).as_bytes()])
}

fn peer_label(job: &str, ts: u64, nonce: &str) -> String {
    format!("weft-peer\0{job}\0{ts}\0{nonce}")
}

/// A fresh nonce (16 hex digits).
pub fn fresh_nonce() -> String {
    let mut b = [0u8; 8];
    // A failing getrandom leaves zeros: requests then collide within a
    // millisecond and the later one is refused as a replay (retried).
    let _ = getrandom::fill(&mut b);
    format!("{:016x}", u64::from_le_bytes(b))
}

/// Adds our credentials to a request to a peer.
pub fn sign<T>(e: &Engine, mut req: tonic::Request<T>) -> tonic::Request<T> {
    let ts = now_ms();
    let nonce = fresh_nonce();
    let mac = peer_mac(
        e.auth.secret.as_deref().unwrap_or(""),
        &e.auth.job,
        ts,
        &nonce,
    );
    if let (Ok(m), Ok(t), Ok(n)) = (mac.parse(), ts.to_string().parse(), nonce.parse()) {
        req.metadata_mut().insert(AUTH_HEADER, m);
        req.metadata_mut().insert(TS_HEADER, t);
        req.metadata_mut().insert(NONCE_HEADER, n);
    }
    req
}

/// Each MAC is accepted once within the skew window (a recorded request
/// cannot be replayed); the memory is bounded by the window and a cap.
static SEEN: ReplayGuard = ReplayGuard::new(MAX_SKEW_MS, 100_000);

/// Checks a peer request's timestamp and MAC: fresh, of this job's secret,
/// not seen before.
fn check_request(e: &Engine, ts: u64, nonce: &str, mac: &str) -> Result<(), HandshakeError> {
    let now = now_ms();
    handshake::check_fresh(ts, now, MAX_SKEW_MS)?;
    let secret = e.auth.secret.as_deref().unwrap_or("");
    let label = peer_label(&e.auth.job, ts, nonce);
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
    let nonce = md
        .get(NONCE_HEADER)
        .and_then(|v| v.to_str().ok())
        .filter(|n| n.len() <= 64);
    let why = match (ts, mac, nonce) {
        (Some(ts), Some(mac), Some(nonce)) => match check_request(e, ts, nonce, mac) {
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

/// A lazily connecting client of the peer sidecar at `addr` (HOST:PORT),
/// each call bounded by 1 s.
pub(super) async fn client(addr: &str) -> Option<SidecarClient<Channel>> {
    let ep = Endpoint::from_shared(format!("http://{addr}"))
        .ok()?
        .connect_timeout(Duration::from_secs(1))
        .timeout(Duration::from_secs(1));
    Some(SidecarClient::new(ep.connect_lazy()))
}
