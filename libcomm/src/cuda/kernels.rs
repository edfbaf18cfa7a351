//! Kernel lookup, the one place every launch gets its kernel from
//! ([`function`]): which kernel a collective runs, and loading it once per
//! device from the best source there is for the device's compute capability:
//!
//! 1. the machine code (cubin) the build compiled for it (`embedded.rs`):
//!    nothing is compiled;
//! 2. else the build's PTX, which the driver JIT-compiles (a GPU newer than
//!    the build's newest cubin; the driver caches the result);
//! 3. else NVRTC in the process (`nvrtc.rs`, cached on disk), as every
//!    kernel was compiled before the build did it: a GPU older than every
//!    image, or a library built without NVRTC.
//!
//! `WEFT_KERNEL_SOURCE` can skip the first (`ptx`) or both (`nvrtc`). Each
//! kernel is its own module (the images hold one entry per kernel), so a
//! process loads, JIT-compiles or compiles only the kernels it launches.
//! Falling back to 2 or 3 is logged once per process.

use super::driver::{compute_capability, use_device};
use super::embedded::{self, Image};
use super::error::{CudaError, CudaResult, check};
use super::kernel_set::{self, P2P};
use super::nvrtc;
use crate::data::types::{DataType, ReduceOp};
use cudarc::driver::sys;
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, Once, OnceLock};

pub use super::nvrtc::{compile_single, compiles as nvrtc_compiles, nvrtc_available};

/// Where a kernel came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// The build's machine code.
    Cubin,
    /// The build's PTX, JIT-compiled by the driver.
    Ptx,
    /// Compiled in this process by NVRTC.
    Nvrtc,
}

static LOADS: [AtomicUsize; 3] = [const { AtomicUsize::new(0) }; 3];

/// Kernels this process has loaded, per source (cubin, PTX, NVRTC).
pub fn loads() -> [usize; 3] {
    LOADS.each_ref().map(|n| n.load(Ordering::Relaxed))
}

/// Which sources `WEFT_KERNEL_SOURCE` allows, best first.
fn allowed() -> &'static [Source] {
    static A: OnceLock<&'static [Source]> = OnceLock::new();
    A.get_or_init(
        || match weft_contract::params::WEFT_KERNEL_SOURCE.value().as_str() {
            "nvrtc" => &[Source::Nvrtc],
            "ptx" => &[Source::Ptx, Source::Nvrtc],
            _ => &[Source::Cubin, Source::Ptx, Source::Nvrtc],
        },
    )
}

/// Whether kernel `name` can be had on a GPU of compute capability `cc`,
/// without trying (the plan asks before every launch: the answer is
/// remembered).
pub(super) fn available_for(cc: (i32, i32), name: &'static str) -> bool {
    type Known = HashMap<((i32, i32), &'static str), bool>;
    static KNOWN: Mutex<Option<Known>> = Mutex::new(None);
    let mut g = KNOWN.lock().unwrap_or_else(|e| e.into_inner());
    *g.get_or_insert_with(HashMap::new)
        .entry((cc, name))
        .or_insert_with(|| {
            allowed().iter().any(|s| match s {
                Source::Cubin => {
                    embedded::cubin_for(embedded::images(), cc).is_some_and(|i| i.has(name))
                }
                Source::Ptx => {
                    embedded::ptx_for(embedded::images(), cc).is_some_and(|i| i.has(name))
                }
                Source::Nvrtc => nvrtc_available(),
            })
        })
}

/// Whether this library has kernels at all: compiled by the build, or
/// NVRTC to compile them (tests that need the kernel path check this).
pub fn available() -> bool {
    !embedded::images().is_empty() || nvrtc_available()
}

/// A table filled on first use whose lock is never held while an entry
/// loads: a load may take milliseconds (a cubin) or seconds (a PTX JIT,
/// NVRTC), and every launch of every communicator in the process looks its
/// kernel up here, so holding the lock would stall them all behind one
/// first use (issue 33). Two threads that miss the same key both load it;
/// the first to insert wins (a kernel module loaded twice stays unused).
struct Table<K, V> {
    map: Mutex<Option<HashMap<K, V>>>,
}

impl<K: Eq + std::hash::Hash + Copy, V: Copy> Table<K, V> {
    const fn new() -> Self {
        Table {
            map: Mutex::new(None),
        }
    }

    fn lookup(&self) -> std::sync::MutexGuard<'_, Option<HashMap<K, V>>> {
        self.map.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn get_or_load<E>(&self, key: K, load: impl FnOnce() -> Result<V, E>) -> Result<V, E> {
        if let Some(v) = self.lookup().get_or_insert_with(HashMap::new).get(&key) {
            return Ok(*v);
        }
        let v = load()?;
        Ok(*self
            .lookup()
            .get_or_insert_with(HashMap::new)
            .entry(key)
            .or_insert(v))
    }
}

/// Kernel `name` on device `dev`, loaded on first use.
pub(super) fn function(dev: i32, name: &'static str) -> CudaResult<sys::CUfunction> {
    static FUNCS: Table<(i32, &'static str), usize> = Table::new();
    FUNCS
        .get_or_load((dev, name), || load(dev, name).map(|f| f as usize))
        .map(|f| f as sys::CUfunction)
}

/// Loads `name` on `dev` from the first source that has it and whose
/// module the driver takes.
fn load(dev: i32, name: &str) -> CudaResult<sys::CUfunction> {
    let cc = compute_capability(dev)?;
    let mut failed: Option<CudaError> = None;
    for &source in allowed() {
        let image = match source {
            Source::Cubin => module_bytes(embedded::cubin_for(embedded::images(), cc), name)?,
            Source::Ptx => module_bytes(embedded::ptx_for(embedded::images(), cc), name)?,
            Source::Nvrtc if !nvrtc_available() => continue,
            Source::Nvrtc => {
                fallback_note(cc, Source::Nvrtc);
                let arch = format!("compute_{}{}", cc.0, cc.1);
                let mut ptx = nvrtc::kernel_ptx(name, &arch)?.into_bytes();
                ptx.push(0);
                Some(ptx)
            }
        };
        let Some(image) = image else { continue };
        if source == Source::Ptx {
            fallback_note(cc, Source::Ptx);
        }
        use_device(dev)?;
        match load_module(&image, name) {
            Ok(f) => {
                LOADS[source as usize].fetch_add(1, Ordering::Relaxed);
                return Ok(f);
            }
            // The driver refused the build's image (a driver too old for
            // it): the next source may still work.
            Err(e) if source != Source::Nvrtc => failed = Some(e),
            Err(e) => return Err(e),
        }
    }
    // Every setting ends with NVRTC: here it is not available.
    Err(failed.unwrap_or_else(|| {
        CudaError::Unsupported(format!(
            "no kernel {name} for compute capability {}.{}: none built for it (WEFT_KERNEL_SOURCE={}) and NVRTC is not available",
            cc.0,
            cc.1,
            weft_contract::params::WEFT_KERNEL_SOURCE.value()
        ))
    }))
}

/// `name` from `image`, if the image exists and has it.
fn module_bytes(image: Option<&Image>, name: &str) -> CudaResult<Option<Vec<u8>>> {
    match image {
        Some(i) => i.kernel(name),
        None => Ok(None),
    }
}

/// A cubin or NUL-terminated PTX as a module, and its kernel `name`.
fn load_module(image: &[u8], name: &str) -> CudaResult<sys::CUfunction> {
    let mut m: sys::CUmodule = std::ptr::null_mut();
    unsafe {
        check(
            sys::cuModuleLoadData(&mut m, image.as_ptr().cast()),
            "cuModuleLoadData",
        )?
    };
    let cname = std::ffi::CString::new(name).map_err(|_| CudaError::InvalidPtx)?;
    let mut f: sys::CUfunction = std::ptr::null_mut();
    let r = unsafe { sys::cuModuleGetFunction(&mut f, m, cname.as_ptr()) };
    if let Err(e) = check(r, "cuModuleGetFunction") {
        unsafe { sys::cuModuleUnload(m) };
        return Err(e);
    }
    // Load it onto the device now. Under CUDA's lazy loading (the default
    // since 12.2) the first launch would load it, and loading may wait for
    // the context's work in flight: a launch enqueued after a stream wait
    // that the calling thread itself must release later (the cross-host
    // path's wait for `done`, which its progress thread writes only after
    // the call queued the job) then never returns. Asking for an attribute
    // forces the load here, where the caller looks the kernel up.
    let mut regs = 0;
    let r = unsafe {
        sys::cuFuncGetAttribute(
            &mut regs,
            sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_NUM_REGS,
            f,
        )
    };
    if let Err(e) = check(r, "cuFuncGetAttribute (loading the kernel)") {
        unsafe { sys::cuModuleUnload(m) };
        return Err(e);
    }
    Ok(f)
}

/// Says once per process that kernels are compiled here rather than
/// loaded ready-made (the first launches then take seconds).
fn fallback_note(cc: (i32, i32), source: Source) {
    static PTX: Once = Once::new();
    static NVRTC: Once = Once::new();
    let images: Vec<String> = embedded::images().iter().map(Image::label).collect();
    let carried = if images.is_empty() {
        "this library was built without NVRTC".to_string()
    } else {
        format!("this library carries {}", images.join(", "))
    };
    match source {
        Source::Ptx => PTX.call_once(|| {
            super::logger::warn(&format!(
                "no machine code for compute capability {}.{} ({carried}): the driver JIT-compiles the kernels' PTX on first use (cached by the driver)",
                cc.0, cc.1
            ))
        }),
        Source::Nvrtc => NVRTC.call_once(|| {
            super::logger::warn(&format!(
                "compiling kernels for compute capability {}.{} with NVRTC on first use ({carried}; WEFT_KERNEL_SOURCE={})",
                cc.0,
                cc.1,
                weft_contract::params::WEFT_KERNEL_SOURCE.value()
            ))
        }),
        Source::Cubin => {}
    }
}

/// The kernel set's name `n` with a static lifetime (every name a launch
/// uses comes from the set, once).
fn static_name(n: &str) -> Option<&'static str> {
    static NAMES: OnceLock<Vec<String>> = OnceLock::new();
    NAMES
        .get_or_init(|| kernel_set::all().into_iter().map(|k| k.name).collect())
        .iter()
        .find(|k| *k == n)
        .map(String::as_str)
}

/// The reducing ops that have kernels, in [`OpIndex`] order.
const REDUCING_OPS: [&str; 5] = ["sum", "prod", "max", "min", "avg"];
type OpIndex = usize;

/// Every collective's kernel name, looked up once: `func_name` runs on
/// every launch and must not format or search strings there.
struct Names {
    /// By `DataType as usize`, then `OpIndex`.
    reducing: [[Option<&'static str>; REDUCING_OPS.len()]; DataType::ALL.len()],
    /// By element size (1, 2, 4, 8 bytes: index `trailing_zeros`).
    moving: [Option<&'static str>; 4],
}

fn names() -> &'static Names {
    static N: OnceLock<Names> = OnceLock::new();
    N.get_or_init(|| {
        let mut n = Names {
            reducing: [[None; REDUCING_OPS.len()]; DataType::ALL.len()],
            moving: [None; 4],
        };
        for dt in DataType::ALL {
            for (i, o) in REDUCING_OPS.iter().enumerate() {
                n.reducing[dt as usize][i] = static_name(&kernel_set::coll_name(type_name(dt), o));
            }
            n.moving[dt.size().trailing_zeros() as usize] =
                static_name(&kernel_set::move_name(dt.size()));
        }
        n
    })
}

fn type_name(dt: DataType) -> &'static str {
    match dt {
        DataType::I8 => "i8",
        DataType::U8 => "u8",
        DataType::I32 => "i32",
        DataType::U32 => "u32",
        DataType::I64 => "i64",
        DataType::U64 => "u64",
        DataType::F16 => "f16",
        DataType::F32 => "f32",
        DataType::F64 => "f64",
        DataType::Bf16 => "bf16",
        DataType::F8E4M3 => "f8e4m3",
        DataType::F8E5M2 => "f8e5m2",
    }
}

/// The kernel of a collective: a reducing kernel for its type and op when
/// it combines values (`reduces`), else the moving kernel of its element
/// size. None for PreMulSum (staged).
pub(super) fn func_name(dt: DataType, op: Option<ReduceOp>, reduces: bool) -> Option<&'static str> {
    let n = names();
    if !reduces {
        return n.moving[dt.size().trailing_zeros() as usize];
    }
    let o: OpIndex = match op {
        None | Some(ReduceOp::Sum) => 0,
        Some(ReduceOp::Prod) => 1,
        Some(ReduceOp::Max) => 2,
        Some(ReduceOp::Min) => 3,
        Some(ReduceOp::Avg) => 4,
        Some(ReduceOp::PreMulSum(_)) => return None,
    };
    n.reducing[dt as usize][o]
}

/// The point-to-point kernel's name.
pub(super) const P2P_KERNEL: &str = P2P;

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;
    use std::time::Duration;

    /// While one kernel loads (slowly), a launch of another kernel finds
    /// its own at once: the table's lock is not held across a load.
    #[test]
    fn a_slow_load_does_not_stall_lookups_of_other_kernels() {
        static T: Table<u32, u32> = Table::new();
        assert_eq!(T.get_or_load(2, || Ok::<_, ()>(20)), Ok(20));
        let (started_tx, started) = mpsc::channel();
        let (release, release_rx) = mpsc::channel::<()>();
        let slow = std::thread::spawn(move || {
            T.get_or_load(1, || {
                started_tx.send(()).unwrap();
                release_rx.recv().unwrap();
                Ok::<_, ()>(10)
            })
        });
        started.recv().unwrap();
        let (got_tx, got) = mpsc::channel();
        std::thread::spawn(move || got_tx.send(T.get_or_load(2, || Ok::<_, ()>(99))).unwrap());
        let r = got.recv_timeout(Duration::from_secs(5));
        release.send(()).unwrap();
        assert_eq!(r, Ok(Ok(20)), "a lookup waited for another kernel's load");
        assert_eq!(slow.join().unwrap(), Ok(10));
        // Loaded once: a later miss of the same key is a hit.
        assert_eq!(T.get_or_load(1, || Err(())), Ok(10));
    }

    /// Every type and op has its reducing kernel and every size its moving
    /// kernel, in the kernel set the build compiles.
    #[test]
    fn every_collective_names_a_kernel_of_the_set() {
        let ops = [
            ReduceOp::Sum,
            ReduceOp::Prod,
            ReduceOp::Max,
            ReduceOp::Min,
            ReduceOp::Avg,
        ];
        let mut used = std::collections::HashSet::new();
        for dt in DataType::ALL {
            for op in ops {
                used.insert(func_name(dt, Some(op), true).unwrap());
            }
            let mover = func_name(dt, None, false).unwrap();
            assert_eq!(mover, format!("weft_move_{}", dt.size()));
            // A moving collective ignores the op.
            assert_eq!(func_name(dt, Some(ReduceOp::Max), false), Some(mover));
            used.insert(mover);
        }
        assert_eq!(
            func_name(DataType::Bf16, Some(ReduceOp::Sum), true),
            Some("weft_coll_bf16_sum")
        );
        assert_eq!(
            func_name(DataType::F32, Some(ReduceOp::PreMulSum(2.0)), true),
            None
        );
        used.insert(P2P_KERNEL);
        // Each kernel of the set is used by something, and nothing else is.
        let all: std::collections::HashSet<String> =
            kernel_set::all().into_iter().map(|k| k.name).collect();
        let used: std::collections::HashSet<String> = used.into_iter().map(String::from).collect();
        assert_eq!(used, all);
    }
}
