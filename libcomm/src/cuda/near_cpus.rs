//! The CPUs near a GPU (`WEFT_CPU_AFFINITY=gpu`, the default): where the
//! cross-host path places its threads (progress thread, engine, socket
//! helpers) and pins its host buffers; `sys/affinity.rs` says why.

use super::driver::pci_location;
use crate::sys::affinity::{self, CpuSet, OnCpus};
use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

/// The CPUs near device `dev` (looked up once per device and process);
/// None with `WEFT_CPU_AFFINITY=none`, or where the driver or sysfs does
/// not say.
pub(super) fn near(dev: i32) -> Option<CpuSet> {
    if weft_contract::params::WEFT_CPU_AFFINITY.value() == "none" {
        return None;
    }
    static BY_DEVICE: OnceLock<Mutex<HashMap<i32, Option<CpuSet>>>> = OnceLock::new();
    *BY_DEVICE
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .entry(dev)
        .or_insert_with(|| affinity::near_pci(pci_location(dev).ok()?))
}

/// The calling thread on the CPUs near `dev` (within its own mask) until
/// the guard drops; None where that changes nothing (see
/// [`affinity::run_on`]).
pub(super) fn run_near(dev: i32) -> Option<OnCpus> {
    affinity::run_on(&near(dev)?, |before, why| {
        crate::log::warn_log!(
            "could not put this thread back on CPUs {before:?} (its mask before the host buffers were pinned): {why}"
        )
    })
}

/// The CPUs near `dev` within the calling thread's mask, where that
/// narrows it: the placement of the threads the cross-host path starts
/// for `dev` ([`affinity::placing`]).
pub(super) fn placement_near(dev: i32) -> Option<CpuSet> {
    affinity::narrowing(&near(dev)?)
}
