//! Coverage against a real NCCL: the `libnccl.so.2` and `nccl.h` of NVIDIA's
//! PyPI wheel `nvidia-nccl-cu13` (no GPU needed to read them).
//!
//! 1. Every `nccl*`/`pnccl*` symbol the real library exports is exported by
//!    ours (`nm -D --defined-only` on both).
//! 2. Every function the real `nccl.h` declares is declared by ours, and a C
//!    file that includes OUR header and re-declares each of them with the real
//!    header's exact prototype compiles (`cc -c`): a different prototype is a
//!    conflicting redeclaration, a compile error.
//!
//! The wheel (about 300 MB) is downloaded once with `python3 -m pip download`
//! and only the two files are kept, under `target/tmp/nccl-wheel-<version>/`.
//! `WEFT_REAL_NCCL_DIR=<dir>` uses `<dir>/lib/libnccl.so.2` and
//! `<dir>/include/nccl.h` instead (an unpacked wheel's `nvidia/nccl/`). Without
//! network the test prints a skip, except with `CI=true`, where it fails.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The wheel pinned for the check (NCCL 2.32.3, a superset of the 2.28/2.29 API).
const WHEEL: &str = "nvidia-nccl-cu13";
const VERSION: &str = "2.32.3";

mod common;
use common::{built_library, include_dir};

/// The real NCCL's files, or None (skip) when they cannot be had here.
struct Real {
    lib: PathBuf,
    header: PathBuf,
}

fn real_nccl() -> Option<Real> {
    if let Some(dir) = std::env::var_os("WEFT_REAL_NCCL_DIR") {
        let dir = PathBuf::from(dir);
        let r = Real {
            lib: dir.join("lib/libnccl.so.2"),
            header: dir.join("include/nccl.h"),
        };
        assert!(
            r.lib.is_file() && r.header.is_file(),
            "WEFT_REAL_NCCL_DIR={}: expected lib/libnccl.so.2 and include/nccl.h there",
            dir.display()
        );
        return Some(r);
    }
    let cache = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("nccl-wheel-{VERSION}"));
    let r = Real {
        lib: cache.join("libnccl.so.2"),
        header: cache.join("nccl.h"),
    };
    if r.lib.is_file() && r.header.is_file() {
        return Some(r);
    }
    // Test processes run in parallel: one downloads, the others wait for it.
    std::fs::create_dir_all(&cache).unwrap();
    let lock = std::fs::File::create(cache.join(".lock")).unwrap();
    use std::os::fd::AsRawFd;
    assert_eq!(
        unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) },
        0,
        "flock"
    );
    if r.lib.is_file() && r.header.is_file() {
        return Some(r);
    }
    match download(&cache) {
        Ok(()) => Some(r),
        Err(why) => {
            let ci = std::env::var("CI").is_ok_and(|v| v == "true" || v == "1");
            assert!(
                !ci,
                "CI=true: cannot obtain {WHEEL}=={VERSION} for the symbol check: {why}"
            );
            eprintln!(
                "SKIP: cannot obtain {WHEEL}=={VERSION} (no network?): {why}\n\
                 (set WEFT_REAL_NCCL_DIR to an unpacked wheel's nvidia/nccl directory to run it offline)"
            );
            None
        }
    }
}

/// Downloads the wheel into `cache/dl`, extracts `libnccl.so.2` and `nccl.h`
/// into `cache`, and deletes the wheel (the caller holds `cache/.lock`).
fn download(cache: &Path) -> Result<(), String> {
    let dl = cache.join("dl");
    let _ = std::fs::remove_dir_all(&dl);
    std::fs::create_dir_all(&dl).map_err(|e| format!("mkdir {}: {e}", dl.display()))?;
    let o = Command::new("python3")
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--quiet",
        ])
        .arg(format!("{WHEEL}=={VERSION}"))
        .arg("-d")
        .arg(&dl)
        .output()
        .map_err(|e| format!("cannot run python3 -m pip: {e}"))?;
    if !o.status.success() {
        return Err(format!(
            "pip download failed: {}",
            String::from_utf8_lossy(&o.stderr).trim()
        ));
    }
    // Extract to temporary names, then rename: a cache hit is always complete.
    let script = r#"
import glob, os, sys, zipfile
dl, out = sys.argv[1], sys.argv[2]
wheels = glob.glob(os.path.join(dl, "*.whl"))
if len(wheels) != 1:
    sys.exit("expected one wheel in %s, found %r" % (dl, wheels))
with zipfile.ZipFile(wheels[0]) as z:
    for member, name in (("nvidia/nccl/lib/libnccl.so.2", "libnccl.so.2"),
                         ("nvidia/nccl/include/nccl.h", "nccl.h")):
        tmp = os.path.join(out, name + ".part")
        with z.open(member) as src, open(tmp, "wb") as dst:
            dst.write(src.read())
        os.replace(tmp, os.path.join(out, name))
os.remove(wheels[0])
"#;
    let o = Command::new("python3")
        .arg("-c")
        .arg(script)
        .arg(&dl)
        .arg(cache)
        .output()
        .map_err(|e| format!("cannot run python3: {e}"))?;
    if !o.status.success() {
        return Err(format!(
            "extracting the wheel failed: {}",
            String::from_utf8_lossy(&o.stderr).trim()
        ));
    }
    let _ = std::fs::remove_dir_all(&dl);
    Ok(())
}

/// The defined dynamic symbols named `nccl*` or `pnccl*`.
fn nccl_symbols(lib: &Path) -> BTreeSet<String> {
    let o = Command::new("nm")
        .args(["-D", "--defined-only"])
        .arg(lib)
        .output()
        .unwrap_or_else(|e| panic!("cannot run nm (binutils): {e}"));
    assert!(
        o.status.success(),
        "nm -D {}: {}",
        lib.display(),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().last())
        .map(|s| s.split('@').next().unwrap_or(s))
        .filter(|s| s.starts_with("nccl") || s.starts_with("pnccl"))
        .map(str::to_string)
        .collect()
}

#[test]
fn every_real_nccl_symbol_is_exported() {
    let Some(real) = real_nccl() else { return };
    let theirs = nccl_symbols(&real.lib);
    let ours = nccl_symbols(&built_library());
    assert!(
        theirs.len() > 150,
        "only {} nccl symbols read from {}",
        theirs.len(),
        real.lib.display()
    );
    let missing: Vec<&String> = theirs.difference(&ours).collect();
    assert!(
        missing.is_empty(),
        "{} of the {} nccl*/pnccl* symbols of NCCL {VERSION} are missing from {}:\n  {}",
        missing.len(),
        theirs.len(),
        built_library().display(),
        missing
            .iter()
            .map(|s| s.as_str())
            .collect::<Vec<_>>()
            .join("\n  ")
    );
    eprintln!(
        "all {} nccl*/pnccl* symbols of NCCL {VERSION} are exported",
        theirs.len()
    );
}

/// A function prototype: its name and the declaration text (`ret name(args);`).
#[derive(Debug, Clone)]
struct Proto {
    name: String,
    text: String,
}

/// The `nccl*`/`pnccl*` function declarations of C source text (comments,
/// preprocessor lines and attributes dropped). Return types NCCL uses:
/// `ncclResult_t`, `const char*`, `void`, `int`; another one fails the test so
/// that a new kind of declaration is not silently skipped.
fn prototypes(src: &str) -> Vec<Proto> {
    let mut s = String::new();
    // Comments out.
    let mut rest = src;
    while !rest.is_empty() {
        if let Some(r) = rest.strip_prefix("/*") {
            rest = r.find("*/").map_or("", |i| &r[i + 2..]);
            s.push(' ');
        } else if let Some(r) = rest.strip_prefix("//") {
            rest = r.find('\n').map_or("", |i| &r[i..]);
        } else if rest.starts_with('"') {
            // String literals (attributes) kept whole, so `//` inside is no comment.
            let end = rest[1..].find('"').map_or(rest.len(), |i| i + 2);
            s.push_str(&rest[..end]);
            rest = &rest[end..];
        } else {
            let c = rest.chars().next().unwrap();
            s.push(c);
            rest = &rest[c.len_utf8()..];
        }
    }
    // Preprocessor lines (with their continuations) out.
    let joined = s.replace("\\\n", " ");
    let code: String = joined
        .lines()
        .filter(|l| !l.trim_start().starts_with('#'))
        .collect::<Vec<_>>()
        .join("\n");
    let mut out = Vec::new();
    for stmt in code.split(';') {
        let stmt = stmt.split_whitespace().collect::<Vec<_>>().join(" ");
        let Some(body) = stmt.strip_suffix(')') else {
            continue;
        };
        let Some(open) = body.rfind('(') else {
            continue;
        };
        let args = body[open + 1..].trim();
        let head = body[..open].trim_end();
        let name_start = head
            .rfind(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .map_or(0, |i| i + 1);
        let name = &head[name_start..];
        if !(name.starts_with("nccl") || name.starts_with("pnccl")) {
            continue;
        }
        let before = head[..name_start].replace(' ', "");
        let ret = [
            ("ncclResult_t", "ncclResult_t"),
            ("constchar*", "const char*"),
            ("void", "void"),
            ("int", "int"),
        ]
        .iter()
        .find(|(k, _)| before.ends_with(k))
        .map(|(_, v)| *v)
        .unwrap_or_else(|| panic!("unhandled return type in the declaration `{stmt}`"));
        out.push(Proto {
            name: name.to_string(),
            text: format!("{ret} {name}({args});"),
        });
    }
    out
}

/// Our header's declarations, after the preprocessor (it declares through a
/// macro).
fn our_prototypes() -> Vec<Proto> {
    let o = Command::new("cc")
        .args(["-E", "-P", "-x", "c"])
        .arg(include_dir().join("nccl.h"))
        .output()
        .unwrap_or_else(|e| panic!("cannot run cc: {e}"));
    assert!(
        o.status.success(),
        "cc -E nccl.h: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    prototypes(&String::from_utf8_lossy(&o.stdout))
}

/// Compiles `body` after `#include "nccl.h"` (ours) with `cc -c`; the
/// compiler's messages on failure.
fn compile_against_ours(dir: &Path, tag: &str, body: &str) -> Result<(), String> {
    let c = dir.join(format!("{tag}.c"));
    std::fs::write(&c, format!("#include \"nccl.h\"\n\n{body}")).unwrap();
    let o = Command::new("cc")
        .args(["-std=gnu11", "-Wall", "-Werror", "-c", "-o"])
        .arg(dir.join(format!("{tag}.o")))
        .arg("-I")
        .arg(include_dir())
        .arg(&c)
        .output()
        .unwrap_or_else(|e| panic!("cannot run cc: {e}"));
    if o.status.success() {
        Ok(())
    } else {
        Err(String::from_utf8_lossy(&o.stderr).into_owned())
    }
}

#[test]
fn real_nccl_h_prototypes_match_ours() {
    let Some(real) = real_nccl() else { return };
    let text = std::fs::read_to_string(&real.header).unwrap();
    let theirs = prototypes(&text);
    assert!(
        theirs.len() > 100,
        "only {} prototypes parsed from {}",
        theirs.len(),
        real.header.display()
    );
    let ours: BTreeSet<String> = our_prototypes().into_iter().map(|p| p.name).collect();
    let undeclared: Vec<&str> = theirs
        .iter()
        .filter(|p| !ours.contains(&p.name))
        .map(|p| p.name.as_str())
        .collect();
    assert!(
        undeclared.is_empty(),
        "functions of NCCL {VERSION}'s nccl.h that libcomm/include/nccl.h does not declare:\n  {}",
        undeclared.join("\n  ")
    );

    let dir =
        Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("nccl-protos-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let body: String = theirs.iter().map(|p| format!("{}\n", p.text)).collect();
    if let Err(msg) = compile_against_ours(&dir, "real_prototypes", &body) {
        panic!(
            "NCCL {VERSION}'s prototypes conflict with libcomm/include/nccl.h ({}):\n{msg}",
            dir.join("real_prototypes.c").display()
        );
    }
    // The check itself: a changed prototype must not compile.
    let wrong = "ncclResult_t ncclGetVersion(long* version);\n";
    assert!(
        compile_against_ours(&dir, "wrong_prototype", wrong).is_err(),
        "a conflicting redeclaration compiled: the prototype check checks nothing"
    );
    let _ = std::fs::remove_dir_all(&dir);
    eprintln!(
        "all {} prototypes of NCCL {VERSION}'s nccl.h match libcomm/include/nccl.h",
        theirs.len()
    );
}

#[test]
fn prototype_parser_reads_multiline_and_attributed_declarations() {
    let src = r#"
/* a comment; with ncclFake(int); inside */
#define NCCL_X(a) \
  ncclNotAFunction(a);
typedef struct { int a; } ncclThing_t;
ncclResult_t  ncclAllGather(const void* sendbuff, void* recvbuff,
    size_t sendcount, ncclComm_t comm); // trailing; comment
const char*  ncclGetErrorString(ncclResult_t result);
  __attribute__ ((deprecated("no // comment here")))
  void  ncclResetDebugInit();
"#;
    let p = prototypes(src);
    let texts: Vec<&str> = p.iter().map(|p| p.text.as_str()).collect();
    assert_eq!(
        texts,
        [
            "ncclResult_t ncclAllGather(const void* sendbuff, void* recvbuff, size_t sendcount, ncclComm_t comm);",
            "const char* ncclGetErrorString(ncclResult_t result);",
            "void ncclResetDebugInit();",
        ]
    );
}
