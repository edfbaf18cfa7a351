//! The small codes a record carries instead of names: operation, data
//! type, algorithm and outcome. One table per kind, here only, read by both
//! sides (the rank encodes, the sidecar and the in-process exporter decode).
//! Code 0 is "other": a name missing from a table is reported as `other`
//! rather than lost, and a code read from another process that is out of
//! range decodes to it too.

/// Operations: "other", then libcomm's names in their order
/// (`libcomm::observe::OP_NAMES`: `OpKind::name`, then `group`), so an
/// operation's code is its name's index plus one and the two lists cannot
/// drift apart.
pub const OPS: &[&str] = &OPS_TABLE;

const OP_COUNT: usize = libcomm::observe::OP_NAMES.len();
const OPS_TABLE: [&str; OP_COUNT + 1] = {
    let mut out = ["other"; OP_COUNT + 1];
    let mut i = 0;
    while i < OP_COUNT {
        out[i + 1] = libcomm::observe::OP_NAMES[i];
        i += 1;
    }
    out
};

/// Data types (`libcomm::DataType::name`); "" is a group of mixed types.
pub const DTYPES: &[&str] = &[
    "other", "", "int8", "uint8", "int32", "uint32", "int64", "uint64", "half", "float", "double",
    "bfloat16", "f8e4m3", "f8e5m2",
];

/// Algorithms: the host tuner's (`Algo::name`), point-to-point and group,
/// and the device backend's kernels (`cuda/plan.rs`, `cuda/batch.rs`).
pub const ALGOS: &[&str] = &[
    "other",
    "ring",
    "rd",
    "tree",
    "direct",
    "pairwise",
    "ll",
    "ll2",
    "p2p",
    "group",
    "copy",
    "lines",
    "chain",
    "one-shot",
    "two-shot",
    "p2p-eager",
    "p2p-kernel",
    "staged",
    "oneshot",
    "twoshot",
];

/// Outcome codes: 0 success, 1 an error (its text, when the rank wrote
/// one, is in the communicator's slot).
pub const OK: u16 = 0;
pub const ERROR: u16 = 1;

fn code(table: &[&str], name: &str) -> u8 {
    table.iter().position(|n| *n == name).unwrap_or(0) as u8
}

fn name(table: &'static [&'static str], code: u8) -> &'static str {
    table.get(code as usize).copied().unwrap_or(table[0])
}

/// The code of `libcomm::observe::OP_NAMES[index]` (what libcomm's
/// `OpName` holds), without a lookup: [`OPS`] is that list behind "other".
pub const fn op_code_at(index: usize) -> u8 {
    (index + 1) as u8
}

pub fn op_code(n: &str) -> u8 {
    code(OPS, n)
}
pub fn op_name(c: u8) -> &'static str {
    name(OPS, c)
}
pub fn dtype_code(n: &str) -> u8 {
    code(DTYPES, n)
}
pub fn dtype_name(c: u8) -> &'static str {
    name(DTYPES, c)
}
pub fn algo_code(n: &str) -> u8 {
    code(ALGOS, n)
}
pub fn algo_name(c: u8) -> &'static str {
    name(ALGOS, c)
}

#[cfg(test)]
mod tests {
    use super::*;
    use libcomm::DataType;

    /// Every name libcomm reports has its own code, and codes round-trip.
    #[test]
    fn libcomm_names_have_codes() {
        for t in DataType::ALL {
            let c = dtype_code(t.name());
            assert_ne!(c, 0, "{}", t.name());
            assert_eq!(dtype_name(c), t.name());
        }
        // Every name libcomm reports an operation by (OpKind's and group).
        for (i, n) in libcomm::observe::OP_NAMES.into_iter().enumerate() {
            assert_ne!(op_code(n), 0, "{n}");
            assert_eq!(op_name(op_code(n)), n);
            assert_eq!(op_code_at(i), op_code(n), "{n}");
        }
        for a in weft_contract::params::CUDA_ALGOS {
            assert_ne!(algo_code(a), 0, "{a}");
        }
        for a in [
            libcomm::Algo::Ring,
            libcomm::Algo::RecursiveDoubling,
            libcomm::Algo::Tree,
            libcomm::Algo::Direct,
            libcomm::Algo::Pairwise,
            libcomm::Algo::Ll,
            libcomm::Algo::Ll2,
        ] {
            assert_eq!(algo_name(algo_code(a.name())), a.name());
        }
        assert_eq!(op_name(200), "other");
        assert_eq!(algo_code("no-such-kernel"), 0);
        // Codes fit the record's byte.
        assert!(OPS.len() < 256 && DTYPES.len() < 256 && ALGOS.len() < 256);
    }
}
