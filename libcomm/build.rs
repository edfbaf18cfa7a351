//! Compiles the CUDA kernels ahead of time, so that a process launches its
//! first collective without compiling anything.
//!
//! With NVRTC at hand (see `build/locate.rs`; PyPI's wheel needs no CUDA
//! toolkit), every kernel of `src/cuda/kernel_set.rs` is compiled to machine
//! code (cubin) for each architecture of `CUBIN_ARCHS`, and to PTX for
//! `PTX_ARCH`, on `NUM_JOBS` threads. Each cubin is checked (its ELF header
//! names the architecture, it defines the kernel), the results are packed
//! into one archive per architecture (`src/cuda/kernel_archive.rs`) and
//! `kernel_images.rs` in OUT_DIR embeds them (`src/cuda/embedded.rs`).
//! Compiled kernels are cached by content in `target/weft-kernels`, so
//! debug and release builds, and rebuilds after unrelated edits, compile
//! nothing again.
//!
//! Without NVRTC the build still succeeds and says so once (the library then
//! compiles kernels at run time, as it did before); with
//! `WEFT_REQUIRE_NVRTC=1` (CI) that is a build failure instead. A kernel
//! that does not compile always fails the build.

#[path = "build/locate.rs"]
mod locate;
#[path = "build/nvrtc.rs"]
mod nvrtc;

#[allow(dead_code)]
#[path = "src/cuda/cubin.rs"]
mod cubin;
#[allow(dead_code)]
#[path = "src/cuda/kernel_archive.rs"]
mod kernel_archive;
#[allow(dead_code)]
#[path = "src/cuda/kernel_set.rs"]
mod kernel_set;

use kernel_set::{CUBIN_ARCHS, Kernel, OPTIONS, PTX_ARCH};
use nvrtc::Nvrtc;
use sha2::{Digest, Sha256};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;
use weft_contract::params::{WEFT_NVRTC, WEFT_REQUIRE_NVRTC};

fn main() {
    for f in [
        "build.rs",
        "build",
        "../kernels/collectives.cu",
        "src/cuda/kernel_set.rs",
        "src/cuda/kernel_archive.rs",
        "src/cuda/cubin.rs",
        // NVRTC appearing in CI's folder (`.ci/run` installs it there).
        "../.ci",
    ] {
        println!("cargo:rerun-if-changed={f}");
    }
    // Not LD_LIBRARY_PATH, though NVRTC is looked for there too: shells
    // that differ only in it would rebuild libcomm back and forth. NVRTC
    // installed elsewhere later: set WEFT_NVRTC.
    for v in [WEFT_NVRTC.spec().name, WEFT_REQUIRE_NVRTC.spec().name] {
        println!("cargo:rerun-if-env-changed={v}");
    }
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let manifest = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets it"));
    let required = WEFT_REQUIRE_NVRTC.raw().as_deref() == Some("1");
    let images = match build_images(&manifest, &out) {
        Ok(images) => images,
        Err(Skip::Off) if !required => Vec::new(),
        Err(Skip::Missing(why)) if !required => {
            println!(
                "cargo:warning=CUDA kernels not compiled ahead of time ({why}); the library will compile them with NVRTC at run time, on first use. Install NVRTC (pip install nvidia-cuda-nvrtc==13.0.88) or set WEFT_NVRTC to compile them now."
            );
            Vec::new()
        }
        Err(Skip::Off) => panic!("WEFT_REQUIRE_NVRTC=1 but WEFT_NVRTC=off"),
        Err(Skip::Missing(why)) => panic!("WEFT_REQUIRE_NVRTC=1 but {why}"),
    };
    write_index(&out, &images);
}

/// Why the build compiled no kernels.
enum Skip {
    Off,
    Missing(String),
}

/// One embedded archive: its architecture, whether it holds PTX, its file.
struct Image {
    arch: u32,
    ptx: bool,
    file: PathBuf,
}

/// Compiles every kernel and writes the archives into `out`.
fn build_images(manifest: &Path, out: &Path) -> Result<Vec<Image>, Skip> {
    let workspace = manifest.parent().unwrap_or(manifest);
    let path = match locate::nvrtc(WEFT_NVRTC.raw().as_deref(), workspace) {
        Ok(locate::Choice::Off) => return Err(Skip::Off),
        Ok(locate::Choice::Library(p)) => p,
        // A WEFT_NVRTC that names nothing is a mistake, required or not.
        Err(e) => panic!("{e}"),
    };
    let nvrtc = Nvrtc::load(&path).map_err(|e| Skip::Missing(format!("NVRTC not loaded: {e}")))?;
    let jobs: Vec<Job> = CUBIN_ARCHS
        .iter()
        .flat_map(|&arch| {
            kernel_set::for_arch(arch)
                .into_iter()
                .map(move |kernel| Job {
                    arch,
                    ptx: arch == PTX_ARCH,
                    kernel,
                })
        })
        .collect();
    let cache = cache_dir(out);
    let started = Instant::now();
    let compiled = AtomicUsize::new(0);
    let results = run_jobs(&jobs, |job| {
        job.compile(&nvrtc, cache.as_deref(), &compiled)
    });
    let mut failures = String::new();
    let mut done = Vec::with_capacity(jobs.len());
    for (job, r) in jobs.iter().zip(results) {
        match r {
            Ok(o) => done.push((job, o)),
            Err(e) => writeln!(failures, "{e}").unwrap(),
        }
    }
    if !failures.is_empty() {
        panic!(
            "kernels did not compile with {}:\n{failures}",
            path.display()
        );
    }
    let mut images = Vec::new();
    let mut summary = format!(
        "NVRTC {}.{} ({}): {} kernels compiled in {:.1} s ({} from the cache)\n",
        nvrtc.version.0,
        nvrtc.version.1,
        nvrtc.path.display(),
        jobs.len(),
        started.elapsed().as_secs_f64(),
        jobs.len() - compiled.load(Ordering::Relaxed),
    );
    for &arch in CUBIN_ARCHS {
        let of_arch = || done.iter().filter(|(j, _)| j.arch == arch);
        let cubins: Vec<(String, Vec<u8>)> = of_arch()
            .map(|(j, o)| (j.kernel.name.clone(), o.cubin.clone()))
            .collect();
        images.push(write_archive(out, arch, false, &cubins, &mut summary));
        if arch == PTX_ARCH {
            let ptx: Vec<(String, Vec<u8>)> = of_arch()
                .filter_map(|(j, o)| Some((j.kernel.name.clone(), o.ptx.clone()?)))
                .collect();
            images.push(write_archive(out, arch, true, &ptx, &mut summary));
        }
    }
    println!("{summary}");
    let _ = std::fs::write(out.join("kernels-summary.txt"), summary);
    Ok(images)
}

/// One compilation: a kernel for an architecture (its PTX too for PTX_ARCH).
struct Job {
    arch: u32,
    ptx: bool,
    kernel: Kernel,
}

impl Job {
    fn options(&self) -> Vec<String> {
        let mut o: Vec<String> = OPTIONS.iter().map(|s| s.to_string()).collect();
        o.push(kernel_set::arch_option(self.arch, true));
        o
    }

    /// The cubin (and PTX), from the cache or NVRTC, checked.
    fn compile(
        &self,
        nvrtc: &Nvrtc,
        cache: Option<&Path>,
        compiled: &AtomicUsize,
    ) -> Result<nvrtc::Output, String> {
        let program = kernel_set::program(&self.kernel);
        let options = self.options();
        let key = {
            let mut h = Sha256::new();
            h.update(format!("{:?}\0{}\0", nvrtc.version, options.join(" ")));
            h.update(program.as_bytes());
            h.finalize()
                .iter()
                .take(16)
                .fold(String::new(), |mut s, b| {
                    let _ = write!(s, "{b:02x}");
                    s
                })
        };
        let cached = |ext: &str| cache.map(|d| d.join(format!("{key}.{ext}")));
        let from_cache = || -> Option<nvrtc::Output> {
            let cubin = std::fs::read(cached("cubin")?).ok()?;
            let ptx = match self.ptx {
                true => Some(std::fs::read(cached("ptx")?).ok()?),
                false => None,
            };
            Some(nvrtc::Output { cubin, ptx })
        };
        let output = match from_cache() {
            Some(o) => o,
            None => {
                let name = format!("{}.cu", self.kernel.name);
                let o = nvrtc.compile(&name, &program, &options, self.ptx)?;
                compiled.fetch_add(1, Ordering::Relaxed);
                // Best effort: a failed write only costs a later compile.
                if let Some(f) = cached("cubin") {
                    write_atomic(&f, &o.cubin);
                }
                if let (Some(f), Some(p)) = (cached("ptx"), &o.ptx) {
                    write_atomic(&f, p);
                }
                o
            }
        };
        let info = cubin::inspect(&output.cubin)
            .map_err(|e| format!("{} for sm_{}: {e}", self.kernel.name, self.arch))?;
        if info.arch != self.arch || !info.functions.contains(&self.kernel.name) {
            return Err(format!(
                "{} for sm_{}: the cubin is for sm_{} and defines {:?}",
                self.kernel.name, self.arch, info.arch, info.functions
            ));
        }
        Ok(output)
    }
}

/// Runs `f` over `jobs` on `NUM_JOBS` threads (cargo's -j), results in order.
fn run_jobs<T: Send>(
    jobs: &[Job],
    f: impl Fn(&Job) -> Result<T, String> + Sync,
) -> Vec<Result<T, String>> {
    let threads = std::env::var("NUM_JOBS")
        .ok()
        .and_then(|n| n.parse::<usize>().ok())
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
        .clamp(1, jobs.len().max(1));
    let next = AtomicUsize::new(0);
    let results: Vec<Mutex<Option<Result<T, String>>>> =
        jobs.iter().map(|_| Mutex::new(None)).collect();
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(job) = jobs.get(i) else { break };
                    let r = f(job);
                    *results[i].lock().unwrap() = Some(r);
                }
            });
        }
    });
    results
        .into_iter()
        .map(|m| m.into_inner().unwrap().expect("every job ran"))
        .collect()
}

/// `target/weft-kernels` (OUT_DIR is `target/<profile>/build/<pkg>/out`).
fn cache_dir(out: &Path) -> Option<PathBuf> {
    let d = out.ancestors().nth(4)?.join("weft-kernels");
    std::fs::create_dir_all(&d).ok()?;
    Some(d)
}

fn write_atomic(f: &Path, bytes: &[u8]) {
    let tmp = f.with_extension(format!("tmp{}", std::process::id()));
    if std::fs::write(&tmp, bytes).is_ok() {
        let _ = std::fs::rename(&tmp, f);
    }
}

fn write_archive(
    out: &Path,
    arch: u32,
    ptx: bool,
    entries: &[(String, Vec<u8>)],
    summary: &mut String,
) -> Image {
    let packed = kernel_archive::pack(entries);
    let form = if ptx { "compute" } else { "sm" };
    let file = out.join(format!("kernels-{form}_{arch}.kar"));
    // Unchanged contents keep their timestamp (nothing recompiles).
    if std::fs::read(&file).ok().as_deref() != Some(packed.as_slice()) {
        std::fs::write(&file, &packed).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
    }
    let raw: usize = entries.iter().map(|(_, b)| b.len()).sum();
    let _ = writeln!(
        summary,
        "{} for sm_{arch}: {} kernels, {raw} bytes, {} packed",
        if ptx { "PTX" } else { "cubin" },
        entries.len(),
        packed.len()
    );
    Image { arch, ptx, file }
}

/// Writes `kernel_images.rs`: the archives as `include_bytes!`.
fn write_index(out: &Path, images: &[Image]) {
    let mut s =
        String::from("// Generated by libcomm/build.rs: the kernels compiled ahead of time.\n");
    s.push_str("pub(super) const IMAGES: &[Image] = &[\n");
    for i in images {
        let form = if i.ptx { "Ptx" } else { "Cubin" };
        let _ = writeln!(
            s,
            "    Image {{ arch: {}, form: Form::{form}, archive: include_bytes!({:?}) }},",
            i.arch,
            i.file.display().to_string()
        );
    }
    s.push_str("];\n");
    let f = out.join("kernel_images.rs");
    // Unchanged contents keep their timestamp (nothing recompiles).
    if std::fs::read_to_string(&f).ok().as_deref() != Some(s.as_str()) {
        std::fs::write(&f, s).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
    }
}
