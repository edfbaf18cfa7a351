//! The sidecar's job state (processes, communicators, ranks) and the RAS
//! snapshots published from it.
//!
//! Writers (the per-process Attach streams) mutate the registry under its
//! mutex and publish a fresh immutable `Status` into an `ArcSwap`; readers
//! (`GetStatus`, the HTTP page, the storm test) only load that `Arc`: the
//! status path never takes a lock that registration or events take.

use arc_swap::ArcSwap;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{SystemTime, UNIX_EPOCH};
use tokio::sync::mpsc;
use weft_agent::ring::codes;
use weft_agent::ring::slots::{self, SlotView};
use weft_agent::rpc::{self, CommStatus, HostStatus, ProcessStatus, RankStatus, Status};

pub type CmdTx = mpsc::Sender<Result<rpc::SidecarCommand, tonic::Status>>;

pub fn now_nanos() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

/// One attached rank process (one Attach stream).
pub struct Proc {
    pub pid: u32,
    /// Its pid in this sidecar's namespace, when it shares ours (see
    /// `ConnInfo::peer_pid`).
    pub os_pid: Option<u32>,
    pub host: String,
    pub gpus: Vec<String>,
    pub alive: bool,
    pub tx: CmdTx,
    /// Events an older agent said it dropped (`Hello.dropped_events`).
    pub dropped: u64,
    /// Operations its telemetry ring dropped (or lost), as last read.
    pub ring_dropped: u64,
    /// Communicator ranks it registered: a process that ends with all of
    /// them destroyed exited; one that never registered any did not get far
    /// enough to finish anything (a replacement dying while it joins).
    pub registered: u64,
    /// Its telemetry segment, when it passed one.
    pub ring: Option<Arc<super::drain::ProcRing>>,
    /// How to tell whether the process still lives (not its stream).
    pub liveness: Arc<super::liveness::Liveness>,
    /// Its control stream ended while it lived: it should attach again.
    pub disconnected: bool,
    /// Commands for it while disconnected, sent when it attaches again.
    pub pending: Vec<rpc::SidecarCommand>,
    /// Wakes whoever waits on its departure when it attaches again.
    pub reattached: Arc<tokio::sync::Notify>,
}

/// Commands kept for a disconnected process, at most.
pub const MAX_PENDING: usize = 64;

#[derive(Default, Clone)]
pub struct RankEntry {
    pub conn: u64,
    /// The process's pid and host, kept after it has gone.
    pub pid: u32,
    pub host: String,
    pub started_seq: u64,
    pub started_op: String,
    pub started_at: u64,
    pub completed_seq: u64,
    pub completed_op: String,
    pub outcome: String,
    /// running, finalizing, aborted, failed
    pub state: String,
}

impl RankEntry {
    /// Copies its slot's view (from the process's telemetry segment) into
    /// this entry; whether anything changed.
    pub fn apply_slot(&mut self, v: &SlotView, err: Option<String>) -> bool {
        if self.started_seq == v.started_seq
            && self.completed_seq == v.completed_seq
            && !matches!(v.state, slots::FAILED | slots::ABORTED | slots::DESTROYED)
        {
            return false;
        }
        let before = (self.started_seq, self.completed_seq, self.state.clone());
        // An untimed start (libcomm's sampling) has no time: the first
        // drain that sees it stands in (2-5 ms late: nothing next to the
        // seconds a stuck rank is given).
        if self.started_seq != v.started_seq {
            self.started_at = if v.started_ns != 0 {
                v.started_ns
            } else {
                now_nanos()
            };
        }
        self.started_seq = v.started_seq;
        self.started_op = codes::op_name(v.started_op).into();
        if v.completed_seq > 0 {
            self.completed_seq = v.completed_seq;
            self.completed_op = codes::op_name(v.completed_op).into();
            self.outcome = if v.outcome == codes::OK {
                "ok".into()
            } else {
                err.unwrap_or_else(|| "error".into())
            };
        }
        match v.state {
            slots::FAILED => self.state = "failed".into(),
            slots::ABORTED => self.state = "aborted".into(),
            slots::DESTROYED => self.state = "finalizing".into(),
            _ => {}
        }
        before != (self.started_seq, self.completed_seq, self.state.clone())
    }
}

#[derive(Default)]
pub struct Comm {
    pub nranks: u32,
    pub ranks: BTreeMap<u32, RankEntry>,
}

/// What heartbeats say about one peer sidecar.
#[derive(Default, Clone)]
pub struct PeerState {
    pub host: String,
    pub last_seen: u64,
    pub lost: bool,
    /// The last answer, or the first failed attempt when it never answered.
    pub since: Option<std::time::Instant>,
}

#[derive(Default)]
pub struct Registry {
    pub peers: BTreeMap<String, PeerState>,
    pub procs: BTreeMap<u64, Proc>,
    pub comms: BTreeMap<String, Comm>,
    pub async_errors: Vec<String>,
    /// Events dropped by processes that have exited cleanly (removed from
    /// `procs`): RAS keeps counting them.
    pub dropped_gone: u64,
}

/// Most async errors kept (the oldest are dropped first): the snapshot stays bounded.
const MAX_ERRORS: usize = 256;

impl Registry {
    pub fn push_error(&mut self, e: String) {
        if self.async_errors.len() >= MAX_ERRORS {
            self.async_errors.remove(0);
        }
        self.async_errors.push(e);
    }
}

pub struct State {
    pub job: String,
    pub host: String,
    reg: Mutex<Registry>,
    snap: ArcSwap<Status>,
    seq: AtomicU64,
    next_conn: AtomicU64,
    pub terminating: AtomicBool,
    /// Events arrive far faster than anyone reads status: they mark the
    /// registry dirty and one task publishes at most every `COALESCE`.
    dirty: AtomicBool,
    wake: tokio::sync::Notify,
}

const COALESCE: std::time::Duration = std::time::Duration::from_millis(2);
const REFRESH: std::time::Duration = std::time::Duration::from_secs(1);

/// A rank whose collective has been in flight this long is reported `stuck`
/// (`WEFT_RAS_STUCK_MS`, default 10 s): the hang shows in RAS.
fn stuck_after_ns() -> u64 {
    static V: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *V.get_or_init(|| weft_contract::params::WEFT_RAS_STUCK_MS.value() * 1_000_000)
}

impl State {
    pub fn new(job: String, host: String) -> Arc<State> {
        let s = Arc::new(State {
            job,
            host,
            reg: Mutex::new(Registry::default()),
            snap: ArcSwap::from_pointee(Status::default()),
            seq: AtomicU64::new(0),
            next_conn: AtomicU64::new(1),
            terminating: AtomicBool::new(false),
            dirty: AtomicBool::new(false),
            wake: tokio::sync::Notify::new(),
        });
        s.publish(&s.lock());
        s
    }

    pub fn conn_id(&self) -> u64 {
        self.next_conn.fetch_add(1, Ordering::Relaxed)
    }

    pub fn lock(&self) -> MutexGuard<'_, Registry> {
        self.reg.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The current snapshot: an atomic load, no lock.
    pub fn snapshot(&self) -> Arc<Status> {
        self.snap.load_full()
    }

    /// Marks the registry changed; the publisher task publishes soon.
    pub fn touch(&self) {
        if !self.dirty.swap(true, Ordering::AcqRel) {
            self.wake.notify_one();
        }
    }

    /// Publishes what [`touch`](Self::touch) marked, coalescing bursts.
    pub async fn publisher(self: Arc<Self>) {
        loop {
            // Also once a second regardless: time-based states ("stuck") age.
            let woken = tokio::time::timeout(REFRESH, self.wake.notified()).await;
            if woken.is_ok() {
                tokio::time::sleep(COALESCE).await;
            }
            if self.dirty.swap(false, Ordering::AcqRel) || woken.is_err() {
                let reg = self.lock();
                self.publish(&reg);
            }
        }
    }

    /// Builds and publishes a snapshot of `reg` (call with the registry locked).
    pub fn publish(&self, reg: &Registry) {
        self.dirty.store(false, Ordering::Release);
        let now = now_nanos();
        let procs: Vec<ProcessStatus> = reg
            .procs
            .values()
            .map(|p| ProcessStatus {
                pid: p.pid,
                host: p.host.clone(),
                state: match (p.alive, p.disconnected) {
                    (false, _) => "dead",
                    (true, true) => "disconnected",
                    (true, false) => "alive",
                }
                .into(),
                gpus: p.gpus.clone(),
                dropped_events: p.dropped + p.ring_dropped,
            })
            .collect();
        let comms = reg
            .comms
            .iter()
            .map(|(id, c)| {
                let ranks: Vec<RankStatus> = c
                    .ranks
                    .iter()
                    .map(|(r, e)| {
                        let p = reg.procs.get(&e.conn);
                        let alive = p.is_some_and(|p| p.alive);
                        let stuck = e.started_seq > e.completed_seq
                            && now.saturating_sub(e.started_at) > stuck_after_ns();
                        // A rank that destroyed its communicator before its
                        // process went has exited, not died.
                        let exited = e.state == "finalizing";
                        RankStatus {
                            rank: *r,
                            pid: p.map_or(e.pid, |p| p.pid),
                            host: p.map_or_else(|| e.host.clone(), |p| p.host.clone()),
                            state: match (alive, stuck, exited) {
                                (false, _, true) => "exited",
                                (false, _, false) => "dead",
                                (true, true, _) => "stuck",
                                (true, false, _) => "alive",
                            }
                            .into(),
                            last_started_seq: e.started_seq,
                            last_started_op: e.started_op.clone(),
                            last_completed_seq: e.completed_seq,
                            last_completed_op: e.completed_op.clone(),
                            last_outcome: e.outcome.clone(),
                        }
                    })
                    .collect();
                let states: Vec<&str> = c.ranks.values().map(|e| e.state.as_str()).collect();
                let state = ["aborted", "failed", "finalizing", "running"]
                    .into_iter()
                    .find(|s| states.contains(s))
                    .unwrap_or("initializing");
                let missing = (0..c.nranks)
                    .filter(|r| !c.ranks.contains_key(r))
                    .take(1024)
                    .collect();
                CommStatus {
                    comm_id: id.clone(),
                    nranks: c.nranks,
                    state: state.into(),
                    ranks,
                    missing,
                }
            })
            .collect();
        let st = Status {
            job: self.job.clone(),
            host: self.host.clone(),
            snapshot_seq: self.seq.fetch_add(1, Ordering::Relaxed) + 1,
            time_unix_nano: now_nanos(),
            processes: procs,
            comms,
            async_errors: reg.async_errors.clone(),
            terminating: self.terminating.load(Ordering::Relaxed),
            dropped_events: reg.dropped_gone
                + reg
                    .procs
                    .values()
                    .map(|p| p.dropped + p.ring_dropped)
                    .sum::<u64>(),
            hosts: reg
                .peers
                .iter()
                .map(|(addr, p)| HostStatus {
                    host: p.host.clone(),
                    addr: addr.clone(),
                    state: if p.lost {
                        "lost"
                    } else if p.last_seen == 0 {
                        "unknown"
                    } else {
                        "up"
                    }
                    .into(),
                    last_seen_unix_nano: p.last_seen,
                    ..Default::default()
                })
                .collect(),
        };
        self.snap.store(Arc::new(st));
    }

    /// A heartbeat from `addr` came back.
    pub fn peer_seen(&self, addr: &str, host: &str) {
        let mut reg = self.lock();
        let p = reg.peers.entry(addr.to_string()).or_default();
        let changed = p.last_seen == 0 || p.lost || p.host != host;
        p.host = host.chars().take(256).collect();
        p.last_seen = now_nanos();
        p.since = Some(std::time::Instant::now());
        p.lost = false;
        if changed {
            self.publish(&reg);
        }
    }

    /// A heartbeat to `addr` failed. Returns the peer's name when it has now
    /// been silent for `timeout` since its last answer, or for `first` since
    /// the first attempt when it never answered (once).
    pub fn peer_silent(
        &self,
        addr: &str,
        timeout: std::time::Duration,
        first: std::time::Duration,
    ) -> Option<String> {
        let mut reg = self.lock();
        let p = reg.peers.entry(addr.to_string()).or_default();
        let since = *p.since.get_or_insert_with(std::time::Instant::now);
        let limit = if p.last_seen == 0 { first } else { timeout };
        if p.lost || since.elapsed() < limit {
            return None;
        }
        p.lost = true;
        let name = if p.host.is_empty() {
            addr.to_string()
        } else {
            format!("{} ({addr})", p.host)
        };
        self.publish(&reg);
        Some(name)
    }

    /// The connections of every live process holding a rank of `comm`
    /// (every process when `comm` is empty), except connection `but`.
    pub fn targets(reg: &Registry, comm: &str, but: u64) -> Vec<u64> {
        let conns: Vec<u64> = if comm.is_empty() {
            reg.procs.keys().copied().collect()
        } else {
            reg.comms
                .get(comm)
                .map(|c| c.ranks.values().map(|e| e.conn).collect())
                .unwrap_or_default()
        };
        let mut seen = HashMap::new();
        conns
            .into_iter()
            .filter(|c| *c != but)
            .filter_map(|c| reg.procs.get(&c).filter(|p| p.alive).map(|p| (c, p)))
            .filter(|(c, _)| seen.insert(*c, ()).is_none())
            .map(|(c, _)| c)
            .collect()
    }
}

/// Merges a peer's snapshot into `into` (the job-wide view): processes and
/// errors are added, each communicator's ranks are joined (first report of
/// a rank wins) and its missing ranks and state recomputed.
pub fn merge(into: &mut Status, other: Status) {
    into.processes.extend(other.processes);
    into.async_errors.extend(other.async_errors);
    into.dropped_events += other.dropped_events;
    for c in other.comms {
        match into.comms.iter_mut().find(|x| x.comm_id == c.comm_id) {
            None => into.comms.push(c),
            Some(x) => {
                for r in c.ranks {
                    if !x.ranks.iter().any(|y| y.rank == r.rank) {
                        x.ranks.push(r);
                    }
                }
                x.ranks.sort_by_key(|r| r.rank);
                x.missing = (0..x.nranks)
                    .filter(|r| !x.ranks.iter().any(|y| y.rank == *r))
                    .take(1024)
                    .collect();
                for st in ["aborted", "failed", "finalizing"] {
                    if c.state == st || x.state == st {
                        x.state = st.into();
                        break;
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// A peer that never answered gets the startup grace; once it has
    /// answered, the ordinary timeout applies; lost is reported once.
    #[test]
    fn peer_silence_limits() {
        let s = State::new("job".into(), "me".into());
        let (short, long) = (Duration::from_millis(30), Duration::from_secs(3600));
        assert_eq!(s.peer_silent("a:1", short, long), None);
        std::thread::sleep(Duration::from_millis(60));
        assert_eq!(
            s.peer_silent("a:1", short, long),
            None,
            "still in its startup grace"
        );
        assert_eq!(s.peer_silent("b:1", short, short), None);
        std::thread::sleep(Duration::from_millis(60));
        assert_eq!(s.peer_silent("b:1", short, short).as_deref(), Some("b:1"));
        assert_eq!(s.peer_silent("b:1", short, short), None, "reported once");
        s.peer_seen("a:1", "host-a");
        std::thread::sleep(Duration::from_millis(60));
        assert_eq!(
            s.peer_silent("a:1", short, long).as_deref(),
            Some("host-a (a:1)"),
            "answered once: the ordinary timeout"
        );
    }
}
