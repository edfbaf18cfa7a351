//! The rank side of the sidecar: a libcomm observer that registers this
//! process's communicators and forwards every operation's events to the
//! pod's `weft sidecar` (found through `WEFT_SIDECAR_SOCKET`), and carries
//! the sidecar's abort commands back to the communicators.
//!
//! Without `WEFT_SIDECAR_SOCKET` the sidecar's engine runs in this process
//! (embedded mode): same registry, snapshots, metrics and spans, no socket.
//! This crate does not hold that engine: the caller hands one in through
//! [`Embedded`] (`weft::agent::install_from_env` does), so a rank that only
//! ever attaches links none of it. The drop-in `libnccl.so.2` hands in
//! `spans_only` instead (feature `otlp`): the spans alone.
//!
//! Collectives never wait on this: events go into a bounded queue; when it
//! is full they are dropped and counted (reported to the sidecar, which
//! exports `weft_events_dropped_total`).

use crate::auth;
use crate::rpc::{self, RankMessage, rank_message::Msg};
use libcomm::observe::{AbortHandle, CommEvent, Observer, OpEvent, Phase};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, UNIX_EPOCH};
use tokio::sync::mpsc;
use weft_contract::params;

/// Events queued toward the sidecar before new ones are dropped.
const QUEUE: usize = 1 << 16;

/// The engine of embedded mode, as the agent sees it: it takes this
/// process's messages (as the sidecar's `Attach` stream would) and sends its
/// commands (aborts) back on the [`Commands`] it was started with.
pub trait Embedded: Send + Sync {
    /// One message of this process.
    fn on_message(&self, m: Msg);
    /// Flushes and stops what the engine exports (spans). Blocks: the agent
    /// calls it off its runtime (at [`Agent::close`] and when it stops).
    fn shutdown(&self);
}

/// Where an engine sends its commands to this process.
pub type Commands = mpsc::Sender<Result<rpc::SidecarCommand, tonic::Status>>;

/// Starts the embedded engine on the agent's runtime (it may spawn tasks
/// there) and registers this process with its `Hello`; an error (why it
/// cannot start) fails the install.
pub type StartEmbedded =
    Box<dyn FnOnce(rpc::Hello, Commands) -> Result<Arc<dyn Embedded>, String> + Send>;

pub struct Agent {
    tx: mpsc::Sender<RankMessage>,
    dropped: AtomicU64,
    handles: Mutex<HashMap<(String, usize), AbortHandle>>,
    pid: u32,
    job: String,
    closing: AtomicBool,
    /// `close` asks the forwarder to flush and end the stream; it answers on `done`.
    close_tx: Mutex<Option<tokio::sync::oneshot::Sender<()>>>,
    done_rx: Mutex<Option<std::sync::mpsc::Receiver<()>>>,
    /// In embedded mode, the in-process engine (its snapshot is this process's RAS view).
    embedded: OnceLock<Arc<dyn Embedded>>,
}

fn nanos(t: std::time::SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

fn msg(m: Msg) -> RankMessage {
    RankMessage { msg: Some(m) }
}

impl Agent {
    fn send(&self, m: Msg) {
        if self.tx.try_send(msg(m)).is_err() {
            self.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }

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
    fn act(&self, comm: &str, reason: &str, fail: bool) {
        let hs: Vec<AbortHandle> = self
            .handles
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter(|((c, _), _)| comm.is_empty() || c == comm)
            .map(|(_, h)| h.clone())
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
}

impl Observer for Agent {
    fn on_op(&self, ev: OpEvent) {
        let (phase, outcome) = match (&ev.phase, &ev.outcome) {
            (Phase::Started, _) => (rpc::Phase::Started, String::new()),
            (Phase::Completed, Some(Err(e))) => (rpc::Phase::Completed, e.clone()),
            (Phase::Completed, _) => (rpc::Phase::Completed, "ok".to_string()),
        };
        self.send(Msg::Op(rpc::OpEvent {
            comm_id: ev.comm_id,
            rank: ev.rank as u32,
            nranks: ev.nranks as u32,
            op: ev.op.into(),
            dtype: ev.dtype.into(),
            bytes: ev.bytes,
            algo: ev.algo.into(),
            seq: ev.seq,
            phase: phase as i32,
            outcome,
            time_unix_nano: nanos(ev.time),
            group: ev.group,
            pid: self.pid,
            job: ev.job,
        }));
    }

    fn on_comm(&self, ev: CommEvent) {
        let mut handles = self.handles.lock().unwrap_or_else(|e| e.into_inner());
        match ev {
            CommEvent::Ready {
                comm_id,
                rank,
                nranks,
                handle,
            } => {
                handles.insert((comm_id.clone(), rank), handle);
                self.send_reliably(Msg::Register(rpc::Register {
                    comm_id,
                    rank: rank as u32,
                    nranks: nranks as u32,
                }));
            }
            CommEvent::Failed {
                comm_id,
                rank,
                error,
            } => {
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
                self.send_reliably(Msg::State(rpc::CommStateChange {
                    comm_id,
                    rank: rank as u32,
                    state: "aborted".into(),
                }));
            }
            CommEvent::Destroyed { comm_id, rank } => {
                handles.remove(&(comm_id.clone(), rank));
                self.send_reliably(Msg::Deregister(rpc::Deregister {
                    comm_id,
                    rank: rank as u32,
                }));
            }
        }
    }
}

fn hello(job: &str, pid: u32, dropped: u64) -> rpc::Hello {
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
    let (tx, rx) = mpsc::channel(QUEUE);
    let (close_tx, close_rx) = tokio::sync::oneshot::channel();
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    let agent = Arc::new(Agent {
        tx,
        dropped: AtomicU64::new(0),
        handles: Mutex::new(HashMap::new()),
        pid,
        job: job.clone(),
        closing: AtomicBool::new(false),
        close_tx: Mutex::new(Some(close_tx)),
        done_rx: Mutex::new(Some(done_rx)),
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
                    rt.block_on(attached(a, p, rx, close_rx, ready_tx));
                    let _ = done_tx.send(());
                }
                Mode::Embedded(start) => {
                    rt.block_on(embedded(a.clone(), start, rx, ready_tx));
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
        if self.embedded.get().is_none() {
            // Attached: the forwarder drains the queue and ends the stream; the
            // sidecar ends its side once it has read everything.
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
            // Give the engine a moment to turn the last events into spans, then flush.
            std::thread::sleep(Duration::from_millis(50));
            e.shutdown();
        }
    }

    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }
}

async fn attached(
    a: Arc<Agent>,
    socket: PathBuf,
    mut rx: mpsc::Receiver<RankMessage>,
    mut close: tokio::sync::oneshot::Receiver<()>,
    ready: std::sync::mpsc::Sender<Result<(), String>>,
) {
    let mut client = match crate::client::sidecar(socket.clone()).await {
        Ok(c) => c,
        Err(e) => {
            let _ = ready.send(Err(format!(
                "cannot reach the sidecar at {} (WEFT_SIDECAR_SOCKET): {e}",
                socket.display()
            )));
            return;
        }
    };
    // Hello first, then the queue; a ticker refreshes the drop count.
    let (out_tx, out_rx) = mpsc::channel::<RankMessage>(1024);
    let _ = out_tx.send(msg(Msg::Hello(hello(&a.job, a.pid, 0)))).await;
    let stream = tokio_stream::wrappers::ReceiverStream::new(out_rx);
    let mut inbound = match client.attach(stream).await {
        Ok(r) => r.into_inner(),
        Err(e) => {
            let _ = ready.send(Err(format!(
                "the sidecar at {} refused us: {}",
                socket.display(),
                e.message()
            )));
            return;
        }
    };
    let _ = ready.send(Ok(()));
    let a2 = a.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        let mut last = 0;
        loop {
            tokio::select! {
                m = rx.recv() => match m {
                    Some(m) => if out_tx.send(m).await.is_err() { break },
                    None => break,
                },
                _ = tick.tick() => {
                    let d = a2.dropped();
                    if d != last {
                        last = d;
                        let _ = out_tx.send(msg(Msg::Hello(hello(&a2.job, a2.pid, d)))).await;
                    }
                }
                _ = &mut close => {
                    while let Ok(m) = rx.try_recv() {
                        if out_tx.send(m).await.is_err() {
                            break;
                        }
                    }
                    let d = a2.dropped();
                    let _ = out_tx.send(msg(Msg::Hello(hello(&a2.job, a2.pid, d)))).await;
                    break; // dropping out_tx ends the request stream
                }
            }
        }
    });
    let why = loop {
        match inbound.message().await {
            Ok(Some(rpc::SidecarCommand {
                cmd: Some(rpc::sidecar_command::Cmd::Abort(c)),
            })) => a.act(&c.comm_id, &c.reason, c.fail),
            Ok(Some(_)) => {}
            Ok(None) => break "it closed the control stream".to_string(),
            Err(e) => break e.message().to_string(),
        }
    };
    if !a.closing.load(Ordering::Relaxed) {
        // The pod's sidecar is gone (killed, or the pod is going away): fail
        // rather than run on unobserved and unproxied.
        let host = params::WEFT_HOSTNAME.raw().unwrap_or_else(crate::host_name);
        let reason = format!(
            "lost the sidecar at {} on host {host}: {why}",
            socket.display()
        );
        eprintln!("weft: {reason}");
        a.act("", &reason, true);
    }
}

async fn embedded(
    a: Arc<Agent>,
    start: StartEmbedded,
    mut rx: mpsc::Receiver<RankMessage>,
    ready: std::sync::mpsc::Sender<Result<(), String>>,
) {
    let (cmd_tx, mut cmd_rx) = mpsc::channel(64);
    let e = match start(hello(&a.job, a.pid, 0), cmd_tx) {
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
