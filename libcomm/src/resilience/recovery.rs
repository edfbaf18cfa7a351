//! Reconfiguring a communicator around lost ranks, with NCCL's semantics
//! (2.27-2.29): [`Communicator::revoke`], [`Communicator::shrink`] (called
//! by the survivors only) and [`Communicator::grow_unique_id`] +
//! [`Communicator::grow`] / [`Communicator::join`].
//!
//! A shrink needs nothing of the parent's channels: every survivor holds
//! the parent's table of peers (`CommShared::built`, kept past a failure),
//! so the survivors derive the same child (its id from the parent's id, the
//! excluded ranks and how many shrinks with that list came before) and
//! build it directly, like a split without the exchange (`comm/split.rs`). A grow runs a
//! fresh bootstrap rendezvous whose root lives in the process that called
//! `grow_unique_id`; the existing ranks learn the id over the parent (one
//! all-gather), the new ranks get it out of band (the launcher's recovery
//! board, `resilient.rs`). See docs/FAULT-TOLERANCE.md.

use crate::algo;
use crate::bootstrap::unique_id::{UNIQUE_ID_BYTES, UniqueId, hex};
use crate::comm::communicator::Communicator;
use crate::comm::shared::{CommShared, lock};
use crate::config::Config;
use crate::data::types::DataType;
use crate::error::{Error, Result};
use crate::op::Op;
use crate::op::tuner;
use crate::state::CommState;
use crate::transport::shm::FAIL_ABORT;
use sha2::{Digest, Sha256};
use std::time::{Duration, Instant};

/// How a shrink treats operations still running on the parent (NCCL's
/// `shrinkFlags`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ShrinkMode {
    /// `NCCL_SHRINK_DEFAULT`: the parent has no operation in flight (a
    /// healthy parent stays usable afterwards).
    #[default]
    Default,
    /// `NCCL_SHRINK_ABORT`: revoke the parent first (in-flight operations
    /// on every rank return), then shrink. For a parent with a dead rank.
    Abort,
}

impl Communicator {
    /// NCCL's `ncclCommRevoke`: stops the operations in flight on this
    /// communicator, here and on every rank (they return an error naming
    /// this rank), and refuses new ones. [`async_error`](Self::async_error)
    /// reports `InProgress` until this rank is quiescent (no call of ours
    /// still inside the communicator), then `Ok`; afterwards only
    /// [`split`](Self::split) (every rank calls it, as any split),
    /// [`shrink`](Self::shrink) and destroy are allowed. Idempotent.
    pub fn revoke(&self) -> Result<()> {
        let s = &self.s;
        let st = s.state.get();
        if !matches!(st, CommState::Ready | CommState::Failed) {
            return Err(s.state_error(st, "revoke"));
        }
        if !s.reconf.start_revoke() {
            return Ok(());
        }
        let why = format!("rank {} revoked communicator {}", s.rank, s.label);
        s.set_async_error(Error::InvalidUsage(format!(
            "{} was revoked (by rank {}): only split, shrink and destroy are allowed",
            self.describe(),
            s.rank
        )));
        s.state
            .transition_from(&[CommState::Ready], CommState::Failed);
        if let Some(w) = s.device_word() {
            w.fire();
        }
        if let Some(f) = s.fault() {
            f.raise(FAIL_ABORT, &why);
        }
        crate::log::info_log!("comm {} rank {}: revoked", s.label, s.rank);
        let quiesce = |s: &CommShared| {
            // Pending eager sends are dropped with the resources later; an
            // operation of another thread returns (it saw the raise) and
            // releases the lock.
            s.flusher.stop();
            drop(lock(&s.resources));
            s.reconf.end_revoke();
        };
        if s.cfg.blocking {
            quiesce(s);
        } else {
            let s2 = s.clone();
            std::thread::Builder::new()
                .name(format!("weft-revoke-{}", s.rank))
                .spawn(move || quiesce(&s2))
                .map_err(|e| Error::sys("spawning the revoke thread", e))?;
        }
        Ok(())
    }

    /// NCCL's `ncclCommShrink`: a communicator of the ranks not in
    /// `exclude`, renumbered in their order. Called by the survivors only
    /// (excluded ranks, dead or departing, never call it), each with the
    /// same list; the parent may be healthy or failed (a peer died). With
    /// [`ShrinkMode::Abort`] the parent is revoked first. `cfg` `None`
    /// inherits the parent's; a non-blocking configuration returns the child
    /// still initializing. A rank that dies meanwhile makes the others'
    /// shrink fail (a typed error, bounded by the init timeout): shrink the
    /// parent again without it.
    pub fn shrink(
        &self,
        exclude: &[usize],
        cfg: Option<Config>,
        mode: ShrinkMode,
    ) -> Result<Communicator> {
        self.shrink_tagged(exclude, cfg, mode, None)
    }

    /// [`shrink`](Self::shrink) with the child's id given (which every
    /// survivor passes the same) instead of derived from the parent and the
    /// count of earlier shrinks: for recovery loops where survivors may
    /// reach the same membership from different parents.
    pub(crate) fn shrink_tagged(
        &self,
        exclude: &[usize],
        cfg: Option<Config>,
        mode: ShrinkMode,
        given_id: Option<[u8; 16]>,
    ) -> Result<Communicator> {
        let s = &self.s;
        let who = self.describe();
        let st = s.state.get();
        if !matches!(st, CommState::Ready | CommState::Failed) {
            return Err(s.state_error(st, "shrink"));
        }
        let n = s.nranks;
        let mut ex = vec![false; n];
        for &r in exclude {
            if r >= n {
                return Err(Error::arg(format!(
                    "{who}: excluded rank {r} is out of range for {n} ranks"
                )));
            }
            ex[r] = true;
        }
        if ex[s.rank] {
            return Err(Error::arg(format!(
                "{who}: this rank is in the exclude list; excluded ranks do not call shrink"
            )));
        }
        let Some((ctx, _)) = s.built.get().cloned() else {
            return Err(s.state_error(st, "shrink"));
        };
        let _busy = s.reconf.shrinking(&who)?;
        // The phases are logged with their times (NCCL_DEBUG=INFO): a
        // recovery's budget is about a second, and these say where it goes.
        let t0 = Instant::now();
        if mode == ShrinkMode::Abort {
            self.revoke()?;
            let until = Instant::now() + s.cfg.init_timeout;
            while !s.reconf.revoke_ended() {
                if Instant::now() >= until {
                    return Err(Error::Timeout {
                        comm: s.label.clone(),
                        rank: s.rank,
                        after_ms: s.cfg.init_timeout.as_millis() as u64,
                        waiting_for: "an operation in flight to return after the revoke".into(),
                    });
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            crate::log::info_log!(
                "comm {} rank {}: revoked for the shrink; quiescent after {} ms",
                s.label,
                s.rank,
                t0.elapsed().as_millis()
            );
        }
        let excluded: Vec<usize> = (0..n).filter(|&r| ex[r]).collect();
        let id = given_id.unwrap_or_else(|| {
            let tag = s.reconf.next_shrink(&excluded);
            let mut h = Sha256::new();
            h.update(ctx.id);
            h.update(b"shrink");
            h.update(tag.to_le_bytes());
            for r in &excluded {
                h.update((*r as u64).to_le_bytes());
            }
            h.finalize()[..16].try_into().unwrap()
        });
        let members: Vec<usize> = (0..n).filter(|&r| !ex[r]).collect();
        let cfg = cfg.unwrap_or_else(|| s.cfg.clone());
        crate::log::info_log!(
            "comm {} rank {}: shrinking to {} rank(s) without {excluded:?} (new id {})",
            s.label,
            s.rank,
            members.len(),
            cfg.name.clone().unwrap_or_else(|| hex(&id[..4]))
        );
        let child = self.build_members(&members, id, cfg);
        crate::log::info_log!(
            "comm {} rank {}: shrink {} after {} ms",
            s.label,
            s.rank,
            if child.is_ok() {
                "built the child"
            } else {
                "failed"
            },
            t0.elapsed().as_millis()
        );
        child
    }

    /// NCCL's `ncclCommGetUniqueId`: an id for growing this communicator,
    /// whose bootstrap root is served by this process. This rank then passes
    /// it to [`grow`](Self::grow) (the "root" of the grow); the new ranks get
    /// it out of band and call [`join`](Self::join). One id at a time: a
    /// second call before a grow consumed the first is refused.
    pub fn grow_unique_id(&self) -> Result<UniqueId> {
        let st = self.s.state.get();
        if st != CommState::Ready {
            return Err(self.s.state_error(st, "getting a unique id for grow"));
        }
        let mut g = self.s.reconf.grow_id();
        if g.is_some() {
            return Err(Error::InvalidUsage(format!(
                "{}: the unique id from an earlier ncclCommGetUniqueId was not consumed by a grow yet",
                self.describe()
            )));
        }
        // The root listens where this rank is reached in this communicator
        // (loopback when every rank is on this host): the existing ranks
        // reach it there, and so does a replacement in the same network.
        // The route-based guess of a fresh ncclGetUniqueId may pick an
        // interface the job does not use (and that may vanish).
        let ip = self
            .s
            .built
            .get()
            .map(|(ctx, _)| ctx.peers[self.s.rank].addr.ip())
            .filter(|ip| !ip.is_unspecified());
        let id = match ip {
            Some(ip) => UniqueId::new_at(ip)?,
            None => UniqueId::new()?,
        };
        *g = Some(id.clone());
        Ok(id)
    }

    /// NCCL's `ncclCommGrow` for the ranks of this communicator: every one
    /// calls it, the rank that made the id with `Some(id)`, the others with
    /// `None`; they keep their ranks in the new communicator of `nranks`
    /// ranks, and the new ranks ([`join`](Self::join)) take the ranks after
    /// them. A new rank that never arrives (it died) fails the grow after
    /// the init timeout, or at once when the child is aborted; this
    /// communicator stays usable either way.
    pub fn grow(
        &self,
        nranks: usize,
        id: Option<&UniqueId>,
        cfg: Option<Config>,
    ) -> Result<Communicator> {
        let who = self.describe();
        let n = self.s.nranks;
        if nranks <= n || nranks > (1 << 20) {
            return Err(Error::arg(format!(
                "{who}: grow to {nranks} ranks: nRanks must be larger than the current {n} (and at most 1048576)"
            )));
        }
        let _busy = self.s.reconf.growing(&who)?;
        if let Some(id) = id
            && self.s.reconf.grow_id().as_ref() != Some(id)
        {
            return Err(Error::InvalidUsage(format!(
                "{who}: the unique id passed to grow was not made by ncclCommGetUniqueId on this communicator (or was consumed already)"
            )));
        }
        const W: usize = 1 + UNIQUE_ID_BYTES;
        let mut mine = [0u8; W];
        if let Some(id) = id {
            mine[0] = 1;
            mine[1..].copy_from_slice(&id.to_bytes());
        }
        let all = self.with_resources("grow", |core| {
            let mut all = vec![0u8; W * n];
            let a = tuner::choose(tuner::Coll::AllGather, W * n, n, &core.ctx.cfg.algo);
            let op = Op::all_gather(mine.as_ptr(), all.as_mut_ptr(), W, DataType::U8);
            algo::all_gather(core, &op, a)?;
            Ok(all)
        })?;
        let holders: Vec<usize> = (0..n).filter(|&r| all[r * W] == 1).collect();
        if holders.len() != 1 {
            return Err(Error::InvalidUsage(format!(
                "{who}: grow: {} rank(s) ({holders:?}) passed a unique id; exactly one, the rank that called ncclCommGetUniqueId, must",
                holders.len()
            )));
        }
        let h = holders[0];
        let gid = UniqueId::from_bytes(&all[h * W + 1..(h + 1) * W])?;
        if id.is_some() {
            self.s.reconf.grow_id().take();
        }
        let cfg = cfg.unwrap_or_else(|| self.s.cfg.clone());
        Self::rendezvous(&gid, nranks, self.s.rank, cfg)
    }

    /// NCCL's `ncclCommGrow` for a new rank (`comm` NULL): joins the
    /// communicator that the existing ranks grow with `id`, as rank `rank`
    /// (from the old size up to `nranks - 1`).
    pub fn join(id: &UniqueId, nranks: usize, rank: usize, cfg: Config) -> Result<Communicator> {
        if rank >= nranks {
            return Err(Error::arg(format!(
                "grow: rank {rank} is out of range for {nranks} ranks"
            )));
        }
        Self::rendezvous(id, nranks, rank, cfg)
    }

    /// Whether [`revoke`](Self::revoke) was called on this communicator.
    pub fn is_revoked(&self) -> bool {
        self.s.reconf.revoked()
    }
}
