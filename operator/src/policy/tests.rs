use k8s_openapi::api::core::v1::ContainerStateTerminated;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::ResourceExt;

use super::*;
use crate::crd::{CleanPodPolicy, FailureAction, FailurePolicy, JobPhase, RankFailure};
use crate::resources::{OperatorConfig, desired_pod, tests::job};
use crate::status::tests::{cs_exited, cs_running, with_status};

fn t(s: i64) -> Timestamp {
    Timestamp::from_second(1_800_000_000 + s).unwrap()
}

/// Applies a plan the way the API server would (pods created/deleted at
/// once, status stored), returning the job and its pods.
fn apply(mut j: CollectiveJob, mut pods: Vec<Pod>, p: &Plan) -> (CollectiveJob, Vec<Pod>) {
    pods.retain(|x| !p.delete_pods.contains(&x.name_any()));
    for i in &p.create_pods {
        pods.push(crate::resources::desired_pod_incarnation(
            &j,
            *i,
            p.status.restart_epoch,
            p.incarnation(*i),
            &OperatorConfig::default(),
        ));
    }
    j.status = Some(p.status.clone());
    (j, pods)
}

fn set_all(pods: Vec<Pod>, phase: &str, ready: bool, code: Option<i32>) -> Vec<Pod> {
    pods.into_iter()
        .map(|p| {
            let cs = match code {
                Some(c) => cs_exited("main", c),
                None => cs_running("main"),
            };
            with_status(p, phase, ready, vec![cs])
        })
        .collect()
}

/// The job once its pods are created and every one is Running and ready.
fn started(j: CollectiveJob) -> (CollectiveJob, Vec<Pod>) {
    let p = plan(&j, &[], t(0));
    let (j, pods) = apply(j, vec![], &p);
    (j, set_all(pods, "Running", true, None))
}

/// The job once its pods of epoch 0 are created and a restart is decided
/// (epoch 1, phase Restarting), with those pods.
fn restart_decided(j: CollectiveJob) -> (CollectiveJob, Vec<Pod>) {
    let p = plan(&j, &[], t(0));
    let (mut j, pods) = apply(j, vec![], &p);
    let st = j.status.as_mut().unwrap();
    st.restart_epoch = 1;
    st.phase = Some(JobPhase::Restarting);
    (j, pods)
}

/// The pod in `phase` after its workload exited with `code`.
fn exited(pod: &Pod, phase: &str, code: i32) -> Pod {
    with_status(pod.clone(), phase, false, vec![cs_exited("main", code)])
}

fn phase(p: &Plan) -> JobPhase {
    p.status.phase.unwrap()
}

fn reasons(p: &Plan) -> Vec<&str> {
    p.events.iter().map(|e| e.reason.as_str()).collect()
}

#[test]
fn fresh_job_creates_all_pods_and_base() {
    let j = job("a", 3, 2);
    let p = plan(&j, &[], t(0));
    assert!(p.ensure_base);
    assert_eq!(p.create_pods, [0, 1, 2]);
    assert_eq!(phase(&p), JobPhase::Pending);
    assert_eq!(p.status.launched_epoch, Some(0));
    assert_eq!(p.status.world_size, 6);
    assert_eq!(
        p.status.bootstrap_endpoint.as_deref(),
        Some("a-0.a.ml.svc:29400")
    );
    assert_eq!(p.status.start_time, Some(Time(t(0))));
    assert_eq!(p.status.observed_generation, Some(1));
    assert_eq!(p.status.ranks.len(), 3);
    assert!(p.status.ranks.iter().all(|r| r.phase == "Creating"));
    assert_eq!(reasons(&p), ["PodsCreated"]);
}

#[test]
fn gpu_count_mismatch_is_a_warning_event() {
    use k8s_openapi::api::core::v1::ResourceRequirements;
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
    let with_gpus = |rpr: i32, gpus: &str| {
        let mut j = job("g", 1, rpr);
        j.spec.template.spec.as_mut().unwrap().containers[0].resources =
            Some(ResourceRequirements {
                limits: Some([("nvidia.com/gpu".to_string(), Quantity(gpus.into()))].into()),
                ..ResourceRequirements::default()
            });
        j
    };
    let p = plan(&with_gpus(8, "8"), &[], t(0));
    assert_eq!(reasons(&p), ["PodsCreated"]);
    let p = plan(&with_gpus(8, "4"), &[], t(0));
    assert_eq!(reasons(&p), ["PodsCreated", "GPUCountMismatch"]);
    assert!(p.events[1].warning);
    assert_eq!(p.create_pods, [0], "a warning, not a refusal");
}

#[test]
fn steady_state_is_idempotent() {
    let j = job("a", 2, 1);
    let (j, pods) = started(j);
    let p1 = plan(&j, &pods, t(1));
    assert_eq!(phase(&p1), JobPhase::Running);
    assert_eq!(p1.status.ready.as_deref(), Some("2/2"));
    assert_eq!(reasons(&p1), ["Running"]);
    let (j, pods) = apply(j, pods, &p1);
    let p2 = plan(&j, &pods, t(2));
    assert!(p2.create_pods.is_empty() && p2.delete_pods.is_empty());
    assert!(p2.events.is_empty());
    assert_eq!(
        Some(&p2.status),
        j.status.as_ref(),
        "no status change, no write"
    );
}

#[test]
fn success_when_every_workload_exits_zero() {
    let j = job("a", 2, 1);
    let (j, mut pods) = started(j);
    pods[0] = exited(&pods[0], "Succeeded", 0);
    let p = plan(&j, &pods, t(5));
    assert_eq!(phase(&p), JobPhase::Running);
    let pods = set_all(pods, "Succeeded", false, Some(0));
    let p = plan(&j, &pods, t(9));
    assert_eq!(phase(&p), JobPhase::Succeeded);
    assert_eq!(p.status.completion_time, Some(Time(t(9))));
    assert!(reasons(&p).contains(&"Succeeded"));
    // cleanPodPolicy Running: finished pods are kept
    assert!(p.delete_pods.is_empty());
}

#[test]
fn failure_restarts_with_new_epoch_then_recreates() {
    let j = job("a", 2, 4);
    let (j, mut pods) = started(j);
    pods[1] = exited(&pods[1], "Failed", 137);
    let p = plan(&j, &pods, t(3));
    assert_eq!(phase(&p), JobPhase::Restarting);
    assert_eq!(p.status.restarts, 1);
    assert_eq!(p.status.restart_epoch, 1);
    assert_eq!(p.delete_pods, ["a-0", "a-1"]);
    assert!(
        p.create_pods.is_empty(),
        "names still taken by the old pods"
    );
    let f = p.status.last_failure.as_ref().unwrap();
    assert_eq!(
        (f.pod.as_str(), f.container.as_deref(), f.exit_code),
        ("a-1", Some("main"), Some(137))
    );
    assert_eq!(reasons(&p), ["RankFailed", "Restarting"]);
    // old pods gone: new epoch created
    let (j, pods) = apply(j, pods, &p);
    assert!(pods.is_empty());
    let p = plan(&j, &pods, t(4));
    assert_eq!(p.create_pods, [0, 1]);
    assert_eq!(phase(&p), JobPhase::Restarting);
    assert_eq!(p.status.launched_epoch, Some(1));
    let (j, pods) = apply(j, pods, &p);
    let env = &pods[0].spec.as_ref().unwrap().containers[0]
        .env
        .as_ref()
        .unwrap();
    assert!(
        env.iter()
            .any(|e| e.name == "WEFT_RESTART_EPOCH" && e.value.as_deref() == Some("1"))
    );
    let pods = set_all(pods, "Running", true, None);
    let p = plan(&j, &pods, t(5));
    assert_eq!(phase(&p), JobPhase::Running);
    let c = crate::status::condition(&p.status.conditions, COND_RESTARTING).unwrap();
    assert_eq!(
        (c.status.as_str(), c.reason.as_str()),
        ("False", "Recovered")
    );
}

#[test]
fn stale_terminating_pods_block_recreation() {
    let (j, pods) = restart_decided(job("a", 2, 1));
    // old pods still terminating
    let pods: Vec<Pod> = pods
        .into_iter()
        .map(|mut p| {
            p.metadata.deletion_timestamp = Some(Time(t(1)));
            p
        })
        .collect();
    let p = plan(&j, &pods, t(2));
    assert!(p.create_pods.is_empty());
    assert!(p.delete_pods.is_empty(), "already terminating");
    assert_eq!(phase(&p), JobPhase::Restarting);
    assert!(p.requeue_after.is_some());
}

#[test]
fn old_pods_stuck_terminating_are_force_deleted() {
    let (j, pods) = restart_decided(job("a", 1, 1));
    let mut pod = pods[0].clone();
    pod.metadata.deletion_timestamp = Some(Time(t(30)));
    let p = plan(&j, std::slice::from_ref(&pod), t(60));
    assert!(p.force_delete_pods.is_empty(), "still within grace");
    let p = plan(
        &j,
        std::slice::from_ref(&pod),
        t(30 + FORCE_DELETE_AFTER_SECS),
    );
    assert_eq!(p.force_delete_pods, ["a-0"]);
    assert!(p.create_pods.is_empty());
}

#[test]
fn max_restarts_then_failed_naming_pod_container_code() {
    let mut j = job("a", 2, 1);
    j.spec.failure_policy.max_restarts = 1;
    let (j, mut pods) = started(j);
    pods[0] = exited(&pods[0], "Running", 2);
    let p = plan(&j, &pods, t(1));
    assert_eq!(phase(&p), JobPhase::Restarting);
    let (j, pods) = apply(j, pods, &p);
    let p = plan(&j, &pods, t(2));
    let (j, pods) = apply(j, pods, &p);
    let mut pods = set_all(pods, "Running", true, None);
    pods[1] = with_status(pods[1].clone(), "Failed", false, vec![cs_exited("main", 9)]);
    let p = plan(&j, &pods, t(3));
    assert_eq!(phase(&p), JobPhase::Failed);
    assert_eq!(p.status.restarts, 1);
    let c = crate::status::condition(&p.status.conditions, COND_FAILED).unwrap();
    assert_eq!(c.reason, "MaxRestartsExceeded");
    assert!(
        c.message.contains("pod a-1")
            && c.message.contains("container main")
            && c.message.contains("exit code 9"),
        "{}",
        c.message
    );
    // cleanPodPolicy Running: the surviving running pod is deleted, the failed one kept
    assert_eq!(p.delete_pods, ["a-0"]);
    assert_eq!(p.status.completion_time, Some(Time(t(3))));
    // terminal is sticky
    let (j, pods) = apply(j, pods, &p);
    let p = plan(&j, &pods, t(4));
    assert_eq!(phase(&p), JobPhase::Failed);
    assert!(p.create_pods.is_empty() && p.events.is_empty());
}

#[test]
fn restart_decisions() {
    let f = |code| RankFailure {
        pod: "p".into(),
        container: Some("c".into()),
        exit_code: code,
        reason: "Error".into(),
        message: String::new(),
        epoch: 0,
    };
    let mut pol = FailurePolicy::default();
    assert_eq!(on_rank_failure(&pol, 0, 0, &f(Some(1))), Decision::Restart);
    assert_eq!(on_rank_failure(&pol, 2, 0, &f(None)), Decision::Restart);
    assert_eq!(
        on_rank_failure(&pol, 3, 0, &f(Some(1))),
        Decision::Fail {
            reason: "MaxRestartsExceeded"
        }
    );
    pol.permanent_exit_codes = vec![42];
    assert_eq!(
        on_rank_failure(&pol, 0, 0, &f(Some(42))),
        Decision::Fail {
            reason: "PermanentExitCode"
        }
    );
    assert_eq!(on_rank_failure(&pol, 0, 0, &f(Some(41))), Decision::Restart);
    pol.on_rank_failure = FailureAction::ReplaceRank;
    pol.max_replacements = 2;
    assert_eq!(on_rank_failure(&pol, 0, 0, &f(Some(1))), Decision::Replace);
    assert_eq!(on_rank_failure(&pol, 0, 1, &f(None)), Decision::Replace);
    assert_eq!(on_rank_failure(&pol, 0, 2, &f(Some(1))), Decision::Restart);
    assert_eq!(
        on_rank_failure(&pol, 3, 2, &f(Some(1))),
        Decision::Fail {
            reason: "MaxRestartsExceeded"
        }
    );
    assert_eq!(
        on_rank_failure(&pol, 0, 0, &f(Some(42))),
        Decision::Fail {
            reason: "PermanentExitCode"
        }
    );
    pol.on_rank_failure = FailureAction::FailJob;
    assert_eq!(
        on_rank_failure(&pol, 0, 0, &f(Some(1))),
        Decision::Fail {
            reason: "RankFailed"
        }
    );
    pol = FailurePolicy {
        max_restarts: 0,
        ..FailurePolicy::default()
    };
    assert_eq!(
        on_rank_failure(&pol, 0, 0, &f(Some(1))),
        Decision::Fail {
            reason: "MaxRestartsExceeded"
        }
    );
}

#[test]
fn permanent_exit_code_fails_without_restart() {
    let mut j = job("a", 1, 1);
    j.spec.failure_policy.permanent_exit_codes = vec![64];
    let p = plan(&j, &[], t(0));
    let (j, pods) = apply(j, vec![], &p);
    let pods = set_all(pods, "Failed", false, Some(64));
    let p = plan(&j, &pods, t(1));
    assert_eq!(phase(&p), JobPhase::Failed);
    assert_eq!(p.status.restarts, 0);
    assert!(reasons(&p).contains(&"PermanentExitCode"));
}

#[test]
fn pod_deleted_by_hand_is_a_failure_not_silently_recreated() {
    let j = job("a", 3, 1);
    let (j, mut pods) = started(j);
    pods.remove(1);
    let p = plan(&j, &pods, t(1));
    assert!(p.create_pods.is_empty());
    assert_eq!(phase(&p), JobPhase::Restarting);
    let f = p.status.last_failure.unwrap();
    assert_eq!((f.pod.as_str(), f.reason.as_str()), ("a-1", "PodDeleted"));
    // also while it is still terminating
    let (j, _) = apply(job("a", 1, 1), vec![], &plan(&job("a", 1, 1), &[], t(0)));
    let mut pod = desired_pod(&j, 0, 0, &OperatorConfig::default());
    pod = with_status(pod, "Running", true, vec![cs_running("main")]);
    pod.metadata.deletion_timestamp = Some(Time(t(1)));
    let p = plan(&j, &[pod], t(1));
    assert_eq!(p.status.last_failure.unwrap().reason, "PodDeleted");
}

#[test]
fn partially_created_epoch_is_completed_not_failed() {
    // controller crashed after creating pod 0 of 2, before writing status
    let j = job("a", 2, 1);
    let pod0 = desired_pod(&j, 0, 0, &OperatorConfig::default());
    let p = plan(&j, &[pod0], t(0));
    assert_eq!(p.create_pods, [1]);
    assert!(p.status.last_failure.is_none());
}

#[test]
fn suspend_and_resume() {
    let j = job("a", 2, 1);
    let p = plan(&j, &[], t(0));
    let (mut j, pods) = apply(j, vec![], &p);
    let pods = set_all(pods, "Running", true, None);
    j.spec.run_policy.suspend = true;
    let p = plan(&j, &pods, t(1));
    assert_eq!(phase(&p), JobPhase::Suspended);
    assert_eq!(p.delete_pods, ["a-0", "a-1"]);
    assert_eq!(p.status.restart_epoch, 1);
    assert_eq!(p.status.restarts, 0, "a suspension is not a restart");
    assert_eq!(p.status.launched_epoch, None);
    assert_eq!(p.status.start_time, None);
    assert_eq!(reasons(&p), ["Suspended"]);
    let (mut j, pods) = apply(j, pods, &p);
    let p = plan(&j, &pods, t(2));
    assert!(p.events.is_empty() && p.delete_pods.is_empty());
    j.spec.run_policy.suspend = false;
    let p = plan(&j, &pods, t(3));
    assert_eq!(p.create_pods, [0, 1]);
    assert_eq!(phase(&p), JobPhase::Pending);
    assert_eq!(reasons(&p), ["Resumed", "PodsCreated"]);
    let c = crate::status::condition(&p.status.conditions, COND_SUSPENDED).unwrap();
    assert_eq!(c.status, "False");
    let (_, pods) = apply(j, pods, &p);
    assert_eq!(
        pods[0].metadata.labels.as_ref().unwrap()["weft.dev/restart-epoch"],
        "1"
    );
}

#[test]
fn suspended_at_creation_creates_nothing() {
    let mut j = job("a", 2, 1);
    j.spec.run_policy.suspend = true;
    let p = plan(&j, &[], t(0));
    assert_eq!(phase(&p), JobPhase::Suspended);
    assert!(p.create_pods.is_empty());
    assert_eq!(p.status.restart_epoch, 0);
}

#[test]
fn active_deadline() {
    let mut j = job("a", 1, 1);
    j.spec.run_policy.active_deadline_seconds = Some(60);
    let p = plan(&j, &[], t(0));
    assert_eq!(p.requeue_after, Some(Duration::from_secs(60)));
    let (j, pods) = apply(j, vec![], &p);
    let pods = set_all(pods, "Running", true, None);
    let p = plan(&j, &pods, t(30));
    assert_eq!(phase(&p), JobPhase::Running);
    assert_eq!(p.requeue_after, Some(Duration::from_secs(30)));
    let p = plan(&j, &pods, t(60));
    assert_eq!(phase(&p), JobPhase::Failed);
    assert!(reasons(&p).contains(&"DeadlineExceeded"));
    assert_eq!(p.delete_pods, ["a-0"]);
}

#[test]
fn ttl_after_finished_deletes_job() {
    let mut j = job("a", 1, 1);
    j.spec.run_policy.ttl_seconds_after_finished = Some(100);
    let p = plan(&j, &[], t(0));
    let (j, pods) = apply(j, vec![], &p);
    let pods = set_all(pods, "Succeeded", false, Some(0));
    let p = plan(&j, &pods, t(10));
    assert_eq!(phase(&p), JobPhase::Succeeded);
    assert_eq!(p.requeue_after, Some(Duration::from_secs(100)));
    assert!(!p.delete_job);
    let (j, pods) = apply(j, pods, &p);
    assert!(!plan(&j, &pods, t(109)).delete_job);
    let p = plan(&j, &pods, t(110));
    assert!(p.delete_job);
    assert_eq!(reasons(&p), ["TTLExpired"]);
}

#[test]
fn clean_pod_policies() {
    for (policy, want) in [
        (CleanPodPolicy::None, vec![]),
        (CleanPodPolicy::Running, vec!["a-0"]),
        (CleanPodPolicy::All, vec!["a-0", "a-1"]),
    ] {
        let mut j = job("a", 2, 1);
        j.spec.failure_policy.on_rank_failure = FailureAction::FailJob;
        j.spec.run_policy.clean_pod_policy = policy;
        let p = plan(&j, &[], t(0));
        let (j, pods) = apply(j, vec![], &p);
        let mut pods = set_all(pods, "Running", true, None);
        pods[1] = with_status(pods[1].clone(), "Failed", false, vec![cs_exited("main", 1)]);
        let p = plan(&j, &pods, t(1));
        assert_eq!(phase(&p), JobPhase::Failed, "{policy:?}");
        assert_eq!(p.delete_pods, want, "{policy:?}");
    }
}

#[test]
fn invalid_spec_fails_with_reason() {
    let mut j = job("a", 1, 1);
    j.spec.template.spec.as_mut().unwrap().restart_policy = Some("Always".into());
    let p = plan(&j, &[], t(0));
    assert_eq!(phase(&p), JobPhase::Failed);
    assert!(p.create_pods.is_empty());
    assert_eq!(reasons(&p), ["InvalidSpec"]);
}

#[test]
fn ready_condition_names_what_the_kubelet_is_stuck_on() {
    use k8s_openapi::api::core::v1::{ContainerState, ContainerStateWaiting, ContainerStatus};
    let j = job("a", 1, 1);
    let p = plan(&j, &[], t(0));
    let (j, pods) = apply(j, vec![], &p);
    let stuck = ContainerStatus {
        name: "main".into(),
        state: Some(ContainerState {
            waiting: Some(ContainerStateWaiting {
                reason: Some("ErrImagePull".into()),
                message: None,
            }),
            ..ContainerState::default()
        }),
        ..ContainerStatus::default()
    };
    let pods = vec![with_status(pods[0].clone(), "Pending", false, vec![stuck])];
    let p = plan(&j, &pods, t(1));
    let c = crate::status::condition(&p.status.conditions, COND_READY).unwrap();
    assert_eq!(
        c.message,
        "0 of 1 pods ready; pod a-0: container main: ErrImagePull"
    );
}

#[test]
fn pending_until_all_running() {
    let j = job("a", 2, 1);
    let p = plan(&j, &[], t(0));
    let (j, pods) = apply(j, vec![], &p);
    let mut pods = set_all(pods, "Running", false, None);
    pods[1].status.as_mut().unwrap().phase = Some("Pending".into());
    let p = plan(&j, &pods, t(1));
    assert_eq!(phase(&p), JobPhase::Pending);
    assert_eq!(p.status.ready.as_deref(), Some("0/2"));
    assert_eq!(p.status.ranks[0].phase, "Running");
    assert_eq!(p.status.ranks[1].phase, "Pending");
    let c = crate::status::condition(&p.status.conditions, COND_READY).unwrap();
    assert_eq!(c.message, "0 of 2 pods ready");
}
fn replace_job(name: &str, replicas: i32, rpr: i32, max_replacements: i32) -> CollectiveJob {
    let mut j = job(name, replicas, rpr);
    j.spec.failure_policy.on_rank_failure = FailureAction::ReplaceRank;
    j.spec.failure_policy.max_replacements = max_replacements;
    j
}

/// A job of `replicas` pods, all running and ready, at t(1).
fn running(j: CollectiveJob) -> (CollectiveJob, Vec<Pod>) {
    let (j, pods) = started(j);
    let p = plan(&j, &pods, t(1));
    assert_eq!(phase(&p), JobPhase::Running);
    apply(j, pods, &p)
}

fn fail_pod(pods: &mut [Pod], i: usize, code: i32) {
    pods[i] = with_status(
        pods[i].clone(),
        "Failed",
        false,
        vec![cs_exited("main", code)],
    );
}

fn pod_of<'a>(pods: &'a [Pod], name: &str) -> &'a Pod {
    pods.iter().find(|p| p.name_any() == name).unwrap()
}

fn env_of(pod: &Pod) -> std::collections::BTreeMap<String, String> {
    pod.spec.as_ref().unwrap().containers[0]
        .env
        .iter()
        .flatten()
        .map(|e| (e.name.clone(), e.value.clone().unwrap_or_default()))
        .collect()
}

#[test]
fn replace_rank_replaces_only_the_failed_pod() {
    let (j, mut pods) = running(replace_job("a", 3, 2, 3));
    let uid0 = pods[0].metadata.clone();
    fail_pod(&mut pods, 1, 137);
    let p = plan(&j, &pods, t(10));
    assert_eq!(phase(&p), JobPhase::Running, "the job keeps running");
    assert_eq!(p.delete_pods, ["a-1"], "only the failed pod");
    assert!(p.create_pods.is_empty(), "its name is still taken");
    assert_eq!((p.status.restarts, p.status.restart_epoch), (0, 0));
    assert_eq!(p.status.replacements, 1);
    let r = &p.status.recoveries[0];
    assert_eq!(
        (r.pod.as_str(), r.replica_index, r.first_rank, r.ranks),
        ("a-1", 1, 2, 2)
    );
    assert_eq!((r.epoch, r.incarnation, r.count), (0, 1, 1));
    assert_eq!((r.reason.as_str(), r.exit_code), ("Error", Some(137)));
    assert_eq!(r.state, RecoveryState::Replacing);
    assert_eq!(r.failed_at, Time(t(10)));
    assert_eq!(reasons(&p), ["RankFailed", "ReplacingRank"]);
    assert!(
        p.events[1].note.contains("ranks 2-3"),
        "{}",
        p.events[1].note
    );
    let c = crate::status::condition(&p.status.conditions, COND_REPLACING).unwrap();
    assert_eq!(
        (c.status.as_str(), c.reason.as_str()),
        ("True", "RankFailed")
    );

    // The failed pod is gone: its replacement is created, same name and ranks.
    let (j, pods) = apply(j, pods, &p);
    let p = plan(&j, &pods, t(11));
    assert_eq!(p.create_pods, [1]);
    assert!(p.replacements_only);
    assert_eq!(p.incarnation(1), 1);
    assert_eq!(p.incarnation(0), 0);
    assert!(p.delete_pods.is_empty());
    assert_eq!(phase(&p), JobPhase::Running);
    assert_eq!(reasons(&p), ["ReplacementCreated"]);
    assert_eq!(
        (
            p.status.ranks[1].phase.as_str(),
            p.status.ranks[1].incarnation
        ),
        ("Creating", 1)
    );
    let (j, pods) = apply(j, pods, &p);
    assert_eq!(pods[0].metadata, uid0, "the survivors are untouched");
    let new = pod_of(&pods, "a-1");
    let e = env_of(new);
    assert_eq!(e["WEFT_INCARNATION"], "1");
    assert_eq!(e["WEFT_RANK_OFFSET"], "2");
    assert_eq!(e["WEFT_RESTART_EPOCH"], "0");
    assert_eq!(e["WEFT_WORLD_SIZE"], "6");
    assert_eq!(env_of(&pods[0])["WEFT_INCARNATION"], "0");
    let spec = new.spec.as_ref().unwrap();
    assert_eq!(
        (spec.hostname.as_deref(), spec.subdomain.as_deref()),
        (Some("a-1"), Some("a"))
    );
    assert_eq!(
        new.metadata.labels.as_ref().unwrap()["weft.dev/incarnation"],
        "1"
    );

    // Not ready yet: still replacing, the job still Running.
    let p = plan(&j, &pods, t(12));
    assert_eq!(phase(&p), JobPhase::Running);
    assert!(p.events.is_empty());
    let ready = crate::status::condition(&p.status.conditions, COND_READY).unwrap();
    assert_eq!(ready.status, "False");
    assert!(ready.message.contains("replacing a-1"), "{}", ready.message);

    // Ready: the recovery ends, with the time it cost.
    let (j, mut pods) = apply(j, pods, &p);
    let i = pods.iter().position(|p| p.name_any() == "a-1").unwrap();
    pods[i] = with_status(pods[i].clone(), "Running", true, vec![cs_running("main")]);
    let p = plan(&j, &pods, t(25));
    assert_eq!(phase(&p), JobPhase::Running);
    let r = &p.status.recoveries[0];
    assert_eq!(r.state, RecoveryState::Recovered);
    assert_eq!(
        (r.ended_at.clone(), r.time_lost_seconds),
        (Some(Time(t(25))), Some(15))
    );
    assert_eq!(reasons(&p), ["RankReplaced"]);
    let c = crate::status::condition(&p.status.conditions, COND_REPLACING).unwrap();
    assert_eq!(
        (c.status.as_str(), c.reason.as_str()),
        ("False", "Recovered")
    );
    let ready = crate::status::condition(&p.status.conditions, COND_READY).unwrap();
    assert_eq!(ready.status, "True");
    assert_eq!(p.status.ranks[1].incarnation, 1);
    assert_eq!(p.status.ready.as_deref(), Some("3/3"));
    // Settled: nothing more happens.
    let (j, pods) = apply(j, pods, &p);
    let p2 = plan(&j, &pods, t(30));
    assert!(p2.events.is_empty() && p2.delete_pods.is_empty() && p2.create_pods.is_empty());
    assert_eq!(p2.status.recoveries, p.status.recoveries);
}

#[test]
fn replace_rank_bound_falls_back_to_restart_then_fail() {
    let mut j = replace_job("a", 2, 1, 1);
    j.spec.failure_policy.max_restarts = 1;
    let (j, mut pods) = running(j);
    fail_pod(&mut pods, 0, 1);
    let p = plan(&j, &pods, t(5));
    assert_eq!(p.status.replacements, 1);
    let (j, pods) = apply(j, pods, &p);
    let p = plan(&j, &pods, t(6));
    let (j, pods) = apply(j, pods, &p);
    let mut pods = set_all(pods, "Running", true, None);
    let p = plan(&j, &pods, t(7));
    assert_eq!(p.status.recoveries[0].state, RecoveryState::Recovered);
    let (j, _) = apply(j, pods.clone(), &p);

    // The second failure is beyond maxReplacements: the whole job restarts.
    fail_pod(&mut pods, 1, 1);
    let p = plan(&j, &pods, t(8));
    assert_eq!(phase(&p), JobPhase::Restarting);
    assert_eq!((p.status.restarts, p.status.restart_epoch), (1, 1));
    assert_eq!(p.status.replacements, 1);
    assert_eq!(p.delete_pods, ["a-0", "a-1"]);
    assert_eq!(
        reasons(&p),
        ["RankFailed", "ReplacementsExhausted", "Restarting"]
    );
    let c = crate::status::condition(&p.status.conditions, COND_RESTARTING).unwrap();
    assert!(c.message.contains("maxReplacements 1"), "{}", c.message);

    // The new epoch: pods are incarnation 0 again; the budget is used up
    // for the life of the job, and maxRestarts 1 is used up too: Failed.
    let (j, pods) = apply(j, pods, &p);
    let p = plan(&j, &pods, t(9));
    assert_eq!(p.create_pods, [0, 1]);
    assert_eq!(p.incarnation(0), 0);
    let (j, pods) = apply(j, pods, &p);
    let mut pods = set_all(pods, "Running", true, None);
    let p = plan(&j, &pods, t(10));
    let (j, _) = apply(j, pods.clone(), &p);
    fail_pod(&mut pods, 0, 1);
    let p = plan(&j, &pods, t(11));
    assert_eq!(phase(&p), JobPhase::Failed);
    let c = crate::status::condition(&p.status.conditions, COND_FAILED).unwrap();
    assert_eq!(c.reason, "MaxRestartsExceeded");
    assert!(c.message.contains("maxReplacements 1"), "{}", c.message);
}

#[test]
fn max_replacements_zero_behaves_as_restart_job() {
    let (j, mut pods) = running(replace_job("a", 2, 1, 0));
    fail_pod(&mut pods, 1, 1);
    let p = plan(&j, &pods, t(5));
    assert_eq!(phase(&p), JobPhase::Restarting);
    assert_eq!(p.status.replacements, 0);
    assert!(p.status.recoveries.is_empty());
}

#[test]
fn second_failure_while_a_pod_is_replaced() {
    let (j, mut pods) = running(replace_job("a", 3, 1, 5));
    fail_pod(&mut pods, 1, 1);
    let p = plan(&j, &pods, t(5));
    let (j, mut pods) = apply(j, pods, &p);
    // a-1 is gone, not yet recreated; now a-2 fails too.
    let i = pods.iter().position(|p| p.name_any() == "a-2").unwrap();
    fail_pod(&mut pods, i, 2);
    let p = plan(&j, &pods, t(6));
    assert_eq!(phase(&p), JobPhase::Running);
    assert_eq!(p.delete_pods, ["a-2"]);
    assert_eq!(p.create_pods, [1]);
    assert_eq!(p.status.replacements, 2);
    let live: Vec<(i32, i32, i32)> = p
        .status
        .recoveries
        .iter()
        .filter(|r| r.state == RecoveryState::Replacing)
        .map(|r| (r.replica_index, r.incarnation, r.count))
        .collect();
    assert_eq!(live, [(1, 1, 1), (2, 1, 2)]);
    assert_eq!(
        reasons(&p),
        ["RankFailed", "ReplacingRank", "ReplacementCreated"]
    );
    let (j, pods) = apply(j, pods, &p);
    let p = plan(&j, &pods, t(7));
    assert_eq!(p.create_pods, [2]);
    assert_eq!(p.incarnation(2), 1);
    let (j, pods) = apply(j, pods, &p);

    // The replacement of a-1 fails before it is ready: replaced again,
    // with the next incarnation; the first record says so.
    let mut pods = pods;
    let i = pods.iter().position(|p| p.name_any() == "a-1").unwrap();
    fail_pod(&mut pods, i, 3);
    let p = plan(&j, &pods, t(8));
    assert_eq!(phase(&p), JobPhase::Running);
    assert_eq!(p.delete_pods, ["a-1"]);
    assert_eq!(p.status.replacements, 3);
    let states: Vec<(i32, i32, RecoveryState)> = p
        .status
        .recoveries
        .iter()
        .map(|r| (r.replica_index, r.incarnation, r.state))
        .collect();
    assert_eq!(
        states,
        [
            (1, 1, RecoveryState::ReplacementFailed),
            (2, 1, RecoveryState::Replacing),
            (1, 2, RecoveryState::Replacing)
        ]
    );
    let (j, pods) = apply(j, pods, &p);
    let p = plan(&j, &pods, t(9));
    assert_eq!(p.create_pods, [1]);
    assert_eq!(p.incarnation(1), 2);
    let (j, pods) = apply(j, pods, &p);
    assert_eq!(env_of(pod_of(&pods, "a-1"))["WEFT_INCARNATION"], "2");
    let pods = set_all(pods, "Running", true, None);
    let p = plan(&j, &pods, t(20));
    assert_eq!(phase(&p), JobPhase::Running);
    assert_eq!(reasons(&p), ["RankReplaced", "RankReplaced"]);
    assert!(
        p.status
            .recoveries
            .iter()
            .all(|r| r.state != RecoveryState::Replacing)
    );
    assert_eq!(p.status.recoveries[2].time_lost_seconds, Some(12));
    assert_eq!(p.status.restarts, 0);
}

#[test]
fn replacing_pod_deleted_by_hand_waits_for_it_then_recreates() {
    let (j, mut pods) = running(replace_job("a", 2, 1, 3));
    pods[1].metadata.deletion_timestamp = Some(Time(t(5)));
    let p = plan(&j, &pods, t(5));
    assert_eq!(phase(&p), JobPhase::Running);
    assert!(p.delete_pods.is_empty(), "already terminating");
    assert_eq!(p.status.recoveries[0].reason, "PodDeleted");
    let (j, _) = apply(j, pods.clone(), &p);
    // Still terminating: no new failure, nothing created.
    let p = plan(&j, &pods, t(6));
    assert!(p.events.is_empty() && p.create_pods.is_empty());
    assert_eq!(p.status.replacements, 1);
    assert_eq!(p.status.ranks[1].phase, "Terminating");
    // Stuck on a lost node: force-deleted.
    let p = plan(&j, &pods, t(5 + FORCE_DELETE_AFTER_SECS));
    assert_eq!(p.force_delete_pods, ["a-1"]);
    // Gone: recreated.
    pods.remove(1);
    let p = plan(&j, &pods, t(70));
    assert_eq!(p.create_pods, [1]);
    assert!(p.status.last_failure.is_some());
    assert_eq!(p.status.replacements, 1);
    // A pod that vanished entirely is replaced too.
    let (j, pods) = running(replace_job("b", 2, 1, 3));
    let p = plan(&j, &pods[..1], t(5));
    assert_eq!(phase(&p), JobPhase::Running);
    assert_eq!(p.create_pods, [1]);
    assert_eq!(p.incarnation(1), 1);
    assert_eq!(
        reasons(&p),
        ["RankFailed", "ReplacingRank", "ReplacementCreated"]
    );
    assert_eq!(p.status.ranks[1].phase, "Creating");
}

#[test]
fn replace_rank_permanent_exit_code_fails_the_job() {
    let mut j = replace_job("a", 2, 1, 3);
    j.spec.failure_policy.permanent_exit_codes = vec![64];
    let (j, mut pods) = running(j);
    fail_pod(&mut pods, 0, 64);
    let p = plan(&j, &pods, t(5));
    assert_eq!(phase(&p), JobPhase::Failed);
    assert_eq!(p.status.replacements, 0);
    assert!(!reasons(&p).contains(&"ReplacementsExhausted"));
}

#[test]
fn deadline_during_a_replacement_abandons_it() {
    let mut j = replace_job("a", 2, 1, 3);
    j.spec.run_policy.active_deadline_seconds = Some(60);
    let (j, mut pods) = running(j);
    fail_pod(&mut pods, 0, 1);
    let p = plan(&j, &pods, t(5));
    let (j, pods) = apply(j, pods, &p);
    let p = plan(&j, &pods, t(60));
    assert_eq!(phase(&p), JobPhase::Failed);
    assert_eq!(p.status.recoveries[0].state, RecoveryState::Abandoned);
    let c = crate::status::condition(&p.status.conditions, COND_REPLACING).unwrap();
    assert_eq!(
        (c.status.as_str(), c.reason.as_str()),
        ("False", "Abandoned")
    );
}

#[test]
fn recovery_history_is_bounded() {
    let (mut j, pods) = running(replace_job("a", 1, 1, 1000));
    let mut pods = pods;
    for k in 0..(MAX_RECOVERY_RECORDS as i64 + 5) {
        fail_pod(&mut pods, 0, 1);
        let p = plan(&j, &pods, t(10 + 3 * k));
        let (j2, pods2) = apply(j, pods, &p);
        let p = plan(&j2, &pods2, t(11 + 3 * k));
        let (j2, pods2) = apply(j2, pods2, &p);
        let pods2 = set_all(pods2, "Running", true, None);
        let p = plan(&j2, &pods2, t(12 + 3 * k));
        assert_eq!(phase(&p), JobPhase::Running);
        (j, pods) = apply(j2, pods2, &p);
    }
    let st = j.status.unwrap();
    assert_eq!(st.replacements, MAX_RECOVERY_RECORDS as i32 + 5);
    assert_eq!(st.recoveries.len(), MAX_RECOVERY_RECORDS);
    assert_eq!(st.recoveries.last().unwrap().count, st.replacements);
    assert_eq!(st.ranks[0].incarnation, st.replacements);
}

/// Ends pod `i`'s workload with `code` at `at` (its `finishedAt`).
fn end_pod_at(pods: &mut [Pod], i: usize, code: i32, at: Timestamp) {
    pods[i] = with_status(
        pods[i].clone(),
        "Failed",
        false,
        vec![crate::status::tests::cs_exited_at("main", code, at)],
    );
}

/// The failure named by a restart: `lastFailure`, the RankFailed event and
/// the Restarting condition.
fn blamed(p: &Plan) -> (String, String, String) {
    let f = p.status.last_failure.as_ref().unwrap();
    let note = p
        .events
        .iter()
        .find(|e| e.reason == "RankFailed")
        .unwrap()
        .note
        .clone();
    let cond = crate::status::condition(&p.status.conditions, COND_RESTARTING).unwrap();
    (f.pod.clone(), note, cond.message.clone())
}

/// Issue 31 (7): a rank of pod 1 is killed (SIGKILL, exit 137); pod 0 exits
/// 1 in reaction, even a moment earlier than the kubelet reports pod 1's end.
/// The restart names pod 1, not the first pod in replica order.
#[test]
fn a_killed_rank_is_blamed_not_the_peer_that_exited_in_reaction() {
    let (j, mut pods) = running(job("k", 3, 2));
    end_pod_at(&mut pods, 0, 1, t(10));
    end_pod_at(&mut pods, 1, 137, t(11));
    end_pod_at(&mut pods, 2, 1, t(10));
    let p = plan(&j, &pods, t(12));
    assert_eq!(phase(&p), JobPhase::Restarting);
    let (pod, note, cond) = blamed(&p);
    assert_eq!(pod, "k-1");
    assert_eq!(p.status.last_failure.as_ref().unwrap().exit_code, Some(137));
    assert_eq!(
        note,
        "Rank failure in pod k-1 (container main, exit code 137, Error)"
    );
    assert!(
        cond.contains("pod k-1 (container main, exit code 137"),
        "{cond}"
    );
    assert_eq!(reasons(&p), ["RankFailed", "Restarting"]);
}

/// Among ranks that all exited with an error, the one that ended first is the
/// cause; the OOM killer, SIGTERM, a runtime-reported signal and a pod
/// deleted by hand each count as "ended from outside".
#[test]
fn root_cause_order_of_rank_failures() {
    // Error exits only: the earliest finishedAt, whatever the replica order.
    let (j, mut pods) = running(job("e", 3, 1));
    end_pod_at(&mut pods, 0, 1, t(20));
    end_pod_at(&mut pods, 1, 2, t(21));
    end_pod_at(&mut pods, 2, 1, t(19));
    assert_eq!(blamed(&plan(&j, &pods, t(30))).0, "e-2");

    // Unknown finish times: replica order, as before.
    let (j, mut pods) = running(job("u", 2, 1));
    fail_pod(&mut pods, 0, 1);
    fail_pod(&mut pods, 1, 1);
    assert_eq!(blamed(&plan(&j, &pods, t(22))).0, "u-0");

    let from_outside = |edit: &dyn Fn(&mut ContainerStateTerminated)| {
        let (j, mut pods) = running(job("o", 2, 1));
        end_pod_at(&mut pods, 0, 1, t(5));
        end_pod_at(&mut pods, 1, 1, t(9));
        let cs = &mut pods[1]
            .status
            .as_mut()
            .unwrap()
            .container_statuses
            .as_mut()
            .unwrap()[0];
        edit(cs.state.as_mut().unwrap().terminated.as_mut().unwrap());
        blamed(&plan(&j, &pods, t(10))).0
    };
    assert_eq!(from_outside(&|_| {}), "o-0", "both exited: the earlier");
    assert_eq!(from_outside(&|t| t.exit_code = 143), "o-1", "SIGTERM");
    assert_eq!(from_outside(&|t| t.signal = Some(9)), "o-1", "signal");
    assert_eq!(
        from_outside(&|t| t.reason = Some("OOMKilled".into())),
        "o-1",
        "OOM killer"
    );

    // A pod deleted by hand (its peer exits 1 in reaction) is the cause.
    let (j, mut pods) = running(job("d", 2, 1));
    end_pod_at(&mut pods, 0, 1, t(5));
    pods[1].metadata.deletion_timestamp = Some(Time(t(30)));
    let (pod, note, _) = blamed(&plan(&j, &pods, t(6)));
    assert_eq!(pod, "d-1");
    assert!(note.contains("PodDeleted"), "{note}");
}

/// Issue 31 (7): a rank that exited with an error is acted on only once its
/// peers had a moment to report the failure that made it exit.
#[test]
fn an_error_exit_waits_a_moment_for_the_cause() {
    let (j, mut pods) = running(job("w", 2, 1));
    end_pod_at(&mut pods, 0, 1, t(10));
    let p = plan(&j, &pods, t(11));
    assert_eq!(
        Some(&p.status),
        j.status.as_ref(),
        "nothing decided, nothing written"
    );
    assert!(p.events.is_empty() && p.delete_pods.is_empty() && p.create_pods.is_empty());
    assert_eq!(
        p.requeue_after,
        Some(Duration::from_secs(FAILURE_GATHER_SECS as u64 - 1))
    );

    // The killed peer is reported meanwhile: it is named at once.
    let mut killed = pods.clone();
    end_pod_at(&mut killed, 1, 137, t(10));
    assert_eq!(blamed(&plan(&j, &killed, t(11))).0, "w-1");

    // Nobody else failed: once the moment is over, the error exit is the cause.
    let p = plan(&j, &pods, t(10 + FAILURE_GATHER_SECS));
    assert_eq!(phase(&p), JobPhase::Restarting);
    assert_eq!(blamed(&p).0, "w-0");

    // A node clock ahead of the operator's does not stall the job.
    end_pod_at(&mut pods, 0, 1, t(60));
    assert_eq!(phase(&plan(&j, &pods, t(11))), JobPhase::Restarting);
}
