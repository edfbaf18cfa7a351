//! The observer hook: one process-wide callback receiving every operation's
//! start and completion and every communicator's lifecycle, each event with
//! its full context *by value* (job, communicator, rank, size, op, dtype,
//! bytes, algorithm, sequence number, outcome). A proxy serving many ranks
//! therefore can never attribute an event to the wrong rank: nothing is looked
//! up later from shared state.
//!
//! The sidecar client (`weft::agent`) installs an observer that forwards
//! events to `weft sidecar` (or to the same engine in-process). Without an
//! observer the cost is one atomic load per operation.
//!
//! | file | its one job |
//! |---|---|
//! | `event.rs` | the events ([`OpEvent`], [`CommEvent`]) and the [`AbortHandle`] a Ready event carries |
//! | `clock.rs` | wall-clock stamps cheap enough for every collective (the TSC, scaled per thread) |
//! | `ops.rs` | reporting one operation's (or group's) start and completion, with its sequence number |

mod clock;
mod event;
mod ops;

pub(crate) use event::Lever;
pub use event::{AbortHandle, CommEvent, OpEvent, Phase};
pub(crate) use ops::{Seq, Who, finish, start};

use std::sync::{Arc, OnceLock};

pub trait Observer: Send + Sync {
    /// Called on the thread running the operation: must not block. By
    /// reference: the started event is the completed one's too, built
    /// once per operation.
    fn on_op(&self, ev: &OpEvent<'_>);
    fn on_comm(&self, ev: CommEvent);
}

static OBSERVER: OnceLock<Arc<dyn Observer>> = OnceLock::new();

/// Installs the process-wide observer; only the first call wins (`false` after).
pub fn set_observer(o: Arc<dyn Observer>) -> bool {
    OBSERVER.set(o).is_ok()
}

pub(crate) fn observer() -> Option<&'static Arc<dyn Observer>> {
    OBSERVER.get()
}

/// Reports a communicator's lifecycle event (built only when an observer is set).
pub(crate) fn comm(ev: impl FnOnce() -> CommEvent) {
    if let Some(o) = observer() {
        o.on_comm(ev());
    }
}
