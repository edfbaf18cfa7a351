//! Operations on device memory: one call, or every operation of a group.
//!
//! 1. Communicators seen with device buffers for the first time set up their
//!    device side together: allocate scratch + flags, all-gather descriptors
//!    over the host communicator, map the peers (P2P in this process, CUDA
//!    IPC across processes), and agree (all-reduce min) on whether every rank
//!    made it, so that all ranks take the same path.
//! 2. Collectives the kernel path takes are launched on the caller's stream
//!    (asynchronous, like NCCL); a communicator's send/recv/gather/scatter
//!    pieces of the batch become fused point-to-point kernels on the stream
//!    (one stream per communicator in the batch); a batch of sends only is
//!    eager: copied into staging on the stream, sent from a side stream, so
//!    it does not wait for the peer's receive (`eager.rs`).
//! 3. The rest (PreMulSum, point-to-point across processes or streams, no
//!    kernel path) is staged through host memory and runs with the batch's
//!    host operations through the core (`Comms::run_host`, one group):
//!    correct, slow, logged once.
//!
//! A communicator whose ranks span hosts (their host identities differ)
//! skips 1-3: at its first device operation it gets a [`ProxySide`] (no
//! mapping, no exchange), and every batch's operations on it, host memory
//! included, become one job enqueued on the stream for its progress thread
//! (`proxy.rs`).
//!
//! The core hands this backend validated operations of ready communicators
//! and lends it only `Comms` (see `op/backend.rs`).

use super::devcomm::DevComm;
use super::driver::{ContextGuard, stream_capturing};
use super::eager::sends_only;
use super::error::CudaError;
use super::logger::log;
use super::mapping::DESCRIPTOR_BYTES;
use super::p2p::{P2p, is_p2p, p2p_pieces};
use super::pinned_copy::Copier;
use super::proxy::{ProxySide, log_choice};
use super::staging::Staging;
use crate::data::types::{DataType, ReduceOp};
use crate::error::{Error, Result};
use crate::op::backend::{Backend, Comms, DeviceSide, DeviceSlot, Item, spans_hosts};
use crate::op::tuner::Decision;
use crate::op::{Memory, Op};
use std::any::Any;

/// The CUDA backend: the device backend the communicator core constructs.
pub struct CudaBackend;

impl DeviceSide for DevComm {
    fn device(&self) -> i32 {
        DevComm::device(self)
    }
    fn kernel_error(&self) -> Option<String> {
        DevComm::kernel_error(self)
    }
    fn abort(&self) {
        DevComm::abort(self)
    }
    fn abort_word(&self) -> std::sync::Arc<crate::op::backend::AbortWord> {
        self.word.clone()
    }
    fn finalize(self: Box<Self>) -> std::result::Result<(), String> {
        DevComm::finalize(*self).map_err(|e| e.to_string())
    }
    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}

/// The kernel-path state of a slot that has one.
fn dev_comm(slot: &mut DeviceSlot) -> Option<&mut DevComm> {
    match slot {
        DeviceSlot::On(d) => d.as_any_mut().downcast_mut::<DevComm>(),
        _ => None,
    }
}

fn cuda_err(what: &str, comms: &dyn Comms, c: usize, e: CudaError) -> Error {
    Error::Cuda(format!("{what} on {}: {e}", comms.describe(c)))
}

/// The cross-host side of a slot that has one.
fn proxy_side(slot: &mut DeviceSlot) -> Option<&mut ProxySide> {
    match slot {
        DeviceSlot::On(d) => d.as_any_mut().downcast_mut::<ProxySide>(),
        _ => None,
    }
}

/// One host operation per communicator of `todo` (`(comm, device)`), the
/// i-th built by `op(i)`: the setup's exchanges.
fn per_comm(todo: &[(usize, i32)], mut op: impl FnMut(usize) -> Op) -> Vec<Item> {
    todo.iter()
        .enumerate()
        .map(|(i, &(comm, _))| Item { comm, op: op(i) })
        .collect()
}

/// Step 1 for every communicator of the batch that needs it.
unsafe fn setup(comms: &dyn Comms, ops: &[Item]) -> Result<()> {
    let devices: Vec<(usize, i32)> = ops
        .iter()
        .filter_map(|o| match o.op.memory {
            Memory::Device(d) => Some((o.comm, d)),
            Memory::Host => None,
        })
        .collect();
    unsafe { set_up_devices(comms, &devices) }
}

/// Step 1 for each `(communicator, device)` whose slot is still unset (the
/// first device of a communicator listed twice).
unsafe fn set_up_devices(comms: &dyn Comms, devices: &[(usize, i32)]) -> Result<()> {
    let mut todo: Vec<(usize, i32)> = Vec::new();
    for &(c, d) in devices {
        if matches!(*comms.device_slot(c), DeviceSlot::Unset) && !todo.iter().any(|(x, _)| *x == c)
        {
            todo.push((c, d));
        }
    }
    // Communicators that span hosts take the cross-host path: nothing to
    // map, nothing to exchange (every rank sees the same host identities,
    // so every rank decides alike).
    let mut first: Option<Error> = None;
    let slice_bytes = || -> Result<usize> {
        let p = weft_contract::params::WEFT_CROSSHOST_SLICE_BYTES;
        p.try_get()
            .map_err(|e| Error::arg(e.to_string()))
            .map(|v| v.or(p.default_value()).unwrap_or(0))
    };
    todo.retain(|&(c, d)| {
        let hosts = comms.host_ids(c);
        if !spans_hosts(&hosts) {
            return true;
        }
        let mut distinct = hosts.clone();
        distinct.sort_unstable();
        distinct.dedup();
        let slice_bytes = match slice_bytes() {
            Ok(b) => b,
            Err(e) => {
                first.get_or_insert(e);
                return false;
            }
        };
        let copier = Copier::choose(&weft_contract::params::WEFT_CROSSHOST_COPY.value(), d);
        let pipeline = weft_contract::params::WEFT_CROSSHOST_PIPELINE.value() != "0";
        // The threads started here (the progress thread; the engine and
        // its socket helpers, which the host runner builds unless a host
        // collective built them before) go on the CPUs near the GPU; this
        // thread stays where it is.
        let place = super::near_cpus::placement_near(d);
        let threads_on = place.map_or(String::new(), |p| {
            format!("; the threads it starts on CPUs {p:?}, near it")
        });
        let started = crate::sys::affinity::placing(place, || {
            ProxySide::new(
                comms.rank(c),
                comms.nranks(c),
                distinct.len(),
                d,
                slice_bytes,
                copier,
                pipeline,
                comms.host_runner(c),
                comms.describe(c),
            )
        });
        match started {
            Ok(px) => {
                log(
                    false,
                    &format!(
                        "{}: CUDA device {d}: ranks on {} hosts: cross-host path (no peer memory is mapped; stream-ordered through pinned host memory and a progress thread; copies to and from it by {}{threads_on})",
                        comms.describe(c),
                        distinct.len(),
                        copier.describe()
                    ),
                );
                *comms.device_slot(c) = DeviceSlot::On(Box::new(px));
            }
            Err(e) => {
                first.get_or_insert(cuda_err("starting the cross-host path", comms, c, e));
            }
        }
        false
    });
    if let Some(e) = first {
        return Err(e);
    }
    if todo.is_empty() {
        return Ok(());
    }
    let t0 = std::time::Instant::now();
    let mut created: Vec<Option<DevComm>> = Vec::with_capacity(todo.len());
    let mut descs: Vec<Vec<u8>> = Vec::with_capacity(todo.len());
    let mut gathered: Vec<Vec<u8>> = Vec::with_capacity(todo.len());
    for &(c, d) in &todo {
        let me = comms.host_ids(c).get(comms.rank(c)).copied().unwrap_or(0);
        match DevComm::create(comms.rank(c), comms.nranks(c), d, me) {
            Ok((dc, desc)) => {
                created.push(Some(dc));
                descs.push(desc);
            }
            Err(err) => {
                log(
                    true,
                    &format!("{}: CUDA kernel path unavailable: {err}", comms.describe(c)),
                );
                created.push(None);
                descs.push(vec![0u8; DESCRIPTOR_BYTES]);
            }
        }
        gathered.push(vec![0u8; DESCRIPTOR_BYTES * comms.nranks(c)]);
    }
    let exchange = per_comm(&todo, |i| {
        Op::all_gather(
            descs[i].as_ptr(),
            gathered[i].as_mut_ptr(),
            DESCRIPTOR_BYTES,
            DataType::U8,
        )
    });
    unsafe { comms.run_host(&exchange) }?;
    let mut ok = vec![[0u8]; todo.len()];
    let mut agreed = vec![[0u8]; todo.len()];
    for (i, &(c, _)) in todo.iter().enumerate() {
        let all = &gathered[i];
        let everyone_created = (0..comms.nranks(c))
            .all(|r| all[r * DESCRIPTOR_BYTES..r * DESCRIPTOR_BYTES + 8] != [0u8; 8]);
        if let Some(dc) = created[i].as_mut()
            && everyone_created
        {
            match dc.connect(all) {
                // 1: connected; 3: and every link carries lines.
                Ok(()) => ok[i][0] = 1 | ((dc.lines_capable() as u8) << 1),
                Err(err) => log(
                    true,
                    &format!(
                        "{}: CUDA kernel path unavailable (staging through host memory): {err}",
                        comms.describe(c)
                    ),
                ),
            }
        }
    }
    let agree = per_comm(&todo, |i| {
        Op::all_reduce(
            ok[i].as_ptr(),
            agreed[i].as_mut_ptr(),
            1,
            DataType::U8,
            ReduceOp::Min,
        )
    });
    unsafe { comms.run_host(&agree) }?;
    for (i, &(c, d)) in todo.iter().enumerate() {
        let usable = agreed[i][0] & 1 == 1;
        let slot = match created[i].take() {
            Some(mut dc) if usable => {
                dc.set_usable(true);
                dc.set_lines(agreed[i][0] == 3);
                DeviceSlot::On(Box::new(dc))
            }
            // Created but unusable elsewhere: release it now.
            Some(dc) => {
                let _ = dc.finalize();
                DeviceSlot::Off(d)
            }
            None => DeviceSlot::Off(d),
        };
        log(
            false,
            &format!(
                "{}: CUDA device {d}: {} (set up in {} ms)",
                comms.describe(c),
                if agreed[i][0] == 3 {
                    "kernel path on (peers mapped by P2P/IPC; NVLink everywhere: lines chain on)"
                } else if usable {
                    "kernel path on (peers mapped by P2P/IPC; some link is not NVLink-class: lines chain off)"
                } else {
                    "kernel path off: every operation stages through host memory (slow)"
                },
                t0.elapsed().as_millis()
            ),
        );
        *comms.device_slot(c) = slot;
    }
    Ok(())
}

/// Refuses a batch in which two ranks of one communicator, both in this
/// process, would run collective kernels on the same stream: each waits for the other,
/// and one stream runs them one after the other, so the first would wait for
/// ever (NCCL cannot meet this: it refuses two ranks on one GPU).
fn same_stream_check(comms: &dyn Comms, ops: &[Item]) -> Result<()> {
    // (every rank's area as mapped here: the same for the ranks of a
    // communicator that are in this process; the device and stream: the
    // null stream is per device; the communicator's index; the rank).
    type Seen = (Vec<u64>, (i32, usize), usize, usize);
    // Two ranks need two operations: a single call (every call outside a
    // group) has nothing to compare, and takes no lock or copy here.
    if ops.len() < 2 {
        return Ok(());
    }
    let mut seen: Vec<Seen> = Vec::new();
    for o in ops {
        // Point-to-point may be fine (an eager send leaves the stream at
        // once); a collective always waits for every rank.
        if o.op.memory == Memory::Host || is_p2p(&o.op) {
            continue;
        }
        let mut slot = comms.device_slot(o.comm);
        // Direct or staged through scratch (`WEFT_CUDA_DIRECT=0`): two ranks
        // of this process on one stream deadlock either way.
        let Some(dc) = dev_comm(&mut slot) else {
            continue;
        };
        let stream = (dc.dev, o.op.stream as usize);
        if let Some((_, _, c, rank)) = seen
            .iter()
            .find(|(p, st, _, r)| *p == dc.peers && *st == stream && *r != dc.rank)
        {
            return Err(Error::InvalidUsage(format!(
                "{} and {} (rank {rank}) are ranks of one communicator and were given the same CUDA stream in one group: their kernels wait for each other, and one stream would run them one after the other (a deadlock); give each rank its own stream",
                comms.describe(o.comm),
                comms.describe(*c)
            )));
        }
        seen.push((dc.peers.clone(), stream, o.comm, dc.rank));
    }
    Ok(())
}

/// Operations of one communicator in a batch (its point-to-point pieces,
/// or everything of a communicator on the cross-host path).
struct P2pBatch {
    comm: usize,
    ops: Vec<Op>,
}

impl Backend for CudaBackend {
    unsafe fn alloc_scratch(
        &self,
        device: i32,
        bytes: usize,
        stream: *mut std::ffi::c_void,
    ) -> Result<u64> {
        unsafe { super::scratch::alloc(device, bytes, stream) }
            .map_err(|e| Error::Cuda(format!("device scratch of {bytes} bytes: {e}")))
    }

    unsafe fn free_scratch(
        &self,
        device: i32,
        ptr: u64,
        stream: *mut std::ffi::c_void,
    ) -> Result<()> {
        unsafe { super::scratch::free(device, ptr, stream) }
            .map_err(|e| Error::Cuda(format!("freeing device scratch: {e}")))
    }

    unsafe fn copy_on_stream(
        &self,
        device: i32,
        dst: u64,
        src: u64,
        bytes: usize,
        stream: *mut std::ffi::c_void,
    ) -> Result<()> {
        unsafe { super::scratch::copy(device, dst, src, bytes, stream) }.map_err(|e| {
            Error::Cuda(format!(
                "copy of {bytes} bytes between a hierarchical collective's buffer and its scratch: {e}"
            ))
        })
    }

    unsafe fn set_up(&self, comms: &dyn Comms, devices: &[(usize, i32)]) -> Result<()> {
        let _ctx = ContextGuard::save();
        unsafe { set_up_devices(comms, devices) }
    }

    /// Runs a batch of operations (see the module docs). Host-memory
    /// operations may be part of it (a group mixing both).
    unsafe fn run(&self, comms: &dyn Comms, items: &[Item]) -> Result<()> {
        for o in items {
            if o.op.memory != Memory::Host && stream_capturing(o.op.stream) {
                return Err(Error::Unsupported(format!(
                    "{} on {}: the stream is being captured into a CUDA graph, which Weft does not support yet: its kernels take per-call sequence numbers and flags as arguments, so a replayed graph would reuse them and read stale data; run the operation outside capture (nccl-tests: without -G)",
                    o.op.name(),
                    comms.describe(o.comm)
                )));
            }
        }
        let ops: Vec<Item> = items.iter().copied().filter(|o| !o.op.is_empty()).collect();
        // The caller's current context (its cudaSetDevice) is back on return.
        let _ctx = ContextGuard::save();
        unsafe { setup(comms, &ops) }?;
        same_stream_check(comms, &ops)?;
        let mut host: Vec<Item> = Vec::new();
        let mut to_stage: Vec<Item> = Vec::new();
        let mut p2p: Vec<P2pBatch> = Vec::new();
        let mut across: Vec<P2pBatch> = Vec::new();
        let mut first: Option<Error> = None;
        for o in &ops {
            let mut slot = comms.device_slot(o.comm);
            if proxy_side(&mut slot).is_some() {
                // Host-memory operations too: they must run in order with
                // the device ones, on the progress thread.
                match across.iter_mut().find(|b| b.comm == o.comm) {
                    Some(b) => b.ops.push(o.op),
                    None => across.push(P2pBatch {
                        comm: o.comm,
                        ops: vec![o.op],
                    }),
                }
                continue;
            }
            if o.op.memory == Memory::Host {
                host.push(*o);
                continue;
            }
            let Some(dc) = dev_comm(&mut slot) else {
                to_stage.push(*o);
                continue;
            };
            if is_p2p(&o.op) {
                match p2p.iter_mut().find(|b| b.comm == o.comm) {
                    Some(b) => b.ops.push(o.op),
                    None => p2p.push(P2pBatch {
                        comm: o.comm,
                        ops: vec![o.op],
                    }),
                }
                continue;
            }
            match dc.plan(&o.op) {
                Some(plan) => {
                    // The span covers the enqueue: the kernel runs after the call
                    // returns, in stream order (as NCCL's calls return).
                    let r = comms.observed(
                        o.comm,
                        std::slice::from_ref(&o.op),
                        false,
                        Decision::Device(plan.algorithm()),
                        &mut || {
                            unsafe { dc.launch(&plan, o.op.stream) }
                                .map_err(|e| cuda_err(o.op.name(), comms, o.comm, e))
                        },
                    );
                    if let Err(e) = r {
                        first.get_or_insert(e);
                    }
                }
                None => to_stage.push(*o),
            }
        }
        for b in across {
            let mut slot = comms.device_slot(b.comm);
            let Some(px) = proxy_side(&mut slot) else {
                unreachable!("cross-host batches are only made for communicators with that side")
            };
            if b.ops.iter().all(|o| o.memory == Memory::Host) {
                // No stream to order them on: they run here, after the
                // device work queued before them.
                px.drain();
                drop(slot);
                host.extend(b.ops.iter().map(|&op| Item { comm: b.comm, op }));
                continue;
            }
            for o in &b.ops {
                log_choice(|| comms.describe(b.comm), o, px.hosts());
            }
            let r = comms.observed(
                b.comm,
                &b.ops,
                b.ops.len() > 1,
                Decision::Device("cross-host-proxy"),
                &mut || {
                    unsafe { px.enqueue(&b.ops) }
                        .map_err(|e| cuda_err("cross-host operation", comms, b.comm, e))
                },
            );
            if let Err(e) = r {
                first.get_or_insert(e);
            }
        }
        for b in p2p {
            let mut slot = comms.device_slot(b.comm);
            let Some(dc) = dev_comm(&mut slot) else {
                unreachable!("p2p batches are only made for communicators with a kernel path")
            };
            let stream = b.ops[0].stream;
            let one_stream = b.ops.iter().all(|o| o.stream == stream);
            if !(dc.p2p_ok() && one_stream) {
                to_stage.extend(b.ops.iter().map(|&op| Item { comm: b.comm, op }));
                continue;
            }
            let (rank, n) = (comms.rank(b.comm), comms.nranks(b.comm));
            let pieces: Vec<P2p> = b
                .ops
                .iter()
                .flat_map(|o| p2p_pieces(o, rank, n).unwrap_or_default())
                .collect();
            // Sends only, to other ranks, outside capture: eager (see
            // `eager.rs`), so the stream's next operation, typically the
            // matching receive of a ring, is not held behind the send.
            let eager = sends_only(&pieces, rank) && !stream_capturing(stream);
            let r = comms.observed(
                b.comm,
                &b.ops,
                true,
                Decision::Device(if eager { "p2p-eager" } else { "p2p-kernel" }),
                &mut || {
                    if eager {
                        unsafe { dc.launch_p2p_eager(&pieces, stream) }
                    } else {
                        unsafe { dc.launch_p2p(&pieces, stream) }
                    }
                    .map_err(|e| cuda_err("send/recv", comms, b.comm, e))
                },
            );
            if let Err(e) = r {
                first.get_or_insert(e);
            }
        }
        let mut staged: Vec<Staging> = Vec::new();
        for o in &to_stage {
            static ONCE: std::sync::Once = std::sync::Once::new();
            ONCE.call_once(|| {
                log(
                    false,
                    &format!(
                        "{} on device memory stages through host memory (correct, slow: no kernel path for it here)",
                        o.op.name()
                    ),
                )
            });
            let (rank, n) = (comms.rank(o.comm), comms.nranks(o.comm));
            let st = unsafe { Staging::begin(&o.op, rank, n) }
                .map_err(|e| cuda_err(o.op.name(), comms, o.comm, e))?;
            host.push(Item {
                comm: o.comm,
                op: st.op,
            });
            staged.push(st);
        }
        if !host.is_empty()
            && let Err(err) = unsafe { comms.run_host(&host) }
        {
            first.get_or_insert(err);
        }
        for st in staged {
            if let Err(e) = st.finish() {
                first.get_or_insert(Error::Cuda(format!(
                    "copying staged results to the device: {e}"
                )));
            }
        }
        match first {
            Some(f) => Err(f),
            None => Ok(()),
        }
    }
}
