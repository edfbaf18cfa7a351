# Helpers of the e2e scenarios (sourced by e2e/run.sh): logging, failing
# with the cluster's side of the story, waiting, and status checks.
# Every kubectl call goes to $KUBECONFIG; jobs live in namespace $NS.

log() { echo "e2e: $*"; }
now_ms() { date +%s%3N; }

# fail MSG: print it and what the cluster says about the current job, stop
# the scenario (scenarios run in a subshell: the run goes on with the next).
fail() {
  echo "e2e: FAILED: $*" >&2
  if [[ -n "${CURRENT_JOB:-}" ]]; then debug_job "$CURRENT_JOB" >&2; fi
  exit 1
}

debug_job() {
  kubectl -n "$NS" describe cjob "$1" | tail -40 || true
  kubectl -n "$NS" get pods -o wide || true
  kubectl -n "$NS" logs -l "weft.dev/job-name=$1" --all-containers --tail=30 --prefix || true
  kubectl -n "$OP_NS" logs -l app.kubernetes.io/name=weft-operator --tail=40 --prefix || true
}

# The locally built images in place of the published ones: same
# repositories, the e2e tag (or $REPO's, for a registry).
local_images() {
  sed -e "s#ghcr.io/weft-dev/\(weft[a-z-]*\):0.1.0#$REPO/\1:$TAG#g" "$@"
}

# apply FILE [SED-EXPR...]: the manifest with local images and the edits.
apply() {
  local f=$1; shift
  local edits=()
  for e in "$@"; do edits+=(-e "$e"); done
  # kubectl's "created" line to stderr: callers' stdout may be a value.
  if ((${#edits[@]})); then
    local_images "$f" | sed "${edits[@]}" | kubectl -n "$NS" apply -f - >&2
  else
    local_images "$f" | kubectl -n "$NS" apply -f - >&2
  fi
}

job_json() { kubectl -n "$NS" get cjob "$1" -o json; }

# check JOB JQ-EXPR...: every expression is true of the job's JSON.
check() {
  local job=$1 json; shift
  json=$(job_json "$job")
  for e in "$@"; do
    jq -e "$e" <<<"$json" >/dev/null || { jq .status <<<"$json" >&2; fail "$job: status check $e"; }
  done
}

# wait_phase JOB PHASE [SECONDS]
wait_phase() {
  kubectl -n "$NS" wait "cjob/$1" --for=jsonpath='{.status.phase}'="$2" --timeout="${3:-300}s" >/dev/null \
    || fail "$1 did not reach $2 within ${3:-300} s (phase: $(kubectl -n "$NS" get cjob "$1" -o jsonpath='{.status.phase}'))"
}

# wait_until SECONDS WHAT 'SHELL CODE': until the code (evaluated anew each
# time, with this file's functions) succeeds, polled every 0.5 s.
wait_until() {
  local limit=$1 what=$2 code=$3 t0
  t0=$(date +%s)
  until eval "$code" >/dev/null 2>&1; do
    (($(date +%s) - t0 < limit)) || fail "$what: not within $limit s"
    sleep 0.5
  done
}

pod_names() { kubectl -n "$NS" get pods -l "weft.dev/job-name=$1" -o jsonpath='{.items[*].metadata.name}'; }
pod_uids() { kubectl -n "$NS" get pods -l "weft.dev/job-name=$1" -o jsonpath='{range .items[*]}{.metadata.name}={.metadata.uid} {end}'; }
no_pods() { [[ -z "$(pod_names "$1")" ]]; }

# delete_job JOB...: delete the jobs and wait until their pods are gone (not
# only Terminating: the finalizer deletes them, the kubelet takes seconds).
delete_job() {
  local j
  kubectl -n "$NS" delete cjob "$@" --ignore-not-found --wait --timeout=120s >/dev/null \
    || fail "deleting $* did not finish (finalizer)"
  for j in "$@"; do wait_until 120 "pods of $j gone" "no_pods $j"; done
}

# The count of events with REASON about object NAME.
events() {
  kubectl -n "$NS" get events --field-selector "involvedObject.name=$1,reason=$2" -o json \
    | jq '[.items[].count // 1] | add // 0'
}

# The lines of a container's log that start with '@ KEY' (after the
# `[rank] ` prefix of `weft run`, which is dropped).
facts() { kubectl -n "$NS" logs "$1" -c "$2" | facts_in "$3"; }
facts_in() { sed -nE "s/^(\[ *[0-9]+\] )?(@ $1)/\2/p"; }

# field LINE KEY: the value of KEY=VALUE in a line.
field() { tr ' ' '\n' <<<"$1" | sed -n "s/^$2=//p" | head -1; }

leader() { kubectl -n "$OP_NS" get lease weft-operator-leader -o jsonpath='{.spec.holderIdentity}'; }

# No sidecar of JOB, whose ranks all exited cleanly, declared one of them
# dead (issue 31 (8): a clean exit cut the rank's control stream short, its
# sidecar took it for a death and aborted its peers' communicator).
no_sidecar_deaths() {
  local p n=0 lines
  for p in $(pod_names "$1"); do
    lines=$(kubectl -n "$NS" logs "$p" -c weft-sidecar 2>/dev/null | grep ' died' || true)
    if [[ -n $lines ]]; then n=$((n + $(wc -l <<<"$lines"))); echo "$p: $lines" >&2; fi
  done
  ((n == 0)) || fail "the sidecars of $1 declared $n rank(s) dead that exited cleanly"
  log "no sidecar of $1 declared a rank dead"
}

# Deletes every CollectiveJob in the cluster and removes what finalizer is
# left on it (an operator may still run it; without one it would hold the
# job, and the CRD's deletion, forever).
release_jobs() {
  local j
  kubectl get crd collectivejobs.weft.dev >/dev/null 2>&1 || return 0
  for j in $(kubectl get cjob -A -o jsonpath='{range .items[*]}{.metadata.namespace}/{.metadata.name}{" "}{end}'); do
    kubectl -n "${j%/*}" delete cjob "${j#*/}" --wait=false >/dev/null 2>&1 || true
    kubectl -n "${j%/*}" patch cjob "${j#*/}" --type=merge -p '{"metadata":{"finalizers":null}}' >/dev/null 2>&1 || true
  done
}
