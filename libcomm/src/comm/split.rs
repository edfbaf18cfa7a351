//! Splitting a communicator (NCCL's `ncclCommSplit`, after a revoke too),
//! and the one way a child communicator is built: from a table of peers
//! this rank already holds, without a rendezvous ([`Child`]), for a split's
//! children, a shrink's survivors (`resilience/recovery.rs`) and the
//! temporary communicator of a split after revoke.

use crate::algo;
use crate::bootstrap::PeerInfo;
use crate::bootstrap::ctx::{CommId, Ctx};
use crate::bootstrap::unique_id::hex;
use crate::comm::communicator::Communicator;
use crate::comm::shared::lock;
use crate::config::Config;
use crate::data::types::DataType;
use crate::error::{Error, Result};
use crate::op::Op;
use crate::op::tuner;
use crate::progress::resources::Resources;
use crate::state::CommState;
use crate::transport::tcp::Endpoint;
use sha2::{Digest, Sha256};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What a child communicator is built from: its id (the same on every
/// member), this rank in it, its members' entries of the parent's table of
/// peers, the job's secret and label, and this process's endpoint.
pub(crate) struct Child {
    pub id: CommId,
    pub rank: usize,
    pub peers: Vec<PeerInfo>,
    pub secret: [u8; 32],
    pub job: String,
    pub endpoint: Arc<Endpoint>,
}

impl Child {
    /// Builds it with `cfg` (its name, else the id's first bytes, labels
    /// it): a blocking configuration returns it Ready, else Initializing.
    pub(crate) fn build(self, cfg: Config) -> Result<Communicator> {
        let label = cfg.name.clone().unwrap_or_else(|| hex(&self.id[..4]));
        let (rank, nranks) = (self.rank, self.peers.len());
        Communicator::start(label.clone(), rank, nranks, cfg, move |s| {
            let ctx = Arc::new(Ctx {
                id: self.id,
                label,
                rank,
                nranks,
                secret: self.secret,
                peers: self.peers,
                cfg: s.cfg.clone(),
                job: self.job,
            });
            Resources::build(ctx, self.endpoint, deadline(&s.cfg))
        })
    }
}

/// When building a child gives up: its init timeout (100 ms at least).
fn deadline(cfg: &Config) -> Instant {
    Instant::now() + cfg.init_timeout.max(Duration::from_millis(100))
}

impl Communicator {
    /// Splits into sub-communicators (NCCL's `ncclCommSplit`): ranks passing the
    /// same `color` form one, ordered by `key` then by rank here; `None` (NCCL's
    /// `NCCL_SPLIT_NOCOLOR`) takes part but gets no communicator. Every rank must call it.
    pub fn split(&self, color: Option<u32>, key: i32) -> Result<Option<Communicator>> {
        self.split_with_config(color, key, self.s.cfg.clone())
    }

    /// Split with a configuration for the child; non-blocking configurations
    /// return a child still `Initializing` (the exchange with the parent's ranks
    /// is done before returning, so calls on the parent stay ordered).
    ///
    /// A [revoked](Self::revoke) communicator can be split too (as in NCCL),
    /// once this rank is quiescent ([`async_error`](Self::async_error) reads
    /// `Ok`; before, this returns `Error::InProgress`): the colors are then
    /// exchanged on a temporary communicator of all its ranks built from its
    /// table of peers, with no message on the revoked one (see
    /// below). Every rank must call it, as any split.
    pub fn split_with_config(
        &self,
        color: Option<u32>,
        key: i32,
        cfg: Config,
    ) -> Result<Option<Communicator>> {
        if self.s.reconf.revoked() {
            return self.split_revoked(color, key, cfg);
        }
        let plan = self.with_resources("split", |core| {
            let n = core.ctx.nranks;
            let seq = core.split_seq();
            let mut mine = [0u8; 16];
            mine[..8].copy_from_slice(&color.map(|c| c as i64).unwrap_or(-1).to_le_bytes());
            mine[8..12].copy_from_slice(&key.to_le_bytes());
            let mut all = vec![0u8; 16 * n];
            let a = tuner::choose(tuner::Coll::AllGather, 16 * n, n, &core.ctx.cfg.algo);
            let op = Op::all_gather(mine.as_ptr(), all.as_mut_ptr(), 16, DataType::U8);
            algo::all_gather(core, &op, a)?;
            let Some(color) = color else { return Ok(None) };
            let mut members: Vec<(i32, usize)> = (0..n)
                .filter_map(|r| {
                    let e = &all[16 * r..16 * r + 16];
                    let c = i64::from_le_bytes(e[..8].try_into().unwrap());
                    let k = i32::from_le_bytes(e[8..12].try_into().unwrap());
                    (c == color as i64).then_some((k, r))
                })
                .collect();
            members.sort();
            let new_rank = members
                .iter()
                .position(|&(_, r)| r == core.ctx.rank)
                .expect("self is a member");
            let mut h = Sha256::new();
            h.update(core.ctx.id);
            h.update(seq.to_le_bytes());
            h.update((color as i64).to_le_bytes());
            let id: [u8; 16] = h.finalize()[..16].try_into().unwrap();
            let peers: Vec<PeerInfo> = members
                .iter()
                .map(|&(_, r)| core.ctx.peers[r].clone())
                .collect();
            Ok(Some(Child {
                id,
                rank: new_rank,
                peers,
                secret: core.ctx.secret,
                job: core.ctx.job.clone(),
                endpoint: core.endpoint.clone(),
            }))
        })?;
        match plan {
            Some(child) => child.build(cfg).map(Some),
            None => Ok(None),
        }
    }

    /// The communicator of the parent's ranks `members` (in that order,
    /// this rank among them) with id `id`, built from the parent's table of
    /// peers without a message on the parent: every member calls it with
    /// the same arguments (shrink, and the exchange of a split after
    /// revoke). A blocking `cfg` returns it Ready.
    pub(crate) fn build_members(
        &self,
        members: &[usize],
        id: CommId,
        cfg: Config,
    ) -> Result<Communicator> {
        let s = &self.s;
        let st = s.state.get();
        let Some((ctx, endpoint)) = s.built.get().cloned() else {
            return Err(s.state_error(st, "building a communicator from this one"));
        };
        let Some(rank) = members.iter().position(|&r| r == s.rank) else {
            return Err(Error::Internal(format!(
                "{}: building a communicator of ranks {members:?} without this one",
                self.describe()
            )));
        };
        Child {
            id,
            rank,
            peers: members.iter().map(|&r| ctx.peers[r].clone()).collect(),
            secret: ctx.secret,
            job: ctx.job.clone(),
            endpoint,
        }
        .build(cfg)
    }

    /// [`split_with_config`](Self::split_with_config) of a revoked
    /// communicator (NCCL allows split after revoke). The parent's channels
    /// are gone, so the colors are exchanged on a temporary communicator of
    /// all its ranks, built from the parent's table of peers as a shrink
    /// with nothing excluded would be (its id from the parent's id and split
    /// count, the same on every rank); the children are split from it as
    /// from a healthy parent, then it is destroyed. Every rank of the parent
    /// must call it, as any split. Before this rank is quiescent (the
    /// revoke of a non-blocking communicator still waits for a call of ours
    /// to return; `async_error` reads `InProgress`) it returns
    /// `Error::InProgress` and does nothing: split again once `async_error`
    /// reads `Ok`.
    pub(crate) fn split_revoked(
        &self,
        color: Option<u32>,
        key: i32,
        cfg: Config,
    ) -> Result<Option<Communicator>> {
        let s = &self.s;
        let st = s.state.get();
        if st != CommState::Failed {
            return Err(s.state_error(st, "split"));
        }
        match s.reconf.revoke_status() {
            Some(Ok(())) => {}
            Some(Err(e)) => {
                crate::log::warn_log!(
                    "comm {} rank {}: split while the revoke is still in progress (an operation of this rank has not returned yet): poll the async error until it reads success, then split",
                    s.label,
                    s.rank
                );
                return Err(e);
            }
            None => {
                return Err(Error::Internal(
                    "split_revoked on a communicator that was not revoked".into(),
                ));
            }
        }
        let Some((ctx, _)) = s.built.get().cloned() else {
            return Err(s.state_error(st, "split"));
        };
        // The parent's split count, as a split of the healthy parent would
        // take it (the same on every rank).
        let seq = match lock(&s.resources).as_mut() {
            Some(core) => core.split_seq(),
            None => return Err(s.state_error(s.state.get(), "split")),
        };
        let mut h = Sha256::new();
        h.update(ctx.id);
        h.update(b"split after revoke");
        h.update(seq.to_le_bytes());
        let id: [u8; 16] = h.finalize()[..16].try_into().unwrap();
        let mut tmp_cfg = s.cfg.clone().blocking(true);
        tmp_cfg.name = None;
        crate::log::info_log!(
            "comm {} rank {}: split after revoke: exchanging colors on a temporary communicator {}",
            s.label,
            s.rank,
            hex(&id[..4])
        );
        let all: Vec<usize> = (0..s.nranks).collect();
        let tmp = self
            .build_members(&all, id, tmp_cfg)
            .map_err(|e| match e {
                Error::Remote { comm, rank, detail } => Error::Remote {
                    comm,
                    rank,
                    detail: format!(
                        "split after revoke of {}: {detail} (every rank of the revoked communicator must call split)",
                        s.label
                    ),
                },
                e => e,
            })?;
        let r = tmp.split_with_config(color, key, cfg);
        drop(tmp);
        r
    }
}
