//! The kernels the library carries: what the build compiled ahead of time
//! (`libcomm/build.rs`), one archive of cubins per architecture and one of
//! PTX, and which of them serves a GPU of a given compute capability.

use super::error::{CudaError, CudaResult};
use super::kernel_archive;

/// What an image holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Form {
    /// Machine code for one architecture (and the newer minor versions of
    /// its major one).
    Cubin,
    /// PTX, which the driver JIT-compiles for its architecture or any newer.
    Ptx,
}

/// One embedded archive.
#[derive(Debug)]
pub struct Image {
    /// The SM number it was compiled for (90: sm_90 / compute_90).
    pub arch: u32,
    pub form: Form,
    pub archive: &'static [u8],
}

// IMAGES: the build's archives, empty when it had no NVRTC.
include!(concat!(env!("OUT_DIR"), "/kernel_images.rs"));

/// Every image the library carries (none from a build without NVRTC).
pub fn images() -> &'static [Image] {
    IMAGES
}

impl Image {
    /// Kernel `name` of this image (cubin bytes, or NUL-terminated PTX);
    /// None when the image has no such kernel.
    pub fn kernel(&self, name: &str) -> CudaResult<Option<Vec<u8>>> {
        let entries = kernel_archive::parse(self.archive).map_err(image_error)?;
        match entries.iter().find(|e| e.name == name) {
            Some(e) => e.bytes().map(Some).map_err(image_error),
            None => Ok(None),
        }
    }

    /// Whether the image has kernel `name`.
    pub fn has(&self, name: &str) -> bool {
        kernel_archive::parse(self.archive).is_ok_and(|es| es.iter().any(|e| e.name == name))
    }

    /// The names of its kernels, in the build's order.
    #[cfg(test)]
    pub fn names(&self) -> CudaResult<Vec<&'static str>> {
        let entries = kernel_archive::parse(self.archive).map_err(image_error)?;
        Ok(entries.iter().map(|e| e.name).collect())
    }

    /// `sm_90` or `compute_90`.
    pub fn label(&self) -> String {
        match self.form {
            Form::Cubin => format!("sm_{}", self.arch),
            Form::Ptx => format!("compute_{}", self.arch),
        }
    }
}

fn image_error(e: kernel_archive::ArchiveError) -> CudaError {
    CudaError::Unsupported(format!("the library's kernels are damaged: {e}"))
}

/// A compute capability as an SM number: (9, 0) is 90, (10, 3) is 103.
pub fn sm(cc: (i32, i32)) -> u32 {
    (cc.0.max(0) * 10 + cc.1.max(0)) as u32
}

/// The cubin that runs on compute capability `cc`: one of the same major
/// version whose minor is the highest not above the device's (a cubin for
/// sm_XY runs on X.Z for Z >= Y, CUDA's binary compatibility: sm_80 serves
/// 8.6 and 8.9, sm_100 serves 10.3; sm_90 is the only 9.x). The build makes
/// plain cubins only: an arch-specific one (sm_90a) would run on exactly
/// its own architecture.
pub fn cubin_for(images: &'static [Image], cc: (i32, i32)) -> Option<&'static Image> {
    let dev = sm(cc);
    images
        .iter()
        .filter(|i| i.form == Form::Cubin && i.arch / 10 == dev / 10 && i.arch <= dev)
        .max_by_key(|i| i.arch)
}

/// The PTX the driver can compile for compute capability `cc`: PTX for
/// compute_XY runs on any architecture at or above XY.
pub fn ptx_for(images: &'static [Image], cc: (i32, i32)) -> Option<&'static Image> {
    let dev = sm(cc);
    images
        .iter()
        .filter(|i| i.form == Form::Ptx && i.arch <= dev)
        .max_by_key(|i| i.arch)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::cubin;
    use crate::cuda::kernel_set::{self, CUBIN_ARCHS, PTX_ARCH};

    static SET: [Image; 4] = [
        Image {
            arch: 80,
            form: Form::Cubin,
            archive: &[],
        },
        Image {
            arch: 90,
            form: Form::Cubin,
            archive: &[],
        },
        Image {
            arch: 100,
            form: Form::Cubin,
            archive: &[],
        },
        Image {
            arch: 100,
            form: Form::Ptx,
            archive: &[],
        },
    ];

    fn pick(cc: (i32, i32)) -> (Option<String>, Option<String>) {
        (
            cubin_for(&SET, cc).map(Image::label),
            ptx_for(&SET, cc).map(Image::label),
        )
    }

    #[test]
    fn each_gpu_gets_the_image_that_runs_on_it() {
        let s = |x: &str| Some(x.to_string());
        // Ampere and Ada: sm_80 machine code, too old for the PTX.
        assert_eq!(pick((8, 0)), (s("sm_80"), None));
        assert_eq!(pick((8, 6)), (s("sm_80"), None));
        assert_eq!(pick((8, 9)), (s("sm_80"), None));
        // Hopper.
        assert_eq!(pick((9, 0)), (s("sm_90"), None));
        // Blackwell: sm_100 code for 10.0 and 10.3; PTX for 11.0, 12.0 ...
        assert_eq!(pick((10, 0)), (s("sm_100"), s("compute_100")));
        assert_eq!(pick((10, 3)), (s("sm_100"), s("compute_100")));
        assert_eq!(pick((12, 0)), (None, s("compute_100")));
        assert_eq!(pick((11, 0)), (None, s("compute_100")));
        // Older than anything built: only NVRTC at run time.
        assert_eq!(pick((7, 5)), (None, None));
        assert_eq!(sm((10, 3)), 103);
    }

    /// CI (no GPU): the library carries a cubin for every architecture of
    /// CUBIN_ARCHS and PTX for PTX_ARCH, each with every kernel the loader
    /// can ask for on it; every cubin's ELF header says CUDA (EM_CUDA) and
    /// its architecture, and it defines its kernel. A build without NVRTC
    /// carries nothing: the test then says so and passes, unless
    /// WEFT_REQUIRE_NVRTC=1 (CI), where that build failed already.
    #[test]
    fn the_library_carries_every_kernel_for_every_architecture() {
        let images = images();
        if images.is_empty() {
            // .ci/run installs NVRTC: in CI its absence is a failure.
            weft_testkit::skip_outside_ci(
                weft_contract::params::WEFT_REQUIRE_NVRTC.raw().as_deref() == Some("1"),
                "this build has no kernels compiled ahead of time (no NVRTC at build time)",
            );
            return;
        }
        let mut labels: Vec<String> = images.iter().map(Image::label).collect();
        labels.sort();
        let mut want: Vec<String> = CUBIN_ARCHS.iter().map(|a| format!("sm_{a}")).collect();
        want.push(format!("compute_{PTX_ARCH}"));
        want.sort();
        assert_eq!(labels, want);
        for image in images {
            let names = image.names().unwrap();
            let expected: Vec<String> = kernel_set::for_arch(image.arch)
                .into_iter()
                .map(|k| k.name)
                .collect();
            assert_eq!(names, expected, "{}", image.label());
            for name in names {
                let bytes = image.kernel(name).unwrap().unwrap();
                match image.form {
                    Form::Cubin => {
                        let info = cubin::inspect(&bytes)
                            .unwrap_or_else(|e| panic!("{} {name}: {e}", image.label()));
                        assert_eq!(info.arch, image.arch, "{name}");
                        assert!(info.functions.iter().any(|f| f == name), "{name}");
                    }
                    Form::Ptx => {
                        let text = std::str::from_utf8(&bytes).unwrap();
                        assert!(text.ends_with('\0'), "{name}: PTX is NUL-terminated");
                        assert!(text.contains(&format!(".target sm_{}", image.arch)));
                        assert!(text.contains(&format!(".entry {name}(")), "{name}");
                    }
                }
            }
        }
        // The fp8 kernels only where sm_89 instructions exist.
        let sm80 = images.iter().find(|i| i.label() == "sm_80").unwrap();
        assert!(!sm80.has("weft_coll_f8e4m3_sum") && sm80.has("weft_coll_bf16_sum"));
    }
}
