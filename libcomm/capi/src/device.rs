//! Device memory in the C ABI: routes operations on CUDA buffers to libcomm's
//! CUDA backend (`libcomm::cuda`).
//!
//! A batch (one call, or every operation of an outermost `ncclGroupEnd`):
//! 1. communicators seen with device buffers for the first time set up their
//!    device side together: allocate scratch + flags, all-gather descriptors
//!    over the host communicator, map the peers (P2P in this process, CUDA
//!    IPC across processes), and agree (all-reduce min) on whether every rank
//!    made it, so that all ranks take the same path;
//! 2. operations the kernel path takes are launched on the caller's stream
//!    (asynchronous, like NCCL);
//! 3. the rest (gather, scatter, send/recv, PreMulSum, or no kernel path) are
//!    staged through host memory and run with the host operations in one
//!    libcomm `Group`: correct, slow, and logged once at INFO.

use crate::errors::{CResult, Fail, Level, UNHANDLED_CUDA_ERROR, log};
use crate::handles::CommEntry;
use libcomm::cuda::{self, DESCRIPTOR_BYTES, DevComm, Staging};
use libcomm::{DataType, Group, GroupOp, ReduceOp};
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex};

/// One operation of a batch.
pub struct DevOp {
    pub entry: Arc<CommEntry>,
    pub op: GroupOp,
    /// `cudaStream_t` as an address.
    pub stream: usize,
    /// The device of its buffers (None: host memory).
    pub device: Option<i32>,
    pub what: &'static str,
}

type Shared = Arc<Mutex<Option<DevComm>>>;

/// Device sides by communicator serial (None: set up, kernel path off).
static DEV: Mutex<Option<HashMap<u64, Shared>>> = Mutex::new(None);

fn dev_of(serial: u64) -> Option<Shared> {
    DEV.lock()
        .unwrap_or_else(|e| e.into_inner())
        .get_or_insert_with(HashMap::new)
        .get(&serial)
        .cloned()
}

/// The CUDA device a communicator's device side lives on, if any.
pub fn comm_device(e: &CommEntry) -> Option<i32> {
    let d = dev_of(e.serial)?;
    let g = d.lock().unwrap_or_else(|e| e.into_inner());
    g.as_ref().map(|d| d.device())
}

/// Forgets a destroyed communicator's device side (its memory stays mapped
/// until the process ends: peers may still be reading it).
pub fn forget(serial: u64) {
    DEV.lock()
        .unwrap_or_else(|e| e.into_inner())
        .get_or_insert_with(HashMap::new)
        .remove(&serial);
}

fn cuda_fail(what: &str, e: String) -> Fail {
    Fail::new(UNHANDLED_CUDA_ERROR, format!("{what}: {e}"))
}

/// The device of an operation's buffers, when it has device buffers.
pub fn device_of(ptrs: &[*const c_void]) -> Option<i32> {
    if !cuda::driver_loaded() {
        return None;
    }
    ptrs.iter().find_map(|&p| cuda::pointer_device(p))
}

/// Step 1 for every communicator of the batch that needs it.
fn setup(ops: &[DevOp]) -> CResult<()> {
    let mut todo: Vec<(Arc<CommEntry>, i32)> = Vec::new();
    for o in ops {
        if let Some(d) = o.device
            && dev_of(o.entry.serial).is_none()
            && !todo.iter().any(|(e, _)| e.serial == o.entry.serial)
        {
            todo.push((o.entry.clone(), d));
        }
    }
    if todo.is_empty() {
        return Ok(());
    }
    let n = todo.len();
    let mut created: Vec<Option<DevComm>> = Vec::with_capacity(n);
    let mut descs: Vec<Vec<u8>> = Vec::with_capacity(n);
    let mut gathered: Vec<Vec<u8>> = Vec::with_capacity(n);
    for (e, d) in &todo {
        match DevComm::create(e.comm.rank(), e.comm.count(), *d) {
            Ok((dc, desc)) => {
                created.push(Some(dc));
                descs.push(desc);
            }
            Err(err) => {
                log(
                    Level::Warn,
                    &format!("{}: CUDA kernel path unavailable: {err}", e.describe()),
                );
                created.push(None);
                descs.push(vec![0u8; DESCRIPTOR_BYTES]);
            }
        }
        gathered.push(vec![0u8; DESCRIPTOR_BYTES * e.comm.count()]);
    }
    {
        let mut g = Group::new();
        for (i, (e, _)) in todo.iter().enumerate() {
            let op = GroupOp::AllGather {
                send: descs[i].as_ptr(),
                recv: gathered[i].as_mut_ptr(),
                count: DESCRIPTOR_BYTES,
                dtype: DataType::U8,
            };
            unsafe { g.push_raw(&e.comm, op) }.map_err(Fail::from)?;
        }
        g.execute().map_err(Fail::from)?;
    }
    let mut ok: Vec<[u8; 1]> = vec![[0u8]; n];
    let mut agreed: Vec<[u8; 1]> = vec![[0u8]; n];
    for (i, (e, _)) in todo.iter().enumerate() {
        let all = &gathered[i];
        let everyone_created = (0..e.comm.count())
            .all(|r| all[r * DESCRIPTOR_BYTES..r * DESCRIPTOR_BYTES + 8] != [0u8; 8]);
        if let Some(dc) = created[i].as_mut()
            && everyone_created
        {
            match dc.connect(all) {
                Ok(()) => ok[i][0] = 1,
                Err(err) => log(
                    Level::Warn,
                    &format!(
                        "{}: CUDA kernel path unavailable (staging through host memory): {err}",
                        e.describe()
                    ),
                ),
            }
        }
    }
    {
        let mut g = Group::new();
        for (i, (e, _)) in todo.iter().enumerate() {
            let op = GroupOp::AllReduce {
                send: ok[i].as_ptr(),
                recv: agreed[i].as_mut_ptr(),
                count: 1,
                dtype: DataType::U8,
                op: ReduceOp::Min,
            };
            unsafe { g.push_raw(&e.comm, op) }.map_err(Fail::from)?;
        }
        g.execute().map_err(Fail::from)?;
    }
    let mut map = DEV.lock().unwrap_or_else(|e| e.into_inner());
    let map = map.get_or_insert_with(HashMap::new);
    for (i, (e, d)) in todo.iter().enumerate() {
        let usable = agreed[i][0] == 1;
        let mut dc = created[i].take();
        if let Some(dc) = dc.as_mut() {
            dc.set_usable(usable);
        }
        log(
            Level::Info,
            &format!(
                "{}: CUDA device {d}: {}",
                e.describe(),
                if usable {
                    "kernel path on (peers mapped by P2P/IPC)"
                } else {
                    "kernel path off: every operation stages through host memory (slow)"
                }
            ),
        );
        map.insert(e.serial, Arc::new(Mutex::new(dc)));
    }
    Ok(())
}

/// Runs a batch of operations (see the module docs).
pub fn run(ops: Vec<DevOp>) -> CResult<()> {
    // The caller's current context (its cudaSetDevice) is back on return.
    let _ctx = cuda::ContextGuard::save();
    setup(&ops)?;
    let mut host: Vec<(Arc<CommEntry>, GroupOp, &'static str)> = Vec::new();
    let mut staged: Vec<Staging> = Vec::new();
    let mut first: Option<Fail> = None;
    for o in ops {
        let Some(device) = o.device else {
            host.push((o.entry, o.op, o.what));
            continue;
        };
        let shared = dev_of(o.entry.serial);
        let mut launched = false;
        if let Some(s) = shared {
            let mut g = s.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(dc) = g.as_mut()
                && let Some(plan) = dc.plan(&o.op)
            {
                if let Err(e) = unsafe { dc.launch(&plan, o.stream as *mut c_void) } {
                    first.get_or_insert(cuda_fail(o.what, e).context(o.entry.describe()));
                }
                launched = true;
            }
        }
        if launched {
            continue;
        }
        static ONCE: std::sync::Once = std::sync::Once::new();
        ONCE.call_once(|| {
            log(
                Level::Info,
                &format!(
                    "{} on device memory stages through host memory (correct, slow: no kernel path for it here)",
                    o.what
                ),
            )
        });
        let st = unsafe {
            Staging::begin(
                &o.op,
                o.entry.comm.rank(),
                o.entry.comm.count(),
                o.stream as *mut c_void,
                device,
            )
        }
        .map_err(|e| cuda_fail(o.what, e).context(o.entry.describe()))?;
        host.push((o.entry, st.op, o.what));
        staged.push(st);
    }
    if !host.is_empty() {
        let mut g = Group::new();
        for (e, op, what) in &host {
            unsafe { g.push_raw(&e.comm, *op) }
                .map_err(|err| Fail::from(err).context(format!("{what} on {}", e.describe())))?;
        }
        if let Err(err) = g.execute() {
            first.get_or_insert(Fail::from(err));
        }
    }
    for st in staged {
        if let Err(e) = st.finish() {
            first.get_or_insert(cuda_fail("copying staged results to the device", e));
        }
    }
    match first {
        Some(f) => Err(f),
        None => Ok(()),
    }
}
