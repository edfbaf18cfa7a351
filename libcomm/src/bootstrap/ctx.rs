//! [`Ctx`]: the immutable facts a communicator is built from (its id, rank,
//! peers, secret and configuration), what a rendezvous or a split yields.
//! Here, below the transports, because both the communicator's resources
//! (`progress::resources`) and the transports that set up channels from it
//! (the TCP endpoint's registry, the sidecar rings) read it. The job's
//! label, part of every context, is read here too.

use crate::bootstrap::PeerInfo;
use crate::config::Config;

/// A communicator's id, the same on every rank (derived at the rendezvous,
/// or from the parent's at a split).
pub(crate) type CommId = [u8; 16];

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

/// The job's label (`WEFT_JOB`, letters, digits, `-` and `_`, at most 40;
/// `anon` without one): in segment names, observer events, recovery boards.
pub(crate) fn job_label() -> String {
    let j: String = weft_contract::params::WEFT_JOB
        .raw()
        .unwrap_or_default()
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || *c == '-' || *c == '_')
        .take(40)
        .collect();
    if j.is_empty() { "anon".into() } else { j }
}
