#!/bin/bash
# The calling thread's time inside a 256 MiB ncclAllReduce across two
# simulated hosts (issue 32), Weft beside NCCL's socket transport from one
# binary: libcomm/capi/tests/c/calltime_cuda.c, one process per GPU (NP,
# default 2), each rank its own host (WEFT_HOSTNAME / NCCL_HOSTID), ITERS
# timed calls (default 20) after GAP_US of idle each (default: 0 and 2000).
# Usage: OUT=/tmp/out bench/gpu/calltime.sh   (layout as run.sh: weft/libnccl.so.2 next to it)
# Output: $OUT/calltime-{weft,nccl}.txt, one "calltime ..." line per rank and gap.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
D=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$D/../.." && pwd)
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
NP=${NP:-2}
NCCL=$(python3 -c 'import nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__file__))' 2>/dev/null)
NVRTC=$(dirname $(find / -name 'libnvrtc.so.13*' -not -path '/proc/*' 2>/dev/null | head -1) 2>/dev/null)
BIN=/tmp/calltime_cuda
nvcc -O2 -I $REPO/libcomm/include $REPO/libcomm/capi/tests/c/calltime_cuda.c \
  -L $D/weft -l:libnccl.so.2 -o $BIN || exit 2
port=29711
for gap in ${GAPS:-0 2000}; do
  for who in weft nccl; do
    ld=$D/weft:$NVRTC; [ $who = nccl ] && ld=$NCCL/lib
    port=$((port + 1)); pids=()
    for r in $(seq 0 $((NP - 1))); do
      if [ $who = nccl ]; then hostenv="NCCL_HOSTID=host$r NCCL_SOCKET_IFNAME=lo"
      else hostenv="WEFT_HOSTNAME=host$r"; fi
      env $hostenv GAP_US=$gap LD_LIBRARY_PATH=$ld RANK=$r LOCAL_RANK=$r WORLD_SIZE=$NP \
        NCCL_COMM_ID=127.0.0.1:$port timeout 200 $BIN ${ITERS:-20} >> $OUT/calltime-$who-$r.txt 2>&1 &
      pids+=($!)
    done
    rc=0; for p in ${pids[@]}; do wait $p || rc=$?; done
    echo "== $who gap $gap us ($NP processes, one GPU each, each its own host) rc=$rc"
    cat $OUT/calltime-$who-*.txt | grep -E "gap $gap:|WRONG|^rank [0-9]+: "
  done
done
for who in weft nccl; do cat $OUT/calltime-$who-*.txt > $OUT/calltime-$who.txt; rm -f $OUT/calltime-$who-*.txt; done
