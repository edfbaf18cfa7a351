#!/usr/bin/env python3
"""Runs benchmark commands in turn and prints their times side by side.

Usage: bench/sidecar_vs.py ROUNDS LABEL 'COMMAND' [LABEL 'COMMAND' ...]

Each command prints nccl-tests style rows (weft bench, weft bench-rank under
`weft run`, nccl-tests' *_perf: size in bytes first, the out-of-place time in
microseconds in the sixth column). The commands run one after the other,
ROUNDS times (A B C A B C ...), so a machine whose speed drifts treats them
alike. Per size, the table has each command's median time over the rounds
and, for every pair of commands (1st and 2nd, 3rd and 4th, ...), the
second's time over the first's: with the commands given as "without the
sidecar, with it", that is the sidecar's cost. With VS_PARTIAL=FILE the
table so far is written there after every round (a run cut short by a
time limit keeps its finished rounds). With VS_RAW=FILE every run's times
are appended there as one line (`round label size:us ...`), to see how the
runs of one command spread (a machine whose runs fall into a fast and a
slow mode shows it there, not in a median).
"""
import os
import re
import shlex
import statistics
import subprocess
import sys

ROW = re.compile(r"^(?:\[\d+\]\s+)?\s*(\d+)\s+\d+\s+\S+\s+\S+\s+-?\d+\s+([0-9.]+)\s")


def times(out):
    """Size -> out-of-place time (us) of every table row in `out`."""
    got = {}
    for line in out.splitlines():
        m = ROW.match(line)
        if m:
            got.setdefault(int(m.group(1)), float(m.group(2)))
    return got


def main():
    if len(sys.argv) < 4 or len(sys.argv) % 2 != 0:
        sys.exit(__doc__)
    rounds = int(sys.argv[1])
    cmds = list(zip(sys.argv[2::2], sys.argv[3::2]))
    runs = {label: [] for label, _ in cmds}
    for r in range(rounds):
        for label, cmd in cmds:
            p = subprocess.run(shlex.split(cmd), capture_output=True, text=True, timeout=600)
            t = times(p.stdout + p.stderr)
            if p.returncode != 0 or not t:
                print(f"round {r + 1} {label}: exit {p.returncode}, {len(t)} rows", file=sys.stderr)
                print((p.stdout + p.stderr)[-2000:], file=sys.stderr)
                continue
            runs[label].append(t)
            if os.environ.get("VS_RAW"):
                with open(os.environ["VS_RAW"], "a") as f:
                    cells = " ".join(f"{s}:{us}" for s, us in sorted(t.items()))
                    print(f"{r + 1} {label} {cells}", file=f)
        # A run cut short by a time limit still leaves its rounds so far.
        if os.environ.get("VS_PARTIAL"):
            with open(os.environ["VS_PARTIAL"], "w") as f:
                table(r + 1, cmds, runs, f)
        print(f"round {r + 1} done", file=sys.stderr, flush=True)
    table(rounds, cmds, runs, sys.stdout)


def table(rounds, cmds, runs, out):
    """The medians so far and each pair's ratio, as a markdown table."""
    p = lambda line: print(line, file=out, flush=True)
    sizes = sorted({s for rs in runs.values() for t in rs for s in t})
    labels = [label for label, _ in cmds]
    pairs = list(zip(labels[0::2], labels[1::2]))
    head = ["bytes"] + [f"{l} us" for l in labels] + [f"{b}/{a}" for a, b in pairs]
    p("| " + " | ".join(head) + " |")
    p("|" + "---|" * len(head))
    for s in sizes:
        med = {}
        for l in labels:
            v = [t[s] for t in runs[l] if s in t]
            med[l] = statistics.median(v) if v else float("nan")
        cells = [str(s)] + [f"{med[l]:.2f}" for l in labels]
        cells += [f"{med[b] / med[a]:.3f}" if med[a] > 0 else "-" for a, b in pairs]
        p("| " + " | ".join(cells) + " |")
    p(f"(median of {rounds} interleaved rounds; runs per command: "
      + ", ".join(f"{l} {len(runs[l])}" for l in labels) + ")")


if __name__ == "__main__":
    main()
