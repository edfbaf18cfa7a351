//! The public communicator and the one entry point of operations.
//!
//! Names, from the outside in:
//! - [`Communicator`]: one rank's handle (the public type);
//! - [`CommShared`]: its lifecycle record, shared with the init thread and
//!   the observer's abort handle: identity, [`CommState`], the failure cause,
//!   the device backend's [`DeviceSlot`], and the [`Resources`];
//! - [`Resources`] (`core.rs`): the live resources of a Ready communicator
//!   (peers, channels, shared memory, failure domain), behind one mutex, so
//!   calls from several threads are serialized; abort and the status
//!   queries never take that mutex, so they work while a collective is
//!   blocked. Its immutable facts (ids, rank, peers, config) are `core::Ctx`.
//!
//! Every operation is an [`Op`] and enters through [`Communicator::submit`]
//! (a group through [`Group::execute`]): validated once here, then run on
//! host memory by the host algorithms ([`run_op`], with the tuner's
//! [`Decision`]) or handed to the device backend ([`run_device`]; see
//! `backend.rs`). This module is the only one of the core that names `cuda/`
//! (in `device_backend`), and `cuda/` never imports it.

use crate::algo;
use crate::bootstrap::ctx::{Ctx, job_label};
use crate::bootstrap::unique_id::{UniqueId, hex};
use crate::bootstrap::{PeerInfo, client, root};
use crate::comm::flusher::{self, Flusher};
use crate::comm::group::Group;
use crate::comm::watch::{self, Watched};
use crate::config::Config;
use crate::data::types::{Element, ReduceOp};
use crate::error::{Error, ErrorKind, Result};
use crate::op::backend::{AbortWord, Backend, Comms, DeviceSlot, Item};
use crate::op::tuner::{self, Decision};
use crate::op::{Memory, Op, OpKind, typed};
use crate::progress::fault::Fault;
use crate::progress::resources::Resources;
use crate::state::{CommState, StateCell};
use crate::transport::shm::FAIL_ABORT;
use crate::transport::tcp;
use sha2::{Digest, Sha256};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime};

/// A communicator's lifecycle record (see the module docs).
pub(crate) struct CommShared {
    pub label: String,
    pub rank: usize,
    pub nranks: usize,
    pub cfg: Config,
    pub state: StateCell,
    pub(crate) resources: Mutex<Option<Resources>>,
    /// Pushes pending eager host sends while the communicator is idle (`eager.rs`).
    pub(crate) flusher: Flusher,
    fault: OnceLock<Arc<Fault>>,
    async_err: Mutex<Option<Error>>,
    /// Set by abort/destroy to stop a bootstrap in progress.
    cancel: AtomicBool,
    worker: Mutex<Option<JoinHandle<()>>>,
    ended_at: Mutex<Option<SystemTime>>,
    /// Sequence numbers of operations, for the observer (`observe.rs`).
    pub(crate) obs_seq: crate::observe::Seq,
    /// A weak pointer to this record, for the observer's abort handle.
    me: OnceLock<std::sync::Weak<CommShared>>,
    /// The device side (CUDA), set up by the first operation on device memory.
    pub(crate) dev: Mutex<DeviceSlot>,
    /// The device side's abort word, once it exists: fired without `dev`'s
    /// lock (by abort, and by the device watch on a peer's failure).
    device_word: OnceLock<Arc<AbortWord>>,
    /// What the communicator was built from (peers, id, secret) and the
    /// process's endpoint, kept past a failure or revoke: a shrink builds
    /// the survivors' communicator from it without the parent's channels.
    pub(crate) built: OnceLock<(Arc<Ctx>, Arc<tcp::Endpoint>)>,
    /// Reconfiguration bookkeeping (revoke, shrink, grow): `recovery.rs`.
    pub(crate) reconf: crate::resilience::recovery::Reconf,
}

/// One rank's handle on a communicator. Dropping it destroys it.
pub struct Communicator {
    pub(crate) s: Arc<CommShared>,
}

impl std::fmt::Debug for Communicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Communicator")
            .field("id", &self.s.label)
            .field("rank", &self.s.rank)
            .field("nranks", &self.s.nranks)
            .field("state", &self.s.state.get())
            .finish()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn since_epoch(t: SystemTime) -> String {
    let d = t.duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default();
    format!("unix time {}.{:03}", d.as_secs(), d.subsec_millis())
}

impl CommShared {
    pub(crate) fn new(label: String, rank: usize, nranks: usize, cfg: Config) -> Arc<CommShared> {
        let s = Arc::new(CommShared {
            label,
            rank,
            nranks,
            cfg,
            state: StateCell::new(CommState::Initializing),
            resources: Mutex::new(None),
            flusher: Default::default(),
            fault: OnceLock::new(),
            async_err: Mutex::new(None),
            cancel: AtomicBool::new(false),
            worker: Mutex::new(None),
            ended_at: Mutex::new(None),
            obs_seq: Default::default(),
            me: OnceLock::new(),
            dev: Mutex::new(Default::default()),
            device_word: OnceLock::new(),
            built: OnceLock::new(),
            reconf: Default::default(),
        });
        let _ = s.me.set(Arc::downgrade(&s));
        s
    }

    pub(crate) fn state_error(&self, state: CommState, what: &'static str) -> Error {
        match state {
            CommState::Destroyed => Error::InvalidUsage(format!(
                "communicator {} (rank {}) was destroyed{}; {what} is not allowed on a destroyed communicator",
                self.label,
                self.rank,
                lock(&self.ended_at)
                    .map(|t| format!(" at {}", since_epoch(t)))
                    .unwrap_or_default()
            )),
            // As NCCL: every later call returns the error that broke the
            // communicator (ncclRemoteError for a dead peer), not a usage error.
            CommState::Failed => match lock(&self.async_err).as_ref() {
                Some(e) => e.clone(),
                None => Error::InvalidUsage(format!(
                    "communicator {} (rank {}) has failed; {what} is not allowed: abort or destroy it",
                    self.label, self.rank
                )),
            },
            _ => Error::InvalidState {
                comm: self.label.clone(),
                rank: self.rank,
                state,
                what,
            },
        }
    }

    /// Installs the result of a bootstrap (init or split).
    fn finish_init(&self, r: Result<Resources>) {
        let mut g = lock(&self.resources);
        match r {
            Ok(core) => {
                let fault = core.fault.clone();
                if self
                    .state
                    .transition_from(&[CommState::Initializing], CommState::Ready)
                {
                    let _ = self.fault.set(fault);
                    let _ = self.built.set((core.ctx.clone(), core.endpoint.clone()));
                    *g = Some(core);
                    self.observe_ready();
                }
                // Else it was aborted or destroyed meanwhile: dropping `core` releases it.
            }
            Err(e) => {
                crate::log::warn_log!("comm {} rank {}: init failed: {e}", self.label, self.rank);
                crate::observe::comm(|| crate::observe::CommEvent::Failed {
                    comm_id: self.label.clone(),
                    rank: self.rank,
                    error: e.to_string(),
                });
                lock(&self.async_err).get_or_insert(e);
                self.state
                    .transition_from(&[CommState::Initializing], CommState::Failed);
            }
        }
    }

    fn observe_ready(&self) {
        // The abort handle is weak: a sidecar's registry never keeps a communicator alive.
        crate::observe::comm(|| crate::observe::CommEvent::Ready {
            comm_id: self.label.clone(),
            rank: self.rank,
            nranks: self.nranks,
            handle: crate::observe::AbortHandle(self.me.get().cloned().unwrap_or_default() as _),
        });
    }

    /// The observer's view of this communicator (see `observe.rs`).
    pub(crate) fn who(&self) -> crate::observe::Who<'_> {
        crate::observe::Who {
            comm_id: &self.label,
            rank: self.rank,
            nranks: self.nranks,
            seq: &self.obs_seq,
        }
    }

    /// Looks for a failure no operation of ours is waiting to see: a local
    /// peer whose process is gone (raised here, as the host path would, so
    /// the other local peers learn too), or a failure a peer raised. Records
    /// it (the communicator becomes Failed) and fires the device abort word,
    /// so kernels waiting on that peer return. Never waits on a lock an
    /// operation may hold: `ncclCommGetAsyncError` and the device watch call it.
    pub(crate) fn fault(&self) -> Option<&Arc<Fault>> {
        self.fault.get()
    }

    pub(crate) fn device_word(&self) -> Option<&Arc<AbortWord>> {
        self.device_word.get()
    }

    pub(crate) fn set_async_error(&self, e: Error) {
        lock(&self.async_err).get_or_insert(e);
    }

    pub(crate) fn poll_peers(&self) -> Result<()> {
        let Some(f) = self.fault.get() else {
            return Ok(());
        };
        if let Some((rank, pid)) = f.dead_local() {
            f.raise(
                crate::transport::shm::FAIL_ERROR,
                &format!(
                    "rank {rank} (pid {pid}, this host) exited without destroying its communicator"
                ),
            );
        }
        // A kernel's wait made no progress for WEFT_TIMEOUT_MS (a frozen or
        // lost peer): raised as a failure, so every peer learns too.
        if let Some(site) = self.device_word.get().and_then(|w| w.stalled()) {
            f.raise(
                crate::transport::shm::FAIL_ERROR,
                &format!(
                    "no progress for {} ms on the GPU (WEFT_TIMEOUT_MS): rank {} on {} waits for {site}",
                    self.cfg.timeout.map_or(0, |t| t.as_millis()),
                    self.rank,
                    crate::log::host(),
                ),
            );
        }
        let Some(r) = f.check() else {
            return Ok(());
        };
        if let Some(w) = self.device_word.get() {
            w.fire();
        }
        // A failure raised here names its cause in the reason.
        let e = if r.abort {
            Error::Aborted {
                comm: self.label.clone(),
                rank: self.rank,
                by: Some(r.origin),
            }
        } else {
            Error::Remote {
                comm: self.label.clone(),
                rank: self.rank,
                detail: if r.origin == self.rank {
                    r.reason
                } else {
                    format!("rank {} reported a failure: {}", r.origin, r.reason)
                },
            }
        };
        self.record_failure(&e);
        Err(e)
    }
}

/// One look of the device watch (`watch.rs`).
impl Watched for CommShared {
    fn watch_tick(&self) -> bool {
        let Some(word) = self.device_word.get() else {
            return false;
        };
        match self.state.get() {
            CommState::Ready => {
                if self.poll_peers().is_err() {
                    word.fire();
                    return false;
                }
                true
            }
            CommState::Initializing => true,
            // Failed by an operation that saw the failure on the host:
            // kernels still waiting on that peer must return too.
            CommState::Failed | CommState::Aborted => {
                word.fire();
                false
            }
            CommState::Destroyed => false,
        }
    }
}

impl CommShared {
    /// Watches the device side once it exists (see `watch.rs`).
    fn watch_device(self: &Arc<Self>, word: Arc<AbortWord>) {
        // Kernels report waits without progress for this long (0: never).
        word.set_timeout(self.cfg.timeout);
        if self.device_word.set(word).is_ok() {
            let me = Arc::downgrade(self);
            watch::register(me);
        }
    }

    /// Records a failure of an operation as the async error (and the
    /// communicator Failed) when it breaks the communicator.
    pub(crate) fn record_failure(&self, e: &Error) {
        if matches!(
            e.kind(),
            ErrorKind::RemoteError | ErrorKind::Internal | ErrorKind::SystemError
        ) {
            lock(&self.async_err).get_or_insert_with(|| e.clone());
            if self
                .state
                .transition_from(&[CommState::Ready], CommState::Failed)
            {
                crate::observe::comm(|| crate::observe::CommEvent::Failed {
                    comm_id: self.label.clone(),
                    rank: self.rank,
                    error: e.to_string(),
                });
            }
        }
    }

    pub(crate) fn cancelled(&self) -> Option<Error> {
        self.cancel.load(Ordering::Acquire).then(|| Error::Aborted {
            comm: self.label.clone(),
            rank: self.rank,
            by: Some(self.rank),
        })
    }

    pub(crate) fn run_or_spawn(
        self: &Arc<Self>,
        blocking: bool,
        work: impl FnOnce(&Arc<CommShared>) -> Result<Resources> + Send + 'static,
    ) -> Result<()> {
        if blocking {
            let r = work(self);
            self.finish_init(r);
            return Ok(());
        }
        let s = self.clone();
        let h = std::thread::Builder::new()
            .name(format!("weft-init-{}", self.rank))
            .spawn(move || {
                let r = work(&s);
                s.finish_init(r);
            })
            .map_err(|e| Error::sys("spawning the init thread", e))?;
        *lock(&self.worker) = Some(h);
        Ok(())
    }

    fn join_worker(&self) {
        let h = lock(&self.worker).take();
        if let Some(h) = h
            && h.thread().id() != std::thread::current().id()
        {
            let _ = h.join();
        }
    }
}

fn check_rank_args(nranks: usize, rank: usize) -> Result<()> {
    if nranks == 0 {
        return Err(Error::arg("nranks must be at least 1"));
    }
    if nranks > (1 << 20) {
        return Err(Error::arg(format!(
            "nranks {nranks} is larger than Weft supports (1048576)"
        )));
    }
    if rank >= nranks {
        return Err(Error::arg(format!(
            "rank {rank} is out of range for {nranks} ranks (valid: 0..={})",
            nranks - 1
        )));
    }
    Ok(())
}

impl Communicator {
    /// Blocking init with configuration from the environment (NCCL's `ncclCommInitRank`).
    pub fn init(id: &UniqueId, nranks: usize, rank: usize) -> Result<Communicator> {
        Self::init_with_config(id, nranks, rank, Config::from_env()?)
    }

    /// Init with an explicit configuration; with `cfg.blocking == false` it
    /// returns at once in state `Initializing` (poll [`state`](Self::state),
    /// [`wait_ready`](Self::wait_ready) or [`async_error`](Self::async_error)).
    pub fn init_with_config(
        id: &UniqueId,
        nranks: usize,
        rank: usize,
        cfg: Config,
    ) -> Result<Communicator> {
        // A misspelt WEFT_* variable is named once per process (C ABI programs too).
        weft_contract::params::warn_unknown_once();
        check_rank_args(nranks, rank)?;
        let label = cfg.name.clone().unwrap_or_else(|| hex(&id.nonce[..4]));
        let s = CommShared::new(label, rank, nranks, cfg.clone());
        let id = id.clone();
        let blocking = cfg.blocking;
        s.run_or_spawn(blocking, move |s| bootstrap(s, &id))?;
        let c = Communicator { s };
        if blocking {
            c.wait_ready(None)?;
        }
        Ok(c)
    }

    /// Non-blocking init: returns at once; the communicator becomes Ready (or Failed) later.
    pub fn init_nonblocking(
        id: &UniqueId,
        nranks: usize,
        rank: usize,
        cfg: Config,
    ) -> Result<Communicator> {
        Self::init_with_config(id, nranks, rank, cfg.blocking(false))
    }

    /// Init from the launcher's environment (`weft run`, the operator, torchrun-style):
    /// rank from `WEFT_RANK`/`RANK`, size from `WEFT_WORLD_SIZE`/`WORLD_SIZE`, id from
    /// `WEFT_BOOTSTRAP`/`NCCL_COMM_ID` and the job secret.
    pub fn from_env() -> Result<Communicator> {
        use weft_contract::env::{EnvError, RankId, names};
        let id = RankId::from_env().map_err(|e| match e {
            EnvError::Missing { name, or: Some(b) } => Error::arg(format!(
                "{name} (or {b}) is not set: start ranks with `weft run -n N -- ...`"
            )),
            EnvError::Missing { name, or: None } => Error::arg(format!("{name} is not set")),
            // Named by its WEFT_* variable even when read from RANK/WORLD_SIZE.
            EnvError::Bad(e) => {
                let a = match e.name {
                    names::RANK => names::WEFT_RANK,
                    names::WORLD_SIZE => names::WEFT_WORLD_SIZE,
                    a => a,
                };
                Error::arg(format!("{a}={} is not a number", e.value))
            }
        })?;
        Self::init(&UniqueId::from_env()?, id.world_size, id.rank)
    }

    /// `n` ranks in this process, one communicator each (NCCL's `ncclCommInitAll`).
    pub fn init_all(n: usize) -> Result<Vec<Communicator>> {
        check_rank_args(n, 0)?;
        let id = UniqueId::new()?;
        let cfg = Config::from_env()?;
        // Blocking communicators (as NCCL's CommInitAll makes), initialised concurrently.
        let comms: Vec<Result<Communicator>> = std::thread::scope(|sc| {
            let hs: Vec<_> = (0..n)
                .map(|r| {
                    let (id, cfg) = (&id, cfg.clone());
                    sc.spawn(move || Self::init_with_config(id, n, r, cfg))
                })
                .collect();
            hs.into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err(Error::Internal("init thread panicked".into())))
                })
                .collect()
        });
        let comms: Vec<Communicator> = comms.into_iter().collect::<Result<_>>()?;
        Ok(comms)
    }

    pub fn rank(&self) -> usize {
        self.s.rank
    }

    pub fn count(&self) -> usize {
        self.s.nranks
    }

    /// A short identifier shown in errors and logs.
    pub fn id(&self) -> &str {
        &self.s.label
    }

    pub fn state(&self) -> CommState {
        self.s.state.get()
    }

    pub fn config(&self) -> &Config {
        &self.s.cfg
    }

    /// Waits until init finished; returns its error if it failed.
    /// With a timeout that expires first: `Err(Error::InProgress)`.
    pub fn wait_ready(&self, timeout: Option<Duration>) -> Result<()> {
        match self.s.state.wait_settled(timeout) {
            CommState::Ready => Ok(()),
            CommState::Initializing => Err(Error::InProgress),
            CommState::Failed => Err(lock(&self.s.async_err)
                .clone()
                .unwrap_or_else(|| self.s.state_error(CommState::Failed, "waiting"))),
            st => Err(self.s.state_error(st, "waiting for init")),
        }
    }

    /// NCCL's `ncclCommGetAsyncError`: `Ok` while healthy, `Err(InProgress)` while
    /// initializing, otherwise the error that broke the communicator. Also
    /// notices failures raised by peers while this rank is idle.
    pub fn async_error(&self) -> Result<()> {
        if let Some(r) = self.s.reconf.revoke_status() {
            return r;
        }
        match self.s.state.get() {
            CommState::Initializing => Err(Error::InProgress),
            CommState::Ready => {
                // try_lock: an operation may hold the slot while its
                // kernels spin; this query must never wait for them.
                if let Ok(slot) = self.s.dev.try_lock()
                    && let DeviceSlot::On(dc) = &*slot
                    && let Some(e) = dc.kernel_error()
                {
                    return Err(Error::InvalidUsage(format!(
                        "{}: an operation failed on the GPU: {e}",
                        self.describe()
                    )));
                }
                self.s.poll_peers()?;
                Ok(())
            }
            CommState::Failed => Err(lock(&self.s.async_err)
                .clone()
                .unwrap_or_else(|| self.s.state_error(CommState::Failed, "query"))),
            CommState::Aborted => Err(Error::Aborted {
                comm: self.s.label.clone(),
                rank: self.s.rank,
                by: Some(self.s.rank),
            }),
            CommState::Destroyed => Err(self
                .s
                .state_error(CommState::Destroyed, "querying the async error")),
        }
    }

    fn record_failure(&self, e: &Error) {
        self.s.record_failure(e)
    }

    /// Runs `f` on the live core, serialized with every other call on this communicator.
    pub(crate) fn with_resources<R>(
        &self,
        what: &'static str,
        f: impl FnOnce(&mut Resources) -> Result<R>,
    ) -> Result<R> {
        let st = self.s.state.get();
        if st != CommState::Ready {
            return Err(self.s.state_error(st, what));
        }
        let mut g = lock(&self.s.resources);
        let st = self.s.state.get();
        let core = match g.as_mut() {
            Some(c) if st == CommState::Ready => c,
            _ => return Err(self.s.state_error(st, what)),
        };
        let r = f(core);
        if let Err(e) = &r {
            self.record_failure(e);
        }
        r
    }

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
    /// `recovery.rs`). Every rank must call it, as any split.
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
            algo::all_gather(core, mine.as_ptr(), all.as_mut_ptr(), 16, a)?;
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
            Ok(Some((
                id,
                new_rank,
                peers,
                core.ctx.secret,
                core.endpoint.clone(),
            )))
        })?;
        let Some((id, rank, peers, secret, endpoint)) = plan else {
            return Ok(None);
        };
        let label = cfg.name.clone().unwrap_or_else(|| hex(&id[..4]));
        let nranks = peers.len();
        let s = CommShared::new(label.clone(), rank, nranks, cfg.clone());
        let blocking = cfg.blocking;
        s.run_or_spawn(blocking, move |s| {
            let ctx = Arc::new(Ctx {
                id,
                label,
                rank,
                nranks,
                secret,
                peers,
                cfg: s.cfg.clone(),
                job: job_label(),
            });
            Resources::build(
                ctx,
                endpoint,
                crate::progress::resources::default_deadline(&s.cfg),
            )
        })?;
        let c = Communicator { s };
        if blocking {
            c.wait_ready(None)?;
        }
        Ok(Some(c))
    }

    /// Aborts: pending and future calls on this communicator fail here and on
    /// every other rank of it (they see `Error::Aborted`), resources are
    /// released. Idempotent; afterwards only `destroy` is allowed.
    pub fn abort(&self) -> Result<()> {
        abort_shared(&self.s, &format!("rank {} called abort", self.s.rank))
    }

    /// Destroys: waits for an operation in flight on another thread, releases
    /// everything. A second destroy is an error (`AlreadyDestroyed`), never UB.
    pub fn destroy(&self) -> Result<()> {
        let from = self.s.state.get();
        if from == CommState::Destroyed {
            return Err(Error::AlreadyDestroyed {
                comm: self.s.label.clone(),
                rank: self.s.rank,
            });
        }
        if from == CommState::Initializing {
            self.s.cancel.store(true, Ordering::Release);
            self.s.join_worker();
        }
        // Eager host sends still pending are delivered first (bounded: see
        // eager.rs); the flusher thread ends before the resources go.
        self.s.flusher.stop();
        let flushed = match lock(&self.s.resources).as_mut() {
            Some(c) if from == CommState::Ready && !c.eager.is_empty() => {
                let bound = Some(c.ctx.cfg.timeout.unwrap_or(c.ctx.cfg.peer_timeout));
                c.flush_eager(bound).map_err(|e| {
                    let e = c.eager_error("destroying the communicator", &e);
                    crate::log::warn_log!("comm {} rank {}: {e}", self.s.label, self.s.rank);
                    e
                })
            }
            _ => Ok(()),
        };
        let core = lock(&self.s.resources).take();
        if !self.s.state.transition_from(
            &[
                CommState::Initializing,
                CommState::Ready,
                CommState::Failed,
                CommState::Aborted,
            ],
            CommState::Destroyed,
        ) {
            return Err(Error::AlreadyDestroyed {
                comm: self.s.label.clone(),
                rank: self.s.rank,
            });
        }
        *lock(&self.s.ended_at) = Some(SystemTime::now());
        drop(core);
        // The device side goes after the stream work that uses it; an aborted
        // one stays (a peer's kernel may still touch it).
        let dev = std::mem::take(&mut *lock(&self.s.dev));
        let dev_result = match dev {
            DeviceSlot::On(dc) if from != CommState::Aborted => dc.finalize().map_err(|e| {
                Error::Cuda(format!(
                    "releasing the device side of communicator {} (rank {}): {e}",
                    self.s.label, self.s.rank
                ))
            }),
            _ => Ok(()),
        };
        crate::observe::comm(|| crate::observe::CommEvent::Destroyed {
            comm_id: self.s.label.clone(),
            rank: self.s.rank,
        });
        flushed.and(dev_result)
    }

    /// "communicator <id> (rank r of n)", for messages.
    pub fn describe(&self) -> String {
        format!(
            "communicator {} (rank {} of {})",
            self.s.label, self.s.rank, self.s.nranks
        )
    }

    /// The CUDA device of this rank's device side (set up by its first
    /// operation on device memory), if any.
    pub fn cuda_device(&self) -> Option<i32> {
        lock(&self.s.dev).device()
    }
}

impl Drop for Communicator {
    fn drop(&mut self) {
        if self.s.state.get() != CommState::Destroyed {
            let _ = self.destroy();
        }
    }
}

/// Abort with a reason (the observer's handle gives the sidecar's reason).
pub(crate) fn abort_shared(s: &CommShared, reason: &str) -> Result<()> {
    let from = s.state.get();
    match from {
        CommState::Destroyed => return Err(s.state_error(from, "abort")),
        CommState::Aborted => return Ok(()),
        _ => {}
    }
    s.cancel.store(true, Ordering::Release);
    if !s.state.transition_from(
        &[CommState::Initializing, CommState::Ready, CommState::Failed],
        CommState::Aborted,
    ) {
        return match s.state.get() {
            CommState::Aborted => Ok(()),
            st => Err(s.state_error(st, "abort")),
        };
    }
    *lock(&s.ended_at) = Some(SystemTime::now());
    // Kernels of ours spinning on peers return (their stream completes).
    // Through the word when there is one: an operation may hold `dev`.
    match s.device_word.get() {
        Some(w) => {
            w.fire();
        }
        None => {
            if let DeviceSlot::On(dc) = &*lock(&s.dev) {
                dc.abort();
            }
        }
    }
    // Lock-free: wake everyone, including a collective of ours blocked in another thread.
    if let Some(f) = s.fault.get() {
        f.raise(FAIL_ABORT, reason);
    }
    s.join_worker();
    // Pending eager sends are dropped with the resources, after their
    // flusher thread ended.
    s.flusher.stop();
    let core = lock(&s.resources).take();
    drop(core);
    crate::observe::comm(|| crate::observe::CommEvent::Aborted {
        comm_id: s.label.clone(),
        rank: s.rank,
    });
    Ok(())
}

/// The eager-send flusher's view of its communicator.
impl flusher::Owner for CommShared {
    fn flusher(&self) -> &Flusher {
        &self.flusher
    }
    fn ready(&self) -> bool {
        self.state.get() == CommState::Ready
    }
    fn resources(&self) -> &Mutex<Option<Resources>> {
        &self.resources
    }
    fn record_failure(&self, e: &Error) {
        CommShared::record_failure(self, e)
    }
    fn who(&self) -> (&str, usize) {
        (&self.label, self.rank)
    }
}

/// The observer's abort handle pulls these.
impl crate::observe::Lever for CommShared {
    fn abort(&self, reason: &str) {
        let _ = abort_shared(self, reason);
    }
    fn fail(&self, reason: &str) {
        fail_shared(self, reason)
    }
}

/// Raises a failure with a reason (the observer's handle: lost host, dead rank).
pub(crate) fn fail_shared(s: &CommShared, reason: &str) {
    match s.fault.get() {
        Some(f) => f.raise(crate::transport::shm::FAIL_ERROR, reason),
        None => {
            let _ = abort_shared(s, reason);
        }
    }
}

/// Bootstrap of a new communicator from a unique id.
pub(crate) fn bootstrap(s: &Arc<CommShared>, id: &UniqueId) -> Result<Resources> {
    let deadline = Instant::now() + s.cfg.init_timeout;
    if id.rank0_serves && s.rank == 0 {
        root::serve_at(id, s.nranks)?;
    }
    let ep = tcp::endpoint()?;
    // Peers of this communicator may connect before it is built here:
    // their MAC is checked against this secret before anything is kept.
    ep.trust(id.secret);
    let bind_ip = tcp::bind_ip(id.root, id.root_named);
    let port = ep.listen_for(bind_ip)?;
    let hostname = s
        .cfg
        .hostname
        .clone()
        .unwrap_or_else(crate::sys::topology::system_hostname);
    let me = PeerInfo {
        host_id: crate::sys::topology::host_id(s.cfg.hostname.as_deref()),
        pid: std::process::id(),
        addr: SocketAddr::new(bind_ip, port),
        hostname,
        proxied: crate::transport::sidecar_link::would_proxy(&s.cfg),
    };
    let (comm_id, peers) =
        client::rendezvous(id, s.rank, s.nranks, me, deadline, &|| s.cancelled())?;
    let ctx = Arc::new(Ctx {
        id: comm_id,
        label: s.label.clone(),
        rank: s.rank,
        nranks: s.nranks,
        secret: id.secret,
        peers,
        cfg: s.cfg.clone(),
        job: job_label(),
    });
    Resources::build(ctx, ep, deadline)
}

/// The one entry point of operations (the typed methods below, groups and
/// the C ABI all come here): validate, check the state, pick the backend by
/// the operation's memory kind.
impl Communicator {
    /// Checks an operation's arguments against this communicator, without running it.
    pub(crate) fn validate(&self, op: &Op) -> Result<()> {
        op.validate(self.s.rank, self.s.nranks)
    }

    /// What every operation passes before a backend sees it: valid
    /// arguments, then a Ready communicator.
    fn admit(&self, op: &Op) -> Result<()> {
        self.validate(op)?;
        let st = self.s.state.get();
        if st != CommState::Ready {
            return Err(self.s.state_error(st, op.name()));
        }
        Ok(())
    }

    /// Validates, then runs one operation: host memory on the host
    /// algorithms (blocking), device memory on the device backend (enqueued
    /// on the operation's stream, like NCCL).
    ///
    /// # Safety
    /// The operation's pointers must be valid for the sizes it names (until
    /// its stream reaches it, for device memory).
    pub unsafe fn submit(&self, op: Op) -> Result<()> {
        if op.memory != Memory::Host {
            return unsafe { run_device(&[(self, op)]) };
        }
        self.admit(&op)?;
        if op.is_empty() {
            return Ok(());
        }
        // Under the resources' lock: a thread that saw the state turn Ready
        // waits here until init has installed them, so every rank decides
        // on the same shape.
        let shape = lock(&self.s.resources)
            .as_ref()
            .map_or(tuner::Shape::ranks(self.s.nranks), |c| c.shape());
        let d = tuner::decide(&op, &shape, &self.s.cfg.algo);
        let obs = crate::observe::start(&self.s.who(), std::slice::from_ref(&op), false, d.name());
        let r = if op.kind == OpKind::Send {
            // Eager: returns once the message is in the peer's ring or
            // copied (eager.rs).
            let x = crate::progress::xfer::Xfer::send(op.peer(), op.send, op.bytes());
            self.with_resources(op.name(), |c| {
                c.coll_seq += 1;
                c.send_eager(vec![x])
            })
            .map(|pending| self.kick_if(pending))
        } else {
            self.with_resources(op.name(), |c| unsafe { run_op(c, &op, d) })
        };
        crate::observe::finish(obs, &r);
        r
    }

    /// Wakes the eager-send flusher when sends are pending.
    pub(crate) fn kick_if(&self, pending: bool) {
        if pending && let Some(me) = self.s.me.get().and_then(|w| w.upgrade()) {
            self.s.flusher.kick(&me);
        }
    }

    /// Waits until every send that returned early (eager host sends, see
    /// [`send`](Self::send)) is in its peer's ring, bounded by the
    /// configured timeout like any operation. Destroy does this itself.
    pub fn flush(&self) -> Result<()> {
        self.with_resources("flush", |c| {
            let t = c.ctx.cfg.timeout;
            c.flush_eager(t)
                .map_err(|e| c.eager_error("flushing eager sends", &e))
        })
    }
}

/// Runs a validated host-memory operation on the live resources, with the
/// tuner's decision for it.
pub(crate) unsafe fn run_op(c: &mut Resources, op: &Op, d: Decision) -> Result<()> {
    use crate::progress::xfer::Xfer;
    c.coll_seq += 1;
    let (send, recv, count, dtype, root, a) =
        (op.send, op.recv, op.count, op.dtype, op.root, d.algo());
    let bytes = op.bytes();
    let redop = || op.redop.expect("a reduction carries its operator");
    match op.kind {
        OpKind::AllReduce => algo::all_reduce(c, send, recv, count, dtype, redop(), a),
        OpKind::Broadcast => algo::broadcast(c, send, recv, bytes, root, a),
        OpKind::Reduce => algo::reduce(c, send, recv, count, dtype, redop(), root, a),
        OpKind::AllGather => algo::all_gather(c, send, recv, bytes, a),
        OpKind::ReduceScatter => algo::reduce_scatter(c, send, recv, count, dtype, redop(), a),
        OpKind::AllToAll => algo::all_to_all(c, send, recv, bytes, a),
        OpKind::Gather => algo::gather(c, send, recv, bytes, root),
        OpKind::Scatter => algo::scatter(c, send, recv, bytes, root),
        OpKind::Send => c.exec(&mut [Xfer::send(root, send, bytes)]),
        OpKind::Recv => c.exec(&mut [Xfer::recv(root, recv, bytes)]),
    }
}

/// The backend for device memory: the one place the core names `cuda/`
/// (which never imports this module back).
fn device_backend() -> &'static dyn Backend {
    &crate::cuda::CudaBackend
}

/// Runs a batch holding device-memory operations (one call, or a group's
/// operations, host memory included) on the device backend, after the
/// checks of every operation.
///
/// # Safety
/// As [`Backend::run`].
pub(crate) unsafe fn run_device(ops: &[(&Communicator, Op)]) -> Result<()> {
    for (c, op) in ops {
        c.admit(op)?;
        if let DeviceSlot::On(dc) = &*lock(&c.s.dev)
            && let Some(e) = dc.kernel_error()
        {
            return Err(Error::InvalidUsage(format!(
                "{}: an earlier operation failed on the GPU: {e}",
                c.describe()
            )));
        }
    }
    let mut lent = Lent { comms: Vec::new() };
    let mut items = Vec::with_capacity(ops.len());
    for (c, op) in ops {
        let i = match lent.comms.iter().position(|x| std::ptr::eq(*x, *c)) {
            Some(i) => i,
            None => {
                lent.comms.push(c);
                lent.comms.len() - 1
            }
        };
        items.push(Item { comm: i, op: *op });
    }
    let r = unsafe { device_backend().run(&lent, &items) };
    for c in &lent.comms {
        if c.s.device_word.get().is_none() {
            let word = match &*lock(&c.s.dev) {
                DeviceSlot::On(dc) => Some(dc.abort_word()),
                _ => None,
            };
            if let Some(w) = word {
                c.s.watch_device(w);
            }
        }
    }
    r
}

/// The communicators of one batch, as a backend sees them ([`Comms`]).
struct Lent<'a> {
    comms: Vec<&'a Communicator>,
}

impl Comms for Lent<'_> {
    fn rank(&self, c: usize) -> usize {
        self.comms[c].s.rank
    }

    fn nranks(&self, c: usize) -> usize {
        self.comms[c].s.nranks
    }

    fn describe(&self, c: usize) -> String {
        self.comms[c].describe()
    }

    fn device_slot(&self, c: usize) -> MutexGuard<'_, DeviceSlot> {
        lock(&self.comms[c].s.dev)
    }

    unsafe fn run_host(&self, items: &[Item]) -> Result<()> {
        let mut g = Group::new();
        for it in items {
            debug_assert_eq!(it.op.memory, Memory::Host);
            unsafe { g.push(self.comms[it.comm], it.op) }?;
        }
        g.execute()
    }

    fn observed(
        &self,
        c: usize,
        ops: &[Op],
        group: bool,
        decision: Decision,
        f: &mut dyn FnMut() -> Result<()>,
    ) -> Result<()> {
        let obs = crate::observe::start(&self.comms[c].s.who(), ops, group, decision.name());
        let r = f();
        crate::observe::finish(obs, &r);
        r
    }
}

/// Typed, safe collectives on slices: the descriptors (and their length
/// checks) come from [`typed`], shared with [`Group`]'s typed methods.
impl Communicator {
    /// Runs a descriptor built by [`typed`] from the caller's slices.
    fn submit_typed(&self, op: Result<Op>) -> Result<()> {
        // SAFETY: the descriptor points into slices the caller borrows (the
        // written ones mutably) for this whole call, and a host-memory
        // operation has ended when `submit` returns.
        unsafe { self.submit(op?) }
    }

    pub fn all_reduce<T: Element>(&self, send: &[T], recv: &mut [T], op: ReduceOp) -> Result<()> {
        self.submit_typed(typed::all_reduce(send, recv, op))
    }

    pub fn all_reduce_in_place<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        self.submit_typed(typed::all_reduce_in_place(buf, op))
    }

    /// `send` is read on the root only (others may pass an empty slice).
    pub fn broadcast<T: Element>(&self, send: &[T], recv: &mut [T], root: usize) -> Result<()> {
        self.submit_typed(typed::broadcast(send, recv, root, self.s.rank))
    }

    pub fn broadcast_in_place<T: Element>(&self, buf: &mut [T], root: usize) -> Result<()> {
        self.submit_typed(typed::broadcast_in_place(buf, root))
    }

    /// `recv` is written on the root only (others may pass an empty slice).
    pub fn reduce<T: Element>(
        &self,
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
        root: usize,
    ) -> Result<()> {
        self.submit_typed(typed::reduce(send, recv, op, root, self.s.rank))
    }

    pub fn reduce_in_place<T: Element>(
        &self,
        buf: &mut [T],
        op: ReduceOp,
        root: usize,
    ) -> Result<()> {
        self.submit_typed(typed::reduce_in_place(buf, op, root))
    }

    /// `recv.len() == send.len() * count()`.
    pub fn all_gather<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        self.submit_typed(typed::all_gather(send, recv, self.s.nranks))
    }

    /// This rank's block is at `buf[rank * n .. (rank + 1) * n]`, `n = buf.len() / count()`.
    pub fn all_gather_in_place<T: Element>(&self, buf: &mut [T]) -> Result<()> {
        self.submit_typed(typed::all_gather_in_place(buf, self.s.rank, self.s.nranks))
    }

    /// `send.len() == recv.len() * count()`.
    pub fn reduce_scatter<T: Element>(
        &self,
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        self.submit_typed(typed::reduce_scatter(send, recv, op, self.s.nranks))
    }

    /// The result lands in `buf[rank * n .. (rank + 1) * n]`, `n = buf.len() / count()`.
    pub fn reduce_scatter_in_place<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        let (rank, n) = (self.s.rank, self.s.nranks);
        self.submit_typed(typed::reduce_scatter_in_place(buf, op, rank, n))
    }

    /// Block p (of `len / count()` elements) of `send` goes to rank p.
    pub fn all_to_all<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        self.submit_typed(typed::all_to_all(send, recv, self.s.nranks))
    }

    pub fn all_to_all_in_place<T: Element>(&self, buf: &mut [T]) -> Result<()> {
        self.submit_typed(typed::all_to_all_in_place(buf, self.s.nranks))
    }

    /// Sends `buf` to `peer`. Eager: it returns once the message is in the
    /// peer's ring or copied into a buffer of the communicator, without
    /// waiting for the peer's receive (up to `WEFT_EAGER_MAX_BYTES` held per
    /// communicator; see [`flush`](Self::flush)), so `send(next);
    /// recv(prev)` on every rank of a ring completes at any size.
    pub fn send<T: Element>(&self, buf: &[T], peer: usize) -> Result<()> {
        self.submit_typed(typed::send(buf, peer))
    }

    pub fn recv<T: Element>(&self, buf: &mut [T], peer: usize) -> Result<()> {
        self.submit_typed(typed::recv(buf, peer))
    }
}
