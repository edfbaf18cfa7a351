//! The CRD's CEL rules (x-kubernetes-validations), evaluated offline with
//! kube-cel the way the API server evaluates them (defaults applied first,
//! transition rules against the old object), so a bad spec is known to be
//! refused with a clear message without needing a cluster.

use serde_json::{Value, json};
use weft_operator::crd::crd_schema;

fn base() -> Value {
    json!({
        "apiVersion": "weft.dev/v1alpha1",
        "kind": "CollectiveJob",
        "metadata": {"name": "j", "namespace": "default"},
        "spec": {
            "replicas": 2,
            "ranksPerReplica": 4,
            "template": {"spec": {"containers": [{"name": "main", "image": "busybox"}]}}
        }
    })
}

fn check(obj: &Value, old: Option<&Value>) -> Result<(), String> {
    kube_cel::Validator::new()
        .validate(&crd_schema(), obj, old)
        .map_err(|e| e.to_string())
}

/// Sets (or adds) the field at a JSON pointer whose parent exists.
fn with(mut obj: Value, pointer: &str, value: Value) -> Value {
    let (parent, key) = pointer.rsplit_once('/').unwrap();
    obj.pointer_mut(parent)
        .and_then(Value::as_object_mut)
        .unwrap_or_else(|| panic!("no object at {parent}"))
        .insert(key.to_string(), value);
    obj
}

#[test]
fn valid_spec_passes_every_rule() {
    check(&base(), None).unwrap();
    let full = with(
        base(),
        "/spec/sidecar",
        json!({"bootstrapPort": 31000, "metricsPort": 9000}),
    );
    let full = with(
        full,
        "/spec/failurePolicy",
        json!({"permanentExitCodes": [1, 2, 255], "onRankFailure": "ReplaceRank", "maxReplacements": 5}),
    );
    check(&full, None).unwrap();
}

#[test]
fn world_size_is_bounded() {
    let obj = with(base(), "/spec/replicas", json!(4096));
    let obj = with(obj, "/spec/ranksPerReplica", json!(64));
    let err = check(&obj, None).unwrap_err();
    assert!(err.contains("world size"), "{err}");
}

#[test]
fn sidecar_ports_must_differ_and_avoid_torchrun() {
    let obj = with(base(), "/spec/sidecar", json!({"bootstrapPort": 9464}));
    let err = check(&obj, None).unwrap_err();
    assert!(err.contains("must differ"), "{err}");
    let obj = with(base(), "/spec/sidecar", json!({"bootstrapPort": 29500}));
    let err = check(&obj, None).unwrap_err();
    assert!(err.contains("29500"), "{err}");
}

#[test]
fn permanent_exit_codes_are_real_exit_codes() {
    for bad in [0, 256, -1] {
        let obj = with(
            base(),
            "/spec/failurePolicy",
            json!({"permanentExitCodes": [bad]}),
        );
        let err = check(&obj, None).unwrap_err();
        assert!(err.contains("between 1 and 255"), "{bad}: {err}");
    }
}

#[test]
fn container_and_volume_names() {
    let dup = json!([{"name": "a", "image": "x"}, {"name": "a", "image": "y"}]);
    let err = check(&with(base(), "/spec/template/spec/containers", dup), None).unwrap_err();
    assert!(err.contains("unique"), "{err}");
    let reserved = json!([{"name": "weft-sidecar", "image": "x"}]);
    let err = check(
        &with(base(), "/spec/template/spec/containers", reserved),
        None,
    )
    .unwrap_err();
    assert!(err.contains("reserved"), "{err}");
    let vols = json!([{"name": "weft-shm", "emptyDir": {}}]);
    let err = check(&with(base(), "/spec/template/spec/volumes", vols), None).unwrap_err();
    assert!(err.contains("reserved"), "{err}");
}

#[test]
fn world_shape_is_immutable() {
    let old = base();
    check(&old, Some(&old)).unwrap();
    let err = check(&with(base(), "/spec/replicas", json!(3)), Some(&old)).unwrap_err();
    assert!(err.contains("replicas is immutable"), "{err}");
    let err = check(&with(base(), "/spec/ranksPerReplica", json!(8)), Some(&old)).unwrap_err();
    assert!(err.contains("ranksPerReplica is immutable"), "{err}");
    // other fields may change (e.g. suspend / resume)
    let suspended = with(base(), "/spec/runPolicy", json!({"suspend": true}));
    check(&suspended, Some(&old)).unwrap();
}
