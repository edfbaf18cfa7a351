//! Deterministic random inputs and an independent reference.
//!
//! Element `i` of rank `r`'s input for case `c` is a pure function of
//! `(seed, c, r, i)`, so every rank can compute every other rank's input and
//! check its own output without exchanging anything. The reference works in
//! i128 (wrapping to the type's width) and f64, never through libcomm's code.

use libcomm::{DataType, F8E4M3, F8E5M2, ReduceOp};

/// One element's value: integers as i128 (already wrapped), floats as f64.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Val {
    I(i128),
    F(f64),
}

pub fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = x;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The seed of rank `rank`'s input in case `case`.
pub fn input_seed(base: u64, case: u64, rank: usize) -> u64 {
    splitmix(
        base ^ splitmix(
            case.wrapping_mul(1_000_003) ^ (rank as u64).wrapping_mul(0xA24B_AED4_963E_E407),
        ),
    )
}

/// Per-element randomness: one multiply-xorshift round over a well-mixed
/// seed (cheap: the reference evaluates it n times per checked element).
#[inline]
fn elem_rand(seed: u64, i: usize) -> u64 {
    let x =
        (seed ^ (i as u64).wrapping_mul(0xD1B5_4A32_D192_ED03)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    x ^ (x >> 31) ^ (x >> 17)
}

/// Wraps an integer to the type's width (two's complement, sign-extended).
pub fn wrap(dt: DataType, v: i128) -> i128 {
    match dt {
        DataType::I8 => v as i8 as i128,
        DataType::U8 => v as u8 as i128,
        DataType::I32 => v as i32 as i128,
        DataType::U32 => v as u32 as i128,
        DataType::I64 => v as i64 as i128,
        DataType::U64 => v as u64 as i128,
        _ => unreachable!("not an integer type"),
    }
}

pub fn encode(dt: DataType, v: Val, out: &mut [u8]) {
    match (dt, v) {
        (DataType::I8 | DataType::U8, Val::I(x)) => out[0] = x as u8,
        (DataType::I32 | DataType::U32, Val::I(x)) => {
            out.copy_from_slice(&(x as u32).to_ne_bytes())
        }
        (DataType::I64 | DataType::U64, Val::I(x)) => {
            out.copy_from_slice(&(x as u64).to_ne_bytes())
        }
        (DataType::F16, Val::F(x)) => out.copy_from_slice(&half::f16::from_f64(x).to_ne_bytes()),
        (DataType::Bf16, Val::F(x)) => out.copy_from_slice(&half::bf16::from_f64(x).to_ne_bytes()),
        (DataType::F32, Val::F(x)) => out.copy_from_slice(&(x as f32).to_ne_bytes()),
        (DataType::F64, Val::F(x)) => out.copy_from_slice(&x.to_ne_bytes()),
        (DataType::F8E4M3, Val::F(x)) => out[0] = F8E4M3::from_f32(x as f32).0,
        (DataType::F8E5M2, Val::F(x)) => out[0] = F8E5M2::from_f32(x as f32).0,
        _ => unreachable!("value kind does not match {dt}"),
    }
}

pub fn decode(dt: DataType, b: &[u8]) -> Val {
    match dt {
        DataType::I8 => Val::I(b[0] as i8 as i128),
        DataType::U8 => Val::I(b[0] as i128),
        DataType::I32 => Val::I(i32::from_ne_bytes(b.try_into().unwrap()) as i128),
        DataType::U32 => Val::I(u32::from_ne_bytes(b.try_into().unwrap()) as i128),
        DataType::I64 => Val::I(i64::from_ne_bytes(b.try_into().unwrap()) as i128),
        DataType::U64 => Val::I(u64::from_ne_bytes(b.try_into().unwrap()) as i128),
        DataType::F16 => Val::F(half::f16::from_ne_bytes(b.try_into().unwrap()).to_f64()),
        DataType::Bf16 => Val::F(half::bf16::from_ne_bytes(b.try_into().unwrap()).to_f64()),
        DataType::F32 => Val::F(f32::from_ne_bytes(b.try_into().unwrap()) as f64),
        DataType::F64 => Val::F(f64::from_ne_bytes(b.try_into().unwrap())),
        DataType::F8E4M3 => Val::F(F8E4M3(b[0]).to_f32() as f64),
        DataType::F8E5M2 => Val::F(F8E5M2(b[0]).to_f32() as f64),
    }
}

/// Mantissa bits of a float type.
fn mantissa_bits(dt: DataType) -> u32 {
    match dt {
        DataType::F16 => 10,
        DataType::Bf16 => 7,
        DataType::F32 => 23,
        DataType::F64 => 52,
        DataType::F8E4M3 => 3,
        DataType::F8E5M2 => 2,
        _ => 0,
    }
}

/// Element `i` of an input with seed `seed`, for reduction `op`. Floats are
/// built exactly representable in their type (random sign and mantissa bits,
/// magnitude in [1/8, 2), or [1/2, 2) for products so they neither overflow
/// nor vanish), so no rounding hides in the inputs. Never zero.
pub fn value(dt: DataType, op: Option<ReduceOp>, seed: u64, i: usize) -> Val {
    let r = elem_rand(seed, i);
    if !dt.is_float() {
        let v = wrap(dt, r as i128);
        return Val::I(if v == 0 { 1 } else { v });
    }
    // Sign, a small exponent and the type's mantissa bits, assembled as f64
    // bits: exactly representable in `dt`, and cheap (this runs n times per
    // checked element).
    let mb = mantissa_bits(dt);
    let e = match op {
        Some(ReduceOp::Prod) => (r >> 8) & 1,
        _ => (r >> 8) & 3,
    };
    let mantissa = (r >> (64 - mb)) << (52 - mb);
    let bits = ((r & 1) << 63) | ((1023 - e) << 52) | mantissa;
    Val::F(f64::from_bits(bits))
}

/// The scalar each rank passes to `PreMulSum` in the tests.
pub fn premul_scalar(dt: DataType, rank: usize) -> f64 {
    if dt.is_float() {
        1.0 + 0.25 * rank as f64
    } else {
        rank as f64 + 1.0
    }
}

/// Expected result of reducing the `n` ranks' values `val(r)` with `op`,
/// and the tolerance allowed for floats (0 for exact results).
pub fn reduce_ref(dt: DataType, op: ReduceOp, n: usize, val: impl Fn(usize) -> Val) -> (Val, f64) {
    let premul = matches!(op, ReduceOp::PreMulSum(_));
    if !dt.is_float() {
        let get = |r: usize| match val(r) {
            Val::I(x) if premul => wrap(dt, x.wrapping_mul(premul_scalar(dt, r) as i128)),
            Val::I(x) => x,
            Val::F(_) => unreachable!(),
        };
        let mut acc = get(0);
        for r in 1..n {
            let x = get(r);
            acc = match op {
                ReduceOp::Sum | ReduceOp::PreMulSum(_) | ReduceOp::Avg => {
                    wrap(dt, acc.wrapping_add(x))
                }
                ReduceOp::Prod => wrap(dt, acc.wrapping_mul(x)),
                ReduceOp::Max => acc.max(x),
                ReduceOp::Min => acc.min(x),
            };
        }
        if op == ReduceOp::Avg {
            acc /= n as i128;
        }
        return (Val::I(acc), 0.0);
    }
    let get = |r: usize| match val(r) {
        Val::F(x) if premul => x * premul_scalar(dt, r),
        Val::F(x) => x,
        Val::I(_) => unreachable!(),
    };
    let (mut sum, mut abs_sum, mut prod) = (0.0f64, 0.0f64, 1.0f64);
    let (mut lo, mut hi) = (f64::MAX, f64::MIN);
    for r in 0..n {
        let x = get(r);
        sum += x;
        abs_sum += x.abs();
        prod *= x;
        lo = lo.min(x);
        hi = hi.max(x);
    }
    let eps = dt.epsilon();
    // Every combine and the final scaling round once in the type: (n + 2)
    // roundings of at most eps relative to the running magnitude.
    let c = (n + 2) as f64;
    let tiny = match dt {
        DataType::F8E4M3 => 2f64.powi(-9),
        DataType::F8E5M2 => 2f64.powi(-16),
        DataType::F16 => 2f64.powi(-24),
        _ => 0.0,
    } * c;
    match op {
        ReduceOp::Sum | ReduceOp::PreMulSum(_) => (Val::F(sum), c * eps * abs_sum + tiny),
        ReduceOp::Avg => {
            let avg = sum / n as f64;
            (
                Val::F(avg),
                c * eps * abs_sum / n as f64 + eps * avg.abs() + tiny,
            )
        }
        ReduceOp::Prod => (Val::F(prod), c * eps * prod.abs() + tiny),
        ReduceOp::Max => (Val::F(hi), 0.0),
        ReduceOp::Min => (Val::F(lo), 0.0),
    }
}

/// Whether `got` matches `want` within `tol`.
pub fn matches(got: Val, want: Val, tol: f64) -> bool {
    match (got, want) {
        (Val::I(a), Val::I(b)) => a == b,
        (Val::F(a), Val::F(b)) => !a.is_nan() && (a - b).abs() <= tol,
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_are_never_zero_and_deterministic() {
        for dt in DataType::ALL {
            for i in 0..2000 {
                let v = value(dt, Some(ReduceOp::Sum), 42, i);
                assert_eq!(v, value(dt, Some(ReduceOp::Sum), 42, i));
                match v {
                    Val::I(x) => assert_ne!(x, 0),
                    Val::F(x) => assert_ne!(x, 0.0, "{dt} element {i}"),
                }
            }
        }
    }

    #[test]
    fn integer_reference_wraps_like_the_type() {
        let v2 = |a, b| move |r: usize| if r == 0 { Val::I(a) } else { Val::I(b) };
        let (v, _) = reduce_ref(DataType::I8, ReduceOp::Sum, 2, v2(100, 100));
        assert_eq!(v, Val::I(-56));
        let (v, _) = reduce_ref(DataType::U8, ReduceOp::Avg, 2, v2(200, 100));
        assert_eq!(v, Val::I(22)); // (300 mod 256) / 2
        let (v, _) = reduce_ref(DataType::I32, ReduceOp::PreMulSum(0.0), 2, v2(3, 5));
        assert_eq!(v, Val::I(3 + 10));
    }

    #[test]
    fn encode_decode_round_trip() {
        for dt in DataType::ALL {
            let v = value(dt, None, 7, 3);
            let mut b = vec![0u8; dt.size()];
            encode(dt, v, &mut b);
            assert_eq!(decode(dt, &b), v, "{dt}");
        }
    }
}
