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

fn host_mr(id: u64, base: *const u8, len: usize, kind: MemKind) -> Result<Mr, NetError> {
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
pub(super) struct OutMsg {
    id: u64,
    src: *const u8,
    len: usize,
    tag: u32,
    /// Ring bytes written so far (header and padding included).
    pos: usize,
}

/// A posted receive.
pub(super) struct InMsg {
    id: u64,
    dst: *mut u8,
    cap: usize,
    tag: u32,
    /// The message's length once its header was read.
    len: Option<usize>,
    /// Payload bytes (padding included) taken from the ring so far.
    off: usize,
}

/// One direction of a proxied channel: its ring end, the requests posted
/// and not yet through the ring (in posting order: messages are matched in
/// order), and those done until tested.
pub(super) struct Requests<M> {
    pub(super) att: Arc<Attachment>,
    pub(super) ring: RingEnd,
    peer: String,
    queue: VecDeque<M>,
    /// Finished requests and their sizes, until tested.
    done: BTreeMap<u64, usize>,
    /// The last id given (requests and registrations share the counter).
    next: u64,
}

// SAFETY: the pointers in `queue` are the caller's, valid until tested
// (`isend`'s and `irecv`'s contracts); the ring end is this comm's alone.
unsafe impl<M> Send for Requests<M> {}

impl<M> Requests<M> {
    fn new(att: Arc<Attachment>, ring: RingEnd, peer: String) -> Requests<M> {
        Requests {
            att,
            ring,
            peer,
            queue: VecDeque::new(),
            done: BTreeMap::new(),
            next: 0,
        }
    }

    fn id(&mut self) -> u64 {
        self.next += 1;
        self.next
    }

    fn reg(&mut self, base: *const u8, len: usize, kind: MemKind) -> Result<Mr, NetError> {
        let id = self.id();
        host_mr(id, base, len, kind)
    }

    /// Queues a request made by `make` from its id, unless the link failed
    /// (an error) or too many are in flight (`None`: post it again later);
    /// then moves what it can.
    fn post(
        &mut self,
        make: impl FnOnce(u64) -> M,
        progress: fn(&mut Self) -> Result<bool, NetError>,
    ) -> Result<Option<Request>, NetError> {
        self.att.health()?;
        if self.queue.len() + self.done.len() >= MAX_REQUESTS {
            return Ok(None);
        }
        let id = self.id();
        self.queue.push_back(make(id));
        progress(self)?;
        Ok(Some(Request(id)))
    }

    /// The size of request `req` once done; moves what it can first, and
    /// looks at the link's health when nothing moved.
    fn test(
        &mut self,
        req: Request,
        progress: fn(&mut Self) -> Result<bool, NetError>,
    ) -> Result<Option<usize>, NetError> {
        if let Some(n) = self.done.remove(&req.0) {
            return Ok(Some(n));
        }
        if !progress(self)? {
            self.att.health()?;
        }
        Ok(self.done.remove(&req.0))
    }
}

impl Requests<OutMsg> {
    /// Copies what fits of the queued sends into the ring, in order.
    fn progress(&mut self) -> Result<bool, NetError> {
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

impl Requests<InMsg> {
    /// Copies what arrived into the posted receives, in order; a message
    /// whose tag or size does not fit its receive is an error naming the
    /// peer (the ranks run different operations).
    fn progress(&mut self) -> Result<bool, NetError> {
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

/// The sending end of a proxied channel.
pub(super) struct ProxySend(pub(super) Requests<OutMsg>);

impl ProxySend {
    pub(super) fn new(att: Arc<Attachment>, ring: RingEnd, peer: String) -> ProxySend {
        ProxySend(Requests::new(att, ring, peer))
    }
}

impl SendComm for ProxySend {
    fn peer(&self) -> &str {
        &self.0.peer
    }

    fn reg_mr(&mut self, base: *const u8, len: usize, kind: MemKind) -> Result<Mr, NetError> {
        self.0.reg(base, len, kind)
    }

    fn dereg_mr(&mut self, _mr: &Mr) -> Result<(), NetError> {
        Ok(())
    }

    unsafe fn isend(
        &mut self,
        mr: &Mr,
        data: *const u8,
        len: usize,
        tag: u32,
    ) -> Result<Option<Request>, NetError> {
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
        let make = |id| OutMsg {
            id,
            src: data,
            len,
            tag,
            pos: 0,
        };
        self.0.post(make, Requests::<OutMsg>::progress)
    }

    fn test(&mut self, req: Request) -> Result<Option<usize>, NetError> {
        self.0.test(req, Requests::<OutMsg>::progress)
    }
}

/// The receiving end of a proxied channel.
pub(super) struct ProxyRecv(pub(super) Requests<InMsg>);

impl ProxyRecv {
    pub(super) fn new(att: Arc<Attachment>, ring: RingEnd, peer: String) -> ProxyRecv {
        ProxyRecv(Requests::new(att, ring, peer))
    }
}

impl RecvComm for ProxyRecv {
    fn peer(&self) -> &str {
        &self.0.peer
    }

    fn reg_mr(&mut self, base: *const u8, len: usize, kind: MemKind) -> Result<Mr, NetError> {
        self.0.reg(base, len, kind)
    }

    fn dereg_mr(&mut self, _mr: &Mr) -> Result<(), NetError> {
        Ok(())
    }

    unsafe fn irecv(&mut self, bufs: &[RecvBuf<'_>]) -> Result<Option<Request>, NetError> {
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
        let make = |id| InMsg {
            id,
            dst: b.ptr,
            cap: b.len,
            tag: b.tag,
            len: None,
            off: 0,
        };
        self.0.post(make, Requests::<InMsg>::progress)
    }

    fn test(&mut self, req: Request) -> Result<Option<Vec<usize>>, NetError> {
        Ok(self
            .0
            .test(req, Requests::<InMsg>::progress)?
            .map(|n| vec![n]))
    }
}
