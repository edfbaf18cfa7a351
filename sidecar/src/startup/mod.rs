//! `weft sidecar` start-up: the one place where the engine (the ranks'
//! gRPC socket, job state, peer heartbeats, HTTP port) and the network
//! proxy are composed. The engine's listeners are given the proxy's route
//! for connections on the peer port; the proxy is given the engine as the
//! sink of lost hosts; the engine's status is given the proxy's host views.
//!
//! `serve` runs named phases in order: telemetry, the proxy, the ports
//! (socket, HTTP, signals), the socket's accept loop, the peer port and its
//! gRPC server, the recovery board, the heartbeats, the socket's gRPC and
//! HTTP servers, the ready line; then, on SIGTERM or SIGINT, the shutdown.
//! The first phase that fails ends the start-up with exit code 1.

mod args;
mod ports;

pub use args::SidecarArgs;

use crate::engine::listen::{self, Listener, PortLimits};
use crate::engine::{
    self, CONNECTION_WINDOW, Engine, KEEPALIVE_ACK, MAX_MESSAGE, MAX_STREAMS, auth, board,
    board_relay, host_name, http, peer_rpc, peers, service, telemetry,
};
use crate::log::log;
use crate::proxy::{self, Proxy};
use crate::seams::{JobEvents, Route};
use ports::{Limits, Ports, Signals};
use std::io;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio_stream::wrappers::ReceiverStream;
use weft_agent::rpc;

/// Raises the descriptor limit to the hard limit: the connection caps, not
/// the process's limit, decide what a flood gets.
fn raise_fd_limit() {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: plain get/setrlimit on a local struct.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) == 0 && r.rlim_cur < r.rlim_max {
            r.rlim_cur = r.rlim_max.min(1 << 20);
            libc::setrlimit(libc::RLIMIT_NOFILE, &r);
        }
    }
}

/// The gRPC server of either gRPC port, with HTTP/2 limits: streams per
/// connection, header list size, pending resets, and keepalive pings that
/// close a connection which stops answering.
fn grpc_server(args: &SidecarArgs) -> tonic::transport::Server {
    let idle = Duration::from_millis(args.idle_timeout_ms.max(100));
    tonic::transport::Server::builder()
        .max_concurrent_streams(MAX_STREAMS)
        // h2 closes a connection (GOAWAY ENHANCE_YOUR_CALM) whose small DATA
        // frames, buffered unread, exceed half the connection window; with
        // operations in the telemetry rings a rank's stream carries only
        // lifecycle messages (~100 B frames), and a window of 1 MiB lets
        // thousands of them (a burst of communicators) queue up.
        .initial_connection_window_size(CONNECTION_WINDOW)
        .initial_stream_window_size(CONNECTION_WINDOW)
        .http2_max_header_list_size(16 << 10)
        .http2_max_pending_accept_reset_streams(Some(64))
        .http2_keepalive_interval(Some(idle))
        .http2_keepalive_timeout(Some(KEEPALIVE_ACK.min(idle)))
}

/// Runs the sidecar until SIGTERM/SIGINT; returns the exit code.
pub fn run(args: SidecarArgs) -> i32 {
    raise_fd_limit();
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .thread_name("weft-sidecar")
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            log(&format!("cannot start the runtime: {e}"));
            return 1;
        }
    };
    let host = args.host.clone().unwrap_or_else(host_name);
    let engine = Engine::new(args.job.clone(), host.clone(), auth::job_secret_from_env());
    if engine.auth.secret.is_none() {
        log(
            "no job secret (WEFT_JOB_SECRET): attaching processes are not authenticated beyond the socket's permissions",
        );
    }
    let code = rt.block_on(serve(args, engine.clone()));
    // Flushing spans blocks: outside the runtime's async context (its workers still run).
    if let Some(t) = engine.telemetry.get() {
        t.shutdown();
    }
    rt.shutdown_timeout(Duration::from_millis(500));
    code
}

/// What a started sidecar holds until it stops.
struct Running {
    /// The network proxy (its socket is removed at the end).
    proxy: Option<Arc<Proxy>>,
    signals: Signals,
    /// Tells the servers to stop.
    stop: watch::Sender<bool>,
    /// The peer port's gRPC server, the socket's and the HTTP server, in
    /// the order they are waited for.
    servers: Vec<JoinHandle<()>>,
}

async fn serve(args: SidecarArgs, engine: Arc<Engine>) -> i32 {
    let mut running = match start(&args, &engine).await {
        Ok(r) => r,
        Err(why) => {
            log(&why);
            return 1;
        }
    };
    let sig = running.signals.first().await;
    shut_down(&args, &engine, sig, running).await;
    0
}

/// The start-up phases, in order; the first error (a line to log) ends it.
async fn start(args: &SidecarArgs, engine: &Arc<Engine>) -> Result<Running, String> {
    start_telemetry(engine);
    // The proxy's socket exists before the control socket: a rank that
    // attached can rely on its presence meaning "proxy offered".
    let proxy = start_proxy(args, engine)?;
    let ports = Ports::bind(args).await?;
    let limits = Limits::new(args, engine);
    // Connections open with the HTTP/2 preface (gRPC) or one of these.
    let routes: Arc<[Route]> = Arc::from(vec![proxy::route(proxy.as_ref())]);
    let (conn_tx, conn_rx) = mpsc::channel(64);
    tokio::spawn(listen::accept_loop(
        Listener::Unix(ports.socket),
        engine.clone(),
        routes.clone(),
        conn_tx,
        limits.socket,
    ));
    let (stop, stop_rx) = watch::channel(false);
    let peer = start_peer_port(args, engine, routes, limits.peer, stop_rx.clone()).await?;
    let _ = engine.peers.set(args.peers.clone());
    start_board(args, engine)?;
    start_heartbeats(args, engine);
    let grpc = serve_socket(args, engine, conn_rx, stop_rx.clone());
    let router = http::router(engine.clone());
    let web = tokio::spawn(http::serve(ports.http, router, limits.http, stop_rx));
    announce_ready(
        args,
        engine,
        &ports.http_addr,
        peer.as_ref().map(|p| p.addr.as_str()),
    );
    let servers = peer
        .map(|p| p.server)
        .into_iter()
        .chain([grpc, web])
        .collect();
    Ok(Running {
        proxy,
        signals: ports.signals,
        stop,
        servers,
    })
}

/// OpenTelemetry spans (when an endpoint is configured) and the publisher
/// of the status snapshots.
fn start_telemetry(engine: &Arc<Engine>) {
    if telemetry::enabled() {
        match telemetry::Telemetry::start("weft-sidecar", engine.metrics.spans_dropped.clone()) {
            Ok(t) => {
                let _ = engine.telemetry.set(t);
            }
            Err(e) => log(&format!("tracing disabled: {e}")),
        }
    }
    tokio::spawn(engine.state.clone().publisher());
    engine::start_draining(engine);
}

/// The network proxy, with `--peer-listen` unless `--no-proxy`: its socket
/// beside the control socket, lost hosts reported to the engine, its
/// connections shown in the engine's status.
fn start_proxy(args: &SidecarArgs, engine: &Arc<Engine>) -> Result<Option<Arc<Proxy>>, String> {
    let Some(addr) = args.peer_listen.filter(|_| !args.no_proxy) else {
        return Ok(None);
    };
    let cfg = proxy::Config {
        job: engine.auth.job.clone(),
        secret: engine.auth.secret.clone().unwrap_or_default(),
        host: engine.state.host.clone(),
        peers: args.peers.clone(),
        own_port: addr.port(),
        timeout: Duration::from_millis(args.peer_timeout_ms.max(100)),
    };
    let events: Arc<dyn JobEvents> = engine.clone();
    let p = proxy::start(cfg, &args.socket, engine.metrics.clone(), events)
        .map_err(|e| format!("cannot start the proxy: {e}"))?;
    let _ = engine.host_views.set(p.clone());
    Ok(Some(p))
}

/// The peer port's gRPC server and the address it is bound to.
struct PeerPort {
    server: JoinHandle<()>,
    addr: String,
}

/// With `--peer-listen`: binds the peer port, accepts on it (the proxy's
/// connections go to `routes`) and serves the other sidecars' gRPC calls,
/// each checked for the job secret's signature.
async fn start_peer_port(
    args: &SidecarArgs,
    engine: &Arc<Engine>,
    routes: Arc<[Route]>,
    limits: PortLimits,
    stop: watch::Receiver<bool>,
) -> Result<Option<PeerPort>, String> {
    let Some(addr) = args.peer_listen else {
        return Ok(None);
    };
    let l = TcpListener::bind(addr)
        .await
        .map_err(|e| format!("cannot bind the peer port {addr}: {e}"))?;
    let bound = l.local_addr().map(|a| a.to_string()).unwrap_or_default();
    let (tx, rx) = mpsc::channel(64);
    tokio::spawn(listen::accept_loop(
        Listener::Tcp(l),
        engine.clone(),
        routes,
        tx,
        limits,
    ));
    let e = engine.clone();
    let svc = tonic::service::interceptor::InterceptedService::new(
        sidecar_service(engine, true),
        move |req: tonic::Request<()>| peer_rpc::check(&e, &req).map(|_| req),
    );
    let server = grpc_server(args)
        .add_service(svc)
        .serve_with_incoming_shutdown(ReceiverStream::new(rx), stopped(stop));
    Ok(Some(PeerPort {
        server: tokio::spawn(async move {
            let _ = server.await;
        }),
        addr: bound,
    }))
}

/// The pod's recovery board (`WEFT_RECOVERY_DIR`), relayed to the peers.
fn start_board(args: &SidecarArgs, engine: &Arc<Engine>) -> Result<(), String> {
    let Some(b) =
        board::Board::from_env().map_err(|e| format!("cannot keep the recovery board: {e}"))?
    else {
        return Ok(());
    };
    let b = Arc::new(b);
    log(&format!(
        "recovery board {}: ranks {}..{} incarnation {}, relayed to {} peer(s)",
        b.dir().display(),
        b.me.offset,
        b.me.offset + b.me.count,
        b.me.incarnation,
        args.peers.len()
    ));
    let _ = engine.board.set(b.clone());
    board_relay::start(engine.clone(), b, args.peers.clone());
    Ok(())
}

/// Heartbeats with the peer sidecars (`--peers`): a silent one is a lost host.
fn start_heartbeats(args: &SidecarArgs, engine: &Arc<Engine>) {
    if args.peers.is_empty() {
        return;
    }
    let timeout = Duration::from_millis(args.peer_timeout_ms.max(100));
    tokio::spawn(peers::heartbeat_loop(
        engine.clone(),
        args.peers.clone(),
        (timeout / 6).max(Duration::from_millis(50)),
        timeout,
        Duration::from_millis(args.peer_startup_grace_ms).max(timeout),
    ));
}

/// The `weft.v1.Sidecar` service; `peer_port`: as served on the peer port.
fn sidecar_service(
    engine: &Arc<Engine>,
    peer_port: bool,
) -> rpc::sidecar_server::SidecarServer<service::Service> {
    rpc::sidecar_server::SidecarServer::new(service::Service {
        engine: engine.clone(),
        peer_port,
    })
    .max_decoding_message_size(MAX_MESSAGE)
}

/// Resolves when `stop` turns true: the servers' shutdown signal.
async fn stopped(mut stop: watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}

/// Serves the ranks' gRPC on the connections the socket's accept loop hands over.
fn serve_socket(
    args: &SidecarArgs,
    engine: &Arc<Engine>,
    conns: mpsc::Receiver<io::Result<listen::Conn>>,
    stop: watch::Receiver<bool>,
) -> JoinHandle<()> {
    let server = grpc_server(args)
        .add_service(sidecar_service(engine, false))
        .serve_with_incoming_shutdown(ReceiverStream::new(conns), stopped(stop));
    tokio::spawn(async move {
        let _ = server.await;
    })
}

/// The line tests and the operator's probes read to find the ports.
fn announce_ready(args: &SidecarArgs, engine: &Engine, http_addr: &str, peer_addr: Option<&str>) {
    println!(
        "weft sidecar ready: socket={} http={http_addr} peer={} job={}",
        args.socket.display(),
        peer_addr.unwrap_or(""),
        engine.state.job
    );
    use std::io::Write;
    let _ = std::io::stdout().flush();
}

/// Pod termination after signal `sig`: abort the ranks, tell the peers (or,
/// with a recovery board, post this pod's deaths), stop the servers (1 s
/// each at most) and remove the sockets.
async fn shut_down(args: &SidecarArgs, engine: &Arc<Engine>, sig: &str, running: Running) {
    engine::terminate(
        engine,
        sig,
        Duration::from_secs_f64(args.grace.clamp(0.1, 60.0)),
    )
    .await;
    if !args.peers.is_empty() {
        let reason = format!(
            "host {} is terminating ({sig}: pod shutdown)",
            engine.state.host
        );
        peers::tell_peers(engine, &args.peers, &reason).await;
    }
    let _ = running.stop.send(true);
    for server in running.servers {
        let _ = tokio::time::timeout(Duration::from_secs(1), server).await;
    }
    let _ = std::fs::remove_file(&args.socket);
    if let Some(p) = &running.proxy {
        let _ = std::fs::remove_file(&p.socket_path);
    }
}
