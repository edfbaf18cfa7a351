//! The device watch: one thread per process that notices a peer's failure
//! for communicators whose work runs in GPU kernels.
//!
//! On host memory a rank learns of a dead peer while it waits for it: the
//! waiting thread checks the fault domain (`progress/fault.rs`). Work on device
//! memory has no waiting host thread: the kernel spins on the peer's flags
//! and the host is elsewhere (often blocked in `cudaStreamSynchronize` or a
//! tensor's `.item()`, where nothing of ours runs). Unless someone polls
//! `ncclCommGetAsyncError` (PyTorch's watchdog does, a plain C program need
//! not), the kernel would spin for ever.
//!
//! So once a communicator has a device side, this thread looks at it every
//! [`INTERVAL`]: a local peer whose process is gone, a failure a peer
//! raised, or a kernel wait that made no progress for `WEFT_TIMEOUT_MS` (a
//! frozen peer: the kernel reports it in its status word, see
//! `AbortWord::stalled`) marks the communicator Failed (the error names the
//! rank) and fires its abort word; the kernels return within microseconds, the user's
//! stream drains, and the next call on the communicator returns the error.
//! A communicator is dropped from the watch when it is destroyed or its word
//! was fired; the thread ends when nothing is left to watch.

use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

/// How often the watch looks: the bound on noticing a dead local peer while
/// every rank's work is on the GPU (a look costs a few microseconds per peer).
pub(crate) const INTERVAL: Duration = Duration::from_millis(20);

/// What the watch looks at: a communicator's lifecycle record implements it
/// (`shared.rs`), so the watch never names the record.
pub(crate) trait Watched: Send + Sync {
    /// One look: false once there is nothing left to watch (destroyed, or
    /// the word was fired).
    fn watch_tick(&self) -> bool;
}

struct Registry {
    comms: Vec<Weak<dyn Watched>>,
    running: bool,
}

static WATCHED: Mutex<Registry> = Mutex::new(Registry {
    comms: Vec::new(),
    running: false,
});

fn watched() -> std::sync::MutexGuard<'static, Registry> {
    WATCHED.lock().unwrap_or_else(|e| e.into_inner())
}

/// Starts watching `comm` (its device word is set).
pub(crate) fn register(comm: Weak<dyn Watched>) {
    let mut w = watched();
    w.comms.push(comm);
    if !w.running {
        let started = std::thread::Builder::new()
            .name("weft-watch".into())
            .spawn(run);
        match started {
            Ok(_) => w.running = true,
            Err(e) => crate::log::warn_log!(
                "the device watch thread could not start ({e}): a dead peer is noticed only when ncclCommGetAsyncError is called"
            ),
        }
    }
}

fn run() {
    loop {
        std::thread::sleep(INTERVAL);
        // Upgrade outside the look: a tick may take the communicator's own
        // locks, never this registry's.
        let live: Vec<Arc<dyn Watched>> = {
            let mut w = watched();
            w.comms.retain(|c| c.strong_count() > 0);
            if w.comms.is_empty() {
                w.running = false;
                return;
            }
            w.comms.iter().filter_map(Weak::upgrade).collect()
        };
        let mut done = Vec::new();
        for c in &live {
            if !c.watch_tick() {
                done.push(Arc::downgrade(c));
            }
        }
        if !done.is_empty() {
            watched()
                .comms
                .retain(|c| !done.iter().any(|d| d.ptr_eq(c)));
        }
    }
}
