//! A batch of operations on host memory, on one or more communicators (a
//! group's, or the host part of a device batch: [`run_host`]); each runs by
//! the host algorithms (`algo::run`) with the tuner's decision.
//!
//! Within one communicator, all sends and receives of a batch progress
//! together (so matched pairs never deadlock, whatever their order), then
//! the collectives run in the order they were added. Batches of different
//! communicators run concurrently, one thread per communicator: that is
//! what lets one thread drive several ranks (several communicators of one
//! job, as `nccl-tests -g 4` does).

use crate::algo;
use crate::comm::communicator::Communicator;
use crate::error::{Error, Result};
use crate::observe;
use crate::op::tuner;
use crate::op::{Op, OpKind};
use crate::progress::xfer::Xfer;

/// Lets a batch for one communicator move to its worker thread.
struct Batch<'a>(&'a Communicator, Vec<Op>);
unsafe impl Send for Batch<'_> {}

/// Runs validated host-memory operations, grouped per communicator; returns
/// the first error (after every communicator's batch ended).
///
/// # Safety
/// As `Group::push`: every operation's pointers are valid, and not used
/// elsewhere, until this returns.
pub(crate) unsafe fn run_host(ops: Vec<(&Communicator, Op)>) -> Result<()> {
    let mut batches: Vec<Batch<'_>> = Vec::new();
    for (comm, op) in ops {
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
                    Ok(h) => h
                        .join()
                        .unwrap_or_else(|_| Err(Error::Internal("a group worker panicked".into()))),
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

fn run_batch(b: Batch<'_>) -> Result<()> {
    let Batch(comm, ops) = b;
    let obs = observe::start(&comm.s.who(), &ops, true, "group");
    // A batch of sends only goes eager, as a lone send does (`progress/eager.rs`).
    if ops.iter().all(|op| op.kind == OpKind::Send) {
        let xs: Vec<Xfer> = ops
            .iter()
            .map(|op| Xfer::send(op.peer(), op.send, op.bytes()))
            .collect();
        let r = comm
            .with_resources("group", |c| c.send_eager(xs))
            .map(|pending| comm.kick_if(pending));
        observe::finish(obs, &r);
        return r;
    }
    let r = comm.with_resources("group", |c| {
        let mut xs: Vec<Xfer> = ops
            .iter()
            .filter(|op| op.is_send_recv())
            .map(|op| match op.kind {
                OpKind::Send => Xfer::send(op.peer(), op.send, op.bytes()),
                _ => Xfer::recv(op.peer(), op.recv, op.bytes()),
            })
            .collect();
        if !xs.is_empty() {
            c.exec(&mut xs)?;
        }
        let shape = c.shape();
        for op in ops.iter().filter(|o| !o.is_send_recv() && !o.is_empty()) {
            let d = tuner::decide(op, &shape, &c.ctx.cfg.algo);
            algo::run(c, op, d)?;
        }
        Ok(())
    });
    observe::finish(obs, &r);
    r
}
