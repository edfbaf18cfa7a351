//! The controller against a mock API server (the `tower-test` pattern of
//! kube-rs' controller-rs), made stateful: a tiny in-memory apiserver that
//! understands the requests the operator makes (get/list/create/delete,
//! JSON patch for the finalizer, server-side apply, the status subresource,
//! owner-reference garbage collection). Tests then drive whole lifecycles by
//! reconciling, changing pod states as a kubelet would, and reconciling again.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use http::{Method, Request, Response, StatusCode};
use k8s_openapi::api::core::v1::{Pod, Secret, Service};
use k8s_openapi::jiff::Timestamp;
use kube::client::Body;
use kube::{Client, ResourceExt};
use serde_json::{Value, json};

use super::*;
use crate::crd::{CollectiveJob, JobPhase};
use crate::resources::tests::job as make_job;
use crate::status::tests::{cs_exited, cs_running, with_status};

const JOBS: &str = "/apis/weft.dev/v1alpha1/namespaces/ml/collectivejobs";
const PODS: &str = "/api/v1/namespaces/ml/pods";
const SERVICES: &str = "/api/v1/namespaces/ml/services";
const SECRETS: &str = "/api/v1/namespaces/ml/secrets";
const EVENTS: &str = "/apis/events.k8s.io/v1/namespaces/ml/events";

#[derive(Default)]
struct State {
    /// collection path -> name -> object
    objects: BTreeMap<String, BTreeMap<String, Value>>,
    /// "METHOD path?query" of every request, in order
    log: Vec<String>,
    events: Vec<Value>,
    rv: u64,
    /// collection path whose next request fails with 500
    fail_next: Option<String>,
    /// Watch requests are never answered (kept open until the test ends).
    held_watches: Vec<tower_test::mock::SendResponse<Response<Body>>>,
    /// Requests under these paths are never answered (a frozen connection).
    hang: Vec<String>,
    /// Requests under these paths are refused with 403 (RBAC removed).
    forbid: Vec<String>,
    /// Cluster-wide lists of this plural fail with 500 while set.
    fail_lists: Option<String>,
    /// ResourceQuota on pods: creating more than this many fails with 403.
    pod_quota: Option<usize>,
    /// Event series updates (PATCH of an existing Event).
    event_patches: Vec<Value>,
    /// Body of the last server-side apply of a status.
    last_status_apply: Option<Value>,
    /// After answering a GET of this object (collection path, name), another
    /// writer changes it: its resourceVersion moves on and the label
    /// `concurrent: "yes"` is set.
    concurrent_write_after_get: Option<(String, String)>,
}

#[derive(Clone, Default)]
struct FakeApi(Arc<Mutex<State>>);

fn status(code: u16, reason: &str, message: &str) -> (u16, Value) {
    (
        code,
        json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
               "message": message, "reason": reason, "code": code}),
    )
}

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' && i + 2 < b.len() {
            out.push(u8::from_str_radix(&s[i + 1..i + 3], 16).unwrap());
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).unwrap()
}

fn matches_selector(obj: &Value, selector: &str) -> bool {
    selector.split(',').filter(|s| !s.is_empty()).all(|kv| {
        let (k, v) = kv.split_once('=').unwrap();
        obj["metadata"]["labels"][k].as_str() == Some(v)
    })
}

impl FakeApi {
    fn start() -> (Self, Client) {
        let (svc, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let fake = FakeApi::default();
        let state = fake.clone();
        tokio::spawn(async move {
            while let Some((req, send)) = handle.next_request().await {
                let is_watch = req
                    .uri()
                    .query()
                    .is_some_and(|q| q.split('&').any(|kv| kv == "watch=true"));
                let path = req.uri().path().to_string();
                let hang = {
                    let st = state.0.lock().unwrap();
                    st.hang.iter().any(|h| path.starts_with(h.as_str()))
                };
                if is_watch || hang {
                    state.0.lock().unwrap().held_watches.push(send);
                    continue;
                }
                let (code, body) = state.handle(req).await;
                send.send_response(
                    Response::builder()
                        .status(StatusCode::from_u16(code).unwrap())
                        .header("content-type", "application/json")
                        .body(Body::from(serde_json::to_vec(&body).unwrap()))
                        .unwrap(),
                );
            }
        });
        (fake, Client::new(svc, "ml"))
    }

    async fn handle(&self, req: Request<Body>) -> (u16, Value) {
        let method = req.method().clone();
        let path = req.uri().path().to_string();
        let query = req.uri().query().unwrap_or("").to_string();
        let ctype = req
            .headers()
            .get("content-type")
            .map(|v| v.to_str().unwrap().to_string())
            .unwrap_or_default();
        let bytes = req.into_body().collect_bytes().await.unwrap();
        let body: Value = if bytes.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&bytes).unwrap_or(Value::Null)
        };
        let mut st = self.0.lock().unwrap();
        st.log.push(format!("{method} {path}?{query}"));
        if st.forbid.iter().any(|f| path.starts_with(f.as_str())) {
            return status(
                403,
                "Forbidden",
                &format!(
                    "{path} is forbidden: User \"system:serviceaccount:weft-system:weft\" cannot {method} it"
                ),
            );
        }

        // Cluster-wide list (the controller's watchers): every namespace.
        if !path.contains("/namespaces/") {
            assert_eq!(method, Method::GET, "cluster-wide {method} {path}");
            let plural = path.rsplit('/').next().unwrap().to_string();
            if st.fail_lists.as_deref() == Some(plural.as_str()) {
                return status(500, "InternalError", "etcd unavailable");
            }
            let selector = query
                .split('&')
                .find_map(|kv| kv.strip_prefix("labelSelector="))
                .map(percent_decode)
                .unwrap_or_default();
            let items: Vec<Value> = st
                .objects
                .iter()
                .filter(|(c, _)| c.ends_with(&format!("/{plural}")))
                .flat_map(|(_, o)| o.values())
                .filter(|o| matches_selector(o, &selector))
                .cloned()
                .collect();
            return (
                200,
                json!({"apiVersion": "v1", "kind": "List", "metadata": {"resourceVersion": st.rv.to_string()}, "items": items}),
            );
        }

        // Split /.../{plural}[/{name}[/status]]
        let segs: Vec<&str> = path.trim_start_matches('/').split('/').collect();
        let ns_pos = segs
            .iter()
            .position(|s| *s == "namespaces")
            .expect("namespaced request");
        let coll = format!("/{}", segs[..ns_pos + 3].join("/"));
        let name = segs.get(ns_pos + 3).map(|s| s.to_string());
        let sub = segs.get(ns_pos + 4).map(|s| s.to_string());
        if st.fail_next.as_deref() == Some(coll.as_str()) {
            st.fail_next = None;
            return status(500, "InternalError", "injected failure");
        }
        if coll == EVENTS {
            if method == Method::POST {
                st.events.push(body.clone());
                return (201, body);
            }
            st.event_patches.push(body.clone());
            return (200, body);
        }
        st.rv += 1;
        let rv = st.rv.to_string();
        let pod_quota = st.pod_quota;
        if ctype.contains("apply-patch") && sub.as_deref() == Some("status") {
            st.last_status_apply = Some(body.clone());
        }
        let concurrent = st.concurrent_write_after_get.clone();
        let objs = st.objects.entry(coll.clone()).or_default();
        match (method, name) {
            (Method::GET, Some(n)) => match objs.get_mut(&n) {
                Some(o) => {
                    let reply = o.clone();
                    if concurrent == Some((coll.clone(), n.clone())) {
                        o["metadata"]["resourceVersion"] = json!(format!("{rv}-other"));
                        o["metadata"]["labels"]["concurrent"] = json!("yes");
                    }
                    (200, reply)
                }
                None => status(404, "NotFound", &format!("{n} not found")),
            },
            (Method::GET, None) => {
                let selector = query
                    .split('&')
                    .find_map(|kv| kv.strip_prefix("labelSelector="))
                    .map(percent_decode)
                    .unwrap_or_default();
                let items: Vec<Value> = objs
                    .values()
                    .filter(|o| matches_selector(o, &selector))
                    .cloned()
                    .collect();
                (
                    200,
                    json!({"apiVersion": "v1", "kind": "List", "metadata": {"resourceVersion": rv}, "items": items}),
                )
            }
            (Method::POST, None) => {
                let mut obj = body;
                let n = obj["metadata"]["name"].as_str().unwrap().to_string();
                // Admission as the apiserver does it, for the cases the tests need.
                if coll == PODS {
                    let text = obj.to_string();
                    if text.contains("\"lots\"") {
                        return status(
                            400,
                            "BadRequest",
                            "quantities must match the regular expression '^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$'",
                        );
                    }
                    if let Some(pc) = obj["spec"]["priorityClassName"].as_str()
                        && pc == "missing"
                    {
                        return status(
                            403,
                            "Forbidden",
                            &format!(
                                "pods \"{n}\" is forbidden: no PriorityClass with name missing was found"
                            ),
                        );
                    }
                    if pod_quota.is_some_and(|q| objs.len() >= q) {
                        return status(
                            403,
                            "Forbidden",
                            &format!(
                                "pods \"{n}\" is forbidden: exceeded quota: gpu-quota, requested: pods=1, used: pods=1, limited: pods=1"
                            ),
                        );
                    }
                }
                // Pod validation as the apiserver does it, for one field.
                if coll == PODS
                    && obj["spec"]["containers"]
                        .as_array()
                        .is_some_and(|cs| cs.iter().any(|c| c["image"].is_null()))
                {
                    return status(
                        422,
                        "Invalid",
                        &format!(
                            "Pod \"{n}\" is invalid: spec.containers[0].image: Required value"
                        ),
                    );
                }
                if objs.contains_key(&n) {
                    return status(409, "AlreadyExists", &format!("{n} already exists"));
                }
                obj["metadata"]["uid"] = json!(format!("uid-{n}-{rv}"));
                obj["metadata"]["resourceVersion"] = json!(rv);
                objs.insert(n, obj.clone());
                (201, obj)
            }
            (Method::PATCH, Some(n)) => {
                let existing = objs.get(&n).cloned();
                let obj = if ctype.contains("json-patch") {
                    let Some(mut obj) = existing else {
                        return status(404, "NotFound", &n);
                    };
                    // `test` of a missing path against null means "absent": accept it.
                    let ops: Vec<Value> = body
                        .as_array()
                        .unwrap()
                        .iter()
                        .filter(|op| {
                            !(op["op"] == "test"
                                && op["value"].is_null()
                                && obj.pointer(op["path"].as_str().unwrap()).is_none())
                        })
                        .cloned()
                        .collect();
                    let patch: json_patch::Patch =
                        serde_json::from_value(Value::Array(ops)).unwrap();
                    if let Err(e) = json_patch::patch(&mut obj, &patch) {
                        return status(422, "Invalid", &e.to_string());
                    }
                    obj
                } else if ctype.contains("merge-patch") {
                    let Some(mut obj) = existing else {
                        return status(404, "NotFound", &n);
                    };
                    if sub.as_deref() == Some("status") {
                        json_patch::merge(&mut obj["status"], &body["status"]);
                    } else {
                        json_patch::merge(&mut obj, &body);
                    }
                    obj
                } else if ctype.contains("apply-patch") {
                    assert!(
                        query.contains("fieldManager=weft-operator"),
                        "SSA without our field manager: {query}"
                    );
                    assert!(query.contains("force=true"), "SSA without force: {query}");
                    if coll == SERVICES && n.contains('.') {
                        return status(
                            422,
                            "Invalid",
                            &format!(
                                "Service \"{n}\" is invalid: metadata.name: Invalid value: \"{n}\": a DNS-1035 label must consist of lower case alphanumeric characters or '-'"
                            ),
                        );
                    }
                    // A resourceVersion in an apply is a precondition.
                    let sent = &body["metadata"]["resourceVersion"];
                    if let Some(e) = &existing
                        && !sent.is_null()
                        && *sent != e["metadata"]["resourceVersion"]
                    {
                        return status(
                            409,
                            "Conflict",
                            "Operation cannot be fulfilled: the object has been modified; please apply your changes to the latest version and try again",
                        );
                    }
                    if sub.as_deref() == Some("status") {
                        let Some(mut obj) = existing else {
                            return status(404, "NotFound", &n);
                        };
                        obj["status"] = body["status"].clone();
                        obj
                    } else {
                        let mut obj = existing.unwrap_or_else(|| {
                            let mut b = body.clone();
                            b["metadata"]["uid"] = json!(format!("uid-{n}-{rv}"));
                            b
                        });
                        obj["spec"] = body["spec"].clone();
                        obj["metadata"]["labels"] = body["metadata"]["labels"].clone();
                        obj
                    }
                } else {
                    panic!("unexpected patch type {ctype}");
                };
                let mut obj = obj;
                obj["metadata"]["resourceVersion"] = json!(rv);
                let gone = obj["metadata"]["deletionTimestamp"].is_string()
                    && obj["metadata"]["finalizers"]
                        .as_array()
                        .is_none_or(|f| f.is_empty());
                objs.insert(n.clone(), obj.clone());
                if gone {
                    st.remove(&coll, &n);
                }
                (200, obj)
            }
            (Method::PUT, Some(n)) => {
                // replace: optimistic concurrency on resourceVersion, as the apiserver does
                let Some(existing) = objs.get(&n) else {
                    return status(404, "NotFound", &n);
                };
                let sent = body["metadata"]["resourceVersion"].clone();
                if !sent.is_null() && sent != existing["metadata"]["resourceVersion"] {
                    return status(409, "Conflict", "the object has been modified");
                }
                let mut obj = body;
                obj["metadata"]["uid"] = existing["metadata"]["uid"].clone();
                obj["metadata"]["resourceVersion"] = json!(rv);
                objs.insert(n, obj.clone());
                (200, obj)
            }
            (Method::DELETE, Some(n)) => {
                let Some(mut obj) = objs.get(&n).cloned() else {
                    return status(404, "NotFound", &n);
                };
                // Foreground deletion: the object stays until the garbage
                // collector has deleted its dependents (the test removes it).
                if body["propagationPolicy"] == "Foreground" {
                    obj["metadata"]["finalizers"] = json!(["foregroundDeletion"]);
                }
                if obj["metadata"]["finalizers"]
                    .as_array()
                    .is_some_and(|f| !f.is_empty())
                {
                    obj["metadata"]["deletionTimestamp"] = json!("2026-01-01T00:00:00Z");
                    objs.insert(n, obj.clone());
                } else {
                    st.remove(&coll, &n);
                }
                (200, obj)
            }
            (m, n) => panic!("unexpected request {m} {coll} {n:?}"),
        }
    }
}

impl State {
    /// Removes an object and, like the garbage collector, everything it owns.
    fn remove(&mut self, coll: &str, name: &str) {
        let Some(obj) = self.objects.get_mut(coll).and_then(|o| o.remove(name)) else {
            return;
        };
        let uid = obj["metadata"]["uid"].clone();
        let mut owned = vec![];
        for (c, objs) in &self.objects {
            for (n, o) in objs {
                let refs = o["metadata"]["ownerReferences"]
                    .as_array()
                    .cloned()
                    .unwrap_or_default();
                if refs.iter().any(|r| r["uid"] == uid) {
                    owned.push((c.clone(), n.clone()));
                }
            }
        }
        for (c, n) in owned {
            self.remove(&c, &n);
        }
    }
}

impl FakeApi {
    fn get(&self, coll: &str, name: &str) -> Option<Value> {
        self.0
            .lock()
            .unwrap()
            .objects
            .get(coll)
            .and_then(|o| o.get(name))
            .cloned()
    }
    fn names(&self, coll: &str) -> Vec<String> {
        self.0
            .lock()
            .unwrap()
            .objects
            .get(coll)
            .map(|o| o.keys().cloned().collect())
            .unwrap_or_default()
    }
    fn put(&self, coll: &str, obj: Value) {
        let name = obj["metadata"]["name"].as_str().unwrap().to_string();
        self.0
            .lock()
            .unwrap()
            .objects
            .entry(coll.into())
            .or_default()
            .insert(name, obj);
    }
    fn job(&self, name: &str) -> Option<CollectiveJob> {
        self.get(JOBS, name)
            .map(|v| serde_json::from_value(v).unwrap())
    }
    fn pod(&self, name: &str) -> Pod {
        serde_json::from_value(self.get(PODS, name).unwrap()).unwrap()
    }
    fn set_pod(&self, pod: Pod) {
        self.put(PODS, serde_json::to_value(pod).unwrap());
    }
    fn event_reasons(&self) -> Vec<String> {
        self.0
            .lock()
            .unwrap()
            .events
            .iter()
            .map(|e| e["reason"].as_str().unwrap().to_string())
            .collect()
    }
    /// The notes of the recorded events, oldest first; with a `reason`, only
    /// the notes of events of that reason.
    fn event_notes(&self, reason: Option<&str>) -> Vec<String> {
        self.0
            .lock()
            .unwrap()
            .events
            .iter()
            .filter(|e| reason.is_none_or(|r| e["reason"] == r))
            .map(|e| e["note"].as_str().unwrap().to_string())
            .collect()
    }
    fn writes(&self) -> Vec<String> {
        self.0
            .lock()
            .unwrap()
            .log
            .iter()
            .filter(|l| !l.starts_with("GET"))
            .cloned()
            .collect()
    }
    /// Everything observable, minus resource versions: equal snapshots mean
    /// the last reconcile changed nothing.
    fn snapshot(&self) -> String {
        let st = self.0.lock().unwrap();
        let mut objs = st.objects.clone();
        for o in objs.values_mut().flat_map(|m| m.values_mut()) {
            o["metadata"]
                .as_object_mut()
                .map(|m| m.remove("resourceVersion"));
        }
        format!(
            "{}{}",
            serde_json::to_string(&objs).unwrap(),
            st.events.len()
        )
    }
    fn delete(&self, coll: &str, name: &str) {
        self.0.lock().unwrap().remove(coll, name);
    }
}

struct Harness {
    api: FakeApi,
    ctx: Arc<Context>,
    now: Arc<Mutex<Timestamp>>,
}

impl Harness {
    fn new() -> Self {
        let (api, client) = FakeApi::start();
        let now = Arc::new(Mutex::new(Timestamp::from_second(1_800_000_000).unwrap()));
        let clock_now = now.clone();
        let ctx = Context::with_clock(
            client,
            OperatorConfig::default(),
            Arc::default(),
            Arc::new(move || *clock_now.lock().unwrap()),
            "weft-operator-test".into(),
        );
        Harness {
            api,
            ctx: Arc::new(ctx),
            now,
        }
    }

    /// Stores a job as `kubectl apply` would.
    fn submit(&self, job: CollectiveJob) {
        let mut v = serde_json::to_value(job).unwrap();
        v["metadata"]["creationTimestamp"] = json!("2026-11-21T06:00:00Z");
        self.api.put(JOBS, v);
    }

    async fn reconcile(&self, name: &str) -> Result<Action, Error> {
        let job = self.api.job(name).expect("job exists");
        reconcile(Arc::new(job), self.ctx.clone()).await
    }

    /// Reconciles until nothing changes (at most 6 rounds).
    async fn settle(&self, name: &str) {
        for _ in 0..6 {
            let before = self.api.snapshot();
            if self.api.job(name).is_none() {
                return;
            }
            self.reconcile(name).await.expect("reconcile");
            if self.api.snapshot() == before {
                return;
            }
        }
        panic!("did not settle: {:#?}", self.api.writes());
    }

    fn status(&self, name: &str) -> crate::crd::CollectiveJobStatus {
        self.api.job(name).unwrap().status.unwrap()
    }

    /// Sets every pod's phase and its first container's state, as a kubelet would.
    fn set_pods(&self, phase: &str, ready: bool, code: Option<i32>) {
        for n in self.api.names(PODS) {
            let container = self.api.pod(&n).spec.unwrap().containers[0].name.clone();
            let cs = match code {
                Some(c) => cs_exited(&container, c),
                None => cs_running(&container),
            };
            self.api
                .set_pod(with_status(self.api.pod(&n), phase, ready, vec![cs]));
        }
    }

    fn advance(&self, secs: i64) {
        let mut t = self.now.lock().unwrap();
        *t = Timestamp::from_second(t.as_second() + secs).unwrap();
    }
}

fn env_value(pod: &Pod, name: &str) -> Option<String> {
    pod.spec.as_ref().unwrap().containers[0]
        .env
        .iter()
        .flatten()
        .find(|e| e.name == name)
        .and_then(|e| e.value.clone())
}

#[tokio::test]
async fn creation_adds_finalizer_then_service_secret_pods_status() {
    let h = Harness::new();
    h.submit(make_job("train", 2, 4));

    // First pass only adds the finalizer (JSON patch), as kube's finalizer helper does.
    h.reconcile("train").await.unwrap();
    assert_eq!(
        h.api.job("train").unwrap().metadata.finalizers,
        Some(vec![FINALIZER.to_string()])
    );
    assert!(h.api.names(PODS).is_empty());

    h.reconcile("train").await.unwrap();
    let svc: Service = serde_json::from_value(h.api.get(SERVICES, "train").unwrap()).unwrap();
    let spec = svc.spec.unwrap();
    assert_eq!(spec.cluster_ip.as_deref(), Some("None"));
    assert_eq!(spec.publish_not_ready_addresses, Some(true));
    let secret: Secret =
        serde_json::from_value(h.api.get(SECRETS, "train-weft-token-uid1").unwrap()).unwrap();
    let token = secret.data.unwrap()["token"].0.clone();
    assert_eq!(token.len(), 64);
    assert_eq!(h.api.names(PODS), ["train-0", "train-1"]);
    let pod1 = h.api.pod("train-1");
    assert_eq!(env_value(&pod1, "WEFT_RANK_OFFSET").as_deref(), Some("4"));
    assert_eq!(env_value(&pod1, "WEFT_WORLD_SIZE").as_deref(), Some("8"));
    assert_eq!(
        env_value(&pod1, "WEFT_BOOTSTRAP").as_deref(),
        Some("train-0.train.ml.svc:29400")
    );
    assert_eq!(pod1.owner_references()[0].name, "train");

    let st = h.status("train");
    assert_eq!(st.phase, Some(JobPhase::Pending));
    assert_eq!(st.world_size, 8);
    assert_eq!(st.ranks.len(), 2);
    assert_eq!(st.ranks[1].first_rank, 4);
    assert_eq!(st.observed_generation, Some(1));
    assert_eq!(h.api.event_reasons(), ["PodsCreated"]);
    assert!(
        h.api
            .writes()
            .iter()
            .any(|w| w.starts_with(&format!("PATCH {JOBS}/train/status?"))
                && w.contains("fieldManager=weft-operator")),
        "status written by server-side apply on the status subresource"
    );

    // The next pass sees the new pods (rank table: Missing -> Pending); after
    // that the reconcile is idempotent: nothing changed, so nothing is written
    // (the Service apply is the only write, a no-op on a real apiserver), and
    // the token is kept.
    h.reconcile("train").await.unwrap();
    assert_eq!(h.status("train").ranks[0].phase, "Pending");
    let before: Vec<String> = h.api.writes();
    h.reconcile("train").await.unwrap();
    let after = h.api.writes();
    let new: Vec<_> = after[before.len()..].to_vec();
    assert!(
        new.iter()
            .all(|w| w.starts_with(&format!("PATCH {SERVICES}/train"))),
        "{new:#?}"
    );
    let secret: Secret =
        serde_json::from_value(h.api.get(SECRETS, "train-weft-token-uid1").unwrap()).unwrap();
    assert_eq!(secret.data.unwrap()["token"].0, token);
}

#[tokio::test]
async fn status_follows_pods_to_success() {
    let h = Harness::new();
    h.submit(make_job("ok", 2, 1));
    h.settle("ok").await;
    h.set_pods("Running", true, None);
    h.settle("ok").await;
    let st = h.status("ok");
    assert_eq!(st.phase, Some(JobPhase::Running));
    assert_eq!(st.ready.as_deref(), Some("2/2"));
    assert!(
        st.ranks
            .iter()
            .all(|r| r.ready && r.node.as_deref() == Some("node-a"))
    );
    h.set_pods("Succeeded", false, Some(0));
    h.settle("ok").await;
    let st = h.status("ok");
    assert_eq!(st.phase, Some(JobPhase::Succeeded));
    assert!(st.completion_time.is_some());
    assert_eq!(
        h.api.event_reasons(),
        ["PodsCreated", "Running", "Succeeded"]
    );
    // cleanPodPolicy Running keeps finished pods for their logs
    assert_eq!(h.api.names(PODS).len(), 2);
}

#[tokio::test]
async fn pod_failure_restarts_job_with_new_epoch() {
    let h = Harness::new();
    h.submit(make_job("r", 2, 2));
    h.settle("r").await;
    h.set_pods("Running", true, None);
    h.settle("r").await;
    let uid_before = h.api.pod("r-0").metadata.uid.clone();

    h.fail_pod("r-1", 1);
    h.reconcile("r").await.unwrap();
    let st = h.status("r");
    assert_eq!(st.phase, Some(JobPhase::Restarting));
    assert_eq!((st.restarts, st.restart_epoch), (1, 1));
    assert_eq!(st.last_failure.as_ref().unwrap().pod, "r-1");
    assert!(h.api.names(PODS).is_empty(), "all pods deleted");

    h.settle("r").await;
    assert_eq!(h.api.names(PODS), ["r-0", "r-1"]);
    let pod = h.api.pod("r-0");
    assert_ne!(pod.metadata.uid, uid_before);
    assert_eq!(env_value(&pod, "WEFT_RESTART_EPOCH").as_deref(), Some("1"));
    assert_eq!(pod.labels()["weft.dev/restart-epoch"], "1");
    h.set_pods("Running", true, None);
    h.settle("r").await;
    assert_eq!(h.status("r").phase, Some(JobPhase::Running));
    assert_eq!(
        h.api.event_reasons(),
        [
            "PodsCreated",
            "Running",
            "RankFailed",
            "Restarting",
            "PodsCreated",
            "Running"
        ]
    );
    assert_eq!(h.ctx.metrics.job_restarts.get(), 1);
}

#[tokio::test]
async fn max_restarts_reached_fails_naming_pod_container_exit_code() {
    let h = Harness::new();
    let mut j = make_job("m", 2, 1);
    j.spec.failure_policy.max_restarts = 1;
    h.submit(j);
    for _ in 0..2 {
        h.settle("m").await;
        h.set_pods("Running", true, None);
        h.settle("m").await;
        h.fail_pod("m-0", 3);
        h.settle("m").await;
    }
    let st = h.status("m");
    assert_eq!(st.phase, Some(JobPhase::Failed));
    assert_eq!(st.restarts, 1);
    let cond = st.conditions.iter().find(|c| c.type_ == "Failed").unwrap();
    assert_eq!(cond.reason, "MaxRestartsExceeded");
    assert!(
        cond.message
            .contains("pod m-0 (container main, exit code 3"),
        "{}",
        cond.message
    );
    // the running survivor is cleaned, the failed pod is kept for its logs
    assert_eq!(h.api.names(PODS), ["m-0"]);
    assert_eq!(h.api.event_reasons().last().unwrap(), "MaxRestartsExceeded");
}

#[tokio::test]
async fn suspend_deletes_pods_and_resume_recreates_them() {
    let h = Harness::new();
    h.submit(make_job("s", 3, 1));
    h.settle("s").await;
    h.set_pods("Running", true, None);
    h.settle("s").await;

    let mut j = h.api.job("s").unwrap();
    j.spec.run_policy.suspend = true;
    h.api.put(JOBS, serde_json::to_value(&j).unwrap());
    h.settle("s").await;
    assert!(h.api.names(PODS).is_empty());
    let st = h.status("s");
    assert_eq!(st.phase, Some(JobPhase::Suspended));
    assert_eq!((st.restarts, st.restart_epoch), (0, 1));

    let mut j = h.api.job("s").unwrap();
    j.spec.run_policy.suspend = false;
    h.api.put(JOBS, serde_json::to_value(&j).unwrap());
    h.settle("s").await;
    assert_eq!(h.api.names(PODS).len(), 3);
    assert_eq!(h.status("s").phase, Some(JobPhase::Pending));
    assert_eq!(
        env_value(&h.api.pod("s-2"), "WEFT_RESTART_EPOCH").as_deref(),
        Some("1")
    );
    let reasons = h.api.event_reasons();
    assert_eq!(reasons[2..], ["Suspended", "Resumed", "PodsCreated"]);
}

#[tokio::test]
async fn pod_deleted_by_hand_counts_as_failure() {
    let h = Harness::new();
    h.submit(make_job("d", 2, 1));
    h.settle("d").await;
    h.set_pods("Running", true, None);
    h.settle("d").await;
    h.api.delete(PODS, "d-1");
    h.reconcile("d").await.unwrap();
    let st = h.status("d");
    assert_eq!(st.phase, Some(JobPhase::Restarting));
    assert_eq!(st.restarts, 1);
    assert_eq!(st.last_failure.unwrap().reason, "PodDeleted");
}

#[tokio::test]
async fn deletion_runs_finalizer_cleanup() {
    let h = Harness::new();
    h.submit(make_job("del", 2, 1));
    h.settle("del").await;
    h.set_pods("Running", true, None);
    h.settle("del").await;

    // `kubectl delete`: the apiserver only sets deletionTimestamp while our finalizer is there.
    let client = h.ctx.client.clone();
    let jobs: Api<CollectiveJob> = Api::namespaced(client, "ml");
    jobs.delete("del", &DeleteParams::default()).await.unwrap();
    assert!(
        h.api
            .job("del")
            .unwrap()
            .metadata
            .deletion_timestamp
            .is_some()
    );
    h.reconcile("del").await.unwrap();
    assert!(h.api.job("del").is_none(), "finalizer removed, object gone");
    assert!(h.api.names(PODS).is_empty());
    assert!(
        h.api.get(SERVICES, "del").is_none(),
        "owned Service collected"
    );
    assert!(
        h.api.get(SECRETS, "del-weft-token-uid1").is_none(),
        "owned Secret collected"
    );
    assert_eq!(h.api.event_reasons().last().unwrap(), "Deleting");
}

#[tokio::test]
async fn deadline_then_ttl_deletes_job() {
    let h = Harness::new();
    let mut j = make_job("t", 1, 1);
    j.spec.run_policy.active_deadline_seconds = Some(60);
    j.spec.run_policy.ttl_seconds_after_finished = Some(30);
    h.submit(j);
    h.settle("t").await;
    h.set_pods("Running", true, None);
    h.settle("t").await;
    h.advance(61);
    let action = h.reconcile("t").await.unwrap();
    let st = h.status("t");
    assert_eq!(st.phase, Some(JobPhase::Failed));
    assert!(st.conditions.iter().any(|c| c.reason == "DeadlineExceeded"));
    assert!(h.api.names(PODS).is_empty(), "running pod cleaned");
    assert_eq!(action, Action::requeue(Duration::from_secs(30)));
    h.advance(30);
    h.reconcile("t").await.unwrap();
    h.reconcile("t").await.unwrap();
    assert!(h.api.job("t").is_none(), "TTL deleted the job");
}

#[tokio::test]
async fn api_errors_fail_the_reconcile_and_are_counted() {
    let h = Harness::new();
    h.submit(make_job("e", 1, 1));
    h.reconcile("e").await.unwrap(); // finalizer
    h.api.0.lock().unwrap().fail_next = Some(PODS.into());
    let job = Arc::new(h.api.job("e").unwrap());
    let err = reconcile(job.clone(), h.ctx.clone()).await.unwrap_err();
    assert_eq!(err.kind(), "apply");
    let action = error_policy(job, &err, h.ctx.clone());
    assert_eq!(action, Action::requeue(Duration::from_secs(15)));
    assert!(
        h.ctx
            .metrics
            .encode()
            .contains("reconcile_errors_total{error=\"apply\"} 1")
    );
    // and the next reconcile recovers
    h.settle("e").await;
    assert_eq!(h.api.names(PODS), ["e-0"]);
}

/// Writes a rendered Pod and a status object for docs/KUBERNETES.md to
/// target/weft-operator-docs (run with `cargo test -p weft-operator docs_artifacts`).
#[tokio::test]
async fn docs_artifacts() {
    let h = Harness::new();
    let mut j = make_job("bench", 2, 4);
    j.spec.template = serde_json::from_value(json!({"spec": {"containers": [{
        "name": "bench", "image": "ghcr.io/weft-dev/weft:0.1.0",
        "command": ["weft", "run", "-n", "$(WEFT_LOCAL_RANKS)", "--", "weft", "bench", "all_reduce",
                    "-b", "1K", "-e", "16M", "-f", "2", "--check"]
    }]}}))
    .unwrap();
    h.submit(j);
    h.settle("bench").await;
    h.advance(20);
    h.set_pods("Running", true, None);
    h.settle("bench").await;
    h.advance(95);
    let failed = with_status(
        h.api.pod("bench-1"),
        "Failed",
        false,
        vec![cs_exited("bench", 1)],
    );
    h.api.set_pod(failed);
    h.settle("bench").await;
    h.advance(25);
    h.set_pods("Running", true, None);
    h.settle("bench").await;
    h.advance(300);
    h.set_pods("Succeeded", false, Some(0));
    h.settle("bench").await;
    let st = h.status("bench");
    assert_eq!(st.phase, Some(JobPhase::Succeeded));
    let mut pod = h.api.get(PODS, "bench-1").unwrap();
    pod.as_object_mut().unwrap().remove("status");
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/weft-operator-docs");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("pod.yaml"), serde_yaml::to_string(&pod).unwrap()).unwrap();
    let status = h.api.get(JOBS, "bench").unwrap()["status"].clone();
    std::fs::write(
        dir.join("status.yaml"),
        serde_yaml::to_string(&status).unwrap(),
    )
    .unwrap();
}

#[tokio::test]
async fn leader_election_against_mock_api() {
    use crate::leader::{LeaseConfig, release, try_acquire_or_renew};
    use k8s_openapi::api::coordination::v1::Lease;
    const LEASES: &str = "/apis/coordination.k8s.io/v1/namespaces/weft-system/leases";

    let h = Harness::new();
    let leases: Api<Lease> = Api::namespaced(h.ctx.client.clone(), "weft-system");
    let a = LeaseConfig::new("weft-system", "operator-a");
    let b = LeaseConfig::new("weft-system", "operator-b");

    assert!(
        try_acquire_or_renew(&leases, &a).await.unwrap(),
        "a creates the lease"
    );
    assert!(
        !try_acquire_or_renew(&leases, &b).await.unwrap(),
        "b must wait"
    );
    assert!(try_acquire_or_renew(&leases, &a).await.unwrap(), "a renews");
    let lease = h.api.get(LEASES, "weft-operator-leader").unwrap();
    assert_eq!(lease["spec"]["holderIdentity"], "operator-a");
    assert_eq!(lease["spec"]["leaseTransitions"], 0);

    // a stops renewing: once the lease has expired, b takes over and a is out.
    let mut stale = lease.clone();
    stale["spec"]["renewTime"] = json!("2020-01-01T00:00:00.000000Z");
    h.api.put(LEASES, stale);
    assert!(
        try_acquire_or_renew(&leases, &b).await.unwrap(),
        "b takes the expired lease"
    );
    assert!(
        !try_acquire_or_renew(&leases, &a).await.unwrap(),
        "a lost it"
    );
    let lease = h.api.get(LEASES, "weft-operator-leader").unwrap();
    assert_eq!(lease["spec"]["holderIdentity"], "operator-b");
    assert_eq!(lease["spec"]["leaseTransitions"], 1);

    // a write based on an old read loses (409), it does not overwrite
    let mut old: Lease = serde_json::from_value(lease.clone()).unwrap();
    assert!(try_acquire_or_renew(&leases, &b).await.unwrap());
    old.spec.as_mut().unwrap().holder_identity = Some("operator-a".into());
    let err = leases
        .replace("weft-operator-leader", &Default::default(), &old)
        .await
        .unwrap_err();
    assert!(matches!(err, kube::Error::Api(s) if s.is_conflict()));

    // graceful shutdown hands the lease back; a takes it at once
    release(&leases, &a).await; // not the holder: no-op
    assert_eq!(
        h.api.get(LEASES, "weft-operator-leader").unwrap()["spec"]["holderIdentity"],
        "operator-b"
    );
    release(&leases, &b).await;
    assert!(h.api.get(LEASES, "weft-operator-leader").unwrap()["spec"]["holderIdentity"].is_null());
    assert!(try_acquire_or_renew(&leases, &a).await.unwrap());
}

/// The real `Controller` loop (watchers, owned-object triggers, scheduler)
/// wired as in production: it reconciles the jobs it lists and stops when the
/// shutdown future resolves. Watches are held open by the fake apiserver.
#[tokio::test]
async fn controller_loop_reconciles_and_shuts_down_gracefully() {
    let h = Harness::new();
    let mut j = make_job("live", 2, 1);
    // as after a first pass: the finalizer is there, so the first reconcile applies
    j.metadata.finalizers = Some(vec![FINALIZER.to_string()]);
    h.submit(j);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(run(h.ctx.client.clone(), h.ctx.clone(), true, async {
        let _ = stopped.await;
    }));
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let status = h.api.job("live").and_then(|j| j.status);
        if h.api.names(PODS).len() == 2
            && status.is_some_and(|s| s.phase == Some(JobPhase::Pending))
        {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "controller did not reconcile: {:#?}",
            h.api.writes()
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let _ = stop.send(());
    tokio::time::timeout(std::time::Duration::from_secs(5), task)
        .await
        .expect("controller stops on the shutdown signal")
        .unwrap();
    assert!(h.ctx.metrics.reconciles.get() >= 1);
}

#[tokio::test]
async fn pod_refused_by_the_apiserver_fails_the_job_with_its_message() {
    let h = Harness::new();
    let mut j = make_job("bad", 2, 1);
    j.spec.template.spec.as_mut().unwrap().containers[0].image = None;
    h.submit(j);
    h.settle("bad").await;
    let st = h.status("bad");
    assert_eq!(st.phase, Some(JobPhase::Failed));
    let c = st.conditions.iter().find(|c| c.type_ == "Failed").unwrap();
    assert_eq!(c.reason, "InvalidSpec");
    assert!(
        c.message
            .contains("spec.containers[0].image: Required value"),
        "{}",
        c.message
    );
    assert!(h.api.names(PODS).is_empty());
    assert_eq!(h.api.event_reasons(), ["InvalidSpec"]);
}

// ---- issue 19: the operator against a real API server's behaviour ----

fn condition(st: &crate::crd::CollectiveJobStatus, type_: &str) -> Condition {
    st.conditions
        .iter()
        .find(|c| c.type_ == type_)
        .unwrap_or_else(|| panic!("no {type_} condition in {st:#?}"))
        .clone()
}

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;

async fn wait_for(what: &str, secs: u64, mut f: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(secs);
    while !f() {
        assert!(tokio::time::Instant::now() < deadline, "timed out: {what}");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// Issue 19 (1): a job whose template does not decode (`command: "sleep 1"`,
/// accepted by the old untyped CRD) made every list of CollectiveJobs fail,
/// so no job got pods. Now the others run, the bad one is marked with a
/// condition and an event, and readiness reflects the working watch.
#[tokio::test]
async fn undecodable_job_does_not_stop_the_watch_of_the_others() {
    let h = Harness::new();
    let mut good = make_job("live", 2, 1);
    good.metadata.finalizers = Some(vec![FINALIZER.to_string()]);
    h.submit(good);
    h.api.put(
        JOBS,
        json!({
            "apiVersion": "weft.dev/v1alpha1", "kind": "CollectiveJob",
            "metadata": {"name": "bad", "namespace": "ml", "uid": "uid-bad", "resourceVersion": "3", "generation": 1},
            "spec": {"template": {"spec": {"containers": [{"name": "main", "image": "busybox", "command": "sleep 1"}]}}}
        }),
    );
    assert!(!h.ctx.readiness.watch_ok.load(Ordering::Relaxed));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(run(h.ctx.client.clone(), h.ctx.clone(), true, async {
        let _ = stopped.await;
    }));
    wait_for("the good job gets its pods", 10, || {
        h.api.names(PODS).len() == 2
            && h.api
                .job("live")
                .and_then(|j| j.status)
                .is_some_and(|s| s.phase == Some(JobPhase::Pending))
    })
    .await;
    wait_for("the bad job is marked", 10, || {
        h.api.get(JOBS, "bad").unwrap()["status"]["conditions"][0]["type"] == "Decodable"
    })
    .await;
    let bad = h.api.get(JOBS, "bad").unwrap();
    let c = &bad["status"]["conditions"][0];
    assert_eq!(c["status"], "False");
    assert!(
        c["message"]
            .as_str()
            .unwrap()
            .contains("invalid type: string \"sleep 1\", expected a sequence"),
        "{c}"
    );
    wait_for("an event on the bad job", 5, || {
        h.api
            .0
            .lock()
            .unwrap()
            .events
            .iter()
            .any(|e| e["reason"] == "InvalidObject" && e["regarding"]["name"] == "bad")
    })
    .await;
    assert!(
        h.ctx.readiness.watch_ok.load(Ordering::Relaxed),
        "watch is up"
    );
    assert!(h.api.names(PODS).iter().all(|p| p.starts_with("live-")));
    let _ = stop.send(());
    tokio::time::timeout(std::time::Duration::from_secs(5), task)
        .await
        .expect("controller stops on the shutdown signal")
        .unwrap();
    assert!(!h.ctx.readiness.watch_ok.load(Ordering::Relaxed));
}

/// Issue 19 (1): `/readyz` said 200 while the operator could not list jobs.
#[tokio::test]
async fn readiness_follows_the_job_watch() {
    let h = Harness::new();
    h.api.0.lock().unwrap().fail_lists = Some("collectivejobs".into());
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(run(h.ctx.client.clone(), h.ctx.clone(), false, async {
        let _ = stopped.await;
    }));
    wait_for("a failed list", 5, || {
        h.api
            .0
            .lock()
            .unwrap()
            .log
            .iter()
            .any(|l| l.contains("/collectivejobs?"))
    })
    .await;
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    assert!(!h.ctx.readiness.watch_ok.load(Ordering::Relaxed));
    h.ctx.readiness.leading.store(true, Ordering::Relaxed);
    assert!(h.ctx.readiness.check().is_err());
    h.api.0.lock().unwrap().fail_lists = None;
    wait_for("the watch recovers", 10, || {
        h.ctx.readiness.watch_ok.load(Ordering::Relaxed)
    })
    .await;
    assert!(h.ctx.readiness.check().is_ok());
    let _ = stop.send(());
    tokio::time::timeout(std::time::Duration::from_secs(5), task)
        .await
        .expect("controller stops")
        .unwrap();
}

/// Issue 19 (2): a leader whose connection freezes steps down (metric 0,
/// unready) within the renew deadline, before the lease can expire.
#[tokio::test]
async fn leader_that_cannot_renew_steps_down_before_the_lease_expires() {
    use crate::leader::{LeaseConfig, lead, try_acquire_or_renew};
    use k8s_openapi::api::coordination::v1::Lease;
    const LEASES: &str = "/apis/coordination.k8s.io/v1/namespaces/weft-system/leases";
    let h = Harness::new();
    let leases: Api<Lease> = Api::namespaced(h.ctx.client.clone(), "weft-system");
    let cfg = LeaseConfig {
        lease_duration: Duration::from_millis(3000),
        renew_deadline: Duration::from_millis(1000),
        renew_every: Duration::from_millis(200),
        request_timeout: Duration::from_millis(500),
        ..LeaseConfig::new("weft-system", "operator-a")
    };
    cfg.check().unwrap();
    assert!(try_acquire_or_renew(&leases, &cfg).await.unwrap());
    let readiness = h.ctx.readiness.clone();
    readiness.watch_ok.store(true, Ordering::Relaxed);
    let metrics = h.ctx.metrics.clone();
    let (c2, r2, m2, l2) = (
        cfg.clone(),
        readiness.clone(),
        metrics.clone(),
        leases.clone(),
    );
    let start = tokio::time::Instant::now();
    let leading = tokio::spawn(async move { lead(&l2, &c2, &m2, &r2).await });
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(metrics.leader.get(), 1);
    assert!(readiness.check().is_ok());
    // The connection freezes: requests are never answered.
    h.api.0.lock().unwrap().hang.push(LEASES.into());
    tokio::time::timeout(Duration::from_secs(5), leading)
        .await
        .expect("the leader steps down")
        .unwrap();
    let took = start.elapsed();
    assert!(
        took < cfg.lease_duration,
        "stepped down after {took:?}, the lease expires for others after {:?}",
        cfg.lease_duration
    );
    assert_eq!(metrics.leader.get(), 0);
    assert!(readiness.check().is_err());
}

/// Issue 19 (4): a ResourceQuota that admits 1 of 2 pods: nothing of the
/// gang is left holding quota, the job says why (condition + event with the
/// server's message), retries with backoff, and runs once quota is free.
#[tokio::test]
async fn quota_refusal_rolls_back_the_gang_and_reports_it() {
    let h = Harness::new();
    h.submit(make_job("q", 2, 1));
    h.reconcile("q").await.unwrap(); // finalizer
    h.api.0.lock().unwrap().pod_quota = Some(1);
    let action = h
        .reconcile("q")
        .await
        .expect("a refusal is not a reconcile error");
    assert!(h.api.names(PODS).is_empty(), "partial gang deleted");
    let st = h.status("q");
    assert_eq!(st.phase, Some(JobPhase::Pending));
    assert_eq!(st.restarts, 0);
    assert_eq!(
        st.restart_epoch, 1,
        "the abandoned gang's epoch is not reused"
    );
    assert_eq!(st.launched_epoch, None);
    let c = condition(&st, "Ready");
    assert_eq!(c.reason, "QuotaExceeded");
    assert!(
        c.message.contains("exceeded quota: gpu-quota"),
        "{}",
        c.message
    );
    assert!(c.message.contains("deleted the 1 pod(s)"), "{}", c.message);
    assert_eq!(action, Action::requeue(Duration::from_secs(5)));
    let ev = h.api.0.lock().unwrap().events.last().unwrap().clone();
    assert_eq!(ev["reason"], "CreatePodsFailed");
    assert_eq!(ev["type"], "Warning");
    assert!(ev["note"].as_str().unwrap().contains("exceeded quota"));
    // The rollback's own writes trigger reconciles at once: they wait out
    // the backoff instead of trying again (no tight create/delete loop).
    let posts = |h: &Harness| {
        h.api
            .0
            .lock()
            .unwrap()
            .log
            .iter()
            .filter(|l| l.starts_with(&format!("POST {PODS}")))
            .count()
    };
    let tried = posts(&h);
    h.advance(2);
    let action = h.reconcile("q").await.unwrap();
    assert_eq!(action, Action::requeue(Duration::from_secs(3)));
    assert_eq!(posts(&h), tried, "no attempt during the backoff");
    // backoff grows
    h.advance(3);
    let action = h.reconcile("q").await.unwrap();
    assert_eq!(action, Action::requeue(Duration::from_secs(10)));
    assert!(posts(&h) > tried);
    assert!(h.api.names(PODS).is_empty());
    // quota freed: the gang is created whole after the backoff, no rank
    // failure was recorded
    h.api.0.lock().unwrap().pod_quota = None;
    h.advance(10);
    h.settle("q").await;
    assert_eq!(h.api.names(PODS), ["q-0", "q-1"]);
    let st = h.status("q");
    assert_eq!((st.phase, st.restarts), (Some(JobPhase::Pending), 0));
    assert!(st.last_failure.is_none());
    assert!(!h.api.event_reasons().contains(&"RankFailed".to_string()));
}

/// Issue 19 (4): a missing PriorityClass (403) is reported, not looped on.
#[tokio::test]
async fn forbidden_pod_is_reported_with_the_servers_message() {
    let h = Harness::new();
    let mut j = make_job("pc", 1, 1);
    j.spec.scheduling.priority_class_name = Some("missing".into());
    h.submit(j);
    h.reconcile("pc").await.unwrap();
    h.reconcile("pc").await.expect("no reconcile error");
    let c = condition(&h.status("pc"), "Ready");
    assert_eq!(c.reason, "Forbidden");
    assert!(
        c.message
            .contains("no PriorityClass with name missing was found"),
        "{}",
        c.message
    );
    assert_eq!(h.api.event_reasons(), ["CreatePodsFailed"]);
    // Fixing the spec (a new generation) retries at once, backoff or not.
    let mut job = h.api.job("pc").unwrap();
    job.spec.scheduling.priority_class_name = None;
    job.metadata.generation = Some(2);
    h.api.put(JOBS, serde_json::to_value(job).unwrap());
    h.settle("pc").await;
    assert_eq!(h.api.names(PODS), ["pc-0"]);
    assert_eq!(h.status("pc").phase, Some(JobPhase::Pending));
}

/// Issue 19 (4): a bad quantity (400) fails the job with the server's message.
#[tokio::test]
async fn bad_request_fails_the_job_with_the_servers_message() {
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
    let h = Harness::new();
    let mut j = make_job("shm", 2, 1);
    j.spec.network.shm_size = Some(Quantity("lots".into()));
    h.submit(j);
    h.settle("shm").await;
    let st = h.status("shm");
    assert_eq!(st.phase, Some(JobPhase::Failed));
    let c = condition(&st, "Failed");
    assert_eq!(c.reason, "InvalidSpec");
    assert!(c.message.contains("quantities must match"), "{}", c.message);
    assert!(h.api.names(PODS).is_empty());
}

/// Issue 19 (4): `a.b` is a valid CollectiveJob name but not a Service name.
#[tokio::test]
async fn dotted_job_name_fails_with_a_clear_condition() {
    let h = Harness::new();
    h.submit(make_job("a.b", 1, 1));
    h.settle("a.b").await;
    let st = h.status("a.b");
    assert_eq!(st.phase, Some(JobPhase::Failed));
    let c = condition(&st, "Failed");
    assert!(c.message.contains("DNS-1035"), "{}", c.message);
    assert!(h.api.get(SERVICES, "a.b").is_none());
    assert!(h.api.names(PODS).is_empty());
}

/// Issue 19 (5): a reconcile from a stale view of the job (a cache entry
/// from before the first status write and a restart) must neither erase
/// startTime / launchedEpoch nor treat the current pods as leftovers.
#[tokio::test]
async fn stale_reconcile_cannot_erase_status_or_pods() {
    let h = Harness::new();
    h.submit(make_job("st", 2, 1));
    h.reconcile("st").await.unwrap(); // finalizer
    let stale = h.api.job("st").unwrap();
    assert!(stale.status.is_none());
    h.settle("st").await;
    h.set_pods("Running", true, None);
    h.settle("st").await;
    h.fail_pod("st-1", 1);
    h.settle("st").await;
    h.set_pods("Running", true, None);
    h.settle("st").await;
    let before = h.status("st");
    assert_eq!(
        (before.phase, before.restart_epoch),
        (Some(JobPhase::Running), 1)
    );
    assert!(before.start_time.is_some() && before.launched_epoch == Some(1));
    let uids: Vec<_> = ["st-0", "st-1"].map(|p| h.api.pod(p).metadata.uid).into();

    reconcile(Arc::new(stale), h.ctx.clone()).await.unwrap();
    let after = h.status("st");
    assert_eq!(after.start_time, before.start_time);
    assert_eq!(after.launched_epoch, Some(1));
    assert_eq!(after.restart_epoch, 1);
    assert_eq!(after.phase, Some(JobPhase::Running));
    let now: Vec<_> = ["st-0", "st-1"].map(|p| h.api.pod(p).metadata.uid).into();
    assert_eq!(now, uids, "the current pods were not touched");
}

/// Issue 19 (5): the status write is conditional on the resourceVersion the
/// plan was computed from (the API server answers 409 when the job changed
/// in between; the reconcile then runs again instead of overwriting).
#[tokio::test]
async fn status_write_carries_the_resource_version() {
    let h = Harness::new();
    h.submit(make_job("rv", 1, 1));
    h.reconcile("rv").await.unwrap();
    let rv = h.api.job("rv").unwrap().metadata.resource_version.unwrap();
    h.reconcile("rv").await.unwrap();
    let log = h.api.0.lock().unwrap().log.clone();
    assert!(
        log.iter()
            .any(|l| l.starts_with(&format!("GET {JOBS}/rv?"))),
        "fresh read"
    );
    let body = h.api.0.lock().unwrap().last_status_apply.clone().unwrap();
    assert_eq!(body["metadata"]["resourceVersion"], rv.as_str());
}

/// Issue 19 (6): a Failed job shows READY 0/N.
#[tokio::test]
async fn failed_job_has_no_ready_pods() {
    let h = Harness::new();
    let mut j = make_job("f", 2, 1);
    j.spec.failure_policy.on_rank_failure = crate::crd::FailureAction::FailJob;
    h.submit(j);
    h.settle("f").await;
    h.set_pods("Running", true, None);
    h.settle("f").await;
    assert_eq!(h.status("f").ready.as_deref(), Some("2/2"));
    h.fail_pod("f-1", 1);
    h.settle("f").await;
    let st = h.status("f");
    assert_eq!(st.phase, Some(JobPhase::Failed));
    assert_eq!(st.ready.as_deref(), Some("0/2"));
}

/// Issue 19 (6): each failure has its own event note (not the first
/// RankFailed's note repeated).
#[tokio::test]
async fn event_notes_name_each_failure() {
    let h = Harness::new();
    h.submit(make_job("n", 2, 1));
    for pod in ["n-0", "n-1"] {
        h.settle("n").await;
        h.set_pods("Running", true, None);
        h.settle("n").await;
        h.fail_pod(pod, 7);
        h.settle("n").await;
    }
    let notes = h.api.event_notes(Some("RankFailed"));
    assert_eq!(notes.len(), 2, "{notes:?}");
    assert!(notes[0].contains("pod n-0"), "{notes:?}");
    assert!(notes[1].contains("pod n-1"), "{notes:?}");
}

/// Issue 19 (6): removing the finalizer of a job that is already gone is not
/// a reconcile error.
#[tokio::test]
async fn finalizer_on_a_gone_job_is_not_an_error() {
    let h = Harness::new();
    h.submit(make_job("g", 1, 1));
    h.settle("g").await;
    let jobs: Api<CollectiveJob> = Api::namespaced(h.ctx.client.clone(), "ml");
    jobs.delete("g", &DeleteParams::default()).await.unwrap();
    let deleting = h.api.job("g").unwrap();
    h.reconcile("g").await.unwrap();
    assert!(h.api.job("g").is_none());
    // the same deleted job, from a cache that still has it
    reconcile(Arc::new(deleting), h.ctx.clone())
        .await
        .expect("not an error");
}

/// Issue 19 (6): a job re-created under the same name must not adopt the
/// previous job's Secret (owned by the old uid, so garbage-collected).
#[tokio::test]
async fn recreated_job_gets_its_own_secret() {
    let h = Harness::new();
    h.submit(make_job("re", 1, 1));
    h.settle("re").await;
    let old_secret = h.api.names(SECRETS);
    assert_eq!(old_secret.len(), 1);
    // deleted; the garbage collector has not removed the Secret yet
    let secret = h.api.get(SECRETS, &old_secret[0]).unwrap();
    h.api.delete(JOBS, "re");
    h.api.put(SECRETS, secret);
    let mut j = make_job("re", 1, 1);
    j.metadata.uid = Some("uid-2".into());
    h.submit(j);
    h.settle("re").await;
    let pod = h.api.pod("re-0");
    let mounted = pod
        .spec
        .unwrap()
        .volumes
        .unwrap()
        .into_iter()
        .find_map(|v| v.secret.and_then(|s| s.secret_name))
        .unwrap();
    let s = h
        .api
        .get(SECRETS, &mounted)
        .expect("the mounted Secret exists");
    assert_eq!(s["metadata"]["ownerReferences"][0]["uid"], "uid-2");
}

/// Issue 19 (5): when the job changes between the reconcile's read and its
/// status write, the API server refuses the write (409, resourceVersion
/// precondition): the status is not overwritten and the job is reconciled
/// again soon, not reported as an error.
#[tokio::test]
async fn status_write_on_a_changed_job_is_refused_and_retried() {
    let h = Harness::new();
    h.submit(make_job("cw", 1, 1));
    h.reconcile("cw").await.unwrap(); // finalizer
    h.api.0.lock().unwrap().concurrent_write_after_get = Some((JOBS.into(), "cw".into()));
    let action = h.reconcile("cw").await.expect("a conflict is not an error");
    assert_eq!(action, Action::requeue(Duration::from_secs(1)));
    let job = h.api.job("cw").unwrap();
    assert_eq!(
        job.labels().get("concurrent").map(String::as_str),
        Some("yes")
    );
    assert!(
        job.status.is_none(),
        "a status computed from the old version was not written: {:?}",
        job.status
    );
    h.api.0.lock().unwrap().concurrent_write_after_get = None;
    h.reconcile("cw").await.unwrap();
    assert_eq!(h.status("cw").phase, Some(JobPhase::Pending));
}

/// Issue 19 (4): every API error class has its handling.
#[test]
fn api_errors_are_classified() {
    let api = |code: u16, reason: &str, message: &str| {
        kube::Error::Api(
            kube::core::Status {
                code,
                reason: reason.into(),
                message: message.into(),
                ..Default::default()
            }
            .boxed(),
        )
    };
    use ApiErrorClass::*;
    for (code, reason, message, want) in [
        (400, "BadRequest", "quantities must match", Permanent),
        (422, "Invalid", "a DNS-1035 label", Permanent),
        (
            403,
            "Forbidden",
            "exceeded quota: q",
            Blocked("QuotaExceeded"),
        ),
        (
            403,
            "Forbidden",
            "no PriorityClass with name x was found",
            Blocked("Forbidden"),
        ),
        (
            404,
            "NotFound",
            "namespace is being terminated",
            Blocked("NotFound"),
        ),
        (
            409,
            "Conflict",
            "the object has been modified",
            Blocked("Conflict"),
        ),
        (
            429,
            "TooManyRequests",
            "slow down",
            Blocked("TooManyRequests"),
        ),
        (500, "InternalError", "etcd", Retry),
        (503, "ServiceUnavailable", "", Retry),
    ] {
        assert_eq!(
            classify_api_error(&api(code, reason, message)),
            want,
            "{code} {message}"
        );
    }
}

fn replace_rank_job(name: &str, replicas: i32, rpr: i32, max_replacements: i32) -> CollectiveJob {
    let mut j = make_job(name, replicas, rpr);
    j.spec.failure_policy.on_rank_failure = crate::crd::FailureAction::ReplaceRank;
    j.spec.failure_policy.max_replacements = max_replacements;
    j
}

impl Harness {
    /// Reconciles until nothing changes, checking the phase after every pass.
    async fn settle_in_phase(&self, name: &str, phase: JobPhase) {
        for _ in 0..6 {
            let before = self.api.snapshot();
            self.reconcile(name).await.expect("reconcile");
            assert_eq!(
                self.status(name).phase,
                Some(phase),
                "{:#?}",
                self.status(name)
            );
            if self.api.snapshot() == before {
                return;
            }
        }
        panic!("did not settle: {:#?}", self.api.writes());
    }

    fn fail_pod(&self, name: &str, code: i32) {
        let failed = with_status(
            self.api.pod(name),
            "Failed",
            false,
            vec![cs_exited("main", code)],
        );
        self.api.set_pod(failed);
    }

    fn run_pod(&self, name: &str) {
        let ok = with_status(
            self.api.pod(name),
            "Running",
            true,
            vec![cs_running("main")],
        );
        self.api.set_pod(ok);
    }

    fn pod_writes(&self) -> Vec<String> {
        self.api
            .writes()
            .into_iter()
            .filter(|w| w.contains(PODS))
            .map(|w| w.split('?').next().unwrap().to_string())
            .collect()
    }
}

/// Issue 20: a failed pod is replaced in place (same name, DNS name and
/// ranks, a new incarnation); the others are not touched and the job stays
/// Running throughout.
#[tokio::test]
async fn replace_rank_recreates_only_the_failed_pod() {
    let h = Harness::new();
    h.submit(replace_rank_job("rr", 3, 2, 2));
    h.settle("rr").await;
    h.set_pods("Running", true, None);
    h.settle_in_phase("rr", JobPhase::Running).await;
    let survivors = |h: &Harness| {
        ["rr-0", "rr-2"].map(|n| {
            let p = h.api.pod(n);
            (p.metadata.uid.clone(), p.metadata.resource_version.clone())
        })
    };
    let before = survivors(&h);
    let writes_before = h.pod_writes().len();

    h.advance(60);
    h.fail_pod("rr-1", 137);
    h.reconcile("rr").await.unwrap();
    let st = h.status("rr");
    assert_eq!(st.phase, Some(JobPhase::Running));
    assert_eq!((st.restarts, st.restart_epoch, st.replacements), (0, 0, 1));
    assert_eq!(
        h.api.names(PODS),
        ["rr-0", "rr-2"],
        "only the failed pod deleted"
    );
    let r = &st.recoveries[0];
    assert_eq!(
        (
            r.pod.as_str(),
            r.first_rank,
            r.ranks,
            r.incarnation,
            r.count
        ),
        ("rr-1", 2, 2, 1, 1)
    );
    assert_eq!(r.state, crate::crd::RecoveryState::Replacing);
    assert_eq!(condition(&st, "Replacing").status, "True");

    h.advance(2);
    h.settle_in_phase("rr", JobPhase::Running).await;
    assert_eq!(h.api.names(PODS), ["rr-0", "rr-1", "rr-2"]);
    assert_eq!(
        h.pod_writes()[writes_before..],
        [format!("DELETE {PODS}/rr-1"), format!("POST {PODS}")],
        "one delete and one create: the survivors are untouched"
    );
    assert_eq!(survivors(&h), before);
    let pod = h.api.pod("rr-1");
    assert_eq!(pod.labels()["weft.dev/incarnation"], "1");
    assert_eq!(pod.labels()["weft.dev/restart-epoch"], "0");
    assert_eq!(env_value(&pod, "WEFT_INCARNATION").as_deref(), Some("1"));
    assert_eq!(env_value(&pod, "WEFT_RANK_OFFSET").as_deref(), Some("2"));
    assert_eq!(env_value(&pod, "WEFT_RESTART_EPOCH").as_deref(), Some("0"));
    assert_eq!(
        env_value(&pod, "WEFT_BOOTSTRAP").as_deref(),
        Some("rr-0.rr.ml.svc:29400")
    );
    let spec = pod.spec.as_ref().unwrap();
    assert_eq!(spec.hostname.as_deref(), Some("rr-1"));
    assert_eq!(spec.subdomain.as_deref(), Some("rr"));
    assert_eq!(
        env_value(&h.api.pod("rr-0"), "WEFT_INCARNATION").as_deref(),
        Some("0")
    );
    let st = h.status("rr");
    assert_eq!(st.ranks[1].incarnation, 1);
    assert_eq!(st.ranks[1].phase, "Pending");

    // The replacement's sidecar is up: the recovery ends with its cost.
    h.advance(18);
    h.run_pod("rr-1");
    h.settle_in_phase("rr", JobPhase::Running).await;
    let st = h.status("rr");
    let r = &st.recoveries[0];
    assert_eq!(r.state, crate::crd::RecoveryState::Recovered);
    assert_eq!(r.time_lost_seconds, Some(20));
    assert_eq!(condition(&st, "Replacing").status, "False");
    assert_eq!(condition(&st, "Ready").status, "True");
    assert_eq!(st.ready.as_deref(), Some("3/3"));
    assert_eq!(
        h.api.event_reasons(),
        [
            "PodsCreated",
            "Running",
            "RankFailed",
            "ReplacingRank",
            "ReplacementCreated",
            "RankReplaced"
        ]
    );
    let notes = h.api.event_notes(None);
    assert!(
        notes[2].contains("pod rr-1 (container main, exit code 137"),
        "{}",
        notes[2]
    );
    assert!(
        notes[3].contains("ranks 2-3") && notes[3].contains("1/2"),
        "{}",
        notes[3]
    );
    assert!(notes[5].contains("after the failure"), "{}", notes[5]);
    assert_eq!(h.ctx.metrics.rank_replacements.get(), 1);
    assert_eq!(h.ctx.metrics.job_restarts.get(), 0);
    // For docs/KUBERNETES.md ("Replacing a failed rank").
    let status = h.api.get(JOBS, "rr").unwrap()["status"].clone();
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/weft-operator-docs");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("status-replace-rank.yaml"),
        serde_yaml::to_string(&serde_json::json!({
            "replacements": status["replacements"],
            "recoveries": status["recoveries"],
            "ranks": status["ranks"],
        }))
        .unwrap(),
    )
    .unwrap();
}

/// A second failure while a pod is being replaced, a replacement that fails
/// itself, then a failure beyond maxReplacements: the job restarts.
#[tokio::test]
async fn replace_rank_second_failure_and_the_bound() {
    let h = Harness::new();
    h.submit(replace_rank_job("b", 3, 1, 3));
    h.settle("b").await;
    h.set_pods("Running", true, None);
    h.settle_in_phase("b", JobPhase::Running).await;

    // b-1 fails; before its replacement is even created, b-2 fails too.
    h.fail_pod("b-1", 1);
    h.reconcile("b").await.unwrap();
    assert_eq!(h.api.names(PODS), ["b-0", "b-2"]);
    h.fail_pod("b-2", 2);
    h.reconcile("b").await.unwrap();
    let st = h.status("b");
    assert_eq!(st.phase, Some(JobPhase::Running));
    assert_eq!(st.replacements, 2);
    assert_eq!(h.api.names(PODS), ["b-0", "b-1"], "b-2 deleted, b-1 back");
    h.settle_in_phase("b", JobPhase::Running).await;
    assert_eq!(h.api.names(PODS), ["b-0", "b-1", "b-2"]);

    // The replacement b-1 dies before it is ready: replaced again.
    h.fail_pod("b-1", 3);
    h.settle_in_phase("b", JobPhase::Running).await;
    assert_eq!(
        env_value(&h.api.pod("b-1"), "WEFT_INCARNATION").as_deref(),
        Some("2")
    );
    h.set_pods("Running", true, None);
    h.settle_in_phase("b", JobPhase::Running).await;
    let st = h.status("b");
    use crate::crd::RecoveryState::*;
    let rec: Vec<_> = st
        .recoveries
        .iter()
        .map(|r| (r.pod.as_str(), r.incarnation, r.count, r.state))
        .collect();
    assert_eq!(
        rec,
        [
            ("b-1", 1, 1, ReplacementFailed),
            ("b-2", 1, 2, Recovered),
            ("b-1", 2, 3, Recovered)
        ]
    );
    assert_eq!(st.replacements, 3);
    assert_eq!(st.restarts, 0);

    // maxReplacements (3) used up: the next failure restarts the whole job.
    h.fail_pod("b-0", 4);
    h.reconcile("b").await.unwrap();
    let st = h.status("b");
    assert_eq!(st.phase, Some(JobPhase::Restarting));
    assert_eq!((st.restarts, st.restart_epoch, st.replacements), (1, 1, 3));
    assert!(h.api.names(PODS).is_empty(), "all pods deleted");
    assert!(
        h.api
            .event_reasons()
            .contains(&"ReplacementsExhausted".to_string())
    );
    h.settle("b").await;
    assert_eq!(h.api.names(PODS), ["b-0", "b-1", "b-2"]);
    for n in ["b-0", "b-1", "b-2"] {
        let p = h.api.pod(n);
        assert_eq!(env_value(&p, "WEFT_RESTART_EPOCH").as_deref(), Some("1"));
        assert_eq!(env_value(&p, "WEFT_INCARNATION").as_deref(), Some("0"));
    }
    assert_eq!(h.ctx.metrics.rank_replacements.get(), 3);
    assert_eq!(h.ctx.metrics.job_restarts.get(), 1);
}

/// A replacement refused by a ResourceQuota is retried; the running pods are
/// not rolled back as a gang.
#[tokio::test]
async fn refused_replacement_keeps_the_running_pods() {
    let h = Harness::new();
    h.submit(replace_rank_job("qr", 3, 1, 3));
    h.settle("qr").await;
    h.set_pods("Running", true, None);
    h.settle_in_phase("qr", JobPhase::Running).await;
    h.fail_pod("qr-1", 1);
    h.reconcile("qr").await.unwrap();
    h.api.0.lock().unwrap().pod_quota = Some(2);
    h.reconcile("qr")
        .await
        .expect("a refusal is not a reconcile error");
    assert_eq!(h.api.names(PODS), ["qr-0", "qr-2"], "no rollback");
    let st = h.status("qr");
    assert_eq!(st.phase, Some(JobPhase::Running));
    assert_eq!(st.restart_epoch, 0);
    assert_eq!(condition(&st, "Ready").reason, "QuotaExceeded");
    assert_eq!(st.recoveries[0].state, crate::crd::RecoveryState::Replacing);
    h.api.0.lock().unwrap().pod_quota = None;
    h.advance(5);
    h.settle_in_phase("qr", JobPhase::Running).await;
    assert_eq!(h.api.names(PODS), ["qr-0", "qr-1", "qr-2"]);
    assert_eq!(
        env_value(&h.api.pod("qr-1"), "WEFT_INCARNATION").as_deref(),
        Some("1")
    );
    assert_eq!(h.status("qr").replacements, 1);
}

/// RestartJob (the default) is unchanged by ReplaceRank's fields.
#[tokio::test]
async fn restart_job_records_no_recoveries() {
    let h = Harness::new();
    h.submit(make_job("rj", 2, 1));
    h.settle("rj").await;
    h.set_pods("Running", true, None);
    h.settle("rj").await;
    h.fail_pod("rj-1", 1);
    h.reconcile("rj").await.unwrap();
    let st = h.status("rj");
    assert_eq!(st.phase, Some(JobPhase::Restarting));
    assert!(h.api.names(PODS).is_empty());
    assert_eq!(st.replacements, 0);
    assert!(st.recoveries.is_empty());
    assert!(st.conditions.iter().all(|c| c.type_ != "Replacing"));
    h.settle("rj").await;
    assert_eq!(
        env_value(&h.api.pod("rj-1"), "WEFT_INCARNATION").as_deref(),
        Some("0")
    );
    assert_eq!(h.ctx.metrics.rank_replacements.get(), 0);
}

/// Issue 31 (6): every restart is counted, also one decided while the job is
/// still Restarting from the previous one (a pod of the new epoch fails
/// before the whole gang runs): 5 restarts, 2 entries into Restarting.
#[tokio::test]
async fn every_restart_is_counted_also_while_restarting() {
    use crate::telemetry::metrics::PhaseLabels;
    let h = Harness::new();
    let mut j = make_job("c", 2, 1);
    j.spec.failure_policy.max_restarts = 10;
    h.submit(j);
    h.settle("c").await;
    h.set_pods("Running", true, None);
    h.settle("c").await;
    h.fail_pod("c-1", 1);
    h.settle("c").await;
    for _ in 0..3 {
        assert_eq!(h.status("c").phase, Some(JobPhase::Restarting));
        h.fail_pod("c-0", 1);
        h.settle("c").await;
    }
    h.set_pods("Running", true, None);
    h.settle("c").await;
    assert_eq!(h.status("c").phase, Some(JobPhase::Running));
    h.fail_pod("c-1", 137);
    h.settle("c").await;

    let st = h.status("c");
    assert_eq!((st.restarts, st.restart_epoch), (5, 5));
    assert_eq!(h.ctx.metrics.job_restarts.get(), 5);
    let entered = |phase: &str| {
        h.ctx
            .metrics
            .phase_transitions
            .get_or_create(&PhaseLabels {
                phase: phase.into(),
            })
            .get()
    };
    assert_eq!(entered("Restarting"), 2);
    assert_eq!(entered("Running"), 2);
}

/// Issue 31 (7): `kill -9` of a rank in pod 1; pod 0 exits 1 in reaction and
/// is reported first. The operator waits a moment for the cause, then the
/// event, `lastFailure` and the Restarting condition name pod 1.
#[tokio::test]
async fn killed_rank_is_named_not_the_peer_that_exited_in_reaction() {
    use crate::status::tests::cs_exited_at;
    let h = Harness::new();
    h.submit(make_job("k", 2, 2));
    h.settle("k").await;
    h.set_pods("Running", true, None);
    h.settle("k").await;
    let now = (h.ctx.clock)();
    let reaction = vec![cs_exited_at("main", 1, now)];
    h.api
        .set_pod(with_status(h.api.pod("k-0"), "Failed", false, reaction));
    let action = h.reconcile("k").await.unwrap();
    assert_eq!(
        action,
        Action::requeue(Duration::from_secs(policy::FAILURE_GATHER_SECS as u64))
    );
    assert_eq!(h.status("k").phase, Some(JobPhase::Running));
    assert!(!h.api.event_reasons().contains(&"RankFailed".to_string()));

    h.advance(1);
    let killed = vec![cs_exited_at("main", 137, now)];
    h.api
        .set_pod(with_status(h.api.pod("k-1"), "Failed", false, killed));
    h.reconcile("k").await.unwrap();
    let st = h.status("k");
    assert_eq!(st.phase, Some(JobPhase::Restarting));
    let f = st.last_failure.as_ref().unwrap();
    assert_eq!((f.pod.as_str(), f.exit_code), ("k-1", Some(137)));
    let notes = h.api.event_notes(Some("RankFailed"));
    assert_eq!(
        notes,
        ["Rank failure in pod k-1 (container main, exit code 137, Error)"]
    );
    let restarting = condition(&st, "Restarting");
    assert!(
        restarting.message.starts_with(
            "restart 1/3 after rank failure in pod k-1 (container main, exit code 137"
        ),
        "{}",
        restarting.message
    );
}

const LEASES_WS: &str = "/apis/coordination.k8s.io/v1/namespaces/weft-system/leases";
const DEPLOYMENTS_WS: &str = "/apis/apps/v1/namespaces/weft-system/deployments";

/// Issue 31 (5): when RBAC is gone (`helm uninstall` deletes it while the
/// operator still runs), Lease calls are refused with 403: the leader steps
/// down at once, saying so, instead of retrying until the renew deadline; a
/// standby gives up; a release reports the refusal instead of returning
/// silently. With RBAC in place, shutdown clears the holder.
#[tokio::test]
async fn refused_lease_calls_end_leadership_at_once_and_are_reported() {
    use crate::leader::{
        LeaseConfig, Released, StepDown, acquire, lead, release, try_acquire_or_renew,
    };
    use k8s_openapi::api::coordination::v1::Lease;
    let h = Harness::new();
    let leases: Api<Lease> = Api::namespaced(h.ctx.client.clone(), "weft-system");
    let cfg = LeaseConfig {
        renew_every: Duration::from_millis(100),
        ..LeaseConfig::new("weft-system", "operator-a")
    };
    assert!(try_acquire_or_renew(&leases, &cfg).await.unwrap());

    // Shutdown with RBAC in place: the holder is cleared.
    assert!(matches!(release(&leases, &cfg).await, Released::Released));
    let lease = h.api.get(LEASES_WS, crate::leader::LEASE_NAME).unwrap();
    assert!(lease["spec"]["holderIdentity"].is_null(), "{lease}");
    assert!(matches!(
        release(&leases, &cfg).await,
        Released::NotHolder(None)
    ));

    // Leading, then RBAC goes away.
    assert!(try_acquire_or_renew(&leases, &cfg).await.unwrap());
    let metrics = h.ctx.metrics.clone();
    let readiness = h.ctx.readiness.clone();
    let (l2, c2, m2, r2) = (
        leases.clone(),
        cfg.clone(),
        metrics.clone(),
        readiness.clone(),
    );
    let leading = tokio::spawn(async move { lead(&l2, &c2, &m2, &r2).await });
    tokio::time::sleep(Duration::from_millis(250)).await;
    assert_eq!(metrics.leader.get(), 1);
    h.api.0.lock().unwrap().forbid.push(LEASES_WS.into());
    let start = tokio::time::Instant::now();
    let why = tokio::time::timeout(Duration::from_secs(5), leading)
        .await
        .expect("the leader steps down")
        .unwrap();
    let took = start.elapsed();
    assert!(
        matches!(&why, StepDown::Refused(e) if e.refused()),
        "{why:?}"
    );
    assert!(
        took < Duration::from_secs(1),
        "stepped down after {took:?}, at the first refused renewal (every {:?}), not at the {:?} deadline",
        cfg.renew_every,
        cfg.renew_deadline
    );
    assert_eq!(metrics.leader.get(), 0);

    // A shutdown now cannot release, and says so.
    match release(&leases, &cfg).await {
        Released::Failed(e) => assert!(e.refused(), "{e}"),
        other => panic!("{other:?}"),
    }
    // A standby gives up instead of polling a Lease it may not read.
    let b = LeaseConfig::new("weft-system", "operator-b");
    let polled = std::sync::Mutex::new(vec![]);
    let r = tokio::time::timeout(
        Duration::from_secs(5),
        acquire(&leases, &b, |ok| polled.lock().unwrap().push(ok)),
    )
    .await
    .expect("acquire returns");
    assert!(r.is_err_and(|e| e.refused()));
    assert_eq!(*polled.lock().unwrap(), [false]);
}

fn uninstall_config(stop_timeout: Duration) -> crate::uninstall::UninstallConfig {
    crate::uninstall::UninstallConfig {
        namespace: "weft-system".into(),
        deployment: "weft".into(),
        lease: crate::leader::LEASE_NAME.into(),
        stop_timeout,
        poll_every: Duration::from_millis(20),
    }
}

/// Issue 31 (5): the chart's pre-delete hook. It stops the operator first
/// (foreground deletion of its Deployment: gone only once its pods are), and
/// only then removes the finalizer from every job, keeping other finalizers;
/// the jobs keep running, and `kubectl delete cjob` then deletes a job and
/// its pods without an operator. The Lease goes too. A second run finds
/// nothing left to do.
#[tokio::test]
async fn uninstall_stops_the_operator_then_releases_every_job() {
    use crate::uninstall::{Report, uninstall};
    let h = Harness::new();
    h.submit(make_job("a", 2, 1));
    let mut b = make_job("b", 1, 1);
    b.metadata.uid = Some("uid-b".into());
    b.metadata.finalizers = Some(vec!["example.com/keep".into()]);
    h.submit(b);
    for job in ["a", "b"] {
        h.settle(job).await;
    }
    h.set_pods("Running", true, None);
    h.settle("a").await;
    assert_eq!(
        h.api.job("b").unwrap().finalizers(),
        ["example.com/keep", FINALIZER]
    );
    h.api.put(
        DEPLOYMENTS_WS,
        json!({"apiVersion": "apps/v1", "kind": "Deployment",
               "metadata": {"name": "weft", "namespace": "weft-system", "uid": "d1"}}),
    );
    h.api.put(
        LEASES_WS,
        json!({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
               "metadata": {"name": crate::leader::LEASE_NAME, "namespace": "weft-system"},
               "spec": {"holderIdentity": "weft-abc"}}),
    );

    let client = h.ctx.client.clone();
    let cfg = uninstall_config(Duration::from_secs(10));
    let task = tokio::spawn(async move { uninstall(client, &cfg).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    // The operator's pods are still terminating: the jobs keep the finalizer,
    // or the operator could add it back.
    let dep = h.api.get(DEPLOYMENTS_WS, "weft").expect("being deleted");
    assert_eq!(dep["metadata"]["finalizers"], json!(["foregroundDeletion"]));
    assert!(
        h.api
            .job("a")
            .unwrap()
            .finalizers()
            .contains(&FINALIZER.into())
    );
    assert!(!task.is_finished());
    // The garbage collector has deleted the operator's pods.
    h.api.delete(DEPLOYMENTS_WS, "weft");
    let report = tokio::time::timeout(Duration::from_secs(5), task)
        .await
        .expect("uninstall finishes")
        .unwrap()
        .unwrap();
    assert_eq!(
        report,
        Report {
            operator_stopped: true,
            released: vec!["ml/a".into(), "ml/b".into()],
            jobs_left: vec!["ml/a".into(), "ml/b".into()],
            lease_deleted: true,
        }
    );
    assert!(h.api.job("a").unwrap().finalizers().is_empty());
    assert_eq!(h.api.job("b").unwrap().finalizers(), ["example.com/keep"]);
    assert!(h.api.get(LEASES_WS, crate::leader::LEASE_NAME).is_none());
    assert_eq!(
        h.api.names(PODS),
        ["a-0", "a-1", "b-0"],
        "jobs keep running"
    );

    // No operator left: deleting a job no longer waits for one.
    let jobs: Api<CollectiveJob> = Api::namespaced(h.ctx.client.clone(), "ml");
    jobs.delete("a", &DeleteParams::default()).await.unwrap();
    assert!(h.api.job("a").is_none());
    assert_eq!(h.api.names(PODS), ["b-0"], "a's pods went with it");

    let again = uninstall(
        h.ctx.client.clone(),
        &uninstall_config(Duration::from_secs(1)),
    )
    .await
    .unwrap();
    assert_eq!(
        again,
        Report {
            jobs_left: vec!["ml/b".into()],
            ..Report::default()
        }
    );
}

/// Issue 31 (5): an operator that does not stop in time (no garbage
/// collector, a pod stuck terminating) fails the hook, with the finalizers
/// left in place: a running operator would add them back.
#[tokio::test]
async fn uninstall_leaves_finalizers_while_the_operator_still_runs() {
    use crate::uninstall::{UninstallError, uninstall};
    let h = Harness::new();
    h.submit(make_job("a", 1, 1));
    h.settle("a").await;
    h.api.put(
        DEPLOYMENTS_WS,
        json!({"apiVersion": "apps/v1", "kind": "Deployment",
               "metadata": {"name": "weft", "namespace": "weft-system", "uid": "d1"}}),
    );
    let err = uninstall(
        h.ctx.client.clone(),
        &uninstall_config(Duration::from_millis(200)),
    )
    .await
    .unwrap_err();
    assert!(
        matches!(&err, UninstallError::OperatorStillRunning(d, _) if d == "weft"),
        "{err}"
    );
    assert!(
        err.to_string().contains("finalizers are left in place"),
        "{err}"
    );
    assert_eq!(h.api.job("a").unwrap().finalizers(), [FINALIZER]);
}
