//! Planning: which kernel and algorithm one collective runs on the kernel
//! path ([`Plan`]), or None when it stages through host memory. The size
//! rules come from `tuning.rs`; the plan is what `launch.rs` turns into
//! kernel arguments, and what the observer records as the algorithm.

use super::abi::{
    CHAIN_FIFO, CHAIN_LINES, K_ALLGATHER, K_ALLREDUCE, K_ALLREDUCE_2SHOT, K_ALLTOALL, K_BROADCAST,
    K_REDUCE, K_REDUCESCATTER,
};
use super::devcomm::DevComm;
use super::kernels::{P2P_KERNEL, available_for, func_name};
use crate::data::types::DataType;
use crate::op::{Op, OpKind};

/// How one operation runs on the kernel path.
#[derive(Clone, Copy, Debug)]
pub struct Plan {
    pub(super) kind: i32,
    pub(super) func: &'static str,
    pub(super) input: u64,
    pub(super) output: u64,
    pub(super) count: usize,
    pub(super) elem: usize,
    pub(super) root: i32,
    pub(super) parts: usize,
    /// Broadcast or reduce as a chain: 0 no, else `CHAIN_FIFO` (slots and a
    /// flag per step) or `CHAIN_LINES` (lines with their own flags).
    pub(super) chain: i32,
    /// An LL one-shot (see `Tuning::ll` in `tuning.rs`).
    pub(super) ll: bool,
    /// One rank: the result is a copy of the input (see [`DevComm::plan`]).
    pub(super) copy: bool,
}

impl Plan {
    pub fn algorithm(&self) -> &'static str {
        match self.kind {
            _ if self.copy => "copy",
            _ if self.ll => "ll",
            _ if self.chain == CHAIN_LINES => "lines",
            _ if self.chain == CHAIN_FIFO => "chain",
            K_ALLREDUCE => "one-shot",
            K_ALLREDUCE_2SHOT => "two-shot",
            _ => "direct",
        }
    }
}

impl DevComm {
    /// How `op` runs on the kernel path, or None (staging).
    pub fn plan(&self, op: &Op) -> Option<Plan> {
        if !self.usable {
            return None;
        }
        let algo = self.tuning.algo;
        if algo == Some("staged") {
            return None;
        }
        let n = self.nranks;
        let (send, recv, count, dtype, rop) = (op.send, op.recv, op.count, op.dtype, op.redop);
        let (kind, root, parts) = match op.kind {
            OpKind::AllReduce => {
                let bytes = count * dtype.size();
                let one = match algo {
                    Some("oneshot") => true,
                    Some("twoshot") => false,
                    _ => bytes <= self.tuning.oneshot_max || n <= 2,
                };
                let k = if one { K_ALLREDUCE } else { K_ALLREDUCE_2SHOT };
                (k, 0, 1)
            }
            OpKind::Reduce => (K_REDUCE, op.root, 1),
            OpKind::ReduceScatter => (K_REDUCESCATTER, 0, n),
            OpKind::AllGather => (K_ALLGATHER, 0, 1),
            OpKind::Broadcast => (K_BROADCAST, op.root, 1),
            OpKind::AllToAll => (K_ALLTOALL, 0, n),
            _ => return None,
        };
        // One rank: every collective's result is its input (an average of
        // one value is that value), so it is one device-to-device copy, at
        // the copy engine's speed (a collective kernel moved 446 GB/s where
        // cudaMemcpy moves ~1450 on an H100), and none in place. PreMulSum
        // scales: `func_name` has no kernel for it, so it stays staged.
        let copy = n == 1;
        if !copy && matches!(dtype, DataType::F8E4M3 | DataType::F8E5M2) && self.cc < (8, 9) {
            return None;
        }
        // All-gather, broadcast and all-to-all only move bytes: the moving
        // kernel of the element size runs them.
        let reduces = matches!(
            kind,
            K_ALLREDUCE | K_ALLREDUCE_2SHOT | K_REDUCE | K_REDUCESCATTER
        );
        let func = func_name(dtype, rop, reduces)?;
        if !available_for(self.cc, func) {
            return None;
        }
        let bytes = count * dtype.size();
        let ll = !copy && self.tuning.ll(bytes, n, self.direct);
        // The LL kernel is a one-shot whatever the size rule picked.
        let kind = if ll && kind == K_ALLREDUCE_2SHOT {
            K_ALLREDUCE
        } else {
            kind
        };
        Some(Plan {
            kind,
            func,
            input: send as u64,
            output: recv as u64,
            count,
            elem: dtype.size(),
            root: root as i32,
            parts,
            ll,
            copy,
            chain: if ll || copy {
                0
            } else if self.tuning.lines(kind, bytes, n, self.lines) {
                CHAIN_LINES
            } else if self.tuning.chain(kind, bytes, n, self.direct) {
                CHAIN_FIFO
            } else {
                0
            },
        })
    }

    /// Whether a group's point-to-point pieces can run as kernels here: in
    /// one process the receiver reads the sender's buffer in place, across
    /// processes the sender streams through the receiver's scratch.
    pub fn p2p_ok(&self) -> bool {
        self.usable && available_for(self.cc, P2P_KERNEL) && self.tuning.algo != Some("staged")
    }
}
