//! The supervision loop: watch the ranks, react to the first failure, to
//! signals sent to the launcher and to deadlines, until every rank is reaped.
//!
//! It polls every [`TICK`] rather than blocking in `waitpid(-1)`: a library
//! caller may have other children we must not reap, and polling lets one
//! loop handle exits, signals and deadlines without a SIGCHLD handler.

use std::process::ExitStatus;
use std::time::{Duration, Instant};

use weft_contract::board::{self, Death};

use super::output::diag;
use super::process;
use super::signals::{self, SignalGuard};

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

/// Why the launcher stopped the job early.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StopReason {
    /// The first rank to fail (non-zero exit or killed by a signal).
    RankFailed {
        rank: usize,
        pid: u32,
        status: ExitStatus,
    },
    /// The launcher received this signal and forwarded it.
    Signal(i32),
    /// The launch's timeout (`LaunchSpec::timeout`) ran out.
    Timeout(Duration),
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
    /// `--replace-failed`: restarts a failed rank instead of stopping the job.
    pub replacer: Option<Replacer<'a>>,
}

/// A replaced rank: which, its pid, how it ended, when.
#[derive(Debug, Clone)]
pub struct Replaced {
    pub rank: usize,
    pub pid: u32,
    pub status: ExitStatus,
    pub incarnation: u32,
    /// Time since the launch started.
    pub at: Duration,
}

/// Restarts failed ranks with the same rank (`weft run --replace-failed`)
/// and keeps the recovery board (docs/FAULT-TOLERANCE.md).
pub(crate) struct Replacer<'a> {
    /// Replacements left.
    pub budget: usize,
    pub board: std::path::PathBuf,
    /// Starts rank `r`, incarnation `i`: its pid (its pipes go to the pump).
    pub spawn: Box<dyn FnMut(usize, u32) -> std::io::Result<libc::pid_t> + 'a>,
    pub incarnations: Vec<u32>,
    /// Every death, as written to `dead`.
    pub deaths: Vec<Death>,
    pub replaced: Vec<Replaced>,
}

impl Replacer<'_> {
    /// Records a death and rewrites `dead`. A failed write is not fatal:
    /// the ranks then wait on the death until their timeout.
    fn record_death(&mut self, rank: usize, incarnation: u32, replaced: bool) {
        self.deaths.push(Death {
            rank,
            incarnation,
            replaced,
        });
        let body = board::dead_file(self.deaths.iter().copied());
        let _ = board::write_atomic(&self.board, board::DEAD, &body);
    }

    /// Ranks' reports of failures they could not explain (a frozen peer).
    fn take_reports(&self) -> bool {
        let Ok(rd) = std::fs::read_dir(&self.board) else {
            return false;
        };
        let mut any = false;
        for e in rd.flatten() {
            let name = e.file_name();
            let report = board::RankFile::parse(&name.to_string_lossy())
                .is_some_and(|f| f.kind == board::Kind::Report);
            if report {
                let _ = std::fs::remove_file(e.path());
                any = true;
            }
        }
        any
    }
}

/// Whether process `pid` is stopped (SIGSTOP, or traced).
fn stopped(pid: libc::pid_t) -> bool {
    let Ok(s) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    // "pid (comm) S ...": the state follows the last ')'.
    s.rfind(')')
        .and_then(|i| s[i + 1..].trim_start().chars().next())
        .is_some_and(|c| c == 'T' || c == 't')
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
            replacer: None,
        }
    }

    /// Runs until every rank has been reaped; returns their statuses by rank
    /// (of each rank's last process), the stop reason, the replacements.
    pub fn run(
        mut self,
        signals: Option<&SignalGuard>,
    ) -> (
        Vec<ExitStatus>,
        Option<StopReason>,
        Vec<Replaced>,
        Vec<libc::pid_t>,
    ) {
        loop {
            if let Some(g) = signals {
                for (sig, n) in g.take() {
                    self.on_signal(sig, n);
                }
            }
            self.reap_exited();
            self.check_reports();
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
        let replaced = self.replacer.map(|r| r.replaced).unwrap_or_default();
        (statuses, self.stop, replaced, self.pids)
    }

    /// A rank reported a failure it could not explain: a rank of ours that
    /// is stopped (SIGSTOP) is frozen; kill it, so it is replaced.
    fn check_reports(&mut self) {
        if self.stop.is_some() {
            return;
        }
        let Some(rep) = &self.replacer else { return };
        if !rep.take_reports() {
            return;
        }
        for rank in 0..self.pids.len() {
            let pid = self.pids[rank];
            if self.statuses[rank].is_none() && stopped(pid) {
                diag(
                    self.label,
                    &format!(
                        "rank {rank} (pid {pid}) is stopped and its peers timed out on it; killing it"
                    ),
                );
                process::signal_group(pid, libc::SIGKILL);
            }
        }
    }

    /// `--replace-failed`: records the death and starts the rank again, if
    /// replacements are left. False when the job must stop instead.
    fn replace(&mut self, rank: usize, status: ExitStatus) -> bool {
        let Some(rep) = self.replacer.as_mut() else {
            return false;
        };
        if self.stop.is_some() {
            return false;
        }
        let inc = rep.incarnations[rank];
        let pid = self.pids[rank];
        let what = process::describe(&status);
        if rep.budget == 0 {
            rep.record_death(rank, inc, false);
            diag(
                self.label,
                &format!("rank {rank} (pid {pid}) {what}; no replacements left (--replace-failed)"),
            );
            return false;
        }
        rep.record_death(rank, inc, true);
        rep.budget -= 1;
        rep.replaced.push(Replaced {
            rank,
            pid: pid as u32,
            status,
            incarnation: inc,
            at: self.start.elapsed(),
        });
        match (rep.spawn)(rank, inc + 1) {
            Ok(new) => {
                rep.incarnations[rank] = inc + 1;
                diag(
                    self.label,
                    &format!(
                        "rank {rank} (pid {pid}) {what}; replaced by pid {new} ({} replacement(s) left)",
                        rep.budget
                    ),
                );
                self.pids[rank] = new;
                self.statuses[rank] = None;
                true
            }
            Err(e) => {
                diag(
                    self.label,
                    &format!("rank {rank}: cannot start a replacement: {e}"),
                );
                false
            }
        }
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
            if !status.success() && self.stop.is_none() && !self.replace(rank, status) {
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
