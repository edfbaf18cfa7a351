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
TARGET=${CARGO_TARGET_DIR:-target}
mkdir -p "$OUT"

if [ "${REUSE:-0}" != 1 ]; then
if ! command -v mpicc >/dev/null || ! command -v mpirun >/dev/null; then
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
MPIBIN="$OUT/allreduce_bench"
echo "== building the MPI program" >&2
mpicc -O2 -o "$MPIBIN" bench/mpi/allreduce_bench.c

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
    echo "# $(mpirun --version | head -1); weft $("$WEFT" --version | cut -d' ' -f2)"
    echo "# load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
} | tee "$OUT/machine.txt" >&2

for r in $(seq 1 "$ROUNDS"); do
    echo "== round $r/$ROUNDS: weft bench all_reduce -n $N ${SIZES[*]}" >&2
    "$WEFT" bench all_reduce -n "$N" "${SIZES[@]}" | tee "$OUT/weft.$r.txt" >&2
    echo "== round $r/$ROUNDS: ${MPIRUN[*]} allreduce_bench ${SIZES[*]}" >&2
    "${MPIRUN[@]}" "$MPIBIN" "${SIZES[@]}" | tee "$OUT/mpi.$r.txt" >&2
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
best "$OUT"/mpi.*.txt > "$OUT/mpi.best"
for a in $ALGOS; do best "$OUT/weft-$a.txt" > "$OUT/weft-$a.best"; done

# Side by side. busbw = size / time * 2(n-1)/n (GB/s); ratios weft/MPI.
{
    echo "| size | weft time (us) | MPI time (us) | time weft/MPI | weft busbw (GB/s) | MPI busbw (GB/s) | busbw weft/MPI | in-place time weft/MPI | in-place busbw weft/MPI |"
    echo "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
    join -j 1 <(sort -n "$OUT/weft.best") <(sort -n "$OUT/mpi.best") | sort -n | awk -v n="$N" '
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
} | tee "$OUT/compare.md"

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

# The goal: busbw >= MPI from 1 MiB up; time <= 1.5x MPI for small messages.
join -j 1 <(sort -n "$OUT/weft.best") <(sort -n "$OUT/mpi.best") | sort -n | awk '
    $1 >= 1048576 && $2 > $4 { bw = bw " " $1 }
    $1 < 1048576 && $2 > 1.5 * $4 { lat = lat " " $1 }
    END {
        print ""
        print "busbw >= MPI from 1 MiB up (out of place): " (bw == "" ? "met" : "missed at" bw)
        print "time <= 1.5x MPI below 1 MiB (out of place): " (lat == "" ? "met" : "missed at" lat)
    }' | tee -a "$OUT/compare.md"
