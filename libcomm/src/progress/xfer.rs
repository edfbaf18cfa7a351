//! The units the progress engine works on, in one leaf module that
//! everything above the engine can name without importing the engine (or
//! the resources it runs on): a transfer ([`Xfer`]), how long a run waits
//! ([`Wait`]), and the eager sends still in flight ([`Pending`] in a
//! [`Queue`], which a communicator's resources own: `eager.rs`).

use crate::transport::{Progress, Reduce};
use std::time::{Duration, Instant};

/// One send or receive of a batch, and how far it got.
pub(crate) struct Xfer {
    pub peer: usize,
    pub send: bool,
    pub ptr: *mut u8,
    pub len: usize,
    pub red: Option<Reduce>,
    /// Index of a receive in the same batch whose delivered bytes bound this send.
    pub gate: Option<usize>,
    pub p: Progress,
    /// Its sequence number was taken (`exec.rs`, on the first step).
    pub(super) started: bool,
}

impl Xfer {
    pub fn send(peer: usize, ptr: *const u8, len: usize) -> Xfer {
        Xfer {
            peer,
            send: true,
            ptr: ptr as *mut u8,
            len,
            red: None,
            gate: None,
            p: Progress::default(),
            started: false,
        }
    }
    pub fn recv(peer: usize, ptr: *mut u8, len: usize) -> Xfer {
        Xfer {
            send: false,
            ..Xfer::send(peer, ptr, len)
        }
    }
    pub fn recv_reduce(peer: usize, ptr: *mut u8, len: usize, red: Reduce) -> Xfer {
        Xfer {
            red: Some(red),
            ..Xfer::recv(peer, ptr, len)
        }
    }
    pub fn gated(mut self, on: usize) -> Xfer {
        self.gate = Some(on);
        self
    }
}

/// How long an `exec` waits.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Wait {
    /// Until the batch is done (the communicator's pending eager sends
    /// progress alongside but need not finish).
    Batch,
    /// Until the batch and every pending eager send are done, giving up after
    /// `timeout` without progress.
    All { timeout: Option<Duration> },
    /// Never sleeps: returns once a pass over the batch and the pending sends
    /// makes no progress, everything is done, or `until` has passed.
    NoSleep { until: Option<Instant> },
}

/// A send that returned to its caller before its peer had everything.
pub(crate) struct Pending {
    pub x: Xfer,
    /// The copy `x` sends from (its first bytes, already sent, are never
    /// touched: for large messages those pages are never even allocated).
    _buf: Vec<u8>,
    /// Bytes copied (not yet sent when the call returned).
    pub bytes: usize,
}

// SAFETY: `x` points into `_buf`, which moves with it.
unsafe impl Send for Pending {}

/// A communicator's pending eager sends, in the order they were issued.
#[derive(Default)]
pub(crate) struct Queue {
    pub pending: Vec<Pending>,
    /// Sum of the pending sends' `bytes`.
    pub bytes: usize,
    /// The doorbell value read at the start of the engine's last pass (the
    /// flusher sleeps while it is unchanged).
    pub seen: u32,
}

impl Queue {
    pub fn is_empty(&self) -> bool {
        self.pending.is_empty()
    }

    /// Puts back what the engine took out, dropping the sends now done.
    pub(crate) fn put_back(&mut self, mut pre: Vec<Pending>) {
        pre.retain(|p| !p.x.p.done);
        self.bytes = pre.iter().map(|p| p.bytes).sum();
        self.pending = pre;
    }

    /// Copies what `x` has not sent yet and queues it.
    pub(super) fn push(&mut self, mut x: Xfer) {
        let sent = x.p.payload.min(x.len);
        // Zeroed memory: large blocks come straight from mmap, so the pages
        // of the part already sent are never touched.
        let mut buf = vec![0u8; x.len];
        // SAFETY: the caller's buffer is valid for `x.len` bytes (the
        // submit contract) and does not overlap our fresh copy.
        unsafe {
            std::ptr::copy_nonoverlapping(x.ptr.add(sent), buf.as_mut_ptr().add(sent), x.len - sent)
        };
        x.ptr = buf.as_mut_ptr();
        let bytes = x.len - sent;
        self.bytes += bytes;
        self.pending.push(Pending {
            x,
            _buf: buf,
            bytes,
        });
    }

    /// "rank P (N bytes)" for each peer with pending sends, for messages.
    pub(crate) fn describe(&self) -> String {
        let mut per: Vec<(usize, usize)> = Vec::new();
        for p in &self.pending {
            let left = p.x.len - p.x.p.payload.min(p.x.len);
            match per.iter_mut().find(|(r, _)| *r == p.x.peer) {
                Some((_, n)) => *n += left,
                None => per.push((p.x.peer, left)),
            }
        }
        per.iter()
            .map(|(r, n)| format!("rank {r} ({n} bytes)"))
            .collect::<Vec<_>>()
            .join(", ")
    }
}
