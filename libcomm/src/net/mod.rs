//! The byte mover seam: how the cross-host progress engine (`crosshost/`)
//! moves bytes between hosts, shaped like NCCL's network plugin interface
//! (`ncclNet_v8`..`v10`), so that an RDMA transport or an adapter around an
//! NCCL net plugin (IB verbs, EFA) can be added without touching the
//! algorithms or the engine.
//!
//! The calls, and their NCCL counterparts:
//!
//! | here | NCCL | what |
//! |---|---|---|
//! | [`Net::devices`], [`Net::properties`] | `devices`, `getProperties` | the NICs and what they can do ([`Properties`]) |
//! | [`Net::listen`] | `listen` | a [`ConnectHandle`] (opaque bytes, at most [`HANDLE_MAX`], sent to the peer out of band) and a [`ListenComm`] |
//! | [`Net::connect`] | `connect` | a [`SendComm`] to the listener the handle names |
//! | [`ListenComm::accept`] | `accept` | a [`RecvComm`], with the [`Peer`] the connector said it is |
//! | `reg_mr` / `dereg_mr` | `regMr` / `deregMr` | memory registration, host or device ([`MemKind`]) |
//! | [`SendComm::isend`], [`RecvComm::irecv`] | `isend`, `irecv` | post a transfer; `Ok(None)`: not now (too many in flight), post again later |
//! | `test` | `test` | poll one request |
//! | [`RecvComm::iflush`] | `iflush` | make received data visible to the GPU (GPUDirect RDMA); nothing to do on TCP |
//! | `Drop` | `closeSend`, `closeRecv`, `closeListen` | close |
//!
//! Differences, on purpose:
//! - connect and accept block until done or their deadline (NCCL's return
//!   NULL until done and are called again); the engine sets connections up
//!   before its thread starts, so nothing waits behind them.
//! - [`Net::connect`] carries the connector's [`Peer`] (rank and stream) and
//!   [`ListenComm::accept`] returns it, so one listener serves every peer of
//!   a rank. An adapter around an NCCL plugin sends it as the first message
//!   of the new connection.
//! - Messages on one comm are matched in order (as NCCL's socket and IB
//!   transports do); the tag of a receive must equal the sender's, so two
//!   ranks that disagree about which collective runs get an error naming the
//!   peer instead of each other's bytes. A receive larger than the message
//!   is allowed (the size is reported); a message larger than the receive
//!   is an error.
//! - Errors are typed ([`NetError`]) and name the peer's address.
//!
//! Built in: TCP ([`tcp`]), and the pod's sidecar proxy ([`proxy`]: the
//! data connections through the sidecar's rings, `WEFT_CROSSHOST_NET=proxy`),
//! both host memory only: registering device memory returns
//! [`NetError::Unsupported`], so a caller stages device data through pinned
//! host memory.

pub mod proxy;
pub mod tcp;

use std::fmt;
use std::time::Instant;

/// Largest connect handle (NCCL's `NCCL_NET_HANDLE_MAXSIZE`).
pub const HANDLE_MAX: usize = 128;

/// What a listener hands to its peers (out of band, e.g. an all-gather over
/// the bootstrap) so they can connect: opaque bytes, at most [`HANDLE_MAX`].
#[derive(Clone, PartialEq, Eq)]
pub struct ConnectHandle(Vec<u8>);

impl ConnectHandle {
    /// A handle from bytes received from a peer (checked for length only;
    /// the transport that decodes it checks the rest).
    pub fn from_bytes(b: &[u8]) -> Result<ConnectHandle, NetError> {
        if b.len() > HANDLE_MAX {
            return Err(NetError::InvalidArgument(format!(
                "a connect handle is at most {HANDLE_MAX} bytes, got {}",
                b.len()
            )));
        }
        Ok(ConnectHandle(b.to_vec()))
    }

    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }
}

impl fmt::Debug for ConnectHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ConnectHandle({} bytes)", self.0.len())
    }
}

/// Which memory a transport can send from and receive into (NCCL's
/// `ptrSupport`: `NCCL_PTR_HOST | NCCL_PTR_CUDA | NCCL_PTR_DMABUF`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PtrSupport {
    pub host: bool,
    pub device: bool,
    pub dmabuf: bool,
}

/// What one device (NIC) of a transport can do (NCCL's `ncclNetProperties`).
#[derive(Debug, Clone, PartialEq)]
pub struct Properties {
    pub name: String,
    pub ptr_support: PtrSupport,
    /// A registration serves every comm of the device (`regIsGlobal`).
    pub reg_is_global: bool,
    /// Port speed in Mbit/s (0: unknown).
    pub speed_mbps: u64,
    /// One-way latency in microseconds (0: unknown).
    pub latency_us: f32,
    /// Comms the device supports at most.
    pub max_comms: usize,
    /// Buffers one [`RecvComm::irecv`] may post (multi-receive).
    pub max_recvs: usize,
    /// Requests in flight per comm (NCCL's `NCCL_NET_MAX_REQUESTS`).
    pub max_requests: usize,
    /// Largest message (`maxP2pBytes`).
    pub max_message: usize,
}

/// The kind of memory behind a registration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemKind {
    Host,
    /// CUDA device memory of this device ordinal.
    Device(i32),
}

/// A registered memory region (NCCL's `mhandle`): transfers name one, and
/// their bytes must lie inside it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mr {
    /// The transport's key for it (unique per comm).
    pub id: u64,
    pub base: usize,
    pub len: usize,
    pub kind: MemKind,
}

impl Mr {
    /// Whether `[ptr, ptr + len)` lies inside the region.
    pub fn covers(&self, ptr: usize, len: usize) -> bool {
        ptr >= self.base
            && ptr
                .checked_add(len)
                .is_some_and(|end| end <= self.base + self.len)
    }
}

/// Who opened a connection: the connector's rank and a stream number of its
/// choosing (several connections between one pair, a failure notice...).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Peer {
    pub rank: u32,
    pub stream: u32,
}

/// A posted transfer (NCCL's `request`), tested with the comm that posted it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Request(pub u64);

/// One buffer of a receive.
#[derive(Debug, Clone, Copy)]
pub struct RecvBuf<'a> {
    pub mr: &'a Mr,
    pub ptr: *mut u8,
    pub len: usize,
    pub tag: u32,
}

/// Why a network call failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NetError {
    /// The transport cannot do this (device memory on TCP: stage through
    /// pinned host memory).
    #[error("unsupported by the {net} transport: {what}")]
    Unsupported { net: &'static str, what: String },
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The connection to `peer` failed or the peer broke the protocol.
    #[error("{peer}: {what}")]
    Peer { peer: String, what: String },
    /// Connecting to `peer` did not finish in time.
    #[error("{peer}: connection not established in time: {what}")]
    ConnectTimeout { peer: String, what: String },
    /// The comm was closed (abort) while the call waited.
    #[error("closed")]
    Closed,
    /// A local system call failed.
    #[error("{context}: {why}")]
    System { context: String, why: String },
}

impl NetError {
    pub(crate) fn sys(context: impl fmt::Display, e: std::io::Error) -> NetError {
        NetError::System {
            context: context.to_string(),
            why: e.to_string(),
        }
    }
}

/// A transport: the devices it drives and how to open connections on them.
/// Object safe: the engine holds an `Arc<dyn Net>`.
pub trait Net: Send + Sync {
    /// For logs ("tcp", "ib", a plugin's name).
    fn name(&self) -> &'static str;
    /// Number of devices (NICs); device numbers are `0..devices()`.
    fn devices(&self) -> usize;
    fn properties(&self, dev: usize) -> Result<Properties, NetError>;
    /// Starts listening on `dev`: the handle to give the peers, and the comm
    /// to accept them with.
    fn listen(&self, dev: usize) -> Result<(ConnectHandle, Box<dyn ListenComm>), NetError>;
    /// Connects to the listener `handle` names, as `me`, by `deadline`;
    /// `cancelled` is polled while waiting (an abort during setup).
    fn connect(
        &self,
        dev: usize,
        handle: &ConnectHandle,
        me: Peer,
        deadline: Instant,
        cancelled: &dyn Fn() -> bool,
    ) -> Result<Box<dyn SendComm>, NetError>;
}

/// An accepted connection and the peer it says it is.
pub type Accepted = (Box<dyn RecvComm>, Peer);

/// Accepts the connections made to one listener.
pub trait ListenComm: Send {
    /// The next connection, with the peer it says it is (authenticated by
    /// the transport); `Ok(None)` when none arrived by `deadline` (a
    /// deadline in the past only looks).
    fn accept(&mut self, deadline: Instant) -> Result<Option<Accepted>, NetError>;
}

/// The sending end of a connection. Requests complete in any order; messages
/// are matched with the receiver's receives in the order they were posted.
pub trait SendComm: Send {
    /// The peer, for messages ("10.0.0.2:41000").
    fn peer(&self) -> &str;
    fn reg_mr(&mut self, base: *const u8, len: usize, kind: MemKind) -> Result<Mr, NetError>;
    fn dereg_mr(&mut self, mr: &Mr) -> Result<(), NetError>;
    /// Posts a send of `len` bytes at `data` (inside `mr`). `Ok(None)`: too
    /// many requests in flight, post it again later.
    ///
    /// # Safety
    /// `data..data + len` must stay valid and unchanged until `test` reports
    /// the request done (or the comm is dropped).
    unsafe fn isend(
        &mut self,
        mr: &Mr,
        data: *const u8,
        len: usize,
        tag: u32,
    ) -> Result<Option<Request>, NetError>;
    /// `Some(bytes)` once the request is done (the request is then gone).
    fn test(&mut self, req: Request) -> Result<Option<usize>, NetError>;
}

/// The receiving end of a connection.
pub trait RecvComm: Send {
    fn peer(&self) -> &str;
    fn reg_mr(&mut self, base: *const u8, len: usize, kind: MemKind) -> Result<Mr, NetError>;
    fn dereg_mr(&mut self, mr: &Mr) -> Result<(), NetError>;
    /// Posts a receive into `bufs` (at most [`Properties::max_recvs`]).
    /// `Ok(None)`: too many requests in flight, post it again later.
    ///
    /// # Safety
    /// Every buffer must stay valid, and untouched by others, until `test`
    /// reports the request done (or the comm is dropped).
    unsafe fn irecv(&mut self, bufs: &[RecvBuf<'_>]) -> Result<Option<Request>, NetError>;
    /// `Some(sizes)` (bytes received into each buffer) once done.
    fn test(&mut self, req: Request) -> Result<Option<Vec<usize>>, NetError>;
    /// Makes received data visible to a GPU that reads it (GPUDirect RDMA
    /// writes can be reordered with the GPU's reads); `Ok(None)` when there
    /// is nothing to do, as for host memory and on TCP.
    fn iflush(&mut self, _bufs: &[RecvBuf<'_>]) -> Result<Option<Request>, NetError> {
        Ok(None)
    }
}
