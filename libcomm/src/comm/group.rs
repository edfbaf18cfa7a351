//! Group calls (NCCL's `ncclGroupStart`/`ncclGroupEnd`): operations collected,
//! then run together.
//!
//! Within one communicator, all sends and receives of the group progress
//! together (so matched pairs never deadlock, whatever their order), then the
//! collectives run in the order they were added. Operations on different
//! communicators run concurrently, one thread per communicator: that is what
//! lets one thread drive several ranks (several communicators of one job, as
//! `nccl-tests -g 4` does).
//!
//! A group holds operation descriptors ([`Op`]); one holding device memory
//! goes whole to the device backend (see `backend.rs`), which runs its
//! host-memory operations back through here.

use crate::comm::communicator::{Communicator, run_device, run_op};
use crate::data::types::{Element, ReduceOp};
use crate::error::{Error, Result};
use crate::op::tuner;
use crate::op::{Memory, Op, typed};
use crate::progress::xfer::Xfer;
use std::marker::PhantomData;

/// A batch of operations, possibly on several communicators.
#[derive(Default)]
pub struct Group<'a> {
    ops: Vec<(&'a Communicator, Op)>,
    _borrows: PhantomData<&'a mut ()>,
}

/// Lets a batch for one communicator move to its worker thread.
struct Batch<'a>(&'a Communicator, Vec<Op>);
unsafe impl Send for Batch<'_> {}

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
        let mut batches: Vec<Batch<'a>> = Vec::new();
        for (comm, op) in self.ops {
            match batches.iter_mut().find(|b| std::ptr::eq(b.0, comm)) {
                Some(b) => b.1.push(op),
                None => batches.push(Batch(comm, vec![op])),
            }
        }
        match batches.len() {
            0 => Ok(()),
            1 => run_batch(batches.pop().unwrap()),
            _ => std::thread::scope(|sc| {
                let handles: Vec<_> = batches
                    .into_iter()
                    .map(|b| {
                        std::thread::Builder::new()
                            .name("weft-group".into())
                            .spawn_scoped(sc, move || run_batch(b))
                    })
                    .collect();
                let mut first: Option<Error> = None;
                for h in handles {
                    let r = match h {
                        Ok(h) => h.join().unwrap_or_else(|_| {
                            Err(Error::Internal("a group worker panicked".into()))
                        }),
                        Err(e) => Err(Error::sys("spawning a group worker", e)),
                    };
                    if let Err(e) = r {
                        first.get_or_insert(e);
                    }
                }
                first.map_or(Ok(()), Err)
            }),
        }
    }
}

fn run_batch(b: Batch<'_>) -> Result<()> {
    let Batch(comm, ops) = b;
    let obs = crate::observe::start(&comm.s.who(), &ops, true, "group");
    // A batch of sends only goes eager, as a lone send does (eager.rs).
    if ops.iter().all(|op| op.kind == crate::op::OpKind::Send) {
        let xs: Vec<Xfer> = ops
            .iter()
            .map(|op| Xfer::send(op.peer(), op.send, op.bytes()))
            .collect();
        let r = comm
            .with_resources("group", |c| c.send_eager(xs))
            .map(|pending| comm.kick_if(pending));
        crate::observe::finish(obs, &r);
        return r;
    }
    let r = comm.with_resources("group", |c| {
        let mut xs: Vec<Xfer> = ops
            .iter()
            .filter(|op| op.is_send_recv())
            .map(|op| match op.kind {
                crate::op::OpKind::Send => Xfer::send(op.peer(), op.send, op.bytes()),
                _ => Xfer::recv(op.peer(), op.recv, op.bytes()),
            })
            .collect();
        if !xs.is_empty() {
            c.exec(&mut xs)?;
        }
        let shape = c.shape();
        for op in ops.iter().filter(|o| !o.is_send_recv() && !o.is_empty()) {
            let d = tuner::decide(op, &shape, &c.ctx.cfg.algo);
            unsafe { run_op(c, op, d)? };
        }
        Ok(())
    });
    crate::observe::finish(obs, &r);
    r
}
