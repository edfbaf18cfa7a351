//! Where a communicator rank counts the operations it does not time
//! (`sample.rs`): a block of words, [`UntimedWords`], that an observer
//! lends it (the sidecar agent places one in the rank's slot of the shared
//! segment the sidecar reads). libcomm writes them itself, with plain loads
//! and stores and no call into the observer: in a tight loop of small
//! collectives this is the whole reporting cost of an operation, and a
//! call through a trait object and a lookup per operation cost 1-4% of an
//! 8-byte all-reduce on the machines we measure on.
//!
//! The words' meaning is this module's, not the reader's: the last untimed
//! operation started and completed (sequence number, name) and, per name,
//! the operations and bytes completed untimed. One thread writes them at a
//! time (NCCL's rule: one thread per communicator at a time; where a
//! communicator spanning hosts reports from two, the caller's calls and
//! its progress thread's groups, they count under different names); a
//! reader in another process may see a view torn between two operations,
//! never a wrong count for long: every word only moves forward.

use crate::op::{OP_NAMES, OpKind};
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::{Relaxed, Release};

/// An operation's name as an index into [`OP_NAMES`]: what the untimed
/// words hold, so a reader maps names to its own codes once.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct OpName(u8);

impl OpName {
    /// A batch of operations (a group).
    pub const GROUP: OpName = OpName(OP_NAMES.len() as u8 - 1);
    /// How many names there are (indices `0..COUNT`).
    pub const COUNT: usize = OP_NAMES.len();

    pub fn index(self) -> usize {
        self.0 as usize
    }

    pub fn as_str(self) -> &'static str {
        OP_NAMES[self.index()]
    }

    /// The name of index `i` (`None` beyond [`COUNT`](Self::COUNT)): for
    /// readers of a word written elsewhere.
    pub fn from_index(i: u64) -> Option<OpName> {
        (i < Self::COUNT as u64).then_some(OpName(i as u8))
    }
}

impl From<OpKind> for OpName {
    fn from(k: OpKind) -> OpName {
        OpName(k as u8)
    }
}

/// One communicator rank's untimed operations, as words another process
/// can read. `repr(C)`: its layout (in `u64` words, [`UntimedWords::WORDS`]
/// of them) is part of the contract with whoever maps it.
#[repr(C)]
#[derive(Debug, Default)]
pub struct UntimedWords {
    /// The last untimed operation started: sequence number, name index.
    pub started: AtomicU64,
    pub started_op: AtomicU64,
    /// The last untimed operation completed (untimed completions never
    /// fail: a failure is always a timed event): sequence number, name index.
    pub completed: AtomicU64,
    pub completed_op: AtomicU64,
    /// Per name index: operations, then bytes, completed untimed.
    pub counts: [[AtomicU64; 2]; OpName::COUNT],
}

impl UntimedWords {
    /// Its size in `u64` words.
    pub const WORDS: usize = std::mem::size_of::<UntimedWords>() / 8;

    /// Untimed operation `seq` started.
    #[inline]
    pub fn started(&self, seq: u64, op: OpName) {
        set_if_changed(&self.started_op, op.0 as u64);
        self.started.store(seq, Release);
    }

    /// Untimed operation `seq` completed without an error.
    #[inline]
    pub fn completed(&self, seq: u64, op: OpName, bytes: u64) {
        let [ops, b] = &self.counts[op.index()];
        ops.store(ops.load(Relaxed).wrapping_add(1), Relaxed);
        b.store(b.load(Relaxed).wrapping_add(bytes), Relaxed);
        set_if_changed(&self.completed_op, op.0 as u64);
        self.completed.store(seq, Release);
    }
}

const _: () = assert!(std::mem::size_of::<UntimedWords>().is_multiple_of(8));
const _: () = assert!(std::mem::align_of::<UntimedWords>() == 8);

/// A loop repeats one operation: its name is written once, not every call.
#[inline]
fn set_if_changed(w: &AtomicU64, v: u64) {
    if w.load(Relaxed) != v {
        w.store(v, Relaxed);
    }
}

/// The [`UntimedWords`] an observer lends a communicator rank, and what
/// keeps them alive (for the sidecar agent: the mapping of its shared
/// segment). Cheap to read: a pointer, no call.
pub struct CounterWords {
    words: NonNull<UntimedWords>,
    _owner: Arc<dyn Send + Sync>,
}

// SAFETY: the words are atomics, shared by design; `new`'s contract keeps
// them valid while `_owner` (Send + Sync) lives.
unsafe impl Send for CounterWords {}
unsafe impl Sync for CounterWords {}

impl CounterWords {
    /// Words at `words`, kept valid by `owner`.
    ///
    /// # Safety
    /// `words` points to an aligned [`UntimedWords`] (any bit pattern is
    /// one) that stays mapped and is not reused for anything else while
    /// `owner` lives.
    pub unsafe fn new(owner: Arc<dyn Send + Sync>, words: NonNull<UntimedWords>) -> CounterWords {
        CounterWords {
            words,
            _owner: owner,
        }
    }

    /// Words in this process's memory, which the caller may keep reading
    /// (an observer without a shared segment; tests).
    pub fn in_memory(words: Arc<UntimedWords>) -> CounterWords {
        let at = NonNull::from(&*words);
        // SAFETY: the words are the owner itself, alive as long as it.
        unsafe { CounterWords::new(words, at) }
    }

    pub fn words(&self) -> &UntimedWords {
        // SAFETY: `new`'s contract: valid while `_owner`, which we hold, lives.
        unsafe { self.words.as_ref() }
    }
}

impl std::fmt::Debug for CounterWords {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("CounterWords").field(self.words()).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn untimed_words_count_per_name_and_keep_the_last_operation() {
        let c = CounterWords::in_memory(Arc::default());
        let w = c.words();
        let ar = OpName::from(OpKind::AllReduce);
        w.started(1, ar);
        assert_eq!(w.started.load(Relaxed), 1);
        assert_eq!(w.completed.load(Relaxed), 0);
        w.completed(1, ar, 8);
        w.started(2, OpName::GROUP);
        w.completed(2, OpName::GROUP, 24);
        w.started(3, ar);
        w.completed(3, ar, 8);
        assert_eq!(w.counts[ar.index()][0].load(Relaxed), 2);
        assert_eq!(w.counts[ar.index()][1].load(Relaxed), 16);
        assert_eq!(w.counts[OpName::GROUP.index()][0].load(Relaxed), 1);
        assert_eq!(w.completed.load(Relaxed), 3);
        assert_eq!(w.completed_op.load(Relaxed), ar.index() as u64);
        assert_eq!(OpName::from_index(w.started_op.load(Relaxed)), Some(ar));
        assert_eq!(OpName::from_index(OpName::COUNT as u64), None);
        assert_eq!(UntimedWords::WORDS, 4 + 2 * OpName::COUNT);
        assert_eq!(OpName::GROUP.as_str(), "group");
    }
}
