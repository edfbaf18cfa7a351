#!/usr/bin/env python3
"""The PyTorch end-to-end suite for Weft's libnccl.so.2.

Run it with a launcher that sets torch's environment (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT):

    weft run -n 2 -- python tests/torch/suite.py            # LD_PRELOAD=<libnccl.so.2> in the env
    LD_PRELOAD=/opt/weft/lib/libnccl.so.2 torchrun --nproc-per-node 2 tests/torch/suite.py
    torchrun --nproc-per-node 2 tests/torch/suite.py --backend gloo   # CPU: the test logic only

Rank 0 prints one line per check (PASS/FAIL/SKIP, agreed by every rank over a
separate gloo group) and a summary; every rank exits 1 when any check failed.
`--only all_reduce,p2p` runs the checks whose name or group contains one of
the words; `--list` prints the names. tests/torch/run.sh runs everything on
the GPU machine.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import collectives  # noqa: E402
import groups  # noqa: E402
import p2p  # noqa: E402
import training  # noqa: E402
from common import Registry, run_check, setup  # noqa: E402


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="nccl", choices=["nccl", "gloo"], help="nccl (default) or gloo (CPU sanity run of the logic)")
    ap.add_argument("--only", default="", help="comma-separated words; run checks whose name or group contains one")
    ap.add_argument("--skip", default="", help="comma-separated words; leave out checks whose name contains one")
    ap.add_argument("--list", action="store_true", help="print the check names and exit (no launcher needed)")
    ap.add_argument("--seed", type=int, default=20261124)
    ap.add_argument("--lazy-init", action="store_true", help="do not pass device_id to init_process_group: communicators are made on first use (p2p pairs get their own 2-rank communicators, groups their own ncclCommInitRank)")
    ap.add_argument("--pg-timeout-s", type=float, default=300.0, help="init_process_group timeout (collective timeout)")
    ap.add_argument("--expect-nccl", default=os.environ.get("SUITE_EXPECT_NCCL"), help="fail unless exactly this libnccl file is loaded (env SUITE_EXPECT_NCCL)")
    ap.add_argument("--trace", action="store_true", help="every rank prints each check's name as it starts (to find a hang)")
    ap.add_argument("--no-destroy", action="store_true", help="skip the final destroy_process_group check")
    return ap.parse_args(argv)


def build() -> Registry:
    reg = Registry()
    collectives.register(reg)
    p2p.register(reg)
    groups.register(reg)
    training.register(reg)
    return reg


def select(reg: Registry, only: str, skip: str):
    words = [w for w in only.split(",") if w]
    nots = [w for w in skip.split(",") if w]
    out = []
    for c in reg.checks:
        if words and not any(w in c.name or w == c.group for w in words):
            continue
        if any(w in c.name for w in nots):
            continue
        out.append(c)
    return out


def main(argv=None) -> int:
    args = parse(argv)
    checks = select(build(), args.only, args.skip)
    if args.list:
        for c in checks:
            print(f"{c.group:15} {c.name}")
        return 0
    if not checks:
        print("suite: no check matches --only/--skip", file=sys.stderr)
        return 2
    training.setup_determinism()
    t0 = time.monotonic()
    ctx = setup(args)
    for c in checks:
        run_check(ctx, c, args.trace)
    counts = {s: sum(1 for _, v in ctx.results if v == s) for s in ("PASS", "FAIL", "SKIP")}
    failed = counts["FAIL"] > 0
    # The last check: destroy_process_group, then no group may be left.
    destroy_ok = True
    if not args.no_destroy:
        ctx.sync()
        try:
            dist.destroy_process_group()
            if dist.is_initialized():
                raise AssertionError("dist.is_initialized() is still True")
        except Exception as e:  # noqa: BLE001
            destroy_ok = False
            print(f"FAIL destroy_process_group (rank {ctx.rank}): {type(e).__name__}: {e}", flush=True)
        else:
            print(f"PASS destroy_process_group (rank {ctx.rank})", flush=True)
        counts["PASS" if destroy_ok else "FAIL"] += 1 if ctx.rank == 0 else 0
    else:
        dist.destroy_process_group()
    if ctx.rank == 0:
        total = sum(counts.values())
        print(
            f"SUMMARY: {counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped of {total} checks "
            f"(backend {ctx.backend}, world {ctx.world}, torch {torch.__version__}, {time.monotonic() - t0:.1f}s)",
            flush=True,
        )
        for name, v in ctx.results:
            if v == "FAIL":
                print(f"SUMMARY: FAILED {name}", flush=True)
    return 1 if failed or not destroy_ok else 0


if __name__ == "__main__":
    sys.exit(main())
