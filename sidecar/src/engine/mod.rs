//! `weft sidecar`: the per-pod engine. It serves the pod's rank processes over
//! a Unix socket (gRPC `weft.v1.Sidecar`), holds the job state RAS reports,
//! turns every collective into an OpenTelemetry span and Prometheus metrics,
//! and ties the ranks to the pod's lifecycle (SIGTERM aborts them).

pub mod auth;
pub mod http;
pub mod listen;
pub mod metrics;
pub mod peers;
pub mod service;
pub mod spawn;
pub mod state;
pub mod telemetry;

use crate::rpc;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

/// Largest gRPC message the sidecar decodes (status replies are built, not decoded).
pub const MAX_MESSAGE: usize = 1 << 20;

pub fn log(msg: &str) {
    eprintln!("weft sidecar: {msg}");
}

pub struct Engine {
    pub state: Arc<state::State>,
    pub metrics: metrics::Metrics,
    pub auth: auth::Auth,
    pub telemetry: OnceLock<telemetry::Telemetry>,
    /// Peer sidecars' addresses (`--peers`), for job-wide status.
    pub peers: OnceLock<Vec<String>>,
    /// The network proxy (with `--peer-listen`, unless `--no-proxy`).
    pub proxy: OnceLock<Arc<crate::proxy::Proxy>>,
}

impl Engine {
    pub fn new(job: String, host: String, secret: Option<String>) -> Arc<Engine> {
        Arc::new(Engine {
            state: state::State::new(job.clone(), host),
            metrics: metrics::Metrics::new(),
            auth: auth::Auth { job, secret },
            telemetry: OnceLock::new(),
            peers: OnceLock::new(),
            proxy: OnceLock::new(),
        })
    }

    /// The published snapshot with the proxy's live counters per host
    /// (atomics: no lock shared with anything).
    pub fn status(&self) -> rpc::Status {
        let mut s = (*self.state.snapshot()).clone();
        if let Some(p) = self.proxy.get() {
            for v in p.view() {
                let ip = v.ip.to_string();
                let i = match s.hosts.iter().position(|h| {
                    h.addr
                        .rsplit_once(':')
                        .map(|x| x.0.trim_matches(['[', ']']))
                        == Some(&ip)
                }) {
                    Some(i) => i,
                    None => {
                        s.hosts.push(rpc::HostStatus {
                            host: v.name.clone(),
                            addr: ip.clone(),
                            state: "unknown".into(),
                            ..Default::default()
                        });
                        s.hosts.len() - 1
                    }
                };
                let h = &mut s.hosts[i];
                h.proxy = v.state.into();
                h.proxy_tx_bytes = v.tx_bytes;
                h.proxy_rx_bytes = v.rx_bytes;
                h.proxy_connects = v.connects;
            }
        }
        s
    }
}

/// `weft sidecar` options.
#[derive(Debug, Clone, clap::Args)]
pub struct SidecarArgs {
    /// The Unix socket ranks attach to (export it as WEFT_SIDECAR_SOCKET).
    #[arg(long, env = "WEFT_SIDECAR_SOCKET", value_name = "PATH")]
    pub socket: PathBuf,
    /// HTTP port for /metrics, /healthz, /readyz, /ras (port 0: any free port).
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:9464")]
    pub http: SocketAddr,
    /// Job name (WEFT_JOB).
    #[arg(long, env = "WEFT_JOB", default_value = "anon")]
    pub job: String,
    /// Host name reported in RAS (default: this machine's).
    #[arg(long, env = "WEFT_HOSTNAME")]
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
}

/// This machine's host name (the rank side's, shared).
pub use weft_agent::host_name;

/// Runs the sidecar until SIGTERM/SIGINT; returns the exit code.
pub fn run(args: SidecarArgs) -> i32 {
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
    // The proxy's socket exists before the control socket: a rank that
    // attached can rely on its presence meaning "proxy offered".
    if let Some(addr) = args.peer_listen
        && !args.no_proxy
    {
        match crate::proxy::start(
            engine.clone(),
            &args.socket,
            args.peers.clone(),
            addr.port(),
            Duration::from_millis(args.peer_timeout_ms.max(100)),
        ) {
            Ok(p) => {
                let _ = engine.proxy.set(p);
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
    let (conn_tx, conn_rx) = tokio::sync::mpsc::channel(64);
    tokio::spawn(listen::accept_loop(
        listen::Listener::Unix(listener),
        engine.clone(),
        conn_tx,
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
            ptx,
        ));
        let e2 = engine.clone();
        let svc = tonic::service::interceptor::InterceptedService::new(
            crate::rpc::sidecar_server::SidecarServer::new(service::Service {
                engine: engine.clone(),
            })
            .max_decoding_message_size(MAX_MESSAGE),
            move |req: tonic::Request<()>| peers::check(&e2, &req).map(|_| req),
        );
        let mut stop = stop_rx.clone();
        peer_server = Some(tokio::spawn(
            tonic::transport::Server::builder()
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
    let svc = crate::rpc::sidecar_server::SidecarServer::new(service::Service {
        engine: engine.clone(),
    })
    .max_decoding_message_size(MAX_MESSAGE);
    let mut stop = stop_rx.clone();
    let grpc = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(svc)
            .serve_with_incoming_shutdown(
                tokio_stream::wrappers::ReceiverStream::new(conn_rx),
                async move {
                    let _ = stop.wait_for(|s| *s).await;
                },
            ),
    );
    let mut stop = stop_rx.clone();
    let router = http::router(engine.clone());
    let web = tokio::spawn(async move {
        axum::serve(http, router)
            .with_graceful_shutdown(async move {
                let _ = stop.wait_for(|s| *s).await;
            })
            .await
    });
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
    terminate(
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
    if let Some(p) = engine.proxy.get() {
        let _ = std::fs::remove_file(&p.socket_path);
    }
    0
}

/// Pod termination: abort every communicator of every attached process, wait
/// (bounded) until they have gone, then let the servers stop.
async fn terminate(engine: &Arc<Engine>, sig: &str, grace: Duration) {
    engine.state.terminating.store(true, Ordering::Relaxed);
    engine.state.publish(&engine.state.lock());
    let reason = format!(
        "the sidecar of host {} is terminating ({sig}: pod shutdown)",
        engine.state.host
    );
    // Failed rather than aborted: a call that starts after this (not only
    // one in flight) returns the remote error with this reason, not a usage error.
    let n = engine.fail_comm("", &reason, 0);
    log(&format!(
        "{sig}: aborting the communicators of {n} process(es)"
    ));
    // Ranks acknowledge by aborting (their streams stay open until they exit);
    // half the grace is enough for the abort commands to be read.
    let deadline = Instant::now() + grace / 2;
    while Instant::now() < deadline {
        let live = engine
            .state
            .lock()
            .procs
            .values()
            .filter(|p| p.alive)
            .count();
        if live == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
