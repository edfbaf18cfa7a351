//! [`Ctx`]: the immutable facts a communicator is built from (its id, rank,
//! peers, secret and configuration). Its own module because both the core
//! (`core::Resources`) and the transports that set up channels from it (the
//! sidecar rings) read it, and neither should import the other for it.

use crate::bootstrap::PeerInfo;
use crate::config::Config;
use crate::transport::tcp::CommId;

/// Immutable facts about a communicator.
pub(crate) struct Ctx {
    pub id: CommId,
    pub label: String,
    pub rank: usize,
    pub nranks: usize,
    pub secret: [u8; 32],
    pub peers: Vec<PeerInfo>,
    pub cfg: Config,
    pub job: String,
}
