//! Puts Weft's `libnccl.so.2` in front of the ranks' dynamic loader.
//!
//! `weft run -n N -- python train.py` should run an unmodified NCCL program
//! on Weft. Programs linked against `libnccl.so.2` through `LD_LIBRARY_PATH`
//! would find ours anyway, but PyTorch's pip wheels load the NCCL of the
//! `nvidia-nccl` wheel through an `RPATH`, which the loader searches before
//! `LD_LIBRARY_PATH`: only `LD_PRELOAD` makes torch's calls bind to Weft. So
//! `weft run` preloads the library into the ranks (not into itself).
//!
//! `WEFT_PRELOAD`: `auto` (default) preloads the `libnccl.so.2` installed with
//! this `weft` (next to the binary, in `../lib` or `../lib/weft`) when there
//! is one, and nothing otherwise; `off` never preloads; any other value is the
//! path of the library to preload (an error when it does not exist). An
//! `LD_PRELOAD` the user already set is kept, after ours.

use std::path::{Path, PathBuf};

/// The file name the loader and NCCL programs use.
pub const LIBRARY: &str = "libnccl.so.2";

/// What `WEFT_PRELOAD` asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Mode {
    Auto,
    Off,
    Path(PathBuf),
}

impl Mode {
    pub fn parse(value: Option<&str>) -> Mode {
        match value.map(str::trim) {
            None | Some("") | Some("auto") => Mode::Auto,
            Some("off") | Some("0") | Some("false") | Some("no") => Mode::Off,
            Some(p) => Mode::Path(PathBuf::from(p)),
        }
    }

    pub fn from_env() -> Mode {
        Mode::parse(weft_contract::params::WEFT_PRELOAD.get().as_deref())
    }
}

/// Where a `weft` binary at `exe` finds the library installed with it.
pub fn candidates(exe: &Path) -> Vec<PathBuf> {
    let Some(dir) = exe.parent() else {
        return Vec::new();
    };
    vec![
        dir.join(LIBRARY),
        dir.join("../lib").join(LIBRARY),
        dir.join("../lib/weft").join(LIBRARY),
    ]
}

/// The library to preload, or `None`; an error names a missing explicit path.
pub fn choose(mode: &Mode, exe: Option<&Path>) -> Result<Option<PathBuf>, String> {
    match mode {
        Mode::Off => Ok(None),
        Mode::Path(p) => {
            if p.is_file() {
                Ok(Some(std::fs::canonicalize(p).unwrap_or_else(|_| p.clone())))
            } else {
                Err(format!(
                    "WEFT_PRELOAD={}: no such file (set WEFT_PRELOAD=off to preload nothing)",
                    p.display()
                ))
            }
        }
        Mode::Auto => Ok(exe
            .map(candidates)
            .unwrap_or_default()
            .into_iter()
            .find(|p| p.is_file())
            .map(|p| std::fs::canonicalize(&p).unwrap_or(p))),
    }
}

/// The ranks' `LD_PRELOAD`: `lib` first, then what was already there (without
/// a second copy of `lib`).
pub fn ld_preload(lib: &Path, existing: Option<&str>) -> String {
    let lib = lib.display().to_string();
    let mut out = vec![lib.clone()];
    for entry in existing
        .unwrap_or("")
        .split([' ', ':'])
        .filter(|e| !e.is_empty())
    {
        if entry != lib {
            out.push(entry.to_string());
        }
    }
    out.join(":")
}

/// The variable to add to every rank's environment, if any.
pub fn rank_var() -> Result<Option<(String, String)>, String> {
    let exe = std::env::current_exe().ok();
    let Some(lib) = choose(&Mode::from_env(), exe.as_deref())? else {
        return Ok(None);
    };
    let existing = std::env::var("LD_PRELOAD").ok();
    Ok(Some((
        "LD_PRELOAD".to_string(),
        ld_preload(&lib, existing.as_deref()),
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes() {
        assert_eq!(Mode::parse(None), Mode::Auto);
        assert_eq!(Mode::parse(Some("auto")), Mode::Auto);
        assert_eq!(Mode::parse(Some("off")), Mode::Off);
        assert_eq!(
            Mode::parse(Some("/x/libnccl.so.2")),
            Mode::Path("/x/libnccl.so.2".into())
        );
    }

    #[test]
    fn auto_finds_the_library_installed_with_weft() {
        let d = std::env::temp_dir().join(format!("weft-preload-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        let bin = d.join("bin");
        let lib = d.join("lib/weft");
        std::fs::create_dir_all(&bin).unwrap();
        std::fs::create_dir_all(&lib).unwrap();
        let exe = bin.join("weft");
        assert_eq!(choose(&Mode::Auto, Some(&exe)).unwrap(), None);
        std::fs::write(lib.join(LIBRARY), b"").unwrap();
        let found = choose(&Mode::Auto, Some(&exe)).unwrap().unwrap();
        assert_eq!(found, std::fs::canonicalize(lib.join(LIBRARY)).unwrap());
        // Next to the binary wins.
        std::fs::write(bin.join(LIBRARY), b"").unwrap();
        let found = choose(&Mode::Auto, Some(&exe)).unwrap().unwrap();
        assert_eq!(found, std::fs::canonicalize(bin.join(LIBRARY)).unwrap());
        assert_eq!(choose(&Mode::Off, Some(&exe)).unwrap(), None);
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn an_explicit_path_must_exist() {
        let e = choose(&Mode::Path("/nonexistent/libnccl.so.2".into()), None).unwrap_err();
        assert!(e.contains("/nonexistent/libnccl.so.2") && e.contains("WEFT_PRELOAD=off"));
    }

    #[test]
    fn ours_goes_first_and_once() {
        let lib = Path::new("/opt/weft/libnccl.so.2");
        assert_eq!(ld_preload(lib, None), "/opt/weft/libnccl.so.2");
        assert_eq!(
            ld_preload(lib, Some("/a.so /opt/weft/libnccl.so.2:/b.so")),
            "/opt/weft/libnccl.so.2:/a.so:/b.so"
        );
    }
}
