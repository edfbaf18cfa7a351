//! `UniqueId`: the 128-byte token (NCCL-sized) that ranks share to find each
//! other. It holds the bootstrap root's address, a nonce naming this
//! rendezvous, the secret that authenticates every bootstrap and peer
//! connection, and a checksum so a corrupted or foreign id is refused.
//!
//! Layout (all integers big-endian):
//! ```text
//!  0..4    magic "WEFT"       4  version (1)     5  flags
//!  6..8    root port          8..24  root IPv6 (IPv4-mapped for v4)
//! 24..40   nonce             40..72  secret        72..120 zero
//! 120..128 SHA-256(0..120)[..8]
//! ```

use crate::error::{Error, Result};
use sha2::{Digest, Sha256};
use std::net::{IpAddr, Ipv6Addr, SocketAddr, ToSocketAddrs};
use std::time::{Duration, Instant};
use weft_contract::env::{BootstrapEnv, SecretSource};
use weft_contract::params;

pub const UNIQUE_ID_BYTES: usize = 128;
const MAGIC: &[u8; 4] = b"WEFT";
const VERSION: u8 = 1;
/// Rank 0 of the communicator serves the bootstrap root at the id's address
/// (ids from `WEFT_BOOTSTRAP` / `NCCL_COMM_ID`), instead of the creator's thread.
const FLAG_RANK0_SERVES: u8 = 1;
/// The root's address was given as a host name (not an IP literal or
/// `localhost`): other hosts may resolve it to another address, so the
/// listeners keep to every interface (see `tcp::bind_ip`, `root::root_bind`).
const FLAG_ROOT_NAMED: u8 = 2;

#[derive(Clone, PartialEq, Eq)]
pub struct UniqueId {
    pub(crate) root: SocketAddr,
    pub(crate) nonce: [u8; 16],
    pub(crate) secret: [u8; 32],
    pub(crate) rank0_serves: bool,
    pub(crate) root_named: bool,
}

impl std::fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the secret.
        f.debug_struct("UniqueId")
            .field("root", &self.root)
            .field("nonce", &hex(&self.nonce[..4]))
            .field("rank0_serves", &self.rank0_serves)
            .field("root_named", &self.root_named)
            .finish_non_exhaustive()
    }
}

pub(crate) fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

impl UniqueId {
    /// The id every rank of a launched job computes identically from its
    /// environment: `WEFT_BOOTSTRAP` (or `NCCL_COMM_ID`) names where rank 0
    /// serves the root, and the job secret (`WEFT_JOB_SECRET`, or the file named
    /// by `WEFT_JOB_SECRET_FILE`) authenticates it.
    pub fn from_env() -> Result<UniqueId> {
        let env = BootstrapEnv::from_env().map_err(|_| {
            Error::arg("neither WEFT_BOOTSTRAP nor NCCL_COMM_ID is set (start ranks with `weft run`, or set WEFT_BOOTSTRAP=host:port)")
        })?;
        let secret_text = read_secret(env.secret.as_ref())?;
        let (addr, job, epoch) = (env.addr, env.job, env.restart_epoch);
        Self::from_parts(
            &addr,
            &job,
            &epoch,
            secret_text.as_deref(),
            Duration::from_secs(120),
        )
    }

    /// Builds an env-style id; `secret` None means unauthenticated (a warning is logged).
    pub fn from_parts(
        addr: &str,
        job: &str,
        epoch: &str,
        secret: Option<&str>,
        resolve_for: Duration,
    ) -> Result<UniqueId> {
        let root = resolve(addr, resolve_for)?;
        let secret_material = match secret {
            Some(s) => s.to_string(),
            None => {
                crate::log::warn_log!(
                    "no job secret (WEFT_JOB_SECRET / WEFT_JOB_SECRET_FILE): bootstrap of job '{job}' is not authenticated"
                );
                format!("weft-unauthenticated:{job}")
            }
        };
        let secret: [u8; 32] = Sha256::digest(format!("weft-secret\0{secret_material}")).into();
        let nonce_full = Sha256::digest(format!(
            "weft-nonce\0{job}\0{epoch}\0{addr}\0{}",
            hex(&secret)
        ));
        Ok(UniqueId {
            root,
            nonce: nonce_full[..16].try_into().unwrap(),
            secret,
            rank0_serves: true,
            root_named: !names_an_ip(addr),
        })
    }

    pub fn to_bytes(&self) -> [u8; UNIQUE_ID_BYTES] {
        let mut b = [0u8; UNIQUE_ID_BYTES];
        b[0..4].copy_from_slice(MAGIC);
        b[4] = VERSION;
        b[5] = if self.rank0_serves {
            FLAG_RANK0_SERVES
        } else {
            0
        } | if self.root_named { FLAG_ROOT_NAMED } else { 0 };
        b[6..8].copy_from_slice(&self.root.port().to_be_bytes());
        let v6 = match self.root.ip() {
            IpAddr::V4(v4) => v4.to_ipv6_mapped(),
            IpAddr::V6(v6) => v6,
        };
        b[8..24].copy_from_slice(&v6.octets());
        b[24..40].copy_from_slice(&self.nonce);
        b[40..72].copy_from_slice(&self.secret);
        let sum = Sha256::digest(&b[..120]);
        b[120..128].copy_from_slice(&sum[..8]);
        b
    }

    /// Parses and validates an id; refuses corrupted, foreign or newer ids with a clear message.
    pub fn from_bytes(b: &[u8]) -> Result<UniqueId> {
        if b.len() != UNIQUE_ID_BYTES {
            return Err(Error::arg(format!(
                "a unique id is {UNIQUE_ID_BYTES} bytes, got {}",
                b.len()
            )));
        }
        if &b[0..4] != MAGIC {
            return Err(Error::arg(
                "not a Weft unique id (bad magic): it was not made by Weft's GetUniqueId, or is uninitialised memory",
            ));
        }
        if b[4] != VERSION {
            return Err(Error::arg(format!(
                "unique id version {} is not supported by this Weft (expects {VERSION}); mixed Weft versions in one job?",
                b[4]
            )));
        }
        let sum = Sha256::digest(&b[..120]);
        if b[120..128] != sum[..8] || b[72..120].iter().any(|&x| x != 0) {
            return Err(Error::arg(
                "unique id is corrupted (checksum mismatch): it was altered in transit between ranks",
            ));
        }
        let port = u16::from_be_bytes([b[6], b[7]]);
        let v6 = Ipv6Addr::from(<[u8; 16]>::try_from(&b[8..24]).unwrap());
        let ip = match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6(v6),
        };
        Ok(UniqueId {
            root: SocketAddr::new(ip, port),
            nonce: b[24..40].try_into().unwrap(),
            secret: b[40..72].try_into().unwrap(),
            rank0_serves: b[5] & FLAG_RANK0_SERVES != 0,
            root_named: b[5] & FLAG_ROOT_NAMED != 0,
        })
    }

    pub fn root_addr(&self) -> SocketAddr {
        self.root
    }
}

/// Whether a `host:port` bootstrap address names its host by an IP literal
/// (or `localhost`), the same on every host.
fn names_an_ip(addr: &str) -> bool {
    let host = addr.rsplit_once(':').map(|(h, _)| h).unwrap_or(addr);
    let host = host.trim_start_matches('[').trim_end_matches(']');
    host.parse::<IpAddr>().is_ok() || host.eq_ignore_ascii_case("localhost")
}

/// The job secret from `WEFT_JOB_SECRET`, or the file `WEFT_JOB_SECRET_FILE` names.
fn read_secret(src: Option<&SecretSource>) -> Result<Option<String>> {
    match src {
        None => Ok(None),
        Some(SecretSource::Inline(s)) => Ok(Some(s.clone())),
        Some(f @ SecretSource::File(path)) => f.read().map(Some).map_err(|e| {
            Error::sys(
                format!("reading job secret from WEFT_JOB_SECRET_FILE={path}"),
                e,
            )
        }),
    }
}

/// `WEFT_LISTEN_ADDR` when set to an IP address.
pub(crate) fn listen_addr() -> Option<IpAddr> {
    params::WEFT_LISTEN_ADDR.raw().and_then(|a| a.parse().ok())
}

/// The address other hosts should use for us: `WEFT_LISTEN_ADDR`, else the
/// source address of a route towards a public range (no packet is sent), else loopback.
pub(crate) fn advertised_ip() -> IpAddr {
    if let Some(ip) = listen_addr() {
        return ip;
    }
    std::net::UdpSocket::bind("0.0.0.0:0")
        .and_then(|s| {
            s.connect("192.0.2.1:9")?; // TEST-NET-1: routing lookup only, never sent to
            s.local_addr()
        })
        .map(|a| a.ip())
        .unwrap_or(IpAddr::V4(std::net::Ipv4Addr::LOCALHOST))
}

/// Resolves `host:port`, retrying while DNS is not ready yet (a Kubernetes
/// pod's name resolves only once its Service endpoints exist).
fn resolve(addr: &str, for_at_most: Duration) -> Result<SocketAddr> {
    let deadline = Instant::now() + for_at_most;
    let mut last;
    loop {
        match addr.to_socket_addrs() {
            Ok(mut it) => match it.next() {
                Some(a) => return Ok(a),
                None => last = format!("'{addr}' resolved to no address"),
            },
            Err(e) => last = format!("cannot resolve bootstrap address '{addr}': {e}"),
        }
        if !addr.contains(':') || Instant::now() >= deadline {
            return Err(Error::arg(format!("{last} (expected host:port)")));
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> UniqueId {
        UniqueId::from_parts("127.0.0.1:4242", "job", "0", Some("s3cret"), Duration::ZERO).unwrap()
    }

    #[test]
    fn round_trips() {
        let id = sample();
        let back = UniqueId::from_bytes(&id.to_bytes()).unwrap();
        assert_eq!(back, id);
        assert_eq!(back.root.port(), 4242);
        assert!(back.rank0_serves);
    }

    #[test]
    fn every_flipped_bit_is_refused() {
        let b = sample().to_bytes();
        for i in 0..UNIQUE_ID_BYTES * 8 {
            let mut c = b;
            c[i / 8] ^= 1 << (i % 8);
            assert!(UniqueId::from_bytes(&c).is_err(), "bit {i} flip accepted");
        }
    }

    #[test]
    fn foreign_ids_are_refused_with_reason() {
        let err = UniqueId::from_bytes(&[0u8; 128]).unwrap_err().to_string();
        assert!(err.contains("not a Weft unique id"), "{err}");
        let err = UniqueId::from_bytes(&[0u8; 12]).unwrap_err().to_string();
        assert!(err.contains("128 bytes"), "{err}");
    }

    #[test]
    fn a_named_root_is_remembered_through_the_bytes() {
        let lit = sample();
        assert!(!lit.root_named);
        let named =
            UniqueId::from_parts("localhost:4242", "job", "0", Some("s"), Duration::ZERO).unwrap();
        assert!(!named.root_named, "localhost is loopback everywhere");
        let mut by_name = named.clone();
        by_name.root_named = true;
        assert_eq!(UniqueId::from_bytes(&by_name.to_bytes()).unwrap(), by_name);
        assert!(names_an_ip("[::1]:7") && names_an_ip("10.0.0.1:7"));
        assert!(!names_an_ip("rank0.svc:7") && !names_an_ip("myhost:7"));
    }

    #[test]
    fn same_env_gives_same_id_and_secret_matters() {
        let a = UniqueId::from_parts("127.0.0.1:1", "j", "0", Some("x"), Duration::ZERO).unwrap();
        let b = UniqueId::from_parts("127.0.0.1:1", "j", "0", Some("x"), Duration::ZERO).unwrap();
        let c = UniqueId::from_parts("127.0.0.1:1", "j", "0", Some("y"), Duration::ZERO).unwrap();
        assert_eq!(a, b);
        assert_ne!(a.secret, c.secret);
        assert_ne!(a.nonce, c.nonce);
    }
}
