//! [`Reconf`]: a communicator's reconfiguration bookkeeping (revoke,
//! shrink, grow; `resilience/recovery.rs` drives them), held in its
//! lifecycle record. Its own module because the record and its status
//! queries read it while the reconfigurations, above the communicator,
//! change it.

use crate::bootstrap::unique_id::UniqueId;
use crate::error::{Error, Result};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Mutex, MutexGuard};

const REVOKE_NONE: u8 = 0;
const REVOKE_RUNNING: u8 = 1;
const REVOKE_DONE: u8 = 2;

/// A communicator's reconfiguration bookkeeping (in `CommShared`).
#[derive(Default)]
pub(crate) struct Reconf {
    revoke: AtomicU8,
    shrinking: AtomicBool,
    growing: AtomicBool,
    /// Shrinks so far per excluded list: part of the child's id, so a second
    /// shrink with the same list makes a different communicator.
    shrinks: Mutex<HashMap<Vec<usize>, u64>>,
    /// The id from `grow_unique_id`, until a grow consumes it.
    grow_id: Mutex<Option<UniqueId>>,
}

impl Reconf {
    /// `Some` once revoked: `InProgress` until quiescent, then `Ok` (as
    /// `ncclCommGetAsyncError` after `ncclCommRevoke`).
    pub(crate) fn revoke_status(&self) -> Option<Result<()>> {
        match self.revoke.load(Ordering::Acquire) {
            REVOKE_NONE => None,
            REVOKE_RUNNING => Some(Err(Error::InProgress)),
            _ => Some(Ok(())),
        }
    }

    pub(crate) fn revoked(&self) -> bool {
        self.revoke.load(Ordering::Acquire) != REVOKE_NONE
    }

    /// Starts the revoke: false when one started before (revoke is idempotent).
    pub(crate) fn start_revoke(&self) -> bool {
        self.revoke
            .compare_exchange(
                REVOKE_NONE,
                REVOKE_RUNNING,
                Ordering::AcqRel,
                Ordering::Acquire,
            )
            .is_ok()
    }

    /// This rank is quiescent after its revoke.
    pub(crate) fn end_revoke(&self) {
        self.revoke.store(REVOKE_DONE, Ordering::Release);
    }

    pub(crate) fn revoke_ended(&self) -> bool {
        self.revoke.load(Ordering::Acquire) == REVOKE_DONE
    }

    /// Marks a shrink running until the guard drops (one at a time).
    pub(crate) fn shrinking(&self, who: &str) -> Result<Busy<'_>> {
        Busy::take(&self.shrinking, "shrink", who)
    }

    /// Marks a grow running until the guard drops (one at a time).
    pub(crate) fn growing(&self, who: &str) -> Result<Busy<'_>> {
        Busy::take(&self.growing, "grow", who)
    }

    /// How many shrinks excluding `excluded` came before this one (which
    /// is counted).
    pub(crate) fn next_shrink(&self, excluded: &[usize]) -> u64 {
        let mut m = self.shrinks.lock().unwrap_or_else(|e| e.into_inner());
        let c = m.entry(excluded.to_vec()).or_insert(0);
        *c += 1;
        *c - 1
    }

    /// The id from `grow_unique_id` not consumed by a grow yet.
    pub(crate) fn grow_id(&self) -> MutexGuard<'_, Option<UniqueId>> {
        self.grow_id.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Clears a busy flag when dropped.
pub(crate) struct Busy<'a>(&'a AtomicBool);

impl<'a> Busy<'a> {
    fn take(flag: &'a AtomicBool, what: &str, who: &str) -> Result<Busy<'a>> {
        if flag.swap(true, Ordering::AcqRel) {
            return Err(Error::InvalidUsage(format!(
                "{who}: a {what} of this communicator is already running on another thread; \
                 call it once per rank"
            )));
        }
        Ok(Busy(flag))
    }
}

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}
