#!/usr/bin/env python3
"""Survive a lost rank in PyTorch: shrink, redo the step, grow back (Weft's recovery board).

    weft run -n 4 --replace-failed -- python tests/torch/resilient_train.py --kill-rank 3 --kill-step 4
    python tests/torch/resilient_train.py --drive --weft bench/gpu/weft/weft       # the check: see below
    python tests/torch/resilient_train.py --drive --weft target/debug/weft --backend gloo   # CPU, no GPU

A small data-parallel least-squares model trained with torch tensors on the
GPU (cuda:LOCAL_RANK % GPUs; ranks may share one) and torch.distributed's
NCCL backend, which under `weft run` is Weft's libnccl.so.2. It is the
PyTorch counterpart of libcomm's `Resilient` loop and of the Rust recovery
test (tests/src/bin/recovery/train.rs): each logical rank owns a fixed shard
of samples; a step sums the shards' gradients, quantised to integers (so the
sum is exact in any order and on any number of processes), all-reduces them
and updates the weights. The final weights therefore equal those of a run
without failure exactly when no step is skipped or done twice.

When a peer dies (docs/FAULT-TOLERANCE.md has the recovery board's protocol):

1. The step's all_reduce fails. It is issued with async_op=True and polled
   (`Work.is_completed()`, then `ncclCommGetAsyncError` on the group's
   communicator), while the board's `dead` file is watched. Torch's own
   paths are not used for the error: with TORCH_NCCL_BLOCKING_WAIT=1,
   `Work.wait()` aborts the communicator before it raises (an aborted
   communicator cannot be shrunk), and the watchdog (without blocking wait)
   aborts it or ends the process. So this program sets
   TORCH_NCCL_BLOCKING_WAIT=1 (no watchdog thread at all),
   TORCH_NCCL_ASYNC_ERROR_HANDLING=0 and TORCH_NCCL_USE_COMM_NONBLOCKING=0
   (torch checks a non-blocking parent's async error, which reports the
   failure, before it shrinks it), and never waits on a failed work.
2. Each survivor restores the weights saved before the step, reads `dead`
   until it names members of the group, and calls
   `torch.distributed.shrink_group(dead, shrink_flags=SHRINK_ABORT)`
   (ncclCommShrink; the survivors are renumbered in order; the shrunk group
   becomes the default group). The survivors then agree (a MIN all-reduce of
   their step counts) on the step to redo: one that finished the step before
   noticing the loss rolls back one step further. The lost ranks' shards are
   dealt round-robin to the survivors.
3. The replacement that `weft run --replace-failed` starts (WEFT_INCARNATION
   >= 1) writes `ready-R-I` and waits. At a step boundary the survivors
   all-reduce which replacements they see ready (MIN and MAX: they act only
   on what all of them see); then a new full-size process group is formed
   (torch has no grow): the lowest surviving logical rank serves a fresh
   TCPStore and writes its address to the board file `torch-store-KEY`
   (`HOST PORT`) and `torch-grow-R-I` (`SEQ KEY SRC`) for each joiner; every
   survivor destroys its shrunk group and all call init_process_group(store=
   PrefixStore(KEY, that store), rank=index, world_size=...); KEY names the
   new membership (`grow<N>-R.I-R.I-...`). The survivor at index SRC then
   broadcasts the step count and the weights.
4. At the end every rank waits (bounded) until no replaced rank is missing,
   so a replacement is never left waiting for a job that ended.

With --backend gloo (CPU tensors; test-only) the shrink is not
shrink_group (gloo cannot shrink) but a new group of the survivors over a
fresh store, formed the same way as a grow (`torch-store-KEY`, KEY
`shrink<N>-...`). The NCCL path uses it too, as a fallback, if shrink_group
raises; the `@ shrunk` line says which (`via=shrink_group|new_group`).

Output (each rank): `@ kill t=MS step=S`, `@ shrunk t=MS size=N redo=S via=...`,
`@ joined t=MS at_step=S`, `@ grown t=MS size=N`, and at the end
`@ final w=HEX` (the weights' float64 bits) and `@ steps=N size=N`; and
`@ phase=NAME t=MS` at each step of a recovery (wall-clock ms, so the
driver can line the ranks up): survivors `noticed` (how=async_error|board|
call: the failed collective raised), `named` (the board names the dead),
`shrink_called`, `shrink_returned`, then `shrunk` (the first collective on
the shrunk group, the step agreement, is done: computing again);
`grow_agreed`, `dropped` (the shrunk group destroyed), `formed`
(init_process_group returned), `grown`; the replacement `started` (Python
running), `torch_ready` (torch imported, CUDA device set), `ready`
(`ready-R-I` written), `grow_seen`, `formed`, `joined`. `--debug-logs`
adds NCCL_DEBUG=INFO (Weft's lines carry the time of day, and the shrink,
the device set-up and the release say how long they took) and torch's
C++ INFO log to the kill run's output.

--drive runs the check (tests/torch/run.sh step `resilient`): a failure-free
run, then a run where rank --kill-rank (the last by default) SIGKILLs
itself at --kill-step under `weft run --replace-failed`; PASS when every
rank of both runs ends with the same weights, the kill run shrank and grew
back, and (NCCL) the shrink was shrink_group. It prints the time from the
kill to the survivors' shrunk group and to the full size again.

Limits (an example, not a library): one failure at a time is handled (a
second death during a shrink or grow ends the job with an error, bounded by
--recovery-timeout-s); the rank that serves the current group's store (the
job's rank 0 at first, the lowest survivor after a grow) should not be the
one that dies, since shrink_group clones that store (if the clone fails,
the fallback path takes over).
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import faulthandler
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import time

# When this process started running Python (before torch is imported): the
# replacement's phases are timed from here.
T_START_MS = int(time.time() * 1000)

D = 8  # weights
M = 16  # samples per logical rank
SCALE = float(1 << 24)
MASK = (1 << 64) - 1
NCCL_SUCCESS, NCCL_IN_PROGRESS = 0, 7


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--step-ms", type=float, default=250.0,
                    help="extra time per step (a stand-in for compute), so the replacement joins mid-run")
    ap.add_argument("--backend", default="nccl", choices=["nccl", "gloo"], help="gloo: CPU tensors (test-only)")
    ap.add_argument("--kill-rank", type=int, default=-1, help="logical rank that SIGKILLs itself (-1: none; --drive: the last)")
    ap.add_argument("--kill-step", type=int, default=4, help="the step it dies in (after its gradient, before the all-reduce)")
    ap.add_argument("--kill-after", action="store_true",
                    help="die after that step's all-reduce instead (the next collective fails; the last step: the end's)")
    ap.add_argument("--pg-timeout-s", type=float, default=60.0, help="process groups' timeout")
    ap.add_argument("--recovery-timeout-s", type=float, default=60.0, help="bound on each wait of a recovery")
    ap.add_argument("--report-after-s", type=float, default=10.0,
                    help="a collective stuck this long with no death on the board: write report-R-I (a frozen peer)")
    ap.add_argument("--no-shrink-group", action="store_true", help="NCCL: skip shrink_group, use the new-group path")
    ap.add_argument("--expect-nccl", default=None, help="NCCL: fail unless torch's NCCL calls bind to this library")
    # Driver
    ap.add_argument("--drive", action="store_true", help="run the reference and the kill run and compare")
    ap.add_argument("--weft", default="weft", help="--drive: the weft binary")
    ap.add_argument("--nproc", type=int, default=4, help="--drive: ranks")
    ap.add_argument("--run-timeout-s", type=float, default=120.0, help="--drive: bound on each weft run")
    ap.add_argument("--log-dir", default=None, help="--drive: keep each run's output here")
    ap.add_argument("--allow-fallback", action="store_true", help="--drive: NCCL may shrink by the new-group path")
    ap.add_argument("--debug-logs", action="store_true",
                    help="--drive: the kill run with NCCL_DEBUG=INFO and TORCH_CPP_LOG_LEVEL=INFO and the survivors' Python stacks each second of a shrink_group (timed phases in its log)")
    return ap.parse_args(argv)


# --------------------------------------------------------------------------
# The model: deterministic data (the Rust test's generator), integer gradients


def _mix(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


def _unit(seed: int) -> float:
    return (_mix(seed) >> 11) / float(1 << 53) - 0.5


def shard_data(r: int):
    """Samples (x, y) of logical rank r's shard: y = x . (1..D) + noise."""
    xs, ys = [], []
    for i in range(M):
        s = (r * M + i) * 1000
        x = [_unit(s + j) for j in range(D)]
        xs.append(x)
        ys.append(sum(x[j] * (j + 1.0) for j in range(D)) + 0.01 * _unit(s + 999))
    return xs, ys


def now_ms() -> int:
    return int(time.time() * 1000)


def say(s: str) -> None:
    print(s, flush=True)


def hex_weights(w) -> str:
    return "".join("%016x" % struct.unpack("<Q", struct.pack("<d", float(x)))[0] for x in w)


# --------------------------------------------------------------------------
# The recovery board (docs/FAULT-TOLERANCE.md)


class Board:
    def __init__(self, d: str):
        self.dir = d

    def path(self, name: str) -> str:
        return os.path.join(self.dir, name)

    def write(self, name: str, body: str) -> None:
        tmp = self.path(f".{name}.{os.getpid()}")
        with open(tmp, "w") as f:
            f.write(body)
        os.replace(tmp, self.path(name))

    def read(self, name: str):
        try:
            with open(self.path(name)) as f:
                return f.read()
        except OSError:
            return None

    def deaths(self):
        """(rank, incarnation, replaced) per line of `dead`."""
        out = []
        for line in (self.read("dead") or "").splitlines():
            w = line.split()
            if len(w) >= 2 and w[0].isdigit() and w[1].isdigit():
                out.append((int(w[0]), int(w[1]), len(w) > 2 and w[2] == "replaced"))
        return out

    @staticmethod
    def is_dead(deaths, rank: int, inc: int) -> bool:
        return any(d[0] == rank and d[1] == inc for d in deaths)

    def ready(self, rank: int, deaths):
        """The newest incarnation of `rank` that said it is ready and is alive."""
        best = None
        prefix = f"ready-{rank}-"
        try:
            names = os.listdir(self.dir)
        except OSError:
            return None
        for n in names:
            if n.startswith(prefix) and n[len(prefix):].isdigit():
                i = int(n[len(prefix):])
                if not self.is_dead(deaths, rank, i) and (best is None or i > best):
                    best = i
        return best

    def wait_for(self, name: str, until: float, what: str) -> str:
        while True:
            s = self.read(name)
            if s:
                return s
            if time.monotonic() > until:
                raise RuntimeError(f"timed out waiting for {what} ({self.path(name)})")
            time.sleep(0.002)


class PeerFailure(Exception):
    """A collective failed because a peer is gone: recover and redo the step.
    `how` says who noticed: async_error, board, or call (the call raised)."""

    def __init__(self, msg: str, how: str):
        super().__init__(msg)
        self.how = how


def phase(name: str, t=None, **kv) -> None:
    """One timed step of a recovery (see the module docs); `t` defaults to now."""
    extra = "".join(f" {k}={v}" for k, v in kv.items())
    say(f"@ phase={name} t={now_ms() if t is None else t}{extra}")


# --------------------------------------------------------------------------
# The worker


class Trainer:
    def __init__(self, args):
        # Before any ProcessGroupNCCL exists (see the module docs, point 1).
        os.environ["TORCH_NCCL_BLOCKING_WAIT"] = "1"
        os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "0"
        # A blocking communicator: torch's non-blocking mode polls the
        # parent's async error (a failed one) before it shrinks it.
        os.environ["TORCH_NCCL_USE_COMM_NONBLOCKING"] = "0"
        import torch
        import torch.distributed as dist

        self.torch, self.dist = torch, dist
        self.args = args
        self.nccl = args.backend == "nccl"
        self.logical = int(os.environ.get("WEFT_RANK", os.environ["RANK"]))
        self.world = int(os.environ.get("WEFT_WORLD_SIZE", os.environ["WORLD_SIZE"]))
        self.inc = int(os.environ.get("WEFT_INCARNATION", "0"))
        bd = os.environ.get("WEFT_RECOVERY_DIR")
        self.board = Board(bd) if bd else None
        if self.nccl:
            n = torch.cuda.device_count()
            if n == 0:
                raise SystemExit("backend nccl needs a CUDA device (use --backend gloo for a CPU run)")
            self.dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % n)
            torch.cuda.set_device(self.dev)
        else:
            self.dev = torch.device("cpu")
        if self.inc > 0:
            phase("started", t=T_START_MS)
            phase("torch_ready")
        self.timeout = datetime.timedelta(seconds=args.pg_timeout_s)
        self.members = [(r, 0) for r in range(self.world)]  # (logical, incarnation) in group order
        self.done = 0
        self.prev = None  # the weights before the last completed step
        self.grows = 0  # grows so far (agreed by every member)
        self.shrinks = 0
        self.stores = []  # TCPStore servers this process serves (kept alive)
        self.set_aside = []  # failed groups not destroyed (gloo: a collective still in flight)
        self.comm_ptr = None
        self._get_async_error = None
        # Data of every shard (any rank may compute any shard), on the device.
        xs, ys = zip(*(shard_data(r) for r in range(self.world)))
        f64 = torch.float64
        self.X = torch.tensor(xs, dtype=f64, device=self.dev)  # world x M x D
        self.Y = torch.tensor(ys, dtype=f64, device=self.dev)  # world x M
        self.w = torch.zeros(D, dtype=f64, device=self.dev)
        self.lr = 0.5 / (self.world * M)

    # -- groups ------------------------------------------------------------

    def _init_kwargs(self):
        return {"device_id": self.dev} if self.nccl else {}

    def init_first(self) -> None:
        """Incarnation 0: the job's default group from the launcher's environment."""
        self.dist.init_process_group(self.args.backend, timeout=self.timeout, **self._init_kwargs())
        self._refresh_comm_ptr()

    def _refresh_comm_ptr(self) -> None:
        """The default group's ncclComm_t (0 until torch has made it)."""
        self.comm_ptr = None
        if not self.nccl:
            return
        try:
            pg = self.dist.distributed_c10d._get_default_group()
            self.comm_ptr = pg._get_backend(self.dev)._comm_ptr() or None
        except Exception as e:  # noqa: BLE001 -- then errors are taken from wait()
            say(f"resilient: rank {self.logical}: no communicator handle: {type(e).__name__}: {e}")

    def my_index(self) -> int:
        return [m[0] for m in self.members].index(self.logical)

    def _serve_store(self):
        host = os.environ.get("MASTER_ADDR", "127.0.0.1")
        if host not in ("127.0.0.1", "localhost", "::1"):
            host = socket.getfqdn()
        st = self.dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=self.timeout)
        self.stores.append(st)
        return st, host, st.port

    def _form_group(self, key: str, members, leader: bool, joiners=()) -> None:
        """A new default group of `members` over a store the leader serves."""
        dist = self.dist
        until = time.monotonic() + self.args.recovery_timeout_s
        if leader:
            st, host, port = self._serve_store()
            self.board.write(f"torch-store-{key}", f"{host} {port}\n")
            seq = time.time_ns() // 1000
            src = [m[0] for m in members].index(self.logical)
            for r, i in joiners:
                self.board.write(f"torch-grow-{r}-{i}", f"{seq} {key} {src}\n")
        else:
            host, port = self.board.wait_for(f"torch-store-{key}", until, "the new group's store").split()
            st = dist.TCPStore(host, int(port), is_master=False, timeout=self.timeout)
        store = dist.PrefixStore(key + "/", st)
        index = [m[0] for m in members].index(self.logical)
        dist.init_process_group(
            self.args.backend, store=store, rank=index, world_size=len(members), timeout=self.timeout,
            **self._init_kwargs(),
        )
        self.members = list(members)
        self._refresh_comm_ptr()

    def _drop_group(self, failed: bool) -> None:
        """Leaves the default group: destroyed when healthy; after a failure
        aborted (NCCL), or with gloo set aside unfinished (test-only: gloo's
        abort and destroy wait for the failed collective's timeout)."""
        dist = self.dist
        if not dist.is_initialized():
            return
        c10d = dist.distributed_c10d
        try:
            if not failed:
                dist.destroy_process_group()
            elif self.nccl:
                c10d._abort_process_group()
        except Exception as e:  # noqa: BLE001 -- the group is being replaced anyway
            say(f"resilient: rank {self.logical}: dropping the old group: {type(e).__name__}: {e}")
        if dist.is_initialized():
            # gloo, or what a failed shrink_group or abort left registered.
            pg = c10d._get_default_group()
            self.set_aside.append(pg)
            c10d._cleanup_process_group_global_state(pg)
            c10d._update_default_pg(None)
        self.comm_ptr = None

    @staticmethod
    def _key(kind: str, n: int, members) -> str:
        return f"{kind}{n}-" + "-".join(f"{r}.{i}" for r, i in members)

    # -- collectives that notice a lost peer ------------------------------

    def _async_error(self) -> int:
        if not self.nccl:
            return NCCL_SUCCESS
        if not self.comm_ptr:
            self._refresh_comm_ptr()
            if not self.comm_ptr:
                return NCCL_SUCCESS
        if self._get_async_error is None:
            fn = getattr(ctypes.CDLL(None), "ncclCommGetAsyncError", None)
            if fn is None:
                sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
                from common import nccl_provider

                fn = ctypes.CDLL(nccl_provider("ncclAllReduce")).ncclCommGetAsyncError
            fn.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
            fn.restype = ctypes.c_int
            self._get_async_error = fn
        res = ctypes.c_int(0)
        rc = self._get_async_error(ctypes.c_void_p(self.comm_ptr), ctypes.byref(res))
        return rc if rc != NCCL_SUCCESS else res.value

    def _member_died(self) -> bool:
        if not self.board:
            return False
        deaths = self.board.deaths()
        return any(Board.is_dead(deaths, r, i) for r, i in self.members)

    def _run(self, what: str, issue) -> None:
        """Issues a collective (async_op=True) and waits for it by polling;
        PeerFailure when it failed or the board names a lost member."""
        t0 = time.monotonic()
        reported = False
        try:
            work = issue()
        except Exception as e:  # noqa: BLE001 -- e.g. the communicator already failed
            raise PeerFailure(f"{what}: {type(e).__name__}: {e}", "call") from e
        next_look = t0  # the board and the async error: every few ms
        while True:
            if work.is_completed():
                err = self._async_error()
                if err not in (NCCL_SUCCESS, NCCL_IN_PROGRESS):
                    raise PeerFailure(f"{what}: ncclCommGetAsyncError: {err}", "async_error")
                if self.nccl and self.comm_ptr:
                    # Completed on the GPU (its end event has passed), so no
                    # wait(): that would re-check the communicator and, had a
                    # peer died just now, abort it before raising.
                    return
                try:
                    work.wait()  # gloo reports a failure here (NCCL: only without a handle)
                except Exception as e:  # noqa: BLE001
                    raise PeerFailure(f"{what}: {type(e).__name__}: {e}", "call") from e
                return
            now = time.monotonic()
            if now >= next_look:
                next_look = now + 0.002
                err = self._async_error()
                if err not in (NCCL_SUCCESS, NCCL_IN_PROGRESS):
                    raise PeerFailure(f"{what}: ncclCommGetAsyncError: {err}", "async_error")
                if self._member_died():
                    raise PeerFailure(f"{what}: the board names a lost member", "board")
                waited = now - t0
                if self.board and not reported and waited > self.args.report_after_s:
                    # A frozen peer: the launcher looks for a stopped rank and kills it.
                    self.board.write(f"report-{self.logical}-{self.inc}", f"{what} stuck for {waited:.1f}s\n")
                    reported = True
                if waited > self.args.recovery_timeout_s + self.args.report_after_s:
                    raise RuntimeError(f"{what}: no progress for {waited:.0f}s and no death on the board")
            time.sleep(0.0001)

    def all_reduce(self, t, op, what: str) -> None:
        self._run(what, lambda: self.dist.all_reduce(t, op=op, async_op=True))

    def broadcast(self, t, src: int, what: str) -> None:
        self._run(what, lambda: self.dist.broadcast(t, src=src, async_op=True))

    # -- the step ----------------------------------------------------------

    def shards(self):
        """Own shard first, then absent logical ranks dealt round-robin."""
        present = [m[0] for m in self.members]
        absent = [r for r in range(self.world) if r not in present]
        me = self.my_index()
        return [self.logical] + [r for i, r in enumerate(absent) if i % len(present) == me]

    def gradient(self, shards):
        torch = self.torch
        g = torch.zeros(D, dtype=torch.int64, device=self.dev)
        for r in shards:
            x, y = self.X[r], self.Y[r]
            e = (x * self.w).sum(dim=1) - y  # M
            g += torch.round(e[:, None] * x * SCALE).to(torch.int64).sum(dim=0)
        return g

    def step(self) -> None:
        torch = self.torch
        while True:
            snapshot = self.w.clone()
            try:
                self.maybe_grow()
                g = self.gradient(self.shards())
                if self.args.step_ms > 0:
                    time.sleep(self.args.step_ms / 1e3)
                a = self.args
                if self.inc == 0 and self.logical == a.kill_rank and self.done == a.kill_step and not a.kill_after:
                    if self.nccl:
                        torch.cuda.synchronize(self.dev)
                    say(f"@ kill t={now_ms()} step={self.done}")
                    os.kill(os.getpid(), signal.SIGKILL)
                self.all_reduce(g, self.dist.ReduceOp.SUM, f"step {self.done}")
                self.w -= self.lr * g.to(torch.float64) / SCALE
                self.done += 1
                self.prev = snapshot
                if self.inc == 0 and self.logical == a.kill_rank and self.done == a.kill_step + 1 and a.kill_after:
                    say(f"@ kill t={now_ms()} after_step={a.kill_step}")
                    os.kill(os.getpid(), signal.SIGKILL)
                return
            except PeerFailure as e:
                phase("noticed", how=e.how)
                say(f"resilient: rank {self.logical}: {e}; recovering")
                self.w = snapshot
                self.recover()

    # -- shrink ------------------------------------------------------------

    def recover(self) -> None:
        """Learn who died from the board, shrink around them, agree on the step."""
        torch, dist = self.torch, self.dist
        if not self.board:
            raise RuntimeError("a peer failed and there is no recovery board: run under `weft run --replace-failed`")
        until = time.monotonic() + self.args.recovery_timeout_s
        reported = False
        while True:
            deaths = self.board.deaths()
            gone = [i for i, (r, inc) in enumerate(self.members) if Board.is_dead(deaths, r, inc)]
            if not gone:
                if time.monotonic() > until:
                    raise RuntimeError("the launcher named no lost rank (is this `weft run --replace-failed`?)")
                if not reported:
                    self.board.write(f"report-{self.logical}-{self.inc}", "a collective failed; no death known\n")
                    reported = True
                time.sleep(0.002)
                continue
            survivors = [m for i, m in enumerate(self.members) if i not in gone]
            phase("named", gone=",".join(str(self.members[i][0]) for i in gone))
            via = self._shrink(gone, survivors)
            # The step to redo: the least any survivor completed.
            v = torch.tensor([self.done, -self.done], dtype=torch.int64, device=self.dev)
            try:
                self.all_reduce(v, dist.ReduceOp.MIN, "the step agreement")
            except PeerFailure as e:
                phase("noticed", how=e.how, after="shrink")
                say(f"resilient: rank {self.logical}: {e} after the shrink; again")
                continue
            lo, hi = int(v[0]), -int(v[1])
            if hi > lo + 1:
                raise RuntimeError(f"survivors are {hi - lo} steps apart (at most 1 is possible)")
            if self.done > lo:
                self.w = self.prev
                self.prev = None
                self.done = lo
            say(f"@ shrunk t={now_ms()} size={len(self.members)} redo={self.done} via={via}")
            return

    def _shrink(self, gone, survivors) -> str:
        dist = self.dist
        self.shrinks += 1
        if self.nccl and not self.args.no_shrink_group:
            try:
                phase("shrink_called")
                # --debug-logs: where a slow shrink_group waits, as Python
                # stacks of every thread once a second until it returns.
                if os.environ.get("RESILIENT_STACKS"):
                    faulthandler.dump_traceback_later(1.0, repeat=True, file=sys.stderr)
                try:
                    dist.shrink_group(gone, shrink_flags=dist.distributed_c10d.SHRINK_ABORT)
                finally:
                    faulthandler.cancel_dump_traceback_later()
                phase("shrink_returned")
                self.members = survivors
                self._refresh_comm_ptr()
                return "shrink_group"
            except Exception as e:  # noqa: BLE001 -- reported, then the other path
                say(f"resilient: rank {self.logical}: shrink_group({gone}) failed: {type(e).__name__}: {e}; "
                    "forming a new group of the survivors instead")
        # gloo (test-only), or the fallback: a new group of the survivors.
        t0 = time.monotonic()
        self._drop_group(failed=True)
        t1 = time.monotonic()
        key = self._key("shrink", self.shrinks, survivors) + f"-g{self.grows}"
        self._form_group(key, survivors, leader=survivors[0][0] == self.logical)
        say(f"resilient: rank {self.logical}: the old group dropped in {(t1 - t0) * 1e3:.0f} ms, "
            f"the survivors' group formed in {(time.monotonic() - t1) * 1e3:.0f} ms")
        return "new_group"

    # -- grow --------------------------------------------------------------

    def maybe_grow(self) -> None:
        while self.grow_once():
            pass

    def grow_once(self) -> bool:
        torch, dist = self.torch, self.dist
        if not self.board or len(self.members) >= self.world:
            return False
        deaths = self.board.deaths()
        present = {m[0] for m in self.members}
        ready = []
        for r in range(self.world):
            i = None if r in present else self.board.ready(r, deaths)
            ready.append(0 if i is None else i + 1)
        lo = torch.tensor(ready, dtype=torch.int64, device=self.dev)
        hi = lo.clone()
        self.all_reduce(lo, dist.ReduceOp.MIN, "the readiness agreement (min)")
        self.all_reduce(hi, dist.ReduceOp.MAX, "the readiness agreement (max)")
        lo, hi = lo.tolist(), hi.tolist()
        joiners = [(r, lo[r] - 1) for r in range(self.world) if lo[r] > 0 and lo[r] == hi[r]]
        if not joiners:
            return False
        members = sorted(self.members + joiners)
        key = self._key("grow", self.grows + 1, members)
        # The lowest surviving logical rank serves the store and sends the state.
        leader = self.members[0][0]
        src = [m[0] for m in members].index(leader)
        phase("grow_agreed", joiners=",".join(f"{r}.{i}" for r, i in joiners))
        # Torch has no grow: every member leaves its group and all form a new one.
        self._drop_group(failed=False)
        phase("dropped")
        self._form_group(key, members, leader == self.logical, joiners)
        phase("formed")
        self.grows += 1
        self._send_state(src)
        say(f"@ grown t={now_ms()} size={len(self.members)}")
        return True

    def _send_state(self, src: int) -> None:
        torch = self.torch
        head = torch.tensor([self.done, self.grows, self.shrinks], dtype=torch.int64, device=self.dev)
        self.broadcast(head, src, "the state header")
        self.broadcast(self.w, src, "the state")
        self.done, self.grows, self.shrinks = (int(x) for x in head.tolist())

    def join(self) -> None:
        """A replacement: say ready, wait for the survivors' grow, get the state."""
        if not self.board:
            raise SystemExit("WEFT_INCARNATION is set but WEFT_RECOVERY_DIR is not: run under `weft run --replace-failed`")
        self.board.write(f"ready-{self.logical}-{self.inc}", "")
        phase("ready")
        until = time.monotonic() + self.args.recovery_timeout_s
        _seq, key, src = self.board.wait_for(
            f"torch-grow-{self.logical}-{self.inc}", until, "the survivors to grow the job back").split()
        phase("grow_seen")
        members = [tuple(int(x) for x in m.split(".")) for m in key.split("-")[1:]]
        self._form_group(key, members, leader=False)
        phase("formed")
        self._send_state(src=int(src))
        say(f"@ joined t={now_ms()} at_step={self.done}")

    # -- the end -----------------------------------------------------------

    def pending_replacements(self) -> bool:
        deaths = self.board.deaths() if self.board else []
        present = {m[0] for m in self.members}
        for r in range(self.world):
            if r in present:
                continue
            mine = [d for d in deaths if d[0] == r]
            if mine and max(mine, key=lambda d: d[1])[2]:
                return True
        return False

    def finish(self, steps: int) -> bool:
        """Waits (bounded) until every replaced rank has joined. False when a
        recovery rolled the last step back (a survivor had not finished it):
        then step again."""
        torch, dist = self.torch, self.dist
        until = time.monotonic() + self.args.recovery_timeout_s
        while True:
            try:
                self.maybe_grow()
                v = torch.tensor([int(self.pending_replacements())], dtype=torch.int64, device=self.dev)
                self.all_reduce(v, dist.ReduceOp.MAX, "the end agreement")
            except PeerFailure as e:
                phase("noticed", how=e.how)
                say(f"resilient: rank {self.logical}: {e}; recovering")
                self.recover()
                if self.done < steps:
                    return False
                continue
            if int(v[0]) == 0:
                return True
            if time.monotonic() > until:
                raise RuntimeError("replacements did not join before the end")
            time.sleep(0.02)


def check_library(args) -> None:
    """Which libnccl torch's calls bind to (Weft's, under `weft run`)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from common import nccl_provider

    got = nccl_provider("ncclCommShrink")
    if os.environ.get("WEFT_RANK", os.environ.get("RANK")) == "0" and os.environ.get("WEFT_INCARNATION", "0") == "0":
        say(f"resilient: ncclCommShrink from {got}")
    if args.expect_nccl and got != os.path.realpath(args.expect_nccl):
        raise SystemExit(f"torch's NCCL calls bind to {got}, not {os.path.realpath(args.expect_nccl)}")


def worker(args) -> int:
    t = Trainer(args)
    if t.nccl:
        check_library(args)
    if t.inc == 0:
        t.init_first()
    else:
        t.join()
    while True:
        while t.done < args.steps:
            t.step()
        if t.finish(args.steps):
            break
    w = t.w.cpu().tolist()
    say(f"@ final w={hex_weights(w)}")
    say(f"@ steps={t.done} size={len(t.members)}")
    t.dist.destroy_process_group()
    if t.set_aside:
        # Their destructors would wait for the failed collectives' timeout.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


# --------------------------------------------------------------------------
# The driver: a failure-free run and a kill run, compared


LINE = re.compile(r"^\[\s*(\d+)\]\s+@ (.*)$")


def facts(out: str):
    """(rank, event, {key: value}) of every `[R] @ event k=v ...` line; for
    `@ final w=...` and `@ steps=N ...` the event is the first key."""
    res = []
    for line in out.splitlines():
        m = LINE.match(line)
        if not m or not m.group(2).split():
            continue
        words = m.group(2).split()
        kv = dict(w.split("=", 1) for w in words if "=" in w)
        res.append((int(m.group(1)), words[0].split("=", 1)[0], kv))
    return res


def run_job(args, name: str, extra: list[str], replace: bool, env=None):
    me = os.path.abspath(__file__)
    cmd = [args.weft, "run", "-n", str(args.nproc), "--timeout", str(int(args.run_timeout_s))]
    if replace:
        cmd.append("--replace-failed=1")
    cmd += ["--", sys.executable, me, "--steps", str(args.steps), "--step-ms", str(args.step_ms), "--backend", args.backend,
            "--pg-timeout-s", str(args.pg_timeout_s), "--recovery-timeout-s", str(args.recovery_timeout_s)] + extra
    if args.no_shrink_group:
        cmd.append("--no-shrink-group")
    if args.expect_nccl:
        cmd += ["--expect-nccl", args.expect_nccl]
    say(f"resilient: {name}: {' '.join(cmd)}")
    t0 = time.monotonic()
    try:
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           timeout=args.run_timeout_s + 15, start_new_session=True, env=env)
        rc, out = p.returncode, p.stdout
    except subprocess.TimeoutExpired as e:
        rc, out = 124, (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
    dt = time.monotonic() - t0
    if args.log_dir:
        os.makedirs(args.log_dir, exist_ok=True)
        with open(os.path.join(args.log_dir, f"resilient-{args.backend}-{name}.log"), "w") as f:
            f.write(out)
    return rc, out, dt


def finals(name: str, rc: int, out: str, args, problems: list[str]):
    if rc != 0:
        problems.append(f"{name}: weft run exited {rc}")
    f = facts(out)
    ws = {}
    for r in range(args.nproc):
        mine = [kv for rank, ev, kv in f if rank == r and ev == "final"]
        steps = [kv for rank, ev, kv in f if rank == r and ev == "steps"]
        if not mine or not steps:
            problems.append(f"{name}: rank {r} printed no final weights")
            continue
        ws[r] = mine[-1]["w"]
        if steps[-1].get("steps") != str(args.steps) or steps[-1].get("size") != str(args.nproc):
            problems.append(f"{name}: rank {r} ended with {steps[-1]} (want steps={args.steps} size={args.nproc})")
    if len(set(ws.values())) > 1:
        problems.append(f"{name}: ranks disagree on the final weights: {ws}")
    return f, (next(iter(ws.values())) if ws else None)


SURVIVOR_PHASES = ("noticed", "named", "shrink_called", "shrink_returned", "shrunk",
                   "grow_agreed", "dropped", "formed", "grown")
JOINER_PHASES = ("started", "torch_ready", "ready", "grow_seen", "formed", "joined")


def phase_table(f, kill_ms: int):
    """Where the recovery's time went: each phase's time after the kill (ms),
    first and last rank, for the survivors and the replacement, with the
    step from the previous phase (on the slowest rank)."""
    joiners = {r for r, ev, _ in f if ev == "phase" and _.get("phase") == "started"}
    out = ["resilient: recovery phases, ms after the kill (first..last rank; +ms since the previous phase, last rank)"]
    for who, names, ranks in (("survivors", SURVIVOR_PHASES, lambda r: r not in joiners),
                              ("replacement", JOINER_PHASES, lambda r: r in joiners)):
        prev = None
        cells = []
        for name in names:
            ts = []
            for r, ev, kv in f:
                if not ranks(r) or "t" not in kv:
                    continue
                tag = kv.get("phase") if ev == "phase" else ev
                if tag == name:
                    ts.append(int(kv["t"]) - kill_ms)
            if not ts:
                continue
            lo, hi = min(ts), max(ts)
            step = f" +{hi - prev}" if prev is not None else ""
            cells.append(f"{name} {lo}..{hi}{step}" if lo != hi else f"{name} {hi}{step}")
            prev = hi
        out.append(f"resilient:   {who}: " + (", ".join(cells) if cells else "-"))
    return out


def drive(args) -> int:
    if args.nproc < 2:
        say("resilient: needs --nproc 2 or more")
        return 2
    victim = args.kill_rank if args.kill_rank >= 0 else args.nproc - 1
    say(f"resilient: {args.nproc} ranks, backend {args.backend}, {args.steps} steps; "
        f"rank {victim} SIGKILLs itself {'after' if args.kill_after else 'in'} step {args.kill_step}")
    problems: list[str] = []
    rc, out, dt0 = run_job(args, "reference", [], replace=False)
    _, ref = finals("reference", rc, out, args, problems)
    if problems:
        say(out[-6000:])
    kill = ["--kill-rank", str(victim), "--kill-step", str(args.kill_step)] + (["--kill-after"] if args.kill_after else [])
    env = None
    if args.debug_logs:
        env = dict(os.environ, NCCL_DEBUG="INFO", TORCH_CPP_LOG_LEVEL="INFO", RESILIENT_STACKS="1")
    rc, out, dt1 = run_job(args, "kill", kill, replace=True, env=env)
    n_before = len(problems)
    f, got = finals("kill", rc, out, args, problems)
    kills = [int(kv["t"]) for r, ev, kv in f if ev == "kill"]
    shrunk = [(r, kv) for r, ev, kv in f if ev == "shrunk"]
    grown = [(r, kv) for r, ev, kv in f if ev == "grown" or ev == "joined"]
    if not kills:
        problems.append("kill: no rank reported its kill")
    if not shrunk:
        problems.append("kill: the survivors never shrank")
    if not [1 for r, ev, kv in f if ev == "grown"]:
        problems.append("kill: the job never grew back")
    vias = sorted({kv.get("via", "?") for _, kv in shrunk})
    joined = [int(kv["at_step"]) for r, ev, kv in f if ev == "joined"]
    if joined:
        say(f"resilient: the replacement joined at step {joined[0]} of {args.steps}")
    if args.backend == "nccl" and not args.allow_fallback and any(v != "shrink_group" for v in vias):
        problems.append(f"kill: the shrink went by {vias}, not torch.distributed.shrink_group (see the log)")
    if ref and got and ref != got:
        problems.append(f"kill: final weights {got} differ from the failure-free run's {ref}")
    if len(problems) > n_before:
        say(out[-8000:])
    if kills and shrunk:
        k = kills[0]
        t_shrunk = max(int(kv["t"]) for _, kv in shrunk) - k
        t_grown = max(int(kv["t"]) for _, kv in grown) - k if grown else None
        say(f"resilient: kill -> survivors shrunk ({'/'.join(vias)}) {t_shrunk} ms; "
            f"kill -> full size {t_grown if t_grown is not None else '-'} ms "
            f"(runs took {dt0:.1f} s and {dt1:.1f} s)")
        for line in phase_table(f, k):
            say(line)
    for p in problems:
        say(f"FAIL resilient: {p}")
    ok = not problems
    if ok:
        say(f"PASS resilient: final weights equal the failure-free run's ({got[:32]}...)")
    say(f"SUMMARY: resilient {'PASS' if ok else 'FAIL'} (backend {args.backend}, {args.nproc} ranks, "
        f"{args.steps} steps, kill rank {victim} step {args.kill_step})")
    return 0 if ok else 1


def main(argv=None) -> int:
    args = parse(argv)
    if args.drive:
        return drive(args)
    return worker(args)


if __name__ == "__main__":
    sys.exit(main())
