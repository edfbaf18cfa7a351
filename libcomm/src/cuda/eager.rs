//! Eager sends on device memory: a send that does not hold the caller's
//! stream until the peer's receive is posted.
//!
//! # The problem
//!
//! Point-to-point on the kernel path is a rendezvous: a send kernel waits for
//! its receiver (the receive kernel's `RREADY` across processes, `DONE` in one
//! process). The standard ring, issued unbatched on every rank on one stream,
//! `ncclSend(next); ncclRecv(prev)`, then deadlocks: every rank's send kernel
//! waits for a receive that is queued behind it on the same stream.
//!
//! # The design
//!
//! A batch of one communicator that holds only sends (an unbatched
//! `ncclSend`, or a group of sends only) outside graph capture runs eagerly
//! ([`DevComm::launch_p2p_eager`]):
//!
//! 1. On the caller's stream: each send's data is copied into a staging
//!    buffer from this communicator's stream-ordered memory pool
//!    (`cuMemAllocFromPoolAsync` + `cuMemcpyDtoDAsync`), and an event is
//!    recorded. The caller's stream carries only the copy: once it is done the
//!    caller may overwrite its send buffer, as stream order promises, and the
//!    stream's next operation (the receive) runs.
//! 2. On the communicator's side stream (created lazily,
//!    `CU_STREAM_NON_BLOCKING`, so it never waits for the legacy NULL stream):
//!    wait for the event, run the usual send kernel (`weft_p2p`) from the
//!    staging buffers, then `cuMemFreeAsync` them on the side stream.
//!
//! The wire protocol is unchanged, so an eager send matches a receive issued
//! unbatched or in a group, eager or not on the other side.
//!
//! The pool is our own (`cuMemPoolCreate`), not the device's default pool:
//! in one process the receiver reads the sender's buffer in place, possibly
//! from another GPU, and stream-ordered allocations are visible to other
//! devices only through `cuMemPoolSetAccess` (peer access of the context does
//! not cover them). Its release threshold is unlimited, so repeated sends
//! reuse the memory; it is returned when the communicator finalizes. The
//! pool must not reuse a block whose free is still pending on the side
//! stream by making the caller's stream wait for it
//! (`CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES` off): that free
//! follows a send kernel that waits for the peer, so the caller's stream
//! would wait for the peer's receive again (deadlock when two ranks each
//! send twice before receiving).
//!
//! Cost and limits: one extra device-to-device copy per send on the
//! caller's stream (about 3 TB/s on an H100: 64 MiB in ~25-45 us), and
//! staging memory equal to the bytes of the sends in flight (sends whose
//! receive has not finished), kept in the pool until the communicator ends.
//!
//! # Why concurrent kernels of one communicator do not race
//!
//! A side-stream send may run while later kernels of the same communicator
//! run on the caller's stream (a receive, a grouped exchange, a collective).
//! Sequence numbers per peer and direction are assigned at enqueue
//! (`send_seq`/`recv_seq` in `launch.rs`), so they follow issue order whatever
//! stream runs the kernel. The shared state, piece by piece:
//!
//! - Direct path (one process), the receiver's `PTR[sender]` slot and
//!   `READY[sender]`: two sends to one peer may now run at once (an eager one
//!   on the side stream, a grouped one on the caller's stream). The later one
//!   would overwrite the slot the receiver is still reading, or raise `READY`
//!   past the earlier send's sequence number. So a direct send first waits
//!   until `DONE[peer] >= seq - 1` on its own flags (the receiver finished the
//!   previous send to it) before it writes its slot. That wait ends: send
//!   `seq - 1` was issued earlier, its kernel does not depend on send `seq`,
//!   and its receive is the peer's previous receive from us.
//! - Direct path, the receiver's `COUNT[sender]`: receives stay on the
//!   caller's stream in issue order, and receive `seq` cannot start copying
//!   before `READY >= seq`, which (above) comes after `DONE >= seq - 1`, i.e.
//!   after every block of receive `seq - 1` counted. So the counts of two
//!   receives never interleave and the `base` assigned at enqueue holds.
//! - Across processes (FIFO), the sender waits for `RREADY[peer] >= seq`
//!   (`wait_progress` is a >= wait) before it reads `RBYTES` or writes a
//!   tail or a slot in the receiver's scratch region for it. The receiver
//!   raises `RREADY` to `seq` only when receive `seq` runs, which is after
//!   receive `seq - 1` drained every slot (same stream, or a later kernel);
//!   so send `seq` never writes a slot, tail or `RBYTES` that send `seq - 1`
//!   or its receive still use. Credits and tails carry `seq << 32` tags, so
//!   an earlier operation's values never satisfy a later wait, and a later
//!   operation's values satisfy an earlier (>=) wait only once it is over.
//! - Scratch: an eager send across processes writes only into the
//!   *receiver's* scratch, and only while the receiver's receive kernel runs
//!   (between its `RREADY` and its last credit); collectives on the receiver
//!   run before or after that kernel on its stream, never during it. The
//!   sender's own scratch is not touched by a send, so the sender's later
//!   collectives on its stream may run beside it. In one process a send
//!   touches no scratch at all.
//! - Flag offsets: point-to-point words (`WEFT_P2P_*`, 8 KiB to 21 KiB of the
//!   flag area) are disjoint from the barrier flags, pointers, progress,
//!   chain, lines and LL words of the collectives.
//! - The staging buffer lives until the send kernel ends, which is after the
//!   receiver read it (direct: `DONE >= seq`; FIFO: the last credit).
//!
//! Receives that the caller spreads over several streams of one
//! communicator at once are not ordered by anything (as before this change).
//! Ranks of one process must each have their own stream: two ranks on one
//! stream (the legacy NULL stream, say) still serialize one rank's receive
//! before the other's staging copy, which the send waits for.
//!
//! # Lifecycle
//!
//! `finalize` synchronizes the context (side stream included) before it
//! frees anything, then destroys the side stream, its event and the pool.
//! So destroying a communicator waits for its sends in flight, as it waits
//! for any kernel of it; a send whose receive never comes is ended by
//! `ncclCommAbort`, not by destroy (with the rendezvous send the caller's
//! stream hung there instead).
//! Abort sets the status word every spin loop polls, so a side-stream send
//! waiting for a peer returns; abort itself waits for nothing. Graph capture
//! is refused before this point (`batch.rs`); a capture would also need the
//! side stream forked into the graph, which this path does not do.
//!
//! Ranks of different processes sharing one GPU time-slice: nothing here
//! needs kernels of two processes to run at the same instant (a spin loop
//! waits for a flag that the other process's kernel writes in its own time
//! slice). In one process the side-stream send and the caller's receive run
//! concurrently, as kernels of one context on two streams do.

use super::devcomm::DevComm;
use super::driver::use_device;
use super::error::{CudaError, CudaResult, check};
use super::logger::warn;
use super::p2p::P2p;
use super::side_stream::SideStream;
use cudarc::driver::sys;
use std::ffi::c_void;

/// Whether a communicator's point-to-point pieces of one batch may run
/// eagerly: there are some, and all are sends to other ranks (a send to
/// oneself pairs with a receive into a copy; a receive must run on the
/// caller's stream).
pub(super) fn sends_only(pieces: &[P2p], me: usize) -> bool {
    !pieces.is_empty()
        && pieces
            .iter()
            .all(|p| matches!(*p, P2p::Send { peer, .. } if peer != me))
}

impl DevComm {
    /// Enqueues a batch of sends only (see the module docs): the copies into
    /// staging on `stream`, the send kernels on the side stream.
    ///
    /// # Safety
    /// As [`DevComm::launch_p2p`]; `pieces` are sends to other ranks.
    pub unsafe fn launch_p2p_eager(
        &mut self,
        pieces: &[P2p],
        stream: *mut c_void,
    ) -> CudaResult<()> {
        use_device(self.dev)?;
        if self.eager.is_none() && !self.eager_off {
            match SideStream::create(self.dev, &self.peer_devs) {
                Ok(e) => self.eager = Some(e),
                Err(err) => {
                    // No side stream or pool here (a device without
                    // stream-ordered memory, say): sends stay rendezvous,
                    // correct for every program that posts receives first.
                    self.eager_off = true;
                    warn(&format!(
                        "eager sends unavailable on GPU {} ({err}): a send waits on its stream for the peer's receive",
                        self.dev
                    ));
                }
            }
        }
        let Some(e) = self.eager.as_ref() else {
            return unsafe { self.launch_p2p(pieces, stream) };
        };
        let (side, event, pool) = (e.stream, e.event, e.pool);
        let user = stream as sys::CUstream;
        let mut staged: Vec<P2p> = Vec::with_capacity(pieces.len());
        let mut buffers: Vec<u64> = Vec::with_capacity(pieces.len());
        let copied = (|| -> CudaResult<()> {
            for p in pieces {
                let P2p::Send { peer, ptr, bytes } = *p else {
                    return Err(CudaError::InvalidUsage(
                        "an eager batch holds only sends".into(),
                    ));
                };
                let mut buf: sys::CUdeviceptr = 0;
                unsafe {
                    check(
                        sys::cuMemAllocFromPoolAsync(&mut buf, bytes.max(16), pool, user),
                        "cuMemAllocFromPoolAsync (staging of an eager send)",
                    )?;
                    buffers.push(buf);
                    check(
                        sys::cuMemcpyDtoDAsync_v2(buf, ptr, bytes, user),
                        "cuMemcpyDtoDAsync (staging of an eager send)",
                    )?;
                }
                staged.push(P2p::Send {
                    peer,
                    ptr: buf,
                    bytes,
                });
            }
            unsafe {
                check(sys::cuEventRecord(event, user), "cuEventRecord")?;
                check(sys::cuStreamWaitEvent(side, event, 0), "cuStreamWaitEvent")
            }
        })();
        if let Err(e) = copied {
            // Nothing was launched: give the staging back in the caller's
            // stream order (after any copy that was enqueued).
            for b in buffers {
                unsafe {
                    let _ = sys::cuMemFreeAsync(b, user);
                }
            }
            return Err(e);
        }
        let launched = unsafe { self.launch_p2p(&staged, side.cast()) };
        // After the send kernels on the side stream (or at once there if the
        // launch failed: nothing of ours reads them then).
        for b in buffers {
            unsafe {
                check(
                    sys::cuMemFreeAsync(b, side),
                    "cuMemFreeAsync (staging of an eager send)",
                )?;
            }
        }
        launched
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::types::DataType;
    use crate::op::Op;

    /// Unbatched sends, groups of sends and a non-root gather are eager;
    /// anything with a receive, a copy or a send to oneself is not.
    #[test]
    fn only_batches_of_sends_to_others_are_eager() {
        let send = |peer| P2p::Send {
            peer,
            ptr: 64,
            bytes: 8,
        };
        let recv = |peer| P2p::Recv {
            peer,
            ptr: 128,
            bytes: 8,
        };
        assert!(sends_only(&[send(1)], 0));
        assert!(sends_only(&[send(1), send(2), send(1)], 0));
        assert!(!sends_only(&[], 0));
        assert!(!sends_only(&[send(1), recv(2)], 0));
        assert!(!sends_only(&[recv(1)], 0));
        assert!(!sends_only(&[send(0)], 0));
        let g = Op::gather(100 as *const u8, 1000 as *mut u8, 2, DataType::F32, 1);
        let on = |rank| super::super::p2p::p2p_pieces(&g, rank, 3).unwrap();
        assert!(sends_only(&on(0), 0), "a non-root gather only sends");
        assert!(!sends_only(&on(1), 1), "the root receives");
        let sc = Op::scatter(100 as *const u8, 1000 as *mut u8, 2, DataType::F32, 0);
        assert!(
            !sends_only(&super::super::p2p::p2p_pieces(&sc, 0, 3).unwrap(), 0),
            "the root of a scatter copies its own block"
        );
    }
}
