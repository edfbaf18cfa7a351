//! Issue 31 (5): the operator binary as the elected leader, against a fake API
//! server that stores the Lease. On SIGTERM it hands the Lease back (holder
//! cleared, logged); when the API server starts refusing the Lease (403: its
//! RBAC deleted by `helm uninstall`), it says so and exits at once instead of
//! retrying silently.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{Operator, Reply, Request, empty_list, start_api, status};
use serde_json::{Value, json};

const LEASE: &str = "/apis/coordination.k8s.io/v1/namespaces/weft-system/leases";

/// A fake API server: empty lists, held watches, and one stored Lease.
#[derive(Clone, Default)]
struct Api {
    lease: Arc<Mutex<Option<Value>>>,
    forbid_leases: Arc<AtomicBool>,
}

impl Api {
    fn start(&self) -> u16 {
        let api = self.clone();
        start_api(move |r| api.answer(r))
    }

    fn holder(&self) -> Value {
        let lease = self.lease.lock().unwrap();
        lease.as_ref().expect("a Lease was created")["spec"]["holderIdentity"].clone()
    }

    fn answer(&self, r: &Request) -> Reply {
        if r.is_watch() {
            return Reply::Hold;
        }
        if !r.path().starts_with(LEASE) {
            return if r.method == "GET" {
                empty_list()
            } else {
                Reply::Json(201, "{}".into())
            };
        }
        if self.forbid_leases.load(Ordering::Relaxed) {
            return status(
                403,
                "Forbidden",
                "leases.coordination.k8s.io is forbidden: User cannot get resource leases",
            );
        }
        let mut lease = self.lease.lock().unwrap();
        match r.method.as_str() {
            "GET" => match lease.as_ref() {
                Some(l) => Reply::Json(200, l.to_string()),
                None => status(404, "NotFound", "leases weft-operator-leader not found"),
            },
            "POST" | "PUT" => {
                let mut l: Value = serde_json::from_slice(&r.body).unwrap();
                let rv = lease.as_ref().map_or(0, |o| {
                    o["metadata"]["resourceVersion"]
                        .as_str()
                        .unwrap()
                        .parse::<u64>()
                        .unwrap()
                });
                l["metadata"]["resourceVersion"] = json!((rv + 1).to_string());
                *lease = Some(l.clone());
                Reply::Json(if r.method == "POST" { 201 } else { 200 }, l.to_string())
            }
            m => panic!("unexpected {m} {}", r.target),
        }
    }
}

fn start_leader(test: &str, api: &Api) -> Operator {
    let mut op = Operator::start(
        test,
        api.start(),
        &[
            "--leader-elect",
            "true",
            "--identity",
            "op-a",
            "--lease-namespace",
            "weft-system",
            "--shutdown-timeout-secs",
            "5",
        ],
    );
    op.wait_ready(Duration::from_secs(30));
    assert_eq!(api.holder(), "op-a");
    op
}

#[test]
fn leader_releases_the_lease_on_sigterm() {
    let api = Api::default();
    let mut op = start_leader("lease-release", &api);
    op.sigterm();
    let exit = op.wait_exit(Duration::from_secs(10), "SIGTERM");
    let log = op.log();
    assert!(exit.success(), "{exit}:\n{log}");
    assert!(
        api.holder().is_null(),
        "holder after shutdown: {}",
        api.holder()
    );
    assert!(log.contains("released leadership"), "{log}");
}

#[test]
fn leader_exits_at_once_when_the_lease_is_refused() {
    let api = Api::default();
    let mut op = start_leader("lease-refused", &api);
    api.forbid_leases.store(true, Ordering::Relaxed);
    // Renewed every 2 s: the first refused renewal ends it, well before the
    // 10 s renew deadline.
    let exit = op.wait_exit(Duration::from_secs(6), "its Lease was refused");
    let log = op.log();
    assert!(!exit.success(), "{log}");
    assert!(
        log.contains("refuses to let us renew the Lease") && log.contains("helm uninstall"),
        "{log}"
    );
    assert!(log.contains("lost leadership; exiting"), "{log}");
}
