//! [`CommShared`]: a communicator's lifecycle record, shared by its handle
//! (`communicator.rs`), its init thread, the eager-send flusher, the device
//! watch and the observer's abort handle: identity, [`CommState`], the
//! failure cause, the device backend's [`DeviceSlot`], and the
//! [`Resources`] behind one mutex (so calls from several threads are
//! serialized). Abort and the status queries never take that mutex, so
//! they work while a collective is blocked.

use crate::bootstrap::ctx::Ctx;
use crate::comm::flusher::{self, Flusher};
use crate::comm::reconf::Reconf;
use crate::comm::watch::{self, Watched};
use crate::config::Config;
use crate::error::{Error, ErrorKind, Result};
use crate::observe::{self, AbortHandle, CommEvent, Lever, Who};
use crate::op::backend::{AbortWord, DeviceSlot};
use crate::progress::fault::Fault;
use crate::progress::resources::Resources;
use crate::state::{CommState, StateCell};
use crate::transport::shm::{FAIL_ABORT, FAIL_ERROR};
use crate::transport::tcp;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::SystemTime;

/// A communicator's lifecycle record (see the module docs).
pub(crate) struct CommShared {
    pub label: String,
    pub rank: usize,
    pub nranks: usize,
    pub cfg: Config,
    pub state: StateCell,
    pub(crate) resources: Mutex<Option<Resources>>,
    /// Pushes pending eager host sends while the communicator is idle (`flusher.rs`).
    pub(crate) flusher: Flusher,
    fault: OnceLock<Arc<Fault>>,
    async_err: Mutex<Option<Error>>,
    /// Set by abort/destroy to stop a bootstrap in progress.
    cancel: AtomicBool,
    worker: Mutex<Option<JoinHandle<()>>>,
    ended_at: Mutex<Option<SystemTime>>,
    /// Sequence numbers of operations, for the observer (`observe/`).
    pub(crate) meter: observe::Meter,
    /// The cross-host engine, when one runs this communicator's large
    /// collectives (`cross_engine.rs`).
    pub(crate) cross: super::cross_slot::Slot,
    /// The host-local and rail communicators of hierarchical device
    /// collectives across hosts (`hier.rs`).
    pub(crate) hier: super::hier_slot::Slot,
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
    /// Reconfiguration bookkeeping (revoke, shrink, grow): `reconf.rs`.
    pub(crate) reconf: Reconf,
}

pub(crate) use crate::sys::lock;

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
            meter: Default::default(),
            cross: Default::default(),
            hier: Default::default(),
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
                // What a thread woken by `Ready` reads (the host identities
                // the cross-host paths decide from, the fault word) is in
                // place before the state says so: set after it, a waiter of
                // a non-blocking init read every rank on one host and skipped
                // the engine its peers were building (they waited for ever).
                // If the transition fails (aborted or destroyed meanwhile)
                // the clones live until the communicator is dropped.
                let _ = self.fault.set(core.fault.clone());
                let _ = self.built.set((core.ctx.clone(), core.endpoint.clone()));
                if self
                    .state
                    .transition_from(&[CommState::Initializing], CommState::Ready)
                {
                    *g = Some(core);
                    self.observe_ready();
                }
                // Else it was aborted or destroyed meanwhile: dropping `core` releases it.
            }
            Err(e) => {
                crate::log::warn_log!("comm {} rank {}: init failed: {e}", self.label, self.rank);
                observe::comm(|| CommEvent::Failed {
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
        observe::comm(|| CommEvent::Ready {
            comm_id: self.label.clone(),
            rank: self.rank,
            nranks: self.nranks,
            handle: AbortHandle(self.me.get().cloned().unwrap_or_default() as _),
        });
        self.meter.attach(&self.label, self.rank);
    }

    /// Every rank's host identity, by rank, as the bootstrap exchanged them
    /// (one host before the communicator was built).
    pub(crate) fn host_ids(&self) -> Vec<u64> {
        match self.built.get() {
            Some((ctx, _)) => ctx.peers.iter().map(|p| p.host_id).collect(),
            None => vec![0; self.nranks],
        }
    }

    /// The observer's view of this communicator (see `observe/`).
    pub(crate) fn who(&self) -> Who<'_> {
        Who {
            comm_id: &self.label,
            rank: self.rank,
            nranks: self.nranks,
            meter: &self.meter,
        }
    }

    /// The failure domain, once the communicator was Ready.
    pub(crate) fn fault(&self) -> Option<&Arc<Fault>> {
        self.fault.get()
    }

    pub(crate) fn device_word(&self) -> Option<&Arc<AbortWord>> {
        self.device_word.get()
    }

    pub(crate) fn set_async_error(&self, e: Error) {
        lock(&self.async_err).get_or_insert(e);
    }

    /// Looks for a failure no operation of ours is waiting to see: a local
    /// peer whose process is gone (raised here, as the host path would, so
    /// the other local peers learn too), or a failure a peer raised. Records
    /// it (the communicator becomes Failed) and fires the device abort word,
    /// so kernels waiting on that peer return. Never waits on a lock an
    /// operation may hold: `ncclCommGetAsyncError` and the device watch call it.
    pub(crate) fn poll_peers(&self) -> Result<()> {
        let Some(f) = self.fault.get() else {
            return Ok(());
        };
        // At most once per PEER_SCAN_EVERY: the peers' processes cost
        // system calls to look at, and applications query in tight loops.
        if let Some((rank, pid)) = f.dead_local_due() {
            f.raise(
                FAIL_ERROR,
                &format!(
                    "rank {rank} (pid {pid}, this host) exited without destroying its communicator"
                ),
            );
        }
        // A kernel's wait made no progress for WEFT_TIMEOUT_MS (a frozen or
        // lost peer): raised as a failure, so every peer learns too.
        if let Some(site) = self.device_word.get().and_then(|w| w.stalled()) {
            f.raise(
                FAIL_ERROR,
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
                detail: f.describe(&r),
            }
        };
        self.record_failure(&e);
        Err(e)
    }

    /// Watches the device side once it exists (see `watch.rs`).
    pub(super) fn watch_device(self: &Arc<Self>, word: Arc<AbortWord>) {
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
                observe::comm(|| CommEvent::Failed {
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

    pub(super) fn join_worker(&self) {
        let h = lock(&self.worker).take();
        if let Some(h) = h
            && h.thread().id() != std::thread::current().id()
        {
            let _ = h.join();
        }
    }

    /// The error that broke a Failed communicator (a usage error naming
    /// `what` if none was recorded).
    pub(crate) fn failure(&self, what: &'static str) -> Error {
        lock(&self.async_err)
            .clone()
            .unwrap_or_else(|| self.state_error(CommState::Failed, what))
    }

    /// Stops a bootstrap in progress and waits for the init thread.
    pub(super) fn cancel_init(&self) {
        self.cancel.store(true, Ordering::Release);
        self.join_worker();
    }

    /// Records when the communicator ended (aborted or destroyed), for
    /// later messages.
    pub(super) fn mark_ended(&self) {
        *lock(&self.ended_at) = Some(SystemTime::now());
    }

    /// Wakes the eager-send flusher (starting it the first time).
    pub(crate) fn kick_flusher(&self) {
        if let Some(me) = self.me.get().and_then(|w| w.upgrade()) {
            self.flusher.kick(&me);
        }
    }

    /// Aborts with a reason (`Communicator::abort`, and the observer's handle
    /// with the sidecar's reason).
    pub(crate) fn abort_with(&self, reason: &str) -> Result<()> {
        let from = self.state.get();
        match from {
            CommState::Destroyed => return Err(self.state_error(from, "abort")),
            CommState::Aborted => return Ok(()),
            _ => {}
        }
        self.cancel.store(true, Ordering::Release);
        if !self.state.transition_from(
            &[CommState::Initializing, CommState::Ready, CommState::Failed],
            CommState::Aborted,
        ) {
            return match self.state.get() {
                CommState::Aborted => Ok(()),
                st => Err(self.state_error(st, "abort")),
            };
        }
        self.mark_ended();
        // Kernels of ours spinning on peers return (their stream completes).
        // Through the word when there is one: an operation may hold `dev`.
        match self.device_word.get() {
            Some(w) => {
                w.fire();
            }
            None => {
                if let DeviceSlot::On(dc) = &*lock(&self.dev) {
                    dc.abort();
                }
            }
        }
        // Lock-free: wake everyone, including a collective of ours blocked in another thread.
        if let Some(f) = self.fault.get() {
            f.raise(FAIL_ABORT, reason);
        }
        self.cross.release(
            Error::Aborted {
                comm: self.label.clone(),
                rank: self.rank,
                by: Some(self.rank),
            },
            reason,
        );
        self.hier.release(reason);
        self.join_worker();
        // Pending eager sends are dropped with the resources, after their
        // flusher thread ended.
        self.flusher.stop();
        let core = lock(&self.resources).take();
        drop(core);
        observe::comm(|| CommEvent::Aborted {
            comm_id: self.label.clone(),
            rank: self.rank,
        });
        Ok(())
    }

    /// Raises a failure with a reason (the observer's handle: lost host, dead rank).
    pub(crate) fn fail_with(&self, reason: &str) {
        self.cross.release(
            Error::Remote {
                comm: self.label.clone(),
                rank: self.rank,
                detail: reason.to_string(),
            },
            reason,
        );
        match self.fault.get() {
            Some(f) => f.raise(FAIL_ERROR, reason),
            None => {
                let _ = self.abort_with(reason);
            }
        }
        self.hier.release(reason);
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
impl Lever for CommShared {
    fn abort(&self, reason: &str) {
        let _ = self.abort_with(reason);
    }
    fn fail(&self, reason: &str) {
        self.fail_with(reason)
    }
}
