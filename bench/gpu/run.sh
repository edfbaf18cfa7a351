#!/bin/bash
# Weft CUDA data plane on the GPU machine: build nccl-tests against the
# machine's NCCL, run correctness (ours) and performance (NCCL vs ours).
# Usage: bench/gpu/run.sh [phases...]
#   phases: info build mpibuild smoke rtest rtestv rtestc rtestl chainquick rtest0 coldstart check checkg
#           check9 share1 chaincheck chainlite linescheck bcastreduce mpicheck mpi wbench table
#           perfp2p lat mpilat tune chaintune linestune sidecar sidecarhost save unsave
# Layout next to this script (never committed; built/copied per run):
#   nccl-tests/      git archive of github.com/NVIDIA/nccl-tests (2.19.6), built here
#                    with MPI=0 (build/) and MPI=1 (build-mpi/)
#   weft/libnccl.so.2  stripped `cargo build --release -p weft-nccl` (target/release/libnccl.so)
#   weft/cuda-test     stripped `cargo test --release -p weft-nccl --test cuda --no-run` binary
#   weft/cold-start-test  stripped `cargo test --release -p weft-nccl --test cuda_cold_start --no-run` binary
#   weft/weft          stripped `cargo build --release -p weft` (for weft bench --device cuda)
#   weft-old/libnccl.so.2  optional: an earlier build, for the `lat` phase's comparison
# Some phases take the collectives from TABLE_COLLS, CHECK_COLLS (mpicheck),
# MPI_COLLS, WBENCH_COLLS (default: all of theirs).
# Logs go to $OUT (check.txt, perf.txt, build.log); bench/gpu/table.py perf.txt
# prints the side-by-side tables.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
D=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
NG=$(nvidia-smi -L | wc -l)
phases="${*:-info build smoke check table}"
log() { echo "=== $* ($(date -u +%T))"; }
NCCL=$(python3 -c 'import nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__file__))' 2>/dev/null)
[ -n "$NCCL" ] || NCCL=$(dirname $(dirname $(find / -name 'libnccl.so.2*' -not -path '*/.device/*' 2>/dev/null | head -1)))
SYSNCCL=$(find / -name 'libnccl.so.2*' -not -path '*/.device/*' -not -path '/proc/*' 2>/dev/null | head -3)
NVRTC=$(dirname $(find / -name 'libnvrtc.so.13*' -not -path '*/proc/*' 2>/dev/null | head -1) 2>/dev/null)
WEFT=$D/weft   # our libnccl.so.2
# Build outputs outside this folder: a call that carries it replaces it.
T=/tmp/nccl-tests/build
TM=/tmp/nccl-tests/build-mpi
MPIRUN="mpirun --allow-run-as-root --oversubscribe -np $NG --bind-to none -x NCCL_NVLS_ENABLE -x WEFT_KERNEL_CACHE -x LD_LIBRARY_PATH"
CHK() { awk '/^ +[0-9]+ /{n++; if ($9!="0" || ($13!="0" && $13!="N/A")) {bad++; if (bad<4) print "WRONG:", $0}} /Out of bounds|rc=|error|fail|WARN/{print} END{print "rows", n+0, "wrong rows", bad+0}'; }
SYS_LD="$NCCL/lib"
OURS_LD="$WEFT:$NVRTC"
export WEFT_KERNEL_CACHE=/tmp/weft-kernels
run_ours() { LD_LIBRARY_PATH=$OURS_LD timeout ${TMO:-90} "$@"; echo "rc=$?"; }
run_nccl() { LD_LIBRARY_PATH=$SYS_LD timeout ${TMO:-90} "$@"; echo "rc=$?"; }
# side COLL ARGS...: NCCL then Weft on the same nccl-tests binary, checked
# (-c 1), into perf.txt (time, busbw, #wrong of the out-of-place columns).
side() { local t=$1; shift; for who in nccl ours; do
  log perf $who $t g=$NG; echo "### $who $t -g $NG" >> $OUT/perf.txt
  TMO=60 run_$who $T/${t}_perf -g $NG -c 1 -n 10 -w 3 -d float "$@" 2>&1 | tee -a $OUT/perf.txt | grep -E "^ +[0-9]+ |rc=" | awk '{print $1, $6, $8, $9}'
done; }
for ph in $phases; do case $ph in
info)
  log info
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  nvidia-smi topo -m
  echo "NCCL=$NCCL NVRTC=$NVRTC SYSNCCL=$SYSNCCL"; ls -la $SYSNCCL; python3 -c 'import nvidia.nccl' && pip show nvidia-nccl-cu13 2>/dev/null | head -2
  which nvcc; nvcc --version | tail -2 ;;
build)
  log build nccl-tests
  mkdir -p /tmp/ncclh/lib && ln -sf $NCCL/lib/libnccl.so.2 /tmp/ncclh/lib/libnccl.so && ln -sfn $NCCL/include /tmp/ncclh/include
  CUDA_HOME=$(dirname $(dirname $(which nvcc)))
  (cd $D/nccl-tests && make -j16 MPI=0 BUILDDIR=$T NCCL_HOME=/tmp/ncclh CUDA_HOME=$CUDA_HOME NVCC_GENCODE="-gencode=arch=compute_90,code=sm_90" > $OUT/build.log 2>&1; echo "make rc=$?"; tail -3 $OUT/build.log)
  ls $T
  # NCCL's own choice here (channels, protocol) for the record.
  NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,TUNING,GRAPH run_nccl $T/broadcast_perf -g $NG -b 1G -e 1G -c 0 -n 2 -w 1 2>&1 | grep -iE "channel|nchannels|proto|algo|Ring" | sort | uniq -c | sort -rn | head -15 ;;
mpibuild)
  log build nccl-tests MPI=1
  # A MPI_HOME with include/ and lib/ from mpicc's own answers (distributions split them).
  MPI_HOME=/tmp/mpihome; mkdir -p $MPI_HOME
  ln -sfn "$(mpicc --showme:incdirs 2>/dev/null | awk '{print $1}')" $MPI_HOME/include
  ln -sfn "$(mpicc --showme:libdirs 2>/dev/null | awk '{print $1}')" $MPI_HOME/lib
  [ -e $MPI_HOME/include/mpi.h ] || ln -sfn "$(dirname "$(find / -name mpi.h -not -path '/proc/*' 2>/dev/null | head -1)")" $MPI_HOME/include
  echo "mpirun: $(which mpirun) mpicc: $(which mpicc)"; ls -la $MPI_HOME/; mpirun --version 2>&1 | head -2
  CUDA_HOME=$(dirname $(dirname $(which nvcc)))
  (cd $D/nccl-tests && make -j16 MPI=1 MPI_HOME=$MPI_HOME BUILDDIR=$TM NCCL_HOME=/tmp/ncclh CUDA_HOME=$CUDA_HOME NVCC_GENCODE="-gencode=arch=compute_90,code=sm_90" > $OUT/build-mpi.log 2>&1; echo "make rc=$?"; tail -3 $OUT/build-mpi.log)
  ls $TM ;;
smoke)
  log smoke ours g=$NG
  NCCL_DEBUG=INFO TMO=60 run_ours $T/all_reduce_perf -g $NG -b 8 -e 8M -f 8 -c 1 -n 5 -w 2 2>&1 | tail -40 ;;
rtest)
  # RTEST_ENV: settings for this run ("VAR=value ...", e.g. WEFT_ALGO=ll).
  # The GPU tests are #[ignore]d (CI has no GPU): --include-ignored runs them.
  # RTEST_SKIP: e.g. "--skip communicators_sharing_gpus" on a one-GPU machine.
  log rust GPU test $RTEST_ENV
  env $RTEST_ENV LD_LIBRARY_PATH=$OURS_LD timeout 240 $D/weft/cuda-test --include-ignored $RTEST_SKIP --nocapture --test-threads 1 2>&1 | tail -25; echo "rc=$?" ;;
coldstart)
  # A fresh process's init and first bf16/f32 all_reduce, with the kernels
  # from the build's cubins, its PTX (driver JIT, cache off) and NVRTC.
  for v in "" "CUDA_CACHE_DISABLE=1 WEFT_KERNEL_SOURCE=ptx" "WEFT_KERNEL_SOURCE=nvrtc"; do
    log cold start $v
    env $v LD_LIBRARY_PATH=$OURS_LD timeout 600 $D/weft/cold-start-test --ignored --nocapture 2>&1 | grep -E "cold start|panicked|test result"; echo "rc=$?"
  done ;;
rtestv)
  # The Rust GPU test with each broadcast algorithm forced and many small
  # pipeline steps / reduce chunks.
  for v in "WEFT_CUDA_BCAST=ring WEFT_CUDA_BCAST_STEP=4096 WEFT_CUDA_REDUCE_CHUNK=4096" \
           "WEFT_CUDA_BCAST=scatter WEFT_CUDA_BCAST_STEP=4096 WEFT_CUDA_BLOCKS=128"; do
    log rust GPU test $v
    LD_LIBRARY_PATH=$OURS_LD timeout 240 env $v $D/weft/cuda-test --include-ignored $RTEST_SKIP --nocapture --test-threads 1 2>&1 | tail -6; echo "rc=$?"
  done ;;
rtestc)
  # The Rust GPU test with every broadcast and reduce as a chain, in 4 KiB
  # steps through two slots (so senders wait for credits).
  log rust GPU test chain forced $CHAIN_ENV
  LD_LIBRARY_PATH=$OURS_LD timeout 240 env WEFT_CUDA_LINES=0 WEFT_CUDA_CHAIN_MIN_KB=0 WEFT_CUDA_CHAIN_STEP_KB=4 WEFT_CUDA_CHAIN_SLOTS=2 $CHAIN_ENV $D/weft/cuda-test --include-ignored $RTEST_SKIP --nocapture --test-threads 1 2>&1 | tail -8; echo "rc=$?" ;;
rtestl)
  # The Rust GPU test with every broadcast and reduce as a lines chain of
  # one block whose warps have two iterations in flight (senders wait for
  # credits all the time).
  log rust GPU test lines, one block, window 2
  LD_LIBRARY_PATH=$OURS_LD timeout 240 env WEFT_CUDA_LINES_MIN_KB=0 WEFT_CUDA_LINES_BLOCKS=1 WEFT_CUDA_LINES_WINDOW=2 $D/weft/cuda-test --include-ignored $RTEST_SKIP --nocapture --test-threads 1 2>&1 | tail -8; echo "rc=$?" ;;
chainquick)
  # Quick chain checks of one shape ($CHAIN_ENV): broadcast and reduce,
  # every type and op to 16 MB, one process.
  for t in broadcast reduce; do log check ours chain $t $CHAIN_ENV
    TMO=90 run_ours env WEFT_CUDA_LINES=0 WEFT_CUDA_CHAIN_MIN_KB=0 $CHAIN_ENV $T/${t}_perf -g $NG -b 8 -e 16M -f 8 -c 1 -n 1 -w 1 -d all -o all -r 1 2>&1 | tee -a $OUT/check.txt | CHK
  done ;;
rtest0)
  log rust GPU test WEFT_CUDA_DIRECT=0 $RTEST_ENV
  env WEFT_CUDA_DIRECT=0 $RTEST_ENV LD_LIBRARY_PATH=$OURS_LD timeout 240 $D/weft/cuda-test --include-ignored $RTEST_SKIP --nocapture --test-threads 1 2>&1 | tail -25; echo "rc=$?" ;;
check)
  # Every collective on 1, 2 and all GPUs, every type and op; unaligned odd sizes.
  for g in $(printf "%s\n" 1 2 $NG | sort -un); do [ $g -le $NG ] || continue
    for t in all_reduce all_gather reduce_scatter broadcast reduce alltoall sendrecv gather scatter; do
      log check ours $t g=$g
      TMO=120 run_ours $T/${t}_perf -g $g -b 8 -e 4M -f 8 -c 1 -n 2 -w 1 -d all -o all 2>&1 | tee -a $OUT/check.txt | CHK
    done
  done
  log check ours unaligned + odd sizes
  TMO=120 run_ours $T/all_reduce_perf -g $NG -b 7 -e 1000003 -f 13 -c 1 -n 2 -w 1 -d all -o all -u 1 2>&1 | tee -a $OUT/check.txt | CHK
  TMO=120 run_ours $T/reduce_scatter_perf -g $NG -b 12 -e 1000012 -f 13 -c 1 -n 2 -w 1 -d all -o sum -u 1 2>&1 | tee -a $OUT/check.txt | CHK
  TMO=120 run_ours $T/all_gather_perf -g $NG -b 12 -e 1000012 -f 13 -c 1 -n 2 -w 1 -d all -u 1 2>&1 | tee -a $OUT/check.txt | CHK ;;
checkg)
  # Chosen collectives (CHECK_COLLS) on GPU counts GS (default 2 3), every type and op.
  for g in ${GS:-2 3}; do [ $g -le $NG ] || continue
    for t in ${CHECK_COLLS:-broadcast reduce}; do
      log check ours $t g=$g
      TMO=120 run_ours $T/${t}_perf -g $g -b 8 -e 16M -f 8 -c 1 -n 2 -w 1 -d all -o all -r $((g - 1)) 2>&1 | tee -a $OUT/check.txt | CHK
    done
  done ;;
check9)
  for t in all_reduce all_gather reduce_scatter broadcast reduce alltoall sendrecv gather scatter; do
    log check ours $t g=$NG
    TMO=120 run_ours $T/${t}_perf -g $NG -b 8 -e 16M -f 8 -c 1 -n 2 -w 1 -d all -o all 2>&1 | tee -a $OUT/check.txt | CHK
  done
  for t in broadcast reduce gather scatter sendrecv; do
    log check ours $t root=3 unaligned odd g=$NG
    TMO=60 run_ours $T/${t}_perf -g $NG -b 12 -e 40000012 -f 13 -c 1 -n 2 -w 1 -d half -o sum -u 1 -r 3 2>&1 | tee -a $OUT/check.txt | CHK
  done ;;
chaincheck)
  # Broadcast and reduce as a chain at every size: every type and op, roots
  # 0 and 3, one process and one process per GPU, unaligned odd sizes.
  for r in 0 3; do for t in broadcast reduce; do
    log check ours chain $t root=$r
    TMO=90 run_ours env WEFT_CUDA_LINES=0 WEFT_CUDA_CHAIN_MIN_KB=0 $T/${t}_perf -g $NG -b 8 -e 64M -f 8 -c 1 -n 1 -w 1 -d all -o all -r $r 2>&1 | tee -a $OUT/check.txt | CHK
    TMO=60 run_ours env WEFT_CUDA_LINES=0 WEFT_CUDA_CHAIN_MIN_KB=0 WEFT_CUDA_CHAIN_SLOTS=2 $T/${t}_perf -g $NG -b 12 -e 400000012 -f 13 -c 1 -n 1 -w 1 -d half -o sum -u 1 -r $r 2>&1 | tee -a $OUT/check.txt | CHK
    log mpi check ours chain $t root=$r
    LD_LIBRARY_PATH=$OURS_LD WEFT_CUDA_LINES=0 WEFT_CUDA_CHAIN_MIN_KB=0 timeout 90 $MPIRUN -x WEFT_CUDA_CHAIN_MIN_KB -x WEFT_CUDA_LINES $TM/${t}_perf -g 1 -b 8 -e 64M -f 8 -c 1 -n 1 -w 1 -d all -o all -r $r 2>&1 | tee -a $OUT/mpi-check.txt | CHK
  done; done ;;
chainlite)
  # A shorter chaincheck (root 3; every type with sum, every op with float),
  # for a kernel change before the full one.
  for t in broadcast reduce; do
    log check ours chain $t root=3 $CHAIN_ENV
    TMO=90 run_ours env WEFT_CUDA_LINES=0 WEFT_CUDA_CHAIN_MIN_KB=0 $CHAIN_ENV $T/${t}_perf -g $NG -b 8 -e 64M -f 8 -c 1 -n 1 -w 1 -d all -o sum -r 3 2>&1 | tee -a $OUT/check.txt | CHK
    TMO=60 run_ours env WEFT_CUDA_LINES=0 WEFT_CUDA_CHAIN_MIN_KB=0 WEFT_CUDA_CHAIN_SLOTS=2 $CHAIN_ENV $T/${t}_perf -g $NG -b 12 -e 400000012 -f 13 -c 1 -n 1 -w 1 -d half -o sum -u 1 -r 3 2>&1 | tee -a $OUT/check.txt | CHK
    log mpi check ours chain $t root=3
    LD_LIBRARY_PATH=$OURS_LD WEFT_CUDA_LINES=0 WEFT_CUDA_CHAIN_MIN_KB=0 timeout 90 $MPIRUN -x WEFT_CUDA_CHAIN_MIN_KB -x WEFT_CUDA_LINES $TM/${t}_perf -g 1 -b 8 -e 64M -f 8 -c 1 -n 1 -w 1 -d float -o all -r 3 2>&1 | tee -a $OUT/mpi-check.txt | CHK
  done ;;
linescheck)
  # Broadcast and reduce as a lines chain at every size ($LINES_ENV on
  # top): every type and op, roots 0 and 3, unaligned odd sizes with small
  # windows, one process and one process per GPU.
  for r in 0 3; do for t in broadcast reduce; do
    log check ours lines $t root=$r $LINES_ENV
    TMO=90 run_ours env WEFT_CUDA_LINES_MIN_KB=0 $LINES_ENV $T/${t}_perf -g $NG -b 8 -e 64M -f 8 -c 1 -n 1 -w 1 -d all -o all -r $r 2>&1 | tee -a $OUT/check.txt | CHK
    TMO=60 run_ours env WEFT_CUDA_LINES_MIN_KB=0 WEFT_CUDA_LINES_WINDOW=2 $LINES_ENV $T/${t}_perf -g $NG -b 12 -e 400000012 -f 13 -c 1 -n 1 -w 1 -d half -o sum -u 1 -r $r 2>&1 | tee -a $OUT/check.txt | CHK
    log mpi check ours lines $t root=$r
    LD_LIBRARY_PATH=$OURS_LD WEFT_CUDA_LINES_MIN_KB=0 timeout 90 $MPIRUN -x WEFT_CUDA_LINES_MIN_KB $TM/${t}_perf -g 1 -b 8 -e 64M -f 8 -c 1 -n 1 -w 1 -d all -o all -r $r 2>&1 | tee -a $OUT/mpi-check.txt | CHK
  done; done ;;
linestune)
  # Broadcast and reduce from ${TB:-8} bytes to 2 GB, unchecked, NCCL first,
  # then each of LINES_VARIANTS: "on" (lines at every size), "off" (no
  # lines: the other algorithms), "bN" (lines, N blocks), "x:VAR=value[:...]"
  # (WEFT_CUDA_VAR settings on top of the defaults).
  P() { echo "### $1 $2 -g $NG" >> $OUT/tune.txt; log perf $1 $2; }
  pv() { P "ours[${2// /,}]" $1; TMO=90 run_ours env $2 $T/${1}_perf -g $NG -b ${TB:-8} -e 2G -f 4 -c 0 -n 10 -w 3 -d float 2>&1 | tee -a $OUT/tune.txt | grep -E "^ +[0-9]+ " | awk '{print $1, $6, $8}'; }
  for t in ${LT_COLLS:-broadcast reduce}; do
    P nccl $t; TMO=90 run_nccl $T/${t}_perf -g $NG -b ${TB:-8} -e 2G -f 4 -c 0 -n 10 -w 3 -d float 2>&1 | tee -a $OUT/tune.txt | grep -E "^ +[0-9]+ " | awk '{print $1, $6, $8}'
    for v in ${LINES_VARIANTS:-on off}; do
      case $v in
        on) e="WEFT_CUDA_LINES_MIN_KB=0 WEFT_CUDA_LINES_MAX_KB=100000000" ;;
        off) e="WEFT_CUDA_LINES=0" ;;
        b*) e="WEFT_CUDA_LINES_MIN_KB=0 WEFT_CUDA_LINES_MAX_KB=100000000 WEFT_CUDA_LINES_BLOCKS=${v#b}" ;;
        x:*) e="WEFT_DEFAULTS=1"; for x in $(echo ${v#x:} | tr : ' '); do e="$e WEFT_CUDA_$x"; done ;;
      esac
      pv $t "$e"
    done
  done ;;
bcastreduce)
  # Broadcast and reduce after a kernel change: checks (every type and op,
  # odd sizes, unaligned, roots 0 and 3, both broadcast algorithms) and the
  # side by side with NCCL.
  for r in 0 3; do
    log check ours broadcast root=$r; TMO=90 run_ours $T/broadcast_perf -g $NG -b 8 -e 512M -f 4 -c 1 -n 1 -w 1 -d all -r $r 2>&1 | tee -a $OUT/check.txt | CHK
    log check ours reduce root=$r; TMO=90 run_ours $T/reduce_perf -g $NG -b 8 -e 512M -f 4 -c 1 -n 1 -w 1 -d float -o all -r $r 2>&1 | tee -a $OUT/check.txt | CHK
    TMO=60 run_ours $T/reduce_perf -g $NG -b 8 -e 4M -f 8 -c 1 -n 1 -w 1 -d all -o all -r $r 2>&1 | tee -a $OUT/check.txt | CHK
    for t in broadcast reduce; do log check ours $t unaligned odd root=$r
      TMO=60 run_ours $T/${t}_perf -g $NG -b 12 -e 800000012 -f 13 -c 1 -n 1 -w 1 -d half -o sum -u 1 -r $r 2>&1 | tee -a $OUT/check.txt | CHK
    done
  done
  for t in broadcast reduce; do side $t -b 8 -e 2G -f 4; done ;;
mpicheck)
  # One process per GPU (as torchrun/mpirun run jobs): CUDA IPC between ranks.
  for t in ${CHECK_COLLS:-all_reduce all_gather reduce_scatter broadcast reduce alltoall sendrecv gather scatter}; do
    log mpi check ours $t np=$NG
    LD_LIBRARY_PATH=$OURS_LD timeout 60 $MPIRUN $TM/${t}_perf -g 1 -b 8 -e 16M -f 8 -c 1 -n 2 -w 1 -d all -o all 2>&1 | tee -a $OUT/mpi-check.txt | CHK
  done ;;
mpi)
  # One process per GPU, NCCL and Weft side by side (checked).
  for t in ${MPI_COLLS:-all_reduce all_gather broadcast reduce sendrecv}; do for who in nccl ours; do
    log mpi perf $who $t np=$NG; echo "### mpi $who $t np=$NG" >> $OUT/perf-mpi.txt
    if [ $who = ours ]; then L=$OURS_LD; else L=$SYS_LD; fi
    # MPI_ENV: WEFT_CUDA_* settings for our ranks ("VAR=value ...").
    X=""; for kv in $MPI_ENV; do X="$X -x $kv"; done
    LD_LIBRARY_PATH=$L timeout 60 $MPIRUN $X $TM/${t}_perf -g 1 -b 8 -e 1G -f 32 -c 1 -n 10 -w 3 -d float 2>&1 | tee -a $OUT/perf-mpi.txt | grep -E "^ +[0-9]+ |rc=" | awk '{print $1, $6, $8, $9}'
  done; done ;;
wbench)
  # weft bench --device cuda: one process per rank/GPU, results checked.
  for t in ${WBENCH_COLLS:-all_reduce all_gather reduce_scatter broadcast reduce alltoall sendrecv}; do
    log weft bench $t --device cuda -n $NG
    LD_LIBRARY_PATH=$NVRTC timeout 60 $D/weft/weft bench $t -n $NG -b 8 -e 256M -f 32 --check --device cuda -w 2 -i 10 2>&1 | tee -a $OUT/wbench.txt | tail -14
  done ;;
table)
  # The side-by-side tables of docs/PERFORMANCE-GPU.md (bench/gpu/table.py perf.txt).
  for t in ${TABLE_COLLS:-all_reduce all_gather reduce_scatter alltoall broadcast reduce}; do side $t -b 8 -e 2G -f 4; done ;;
perfp2p)
  for t in sendrecv gather scatter; do side $t -b 8 -e 2G -f 8; done ;;
lat)
  # Small-message latency, interleaved to cancel the machine's drift: NCCL,
  # Weft, and the build in weft-old/ (libnccl.so.2) if there is one, one
  # after the other, LAT_REPS times (default 3), for LAT_COLLS (default
  # broadcast sendrecv reduce_scatter), -n LAT_N (default 50); into lat.txt.
  # Mean per library: awk '/^###/{k=$2" "$3} /^ +[0-9]+ /{s[k]+=$6; n[k]++}
  # END{for (k in s) print k, s[k]/n[k]}' lat.txt
  for rep in $(seq ${LAT_REPS:-3}); do for t in ${LAT_COLLS:-broadcast sendrecv reduce_scatter}; do
    for who in nccl ours old; do
      case $who in nccl) L=$SYS_LD;; ours) L=$OURS_LD;; old) [ -e $D/weft-old/libnccl.so.2 ] || continue; L=$D/weft-old:$NVRTC;; esac
      echo "### $who $t rep $rep" >> $OUT/lat.txt
      LD_LIBRARY_PATH=$L timeout 60 $T/${t}_perf -g $NG -b 8 -e 64K -f 4 -c 1 -n ${LAT_N:-50} -w 10 -d float > $OUT/lat1.txt 2>&1
      cat $OUT/lat1.txt >> $OUT/lat.txt
      echo "$who $t rep $rep: $(awk '/^ +[0-9]+ /{printf "%s ", $6}' $OUT/lat1.txt)"
    done
  done; done; rm -f $OUT/lat1.txt ;;
mpilat)
  # One process per GPU, small messages (8 B - 1 MB), checked, interleaved:
  # NCCL, then Weft with each of MLAT_VARIANTS ("default" or
  # "VAR=value,VAR=value" of WEFT_CUDA_*; default: default, LL off, LL to
  # 256 KiB), MLAT_REPS times (default 2), MLAT_COLLS (default the six
  # collectives and sendrecv), -n MLAT_N (default 50); into mpilat.txt.
  # Means: awk '/^###/{k=$3" "$4} /^ +[0-9]+ /{s[k]+=$6; n[k]++}
  # END{for (k in s) print k, s[k]/n[k]}' mpilat.txt
  for rep in $(seq ${MLAT_REPS:-2}); do for t in ${MLAT_COLLS:-all_reduce all_gather reduce_scatter alltoall broadcast reduce sendrecv}; do
    for v in nccl ${MLAT_VARIANTS:-default WEFT_CUDA_LL_MAX_KB=0 WEFT_CUDA_LL_MAX_KB=256}; do
      if [ $v = nccl ]; then L=$SYS_LD; X=""; else L=$OURS_LD; X=""; [ $v = default ] || for kv in ${v//,/ }; do X="$X -x $kv"; done; fi
      echo "### rep$rep $t $v" >> $OUT/mpilat.txt
      LD_LIBRARY_PATH=$L timeout 60 $MPIRUN $X $TM/${t}_perf -g 1 -b 8 -e 1M -f 4 -c 1 -n ${MLAT_N:-50} -w 10 -d float > $OUT/mlat1.txt 2>&1
      cat $OUT/mlat1.txt >> $OUT/mpilat.txt
      echo "$t $v rep $rep: $(awk '/^ +[0-9]+ /{printf "%s ", $6} /^ +[0-9]+ / && ($9!="0" || ($13!="0" && $13!="N/A")) {w++} END{if (w) printf " WRONG rows %d", w}' $OUT/mlat1.txt) $(grep -m1 -iE 'error|rc=|abort' $OUT/mlat1.txt)"
    done
  done; done; rm -f $OUT/mlat1.txt ;;
tune)
  # Broadcast / reduce variants side by side with NCCL (32 MB - 2 GB,
  # unchecked). The defaults (no variable set) come first.
  P() { echo "### $1 $2 -g $NG" >> $OUT/tune.txt; log perf $1 $2; }
  pv() { P "ours[${2// /,}]" $1; TMO=60 run_ours env $2 $T/${1}_perf -g $NG -b 32M -e 2G -f 4 -c 0 -n 10 -w 3 -d float 2>&1 | tee -a $OUT/tune.txt | grep -E "^ +[0-9]+ " | awk '{print $1, $6, $8}'; }
  for t in broadcast reduce; do
    P nccl $t; TMO=60 run_nccl $T/${t}_perf -g $NG -b 32M -e 2G -f 4 -c 0 -n 10 -w 3 -d float 2>&1 | tee -a $OUT/tune.txt | grep -E "^ +[0-9]+ " | awk '{print $1, $6, $8}'
  done
  for v in "WEFT_DEFAULTS=1" "WEFT_CUDA_BCAST=ring" "WEFT_CUDA_BCAST=ring WEFT_CUDA_BLOCKS=128" "WEFT_CUDA_BCAST=ring WEFT_CUDA_BCAST_STEP=262144" \
           "WEFT_CUDA_BCAST=scatter" "WEFT_CUDA_BCAST=scatter WEFT_CUDA_BCAST_STEP=65536"; do
    pv broadcast "$v"
  done
  for v in "WEFT_DEFAULTS=1" "WEFT_CUDA_REDUCE_CHUNK=1048576" "WEFT_CUDA_REDUCE_CHUNK=65536"; do pv reduce "$v"; done ;;
chaintune)
  # Chain shapes for broadcast and reduce, NCCL first, 32 MB - 2 GB,
  # unchecked; each variant: "blocks:step KiB[:more VAR=value of WEFT_CUDA_*]",
  # chained at every size; "off" = the other algorithms; "x:VAR=value[:...]"
  # = the other algorithms with those WEFT_CUDA_* settings.
  P() { echo "### $1 $2 -g $NG" >> $OUT/tune.txt; log perf $1 $2; }
  pv() { P "ours[${2// /,}]" $1; TMO=60 run_ours env $2 $T/${1}_perf -g $NG -b ${TB:-32M} -e 2G -f 4 -c 0 -n 10 -w 3 -d float 2>&1 | tee -a $OUT/tune.txt | grep -E "^ +[0-9]+ " | awk '{print $1, $6, $8}'; }
  for t in broadcast reduce; do
    P nccl $t; TMO=60 run_nccl $T/${t}_perf -g $NG -b ${TB:-32M} -e 2G -f 4 -c 0 -n 10 -w 3 -d float 2>&1 | tee -a $OUT/tune.txt | grep -E "^ +[0-9]+ " | awk '{print $1, $6, $8}'
    for v in ${CHAIN_VARIANTS:-off 32:64 64:128 128:64}; do
      if [ $v = off ]; then pv $t "WEFT_CUDA_LINES=0 WEFT_CUDA_CHAIN_MIN_KB=1000000000"; continue; fi
      if [ "${v#x:}" != "$v" ]; then e="WEFT_CUDA_LINES=0 WEFT_CUDA_CHAIN_MIN_KB=1000000000"
        for x in $(echo ${v#x:} | tr : ' '); do e="$e WEFT_CUDA_$x"; done; pv $t "$e"; continue; fi
      IFS=: read -r nb st rest <<< "$v"
      e="WEFT_CUDA_LINES=0 WEFT_CUDA_CHAIN_MIN_KB=0 WEFT_CUDA_CHAIN_BLOCKS=$nb WEFT_CUDA_CHAIN_STEP_KB=$st"
      for x in ${rest//:/ }; do e="$e WEFT_CUDA_$x"; done
      pv $t "$e"
    done
  done ;;
share1)
  # One GPU shared by SHARE_NP ranks (default 2 3; Weft allows it, NCCL refuses):
  # one process per rank through mpirun, every rank on GPU 0
  # (NCCL_TESTS_DEVICE=0), every collective, type and op checked
  # (SHARE_ARGS replaces the sizes/types: ranks sharing a GPU take ~2.4 ms a
  # call today, so the full matrix takes minutes per collective).
  for np in ${SHARE_NP:-2 3}; do for t in ${CHECK_COLLS:-all_reduce all_gather reduce_scatter broadcast reduce alltoall sendrecv gather scatter}; do
    log share1 check ours $t np=$np
    LD_LIBRARY_PATH=$OURS_LD NCCL_TESTS_DEVICE=0 timeout 120 mpirun --allow-run-as-root --oversubscribe -np $np --bind-to none -x NCCL_NVLS_ENABLE -x WEFT_KERNEL_CACHE -x LD_LIBRARY_PATH -x NCCL_TESTS_DEVICE $TM/${t}_perf -g 1 -c 1 -n 2 -w 1 ${SHARE_ARGS:--b 8 -e 4M -f 8 -d all -o all} 2>&1 | tee -a $OUT/share-check.txt | CHK
  done; done ;;
sidecar)
  # Issue 30: small collectives with the pod's sidecar attached vs without,
  # side by side in one run (interleaved rounds, ROUNDS of them, default 5;
  # bench/sidecar_vs.py prints the medians and with/without). Both sides
  # run under `weft run` (same environment but the sidecar). Host memory,
  # 4 ranks; device memory: weft bench-rank --device cuda on every GPU, and
  # nccl-tests all_reduce_perf -g $NG in one process on our libnccl.so.2.
  # SIDECAR_HOST_NP ranks for host memory (default 4; the machine's cores
  # keep them apart), one rank per GPU for device memory. SIDECAR_SIDES:
  # which bench-rank sides (default "host cuda"; nccl-tests always runs).
  W=$D/weft/weft; VS="python3 $D/../sidecar_vs.py ${ROUNDS:-5}"
  export VS_PARTIAL=$OUT/sidecar-partial.md
  SZ="-b 8 -e 64K -f 2"
  for side in ${SIDECAR_SIDES:-host cuda}; do
    np=${SIDECAR_HOST_NP:-4}; [ $side = cuda ] && np=$NG
    log sidecar weft bench-rank $side n=$np
    $VS plain "env LD_LIBRARY_PATH=$OURS_LD $W run -n $np -- $W bench-rank all_reduce -n $np --device $side $SZ -i 5000 -w 200" \
      sidecar "env LD_LIBRARY_PATH=$OURS_LD $W run --sidecar -n $np -- $W bench-rank all_reduce -n $np --device $side $SZ -i 5000 -w 200" \
      2>&1 | tee -a $OUT/sidecar.txt
  done
  log sidecar nccl-tests all_reduce_perf -g $NG
  $VS plain "env LD_LIBRARY_PATH=$OURS_LD $W run -n 1 -- $T/all_reduce_perf -g $NG $SZ -n 2000 -w 50" \
    sidecar "env LD_LIBRARY_PATH=$OURS_LD $W run --sidecar -n 1 -- $T/all_reduce_perf -g $NG $SZ -n 2000 -w 50" \
    2>&1 | tee -a $OUT/sidecar.txt ;;
sidecarhost)
  # Issue 30, host memory only, at the noise floor: 4 ranks, 8 B - 64 KiB,
  # 10,000 calls a size after 10,000 warm-up calls (so the job's start is
  # behind every size), two interleaved pairs without/with the sidecar
  # (their difference shows the noise), ROUNDS of them (default 9); the
  # table so far in $OUT/sidecarhost-partial.md after every round.
  W=$D/weft/weft; B="$W bench-rank all_reduce -n 4 -b 8 -e 64K -f 2 -i 10000 -w 10000"
  log sidecarhost weft bench-rank host n=4
  VS_PARTIAL=$OUT/sidecarhost-partial.md python3 $D/../sidecar_vs.py ${ROUNDS:-9} \
    plain "$W run -n 4 -- $B" sidecar "$W run --sidecar -n 4 -- $B" \
    plain2 "$W run -n 4 -- $B" sidecar2 "$W run --sidecar -n 4 -- $B" \
    2>&1 | tee -a $OUT/sidecar.txt ;;
save)
  # Built nccl-tests binaries back to the caller (one file: carry it next time).
  (cd /tmp/nccl-tests && tar czf $OUT/ncclbin.tgz build/*_perf build-mpi/*_perf 2>/dev/null); ls -la $OUT/ncclbin.tgz ;;
unsave)
  [ -e $D/ncclbin.tgz ] && (mkdir -p /tmp/nccl-tests && cd /tmp/nccl-tests && tar xzf $D/ncclbin.tgz) && ls $T $TM ;;
*)
  echo "unknown phase: $ph" ;;
esac; done
