//! The correctness matrix run by every rank: every collective x every data
//! type x every reduction op x counts {0, 1, 7, 1023, just above the
//! shared-memory ring}, in place and out of place, each result checked element
//! by element against [`crate::data`]'s reference, outputs poisoned
//! beforehand.

use crate::data::{Val, decode, encode, input_seed, matches, premul_scalar, reduce_ref, value};
use libcomm::{Communicator, DataType, Group, Op, ReduceOp};
use std::time::Instant;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Coll {
    AllReduce,
    Reduce,
    ReduceScatter,
    AllGather,
    Broadcast,
    AllToAll,
    SendRecv,
    Gather,
    Scatter,
}

pub const COLLS: [Coll; 9] = [
    Coll::AllReduce,
    Coll::Reduce,
    Coll::ReduceScatter,
    Coll::AllGather,
    Coll::Broadcast,
    Coll::AllToAll,
    Coll::SendRecv,
    Coll::Gather,
    Coll::Scatter,
];

impl Coll {
    pub fn reduces(self) -> bool {
        matches!(self, Coll::AllReduce | Coll::Reduce | Coll::ReduceScatter)
    }
}

pub fn ops(dt: DataType, rank: usize) -> Vec<ReduceOp> {
    let mut v = ReduceOp::BUILTIN.to_vec();
    v.push(ReduceOp::PreMulSum(premul_scalar(dt, rank)));
    v
}

/// Counts per rank block: 0, 1, 7, 1023, and one of `big_bytes` of data plus
/// three elements.
pub fn counts(dt: DataType, big_bytes: usize) -> [usize; 5] {
    [0, 1, 7, 1023, big_bytes / dt.size() + 3]
}

/// The largest count's bytes: the shared-memory ring's capacity
/// (`WEFT_SHM_RING_BYTES`, else libcomm's largest default, 1 MiB), so that
/// every large message wraps its ring and waits on its reader, and spans more
/// than one 256 KiB transport piece. The tests shrink the ring to keep the
/// reference's work (n x count values per element for reduce-scatter) small
/// on a 2-core machine without losing either.
pub fn big_bytes() -> usize {
    libcomm::Config::from_env()
        .ok()
        .and_then(|c| c.shm_ring_bytes)
        .unwrap_or(1 << 20)
}

const POISON: u8 = 0xA5;

/// FNV-1a over 8-byte words (and the tail), to compare outputs across ranks.
fn fnv(b: &[u8]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    let mut words = b.chunks_exact(8);
    for w in &mut words {
        h = (h ^ u64::from_ne_bytes(w.try_into().unwrap())).wrapping_mul(0x0100_0000_01b3);
    }
    for &x in words.remainder() {
        h = (h ^ x as u64).wrapping_mul(0x0100_0000_01b3);
    }
    h
}

pub struct Case {
    pub id: u64,
    pub coll: Coll,
    pub dt: DataType,
    pub op: Option<ReduceOp>,
    pub count: usize,
    pub inplace: bool,
}

impl std::fmt::Display for Case {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "case #{} {:?} {} {} count={} {}",
            self.id,
            self.coll,
            self.dt,
            self.op.map(|o| o.name()).unwrap_or("-"),
            self.count,
            if self.inplace {
                "in-place"
            } else {
                "out-of-place"
            }
        )
    }
}

pub struct Runner<'a> {
    pub comm: &'a Communicator,
    pub seed: u64,
    /// Wall time spent inside libcomm calls vs. building inputs and checking.
    pub in_calls: std::cell::Cell<std::time::Duration>,
    /// CPU seconds of this thread: [input generation, calls, checking].
    pub cpu: std::cell::Cell<[f64; 3]>,
}

/// CPU time of the calling thread, in seconds.
pub fn thread_cpu() -> f64 {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) };
    t.tv_sec as f64 + t.tv_nsec as f64 * 1e-9
}

impl Runner<'_> {
    fn input(&self, c: &Case, rank: usize, len: usize) -> Vec<u8> {
        let es = c.dt.size();
        let seed = input_seed(self.seed, c.id, rank);
        let mut b = vec![0u8; len * es];
        for i in 0..len {
            encode(
                c.dt,
                value(c.dt, c.op, seed, i),
                &mut b[i * es..(i + 1) * es],
            );
        }
        b
    }

    fn elem(&self, c: &Case, rank: usize, i: usize) -> Val {
        value(c.dt, c.op, input_seed(self.seed, c.id, rank), i)
    }

    #[inline]
    fn elem_s(&self, c: &Case, seed: u64, i: usize) -> Val {
        value(c.dt, c.op, seed, i)
    }

    /// Runs one case; returns a description of the first mismatches, if any.
    pub fn run(&self, c: &Case) -> Result<(), String> {
        let (n, me) = (self.comm.count(), self.comm.rank());
        let (cnt, es, dt) = (c.count, c.dt.size(), c.dt);
        let root = (c.id as usize) % n;
        let op = c.op.unwrap_or(ReduceOp::Sum);
        let err = |e: libcomm::Error| format!("{c}: call failed: {e}");
        let in_len = match c.coll {
            Coll::ReduceScatter | Coll::AllToAll => n * cnt,
            Coll::Scatter if me == root => n * cnt,
            Coll::Scatter => 0,
            _ => cnt,
        };
        let out_len = match c.coll {
            Coll::AllGather | Coll::AllToAll => n * cnt,
            Coll::Gather if me == root => n * cnt,
            _ => cnt,
        };
        let c0 = thread_cpu();
        let input = self.input(c, me, in_len);
        let c1 = thread_cpu();
        let mut out = vec![POISON; out_len.max(in_len) * es];
        let (ip, op_ptr) = (input.as_ptr(), out.as_mut_ptr());
        let t_call = Instant::now();
        let res = unsafe {
            match (c.coll, c.inplace) {
                (Coll::AllReduce, false) => {
                    self.comm.submit(Op::all_reduce(ip, op_ptr, cnt, dt, op))
                }
                (Coll::AllReduce, true) => {
                    out[..input.len()].copy_from_slice(&input);
                    self.comm
                        .submit(Op::all_reduce(op_ptr, op_ptr, cnt, dt, op))
                }
                (Coll::Reduce, false) => {
                    self.comm.submit(Op::reduce(ip, op_ptr, cnt, dt, op, root))
                }
                (Coll::Reduce, true) => {
                    out[..input.len()].copy_from_slice(&input);
                    self.comm
                        .submit(Op::reduce(op_ptr, op_ptr, cnt, dt, op, root))
                }
                (Coll::ReduceScatter, false) => self
                    .comm
                    .submit(Op::reduce_scatter(ip, op_ptr, cnt, dt, op)),
                (Coll::ReduceScatter, true) => {
                    out[..input.len()].copy_from_slice(&input);
                    self.comm.submit(Op::reduce_scatter(
                        op_ptr,
                        op_ptr.add(me * cnt * es),
                        cnt,
                        dt,
                        op,
                    ))
                }
                (Coll::AllGather, false) => self.comm.submit(Op::all_gather(ip, op_ptr, cnt, dt)),
                (Coll::AllGather, true) => {
                    out[me * cnt * es..(me + 1) * cnt * es].copy_from_slice(&input);
                    self.comm
                        .submit(Op::all_gather(op_ptr.add(me * cnt * es), op_ptr, cnt, dt))
                }
                (Coll::Broadcast, false) => {
                    self.comm.submit(Op::broadcast(ip, op_ptr, cnt, dt, root))
                }
                (Coll::Broadcast, true) => {
                    if me == root {
                        out[..input.len()].copy_from_slice(&input);
                    }
                    self.comm
                        .submit(Op::broadcast(op_ptr, op_ptr, cnt, dt, root))
                }
                (Coll::AllToAll, false) => self.comm.submit(Op::all_to_all(ip, op_ptr, cnt, dt)),
                (Coll::AllToAll, true) => {
                    out[..input.len()].copy_from_slice(&input);
                    self.comm.submit(Op::all_to_all(op_ptr, op_ptr, cnt, dt))
                }
                (Coll::SendRecv, false) => {
                    // Ring exchange as two grouped calls posted send-first.
                    let mut g = Group::new();
                    g.push(self.comm, Op::send(ip, cnt, dt, (me + 1) % n))
                        .and_then(|g| {
                            g.push(self.comm, Op::recv(op_ptr, cnt, dt, (me + n - 1) % n))
                        })
                        .map_err(err)?;
                    g.execute()
                }
                (Coll::SendRecv, true) => {
                    // Receive posted before the send: a group must not care.
                    let mut g = Group::new();
                    g.push(self.comm, Op::recv(op_ptr, cnt, dt, (me + n - 1) % n))
                        .and_then(|g| g.push(self.comm, Op::send(ip, cnt, dt, (me + 1) % n)))
                        .map_err(err)?;
                    g.execute()
                }
                (Coll::Gather, false) => self.comm.submit(Op::gather(ip, op_ptr, cnt, dt, root)),
                (Coll::Gather, true) => {
                    let at = if me == root { me * cnt * es } else { 0 };
                    out[at..at + input.len()].copy_from_slice(&input);
                    self.comm
                        .submit(Op::gather(op_ptr.add(at), op_ptr, cnt, dt, root))
                }
                (Coll::Scatter, false) => self.comm.submit(Op::scatter(ip, op_ptr, cnt, dt, root)),
                (Coll::Scatter, true) => {
                    out[..input.len()].copy_from_slice(&input);
                    let recv = if me == root {
                        op_ptr.add(me * cnt * es)
                    } else {
                        op_ptr
                    };
                    self.comm.submit(Op::scatter(op_ptr, recv, cnt, dt, root))
                }
            }
        };
        self.in_calls.set(self.in_calls.get() + t_call.elapsed());
        let c2 = thread_cpu();
        let mut acc = self.cpu.get();
        acc[0] += c1 - c0;
        acc[1] += c2 - c1;
        self.cpu.set(acc);
        res.map_err(err)?;
        // Where this rank's result is, how long, and what each element must be.
        let (res_off, res_len) = match (c.coll, c.inplace) {
            (Coll::ReduceScatter, true) => (me * cnt, cnt),
            (Coll::Reduce, _) if me != root => return Ok(()),
            (Coll::Gather, _) if me != root => return Ok(()),
            (Coll::Scatter, true) if me == root => (me * cnt, cnt),
            _ => (0, out_len),
        };
        // All-reduce leaves bit-identical results on every rank: one rank
        // (rotating with the case) checks against the reference, and every
        // rank proves its output equals the others' by a hash exchange.
        if c.coll == Coll::AllReduce && n > 1 && res_len > 0 {
            let h = fnv(&out[..res_len * es]);
            let mut both = [h, !h];
            self.comm
                .all_reduce_in_place(&mut both, ReduceOp::Max)
                .map_err(|e| format!("{c}: hash exchange failed: {e}"))?;
            if both[0] != h || !both[1] != h {
                return Err(format!(
                    "{c} on rank {me}/{n}: results differ between ranks"
                ));
            }
            if (c.id as usize) % n != me {
                return Ok(());
            }
        }
        let seeds: Vec<u64> = (0..n).map(|r| input_seed(self.seed, c.id, r)).collect();
        let mut bad = Vec::new();
        let mut checked = 0usize;
        for j in 0..res_len {
            let got = decode(dt, &out[(res_off + j) * es..(res_off + j + 1) * es]);
            let (want, tol) = match c.coll {
                Coll::AllReduce | Coll::Reduce => {
                    reduce_ref(dt, op, n, |r| self.elem_s(c, seeds[r], j))
                }
                Coll::ReduceScatter => {
                    reduce_ref(dt, op, n, |r| self.elem_s(c, seeds[r], me * cnt + j))
                }
                Coll::AllGather | Coll::Gather => (self.elem(c, j / cnt, j % cnt), 0.0),
                Coll::Broadcast => (self.elem(c, root, j), 0.0),
                Coll::AllToAll => (self.elem(c, j / cnt, me * cnt + j % cnt), 0.0),
                Coll::SendRecv => (self.elem(c, (me + n - 1) % n, j), 0.0),
                Coll::Scatter => (self.elem(c, root, me * cnt + j), 0.0),
            };
            checked += 1;
            if !matches(got, want, tol) && bad.len() < 5 {
                bad.push(format!("  [{j}] got {got:?} want {want:?} (tol {tol:e})"));
            }
        }
        let mut acc = self.cpu.get();
        acc[2] += thread_cpu() - c2;
        self.cpu.set(acc);
        if bad.is_empty() {
            Ok(())
        } else {
            Err(format!(
                "{c} on rank {me}/{n}: wrong results ({checked} checked):\n{}",
                bad.join("\n")
            ))
        }
    }
}

/// Runs the whole matrix (optionally only the collectives in `only` and the
/// types in `types`). Returns (cases run, failures).
pub fn run_all(
    comm: &Communicator,
    seed: u64,
    only: &[Coll],
    types: &[DataType],
) -> (usize, Vec<String>) {
    let r = Runner {
        comm,
        seed,
        in_calls: Default::default(),
        cpu: Default::default(),
    };
    let mut id = 0u64;
    let mut fails = Vec::new();
    let start = Instant::now();
    let big = big_bytes();
    for coll in COLLS
        .into_iter()
        .filter(|c| only.is_empty() || only.contains(c))
    {
        let t = Instant::now();
        let mut n_cases = 0;
        for dt in DataType::ALL
            .into_iter()
            .filter(|d| types.is_empty() || types.contains(d))
        {
            let op_list: Vec<Option<ReduceOp>> = if coll.reduces() {
                ops(dt, comm.rank()).into_iter().map(Some).collect()
            } else {
                vec![None]
            };
            for op in op_list {
                for count in counts(dt, big) {
                    for inplace in [false, true] {
                        id += 1;
                        n_cases += 1;
                        let c = Case {
                            id,
                            coll,
                            dt,
                            op,
                            count,
                            inplace,
                        };
                        if let Err(e) = r.run(&c) {
                            fails.push(e);
                            if fails.len() >= 10 || comm.async_error().is_err() {
                                return (id as usize, fails);
                            }
                        }
                    }
                }
            }
        }
        if comm.rank() == 0 {
            let cpu = r.cpu.take();
            eprintln!(
                "{coll:?}: {n_cases} cases in {:.2?} ({:.2?} in calls; cpu s: gen {:.2} calls {:.2} check {:.2})",
                t.elapsed(),
                r.in_calls.take(),
                cpu[0],
                cpu[1],
                cpu[2]
            );
        }
    }
    if comm.rank() == 0 {
        eprintln!("matrix: {id} cases in {:.2?}", start.elapsed());
    }
    (id as usize, fails)
}
