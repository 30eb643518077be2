//! The shared gather-scale-sum kernel of finalize and unpermute, over host
//! slices: output rows split into contiguous chunks, one per thread.

use std::sync::{Mutex, PoisonError};

use super::lanes::{accumulate_group, fused_dispatch, Lanes, SimdKernel, GROUP};
use super::threads::{finalize_threads, stream_output, WIDE_SIMD};

/// How [`Gather::run`] may store its output.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Store {
    /// Output the caller gets: streaming stores where the call is large
    /// enough ([`stream_output`]).
    MayStream,
    /// Output read again at once (staging that peers read next): ordinary
    /// stores, which leave it in the cache.
    Cached,
}

/// What one output token gathers. Shared by finalize and unpermute.
pub(super) struct Gather<'a, T> {
    /// Source rows, `[rows, h]`.
    pub(super) x: &'a [T],
    pub(super) rows: usize,
    pub(super) h: usize,
    pub(super) x1: Option<&'a [T]>,
    pub(super) x2: Option<&'a [T]>,
    /// Bias `[E, h]`, widened once, and the expert of each (i, k) slot (row-major).
    pub(super) bias: Option<(Vec<f32>, &'a [i32])>,
    /// Scales `[N, K]` row-major, widened once.
    pub(super) scales: Option<Vec<f32>>,
    pub(super) idx: &'a [i32],
    pub(super) n: usize,
    pub(super) k: usize,
    pub(super) row_layout: bool,
    /// Unpermute: an index outside `[0, rows)` contributes nothing. Finalize:
    /// indices are validated, a negative one is a dropped slot (zero row).
    pub(super) skip_invalid: bool,
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

    /// The first [`GROUP`] in-range source rows of token `i` (empty slices
    /// after them): where the rows of the token after this one start, for
    /// prefetching.
    #[inline(always)]
    fn source_rows(&self, i: usize) -> [&[T]; GROUP] {
        let h = self.h;
        let mut rows: [&[T]; GROUP] = [&[]; GROUP];
        let mut g = 0;
        for kk in 0..self.k {
            if g == GROUP {
                break;
            }
            let r = self.idx[if self.row_layout { i * self.k + kk } else { kk * self.n + i }];
            if r >= 0 && (r as usize) < self.rows {
                let r = r as usize;
                rows[g] = &self.x[r * h..(r + 1) * h];
                g += 1;
            }
        }
        rows
    }

    /// Token `i` straight into `out` in one pass, when it qualifies: element
    /// types widened per lane, no bias, at most one skip input, and all its
    /// slots in one group. Returns false (nothing written) otherwise.
    ///
    /// `next`: the source rows of the token after this one, for prefetching.
    /// `simd`: the type's kernel for the instructions the caller runs with,
    /// if it has one; `stream`: that kernel writes with streaming stores, and
    /// the caller fences them (see [`SimdKernel`]).
    #[inline(always)]
    fn fused_token(&self, i: usize, next: &[&[T]], out: &mut [T], simd: Option<SimdKernel<T>>, stream: bool) -> bool {
        if !(T::LANEWISE || simd.is_some())
            || self.bias.is_some()
            || self.k > GROUP
            || (self.x1.is_some() && self.x2.is_some())
        {
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
        // The skip row and the rest of its input after it (the next token's
        // row, which the SIMD kernels prefetch).
        let skip_on = self.x1.or(self.x2).map(|x| &x[i * h..]);
        #[cfg(target_arch = "x86_64")]
        if let Some(kernel) = simd {
            // SAFETY: `simd` is only given by a caller that runs with the instructions it
            // is built for; a `stream` caller fences before anyone reads `out`.
            unsafe { kernel(skip_on, &ss, &rows, g, next, out, stream) };
            return true;
        }
        fused_dispatch(skip_on.map(|x| &x[..h]), &ss, &rows, g, out);
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
    /// `simd`: the type's kernel for the instructions the caller runs with;
    /// `stream`: it writes with streaming stores (see [`Gather::fused_token`]),
    /// fenced before returning.
    #[inline(always)]
    fn rows_generic(
        &self,
        first_row: usize,
        chunk: &mut [T],
        token_of: &(dyn Fn(usize) -> Option<usize> + Sync),
        simd: Option<SimdKernel<T>>,
        stream: bool,
    ) {
        let h = self.h;
        let mut acc = vec![0f32; h];
        let mut tmp = vec![0f32; h];
        let out_rows = chunk.len() / h;
        // Only the SIMD kernels prefetch the next token's rows: elsewhere they
        // are not looked up.
        let prefetch = simd.is_some();
        for (j, o) in chunk.chunks_exact_mut(h).enumerate() {
            match token_of(first_row + j) {
                Some(i) => {
                    let next = if prefetch && j + 1 < out_rows { token_of(first_row + j + 1) } else { None };
                    let next = next.map_or([&[][..]; GROUP], |t| self.source_rows(t));
                    if !self.fused_token(i, &next, o, simd, stream) {
                        self.token(i, &mut acc, &mut tmp);
                        T::narrow(&acc, o);
                    }
                }
                None => o.fill(T::default()),
            }
        }
        #[cfg(target_arch = "x86_64")]
        if stream && simd.is_some() {
            // SAFETY: SSE is baseline on x86_64. Orders this thread's streaming
            // stores before its later stores and its exit, which the thread
            // reading `chunk` next synchronises with.
            unsafe { std::arch::x86_64::_mm_sfence() };
        }
    }

    /// [`Gather::rows_generic`] compiled for AVX2. Same operations in the same
    /// order (no fused multiply-add), so bitwise the same results.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    unsafe fn rows_avx2(&self, first_row: usize, chunk: &mut [T], token_of: &(dyn Fn(usize) -> Option<usize> + Sync)) {
        self.rows_generic(first_row, chunk, token_of, None, false)
    }

    /// [`Gather::rows_avx2`] with F16C as well, for types with an AVX2 kernel;
    /// `stream`: with streaming stores.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn rows_avx2_f16c(
        &self,
        first_row: usize,
        chunk: &mut [T],
        token_of: &(dyn Fn(usize) -> Option<usize> + Sync),
        stream: bool,
    ) {
        self.rows_generic(first_row, chunk, token_of, T::SIMD, stream)
    }

    /// [`Gather::rows_avx2_f16c`] for AVX-512, for types with an AVX-512 kernel.
    #[cfg(all(target_arch = "x86_64", amoe_avx512))]
    #[target_feature(enable = "avx512f,avx512bw,avx2,f16c")]
    unsafe fn rows_avx512(
        &self,
        first_row: usize,
        chunk: &mut [T],
        token_of: &(dyn Fn(usize) -> Option<usize> + Sync),
        stream: bool,
    ) {
        self.rows_generic(first_row, chunk, token_of, T::SIMD512, stream)
    }

    /// Fills `out` (`out_rows` rows of `h`), row `j` taking token `token_of(j)`
    /// or zeros, stored as `store` allows.
    pub(super) fn run(
        &self,
        out: &mut [T],
        out_rows: usize,
        token_of: &(dyn Fn(usize) -> Option<usize> + Sync),
        store: Store,
    ) {
        let h = self.h;
        if out_rows == 0 || h == 0 {
            return;
        }
        let threads = finalize_threads(out_rows, h);
        let chunk_rows = out_rows.div_ceil(threads);
        let wide = WIDE_SIMD.with(|w| w.get());
        // Bytes the call moves: K source rows and up to two skip rows read,
        // the output row written, per output row.
        let skips = usize::from(self.x1.is_some()) + usize::from(self.x2.is_some());
        let row_bytes = h.saturating_mul(std::mem::size_of::<T>());
        let moved = out_rows.saturating_mul(row_bytes).saturating_mul(self.k + skips + 1);
        let stream = store == Store::MayStream && stream_output(moved);
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (wide, stream); // only the x86_64 kernels have a wider path or streaming stores
        let work = |first_row: usize, chunk: &mut [T]| {
            #[cfg(target_arch = "x86_64")]
            if wide && std::arch::is_x86_feature_detected!("avx2") {
                #[cfg(amoe_avx512)]
                if T::SIMD512.is_some()
                    && std::arch::is_x86_feature_detected!("avx512f")
                    && std::arch::is_x86_feature_detected!("avx512bw")
                    && std::arch::is_x86_feature_detected!("f16c")
                {
                    // SAFETY: the CPU supports AVX-512 F and BW, AVX2 and F16C (checked just above).
                    unsafe { self.rows_avx512(first_row, chunk, token_of, stream) };
                    return;
                }
                if T::SIMD.is_some() && std::arch::is_x86_feature_detected!("f16c") {
                    // SAFETY: the CPU supports AVX2 and F16C (checked just above).
                    unsafe { self.rows_avx2_f16c(first_row, chunk, token_of, stream) };
                    return;
                }
                // SAFETY: the CPU supports AVX2 (checked just above).
                unsafe { self.rows_avx2(first_row, chunk, token_of) };
                return;
            }
            self.rows_generic(first_row, chunk, token_of, None, false);
        };
        if threads == 1 {
            work(0, out);
            return;
        }
        // Each chunk sits in a slot that whoever reaches it first empties: a
        // thread started for it, or the calling thread, which does the first
        // chunk and then every chunk no thread took. So a thread the system
        // refuses to start (a process or cgroup thread limit, no memory for
        // its stack) costs speed, never a panic in the caller; the result is
        // the same whichever thread does a chunk.
        let slots: Vec<Mutex<Option<&mut [T]>>> = out.chunks_mut(chunk_rows * h).map(|c| Mutex::new(Some(c))).collect();
        let take = |c: usize| slots[c].lock().unwrap_or_else(PoisonError::into_inner).take();
        let run_chunk = |c: usize| {
            if let Some(chunk) = take(c) {
                work(c * chunk_rows, chunk);
            }
        };
        std::thread::scope(|sc| {
            for c in 1..slots.len() {
                let run_chunk = &run_chunk;
                if std::thread::Builder::new().spawn_scoped(sc, move || run_chunk(c)).is_err() {
                    break;
                }
            }
            (0..slots.len()).for_each(run_chunk);
        });
    }
}
