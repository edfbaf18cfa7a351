//! A Ready communicator's live resources and the engine that drives its
//! transfers to completion. The communicator (`comm/`) owns the resources
//! behind one mutex; the host algorithms (`algo/`) express collectives as
//! batches of transfers this engine runs.
//!
//! | file | its one job |
//! |---|---|
//! | `resources.rs` | `Resources`: peers, shared-memory segments, channels (connected on first use), the failure domain |
//! | `fault.rs` | `Fault`: raising, spreading and observing a communicator's failure |
//! | `xfer.rs` | the engine's units, a leaf: `Xfer`, `Wait`, the eager sends' `Queue` |
//! | `exec.rs` | the progress engine: a batch of transfers to completion, waiting, blame |
//! | `eager.rs` | eager host sends: what a send left, copied and queued; flushing the queue |

pub(crate) mod eager;
pub(crate) mod exec;
pub(crate) mod fault;
pub(crate) mod resources;
pub(crate) mod xfer;
