//! Eager host sends: a host-memory send returns before its peer has posted
//! the matching receive.
//!
//! Without this, `send(next); recv(prev)` issued unbatched on every rank of a
//! ring (each call blocking, as `ncclSend`/`ncclRecv` on host memory are)
//! deadlocks once a message exceeds the ring between two ranks: every rank
//! waits in its send for a peer that waits in its own send.
//!
//! How it works:
//! - **Eager sends.** A host send submitted alone (or a group whose batch on
//!   a communicator holds only sends) first progresses without waiting
//!   ([`Wait::NoSleep`]): whatever fits in the peer's ring (shared memory) or
//!   socket buffer (TCP) goes at once. Whatever is left is copied into a
//!   buffer owned by the communicator and queued as a [`Pending`] send: the
//!   transfer keeps its progress (sequence number, stream position), so it
//!   resumes exactly where it stopped, and the call returns.
//! - **Order.** Pending sends go first in every later `exec` on the
//!   communicator (receives, collectives, more sends). The engine runs
//!   transfers to one peer in one direction in list order, so per-peer order
//!   is kept; the `exec` returns when *its* transfers are done, and pending
//!   sends progress alongside (the `recv(prev)` after an eager `send(next)`
//!   pushes the send while it receives: no deadlock).
//! - **Background flusher.** A rank that sends and then makes no more calls
//!   must still deliver: a progress thread per communicator (started on the
//!   first pending send, ended by destroy or abort) pushes pending sends
//!   while the communicator is idle. It only takes the communicator's lock
//!   with `try_lock`, holds it for at most [`FLUSH_SLICE`] at a time, and
//!   sleeps on the rank's futex doorbell (shared memory) or in poll(2) (TCP)
//!   between attempts: it never busy-spins and never starves the caller (a
//!   caller's `exec` pushes pending sends itself).
//! - **Failures.** A failure while the flusher pushes (the peer exited or
//!   destroyed its communicator first, `WEFT_TIMEOUT_MS` without progress)
//!   fails the communicator: it becomes its async error (NCCL's
//!   `ncclCommGetAsyncError`), naming the peer and the bytes not delivered.
//! - **Destroy** flushes what is pending, bounded by `WEFT_TIMEOUT_MS` when
//!   set, else by `WEFT_PEER_TIMEOUT_MS` without progress, by the peer's
//!   exit or destroy, and by abort; if the flush fails, destroy still
//!   releases everything and returns an error naming the peer. **Abort**
//!   drops pending sends. [`Communicator::flush`](crate::Communicator::flush)
//!   waits for them explicitly.
//! - **Limit.** At most `WEFT_EAGER_MAX_BYTES` (default 1 GiB) of copies are
//!   held per communicator; a send that would exceed it blocks until it is in
//!   its peer's ring, as every host send did before (and may then deadlock in
//!   the unbatched ring pattern: batch such sends with a group).

use crate::comm::communicator::CommShared;
use crate::error::{Error, Result};
use crate::progress::exec::{Wait, Xfer};
use crate::progress::resources::Resources;
use crate::state::CommState;
use crate::transport::futex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, TryLockError, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The longest the flusher holds the communicator's lock at a time.
const FLUSH_SLICE: Duration = Duration::from_millis(2);
/// The longest the flusher sleeps between two looks at its pending sends.
const FLUSH_NAP: Duration = Duration::from_millis(100);

/// `WEFT_EAGER_MAX_BYTES`, read once per process.
pub(crate) fn max_bytes() -> usize {
    use std::sync::OnceLock;
    static MAX: OnceLock<usize> = OnceLock::new();
    *MAX.get_or_init(|| {
        let p = weft_contract::params::WEFT_EAGER_MAX_BYTES;
        p.get().or_else(|| p.default_value()).unwrap_or(1 << 30)
    })
}

/// A send that returned to its caller before its peer had everything.
pub(crate) struct Pending {
    pub x: Xfer,
    /// The copy `x` sends from (its first bytes, already sent, are never
    /// touched: for large messages those pages are never even allocated).
    _buf: Vec<u8>,
    /// Bytes copied (not yet sent when the call returned).
    pub bytes: usize,
}

// SAFETY: `x` points into `_buf`, which moves with it.
unsafe impl Send for Pending {}

/// A communicator's pending eager sends, in the order they were issued.
#[derive(Default)]
pub(crate) struct Queue {
    pub pending: Vec<Pending>,
    /// Sum of the pending sends' `bytes`.
    pub bytes: usize,
    /// The doorbell value read at the start of the engine's last pass (the
    /// flusher sleeps while it is unchanged).
    pub seen: u32,
}

impl Queue {
    pub fn is_empty(&self) -> bool {
        self.pending.is_empty()
    }

    /// Puts back what the engine took out, dropping the sends now done.
    pub(crate) fn put_back(&mut self, mut pre: Vec<Pending>) {
        pre.retain(|p| !p.x.p.done);
        self.bytes = pre.iter().map(|p| p.bytes).sum();
        self.pending = pre;
    }

    /// Copies what `x` has not sent yet and queues it.
    fn push(&mut self, mut x: Xfer) {
        let sent = x.p.payload.min(x.len);
        // Zeroed memory: large blocks come straight from mmap, so the pages
        // of the part already sent are never touched.
        let mut buf = vec![0u8; x.len];
        // SAFETY: the caller's buffer is valid for `x.len` bytes (the
        // submit contract) and does not overlap our fresh copy.
        unsafe {
            std::ptr::copy_nonoverlapping(x.ptr.add(sent), buf.as_mut_ptr().add(sent), x.len - sent)
        };
        x.ptr = buf.as_mut_ptr();
        let bytes = x.len - sent;
        self.bytes += bytes;
        self.pending.push(Pending {
            x,
            _buf: buf,
            bytes,
        });
    }

    /// "rank P (N bytes)" for each peer with pending sends, for messages.
    pub(crate) fn describe(&self) -> String {
        let mut per: Vec<(usize, usize)> = Vec::new();
        for p in &self.pending {
            let left = p.x.len - p.x.p.payload.min(p.x.len);
            match per.iter_mut().find(|(r, _)| *r == p.x.peer) {
                Some((_, n)) => *n += left,
                None => per.push((p.x.peer, left)),
            }
        }
        per.iter()
            .map(|(r, n)| format!("rank {r} ({n} bytes)"))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

impl Resources {
    /// Runs a batch of sends eagerly (see the module docs). Returns whether
    /// something is left pending (the caller then kicks the flusher).
    pub(crate) fn send_eager(&mut self, mut xs: Vec<Xfer>) -> Result<bool> {
        debug_assert!(xs.iter().all(|x| x.send));
        if xs.iter().any(|x| x.peer == self.ctx.rank) {
            // Sends to ourselves need their receive in the same batch: the
            // engine reports the mismatch.
            self.exec(&mut xs)?;
            return Ok(!self.eager.is_empty());
        }
        self.exec_with(&mut xs, Wait::NoSleep { until: None })?;
        let left: usize = xs
            .iter()
            .filter(|x| !x.p.done)
            .map(|x| x.len - x.p.payload.min(x.len))
            .sum();
        if left > 0 && self.eager.bytes + left > max_bytes() {
            // Over the cap: wait until this batch is in the peers' rings.
            crate::log::info_log!(
                "comm {} rank {}: {} eager bytes held, {left} more would exceed WEFT_EAGER_MAX_BYTES={}: this send blocks",
                self.ctx.label,
                self.ctx.rank,
                self.eager.bytes,
                max_bytes()
            );
            self.exec(&mut xs)?;
            return Ok(!self.eager.is_empty());
        }
        for x in xs.into_iter().filter(|x| !x.p.done) {
            self.eager.push(x);
        }
        Ok(!self.eager.is_empty())
    }

    /// Waits until every pending eager send is in its peer's ring, giving up
    /// after `timeout` without progress.
    pub(crate) fn flush_eager(&mut self, timeout: Option<Duration>) -> Result<()> {
        if self.eager.is_empty() {
            return Ok(());
        }
        self.exec_with(&mut [], Wait::All { timeout }).map(|_| ())
    }

    /// The flusher's checks while its sends make no progress: peers alive,
    /// the communicator's timeout.
    fn eager_idle_check(&self, idle: Duration) -> Result<()> {
        self.check_peers(self.eager.pending.iter().map(|p| p.x.peer))?;
        if let Some(t) = self.ctx.cfg.timeout
            && idle >= t
        {
            return Err(Error::Timeout {
                comm: self.ctx.label.clone(),
                rank: self.ctx.rank,
                after_ms: t.as_millis() as u64,
                waiting_for: format!("delivering earlier sends to {}", self.eager.describe()),
            });
        }
        Ok(())
    }

    /// The error to report when pending sends could not be delivered.
    pub(crate) fn eager_error(&self, what: &str, e: &Error) -> Error {
        Error::Remote {
            comm: self.ctx.label.clone(),
            rank: self.ctx.rank,
            detail: format!(
                "{what}: sends that had returned to the caller were never fully received by {}: {e}; \
                 check that every send has a matching receive on its peer, posted before the peer destroys its communicator",
                self.eager.describe()
            ),
        }
    }
}

/// A communicator's background progress thread (see the module docs).
#[derive(Default)]
pub(crate) struct Flusher {
    thread: Mutex<Option<JoinHandle<()>>>,
    stop: AtomicBool,
}

impl Flusher {
    /// Wakes the flusher (starting it the first time): something is pending.
    pub(crate) fn kick(&self, s: &Arc<CommShared>) {
        let mut g = self.thread.lock().unwrap_or_else(|e| e.into_inner());
        if self.stop.load(Ordering::Acquire) {
            return;
        }
        if let Some(h) = g.as_ref()
            && !h.is_finished()
        {
            h.thread().unpark();
            return;
        }
        let w = Arc::downgrade(s);
        match std::thread::Builder::new()
            .name(format!("weft-eager-{}", s.rank))
            .spawn(move || run(w))
        {
            Ok(h) => *g = Some(h),
            // Pending sends still progress in the next call on the
            // communicator, and destroy flushes them.
            Err(e) => crate::log::warn_log!(
                "comm {} rank {}: could not start the eager-send flusher thread: {e}",
                s.label,
                s.rank
            ),
        }
    }

    /// Ends the flusher (destroy, abort); later kicks start nothing.
    pub(crate) fn stop(&self) {
        self.stop.store(true, Ordering::Release);
        let h = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(h) = h {
            h.thread().unpark();
            if h.thread().id() != std::thread::current().id() {
                let _ = h.join();
            }
        }
    }

    fn stopped(&self) -> bool {
        self.stop.load(Ordering::Acquire)
    }
}

/// What the flusher does after one look at the communicator.
enum Next {
    /// Progress was made: look again at once.
    Again,
    /// Nothing pending: sleep until kicked.
    Park,
    /// The caller holds the lock (its `exec` pushes pending sends).
    Busy,
    /// Stuck on peers: sleep until the doorbell moves or a socket is ready.
    Sleep {
        fault: Arc<crate::progress::fault::Fault>,
        seen: u32,
        fds: Vec<libc::pollfd>,
        shm: bool,
    },
    Exit,
}

fn run(w: Weak<CommShared>) {
    let mut last_progress = Instant::now();
    let mut last_check = Instant::now();
    loop {
        let next = {
            let Some(s) = w.upgrade() else { return };
            look(&s, &mut last_progress, &mut last_check)
        };
        match next {
            Next::Again => {}
            Next::Exit => return,
            Next::Park => std::thread::park_timeout(Duration::from_secs(1)),
            Next::Busy => std::thread::park_timeout(Duration::from_millis(20)),
            Next::Sleep {
                fault,
                seen,
                mut fds,
                shm,
            } => {
                if fds.is_empty() {
                    let ctrl = fault.own.control();
                    ctrl.sleepers.fetch_add(1, Ordering::SeqCst);
                    futex::wait(&ctrl.doorbell, seen, FLUSH_NAP);
                    ctrl.sleepers.fetch_sub(1, Ordering::SeqCst);
                } else {
                    // Mixed shared memory and TCP: poll in short slices so
                    // the shared-memory sends are looked at too.
                    let ms = if shm { 5 } else { FLUSH_NAP.as_millis() as i32 };
                    // SAFETY: the fds belong to channels of the communicator's
                    // resources, which destroy and abort drop only after
                    // stopping (joining) this thread.
                    unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
                }
            }
        }
    }
}

fn look(s: &Arc<CommShared>, last_progress: &mut Instant, last_check: &mut Instant) -> Next {
    if s.flusher.stopped() || s.state.get() != CommState::Ready {
        return Next::Exit;
    }
    // The timeout counts only time this thread alone waited on stuck sends
    // (a caller's operation applies its own).
    let mut g = match s.resources.try_lock() {
        Ok(g) => g,
        Err(TryLockError::WouldBlock) => {
            *last_progress = Instant::now();
            return Next::Busy;
        }
        Err(TryLockError::Poisoned(p)) => p.into_inner(),
    };
    let Some(core) = g.as_mut() else {
        return Next::Exit;
    };
    if core.eager.is_empty() {
        *last_progress = Instant::now();
        return Next::Park;
    }
    let r = core
        .exec_with(
            &mut [],
            Wait::NoSleep {
                until: Some(Instant::now() + FLUSH_SLICE),
            },
        )
        .and_then(|made| {
            if made {
                *last_progress = Instant::now();
                *last_check = Instant::now();
            } else if last_check.elapsed() >= FLUSH_NAP {
                *last_check = Instant::now();
                core.eager_idle_check(last_progress.elapsed())
                    .map_err(|e| core.fail(e))?;
            }
            Ok(made)
        });
    match r {
        Err(e) => {
            if !matches!(e, Error::Aborted { .. }) && !s.flusher.stopped() {
                let e = core.eager_error("delivering eager sends in the background", &e);
                crate::log::warn_log!("comm {} rank {}: {e}", s.label, s.rank);
                drop(g);
                s.record_failure(&e);
            }
            Next::Exit
        }
        Ok(_) if core.eager.is_empty() => Next::Park,
        Ok(true) => Next::Again,
        Ok(false) => {
            let fds: Vec<libc::pollfd> = core
                .eager
                .pending
                .iter()
                .filter_map(|p| {
                    core.chans[p.x.peer]
                        .as_ref()
                        .and_then(|c| c.fd())
                        .map(|fd| libc::pollfd {
                            fd,
                            events: libc::POLLOUT,
                            revents: 0,
                        })
                })
                .collect();
            let shm = fds.len() < core.eager.pending.len();
            Next::Sleep {
                fault: core.fault.clone(),
                seen: core.eager.seen,
                fds,
                shm,
            }
        }
    }
}
