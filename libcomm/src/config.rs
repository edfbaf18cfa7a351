//! Communicator configuration: defaults, environment variables, builder.
//!
//! The variables are declared (type, default, help) in the parameter
//! registry, `weft_contract::params`, and read through it (once per
//! `Config::from_env`): `WEFT_TIMEOUT_MS`, `WEFT_PEER_TIMEOUT_MS`,
//! `WEFT_INIT_TIMEOUT_MS`, `WEFT_ALGO`, `WEFT_TRANSPORT`,
//! `WEFT_SHM_RING_BYTES`, `WEFT_HOSTNAME`, `WEFT_LISTEN_ADDR`,
//! `NCCL_COMM_BLOCKING`. README.md's configuration table lists them.

use crate::error::{Error, Result};
use crate::op::tuner::AlgoOverride;
use std::time::Duration;
use weft_contract::params::{self, Param};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransportPref {
    Auto,
    Shm,
    Tcp,
}

#[derive(Debug, Clone)]
pub struct Config {
    /// Non-blocking communicators return from init/split at once (NCCL `blocking = 0`).
    pub blocking: bool,
    pub timeout: Option<Duration>,
    pub peer_timeout: Duration,
    pub init_timeout: Duration,
    pub algo: AlgoOverride,
    pub transport: TransportPref,
    pub shm_ring_bytes: Option<usize>,
    pub hostname: Option<String>,
    pub listen_addr: Option<String>,
    /// A label shown in errors and logs (NCCL's `commName`).
    pub name: Option<String>,
    /// Collectives of at least this many bytes on a communicator spanning
    /// hosts run on the cross-host engine (`WEFT_CROSSHOST_MIN_BYTES`;
    /// `None`: never).
    pub cross_engine_min_bytes: Option<usize>,
    /// The engine moves its bytes through the sidecar proxy
    /// (`WEFT_CROSSHOST_NET=proxy`) rather than over its own TCP
    /// connections.
    pub cross_engine_via_proxy: bool,
    /// Remote ranks the engine connects to at most before it connects only
    /// to its rail (`WEFT_CROSSHOST_MAX_PEERS`).
    pub cross_engine_max_peers: usize,
    /// Device collectives across hosts run hierarchically where the layout
    /// allows (`WEFT_CROSSHOST_HIER`, on by default).
    pub device_hier: bool,
    /// The smallest device collective (all its data) that runs
    /// hierarchically (`WEFT_CROSSHOST_HIER_MIN_BYTES`).
    pub device_hier_min_bytes: usize,
}

/// The most remote ranks a rank's cross-host engine connects to when
/// `WEFT_CROSSHOST_MAX_PEERS` is unset: a send and a receive connection
/// each, `WEFT_NET_SOCKETS` sockets with a helper thread apiece (64 threads
/// a rank with the default 4 sockets).
pub const DEFAULT_CROSSHOST_MAX_PEERS: usize = 8;

/// The smallest device collective that runs hierarchically across hosts
/// when `WEFT_CROSSHOST_HIER_MIN_BYTES` is unset: measured on 2 hosts x 2
/// GPUs (docs/PERFORMANCE-GPU.md, "Across hosts"), the staged path won up
/// to 4 MiB and the hierarchical one from 16 MiB.
pub const DEFAULT_HIER_MIN_BYTES: usize = 8 << 20;

impl Default for Config {
    fn default() -> Self {
        Config {
            blocking: true,
            timeout: None,
            peer_timeout: Duration::from_secs(10),
            init_timeout: Duration::from_secs(120),
            algo: AlgoOverride::default(),
            transport: TransportPref::Auto,
            shm_ring_bytes: None,
            hostname: None,
            listen_addr: None,
            name: None,
            cross_engine_min_bytes: None,
            cross_engine_via_proxy: false,
            cross_engine_max_peers: DEFAULT_CROSSHOST_MAX_PEERS,
            device_hier: true,
            device_hier_min_bytes: DEFAULT_HIER_MIN_BYTES,
        }
    }
}

fn env_ms(p: Param<u64>) -> Result<Option<Duration>> {
    p.try_get()
        .map(|ms| ms.map(Duration::from_millis))
        .map_err(|e| Error::arg(e.to_string()))
}

/// Set and not blank (the value as set).
fn env_str(p: Param<String>) -> Option<String> {
    p.raw().filter(|v| !v.trim().is_empty())
}

impl Config {
    /// Defaults overridden by the `WEFT_*` environment variables.
    pub fn from_env() -> Result<Config> {
        let mut c = Config::default();
        if let Some(t) = env_ms(params::WEFT_TIMEOUT_MS)? {
            c.timeout = (!t.is_zero()).then_some(t);
        }
        if let Some(t) = env_ms(params::WEFT_PEER_TIMEOUT_MS)? {
            c.peer_timeout = t.max(Duration::from_millis(100));
        }
        if let Some(t) = env_ms(params::WEFT_INIT_TIMEOUT_MS)? {
            c.init_timeout = t.max(Duration::from_millis(100));
        }
        c.algo = AlgoOverride::from_env()?;
        if let Some(t) = env_str(params::WEFT_TRANSPORT) {
            c.transport = match t.to_ascii_lowercase().as_str() {
                "auto" => TransportPref::Auto,
                "shm" => TransportPref::Shm,
                "tcp" | "socket" => TransportPref::Tcp,
                other => {
                    return Err(Error::arg(format!(
                        "WEFT_TRANSPORT={other}: expected auto, shm or tcp"
                    )));
                }
            };
        }
        if let Some(v) = params::WEFT_SHM_RING_BYTES
            .raw()
            .filter(|v| !v.trim().is_empty())
        {
            let n = weft_contract::params::parse_bytes(&v)
                .and_then(|n| usize::try_from(n).ok())
                .ok_or_else(|| {
                    Error::arg(format!(
                        "WEFT_SHM_RING_BYTES={v}: expected bytes (a whole number, optionally with K, M or G)"
                    ))
                })?;
            if !n.is_power_of_two() || !(4096..=1 << 30).contains(&n) {
                return Err(Error::arg(format!(
                    "WEFT_SHM_RING_BYTES={v}: must be a power of two between 4096 and 1 GiB"
                )));
            }
            c.shm_ring_bytes = Some(n);
        }
        c.cross_engine_min_bytes = params::WEFT_CROSSHOST_MIN_BYTES
            .try_get()
            .map_err(|e| Error::arg(e.to_string()))?;
        c.cross_engine_via_proxy = params::WEFT_CROSSHOST_NET
            .try_get()
            .map_err(|e| Error::arg(e.to_string()))?
            .is_some_and(|v| v == "proxy");
        if let Some(n) = params::WEFT_CROSSHOST_MAX_PEERS
            .try_get()
            .map_err(|e| Error::arg(e.to_string()))?
        {
            c.cross_engine_max_peers = n;
        }
        c.device_hier = params::WEFT_CROSSHOST_HIER
            .try_get()
            .map_err(|e| Error::arg(e.to_string()))?
            .is_none_or(|v| v != "0");
        if let Some(n) = params::WEFT_CROSSHOST_HIER_MIN_BYTES
            .try_get()
            .map_err(|e| Error::arg(e.to_string()))?
        {
            c.device_hier_min_bytes = n;
        }
        c.hostname = env_str(params::WEFT_HOSTNAME);
        c.listen_addr = env_str(params::WEFT_LISTEN_ADDR);
        if let Some(b) = params::NCCL_COMM_BLOCKING
            .raw()
            .filter(|v| !v.trim().is_empty())
        {
            c.blocking = b != "0";
        }
        Ok(c)
    }

    pub fn blocking(mut self, b: bool) -> Self {
        self.blocking = b;
        self
    }
    pub fn timeout(mut self, t: Option<Duration>) -> Self {
        self.timeout = t;
        self
    }
    pub fn peer_timeout(mut self, t: Duration) -> Self {
        self.peer_timeout = t;
        self
    }
    pub fn init_timeout(mut self, t: Duration) -> Self {
        self.init_timeout = t;
        self
    }
    pub fn name(mut self, n: impl Into<String>) -> Self {
        self.name = Some(n.into());
        self
    }
}
