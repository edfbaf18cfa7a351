//! A CPU model of the kernels' abort protocol (`kernels/collectives.cu`),
//! for CI: every wait point of every device algorithm, a rank that dies or
//! freezes there or an abort that lands there, and random schedules; every
//! surviving rank's every thread must return (no schedule leaves a survivor
//! spinning), and kernels still queued or launched after the abort return too.
//!
//! What is modelled, from the CUDA source (the names are its names):
//! - memory: the flag words the kernels wait on (barrier flags
//!   `flags[block][rank]`, chain tails and credits, the broadcast pipeline's
//!   progress counters, lines-chain lines and credits, LL lines and
//!   `WEFT_LL_COUNT`, the point-to-point ready/done/count/tail/credit/rready
//!   words), with the values the kernels store (sequence numbers, tags
//!   `seq << 32 | step`, LL flags);
//! - each rank's kernels as thread programs, in stream order, built from the
//!   host's arguments as `launch.rs` builds them (sequence numbers per
//!   kind, `LlHistory` for LL reuse, point-to-point sequence numbers and
//!   block counts);
//! - `wait_geq`, `lines_recv` and `ld_ll`: poll until the condition holds;
//!   every `K` unsuccessful polls read the rank's own abort word (its own
//!   `Status`: every rank has one, fired by its own process's watch) and
//!   leave as the call site does (return; a predicate the block ORs at its
//!   next barrier, `__syncthreads_or`, then every thread returns; or the
//!   result ignored);
//! - `__syncthreads` strictly: it completes only when every thread of the
//!   block is at it. A thread that has exited never arrives, so nothing may
//!   depend on how the hardware counts exited threads (the LL kernel used
//!   to: see `ll_oneshot`'s `ok`);
//! - warps as one thread (`lines_recv` and `warp_wait_geq` agree through
//!   `__any_sync`/`__shfl_sync`: the warp moves together);
//! - the host: each rank launches its operations in order while its
//!   communicator is not Failed; the device watch fires the word, then marks
//!   the communicator Failed (`CommShared::poll_peers`), so a launch may slip
//!   in between; a frozen peer is noticed through a survivor's wait that
//!   made no progress (`Status.stalled`), which the watch raises.
//!
//! Not modelled: data (only flags), the eager send's side stream (its kernel
//! is the same send kernel), several blocks where blocks are symmetric.

use super::abi::{K_ALLREDUCE, K_BROADCAST, K_REDUCE};
use super::ll::{LlHistory, ll_peers};
use std::collections::HashMap;

/// Polls between two reads of the abort word (1024 on the GPU).
const K: u32 = 3;

#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
enum Loc {
    /// `flags[block][from]` in `owner`'s flag area (the barrier).
    Bar {
        owner: usize,
        block: usize,
        from: usize,
    },
    Tail {
        owner: usize,
        block: usize,
    },
    Cred {
        owner: usize,
        block: usize,
    },
    Prog {
        owner: usize,
        block: usize,
    },
    LinesCred {
        owner: usize,
        warp: usize,
    },
    Line {
        owner: usize,
        warp: usize,
        slot: usize,
    },
    LlLine {
        owner: usize,
        par: usize,
        from: usize,
        v: usize,
    },
    LlCount {
        owner: usize,
    },
    Ready {
        owner: usize,
        from: usize,
    },
    Done {
        owner: usize,
        from: usize,
    },
    Count {
        owner: usize,
        from: usize,
    },
    PTail {
        owner: usize,
        from: usize,
        block: usize,
    },
    PCred {
        owner: usize,
        from: usize,
        block: usize,
    },
    RReady {
        owner: usize,
        from: usize,
    },
}

#[derive(Clone, Copy, Debug)]
enum Cmp {
    Geq(u64),
    Eq(u64),
}

/// What a wait's caller does when the wait returns false (aborted).
#[derive(Clone, Copy, Debug)]
enum OnAbort {
    /// `return` from the kernel (this thread or warp exits).
    Return,
    /// This thread's predicate, then skip `skip` instructions (the
    /// short-circuit of `wait_progress`); the block agrees next
    /// (`__syncthreads_or`).
    Stop { skip: usize },
    /// The result is not looked at (a final drain: the kernel ends).
    Ignore,
    /// LL: `ok = false`, jump to instruction `to` (the block barrier).
    Break { to: usize },
}

#[derive(Clone, Copy, Debug)]
enum Ins {
    St(Loc, u64),
    /// The last receiving block: `prev + 1 == last` raises `flag` to `val`.
    AddSignal {
        count: Loc,
        last: u64,
        flag: Loc,
        val: u64,
    },
    Wait {
        at: Loc,
        cmp: Cmp,
        on_abort: OnAbort,
    },
    /// `__syncthreads()`.
    Sync,
    /// `__syncthreads_or(predicate)`: the block's verdict for every thread
    /// (the point-to-point receives' shared `stop`, written by thread 0
    /// only and read after the barrier, amounts to the same).
    SyncOr,
    /// `if (verdict) return`.
    ReturnIfStop,
    /// LL: the predicate is `!ok`.
    PredicateNotOk,
    /// LL: thread 0, `if (!broke)` count the block.
    AddUnlessStop(Loc),
}

/// One block: a program per thread (every thread meets the same barriers).
type Block = Vec<Vec<Ins>>;
type Kernel = Vec<Block>;

/// An operation, as the host plans it (every rank the same).
#[derive(Clone, Copy, Debug)]
pub(super) enum Spec {
    /// The staged kernel (ranks in other processes): `chunks` chunks, one
    /// barrier each (two for two-shot), then the exit barrier.
    Staged { chunks: u64, two_shot: bool },
    /// Direct (one process): entry barrier, (second barrier for two-shot),
    /// exit barrier.
    Direct { two_shot: bool },
    /// Direct broadcast as the ring pipeline of `steps` steps.
    BcastRing { root: usize, steps: u64 },
    /// Direct broadcast as the scatter pipeline: the root raises every
    /// other rank's counter each step, they wait on theirs.
    BcastScatter { root: usize, steps: u64 },
    /// FIFO chain: `steps` steps through `slots` slots.
    Chain {
        bcast: bool,
        root: usize,
        steps: u64,
        slots: u64,
    },
    /// Lines chain: `iters` iterations per warp, window `window`.
    Lines {
        bcast: bool,
        root: usize,
        iters: u64,
        window: u64,
    },
    /// LL one-shot of `kind` (all-reduce, broadcast, reduce).
    Ll { kind: i32, root: usize },
    /// A point-to-point round in one process: send to r + `to`, receive
    /// from r - `to` (all-to-all: every offset), `nb` blocks per receive.
    P2p {
        offsets: &'static [usize],
        nb: usize,
    },
    /// The same across processes (FIFO through the receiver's scratch).
    P2pFifo {
        offsets: &'static [usize],
        steps: u64,
        slots: u64,
    },
}

/// The host's per-rank launch state (`launch.rs`).
#[derive(Clone)]
struct Host {
    seq: u64,
    ll: LlHistory,
    ll_ops: u64,
    send_seq: Vec<u64>,
    recv_seq: Vec<u64>,
    recv_blocks: Vec<u64>,
}

/// `barrier(a, value)` of block 0 for `nt` threads (`n` of them work);
/// `ret`: `BARRIER` (return on abort) or the ignored exit barrier.
fn barrier(prog: &mut [Vec<Ins>], r: usize, n: usize, value: u64, ret: bool) {
    for (t, p) in prog.iter_mut().enumerate() {
        p.push(Ins::Sync);
        if t < n {
            p.push(Ins::St(
                Loc::Bar {
                    owner: t,
                    block: 0,
                    from: r,
                },
                value,
            ));
            p.push(Ins::Wait {
                at: Loc::Bar {
                    owner: r,
                    block: 0,
                    from: t,
                },
                cmp: Cmp::Geq(value),
                on_abort: OnAbort::Stop { skip: 0 },
            });
        }
        p.push(Ins::SyncOr);
        if ret {
            p.push(Ins::ReturnIfStop);
        }
    }
}

/// `wait_progress(status, p, v, p2, v2)`: thread 0 waits, the block agrees.
fn wait_progress(prog: &mut [Vec<Ins>], waits: &[(Loc, u64)]) {
    for (t, p) in prog.iter_mut().enumerate() {
        if t == 0 {
            for (i, &(at, v)) in waits.iter().enumerate() {
                p.push(Ins::Wait {
                    at,
                    cmp: Cmp::Geq(v),
                    on_abort: OnAbort::Stop {
                        skip: waits.len() - 1 - i,
                    },
                });
            }
        }
        p.push(Ins::SyncOr);
        p.push(Ins::ReturnIfStop);
    }
}

/// `signal_progress(p, v, credit)`.
fn signal_progress(prog: &mut [Vec<Ins>], stores: &[(Loc, u64)]) {
    for (t, p) in prog.iter_mut().enumerate() {
        p.push(Ins::Sync);
        if t == 0 {
            p.extend(stores.iter().map(|&(l, v)| Ins::St(l, v)));
        }
    }
}

/// The kernel rank `r` of `n` launches for `spec`, advancing its host state
/// as `launch.rs` does. `old_ll`: the LL kernel as it was (threads return
/// at an aborted line wait), to show the model finds what that risked.
fn kernel(spec: Spec, r: usize, n: usize, h: &mut Host, old_ll: bool) -> Kernel {
    let nt = n.max(2);
    let mut b: Block = vec![Vec::new(); nt];
    let (pred, succ) = ((r + n - 1) % n, (r + 1) % n);
    match spec {
        Spec::Staged { chunks, two_shot } => {
            let s0 = h.seq + 1;
            for c in 0..chunks {
                barrier(&mut b, r, n, 2 * (s0 + c), true);
                if two_shot {
                    barrier(&mut b, r, n, 2 * (s0 + c) + 1, true);
                }
            }
            barrier(&mut b, r, n, 2 * (s0 + chunks), false);
            h.seq += chunks + 1;
        }
        Spec::Direct { two_shot } => {
            let s = h.seq + 1;
            barrier(&mut b, r, n, 2 * s, true);
            if two_shot {
                barrier(&mut b, r, n, 2 * s + 1, true);
            }
            barrier(&mut b, r, n, 2 * s + 2, false);
            h.seq += 2;
        }
        Spec::BcastScatter { root, steps } => {
            let s = h.seq + 1;
            let tag = s << 32;
            barrier(&mut b, r, n, 2 * s, true);
            if r == root {
                for j in 0..steps {
                    let st: Vec<(Loc, u64)> = (0..n)
                        .filter(|&q| q != root)
                        .map(|q| (Loc::Prog { owner: q, block: 0 }, tag | (j + 1)))
                        .collect();
                    signal_progress(&mut b, &st);
                }
            } else {
                for j in 0..steps {
                    wait_progress(&mut b, &[(Loc::Prog { owner: r, block: 0 }, tag | (j + 1))]);
                }
            }
            barrier(&mut b, r, n, 2 * s + 2, false);
            h.seq += 2;
        }
        Spec::BcastRing { root, steps } => {
            let s = h.seq + 1;
            let tag = s << 32;
            barrier(&mut b, r, n, 2 * s, true);
            let pos = (r + n - root) % n;
            if pos != 0 {
                for j in 0..steps {
                    if pos > 1 {
                        wait_progress(&mut b, &[(Loc::Prog { owner: r, block: 0 }, tag | (j + 1))]);
                    }
                    if pos < n - 1 {
                        signal_progress(
                            &mut b,
                            &[(
                                Loc::Prog {
                                    owner: succ,
                                    block: 0,
                                },
                                tag | (j + 1),
                            )],
                        );
                    }
                }
            }
            barrier(&mut b, r, n, 2 * s + 2, false);
            h.seq += 2;
        }
        Spec::Chain {
            bcast,
            root,
            steps,
            slots,
        } => {
            let s = h.seq + 1;
            let tag = s << 32;
            barrier(&mut b, r, n, 2 * s, true);
            let first = if bcast { root } else { (root + 1) % n };
            let pos = (r + n - first) % n;
            let (has_pred, has_succ) = (pos > 0, pos < n - 1);
            for j in 0..steps {
                let mut w = Vec::new();
                if has_pred {
                    w.push((Loc::Tail { owner: r, block: 0 }, tag | (j + 1)));
                }
                if has_succ && j >= slots {
                    w.push((Loc::Cred { owner: r, block: 0 }, tag | (j + 1 - slots)));
                }
                wait_progress(&mut b, &w);
                let mut st = Vec::new();
                if has_succ {
                    st.push((
                        Loc::Tail {
                            owner: succ,
                            block: 0,
                        },
                        tag | (j + 1),
                    ));
                }
                if has_pred {
                    st.push((
                        Loc::Cred {
                            owner: pred,
                            block: 0,
                        },
                        tag | (j + 1),
                    ));
                }
                signal_progress(&mut b, &st);
            }
            if has_succ && steps > 0 {
                b[0].push(Ins::Wait {
                    at: Loc::Cred { owner: r, block: 0 },
                    cmp: Cmp::Geq(tag | steps),
                    on_abort: OnAbort::Ignore,
                });
            }
            h.seq += 1;
        }
        Spec::Lines {
            bcast,
            root,
            iters,
            window,
        } => {
            // One warp, as one thread (no block barrier in lines_chain).
            let tag = (h.seq + 1) << 32;
            let first = if bcast { root } else { (root + 1) % n };
            let pos = (r + n - first) % n;
            let (has_pred, has_succ) = (pos > 0, pos < n - 1);
            let every = (window / 2).max(1);
            let mut p = Vec::new();
            for k in 0..iters {
                if has_succ && k >= window {
                    p.push(Ins::Wait {
                        at: Loc::LinesCred { owner: r, warp: 0 },
                        cmp: Cmp::Geq(tag | (k + 1 - window)),
                        on_abort: OnAbort::Return,
                    });
                }
                let slot = (k % window) as usize;
                if has_pred {
                    p.push(Ins::Wait {
                        at: Loc::Line {
                            owner: r,
                            warp: 0,
                            slot,
                        },
                        cmp: Cmp::Eq(tag | (k + 1)),
                        on_abort: OnAbort::Return,
                    });
                }
                if has_succ {
                    p.push(Ins::St(
                        Loc::Line {
                            owner: succ,
                            warp: 0,
                            slot,
                        },
                        tag | (k + 1),
                    ));
                }
                if has_pred && ((k + 1) % every == 0 || k + 1 == iters) {
                    p.push(Ins::St(
                        Loc::LinesCred {
                            owner: pred,
                            warp: 0,
                        },
                        tag | (k + 1),
                    ));
                }
            }
            if has_succ && iters > 0 {
                p.push(Ins::Wait {
                    at: Loc::LinesCred { owner: r, warp: 0 },
                    cmp: Cmp::Geq(tag | iters),
                    on_abort: OnAbort::Ignore,
                });
            }
            b = vec![p];
            h.seq += 1;
        }
        Spec::Ll { kind, root } => {
            // One block of `nt` threads, two vectors (threads 0 and 1).
            let k = h.ll_ops;
            h.ll_ops += 1;
            let (sends, receives) = ll_peers(kind, root, r, n);
            let (check, need) = h.ll.next(sends, receives, 1);
            let f = k % u32::MAX as u64 + 1;
            let par = (k & 1) as usize;
            let nv = 2;
            for (t, p) in b.iter_mut().enumerate() {
                p.push(Ins::Sync);
                if sends != 0 && t < n && (check >> t) & 1 == 1 {
                    p.push(Ins::Wait {
                        at: Loc::LlCount { owner: t },
                        cmp: Cmp::Geq(need),
                        on_abort: OnAbort::Stop { skip: 0 },
                    });
                }
                p.push(Ins::SyncOr);
                p.push(Ins::ReturnIfStop);
                let mut waits_at = Vec::new();
                if t < nv {
                    let v = t;
                    for d in (0..n).filter(|&d| (sends >> d) & 1 == 1) {
                        p.push(Ins::St(
                            Loc::LlLine {
                                owner: d,
                                par,
                                from: r,
                                v,
                            },
                            f,
                        ));
                    }
                    for s in (0..n).filter(|&s| (receives >> s) & 1 == 1) {
                        waits_at.push(p.len());
                        p.push(Ins::Wait {
                            at: Loc::LlLine {
                                owner: r,
                                par,
                                from: s,
                                v,
                            },
                            cmp: Cmp::Eq(f),
                            on_abort: OnAbort::Return, // set below
                        });
                    }
                }
                let end = p.len();
                for i in waits_at {
                    if let Ins::Wait { on_abort, .. } = &mut p[i] {
                        *on_abort = if old_ll {
                            OnAbort::Return
                        } else {
                            OnAbort::Break { to: end }
                        };
                    }
                }
                p.push(Ins::PredicateNotOk);
                p.push(Ins::SyncOr);
                if t == 0 {
                    p.push(Ins::AddUnlessStop(Loc::LlCount { owner: r }));
                }
            }
        }
        Spec::P2p { offsets, nb } => {
            let mut blocks: Kernel = Vec::new();
            // One send to and one receive from each peer per round (a copy
            // to oneself waits for nothing).
            for &o in offsets.iter().filter(|&&o| o > 0 && o < n) {
                let (to, from) = ((r + o) % n, (r + n - o) % n);
                h.send_seq[to] += 1;
                let seq = h.send_seq[to];
                let mut send = Vec::new();
                if seq > 1 {
                    send.push(Ins::Wait {
                        at: Loc::Done { owner: r, from: to },
                        cmp: Cmp::Geq(seq - 1),
                        on_abort: OnAbort::Return,
                    });
                }
                send.push(Ins::St(Loc::Ready { owner: to, from: r }, seq));
                send.push(Ins::Wait {
                    at: Loc::Done { owner: r, from: to },
                    cmp: Cmp::Geq(seq),
                    on_abort: OnAbort::Ignore,
                });
                blocks.push(vec![send]);
                h.recv_seq[from] += 1;
                let rseq = h.recv_seq[from];
                let base = h.recv_blocks[from];
                h.recv_blocks[from] += nb as u64;
                for _ in 0..nb {
                    let mut rb: Block = vec![Vec::new(); 2];
                    rb[0].push(Ins::Wait {
                        at: Loc::Ready { owner: r, from },
                        cmp: Cmp::Geq(rseq),
                        on_abort: OnAbort::Stop { skip: 0 },
                    });
                    for (t, p) in rb.iter_mut().enumerate() {
                        p.push(Ins::SyncOr);
                        p.push(Ins::ReturnIfStop);
                        p.push(Ins::Sync);
                        if t == 0 {
                            p.push(Ins::AddSignal {
                                count: Loc::Count { owner: r, from },
                                last: base + nb as u64,
                                flag: Loc::Done {
                                    owner: from,
                                    from: r,
                                },
                                val: rseq,
                            });
                        }
                    }
                    blocks.push(rb);
                }
            }
            return blocks;
        }
        Spec::P2pFifo {
            offsets,
            steps,
            slots,
        } => {
            let mut blocks: Kernel = Vec::new();
            for &o in offsets.iter().filter(|&&o| o > 0 && o < n) {
                let (to, from) = ((r + o) % n, (r + n - o) % n);
                h.send_seq[to] += 1;
                let seq = h.send_seq[to];
                let tag = seq << 32;
                let mut sb: Block = vec![Vec::new(); 2];
                wait_progress(&mut sb, &[(Loc::RReady { owner: r, from: to }, seq)]);
                for j in 0..steps {
                    if j >= slots {
                        wait_progress(
                            &mut sb,
                            &[(
                                Loc::PCred {
                                    owner: r,
                                    from: to,
                                    block: 0,
                                },
                                tag | (j + 1 - slots),
                            )],
                        );
                    }
                    signal_progress(
                        &mut sb,
                        &[(
                            Loc::PTail {
                                owner: to,
                                from: r,
                                block: 0,
                            },
                            tag | (j + 1),
                        )],
                    );
                }
                if steps > 0 {
                    sb[0].push(Ins::Wait {
                        at: Loc::PCred {
                            owner: r,
                            from: to,
                            block: 0,
                        },
                        cmp: Cmp::Geq(tag | steps),
                        on_abort: OnAbort::Ignore,
                    });
                }
                blocks.push(sb);
                h.recv_seq[from] += 1;
                let rseq = h.recv_seq[from];
                let rtag = rseq << 32;
                let mut rb: Block = vec![Vec::new(); 2];
                rb[0].push(Ins::St(
                    Loc::RReady {
                        owner: from,
                        from: r,
                    },
                    rseq,
                ));
                for j in 0..steps {
                    rb[0].push(Ins::Wait {
                        at: Loc::PTail {
                            owner: r,
                            from,
                            block: 0,
                        },
                        cmp: Cmp::Geq(rtag | (j + 1)),
                        on_abort: OnAbort::Stop { skip: 0 },
                    });
                    for p in rb.iter_mut() {
                        p.push(Ins::SyncOr);
                        p.push(Ins::ReturnIfStop);
                    }
                    signal_progress(
                        &mut rb,
                        &[(
                            Loc::PCred {
                                owner: from,
                                from: r,
                                block: 0,
                            },
                            rtag | (j + 1),
                        )],
                    );
                }
                blocks.push(rb);
            }
            return blocks;
        }
    }
    vec![b]
}

/// What happens in a run.
#[derive(Clone, Copy, Debug)]
pub(super) enum Event {
    /// Nothing fails: every rank must finish.
    None,
    /// `victim` dies when it enters its `at`-th wait (counted over its
    /// threads and kernels); the watch of every other rank notices.
    Death { victim: usize, at: usize },
    /// `victim` freezes there (SIGSTOP): noticed only through a survivor's
    /// wait without progress (`Status.stalled`, `WEFT_TIMEOUT_MS`).
    Freeze { victim: usize, at: usize },
    /// Rank `rank`'s word fires when it enters its `at`-th wait
    /// (ncclCommAbort, a failure raised elsewhere); the failure spreads.
    Abort { rank: usize, at: usize },
}

#[derive(Clone, Copy, Default)]
struct Th {
    pc: usize,
    polls: u32,
    /// Abort checks without progress in the current wait.
    checks: u32,
    done: bool,
    ok: bool,
    /// What this thread brings to the next `__syncthreads_or`.
    pred: bool,
    /// What the last `__syncthreads_or` returned.
    verdict: bool,
}

struct Run {
    n: usize,
    mem: HashMap<Loc, u64>,
    /// Per rank: launched kernels not yet finished, the head running.
    stream: Vec<std::collections::VecDeque<(Kernel, Vec<Vec<Th>>)>>,
    word: Vec<bool>,
    failed: Vec<bool>,
    waits: Vec<usize>,
}

/// Checks (abort word reads) without progress after which a wait reports
/// itself stalled (the model's `WEFT_TIMEOUT_MS`).
const STALL_CHECKS: u32 = 20;

fn xorshift(s: &mut u64) -> u64 {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    *s
}

/// What a run did.
pub(super) struct Outcome {
    /// Waits each rank entered (for enumerating wait points).
    waits: Vec<usize>,
    /// The event happened (the victim or rank reached its wait point).
    happened: bool,
    /// Some survivor's word fired.
    fired: bool,
}

/// Runs `ops` on `n` ranks under `event` and schedule `seed`. Err: what
/// hung.
pub(super) fn run(
    n: usize,
    ops: &[Spec],
    event: Event,
    seed: u64,
    old_ll: bool,
) -> Result<Outcome, String> {
    let mut kernels: Vec<Vec<Kernel>> = Vec::new();
    for r in 0..n {
        let mut h = Host {
            seq: 0,
            ll: LlHistory::default(),
            ll_ops: 0,
            send_seq: vec![0; n],
            recv_seq: vec![0; n],
            recv_blocks: vec![0; n],
        };
        kernels.push(
            ops.iter()
                .map(|&s| kernel(s, r, n, &mut h, old_ll))
                .collect(),
        );
    }
    let mut st = Run {
        n,
        mem: HashMap::new(),
        stream: vec![Default::default(); n],
        word: vec![false; n],
        failed: vec![false; n],
        waits: vec![0; n],
    };
    let mut launched = vec![0usize; n];
    let mut rng = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let victim = match event {
        Event::Death { victim, .. } | Event::Freeze { victim, .. } => Some(victim),
        _ => None,
    };
    let mut stopped = false; // the victim stopped (dead or frozen)
    let mut dead = false;
    // When each rank's watch fires its word (steps), once the failure is raised.
    let mut fire_at: Vec<Option<u64>> = vec![None; n];
    let mut raised = false;
    let mut stalled = false;
    let live = |r: usize, stopped: bool| !(stopped && Some(r) == victim);
    for step in 0..400_000u64 {
        // The device watch of each rank: fires the word, then (a step later)
        // the communicator is Failed.
        if !raised
            && (dead
                || stalled
                || matches!(event, Event::Abort { .. }) && st.word.iter().any(|&w| w))
        {
            raised = true;
            for (r, f) in fire_at.iter_mut().enumerate() {
                if live(r, stopped) && f.is_none() {
                    *f = Some(step + xorshift(&mut rng) % 500);
                }
            }
        }
        for (r, at) in fire_at.iter().enumerate() {
            if let Some(t) = *at {
                if step >= t {
                    st.word[r] = true;
                }
                if step >= t + 1 + xorshift(&mut rng) % 4 {
                    st.failed[r] = true;
                }
            }
        }
        // Done: every live rank launched what it will and drained its stream.
        let finished = (0..n)
            .filter(|&r| live(r, stopped))
            .all(|r| (launched[r] == ops.len() || st.failed[r]) && st.stream[r].is_empty());
        if finished {
            if matches!(event, Event::None)
                && (launched.iter().any(|&l| l < ops.len()) || st.word.iter().any(|&w| w))
            {
                return Err(format!(
                    "without a failure, not every operation ran: {launched:?}"
                ));
            }
            let happened = stopped || matches!(event, Event::Abort { .. }) && raised;
            return Ok(Outcome {
                happened,
                fired: st.word.iter().any(|&w| w),
                waits: st.waits,
            });
        }
        // Pick a live rank, then launch or step one of its threads.
        let r = xorshift(&mut rng) as usize % n;
        if !live(r, stopped) {
            continue;
        }
        if launched[r] < ops.len() && !st.failed[r] && xorshift(&mut rng).is_multiple_of(4) {
            let k = kernels[r][launched[r]].clone();
            let th = k
                .iter()
                .map(|b| {
                    vec![
                        Th {
                            ok: true,
                            ..Th::default()
                        };
                        b.len()
                    ]
                })
                .collect();
            st.stream[r].push_back((k, th));
            launched[r] += 1;
            continue;
        }
        let Some((k, mut th)) = st.stream[r].pop_front() else {
            continue;
        };
        let th = &mut th;
        let b = xorshift(&mut rng) as usize % k.len();
        let t = xorshift(&mut rng) as usize % k[b].len();
        let prog = &k[b][t];
        let me = th[b][t];
        if me.done {
            st.stream[r].push_front((k, std::mem::take(th)));
            continue;
        }
        if me.pc >= prog.len() {
            th[b][t].done = true;
        } else {
            match prog[me.pc] {
                Ins::St(l, v) => {
                    st.mem.insert(l, v);
                    th[b][t].pc += 1;
                }
                Ins::AddSignal {
                    count,
                    last,
                    flag,
                    val,
                } => {
                    let c = st.mem.entry(count).or_insert(0);
                    *c += 1;
                    if *c == last {
                        st.mem.insert(flag, val);
                    }
                    th[b][t].pc += 1;
                }
                Ins::Wait { at, cmp, on_abort } => {
                    if me.polls == 0 && me.checks == 0 {
                        // Entering the wait (first poll): a wait point.
                        let w = st.waits[r];
                        st.waits[r] += 1;
                        match event {
                            Event::Death { victim, at } | Event::Freeze { victim, at }
                                if victim == r && at == w =>
                            {
                                stopped = true;
                                dead = matches!(event, Event::Death { .. });
                                st.stream[r].push_front((k, std::mem::take(th)));
                                continue;
                            }
                            Event::Abort { rank, at } if rank == r && at == w => st.word[r] = true,
                            _ => {}
                        }
                    }
                    let v = st.mem.get(&at).copied().unwrap_or(0);
                    let ready = match cmp {
                        Cmp::Geq(x) => v >= x,
                        Cmp::Eq(x) => v == x,
                    };
                    let th = &mut th[b][t];
                    if ready {
                        th.pc += 1;
                        th.polls = 0;
                        th.checks = 0;
                    } else {
                        th.polls += 1;
                        if th.polls == K {
                            th.polls = 0;
                            th.checks += 1;
                            if st.word[r] {
                                th.checks = 0;
                                match on_abort {
                                    OnAbort::Return => th.done = true,
                                    OnAbort::Stop { skip } => {
                                        th.pred = true;
                                        th.pc += 1 + skip;
                                    }
                                    OnAbort::Ignore => th.pc += 1,
                                    OnAbort::Break { to } => {
                                        th.ok = false;
                                        th.pc = to;
                                    }
                                }
                            } else if th.checks >= STALL_CHECKS
                                && matches!(event, Event::Freeze { .. })
                            {
                                // Status.stalled: the watch raises it.
                                stalled = true;
                            }
                        }
                    }
                }
                Ins::Sync | Ins::SyncOr => {
                    // Every thread of the block at a barrier (an exited one
                    // never arrives); `__syncthreads_or` hands every thread
                    // the OR of their predicates.
                    let at_barrier = |p: &Vec<Ins>, x: &Th| {
                        !x.done && matches!(p.get(x.pc), Some(Ins::Sync | Ins::SyncOr))
                    };
                    let all = k[b].iter().zip(&th[b]).all(|(p, x)| at_barrier(p, x));
                    if all {
                        let or = matches!(prog[me.pc], Ins::SyncOr);
                        let verdict = th[b].iter().any(|x| x.pred);
                        for x in th[b].iter_mut() {
                            if or {
                                x.verdict = verdict;
                                x.pred = false;
                            }
                            x.pc += 1;
                        }
                    } else if th[b].iter().any(|x| x.done) {
                        let waiting = k[b]
                            .iter()
                            .zip(th[b].iter())
                            .filter(|(p, x)| at_barrier(p, x))
                            .count();
                        let running = th[b].iter().filter(|x| !x.done).count();
                        if waiting == running {
                            return Err(format!(
                                "rank {r}: block {b} waits at a block barrier for a thread that has exited (word fired: {}), for ever: {:?}",
                                st.word[r],
                                k[b].iter()
                                    .zip(th[b].iter())
                                    .map(|(p, x)| (x.pc, x.done, p.clone()))
                                    .collect::<Vec<_>>()
                            ));
                        }
                    }
                }
                Ins::ReturnIfStop => {
                    if me.verdict {
                        th[b][t].done = true;
                    } else {
                        th[b][t].pc += 1;
                    }
                }
                Ins::PredicateNotOk => {
                    th[b][t].pred = !me.ok;
                    th[b][t].pc += 1;
                }
                Ins::AddUnlessStop(l) => {
                    if !me.verdict {
                        *st.mem.entry(l).or_insert(0) += 1;
                    }
                    th[b][t].pc += 1;
                }
            }
        }
        // The head kernel ended: the stream runs the next.
        if !th.iter().all(|b| b.iter().all(|x| x.done)) {
            st.stream[r].push_front((k, std::mem::take(th)));
        }
    }
    let stuck: Vec<String> = (0..n)
        .filter(|&r| live(r, stopped) && !st.stream[r].is_empty())
        .map(|r| {
            let (k, th) = &st.stream[r][0];
            let at: Vec<String> = th
                .iter()
                .enumerate()
                .flat_map(|(b, ts)| ts.iter().enumerate().map(move |(t, x)| (b, t, *x)))
                .filter(|(_, _, x)| !x.done)
                .map(|(b, t, x)| format!("block {b} thread {t} at {:?}", k[b][t].get(x.pc)))
                .collect();
            format!("rank {r} (word fired: {}): {}", st.word[r], at.join("; "))
        })
        .collect();
    Err(format!(
        "{} rank(s) never finished ({} of {n} ranks): {}",
        stuck.len(),
        st.n,
        stuck.join(" | ")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Sequences of operations that cover every wait point of every kernel,
    /// each operation twice or more (reuse of flags, windows and halves).
    fn cases(n: usize) -> Vec<(&'static str, Vec<Spec>)> {
        vec![
            (
                "staged one-shot, 2 chunks",
                vec![
                    Spec::Staged {
                        chunks: 2,
                        two_shot: false
                    };
                    2
                ],
            ),
            (
                "staged two-shot",
                vec![
                    Spec::Staged {
                        chunks: 1,
                        two_shot: true
                    };
                    2
                ],
            ),
            (
                "direct one-shot and two-shot",
                vec![
                    Spec::Direct { two_shot: false },
                    Spec::Direct { two_shot: true },
                ],
            ),
            (
                "direct broadcast scatter",
                vec![
                    Spec::BcastScatter {
                        root: n - 1,
                        steps: 3
                    };
                    2
                ],
            ),
            (
                "direct broadcast ring",
                vec![
                    Spec::BcastRing {
                        root: 1 % n,
                        steps: 3
                    };
                    2
                ],
            ),
            (
                "FIFO chain broadcast then reduce",
                vec![
                    Spec::Chain {
                        bcast: true,
                        root: 0,
                        steps: 4,
                        slots: 2,
                    },
                    Spec::Chain {
                        bcast: false,
                        root: n - 1,
                        steps: 3,
                        slots: 2,
                    },
                ],
            ),
            (
                "lines chain broadcast then reduce",
                vec![
                    Spec::Lines {
                        bcast: true,
                        root: 0,
                        iters: 5,
                        window: 2,
                    },
                    Spec::Lines {
                        bcast: false,
                        root: 1 % n,
                        iters: 3,
                        window: 2,
                    },
                ],
            ),
            (
                "LL all-reduce, broadcast, reduce",
                vec![
                    Spec::Ll {
                        kind: K_ALLREDUCE,
                        root: 0,
                    },
                    Spec::Ll {
                        kind: K_BROADCAST,
                        root: 0,
                    },
                    Spec::Ll {
                        kind: K_BROADCAST,
                        root: 0,
                    },
                    Spec::Ll {
                        kind: K_REDUCE,
                        root: n - 1,
                    },
                ],
            ),
            (
                "point-to-point ring, one process",
                vec![
                    Spec::P2p {
                        offsets: &[1],
                        nb: 2
                    };
                    2
                ],
            ),
            (
                "grouped all-to-all, one process",
                vec![Spec::P2p {
                    offsets: &[0, 1, 2, 3],
                    nb: 1,
                }],
            ),
            (
                "point-to-point ring, FIFO",
                vec![
                    Spec::P2pFifo {
                        offsets: &[1],
                        steps: 3,
                        slots: 2
                    };
                    2
                ],
            ),
            (
                "grouped all-to-all, FIFO",
                vec![Spec::P2pFifo {
                    offsets: &[1, 2, 3],
                    steps: 2,
                    slots: 1,
                }],
            ),
            (
                "a mix",
                vec![
                    Spec::Direct { two_shot: true },
                    Spec::Ll {
                        kind: K_ALLREDUCE,
                        root: 0,
                    },
                    Spec::Chain {
                        bcast: true,
                        root: 1 % n,
                        steps: 3,
                        slots: 2,
                    },
                    Spec::P2p {
                        offsets: &[1],
                        nb: 1,
                    },
                    Spec::Staged {
                        chunks: 1,
                        two_shot: false,
                    },
                ],
            ),
        ]
    }

    /// Without a failure every operation of every case finishes on every
    /// rank (the model is the protocol, not a toy that hangs by itself).
    #[test]
    fn without_a_failure_every_rank_finishes() {
        for n in [2, 3, 4] {
            for (name, ops) in cases(n) {
                for seed in 0..20 {
                    if let Err(e) = run(n, &ops, Event::None, seed, false) {
                        panic!("{name}, {n} ranks, seed {seed}: {e}");
                    }
                }
            }
        }
    }

    /// A rank dies, freezes, or its word fires at every wait point it
    /// reaches, under several schedules each: every survivor's every
    /// thread returns, queued and late-launched kernels included.
    #[test]
    fn every_wait_returns_when_a_rank_dies_freezes_or_aborts_at_any_wait_point() {
        let (mut runs, mut happened, mut fired) = (0, 0, 0);
        for n in [2, 3, 4, 5] {
            for (name, ops) in cases(n) {
                for victim in 0..n {
                    // Wait points the victim reaches without a failure.
                    let waits = (0..4)
                        .map(|s| run(n, &ops, Event::None, s, false).unwrap().waits[victim])
                        .max()
                        .unwrap();
                    for at in 0..waits {
                        for event in [
                            Event::Death { victim, at },
                            Event::Freeze { victim, at },
                            Event::Abort { rank: victim, at },
                        ] {
                            for seed in 0..4 {
                                runs += 1;
                                match run(n, &ops, event, seed, false) {
                                    Ok(o) => {
                                        happened += o.happened as usize;
                                        fired += o.fired as usize;
                                    }
                                    Err(e) => {
                                        panic!("{name}, {n} ranks, {event:?}, seed {seed}: {e}")
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
        // Wait points are counted on failure-free schedules: most runs
        // must reach theirs, and then a word must fire.
        assert!(runs > 5000, "{runs} runs");
        assert!(
            happened * 10 > runs * 8,
            "{happened} of {runs} runs reached their wait point"
        );
        // (Not always a word: survivors that no longer need the victim
        // finish before anything is raised.)
        assert!(fired * 10 > runs * 8, "{fired} of {runs} runs fired a word");
    }

    /// The model has teeth: the LL kernel as it was (a thread whose line
    /// wait was aborted returned, while the others went on to the block
    /// barrier) depends on exited threads counting at that barrier, which
    /// the model (like the CUDA programming guide) does not grant.
    #[test]
    fn the_model_finds_a_barrier_that_waits_for_an_exited_thread() {
        let ops = [Spec::Ll {
            kind: K_ALLREDUCE,
            root: 0,
        }; 2];
        let found = (0..6).any(|at| {
            (0..20).any(|seed| run(3, &ops, Event::Death { victim: 2, at }, seed, true).is_err())
        });
        assert!(found, "the old LL kernel should hang in the model");
    }
}
