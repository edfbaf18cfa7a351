//! `pinned_plan`'s tests: each staging run as the GPU and the progress
//! thread would, on host memory standing for both.

use super::*;
use crate::op::Memory;

const MIB: usize = 1 << 20;

/// Device addresses in these tests are at or above this.
const DEV: u64 = 1 << 40;

fn on_device(p: u64) -> bool {
    p >= DEV
}

fn never(_: DataType, _: ReduceOp) -> bool {
    false
}

fn always(_: DataType, _: ReduceOp) -> bool {
    true
}

/// Device memory at [`DEV`] and up; every reduction on the CPU.
const ON_CPU: DeviceCan = DeviceCan {
    on_device: &on_device,
    reduce: &never,
};

/// As [`ON_CPU`], and the GPU reduces every type and op.
const ON_GPU: DeviceCan = DeviceCan {
    on_device: &on_device,
    reduce: &always,
};

fn no_regions(_: &[Op]) -> Vec<DevRegion> {
    panic!("the generic path was not expected")
}

fn dev_op(mut op: Op) -> Op {
    op = op.on(Memory::Device(0), std::ptr::null_mut());
    op
}

fn p(a: u64) -> *mut u8 {
    a as *mut u8
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
    let ag = dev_op(Op::all_gather(p(send), p(recv), c, DataType::F32));
    let s = &stage(&[ag], 1, n, 8, &ON_CPU, &no_regions);
    assert_eq!(s.len(), 1, "a block under one slice's alignment is not cut");
    let s = &s[0];
    assert_eq!(s.bytes, n * c * 4);
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
            bytes: n * c * 4
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
    let n = 3;
    // A block of 5 pages and 3 floats: six slices, the last of 12 bytes.
    let count = 5 * 1024 + 3;
    let block = count * 4;
    let value = |r: usize, i: usize| ((r * 31 + i * 7) % 97 + 1) as f32;
    for kind in [OpKind::AllGather, OpKind::ReduceScatter] {
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
            assert_eq!(jobs[0].len(), 6, "{kind:?}: cut in six slices");
            let idx = |a: u64| (a - DEV) as usize / 4;
            for j in 0..jobs[0].len() {
                // Copies in (and the GPU's own copies), per rank.
                let mut pinned: Vec<Vec<f32>> = Vec::new();
                for r in 0..n {
                    let s = &jobs[r][j];
                    for &(dst, src, bytes) in &s.dtod {
                        let v = mem[r][idx(src)..idx(src) + bytes / 4].to_vec();
                        mem[r][idx(dst)..idx(dst) + bytes / 4].copy_from_slice(&v);
                    }
                    let mut b = vec![f32::NAN; s.bytes / 4];
                    for c in &s.to_host {
                        assert!(c.bytes <= 4096, "{kind:?}: a slice of a block at most");
                        b[c.off / 4..(c.off + c.bytes) / 4]
                            .copy_from_slice(&mem[r][idx(c.dev)..idx(c.dev) + c.bytes / 4]);
                    }
                    pinned.push(b);
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
                        assert!(cp.bytes <= 4096, "{kind:?}: a slice of a block at most");
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

/// Runs job `j` of every rank (`jobs[r][j]`, jobs of sends and receives
/// whose copy out may reduce) on `mem` as the GPU and the progress thread
/// would: every rank's copies in, each send into the peer's receive from
/// this rank (one a pair: the same bytes), the reducing copy out (sum),
/// the copies out. Returns each rank's pinned buffer after the network.
fn run_exchange(mem: &mut [Vec<f32>], jobs: &[Vec<Staged>], j: usize) -> Vec<Vec<f32>> {
    run_exchange_with(mem, jobs, j, &vec![None; mem.len()])
}

/// [`run_exchange`] where rank r's progress thread reduces `cpu[r]` on
/// its pinned buffer after the network part ([`reduced_on_host`]).
fn run_exchange_with(
    mem: &mut [Vec<f32>],
    jobs: &[Vec<Staged>],
    j: usize,
    cpu: &[Option<HostReduce>],
) -> Vec<Vec<f32>> {
    let n = mem.len();
    let idx = |a: u64| (a - DEV) as usize / 4;
    let mut pinned: Vec<Vec<f32>> = Vec::new();
    for r in 0..n {
        let s = &jobs[r][j];
        assert!(s.dtod.is_empty());
        let mut b = vec![f32::NAN; s.bytes / 4];
        for c in &s.to_host {
            b[c.off / 4..(c.off + c.bytes) / 4]
                .copy_from_slice(&mem[r][idx(c.dev)..idx(c.dev) + c.bytes / 4]);
        }
        pinned.push(b);
    }
    let host: Vec<Vec<Op>> = (0..n).map(|r| jobs[r][j].host_ops(0)).collect();
    let before = pinned.clone();
    for r in 0..n {
        for send in host[r].iter().filter(|o| o.kind == OpKind::Send) {
            let q = send.peer();
            let to_q = host[r]
                .iter()
                .filter(|o| o.kind == OpKind::Send && o.peer() == q);
            assert_eq!(to_q.count(), 1, "one piece to each peer a job");
            let recv = host[q]
                .iter()
                .find(|o| o.kind == OpKind::Recv && o.peer() == r)
                .expect("a receive for every send");
            assert_eq!(recv.bytes(), send.bytes());
            let (from, to, c) = (send.send as usize / 4, recv.recv as usize / 4, send.count);
            let v = before[r][from..from + c].to_vec();
            pinned[q][to..to + c].copy_from_slice(&v);
        }
    }
    for (r, h) in cpu.iter().enumerate() {
        if let Some(h) = h {
            assert_eq!(
                (h.received.op, h.received.from.len()),
                (ReduceOp::Sum, n - 1)
            );
            for i in 0..h.received.count {
                let mut acc = pinned[r][h.into / 4 + i];
                for &off in &h.received.from {
                    acc += pinned[r][off / 4 + i];
                }
                pinned[r][h.into / 4 + i] = acc;
            }
        }
    }
    for r in 0..n {
        let s = &jobs[r][j];
        if let Some(red) = &s.reduce_out {
            assert_eq!(
                (red.received.op, red.received.from.len()),
                (ReduceOp::Sum, n - 1)
            );
            for i in 0..red.received.count {
                let mut acc = mem[r][idx(red.own) + i];
                for &off in &red.received.from {
                    acc += pinned[r][off / 4 + i];
                }
                mem[r][idx(red.dst) + i] = acc;
            }
        }
        for c in &s.to_device {
            let v = pinned[r][c.off / 4..(c.off + c.bytes) / 4].to_vec();
            mem[r][idx(c.dev)..idx(c.dev) + c.bytes / 4].copy_from_slice(&v);
        }
    }
    pinned
}

/// Random integer-valued f32 (sums exact in any order), xorshift.
fn random_values(seed: &mut u64, n: usize) -> Vec<f32> {
    (0..n)
        .map(|_| {
            *seed ^= *seed << 13;
            *seed ^= *seed >> 7;
            *seed ^= *seed << 17;
            (*seed % 33) as f32 - 16.0
        })
        .collect()
}

/// A reduce-scatter the GPU reduces ([`reduce_scatter_on_gpu`]), its
/// jobs run here as the GPU and the progress thread would, on 3 ranks,
/// whole and cut in slices, in and out of place, an odd block: each job
/// copies in only the other ranks' slices of its input, its sends meet
/// the peers' receives, nothing is copied back as such, and the reduction
/// of the own slice (device memory) with the received ones (pinned) is
/// the reference.
#[test]
fn a_reduce_scatter_reduced_on_the_gpu_sends_the_other_blocks_and_reduces_what_arrives() {
    const MEM: usize = 1 << 20;
    let n = 3;
    let count = 5 * 1024 + 3;
    let block = count * 4;
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    for (slice_bytes, jobs_each) in [(0, 1), (8192, 6)] {
        for in_place_op in [false, true] {
            let mut mem: Vec<Vec<f32>> = (0..n)
                .map(|_| {
                    let mut m = vec![f32::NAN; 2 * MEM / 4];
                    m[..n * count].copy_from_slice(&random_values(&mut seed, n * count));
                    m
                })
                .collect();
            let input = mem.clone();
            let ops: Vec<Op> = (0..n)
                .map(|r| {
                    let rp = match in_place_op {
                        true => DEV + (r * block) as u64,
                        false => DEV + MEM as u64,
                    };
                    dev_op(Op::reduce_scatter(
                        p(DEV),
                        p(rp),
                        count,
                        DataType::F32,
                        ReduceOp::Sum,
                    ))
                })
                .collect();
            let jobs: Vec<Vec<Staged>> = (0..n)
                .map(|r| stage(&[ops[r]], r, n, slice_bytes, &ON_GPU, &no_regions))
                .collect();
            // The same op with every reduction on the CPU: the in-place staging.
            let cpu = stage(&[ops[0]], 0, n, slice_bytes, &ON_CPU, &no_regions);
            assert!(cpu.iter().all(|s| s.reduce_out.is_none() && !s.per_op));
            for j in 0..jobs_each {
                for r in 0..n {
                    let s = &jobs[r][j];
                    assert_eq!(jobs[r].len(), jobs_each);
                    assert!(s.to_device.is_empty() && !s.after_previous);
                    assert_eq!(s.to_host.len(), n - 1, "the other ranks' slices only");
                    let own = (ops[r].send as u64 - DEV) as usize / 4 + r * count;
                    for c in &s.to_host {
                        let at = (c.dev - DEV) as usize / 4;
                        assert!(at + c.bytes / 4 <= own || at >= own + count);
                    }
                }
                run_exchange(&mut mem, &jobs, j);
            }
            for r in 0..n {
                let out = (ops[r].recv as u64 - DEV) as usize / 4;
                for i in 0..count {
                    let want: f32 = (0..n).map(|q| input[q][r * count + i]).sum();
                    assert_eq!(
                        mem[r][out + i],
                        want,
                        "slices {slice_bytes} in place {in_place_op} rank {r} at {i}"
                    );
                }
            }
        }
    }
    // PreMulSum (no kernel) and more ranks than a kernel reduces: the
    // in-place staging.
    let op = dev_op(Op::reduce_scatter(
        p(DEV),
        p(DEV + MEM as u64),
        64,
        DataType::F32,
        ReduceOp::PreMulSum(0.5),
    ));
    let only_sum = |_: DataType, r: ReduceOp| r == ReduceOp::Sum;
    let can = DeviceCan {
        on_device: &on_device,
        reduce: &only_sum,
    };
    assert!(
        stage(&[op], 0, 2, 0, &can, &no_regions)[0]
            .reduce_out
            .is_none()
    );
    let sum = dev_op(Op::reduce_scatter(
        p(DEV),
        p(DEV + MEM as u64),
        64,
        DataType::F32,
        ReduceOp::Sum,
    ));
    assert!(
        stage(&[sum], 0, 2, 0, &can, &no_regions)[0]
            .reduce_out
            .is_some()
    );
    assert!(
        stage(&[sum], 0, MAX_RANKS + 1, 0, &can, &no_regions)[0]
            .reduce_out
            .is_none()
    );
}

/// A rank that cannot launch the reducing kernel ([`reduced_on_host`])
/// sends and receives exactly what the others do: its own part is copied
/// in too, its progress thread reduces, the result is copied out. A
/// reduce-scatter and an all-reduce on 3 ranks, rank 1 reducing on its
/// CPU and the others on their GPUs: every output is the reference. And
/// the choice of the form rests on the setting, type and op alone.
#[test]
// Rank r of every job: indices read plainer here.
#[allow(clippy::needless_range_loop)]
fn a_rank_reducing_on_its_cpu_exchanges_what_the_gpu_ranks_do() {
    const MEM: usize = 4 << 20;
    let n = 3;
    let count = (1 << 19) + 7;
    let mut seed = 0x5851_f42d_4c95_7f2du64;
    for kind in [OpKind::ReduceScatter, OpKind::AllReduce] {
        let inputs = if kind == OpKind::AllReduce {
            count
        } else {
            n * count
        };
        let mut mem: Vec<Vec<f32>> = (0..n)
            .map(|_| {
                let mut m = vec![f32::NAN; 2 * MEM / 4];
                m[..inputs].copy_from_slice(&random_values(&mut seed, inputs));
                m
            })
            .collect();
        let input = mem.clone();
        let recv = DEV + MEM as u64;
        let op = dev_op(match kind {
            OpKind::AllReduce => {
                Op::all_reduce(p(DEV), p(recv), count, DataType::F32, ReduceOp::Sum)
            }
            _ => Op::reduce_scatter(p(DEV), p(recv), count, DataType::F32, ReduceOp::Sum),
        });
        let mut host: Vec<Vec<Option<HostReduce>>> = Vec::new();
        let jobs: Vec<Vec<Staged>> = (0..n)
            .map(|r| {
                let staged = stage(&[op], r, n, 64 << 20, &ON_GPU, &no_regions);
                let (jobs, h): (Vec<Staged>, Vec<Option<HostReduce>>) = staged
                    .into_iter()
                    .map(|s| {
                        if r == 1 {
                            reduced_on_host(s)
                        } else {
                            (s, None)
                        }
                    })
                    .unzip();
                host.push(h);
                jobs
            })
            .collect();
        assert!(host[1][0].is_some() && jobs[1][0].reduce_out.is_none());
        assert!(jobs[0][0].reduce_out.is_some());
        assert_eq!(
            jobs[1][0].to_host.len(),
            jobs[0][0].to_host.len() + 1,
            "the own part copied in too"
        );
        for j in 0..jobs[0].len() {
            let h: Vec<Option<HostReduce>> = host.iter().map(|hs| hs[j].clone()).collect();
            run_exchange_with(&mut mem, &jobs, j, &h);
        }
        for r in 0..n {
            let out = (recv - DEV) as usize / 4;
            for i in 0..count {
                let at = if kind == OpKind::AllReduce {
                    i
                } else {
                    r * count + i
                };
                let want: f32 = (0..n).map(|q| input[q][at]).sum();
                assert_eq!(mem[r][out + i], want, "{kind:?} rank {r} at {i}");
            }
        }
    }
    // The form: the setting (default gpu), the type, the op; never fp8 or
    // PreMulSum.
    assert!(exchanges(DataType::F32, ReduceOp::Sum));
    assert!(exchanges(DataType::Bf16, ReduceOp::Avg));
    assert!(exchanges(DataType::I64, ReduceOp::Prod));
    assert!(!exchanges(DataType::F8E4M3, ReduceOp::Sum));
    assert!(!exchanges(DataType::F8E5M2, ReduceOp::Max));
    assert!(!exchanges(DataType::F32, ReduceOp::PreMulSum(2.0)));
}

/// An all-reduce of 2 MiB and more the GPU reduces ([`all_reduce_on_gpu`])
/// run here on 3 ranks, in and out of place, a count that 3 does not
/// divide: two jobs, the second after the first's copy out; the first
/// sends the other ranks' parts and reduces its own, the second sends the
/// reduced part and copies the others' back; every rank's output is the
/// reference. Below 2 MiB or cut in slices: the in-place staging.
#[test]
// Rank r of every job: indices read plainer here.
#[allow(clippy::needless_range_loop)]
fn an_all_reduce_reduced_on_the_gpu_is_a_reduce_scatter_then_an_all_gather() {
    const MEM: usize = 4 << 20;
    let n = 3;
    let count = (1 << 19) + 7;
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    for in_place_op in [false, true] {
        let mut mem: Vec<Vec<f32>> = (0..n)
            .map(|_| {
                let mut m = vec![f32::NAN; 2 * MEM / 4];
                m[..count].copy_from_slice(&random_values(&mut seed, count));
                m
            })
            .collect();
        let input = mem.clone();
        let recv = if in_place_op { DEV } else { DEV + MEM as u64 };
        let op = dev_op(Op::all_reduce(
            p(DEV),
            p(recv),
            count,
            DataType::F32,
            ReduceOp::Sum,
        ));
        let jobs: Vec<Vec<Staged>> = (0..n)
            .map(|r| stage(&[op], r, n, 64 << 20, &ON_GPU, &no_regions))
            .collect();
        for r in 0..n {
            let [reduce, gather] = &jobs[r][..] else {
                panic!("two jobs, not {}", jobs[r].len());
            };
            assert!(reduce.reduce_out.is_some() && !reduce.after_previous);
            assert!(gather.reduce_out.is_none() && gather.after_previous);
            let (_, mine) = part(count, n, r);
            assert_eq!(reduce.reduce_out.as_ref().unwrap().received.count, mine);
            assert_eq!(gather.to_host.len(), 1, "its own reduced part");
            assert_eq!(gather.to_device.len(), n - 1, "the others' parts");
        }
        for j in 0..2 {
            run_exchange(&mut mem, &jobs, j);
        }
        let out = (recv - DEV) as usize / 4;
        for r in 0..n {
            for i in 0..count {
                let want: f32 = (0..n).map(|q| input[q][i]).sum();
                assert_eq!(
                    mem[r][out + i],
                    want,
                    "in place {in_place_op} rank {r} at {i}"
                );
            }
        }
    }
    let staged_in_place = |count: usize, slice: usize, redop: ReduceOp| {
        let op = dev_op(Op::all_reduce(p(DEV), p(DEV), count, DataType::F32, redop));
        let s = stage(&[op], 0, n, slice, &ON_GPU, &no_regions);
        s.iter().all(|j| j.reduce_out.is_none() && !j.per_op)
    };
    assert!(!staged_in_place(count, 64 << 20, ReduceOp::Sum));
    assert!(
        staged_in_place((1 << 19) - 1, 64 << 20, ReduceOp::Sum),
        "under 2 MiB"
    );
    assert!(
        staged_in_place(count, 1 << 20, ReduceOp::Sum),
        "cut in slices"
    );
    // Parts cover the buffer in order, the first count % n one longer.
    assert_eq!(part(10, 3, 0), (0, 4));
    assert_eq!(part(10, 3, 1), (4, 3));
    assert_eq!(part(10, 3, 2), (7, 3));
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
