#!/usr/bin/env python3
"""Side-by-side table from nccl-tests output (bench/gpu/run.sh's perf.txt):
sections start with '### <who> <collective> ...'; rows are nccl-tests rows.
Prints, per collective, size | NCCL time, busbw | Weft time, busbw | ratios
(out-of-place columns)."""
import sys, re
from collections import defaultdict

data = defaultdict(dict)  # (coll) -> who -> {size: (time, busbw)}
who = coll = None
for line in open(sys.argv[1]):
    m = re.match(r"### (\S+) (\S+)", line)
    if m:
        who, coll = m.group(1), m.group(2)
        data[coll].setdefault(who, {})
        continue
    f = line.split()
    if who and len(f) >= 9 and f[0].isdigit() and f[1].isdigit():
        data[coll][who][int(f[0])] = (float(f[5]), float(f[7]))

def human(n):
    for u in ["B", "KiB", "MiB", "GiB"]:
        if n < 1024:
            return f"{n} {u}"
        n //= 1024
    return f"{n} TiB"

for coll, d in data.items():
    others = [w for w in d if w not in ("nccl",)]
    for w in others:
        if "nccl" not in d:
            continue
        print(f"\n#### {coll}: NCCL vs Weft ({w})\n")
        print("| size | NCCL time (us) | NCCL busbw (GB/s) | Weft time (us) | Weft busbw (GB/s) | Weft/NCCL (= NCCL time / Weft time) |")
        print("| ---: | ---: | ---: | ---: | ---: | ---: |")
        for size in sorted(set(d["nccl"]) & set(d[w])):
            (tn, bn), (tw, bw) = d["nccl"][size], d[w][size]
            print(f"| {human(size)} | {tn:.2f} | {bn:.2f} | {tw:.2f} | {bw:.2f} | {tn / tw:.2f} |")
