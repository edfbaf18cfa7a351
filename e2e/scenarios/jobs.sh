# Jobs run to their end: the benchmark example (through the sidecars' proxy
# and over direct TCP), an unmodified NCCL C program, and a whole-job
# restart when a pod is deleted.

# bench_example NAME TRANSPORT [engine]: examples/bench-allreduce.yaml under
# NAME with network.transport TRANSPORT, to Succeeded, with its status and its
# table checked (one table, from rank 0's pod; every rank on its own pod;
# every result checked, none wrong), and which path the ranks' bytes took.
# With `engine`, all-reduces from 64 KiB run on the cross-host engine with
# its bytes through the sidecars' proxy (WEFT_CROSSHOST_NET=proxy), which
# every rank must say (WEFT_DEBUG=INFO: its log lines are left out of the
# table's checks).
bench_example() {
  local job=$1 transport=$2 engine=${3:-} t0 env_edit=""
  CURRENT_JOB=$job
  t0=$(now_ms)
  if [[ $engine == engine ]]; then
    env_edit='s/^        - name: bench$/        - name: bench\n          env: [{name: WEFT_CROSSHOST_NET, value: proxy}, {name: WEFT_CROSSHOST_MIN_BYTES, value: "65536"}, {name: WEFT_DEBUG, value: INFO}]/'
  fi
  apply "$ROOT/examples/bench-allreduce.yaml" "s/^  name: bench-allreduce$/  name: $job/" \
    "s/^    transport: auto$/    transport: $transport/" ${env_edit:+"$env_edit"}
  wait_phase $job Succeeded 600
  log "$job Succeeded $(($(now_ms) - t0)) ms after it was applied"
  check $job '.status.worldSize == 4' '.status.ranks | length == 2' '.status.ranks[1].firstRank == 2' \
    ".status.bootstrapEndpoint == \"$job-0.$job.$NS.svc:29400\"" '.status.completionTime != null' \
    '.status.ready == "0/2"' '.status.restarts == 0' \
    '[.status.conditions[] | select(.type=="Succeeded" and .status=="True")] | length == 1'
  [[ $(events $job PodsCreated) -ge 1 ]] || fail "no PodsCreated event"
  local table rows r full
  full=$(kubectl -n "$NS" logs $job-0 -c bench)
  table=$(grep -vE ' weft (INFO|WARN|TRACE) ' <<<"$full")
  grep -q '^# nRanks 4 ' <<<"$table" || fail "not a 4-rank table: $table"
  [[ $(grep -c 'Collective test starting' <<<"$table") == 1 ]] || fail "not one table: $table"
  for r in 0 1 2 3; do
    grep -qE "^#  Rank  $r .* on +$job-$((r / 2)) " <<<"$table" || fail "rank $r not on pod $((r / 2)): $table"
  done
  grep -q '^# Out of bounds values : 0 OK$' <<<"$table" || fail "wrong values: $table"
  rows=$(grep -v '^#' <<<"$table" | grep -c .)
  [[ $rows == "$(bench_rows)" ]] || fail "$rows rows, not $(bench_rows): $table"
  kubectl -n "$NS" logs $job-1 -c bench | grep -q 'ranks 2..3 of 4 finished, no wrong values' \
    || fail "pod 1 did not report its ranks: $(kubectl -n "$NS" logs $job-1 -c bench)"
  sed 's/^/    /' <<<"$table"
  if [[ $engine == engine ]]; then
    local said p
    for p in 0 1; do
      said=$(kubectl -n "$NS" logs $job-$p -c bench | grep 'run on the cross-host engine' || true)
      [[ $(grep -c 'between hosts through the sidecar proxy' <<<"$said") == 2 ]] \
        || fail "pod $p: its 2 ranks did not say they run on the engine through the proxy: $said"
    done
    log "the engine through the proxy: $(head -1 <<<"$said")"
  fi
  # Which path: the sidecars' proxy connects hosts only for ranks' traffic.
  local sc; sc=$(kubectl -n "$NS" logs $job-0 -c weft-sidecar)
  if [[ $transport == auto ]]; then
    grep -q 'proxy: connected to host' <<<"$sc" || fail "no proxy connection with transport auto: $sc"
    log "through the proxy: $(grep -m1 'proxy: connected to host' <<<"$sc")"
  else
    ! grep -q 'proxy: connected to host' <<<"$sc" || fail "the proxy carried transport $transport's traffic: $sc"
  fi
  no_sidecar_deaths $job
  delete_job $job
}

# Rows of the example's table: its sizes from -b to -e by -f (the command
# is one line of the manifest).
bench_rows() {
  local words min max f n=0 s
  words=" $(grep -m1 'command: \["weft", "bench"' "$ROOT/examples/bench-allreduce.yaml" | tr -d '[]",' | sed 's/.*command://') "
  bytes() { local v=${1%[KMG]}; case $1 in *K) echo $((v << 10)) ;; *M) echo $((v << 20)) ;; *G) echo $((v << 30)) ;; *) echo "$v" ;; esac; }
  min=$(bytes "$(sed -n 's/.* -b \([^ ]*\) .*/\1/p' <<<"$words")")
  max=$(bytes "$(sed -n 's/.* -e \([^ ]*\) .*/\1/p' <<<"$words")")
  f=$(sed -n 's/.* -f \([^ ]*\) .*/\1/p' <<<"$words")
  for ((s = min; s <= max; s *= f)); do n=$((n + 1)); done
  echo $n
}

scenario_bench_proxy() { bench_example bench-proxy auto; }
scenario_bench_tcp() { bench_example bench-tcp tcp; }
scenario_bench_engine_proxy() { bench_example bench-engine-proxy auto engine; }

# The benchmark example on 3 pods x 2 ranks with all-reduces from 64 KiB on
# the cross-host engine and WEFT_CROSSHOST_MAX_PEERS=2: each rank has 4
# remote ranks, more than 2, so its engine connects to its rail only (the
# rank of the same local index in each other pod) and runs on rails. The
# table checked (6 ranks, none wrong), every rank saying how it connected.
scenario_bench_engine_rails() {
  local job=bench-engine-rails t0 full table p said
  CURRENT_JOB=$job
  t0=$(now_ms)
  apply "$ROOT/examples/bench-allreduce.yaml" "s/^  name: bench-allreduce$/  name: $job/" \
    "s/^  replicas: 2$/  replicas: 3/" \
    's/^        - name: bench$/        - name: bench\n          env: [{name: WEFT_CROSSHOST_MAX_PEERS, value: "2"}, {name: WEFT_CROSSHOST_MIN_BYTES, value: "65536"}, {name: WEFT_DEBUG, value: INFO}]/'
  wait_phase $job Succeeded 600
  log "$job Succeeded $(($(now_ms) - t0)) ms after it was applied"
  check $job '.status.worldSize == 6' '.status.ranks | length == 3' '.status.restarts == 0'
  full=$(kubectl -n "$NS" logs $job-0 -c bench)
  table=$(grep -vE ' weft (INFO|WARN|TRACE) ' <<<"$full")
  grep -q '^# nRanks 6 ' <<<"$table" || fail "not a 6-rank table: $table"
  grep -q '^# Out of bounds values : 0 OK$' <<<"$table" || fail "wrong values: $table"
  sed 's/^/    /' <<<"$table"
  for p in 0 1 2; do
    said=$(kubectl -n "$NS" logs $job-$p -c bench | grep 'run on the cross-host engine' || true)
    [[ $(grep -c 'to 2 remote rank(s): its rail only' <<<"$said") == 2 ]] \
      || fail "pod $p: its 2 ranks did not say they reach their rail only: $said"
  done
  log "rails only: $(head -1 <<<"$said")"
  no_sidecar_deaths $job
  delete_job $job
}

# libcomm/capi/tests/c/dropin.c, a program written for NVIDIA's NCCL
# (<nccl.h>, -lnccl, ncclGetUniqueId + ncclCommInitRank from RANK and
# WORLD_SIZE), on 2 pods x 2 ranks with Weft's libnccl.so.2.
scenario_nccl_c() {
  local job=e2e-nccl p
  CURRENT_JOB=$job
  apply "$ROOT/e2e/nccl-dropin.yaml"
  wait_phase $job Succeeded 300
  check $job '.status.worldSize == 4' '.status.restarts == 0'
  for p in 0 1; do
    [[ $(kubectl -n "$NS" logs $job-$p -c main | grep -c 'dropin ok') == 2 ]] \
      || fail "pod $p: $(kubectl -n "$NS" logs $job-$p -c main)"
  done
  log "4 ranks of an unmodified NCCL program: $(kubectl -n "$NS" logs $job-0 -c main | head -1)"
  no_sidecar_deaths $job
  delete_job $job
}

# A pod deleted from a running job: the operator restarts the whole job.
scenario_restart() {
  local job=e2e-restart t0 epochs
  CURRENT_JOB=$job
  t0=$(now_ms)
  apply "$ROOT/e2e/restart-job.yaml"
  wait_phase $job Running 300
  log "$job Running (its 2 pods started, sidecars ready) $(($(now_ms) - t0)) ms after it was applied"
  t0=$(now_ms)
  kubectl -n "$NS" delete pod $job-1 --wait=false >/dev/null
  kubectl -n "$NS" wait cjob/$job --for=jsonpath='{.status.restarts}'=1 --timeout=120s >/dev/null \
    || fail "no restart after a pod was deleted"
  wait_phase $job Running 300
  log "Running again $(($(now_ms) - t0)) ms after the pod was deleted"
  check $job '.status.restartEpoch == 1' '.status.lastFailure.pod == "e2e-restart-1"' \
    '.status.lastFailure.reason == "PodDeleted"'
  epochs=$(kubectl -n "$NS" get pods -l weft.dev/job-name=$job -o jsonpath='{.items[*].metadata.labels.weft\.dev/restart-epoch}')
  [[ "$epochs" == "1 1" ]] || fail "pods not all of epoch 1: $epochs"
  [[ $(events $job RankFailed) -ge 1 ]] || fail "no RankFailed event"
  delete_job $job
}
