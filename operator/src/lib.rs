//! Weft's Kubernetes operator: reconciles `CollectiveJob`s into a headless
//! Service, a job Secret and one Pod per replica with the Weft sidecar.
//!
//! Decisions are pure functions (`resources`, `status`, `policy`); the
//! `controller` module only reads the cluster and executes plans.

pub mod controller;
pub mod crd;
pub mod leader;
pub mod policy;
pub mod resources;
pub mod status;
pub mod telemetry;
pub mod uninstall;
