//! `--check`: deterministic pseudo-random inputs that any rank can regenerate
//! for any other rank, and an independent host reference to compare results with.
//!
//! Every input element is a function of (seed, rank, index), so a rank checks
//! its output by recomputing what every peer sent, without any communication.
//! Data-movement collectives (broadcast, all-gather, all-to-all, send/recv)
//! carry random bit patterns and are compared bit for bit. Reductions carry
//! small non-zero integers (or ±1/2, ±1, ±2 for `prod`), exact in every type,
//! and are compared with the expected value computed in `f64` (floats, with a
//! tolerance bounded by the type's epsilon and the number of ranks) or with
//! wrapping integer arithmetic in the element's width (integers, exact).

use half::{bf16, f16};
use libcomm::{DataType, F8E4M3, F8E5M2, ReduceOp};

/// One element's value, exact for its data type.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Val {
    Int(i128),
    Float(f64),
}

/// Inputs and references for one (size, placement) check.
#[derive(Debug, Clone, Copy)]
pub struct Data {
    pub dtype: DataType,
    /// `Some` for reductions: values are chosen so the op stays exact.
    pub op: Option<ReduceOp>,
    pub nranks: usize,
    pub seed: u64,
}

fn mix(mut z: u64) -> u64 {
    // splitmix64 finaliser
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn is_signed(dt: DataType) -> bool {
    matches!(dt, DataType::I8 | DataType::I32 | DataType::I64)
}

fn int_bits(dt: DataType) -> u32 {
    (dt.size() * 8) as u32
}

/// Reduces `v` modulo 2^bits into the type's range (two's complement wrapping).
pub fn wrap(dt: DataType, v: i128) -> i128 {
    let bits = int_bits(dt);
    let m = v.rem_euclid(1i128 << bits);
    if is_signed(dt) && m >= 1i128 << (bits - 1) {
        m - (1i128 << bits)
    } else {
        m
    }
}

/// Reads element `i` of `buf` (native byte order).
pub fn read(dt: DataType, buf: &[u8], i: usize) -> Val {
    let s = dt.size();
    let b = &buf[i * s..(i + 1) * s];
    let a = |n: usize| -> [u8; 8] {
        let mut x = [0u8; 8];
        x[..n].copy_from_slice(&b[..n]);
        x
    };
    match dt {
        DataType::I8 => Val::Int(b[0] as i8 as i128),
        DataType::U8 => Val::Int(b[0] as i128),
        DataType::I32 => Val::Int(i32::from_ne_bytes(b.try_into().unwrap()) as i128),
        DataType::U32 => Val::Int(u32::from_ne_bytes(b.try_into().unwrap()) as i128),
        DataType::I64 => Val::Int(i64::from_ne_bytes(b.try_into().unwrap()) as i128),
        DataType::U64 => Val::Int(u64::from_ne_bytes(a(8)) as i128),
        DataType::F16 => Val::Float(f16::from_ne_bytes([b[0], b[1]]).to_f64()),
        DataType::Bf16 => Val::Float(bf16::from_ne_bytes([b[0], b[1]]).to_f64()),
        DataType::F32 => Val::Float(f32::from_ne_bytes(b.try_into().unwrap()) as f64),
        DataType::F64 => Val::Float(f64::from_ne_bytes(b.try_into().unwrap())),
        DataType::F8E4M3 => Val::Float(F8E4M3(b[0]).to_f32() as f64),
        DataType::F8E5M2 => Val::Float(F8E5M2(b[0]).to_f32() as f64),
    }
}

/// Writes `v` (exactly representable, or rounded to nearest) into element `i`.
pub fn write(dt: DataType, buf: &mut [u8], i: usize, v: Val) {
    let s = dt.size();
    let out = &mut buf[i * s..(i + 1) * s];
    let (iv, fv) = match v {
        Val::Int(x) => (x, x as f64),
        Val::Float(x) => (x as i128, x),
    };
    match dt {
        DataType::I8 | DataType::U8 => out[0] = iv as u8,
        DataType::I32 | DataType::U32 => out.copy_from_slice(&(iv as u32).to_ne_bytes()),
        DataType::I64 | DataType::U64 => out.copy_from_slice(&(iv as u64).to_ne_bytes()),
        DataType::F16 => out.copy_from_slice(&f16::from_f64(fv).to_ne_bytes()),
        DataType::Bf16 => out.copy_from_slice(&bf16::from_f64(fv).to_ne_bytes()),
        DataType::F32 => out.copy_from_slice(&(fv as f32).to_ne_bytes()),
        DataType::F64 => out.copy_from_slice(&fv.to_ne_bytes()),
        DataType::F8E4M3 => out[0] = F8E4M3::from_f32(fv as f32).0,
        DataType::F8E5M2 => out[0] = F8E5M2::from_f32(fv as f32).0,
    }
}

impl Data {
    fn bits(&self, rank: usize, idx: usize) -> u64 {
        mix(self.seed ^ mix((rank as u64) << 40 ^ idx as u64))
    }

    /// The value rank `rank` contributes at element `idx` of its input.
    pub fn input(&self, rank: usize, idx: usize) -> Val {
        let r = self.bits(rank, idx);
        let prod = matches!(self.op, Some(ReduceOp::Prod));
        if self.dtype.is_float() {
            if prod {
                // ±0.5, ±1, ±2: products stay exact powers of two.
                let mag = [0.5, 1.0, 2.0][(r % 3) as usize];
                Val::Float(if r & 8 != 0 { -mag } else { mag })
            } else {
                // -4..=4 without 0.
                let k = (r % 8) as i64 - 4;
                Val::Float(if k >= 0 { k + 1 } else { k } as f64)
            }
        } else if prod {
            let mag = 1 + (r % 2) as i128;
            Val::Int(if is_signed(self.dtype) && r & 8 != 0 {
                -mag
            } else {
                mag
            })
        } else if is_signed(self.dtype) {
            let k = (r % 8) as i128 - 4;
            Val::Int(if k >= 0 { k + 1 } else { k })
        } else {
            Val::Int(1 + (r % 8) as i128)
        }
    }

    /// Writes `rank`'s input elements `first..first + n` into `dst` (`n * size` bytes).
    pub fn fill(&self, rank: usize, first: usize, dst: &mut [u8]) {
        let s = self.dtype.size();
        let n = dst.len() / s;
        if self.op.is_some() {
            for j in 0..n {
                write(self.dtype, dst, j, self.input(rank, first + j));
            }
        } else {
            for (j, e) in dst.chunks_exact_mut(s).enumerate() {
                let b = self.bits(rank, first + j).to_ne_bytes();
                e.copy_from_slice(&b[..s]);
            }
        }
    }

    /// Fills a receive buffer with a pattern no correct result is likely to
    /// match, so a collective that writes nothing is caught.
    pub fn fill_sentinel(&self, dst: &mut [u8]) {
        let poison = Data {
            op: None,
            seed: !self.seed,
            ..*self
        };
        poison.fill(usize::MAX >> 1, 0, dst);
    }

    /// Counts elements of `got` that differ from the bits rank `src(j).0` put at
    /// its index `src(j).1` (data movement: exact comparison).
    pub fn wrong_copies(&self, got: &[u8], src: impl Fn(usize) -> (usize, usize)) -> u64 {
        let s = self.dtype.size();
        let mut wrong = 0;
        for (j, e) in got.chunks_exact(s).enumerate() {
            let (rank, idx) = src(j);
            let b = self.bits(rank, idx).to_ne_bytes();
            if e != &b[..s] {
                wrong += 1;
            }
        }
        wrong
    }

    /// The reference result of reducing every rank's element `idx`.
    pub fn expected(&self, idx: usize) -> (Val, f64) {
        let op = self.op.unwrap_or(ReduceOp::Sum);
        let n = self.nranks;
        let vals = (0..n).map(|r| self.input(r, idx));
        if self.dtype.is_float() {
            let xs: Vec<f64> = vals
                .map(|v| match v {
                    Val::Float(x) => x,
                    Val::Int(x) => x as f64,
                })
                .collect();
            let abs_sum: f64 = xs.iter().map(|x| x.abs()).sum();
            let eps = self.dtype.epsilon();
            let steps = (n + 1) as f64;
            let (v, tol) = match op {
                ReduceOp::Prod => {
                    let p: f64 = xs.iter().product();
                    (p, eps * steps * p.abs())
                }
                ReduceOp::Max => (xs.iter().cloned().fold(f64::MIN, f64::max), 0.0),
                ReduceOp::Min => (xs.iter().cloned().fold(f64::MAX, f64::min), 0.0),
                ReduceOp::Avg => {
                    let a = xs.iter().sum::<f64>() / n as f64;
                    (a, eps * steps * abs_sum / n as f64 + 2.0 * eps * a.abs())
                }
                _ => (xs.iter().sum(), eps * steps * abs_sum),
            };
            (Val::Float(v), tol)
        } else {
            let xs: Vec<i128> = vals
                .map(|v| match v {
                    Val::Int(x) => x,
                    Val::Float(x) => x as i128,
                })
                .collect();
            let dt = self.dtype;
            let v = match op {
                ReduceOp::Prod => xs.iter().fold(1i128, |a, &x| wrap(dt, a * x)),
                ReduceOp::Max => *xs.iter().max().unwrap(),
                ReduceOp::Min => *xs.iter().min().unwrap(),
                // libcomm (like NCCL) sums with wrapping, then divides by n.
                ReduceOp::Avg => wrap(dt, xs.iter().sum()) / n as i128,
                _ => wrap(dt, xs.iter().sum()),
            };
            (Val::Int(v), 0.0)
        }
    }

    /// Counts elements of `got` that differ from the reduction of every
    /// rank's input element `idx(j)`.
    pub fn wrong_reductions(&self, got: &[u8], idx: impl Fn(usize) -> usize) -> u64 {
        let n = got.len() / self.dtype.size();
        let mut wrong = 0;
        for j in 0..n {
            let (want, tol) = self.expected(idx(j));
            let ok = match (read(self.dtype, got, j), want) {
                (Val::Int(g), Val::Int(w)) => g == w,
                (Val::Float(g), Val::Float(w)) => (g - w).abs() <= tol || g == w,
                _ => false,
            };
            if !ok {
                wrong += 1;
            }
        }
        wrong
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(dt: DataType, op: Option<ReduceOp>) -> Data {
        Data {
            dtype: dt,
            op,
            nranks: 4,
            seed: 7,
        }
    }

    #[test]
    fn inputs_are_never_zero_and_round_trip() {
        for dt in DataType::ALL {
            for op in ReduceOp::BUILTIN {
                let d = data(dt, Some(op));
                let mut buf = vec![0u8; 64 * dt.size()];
                d.fill(2, 100, &mut buf);
                for j in 0..64 {
                    let v = read(dt, &buf, j);
                    assert_eq!(v, d.input(2, 100 + j), "{dt} {op}");
                    assert_ne!(v, Val::Int(0));
                    assert_ne!(v, Val::Float(0.0));
                }
            }
        }
    }

    #[test]
    fn reference_matches_a_local_reduction() {
        // Reduce 4 ranks' inputs by hand and check the reference agrees.
        for dt in [DataType::F32, DataType::I8, DataType::U8, DataType::Bf16] {
            for op in ReduceOp::BUILTIN {
                let d = data(dt, Some(op));
                let mut acc = vec![0u8; 32 * dt.size()];
                let mut tmp = acc.clone();
                d.fill(0, 0, &mut acc);
                for r in 1..4 {
                    d.fill(r, 0, &mut tmp);
                    for j in 0..32 {
                        let v = match (read(dt, &acc, j), read(dt, &tmp, j)) {
                            (Val::Int(a), Val::Int(b)) => Val::Int(wrap(
                                dt,
                                match op {
                                    ReduceOp::Prod => a * b,
                                    ReduceOp::Max => a.max(b),
                                    ReduceOp::Min => a.min(b),
                                    _ => a + b,
                                },
                            )),
                            (Val::Float(a), Val::Float(b)) => Val::Float(match op {
                                ReduceOp::Prod => a * b,
                                ReduceOp::Max => a.max(b),
                                ReduceOp::Min => a.min(b),
                                _ => a + b,
                            }),
                            _ => unreachable!(),
                        };
                        write(dt, &mut acc, j, v);
                    }
                }
                if op == ReduceOp::Avg {
                    for j in 0..32 {
                        let v = match read(dt, &acc, j) {
                            Val::Int(a) => Val::Int(a / 4),
                            Val::Float(a) => Val::Float(a / 4.0),
                        };
                        write(dt, &mut acc, j, v);
                    }
                }
                assert_eq!(d.wrong_reductions(&acc, |j| j), 0, "{dt} {op}");
                // A corrupted element is caught.
                let mut bad = acc.clone();
                let v = read(dt, &bad, 3);
                let off = match v {
                    Val::Int(x) => Val::Int(x + 1),
                    Val::Float(x) => Val::Float(x + 1.0),
                };
                write(dt, &mut bad, 3, off);
                assert_eq!(d.wrong_reductions(&bad, |j| j), 1, "{dt} {op}");
            }
        }
    }

    #[test]
    fn copies_compare_bits() {
        let d = data(DataType::F64, None);
        let mut buf = vec![0u8; 16 * 8];
        d.fill(3, 5, &mut buf);
        assert_eq!(d.wrong_copies(&buf, |j| (3, 5 + j)), 0);
        assert_eq!(d.wrong_copies(&buf, |j| (2, 5 + j)), 16);
        let mut s = buf.clone();
        d.fill_sentinel(&mut s);
        assert_eq!(d.wrong_copies(&s, |j| (3, 5 + j)), 16);
    }

    #[test]
    fn wrapping() {
        assert_eq!(wrap(DataType::I8, 128), -128);
        assert_eq!(wrap(DataType::U8, 256), 0);
        assert_eq!(wrap(DataType::U8, -1), 255);
        assert_eq!(wrap(DataType::I32, 1 << 31), -(1 << 31));
        assert_eq!(wrap(DataType::U64, -1), u64::MAX as i128);
    }
}
