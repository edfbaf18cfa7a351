# onRankFailure: ReplaceRank with examples/replace-rank.yaml (4 pods x 1
# rank of resilient-train): a rank that kills itself, and a pod deleted
# from outside. Only the failed pod is replaced, the survivors shrink and go
# on, grow back when the replacement joins, and the final weights are those
# of a run that lost nothing. Timed: from the loss to the survivors
# computing again (their `@ shrunk`) and to full size (`@ grown`).

# train_job NAME ARGS: the example under NAME, resilient-train given ARGS
# (a JSON list's items, e.g. "600", "--step-ms=100").
train_job() {
  apply "$ROOT/examples/replace-rank.yaml" "s/^  name: replace-rank$/  name: $1/" \
    "s|\"resilient-train\", .*\\]\$|\"resilient-train\", $2]|"
}

# The weights of a run without failure of STEPS steps (no pauses: seconds),
# run once per e2e run: printed, and kept in $RUN_DIR/train-ref-STEPS.w.
reference_weights() {
  local job=train-ref-$1 w
  CURRENT_JOB=$job
  if [[ ! -s "$RUN_DIR/$job.w" ]]; then
    train_job $job "\"$1\""
    wait_phase $job Succeeded 300
    w=$(facts $job-0 train final)
    [[ -n "$w" ]] || fail "$job printed no final weights"
    echo "$w" >"$RUN_DIR/$job.w"
    log "$job, without failure: $w"
    no_sidecar_deaths $job
    delete_job $job
  fi
}

# check_recovered JOB LOST_POD T_LOSS_MS REF_WEIGHTS SURVIVOR_UIDS: the
# replacement and the survivors after the job Succeeded.
check_recovered() {
  local job=$1 lost=$2 t_loss=$3 ref=$4 survivors=$5 p shrunk=0 grown=0 t w
  wait_phase $job Succeeded 600
  check $job '.status.replacements == 1' '.status.restarts == 0' \
    ".status.recoveries[0].pod == \"$lost\"" '.status.recoveries[0].state == "Recovered"'
  [[ "$(kubectl -n "$NS" get pod $lost -o jsonpath='{.metadata.labels.weft\.dev/incarnation}')" == 1 ]] \
    || fail "$lost is not incarnation 1"
  for p in $survivors; do
    [[ " $(pod_uids $job) " == *" $p "* ]] || fail "survivor ${p%%=*} was recreated"
  done
  for p in $(pod_names $job); do
    w=$(facts $p train final)
    [[ "$w" == "$ref" ]] || fail "$p: final weights $w, not those of the run without failure $ref"
    facts $p train steps | grep -q 'size=4' || fail "$p did not end at full size: $(facts $p train steps)"
    [[ $p == "$lost" ]] && continue
    # The latest survivor to compute again / to be back at full size.
    t=$(field "$(facts $p train shrunk | head -1)" t); [[ -n $t ]] || fail "$p never shrank"
    ((t > shrunk)) && shrunk=$t
    t=$(field "$(facts $p train grown | tail -1)" t); [[ -n $t ]] || fail "$p never grew back"
    ((t > grown)) && grown=$t
  done
  facts $lost train joined | grep -q . || fail "the replacement did not join the running job"
  log "$lost lost -> survivors computing again at 3 ranks: $((shrunk - t_loss)) ms; -> full size 4 again: $((grown - t_loss)) ms; operator: replacement Ready $(job_json $job | jq '.status.recoveries[0].timeLostSeconds') s after it saw the failure"
  log "final weights of every pod equal the run without failure"
}

# Rank 2 SIGKILLs itself at step 200 of 600 (50 ms a step).
scenario_replace_kill() {
  local ref job=replace-kill survivors t_kill
  reference_weights 600
  ref=$(cat "$RUN_DIR/train-ref-600.w")
  CURRENT_JOB=$job
  train_job $job '"600", "kill", "2", "200", "--step-ms=50"'
  wait_phase $job Running 300
  survivors=$(pod_uids $job | tr ' ' '\n' | grep -v "^$job-2=" | tr '\n' ' ')
  # The victim's own log goes with its pod: follow it until it dies.
  kubectl -n "$NS" logs -f $job-2 -c train >"$RUN_DIR/$job-victim.log" 2>&1 &
  local follower=$!
  kubectl -n "$NS" wait cjob/$job --for=jsonpath='{.status.replacements}'=1 --timeout=120s >/dev/null \
    || fail "rank 2 was not replaced"
  wait "$follower" 2>/dev/null || true
  t_kill=$(field "$(facts_in kill <"$RUN_DIR/$job-victim.log" | head -1)" t)
  [[ -n $t_kill ]] || fail "the victim did not report its kill: $(cat "$RUN_DIR/$job-victim.log")"
  check_recovered $job $job-2 "$t_kill" "$ref" "$survivors"
  delete_job $job
}

# The example as it is; its pod 2 deleted (kubectl delete pod) mid-run.
scenario_replace_delete() {
  local ref job=replace-rank survivors t_del
  reference_weights 600
  ref=$(cat "$RUN_DIR/train-ref-600.w")
  CURRENT_JOB=$job
  apply "$ROOT/examples/replace-rank.yaml"
  wait_phase $job Running 300
  survivors=$(pod_uids $job | tr ' ' '\n' | grep -v "^$job-2=" | tr '\n' ' ')
  wait_until 300 "step 100 reached" "facts $job-0 train 'step 100 ' | grep -q ."
  ras_lists_each_peer_once $job
  t_del=$(now_ms)
  kubectl -n "$NS" delete pod $job-2 --wait=false >/dev/null
  check_recovered $job $job-2 "$t_del" "$ref" "$survivors"
  check $job '.status.recoveries[0].reason == "PodDeleted"'
  delete_job $job
}

# `weft ras` in pod 0's sidecar lists each other pod once, with the proxy's
# connection to it (it listed a pod named by DNS twice: issue 31).
ras_lists_each_peer_once() {
  local job=$1 ras p n
  ras=$(kubectl -n "$NS" exec $job-0 -c weft-sidecar -- weft ras)
  n=$(($(pod_names $job | wc -w) - 1))
  grep -q "^peer hosts: $n\$" <<<"$ras" || fail "RAS does not list $n peer hosts: $ras"
  for p in $(pod_names $job); do
    [[ $p == "$job-0" ]] && continue
    [[ $(grep -c "^  $p\(\.[^ ]*\)\? at .*; proxy up " <<<"$ras") == 1 ]] || fail "RAS does not list $p once, proxy up: $ras"
  done
  log "weft ras in $job-0 lists each of its $n peers once: $(grep -m1 '^  ' <<<"$ras")"
}
