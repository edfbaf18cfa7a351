//! Which algorithm runs a collective: chosen from the message size and rank
//! count, overridable with `WEFT_ALGO` (like `NCCL_ALGO`): a single name for
//! every collective that supports it (`WEFT_ALGO=ring`), or per collective
//! (`WEFT_ALGO=allreduce:rd,broadcast:tree`).
//!
//! The tuner decides once per operation ([`decide`]); the [`Decision`]
//! travels with the operation to the host algorithm that runs it and to the
//! observer that labels its span.

use crate::error::{Error, Result};
use crate::op::{Op, OpKind};

/// Algorithm names only the device (CUDA) backend knows: `WEFT_ALGO` /
/// `WEFT_CUDA_ALGO` may give them; host memory keeps choosing by size.
pub const DEVICE_ALGOS: &[&str] = &["oneshot", "twoshot", "ll", "staged"];

/// Whether `name` names a device algorithm (the host tuner leaves those it
/// does not know itself to the device backend).
pub fn is_device_algo(name: &str) -> bool {
    let name = name.trim().to_ascii_lowercase();
    DEVICE_ALGOS.contains(&name.as_str())
}

/// How one operation runs, decided once: what the host algorithms execute
/// and what the observer records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// A host collective with this algorithm.
    Host(Algo),
    /// Gather, scatter, send or receive: point-to-point transfers.
    P2p,
    /// The device backend's own algorithm (kernel name, `p2p-kernel`).
    Device(&'static str),
}

impl Decision {
    /// The label the observer records.
    pub fn name(self) -> &'static str {
        match self {
            Decision::Host(a) => a.name(),
            Decision::P2p => "p2p",
            Decision::Device(n) => n,
        }
    }

    /// The host algorithm (Ring where none was decided).
    pub fn algo(self) -> Algo {
        match self {
            Decision::Host(a) => a,
            _ => Algo::Ring,
        }
    }
}

/// The host decision for `op` on `n` ranks: the collective and the bytes the
/// size rules see (the all-reduce buffer, the broadcast/reduce buffer, the
/// gathered result, one rank's whole all-to-all send buffer).
pub fn decide(op: &Op, n: usize, o: &AlgoOverride) -> Decision {
    let b = op.bytes();
    let (coll, bytes) = match op.kind {
        OpKind::AllReduce => (Coll::AllReduce, b),
        OpKind::Broadcast => (Coll::Broadcast, b),
        OpKind::Reduce => (Coll::Reduce, b),
        OpKind::AllGather => (Coll::AllGather, b * n),
        OpKind::ReduceScatter => (Coll::ReduceScatter, b * n),
        OpKind::AllToAll => (Coll::AllToAll, b * n),
        OpKind::Gather | OpKind::Scatter | OpKind::Send | OpKind::Recv => return Decision::P2p,
    };
    Decision::Host(choose(coll, bytes, n, o))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Coll {
    AllReduce,
    Broadcast,
    Reduce,
    AllGather,
    ReduceScatter,
    AllToAll,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Algo {
    /// Bandwidth-optimal ring (pipelined chain for broadcast).
    Ring,
    /// Recursive doubling: log2(n) full-size exchanges (latency-optimal all-reduce).
    RecursiveDoubling,
    /// Binomial tree (broadcast, reduce): log2(n) steps.
    Tree,
    /// Every rank talks to every other rank in one step (small all-gather,
    /// reduce-scatter, all-to-all).
    Direct,
    /// n-1 steps of pairwise exchange (large all-to-all).
    Pairwise,
}

impl Algo {
    pub fn name(self) -> &'static str {
        match self {
            Algo::Ring => "ring",
            Algo::RecursiveDoubling => "rd",
            Algo::Tree => "tree",
            Algo::Direct => "direct",
            Algo::Pairwise => "pairwise",
        }
    }
}

impl Coll {
    pub fn name(self) -> &'static str {
        match self {
            Coll::AllReduce => "allreduce",
            Coll::Broadcast => "broadcast",
            Coll::Reduce => "reduce",
            Coll::AllGather => "allgather",
            Coll::ReduceScatter => "reducescatter",
            Coll::AllToAll => "alltoall",
        }
    }

    pub fn supports(self, a: Algo) -> bool {
        use Algo::*;
        match self {
            Coll::AllReduce => matches!(a, Ring | RecursiveDoubling | Direct),
            Coll::Broadcast | Coll::Reduce => matches!(a, Ring | Tree),
            Coll::AllGather | Coll::ReduceScatter => matches!(a, Ring | Direct),
            Coll::AllToAll => matches!(a, Pairwise | Direct),
        }
    }

    const ALL: [Coll; 6] = [
        Coll::AllReduce,
        Coll::Broadcast,
        Coll::Reduce,
        Coll::AllGather,
        Coll::ReduceScatter,
        Coll::AllToAll,
    ];
}

fn parse_algo(s: &str) -> Result<Algo> {
    Ok(match s.trim().to_ascii_lowercase().as_str() {
        "ring" => Algo::Ring,
        "rd" | "recursive_doubling" | "recursivedoubling" => Algo::RecursiveDoubling,
        "tree" => Algo::Tree,
        "direct" | "oneshot" | "one_shot" => Algo::Direct,
        "pairwise" => Algo::Pairwise,
        other => {
            return Err(Error::arg(format!(
                "WEFT_ALGO: unknown algorithm '{other}' (ring, rd, tree, direct, pairwise; for device memory also oneshot, twoshot, ll, staged)"
            )));
        }
    })
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct AlgoOverride {
    global: Option<Algo>,
    per: Vec<(Coll, Algo)>,
}

impl std::str::FromStr for AlgoOverride {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        let mut o = AlgoOverride::default();
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            match part.split_once(':') {
                None => match parse_algo(part) {
                    Ok(a) => o.global = Some(a),
                    // Names only the CUDA kernel path knows steer device
                    // memory; host memory keeps choosing by size.
                    Err(_) if is_device_algo(part) => {}
                    Err(e) => return Err(e),
                },
                Some((c, a)) => {
                    let c = c.trim().to_ascii_lowercase().replace('_', "");
                    let coll = Coll::ALL
                        .into_iter()
                        .find(|x| x.name() == c || (c == "bcast" && *x == Coll::Broadcast))
                        .ok_or_else(|| {
                            Error::arg(format!("WEFT_ALGO: unknown collective '{c}'"))
                        })?;
                    let algo = parse_algo(a)?;
                    if !coll.supports(algo) {
                        return Err(Error::arg(format!(
                            "WEFT_ALGO: {} cannot run with {}",
                            coll.name(),
                            algo.name()
                        )));
                    }
                    o.per.push((coll, algo));
                }
            }
        }
        Ok(o)
    }
}

/// Size thresholds under which latency-optimal algorithms win on host memory
/// (measured with `weft bench`, see docs/PERFORMANCE.md): one-step direct
/// all-reduce for tiny buffers, recursive doubling up to where the ring wins
/// (16 KiB on 16 cores, 32-64 KiB on 2).
const TINY_ALLREDUCE: usize = 4 << 10;
const DIRECT_MAX_RANKS: usize = 16;
const SMALL_ALLREDUCE: usize = 32 << 10;
const SMALL_OTHER: usize = 32 << 10;

/// The algorithm for `coll` moving `bytes` (the full buffer: the all-reduce
/// buffer, the gathered result, one rank's all-to-all send buffer) over `n` ranks.
pub fn choose(coll: Coll, bytes: usize, n: usize, o: &AlgoOverride) -> Algo {
    if let Some((_, a)) = o.per.iter().find(|(c, _)| *c == coll) {
        return *a;
    }
    if let Some(a) = o.global {
        if coll.supports(a) {
            return a;
        }
        // A single name like `tree` also selects the latency path where it has another name.
        if matches!(a, Algo::Tree | Algo::RecursiveDoubling | Algo::Direct) {
            return match coll {
                Coll::AllReduce => Algo::RecursiveDoubling,
                Coll::Broadcast | Coll::Reduce => Algo::Tree,
                _ => Algo::Direct,
            };
        }
        if matches!(a, Algo::Ring | Algo::Pairwise) {
            return if coll == Coll::AllToAll {
                Algo::Pairwise
            } else {
                Algo::Ring
            };
        }
    }
    let small = match coll {
        Coll::AllReduce => bytes <= SMALL_ALLREDUCE,
        _ => bytes <= SMALL_OTHER,
    };
    if coll == Coll::AllReduce && bytes <= TINY_ALLREDUCE && (3..=DIRECT_MAX_RANKS).contains(&n) {
        return Algo::Direct;
    }
    match (coll, small || n <= 2) {
        (Coll::AllReduce, true) => Algo::RecursiveDoubling,
        (Coll::AllReduce, false) => Algo::Ring,
        (Coll::Broadcast | Coll::Reduce, true) => Algo::Tree,
        (Coll::Broadcast | Coll::Reduce, false) => Algo::Ring,
        (Coll::AllGather | Coll::ReduceScatter, true) => Algo::Direct,
        (Coll::AllGather | Coll::ReduceScatter, false) => Algo::Ring,
        (Coll::AllToAll, true) => Algo::Direct,
        (Coll::AllToAll, false) => Algo::Pairwise,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_by_size() {
        let o = AlgoOverride::default();
        assert_eq!(choose(Coll::AllReduce, 8, 4, &o), Algo::Direct);
        assert_eq!(choose(Coll::AllReduce, 8, 64, &o), Algo::RecursiveDoubling);
        assert_eq!(
            choose(Coll::AllReduce, 16 << 10, 4, &o),
            Algo::RecursiveDoubling
        );
        assert_eq!(choose(Coll::AllReduce, 64 << 20, 4, &o), Algo::Ring);
        assert_eq!(choose(Coll::AllToAll, 1 << 20, 8, &o), Algo::Pairwise);
        assert_eq!(choose(Coll::Broadcast, 8, 8, &o), Algo::Tree);
    }

    #[test]
    fn overrides() {
        let o: AlgoOverride = "ring".parse().unwrap();
        assert_eq!(choose(Coll::AllReduce, 8, 4, &o), Algo::Ring);
        assert_eq!(choose(Coll::AllToAll, 8, 4, &o), Algo::Pairwise);
        let o: AlgoOverride = "allreduce:rd, broadcast:ring".parse().unwrap();
        assert_eq!(
            choose(Coll::AllReduce, 1 << 30, 4, &o),
            Algo::RecursiveDoubling
        );
        assert_eq!(choose(Coll::Broadcast, 8, 4, &o), Algo::Ring);
        assert!("allreduce:pairwise".parse::<AlgoOverride>().is_err());
        assert!("warp".parse::<AlgoOverride>().is_err());
        // Device-only names leave host memory to the size rules.
        for d in ["twoshot", "LL", "staged"] {
            assert_eq!(d.parse::<AlgoOverride>().unwrap(), AlgoOverride::default());
        }
        assert!("allreduce:ll".parse::<AlgoOverride>().is_err());
    }
}
