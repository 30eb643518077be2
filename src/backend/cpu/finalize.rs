//! CPU finalize-routing and token-unpermute kernels (SPEC section 1).
//!
//! Both ops are "gather K rows per token, scale, sum": one kernel serves both.
//! Work is split over output rows into contiguous chunks, one per thread
//! (`std::thread::scope`); each output row is computed by exactly one thread in
//! the SPEC order (`acc = x1 (+ x2)`, then `acc += s * (row + bias)` for
//! k = 0..K-1, all in f32, one final rounding), so the result is bitwise the
//! same for any thread count.
//!
//! The inner loops run over H and vectorise. For f32 and bf16 without bias, up
//! to eight source rows are streamed in one pass (each element still sees the
//! same operations in the same order), and a token with one skip input and
//! K <= 8 goes from its inputs to its rounded output row in a single pass. On
//! x86_64 the same code is also compiled for AVX2 and picked at run time; no
//! fused multiply-add is used, so both paths give the same bits.
//!
//! The thread count is the calling thread's override ([`set_num_threads`]),
//! else `ASCEND_MOE_NUM_THREADS`, else the machine's parallelism; small calls run
//! on the calling thread.

use std::cell::Cell;

use half::{bf16, f16};

use super::{host, host_mut, CpuComm};
use crate::backend::{FinalizeArgs, FinalizeDims, OutputRows};
use crate::comm::ReduceOp;
use crate::{DType, Element, Error, Result, Tensor};

const FINALIZE: &str = "moe_finalize_routing";
const UNPERMUTE: &str = "moe_token_unpermute";

/// Elements of output a thread must have before another thread is worth spawning.
const MIN_ELEMS_PER_THREAD: usize = 1 << 16;

thread_local! {
    static THREADS: Cell<Option<usize>> = const { Cell::new(None) };
    static WIDE_SIMD: Cell<bool> = const { Cell::new(true) };
}

/// Allows (`true`, the default) or forbids the wider SIMD code path (AVX2) for
/// calls made from the current thread. Both paths do the same operations in the
/// same order; the switch exists so tests can show they agree bit for bit.
pub fn set_wide_simd(enabled: bool) {
    WIDE_SIMD.with(|w| w.set(enabled));
}

/// Sets the number of threads the CPU kernels use for calls made from the
/// current thread (`None`: back to the default). A forced count is used even
/// for small calls, which is what the determinism tests need.
pub fn set_num_threads(n: Option<usize>) {
    THREADS.with(|t| t.set(n.map(|n| n.max(1))));
}

/// The default thread count: `ASCEND_MOE_NUM_THREADS`, else the available parallelism.
pub fn default_num_threads() -> usize {
    std::env::var("ASCEND_MOE_NUM_THREADS")
        .ok()
        .and_then(|s| s.trim().parse::<usize>().ok())
        .filter(|n| *n > 0)
        .unwrap_or_else(|| std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1))
}

/// Threads for a call producing `rows` rows of `h` elements.
fn threads_for(rows: usize, h: usize) -> usize {
    let t = match THREADS.with(|t| t.get()) {
        Some(n) => n,
        None => default_num_threads().min((rows * h / MIN_ELEMS_PER_THREAD).max(1)),
    };
    t.clamp(1, rows.max(1))
}

/// Row conversions between an element type and f32 scratch rows.
trait Lanes: Element {
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
const GROUP: usize = 8;

/// `acc += s[0] * row[0]; acc += s[1] * row[1]; ...` for the first `G` rows, in
/// one pass over H: every element sees the same operations in the same order as
/// `G` separate passes, but `G` source rows stream at once (more memory-level
/// parallelism for rows scattered in memory) and `acc` stays in registers.
#[inline(always)]
fn accumulate_group<T: Lanes, const G: usize>(acc: &mut [f32], s: &[f32; GROUP], rows: &[&[T]; GROUP]) {
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
fn fused_dispatch<T: Lanes>(skip: Option<&[T]>, s: &[f32; GROUP], rows: &[&[T]; GROUP], g: usize, out: &mut [T]) {
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

    use super::GROUP;

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

/// What one output token gathers. Shared by finalize and unpermute.
struct Gather<'a, T> {
    /// Source rows, `[rows, h]`.
    x: &'a [T],
    rows: usize,
    h: usize,
    x1: Option<&'a [T]>,
    x2: Option<&'a [T]>,
    /// Bias `[E, h]`, widened once, and the expert of each (i, k) slot (row-major).
    bias: Option<(Vec<f32>, &'a [i32])>,
    /// Scales `[N, K]` row-major, widened once.
    scales: Option<Vec<f32>>,
    idx: &'a [i32],
    n: usize,
    k: usize,
    row_layout: bool,
    /// Unpermute: an index outside `[0, rows)` contributes nothing. Finalize:
    /// indices are validated, a negative one is a dropped slot (zero row).
    skip_invalid: bool,
}

impl<T: Lanes> Gather<'_, T> {
    /// Collects up to [`GROUP`] consecutive real rows of token `i` from slot
    /// `*kk` on (skipping out-of-range slots where they contribute nothing),
    /// stopping before a dropped slot. Returns how many were collected.
    #[inline(always)]
    fn collect_group<'s>(
        &'s self,
        i: usize,
        kk: &mut usize,
        rows: &mut [&'s [T]; GROUP],
        ss: &mut [f32; GROUP],
    ) -> usize {
        let h = self.h;
        let mut g = 0;
        while *kk < self.k && g < GROUP {
            let slot = i * self.k + *kk;
            let r = self.idx[if self.row_layout { slot } else { *kk * self.n + i }];
            if r >= 0 && (r as usize) < self.rows {
                let r = r as usize;
                rows[g] = &self.x[r * h..(r + 1) * h];
                ss[g] = self.scales.as_ref().map_or(1.0, |s| s[slot]);
                g += 1;
                *kk += 1;
            } else if self.skip_invalid {
                *kk += 1;
            } else {
                break;
            }
        }
        g
    }

    /// Token `i` straight into `out` in one pass, when it qualifies: element
    /// types widened per lane, no bias, at most one skip input, and all its
    /// slots in one group. Returns false (nothing written) otherwise.
    ///
    /// `f16c`: the caller runs with AVX2 and F16C enabled (types with an F16C
    /// kernel then qualify too).
    #[inline(always)]
    fn fused_token(&self, i: usize, out: &mut [T], f16c: bool) -> bool {
        let f16c = f16c && T::HAS_F16C;
        if !(T::LANEWISE || f16c) || self.bias.is_some() || self.k > GROUP || (self.x1.is_some() && self.x2.is_some()) {
            return false;
        }
        let h = self.h;
        let mut rows: [&[T]; GROUP] = [&[]; GROUP];
        let mut ss = [0f32; GROUP];
        let mut kk = 0;
        let g = self.collect_group(i, &mut kk, &mut rows, &mut ss);
        if kk < self.k {
            return false; // a dropped slot: the general path keeps the order
        }
        let skip = self.x1.or(self.x2).map(|x| &x[i * h..(i + 1) * h]);
        #[cfg(target_arch = "x86_64")]
        if f16c {
            // SAFETY: `f16c` is only true when the caller runs with AVX2 and F16C.
            unsafe { T::fused_f16c(skip, &ss, &rows, g, out) };
            return true;
        }
        fused_dispatch(skip, &ss, &rows, g, out);
        true
    }

    /// Computes token `i` into `acc` (f32), using `tmp` as scratch.
    #[inline(always)]
    fn token(&self, i: usize, acc: &mut [f32], tmp: &mut [f32]) {
        let h = self.h;
        match (self.x1, self.x2) {
            (Some(a), Some(b)) => {
                T::widen(&a[i * h..(i + 1) * h], acc);
                T::widen(&b[i * h..(i + 1) * h], tmp);
                for (o, v) in acc.iter_mut().zip(tmp.iter()) {
                    *o += *v;
                }
            }
            (Some(a), None) | (None, Some(a)) => T::widen(&a[i * h..(i + 1) * h], acc),
            (None, None) => acc.fill(0.0),
        }
        let mut kk = 0;
        while kk < self.k {
            if T::LANEWISE && self.bias.is_none() {
                // Up to GROUP consecutive real rows, streamed together.
                let mut rows: [&[T]; GROUP] = [&[]; GROUP];
                let mut ss = [0f32; GROUP];
                let g = self.collect_group(i, &mut kk, &mut rows, &mut ss);
                match g {
                    1 => accumulate_group::<T, 1>(acc, &ss, &rows),
                    2 => accumulate_group::<T, 2>(acc, &ss, &rows),
                    3 => accumulate_group::<T, 3>(acc, &ss, &rows),
                    4 => accumulate_group::<T, 4>(acc, &ss, &rows),
                    5 => accumulate_group::<T, 5>(acc, &ss, &rows),
                    6 => accumulate_group::<T, 6>(acc, &ss, &rows),
                    7 => accumulate_group::<T, 7>(acc, &ss, &rows),
                    8 => accumulate_group::<T, 8>(acc, &ss, &rows),
                    _ => {}
                }
                if g > 0 || kk >= self.k {
                    continue;
                }
                // A dropped slot: the general path below, in order.
            }
            let slot = i * self.k + kk;
            let pos = if self.row_layout { slot } else { kk * self.n + i };
            kk += 1;
            let r = self.idx[pos];
            let s = self.scales.as_ref().map_or(1.0, |s| s[slot]);
            let in_range = r >= 0 && (r as usize) < self.rows;
            if !in_range && self.skip_invalid {
                continue;
            }
            match (&self.bias, in_range) {
                // The common case: a real row and no bias, widened on the fly.
                (None, true) => {
                    let r = r as usize;
                    T::axpy(acc, s, &self.x[r * h..(r + 1) * h], tmp);
                    continue;
                }
                (_, true) => {
                    let r = r as usize;
                    T::widen(&self.x[r * h..(r + 1) * h], tmp);
                }
                (_, false) => tmp.fill(0.0),
            }
            match &self.bias {
                Some((b, experts)) => {
                    // Validated by the caller: 0 <= e < E.
                    let e = experts[slot] as usize;
                    let b = &b[e * h..(e + 1) * h];
                    for ((o, v), bv) in acc.iter_mut().zip(tmp.iter()).zip(b) {
                        *o += s * (*v + *bv);
                    }
                }
                None => {
                    for (o, v) in acc.iter_mut().zip(tmp.iter()) {
                        *o += s * *v;
                    }
                }
            }
        }
    }

    /// Computes the output rows of `chunk` (first row `first_row`).
    /// `f16c`: AVX2 and F16C are available (see [`Gather::fused_token`]).
    #[inline(always)]
    fn rows_generic(
        &self,
        first_row: usize,
        chunk: &mut [T],
        token_of: &(dyn Fn(usize) -> Option<usize> + Sync),
        f16c: bool,
    ) {
        let h = self.h;
        let mut acc = vec![0f32; h];
        let mut tmp = vec![0f32; h];
        for (j, o) in chunk.chunks_exact_mut(h).enumerate() {
            match token_of(first_row + j) {
                Some(i) => {
                    if !self.fused_token(i, o, f16c) {
                        self.token(i, &mut acc, &mut tmp);
                        T::narrow(&acc, o);
                    }
                }
                None => o.fill(T::default()),
            }
        }
    }

    /// [`Gather::rows_generic`] compiled for AVX2. Same operations in the same
    /// order (no fused multiply-add), so bitwise the same results.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    unsafe fn rows_avx2(&self, first_row: usize, chunk: &mut [T], token_of: &(dyn Fn(usize) -> Option<usize> + Sync)) {
        self.rows_generic(first_row, chunk, token_of, false)
    }

    /// [`Gather::rows_avx2`] with F16C as well, for types with an F16C kernel.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn rows_avx2_f16c(
        &self,
        first_row: usize,
        chunk: &mut [T],
        token_of: &(dyn Fn(usize) -> Option<usize> + Sync),
    ) {
        self.rows_generic(first_row, chunk, token_of, true)
    }

    /// Fills `out` (`out_rows` rows of `h`), row `j` taking token `token_of(j)`
    /// or zeros.
    fn run(&self, out: &mut [T], out_rows: usize, token_of: &(dyn Fn(usize) -> Option<usize> + Sync)) {
        let h = self.h;
        if out_rows == 0 || h == 0 {
            return;
        }
        let threads = threads_for(out_rows, h);
        let chunk_rows = out_rows.div_ceil(threads);
        let wide = WIDE_SIMD.with(|w| w.get());
        let work = |first_row: usize, chunk: &mut [T]| {
            #[cfg(target_arch = "x86_64")]
            if wide && std::arch::is_x86_feature_detected!("avx2") {
                if T::HAS_F16C && std::arch::is_x86_feature_detected!("f16c") {
                    // SAFETY: the CPU supports AVX2 and F16C (checked just above).
                    unsafe { self.rows_avx2_f16c(first_row, chunk, token_of) };
                    return;
                }
                // SAFETY: the CPU supports AVX2 (checked just above).
                unsafe { self.rows_avx2(first_row, chunk, token_of) };
                return;
            }
            self.rows_generic(first_row, chunk, token_of, false);
        };
        if threads == 1 {
            work(0, out);
            return;
        }
        std::thread::scope(|sc| {
            let mut chunks = out.chunks_mut(chunk_rows * h).enumerate();
            // The calling thread takes the first chunk itself.
            let first = chunks.next();
            for (c, chunk) in chunks {
                let work = &work;
                sc.spawn(move || work(c * chunk_rows, chunk));
            }
            if let Some((_, chunk)) = first {
                work(0, chunk);
            }
        });
    }
}

/// Widens a float tensor (any of the three float dtypes) to f32.
fn widen_any(op: &'static str, arg: &'static str, t: &Tensor) -> Result<Vec<f32>> {
    host(op, arg, t)?;
    Ok(match t.dtype() {
        DType::F32 => t.as_slice::<f32>()?.to_vec(),
        DType::F16 => t.as_slice::<f16>()?.iter().map(|v| v.to_f32()).collect(),
        DType::BF16 => t.as_slice::<bf16>()?.iter().map(|v| v.to_f32()).collect(),
        d => return Err(Error::dtype(op, arg, "f32, f16 or bf16", d)),
    })
}

/// The `[N, K]` routing weights `t` widened to f32.
fn weights(op: &'static str, arg: &'static str, t: &Tensor, n: usize, k: usize) -> Result<Vec<f32>> {
    let v = widen_any(op, arg, t)?;
    if v.len() != n * k {
        return Err(Error::shape(op, arg, format!("[{n}, {k}]"), t.shape()));
    }
    Ok(v)
}

/// Index slice of an int32 tensor on the host.
fn indices<'a>(op: &'static str, arg: &'static str, t: &'a Tensor) -> Result<&'a [i32]> {
    host(op, arg, t)?;
    if t.dtype() != DType::I32 {
        return Err(Error::dtype(op, arg, "i32", t.dtype()));
    }
    t.as_slice::<i32>()
}

/// Checks that every index lies in `[lo, hi)`; the first offender names its
/// position and value.
fn check_range(op: &'static str, arg: &'static str, idx: &[i32], lo: i64, hi: usize) -> Result<()> {
    match idx.iter().position(|&v| (v as i64) < lo || (v as i64) >= hi as i64) {
        None => Ok(()),
        Some(position) => Err(Error::IndexOutOfRange {
            op,
            arg,
            position,
            value: idx[position] as i64,
            valid: format!("[{lo}, {hi})"),
        }),
    }
}

/// A typed data slice of `t`, which must have dtype `T` and `len` elements.
fn data<'a, T: Element>(op: &'static str, arg: &'static str, t: &'a Tensor, len: usize) -> Result<&'a [T]> {
    host(op, arg, t)?;
    if t.dtype() != T::DTYPE {
        return Err(Error::dtype(op, arg, T::DTYPE.name(), t.dtype()));
    }
    let s = t.as_slice::<T>()?;
    if s.len() != len {
        return Err(Error::shape(op, arg, format!("{len} elements"), t.shape()));
    }
    Ok(s)
}

/// Fused finalize routing on the host (SPEC section 1).
///
/// `dims` come from the op layer's shape function; this function re-checks
/// every length it relies on (so it never reads out of bounds even when called
/// directly) and every index value.
pub fn finalize_routing(
    args: &FinalizeArgs<'_>,
    dims: &FinalizeDims,
    out: &mut Tensor,
    rows: OutputRows<'_>,
) -> Result<()> {
    match args.expanded_x.dtype() {
        DType::F32 => finalize_typed::<f32>(args, dims, out, rows),
        DType::F16 => finalize_typed::<f16>(args, dims, out, rows),
        DType::BF16 => finalize_typed::<bf16>(args, dims, out, rows),
        d => Err(Error::dtype(FINALIZE, "expanded_x", "f32, f16 or bf16", d)),
    }
}

/// Validates every input of a finalize (lengths and index values) and
/// collects what each output token gathers.
fn finalize_gather<'a, T: Lanes>(args: &FinalizeArgs<'a>, dims: &FinalizeDims) -> Result<Gather<'a, T>> {
    let FinalizeDims { n, k, h, expanded_rows, experts } = *dims;
    let x = data::<T>(FINALIZE, "expanded_x", args.expanded_x, expanded_rows * h)?;
    let idx = indices(FINALIZE, "expanded_row_idx", args.expanded_row_idx)?;
    if idx.len() != n * k {
        let want = format!("[{}] (N*K = {n}*{k})", n * k);
        return Err(Error::shape(FINALIZE, "expanded_row_idx", want, args.expanded_row_idx.shape()));
    }
    let x1 = args.x1.map(|t| data::<T>(FINALIZE, "x1", t, n * h)).transpose()?;
    let x2 = args.x2.map(|t| data::<T>(FINALIZE, "x2", t, n * h)).transpose()?;
    let scales = args.scales.map(|s| weights(FINALIZE, "scales", s, n, k)).transpose()?;
    let bias = match (args.bias, args.expert_idx) {
        (Some(b), Some(e)) => {
            let bv = widen_any(FINALIZE, "bias", b)?;
            if bv.len() != experts * h {
                return Err(Error::shape(FINALIZE, "bias", format!("[{experts}, {h}]"), b.shape()));
            }
            let ev = indices(FINALIZE, "expert_idx", e)?;
            if ev.len() != n * k {
                return Err(Error::shape(FINALIZE, "expert_idx", format!("[{n}, {k}]"), e.shape()));
            }
            check_range(FINALIZE, "expert_idx", ev, 0, experts)?;
            Some((bv, ev))
        }
        (Some(_), None) => {
            return Err(Error::invalid(FINALIZE, "expert_idx", "required when bias is given, got none"));
        }
        (None, _) => None,
    };
    let lo = if args.drop_pad_mode.is_drop_pad() { -1 } else { 0 };
    check_range(FINALIZE, "expanded_row_idx", idx, lo, expanded_rows)?;
    Ok(Gather {
        x,
        rows: expanded_rows,
        h,
        x1,
        x2,
        bias,
        scales,
        idx,
        n,
        k,
        row_layout: args.drop_pad_mode.is_row_layout(),
        skip_invalid: false,
    })
}

fn finalize_typed<T: Lanes>(
    args: &FinalizeArgs<'_>,
    dims: &FinalizeDims,
    out: &mut Tensor,
    rows: OutputRows<'_>,
) -> Result<()> {
    let g = finalize_gather::<T>(args, dims)?;
    let (n, h) = (dims.n, dims.h);
    let out_rows = match rows {
        OutputRows::Dense => n,
        OutputRows::Padded { local_sizes, slot_rows } => {
            let total: usize = local_sizes.iter().sum();
            if total != n {
                return Err(Error::invalid(
                    FINALIZE,
                    "local_sizes",
                    format!("sum {total} must equal the token count N = {n}"),
                ));
            }
            if let Some(m) = local_sizes.iter().copied().max().filter(|m| *m > slot_rows) {
                return Err(Error::invalid(
                    FINALIZE,
                    "slot_rows",
                    format!("{slot_rows} is less than the largest local size {m}"),
                ));
            }
            local_sizes.len() * slot_rows
        }
    };
    if out.dtype() != T::DTYPE {
        return Err(Error::dtype(FINALIZE, "out", T::DTYPE.name(), out.dtype()));
    }
    if out.numel() != out_rows * h {
        return Err(Error::shape(FINALIZE, "out", format!("{out_rows} rows of {h} elements"), out.shape()));
    }
    let o: &mut [T] = bytemuck::cast_slice_mut(host_mut(FINALIZE, "out", out)?);
    match rows {
        OutputRows::Dense => g.run(o, out_rows, &Some),
        OutputRows::Padded { local_sizes, slot_rows } => {
            let mut offsets = Vec::with_capacity(local_sizes.len());
            let mut acc = 0;
            for &s in local_sizes {
                offsets.push(acc);
                acc += s;
            }
            let token_of = move |j: usize| {
                let (r, off) = (j / slot_rows, j % slot_rows);
                (off < local_sizes[r]).then(|| offsets[r] + off)
            };
            g.run(o, out_rows, &token_of)
        }
    }
    Ok(())
}

/// Finalize routing fused with the EP reduce-scatter over a CPU communicator:
/// this rank's finalize output (`[N, H]`, tokens in EP-rank block order, block
/// `r` = `local_sizes[r]` tokens) is computed straight into `comm`'s staging
/// buffers and summed over the ranks; `out` (`[local_sizes[rank], H]`)
/// receives block `rank` of the sum. Bitwise the same as the dense finalize
/// followed by a reduce-scatter of the blocks, without the finalize output
/// ever being written to or read from a buffer of its own.
///
/// An invalid input fails the call on every rank of `comm` (with this rank's
/// reason), not only here. Needs `comm.rows_per_region(H, dtype) >= 1`.
pub fn finalize_reduce_scatter(
    args: &FinalizeArgs<'_>,
    dims: &FinalizeDims,
    local_sizes: &[usize],
    comm: &CpuComm,
    out: &mut Tensor,
) -> Result<()> {
    let dtype = args.expanded_x.dtype();
    match dtype {
        DType::F32 => reduce_scatter_typed::<f32>(args, dims, local_sizes, comm, out),
        DType::F16 => reduce_scatter_typed::<f16>(args, dims, local_sizes, comm, out),
        DType::BF16 => reduce_scatter_typed::<bf16>(args, dims, local_sizes, comm, out),
        d => {
            let e = Err(Error::dtype(FINALIZE, "expanded_x", "f32, f16 or bf16", d));
            comm.reduce_scatter_rows_with(d, ReduceOp::Sum, local_sizes, dims.h, out, e, &mut |_, _, _| {})
        }
    }
}

fn reduce_scatter_typed<T: Lanes>(
    args: &FinalizeArgs<'_>,
    dims: &FinalizeDims,
    local_sizes: &[usize],
    comm: &CpuComm,
    out: &mut Tensor,
) -> Result<()> {
    let h = dims.h;
    let gather = finalize_gather::<T>(args, dims).and_then(|g| {
        let total = local_sizes.iter().try_fold(0usize, |a, &s| a.checked_add(s));
        if total != Some(dims.n) {
            let why = format!("{local_sizes:?} must sum to the token count N = {}", dims.n);
            return Err(Error::invalid(FINALIZE, "local_sizes", why));
        }
        Ok(g)
    });
    let (g, local) = match gather {
        Ok(g) => (Some(g), Ok(())),
        Err(e) => (None, Err(e)),
    };
    let offsets: Vec<usize> = local_sizes
        .iter()
        .scan(0usize, |acc, &s| {
            let o = *acc;
            *acc = acc.saturating_add(s);
            Some(o)
        })
        .collect();
    let mut produce = |block: usize, first: usize, bytes: &mut [u8]| {
        // Called only when `local` is Ok, i.e. with `g` present.
        if let Some(g) = &g {
            let o: &mut [T] = bytemuck::cast_slice_mut(bytes);
            let base = offsets[block] + first;
            g.run(o, o.len() / h, &|r| Some(base + r));
        }
    };
    comm.reduce_scatter_rows_with(T::DTYPE, ReduceOp::Sum, local_sizes, h, out, local, &mut produce)
}

/// Token unpermute on the host: `out[t] = sum_k probs[t,k] * permuted[idx[t*K + k]]`;
/// an index outside `[0, permuted.rows)` contributes nothing.
pub fn token_unpermute(
    permuted: &Tensor,
    sorted_indices: &Tensor,
    probs: Option<&Tensor>,
    k: usize,
    out: &mut Tensor,
) -> Result<()> {
    match permuted.dtype() {
        DType::F32 => unpermute_typed::<f32>(permuted, sorted_indices, probs, k, out),
        DType::F16 => unpermute_typed::<f16>(permuted, sorted_indices, probs, k, out),
        DType::BF16 => unpermute_typed::<bf16>(permuted, sorted_indices, probs, k, out),
        d => Err(Error::dtype(UNPERMUTE, "permuted", "f32, f16 or bf16", d)),
    }
}

fn unpermute_typed<T: Lanes>(
    permuted: &Tensor,
    sorted_indices: &Tensor,
    probs: Option<&Tensor>,
    k: usize,
    out: &mut Tensor,
) -> Result<()> {
    let h = permuted.row_len();
    let rows = if permuted.shape().is_empty() { 0 } else { permuted.rows() };
    let x = data::<T>(UNPERMUTE, "permuted", permuted, rows * h)?;
    let idx = indices(UNPERMUTE, "sorted_indices", sorted_indices)?;
    if k == 0 || idx.len() % k != 0 {
        return Err(Error::invalid(UNPERMUTE, "k", format!("{k} does not divide the {} indices", idx.len())));
    }
    let n = idx.len() / k;
    let scales = probs.map(|p| weights(UNPERMUTE, "probs", p, n, k)).transpose()?;
    if out.dtype() != T::DTYPE {
        return Err(Error::dtype(UNPERMUTE, "out", T::DTYPE.name(), out.dtype()));
    }
    if out.numel() != n * h {
        return Err(Error::shape(UNPERMUTE, "out", format!("{n} rows of {h} elements"), out.shape()));
    }
    let o: &mut [T] = bytemuck::cast_slice_mut(host_mut(UNPERMUTE, "out", out)?);
    let g =
        Gather { x, rows, h, x1: None, x2: None, bias: None, scales, idx, n, k, row_layout: true, skip_invalid: true };
    g.run(o, n, &Some);
    Ok(())
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
