//! Which shape, chunk size and pipelining depth a cross-host operation
//! gets, by size, ranks per host and hosts; logged once per collective,
//! size class and choice with `WEFT_DEBUG=INFO`.
//!
//! The rules, and why:
//! - Hosts with different numbers of ranks: leaders (rails need every host
//!   to have the same local ranks); all-to-all: direct.
//! - All-to-all: rails (k blocks per host pair in one message per rail)
//!   while a block per peer is at most [`A2A_RAILS_MAX`]; larger blocks
//!   direct (the rails' extra local passes cost more than the messages save).
//! - Send/receive: direct (the planner's only shape for them), chunks of
//!   [`P2P_CHUNK`] whatever the sizes (each end knows only its own side).
//! - Others: rails once a rail's part (bytes / k) is at least
//!   [`RAILS_MIN_PART`] (each rail then carries 1/k of the traffic, in
//!   parallel over k NICs, and the local phases are cheap next to the
//!   network); below, leaders (one message stream, k times larger
//!   messages: latency wins). One rank per host: rails and leaders are
//!   the same; rails.
//! - Chunk: a quarter of the per-rank block, a power of two from
//!   [`MIN_CHUNK`] to [`MAX_CHUNK`] (a pipeline at least a few chunks deep,
//!   chunks large enough that per-message costs stay small); window:
//!   [`WINDOW`] chunks in flight per lane.
//!
//! The thresholds were set on host memory over loopback TCP (2 cores);
//! phase 2 re-measures them on GPUs (docs/ARCHITECTURE.md, "Across hosts").

use super::layout::Layout;
use super::plan::{Coll, Shape};

/// A rail's part below this goes through leaders instead.
pub const RAILS_MIN_PART: usize = 64 << 10;
/// All-to-all blocks (per peer) up to this go through rails.
pub const A2A_RAILS_MAX: usize = 256 << 10;
pub const MIN_CHUNK: usize = 64 << 10;
pub const MAX_CHUNK: usize = 4 << 20;
pub const WINDOW: usize = 4;
/// The chunk of sends and receives, whatever their sizes (both ends of a
/// message must cut it alike; see `CrossHost::send_recv`).
pub const P2P_CHUNK: usize = 1 << 20;

/// The tuner's decision for one operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Choice {
    pub shape: Shape,
    /// Bytes per chunk.
    pub chunk: usize,
    /// Chunks in flight per peer and direction.
    pub window: usize,
    /// Connections carrying the operation between one pair of hosts at
    /// once (each striped over `WEFT_NET_SOCKETS` sockets): k on rails, 1
    /// through leaders, k x k direct.
    pub connections: usize,
}

/// Bytes of the operation as the rules see them: the all-reduce, broadcast
/// and reduce buffer; the gathered or scattered whole; one all-to-all block.
pub fn rule_bytes(coll: Coll, count: usize, esize: usize, n: usize) -> usize {
    match coll {
        Coll::AllReduce | Coll::Broadcast { .. } | Coll::Reduce { .. } | Coll::AllToAll => {
            count * esize
        }
        Coll::AllGather | Coll::ReduceScatter => count * esize * n,
    }
}

/// The choice for `coll` moving `bytes` (see [`rule_bytes`]) on `layout`.
pub fn decide(coll: Coll, bytes: usize, layout: &Layout) -> Choice {
    let uniform = layout.per_host();
    let shape = match (coll, uniform) {
        (Coll::AllToAll, Some(k)) if k > 1 && bytes <= A2A_RAILS_MAX => Shape::Rails,
        (Coll::AllToAll, _) => Shape::Direct,
        (_, None) => Shape::Leaders,
        (_, Some(1)) => Shape::Rails,
        (_, Some(k)) if bytes / k >= RAILS_MIN_PART => Shape::Rails,
        _ => Shape::Leaders,
    };
    let block = match shape {
        Shape::Rails => bytes / uniform.unwrap_or(1).max(1),
        _ => bytes,
    } / layout.nhosts().max(1);
    let chunk = (block / 4)
        .max(1)
        .next_power_of_two()
        .clamp(MIN_CHUNK, MAX_CHUNK);
    let c = Choice {
        shape,
        chunk,
        window: WINDOW,
        connections: connections(shape, layout),
    };
    log_choice(coll, bytes, layout, c);
    c
}

/// Connections a shape uses between one pair of hosts at once.
pub fn connections(shape: Shape, layout: &Layout) -> usize {
    let k = layout.per_host().unwrap_or(1);
    match shape {
        Shape::Rails => k,
        Shape::Leaders => 1,
        Shape::Direct => k * k,
    }
}

/// `WEFT_DEBUG=INFO`: one line per collective, size class, layout and choice.
fn log_choice(coll: Coll, bytes: usize, layout: &Layout, c: Choice) {
    use std::collections::HashSet;
    use std::sync::{Mutex, OnceLock};
    if crate::log::level() < crate::log::Level::Info {
        return;
    }
    type Key = (&'static str, u32, usize, Option<usize>, Shape, usize);
    static SEEN: OnceLock<Mutex<HashSet<Key>>> = OnceLock::new();
    let class = bytes.max(1).next_power_of_two().trailing_zeros();
    let key = (
        coll.name(),
        class,
        layout.nhosts(),
        layout.per_host(),
        c.shape,
        c.chunk,
    );
    let new = SEEN
        .get_or_init(Default::default)
        .lock()
        .map(|mut m| m.insert(key))
        .unwrap_or(false);
    if new {
        crate::log::info_log!(
            "cross-host tuner: {} of {bytes} B on {}: {}, {} connection(s) per host pair, chunk {} KiB, {} in flight per peer",
            coll.name(),
            layout.describe(),
            c.shape.name(),
            c.connections,
            c.chunk >> 10,
            c.window
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_follow_size_and_layout() {
        let u = Layout::uniform(2, 4);
        assert_eq!(decide(Coll::AllReduce, 64 << 20, &u).shape, Shape::Rails);
        assert_eq!(decide(Coll::AllReduce, 4096, &u).shape, Shape::Leaders);
        let one = Layout::uniform(3, 1);
        assert_eq!(decide(Coll::AllReduce, 8, &one).shape, Shape::Rails);
        let uneven = Layout::from_hosts(vec![vec![0, 1, 2], vec![3]]).unwrap();
        assert_eq!(
            decide(Coll::AllReduce, 64 << 20, &uneven).shape,
            Shape::Leaders
        );
        assert_eq!(decide(Coll::AllToAll, 1024, &uneven).shape, Shape::Direct);
        assert_eq!(decide(Coll::AllToAll, 1024, &u).shape, Shape::Rails);
        assert_eq!(decide(Coll::AllToAll, 1 << 20, &u).shape, Shape::Direct);
        let c = decide(Coll::AllReduce, 256 << 20, &u);
        assert_eq!((c.chunk, c.window, c.connections), (MAX_CHUNK, WINDOW, 4));
        assert_eq!(decide(Coll::AllReduce, 4096, &u).connections, 1);
        assert_eq!(decide(Coll::AllReduce, 1 << 20, &u).chunk, MIN_CHUNK);
        for (coll, bytes) in [(Coll::Broadcast { root: 1 }, 1 << 30), (Coll::AllGather, 1)] {
            let c = decide(coll, bytes, &u);
            assert!(c.shape.fits(coll, &u));
            assert!(c.chunk.is_power_of_two());
        }
    }
}
