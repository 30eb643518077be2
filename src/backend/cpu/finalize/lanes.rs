//! Element kernels: conversions between each element type and f32 scratch
//! rows, and the one-pass accumulation of up to [`GROUP`] source rows.

use half::{bf16, f16};

use crate::Element;

/// Row conversions between an element type and f32 scratch rows.
pub(super) trait Lanes: Element {
    /// True when [`Lanes::lane`] is a cheap per-element widening (f32, bf16),
    /// so several source rows can be streamed in one pass.
    const LANEWISE: bool = false;
    /// One element widened to f32.
    #[inline(always)]
    fn lane(self) -> f32 {
        self.to_f32()
    }
    /// One f32 rounded to this type (round to nearest even).
    #[inline(always)]
    fn narrow_one(v: f32) -> Self {
        Self::from_f32(v)
    }
    /// `dst = f32(src)`.
    fn widen(src: &[Self], dst: &mut [f32]);
    /// `dst = round(src)` (round to nearest even).
    fn narrow(src: &[f32], dst: &mut [Self]);
    /// `acc += s * f32(src)` (one product, one sum per element); `tmp` is scratch.
    #[inline(always)]
    fn axpy(acc: &mut [f32], s: f32, src: &[Self], tmp: &mut [f32]) {
        Self::widen(src, tmp);
        for (o, v) in acc.iter_mut().zip(tmp.iter()) {
            *o += s * *v;
        }
    }
    /// True when [`Lanes::fused_f16c`] is a hand-vectorised F16C kernel.
    const HAS_F16C: bool = false;
    /// [`fused_token`] for the first `g` rows, using AVX2 + F16C where the type
    /// has such a kernel (the portable loop otherwise).
    ///
    /// # Safety
    /// When [`Lanes::HAS_F16C`], the CPU must support AVX2 and F16C.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn fused_f16c(skip: Option<&[Self]>, s: &[f32; GROUP], rows: &[&[Self]; GROUP], g: usize, out: &mut [Self]) {
        fused_dispatch(skip, s, rows, g, out)
    }
}

impl Lanes for f32 {
    const LANEWISE: bool = true;
    #[inline(always)]
    fn lane(self) -> f32 {
        self
    }
    #[inline(always)]
    fn widen(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
    #[inline(always)]
    fn narrow(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
    #[inline(always)]
    fn axpy(acc: &mut [f32], s: f32, src: &[f32], _tmp: &mut [f32]) {
        for (o, v) in acc.iter_mut().zip(src) {
            *o += s * *v;
        }
    }
}

impl Lanes for bf16 {
    const LANEWISE: bool = true;
    #[inline(always)]
    fn narrow_one(v: f32) -> Self {
        // Round to nearest even on the upper 16 bits; NaN stays a (quiet) NaN.
        let x = v.to_bits();
        let rounded = (x.wrapping_add(0x7fff + ((x >> 16) & 1)) >> 16) as u16;
        let nan = ((x >> 16) as u16) | 0x0040;
        bf16::from_bits(if v.is_nan() { nan } else { rounded })
    }
    #[inline(always)]
    fn lane(self) -> f32 {
        f32::from_bits((self.to_bits() as u32) << 16)
    }
    #[inline(always)]
    fn widen(src: &[bf16], dst: &mut [f32]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = f32::from_bits((s.to_bits() as u32) << 16);
        }
    }
    #[inline(always)]
    fn narrow(src: &[f32], dst: &mut [bf16]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = Self::narrow_one(*s);
        }
    }
    #[inline(always)]
    fn axpy(acc: &mut [f32], s: f32, src: &[bf16], _tmp: &mut [f32]) {
        for (o, v) in acc.iter_mut().zip(src) {
            *o += s * f32::from_bits((v.to_bits() as u32) << 16);
        }
    }
}

impl Lanes for f16 {
    const HAS_F16C: bool = true;
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn fused_f16c(skip: Option<&[f16]>, s: &[f32; GROUP], rows: &[&[f16]; GROUP], g: usize, out: &mut [f16]) {
        // SAFETY (all arms): the caller guarantees AVX2 and F16C.
        unsafe {
            match g {
                0 => f16c::fused::<0>(skip, s, rows, out),
                1 => f16c::fused::<1>(skip, s, rows, out),
                2 => f16c::fused::<2>(skip, s, rows, out),
                3 => f16c::fused::<3>(skip, s, rows, out),
                4 => f16c::fused::<4>(skip, s, rows, out),
                5 => f16c::fused::<5>(skip, s, rows, out),
                6 => f16c::fused::<6>(skip, s, rows, out),
                7 => f16c::fused::<7>(skip, s, rows, out),
                _ => f16c::fused::<8>(skip, s, rows, out),
            }
        }
    }
    #[inline(always)]
    fn widen(src: &[f16], dst: &mut [f32]) {
        use half::slice::HalfFloatSliceExt;
        src.convert_to_f32_slice(dst);
    }
    #[inline(always)]
    fn narrow(src: &[f32], dst: &mut [f16]) {
        use half::slice::HalfFloatSliceExt;
        dst.convert_from_f32_slice(src);
    }
}

/// Rows accumulated in one pass over H.
pub(super) const GROUP: usize = 8;

/// `acc += s[0] * row[0]; acc += s[1] * row[1]; ...` for the first `G` rows, in
/// one pass over H: every element sees the same operations in the same order as
/// `G` separate passes, but `G` source rows stream at once (more memory-level
/// parallelism for rows scattered in memory) and `acc` stays in registers.
#[inline(always)]
pub(super) fn accumulate_group<T: Lanes, const G: usize>(acc: &mut [f32], s: &[f32; GROUP], rows: &[&[T]; GROUP]) {
    let h = acc.len();
    let rows: [&[T]; G] = std::array::from_fn(|g| &rows[g][..h]);
    for (j, a) in acc.iter_mut().enumerate() {
        let mut v = *a;
        for g in 0..G {
            v += s[g] * rows[g][j].lane();
        }
        *a = v;
    }
}

/// The whole token in one pass when it is one group of real rows with no bias
/// and at most one skip input: `out = round(skip + s[0] * row[0] + ...)`, the
/// same operations in the same order as the general path, without the f32
/// scratch row.
#[inline(always)]
fn fused_token<T: Lanes, const G: usize>(skip: Option<&[T]>, s: &[f32; GROUP], rows: &[&[T]; GROUP], out: &mut [T]) {
    let h = out.len();
    let rows: [&[T]; G] = std::array::from_fn(|g| &rows[g][..h]);
    match skip {
        Some(x1) => {
            let x1 = &x1[..h];
            for (j, o) in out.iter_mut().enumerate() {
                let mut v = x1[j].lane();
                for g in 0..G {
                    v += s[g] * rows[g][j].lane();
                }
                *o = T::narrow_one(v);
            }
        }
        None => {
            for (j, o) in out.iter_mut().enumerate() {
                let mut v = 0.0f32;
                for g in 0..G {
                    v += s[g] * rows[g][j].lane();
                }
                *o = T::narrow_one(v);
            }
        }
    }
}

/// [`fused_token`] for the first `g` rows.
#[inline(always)]
pub(super) fn fused_dispatch<T: Lanes>(
    skip: Option<&[T]>,
    s: &[f32; GROUP],
    rows: &[&[T]; GROUP],
    g: usize,
    out: &mut [T],
) {
    match g {
        0 => fused_token::<T, 0>(skip, s, rows, out),
        1 => fused_token::<T, 1>(skip, s, rows, out),
        2 => fused_token::<T, 2>(skip, s, rows, out),
        3 => fused_token::<T, 3>(skip, s, rows, out),
        4 => fused_token::<T, 4>(skip, s, rows, out),
        5 => fused_token::<T, 5>(skip, s, rows, out),
        6 => fused_token::<T, 6>(skip, s, rows, out),
        7 => fused_token::<T, 7>(skip, s, rows, out),
        _ => fused_token::<T, 8>(skip, s, rows, out),
    }
}

/// f16 fused token, eight lanes at a time with F16C conversions. Every element
/// sees the same f32 operations in the same order as [`fused_token`] (separate
/// multiply and add, no FMA), and F16C rounds to nearest even exactly like
/// `f16::from_f32` (subnormals, overflow to infinity, quiet NaN), so the bits
/// match the portable path.
#[cfg(target_arch = "x86_64")]
mod f16c {
    use std::arch::x86_64::{
        __m128i, __m256, _mm256_add_ps, _mm256_cvtph_ps, _mm256_cvtps_ph, _mm256_mul_ps, _mm256_set1_ps,
        _mm256_setzero_ps, _mm_loadu_si128, _mm_storeu_si128, _MM_FROUND_TO_NEAREST_INT,
    };

    use half::f16;

    use crate::backend::cpu::finalize::lanes::GROUP;

    /// Eight f16 at `x[j..j + 8]` widened.
    #[inline(always)]
    unsafe fn load(x: &[f16], j: usize) -> __m256 {
        let x = &x[j..j + 8];
        // SAFETY: `x` holds 8 f16 = 16 bytes (unaligned load); the caller enables F16C.
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(x.as_ptr().cast::<__m128i>())) }
    }

    /// `out = round(skip + s[0] * rows[0] + ... + s[G-1] * rows[G-1])` (skip
    /// absent: starting from 0.0).
    ///
    /// # Safety
    /// The CPU must support AVX2 and F16C.
    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn fused<const G: usize>(
        skip: Option<&[f16]>,
        s: &[f32; GROUP],
        rows: &[&[f16]; GROUP],
        out: &mut [f16],
    ) {
        let h = out.len();
        let rows: [&[f16]; G] = std::array::from_fn(|g| &rows[g][..h]);
        let skip = skip.map(|x| &x[..h]);
        let sv: [__m256; G] = std::array::from_fn(|g| _mm256_set1_ps(s[g]));
        let main = h - h % 8;
        let mut j = 0;
        while j < main {
            // SAFETY: j + 8 <= h, every slice holds h elements; AVX2 + F16C are enabled.
            unsafe {
                let mut v = match skip {
                    Some(x) => load(x, j),
                    None => _mm256_setzero_ps(),
                };
                for g in 0..G {
                    v = _mm256_add_ps(v, _mm256_mul_ps(sv[g], load(rows[g], j)));
                }
                let o = &mut out[j..j + 8];
                _mm_storeu_si128(o.as_mut_ptr().cast::<__m128i>(), _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v));
            }
            j += 8;
        }
        for j in main..h {
            let mut v = skip.map_or(0.0, |x| x[j].to_f32());
            for g in 0..G {
                v += s[g] * rows[g][j].to_f32();
            }
            out[j] = f16::from_f32(v);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_narrow_matches_half_on_edge_values() {
        let vals = [
            0.0f32,
            -0.0,
            1.0,
            1.0 + f32::EPSILON,
            f32::from_bits(0x3f80_8000), // exact tie, even -> down
            f32::from_bits(0x3f81_8000), // exact tie, odd -> up
            f32::MAX,
            f32::MIN_POSITIVE / 3.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            -3.3e38,
        ];
        let mut out = vec![bf16::ZERO; vals.len()];
        bf16::narrow(&vals, &mut out);
        for (v, o) in vals.iter().zip(&out) {
            assert_eq!(o.to_bits(), bf16::from_f32(*v).to_bits(), "value {v:e}");
        }
        let mut nan = [bf16::ZERO];
        bf16::narrow(&[f32::NAN], &mut nan);
        assert!(nan[0].is_nan());
    }

    /// Edge values for f16 rounding: ties (even down, odd up), values that
    /// round into and out of the subnormal range, the largest finite value,
    /// overflow to infinity, signed zeros.
    fn f16_edge_values() -> Vec<f32> {
        vec![
            0.0f32,
            -0.0,
            1.0,
            -1.0,
            1.0 + f32::EPSILON,
            f32::from_bits(0x3f80_1000), // 1 + 2^-11: exact tie, even -> down
            f32::from_bits(0x3f80_3000), // 1 + 3 * 2^-11: exact tie, odd -> up
            f32::from_bits(0x3f80_0fff), // just below a tie
            65504.0,                     // max finite
            65519.99,                    // rounds down to max finite
            65520.0,                     // tie at the top: overflows to inf
            -70000.0,
            1e10,
            f32::INFINITY,
            f32::NEG_INFINITY,
            6.103_515_6e-5, // min normal
            6.0e-5,         // rounds into the subnormals
            5.960_464_5e-8, // min subnormal
            2.980_232_2e-8, // half the min subnormal: tie -> 0
            4.470_348_4e-8, // 1.5 min subnormal: tie -> even (2 * min)
            3.0e-8,         // just above half: min subnormal
            -1.0e-9,        // underflows to -0
            f32::MIN_POSITIVE,
            0.333_333_34,
        ]
    }

    #[test]
    fn f16_narrow_matches_half_on_edge_values() {
        let vals = f16_edge_values();
        let mut out = vec![f16::ZERO; vals.len()];
        f16::narrow(&vals, &mut out);
        for (v, o) in vals.iter().zip(&out) {
            assert_eq!(o.to_bits(), f16::from_f32(*v).to_bits(), "value {v:e}");
        }
        let mut nan = [f16::ZERO];
        f16::narrow(&[f32::NAN], &mut nan);
        assert!(nan[0].is_nan());
    }

    /// The F16C fused kernel against a naive per-element reference built on
    /// `half` conversions, on edge values (vector body and scalar tail).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn f16c_fused_matches_naive_reference() {
        if !(std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("f16c")) {
            return;
        }
        let edges = f16_edge_values();
        // 37 elements: four vectors of 8 and a tail of 5.
        let h = 37;
        let skip: Vec<f16> = (0..h).map(|j| f16::from_f32(edges[j % edges.len()])).collect();
        let srcs: Vec<Vec<f16>> = (0..GROUP)
            .map(|g| (0..h).map(|j| f16::from_f32(edges[(j * 7 + g * 3) % edges.len()] * 0.75)).collect())
            .collect();
        let s = [1.0f32, 0.5, -0.25, 2.0, 1.0e-3, -1.0, 0.125, 3.0];
        let rows: [&[f16]; GROUP] = std::array::from_fn(|g| srcs[g].as_slice());
        for g in 0..=GROUP {
            for with_skip in [false, true] {
                let sk = with_skip.then_some(skip.as_slice());
                let mut got = vec![f16::ZERO; h];
                // SAFETY: AVX2 and F16C were detected above.
                unsafe { f16::fused_f16c(sk, &s, &rows, g, &mut got) };
                for j in 0..h {
                    let mut v = if with_skip { skip[j].to_f32() } else { 0.0 };
                    for (gg, row) in srcs.iter().enumerate().take(g) {
                        v += s[gg] * row[j].to_f32();
                    }
                    let want = f16::from_f32(v);
                    let ok = got[j].to_bits() == want.to_bits() || (got[j].is_nan() && want.is_nan());
                    assert!(ok, "g={g} skip={with_skip} j={j}: {:#06x} vs {:#06x}", got[j].to_bits(), want.to_bits());
                }
            }
        }
    }
}
