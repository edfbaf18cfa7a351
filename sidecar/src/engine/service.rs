//! The gRPC service (`weft.v1.Sidecar`): rank processes attach, register
//! communicators and stream events; tools read status and abort.

use super::Engine;
use super::drain::ProcRing;
use super::liveness::Liveness;
use super::state::{MAX_PENDING, Proc, RankEntry, Registry, State, now_nanos};
use super::telemetry::SpanRecord;
use std::pin::Pin;
use std::sync::Arc;
use tokio::sync::mpsc;
use tokio_stream::Stream;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};
use weft_agent::export::Export;
use weft_agent::ring::Segment;
use weft_agent::rpc::{self, rank_message::Msg, sidecar_server::Sidecar};
use weft_agent::spans::Origin;

/// Commands queued per process before the sidecar considers it stuck.
const CMD_QUEUE: usize = 64;

/// Longest strings accepted in messages (ids, op names, error texts): a
/// bounded decoder is not enough when we keep what we decode.
const MAX_STR: usize = 4096;

pub struct Service {
    pub engine: Arc<Engine>,
    /// Serving the peer port (other sidecars, authenticated by the job
    /// secret) rather than the pod's Unix socket.
    pub peer_port: bool,
}

fn clip(mut s: String) -> String {
    if s.len() > MAX_STR {
        let mut n = MAX_STR;
        while !s.is_char_boundary(n) {
            n -= 1;
        }
        s.truncate(n);
    }
    s
}

fn abort_cmd(comm: &str, reason: &str, fail: bool) -> rpc::SidecarCommand {
    rpc::SidecarCommand {
        cmd: Some(rpc::sidecar_command::Cmd::Abort(rpc::AbortCommand {
            comm_id: comm.into(),
            reason: reason.into(),
            fail,
        })),
    }
}

impl Engine {
    /// Sends an abort for `comm` (all when empty) to every live process but `but`.
    pub fn abort_comm(&self, comm: &str, reason: &str, but: u64) -> usize {
        self.command(comm, reason, but, false)
    }

    /// Like [`abort_comm`](Self::abort_comm), but the ranks' calls fail with
    /// an error carrying `reason` (a lost host, a dead rank).
    pub fn fail_comm(&self, comm: &str, reason: &str, but: u64) -> usize {
        self.command(comm, reason, but, true)
    }

    fn command(&self, comm: &str, reason: &str, but: u64, fail: bool) -> usize {
        let cmd = abort_cmd(comm, reason, fail);
        let mut reg = self.state.lock();
        let conns = State::targets(&reg, comm, but);
        for c in &conns {
            let Some(p) = reg.procs.get_mut(c) else {
                continue;
            };
            if p.disconnected {
                // Sent when it attaches again.
                if p.pending.len() < MAX_PENDING {
                    p.pending.push(cmd.clone());
                }
            } else {
                // Never wait on a stuck process: its queue full means it is not reading.
                let _ = p.tx.try_send(Ok(cmd.clone()));
            }
        }
        conns.len()
    }

    /// Registers an attached process, with its telemetry segment and how
    /// to tell whether it lives; returns its connection id. A process
    /// attaching again (its stream broke) is recognised by its segment and
    /// keeps its communicators.
    pub fn add_proc(
        &self,
        hello: rpc::Hello,
        os_pid: Option<u32>,
        tx: super::state::CmdTx,
        seg: Option<Arc<Segment>>,
        liveness: Liveness,
    ) -> u64 {
        let conn = self.state.conn_id();
        let mut reg = self.state.lock();
        let again = seg.as_ref().and_then(|s| {
            reg.procs
                .iter()
                .find(|(_, p)| p.alive && p.ring.as_ref().is_some_and(|r| r.seg.same_file(s)))
                .map(|(c, _)| *c)
        });
        if let Some(old) = again {
            if reattach(&mut reg, old, conn, tx) {
                // Its old stream's end will find it gone: count the break here.
                self.metrics.stream_breaks.inc();
            }
            self.state.publish(&reg);
            return conn;
        }
        let host = clip(hello.hostname);
        let ring = seg.map(|s| {
            Arc::new(ProcRing::new(
                s,
                Origin {
                    job: clip(hello.job),
                    pid: hello.pid,
                    host: host.clone(),
                },
            ))
        });
        reg.procs.insert(
            conn,
            Proc {
                pid: hello.pid,
                os_pid,
                host,
                gpus: hello.gpus.into_iter().take(64).map(clip).collect(),
                alive: true,
                tx,
                dropped: 0,
                ring_dropped: 0,
                registered: 0,
                ring,
                liveness: Arc::new(liveness),
                disconnected: false,
                pending: Vec::new(),
                reattached: Arc::default(),
            },
        );
        self.state.publish(&reg);
        self.metrics
            .peers_up
            .set(reg.procs.values().filter(|p| p.alive).count() as i64);
        if let Some(b) = self.board.get() {
            b.attached();
        }
        conn
    }

    /// One message of connection `conn`. Before a lifecycle message, the
    /// process's ring is drained: the spans of a communicator's operations
    /// come before its end.
    pub fn on_message(&self, conn: u64, msg: Msg) {
        if !matches!(msg, Msg::Hello(_) | Msg::Op(_)) {
            self.drain_conn(conn, false);
        }
        let st = &self.state;
        let mut reg = st.lock();
        let ring = reg.procs.get(&conn).and_then(|p| p.ring.clone());
        match msg {
            Msg::Hello(_) => {} // only valid first; handled by attach
            Msg::Register(r) => {
                let (pid, host) = reg
                    .procs
                    .get(&conn)
                    .map(|p| (p.pid, p.host.clone()))
                    .unwrap_or_default();
                let label = clip(r.comm_id);
                let c = reg.comms.entry(label.clone()).or_default();
                c.nranks = r.nranks;
                // Registered again after a reconnection: keep its progress.
                let again = c.ranks.get(&r.rank).is_some_and(|e| e.conn == conn);
                if !again {
                    c.ranks.insert(
                        r.rank,
                        RankEntry {
                            conn,
                            pid,
                            host,
                            state: "running".into(),
                            ..Default::default()
                        },
                    );
                    if let Some(p) = reg.procs.get_mut(&conn) {
                        p.registered += 1;
                    }
                }
                st.publish(&reg);
                drop(reg);
                if let Some(ring) = ring {
                    ring.register(&label, r.rank, r.slot, r.slot_generation);
                }
                return;
            }
            Msg::Deregister(d) => {
                if let Some(ring) = &ring {
                    ring.deregister(&d.comm_id, d.rank);
                }
                if let Some(c) = reg.comms.get_mut(&d.comm_id) {
                    if let Some(e) = c.ranks.get_mut(&d.rank) {
                        e.state = "finalizing".into();
                    }
                    // Gone from the registry once every rank of ours has left.
                    if c.ranks.values().all(|e| e.state == "finalizing") {
                        reg.comms.remove(&d.comm_id);
                    }
                }
            }
            Msg::State(s) => {
                if let Some(e) = reg
                    .comms
                    .get_mut(&s.comm_id)
                    .and_then(|c| c.ranks.get_mut(&s.rank))
                {
                    e.state = clip(s.state);
                }
            }
            Msg::Error(e) => {
                let host = reg.procs.get(&conn).map(|p| (p.pid, p.host.clone()));
                let (pid, h) = host.unwrap_or_default();
                reg.push_error(clip(format!(
                    "comm {} rank {} (pid {pid} on {h}): {}",
                    e.comm_id, e.rank, e.error
                )));
            }
            Msg::Op(ev) => {
                // From an agent older than the telemetry segment.
                let (pid, host) = reg
                    .procs
                    .get(&conn)
                    .map(|p| (p.pid, p.host.clone()))
                    .unwrap_or_default();
                let Some(e) = reg
                    .comms
                    .get_mut(&ev.comm_id)
                    .and_then(|c| c.ranks.get_mut(&ev.rank))
                else {
                    return; // an event for a communicator never registered: ignore
                };
                let op = clip(ev.op);
                if ev.phase == rpc::Phase::Started as i32 {
                    e.started_seq = ev.seq;
                    e.started_op = op;
                    e.started_at = ev.time_unix_nano;
                } else {
                    let start = if e.started_seq == ev.seq {
                        e.started_at
                    } else {
                        ev.time_unix_nano
                    };
                    e.completed_seq = ev.seq;
                    e.completed_op = op.clone();
                    e.outcome = clip(ev.outcome.clone());
                    drop(reg);
                    self.completed(SpanRecord {
                        job: clip(ev.job),
                        comm_id: clip(ev.comm_id),
                        rank: ev.rank,
                        nranks: ev.nranks,
                        op,
                        dtype: clip(ev.dtype),
                        bytes: ev.bytes,
                        algo: clip(ev.algo),
                        seq: ev.seq,
                        outcome: clip(ev.outcome),
                        group: ev.group,
                        pid,
                        host,
                        start_ns: start,
                        end_ns: ev.time_unix_nano,
                        export: Export::Span.label(),
                        count: 1,
                        aggregate: None,
                    });
                    return st.touch();
                }
                // Operation events are the hot path: published coalesced.
                return st.touch();
            }
        }
        st.publish(&reg);
    }

    fn completed(&self, r: SpanRecord) {
        let m = &self.metrics;
        let l = crate::metrics::OpLabel { op: r.op.clone() };
        m.collectives.get_or_create(&l).inc();
        m.bytes.get_or_create(&l).inc_by(r.bytes);
        if r.outcome != "ok" {
            m.errors.get_or_create(&l).inc();
        }
        m.latency
            .get_or_create(&l)
            .observe(r.end_ns.saturating_sub(r.start_ns) as f64 / 1e9);
        if let Some(t) = self.telemetry.get() {
            t.record(r);
        }
    }
}

/// Moves the registrations of process `old` (its stream broke) to its new
/// connection `new`, and sends it what was kept for it meanwhile. Returns
/// whether the break is news (the old stream's end not yet handled).
fn reattach(reg: &mut Registry, old: u64, new: u64, tx: super::state::CmdTx) -> bool {
    let Some(mut p) = reg.procs.remove(&old) else {
        return false;
    };
    let news = !p.disconnected;
    p.tx = tx;
    p.disconnected = false;
    for cmd in p.pending.drain(..) {
        let _ = p.tx.try_send(Ok(cmd));
    }
    for c in reg.comms.values_mut() {
        for e in c.ranks.values_mut() {
            if e.conn == old {
                e.conn = new;
            }
        }
    }
    p.reattached.notify_waiters();
    super::log(&format!(
        "pid {} on host {} attached again (connection {old} -> {new})",
        p.pid, p.host
    ));
    reg.procs.insert(new, p);
    news
}

/// What an attach connection passed: its telemetry segment (a memory
/// file, checked before it is mapped) and its lifeline (a pipe); anything
/// else, or a segment that fails the checks, refuses the attach.
fn passed_parts(
    fds: Vec<std::os::fd::OwnedFd>,
    os_pid: Option<u32>,
) -> Result<(Option<Arc<Segment>>, Liveness), String> {
    let (mut seg, mut lifeline) = (None, None);
    for fd in fds {
        // SAFETY: fstat into a zeroed struct we own.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        let kind = if unsafe { libc::fstat(std::os::fd::AsRawFd::as_raw_fd(&fd), &mut st) } == 0 {
            st.st_mode & libc::S_IFMT
        } else {
            0
        };
        match kind {
            libc::S_IFREG if seg.is_none() => {
                let s = Segment::from_fd(fd).map_err(|e| format!("telemetry ring refused: {e}"))?;
                seg = Some(Arc::new(s));
            }
            libc::S_IFIFO if lifeline.is_none() => lifeline = Some(fd),
            _ => return Err("the connection passed a descriptor that is neither a telemetry ring nor a lifeline".into()),
        }
    }
    Ok((seg, Liveness::new(os_pid, lifeline)?))
}

type CmdStream = Pin<Box<dyn Stream<Item = Result<rpc::SidecarCommand, Status>> + Send>>;

#[tonic::async_trait]
impl Sidecar for Service {
    type AttachStream = CmdStream;

    async fn attach(
        &self,
        req: Request<Streaming<rpc::RankMessage>>,
    ) -> Result<Response<CmdStream>, Status> {
        let info = req.extensions().get::<super::listen::ConnInfo>().cloned();
        let slot = info.as_ref().map(|c| c.slot.clone());
        let os_pid = info.as_ref().and_then(|c| c.peer_pid);
        // What the connection passed with its first bytes (taken: once).
        let passed = info.map(|c| c.take_passed()).unwrap_or_default();
        let mut inbound = req.into_inner();
        let engine = self.engine.clone();
        let hello = match inbound.message().await {
            Ok(Some(rpc::RankMessage {
                msg: Some(Msg::Hello(h)),
            })) => h,
            Ok(_) => {
                engine.metrics.reject("socket", "no-hello");
                super::log("rejected an attach: the first message was not Hello");
                return Err(Status::invalid_argument("first message must be Hello"));
            }
            Err(e) => {
                engine.metrics.reject("socket", "bad-message");
                super::log(&format!("rejected an attach: {e}"));
                return Err(e);
            }
        };
        if let Err(why) = engine.auth.check_hello(&hello) {
            engine.metrics.reject("socket", "auth");
            super::log(&format!(
                "rejected an attach from pid {} ({}): {why}",
                hello.pid, hello.hostname
            ));
            return Err(Status::unauthenticated(why.to_string()));
        }
        if engine
            .state
            .terminating
            .load(std::sync::atomic::Ordering::Relaxed)
        {
            return Err(Status::unavailable("the sidecar is terminating"));
        }
        let (seg, liveness) = match passed_parts(passed, os_pid) {
            Ok(x) => x,
            Err(why) => {
                engine.metrics.reject("socket", "ring");
                super::log(&format!(
                    "rejected an attach from pid {} ({}): {why}",
                    hello.pid, hello.hostname
                ));
                return Err(Status::invalid_argument(why));
            }
        };
        // Authenticated: the connection is never evicted for a newer one.
        if let Some(s) = slot {
            s.hold(true);
        }
        let (tx, rx) = mpsc::channel(CMD_QUEUE);
        let conn = engine.add_proc(hello, os_pid, tx, seg, liveness);
        tokio::spawn(async move {
            let why = loop {
                match inbound.message().await {
                    Ok(Some(rpc::RankMessage { msg: Some(m) })) => {
                        if let Msg::Hello(h) = &m {
                            // A later Hello only updates the drop counter.
                            let mut reg = engine.state.lock();
                            if let Some(p) = reg.procs.get_mut(&conn) {
                                let more = h.dropped_events.saturating_sub(p.dropped);
                                engine.metrics.events_dropped.inc_by(more);
                                p.dropped = h.dropped_events;
                            }
                            continue;
                        }
                        engine.on_message(conn, m);
                    }
                    Ok(Some(_)) => {}
                    Ok(None) => break "its control stream closed".to_string(),
                    Err(e) => {
                        if e.code() == tonic::Code::OutOfRange
                            || e.code() == tonic::Code::ResourceExhausted
                        {
                            engine.metrics.reject("socket", "oversized");
                            super::log(&format!("rejected a message from conn {conn}: {e}"));
                        }
                        break format!("its control stream failed: {}", e.message());
                    }
                }
            };
            engine.stream_ended(conn, &why).await;
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx)) as CmdStream))
    }

    async fn get_status(
        &self,
        req: Request<rpc::StatusRequest>,
    ) -> Result<Response<rpc::Status>, Status> {
        self.engine.metrics.status_queries.inc();
        let mut s = self.engine.status();
        if req.into_inner().job_wide {
            for other in super::peers::peer_statuses(&self.engine).await {
                super::state::merge(&mut s, other);
            }
        }
        Ok(Response::new(s))
    }

    async fn abort(
        &self,
        req: Request<rpc::AbortRequest>,
    ) -> Result<Response<rpc::AbortReply>, Status> {
        let r = req.into_inner();
        let reason = if r.reason.is_empty() {
            format!("aborted through the sidecar on {}", self.engine.state.host)
        } else {
            clip(r.reason)
        };
        let n = self.engine.command(&r.comm_id, &reason, 0, r.fail);
        Ok(Response::new(rpc::AbortReply { aborted: n as u32 }))
    }

    async fn heartbeat(
        &self,
        _req: Request<rpc::HeartbeatRequest>,
    ) -> Result<Response<rpc::HeartbeatReply>, Status> {
        let me = self.engine.board.get().map(|b| b.me);
        Ok(Response::new(rpc::HeartbeatReply {
            host: self.engine.state.host.clone(),
            time_unix_nano: now_nanos(),
            rank_offset: me.map_or(0, |m| m.offset),
            local_ranks: me.map_or(0, |m| m.count),
            incarnation: me.map_or(0, |m| m.incarnation),
        }))
    }

    async fn post_board(
        &self,
        req: Request<rpc::BoardPost>,
    ) -> Result<Response<rpc::BoardReply>, Status> {
        let e = &self.engine;
        if !self.peer_port {
            return Err(Status::permission_denied(
                "PostBoard is for peer sidecars, on the peer port",
            ));
        }
        let Some(b) = e.board.get() else {
            return Err(Status::failed_precondition(
                "this pod keeps no recovery board (WEFT_RECOVERY_DIR is unset: the job's onRankFailure is not ReplaceRank)",
            ));
        };
        let post = req.into_inner();
        match b.accept(&post) {
            Ok((reports, deaths)) => {
                // Recorded, not acted on: the ranks' own calls fail on the
                // dead peer (a closed connection, their timeout). Failing the
                // communicators here would also fail survivors in their last
                // collective when a rank that ended cleanly had its exit
                // taken for a death (its last deregistration still queued).
                if !deaths.is_empty() {
                    super::log(&format!(
                        "recovery board: {} says ranks (rank, incarnation) {deaths:?} are dead",
                        clip(post.from_host)
                    ));
                }
                if !reports.is_empty() {
                    e.kill_stopped_ranks(&reports);
                }
                Ok(Response::new(rpc::BoardReply { boot: b.boot }))
            }
            Err(why) => {
                e.metrics.reject("peer", "board");
                super::log(&format!(
                    "refused a recovery board post from {}: {why}",
                    clip(post.from_host)
                ));
                Err(Status::invalid_argument(why.to_string()))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hello(pid: u32) -> rpc::Hello {
        rpc::Hello {
            pid,
            hostname: "h".into(),
            job: "j".into(),
            ..Default::default()
        }
    }

    /// A rank that destroyed its communicator and exited while a peer of it
    /// on this host still runs shows as exited, with its pid (it showed as
    /// "pid 0 ... dead").
    #[test]
    fn a_cleanly_exited_rank_shows_as_exited_with_its_pid() {
        let e = Engine::new("j".into(), "h".into(), None);
        let (tx, _rx) = mpsc::channel(4);
        let a = e.add_proc(hello(111), None, tx.clone(), None, Liveness::Unknown);
        let b = e.add_proc(hello(222), None, tx, None, Liveness::Unknown);
        for (conn, rank) in [(a, 0), (b, 1)] {
            e.on_message(
                conn,
                Msg::Register(rpc::Register {
                    comm_id: "c".into(),
                    rank,
                    nranks: 2,
                    ..Default::default()
                }),
            );
        }
        e.on_message(
            a,
            Msg::Deregister(rpc::Deregister {
                comm_id: "c".into(),
                rank: 0,
            }),
        );
        e.on_gone(a, "its control stream closed");
        let s = e.status();
        let c = &s.comms[0];
        let r0 = c.ranks.iter().find(|r| r.rank == 0).unwrap();
        assert_eq!(
            (r0.pid, r0.state.as_str(), r0.host.as_str()),
            (111, "exited", "h")
        );
        let r1 = c.ranks.iter().find(|r| r.rank == 1).unwrap();
        assert_eq!((r1.pid, r1.state.as_str()), (222, "alive"));
        assert!(s.async_errors.is_empty(), "{:?}", s.async_errors);
        // A rank whose process goes without destroying is dead.
        e.on_gone(b, "its control stream closed");
        let s = e.status();
        let r1 = s.comms[0].ranks.iter().find(|r| r.rank == 1).unwrap();
        assert_eq!((r1.pid, r1.state.as_str()), (222, "dead"));
    }
}
