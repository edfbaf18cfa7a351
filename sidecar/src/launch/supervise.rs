//! The supervision loop: watch the ranks, react to the first failure, to
//! signals sent to the launcher and to deadlines, until every rank is reaped.
//!
//! It polls every [`TICK`] rather than blocking in `waitpid(-1)`: a library
//! caller may have other children we must not reap, and polling lets one
//! loop handle exits, signals and deadlines without a SIGCHLD handler.

use std::process::ExitStatus;
use std::time::{Duration, Instant};

use super::signals::{self, SignalGuard};
use super::{StopReason, diag, process};

/// How often the supervisor checks ranks, signals and deadlines. Bounds how
/// late a failure is noticed; costs one `waitid` per live rank per tick.
const TICK: Duration = Duration::from_millis(10);

/// `1 rank`, `3 ranks`.
pub(crate) fn ranks(n: usize) -> String {
    if n == 1 {
        "1 rank".into()
    } else {
        format!("{n} ranks")
    }
}

/// The state of one launch's ranks.
pub(crate) struct Supervisor<'a> {
    label: &'a str,
    grace: Duration,
    timeout: Option<Duration>,
    start: Instant,
    /// Rank pid (= process group id) and, once reaped, its status.
    pids: Vec<libc::pid_t>,
    statuses: Vec<Option<ExitStatus>>,
    pub stop: Option<StopReason>,
    /// When the ranks still running get SIGKILL (set when stopping starts).
    kill_at: Option<Instant>,
    killed: bool,
    interrupts: usize,
}

impl<'a> Supervisor<'a> {
    pub fn new(
        label: &'a str,
        grace: Duration,
        timeout: Option<Duration>,
        start: Instant,
        pids: Vec<libc::pid_t>,
    ) -> Self {
        let statuses = vec![None; pids.len()];
        Supervisor {
            label,
            grace,
            timeout,
            start,
            pids,
            statuses,
            stop: None,
            kill_at: None,
            killed: false,
            interrupts: 0,
        }
    }

    /// Runs until every rank has been reaped; returns their statuses by rank.
    pub fn run(mut self, signals: Option<&SignalGuard>) -> (Vec<ExitStatus>, Option<StopReason>) {
        loop {
            if let Some(g) = signals {
                for (sig, n) in g.take() {
                    self.on_signal(sig, n);
                }
            }
            self.reap_exited();
            if self.running() == 0 {
                break;
            }
            self.check_deadlines();
            std::thread::sleep(TICK);
        }
        let statuses = self
            .statuses
            .into_iter()
            .map(|s| s.expect("reaped"))
            .collect();
        (statuses, self.stop)
    }

    fn running(&self) -> usize {
        self.statuses.iter().filter(|s| s.is_none()).count()
    }

    /// Sends `sig` to every live rank's process group.
    fn signal_all(&self, sig: libc::c_int) {
        for (pid, st) in self.pids.iter().zip(&self.statuses) {
            if st.is_none() {
                process::signal_group(*pid, sig);
            }
        }
    }

    /// Starts stopping the job (once): `sig` now, SIGKILL after the grace.
    fn begin_stop(&mut self, reason: StopReason, sig: libc::c_int) {
        self.stop.get_or_insert(reason);
        self.signal_all(sig);
        self.kill_at.get_or_insert(Instant::now() + self.grace);
    }

    /// A signal to the launcher: forward it; a second SIGINT kills at once.
    fn on_signal(&mut self, sig: libc::c_int, n: usize) {
        let name = signals::signal_name(sig);
        let live = ranks(self.running());
        if sig == libc::SIGINT {
            self.interrupts += n;
            if self.interrupts >= 2 {
                diag(self.label, &format!("{name} again; killing {live}"));
                self.begin_stop(StopReason::Signal(sig), libc::SIGKILL);
                self.killed = true;
                return;
            }
        }
        let hint = if sig == libc::SIGINT {
            " (interrupt again to kill them)"
        } else {
            ""
        };
        diag(
            self.label,
            &format!("received {name}; forwarding it to {live}{hint}"),
        );
        self.begin_stop(StopReason::Signal(sig), sig);
    }

    /// Reaps ranks that ended. Their process group is SIGKILLed first, while
    /// the unreaped zombie still reserves the pgid, so a rank's leftover
    /// children die with it and no unrelated process can be hit.
    ///
    /// Blame: when one rank dies, its peers notice within milliseconds and
    /// exit with an error of their own, often within the same tick. Among
    /// the failures reaped together, a rank killed by a signal is the cause
    /// (its peers exit with a code after noticing it), then the lowest rank.
    fn reap_exited(&mut self) {
        let mut failed: Vec<(usize, ExitStatus)> = Vec::new();
        for rank in 0..self.pids.len() {
            let pid = self.pids[rank];
            if self.statuses[rank].is_some() || !process::has_exited(pid) {
                continue;
            }
            process::signal_group(pid, libc::SIGKILL);
            let status = process::reap(pid);
            self.statuses[rank] = Some(status);
            if !status.success() && self.stop.is_none() {
                failed.push((rank, status));
            }
        }
        let Some(&(rank, status)) = blame(&failed) else {
            return;
        };
        let pid = self.pids[rank];
        let others = self.running();
        let tail = match others {
            0 => String::new(),
            n => format!("; stopping the other {}", ranks(n)),
        };
        let what = process::describe(&status);
        let others_failed: Vec<String> = failed
            .iter()
            .filter(|f| f.0 != rank)
            .map(|f| f.0.to_string())
            .collect();
        let also = match others_failed.len() {
            0 => String::new(),
            1 => format!(" (rank {} ended in the same tick)", others_failed[0]),
            _ => format!(
                " (ranks {} ended in the same tick)",
                others_failed.join(", ")
            ),
        };
        diag(
            self.label,
            &format!("rank {rank} (pid {pid}) {what}{also}{tail}"),
        );
        let reason = StopReason::RankFailed {
            rank,
            pid: pid as u32,
            status,
        };
        self.begin_stop(reason, libc::SIGTERM);
    }

    /// The job timeout, then the end of the grace period.
    fn check_deadlines(&mut self) {
        if let Some(t) = self.timeout
            && self.stop.is_none()
            && self.start.elapsed() >= t
        {
            let live = ranks(self.running());
            diag(
                self.label,
                &format!("timed out after {t:?}; stopping {live}"),
            );
            self.begin_stop(StopReason::Timeout(t), libc::SIGTERM);
        }
        if !self.killed && self.kill_at.is_some_and(|k| Instant::now() >= k) {
            let live = ranks(self.running());
            let grace = self.grace;
            diag(
                self.label,
                &format!("{live} still running {grace:?} after SIGTERM; sending SIGKILL"),
            );
            self.signal_all(libc::SIGKILL);
            self.killed = true;
        }
    }
}

/// The rank to blame among failures reaped in one tick: killed by a signal
/// first, then the lowest rank.
fn blame(failed: &[(usize, ExitStatus)]) -> Option<&(usize, ExitStatus)> {
    use std::os::unix::process::ExitStatusExt;
    failed
        .iter()
        .min_by_key(|(rank, st)| (st.signal().is_none(), *rank))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::ExitStatusExt;

    #[test]
    fn a_rank_killed_by_a_signal_is_blamed_over_peers_that_exited_after_it() {
        // rank 3 SIGKILLed; ranks 0 and 1 exited with code 5 after noticing.
        let failed = [
            (0, ExitStatus::from_raw(5 << 8)),
            (1, ExitStatus::from_raw(5 << 8)),
            (3, ExitStatus::from_raw(libc::SIGKILL)),
        ];
        assert_eq!(blame(&failed).unwrap().0, 3);
        let codes = [
            (2, ExitStatus::from_raw(1 << 8)),
            (4, ExitStatus::from_raw(5 << 8)),
        ];
        assert_eq!(blame(&codes).unwrap().0, 2, "else the lowest rank");
        assert!(blame(&[]).is_none());
    }
}
