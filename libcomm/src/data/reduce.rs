//! Host reduction kernels: elementwise combine, average division and the
//! pre-multiplication of `PreMulSum`, for every [`DataType`].
//!
//! They work on raw pointers because their operands live in user buffers, in
//! shared-memory rings and in in-place aliases of each other; `dst` may alias
//! `a` or `b` exactly (never partially). Each op is matched outside its loop so
//! the loops stay tight enough for LLVM to vectorise.

use crate::data::types::{Combine, DataType, F8E4M3, F8E5M2};
use half::{bf16, f16};

trait Num: Copy {
    fn add(self, o: Self) -> Self;
    fn mul(self, o: Self) -> Self;
    fn min(self, o: Self) -> Self;
    fn max(self, o: Self) -> Self;
    fn div_n(self, n: usize) -> Self;
    fn scale(self, s: f64) -> Self;
}

macro_rules! int_num {
    ($($t:ty),*) => {$(
        impl Num for $t {
            #[inline(always)] fn add(self, o: Self) -> Self { self.wrapping_add(o) }
            #[inline(always)] fn mul(self, o: Self) -> Self { self.wrapping_mul(o) }
            #[inline(always)] fn min(self, o: Self) -> Self { Ord::min(self, o) }
            #[inline(always)] fn max(self, o: Self) -> Self { Ord::max(self, o) }
            #[inline(always)] fn div_n(self, n: usize) -> Self { self / (n as $t) }
            // Integer pre-multiplication uses the scalar converted to the type, as NCCL does.
            #[inline(always)] fn scale(self, s: f64) -> Self { self.wrapping_mul(s as i64 as $t) }
        }
    )*};
}
int_num!(i8, u8, i32, u32, i64, u64);

macro_rules! float_num {
    ($($t:ty),*) => {$(
        impl Num for $t {
            #[inline(always)] fn add(self, o: Self) -> Self { self + o }
            #[inline(always)] fn mul(self, o: Self) -> Self { self * o }
            #[inline(always)] fn min(self, o: Self) -> Self { if o < self { o } else { self } }
            #[inline(always)] fn max(self, o: Self) -> Self { if o > self { o } else { self } }
            #[inline(always)] fn div_n(self, n: usize) -> Self { self / (n as $t) }
            #[inline(always)] fn scale(self, s: f64) -> Self { self * (s as $t) }
        }
    )*};
}
float_num!(f32, f64);

/// Narrow floats compute in f32 and round back once per combine.
macro_rules! narrow_num {
    ($($t:ty: $to:expr, $from:expr);*) => {$(
        impl Num for $t {
            #[inline(always)] fn add(self, o: Self) -> Self { $from($to(self) + $to(o)) }
            #[inline(always)] fn mul(self, o: Self) -> Self { $from($to(self) * $to(o)) }
            #[inline(always)] fn min(self, o: Self) -> Self { if $to(o) < $to(self) { o } else { self } }
            #[inline(always)] fn max(self, o: Self) -> Self { if $to(o) > $to(self) { o } else { self } }
            #[inline(always)] fn div_n(self, n: usize) -> Self { $from($to(self) / n as f32) }
            #[inline(always)] fn scale(self, s: f64) -> Self { $from($to(self) * s as f32) }
        }
    )*};
}
narrow_num!(
    f16: f16::to_f32, f16::from_f32;
    bf16: bf16::to_f32, bf16::from_f32;
    F8E4M3: F8E4M3::to_f32, F8E4M3::from_f32;
    F8E5M2: F8E5M2::to_f32, F8E5M2::from_f32
);

/// The aliasing cases get loops of their own: LLVM vectorises a loop over
/// raw pointers behind a run-time check that the written range does not
/// overlap the ones read, and `dst == a` (every in-place reduction: the ring
/// reducing into the buffer it sends from, the latency slots accumulating
/// into the output) fails that check and ran the scalar loop, 2-3x slower
/// than out of place. A loop that reads and writes `dst` through one
/// pointer only has the other operand to check against.
#[inline(always)]
unsafe fn zip<T: Num>(dst: *mut T, a: *const T, b: *const T, n: usize, f: impl Fn(T, T) -> T) {
    if std::ptr::eq(dst, a) {
        for i in 0..n {
            unsafe {
                let d = dst.add(i);
                d.write_unaligned(f(d.read_unaligned(), b.add(i).read_unaligned()));
            }
        }
    } else if std::ptr::eq(dst, b) {
        for i in 0..n {
            unsafe {
                let d = dst.add(i);
                d.write_unaligned(f(a.add(i).read_unaligned(), d.read_unaligned()));
            }
        }
    } else {
        for i in 0..n {
            unsafe {
                let v = f(a.add(i).read_unaligned(), b.add(i).read_unaligned());
                dst.add(i).write_unaligned(v);
            }
        }
    }
}

unsafe fn combine_t<T: Num>(op: Combine, dst: *mut T, a: *const T, b: *const T, n: usize) {
    unsafe {
        match op {
            Combine::Sum => zip(dst, a, b, n, T::add),
            Combine::Prod => zip(dst, a, b, n, T::mul),
            Combine::Min => zip(dst, a, b, n, T::min),
            Combine::Max => zip(dst, a, b, n, T::max),
        }
    }
}

macro_rules! dispatch {
    ($dtype:expr, $f:ident, ($($arg:expr),*)) => {
        match $dtype {
            DataType::I8 => $f::<i8>($($arg),*),
            DataType::U8 => $f::<u8>($($arg),*),
            DataType::I32 => $f::<i32>($($arg),*),
            DataType::U32 => $f::<u32>($($arg),*),
            DataType::I64 => $f::<i64>($($arg),*),
            DataType::U64 => $f::<u64>($($arg),*),
            DataType::F16 => $f::<f16>($($arg),*),
            DataType::F32 => $f::<f32>($($arg),*),
            DataType::F64 => $f::<f64>($($arg),*),
            DataType::Bf16 => $f::<bf16>($($arg),*),
            DataType::F8E4M3 => $f::<F8E4M3>($($arg),*),
            DataType::F8E5M2 => $f::<F8E5M2>($($arg),*),
        }
    };
}

/// `dst[i] = a[i] op b[i]` for `count` elements of `dtype`.
///
/// # Safety
/// All three regions must be valid for `count` elements; `dst` may equal `a`
/// or `b` but must not partially overlap them.
pub(crate) unsafe fn combine(
    dtype: DataType,
    op: Combine,
    dst: *mut u8,
    a: *const u8,
    b: *const u8,
    count: usize,
) {
    unsafe fn go<T: Num>(op: Combine, d: *mut u8, a: *const u8, b: *const u8, n: usize) {
        unsafe { combine_t::<T>(op, d.cast(), a.cast(), b.cast(), n) }
    }
    unsafe { dispatch!(dtype, go, (op, dst, a, b, count)) }
}

/// Chunks below this many bytes are reduced by the calling thread alone in
/// [`combine_split`] (a thread's start costs about what 64 KiB of
/// reduction does).
const SPLIT_MIN_BYTES: usize = 512 << 10;

/// [`combine`] cut into up to `threads` contiguous parts, reduced at once
/// by as many threads (this one among them; scoped, joined before the
/// return). For a thread that reduces what many sockets receive (the
/// cross-host engine's), where one core's reduction is slower than the
/// network. Same results as [`combine`]: every element is reduced once,
/// by the same operation.
///
/// # Safety
/// As [`combine`].
pub(crate) unsafe fn combine_split(
    dtype: DataType,
    op: Combine,
    dst: *mut u8,
    a: *const u8,
    b: *const u8,
    count: usize,
    threads: usize,
) {
    let es = dtype.size();
    let parts = threads.min(count * es / SPLIT_MIN_BYTES).max(1);
    if parts == 1 {
        return unsafe { combine(dtype, op, dst, a, b, count) };
    }
    let per = count.div_ceil(parts);
    // Addresses cross the spawn as integers: the parts are disjoint, and
    // the scope ends every thread before the caller's buffers can go.
    let (d, x, y) = (dst as usize, a as usize, b as usize);
    std::thread::scope(|s| {
        for i in 1..parts {
            let (at, n) = (i * per, per.min(count.saturating_sub(i * per)));
            if n == 0 {
                continue;
            }
            let o = at * es;
            s.spawn(move || unsafe {
                combine(
                    dtype,
                    op,
                    (d + o) as *mut u8,
                    (x + o) as *const u8,
                    (y + o) as *const u8,
                    n,
                )
            });
        }
        unsafe { combine(dtype, op, dst, a, b, per.min(count)) };
    });
}

/// Threads the cross-host engine reduces a large received chunk with: a
/// quarter of the cores (the rest receive, copy and run the caller's
/// work), from 1 (two cores: the development VM, CI) to 4.
pub(crate) fn split_threads() -> usize {
    // Unit tests split on any machine, so that CI's two cores run the
    // engine's split path too (`crosshost::tests`).
    if cfg!(test) {
        return 3;
    }
    static N: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *N.get_or_init(|| {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        (cores / 4).clamp(1, 4)
    })
}

/// `buf[i] /= n` (the final step of an average).
///
/// # Safety
/// `buf` must be valid for `count` elements.
pub(crate) unsafe fn divide(dtype: DataType, buf: *mut u8, count: usize, n: usize) {
    unsafe fn go<T: Num>(p: *mut u8, count: usize, n: usize) {
        let p = p.cast::<T>();
        for i in 0..count {
            unsafe { p.add(i).write_unaligned(p.add(i).read_unaligned().div_n(n)) }
        }
    }
    unsafe { dispatch!(dtype, go, (buf, count, n)) }
}

/// `dst[i] = src[i] * scalar` (the local step of a pre-multiplied sum).
///
/// # Safety
/// Both regions valid for `count` elements; they may be equal.
pub(crate) unsafe fn scale(dtype: DataType, dst: *mut u8, src: *const u8, count: usize, s: f64) {
    unsafe fn go<T: Num>(d: *mut u8, s_: *const u8, count: usize, s: f64) {
        let (d, src) = (d.cast::<T>(), s_.cast::<T>());
        for i in 0..count {
            unsafe {
                d.add(i)
                    .write_unaligned(src.add(i).read_unaligned().scale(s))
            }
        }
    }
    unsafe { dispatch!(dtype, go, (dst, src, count, s)) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn combine_split_matches_combine_for_every_part_count_and_alias() {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut rnd = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        };
        for count in [1usize, 131_071, 300_001, 1 << 20] {
            let a: Vec<f32> = (0..count).map(|_| rnd()).collect();
            let b: Vec<f32> = (0..count).map(|_| rnd()).collect();
            let mut want = vec![0f32; count];
            unsafe {
                combine(
                    DataType::F32,
                    Combine::Sum,
                    want.as_mut_ptr().cast(),
                    a.as_ptr().cast(),
                    b.as_ptr().cast(),
                    count,
                )
            };
            for threads in [1, 2, 3, 4] {
                let mut got = vec![f32::NAN; count];
                unsafe {
                    combine_split(
                        DataType::F32,
                        Combine::Sum,
                        got.as_mut_ptr().cast(),
                        a.as_ptr().cast(),
                        b.as_ptr().cast(),
                        count,
                        threads,
                    )
                };
                assert!(got == want, "{count} elements, {threads} threads");
                // In place (dst == a), as the engine's reducing receives are.
                let mut inp = a.clone();
                let p = inp.as_mut_ptr().cast::<u8>();
                unsafe {
                    combine_split(
                        DataType::F32,
                        Combine::Sum,
                        p,
                        p,
                        b.as_ptr().cast(),
                        count,
                        threads,
                    )
                };
                assert!(inp == want, "in place, {count} elements, {threads} threads");
            }
        }
    }

    #[test]
    fn combine_i8_wraps_and_aliases() {
        let mut a = [100i8, -5, 7];
        let b = [100i8, 3, -9];
        let p = a.as_mut_ptr().cast::<u8>();
        unsafe { combine(DataType::I8, Combine::Sum, p, p, b.as_ptr().cast(), 3) };
        assert_eq!(a, [-56, -2, -2]);
    }

    #[test]
    fn combine_f32_min_max_prod() {
        let a = [1.5f32, -2.0, 3.0];
        let b = [0.5f32, 4.0, -1.0];
        let mut d = [0f32; 3];
        let run = |op, d: &mut [f32; 3]| unsafe {
            combine(
                DataType::F32,
                op,
                d.as_mut_ptr().cast(),
                a.as_ptr().cast(),
                b.as_ptr().cast(),
                3,
            )
        };
        run(Combine::Min, &mut d);
        assert_eq!(d, [0.5, -2.0, -1.0]);
        run(Combine::Max, &mut d);
        assert_eq!(d, [1.5, 4.0, 3.0]);
        run(Combine::Prod, &mut d);
        assert_eq!(d, [0.75, -8.0, -3.0]);
    }

    #[test]
    fn aliased_operands_match_distinct_ones() {
        // Long enough for the vectorised loops, odd for their remainders.
        let n = 1027;
        let a: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin() * 100.0).collect();
        let b: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos() * 100.0).collect();
        for op in [Combine::Sum, Combine::Prod, Combine::Min, Combine::Max] {
            let mut want = vec![0f32; n];
            let (mut da, mut db) = (a.clone(), b.clone());
            unsafe {
                let f = |d: *mut f32, x: *const f32, y: *const f32| {
                    combine(DataType::F32, op, d.cast(), x.cast(), y.cast(), n)
                };
                f(want.as_mut_ptr(), a.as_ptr(), b.as_ptr());
                f(da.as_mut_ptr(), da.as_ptr(), b.as_ptr());
                f(db.as_mut_ptr(), a.as_ptr(), db.as_ptr());
            }
            assert_eq!(da, want, "{op:?} with dst == a");
            assert_eq!(db, want, "{op:?} with dst == b");
        }
    }

    #[test]
    fn unaligned_operands_work() {
        let mut raw = vec![0u8; 4 * 5 + 1];
        let vals = [1.0f32, 2.0, 3.0, 4.0, 5.0];
        for (i, v) in vals.iter().enumerate() {
            raw[1 + 4 * i..5 + 4 * i].copy_from_slice(&v.to_ne_bytes());
        }
        let p = unsafe { raw.as_mut_ptr().add(1) };
        unsafe { combine(DataType::F32, Combine::Sum, p, p, p, 5) };
        unsafe { divide(DataType::F32, p, 5, 2) };
        for (i, v) in vals.iter().enumerate() {
            let got = f32::from_ne_bytes(raw[1 + 4 * i..5 + 4 * i].try_into().unwrap());
            assert_eq!(got, *v);
        }
    }

    #[test]
    fn narrow_types_round_through_f32() {
        let a = [bf16::from_f32(1.0), bf16::from_f32(2.5)];
        let b = [bf16::from_f32(0.5), bf16::from_f32(-0.5)];
        let mut d = [bf16::ZERO; 2];
        unsafe {
            combine(
                DataType::Bf16,
                Combine::Sum,
                d.as_mut_ptr().cast(),
                a.as_ptr().cast(),
                b.as_ptr().cast(),
                2,
            );
            scale(
                DataType::Bf16,
                d.as_mut_ptr().cast(),
                d.as_ptr().cast(),
                2,
                2.0,
            );
        }
        assert_eq!(d.map(|x| x.to_f32()), [3.0, 4.0]);
    }
}
