//! The cross-host progress engine: a thread of the rank (embedded mode) that
//! executes queued [`Call`]s over its [`Links`], chunk by chunk, with
//! several chunks in flight per lane, meeting its producer and consumer
//! through [`Flags`].
//!
//! Calls run one after another, in the order submitted; [`Engine::submit`]
//! never waits (the caller, a GPU stream in production, goes on and waits on
//! the words the call raises). Within a call every lane (peer, direction)
//! posts its steps in order as their dependencies allow, up to the call's
//! window; completions are tested on every pass, a reducing receive is
//! combined into its chunk on this thread, and published words rise.
//!
//! Failures are bounded: a peer's connection failing (its process died, its
//! host went: EOF, reset, keepalive, `TCP_USER_TIMEOUT`) fails the call at
//! once, naming the rank; a call that makes no progress for the timeout
//! (`WEFT_TIMEOUT_MS`: a frozen peer) fails naming what it waits for. On any
//! failure, and on [`Engine::abort`], every flag word gets
//! [`TERMINAL`](super::flags::TERMINAL) (every waiter is released), the
//! peers are told why ([`Links::send_notices`]) and the connections close;
//! later submits return the error. A peer's connection that closes is blamed
//! on a notice that arrives within [`NOTICE_GRACE`] when there is one (the
//! rank that failed first), else on that peer. A wait that times out says
//! whom it waits for ([`Links::send_waits`]) and listens for the others'
//! waits for [`TIMEOUT_GRACE`]: the chain of waits ends at the stuck rank,
//! which is the one named (a rank blocked behind the stuck one, locally or
//! over the network, is only a link of the chain). A failure notice
//! explains such a wait only if it started on that chain (every notice
//! carries its origin, the rank whose own failure started it, however
//! often relayed); one that started elsewhere (another rank, held up
//! behind the stuck one, timing out first and naming what it waits for)
//! is only noted. A failure heard of while this rank's own call had been
//! stalled says what that call waited for.

use super::flags::Flags;
use super::links::{Links, Notice, chain_of_waits};
use super::program::{Call, Step, StepOp};
use crate::error::{Error, Result};
use crate::net::{MemKind, Mr, NetError, RecvBuf, Request};
use crate::sys::backoff::Backoff;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long a closed connection waits for the closing rank's notice.
pub const NOTICE_GRACE: Duration = Duration::from_millis(300);
/// All notices of one failure are sent within this.
const NOTICE_DEADLINE: Duration = Duration::from_millis(250);
/// How long a rank whose wait timed out listens for the waits of others
/// after telling its own: the spread of the moments at which the ranks held
/// up by one stuck rank time out (each from its own last progress).
pub const TIMEOUT_GRACE: Duration = Duration::from_millis(500);
/// How often an idle or waiting engine looks for notices.
const NOTICE_POLL: Duration = Duration::from_millis(2);
/// A failure heard of from another rank carries this rank's own wait when
/// its call had made no progress for this long ([`Runner::own_wait_note`]).
const OWN_WAIT_NOTED: Duration = Duration::from_millis(100);

/// What an engine is told at start.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Names the communicator in errors.
    pub label: String,
    pub rank: usize,
    /// Every rank's name in errors ("rank 3 (host b)").
    pub names: Vec<String>,
    /// Fail a call that makes no progress for this long (None: never).
    pub timeout: Option<Duration>,
}

impl EngineConfig {
    fn name(&self, r: usize) -> String {
        self.names
            .get(r)
            .cloned()
            .unwrap_or_else(|| format!("rank {r}"))
    }
}

struct Shared {
    cfg: EngineConfig,
    queue: Mutex<VecDeque<Call>>,
    error: Mutex<Option<Error>>,
    abort: AtomicBool,
    stop: AtomicBool,
    flags: Arc<dyn Flags>,
    /// A local phase timed out waiting for this rank, with this error (see
    /// [`Engine::local_stall`]).
    stall: Mutex<Option<(usize, Error)>>,
}

impl Shared {
    fn error(&self) -> Option<Error> {
        self.error.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn set_error(&self, e: Error) -> Error {
        let mut g = self.error.lock().unwrap_or_else(|e| e.into_inner());
        g.get_or_insert(e).clone()
    }

    /// Fails with `e` (the first error stays): every waiter is released.
    fn fail(&self, e: Error) {
        self.set_error(e);
        self.abort.store(true, Ordering::Release);
        self.flags.release_all();
    }

    fn aborted(&self) -> Error {
        Error::Aborted {
            comm: self.cfg.label.clone(),
            rank: self.cfg.rank,
            by: Some(self.cfg.rank),
        }
    }
}

/// Fails a running engine from outside whatever holds it (an abort of its
/// communicator while a call waits in it).
pub struct Aborter {
    shared: Arc<Shared>,
    thread: Option<std::thread::Thread>,
}

impl Aborter {
    /// As [`Engine::fail`].
    pub fn fail(&self, e: Error) {
        self.shared.fail(e);
        if let Some(t) = &self.thread {
            t.unpark();
        }
    }
}

/// A running engine. Dropping it stops the thread (releasing every waiter).
pub struct Engine {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl Engine {
    /// Starts the engine's thread over `links`.
    pub fn start(links: Links, flags: Arc<dyn Flags>, cfg: EngineConfig) -> Result<Engine> {
        let shared = Arc::new(Shared {
            cfg,
            queue: Mutex::new(VecDeque::new()),
            error: Mutex::new(None),
            abort: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            flags,
            stall: Mutex::new(None),
        });
        let sh = shared.clone();
        let thread = std::thread::Builder::new()
            .name("weft-crosshost".into())
            .spawn(crate::sys::affinity::placed(move || {
                Runner::new(links, sh).run()
            }))
            .map_err(|e| Error::sys("spawning the cross-host engine", e))?;
        Ok(Engine {
            shared,
            thread: Some(thread),
        })
    }

    /// Queues a call (never waits for the network).
    pub fn submit(&self, call: Call) -> Result<()> {
        if let Some(e) = self.shared.error() {
            return Err(e);
        }
        call.check(self.shared.cfg.rank)
            .map_err(|e| Error::Internal(format!("cross-host call: {e}")))?;
        self.shared
            .queue
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push_back(call);
        if let Some(t) = &self.thread {
            t.thread().unpark();
        }
        Ok(())
    }

    /// The error that stopped the engine, if any.
    pub fn error(&self) -> Option<Error> {
        self.shared.error()
    }

    /// Whether the engine's thread has ended (after a failure or abort).
    pub fn ended(&self) -> bool {
        self.thread.as_ref().is_none_or(|t| t.is_finished())
    }

    pub fn flags(&self) -> &Arc<dyn Flags> {
        &self.shared.flags
    }

    /// Waits until word `w` reaches `target`; the engine's error when it was
    /// released by a failure instead, once its connections are closed (so
    /// nothing lands in the caller's buffers after this returns).
    pub fn wait(&self, w: usize, target: u64) -> Result<()> {
        let waited = super::flags::wait_geq(self.shared.flags.as_ref(), w, target, || self.ended());
        if waited == super::flags::Waited::Reached {
            return Ok(());
        }
        self.wait_ended();
        Err(self.error().unwrap_or_else(|| {
            Error::Internal("the cross-host engine ended without an error".into())
        }))
    }

    /// Waits until the thread has ended (bounded after a failure or abort:
    /// the notices take at most their deadline, the connections close).
    pub fn wait_ended(&self) {
        while !self.ended() {
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Aborts: every waiter is released now; the thread tells the peers and
    /// closes the connections. Returns at once.
    pub fn abort(&self) {
        self.fail(self.shared.aborted());
    }

    /// A local phase of the same operation timed out waiting for rank `on`
    /// with error `e`: the engine tells the others, follows the chain of
    /// waits from `on` for [`TIMEOUT_GRACE`] and fails with `e` naming the
    /// stuck rank (or with a failure notice that arrives meanwhile). Returns
    /// at once; [`Engine::wait_ended`], then [`Engine::error`], give the
    /// outcome.
    pub fn local_stall(&self, on: usize, e: Error) {
        *self.shared.stall.lock().unwrap_or_else(|e| e.into_inner()) = Some((on, e));
        if let Some(t) = &self.thread {
            t.thread().unpark();
        }
    }

    /// Fails the engine with `e` (a local phase of the same operation
    /// failed): as [`Engine::abort`], with `e` as the reason the peers hear.
    pub fn fail(&self, e: Error) {
        self.aborter().fail(e);
    }

    /// What fails this engine from elsewhere.
    pub fn aborter(&self) -> Aborter {
        Aborter {
            shared: self.shared.clone(),
            thread: self.thread.as_ref().map(|t| t.thread().clone()),
        }
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            t.thread().unpark();
            let _ = t.join();
        }
        self.shared.flags.release_all();
    }
}

/// One step in flight.
struct Inflight {
    step: usize,
    req: Request,
    /// The staging slot of a reducing receive.
    slot: Option<usize>,
}

/// One peer and direction of a call.
struct Lane {
    peer: usize,
    send: bool,
    order: Vec<usize>,
    next: usize,
    inflight: Vec<Inflight>,
    /// Staging for reducing receives: `window` slots of `slot_len` bytes.
    staging: Vec<u8>,
    slot_len: usize,
    free: Vec<usize>,
    staging_mr: Option<Mr>,
}

/// The call being executed.
struct Running {
    call: Call,
    done: Vec<bool>,
    left: usize,
    lanes: Vec<Lane>,
    pubs: HashMap<usize, VecDeque<(u64, usize)>>,
    mrs: HashMap<(usize, usize), Mr>,
}

impl Running {
    /// `spare`: staging of earlier calls, reused (a fresh buffer of a large
    /// call's window is mapped and page-faulted in on every call).
    fn new(call: Call, spare: &mut Vec<Vec<u8>>) -> Running {
        let mut lanes: Vec<Lane> = Vec::new();
        let mut pubs: HashMap<usize, VecDeque<(u64, usize)>> = HashMap::new();
        for (i, s) in call.steps.iter().enumerate() {
            let send = s.op == StepOp::Send;
            let l = match lanes
                .iter()
                .position(|l| l.peer == s.peer && l.send == send)
            {
                Some(l) => l,
                None => {
                    lanes.push(Lane {
                        peer: s.peer,
                        send,
                        order: Vec::new(),
                        next: 0,
                        inflight: Vec::new(),
                        staging: Vec::new(),
                        slot_len: 0,
                        free: Vec::new(),
                        staging_mr: None,
                    });
                    lanes.len() - 1
                }
            };
            lanes[l].order.push(i);
            if s.op == StepOp::RecvReduce {
                lanes[l].slot_len = lanes[l].slot_len.max(s.len);
            }
            if let Some((w, v)) = s.publish {
                pubs.entry(w).or_default().push_back((v, i));
            }
        }
        let window = call.window.max(1);
        for l in &mut lanes {
            if l.slot_len > 0 {
                let len = l.slot_len * window;
                l.staging = match spare.iter().position(|b| b.len() >= len) {
                    Some(i) => spare.swap_remove(i),
                    None => vec![0u8; len],
                };
                l.free = (0..window).rev().collect();
            }
        }
        Running {
            done: vec![false; call.steps.len()],
            left: call.steps.len(),
            lanes,
            pubs,
            mrs: HashMap::new(),
            call,
        }
    }
}

/// The engine's thread.
struct Runner {
    links: Links,
    sh: Arc<Shared>,
    running: Option<Running>,
    /// Staging buffers of finished calls (see [`Running::new`]).
    spare: Vec<Vec<u8>>,
    last_progress: Instant,
    last_notice_poll: Instant,
    /// Whom each rank said it waits for (their waits timed out).
    waits: BTreeMap<usize, usize>,
    /// The rank whose failure this engine took for its own (a notice's
    /// origin); none: it failed for its own reasons.
    origin: Option<usize>,
}

impl Runner {
    fn new(links: Links, sh: Arc<Shared>) -> Runner {
        Runner {
            links,
            sh,
            running: None,
            spare: Vec::new(),
            last_progress: Instant::now(),
            last_notice_poll: Instant::now(),
            waits: BTreeMap::new(),
            origin: None,
        }
    }

    fn run(mut self) {
        // Between a call's chunks: spin, yield, then park (a submit or an
        // abort unparks it), by time (`sys/backoff.rs`).
        let mut idle = Backoff::new();
        loop {
            if self.sh.abort.load(Ordering::Acquire) {
                let e = self.sh.error().unwrap_or_else(|| self.sh.aborted());
                return self.fail(e);
            }
            if self.sh.stop.load(Ordering::Acquire) {
                self.sh.flags.release_all();
                return;
            }
            let stall = self
                .sh
                .stall
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .take();
            if let Some((on, e)) = stall {
                let e = match self.blame_stall(on) {
                    Ok(chain) => self.with_note(e, &chain),
                    Err(noticed) => noticed,
                };
                return self.fail(e);
            }
            if self.last_notice_poll.elapsed() >= NOTICE_POLL {
                self.last_notice_poll = Instant::now();
                if let Some(e) = self.failure_notice(Instant::now()) {
                    let e = match self.own_wait_note() {
                        Some(note) => self.with_note(e, &note),
                        None => e,
                    };
                    return self.fail(e);
                }
            }
            if self.running.is_none() {
                let next = self
                    .sh
                    .queue
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .pop_front();
                match next {
                    Some(c) => {
                        self.running = Some(Running::new(c, &mut self.spare));
                        self.last_progress = Instant::now();
                    }
                    None => {
                        std::thread::park_timeout(NOTICE_POLL);
                        continue;
                    }
                }
            }
            match self.progress() {
                Ok(true) => {
                    idle.reset();
                    self.last_progress = Instant::now();
                }
                Ok(false) => {
                    if let Some(e) = self.timed_out() {
                        return self.fail(e);
                    }
                    idle.snooze_with(std::thread::park_timeout);
                }
                Err(e) => return self.fail(e),
            }
            if self.running.as_ref().is_some_and(|r| r.left == 0) {
                self.finish_call();
            }
        }
    }

    /// A notice from rank `r`: it failed, or learned of a failure.
    fn noticed(&self, r: usize, why: &str) -> Error {
        Error::Remote {
            comm: self.sh.cfg.label.clone(),
            rank: self.sh.cfg.rank,
            detail: format!("{} failed: {why}", self.sh.cfg.name(r)),
        }
    }

    /// The first failure notice that arrives by `until` (none: `None`),
    /// remembering the waits that come before it.
    fn failure_notice(&mut self, until: Instant) -> Option<Error> {
        self.first_notice(until, |_, _| true, &mut Vec::new())
    }

    /// The first failure notice by `until` whose origin `explains` (given
    /// the waits known when it arrives) it, taking that origin as this
    /// engine's; the others' origins go to `elsewhere`, the waits that
    /// come are remembered.
    fn first_notice(
        &mut self,
        until: Instant,
        explains: impl Fn(&BTreeMap<usize, usize>, usize) -> bool,
        elsewhere: &mut Vec<usize>,
    ) -> Option<Error> {
        loop {
            match self.links.take_notice(until)? {
                Notice::Failed { rank, origin, why } => {
                    if explains(&self.waits, origin) {
                        self.origin = Some(origin);
                        return Some(self.noticed(rank, &why));
                    }
                    if !elsewhere.contains(&origin) {
                        elsewhere.push(origin);
                    }
                }
                Notice::Waits { rank, on } => {
                    self.waits.insert(rank, on);
                }
            }
        }
    }

    /// This rank's wait for rank `on` timed out: tell the others, listen to
    /// theirs for [`TIMEOUT_GRACE`], and describe the chain of waits from
    /// `on` to the stuck rank ("; rank 3 (host 1) waits for rank 2 (host 1);
    /// rank 2 (host 1) is stuck: it reported no wait of its own"). Err: a
    /// failure notice that came meanwhile, which explains it.
    fn blame_stall(&mut self, on: usize) -> std::result::Result<String, Error> {
        let mut elsewhere = Vec::new();
        if let Some(e) = self.notice_explaining(on, Instant::now(), &mut elsewhere) {
            return Err(e);
        }
        self.links.send_waits(on, NOTICE_DEADLINE);
        let until = Instant::now() + TIMEOUT_GRACE;
        if let Some(e) = self.notice_explaining(on, until, &mut elsewhere) {
            return Err(e);
        }
        let chain = chain_of_waits(on, &self.waits);
        let name = |r: &usize| self.sh.cfg.name(*r);
        let mut text = String::new();
        for w in chain.windows(2) {
            text.push_str(&format!("; {} waits for {}", name(&w[0]), name(&w[1])));
        }
        let last = *chain.last().expect("a chain starts with a rank");
        match self.waits.get(&last) {
            Some(back) if chain.contains(back) => text.push_str(&format!(
                "; {} waits for {}: these ranks wait for each other in a circle (do they run the same operations?)",
                name(&last),
                name(back)
            )),
            _ => text.push_str(&format!(
                "; {} is stuck: it reported no wait of its own",
                name(&last)
            )),
        }
        if !elsewhere.is_empty() {
            let who: Vec<String> = elsewhere.iter().map(name).collect();
            text.push_str(&format!("; meanwhile {} failed", who.join(", ")));
        }
        Ok(text)
    }

    /// The first failure notice by `until` that explains this rank's wait
    /// for rank `on`: one whose origin (the rank whose own failure started
    /// it, whoever relays it) is `on` or a rank on the chain of waits from
    /// it (as known when it arrives). The others' origins go to `elsewhere`
    /// (a failure that started off the chain, such as another rank held up
    /// by the stuck one timing out first, does not explain this wait:
    /// taking its error as this rank's hid the stuck rank this rank waits
    /// for, across hosts on 2 x H200); the waits that come are remembered.
    fn notice_explaining(
        &mut self,
        on: usize,
        until: Instant,
        elsewhere: &mut Vec<usize>,
    ) -> Option<Error> {
        let on_chain =
            |waits: &BTreeMap<usize, usize>, origin| chain_of_waits(on, waits).contains(&origin);
        self.first_notice(until, on_chain, elsewhere)
    }

    /// `e` with `note` appended to what it says (a remote error's detail, a
    /// timeout's wait), kind unchanged; other kinds become remote errors.
    fn with_note(&self, e: Error, note: &str) -> Error {
        match e {
            Error::Remote { comm, rank, detail } => Error::Remote {
                comm,
                rank,
                detail: detail + note,
            },
            Error::Timeout {
                comm,
                rank,
                after_ms,
                waiting_for,
            } => Error::Timeout {
                comm,
                rank,
                after_ms,
                waiting_for: waiting_for + note,
            },
            other => Error::Remote {
                comm: self.sh.cfg.label.clone(),
                rank: self.sh.cfg.rank,
                detail: format!("{other}{note}"),
            },
        }
    }

    /// A peer's connection failed: blame a notice that explains it, if one
    /// comes within the grace, else the peer.
    fn peer_failed(&mut self, peer: usize, e: NetError) -> Error {
        if let Some(e) = self.failure_notice(Instant::now() + NOTICE_GRACE) {
            return e;
        }
        Error::Remote {
            comm: self.sh.cfg.label.clone(),
            rank: self.sh.cfg.rank,
            detail: format!("{}: {e}", self.sh.cfg.name(peer)),
        }
    }

    fn fail(self, e: Error) {
        let e = self.sh.set_error(e);
        self.sh.flags.release_all();
        let origin = self.origin.unwrap_or(self.sh.cfg.rank);
        let Runner { links, running, .. } = self;
        links.send_notices(origin, &e.to_string(), NOTICE_DEADLINE);
        // Close every connection (stopping its threads) before the call's
        // staging goes: nothing may land in freed memory.
        drop(links);
        drop(running);
    }

    /// What the running call waits for, peers first (the likelier
    /// culprits), then flags ("for rank 3 (host 1) to send (1 chunk(s) in
    /// flight)"); empty without a running call.
    fn pending_waits(&self) -> Vec<String> {
        let Some(r) = self.running.as_ref() else {
            return Vec::new();
        };
        let mut waits: Vec<String> = Vec::new();
        for l in &r.lanes {
            if !l.inflight.is_empty() {
                let what = if l.send { "to receive" } else { "to send" };
                waits.push(format!(
                    "for {} {what} ({} chunk(s) in flight)",
                    self.sh.cfg.name(l.peer),
                    l.inflight.len()
                ));
            }
        }
        for l in &r.lanes {
            if let Some(&i) = l.order.get(l.next)
                && let Some((w, v)) = r.call.steps[i].ready
                && self.sh.flags.load(w) < v
                && l.inflight.is_empty()
            {
                waits.push(format!(
                    "for the local producer (flag word {w} to reach {v})"
                ));
            }
        }
        if waits.is_empty() {
            waits.push("for a step whose dependency never completed".into());
        }
        waits
    }

    /// A note on what this rank's own call was waiting for, to add to a
    /// failure it heard of from another rank, when its call had made no
    /// progress for [`OWN_WAIT_NOTED`]: the failure named may be another
    /// rank's view (a rank held up behind the stuck one), and this rank's
    /// own wait may name the stuck one ("; this rank had waited 2900 ms for
    /// rank 3 (host 1) to send").
    fn own_wait_note(&self) -> Option<String> {
        self.running.as_ref()?;
        let waited = self.last_progress.elapsed();
        (waited >= OWN_WAIT_NOTED).then(|| {
            format!(
                "; this rank had waited {} ms {}",
                waited.as_millis(),
                self.pending_waits().join(", ")
            )
        })
    }

    fn timed_out(&mut self) -> Option<Error> {
        let t = self.sh.cfg.timeout?;
        let r = self.running.as_ref()?;
        if self.last_progress.elapsed() < t {
            return None;
        }
        let waits = self.pending_waits();
        // The peer waited for may itself be held up by the stuck rank: the
        // chain of waits names it. Without a peer (the local producer), a
        // failure notice that comes within the grace may explain it.
        let on = r
            .lanes
            .iter()
            .find(|l| !l.inflight.is_empty())
            .map(|l| l.peer);
        let chain = match on {
            Some(on) => match self.blame_stall(on) {
                Ok(chain) => chain,
                Err(noticed) => return Some(noticed),
            },
            None => match self.failure_notice(Instant::now() + NOTICE_GRACE) {
                Some(noticed) => return Some(noticed),
                None => String::new(),
            },
        };
        Some(Error::Timeout {
            comm: self.sh.cfg.label.clone(),
            rank: self.sh.cfg.rank,
            after_ms: t.as_millis() as u64,
            waiting_for: format!("waiting {} (WEFT_TIMEOUT_MS){chain}", waits.join(", ")),
        })
    }

    /// One pass over every lane: completions, then posts. Ok(true) when
    /// anything moved.
    fn progress(&mut self) -> Result<bool> {
        let mut run = self.running.take().expect("a running call");
        let r = self.pass(&mut run);
        self.running = Some(run);
        r
    }

    fn pass(&mut self, run: &mut Running) -> Result<bool> {
        let mut made = false;
        for li in 0..run.lanes.len() {
            made |= self.complete(run, li)?;
            made |= self.post(run, li)?;
        }
        Ok(made)
    }

    fn complete(&mut self, run: &mut Running, li: usize) -> Result<bool> {
        let mut made = false;
        let mut k = 0;
        while k < run.lanes[li].inflight.len() {
            let (peer, send) = (run.lanes[li].peer, run.lanes[li].send);
            let f = &run.lanes[li].inflight[k];
            let (step, req, slot) = (f.step, f.req, f.slot);
            let got = if send {
                let c = self.links.send.get_mut(&peer).expect("checked at post");
                c.test(req)
            } else {
                let c = self.links.recv.get_mut(&peer).expect("checked at post");
                c.test(req)
                    .map(|o| o.map(|v| v.first().copied().unwrap_or(0)))
            };
            let n = match got {
                Ok(Some(n)) => n,
                Ok(None) => {
                    k += 1;
                    continue;
                }
                Err(e) => return Err(self.peer_failed(peer, e)),
            };
            let s = &run.call.steps[step];
            if n != s.len {
                return Err(Error::Remote {
                    comm: self.sh.cfg.label.clone(),
                    rank: self.sh.cfg.rank,
                    detail: format!(
                        "{} sent {n} bytes where {} were expected (the ranks disagree about the operation's size)",
                        self.sh.cfg.name(peer),
                        s.len
                    ),
                });
            }
            if let Some(slot) = slot {
                let (dt, op) = run.call.reduce.expect("checked at submit");
                let lane = &mut run.lanes[li];
                let dst = (run.call.bufs[s.buf].ptr + s.off) as *mut u8;
                let with = match s.with {
                    Some((b, off)) => (run.call.bufs[b].ptr + off) as *const u8,
                    None => dst,
                };
                let src = lane.staging[slot * lane.slot_len..].as_ptr();
                // SAFETY: the chunk and its operand lie in their buffers
                // (checked at submit), the staging slot holds `n == s.len`
                // bytes, and no other step of the call writes this chunk
                // while this one is in flight.
                // Split over a few threads: one core reduces slower than
                // the sockets deliver (a reduce's root takes every chunk).
                unsafe {
                    crate::data::reduce::combine_split(
                        dt,
                        op.combine(),
                        dst,
                        with,
                        src,
                        s.len / dt.size(),
                        crate::data::reduce::split_threads(),
                    )
                };
                lane.free.push(slot);
            }
            run.lanes[li].inflight.swap_remove(k);
            run.done[step] = true;
            run.left -= 1;
            made = true;
            if let Some((w, _)) = run.call.steps[step].publish {
                self.publish(run, w);
            }
        }
        Ok(made)
    }

    /// Raises word `w` to the value of its last step with every earlier one done.
    fn publish(&self, run: &mut Running, w: usize) {
        let q = run.pubs.get_mut(&w).expect("registered");
        let mut last = None;
        while let Some(&(v, i)) = q.front() {
            if !run.done[i] {
                break;
            }
            last = Some(v);
            q.pop_front();
        }
        if let Some(v) = last {
            self.sh.flags.store(w, v);
            self.sh.flags.wake();
        }
    }

    fn ready(&self, run: &Running, s: &Step) -> bool {
        s.after.is_none_or(|a| run.done[a])
            && s.ready.is_none_or(|(w, v)| self.sh.flags.load(w) >= v)
    }

    fn post(&mut self, run: &mut Running, li: usize) -> Result<bool> {
        let mut made = false;
        let window = run.call.window.max(1);
        loop {
            let lane = &run.lanes[li];
            if lane.inflight.len() >= window {
                break;
            }
            let Some(&i) = lane.order.get(lane.next) else {
                break;
            };
            if !self.ready(run, &run.call.steps[i]) {
                break;
            }
            let (peer, send) = (lane.peer, lane.send);
            let s = run.call.steps[i].clone();
            let mr = self.mr(run, li, s.buf)?;
            let ptr = run.call.bufs[s.buf].ptr + s.off;
            let tag = run.call.tag;
            let posted = if send {
                let c = self
                    .links
                    .send
                    .get_mut(&peer)
                    .ok_or_else(|| no_link(peer))?;
                // SAFETY: the chunk lies in its buffer (checked at submit),
                // which the submitter keeps valid until the call is done.
                unsafe { c.isend(&mr, ptr as *const u8, s.len, tag) }.map(|r| r.map(|r| (r, None)))
            } else {
                let lane = &mut run.lanes[li];
                let slot = match s.op {
                    StepOp::RecvReduce => match lane.free.pop() {
                        Some(slot) => Some(slot),
                        None => break,
                    },
                    _ => None,
                };
                let c = self
                    .links
                    .recv
                    .get_mut(&peer)
                    .ok_or_else(|| no_link(peer))?;
                let (dst, dst_mr) = match slot {
                    Some(slot) => {
                        if lane.staging_mr.is_none() {
                            let m = c
                                .reg_mr(lane.staging.as_ptr(), lane.staging.len(), MemKind::Host)
                                .map_err(net_err)?;
                            lane.staging_mr = Some(m);
                        }
                        (
                            lane.staging[slot * lane.slot_len..].as_mut_ptr(),
                            lane.staging_mr.clone().expect("registered"),
                        )
                    }
                    None => (ptr as *mut u8, mr),
                };
                let b = RecvBuf {
                    mr: &dst_mr,
                    ptr: dst,
                    len: s.len,
                    tag,
                };
                // SAFETY: as for sends; a staging slot stays ours until done.
                let r = unsafe { c.irecv(&[b]) };
                if !matches!(r, Ok(Some(_)))
                    && let Some(slot) = slot
                {
                    lane.free.push(slot);
                }
                r.map(|r| r.map(|r| (r, slot)))
            };
            match posted {
                Ok(Some((req, slot))) => {
                    let lane = &mut run.lanes[li];
                    lane.inflight.push(Inflight { step: i, req, slot });
                    lane.next += 1;
                    made = true;
                }
                Ok(None) => break,
                Err(e) => return Err(self.peer_failed(peer, e)),
            }
        }
        Ok(made)
    }

    /// Buffer `buf` registered with lane `li`'s comm.
    fn mr(&mut self, run: &mut Running, li: usize, buf: usize) -> Result<Mr> {
        if let Some(m) = run.mrs.get(&(li, buf)) {
            return Ok(m.clone());
        }
        let (peer, send) = (run.lanes[li].peer, run.lanes[li].send);
        let b = run.call.bufs[buf];
        let m = if send {
            let c = self
                .links
                .send
                .get_mut(&peer)
                .ok_or_else(|| no_link(peer))?;
            c.reg_mr(b.ptr as *const u8, b.len, MemKind::Host)
        } else {
            let c = self
                .links
                .recv
                .get_mut(&peer)
                .ok_or_else(|| no_link(peer))?;
            c.reg_mr(b.ptr as *const u8, b.len, MemKind::Host)
        }
        .map_err(net_err)?;
        run.mrs.insert((li, buf), m.clone());
        Ok(m)
    }

    fn finish_call(&mut self) {
        let Some(run) = self.running.take() else {
            return;
        };
        for ((li, _), m) in &run.mrs {
            let l = &run.lanes[*li];
            let _ = if l.send {
                self.links.send.get_mut(&l.peer).map(|c| c.dereg_mr(m))
            } else {
                self.links.recv.get_mut(&l.peer).map(|c| c.dereg_mr(m))
            };
        }
        for l in &run.lanes {
            if let (Some(m), Some(c)) = (&l.staging_mr, self.links.recv.get_mut(&l.peer)) {
                let _ = c.dereg_mr(m);
            }
        }
        if let Some((w, v)) = run.call.done {
            self.sh.flags.store(w, v);
            self.sh.flags.wake();
        }
        // The largest few are kept (one per receiving lane of a call).
        self.spare.extend(
            run.lanes
                .into_iter()
                .map(|l| l.staging)
                .filter(|s| !s.is_empty()),
        );
        self.spare.sort_by_key(|s| std::cmp::Reverse(s.len()));
        self.spare.truncate(4);
    }
}

/// A registration refused (device memory on a host-only transport).
fn net_err(e: NetError) -> Error {
    match e {
        NetError::Unsupported { .. } => Error::Unsupported(e.to_string()),
        _ => Error::Internal(format!("cross-host: {e}")),
    }
}

fn no_link(peer: usize) -> Error {
    Error::Internal(format!(
        "cross-host: no connection to rank {peer} (the plan uses a peer the links were not made for)"
    ))
}
