//! Connection caps for every port of the sidecar (HTTP, the ranks' socket,
//! the peer port) and the rate-limited log of what they refuse.
//!
//! A [`Gate`] counts the open connections of a port, in all and per source
//! address. A connection is *evictable* until it has proved itself (an
//! authenticated attach or peer request) or while it has no request in
//! progress (HTTP). At a cap, a new connection displaces the oldest
//! evictable one (of its own source when the per-source cap is reached, else
//! of the source holding the most): a flood of silent or slow connections
//! cannot keep a health probe, a rank or a peer sidecar out, since they
//! finish their first exchange in milliseconds. With nothing evictable the
//! new connection is refused. Either way it is counted
//! (`weft_rejected_connections_total{port,reason="cap"|"evicted"}`) and
//! logged at most once per source, port and reason every
//! [`crate::log::LOG_EVERY`].

use crate::log::RateLog;
use crate::metrics::Metrics;
use std::collections::HashMap;
use std::net::IpAddr;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// One open connection, as its gate sees it.
pub struct Slot {
    pub source: Option<IpAddr>,
    since: Instant,
    held: AtomicBool,
    evicted: AtomicBool,
    /// A duplicate of the connection's descriptor: eviction shuts the
    /// connection down through it (whatever task or thread is reading it
    /// sees the end at once), and it keeps the number from being reused.
    fd: Option<OwnedFd>,
}

impl Slot {
    /// `true`: the connection proved itself (or is serving a request) and
    /// is never evicted; `false`: evictable again.
    pub fn hold(&self, yes: bool) {
        self.held.store(yes, Ordering::Relaxed);
    }

    /// Whether the gate displaced this connection for a newer one.
    pub fn evicted(&self) -> bool {
        self.evicted.load(Ordering::Relaxed)
    }

    /// Ends the connection now (both directions).
    pub fn shut(&self) {
        if let Some(fd) = &self.fd {
            // SAFETY: shutdown on a descriptor we own.
            unsafe { libc::shutdown(fd.as_raw_fd(), libc::SHUT_RDWR) };
        }
    }
}

/// An admitted connection; dropping it frees its place.
pub struct Ticket {
    gate: Arc<Gate>,
    id: u64,
    pub slot: Arc<Slot>,
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.gate.lock().remove(&self.id);
    }
}

/// The caps of one port.
pub struct Gate {
    port: &'static str,
    what: &'static str,
    max: usize,
    per_source: usize,
    metrics: Arc<Metrics>,
    pub log: Arc<RateLog>,
    conns: Mutex<HashMap<u64, Arc<Slot>>>,
    next: AtomicU64,
}

impl Gate {
    /// `port` labels the counter; `what` names the port in log lines ("peer port").
    pub fn new(
        port: &'static str,
        what: &'static str,
        max: usize,
        per_source: usize,
        metrics: Arc<Metrics>,
        log: Arc<RateLog>,
    ) -> Arc<Gate> {
        Arc::new(Gate {
            port,
            what,
            max: max.max(1),
            per_source: per_source.max(1),
            metrics,
            log,
            conns: Mutex::new(HashMap::new()),
            next: AtomicU64::new(0),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Arc<Slot>>> {
        self.conns.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Open connections.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Admits a connection from `source` (`None`: a Unix socket), displacing
    /// the oldest evictable one at a cap; `None` when it must be refused
    /// (counted and logged here).
    pub fn admit(self: &Arc<Self>, fd: BorrowedFd<'_>, source: Option<IpAddr>) -> Option<Ticket> {
        let mut conns = self.lock();
        let mine = source.map_or(0, |s| {
            conns.values().filter(|c| c.source == Some(s)).count()
        });
        let over_source = source.is_some() && mine >= self.per_source;
        let over_all = conns.len() >= self.max;
        if over_source || over_all {
            let victim = if over_source {
                oldest(conns.iter().filter(|(_, c)| c.source == source))
            } else {
                // The source holding the most evictable connections pays.
                let mut per: HashMap<Option<IpAddr>, usize> = HashMap::new();
                for c in conns.values().filter(|c| !c.held.load(Ordering::Relaxed)) {
                    *per.entry(c.source).or_default() += 1;
                }
                let top = per.into_iter().max_by_key(|(_, n)| *n).map(|(s, _)| s);
                oldest(conns.iter().filter(|(_, c)| Some(c.source) == top))
            };
            let cap = if over_source {
                format!("{} per source", self.per_source)
            } else {
                format!("{} in all", self.max)
            };
            match victim {
                Some(id) => {
                    let v = conns.remove(&id);
                    drop(conns);
                    if let Some(v) = v {
                        v.evicted.store(true, Ordering::Relaxed);
                        v.shut();
                        self.refused(
                            v.source,
                            "evicted",
                            &format!(
                                "closed it for a newer one: too many connections (cap {cap}), this the oldest idle or unauthenticated"
                            ),
                        );
                    }
                    conns = self.lock();
                }
                None => {
                    drop(conns);
                    self.refused(
                        source,
                        "cap",
                        &format!("too many connections (cap {cap}), none idle or unauthenticated"),
                    );
                    return None;
                }
            }
        }
        let slot = Arc::new(Slot {
            source,
            since: Instant::now(),
            held: AtomicBool::new(false),
            evicted: AtomicBool::new(false),
            fd: fd.try_clone_to_owned().ok(),
        });
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        conns.insert(id, slot.clone());
        Some(Ticket {
            gate: self.clone(),
            id,
            slot,
        })
    }

    /// Counts a refusal on this port and logs `why` (rate-limited per
    /// source and reason).
    pub fn refused(&self, source: Option<IpAddr>, reason: &'static str, why: &str) {
        self.metrics.reject(self.port, reason);
        let from = source.map_or_else(String::new, |s| format!(" from {s}"));
        self.log.log(self.port, reason, source, || {
            format!("rejected a connection on the {}{from}: {why}", self.what)
        });
    }
}

fn oldest<'a>(it: impl Iterator<Item = (&'a u64, &'a Arc<Slot>)>) -> Option<u64> {
    it.filter(|(_, c)| !c.held.load(Ordering::Relaxed))
        .min_by_key(|(_, c)| c.since)
        .map(|(id, _)| *id)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{Ipv4Addr, TcpListener, TcpStream};
    use std::os::fd::AsFd;
    use std::time::Duration;

    fn pair(l: &TcpListener) -> (TcpStream, TcpStream) {
        let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (s, _) = l.accept().unwrap();
        (c, s)
    }

    #[test]
    fn caps_evict_the_oldest_idle_connection_of_the_source() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let g = Gate::new(
            "test",
            "connection",
            4,
            2,
            Arc::new(Metrics::new()),
            Arc::default(),
        );
        let a = Some(IpAddr::V4(Ipv4Addr::new(10, 0, 0, 1)));
        let b = Some(IpAddr::V4(Ipv4Addr::new(10, 0, 0, 2)));
        let conns: Vec<_> = (0..6).map(|_| pair(&l)).collect();
        let t0 = g.admit(conns[0].1.as_fd(), a).unwrap();
        let t1 = g.admit(conns[1].1.as_fd(), a).unwrap();
        // The third from a: the oldest of a goes.
        let t2 = g.admit(conns[2].1.as_fd(), a).unwrap();
        assert!(t0.slot.evicted() && !t1.slot.evicted());
        assert_eq!(g.len(), 2);
        // Held connections are never displaced: a's are both held now.
        t1.slot.hold(true);
        t2.slot.hold(true);
        assert!(g.admit(conns[3].1.as_fd(), a).is_none());
        // Other sources fill the rest; at the total cap the source with the
        // most evictable connections pays.
        let t4 = g.admit(conns[4].1.as_fd(), b).unwrap();
        let t5 = g.admit(conns[5].1.as_fd(), b).unwrap();
        assert_eq!(g.len(), 4);
        let extra = pair(&l);
        let t6 = g.admit(extra.1.as_fd(), None).unwrap();
        assert!(t4.slot.evicted() && !t5.slot.evicted() && !t6.slot.evicted());
        drop((t1, t2, t5, t6));
        assert!(g.is_empty());
        // The evicted connection was shut down: its client sees the end.
        use std::io::Read;
        let mut c = &conns[0].0;
        c.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        assert_eq!(c.read(&mut [0u8; 1]).unwrap(), 0);
    }
}
