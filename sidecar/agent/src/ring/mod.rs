//! The per-process telemetry segment a rank shares with its pod's sidecar:
//! every collective is counted in its communicator's slot and, at low
//! rates (and always when it failed or was slow), also written as one
//! fixed-size record into a ring in shared memory, with no system call and
//! no lock; the sidecar drains the ring in batches on a timer and learns
//! of the operations that were only counted from the counters (`tally`). The same segment holds a table of
//! the process's communicators (their lifecycle and progress), written
//! synchronously by the rank, so the sidecar can tell a clean exit from a
//! death even after the process is gone.
//!
//! One memfd per process, created by the agent at attach, sealed against
//! resizing (so a mapping can never fault) and passed to the sidecar with
//! the first bytes of the attach connection (SCM_RIGHTS, `crate::client`).
//! Layout (64-bit words, little endian; [`layout`]):
//!
//! ```text
//! header (4 KiB)   magic, version, geometry, segment id, pid, flags;
//!                  on their own cache lines: the producers' ticket (tail),
//!                  the dropped counter, the consumer's position (head)
//! slots            the communicator table: per slot a state word
//!                  (free, live, failed, aborted, destroyed), the
//!                  communicator's key, rank and size, its last started
//!                  and completed operation, per operation code the
//!                  operations, bytes and busy time so far, the text of its
//!                  last error
//! ring             `capacity` records of 8 words (one cache line): a
//!                  sequence word (publication), then the record by value
//!                  (`Record`)
//! ```
//!
//! The ring is a bounded multi-producer queue after Dmitry Vyukov's design:
//! producers take a ticket with a compare-and-swap on `tail` and publish
//! with the slot's sequence word; a full ring drops the record and counts it
//! (never a wait). The single consumer (the sidecar's drain, or the
//! in-process exporter) reads everything it maps defensively: a segment
//! from another process is checked (seals, size, magic, version, geometry)
//! before it is mapped, and nothing read from it is trusted for addressing
//! or for how long a loop runs.

pub mod codes;
pub mod layout;
pub mod queue;
pub mod record;
pub mod segment;
pub mod slots;
pub mod tally;

pub use record::{CommKey, Record};
pub use segment::{Segment, SegmentError};
