//! Group calls (NCCL's `ncclGroupStart`/`ncclGroupEnd`): operations collected,
//! then run together.
//!
//! A group holds operation descriptors ([`Op`]). On host memory it runs as
//! one batch per communicator, the communicators concurrently (`host.rs`:
//! within one, the sends and receives progress together, then the
//! collectives run in the order they were added); one holding device memory
//! goes whole to the device backend (`device.rs`), which hands its
//! host-memory operations back to the same host path.

use crate::comm::communicator::Communicator;
use crate::comm::device::run_device;
use crate::comm::host::run_host;
use crate::data::types::{Element, ReduceOp};
use crate::error::Result;
use crate::op::{Memory, Op, typed};
use std::marker::PhantomData;

/// A batch of operations, possibly on several communicators.
#[derive(Default)]
pub struct Group<'a> {
    ops: Vec<(&'a Communicator, Op)>,
    _borrows: PhantomData<&'a mut ()>,
}

impl<'a> Group<'a> {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn len(&self) -> usize {
        self.ops.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }

    /// Adds an operation after validating its arguments.
    ///
    /// # Safety
    /// Its pointers must stay valid, and not be used elsewhere, until `execute`
    /// returns (for device memory: until its stream reaches it).
    pub unsafe fn push(&mut self, comm: &'a Communicator, op: Op) -> Result<&mut Self> {
        comm.validate(&op)?;
        self.ops.push((comm, op));
        Ok(self)
    }

    /// Adds an operation of the typed API, built by [`typed`] from the
    /// group's borrowed slices.
    fn push_typed(&mut self, comm: &'a Communicator, op: Result<Op>) -> Result<&mut Self> {
        // SAFETY: the descriptor points into slices borrowed (the written
        // ones mutably) for the group's lifetime `'a`, which `execute` ends.
        unsafe { self.push(comm, op?) }
    }

    pub fn send<T: Element>(
        &mut self,
        comm: &'a Communicator,
        buf: &'a [T],
        peer: usize,
    ) -> Result<&mut Self> {
        self.push_typed(comm, typed::send(buf, peer))
    }

    pub fn recv<T: Element>(
        &mut self,
        comm: &'a Communicator,
        buf: &'a mut [T],
        peer: usize,
    ) -> Result<&mut Self> {
        self.push_typed(comm, typed::recv(buf, peer))
    }

    pub fn all_reduce<T: Element>(
        &mut self,
        comm: &'a Communicator,
        send: &'a [T],
        recv: &'a mut [T],
        op: ReduceOp,
    ) -> Result<&mut Self> {
        self.push_typed(comm, typed::all_reduce(send, recv, op))
    }

    pub fn all_reduce_in_place<T: Element>(
        &mut self,
        comm: &'a Communicator,
        buf: &'a mut [T],
        op: ReduceOp,
    ) -> Result<&mut Self> {
        self.push_typed(comm, typed::all_reduce_in_place(buf, op))
    }

    pub fn broadcast_in_place<T: Element>(
        &mut self,
        comm: &'a Communicator,
        buf: &'a mut [T],
        root: usize,
    ) -> Result<&mut Self> {
        self.push_typed(comm, typed::broadcast_in_place(buf, root))
    }

    /// `recv.len() == send.len() * comm.count()`.
    pub fn all_gather<T: Element>(
        &mut self,
        comm: &'a Communicator,
        send: &'a [T],
        recv: &'a mut [T],
    ) -> Result<&mut Self> {
        self.push_typed(comm, typed::all_gather(send, recv, comm.count()))
    }

    /// Runs everything; returns the first error (after every communicator's batch ended).
    /// A group holding device memory runs on the device backend (enqueued on
    /// the operations' streams).
    pub fn execute(self) -> Result<()> {
        if self.ops.iter().any(|(_, op)| op.memory != Memory::Host) {
            // SAFETY: `push`'s contract.
            return unsafe { run_device(&self.ops) };
        }
        // SAFETY: `push`'s contract.
        unsafe { run_host(self.ops) }
    }
}
