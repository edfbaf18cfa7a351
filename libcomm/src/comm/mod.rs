//! The communicator: the public handle, its lifecycle, and the one entry
//! point of operations.
//!
//! Names, from the outside in: a [`Communicator`] is one rank's handle (the
//! public type); its `CommShared` is the lifecycle record it shares with its
//! init thread, the eager-send flusher, the device watch and the observer's
//! abort handle; the record holds the `Resources` of a Ready communicator
//! (`progress/`) behind one mutex.
//!
//! Every operation is an `Op` and enters through [`Communicator::submit`]
//! (a group through [`Group::execute`]): validated once, then run on host
//! memory by the host algorithms with the tuner's decision (`host.rs`) or
//! handed to the device backend (`device.rs`).
//!
//! | file | its one job |
//! |---|---|
//! | `communicator.rs` | [`Communicator`]: accessors, the checks every operation passes, the typed methods |
//! | `shared.rs` | `CommShared`, the lifecycle record: state, failure cause, device slot, resources; abort and fail |
//! | `lifecycle.rs` | init (unique id, environment, all ranks in this process), waiting, the async error, abort, destroy |
//! | `split.rs` | split (after revoke too), and `Child`: the one builder of a child communicator |
//! | `submit.rs` | `submit` and `flush`: the entry point |
//! | `host.rs` | host memory: one operation by the host algorithms, a batch per communicator |
//! | `device.rs` | device memory: a batch handed to the device backend (the only file of the core naming `cuda/`) |
//! | `group.rs` | [`Group`] (NCCL's group calls) |
//! | `flusher.rs` | the eager-send flusher thread |
//! | `watch.rs` | the device watch thread |
//! | `reconf.rs` | `Reconf`: revoke, shrink and grow bookkeeping |
//! | `cross_mover.rs` | the communicator as the cross-host engine's handle exchange and host-local mover (`CommMover`) |
//! | `cross_engine.rs` | large collectives of a communicator spanning hosts on the cross-host engine (opt-in: `WEFT_CROSSHOST_MIN_BYTES`) |
//! | `cross_slot.rs` | the communicator's engine slot, and what releases a call in it on abort |
//! | `hier.rs` | device collectives across hosts, hierarchically: a host-local and a rail communicator, the plan's steps on them, failures tied to the parent |
//! | `hier_p2p.rs` | device sends, receives and all-to-all across hosts with a hierarchy: this host's pieces on the host-local communicator's kernels, the rest across |
//! | `hier_slot.rs` | the communicator's hierarchy slot: the hierarchy once built, its two communicators for abort, the watch and destroy |

pub(crate) mod communicator;
mod cross_engine;
pub mod cross_mover;
mod cross_slot;
mod device;
pub(crate) mod flusher;
pub(crate) mod group;
mod hier;
mod hier_p2p;
mod hier_slot;
mod host;
mod lifecycle;
pub(crate) mod reconf;
pub(crate) mod shared;
pub(crate) mod split;
mod submit;
pub(crate) mod watch;

pub use communicator::Communicator;
pub use group::Group;
