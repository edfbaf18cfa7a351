use super::*;
use std::path::{Path, PathBuf};

use crate::test_table as table;

#[test]
fn names_are_unique_and_well_formed() {
    let mut seen = HashSet::new();
    for p in PARAMS {
        assert!(seen.insert(p.name), "{} declared twice", p.name);
        assert!(
            p.name
                .chars()
                .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_'),
            "{}",
            p.name
        );
        assert!(!p.help.is_empty(), "{} has no help", p.name);
        assert!(!p.help.contains('|'), "{}: '|' breaks the table", p.name);
        assert!(!p.parts.is_empty(), "{} names no part", p.name);
    }
    for g in Group::LISTED {
        assert!(PARAMS.iter().any(|p| p.group == g), "{g:?} is empty");
    }
    assert_eq!(find("WEFT_ALGO").map(|p| p.name), Some("WEFT_ALGO"));
    assert_eq!(find("WEFT_NOPE"), None);
}

#[test]
fn every_fixed_default_parses_as_its_kind() {
    for p in PARAMS {
        let DefaultValue::Value(v) = p.default else {
            continue;
        };
        let ok = match p.kind {
            Kind::Int | Kind::Ms | Kind::Bytes | Kind::Kib | Kind::Mib => v.parse::<u64>().is_ok(),
            Kind::Bool | Kind::OnUnless0 | Kind::OnIf1 => bool::parse(v, p.kind).is_some(),
            Kind::Choice(words) => words.contains(&v),
            Kind::Str | Kind::Path | Kind::Addr | Kind::List => true,
        };
        assert!(ok, "{}: default {v:?} is not {}", p.name, p.kind.expected());
    }
}

#[test]
fn defaults_are_those_of_the_readers() {
    let none = table(&[]);
    assert_eq!(WEFT_PEER_TIMEOUT_MS.value_from(&none), 10_000);
    assert_eq!(WEFT_TIMEOUT_MS.value_from(&none), 0);
    assert_eq!(WEFT_INIT_TIMEOUT_MS.value_from(&none), 120_000);
    assert_eq!(WEFT_RAS_STUCK_MS.value_from(&none), 10_000);
    assert!(NCCL_COMM_BLOCKING.value_from(&none));
    assert_eq!(WEFT_TRANSPORT.value_from(&none), "auto");
    assert_eq!(WEFT_CUDA_THREADS.value_from(&none), 512);
    assert_eq!(WEFT_CUDA_ONESHOT_MAX.value_from(&none), 256 << 10);
    assert_eq!(WEFT_CUDA_REDUCE_CHUNK.value_from(&none), 256 << 10);
    assert_eq!(WEFT_CUDA_SCRATCH_MB.value_from(&none), 32);
    assert_eq!(WEFT_CUDA_LINES_WINDOW.value_from(&none), 16);
    assert_eq!(WEFT_CUDA_BCAST_RING_MB.value_from(&none), 256);
    assert_eq!(
        WEFT_SIDECAR_IMAGE.value_from(&none),
        "ghcr.io/weft-dev/weft:latest"
    );
    assert_eq!(WEFT_OPERATOR_HTTP_ADDR.value_from(&none), "0.0.0.0:8080");
    assert!(WEFT_LEADER_ELECT.value_from(&none));
    assert!(!WEFT_LOG_JSON.value_from(&none));
    assert_eq!(WEFT_CUDA_ALGO.default_value(), None);
}

#[test]
#[should_panic(expected = "no fixed default")]
fn value_of_a_computed_default_panics() {
    WEFT_SHM_RING_BYTES.value_from(&table(&[]));
}

#[test]
fn parsing_and_errors() {
    let t = table(&[
        ("WEFT_TIMEOUT_MS", " 250 "),
        ("WEFT_PEER_TIMEOUT_MS", "soon"),
        ("WEFT_INIT_TIMEOUT_MS", "   "),
        ("WEFT_TRANSPORT", "SHM"),
        ("WEFT_CUDA_BCAST", "tree"),
        ("WEFT_HOSTNAME", " h1 "),
    ]);
    assert_eq!(WEFT_TIMEOUT_MS.try_get_from(&t), Ok(Some(250)));
    let e = WEFT_PEER_TIMEOUT_MS.try_get_from(&t).unwrap_err();
    assert_eq!(
        e.to_string(),
        "WEFT_PEER_TIMEOUT_MS=soon: expected milliseconds"
    );
    // A bad value warns and counts as unset: the default applies.
    assert_eq!(WEFT_PEER_TIMEOUT_MS.get_from(&t), None);
    assert_eq!(WEFT_PEER_TIMEOUT_MS.value_from(&t), 10_000);
    // Blank is unset.
    assert_eq!(WEFT_INIT_TIMEOUT_MS.try_get_from(&t), Ok(None));
    // Choices come back in their declared spelling.
    assert_eq!(WEFT_TRANSPORT.try_get_from(&t), Ok(Some("shm".into())));
    let e = WEFT_CUDA_BCAST.try_get_from(&t).unwrap_err();
    assert_eq!(
        e.to_string(),
        "WEFT_CUDA_BCAST=tree: expected one of scatter, ring"
    );
    // Text is kept as set.
    assert_eq!(WEFT_HOSTNAME.try_get_from(&t), Ok(Some(" h1 ".into())));
}

#[test]
fn switches() {
    let on = |p: Param<bool>, v: &str| p.try_get_from(&table(&[(p.name(), v)]));
    assert_eq!(on(WEFT_CUDA_LINES, "0"), Ok(Some(false)));
    assert_eq!(on(WEFT_CUDA_LINES, "1"), Ok(Some(true)));
    assert_eq!(on(WEFT_CUDA_LINES, "yes"), Ok(Some(true)));
    assert_eq!(on(WEFT_CUDA_PUSH, "1"), Ok(Some(true)));
    assert_eq!(on(WEFT_CUDA_PUSH, "0"), Ok(Some(false)));
    assert_eq!(on(WEFT_CUDA_PUSH, "true"), Ok(Some(false)));
    assert_eq!(on(WEFT_LEADER_ELECT, "false"), Ok(Some(false)));
    assert_eq!(on(WEFT_LEADER_ELECT, "On"), Ok(Some(true)));
    assert!(on(WEFT_LEADER_ELECT, "maybe").is_err());
}

#[test]
fn unknown_variables_get_the_closest_name() {
    let u = unknown_vars(["WEFT_CUDA_THREAD", "PATH", "WEFT_JOB", "WEFT_PEER_TIMEOUT"]);
    assert_eq!(u.len(), 2);
    assert_eq!(
        u[0].to_string(),
        "weft: unknown variable WEFT_CUDA_THREAD; did you mean WEFT_CUDA_THREADS?"
    );
    assert_eq!(u[1].suggestion, Some("WEFT_PEER_TIMEOUT_MS"));
    assert_eq!(suggest("weft_algo"), Some("WEFT_ALGO"));
    assert_eq!(suggest("WEFT_TRANSPROT"), Some("WEFT_TRANSPORT"));
    // Nothing close: no guess.
    let far = unknown_vars(["WEFT_SOMETHING_ELSE_ENTIRELY"]);
    assert_eq!(far[0].suggestion, None);
    assert!(
        far[0]
            .to_string()
            .starts_with("weft: unknown variable WEFT_SOMETHING_ELSE_ENTIRELY")
    );
    // Every declared name (test-only ones included) is known.
    assert!(unknown_vars(PARAMS.iter().map(|p| p.name)).is_empty());
    assert_eq!(edit_distance("kitten", "sitting"), 3);
    assert_eq!(edit_distance("", "abc"), 3);
    assert_eq!(edit_distance("same", "same"), 0);
    // Only WEFT_*: NCCL has many variables Weft does not read.
    assert!(unknown_vars(["NCCL_IB_HCA", "NCCL_DEBUG_SUBSYS"]).is_empty());
}

#[test]
fn warn_unknown_once_runs() {
    // Prints to stderr; twice is harmless.
    warn_unknown_once();
    warn_unknown_once();
}

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("contract/ is in the workspace root")
        .to_path_buf()
}

#[test]
fn readme_table_is_generated_from_the_registry() {
    let path = repo_root().join("README.md");
    let readme = std::fs::read_to_string(&path).expect("README.md");
    let want = splice_readme(&readme, &readme_table())
        .unwrap_or_else(|| panic!("README.md lacks the {README_BEGIN} / {README_END} markers"));
    if readme == want {
        return;
    }
    if WEFT_BLESS.get().unwrap_or(false) {
        std::fs::write(&path, want).expect("rewriting README.md");
        return;
    }
    panic!(
        "README.md's configuration table differs from the registry \
         (contract/src/params/list.rs). Regenerate it with\n    \
         cargo run -p weft-contract --example readme-params\n\
         (or WEFT_BLESS=1 cargo test -p weft-contract readme)"
    );
}

#[test]
fn splice_replaces_only_between_the_markers() {
    let r = format!("a\n{README_BEGIN}\nold\n{README_END}\nb\n");
    assert_eq!(
        splice_readme(&r, "new\n").unwrap(),
        format!("a\n{README_BEGIN}\nnew\n{README_END}\nb\n")
    );
    assert_eq!(splice_readme("no markers", "x"), None);
    let t = readme_table();
    assert!(t.contains("| `WEFT_CUDA_THREADS` |"));
    assert!(
        !t.contains("WEFT_TEST_SEED"),
        "test-only variables stay out of the README"
    );
}

/// String literals `"WEFT_..."` / `"NCCL_..."` in a Rust source.
fn literals(src: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    for (ln, line) in src.lines().enumerate() {
        let b = line.as_bytes();
        let mut i = 0;
        while let Some(q) = line[i..].find('"') {
            let start = i + q + 1;
            let rest = &line[start..];
            if rest.starts_with("WEFT_") || rest.starts_with("NCCL_") {
                let len = rest
                    .bytes()
                    .take_while(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || *c == b'_')
                    .count();
                if b.get(start + len) == Some(&b'"') && len > 5 {
                    out.push((ln + 1, rest[..len].to_string()));
                }
            }
            i = start;
        }
    }
    out
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    for e in rd.flatten() {
        let p = e.path();
        let name = e.file_name();
        if p.is_dir() {
            if name != "target" && name != ".git" {
                rust_files(&p, out);
            }
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

#[test]
fn every_variable_named_in_the_source_is_declared() {
    let root = repo_root();
    let mut files = Vec::new();
    for d in [
        "libcomm",
        "sidecar",
        "operator",
        "tests",
        "contract/examples",
    ] {
        rust_files(&root.join(d), &mut files);
    }
    assert!(files.len() > 50, "found only {} .rs files", files.len());
    let mut missing = Vec::new();
    let mut found = 0;
    for f in &files {
        let src = std::fs::read_to_string(f).unwrap();
        for (line, name) in literals(&src) {
            found += 1;
            if find(&name).is_none() {
                missing.push(format!(
                    "{}:{line}: {name}",
                    f.strip_prefix(&root).unwrap().display()
                ));
            }
        }
    }
    assert!(found > 50, "the scan found only {found} names");
    assert!(
        missing.is_empty(),
        "variables read or set in the source but not declared in contract/src/params/list.rs:\n{}",
        missing.join("\n")
    );
}

#[test]
fn the_literal_scan_finds_what_it_should() {
    let src = "let a = std::env::var(\"WEFT_X_1\");\n\"NCCL_Y\" \"WEFT_lower\" \"no WEFT_Z here\" \"NCCL_\"";
    let got: Vec<String> = literals(src).into_iter().map(|(_, n)| n).collect();
    assert_eq!(got, ["WEFT_X_1", "NCCL_Y"]);
}

#[test]
fn byte_counts_take_the_suffixes_weft_bench_takes() {
    use super::{FromParam, Kind, parse_bytes};
    assert_eq!(parse_bytes("4194304"), Some(4 << 20));
    assert_eq!(parse_bytes("4M"), Some(4 << 20));
    assert_eq!(parse_bytes("64MiB"), Some(64 << 20));
    assert_eq!(parse_bytes("1g"), Some(1 << 30));
    assert_eq!(parse_bytes("512kb"), Some(512 << 10));
    assert_eq!(parse_bytes("0"), Some(0));
    for bad in [
        "",
        "M",
        "4.5M",
        "-1",
        "4X",
        "4 M",
        "99999999999999999999",
        "20000000T",
    ] {
        assert_eq!(parse_bytes(bad), None, "{bad:?}");
    }
    // Through the registry's parser: bytes take suffixes, other numbers not.
    assert_eq!(usize::parse("4M", Kind::Bytes), Some(4 << 20));
    assert_eq!(usize::parse("4M", Kind::Int), None);
    assert_eq!(u32::parse("8G", Kind::Bytes), None, "overflows a u32");
}
