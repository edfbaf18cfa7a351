//! The host-memory executor of the plans: one rank's [`CrossHost`] runs a
//! collective's phases, the network ones through its engine (a thread of the
//! rank), the local ones through a [`LocalMover`].
//!
//! It is what phase 2 does on GPUs with other parts (docs/ARCHITECTURE.md,
//! "Across hosts"): there the local phases are the NVLink kernels and the
//! engine's chunks move through pinned buffers; here everything is host
//! memory and the calling thread waits for each network phase (the engine's
//! done word).

use super::engine::{Engine, EngineConfig, NOTICE_GRACE};
use super::layout::Layout;
use super::links::Links;
use super::local::{LocalMover, Mem, run_local};
use super::plan::{Buf, Coll, Phase, RankPlan, Region, Scaling, Shape, plan, plan_p2p};
use super::program::{Call, CallBuf};
use super::schedule::{Cut, schedule};
use super::stream_words::{DONE, LANDED, READY, StreamWords};
use super::tuner::{self, Choice};
use crate::data::types::{DataType, Element, ReduceOp};
use crate::error::{Error, Result};
use crate::op::backend::JobProgress;
use std::sync::Arc;
use std::time::Duration;

/// One rank's cross-host collectives over host memory.
pub struct CrossHost {
    me: usize,
    layout: Layout,
    engine: Engine,
    /// The engine's words (its `done`, a pipelined job's `ready` and
    /// `landed`).
    words: Arc<StreamWords>,
    local: Box<dyn LocalMover>,
    /// Calls submitted so far (the done word's target).
    calls: u64,
    /// Input chunks and landings of the pipelined calls so far (the
    /// `ready` and `landed` words' values before the next one).
    readies: u64,
    landings: u64,
    /// Forces a shape (tests, measurements); None: the tuner decides.
    pub shape: Option<Shape>,
    /// Forces a chunk size in bytes (tests, measurements).
    pub chunk: Option<usize>,
    /// Whether it runs all-to-all: not when it is connected to its ring
    /// neighbours alone (all-to-all needs every host of its rail).
    pub all_to_all: bool,
    /// Whether it runs sends and receives: only when connected to every
    /// rank of the other hosts.
    pub send_recv: bool,
    /// The plans' scratch buffers, kept from call to call: a fresh buffer
    /// of a large collective's size is mapped and page-faulted in on every
    /// call (measured: a fifth of the time of a 256 MiB all-reduce).
    scratch: Vec<Vec<u128>>,
}

/// Where a plan's buffers are.
struct Bufs {
    /// (buffer, pointer, bytes); the call buffer index is the position.
    list: Vec<(Buf, usize, usize)>,
    esize: usize,
}

impl Bufs {
    fn index(&self, b: Buf) -> usize {
        self.list
            .iter()
            .position(|(x, _, _)| *x == b)
            .unwrap_or_else(|| panic!("the plan names {b:?}, which it has no buffer for"))
    }

    fn at(&self, r: &Region) -> *mut u8 {
        let (_, p, len) = self.list[self.index(r.buf)];
        assert!(
            (r.off + r.count) * self.esize <= len,
            "{r:?} outside its buffer of {len} bytes"
        );
        (p + r.off * self.esize) as *mut u8
    }

    fn call_bufs(&self) -> Vec<CallBuf> {
        self.list
            .iter()
            .map(|&(_, ptr, len)| CallBuf { ptr, len })
            .collect()
    }
}

/// A pipelined device job's collective: its stream's progress and where
/// its input and output are (address, bytes).
struct Pipe {
    progress: Arc<dyn JobProgress>,
    input: (usize, usize),
    output: (usize, usize),
}

/// Ends the words' job when the call is over, however it ends.
struct EndJob<'a>(&'a StreamWords);

impl Drop for EndJob<'_> {
    fn drop(&mut self) {
        self.0.end();
    }
}

impl CrossHost {
    /// Starts the engine over `links` for rank `links.me` of `layout`.
    /// `timeout`: fail a network phase that makes no progress this long.
    pub fn new(
        layout: Layout,
        links: Links,
        local: Box<dyn LocalMover>,
        label: &str,
        timeout: Option<Duration>,
    ) -> Result<CrossHost> {
        let me = links.me;
        let names = (0..layout.n())
            .map(|r| format!("rank {r} (host {})", layout.host(r)))
            .collect();
        let words = Arc::new(StreamWords::default());
        let engine = Engine::start(
            links,
            words.clone(),
            EngineConfig {
                label: label.to_string(),
                rank: me,
                names,
                timeout,
            },
        )?;
        Ok(CrossHost {
            me,
            layout,
            engine,
            words,
            local,
            calls: 0,
            readies: 0,
            landings: 0,
            shape: None,
            chunk: None,
            all_to_all: true,
            send_recv: true,
            scratch: Vec::new(),
        })
    }

    pub fn rank(&self) -> usize {
        self.me
    }

    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// Aborts: the engine releases every waiter, tells the peers, closes.
    pub fn abort(&self) {
        self.engine.abort();
    }

    /// The decision for `coll` of `count` elements of `dtype`.
    pub fn choose(&self, coll: Coll, count: usize, dtype: DataType) -> Choice {
        let bytes = tuner::rule_bytes(coll, count, dtype.size(), self.layout.n());
        let mut c = tuner::decide(coll, bytes, &self.layout);
        if let Some(s) = self.shape.filter(|s| s.fits(coll, &self.layout)) {
            c.shape = s;
            c.connections = tuner::connections(s, &self.layout);
        }
        if let Some(ch) = self.chunk {
            c.chunk = ch;
        }
        c
    }

    /// Runs `coll` (counts as in NCCL) from `send` into `recv`.
    ///
    /// # Safety
    /// `send` and `recv` must be valid for the collective's sizes
    /// ([`Coll::sizes`]) of `dtype`; they may be NCCL's in-place arrangement.
    pub unsafe fn collective(
        &mut self,
        coll: Coll,
        send: *const u8,
        recv: *mut u8,
        count: usize,
        dtype: DataType,
        op: ReduceOp,
    ) -> Result<()> {
        unsafe { self.collective_progressive(coll, send, recv, count, dtype, op, None) }
    }

    /// As [`collective`](Self::collective), for a device job whose stream
    /// is still putting `send` in place and copies `recv` out as it becomes
    /// final (`progress`; None: as `collective`): when the plan is one
    /// network phase (a rank alone on its host), its steps read each input
    /// chunk once it is in place and tell `progress` how far the output is
    /// final as chunks land; otherwise (local phases would read the input
    /// on this thread) it waits for the whole input first. When that wait
    /// is given up (the job is released: an abort) nothing runs and it
    /// returns `Ok`.
    ///
    /// # Safety
    /// As [`collective`](Self::collective); bytes of `send` may be read
    /// as soon as `progress` says they are in place.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn collective_progressive(
        &mut self,
        coll: Coll,
        send: *const u8,
        recv: *mut u8,
        count: usize,
        dtype: DataType,
        op: ReduceOp,
        progress: Option<Arc<dyn JobProgress>>,
    ) -> Result<()> {
        let n = self.layout.n();
        if coll == Coll::AllToAll && !self.all_to_all {
            return Err(Error::InvalidUsage(
                "all-to-all on a cross-host engine connected to its ring neighbours alone".into(),
            ));
        }
        if let Coll::Broadcast { root } | Coll::Reduce { root } = coll
            && root >= n
        {
            return Err(Error::arg(format!("root {root} of {n} ranks")));
        }
        let (ns, nr) = coll.sizes(count, n);
        let es = dtype.size();
        let in_place = ranges_overlap(send as usize, ns * es, recv as usize, nr * es);
        let c = self.choose(coll, count, dtype);
        let sc = Scaling {
            premul: matches!(op, ReduceOp::PreMulSum(_)),
            avg: op == ReduceOp::Avg,
        };
        let p = plan(coll, count, sc, &self.layout, self.me, c.shape, in_place);
        let piped = progress.map(|pr| Pipe {
            progress: pr,
            input: (send as usize, ns * es),
            output: (recv as usize, nr * es),
        });
        let list = vec![
            (Buf::Send(0), send as usize, ns * es),
            (Buf::Recv(0), recv as usize, nr * es),
        ];
        let tag = (u32::from(coll.id()) << 8) | 0x5700_0000;
        unsafe { self.execute(&p, list, dtype, op, c, tag, piped) }
    }

    /// Runs a group of sends (`sends[i]`: peer, buffer, count) and receives.
    ///
    /// # Safety
    /// Every buffer must be valid for its count of `dtype`.
    pub unsafe fn send_recv(
        &mut self,
        sends: &[(usize, *const u8, usize)],
        recvs: &[(usize, *mut u8, usize)],
        dtype: DataType,
    ) -> Result<()> {
        let n = self.layout.n();
        if let Some(p) = sends
            .iter()
            .map(|s| s.0)
            .chain(recvs.iter().map(|r| r.0))
            .find(|&p| p >= n)
        {
            return Err(Error::arg(format!("peer {p} of {n} ranks")));
        }
        let es = dtype.size();
        let p = plan_p2p(
            &self.layout,
            self.me,
            &sends.iter().map(|&(p, _, c)| (p, c)).collect::<Vec<_>>(),
            &recvs.iter().map(|&(p, _, c)| (p, c)).collect::<Vec<_>>(),
        );
        let mut list = Vec::new();
        for (i, &(_, b, c)) in sends.iter().enumerate() {
            list.push((Buf::Send(i as u16), b as usize, c * es));
        }
        for (i, &(_, b, c)) in recvs.iter().enumerate() {
            list.push((Buf::Recv(i as u16), b as usize, c * es));
        }
        // Both ends of a message must cut it into the same chunks, and each
        // knows only its own side of the group (a lone receive has no
        // sends to size anything by): a fixed chunk, small enough that a
        // message of the engine's smallest size spreads over its sockets.
        let c = Choice {
            shape: Shape::Direct,
            connections: 1,
            chunk: self.chunk.unwrap_or(tuner::P2P_CHUNK),
            window: tuner::WINDOW,
        };
        unsafe { self.execute(&p, list, dtype, ReduceOp::Sum, c, 0x5750_0000, None) }
    }

    #[allow(clippy::too_many_arguments)]
    unsafe fn execute(
        &mut self,
        p: &RankPlan,
        mut list: Vec<(Buf, usize, usize)>,
        dtype: DataType,
        op: ReduceOp,
        c: Choice,
        tag: u32,
        piped: Option<Pipe>,
    ) -> Result<()> {
        if let Some(e) = self.engine.error() {
            return Err(e);
        }
        let es = dtype.size();
        // 16-byte aligned scratch, reused (grown when too small).
        let mut scratch = std::mem::take(&mut self.scratch);
        if scratch.len() < p.scratch.len() {
            scratch.resize_with(p.scratch.len(), Vec::new);
        }
        for (s, &n) in scratch.iter_mut().zip(&p.scratch) {
            let words = (n * es).div_ceil(16);
            if s.len() < words {
                *s = vec![0u128; words];
            }
        }
        for (i, s) in scratch.iter_mut().take(p.scratch.len()).enumerate() {
            list.push((
                Buf::Scratch(i as u16),
                s.as_mut_ptr() as usize,
                p.scratch[i] * es,
            ));
        }
        let bufs = Bufs { list, esize: es };
        // A pipelined job's input is read chunk by chunk by its one network
        // phase; any other phase that moves data (a local step, a copy
        // that is not in place) would read it on this thread: the whole
        // input first then, and the output final at the end.
        let piped = match piped {
            Some(pp) if !pipelines(p, &bufs) => match pp.progress.wait_input() {
                true => None,
                false => {
                    self.scratch = scratch;
                    return Ok(());
                }
            },
            pp => pp,
        };
        let at = |r: &Region| bufs.at(r);
        let mem = Mem {
            at: &at,
            esize: es,
            reduce: Some((dtype, op)),
        };
        let mut pending: Option<u64> = None;
        let r = (|| -> Result<()> {
            for ph in &p.phases {
                match ph {
                    Phase::Local(step) => unsafe { run_local(step, self.local.as_mut(), &mem)? },
                    Phase::Net { coll, wait } => {
                        if let Some(t) = pending.take() {
                            self.engine.wait(DONE, t)?;
                        }
                        let locate = |r: &Region| (bufs.index(r.buf), r.off * es);
                        let on = piped.is_some();
                        let cut = Cut {
                            me: self.me,
                            chunk: (c.chunk / es).max(1),
                            esize: es,
                            locate: &locate,
                            ready: on.then_some((READY, self.readies)),
                            landed: on.then_some((LANDED, self.landings)),
                        };
                        let s = schedule(coll, &cut);
                        // The words stand for the job while its call runs
                        // (it is the plan's only phase, waited for below).
                        let _job = piped.as_ref().map(|pp| {
                            let at: Vec<usize> = bufs.list.iter().map(|b| b.1).collect();
                            self.words.begin(
                                pp.progress.clone(),
                                &s.steps,
                                &at,
                                (self.readies, pp.input),
                                (self.landings, pp.output),
                            );
                            let chunks = s
                                .steps
                                .iter()
                                .filter_map(|st| st.ready.map(|r| r.1))
                                .max()
                                .map_or(0, |v| v - self.readies);
                            self.readies += chunks;
                            self.landings += s.landed;
                            said_pipelined(self.me, chunks, s.landed);
                            EndJob(&self.words)
                        });
                        self.calls += 1;
                        self.engine.submit(Call {
                            steps: s.steps,
                            bufs: bufs.call_bufs(),
                            reduce: Some((dtype, op)),
                            tag: tag | (u32::from(coll.kind()) << 16),
                            window: c.window,
                            done: Some((DONE, self.calls)),
                        })?;
                        if *wait || on {
                            self.engine.wait(DONE, self.calls)?;
                        } else {
                            pending = Some(self.calls);
                        }
                    }
                    Phase::Copy { src, dst } => unsafe {
                        let (s, d) = (bufs.at(src), bufs.at(dst));
                        // In place (an all-gather's own block already there).
                        if s != d {
                            std::ptr::copy(s, d, src.count * es)
                        }
                    },
                    Phase::Divide { region, by } => unsafe {
                        crate::data::reduce::divide(dtype, bufs.at(region), region.count, *by)
                    },
                    Phase::Scale { src, dst } => {
                        let ReduceOp::PreMulSum(s) = op else {
                            return Err(Error::Internal("a scale step without PreMulSum".into()));
                        };
                        unsafe {
                            crate::data::reduce::scale(
                                dtype,
                                bufs.at(dst),
                                bufs.at(src),
                                src.count,
                                s,
                            )
                        }
                    }
                }
            }
            if let Some(t) = pending.take() {
                self.engine.wait(DONE, t)?;
            }
            Ok(())
        })();
        if let Err(e) = r {
            // A local phase that timed out may be held up by a stuck rank
            // elsewhere: the engine follows the chain of waits to it. Any
            // other error of a local phase may only be the echo of a failure
            // elsewhere (a local peer that gave up on a remote one): a
            // notice naming the rank that failed first explains it better,
            // so give it a moment to arrive (twice the engine's grace: the
            // rank whose notice explains ours may have waited that long
            // first). Then the peers hear of ours, and the engine lets go of
            // our buffers before they are freed.
            match self.local.stalled_on() {
                Some(on) => self.engine.local_stall(on, e.clone()),
                None => {
                    let t = std::time::Instant::now();
                    while self.engine.error().is_none() && t.elapsed() < 2 * NOTICE_GRACE {
                        std::thread::sleep(Duration::from_millis(5));
                    }
                    self.engine.fail(e.clone());
                }
            }
            self.engine.wait_ended();
            self.scratch = scratch;
            return Err(self.engine.error().unwrap_or(e));
        }
        self.scratch = scratch;
        Ok(())
    }

    // ------------------------------------------------------------ typed

    pub fn all_reduce<T: Element>(
        &mut self,
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        check_len(recv.len(), send.len(), "all_reduce")?;
        unsafe {
            self.collective(
                Coll::AllReduce,
                send.as_ptr().cast(),
                recv.as_mut_ptr().cast(),
                send.len(),
                T::DTYPE,
                op,
            )
        }
    }

    pub fn all_gather<T: Element>(&mut self, send: &[T], recv: &mut [T]) -> Result<()> {
        check_len(recv.len(), send.len() * self.layout.n(), "all_gather")?;
        unsafe {
            self.collective(
                Coll::AllGather,
                send.as_ptr().cast(),
                recv.as_mut_ptr().cast(),
                send.len(),
                T::DTYPE,
                ReduceOp::Sum,
            )
        }
    }

    pub fn reduce_scatter<T: Element>(
        &mut self,
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        check_len(send.len(), recv.len() * self.layout.n(), "reduce_scatter")?;
        unsafe {
            self.collective(
                Coll::ReduceScatter,
                send.as_ptr().cast(),
                recv.as_mut_ptr().cast(),
                recv.len(),
                T::DTYPE,
                op,
            )
        }
    }

    pub fn broadcast<T: Element>(&mut self, send: &[T], recv: &mut [T], root: usize) -> Result<()> {
        check_len(recv.len(), send.len(), "broadcast")?;
        unsafe {
            self.collective(
                Coll::Broadcast { root },
                send.as_ptr().cast(),
                recv.as_mut_ptr().cast(),
                send.len(),
                T::DTYPE,
                ReduceOp::Sum,
            )
        }
    }

    pub fn reduce<T: Element>(
        &mut self,
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
        root: usize,
    ) -> Result<()> {
        check_len(recv.len(), send.len(), "reduce")?;
        unsafe {
            self.collective(
                Coll::Reduce { root },
                send.as_ptr().cast(),
                recv.as_mut_ptr().cast(),
                send.len(),
                T::DTYPE,
                op,
            )
        }
    }

    pub fn all_to_all<T: Element>(&mut self, send: &[T], recv: &mut [T]) -> Result<()> {
        check_len(recv.len(), send.len(), "all_to_all")?;
        let n = self.layout.n();
        if !send.len().is_multiple_of(n) {
            return Err(Error::arg(format!(
                "all_to_all: {} elements do not split over {n} ranks",
                send.len()
            )));
        }
        unsafe {
            self.collective(
                Coll::AllToAll,
                send.as_ptr().cast(),
                recv.as_mut_ptr().cast(),
                send.len() / n,
                T::DTYPE,
                ReduceOp::Sum,
            )
        }
    }
}

/// Says once per process that a device job's call ran chunk by chunk.
fn said_pipelined(me: usize, chunks: u64, landings: u64) {
    static SAID: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if !SAID.swap(true, std::sync::atomic::Ordering::Relaxed) {
        crate::log::info_log!(
            "cross-host engine rank {me}: a device job pipelined: its sends read {chunks} input chunk(s) as its stream puts them in place, {landings} chunk(s) landed tell its stream how far the output is final"
        );
    }
}

/// Whether plan `p` can run pipelined: one network phase, and no other
/// phase that moves bytes (copies in place are none).
fn pipelines(p: &RankPlan, bufs: &Bufs) -> bool {
    let nets = p
        .phases
        .iter()
        .filter(|ph| matches!(ph, Phase::Net { .. }))
        .count();
    nets == 1
        && p.phases.iter().all(|ph| match ph {
            Phase::Net { .. } => true,
            Phase::Copy { src, dst } => bufs.at(src) == bufs.at(dst),
            _ => false,
        })
}

fn check_len(got: usize, want: usize, what: &str) -> Result<()> {
    if got == want {
        Ok(())
    } else {
        Err(Error::arg(format!(
            "{what}: {got} elements where {want} are needed"
        )))
    }
}

fn ranges_overlap(a: usize, alen: usize, b: usize, blen: usize) -> bool {
    alen > 0 && blen > 0 && a < b + blen && b < a + alen
}
