//! Large host collectives of a communicator whose ranks span hosts, on the
//! cross-host engine (`crosshost/`): two levels, a host-local communicator
//! within each host and the engine's pipelined chunks over the byte mover
//! (`WEFT_NET_SOCKETS` sockets per peer pair) between hosts, instead of the
//! flat host algorithms over one TCP connection per peer. Host-memory
//! calls, and the host part of device collectives across hosts: their
//! progress thread (`cuda/proxy.rs`) cannot run the collectives that build
//! the engine while it holds a device job, so the caller's thread builds
//! it when the communicator's first device operation sets its cross-host
//! path up, and the progress thread only runs collectives on an engine
//! built already.
//!
//! `WEFT_CROSSHOST_MIN_BYTES` (every rank the same, like `WEFT_ALGO`) is
//! the smallest all-reduce, all-gather, reduce-scatter or all-to-all (of
//! device memory: broadcast and reduce too; by its whole data, an
//! all-gather's output) that takes the engine. Unset:
//! [`DEVICE_MIN_BYTES`] for device collectives (on 2 GPUs as two hosts the
//! engine moved up to 3.4x the flat path's bus bandwidth from 4 MiB, and
//! since its waits back off by time it wins from 1 MiB too:
//! docs/PERFORMANCE-GPU.md "Across hosts"), and never for host
//! memory (not yet measured beside the flat path where the cores are not
//! the limit: docs/PERFORMANCE.md, "Cross-host byte mover"). A value above
//! every collective's size keeps all flat. The engine
//! is built at the first host operation that qualifies or the first device
//! operation, on every rank at the same point of the call order (its
//! handle exchange and the host split are collectives of the
//! communicator, and the collectives that build it take the flat path);
//! a communicator that turns out to live on one host, or whose engine any
//! rank could not build, keeps the flat path on every rank, logged once.
//!
//! The sends and receives of a device job (an all-to-all's pieces too) take
//! the engine piece by piece from [`DEVICE_P2P_MIN_BYTES`] each when the
//! setting is unset (from the setting when set): an all-to-all of 1 MiB on
//! 2 hosts is two pieces of 512 KiB, which went flat at about the speed of
//! NCCL's sockets while a send of 1 MiB on the engine moved 2.5x that.
//!
//! Whom it connects to ([`engine_reach`]): every remote rank while a rank
//! has at most `WEFT_CROSSHOST_MAX_PEERS` of them; beyond that, on hosts of
//! equal size, its rail alone, every collective then on rails; with more
//! hosts than that, its two ring neighbours on its rail (rings and chains
//! on rails, all-to-all on the flat path); on uneven hosts past the limit,
//! no engine by default. The byte mover is the rank's own TCP, or the
//! sidecar proxy with `WEFT_CROSSHOST_NET=proxy` (`net/proxy/`).
//!
//! Failures stay bounded as on the flat path: the engine names the rank
//! that failed or went silent (`WEFT_TIMEOUT_MS`), and an abort or a
//! failure raised on the communicator (the sidecar's lever, the device
//! watch) releases a call waiting in the engine at once (not yet one still
//! building it: connecting is bounded by 60 s).

use super::communicator::Communicator;
use super::cross_mover::CommMover;
use super::cross_slot::{State, Stop};
use super::shared::lock;
use crate::crosshost::{Coll, CrossHost, Layout, Links, Shape};
use crate::error::{Error, Result};
use crate::net::Net;
use crate::net::proxy::ProxyNet;
use crate::net::tcp::{TcpConfig, TcpNet};
use crate::observe::{self, Lever};
use crate::op::backend::JobProgress;
use crate::op::{Op, OpKind};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

/// How long building the engine may take (connecting to every remote rank).
const CONNECT_BOUND: Duration = Duration::from_secs(60);

/// The smallest device collective on the engine when
/// `WEFT_CROSSHOST_MIN_BYTES` is unset (see the module docs). 1 MiB since
/// the waits back off by time (`sys/backoff.rs`): under torch on 2 x H200
/// as 2 hosts x 1 (two rounds, the same call), the engine from 1 MiB moved
/// broadcast of 1 MiB 2.9-3.3 -> 6.0-6.2 GB/s, all-to-all of 4 MiB
/// 2.0-2.4 -> 3.8-4.0 and all-reduce of 1 MiB 1.8-1.9 -> 2.0-2.1.
pub const DEVICE_MIN_BYTES: usize = 1 << 20;

/// The smallest send or receive of a device job on the engine when
/// `WEFT_CROSSHOST_MIN_BYTES` is unset (see the module docs). Under torch
/// on 2 x H200 as 2 hosts x 1 (100 calls, two rounds): sendrecv of 1 MiB,
/// on the engine, 5.3-5.5 GB/s; all-to-all of 1 MiB, pieces of 512 KiB,
/// flat, 1.9-2.1 (NCCL 1.7-1.8).
pub const DEVICE_P2P_MIN_BYTES: usize = 256 << 10;
const _: () = assert!(DEVICE_P2P_MIN_BYTES < DEVICE_MIN_BYTES);

/// Which ranks of other hosts the engine connects to, on a layout (the same
/// answer on every rank: the layout is).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Reach {
    /// Every remote rank: any shape the tuner picks.
    All,
    /// Only the ranks of its rail (same local index, one per other host):
    /// every collective on rails, whose plans use nothing else. For jobs
    /// whose ranks have more than `max` remote ranks on hosts of equal
    /// size (4 nodes x 8 GPUs: 3 rail peers instead of 24).
    Rails,
    /// Only its two neighbours on its rail's ring (the previous and the
    /// next host's), when even its rail has more than `max` ranks (more
    /// hosts): all-reduce, all-gather, reduce-scatter, broadcast and reduce
    /// on rails (rings and chains), all-to-all on the flat path.
    Ring,
    /// Hosts of different sizes with more than `max` remote ranks a rank.
    TooMany,
}

fn engine_reach(layout: &Layout, max: usize) -> Reach {
    // A rank's remote peers: every rank but its host's.
    let most = (0..layout.nhosts())
        .map(|h| layout.n() - layout.members(h).len())
        .max()
        .unwrap_or(0);
    match layout.per_host() {
        _ if most <= max => Reach::All,
        Some(_) if layout.nhosts() - 1 <= max => Reach::Rails,
        Some(_) => Reach::Ring,
        None => Reach::TooMany,
    }
}

/// The engine's collective for `op`, when it takes it. Broadcast and
/// reduce of host memory stay on the flat path: their non-root ranks may
/// pass no buffer (NCCL allows it), and every rank must decide alike from
/// what all of them pass (kind and size). A device collective's host part
/// always has its buffers (the pinned copies), and the engine's plans
/// never touch a non-root's unused one.
fn coll(op: &Op, device: bool) -> Option<Coll> {
    Some(match op.kind {
        OpKind::AllReduce => Coll::AllReduce,
        OpKind::AllGather => Coll::AllGather,
        OpKind::ReduceScatter => Coll::ReduceScatter,
        OpKind::AllToAll => Coll::AllToAll,
        OpKind::Broadcast if device => Coll::Broadcast { root: op.root },
        OpKind::Reduce if device => Coll::Reduce { root: op.root },
        _ => return None,
    })
}

/// Whether every rank said yes, over the flat path.
pub(super) fn all_agree(c: &Communicator, yes: bool) -> Result<bool> {
    let all = crate::crosshost::Exchange::all_gather(c, &[u8::from(yes)])?;
    Ok(all.iter().all(|v| v.first() == Some(&1)))
}

impl Communicator {
    /// Whether `op` (validated, host memory) runs on the cross-host
    /// engine; builds the engine at the first operation that qualifies.
    /// Called before the operation is reported, so the collectives that
    /// build the engine are reported as calls of their own before it.
    pub(crate) fn takes_cross_engine(&self, op: &Op) -> bool {
        self.qualifies_for_cross_engine(op, false)
            && self.prepare_cross_engine(false)
            && self.cross_engine_runs(op, false)
    }

    /// Whether the engine built runs `op`'s collective (one connected to
    /// its ring neighbours alone runs no all-to-all): the same answer on
    /// every rank (the engine's reach follows from the layout).
    fn cross_engine_runs(&self, op: &Op, device: bool) -> bool {
        match (&*lock(&self.s.cross.state), coll(op, device)) {
            (State::On(x), Some(c)) => c != Coll::AllToAll || x.all_to_all,
            _ => false,
        }
    }

    /// The smallest collective on the engine, for device collectives (the
    /// host part of which the progress thread runs) or host ones; None:
    /// none.
    fn cross_engine_min(&self, device: bool) -> Option<usize> {
        self.s
            .cfg
            .cross_engine_min_bytes
            .or(device.then_some(DEVICE_MIN_BYTES))
    }

    /// Whether `op` is one the engine runs once built (configured, its
    /// kind, its size).
    fn qualifies_for_cross_engine(&self, op: &Op, device: bool) -> bool {
        let Some(min) = self.cross_engine_min(device) else {
            return false;
        };
        // By the whole data (an all-gather's output): a 4 MiB all-gather on
        // 2 hosts, 2 MiB a rank, went flat at 1.7 GB/s beside the
        // all-reduce's 3.2 on the engine (torch, 2 x H200 as 2 hosts x 1).
        coll(op, device).is_some() && !op.is_empty() && op.whole_bytes(self.s.nranks) >= min
    }

    /// Whether `op` runs on an engine built already; never builds one. For
    /// the device backend's progress thread, which runs the host part of a
    /// device collective spanning hosts and cannot run the collectives
    /// that build the engine (the caller's thread did, in
    /// [`prepare_cross_engine`](Self::prepare_cross_engine), when the
    /// communicator's first device operation set its cross-host path up).
    pub(crate) fn cross_engine_ready_for(&self, op: &Op) -> bool {
        self.qualifies_for_cross_engine(op, true)
            && !self.s.cross.building.load(Ordering::Acquire)
            && self.cross_engine_runs(op, true)
    }

    /// Builds the engine if it is configured (for device collectives when
    /// `device`) and was not tried yet (every rank at the same point of its
    /// calls); whether it is on.
    pub(crate) fn prepare_cross_engine(&self, device: bool) -> bool {
        if self.cross_engine_min(device).is_none() || self.s.cross.building.load(Ordering::Acquire)
        {
            return false;
        }
        let mut state = lock(&self.s.cross.state);
        if matches!(*state, State::Untried) {
            self.s.cross.building.store(true, Ordering::Release);
            let built = self.build_cross_engine(device);
            self.s.cross.building.store(false, Ordering::Release);
            *state = match built {
                Ok(Some((x, local))) => {
                    *lock(&self.s.cross.stop) = Some(Stop {
                        engine: x.engine().aborter(),
                        local,
                    });
                    State::On(Box::new(x))
                }
                Ok(None) => State::Off,
                Err(e) => {
                    crate::log::warn_log!(
                        "comm {} rank {}: the cross-host engine was not built ({e}); the flat host path runs its collectives",
                        self.s.label,
                        self.s.rank
                    );
                    State::Off
                }
            };
        }
        matches!(*state, State::On(_))
    }

    /// Runs `op` on the engine ([`takes_cross_engine`](Self::takes_cross_engine)
    /// or [`cross_engine_ready_for`](Self::cross_engine_ready_for) said
    /// so), reported as one `crosshost` call.
    pub(crate) fn run_on_cross_engine(&self, op: &Op, device: bool) -> Result<()> {
        self.run_observed_on_engine(op, device, None)
    }

    /// The sends and receives of a device job's host part (`ops`, all
    /// sends and receives) that run on the engine, and the rest: those of
    /// at least [`DEVICE_P2P_MIN_BYTES`] (or the setting), when the engine is built and
    /// connected to every remote rank. Both ends of a message decide alike
    /// (the same bytes), so each end's engine part and flat part match the
    /// other's. None: all flat.
    pub(crate) fn cross_engine_p2p_split(&self, ops: &[Op]) -> Option<(Vec<Op>, Vec<Op>)> {
        if !ops.iter().all(Op::is_send_recv) || self.s.cross.building.load(Ordering::Acquire) {
            return None;
        }
        let min = self
            .s
            .cfg
            .cross_engine_min_bytes
            .unwrap_or(DEVICE_P2P_MIN_BYTES);
        if !matches!(&*lock(&self.s.cross.state), State::On(x) if x.send_recv) {
            return None;
        }
        let (on, flat): (Vec<Op>, Vec<Op>) = ops.iter().partition(|o| o.bytes() >= min);
        (!on.is_empty()).then_some((on, flat))
    }

    /// Runs sends and receives (validated, host memory: a device job's
    /// pinned copies) on the engine, as one group: every rank's own pieces
    /// by bytes, to ranks of other hosts directly over its connections,
    /// within its host through the engine's host-local communicator.
    ///
    /// # Safety
    /// Every buffer is valid for its bytes until this returns.
    pub(crate) unsafe fn run_p2p_on_cross_engine(&self, ops: &[Op]) -> Result<()> {
        let obs = observe::start(&self.s.who(), ops, true, "crosshost");
        let r = (|| {
            let mut state = lock(&self.s.cross.state);
            let State::On(x) = &mut *state else {
                return Err(Error::Internal(
                    "the cross-host engine is gone (destroyed meanwhile?)".into(),
                ));
            };
            let sends: Vec<(usize, *const u8, usize)> = ops
                .iter()
                .filter(|o| o.kind == OpKind::Send)
                .map(|o| (o.peer(), o.send, o.bytes()))
                .collect();
            let recvs: Vec<(usize, *mut u8, usize)> = ops
                .iter()
                .filter(|o| o.kind == OpKind::Recv)
                .map(|o| (o.peer(), o.recv, o.bytes()))
                .collect();
            // SAFETY: the caller's.
            unsafe { x.send_recv(&sends, &recvs, crate::data::types::DataType::U8) }
        })();
        if let Err(e) = &r {
            self.s.record_failure(e);
        }
        observe::finish(obs, &r);
        r
    }

    /// As [`run_on_cross_engine`](Self::run_on_cross_engine) for a device
    /// job's collective whose stream puts its input in place and copies its
    /// output out chunk by chunk (`HostRunner::run_progressive`).
    pub(crate) fn run_on_cross_engine_progressive(
        &self,
        op: &Op,
        progress: Arc<dyn JobProgress>,
    ) -> Result<()> {
        self.run_observed_on_engine(op, true, Some(progress))
    }

    fn run_observed_on_engine(
        &self,
        op: &Op,
        device: bool,
        progress: Option<Arc<dyn JobProgress>>,
    ) -> Result<()> {
        let obs = observe::start(&self.s.who(), std::slice::from_ref(op), false, "crosshost");
        let r = (|| {
            let mut state = lock(&self.s.cross.state);
            let (State::On(x), Some(coll)) = (&mut *state, coll(op, device)) else {
                return Err(Error::Internal(
                    "the cross-host engine is gone (destroyed meanwhile?)".into(),
                ));
            };
            let redop = op.redop.unwrap_or(crate::data::types::ReduceOp::Sum);
            let (send, recv, count, dtype) = (op.send, op.recv, op.count, op.dtype);
            // SAFETY: validated by the caller; every rank passes both buffers
            // of these collectives.
            unsafe { x.collective_progressive(coll, send, recv, count, dtype, redop, progress) }
        })();
        if let Err(e) = &r {
            self.s.record_failure(e);
        }
        observe::finish(obs, &r);
        r
    }

    /// The engine over this communicator: its layout by host identity, a
    /// host-local split, connections to every remote rank. `None` when
    /// every rank is on one host or any rank could not build its part:
    /// every rank ends with the same answer (two agreements over the flat
    /// path; the layout is the bootstrap's host identities, the same on
    /// every rank), so none runs a collective on the engine that another
    /// runs flat. With the engine, the host-local communicator's lever (to
    /// abort it).
    fn build_cross_engine(&self, device: bool) -> Result<Option<(CrossHost, Weak<dyn Lever>)>> {
        // The host identities the bootstrap exchanged (the same the device
        // path decides "spans hosts" from, and the same on every rank): on
        // one host every rank stops here alike, before any collective.
        let layout = Layout::from_host_ids(&self.s.host_ids());
        if layout.nhosts() < 2 {
            return Ok(None);
        }
        let max = self.s.cfg.cross_engine_max_peers;
        let reach = match engine_reach(&layout, max) {
            Reach::TooMany if self.s.cfg.cross_engine_min_bytes.is_none() => {
                crate::log::info_log!(
                    "comm {} rank {}: {}: more than {max} remote peers a rank (WEFT_CROSSHOST_MAX_PEERS) on hosts of different sizes (no rails), so the cross-host engine is not built by default (WEFT_CROSSHOST_MIN_BYTES builds it, connected to every remote rank); the flat path runs every collective",
                    self.s.label,
                    self.s.rank,
                    layout.describe()
                );
                return Ok(None);
            }
            Reach::TooMany => Reach::All,
            r => r,
        };
        // What can fail here alone comes first and is agreed on. The byte
        // mover authenticates with the communicator's own secret (the
        // unique id it was created from: a program that passes ids itself
        // has none in its environment).
        let me = self.rank();
        let peers = match reach {
            Reach::Rails => layout.rail_peers(me),
            Reach::Ring => layout.ring_peers(me),
            Reach::All | Reach::TooMany => layout.remote(me),
        };
        let net = self.cross_byte_mover(&peers);
        if !all_agree(self, net.is_ok())? {
            return net.and(Ok(None));
        }
        let (net, mover) = net?;
        let h = layout.host(me);
        // The split and the connections are collectives; whatever fails on
        // one rank fails (or times out) the same step on the others, and
        // the last agreement settles it for all.
        // The host-local communicator is the engine's own and must be
        // ready before the engine uses it: blocking, whatever this one's
        // configuration says (the C ABI starts a communicator made inside
        // a group non-blocking, as nccl-tests' are; a child split with
        // that configuration came back still initializing and the
        // engine's first host-local step failed).
        let built = self
            .split_with_config(Some(h as u32), me as i32, self.s.cfg.clone().blocking(true))
            .and_then(|l| l.ok_or_else(|| Error::Internal("no host-local communicator".into())))
            .and_then(|local| {
                let links = Links::connect(net, self, me, &peers, Instant::now() + CONNECT_BOUND)?;
                let lever = std::sync::Arc::downgrade(&local.s) as Weak<dyn Lever>;
                let mover = CommMover::new(local, layout.members(h).to_vec());
                let mut x = CrossHost::new(
                    layout.clone(),
                    links,
                    Box::new(mover),
                    &self.s.label,
                    self.s.cfg.timeout,
                )?;
                if matches!(reach, Reach::Rails | Reach::Ring) {
                    // Its plans use the rail alone (rings and chains: the
                    // ring neighbours), which is all it reaches.
                    x.shape = Some(Shape::Rails);
                    x.all_to_all = reach == Reach::Rails;
                    x.send_recv = false;
                }
                Ok((x, lever))
            });
        if !all_agree(self, built.is_ok())? {
            return built.and(Ok(None));
        }
        crate::log::info_log!(
            "comm {} rank {}: {} collectives of {} bytes and more run on the cross-host engine ({}; between hosts {mover}, to {} remote rank(s){})",
            self.s.label,
            self.s.rank,
            if device { "device" } else { "host" },
            self.cross_engine_min(device).unwrap_or(0),
            layout.describe(),
            peers.len(),
            match reach {
                Reach::Rails => ": its rail only, every collective on rails",
                Reach::Ring =>
                    ": its ring neighbours on its rail only, every collective on rails, all-to-all on the flat path",
                _ => "",
            }
        );
        built.map(Some)
    }

    /// The engine's byte mover to `remotes` (this rank's peers on other
    /// hosts), and how it moves for the log: TCP connections of the rank's
    /// own, authenticated with the communicator's secret (the unique id it
    /// was created from: a program that passes ids itself has none in its
    /// environment); or the sidecar proxy's rings
    /// (`WEFT_CROSSHOST_NET=proxy`), with TCP kept for failure notices.
    fn cross_byte_mover(&self, remotes: &[usize]) -> Result<(Arc<dyn Net>, &'static str)> {
        let (ctx, _) = self
            .s
            .built
            .get()
            .ok_or_else(|| Error::Internal("the communicator was never built".into()))?;
        // Peers dial this rank where they reach its communicator's endpoint.
        let cfg = TcpConfig::from_env(ctx.secret)
            .map_err(|e| Error::arg(e.to_string()))?
            .advertising(ctx.peers[ctx.rank].addr.ip());
        let tcp: Arc<dyn Net> = TcpNet::new(cfg)
            .map_err(|e| Error::Internal(format!("the cross-host byte mover: {e}")))?;
        if !self.s.cfg.cross_engine_via_proxy {
            return Ok((tcp, "over the rank's own TCP connections"));
        }
        let path = crate::transport::sidecar_link::socket_path()?.ok_or_else(|| {
            Error::arg(
                "WEFT_CROSSHOST_NET=proxy, but no sidecar proxy is offered (WEFT_SIDECAR_SOCKET with a .proxy socket, WEFT_PROXY not 0)",
            )
        })?;
        let net = ProxyNet::open(
            &path,
            ctx,
            remotes,
            tcp,
            crate::crosshost::DATA_STREAM,
            Instant::now() + CONNECT_BOUND,
        )?;
        Ok((net, "through the sidecar proxy"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_engine_reaches_every_remote_rank_its_rail_or_none_by_layout() {
        let m = crate::config::DEFAULT_CROSSHOST_MAX_PEERS;
        // 2 hosts x 4: 4 remote peers each; 3 x 4: 8; 2 x 8: 8.
        assert_eq!(engine_reach(&Layout::uniform(2, 4), m), Reach::All);
        assert_eq!(engine_reach(&Layout::uniform(3, 4), m), Reach::All);
        assert_eq!(engine_reach(&Layout::uniform(2, 8), m), Reach::All);
        // 3 x 8: 16 remote, 2 on the rail; 4 x 8: 24, 3; 9 x 8: 64, 8.
        assert_eq!(engine_reach(&Layout::uniform(3, 8), m), Reach::Rails);
        assert_eq!(engine_reach(&Layout::uniform(4, 8), m), Reach::Rails);
        assert_eq!(engine_reach(&Layout::uniform(9, 8), m), Reach::Rails);
        // 10 x 8: 9 on the rail; 10 x 1: 9 remote (the rail is all): the
        // ring neighbours alone.
        assert_eq!(engine_reach(&Layout::uniform(10, 8), m), Reach::Ring);
        assert_eq!(engine_reach(&Layout::uniform(9, 1), m), Reach::All);
        assert_eq!(engine_reach(&Layout::uniform(10, 1), m), Reach::Ring);
        assert_eq!(engine_reach(&Layout::uniform(64, 8), m), Reach::Ring);
        // Uneven hosts have no rails: the rank with the most remote peers
        // decides for all.
        let uneven = Layout::from_hosts(vec![vec![0], (1..10).collect()]).unwrap();
        assert_eq!(engine_reach(&uneven, m), Reach::TooMany);
        // The limit is WEFT_CROSSHOST_MAX_PEERS: 2 x 2 with 1.
        assert_eq!(engine_reach(&Layout::uniform(2, 2), 1), Reach::Rails);
    }

    #[test]
    fn a_rail_is_symmetric_and_one_rank_per_other_host() {
        let l = Layout::from_hosts(vec![vec![5, 0, 3], vec![1, 4, 2], vec![6, 7, 8]]).unwrap();
        for r in 0..l.n() {
            let peers = l.rail_peers(r);
            assert_eq!(peers.len(), l.nhosts() - 1, "rank {r}: {peers:?}");
            let mut hosts: Vec<usize> = peers.iter().map(|&p| l.host(p)).collect();
            hosts.sort();
            hosts.dedup();
            assert_eq!(hosts.len(), l.nhosts() - 1);
            assert!(!hosts.contains(&l.host(r)));
            for &p in &peers {
                assert_eq!(l.local(p), l.local(r));
                assert!(l.rail_peers(p).contains(&r), "{p} does not reach {r}");
            }
        }
        let uneven = Layout::from_hosts(vec![vec![0], vec![1, 2]]).unwrap();
        assert_eq!(uneven.rail_peers(0), uneven.remote(0));
        assert_eq!(uneven.ring_peers(0), uneven.remote(0));
    }

    #[test]
    fn ring_neighbours_are_the_previous_and_next_host_on_the_rail_and_symmetric() {
        let l = Layout::uniform(5, 3);
        for r in 0..l.n() {
            let peers = l.ring_peers(r);
            assert_eq!(peers.len(), 2, "rank {r}: {peers:?}");
            let h = l.host(r);
            let hosts: Vec<usize> = peers.iter().map(|&p| l.host(p)).collect();
            assert_eq!(hosts, [(h + 4) % 5, (h + 1) % 5], "rank {r}");
            for &p in &peers {
                assert_eq!(l.local(p), l.local(r));
                assert!(l.ring_peers(p).contains(&r), "{p} does not reach {r}");
            }
        }
        // Two hosts: one neighbour, both ways.
        let two = Layout::uniform(2, 2);
        assert_eq!(two.ring_peers(0), [2]);
        assert_eq!(two.ring_peers(3), [1]);
    }
}
