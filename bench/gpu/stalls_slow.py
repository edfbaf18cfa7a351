#!/usr/bin/env python3
"""Where the slow calls of a stalls run come from (issue 33, item 3).

Reads the "slow ..." lines `stalls_cuda.c` prints with STALLS_SLOW=F (every
call over F x its cell's p50, with its CLOCK_MONOTONIC start, the CPU it
ended on and its enqueue time) and, when given, two snapshots of
/proc/interrupts taken around the run. Prints per run:

- slow calls per rank, and how many of rank 0's have a slow call of rank 1
  starting within 30 us (one rank's delay the other waited for: a call of
  two ranks is as slow as its slower rank);
- the gaps between one rank's consecutive slow calls within a cell, as a
  histogram in ms: a timer ticking at HZ shows as gaps at multiples of
  1000/HZ ms;
- how many slow calls were slow in their enqueue (the host call itself)
  rather than in the wait;
- interrupts per second on the CPUs the ranks ran on (the local timer,
  LOC, and the rest by name), from the snapshots;
- with --pauses (the times `pauses.c` found its spinning CPU stopped,
  beside the run: the virtual machine stopping every CPU at once), per
  cell: p50 / p99 of all calls, of the calls that met a pause and of the
  calls that met none (print every call: STALLS_SLOW=0.01), and how many
  of the calls over 2 x p50 met one.

Usage: stalls_slow.py STALLS_FILE [--irq BEFORE AFTER SECONDS] [--pauses FILE]
"""
import argparse
import bisect
import collections
import re

SLOW = re.compile(
    r"^slow (\S+) (\d+) rank (\d+): at ([\d.]+) us lat ([\d.]+) enq ([\d.]+) cpu (-?\d+)"
)


def read_slow(path):
    calls = []
    for line in open(path, errors="replace"):
        m = SLOW.match(line.strip())
        if m:
            op, size, rank, at, lat, enq, cpu = m.groups()
            calls.append((op, int(size), int(rank), float(at), float(lat), float(enq), int(cpu)))
    return calls


def irq_counts(path):
    """{(name, cpu): count} from one /proc/interrupts snapshot."""
    lines = open(path).read().splitlines()
    ncpu = len(lines[0].split())
    out = {}
    for line in lines[1:]:
        parts = line.split()
        if not parts:
            continue
        name = parts[0].rstrip(":")
        for cpu, v in enumerate(parts[1 : 1 + ncpu]):
            if v.isdigit():
                out[(name, cpu)] = int(v)
    return out


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * q))] if xs else float("nan")


def by_pause(calls, pauses_path):
    """Per cell and rank: the calls split by whether a machine pause
    started inside them (or began before and ended inside)."""
    pauses = sorted(tuple(map(float, l.split())) for l in open(pauses_path) if l.strip())
    starts = [p[0] for p in pauses]
    cells = collections.defaultdict(lambda: ([], []))
    for op, size, rank, at, lat, _enq, _cpu in calls:
        if op == "floor" and size < 1 << 20:
            continue
        i = bisect.bisect_right(starts, at + lat)
        # The last pause starting before the call ends, if it reaches into it.
        met = i > 0 and pauses[i - 1][0] + pauses[i - 1][1] > at
        cells[(op, size, rank)][1 if met else 0].append(lat)
    print(f"{len(pauses)} machine pauses beside the run; per cell, us (worst rank):")
    print("cell                 all p50 / p99    met none p50 / p99    met one: share  p50   over 2x p50: met one")
    worst = {}
    for (op, size, rank), (clear, met) in cells.items():
        every = clear + met
        p50 = pct(every, 0.5)
        slow = [x for x in met if x > 2 * p50]
        row = (pct(every, 0.99) / p50, op, size, p50, pct(every, 0.99), pct(clear, 0.5),
               pct(clear, 0.99), len(met) / len(every), pct(met, 0.5),
               sum(1 for x in every if x > 2 * p50), len(slow))
        if (op, size) not in worst or row > worst[(op, size)]:
            worst[(op, size)] = row
    for _, op, size, p50, p99, c50, c99, share, m50, over, over_met in sorted(
        worst.values(), key=lambda r: (r[1], r[2])
    ):
        print(f"{op:14} {size:>8}  {p50:6.1f} / {p99:6.1f}   {c50:6.1f} / {c99:6.1f}        "
              f"{share * 100:5.1f}% {m50:6.1f}   {over}: {over_met}")
    # Issue 33's bound (p99 <= 2 x p50, max < 1 ms) per rank-cell of the
    # collectives, on all calls and on the calls that met no pause.
    ok_all = ok_clear = n = 0
    worst_all = worst_clear = 0.0
    for (op, _size, _rank), (clear, met) in cells.items():
        if op == "floor":
            continue
        every = clear + met
        r_all = pct(every, 0.99) / pct(every, 0.5)
        r_clear = pct(clear, 0.99) / pct(clear, 0.5)
        n += 1
        ok_all += r_all <= 2 and max(every) < 1000
        ok_clear += r_clear <= 2 and max(clear) < 1000
        worst_all, worst_clear = max(worst_all, r_all), max(worst_clear, r_clear)
    print(f"rank-cells within p99 <= 2 x p50 and max < 1 ms: all calls {ok_all} of {n} "
          f"(worst p99/p50 {worst_all:.2f}), calls that met no pause {ok_clear} of {n} "
          f"(worst {worst_clear:.2f})")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("stalls")
    ap.add_argument("--irq", nargs=3, metavar=("BEFORE", "AFTER", "SECONDS"))
    ap.add_argument("--pauses")
    args = ap.parse_args()
    calls = read_slow(args.stalls)
    by_rank = collections.defaultdict(list)
    for c in calls:
        by_rank[c[2]].append(c)
    print(f"slow calls: {len(calls)} ({', '.join(f'rank {r}: {len(v)}' for r, v in sorted(by_rank.items()))})")
    if not calls:
        return
    starts = {r: sorted(c[3] for c in v) for r, v in by_rank.items()}
    ranks = sorted(starts)
    if len(ranks) >= 2:
        a, b = starts[ranks[0]], starts[ranks[1]]
        j, both = 0, 0
        for t in a:
            while j < len(b) and b[j] < t - 30:
                j += 1
            if j < len(b) and abs(b[j] - t) <= 30:
                both += 1
        print(f"rank {ranks[0]}'s slow calls with one of rank {ranks[1]} within 30 us: {both} of {len(a)}")
    enq_slow = sum(1 for c in calls if c[5] > c[4] / 2)
    print(f"slow in the enqueue (over half the call): {enq_slow} of {len(calls)}")
    gaps = collections.Counter()
    for r, v in by_rank.items():
        cells = collections.defaultdict(list)
        for c in v:
            cells[(c[0], c[1])].append(c[3])
        for ts in cells.values():
            ts.sort()
            for x, y in zip(ts, ts[1:]):
                gaps[min(int((y - x) / 1000), 20)] += 1
    print("gaps between one rank's slow calls in a cell, ms (20: 20 or more):")
    print("  " + " ".join(f"{k}:{gaps[k]}" for k in sorted(gaps)))
    cpus = collections.Counter(c[6] for c in calls)
    print("CPUs the slow calls ended on: " + " ".join(f"{k}:{v}" for k, v in cpus.most_common(8)))
    if args.irq:
        before, after, secs = irq_counts(args.irq[0]), irq_counts(args.irq[1]), float(args.irq[2])
        for cpu, _ in cpus.most_common(4):
            rates = {
                name: (after[(name, c)] - v) / secs
                for (name, c), v in before.items()
                if c == cpu and (name, c) in after and after[(name, c)] > v
            }
            top = sorted(rates.items(), key=lambda kv: -kv[1])[:6]
            print(f"cpu {cpu} interrupts/s: " + " ".join(f"{n}:{r:.0f}" for n, r in top))
    if args.pauses:
        by_pause(calls, args.pauses)


if __name__ == "__main__":
    main()
