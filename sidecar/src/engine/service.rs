//! The gRPC service (`weft.v1.Sidecar`): rank processes attach, register
//! communicators and stream events; tools read status and abort.

use super::Engine;
use super::state::{Proc, RankEntry, State, now_nanos};
use super::telemetry::SpanRecord;
use std::pin::Pin;
use std::sync::Arc;
use tokio::sync::mpsc;
use tokio_stream::Stream;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};
use weft_agent::rpc::{self, rank_message::Msg, sidecar_server::Sidecar};

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
        let targets = {
            let reg = self.state.lock();
            State::targets(&reg, comm, but)
        };
        let n = targets.len();
        for tx in targets {
            // Never wait on a stuck process: its queue full means it is not reading.
            let _ = tx.try_send(Ok(abort_cmd(comm, reason, fail)));
        }
        n
    }

    /// Registers an attached process; returns its connection id.
    pub fn add_proc(&self, hello: rpc::Hello, os_pid: Option<u32>, tx: super::state::CmdTx) -> u64 {
        let conn = self.state.conn_id();
        let mut reg = self.state.lock();
        reg.procs.insert(
            conn,
            Proc {
                pid: hello.pid,
                os_pid,
                host: clip(hello.hostname),
                gpus: hello.gpus.into_iter().take(64).map(clip).collect(),
                alive: true,
                tx,
                dropped: 0,
                registered: 0,
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

    /// One message of connection `conn`.
    pub fn on_message(&self, conn: u64, msg: Msg) {
        let st = &self.state;
        let mut reg = st.lock();
        match msg {
            Msg::Hello(_) => {} // only valid first; handled by attach
            Msg::Register(r) => {
                let (pid, host) = reg
                    .procs
                    .get(&conn)
                    .map(|p| (p.pid, p.host.clone()))
                    .unwrap_or_default();
                if let Some(p) = reg.procs.get_mut(&conn) {
                    p.registered += 1;
                }
                let c = reg.comms.entry(clip(r.comm_id)).or_default();
                c.nranks = r.nranks;
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
            }
            Msg::Deregister(d) => {
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

    /// The process behind `conn` is gone: mark it dead, fail its communicators' peers.
    fn on_gone(&self, conn: u64, why: &str) {
        let mut reg = self.state.lock();
        let Some(p) = reg.procs.get_mut(&conn) else {
            return;
        };
        p.alive = false;
        let (pid, host, registered) = (p.pid, p.host.clone(), p.registered);
        let mut lost: Vec<(String, u32)> = Vec::new();
        for (id, c) in reg.comms.iter() {
            for (r, e) in c.ranks.iter() {
                if e.conn == conn && e.state != "finalizing" {
                    lost.push((id.clone(), *r));
                }
            }
        }
        if lost.is_empty() {
            // A clean exit: every communicator was destroyed first.
            reg.procs.remove(&conn);
        }
        for (id, r) in &lost {
            reg.push_error(format!(
                "comm {id} rank {r} (pid {pid} on host {host}) died: {why}"
            ));
        }
        self.state.publish(&reg);
        self.metrics
            .peers_up
            .set(reg.procs.values().filter(|p| p.alive).count() as i64);
        drop(reg);
        // Gone unclean: with communicators left, or before it registered
        // any (a replacement dying while it joins).
        if (!lost.is_empty() || registered == 0)
            && let Some(b) = self.board.get()
            && b.own_death()
        {
            super::log(&format!(
                "recovery board: pid {pid} died ({why}): this pod's ranks {:?} are named dead",
                b.me.deaths()
            ));
        }
        for (id, r) in lost {
            let reason = format!("rank {r} (pid {pid} on host {host}) of comm {id} died ({why})");
            let n = self.fail_comm(&id, &reason, conn);
            super::log(&format!(
                "{reason}: aborting comm {id} in {n} local process(es)"
            ));
        }
    }
}

type CmdStream = Pin<Box<dyn Stream<Item = Result<rpc::SidecarCommand, Status>> + Send>>;

#[tonic::async_trait]
impl Sidecar for Service {
    type AttachStream = CmdStream;

    async fn attach(
        &self,
        req: Request<Streaming<rpc::RankMessage>>,
    ) -> Result<Response<CmdStream>, Status> {
        let slot = req
            .extensions()
            .get::<super::listen::ConnInfo>()
            .map(|c| c.slot.clone());
        let os_pid = req
            .extensions()
            .get::<super::listen::ConnInfo>()
            .and_then(|c| c.peer_pid);
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
        // Authenticated: the connection is never evicted for a newer one.
        if let Some(s) = slot {
            s.hold(true);
        }
        let (tx, rx) = mpsc::channel(CMD_QUEUE);
        let conn = engine.add_proc(hello, os_pid, tx);
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
            engine.on_gone(conn, &why);
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
        let a = e.add_proc(hello(111), None, tx.clone());
        let b = e.add_proc(hello(222), None, tx);
        for (conn, rank) in [(a, 0), (b, 1)] {
            e.on_message(
                conn,
                Msg::Register(rpc::Register {
                    comm_id: "c".into(),
                    rank,
                    nranks: 2,
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
