//! CollectiveJobs that do not decode: left out of the watch and reported on
//! the object itself, so one bad object never stops the others.

use std::sync::Arc;

use k8s_openapi::api::core::v1::ObjectReference;
use kube::ResourceExt;
use kube::api::{Api, ApiResource, DynamicObject, Patch, PatchParams};
use serde_json::json;
use tracing::warn;

use super::Context;
use crate::crd::CollectiveJob;
use crate::policy;

/// Decodes one watched object. A CollectiveJob that does not decode (e.g.
/// created before the CRD typed the pod template, or by a newer operator)
/// is reported on the object itself and left out; it never stops the watch
/// of the others, which a typed `Api<CollectiveJob>` list would.
pub(super) fn decode(
    obj: DynamicObject,
    ctx: &Arc<Context>,
    report: bool,
) -> Option<CollectiveJob> {
    let value = match serde_json::to_value(&obj) {
        Ok(v) => v,
        Err(e) => {
            warn!(error = %e, "cannot serialise a watched object");
            return None;
        }
    };
    match serde_json::from_value::<CollectiveJob>(value) {
        Ok(job) => Some(job),
        Err(e) if report => {
            let ctx = ctx.clone();
            let msg = e.to_string();
            tokio::spawn(async move { report_undecodable(&ctx, &obj, &msg).await });
            None
        }
        Err(e) => {
            warn!(job = %obj.name_any(), error = %e, "cannot decode a deleted CollectiveJob");
            None
        }
    }
}

/// Marks an undecodable job: a `Decodable=False` condition with the decode
/// error (merge patch of the status subresource, which needs no decoding) and
/// a Warning event. Once per resourceVersion, and not again while the
/// condition already says the same.
pub async fn report_undecodable(ctx: &Context, obj: &DynamicObject, error: &str) {
    let name = obj.name_any();
    let ns = obj.namespace().unwrap_or_else(|| "default".into());
    let uid = obj.uid().unwrap_or_default();
    let rv = obj.resource_version().unwrap_or_default();
    if !ctx
        .reported_undecodable
        .lock()
        .unwrap()
        .insert((uid.clone(), rv))
    {
        return;
    }
    let message = format!(
        "the operator cannot read this CollectiveJob, so it is not run: {error}. \
         Fix the spec (kubectl edit) or delete and re-create it."
    );
    warn!(job = %name, namespace = %ns, %error, "cannot decode a CollectiveJob; skipping it");
    ctx.metrics.reconcile_failed("decode");
    let mut conditions: Vec<serde_json::Value> = obj.data["status"]["conditions"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let already = conditions.iter().any(|c| {
        c["type"] == policy::COND_DECODABLE && c["message"].as_str() == Some(message.as_str())
    });
    if already {
        // Reported before (this is the update our own status patch caused).
        return;
    }
    conditions.retain(|c| c["type"] != policy::COND_DECODABLE);
    conditions.push(json!({
        "type": policy::COND_DECODABLE,
        "status": "False",
        "reason": "InvalidObject",
        "message": message,
        "lastTransitionTime": (ctx.clock)().to_string(),
        "observedGeneration": obj.metadata.generation,
    }));
    let api: Api<DynamicObject> = Api::namespaced_with(
        ctx.client.clone(),
        &ns,
        &ApiResource::erase::<CollectiveJob>(&()),
    );
    let patch = json!({"status": {"conditions": conditions}});
    match api
        .patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
    {
        // The watch will deliver this new version: it is reported already.
        Ok(patched) => {
            if let Some(rv) = patched.resource_version() {
                ctx.reported_undecodable
                    .lock()
                    .unwrap()
                    .insert((uid.clone(), rv));
            }
        }
        Err(e) => warn!(job = %name, error = %e, "could not mark an undecodable CollectiveJob"),
    }
    let oref = ObjectReference {
        api_version: Some(format!("{}/{}", crate::crd::GROUP, crate::crd::VERSION)),
        kind: Some("CollectiveJob".into()),
        name: Some(name.clone()),
        namespace: Some(ns),
        uid: Some(uid),
        ..ObjectReference::default()
    };
    if let Err(e) = ctx
        .events
        .publish(&oref, true, "InvalidObject", "Decode", &message)
        .await
    {
        warn!(job = %name, error = %e, "could not publish event");
    }
}
