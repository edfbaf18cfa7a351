//! Large host collectives of a communicator whose ranks span hosts, on the
//! cross-host engine (`crosshost/`): two levels, a host-local communicator
//! within each host and the engine's pipelined chunks over the byte mover
//! (`WEFT_NET_SOCKETS` sockets per peer pair) between hosts, instead of the
//! flat host algorithms over one TCP connection per peer. On host memory
//! the engine measured 1.3-2x the flat path from 4 MiB up
//! (docs/PERFORMANCE.md, "Cross-host byte mover"); device collectives
//! across hosts run their host part here too (`cuda/proxy.rs` hands its
//! jobs to the host path).
//!
//! Opt-in: `WEFT_CROSSHOST_MIN_BYTES` (every rank the same, like
//! `WEFT_ALGO`) is the smallest operation that takes the engine; unset,
//! nothing here runs. The engine is built at the first operation that
//! qualifies, on every rank at the same point of the call order (its
//! handle exchange and the host split are collectives of the
//! communicator); a communicator that turns out to live on one host, or
//! whose engine could not be built, keeps the flat path, logged once.
//!
//! Failures stay bounded as on the flat path: the engine names the rank
//! that failed or went silent (`WEFT_TIMEOUT_MS`), and an abort or a
//! failure raised on the communicator (the sidecar's lever, the device
//! watch) releases a call waiting in the engine at once.

use super::communicator::Communicator;
use super::cross_mover::CommMover;
use super::cross_slot::{State, Stop};
use super::shared::lock;
use crate::crosshost::{Coll, CrossHost, Layout, Links};
use crate::error::{Error, Result};
use crate::net::tcp::{TcpConfig, TcpNet};
use crate::observe::Lever;
use crate::op::{Op, OpKind};
use std::sync::Weak;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// How long building the engine may take (connecting to every remote rank).
const CONNECT_BOUND: Duration = Duration::from_secs(60);

/// The engine's collective for `op`, when it has one.
fn coll(op: &Op) -> Option<Coll> {
    Some(match op.kind {
        OpKind::AllReduce => Coll::AllReduce,
        OpKind::AllGather => Coll::AllGather,
        OpKind::ReduceScatter => Coll::ReduceScatter,
        OpKind::AllToAll => Coll::AllToAll,
        OpKind::Broadcast => Coll::Broadcast { root: op.root },
        OpKind::Reduce => Coll::Reduce { root: op.root },
        _ => return None,
    })
}

impl Communicator {
    /// Runs `op` (validated, host memory) on the cross-host engine when it
    /// qualifies; `None`: the flat host path runs it.
    pub(crate) fn on_cross_engine(&self, op: &Op) -> Option<Result<()>> {
        let min = self.s.cfg.cross_engine_min_bytes?;
        let coll = coll(op)?;
        if op.is_empty() || op.bytes() < min || op.send.is_null() || op.recv.is_null() {
            return None;
        }
        if self.s.cross.building.load(Ordering::Acquire) {
            return None;
        }
        let mut state = lock(&self.s.cross.state);
        if matches!(*state, State::Untried) {
            self.s.cross.building.store(true, Ordering::Release);
            let built = self.build_cross_engine();
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
                        "comm {} rank {}: the cross-host engine could not be built ({e}); the flat host path runs its collectives",
                        self.s.label,
                        self.s.rank
                    );
                    State::Off
                }
            };
        }
        let State::On(x) = &mut *state else {
            return None;
        };
        let redop = op.redop.unwrap_or(crate::data::types::ReduceOp::Sum);
        // SAFETY: validated by the caller; the buffers are the operation's.
        let r = unsafe { x.collective(coll, op.send, op.recv, op.count, op.dtype, redop) };
        if let Err(e) = &r {
            self.s.record_failure(e);
        }
        Some(r)
    }

    /// The engine over this communicator: its layout by host identity,
    /// a host-local split, connections to every remote rank. `None` when
    /// every rank is on one host. With it, the host-local communicator's
    /// record (to abort it).
    fn build_cross_engine(&self) -> Result<Option<(CrossHost, Weak<dyn Lever>)>> {
        let layout = Layout::gather(self)?;
        let me = self.rank();
        if layout.nhosts() < 2 {
            return Ok(None);
        }
        let h = layout.host(me);
        let local = self
            .split(Some(h as u32), me as i32)?
            .ok_or_else(|| Error::Internal("no host-local communicator".into()))?;
        let net = TcpNet::new(TcpConfig::for_job().map_err(|e| Error::arg(e.to_string()))?)
            .map_err(|e| Error::Internal(format!("the cross-host byte mover: {e}")))?;
        let links = Links::connect(
            net,
            self,
            me,
            &layout.remote(me),
            Instant::now() + CONNECT_BOUND,
        )?;
        crate::log::info_log!(
            "comm {} rank {}: collectives of {} bytes and more run on the cross-host engine ({})",
            self.s.label,
            self.s.rank,
            self.s.cfg.cross_engine_min_bytes.unwrap_or(0),
            layout.describe()
        );
        let record: Weak<dyn Lever> = std::sync::Arc::downgrade(&local.s) as Weak<dyn Lever>;
        let mover = CommMover::new(local, layout.members(h).to_vec());
        let x = CrossHost::new(
            layout,
            links,
            Box::new(mover),
            &self.s.label,
            self.s.cfg.timeout,
        )?;
        Ok(Some((x, record)))
    }
}
