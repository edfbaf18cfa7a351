//! Sends, receives and all-to-all of device memory on a communicator
//! spanning hosts whose hierarchy is built (`hier.rs`): the pieces to and
//! from ranks of this host go over the host-local communicator's GPU
//! kernels (NVLink where the GPUs have it), never through host memory; the
//! pieces to and from other hosts over the parent's cross-host path
//! (`cuda/proxy.rs`: pinned buffers, the large pieces on the engine's
//! connections). The host's part is enqueued first, then the rest, on the
//! caller's stream; both ends of a message route it alike (by the layout,
//! the same on every rank).
//!
//! The hierarchy is built at the communicator's first device operation,
//! whatever it is (`hier.rs`), so a program of sends and receives alone
//! (pipeline stages) goes by host from its first; where there is none
//! (`WEFT_CROSSHOST_HIER=0`, hosts of different sizes, one rank a host)
//! a group is staged whole.

use super::communicator::Communicator;
use super::device::run_flat;
use super::hier::Hier;
use super::host::run_host;
use crate::error::Result;
use crate::observe;
use crate::op::{Memory, Op, OpKind};

impl Communicator {
    /// Runs a group's sends and receives on this communicator (validated,
    /// device memory, one stream) split by host as above; None: there is
    /// no hierarchy (the caller stages them whole).
    ///
    /// # Safety
    /// As `run_device`.
    pub(super) unsafe fn run_hier_p2p(&self, ops: &[Op]) -> Option<Result<()>> {
        if !self.s.cfg.device_hier
            || ops.is_empty()
            || !ops
                .iter()
                .all(|o| o.is_send_recv() && matches!(o.memory, Memory::Device(_)))
            || ops.iter().any(|o| o.stream != ops[0].stream)
        {
            return None;
        }
        let h = self.built_hierarchy()?;
        h.log_once(OpKind::Send, || {
            format!(
                "comm {} rank {}: sends and receives on device memory across {}: by host, this host's pieces of {} bytes and more (WEFT_CROSSHOST_HIER_MIN_BYTES) on the GPU kernels of {}, the rest through pinned host memory",
                self.s.label,
                self.s.rank,
                h.layout.describe(),
                self.s.cfg.device_hier_min_bytes,
                h.local.s.label
            )
        });
        let obs = observe::start(&self.s.who(), ops, true, "cross-host-hier");
        let min = self.s.cfg.device_hier_min_bytes;
        let r = unsafe { self.by_host(&h, ops, min) }.map_err(|e| self.hier_error(e));
        observe::finish(obs, &r);
        Some(r)
    }

    /// An all-to-all (validated, not empty) as sends and receives of a
    /// block per rank, itself included (the host-local group copies it on
    /// the GPU), split by host.
    ///
    /// # Safety
    /// As `run_device`.
    pub(super) unsafe fn hier_all_to_all(&self, h: &Hier, op: &Op) -> Result<()> {
        let ops = op.all_to_all_as_sends_and_receives(self.s.nranks, |_| false);
        let obs = observe::start(
            &self.s.who(),
            std::slice::from_ref(op),
            false,
            "cross-host-hier",
        );
        // The whole all-to-all met the threshold (`hierarchical`): every
        // block of this host goes on its kernels, whatever its size.
        let r = unsafe { self.by_host(h, &ops, 0) }.map_err(|e| self.hier_error(e));
        observe::finish(obs, &r);
        r
    }

    /// `ops` (sends and receives), those of at least `min_here` bytes with
    /// ranks of this host on the host-local communicator (their peers
    /// renumbered), then the others on this one. Both ends of a message
    /// decide alike (the same bytes, the same setting).
    ///
    /// Why a threshold for the pieces of a group (`WEFT_CROSSHOST_HIER_MIN_BYTES`,
    /// as for the collectives): on GPUs shared by both simulated hosts, the
    /// host-local kernels' waits time-slice with the other host's
    /// processes, and 1-4 MiB pieces went 2-8x slower than staged, while
    /// from 16 MiB they went 2.4-7x faster (docs/PERFORMANCE-GPU.md); with
    /// a GPU a process, as pods run, the setting can go to 0.
    unsafe fn by_host(&self, h: &Hier, ops: &[Op], min_here: usize) -> Result<()> {
        self.no_sub_failure()?;
        let host = h.layout.host(self.s.rank);
        let (here, across): (Vec<Op>, Vec<Op>) = ops
            .iter()
            .partition(|o| h.layout.host(o.peer()) == host && o.bytes() >= min_here);
        let here: Vec<Op> = here
            .into_iter()
            .map(|mut o| {
                o.root = h.layout.local(o.peer());
                o
            })
            .collect();
        let host_memory = ops.iter().all(|o| o.memory == Memory::Host);
        for (comm, part) in [(&h.local, here), (self, across)] {
            if part.is_empty() {
                continue;
            }
            let batch: Vec<(&Communicator, Op)> = part.iter().map(|&o| (comm, o)).collect();
            // Host memory (CI's test of the split, no GPU): the same groups
            // on the host path, blocking.
            if host_memory {
                unsafe { run_host(batch) }?;
            } else {
                unsafe { run_flat(&batch) }?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::hier::tests::four_on_two_hosts;
    use crate::data::types::DataType;

    /// What rank `from` sends rank `to`, element i: never zero, distinct.
    fn value(from: usize, to: usize, i: usize) -> f32 {
        (from * 1000 + to * 100 + i % 89 + 1) as f32
    }

    /// A program of sends and receives alone: the hierarchy is built where
    /// its first device operation would build it (no collective called
    /// before), and a ring of sends and receives crossing hosts and
    /// within them goes by host, odd sizes, against the reference.
    #[test]
    fn sends_and_receives_alone_go_by_host_from_the_first_operation() {
        let comms = four_on_two_hosts();
        let n = 4;
        std::thread::scope(|s| {
            for (r, c) in comms.iter().enumerate() {
                s.spawn(move || {
                    assert!(c.built_hierarchy().is_none(), "rank {r}: built early");
                    // What `run_device` does at the first device operation.
                    c.prepare_hierarchy(None);
                    let h = c.built_hierarchy().expect("built at the first operation");
                    for count in [1usize, 4097, 65_537] {
                        let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
                        let to_next: Vec<f32> = (0..count).map(|i| value(r, next, i)).collect();
                        // Every local piece on the host-local communicator,
                        // then only those of 64 KiB and more (both ends alike).
                        for min_here in [0, 64 << 10] {
                            let mut from_prev = vec![0f32; count];
                            let ops = [
                                Op::send(to_next.as_ptr().cast(), count, DataType::F32, next),
                                Op::recv(from_prev.as_mut_ptr().cast(), count, DataType::F32, prev),
                            ];
                            unsafe { c.by_host(&h, &ops, min_here) }.unwrap();
                            for (i, got) in from_prev.iter().enumerate() {
                                assert_eq!(
                                    *got,
                                    value(prev, r, i),
                                    "rank {r} count {count} min {min_here} at {i}"
                                );
                            }
                        }
                    }
                });
            }
        });
    }

    /// A gather and a scatter across hosts as the sends and receives they
    /// mean (what `run_device` makes of them), by host, every root, odd
    /// sizes, against the reference.
    #[test]
    fn gather_and_scatter_as_sends_and_receives_go_by_host() {
        let comms = four_on_two_hosts();
        let n = 4;
        std::thread::scope(|s| {
            for (r, c) in comms.iter().enumerate() {
                s.spawn(move || {
                    c.prepare_hierarchy(None);
                    let h = c.built_hierarchy().expect("built");
                    for (root, count) in [(0usize, 1usize), (3, 1001), (1, 4097)] {
                        let mine: Vec<f32> = (0..count).map(|i| value(r, root, i)).collect();
                        let mut all = vec![0f32; n * count];
                        let g = Op::gather(
                            mine.as_ptr().cast(),
                            all.as_mut_ptr().cast(),
                            count,
                            DataType::F32,
                            root,
                        );
                        let ops = g.gather_or_scatter_as_sends_and_receives(r, n);
                        unsafe { c.by_host(&h, &ops, 0) }.unwrap();
                        if r == root {
                            for (j, got) in all.iter().enumerate() {
                                assert_eq!(
                                    *got,
                                    value(j / count, root, j % count),
                                    "rank {r}: gather root {root} at {j}"
                                );
                            }
                        }
                        let blocks: Vec<f32> = (0..n * count)
                            .map(|j| value(root, j / count, j % count))
                            .collect();
                        let mut got = vec![0f32; count];
                        let sc = Op::scatter(
                            blocks.as_ptr().cast(),
                            got.as_mut_ptr().cast(),
                            count,
                            DataType::F32,
                            root,
                        );
                        let ops = sc.gather_or_scatter_as_sends_and_receives(r, n);
                        unsafe { c.by_host(&h, &ops, 0) }.unwrap();
                        for (i, v) in got.iter().enumerate() {
                            assert_eq!(
                                *v,
                                value(root, r, i),
                                "rank {r}: scatter root {root} at {i}"
                            );
                        }
                    }
                });
            }
        });
    }

    /// An all-to-all builds the hierarchy and goes by host (the host-local
    /// communicator for this host's blocks, the own one included; the
    /// parent for the others), odd sizes (in place it is left staged); then a
    /// group of sends and receives (a ring crossing hosts and within them,
    /// plus a send to itself) goes by host too. Host memory: the same
    /// split as on GPUs, on the host path. Every element against the
    /// reference.
    #[test]
    fn all_to_all_and_send_receive_groups_go_by_host_and_match_the_reference() {
        let comms = four_on_two_hosts();
        let n = 4;
        std::thread::scope(|s| {
            for (r, c) in comms.iter().enumerate() {
                s.spawn(move || {
                    for (count, in_place) in [(1usize, false), (4099, false), (1000, true)] {
                        let send: Vec<f32> = (0..n * count)
                            .map(|j| value(r, j / count, j % count))
                            .collect();
                        let mut recv = if in_place {
                            send.clone()
                        } else {
                            vec![0f32; n * count]
                        };
                        let src = if in_place {
                            recv.as_ptr().cast()
                        } else {
                            send.as_ptr().cast()
                        };
                        let op =
                            Op::all_to_all(src, recv.as_mut_ptr().cast(), count, DataType::F32);
                        let taken = unsafe { c.hierarchical(&op) };
                        if in_place {
                            // Staged whole instead (see `hierarchical`).
                            assert!(taken.is_none(), "rank {r}: in place taken");
                            continue;
                        }
                        taken
                            .unwrap_or_else(|| panic!("rank {r}: all-to-all not taken"))
                            .unwrap();
                        for (j, got) in recv.iter().enumerate() {
                            let want = value(j / count, r, j % count);
                            assert_eq!(*got, want, "rank {r} count {count} at {j}");
                        }
                    }
                    let h = c.built_hierarchy().expect("built by the all-to-all");
                    let count = 3001;
                    let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
                    let to_next: Vec<f32> = (0..count).map(|i| value(r, next, i)).collect();
                    let to_me: Vec<f32> = (0..count).map(|i| value(r, r, i)).collect();
                    let mut from_prev = vec![0f32; count];
                    let mut from_me = vec![0f32; count];
                    let ops = [
                        Op::send(to_next.as_ptr().cast(), count, DataType::F32, next),
                        Op::recv(from_prev.as_mut_ptr().cast(), count, DataType::F32, prev),
                        Op::send(to_me.as_ptr().cast(), count, DataType::F32, r),
                        Op::recv(from_me.as_mut_ptr().cast(), count, DataType::F32, r),
                    ];
                    unsafe { c.by_host(&h, &ops, 0) }.unwrap();
                    for i in 0..count {
                        assert_eq!(
                            from_prev[i],
                            value(prev, r, i),
                            "rank {r}: from {prev} at {i}"
                        );
                        assert_eq!(from_me[i], value(r, r, i), "rank {r}: from itself at {i}");
                    }
                });
            }
        });
    }
}
