#!/usr/bin/env python3
"""Offline checks of the Helm chart, the CRD and the examples.

1. `helm lint --strict` of charts/weft (Helm v4 as a library: helm-python-sdk).
2. Render the chart with the default values and with every switch flipped
   (values.schema.json must accept those and refuse bad values);
   validate each rendered manifest and the chart's CRD against the Kubernetes
   1.37 schemas (kubernetes-validate, strict: unknown fields are errors).
3. The chart's CRD must be byte-identical to crds/collectivejob.yaml.
4. Every example: CollectiveJobs against our CRD's openAPIV3Schema (jsonschema),
   their pod templates as core/v1 PodTemplates, other kinds against Kubernetes.
5. Specs that the CRD schema must refuse are refused.
6. Optional --rendered DIR: the Service/Secret/Pods the operator generates for
   each example (written by the Rust test) validated against Kubernetes.

Exit status 0 only if everything passed. Run by operator/tests/chart_check.rs.
"""

from __future__ import annotations

import argparse
import copy
import pathlib
import sys

import jsonschema
import yaml

import helm_python as helm
import kubernetes_validate

ROOT = pathlib.Path(__file__).resolve().parent.parent
CHART = ROOT / "charts" / "weft"
K8S = "1.37.0"

failures: list[str] = []


def fail(msg: str) -> None:
    failures.append(msg)
    print(f"FAIL {msg}")


def ok(msg: str) -> None:
    print(f"ok   {msg}")


def validate_k8s(doc: dict, where: str) -> None:
    try:
        kubernetes_validate.validate(doc, K8S, strict=True)
        ok(f"{where}: {doc['kind']} {doc.get('metadata', {}).get('name')} valid for Kubernetes {K8S}")
    except kubernetes_validate.ValidationError as e:
        fail(f"{where}: {doc['kind']} {doc.get('metadata', {}).get('name')}: {e.caught.message} at {list(e.caught.absolute_path)}")
    except kubernetes_validate.SchemaNotFoundError:
        fail(f"{where}: no Kubernetes schema for {doc['apiVersion']} {doc['kind']}")


def lint() -> None:
    report = helm.lint(str(CHART), strict=True, kube_version=f"v{K8S}")
    bad = [m for m in report.get("messages", []) if m.get("severity", 0) >= 2]
    for m in report.get("messages", []):
        print(f"     lint: severity={m.get('severity')} {m.get('path')}: {m.get('error')}")
    if bad or report.get("errors"):
        fail(f"helm lint --strict: {bad} {report.get('errors')}")
    else:
        ok(f"helm lint --strict ({report.get('total_charts_linted')} chart, {len(report.get('messages', []))} info messages)")


VALUE_SETS = {
    "defaults": None,
    "ha-no-secret-watch": {
        "operator": {"replicas": 2},
        "rbac": {"watchSecrets": False},
        "telemetry": {"otlpEndpoint": "http://otel-collector.monitoring:4317"},
        "serviceAccount": {"name": "weft", "annotations": {"example.com/a": "b"}},
        "imagePullSecrets": [{"name": "regcred"}],
    },
    "no-leader-election-no-service-no-hook": {
        "operator": {"leaderElection": False, "nodeSelector": {"kubernetes.io/os": "linux"}},
        "metrics": {"service": {"enabled": False}},
        "uninstall": {"hook": False},
    },
}


def render() -> None:
    chart = helm.Chart.load(str(CHART))
    for label, values in VALUE_SETS.items():
        out = chart.render(values, name="weft", namespace="weft-system", is_install=True)
        kinds = []
        deployments, hook_jobs = [], []
        for path, text in sorted(out.items()):
            if path.endswith("NOTES.txt"):
                if "kubectl apply -f examples/" not in text:
                    fail(f"{label}: NOTES.txt does not explain how to run an example")
                continue
            for doc in yaml.safe_load_all(text):
                if not doc:
                    continue
                kinds.append(doc["kind"])
                validate_k8s(doc, f"render[{label}] {path}")
                hook = doc["metadata"].get("annotations", {}).get("helm.sh/hook")
                if path.endswith("uninstall-hook.yaml") and hook != "pre-delete":
                    fail(f"{label}: {doc['kind']} {doc['metadata']['name']} of the uninstall hook is not a pre-delete hook")
                if doc["kind"] == "ClusterRole":
                    if hook:
                        check_hook_rbac(doc)
                    else:
                        check_rbac(doc, values or {})
                if doc["kind"] == "Role" and hook:
                    check_hook_rbac(doc)
                if doc["kind"] == "Job":
                    hook_jobs.append(doc)
                if doc["kind"] == "Deployment":
                    deployments.append(doc["metadata"]["name"])
                    want = (values or {}).get("operator", {}).get("replicas", 1)
                    if doc["spec"]["replicas"] != want:
                        fail(f"{label}: Deployment replicas {doc['spec']['replicas']} != {want}")
        for job in hook_jobs:
            args = job["spec"]["template"]["spec"]["containers"][0]["args"]
            if args[0] != "uninstall" or [f"--deployment={d}" for d in deployments] != args[1:2]:
                fail(f"{label}: the uninstall hook's args {args} do not name the Deployment {deployments}")
        expected = {"Deployment", "ServiceAccount", "ClusterRole", "ClusterRoleBinding"}
        if (values or {}).get("operator", {}).get("leaderElection", True):
            expected |= {"Role", "RoleBinding"}
        if (values or {}).get("uninstall", {}).get("hook", True):
            expected |= {"Job", "Role", "RoleBinding"}
        if (values or {}).get("metrics", {}).get("service", {}).get("enabled", True):
            expected.add("Service")
        if set(kinds) != expected:
            fail(f"render[{label}]: kinds {sorted(set(kinds))} != {sorted(expected)}")
        else:
            ok(f"render[{label}]: {sorted(kinds)}")
    crds = chart.crds
    if len(crds) != 1:
        fail(f"chart has {len(crds)} CRDs, expected 1")
    # values.schema.json refuses bad values
    for label, bad in {
        "replicas: two": {"operator": {"replicas": "two"}},
        "pullPolicy: Sometimes": {"operator": {"image": {"pullPolicy": "Sometimes"}}},
        "unknown key": {"sidecar": {"imag": "x"}},
        "uninstall.stopTimeoutSeconds: 0": {"uninstall": {"stopTimeoutSeconds": 0}},
    }.items():
        try:
            chart.validate_schema(bad)
            fail(f"values.schema.json accepts bad values ({label})")
        except helm.HelmError as e:
            ok(f"values.schema.json refuses {label}: {' '.join(str(e).split())[:160]}")
    for values in VALUE_SETS.values():
        chart.validate_schema(values)


def check_rbac(role: dict, values: dict) -> None:
    # No wildcards, nothing beyond what the operator uses.
    allowed = {
        ("weft.dev", "collectivejobs"): {"get", "list", "watch", "patch", "delete"},
        ("weft.dev", "collectivejobs/status"): {"patch"},
        ("", "pods"): {"list", "watch", "create", "delete"},
        ("", "services"): {"list", "watch", "create", "patch"},
        ("", "secrets"): {"create", "list", "watch"},
        ("events.k8s.io", "events"): {"create", "patch"},
    }
    for rule in role["rules"]:
        for g in rule["apiGroups"]:
            for r in rule["resources"]:
                verbs = set(rule["verbs"])
                if "*" in verbs or r == "*" or g == "*":
                    fail(f"ClusterRole uses a wildcard: {rule}")
                extra = verbs - allowed.get((g, r), set())
                if extra:
                    fail(f"ClusterRole grants {sorted(extra)} on {g}/{r} beyond what the operator uses")
                if r == "secrets" and not values.get("rbac", {}).get("watchSecrets", True) and verbs != {"create"}:
                    fail("rbac.watchSecrets=false must leave only create on secrets")


def check_hook_rbac(role: dict) -> None:
    # The uninstall hook: its own Deployment and Lease by name, and the
    # finalizers of CollectiveJobs; nothing else.
    allowed = {
        ("weft.dev", "collectivejobs"): {"get", "list", "patch"},
        ("apps", "deployments"): {"get", "delete"},
        ("coordination.k8s.io", "leases"): {"delete"},
    }
    for rule in role["rules"]:
        for g in rule["apiGroups"]:
            for r in rule["resources"]:
                extra = set(rule["verbs"]) - allowed.get((g, r), set())
                if extra:
                    fail(f"uninstall hook {role['kind']} grants {sorted(extra)} on {g}/{r}")
                if role["kind"] == "Role" and not rule.get("resourceNames"):
                    fail(f"uninstall hook Role: {g}/{r} is not narrowed to resourceNames")
                if r == "leases" and rule.get("resourceNames") != ["weft-operator-leader"]:
                    fail(f"uninstall hook Role: leases {rule.get('resourceNames')} is not the leader Lease")


def load_crd() -> dict:
    text = (ROOT / "crds" / "collectivejob.yaml").read_text()
    chart_text = (CHART / "crds" / "collectivejob.yaml").read_text()
    if text != chart_text:
        fail("charts/weft/crds/collectivejob.yaml differs from crds/collectivejob.yaml")
    else:
        ok("chart CRD == crds/collectivejob.yaml")
    crd = yaml.safe_load(text)
    validate_k8s(crd, "crds/collectivejob.yaml")
    return crd


def crd_validator(crd: dict):
    schema = copy.deepcopy(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"])
    # OpenAPI v3 `nullable` is not JSON Schema; allow null where it is set.
    def fix(node):
        if isinstance(node, dict):
            if node.get("nullable") and "type" in node:
                node["type"] = [node["type"], "null"]
            for v in node.values():
                fix(v)
        elif isinstance(node, list):
            for v in node:
                fix(v)
    fix(schema)
    return jsonschema.Draft7Validator(schema)


def check_examples(crd: dict) -> None:
    validator = crd_validator(crd)
    files = sorted((ROOT / "examples").glob("*.yaml"))
    if len(files) < 2:
        fail(f"expected at least 2 examples, found {files}")
    jobs = 0
    for f in files:
        for doc in yaml.safe_load_all(f.read_text()):
            if not doc:
                continue
            where = f"examples/{f.name}"
            if doc["kind"] == "CollectiveJob":
                jobs += 1
                errors = sorted(validator.iter_errors(doc), key=lambda e: list(e.absolute_path))
                for e in errors:
                    fail(f"{where}: {e.message} at {list(e.absolute_path)}")
                if not errors:
                    ok(f"{where}: CollectiveJob {doc['metadata']['name']} valid against the CRD schema")
                tmpl = {"apiVersion": "v1", "kind": "PodTemplate",
                        "metadata": {"name": doc["metadata"]["name"]}, "template": doc["spec"]["template"]}
                validate_k8s(tmpl, f"{where} spec.template")
            else:
                validate_k8s(doc, where)
    if jobs < 2:
        fail(f"expected at least 2 CollectiveJob examples, found {jobs}")


def check_refusals(crd: dict) -> None:
    validator = crd_validator(crd)
    base = {"apiVersion": "weft.dev/v1alpha1", "kind": "CollectiveJob", "metadata": {"name": "x"},
            "spec": {"template": {"spec": {"containers": [{"name": "main", "image": "busybox"}]}}}}
    bad = {
        "replicas: 0": {"replicas": 0},
        "ranksPerReplica: 0": {"ranksPerReplica": 0},
        "transport: udp": {"network": {"transport": "udp"}},
        "onRankFailure: Retry": {"failurePolicy": {"onRankFailure": "Retry"}},
        "maxRestarts: -1": {"failurePolicy": {"maxRestarts": -1}},
        "maxReplacements: -1": {"failurePolicy": {"onRankFailure": "ReplaceRank",
                                                  "maxReplacements": -1}},
        "maxReplacements: 1001": {"failurePolicy": {"maxReplacements": 1001}},
        "onRankFailure: replaceRank": {"failurePolicy": {"onRankFailure": "replaceRank"}},
        "cleanPodPolicy: Some": {"runPolicy": {"cleanPodPolicy": "Some"}},
        "activeDeadlineSeconds: 0": {"runPolicy": {"activeDeadlineSeconds": 0}},
        "no containers": {"template": {"spec": {"containers": []}}},
        "no template": {"template": None},
        "restartPolicy: Always": {"template": {"spec": {"restartPolicy": "Always",
                                                         "containers": [{"name": "m"}]}}},
        "logLevel: loud": {"sidecar": {"logLevel": "loud"}},
        # issue 19: the pod template is typed
        "command: a string": {"template": {"spec": {"containers": [
            {"name": "m", "image": "busybox", "command": "sleep 1"}]}}},
        "containers: not a list": {"template": {"spec": {"containers": {"name": "m"}}}},
        "env value: a number": {"template": {"spec": {"containers": [
            {"name": "m", "image": "busybox", "env": [{"name": "A", "value": 1}]}]}}},
        "bootstrapPort: 80": {"sidecar": {"bootstrapPort": 80}},
    }
    for label, patch in bad.items():
        doc = copy.deepcopy(base)
        for k, v in patch.items():
            if v is None:
                doc["spec"].pop(k)
            else:
                doc["spec"][k] = v
        if validator.is_valid(doc):
            fail(f"CRD schema accepts a bad spec ({label})")
        else:
            ok(f"CRD schema refuses {label}: {next(validator.iter_errors(doc)).message}")
    if not validator.is_valid(base):
        fail("CRD schema refuses the minimal valid spec")


def check_rendered(directory: pathlib.Path) -> None:
    files = sorted(directory.glob("*.yaml"))
    if not files:
        fail(f"no operator-rendered objects in {directory}")
    for f in files:
        for doc in yaml.safe_load_all(f.read_text()):
            if doc:
                validate_k8s(doc, f"operator-rendered {f.name}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rendered", type=pathlib.Path, help="directory of operator-rendered objects")
    args = ap.parse_args()
    print(f"helm-python-sdk: Helm SDK {helm.helm_sdk_version()}; kubernetes-validate for Kubernetes {K8S}")
    lint()
    render()
    crd = load_crd()
    check_examples(crd)
    check_refusals(crd)
    if args.rendered:
        check_rendered(args.rendered)
    if failures:
        print(f"\n{len(failures)} check(s) failed")
        return 1
    print("\nall chart, CRD and example checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
