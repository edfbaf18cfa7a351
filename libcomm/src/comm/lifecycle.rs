//! A communicator's lifecycle: init (from a unique id, from the launcher's
//! environment, or every rank in this process), the wait for init and the
//! async error, abort and destroy. Every new communicator, a child's too
//! (`split.rs`), starts through [`Communicator::start`].

use crate::bootstrap::PeerInfo;
use crate::bootstrap::ctx::{Ctx, job_label};
use crate::bootstrap::unique_id::{UniqueId, hex};
use crate::bootstrap::{client, root};
use crate::comm::communicator::Communicator;
use crate::comm::shared::{CommShared, lock};
use crate::config::Config;
use crate::error::{Error, Result};
use crate::observe::{self, CommEvent};
use crate::op::backend::DeviceSlot;
use crate::progress::resources::Resources;
use crate::state::CommState;
use crate::transport::tcp;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

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
        Self::rendezvous(id, nranks, rank, cfg)
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

    /// Tests: `n` ranks in this process on simulated hosts of `per_host`
    /// ranks each (host `sim-<r / per_host>` in each rank's configuration,
    /// so the bootstrap sees hosts as between machines), each configuration
    /// from the environment passed through `cfg` first; every one Ready.
    #[cfg(test)]
    pub(crate) fn init_on_simulated_hosts(
        n: usize,
        per_host: usize,
        cfg: impl Fn(Config) -> Config + Sync,
    ) -> Vec<Communicator> {
        Self::init_on_hosts(n, |r| r / per_host, cfg)
    }

    /// Tests: as [`init_on_simulated_hosts`](Self::init_on_simulated_hosts),
    /// rank r on host `sim-<host_of(r)>` (hosts interleaved in rank order,
    /// of different sizes).
    #[cfg(test)]
    pub(crate) fn init_on_hosts(
        n: usize,
        host_of: impl Fn(usize) -> usize + Sync,
        cfg: impl Fn(Config) -> Config + Sync,
    ) -> Vec<Communicator> {
        let id = UniqueId::new().unwrap();
        std::thread::scope(|sc| {
            let hs: Vec<_> = (0..n)
                .map(|r| {
                    let (id, cfg, host_of) = (&id, &cfg, &host_of);
                    sc.spawn(move || {
                        let mut c = Config::from_env().unwrap();
                        c.hostname = Some(format!("sim-{}", host_of(r)));
                        let comm = Self::init_with_config(id, n, r, cfg(c)).unwrap();
                        comm.wait_ready(None).unwrap();
                        comm
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    /// A new communicator from a rendezvous at the root `id` names (init,
    /// and the ranks of a grow): its name, else the id's first bytes,
    /// labels it.
    pub(crate) fn rendezvous(
        id: &UniqueId,
        nranks: usize,
        rank: usize,
        cfg: Config,
    ) -> Result<Communicator> {
        let label = cfg.name.clone().unwrap_or_else(|| hex(&id.nonce[..4]));
        let id = id.clone();
        Self::start(label, rank, nranks, cfg, move |s| bootstrap(s, &id))
    }

    /// A new communicator of `nranks` ranks, this one `rank`, whose
    /// resources `work` builds (a bootstrap, or a child's build from its
    /// parent's table of peers): on this thread when `cfg` is blocking (it
    /// returns Ready), on an init thread otherwise (it returns
    /// Initializing).
    pub(crate) fn start(
        label: String,
        rank: usize,
        nranks: usize,
        cfg: Config,
        work: impl FnOnce(&Arc<CommShared>) -> Result<Resources> + Send + 'static,
    ) -> Result<Communicator> {
        let blocking = cfg.blocking;
        let s = CommShared::new(label, rank, nranks, cfg);
        s.run_or_spawn(blocking, work)?;
        let c = Communicator { s };
        if blocking {
            c.wait_ready(None)?;
        }
        Ok(c)
    }

    /// Waits until init finished; returns its error if it failed.
    /// With a timeout that expires first: `Err(Error::InProgress)`.
    pub fn wait_ready(&self, timeout: Option<Duration>) -> Result<()> {
        match self.s.state.wait_settled(timeout) {
            CommState::Ready => Ok(()),
            CommState::Initializing => Err(Error::InProgress),
            CommState::Failed => Err(self.s.failure("waiting")),
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
            CommState::Failed => Err(self.s.failure("query")),
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

    /// Aborts: pending and future calls on this communicator fail here and on
    /// every other rank of it (they see `Error::Aborted`), resources are
    /// released. Idempotent; afterwards only `destroy` is allowed.
    pub fn abort(&self) -> Result<()> {
        self.s
            .abort_with(&format!("rank {} called abort", self.s.rank))
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
            self.s.cancel_init();
        }
        // Device work the backend runs on its own threads (across hosts:
        // the progress thread's staged operations) ends first: it runs on
        // the resources taken below.
        if let DeviceSlot::On(dc) = &*lock(&self.s.dev) {
            dc.drain();
        }
        // Then the hierarchy's communicators (their queued work runs
        // first), the cross-host engine and its host-local communicator.
        self.s.hier.close();
        self.s.cross.close();
        // Eager host sends still pending are delivered first (bounded: see
        // progress/eager.rs); the flusher thread ends before the resources go.
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
        self.s.mark_ended();
        drop(core);
        // The device side goes after the stream work that uses it; an aborted
        // one stays (a peer's kernel may still touch it).
        let dev = std::mem::take(&mut *lock(&self.s.dev));
        let dev_result = match dev {
            DeviceSlot::On(dc) if from != CommState::Aborted => {
                // It waits for the device (every stream of the context):
                // logged with its time, as a recovery's phases are.
                let t0 = std::time::Instant::now();
                let r = dc.finalize().map_err(|e| {
                    Error::Cuda(format!(
                        "releasing the device side of communicator {} (rank {}): {e}",
                        self.s.label, self.s.rank
                    ))
                });
                crate::log::info_log!(
                    "comm {} rank {}: device side released in {} ms",
                    self.s.label,
                    self.s.rank,
                    t0.elapsed().as_millis()
                );
                r
            }
            _ => Ok(()),
        };
        observe::comm(|| CommEvent::Destroyed {
            comm_id: self.s.label.clone(),
            rank: self.s.rank,
        });
        flushed.and(dev_result)
    }
}

/// Bootstrap of a new communicator from a unique id.
fn bootstrap(s: &Arc<CommShared>, id: &UniqueId) -> Result<Resources> {
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
