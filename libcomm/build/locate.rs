//! Where the build finds NVRTC (`libnvrtc.so.13`), in order: `WEFT_NVRTC`
//! (the library, or a folder holding it or PyPI's `nvidia/cu13/lib`), the
//! copy CI installs into `.ci/nvrtc`, LD_LIBRARY_PATH, Python's
//! site-packages (`pip install nvidia-cuda-nvrtc`), then the system's
//! library path.

use std::path::{Path, PathBuf};
use std::process::Command;

const LIB: &str = "libnvrtc.so.13";
/// Where PyPI's wheel puts the library under site-packages (or pip's --target).
const WHEEL_LIB: &str = "nvidia/cu13/lib";

/// What the build compiles kernels with.
pub enum Choice {
    /// This library (a path, or a bare name for the system's library path).
    Library(PathBuf),
    /// `WEFT_NVRTC=off`: compile nothing ahead of time.
    Off,
}

/// The library to use. Errors when `WEFT_NVRTC` names something that is
/// not there (a wrong path should not quietly mean "no kernels").
pub fn nvrtc(setting: Option<&str>, workspace: &Path) -> Result<Choice, String> {
    match setting.map(str::trim) {
        Some("off" | "0") => return Ok(Choice::Off),
        Some(s) if !s.is_empty() => {
            return in_place(Path::new(s))
                .map(Choice::Library)
                .ok_or_else(|| format!("WEFT_NVRTC={s}: no {LIB} there"));
        }
        _ => {}
    }
    let ci = workspace.join(".ci/nvrtc");
    let library_path = std::env::var_os("LD_LIBRARY_PATH").unwrap_or_default();
    let found = std::iter::once(ci)
        .chain(std::env::split_paths(&library_path))
        // Python only when nothing before had it.
        .chain(std::iter::once_with(python_paths).flatten())
        .find_map(|d| in_place(&d));
    Ok(Choice::Library(found.unwrap_or_else(|| PathBuf::from(LIB))))
}

/// `p` if it is the library, else the library in folder `p` or in its
/// wheel layout.
fn in_place(p: &Path) -> Option<PathBuf> {
    if p.is_file() {
        return Some(p.to_path_buf());
    }
    [p.join(LIB), p.join(WHEEL_LIB).join(LIB)]
        .into_iter()
        .find(|c| c.is_file())
}

/// Python's module search path (site-packages among it); empty without
/// python3.
fn python_paths() -> Vec<PathBuf> {
    let out = Command::new("python3")
        .args([
            "-c",
            "import sys; print('\\n'.join(p for p in sys.path if p))",
        ])
        .output();
    match out {
        Ok(o) if o.status.success() => String::from_utf8_lossy(&o.stdout)
            .lines()
            .map(PathBuf::from)
            .collect(),
        _ => Vec::new(),
    }
}
