//! The progress engine: drives a set of point-to-point transfers of one
//! communicator to completion.
//!
//! All transfers progress together, non-blockingly, so any set of matched
//! sends and receives completes regardless of order (grouped send/recv, ring
//! steps that send and receive at once). Transfers to the same peer in the same
//! direction run in list order. A send may be *gated* on a receive: it only
//! sends what that receive has delivered (pipelined forwarding).
//!
//! Waiting: spin briefly, then yield, then sleep on this rank's futex doorbell
//! (shared memory) or in poll(2) (TCP), in slices of at most 100 ms, checking
//! for raised failures every iteration and peer liveness every slice. With more
//! local ranks than cores the spin phase is skipped, so oversubscribed jobs
//! (64 ranks on 2 cores) make progress instead of burning their time slices.

use crate::error::{Error, Result};
use crate::progress::resources::{PeerKind, Resources};
use crate::progress::xfer::{Pending, Wait, Xfer};
use crate::transport::futex;
use crate::transport::shm::{FAIL_ERROR, ST_DESTROYED};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// How long the blame probe waits for an endpoint (a dead process's refuses
/// at once; a lost host's never answers).
const BLAME_PROBE: Duration = Duration::from_millis(500);
/// How long a closed connection waits for the closing rank's failure notice
/// when that rank still lives, and when it is gone.
const NOTICE_GRACE: Duration = Duration::from_millis(300);
const NOTICE_GRACE_GONE: Duration = Duration::from_millis(50);

const SLICE: Duration = Duration::from_millis(100);

impl Resources {
    /// Runs `xs` to completion, or fails the communicator and returns why.
    /// The communicator's pending eager sends go first (see `eager.rs`).
    pub(crate) fn exec(&mut self, xs: &mut [Xfer]) -> Result<()> {
        self.exec_with(xs, Wait::Batch).map(|_| ())
    }

    /// [`exec`](Self::exec) with a choice of how long to wait; returns
    /// whether anything moved.
    pub(crate) fn exec_with(&mut self, xs: &mut [Xfer], wait: Wait) -> Result<bool> {
        match self.exec_inner(xs, wait) {
            Ok(made) => Ok(made),
            Err(e) => Err(self.fail(e)),
        }
    }

    fn exec_inner(&mut self, xs: &mut [Xfer], wait: Wait) -> Result<bool> {
        self.check_raised()?;
        self.exec_self(xs)?;
        // Connect before waiting for connections: lower ranks never wait, so
        // lazy connection setup cannot deadlock. (Pending eager sends were
        // connected when they were first issued.)
        for pass_connecting in [true, false] {
            for x in xs.iter() {
                if !x.p.done && (x.peer > self.ctx.rank) == pass_connecting {
                    self.chan(x.peer)?;
                }
            }
        }
        // Per-peer "a transfer in this direction is active" bits, reused.
        let mut busy = std::mem::take(&mut self.busy);
        busy.resize(self.ctx.nranks, 0);
        let mut pre = std::mem::take(&mut self.eager.pending);
        let r = self.progress(&mut pre, xs, &mut busy, wait);
        self.eager.put_back(pre);
        self.busy = busy;
        r
    }

    /// One step of one transfer; `Some(tcp)` while it is not done.
    fn step(&mut self, x: &mut Xfer, limit: usize, made: &mut bool) -> Result<Option<bool>> {
        let peer = x.peer;
        if !x.started {
            let s = &mut self.seqs[peer];
            let c = if x.send { &mut s.send } else { &mut s.recv };
            x.p.seq = *c;
            *c = c.wrapping_add(1);
            x.started = true;
        }
        let chan = self.chans[peer]
            .as_mut()
            .expect("channel established above");
        let step = unsafe {
            if x.send {
                chan.send_step(x.ptr, x.len, limit, &mut x.p)
            } else {
                chan.recv_step(x.ptr, x.len, x.red, &mut x.p)
            }
        };
        match step {
            Ok(m) => *made |= m,
            Err(why)
                if self.kinds[peer] == PeerKind::Tcp && why.starts_with("connection closed") =>
            {
                return Err(self.blame_closed(peer, &why));
            }
            Err(why) => return Err(self.peer_error(peer, &why)),
        }
        Ok((!x.p.done).then(|| chan.is_tcp()))
    }

    /// Drives `pre` (pending eager sends, first) and `xs` (see [`Wait`]).
    fn progress(
        &mut self,
        pre: &mut [Pending],
        xs: &mut [Xfer],
        busy: &mut [u8],
        wait: Wait,
    ) -> Result<bool> {
        let own = self.fault.own.clone();
        let ctrl = own.control();
        let mut idle: u32 = 0;
        let mut last_progress = Instant::now();
        let mut last_check = Instant::now();
        let mut any = false;
        // A peer found dead or destroyed may still have left everything we need
        // in our rings (it finished, then left while we slept): the suspicion
        // becomes an error only if one more pass over the transfers makes no
        // progress.
        let mut suspect: Option<Error> = None;
        let (spin, yields) = self.wait_budget();
        let timeout = match wait {
            Wait::All { timeout } => timeout,
            _ => self.ctx.cfg.timeout,
        };
        // Whether pending eager sends must finish too.
        let want_pre = !matches!(wait, Wait::Batch);
        loop {
            let seen = ctrl.doorbell.load(Ordering::SeqCst);
            self.eager.seen = seen;
            let mut progress = false;
            let mut pending = false;
            let mut tcp_pending = false;
            let mut shm_pending = false;
            for p in pre.iter() {
                busy[p.x.peer] = 0;
            }
            for x in xs.iter() {
                busy[x.peer] = 0;
            }
            let npre = pre.len();
            // One index over both lists (pending sends first).
            #[allow(clippy::needless_range_loop)]
            for i in 0..npre + xs.len() {
                let (x, limit) = if i < npre {
                    let x = &mut pre[i].x;
                    let len = x.len;
                    (x, len)
                } else {
                    let j = i - npre;
                    let limit = match xs[j].gate {
                        Some(g) => xs[g].p.payload,
                        None => xs[j].len,
                    };
                    (&mut xs[j], limit)
                };
                if x.p.done {
                    continue;
                }
                if i >= npre || want_pre {
                    pending = true;
                }
                let bit = if x.send { 1 } else { 2 };
                if busy[x.peer] & bit != 0 {
                    continue;
                }
                busy[x.peer] |= bit;
                match self.step(x, limit, &mut progress)? {
                    None => {}
                    Some(true) => tcp_pending = true,
                    Some(false) => shm_pending = true,
                }
            }
            any |= progress;
            if !pending {
                return Ok(any);
            }
            if let Wait::NoSleep { until } = wait {
                if !progress || until.is_some_and(|t| Instant::now() >= t) {
                    return Ok(any);
                }
                continue;
            }
            if progress {
                idle = 0;
                last_progress = Instant::now();
                suspect = None;
                continue;
            }
            self.check_raised()?;
            if let Some(e) = suspect.take() {
                return Err(e);
            }
            idle += 1;
            if idle < spin {
                std::hint::spin_loop();
                continue;
            }
            if idle < spin + yields {
                std::thread::yield_now();
                continue;
            }
            // Block for a while.
            if tcp_pending {
                let fd_of = |peer: usize, send: bool| {
                    self.chans[peer]
                        .as_ref()
                        .and_then(|c| c.fd())
                        .map(|fd| libc::pollfd {
                            fd,
                            events: if send { libc::POLLOUT } else { libc::POLLIN },
                            revents: 0,
                        })
                };
                let mut fds: Vec<libc::pollfd> = pre
                    .iter()
                    .map(|p| &p.x)
                    .chain(xs.iter())
                    .filter(|x| !x.p.done)
                    .filter_map(|x| fd_of(x.peer, x.send))
                    .collect();
                let ms = if shm_pending {
                    1
                } else {
                    SLICE.as_millis() as i32
                };
                unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
            } else {
                ctrl.sleepers.fetch_add(1, Ordering::SeqCst);
                futex::wait(&ctrl.doorbell, seen, SLICE);
                ctrl.sleepers.fetch_sub(1, Ordering::SeqCst);
            }
            if last_check.elapsed() >= SLICE {
                last_check = Instant::now();
                // The peers this call waits for.
                let waited = pre
                    .iter()
                    .map(|p| &p.x)
                    .filter(|_| want_pre)
                    .chain(xs.iter())
                    .filter(|x| !x.p.done)
                    .map(|x| x.peer);
                if let Err(e) = self.check_peers(waited) {
                    suspect = Some(e);
                    continue;
                }
                if let Some(t) = timeout
                    && last_progress.elapsed() >= t
                {
                    let mut waiting: Vec<String> = xs
                        .iter()
                        .filter(|x| !x.p.done)
                        .map(|x| {
                            format!(
                                "{} rank {}",
                                if x.send {
                                    "sending to"
                                } else {
                                    "receiving from"
                                },
                                x.peer
                            )
                        })
                        .collect();
                    let earlier: Vec<usize> = pre
                        .iter()
                        .filter(|p| !p.x.p.done)
                        .map(|p| p.x.peer)
                        .collect();
                    if !earlier.is_empty() {
                        let mut peers = earlier;
                        peers.sort_unstable();
                        peers.dedup();
                        waiting.push(format!(
                            "delivering earlier (eager) sends to rank(s) {peers:?}"
                        ));
                    }
                    return Err(Error::Timeout {
                        comm: self.ctx.label.clone(),
                        rank: self.ctx.rank,
                        after_ms: t.as_millis() as u64,
                        waiting_for: waiting.join(", "),
                    });
                }
            }
        }
    }

    /// How many idle iterations to spin, then to yield, before sleeping.
    /// Oversubscribed ranks skip spinning (a spinning rank holds the core its
    /// peer needs) but yield, which hands the core straight to a runnable peer.
    /// `WEFT_SPIN_ITERS` / `WEFT_YIELD_ITERS` override (tuning knobs).
    pub(crate) fn wait_budget(&self) -> (u32, u32) {
        use std::sync::OnceLock;
        static KNOBS: OnceLock<(Option<u32>, Option<u32>)> = OnceLock::new();
        let (s, y) = *KNOBS.get_or_init(|| {
            use weft_contract::params::{WEFT_SPIN_ITERS, WEFT_YIELD_ITERS};
            (WEFT_SPIN_ITERS.get(), WEFT_YIELD_ITERS.get())
        });
        let spin = s.unwrap_or(if self.oversubscribed { 0 } else { 4000 });
        // Measured with 4 ranks on 2 cores (docs/PERFORMANCE.md): 32 yields
        // before sleeping beat 8 by ~30% at 8-64 B.
        (spin, y.unwrap_or(if self.oversubscribed { 32 } else { 8 }))
    }

    /// Transfers to ourselves: pair the k-th send with the k-th receive.
    fn exec_self(&mut self, xs: &mut [Xfer]) -> Result<()> {
        let me = self.ctx.rank;
        if !xs.iter().any(|x| x.peer == me) {
            return Ok(());
        }
        let sends: Vec<usize> = (0..xs.len())
            .filter(|&i| xs[i].peer == me && xs[i].send)
            .collect();
        let recvs: Vec<usize> = (0..xs.len())
            .filter(|&i| xs[i].peer == me && !xs[i].send)
            .collect();
        if sends.len() != recvs.len() {
            return Err(Error::InvalidUsage(format!(
                "rank {me} posted {} send(s) to itself but {} receive(s) from itself",
                sends.len(),
                recvs.len()
            )));
        }
        for (&s, &r) in sends.iter().zip(&recvs) {
            if xs[s].len != xs[r].len {
                return Err(Error::InvalidUsage(format!(
                    "rank {me} sends {} bytes to itself but receives {}",
                    xs[s].len, xs[r].len
                )));
            }
            let (src, dst, len, red) = (xs[s].ptr as *const u8, xs[r].ptr, xs[r].len, xs[r].red);
            unsafe {
                match red {
                    None if !std::ptr::eq(src, dst) => std::ptr::copy(src, dst, len),
                    None => {}
                    Some(rd) => crate::data::reduce::combine(
                        rd.dtype,
                        rd.op,
                        dst,
                        rd.other,
                        src,
                        len / rd.dtype.size(),
                    ),
                }
            }
            for i in [s, r] {
                xs[i].p.done = true;
                xs[i].p.payload = len;
            }
        }
        Ok(())
    }

    /// Turns a raised failure into this rank's error.
    pub(crate) fn check_raised(&self) -> Result<()> {
        match self.fault.check() {
            None => Ok(()),
            Some(r) if r.abort => Err(Error::Aborted {
                comm: self.ctx.label.clone(),
                rank: self.ctx.rank,
                by: Some(r.origin),
            }),
            Some(r) => Err(Error::Remote {
                comm: self.ctx.label.clone(),
                rank: self.ctx.rank,
                detail: self.fault.describe(&r),
            }),
        }
    }

    /// A TCP connection to `peer` closed. That peer may be the rank that
    /// died, or a healthy rank that closed its connections because it saw a
    /// failure first (raising a failure shuts every connection down), and
    /// blaming it would send the user after the wrong rank. A process's
    /// endpoint answers as long as it lives: if `peer`'s does, name the rank
    /// whose endpoint refuses connections instead.
    fn blame_closed(&self, peer: usize, why: &str) -> Error {
        // A reason raised here already (a local peer's, or a notice that
        // came first) is the better one.
        if let Err(e) = self.check_raised() {
            return e;
        }
        // A rank that closes because it saw a failure tells us why on a
        // connection of its own (`tcp::FailNotify`), which may land just
        // after the close.
        let notice = |grace: Duration| -> Option<Error> {
            let until = Instant::now() + grace;
            while Instant::now() < until {
                std::thread::sleep(Duration::from_millis(5));
                if let Err(e) = self.check_raised() {
                    return Some(e);
                }
            }
            None
        };
        // The peer's endpoint answers as long as its process lives.
        let answers = |addr| crate::transport::tcp::answers(addr, BLAME_PROBE);
        if !answers(self.ctx.peers[peer].addr) {
            // Gone: it died, or it closed in reaction and exited at once (a
            // short wait tells those apart).
            return notice(NOTICE_GRACE_GONE).unwrap_or_else(|| self.peer_error(peer, why));
        }
        // It lives, so it closed because it saw a failure: wait for its notice.
        if let Some(e) = notice(NOTICE_GRACE) {
            return e;
        }
        // No notice: look for the rank whose endpoint refuses.
        let others: Vec<(usize, std::net::SocketAddr)> = (0..self.ctx.peers.len())
            .filter(|&r| r != peer && self.kinds[r] == PeerKind::Tcp)
            .map(|r| (r, self.ctx.peers[r].addr))
            .collect();
        let gone: Vec<usize> = std::thread::scope(|s| {
            let probes: Vec<_> = others
                .iter()
                .map(|&(r, addr)| (r, s.spawn(move || answers(addr))))
                .collect();
            probes
                .into_iter()
                .filter_map(|(r, h)| (h.join().ok() == Some(false)).then_some(r))
                .collect()
        });
        match gone.first() {
            Some(&dead) => self.peer_error(
                dead,
                &format!(
                    "its process is gone (its endpoint refuses connections); rank {peer} closed its connection to this rank after seeing that failure"
                ),
            ),
            None => self.peer_error(
                peer,
                &format!(
                    "{why}; its process still answers, so it may have closed in reaction to a failure elsewhere"
                ),
            ),
        }
    }

    pub(crate) fn peer_error(&self, peer: usize, why: &str) -> Error {
        let p = &self.ctx.peers[peer];
        Error::Remote {
            comm: self.ctx.label.clone(),
            rank: self.ctx.rank,
            detail: format!("rank {peer} (pid {} on {}): {why}", p.pid, p.hostname),
        }
    }

    /// Liveness of the peers we are waiting for.
    pub(crate) fn check_peers(&self, peers: impl Iterator<Item = usize>) -> Result<()> {
        // A raised failure explains a vanished peer better than the vanishing
        // itself (an aborting rank drops its resources right after raising).
        self.check_raised()?;
        for peer in peers {
            if self.kinds[peer] == PeerKind::Proxy {
                // Lost peer hosts are raised in our control block by the
                // sidecar; a lost sidecar shows here.
                if let Some(link) = &self.proxy
                    && let Err(why) = link.check()
                {
                    return Err(Error::Remote {
                        comm: self.ctx.label.clone(),
                        rank: self.ctx.rank,
                        detail: format!("{why} (host {})", self.ctx.peers[self.ctx.rank].hostname),
                    });
                }
                continue;
            }
            if self.kinds[peer] != PeerKind::Shm {
                continue;
            }
            if let Some(m) = &self.local_maps[peer]
                && m.control().state.load(Ordering::Acquire) == ST_DESTROYED
            {
                return Err(self.peer_error(
                    peer,
                    "it destroyed its communicator while this rank was waiting for it",
                ));
            }
            let pid = self.ctx.peers[peer].pid;
            if !crate::sys::topology::pid_alive(pid) {
                return Err(self.peer_error(peer, "the process exited"));
            }
        }
        Ok(())
    }

    /// Marks the communicator failed (spreading the failure to peers) and
    /// returns the error to report.
    pub(crate) fn fail(&self, e: Error) -> Error {
        match &e {
            // Already raised by someone: pass it on but keep their reason.
            Error::Aborted { .. } => self.fault.spread(crate::transport::shm::FAIL_ABORT),
            Error::Remote { .. } if self.fault.check().is_some() => self.fault.spread(FAIL_ERROR),
            _ => self.fault.raise(FAIL_ERROR, &e.to_string()),
        }
        e
    }
}
