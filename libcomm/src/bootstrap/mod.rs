//! Bootstrap: how the ranks of a new communicator find each other.
//!
//! Every rank connects to the root named by the [`UniqueId`](crate::bootstrap::unique_id::UniqueId),
//! answers its challenge with an authenticated `Hello` (rank, world size, host
//! identity, pid, the address of its peer endpoint), and receives the table of
//! all ranks once everyone has arrived. Splits need no root: they derive the
//! child's table from the parent's over the parent communicator itself.
//!
//! Here too, below the transports that use them: the [`UniqueId`](crate::bootstrap::unique_id::UniqueId)
//! (`unique_id.rs`), the job-secret handshake every listener of Weft shares
//! (`handshake.rs`), and the context a communicator is built from
//! (`ctx.rs`: id, rank, peers, secret, configuration, the job's label).

pub(crate) mod client;
pub(crate) mod ctx;
pub mod handshake;
pub(crate) mod root;
pub(crate) mod server;
pub(crate) mod unique_id;
pub(crate) mod wire;

use crate::error::Result;
use std::net::SocketAddr;
use wire::{Dec, Enc};

/// What every rank learns about every other rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerInfo {
    pub host_id: u64,
    pub pid: u32,
    /// The peer's TCP endpoint (for transports across hosts).
    pub addr: SocketAddr,
    pub hostname: String,
    /// It reaches other hosts through its sidecar's proxy (every rank of a
    /// job must make the same choice; checked when channels are built).
    pub proxied: bool,
}

impl PeerInfo {
    /// The smallest encoding: host id, pid, address, empty name, flags.
    pub(crate) const MIN_BYTES: usize = 8 + 4 + 18 + 2 + 2;

    pub(crate) fn encode(&self, e: &mut Enc) {
        e.u64(self.host_id)
            .u32(self.pid)
            .addr(self.addr)
            .str(&self.hostname)
            .u16(self.proxied as u16);
    }
    pub(crate) fn decode(d: &mut Dec<'_>) -> Result<PeerInfo> {
        Ok(PeerInfo {
            host_id: d.u64()?,
            pid: d.u32()?,
            addr: d.addr()?,
            hostname: d.str(255)?,
            proxied: d.u16()? & 1 != 0,
        })
    }
}

pub(crate) struct Hello {
    pub nonce: [u8; 16],
    pub client_nonce: [u8; 16],
    pub rank: u32,
    pub nranks: u32,
    pub info: PeerInfo,
}

impl Hello {
    pub fn encode(&self) -> Vec<u8> {
        let mut e = Enc::default();
        e.bytes(&self.nonce)
            .bytes(&self.client_nonce)
            .u32(self.rank)
            .u32(self.nranks);
        self.info.encode(&mut e);
        e.0
    }
    pub fn decode(b: &[u8]) -> Result<Hello> {
        let mut d = Dec::new(b, "hello");
        let h = Hello {
            nonce: d.array()?,
            client_nonce: d.array()?,
            rank: d.u32()?,
            nranks: d.u32()?,
            info: PeerInfo::decode(&mut d)?,
        };
        d.finish()?;
        Ok(h)
    }
}

/// The table the root sends: a fresh communicator id chosen by the root (so
/// two rendezvous on the same address never share an id) and every rank's info.
pub(crate) fn encode_table(comm_id: &[u8; 16], t: &[PeerInfo]) -> Vec<u8> {
    let mut e = Enc::default();
    e.bytes(comm_id).u32(t.len() as u32);
    for p in t {
        p.encode(&mut e);
    }
    e.0
}

pub(crate) fn decode_table(b: &[u8], expect: usize) -> Result<([u8; 16], Vec<PeerInfo>)> {
    let mut d = Dec::new(b, "table");
    let id = d.array::<16>()?;
    let n = d.u32()? as usize;
    if n != expect {
        return Err(crate::error::Error::Bootstrap(format!(
            "root sent a table of {n} ranks, expected {expect}"
        )));
    }
    // Reserve no more than the bytes at hand can hold (a peer is at least
    // 34 bytes): a claimed count allocates nothing by itself.
    let mut t = Vec::with_capacity(n.min(b.len() / PeerInfo::MIN_BYTES));
    for _ in 0..n {
        t.push(PeerInfo::decode(&mut d)?);
    }
    d.finish()?;
    Ok((id, t))
}
