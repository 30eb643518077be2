//! The workspace pool and the pinned staging blocks of a stream.

use std::sync::Arc;

use super::stream::{lock, Fence, NpuStream, SyncEvent};
use crate::backend::npu::pool::{self, Allocator, PoolStats, GRAPH_STAGING, STAGING_BLOCK, STAGING_BLOCKS};
use crate::backend::npu::result::acl as rt;
use crate::{Error, Result};

impl NpuStream {
    /// Makes sure the workspace pool of this stream has a free block of at
    /// least `bytes` (adding an `aclrtMalloc` segment when it has not), so
    /// ops of that size can run under graph capture. Refused under capture.
    pub fn reserve_workspace(&self, bytes: usize) -> Result<()> {
        self.enter()?;
        if lock(self.state()).pool.largest_free() >= bytes {
            return Ok(());
        }
        self.refuse_under_capture("reserve_workspace", "reserve before the capture begins")?;
        let len = pool::round_up(bytes)?;
        // Nonzero size, device bound.
        let ptr = rt::malloc(len, acl_sys::aclrtMemMallocPolicy::ACL_MEM_MALLOC_HUGE_FIRST)?;
        lock(self.state()).pool.add_segment(ptr as usize, len);
        Ok(())
    }

    /// A new pinned allocation of at least `bytes` (`aclrtMallocHost`).
    fn staging_block(bytes: usize) -> Result<(usize, usize)> {
        let len = pool::round_up(bytes)?;
        // Nonzero size.
        let ptr = rt::malloc_host(len)?;
        Ok((ptr as usize, len))
    }

    /// Makes sure a pinned staging block of at least `bytes` is free (small
    /// host data the native kernel needs: slot offsets, a tiling), and that
    /// at least `bytes` of pinned memory are left for the copies captured
    /// into graphs later (each keeps its bytes for the stream's life; a
    /// stream keeps 256 KiB, or the most one run of captures took). Refused
    /// under capture.
    pub fn reserve_staging(&self, bytes: usize) -> Result<()> {
        self.enter()?;
        self.refuse_under_capture("reserve_staging", "reserve before the capture begins")?;
        self.keep_graph_staging(bytes)?;
        if lock(self.state()).staging.has_free(bytes) {
            return Ok(());
        }
        let b = Self::staging_block(bytes)?;
        lock(self.state()).staging.add(b, [b]);
        Ok(())
    }

    /// The pinned staging `warm` holds, on this stream: its arena, and as
    /// much room in one piece for captured copies (outside capture).
    pub(crate) fn reserve_staging_like(&self, warm: &NpuStream) -> Result<()> {
        let (arena, room) = {
            let st = lock(warm.state());
            (st.staging.has_arena(), st.staging.graph_room())
        };
        if arena && !lock(self.state()).staging.has_arena() {
            self.add_staging_arena()?;
        }
        if room > 0 {
            self.keep_graph_staging(room)?;
        }
        Ok(())
    }

    /// Makes sure a piece of `bytes` can be cut for a captured copy, adding a
    /// pinned chunk of at least [`GRAPH_STAGING`] bytes when none can.
    /// Outside capture.
    fn keep_graph_staging(&self, bytes: usize) -> Result<()> {
        if lock(self.state()).staging.graph_room() >= bytes {
            return Ok(());
        }
        let chunk = Self::staging_block(bytes.max(GRAPH_STAGING))?;
        lock(self.state()).staging.add_graph_chunk(chunk);
        Ok(())
    }

    /// The first staged copy of the stream: the arena of
    /// [`STAGING_BLOCKS`] blocks of [`STAGING_BLOCK`] bytes (one
    /// `aclrtMallocHost`) and a fence for each, so that later copies
    /// neither allocate nor create events.
    fn add_staging_arena(&self) -> Result<()> {
        let fences = (0..STAGING_BLOCKS).map(|_| SyncEvent::create(self).map(Arc::new)).collect::<Result<Vec<_>>>()?;
        let (ptr, len) = Self::staging_block(STAGING_BLOCK * STAGING_BLOCKS)?;
        let mut st = lock(self.state());
        st.staging.add((ptr, len), (0..STAGING_BLOCKS).map(|i| (ptr + i * STAGING_BLOCK, STAGING_BLOCK)));
        for f in fences {
            st.staging.add_spare(f);
        }
        Ok(())
    }

    /// A fence to record after a staged copy: a spare one, else a new event.
    fn staging_fence(&self) -> Result<Fence> {
        if let Some(f) = lock(self.state()).staging.take_spare() {
            return Ok(f);
        }
        Ok(Arc::new(SyncEvent::create(self)?))
    }

    /// The fence of the block in flight at position `i`, recording one at
    /// the end of the stream for a block that has none (a later record
    /// covers its copy too).
    fn staging_fence_at(&self, i: usize) -> Result<Option<(usize, Fence)>> {
        let Some((ptr, fence)) = lock(self.state()).staging.in_flight_at(i) else { return Ok(None) };
        if let Some(f) = fence {
            return Ok(Some((ptr, f)));
        }
        let f = self.staging_fence()?;
        f.record(self)?;
        lock(self.state()).staging.set_fence(ptr, f.clone());
        Ok(Some((ptr, f)))
    }

    /// Frees staging blocks whose copy completed, outside capture, when a
    /// request of `bytes` finds no free block or [`STAGING_BLOCKS`] blocks
    /// are in flight: the fences of the oldest blocks are asked, without
    /// waiting ([`SyncEvent::is_complete`]), oldest first. Only when
    /// [`STAGING_BLOCKS`] blocks are still in flight after that does the host
    /// wait: for the copy of the newest of the older half
    /// ([`SyncEvent::wait`]), which frees that half. So at most
    /// [`STAGING_BLOCKS`] blocks are ever in flight.
    fn reclaim_staging(&self, bytes: usize) -> Result<()> {
        loop {
            let needed = {
                let st = lock(self.state());
                st.staging.in_flight() >= STAGING_BLOCKS || !st.staging.has_free(bytes)
            };
            if !needed {
                return Ok(());
            }
            let Some((ptr, fence)) = self.staging_fence_at(0)? else { return Ok(()) };
            if !fence.is_complete()? {
                break;
            }
            lock(self.state()).staging.completed_through(ptr);
        }
        if lock(self.state()).staging.in_flight() < STAGING_BLOCKS {
            return Ok(());
        }
        if let Some((ptr, fence)) = self.staging_fence_at(STAGING_BLOCKS / 2 - 1)? {
            fence.wait()?;
            lock(self.state()).staging.completed_through(ptr);
        }
        Ok(())
    }

    /// A pinned block of at least `bytes` for a staged copy, now in flight.
    /// Outside capture: a free block (freeing the completed ones first when
    /// needed, [`reclaim_staging`](Self::reclaim_staging)), else a new
    /// allocation: the arena at the first copy, later only a request larger
    /// than [`STAGING_BLOCK`] that no free block holds. Under capture: a free
    /// block or an error (nothing is allocated or asked).
    fn take_staging(&self, bytes: usize) -> Result<(usize, usize)> {
        if self.is_capturing()? {
            let mut st = lock(self.state());
            let room = st.staging.graph_room();
            return st.staging.take_for_graph(bytes).map(|p| (p, bytes)).ok_or_else(|| {
                Error::invalid(
                    "stage_to_device",
                    "stream",
                    format!(
                        "{self:?} is being captured into a graph: a captured copy keeps its {bytes} bytes of \
                         pinned staging for the stream's life and {room} are left in one piece; reserve more \
                         with amoe_workspace_reserve(stream, 0, staging_bytes) / NpuStream::reserve_staging \
                         before the capture begins"
                    ),
                )
            });
        }
        if !lock(self.state()).staging.has_arena() && bytes <= STAGING_BLOCK {
            self.add_staging_arena()?;
        }
        // The captures since the last eager copy ended: keep room for as many.
        let keep = lock(self.state()).staging.end_graph_run();
        self.keep_graph_staging(keep)?;
        self.reclaim_staging(bytes)?;
        if let Some(b) = lock(self.state()).staging.take_free(bytes) {
            return Ok(b);
        }
        let b = Self::staging_block(bytes)?;
        let mut st = lock(self.state());
        st.staging.add(b, [b]);
        Ok(st.staging.take_free(bytes).unwrap_or(b))
    }

    /// Serves every workspace block of this stream from `allocator` (`None`:
    /// from the stream's pool again). Blocks already handed out go back where
    /// they came from.
    pub fn set_allocator(&self, allocator: Option<Allocator>) {
        lock(self.state()).allocator = allocator;
    }

    /// Returns a block detached from a workspace buffer to the pool, unless
    /// the stream is being captured: then a captured task may use it, and it
    /// stays with the graph ([`Pool::retire`](crate::backend::npu::pool::Pool::retire)).
    pub(crate) fn give_back_block(&self, ptr: usize, block: usize) {
        self.return_block(ptr, block, false)
    }

    /// [`give_back_block`](Self::give_back_block) of a block that was taken
    /// under capture when `captured` (it stays with the graph whatever the
    /// stream does now). When the capture status cannot be read the block is
    /// kept too: keeping it costs memory, reusing it could corrupt a graph.
    pub(crate) fn return_block(&self, ptr: usize, block: usize, captured: bool) {
        let graph = captured || self.is_capturing().unwrap_or(true);
        let mut st = lock(self.state());
        if graph {
            st.pool.retire(ptr, block);
        } else {
            st.pool.give_back(ptr, block);
        }
    }

    /// Reads `dst.len()` bytes of device memory at `src` (a drained stream's,
    /// or a record a replay on another stream may still be writing: the
    /// words read are then a mix, which the caller allows for).
    ///
    /// The copy is blocking, which CANN refuses while another thread's
    /// stream captures in GLOBAL mode (a stream this crate may never have
    /// seen: torch_npu captures in GLOBAL mode by default): the thread is switched to RELAXED for it
    /// ([`rt::relaxed_capture_mode`]; nothing to switch when the caller's check holds the switch,
    /// as `NpuStream::check_with_timeout` does for all its reads). That is right because the words read
    /// are status records of launches this crate made, which no capture
    /// records or reads; the callers never read a record of a launch being
    /// captured (`NpuStream::check_captures_of_other_streams`).
    pub(crate) fn read_drained(&self, src: usize, dst: &mut [u8]) -> Result<()> {
        self.enter()?;
        let _relaxed = rt::relaxed_capture_mode()?;
        let n = dst.len();
        // SAFETY: `src` is device memory of at least `n` bytes of this device
        // (a live pool's); a device write racing the copy changes the words
        // read, never host memory; `dst` is exclusive.
        unsafe {
            rt::memcpy(
                dst.as_mut_ptr().cast(),
                n,
                src as *const std::ffi::c_void,
                n,
                acl_sys::aclrtMemcpyKind::ACL_MEMCPY_DEVICE_TO_HOST,
            )
        }
    }

    /// What this stream's workspace did so far.
    pub fn workspace_stats(&self) -> PoolStats {
        lock(self.state()).pool.stats
    }

    /// Queues a copy of `data` into the device memory `dst` (at least
    /// `data.len()` bytes) through a pinned staging block of this stream, so
    /// the host never waits and never copies from pageable memory
    /// (aclrtMemcpyAsync, AscendCL API reference: asynchronous host copies
    /// need page-locked memory to be truly asynchronous). Outside capture a
    /// fence (an event of the stream's, recorded again) follows the copy,
    /// and the block is free again once the fence completed or the stream
    /// synchronised ([`take_staging`](Self::take_staging)); when the stream
    /// is captured into a graph the block stays reserved for the stream's
    /// life (every replay copies from it again).
    pub(crate) fn stage_to_device(&self, data: &[u8], dst: *mut std::ffi::c_void, dst_len: usize) -> Result<()> {
        if data.is_empty() {
            return Ok(());
        }
        if dst_len < data.len() {
            return Err(Error::invalid("stage_to_device", "dst", format!("{dst_len} bytes for {}", data.len())));
        }
        self.enter()?;
        let (ptr, _) = self.take_staging(data.len())?;
        // SAFETY: `ptr` is a pinned block of at least `data.len()` bytes that
        // no queued copy reads (it was free), exclusively ours until the sync.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), ptr as *mut u8, data.len()) };
        // Under capture the piece was cut for the graph: every replay copies
        // from it again, and it keeps these bytes.
        let capturing = self.is_capturing()?;
        // SAFETY: `dst` is device memory of `dst_len >= data.len()` bytes; the
        // pinned source stays allocated and unchanged until its fence
        // completed or the stream drained.
        let queued = unsafe {
            rt::memcpy_async(
                dst,
                dst_len,
                ptr as *const std::ffi::c_void,
                data.len(),
                acl_sys::aclrtMemcpyKind::ACL_MEMCPY_HOST_TO_DEVICE,
                self.raw(),
            )
        };
        if capturing {
            return queued;
        }
        if let Err(e) = queued {
            lock(self.state()).staging.not_queued(ptr);
            return Err(e);
        }
        // Without a fence the block is freed by a later fence or the next sync.
        let fence = self.staging_fence()?;
        match fence.record(self) {
            Ok(()) => lock(self.state()).staging.set_fence(ptr, fence),
            Err(e) => {
                lock(self.state()).staging.add_spare(fence);
                return Err(e);
            }
        }
        Ok(())
    }
}
