//! Data types and reduction operations, with the numeric values of NCCL's
//! `ncclDataType_t` and `ncclRedOp_t` so the C ABI can cast them directly.

use crate::error::{Error, Result};

/// Element types of collectives (values equal NCCL's `ncclDataType_t`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(i32)]
pub enum DataType {
    I8 = 0,
    U8 = 1,
    I32 = 2,
    U32 = 3,
    I64 = 4,
    U64 = 5,
    F16 = 6,
    F32 = 7,
    F64 = 8,
    Bf16 = 9,
    F8E4M3 = 10,
    F8E5M2 = 11,
}

impl DataType {
    pub const ALL: [DataType; 12] = [
        DataType::I8,
        DataType::U8,
        DataType::I32,
        DataType::U32,
        DataType::I64,
        DataType::U64,
        DataType::F16,
        DataType::F32,
        DataType::F64,
        DataType::Bf16,
        DataType::F8E4M3,
        DataType::F8E5M2,
    ];

    pub fn size(self) -> usize {
        match self {
            DataType::I8 | DataType::U8 | DataType::F8E4M3 | DataType::F8E5M2 => 1,
            DataType::F16 | DataType::Bf16 => 2,
            DataType::I32 | DataType::U32 | DataType::F32 => 4,
            DataType::I64 | DataType::U64 | DataType::F64 => 8,
        }
    }

    pub fn is_float(self) -> bool {
        matches!(
            self,
            DataType::F16
                | DataType::F32
                | DataType::F64
                | DataType::Bf16
                | DataType::F8E4M3
                | DataType::F8E5M2
        )
    }

    /// Units in the last place relative to 1.0 (machine epsilon); 0 for integers.
    pub fn epsilon(self) -> f64 {
        match self {
            DataType::F16 => 9.765625e-4,
            DataType::Bf16 => 7.8125e-3,
            DataType::F32 => f32::EPSILON as f64,
            DataType::F64 => f64::EPSILON,
            DataType::F8E4M3 => 0.125,
            DataType::F8E5M2 => 0.25,
            _ => 0.0,
        }
    }

    /// nccl-tests' short names, used by `weft bench --dtype`.
    pub fn name(self) -> &'static str {
        match self {
            DataType::I8 => "int8",
            DataType::U8 => "uint8",
            DataType::I32 => "int32",
            DataType::U32 => "uint32",
            DataType::I64 => "int64",
            DataType::U64 => "uint64",
            DataType::F16 => "half",
            DataType::F32 => "float",
            DataType::F64 => "double",
            DataType::Bf16 => "bfloat16",
            DataType::F8E4M3 => "f8e4m3",
            DataType::F8E5M2 => "f8e5m2",
        }
    }

    pub fn from_raw(v: i32) -> Result<DataType> {
        DataType::ALL
            .iter()
            .copied()
            .find(|d| *d as i32 == v)
            .ok_or_else(|| Error::arg(format!("unknown data type {v} (valid: 0..=11)")))
    }
}

impl std::str::FromStr for DataType {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        let alias = match s {
            "i8" | "char" => "int8",
            "u8" => "uint8",
            "i32" | "int" => "int32",
            "u32" => "uint32",
            "i64" => "int64",
            "u64" => "uint64",
            "f16" | "fp16" => "half",
            "f32" | "fp32" => "float",
            "f64" | "fp64" => "double",
            "bf16" => "bfloat16",
            "e4m3" | "fp8e4m3" => "f8e4m3",
            "e5m2" | "fp8e5m2" => "f8e5m2",
            other => other,
        };
        DataType::ALL
            .iter()
            .copied()
            .find(|d| d.name() == alias)
            .ok_or_else(|| Error::arg(format!("unknown data type '{s}'")))
    }
}

impl std::fmt::Display for DataType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Reduction operations. `PreMulSum` multiplies each rank's input by that
/// rank's own scalar before summing (NCCL's `ncclRedOpCreatePreMulSum`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ReduceOp {
    Sum,
    Prod,
    Max,
    Min,
    Avg,
    PreMulSum(f64),
}

impl ReduceOp {
    pub const BUILTIN: [ReduceOp; 5] = [
        ReduceOp::Sum,
        ReduceOp::Prod,
        ReduceOp::Max,
        ReduceOp::Min,
        ReduceOp::Avg,
    ];

    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Prod => "prod",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
            ReduceOp::Avg => "avg",
            ReduceOp::PreMulSum(_) => "premulsum",
        }
    }

    /// The elementwise combine step used between ranks (avg and pre-mul-sum
    /// combine by summing; their scaling happens once, before or after).
    pub(crate) fn combine(self) -> Combine {
        match self {
            ReduceOp::Sum | ReduceOp::Avg | ReduceOp::PreMulSum(_) => Combine::Sum,
            ReduceOp::Prod => Combine::Prod,
            ReduceOp::Max => Combine::Max,
            ReduceOp::Min => Combine::Min,
        }
    }
}

impl std::str::FromStr for ReduceOp {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "sum" => Ok(ReduceOp::Sum),
            "prod" => Ok(ReduceOp::Prod),
            "max" => Ok(ReduceOp::Max),
            "min" => Ok(ReduceOp::Min),
            "avg" => Ok(ReduceOp::Avg),
            _ => match s.strip_prefix("premulsum:") {
                Some(v) => v
                    .parse()
                    .map(ReduceOp::PreMulSum)
                    .map_err(|_| Error::arg(format!("bad premulsum scalar in '{s}'"))),
                None => Err(Error::arg(format!(
                    "unknown reduction op '{s}' (sum, prod, max, min, avg, premulsum:X)"
                ))),
            },
        }
    }
}

impl std::fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The binary operation applied between two ranks' values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Combine {
    Sum,
    Prod,
    Max,
    Min,
}

/// 8-bit float, 4 exponent bits, 3 mantissa bits, no infinities ("fn" variant, as on H100).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[repr(transparent)]
pub struct F8E4M3(pub u8);

/// 8-bit float, 5 exponent bits, 2 mantissa bits, IEEE-like (has infinities).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[repr(transparent)]
pub struct F8E5M2(pub u8);

impl F8E4M3 {
    pub fn from_f32(x: f32) -> Self {
        F8E4M3(fp8_encode(x, 3, 7, 448.0, 0x7e, 0x7f))
    }
    pub fn to_f32(self) -> f32 {
        fp8_decode(self.0, 3, 7, false)
    }
}

impl F8E5M2 {
    pub fn from_f32(x: f32) -> Self {
        F8E5M2(fp8_encode(x, 2, 15, 57344.0, 0x7b, 0x7f))
    }
    pub fn to_f32(self) -> f32 {
        fp8_decode(self.0, 2, 15, true)
    }
}

/// 2^e as f32, exactly, for normal exponents (-126..=127).
#[inline]
fn pow2(e: i32) -> f32 {
    f32::from_bits(((e + 127) as u32) << 23)
}

/// Round-to-nearest-even encoding, saturating to the largest finite value
/// (NVIDIA's `__NV_SATFINITE` behaviour), NaN kept as NaN. Bit arithmetic
/// only (it runs per element in fp8 reductions).
#[inline]
fn fp8_encode(x: f32, man_bits: u32, bias: i32, max: f32, max_code: u8, nan: u8) -> u8 {
    if x.is_nan() {
        return nan;
    }
    let sign = if x.is_sign_negative() { 0x80u8 } else { 0 };
    let a = x.abs();
    if a >= max {
        return sign | max_code;
    }
    let min_normal_exp = 1 - bias;
    // The f32 exponent (f32 subnormals and zero land below the minimum).
    let e = (((a.to_bits() >> 23) as i32) - 127).max(min_normal_exp);
    // Quantum at this exponent; subnormals share the minimum normal's quantum.
    let q = (a / pow2(e - man_bits as i32)).round_ties_even() as u32;
    // q counts quanta: for normals it lies in [2^m, 2^(m+1)], for subnormals below 2^m.
    let code = if e == min_normal_exp && q < (1 << man_bits) {
        q
    } else {
        let (e, q) = if q >= (2 << man_bits) {
            (e + 1, q >> 1)
        } else {
            (e, q)
        };
        (((e + bias) as u32) << man_bits) | (q & ((1 << man_bits) - 1))
    };
    if code > max_code as u32 {
        sign | max_code
    } else {
        sign | code as u8
    }
}

#[inline]
fn fp8_decode(v: u8, man_bits: u32, bias: i32, ieee: bool) -> f32 {
    let negative = v & 0x80 != 0;
    let exp_bits = 7 - man_bits;
    let e = ((v & 0x7f) >> man_bits) as i32;
    let m = (v & ((1 << man_bits) - 1)) as u32;
    let max_e = (1 << exp_bits) - 1;
    let mag = if ieee && e == max_e {
        if m == 0 { f32::INFINITY } else { f32::NAN }
    } else if !ieee && e == max_e && m == (1 << man_bits) - 1 {
        f32::NAN
    } else if e == 0 {
        m as f32 * pow2(1 - bias - man_bits as i32)
    } else {
        f32::from_bits((((e - bias + 127) as u32) << 23) | (m << (23 - man_bits)))
    };
    if negative { -mag } else { mag }
}

/// Element types usable with the typed Rust API.
///
/// # Safety
/// `DTYPE` must describe the in-memory representation of `Self` exactly.
pub unsafe trait Element: Copy + Send + Sync + 'static {
    const DTYPE: DataType;
}

macro_rules! element {
    ($($t:ty => $d:ident),* $(,)?) => {
        $(unsafe impl Element for $t { const DTYPE: DataType = DataType::$d; })*
    };
}
element!(i8 => I8, u8 => U8, i32 => I32, u32 => U32, i64 => I64, u64 => U64,
    half::f16 => F16, f32 => F32, f64 => F64, half::bf16 => Bf16,
    F8E4M3 => F8E4M3, F8E5M2 => F8E5M2);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fp8_round_trips_every_code() {
        for v in 0..=255u8 {
            let a = F8E4M3(v).to_f32();
            if !a.is_nan() {
                assert_eq!(F8E4M3::from_f32(a).0, v, "e4m3 code {v:#x} -> {a}");
            }
            let b = F8E5M2(v).to_f32();
            if !b.is_nan() && !b.is_infinite() {
                assert_eq!(F8E5M2::from_f32(b).0, v, "e5m2 code {v:#x} -> {b}");
            }
        }
    }

    #[test]
    fn fp8_known_values() {
        assert_eq!(F8E4M3(0x7e).to_f32(), 448.0);
        assert_eq!(F8E5M2(0x7b).to_f32(), 57344.0);
        assert_eq!(F8E4M3::from_f32(1000.0).0, 0x7e); // saturates
        assert_eq!(F8E4M3::from_f32(-1000.0).0, 0xfe);
        assert_eq!(F8E4M3::from_f32(1.0).0, 0x38);
        assert_eq!(F8E5M2::from_f32(1.0).0, 0x3c);
        assert_eq!(F8E4M3(0x01).to_f32(), 2f32.powi(-9)); // smallest subnormal
        // 1.0625 is halfway between 1.0 and 1.125: ties to even (1.0).
        assert_eq!(F8E4M3::from_f32(1.0625).0, 0x38);
        assert!(F8E4M3::from_f32(f32::NAN).to_f32().is_nan());
    }

    /// The encoder picks the nearest representable value (ties to the even
    /// code), saturating: checked against a brute-force search.
    #[test]
    fn fp8_encode_is_nearest_ties_to_even() {
        fn brute(x: f32, decode: fn(u8) -> f32, max_code: u8) -> u8 {
            let sign = if x.is_sign_negative() { 0x80 } else { 0 };
            let a = x.abs();
            let mut best = 0u8;
            for c in 0..=max_code {
                let (d, db) = ((decode(c) - a).abs(), (decode(best) - a).abs());
                if d < db || (d == db && c % 2 == 0 && best % 2 == 1) {
                    best = c;
                }
            }
            sign | best
        }
        let mut s = 0x1234_5678u32;
        for i in 0..20000 {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            // Magnitudes from 2^-20 to 2^17, both signs, plus exact midpoints.
            let x = f32::from_bits((s & 0x807f_ffff) | ((107 + (s >> 23) % 37) << 23));
            let c = (s % 0x7e) as u8; // c and c + 1 both finite
            let mid = (F8E4M3(c).to_f32() + F8E4M3(c + 1).to_f32()) / 2.0;
            let x = if i % 7 == 0 { mid } else { x };
            assert_eq!(
                F8E4M3::from_f32(x).0,
                brute(x, |c| F8E4M3(c).to_f32(), 0x7e),
                "e4m3 {x:e}"
            );
            assert_eq!(
                F8E5M2::from_f32(x).0,
                brute(x, |c| F8E5M2(c).to_f32(), 0x7b),
                "e5m2 {x:e}"
            );
        }
    }

    #[test]
    fn names_parse_back() {
        for d in DataType::ALL {
            assert_eq!(d.name().parse::<DataType>().unwrap(), d);
            assert_eq!(DataType::from_raw(d as i32).unwrap(), d);
        }
        assert!(DataType::from_raw(12).is_err());
        for op in ReduceOp::BUILTIN {
            assert_eq!(op.name().parse::<ReduceOp>().unwrap(), op);
        }
    }
}
