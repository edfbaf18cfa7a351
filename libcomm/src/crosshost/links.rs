//! Setting up one rank's connections over a [`Net`], and failure notices.
//!
//! Every rank listens once and hands its connect handle to every rank
//! through an [`Exchange`] (an all-gather over the bootstrap: the host
//! communicator in production, a shared board for ranks that are threads);
//! then it connects to each of its peers (connecting never waits for the
//! peer's thread: the transport's listener authenticates and queues) and
//! accepts one connection from each. The listener stays open for failure
//! notices: a rank whose engine fails tells its peers why on a fresh
//! connection (stream [`NOTICE_STREAM`]), so a peer that then sees its
//! connection to that rank close blames the rank that failed first, not the
//! messenger. A rank whose wait timed out first says whom it waits for
//! (stream [`WAITS_STREAM`]), so the ranks that timed out together can follow
//! the chain of waits to the rank that is stuck (see the engine).

use crate::error::{Error, Result};
use crate::net::{
    ConnectHandle, HANDLE_MAX, ListenComm, MemKind, Net, NetError, Peer, RecvBuf, RecvComm,
    SendComm,
};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::time::{Duration, Instant};

/// The stream number of data connections.
pub const DATA_STREAM: u32 = 0;
/// The stream number of a failure notice's connection.
pub const NOTICE_STREAM: u32 = u32::MAX;
/// The stream number of a "waits for" notice's connection.
pub const WAITS_STREAM: u32 = u32::MAX - 1;
/// The tag of a failure notice's message.
const NOTICE_TAG: u32 = 0x4e4f_5449; // "NOTI"
/// Longest notice read.
const NOTICE_MAX: usize = 1024;
/// Notices in flight at once.
const NOTICE_PARALLEL: usize = 16;

/// What arrives on the listener after setup.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Notice {
    /// `rank` failed, for this reason; `origin`: the rank whose own
    /// failure started it (`rank` itself, or the rank whose notice `rank`
    /// failed from: a rank that relays a failure explains no wait).
    Failed {
        rank: usize,
        origin: usize,
        why: String,
    },
    /// `rank` timed out waiting for rank `on` (it has not failed yet).
    Waits { rank: usize, on: usize },
}

/// An all-gather of one fixed-size record per rank, in rank order (the
/// communicator implements it in `comm/cross_mover.rs`; tests over a board).
pub trait Exchange {
    fn all_gather(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>>;
}

/// One rank's connections: a send and a receive comm per peer, the listener
/// (kept for notices) and every rank's handle (to send notices to).
pub struct Links {
    pub me: usize,
    pub net: Arc<dyn Net>,
    pub send: BTreeMap<usize, Box<dyn SendComm>>,
    pub recv: BTreeMap<usize, Box<dyn RecvComm>>,
    pub listen: Box<dyn ListenComm>,
    pub handles: Vec<ConnectHandle>,
}

fn setup_err(what: String) -> Error {
    Error::Bootstrap(format!("cross-host connections: {what}"))
}

impl Links {
    /// Connects rank `me` with each of `peers` (a set every peer computes
    /// alike: `me` connects to `p` exactly when `p` connects to `me`) by
    /// `deadline`. Every rank of the exchange must call it.
    pub fn connect(
        net: Arc<dyn Net>,
        exchange: &dyn Exchange,
        me: usize,
        peers: &[usize],
        deadline: Instant,
    ) -> Result<Links> {
        let (handle, mut listen) = net
            .listen(0)
            .map_err(|e| setup_err(format!("listening: {e}")))?;
        let mut mine = vec![0u8; 1 + HANDLE_MAX];
        mine[0] = handle.as_bytes().len() as u8;
        mine[1..1 + handle.as_bytes().len()].copy_from_slice(handle.as_bytes());
        let all = exchange.all_gather(&mine)?;
        let handles = all
            .iter()
            .enumerate()
            .map(|(r, rec)| {
                let n = rec.first().copied().unwrap_or(0) as usize;
                rec.get(1..1 + n)
                    .ok_or_else(|| setup_err(format!("rank {r}'s handle is truncated")))
                    .and_then(|b| {
                        ConnectHandle::from_bytes(b)
                            .map_err(|e| setup_err(format!("rank {r}: {e}")))
                    })
            })
            .collect::<Result<Vec<_>>>()?;
        let mut send = BTreeMap::new();
        for &p in peers {
            let h = handles
                .get(p)
                .ok_or_else(|| setup_err(format!("no rank {p} among {}", handles.len())))?;
            let me32 = Peer {
                rank: me as u32,
                stream: DATA_STREAM,
            };
            let c = net
                .connect(0, h, me32, deadline, &|| false)
                .map_err(|e| setup_err(format!("connecting to rank {p}: {e}")))?;
            send.insert(p, c);
        }
        let mut recv: BTreeMap<usize, Box<dyn RecvComm>> = BTreeMap::new();
        while recv.len() < peers.len() {
            let got = listen
                .accept(deadline)
                .map_err(|e| setup_err(format!("accepting: {e}")))?;
            let Some((c, who)) = got else {
                let missing: Vec<usize> = peers
                    .iter()
                    .copied()
                    .filter(|p| !recv.contains_key(p))
                    .collect();
                return Err(setup_err(format!(
                    "rank(s) {missing:?} did not connect in time"
                )));
            };
            let p = who.rank as usize;
            if who.stream != DATA_STREAM || !peers.contains(&p) || recv.contains_key(&p) {
                return Err(setup_err(format!(
                    "an unexpected connection from rank {p} (stream {})",
                    who.stream
                )));
            }
            recv.insert(p, c);
        }
        Ok(Links {
            me,
            net,
            send,
            recv,
            listen,
            handles,
        })
    }

    /// Tells every other rank why this rank failed (its host's ranks too:
    /// a local phase waiting on this rank then learns the cause, not only
    /// that this rank went), and which rank's failure started it
    /// (`origin`: this rank, or the rank whose notice it failed from): a
    /// fresh connection each, up to `NOTICE_PARALLEL` at once, bounded by
    /// `within` in all (a lost host never answers).
    pub fn send_notices(&self, origin: usize, reason: &str, within: Duration) {
        let text = format!("{origin}\n{reason}");
        self.broadcast(NOTICE_STREAM, text.as_bytes(), within);
    }

    /// Tells every other rank that this rank timed out waiting for rank
    /// `on` (bounded as [`Links::send_notices`]).
    pub fn send_waits(&self, on: usize, within: Duration) {
        self.broadcast(WAITS_STREAM, on.to_string().as_bytes(), within);
    }

    fn broadcast(&self, stream: u32, bytes: &[u8], within: Duration) {
        let deadline = Instant::now() + within;
        let bytes = &bytes[..bytes.len().min(NOTICE_MAX)];
        let me = Peer {
            rank: self.me as u32,
            stream,
        };
        let others: Vec<usize> = (0..self.handles.len()).filter(|&r| r != self.me).collect();
        let next = AtomicUsize::new(0);
        let (net, handles) = (self.net.as_ref(), &self.handles);
        std::thread::scope(|s| {
            for _ in 0..NOTICE_PARALLEL.min(others.len()) {
                s.spawn(|| {
                    while let Some(&p) = others.get(next.fetch_add(1, Relaxed)) {
                        let _ = send_notice(net, &handles[p], me, bytes, deadline);
                    }
                });
            }
        });
    }

    /// A notice that arrived (none waiting: `None` at once, or after
    /// waiting until `until`).
    pub fn take_notice(&mut self, until: Instant) -> Option<Notice> {
        loop {
            let (c, who) = self.listen.accept(until).ok()??;
            let rank = who.rank as usize;
            let text = || read_notice(c, Instant::now() + Duration::from_millis(200));
            match who.stream {
                NOTICE_STREAM => {
                    let text = text().unwrap_or_else(|| "it failed (no reason arrived)".into());
                    // "origin\nreason"; a notice without a valid origin is
                    // the sender's own.
                    let (origin, why) = match text.split_once('\n') {
                        Some((o, why)) => match o.parse::<usize>() {
                            Ok(o) if o < self.handles.len() => (o, why.to_string()),
                            _ => (rank, text.clone()),
                        },
                        None => (rank, text.clone()),
                    };
                    return Some(Notice::Failed { rank, origin, why });
                }
                WAITS_STREAM => {
                    // A rank that names no valid rank is ignored (it fails
                    // soon enough by itself, with a notice).
                    if let Some(on) = text()
                        .and_then(|t| t.trim().parse::<usize>().ok())
                        .filter(|&on| on < self.handles.len() && on != rank)
                    {
                        return Some(Notice::Waits { rank, on });
                    }
                }
                _ => crate::log::warn_log!(
                    "cross-host: rank {} connected again after setup; ignored",
                    who.rank
                ),
            }
        }
    }
}

/// The end of the chain of waits that starts at rank `first` (`waits[r]`:
/// whom rank r said it waits for): the ranks visited, in order, the last
/// being the one that said nothing (the stuck one) or closes a circle.
pub fn chain_of_waits(first: usize, waits: &BTreeMap<usize, usize>) -> Vec<usize> {
    let mut chain = vec![first];
    let mut at = first;
    while let Some(&next) = waits.get(&at) {
        if chain.contains(&next) {
            break;
        }
        chain.push(next);
        at = next;
    }
    chain
}

fn send_notice(
    net: &dyn Net,
    h: &ConnectHandle,
    me: Peer,
    bytes: &[u8],
    deadline: Instant,
) -> std::result::Result<(), NetError> {
    let past = || Instant::now() >= deadline;
    let mut c = net.connect(0, h, me, deadline, &past)?;
    let mr = c.reg_mr(bytes.as_ptr(), bytes.len(), MemKind::Host)?;
    // SAFETY: `bytes` outlives the request: we wait for it or drop the comm.
    let Some(req) = (unsafe { c.isend(&mr, bytes.as_ptr(), bytes.len(), NOTICE_TAG)? }) else {
        return Ok(());
    };
    while !past() {
        if c.test(req)?.is_some() {
            break;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    Ok(())
}

fn read_notice(c: Box<dyn RecvComm>, deadline: Instant) -> Option<String> {
    let mut buf = vec![0u8; NOTICE_MAX];
    // Declared after `buf`, so dropped (its threads stopped) before it.
    let mut c = c;
    let mr = c.reg_mr(buf.as_ptr(), buf.len(), MemKind::Host).ok()?;
    let b = RecvBuf {
        mr: &mr,
        ptr: buf.as_mut_ptr(),
        len: buf.len(),
        tag: NOTICE_TAG,
    };
    // SAFETY: `buf` outlives the request: we wait for it or drop the comm
    // (which stops its threads) before returning.
    let req = unsafe { c.irecv(&[b]) }.ok()??;
    while Instant::now() < deadline {
        match c.test(req) {
            Ok(Some(n)) => {
                let n = n.first().copied().unwrap_or(0).min(NOTICE_MAX);
                return Some(String::from_utf8_lossy(&buf[..n]).into_owned());
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(1)),
            Err(_) => return None,
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::chain_of_waits;
    use std::collections::BTreeMap;

    #[test]
    fn a_chain_of_waits_ends_at_the_rank_that_reported_none() {
        let waits = BTreeMap::from([(1, 3), (3, 2), (0, 2)]);
        assert_eq!(chain_of_waits(3, &waits), [3, 2]);
        assert_eq!(chain_of_waits(1, &waits), [1, 3, 2]);
        assert_eq!(chain_of_waits(2, &waits), [2]);
        // A circle stops before it repeats.
        let circle = BTreeMap::from([(0, 1), (1, 2), (2, 0)]);
        assert_eq!(chain_of_waits(1, &circle), [1, 2, 0]);
    }
}
