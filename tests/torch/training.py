"""Training: DDP steps and an FSDP2 (fully_shard) step, each compared with a
single-process reference that sees the whole global batch. With a mean loss,
the gradient of the global batch equals the average over ranks of the
local-batch gradients, which is what DDP and FSDP2 compute."""

from __future__ import annotations



import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from common import Ctx, Registry, Skip, expect_close, gen

D_IN, D_H1, D_H2, D_OUT = 37, 129, 61, 5
LOCAL_BATCH = 11
RTOL, ATOL = 2e-4, 2e-6


def make_model(ctx: Ctx) -> torch.nn.Module:
    # Same seed on every rank: identical initial weights (DDP also
    # broadcasts rank 0's, FSDP2 does not).
    g = torch.random.fork_rng(devices=[])
    with g:
        torch.manual_seed(ctx.seed + 12345)
        m = torch.nn.Sequential(
            torch.nn.Linear(D_IN, D_H1),
            torch.nn.Tanh(),
            torch.nn.Linear(D_H1, D_H2),
            torch.nn.Tanh(),
            torch.nn.Linear(D_H2, D_OUT),
        )
    return m.to(ctx.device)


def global_batch(ctx: Ctx, step: int):
    b = LOCAL_BATCH * ctx.world
    x = gen(ctx, ("train_x", step), 0, (b, D_IN), torch.float32).to(ctx.device, copy=True)
    y = gen(ctx, ("train_y", step), 0, (b, D_OUT), torch.float32).to(ctx.device, copy=True)
    return x, y


def local_slice(ctx: Ctx, t: torch.Tensor) -> torch.Tensor:
    return t[ctx.rank * LOCAL_BATCH : (ctx.rank + 1) * LOCAL_BATCH]


def loss_fn(out, y):
    return torch.nn.functional.mse_loss(out, y)


def _ddp(ctx: Ctx, **kw) -> DDP:
    m = make_model(ctx)
    if ctx.device.type == "cuda":
        return DDP(m, device_ids=[ctx.device.index], **kw)
    return DDP(m, **kw)


def check_ddp(steps: int = 4, **ddp_kw):
    def run(ctx: Ctx) -> None:
        ref = make_model(ctx)
        model = _ddp(ctx, **ddp_kw)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
        for step in range(steps):
            x, y = global_batch(ctx, step)
            opt.zero_grad(set_to_none=True)
            ref_opt.zero_grad(set_to_none=True)
            loss_fn(model(local_slice(ctx, x)), local_slice(ctx, y)).backward()
            loss_fn(ref(x), y).backward()
            for (name, p), q in zip(model.module.named_parameters(), ref.parameters()):
                expect_close(ctx, p.grad, q.grad, f"step {step} grad {name}", RTOL, ATOL)
            opt.step()
            ref_opt.step()
            for (name, p), q in zip(model.module.named_parameters(), ref.parameters()):
                expect_close(ctx, p.detach(), q.detach(), f"step {step} param {name}", RTOL, ATOL)

    return run


def check_ddp_no_sync(ctx: Ctx) -> None:
    """Gradient accumulation: the first micro-batch under no_sync()."""
    ref = make_model(ctx)
    model = _ddp(ctx)
    for step in range(2):
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        x1, y1 = global_batch(ctx, 100 + 2 * step)
        x2, y2 = global_batch(ctx, 101 + 2 * step)
        with model.no_sync():
            loss_fn(model(local_slice(ctx, x1)), local_slice(ctx, y1)).backward()
        loss_fn(model(local_slice(ctx, x2)), local_slice(ctx, y2)).backward()
        (loss_fn(ref(x1), y1) + loss_fn(ref(x2), y2)).backward()
        for (name, p), q in zip(model.module.named_parameters(), ref.parameters()):
            expect_close(ctx, p.grad, q.grad, f"accumulated grad {name}", RTOL, ATOL)


def check_fsdp2(ctx: Ctx) -> None:
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError as e:
        raise Skip(f"no torch.distributed.fsdp.fully_shard: {e}") from e
    ref = make_model(ctx)
    model = make_model(ctx)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    names = [n for n, _ in ref.named_parameters()]
    for step in range(3):
        x, y = global_batch(ctx, 200 + step)
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
        loss_fn(model(local_slice(ctx, x)), local_slice(ctx, y)).backward()
        loss_fn(ref(x), y).backward()
        for name, p, q in zip(names, model.parameters(), ref.parameters()):
            expect_close(ctx, p.grad.full_tensor(), q.grad, f"step {step} grad {name}", RTOL, ATOL)
        opt.step()
        ref_opt.step()
        for name, p, q in zip(names, model.parameters(), ref.parameters()):
            expect_close(ctx, p.detach().full_tensor(), q.detach(), f"step {step} param {name}", 1e-4, 1e-5)


def register(reg: Registry) -> None:
    reg.add("training", "training.ddp", check_ddp())
    # Tiny buckets: one all_reduce per parameter, overlapping the backward.
    reg.add("training", "training.ddp.small_buckets_bucket_view", check_ddp(bucket_cap_mb=0.001, gradient_as_bucket_view=True))
    reg.add("training", "training.ddp.no_sync", check_ddp_no_sync)
    reg.add("training", "training.fsdp2_fully_shard", check_fsdp2)


def setup_determinism() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False



