//! The data: element types and reduction operators, and the host
//! reduction kernels.

pub(crate) mod reduce;
pub(crate) mod types;
