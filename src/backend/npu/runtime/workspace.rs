//! The workspace pool and the pinned staging blocks of a stream.

use super::stream::{lock, NpuStream};
use crate::backend::npu::pool::{self, Allocator, PoolStats};
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

    /// A new pinned staging block of at least `bytes` (`aclrtMallocHost`).
    fn staging_block(bytes: usize) -> Result<(usize, usize)> {
        let len = pool::round_up(bytes)?;
        // Nonzero size.
        let ptr = rt::malloc_host(len)?;
        Ok((ptr as usize, len))
    }

    /// Makes sure a pinned staging block of at least `bytes` is free (small
    /// host data the native kernel needs: slot offsets, a tiling).
    pub fn reserve_staging(&self, bytes: usize) -> Result<()> {
        self.enter()?;
        self.refuse_under_capture("reserve_staging", "reserve before the capture begins")?;
        if lock(self.state()).staging.has_free(bytes) {
            return Ok(());
        }
        let b = Self::staging_block(bytes)?;
        lock(self.state()).staging.add(b, true);
        Ok(())
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

    /// Reads `dst.len()` bytes of device memory at `src` (a drained stream's).
    pub(crate) fn read_drained(&self, src: usize, dst: &mut [u8]) -> Result<()> {
        self.enter()?;
        let n = dst.len();
        // SAFETY: `src` is device memory of at least `n` bytes of this device
        // that no queued work writes (the stream drained); `dst` is exclusive.
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
    /// need page-locked memory to be truly asynchronous). The block stays
    /// reserved until the stream's next synchronisation, or, when the stream
    /// is captured into a graph, for the stream's life (every replay copies
    /// from it again).
    pub(crate) fn stage_to_device(&self, data: &[u8], dst: *mut std::ffi::c_void, dst_len: usize) -> Result<()> {
        if data.is_empty() {
            return Ok(());
        }
        if dst_len < data.len() {
            return Err(Error::invalid("stage_to_device", "dst", format!("{dst_len} bytes for {}", data.len())));
        }
        self.enter()?;
        let taken = lock(self.state()).staging.take_free(data.len());
        let (ptr, _) = match taken {
            Some(b) => b,
            None => {
                self.refuse_under_capture(
                    "stage_to_device",
                    "no pinned staging block is free and none can be allocated; reserve with \
                     amoe_workspace_reserve / NpuStream::reserve_staging before the capture begins",
                )?;
                let b = Self::staging_block(data.len())?;
                lock(self.state()).staging.add(b, false);
                b
            }
        };
        // SAFETY: `ptr` is a pinned block of at least `data.len()` bytes that
        // no queued copy reads (it was free), exclusively ours until the sync.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), ptr as *mut u8, data.len()) };
        if self.is_capturing()? {
            // Every replay copies from the block again: it keeps these bytes.
            lock(self.state()).staging.keep_for_graph(ptr);
        }
        // SAFETY: `dst` is device memory of `dst_len >= data.len()` bytes; the
        // pinned source stays allocated and unchanged until the stream drained.
        unsafe {
            rt::memcpy_async(
                dst,
                dst_len,
                ptr as *const std::ffi::c_void,
                data.len(),
                acl_sys::aclrtMemcpyKind::ACL_MEMCPY_HOST_TO_DEVICE,
                self.raw(),
            )
        }
    }
}
