//! The byte copies of the data phases (into and out of staging).
//!
//! **Into staging, plain stores.** A staged chunk is read by its peers right
//! after the barrier that follows it, and a data-moving collective stages at
//! most 1 MiB per rank per round, so the chunk is still in the cache when they
//! read it. Non-temporal stores would send it to memory only for the peers to
//! read it back. Measured with `ascend-moe bench collectives`, 4 ranks on a
//! 2-core VM (2 MiB L2 per core), 8 and 64 MiB per rank, interleaved runs over
//! threads and over processes, against streamed staging in 4 MiB rounds:
//! - plain staging in 1 MiB rounds took 0.72-1.06 of the time over the five
//!   collectives (6 runs); in 1 MiB slots, 0.62-0.97 (8 runs, median 0.85);
//!   in 2 MiB rounds, 0.65-1.12;
//! - at 1-2 MiB per rank, where nothing streamed before either, 1 MiB rounds
//!   took 0.73-1.03;
//! - streamed staging in 1 MiB rounds gained less and less reliably
//!   (0.78-1.52): the stores matter, not only the round size.
//!
//! The fused finalize-and-reduce-scatter stages in the same 1 MiB rounds (of
//! whole rows). Whole-slot rounds (4 MiB per rank) took 1.05-1.35x the CPU
//! time per call and 1.07-1.35x the call's time (4 ranks on 2 cores, 4 KiB
//! rows, 3000 + 1096 tokens at top-k 2; medians over all ranks, 3 runs in
//! each of two sessions: 12.3-13.0 against 9.4-10.7 ms of CPU, then 11.1-11.4
//! against 10.4-10.8 ms): by the barrier the rows had left the cache, and
//! the peers read them back from memory. (Each rank's best call, taken apart
//! from the others', hides this with more ranks than cores: it rewards few
//! barriers, not short calls.)
//!
//! **Into the caller's buffers, streaming for large collectives.** Each output
//! byte is written once and not read again by the collective, while the
//! ranks' buffers together outgrow the last-level cache. Plain stores still
//! read every destination line before writing it (write allocate), which
//! makes a copy move three bytes per byte. From [`STREAM_MIN`] bytes per rank
//! the copy-outs use non-temporal stores instead, two bytes per byte; smaller
//! collectives keep plain copies.
//!
//! The threshold is measured (`ascend-moe bench collectives --procs --ranks 4`,
//! an interleaved A/B on a 2-core VM with a 32 MiB L3): streaming took 1.2-2x
//! the time of plain copies at 256 KiB-1 MiB per rank, was mixed at 2 MiB, and
//! took 0.6-0.9x from 4 MiB to 32 MiB.

/// Bytes per rank from which a collective's copies stream past the cache.
pub(crate) const STREAM_MIN: usize = 4 << 20;

/// How one collective copies: plain, or streaming for large data.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Copier {
    stream: bool,
}

impl Copier {
    /// The copier of every copy into staging: plain stores, which leave the
    /// chunk cached for the peers that read it after the next barrier.
    pub(crate) const STAGE: Copier = Copier { stream: false };

    /// The copier of the copy-outs of a collective moving `bytes` per rank.
    pub(crate) fn for_bytes(bytes: usize) -> Self {
        Copier { stream: bytes >= STREAM_MIN }
    }

    /// The copier of the copy-outs of a collective whose per-rank data is
    /// `counts` elements of `esz` bytes in all.
    pub(crate) fn for_counts(counts: &[usize], esz: usize) -> Self {
        Self::for_bytes(counts.iter().fold(0usize, |a, &c| a.saturating_add(c)).saturating_mul(esz))
    }

    /// Streams if either copier does (a collective whose input and output differ in size).
    pub(crate) fn or(self, other: Copier) -> Self {
        Copier { stream: self.stream || other.stream }
    }

    /// Copies `len` bytes from `src` to `dst`. Every store is visible to
    /// other processes before any store this thread makes after the call (a
    /// streaming copy ends with a store fence), so the release that
    /// publishes a staged chunk still orders it.
    ///
    /// # Safety
    /// As `std::ptr::copy_nonoverlapping`: `src` readable and `dst` writable
    /// for `len` bytes, not overlapping.
    pub(crate) unsafe fn copy(self, src: *const u8, dst: *mut u8, len: usize) {
        if self.stream {
            // SAFETY: the caller's contract.
            unsafe { stream_copy(src, dst, len) }
        } else {
            // SAFETY: the caller's contract.
            unsafe { std::ptr::copy_nonoverlapping(src, dst, len) }
        }
    }
}

/// A copy whose stores bypass the cache: plain bytes up to `dst`'s first
/// 64-byte boundary, then whole lines with SSE2 non-temporal stores (SSE2 is
/// part of x86-64), then the tail, then `sfence`, which orders the
/// non-temporal stores before every later store.
///
/// # Safety
/// As [`Copier::copy`].
#[cfg(target_arch = "x86_64")]
unsafe fn stream_copy(src: *const u8, dst: *mut u8, len: usize) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
    let head = dst.align_offset(64).min(len);
    let lines = (len - head) / 64;
    // SAFETY: every access below lies in [0, len) of `src` / `dst` (head +
    // 64 * lines + tail = len); the streamed destinations are 16-byte
    // aligned, since dst + head is 64-byte aligned.
    unsafe {
        std::ptr::copy_nonoverlapping(src, dst, head);
        let (s, d) = (src.add(head), dst.add(head));
        for l in 0..lines {
            let (s, d) = (s.add(64 * l) as *const __m128i, d.add(64 * l) as *mut __m128i);
            let (a, b, c, e) =
                (_mm_loadu_si128(s), _mm_loadu_si128(s.add(1)), _mm_loadu_si128(s.add(2)), _mm_loadu_si128(s.add(3)));
            _mm_stream_si128(d, a);
            _mm_stream_si128(d.add(1), b);
            _mm_stream_si128(d.add(2), c);
            _mm_stream_si128(d.add(3), e);
        }
        let done = head + 64 * lines;
        std::ptr::copy_nonoverlapping(src.add(done), dst.add(done), len - done);
        _mm_sfence();
    }
}

/// Elsewhere a plain copy.
///
/// # Safety
/// As [`Copier::copy`].
#[cfg(not(target_arch = "x86_64"))]
unsafe fn stream_copy(src: *const u8, dst: *mut u8, len: usize) {
    // SAFETY: the caller's contract.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, len) }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(stream: bool, src_off: usize, dst_off: usize, len: usize) {
        let src: Vec<u8> = (0..len + 200).map(|i| (i * 31 + 7) as u8).collect();
        let mut dst = vec![0xEEu8; len + 200];
        let c = Copier { stream };
        // SAFETY: both ranges lie inside their vectors, which do not overlap.
        unsafe { c.copy(src.as_ptr().add(src_off), dst.as_mut_ptr().add(dst_off), len) };
        assert_eq!(&dst[dst_off..dst_off + len], &src[src_off..src_off + len], "{stream} {src_off} {dst_off} {len}");
        assert!(dst[..dst_off].iter().all(|&b| b == 0xEE), "wrote before dst: {src_off} {dst_off} {len}");
        assert!(dst[dst_off + len..].iter().all(|&b| b == 0xEE), "wrote past dst: {src_off} {dst_off} {len}");
    }

    #[test]
    fn streaming_copies_every_byte_and_nothing_else_at_any_alignment() {
        for len in (0..300).chain([4095, 4096, 65_537]) {
            for (s, d) in [(0, 0), (1, 0), (0, 3), (5, 17), (63, 1), (16, 48)] {
                check(true, s, d, len);
                check(false, s, d, len);
            }
        }
    }

    #[test]
    fn only_copy_outs_of_collectives_larger_than_the_cache_stream() {
        assert!(!Copier::for_bytes(STREAM_MIN - 1).stream);
        assert!(Copier::for_bytes(STREAM_MIN).stream);
        assert!(!Copier::for_bytes(0).stream);
    }
}
