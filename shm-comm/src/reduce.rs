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

use crate::{DataType, ReduceOp};

/// Runs `$body` with `$T` bound to the Rust type of a reducible `$dtype`;
/// `$other` for the types reductions do not take.
macro_rules! with_kern {
    ($dtype:expr, $T:ident => $body:expr, $other:expr) => {
        match $dtype {
            DataType::F32 => {
                type $T = f32;
                $body
            }
            DataType::F16 => {
                type $T = f16;
                $body
            }
            DataType::BF16 => {
                type $T = bf16;
                $body
            }
            DataType::I32 => {
                type $T = i32;
                $body
            }
            DataType::I64 => {
                type $T = i64;
                $body
            }
            _ => $other,
        }
    };
}

/// Elements per block.
pub(crate) const BLK: usize = 1024;

/// Element types the kernels reduce.
pub(crate) trait Kern: Copy + 'static {
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

/// The bf16 sum of [`reduce_body`] with the accumulator in registers: 16
/// elements at a time, every input widened and added in rank order, then
/// rounded once as [`f32_to_bf16_slice`] rounds, so the bits are the same.
/// The block kernel keeps its accumulator in memory and runs this hot case
/// at about half the speed of a copy.
///
/// # Safety
/// As [`reduce_body`] for `bf16` (2-byte alignment is enough), and the CPU
/// must support AVX2. A chunk's inputs are all read before its output is
/// written, so `out` may equal an input.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn bf16_sum_avx2(inputs: &[*const u8], out: *mut u8, len: usize) {
    use std::arch::x86_64::*;
    // Each input is prefetched this many elements (2.5 KiB) ahead: the
    // hardware prefetchers stop at every 4 KiB page, so each of the inputs
    // streamed side by side would otherwise start cold at every page. In an
    // interleaved A/B (`bench collectives --procs --ranks 4`, 32 MiB, 8 pairs,
    // twice) all_reduce took 0.90-0.93 and reduce_scatter 0.94-0.96 of the time
    // without it.
    const AHEAD: usize = 1280;
    // Sixteen bf16 at `p` as f32 (the bits move to the top half of each
    // lane, a zero interleaved below): elements 0-3 and 8-11 in the first
    // register, 4-7 and 12-15 in the second, the order in which AVX2 unpacks
    // within each 128-bit half. The pack below takes them back in that order.
    #[inline(always)]
    unsafe fn widen16(p: *const u16) -> (__m256, __m256) {
        // SAFETY: the caller's `p` is readable for 16 elements.
        let x = unsafe { _mm256_loadu_si256(p.cast()) };
        let zero = _mm256_setzero_si256();
        (_mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, x)), _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, x)))
    }
    // Eight f32 rounded to nearest even as bf16 bits in the low half of each
    // lane; a NaN keeps its top bits with the quiet bit set.
    #[inline(always)]
    unsafe fn narrow(a: __m256) -> __m256i {
        let b = _mm256_castps_si256(a);
        let lsb = _mm256_and_si256(_mm256_srli_epi32::<16>(b), _mm256_set1_epi32(1));
        let rounded = _mm256_srli_epi32::<16>(_mm256_add_epi32(b, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb)));
        let abs = _mm256_and_si256(b, _mm256_set1_epi32(0x7fff_ffff));
        let is_nan = _mm256_cmpgt_epi32(abs, _mm256_set1_epi32(0x7f80_0000));
        let nan = _mm256_or_si256(_mm256_srli_epi32::<16>(b), _mm256_set1_epi32(0x40));
        _mm256_blendv_epi8(rounded, nan, is_nan)
    }
    let mut i = 0;
    while i + 16 <= len {
        if i % 32 == 0 && i + AHEAD < len {
            for p in inputs {
                // SAFETY: i + AHEAD < len: inside every input's range.
                unsafe { _mm_prefetch::<_MM_HINT_T0>(p.cast::<u16>().add(i + AHEAD).cast()) };
            }
        }
        // SAFETY: i + 16 <= len: every input is readable and `out` writable
        // for these 16 elements (the caller's contract).
        unsafe {
            let (mut lo, mut hi) = widen16(inputs[0].cast::<u16>().add(i));
            for p in &inputs[1..] {
                let (a, b) = widen16(p.cast::<u16>().add(i));
                lo = _mm256_add_ps(lo, a);
                hi = _mm256_add_ps(hi, b);
            }
            // packus takes four lanes of `lo` then four of `hi` in each
            // 128-bit half: elements 0-3, 4-7 | 8-11, 12-15, in order.
            let packed = _mm256_packus_epi32(narrow(lo), narrow(hi));
            _mm256_storeu_si256(out.cast::<u16>().add(i).cast(), packed);
        }
        i += 16;
    }
    if i < len {
        let tail: Vec<*const u8> = inputs.iter().map(|p| p.wrapping_add(i * 2)).collect();
        // SAFETY: the remaining len - i elements of every range, as above.
        unsafe { reduce_body::<half::bf16>(ReduceOp::Sum, &tail, out.add(i * 2), len - i) }
    }
}

/// Picks the widest kernel this CPU runs.
///
/// # Safety
/// As [`reduce_body`].
unsafe fn reduce_typed<T: Kern>(op: ReduceOp, inputs: &[*const u8], out: *mut u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        if std::any::TypeId::of::<T>() == std::any::TypeId::of::<bf16>() && op == ReduceOp::Sum {
            // SAFETY: AVX2 is present and T is bf16; the rest is forwarded.
            return unsafe { bf16_sum_avx2(inputs, out, len) };
        }
        // SAFETY: AVX2 is present; the rest is forwarded from the caller.
        return unsafe { reduce_avx2::<T>(op, inputs, out, len) };
    }
    // SAFETY: forwarded from the caller.
    unsafe { reduce_body::<T>(op, inputs, out, len) }
}

/// Reduces `len` elements of `dtype` from every input into `out`. Types that
/// are not reducible are refused before any collective reaches here; for them
/// this does nothing.
///
/// # Safety
/// As [`reduce_body`]: valid, aligned, non-partially-overlapping ranges.
pub(crate) unsafe fn reduce(dtype: DataType, op: ReduceOp, inputs: &[*const u8], out: *mut u8, len: usize) {
    if inputs.is_empty() || len == 0 {
        return;
    }
    // SAFETY: forwarded from the caller.
    with_kern!(dtype, T => unsafe { reduce_typed::<T>(op, inputs, out, len) }, ())
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

    /// The dispatched bf16 sum writing over one of its inputs (as all_reduce
    /// does with its own staging piece) equals the baseline into fresh memory.
    #[test]
    fn dispatched_bf16_sum_in_place_matches_baseline() {
        // Shorter than the prefetch distance, and long enough to prefetch.
        for n in [5 * 16 + 7, 3000 + 7] {
            bf16_sum_in_place_matches_baseline(n);
        }
    }

    fn bf16_sum_in_place_matches_baseline(n: usize) {
        let mut x: u32 = 0x2545_f491;
        let mut inputs: Vec<Vec<u16>> = (0..4)
            .map(|_| {
                (0..n)
                    .map(|_| {
                        x ^= x << 13;
                        x ^= x >> 17;
                        x ^= x << 5;
                        (x >> 8) as u16
                    })
                    .collect()
            })
            .collect();
        let mut want = vec![0u16; n];
        let ptrs: Vec<*const u8> = inputs.iter().map(|v| v.as_ptr() as *const u8).collect();
        // SAFETY: every buffer holds n u16, 2-byte aligned; `want` is separate.
        unsafe { reduce_body::<bf16>(ReduceOp::Sum, &ptrs, want.as_mut_ptr() as *mut u8, n) };
        let out = inputs[2].as_mut_ptr() as *mut u8;
        let ptrs: Vec<*const u8> = inputs.iter().map(|v| v.as_ptr() as *const u8).collect();
        // SAFETY: as above; `out` is input 2 itself (allowed: equal, not overlapping).
        unsafe { reduce(DataType::BF16, ReduceOp::Sum, &ptrs, out, n) };
        assert_eq!(inputs[2], want);
    }

    /// Little-endian elements of `dtype` with every NaN replaced by one
    /// pattern (all ones).
    fn canonical_nans(dtype: DataType, bytes: &[u8]) -> Vec<u8> {
        let is_nan = |e: &[u8]| match dtype {
            DataType::F32 => u32::from_le_bytes(e.try_into().expect("4 bytes")) & 0x7fff_ffff > 0x7f80_0000,
            DataType::F16 => u16::from_le_bytes(e.try_into().expect("2 bytes")) & 0x7fff > 0x7c00,
            DataType::BF16 => u16::from_le_bytes(e.try_into().expect("2 bytes")) & 0x7fff > 0x7f80,
            _ => false,
        };
        bytes.chunks(dtype.size()).flat_map(|e| if is_nan(e) { vec![0xff; e.len()] } else { e.to_vec() }).collect()
    }

    /// The run-time-selected kernel and the baseline kernel agree bitwise
    /// (NaNs: both NaN).
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
        for dtype in DataType::REDUCIBLE {
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
                    with_kern!(dtype, T => reduce_body::<T>(op, &ap, b.as_mut_ptr() as *mut u8, n), ());
                }
                let nbytes = n * dtype.size();
                let bytes = |v: &[u64]| v.iter().flat_map(|w| w.to_le_bytes()).take(nbytes).collect::<Vec<u8>>();
                // Bit for bit, except that a NaN is any NaN: which input's
                // payload a float add passes on depends on operand order,
                // which the compiler may swap in one kernel and not the other.
                let (a, b) = (canonical_nans(dtype, &bytes(&a)), canonical_nans(dtype, &bytes(&b)));
                assert_eq!(a, b, "{dtype} {op:?}");
            }
        }
    }
}
