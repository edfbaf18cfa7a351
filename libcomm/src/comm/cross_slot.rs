//! A communicator's cross-host engine slot (`cross_engine.rs` builds and
//! drives it): the engine once built, and what releases a call waiting in
//! it when the communicator is aborted or failed (the engine's aborter
//! and the host-local communicator's lever), kept outside the lock a
//! running call holds.

use crate::crosshost::CrossHost;
use crate::crosshost::engine::Aborter;
use crate::error::Error;
use crate::observe::Lever;
use crate::sys::lock;
use std::sync::atomic::AtomicBool;
use std::sync::{Mutex, Weak};

/// A communicator's engine, once asked for.
#[derive(Default)]
pub(crate) struct Slot {
    pub(super) state: Mutex<State>,
    /// The engine is being built: the collectives that builds it (the
    /// layout's and the handles' exchange, the host split) take the flat
    /// path, whatever their size.
    pub(super) building: AtomicBool,
    /// Outside `state` (which a running call holds): releases it.
    pub(super) stop: Mutex<Option<Stop>>,
}

#[derive(Default)]
pub(super) enum State {
    #[default]
    Untried,
    /// One host, or the engine could not be built: the flat path.
    Off,
    On(Box<CrossHost>),
}

/// What releases a call in the engine: the engine's aborter and the
/// host-local communicator.
pub(super) struct Stop {
    pub(super) engine: Aborter,
    pub(super) local: Weak<dyn Lever>,
}

impl Slot {
    /// Fails a call in the engine, and the engine, with `e` (the
    /// communicator was aborted or failed for `reason`).
    pub(crate) fn release(&self, e: Error, reason: &str) {
        if let Some(s) = lock(&self.stop).as_ref() {
            s.engine.fail(e);
            if let Some(l) = s.local.upgrade() {
                l.abort(reason);
            }
        }
    }

    /// Stops the engine and destroys the host-local communicator (the
    /// communicator is being destroyed; no call runs).
    pub(crate) fn close(&self) {
        let engine = std::mem::replace(&mut *lock(&self.state), State::Off);
        *lock(&self.stop) = None;
        drop(engine); // after both locks: its thread ends, the local communicator goes
    }
}
