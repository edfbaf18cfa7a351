//! [`Resilient`]: a training loop's communicator that survives lost ranks.
//!
//! "Run this step; on a peer failure, shrink, wait for replacements, grow,
//! resume": [`Resilient::step`] runs one step of the program's loop. When a
//! peer fails during it, the survivors roll the state back to before the
//! step, agree on who is gone, [`shrink`](Communicator::shrink) around them
//! and redo the step with fewer processes, each computing the shards
//! ([`Step::shards`]) of the missing ranks as well, so nothing is skipped
//! or done twice. At the next step boundary where every survivor sees a
//! replacement ready, they [`grow`](Communicator::grow) back, restore the
//! original rank order, and hand the replacement the state and the step
//! number over the communicator (no shared filesystem).
//!
//! Who is gone and who is ready comes from the launcher: `weft run
//! --replace-failed` (and the operator's in-place recovery) give each rank a
//! private directory, the recovery board (`WEFT_RECOVERY_DIR`), where the
//! launcher records deaths (`dead`) and the ranks record readiness
//! (`ready-R-I`), grow ids (`grow-R-I`) and failures they could not explain
//! (`report-R-I`, for a frozen rank that only a timeout reveals). The
//! protocol is in docs/FAULT-TOLERANCE.md.

use crate::bootstrap::unique_id::{UniqueId, hex};
use crate::comm::communicator::Communicator;
use crate::config::Config;
use crate::data::types::ReduceOp;
use crate::error::{Error, ErrorKind, Result};
use crate::resilience::recovery::ShrinkMode;
use crate::state::CommState;
use sha2::{Digest, Sha256};
use std::path::PathBuf;
use std::time::{Duration, Instant, SystemTime};
use weft_contract::board::{self, RankFile};
use weft_contract::params;

/// The state a program keeps across steps: saved before each step (rolled
/// back on a failure) and handed to replacements.
pub trait State {
    fn save(&self) -> Vec<u8>;
    fn load(&mut self, bytes: &[u8]) -> Result<()>;
}

/// What a step may use: the communicator (ranks ordered by logical rank)
/// and the logical ranks whose share of the work this process computes.
pub struct Step<'a> {
    pub comm: &'a Communicator,
    /// The index of this step (0 for the first).
    pub index: u64,
    /// This process's logical rank first, then those of absent ranks it
    /// stands in for.
    pub shards: Vec<usize>,
    /// The job's full size (logical ranks `0..world`).
    pub world: usize,
}

/// One recovery, as the program may report it.
#[derive(Debug, Clone)]
pub enum RecoveryEvent {
    /// The survivors formed a smaller communicator: `lost` logical ranks,
    /// `size` processes left; `at` is when it was ready.
    Shrunk {
        lost: Vec<usize>,
        size: usize,
        at: SystemTime,
        redo_from: u64,
    },
    /// Replacements joined: back to `size` processes.
    Grown {
        joined: Vec<usize>,
        size: usize,
        at: SystemTime,
    },
    /// A grow was given up because a joining replacement died.
    GrowFailed { rank: usize, at: SystemTime },
}

/// The launcher's recovery board (see the module docs).
#[derive(Debug, Clone)]
struct Board {
    dir: PathBuf,
}

/// A death the launcher recorded: (logical rank, incarnation, replaced).
type Death = (usize, u32, bool);

impl Board {
    fn from_env() -> Option<Board> {
        params::WEFT_RECOVERY_DIR
            .raw()
            .map(|d| Board { dir: d.into() })
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    fn write(&self, name: &str, body: &str) -> Result<()> {
        board::write_atomic(&self.dir, name, body)
            .map_err(|e| Error::sys(format!("writing {}", self.path(name).display()), e))
    }

    fn deaths(&self) -> Vec<Death> {
        board::read_dead(&self.dir)
            .into_iter()
            .map(|d| (d.rank, d.incarnation, d.replaced))
            .collect()
    }

    fn is_dead(deaths: &[Death], rank: usize, inc: u32) -> bool {
        deaths.iter().any(|d| d.0 == rank && d.1 == inc)
    }

    /// The newest incarnation of `rank` that said it is ready, if it is alive.
    fn ready(&self, rank: usize, deaths: &[Death]) -> Option<u32> {
        let rd = std::fs::read_dir(&self.dir).ok()?;
        rd.filter_map(|e| {
            let f = RankFile::parse(e.ok()?.file_name().to_str()?)?;
            (f.kind == board::Kind::Ready && f.rank == rank).then_some(f.incarnation)
        })
        .filter(|&i| !Self::is_dead(deaths, rank, i))
        .max()
    }
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

/// Gives up a communicator still initializing: aborted and dropped on a
/// thread of its own, because its build may wait for a dead peer until the
/// init deadline (the build is not cancellable), while the recovery must go on.
fn abandon(c: Communicator) {
    let spawned = std::thread::Builder::new()
        .name("weft-abandon".into())
        .spawn(move || {
            let _ = c.abort();
        });
    if let Err(e) = spawned {
        crate::log::warn_log!("resilient: could not start a thread to abandon a communicator: {e}");
    }
}

/// Whether an error means "a peer is gone" (recoverable by shrinking).
pub fn is_peer_failure(e: &Error) -> bool {
    e.kind() == ErrorKind::RemoteError
}

/// A communicator that survives lost ranks (see the module docs).
pub struct Resilient {
    comm: Communicator,
    world: usize,
    logical: usize,
    inc: u32,
    /// Logical rank and incarnation of each rank of `comm`.
    members: Vec<(usize, u32)>,
    board: Option<Board>,
    cfg: Config,
    done: u64,
    /// The state before the last completed step, to roll back to.
    prev: Option<Vec<u8>>,
    /// State received as a replacement, for [`restore`](Self::restore).
    received: Option<Vec<u8>>,
    events: Vec<RecoveryEvent>,
    /// Grows completed by the job (every member agrees): part of a shrunk
    /// communicator's id.
    grows: u64,
    /// How long a recovery may wait for the launcher and the other ranks.
    pub recovery_timeout: Duration,
}

impl std::fmt::Debug for Resilient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Resilient")
            .field("logical", &self.logical)
            .field("world", &self.world)
            .field("members", &self.members)
            .field("done", &self.done)
            .finish()
    }
}

const POLL: Duration = Duration::from_millis(5);

impl Resilient {
    /// From the launcher's environment: the first incarnation of a rank
    /// initializes with the job (`Communicator::from_env`); a replacement
    /// (`WEFT_INCARNATION` >= 1) says it is ready on the board and joins the
    /// running job by grow, receiving the state (then call
    /// [`restore`](Self::restore)).
    pub fn from_env() -> Result<Resilient> {
        let rank = params::WEFT_RANK
            .get()
            .or_else(|| params::RANK.get())
            .ok_or_else(|| Error::arg("WEFT_RANK is not set: start ranks with `weft run`"))?;
        let world = params::WEFT_WORLD_SIZE
            .get()
            .or_else(|| params::WORLD_SIZE.get())
            .ok_or_else(|| Error::arg("WEFT_WORLD_SIZE is not set: start ranks with `weft run`"))?;
        let inc = params::WEFT_INCARNATION.get().unwrap_or(0);
        let board = Board::from_env();
        let cfg = Config::from_env()?;
        let timeout = cfg.init_timeout;
        if inc == 0 {
            let comm = Communicator::from_env()?;
            let mut r = Resilient::new_inner(comm, world, rank, inc, board, cfg);
            r.recovery_timeout = timeout;
            r.refresh_members()?;
            return Ok(r);
        }
        let Some(board) = board else {
            return Err(Error::arg(
                "WEFT_INCARNATION is set but WEFT_RECOVERY_DIR is not: a replacement needs the launcher's recovery board (`weft run --replace-failed`)",
            ));
        };
        Self::join_as_replacement(board, world, rank, inc, cfg, timeout)
    }

    /// Wraps a communicator whose rank `r` is logical rank `r` of `world`
    /// (no board: failures are recovered by shrinking only when the caller
    /// says who is gone; see [`recover_without`](Self::recover_without)).
    pub fn new(
        comm: Communicator,
        world: usize,
        logical: usize,
        inc: u32,
        board: Option<PathBuf>,
        cfg: Config,
    ) -> Resilient {
        Resilient::new_inner(
            comm,
            world,
            logical,
            inc,
            board.map(|dir| Board { dir }),
            cfg,
        )
    }

    fn new_inner(
        comm: Communicator,
        world: usize,
        logical: usize,
        inc: u32,
        board: Option<Board>,
        cfg: Config,
    ) -> Resilient {
        let members = (0..comm.count()).map(|r| (r, 0)).collect();
        Resilient {
            comm,
            world,
            logical,
            inc,
            members,
            board,
            cfg: cfg.clone(),
            done: 0,
            prev: None,
            received: None,
            events: Vec::new(),
            grows: 0,
            recovery_timeout: cfg.init_timeout,
        }
    }

    /// The communicator of the moment (it changes at every recovery).
    pub fn comm(&self) -> &Communicator {
        &self.comm
    }

    pub fn logical_rank(&self) -> usize {
        self.logical
    }

    pub fn world(&self) -> usize {
        self.world
    }

    /// Processes in the communicator now (`world` when nothing is lost).
    pub fn size(&self) -> usize {
        self.members.len()
    }

    /// Steps completed (by the job: a replacement starts at the survivors' count).
    pub fn steps_done(&self) -> u64 {
        self.done
    }

    /// The recoveries so far (drained).
    pub fn take_events(&mut self) -> Vec<RecoveryEvent> {
        std::mem::take(&mut self.events)
    }

    /// A replacement loads the state it received when it joined; `false`
    /// for a first incarnation (nothing to load).
    pub fn restore(&mut self, state: &mut impl State) -> Result<bool> {
        match self.received.take() {
            Some(b) => state.load(&b).map(|_| true),
            None => Ok(false),
        }
    }

    /// The shards this process computes: its own, then those of absent
    /// logical ranks dealt round-robin over the members in rank order.
    fn shards(&self) -> Vec<usize> {
        let present: Vec<usize> = self.members.iter().map(|m| m.0).collect();
        let absent: Vec<usize> = (0..self.world).filter(|r| !present.contains(r)).collect();
        let me = self.comm.rank();
        let mut s = vec![self.logical];
        s.extend(
            absent
                .iter()
                .enumerate()
                .filter(|(i, _)| i % present.len() == me)
                .map(|(_, &r)| r),
        );
        s
    }

    /// Runs one step: `f` computes and communicates on `Step::comm`. On a
    /// peer failure the state is rolled back, the communicator rebuilt
    /// without the lost ranks, and the step run again; replacements that
    /// are ready join at the start of a step.
    pub fn step<S: State>(
        &mut self,
        state: &mut S,
        mut f: impl FnMut(&Step<'_>, &mut S) -> Result<()>,
    ) -> Result<()> {
        loop {
            let snapshot = state.save();
            let r = self.maybe_grow(state).and_then(|_| {
                let step = Step {
                    comm: &self.comm,
                    index: self.done,
                    shards: self.shards(),
                    world: self.world,
                };
                f(&step, state)
            });
            match r {
                Ok(()) => {
                    self.done += 1;
                    self.prev = Some(snapshot);
                    return Ok(());
                }
                Err(e) if is_peer_failure(&e) => {
                    crate::log::info_log!(
                        "resilient: logical rank {} step {}: {e}; recovering",
                        self.logical,
                        self.done
                    );
                    state.load(&snapshot)?;
                    self.recover(state, &e)?;
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// At the end of the loop: waits (bounded) until every lost rank that
    /// the launcher replaces has joined, so a replacement is never left
    /// waiting for a job that ended.
    pub fn finish<S: State>(&mut self, state: &mut S) -> Result<()> {
        let until = Instant::now() + self.recovery_timeout;
        loop {
            let snapshot = state.save();
            match self.maybe_grow(state) {
                Ok(()) => {}
                Err(e) if is_peer_failure(&e) => {
                    state.load(&snapshot)?;
                    self.recover(state, &e)?;
                    continue;
                }
                Err(e) => return Err(e),
            }
            let expected = self.pending_replacements();
            // Every member must agree that nothing is pending.
            let mut v = [expected as i32];
            match self.comm.all_reduce_in_place(&mut v, ReduceOp::Max) {
                Ok(()) => {}
                Err(e) if is_peer_failure(&e) => {
                    self.recover(state, &e)?;
                    continue;
                }
                Err(e) => return Err(e),
            }
            if v[0] == 0 {
                return Ok(());
            }
            if Instant::now() >= until {
                return Err(Error::Timeout {
                    comm: self.comm.id().to_string(),
                    rank: self.comm.rank(),
                    after_ms: self.recovery_timeout.as_millis() as u64,
                    waiting_for: "replacements to join before the end".into(),
                });
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Whether some absent logical rank will be replaced by the launcher.
    fn pending_replacements(&self) -> bool {
        let Some(b) = &self.board else { return false };
        let deaths = b.deaths();
        (0..self.world)
            .filter(|r| !self.members.iter().any(|m| m.0 == *r))
            .any(|r| {
                // The newest death of r says whether the launcher replaces it.
                deaths
                    .iter()
                    .filter(|d| d.0 == r)
                    .max_by_key(|d| d.1)
                    .is_some_and(|d| d.2)
            })
    }

    /// Learns the logical rank and incarnation of every member.
    fn refresh_members(&mut self) -> Result<()> {
        let n = self.comm.count();
        let mine = [self.logical as u32, self.inc];
        let mut all = vec![0u32; 2 * n];
        self.comm.all_gather(&mine, &mut all)?;
        self.members = (0..n)
            .map(|r| (all[2 * r] as usize, all[2 * r + 1]))
            .collect();
        Ok(())
    }

    /// Says on the board that this rank saw a failure it cannot explain
    /// (a peer may be frozen): the launcher looks at its ranks.
    fn report(&self, e: &Error) {
        if let Some(b) = &self.board {
            let _ = b.write(
                &RankFile::report(self.logical, self.inc).name(),
                &e.to_string(),
            );
        }
    }

    /// After a peer failure: agree on who is gone, shrink around them, roll
    /// back to the step every survivor completed.
    fn recover(&mut self, state: &mut impl State, cause: &Error) -> Result<()> {
        let Some(board) = self.board.clone() else {
            return Err(Error::InvalidUsage(format!(
                "a peer failed ({cause}) and no recovery board says who: run under `weft run --replace-failed`, or call recover_without"
            )));
        };
        let until = Instant::now() + self.recovery_timeout;
        let mut reported = false;
        let mut tried: Option<Vec<(usize, u32)>> = None;
        loop {
            if Instant::now() >= until {
                return Err(Error::Timeout {
                    comm: self.comm.id().to_string(),
                    rank: self.comm.rank(),
                    after_ms: self.recovery_timeout.as_millis() as u64,
                    waiting_for: format!("the launcher to name the lost rank(s) after: {cause}"),
                });
            }
            let deaths = board.deaths();
            let gone: Vec<usize> = (0..self.members.len())
                .filter(|&r| Board::is_dead(&deaths, self.members[r].0, self.members[r].1))
                .collect();
            // Who would be left: compared across attempts (their parents
            // may differ: a shrink can succeed, then fail its first message).
            let left: Vec<(usize, u32)> = (0..self.members.len())
                .filter(|i| !gone.contains(i))
                .map(|i| self.members[i])
                .collect();
            if gone.is_empty() || tried.as_ref() == Some(&left) {
                if !reported {
                    self.report(cause);
                    reported = true;
                }
                std::thread::sleep(POLL);
                continue;
            }
            match self.try_shrink(&board, &gone, until) {
                Ok(()) => {}
                Err(e) if is_peer_failure(&e) => {
                    crate::log::info_log!(
                        "resilient: logical rank {}: shrink without {gone:?} failed ({e}); again",
                        self.logical
                    );
                    tried = Some(left);
                    continue;
                }
                Err(e) => return Err(e),
            }
            // Roll back to the step every survivor completed.
            let mut v = [self.done as i64, -(self.done as i64)];
            let agreed = self
                .comm
                .all_reduce_in_place(&mut v[..1], ReduceOp::Min)
                .and_then(|_| self.comm.all_reduce_in_place(&mut v[1..], ReduceOp::Min));
            if let Err(e) = agreed {
                if is_peer_failure(&e) {
                    continue;
                }
                return Err(e);
            }
            let (min, max) = (v[0] as u64, (-v[1]) as u64);
            if max > min + 1 {
                return Err(Error::Internal(format!(
                    "survivors are {} steps apart after a failure (at most 1 is possible)",
                    max - min
                )));
            }
            if self.done > min {
                let prev = self.prev.take().ok_or_else(|| {
                    Error::Internal("no snapshot of the previous step to roll back to".into())
                })?;
                state.load(&prev)?;
                self.done = min;
            }
            let lost: Vec<usize> = (0..self.world)
                .filter(|r| !self.members.iter().any(|m| m.0 == *r))
                .collect();
            self.events.push(RecoveryEvent::Shrunk {
                lost,
                size: self.members.len(),
                at: SystemTime::now(),
                redo_from: self.done,
            });
            return Ok(());
        }
    }

    /// One attempt: shrink without the ranks `gone` (indices in `comm`),
    /// abandoned when the board shows another death meanwhile.
    fn try_shrink(&mut self, board: &Board, gone: &[usize], until: Instant) -> Result<()> {
        let ndead = board.deaths().len();
        let cfg = self.cfg.clone().blocking(false);
        // The id depends only on who is left (and the grows so far), so
        // survivors that reach the same membership from different parents
        // (one finished a shrink that another gave up) meet in one child.
        let mut h = Sha256::new();
        h.update(b"weft-resilient-shrink");
        h.update(crate::bootstrap::ctx::job_label().as_bytes());
        // The secret every communicator since the last grow shares (a
        // shrink keeps its parent's): two jobs with one name never meet.
        if let Some((ctx, _)) = self.comm.s.built.get() {
            h.update(ctx.secret);
        }
        h.update(self.grows.to_le_bytes());
        for (i, m) in self.members.iter().enumerate() {
            if !gone.contains(&i) {
                h.update((m.0 as u64).to_le_bytes());
                h.update(m.1.to_le_bytes());
            }
        }
        let id: [u8; 16] = h.finalize()[..16].try_into().unwrap();
        let child = self
            .comm
            .shrink_tagged(gone, Some(cfg), ShrinkMode::Abort, Some(id))?;
        loop {
            match child.state() {
                CommState::Ready => break,
                CommState::Initializing => {}
                _ => {
                    // Whatever broke the build (a peer died while its segment
                    // was being passed: a reset connection, a timeout), the
                    // survivors try again: a peer failure.
                    let why = child
                        .wait_ready(Some(Duration::ZERO))
                        .err()
                        .map(|e| e.to_string())
                        .unwrap_or_default();
                    return Err(Error::Remote {
                        comm: child.id().to_string(),
                        rank: child.rank(),
                        detail: format!("the shrunk communicator failed to build: {why}"),
                    });
                }
            }
            let now_dead = board.deaths().len();
            if now_dead != ndead || Instant::now() >= until {
                abandon(child);
                return Err(Error::Bootstrap(if now_dead != ndead {
                    format!("another rank died during the shrink ({ndead} -> {now_dead} deaths)")
                } else {
                    "the recovery timed out during the shrink".into()
                }));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        self.adopt_shrunk(child, gone)
    }

    /// Makes `child` (the shrink without `gone`) the communicator. The old
    /// one is aborted, not just destroyed: its device side (if any) stays to
    /// the end of the process, as after any abort, since a survivor's kernel
    /// that has not seen the failure yet may still read it. The members are
    /// known without asking (the survivors in order), so a failure of the
    /// all-gather in `refresh_members` leaves a consistent view to recover from.
    fn adopt_shrunk(&mut self, child: Communicator, gone: &[usize]) -> Result<()> {
        let old = std::mem::replace(&mut self.comm, child);
        let _ = old.abort();
        let _ = old.destroy();
        self.members = (0..self.members.len())
            .filter(|i| !gone.contains(i))
            .map(|i| self.members[i])
            .collect();
        self.refresh_members()
    }

    /// Shrinks without the given ranks of the current communicator, when
    /// the program learned itself who is gone (no board).
    pub fn recover_without(&mut self, gone: &[usize]) -> Result<()> {
        let child = self
            .comm
            .shrink(gone, Some(self.cfg.clone()), ShrinkMode::Abort)?;
        self.adopt_shrunk(child, gone)
    }

    /// At a step boundary: when every member sees the same replacements
    /// ready, grow back to include them. After a grow it looks again, so a
    /// joiner (whose first call here is its next look) stays in step.
    fn maybe_grow(&mut self, state: &mut impl State) -> Result<()> {
        while self.grow_once(state)? {}
        Ok(())
    }

    /// One look: true when a grow happened.
    fn grow_once(&mut self, state: &mut impl State) -> Result<bool> {
        let Some(board) = self.board.clone() else {
            return Ok(false);
        };
        if self.members.len() >= self.world {
            return Ok(false);
        }
        let deaths = board.deaths();
        // Per logical rank: the ready incarnation + 1, or 0.
        let mut ready: Vec<i64> = (0..self.world)
            .map(|r| {
                if self.members.iter().any(|m| m.0 == r) {
                    return 0;
                }
                board.ready(r, &deaths).map(|i| i as i64 + 1).unwrap_or(0)
            })
            .collect();
        let mut hi = ready.clone();
        self.comm.all_reduce_in_place(&mut ready, ReduceOp::Min)?;
        self.comm.all_reduce_in_place(&mut hi, ReduceOp::Max)?;
        let joiners: Vec<(usize, u32)> = (0..self.world)
            .filter(|&r| ready[r] > 0 && ready[r] == hi[r])
            .map(|r| (r, (ready[r] - 1) as u32))
            .collect();
        if joiners.is_empty() {
            return Ok(false);
        }
        let n = self.comm.count();
        let nranks = n + joiners.len();
        // Newer than any grow id written before (by any root).
        let seq = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap_or_default()
            .as_micros() as u64;
        let id = if self.comm.rank() == 0 {
            let id = self.comm.grow_unique_id()?;
            for (i, &(r, inc)) in joiners.iter().enumerate() {
                board.write(
                    &RankFile::grow(r, inc).name(),
                    &format!(
                        "{} {} {} {} {}\n",
                        seq,
                        nranks,
                        n + i,
                        self.done,
                        hex(&id.to_bytes())
                    ),
                )?;
            }
            Some(id)
        } else {
            None
        };
        let cfg = self.cfg.clone().blocking(false);
        let grown = self.comm.grow(nranks, id.as_ref(), Some(cfg))?;
        let until = Instant::now() + self.recovery_timeout;
        // Wait for the grown communicator, a joiner's death, a member's
        // death or the timeout; then the members agree (over the current
        // communicator, which the grow did not touch) whether to adopt it:
        // one may see it ready while another saw the joiner die first.
        let mut lost_joiner = None;
        let ok = loop {
            match grown.state() {
                CommState::Ready => break true,
                CommState::Initializing => {}
                _ => {
                    if let Err(e) = grown.wait_ready(Some(Duration::ZERO)) {
                        crate::log::warn_log!("resilient: grow failed: {e}");
                    }
                    break false;
                }
            }
            let deaths = board.deaths();
            if let Some(&(r, _)) = joiners
                .iter()
                .find(|&&(r, i)| Board::is_dead(&deaths, r, i))
            {
                lost_joiner = Some(r);
                break false;
            }
            if self
                .members
                .iter()
                .any(|&(r, i)| Board::is_dead(&deaths, r, i))
            {
                abandon(grown);
                return Err(Error::Remote {
                    comm: self.comm.id().to_string(),
                    rank: self.comm.rank(),
                    detail: "a member died during the grow".into(),
                });
            }
            if Instant::now() >= until {
                break false;
            }
            std::thread::sleep(Duration::from_millis(1));
        };
        let mut v = [ok as i32];
        if let Err(e) = self.comm.all_reduce_in_place(&mut v, ReduceOp::Min) {
            abandon(grown);
            return Err(e);
        }
        if v[0] == 0 {
            abandon(grown);
            self.events.push(RecoveryEvent::GrowFailed {
                rank: lost_joiner.unwrap_or(joiners[0].0),
                at: SystemTime::now(),
            });
            return Ok(false);
        }
        self.adopt_grown(grown, state, &joiners)
    }

    /// After a grow: order the ranks by logical rank again (a split) and
    /// send the state to the joiners. The members agree over the current
    /// communicator whether the split worked: a joiner can fail it without
    /// dying (it gave the grow up), and then no death would ever explain
    /// the failure; the grow is given up instead (false) and tried again.
    fn adopt_grown(
        &mut self,
        grown: Communicator,
        state: &mut impl State,
        joiners: &[(usize, u32)],
    ) -> Result<bool> {
        let split = grown.split_with_config(
            Some(0),
            self.logical as i32,
            self.cfg.clone().blocking(true),
        );
        let ordered = match split {
            Ok(Some(o)) => Some(o),
            Ok(None) => {
                return Err(Error::Internal(
                    "the ordering split gave no communicator".into(),
                ));
            }
            Err(e) if is_peer_failure(&e) => {
                crate::log::warn_log!("resilient: the grown communicator failed its split: {e}");
                None
            }
            Err(e) => return Err(e),
        };
        let mut v = [ordered.is_some() as i32];
        let agreed = self.comm.all_reduce_in_place(&mut v, ReduceOp::Min);
        if agreed.is_err() || v[0] == 0 {
            if let Some(o) = ordered {
                let _ = o.abort();
            }
            abandon(grown);
            agreed?;
            self.events.push(RecoveryEvent::GrowFailed {
                rank: joiners[0].0,
                at: SystemTime::now(),
            });
            return Ok(false);
        }
        let ordered = ordered.expect("agreed: the split worked here");
        let _ = grown.destroy();
        let old = std::mem::replace(&mut self.comm, ordered);
        let _ = old.destroy();
        // Known without asking: ordered by logical rank (see try_shrink).
        self.members.extend_from_slice(joiners);
        self.members.sort();
        self.refresh_members()?;
        self.grows += 1;
        let joined_now: Vec<usize> = joiners.iter().map(|j| j.0).collect();
        self.send_state(Some(state.save()))?;
        self.events.push(RecoveryEvent::Grown {
            joined: joined_now,
            size: self.members.len(),
            at: SystemTime::now(),
        });
        Ok(true)
    }

    /// The lowest-ranked member that is not joining broadcasts the step
    /// count, the grow count and the state. `bytes` is `None` on a joiner.
    fn send_state(&mut self, bytes: Option<Vec<u8>>) -> Result<()> {
        let n = self.comm.count();
        let mut flags = vec![0u32; n];
        self.comm
            .all_gather(&[bytes.is_none() as u32], &mut flags)?;
        let src = (0..n)
            .find(|&r| flags[r] == 0)
            .ok_or_else(|| Error::Internal("no member to send the state".into()))?;
        let me_src = self.comm.rank() == src;
        let mut head = [0u64; 3];
        if me_src {
            head = [
                self.done,
                bytes.as_ref().map(|b| b.len() as u64).unwrap_or(0),
                self.grows,
            ];
        }
        self.comm.broadcast_in_place(&mut head, src)?;
        let mut buf = if me_src {
            bytes.clone().unwrap_or_default()
        } else {
            vec![0u8; head[1] as usize]
        };
        self.comm.broadcast_in_place(&mut buf, src)?;
        self.done = head[0];
        self.grows = head[2];
        if bytes.is_none() {
            self.received = Some(buf);
        }
        Ok(())
    }

    /// A replacement: say ready, wait for a grow id, join, get the state.
    fn join_as_replacement(
        board: Board,
        world: usize,
        logical: usize,
        inc: u32,
        cfg: Config,
        timeout: Duration,
    ) -> Result<Resilient> {
        board.write(&RankFile::ready(logical, inc).name(), "")?;
        let until = Instant::now() + timeout;
        let mut last_seq = 0u64;
        let grow_file = board.path(&RankFile::grow(logical, inc).name());
        loop {
            if Instant::now() >= until {
                return Err(Error::Timeout {
                    comm: "(joining)".into(),
                    rank: logical,
                    after_ms: timeout.as_millis() as u64,
                    waiting_for: "the survivors to grow the job back".into(),
                });
            }
            let Ok(s) = std::fs::read_to_string(&grow_file) else {
                std::thread::sleep(POLL);
                continue;
            };
            let w: Vec<&str> = s.split_whitespace().collect();
            let parsed = (|| {
                let seq: u64 = w.first()?.parse().ok()?;
                let nranks: usize = w.get(1)?.parse().ok()?;
                let rank: usize = w.get(2)?.parse().ok()?;
                let id = UniqueId::from_bytes(&unhex(w.get(4)?)?).ok()?;
                Some((seq, nranks, rank, id))
            })();
            let Some((seq, nranks, rank, id)) = parsed else {
                std::thread::sleep(POLL);
                continue;
            };
            if seq <= last_seq {
                std::thread::sleep(POLL);
                continue;
            }
            last_seq = seq;
            let c = Communicator::join(&id, nranks, rank, cfg.clone().blocking(false))?;
            // 0: ready, 1: failed (dropped here), 2: to abandon.
            let outcome = loop {
                match c.state() {
                    CommState::Ready => break 0,
                    CommState::Initializing => {}
                    _ => break 1,
                }
                // A newer grow for us: the survivors gave this one up (one
                // of them or another joiner died) and started another. Not
                // any death on the board: this board is fresh, and deaths
                // from before the grow (our predecessor's) arrive after the
                // grow file; leaving then closed the survivors' connections
                // mid-bootstrap and failed a grow that was going well.
                let newer = std::fs::read_to_string(&grow_file)
                    .ok()
                    .and_then(|s| s.split_whitespace().next()?.parse::<u64>().ok())
                    .is_some_and(|q| q > seq);
                if newer || Instant::now() >= until {
                    break 2;
                }
                std::thread::sleep(Duration::from_millis(1));
            };
            match outcome {
                0 => {}
                1 => continue,
                _ => {
                    abandon(c);
                    continue;
                }
            }
            // The survivors may give this grow up after it was ready here
            // (they agree among themselves): then the split fails, and we
            // wait for the next grow.
            let ordered =
                match c.split_with_config(Some(0), logical as i32, cfg.clone().blocking(true)) {
                    Ok(Some(o)) => o,
                    Ok(None) => {
                        return Err(Error::Internal(
                            "the ordering split gave no communicator".into(),
                        ));
                    }
                    Err(e) if is_peer_failure(&e) => continue,
                    Err(e) => return Err(e),
                };
            let _ = c.destroy();
            let mut r = Resilient::new_inner(
                ordered,
                world,
                logical,
                inc,
                Some(board.clone()),
                cfg.clone(),
            );
            r.recovery_timeout = timeout;
            match r.refresh_members().and_then(|_| r.send_state(None)) {
                Ok(()) => return Ok(r),
                Err(e) if is_peer_failure(&e) => continue,
                Err(e) => return Err(e),
            }
        }
    }
}
