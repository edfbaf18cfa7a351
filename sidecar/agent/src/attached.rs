//! Attached mode: the control stream to the pod's sidecar, kept up for the
//! process's life. A session opens a connection that passes the telemetry
//! segment and the lifeline (`client::connect_passing`), says `Hello`,
//! registers every live communicator, then forwards lifecycle messages and
//! executes the sidecar's commands.
//!
//! A session that breaks while the sidecar lives (an HTTP/2 error, a reset)
//! is opened again, with backoff: the sidecar keeps this process's
//! communicators meanwhile (it checks the process, not the stream). Only
//! when the sidecar is gone (its socket refuses or has vanished, or it
//! refuses the attach: it is terminating) are the communicators failed
//! ("lost the sidecar"), as a pod going away must.

use crate::client;
use crate::rpc::{self, RankMessage};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot};
use tokio_stream::StreamExt;
use weft_contract::params;

/// What a session needs of the agent that owns it. The agent implements it,
/// so this module never names the agent and the two do not import each
/// other.
pub(crate) trait Owner: Send + Sync + 'static {
    /// The `Hello` that opens a stream.
    fn hello(&self) -> rpc::Hello;
    /// The `Register` of every live communicator (sent again on a reconnect).
    fn registrations(&self) -> Vec<RankMessage>;
    /// The descriptors passed with a connection's first bytes (the telemetry
    /// segment, the lifeline).
    fn passed_fds(&self) -> Vec<std::os::fd::OwnedFd>;
    /// Carries out a command of the sidecar (abort or fail a communicator;
    /// `comm` empty: every one).
    fn act(&self, comm: &str, reason: &str, fail: bool);
    /// Whether the owner is closing (a broken stream is then not reopened).
    fn closing(&self) -> bool;
    /// Counts a reconnect.
    fn reconnected(&self);
    /// The test hook that cuts the stream.
    fn cut(&self) -> &tokio::sync::Notify;
}

/// Longest a session may stay down for reasons other than a gone sidecar.
const RECONNECT_LIMIT: Duration = Duration::from_secs(30);
/// First and longest wait between reconnection attempts.
const BACKOFF_FIRST: Duration = Duration::from_millis(10);
const BACKOFF_MAX: Duration = Duration::from_secs(1);

/// Why a session could not be opened.
enum OpenError {
    /// The sidecar is not there (nothing listens, or no socket).
    Gone(String),
    /// It answered and refused (terminating, wrong secret, ...).
    Refused(String),
    /// Anything else (worth another attempt).
    Transient(String),
}

impl OpenError {
    fn text(&self) -> &str {
        match self {
            OpenError::Gone(s) | OpenError::Refused(s) | OpenError::Transient(s) => s,
        }
    }
}

/// How a session ended.
enum Ended {
    /// The agent closed (a normal exit): everything queued was sent.
    Closed,
    /// The stream broke.
    Broken(String),
}

struct Session {
    out: mpsc::Sender<RankMessage>,
    inbound: tonic::Streaming<rpc::SidecarCommand>,
}

/// Gone when the connection was refused or the socket does not exist.
fn classify(e: tonic::transport::Error) -> OpenError {
    let mut src: Option<&(dyn std::error::Error + 'static)> = Some(&e);
    while let Some(s) = src {
        if let Some(io) = s.downcast_ref::<std::io::Error>() {
            use std::io::ErrorKind::*;
            if matches!(io.kind(), ConnectionRefused | NotFound) {
                return OpenError::Gone(io.to_string());
            }
        }
        src = s.source();
    }
    OpenError::Transient(e.to_string())
}

async fn open<A: Owner>(a: &Arc<A>, socket: &Path) -> Result<Session, OpenError> {
    let a2 = a.clone();
    let fds: client::PassFds = Arc::new(move || a2.passed_fds());
    let channel = client::connect_passing(socket.to_path_buf(), Some(fds))
        .await
        .map_err(classify)?;
    // Hello, then every live communicator, then the queue.
    let mut first = vec![RankMessage {
        msg: Some(rpc::rank_message::Msg::Hello(a.hello())),
    }];
    first.extend(a.registrations());
    let (out, out_rx) = mpsc::channel::<RankMessage>(1024);
    let stream =
        tokio_stream::iter(first).chain(tokio_stream::wrappers::ReceiverStream::new(out_rx));
    let inbound = client::client(channel)
        .attach(stream)
        .await
        .map_err(|e| OpenError::Refused(e.message().to_string()))?
        .into_inner();
    Ok(Session { out, inbound })
}

/// Forwards lifecycle messages and executes commands until the stream
/// breaks or the agent closes.
async fn serve<A: Owner>(
    a: &A,
    s: Session,
    rx: &mut mpsc::Receiver<RankMessage>,
    close: &mut oneshot::Receiver<()>,
) -> Ended {
    let Session { out, mut inbound } = s;
    let why = loop {
        tokio::select! {
            m = rx.recv() => match m {
                Some(m) => if out.send(m).await.is_err() {
                    break "the request stream closed".to_string();
                },
                None => return Ended::Closed,
            },
            _ = &mut *close => {
                while let Ok(m) = rx.try_recv() {
                    if out.send(m).await.is_err() {
                        break;
                    }
                }
                drop(out); // ends the request stream
                // The sidecar ends its side once it has read everything.
                while let Ok(Some(_)) = inbound.message().await {}
                return Ended::Closed;
            }
            c = inbound.message() => match c {
                Ok(Some(rpc::SidecarCommand {
                    cmd: Some(rpc::sidecar_command::Cmd::Abort(c)),
                })) => a.act(&c.comm_id, &c.reason, c.fail),
                Ok(Some(_)) => {}
                Ok(None) => break "it closed the control stream".to_string(),
                Err(e) => break e.message().to_string(),
            },
            _ = a.cut().notified() => break "cut by the test hook".to_string(),
        }
    };
    Ended::Broken(why)
}

/// Runs the sessions of the process's life. The first open answers on
/// `ready` (its failure fails the install).
pub(crate) async fn run<A: Owner>(
    a: Arc<A>,
    socket: PathBuf,
    mut rx: mpsc::Receiver<RankMessage>,
    mut close: oneshot::Receiver<()>,
    ready: std::sync::mpsc::Sender<Result<(), String>>,
) {
    let mut session = match open(&a, &socket).await {
        Ok(s) => s,
        Err(e) => {
            let why = match e {
                OpenError::Refused(m) => {
                    format!("the sidecar at {} refused us: {m}", socket.display())
                }
                e => format!(
                    "cannot reach the sidecar at {} (WEFT_SIDECAR_SOCKET): {}",
                    socket.display(),
                    e.text()
                ),
            };
            let _ = ready.send(Err(why));
            return;
        }
    };
    let _ = ready.send(Ok(()));
    loop {
        let why = match serve(&*a, session, &mut rx, &mut close).await {
            Ended::Closed => return,
            Ended::Broken(why) => why,
        };
        if a.closing() {
            return;
        }
        eprintln!(
            "weft: the control stream to the sidecar at {} broke ({why}): reconnecting",
            socket.display()
        );
        session = match reopen(&a, &socket).await {
            Ok(s) => s,
            Err(gone) => return lost(&*a, &socket, &gone),
        };
        a.reconnected();
        eprintln!("weft: reconnected to the sidecar at {}", socket.display());
    }
}

/// Opens a session again, with backoff; an error says why the sidecar
/// counts as gone.
async fn reopen<A: Owner>(a: &Arc<A>, socket: &Path) -> Result<Session, String> {
    let deadline = Instant::now() + RECONNECT_LIMIT;
    let mut wait = BACKOFF_FIRST;
    loop {
        match open(a, socket).await {
            Ok(s) => return Ok(s),
            Err(OpenError::Transient(why)) if Instant::now() < deadline => {
                eprintln!("weft: reconnecting to the sidecar: {why}; again in {wait:?}");
                tokio::time::sleep(wait).await;
                wait = (wait * 2).min(BACKOFF_MAX);
            }
            Err(e) => return Err(e.text().to_string()),
        }
    }
}

/// The pod's sidecar is gone (killed, or the pod is going away): fail
/// rather than run on unobserved and unproxied.
fn lost<A: Owner>(a: &A, socket: &Path, why: &str) {
    let host = params::WEFT_HOSTNAME.raw().unwrap_or_else(crate::host_name);
    let reason = format!(
        "lost the sidecar at {} on host {host}: {why}",
        socket.display()
    );
    eprintln!("weft: {reason}");
    a.act("", &reason, true);
}
