//! Reduction kernels: `out = op(in_0, in_1, ..., in_{n-1})` in fixed rank order.
//!
//! Floats accumulate in `f32` (f16 / bf16 widened exactly, rounded once to
//! nearest-even at the end), so every rank that runs the same kernel on the same
//! inputs gets the same bits. Integers reduce exactly in their own type (sum
//! wraps on overflow, like two's-complement hardware). `max` / `min` on floats
//! follow `f32::max` / `f32::min` (a NaN loses against a number).
//!
//! Work is done in blocks of [`BLK`] elements held in a stack accumulator, so the
//! output may alias one of the inputs and the conversions run as tight loops the
//! compiler vectorises.

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

use crate::{with_reducible_dtype, DType, Element, ReduceOp};

/// Elements per block.
pub(crate) const BLK: usize = 1024;

/// Element types the kernels reduce.
pub(crate) trait Kern: Element {
    /// Accumulator type.
    type Acc: Copy + Default;
    /// `acc = widen(src)`.
    fn load(src: &[Self], acc: &mut [Self::Acc]);
    /// `acc = op(acc, widen(src))`.
    fn accumulate(op: ReduceOp, src: &[Self], acc: &mut [Self::Acc]);
    /// `dst = narrow(acc)`.
    fn store(acc: &[Self::Acc], dst: &mut [Self]);
}

#[inline(always)]
fn combine_f32(op: ReduceOp, x: &[f32], acc: &mut [f32]) {
    match op {
        ReduceOp::Sum => acc.iter_mut().zip(x).for_each(|(a, x)| *a += *x),
        ReduceOp::Max => acc.iter_mut().zip(x).for_each(|(a, x)| *a = a.max(*x)),
        ReduceOp::Min => acc.iter_mut().zip(x).for_each(|(a, x)| *a = a.min(*x)),
    }
}

impl Kern for f32 {
    type Acc = f32;
    #[inline(always)]
    fn load(src: &[f32], acc: &mut [f32]) {
        acc.copy_from_slice(src);
    }
    #[inline(always)]
    fn accumulate(op: ReduceOp, src: &[f32], acc: &mut [f32]) {
        combine_f32(op, src, acc);
    }
    #[inline(always)]
    fn store(acc: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(acc);
    }
}

impl Kern for f16 {
    type Acc = f32;
    #[inline(always)]
    fn load(src: &[f16], acc: &mut [f32]) {
        src.convert_to_f32_slice(acc);
    }
    #[inline(always)]
    fn accumulate(op: ReduceOp, src: &[f16], acc: &mut [f32]) {
        let mut tmp = [0f32; BLK];
        let tmp = &mut tmp[..src.len()];
        src.convert_to_f32_slice(tmp);
        combine_f32(op, tmp, acc);
    }
    #[inline(always)]
    fn store(acc: &[f32], dst: &mut [f16]) {
        dst.convert_from_f32_slice(acc);
    }
}

/// bf16 -> f32 (exact): the bits move to the top half.
#[inline(always)]
pub fn bf16_to_f32_slice(src: &[bf16], dst: &mut [f32]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = bf16_f32(*s);
    }
}

/// f32 -> bf16, round to nearest even; NaN stays NaN (quiet bit set).
#[inline(always)]
pub fn f32_to_bf16_slice(src: &[f32], dst: &mut [bf16]) {
    for (d, s) in dst.iter_mut().zip(src) {
        let b = s.to_bits();
        let rounded = (b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16) as u16;
        let nan = ((b >> 16) | 0x40) as u16;
        *d = bf16::from_bits(if b & 0x7fff_ffff > 0x7f80_0000 { nan } else { rounded });
    }
}

#[inline(always)]
fn bf16_f32(x: bf16) -> f32 {
    f32::from_bits((x.to_bits() as u32) << 16)
}

impl Kern for bf16 {
    type Acc = f32;
    #[inline(always)]
    fn load(src: &[bf16], acc: &mut [f32]) {
        bf16_to_f32_slice(src, acc);
    }
    #[inline(always)]
    fn accumulate(op: ReduceOp, src: &[bf16], acc: &mut [f32]) {
        // Widen and combine in one pass (vectorises; no temporary).
        match op {
            ReduceOp::Sum => acc.iter_mut().zip(src).for_each(|(a, x)| *a += bf16_f32(*x)),
            ReduceOp::Max => acc.iter_mut().zip(src).for_each(|(a, x)| *a = a.max(bf16_f32(*x))),
            ReduceOp::Min => acc.iter_mut().zip(src).for_each(|(a, x)| *a = a.min(bf16_f32(*x))),
        }
    }
    #[inline(always)]
    fn store(acc: &[f32], dst: &mut [bf16]) {
        f32_to_bf16_slice(acc, dst);
    }
}

macro_rules! int_kern {
    ($t:ty) => {
        impl Kern for $t {
            type Acc = $t;
            #[inline(always)]
            fn load(src: &[$t], acc: &mut [$t]) {
                acc.copy_from_slice(src);
            }
            #[inline(always)]
            fn accumulate(op: ReduceOp, src: &[$t], acc: &mut [$t]) {
                match op {
                    ReduceOp::Sum => acc.iter_mut().zip(src).for_each(|(a, x)| *a = a.wrapping_add(*x)),
                    ReduceOp::Max => acc.iter_mut().zip(src).for_each(|(a, x)| *a = (*a).max(*x)),
                    ReduceOp::Min => acc.iter_mut().zip(src).for_each(|(a, x)| *a = (*a).min(*x)),
                }
            }
            #[inline(always)]
            fn store(acc: &[$t], dst: &mut [$t]) {
                dst.copy_from_slice(acc);
            }
        }
    };
}
int_kern!(i32);
int_kern!(i64);

/// `out[..len] = op(inputs[0][..len], ..., inputs[n-1][..len])`, rank order.
///
/// # Safety
/// Every input pointer must be valid for reading `len` elements of `T`, `out`
/// valid for writing `len` elements, all aligned for `T`; `out` may equal an
/// input pointer but must not partially overlap one; no other thread writes
/// these ranges during the call.
#[inline(always)]
unsafe fn reduce_body<T: Kern>(op: ReduceOp, inputs: &[*const u8], out: *mut u8, len: usize) {
    let mut acc = [T::Acc::default(); BLK];
    let mut i = 0;
    while i < len {
        let b = BLK.min(len - i);
        let acc = &mut acc[..b];
        for (j, p) in inputs.iter().enumerate() {
            // SAFETY: the caller guarantees p is valid for len elements; i + b <= len.
            let src = unsafe { std::slice::from_raw_parts((*p as *const T).add(i), b) };
            if j == 0 {
                T::load(src, acc);
            } else {
                T::accumulate(op, src, acc);
            }
        }
        // SAFETY: the input slices above are dead; out is valid for len elements.
        let dst = unsafe { std::slice::from_raw_parts_mut((out as *mut T).add(i), b) };
        T::store(acc, dst);
        i += b;
    }
}

/// [`reduce_body`] compiled for AVX2 (same results: no contraction, same order).
///
/// # Safety
/// As [`reduce_body`], and the CPU must support AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn reduce_avx2<T: Kern>(op: ReduceOp, inputs: &[*const u8], out: *mut u8, len: usize) {
    // SAFETY: forwarded from the caller.
    unsafe { reduce_body::<T>(op, inputs, out, len) }
}

/// Picks the widest kernel this CPU runs.
///
/// # Safety
/// As [`reduce_body`].
unsafe fn reduce_typed<T: Kern>(op: ReduceOp, inputs: &[*const u8], out: *mut u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 is present; the rest is forwarded from the caller.
        return unsafe { reduce_avx2::<T>(op, inputs, out, len) };
    }
    // SAFETY: forwarded from the caller.
    unsafe { reduce_body::<T>(op, inputs, out, len) }
}

/// Reduces `len` elements of `dtype` from every input into `out`.
///
/// # Safety
/// As [`reduce_body`]: valid, aligned, non-partially-overlapping ranges.
pub(crate) unsafe fn reduce(dtype: DType, op: ReduceOp, inputs: &[*const u8], out: *mut u8, len: usize) {
    if inputs.is_empty() || len == 0 {
        return;
    }
    // SAFETY: forwarded from the caller.
    // The one-byte dtypes never get here: `Comm` refuses to reduce them.
    with_reducible_dtype!(dtype, T => unsafe { reduce_typed::<T>(op, inputs, out, len) }, else ())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_rounding_matches_half() {
        let mut x: u32 = 0x1234_5678;
        let mut src = Vec::new();
        for _ in 0..200_000 {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            src.push(f32::from_bits(x));
        }
        src.extend([0.0, -0.0, f32::INFINITY, f32::NEG_INFINITY, f32::MAX, f32::MIN_POSITIVE, 1.0 + f32::EPSILON]);
        src.extend((0..=0xffffu32).map(|h| f32::from_bits((h << 16) | 0x8000)));
        let mut ours = vec![bf16::ZERO; src.len()];
        f32_to_bf16_slice(&src, &mut ours);
        for (s, o) in src.iter().zip(&ours) {
            let want = bf16::from_f32(*s);
            if s.is_nan() {
                assert!(o.is_nan(), "{s:?}");
            } else {
                assert_eq!(o.to_bits(), want.to_bits(), "{s:?} ({:#x})", s.to_bits());
            }
        }
        let mut back = vec![0f32; ours.len()];
        bf16_to_f32_slice(&ours, &mut back);
        for (b, o) in back.iter().zip(&ours) {
            assert_eq!(b.to_bits(), o.to_f32().to_bits());
        }
    }

    /// The run-time-selected kernel and the baseline kernel agree bitwise.
    #[test]
    fn dispatched_kernel_matches_baseline() {
        let n = 3 * BLK + 17;
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let inputs: Vec<Vec<u8>> = (0..5)
            .map(|_| {
                (0..n * 8)
                    .map(|_| {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        (x >> 24) as u8
                    })
                    .collect()
            })
            .collect();
        for dtype in DType::ALL {
            for op in ReduceOp::ALL {
                // u64 backing keeps every dtype aligned.
                let mut a = vec![0u64; n];
                let mut b = vec![0u64; n];
                let aligned: Vec<Vec<u64>> = inputs
                    .iter()
                    .map(|v| v.chunks(8).map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes"))).collect())
                    .collect();
                let ap: Vec<*const u8> = aligned.iter().map(|v| v.as_ptr() as *const u8).collect();
                // SAFETY: every buffer holds n * 8 >= n * dtype.size() bytes, 8-byte aligned.
                unsafe {
                    reduce(dtype, op, &ap, a.as_mut_ptr() as *mut u8, n);
                    with_reducible_dtype!(dtype, T => reduce_body::<T>(op, &ap, b.as_mut_ptr() as *mut u8, n), else ());
                }
                let nbytes = n * dtype.size();
                let (a, b): (&[u8], &[u8]) = (bytemuck::cast_slice(&a), bytemuck::cast_slice(&b));
                assert_eq!(a[..nbytes], b[..nbytes], "{dtype} {op:?}");
            }
        }
    }
}
