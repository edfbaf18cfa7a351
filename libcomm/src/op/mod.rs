//! The operation descriptor: one value describing one collective or
//! point-to-point call (NCCL's `ncclInfo`): kind, buffers, count, data type,
//! reduction, root or peer, and where its buffers live (host memory, or a
//! CUDA device and the stream it is ordered on).
//!
//! Every layer takes an [`Op`]: the Rust API's typed methods build one (in
//! [`typed`], with the slice-length checks) and call
//! [`Communicator::submit`](crate::comm::Communicator::submit); the C ABI builds
//! one per call; groups hold them; the host algorithms, the CUDA
//! planner, the observer and the benchmark read them. This module alone owns
//! what an operation means: [`Op::bytes`], [`Op::buffers`] (what it reads and
//! writes on a rank) and [`Op::validate`] (every argument check).

pub(crate) mod backend;
pub mod tuner;

use crate::data::types::{DataType, ReduceOp};
use crate::error::{Error, Result};
use std::ffi::c_void;

/// The operation's kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OpKind {
    AllReduce,
    Broadcast,
    Reduce,
    AllGather,
    ReduceScatter,
    AllToAll,
    Gather,
    Scatter,
    Send,
    Recv,
}

/// Every [`OpKind`]'s name in declaration order, then `group` (a batch of
/// operations): the names observers see (`observe::OpName`).
pub const OP_NAMES: [&str; 11] = [
    "all_reduce",
    "broadcast",
    "reduce",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "gather",
    "scatter",
    "send",
    "recv",
    "group",
];

impl OpKind {
    /// Every kind, in declaration order (the order of [`OP_NAMES`]).
    pub const ALL: [OpKind; 10] = [
        OpKind::AllReduce,
        OpKind::Broadcast,
        OpKind::Reduce,
        OpKind::AllGather,
        OpKind::ReduceScatter,
        OpKind::AllToAll,
        OpKind::Gather,
        OpKind::Scatter,
        OpKind::Send,
        OpKind::Recv,
    ];

    pub fn name(self) -> &'static str {
        OP_NAMES[self as usize]
    }
}

/// Where an operation's buffers live: it picks the data-plane backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Memory {
    /// Host memory: the host algorithms over shared memory and TCP.
    #[default]
    Host,
    /// Memory of this CUDA device: the device backend (kernels on the
    /// operation's stream, or staging through host memory).
    Device(i32),
}

/// One operation, as raw pointers.
///
/// `send` is the input (a send's buffer), `recv` the output (a receive's
/// buffer); the other one is null for send and recv. `root` is the root of
/// broadcast, reduce, gather and scatter and the peer of send and recv.
/// `count` is NCCL's: the elements of one rank's block (all-gather's send
/// count, reduce-scatter's receive count, all-to-all's count per peer).
#[derive(Debug, Clone, Copy)]
pub struct Op {
    pub kind: OpKind,
    pub send: *const u8,
    pub recv: *mut u8,
    pub count: usize,
    pub dtype: DataType,
    /// The reduction (None for operations that do not reduce).
    pub redop: Option<ReduceOp>,
    /// Root, or peer for send and recv (0 where neither applies).
    pub root: usize,
    pub memory: Memory,
    /// `cudaStream_t` for device memory (NULL: the legacy default stream).
    pub stream: *mut c_void,
}

/// One buffer of an operation on one rank: address, bytes, written or read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Buf {
    pub ptr: u64,
    pub bytes: usize,
    pub write: bool,
}

/// The collectives' constructors, one line each: every one takes `send`,
/// `recv`, `count` and `dtype`, then its own arguments (`name(args) =>
/// kind, reduction, root`), and fills the rest of the [`Op`] alike.
macro_rules! collectives {
    ($($(#[$doc:meta])* $name:ident($($arg:ident: $ty:ty),*) => $kind:ident, $redop:expr, $root:expr;)*) => {$(
        $(#[$doc])*
        pub fn $name(
            send: *const u8,
            recv: *mut u8,
            count: usize,
            dtype: DataType,
            $($arg: $ty),*
        ) -> Op {
            Op::new(OpKind::$kind, send, recv, count, dtype, $redop, $root)
        }
    )*};
}

impl Op {
    #[allow(clippy::too_many_arguments)]
    fn new(
        kind: OpKind,
        send: *const u8,
        recv: *mut u8,
        count: usize,
        dtype: DataType,
        redop: Option<ReduceOp>,
        root: usize,
    ) -> Op {
        Op {
            kind,
            send,
            recv,
            count,
            dtype,
            redop,
            root,
            memory: Memory::Host,
            stream: std::ptr::null_mut(),
        }
    }

    collectives! {
        /// `send`/`recv` hold `count` elements (they may be equal: in place).
        all_reduce(op: ReduceOp) => AllReduce, Some(op), 0;
        /// `recv` holds `count` elements everywhere; `send` is read at the root.
        broadcast(root: usize) => Broadcast, None, root;
        /// `send` holds `count` elements; `recv` is written at the root.
        reduce(op: ReduceOp, root: usize) => Reduce, Some(op), root;
        /// `recv` holds `count * nranks` elements; in place: `send == recv + rank * count`.
        all_gather() => AllGather, None, 0;
        /// `send` holds `count * nranks` elements; in place: `recv == send + rank * count`.
        reduce_scatter(op: ReduceOp) => ReduceScatter, Some(op), 0;
        /// `count` elements to and from every rank (`count * nranks` in each buffer).
        all_to_all() => AllToAll, None, 0;
        /// The root's `recv` holds `count * nranks` elements; `send` holds `count`.
        gather(root: usize) => Gather, None, root;
        /// The root's `send` holds `count * nranks` elements; `recv` holds `count`.
        scatter(root: usize) => Scatter, None, root;
    }

    /// Sends `count` elements of `buf` to `peer`.
    pub fn send(buf: *const u8, count: usize, dtype: DataType, peer: usize) -> Op {
        Op::new(
            OpKind::Send,
            buf,
            std::ptr::null_mut(),
            count,
            dtype,
            None,
            peer,
        )
    }

    /// Receives `count` elements from `peer` into `buf`.
    pub fn recv(buf: *mut u8, count: usize, dtype: DataType, peer: usize) -> Op {
        Op::new(
            OpKind::Recv,
            std::ptr::null(),
            buf,
            count,
            dtype,
            None,
            peer,
        )
    }

    /// The same operation with its buffers in `memory`, ordered on `stream`
    /// (device memory; NULL: the legacy default stream).
    pub fn on(mut self, memory: Memory, stream: *mut c_void) -> Op {
        self.memory = memory;
        self.stream = stream;
        self
    }

    pub fn name(&self) -> &'static str {
        self.kind.name()
    }

    /// The peer of a send or receive (its `root` field).
    pub fn peer(&self) -> usize {
        self.root
    }

    /// The single buffer of a send or receive.
    pub fn p2p_buf(&self) -> *const u8 {
        match self.kind {
            OpKind::Recv => self.recv.cast_const(),
            _ => self.send,
        }
    }

    /// Bytes of one rank's block: `count` elements of `dtype`.
    pub fn bytes(&self) -> usize {
        self.count * self.dtype.size()
    }

    /// All of the collective's data on `nranks` ranks, the same on every
    /// rank: an all-gather's output, a reduce-scatter's input, an
    /// all-to-all's buffer; one rank's buffer for the others.
    pub fn whole_bytes(&self, nranks: usize) -> usize {
        match self.kind {
            OpKind::AllGather | OpKind::ReduceScatter | OpKind::AllToAll => {
                self.bytes().saturating_mul(nranks)
            }
            _ => self.bytes(),
        }
    }

    /// Zero-count collectives are no-ops (sends/receives of 0 bytes still match up).
    pub fn is_empty(&self) -> bool {
        !self.is_send_recv() && self.count == 0
    }

    /// An all-to-all of `nranks` ranks as the group it means: a send of
    /// block p of the input to rank p and a receive of block p of the output
    /// from rank p, for every rank p but those `skip` says (the cross-host
    /// paths: `cuda/pinned_plan.rs` copies its own block apart,
    /// `comm/hier_p2p.rs` keeps it as a pair to itself).
    pub fn all_to_all_as_sends_and_receives(
        &self,
        nranks: usize,
        skip: impl Fn(usize) -> bool,
    ) -> Vec<Op> {
        debug_assert_eq!(self.kind, OpKind::AllToAll);
        let block = self.bytes();
        (0..nranks)
            .filter(|&p| !skip(p))
            .flat_map(|p| {
                let at = p * block;
                [
                    Op::send(self.send.wrapping_add(at), self.count, self.dtype, p),
                    Op::recv(self.recv.wrapping_add(at), self.count, self.dtype, p),
                ]
            })
            .map(|o| o.on(self.memory, self.stream))
            .collect()
    }

    /// A gather or scatter on rank `rank` as the group it means (as NCCL
    /// builds them): a rank other than the root sends its block to the
    /// root (gather) or receives its block from it (scatter); the root
    /// receives (sends) block p from (to) every rank p, its own as a pair
    /// to itself. For the cross-host paths, which route sends and receives
    /// by host (`comm/hier_p2p.rs`) and over the engine's connections.
    pub fn gather_or_scatter_as_sends_and_receives(&self, rank: usize, nranks: usize) -> Vec<Op> {
        debug_assert!(matches!(self.kind, OpKind::Gather | OpKind::Scatter));
        let (gather, root, block) = (self.kind == OpKind::Gather, self.root, self.bytes());
        let send = |p: *const u8, to: usize| Op::send(p, self.count, self.dtype, to);
        let recv = |p: *mut u8, from: usize| Op::recv(p, self.count, self.dtype, from);
        let mut ops = Vec::new();
        if rank != root {
            ops.push(if gather {
                send(self.send, root)
            } else {
                recv(self.recv, root)
            });
        } else {
            for p in 0..nranks {
                let at = p * block;
                if gather {
                    if p == rank {
                        ops.push(send(self.send, p));
                    }
                    ops.push(recv(self.recv.wrapping_add(at), p));
                } else {
                    ops.push(send(self.send.wrapping_add(at), p));
                    if p == rank {
                        ops.push(recv(self.recv, p));
                    }
                }
            }
        }
        ops.into_iter()
            .map(|o| o.on(self.memory, self.stream))
            .collect()
    }

    /// Send or receive (what a group fuses into one exchange).
    pub fn is_send_recv(&self) -> bool {
        matches!(self.kind, OpKind::Send | OpKind::Recv)
    }

    /// Rewrites both buffer pointers through `f` (the staging path's host copies).
    pub fn map_ptrs(&self, f: impl Fn(u64) -> u64) -> Op {
        let mut o = *self;
        o.send = f(self.send as u64) as *const u8;
        o.recv = f(self.recv as u64) as *mut u8;
        o
    }

    /// The buffers this operation reads and writes on rank `rank` of
    /// `nranks` (NCCL's rules: a root-only buffer is not touched elsewhere),
    /// empty and NULL ones left out.
    pub fn buffers(&self, rank: usize, nranks: usize) -> Vec<Buf> {
        let b = |p: *const u8, count: usize, write: bool| Buf {
            ptr: p as u64,
            bytes: count * self.dtype.size(),
            write,
        };
        let (send, recv, count, at_root) = (self.send, self.recv.cast_const(), self.count, {
            rank == self.root
        });
        let all = count * nranks;
        let mut v = Vec::new();
        match self.kind {
            OpKind::AllReduce => v.extend([b(send, count, false), b(recv, count, true)]),
            OpKind::Broadcast => {
                if at_root {
                    v.push(b(send, count, false));
                }
                v.push(b(recv, count, true));
            }
            OpKind::Reduce => {
                v.push(b(send, count, false));
                if at_root {
                    v.push(b(recv, count, true));
                }
            }
            OpKind::AllGather => v.extend([b(send, count, false), b(recv, all, true)]),
            OpKind::ReduceScatter => v.extend([b(send, all, false), b(recv, count, true)]),
            OpKind::AllToAll => v.extend([b(send, all, false), b(recv, all, true)]),
            OpKind::Gather => {
                v.push(b(send, count, false));
                if at_root {
                    v.push(b(recv, all, true));
                }
            }
            OpKind::Scatter => {
                if at_root {
                    v.push(b(send, all, false));
                }
                v.push(b(recv, count, true));
            }
            OpKind::Send => v.push(b(send, count, false)),
            OpKind::Recv => v.push(b(recv, count, true)),
        }
        v.retain(|b| b.bytes > 0 && b.ptr != 0);
        v
    }

    /// Checks the arguments for rank `me` of `n` ranks, without running it:
    /// byte counts that fit the address space, NULL buffers, root or peer in
    /// range, buffers that overlap other than in NCCL's in-place layout.
    pub fn validate(&self, me: usize, n: usize) -> Result<()> {
        let what = self.name();
        let (send, recv, count, dtype, root) =
            (self.send, self.recv, self.count, self.dtype, self.root);
        // `role`: "root", or "peer" for send and recv.
        let in_range = |role: &str| -> Result<()> {
            if root >= n {
                return Err(Error::arg(format!(
                    "{what}: {role} {root} is out of range for {n} ranks"
                )));
            }
            Ok(())
        };
        let reduces = matches!(
            self.kind,
            OpKind::AllReduce | OpKind::Reduce | OpKind::ReduceScatter
        );
        if reduces && self.redop.is_none() {
            // Only a hand-built descriptor lacks it (the constructors set it).
            return Err(Error::arg(format!("{what}: no reduction operator")));
        }
        let times_n = count.saturating_mul(n);
        let same = std::ptr::eq(send, recv);
        match self.kind {
            OpKind::AllReduce => {
                let b = bytes_of(count, dtype, what)?;
                check_ptr(send, b, "all_reduce: send buffer")?;
                check_ptr(recv, b, "all_reduce: receive buffer")?;
                check_overlap(send, b, recv, b, same, what)
            }
            OpKind::Broadcast => {
                let b = bytes_of(count, dtype, what)?;
                in_range("root")?;
                if me == root {
                    check_ptr(send, b, "broadcast: send buffer (root)")?;
                    check_overlap(send, b, recv, b, same, what)?;
                }
                check_ptr(recv, b, "broadcast: receive buffer")
            }
            OpKind::Reduce => {
                let b = bytes_of(count, dtype, what)?;
                in_range("root")?;
                check_ptr(send, b, "reduce: send buffer")?;
                if me == root {
                    check_ptr(recv, b, "reduce: receive buffer (root)")?;
                    check_overlap(send, b, recv, b, same, what)?;
                }
                Ok(())
            }
            OpKind::AllGather => {
                let b = bytes_of(count, dtype, what)?;
                let total = bytes_of(times_n, dtype, what)?;
                check_ptr(send, b, "all_gather: send buffer")?;
                check_ptr(recv, total, "all_gather: receive buffer")?;
                let inplace = std::ptr::eq(send, recv.wrapping_add(me * b));
                check_overlap(send, b, recv, total, inplace, what)
            }
            OpKind::ReduceScatter => {
                let b = bytes_of(count, dtype, what)?;
                let total = bytes_of(times_n, dtype, what)?;
                check_ptr(send, total, "reduce_scatter: send buffer")?;
                check_ptr(recv, b, "reduce_scatter: receive buffer")?;
                let inplace = std::ptr::eq(recv, send.wrapping_add(me * b));
                check_overlap(send, total, recv, b, inplace, what)
            }
            OpKind::AllToAll => {
                let total = bytes_of(times_n, dtype, what)?;
                check_ptr(send, total, "all_to_all: send buffer")?;
                check_ptr(recv, total, "all_to_all: receive buffer")?;
                check_overlap(send, total, recv, total, same, what)
            }
            OpKind::Gather => {
                let b = bytes_of(count, dtype, what)?;
                in_range("root")?;
                check_ptr(send, b, "gather: send buffer")?;
                if me == root {
                    check_ptr(
                        recv,
                        bytes_of(times_n, dtype, what)?,
                        "gather: receive buffer (root)",
                    )?;
                }
                Ok(())
            }
            OpKind::Scatter => {
                let b = bytes_of(count, dtype, what)?;
                in_range("root")?;
                check_ptr(recv, b, "scatter: receive buffer")?;
                if me == root {
                    check_ptr(
                        send,
                        bytes_of(times_n, dtype, what)?,
                        "scatter: send buffer (root)",
                    )?;
                }
                Ok(())
            }
            OpKind::Send => {
                in_range("peer")?;
                check_ptr(send, bytes_of(count, dtype, what)?, "send: buffer")
            }
            OpKind::Recv => {
                in_range("peer")?;
                check_ptr(recv, bytes_of(count, dtype, what)?, "recv: buffer")
            }
        }
    }
}

/// The descriptors of the typed, slice-based API: [`Communicator`]'s typed
/// methods and [`Group`]'s build their operations here, so each slice-length
/// rule (and its message) is written once. `rank` and `nranks` are the
/// communicator's. The descriptors hold the slices' pointers and do not
/// borrow them: the caller keeps the slices alive until the operation ran.
///
/// [`Communicator`]: crate::comm::Communicator
/// [`Group`]: crate::comm::Group
pub mod typed {
    use super::Op;
    use crate::data::types::{Element, ReduceOp};
    use crate::error::{Error, Result};

    /// `what`'s length error unless `ok`; `detail` says what was wrong.
    fn lengths(ok: bool, what: &str, detail: impl FnOnce() -> String) -> Result<()> {
        if ok {
            return Ok(());
        }
        Err(Error::arg(format!("{what}: {}", detail())))
    }

    /// The slices as a descriptor's `send` and `recv`.
    fn ptrs<T>(send: &[T], recv: &mut [T]) -> (*const u8, *mut u8) {
        (send.as_ptr().cast(), recv.as_mut_ptr().cast())
    }

    /// In place: `buf` as both `send` and `recv`.
    fn same<T>(buf: &mut [T]) -> (*const u8, *mut u8) {
        let p = buf.as_mut_ptr().cast::<u8>();
        (p, p)
    }

    /// `buf` split into `nranks` equal blocks: the block's length.
    fn block<T>(what: &str, buf: &[T], nranks: usize) -> Result<usize> {
        let len = buf.len();
        lengths(len.is_multiple_of(nranks), what, || {
            format!("{len} elements do not divide into {nranks} ranks")
        })?;
        Ok(len / nranks)
    }

    /// `send` and `recv` of equal length.
    pub fn all_reduce<T: Element>(send: &[T], recv: &mut [T], op: ReduceOp) -> Result<Op> {
        let (n, m) = (send.len(), recv.len());
        lengths(n == m, "all_reduce", || {
            format!("send has {n} elements, receive {m}")
        })?;
        let (s, r) = ptrs(send, recv);
        Ok(Op::all_reduce(s, r, n, T::DTYPE, op))
    }

    pub fn all_reduce_in_place<T: Element>(buf: &mut [T], op: ReduceOp) -> Result<Op> {
        let (s, r) = same(buf);
        Ok(Op::all_reduce(s, r, buf.len(), T::DTYPE, op))
    }

    /// `send` is read on the root only (others may pass an empty slice).
    pub fn broadcast<T: Element>(
        send: &[T],
        recv: &mut [T],
        root: usize,
        rank: usize,
    ) -> Result<Op> {
        let (n, m) = (send.len(), recv.len());
        lengths(rank != root || n == m, "broadcast", || {
            format!("root's send has {n} elements, receive {m}")
        })?;
        let (s, r) = ptrs(send, recv);
        Ok(Op::broadcast(s, r, m, T::DTYPE, root))
    }

    pub fn broadcast_in_place<T: Element>(buf: &mut [T], root: usize) -> Result<Op> {
        let (s, r) = same(buf);
        Ok(Op::broadcast(s, r, buf.len(), T::DTYPE, root))
    }

    /// `recv` is written on the root only (others may pass an empty slice).
    pub fn reduce<T: Element>(
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
        root: usize,
        rank: usize,
    ) -> Result<Op> {
        let (n, m) = (send.len(), recv.len());
        lengths(rank != root || n == m, "reduce", || {
            format!("send has {n} elements, root's receive {m}")
        })?;
        let (s, r) = ptrs(send, recv);
        Ok(Op::reduce(s, r, n, T::DTYPE, op, root))
    }

    pub fn reduce_in_place<T: Element>(buf: &mut [T], op: ReduceOp, root: usize) -> Result<Op> {
        let (s, r) = same(buf);
        Ok(Op::reduce(s, r, buf.len(), T::DTYPE, op, root))
    }

    /// `recv.len() == send.len() * nranks`.
    pub fn all_gather<T: Element>(send: &[T], recv: &mut [T], nranks: usize) -> Result<Op> {
        let (n, m) = (send.len(), recv.len());
        lengths(Some(m) == n.checked_mul(nranks), "all_gather", || {
            format!("receive must hold {n} x {nranks} ranks elements, has {m}")
        })?;
        let (s, r) = ptrs(send, recv);
        Ok(Op::all_gather(s, r, n, T::DTYPE))
    }

    /// This rank's block is at `buf[rank * n .. (rank + 1) * n]`, `n = buf.len() / nranks`.
    pub fn all_gather_in_place<T: Element>(
        buf: &mut [T],
        rank: usize,
        nranks: usize,
    ) -> Result<Op> {
        let n = block("all_gather_in_place", buf, nranks)?;
        let (s, r) = same(buf);
        Ok(Op::all_gather(
            s.wrapping_add(rank * n * size_of::<T>()),
            r,
            n,
            T::DTYPE,
        ))
    }

    /// `send.len() == recv.len() * nranks`.
    pub fn reduce_scatter<T: Element>(
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
        nranks: usize,
    ) -> Result<Op> {
        let (n, m) = (send.len(), recv.len());
        lengths(Some(n) == m.checked_mul(nranks), "reduce_scatter", || {
            format!("send must hold {m} x {nranks} ranks elements, has {n}")
        })?;
        let (s, r) = ptrs(send, recv);
        Ok(Op::reduce_scatter(s, r, m, T::DTYPE, op))
    }

    /// The result lands in `buf[rank * n .. (rank + 1) * n]`, `n = buf.len() / nranks`.
    pub fn reduce_scatter_in_place<T: Element>(
        buf: &mut [T],
        op: ReduceOp,
        rank: usize,
        nranks: usize,
    ) -> Result<Op> {
        let n = block("reduce_scatter_in_place", buf, nranks)?;
        let (s, r) = same(buf);
        let r = r.wrapping_add(rank * n * size_of::<T>());
        Ok(Op::reduce_scatter(s, r, n, T::DTYPE, op))
    }

    /// Block p (of `len / nranks` elements) of `send` goes to rank p.
    pub fn all_to_all<T: Element>(send: &[T], recv: &mut [T], nranks: usize) -> Result<Op> {
        let (n, m) = (send.len(), recv.len());
        lengths(n == m && n.is_multiple_of(nranks), "all_to_all", || {
            format!("send ({n}) and receive ({m}) must be equal and divisible by {nranks} ranks")
        })?;
        let (s, r) = ptrs(send, recv);
        Ok(Op::all_to_all(s, r, n / nranks, T::DTYPE))
    }

    pub fn all_to_all_in_place<T: Element>(buf: &mut [T], nranks: usize) -> Result<Op> {
        let n = block("all_to_all_in_place", buf, nranks)?;
        let (s, r) = same(buf);
        Ok(Op::all_to_all(s, r, n, T::DTYPE))
    }

    pub fn send<T: Element>(buf: &[T], peer: usize) -> Result<Op> {
        Ok(Op::send(buf.as_ptr().cast(), buf.len(), T::DTYPE, peer))
    }

    pub fn recv<T: Element>(buf: &mut [T], peer: usize) -> Result<Op> {
        Ok(Op::recv(buf.as_mut_ptr().cast(), buf.len(), T::DTYPE, peer))
    }
}

fn bytes_of(count: usize, dt: DataType, what: &str) -> Result<usize> {
    count
        .checked_mul(dt.size())
        .filter(|b| *b <= isize::MAX as usize)
        .ok_or_else(|| {
            Error::arg(format!(
                "{what}: {count} elements of {dt} overflow the address space"
            ))
        })
}

fn check_ptr(p: *const u8, bytes: usize, what: &str) -> Result<()> {
    if bytes > 0 && p.is_null() {
        return Err(Error::arg(format!(
            "{what} is NULL but {bytes} bytes were requested"
        )));
    }
    Ok(())
}

/// Refuses buffers that overlap other than in the exact in-place layout.
fn check_overlap(
    a: *const u8,
    alen: usize,
    b: *const u8,
    blen: usize,
    inplace_ok: bool,
    what: &str,
) -> Result<()> {
    if alen == 0 || blen == 0 {
        return Ok(());
    }
    let (a0, a1, b0, b1) = (a as usize, a as usize + alen, b as usize, b as usize + blen);
    if a0 < b1 && b0 < a1 && !inplace_ok {
        return Err(Error::arg(format!(
            "{what}: send and receive buffers overlap but are not the in-place layout"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// (kind, peer, offset into the buffer it reads or writes) of each op.
    fn shape(ops: &[Op], base_send: usize, base_recv: usize) -> Vec<(OpKind, usize, usize)> {
        ops.iter()
            .map(|o| match o.kind {
                OpKind::Send => (o.kind, o.peer(), o.send as usize - base_send),
                _ => (o.kind, o.peer(), o.recv as usize - base_recv),
            })
            .collect()
    }

    #[test]
    fn gather_and_scatter_as_sends_and_receives_move_a_block_per_rank() {
        let (s, r) = (0x1000usize, 0x9000usize);
        // 3 f32 a block (12 bytes), root 1 of 3.
        let g = Op::gather(s as *const u8, r as *mut u8, 3, DataType::F32, 1);
        use OpKind::{Recv, Send};
        assert_eq!(
            shape(&g.gather_or_scatter_as_sends_and_receives(0, 3), s, r),
            [(Send, 1, 0)]
        );
        assert_eq!(
            shape(&g.gather_or_scatter_as_sends_and_receives(1, 3), s, r),
            [(Recv, 0, 0), (Send, 1, 0), (Recv, 1, 12), (Recv, 2, 24)]
        );
        let sc = Op::scatter(s as *const u8, r as *mut u8, 3, DataType::F32, 1);
        assert_eq!(
            shape(&sc.gather_or_scatter_as_sends_and_receives(2, 3), s, r),
            [(Recv, 1, 0)]
        );
        assert_eq!(
            shape(&sc.gather_or_scatter_as_sends_and_receives(1, 3), s, r),
            [(Send, 0, 0), (Send, 1, 12), (Recv, 1, 0), (Send, 2, 24)]
        );
        assert!(
            sc.gather_or_scatter_as_sends_and_receives(1, 3)
                .iter()
                .all(|o| o.count == 3 && o.dtype == DataType::F32)
        );
    }

    #[test]
    fn every_kind_has_its_own_name_and_group_comes_last() {
        let kinds = OpKind::ALL;
        assert_eq!(kinds.len() + 1, OP_NAMES.len());
        assert!(kinds.iter().enumerate().all(|(i, k)| *k as usize == i));
        let names: std::collections::HashSet<_> = kinds.iter().map(|k| k.name()).collect();
        assert_eq!(names.len(), kinds.len());
        assert_eq!(OpKind::AllToAll.name(), "all_to_all");
        assert_eq!(OpKind::Recv.name(), "recv");
        assert_eq!(OP_NAMES[OP_NAMES.len() - 1], "group");
    }

    #[test]
    fn buffers_follow_the_root_rules() {
        let g = Op::gather(100 as *const u8, 1000 as *mut u8, 2, DataType::F32, 1);
        assert_eq!(
            g.buffers(0, 3),
            vec![Buf {
                ptr: 100,
                bytes: 8,
                write: false
            }]
        );
        assert_eq!(g.buffers(1, 3)[1].bytes, 24);
        let r = Op::recv(50 as *mut u8, 4, DataType::U8, 0);
        assert_eq!(
            r.buffers(1, 2),
            vec![Buf {
                ptr: 50,
                bytes: 4,
                write: true
            }]
        );
        assert!(
            Op::all_reduce(
                std::ptr::null(),
                std::ptr::null_mut(),
                0,
                DataType::F32,
                ReduceOp::Sum
            )
            .is_empty()
        );
        assert!(!Op::send(std::ptr::null(), 0, DataType::F32, 0).is_empty());
    }

    #[test]
    fn typed_builders_check_lengths_once() {
        let a = [1.0f32; 2];
        let mut b = [0.0f32; 5];
        let e = typed::all_gather(&a, &mut b, 3).unwrap_err();
        assert!(
            e.to_string()
                .contains("all_gather: receive must hold 2 x 3 ranks elements, has 5")
        );
        let e = typed::all_gather_in_place(&mut b, 0, 2).unwrap_err();
        assert!(
            e.to_string()
                .contains("all_gather_in_place: 5 elements do not divide into 2 ranks")
        );
        let mut c = [0.0f32; 6];
        let op = typed::all_gather_in_place(&mut c, 1, 3).unwrap();
        assert_eq!((op.count, op.send as usize), (2, c.as_ptr() as usize + 8));
        let op = typed::reduce_scatter_in_place(&mut c, ReduceOp::Sum, 2, 3).unwrap();
        assert_eq!((op.count, op.recv as usize), (2, c.as_ptr() as usize + 16));
        // The root's lengths only are checked.
        assert!(typed::broadcast(&a, &mut b, 0, 1).is_ok());
        assert!(typed::broadcast(&a, &mut b, 0, 0).is_err());
    }

    #[test]
    fn validate_keeps_the_messages() {
        let e = Op::send(std::ptr::null(), 1, DataType::F32, 4)
            .validate(0, 4)
            .unwrap_err();
        assert!(
            e.to_string()
                .contains("send: peer 4 is out of range for 4 ranks")
        );
        let mut buf = [0u8; 16];
        let p = buf.as_mut_ptr();
        let e = Op::all_reduce(p, p.wrapping_add(4), 2, DataType::F32, ReduceOp::Sum)
            .validate(0, 2)
            .unwrap_err();
        assert!(e.to_string().contains("not the in-place layout"));
        let e = Op::broadcast(p, p, 1, DataType::U8, 2)
            .validate(0, 2)
            .unwrap_err();
        assert!(
            e.to_string()
                .contains("broadcast: root 2 is out of range for 2 ranks")
        );
    }
}
