//! The layering the redesign set up, checked on the source so that it stays:
//! the CUDA backend (`src/cuda/`) reaches the rest of libcomm only through the
//! seam (`op`: the descriptor, the backend seam, the tuner's `Decision`;
//! `data`, `error`, `log`),
//! and none of those modules reaches back into `cuda/` — so there is no
//! import cycle between the core and `cuda/`. A new `use crate::comm` (or
//! `group`, `core`, ...) inside `cuda/`, or a `cuda::` inside the seam, fails
//! here with the file and the name.

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};

/// What `cuda/` may import from the rest of the crate: the seam.
const SEAM: &[&str] = &["op", "data", "error", "log"];

fn rs_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            rs_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The top-level crate modules a source file names through `crate::`,
/// including grouped imports (`use crate::{a::X, b}`). Comments are skipped.
fn crate_modules(src: &str) -> BTreeSet<String> {
    let mut mods = BTreeSet::new();
    for line in src.lines() {
        let code = line.split("//").next().unwrap_or("");
        let mut rest = code;
        while let Some(i) = rest.find("crate::") {
            rest = &rest[i + "crate::".len()..];
            if let Some(group) = rest.strip_prefix('{') {
                let end = group.find('}').unwrap_or(group.len());
                for item in group[..end].split(',') {
                    let name: String = item
                        .trim()
                        .chars()
                        .take_while(|c| c.is_alphanumeric() || *c == '_')
                        .collect();
                    if !name.is_empty() {
                        mods.insert(name);
                    }
                }
            } else {
                let name: String = rest
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect();
                if !name.is_empty() {
                    mods.insert(name);
                }
            }
        }
    }
    mods
}

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

#[test]
fn cuda_reaches_the_core_only_through_the_seam() {
    let mut files = Vec::new();
    rs_files(&src().join("cuda"), &mut files);
    assert!(files.len() > 5, "cuda/ files not found under {:?}", src());
    let mut bad = Vec::new();
    for f in &files {
        let text = fs::read_to_string(f).unwrap();
        for m in crate_modules(&text) {
            if m != "cuda" && !SEAM.contains(&m.as_str()) {
                bad.push(format!("{}: crate::{m}", f.display()));
            }
        }
    }
    assert!(
        bad.is_empty(),
        "cuda/ must reach the rest of libcomm only through {SEAM:?}; found:\n{}",
        bad.join("\n")
    );
}

#[test]
fn the_seam_never_reaches_back_into_cuda() {
    let mut files = Vec::new();
    for m in SEAM {
        let dir = src().join(m);
        if dir.is_dir() {
            rs_files(&dir, &mut files);
        } else {
            files.push(src().join(format!("{m}.rs")));
        }
    }
    let mut bad = Vec::new();
    for f in &files {
        let text = fs::read_to_string(f).unwrap();
        if crate_modules(&text).contains("cuda") {
            bad.push(f.display().to_string());
        }
    }
    assert!(
        bad.is_empty(),
        "these seam modules import cuda/ (an import cycle with the core):\n{}",
        bad.join("\n")
    );
}

#[test]
fn the_scanner_sees_grouped_and_plain_imports() {
    let m =
        crate_modules("use crate::{op::Op, comm::X};\nlet a = crate::core::f(); // crate::group");
    assert_eq!(
        m.into_iter().collect::<Vec<_>>(),
        ["comm", "core", "op"].map(String::from)
    );
}
