#!/usr/bin/env python3
"""Per-call latency of small and medium collectives: finds stalls.

    weft run -n 2 -- python tests/torch/stalls.py --label weft          # Weft (WEFT_PRELOAD)
    torchrun --nproc-per-node 2 tests/torch/stalls.py --label nccl      # torch's own NCCL
    tests/torch/run.sh stalls                                           # both, one table

For all_reduce, all_gather (into one tensor) and reduce_scatter (from one
tensor) at each size (--sizes, bytes of the largest buffer as nccl-tests
counts them: the all-reduce's tensor, the all-gather's output, the
reduce-scatter's input; float32, at least one element per rank), every rank
runs --warmup calls, then --iters calls each timed on its own:

    t0; op (async_op=False: returns once enqueued); t1; cuda.synchronize(); t2

The first call of each cell is timed apart, before the warm-up (`first_us`:
a lazy first use shows there: the kernel of a new type and op loaded, the
communicator's device set-up in the first cell).
`enqueue` is t1 - t0 (host time inside torch and the library), `call` is
t2 - t0. A call of a collective ends when the slowest rank's ends, so each
iteration's latency is the maximum over the ranks, and p50, p99 and max are
taken over those. The worst iteration is named with the rank whose enqueue
was slowest in it: a large enqueue there is a host-side stall (a lock, an
allocation, a compile in the library or torch); a large call with a small
enqueue everywhere is time on the GPU (a kernel waiting for a peer whose
launch came late, or ranks sharing a GPU that time-slice). Each worst
iteration also says how long Python's garbage collector ran inside that
rank's call (`gc`, from `gc.callbacks`): a pause that is all `gc` is the
interpreter's, not the library's. --no-gc disables the collector during
the timed calls (as latency-critical loops do), to compare. `--ops
launch` is the control: the same loop around one elementwise kernel, no
collective: pauses there are the machine's, the driver's or torch's.

Rank 0 prints one row per (op, size) and appends it to --out (a
tab-separated table; run.sh collects the Weft and NCCL rows side by side).
A cell is `ok` when p99 <= 2 x p50 and max < 1 ms (issue 33), else `STALL`.
--strict exits 1 when any cell is not ok.

Ranks sharing one GPU: Weft runs them (`weft run` starts an MPS daemon so
their kernels run side by side; without MPS they time-slice, ~2 ms a
call); torch's NCCL refuses two ranks on one GPU, so an NCCL row exists
only when every rank has its own GPU.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

OPS = ("all_reduce", "all_gather", "reduce_scatter")

# Nanoseconds Python's garbage collector has run so far (gc.callbacks).
GC_NS = [0]
_GC_START = [0]


def _gc_timer(phase, _info):
    if phase == "start":
        _GC_START[0] = time.perf_counter_ns()
    else:
        GC_NS[0] += time.perf_counter_ns() - _GC_START[0]


gc.callbacks.append(_gc_timer)
SIZES = (8, 4 << 10, 64 << 10, 1 << 20)


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", default=",".join(OPS),
                    help="comma-separated: " + ",".join(OPS) + ", launch (the control: one elementwise kernel, no collective)")
    ap.add_argument("--sizes", default=",".join(str(s) for s in SIZES), help="bytes, comma-separated")
    ap.add_argument("--iters", type=int, default=1000, help="timed calls per cell")
    ap.add_argument("--warmup", type=int, default=100, help="untimed calls per cell first")
    ap.add_argument("--label", default="weft", help="the row's library label (weft, nccl)")
    ap.add_argument("--out", default=None, help="append rank 0's rows to this file (tab-separated)")
    ap.add_argument("--strict", action="store_true", help="exit 1 when a cell is not within bounds")
    ap.add_argument("--p99-ratio", type=float, default=2.0, help="bound: p99 <= this x p50")
    ap.add_argument("--max-us", type=float, default=1000.0, help="bound: max < this (us)")
    ap.add_argument("--worst", type=int, default=3, help="slowest iterations listed per cell")
    ap.add_argument("--no-gc", action="store_true", help="disable Python's garbage collector during the timed calls")
    ap.add_argument("--hosts", type=int, default=1,
                    help="split the ranks into this many simulated hosts (WEFT_HOSTNAME for Weft, NCCL_HOSTID "
                    "for NCCL: its socket transport when a host has one rank), as ddp_step.py does")
    return ap.parse_args(argv)


def percentile(sorted_vals, q: float) -> float:
    """Nearest-rank percentile of an ascending list."""
    if not sorted_vals:
        return float("nan")
    k = math.ceil(q / 100.0 * len(sorted_vals)) - 1
    return sorted_vals[max(0, min(len(sorted_vals) - 1, k))]


def make_op(name: str, nbytes: int, world: int, dev):
    """The call to time and the bytes it really moves (rounded to whole
    float32 elements per rank)."""
    per_rank = max(1, nbytes // 4 // world)
    if name == "all_reduce":
        n = max(1, nbytes // 4)
        t = torch.ones(n, dtype=torch.float32, device=dev)
        return (lambda: dist.all_reduce(t)), n * 4
    if name == "all_gather":
        src = torch.ones(per_rank, dtype=torch.float32, device=dev)
        out = torch.empty(per_rank * world, dtype=torch.float32, device=dev)
        return (lambda: dist.all_gather_into_tensor(out, src)), per_rank * world * 4
    if name == "launch":
        # The control: one elementwise kernel, no collective and no
        # library call. A pause here is the machine's, the driver's or
        # torch's, never the communication library's.
        n = max(1, nbytes // 4)
        t = torch.ones(n, dtype=torch.float32, device=dev)
        return (lambda: t.add_(1.0)), n * 4
    if name == "reduce_scatter":
        src = torch.ones(per_rank * world, dtype=torch.float32, device=dev)
        out = torch.empty(per_rank, dtype=torch.float32, device=dev)
        return (lambda: dist.reduce_scatter_tensor(out, src)), per_rank * world * 4
    raise SystemExit(f"stalls: unknown op {name!r} (one of {', '.join(OPS)})")


def measure(op, iters: int, warmup: int, dev, no_gc: bool = False):
    """(call_ns, enqueue_ns) of each timed call, the first call's ns
    (before the warm-up: what a lazy first use costs, e.g. loading the
    kernel of this type and op, or the device set-up of the first call),
    and the garbage collector's ns inside each timed call."""
    torch.cuda.synchronize(dev)
    t0 = time.perf_counter_ns()
    op()
    torch.cuda.synchronize(dev)
    first = time.perf_counter_ns() - t0
    for _ in range(warmup):
        op()
    torch.cuda.synchronize(dev)
    calls, enq, gcs = [0] * iters, [0] * iters, [0] * iters
    clock = time.perf_counter_ns
    sync = torch.cuda.synchronize
    if no_gc:
        gc.disable()
    try:
        for i in range(iters):
            g0 = GC_NS[0]
            t0 = clock()
            op()
            t1 = clock()
            sync(dev)
            t2 = clock()
            calls[i] = t2 - t0
            enq[i] = t1 - t0
            gcs[i] = GC_NS[0] - g0
    finally:
        if no_gc:
            gc.enable()
    return calls, enq, first, gcs


def summarize(per_rank, args):
    """One row from every rank's (calls, enqueues, first call, gc) of a cell."""
    world = len(per_rank)
    iters = len(per_rank[0][0])
    lat = [max(per_rank[r][0][i] for r in range(world)) / 1e3 for i in range(iters)]
    s = sorted(lat)
    p50, p99, mx = percentile(s, 50), percentile(s, 99), s[-1]
    worst = sorted(range(iters), key=lambda i: lat[i], reverse=True)[: args.worst]
    notes = []
    for i in worst:
        r = max(range(world), key=lambda r: per_rank[r][1][i])
        notes.append(f"#{i}:{lat[i]:.0f}us(enq r{r} {per_rank[r][1][i] / 1e3:.0f}us gc {per_rank[r][3][i] / 1e3:.0f}us)")
    enq_max = max(max(p[1]) for p in per_rank) / 1e3
    # The calling thread's time per call (issue 32 bounds it for large
    # collectives): the median over iterations of the slowest rank's.
    enq_p50 = percentile(sorted(max(p[1][i] for p in per_rank) / 1e3 for i in range(iters)), 50)
    slow = sum(1 for v in lat if v >= args.max_us)
    ok = p99 <= args.p99_ratio * p50 and mx < args.max_us
    first = max(p[2] for p in per_rank) / 1e3
    return {
        "p50": p50, "p99": p99, "max": mx, "enq_p50": enq_p50, "enq_max": enq_max, "over": slow,
        "ok": ok, "worst": " ".join(notes), "first": first,
    }


HEADER = "lib\tranks\top\tbytes\tp50_us\tp99_us\tmax_us\tenq_p50_us\tenq_max_us\tcalls>=max\tverdict\tfirst_us\tworst"


def main(argv=None) -> int:
    args = parse(argv)
    if args.hosts > 1:
        from common import simulate_hosts

        simulate_hosts(args.hosts)
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    ngpu = torch.cuda.device_count()
    if ngpu == 0:
        raise SystemExit("stalls: needs a CUDA device")
    dev = torch.device("cuda", local % ngpu)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", device_id=dev, timeout=datetime.timedelta(seconds=300))
    # The report goes over gloo: it never disturbs the library measured.
    report = dist.new_group(backend="gloo")
    if rank == 0:
        from common import nccl_provider

        lib = nccl_provider("ncclAllReduce")
        shared = "" if world <= ngpu else f"; {world} ranks share {ngpu} GPU(s)"
        print(f"stalls: {args.label}: {world} ranks, torch {torch.__version__}, libnccl {lib}{shared}", flush=True)
    ops = [o for o in args.ops.split(",") if o]
    sizes = [int(s) for s in args.sizes.split(",") if s]
    rows, bad = [], 0
    for name in ops:
        for size in sizes:
            op, nbytes = make_op(name, size, world, dev)
            got = measure(op, args.iters, args.warmup, dev, args.no_gc)
            gathered = [None] * world
            dist.all_gather_object(gathered, got, group=report)
            if rank != 0:
                continue
            r = summarize(gathered, args)
            bad += not r["ok"]
            row = (f"{args.label}\t{world}\t{name}\t{nbytes}\t{r['p50']:.1f}\t{r['p99']:.1f}\t{r['max']:.1f}\t"
                   f"{r['enq_p50']:.1f}\t{r['enq_max']:.1f}\t{r['over']}\t{'ok' if r['ok'] else 'STALL'}\t{r['first']:.0f}\t{r['worst']}")
            rows.append(row)
            print(f"stalls: {row}", flush=True)
    if rank == 0:
        if args.out:
            new = not os.path.exists(args.out)
            with open(args.out, "a") as f:
                if new:
                    f.write(HEADER + "\n")
                for row in rows:
                    f.write(row + "\n")
        print(f"SUMMARY: stalls {args.label}: {len(rows) - bad}/{len(rows)} cells within bounds "
              f"(p99 <= {args.p99_ratio:g} x p50, max < {args.max_us:g} us; {args.iters} calls each)", flush=True)
    dist.barrier(group=report)
    dist.destroy_process_group()
    return 1 if (args.strict and bad) else 0


if __name__ == "__main__":
    sys.exit(main())
