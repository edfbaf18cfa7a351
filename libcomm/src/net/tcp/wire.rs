//! What travels on the TCP byte mover's connections, with bounded decoders
//! (every byte here comes from outside: a handle from the bootstrap, a hello
//! from any client, a task header from an authenticated peer).
//!
//! - [`Handle`]: the connect handle, 40 bytes: magic `WFTN`, version,
//!   port, IPv6 address (IPv4-mapped for v4), listen id.
//! - [`Hello`]: the first frame of every socket (a bootstrap `Connect` frame,
//!   MAC'd with the job secret over the listener's challenge): which listener,
//!   which connection it belongs to (a random id shared by its sockets), its
//!   index among them, the connector's [`Peer`], a nonce the acceptance is
//!   MAC'd over.
//! - [`TaskHeader`]: 32 bytes before each piece of a message: the message's
//!   sequence number on its comm, its total size, this piece's offset and
//!   length, and the message's tag.

use crate::bootstrap::wire::{Dec, Enc};
use crate::net::{ConnectHandle, NetError, Peer};
use std::net::{IpAddr, Ipv6Addr, SocketAddr};

const HANDLE_MAGIC: &[u8; 4] = b"WFTN";
const HANDLE_VERSION: u8 = 1;
const HANDLE_BYTES: usize = 40;
/// Domain separation: a hello can never pass for another protocol's connect.
const HELLO_LABEL: &[u8] = b"weft-net\0";
/// Sockets one connection may stripe over, at most.
pub const MAX_SOCKETS: u16 = 64;

pub type ListenId = [u8; 16];
pub type ConnId = [u8; 16];

/// Where a listener is, and which of the process's listen comms it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Handle {
    pub addr: SocketAddr,
    pub listen: ListenId,
}

impl Handle {
    pub fn encode(&self) -> ConnectHandle {
        let mut b = Vec::with_capacity(HANDLE_BYTES);
        b.extend_from_slice(HANDLE_MAGIC);
        b.push(HANDLE_VERSION);
        b.push(0);
        b.extend_from_slice(&self.addr.port().to_be_bytes());
        let v6 = match self.addr.ip() {
            IpAddr::V4(v4) => v4.to_ipv6_mapped(),
            IpAddr::V6(v6) => v6,
        };
        b.extend_from_slice(&v6.octets());
        b.extend_from_slice(&self.listen);
        ConnectHandle(b)
    }

    pub fn decode(h: &ConnectHandle) -> Result<Handle, NetError> {
        let b = h.as_bytes();
        let bad = |why: &str| {
            NetError::InvalidArgument(format!(
                "not a TCP connect handle: {why} (is WEFT_CROSSHOST_NET the same on every rank?)"
            ))
        };
        if b.len() != HANDLE_BYTES {
            return Err(bad(&format!("{} bytes, expected {HANDLE_BYTES}", b.len())));
        }
        if &b[0..4] != HANDLE_MAGIC {
            return Err(bad("bad magic"));
        }
        if b[4] != HANDLE_VERSION {
            return Err(bad(&format!(
                "version {}, this Weft speaks {HANDLE_VERSION}",
                b[4]
            )));
        }
        let port = u16::from_be_bytes([b[6], b[7]]);
        let v6 = Ipv6Addr::from(<[u8; 16]>::try_from(&b[8..24]).expect("16 bytes"));
        let ip = match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6(v6),
        };
        Ok(Handle {
            addr: SocketAddr::new(ip, port),
            listen: b[24..40].try_into().expect("16 bytes"),
        })
    }
}

/// The first frame of each socket of a connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    pub listen: ListenId,
    pub conn: ConnId,
    pub index: u16,
    pub nsocks: u16,
    pub peer: Peer,
    pub client_nonce: [u8; 16],
}

impl Hello {
    pub fn encode(&self) -> Vec<u8> {
        let mut e = Enc::default();
        e.bytes(HELLO_LABEL)
            .bytes(&self.listen)
            .bytes(&self.conn)
            .u16(self.index)
            .u16(self.nsocks)
            .u32(self.peer.rank)
            .u32(self.peer.stream)
            .bytes(&self.client_nonce);
        e.0
    }

    /// Decodes and checks the socket index against the socket count.
    pub fn decode(b: &[u8]) -> crate::error::Result<Hello> {
        let mut d = Dec::new(b, "net hello");
        let label: [u8; 9] = d.array()?;
        if label != HELLO_LABEL {
            return Err(crate::error::Error::Bootstrap(
                "not a Weft net connection (wrong label)".into(),
            ));
        }
        let h = Hello {
            listen: d.array()?,
            conn: d.array()?,
            index: d.u16()?,
            nsocks: d.u16()?,
            peer: Peer {
                rank: d.u32()?,
                stream: d.u32()?,
            },
            client_nonce: d.array()?,
        };
        d.finish()?;
        if h.nsocks == 0 || h.nsocks > MAX_SOCKETS || h.index >= h.nsocks {
            return Err(crate::error::Error::Bootstrap(format!(
                "socket {} of {} (at most {MAX_SOCKETS} sockets per connection)",
                h.index, h.nsocks
            )));
        }
        Ok(h)
    }
}

/// Bytes of a [`TaskHeader`].
pub const TASK_HEADER: usize = 32;

/// The header before each piece ("task") of a message on one socket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TaskHeader {
    /// The message's sequence number on its comm (0, 1, ...).
    pub seq: u64,
    /// The message's size.
    pub total: u64,
    /// Where this piece goes in the message.
    pub offset: u64,
    pub len: u32,
    pub tag: u32,
}

impl TaskHeader {
    pub fn encode(&self) -> [u8; TASK_HEADER] {
        let mut b = [0u8; TASK_HEADER];
        b[0..8].copy_from_slice(&self.seq.to_be_bytes());
        b[8..16].copy_from_slice(&self.total.to_be_bytes());
        b[16..24].copy_from_slice(&self.offset.to_be_bytes());
        b[24..28].copy_from_slice(&self.len.to_be_bytes());
        b[28..32].copy_from_slice(&self.tag.to_be_bytes());
        b
    }

    /// Decodes a header; the piece must lie inside its message.
    pub fn decode(b: &[u8; TASK_HEADER]) -> Result<TaskHeader, String> {
        let u64_at = |i: usize| u64::from_be_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        let u32_at = |i: usize| u32::from_be_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        let h = TaskHeader {
            seq: u64_at(0),
            total: u64_at(8),
            offset: u64_at(16),
            len: u32_at(24),
            tag: u32_at(28),
        };
        if h.offset
            .checked_add(h.len as u64)
            .is_none_or(|end| end > h.total)
        {
            return Err(format!(
                "a piece at {} of {} bytes lies outside its message of {} bytes",
                h.offset, h.len, h.total
            ));
        }
        Ok(h)
    }
}

/// How a message of `total` bytes is cut into pieces over `nsocks` sockets:
/// `(socket, offset, len)` for each piece, alike on both sides. Pieces are
/// at least `min_task` bytes (small messages use fewer sockets) and at most
/// `u32::MAX`; the first goes to socket `seq % nsocks`, so small messages
/// spread over the sockets too.
pub fn pieces(
    seq: u64,
    total: usize,
    nsocks: usize,
    min_task: usize,
) -> Vec<(usize, usize, usize)> {
    let nsocks = nsocks.max(1);
    let per = total
        .div_ceil(nsocks)
        .max(min_task.max(1))
        .min(u32::MAX as usize);
    let n = total.div_ceil(per).max(1);
    (0..n)
        .map(|i| {
            let off = i * per;
            let sock = (seq as usize % nsocks + i) % nsocks;
            (sock, off, per.min(total - off.min(total)))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles_round_trip_and_foreign_bytes_are_refused() {
        for addr in ["10.200.0.2:7001", "[::1]:9"] {
            let h = Handle {
                addr: addr.parse().unwrap(),
                listen: [7; 16],
            };
            assert_eq!(Handle::decode(&h.encode()).unwrap(), h);
        }
        let good = Handle {
            addr: "127.0.0.1:1".parse().unwrap(),
            listen: [1; 16],
        }
        .encode();
        for cut in 0..good.as_bytes().len() {
            let h = ConnectHandle::from_bytes(&good.as_bytes()[..cut]).unwrap();
            assert!(Handle::decode(&h).is_err(), "{cut} bytes");
        }
        let mut b = good.as_bytes().to_vec();
        b[4] = 9;
        let e = Handle::decode(&ConnectHandle::from_bytes(&b).unwrap()).unwrap_err();
        assert!(e.to_string().contains("version 9"), "{e}");
        assert!(ConnectHandle::from_bytes(&[0u8; 129]).is_err());
    }

    #[test]
    fn hellos_round_trip_and_bad_socket_counts_are_refused() {
        let h = Hello {
            listen: [1; 16],
            conn: [2; 16],
            index: 3,
            nsocks: 4,
            peer: Peer { rank: 5, stream: 6 },
            client_nonce: [7; 16],
        };
        assert_eq!(Hello::decode(&h.encode()).unwrap(), h);
        for (index, nsocks) in [(0, 0), (4, 4), (0, MAX_SOCKETS + 1)] {
            let b = Hello {
                index,
                nsocks,
                ..h.clone()
            }
            .encode();
            assert!(Hello::decode(&b).is_err(), "{index} of {nsocks}");
        }
        let mut b = h.encode();
        b[0] = b'x';
        assert!(Hello::decode(&b).is_err(), "another protocol's payload");
        assert!(Hello::decode(&b[..20]).is_err());
        assert!(Hello::decode(&[h.encode(), vec![0]].concat()).is_err());
    }

    #[test]
    fn task_headers_must_stay_inside_their_message() {
        let h = TaskHeader {
            seq: 9,
            total: 100,
            offset: 60,
            len: 40,
            tag: 3,
        };
        assert_eq!(TaskHeader::decode(&h.encode()).unwrap(), h);
        for (offset, len) in [(61, 40), (u64::MAX, 2), (0, 101)] {
            let b = TaskHeader { offset, len, ..h }.encode();
            assert!(TaskHeader::decode(&b).is_err(), "{offset}+{len}");
        }
    }

    #[test]
    fn pieces_cover_the_message_once_and_spread_over_sockets() {
        for total in [0usize, 1, 1000, 65536, 65537, 1 << 20, (1 << 20) + 3] {
            for nsocks in [1, 2, 3, 8] {
                for seq in [0u64, 5] {
                    let p = pieces(seq, total, nsocks, 4096);
                    assert!(!p.is_empty());
                    let mut next = 0;
                    for &(s, off, len) in &p {
                        assert!(s < nsocks);
                        assert_eq!(off, next, "contiguous");
                        next += len;
                    }
                    assert_eq!(next, total);
                    assert!(p.len() <= nsocks.max(1));
                    assert_eq!(p[0].0, seq as usize % nsocks);
                }
            }
        }
        // Large messages use every socket, small ones one.
        assert_eq!(pieces(0, 1 << 20, 4, 4096).len(), 4);
        assert_eq!(pieces(0, 100, 4, 4096).len(), 1);
    }
}
