//! The host-local phases of a plan ([`LocalStep`]) in host memory: each
//! step lowered to sends and receives among the host's ranks (a
//! [`LocalMover`]) plus copies and reductions in local rank order. On GPUs
//! these steps are the NVLink kernels of a host-local sub-communicator
//! instead (docs/ARCHITECTURE.md, "Across hosts").
//!
//! Two movers: `CommMover` (`comm/cross_mover.rs`: a host-local libcomm
//! communicator, ranks as processes over shared-memory rings), and
//! [`BoardMover`], ranks that are threads of one process handing each other
//! pointers.

use super::plan::{LocalStep, Region};
use crate::data::types::{DataType, ReduceOp};
use crate::error::{Error, Result};
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// Moves bytes among the ranks of one host.
pub trait LocalMover: Send {
    /// This rank's index among the host's ranks, and their number.
    fn local_rank(&self) -> usize;
    fn local_size(&self) -> usize;
    /// Every send to its local rank and every receive from one, all at once
    /// (sends to a rank meet its receives from this rank in order).
    ///
    /// # Safety
    /// Every pointer is valid for its length until the call returns.
    unsafe fn exchange(
        &mut self,
        sends: &[(usize, *const u8, usize)],
        recvs: &[(usize, *mut u8, usize)],
    ) -> Result<()>;
    /// The rank (as the job knows it) whose wait made the last failed
    /// exchange time out, when the mover knows it.
    fn stalled_on(&self) -> Option<usize> {
        None
    }
}

/// Where the ranks (threads) of one host meet: posted sends, by (from, to).
pub struct HostBoard {
    size: usize,
    posts: Mutex<HashMap<(usize, usize), VecDeque<Posted>>>,
    moved: Condvar,
    /// How long a rank waits for a peer's post or pickup.
    patience: Duration,
}

struct Posted {
    ptr: usize,
    len: usize,
    taken: Arc<AtomicBool>,
}

impl HostBoard {
    pub fn new(size: usize, patience: Duration) -> Arc<HostBoard> {
        Arc::new(HostBoard {
            size,
            posts: Mutex::new(HashMap::new()),
            moved: Condvar::new(),
            patience,
        })
    }
}

/// One thread-rank's side of a [`HostBoard`].
pub struct BoardMover {
    pub board: Arc<HostBoard>,
    pub me: usize,
}

impl LocalMover for BoardMover {
    fn local_rank(&self) -> usize {
        self.me
    }
    fn local_size(&self) -> usize {
        self.board.size
    }
    unsafe fn exchange(
        &mut self,
        sends: &[(usize, *const u8, usize)],
        recvs: &[(usize, *mut u8, usize)],
    ) -> Result<()> {
        let b = &self.board;
        let deadline = Instant::now() + b.patience;
        let mut mine = Vec::new();
        {
            let mut g = b.posts.lock().unwrap_or_else(|e| e.into_inner());
            for &(p, ptr, len) in sends {
                let taken = Arc::new(AtomicBool::new(false));
                g.entry((self.me, p)).or_default().push_back(Posted {
                    ptr: ptr as usize,
                    len,
                    taken: taken.clone(),
                });
                mine.push((p, taken));
            }
        }
        b.moved.notify_all();
        let timeout = |what: String| Error::Timeout {
            comm: "host board".into(),
            rank: self.me,
            after_ms: b.patience.as_millis() as u64,
            waiting_for: what,
        };
        for &(p, ptr, len) in recvs {
            let mut g = b.posts.lock().unwrap_or_else(|e| e.into_inner());
            let post = loop {
                if let Some(post) = g.get_mut(&(p, self.me)).and_then(VecDeque::pop_front) {
                    break post;
                }
                if Instant::now() >= deadline {
                    return Err(timeout(format!("for local rank {p} to send")));
                }
                g = b
                    .moved
                    .wait_timeout(g, Duration::from_millis(50))
                    .unwrap_or_else(|e| e.into_inner())
                    .0;
            };
            drop(g);
            if post.len != len {
                post.taken.store(true, Ordering::Release);
                b.moved.notify_all();
                return Err(Error::InvalidUsage(format!(
                    "local rank {p} sent {} bytes where {len} were expected",
                    post.len
                )));
            }
            // SAFETY: the sender keeps its buffer until it sees `taken`.
            unsafe { std::ptr::copy(post.ptr as *const u8, ptr, len) };
            post.taken.store(true, Ordering::Release);
            b.moved.notify_all();
        }
        let mut g = b.posts.lock().unwrap_or_else(|e| e.into_inner());
        while let Some((p, _)) = mine.iter().find(|(_, t)| !t.load(Ordering::Acquire)) {
            if Instant::now() >= deadline {
                return Err(timeout(format!("for local rank {p} to receive")));
            }
            g = b
                .moved
                .wait_timeout(g, Duration::from_millis(50))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        Ok(())
    }
}

/// How a step reaches the memory of its regions.
pub struct Mem<'a> {
    pub at: &'a dyn Fn(&Region) -> *mut u8,
    pub esize: usize,
    pub reduce: Option<(DataType, ReduceOp)>,
}

impl Mem<'_> {
    fn bytes(&self, r: &Region) -> usize {
        r.count * self.esize
    }

    /// `dst = c_0 op c_1 op ...` over `parts` (pointers to `count` elements
    /// each), in order.
    unsafe fn fold(&self, dst: *mut u8, parts: &[*const u8], count: usize) -> Result<()> {
        let (dt, op) = self
            .reduce
            .ok_or_else(|| Error::Internal("a local reduction without a reduction".into()))?;
        unsafe {
            std::ptr::copy(parts[0], dst, count * self.esize);
            for &p in &parts[1..] {
                crate::data::reduce::combine(dt, op.combine(), dst, dst, p, count);
            }
        }
        Ok(())
    }
}

/// Sends `sends`, receives every other local rank's `count` elements, and
/// reduces them with this rank's `own` into `dst`, in local rank order.
unsafe fn reduce_in(
    mover: &mut dyn LocalMover,
    mem: &Mem<'_>,
    sends: &[(usize, *const u8, usize)],
    own: *const u8,
    count: usize,
    dst: *mut u8,
) -> Result<()> {
    let (me, k) = (mover.local_rank(), mover.local_size());
    let stride = count * mem.esize;
    let mut t = vec![0u128; (stride * k).div_ceil(16)];
    let tp = t.as_mut_ptr().cast::<u8>();
    // SAFETY: slot j of `t` holds `stride` bytes.
    let slot = |j: usize| unsafe { tp.add(j * stride) };
    let recvs: Vec<_> = (0..k)
        .filter(|&j| j != me)
        .map(|j| (j, slot(j), stride))
        .collect();
    unsafe { mover.exchange(sends, &recvs)? };
    let order: Vec<*const u8> = (0..k)
        .map(|j| if j == me { own } else { slot(j) as *const u8 })
        .collect();
    if count > 0 {
        unsafe { mem.fold(dst, &order, count)? };
    }
    Ok(())
}

/// Runs one local step for this rank.
///
/// # Safety
/// The regions of `step` must lie inside live buffers `mem` points into.
pub unsafe fn run_local(step: &LocalStep, mover: &mut dyn LocalMover, mem: &Mem<'_>) -> Result<()> {
    let (me, k) = (mover.local_rank(), mover.local_size());
    let ptr = |r: &Region| (mem.at)(r);
    let len = |r: &Region| mem.bytes(r);
    let copy = |src: &Region, dst: &Region| {
        let (s, d) = (ptr(src), ptr(dst));
        if s != d {
            // SAFETY: both inside live buffers (the caller's promise).
            unsafe { std::ptr::copy(s, d, len(src)) };
        }
    };
    // `f(j)` to (or from) every other local rank.
    let to_each = |f: &dyn Fn(usize) -> Region| -> Vec<(usize, *const u8, usize)> {
        (0..k)
            .filter(|&j| j != me)
            .map(|j| (j, ptr(&f(j)) as *const u8, len(&f(j))))
            .collect()
    };
    let from_each = |f: &dyn Fn(usize) -> Region| -> Vec<(usize, *mut u8, usize)> {
        (0..k)
            .filter(|&j| j != me)
            .map(|j| (j, ptr(&f(j)), len(&f(j))))
            .collect()
    };
    match step {
        LocalStep::ReduceScatter { src, parts, dst } => unsafe {
            let sends = to_each(&|j| src.part(parts[j]));
            let own = ptr(&src.part(parts[me]));
            reduce_in(mover, mem, &sends, own, parts[me].count, ptr(dst))?;
        },
        LocalStep::AllGather { src, parts, dst } => {
            copy(src, &dst.part(parts[me]));
            unsafe { mover.exchange(&to_each(&|_| *src), &from_each(&|j| dst.part(parts[j])))? };
        }
        // Outside the root, a rooted step is one transfer with the root:
        // this rank's input to it (reduce, gather) or its output from it.
        LocalStep::Reduce { src, root, .. } | LocalStep::Gather { src, root, .. }
            if me != *root =>
        unsafe {
            mover.exchange(&[(*root, ptr(src), len(src))], &[])?;
        },
        LocalStep::Broadcast { buf: dst, root } | LocalStep::Scatter { dst, root, .. }
            if me != *root =>
        unsafe {
            mover.exchange(&[], &[(*root, ptr(dst), len(dst))])?;
        },
        // The root's side of each rooted step.
        LocalStep::Reduce { src, dst, .. } => unsafe {
            reduce_in(mover, mem, &[], ptr(src), src.count, ptr(dst))?;
        },
        LocalStep::Broadcast { buf, .. } => unsafe {
            mover.exchange(&to_each(&|_| *buf), &[])?;
        },
        LocalStep::Gather {
            src, parts, dst, ..
        } => {
            copy(src, &dst.part(parts[me]));
            unsafe { mover.exchange(&[], &from_each(&|j| dst.part(parts[j])))? };
        }
        LocalStep::Scatter {
            src, parts, dst, ..
        } => {
            unsafe { mover.exchange(&to_each(&|j| src.part(parts[j])), &[])? };
            copy(&src.part(parts[me]), dst);
        }
        LocalStep::AllToAll { src, out, dst, inp } => {
            let sends = to_each(&|j| src.part(out[j]));
            unsafe { mover.exchange(&sends, &from_each(&|j| dst.part(inp[j])))? };
            copy(&src.part(out[me]), &dst.part(inp[me]));
        }
        LocalStep::SendRecv { sends, recvs } => {
            let s: Vec<_> = sends
                .iter()
                .map(|(j, r)| (*j, ptr(r) as *const u8, len(r)))
                .collect();
            let r: Vec<_> = recvs.iter().map(|(j, r)| (*j, ptr(r), len(r))).collect();
            unsafe { mover.exchange(&s, &r)? };
        }
    }
    Ok(())
}
