//! Where the C ABI tests find what cargo built: the crate, our header and the
//! `libnccl.so` cdylib. Shared by the test binaries of this crate.

use std::path::PathBuf;

pub fn crate_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Our `nccl.h`.
pub fn include_dir() -> PathBuf {
    crate_dir().join("../include")
}

/// The cdylib cargo built with this test: `<target>/<profile>/libnccl.so`
/// (the test executable lives in `<target>/<profile>/deps/`).
pub fn built_library() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    let mut candidates = Vec::new();
    for dir in exe.ancestors().skip(1).take(3) {
        candidates.push(dir.join("libnccl.so"));
        candidates.push(dir.join("deps").join("libnccl.so"));
    }
    candidates
        .iter()
        .filter(|p| p.is_file())
        .max_by_key(|p| p.metadata().and_then(|m| m.modified()).ok())
        .cloned()
        .unwrap_or_else(|| panic!("libnccl.so not found; looked at {candidates:?}"))
}
