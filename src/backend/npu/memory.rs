//! Device memory ([`NpuBuffer`], typed [`DeviceBuffer`]) and pinned host
//! memory ([`PinnedHostBuffer`]).
//!
//! A buffer belongs to a stream: work on it is queued there. An owned buffer
//! ([`NpuBuffer::alloc`]) synchronises that stream before `aclrtFree` on drop,
//! so memory is never released under queued work. A workspace buffer
//! ([`NpuBuffer::workspace`], what ops use for their intermediates) comes from
//! the stream's pool or the caller's allocator and goes back there on drop
//! without any synchronisation (see [`super::pool`]). "Sync" copies
//! synchronise the stream first and then use the blocking `aclrtMemcpy`;
//! "async" copies are queued on the stream.

use std::ffi::c_void;

use acl_sys::{aclrtMemMallocPolicy, aclrtMemcpyKind};

use super::aclnn::DeviceMemory;
use super::kernel;
use super::pool::{self, Allocator};
use super::result::acl as rt;
use super::runtime::{lock, record_drop_error, settled, NpuStream};
use super::NpuDevice;
use crate::{Error, Result};

/// Asynchronous device-to-device copies need 64-byte aligned addresses.
const ASYNC_D2D_ALIGN: usize = 64;

/// Untyped device memory (the storage of an NPU [`crate::Tensor`]).
///
/// Either owned (from [`NpuBuffer::alloc`]; dropping it frees the memory) or
/// borrowed (from [`NpuBuffer::borrow_raw`]; memory of the host engine, e.g.
/// a torch_npu tensor, which dropping never frees).
pub struct NpuBuffer {
    ptr: *mut c_void,
    len: usize,
    device: NpuDevice,
    origin: Origin,
}

/// Where a buffer's memory comes from, and where it goes on drop.
#[derive(Clone)]
enum Origin {
    /// `aclrtMalloc`; freed after a synchronisation of the stream.
    Owned,
    /// The host engine's memory; never freed.
    Borrowed,
    /// A block of the stream's pool (`len` rounded up); returned without
    /// sync, or kept by the graph when taken under capture
    /// ([`NpuStream::give_back_block`]).
    Pool { block: usize, captured: bool },
    /// A block of the caller's allocator; returned through its `free`.
    Callback(Allocator),
}

impl std::fmt::Debug for Origin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Origin::Owned => f.write_str("Owned"),
            Origin::Borrowed => f.write_str("Borrowed"),
            Origin::Pool { block, captured } => {
                f.debug_struct("Pool").field("block", block).field("captured", captured).finish()
            }
            Origin::Callback(_) => f.write_str("Callback"),
        }
    }
}

// SAFETY: the pointer is device memory, never dereferenced on the host; ACL
// allows any thread bound to the device to use it (we bind before each call).
unsafe impl Send for NpuBuffer {}
// SAFETY: `&NpuBuffer` only reads through the runtime (copies from it).
unsafe impl Sync for NpuBuffer {}

impl std::fmt::Debug for NpuBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NpuBuffer(npu:{}, {} bytes at {:p})", self.device.ordinal(), self.len, self.ptr)
    }
}

impl NpuBuffer {
    /// Allocates `len` uninitialised bytes on `device` (queued work goes on its stream).
    pub fn alloc(device: &NpuDevice, len: usize) -> Result<Self> {
        if len == 0 {
            return Ok(NpuBuffer { ptr: std::ptr::null_mut(), len, device: device.clone(), origin: Origin::Owned });
        }
        device.stream().enter()?;
        // Nonzero size, device bound.
        let ptr = rt::malloc(len, aclrtMemMallocPolicy::ACL_MEM_MALLOC_HUGE_FIRST)?;
        Ok(NpuBuffer { ptr, len, device: device.clone(), origin: Origin::Owned })
    }

    /// `len` uninitialised bytes of workspace for work queued on `device`'s
    /// stream: from the caller's allocator when one is set on the stream,
    /// else from the stream's pool, which grows (`aclrtMalloc`) only outside
    /// graph capture. Dropping it never synchronises.
    pub fn workspace(device: &NpuDevice, len: usize) -> Result<Self> {
        let origin = Origin::Pool { block: 0, captured: false };
        if len == 0 {
            return Ok(NpuBuffer { ptr: std::ptr::null_mut(), len, device: device.clone(), origin });
        }
        let stream = device.stream();
        let allocator = lock(stream.state()).allocator.clone();
        if let Some(a) = allocator {
            let ptr = pool::callback_alloc(&a, len, stream.raw())?;
            lock(stream.state()).pool.stats.callback_blocks += 1;
            return Ok(NpuBuffer { ptr, len, device: device.clone(), origin: Origin::Callback(a) });
        }
        Self::pool_block(device, len)
    }

    /// `len` bytes from the stream's own pool, whatever allocator is set: for
    /// records the stream's check holds after the op (a kernel's status
    /// words), which must not go back to the engine's allocator before they
    /// were read. Same rules as [`workspace`](Self::workspace) otherwise.
    pub(crate) fn pool_block(device: &NpuDevice, len: usize) -> Result<Self> {
        let origin = Origin::Pool { block: 0, captured: false };
        if len == 0 {
            return Ok(NpuBuffer { ptr: std::ptr::null_mut(), len, device: device.clone(), origin });
        }
        let captured = device.stream().is_capturing()?;
        let (ptr, block) = super::device_check::take_pool_block(device.stream(), len)?;
        let origin = Origin::Pool { block, captured };
        Ok(NpuBuffer { ptr: ptr as *mut c_void, len, device: device.clone(), origin })
    }

    /// `len` zero bytes of workspace (the memset is queued on the stream).
    pub fn workspace_zeros(device: &NpuDevice, len: usize) -> Result<Self> {
        let b = Self::workspace(device, len)?;
        b.memset_async(0, 0, len)?;
        Ok(b)
    }

    /// Wraps `len` bytes of device memory owned by someone else (e.g. a
    /// torch_npu tensor) without copying and without taking ownership:
    /// dropping the buffer never frees `ptr`. Bounds checks use `len`; work on
    /// the buffer is queued on `device`'s stream.
    ///
    /// # Safety
    /// `ptr` must be NULL (only with `len == 0`) or device memory of `device`
    /// valid for `len` bytes for as long as the returned buffer (and every
    /// tensor holding it) lives, and not freed by its owner meanwhile.
    pub unsafe fn borrow_raw(device: &NpuDevice, ptr: *mut c_void, len: usize) -> Result<Self> {
        if ptr.is_null() && len > 0 {
            return Err(Error::invalid("NpuBuffer::borrow_raw", "ptr", format!("NULL for {len} bytes")));
        }
        Ok(NpuBuffer { ptr, len, device: device.clone(), origin: Origin::Borrowed })
    }

    /// Whether dropping this buffer frees or returns its memory (false for
    /// [`NpuBuffer::borrow_raw`]).
    pub fn is_owned(&self) -> bool {
        !matches!(self.origin, Origin::Borrowed)
    }

    /// Whether this is workspace (pool or the caller's allocator), whose drop
    /// never synchronises.
    pub fn is_workspace(&self) -> bool {
        matches!(self.origin, Origin::Pool { .. } | Origin::Callback(_))
    }

    /// Allocates `len` zero bytes.
    pub fn zeros(device: &NpuDevice, len: usize) -> Result<Self> {
        let b = Self::alloc(device, len)?;
        b.memset_async(0, 0, len)?;
        Ok(b)
    }

    /// Allocates `len` bytes that are zero when this returns: a blocking
    /// memset, queued on no stream, for memory that work on any stream of
    /// the device may use next (a queued memset is ordered on the device's
    /// stream only). Refused while a capture's mode forbids blocking calls.
    pub fn zeros_now(device: &NpuDevice, len: usize) -> Result<Self> {
        let b = Self::alloc(device, len)?;
        if len == 0 {
            return Ok(b);
        }
        device.stream().enter()?;
        // aclrtMemset is the driver's memset, done when it returns and
        // ordered with no stream: `aclrtMemsetImpl` -> `rtMemset`
        // (hicann/runtime v8.5.0 `src/acl/aclrt_impl/memory.cpp:547-560`,
        // `src/runtime/feature/src/api/api_c.cc:961-974`) -> `ApiImpl::MemSetSync`,
        // which refuses it when the capture mode forbids it
        // (`src/runtime/feature/src/api_impl/api_impl.cc:3049-3064`) ->
        // `NpuDriver::MemSetSync`, `drvMemsetD8`
        // (`src/runtime/feature/src/drv/npu_driver.cc:2141-2158`).
        // SAFETY: `len` bytes of this fresh allocation, which no queued work uses.
        unsafe { rt::memset(b.ptr, len, 0, len) }?;
        Ok(b)
    }

    /// Size in bytes.
    pub fn len_bytes(&self) -> usize {
        self.len
    }

    /// The owning device.
    pub fn device(&self) -> &NpuDevice {
        &self.device
    }

    /// The stream work on this buffer is queued on.
    pub fn stream(&self) -> &NpuStream {
        self.device.stream()
    }

    /// The device address (not dereferenceable on the host).
    pub fn as_ptr(&self) -> *mut c_void {
        self.ptr
    }

    fn at(&self, offset: usize) -> *mut c_void {
        self.ptr.cast::<u8>().wrapping_add(offset).cast()
    }

    fn range_check(&self, op: &'static str, arg: &'static str, offset: usize, len: usize) -> Result<()> {
        if offset.checked_add(len).map_or(true, |end| end > self.len) {
            return Err(Error::invalid(
                op,
                arg,
                format!("bytes {offset}..{} outside a buffer of {} bytes", offset.saturating_add(len), self.len),
            ));
        }
        Ok(())
    }

    /// Queues `memset(self[offset..offset+len], value)` on the stream.
    pub fn memset_async(&self, value: u8, offset: usize, len: usize) -> Result<()> {
        self.range_check("NpuBuffer::memset_async", "len", offset, len)?;
        if len == 0 {
            return Ok(());
        }
        self.stream().enter()?;
        // SAFETY: the range is inside this allocation; the stream is live.
        unsafe { rt::memset_async(self.at(offset), self.len - offset, value as i32, len, self.stream().raw()) }
    }

    /// Copies `src` into `self[offset..]`, blocking until done.
    pub fn copy_from_host_at(&self, offset: usize, src: &[u8]) -> Result<()> {
        self.range_check("NpuBuffer::copy_from_host", "src", offset, src.len())?;
        if src.is_empty() {
            return Ok(());
        }
        self.stream().synchronize()?;
        self.stream().enter()?;
        // SAFETY: the destination range is inside this allocation and `src` is
        // a live host slice of exactly `src.len()` bytes.
        unsafe {
            rt::memcpy(
                self.at(offset),
                self.len - offset,
                src.as_ptr().cast(),
                src.len(),
                aclrtMemcpyKind::ACL_MEMCPY_HOST_TO_DEVICE,
            )
        }
    }

    /// Copies `self[offset..offset+dst.len()]` to `dst`, after all queued work.
    pub fn copy_to_host_at(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.range_check("NpuBuffer::copy_to_host", "dst", offset, dst.len())?;
        if dst.is_empty() {
            return Ok(());
        }
        self.stream().synchronize()?;
        self.stream().enter()?;
        let n = dst.len();
        // SAFETY: the source range is inside this allocation; `dst` is a live,
        // exclusively borrowed host slice of `n` bytes.
        unsafe {
            rt::memcpy(dst.as_mut_ptr().cast(), n, self.at(offset), n, aclrtMemcpyKind::ACL_MEMCPY_DEVICE_TO_HOST)
        }
    }

    /// Copies the whole buffer to host memory (synchronising its stream).
    pub fn copy_to_host(&self, dst: &mut [u8]) -> Result<()> {
        if dst.len() != self.len {
            return Err(Error::invalid(
                "NpuBuffer::copy_to_host",
                "dst",
                format!("{} bytes, expected the buffer's {}", dst.len(), self.len),
            ));
        }
        self.copy_to_host_at(0, dst)
    }

    /// Copies `len` bytes from `src[src_off..]` to `self[dst_off..]` on this
    /// buffer's stream, ordered after `src`'s stream; the host never waits
    /// for a copy within one device.
    ///
    /// - Both addresses 64-byte aligned: `aclrtMemcpyAsync` (acl_rt.h: an
    ///   on-chip device-to-device asynchronous copy needs 64-byte aligned
    ///   source and destination).
    /// - Any other same-device copy: the byte-copy kernel
    ///   (`kernels/copy_kernel.cpp`), enqueued like the other native kernels;
    ///   it stages and allocates nothing, so it can be captured into a graph.
    /// - Where no copy kernel can launch (no AI Core kernel library, not the
    ///   simulator), an unaligned copy synchronises the stream and uses the
    ///   blocking `aclrtMemcpy`; under graph capture, which forbids both,
    ///   that is refused with an error naming the copy.
    /// - Buffers on different devices are staged through the host (blocking).
    ///
    /// Overlapping source and destination ranges are refused (the same
    /// range is left as it is).
    pub fn copy_from_device(&self, dst_off: usize, src: &NpuBuffer, src_off: usize, len: usize) -> Result<()> {
        const OP: &str = "NpuBuffer::copy_from_device";
        self.range_check(OP, "dst", dst_off, len)?;
        src.range_check(OP, "src", src_off, len)?;
        if len == 0 {
            return Ok(());
        }
        if src.device.ordinal() != self.device.ordinal() {
            let mut host = crate::backend::cpu::CpuBuffer::try_zeros(OP, len)?;
            src.copy_to_host_at(src_off, host.as_bytes_mut())?;
            return self.copy_from_host_at(dst_off, host.as_bytes());
        }
        let (d, s) = (self.at(dst_off), src.at(src_off));
        let (da, sa) = (d as usize, s as usize);
        if da == sa {
            return Ok(());
        }
        if da < sa.wrapping_add(len) && sa < da.wrapping_add(len) {
            return Err(Error::invalid(
                OP,
                "src",
                format!(
                    "the {len} bytes at {sa:#x} overlap the {len} bytes at {da:#x} they would be copied to; \
                     neither the copy engine nor the copy kernel defines overlapping copies: copy through a \
                     separate buffer"
                ),
            ));
        }
        self.stream().wait_for(src.stream())?;
        self.stream().enter()?;
        if da % ASYNC_D2D_ALIGN == 0 && sa % ASYNC_D2D_ALIGN == 0 {
            // SAFETY: both ranges are inside live allocations of this device;
            // both buffers outlive the queued copy (their drop synchronises
            // their stream, and `src`'s is ordered after the copy below).
            unsafe {
                rt::memcpy_async(
                    d,
                    self.len - dst_off,
                    s,
                    len,
                    aclrtMemcpyKind::ACL_MEMCPY_DEVICE_TO_DEVICE,
                    self.stream().raw(),
                )
            }?;
            // `src` is neither overwritten nor freed through its own stream
            // while the copy still reads it.
            return self.stream().order_operand_streams_after(std::slice::from_ref(src.stream()));
        }
        // SAFETY: both ranges are inside live allocations of this device and
        // do not overlap (checked above); an owned buffer's drop synchronises
        // its stream (`src`'s is ordered after the copy below) and workspace
        // is reused only by work queued after this copy, so both outlive it.
        if unsafe { kernel::copy::enqueue_copy(self.stream(), d, s, len) }? {
            return self.stream().order_operand_streams_after(std::slice::from_ref(src.stream()));
        }
        if self.stream().is_capturing()? {
            return Err(Error::invalid(
                OP,
                "stream",
                format!(
                    "{len} bytes from {sa:#x} to {da:#x} while {:?} is captured into a graph: the addresses are \
                     not both 64-byte aligned, which aclrtMemcpyAsync needs, and no copy kernel can launch here \
                     (neither the simulator's cannsim_launch_kernel_ex with the host kernel build nor an AI Core \
                     kernel library with {}), so the copy would need a stream synchronisation and the blocking \
                     aclrtMemcpy, which capture forbids: build the crate with CANN (or set ASCEND_MOE_KERNEL_LIB) \
                     so the copy kernel exists, or keep both offsets multiples of 64 bytes",
                    self.stream(),
                    kernel::copy::NPU_COPY_LAUNCH_SYMBOL
                ),
            ));
        }
        self.stream().synchronize()?;
        // SAFETY: as above; the blocking copy runs after all queued work.
        unsafe { rt::memcpy(d, self.len - dst_off, s, len, aclrtMemcpyKind::ACL_MEMCPY_DEVICE_TO_DEVICE) }
    }

    /// Queues a host-to-device copy from pinned memory.
    pub fn copy_from_pinned_async(&self, offset: usize, src: &PinnedHostBuffer) -> Result<()> {
        self.range_check("NpuBuffer::copy_from_pinned_async", "src", offset, src.len)?;
        if src.len == 0 {
            return Ok(());
        }
        self.stream().enter()?;
        // SAFETY: pinned memory stays valid until its drop, which synchronises
        // the stream it was used with (the caller keeps it alive; see
        // `PinnedHostBuffer`); the device range is inside this allocation.
        unsafe {
            rt::memcpy_async(
                self.at(offset),
                self.len - offset,
                src.ptr,
                src.len,
                aclrtMemcpyKind::ACL_MEMCPY_HOST_TO_DEVICE,
                self.stream().raw(),
            )
        }
    }

    /// Queues a device-to-host copy into pinned memory (read it after
    /// synchronising the stream).
    pub fn copy_to_pinned_async(&self, offset: usize, dst: &mut PinnedHostBuffer) -> Result<()> {
        self.range_check("NpuBuffer::copy_to_pinned_async", "dst", offset, dst.len)?;
        if dst.len == 0 {
            return Ok(());
        }
        self.stream().enter()?;
        // SAFETY: as for `copy_from_pinned_async`.
        unsafe {
            rt::memcpy_async(
                dst.ptr,
                dst.len,
                self.at(offset),
                dst.len,
                aclrtMemcpyKind::ACL_MEMCPY_DEVICE_TO_HOST,
                self.stream().raw(),
            )
        }
    }
}

impl Drop for NpuBuffer {
    fn drop(&mut self) {
        if self.ptr.is_null() {
            return;
        }
        match &self.origin {
            Origin::Borrowed => return,
            Origin::Owned => {}
            &Origin::Pool { block, captured } => {
                // Stream-ordered reuse: no sync (module docs); a block a
                // captured task uses stays with the graph.
                self.device.stream().return_block(self.ptr as usize, block, captured);
                return;
            }
            Origin::Callback(a) => {
                // `ptr` came from `a.alloc` with `len` bytes on this stream and
                // goes back once; work queued on the stream may still use it.
                if let Some(p) = std::ptr::NonNull::new(self.ptr) {
                    a.free(p, self.len, self.device.stream().raw());
                }
                lock(self.device.stream().state()).pool.stats.callback_frees += 1;
                return;
            }
        }
        let stream = self.device.stream().clone();
        // Bounded: a collective that never completes leaks the buffer rather
        // than blocking the drop (`teardown_sync`).
        let result = settled(stream.teardown_sync()).and_then(|_| {
            stream.enter()?;
            // SAFETY: allocated by aclrtMalloc, freed once, no queued work left.
            unsafe { rt::free(self.ptr) }
        });
        if let Err(e) = result {
            record_drop_error(e);
        }
    }
}

impl DeviceMemory for NpuBuffer {
    fn device_ptr(&self) -> *mut c_void {
        self.ptr
    }

    fn size_bytes(&self) -> usize {
        self.len
    }
}

/// Page-locked host memory from `aclrtMallocHost`, for asynchronous copies.
/// Dropping it synchronises its device's stream first, so a queued copy never
/// outlives the memory.
pub struct PinnedHostBuffer {
    ptr: *mut c_void,
    len: usize,
    device: NpuDevice,
}

// SAFETY: plain host memory owned by this value; ACL places no thread
// restriction on pinned memory.
unsafe impl Send for PinnedHostBuffer {}
// SAFETY: shared access only reads.
unsafe impl Sync for PinnedHostBuffer {}

impl std::fmt::Debug for PinnedHostBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PinnedHostBuffer({} bytes)", self.len)
    }
}

impl PinnedHostBuffer {
    /// `len` zero bytes of pinned memory.
    pub fn zeros(device: &NpuDevice, len: usize) -> Result<Self> {
        if len == 0 {
            return Ok(PinnedHostBuffer { ptr: std::ptr::null_mut(), len, device: device.clone() });
        }
        device.stream().enter()?;
        // Nonzero size.
        let ptr = rt::malloc_host(len)?;
        // SAFETY: `ptr` is a fresh host allocation of `len` bytes.
        unsafe { std::ptr::write_bytes(ptr.cast::<u8>(), 0, len) };
        Ok(PinnedHostBuffer { ptr, len, device: device.clone() })
    }

    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The bytes (synchronise the stream first if a copy into them is queued).
    pub fn as_bytes(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: `ptr` is a live host allocation of `len` bytes owned by self.
        unsafe { std::slice::from_raw_parts(self.ptr.cast(), self.len) }
    }

    /// The bytes, mutable.
    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        if self.len == 0 {
            return &mut [];
        }
        // SAFETY: as above, and `&mut self` makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.cast(), self.len) }
    }
}

impl Drop for PinnedHostBuffer {
    fn drop(&mut self) {
        if self.ptr.is_null() {
            return;
        }
        let stream = self.device.stream().clone();
        // Bounded: a collective that never completes leaks the buffer rather
        // than blocking the drop (`teardown_sync`).
        let result = settled(stream.teardown_sync()).and_then(|_| {
            stream.enter()?;
            // SAFETY: allocated by aclrtMallocHost, freed once, no queued copy left.
            unsafe { rt::free_host(self.ptr) }
        });
        if let Err(e) = result {
            record_drop_error(e);
        }
    }
}

impl crate::backend::Buffer for NpuBuffer {
    fn len_bytes(&self) -> usize {
        NpuBuffer::len_bytes(self)
    }
}
