//! The job-secret handshake: how every Weft protocol proves that the other
//! side holds the job's secret, written once.
//!
//! Each protocol keeps its own frames and its own MAC inputs (the wire
//! bytes do not change); what they share is here:
//!
//! - a fresh random [`challenge`] per connection (so nothing recorded can be
//!   replayed under another one);
//! - [`tag`]: HMAC-SHA256 keyed with the job secret over the concatenation of
//!   the protocol's parts, its domain-separation label first where it has
//!   one (`weft-proxy`, `weft-peer`, `weft-attach`; the bootstrap frames
//!   have none and MAC the challenge, the header and the payload); checked
//!   in constant time by [`check`] (and [`tag_hex`]/[`check_hex`] for the
//!   protocols that carry the tag as hex text);
//! - bounded reads of a handshake message before a deadline
//!   ([`read_exact_by`], and [`read_msg`]/[`write_msg`] for messages framed
//!   by a big-endian `u32` length);
//! - for time-stamped requests (no challenge round trip): the skew window
//!   ([`check_fresh`]) and the memory of MACs already seen ([`ReplayGuard`]);
//! - [`HandshakeError`]: one error per cause, each with a clear message.
//!
//! Users: the bootstrap and the direct TCP endpoint (`bootstrap::wire`), the
//! sidecar proxy between hosts (`weft::proxy::wire`), the sidecars' peer
//! heartbeats and a rank's attach to its sidecar (`weft::engine`).

use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;
use std::collections::HashMap;
use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Bytes of a challenge (a nonce).
pub const CHALLENGE: usize = 16;
/// Bytes of a tag (HMAC-SHA256).
pub const TAG: usize = 32;

pub type Challenge = [u8; CHALLENGE];
pub type Tag = [u8; TAG];

/// Why a handshake failed. `what` names the protocol's message ("bootstrap",
/// "handshake").
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HandshakeError {
    /// The tag does not match: the peer does not hold this job's secret (or
    /// answered another challenge).
    #[error("HMAC mismatch")]
    BadTag,
    #[error("{what} message of {len} bytes exceeds the limit of {max}")]
    Oversized {
        what: &'static str,
        len: usize,
        max: usize,
    },
    #[error("truncated {what} message")]
    Truncated { what: &'static str },
    #[error("timed out waiting for a {what} message")]
    TimedOut { what: &'static str },
    #[error("connection closed by the other side during {what}")]
    Closed { what: &'static str },
    #[error("reading {what} message: {why}")]
    Io { what: &'static str, why: String },
    #[error("stale or future timestamp")]
    Stale,
    #[error("replayed request")]
    Replayed,
    #[error("no system randomness: {0}")]
    NoRandomness(String),
}

/// A fresh random challenge.
pub fn challenge() -> Result<Challenge, HandshakeError> {
    random_bytes()
}

/// `N` bytes from the system's randomness: challenges, nonces, ids and secrets
/// all come from here.
pub fn random_bytes<const N: usize>() -> Result<[u8; N], HandshakeError> {
    let mut b = [0u8; N];
    getrandom::fill(&mut b).map_err(|e| HandshakeError::NoRandomness(e.to_string()))?;
    Ok(b)
}

/// [`random_bytes`] as a libcomm error, for nonces and ids.
pub(crate) fn random<const N: usize>() -> crate::error::Result<[u8; N]> {
    random_bytes().map_err(|e| crate::error::Error::Internal(e.to_string()))
}

fn hmac(secret: &[u8], parts: &[&[u8]]) -> Hmac<Sha256> {
    let mut m = <Hmac<Sha256> as KeyInit>::new_from_slice(secret).expect("any key length");
    for p in parts {
        m.update(p);
    }
    m
}

/// HMAC-SHA256 keyed with `secret` over the concatenation of `parts`.
pub fn tag(secret: &[u8], parts: &[&[u8]]) -> Tag {
    hmac(secret, parts).finalize().into_bytes().into()
}

/// Checks `got` against the tag of `parts`, in constant time.
pub fn check(secret: &[u8], parts: &[&[u8]], got: &[u8]) -> Result<(), HandshakeError> {
    hmac(secret, parts)
        .verify_slice(got)
        .map_err(|_| HandshakeError::BadTag)
}

/// [`tag`] as lower-case hex text (for tags carried in text fields).
pub fn tag_hex(secret: &[u8], parts: &[&[u8]]) -> String {
    tag(secret, parts)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Checks a hex tag (exactly as [`tag_hex`] writes it) in constant time.
pub fn check_hex(secret: &[u8], parts: &[&[u8]], got: &str) -> Result<(), HandshakeError> {
    let want = tag_hex(secret, parts);
    if ct_eq(want.as_bytes(), got.as_bytes()) {
        Ok(())
    } else {
        Err(HandshakeError::BadTag)
    }
}

/// Constant-time equality (lengths are not secret).
pub fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Reads exactly `buf.len()` bytes before `deadline` from a blocking socket.
pub fn read_exact_by(
    s: &mut TcpStream,
    buf: &mut [u8],
    deadline: Instant,
    what: &'static str,
) -> Result<(), HandshakeError> {
    let mut got = 0;
    while got < buf.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(HandshakeError::TimedOut { what });
        }
        s.set_read_timeout(Some(left.max(Duration::from_millis(1))))
            .map_err(|e| HandshakeError::Io {
                what,
                why: format!("setsockopt: {e}"),
            })?;
        match s.read(&mut buf[got..]) {
            Ok(0) => return Err(HandshakeError::Closed { what }),
            Ok(n) => got += n,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => {
                return Err(HandshakeError::Io {
                    what,
                    why: e.to_string(),
                });
            }
        }
    }
    Ok(())
}

/// Checks a message length against its bound.
pub fn check_len(len: usize, max: usize, what: &'static str) -> Result<usize, HandshakeError> {
    if len > max {
        Err(HandshakeError::Oversized { what, len, max })
    } else {
        Ok(len)
    }
}

/// Reads one message framed by a big-endian `u32` length, at most `max`
/// bytes, before `deadline`.
pub fn read_msg(
    s: &mut TcpStream,
    max: usize,
    deadline: Instant,
    what: &'static str,
) -> Result<Vec<u8>, HandshakeError> {
    let mut l = [0u8; 4];
    read_exact_by(s, &mut l, deadline, what)?;
    let n = check_len(u32::from_be_bytes(l) as usize, max, what)?;
    let mut b = vec![0u8; n];
    read_exact_by(s, &mut b, deadline, what)?;
    Ok(b)
}

/// Writes one message framed by a big-endian `u32` length.
pub fn write_msg(w: &mut impl Write, b: &[u8]) -> std::io::Result<()> {
    let mut v = Vec::with_capacity(4 + b.len());
    v.extend_from_slice(&(b.len() as u32).to_be_bytes());
    v.extend_from_slice(b);
    w.write_all(&v)
}

/// A time-stamped request is fresh when its time (ms) is within `skew_ms`
/// of ours, either way.
pub fn check_fresh(ts_ms: u64, now_ms: u64, skew_ms: u64) -> Result<(), HandshakeError> {
    if now_ms.abs_diff(ts_ms) > skew_ms {
        Err(HandshakeError::Stale)
    } else {
        Ok(())
    }
}

/// Remembers the tags accepted within the skew window so each is accepted
/// once (a recorded request cannot be replayed); bounded by the window and
/// a cap (beyond it, a flood is refused rather than remembered).
pub struct ReplayGuard {
    window_ms: u64,
    cap: usize,
    seen: Mutex<Option<HashMap<String, u64>>>,
}

impl ReplayGuard {
    pub const fn new(window_ms: u64, cap: usize) -> ReplayGuard {
        ReplayGuard {
            window_ms,
            cap,
            seen: Mutex::new(None),
        }
    }

    /// Records `tag` (stamped `ts_ms`); an error if it was seen before or
    /// the memory is full.
    pub fn first_use(&self, tag: &str, ts_ms: u64, now_ms: u64) -> Result<(), HandshakeError> {
        let mut g = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        let seen = g.get_or_insert_with(HashMap::new);
        if seen.len() > self.cap {
            seen.retain(|_, t| now_ms.abs_diff(*t) <= self.window_ms);
        }
        if seen.len() > self.cap {
            return Err(HandshakeError::Replayed); // a flood: refuse rather than grow
        }
        match seen.insert(tag.to_string(), ts_ms) {
            None => Ok(()),
            Some(_) => Err(HandshakeError::Replayed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    const SECRET: &[u8] = b"the job secret";

    #[test]
    fn good_tag_is_accepted_and_a_wrong_secret_refused() {
        let c = challenge().unwrap();
        let t = tag(SECRET, &[b"label\0", &c, b"payload"]);
        check(SECRET, &[b"label\0", &c, b"payload"], &t).unwrap();
        // The parts are concatenated: how they are split does not matter.
        check(SECRET, &[b"label\0", &c, b"pay", b"load"], &t).unwrap();
        assert_eq!(
            check(b"another secret", &[b"label\0", &c, b"payload"], &t),
            Err(HandshakeError::BadTag)
        );
        assert_eq!(
            check(SECRET, &[b"label\0", &c, b"payload"], &t[..31]),
            Err(HandshakeError::BadTag),
            "a truncated tag"
        );
        let h = tag_hex(SECRET, &[b"x"]);
        assert_eq!(h.len(), 64);
        check_hex(SECRET, &[b"x"], &h).unwrap();
        assert!(check_hex(b"other", &[b"x"], &h).is_err());
        assert!(check_hex(SECRET, &[b"x"], &h.to_uppercase()).is_err());
        assert!(check_hex(SECRET, &[b"x"], "").is_err());
    }

    #[test]
    fn a_tag_replayed_under_another_challenge_or_label_is_refused() {
        let (c1, c2) = (challenge().unwrap(), challenge().unwrap());
        assert_ne!(c1, c2, "fresh challenges");
        let t = tag(SECRET, &[&c1, b"hello"]);
        assert_eq!(
            check(SECRET, &[&c2, b"hello"], &t),
            Err(HandshakeError::BadTag)
        );
        let a = tag(SECRET, &[b"weft-proxy\0", b"acceptor"]);
        assert!(check(SECRET, &[b"weft-proxy\0", b"dialer"], &a).is_err());
    }

    #[test]
    fn replay_guard_accepts_each_tag_once_and_bounds_its_memory() {
        let g = ReplayGuard::new(1000, 2);
        g.first_use("a", 10, 10).unwrap();
        assert_eq!(g.first_use("a", 10, 11), Err(HandshakeError::Replayed));
        g.first_use("b", 10, 10).unwrap();
        g.first_use("c", 10, 10).unwrap();
        // Over the cap, within the window: refused (a flood).
        assert_eq!(g.first_use("d", 10, 10), Err(HandshakeError::Replayed));
        // Once the old ones are out of the window, room again.
        g.first_use("e", 5000, 5000).unwrap();
        assert!(check_fresh(100, 130, 30).is_ok());
        assert_eq!(check_fresh(100, 131, 30), Err(HandshakeError::Stale));
        assert_eq!(check_fresh(200, 100, 30), Err(HandshakeError::Stale));
    }

    fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let b = l.accept().unwrap().0;
        (a, b)
    }

    #[test]
    fn framed_messages_are_bounded_and_errors_are_clear() {
        let soon = || Instant::now() + Duration::from_secs(5);
        let (mut a, mut b) = pair();
        write_msg(&mut a, b"hello").unwrap();
        assert_eq!(read_msg(&mut b, 16, soon(), "handshake").unwrap(), b"hello");
        // Oversized: refused from the length alone.
        write_msg(&mut a, &[0u8; 17]).unwrap();
        let e = read_msg(&mut b, 16, soon(), "handshake").unwrap_err();
        assert_eq!(
            e.to_string(),
            "handshake message of 17 bytes exceeds the limit of 16"
        );
        // Garbage announcing a huge length: refused before allocating it.
        let (mut a, mut b) = pair();
        a.write_all(b"GET / HTTP/1.1\r\n").unwrap();
        let e = read_msg(&mut b, 1024, soon(), "handshake").unwrap_err();
        assert!(matches!(e, HandshakeError::Oversized { .. }), "{e}");
        // Truncated: the peer closes halfway.
        let (mut a, mut b) = pair();
        a.write_all(&8u32.to_be_bytes()).unwrap();
        a.write_all(b"half").unwrap();
        drop(a);
        let e = read_msg(&mut b, 16, soon(), "bootstrap").unwrap_err();
        assert_eq!(
            e.to_string(),
            "connection closed by the other side during bootstrap"
        );
        // Silence: a deadline, not a hang.
        let (_a, mut b) = pair();
        let e = read_msg(
            &mut b,
            16,
            Instant::now() + Duration::from_millis(50),
            "bootstrap",
        )
        .unwrap_err();
        assert_eq!(e.to_string(), "timed out waiting for a bootstrap message");
    }
}
