//! Sidecar-to-sidecar proxy wire format: the handshake that authenticates
//! a connection with the job secret, and the frames multiplexed over it.
//! Every decoder bounds sizes and checks every field; nothing decoded is
//! trusted for addressing.
//!
//! Handshake (each message a u32 big-endian length and at most
//! [`MAX_HANDSHAKE`] bytes): the dialer sends [`PREFACE`] and `Hello`
//! (its nonce, job, host name); the acceptor answers `Challenge` (its
//! nonce, host name, HMAC over both nonces in the acceptor role); the
//! dialer answers `Proof` (HMAC in the dialer role); the acceptor confirms
//! with one byte. Both sides prove the secret over fresh nonces of both, so
//! nothing recorded can be replayed and neither role's MAC serves the other.

use crate::error::SidecarError;
use libcomm::handshake::{self, HandshakeError};

/// The first 24 bytes of a proxy connection (the peer port tells it from
/// the HTTP/2 preface of gRPC by these).
pub const PREFACE: &[u8; 24] = b"WEFT-PROXY/1\r\n\r\n\0\0\0\0\0\0\0\0";
pub const MAX_HANDSHAKE: usize = 1024;
pub const FRAME_HEADER: usize = 40;
/// Largest data frame (a multiple of 8).
pub const MAX_FRAME: usize = 1 << 20;
/// Largest reason text a `fail` frame carries.
pub const MAX_REASON: usize = 512;

pub const KIND_DATA: u8 = 1;
pub const KIND_CREDIT: u8 = 2;
pub const KIND_PING: u8 = 3;
/// A rank of communicator `key.0` failed or died on the sender's host:
/// `key.1` the rank that failed; `value` 0 failed, 1 aborted, 2 exited
/// without destroying its communicator; the payload (at most
/// [`MAX_REASON`] bytes) is the rank's reason, if known.
pub const KIND_FAIL: u8 = 4;

/// (communicator, source rank, destination rank): one direction of a channel.
pub type Key = ([u8; 16], u32, u32);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Frame {
    pub kind: u8,
    pub key: Key,
    /// Data: payload bytes that follow.
    pub len: u32,
    /// Data: stream position of the first payload byte; credit: how far the
    /// sender may write (stream position).
    pub value: u64,
}

impl Frame {
    pub fn encode(&self) -> [u8; FRAME_HEADER] {
        let mut h = [0u8; FRAME_HEADER];
        h[0] = self.kind;
        h[4..8].copy_from_slice(&self.key.1.to_be_bytes());
        h[8..12].copy_from_slice(&self.key.2.to_be_bytes());
        h[12..16].copy_from_slice(&self.len.to_be_bytes());
        h[16..32].copy_from_slice(&self.key.0);
        h[32..40].copy_from_slice(&self.value.to_be_bytes());
        h
    }

    pub fn decode(h: &[u8; FRAME_HEADER]) -> Result<Frame, SidecarError> {
        let kind = h[0];
        if h[1..4] != [0, 0, 0] {
            return Err(SidecarError::Protocol(
                "reserved header bytes are not zero".into(),
            ));
        }
        let u32_at = |i: usize| u32::from_be_bytes(h[i..i + 4].try_into().unwrap());
        let f = Frame {
            kind,
            key: (h[16..32].try_into().unwrap(), u32_at(4), u32_at(8)),
            len: u32_at(12),
            value: u64::from_be_bytes(h[32..40].try_into().unwrap()),
        };
        match kind {
            KIND_DATA => {
                let n = f.len as usize;
                if n == 0 || n > MAX_FRAME || !n.is_multiple_of(8) {
                    return Err(SidecarError::Protocol(format!(
                        "data frame of {n} bytes (must be 8..={MAX_FRAME}, a multiple of 8)"
                    )));
                }
                if !f.value.is_multiple_of(8) {
                    return Err(SidecarError::Protocol(
                        "data frame at an unaligned stream position".into(),
                    ));
                }
            }
            KIND_FAIL => {
                if f.len as usize > MAX_REASON {
                    return Err(SidecarError::Protocol(format!(
                        "fail frame with a {} byte reason",
                        f.len
                    )));
                }
            }
            KIND_CREDIT | KIND_PING => {
                if f.len != 0 {
                    return Err(SidecarError::Protocol(format!(
                        "kind {kind} frame with a {} byte payload",
                        f.len
                    )));
                }
            }
            k => return Err(SidecarError::Protocol(format!("unknown frame kind {k}"))),
        }
        Ok(f)
    }
}

/// A bounded reader of handshake fields.
struct Rd<'a>(&'a [u8]);

impl<'a> Rd<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], SidecarError> {
        if self.0.len() < n {
            return Err(HandshakeError::Truncated { what: WHAT }.into());
        }
        let (h, t) = self.0.split_at(n);
        self.0 = t;
        Ok(h)
    }
    fn nonce(&mut self) -> Result<[u8; 16], SidecarError> {
        Ok(self.take(16)?.try_into().unwrap())
    }
    fn mac(&mut self) -> Result<[u8; 32], SidecarError> {
        Ok(self.take(32)?.try_into().unwrap())
    }
    fn str(&mut self) -> Result<String, SidecarError> {
        let n = u16::from_be_bytes(self.take(2)?.try_into().unwrap()) as usize;
        if n > 256 {
            return Err(SidecarError::Garbage(format!(
                "string of {n} bytes in a handshake message"
            )));
        }
        String::from_utf8(self.take(n)?.to_vec())
            .map_err(|_| SidecarError::Garbage("invalid UTF-8".into()))
    }
    fn end(&self) -> Result<(), SidecarError> {
        if self.0.is_empty() {
            Ok(())
        } else {
            Err(SidecarError::Garbage(
                "trailing bytes in a handshake message".into(),
            ))
        }
    }
}

fn put_str(v: &mut Vec<u8>, s: &str) {
    let s = &s.as_bytes()[..s.len().min(256)];
    v.extend_from_slice(&(s.len() as u16).to_be_bytes());
    v.extend_from_slice(s);
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    pub nonce: [u8; 16],
    pub job: String,
    pub host: String,
    /// The dialer's address as its ranks advertise it: the connection is
    /// the host's with that address, whatever source address the kernel
    /// picked (multi-homed hosts, loopback aliases).
    pub addr: String,
}

impl Hello {
    pub fn encode(&self) -> Vec<u8> {
        let mut v = self.nonce.to_vec();
        put_str(&mut v, &self.job);
        put_str(&mut v, &self.host);
        put_str(&mut v, &self.addr);
        v
    }
    pub fn decode(b: &[u8]) -> Result<Hello, SidecarError> {
        let mut r = Rd(b);
        let h = Hello {
            nonce: r.nonce()?,
            job: r.str()?,
            host: r.str()?,
            addr: r.str()?,
        };
        r.end()?;
        Ok(h)
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Challenge {
    pub nonce: [u8; 16],
    pub host: String,
    pub mac: [u8; 32],
}

impl Challenge {
    pub fn encode(&self) -> Vec<u8> {
        let mut v = self.nonce.to_vec();
        put_str(&mut v, &self.host);
        v.extend_from_slice(&self.mac);
        v
    }
    pub fn decode(b: &[u8]) -> Result<Challenge, SidecarError> {
        let mut r = Rd(b);
        let c = Challenge {
            nonce: r.nonce()?,
            host: r.str()?,
            mac: r.mac()?,
        };
        r.end()?;
        Ok(c)
    }
}

/// The dialer's proof: its MAC.
pub fn decode_proof(b: &[u8]) -> Result<[u8; 32], SidecarError> {
    let mut r = Rd(b);
    let m = r.mac()?;
    r.end()?;
    Ok(m)
}

/// What handshake errors call a message of this protocol.
pub const WHAT: &str = "handshake";

/// Checks a handshake message's length prefix.
pub fn decode_len(b: [u8; 4]) -> Result<usize, HandshakeError> {
    handshake::check_len(u32::from_be_bytes(b) as usize, MAX_HANDSHAKE, WHAT)
}

/// The MAC's inputs: "weft-proxy" role job hello nonce_acceptor. `hello` is
/// the dialer's whole Hello (its nonce, host and address included), so
/// neither side can be talked into a different peer identity.
fn mac_parts<'a>(
    role: &'a str,
    job: &'a str,
    hello: &'a [u8],
    hello_len: &'a [u8; 4],
    acceptor: &'a [u8; 16],
) -> [&'a [u8]; 8] {
    [
        b"weft-proxy\0",
        role.as_bytes(),
        b"\0",
        job.as_bytes(),
        b"\0",
        hello_len,
        hello,
        acceptor,
    ]
}

/// HMAC-SHA256(secret, "weft-proxy" role job hello nonce_acceptor).
pub fn mac(secret: &str, role: &str, job: &str, hello: &[u8], acceptor: &[u8; 16]) -> [u8; 32] {
    let n = (hello.len() as u32).to_be_bytes();
    handshake::tag(
        secret.as_bytes(),
        &mac_parts(role, job, hello, &n, acceptor),
    )
}

/// Checks the MAC of `role` in constant time.
pub fn check_mac(
    secret: &str,
    role: &str,
    job: &str,
    hello: &[u8],
    acceptor: &[u8; 16],
    got: &[u8; 32],
) -> Result<(), HandshakeError> {
    let n = (hello.len() as u32).to_be_bytes();
    handshake::check(
        secret.as_bytes(),
        &mac_parts(role, job, hello, &n, acceptor),
        got,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip_and_bad_ones_are_refused() {
        let f = Frame {
            kind: KIND_DATA,
            key: ([7; 16], 1, 2),
            len: 64,
            value: 128,
        };
        assert_eq!(Frame::decode(&f.encode()).unwrap(), f);
        for bad in [
            Frame { len: 0, ..f },
            Frame { len: 12, ..f },
            Frame {
                len: MAX_FRAME as u32 + 8,
                ..f
            },
            Frame {
                kind: KIND_CREDIT,
                ..f
            },
            Frame { kind: 9, ..f },
        ] {
            assert!(Frame::decode(&bad.encode()).is_err(), "{bad:?}");
        }
        let h = Hello {
            nonce: [1; 16],
            job: "j".into(),
            host: "h".into(),
            addr: "10.0.0.1".into(),
        };
        assert_eq!(Hello::decode(&h.encode()).unwrap(), h);
        assert!(decode_len(2048u32.to_be_bytes()).is_err());
        assert_eq!(decode_len(1024u32.to_be_bytes()).unwrap(), 1024);
    }

    #[test]
    fn mac_is_the_one_of_the_wire_format() {
        // The bytes the MAC covers are those of version 1 (written out here so
        // a refactor of the helper cannot change them unnoticed).
        use hmac::{KeyInit, Mac};
        let hello = b"hello bytes";
        let acceptor = [3u8; 16];
        let mut m = <hmac::Hmac<sha2::Sha256> as KeyInit>::new_from_slice(b"s3cret").unwrap();
        m.update(b"weft-proxy\0dialer\0job\0");
        m.update(&(hello.len() as u32).to_be_bytes());
        m.update(hello);
        m.update(&acceptor);
        let want: [u8; 32] = m.finalize().into_bytes().into();
        assert_eq!(mac("s3cret", "dialer", "job", hello, &acceptor), want);
        check_mac("s3cret", "dialer", "job", hello, &acceptor, &want).unwrap();
        assert!(check_mac("s3cret", "acceptor", "job", hello, &acceptor, &want).is_err());
        assert!(check_mac("other", "dialer", "job", hello, &acceptor, &want).is_err());
    }
}
