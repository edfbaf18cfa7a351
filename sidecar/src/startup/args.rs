//! `weft sidecar`'s options.

use std::net::SocketAddr;
use std::path::PathBuf;

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
