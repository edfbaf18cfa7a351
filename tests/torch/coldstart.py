"""A fresh process's cost before its first collectives, as PyTorch sees it:
init_process_group (eager, device_id) and the first bf16 and fp32 all_reduce
of 1 Mi elements, each timed to completion on the GPU.

Run it under torchrun (or `weft run`) once per library, each in a fresh
process with an empty Weft kernel cache (run.sh's `coldstart` step does, for
Weft and for NCCL on the same machine). Rank 0 prints one line:

    COLDSTART lib=<file> world=N init_ms=.. first_bf16_ms=.. first_f32_ms=.. total_ms=..

`total_ms` runs from just before init_process_group to the end of the fp32
all_reduce (import of torch and CUDA context creation excluded: they are the
same for both libraries and happen before either is touched).
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import nccl_provider, pick_device  # noqa: E402

COUNT = 1 << 20


def main() -> None:
    device = pick_device("nccl")
    torch.cuda.set_device(device)
    # The CUDA context and the buffers exist before the clock starts.
    bf = torch.ones(COUNT, dtype=torch.bfloat16, device=device)
    f32 = torch.ones(COUNT, dtype=torch.float32, device=device)
    torch.cuda.synchronize(device)

    t0 = time.perf_counter()
    dist.init_process_group(backend="nccl", device_id=device)
    t1 = time.perf_counter()
    dist.all_reduce(bf)
    torch.cuda.synchronize(device)
    t2 = time.perf_counter()
    dist.all_reduce(f32)
    torch.cuda.synchronize(device)
    t3 = time.perf_counter()

    world = dist.get_world_size()
    ok = bool((bf == world).all()) and bool((f32 == world).all())
    # Every rank's slowest phase counts: the job waits for the last rank.
    times = torch.tensor([t1 - t0, t2 - t1, t3 - t2, t3 - t0], dtype=torch.float64, device=device)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        lib = nccl_provider() or "?"
        i, b, f, total = (1e3 * x for x in times.tolist())
        print(
            f"COLDSTART lib={os.path.basename(os.path.dirname(lib))}/{os.path.basename(lib)} "
            f"world={world} init_ms={i:.1f} first_bf16_ms={b:.1f} first_f32_ms={f:.1f} "
            f"total_ms={total:.1f} correct={ok}",
            flush=True,
        )
    dist.destroy_process_group()
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
