"""Time of a DDP training step of a ~400M-parameter transformer, as the
issues measure it (bf16 autocast, 100 MB gradient buckets, one process per
GPU), so Weft and NCCL can be compared in the same call.

Run under torchrun, once with Weft's libnccl.so.2 preloaded and once
without (run.sh's `ddp` step does both). Rank 0 prints:

    DDP lib=<file> world=N params=403.1M step_ms median=.. p10=.. p90=.. (K steps)

The model: 32 encoder layers, d_model 1024, 16 heads, feed-forward 4096
(12.6M parameters a layer), a linear head; a batch of 8 sequences of 512
tokens per rank; AdamW. The first WARMUP steps are not timed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import nccl_provider, pick_device, simulate_hosts  # noqa: E402


def model(layers: int, d: int) -> torch.nn.Module:
    layer = torch.nn.TransformerEncoderLayer(d, 16, 4 * d, dropout=0.0, batch_first=True)
    return torch.nn.Sequential(torch.nn.TransformerEncoder(layer, layers), torch.nn.Linear(d, d))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--d", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument(
        "--hosts",
        type=int,
        default=1,
        help="split the ranks into this many simulated hosts (issue 32): WEFT_HOSTNAME for Weft, "
        "NCCL_HOSTID for NCCL (its socket transport when a host has one rank)",
    )
    args = ap.parse_args()
    if args.hosts > 1:
        simulate_hosts(args.hosts)

    device = pick_device("nccl")
    torch.cuda.set_device(device)
    dist.init_process_group(backend="nccl", device_id=device)
    torch.manual_seed(1234)
    net = model(args.layers, args.d).to(device)
    params = sum(p.numel() for p in net.parameters())
    ddp = DDP(net, device_ids=[device.index], bucket_cap_mb=100)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4)
    g = torch.Generator(device=device).manual_seed(dist.get_rank())
    x = torch.randn(args.batch, args.seq, args.d, device=device, generator=g)
    y = torch.randn(args.batch, args.seq, args.d, device=device, generator=g)

    times = []
    for step in range(args.warmup + args.steps):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        opt.step()
        torch.cuda.synchronize(device)
        if step >= args.warmup:
            times.append(1e3 * (time.perf_counter() - t0))

    # The job's step is its slowest rank's.
    t = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        ts = sorted(t.tolist())
        lib = nccl_provider() or "?"
        q = statistics.quantiles(ts, n=10)
        print(
            f"DDP lib={os.path.basename(os.path.dirname(lib))}/{os.path.basename(lib)} "
            f"world={dist.get_world_size()} hosts={args.hosts} params={params / 1e6:.1f}M "
            f"step_ms median={statistics.median(ts):.2f} p10={q[0]:.2f} p90={q[-1]:.2f} ({len(ts)} steps)",
            flush=True,
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
