# spec.telemetry: the sidecars export a span per collective of every rank
# to an OTLP receiver running in the cluster (otlp-sink, built from this
# repository), each span naming its rank, job and the rank's host (its pod).

sink_spans() { kubectl -n "$NS" logs otlp-sink -c sink | grep '^{' || true; }

# The ranks with spans of JOB at the sink, as "rank@host" words, sorted.
span_ranks() {
  sink_spans | jq -r --arg job "$1" 'select(.attrs["weft.job"] == $job)
    | "\(.attrs["weft.rank"])@\(.attrs["host.name"])"' | sort -u | tr '\n' ' '
}

scenario_telemetry() {
  local job=e2e-telemetry want n
  CURRENT_JOB=$job
  apply "$ROOT/e2e/otlp-sink.yaml"
  kubectl -n "$NS" wait pod/otlp-sink --for=condition=Ready --timeout=120s >/dev/null \
    || fail "the receiver did not start"
  apply "$ROOT/e2e/telemetry-job.yaml" "s#otlp-sink.NAMESPACE.svc#otlp-sink.$NS.svc#"
  wait_phase $job Succeeded 300
  # Ranks 0 and 1 run in pod 0, 2 and 3 in pod 1; the sidecars flush their
  # spans when the workload has exited and they are stopped.
  want="0@$job-0 1@$job-0 2@$job-1 3@$job-1 "
  wait_until 60 "spans of every rank at the receiver" '[[ $(span_ranks $job) == "$want" ]]'
  n=$(sink_spans | jq -r --arg job $job 'select(.attrs["weft.job"] == $job and .attrs["weft.op"] == "all_reduce") | .attrs["weft.rank"]' | sort | uniq -c | tr -s ' ' | tr '\n' ';')
  sink_spans | jq -e --arg job $job 'select(.attrs["weft.job"] == $job) | select(.attrs["weft.outcome"] != "ok")' >/dev/null \
    && fail "a span with an outcome other than ok"
  log "spans from every rank, each on its own pod: $(span_ranks $job); all_reduce spans per rank: $n"
  no_sidecar_deaths $job
  delete_job $job
  kubectl -n "$NS" delete -f "$ROOT/e2e/otlp-sink.yaml" --wait >/dev/null
}
