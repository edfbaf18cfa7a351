//! The shape of libcomm's source, checked on every test run so that the
//! next feature cannot re-knot it (`cargo test -p weft-libcomm --test
//! layering`):
//!
//! - **No import cycle** between the files of `libcomm/src` (nor of
//!   `sidecar/src`): the graph `graph.rs` builds from every `crate::`,
//!   `super::`, `self::` path is acyclic; a failure names the circle, file,
//!   line and path of each step.
//! - **Layers point down**: [`LAYERS`] lists libcomm's layers top to
//!   bottom (docs/ARCHITECTURE.md, "Layers", draws the same list); a file
//!   imports its own layer or the ones below, never one above, and every
//!   file belongs to a layer.
//! - **The CUDA seam**: `cuda/` reaches the rest of libcomm only through
//!   [`SEAM`], and none of the seam reaches back into `cuda/`.
//! - **Files stay readable**: none over [`MAX_LINES`] lines, except the
//!   test-only models named in [`LONG_TEST_MODELS`].
//!
//! The checker itself is tested on small synthetic crates at the end.

mod graph;
mod scan;

use graph::Graph;
use std::fs;
use std::path::{Path, PathBuf};

/// libcomm's layers, top to bottom. Each names module paths (a folder, or
/// a file at the crate root; `""` is `lib.rs`); a file belongs to the layer
/// of the longest path that contains it.
const LAYERS: &[(&str, &[&str])] = &[
    ("the public API", &["", "fuzz"]),
    ("resilience", &["resilience"]),
    ("the communicator", &["comm"]),
    ("across hosts", &["crosshost"]),
    ("observation", &["observe"]),
    ("host algorithms, the CUDA backend", &["algo", "cuda"]),
    ("the progress engine and its resources", &["progress"]),
    ("transports, the byte mover", &["transport", "net"]),
    ("bootstrap", &["bootstrap"]),
    ("descriptions", &["op", "config"]),
    ("foundation", &["error", "state", "log", "data", "sys"]),
];

/// What `cuda/` may import from the rest of the crate: the operation
/// descriptor, the backend seam and the tuner's names, the data types, errors
/// and logging, how a thread waits microseconds (a leaf on `std` alone), and
/// which CPUs a thread runs on (a leaf on `libc`: its guard tells its
/// caller, who logs, when a thread's old mask does not come back).
const SEAM: &[&str] = &[
    "op",
    "op::backend",
    "op::tuner",
    "data::types",
    "data::reduce",
    "error",
    "log",
    "sys::backoff",
    "sys::affinity",
];

const MAX_LINES: usize = 1000;

/// Test-only models allowed to be longer (declared `#[cfg(test)]`, which
/// the limit test checks).
const LONG_TEST_MODELS: &[&str] = &["cuda/abort_model.rs"];

fn manifest() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn libcomm() -> Graph {
    let g = Graph::of_dir(&manifest().join("src"));
    assert!(g.files.len() > 40, "libcomm's sources not found");
    g
}

/// Every import cycle of `g`, one line each (empty when there is none).
fn cycle_report(g: &Graph) -> Vec<String> {
    g.cycles()
        .iter()
        .map(|c| {
            format!(
                "{} files ({}): {}",
                c.len(),
                c.join(", "),
                g.describe_cycle(c)
            )
        })
        .collect()
}

/// The layer index of each file (0 is the top), or the files in no layer.
fn layer_of(g: &Graph, layers: &[(&str, &[&str])]) -> Result<Vec<usize>, Vec<String>> {
    let mut out = Vec::new();
    let mut lost = Vec::new();
    for (f, m) in g.files.iter().zip(&g.modules) {
        let best = layers
            .iter()
            .enumerate()
            .flat_map(|(i, (_, mods))| mods.iter().map(move |p| (i, *p)))
            .filter_map(|(i, p)| {
                let path: Vec<&str> = p.split("::").filter(|s| !s.is_empty()).collect();
                let inside = m.len() >= path.len() && m.iter().zip(&path).all(|(a, b)| a == b);
                // The root (`""`) holds only the files at the root.
                let root_only = path.is_empty() && !m.is_empty();
                (inside && !root_only).then_some((path.len(), i))
            })
            .max();
        match best {
            Some((_, i)) => out.push(i),
            None => lost.push(f.clone()),
        }
    }
    if lost.is_empty() { Ok(out) } else { Err(lost) }
}

/// Every import from a lower layer into a higher one, as "file:line `path`:
/// layer imports layer above it".
fn upward_imports(g: &Graph, layers: &[(&str, &[&str])]) -> Vec<String> {
    let at = match layer_of(g, layers) {
        Ok(at) => at,
        Err(lost) => return lost.iter().map(|f| format!("{f}: in no layer")).collect(),
    };
    g.edges
        .iter()
        .filter(|e| at[e.to] < at[e.from])
        .map(|e| {
            format!(
                "{}:{} `{}` ({}) imports {} ({}), a layer above it",
                g.files[e.from],
                e.line,
                e.written,
                layers[at[e.from]].0,
                g.files[e.to],
                layers[at[e.to]].0
            )
        })
        .collect()
}

/// Files of `dir` over `max` lines, but for `exempt`.
fn long_files(dir: &Path, max: usize, exempt: &[&str]) -> Vec<String> {
    let mut files = Vec::new();
    graph::rs_files(dir, &mut files);
    files
        .iter()
        .filter_map(|p| {
            let f = p.strip_prefix(dir).unwrap().to_string_lossy().into_owned();
            let n = fs::read_to_string(p).unwrap().lines().count();
            (n > max && !exempt.contains(&f.as_str())).then(|| format!("{f}: {n} lines"))
        })
        .collect()
}

#[test]
fn libcomm_has_no_import_cycle() {
    let cycles = cycle_report(&libcomm());
    assert!(
        cycles.is_empty(),
        "import cycles in libcomm/src:\n{}",
        cycles.join("\n")
    );
}

/// The sidecar crate (`weft`) is held to the same rule.
#[test]
fn sidecar_has_no_import_cycle() {
    // The sidecar binary's sources and the agent crate that ranks link.
    for (dir, least) in [("../sidecar/src", 20), ("../sidecar/agent/src", 10)] {
        let dir = manifest().join(dir);
        let g = Graph::of_dir(&dir);
        assert!(g.files.len() > least, "sources not found at {dir:?}");
        let cycles = cycle_report(&g);
        assert!(
            cycles.is_empty(),
            "import cycles in {}:\n{}",
            dir.display(),
            cycles.join("\n")
        );
    }
}

#[test]
fn libcomm_layers_point_down() {
    let up = upward_imports(&libcomm(), LAYERS);
    assert!(
        up.is_empty(),
        "libcomm's layers, top to bottom, are {:?}; these imports point up (or a file is in no layer):\n{}",
        LAYERS.iter().map(|l| l.0).collect::<Vec<_>>(),
        up.join("\n")
    );
}

#[test]
fn cuda_reaches_the_core_only_through_the_seam() {
    let g = libcomm();
    let in_cuda = |i: usize| g.modules[i].first().is_some_and(|m| m == "cuda");
    let seam: Vec<usize> = SEAM
        .iter()
        .map(|m| {
            g.file_of(m)
                .unwrap_or_else(|| panic!("seam module {m} not found"))
        })
        .collect();
    let mut bad = Vec::new();
    for e in &g.edges {
        if in_cuda(e.from) && !in_cuda(e.to) && !seam.contains(&e.to) {
            bad.push(format!("{}:{} `{}`", g.files[e.from], e.line, e.written));
        }
        if seam.contains(&e.from) && in_cuda(e.to) {
            bad.push(format!(
                "{}:{} `{}` (the seam reaches back into cuda/)",
                g.files[e.from], e.line, e.written
            ));
        }
    }
    assert!(
        bad.is_empty(),
        "cuda/ must reach the rest of libcomm only through {SEAM:?}, which must not import cuda/; found:\n{}",
        bad.join("\n")
    );
}

#[test]
fn no_file_is_over_the_line_limit() {
    let mut long = long_files(&manifest().join("src"), MAX_LINES, LONG_TEST_MODELS);
    long.extend(
        long_files(&manifest().join("../sidecar/src"), MAX_LINES, &[])
            .into_iter()
            .map(|f| format!("sidecar/src/{f}")),
    );
    assert!(
        long.is_empty(),
        "files over {MAX_LINES} lines (split them along a seam):\n{}",
        long.join("\n")
    );
    // The exemption holds only while each model is compiled for tests alone.
    for m in LONG_TEST_MODELS {
        let (dir, file) = m.rsplit_once('/').unwrap();
        let name = file.trim_end_matches(".rs");
        let parent = fs::read_to_string(manifest().join("src").join(dir).join("mod.rs")).unwrap();
        assert!(
            parent.contains(&format!("#[cfg(test)]\nmod {name};")),
            "{m} is exempt from the line limit as a test-only model, but {dir}/mod.rs does not declare it #[cfg(test)]"
        );
    }
}

// ---- The checker on small synthetic crates.

fn crate_of(files: &[(&str, &str)]) -> Graph {
    let sources: Vec<(String, String)> = files
        .iter()
        .map(|(p, s)| (p.to_string(), s.to_string()))
        .collect();
    Graph::of_sources(&sources)
}

/// `(from, to)` file pairs of `g`'s edges.
fn pairs(g: &Graph) -> Vec<(String, String)> {
    let mut v: Vec<(String, String)> = g
        .edges
        .iter()
        .map(|e| (g.files[e.from].clone(), g.files[e.to].clone()))
        .collect();
    v.sort();
    v.dedup();
    v
}

fn pair(a: &str, b: &str) -> (String, String) {
    (a.to_string(), b.to_string())
}

#[test]
fn a_cycle_is_found_and_named() {
    let g = crate_of(&[
        ("lib.rs", "mod a;\nmod b;\nmod c;\n"),
        ("a.rs", "use crate::b::Thing;\n"),
        ("b.rs", "pub struct Thing;\nfn f() { crate::c::g() }\n"),
        ("c.rs", "use crate::a;\npub fn g() {}\n"),
    ]);
    assert_eq!(g.cycles(), vec![vec!["a.rs", "b.rs", "c.rs"]]);
    assert_eq!(
        cycle_report(&g),
        [
            "3 files (a.rs, b.rs, c.rs): a.rs:1 `crate::b::Thing` -> b.rs:2 `crate::c::g` -> c.rs:1 `crate::a` -> a.rs"
        ]
    );
}

#[test]
fn a_dag_is_accepted() {
    let g = crate_of(&[
        ("lib.rs", "mod a;\nmod b;\nmod c;\npub use a::A;\n"),
        (
            "a.rs",
            "use crate::b::B;\nuse crate::c::C;\npub struct A;\n",
        ),
        ("b.rs", "use crate::c::C;\npub struct B;\n"),
        ("c.rs", "pub struct C;\n"),
    ]);
    assert!(g.cycles().is_empty());
    assert_eq!(
        pairs(&g),
        [
            pair("a.rs", "b.rs"),
            pair("a.rs", "c.rs"),
            pair("b.rs", "c.rs"),
            pair("lib.rs", "a.rs")
        ]
    );
}

#[test]
fn grouped_and_nested_imports_are_parsed() {
    let g = crate_of(&[
        ("lib.rs", "mod a;\nmod b;\nmod d;\nmod e;\n"),
        (
            "a.rs",
            "use crate::{\n    b::{self, c::Y},\n    d::{D, E as F},\n};\n\
             // use crate::e::X;\nconst S: &str = \"crate::e::X\";\nconst C: char = '{';\n",
        ),
        ("b/mod.rs", "pub mod c;\n"),
        ("b/c.rs", "pub struct Y;\n"),
        ("d.rs", "pub struct D;\npub struct E;\n"),
        ("e.rs", "pub struct X;\n"),
    ]);
    // Comments, strings and characters are no imports (e.rs is not named).
    assert_eq!(
        pairs(&g),
        [
            pair("a.rs", "b/c.rs"),
            pair("a.rs", "b/mod.rs"),
            pair("a.rs", "d.rs")
        ]
    );
}

#[test]
fn relative_paths_resolve_from_where_they_are_written() {
    let g = crate_of(&[
        ("lib.rs", "mod x;\n"),
        (
            "x/mod.rs",
            "mod y;\nmod z;\npub struct P;\nfn f() { y::g(); }\n",
        ),
        (
            "x/y.rs",
            "use super::P;\npub fn g() {}\n#[cfg(test)]\nmod tests {\n    use super::*;\n    use super::super::z::Z;\n}\n",
        ),
        (
            "x/z.rs",
            "pub struct Z;\nuse self::inner::Q;\nmod inner { pub struct Q; }\n",
        ),
    ]);
    // A module using its submodule is an edge; a submodule using its
    // parent's own items is inside the parent's scope, not an edge; `super`
    // in an inline `mod tests` is the file's module.
    assert_eq!(
        pairs(&g),
        [pair("x/mod.rs", "x/y.rs"), pair("x/y.rs", "x/z.rs")]
    );
}

#[test]
fn reexports_are_followed() {
    let g = crate_of(&[
        (
            "lib.rs",
            "mod a;\nmod b;\nmod f;\npub use a::Thing;\npub use other_crate::Ext;\n",
        ),
        ("a.rs", "pub struct Thing;\n"),
        // Through the root, and through a facade that re-exports a sibling.
        (
            "b.rs",
            "use crate::Thing;\nuse crate::Ext;\nuse crate::f::Moved;\n",
        ),
        ("f/mod.rs", "mod g;\npub(crate) use g::Moved;\n"),
        ("f/g.rs", "pub struct Moved;\n"),
    ]);
    assert_eq!(
        pairs(&g),
        [
            pair("b.rs", "a.rs"),
            pair("b.rs", "f/g.rs"),
            pair("f/mod.rs", "f/g.rs"),
            pair("lib.rs", "a.rs")
        ]
    );
}

#[test]
fn an_upward_import_names_file_line_and_layers() {
    let g = crate_of(&[
        ("lib.rs", "mod high;\nmod low;\n"),
        ("high.rs", "use crate::low::L;\npub struct H;\n"),
        ("low.rs", "pub struct L;\n\nfn f(_: crate::high::H) {}\n"),
    ]);
    let layers: &[(&str, &[&str])] = &[("api", &[""]), ("top", &["high"]), ("bottom", &["low"])];
    assert_eq!(
        upward_imports(&g, layers),
        ["low.rs:3 `crate::high::H` (bottom) imports high.rs (top), a layer above it"]
    );
    let partial: &[(&str, &[&str])] = &[("api", &[""]), ("top", &["high"])];
    assert_eq!(upward_imports(&g, partial), ["low.rs: in no layer"]);
}
