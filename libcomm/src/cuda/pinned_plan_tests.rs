//! `pinned_plan`'s tests: each staging run as the GPU and the progress
//! thread would, on host memory standing for both.

use super::*;
use crate::op::Memory;

const MIB: usize = 1 << 20;

/// Device addresses in these tests are at or above this.
pub(in crate::cuda) const DEV: u64 = 1 << 40;

pub(super) fn on_device(p: u64) -> bool {
    p >= DEV
}

fn never(_: DataType, _: ReduceOp) -> bool {
    false
}

fn always(_: DataType, _: ReduceOp) -> bool {
    true
}

/// Device memory at [`DEV`] and up; every reduction on the CPU.
pub(in crate::cuda) const ON_CPU: DeviceCan = DeviceCan {
    on_device: &on_device,
    reduce: &never,
};

/// As [`ON_CPU`], and the GPU reduces every type and op.
pub(super) const ON_GPU: DeviceCan = DeviceCan {
    on_device: &on_device,
    reduce: &always,
};

pub(in crate::cuda) fn no_regions(_: &[Op]) -> Vec<DevRegion> {
    panic!("the generic path was not expected")
}

pub(in crate::cuda) fn dev_op(mut op: Op) -> Op {
    op = op.on(Memory::Device(0), std::ptr::null_mut());
    op
}

pub(in crate::cuda) fn p(a: u64) -> *mut u8 {
    a as *mut u8
}

/// Job `s`'s stream part before the network, on `mem` (one rank's device
/// memory from [`DEV`], f32 elements): its device-to-device copies, then
/// its copies into a new pinned buffer, which it returns.
pub(super) fn copy_in(mem: &mut [f32], s: &Staged) -> Vec<f32> {
    let idx = |a: u64| (a - DEV) as usize / 4;
    for &(dst, src, bytes) in &s.dtod {
        let v = mem[idx(src)..idx(src) + bytes / 4].to_vec();
        mem[idx(dst)..idx(dst) + bytes / 4].copy_from_slice(&v);
    }
    let mut b = vec![f32::NAN; s.bytes / 4];
    for c in &s.to_host {
        b[c.off / 4..(c.off + c.bytes) / 4]
            .copy_from_slice(&mem[idx(c.dev)..idx(c.dev) + c.bytes / 4]);
    }
    b
}

/// The element at device address `a`, in the pinned buffer of `s`: its
/// offset there.
fn pinned_at(s: &Staged, a: u64) -> usize {
    let &(d, n, off) = s
        .map
        .iter()
        .find(|&&(d, n, _)| a >= d && a < d + n as u64)
        .unwrap_or_else(|| panic!("{a:#x} is not staged: {:?}", s.map));
    assert!(off + n <= s.bytes);
    off + (a - d) as usize
}

#[test]
fn slices_cover_the_collective_on_aligned_bounds() {
    assert_eq!(slice_count(100 * MIB, 0), 1, "0: never cut");
    assert_eq!(slice_count(100 * MIB, 64 * MIB), 1);
    assert_eq!(slice_count(128 * MIB, 64 * MIB), 2);
    assert_eq!(slice_count(1 << 30, 64 * MIB), MAX_SLICES);
    for (bytes, k) in [
        (128 * MIB + 12, 2),
        (3 * SLICE_ALIGN + 4, 3),
        (1 << 30, 8),
        (5, 1),
    ] {
        let s = slices(bytes, k);
        assert!(s.len() <= k && !s.is_empty(), "{bytes} {k}: {s:?}");
        let mut at = 0;
        for &(o, n) in &s {
            assert_eq!(o, at, "contiguous");
            assert_eq!(o % SLICE_ALIGN, 0);
            assert!(n > 0);
            at += n;
        }
        assert_eq!(at, bytes, "{s:?}");
    }
}

#[test]
fn an_out_of_place_all_reduce_runs_in_place_on_one_pinned_copy_cut_in_slices() {
    let (send, recv) = (DEV, DEV + (1 << 32));
    let count = (160 * MIB + 4096) / 4;
    let op = dev_op(Op::all_reduce(
        p(send),
        p(recv),
        count,
        DataType::F32,
        ReduceOp::Sum,
    ));
    let staged = stage(&[op], 0, 2, 64 * MIB, &ON_CPU, &no_regions);
    assert_eq!(staged.len(), 2);
    let mut covered = 0;
    for s in &staged {
        let o = s.ops[0];
        assert_eq!(o.send, o.recv.cast_const(), "in place");
        assert_eq!(s.bytes, o.count * 4, "one copy, not two");
        let off = o.recv as u64 - recv;
        assert_eq!(
            s.to_host,
            vec![Copy {
                dev: send + off,
                off: 0,
                bytes: s.bytes
            }]
        );
        assert_eq!(
            s.to_device,
            vec![Copy {
                dev: recv + off,
                off: 0,
                bytes: s.bytes
            }]
        );
        assert_eq!(pinned_at(s, o.recv as u64), 0);
        assert!(s.dtod.is_empty());
        covered += o.count;
    }
    assert_eq!(covered, count);
}

#[test]
fn a_broadcast_root_copies_its_output_on_the_device_and_nothing_back() {
    let (send, recv) = (DEV, DEV + (1 << 32));
    let op = dev_op(Op::broadcast(p(send), p(recv), 1000, DataType::F64, 1));
    let root = &stage(&[op], 1, 3, 64 * MIB, &ON_CPU, &no_regions)[0];
    assert_eq!(root.dtod, vec![(recv, send, 8000)]);
    assert_eq!(
        root.to_host,
        vec![Copy {
            dev: send,
            off: 0,
            bytes: 8000
        }]
    );
    assert!(root.to_device.is_empty());
    assert_eq!(root.ops[0].send, root.ops[0].recv.cast_const());
    let other = &stage(&[op], 0, 3, 64 * MIB, &ON_CPU, &no_regions)[0];
    assert!(other.dtod.is_empty() && other.to_host.is_empty());
    assert_eq!(
        other.to_device,
        vec![Copy {
            dev: recv,
            off: 0,
            bytes: 8000
        }]
    );
    // In place at the root: no device copy either.
    let inp = dev_op(Op::broadcast(p(send), p(send), 1000, DataType::F64, 1));
    assert!(
        stage(&[inp], 1, 3, 0, &ON_CPU, &no_regions)[0]
            .dtod
            .is_empty()
    );
}

#[test]
fn a_reduce_copies_back_at_the_root_only() {
    let (send, recv) = (DEV, DEV + (1 << 32));
    let op = dev_op(Op::reduce(
        p(send),
        p(recv),
        77,
        DataType::I32,
        ReduceOp::Max,
        2,
    ));
    let root = &stage(&[op], 2, 4, 0, &ON_CPU, &no_regions)[0];
    assert_eq!(
        root.to_device,
        vec![Copy {
            dev: recv,
            off: 0,
            bytes: 308
        }]
    );
    assert_eq!(root.ops[0].send, root.ops[0].recv.cast_const());
    let other = &stage(&[op], 0, 4, 0, &ON_CPU, &no_regions)[0];
    assert!(other.to_device.is_empty());
    assert_eq!(
        other.to_host,
        vec![Copy {
            dev: send,
            off: 0,
            bytes: 308
        }]
    );
}

#[test]
fn all_gather_and_reduce_scatter_take_nccls_in_place_layouts() {
    let (send, recv) = (DEV, DEV + (1 << 32));
    let (n, c) = (3usize, 1001usize);
    // An all-gather in place on one copy: on more ranks than the exchange
    // form takes (`all_gather_exchanged`, up to MAX_RANKS).
    let big = MAX_RANKS + 1;
    let ag = dev_op(Op::all_gather(p(send), p(recv), c, DataType::F32));
    let s = &stage(&[ag], 1, big, 8, &ON_CPU, &no_regions);
    assert_eq!(s.len(), 1, "a block under one slice's alignment is not cut");
    let s = &s[0];
    assert_eq!(s.bytes, big * c * 4);
    let o = s.ops[0];
    assert_eq!(
        o.send as u64,
        recv + (c * 4) as u64,
        "input at recv + rank*count"
    );
    assert_eq!(
        s.to_host,
        vec![Copy {
            dev: send,
            off: c * 4,
            bytes: c * 4
        }]
    );
    assert_eq!(pinned_at(s, o.send as u64), c * 4);
    assert_eq!(
        s.to_device,
        vec![Copy {
            dev: recv,
            off: 0,
            bytes: big * c * 4
        }]
    );

    let rs = dev_op(Op::reduce_scatter(
        p(send),
        p(recv),
        c,
        DataType::F32,
        ReduceOp::Sum,
    ));
    let s = &stage(&[rs], 2, n, 8, &ON_CPU, &no_regions)[0];
    let o = s.ops[0];
    assert_eq!(
        o.recv as u64,
        send + (2 * c * 4) as u64,
        "output at send + rank*count"
    );
    assert_eq!(
        s.to_host,
        vec![Copy {
            dev: send,
            off: 0,
            bytes: n * c * 4
        }]
    );
    assert_eq!(
        s.to_device,
        vec![Copy {
            dev: recv,
            off: 2 * c * 4,
            bytes: c * 4
        }]
    );
}

/// Every rank's jobs of a sliced all-gather and reduce-scatter run as
/// the GPU and the progress thread would (the device's copies, the
/// collective on each job's pinned region, the copies back), in and out
/// of place, odd block sizes: every rank's output against the
/// reference, and no job copies more than its slice of each block.
#[test]
// Job j of every rank, rank r of every job: indices read plainer here.
#[allow(clippy::needless_range_loop)]
fn sliced_all_gather_and_reduce_scatter_move_every_block_once_and_match_the_reference() {
    const MEM: usize = 1 << 20;
    // A block of 5 pages and 3 floats. Reduce-scatter on 3 ranks, reduced
    // on the CPU: six slices, the last of 12 bytes. All-gather on more
    // ranks than its exchange form takes: three slices (at most
    // MAX_GATHERED_COPIES block copies in all).
    let count = 5 * 1024 + 3;
    let block = count * 4;
    let value = |r: usize, i: usize| ((r * 31 + i * 7) % 97 + 1) as f32;
    for (kind, n, k) in [
        (OpKind::AllGather, MAX_RANKS + 1, 3),
        (OpKind::ReduceScatter, 3, 6),
    ] {
        let largest = slices(block, k).iter().map(|s| s.1).max().unwrap();
        for in_place_op in [false, true] {
            // Device memory of each rank: the send buffer at DEV, the
            // receive buffer at DEV + MEM (in place: NCCL's layouts).
            let mut mem: Vec<Vec<f32>> = (0..n)
                .map(|r| {
                    let mut m = vec![f32::NAN; 2 * MEM / 4];
                    let inputs = if kind == OpKind::AllGather {
                        count
                    } else {
                        n * count
                    };
                    let at = match (kind, in_place_op) {
                        (OpKind::AllGather, true) => MEM / 4 + r * count,
                        _ => 0,
                    };
                    for i in 0..inputs {
                        m[at + i] = value(r, i);
                    }
                    m
                })
                .collect();
            let ops: Vec<Op> = (0..n)
                .map(|r| {
                    let recv = DEV + MEM as u64;
                    let (sp, rp) = match (kind, in_place_op) {
                        (OpKind::AllGather, true) => (recv + (r * block) as u64, recv),
                        (OpKind::AllGather, false) => (DEV, recv),
                        (_, true) => (DEV, DEV + (r * block) as u64),
                        (_, false) => (DEV, recv),
                    };
                    let op = if kind == OpKind::AllGather {
                        Op::all_gather(p(sp), p(rp), count, DataType::F32)
                    } else {
                        Op::reduce_scatter(p(sp), p(rp), count, DataType::F32, ReduceOp::Sum)
                    };
                    dev_op(op)
                })
                .collect();
            let jobs: Vec<Vec<Staged>> = (0..n)
                .map(|r| stage(&[ops[r]], r, n, 8192, &ON_CPU, &no_regions))
                .collect();
            assert_eq!(jobs[0].len(), k, "{kind:?}: cut in {k} slices");
            let idx = |a: u64| (a - DEV) as usize / 4;
            for j in 0..jobs[0].len() {
                // Copies in (and the GPU's own copies), per rank.
                let mut pinned: Vec<Vec<f32>> = Vec::new();
                for r in 0..n {
                    let s = &jobs[r][j];
                    assert!(
                        s.to_host.iter().all(|c| c.bytes <= largest),
                        "{kind:?}: a slice"
                    );
                    pinned.push(copy_in(&mut mem[r], s));
                }
                // The collective of the slice on the pinned regions.
                let o = jobs[0][j].ops[0];
                let c = o.count;
                let before = pinned.clone();
                for r in 0..n {
                    let s = &jobs[r][j];
                    let (so, ro) = (
                        pinned_at(s, s.ops[0].send as u64) / 4,
                        pinned_at(s, s.ops[0].recv as u64) / 4,
                    );
                    for q in 0..n {
                        if kind == OpKind::AllGather {
                            let sq = &jobs[q][j];
                            let qo = pinned_at(sq, sq.ops[0].send as u64) / 4;
                            let v = before[q][qo..qo + c].to_vec();
                            pinned[r][ro + q * c..ro + (q + 1) * c].copy_from_slice(&v);
                        }
                    }
                    if kind == OpKind::ReduceScatter {
                        for i in 0..c {
                            pinned[r][ro + i] = (0..n).map(|q| before[q][so + r * c + i]).sum();
                        }
                    }
                }
                // Copies back.
                for r in 0..n {
                    for cp in &jobs[r][j].to_device {
                        assert!(cp.bytes <= largest, "{kind:?}: a slice of a block at most");
                        let v = pinned[r][cp.off / 4..(cp.off + cp.bytes) / 4].to_vec();
                        mem[r][idx(cp.dev)..idx(cp.dev) + cp.bytes / 4].copy_from_slice(&v);
                    }
                }
            }
            for r in 0..n {
                let out = idx(ops[r].recv as u64);
                if kind == OpKind::AllGather {
                    for i in 0..n * count {
                        let want = value(i / count, i % count);
                        assert_eq!(
                            mem[r][out + i],
                            want,
                            "all_gather in place {in_place_op} rank {r} at {i}"
                        );
                    }
                } else {
                    for i in 0..count {
                        let want: f32 = (0..n).map(|q| value(q, r * count + i)).sum();
                        assert_eq!(
                            mem[r][out + i],
                            want,
                            "reduce_scatter in place {in_place_op} rank {r} at {i}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn groups_host_buffers_and_other_kinds_take_the_generic_staging() {
    let (a, b) = (DEV, DEV + (1 << 32));
    let regions = |ops: &[Op]| {
        assert!(!ops.is_empty());
        vec![
            DevRegion {
                dev: a,
                bytes: 100,
                write: false,
                read: true,
            },
            DevRegion {
                dev: b,
                bytes: 300,
                write: true,
                read: false,
            },
        ]
    };
    let a2a = dev_op(Op::all_to_all(p(a), p(b), 25, DataType::F32));
    let host = dev_op(Op::all_reduce(
        p(4096),
        p(b),
        25,
        DataType::F32,
        ReduceOp::Sum,
    ));
    let send = dev_op(Op::send(p(a), 25, DataType::F32, 1));
    for job in [vec![host], vec![send, a2a]] {
        let s = stage(&job, 0, 2, 8, &ON_CPU, &regions);
        assert_eq!(s.len(), 1);
        let s = &s[0];
        assert_eq!(s.ops.len(), job.len());
        assert_eq!(
            s.to_host,
            vec![Copy {
                dev: a,
                off: 0,
                bytes: 100
            }]
        );
        assert_eq!(
            s.to_device,
            vec![Copy {
                dev: b,
                off: 256,
                bytes: 300
            }]
        );
        assert_eq!(s.bytes, 256 + 512);
        assert_eq!(
            s.host_map(1 << 20),
            vec![(a, 100, 1 << 20), (b, 300, (1 << 20) + 256)]
        );
    }
}

/// Where op `i` of `s` points once staged at pinned base `base`.
fn host_ptrs(s: &Staged, base: u64) -> Vec<u64> {
    s.host_ops(base)
        .iter()
        .map(|o| o.p2p_buf() as u64)
        .collect()
}

#[test]
fn sends_and_receives_stage_each_piece_apart_cut_alike_on_both_ends() {
    let (a, b) = (DEV, DEV + (1 << 32));
    // In place, as nccl-tests' send/recv: the receive over its own send.
    let mine = vec![
        dev_op(Op::send(p(a), 3 * MIB / 4, DataType::F32, 1)),
        dev_op(Op::recv(p(a), 3 * MIB / 4, DataType::F32, 1)),
        dev_op(Op::recv(p(b), (MIB + 12) / 4, DataType::F32, 2)),
    ];
    let jobs = stage(&mine, 0, 3, MIB, &ON_CPU, &no_regions);
    // 3 MiB in 3 slices of 1 MiB; the 1 MiB + 12 receive is not cut.
    assert_eq!(jobs.len(), 3);
    for (k, s) in jobs.iter().enumerate() {
        let piece = (k * MIB) as u64;
        assert_eq!(
            s.to_host,
            vec![Copy {
                dev: a + piece,
                off: 0,
                bytes: MIB
            }]
        );
        let mut want = vec![Copy {
            dev: a + piece,
            off: MIB,
            bytes: MIB,
        }];
        if k == 0 {
            want.push(Copy {
                dev: b,
                off: 2 * MIB,
                bytes: MIB + 12,
            });
        }
        assert_eq!(s.to_device, want, "job {k}");
        // The send and the receive over it get their own regions.
        let base = 1 << 30;
        let ptrs = host_ptrs(s, base);
        assert_eq!(ptrs[..2], [base, base + MIB as u64], "job {k}");
        assert!(
            s.ops
                .iter()
                .all(|o| o.count == MIB / 4 || o.count == (MIB + 12) / 4)
        );
        assert!(s.host_ops(base).iter().all(|o| o.memory == Memory::Host));
    }
    // The other end's matching ops are cut alike: job k moves piece k.
    let theirs = vec![
        dev_op(Op::recv(p(b), 3 * MIB / 4, DataType::F32, 0)),
        dev_op(Op::send(p(b), 3 * MIB / 4, DataType::F32, 0)),
    ];
    let other = stage(&theirs, 1, 3, MIB, &ON_CPU, &no_regions);
    assert_eq!(other.len(), 3);
    for (k, s) in other.iter().enumerate() {
        assert_eq!(
            s.ops.iter().map(|o| o.bytes()).collect::<Vec<_>>(),
            vec![MIB, MIB]
        );
        assert_eq!(s.to_device[0].dev, b + (k * MIB) as u64);
    }
}

#[test]
fn an_all_to_all_sends_only_the_other_ranks_blocks_and_copies_its_own_on_the_gpu() {
    let (snd, rcv) = (DEV, DEV + (1 << 32));
    let count = 1000; // 4000 bytes a block
    let op = dev_op(Op::all_to_all(p(snd), p(rcv), count, DataType::F32));
    let jobs = stage(&[op], 1, 3, 0, &ON_CPU, &no_regions);
    assert_eq!(jobs.len(), 1);
    let s = &jobs[0];
    assert_eq!(
        s.dtod,
        vec![(rcv + 4000, snd + 4000, 4000)],
        "the own block, on the GPU"
    );
    let peers: Vec<(OpKind, usize, u64)> = s
        .ops
        .iter()
        .map(|o| (o.kind, o.peer(), o.p2p_buf() as u64))
        .collect();
    assert_eq!(
        peers,
        vec![
            (OpKind::Send, 0, snd),
            (OpKind::Recv, 0, rcv),
            (OpKind::Send, 2, snd + 8000),
            (OpKind::Recv, 2, rcv + 8000),
        ]
    );
    let devs = |c: &[Copy]| c.iter().map(|c| (c.dev, c.bytes)).collect::<Vec<_>>();
    assert_eq!(devs(&s.to_host), vec![(snd, 4000), (snd + 8000, 4000)]);
    assert_eq!(devs(&s.to_device), vec![(rcv, 4000), (rcv + 8000, 4000)]);
    assert_eq!(s.bytes, 4 * 4096);
    // In place: no own copy at all.
    let inplace = dev_op(Op::all_to_all(p(snd), p(snd), count, DataType::F32));
    let jobs = stage(&[inplace], 1, 3, 0, &ON_CPU, &no_regions);
    assert!(jobs[0].dtod.is_empty());
    assert_eq!(jobs[0].ops.len(), 4);
}
