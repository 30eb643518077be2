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
    /// The type's hand-vectorised AVX2 kernel for a fused token, if it has
    /// one (the portable [`fused_dispatch`] otherwise).
    const SIMD: Option<SimdKernel<Self>> = None;
    /// The same kernel for AVX-512 (F and BW), if the type has one.
    const SIMD512: Option<SimdKernel<Self>> = None;
}

/// A fused-token kernel: [`fused_dispatch`]'s arguments, plus `next`, the
/// rows of the token after this one, for prefetching (empty: none), and
/// `stream`: write `out` with streaming stores (from its first 16-byte
/// boundary on). `skip` may run on past `out.len()` elements, into the rest of
/// its input: only its first `out.len()` are summed, and the ones after them
/// (the next token's skip row) are prefetched.
///
/// # Safety
/// The CPU must support what the kernel is built for: AVX2 and F16C for
/// [`Lanes::SIMD`], AVX-512 F and BW for [`Lanes::SIMD512`]. With `stream`,
/// the calling thread must run `_mm_sfence` before anything else reads `out`
/// (streaming stores are not ordered with later ones or with the thread's
/// release).
pub(super) type SimdKernel<T> = unsafe fn(
    skip: Option<&[T]>,
    s: &[f32; GROUP],
    rows: &[&[T]; GROUP],
    g: usize,
    next: &[&[T]],
    out: &mut [T],
    stream: bool,
);

/// `$m::$f::<$t, G>(args)` for the group size `$g` (0..=[`GROUP`]).
#[cfg(target_arch = "x86_64")]
macro_rules! by_group {
    ($g:expr, $m:ident::$f:ident::<$t:ty>($($a:expr),* $(,)?)) => {
        match $g {
            0 => $m::$f::<$t, 0>($($a),*),
            1 => $m::$f::<$t, 1>($($a),*),
            2 => $m::$f::<$t, 2>($($a),*),
            3 => $m::$f::<$t, 3>($($a),*),
            4 => $m::$f::<$t, 4>($($a),*),
            5 => $m::$f::<$t, 5>($($a),*),
            6 => $m::$f::<$t, 6>($($a),*),
            7 => $m::$f::<$t, 7>($($a),*),
            _ => $m::$f::<$t, 8>($($a),*),
        }
    };
}

/// The [`SimdKernel`] of a type with an AVX2 kernel: `simd::fused` at `g`.
///
/// # Safety
/// As [`SimdKernel`], with AVX2 and F16C.
#[cfg(target_arch = "x86_64")]
unsafe fn simd_dispatch<T: Lanes>(
    skip: Option<&[T]>,
    s: &[f32; GROUP],
    rows: &[&[T]; GROUP],
    g: usize,
    next: &[&[T]],
    out: &mut [T],
    stream: bool,
) where
    simd::Avx2: simd::Step<T>,
{
    // SAFETY: the caller's contract (AVX2, F16C, the fence after streaming stores).
    unsafe { by_group!(g, simd::fused::<T>(skip, s, rows, next, out, stream)) }
}

/// The [`SimdKernel`] of a type with an AVX-512 kernel: `simd::fused512` at `g`.
///
/// # Safety
/// As [`SimdKernel`], with AVX-512 F and BW instead of AVX2 and F16C.
#[cfg(all(target_arch = "x86_64", amoe_avx512))]
#[clippy::msrv = "1.89"] // cfg(amoe_avx512): build.rs sets it when the intrinsics compile
unsafe fn simd512_dispatch<T: Lanes>(
    skip: Option<&[T]>,
    s: &[f32; GROUP],
    rows: &[&[T]; GROUP],
    g: usize,
    next: &[&[T]],
    out: &mut [T],
    stream: bool,
) where
    simd::Avx512: simd::Step<T>,
{
    // SAFETY: the caller's contract (AVX-512 F and BW, the fence after streaming stores).
    unsafe { by_group!(g, simd::fused512::<T>(skip, s, rows, next, out, stream)) }
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
    #[cfg(target_arch = "x86_64")]
    const SIMD: Option<SimdKernel<Self>> = Some(simd_dispatch::<Self>);
    #[cfg(all(target_arch = "x86_64", amoe_avx512))]
    #[clippy::msrv = "1.89"]
    const SIMD512: Option<SimdKernel<Self>> = Some(simd512_dispatch::<Self>);
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
    #[cfg(target_arch = "x86_64")]
    const SIMD: Option<SimdKernel<Self>> = Some(simd_dispatch::<Self>);
    #[cfg(all(target_arch = "x86_64", amoe_avx512))]
    #[clippy::msrv = "1.89"]
    const SIMD512: Option<SimdKernel<Self>> = Some(simd512_dispatch::<Self>);
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

/// Fused tokens sixteen elements a step on AVX2 (two registers of eight lanes)
/// and 32 on AVX-512 (two of sixteen), for f16 (F16C / AVX-512 F conversions)
/// and bf16 (16-bit unpacks). Every element sees the same f32
/// operations in the same order as [`fused_token`] (separate multiply and add,
/// no FMA), and both narrowings round exactly like [`Lanes::narrow_one`] (to
/// nearest even, subnormals, overflow, quiet NaN), so the bits match the
/// portable path.
///
/// Each source row is also prefetched [`simd::PREFETCH_AHEAD`] bytes ahead,
/// and a call that streams writes its output around the cache.
#[cfg(target_arch = "x86_64")]
mod simd {
    use std::arch::x86_64::{
        __m128i, __m256, __m256i, _mm256_add_epi32, _mm256_add_ps, _mm256_and_si256, _mm256_blendv_epi8,
        _mm256_castps_si256, _mm256_castsi256_ps, _mm256_castsi256_si128, _mm256_cmp_ps, _mm256_cvtph_ps,
        _mm256_cvtps_ph, _mm256_extracti128_si256, _mm256_loadu_si256, _mm256_mul_ps, _mm256_or_si256,
        _mm256_packus_epi32, _mm256_set1_epi32, _mm256_set1_ps, _mm256_setzero_ps, _mm256_setzero_si256,
        _mm256_srli_epi32, _mm256_storeu_si256, _mm256_unpackhi_epi16, _mm256_unpacklo_epi16, _mm_loadu_si128,
        _mm_prefetch, _mm_storeu_si128, _mm_stream_si128, _CMP_UNORD_Q, _MM_FROUND_TO_NEAREST_INT, _MM_HINT_T0,
    };

    #[cfg(amoe_avx512)]
    #[clippy::msrv = "1.89"] // cfg(amoe_avx512): build.rs sets it when the intrinsics compile
    use std::arch::x86_64::{
        __m512, __m512i, _mm512_add_epi32, _mm512_add_ps, _mm512_and_si512, _mm512_castps_si512,
        _mm512_castsi256_si512, _mm512_castsi512_ps, _mm512_cmp_ps_mask, _mm512_cvtph_ps, _mm512_cvtps_ph,
        _mm512_extracti32x4_epi32, _mm512_inserti64x4, _mm512_loadu_si512, _mm512_mask_blend_epi32, _mm512_mul_ps,
        _mm512_or_si512, _mm512_packus_epi32, _mm512_set1_epi32, _mm512_set1_ps, _mm512_setzero_ps,
        _mm512_setzero_si512, _mm512_srli_epi32, _mm512_storeu_si512, _mm512_unpackhi_epi16, _mm512_unpacklo_epi16,
    };

    use half::{bf16, f16};

    use crate::backend::cpu::finalize::lanes::{Lanes, GROUP};

    /// How far ahead of the element being summed each source row is
    /// prefetched, in bytes. A token streams up to [`GROUP`] rows at once, and
    /// the hardware prefetchers stop at every 4 KiB page, so without help each
    /// of those streams starts cold at every page boundary: in the middle of a
    /// long row, and again at each row of the next token. Near the end of a
    /// row the prefetch runs on into the next token's rows.
    ///
    /// Set by measurement (`ascend-moe bench finalize`, bf16 4096x8x4096 on 2
    /// threads, interleaved runs): 2.5-3 KiB ran 10-20% faster than no
    /// prefetch or 1 KiB; 4 KiB (32 KiB ahead over eight rows, most of an L1)
    /// lost the gain.
    pub(super) const PREFETCH_AHEAD: usize = 2560;

    /// The AVX2 registers: eight f32 lanes.
    #[derive(Clone, Copy)]
    pub(super) struct Avx2;

    /// The AVX-512 registers: sixteen f32 lanes.
    #[cfg(amoe_avx512)]
    #[clippy::msrv = "1.89"]
    #[derive(Clone, Copy)]
    pub(super) struct Avx512;

    /// The f32 arithmetic of one register width.
    ///
    /// # Safety (every method)
    /// The CPU supports the width's instructions (AVX2; AVX-512 F and BW).
    pub(super) trait Width {
        /// An f32 register.
        type F: Copy;
        /// `v` in every lane.
        unsafe fn splat(v: f32) -> Self::F;
        /// 0.0 in every lane.
        unsafe fn zero() -> Self::F;
        /// `acc + s * x` lane by lane: a multiply, then an add (no FMA, as
        /// the portable path).
        unsafe fn mul_add(acc: Self::F, s: Self::F, x: Self::F) -> Self::F;
    }

    /// One step of the fused kernel in a register width for the 16-bit type
    /// `T`: `N` elements widened into two registers and rounded back.
    ///
    /// `load` may spread the elements over its two registers in any order,
    /// the same for every call; `store` takes them back in that order. The
    /// kernel only adds and multiplies lane by lane, so every element meets
    /// the same lanes of every row and of `skip`.
    pub(super) trait Step<T>: Width {
        /// Elements per step.
        const N: usize;
        /// `N` elements at `p` widened, in this step's lane order.
        ///
        /// # Safety
        /// `p` is valid for reading `N` elements; the CPU supports the width.
        unsafe fn load(p: *const T) -> (Self::F, Self::F);
        /// `N` lanes in `load`'s order, rounded and stored at `p`; with
        /// `stream`, in streaming stores.
        ///
        /// # Safety
        /// `p` is valid for writing `N` elements; the CPU supports the width.
        /// With `stream`, `p` is 16-byte aligned and the calling thread runs
        /// `_mm_sfence` before anything reads the elements.
        unsafe fn store(a: Self::F, b: Self::F, p: *mut T, stream: bool);
    }

    impl Width for Avx2 {
        type F = __m256;
        #[inline(always)]
        unsafe fn splat(v: f32) -> __m256 {
            // SAFETY: a register-only operation; the caller enables AVX2.
            unsafe { _mm256_set1_ps(v) }
        }
        #[inline(always)]
        unsafe fn zero() -> __m256 {
            // SAFETY: as above.
            unsafe { _mm256_setzero_ps() }
        }
        #[inline(always)]
        unsafe fn mul_add(acc: __m256, s: __m256, x: __m256) -> __m256 {
            // SAFETY: as above.
            unsafe { _mm256_add_ps(acc, _mm256_mul_ps(s, x)) }
        }
    }

    /// The 32 bytes of `v` at `p` in two 16-byte streaming stores (a 32-byte
    /// one would need 32-byte alignment, which numpy arrays (16) do not
    /// promise).
    ///
    /// # Safety
    /// `p` is valid for writing 32 bytes and 16-byte aligned; the CPU supports
    /// AVX2; the calling thread runs `_mm_sfence` before anything reads them.
    #[inline(always)]
    unsafe fn stream32(v: __m256i, p: *mut __m128i) {
        // SAFETY: the caller's contract.
        unsafe {
            _mm_stream_si128(p, _mm256_castsi256_si128(v));
            _mm_stream_si128(p.add(1), _mm256_extracti128_si256::<1>(v));
        }
    }

    impl Step<f16> for Avx2 {
        const N: usize = 16;
        /// Elements 0-7 in the first register, 8-15 in the second.
        #[inline(always)]
        unsafe fn load(p: *const f16) -> (__m256, __m256) {
            // SAFETY: 16 f16 = 32 bytes readable at `p` (unaligned loads); F16C enabled.
            unsafe {
                (
                    _mm256_cvtph_ps(_mm_loadu_si128(p.cast::<__m128i>())),
                    _mm256_cvtph_ps(_mm_loadu_si128(p.add(8).cast::<__m128i>())),
                )
            }
        }
        #[inline(always)]
        unsafe fn store(a: __m256, b: __m256, p: *mut f16, stream: bool) {
            // SAFETY: 16 f16 = 32 bytes writable at `p` (unaligned stores), 16-byte aligned
            // when streamed (so is `p + 8`); F16C enabled.
            unsafe {
                let (a, b) =
                    (_mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(a), _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(b));
                if stream {
                    _mm_stream_si128(p.cast::<__m128i>(), a);
                    _mm_stream_si128(p.add(8).cast::<__m128i>(), b);
                } else {
                    _mm_storeu_si128(p.cast::<__m128i>(), a);
                    _mm_storeu_si128(p.add(8).cast::<__m128i>(), b);
                }
            }
        }
    }

    /// Eight f32 lanes rounded to bf16 as `narrow_one` does, one per 32-bit
    /// lane (in its lower half): add 0x7fff plus the kept lowest bit and keep
    /// the upper half; a NaN keeps its upper half with the quiet bit set.
    #[inline(always)]
    unsafe fn bf16_round(v: __m256) -> __m256i {
        // SAFETY: register-only AVX2 operations; the caller enables AVX2.
        unsafe {
            let x = _mm256_castps_si256(v);
            let hi = _mm256_srli_epi32::<16>(x);
            let bias = _mm256_add_epi32(_mm256_set1_epi32(0x7fff), _mm256_and_si256(hi, _mm256_set1_epi32(1)));
            let rounded = _mm256_srli_epi32::<16>(_mm256_add_epi32(x, bias));
            let quiet = _mm256_or_si256(hi, _mm256_set1_epi32(0x40));
            let nan = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_UNORD_Q>(v, v));
            _mm256_blendv_epi8(rounded, quiet, nan)
        }
    }

    impl Step<bf16> for Avx2 {
        const N: usize = 16;
        /// Elements 0-3 and 8-11 in the first register, 4-7 and 12-15 in the
        /// second: the order in which AVX2 unpacks 16-bit lanes within each
        /// 128-bit half, one instruction per eight elements.
        #[inline(always)]
        unsafe fn load(p: *const bf16) -> (__m256, __m256) {
            // SAFETY: 16 bf16 = 32 bytes readable at `p` (unaligned load); AVX2 enabled.
            // bf16 is the upper half of an f32: interleaving a zero below each
            // element widens it.
            unsafe {
                let x = _mm256_loadu_si256(p.cast::<__m256i>());
                let zero = _mm256_setzero_si256();
                (
                    _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, x)),
                    _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, x)),
                )
            }
        }
        #[inline(always)]
        unsafe fn store(a: __m256, b: __m256, p: *mut bf16, stream: bool) {
            // SAFETY: 16 bf16 = 32 bytes writable at `p` (unaligned store), 16-byte aligned
            // when streamed; AVX2 enabled.
            unsafe {
                // Every lane is at most 0xffff, so the saturating pack only
                // narrows. It takes four lanes of `a` then four of `b` in each
                // 128-bit half: elements 0-3, 4-7 | 8-11, 12-15, in order.
                let packed = _mm256_packus_epi32(bf16_round(a), bf16_round(b));
                if stream {
                    stream32(packed, p.cast::<__m128i>());
                } else {
                    _mm256_storeu_si256(p.cast::<__m256i>(), packed);
                }
            }
        }
    }

    #[cfg(amoe_avx512)]
    #[clippy::msrv = "1.89"]
    impl Width for Avx512 {
        type F = __m512;
        #[inline(always)]
        unsafe fn splat(v: f32) -> __m512 {
            // SAFETY: a register-only operation; the caller enables AVX-512 F.
            unsafe { _mm512_set1_ps(v) }
        }
        #[inline(always)]
        unsafe fn zero() -> __m512 {
            // SAFETY: as above.
            unsafe { _mm512_setzero_ps() }
        }
        #[inline(always)]
        unsafe fn mul_add(acc: __m512, s: __m512, x: __m512) -> __m512 {
            // SAFETY: as above.
            unsafe { _mm512_add_ps(acc, _mm512_mul_ps(s, x)) }
        }
    }

    /// The 64 bytes of `v` at `p` in four 16-byte streaming stores (see
    /// [`stream32`]).
    ///
    /// # Safety
    /// `p` is valid for writing 64 bytes and 16-byte aligned; the CPU supports
    /// AVX-512 F; the calling thread runs `_mm_sfence` before anything reads them.
    #[cfg(amoe_avx512)]
    #[clippy::msrv = "1.89"]
    #[inline(always)]
    unsafe fn stream64(v: __m512i, p: *mut __m128i) {
        // SAFETY: the caller's contract.
        unsafe {
            _mm_stream_si128(p, _mm512_extracti32x4_epi32::<0>(v));
            _mm_stream_si128(p.add(1), _mm512_extracti32x4_epi32::<1>(v));
            _mm_stream_si128(p.add(2), _mm512_extracti32x4_epi32::<2>(v));
            _mm_stream_si128(p.add(3), _mm512_extracti32x4_epi32::<3>(v));
        }
    }

    #[cfg(amoe_avx512)]
    #[clippy::msrv = "1.89"]
    impl Step<f16> for Avx512 {
        const N: usize = 32;
        /// Elements 0-15 in the first register, 16-31 in the second.
        #[inline(always)]
        unsafe fn load(p: *const f16) -> (__m512, __m512) {
            // SAFETY: 32 f16 = 64 bytes readable at `p` (unaligned loads); AVX-512 F enabled.
            unsafe {
                (
                    _mm512_cvtph_ps(_mm256_loadu_si256(p.cast::<__m256i>())),
                    _mm512_cvtph_ps(_mm256_loadu_si256(p.add(16).cast::<__m256i>())),
                )
            }
        }
        #[inline(always)]
        unsafe fn store(a: __m512, b: __m512, p: *mut f16, stream: bool) {
            // SAFETY: 64 bytes writable at `p`, 16-byte aligned when streamed; AVX-512 F enabled.
            unsafe {
                let (a, b) =
                    (_mm512_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(a), _mm512_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(b));
                if stream {
                    stream64(_mm512_inserti64x4::<1>(_mm512_castsi256_si512(a), b), p.cast::<__m128i>());
                } else {
                    _mm256_storeu_si256(p.cast::<__m256i>(), a);
                    _mm256_storeu_si256(p.add(16).cast::<__m256i>(), b);
                }
            }
        }
    }

    /// [`bf16_round`] on sixteen lanes.
    #[cfg(amoe_avx512)]
    #[clippy::msrv = "1.89"]
    #[inline(always)]
    unsafe fn bf16_round512(v: __m512) -> __m512i {
        // SAFETY: register-only AVX-512 F operations; the caller enables AVX-512 F.
        unsafe {
            let x = _mm512_castps_si512(v);
            let hi = _mm512_srli_epi32::<16>(x);
            let bias = _mm512_add_epi32(_mm512_set1_epi32(0x7fff), _mm512_and_si512(hi, _mm512_set1_epi32(1)));
            let rounded = _mm512_srli_epi32::<16>(_mm512_add_epi32(x, bias));
            let quiet = _mm512_or_si512(hi, _mm512_set1_epi32(0x40));
            _mm512_mask_blend_epi32(_mm512_cmp_ps_mask::<_CMP_UNORD_Q>(v, v), rounded, quiet)
        }
    }

    #[cfg(amoe_avx512)]
    #[clippy::msrv = "1.89"]
    impl Step<bf16> for Avx512 {
        const N: usize = 32;
        /// Per 128-bit quarter, as the AVX2 step per half: elements 0-3, 8-11,
        /// 16-19 and 24-27 in the first register, the others in the second.
        #[inline(always)]
        unsafe fn load(p: *const bf16) -> (__m512, __m512) {
            // SAFETY: 32 bf16 = 64 bytes readable at `p` (unaligned load); AVX-512 BW enabled.
            unsafe {
                let x = _mm512_loadu_si512(p.cast::<__m512i>());
                let zero = _mm512_setzero_si512();
                (
                    _mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, x)),
                    _mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, x)),
                )
            }
        }
        #[inline(always)]
        unsafe fn store(a: __m512, b: __m512, p: *mut bf16, stream: bool) {
            // SAFETY: 64 bytes writable at `p`, 16-byte aligned when streamed; AVX-512 BW enabled.
            // The pack takes each quarter's lanes back in element order, as the AVX2 step does.
            unsafe {
                let packed = _mm512_packus_epi32(bf16_round512(a), bf16_round512(b));
                if stream {
                    stream64(packed, p.cast::<__m128i>());
                } else {
                    _mm512_storeu_si512(p.cast::<__m512i>(), packed);
                }
            }
        }
    }

    /// Prefetches every row `PREFETCH_AHEAD` bytes past element `j` of `h`: in
    /// the row itself, or past its end in row `g` of `next`, where the next
    /// token has one; and the skip input as far past `j`, where it runs on
    /// that far. A hint only: it neither loads nor faults.
    ///
    /// The skip row matters as much as the others: without its prefetch, a
    /// bf16 4096x8x4096 finalize with one skip input spent a quarter of its
    /// kernel time waiting on that row's loads at each page it enters
    /// (`perf record -e cpu-clock`, one thread).
    #[inline(always)]
    fn prefetch_ahead<T, const G: usize>(rows: &[&[T]; G], next: &[&[T]], skip: Option<&[T]>, j: usize, h: usize) {
        let a = j + PREFETCH_AHEAD / std::mem::size_of::<T>();
        let hint = |p: &T| {
            // SAFETY: a prefetch of a live reference; SSE is baseline on x86_64.
            unsafe { _mm_prefetch::<_MM_HINT_T0>((p as *const T).cast()) }
        };
        for (g, row) in rows.iter().enumerate() {
            let p = if a < h { row.get(a) } else { next.get(g).and_then(|n| n.get(a - h)) };
            p.map(hint);
        }
        skip.and_then(|x| x.get(a)).map(hint);
    }

    /// `out = round(skip + s[0] * rows[0] + ... + s[G-1] * rows[G-1])` (skip
    /// absent: starting from 0.0), `W::N` elements a step. `stream`: the
    /// steps write with streaming stores (the elements before the first
    /// 16-byte boundary and the tail, the scalar way, with ordinary ones).
    ///
    /// # Safety
    /// The CPU supports `W`'s instructions. With `stream`, the calling thread
    /// runs `_mm_sfence` before anything reads `out`.
    #[inline(always)]
    unsafe fn fused_steps<W: Step<T>, T: Lanes, const G: usize>(
        skip: Option<&[T]>,
        s: &[f32; GROUP],
        rows: &[&[T]; GROUP],
        next: &[&[T]],
        out: &mut [T],
        stream: bool,
    ) {
        let h = out.len();
        let rows: [&[T]; G] = std::array::from_fn(|g| &rows[g][..h]);
        let ahead = skip;
        let skip = skip.map(|x| &x[..h]);
        // SAFETY: the caller enables W's instructions.
        let sv: [W::F; G] = std::array::from_fn(|g| unsafe { W::splat(s[g]) });
        let src: [*const T; G] = std::array::from_fn(|g| rows[g].as_ptr());
        let add = skip.map(|x| x.as_ptr());
        let dst = out.as_mut_ptr();
        // Streaming stores need 16-byte alignment: a row that starts off it
        // takes its first elements (under 16 bytes) the scalar way, and every
        // step after them is aligned (steps of 32 or 64 bytes).
        let head = match (dst as usize) % 16 {
            off if stream && off != 0 => ((16 - off) / std::mem::size_of::<T>()).min(h),
            _ => 0,
        };
        let main = head + (h - head) / W::N * W::N;
        // One prefetch per row per 64-byte line.
        let line = 64 / std::mem::size_of::<T>();
        let mut j = head;
        while j < main {
            if (j - head) % line == 0 {
                prefetch_ahead(&rows, next, ahead, j, h);
            }
            // SAFETY: j + N <= h, and every pointer is to a slice of h elements
            // (`out` is written only through `dst` in this loop); W's instructions
            // are enabled; `dst + j` is 16-byte aligned when streaming.
            unsafe {
                let (mut a, mut b) = match add {
                    Some(x) => W::load(x.add(j)),
                    None => (W::zero(), W::zero()),
                };
                for g in 0..G {
                    let (ra, rb) = W::load(src[g].add(j));
                    a = W::mul_add(a, sv[g], ra);
                    b = W::mul_add(b, sv[g], rb);
                }
                W::store(a, b, dst.add(j), stream);
            }
            j += W::N;
        }
        for j in (0..head).chain(main..h) {
            let mut v = skip.map_or(0.0, |x| x[j].lane());
            for g in 0..G {
                v += s[g] * rows[g][j].lane();
            }
            out[j] = T::narrow_one(v);
        }
    }

    /// [`fused_steps`] on AVX2, sixteen elements a step.
    ///
    /// # Safety
    /// The CPU must support AVX2 and F16C. With `stream`, the calling thread
    /// runs `_mm_sfence` before anything reads `out`.
    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn fused<T: Lanes, const G: usize>(
        skip: Option<&[T]>,
        s: &[f32; GROUP],
        rows: &[&[T]; GROUP],
        next: &[&[T]],
        out: &mut [T],
        stream: bool,
    ) where
        Avx2: Step<T>,
    {
        // SAFETY: AVX2 and F16C are enabled; the fence is the caller's.
        unsafe { fused_steps::<Avx2, T, G>(skip, s, rows, next, out, stream) }
    }

    /// [`fused_steps`] on AVX-512, 32 elements a step.
    ///
    /// # Safety
    /// The CPU must support AVX-512 F and BW. With `stream`, the calling
    /// thread runs `_mm_sfence` before anything reads `out`.
    #[cfg(amoe_avx512)]
    #[clippy::msrv = "1.89"]
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) unsafe fn fused512<T: Lanes, const G: usize>(
        skip: Option<&[T]>,
        s: &[f32; GROUP],
        rows: &[&[T]; GROUP],
        next: &[&[T]],
        out: &mut [T],
        stream: bool,
    ) where
        Avx512: Step<T>,
    {
        // SAFETY: AVX-512 F and BW are enabled; the fence is the caller's.
        unsafe { fused_steps::<Avx512, T, G>(skip, s, rows, next, out, stream) }
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

    /// Edge values for bf16 rounding: ties (even down, odd up), the carry into
    /// the exponent, the largest finite value and overflow, f32 subnormals,
    /// infinities and NaN.
    fn bf16_edge_values() -> Vec<f32> {
        vec![
            0.0f32,
            -0.0,
            1.0,
            -1.5,
            f32::from_bits(0x3f80_8000), // exact tie, even -> down
            f32::from_bits(0x3f81_8000), // exact tie, odd -> up
            f32::from_bits(0x3f80_7fff), // just below a tie
            f32::from_bits(0x3fff_ffff), // rounds up into the next exponent
            f32::from_bits(0x7f7f_0000), // max finite bf16
            f32::MAX,                    // overflows to inf
            -3.3e38,
            f32::MIN_POSITIVE,
            f32::from_bits(0x0000_8001), // subnormal, rounds up
            f32::from_bits(0x8000_0001), // tiny negative subnormal
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            0.333_333_34,
            1.0e-3,
        ]
    }

    /// A fused kernel of `T` against a naive per-element reference built on
    /// `half` conversions, on edge values, at every group size, with and
    /// without a skip input, for rows short enough that every prefetch runs
    /// into the next token's rows and long enough that most stay in the row
    /// (vector body and scalar tail in both), with ordinary and streaming
    /// stores. The caller has checked that the CPU runs `kernel`.
    #[cfg(target_arch = "x86_64")]
    fn simd_fused_matches_naive_reference<T: Lanes>(kernel: SimdKernel<T>, edges: &[f32]) {
        for h in [37, 1029] {
            let skip_input: Vec<T> =
                (0..2 * h).map(|j| T::from_f32(edges[j % edges.len()] * if j < h { 1.0 } else { 3.0 })).collect();
            let skip = &skip_input[..h];
            let srcs: Vec<Vec<T>> = (0..2 * GROUP)
                .map(|g| (0..h).map(|j| T::from_f32(edges[(j * 7 + g * 3) % edges.len()] * 0.75)).collect())
                .collect();
            let s = [1.0f32, 0.5, -0.25, 2.0, 1.0e-3, -1.0, 0.125, 3.0];
            let rows: [&[T]; GROUP] = std::array::from_fn(|g| srcs[g].as_slice());
            let next: Vec<&[T]> = srcs[GROUP..].iter().map(|r| r.as_slice()).collect();
            // Rows 64-byte aligned, 16-byte aligned (8 elements on) and off
            // every 16-byte boundary (1 and 3 elements on: streaming starts
            // after a scalar head), with streaming stores and without.
            let esz = std::mem::size_of::<T>();
            let mut buf = vec![0u128; (h * esz).div_ceil(16) + 4];
            let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut buf);
            let base = bytes.as_ptr().align_offset(64);
            for (g, with_skip, stream, offset) in (0..=GROUP).flat_map(|g| {
                [
                    (false, false, 0),
                    (true, false, 0),
                    (true, true, 0),
                    (false, true, 0),
                    (true, true, 1),
                    (true, true, 3),
                    (true, true, 8),
                ]
                .map(|(sk, st, off)| (g, sk, st, off))
            }) {
                // The skip input runs on past the row (the next token's), as the
                // caller passes it: only its first `h` elements count.
                let sk = with_skip.then_some(skip_input.as_slice());
                // `base` is at most 48 bytes (the buffer is 16-byte aligned) and
                // `offset` at most 8 elements of 2 bytes: inside the 64 spare bytes.
                let start = base + offset * esz;
                let got: &mut [T] = bytemuck::cast_slice_mut(&mut bytes[start..start + h * esz]);
                got.fill(T::default());
                // SAFETY: the caller checked the CPU; the fence follows the streaming stores.
                unsafe {
                    kernel(sk, &s, &rows, g, &next, got, stream);
                    std::arch::x86_64::_mm_sfence();
                }
                let ctx = format!("stream={stream} offset={offset}");
                for j in 0..h {
                    let mut v = if with_skip { skip[j].to_f32() } else { 0.0 };
                    for (gg, row) in srcs.iter().enumerate().take(g) {
                        v += s[gg] * row[j].to_f32();
                    }
                    let want = T::from_f32(v);
                    // The same bits, NaN payloads and quiet bits included.
                    let ok = bytemuck::bytes_of(&got[j]) == bytemuck::bytes_of(&want);
                    let (gv, wv) = (got[j].to_f32(), want.to_f32());
                    assert!(ok, "h={h} g={g} skip={with_skip} {ctx} j={j}: {gv:e} vs {wv:e}");
                }
            }
        }
    }

    /// The AVX2 kernels, then the AVX-512 ones, of `T`, where this CPU runs them.
    #[cfg(target_arch = "x86_64")]
    fn simd_kernels<T: Lanes>() -> Vec<SimdKernel<T>> {
        let mut kernels = Vec::new();
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("f16c") {
            kernels.push(T::SIMD.expect("an AVX2 kernel"));
        }
        #[cfg(amoe_avx512)]
        if std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("avx512bw") {
            kernels.push(T::SIMD512.expect("an AVX-512 kernel"));
        }
        kernels
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn f16_simd_fused_matches_naive_reference() {
        for kernel in simd_kernels::<f16>() {
            simd_fused_matches_naive_reference::<f16>(kernel, &f16_edge_values());
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn bf16_simd_fused_matches_naive_reference() {
        for kernel in simd_kernels::<bf16>() {
            simd_fused_matches_naive_reference::<bf16>(kernel, &bf16_edge_values());
        }
    }
}
