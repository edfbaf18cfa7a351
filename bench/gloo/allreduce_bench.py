#!/usr/bin/env python3
"""allreduce_bench.py: torch.distributed all_reduce (gloo backend, float32 sum)
timed the way `weft bench` times Weft and bench/mpi/allreduce_bench.c times
MPI, printing the same columns, so the three can be compared line by line
(bench/compare_gloo.sh). Written for Weft.

Method, per size and placement: W warm-up calls; a barrier made of a
one-element all_reduce (as weft bench does); I back-to-back calls timed with
time.monotonic_ns; time per call = elapsed / I on each rank, averaged over
ranks. Gloo's all_reduce works in place only: "in-place" is
`all_reduce(buf)`, "out-of-place" is what a caller with separate buffers
does, `recv.copy_(send); all_reduce(recv)`. algbw = size / time (GB/s);
busbw = algbw * 2(n-1)/n. With -c, one more call on random small integers
is checked against the exact sum (#wrong, summed over ranks).

Usage: allreduce_bench.py -n N [-b MIN] [-e MAX] [-f FACTOR] [-w W] [-i I] [-c]
Ranks are local processes (torch.multiprocessing), rendezvous on 127.0.0.1.
Sizes take K, M, G suffixes (powers of 1024).
"""
import argparse
import os
import socket
import sys
import time


def parse_size(s):
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    s = s.strip()
    if s and s[-1].upper() in mult:
        return int(s[:-1]) * mult[s[-1].upper()]
    return int(s)


def fixed(v, width):
    for prec in (2, 1, 0):
        t = "%*.*f" % (width, prec, v)
        if len(t) <= width:
            return t
    return "%*.1e" % (width, v)


def inputs(torch, rank, count, seed):
    g = torch.Generator().manual_seed(seed * 1000003 + rank)
    k = torch.randint(0, 8, (count,), generator=g) - 4
    return torch.where(k >= 0, k + 1, k).to(torch.float32)


def worker(rank, a, port):
    import torch
    import torch.distributed as dist

    # One thread per rank, like the MPI ranks and weft's ranks.
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=a.nranks
    )
    n = a.nranks
    maxcount = a.maxbytes // 4
    send = inputs(torch, rank, maxcount, 0)
    recv = send.clone()
    one = torch.ones(1)
    if rank == 0:
        print(f"# allreduce_bench (torch.distributed gloo, weft bench format), torch {torch.__version__}")
        print("# Collective test starting: all_reduce")
        print(f"# nRanks {n} minBytes {a.minbytes} maxBytes {a.maxbytes} step: {a.stepfactor}(factor) "
              f"warmup iters: {a.warmup_iters} iters: {a.iters} validation: {int(a.check)} device: host algo: gloo")
        print("#")
        print("# %10s  %12s  %8s  %6s  %6s           out-of-place                       in-place          " % ("", "", "", "", ""))
        print("# %10s  %12s  %8s  %6s  %6s  %7s  %6s  %6s  %6s  %7s  %6s  %6s  %6s " % (
            "size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong", "time", "algbw", "busbw", "#wrong"))
        print("# %10s  %12s  %8s  %6s  %6s  %7s  %6s  %6s  %6s  %7s  %6s  %6s  %6s " % (
            "(B)", "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(GB/s)", "(GB/s)", ""))
        sys.stdout.flush()
    bwsum, bwn, total_wrong, seed = 0.0, 0, 0, 1
    size = a.minbytes
    while size <= a.maxbytes:
        count = size // 4
        s, r = send[:count], recv[:count]
        line = "%12d  %12d  %8s  %6s  %6i" % (count * 4, count, "float", "sum", -1)
        for inplace in (False, True):
            def call():
                if not inplace:
                    r.copy_(s)
                dist.all_reduce(r)
            for _ in range(a.warmup_iters):
                call()
            dist.all_reduce(one)
            t0 = time.monotonic_ns()
            for _ in range(a.iters):
                call()
            secs = torch.tensor([(time.monotonic_ns() - t0) / 1e9 / a.iters], dtype=torch.float64)
            dist.all_reduce(secs)
            secs = secs.item() / n
            algbw = count * 4 / 1e9 / secs if secs > 0 else 0
            busbw = algbw * 2 * (n - 1) / n
            bwsum += busbw
            bwn += 1
            wrong = "N/A"
            if a.check:
                seed += 1
                x = inputs(torch, rank, count, seed)
                if inplace:
                    r.copy_(x)
                else:
                    s.copy_(x)
                    r.fill_(12345.0)
                call()
                want = sum(inputs(torch, q, count, seed) for q in range(n))
                w = torch.tensor([int((r != want).sum().item())], dtype=torch.int64)
                dist.all_reduce(w)
                total_wrong += int(w.item())
                wrong = str(int(w.item()))
            line += "  %7s  %6s  %6s  %6s" % (fixed(secs * 1e6, 7), fixed(algbw, 6), fixed(busbw, 6), wrong)
        if rank == 0:
            print(line)
            sys.stdout.flush()
        if size == 0:
            break
        size *= a.stepfactor
    if rank == 0:
        print("# %-20s : %d %s" % ("Out of bounds values", total_wrong, "FAILED" if total_wrong else "OK"))
        print("# %-20s : %g " % ("Avg bus bandwidth", bwsum / bwn if bwn else 0.0))
        print("#\n# Collective test concluded: all_reduce")
        sys.stdout.flush()
    dist.destroy_process_group()
    if total_wrong:
        sys.exit(1)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("-n", "--nranks", type=int, default=4)
    p.add_argument("-b", "--minbytes", type=parse_size, default=8)
    p.add_argument("-e", "--maxbytes", type=parse_size, default=32 << 20)
    p.add_argument("-f", "--stepfactor", type=int, default=2)
    p.add_argument("-w", "--warmup_iters", type=int, default=5)
    p.add_argument("-i", "--iters", type=int, default=20)
    p.add_argument("-c", "--check", action="store_true")
    a = p.parse_args()
    if a.stepfactor < 2 or a.iters < 1 or a.minbytes > a.maxbytes:
        sys.exit("allreduce_bench.py: bad arguments")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch.multiprocessing as mp

    mp.start_processes(worker, args=(a, port), nprocs=a.nranks, start_method="spawn")


if __name__ == "__main__":
    main()
