//! The send and receive comms of [`super::ProxyNet`]: messages on one
//! proxied ring each way (an 8-byte header, payload length and tag, then
//! the payload padded to 8 bytes), copied in and out by the thread that
//! posts and tests them.

use super::{Attachment, HDR, MAX_REQUESTS, ring_err};
use crate::net::{MemKind, Mr, NetError, RecvBuf, RecvComm, Request, SendComm};
use crate::transport::pad8;
use crate::transport::shm::RingEnd;
use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;

fn host_mr(
    id: u64,
    base: *const u8,
    len: usize,
    kind: MemKind,
) -> std::result::Result<Mr, NetError> {
    match kind {
        MemKind::Host => Ok(Mr {
            id,
            base: base as usize,
            len,
            kind,
        }),
        MemKind::Device(_) => Err(NetError::Unsupported {
            net: "sidecar-proxy",
            what: "device memory (stage through pinned host memory)".into(),
        }),
    }
}

fn header(len: usize, tag: u32) -> [u8; HDR] {
    let mut h = [0u8; HDR];
    h[..4].copy_from_slice(&(len as u32).to_le_bytes());
    h[4..].copy_from_slice(&tag.to_le_bytes());
    h
}

/// A send being copied into the ring.
struct OutMsg {
    id: u64,
    src: *const u8,
    len: usize,
    tag: u32,
    /// Ring bytes written so far (header and padding included).
    pos: usize,
}

pub(super) struct ProxySend {
    pub(super) att: Arc<Attachment>,
    pub(super) ring: RingEnd,
    peer: String,
    queue: VecDeque<OutMsg>,
    /// Finished requests and their sizes, until tested.
    done: BTreeMap<u64, usize>,
    next: u64,
}

// SAFETY: the pointers in `queue` are the caller's, valid until tested
// (`isend`'s contract); the ring end is this comm's alone.
unsafe impl Send for ProxySend {}

impl ProxySend {
    pub(super) fn new(att: Arc<Attachment>, ring: RingEnd, peer: String) -> ProxySend {
        ProxySend {
            att,
            ring,
            peer,
            queue: VecDeque::new(),
            done: BTreeMap::new(),
            next: 0,
        }
    }

    /// Copies what fits of the queued sends into the ring, in order.
    fn progress(&mut self) -> std::result::Result<bool, NetError> {
        let mut moved = false;
        while let Some(m) = self.queue.front_mut() {
            let total = HDR + pad8(m.len);
            let mut space = self.ring.space().map_err(ring_err(&self.peer))?;
            let mut wrote = 0;
            if m.pos == 0 {
                if space < HDR {
                    break;
                }
                self.ring.write_at(0, header(m.len, m.tag).as_ptr(), HDR);
                wrote = HDR;
                space -= HDR;
                m.pos = HDR;
            }
            let off = m.pos - HDR;
            let n = space.min(pad8(m.len) - off) & !7;
            if n > 0 {
                let useful = (off + n).min(m.len).saturating_sub(off);
                // SAFETY: `src..src + len` is valid (`isend`'s contract).
                self.ring.write_at(wrote, unsafe { m.src.add(off) }, useful);
                wrote += n;
                m.pos += n;
            }
            if wrote > 0 {
                self.ring.publish(wrote);
                moved = true;
            }
            if m.pos < total {
                break;
            }
            let m = self.queue.pop_front().unwrap();
            self.done.insert(m.id, m.len);
        }
        Ok(moved)
    }
}

impl SendComm for ProxySend {
    fn peer(&self) -> &str {
        &self.peer
    }

    fn reg_mr(
        &mut self,
        base: *const u8,
        len: usize,
        kind: MemKind,
    ) -> std::result::Result<Mr, NetError> {
        self.next += 1;
        host_mr(self.next, base, len, kind)
    }

    fn dereg_mr(&mut self, _mr: &Mr) -> std::result::Result<(), NetError> {
        Ok(())
    }

    unsafe fn isend(
        &mut self,
        mr: &Mr,
        data: *const u8,
        len: usize,
        tag: u32,
    ) -> std::result::Result<Option<Request>, NetError> {
        if !mr.covers(data as usize, len) {
            return Err(NetError::InvalidArgument(format!(
                "a send of {len} bytes outside its registered region"
            )));
        }
        if len > u32::MAX as usize {
            return Err(NetError::InvalidArgument(format!(
                "a message of {len} bytes: the sidecar proxy carries at most {} a message",
                u32::MAX
            )));
        }
        self.att.health()?;
        if self.queue.len() + self.done.len() >= MAX_REQUESTS {
            return Ok(None);
        }
        self.next += 1;
        let id = self.next;
        self.queue.push_back(OutMsg {
            id,
            src: data,
            len,
            tag,
            pos: 0,
        });
        self.progress()?;
        Ok(Some(Request(id)))
    }

    fn test(&mut self, req: Request) -> std::result::Result<Option<usize>, NetError> {
        if let Some(n) = self.done.remove(&req.0) {
            return Ok(Some(n));
        }
        if !self.progress()? {
            self.att.health()?;
        }
        Ok(self.done.remove(&req.0))
    }
}

/// A posted receive.
struct InMsg {
    id: u64,
    dst: *mut u8,
    cap: usize,
    tag: u32,
    /// The message's length once its header was read.
    len: Option<usize>,
    /// Payload bytes (padding included) taken from the ring so far.
    off: usize,
}

pub(super) struct ProxyRecv {
    pub(super) att: Arc<Attachment>,
    pub(super) ring: RingEnd,
    peer: String,
    queue: VecDeque<InMsg>,
    done: BTreeMap<u64, usize>,
    next: u64,
}

// SAFETY: as for `ProxySend` (`irecv`'s contract).
unsafe impl Send for ProxyRecv {}

impl ProxyRecv {
    pub(super) fn new(att: Arc<Attachment>, ring: RingEnd, peer: String) -> ProxyRecv {
        ProxyRecv {
            att,
            ring,
            peer,
            queue: VecDeque::new(),
            done: BTreeMap::new(),
            next: 0,
        }
    }

    /// Copies what arrived into the posted receives, in order; a message
    /// whose tag or size does not fit its receive is an error naming the
    /// peer (the ranks run different operations).
    fn progress(&mut self) -> std::result::Result<bool, NetError> {
        let mut moved = false;
        while let Some(m) = self.queue.front_mut() {
            let mut avail = self.ring.available().map_err(ring_err(&self.peer))?;
            if m.len.is_none() {
                if avail < HDR {
                    break;
                }
                let mut h = [0u8; HDR];
                let [(a, la), (b, lb)] = self.ring.regions(0, HDR);
                // SAFETY: `HDR` published bytes at our position.
                unsafe {
                    std::ptr::copy_nonoverlapping(a, h.as_mut_ptr(), la);
                    std::ptr::copy_nonoverlapping(b, h.as_mut_ptr().add(la), lb);
                }
                let len = u32::from_le_bytes(h[..4].try_into().unwrap()) as usize;
                let tag = u32::from_le_bytes(h[4..].try_into().unwrap());
                if tag != m.tag {
                    return Err(NetError::Peer {
                        peer: self.peer.clone(),
                        what: format!(
                            "a message tagged {tag:#x} arrived where {:#x} was expected: the ranks run different operations",
                            m.tag
                        ),
                    });
                }
                if len > m.cap {
                    return Err(NetError::Peer {
                        peer: self.peer.clone(),
                        what: format!(
                            "a message of {len} bytes arrived for a receive of {}: the ranks run different operations",
                            m.cap
                        ),
                    });
                }
                self.ring.consume(HDR);
                avail -= HDR;
                m.len = Some(len);
                moved = true;
            }
            let len = m.len.unwrap_or(0);
            let n = avail.min(pad8(len) - m.off);
            if n > 0 {
                let useful = (m.off + n).min(len).saturating_sub(m.off);
                let [(a, la), (b, lb)] = self.ring.regions(0, useful);
                // SAFETY: `useful` published bytes at our position; the
                // destination lies inside the posted receive (`irecv`).
                unsafe {
                    std::ptr::copy_nonoverlapping(a, m.dst.add(m.off), la);
                    std::ptr::copy_nonoverlapping(b, m.dst.add(m.off + la), lb);
                }
                self.ring.consume(n);
                m.off += n;
                moved = true;
            }
            if m.off < pad8(len) {
                break;
            }
            let m = self.queue.pop_front().unwrap();
            self.done.insert(m.id, len);
        }
        Ok(moved)
    }
}

impl RecvComm for ProxyRecv {
    fn peer(&self) -> &str {
        &self.peer
    }

    fn reg_mr(
        &mut self,
        base: *const u8,
        len: usize,
        kind: MemKind,
    ) -> std::result::Result<Mr, NetError> {
        self.next += 1;
        host_mr(self.next, base, len, kind)
    }

    fn dereg_mr(&mut self, _mr: &Mr) -> std::result::Result<(), NetError> {
        Ok(())
    }

    unsafe fn irecv(
        &mut self,
        bufs: &[RecvBuf<'_>],
    ) -> std::result::Result<Option<Request>, NetError> {
        let [b] = bufs else {
            return Err(NetError::InvalidArgument(format!(
                "{} buffers in one receive: the sidecar proxy takes 1",
                bufs.len()
            )));
        };
        if !b.mr.covers(b.ptr as usize, b.len) {
            return Err(NetError::InvalidArgument(format!(
                "a receive of {} bytes outside its registered region",
                b.len
            )));
        }
        self.att.health()?;
        if self.queue.len() + self.done.len() >= MAX_REQUESTS {
            return Ok(None);
        }
        self.next += 1;
        let id = self.next;
        self.queue.push_back(InMsg {
            id,
            dst: b.ptr,
            cap: b.len,
            tag: b.tag,
            len: None,
            off: 0,
        });
        self.progress()?;
        Ok(Some(Request(id)))
    }

    fn test(&mut self, req: Request) -> std::result::Result<Option<Vec<usize>>, NetError> {
        if let Some(n) = self.done.remove(&req.0) {
            return Ok(Some(vec![n]));
        }
        if !self.progress()? {
            self.att.health()?;
        }
        Ok(self.done.remove(&req.0).map(|n| vec![n]))
    }
}
