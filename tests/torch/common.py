"""Shared pieces of the PyTorch end-to-end suite: process-group setup, seeded
test data, dtype tolerances, and the check runner that turns each check into
one PASS/FAIL/SKIP line agreed by every rank.

Every rank runs the same checks in the same order. A check computes its
reference locally (each rank can regenerate any rank's input from the seed),
so nothing is compared against data that went through the library under test.
The per-check verdicts are combined over a separate gloo (CPU) group, so the
report itself does not depend on the NCCL library being tested.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import sys
import time
import traceback
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

# Sizes used by most checks: odd, and one above 64 Ki elements.
ODD_SIZES = (1, 7, 1021, 65537)

# dtypes ProcessGroupNCCL maps to NCCL types (kBool goes as ncclUint8).
REDUCE_DTYPES = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int8,
    torch.uint8,
    torch.int32,
    torch.int64,
)
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
# Data-movement collectives also carry bool (and fp8 where torch maps it).
MOVE_DTYPES = REDUCE_DTYPES + (torch.bool,)

# Machine epsilon of each float dtype, for tolerances.
_EPS = {
    torch.float64: 2.2e-16,
    torch.float32: 1.2e-7,
    torch.float16: 9.8e-4,
    torch.bfloat16: 7.9e-3,
}
for _n, _e in (("float8_e4m3fn", 0.125), ("float8_e5m2", 0.25)):
    if hasattr(torch, _n):
        _EPS[getattr(torch, _n)] = _e


def is_fp8(dtype: torch.dtype) -> bool:
    return "float8" in str(dtype)


class Skip(Exception):
    """Raised by a check that cannot run here (the message says why)."""


def dname(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


@dataclass
class Ctx:
    rank: int
    world: int
    local_rank: int
    device: torch.device
    backend: str
    seed: int
    eager: bool
    args: object
    report_pg: object = None
    results: list = field(default_factory=list)
    errors: list = field(default_factory=list)  # mismatches of the running check

    @property
    def nccl(self) -> bool:
        return self.backend == "nccl"

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def pick_device(backend: str) -> torch.device:
    """cuda:(LOCAL_RANK % device count): several ranks may share one GPU."""
    if backend == "gloo":
        return torch.device("cpu")
    n = torch.cuda.device_count()
    if n == 0:
        raise SystemExit("backend nccl needs a CUDA device (use --backend gloo for a CPU run)")
    local = int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")))
    return torch.device("cuda", local % n)


def loaded_nccl() -> list[str]:
    """Paths of every libnccl mapped into this process (from /proc/self/maps)."""
    found = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 6 and "libnccl" in os.path.basename(parts[-1]):
                    p = os.path.realpath(parts[-1])
                    if p not in found:
                        found.append(p)
    except OSError:
        pass
    return found


def nccl_provider(symbol: str = "ncclAllReduce"):
    """The file that provides `symbol` in this process's global scope (what
    torch's calls bind to), via dladdr."""
    import ctypes

    class DlInfo(ctypes.Structure):
        _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                    ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]

    me = ctypes.CDLL(None)
    try:
        addr = ctypes.cast(getattr(me, symbol), ctypes.c_void_p).value
    except AttributeError:
        return None
    dladdr = me.dladdr
    dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(DlInfo)]
    info = DlInfo()
    if not dladdr(addr, ctypes.byref(info)) or not info.dli_fname:
        return None
    return os.path.realpath(info.dli_fname.decode())


def setup(args) -> Ctx:
    """init_process_group from the launcher's environment (torchrun or weft run)."""
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        if var not in os.environ:
            raise SystemExit(f"{var} is not set: start with torchrun or `weft run -n N --`")
    backend = args.backend
    device = pick_device(backend)
    local = int(os.environ.get("LOCAL_RANK", "0"))
    timeout = datetime.timedelta(seconds=args.pg_timeout_s)
    kw = {}
    if device.type == "cuda":
        torch.cuda.set_device(device)
        if not args.lazy_init:
            # Eager init: the world communicator is made now; new_group and
            # split_group then use ncclCommSplit, and unbatched p2p reuses it.
            kw["device_id"] = device
    dist.init_process_group(backend=backend, timeout=timeout, **kw)
    ctx = Ctx(
        rank=dist.get_rank(),
        world=dist.get_world_size(),
        local_rank=local,
        device=device,
        backend=backend,
        seed=args.seed,
        eager="device_id" in kw,
        args=args,
    )
    # Verdicts travel over gloo, independent of the library under test.
    ctx.report_pg = dist.new_group(backend="gloo", timeout=timeout)
    if ctx.rank == 0:
        info = [
            f"torch {torch.__version__}",
            f"backend {backend}",
            f"world {ctx.world}",
            f"init {'eager (device_id)' if ctx.eager else 'lazy'}",
        ]
        if device.type == "cuda":
            info.append(f"GPUs visible {torch.cuda.device_count()}")
            try:
                info.append(f"torch.cuda.nccl.version() {torch.cuda.nccl.version()}")
            except Exception as e:  # noqa: BLE001
                info.append(f"nccl version: {e}")
        print("suite: " + ", ".join(info), flush=True)
    if device.type == "cuda":
        libs = loaded_nccl()
        print(
            f"suite: rank {ctx.rank} device {device} libnccl mapped: {libs or 'none'}; "
            f"ncclAllReduce from {nccl_provider()}",
            flush=True,
        )
        want = getattr(args, "expect_nccl", None)
        if want:
            want = os.path.realpath(want)
            # torch's wheel maps its bundled libnccl even when Weft is
            # preloaded; what matters is which file torch's calls bind to.
            got = nccl_provider()
            if got != want:
                raise SystemExit(
                    f"rank {ctx.rank}: ncclAllReduce binds to {got}, not {want} (mapped: {libs})"
                )
    return ctx


# --------------------------------------------------------------------------
# Seeded data


def _seed(ctx: Ctx, *key) -> int:
    h = hashlib.sha256(repr((ctx.seed,) + key).encode()).digest()
    return int.from_bytes(h[:8], "little") & ((1 << 62) - 1)


def gen(ctx: Ctx, key, rank: int, n, dtype: torch.dtype, kind: str = "normal") -> torch.Tensor:
    """Deterministic random data of rank `rank` for check `key`, on the CPU.

    Never zeros: floats are normal (or, for products, |x| in [0.5, 1.5] with a
    random sign); integers are small non-zero values so sums and products
    stay meaningful (wrapping in the dtype is part of the reference).
    """
    g = torch.Generator().manual_seed(_seed(ctx, key, rank))
    shape = (n,) if isinstance(n, int) else tuple(n)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        if kind == "prod":
            mag = torch.rand(shape, generator=g, dtype=torch.float64) + 0.5
            sign = torch.randint(0, 2, shape, generator=g).double() * 2 - 1
            x = mag * sign
        else:
            x = torch.randn(shape, generator=g, dtype=torch.float64) + 0.25
        return x.to(dtype)
    if kind == "prod":
        lo, hi = (1, 3) if dtype == torch.uint8 else (-2, 3)
    else:
        lo, hi = (1, 100) if dtype == torch.uint8 else (-60, 61)
    x = torch.randint(lo, hi, shape, generator=g, dtype=torch.int64)
    if kind != "prod":
        x[x == 0] = 7
    else:
        x[x == 0] = 1
    return x.to(dtype)


# --------------------------------------------------------------------------
# Comparison


def tolerance(dtype: torch.dtype, terms: int = 1) -> tuple[float, float]:
    """(rtol, atol) for a result accumulated from `terms` inputs of dtype."""
    if not dtype.is_floating_point:
        return 0.0, 0.0
    eps = _EPS.get(dtype, 0.125)
    k = 4.0 * max(1, terms)
    return k * eps, k * eps


def assert_close(got: torch.Tensor, want: torch.Tensor, what: str, rtol=0.0, atol=0.0) -> None:
    got = got.detach().cpu()
    want = want.detach().cpu()
    if got.shape != want.shape:
        raise AssertionError(f"{what}: shape {tuple(got.shape)} != expected {tuple(want.shape)}")
    if got.dtype != want.dtype:
        raise AssertionError(f"{what}: dtype {got.dtype} != expected {want.dtype}")
    if got.numel() == 0:
        return
    if is_fp8(got.dtype):  # compare fp8 as float32 (exact); eq is not defined for fp8 on every device
        got, want = got.float(), want.float()
    if rtol == 0.0 and atol == 0.0 or not got.dtype.is_floating_point:
        if got.dtype.is_floating_point:
            bad = ~((got == want) | (got.isnan() & want.isnan()))
        else:
            bad = got != want
        if bad.any():
            i = int(bad.nonzero()[0][0]) if got.dim() == 1 else tuple(bad.nonzero()[0].tolist())
            raise AssertionError(
                f"{what}: {int(bad.sum())} of {got.numel()} elements differ; first at {i}: "
                f"got {got[i].item()} want {want[i].item()}"
            )
        return
    g = got.double()
    w = want.double()
    err = (g - w).abs()
    lim = atol + rtol * w.abs()
    bad = (err > lim) | (g.isnan() != w.isnan())
    if bad.any():
        flat = bad.flatten().nonzero()[0][0].item()
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {got.numel()} elements outside rtol {rtol:.3g} atol {atol:.3g}; "
            f"first at flat index {flat}: got {g.flatten()[flat].item()!r} want {w.flatten()[flat].item()!r}; "
            f"max abs err {err.max().item():.3g}"
        )


def expect_close(ctx: Ctx, got, want, what: str, rtol=0.0, atol=0.0) -> None:
    """assert_close that records the mismatch and lets the check go on, so
    every rank keeps issuing the same collectives (a rank that stopped early
    would leave the others waiting); run_check fails the check at its end."""
    try:
        assert_close(got, want, what, rtol, atol)
    except AssertionError as e:
        ctx.errors.append(str(e))


# --------------------------------------------------------------------------
# Check runner


@dataclass
class Check:
    name: str
    fn: object  # fn(ctx) -> None, raises AssertionError / Skip
    group: str
    gloo_ok: bool = True  # False: nothing to test with gloo (reported as SKIP)
    min_world: int = 1


class Registry:
    def __init__(self) -> None:
        self.checks: list[Check] = []

    def add(self, group: str, name: str, fn, gloo_ok: bool = True, min_world: int = 1) -> None:
        self.checks.append(Check(name, fn, group, gloo_ok, min_world))


def _gloo_unsupported(e: BaseException) -> bool:
    s = str(e).lower()
    return any(
        m in s
        for m in (
            "not supported",
            "unsupported",
            "does not support",
            "not implemented",
            "cannot use reduceop",
            "no support",
            "invalid scalar type",
            "only supports",
        )
    ) or isinstance(e, NotImplementedError)


def run_check(ctx: Ctx, c: Check, trace: bool) -> str:
    """Runs one check on every rank; returns PASS, FAIL or SKIP (agreed)."""
    t0 = time.monotonic()
    status, msg = "PASS", ""
    if trace:
        print(f"suite: rank {ctx.rank} start {c.name}", flush=True)
    if ctx.world < c.min_world:
        status, msg = "SKIP", f"needs at least {c.min_world} ranks"
    elif ctx.backend == "gloo" and not c.gloo_ok:
        status, msg = "SKIP", "not available with gloo (the nccl run covers it)"
    else:
        ctx.errors = []
        try:
            c.fn(ctx)
            ctx.sync()
            if ctx.errors:
                more = f" (and {len(ctx.errors) - 1} more)" if len(ctx.errors) > 1 else ""
                raise AssertionError(ctx.errors[0] + more)
        except Skip as e:
            status, msg = "SKIP", str(e)
        except Exception as e:  # noqa: BLE001
            if ctx.backend == "gloo" and _gloo_unsupported(e):
                status, msg = "SKIP", f"gloo: {str(e).splitlines()[0][:160]}"
            else:
                status = "FAIL"
                msg = f"{type(e).__name__}: {e}"
                tb = traceback.format_exc()
                print(f"suite: rank {ctx.rank} FAIL {c.name}\n{tb}", file=sys.stderr, flush=True)
    dt = time.monotonic() - t0
    verdicts = [None] * ctx.world
    dist.all_gather_object(verdicts, (status, msg), group=ctx.report_pg)
    fails = [(r, m) for r, (s, m) in enumerate(verdicts) if s == "FAIL"]
    skips = [(r, m) for r, (s, m) in enumerate(verdicts) if s == "SKIP"]
    if fails:
        agreed = "FAIL"
        detail = f"ranks {[r for r, _ in fails]}: {fails[0][1]}"
    elif skips:
        agreed = "SKIP"
        detail = skips[0][1]
    else:
        agreed, detail = "PASS", ""
    if ctx.rank == 0:
        line = f"{agreed} {c.name} ({dt:.2f}s)"
        if detail:
            line += f": {detail[:600]}"
        print(line, flush=True)
    ctx.results.append((c.name, agreed))
    return agreed


def all_close_world(ctx: Ctx, ok: bool) -> bool:
    flags = [None] * ctx.world
    dist.all_gather_object(flags, ok, group=ctx.report_pg)
    return all(flags)


def simulate_hosts(hosts: int) -> None:
    """Gives this rank the host identity of its block of ranks, before the
    library reads it at init: ranks of different identities never map each
    other's memory, so the job takes the cross-host path as between nodes."""
    world = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    if world % hosts:
        raise SystemExit(f"--hosts {hosts} does not divide {world} ranks")
    per = world // hosts
    name = f"sim-{rank // per}"
    os.environ["WEFT_HOSTNAME"] = name
    os.environ["NCCL_HOSTID"] = name
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    if per == 1:
        # One rank per host: NCCL's socket transport, as between machines.
        os.environ.setdefault("NCCL_NET", "Socket")
        os.environ.setdefault("NCCL_P2P_DISABLE", "1")
        os.environ.setdefault("NCCL_SHM_DISABLE", "1")
