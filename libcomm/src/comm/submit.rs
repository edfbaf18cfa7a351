//! The one entry point of operations: the typed methods, the C ABI and a
//! lone call all come to [`Communicator::submit`] (a group to
//! `Group::execute`): validate, check the state, then host memory on the
//! host algorithms (`algo::run`) or device memory on the device backend
//! (`device.rs`).

use crate::algo;
use crate::comm::communicator::Communicator;
use crate::comm::device::{drain_device_work, run_device};
use crate::comm::shared::lock;
use crate::error::Result;
use crate::observe;
use crate::op::tuner;
use crate::op::{Memory, Op, OpKind};
use crate::progress::xfer::Xfer;

impl Communicator {
    /// Validates, then runs one operation: host memory on the host
    /// algorithms (blocking), device memory on the device backend (enqueued
    /// on the operation's stream, like NCCL).
    ///
    /// # Safety
    /// The operation's pointers must be valid for the sizes it names (until
    /// its stream reaches it, for device memory).
    pub unsafe fn submit(&self, op: Op) -> Result<()> {
        if op.memory != Memory::Host {
            return unsafe { run_device(&[(self, op)]) };
        }
        self.admit(&op)?;
        if op.is_empty() {
            return Ok(());
        }
        drain_device_work(self);
        if self.takes_cross_engine(&op) {
            return self.run_on_cross_engine(&op, false);
        }
        // Under the resources' lock: a thread that saw the state turn Ready
        // waits here until init has installed them, so every rank decides
        // on the same shape.
        let shape = lock(&self.s.resources)
            .as_ref()
            .map_or(tuner::Shape::ranks(self.s.nranks), |c| c.shape());
        let d = tuner::decide(&op, &shape, &self.s.cfg.algo);
        let obs = observe::start(&self.s.who(), std::slice::from_ref(&op), false, d.name());
        let r = if op.kind == OpKind::Send {
            // Eager: returns once the message is in the peer's ring or
            // copied (`progress/eager.rs`).
            let x = Xfer::send(op.peer(), op.send, op.bytes());
            self.with_resources(op.name(), |c| {
                c.coll_seq += 1;
                c.send_eager(vec![x])
            })
            .map(|pending| self.kick_if(pending))
        } else {
            self.with_resources(op.name(), |c| algo::run(c, &op, d))
        };
        observe::finish(obs, &r);
        r
    }

    /// Waits until every send that returned early (eager host sends, see
    /// [`send`](Self::send)) is in its peer's ring, bounded by the
    /// configured timeout like any operation. Destroy does this itself.
    pub fn flush(&self) -> Result<()> {
        self.with_resources("flush", |c| {
            let t = c.ctx.cfg.timeout;
            c.flush_eager(t)
                .map_err(|e| c.eager_error("flushing eager sends", &e))
        })
    }
}
