//! The communicator lifecycle as one explicit state machine.
//!
//! Every transition goes through [`StateCell::transition_from`], which checks
//! it against the table below: an unexpected transition is refused (the
//! caller learns it did not happen) instead of silently corrupting state.
//! Waiters (non-blocking init) are woken on every change.

use std::fmt;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum CommState {
    /// Bootstrap (init or split) is still running.
    Initializing,
    /// Usable.
    Ready,
    /// An error made it unusable (a peer died, init failed); it must be destroyed or aborted.
    Failed,
    /// `abort` was called here or by a peer; it must be destroyed.
    Aborted,
    /// Resources released; any further use is an error.
    Destroyed,
}

impl fmt::Display for CommState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            CommState::Initializing => "initializing",
            CommState::Ready => "ready",
            CommState::Failed => "failed",
            CommState::Aborted => "aborted",
            CommState::Destroyed => "destroyed",
        })
    }
}

impl CommState {
    /// Whether `self -> to` is a legal transition.
    pub fn can_become(self, to: CommState) -> bool {
        use CommState::*;
        matches!(
            (self, to),
            (Initializing, Ready | Failed | Aborted | Destroyed)
                | (Ready, Failed | Aborted | Destroyed)
                | (Failed, Aborted | Destroyed)
                | (Aborted, Destroyed)
        )
    }
}

/// The current state plus a condition variable to wait for changes. Reads
/// (every call checks the state) use a lock-free mirror; changes take the lock.
pub(crate) struct StateCell {
    state: Mutex<CommState>,
    mirror: AtomicU8,
    changed: Condvar,
}

impl CommState {
    fn to_u8(self) -> u8 {
        self as u8
    }
    fn from_u8(v: u8) -> CommState {
        match v {
            0 => CommState::Initializing,
            1 => CommState::Ready,
            2 => CommState::Failed,
            3 => CommState::Aborted,
            _ => CommState::Destroyed,
        }
    }
}

impl StateCell {
    pub fn new(s: CommState) -> Self {
        StateCell {
            state: Mutex::new(s),
            mirror: AtomicU8::new(s.to_u8()),
            changed: Condvar::new(),
        }
    }

    #[inline]
    pub fn get(&self) -> CommState {
        CommState::from_u8(self.mirror.load(Ordering::Acquire))
    }

    fn set(&self, guard: &mut CommState, to: CommState) {
        *guard = to;
        self.mirror.store(to.to_u8(), Ordering::Release);
        self.changed.notify_all();
    }

    /// Moves to `to` only if the current state is one of `from`; returns whether it did.
    pub fn transition_from(&self, from: &[CommState], to: CommState) -> bool {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if from.contains(&*s) && s.can_become(to) {
            self.set(&mut s, to);
            true
        } else {
            false
        }
    }

    /// Waits until the state is no longer `Initializing`, or the timeout passes.
    pub fn wait_settled(&self, timeout: Option<Duration>) -> CommState {
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        while *s == CommState::Initializing {
            match deadline {
                None => s = self.changed.wait(s).unwrap_or_else(|e| e.into_inner()),
                Some(d) => {
                    let now = Instant::now();
                    if now >= d {
                        break;
                    }
                    s = self
                        .changed
                        .wait_timeout(s, d - now)
                        .unwrap_or_else(|e| e.into_inner())
                        .0;
                }
            }
        }
        *s
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use CommState::*;

    #[test]
    fn transition_table() {
        let all = [Initializing, Ready, Failed, Aborted, Destroyed];
        for from in all {
            for to in all {
                let legal = from.can_become(to);
                let expect = match from {
                    Initializing => to != Initializing,
                    Ready => matches!(to, Failed | Aborted | Destroyed),
                    Failed => matches!(to, Aborted | Destroyed),
                    Aborted => to == Destroyed,
                    Destroyed => false,
                };
                assert_eq!(legal, expect, "{from} -> {to}");
            }
        }
    }

    #[test]
    fn illegal_transition_is_refused_not_a_panic() {
        let c = StateCell::new(Destroyed);
        assert!(!c.transition_from(&[Destroyed], Ready));
        assert_eq!(c.get(), Destroyed);
    }
}
