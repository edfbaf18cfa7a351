//! Group calls (NCCL's `ncclGroupStart`/`ncclGroupEnd`): operations collected,
//! then run together.
//!
//! Within one communicator, all sends and receives of the group progress
//! together (so matched pairs never deadlock, whatever their order), then the
//! collectives run in the order they were added. Operations on different
//! communicators run concurrently, one thread per communicator: that is what
//! lets one thread drive several ranks (several communicators of one job, as
//! `nccl-tests -g 4` does).

use crate::comm::{Communicator, run_op};
use crate::error::{Error, Result};
use crate::exec::Xfer;
use crate::types::{DataType, Element, ReduceOp};
use std::marker::PhantomData;

/// One operation, as raw pointers (host memory).
#[derive(Debug, Clone, Copy)]
pub enum GroupOp {
    AllReduce {
        send: *const u8,
        recv: *mut u8,
        count: usize,
        dtype: DataType,
        op: ReduceOp,
    },
    Broadcast {
        send: *const u8,
        recv: *mut u8,
        count: usize,
        dtype: DataType,
        root: usize,
    },
    Reduce {
        send: *const u8,
        recv: *mut u8,
        count: usize,
        dtype: DataType,
        op: ReduceOp,
        root: usize,
    },
    AllGather {
        send: *const u8,
        recv: *mut u8,
        count: usize,
        dtype: DataType,
    },
    ReduceScatter {
        send: *const u8,
        recv: *mut u8,
        count: usize,
        dtype: DataType,
        op: ReduceOp,
    },
    AllToAll {
        send: *const u8,
        recv: *mut u8,
        count: usize,
        dtype: DataType,
    },
    Gather {
        send: *const u8,
        recv: *mut u8,
        count: usize,
        dtype: DataType,
        root: usize,
    },
    Scatter {
        send: *const u8,
        recv: *mut u8,
        count: usize,
        dtype: DataType,
        root: usize,
    },
    Send {
        buf: *const u8,
        count: usize,
        dtype: DataType,
        peer: usize,
    },
    Recv {
        buf: *mut u8,
        count: usize,
        dtype: DataType,
        peer: usize,
    },
}

impl GroupOp {
    pub fn name(&self) -> &'static str {
        match self {
            GroupOp::AllReduce { .. } => "all_reduce",
            GroupOp::Broadcast { .. } => "broadcast",
            GroupOp::Reduce { .. } => "reduce",
            GroupOp::AllGather { .. } => "all_gather",
            GroupOp::ReduceScatter { .. } => "reduce_scatter",
            GroupOp::AllToAll { .. } => "all_to_all",
            GroupOp::Gather { .. } => "gather",
            GroupOp::Scatter { .. } => "scatter",
            GroupOp::Send { .. } => "send",
            GroupOp::Recv { .. } => "recv",
        }
    }

    /// Zero-count collectives are no-ops (sends/receives of 0 bytes still match up).
    pub fn is_empty(&self) -> bool {
        match *self {
            GroupOp::Send { .. } | GroupOp::Recv { .. } => false,
            GroupOp::AllReduce { count, .. }
            | GroupOp::Broadcast { count, .. }
            | GroupOp::Reduce { count, .. }
            | GroupOp::AllGather { count, .. }
            | GroupOp::ReduceScatter { count, .. }
            | GroupOp::AllToAll { count, .. }
            | GroupOp::Gather { count, .. }
            | GroupOp::Scatter { count, .. } => count == 0,
        }
    }

    fn is_p2p(&self) -> bool {
        matches!(self, GroupOp::Send { .. } | GroupOp::Recv { .. })
    }
}

/// A batch of operations, possibly on several communicators.
#[derive(Default)]
pub struct Group<'a> {
    ops: Vec<(&'a Communicator, GroupOp)>,
    _borrows: PhantomData<&'a mut ()>,
}

/// Lets a batch for one communicator move to its worker thread.
struct Batch<'a>(&'a Communicator, Vec<GroupOp>);
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

    /// Adds a raw operation after validating its arguments.
    ///
    /// # Safety
    /// Its pointers must stay valid, and not be used elsewhere, until `execute` returns.
    pub unsafe fn push_raw(&mut self, comm: &'a Communicator, op: GroupOp) -> Result<&mut Self> {
        comm.validate(&op)?;
        self.ops.push((comm, op));
        Ok(self)
    }

    pub fn send<T: Element>(
        &mut self,
        comm: &'a Communicator,
        buf: &'a [T],
        peer: usize,
    ) -> Result<&mut Self> {
        let op = GroupOp::Send {
            buf: buf.as_ptr().cast(),
            count: buf.len(),
            dtype: T::DTYPE,
            peer,
        };
        unsafe { self.push_raw(comm, op) }
    }

    pub fn recv<T: Element>(
        &mut self,
        comm: &'a Communicator,
        buf: &'a mut [T],
        peer: usize,
    ) -> Result<&mut Self> {
        let op = GroupOp::Recv {
            buf: buf.as_mut_ptr().cast(),
            count: buf.len(),
            dtype: T::DTYPE,
            peer,
        };
        unsafe { self.push_raw(comm, op) }
    }

    pub fn all_reduce<T: Element>(
        &mut self,
        comm: &'a Communicator,
        send: &'a [T],
        recv: &'a mut [T],
        op: ReduceOp,
    ) -> Result<&mut Self> {
        if send.len() != recv.len() {
            return Err(Error::arg(format!(
                "all_reduce: send has {} elements, receive {}",
                send.len(),
                recv.len()
            )));
        }
        let g = GroupOp::AllReduce {
            send: send.as_ptr().cast(),
            recv: recv.as_mut_ptr().cast(),
            count: send.len(),
            dtype: T::DTYPE,
            op,
        };
        unsafe { self.push_raw(comm, g) }
    }

    pub fn all_reduce_in_place<T: Element>(
        &mut self,
        comm: &'a Communicator,
        buf: &'a mut [T],
        op: ReduceOp,
    ) -> Result<&mut Self> {
        let p = buf.as_mut_ptr().cast::<u8>();
        let g = GroupOp::AllReduce {
            send: p,
            recv: p,
            count: buf.len(),
            dtype: T::DTYPE,
            op,
        };
        unsafe { self.push_raw(comm, g) }
    }

    pub fn broadcast_in_place<T: Element>(
        &mut self,
        comm: &'a Communicator,
        buf: &'a mut [T],
        root: usize,
    ) -> Result<&mut Self> {
        let p = buf.as_mut_ptr().cast::<u8>();
        let g = GroupOp::Broadcast {
            send: p,
            recv: p,
            count: buf.len(),
            dtype: T::DTYPE,
            root,
        };
        unsafe { self.push_raw(comm, g) }
    }

    pub fn all_gather<T: Element>(
        &mut self,
        comm: &'a Communicator,
        send: &'a [T],
        recv: &'a mut [T],
    ) -> Result<&mut Self> {
        if Some(recv.len()) != send.len().checked_mul(comm.count()) {
            return Err(Error::arg(format!(
                "all_gather: receive must hold {} x {} elements",
                send.len(),
                comm.count()
            )));
        }
        let g = GroupOp::AllGather {
            send: send.as_ptr().cast(),
            recv: recv.as_mut_ptr().cast(),
            count: send.len(),
            dtype: T::DTYPE,
        };
        unsafe { self.push_raw(comm, g) }
    }

    /// Runs everything; returns the first error (after every communicator's batch ended).
    pub fn execute(self) -> Result<()> {
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
    let p2p: Vec<GroupOp> = ops.iter().copied().filter(GroupOp::is_p2p).collect();
    let obs = crate::observe::start(&comm.s.who(), &ops, true);
    let r = comm.with_core("group", |c| {
        if !p2p.is_empty() {
            let mut xs: Vec<Xfer> = p2p
                .iter()
                .map(|op| match *op {
                    GroupOp::Send {
                        buf,
                        count,
                        dtype,
                        peer,
                    } => Xfer::send(peer, buf, count * dtype.size()),
                    GroupOp::Recv {
                        buf,
                        count,
                        dtype,
                        peer,
                    } => Xfer::recv(peer, buf, count * dtype.size()),
                    _ => unreachable!("filtered to p2p"),
                })
                .collect();
            c.exec(&mut xs)?;
        }
        for op in ops.iter().filter(|o| !o.is_p2p() && !o.is_empty()) {
            unsafe { run_op(c, op)? };
        }
        Ok(())
    });
    crate::observe::finish(obs, &r);
    r
}
