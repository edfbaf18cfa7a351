//! Best-effort removal of a job's leftover shared-memory segments.
//!
//! The data plane names its POSIX shm segments `weft-<job>-...`; a rank that is
//! SIGKILLed never unlinks its own, and they would pin memory until reboot. Once
//! every rank has ended nobody can still be using them, so the launcher unlinks them.

use std::path::{Path, PathBuf};

/// Where POSIX shared memory lives on Linux.
pub const SHM_DIR: &str = "/dev/shm";

/// Removes every non-directory entry of `dir` named `weft-<job>-*` and returns
/// the paths removed. Errors (missing dir, permissions) are ignored.
pub fn remove_job_segments(dir: &Path, job: &str) -> Vec<PathBuf> {
    let prefix = format!("weft-{job}-");
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut removed = Vec::new();
    for entry in entries.flatten() {
        let matches = entry
            .file_name()
            .to_str()
            .is_some_and(|n| n.starts_with(&prefix));
        let is_dir = entry.file_type().map(|t| t.is_dir()).unwrap_or(true);
        if matches && !is_dir && std::fs::remove_file(entry.path()).is_ok() {
            removed.push(entry.path());
        }
    }
    removed
}
