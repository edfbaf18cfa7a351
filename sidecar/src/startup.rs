//! `weft sidecar` start-up: the one place where the engine (the ranks'
//! gRPC socket, job state, peer heartbeats, HTTP port) and the network
//! proxy are composed. The engine's listeners are given the proxy's route
//! for connections on the peer port; the proxy is given the engine as the
//! sink of lost hosts; the engine's status is given the proxy's host views.

use crate::engine::limits::Gate;
use crate::engine::{
    self, Engine, KEEPALIVE_ACK, MAX_MESSAGE, MAX_PROXY_HANDSHAKES,
    MAX_PROXY_HANDSHAKES_PER_SOURCE, MAX_STREAMS, auth, board, board_relay, host_name, http,
    listen, peer_rpc, peers, service, telemetry,
};
use crate::log::RateLog;
use crate::log::log;
use crate::proxy::{self, Proxy};
use crate::seams::{JobEvents, Route};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use weft_agent::rpc;

/// `weft sidecar` options.
#[derive(Debug, Clone, clap::Args)]
pub struct SidecarArgs {
    /// The Unix socket ranks attach to (export it as WEFT_SIDECAR_SOCKET).
    #[arg(long, env = weft_contract::params::WEFT_SIDECAR_SOCKET.name(), value_name = "PATH")]
    pub socket: PathBuf,
    /// HTTP port for /metrics, /healthz, /readyz, /ras (port 0: any free port).
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:9464")]
    pub http: SocketAddr,
    /// Job name (WEFT_JOB).
    #[arg(long, env = weft_contract::params::WEFT_JOB.name(), default_value = "anon")]
    pub job: String,
    /// Host name reported in RAS (default: this machine's).
    #[arg(long, env = weft_contract::params::WEFT_HOSTNAME.name())]
    pub host: Option<String>,
    /// TCP address peer sidecars reach us on (heartbeats, abort); off when unset.
    #[arg(long, value_name = "ADDR")]
    pub peer_listen: Option<SocketAddr>,
    /// Peer sidecars (other hosts of the job), comma-separated HOST:PORT.
    #[arg(long, value_name = "ADDRS", value_delimiter = ',')]
    pub peers: Vec<String>,
    /// A peer that does not answer heartbeats for this long is a lost host.
    #[arg(long, value_name = "MS", default_value = "3000")]
    pub peer_timeout_ms: u64,
    /// A peer that has never answered is lost only after this long (pods of
    /// one job start minutes apart when images are pulled); 0: after
    /// --peer-timeout-ms like any other.
    #[arg(long, value_name = "MS", default_value = "0")]
    pub peer_startup_grace_ms: u64,
    /// Seconds the ranks get to acknowledge an abort on SIGTERM before we exit.
    #[arg(long, value_name = "SECS", default_value = "2")]
    pub grace: f64,
    /// Do not offer the network proxy (ranks then connect to other hosts
    /// directly over TCP). The proxy needs --peer-listen.
    #[arg(long)]
    pub no_proxy: bool,
    /// Open connections per port (HTTP, socket, peer port) at most; at the
    /// cap a new one displaces the oldest idle or unauthenticated one.
    #[arg(long, value_name = "N", default_value = "256")]
    pub max_connections: usize,
    /// Open connections per source address and port (HTTP, peer port) at most.
    #[arg(long, value_name = "N", default_value = "32")]
    pub max_connections_per_source: usize,
    /// From accept to the HTTP/2 preface and SETTINGS (gRPC), to the end of
    /// a proxy handshake, to a complete HTTP request header.
    #[arg(long, value_name = "MS", default_value = "5000")]
    pub handshake_timeout_ms: u64,
    /// An HTTP connection that moves no byte for this long is closed; the
    /// gRPC servers ping a connection silent for this long (HTTP/2
    /// keepalive) and close it when the ping is not answered.
    #[arg(long, value_name = "MS", default_value = "60000")]
    pub idle_timeout_ms: u64,
}

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

async fn serve(args: SidecarArgs, engine: Arc<Engine>) -> i32 {
    use tokio::signal::unix::{SignalKind, signal};
    if telemetry::enabled() {
        match telemetry::Telemetry::start("weft-sidecar", engine.metrics.spans_dropped.clone()) {
            Ok(t) => {
                let _ = engine.telemetry.set(t);
            }
            Err(e) => log(&format!("tracing disabled: {e}")),
        }
    }
    tokio::spawn(engine.state.clone().publisher());
    let mut the_proxy: Option<Arc<Proxy>> = None;
    // The proxy's socket exists before the control socket: a rank that
    // attached can rely on its presence meaning "proxy offered".
    if let Some(addr) = args.peer_listen
        && !args.no_proxy
    {
        let cfg = proxy::Config {
            job: engine.auth.job.clone(),
            secret: engine.auth.secret.clone().unwrap_or_default(),
            host: engine.state.host.clone(),
            peers: args.peers.clone(),
            own_port: addr.port(),
            timeout: Duration::from_millis(args.peer_timeout_ms.max(100)),
        };
        let events: Arc<dyn JobEvents> = engine.clone();
        match proxy::start(cfg, &args.socket, engine.metrics.clone(), events) {
            Ok(p) => {
                let _ = engine.host_views.set(p.clone());
                the_proxy = Some(p);
            }
            Err(e) => {
                log(&format!("cannot start the proxy: {e}"));
                return 1;
            }
        }
    }
    let listener = match listen::bind(&args.socket) {
        Ok(l) => l,
        Err(e) => {
            log(&format!("cannot bind {}: {e}", args.socket.display()));
            return 1;
        }
    };
    let http = match tokio::net::TcpListener::bind(args.http).await {
        Ok(l) => l,
        Err(e) => {
            log(&format!("cannot bind the HTTP port {}: {e}", args.http));
            return 1;
        }
    };
    let http_addr = http.local_addr().map(|a| a.to_string()).unwrap_or_default();
    let (mut term, mut int) = match (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) {
        (Ok(t), Ok(i)) => (t, i),
        _ => {
            log("cannot install signal handlers");
            return 1;
        }
    };
    let handshake = Duration::from_millis(args.handshake_timeout_ms.max(10));
    let rate_log = Arc::new(RateLog::default());
    let gate = |port: &'static str, what: &'static str, max: usize, per: usize| {
        Gate::new(
            port,
            what,
            max,
            per,
            engine.metrics.clone(),
            rate_log.clone(),
        )
    };
    let (max, per) = (args.max_connections, args.max_connections_per_source);
    let socket_limits = listen::PortLimits {
        gate: gate("socket", "socket", max, max),
        handshakes: gate("proxy", "socket", 1, 1), // no route is served on the socket
        handshake,
    };
    let peer_limits = listen::PortLimits {
        gate: gate("peer", "peer port", max, per),
        handshakes: gate(
            "proxy",
            "peer port (proxy handshake)",
            MAX_PROXY_HANDSHAKES,
            MAX_PROXY_HANDSHAKES_PER_SOURCE,
        ),
        handshake,
    };
    let http_limits = http::HttpLimits {
        gate: gate("http", "HTTP port", max, per),
        header: handshake,
        idle: Duration::from_millis(args.idle_timeout_ms.max(100)),
    };
    let (conn_tx, conn_rx) = tokio::sync::mpsc::channel(64);
    // Connections open with the HTTP/2 preface (gRPC) or one of these.
    let routes: Arc<[Route]> = Arc::from(vec![proxy::route(the_proxy.as_ref())]);
    tokio::spawn(listen::accept_loop(
        listen::Listener::Unix(listener),
        engine.clone(),
        routes.clone(),
        conn_tx,
        socket_limits,
    ));
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut peer_server = None;
    let mut peer_addr = String::new();
    if let Some(addr) = args.peer_listen {
        let l = match tokio::net::TcpListener::bind(addr).await {
            Ok(l) => l,
            Err(e) => {
                log(&format!("cannot bind the peer port {addr}: {e}"));
                return 1;
            }
        };
        peer_addr = l.local_addr().map(|a| a.to_string()).unwrap_or_default();
        let (ptx, prx) = tokio::sync::mpsc::channel(64);
        tokio::spawn(listen::accept_loop(
            listen::Listener::Tcp(l),
            engine.clone(),
            routes.clone(),
            ptx,
            peer_limits,
        ));
        let e2 = engine.clone();
        let svc = tonic::service::interceptor::InterceptedService::new(
            rpc::sidecar_server::SidecarServer::new(service::Service {
                engine: engine.clone(),
                peer_port: true,
            })
            .max_decoding_message_size(MAX_MESSAGE),
            move |req: tonic::Request<()>| peer_rpc::check(&e2, &req).map(|_| req),
        );
        let mut stop = stop_rx.clone();
        peer_server = Some(tokio::spawn(
            grpc_server(&args)
                .add_service(svc)
                .serve_with_incoming_shutdown(
                    tokio_stream::wrappers::ReceiverStream::new(prx),
                    async move {
                        let _ = stop.wait_for(|s| *s).await;
                    },
                ),
        ));
    }
    let _ = engine.peers.set(args.peers.clone());
    match board::Board::from_env() {
        Ok(None) => {}
        Ok(Some(b)) => {
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
        }
        Err(e) => {
            log(&format!("cannot keep the recovery board: {e}"));
            return 1;
        }
    }
    if !args.peers.is_empty() {
        let timeout = Duration::from_millis(args.peer_timeout_ms.max(100));
        tokio::spawn(peers::heartbeat_loop(
            engine.clone(),
            args.peers.clone(),
            (timeout / 6).max(Duration::from_millis(50)),
            timeout,
            Duration::from_millis(args.peer_startup_grace_ms).max(timeout),
        ));
    }
    let svc = rpc::sidecar_server::SidecarServer::new(service::Service {
        engine: engine.clone(),
        peer_port: false,
    })
    .max_decoding_message_size(MAX_MESSAGE);
    let mut stop = stop_rx.clone();
    let grpc = tokio::spawn(
        grpc_server(&args)
            .add_service(svc)
            .serve_with_incoming_shutdown(
                tokio_stream::wrappers::ReceiverStream::new(conn_rx),
                async move {
                    let _ = stop.wait_for(|s| *s).await;
                },
            ),
    );
    let router = http::router(engine.clone());
    let web = tokio::spawn(http::serve(http, router, http_limits, stop_rx.clone()));
    // Tests and the operator's probes read this line to find the ports.
    println!(
        "weft sidecar ready: socket={} http={http_addr} peer={} job={}",
        args.socket.display(),
        peer_addr,
        engine.state.job
    );
    use std::io::Write;
    let _ = std::io::stdout().flush();
    let sig = tokio::select! {
        _ = term.recv() => "SIGTERM",
        _ = int.recv() => "SIGINT",
    };
    engine::terminate(
        &engine,
        sig,
        Duration::from_secs_f64(args.grace.clamp(0.1, 60.0)),
    )
    .await;
    if !args.peers.is_empty() {
        let reason = format!(
            "host {} is terminating ({sig}: pod shutdown)",
            engine.state.host
        );
        peers::tell_peers(&engine, &args.peers, &reason).await;
    }

    let _ = stop_tx.send(true);
    if let Some(p) = peer_server {
        let _ = tokio::time::timeout(Duration::from_secs(1), p).await;
    }
    let _ = tokio::time::timeout(Duration::from_secs(1), grpc).await;
    let _ = tokio::time::timeout(Duration::from_secs(1), web).await;
    let _ = std::fs::remove_file(&args.socket);
    if let Some(p) = &the_proxy {
        let _ = std::fs::remove_file(&p.socket_path);
    }
    0
}
