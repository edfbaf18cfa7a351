#!/usr/bin/env bash
# End-to-end test of Weft on a real Kubernetes cluster: the operator's Helm
# chart, CollectiveJobs with real pods, sidecars and kubelets. The same
# scenarios run on the local cluster of k8s-cluster/ (LOADER=k8s-cluster),
# on kind (LOADER=kind) or on any cluster whose nodes pull from a registry
# (LOADER=none, IMAGES=none, REPO=...). See e2e/README.md.
#
#   KUBECONFIG=... LOADER=k8s-cluster e2e/run.sh            every scenario
#   ... e2e/run.sh install bench-proxy uninstall             some (install first)
#
# Environment:
#   KUBECONFIG   the cluster (required)
#   LOADER       k8s-cluster | kind | none: how images reach the nodes (required)
#   IMAGES       rootfs | docker | none: how they are built (default: rootfs
#                for k8s-cluster, docker for kind, none otherwise)
#   KIND_CLUSTER kind's cluster name (default weft-e2e; LOADER=kind)
#   REPO, TAG    image names: REPO/weft-operator:TAG, ... (ghcr.io/weft-dev, e2e)
#   NS, OP_NS    namespaces of the jobs and of the operator (weft-e2e, weft-system)
#   WORK         scratch directory: binaries, root fs, image archives, and this
#                run's files in WORK/run (default /tmp/weft-e2e)
# The run starts by removing what an earlier run left (release, namespaces,
# CRD). Each scenario prints what it checked and its time; a failed scenario
# prints the cluster's view and the run goes on; the exit status is 1 when
# any scenario failed. Needs kubectl, helm and jq (and ctr / kind / docker
# for the loader and builder).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
: "${KUBECONFIG:?set KUBECONFIG to the kubeconfig of the cluster}"
: "${LOADER:?set LOADER to k8s-cluster, kind or none (e2e/README.md)}"
export KUBECONFIG
case "$LOADER" in
  k8s-cluster) IMAGES=${IMAGES:-rootfs} ;;
  kind) IMAGES=${IMAGES:-docker} ;;
  *) IMAGES=${IMAGES:-none} ;;
esac
KIND_CLUSTER=${KIND_CLUSTER:-weft-e2e}
REPO=${REPO:-ghcr.io/weft-dev}
TAG=${TAG:-e2e}
NS=${NS:-weft-e2e}
OP_NS=${OP_NS:-weft-system}
WORK=${WORK:-/tmp/weft-e2e}
RUN_DIR=$WORK/run   # this run's files (logs, reference results), emptied at start
rm -rf "$RUN_DIR"
mkdir -p "$WORK" "$RUN_DIR"

. "$ROOT/e2e/lib.sh"
. "$ROOT/e2e/images.sh"
for f in "$ROOT"/e2e/scenarios/*.sh; do . "$f"; done

for tool in kubectl helm jq; do
  command -v "$tool" >/dev/null || { echo "e2e: needs $tool on PATH" >&2; exit 2; }
done

# The chart's values for the local images, at every install and upgrade.
HELM_SETS=(--set "operator.image.repository=$REPO/weft-operator" --set "operator.image.tag=$TAG"
           --set operator.image.pullPolicy=IfNotPresent --set "sidecar.image=$REPO/weft:$TAG")

ALL=(install bench-proxy bench-tcp bench-engine-proxy bench-engine-rails nccl-c restart replace-kill replace-delete telemetry failover upgrade uninstall)
if (($#)); then SCENARIOS=("$@"); else SCENARIOS=("${ALL[@]}"); fi

clean_slate() {
  log "removing what an earlier run left (jobs, release, CRD, namespaces)"
  release_jobs
  helm uninstall weft -n "$OP_NS" --wait >/dev/null 2>&1 || true
  kubectl delete crd collectivejobs.weft.dev --ignore-not-found --wait --timeout=120s >/dev/null
  kubectl delete namespace "$NS" "$OP_NS" --ignore-not-found --wait --timeout=180s >/dev/null
  kubectl create namespace "$NS" >/dev/null
}

declare -A RESULT SECONDS_OF
t_start=$(date +%s)
t0=$(date +%s)
if [[ "$IMAGES" != none || "$LOADER" != none ]]; then
  # Not in a condition: set -e would be ignored there.
  ( set -e; build_images; load_images ); rc=$?
  ((rc == 0)) || { echo "e2e: FAILED: images" >&2; exit 1; }
fi
SECONDS_OF[images]=$(($(date +%s) - t0))
clean_slate

failed=0
for s in "${SCENARIOS[@]}"; do
  fn="scenario_${s//-/_}"
  declare -F "$fn" >/dev/null || { echo "e2e: no scenario $s (${ALL[*]})" >&2; exit 2; }
  log "=== $s"
  t0=$(date +%s)
  ( set -e; "$fn" ); rc=$?
  if ((rc == 0)); then RESULT[$s]=PASS; else RESULT[$s]=FAIL; failed=1; fi
  SECONDS_OF[$s]=$(($(date +%s) - t0))
  log "=== $s: ${RESULT[$s]} in ${SECONDS_OF[$s]} s"
  if [[ "$s" == install && "${RESULT[$s]}" == FAIL ]]; then
    echo "e2e: the operator is not installed: stopping" >&2
    break
  fi
done

echo
echo "e2e summary ($LOADER, images $IMAGES; $(kubectl version -o json 2>/dev/null | jq -r '.serverVersion.gitVersion // "?"'))"
printf '  %-16s %5s s\n' images "${SECONDS_OF[images]}"
for s in "${SCENARIOS[@]}"; do
  [[ -n "${RESULT[$s]:-}" ]] && printf '  %-16s %5s s  %s\n' "$s" "${SECONDS_OF[$s]}" "${RESULT[$s]}"
done
printf '  %-16s %5s s\n' total "$(($(date +%s) - t_start))"
if ((failed)); then echo "e2e: FAILED"; exit 1; fi
echo "e2e: PASSED"
