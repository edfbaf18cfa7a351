//! A rank's side of bootstrap: connect to the root (retrying while it is not
//! up yet), answer the challenge with a hello, receive the table.

use super::wire::{self, Kind};
use super::{Hello, PeerInfo, decode_table};
use crate::error::{Error, Result};
use crate::handshake::random;
use crate::unique_id::UniqueId;
use std::net::TcpStream;
use std::time::{Duration, Instant};

/// Connects with retries and exponential backoff (bounded), so ranks that start
/// before the root, or a burst of thousands of ranks, do not fail on the first
/// ECONNREFUSED.
pub(crate) fn connect_retry(
    addr: std::net::SocketAddr,
    deadline: Instant,
    what: &str,
    refused_is_fatal: bool,
    cancelled: &dyn Fn() -> Option<Error>,
) -> Result<TcpStream> {
    let mut backoff = Duration::from_millis(5);
    loop {
        if let Some(e) = cancelled() {
            return Err(e);
        }
        let left = deadline.saturating_duration_since(Instant::now());
        match TcpStream::connect_timeout(
            &addr,
            left.clamp(Duration::from_millis(10), Duration::from_secs(2)),
        ) {
            Ok(s) => {
                let _ = s.set_nodelay(true);
                return Ok(s);
            }
            Err(e) => {
                // A peer endpoint exists for the life of its process: refused means gone.
                if refused_is_fatal && e.kind() == std::io::ErrorKind::ConnectionRefused {
                    return Err(Error::Bootstrap(format!(
                        "{what} at {addr} refused the connection: its process has exited"
                    )));
                }
                if Instant::now() + backoff >= deadline {
                    return Err(Error::Bootstrap(format!(
                        "cannot connect to {what} at {addr}: {e}"
                    )));
                }
                std::thread::sleep(backoff);
                backoff = (backoff * 2).min(Duration::from_millis(500));
            }
        }
    }
}

/// Runs the rendezvous and returns the table of all ranks.
pub(crate) fn rendezvous(
    id: &UniqueId,
    rank: usize,
    nranks: usize,
    mut me: PeerInfo,
    deadline: Instant,
    cancelled: &dyn Fn() -> Option<Error>,
) -> Result<([u8; 16], Vec<PeerInfo>)> {
    let mut s = connect_retry(id.root, deadline, "the bootstrap root", false, cancelled)?;
    // Peers reach our endpoint at the address it is bound to, or, bound to
    // every interface, on the interface that reaches the root (the source
    // address the kernel picks).
    if me.addr.ip().is_unspecified()
        && let Ok(local) = s.local_addr()
    {
        me.addr.set_ip(local.ip());
    }
    let ch = wire::read_frame(&mut s, 64, deadline)?;
    if ch.kind == Kind::Error {
        return Err(Error::Bootstrap(format!(
            "root refused: {}",
            String::from_utf8_lossy(&ch.payload)
        )));
    }
    if ch.kind != Kind::Challenge || ch.payload.len() != 16 {
        return Err(Error::Bootstrap(format!(
            "{} is not a Weft bootstrap root (unexpected first message)",
            id.root
        )));
    }
    let client_nonce: [u8; 16] = random()?;
    let hello = Hello {
        nonce: id.nonce,
        client_nonce,
        rank: rank as u32,
        nranks: nranks as u32,
        info: me,
    };
    let msg = wire::encode(Kind::Hello, &hello.encode(), &id.secret, &ch.payload);
    wire::write_all(&mut s, &msg, deadline)?;
    // The root answers once every rank has arrived: wait in slices so an abort
    // of this (non-blocking) init is noticed.
    let reply = loop {
        if let Some(e) = cancelled() {
            return Err(e);
        }
        if wire::wait_readable(&s, Duration::from_millis(200)) {
            break wire::read_frame(&mut s, wire::MAX_PAYLOAD, deadline)?;
        }
        if Instant::now() >= deadline {
            return Err(Error::Bootstrap(format!(
                "timed out waiting for all {nranks} ranks at the root {} (is every rank started, with the same unique id?)",
                id.root
            )));
        }
    };
    match reply.kind {
        Kind::Table => {
            reply.verify(&id.secret, &client_nonce)?;
            decode_table(&reply.payload, nranks)
        }
        Kind::Error => Err(Error::Bootstrap(format!(
            "root refused rank {rank}: {}",
            String::from_utf8_lossy(&reply.payload)
        ))),
        k => Err(Error::Bootstrap(format!("unexpected {k:?} from the root"))),
    }
}
