//! Kubernetes Events (events.k8s.io/v1) on the objects the operator manages.

use std::collections::HashMap;

use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::api::events::v1::{Event as K8sEvent, EventSeries};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::Client;
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::json;

/// Kubernetes Events (events.k8s.io/v1) on the objects the operator manages.
///
/// Unlike kube's `Recorder`, which folds every repeat of a reason into one
/// Event and so keeps its first note ("RankFailed x3" naming the first failure
/// only), an Event here is a series only while its note is identical: a new
/// note is a new Event.
pub struct Events {
    client: Client,
    controller: String,
    instance: String,
    cache: tokio::sync::Mutex<HashMap<EventKey, (String, i32, Timestamp)>>,
}

/// (object uid, type, reason, note) of an Event series; the cache maps it to
/// (event name, count, last seen).
type EventKey = (String, String, String, String);

/// How long a repeated Event is counted in the same series (as client-go).
const EVENT_SERIES_WINDOW_SECS: i64 = 6 * 60;

impl Events {
    pub fn new(client: Client, instance: String) -> Self {
        Self {
            client,
            controller: "weft.dev/weft-operator".into(),
            instance,
            cache: tokio::sync::Mutex::default(),
        }
    }

    pub async fn publish(
        &self,
        regarding: &ObjectReference,
        warning: bool,
        reason: &str,
        action: &str,
        note: &str,
    ) -> Result<(), kube::Error> {
        let now = Timestamp::now();
        let ns = regarding
            .namespace
            .clone()
            .unwrap_or_else(|| "default".into());
        let api: Api<K8sEvent> = Api::namespaced(self.client.clone(), &ns);
        let type_ = if warning { "Warning" } else { "Normal" };
        let note: String = note.chars().take(1000).collect();
        let key = (
            regarding.uid.clone().unwrap_or_default(),
            type_.to_string(),
            reason.to_string(),
            note.clone(),
        );
        let mut cache = self.cache.lock().await;
        cache.retain(|_, (_, _, t)| now.as_second() - t.as_second() < EVENT_SERIES_WINDOW_SECS);
        if let Some((name, count, when)) = cache.get_mut(&key) {
            *count += 1;
            *when = now;
            let patch = json!({"series": EventSeries {
                count: *count,
                last_observed_time: MicroTime(now),
            }});
            api.patch(name, &PatchParams::default(), &Patch::Merge(&patch))
                .await?;
            return Ok(());
        }
        let name = format!(
            "{}.{:x}",
            regarding.name.as_deref().unwrap_or("weft-operator"),
            now.as_nanosecond()
        );
        let ev = K8sEvent {
            metadata: ObjectMeta {
                name: Some(name.clone()),
                namespace: Some(ns),
                ..ObjectMeta::default()
            },
            event_time: Some(MicroTime(now)),
            action: Some(action.into()),
            reason: Some(reason.into()),
            note: Some(note),
            regarding: Some(regarding.clone()),
            reporting_controller: Some(self.controller.clone()),
            reporting_instance: Some(self.instance.clone()),
            type_: Some(type_.into()),
            ..K8sEvent::default()
        };
        api.create(&PostParams::default(), &ev).await?;
        cache.insert(key, (name, 1, now));
        Ok(())
    }
}
