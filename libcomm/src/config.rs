//! Communicator configuration: defaults, environment variables, builder.
//!
//! Environment variables (read once per `Config::from_env`):
//! - `WEFT_TIMEOUT_MS`: give up on a collective that makes no progress for this
//!   long (default 0 = never, like NCCL: slow peers are legitimate).
//! - `WEFT_PEER_TIMEOUT_MS`: how long a dead or unreachable peer may take to be
//!   noticed (default 10000). A local peer's death is noticed within ~200 ms.
//! - `WEFT_INIT_TIMEOUT_MS`: bootstrap deadline (default 120000).
//! - `WEFT_ALGO`: algorithm override, e.g. `ring`, `rd`, or `allreduce:ring,broadcast:tree`.
//! - `WEFT_TRANSPORT`: `auto` (shm within a host, TCP across), `shm`, or `tcp`.
//! - `WEFT_SHM_RING_BYTES`: capacity of each shared-memory ring (power of two).
//! - `WEFT_HOSTNAME`: host identity override (to place ranks on distinct "hosts").
//! - `WEFT_NET_IF` / `WEFT_LISTEN_ADDR`: where the peer listener binds.

use crate::algo::tuner::AlgoOverride;
use crate::error::{Error, Result};
use std::time::Duration;

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
}

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
        }
    }
}

fn env_ms(name: &str) -> Result<Option<Duration>> {
    match std::env::var(name) {
        Ok(v) if !v.trim().is_empty() => v
            .trim()
            .parse::<u64>()
            .map(|ms| Some(Duration::from_millis(ms)))
            .map_err(|_| Error::arg(format!("{name}={v}: expected milliseconds"))),
        _ => Ok(None),
    }
}

fn env_str(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
}

impl Config {
    /// Defaults overridden by the `WEFT_*` environment variables.
    pub fn from_env() -> Result<Config> {
        let mut c = Config::default();
        if let Some(t) = env_ms("WEFT_TIMEOUT_MS")? {
            c.timeout = (!t.is_zero()).then_some(t);
        }
        if let Some(t) = env_ms("WEFT_PEER_TIMEOUT_MS")? {
            c.peer_timeout = t.max(Duration::from_millis(100));
        }
        if let Some(t) = env_ms("WEFT_INIT_TIMEOUT_MS")? {
            c.init_timeout = t.max(Duration::from_millis(100));
        }
        if let Some(a) = env_str("WEFT_ALGO") {
            c.algo = a.parse()?;
        }
        if let Some(t) = env_str("WEFT_TRANSPORT") {
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
        if let Some(v) = env_str("WEFT_SHM_RING_BYTES") {
            let n: usize = v
                .parse()
                .map_err(|_| Error::arg(format!("WEFT_SHM_RING_BYTES={v}: expected bytes")))?;
            if !n.is_power_of_two() || !(4096..=1 << 30).contains(&n) {
                return Err(Error::arg(format!(
                    "WEFT_SHM_RING_BYTES={v}: must be a power of two between 4096 and 1 GiB"
                )));
            }
            c.shm_ring_bytes = Some(n);
        }
        c.hostname = env_str("WEFT_HOSTNAME");
        c.listen_addr = env_str("WEFT_LISTEN_ADDR");
        if let Some(b) = env_str("NCCL_COMM_BLOCKING") {
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
