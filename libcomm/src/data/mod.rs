//! The data: element types and reduction operators (`types.rs`: NCCL's
//! numeric values, fp8), and the host reduction kernels for every type and
//! operator (`reduce.rs`).

pub(crate) mod reduce;
pub(crate) mod types;
