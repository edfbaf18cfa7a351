"""Bus bandwidth of torch.distributed collectives, as nccl-tests reports it,
for setups nccl-tests cannot reach (ranks in separate network namespaces,
whose MPI launcher cannot cross them: torchrun's TCP store can).

    torchrun --nproc-per-node 2 tests/torch/busbw.py --hosts 2 --label nccl
    LD_PRELOAD=.../libnccl.so.2 torchrun ... tests/torch/busbw.py --hosts 2 --label weft

Two hosts as two network namespaces joined by a veth pair (one torchrun
agent per namespace, `--nnodes 2 --node-rank 0|1 --master-addr` the first's
veth address; set `WEFT_LISTEN_ADDR` / `NCCL_SOCKET_IFNAME` to the veth):
docs/PERFORMANCE-GPU.md, "Across hosts".

For each collective and size (bytes of the largest buffer, as nccl-tests
counts them), float32 random data, --warmup untimed calls, then --iters
calls timed together between two synchronizations: time per call, algbw =
bytes / time, busbw = algbw x nccl-tests' factor (all-reduce 2(n-1)/n;
all-gather, reduce-scatter and all-to-all (n-1)/n; send/recv (a ring,
batched isend/irecv) and broadcast 1). The last call's result is checked
against the reference (small integers: exact in any order). Rank 0 prints
one row per cell:

    busbw <label> <op> <bytes> <us per call> <algbw GB/s> <busbw GB/s> ok|WRONG
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import pick_device, simulate_hosts  # noqa: E402

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "sendrecv", "broadcast")


def cell(op: str, nbytes: int, n: int, me: int, dev):
    """(call, check, factor): a call to time, a check of its last result,
    nccl-tests' bus bandwidth factor."""
    per = max(1, nbytes // 4 // n)  # elements per rank's block
    total = per * n
    g = torch.Generator().manual_seed(1234)
    inputs = [torch.randint(-8, 9, (total,), generator=g).float() for _ in range(n)]
    mine = inputs[me].to(dev)
    if op == "all_reduce":
        t = mine.clone()
        want = sum(inputs)

        def call():
            t.copy_(mine)
            dist.all_reduce(t)

        return call, lambda: torch.equal(t.cpu(), want), 2 * (n - 1) / n
    if op == "all_gather":
        out = torch.empty(total, device=dev)
        src = mine[:per]
        want = torch.cat([x[:per] for x in inputs])
        return (lambda: dist.all_gather_into_tensor(out, src)), (lambda: torch.equal(out.cpu(), want)), (n - 1) / n
    if op == "reduce_scatter":
        out = torch.empty(per, device=dev)
        want = sum(inputs)[me * per:(me + 1) * per]
        return (lambda: dist.reduce_scatter_tensor(out, mine)), (lambda: torch.equal(out.cpu(), want)), (n - 1) / n
    if op == "all_to_all":
        out = torch.empty(total, device=dev)
        want = torch.cat([x[me * per:(me + 1) * per] for x in inputs])
        return (lambda: dist.all_to_all_single(out, mine)), (lambda: torch.equal(out.cpu(), want)), (n - 1) / n
    if op == "sendrecv":
        out = torch.empty(total, device=dev)
        nxt, prv = (me + 1) % n, (me - 1) % n
        want = inputs[prv]

        def call():
            reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, mine, nxt), dist.P2POp(dist.irecv, out, prv)])
            for r in reqs:
                r.wait()

        return call, lambda: torch.equal(out.cpu(), want), 1.0
    if op == "broadcast":
        t = mine.clone()
        want = inputs[0]

        def call():
            dist.broadcast(t, 0)

        return call, lambda: torch.equal(t.cpu(), want), 1.0
    raise SystemExit(f"busbw: unknown op {op!r} (one of {', '.join(OPS)})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", default="all_reduce,sendrecv,all_to_all")
    ap.add_argument("--sizes", default=",".join(str(1 << s) for s in (20, 22, 24, 26, 28)), help="bytes")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--label", default="weft")
    ap.add_argument("--hosts", type=int, default=1, help="simulated hosts (common.simulate_hosts)")
    args = ap.parse_args()
    if args.hosts > 1:
        simulate_hosts(args.hosts)
    dev = pick_device("nccl")
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", device_id=dev)
    n, me = dist.get_world_size(), dist.get_rank()
    bad = 0
    for op in [o for o in args.ops.split(",") if o]:
        for nbytes in [int(s) for s in args.sizes.split(",") if s]:
            call, check, factor = cell(op, nbytes, n, me, dev)
            for _ in range(args.warmup):
                call()
            torch.cuda.synchronize()
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(args.iters):
                call()
            torch.cuda.synchronize()
            us = (time.perf_counter() - t0) / args.iters * 1e6
            ok = torch.tensor([1 if check() else 0], device=dev)
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)
            # The slowest rank's time is the collective's.
            t = torch.tensor([us], device=dev, dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            us = t.item()
            algbw = nbytes / us / 1e3
            good = ok.item() == 1
            bad += not good
            if me == 0:
                print(f"busbw {args.label} {op} {nbytes} {us:.1f} {algbw:.2f} {algbw * factor:.2f} "
                      f"{'ok' if good else 'WRONG'}", flush=True)
    dist.destroy_process_group()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
