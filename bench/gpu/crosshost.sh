#!/bin/bash
# Device collectives across simulated hosts on one GPU machine (issue 32):
# nccl-tests under mpirun, one process per rank, every rank on GPU 0
# (NCCL_TESTS_DEVICE=0), the ranks split into simulated hosts by
# WEFT_HOSTNAME (Weft) or NCCL_HOSTID (NCCL). Ranks of different host
# identities never map each other's memory: Weft runs its cross-host path
# (pinned buffers + progress thread, TCP over loopback between the halves).
# Usage: bench/gpu/crosshost.sh [phases...]     (invoked like bench/gpu/run.sh)
#   phases: info build rtest check perf nccl table (and engine, proxy)
#   build   nccl-tests with MPI=1 (run.sh mpibuild: bench/gpu/nccl-tests -> /tmp/nccl-tests/build-mpi)
#   rtest   the Rust GPU tests (weft/crosshost-test: `cargo test --release -p weft-nccl
#           --test cuda_crosshost --no-run`, stripped): every collective vs a reference,
#           the 256 MiB call time, SIGKILL / SIGSTOP of a remote rank
#   check   Weft, 2 hosts x 2 ranks: every collective, 1 MiB-256 MiB, checks on (-c 1)
#   perf    Weft 2 x 2 and 4 x 1 (XH_PERS: ranks per host, default "2 1"), busbw
#           1 MiB-256 MiB (checks on) into $OUT/crosshost.txt
#   nccl    NCCL on the same splits: 2 x 2 on one GPU (NCCL refuses two ranks of one
#           host on one GPU: recorded), 4 x 1 (NCCL_HOSTID per rank) over its socket transport
#   engine  Weft 2 x 2 with WEFT_CROSSHOST_MIN_BYTES (XH_ENGINE_MIN, default 1048576): the
#           progress thread's host part on the cross-host engine (XH_ENGINE_COLLS: which)
#   proxy   Weft 2 hosts x XH_NP/2 with a `weft sidecar` per simulated host (its own
#           loopback address, 127.0.0.11 / .12) and every rank attached to its host's, as
#           in a pod: the defaults (the engine over its own TCP from 4 MiB, the flat path
#           through the proxy below), the engine over its own TCP (WEFT_CROSSHOST_NET=tcp)
#           and the engine through the proxy (=proxy), these two from XH_ENGINE_MIN
#           (default 1048576); XH_ENGINE_COLLS: which collectives
#   table   busbw side by side from $OUT/crosshost.txt
#   machine what the machine itself moves now (bench/gpu/machine.py: host memcpy, loopback
#           TCP, a short sleep), a line into $OUT/crosshost.txt: put it before and after
#           perf and nccl, since Weft runs near these limits and NCCL far below them
# XH_ITERS: nccl-tests iterations (default "-n 5 -w 2"). XH_EXTRA: more nccl-tests arguments
# after the perf, engine, proxy and nccl phases' own (e.g. "-d all -o all": every type and op). XH_LABEL: the perf phase's column name (default ours). XH_NP: ranks (default 4). XH_DEV=local: each rank on its own GPU (nccl-tests'
# local rank; one process per GPU, e.g. XH_NP=2 on 2 GPUs: 2 hosts x 1); XH_DEV=mod:
# rank r on GPU r mod (GPUs), e.g. XH_NP=4 on 2 GPUs: 2 hosts x 2 GPUs (NVLink within a
# host; the hosts share the two GPUs); else every rank on GPU 0. XH_NCCL_PERS: the nccl
# phase's ranks per host (default 1; 2 with XH_DEV=mod). WEFT_CROSSHOST_HIER=0 reaches the
# ranks (the whole operation staged, for an A/B of the hierarchical path).
# Layout next to this script as run.sh's (weft/libnccl.so.2, nccl-tests/).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
D=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
phases="${*:-info build rtest check perf nccl table}"
log() { echo "=== $* ($(date -u +%T))"; }
NCCL=$(python3 -c 'import nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__file__))' 2>/dev/null)
[ -n "$NCCL" ] || NCCL=$(dirname $(dirname $(find / -name 'libnccl.so.2*' -not -path '*/.device/*' 2>/dev/null | head -1)))
NVRTC=$(dirname $(find / -name 'libnvrtc.so.13*' -not -path '*/proc/*' 2>/dev/null | head -1) 2>/dev/null)
WEFT=${XH_WEFT:-$D/weft}   # XH_WEFT: another build's directory (an A/B of two builds)
TM=/tmp/nccl-tests/build-mpi
COLLS=${XH_COLLS:-all_reduce all_gather reduce_scatter broadcast reduce alltoall sendrecv}
SIZES=${XH_SIZES:--b 1M -e 256M -f 4}
ITERS=${XH_ITERS:--n 5 -w 2}   # nccl-tests iterations of the perf, engine, proxy and nccl phases
CHK() { awk '/^ +[0-9]+ /{n++; if ($9!="0" || ($13!="0" && $13!="N/A")) {bad++; if (bad<4) print "WRONG:", $0}} /Out of bounds|rc=|error|fail|WARN/{print} END{print "rows", n+0, "wrong rows", bad+0}'; }
NP=${XH_NP:-4}
# XH_DEV=local: NCCL_TESTS_DEVICE unset in the ranks (mpirun's local ranks inherit
# its environment, -x or not), so nccl-tests picks its local rank's GPU. Before
# 2026-11-30 it stayed set to 0 and "local" runs shared GPU 0 (docs/PERFORMANCE-GPU.md).
DEVX="-x NCCL_TESTS_DEVICE"; [ "${XH_DEV:-0}" = local ] && DEVX="-x XH_LOCALDEV" && export XH_LOCALDEV=1
[ "${XH_DEV:-0}" = mod ] && DEVX="-x XH_NG" && export XH_NG=$(nvidia-smi -L | wc -l)
HALF=$((NP / 2))   # ranks per host of the two-host runs (check, engine)
# mpirun of NP ranks (on GPU 0 or one each); PER ranks per simulated host; WHO=ours|nccl.
# The wrapper gives each rank its host identity from its MPI rank.
xrun() { local who=$1 per=$2; shift 2
  local ld=$WEFT:$NVRTC; [ $who = nccl ] && ld=$NCCL/lib
  local xs= v; for v in WEFT_CROSSHOST_MIN_BYTES WEFT_CROSSHOST_HIER WEFT_CROSSHOST_COPY WEFT_CROSSHOST_PIPELINE WEFT_DEBUG WEFT_CROSSHOST_SLICE_BYTES WEFT_CROSSHOST_NET WEFT_NET_SOCKETS WEFT_CPU_AFFINITY WEFT_TIMEOUT_MS NCCL_DEBUG XH_SC WEFT_JOB WEFT_JOB_SECRET; do
    [ -n "${!v:-}" ] && xs="$xs -x $v"; done
  LD_LIBRARY_PATH=$ld NCCL_TESTS_DEVICE=0 XH_PER=$per XH_WHO=$who timeout ${TMO:-300} \
    mpirun --allow-run-as-root --oversubscribe -np $NP --bind-to none \
      -x LD_LIBRARY_PATH $DEVX -x XH_PER -x XH_WHO -x NCCL_NVLS_ENABLE $xs \
      bash -c 'h=sim-$((OMPI_COMM_WORLD_RANK / XH_PER))
        [ -n "${XH_LOCALDEV:-}" ] && unset NCCL_TESTS_DEVICE
        [ -n "${XH_NG:-}" ] && export NCCL_TESTS_DEVICE=$((OMPI_COMM_WORLD_RANK % XH_NG))
        if [ "$XH_WHO" = nccl ]; then
          export NCCL_HOSTID=$h NCCL_SOCKET_IFNAME=lo
          # One rank per host: its socket transport, as between machines.
          [ "$XH_PER" = 1 ] && export NCCL_NET=Socket NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1
        else export WEFT_HOSTNAME=$h; fi
        # With sidecars (XH_SC: their socket prefix): attached to the host sidecar,
        # listening on its loopback address (the proxy joins distinct addresses).
        if [ -n "${XH_SC:-}" ]; then i=$((OMPI_COMM_WORLD_RANK / XH_PER))
          export WEFT_SIDECAR_SOCKET=$XH_SC$i.sock WEFT_LISTEN_ADDR=127.0.0.1$((i + 1)); fi
        exec "$@"' _ "$@"
  echo "rc=$?"; }
for ph in $phases; do case $ph in
info)
  log info; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; nproc
  echo "NCCL=$NCCL NVRTC=$NVRTC"; mpirun --version 2>&1 | head -1 ;;
build)
  OUT=$OUT $D/run.sh mpibuild ;;
machine)
  log machine; timeout 120 python3 $D/machine.py | tee -a $OUT/crosshost.txt ;;
rtest)
  log rust GPU tests across simulated hosts
  LD_LIBRARY_PATH=$WEFT:$NVRTC timeout 600 $D/weft/crosshost-test --ignored --nocapture --test-threads 1 2>&1 | grep -E "^test |@ (call_us|median|failed)|panicked|test result" ; echo "rc=$?" ;;
check)
  for t in $COLLS; do
    log check ours $t 2 hosts x $HALF ranks
    TMO=300 xrun ours $HALF $TM/${t}_perf -g 1 $SIZES -c 1 -n 2 -w 1 -d float 2>&1 | tee -a $OUT/crosshost-check.txt | CHK
  done ;;
perf)
  for per in ${XH_PERS:-2 1}; do for t in $COLLS; do
    log perf ${XH_LABEL:-ours} $t $((NP / per)) hosts x $per
    echo "### ${XH_LABEL:-ours} $t hosts=$((NP / per))x$per" >> $OUT/crosshost.txt
    TMO=300 xrun ours $per $TM/${t}_perf -g 1 $SIZES -c 1 $ITERS -d float ${XH_EXTRA:-} 2>&1 | tee -a $OUT/crosshost.txt | grep -E "^ +[0-9]+ |rc=" | awk '{print $1, $6, $8, $9}'
  done; done ;;
engine)
  # As perf, 2 hosts x 2 ranks, with the host part on the cross-host engine
  # (WEFT_CROSSHOST_MIN_BYTES=${XH_ENGINE_MIN:-1048576}, WEFT_NET_SOCKETS default).
  for t in ${XH_ENGINE_COLLS:-all_reduce all_gather reduce_scatter alltoall}; do
    log perf ours-engine $t 2 hosts x $HALF
    echo "### engine $t hosts=2x$HALF" >> $OUT/crosshost.txt
    WEFT_CROSSHOST_MIN_BYTES=${XH_ENGINE_MIN:-1048576} TMO=300 xrun ours $HALF $TM/${t}_perf -g 1 $SIZES -c 1 $ITERS -d float ${XH_EXTRA:-} 2>&1 | tee -a $OUT/crosshost.txt | grep -E "^ +[0-9]+ |rc=" | awk '{print $1, $6, $8, $9}'
  done ;;
proxy)
  # One sidecar per simulated host, as the operator puts one in every pod.
  export WEFT_JOB=xh$$ WEFT_JOB_SECRET=$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n') XH_SC=/tmp/xh-sc
  scs=(); for i in 0 1; do
    rm -f $XH_SC$i.sock $XH_SC$i.sock.proxy
    $WEFT/weft sidecar --http 127.0.0.1:0 --socket $XH_SC$i.sock --job $WEFT_JOB --host sim-$i \
      --peer-listen 127.0.0.1$((i + 1)):7411 --peers 127.0.0.1$((2 - i)):7411 > $OUT/sidecar$i.log 2>&1 &
    scs+=($!)
  done
  for i in 0 1; do for _ in $(seq 100); do [ -S $XH_SC$i.sock.proxy ] && break; sleep 0.1; done; done
  ls -l $XH_SC*; for t in ${XH_ENGINE_COLLS:-all_reduce all_gather reduce_scatter alltoall}; do
    for m in default tcp proxy; do
      log perf ours-sidecar-$m $t 2 hosts x $HALF
      echo "### sidecar-$m $t hosts=2x$HALF" >> $OUT/crosshost.txt
      if [ $m = default ]; then unset WEFT_CROSSHOST_MIN_BYTES WEFT_CROSSHOST_NET
      else export WEFT_CROSSHOST_MIN_BYTES=${XH_ENGINE_MIN:-1048576} WEFT_CROSSHOST_NET=$m; fi
      TMO=300 xrun ours $HALF $TM/${t}_perf -g 1 $SIZES -c 1 $ITERS -d float ${XH_EXTRA:-} 2>&1 | tee -a $OUT/crosshost.txt | grep -E "^ +[0-9]+ |rc=" | awk '{print $1, $6, $8, $9}'
    done
  done
  unset XH_SC WEFT_CROSSHOST_MIN_BYTES WEFT_CROSSHOST_NET; kill ${scs[@]} 2>/dev/null; wait ${scs[@]} ;;
nccl)
  if [ "${XH_DEV:-0}" = 0 ]; then
    log nccl 2 hosts x 2 ranks on one GPU "(expected: refused, duplicate GPU)"
    echo "### nccl all_reduce hosts=2x2" >> $OUT/crosshost.txt
    TMO=120 xrun nccl 2 $TM/all_reduce_perf -g 1 -b 1M -e 1M -c 1 -n 1 -w 1 2>&1 | tee -a $OUT/crosshost.txt | grep -iE "duplicate|invalid|error|rc=" | head -5
  fi
  np=${XH_NCCL_PERS:-1}; [ "${XH_DEV:-0}" = mod ] && np=${XH_NCCL_PERS:-2}
  for per in $np; do for t in $COLLS; do
    log perf nccl $t $((NP / per)) hosts x $per, socket transport between hosts
    echo "### nccl $t hosts=$((NP / per))x$per" >> $OUT/crosshost.txt
    TMO=300 xrun nccl $per $TM/${t}_perf -g 1 $SIZES -c 1 $ITERS -d float ${XH_EXTRA:-} 2>&1 | tee -a $OUT/crosshost.txt | grep -E "^ +[0-9]+ |rc=" | awk '{print $1, $6, $8, $9}'
  done; done ;;
table)
  # busbw (out of place) per size: one column per "### who coll hosts" run.
  awk '/^### /{k=$2" "$3" "$4; if (!(k in seen)) {seen[k]=1; keys[++nk]=k}} /^ +[0-9]+ /&&k!=""{b[k" "$1]=$8; sz[$1]=1}
    END{h="#size"; for (i=1;i<=nk;i++) h=h"\t"keys[i]; gsub(/ /,":",h); print h; for (s in sz) {line=s; for (i=1;i<=nk;i++) line=line"\t"(b[keys[i]" "s]==""?"-":b[keys[i]" "s]); print line}}' $OUT/crosshost.txt | sort -n ;;
esac; done
