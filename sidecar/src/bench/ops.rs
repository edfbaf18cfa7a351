//! The collectives `weft bench` measures: for each, its buffer layout for a
//! given message size (nccl-tests' conventions), the bandwidth arithmetic,
//! the call itself and how its result is checked.

use std::str::FromStr;

use libcomm::{Communicator, DataType, Group, Op, ReduceOp};

use super::check::Data;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BenchOp {
    AllReduce,
    AllGather,
    ReduceScatter,
    Broadcast,
    Reduce,
    AllToAll,
    SendRecv,
}

impl BenchOp {
    pub const ALL: [BenchOp; 7] = [
        BenchOp::AllReduce,
        BenchOp::AllGather,
        BenchOp::ReduceScatter,
        BenchOp::Broadcast,
        BenchOp::Reduce,
        BenchOp::AllToAll,
        BenchOp::SendRecv,
    ];

    /// The name printed in headers (nccl-tests' binary names without `_perf`).
    pub fn name(self) -> &'static str {
        match self {
            BenchOp::AllReduce => "all_reduce",
            BenchOp::AllGather => "all_gather",
            BenchOp::ReduceScatter => "reduce_scatter",
            BenchOp::Broadcast => "broadcast",
            BenchOp::Reduce => "reduce",
            BenchOp::AllToAll => "alltoall",
            BenchOp::SendRecv => "sendrecv",
        }
    }

    /// Reductions print their redop; the others print `none`.
    pub fn has_redop(self) -> bool {
        matches!(
            self,
            BenchOp::AllReduce | BenchOp::ReduceScatter | BenchOp::Reduce
        )
    }

    /// Rooted collectives print their root; the others print `-1`.
    pub fn has_root(self) -> bool {
        matches!(self, BenchOp::Broadcast | BenchOp::Reduce)
    }

    /// Whether `--check` checks the in-place run. Send/recv in place sends
    /// and receives through one buffer, which NCCL leaves undefined (the
    /// receive may overwrite what the send has not read yet; the device
    /// kernels stream both at once), so, as nccl-tests, its in-place run is
    /// timed but not checked.
    pub fn checks_in_place(self) -> bool {
        self != BenchOp::SendRecv
    }

    /// nccl-tests' bus bandwidth correction factor for `n` ranks.
    pub fn busbw_factor(self, n: usize) -> f64 {
        let n = n as f64;
        match self {
            BenchOp::AllReduce => 2.0 * (n - 1.0) / n,
            BenchOp::AllGather | BenchOp::ReduceScatter | BenchOp::AllToAll => (n - 1.0) / n,
            BenchOp::Broadcast | BenchOp::Reduce | BenchOp::SendRecv => 1.0,
        }
    }

    /// Buffer layout for a message of `bytes` bytes of `dtype` over `n` ranks.
    ///
    /// As nccl-tests: all-reduce, broadcast, reduce and sendrecv move `bytes`;
    /// for all-gather `bytes` is the gathered output, for reduce-scatter the
    /// input, for all-to-all each rank's whole buffer. Per-rank blocks are
    /// rounded down to a multiple of 16 bytes.
    pub fn layout(self, bytes: u64, dtype: DataType, n: usize) -> Layout {
        let ts = dtype.size();
        let count = (bytes / ts as u64) as usize;
        let align = (16 / ts).max(1);
        let block = (count / n) / align * align;
        match self {
            BenchOp::AllGather => Layout {
                count: block,
                send_elems: block,
                recv_elems: block * n,
            },
            BenchOp::ReduceScatter => Layout {
                count: block,
                send_elems: block * n,
                recv_elems: block,
            },
            BenchOp::AllToAll => Layout {
                count: block,
                send_elems: block * n,
                recv_elems: block * n,
            },
            _ => Layout {
                count,
                send_elems: count,
                recv_elems: count,
            },
        }
    }

    /// The in-place layout of this rank: where send and receive sit inside the
    /// one (receive) buffer.
    pub fn inplace_offsets(self, l: &Layout, rank: usize) -> (usize, usize) {
        match self {
            BenchOp::AllGather => (rank * l.count, 0),
            BenchOp::ReduceScatter => (0, rank * l.count),
            _ => (0, 0),
        }
    }

    /// Algorithm bandwidth in GB/s (10^9 bytes/s) for one call taking `secs`.
    pub fn algbw(self, l: &Layout, dtype: DataType, n: usize, secs: f64) -> f64 {
        let per_call = match self {
            BenchOp::AllGather | BenchOp::ReduceScatter | BenchOp::AllToAll => l.count * n,
            _ => l.count,
        } * dtype.size();
        if secs > 0.0 {
            per_call as f64 / 1.0e9 / secs
        } else {
            0.0
        }
    }

    /// The operations of one call (send/recv is two), on host memory (see
    /// [`Op::on`] for device memory); run them with [`submit_ops`]. `send`
    /// and `recv` must be valid for the layout's element counts (in place:
    /// both point into one buffer at [`inplace_offsets`](Self::inplace_offsets)).
    #[allow(clippy::too_many_arguments)]
    pub fn group_ops(
        self,
        rank: usize,
        n: usize,
        send: *const u8,
        recv: *mut u8,
        l: &Layout,
        dtype: DataType,
        op: ReduceOp,
        root: usize,
    ) -> Vec<Op> {
        let count = l.count;
        match self {
            BenchOp::AllReduce => vec![Op::all_reduce(send, recv, count, dtype, op)],
            BenchOp::AllGather => vec![Op::all_gather(send, recv, count, dtype)],
            BenchOp::ReduceScatter => {
                vec![Op::reduce_scatter(send, recv, count, dtype, op)]
            }
            BenchOp::Broadcast => vec![Op::broadcast(send, recv, count, dtype, root)],
            BenchOp::Reduce => vec![Op::reduce(send, recv, count, dtype, op, root)],
            BenchOp::AllToAll => vec![Op::all_to_all(send, recv, count, dtype)],
            BenchOp::SendRecv => vec![
                Op::send(send, count, dtype, (rank + 1) % n),
                Op::recv(recv, count, dtype, (rank + n - 1) % n),
            ],
        }
    }

    /// Inputs for `--check`: data for this op (`op` only matters for reductions).
    pub fn data(self, dtype: DataType, op: ReduceOp, n: usize, seed: u64) -> Data {
        Data {
            dtype,
            op: self.has_redop().then_some(op),
            nranks: n,
            seed,
        }
    }

    /// Counts wrong elements of this rank's result in `recv`.
    pub fn wrong(self, d: &Data, rank: usize, root: usize, l: &Layout, recv: &[u8]) -> u64 {
        let n = d.nranks;
        let c = l.count;
        match self {
            BenchOp::AllReduce => d.wrong_reductions(recv, |j| j),
            BenchOp::Reduce if rank == root => d.wrong_reductions(recv, |j| j),
            BenchOp::Reduce => 0,
            BenchOp::ReduceScatter => d.wrong_reductions(recv, |j| rank * c + j),
            BenchOp::Broadcast => d.wrong_copies(recv, |j| (root, j)),
            BenchOp::AllGather => d.wrong_copies(recv, |j| (j / c.max(1), j % c.max(1))),
            BenchOp::AllToAll => d.wrong_copies(recv, |j| (j / c.max(1), rank * c + j % c.max(1))),
            BenchOp::SendRecv => d.wrong_copies(recv, |j| ((rank + n - 1) % n, j)),
        }
    }
}

/// Element counts of one call (nccl-tests' sendcount/recvcount/paramcount).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    /// The count passed to the collective (per rank, per peer for all-to-all).
    pub count: usize,
    /// Elements in this rank's send buffer.
    pub send_elems: usize,
    /// Elements in this rank's receive buffer.
    pub recv_elems: usize,
}

impl Layout {
    /// The size column: the larger of the two buffers, in bytes.
    pub fn bytes(&self, dtype: DataType) -> usize {
        self.send_elems.max(self.recv_elems) * dtype.size()
    }

    /// Elements each of the two buffers must hold.
    pub fn buffer_elems(&self) -> usize {
        self.send_elems.max(self.recv_elems)
    }
}

impl FromStr for BenchOp {
    type Err = String;
    /// nccl-tests' spellings and ours: `all_reduce`, `allreduce`,
    /// `all_reduce_perf`, `all-reduce`, `alltoall`, `all_to_all`, `bcast`...
    fn from_str(s: &str) -> Result<Self, String> {
        let k = s
            .trim()
            .to_ascii_lowercase()
            .trim_end_matches("_perf")
            .replace(['_', '-'], "");
        Ok(match k.as_str() {
            "allreduce" => BenchOp::AllReduce,
            "allgather" => BenchOp::AllGather,
            "reducescatter" => BenchOp::ReduceScatter,
            "broadcast" | "bcast" => BenchOp::Broadcast,
            "reduce" => BenchOp::Reduce,
            "alltoall" | "a2a" => BenchOp::AllToAll,
            "sendrecv" | "p2p" => BenchOp::SendRecv,
            _ => {
                return Err(format!(
                    "unknown collective '{s}' (all_reduce, all_gather, reduce_scatter, \
                     broadcast, reduce, alltoall, sendrecv)"
                ));
            }
        })
    }
}

impl std::fmt::Display for BenchOp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Submits one operation, or several as one group (device memory included:
/// their descriptors say where they live).
///
/// # Safety
/// Every operation's buffers must be valid for the sizes it names.
pub unsafe fn submit_ops(comm: &Communicator, ops: Vec<Op>) -> libcomm::Result<()> {
    unsafe {
        if let [one] = ops[..] {
            return comm.submit(one);
        }
        let mut g = Group::new();
        for o in ops {
            g.push(comm, o)?;
        }
        g.execute()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_nccl_tests_spellings() {
        for (s, op) in [
            ("all_reduce", BenchOp::AllReduce),
            ("allreduce", BenchOp::AllReduce),
            ("all_reduce_perf", BenchOp::AllReduce),
            ("All-Reduce", BenchOp::AllReduce),
            ("all_gather", BenchOp::AllGather),
            ("allgather", BenchOp::AllGather),
            ("reduce_scatter", BenchOp::ReduceScatter),
            ("reducescatter", BenchOp::ReduceScatter),
            ("broadcast", BenchOp::Broadcast),
            ("bcast", BenchOp::Broadcast),
            ("reduce", BenchOp::Reduce),
            ("alltoall", BenchOp::AllToAll),
            ("all_to_all", BenchOp::AllToAll),
            ("sendrecv", BenchOp::SendRecv),
            ("sendrecv_perf", BenchOp::SendRecv),
        ] {
            assert_eq!(s.parse::<BenchOp>().unwrap(), op, "{s}");
        }
        assert!("allreduc".parse::<BenchOp>().is_err());
        for op in BenchOp::ALL {
            assert_eq!(op.name().parse::<BenchOp>().unwrap(), op);
        }
    }

    #[test]
    fn busbw_factors() {
        assert_eq!(BenchOp::AllReduce.busbw_factor(4), 1.5);
        assert_eq!(BenchOp::AllReduce.busbw_factor(1), 0.0);
        assert_eq!(BenchOp::AllGather.busbw_factor(4), 0.75);
        assert_eq!(BenchOp::ReduceScatter.busbw_factor(4), 0.75);
        assert_eq!(BenchOp::AllToAll.busbw_factor(2), 0.5);
        assert_eq!(BenchOp::Broadcast.busbw_factor(8), 1.0);
        assert_eq!(BenchOp::Reduce.busbw_factor(8), 1.0);
        assert_eq!(BenchOp::SendRecv.busbw_factor(8), 1.0);
    }

    #[test]
    fn layouts_follow_nccl_tests() {
        let f = DataType::F32;
        // all-reduce: 1 MiB of float
        let l = BenchOp::AllReduce.layout(1 << 20, f, 4);
        assert_eq!(
            (l.count, l.send_elems, l.recv_elems),
            (262144, 262144, 262144)
        );
        assert_eq!(l.bytes(f), 1 << 20);
        // all-gather: size is the output; count per rank
        let l = BenchOp::AllGather.layout(1 << 20, f, 4);
        assert_eq!(
            (l.count, l.send_elems, l.recv_elems),
            (65536, 65536, 262144)
        );
        assert_eq!(l.bytes(f), 1 << 20);
        assert_eq!(BenchOp::AllGather.inplace_offsets(&l, 3), (3 * 65536, 0));
        // reduce-scatter: size is the input
        let l = BenchOp::ReduceScatter.layout(1 << 20, f, 4);
        assert_eq!(
            (l.count, l.send_elems, l.recv_elems),
            (65536, 262144, 65536)
        );
        assert_eq!(
            BenchOp::ReduceScatter.inplace_offsets(&l, 2),
            (0, 2 * 65536)
        );
        // all-to-all: the whole buffer, count per peer
        let l = BenchOp::AllToAll.layout(1 << 20, f, 4);
        assert_eq!(
            (l.count, l.send_elems, l.recv_elems),
            (65536, 262144, 262144)
        );
        // per-rank blocks round down to 16 bytes: 3 ranks, 100 bytes of float
        let l = BenchOp::AllGather.layout(100, f, 3);
        assert_eq!(l.count, 8);
        assert_eq!(l.bytes(f), 96);
        let l = BenchOp::AllGather.layout(8, f, 3);
        assert_eq!(l.count, 0);
        // int8: 16-element blocks
        let l = BenchOp::AllToAll.layout(100, DataType::I8, 4);
        assert_eq!(l.count, 16);
    }

    #[test]
    fn bandwidths() {
        let f = DataType::F32;
        let l = BenchOp::AllReduce.layout(1_000_000, f, 4);
        // 1e6 bytes in 1 ms: 1 GB/s algbw, 1.5 GB/s busbw
        let alg = BenchOp::AllReduce.algbw(&l, f, 4, 1e-3);
        assert!((alg - 1.0).abs() < 1e-12);
        assert!((alg * BenchOp::AllReduce.busbw_factor(4) - 1.5).abs() < 1e-12);
        // all-gather counts the gathered output
        let l = BenchOp::AllGather.layout(1 << 20, f, 4);
        let alg = BenchOp::AllGather.algbw(&l, f, 4, 1.0);
        assert!((alg - (1 << 20) as f64 / 1e9).abs() < 1e-15);
        assert_eq!(BenchOp::AllReduce.algbw(&l, f, 4, 0.0), 0.0);
    }
}
