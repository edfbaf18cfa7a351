//! Sidecar to sidecar: heartbeats over TCP gRPC (signed with the job secret
//! by [`super::peer_rpc`]); a peer that stops answering for
//! `--peer-timeout-ms` is a lost host: every local communicator is aborted
//! with a reason naming it (with a recovery board, its ranks are named dead
//! on it first). On SIGTERM the peers are told (their ranks fail too).

use super::Engine;
use super::peer_rpc::{client, sign};
use crate::seams::JobEvents;
use std::sync::Arc;
use std::time::Duration;
use tonic::transport::Channel;
use weft_agent::rpc::{self, sidecar_client::SidecarClient};

struct Peer {
    addr: String,
    client: Option<SidecarClient<Channel>>,
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
                Ok(Ok(r)) => {
                    let r = r.into_inner();
                    if let Some(b) = e.board.get() {
                        let before = e.comm_ids();
                        let gone = b.peer_ranks(
                            &p.addr,
                            super::board::PodRanks {
                                offset: r.rank_offset,
                                count: r.local_ranks,
                                incarnation: r.incarnation,
                            },
                        );
                        if !gone.is_empty() {
                            // Nobody said these were dead, yet a replacement
                            // answers in their place: their node was lost.
                            let reason = format!(
                                "host {} at {} answers as incarnation {}: ranks (rank, incarnation) {gone:?} are gone",
                                r.host, p.addr, r.incarnation
                            );
                            super::log(&reason);
                            e.fail_comms_named_dead(&before, &reason);
                        }
                    }
                    e.state.peer_seen(&p.addr, &r.host)
                }
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
                        // With a recovery board the lost pod's ranks are
                        // named dead first, so the ranks whose calls now
                        // fail find out who to shrink away. When its death
                        // is known already (its sidecar said so while
                        // terminating) the survivors may have shrunk: their
                        // new communicators must not be failed for it.
                        let before = e.comm_ids();
                        match e.board.get().and_then(|b| b.peer_lost(&p.addr)) {
                            Some(false) => super::log(&format!(
                                "{host}: its ranks were already known dead; nothing to abort"
                            )),
                            Some(true) => e.fail_comms_named_dead(&before, &reason),
                            None => e.host_lost(&reason),
                        }
                    }
                }
            }
        }
        tokio::time::sleep(period).await;
    }
}

/// Tells every peer that this host is going away (their ranks fail now
/// rather than at their peer timeout). Bounded: 1 s in all.
///
/// With a recovery board this pod's ranks are named dead instead (when they
/// had not all finished cleanly): the survivors' own calls fail as the
/// ranks' connections close, and a blanket abort arriving after they have
/// shrunk around this pod would fail their new communicators.
pub async fn tell_peers(e: &Arc<Engine>, addrs: &[String], reason: &str) {
    if let Some(b) = e.board.get() {
        let clean = {
            let reg = e.state.lock();
            // Processes that exited cleanly are removed from the registry;
            // an empty registry at SIGTERM is a finished pod only if some
            // process had attached (else its workload failed before it did).
            reg.procs.is_empty() && b.had_attach()
        };
        if !clean && b.own_death() {
            super::log(&format!(
                "recovery board: {reason}: this pod's ranks {:?} are named dead",
                b.me.deaths()
            ));
        }
        b.flush(addrs, Duration::from_secs(1)).await;
        return;
    }
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
