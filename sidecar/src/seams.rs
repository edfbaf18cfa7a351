//! The interfaces between the sidecar's engine (the ranks' gRPC socket, the
//! job state, heartbeats with the peers) and its network proxy (the ranks'
//! bytes to other hosts). Neither imports the other: each is given what it
//! needs through these, and the sidecar's start-up (`crate::startup`)
//! connects them.
//!
//! - A listener hands each connection that opens with a [`Route`]'s preface
//!   to that route's [`ConnectionHandler`] (the proxy's connections share the
//!   engine's peer port).
//! - The proxy reports a lost host connection through [`JobEvents`].
//! - The engine's status shows the proxy's connections through [`HostViews`].

use std::net::{IpAddr, SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::Instant;

/// Length of the preface that tells the protocols of a shared port apart
/// (that of HTTP/2, which gRPC speaks).
pub const PREFACE_LEN: usize = 24;

/// A connection a listener accepted and hands over (the preface consumed).
pub struct Handover {
    pub stream: TcpStream,
    pub from: SocketAddr,
    /// The listener's handshake deadline, counted from accept: the
    /// connection must be authenticated by then.
    pub deadline: Instant,
    /// The connection's place among the listener's unauthenticated
    /// connections, held until it is authenticated.
    pub admission: Box<dyn Admission>,
}

/// Takes over the connections a listener hands over.
pub trait ConnectionHandler: Send + Sync {
    fn handle(&self, conn: Handover);
}

/// A connection's place in a listener's caps. Dropping it frees the place;
/// at a cap the listener may evict the connection instead (it shuts the
/// socket down: a blocked read returns at once).
pub trait Admission: Send {
    /// Whether the listener evicted the connection for a newer one.
    fn evicted(&self) -> bool;
}

/// A protocol sharing a listener: connections opening with `preface` go to
/// `handler`; without one (the service is off here), they are refused with
/// a line naming the protocol.
#[derive(Clone)]
pub struct Route {
    pub name: &'static str,
    pub preface: [u8; PREFACE_LEN],
    pub handler: Option<Arc<dyn ConnectionHandler>>,
}

/// What the job learns from the data plane.
pub trait JobEvents: Send + Sync {
    /// A peer host is lost (`reason` names it): record it and fail every
    /// local communicator.
    fn host_lost(&self, reason: &str);
    /// The proxy's connection to a peer host ended (`reason` names it),
    /// after the proxy failed the ranks with a channel to that host. Whether
    /// the job's other communicators fail too is the job's policy.
    fn host_connection_lost(&self, reason: &str);
}

/// One peer host's connection, as the proxy sees it.
#[derive(Debug, Clone)]
pub struct HostView {
    pub ip: IpAddr,
    pub name: String,
    pub state: &'static str,
    pub tx_bytes: u64,
    pub rx_bytes: u64,
    pub connects: u64,
}

/// Live per-host connection counters (atomics: no lock shared with anything).
pub trait HostViews: Send + Sync {
    fn host_views(&self) -> Vec<HostView>;
}
