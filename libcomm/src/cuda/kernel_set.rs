//! Which CUDA kernels exist and how each is compiled: the one list that the
//! build (`libcomm/build.rs`, which includes this file) compiles ahead of
//! time and the loader (`kernels.rs`) looks kernels up in. Plain data and
//! string building only (no crate imports), so the build script can share it.
//!
//! Every kernel is its own program: `kernels/collectives.cu` plus one
//! instantiation line (see the end of that file). Reducing kernels exist per
//! (type, op), moving kernels per element size (all-gather, broadcast and
//! all-to-all only move bytes), and one point-to-point kernel.

/// The collectives' source (every kernel's program starts with it).
pub const COLLECTIVES: &str = include_str!("../../../kernels/collectives.cu");

/// NVRTC options of every compilation (build time and run time), besides the
/// architecture.
pub const OPTIONS: &[&str] = &["--std=c++17"];

// The architectures and `for_arch`, `arch_option`: the build script's (and
// the tests').
/// Architectures the build carries machine code (cubin) for: Ampere, Hopper,
/// Blackwell (data centre). A cubin for sm_XY runs on compute capability
/// X.Z with Z >= Y (CUDA's binary compatibility), so sm_80 also serves
/// 8.6 - 8.9 and sm_100 serves 10.3.
#[cfg_attr(not(test), allow(dead_code))]
pub const CUBIN_ARCHS: &[u32] = &[80, 90, 100];

/// The architecture of the PTX the build carries: the newest cubin's, which
/// the driver JIT-compiles for any newer GPU (sm_110, sm_120, ...).
#[cfg_attr(not(test), allow(dead_code))]
pub const PTX_ARCH: u32 = 100;

/// Kernel types: (name in the kernel's name, C++ type, oldest architecture).
/// The fp8 conversions are sm_89 instructions.
pub const TYPES: &[(&str, &str, u32)] = &[
    ("i8", "i8", 0),
    ("u8", "u8", 0),
    ("i32", "i32", 0),
    ("u32", "u32", 0),
    ("i64", "i64", 0),
    ("u64", "u64", 0),
    ("f16", "Half", 0),
    ("f32", "float", 0),
    ("f64", "double", 0),
    ("bf16", "Bf16", 0),
    ("f8e4m3", "E4M3", 89),
    ("f8e5m2", "E5M2", 89),
];

/// Reduction ops: (name in the kernel's name, C++ op struct).
pub const OPS: &[(&str, &str)] = &[
    ("sum", "OpSum"),
    ("prod", "OpProd"),
    ("max", "OpMax"),
    ("min", "OpMin"),
    ("avg", "OpAvg"),
];

/// Moving kernels: (element bytes, the unsigned C++ type of that size).
pub const MOVE_SIZES: &[(usize, &str)] = &[(1, "u8"), (2, "u16"), (4, "u32"), (8, "u64")];

/// The point-to-point kernel's name.
pub const P2P: &str = "weft_p2p";

/// One kernel: its name (the symbol in the module) and the line that
/// instantiates it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Kernel {
    pub name: String,
    pub instance: String,
    /// Oldest architecture (e.g. 89) it compiles for; 0: any.
    pub min_arch: u32,
}

/// The reducing kernel's name for a type and op name.
pub fn coll_name(ty: &str, op: &str) -> String {
    format!("weft_coll_{ty}_{op}")
}

/// The moving kernel's name for an element size.
pub fn move_name(bytes: usize) -> String {
    format!("weft_move_{bytes}")
}

/// Every kernel, in a fixed order.
pub fn all() -> Vec<Kernel> {
    let mut v = Vec::new();
    for &(bytes, ty) in MOVE_SIZES {
        v.push(Kernel {
            name: move_name(bytes),
            instance: format!("WEFT_MOVE({bytes}, {ty})"),
            min_arch: 0,
        });
    }
    for &(tn, ty, min_arch) in TYPES {
        for &(on, op) in OPS {
            v.push(Kernel {
                name: coll_name(tn, on),
                instance: format!("WEFT_KERNEL({tn}, {ty}, {on}, {op})"),
                min_arch,
            });
        }
    }
    v.push(Kernel {
        name: P2P.to_string(),
        instance: "WEFT_P2P()".to_string(),
        min_arch: 0,
    });
    v
}

/// The kernels that compile for `arch` (e.g. 80).
#[cfg_attr(not(test), allow(dead_code))]
pub fn for_arch(arch: u32) -> Vec<Kernel> {
    all().into_iter().filter(|k| k.min_arch <= arch).collect()
}

/// The kernel called `name`, if there is one.
pub fn find(name: &str) -> Option<Kernel> {
    all().into_iter().find(|k| k.name == name)
}

/// The program that defines exactly `kernel`: the collectives' source and
/// its instantiation line.
pub fn program(kernel: &Kernel) -> String {
    format!("{COLLECTIVES}\n{}\n", kernel.instance)
}

/// NVRTC's `--gpu-architecture` for machine code (`sm_90`) or PTX
/// (`compute_90`).
#[cfg_attr(not(test), allow(dead_code))]
pub fn arch_option(arch: u32, cubin: bool) -> String {
    let prefix = if cubin { "sm" } else { "compute" };
    format!("--gpu-architecture={prefix}_{arch}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_set_has_each_kernel_once_and_fp8_only_from_sm_89() {
        let all = all();
        let mut names: Vec<&str> = all.iter().map(|k| k.name.as_str()).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), all.len());
        assert_eq!(all.len(), MOVE_SIZES.len() + TYPES.len() * OPS.len() + 1);
        assert_eq!(for_arch(80).len(), all.len() - 2 * OPS.len());
        assert_eq!(for_arch(90).len(), all.len());
        let k = find("weft_coll_bf16_avg").unwrap();
        assert_eq!(k.instance, "WEFT_KERNEL(bf16, Bf16, avg, OpAvg)");
        assert!(program(&k).ends_with("\nWEFT_KERNEL(bf16, Bf16, avg, OpAvg)\n"));
        assert_eq!(find("weft_move_8").unwrap().instance, "WEFT_MOVE(8, u64)");
        assert_eq!(find(P2P).unwrap().instance, "WEFT_P2P()");
        assert!(find("weft_coll_f32_xor").is_none());
        assert_eq!(arch_option(90, true), "--gpu-architecture=sm_90");
        assert_eq!(arch_option(100, false), "--gpu-architecture=compute_100");
        // Every instantiation macro is defined by the source.
        for m in [
            "#define WEFT_KERNEL(",
            "#define WEFT_MOVE(",
            "#define WEFT_P2P(",
        ] {
            assert!(COLLECTIVES.contains(m), "{m}");
        }
    }
}
