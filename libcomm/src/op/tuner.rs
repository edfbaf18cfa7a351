//! Which algorithm runs a collective: chosen from the message size and rank
//! count, overridable with `WEFT_ALGO` (like `NCCL_ALGO`): a single name for
//! every collective that supports it (`WEFT_ALGO=ring`), or per collective
//! (`WEFT_ALGO=allreduce:rd,broadcast:tree`).
//!
//! The tuner decides once per operation ([`decide`]) from the operation's
//! size and the communicator's [`Shape`] (ranks, ranks on this host, hosts,
//! cores, latency slots); the [`Decision`] travels with the operation to the
//! host algorithm that runs it and to the observer that labels its span
//! (and, with `WEFT_DEBUG=INFO`, to one log line per collective, size class
//! and choice).
//!
//! `WEFT_ALGO` is read here only ([`AlgoOverride::from_env`]), by one parser
//! for both backends: the host's choice, and the device algorithm it names
//! ([`device_override`], for the CUDA backend). The device algorithm names
//! are the parameter registry's (`weft_contract::params::CUDA_ALGOS`).

use crate::error::{Error, Result};
use crate::op::{Op, OpKind};
use weft_contract::params;

/// Algorithm names only the device (CUDA) backend knows: `WEFT_ALGO` /
/// `WEFT_CUDA_ALGO` may give them; host memory keeps choosing by size. The
/// registry's list, which documents `WEFT_CUDA_ALGO`.
pub const DEVICE_ALGOS: &[&str] = params::CUDA_ALGOS;

/// The device algorithm `name` names, if any (case and spaces aside).
fn device_algo(name: &str) -> Option<&'static str> {
    let name = name.trim().to_ascii_lowercase();
    DEVICE_ALGOS.iter().copied().find(|a| *a == name)
}

/// Whether `name` names a device algorithm (the host tuner leaves those it
/// does not know itself to the device backend).
pub fn is_device_algo(name: &str) -> bool {
    device_algo(name).is_some()
}

/// The device backend's algorithm override: `WEFT_CUDA_ALGO` when it names
/// a device algorithm, else the one a valid `WEFT_ALGO` names as a whole
/// (oneshot | twoshot | ll | staged; host names such as `ring` only steer
/// host memory).
pub fn device_override() -> Option<&'static str> {
    params::WEFT_CUDA_ALGO
        .raw()
        .and_then(|s| device_algo(&s))
        .or_else(|| AlgoOverride::from_env().ok()?.device())
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

/// What the tuner knows of a communicator besides the operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    /// Ranks.
    pub n: usize,
    /// Ranks on this rank's host (itself included) reached over shared memory.
    pub nlocal: usize,
    /// Hosts (estimated as `n / nlocal`, rounded up, when ranks are spread).
    pub hosts: usize,
    /// Cores this process may run on.
    pub cores: usize,
    /// Bytes one latency slot of a local rank carries (0: no slots).
    pub slot_bytes: usize,
}

impl Shape {
    /// `n` ranks with nothing known of where they run (no shared-memory path).
    pub fn ranks(n: usize) -> Shape {
        Shape {
            n,
            nlocal: 1,
            hosts: n,
            cores: 1,
            slot_bytes: 0,
        }
    }

    /// `n` ranks of which `nlocal` share this host, on this machine's cores.
    pub fn local(n: usize, nlocal: usize) -> Shape {
        let nlocal = nlocal.clamp(1, n.max(1));
        Shape {
            n,
            nlocal,
            hosts: n.div_ceil(nlocal),
            cores: cores(),
            slot_bytes: 0,
        }
    }

    /// This shape, with latency slots of `bytes` on every local rank.
    pub fn with_slots(self, bytes: usize) -> Shape {
        Shape {
            slot_bytes: bytes,
            ..self
        }
    }

    /// Every rank on this host, over shared memory: the latency slots can run.
    pub fn all_local(&self) -> bool {
        self.n >= 2 && self.hosts == 1 && self.nlocal == self.n
    }
}

/// Cores this process may run on (read once: it costs system calls).
fn cores() -> usize {
    use std::sync::OnceLock;
    static CORES: OnceLock<usize> = OnceLock::new();
    *CORES.get_or_init(crate::sys::topology::online_cpus)
}

/// The host decision for `op` on a communicator of shape `s`: the collective
/// and the bytes the size rules see (the all-reduce buffer, the
/// broadcast/reduce buffer, the gathered result, one rank's whole all-to-all
/// send buffer).
pub fn decide(op: &Op, s: &Shape, o: &AlgoOverride) -> Decision {
    let n = s.n;
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
    let a = choose_in(coll, bytes, s, o);
    log_choice(coll, bytes, s, a);
    Decision::Host(a)
}

/// `WEFT_DEBUG=INFO`: the first time a collective picks an algorithm for a
/// size class (powers of two) in this process, one line says which and why.
fn log_choice(coll: Coll, bytes: usize, s: &Shape, a: Algo) {
    use std::collections::HashSet;
    use std::sync::{Mutex, OnceLock};
    if crate::log::level() < crate::log::Level::Info {
        return;
    }
    type Key = (Coll, u32, usize, Algo);
    static SEEN: OnceLock<Mutex<HashSet<Key>>> = OnceLock::new();
    let class = bytes.max(1).next_power_of_two().trailing_zeros();
    let new = SEEN
        .get_or_init(Default::default)
        .lock()
        .map(|mut m| m.insert((coll, class, s.n, a)))
        .unwrap_or(false);
    if new {
        crate::log::info_log!(
            "tuner: {} of {} B on {} rank(s) ({} on this host, {} host(s), {} core(s)): {}",
            coll.name(),
            bytes,
            s.n,
            s.nlocal,
            s.hosts,
            s.cores,
            a.name()
        );
    }
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
    /// Latency slots in shared memory, one step (every rank on one host, up
    /// to the slot size): every rank publishes its buffer in its slot and
    /// reduces all n slots itself (all-reduce), reduces its block of the n
    /// slots (reduce-scatter) or copies the n blocks out (all-gather)
    /// (`algo/ll.rs`).
    Ll,
    /// Latency slots, two shots: reduce-scatter then all-gather through the
    /// slots, each one step (reads 2x the buffer instead of n x).
    Ll2,
}

impl Algo {
    /// Every host algorithm (their names are `WEFT_ALGO`'s words).
    pub const ALL: [Algo; 7] = [
        Algo::Ring,
        Algo::RecursiveDoubling,
        Algo::Tree,
        Algo::Direct,
        Algo::Pairwise,
        Algo::Ll,
        Algo::Ll2,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Algo::Ring => "ring",
            Algo::RecursiveDoubling => "rd",
            Algo::Tree => "tree",
            Algo::Direct => "direct",
            Algo::Pairwise => "pairwise",
            Algo::Ll => "ll",
            Algo::Ll2 => "ll2",
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
            Coll::AllReduce => matches!(a, Ring | RecursiveDoubling | Direct | Ll | Ll2),
            Coll::Broadcast | Coll::Reduce => matches!(a, Ring | Tree),
            Coll::AllGather | Coll::ReduceScatter => matches!(a, Ring | Direct | Ll),
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
    let s = s.trim().to_ascii_lowercase();
    if let Some(a) = Algo::ALL.into_iter().find(|a| a.name() == s) {
        return Ok(a);
    }
    Ok(match s.as_str() {
        "recursive_doubling" | "recursivedoubling" => Algo::RecursiveDoubling,
        "oneshot" | "one_shot" => Algo::Direct,
        other => {
            let names: Vec<&str> = Algo::ALL.iter().map(|a| a.name()).collect();
            return Err(Error::arg(format!(
                "WEFT_ALGO: unknown algorithm '{other}' ({}; for device memory also {})",
                names.join(", "),
                DEVICE_ALGOS.join(", ")
            )));
        }
    })
}

/// What `WEFT_ALGO` asks for (parsed by `FromStr`, read by [`from_env`](Self::from_env)).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct AlgoOverride {
    global: Option<Algo>,
    per: Vec<(Coll, Algo)>,
    /// The device algorithm the whole value names, if it names one.
    device: Option<&'static str>,
}

impl AlgoOverride {
    /// `WEFT_ALGO` (unset or blank: no override): the one place it is read.
    pub fn from_env() -> Result<AlgoOverride> {
        match params::WEFT_ALGO.raw().filter(|v| !v.trim().is_empty()) {
            Some(v) => v.parse(),
            None => Ok(AlgoOverride::default()),
        }
    }

    /// The device algorithm the value names as a whole (`WEFT_ALGO=twoshot`).
    pub fn device(&self) -> Option<&'static str> {
        self.device
    }
}

impl std::str::FromStr for AlgoOverride {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        let mut o = AlgoOverride {
            device: device_algo(s),
            ..AlgoOverride::default()
        };
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
/// (16 KiB on 16 cores, 32-64 KiB on 2). With every rank on one host the
/// latency slots take all-reduce up to their size (`Shape::slot_bytes`): one shot while
/// reading the n buffers costs less than a second synchronisation (up to
/// `LL_ONESHOT_READ` bytes read, and always with 2 ranks), two shots above.
/// Measured on 16 idle cores (docs/PERFORMANCE.md): one shot reading 16-32
/// KiB lost to two shots (8 ranks: 11.6 us at 4 KiB one shot, 4.5 us two
/// shots), so one shot stops at 8 KiB read; on 2 oversubscribed cores the
/// two shots cost more per synchronisation but stay under MPI there too.
const TINY_ALLREDUCE: usize = 4 << 10;
const LL_ONESHOT_READ: usize = 8 << 10;
/// Reduce-scatter and all-gather take the latency slots (one step) while
/// the whole buffer (the n blocks) is at most `LL_GATHER_MAX` and one rank's
/// block at most `LL_GATHER_BLOCK`. Measured on 2 cores (docs/PERFORMANCE.md,
/// best of 5 rounds): with 4 ranks the slots win at every size to 64 KiB
/// (all-gather 64 KiB: 8.5 us, ring 12.6, direct 15.7; reduce-scatter 16
/// KiB: 5.6 us, direct 26); with 2 ranks, blocks of 32 KiB are as fast or
/// faster through the rings (all-gather 64 KiB: 5.1 us, direct 4.4).
const LL_GATHER_MAX: usize = 64 << 10;
const LL_GATHER_BLOCK: usize = 16 << 10;
const DIRECT_MAX_RANKS: usize = 16;
const SMALL_ALLREDUCE: usize = 32 << 10;
const SMALL_OTHER: usize = 32 << 10;

/// The algorithm for `coll` moving `bytes` (the full buffer: the all-reduce
/// buffer, the gathered result, one rank's all-to-all send buffer) over `n`
/// ranks, nothing known of where they run.
pub fn choose(coll: Coll, bytes: usize, n: usize, o: &AlgoOverride) -> Algo {
    choose_in(coll, bytes, &Shape::ranks(n), o)
}

/// Whether the latency slots can carry this operation: each rank publishes
/// its all-reduce buffer, its n reduce-scatter blocks (`bytes`), or its
/// all-gather block (`bytes / n`).
fn ll_fits(coll: Coll, bytes: usize, s: &Shape) -> bool {
    s.all_local()
        && match coll {
            Coll::AllReduce | Coll::ReduceScatter => bytes <= s.slot_bytes,
            Coll::AllGather => bytes <= s.slot_bytes * s.n,
            _ => false,
        }
}

/// [`choose`] on a communicator of shape `s`. An override naming the latency
/// slots (`ll`, `ll2`) applies where they can run (all-reduce, reduce-scatter
/// and all-gather, every rank on this host, up to the slot size; `ll2` is
/// `ll` for the latter two); elsewhere the size rules choose.
pub fn choose_in(coll: Coll, bytes: usize, s: &Shape, o: &AlgoOverride) -> Algo {
    let n = s.n;
    let is_ll = |a: Algo| matches!(a, Algo::Ll | Algo::Ll2);
    if let Some((_, a)) = o.per.iter().find(|(c, _)| *c == coll)
        && (!is_ll(*a) || ll_fits(coll, bytes, s))
    {
        return *a;
    }
    if let Some(a) = o.global {
        if is_ll(a) {
            if ll_fits(coll, bytes, s) {
                // Reduce-scatter and all-gather have one latency-slot algorithm.
                return if coll == Coll::AllReduce { a } else { Algo::Ll };
            }
        } else if coll.supports(a) {
            return a;
        }
        // A single name like `tree` also selects the latency path where it has another name.
        if matches!(a, Algo::Tree | Algo::RecursiveDoubling | Algo::Direct)
            || (is_ll(a) && coll != Coll::AllReduce)
        {
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
    if ll_fits(coll, bytes, s) {
        match coll {
            Coll::AllReduce => {
                let one = n == 2 || bytes * n <= LL_ONESHOT_READ;
                return if one { Algo::Ll } else { Algo::Ll2 };
            }
            _ if bytes <= LL_GATHER_MAX && bytes / n <= LL_GATHER_BLOCK => return Algo::Ll,
            _ => {}
        }
    }
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
        // Device-only names leave host memory to the size rules, and steer
        // the device backend.
        for d in ["twoshot", " Staged "] {
            let o: AlgoOverride = d.parse().unwrap();
            assert_eq!((o.global, o.per.len()), (None, 0));
            assert_eq!(o.device(), Some(d.trim().to_ascii_lowercase().as_str()));
        }
        // `ll` and `oneshot` steer both; a list or a host name, the host only.
        let o: AlgoOverride = "ll".parse().unwrap();
        assert_eq!((o.global, o.device()), (Some(Algo::Ll), Some("ll")));
        let o: AlgoOverride = "oneshot".parse().unwrap();
        assert_eq!(
            (o.global, o.device()),
            (Some(Algo::Direct), Some("oneshot"))
        );
        for h in ["ring", "allreduce:ll", "ll,ring"] {
            assert_eq!(h.parse::<AlgoOverride>().unwrap().device(), None, "{h}");
        }
        // `ll` names the latency slots on host memory too (all-reduce only).
        assert!("allreduce:ll".parse::<AlgoOverride>().is_ok());
        assert!("broadcast:ll".parse::<AlgoOverride>().is_err());
    }

    /// The latency slots' size on host memory (`transport::shm::LL_SLOT_BYTES`).
    const SLOT: usize = 64 << 10;

    fn one_host(n: usize, cores: usize) -> Shape {
        Shape {
            n,
            nlocal: n,
            hosts: 1,
            cores,
            slot_bytes: SLOT,
        }
    }

    #[test]
    fn the_names_are_the_registry_s() {
        // The host names are the words WEFT_ALGO's documentation lists...
        let help = params::find("WEFT_ALGO").unwrap().help;
        for a in Algo::ALL {
            assert!(help.contains(&format!("`{}`", a.name())), "{}", a.name());
            assert_eq!(parse_algo(a.name()).unwrap(), a);
        }
        // ... and the device names its list for WEFT_CUDA_ALGO.
        assert_eq!(DEVICE_ALGOS, params::CUDA_ALGOS);
        let e = parse_algo("warp").unwrap_err().to_string();
        assert!(
            e.contains("ring, rd, tree, direct, pairwise, ll, ll2"),
            "{e}"
        );
        assert!(e.contains("oneshot, twoshot, ll, staged"), "{e}");
    }

    #[test]
    fn without_slots_the_latency_path_is_never_chosen() {
        let o = AlgoOverride::default();
        let s = Shape {
            slot_bytes: 0,
            ..one_host(4, 16)
        };
        assert_eq!(choose_in(Coll::AllReduce, 8, &s, &o), Algo::Direct);
        assert_eq!(choose_in(Coll::AllGather, 8, &s, &o), Algo::Direct);
        assert_eq!(Shape::local(4, 4).with_slots(SLOT), one_host(4, cores()));
    }

    #[test]
    fn latency_slots_by_size_ranks_hosts_and_cores() {
        let o = AlgoOverride::default();
        let s = one_host(4, 16);
        assert_eq!(choose_in(Coll::AllReduce, 8, &s, &o), Algo::Ll);
        // One shot while the n inputs read are at most 8 KiB.
        assert_eq!(choose_in(Coll::AllReduce, 2 << 10, &s, &o), Algo::Ll);
        assert_eq!(choose_in(Coll::AllReduce, 4 << 10, &s, &o), Algo::Ll2);
        assert_eq!(choose_in(Coll::AllReduce, 16 << 10, &s, &o), Algo::Ll2);
        assert_eq!(choose_in(Coll::AllReduce, 64 << 10, &s, &o), Algo::Ll2);
        assert_eq!(choose_in(Coll::AllReduce, 128 << 10, &s, &o), Algo::Ring);
        // Oversubscribed: the same choice (every rank must make the same one).
        let s = one_host(4, 2);
        assert_eq!(choose_in(Coll::AllReduce, 64 << 10, &s, &o), Algo::Ll2);
        assert_eq!(
            choose_in(Coll::AllReduce, 8, &one_host(8, 16), &o),
            Algo::Ll
        );
        assert_eq!(
            choose_in(Coll::AllReduce, 1 << 10, &one_host(8, 16), &o),
            Algo::Ll
        );
        assert_eq!(
            choose_in(Coll::AllReduce, 2 << 10, &one_host(8, 16), &o),
            Algo::Ll2
        );
        // Two ranks: one shot.
        assert_eq!(
            choose_in(Coll::AllReduce, 64 << 10, &one_host(2, 16), &o),
            Algo::Ll
        );
        // Several hosts, or nothing known: the previous rules.
        let two = Shape {
            n: 8,
            nlocal: 4,
            hosts: 2,
            cores: 16,
            slot_bytes: SLOT,
        };
        assert_eq!(choose_in(Coll::AllReduce, 8, &two, &o), Algo::Direct);
        assert_eq!(choose(Coll::AllReduce, 8, 4, &o), Algo::Direct);
        // Reduce-scatter and all-gather: one step through the slots while
        // the whole buffer is at most 64 KiB and a block at most 16 KiB, on
        // one host only.
        for c in [Coll::ReduceScatter, Coll::AllGather] {
            assert_eq!(choose_in(c, 8, &s, &o), Algo::Ll);
            assert_eq!(choose_in(c, 64 << 10, &s, &o), Algo::Ll);
            assert_eq!(choose_in(c, 128 << 10, &s, &o), Algo::Ring);
            assert_eq!(choose_in(c, 64 << 10, &one_host(8, 16), &o), Algo::Ll);
            assert_eq!(choose_in(c, 32 << 10, &one_host(2, 16), &o), Algo::Ll);
            assert_eq!(choose_in(c, 64 << 10, &one_host(2, 16), &o), Algo::Direct);
            assert_eq!(choose_in(c, 8, &two, &o), Algo::Direct);
            assert_eq!(choose(c, 8, 4, &o), Algo::Direct);
        }
        // Other collectives keep theirs.
        assert_eq!(choose_in(Coll::Broadcast, 8, &s, &o), Algo::Tree);
        assert_eq!(Shape::local(8, 3).hosts, 3);
    }

    #[test]
    fn latency_slot_overrides_apply_where_they_can_run() {
        let s = one_host(4, 16);
        let o: AlgoOverride = "ll".parse().unwrap();
        assert_eq!(choose_in(Coll::AllReduce, 64 << 10, &s, &o), Algo::Ll);
        // Too big for a slot, or ranks on two hosts: the size rules.
        assert_eq!(choose_in(Coll::AllReduce, 1 << 20, &s, &o), Algo::Ring);
        let two = Shape {
            n: 4,
            nlocal: 2,
            hosts: 2,
            cores: 16,
            slot_bytes: SLOT,
        };
        assert_eq!(choose_in(Coll::AllReduce, 8, &two, &o), Algo::Direct);
        // Other collectives: the latency algorithm of each (reduce-scatter
        // and all-gather: the slots while each rank's part fits in one).
        assert_eq!(choose_in(Coll::Broadcast, 1 << 20, &s, &o), Algo::Tree);
        assert_eq!(choose_in(Coll::AllGather, 1 << 20, &s, &o), Algo::Direct);
        assert_eq!(choose_in(Coll::AllGather, 256 << 10, &s, &o), Algo::Ll);
        assert_eq!(choose_in(Coll::ReduceScatter, 64 << 10, &s, &o), Algo::Ll);
        assert_eq!(
            choose_in(Coll::ReduceScatter, 128 << 10, &s, &o),
            Algo::Direct
        );
        assert_eq!(choose_in(Coll::ReduceScatter, 8, &two, &o), Algo::Direct);
        let o: AlgoOverride = "reducescatter:ll,allgather:ll".parse().unwrap();
        assert_eq!(choose_in(Coll::ReduceScatter, 8, &s, &o), Algo::Ll);
        assert_eq!(choose_in(Coll::AllGather, 8, &s, &o), Algo::Ll);
        assert_eq!(choose_in(Coll::AllReduce, 8, &s, &o), Algo::Ll);
        assert!("reducescatter:ll2".parse::<AlgoOverride>().is_err());
        let o: AlgoOverride = "allreduce:ll2".parse().unwrap();
        assert_eq!(choose_in(Coll::AllReduce, 8, &s, &o), Algo::Ll2);
        assert_eq!(
            choose_in(Coll::AllReduce, 8, &one_host(4, 1), &o),
            Algo::Ll2
        );
        let o: AlgoOverride = "rd".parse().unwrap();
        assert_eq!(
            choose_in(Coll::AllReduce, 8, &s, &o),
            Algo::RecursiveDoubling
        );
    }
}
