//! A rank's side of bootstrap: connect to the root (retrying while it is not
//! up yet), answer the challenge with a hello, receive the table.

use super::wire::{self, Kind};
use super::{Hello, PeerInfo, decode_table};
use crate::bootstrap::handshake::random;
use crate::bootstrap::unique_id::UniqueId;
use crate::error::{Error, Result};
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

/// Whether the other side closed or reset `s` without a word (an accept
/// loop at its cap drops a handshake that has not completed yet).
pub(crate) fn dropped(s: &TcpStream) -> Option<String> {
    let mut b = [0u8; 1];
    match s.peek(&mut b) {
        Ok(0) => Some("closed".into()),
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::ConnectionAborted
            ) =>
        {
            Some(e.to_string())
        }
        _ => None,
    }
}

/// Connections dropped before their handshake completed are retried this
/// many times, when the drop came this soon after our message.
pub(crate) const HANDSHAKE_RETRIES: u32 = 3;
pub(crate) const DROP_WINDOW: Duration = Duration::from_secs(2);

enum Attempt {
    Done(([u8; 16], Vec<PeerInfo>)),
    /// Dropped by the root before it read our hello: try again.
    Dropped(Error),
}

/// Runs the rendezvous and returns the table of all ranks.
pub(crate) fn rendezvous(
    id: &UniqueId,
    rank: usize,
    nranks: usize,
    me: PeerInfo,
    deadline: Instant,
    cancelled: &dyn Fn() -> Option<Error>,
) -> Result<([u8; 16], Vec<PeerInfo>)> {
    let mut connect_by = deadline;
    for tries in 0.. {
        let s = connect_retry(id.root, connect_by, "the bootstrap root", false, cancelled)?;
        match attempt(s, id, rank, nranks, me.clone(), deadline, cancelled)? {
            Attempt::Done(t) => return Ok(t),
            Attempt::Dropped(e) if tries >= HANDSHAKE_RETRIES => return Err(e),
            Attempt::Dropped(e) => {
                crate::log::info_log!("bootstrap: {e}; connecting again");
                std::thread::sleep(Duration::from_millis(10 << tries));
                // A root that is gone refuses: do not wait long for it.
                connect_by = deadline.min(Instant::now() + DROP_WINDOW);
            }
        }
    }
    unreachable!()
}

fn attempt(
    mut s: TcpStream,
    id: &UniqueId,
    rank: usize,
    nranks: usize,
    mut me: PeerInfo,
    deadline: Instant,
    cancelled: &dyn Fn() -> Option<Error>,
) -> Result<Attempt> {
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
    let sent = Instant::now();
    if let Err(e) = wire::write_all(&mut s, &msg, deadline) {
        return Ok(Attempt::Dropped(e));
    }
    // The root answers once every rank has arrived: wait in slices so an abort
    // of this (non-blocking) init is noticed.
    let reply = loop {
        if let Some(e) = cancelled() {
            return Err(e);
        }
        if wire::wait_readable(&s, Duration::from_millis(200)) {
            if sent.elapsed() < DROP_WINDOW
                && let Some(why) = dropped(&s)
            {
                return Ok(Attempt::Dropped(Error::Bootstrap(format!(
                    "the root at {} dropped our connection before reading the hello ({why})",
                    id.root
                ))));
            }
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
            decode_table(&reply.payload, nranks).map(Attempt::Done)
        }
        Kind::Error => Err(Error::Bootstrap(format!(
            "root refused rank {rank}: {}",
            String::from_utf8_lossy(&reply.payload)
        ))),
        k => Err(Error::Bootstrap(format!("unexpected {k:?} from the root"))),
    }
}
