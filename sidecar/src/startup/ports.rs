//! The sidecar's own ports, bound at start-up (the ranks' Unix socket, the
//! HTTP port; the peer port is bound with its server), the connection caps
//! of every port, and the signals that stop the sidecar.

use super::args::SidecarArgs;
use crate::engine::http::HttpLimits;
use crate::engine::limits::Gate;
use crate::engine::listen::{self, PortLimits};
use crate::engine::{Engine, MAX_PROXY_HANDSHAKES, MAX_PROXY_HANDSHAKES_PER_SOURCE};
use crate::log::RateLog;
use std::io;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::{TcpListener, UnixListener};
use tokio::signal::unix::{Signal, SignalKind, signal};

/// SIGTERM and SIGINT, either of which stops the sidecar.
pub(super) struct Signals {
    term: Signal,
    int: Signal,
}

impl Signals {
    fn install() -> io::Result<Signals> {
        Ok(Signals {
            term: signal(SignalKind::terminate())?,
            int: signal(SignalKind::interrupt())?,
        })
    }

    /// Waits for the first; returns its name.
    pub(super) async fn first(&mut self) -> &'static str {
        tokio::select! {
            _ = self.term.recv() => "SIGTERM",
            _ = self.int.recv() => "SIGINT",
        }
    }
}

/// The ranks' Unix socket and the HTTP port, bound, and the signals
/// installed.
pub(super) struct Ports {
    pub socket: UnixListener,
    pub http: TcpListener,
    pub http_addr: String,
    pub signals: Signals,
}

impl Ports {
    pub(super) async fn bind(args: &SidecarArgs) -> Result<Ports, String> {
        let socket = listen::bind(&args.socket)
            .map_err(|e| format!("cannot bind {}: {e}", args.socket.display()))?;
        let http = TcpListener::bind(args.http)
            .await
            .map_err(|e| format!("cannot bind the HTTP port {}: {e}", args.http))?;
        let http_addr = http.local_addr().map(|a| a.to_string()).unwrap_or_default();
        let signals =
            Signals::install().map_err(|_| "cannot install signal handlers".to_string())?;
        Ok(Ports {
            socket,
            http,
            http_addr,
            signals,
        })
    }
}

/// Each port's connection caps (`--max-connections`, per source) and
/// deadlines; one rate-limited log line for all of them.
pub(super) struct Limits {
    pub socket: PortLimits,
    pub peer: PortLimits,
    pub http: HttpLimits,
}

impl Limits {
    pub(super) fn new(args: &SidecarArgs, engine: &Arc<Engine>) -> Limits {
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
        Limits {
            socket: PortLimits {
                gate: gate("socket", "socket", max, max),
                handshakes: gate("proxy", "socket", 1, 1), // no route is served on the socket
                handshake,
            },
            peer: PortLimits {
                gate: gate("peer", "peer port", max, per),
                handshakes: gate(
                    "proxy",
                    "peer port (proxy handshake)",
                    MAX_PROXY_HANDSHAKES,
                    MAX_PROXY_HANDSHAKES_PER_SOURCE,
                ),
                handshake,
            },
            http: HttpLimits {
                gate: gate("http", "HTTP port", max, per),
                header: handshake,
                idle: Duration::from_millis(args.idle_timeout_ms.max(100)),
            },
        }
    }
}
