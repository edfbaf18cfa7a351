//! Operations on device memory: one call, or a batch (a group's, host
//! memory included), handed to the device backend (`op/backend.rs`) after
//! every operation's checks; the backend sees the communicators only as
//! [`Comms`] and hands host-memory work back to the host path (`host.rs`).
//! This module is the only one of the core that names `cuda/` (in
//! `device_backend`), and `cuda/` never imports it.

use crate::comm::communicator::Communicator;
use crate::comm::host::run_host;
use crate::comm::shared::lock;
use crate::error::{Error, Result};
use crate::observe;
use crate::op::backend::{Backend, Comms, DeviceSlot, Item};
use crate::op::tuner::Decision;
use crate::op::{Memory, Op};
use std::sync::MutexGuard;

/// The backend for device memory: the one place the core names `cuda/`
/// (which never imports this module back).
fn device_backend() -> &'static dyn Backend {
    &crate::cuda::CudaBackend
}

/// Runs a batch holding device-memory operations (one call, or a group's
/// operations, host memory included) on the device backend, after the
/// checks of every operation.
///
/// # Safety
/// As [`Backend::run`].
pub(crate) unsafe fn run_device(ops: &[(&Communicator, Op)]) -> Result<()> {
    for (c, op) in ops {
        c.admit(op)?;
        if let DeviceSlot::On(dc) = &*lock(&c.s.dev)
            && let Some(e) = dc.kernel_error()
        {
            return Err(Error::InvalidUsage(format!(
                "{}: an earlier operation failed on the GPU: {e}",
                c.describe()
            )));
        }
    }
    let mut lent = Lent { comms: Vec::new() };
    let mut items = Vec::with_capacity(ops.len());
    for (c, op) in ops {
        let i = match lent.comms.iter().position(|x| std::ptr::eq(*x, *c)) {
            Some(i) => i,
            None => {
                lent.comms.push(c);
                lent.comms.len() - 1
            }
        };
        items.push(Item { comm: i, op: *op });
    }
    let r = unsafe { device_backend().run(&lent, &items) };
    for c in &lent.comms {
        if c.s.device_word().is_none() {
            let word = match &*lock(&c.s.dev) {
                DeviceSlot::On(dc) => Some(dc.abort_word()),
                _ => None,
            };
            if let Some(w) = word {
                c.s.watch_device(w);
            }
        }
    }
    r
}

/// The communicators of one batch, as a backend sees them ([`Comms`]).
struct Lent<'a> {
    comms: Vec<&'a Communicator>,
}

impl Comms for Lent<'_> {
    fn rank(&self, c: usize) -> usize {
        self.comms[c].s.rank
    }

    fn nranks(&self, c: usize) -> usize {
        self.comms[c].s.nranks
    }

    fn describe(&self, c: usize) -> String {
        self.comms[c].describe()
    }

    fn device_slot(&self, c: usize) -> MutexGuard<'_, DeviceSlot> {
        lock(&self.comms[c].s.dev)
    }

    unsafe fn run_host(&self, items: &[Item]) -> Result<()> {
        let mut ops = Vec::with_capacity(items.len());
        for it in items {
            debug_assert_eq!(it.op.memory, Memory::Host);
            let comm = self.comms[it.comm];
            comm.validate(&it.op)?;
            ops.push((comm, it.op));
        }
        // SAFETY: `Comms::run_host`'s contract (as `Group::push`'s).
        unsafe { run_host(ops) }
    }

    fn observed(
        &self,
        c: usize,
        ops: &[Op],
        group: bool,
        decision: Decision,
        f: &mut dyn FnMut() -> Result<()>,
    ) -> Result<()> {
        let obs = observe::start(&self.comms[c].s.who(), ops, group, decision.name());
        let r = f();
        observe::finish(obs, &r);
        r
    }
}
