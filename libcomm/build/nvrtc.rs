//! NVRTC as the build uses it: loaded from a file (PyPI's wheel needs no CUDA
//! toolkit) and asked for machine code (cubin) and PTX. Thread-safe for
//! separate programs, so the build compiles kernels on several threads.

use libloading::os::unix::{Library, RTLD_GLOBAL, RTLD_NOW};
use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::path::{Path, PathBuf};

type Prog = *mut c_void;

/// The loaded library and the entry points the build calls.
pub struct Nvrtc {
    pub path: PathBuf,
    pub version: (i32, i32),
    create: unsafe extern "C" fn(
        *mut Prog,
        *const c_char,
        *const c_char,
        c_int,
        *const *const c_char,
        *const *const c_char,
    ) -> c_int,
    compile: unsafe extern "C" fn(Prog, c_int, *const *const c_char) -> c_int,
    log_size: unsafe extern "C" fn(Prog, *mut usize) -> c_int,
    log: unsafe extern "C" fn(Prog, *mut c_char) -> c_int,
    cubin_size: unsafe extern "C" fn(Prog, *mut usize) -> c_int,
    cubin: unsafe extern "C" fn(Prog, *mut c_char) -> c_int,
    ptx_size: unsafe extern "C" fn(Prog, *mut usize) -> c_int,
    ptx: unsafe extern "C" fn(Prog, *mut c_char) -> c_int,
    destroy: unsafe extern "C" fn(*mut Prog) -> c_int,
    error_string: unsafe extern "C" fn(c_int) -> *const c_char,
    // Kept loaded for the entry points above.
    _libs: Vec<Library>,
}

// The entry points are plain C functions of a library that stays loaded.
unsafe impl Send for Nvrtc {}
unsafe impl Sync for Nvrtc {}

/// The entry point `name` of `lib`, as a function pointer of type `T`.
fn get<T: Copy>(lib: &Library, name: &str) -> Result<T, String> {
    let cname = format!("{name}\0");
    unsafe { lib.get::<T>(cname.as_bytes()) }
        .map(|s| *s)
        .map_err(|e| format!("{name}: {e}"))
}

/// What one compilation produced.
pub struct Output {
    pub cubin: Vec<u8>,
    /// The PTX (NUL-terminated), when asked for.
    pub ptx: Option<Vec<u8>>,
}

impl Nvrtc {
    /// Loads `path` (a `libnvrtc.so.13`). Its builtins library, which NVRTC
    /// opens by name on first use, is loaded first from the same folder:
    /// the dynamic loader then finds it loaded whatever LD_LIBRARY_PATH says.
    pub fn load(path: &Path) -> Result<Nvrtc, String> {
        let mut libs = Vec::new();
        if let Some(dir) = path.parent()
            && let Ok(entries) = std::fs::read_dir(dir)
        {
            for e in entries.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                if name.starts_with("libnvrtc-builtins.so") && !name.contains(".alt.") {
                    let lib = unsafe { Library::open(Some(e.path()), RTLD_NOW | RTLD_GLOBAL) }
                        .map_err(|err| format!("{}: {err}", e.path().display()))?;
                    libs.push(lib);
                }
            }
        }
        let lib = unsafe { Library::open(Some(path), RTLD_NOW | RTLD_GLOBAL) }
            .map_err(|e| format!("{}: {e}", path.display()))?;
        let version_fn: unsafe extern "C" fn(*mut c_int, *mut c_int) -> c_int =
            get(&lib, "nvrtcVersion")?;
        let mut version = (0, 0);
        unsafe { version_fn(&mut version.0, &mut version.1) };
        Ok(Nvrtc {
            path: path.to_path_buf(),
            version,
            create: get(&lib, "nvrtcCreateProgram")?,
            compile: get(&lib, "nvrtcCompileProgram")?,
            log_size: get(&lib, "nvrtcGetProgramLogSize")?,
            log: get(&lib, "nvrtcGetProgramLog")?,
            cubin_size: get(&lib, "nvrtcGetCUBINSize")?,
            cubin: get(&lib, "nvrtcGetCUBIN")?,
            ptx_size: get(&lib, "nvrtcGetPTXSize")?,
            ptx: get(&lib, "nvrtcGetPTX")?,
            destroy: get(&lib, "nvrtcDestroyProgram")?,
            error_string: get(&lib, "nvrtcGetErrorString")?,
            _libs: {
                libs.push(lib);
                libs
            },
        })
    }

    /// Compiles `src` (named `name` in messages) with `options`; the PTX too
    /// when `want_ptx`.
    pub fn compile(
        &self,
        name: &str,
        src: &str,
        options: &[String],
        want_ptx: bool,
    ) -> Result<Output, String> {
        let csrc = CString::new(src).map_err(|_| format!("{name}: NUL in the source"))?;
        let cname = CString::new(name).map_err(|_| format!("{name}: NUL in the name"))?;
        let copts: Vec<CString> = options
            .iter()
            .map(|o| CString::new(o.as_str()).map_err(|_| format!("NUL in option {o}")))
            .collect::<Result<_, _>>()?;
        let ptrs: Vec<*const c_char> = copts.iter().map(|c| c.as_ptr()).collect();
        let mut prog: Prog = std::ptr::null_mut();
        self.check(
            unsafe {
                (self.create)(
                    &mut prog,
                    csrc.as_ptr(),
                    cname.as_ptr(),
                    0,
                    std::ptr::null(),
                    std::ptr::null(),
                )
            },
            "nvrtcCreateProgram",
        )?;
        let result = (|| {
            let r = unsafe { (self.compile)(prog, ptrs.len() as c_int, ptrs.as_ptr()) };
            if r != 0 {
                return Err(format!(
                    "{name} ({}): {}\n{}",
                    options.join(" "),
                    self.error_text(r),
                    self.program_log(prog)
                ));
            }
            let cubin = self.read(prog, self.cubin_size, self.cubin, "nvrtcGetCUBIN")?;
            let ptx = if want_ptx {
                Some(self.read(prog, self.ptx_size, self.ptx, "nvrtcGetPTX")?)
            } else {
                None
            };
            Ok(Output { cubin, ptx })
        })();
        unsafe { (self.destroy)(&mut prog) };
        result
    }

    fn read(
        &self,
        prog: Prog,
        size: unsafe extern "C" fn(Prog, *mut usize) -> c_int,
        get: unsafe extern "C" fn(Prog, *mut c_char) -> c_int,
        what: &str,
    ) -> Result<Vec<u8>, String> {
        let mut n = 0usize;
        self.check(unsafe { size(prog, &mut n) }, what)?;
        let mut buf = vec![0u8; n];
        self.check(unsafe { get(prog, buf.as_mut_ptr().cast()) }, what)?;
        Ok(buf)
    }

    fn program_log(&self, prog: Prog) -> String {
        let mut n = 0usize;
        if unsafe { (self.log_size)(prog, &mut n) } != 0 || n == 0 {
            return String::new();
        }
        let mut buf = vec![0u8; n];
        if unsafe { (self.log)(prog, buf.as_mut_ptr().cast()) } != 0 {
            return String::new();
        }
        String::from_utf8_lossy(&buf)
            .trim_end_matches('\0')
            .to_string()
    }

    fn error_text(&self, r: c_int) -> String {
        let p = unsafe { (self.error_string)(r) };
        if p.is_null() {
            return format!("NVRTC error {r}");
        }
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }

    fn check(&self, r: c_int, what: &str) -> Result<(), String> {
        if r == 0 {
            Ok(())
        } else {
            Err(format!("{what}: {}", self.error_text(r)))
        }
    }
}
