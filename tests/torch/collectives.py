"""Collectives of torch.distributed that ProcessGroupNCCL maps to NCCL calls,
each checked against a reference computed locally from every rank's seeded
input: all_reduce (every ReduceOp, every dtype where the op is valid),
all_gather_into_tensor, all_gather, reduce_scatter_tensor, reduce_scatter,
broadcast, reduce, all_to_all_single (even and uneven splits), all_to_all,
gather, scatter, barrier and the object collectives."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from common import (
    _EPS,
    MOVE_DTYPES,
    ODD_SIZES,
    REDUCE_DTYPES,
    Ctx,
    Registry,
    Skip,
    dname,
    expect_close,
    gen,
    is_fp8,
)

R = dist.ReduceOp
PREMUL_FACTOR = 0.375  # exact in every float dtype


def _premul(dtype: torch.dtype, factor):
    # torch 2.11 hands NCCL a float32 factor for a bfloat16 PREMUL_SUM (and
    # wants a float32 factor tensor), which NCCL reads as a bfloat16: with
    # NVIDIA's NCCL 2.28 the result is all zeros (checked on the GPU machine,
    # one rank, factor 0.75). Weft reads the scalar as NCCL does, so there is
    # nothing meaningful to compare.
    if dtype == torch.bfloat16:
        raise Skip("torch passes a float32 factor for bfloat16 PREMUL_SUM; NCCL itself returns zeros")
    return dist._make_nccl_premul_sum(factor)


# name -> (op maker, valid for integers)
OPS = {
    "SUM": (lambda dt, dev: R.SUM, True),
    "PRODUCT": (lambda dt, dev: R.PRODUCT, True),
    "MIN": (lambda dt, dev: R.MIN, True),
    "MAX": (lambda dt, dev: R.MAX, True),
    "AVG": (lambda dt, dev: R.AVG, False),
    "PREMUL_SUM": (lambda dt, dev: _premul(dt, PREMUL_FACTOR), False),
    # The factor as a device tensor (NCCL's ncclScalarDevice).
    "PREMUL_SUM_TENSOR": (
        lambda dt, dev: _premul(dt, torch.tensor([PREMUL_FACTOR], dtype=dt, device=dev)),
        False,
    ),
}


def fp8_dtypes() -> list:
    return [getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)]


def reduce_ref(inputs: list, op: str, dtype: torch.dtype) -> torch.Tensor:
    """The reduction of `inputs` (CPU tensors of dtype) as NCCL defines it."""
    world = len(inputs)
    if dtype == torch.bool:
        st = torch.stack(inputs)
        if op in ("SUM", "MAX"):  # torch sends bool SUM as ncclMax
            return st.any(0)
        return st.all(0)  # PRODUCT (as ncclMin) and MIN
    if op in ("MIN", "MAX"):
        st = torch.stack([x.double() if dtype.is_floating_point else x.long() for x in inputs])
        r = st.amin(0) if op == "MIN" else st.amax(0)
        return r.to(dtype)
    if dtype.is_floating_point:
        st = torch.stack([x.double() for x in inputs])
        if op == "SUM":
            r = st.sum(0)
        elif op == "PRODUCT":
            r = st.prod(0)
        elif op == "AVG":
            r = st.sum(0) / world
        else:  # PREMUL_SUM
            r = (st * PREMUL_FACTOR).sum(0)
        return r.to(dtype)
    st = torch.stack([x.long() for x in inputs])
    r = st.sum(0) if op == "SUM" else st.prod(0)
    return r.to(dtype)  # integer casts wrap, as the dtype's arithmetic does


def reduce_tol(inputs: list, op: str, dtype: torch.dtype) -> tuple[float, float]:
    if not dtype.is_floating_point or op in ("MIN", "MAX"):
        return 0.0, 0.0
    eps = _EPS[dtype]
    world = len(inputs)
    # fp8: each of the world-1 additions rounds to fp8 (at most eps/2 of the
    # partial sum), so world * eps * sum|x| bounds it; other types get slack.
    k = float(world) if is_fp8(dtype) else 4.0 * (world + 1)
    if op == "PRODUCT":
        return k * eps, 1e-30
    scale = torch.stack([x.double().abs() for x in inputs]).sum(0).max().item()
    if op == "AVG":
        scale /= world
    return k * eps, k * eps * scale


def _kind(op: str) -> str:
    return "prod" if op == "PRODUCT" else "normal"


def _dev(ctx: Ctx, x: torch.Tensor) -> torch.Tensor:
    return x.to(ctx.device, copy=True)


def _op_allowed(op: str, dtype: torch.dtype) -> bool:
    if dtype == torch.bool:
        return op in ("SUM", "PRODUCT", "MIN", "MAX")
    return OPS[op][1] or dtype.is_floating_point


# --------------------------------------------------------------------------
# all_reduce


def check_all_reduce(op: str, dtype: torch.dtype):
    def run(ctx: Ctx) -> None:
        for n in ODD_SIZES:
            key = ("all_reduce", op, dname(dtype), n)
            inputs = [gen(ctx, key, r, n, dtype, _kind(op)) for r in range(ctx.world)]
            t = _dev(ctx, inputs[ctx.rank])
            dist.all_reduce(t, op=OPS[op][0](dtype, ctx.device))
            rtol, atol = reduce_tol(inputs, op, dtype)
            expect_close(ctx, t, reduce_ref(inputs, op, dtype), f"n={n}", rtol, atol)

    return run


def fp8_reduction(check):
    """torch maps float8_e4m3fn/e5m2 reductions to NCCL's fp8 types; where
    this torch refuses (its 'Unsupported Float8 type'), report SKIP."""

    def run(ctx: Ctx) -> None:
        try:
            check(ctx)
        except (RuntimeError, TypeError) as e:
            if "Float8" in str(e) or "float8" in str(e):
                raise Skip(f"torch: {str(e).splitlines()[0][:160]}") from e
            raise

    return run


def check_all_reduce_async(ctx: Ctx) -> None:
    """Several async all_reduces in flight at once, waited in reverse order."""
    works, tensors, refs = [], [], []
    for i, n in enumerate((333, 4099, 1 << 20 | 1)):
        key = ("all_reduce_async", i)
        inputs = [gen(ctx, key, r, n, torch.float32) for r in range(ctx.world)]
        t = _dev(ctx, inputs[ctx.rank])
        works.append(dist.all_reduce(t, async_op=True))
        tensors.append(t)
        refs.append((inputs, n))
    for w in reversed(works):
        w.wait()
    for t, (inputs, n) in zip(tensors, refs):
        rtol, atol = reduce_tol(inputs, "SUM", torch.float32)
        expect_close(ctx, t, reduce_ref(inputs, "SUM", torch.float32), f"n={n}", rtol, atol)


def check_all_reduce_noncontig_2d(ctx: Ctx) -> None:
    """A 2-D tensor with odd dimensions (torch flattens it)."""
    shape = (37, 129)
    inputs = [gen(ctx, "ar2d", r, shape, torch.float32) for r in range(ctx.world)]
    t = _dev(ctx, inputs[ctx.rank])
    dist.all_reduce(t)
    rtol, atol = reduce_tol(inputs, "SUM", torch.float32)
    expect_close(ctx, t, reduce_ref(inputs, "SUM", torch.float32), "37x129", rtol, atol)


# --------------------------------------------------------------------------
# all_gather


def _move_inputs(ctx: Ctx, key, n, dtype):
    """Per-rank inputs; fp8 is made from floats (torch cannot draw fp8 directly)."""
    if dtype in fp8_dtypes():
        return [gen(ctx, key, r, n, torch.float32).to(dtype) for r in range(ctx.world)]
    return [gen(ctx, key, r, n, dtype) for r in range(ctx.world)]


def _same_bits(ctx: Ctx, got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    if got.dtype in fp8_dtypes():
        got, want = got.view(torch.uint8), want.view(torch.uint8)
    expect_close(ctx, got, want, what)


def check_all_gather_into_tensor(dtype):
    def run(ctx: Ctx) -> None:
        for n in ODD_SIZES:
            inputs = _move_inputs(ctx, ("agt", dname(dtype), n), n, dtype)
            x = _dev(ctx, inputs[ctx.rank])
            out = torch.empty(ctx.world * n, dtype=dtype, device=ctx.device)
            dist.all_gather_into_tensor(out, x)
            _same_bits(ctx, out, torch.cat(inputs), f"concat n={n}")
            if ctx.nccl:  # the stacked form, output (world, n): gloo lacks it
                out2 = torch.empty(ctx.world, n, dtype=dtype, device=ctx.device)
                dist.all_gather_into_tensor(out2, x)
                _same_bits(ctx, out2, torch.stack(inputs), f"stack n={n}")

    return run


def check_all_gather_list(dtype):
    def run(ctx: Ctx) -> None:
        for n in (1, 1021, 65537):
            inputs = _move_inputs(ctx, ("ag", dname(dtype), n), n, dtype)
            outs = [torch.empty(n, dtype=dtype, device=ctx.device) for _ in range(ctx.world)]
            dist.all_gather(outs, _dev(ctx, inputs[ctx.rank]))
            for r in range(ctx.world):
                _same_bits(ctx, outs[r], inputs[r], f"n={n} from rank {r}")

    return run


# --------------------------------------------------------------------------
# reduce_scatter


def check_reduce_scatter_tensor(op: str, dtype):
    def run(ctx: Ctx) -> None:
        for n in (1, 1021, 65537):
            key = ("rst", op, dname(dtype), n)
            inputs = [gen(ctx, key, r, ctx.world * n, dtype, _kind(op)) for r in range(ctx.world)]
            out = torch.empty(n, dtype=dtype, device=ctx.device)
            dist.reduce_scatter_tensor(out, _dev(ctx, inputs[ctx.rank]), op=OPS[op][0](dtype, ctx.device))
            mine = [x[ctx.rank * n : (ctx.rank + 1) * n] for x in inputs]
            rtol, atol = reduce_tol(mine, op, dtype)
            expect_close(ctx, out, reduce_ref(mine, op, dtype), f"n={n}", rtol, atol)

    return run


def check_reduce_scatter_list(ctx: Ctx) -> None:
    dtype = torch.float32
    for n in (1, 1021, 65537):
        key = ("rsl", n)
        inputs = [gen(ctx, key, r, ctx.world * n, dtype) for r in range(ctx.world)]
        mine_in = _dev(ctx, inputs[ctx.rank])
        in_list = [mine_in[j * n : (j + 1) * n].clone() for j in range(ctx.world)]
        out = torch.empty(n, dtype=dtype, device=ctx.device)
        dist.reduce_scatter(out, in_list)
        mine = [x[ctx.rank * n : (ctx.rank + 1) * n] for x in inputs]
        rtol, atol = reduce_tol(mine, "SUM", dtype)
        expect_close(ctx, out, reduce_ref(mine, "SUM", dtype), f"n={n}", rtol, atol)


# --------------------------------------------------------------------------
# broadcast, reduce


def check_broadcast(dtype):
    def run(ctx: Ctx) -> None:
        for root in range(ctx.world):
            for n in (1, 1021, 65537):
                inputs = _move_inputs(ctx, ("bc", dname(dtype), n, root), n, dtype)
                t = _dev(ctx, inputs[ctx.rank])  # every rank starts with its own data
                dist.broadcast(t, src=root)
                _same_bits(ctx, t, inputs[root], f"root {root} n={n}")

    return run


def check_reduce(op: str, dtype):
    def run(ctx: Ctx) -> None:
        for root in range(ctx.world):
            for n in (1, 1021, 65537):
                key = ("reduce", op, dname(dtype), n, root)
                inputs = [gen(ctx, key, r, n, dtype, _kind(op)) for r in range(ctx.world)]
                t = _dev(ctx, inputs[ctx.rank])
                dist.reduce(t, dst=root, op=OPS[op][0](dtype, ctx.device))
                if ctx.rank == root:
                    rtol, atol = reduce_tol(inputs, op, dtype)
                    expect_close(ctx, t, reduce_ref(inputs, op, dtype), f"root {root} n={n}", rtol, atol)

    return run


# --------------------------------------------------------------------------
# all_to_all


def _a2a_count(src: int, dst: int) -> int:
    """Rows rank src sends to rank dst in the uneven exchange (0 included)."""
    return 0 if (src + dst) % 5 == 4 else src + 2 * dst + 1


def check_all_to_all_single_even(dtype):
    def run(ctx: Ctx) -> None:
        for n in (1, 333, 16411):
            key = ("a2a_even", dname(dtype), n)
            inputs = [gen(ctx, key, r, ctx.world * n, dtype) for r in range(ctx.world)]
            out = torch.empty(ctx.world * n, dtype=dtype, device=ctx.device)
            dist.all_to_all_single(out, _dev(ctx, inputs[ctx.rank]))
            want = torch.cat([inputs[j][ctx.rank * n : (ctx.rank + 1) * n] for j in range(ctx.world)])
            expect_close(ctx, out, want, f"n={n}")

    return run


def check_all_to_all_single_uneven(dtype):
    def run(ctx: Ctx) -> None:
        width = 3  # rows of 3 elements: splits count rows of a 2-D tensor
        for scale in (1, 97):
            w, me = ctx.world, ctx.rank
            send = [_a2a_count(me, j) * scale for j in range(w)]
            recv = [_a2a_count(j, me) * scale for j in range(w)]
            key = ("a2a_uneven", dname(dtype), scale)
            inputs = [
                gen(ctx, key, r, (sum(_a2a_count(r, j) * scale for j in range(w)), width), dtype)
                for r in range(w)
            ]
            out = torch.empty(sum(recv), width, dtype=dtype, device=ctx.device)
            dist.all_to_all_single(out, _dev(ctx, inputs[me]), output_split_sizes=recv, input_split_sizes=send)
            parts = []
            for j in range(w):
                off = sum(_a2a_count(j, k) * scale for k in range(me))
                parts.append(inputs[j][off : off + _a2a_count(j, me) * scale])
            expect_close(ctx, out, torch.cat(parts), f"scale {scale} splits send {send} recv {recv}")

    return run


def check_all_to_all_list(dtype):
    def run(ctx: Ctx) -> None:
        w, me = ctx.world, ctx.rank
        key = ("a2a_list", dname(dtype))
        # the tensor src sends to dst is gen(key, (src, dst)) of _a2a_count(src, dst)*7+1 elements
        def piece(src, dst):
            return gen(ctx, key, src * 1000 + dst, _a2a_count(src, dst) * 7 + 1, dtype)

        ins = [_dev(ctx, piece(me, j)) for j in range(w)]
        outs = [torch.empty(_a2a_count(j, me) * 7 + 1, dtype=dtype, device=ctx.device) for j in range(w)]
        dist.all_to_all(outs, ins)
        for j in range(w):
            expect_close(ctx, outs[j], piece(j, me), f"from rank {j}")

    return run


# --------------------------------------------------------------------------
# gather, scatter


def check_gather(dtype):
    def run(ctx: Ctx) -> None:
        for root in range(ctx.world):
            for n in (1, 1021, 65537):
                inputs = _move_inputs(ctx, ("gather", dname(dtype), n, root), n, dtype)
                glist = (
                    [torch.empty(n, dtype=dtype, device=ctx.device) for _ in range(ctx.world)]
                    if ctx.rank == root
                    else None
                )
                dist.gather(_dev(ctx, inputs[ctx.rank]), gather_list=glist, dst=root)
                if ctx.rank == root:
                    for r in range(ctx.world):
                        _same_bits(ctx, glist[r], inputs[r], f"root {root} n={n} from {r}")

    return run


def check_scatter(dtype):
    def run(ctx: Ctx) -> None:
        for root in range(ctx.world):
            for n in (1, 1021, 65537):
                pieces = _move_inputs(ctx, ("scatter", dname(dtype), n, root), n, dtype)
                slist = [_dev(ctx, p) for p in pieces] if ctx.rank == root else None
                out = _dev(ctx, _move_inputs(ctx, ("scatter-junk", n), n, dtype)[ctx.rank])
                dist.scatter(out, scatter_list=slist, src=root)
                _same_bits(ctx, out, pieces[ctx.rank], f"root {root} n={n}")

    return run


# --------------------------------------------------------------------------
# barrier, objects


def check_barrier(ctx: Ctx) -> None:
    """Each round one rank sleeps, then sets a store key, then enters the
    barrier; after the barrier every rank must see the key."""
    store = dist.distributed_c10d._get_default_store()
    for i in range(min(ctx.world, 4)):
        late = i % ctx.world
        key = f"suite-barrier-{ctx.seed}-{i}"
        t0 = time.monotonic()
        if ctx.rank == late:
            time.sleep(0.3)
            store.set(key, "1")
        dist.barrier()
        if not store.check([key]):
            raise AssertionError(f"round {i}: left the barrier before rank {late} reached it")
        if ctx.rank != late and time.monotonic() - t0 < 0.25:
            raise AssertionError(f"round {i}: barrier returned after {time.monotonic() - t0:.3f}s, before rank {late} arrived")


def _obj(ctx: Ctx, r: int, tag: str):
    x = gen(ctx, ("obj", tag), r, 5, torch.float64)
    return {"rank": r, "tag": tag, "vals": [round(v, 9) for v in x.tolist()], "s": "w" * (r * 37 + 3)}


def check_broadcast_object_list(ctx: Ctx) -> None:
    for root in range(ctx.world):
        objs = [_obj(ctx, root, f"b{i}") for i in range(3)] if ctx.rank == root else [None] * 3
        dist.broadcast_object_list(objs, src=root)
        want = [_obj(ctx, root, f"b{i}") for i in range(3)]
        if objs != want:
            raise AssertionError(f"root {root}: got {objs!r:.200} want {want!r:.200}")


def check_all_gather_object(ctx: Ctx) -> None:
    out = [None] * ctx.world
    dist.all_gather_object(out, _obj(ctx, ctx.rank, "ag"))
    want = [_obj(ctx, r, "ag") for r in range(ctx.world)]
    if out != want:
        raise AssertionError(f"got {out!r:.300}")


def check_gather_object(ctx: Ctx) -> None:
    for root in range(ctx.world):
        out = [None] * ctx.world if ctx.rank == root else None
        dist.gather_object(_obj(ctx, ctx.rank, f"g{root}"), out, dst=root)
        if ctx.rank == root:
            want = [_obj(ctx, r, f"g{root}") for r in range(ctx.world)]
            if out != want:
                raise AssertionError(f"root {root}: got {out!r:.300}")


def check_scatter_object_list(ctx: Ctx) -> None:
    for root in range(ctx.world):
        ins = [_obj(ctx, r, f"s{root}") for r in range(ctx.world)] if ctx.rank == root else None
        out = [None]
        dist.scatter_object_list(out, ins, src=root)
        if out[0] != _obj(ctx, ctx.rank, f"s{root}"):
            raise AssertionError(f"root {root}: got {out[0]!r:.200}")


# --------------------------------------------------------------------------


def register(reg: Registry) -> None:
    for op in OPS:
        for dt in REDUCE_DTYPES + (torch.bool,):
            if _op_allowed(op, dt):
                gloo = op not in ("AVG", "PREMUL_SUM", "PREMUL_SUM_TENSOR")
                reg.add("all_reduce", f"all_reduce.{op}.{dname(dt)}", check_all_reduce(op, dt), gloo_ok=gloo)
    for dt in fp8_dtypes():
        for op in ("SUM", "MIN", "MAX"):
            reg.add("all_reduce", f"all_reduce.{op}.{dname(dt)}", fp8_reduction(check_all_reduce(op, dt)), gloo_ok=False)
        reg.add(
            "reduce_scatter",
            f"reduce_scatter_tensor.SUM.{dname(dt)}",
            fp8_reduction(check_reduce_scatter_tensor("SUM", dt)),
            gloo_ok=False,
        )
    reg.add("all_reduce", "all_reduce.async_in_flight", check_all_reduce_async)
    reg.add("all_reduce", "all_reduce.2d_odd_shape", check_all_reduce_noncontig_2d)
    for dt in MOVE_DTYPES + tuple(fp8_dtypes()):
        reg.add("all_gather", f"all_gather_into_tensor.{dname(dt)}", check_all_gather_into_tensor(dt))
    for dt in (torch.float32, torch.bfloat16, torch.int64, torch.uint8):
        reg.add("all_gather", f"all_gather.{dname(dt)}", check_all_gather_list(dt))
    for dt in REDUCE_DTYPES:
        reg.add("reduce_scatter", f"reduce_scatter_tensor.SUM.{dname(dt)}", check_reduce_scatter_tensor("SUM", dt))
    for op in ("PRODUCT", "MIN", "MAX", "AVG", "PREMUL_SUM", "PREMUL_SUM_TENSOR"):
        for dt in (torch.float32, torch.bfloat16, torch.int32):
            if _op_allowed(op, dt):
                gloo = op not in ("AVG", "PREMUL_SUM", "PREMUL_SUM_TENSOR")
                reg.add(
                    "reduce_scatter",
                    f"reduce_scatter_tensor.{op}.{dname(dt)}",
                    check_reduce_scatter_tensor(op, dt),
                    gloo_ok=gloo,
                )
    reg.add("reduce_scatter", "reduce_scatter.list.float32", check_reduce_scatter_list)
    for dt in MOVE_DTYPES + tuple(fp8_dtypes()):
        reg.add("broadcast", f"broadcast.{dname(dt)}", check_broadcast(dt))
    for dt in REDUCE_DTYPES:
        reg.add("reduce", f"reduce.SUM.{dname(dt)}", check_reduce("SUM", dt))
    for op in ("PRODUCT", "MIN", "MAX", "AVG", "PREMUL_SUM"):
        for dt in (torch.float32, torch.float16, torch.int64):
            if _op_allowed(op, dt):
                gloo = op not in ("AVG", "PREMUL_SUM")
                reg.add("reduce", f"reduce.{op}.{dname(dt)}", check_reduce(op, dt), gloo_ok=gloo)
    for dt in REDUCE_DTYPES + (torch.bool,):
        reg.add("all_to_all", f"all_to_all_single.even.{dname(dt)}", check_all_to_all_single_even(dt))
        reg.add("all_to_all", f"all_to_all_single.uneven.{dname(dt)}", check_all_to_all_single_uneven(dt))
    for dt in (torch.float32, torch.bfloat16, torch.int64):
        reg.add("all_to_all", f"all_to_all.list.{dname(dt)}", check_all_to_all_list(dt))
    for dt in (torch.float32, torch.float16, torch.int64, torch.uint8):
        reg.add("gather", f"gather.{dname(dt)}", check_gather(dt))
        reg.add("scatter", f"scatter.{dname(dt)}", check_scatter(dt))
    reg.add("barrier", "barrier", check_barrier)
    reg.add("objects", "broadcast_object_list", check_broadcast_object_list)
    reg.add("objects", "all_gather_object", check_all_gather_object)
    reg.add("objects", "gather_object", check_gather_object)
    reg.add("objects", "scatter_object_list", check_scatter_object_list)



