#!/bin/bash
# Two simulated hosts as two network namespaces joined by a veth pair, for the
# cross-host measurements over a real (virtual) link instead of loopback
# (issue 32: "if loopback flatters either"). One torchrun agent per host runs
# tests/torch/busbw.py (nccl-tests' MPI launcher cannot cross namespaces: its
# PMIx client reaches the server over loopback TCP).
#
#   bench/gpu/veth.sh setup                  # wa: va 10.77.0.1/24 <-> wb: vb 10.77.0.2/24
#   bench/gpu/veth.sh run weft|nccl lo|veth  # 2 hosts x 1 on GPU 0 (LOCAL_RANK 0 each), busbw rows
#   bench/gpu/veth.sh teardown
#
# Needs root and `ip` (iproute2). Weft: WEFT_PRELOAD (default bench/gpu/weft/libnccl.so.2)
# is preloaded; its ranks listen on their veth address (WEFT_LISTEN_ADDR). NCCL: torch's own,
# its socket transport on the veth (NCCL_SOCKET_IFNAME=v). OPS: busbw.py's --ops.
set -u
D=$(cd "$(dirname "$0")" && pwd); REPO=$(cd "$D/../.." && pwd)
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
teardown() { ip netns del wa 2>/dev/null; ip netns del wb 2>/dev/null; true; }
setup() {
  teardown
  ip netns add wa && ip netns add wb
  ip link add va type veth peer name vb
  ip link set va netns wa && ip link set vb netns wb
  ip -n wa addr add 10.77.0.1/24 dev va && ip -n wb addr add 10.77.0.2/24 dev vb
  for n in wa wb; do ip -n $n link set lo up; done
  ip -n wa link set va up && ip -n wb link set vb up
}
run() {
  local who=$1 net=$2 r pre= port=$((29500 + RANDOM % 400))
  [ "$who" = weft ] && pre=${WEFT_PRELOAD:-$D/weft/libnccl.so.2}
  for r in 0 1; do
    local wrap= master=127.0.0.1 ifn=lo listen=
    if [ "$net" = veth ]; then
      wrap="ip netns exec $([ $r = 0 ] && echo wa || echo wb)"; master=10.77.0.1; ifn=v; listen=10.77.0.$((r + 1))
    fi
    env LD_PRELOAD=$pre NCCL_SOCKET_IFNAME=$ifn ${listen:+WEFT_LISTEN_ADDR=$listen} timeout 300 $wrap \
      python3 -m torch.distributed.run --nnodes 2 --node-rank $r --nproc-per-node 1 \
      --master-addr $master --master-port $port "$REPO/tests/torch/busbw.py" --hosts 2 \
      --label "$who-$net" --ops "${OPS:-all_reduce,sendrecv,all_to_all}" > "$OUT/busbw-$who-$net-$r.txt" 2>&1 &
  done
  wait
  grep -h '^busbw' "$OUT/busbw-$who-$net-0.txt" || tail -5 "$OUT/busbw-$who-$net-0.txt"
}
case "${1:-}" in
  setup) setup ;;
  teardown) teardown ;;
  run) run "$2" "$3" ;;
  *) sed -n 2,16p "$0"; exit 2 ;;
esac
