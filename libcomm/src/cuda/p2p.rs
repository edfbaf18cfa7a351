//! Point-to-point on the kernel path: what a send, receive, gather or
//! scatter becomes on this rank ([`P2p`] pieces, as NCCL builds them), how a
//! group's pieces split into rounds (one kernel each, at most one send to and
//! one receive from each peer), and how a round streams through the
//! receiver's scratch across processes ([`P2pFifo`]). The launch itself is in
//! `launch.rs`.

use super::abi::{MAX_P2P, P2P_FIFO_MAXB};
use super::error::{CudaError, CudaResult};
use crate::op::{Op, OpKind};
use std::collections::HashMap;

/// How point-to-point streams through a receiver's scratch across processes
/// (every rank computes the same, so sender and receiver agree).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct P2pFifo {
    /// Bytes of a receiver's scratch per sender.
    pub(super) region: usize,
    /// Blocks per send or receive: a round holds at most one send and one
    /// receive per peer, so about 128 blocks in all, which stay resident
    /// together (a block spinning on a peer must not keep the block that
    /// would answer it from running).
    pub(super) blocks: usize,
    pub(super) step: usize,
    pub(super) slots: usize,
}

impl P2pFifo {
    /// `cap`: blocks of a kernel at most (`Tuning::block_cap`).
    pub(super) fn new(scratch: usize, nranks: usize, cap: usize) -> P2pFifo {
        let n = nranks.max(1);
        let region = scratch / n / 16 * 16;
        let blocks = (cap.min(128) / (2 * n)).clamp(1, P2P_FIFO_MAXB);
        let slots = 4;
        let step = (region / blocks / slots / 16 * 16).max(16);
        P2pFifo {
            region,
            blocks,
            step,
            slots,
        }
    }
}

/// One point-to-point piece of a group on this rank.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum P2p {
    Send { peer: usize, ptr: u64, bytes: usize },
    Recv { peer: usize, ptr: u64, bytes: usize },
    Copy { dst: u64, src: u64, bytes: usize },
}

/// Send, receive, gather and scatter: what [`p2p_pieces`] takes apart.
pub fn is_p2p(op: &Op) -> bool {
    matches!(
        op.kind,
        OpKind::Send | OpKind::Recv | OpKind::Gather | OpKind::Scatter
    )
}

/// The point-to-point pieces of `op` on rank `rank` of `n` (send/recv,
/// gather and scatter, as NCCL builds them), or None for other operations.
/// A send to or receive from oneself is returned as is: `DevComm::launch_p2p`
/// pairs them into copies.
pub fn p2p_pieces(op: &Op, rank: usize, n: usize) -> Option<Vec<P2p>> {
    let mut v = Vec::new();
    let (send, recv, bytes, root) = (op.send as u64, op.recv as u64, op.bytes(), op.root);
    match op.kind {
        OpKind::Send => v.push(P2p::Send {
            peer: root,
            ptr: send,
            bytes,
        }),
        OpKind::Recv => v.push(P2p::Recv {
            peer: root,
            ptr: recv,
            bytes,
        }),
        OpKind::Gather | OpKind::Scatter => {
            // The root moves one block per rank (its own by a copy); every
            // other rank one block to or from the root.
            let gather = op.kind == OpKind::Gather;
            if rank != root {
                v.push(if gather {
                    P2p::Send {
                        peer: root,
                        ptr: send,
                        bytes,
                    }
                } else {
                    P2p::Recv {
                        peer: root,
                        ptr: recv,
                        bytes,
                    }
                });
            } else {
                for r in 0..n {
                    let at = (r * bytes) as u64;
                    v.push(match (r == rank, gather) {
                        (true, true) => P2p::Copy {
                            dst: recv + at,
                            src: send,
                            bytes,
                        },
                        (true, false) => P2p::Copy {
                            dst: recv,
                            src: send + at,
                            bytes,
                        },
                        (false, true) => P2p::Recv {
                            peer: r,
                            ptr: recv + at,
                            bytes,
                        },
                        (false, false) => P2p::Send {
                            peer: r,
                            ptr: send + at,
                            bytes,
                        },
                    });
                }
            }
        }
        _ => return None,
    }
    Some(v)
}

/// Splits a group's pieces into rounds: a round holds at most one send to and
/// one receive from each peer (the i-th send to a peer goes into round i, and
/// so does the peer's i-th receive from us, which is what makes the rounds
/// of all ranks match). Sends to and receives from oneself pair up, in order,
/// into copies.
pub(super) fn p2p_rounds(pieces: &[P2p], me: usize) -> CudaResult<Vec<Vec<P2p>>> {
    let mut rounds: Vec<Vec<P2p>> = Vec::new();
    let put = |rounds: &mut Vec<Vec<P2p>>, i: usize, p: P2p| {
        while rounds.len() <= i {
            rounds.push(Vec::new());
        }
        rounds[i].push(p);
    };
    let self_sends: Vec<(u64, usize)> = pieces
        .iter()
        .filter_map(|p| match *p {
            P2p::Send { peer, ptr, bytes } if peer == me => Some((ptr, bytes)),
            _ => None,
        })
        .collect();
    let self_recvs: Vec<(u64, usize)> = pieces
        .iter()
        .filter_map(|p| match *p {
            P2p::Recv { peer, ptr, bytes } if peer == me => Some((ptr, bytes)),
            _ => None,
        })
        .collect();
    if self_sends.len() != self_recvs.len() {
        return Err(CudaError::InvalidUsage(format!(
            "{} sends to this rank itself but {} receives from it in one group",
            self_sends.len(),
            self_recvs.len()
        )));
    }
    let mut copies = 0;
    for (&(src, sb), &(dst, rb)) in self_sends.iter().zip(&self_recvs) {
        if sb != rb {
            return Err(CudaError::InvalidUsage(format!(
                "a send to itself of {sb} bytes meets a receive of {rb} bytes"
            )));
        }
        put(
            &mut rounds,
            copies,
            P2p::Copy {
                dst,
                src,
                bytes: sb,
            },
        );
        copies += 1;
    }
    let mut sends: HashMap<usize, usize> = HashMap::new();
    let mut recvs: HashMap<usize, usize> = HashMap::new();
    for p in pieces {
        match *p {
            P2p::Send { peer, .. } | P2p::Recv { peer, .. } if peer == me => {}
            P2p::Copy { .. } => {
                put(&mut rounds, copies, *p);
                copies += 1;
            }
            P2p::Send { peer, .. } => {
                let i = sends.entry(peer).or_insert(0);
                put(&mut rounds, *i, *p);
                *i += 1;
            }
            P2p::Recv { peer, .. } => {
                let i = recvs.entry(peer).or_insert(0);
                put(&mut rounds, *i, *p);
                *i += 1;
            }
        }
    }
    // Copies are local: they may sit in any round; spread so none overflows.
    for r in &rounds {
        if r.len() > MAX_P2P {
            return Err(CudaError::Unsupported(format!(
                "{} point-to-point pieces in one round (at most {MAX_P2P})",
                r.len()
            )));
        }
    }
    Ok(rounds)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::abi::MAX_RANKS;
    use crate::data::types::DataType;

    #[test]
    fn p2p_fifo_fits_each_receivers_scratch() {
        // Scratch is at least 2 MiB (WEFT_CUDA_SCRATCH_MB >= 1, two parities).
        for scratch in [64usize << 20, 2 << 20] {
            for n in 1..=MAX_RANKS {
                let f = P2pFifo::new(scratch, n, 128);
                // One region per sender, one FIFO per block in it.
                assert!(f.region * n <= scratch, "{scratch} {n}: {f:?}");
                assert!(
                    f.blocks * f.slots * f.step <= f.region,
                    "{scratch} {n}: {f:?}"
                );
                assert!(f.step.is_multiple_of(16) && f.step >= 16 && f.slots >= 2);
                // A round (one send and one receive per peer) stays within
                // about 128 blocks, and within the kernel's flag arrays.
                assert!(2 * n * f.blocks <= 128 || f.blocks == 1);
                assert!(f.blocks <= P2P_FIFO_MAXB);
            }
        }
        let f = P2pFifo::new(64 << 20, 4, 128);
        assert_eq!(
            (f.region, f.blocks, f.step, f.slots),
            (16 << 20, 16, 256 << 10, 4)
        );
    }

    fn send(peer: usize, ptr: u64) -> P2p {
        P2p::Send {
            peer,
            ptr,
            bytes: 8,
        }
    }
    fn recv(peer: usize, ptr: u64) -> P2p {
        P2p::Recv {
            peer,
            ptr,
            bytes: 8,
        }
    }

    /// Rounds: one send per peer and direction each, self pairs as copies.
    #[test]
    fn p2p_rounds_split_repeated_peers_and_pair_self() {
        let r = p2p_rounds(
            &[
                send(1, 10),
                recv(2, 20),
                send(1, 11),
                recv(0, 30),
                send(0, 31),
            ],
            0,
        )
        .unwrap();
        assert_eq!(r.len(), 2);
        assert_eq!(
            r[0],
            vec![
                P2p::Copy {
                    dst: 30,
                    src: 31,
                    bytes: 8
                },
                send(1, 10),
                recv(2, 20)
            ]
        );
        assert_eq!(r[1], vec![send(1, 11)]);
        assert!(
            p2p_rounds(&[send(0, 1)], 0)
                .unwrap_err()
                .to_string()
                .contains("sends to this rank itself")
        );
    }

    /// Gather and scatter become NCCL's pieces.
    #[test]
    fn gather_and_scatter_pieces() {
        let g = Op::gather(100 as *const u8, 1000 as *mut u8, 2, DataType::F32, 1);
        assert_eq!(
            p2p_pieces(&g, 1, 3).unwrap(),
            vec![
                recv8(0, 1000),
                P2p::Copy {
                    dst: 1008,
                    src: 100,
                    bytes: 8
                },
                recv8(2, 1016)
            ]
        );
        assert_eq!(p2p_pieces(&g, 0, 3).unwrap(), vec![send(1, 100)]);
        let sc = Op::scatter(100 as *const u8, 1000 as *mut u8, 2, DataType::F32, 0);
        assert_eq!(p2p_pieces(&sc, 2, 3).unwrap(), vec![recv(0, 1000)]);
        assert_eq!(p2p_pieces(&sc, 0, 3).unwrap()[2], send(2, 116));
    }

    fn recv8(peer: usize, ptr: u64) -> P2p {
        recv(peer, ptr)
    }
}
