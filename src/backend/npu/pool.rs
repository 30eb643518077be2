//! Workspace: device memory for the intermediates of an op without
//! `aclrtMalloc`/`aclrtFree` inside the op.
//!
//! Each stream has a caching pool. Its segments come from `aclrtMalloc`,
//! reserved ahead ([`NpuStream::reserve_workspace`]) or on first use outside
//! graph capture; a request is carved out of a free range of a segment, and a
//! freed block goes back to the free list without any synchronisation: the
//! next user of the range is queued on the same stream, after the work of the
//! previous one, so the reuse is stream-ordered. The pool grows only outside
//! capture; under capture a request no free range fits is an error that says
//! how much to reserve. The segments are released (after the one
//! synchronisation that needs) when the last handle of the stream goes.
//!
//! Alternatively the host engine passes an [`Allocator`] (e.g. torch's caching
//! allocator): every workspace block of that stream then comes from its
//! `alloc` callback and goes back through `free`, also under capture (the
//! engine's allocator serves graph capture from its own private pool).

use std::collections::VecDeque;
use std::ffi::c_void;
use std::ptr::NonNull;
use std::sync::Arc;

use acl_sys::aclrtStream;

use crate::{Error, Result};

/// Granularity of the pool's blocks: every block starts on a multiple of this
/// (more than the 64 bytes asynchronous device-to-device copies need).
pub const WORKSPACE_ALIGN: usize = 512;

/// A device allocator the host engine lends a stream for its workspace
/// (e.g. torch's caching allocator): every workspace block of that stream
/// then comes from [`alloc`](Self::alloc) and goes back through
/// [`free`](Self::free), also under graph capture.
///
/// Both may be called from any thread that runs an op on the stream, and
/// must not call back into this crate.
pub trait WorkspaceAllocator: Send + Sync {
    /// `bytes` (> 0) of device memory usable by work queued on `stream`, or
    /// `None` when it cannot.
    fn alloc(&self, bytes: usize, stream: aclrtStream) -> Option<NonNull<c_void>>;
    /// Returns a block from [`alloc`](Self::alloc) of `bytes` bytes. Work
    /// queued on `stream` before the call may still use it (stream-ordered
    /// release, as a caching allocator's `recordStream`).
    fn free(&self, ptr: NonNull<c_void>, bytes: usize, stream: aclrtStream);
}

/// The allocator a stream's workspace comes from, when the engine set one.
pub type Allocator = Arc<dyn WorkspaceAllocator>;

/// A range `[start, start + len)` of a segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Range {
    segment: usize,
    start: usize,
    len: usize,
}

/// The caching pool of one stream.
#[derive(Debug, Default)]
pub(crate) struct Pool {
    /// Segments from aclrtMalloc: (device address, bytes).
    segments: Vec<(usize, usize)>,
    /// Free ranges, sorted by (segment, start); adjacent ones are merged.
    free: Vec<Range>,
    /// Blocks handed out and not yet returned.
    in_use: usize,
    /// Blocks a captured task uses ([`Pool::retire`]): (device address, bytes).
    graph: Vec<(usize, usize)>,
    /// Counts for tests and reports.
    pub(crate) stats: PoolStats,
}

/// What a pool did since it was created.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct PoolStats {
    /// Segments taken from aclrtMalloc.
    pub segments: usize,
    /// Bytes in those segments.
    pub reserved_bytes: usize,
    /// Blocks served from the pool.
    pub blocks: usize,
    /// Blocks served by the caller's allocator callback.
    pub callback_blocks: usize,
    /// Blocks returned to the caller's allocator callback.
    pub callback_frees: usize,
}

/// `bytes` rounded up to [`WORKSPACE_ALIGN`] (at least one block).
pub(crate) fn round_up(bytes: usize) -> Result<usize> {
    let bytes = bytes.max(1);
    bytes
        .checked_next_multiple_of(WORKSPACE_ALIGN)
        .ok_or_else(|| Error::invalid("workspace", "bytes", format!("{bytes} bytes overflow the address space")))
}

impl Pool {
    /// A block of at least `bytes` (rounded up to [`WORKSPACE_ALIGN`]) from a
    /// free range, `None` when no free range fits.
    pub(crate) fn take(&mut self, bytes: usize) -> Result<Option<(usize, usize)>> {
        let want = round_up(bytes)?;
        // Best fit: the smallest free range that holds the request.
        let Some(i) =
            self.free.iter().enumerate().filter(|(_, r)| r.len >= want).min_by_key(|(_, r)| r.len).map(|(i, _)| i)
        else {
            return Ok(None);
        };
        let r = self.free[i];
        if r.len == want {
            self.free.remove(i);
        } else {
            self.free[i] = Range { segment: r.segment, start: r.start + want, len: r.len - want };
        }
        self.in_use += 1;
        self.stats.blocks += 1;
        Ok(Some((self.segments[r.segment].0 + r.start, want)))
    }

    /// Returns a block from [`take`](Self::take) to the free list (no sync:
    /// its next user is queued after its last one on the same stream).
    pub(crate) fn give_back(&mut self, ptr: usize, len: usize) {
        let Some(segment) = self.segments.iter().position(|&(base, n)| ptr >= base && ptr + len <= base + n) else {
            return;
        };
        let start = ptr - self.segments[segment].0;
        let at = self.free.partition_point(|r| (r.segment, r.start) < (segment, start));
        self.free.insert(at, Range { segment, start, len });
        // Merge with the following, then the preceding range of the same segment.
        if at + 1 < self.free.len() {
            let (a, b) = (self.free[at], self.free[at + 1]);
            if b.segment == a.segment && a.start + a.len == b.start {
                self.free[at].len += b.len;
                self.free.remove(at + 1);
            }
        }
        if at > 0 {
            let (a, b) = (self.free[at - 1], self.free[at]);
            if a.segment == b.segment && a.start + a.len == b.start {
                self.free[at - 1].len += b.len;
                self.free.remove(at);
            }
        }
        self.in_use = self.in_use.saturating_sub(1);
    }

    /// Takes back a block a task captured into a graph uses, without making
    /// it free for eager work: every replay of the graph reads and writes it
    /// again, and the runtime guide's single-stream capture restriction 7
    /// asks that what a captured task uses stay valid until the model is
    /// destroyed, so no later eager work may be handed these bytes. The block
    /// joins the stream's graph blocks for the stream's life (the crate does
    /// not see `aclmdlRIDestroy`); its segment is freed with the pool. Later
    /// work under capture on the same stream may take it again
    /// ([`take_in_capture`](Self::take_in_capture)): graphs replay in the
    /// stream's order, and every captured task that reads such a block runs
    /// after the captured task that writes it.
    pub(crate) fn retire(&mut self, ptr: usize, len: usize) {
        self.in_use = self.in_use.saturating_sub(1);
        self.graph.push((ptr, len));
    }

    /// A block for work queued under capture: a graph block of at least
    /// `bytes` (the smallest that fits), else one from the free ranges.
    pub(crate) fn take_in_capture(&mut self, bytes: usize) -> Result<Option<(usize, usize)>> {
        let want = round_up(bytes)?;
        let best = self.graph.iter().enumerate().filter(|(_, b)| b.1 >= want).min_by_key(|(_, b)| b.1).map(|(i, _)| i);
        if let Some(i) = best {
            self.in_use += 1;
            self.stats.blocks += 1;
            return Ok(Some(self.graph.swap_remove(i)));
        }
        self.take(bytes)
    }

    /// The largest free range, in bytes.
    pub(crate) fn largest_free(&self) -> usize {
        self.free.iter().map(|r| r.len).max().unwrap_or(0)
    }

    /// Adds a segment from aclrtMalloc: `len` bytes at device address `ptr`.
    pub(crate) fn add_segment(&mut self, ptr: usize, len: usize) {
        self.segments.push((ptr, len));
        self.free.push(Range { segment: self.segments.len() - 1, start: 0, len });
        self.stats.segments += 1;
        self.stats.reserved_bytes += len;
    }

    /// True when no segment is held.
    pub(crate) fn is_empty(&self) -> bool {
        self.segments.is_empty()
    }

    /// Hands every segment back for `aclrtFree` and forgets them. The caller
    /// synchronised the stream and holds no block: every block's buffer
    /// keeps the pool alive.
    pub(crate) fn take_segments(&mut self) -> Vec<(usize, usize)> {
        self.free.clear();
        self.graph.clear();
        std::mem::take(&mut self.segments)
    }
}

/// Bytes of one block of a stream's staging arena: small host data (a
/// tiling, slot offsets) fits one.
pub(crate) const STAGING_BLOCK: usize = 4096;
/// Blocks of a stream's staging arena (one `aclrtMallocHost`, made at the
/// first staged copy), and the most staging blocks in flight at once.
pub(crate) const STAGING_BLOCKS: usize = 16;
/// Pinned bytes a stream keeps, outside capture, for the small host data of
/// the copies captured later (at least; more when one run of captures took
/// more): a native launch captures its tiling, a padded finalize also its
/// slot offsets (4 bytes a row).
pub(crate) const GRAPH_STAGING: usize = 256 << 10;
/// Alignment of the pieces cut for captured copies.
pub(crate) const GRAPH_ALIGN: usize = 64;

/// What a stream (or live context) keeps for work captured into graphs,
/// which holds what it takes for the stream's life: the amount taken by the
/// current run of captures (everything captured since the last eager call)
/// and the most any run took. At an eager call the run ends, and at least
/// as much as the largest run is kept free, so the next graph of a model,
/// captured after its warm-up, finds what it needs without a reservation.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct CaptureRuns {
    run: usize,
    most: usize,
}

impl CaptureRuns {
    /// A capture took `n` more.
    pub(crate) fn took(&mut self, n: usize) {
        self.run += n;
    }

    /// A capture gave `n` back (its work was not queued after all).
    pub(crate) fn gave_back(&mut self, n: usize) {
        self.run = self.run.saturating_sub(n);
    }

    /// An eager call: the run ends. Returns what to keep free: `at_least`,
    /// or the most one run took.
    pub(crate) fn end(&mut self, at_least: usize) -> usize {
        self.most = self.most.max(self.run);
        self.run = 0;
        at_least.max(self.most)
    }
}

/// Pinned host blocks (`aclrtMallocHost`) that carry small host data (slot
/// offsets, a tiling) to the device with an asynchronous copy. A block whose
/// copy is queued is in flight, with the fence recorded after that copy,
/// until the fence completed (asked without waiting when a block is needed)
/// or the stream synchronised; then it is free for reuse. The allocations
/// are freed with the pool. `F` is the fence: an event the stream records
/// after a copy (the runtime's `Fence`).
pub(crate) struct Staging<F> {
    /// What `aclrtMallocHost` returned: (address, bytes), freed with the pool.
    allocations: Vec<(usize, usize)>,
    free: Vec<(usize, usize)>,
    /// Blocks whose copy is queued, oldest first, with the fence recorded
    /// after the copy (`None`: none could be recorded yet).
    in_flight: VecDeque<((usize, usize), Option<F>)>,
    /// Pinned chunks the copies captured into graphs are cut from (address,
    /// bytes, bytes cut): every replay copies a piece again, so it keeps its
    /// bytes for the stream's life.
    graph: Vec<(usize, usize, usize)>,
    /// Bytes cut for captured copies, by run of captures.
    graph_run: CaptureRuns,
    /// Fences no block holds, recorded again for later copies.
    spare: Vec<F>,
    /// Host allocations made so far.
    pub(crate) host_blocks: usize,
}

impl<F> Default for Staging<F> {
    fn default() -> Self {
        Staging {
            allocations: Vec::new(),
            free: Vec::new(),
            in_flight: VecDeque::new(),
            graph: Vec::new(),
            graph_run: CaptureRuns::default(),
            spare: Vec::new(),
            host_blocks: 0,
        }
    }
}

impl<F> std::fmt::Debug for Staging<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Staging")
            .field("allocations", &self.allocations)
            .field("free", &self.free)
            .field("in_flight", &self.in_flight.len())
            .field("graph", &self.graph)
            .finish()
    }
}

impl<F: Clone> Staging<F> {
    /// The smallest free block of at least `bytes`, now in flight (without a
    /// fence yet); `None` when none is free.
    pub(crate) fn take_free(&mut self, bytes: usize) -> Option<(usize, usize)> {
        let i = self.free.iter().enumerate().filter(|(_, b)| b.1 >= bytes).min_by_key(|(_, b)| b.1).map(|(i, _)| i)?;
        let b = self.free.swap_remove(i);
        self.in_flight.push_back((b, None));
        Some(b)
    }

    /// A piece of `bytes` (rounded up to [`GRAPH_ALIGN`]) for a copy being
    /// captured into a graph, cut from a graph chunk: it is never free again.
    pub(crate) fn take_for_graph(&mut self, bytes: usize) -> Option<usize> {
        let n = bytes.checked_next_multiple_of(GRAPH_ALIGN)?;
        let chunk = self.graph.iter_mut().find(|(_, len, cut)| len - *cut >= n)?;
        let ptr = chunk.0 + chunk.2;
        chunk.2 += n;
        self.graph_run.took(n);
        Some(ptr)
    }

    /// The largest piece the graph chunks can still give.
    pub(crate) fn graph_room(&self) -> usize {
        self.graph.iter().map(|(_, len, cut)| len - cut).max().unwrap_or(0)
    }

    /// An eager copy: the captures before it ended their run. Returns the
    /// room to keep for the next ones: [`GRAPH_STAGING`], or the most one
    /// run cut so far.
    pub(crate) fn end_graph_run(&mut self) -> usize {
        self.graph_run.end(GRAPH_STAGING)
    }

    /// A new allocation from aclrtMallocHost, cut for captured copies.
    pub(crate) fn add_graph_chunk(&mut self, allocation: (usize, usize)) {
        self.host_blocks += 1;
        self.allocations.push(allocation);
        self.graph.push((allocation.0, allocation.1, 0));
    }

    /// The copy from the block in flight at `ptr` was not queued: it is free.
    pub(crate) fn not_queued(&mut self, ptr: usize) {
        if let Some(i) = self.in_flight.iter().position(|(b, _)| b.0 == ptr) {
            if let Some((b, fence)) = self.in_flight.remove(i) {
                self.free.push(b);
                self.spare.extend(fence);
            }
        }
    }

    /// `fence` was recorded after the copy from the block in flight at `ptr`.
    pub(crate) fn set_fence(&mut self, ptr: usize, fence: F) {
        match self.in_flight.iter_mut().find(|(b, _)| b.0 == ptr) {
            Some((_, slot)) => {
                if let Some(old) = slot.replace(fence) {
                    self.spare.push(old);
                }
            }
            None => self.spare.push(fence),
        }
    }

    /// A fence no block holds, to record again.
    pub(crate) fn take_spare(&mut self) -> Option<F> {
        self.spare.pop()
    }

    /// Keeps `fence` for later copies.
    pub(crate) fn add_spare(&mut self, fence: F) {
        self.spare.push(fence);
    }

    /// Blocks in flight.
    pub(crate) fn in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// The block in flight at position `i` (0: the oldest) and its fence.
    pub(crate) fn in_flight_at(&self, i: usize) -> Option<(usize, Option<F>)> {
        self.in_flight.get(i).map(|(b, f)| (b.0, f.clone()))
    }

    /// The copies from the blocks in flight up to the one at `ptr` (oldest
    /// first) completed: they are free, and their fences spare.
    pub(crate) fn completed_through(&mut self, ptr: usize) {
        let Some(i) = self.in_flight.iter().position(|(b, _)| b.0 == ptr) else { return };
        for (b, fence) in self.in_flight.drain(..=i) {
            self.free.push(b);
            self.spare.extend(fence);
        }
    }

    /// A new allocation from aclrtMallocHost, served as `blocks` (ranges of
    /// it), all free.
    pub(crate) fn add(&mut self, allocation: (usize, usize), blocks: impl IntoIterator<Item = (usize, usize)>) {
        self.host_blocks += 1;
        self.allocations.push(allocation);
        self.free.extend(blocks);
    }

    /// True when a free block holds `bytes`.
    pub(crate) fn has_free(&self, bytes: usize) -> bool {
        self.free.iter().any(|&(_, n)| n >= bytes)
    }

    /// True once the arena of small blocks was allocated.
    pub(crate) fn has_arena(&self) -> bool {
        self.allocations.iter().any(|&(_, n)| n == STAGING_BLOCK * STAGING_BLOCKS)
    }

    /// The stream drained: every block in flight is free again.
    pub(crate) fn drained(&mut self) {
        for (b, fence) in self.in_flight.drain(..) {
            self.free.push(b);
            self.spare.extend(fence);
        }
    }

    /// Hands every allocation back for `aclrtFreeHost` (the stream was
    /// synchronised) and the fences for destruction.
    pub(crate) fn take_all(&mut self) -> (Vec<(usize, usize)>, Vec<F>) {
        self.free.clear();
        self.graph.clear();
        let mut fences = std::mem::take(&mut self.spare);
        fences.extend(self.in_flight.drain(..).filter_map(|(_, f)| f));
        (std::mem::take(&mut self.allocations), fences)
    }

    /// True when no block is held.
    pub(crate) fn is_empty(&self) -> bool {
        self.allocations.is_empty()
    }
}

/// `a.alloc` for `bytes` on `stream`, or an error saying it had none.
pub(crate) fn callback_alloc(a: &Allocator, bytes: usize, stream: aclrtStream) -> Result<*mut c_void> {
    match a.alloc(bytes, stream) {
        Some(p) => Ok(p.as_ptr()),
        None => Err(Error::invalid(
            "workspace",
            "allocator",
            format!("the allocator callback returned NULL for {bytes} bytes"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool_with(segments: &[usize]) -> Pool {
        let mut p = Pool::default();
        let mut base = 1 << 20;
        for &n in segments {
            p.segments.push((base, n));
            p.free.push(Range { segment: p.segments.len() - 1, start: 0, len: n });
            base += n + (1 << 20);
        }
        p
    }

    #[test]
    fn blocks_are_carved_aligned_and_merge_back() {
        let mut p = pool_with(&[4096]);
        let (a, na) = p.take(1).unwrap().unwrap();
        let (b, nb) = p.take(600).unwrap().unwrap();
        assert_eq!((na, nb), (512, 1024));
        assert_eq!(b, a + 512);
        assert_eq!(p.largest_free(), 4096 - 1536);
        assert!(p.take(4096).unwrap().is_none(), "only 2560 bytes are free");
        p.give_back(a, na);
        p.give_back(b, nb);
        assert_eq!(p.free.len(), 1, "{:?}", p.free);
        assert_eq!(p.largest_free(), 4096);
        assert_eq!(p.in_use, 0);
    }

    #[test]
    fn best_fit_picks_the_smallest_range_that_holds_the_request() {
        let mut p = pool_with(&[8192, 1024]);
        let (ptr, _) = p.take(700).unwrap().unwrap();
        assert_eq!(ptr, p.segments[1].0, "the 1024-byte segment fits 700 best");
        assert!(p.take(usize::MAX).is_err(), "an overflowing size is an error");
    }

    #[test]
    fn pieces_for_captured_copies_are_aligned_disjoint_and_never_reused() {
        let mut st: Staging<()> = Staging::default();
        assert_eq!(st.take_for_graph(1), None, "no chunk yet");
        st.add_graph_chunk((1 << 20, 256));
        let a = st.take_for_graph(1).unwrap();
        let b = st.take_for_graph(65).unwrap();
        assert_eq!((a, b), (1 << 20, (1 << 20) + 64), "pieces are cut in 64-byte steps");
        assert_eq!(st.graph_room(), 256 - 64 - 128);
        assert_eq!(st.take_for_graph(65), None, "64 bytes left, 128 needed");
        let c = st.take_for_graph(64).unwrap();
        assert_eq!(c, (1 << 20) + 192);
        st.drained();
        assert_eq!(st.graph_room(), 0, "a drained stream gives nothing captured back");
        assert!(st.take_free(1).is_none(), "and no piece becomes an eager block");
        assert_eq!(st.take_for_graph(usize::MAX), None, "an overflowing size is no piece");
    }

    #[test]
    fn the_room_kept_for_captures_follows_the_largest_run() {
        let mut st: Staging<()> = Staging::default();
        assert_eq!(st.end_graph_run(), GRAPH_STAGING);
        st.add_graph_chunk((1 << 20, 3 * GRAPH_STAGING));
        for _ in 0..(GRAPH_STAGING + GRAPH_STAGING / 2) / GRAPH_ALIGN {
            st.take_for_graph(GRAPH_ALIGN).unwrap();
        }
        let run = GRAPH_STAGING + GRAPH_STAGING / 2;
        assert_eq!(st.end_graph_run(), run, "the run just ended");
        st.take_for_graph(GRAPH_ALIGN).unwrap();
        assert_eq!(st.end_graph_run(), run, "a shorter run keeps the most");
    }
}
