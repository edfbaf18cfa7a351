//! The observer hook: one process-wide callback receiving every operation's
//! start and completion and every communicator's lifecycle, each event with
//! its full context *by value* (job, communicator, rank, size, op, dtype,
//! bytes, algorithm, sequence number, outcome). A proxy serving many ranks
//! therefore can never attribute an event to the wrong rank: nothing is looked
//! up later from shared state.
//!
//! The sidecar client (`weft::agent`) installs an observer that forwards
//! events to `weft sidecar` (or to the same engine in-process). Without an
//! observer the cost is one atomic load per operation. In tight loops
//! (`sample.rs`) only one call in 32 (in 256 above 500,000 a second) is
//! timed and becomes events; the others are counted in [`UntimedWords`]
//! the observer lends the communicator once it is Ready.
//!
//! | file | its one job |
//! |---|---|
//! | `event.rs` | the events ([`OpEvent`], [`CommEvent`]) and the [`AbortHandle`] a Ready event carries |
//! | `clock.rs` | wall-clock stamps cheap enough for every collective (the TSC, scaled per thread) |
//! | `ops.rs` | reporting one operation's (or group's) start and completion, with its sequence number |
//! | `sample.rs` | which operations are timed (all at low rates, one in 32 or 256 in tight loops, the same ones on every rank) |
//! | `untimed.rs` | the words the others are counted in ([`UntimedWords`], lent as [`CounterWords`]) |

mod clock;
mod event;
mod ops;
mod sample;
mod untimed;

pub(crate) use event::Lever;
pub use event::{AbortHandle, CommEvent, OpEvent, Phase};
pub(crate) use ops::{Meter, Who, finish, start};
pub use sample::{
    FAST_MEAN_NS, SAMPLE_EVERY, SAMPLE_EVERY_VERY_FAST, SLOW_EXCESS_NS, VERY_FAST_MEAN_NS,
};
pub use untimed::{CounterWords, OpName, UntimedWords};

pub use crate::op::OP_NAMES;
use std::sync::{Arc, OnceLock};

pub trait Observer: Send + Sync {
    /// Called on the thread running the operation: must not block. By
    /// reference: the started event is the completed one's too, built
    /// once per operation.
    fn on_op(&self, ev: &OpEvent<'_>);
    fn on_comm(&self, ev: CommEvent);
    /// Where communicator `comm_id` rank `rank` counts the operations it
    /// does not time (`sample.rs`): words libcomm writes itself
    /// (`untimed.rs`); asked once, right after its Ready event. An untimed
    /// operation that fails comes to [`on_op`](Self::on_op) as a
    /// completed event (with no started event before it). `None` (the
    /// default): every operation is timed and comes to `on_op`.
    fn counter(&self, comm_id: &str, rank: usize) -> Option<CounterWords> {
        let _ = (comm_id, rank);
        None
    }
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
