# The operator's own life: install, losing its leader, upgrade, uninstall.

operator_pods() {
  kubectl -n "$OP_NS" get pods -l app.kubernetes.io/name=weft-operator \
    -o jsonpath='{range .items[*]}{.metadata.name}{" "}{end}'
}
ready_replicas() { kubectl -n "$OP_NS" get deployment weft -o jsonpath='{.status.readyReplicas}'; }

# Install with 2 replicas: a leader and a ready standby; the CRD's schema
# refuses bad specs.
scenario_install() {
  log "helm install with 2 operator replicas (--wait: the standby is ready too)"
  local t0; t0=$(now_ms)
  helm install weft "$ROOT/charts/weft" -n "$OP_NS" --create-namespace --wait \
    "${HELM_SETS[@]}" --set operator.replicas=2
  log "installed and ready in $(($(now_ms) - t0)) ms"
  kubectl get crd collectivejobs.weft.dev >/dev/null
  [[ "$(ready_replicas)" == 2 ]] || fail "ready replicas: $(ready_replicas), not 2"
  wait_until 30 "a leader holds the Lease" '[[ -n $(leader) ]]'
  local holder; holder=$(leader)
  [[ " $(operator_pods) " == *" $holder "* ]] || fail "Lease holder $holder is not an operator pod ($(operator_pods))"
  log "leader $holder; pods $(operator_pods)"

  log "the API server refuses bad specs (CRD schema)"
  refused "replicas: 0" replicas <<'BAD'
apiVersion: weft.dev/v1alpha1
kind: CollectiveJob
metadata: {name: bad}
spec:
  replicas: 0
  template: {spec: {containers: [{name: m, image: busybox}]}}
BAD
  refused "a command that is a string" command <<'BAD'
apiVersion: weft.dev/v1alpha1
kind: CollectiveJob
metadata: {name: bad}
spec:
  template: {spec: {containers: [{name: m, image: busybox, command: "sleep 1"}]}}
BAD
  log "the PyTorch example passes server-side validation (not run: no GPUs)"
  kubectl -n "$NS" apply --dry-run=server -f "$ROOT/examples/pytorch-ddp.yaml" >/dev/null
}

# refused WHAT WORD < manifest: the API server refuses it, naming WORD.
refused() {
  local out
  if out=$(kubectl -n "$NS" apply -f - 2>&1); then fail "accepted: $1"; fi
  grep -q "$2" <<<"$out" || fail "no '$2' in the refusal of $1: $out"
}

# The leader's pod is lost mid-job (its process SIGKILLed on the node, the
# pod force-deleted, as when its node dies): the standby takes the Lease,
# the job goes on to Succeeded, nothing is created or counted twice.
scenario_failover() {
  local job=e2e-failover
  CURRENT_JOB=$job
  wait_until 120 "2 operator replicas ready" '[[ $(ready_replicas) == 2 ]]'
  apply "$ROOT/examples/replace-rank.yaml" "s/^  name: replace-rank$/  name: $job/" \
    's/^  replicas: 4$/  replicas: 2/' 's|"resilient-train", .*\]$|"resilient-train", "300", "--step-ms=100"]|'
  wait_phase $job Running 300
  local before old standby cid node t0 new
  before=$(pod_uids $job)
  old=$(leader)
  standby=$(operator_pods | tr ' ' '\n' | grep -vx "$old" | grep . | head -1)
  cid=$(kubectl -n "$OP_NS" get pod "$old" -o jsonpath='{.status.containerStatuses[0].containerID}')
  node=$(kubectl -n "$OP_NS" get pod "$old" -o jsonpath='{.spec.nodeName}')
  log "killing the leader $old (standby $standby) while $job runs"
  t0=$(now_ms)
  if node_kill "$node" "$cid"; then
    log "SIGKILLed its process on node $node"
  else
    log "no access to the node (LOADER=$LOADER): the pod is only force-deleted"
  fi
  kubectl -n "$OP_NS" delete pod "$old" --grace-period=0 --force >/dev/null 2>&1
  # The standby, or the pod the Deployment started in place of the lost
  # one (also a standby by then): whichever polls first once the Lease
  # expires.
  wait_until 60 "a standby takes the Lease" '[[ -n $(leader) && $(leader) != "$old" ]]'
  new=$(leader)
  log "$new leads $(($(now_ms) - t0)) ms after the kill (Lease duration 15 s)$([[ $new == "$standby" ]] && echo ': the standby' || echo ': the pod started in place of the lost one')"
  wait_phase $job Succeeded 300
  [[ "$(pod_uids $job)" == "$before" ]] || fail "pods were recreated: $before -> $(pod_uids $job)"
  check $job '.status.restarts == 0' '.status.replacements == 0' '.status.ready == "0/2"'
  [[ $(events $job PodsCreated) == 1 ]] || fail "PodsCreated $(events $job PodsCreated) times"
  [[ $(events $job Succeeded) == 1 ]] || fail "Succeeded $(events $job Succeeded) times"
  local w0 w1
  w0=$(facts $job-0 train final); w1=$(facts $job-1 train final)
  [[ -n "$w0" && "$w0" == "$w1" ]] || fail "final weights: '$w0' vs '$w1'"
  no_sidecar_deaths $job
  wait_until 120 "a new operator pod replaces the lost one" '[[ $(ready_replicas) == 2 ]]'
  delete_job $job
}

# helm upgrade (new values: 1 replica, debug logs) while a job runs: the
# rollout finishes, a new leader takes over, the job is untouched and still
# managed (its deletion runs the finalizer).
scenario_upgrade() {
  local job=e2e-upgrade
  CURRENT_JOB=$job
  apply "$ROOT/e2e/restart-job.yaml" "s/^  name: e2e-restart$/  name: $job/"
  wait_phase $job Running 300
  local before t0 out
  before=$(pod_uids $job)
  t0=$(now_ms)
  helm upgrade weft "$ROOT/charts/weft" -n "$OP_NS" --wait "${HELM_SETS[@]}" \
    --set operator.replicas=1 --set operator.logLevel=debug
  kubectl -n "$OP_NS" rollout status deployment/weft --timeout=180s >/dev/null
  out=$(helm status weft -n "$OP_NS")
  grep -qiE 'revision:? 2' <<<"$out" || fail "not revision 2: $out"
  wait_until 60 "one operator pod, leading" leads_alone
  log "upgraded and rolled out in $(($(now_ms) - t0)) ms; leader $(leader)"
  [[ "$(kubectl -n "$OP_NS" get deployment weft -o jsonpath='{.spec.template.spec.containers[0].env[?(@.name=="WEFT_LOG")].value}')" == debug ]] \
    || fail "the new value did not reach the Deployment"
  [[ "$(pod_uids $job)" == "$before" ]] || fail "the upgrade touched the job's pods"
  check $job '.status.phase == "Running"' '.status.restarts == 0'
  delete_job $job
}

leads_alone() {
  local pods; pods=$(operator_pods)
  [[ "$(wc -w <<<"$pods")" == 1 && "$(leader)" == "${pods% }" ]]
}

# helm uninstall with a job still there. Its pre-delete hook (`weft-operator
# uninstall`) stops the operator (the leader releases the Lease), removes the
# operator's finalizer from every job and deletes the Lease; then Helm
# removes the operator's Deployment, Service, ServiceAccount, RBAC and the
# hook's own objects. What remains (docs/KUBERNETES.md, "Uninstall"): the CRD
# (Helm never deletes CRDs it installed from crds/) and the jobs with their
# pods, Services and Secrets, still running; deleting a job then returns at
# once and the garbage collector removes its pods.
scenario_uninstall() {
  local job=e2e-orphan
  CURRENT_JOB=$job
  apply "$ROOT/e2e/restart-job.yaml" "s/^  name: e2e-restart$/  name: $job/"
  wait_phase $job Running 300
  check $job '.metadata.finalizers == ["weft.dev/cleanup"]'
  local before t0; before=$(pod_uids $job)
  log "helm uninstall with $job running"
  t0=$(now_ms)
  helm uninstall weft -n "$OP_NS" --wait --timeout 300
  log "uninstalled in $(($(now_ms) - t0)) ms (the hook stopped the operator first)"
  wait_until 120 "operator pods gone" '[[ -z $(operator_pods) ]]'
  local k
  for k in deployment service serviceaccount role rolebinding job; do
    [[ -z "$(kubectl -n "$OP_NS" get "$k" -l app.kubernetes.io/instance=weft -o name)" ]] || fail "$k left behind"
  done
  for k in clusterrole clusterrolebinding; do
    [[ -z "$(kubectl get "$k" -l app.kubernetes.io/instance=weft -o name)" ]] || fail "$k left behind"
  done
  ! kubectl -n "$OP_NS" get lease weft-operator-leader >/dev/null 2>&1 || fail "the Lease was left behind"
  kubectl get crd collectivejobs.weft.dev >/dev/null || fail "the CRD went with the release"
  [[ "$(pod_uids $job)" == "$before" ]] || fail "the job's pods changed"
  check $job '.status.phase == "Running"' '(.metadata.finalizers // []) == []'
  kubectl -n "$NS" get service $job >/dev/null
  log "left: the CRD, $job (Running, no finalizer) with its pods and Service; no Lease, no hook objects"
  log "without an operator the job is deleted at once and the garbage collector removes its pods"
  t0=$(now_ms)
  kubectl -n "$NS" delete cjob $job --wait --timeout=60s >/dev/null || fail "deleting $job did not return"
  wait_until 120 "the garbage collector removes its pods" "no_pods $job"
  wait_until 60 "and its Service" "! kubectl -n $NS get service $job"
  log "$job and its pods gone $(($(now_ms) - t0)) ms after the delete"
  log "removing the CRD and the namespaces"
  release_jobs   # any other job left (by a failed scenario) would hold the CRD
  kubectl delete crd collectivejobs.weft.dev --wait --timeout=60s >/dev/null
  kubectl delete namespace "$OP_NS" --wait --timeout=120s >/dev/null
}
