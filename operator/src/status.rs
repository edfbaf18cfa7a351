//! Reading pods: what state each replica is in, and the status fields that
//! follow from it (rank table, ready count, conditions). Pure functions.

use k8s_openapi::api::core::v1::{ContainerStatus, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;

use crate::crd::{CollectiveJob, RankEntry, RankFailure};
use crate::resources::{LABEL_EPOCH, LABEL_INCARNATION, LABEL_INDEX, SIDECAR_NAME, pod_name};

/// What one pod tells us.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PodState {
    /// Not scheduled or containers not all started.
    Pending,
    /// Phase Running (`ready` = the Ready condition).
    Running { ready: bool },
    /// Every workload container exited 0.
    Succeeded,
    /// A workload container failed, or the pod failed (evicted, ...).
    Failed(FailureDetail),
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FailureDetail {
    pub container: Option<String>,
    pub exit_code: Option<i32>,
    pub reason: String,
    pub message: String,
    /// The signal that ended the container, when the runtime reports one.
    pub signal: Option<i32>,
    /// When the container ended (`finishedAt`), when known.
    pub finished_at: Option<Timestamp>,
}

/// A pod of the job, reduced to what the policy needs.
#[derive(Clone, Debug)]
pub struct PodView {
    pub name: String,
    pub index: Option<i32>,
    pub epoch: Option<i32>,
    /// `weft.dev/incarnation` (0 when absent).
    pub incarnation: i32,
    pub node: Option<String>,
    pub terminating: bool,
    /// When the kubelet's grace period for a terminating pod ends
    /// (`metadata.deletionTimestamp`).
    pub delete_deadline: Option<Timestamp>,
    pub state: PodState,
    /// Why a container is not running yet, when the kubelet says
    /// (`container bench: ImagePullBackOff: ...`), for the Ready condition.
    pub waiting: Option<String>,
}

fn label_i32(pod: &Pod, key: &str) -> Option<i32> {
    pod.metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(key))
        .and_then(|v| v.parse().ok())
}

fn terminated_failure(cs: &ContainerStatus) -> Option<FailureDetail> {
    let t = cs.state.as_ref()?.terminated.as_ref()?;
    (t.exit_code != 0).then(|| FailureDetail {
        container: Some(cs.name.clone()),
        exit_code: Some(t.exit_code),
        reason: t.reason.clone().unwrap_or_else(|| "Error".into()),
        message: t.message.clone().unwrap_or_default(),
        signal: t.signal.filter(|s| *s != 0),
        finished_at: t.finished_at.as_ref().map(|f| f.0),
    })
}

fn terminated_ok(cs: &ContainerStatus) -> bool {
    cs.state
        .as_ref()
        .and_then(|s| s.terminated.as_ref())
        .is_some_and(|t| t.exit_code == 0)
}

/// Classifies a pod. Workload containers are all regular containers plus the
/// template's (non-sidecar) init containers; the Weft sidecar is restarted by
/// the kubelet and is not a workload.
pub fn classify(pod: &Pod) -> PodView {
    let status = pod.status.clone().unwrap_or_default();
    let phase = status.phase.as_deref().unwrap_or("Pending");
    let workload: Vec<&ContainerStatus> = status.container_statuses.iter().flatten().collect();
    let init_failure = status
        .init_container_statuses
        .iter()
        .flatten()
        .filter(|c| c.name != SIDECAR_NAME)
        .find_map(terminated_failure);
    let failure = init_failure.or_else(|| workload.iter().find_map(|c| terminated_failure(c)));
    let n_containers = pod.spec.as_ref().map(|s| s.containers.len()).unwrap_or(0);

    let state = if let Some(f) = failure {
        PodState::Failed(f)
    } else if phase == "Failed" {
        PodState::Failed(FailureDetail {
            container: None,
            exit_code: None,
            reason: status.reason.clone().unwrap_or_else(|| "PodFailed".into()),
            message: status.message.clone().unwrap_or_default(),
            signal: None,
            finished_at: None,
        })
    } else if phase == "Succeeded"
        || (!workload.is_empty()
            && workload.len() >= n_containers
            && workload.iter().all(|c| terminated_ok(c)))
    {
        PodState::Succeeded
    } else if phase == "Running" {
        let ready = status
            .conditions
            .iter()
            .flatten()
            .any(|c| c.type_ == "Ready" && c.status == "True");
        PodState::Running { ready }
    } else {
        PodState::Pending
    };
    let waiting = status
        .init_container_statuses
        .iter()
        .flatten()
        .chain(status.container_statuses.iter().flatten())
        .find_map(|c| {
            let w = c.state.as_ref()?.waiting.as_ref()?;
            let reason = w.reason.as_deref()?;
            // ContainerCreating / PodInitializing are normal progress, not news.
            if matches!(reason, "ContainerCreating" | "PodInitializing") {
                return None;
            }
            let mut s = format!("container {}: {reason}", c.name);
            if let Some(m) = w.message.as_deref().filter(|m| !m.is_empty()) {
                s.push_str(": ");
                s.push_str(m);
            }
            Some(s)
        });
    PodView {
        waiting,
        name: pod.metadata.name.clone().unwrap_or_default(),
        index: label_i32(pod, LABEL_INDEX),
        epoch: label_i32(pod, LABEL_EPOCH),
        incarnation: label_i32(pod, LABEL_INCARNATION).unwrap_or(0),
        node: pod.spec.as_ref().and_then(|s| s.node_name.clone()),
        terminating: pod.metadata.deletion_timestamp.is_some(),
        delete_deadline: pod.metadata.deletion_timestamp.as_ref().map(|t| t.0),
        state,
    }
}

impl PodView {
    pub fn phase_str(&self) -> &'static str {
        if self.terminating {
            return "Terminating";
        }
        match self.state {
            PodState::Pending => "Pending",
            PodState::Running { .. } => "Running",
            PodState::Succeeded => "Succeeded",
            PodState::Failed(_) => "Failed",
        }
    }
    pub fn ready(&self) -> bool {
        !self.terminating && matches!(self.state, PodState::Running { ready: true })
    }
    pub fn failure(&self, epoch: i32) -> Option<RankFailure> {
        match &self.state {
            PodState::Failed(f) => Some(RankFailure {
                pod: self.name.clone(),
                container: f.container.clone(),
                exit_code: f.exit_code,
                reason: f.reason.clone(),
                message: f.message.clone(),
                epoch,
            }),
            _ => None,
        }
    }
}

/// One rank-table row per replica, from the pods of the current epoch.
pub fn rank_table(job: &CollectiveJob, current: &[PodView]) -> Vec<RankEntry> {
    let rpr = job.spec.ranks_per_replica;
    (0..job.spec.replicas)
        .map(|i| {
            let pod = current.iter().find(|p| p.index == Some(i));
            RankEntry {
                pod: pod_name(job, i),
                node: pod.and_then(|p| p.node.clone()),
                first_rank: i * rpr,
                ranks: rpr,
                ready: pod.is_some_and(PodView::ready),
                phase: pod.map_or("Missing", PodView::phase_str).to_string(),
                incarnation: pod.map_or(0, |p| p.incarnation),
            }
        })
        .collect()
}

/// Sets a condition, keeping `lastTransitionTime` when its status is unchanged
/// (so an unchanged world produces an identical status and no write).
pub fn set_condition(
    conds: &mut Vec<Condition>,
    type_: &str,
    status: bool,
    reason: &str,
    message: impl Into<String>,
    now: Timestamp,
    generation: Option<i64>,
) {
    let status = if status { "True" } else { "False" };
    let message = message.into();
    if let Some(c) = conds.iter_mut().find(|c| c.type_ == type_) {
        if c.status != status {
            c.last_transition_time = Time(now);
        }
        c.status = status.into();
        c.reason = reason.into();
        c.message = message;
        c.observed_generation = generation;
    } else {
        conds.push(Condition {
            type_: type_.into(),
            status: status.into(),
            reason: reason.into(),
            message,
            last_transition_time: Time(now),
            observed_generation: generation,
        });
    }
}

pub fn condition<'a>(conds: &'a [Condition], type_: &str) -> Option<&'a Condition> {
    conds.iter().find(|c| c.type_ == type_)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::resources::{OperatorConfig, desired_pod, tests::job};
    use k8s_openapi::api::core::v1::{
        ContainerState, ContainerStateRunning, ContainerStateTerminated, PodCondition, PodStatus,
    };

    pub fn cs_running(name: &str) -> ContainerStatus {
        ContainerStatus {
            name: name.into(),
            state: Some(ContainerState {
                running: Some(ContainerStateRunning::default()),
                ..ContainerState::default()
            }),
            ..ContainerStatus::default()
        }
    }

    pub fn cs_exited(name: &str, code: i32) -> ContainerStatus {
        ContainerStatus {
            name: name.into(),
            state: Some(ContainerState {
                terminated: Some(ContainerStateTerminated {
                    exit_code: code,
                    reason: Some(if code == 0 { "Completed" } else { "Error" }.into()),
                    ..ContainerStateTerminated::default()
                }),
                ..ContainerState::default()
            }),
            ..ContainerStatus::default()
        }
    }

    /// A container that exited with `code` at `at` (its `finishedAt`).
    pub fn cs_exited_at(name: &str, code: i32, at: Timestamp) -> ContainerStatus {
        let mut cs = cs_exited(name, code);
        if let Some(t) = cs.state.as_mut().and_then(|s| s.terminated.as_mut()) {
            t.finished_at = Some(Time(at));
        }
        cs
    }

    /// Gives a desired pod a status as the kubelet would.
    pub fn with_status(
        mut pod: Pod,
        phase: &str,
        ready: bool,
        containers: Vec<ContainerStatus>,
    ) -> Pod {
        pod.spec.as_mut().unwrap().node_name = Some("node-a".into());
        pod.status = Some(PodStatus {
            phase: Some(phase.into()),
            conditions: Some(vec![PodCondition {
                type_: "Ready".into(),
                status: if ready { "True" } else { "False" }.into(),
                ..PodCondition::default()
            }]),
            container_statuses: Some(containers),
            init_container_statuses: Some(vec![cs_running(SIDECAR_NAME)]),
            ..PodStatus::default()
        });
        pod
    }

    fn pod() -> Pod {
        desired_pod(&job("c", 2, 4), 1, 3, &OperatorConfig::default())
    }

    #[test]
    fn classify_states() {
        let v = classify(&pod());
        assert_eq!(v.state, PodState::Pending);
        assert_eq!((v.index, v.epoch), (Some(1), Some(3)));

        let v = classify(&with_status(
            pod(),
            "Running",
            true,
            vec![cs_running("main")],
        ));
        assert_eq!(v.state, PodState::Running { ready: true });
        assert!(v.ready());
        assert_eq!(v.node.as_deref(), Some("node-a"));

        // workload done, sidecar not yet stopped: still counts as success
        let v = classify(&with_status(
            pod(),
            "Running",
            false,
            vec![cs_exited("main", 0)],
        ));
        assert_eq!(v.state, PodState::Succeeded);

        let v = classify(&with_status(
            pod(),
            "Running",
            false,
            vec![cs_exited("main", 3)],
        ));
        let f = v.failure(3).unwrap();
        assert_eq!(
            (f.container.as_deref(), f.exit_code),
            (Some("main"), Some(3))
        );
        assert_eq!(f.pod, "c-1");

        let mut p = with_status(pod(), "Failed", false, vec![]);
        p.status.as_mut().unwrap().reason = Some("Evicted".into());
        let f = classify(&p).failure(0).unwrap();
        assert_eq!((f.reason.as_str(), f.exit_code), ("Evicted", None));
    }

    /// What the root-cause ordering of failures needs: when the container
    /// ended and by which signal.
    #[test]
    fn failure_detail_keeps_finish_time_and_signal() {
        let at = Timestamp::from_second(1_800_000_042).unwrap();
        let mut cs = cs_exited_at("main", 137, at);
        cs.state
            .as_mut()
            .unwrap()
            .terminated
            .as_mut()
            .unwrap()
            .signal = Some(9);
        let v = classify(&with_status(pod(), "Failed", false, vec![cs]));
        let PodState::Failed(d) = v.state else {
            panic!("{:?}", v.state)
        };
        assert_eq!(
            (d.exit_code, d.signal, d.finished_at),
            (Some(137), Some(9), Some(at))
        );
    }

    #[test]
    fn multi_container_pod_succeeds_only_when_all_exit_zero() {
        let mut p = pod();
        let first = p.spec.as_ref().unwrap().containers[0].clone();
        p.spec.as_mut().unwrap().containers.push(first);
        p.spec.as_mut().unwrap().containers[1].name = "second".into();
        let half = with_status(
            p.clone(),
            "Running",
            true,
            vec![cs_exited("main", 0), cs_running("second")],
        );
        assert_eq!(classify(&half).state, PodState::Running { ready: true });
        let one_status = with_status(p.clone(), "Running", true, vec![cs_exited("main", 0)]);
        assert_ne!(classify(&one_status).state, PodState::Succeeded);
        let done = with_status(
            p,
            "Running",
            false,
            vec![cs_exited("main", 0), cs_exited("second", 0)],
        );
        assert_eq!(classify(&done).state, PodState::Succeeded);
    }

    #[test]
    fn sidecar_restarts_are_not_failures_but_init_failures_are() {
        let mut p = with_status(pod(), "Running", true, vec![cs_running("main")]);
        p.status.as_mut().unwrap().init_container_statuses = Some(vec![cs_exited(SIDECAR_NAME, 1)]);
        assert!(matches!(classify(&p).state, PodState::Running { .. }));
        p.status.as_mut().unwrap().init_container_statuses = Some(vec![cs_exited("fetch", 2)]);
        let f = classify(&p).failure(0).unwrap();
        assert_eq!(f.container.as_deref(), Some("fetch"));
    }

    #[test]
    fn waiting_reasons_are_reported() {
        use k8s_openapi::api::core::v1::{ContainerState, ContainerStateWaiting};
        let waiting = |reason: &str| ContainerStatus {
            name: "main".into(),
            state: Some(ContainerState {
                waiting: Some(ContainerStateWaiting {
                    reason: Some(reason.into()),
                    message: Some("pull access denied".into()),
                }),
                ..ContainerState::default()
            }),
            ..ContainerStatus::default()
        };
        let p = with_status(pod(), "Pending", false, vec![waiting("ImagePullBackOff")]);
        assert_eq!(
            classify(&p).waiting.as_deref(),
            Some("container main: ImagePullBackOff: pull access denied")
        );
        let p = with_status(pod(), "Pending", false, vec![waiting("ContainerCreating")]);
        assert_eq!(classify(&p).waiting, None);
    }

    #[test]
    fn rank_table_rows() {
        let j = job("r", 3, 4);
        let running = classify(&with_status(
            desired_pod(&j, 1, 0, &OperatorConfig::default()),
            "Running",
            true,
            vec![cs_running("main")],
        ));
        let t = rank_table(&j, &[running]);
        assert_eq!(t.len(), 3);
        assert_eq!(
            (t[0].pod.as_str(), t[0].first_rank, t[0].ranks),
            ("r-0", 0, 4)
        );
        assert_eq!(t[0].phase, "Missing");
        assert!(!t[0].ready);
        assert_eq!(
            (t[1].first_rank, t[1].ready, t[1].node.as_deref()),
            (4, true, Some("node-a"))
        );
        assert_eq!(t[2].first_rank, 8);
    }

    #[test]
    fn condition_transition_time_only_moves_on_change() {
        let t0: Timestamp = "2026-01-01T00:00:00Z".parse().unwrap();
        let t1: Timestamp = "2026-01-01T00:01:00Z".parse().unwrap();
        let mut c = vec![];
        set_condition(&mut c, "Ready", false, "Starting", "x", t0, Some(1));
        set_condition(&mut c, "Ready", false, "Starting", "y", t1, Some(1));
        assert_eq!(c[0].last_transition_time.0, t0);
        assert_eq!(c[0].message, "y");
        set_condition(&mut c, "Ready", true, "AllPodsReady", "z", t1, Some(2));
        assert_eq!(c[0].last_transition_time.0, t1);
        assert_eq!(condition(&c, "Ready").unwrap().observed_generation, Some(2));
    }
}
