"""Point-to-point: unbatched isend/irecv rings (the pattern torch issues one
call at a time, serialized with its other work), blocking send/recv pairs,
and batch_isend_irecv (one NCCL group)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from common import Ctx, Registry, dname, expect_close, gen

RING_SIZES = (333, 1 << 20, 16 << 20)  # floats: 333, 1 Mi, 16 Mi (64 MiB)


def _ring(ctx: Ctx):
    return (ctx.rank + 1) % ctx.world, (ctx.rank - 1) % ctx.world


def check_ring_unbatched(n: int, dtype=torch.float32):
    """isend(next); irecv(prev); wait both -- the ring of issue 17."""

    def run(ctx: Ctx) -> None:
        nxt, prv = _ring(ctx)
        for it in range(2):  # the second round runs on connected peers
            key = ("ring", n, dname(dtype), it)
            s = gen(ctx, key, ctx.rank, n, dtype).to(ctx.device, copy=True)
            r = torch.empty(n, dtype=dtype, device=ctx.device)
            ws = dist.isend(s, nxt)
            wr = dist.irecv(r, prv)
            ws.wait()
            wr.wait()
            expect_close(ctx, r, gen(ctx, key, prv, n, dtype), f"round {it} n={n} from rank {prv}")

    return run


def check_ring_both_directions(ctx: Ctx) -> None:
    """Unbatched: send to both neighbours, then receive from both."""
    nxt, prv = _ring(ctx)
    for n in (333, 65537):
        key = ("ring2", n)
        a = gen(ctx, key + ("fwd",), ctx.rank, n, torch.float32).to(ctx.device, copy=True)
        b = gen(ctx, key + ("bwd",), ctx.rank, n, torch.float32).to(ctx.device, copy=True)
        ra = torch.empty_like(a)
        rb = torch.empty_like(b)
        works = [dist.isend(a, nxt), dist.isend(b, prv), dist.irecv(ra, prv), dist.irecv(rb, nxt)]
        for w in works:
            w.wait()
        expect_close(ctx, ra, gen(ctx, key + ("fwd",), prv, n, torch.float32), f"n={n} forward")
        expect_close(ctx, rb, gen(ctx, key + ("bwd",), nxt, n, torch.float32), f"n={n} backward")


def check_send_recv_blocking(ctx: Ctx) -> None:
    """Blocking send/recv in pairs (even ranks send first)."""
    w, me = ctx.world, ctx.rank
    peer = me ^ 1
    if peer >= w:
        return  # odd world: the last rank has no partner
    for n in (1, 1021, 1 << 20):
        key = ("sendrecv", n)
        s = gen(ctx, key, me, n, torch.float32).to(ctx.device, copy=True)
        r = torch.empty(n, dtype=torch.float32, device=ctx.device)
        if me % 2 == 0:
            dist.send(s, peer)
            dist.recv(r, peer)
        else:
            dist.recv(r, peer)
            dist.send(s, peer)
        expect_close(ctx, r, gen(ctx, key, peer, n, torch.float32), f"n={n} from {peer}")


def check_batch_isend_irecv(ctx: Ctx) -> None:
    nxt, prv = _ring(ctx)
    for n in (333, (1 << 20) + 3, 4 << 20):
        key = ("batch", n)
        a = gen(ctx, key + ("fwd",), ctx.rank, n, torch.float32).to(ctx.device, copy=True)
        b = gen(ctx, key + ("bwd",), ctx.rank, n, torch.float32).to(ctx.device, copy=True)
        ra = torch.empty_like(a)
        rb = torch.empty_like(b)
        ops = [
            dist.P2POp(dist.isend, a, nxt),
            dist.P2POp(dist.irecv, ra, prv),
            dist.P2POp(dist.isend, b, prv),
            dist.P2POp(dist.irecv, rb, nxt),
        ]
        for req in dist.batch_isend_irecv(ops):
            req.wait()
        expect_close(ctx, ra, gen(ctx, key + ("fwd",), prv, n, torch.float32), f"n={n} forward")
        expect_close(ctx, rb, gen(ctx, key + ("bwd",), nxt, n, torch.float32), f"n={n} backward")


def check_batch_all_pairs(ctx: Ctx) -> None:
    """One batch in which every rank exchanges a differently sized, differently
    typed message with every other rank."""
    w, me = ctx.world, ctx.rank
    dtypes = (torch.float32, torch.bfloat16, torch.int64)
    ops, recvs = [], []
    for peer in range(w):
        if peer == me:
            continue
        for i, dt in enumerate(dtypes):
            n_out = 17 + 31 * me + 7 * peer + i
            n_in = 17 + 31 * peer + 7 * me + i
            s = gen(ctx, ("pairs", dname(dt), peer), me, n_out, dt).to(ctx.device, copy=True)
            r = torch.empty(n_in, dtype=dt, device=ctx.device)
            ops += [dist.P2POp(dist.isend, s, peer), dist.P2POp(dist.irecv, r, peer)]
            recvs.append((r, peer, dt, n_in))
    if not ops:
        return
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    for r, peer, dt, n in recvs:
        expect_close(ctx, r, gen(ctx, ("pairs", dname(dt), me), peer, n, dt), f"{dname(dt)} from {peer}")


def register(reg: Registry) -> None:
    for n in RING_SIZES:
        reg.add("p2p", f"p2p.ring_unbatched.float32.{n}", check_ring_unbatched(n), min_world=2)
    for dt in (torch.bfloat16, torch.int64, torch.uint8):
        reg.add("p2p", f"p2p.ring_unbatched.{dname(dt)}.1021", check_ring_unbatched(1021, dt), min_world=2)
    reg.add("p2p", "p2p.ring_both_directions", check_ring_both_directions, min_world=2)
    reg.add("p2p", "p2p.send_recv_blocking", check_send_recv_blocking, min_world=2)
    reg.add("p2p", "p2p.batch_isend_irecv", check_batch_isend_irecv, min_world=2)
    reg.add("p2p", "p2p.batch_isend_irecv.all_pairs", check_batch_all_pairs, min_world=2)
