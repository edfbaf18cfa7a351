//! Eager host sends: a host-memory send returns before its peer has posted
//! the matching receive.
//!
//! Without this, `send(next); recv(prev)` issued unbatched on every rank of a
//! ring (each call blocking, as `ncclSend`/`ncclRecv` on host memory are)
//! deadlocks once a message exceeds the ring between two ranks: every rank
//! waits in its send for a peer that waits in its own send.
//!
//! How it works:
//! - **Eager sends.** A host send submitted alone (or a group whose batch on
//!   a communicator holds only sends) first progresses without waiting
//!   ([`Wait::NoSleep`]): whatever fits in the peer's ring (shared memory) or
//!   socket buffer (TCP) goes at once. Whatever is left is copied into a
//!   buffer owned by the communicator and queued as a [`Pending`] send: the
//!   transfer keeps its progress (sequence number, stream position), so it
//!   resumes exactly where it stopped, and the call returns.
//! - **Order.** Pending sends go first in every later `exec` on the
//!   communicator (receives, collectives, more sends). The engine runs
//!   transfers to one peer in one direction in list order, so per-peer order
//!   is kept; the `exec` returns when *its* transfers are done, and pending
//!   sends progress alongside (the `recv(prev)` after an eager `send(next)`
//!   pushes the send while it receives: no deadlock).
//! - **Background flusher** (`comm/flusher.rs`). A rank that sends and then
//!   makes no more calls must still deliver: a progress thread per
//!   communicator (started on the first pending send, ended by destroy or
//!   abort) pushes pending sends while the communicator is idle. It only
//!   takes the communicator's lock with `try_lock`, holds it for at most
//!   `FLUSH_SLICE` at a time, and
//!   sleeps on the rank's futex doorbell (shared memory) or in poll(2) (TCP)
//!   between attempts: it never busy-spins and never starves the caller (a
//!   caller's `exec` pushes pending sends itself).
//! - **Failures.** A failure while the flusher pushes (the peer exited or
//!   destroyed its communicator first, `WEFT_TIMEOUT_MS` without progress)
//!   fails the communicator: it becomes its async error (NCCL's
//!   `ncclCommGetAsyncError`), naming the peer and the bytes not delivered.
//! - **Destroy** flushes what is pending, bounded by `WEFT_TIMEOUT_MS` when
//!   set, else by `WEFT_PEER_TIMEOUT_MS` without progress, by the peer's
//!   exit or destroy, and by abort; if the flush fails, destroy still
//!   releases everything and returns an error naming the peer. **Abort**
//!   drops pending sends. [`Communicator::flush`](crate::comm::Communicator::flush)
//!   waits for them explicitly.
//! - **Limit.** At most `WEFT_EAGER_MAX_BYTES` (default 1 GiB) of copies are
//!   held per communicator; a send that would exceed it blocks until it is in
//!   its peer's ring, as every host send did before (and may then deadlock in
//!   the unbatched ring pattern: batch such sends with a group).

use crate::error::{Error, Result};
use crate::progress::resources::Resources;
use crate::progress::xfer::{Wait, Xfer};
use std::time::Duration;

/// `WEFT_EAGER_MAX_BYTES`, read once per process.
pub(crate) fn max_bytes() -> usize {
    use std::sync::OnceLock;
    static MAX: OnceLock<usize> = OnceLock::new();
    *MAX.get_or_init(|| {
        let p = weft_contract::params::WEFT_EAGER_MAX_BYTES;
        p.get().or_else(|| p.default_value()).unwrap_or(1 << 30)
    })
}

impl Resources {
    /// Runs a batch of sends eagerly (see the module docs). Returns whether
    /// something is left pending (the caller then kicks the flusher).
    pub(crate) fn send_eager(&mut self, mut xs: Vec<Xfer>) -> Result<bool> {
        debug_assert!(xs.iter().all(|x| x.send));
        if xs.iter().any(|x| x.peer == self.ctx.rank) {
            // Sends to ourselves need their receive in the same batch: the
            // engine reports the mismatch.
            self.exec(&mut xs)?;
            return Ok(!self.eager.is_empty());
        }
        self.exec_with(&mut xs, Wait::NoSleep { until: None })?;
        let left: usize = xs
            .iter()
            .filter(|x| !x.p.done)
            .map(|x| x.len - x.p.payload.min(x.len))
            .sum();
        if left > 0 && self.eager.bytes + left > max_bytes() {
            // Over the cap: wait until this batch is in the peers' rings.
            crate::log::info_log!(
                "comm {} rank {}: {} eager bytes held, {left} more would exceed WEFT_EAGER_MAX_BYTES={}: this send blocks",
                self.ctx.label,
                self.ctx.rank,
                self.eager.bytes,
                max_bytes()
            );
            self.exec(&mut xs)?;
            return Ok(!self.eager.is_empty());
        }
        for x in xs.into_iter().filter(|x| !x.p.done) {
            self.eager.push(x);
        }
        Ok(!self.eager.is_empty())
    }

    /// Waits until every pending eager send is in its peer's ring, giving up
    /// after `timeout` without progress.
    pub(crate) fn flush_eager(&mut self, timeout: Option<Duration>) -> Result<()> {
        if self.eager.is_empty() {
            return Ok(());
        }
        self.exec_with(&mut [], Wait::All { timeout }).map(|_| ())
    }

    /// The flusher's checks while its sends make no progress: peers alive,
    /// the communicator's timeout.
    pub(crate) fn eager_idle_check(&self, idle: Duration) -> Result<()> {
        self.check_peers(self.eager.pending.iter().map(|p| p.x.peer))?;
        if let Some(t) = self.ctx.cfg.timeout
            && idle >= t
        {
            return Err(Error::Timeout {
                comm: self.ctx.label.clone(),
                rank: self.ctx.rank,
                after_ms: t.as_millis() as u64,
                waiting_for: format!("delivering earlier sends to {}", self.eager.describe()),
            });
        }
        Ok(())
    }

    /// The error to report when pending sends could not be delivered.
    pub(crate) fn eager_error(&self, what: &str, e: &Error) -> Error {
        Error::Remote {
            comm: self.ctx.label.clone(),
            rank: self.ctx.rank,
            detail: format!(
                "{what}: sends that had returned to the caller were never fully received by {}: {e}; \
                 check that every send has a matching receive on its peer, posted before the peer destroys its communicator",
                self.eager.describe()
            ),
        }
    }
}
