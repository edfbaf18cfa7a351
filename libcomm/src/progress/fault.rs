//! Failure propagation within a communicator.
//!
//! When any rank aborts or notices a failure (a peer process died, a
//! connection dropped, a mismatched message arrived), it raises the failure on
//! its own control block and on every local peer's, and shuts down its TCP
//! connections so remote peers see the loss at once. Every waiting rank checks
//! its own flag, so a whole job learns of a failure within one wait slice.
//! This object is shared by the communicator's lock-free paths (abort from
//! another thread) and the progress engine.

use crate::transport::shm::{FAIL_ABORT, Mapping, ST_DESTROYED};
use crate::transport::tcp::{FailNotify, NoticeSink};
use std::net::TcpStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// How often a query may look at the local peers' processes
/// ([`Fault::dead_local_due`]): each look is a `kill(pid, 0)` and a read of
/// `/proc/<pid>/stat` per peer (system calls: microseconds), and torch's
/// watchdog queries `ncclCommGetAsyncError` once per outstanding work item
/// while it holds the lock the next collective's enqueue needs. With a
/// look per query, two ranks' enqueues paused 22-67 ms; with this limit
/// 14-16 ms, what NCCL shows with one rank (docs/PERFORMANCE-GPU.md,
/// "Stalls"). A death is still noticed within this much of the next query.
pub(crate) const PEER_SCAN_EVERY: Duration = Duration::from_millis(2);

pub(crate) struct Fault {
    pub rank: usize,
    pub own: Arc<Mapping>,
    /// (rank, mapping) of every local peer.
    pub locals: Vec<(usize, Arc<Mapping>)>,
    pub tcp: Mutex<Vec<TcpStream>>,
    /// Where to tell remote peers why, when a failure starts here.
    pub notify: Option<FailNotify>,
    /// When [`dead_local_due`](Self::dead_local_due) may look again (ns
    /// since a process-wide epoch).
    pub next_scan_ns: AtomicU64,
}

/// Monotonic nanoseconds since the first call in this process.
fn mono_ns() -> u64 {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    EPOCH.get_or_init(Instant::now).elapsed().as_nanos() as u64
}

/// A failure seen by this rank: who raised it, whether it was an abort, why.
#[derive(Debug, Clone)]
pub(crate) struct Raised {
    pub origin: usize,
    pub abort: bool,
    pub reason: String,
}

impl Fault {
    /// Raises a failure originating here. Idempotent; the first reason wins.
    pub fn raise(&self, kind: u32, reason: &str) {
        let c = self.own.control();
        if c.failure().is_none() {
            c.set_reason(reason);
        }
        let first = c.raise(self.rank, kind);
        // Remote peers see our connections close; tell them why first
        // (bounded), so they blame the rank that failed, not us.
        if first && let Some(n) = &self.notify {
            n.send(self.rank as u32, kind, &c.reason());
        }
        self.spread(kind);
    }

    /// A remote peer told us (through our endpoint) that the communicator
    /// failed: raise it here with its origin and reason, and pass it on to
    /// our local peers (our own connections close as for any failure).
    pub fn learn(&self, origin: usize, kind: u32, reason: &str) {
        let c = self.own.control();
        if c.failure().is_none() {
            c.set_reason(reason);
        }
        c.raise(origin, kind);
        self.spread(kind);
    }

    /// Passes a failure we observed on to our local and remote peers.
    pub fn spread(&self, kind: u32) {
        let origin = self
            .own
            .control()
            .failure()
            .map(|f| f.0)
            .unwrap_or(self.rank);
        for (_, m) in &self.locals {
            m.control().raise(origin, kind);
        }
        for s in self.tcp.lock().unwrap_or_else(|e| e.into_inner()).iter() {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
    }

    /// [`dead_local`](Self::dead_local), at most once per
    /// [`PEER_SCAN_EVERY`] (between two looks: `None`). For queries that
    /// an application may make in a tight loop.
    pub fn dead_local_due(&self) -> Option<(usize, u32)> {
        if self.locals.is_empty() {
            return None;
        }
        let now = mono_ns();
        let next = self.next_scan_ns.load(Ordering::Relaxed);
        if now < next
            || self
                .next_scan_ns
                .compare_exchange(
                    next,
                    now + PEER_SCAN_EVERY.as_nanos() as u64,
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                )
                .is_err()
        {
            return None;
        }
        self.dead_local()
    }

    /// A local peer whose process is gone without having destroyed its
    /// communicator: (rank, pid). The host path notices this while it waits;
    /// device work has no host waiter, so queries (`ncclCommGetAsyncError`)
    /// and the device watch call this. A peer that destroyed its side and
    /// then exited is not a failure.
    pub fn dead_local(&self) -> Option<(usize, u32)> {
        self.locals.iter().find_map(|(rank, m)| {
            let c = m.control();
            let pid = c.pid.load(Ordering::Relaxed);
            // The process first, then its state: a peer that destroys its
            // side and exits between the two reads must not look like one
            // that died without destroying (read the other way round, the
            // state was read before its destroy and the pid after its
            // exit: a finished peer was reported as failed, seen once in
            // CI). Its last store precedes its exit, so once the process is
            // seen gone the state it left is the one read here.
            let gone = !crate::sys::topology::pid_alive(pid)
                && c.state.load(Ordering::Acquire) != ST_DESTROYED;
            gone.then_some((*rank, pid))
        })
    }

    /// Local peers whose process is stopped (SIGSTOP, a debugger): alive,
    /// so no failure of theirs is ever seen, and everything that waits for
    /// them waits. A failure reported by another rank (which names what it
    /// waited for, possibly a rank held up behind a stopped one) gets them
    /// named ([`Fault::describe`]).
    pub fn stopped_locals(&self) -> Vec<(usize, u32)> {
        self.locals
            .iter()
            .map(|(rank, m)| (*rank, m.control().pid.load(Ordering::Relaxed)))
            .filter(|&(_, pid)| crate::sys::topology::pid_stopped(pid))
            .collect()
    }

    /// A raised failure as this rank's error detail: its own reason, or
    /// "rank X reported a failure: ..." for another rank's, led by this
    /// host's stopped peers if any ("rank 3 of this host (pid N) is
    /// stopped (SIGSTOP or a debugger); rank 0 reported a failure: ..."):
    /// the reporting rank names what it waited for, which may be a rank
    /// held up behind the stopped one (first, since a relayed reason may
    /// be cut short).
    pub fn describe(&self, r: &Raised) -> String {
        if r.origin == self.rank {
            return r.reason.clone();
        }
        let reported = if r.reason.is_empty() {
            format!("rank {} failed", r.origin)
        } else {
            format!("rank {} reported a failure: {}", r.origin, r.reason)
        };
        let stopped: Vec<String> = self
            .stopped_locals()
            .into_iter()
            .filter(|&(rank, _)| rank != r.origin)
            .map(|(rank, pid)| {
                format!("rank {rank} of this host (pid {pid}) is stopped (SIGSTOP or a debugger)")
            })
            .collect();
        match stopped.is_empty() {
            true => reported,
            false => format!("{}; {reported}", stopped.join("; ")),
        }
    }

    #[inline]
    pub fn check(&self) -> Option<Raised> {
        let (origin, kind) = self.own.control().failure()?;
        let reason = if origin == self.rank {
            self.own.control().reason()
        } else {
            // A local origin wrote its reason in its own block; a remote
            // one's came with its notice, into ours, or into the block of
            // the rank of this host that got the notice first (which then
            // raised the failure here without the reason: `spread`).
            self.locals
                .iter()
                .find(|(r, _)| *r == origin)
                .map(|(_, m)| m.control().reason())
                .or_else(|| Some(self.own.control().reason()).filter(|r| !r.is_empty()))
                .or_else(|| {
                    self.locals
                        .iter()
                        .map(|(_, m)| m.control())
                        .filter(|c| c.failure().map(|f| f.0) == Some(origin))
                        .map(|c| c.reason())
                        .find(|r| !r.is_empty())
                })
                .unwrap_or_default()
        };
        Some(Raised {
            origin,
            abort: kind == FAIL_ABORT,
            reason,
        })
    }
}

/// A remote peer's failure notice, from this process's TCP endpoint.
impl NoticeSink for Fault {
    fn learn(&self, origin: usize, kind: u32, reason: &str) {
        Fault::learn(self, origin, kind, reason)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A rank's shared-memory control block of its own (a memfd).
    fn control_block(name: &str) -> Arc<Mapping> {
        Arc::new(Mapping::create_memfd(name, 2, 4096).unwrap().0)
    }

    fn fault(rank: usize, own: &Arc<Mapping>, peer: (usize, &Arc<Mapping>)) -> Fault {
        Fault {
            rank,
            own: own.clone(),
            locals: vec![(peer.0, peer.1.clone())],
            tcp: Mutex::new(Vec::new()),
            notify: None,
            next_scan_ns: AtomicU64::new(0),
        }
    }

    /// Queries in a tight loop look at the peers' processes once per
    /// PEER_SCAN_EVERY; the first query looks at once, and a death is seen
    /// by the first query after the interval.
    #[test]
    fn peer_processes_are_looked_at_once_per_interval() {
        let a = control_block("fault-test-scan-a");
        let b = control_block("fault-test-scan-b");
        // The peer's pid: a child that has exited and been reaped.
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        b.control().pid.store(pid, Ordering::Relaxed);
        let f = fault(0, &a, (1, &b));
        assert_eq!(f.dead_local_due(), Some((1, pid)), "the first query looks");
        let t = Instant::now();
        let mut seen = 0;
        while t.elapsed() < PEER_SCAN_EVERY / 2 {
            seen += f.dead_local_due().is_some() as u32;
        }
        assert_eq!(seen, 0, "no second look within the interval");
        std::thread::sleep(PEER_SCAN_EVERY);
        assert_eq!(
            f.dead_local_due(),
            Some((1, pid)),
            "the next interval looks again"
        );
    }

    /// A remote rank's notice reaches one rank of this host; the others
    /// learn of the failure from it through shared memory and must still
    /// name the notice's reason, not only "rank N failed" (issue 32: a
    /// survivor of a SIGKILL on the other host named the wrong rank).
    #[test]
    fn a_remote_reason_reaches_every_local_rank() {
        let a = control_block("fault-test-a");
        let b = control_block("fault-test-b");
        let (r0, r1) = (fault(0, &a, (1, &b)), fault(1, &b, (0, &a)));
        r0.learn(
            2,
            crate::transport::shm::FAIL_ERROR,
            "rank 3 (pid 9) exited",
        );
        for f in [&r0, &r1] {
            let got = f.check().expect("raised");
            assert_eq!(got.origin, 2);
            assert_eq!(got.reason, "rank 3 (pid 9) exited", "rank {}", f.rank);
        }
    }

    /// A failure reported by another rank comes led by this host's stopped
    /// peers (SIGSTOP): alive, never failing themselves, they may be what
    /// the reporting rank's wait was held up behind (issue 32: a survivor
    /// across hosts named a rank blocked behind a stopped one). Running
    /// again, a peer is not named; the rank's own failure is its reason.
    #[test]
    fn a_reported_failure_names_a_stopped_local_peer_first() {
        let a = control_block("fault-test-stop-a");
        let b = control_block("fault-test-stop-b");
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let pid = child.id();
        b.control().pid.store(pid, Ordering::Relaxed);
        let f = fault(0, &a, (1, &b));
        let reported = Raised {
            origin: 2,
            abort: false,
            reason: "timed out waiting for rank 0".into(),
        };
        let plain = "rank 2 reported a failure: timed out waiting for rank 0";
        assert!(f.stopped_locals().is_empty());
        assert_eq!(f.describe(&reported), plain);
        let signal = |sig| unsafe { libc::kill(pid as libc::pid_t, sig) };
        signal(libc::SIGSTOP);
        let t = Instant::now();
        while f.stopped_locals().is_empty() {
            assert!(t.elapsed() < Duration::from_secs(5), "never seen stopped");
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(f.stopped_locals(), vec![(1, pid)]);
        assert_eq!(
            f.describe(&reported),
            format!("rank 1 of this host (pid {pid}) is stopped (SIGSTOP or a debugger); {plain}")
        );
        let own = Raised {
            origin: 0,
            abort: false,
            reason: "mine".into(),
        };
        assert_eq!(f.describe(&own), "mine", "its own failure: its reason");
        signal(libc::SIGCONT);
        let t = Instant::now();
        while !f.stopped_locals().is_empty() {
            assert!(t.elapsed() < Duration::from_secs(5), "never seen running");
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(f.describe(&reported), plain);
        let _ = child.kill();
        let _ = child.wait();
    }
}
