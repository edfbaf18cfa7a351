//! The engine's side of the recovery board (see [`super::board`]): the relay
//! that reads the pod's board and sends every peer sidecar what it has not
//! acknowledged, and what the engine does on a death or a report (fail the
//! communicators that wait on a silent peer, SIGKILL the pod's stopped ranks).

use super::board::Board;
use super::{Engine, log, peer_rpc};
use std::sync::Arc;
use std::time::Duration;

/// How often the pod's board is read for files its ranks wrote. A grow or
/// a readiness waits at most this long before it leaves the pod.
const SCAN_EVERY: Duration = Duration::from_millis(10);
/// A peer that did not take a post is retried after this long.
const RETRY_EVERY: Duration = Duration::from_millis(100);
/// A peer that refused a post's content is tried again after this long.
const REFUSED_RETRY: Duration = Duration::from_secs(5);
/// One post may take this long (a silent peer must not hold the others up:
/// each peer has its own sender).
const POST_LIMIT: Duration = Duration::from_secs(1);

/// Runs the relay of `board` to `peers` until the process ends: a reader of
/// the pod's board and one sender per peer.
pub fn start(e: Arc<Engine>, board: Arc<Board>, peers: Vec<String>) {
    let (e2, b2) = (e.clone(), board.clone());
    tokio::spawn(async move {
        loop {
            let reports = {
                let b = b2.clone();
                tokio::task::spawn_blocking(move || b.scan())
                    .await
                    .unwrap_or_default()
            };
            if !reports.is_empty() {
                e2.kill_stopped_ranks(&reports);
            }
            tokio::time::sleep(SCAN_EVERY).await;
        }
    });
    for addr in peers {
        tokio::spawn(send_loop(e.clone(), board.clone(), addr));
    }
}

/// Sends `addr` what it has not acknowledged, whenever there is something.
async fn send_loop(e: Arc<Engine>, board: Arc<Board>, addr: String) {
    let mut changes = board.subscribe();
    let mut client = None;
    loop {
        let mut failed = None;
        while let Some(out) = board.outgoing(&addr, &e.state.host) {
            if client.is_none() {
                client = peer_rpc::client(&addr).await;
            }
            let Some(c) = client.as_mut() else { break };
            let req = peer_rpc::sign(&e, tonic::Request::new(out.post.clone()));
            match tokio::time::timeout(POST_LIMIT, c.post_board(req)).await {
                Ok(Ok(r)) => {
                    if board.acknowledged(&addr, r.into_inner().boot, out) {
                        log(&format!(
                            "recovery board: the sidecar at {addr} restarted: sending it the whole board"
                        ));
                    }
                }
                Ok(Err(status)) if status.code() == tonic::Code::InvalidArgument => {
                    // It refused the post's content (a peer of another
                    // world size?): resending the same cannot help.
                    log(&format!(
                        "recovery board: {addr} refused a post: {}",
                        status.message()
                    ));
                    failed = Some(REFUSED_RETRY);
                    break;
                }
                _ => {
                    // Unreachable (a pod being replaced): whoever answers
                    // there next may be a new sidecar; it gets everything.
                    client = None;
                    board.forget_peer(&addr);
                    failed = Some(RETRY_EVERY);
                    break;
                }
            }
        }
        if let Some(pause) = failed {
            tokio::time::sleep(pause).await;
            changes.mark_unchanged();
        } else {
            let _ = tokio::time::timeout(RETRY_EVERY, changes.changed()).await;
        }
    }
}

/// Whether process `pid` (of this namespace) is stopped (`T`, `t` in
/// /proc/PID/stat).
fn is_stopped(pid: u32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    // "PID (COMM) STATE ...": COMM may hold anything, so look after the last ')'.
    stat.rsplit_once(')')
        .and_then(|(_, rest)| rest.split_whitespace().next())
        .is_some_and(|s| s == "T" || s == "t")
}

impl Engine {
    /// The communicators registered now.
    pub fn comm_ids(&self) -> Vec<String> {
        self.state.lock().comms.keys().cloned().collect()
    }

    /// Deaths nobody had said were just written to the board: fails the
    /// communicators `before` held (read before the write), so ranks that
    /// wait on a silent peer learn it now. Not the ones registered since:
    /// those were built by survivors that already read the deaths (a shrink
    /// around them), and failing them would undo the recovery.
    pub fn fail_comms_named_dead(&self, before: &[String], reason: &str) {
        {
            let mut reg = self.state.lock();
            reg.push_error(reason.to_string());
            self.state.publish(&reg);
        }
        let n: usize = before.iter().map(|id| self.fail_comm(id, reason, 0)).sum();
        log(&format!(
            "{reason}: failing {} communicator(s) registered before ({n} process command(s))",
            before.len()
        ));
    }

    /// A survivor reported a failure nobody's death explains (`report-R-I`:
    /// its operation timed out): SIGKILLs this pod's stopped ranks, whose
    /// deaths the pod's replacement then repairs. Only processes whose pid
    /// this sidecar sees (the pod shares one process namespace: the operator
    /// sets `shareProcessNamespace` under `ReplaceRank`).
    pub fn kill_stopped_ranks(&self, reports: &[String]) {
        let pids: Vec<u32> = self
            .state
            .lock()
            .procs
            .values()
            .filter(|p| p.alive)
            .filter_map(|p| p.os_pid)
            .collect();
        let stopped: Vec<u32> = pids.iter().copied().filter(|&p| is_stopped(p)).collect();
        if stopped.is_empty() {
            log(&format!(
                "recovery board: {reports:?}: none of this pod's {} rank process(es) is stopped",
                pids.len()
            ));
        }
        for pid in stopped {
            {
                log(&format!(
                    "recovery board: {reports:?}: pid {pid} of this pod is stopped: SIGKILL"
                ));
                // SAFETY: kill(2) on a pid read from SO_PEERCRED of a live
                // attach connection (the process cannot have been reaped and
                // its pid reused while its socket is open).
                unsafe {
                    libc::kill(pid as libc::pid_t, libc::SIGKILL);
                }
            }
        }
    }
}
