//! The hierarchical shape of a device collective across hosts: which
//! collectives run within a host (on the host-local communicator, whose
//! device side is the NVLink kernel path) and which between hosts (on the
//! rank's rail: the ranks of the same local index, one per host, whose
//! device side is the stream-ordered pinned path), on which parts of the
//! caller's buffers and of a device scratch. A pure function of the
//! operation and the layout, so every rank derives the same steps (they
//! are collectives of the sub-communicators) and CI checks the steps by
//! running them on host arrays ([`simulate`]) against the reference.
//!
//! The shapes (H hosts of k ranks, this rank local index l on host h):
//! - all-reduce of n (n >= k): reduce-scatter within the host (block l of
//!   n/k lands in place in the output), all-reduce of that block on the
//!   rail, all-gather within the host; the last n mod k elements, if any,
//!   as one all-reduce of the whole communicator. Each rail carries 1/k of
//!   the data between hosts, as NCCL's rings on rails do.
//! - broadcast: the root's rail broadcasts between hosts (into the
//!   output), then every host broadcasts from its rank on that rail.
//! - reduce: within each host to its rank on the root's rail (into the
//!   output at the root, into scratch elsewhere), then on that rail to the
//!   root.
//! - all-gather (hosts are contiguous rank ranges): all-gather on the rail
//!   into scratch (block h' of the scratch: rank (h', l)'s input), then one
//!   all-gather within the host per host h', from scratch block h' into the
//!   output's range of host h'.
//! - reduce-scatter (contiguous hosts): one reduce-scatter within the host
//!   per host h', of the input's range of host h', into scratch block h';
//!   then a reduce-scatter on the rail of the scratch into the output.
//! - all-gather and reduce-scatter on hosts that are not rank ranges
//!   (interleaved): the plan of the layout renumbered host-major, on a
//!   scratch copy of the buffer in host-major block order, with copies on
//!   the rank alone between the two orders ([`permuted`]).
//!
//! Hosts of different sizes: leaders (see [`uneven`]) for all-reduce,
//! all-gather, reduce-scatter and the broadcasts and reduces whose root's
//! local index some host lacks; the root's rail for broadcast and reduce
//! where every host has it.
//!
//! Everything else (gather, scatter, all-to-all, send/recv) is not planned here:
//! the caller stages the whole operation (gather, scatter, all-to-all and
//! send/recv go by host in `comm/hier_p2p.rs`).

mod permuted;
mod simulate;
mod uneven;
mod uniform;

use permuted::permuted;
pub use simulate::simulate;
use uneven::uneven;
use uniform::uniform;

use super::layout::Layout;
use crate::data::types::ReduceOp;
use crate::op::OpKind;

/// Which communicator a step runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Among {
    /// The ranks of this host (local rank = the layout's local index).
    Host,
    /// The ranks of this rank's local index on every host (rail rank = host index).
    Rail,
    /// Every rank (the whole communicator).
    All,
    /// This rank alone: a broadcast among one rank, that is a copy on the
    /// rank's stream (between a buffer and the scratch, [`permuted`]).
    Me,
}

/// A place in one of a step's buffers, in elements from its start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum At {
    Send(usize),
    Recv(usize),
    Scratch(usize),
}

/// One collective of the plan, on one communicator.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Step {
    pub among: Among,
    pub kind: OpKind,
    pub send: At,
    pub recv: At,
    /// As the collective's own count (per rank for all-gather and
    /// reduce-scatter).
    pub count: usize,
    pub redop: Option<ReduceOp>,
    /// The root among `among`'s ranks (broadcast).
    pub root: usize,
}

/// The steps, in stream order, and the scratch they need (elements).
#[derive(Debug, Clone, PartialEq)]
pub struct DevicePlan {
    pub steps: Vec<Step>,
    pub scratch: usize,
}

/// The reduction of a later level: a pre-multiplied sum scales the inputs
/// once, in the first level; the levels after it only add.
pub(super) fn later(op: Option<ReduceOp>) -> Option<ReduceOp> {
    match op {
        Some(ReduceOp::PreMulSum(_)) => Some(ReduceOp::Sum),
        o => o,
    }
}

/// Whether every host is a contiguous range of ranks of the same size (the
/// layout numbers hosts by their lowest rank, so host h is `h*k..(h+1)*k`).
pub fn host_major(layout: &Layout) -> bool {
    layout
        .per_host()
        .is_some_and(|k| *layout == Layout::uniform(layout.nhosts(), k))
}

/// The plan of `kind` (count, reduction, root as the operation's) for rank
/// `me` of `layout`; None where the operation is staged whole instead (see
/// the module docs). Only for layouts of two hosts or more, one of them
/// with two ranks or more (hosts of different sizes: [`uneven`]).
pub fn plan(
    kind: OpKind,
    count: usize,
    redop: Option<ReduceOp>,
    root: usize,
    layout: &Layout,
    me: usize,
) -> Option<DevicePlan> {
    let sizes = (0..layout.nhosts()).map(|h| layout.members(h).len());
    let (smallest, largest) = (sizes.clone().min()?, sizes.max()?);
    if layout.nhosts() < 2 || largest < 2 || count == 0 {
        return None;
    }
    let c = Coll {
        kind,
        count,
        redop,
        root,
    };
    if matches!(kind, OpKind::AllGather | OpKind::ReduceScatter) && !layout.contiguous_hosts() {
        return permuted(c, layout, me);
    }
    match layout.per_host() {
        Some(_) => uniform(c, layout, me),
        None => uneven(c, layout, me, smallest),
    }
}

/// The collective a plan is for, as the operation gives it (the shapes'
/// common arguments).
#[derive(Debug, Clone, Copy)]
pub(super) struct Coll {
    pub kind: OpKind,
    pub count: usize,
    pub redop: Option<ReduceOp>,
    /// The operation's root (broadcast, reduce), a rank of the layout.
    pub root: usize,
}

pub(super) fn step(
    among: Among,
    kind: OpKind,
    send: At,
    recv: At,
    count: usize,
    redop: Option<ReduceOp>,
    root: usize,
) -> Step {
    Step {
        among,
        kind,
        send,
        recv,
        count,
        redop,
        root,
    }
}

#[cfg(test)]
mod tests;
