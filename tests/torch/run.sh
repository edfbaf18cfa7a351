#!/bin/bash
# The PyTorch end-to-end suite on a GPU machine, against Weft's libnccl.so.2.
#
# Usage: tests/torch/run.sh [--lib LIBNCCL] [--weft WEFT] [STEP...]   (from anywhere)
#   STEPs (default: info weft torchrun kill kill-watchdog):
#     info            GPUs, torch, which libnccl torch loads with LD_PRELOAD / LD_LIBRARY_PATH
#     weft            weft run -n $NPROC -- python suite.py (weft run preloads the
#                     libnccl.so.2 beside it, or WEFT_PRELOAD=$WEFT_LIB)
#     torchrun        LD_PRELOAD=$WEFT_LIB torchrun --nproc-per-node $NPROC suite.py
#     torchrun-lazy   the same with --lazy-init (no device_id: per-pair p2p communicators,
#                     one ncclCommInitRank per group instead of ncclCommSplit)
#     weft-lazy       weft run with --lazy-init
#     kill            kill_test.py --mode blocking (TORCH_NCCL_BLOCKING_WAIT=1: a Python exception)
#     kill-watchdog   kill_test.py --mode watchdog (torch's defaults: the process ends)
#     gloo            the suite with --backend gloo on CPU (the test logic, no library involved)
#     resilient       resilient_train.py --drive: $RES_NPROC ranks under `weft run`, a failure-free
#                     run, then one where rank RES_NPROC-1 SIGKILLs itself mid-training under
#                     `weft run --replace-failed`: the survivors shrink_group (ncclCommShrink),
#                     redo the step, grow back with the replacement; final weights must match
#     resilient-gloo  the same with --backend gloo on CPU (the recovery logic; the shrink is a
#                     new group of the survivors, not shrink_group; no library involved)
#     coldstart       coldstart.py three times: init + first bf16/fp32 all_reduce of fresh processes,
#                     Weft (empty kernel cache; NPROC ranks and as many as NCCL runs) and NCCL
#     suite-cold      the suite with an empty kernel cache, then again warm (seconds of each);
#                     SUITE_LAUNCH=weft runs it under weft run (MPS when ranks share a GPU)
#     ddp             ddp_step.py: a DDP step of a ~400M-parameter transformer, NCCL and Weft
#                     alternately, one rank per GPU (DDP_ARGS: e.g. "--layers 8")
#     stalls          stalls.py under `weft run -n $NPROC` (Weft; MPS when ranks share a GPU):
#                     1,000 individually timed all_reduce / all_gather / reduce_scatter calls
#                     per size, p50/p99/max; one table of this run's stalls steps in
#                     $LOG_DIR/stalls.tsv, printed at the end
#     stalls-nccl     the same with torch's own NCCL under torchrun, when every rank has a
#                     GPU of its own (NCCL refuses two ranks on one GPU: otherwise a row says so)
# Environment (or the defaults):
#   WEFT_LIB   our libnccl.so.2 (--lib)  (bench/gpu/weft/libnccl.so.2)
#   WEFT_BIN   the weft binary (--weft)  (bench/gpu/weft/weft)
#   LOG_DIR    where logs go             (/tmp/weft-torch-logs); one <step>.log each, summary.txt (appended)
#   NPROC      ranks                     (2); with one GPU they all share GPU 0
#   PYTHON     python with torch 2.11    (python3)
#   STEP_TIMEOUT  seconds per step       (540); every run is bounded by `timeout`
#   SUITE_ARGS extra suite.py arguments  (e.g. "--only all_reduce,p2p --trace")
#   KILL_TIMEOUT  the kill test's collective timeout in seconds (20)
#   RES_NPROC  ranks of the resilient steps (4); RES_ARGS extra resilient_train.py arguments
#              (e.g. "--kill-step 7 --steps 30"); RES_RUN_TIMEOUT  seconds per weft run (120)
#   STALLS_ARGS extra stalls.py arguments (e.g. "--iters 200 --sizes 8,4096")
# Exit status: 0 when every step passed, else 1.
#
# With one GPU, ranks share it (Weft allows several ranks per GPU; NCCL does
# not); suite.py picks cuda:(LOCAL_RANK % device count).
set -u
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
HERE=$ROOT/tests/torch
WEFT_LIB=${WEFT_LIB:-$ROOT/bench/gpu/weft/libnccl.so.2}
WEFT_BIN=${WEFT_BIN:-$ROOT/bench/gpu/weft/weft}
while [ $# -gt 0 ]; do
  case $1 in
    --lib) WEFT_LIB=$2; shift 2 ;;
    --weft) WEFT_BIN=$2; shift 2 ;;
    -h|--help) sed -n '2,46p' "$0"; exit 0 ;;
    *) break ;;
  esac
done
LOG_DIR=${LOG_DIR:-/tmp/weft-torch-logs}
NPROC=${NPROC:-2}
PYTHON=${PYTHON:-python3}
STEP_TIMEOUT=${STEP_TIMEOUT:-540}
SUITE_ARGS=${SUITE_ARGS:-}
KILL_TIMEOUT=${KILL_TIMEOUT:-20}
RES_NPROC=${RES_NPROC:-4}
RES_ARGS=${RES_ARGS:-}
DDP_ARGS=${DDP_ARGS:-}
RES_RUN_TIMEOUT=${RES_RUN_TIMEOUT:-120}
STALLS_ARGS=${STALLS_ARGS:-}
steps="${*:-info weft torchrun kill kill-watchdog}"

# Multicast (NVLS) stays off on the lent machines.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export WEFT_KERNEL_CACHE=${WEFT_KERNEL_CACHE:-/tmp/weft-kernels}
export PYTHONUNBUFFERED=1

mkdir -p "$LOG_DIR"
SUMMARY=$LOG_DIR/summary.txt
echo "--- run.sh $steps (NPROC=$NPROC, $(date -u +%FT%TZ))" >>"$SUMMARY"
WEFT_LIB=$(realpath "$WEFT_LIB" 2>/dev/null || echo "$WEFT_LIB")
[ -f "$WEFT_LIB" ] || { echo "run.sh: no library at WEFT_LIB=$WEFT_LIB"; exit 2; }

# Weft compiles its kernels with NVRTC at run time: use the one torch's
# wheels install (nvidia/cu13/lib), else any libnvrtc.so.13 on the machine.
NVRTC=$($PYTHON - <<'EOF' 2>/dev/null
import glob, os, site
for d in site.getsitepackages() + [site.getusersitepackages()]:
    for f in glob.glob(os.path.join(d, "nvidia", "*", "lib", "libnvrtc.so.1*")) + glob.glob(os.path.join(d, "nvidia", "cuda_nvrtc", "lib", "libnvrtc.so.1*")):
        print(os.path.dirname(f)); raise SystemExit
EOF
)
[ -n "$NVRTC" ] || NVRTC=$(dirname "$(find / -name 'libnvrtc.so.13*' -not -path '/proc/*' 2>/dev/null | head -1)" 2>/dev/null)
export LD_LIBRARY_PATH="${NVRTC:+$NVRTC:}${LD_LIBRARY_PATH:-}"

log() { echo "=== $* ($(date -u +%T))"; }
failed=0
# record STEP RC LOG: one line per step in summary.txt
record() {
  local s=$1 rc=$2 f=$3 last
  last=$(grep -E '^(\[ ?0\] )?SUMMARY: (kill_test|resilient|stalls|[0-9]+ passed)' "$f" | tail -1)
  [ "$rc" = 0 ] || failed=1
  echo "$s: rc=$rc ${last:-no summary line (see $f)}" | tee -a "$SUMMARY"
}

TO="timeout -k 15 $STEP_TIMEOUT"
# The stalls steps of this run fill one table.
[[ " $steps " == *" stalls"* ]] && rm -f "$LOG_DIR/stalls.tsv"
SUITE="$HERE/suite.py --expect-nccl $WEFT_LIB $SUITE_ARGS"

for s in $steps; do
  f=$LOG_DIR/$s.log
  log "$s -> $f"
  case $s in
    info)
      {
        nvidia-smi -L 2>&1 || echo "no nvidia-smi"
        echo "WEFT_LIB=$WEFT_LIB WEFT_BIN=$WEFT_BIN NPROC=$NPROC NVRTC=$NVRTC"
        for how in LD_PRELOAD LD_LIBRARY_PATH; do
          d=$(mktemp -d); ln -s "$WEFT_LIB" "$d/libnccl.so.2"
          if [ $how = LD_PRELOAD ]; then e="LD_PRELOAD=$WEFT_LIB"; else e="LD_LIBRARY_PATH=$d:$LD_LIBRARY_PATH"; fi
          echo "--- import torch with $how"
          env "$e" timeout 120 "$PYTHON" -c "
import sys; sys.path.insert(0, '$HERE')
import torch
from common import loaded_nccl
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'GPUs', torch.cuda.device_count())
print('torch.cuda.nccl.version()', torch.cuda.nccl.version())
print('libnccl loaded:', loaded_nccl())
" 2>&1 | tail -5
          rm -rf "$d"
        done
      } >"$f" 2>&1
      rc=0; grep -q "torch.cuda.nccl.version" "$f" || rc=1
      cat "$f"; [ $rc = 0 ] || failed=1
      echo "info: rc=$rc" >>"$SUMMARY"
      continue ;;
    weft)
      WEFT_PRELOAD="$WEFT_LIB" $TO "$WEFT_BIN" run -n "$NPROC" --timeout $((STEP_TIMEOUT - 10)) -- "$PYTHON" $SUITE >"$f" 2>&1 ;;
    weft-lazy)
      WEFT_PRELOAD="$WEFT_LIB" $TO "$WEFT_BIN" run -n "$NPROC" --timeout $((STEP_TIMEOUT - 10)) -- "$PYTHON" $SUITE --lazy-init >"$f" 2>&1 ;;
    torchrun)
      LD_PRELOAD="$WEFT_LIB" $TO "$PYTHON" -m torch.distributed.run --nproc-per-node "$NPROC" $SUITE >"$f" 2>&1 ;;
    torchrun-lazy)
      LD_PRELOAD="$WEFT_LIB" $TO "$PYTHON" -m torch.distributed.run --nproc-per-node "$NPROC" $SUITE --lazy-init >"$f" 2>&1 ;;
    kill)
      LD_PRELOAD="$WEFT_LIB" $TO "$PYTHON" "$HERE/kill_test.py" --nproc "$NPROC" --mode blocking --pg-timeout-s "$KILL_TIMEOUT" >"$f" 2>&1 ;;
    kill-watchdog)
      LD_PRELOAD="$WEFT_LIB" $TO "$PYTHON" "$HERE/kill_test.py" --nproc "$NPROC" --mode watchdog --pg-timeout-s "$KILL_TIMEOUT" >"$f" 2>&1 ;;
    gloo)
      $TO "$PYTHON" -m torch.distributed.run --nproc-per-node "$NPROC" "$HERE/suite.py" --backend gloo $SUITE_ARGS >"$f" 2>&1 ;;
    resilient)
      WEFT_PRELOAD="$WEFT_LIB" $TO "$PYTHON" "$HERE/resilient_train.py" --drive --weft "$WEFT_BIN" --nproc "$RES_NPROC" \
        --backend nccl --expect-nccl "$WEFT_LIB" --run-timeout-s "$RES_RUN_TIMEOUT" --log-dir "$LOG_DIR" $RES_ARGS >"$f" 2>&1 ;;
    coldstart)
      # init + first bf16/fp32 all_reduce of fresh processes: Weft with an
      # empty kernel cache, then NCCL (torch's own libnccl) on the same GPUs.
      # NCCL refuses two ranks on one GPU: it runs min(NPROC, GPUs) ranks.
      ngpu=$(nvidia-smi -L 2>/dev/null | wc -l); nn=$(( NPROC < ngpu ? NPROC : ngpu ))
      {
        for i in 1 2 3; do
          c=$(mktemp -d); for n in $(printf "%s\n" $nn $NPROC | sort -un); do
            WEFT_KERNEL_CACHE=$c/$n LD_PRELOAD="$WEFT_LIB" $TO "$PYTHON" -m torch.distributed.run --nproc-per-node $n "$HERE/coldstart.py"
          done; rm -rf "$c"
          $TO "$PYTHON" -m torch.distributed.run --nproc-per-node $nn "$HERE/coldstart.py"
        done
      } >"$f" 2>&1 ;;
    ddp)
      # A DDP step of a ~400M-parameter transformer (ddp_step.py), NCCL and
      # Weft alternately, twice each, one rank per GPU (min(NPROC, GPUs)).
      ngpu=$(nvidia-smi -L 2>/dev/null | wc -l); nn=$(( NPROC < ngpu ? NPROC : ngpu ))
      for i in 1 2; do
        $TO "$PYTHON" -m torch.distributed.run --nproc-per-node $nn "$HERE/ddp_step.py" $DDP_ARGS
        LD_PRELOAD="$WEFT_LIB" $TO "$PYTHON" -m torch.distributed.run --nproc-per-node $nn "$HERE/ddp_step.py" $DDP_ARGS
      done >"$f" 2>&1 ;;
    suite-cold)
      # The suite on a fresh machine (empty kernel cache) and again warm:
      # the seconds of each, for "fresh within 1.2x of warm".
      c=$(mktemp -d)
      for pass in cold warm; do
        t0=$(date +%s.%N)
        if [ "${SUITE_LAUNCH:-torchrun}" = weft ]; then   # weft run: MPS when ranks share a GPU
          WEFT_KERNEL_CACHE=$c WEFT_PRELOAD="$WEFT_LIB" $TO "$WEFT_BIN" run -n "$NPROC" --timeout $((STEP_TIMEOUT - 10)) -- "$PYTHON" $SUITE >"$f.$pass" 2>&1
        else
          WEFT_KERNEL_CACHE=$c LD_PRELOAD="$WEFT_LIB" $TO "$PYTHON" -m torch.distributed.run --nproc-per-node "$NPROC" $SUITE >"$f.$pass" 2>&1
        fi
        rc=$?; t1=$(date +%s.%N)
        echo "SUITE-TIME $pass rc=$rc seconds=$(awk "BEGIN{printf \"%.1f\", $t1 - $t0}") $(grep -E 'SUMMARY' "$f.$pass" | tail -1)"
        [ $rc = 0 ] || break
      done >"$f" 2>&1
      rm -rf "$c"
      grep SUITE-TIME "$f"; (exit $rc) ;;
    resilient-gloo)
      WEFT_PRELOAD=off $TO "$PYTHON" "$HERE/resilient_train.py" --drive --weft "$WEFT_BIN" --nproc "$RES_NPROC" \
        --backend gloo --run-timeout-s "$RES_RUN_TIMEOUT" --log-dir "$LOG_DIR" $RES_ARGS >"$f" 2>&1 ;;
    stalls)
      WEFT_PRELOAD="$WEFT_LIB" $TO "$WEFT_BIN" run -n "$NPROC" --timeout $((STEP_TIMEOUT - 10)) -- \
        "$PYTHON" "$HERE/stalls.py" --label weft --out "$LOG_DIR/stalls.tsv" $STALLS_ARGS >"$f" 2>&1 ;;
    stalls-nccl)
      ngpu=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
      if [ "$NPROC" -gt "$ngpu" ]; then
        echo "stalls: nccl: not run: $NPROC ranks on $ngpu GPU(s), and NCCL refuses two ranks on one GPU" | tee "$f"
        printf 'nccl\t%s\t-\t-\tnot run: %s ranks on %s GPU(s) (NCCL refuses two ranks on one GPU)\n' \
          "$NPROC" "$NPROC" "$ngpu" >>"$LOG_DIR/stalls.tsv"
        echo "$s: rc=0 not run ($NPROC ranks, $ngpu GPUs)" >>"$SUMMARY"
        continue
      fi
      $TO "$PYTHON" -m torch.distributed.run --nproc-per-node "$NPROC" "$HERE/stalls.py" --label nccl \
        --out "$LOG_DIR/stalls.tsv" $STALLS_ARGS >"$f" 2>&1 ;;
    *)
      echo "run.sh: unknown step '$s'"; failed=1; continue ;;
  esac
  rc=$?
  [ $rc = 124 ] && echo "run.sh: step $s stopped by timeout after ${STEP_TIMEOUT}s" >>"$f"
  grep -E '^(\[ ?[0-9]+\] )?(FAIL|SUMMARY|PASS (kill_test|resilient)|suite: |resilient: |stalls: |COLDSTART|SUITE-TIME|DDP )' "$f" | head -60
  record "$s" $rc "$f"
done
if [ -f "$LOG_DIR/stalls.tsv" ] && [[ " $steps " == *" stalls"* ]]; then
  log "stalls table ($LOG_DIR/stalls.tsv)"
  column -t -s $'\t' "$LOG_DIR/stalls.tsv" 2>/dev/null || cat "$LOG_DIR/stalls.tsv"
fi
log "summary (appended to $SUMMARY)"
sed -n '/^--- run.sh/h; /^--- run.sh/!H; ${x;p}' "$SUMMARY"
exit $failed
