"""Sub-communicators: new_group and split_group, each used while collectives
on the world group are in flight at the same time (separate NCCL
communicators and streams), and point-to-point inside a subgroup."""

from __future__ import annotations

import torch
import torch.distributed as dist

from collectives import reduce_ref, reduce_tol
from common import Ctx, Registry, Skip, expect_close, gen


def _halves(world: int):
    return [r for r in range(world) if r % 2 == 0], [r for r in range(world) if r % 2 == 1]


def _concurrent(ctx: Ctx, sub, members: list, tag: str) -> None:
    """World and subgroup collectives in flight together, three rounds."""
    me = ctx.rank
    sub_rank = members.index(me)
    nsub = len(members)
    for it in range(3):
        key_w = (tag, "world", it)
        key_s = (tag, "sub", tuple(members), it)
        n_w, n_s = 65537 + it, 1021 + 2 * it
        w_in = [gen(ctx, key_w, r, n_w, torch.float32) for r in range(ctx.world)]
        s_in = [gen(ctx, key_s, r, n_s, torch.float32) for r in members]
        tw = w_in[me].to(ctx.device, copy=True)
        ts = s_in[sub_rank].to(ctx.device, copy=True)
        root = members[it % nsub]  # a global rank
        bc_all = [gen(ctx, key_s + ("bc",), r, 333, torch.bfloat16) for r in members]
        tb = bc_all[sub_rank].to(ctx.device, copy=True)
        ag_out = torch.empty(nsub * n_s, dtype=torch.float32, device=ctx.device)
        ag_src = ts.clone()
        works = [
            dist.all_reduce(tw, async_op=True),
            dist.all_reduce(ts, group=sub, async_op=True),
            dist.broadcast(tb, src=root, group=sub, async_op=True),
            dist.all_gather_into_tensor(ag_out, ag_src, group=sub, async_op=True),
        ]
        for w in works:
            w.wait()
        expect_close(ctx, tw, reduce_ref(w_in, "SUM", torch.float32), f"round {it} world all_reduce", *reduce_tol(w_in, "SUM", torch.float32))
        expect_close(ctx, ts, reduce_ref(s_in, "SUM", torch.float32), f"round {it} subgroup all_reduce", *reduce_tol(s_in, "SUM", torch.float32))
        expect_close(ctx, tb, bc_all[members.index(root)], f"round {it} subgroup broadcast from {root}")
        expect_close(ctx, ag_out, torch.cat(s_in), f"round {it} subgroup all_gather")
    # Point-to-point inside the subgroup: a ring over its members.
    if nsub >= 2:
        nxt = members[(sub_rank + 1) % nsub]
        prv = members[(sub_rank - 1) % nsub]
        key = (tag, "subring")
        s = gen(ctx, key, me, 4099, torch.float32).to(ctx.device, copy=True)
        r = torch.empty_like(s)
        ws = dist.isend(s, nxt, group=sub)
        wr = dist.irecv(r, prv, group=sub)
        ws.wait()
        wr.wait()
        expect_close(ctx, r, gen(ctx, key, prv, 4099, torch.float32), f"subgroup ring from {prv}")


def check_new_group(ctx: Ctx) -> None:
    evens, odds = _halves(ctx.world)
    g_even = dist.new_group(ranks=evens)
    g_odd = dist.new_group(ranks=odds)
    mine, members = (g_even, evens) if ctx.rank % 2 == 0 else (g_odd, odds)
    got = dist.get_process_group_ranks(mine)
    if got != members:
        raise AssertionError(f"get_process_group_ranks {got} != {members}")
    if dist.get_rank(mine) != members.index(ctx.rank) or dist.get_world_size(mine) != len(members):
        raise AssertionError("group rank/size do not match the members")
    _concurrent(ctx, mine, members, "new_group")
    # A group of every rank, created after the halves.
    g_all = dist.new_group(ranks=list(range(ctx.world)))
    _concurrent(ctx, g_all, list(range(ctx.world)), "new_group_all")


def check_split_group(ctx: Ctx) -> None:
    if not hasattr(dist, "split_group"):
        raise Skip(f"torch {torch.__version__} has no torch.distributed.split_group")
    if ctx.nccl and not ctx.eager:
        raise Skip("split_group needs the world group bound to a device (eager init); run without --lazy-init")
    evens, odds = _halves(ctx.world)
    splits = [evens, odds] if odds else [evens]
    mine = dist.split_group(split_ranks=splits)
    if mine is None:
        raise AssertionError("split_group returned None for a member rank")
    members = evens if ctx.rank % 2 == 0 else odds
    got = dist.get_process_group_ranks(mine)
    if got != members:
        raise AssertionError(f"get_process_group_ranks {got} != {members}")
    _concurrent(ctx, mine, members, "split_group")
    # Every rank in one split: a second communicator over the whole world.
    everyone = list(range(ctx.world))
    g_all = dist.split_group(split_ranks=[everyone])
    _concurrent(ctx, g_all, everyone, "split_group_all")


def register(reg: Registry) -> None:
    reg.add("groups", "groups.new_group_concurrent_with_world", check_new_group, min_world=2)
    # gloo has no split_group (it needs a bound device): the nccl run covers it.
    reg.add("groups", "groups.split_group_concurrent_with_world", check_split_group, gloo_ok=False, min_world=2)
