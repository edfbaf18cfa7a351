//! Device collectives of a communicator spanning hosts, hierarchically:
//! within a host on the GPU kernels (NVLink where the GPUs have it) of a
//! hidden host-local communicator, between hosts on the rank's rail (the
//! ranks of its local index, one per host), whose device side is the
//! stream-ordered pinned path (`cuda/proxy.rs`); so the local part is never
//! staged through host memory because some peer is remote, and each rail
//! carries 1/k of the data between hosts (k ranks a host), as NCCL's rings
//! on rails do. The steps are `crosshost::device_plan`'s (pure, tested in
//! CI by simulation); this module builds the two communicators and runs the
//! steps on them, all enqueued on the caller's stream: the call returns
//! without waiting for the GPU or the network.
//!
//! Collectives of `WEFT_CROSSHOST_HIER_MIN_BYTES` (8 MiB) and more, all
//! their data counted, take it; smaller ones are staged whole (measured:
//! docs/PERFORMANCE-GPU.md, "Across hosts"). Built at the first device
//! operation of any kind (sends and receives too, which then go by host
//! from the first: `hier_p2p.rs`) of a communicator on two hosts or more,
//! one of them holding two ranks or more (hosts of different sizes take
//! the leaders' shapes, `device_plan::uneven`): two splits of the
//! communicator and the host-local one's device setup (collectives: every
//! rank makes its first device operation at the same point of its calls,
//! as the cross-host engine, built there too, already requires), agreed on
//! by every rank over the flat path; `WEFT_CROSSHOST_HIER=0` keeps the
//! whole operation staged.
//!
//! Failures: the communicators are the parent's as far as the user is
//! concerned. A watch entry ([`HierWatch`]) turns a failure of either into
//! a failure of the parent (raised on the parent's fault domain: every rank
//! of it learns, on this host through shared memory, on others through the
//! failure notice), and a failure or abort of the parent aborts both, which
//! releases their kernels and their proxy's flags; the next call on the
//! parent returns its error. Destroying the parent destroys them after
//! their queued work ran.

use super::communicator::Communicator;
use super::cross_engine::all_agree;
use super::device::{device_backend, run_flat, set_up_device};
use super::hier_slot::{State, Sub};
use super::shared::{CommShared, lock};
use super::watch::{self, Watched};
use crate::crosshost::Layout;
use crate::crosshost::device_plan::{self, Among, At, DevicePlan};
use crate::error::{Error, Result};
use crate::observe;
use crate::op::{Memory, Op, OpKind};
use crate::state::CommState;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Weak};

/// The two communicators of a rank and what the steps need to know.
pub(crate) struct Hier {
    pub(super) layout: Layout,
    pub(super) local: Communicator,
    rail: Communicator,
    /// Kinds whose choice was logged (bit per `OpKind as u32`).
    logged: AtomicU32,
    /// Keeps the watch entry alive as long as the hierarchy.
    _watch: Arc<HierWatch>,
}

impl Hier {
    /// Logs `line()` (at `WEFT_DEBUG=INFO`) the first time a kind runs by
    /// the hierarchy.
    pub(super) fn log_once(&self, kind: OpKind, line: impl FnOnce() -> String) {
        let bit = 1u32 << (kind as u32);
        if self.logged.fetch_or(bit, Ordering::Relaxed) & bit == 0 {
            crate::log::info_log!("{}", line());
        }
    }
}

/// A communicator of the hierarchy, as its parent's slot sees it.
impl Sub for CommShared {
    fn failure_text(&self) -> Option<String> {
        match self.state.get() {
            CommState::Failed => Some(self.failure("a hierarchical collective").to_string()),
            // Aborted by a peer: the state stays, the fault says so.
            CommState::Ready => self.fault().and_then(|f| f.check().map(|r| f.describe(&r))),
            _ => None,
        }
    }

    fn label(&self) -> &str {
        &self.label
    }

    fn abort(&self, reason: &str) {
        let _ = self.abort_with(reason);
    }
}

/// The device watch's look at a parent with a hierarchy.
struct HierWatch {
    parent: Weak<CommShared>,
}

impl Watched for HierWatch {
    fn watch_tick(&self) -> bool {
        let Some(p) = self.parent.upgrade() else {
            return false;
        };
        match p.state.get() {
            CommState::Ready => {
                // The parent's own look first: a dead local peer is named
                // as the parent's rank, with the parent's words.
                let mut failed = p.poll_peers().is_err();
                if !failed && let Some(why) = p.hier.sub_failure() {
                    p.fail_with(&why);
                    failed = p.poll_peers().is_err();
                }
                if failed {
                    // Its peers on the two communicators learn why.
                    p.hier
                        .release(&p.failure("a hierarchical collective").to_string());
                    return false;
                }
                true
            }
            CommState::Initializing => true,
            CommState::Failed | CommState::Aborted => {
                p.hier
                    .release(&p.failure("a hierarchical collective").to_string());
                false
            }
            CommState::Destroyed => false,
        }
    }
}

/// Whether [`hierarchical`](Communicator::hierarchical) takes a device
/// operation of this kind (sends and receives go by host in `hier_p2p.rs`).
fn takes(kind: OpKind) -> bool {
    matches!(
        kind,
        OpKind::AllReduce
            | OpKind::AllGather
            | OpKind::ReduceScatter
            | OpKind::Broadcast
            | OpKind::Reduce
            | OpKind::AllToAll
    )
}

impl Communicator {
    /// Runs `op` (validated, device memory, not empty) hierarchically when
    /// the communicator's hierarchy takes it; None: it does not (the
    /// caller runs it as before). Builds the hierarchy at the first
    /// collective that could use it.
    ///
    /// # Safety
    /// As `run_device`.
    pub(super) unsafe fn run_hierarchical(&self, op: &Op) -> Option<Result<()>> {
        // A group may mix host memory in: never here.
        if !matches!(op.memory, Memory::Device(_)) {
            return None;
        }
        unsafe { self.hierarchical(op) }
    }

    /// [`run_hierarchical`](Self::run_hierarchical) for any memory: host
    /// memory runs the same steps on the host path, blocking (CI's test of
    /// the hierarchy, which has no GPU).
    pub(super) unsafe fn hierarchical(&self, op: &Op) -> Option<Result<()>> {
        if !self.s.cfg.device_hier || !takes(op.kind) || op.is_empty() {
            return None;
        }
        let device = match op.memory {
            Memory::Device(d) => Some(d),
            Memory::Host => None,
        };
        let h = self.hierarchy(device)?;
        if op.whole_bytes(self.s.nranks) < self.s.cfg.device_hier_min_bytes {
            return None;
        }
        let me = self.s.rank;
        if op.kind == OpKind::AllToAll {
            // Not steps on the two communicators: the blocks of this host's
            // ranks over the host-local one, the rest across (`hier_p2p.rs`).
            // In place it stays staged whole: there every block is read
            // before any is written, which concurrent sends and receives
            // on one buffer would not guarantee.
            if op.send == op.recv.cast_const() {
                return None;
            }
            return Some(unsafe { self.hier_all_to_all(&h, op) });
        }
        let plan = device_plan::plan(op.kind, op.count, op.redop, op.root, &h.layout, me)?;
        h.log_once(op.kind, || {
            format!(
                "comm {} rank {me}: {} on device memory across {}: hierarchical, within the host on the GPU kernels of {}, between hosts on rail {} through pinned host memory ({} steps)",
                self.s.label,
                op.name(),
                h.layout.describe(),
                h.local.s.label,
                h.rail.s.label,
                plan.steps.len()
            )
        });
        let obs = observe::start(
            &self.s.who(),
            std::slice::from_ref(op),
            false,
            "cross-host-hier",
        );
        let r = unsafe { self.run_steps(&h, op, &plan) }.map_err(|e| self.hier_error(e));
        observe::finish(obs, &r);
        Some(r)
    }

    /// The hierarchy if it was built already (never builds it: for the
    /// operations not every rank calls).
    pub(super) fn built_hierarchy(&self) -> Option<Arc<Hier>> {
        match &*lock(&self.s.hier.state) {
            State::On(h) => h.clone().downcast::<Hier>().ok(),
            _ => None,
        }
    }

    /// Builds the hierarchy, when `WEFT_CROSSHOST_HIER` is on and the
    /// layout has one, at the communicator's first device operation on
    /// `device` (`run_device`; None: host memory, CI's tests), so that
    /// sends and receives go by host from the first: a program of sends
    /// and receives alone (pipeline stages) never calls a collective that
    /// would build it.
    pub(super) fn prepare_hierarchy(&self, device: Option<i32>) {
        if self.s.cfg.device_hier {
            let _ = self.hierarchy(device);
        }
    }

    /// The hierarchy, built at the first call that asks (every rank at the
    /// same call), its host-local communicator's device side set up on
    /// `device` (the calling operation's); None where there is none.
    fn hierarchy(&self, device: Option<i32>) -> Option<Arc<Hier>> {
        let mut st = lock(&self.s.hier.state);
        match &*st {
            State::On(h) => return h.clone().downcast::<Hier>().ok(),
            State::Off => return None,
            State::Untried => {}
        }
        // The bootstrap's host identities: the same on every rank, so
        // every rank stops here alike, before any collective.
        let layout = Layout::from_host_ids(&self.s.host_ids());
        // Two hosts or more, one of them with two ranks or more: something
        // stays on a host's kernels (hosts may differ in size: leaders).
        let fits =
            layout.nhosts() >= 2 && (0..layout.nhosts()).any(|h| layout.members(h).len() >= 2);
        if !fits {
            *st = State::Off;
            return None;
        }
        let built = self.build_hierarchy(layout, device);
        let built = match all_agree(self, built.is_ok()) {
            Ok(true) => built,
            Ok(false) => Err(built.err().unwrap_or_else(|| {
                Error::Internal("another rank could not build its part".into())
            })),
            Err(e) => Err(e),
        };
        match built {
            Ok(h) => {
                let h = Arc::new(h);
                let me = self.s.rank;
                let (host, l) = (h.layout.host(me), h.layout.local(me));
                let local: Weak<dyn Sub> = Arc::downgrade(&h.local.s) as Weak<dyn Sub>;
                let rail: Weak<dyn Sub> = Arc::downgrade(&h.rail.s) as Weak<dyn Sub>;
                self.s.hier.set_subs(vec![
                    (local, h.layout.members(host).to_vec()),
                    (rail, h.layout.rail(l)),
                ]);
                watch::register(Arc::downgrade(&h._watch) as Weak<dyn Watched>);
                *st = State::On(h.clone());
                Some(h)
            }
            Err(e) => {
                crate::log::warn_log!(
                    "comm {} rank {}: no hierarchical device path ({e}): device collectives across hosts stage the whole operation through pinned host memory",
                    self.s.label,
                    self.s.rank
                );
                *st = State::Off;
                None
            }
        }
    }

    /// The host-local communicator (color: the host, rank order) and the
    /// rail (color: the local index, host order), blocking whatever this
    /// one's configuration says: both are used at once.
    fn build_hierarchy(&self, layout: Layout, device: Option<i32>) -> Result<Hier> {
        let me = self.s.rank;
        let (h, l) = (layout.host(me), layout.local(me));
        let cfg = |name: String| {
            let mut c = self.s.cfg.clone().blocking(true);
            c.name = Some(name);
            c
        };
        // A wait within a host is often the echo of one between hosts (a
        // local peer held by its rail, which waits for a frozen remote
        // rank): the host-local communicator gives up later than
        // `WEFT_TIMEOUT_MS` (by half of it, 500 ms at least), so the rail,
        // which names the rank really gone, speaks first.
        let mut local_cfg = cfg(format!("{}.host{h}", self.s.label));
        local_cfg.timeout = local_cfg
            .timeout
            .map(|t| t + (t / 2).max(std::time::Duration::from_millis(500)));
        let local = self
            .split_with_config(Some(h as u32), me as i32, local_cfg)?
            .ok_or_else(|| Error::Internal("no host-local communicator".into()))?;
        let rail = self
            .split_with_config(
                Some(l as u32),
                h as i32,
                cfg(format!("{}.rail{l}", self.s.label)),
            )?
            .ok_or_else(|| Error::Internal("no rail communicator".into()))?;
        // On hosts of different sizes a rail skips the hosts without its
        // local index: its rank is this host's place among the others.
        let on_rail = layout.rail(l).iter().position(|&r| r == me);
        if local.s.rank != l || Some(rail.s.rank) != on_rail {
            return Err(Error::Internal(format!(
                "split ranks {} and {} do not match the layout's local index {l} and place {on_rail:?} on rail {l}",
                local.s.rank, rail.s.rank
            )));
        }
        // The host-local communicator's device side (peers mapped), here
        // where every rank of the parent is: its first own operation may be
        // a send that not every local rank makes at that point. (The rail's
        // is the pinned path, set up without an exchange at its first
        // step, which all its ranks make together.)
        if let Some(d) = device {
            set_up_device(&local, d)?;
        }
        Ok(Hier {
            layout,
            local,
            rail,
            logged: AtomicU32::new(0),
            _watch: Arc::new(HierWatch {
                parent: Arc::downgrade(&self.s),
            }),
        })
    }

    /// Enqueues the plan's steps on `op`'s stream (scratch from the
    /// device's stream-ordered pool, freed after the last step).
    unsafe fn run_steps(&self, h: &Hier, op: &Op, plan: &DevicePlan) -> Result<()> {
        self.no_sub_failure()?;
        let esz = op.dtype.size();
        // Device scratch from the stream-ordered pool; host scratch (CI's
        // test) a vector of 16-byte words, aligned for every type.
        let mut host_scratch: Vec<u128> = Vec::new();
        let scratch = match (plan.scratch, op.memory) {
            (0, _) => None,
            (n, Memory::Device(dev)) => {
                Some(unsafe { device_backend().alloc_scratch(dev, n * esz, op.stream) }?)
            }
            (n, Memory::Host) => {
                host_scratch.resize((n * esz).div_ceil(16), 0);
                Some(host_scratch.as_mut_ptr() as u64)
            }
        };
        let at = |a: At| -> u64 {
            match a {
                At::Send(o) => op.send as u64 + (o * esz) as u64,
                At::Recv(o) => op.recv as u64 + (o * esz) as u64,
                At::Scratch(o) => scratch.unwrap_or(0) + (o * esz) as u64,
            }
        };
        let mut r = Ok(());
        for st in &plan.steps {
            if st.among == Among::Me {
                // SAFETY: both ranges lie within the operation's buffers
                // or the scratch (the plan's offsets), apart.
                r = unsafe { copy_alone(op, at(st.recv), at(st.send), st.count * esz) };
                if r.is_err() {
                    break;
                }
                continue;
            }
            let (send, recv) = (at(st.send) as *const u8, at(st.recv) as *mut u8);
            let redop = st.redop.unwrap_or(crate::data::types::ReduceOp::Sum);
            let sub = match st.kind {
                OpKind::AllReduce => Op::all_reduce(send, recv, st.count, op.dtype, redop),
                OpKind::ReduceScatter => Op::reduce_scatter(send, recv, st.count, op.dtype, redop),
                OpKind::AllGather => Op::all_gather(send, recv, st.count, op.dtype),
                OpKind::Broadcast => Op::broadcast(send, recv, st.count, op.dtype, st.root),
                OpKind::Reduce => Op::reduce(send, recv, st.count, op.dtype, redop, st.root),
                OpKind::Scatter => Op::scatter(send, recv, st.count, op.dtype, st.root),
                k => {
                    r = Err(Error::Internal(format!(
                        "no hierarchical step of kind {k:?}"
                    )));
                    break;
                }
            }
            .on(op.memory, op.stream);
            let comm = match st.among {
                Among::Host => &h.local,
                Among::Rail => &h.rail,
                Among::All | Among::Me => self,
            };
            // SAFETY: the step's buffers lie within the operation's (the
            // plan's offsets) or the scratch, live until the stream passes
            // the free below.
            r = match op.memory {
                Memory::Host => unsafe { comm.submit(sub) },
                Memory::Device(_) => unsafe { run_flat(&[(comm, sub)]) },
            };
            if r.is_err() {
                break;
            }
        }
        if let (Some(p), Memory::Device(dev)) = (scratch, op.memory) {
            let freed = unsafe { device_backend().free_scratch(dev, p, op.stream) };
            r = r.and(freed);
        }
        r
    }

    /// Err when one of the hierarchy's communicators failed already.
    pub(super) fn no_sub_failure(&self) -> Result<()> {
        match self.s.hier.sub_failure() {
            Some(why) => Err(Error::Remote {
                comm: self.s.label.clone(),
                rank: self.s.rank,
                detail: why,
            }),
            None => Ok(()),
        }
    }

    /// An error of a step, as the parent's: when one of its communicators
    /// failed, the parent fails with it (every rank learns) and its error
    /// names the parent; usage errors pass as they are.
    pub(super) fn hier_error(&self, e: Error) -> Error {
        if let Some(why) = self.s.hier.sub_failure() {
            self.s.fail_with(&why);
            let _ = self.s.poll_peers();
        }
        match self.s.state.get() {
            CommState::Failed => self.s.failure("a hierarchical collective"),
            _ => e,
        }
    }
}

/// A plan's step on this rank alone (`Among::Me`): `bytes` from `src` to
/// `dst` in `op`'s memory, on its stream for device memory (in stream
/// order with the steps around it), at once for host memory (whose steps
/// run blocking).
///
/// # Safety
/// Both ranges are valid for `bytes` in `op`'s memory and apart.
unsafe fn copy_alone(op: &Op, dst: u64, src: u64, bytes: usize) -> Result<()> {
    match op.memory {
        Memory::Device(dev) => unsafe {
            device_backend().copy_on_stream(dev, dst, src, bytes, op.stream)
        },
        Memory::Host => {
            unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, bytes) };
            Ok(())
        }
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::data::types::{DataType, ReduceOp};

    /// Four ranks in this process on two simulated hosts (their
    /// configurations' host names), every collective the hierarchy takes
    /// with its threshold at 0.
    pub(in crate::comm) fn four_on_two_hosts() -> Vec<Communicator> {
        Communicator::init_on_simulated_hosts(4, 2, |c| crate::config::Config {
            device_hier_min_bytes: 0,
            timeout: Some(std::time::Duration::from_secs(10)),
            ..c
        })
    }

    /// Rank q's element i: never zero, distinct, exact in f32 sums.
    fn value(q: usize, i: usize) -> f32 {
        ((q * 7919 + i * 104_729) % 61) as f32 + 1.0
    }

    /// The hierarchy's steps on real communicators (host memory: the
    /// same steps as on a GPU, on the host path): the splits, the plan's
    /// offsets, the scratch, the tail of an all-reduce on the parent, every
    /// root; each result against the reference.
    #[test]
    fn hierarchical_steps_on_real_communicators_match_the_reference() {
        let comms = four_on_two_hosts();
        let n = 4;
        /// What a rank checked: the name, what it got, what it wanted.
        type Checked = Vec<(String, Vec<f32>, Vec<f32>)>;
        let outs: Vec<Checked> = std::thread::scope(|s| {
            let hs: Vec<_> = comms
                .iter()
                .enumerate()
                .map(|(me, c)| {
                    s.spawn(move || {
                        let mut got = Vec::new();
                        let run = |op: Op| {
                            let r = unsafe { c.hierarchical(&op) };
                            r.expect("the hierarchy takes it").unwrap();
                        };
                        for count in [1023usize, 64] {
                            let input: Vec<f32> = (0..n * count).map(|i| value(me, i)).collect();
                            let mut out = vec![f32::NAN; n * count];
                            let (sp, rp) = (input.as_ptr().cast(), out.as_mut_ptr().cast());
                            run(Op::all_reduce(sp, rp, count, DataType::F32, ReduceOp::Sum));
                            let want = (0..count)
                                .map(|i| (0..n).map(|q| value(q, i)).sum())
                                .collect();
                            got.push((format!("all_reduce {count}"), out[..count].to_vec(), want));
                            for root in 0..n {
                                run(Op::broadcast(sp, rp, count, DataType::F32, root));
                                let want = (0..count).map(|i| value(root, i)).collect();
                                got.push((
                                    format!("broadcast {count} root {root}"),
                                    out[..count].to_vec(),
                                    want,
                                ));
                                out.fill(f32::NAN);
                                run(Op::reduce(
                                    sp,
                                    rp,
                                    count,
                                    DataType::F32,
                                    ReduceOp::Max,
                                    root,
                                ));
                                if me == root {
                                    let want = (0..count)
                                        .map(|i| {
                                            (0..n).map(|q| value(q, i)).fold(f32::MIN, f32::max)
                                        })
                                        .collect();
                                    got.push((
                                        format!("reduce {count} root {root}"),
                                        out[..count].to_vec(),
                                        want,
                                    ));
                                }
                            }
                            run(Op::all_gather(sp, rp, count, DataType::F32));
                            let want = (0..n * count)
                                .map(|i| value(i / count, i % count))
                                .collect();
                            got.push((format!("all_gather {count}"), out.clone(), want));
                            run(Op::reduce_scatter(
                                sp,
                                rp,
                                count,
                                DataType::F32,
                                ReduceOp::Sum,
                            ));
                            let want = (0..count)
                                .map(|i| (0..n).map(|q| value(q, me * count + i)).sum())
                                .collect();
                            got.push((
                                format!("reduce_scatter {count}"),
                                out[..count].to_vec(),
                                want,
                            ));
                        }
                        got
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (r, got) in outs.iter().enumerate() {
            for (what, g, w) in got {
                assert_eq!(g, w, "rank {r}: {what}");
            }
        }
        for (r, c) in comms.iter().enumerate() {
            let h = c.hierarchy(None).expect("built");
            assert_eq!(h.local.s.label, format!("{}.host{}", c.s.label, r / 2));
            assert_eq!(h.rail.s.label, format!("{}.rail{}", c.s.label, r % 2));
        }
    }

    /// Five ranks on hosts of three and two (a job after a shrink, pods
    /// of different GPU counts): all-reduce by the hosts' leaders,
    /// broadcast and reduce from every root (to rank 2, a local index the
    /// second host lacks, by the leaders), all-gather and reduce-scatter by
    /// the leaders (the hosts are rank ranges), odd sizes, against the
    /// reference.
    /// Hosts that are not rank ranges (ranks round-robin on two hosts of
    /// two; hosts {0, 2, 3} and {1, 4}): all-gather and reduce-scatter run
    /// hierarchically through the host-major copy, out of place and in
    /// place, odd sizes, against the reference.
    #[test]
    fn interleaved_hosts_gather_and_scatter_hierarchically() {
        let round_robin = |r: usize| r % 2;
        let uneven = |r: usize| usize::from(r == 1 || r == 4);
        for (n, host_of) in [
            (4, &round_robin as &(dyn Fn(usize) -> usize + Sync)),
            (5, &uneven),
        ] {
            let comms = Communicator::init_on_hosts(n, host_of, |c| crate::config::Config {
                device_hier_min_bytes: 0,
                timeout: Some(std::time::Duration::from_secs(10)),
                ..c
            });
            std::thread::scope(|s| {
                for (me, c) in comms.iter().enumerate() {
                    s.spawn(move || interleaved_gather_and_scatter(c, me, n));
                }
            });
        }
    }

    fn interleaved_gather_and_scatter(c: &Communicator, me: usize, n: usize) {
        for count in [1usize, 1021] {
            let whole = n * count;
            let input: Vec<f32> = (0..whole).map(|i| value(me, i)).collect();
            let gathered = |i: usize| value(i / count, i % count);
            let summed = |i: usize| -> f32 { (0..n).map(|q| value(q, me * count + i)).sum() };
            let mut out = vec![f32::NAN; whole];
            let (sp, rp) = (input.as_ptr().cast(), out.as_mut_ptr().cast());
            let ag = Op::all_gather(sp, rp, count, DataType::F32);
            unsafe { c.hierarchical(&ag) }
                .expect("all-gather taken on interleaved hosts")
                .unwrap();
            for (i, got) in out.iter().enumerate() {
                assert_eq!(*got, gathered(i), "rank {me}: all_gather {count} at {i}");
            }
            out.fill(f32::NAN);
            let rs = Op::reduce_scatter(sp, rp, count, DataType::F32, ReduceOp::Sum);
            unsafe { c.hierarchical(&rs) }
                .expect("reduce-scatter taken on interleaved hosts")
                .unwrap();
            for (i, got) in out[..count].iter().enumerate() {
                assert_eq!(*got, summed(i), "rank {me}: reduce_scatter {count} at {i}");
            }
            // In place (NCCL's layouts): the all-gather's input is this
            // rank's block of the output, the reduce-scatter's output this
            // rank's block of the input.
            let mut buf: Vec<f32> = vec![f32::NAN; whole];
            buf[me * count..(me + 1) * count].copy_from_slice(&input[..count]);
            let own = buf[me * count..].as_ptr().cast();
            let ag = Op::all_gather(own, buf.as_mut_ptr().cast(), count, DataType::F32);
            unsafe { c.hierarchical(&ag) }.unwrap().unwrap();
            for (i, got) in buf.iter().enumerate() {
                assert_eq!(
                    *got,
                    gathered(i),
                    "rank {me}: in-place all_gather {count} at {i}"
                );
            }
            let mut buf = input.clone();
            let at = buf.as_mut_ptr();
            let own = unsafe { at.add(me * count) }.cast();
            let rs = Op::reduce_scatter(
                at.cast_const().cast(),
                own,
                count,
                DataType::F32,
                ReduceOp::Sum,
            );
            unsafe { c.hierarchical(&rs) }.unwrap().unwrap();
            for (i, got) in buf[me * count..][..count].iter().enumerate() {
                assert_eq!(
                    *got,
                    summed(i),
                    "rank {me}: in-place reduce_scatter {count} at {i}"
                );
            }
        }
    }

    #[test]
    fn uneven_hosts_run_hierarchically_and_match_the_reference() {
        let comms = Communicator::init_on_simulated_hosts(5, 3, |c| crate::config::Config {
            device_hier_min_bytes: 0,
            timeout: Some(std::time::Duration::from_secs(10)),
            ..c
        });
        let n = 5;
        std::thread::scope(|s| {
            for (me, c) in comms.iter().enumerate() {
                s.spawn(move || {
                    for count in [1usize, 1021] {
                        let input: Vec<f32> = (0..n * count).map(|i| value(me, i)).collect();
                        let mut out = vec![f32::NAN; n * count];
                        let (sp, rp) = (input.as_ptr().cast(), out.as_mut_ptr().cast());
                        let ar = Op::all_reduce(sp, rp, count, DataType::F32, ReduceOp::Sum);
                        unsafe { c.hierarchical(&ar) }
                            .expect("all-reduce taken on uneven hosts")
                            .unwrap();
                        for (i, got) in out[..count].iter().enumerate() {
                            let want: f32 = (0..n).map(|q| value(q, i)).sum();
                            assert_eq!(*got, want, "rank {me}: all_reduce {count} at {i}");
                        }
                        for root in 0..n {
                            let b = Op::broadcast(sp, rp, count, DataType::F32, root);
                            unsafe { c.hierarchical(&b) }
                                .expect("broadcast taken from every root")
                                .unwrap();
                            for (i, got) in out[..count].iter().enumerate() {
                                assert_eq!(*got, value(root, i), "rank {me}: bcast root {root}");
                            }
                            out.fill(f32::NAN);
                            let rd = Op::reduce(sp, rp, count, DataType::F32, ReduceOp::Max, root);
                            unsafe { c.hierarchical(&rd) }
                                .expect("reduce taken to every root")
                                .unwrap();
                            // A non-root's output is left alone.
                            let want = |i| {
                                if me == root {
                                    (0..n).map(|q| value(q, i)).fold(f32::MIN, f32::max)
                                } else {
                                    f32::NAN
                                }
                            };
                            for (i, got) in out[..count].iter().enumerate() {
                                let w = want(i);
                                let same = *got == w || (got.is_nan() && w.is_nan());
                                assert!(same, "rank {me}: reduce root {root} at {i}: {got}");
                            }
                        }
                        let ag = Op::all_gather(sp, rp, count, DataType::F32);
                        unsafe { c.hierarchical(&ag) }
                            .expect("all-gather taken on uneven hosts")
                            .unwrap();
                        for (i, got) in out.iter().enumerate() {
                            let want = value(i / count, i % count);
                            assert_eq!(*got, want, "rank {me}: all_gather {count} at {i}");
                        }
                        out.fill(f32::NAN);
                        let rs = Op::reduce_scatter(sp, rp, count, DataType::F32, ReduceOp::Sum);
                        unsafe { c.hierarchical(&rs) }
                            .expect("reduce-scatter taken on uneven hosts")
                            .unwrap();
                        for (i, got) in out[..count].iter().enumerate() {
                            let want: f32 = (0..n).map(|q| value(q, me * count + i)).sum();
                            assert_eq!(*got, want, "rank {me}: reduce_scatter {count} at {i}");
                        }
                    }
                });
            }
        });
    }

    /// One rank aborts: every other rank's next hierarchical collective
    /// fails (bounded, never hangs), and its communicator ends Failed or
    /// Aborted, the error naming the failure across hosts or the abort.
    #[test]
    fn an_abort_fails_every_other_ranks_hierarchical_collective() {
        let comms = four_on_two_hosts();
        let count = 4096;
        // Built and working first.
        std::thread::scope(|s| {
            for c in &comms {
                s.spawn(move || {
                    let mut b = vec![1f32; count];
                    let p = b.as_mut_ptr().cast();
                    let op = Op::all_reduce(p, p, count, DataType::F32, ReduceOp::Sum);
                    unsafe { c.hierarchical(&op) }.unwrap().unwrap();
                    assert_eq!(b[0], 4.0);
                });
            }
        });
        comms[3].abort().unwrap();
        let t = std::time::Instant::now();
        let errs: Vec<String> = std::thread::scope(|s| {
            let hs: Vec<_> = comms[..3]
                .iter()
                .map(|c| {
                    s.spawn(move || {
                        let mut b = vec![1f32; count];
                        let p = b.as_mut_ptr().cast();
                        let op = Op::all_reduce(p, p, count, DataType::F32, ReduceOp::Sum);
                        // A few tries: a rank may finish one step with the
                        // peers that are still there before it learns.
                        for _ in 0..5 {
                            if let Some(Err(e)) = unsafe { c.hierarchical(&op) } {
                                return e.to_string();
                            }
                        }
                        panic!("no error after rank 3 aborted");
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert!(
            t.elapsed() < std::time::Duration::from_secs(30),
            "took {:?}",
            t.elapsed()
        );
        for (r, e) in errs.iter().enumerate() {
            assert!(
                e.contains("rank 3") || e.contains("abort"),
                "rank {r}: the error names the abort or rank 3: {e}"
            );
        }
    }
}
