#!/bin/bash
# Per-call latency of device collectives without Python (issue 33, item 3):
# libcomm/capi/tests/c/stalls_cuda.c, one process per GPU (NP, default every
# GPU of the machine), Weft then NCCL from the same binary (LD_LIBRARY_PATH
# picks libnccl.so.2), 1,000 timed calls per cell (ITERS).
# Usage: OUT=/tmp/out bench/gpu/stalls.sh        (layout as run.sh: weft/libnccl.so.2 next to it)
# Output: $OUT/stalls-{weft,weft-sidecar,nccl}.txt, one "cell ..." line per rank and
# cell, and a summary per run: cells ok / STALL and the largest max (the
# "floor" cells, a memset and a synchronize without the library, printed apart). weft-sidecar:
# Weft's ranks under `weft run --sidecar` (attached to a sidecar, as in a pod: its
# telemetry and health board on every call). weft-run: the same launcher without a sidecar
# (what the launcher itself adds). MODES: which runs (default "weft weft-sidecar nccl").
# STALLS_SLOW=F (e.g. 1.6): every call over F x its cell's p50 is printed too, and
# stalls_slow.py says where they come from (both ranks at once, the gaps between them,
# the enqueue or the wait, the interrupts on the ranks' CPUs, from /proc/interrupts
# around each run). PAUSES=CPU (e.g. 31, a CPU the ranks leave alone): pauses.c spins
# there beside each run and records when the machine stopped it, and stalls_slow.py
# says which calls met such a pause (with STALLS_SLOW=0.01 every call is printed).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
D=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$D/../.." && pwd)
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
NP=${NP:-$(nvidia-smi -L | wc -l)}
NCCL=$(python3 -c 'import nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__file__))' 2>/dev/null)
NVRTC=$(dirname $(find / -name 'libnvrtc.so.13*' -not -path '/proc/*' 2>/dev/null | head -1) 2>/dev/null)
BIN=/tmp/stalls_cuda
nvcc -O2 -I $REPO/libcomm/include $REPO/libcomm/capi/tests/c/stalls_cuda.c \
  -L $D/weft -l:libnccl.so.2 -o $BIN || exit 2
port=29611
if [ -n "$PAUSES" ]; then gcc -O2 -pthread $D/pauses.c -o /tmp/pauses || exit 2; fi
for who in ${MODES:-weft weft-sidecar nccl}; do
  ld=$D/weft:$NVRTC; [ $who = nccl ] && ld=$NCCL/lib
  port=$((port + 1)); pids=()
  cat /proc/interrupts > $OUT/irq-$who-before.txt; t_start=$(date +%s.%N)
  if [ -n "$PAUSES" ]; then
    /tmp/pauses 600 3 $PAUSES $OUT/pauses-$who.txt > $OUT/pauses-$who-report.txt 2>&1 & spinner=$!
  fi
  if [ $who = weft-sidecar ] || [ $who = weft-run ]; then
    # weft run gives each rank RANK, LOCAL_RANK, WORLD_SIZE and NCCL_COMM_ID.
    sc=--sidecar; [ $who = weft-run ] && sc=
    LD_LIBRARY_PATH=$ld timeout 300 $D/weft/weft run $sc --no-prefix -n $NP -- \
      $BIN ${ITERS:-1000} > $OUT/stalls-$who-all.txt 2>&1 &
    pids+=($!)
  else
    for r in $(seq 0 $((NP - 1))); do
      LD_LIBRARY_PATH=$ld RANK=$r LOCAL_RANK=$r WORLD_SIZE=$NP NCCL_COMM_ID=127.0.0.1:$port \
        timeout 300 $BIN ${ITERS:-1000} > $OUT/stalls-$who-$r.txt 2>&1 &
      pids+=($!)
    done
  fi
  rc=0; for p in ${pids[@]}; do wait $p || rc=$?; done
  [ -n "$PAUSES" ] && { kill -TERM $spinner; wait $spinner; }
  cat /proc/interrupts > $OUT/irq-$who-after.txt; secs=$(awk "BEGIN{print $(date +%s.%N) - $t_start}")
  # Only this run's files (stalls-weft-* would also match weft-run's and weft-sidecar's).
  cat $OUT/stalls-$who-[0-9a]*.txt > $OUT/stalls-$who.txt; rm -f $OUT/stalls-$who-[0-9a]*.txt
  echo "== $who ($NP processes, one GPU each) rc=$rc"
  awk '/^cell floor/{print; next} /^cell/{c++; if ($NF=="(ok)") ok++; m=$11+0; if (m>mx) {mx=m; w=$2" "$3}} /WRONG|^rank [0-9]+: /{print}
    END{printf "cells %d ok %d STALL %d; largest max %.0f us (%s)\n", c, ok, c-ok, mx, w}' $OUT/stalls-$who.txt
  [ -n "$STALLS_SLOW" ] && python3 $D/stalls_slow.py $OUT/stalls-$who.txt \
    --irq $OUT/irq-$who-before.txt $OUT/irq-$who-after.txt $secs ${PAUSES:+--pauses $OUT/pauses-$who.txt}
done
