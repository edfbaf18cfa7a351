#!/usr/bin/env bash
# Weft vs OpenMPI all-reduce on this machine: `weft bench all_reduce` and
# bench/mpi/allreduce_bench.c (MPI_Allreduce) with the same sizes, warm-up,
# iterations and timing method, in one invocation, then a side-by-side table
# with the busbw ratio and the latency (time) ratio per size.
#
#   bench/compare_mpi.sh                      # 4 ranks, 8 B .. 256 MiB
#   N=4 MIN=8 MAX=256M ROUNDS=3 ALGOS="ring rd" bench/compare_mpi.sh
#
# Environment:
#   N        ranks (4)                 MIN, MAX   sizes (8, 256M), factor 2
#   WARMUP   warm-up calls (5)         ITERS      timed calls (20)
#   ROUNDS   alternate weft/MPI runs this many times and keep, per size and
#            placement, each side's best (lowest) time (1)
#   ALGOS    extra weft runs with WEFT_ALGO set to each of these, e.g. "ring rd"
#   OUT      folder for the raw outputs ($CARGO_TARGET_DIR/compare-mpi)
#   CARGO_TARGET_DIR  where cargo builds (target)
#   REUSE=1  skip building and running: only redo the tables from $OUT
#   WEFT_BIN use this weft binary instead of building one (cargo build --release)
#   MPI_BENCH_BIN  use this build of bench/mpi/allreduce_bench.c instead of
#            compiling it (a machine with mpirun but no mpicc)
#   GLOO=1   also run torch.distributed's gloo backend (bench/gloo/allreduce_bench.py)
#            in every round, and print a weft-vs-Gloo table (bench/compare_gloo.sh)
#   PYTHON   the python with torch for GLOO=1 (python3)
#   MPI=0    skip MPI (with GLOO=1: weft vs Gloo only)
#
# MPI settings (see docs/PERFORMANCE.md): shared-memory BTL only
# (--mca btl self,vader), no pinning (--bind-to none, like weft's ranks),
# --oversubscribe (4 ranks on 2 cores; Open MPI then yields when idle),
# --allow-run-as-root when root, and mpi_yield_when_idle 1 when there are
# more ranks than cores. Everything else is Open MPI's default,
# including its collective tuner (coll/tuned) choosing the algorithm per size.
set -euo pipefail
cd "$(dirname "$0")/.."

N=${N:-4}
MIN=${MIN:-8}
MAX=${MAX:-256M}
WARMUP=${WARMUP:-5}
ITERS=${ITERS:-20}
ROUNDS=${ROUNDS:-1}
ALGOS=${ALGOS:-}
OUT=${OUT:-${CARGO_TARGET_DIR:-target}/compare-mpi}
GLOO=${GLOO:-0}
MPI=${MPI:-1}
PYTHON=${PYTHON:-python3}
TARGET=${CARGO_TARGET_DIR:-target}
mkdir -p "$OUT"

if [ "${REUSE:-0}" != 1 ]; then
if [ "$GLOO" = 1 ] && ! "$PYTHON" -c 'import torch.distributed as d; assert d.is_gloo_available()' 2>/dev/null; then
    echo "GLOO=1 needs torch with gloo for $PYTHON: pip install torch (or set PYTHON)" >&2
    exit 2
fi
if [ "$MPI" = 1 ] && { ! command -v mpirun >/dev/null || { [ -z "${MPI_BENCH_BIN:-}" ] && ! command -v mpicc >/dev/null; }; }; then
    echo "== installing Debian's Open MPI" >&2
    apt-get update -qq && apt-get install -y -qq openmpi-bin libopenmpi-dev >&2
fi

if [ -n "${WEFT_BIN:-}" ]; then
    WEFT=$WEFT_BIN
else
    echo "== building weft (release)" >&2
    cargo build --release -p weft >&2
    WEFT="$TARGET/release/weft"
fi
MPIBIN=${MPI_BENCH_BIN:-$OUT/allreduce_bench}
if [ "$MPI" = 1 ] && [ -z "${MPI_BENCH_BIN:-}" ]; then
echo "== building the MPI program" >&2
mpicc -O2 -o "$MPIBIN" bench/mpi/allreduce_bench.c
fi

MPIRUN=(mpirun --oversubscribe --bind-to none --mca btl self,vader -np "$N")
if [ "$(id -u)" = 0 ]; then MPIRUN=(mpirun --allow-run-as-root "${MPIRUN[@]:1}"); fi
# More ranks than usable cores: make Open MPI yield the core while it waits
# (weft's ranks sleep on futexes). Open MPI does this by itself when it
# notices the oversubscription, but not under `taskset`, where it counts the
# machine's cores rather than the usable ones and spins a full scheduler tick.
if [ "$N" -gt "$(nproc)" ]; then MPIRUN+=(--mca mpi_yield_when_idle 1); fi
SIZES=(-b "$MIN" -e "$MAX" -f 2 -w "$WARMUP" -i "$ITERS")

{
    echo "# machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //'), $(uname -sr)"
    echo "# $( [ "$MPI" = 1 ] && mpirun --version | head -1); weft $("$WEFT" --version | cut -d' ' -f2)$( [ "$GLOO" = 1 ] && echo "; torch $("$PYTHON" -c 'import torch; print(torch.__version__)') gloo")"
    echo "# load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
} | tee "$OUT/machine.txt" >&2

for r in $(seq 1 "$ROUNDS"); do
    echo "== round $r/$ROUNDS: weft bench all_reduce -n $N ${SIZES[*]}" >&2
    "$WEFT" bench all_reduce -n "$N" "${SIZES[@]}" | tee "$OUT/weft.$r.txt" >&2
    if [ "$MPI" = 1 ]; then
        echo "== round $r/$ROUNDS: ${MPIRUN[*]} allreduce_bench ${SIZES[*]}" >&2
        "${MPIRUN[@]}" "$MPIBIN" "${SIZES[@]}" | tee "$OUT/mpi.$r.txt" >&2
    fi
    if [ "$GLOO" = 1 ]; then
        echo "== round $r/$ROUNDS: $PYTHON bench/gloo/allreduce_bench.py -n $N ${SIZES[*]}" >&2
        "$PYTHON" bench/gloo/allreduce_bench.py -n "$N" "${SIZES[@]}" | tee "$OUT/gloo.$r.txt" >&2
    fi
done
for a in $ALGOS; do
    echo "== weft bench all_reduce -n $N ${SIZES[*]} -a $a" >&2
    "$WEFT" bench all_reduce -n "$N" "${SIZES[@]}" -a "$a" | tee "$OUT/weft-$a.txt" >&2
done
echo "# load average at end: $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$OUT/machine.txt" >&2
fi

# Best time per size and placement over the rounds: "size oop_us ip_us".
best() {
    awk '!/^#/ && NF >= 13 {
        s = $1; o = $6 + 0; i = $10 + 0
        if (!(s in bo) || o < bo[s]) bo[s] = o
        if (!(s in bi) || i < bi[s]) bi[s] = i
        if (!(s in seen)) { seen[s] = 1; order[++n] = s }
    } END { for (k = 1; k <= n; k++) print order[k], bo[order[k]], bi[order[k]] }' "$@"
}
best "$OUT"/weft.*.txt > "$OUT/weft.best"
for other in mpi gloo; do
    if ls "$OUT/$other".*.txt >/dev/null 2>&1; then best "$OUT/$other".*.txt > "$OUT/$other.best"; fi
done
for a in $ALGOS; do best "$OUT/weft-$a.txt" > "$OUT/weft-$a.best"; done

# Side by side with $1 (mpi or gloo, named $2). busbw = size / time * 2(n-1)/n
# (GB/s); ratios weft/other.
side_by_side() {
    local o=$1 name=$2
    echo "| size | weft time (us) | $name time (us) | time weft/$name | weft busbw (GB/s) | $name busbw (GB/s) | busbw weft/$name | in-place time weft/$name | in-place busbw weft/$name |"
    echo "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
    join -j 1 <(sort -n "$OUT/weft.best") <(sort -n "$OUT/$o.best") | sort -n | awk -v n="$N" '
    function human(b) {
        if (b >= 1073741824 && b % 1073741824 == 0) return b / 1073741824 " GiB"
        if (b >= 1048576 && b % 1048576 == 0) return b / 1048576 " MiB"
        if (b >= 1024 && b % 1024 == 0) return b / 1024 " KiB"
        return b " B"
    }
    {
        size = $1; wo = $2; wi = $3; mo = $4; mi = $5
        f = 2 * (n - 1) / n
        wb = size / wo / 1e3 * f; mb = size / mo / 1e3 * f
        printf "| %s | %.2f | %.2f | %.2f | %.3f | %.3f | %.2f | %.2f | %.2f |\n", human(size), wo, mo, wo / mo, wb, mb, (mb > 0 ? wb / mb : 0), wi / mi, mi / wi
    }'
}

# The worst ratios against $1 over sizes up to 64 KiB (time, both
# placements) and above (busbw, out of place), with the goals of issue 21.
worst() {
    local o=$1 name=$2 tgoal=$3 bgoal=$4
    join -j 1 <(sort -n "$OUT/weft.best") <(sort -n "$OUT/$o.best") | sort -n | awk -v name="$name" -v tg="$tgoal" -v bg="$bgoal" '
    $1 <= 65536 { r = $2 / $4; if (r > to) { to = r; so = $1 }; r = $3 / $5; if (r > ti) { ti = r; si = $1 } }
    $1 > 65536 { r = $4 / $2; if (nb == 0 || r < bw) { bw = r; sb = $1 }; nb++ }
    END {
        print ""
        printf "worst time weft/%s up to 64 KiB: out of place %.2f (at %d B), in place %.2f (at %d B); goal <= %s: %s\n", name, to, so, ti, si, tg, (to <= tg && ti <= tg) ? "met" : "missed"
        if (nb > 0) printf "worst busbw weft/%s above 64 KiB (out of place): %.2f (at %d B); goal >= %s: %s\n", name, bw, sb, bg, (bw >= bg) ? "met" : "missed"
    }'
}

: > "$OUT/compare.md"
if [ -s "$OUT/mpi.best" ] && [ "$MPI" = 1 ]; then
    side_by_side mpi MPI | tee "$OUT/compare.md"
fi
if [ "$GLOO" = 1 ] && [ -s "$OUT/gloo.best" ]; then
    echo | tee -a "$OUT/compare.md"
    side_by_side gloo Gloo | tee "$OUT/compare-gloo.md" | tee -a "$OUT/compare.md"
fi

if [ -n "$ALGOS" ]; then
    echo
    {
        printf "| size | weft auto time (us)"
        for a in $ALGOS; do printf " | WEFT_ALGO=%s time (us)" "$a"; done
        printf " | MPI time (us) |\n| ---: | ---:"
        for a in $ALGOS; do printf " | ---:"; done
        printf " | ---: |\n"
        files=("$OUT/weft.best")
        for a in $ALGOS; do files+=("$OUT/weft-$a.best"); done
        files+=("$OUT/mpi.best")
        paste "${files[@]}" | awk '
        function human(b) {
            if (b >= 1073741824 && b % 1073741824 == 0) return b / 1073741824 " GiB"
            if (b >= 1048576 && b % 1048576 == 0) return b / 1048576 " MiB"
            if (b >= 1024 && b % 1024 == 0) return b / 1024 " KiB"
            return b " B"
        }
        {
            printf "| %s", human($1)
            for (c = 2; c <= NF; c += 3) printf " | %.2f", $c
            printf " |\n"
        }'
    } | tee "$OUT/algos.md"
fi

# Goals (issue 21): on 16 cores time <= 1.0x MPI to 64 KiB and busbw >= 1.3x
# MPI from 1 MiB; time <= 0.5x Gloo to 64 KiB and busbw >= 1.0x above; on 2
# cores with 4 ranks, time <= 1.5x MPI. TGOAL overrides the MPI time goal.
if [ "$(nproc)" -lt "$N" ]; then TG=${TGOAL:-1.5}; else TG=${TGOAL:-1.0}; fi
{
    if [ "$MPI" = 1 ] && [ -s "$OUT/mpi.best" ]; then worst mpi MPI "$TG" 1.3; fi
    if [ "$GLOO" = 1 ] && [ -s "$OUT/gloo.best" ]; then worst gloo Gloo 0.5 1.0; fi
} | tee -a "$OUT/compare.md"
