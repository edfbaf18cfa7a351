//! [`Communicator`]: one rank's handle on a communicator (the public type),
//! its accessors, the checks every operation passes, and the typed, safe
//! collectives on slices (which build an [`Op`] and submit it).

use crate::comm::shared::{CommShared, lock};
use crate::config::Config;
use crate::data::types::{Element, ReduceOp};
use crate::error::Result;
use crate::op::{Op, typed};
use crate::progress::resources::Resources;
use crate::state::CommState;
use std::sync::Arc;

/// One rank's handle on a communicator. Dropping it destroys it.
pub struct Communicator {
    pub(crate) s: Arc<CommShared>,
}

impl std::fmt::Debug for Communicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Communicator")
            .field("id", &self.s.label)
            .field("rank", &self.s.rank)
            .field("nranks", &self.s.nranks)
            .field("state", &self.s.state.get())
            .finish()
    }
}

impl Communicator {
    pub fn rank(&self) -> usize {
        self.s.rank
    }

    pub fn count(&self) -> usize {
        self.s.nranks
    }

    /// A short identifier shown in errors and logs.
    pub fn id(&self) -> &str {
        &self.s.label
    }

    pub fn state(&self) -> CommState {
        self.s.state.get()
    }

    pub fn config(&self) -> &Config {
        &self.s.cfg
    }

    /// `communicator <id> (rank r of n)`, for messages.
    pub fn describe(&self) -> String {
        format!(
            "communicator {} (rank {} of {})",
            self.s.label, self.s.rank, self.s.nranks
        )
    }

    /// The CUDA device of this rank's device side (set up by its first
    /// operation on device memory), if any.
    pub fn cuda_device(&self) -> Option<i32> {
        lock(&self.s.dev).device()
    }

    /// Runs `f` on the live core, serialized with every other call on this communicator.
    pub(crate) fn with_resources<R>(
        &self,
        what: &'static str,
        f: impl FnOnce(&mut Resources) -> Result<R>,
    ) -> Result<R> {
        let st = self.s.state.get();
        if st != CommState::Ready {
            return Err(self.s.state_error(st, what));
        }
        let mut g = lock(&self.s.resources);
        let st = self.s.state.get();
        let core = match g.as_mut() {
            Some(c) if st == CommState::Ready => c,
            _ => return Err(self.s.state_error(st, what)),
        };
        let r = f(core);
        if let Err(e) = &r {
            self.s.record_failure(e);
        }
        r
    }

    /// Checks an operation's arguments against this communicator, without running it.
    pub(crate) fn validate(&self, op: &Op) -> Result<()> {
        op.validate(self.s.rank, self.s.nranks)
    }

    /// What every operation passes before a backend sees it: valid
    /// arguments, then a Ready communicator.
    pub(crate) fn admit(&self, op: &Op) -> Result<()> {
        self.validate(op)?;
        let st = self.s.state.get();
        if st != CommState::Ready {
            return Err(self.s.state_error(st, op.name()));
        }
        Ok(())
    }

    /// Wakes the eager-send flusher when sends are pending.
    pub(crate) fn kick_if(&self, pending: bool) {
        if pending {
            self.s.kick_flusher();
        }
    }
}

impl Drop for Communicator {
    fn drop(&mut self) {
        if self.s.state.get() != CommState::Destroyed {
            let _ = self.destroy();
        }
    }
}

/// Typed, safe collectives on slices: the descriptors (and their length
/// checks) come from `typed`, shared with `Group`'s typed methods.
impl Communicator {
    /// Runs a descriptor built by [`typed`] from the caller's slices.
    fn submit_typed(&self, op: Result<Op>) -> Result<()> {
        // SAFETY: the descriptor points into slices the caller borrows (the
        // written ones mutably) for this whole call, and a host-memory
        // operation has ended when `submit` returns.
        unsafe { self.submit(op?) }
    }

    pub fn all_reduce<T: Element>(&self, send: &[T], recv: &mut [T], op: ReduceOp) -> Result<()> {
        self.submit_typed(typed::all_reduce(send, recv, op))
    }

    pub fn all_reduce_in_place<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        self.submit_typed(typed::all_reduce_in_place(buf, op))
    }

    /// `send` is read on the root only (others may pass an empty slice).
    pub fn broadcast<T: Element>(&self, send: &[T], recv: &mut [T], root: usize) -> Result<()> {
        self.submit_typed(typed::broadcast(send, recv, root, self.s.rank))
    }

    pub fn broadcast_in_place<T: Element>(&self, buf: &mut [T], root: usize) -> Result<()> {
        self.submit_typed(typed::broadcast_in_place(buf, root))
    }

    /// `recv` is written on the root only (others may pass an empty slice).
    pub fn reduce<T: Element>(
        &self,
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
        root: usize,
    ) -> Result<()> {
        self.submit_typed(typed::reduce(send, recv, op, root, self.s.rank))
    }

    pub fn reduce_in_place<T: Element>(
        &self,
        buf: &mut [T],
        op: ReduceOp,
        root: usize,
    ) -> Result<()> {
        self.submit_typed(typed::reduce_in_place(buf, op, root))
    }

    /// `recv.len() == send.len() * count()`.
    pub fn all_gather<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        self.submit_typed(typed::all_gather(send, recv, self.s.nranks))
    }

    /// This rank's block is at `buf[rank * n .. (rank + 1) * n]`, `n = buf.len() / count()`.
    pub fn all_gather_in_place<T: Element>(&self, buf: &mut [T]) -> Result<()> {
        self.submit_typed(typed::all_gather_in_place(buf, self.s.rank, self.s.nranks))
    }

    /// `send.len() == recv.len() * count()`.
    pub fn reduce_scatter<T: Element>(
        &self,
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        self.submit_typed(typed::reduce_scatter(send, recv, op, self.s.nranks))
    }

    /// The result lands in `buf[rank * n .. (rank + 1) * n]`, `n = buf.len() / count()`.
    pub fn reduce_scatter_in_place<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        let (rank, n) = (self.s.rank, self.s.nranks);
        self.submit_typed(typed::reduce_scatter_in_place(buf, op, rank, n))
    }

    /// Block p (of `len / count()` elements) of `send` goes to rank p.
    pub fn all_to_all<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        self.submit_typed(typed::all_to_all(send, recv, self.s.nranks))
    }

    pub fn all_to_all_in_place<T: Element>(&self, buf: &mut [T]) -> Result<()> {
        self.submit_typed(typed::all_to_all_in_place(buf, self.s.nranks))
    }

    /// Sends `buf` to `peer`. Eager: it returns once the message is in the
    /// peer's ring or copied into a buffer of the communicator, without
    /// waiting for the peer's receive (up to `WEFT_EAGER_MAX_BYTES` held per
    /// communicator; see [`flush`](Self::flush)), so `send(next);
    /// recv(prev)` on every rank of a ring completes at any size.
    pub fn send<T: Element>(&self, buf: &[T], peer: usize) -> Result<()> {
        self.submit_typed(typed::send(buf, peer))
    }

    pub fn recv<T: Element>(&self, buf: &mut [T], peer: usize) -> Result<()> {
        self.submit_typed(typed::recv(buf, peer))
    }
}
