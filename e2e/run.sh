#!/usr/bin/env bash
# End-to-end test of the operator on a throwaway kind cluster:
#  1. build the images from the workspace (docker/Dockerfile), load them into kind;
#  2. helm install the chart with 2 operator replicas (--wait: a standby is
#     ready), then roll the Deployment out at 1 replica (maxSurge 1,
#     maxUnavailable 0) and check the leader Lease;
#  3. the API server refuses bad specs through the CRD schema (replicas: 0,
#     a command that is a string instead of a list);
#  4. examples/bench-allreduce.yaml runs to Succeeded; its status is checked;
#  5. e2e/restart-job.yaml runs; one of its pods is killed; the operator
#     restarts the whole job (restarts 1, Running again, RankFailed event);
#  6. deleting the jobs runs the finalizer and removes their pods.
#
# Needs: docker, kind, kubectl, helm, jq. Skips (exit 0, saying why) when one
# is missing; set WEFT_E2E_REQUIRED=1 to make a missing tool an error (CI).
# Keep the cluster for debugging with KEEP_CLUSTER=1.
# What can be checked without docker is checked by
# `cargo nextest run -p weft-operator -E 'binary(e2e_assets)'` (see e2e/README.md).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CLUSTER="${CLUSTER:-weft-e2e}"
TAG="${TAG:-e2e}"
NS=weft-system
TIMEOUT="${TIMEOUT:-600s}"

missing=()
for tool in docker kind kubectl helm jq; do
  command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
done
if ((${#missing[@]})) || ! docker info >/dev/null 2>&1; then
  reason="missing tools: ${missing[*]:-none}; docker daemon reachable: $(docker info >/dev/null 2>&1 && echo yes || echo no)"
  if [[ "${WEFT_E2E_REQUIRED:-0}" == 1 ]]; then
    echo "e2e: FAILED, cannot run ($reason)" >&2
    exit 1
  fi
  echo "e2e: SKIPPED ($reason). Needs docker, kind, kubectl, helm and jq."
  exit 0
fi

log() { echo "e2e: $*"; }
fail() { echo "e2e: FAILED: $*" >&2; exit 1; }
cleanup() {
  if [[ "${KEEP_CLUSTER:-0}" != 1 ]]; then kind delete cluster --name "$CLUSTER" >/dev/null 2>&1 || true; fi
}
trap cleanup EXIT
# The locally built weft image in place of the published one.
local_image() { sed -e "s#ghcr.io/weft-dev/weft:0.1.0#weft:$TAG#" "$1"; }
debug_job() {
  kubectl describe cjob "$1" || true
  kubectl get pods -o wide || true
  kubectl logs -l "weft.dev/job-name=$1" --all-containers --tail=50 || true
  kubectl -n "$NS" logs -l app.kubernetes.io/name=weft-operator --tail=100 || true
}

log "creating kind cluster $CLUSTER"
kind create cluster --name "$CLUSTER" --wait 120s

log "building images"
docker build -f "$ROOT/docker/Dockerfile" --target weft-operator -t "weft-operator:$TAG" "$ROOT"
docker build -f "$ROOT/docker/Dockerfile" --target weft -t "weft:$TAG" "$ROOT"
kind load docker-image --name "$CLUSTER" "weft-operator:$TAG" "weft:$TAG"

log "installing the chart with 2 replicas (leader + ready standby)"
helm install weft "$ROOT/charts/weft" --namespace "$NS" --create-namespace --wait --timeout 180s \
  --set operator.image.repository=weft-operator --set operator.image.tag="$TAG" \
  --set operator.image.pullPolicy=Never --set operator.replicas=2 \
  --set sidecar.image="weft:$TAG"
kubectl get crd collectivejobs.weft.dev
holder=$(kubectl -n "$NS" get lease weft-operator-leader -o jsonpath='{.spec.holderIdentity}')
[[ -n "$holder" ]] || fail "no leader holds the Lease"
log "leader: $holder"

log "rolling out at 1 replica, then restarting it (a rollout must finish)"
helm upgrade weft "$ROOT/charts/weft" --namespace "$NS" --reuse-values --set operator.replicas=1 --wait --timeout 180s
kubectl -n "$NS" rollout restart deployment/weft
kubectl -n "$NS" rollout status deployment/weft --timeout=180s

log "the API server refuses bad specs"
bad() {
  if kubectl apply -f - 2>/tmp/weft-e2e-bad.txt; then fail "accepted: $1"; fi
  grep -q "$2" /tmp/weft-e2e-bad.txt || { cat /tmp/weft-e2e-bad.txt; fail "no '$2' in the refusal of $1"; }
}
bad "replicas: 0" replicas <<'BAD'
apiVersion: weft.dev/v1alpha1
kind: CollectiveJob
metadata: {name: bad}
spec:
  replicas: 0
  template: {spec: {containers: [{name: m, image: busybox}]}}
BAD
bad "command as a string" command <<'BAD'
apiVersion: weft.dev/v1alpha1
kind: CollectiveJob
metadata: {name: bad}
spec:
  template: {spec: {containers: [{name: m, image: busybox, command: "sleep 1"}]}}
BAD

log "PyTorch example passes server-side validation (no GPUs here)"
kubectl apply --dry-run=server -f "$ROOT/examples/pytorch-ddp.yaml"

log "running the all-reduce benchmark to Succeeded"
local_image "$ROOT/examples/bench-allreduce.yaml" | kubectl apply -f -
kubectl wait cjob/bench-allreduce --for=jsonpath='{.status.phase}'=Succeeded --timeout="$TIMEOUT" || {
  debug_job bench-allreduce; fail "bench-allreduce did not succeed"
}
status=$(kubectl get cjob bench-allreduce -o json)
check() { jq -e "$1" <<<"$status" >/dev/null || { jq .status <<<"$status"; fail "status check $1"; }; }
check '.status.worldSize == 4'
check '.status.ranks | length == 2'
check '.status.ranks[1].firstRank == 2'
check '.status.bootstrapEndpoint == "bench-allreduce-0.bench-allreduce.default.svc:29400"'
check '.status.completionTime != null'
check '.status.ready == "0/2"'
check '[.status.conditions[] | select(.type=="Succeeded" and .status=="True")] | length == 1'
kubectl get events --field-selector involvedObject.name=bench-allreduce | grep -q PodsCreated

log "killing a pod of a running job: the operator restarts the job"
local_image "$ROOT/e2e/restart-job.yaml" | kubectl apply -f -
kubectl wait cjob/e2e-restart --for=jsonpath='{.status.phase}'=Running --timeout=300s || {
  debug_job e2e-restart; fail "e2e-restart did not start"
}
kubectl delete pod e2e-restart-1 --wait=false
kubectl wait cjob/e2e-restart --for=jsonpath='{.status.restarts}'=1 --timeout=120s || {
  debug_job e2e-restart; fail "no restart after a pod was killed"
}
kubectl wait cjob/e2e-restart --for=jsonpath='{.status.phase}'=Running --timeout=300s || {
  debug_job e2e-restart; fail "e2e-restart did not run again"
}
status=$(kubectl get cjob e2e-restart -o json)
check '.status.restartEpoch == 1'
check '.status.lastFailure.pod == "e2e-restart-1"'
check '.status.lastFailure.reason == "PodDeleted"'
epochs=$(kubectl get pods -l weft.dev/job-name=e2e-restart -o jsonpath='{.items[*].metadata.labels.weft\.dev/restart-epoch}')
[[ "$epochs" == "1 1" ]] || fail "pods not all of epoch 1: $epochs"
kubectl get events --field-selector involvedObject.name=e2e-restart | grep -q RankFailed

log "deleting the jobs runs the finalizer and removes their pods"
kubectl delete cjob bench-allreduce e2e-restart --wait --timeout=120s
test -z "$(kubectl get pods -l weft.dev/job-name=e2e-restart -o name)"
test -z "$(kubectl get pods -l weft.dev/job-name=bench-allreduce -o name)"

log "PASSED"
