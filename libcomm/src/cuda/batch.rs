//! Operations on device memory: one call, or every operation of a group.
//! The backend's entry point, and the home of [`DevSlot`], the slot each
//! communicator keeps for its device side (see the `cuda` module docs for
//! how it differs from the [`DevComm`] it holds).
//!
//! 1. Communicators seen with device buffers for the first time set up their
//!    device side together: allocate scratch + flags, all-gather descriptors
//!    over the host communicator, map the peers (P2P in this process, CUDA
//!    IPC across processes), and agree (all-reduce min) on whether every rank
//!    made it, so that all ranks take the same path.
//! 2. Collectives the kernel path takes are launched on the caller's stream
//!    (asynchronous, like NCCL); a communicator's send/recv/gather/scatter
//!    pieces of the batch become fused point-to-point kernels (ranks in one
//!    process, one stream).
//! 3. The rest (PreMulSum, point-to-point across processes or streams, no
//!    kernel path) is staged through host memory and runs with the batch's
//!    host operations in one libcomm `Group`: correct, slow, logged once.

use super::devcomm::DevComm;
use super::driver::{ContextGuard, stream_capturing};
use super::error::CudaError;
use super::mapping::DESCRIPTOR_BYTES;
use super::p2p::{P2p, is_p2p, p2p_pieces};
use super::staging::{Staging, op_device};
use crate::comm::Communicator;
use crate::error::{Error, Result};
use crate::group::{Group, GroupOp};
use crate::state::CommState;
use crate::types::{DataType, ReduceOp};
use std::ffi::c_void;
use std::sync::OnceLock;

/// A communicator's device side.
#[derive(Default)]
pub(crate) enum DevSlot {
    /// No operation on device memory yet.
    #[default]
    Unset,
    /// Set up on this device; the kernel path is off (some rank could not
    /// map its peers).
    Off(i32),
    /// Set up, kernel path on.
    On(Box<DevComm>),
}

/// One operation of a batch.
#[derive(Clone, Copy)]
pub struct DeviceOp<'a> {
    pub comm: &'a Communicator,
    pub op: GroupOp,
    /// `cudaStream_t` (NULL: the legacy default stream).
    pub stream: *mut c_void,
    /// The device of its buffers (None: host memory; see [`super::op_device`]).
    pub device: Option<i32>,
}

/// Where the backend's informational lines go (the C ABI routes them to
/// NCCL_DEBUG); `warn` marks warnings.
pub type Logger = fn(warn: bool, line: &str);
static LOGGER: OnceLock<Logger> = OnceLock::new();

/// Installs the logger (first call wins). Without one, warnings go to stderr
/// when `WEFT_DEBUG` is set.
pub fn set_logger(f: Logger) {
    let _ = LOGGER.set(f);
}

fn log(warn: bool, line: &str) {
    match LOGGER.get() {
        Some(f) => f(warn, line),
        None if warn && std::env::var_os("WEFT_DEBUG").is_some() => {
            eprintln!("weft WARN {line}")
        }
        None => {}
    }
}

fn cuda_err(what: &str, comm: &Communicator, e: CudaError) -> Error {
    Error::Cuda(format!("{what} on {}: {e}", comm.describe()))
}

/// Step 1 for every communicator of the batch that needs it.
fn setup(ops: &[DeviceOp<'_>]) -> Result<()> {
    let mut todo: Vec<(&Communicator, i32)> = Vec::new();
    for o in ops {
        if let Some(d) = o.device
            && matches!(*o.comm.dev_slot(), DevSlot::Unset)
            && !todo.iter().any(|(c, _)| std::ptr::eq(*c, o.comm))
        {
            todo.push((o.comm, d));
        }
    }
    if todo.is_empty() {
        return Ok(());
    }
    let mut created: Vec<Option<DevComm>> = Vec::with_capacity(todo.len());
    let mut descs: Vec<Vec<u8>> = Vec::with_capacity(todo.len());
    let mut gathered: Vec<Vec<u8>> = Vec::with_capacity(todo.len());
    for (c, d) in &todo {
        match DevComm::create(c.rank(), c.count(), *d) {
            Ok((dc, desc)) => {
                created.push(Some(dc));
                descs.push(desc);
            }
            Err(err) => {
                log(
                    true,
                    &format!("{}: CUDA kernel path unavailable: {err}", c.describe()),
                );
                created.push(None);
                descs.push(vec![0u8; DESCRIPTOR_BYTES]);
            }
        }
        gathered.push(vec![0u8; DESCRIPTOR_BYTES * c.count()]);
    }
    let mut g = Group::new();
    for (i, (c, _)) in todo.iter().enumerate() {
        let op = GroupOp::AllGather {
            send: descs[i].as_ptr(),
            recv: gathered[i].as_mut_ptr(),
            count: DESCRIPTOR_BYTES,
            dtype: DataType::U8,
        };
        unsafe { g.push_raw(c, op) }?;
    }
    g.execute()?;
    let mut ok = vec![[0u8]; todo.len()];
    let mut agreed = vec![[0u8]; todo.len()];
    for (i, (c, _)) in todo.iter().enumerate() {
        let all = &gathered[i];
        let everyone_created =
            (0..c.count()).all(|r| all[r * DESCRIPTOR_BYTES..r * DESCRIPTOR_BYTES + 8] != [0u8; 8]);
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
                        c.describe()
                    ),
                ),
            }
        }
    }
    let mut g = Group::new();
    for (i, (c, _)) in todo.iter().enumerate() {
        let op = GroupOp::AllReduce {
            send: ok[i].as_ptr(),
            recv: agreed[i].as_mut_ptr(),
            count: 1,
            dtype: DataType::U8,
            op: ReduceOp::Min,
        };
        unsafe { g.push_raw(c, op) }?;
    }
    g.execute()?;
    for (i, (c, d)) in todo.iter().enumerate() {
        let usable = agreed[i][0] & 1 == 1;
        let slot = match created[i].take() {
            Some(mut dc) if usable => {
                dc.set_usable(true);
                dc.set_lines(agreed[i][0] == 3);
                DevSlot::On(Box::new(dc))
            }
            // Created but unusable elsewhere: release it now.
            Some(dc) => {
                let _ = dc.finalize();
                DevSlot::Off(*d)
            }
            None => DevSlot::Off(*d),
        };
        log(
            false,
            &format!(
                "{}: CUDA device {d}: {}",
                c.describe(),
                if agreed[i][0] == 3 {
                    "kernel path on (peers mapped by P2P/IPC; NVLink everywhere: lines chain on)"
                } else if usable {
                    "kernel path on (peers mapped by P2P/IPC; some link is not NVLink-class: lines chain off)"
                } else {
                    "kernel path off: every operation stages through host memory (slow)"
                }
            ),
        );
        *c.dev_slot() = slot;
    }
    Ok(())
}

/// Point-to-point pieces of one communicator in a batch.
struct P2pBatch<'a> {
    comm: &'a Communicator,
    ops: Vec<DeviceOp<'a>>,
}

/// Runs a batch of operations (see the module docs). Host-memory operations
/// may be part of it (a group mixing both).
///
/// # Safety
/// Every operation's pointers must be valid for the sizes it names (device
/// memory of `device` where it says so) until its stream reaches it; every
/// rank of each communicator must submit the matching operations.
pub unsafe fn run(ops: &[DeviceOp<'_>]) -> Result<()> {
    for o in ops {
        o.comm.validate(&o.op)?;
        let st = o.comm.state();
        if st != CommState::Ready {
            return Err(o.comm.state_error(st, o.op.name()));
        }
        if let DevSlot::On(dc) = &*o.comm.dev_slot()
            && let Some(e) = dc.kernel_error()
        {
            return Err(Error::InvalidUsage(format!(
                "{}: an earlier operation failed on the GPU: {e}",
                o.comm.describe()
            )));
        }
    }
    for o in ops.iter().filter(|o| o.device.is_some()) {
        if stream_capturing(o.stream) {
            return Err(Error::Unsupported(format!(
                "{} on {}: the stream is being captured into a CUDA graph, which Weft does not support yet: its kernels take per-call sequence numbers and flags as arguments, so a replayed graph would reuse them and read stale data; run the operation outside capture (nccl-tests: without -G)",
                o.op.name(),
                o.comm.describe()
            )));
        }
    }
    let ops: Vec<DeviceOp<'_>> = ops.iter().copied().filter(|o| !o.op.is_empty()).collect();
    // The caller's current context (its cudaSetDevice) is back on return.
    let _ctx = ContextGuard::save();
    setup(&ops)?;
    let mut host: Vec<(&Communicator, GroupOp)> = Vec::new();
    let mut to_stage: Vec<DeviceOp<'_>> = Vec::new();
    let mut p2p: Vec<P2pBatch<'_>> = Vec::new();
    let mut first: Option<Error> = None;
    for o in &ops {
        if o.device.is_none() {
            host.push((o.comm, o.op));
            continue;
        }
        let mut slot = o.comm.dev_slot();
        let DevSlot::On(dc) = &mut *slot else {
            to_stage.push(*o);
            continue;
        };
        if is_p2p(&o.op) {
            match p2p.iter_mut().find(|b| std::ptr::eq(b.comm, o.comm)) {
                Some(b) => b.ops.push(*o),
                None => p2p.push(P2pBatch {
                    comm: o.comm,
                    ops: vec![*o],
                }),
            }
            continue;
        }
        match dc.plan(&o.op) {
            Some(plan) => {
                // The span covers the enqueue: the kernel runs after the call
                // returns, in stream order (as NCCL's calls return).
                let obs = crate::observe::start_with(
                    &o.comm.s.who(),
                    std::slice::from_ref(&o.op),
                    false,
                    Some(plan.algorithm()),
                );
                let r = unsafe { dc.launch(&plan, o.stream) }
                    .map_err(|e| cuda_err(o.op.name(), o.comm, e));
                crate::observe::finish(obs, &r);
                if let Err(e) = r {
                    first.get_or_insert(e);
                }
            }
            None => to_stage.push(*o),
        }
    }
    for b in p2p {
        let mut slot = b.comm.dev_slot();
        let DevSlot::On(dc) = &mut *slot else {
            unreachable!("p2p batches are only made for communicators with a kernel path")
        };
        let one_stream = b.ops.iter().all(|o| o.stream == b.ops[0].stream);
        if !(dc.p2p_ok() && one_stream) {
            to_stage.extend(b.ops);
            continue;
        }
        let pieces: Vec<P2p> = b
            .ops
            .iter()
            .flat_map(|o| p2p_pieces(&o.op, b.comm.rank(), b.comm.count()).unwrap_or_default())
            .collect();
        let ops: Vec<GroupOp> = b.ops.iter().map(|o| o.op).collect();
        let obs = crate::observe::start_with(&b.comm.s.who(), &ops, true, Some("p2p-kernel"));
        let r = unsafe { dc.launch_p2p(&pieces, b.ops[0].stream) }
            .map_err(|e| cuda_err("send/recv", b.comm, e));
        crate::observe::finish(obs, &r);
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
        let device = o.device.unwrap_or(0);
        let st = unsafe { Staging::begin(&o.op, o.comm.rank(), o.comm.count(), o.stream, device) }
            .map_err(|e| cuda_err(o.op.name(), o.comm, e))?;
        host.push((o.comm, st.op));
        staged.push(st);
    }
    if !host.is_empty() {
        let mut g = Group::new();
        for (c, op) in &host {
            unsafe { g.push_raw(c, *op) }?;
        }
        if let Err(err) = g.execute() {
            first.get_or_insert(err);
        }
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

/// Runs one operation on device (or host) memory on `stream`: the device is
/// found from the buffers.
///
/// # Safety
/// As [`run`].
pub unsafe fn submit(comm: &Communicator, op: GroupOp, stream: *mut c_void) -> Result<()> {
    let device = op_device(&op, comm.rank(), comm.count());
    unsafe {
        run(&[DeviceOp {
            comm,
            op,
            stream,
            device,
        }])
    }
}
