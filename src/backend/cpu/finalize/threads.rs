//! The thread count, SIMD width and kind of store the CPU kernels use, per
//! calling thread.

use std::cell::Cell;
use std::sync::OnceLock;

/// Elements of output a thread must have before another thread is worth spawning.
const MIN_ELEMS_PER_THREAD: usize = 1 << 16;

thread_local! {
    static THREADS: Cell<Option<usize>> = const { Cell::new(None) };
    pub(super) static WIDE_SIMD: Cell<bool> = const { Cell::new(true) };
    static STREAM: Cell<Option<bool>> = const { Cell::new(None) };
}

/// Last-level cache assumed where the host reports none.
const DEFAULT_LLC_BYTES: usize = 32 << 20;

/// Forces (`Some`) or leaves to the call's size (`None`, the default) whether
/// the bf16 and f16 finalize kernels (AVX2, AVX-512) write the output a caller gets
/// with streaming (non-temporal) stores, for calls made from the current
/// thread (rows staged for peers, which read them next, never stream). Both
/// stores write the same bits; the switch exists so tests can show it on
/// small calls.
pub fn set_streaming_stores(force: Option<bool>) {
    STREAM.with(|s| s.set(force));
}

/// Whether a finalize that reads and writes `bytes` in all writes its output
/// with streaming stores: when `bytes` is at least twice the last-level cache
/// (the default when [`set_streaming_stores`] forces nothing). Such a call
/// evicts its own output from the cache before it returns, so an ordinary
/// store only costs a read of every output line first (about a tenth of the
/// traffic of a top-8 finalize) and pushes source rows out; a smaller call
/// keeps ordinary stores, which leave the output in cache for the next op.
pub(super) fn stream_output(bytes: usize) -> bool {
    STREAM.with(|s| s.get()).unwrap_or_else(|| {
        let llc = crate::backend::cpu::cache::last_level_cache_bytes().unwrap_or(DEFAULT_LLC_BYTES);
        bytes >= llc.saturating_mul(2)
    })
}

/// Allows (`true`, the default) or forbids the wider SIMD code paths (AVX2,
/// AVX-512, and with them streaming stores) for calls made from the current
/// thread. Every path does the same operations in the same order; the switch
/// exists so tests can show they agree bit for bit.
pub fn set_wide_simd(enabled: bool) {
    WIDE_SIMD.with(|w| w.set(enabled));
}

/// Sets the number of threads the CPU kernels use for calls made from the
/// current thread (`None`: back to the default). A forced count is used even
/// for small calls, which is what the determinism tests need.
pub fn set_num_threads(n: Option<usize>) {
    THREADS.with(|t| t.set(n.map(|n| n.max(1))));
}

/// The default thread count: `ASCEND_MOE_NUM_THREADS`, else the available
/// parallelism. A value that is not a positive integer is warned about on
/// stderr, once per process, and ignored.
pub fn default_num_threads() -> usize {
    let set = env_num_threads().unwrap_or_else(|v| {
        static WARNED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
        if !WARNED.swap(true, std::sync::atomic::Ordering::Relaxed) {
            eprintln!(
                "ascend-moe: warning: ASCEND_MOE_NUM_THREADS={v:?} is not a positive integer: the kernels use \
                 the available cores"
            );
        }
        None
    });
    set.unwrap_or_else(cores)
}

/// `ASCEND_MOE_NUM_THREADS`: `Ok(None)` when unset, its count when a
/// positive integer, else `Err` with the value as set, which
/// [`default_num_threads`] ignores.
pub fn env_num_threads() -> Result<Option<usize>, String> {
    crate::types::env_setting("ASCEND_MOE_NUM_THREADS", |s| s.trim().parse::<usize>().ok().filter(|n| *n > 0))
}

/// The available parallelism, asked once per process: on Linux the question
/// reads the cgroup's CPU quota files, which takes longer (about 13 us on a
/// 2-core VM) than a whole decode-size finalize, and every default call asks it.
fn cores() -> usize {
    static CORES: OnceLock<usize> = OnceLock::new();
    *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// Threads a finalize producing `rows` rows of `h` elements uses when called
/// from the current thread: the count forced by [`set_num_threads`], else
/// [`default_num_threads`] lowered so that every thread writes at least
/// 65,536 elements (a smaller call runs on the calling thread alone: starting
/// a thread costs more than it saves there). Never more threads than rows.
pub fn finalize_threads(rows: usize, h: usize) -> usize {
    let t = match THREADS.with(|t| t.get()) {
        Some(n) => n,
        None => default_num_threads().min((rows * h / MIN_ELEMS_PER_THREAD).max(1)),
    };
    t.clamp(1, rows.max(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A forced choice holds at any size; otherwise only a call of at least
    /// twice the last-level cache streams.
    #[test]
    fn streaming_follows_the_size_unless_forced() {
        let llc = crate::backend::cpu::cache::last_level_cache_bytes().unwrap_or(DEFAULT_LLC_BYTES);
        assert!(!stream_output(0) && !stream_output(2 * llc - 1));
        assert!(stream_output(2 * llc) && stream_output(usize::MAX));
        set_streaming_stores(Some(true));
        assert!(stream_output(0));
        set_streaming_stores(Some(false));
        assert!(!stream_output(usize::MAX));
        set_streaming_stores(None);
        assert!(!stream_output(0));
    }
}
