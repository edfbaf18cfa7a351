//! `weft sidecar` start-up: the one place where the engine (the ranks'
//! gRPC socket, job state, peer heartbeats, HTTP port) and the network
//! proxy are composed. The engine's listeners are given the proxy's route
//! for connections on the peer port; the proxy is given the engine as the
//! sink of lost hosts; the engine's status is given the proxy's host views.

use crate::engine::{
    self, Engine, MAX_MESSAGE, SidecarArgs, auth, host_name, http, listen, peers, service,
    telemetry,
};
use crate::log::log;
use crate::proxy::{self, Proxy};
use crate::rpc;
use crate::seams::{JobEvents, Route};
use std::sync::Arc;
use std::time::Duration;

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
    let (conn_tx, conn_rx) = tokio::sync::mpsc::channel(64);
    // Connections open with the HTTP/2 preface (gRPC) or one of these.
    let routes: Arc<[Route]> = Arc::from(vec![proxy::route(the_proxy.as_ref())]);
    tokio::spawn(listen::accept_loop(
        listen::Listener::Unix(listener),
        engine.clone(),
        routes.clone(),
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
            routes.clone(),
            ptx,
        ));
        let e2 = engine.clone();
        let svc = tonic::service::interceptor::InterceptedService::new(
            rpc::sidecar_server::SidecarServer::new(service::Service {
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
    let svc = rpc::sidecar_server::SidecarServer::new(service::Service {
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
