//! Bootstrap and connection-setup wire format.
//!
//! Every message is a frame: a 16-byte header (magic, version, kind, length),
//! a payload bounded by the reader, and an HMAC-SHA256 tag over the server's
//! challenge, the header and the payload, keyed with the job secret. A server
//! speaks first with a fresh random challenge, so a recorded frame cannot be
//! replayed. Decoders never trust a length: everything is bounds-checked and
//! bad input becomes an error for that connection only.

use crate::bootstrap::handshake::{self, HandshakeError};
use crate::error::{Error, Result};
use std::io::Write;
use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::time::{Duration, Instant};

pub const MAGIC: [u8; 4] = *b"WFTB";
pub const VERSION: u8 = 1;
pub const HEADER: usize = 16;
pub const TAG: usize = handshake::TAG;
/// Largest bootstrap payload we accept (a 64k-rank table fits).
pub const MAX_PAYLOAD: usize = 16 << 20;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    Challenge = 1,
    Hello = 2,
    Table = 3,
    Error = 4,
    Connect = 5,
    Accept = 6,
    /// A rank tells a remote peer's endpoint why a communicator failed
    /// (MAC'd with the communicator's secret), before its connections close.
    Fail = 7,
}

impl Kind {
    fn from_u8(v: u8) -> Option<Kind> {
        Some(match v {
            1 => Kind::Challenge,
            2 => Kind::Hello,
            3 => Kind::Table,
            4 => Kind::Error,
            5 => Kind::Connect,
            6 => Kind::Accept,
            7 => Kind::Fail,
            _ => return None,
        })
    }
}

#[derive(Debug, Clone)]
pub struct Frame {
    pub kind: Kind,
    pub payload: Vec<u8>,
    header: [u8; HEADER],
    tag: [u8; TAG],
}

/// The tag of a frame: over the challenge it answers, its header and payload.
fn mac(secret: &[u8; 32], challenge: &[u8], header: &[u8], payload: &[u8]) -> [u8; TAG] {
    handshake::tag(secret, &[challenge, header, payload])
}

impl Frame {
    /// Checks the tag in constant time.
    pub fn verify(&self, secret: &[u8; 32], challenge: &[u8]) -> Result<()> {
        handshake::check(secret, &[challenge, &self.header, &self.payload], &self.tag)
            .map_err(|_| Error::Bootstrap("authentication failed: the peer does not hold this job's secret (wrong job, wrong WEFT_JOB_SECRET, or a stray client)".into()))
    }
}

pub fn encode(kind: Kind, payload: &[u8], secret: &[u8; 32], challenge: &[u8]) -> Vec<u8> {
    let mut header = [0u8; HEADER];
    header[0..4].copy_from_slice(&MAGIC);
    header[4] = VERSION;
    header[5] = kind as u8;
    header[8..12].copy_from_slice(&(payload.len() as u32).to_be_bytes());
    let tag = mac(secret, challenge, &header, payload);
    let mut out = Vec::with_capacity(HEADER + payload.len() + TAG);
    out.extend_from_slice(&header);
    out.extend_from_slice(payload);
    out.extend_from_slice(&tag);
    out
}

/// Incremental decoder for non-blocking servers: feed bytes, get a frame.
#[derive(Default)]
pub struct FrameBuf {
    buf: Vec<u8>,
}

impl FrameBuf {
    /// How many more bytes are needed at least (0 = a frame is ready).
    pub fn need(&self, max_payload: usize) -> Result<usize> {
        if self.buf.len() < HEADER {
            return Ok(HEADER - self.buf.len());
        }
        let len = parse_header(&self.buf[..HEADER], max_payload)?.1;
        Ok((HEADER + len + TAG).saturating_sub(self.buf.len()))
    }

    pub fn extend(&mut self, b: &[u8]) {
        self.buf.extend_from_slice(b);
    }

    pub fn take(&mut self, max_payload: usize) -> Result<Option<Frame>> {
        if self.need(max_payload)? > 0 {
            return Ok(None);
        }
        let (kind, len) = parse_header(&self.buf[..HEADER], max_payload)?;
        let header: [u8; HEADER] = self.buf[..HEADER].try_into().unwrap();
        let payload = self.buf[HEADER..HEADER + len].to_vec();
        let tag = self.buf[HEADER + len..HEADER + len + TAG]
            .try_into()
            .unwrap();
        self.buf.drain(..HEADER + len + TAG);
        Ok(Some(Frame {
            kind,
            payload,
            header,
            tag,
        }))
    }
}

fn parse_header(h: &[u8], max_payload: usize) -> Result<(Kind, usize)> {
    if h[0..4] != MAGIC {
        return Err(Error::Bootstrap(format!(
            "not a Weft bootstrap message (got bytes {:02x?}); is something else talking to this port?",
            &h[0..4]
        )));
    }
    if h[4] != VERSION {
        return Err(Error::Bootstrap(format!(
            "bootstrap protocol version {} not supported (expects {VERSION}): mixed Weft versions?",
            h[4]
        )));
    }
    let kind = Kind::from_u8(h[5])
        .ok_or_else(|| Error::Bootstrap(format!("unknown bootstrap message kind {}", h[5])))?;
    let len = u32::from_be_bytes(h[8..12].try_into().unwrap()) as usize;
    let len = handshake::check_len(len, max_payload, WHAT).map_err(boot)?;
    Ok((kind, len))
}

/// What handshake errors call a message of this protocol.
const WHAT: &str = "bootstrap";

fn boot(e: HandshakeError) -> Error {
    Error::Bootstrap(e.to_string())
}

/// Blocking read of one frame before `deadline` (socket must be blocking):
/// the header first (checked and bounded), then exactly its payload and tag.
pub fn read_frame(
    s: &mut std::net::TcpStream,
    max_payload: usize,
    deadline: Instant,
) -> Result<Frame> {
    let mut fb = FrameBuf::default();
    let mut header = [0u8; HEADER];
    handshake::read_exact_by(s, &mut header, deadline, WHAT).map_err(boot)?;
    fb.extend(&header);
    let mut rest = vec![0u8; fb.need(max_payload)?];
    handshake::read_exact_by(s, &mut rest, deadline, WHAT).map_err(boot)?;
    fb.extend(&rest);
    Ok(fb.take(max_payload)?.expect("complete"))
}

pub fn write_all(s: &mut std::net::TcpStream, bytes: &[u8], deadline: Instant) -> Result<()> {
    let left = deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1));
    s.set_write_timeout(Some(left))
        .map_err(|e| Error::sys("setsockopt", e))?;
    s.write_all(bytes)
        .map_err(|e| Error::Bootstrap(format!("sending bootstrap message: {e}")))
}

/// Waits until `s` is readable (or closed) for at most `t`.
pub fn wait_readable(s: &std::net::TcpStream, t: Duration) -> bool {
    use std::os::fd::AsRawFd;
    matches!(
        crate::sys::sockets::wait_readable(s.as_raw_fd(), t),
        Ok(true)
    )
}

/// Bounded payload encoder/decoder.
#[derive(Default)]
pub struct Enc(pub Vec<u8>);

impl Enc {
    pub fn u16(&mut self, v: u16) -> &mut Self {
        self.0.extend_from_slice(&v.to_be_bytes());
        self
    }
    pub fn u32(&mut self, v: u32) -> &mut Self {
        self.0.extend_from_slice(&v.to_be_bytes());
        self
    }
    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.0.extend_from_slice(&v.to_be_bytes());
        self
    }
    pub fn bytes(&mut self, b: &[u8]) -> &mut Self {
        self.0.extend_from_slice(b);
        self
    }
    pub fn str(&mut self, s: &str) -> &mut Self {
        let b = &s.as_bytes()[..s.len().min(u16::MAX as usize)];
        self.u16(b.len() as u16).bytes(b)
    }
    pub fn addr(&mut self, a: SocketAddr) -> &mut Self {
        let v6 = match a.ip() {
            IpAddr::V4(v4) => v4.to_ipv6_mapped(),
            IpAddr::V6(v6) => v6,
        };
        self.bytes(&v6.octets()).u16(a.port())
    }
}

pub struct Dec<'a> {
    b: &'a [u8],
    what: &'static str,
}

impl<'a> Dec<'a> {
    pub fn new(b: &'a [u8], what: &'static str) -> Self {
        Dec { b, what }
    }
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        if self.b.len() < n {
            return Err(Error::Bootstrap(format!("truncated {} message", self.what)));
        }
        let (h, t) = self.b.split_at(n);
        self.b = t;
        Ok(h)
    }
    pub fn u16(&mut self) -> Result<u16> {
        Ok(u16::from_be_bytes(self.take(2)?.try_into().unwrap()))
    }
    pub fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_be_bytes(self.take(4)?.try_into().unwrap()))
    }
    pub fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_be_bytes(self.take(8)?.try_into().unwrap()))
    }
    pub fn array<const N: usize>(&mut self) -> Result<[u8; N]> {
        Ok(self.take(N)?.try_into().unwrap())
    }
    pub fn str(&mut self, max: usize) -> Result<String> {
        let n = self.u16()? as usize;
        if n > max {
            return Err(Error::Bootstrap(format!(
                "string of {n} bytes in {} message exceeds {max}",
                self.what
            )));
        }
        String::from_utf8(self.take(n)?.to_vec())
            .map_err(|_| Error::Bootstrap(format!("invalid UTF-8 in {} message", self.what)))
    }
    pub fn addr(&mut self) -> Result<SocketAddr> {
        let v6 = Ipv6Addr::from(self.array::<16>()?);
        let port = self.u16()?;
        let ip = v6
            .to_ipv4_mapped()
            .map(IpAddr::V4)
            .unwrap_or(IpAddr::V6(v6));
        Ok(SocketAddr::new(ip, port))
    }
    pub fn finish(&self) -> Result<()> {
        if self.b.is_empty() {
            Ok(())
        } else {
            Err(Error::Bootstrap(format!(
                "{} trailing bytes in {} message",
                self.b.len(),
                self.what
            )))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frame_round_trip_and_tamper() {
        let secret = [7u8; 32];
        let bytes = encode(Kind::Hello, b"payload", &secret, b"chal");
        let mut fb = FrameBuf::default();
        fb.extend(&bytes[..5]);
        assert!(fb.take(1024).unwrap().is_none());
        fb.extend(&bytes[5..]);
        let f = fb.take(1024).unwrap().unwrap();
        assert_eq!(f.kind, Kind::Hello);
        assert_eq!(f.payload, b"payload");
        f.verify(&secret, b"chal").unwrap();
        assert!(
            f.verify(&secret, b"other").is_err(),
            "replay under another challenge"
        );
        assert!(f.verify(&[8u8; 32], b"chal").is_err(), "wrong secret");
    }

    #[test]
    fn tag_is_the_one_of_the_wire_format() {
        // Version 1 MACs the challenge, the header and the payload, with no
        // label (written out here so a refactor cannot change it unnoticed).
        use hmac::{KeyInit, Mac};
        let secret = [9u8; 32];
        let bytes = encode(Kind::Connect, b"abc", &secret, b"challenge");
        let mut m = <hmac::Hmac<sha2::Sha256> as KeyInit>::new_from_slice(&secret).unwrap();
        m.update(b"challenge");
        m.update(&bytes[..HEADER + 3]);
        let want: [u8; TAG] = m.finalize().into_bytes().into();
        assert_eq!(&bytes[HEADER + 3..], &want);
    }

    #[test]
    fn blocking_reads_are_bounded_with_clear_errors() {
        use std::net::{TcpListener, TcpStream};
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let mut b = l.accept().unwrap().0;
        let soon = || Instant::now() + Duration::from_secs(5);
        let bytes = encode(Kind::Hello, b"payload", &[1; 32], b"c");
        a.write_all(&bytes).unwrap();
        let f = read_frame(&mut b, 64, soon()).unwrap();
        assert_eq!(f.payload, b"payload");
        f.verify(&[1; 32], b"c").unwrap();
        let e = f.verify(&[2; 32], b"c").unwrap_err().to_string();
        assert!(e.contains("does not hold this job's secret"), "{e}");
        // Oversized: refused from the header.
        a.write_all(&bytes).unwrap();
        let e = read_frame(&mut b, 4, soon()).unwrap_err().to_string();
        assert!(e.contains("exceeds the limit of 4"), "{e}");
        // Garbage.
        let (mut a, mut b) = {
            let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
            (a, l.accept().unwrap().0)
        };
        a.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
        let e = read_frame(&mut b, 64, soon()).unwrap_err().to_string();
        assert!(e.contains("not a Weft bootstrap message"), "{e}");
        // Truncated: closed halfway through the payload.
        let (mut a, mut b) = {
            let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
            (a, l.accept().unwrap().0)
        };
        a.write_all(&bytes[..HEADER + 2]).unwrap();
        drop(a);
        let e = read_frame(&mut b, 64, soon()).unwrap_err().to_string();
        assert_eq!(
            e,
            "bootstrap failed: connection closed by the other side during bootstrap"
        );
        // Silence: a deadline.
        let (_a, mut b) = {
            let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
            (a, l.accept().unwrap().0)
        };
        let e = read_frame(&mut b, 64, Instant::now() + Duration::from_millis(50))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("timed out waiting for a bootstrap message"),
            "{e}"
        );
    }

    #[test]
    fn garbage_and_oversize_are_errors() {
        let mut fb = FrameBuf::default();
        fb.extend(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n");
        assert!(fb.take(1024).is_err());
        let big = encode(Kind::Table, &vec![0u8; 2048], &[0; 32], b"");
        let mut fb = FrameBuf::default();
        fb.extend(&big);
        let e = fb.take(1024).unwrap_err().to_string();
        assert!(e.contains("exceeds the limit"), "{e}");
    }

    #[test]
    fn decoder_bounds() {
        let mut d = Dec::new(&[0, 5, b'a'], "test");
        assert!(d.str(64).is_err(), "declared 5 bytes, has 1");
        let mut d = Dec::new(&[0, 1], "test");
        assert!(d.u32().is_err());
    }
}
