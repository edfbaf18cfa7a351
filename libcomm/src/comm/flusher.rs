//! The eager-send flusher: a communicator's background progress thread.
//!
//! A rank that sends and then makes no more calls must still deliver (see
//! `progress/eager.rs` for eager sends): this thread, started on the first
//! pending send and ended by destroy or abort, pushes pending sends while
//! the communicator is idle. It only takes the communicator's lock with
//! `try_lock`, holds it for at most [`FLUSH_SLICE`] at a time, and sleeps
//! on the rank's futex doorbell (shared memory) or in poll(2) (TCP) between
//! attempts: it never busy-spins and never starves the caller (a caller's
//! `exec` pushes pending sends itself). A failure while it pushes becomes
//! the communicator's async error.
//!
//! It sees its communicator through [`Owner`], which the lifecycle record
//! (`shared.rs`) implements, so this module never names the record.

use crate::error::Error;
use crate::progress::fault::Fault;
use crate::progress::resources::Resources;
use crate::progress::xfer::Wait;
use crate::transport::futex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, TryLockError, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The longest the flusher holds the communicator's lock at a time.
const FLUSH_SLICE: Duration = Duration::from_millis(2);
/// The longest the flusher sleeps between two looks at its pending sends.
const FLUSH_NAP: Duration = Duration::from_millis(100);

/// What the flusher needs of its communicator.
pub(crate) trait Owner: Send + Sync + 'static {
    fn flusher(&self) -> &Flusher;
    /// Whether the communicator is Ready (the flusher ends otherwise).
    fn ready(&self) -> bool;
    /// The live resources, behind the lock every operation takes.
    fn resources(&self) -> &Mutex<Option<Resources>>;
    /// Records a failure as the communicator's async error.
    fn record_failure(&self, e: &Error);
    /// The communicator's label and this rank, for thread names and logs.
    fn who(&self) -> (&str, usize);
}

/// A communicator's background progress thread (see the module docs).
#[derive(Default)]
pub(crate) struct Flusher {
    thread: Mutex<Option<JoinHandle<()>>>,
    stop: AtomicBool,
}

impl Flusher {
    /// Wakes the flusher (starting it the first time): something is pending.
    pub(crate) fn kick<O: Owner>(&self, s: &Arc<O>) {
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
        let (label, rank) = s.who();
        match std::thread::Builder::new()
            .name(format!("weft-eager-{rank}"))
            .spawn(move || run(w))
        {
            Ok(h) => *g = Some(h),
            // Pending sends still progress in the next call on the
            // communicator, and destroy flushes them.
            Err(e) => crate::log::warn_log!(
                "comm {label} rank {rank}: could not start the eager-send flusher thread: {e}"
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
        fault: Arc<Fault>,
        seen: u32,
        fds: Vec<libc::pollfd>,
        shm: bool,
    },
    Exit,
}

fn run<O: Owner>(w: Weak<O>) {
    let mut last_progress = Instant::now();
    let mut last_check = Instant::now();
    loop {
        let next = {
            let Some(s) = w.upgrade() else { return };
            look(&*s, &mut last_progress, &mut last_check)
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

fn look<O: Owner>(s: &O, last_progress: &mut Instant, last_check: &mut Instant) -> Next {
    if s.flusher().stopped() || !s.ready() {
        return Next::Exit;
    }
    // The timeout counts only time this thread alone waited on stuck sends
    // (a caller's operation applies its own).
    let mut g = match s.resources().try_lock() {
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
            if !matches!(e, Error::Aborted { .. }) && !s.flusher().stopped() {
                let e = core.eager_error("delivering eager sends in the background", &e);
                let (label, rank) = s.who();
                crate::log::warn_log!("comm {label} rank {rank}: {e}");
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
