//! The rank side of the sidecar: a libcomm observer that reports every
//! operation into the process's telemetry segment (`ring`: shared memory,
//! no system call per operation), registers the process's communicators
//! with the pod's `weft sidecar` (found through `WEFT_SIDECAR_SOCKET`) over
//! one gRPC stream (`attached`), and carries the sidecar's abort commands
//! back to the communicators.
//!
//! Without `WEFT_SIDECAR_SOCKET` the sidecar's engine runs in this process
//! (embedded mode): same registry, snapshots, metrics and spans, no socket,
//! reading the same segment. This crate does not hold that engine: the
//! caller hands one in through [`Embedded`] (`weft::agent::install_from_env`
//! does), so a rank that only ever attaches links none of it. The drop-in
//! `libnccl.so.2` hands in `spans_only` instead (feature `otlp`): the spans
//! alone.
//!
//! Collectives never wait on this: a full ring drops the record and counts
//! it (the sidecar exports the count as `weft_events_dropped_total`).
//! Lifecycle messages go through a bounded queue to the stream and are
//! never dropped; the segment's communicator table says the same
//! synchronously (a destroyed communicator's slot says so before `destroy`
//! returns).

use crate::lifeline::Lifeline;
use crate::report::Reporter;
use crate::ring::Segment;
use crate::ring::layout::Geometry;
use crate::ring::slots::{self, SlotRef};
use crate::rpc::{self, RankMessage, rank_message::Msg};
use crate::{attached, auth};
use libcomm::observe::{AbortHandle, CommEvent, CounterWords, Observer, OpEvent};
use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;
use tokio::sync::mpsc;
use weft_contract::params;

/// Lifecycle messages queued toward the sidecar.
const QUEUE: usize = 1 << 12;

/// The engine of embedded mode, as the agent sees it: it takes this
/// process's messages (as the sidecar's `Attach` stream would) and sends its
/// commands (aborts) back on the [`Commands`] it was started with.
pub trait Embedded: Send + Sync {
    /// One message of this process.
    fn on_message(&self, m: Msg);
    /// Reads what is left in the segment, then flushes and stops what the
    /// engine exports (spans). Blocks: the agent calls it off its runtime
    /// (at [`Agent::close`] and when it stops).
    fn shutdown(&self);
}

/// Where an engine sends its commands to this process.
pub type Commands = mpsc::Sender<Result<rpc::SidecarCommand, tonic::Status>>;

/// Starts the embedded engine on the agent's runtime (it may spawn tasks
/// there) and registers this process with its `Hello` and telemetry
/// segment (none when it could not be created); an error (why it cannot
/// start) fails the install.
pub type StartEmbedded = Box<
    dyn FnOnce(rpc::Hello, Commands, Option<Arc<Segment>>) -> Result<Arc<dyn Embedded>, String>
        + Send,
>;

/// A live communicator rank of this process.
pub(crate) struct Live {
    handle: AbortHandle,
    nranks: usize,
    slot: Option<SlotRef>,
}

pub struct Agent {
    tx: mpsc::Sender<RankMessage>,
    /// Operations not reported because there is no segment.
    unreported: AtomicU64,
    live: Mutex<HashMap<(String, usize), Live>>,
    reporter: Option<Reporter>,
    /// Attached mode: the end the sidecar watches.
    lifeline: Option<Lifeline>,
    pub(crate) pid: u32,
    pub(crate) job: String,
    pub(crate) closing: AtomicBool,
    /// `close` asks the session to flush and end the stream; it answers on `done`.
    close_tx: Mutex<Option<tokio::sync::oneshot::Sender<()>>>,
    done_rx: Mutex<Option<std::sync::mpsc::Receiver<()>>>,
    /// The test hook [`Agent::cut_connection`] pulls.
    pub(crate) cut: tokio::sync::Notify,
    pub(crate) reconnects: AtomicU64,
    /// In embedded mode, the in-process engine (its snapshot is this process's RAS view).
    embedded: OnceLock<Arc<dyn Embedded>>,
}

fn msg(m: Msg) -> RankMessage {
    RankMessage { msg: Some(m) }
}

/// The `Register` of a communicator rank (`slot` is index + 1, 0 for none).
fn register(comm_id: String, rank: usize, nranks: usize, slot: Option<SlotRef>) -> Msg {
    Msg::Register(rpc::Register {
        comm_id,
        rank: rank as u32,
        nranks: nranks as u32,
        slot: slot.map_or(0, |s| s.index as u32 + 1),
        slot_generation: slot.map_or(0, |s| s.generation),
    })
}

impl Agent {
    /// Lifecycle messages must not be dropped: wait (bounded by the queue draining).
    fn send_reliably(&self, m: Msg) {
        match self.tx.try_send(msg(m)) {
            Ok(()) => {}
            Err(mpsc::error::TrySendError::Full(m)) => {
                let tx = self.tx.clone();
                // Off this thread: it may be a collective's (or a runtime's) thread.
                let _ = std::thread::Builder::new()
                    .name("weft-agent-send".into())
                    .spawn(move || {
                        let _ = tx.blocking_send(m);
                    });
            }
            Err(mpsc::error::TrySendError::Closed(_)) => {}
        }
    }

    /// Aborts (or, with `fail`, fails with `reason`) the matching communicators.
    pub(crate) fn act(&self, comm: &str, reason: &str, fail: bool) {
        let hs: Vec<AbortHandle> = self
            .lock_live()
            .iter()
            .filter(|((c, _), _)| comm.is_empty() || c == comm)
            .map(|(_, l)| l.handle.clone())
            .collect();
        if hs.is_empty() {
            return;
        }
        let reason = reason.to_string();
        // Abort waits for an in-flight call to notice: never on the runtime's thread.
        let _ = std::thread::Builder::new()
            .name("weft-agent-abort".into())
            .spawn(move || {
                for h in hs {
                    if fail {
                        h.fail(&reason);
                    } else {
                        h.abort(&reason);
                    }
                }
            });
    }

    fn lock_live(&self) -> std::sync::MutexGuard<'_, HashMap<(String, usize), Live>> {
        self.live.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// `Register` messages of every live communicator rank (a new session's
    /// opening, after `Hello`).
    pub(crate) fn registrations(&self) -> Vec<RankMessage> {
        self.lock_live()
            .iter()
            .map(|((c, r), l)| msg(register(c.clone(), *r, l.nranks, l.slot)))
            .collect()
    }

    /// Fresh duplicates of what an attach connection passes: the segment,
    /// then the lifeline.
    pub(crate) fn passed_fds(&self) -> Vec<OwnedFd> {
        use std::os::fd::AsFd;
        let mut v = Vec::new();
        if let Some(r) = &self.reporter {
            // SAFETY: the segment's descriptor lives as long as the agent.
            let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(r.segment().fd()) };
            v.extend(fd.try_clone_to_owned());
        }
        if let Some(l) = &self.lifeline {
            v.extend(l.read_end().as_fd().try_clone_to_owned());
        }
        v
    }
}

/// What its control-stream session needs of the agent (attached mode).
impl attached::Owner for Agent {
    fn hello(&self) -> rpc::Hello {
        hello(&self.job, self.pid, 0)
    }
    fn registrations(&self) -> Vec<RankMessage> {
        Agent::registrations(self)
    }
    fn passed_fds(&self) -> Vec<OwnedFd> {
        Agent::passed_fds(self)
    }
    fn act(&self, comm: &str, reason: &str, fail: bool) {
        Agent::act(self, comm, reason, fail)
    }
    fn closing(&self) -> bool {
        self.closing.load(Ordering::Relaxed)
    }
    fn reconnected(&self) {
        self.reconnects.fetch_add(1, Ordering::Relaxed);
    }
    fn cut(&self) -> &tokio::sync::Notify {
        &self.cut
    }
}

impl Observer for Agent {
    fn on_op(&self, ev: &OpEvent<'_>) {
        match &self.reporter {
            Some(r) => r.op(ev),
            None => {
                self.unreported.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    fn counter(&self, comm_id: &str, rank: usize) -> Option<CounterWords> {
        self.reporter.as_ref()?.counter(comm_id, rank as u32)
    }

    fn on_comm(&self, ev: CommEvent) {
        let rep = self.reporter.as_ref();
        match ev {
            CommEvent::Ready {
                comm_id,
                rank,
                nranks,
                handle,
            } => {
                let slot = rep.and_then(|r| r.opened(&comm_id, rank as u32, nranks as u32));
                self.lock_live().insert(
                    (comm_id.clone(), rank),
                    Live {
                        handle,
                        nranks,
                        slot,
                    },
                );
                self.send_reliably(register(comm_id, rank, nranks, slot));
            }
            CommEvent::Failed {
                comm_id,
                rank,
                error,
            } => {
                if let Some(r) = rep {
                    r.state(&comm_id, rank as u32, slots::FAILED);
                }
                self.send_reliably(Msg::Error(rpc::AsyncError {
                    comm_id: comm_id.clone(),
                    rank: rank as u32,
                    error,
                }));
                self.send_reliably(Msg::State(rpc::CommStateChange {
                    comm_id,
                    rank: rank as u32,
                    state: "failed".into(),
                }));
            }
            CommEvent::Aborted { comm_id, rank } => {
                if let Some(r) = rep {
                    r.state(&comm_id, rank as u32, slots::ABORTED);
                }
                self.send_reliably(Msg::State(rpc::CommStateChange {
                    comm_id,
                    rank: rank as u32,
                    state: "aborted".into(),
                }));
            }
            CommEvent::Destroyed { comm_id, rank } => {
                // The slot first: true before destroy returns, whatever
                // happens to the stream.
                if let Some(r) = rep {
                    r.destroyed(&comm_id, rank as u32);
                }
                self.lock_live().remove(&(comm_id.clone(), rank));
                self.send_reliably(Msg::Deregister(rpc::Deregister {
                    comm_id,
                    rank: rank as u32,
                }));
            }
        }
    }
}

pub(crate) fn hello(job: &str, pid: u32, dropped: u64) -> rpc::Hello {
    rpc::Hello {
        pid,
        hostname: params::WEFT_HOSTNAME.raw().unwrap_or_else(crate::host_name),
        job: job.into(),
        auth: auth::job_secret_from_env()
            .map(|s| auth::hello_mac(&s, job, pid))
            .unwrap_or_default(),
        gpus: params::CUDA_VISIBLE_DEVICES
            .raw()
            .map(|v| v.split(',').map(str::to_string).collect())
            .unwrap_or_default(),
        dropped_events: dropped,
    }
}

static AGENT: OnceLock<Arc<Agent>> = OnceLock::new();

enum Mode {
    Attached(PathBuf),
    Embedded(StartEmbedded),
}

/// The installed agent, if any.
pub fn installed() -> Option<&'static Arc<Agent>> {
    AGENT.get()
}

/// This process's telemetry segment (`WEFT_EVENT_RING` records), or none
/// (said once) when it cannot be created: operations are then not reported.
fn segment() -> Option<Arc<Segment>> {
    let records = params::WEFT_EVENT_RING.value();
    match Segment::create(Geometry::with_records(records)) {
        Ok(s) => Some(Arc::new(s)),
        Err(e) => {
            eprintln!(
                "weft: no telemetry ring ({e}): this process's collectives are not reported to the sidecar"
            );
            None
        }
    }
}

/// Installs the observer: attached to the sidecar at `WEFT_SIDECAR_SOCKET`
/// (an error when it cannot be reached), else the engine `engine` starts
/// (an error without one). Call once, before creating communicators; later
/// calls return the same agent.
pub fn install_from_env(engine: Option<StartEmbedded>) -> Result<Arc<Agent>, String> {
    if let Some(a) = AGENT.get() {
        return Ok(a.clone());
    }
    let socket = params::WEFT_SIDECAR_SOCKET
        .raw_os()
        .filter(|s| !s.is_empty())
        .map(PathBuf::from);
    let mode = match (socket, engine) {
        (Some(p), _) => Mode::Attached(p),
        (None, Some(start)) => Mode::Embedded(start),
        (None, None) => {
            return Err(
                "no sidecar to attach to (WEFT_SIDECAR_SOCKET is not set) and no embedded engine"
                    .into(),
            );
        }
    };
    let job = params::WEFT_JOB
        .raw()
        .filter(|j| !j.is_empty())
        .unwrap_or_else(|| "anon".into());
    let pid = std::process::id();
    let seg = segment();
    let lifeline = match &mode {
        Mode::Attached(_) => {
            Some(Lifeline::new().map_err(|e| format!("creating the lifeline pipe: {e}"))?)
        }
        Mode::Embedded(_) => None,
    };
    let (tx, rx) = mpsc::channel(QUEUE);
    let (close_tx, close_rx) = tokio::sync::oneshot::channel();
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    let agent = Arc::new(Agent {
        tx,
        unreported: AtomicU64::new(0),
        live: Mutex::new(HashMap::new()),
        reporter: seg.clone().map(Reporter::new),
        lifeline,
        pid,
        job: job.clone(),
        closing: AtomicBool::new(false),
        close_tx: Mutex::new(Some(close_tx)),
        done_rx: Mutex::new(Some(done_rx)),
        cut: tokio::sync::Notify::new(),
        reconnects: AtomicU64::new(0),
        embedded: OnceLock::new(),
    });
    let (ready_tx, ready_rx) = std::sync::mpsc::channel::<Result<(), String>>();
    let a = agent.clone();
    std::thread::Builder::new()
        .name("weft-agent".into())
        .spawn(move || {
            let rt = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    let _ = ready_tx.send(Err(format!("agent runtime: {e}")));
                    return;
                }
            };
            match mode {
                Mode::Attached(p) => {
                    rt.block_on(attached::run(a, p, rx, close_rx, ready_tx));
                    let _ = done_tx.send(());
                }
                Mode::Embedded(start) => {
                    rt.block_on(embedded(a.clone(), start, seg, rx, ready_tx));
                    if let Some(e) = a.embedded.get() {
                        e.shutdown();
                    }
                }
            }
        })
        .map_err(|e| format!("spawning the agent thread: {e}"))?;
    ready_rx
        .recv_timeout(Duration::from_secs(10))
        .map_err(|_| "the sidecar did not answer within 10 s".to_string())??;
    let _ = AGENT.set(agent.clone());
    libcomm::observe::set_observer(agent.clone());
    // A normal exit (return from main, `process::exit`) flushes what is
    // queued and ends the control stream cleanly: without it the process's
    // last messages (its communicators' Deregister) were cut off with the
    // connection, and its sidecar took a rank that had finished for a dead
    // one (issue 31 (8)). Programs need not call `close` themselves.
    // SAFETY: registering a plain extern "C" function, once per process.
    unsafe { libc::atexit(close_at_exit) };
    Ok(agent)
}

extern "C" fn close_at_exit() {
    if let Some(a) = AGENT.get() {
        a.close();
    }
}

impl Agent {
    /// Flushes what is queued (bounded) and stops. Runs by itself at a
    /// normal exit of the process (`atexit`); later calls do nothing.
    pub fn close(&self) {
        if self.closing.swap(true, Ordering::Relaxed) {
            return;
        }
        if let Some(r) = &self.reporter {
            r.segment().mark_closing();
        }
        if self.embedded.get().is_none() {
            // Attached: the session sends what is queued and ends the
            // stream; the sidecar ends its side once it has read everything.
            if let Some(c) = self
                .close_tx
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .take()
            {
                let _ = c.send(());
            }
            if let Some(d) = self
                .done_rx
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .take()
            {
                let _ = d.recv_timeout(Duration::from_secs(5));
            }
            return;
        }
        let deadline = std::time::Instant::now() + Duration::from_secs(2);
        while self.tx.capacity() < self.tx.max_capacity() && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        if let Some(e) = self.embedded.get() {
            e.shutdown();
        }
    }

    /// Records dropped by a full ring (their operations are still counted
    /// in their slots), or, without a ring, every operation.
    pub fn dropped(&self) -> u64 {
        self.reporter.as_ref().map_or(0, |r| r.segment().dropped())
            + self.unreported.load(Ordering::Relaxed)
    }

    /// Records written into the ring so far: every failure and slow call,
    /// and the rest up to `ring::slots::RECORDS_PER_SEC` per communicator
    /// (every operation is counted in its slot either way).
    pub fn reported(&self) -> u64 {
        self.reporter.as_ref().map_or(0, |r| r.segment().produced())
    }

    /// Times the control stream was re-established after it broke.
    pub fn reconnects(&self) -> u64 {
        self.reconnects.load(Ordering::Relaxed)
    }

    /// Drops the control connection as a failing network or HTTP/2 stack
    /// would (the sidecar sees its stream end; this process lives on and
    /// reconnects). For tests of the sidecar's death rule.
    pub fn cut_connection(&self) {
        self.cut.notify_one();
    }
}

async fn embedded(
    a: Arc<Agent>,
    start: StartEmbedded,
    seg: Option<Arc<Segment>>,
    mut rx: mpsc::Receiver<RankMessage>,
    ready: std::sync::mpsc::Sender<Result<(), String>>,
) {
    let (cmd_tx, mut cmd_rx) = mpsc::channel(64);
    let e = match start(hello(&a.job, a.pid, 0), cmd_tx, seg) {
        Ok(e) => e,
        Err(why) => {
            let _ = ready.send(Err(why));
            return;
        }
    };
    let _ = a.embedded.set(e.clone());
    let _ = ready.send(Ok(()));
    // An engine that sends no commands (spans only) drops its sender at
    // once: the messages still flow.
    let mut commands = true;
    loop {
        tokio::select! {
            m = rx.recv() => match m {
                Some(RankMessage { msg: Some(m) }) => e.on_message(m),
                Some(_) => {}
                None => break,
            },
            c = cmd_rx.recv(), if commands => match c {
                Some(Ok(rpc::SidecarCommand { cmd: Some(rpc::sidecar_command::Cmd::Abort(c)) })) => {
                    a.act(&c.comm_id, &c.reason, c.fail)
                }
                Some(_) => {}
                None => commands = false,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{install_from_env, installed};

    /// The only test of this crate that touches the environment.
    #[test]
    fn install_says_why_it_cannot_attach() {
        // SAFETY: no other test of this crate reads or writes the environment.
        unsafe { std::env::remove_var("WEFT_SIDECAR_SOCKET") };
        let Err(e) = install_from_env(None) else {
            panic!("attached with neither a socket nor an engine")
        };
        assert!(e.contains("WEFT_SIDECAR_SOCKET is not set"), "{e}");

        let missing = std::env::temp_dir().join(format!("weft-agent-{}.sock", std::process::id()));
        // SAFETY: as above.
        unsafe { std::env::set_var("WEFT_SIDECAR_SOCKET", &missing) };
        let Err(e) = install_from_env(None) else {
            panic!("attached to a socket nobody listens on")
        };
        assert!(e.contains("cannot reach the sidecar at"), "{e}");
        assert!(e.contains(&missing.display().to_string()), "{e}");
        assert!(installed().is_none(), "a failed attach installs nothing");
    }
}
