//! What the end of a rank's control stream means. A stream ends for many
//! reasons (an HTTP/2 error, a reset, a clean exit, a crash); a rank is
//! dead only when its process is gone with communicators it had not
//! destroyed. So before anything is aborted or relayed:
//!
//! 1. the process's ring is drained (its last spans come first);
//! 2. every communicator it registered destroyed (a `Deregister`, or its
//!    slot in the telemetry segment, written before `destroy` returned):
//!    a clean exit, whatever the stream did;
//! 3. otherwise the process is looked at (`liveness`): ended (a pidfd or
//!    its lifeline says so, within a moment for one still exiting): dead,
//!    its communicators' other local processes are failed and, under
//!    ReplaceRank, its death goes on the recovery board;
//! 4. alive: the stream just broke. It is logged and counted, the process
//!    shows as `disconnected`, its communicators stay, commands for it are
//!    kept, and it attaches again (the agent reconnects, passing the same
//!    segment); if it ends before that, step 3 applies then.
//!
//! With no way to see the process (no pid, no lifeline: an older agent or
//! a tool) the stream's end is its end, as it always was.

use super::Engine;
use super::liveness::Liveness;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long a process whose stream ended may take to finish exiting
/// before it counts as alive (its descriptors close before it is reaped).
const EXIT_GRACE: Duration = Duration::from_millis(200);

impl Engine {
    /// Connection `conn`'s control stream ended with `why`.
    pub async fn stream_ended(self: &Arc<Self>, conn: u64, why: &str) {
        let Some(live) = self.liveness(conn) else {
            return; // it attached again on another connection already
        };
        self.drain_conn(conn, false);
        if self.exited_cleanly(conn) || !live.known() || live.ended() {
            return self.on_gone(conn, why);
        }
        if tokio::time::timeout(EXIT_GRACE, live.wait_ended())
            .await
            .is_ok()
        {
            return self.on_gone(conn, why);
        }
        let (notify, pid, host) = {
            let mut reg = self.state.lock();
            let Some(p) = reg.procs.get_mut(&conn) else {
                return;
            };
            p.disconnected = true;
            let x = (p.reattached.clone(), p.pid, p.host.clone());
            self.state.publish(&reg);
            x
        };
        let reattached = notify.notified();
        tokio::pin!(reattached);
        reattached.as_mut().enable();
        if !self.state.lock().procs.contains_key(&conn) {
            return; // attached again before we listened
        }
        self.metrics.stream_breaks.inc();
        super::log(&format!(
            "the control stream of pid {pid} on host {host} ended ({why}), but the process lives \
             (watched through {}): keeping its communicators until it attaches again or exits",
            live.describe()
        ));
        let since = Instant::now();
        tokio::select! {
            _ = reattached => {}
            _ = live.wait_ended() => self.on_gone(
                conn,
                &format!("{why}; it exited {:.1} s later", since.elapsed().as_secs_f64()),
            ),
        }
    }

    fn liveness(&self, conn: u64) -> Option<Arc<Liveness>> {
        self.state
            .lock()
            .procs
            .get(&conn)
            .map(|p| p.liveness.clone())
    }

    /// A clean end: the process had communicators (registered, or per its
    /// segment) and every one is destroyed (a `Deregister` was read, or
    /// its slot says so), registered or not.
    fn exited_cleanly(&self, conn: u64) -> bool {
        let Some(end) = self.ending(conn) else {
            return false;
        };
        end.opened && end.lost().is_empty()
    }

    /// What `conn`'s process leaves behind, per the registry and its segment.
    fn ending(&self, conn: u64) -> Option<Ending> {
        let (ring, open, registered) = {
            let reg = self.state.lock();
            let p = reg.procs.get(&conn)?;
            (p.ring.clone(), open_ranks(&reg, conn), p.registered)
        };
        let destroyed = |l: &str, r: u32| {
            ring.as_ref()
                .and_then(|x| x.destroyed(l, r))
                .unwrap_or(false)
        };
        let (destroyed, open): (Vec<_>, Vec<_>) =
            open.into_iter().partition(|(l, r)| destroyed(l, *r));
        // Live per the segment though never registered (its Register unread).
        let unregistered = ring
            .as_ref()
            .map(|x| x.live_slots())
            .unwrap_or_default()
            .into_iter()
            .filter(|s| !open.contains(s) && !destroyed.contains(s))
            .collect();
        Some(Ending {
            opened: registered > 0 || ring.as_ref().is_some_and(|x| x.opened_any()),
            destroyed,
            open,
            unregistered,
        })
    }

    /// The process behind `conn` is gone: mark it dead, fail its
    /// communicators' peers (a clean exit has none left).
    pub(crate) fn on_gone(&self, conn: u64, why: &str) {
        self.drain_conn(conn, true);
        let Some(end) = self.ending(conn) else {
            return;
        };
        let mut reg = self.state.lock();
        for (l, r) in &end.destroyed {
            if let Some(e) = reg.comms.get_mut(l).and_then(|c| c.ranks.get_mut(r)) {
                e.state = "finalizing".into();
            }
        }
        let Some(p) = reg.procs.get_mut(&conn) else {
            return;
        };
        p.alive = false;
        p.disconnected = false;
        p.ring = None; // read for the last time above
        let (pid, host) = (p.pid, p.host.clone());
        let lost = end.lost();
        if lost.is_empty() {
            // A clean exit: every communicator was destroyed first.
            if let Some(p) = reg.procs.remove(&conn) {
                reg.dropped_gone += p.dropped + p.ring_dropped;
            }
        }
        for (id, r) in &lost {
            reg.push_error(format!(
                "comm {id} rank {r} (pid {pid} on host {host}) died: {why}"
            ));
        }
        self.state.publish(&reg);
        self.metrics
            .peers_up
            .set(reg.procs.values().filter(|p| p.alive).count() as i64);
        drop(reg);
        // Gone unclean: with communicators left, or before it had any (a
        // replacement dying while it joins).
        if (!lost.is_empty() || !end.opened)
            && let Some(b) = self.board.get()
            && b.own_death()
        {
            super::log(&format!(
                "recovery board: pid {pid} died ({why}): this pod's ranks {:?} are named dead",
                b.me.deaths()
            ));
        }
        for (id, r) in lost {
            let reason = format!("rank {r} (pid {pid} on host {host}) of comm {id} died ({why})");
            let n = self.fail_comm(&id, &reason, conn);
            super::log(&format!(
                "{reason}: aborting comm {id} in {n} local process(es)"
            ));
        }
    }
}

/// What a process leaves behind when it ends.
struct Ending {
    /// It had communicators (registered, or per its segment).
    opened: bool,
    /// Registered, not deregistered, but destroyed per the segment.
    destroyed: Vec<(String, u32)>,
    /// Registered and not destroyed.
    open: Vec<(String, u32)>,
    /// Live per the segment, never registered.
    unregistered: Vec<(String, u32)>,
}

impl Ending {
    /// The communicator ranks it takes with it.
    fn lost(&self) -> Vec<(String, u32)> {
        self.open
            .iter()
            .chain(&self.unregistered)
            .cloned()
            .collect()
    }
}

/// `conn`'s communicator ranks not (yet) known destroyed.
fn open_ranks(reg: &super::state::Registry, conn: u64) -> Vec<(String, u32)> {
    reg.comms
        .iter()
        .flat_map(|(id, c)| {
            c.ranks
                .iter()
                .filter(|(_, e)| e.conn == conn && e.state != "finalizing")
                .map(move |(r, _)| (id.clone(), *r))
        })
        .collect()
}
