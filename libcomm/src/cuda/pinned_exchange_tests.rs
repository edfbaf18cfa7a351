//! `pinned_plan`'s tests of the forms that exchange parts as sends and
//! receives (a reduce-scatter and an all-reduce reduced on the GPU or on a
//! rank's CPU, an all-gather): each rank's jobs run as the GPU and the
//! progress thread would, on host memory standing for both.

use super::tests::{DEV, ON_CPU, ON_GPU, copy_in, dev_op, no_regions, on_device, p};
use super::*;
use crate::data::types::{DataType, ReduceOp};

/// Runs job `j` of every rank (`jobs[r][j]`, jobs of sends and receives
/// whose copy out may reduce) on `mem` as the GPU and the progress thread
/// would: every rank's device copies and copies in, each send into the peer's receive from
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
    let mut pinned: Vec<Vec<f32>> = (0..n).map(|r| copy_in(&mut mem[r], &jobs[r][j])).collect();
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

/// Every rank's memory (`2 * mem` bytes from [`DEV`]) for a sum
/// all-reduce of `count` random values (the rest NaN), a copy of it (the
/// inputs), where the output goes (in place, or `mem` bytes further) and
/// the operation.
fn all_reduce_setup(
    n: usize,
    count: usize,
    mem: usize,
    seed: &mut u64,
    in_place: bool,
) -> (Vec<Vec<f32>>, Vec<Vec<f32>>, u64, Op) {
    let memory: Vec<Vec<f32>> = (0..n)
        .map(|_| {
            let mut m = vec![f32::NAN; 2 * mem / 4];
            m[..count].copy_from_slice(&random_values(seed, count));
            m
        })
        .collect();
    let recv = if in_place { DEV } else { DEV + mem as u64 };
    let op = Op::all_reduce(p(DEV), p(recv), count, DataType::F32, ReduceOp::Sum);
    (memory.clone(), memory, recv, dev_op(op))
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
        let (mut mem, input, recv, op) = all_reduce_setup(n, count, MEM, &mut seed, in_place_op);
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

/// An all-reduce on two ranks ([`all_reduce_of_two`]) run here as the GPU
/// and the progress thread would: in and out of place, odd counts from one
/// element, random values: one job, each rank sends its whole buffer and
/// copies in nothing else, nothing is
/// copied back as such, the copy out reduces its own slice (device memory)
/// with the other's; every output is the reference. A rank that cannot run
/// the reducing kernel ([`reduced_on_host`]) sends the same messages and
/// reduces on its CPU. From 2 MiB the pair of jobs of every rank count;
/// where the ranks do not exchange, and a call cut in slices (one launch
/// for all of them), the in-place staging.
#[test]
// Rank r of every job: indices read plainer here.
#[allow(clippy::needless_range_loop)]
fn an_all_reduce_on_two_ranks_under_2_mib_is_one_exchange_of_the_whole_buffer() {
    const MEM: usize = 1 << 20;
    let n = 2;
    let mut seed = 0x5851_f42d_4c95_7f2du64;
    for (count, slice_bytes, jobs_each) in [(1, 0, 1), (1023, 0, 1), (20 * 1024 + 5, 1 << 20, 1)] {
        for in_place_op in [false, true] {
            for on_cpu in [false, true] {
                let (mut mem, input, recv, op) =
                    all_reduce_setup(n, count, MEM, &mut seed, in_place_op);
                let jobs: Vec<Vec<Staged>> = (0..n)
                    .map(|r| stage(&[op], r, n, slice_bytes, &ON_GPU, &no_regions))
                    .collect();
                let what = format!("count {count} in place {in_place_op} on cpu {on_cpu}");
                for r in 0..n {
                    assert_eq!(jobs[r].len(), jobs_each, "{what}");
                    let mut covered = 0;
                    for s in &jobs[r] {
                        assert!(s.per_op && !s.after_previous, "{what}");
                        let red = s.reduce_out.as_ref().expect("the copy out reduces");
                        assert_eq!(red.own, DEV + 4 * covered as u64, "{what}");
                        assert_eq!(red.dst, recv + 4 * covered as u64, "{what}");
                        assert_eq!(s.to_host.len(), 1, "its own slice, once: {what}");
                        assert_eq!(s.to_host[0].dev, red.own, "{what}");
                        assert!(s.to_device.is_empty(), "{what}");
                        let sends = s.ops.iter().filter(|o| o.kind == OpKind::Send);
                        let recvs = s.ops.iter().filter(|o| o.kind == OpKind::Recv);
                        assert_eq!((sends.count(), recvs.count()), (1, 1), "{what}");
                        covered += red.received.count;
                    }
                    assert_eq!(covered, count, "the slices cover the buffer: {what}");
                }
                for j in 0..jobs_each {
                    let mut jobs_j = jobs.clone();
                    let mut cpu = vec![None; n];
                    if on_cpu {
                        for r in 0..n {
                            let (s, h) = reduced_on_host(jobs[r][j].clone());
                            assert!(h.is_some(), "{what}");
                            jobs_j[r][j] = s;
                            cpu[r] = h;
                        }
                    }
                    run_exchange_with(&mut mem, &jobs_j, j, &cpu);
                }
                let out = (recv - DEV) as usize / 4;
                for r in 0..n {
                    for i in 0..count {
                        assert_eq!(
                            mem[r][out + i],
                            input[0][i] + input[1][i],
                            "{what}: rank {r} at {i}"
                        );
                    }
                }
            }
        }
    }
    // Where the ranks do not exchange (`exchanges`: the setting, fp8,
    // PreMulSum), the in-place staging.
    let op = dev_op(Op::all_reduce(
        p(DEV),
        p(DEV),
        4096,
        DataType::F32,
        ReduceOp::Sum,
    ));
    let s = stage(&[op], 0, n, 0, &ON_CPU, &no_regions);
    assert!(s.iter().all(|j| j.reduce_out.is_none() && !j.per_op));
    let s = stage(&[op], 0, n, 4096, &ON_GPU, &no_regions);
    assert_eq!(s.len(), 4, "cut in slices");
    assert!(s.iter().all(|j| j.reduce_out.is_none() && !j.per_op));
    let big = dev_op(Op::all_reduce(
        p(DEV),
        p(DEV),
        1 << 19,
        DataType::F32,
        ReduceOp::Sum,
    ));
    let s = stage(&[big], 0, n, 64 << 20, &ON_GPU, &no_regions);
    assert_eq!(s.len(), 2, "2 MiB: a reduce-scatter, then an all-gather");
    assert!(s[1].after_previous);
}

/// An all-gather as an exchange ([`all_gather_exchanged`]), its jobs run
/// here as the GPU and the progress thread would, on 3 ranks, whole and
/// cut in slices, in and out of place, an odd block, random values: each
/// job copies in only this rank's slice, once, sends it to every other
/// rank and copies out only theirs (its own slice moved on the GPU when
/// out of place); every output is the reference.
#[test]
// Job j of every rank, rank r of every job: indices read plainer here.
#[allow(clippy::needless_range_loop)]
fn an_all_gather_sends_its_block_once_to_each_rank_and_copies_out_only_theirs() {
    const MEM: usize = 1 << 20;
    let n = 3;
    let count = 5 * 1024 + 3;
    let block = count * 4;
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    for slice_bytes in [0, 8192] {
        for in_place_op in [false, true] {
            let recv = DEV + MEM as u64;
            let mut mem: Vec<Vec<f32>> = vec![vec![f32::NAN; 2 * MEM / 4]; n];
            let inputs: Vec<Vec<f32>> = (0..n).map(|_| random_values(&mut seed, count)).collect();
            let ops: Vec<Op> = (0..n)
                .map(|r| {
                    let sp = match in_place_op {
                        true => recv + (r * block) as u64,
                        false => DEV,
                    };
                    let at = (sp - DEV) as usize / 4;
                    mem[r][at..at + count].copy_from_slice(&inputs[r]);
                    dev_op(Op::all_gather(p(sp), p(recv), count, DataType::F32))
                })
                .collect();
            let jobs: Vec<Vec<Staged>> = (0..n)
                .map(|r| stage(&[ops[r]], r, n, slice_bytes, &ON_CPU, &no_regions))
                .collect();
            let k = slices(block, gathered_slice_count(block, n, slice_bytes)).len();
            assert_eq!(k > 1, slice_bytes > 0, "cut only with a slice size");
            for j in 0..k {
                for r in 0..n {
                    assert_eq!(jobs[r].len(), k);
                    let s = &jobs[r][j];
                    assert!(s.per_op && s.reduce_out.is_none() && !s.after_previous);
                    assert_eq!(s.to_host.len(), 1, "this rank's slice, once");
                    let own = (ops[r].send as u64, ops[r].send as u64 + block as u64);
                    assert!(s.to_host[0].dev >= own.0 && s.to_host[0].dev < own.1);
                    assert_eq!(s.to_device.len(), n - 1, "the other ranks' slices only");
                    let mine = (recv + (r * block) as u64, recv + ((r + 1) * block) as u64);
                    assert!(
                        s.to_device
                            .iter()
                            .all(|c| c.dev < mine.0 || c.dev >= mine.1)
                    );
                    assert_eq!(s.dtod.is_empty(), in_place_op, "own slice moved on the GPU");
                }
                run_exchange(&mut mem, &jobs, j);
            }
            for r in 0..n {
                let out = (recv - DEV) as usize / 4;
                for i in 0..n * count {
                    assert_eq!(
                        mem[r][out + i],
                        inputs[i / count][i % count],
                        "slices {slice_bytes} in place {in_place_op} rank {r} at {i}"
                    );
                }
            }
        }
    }
}
