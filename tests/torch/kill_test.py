#!/usr/bin/env python3
"""A rank killed mid-training: the survivors must get a torch error, not hang.

    python tests/torch/kill_test.py --nproc 2                  # nccl, LD_PRELOAD=<libnccl.so.2> in the env
    python tests/torch/kill_test.py --nproc 2 --backend gloo   # CPU: the script's logic

The script is its own launcher: it starts --nproc worker processes of itself
(torchrun and `weft run` both stop the other ranks as soon as one dies, which
would hide what the survivors do). The workers train a small DDP model; at
step --kill-step rank --kill-rank (the last rank by default, so rank 0's
TCPStore stays up) writes the time and sends itself SIGKILL. Every survivor
ends its step with a synchronous all_reduce, so it waits on the dead peer.

How a survivor learns of the death (see the README section of tests/torch):

* Weft: a dead local peer is noticed by a waiting host thread within one wait
  slice (at most 100 ms) and a remote one within WEFT_PEER_TIMEOUT_MS (10 s);
  a GPU kernel waiting on a dead peer is stopped by ncclCommAbort (the device
  abort word). ncclCommGetAsyncError reports failures already raised.
* torch: with TORCH_NCCL_BLOCKING_WAIT=1 (--mode blocking, the default) there
  is no watchdog thread; Work.wait() polls ncclCommGetAsyncError and the
  collective timeout (init_process_group(timeout=--pg-timeout-s)), then aborts
  the communicator and raises DistBackendError in the calling (Python) thread.
  With --mode watchdog (torch's defaults, TORCH_NCCL_ASYNC_ERROR_HANDLING=3)
  the watchdog thread notices the timeout or the error, aborts and ends the
  process; there is no Python exception, so that mode only checks that every
  survivor process ended (not hung) within the bound.

PASS when every survivor raised (blocking) or ended (watchdog) within --bound-s
seconds of the kill (default: the collective timeout plus 40 s); FAIL names
the survivors that were still running and kills them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--backend", default="nccl", choices=["nccl", "gloo"])
    ap.add_argument("--mode", default="blocking", choices=["blocking", "watchdog"])
    ap.add_argument("--kill-rank", type=int, default=-1, help="rank that kills itself (default: the last)")
    ap.add_argument("--kill-step", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--pg-timeout-s", type=float, default=20.0, help="init_process_group(timeout=...)")
    ap.add_argument("--bound-s", type=float, default=None, help="survivors must fail within this (default timeout + 40)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--dir", default=None, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


# --------------------------------------------------------------------------
# Worker


def worker(args) -> int:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    local = int(os.environ["LOCAL_RANK"])
    victim = args.kill_rank if args.kill_rank >= 0 else world - 1
    rec = os.path.join(args.dir, f"rank{rank}.json")

    def record(**kw):
        kw["rank"] = rank
        with open(rec + ".tmp", "w") as f:
            json.dump(kw, f)
        os.replace(rec + ".tmp", rec)

    if args.backend == "nccl":
        dev = torch.device("cuda", local % torch.cuda.device_count())
        torch.cuda.set_device(dev)
        kw = {"device_id": dev}
    else:
        dev = torch.device("cpu")
        kw = {}
    dist.init_process_group(args.backend, timeout=datetime.timedelta(seconds=args.pg_timeout_s), **kw)
    torch.manual_seed(1234)
    model = torch.nn.Sequential(torch.nn.Linear(257, 513), torch.nn.ReLU(), torch.nn.Linear(513, 31)).to(dev)
    ddp = DDP(model, device_ids=[dev.index] if dev.type == "cuda" else None)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(99 + rank)
    step = -1
    try:
        for step in range(args.steps):
            if rank == victim and step == args.kill_step:
                record(killed_at=time.time(), step=step)
                os.kill(os.getpid(), signal.SIGKILL)
            x = torch.randn(64, 257, generator=g).to(dev)
            y = torch.randn(64, 31, generator=g).to(dev)
            loss = torch.nn.functional.mse_loss(ddp(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            t = loss.detach().reshape(1).clone()
            dist.all_reduce(t)  # synchronous: with blocking wait the CPU waits here
            print(f"kill_test: rank {rank} step {step} mean loss {t.item() / world:.4f}", flush=True)
    except Exception as e:  # noqa: BLE001 -- the point of the test
        record(
            raised_at=time.time(),
            step=step,
            exc=type(e).__name__,
            msg=" ".join(str(e).split())[:400],
        )
        print(f"kill_test: rank {rank} raised {type(e).__name__} at step {step}", flush=True)
        os._exit(3)  # the communicator is broken: do not try a clean teardown
    record(finished_at=time.time(), step=step)
    dist.destroy_process_group()
    return 0


# --------------------------------------------------------------------------
# Launcher


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args) -> int:
    n = args.nproc
    if n < 2:
        print("kill_test: needs --nproc 2 or more", file=sys.stderr)
        return 2
    victim = args.kill_rank if args.kill_rank >= 0 else n - 1
    bound = args.bound_s if args.bound_s is not None else args.pg_timeout_s + 40.0
    d = tempfile.mkdtemp(prefix="weft-kill-test-")
    port = free_port()
    env = dict(os.environ)
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(n), LOCAL_WORLD_SIZE=str(n))
    if args.mode == "blocking":
        env["TORCH_NCCL_BLOCKING_WAIT"] = "1"
    else:
        env.pop("TORCH_NCCL_BLOCKING_WAIT", None)
        env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "3"
    print(
        f"kill_test: {n} ranks, backend {args.backend}, mode {args.mode}, rank {victim} SIGKILLs itself at step "
        f"{args.kill_step}; collective timeout {args.pg_timeout_s:g}s, bound {bound:g}s",
        flush=True,
    )
    procs = []
    me = os.path.abspath(__file__)
    for r in range(n):
        e = dict(env, RANK=str(r), LOCAL_RANK=str(r))
        cmd = [sys.executable, me, "--worker", "--dir", d] + [
            a for a in sys.argv[1:] if a not in ("--worker",)
        ]
        procs.append(subprocess.Popen(cmd, env=e, start_new_session=True))
    kill_file = os.path.join(d, f"rank{victim}.json")
    # Wait for the kill (bounded: init plus kill-step steps).
    t_start = time.time()
    while not os.path.exists(kill_file):
        if time.time() - t_start > 300 or any(p.poll() not in (None,) for i, p in enumerate(procs) if i != victim):
            break
        time.sleep(0.05)
    if not os.path.exists(kill_file):
        for p in procs:
            _kill(p)
        shutil.rmtree(d, ignore_errors=True)
        print(f"FAIL kill_test: rank {victim} never reached step {args.kill_step} (setup or training failed first)", flush=True)
        return 1
    killed_at = json.load(open(kill_file))["killed_at"]
    ended = {}
    while time.time() - killed_at <= bound and len(ended) < n:
        for r, p in enumerate(procs):
            if r not in ended and p.poll() is not None:
                ended[r] = (time.time(), p.returncode)
        time.sleep(0.05)
    ok = True
    for r, p in enumerate(procs):
        if r == victim:
            continue
        recf = os.path.join(d, f"rank{r}.json")
        rec = json.load(open(recf)) if os.path.exists(recf) else {}
        if r not in ended:
            ok = False
            _kill(p)
            print(f"FAIL kill_test: rank {r} still running {bound:g}s after the kill (a hang); killed it", flush=True)
            continue
        t_end, code = ended[r]
        if args.mode == "blocking":
            if "raised_at" not in rec:
                ok = False
                print(f"FAIL kill_test: rank {r} ended (code {code}) {t_end - killed_at:.1f}s after the kill without a Python exception: {rec}", flush=True)
                continue
            dt = rec["raised_at"] - killed_at
            by = "the collective timeout" if "timed out" in rec["msg"].lower() or "timeout" in rec["msg"].lower() else "the library's error"
            print(f"PASS kill_test: rank {r} raised {rec['exc']} {dt:.2f}s after the kill (step {rec['step']}, by {by}): {rec['msg'][:300]}", flush=True)
        else:
            if code == 0:
                ok = False
                print(f"FAIL kill_test: rank {r} exited 0 after the kill: {rec}", flush=True)
                continue
            print(f"PASS kill_test: rank {r} ended (code {code}) {t_end - killed_at:.2f}s after the kill", flush=True)
    for p in procs:
        _kill(p)
    shutil.rmtree(d, ignore_errors=True)
    print(f"SUMMARY: kill_test {'PASS' if ok else 'FAIL'} (mode {args.mode}, bound {bound:g}s)", flush=True)
    return 0 if ok else 1


def _kill(p) -> None:
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()


def main(argv=None) -> int:
    args = parse(argv)
    if args.worker:
        return worker(args)
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
