//! libcomm's build script (it compiles the CUDA kernels ahead of time) when
//! NVRTC is off or cannot be loaded: the build goes on, says so once and
//! embeds no kernels, unless `WEFT_REQUIRE_NVRTC=1` (CI), where it fails
//! instead of falling back quietly; a `WEFT_NVRTC` naming nothing always
//! fails. Runs the build script cargo compiled for this test build, with a
//! scratch OUT_DIR (none of these cases compiles a kernel).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The newest `build-script-build` of weft-libcomm in this target dir.
fn build_script() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    // target/<profile>/deps/<test> -> target/<profile>/build
    let build = exe.parent().unwrap().parent().unwrap().join("build");
    std::fs::read_dir(&build)
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("weft-libcomm-"))
        .map(|e| e.path().join("build-script-build"))
        .filter(|p| p.is_file())
        .max_by_key(|p| p.metadata().and_then(|m| m.modified()).ok())
        .unwrap_or_else(|| panic!("no build-script-build under {}", build.display()))
}

fn scratch(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("weft-build-script-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Runs the build script with `WEFT_NVRTC=nvrtc`, required or not.
fn run(out: &Path, nvrtc: &str, required: bool) -> Output {
    let mut c = Command::new(build_script());
    c.env("OUT_DIR", out)
        .env("CARGO_MANIFEST_DIR", env!("CARGO_MANIFEST_DIR"))
        .env("WEFT_NVRTC", nvrtc)
        .env_remove("WEFT_REQUIRE_NVRTC");
    if required {
        c.env("WEFT_REQUIRE_NVRTC", "1");
    }
    c.output().unwrap()
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// The generated index embeds nothing.
fn no_images(out: &Path) {
    let index = std::fs::read_to_string(out.join("kernel_images.rs")).unwrap();
    assert!(index.contains("IMAGES: &[Image] = &[\n];"), "{index}");
}

#[test]
fn off_builds_without_kernels_unless_required() {
    let out = scratch("off");
    let o = run(&out, "off", false);
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert!(
        !text(&o.stdout).contains("cargo:warning"),
        "asked for: no warning"
    );
    no_images(&out);
    let o = run(&out, "off", true);
    assert!(!o.status.success());
    assert!(text(&o.stderr).contains("WEFT_REQUIRE_NVRTC=1 but WEFT_NVRTC=off"));
    let _ = std::fs::remove_dir_all(out);
}

#[test]
fn an_nvrtc_that_does_not_load_warns_once_or_fails_when_required() {
    let out = scratch("broken");
    // Not a library: dlopen refuses it, as it would a missing one.
    let lib = out.join("libnvrtc.so.13");
    std::fs::write(&lib, b"not a library").unwrap();
    let o = run(&out, lib.to_str().unwrap(), false);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let stdout = text(&o.stdout);
    assert_eq!(stdout.matches("cargo:warning=").count(), 1, "{stdout}");
    assert!(
        stdout.contains("cargo:warning=CUDA kernels not compiled ahead of time (NVRTC not loaded")
    );
    no_images(&out);
    let o = run(&out, lib.to_str().unwrap(), true);
    assert!(!o.status.success());
    assert!(
        text(&o.stderr).contains("WEFT_REQUIRE_NVRTC=1 but NVRTC not loaded"),
        "{}",
        text(&o.stderr)
    );
    let _ = std::fs::remove_dir_all(out);
}

#[test]
fn weft_nvrtc_naming_nothing_fails() {
    let out = scratch("nothing");
    let o = run(&out, out.join("no-such-dir").to_str().unwrap(), false);
    assert!(!o.status.success());
    assert!(
        text(&o.stderr).contains("no libnvrtc.so.13 there"),
        "{}",
        text(&o.stderr)
    );
    let _ = std::fs::remove_dir_all(out);
}
