//! The ACL runtime, safely: loading, error mapping, per-thread device
//! binding, streams and events.
//!
//! Ownership: a [`NpuStream`] holds an `Arc` of its device context, an
//! [`NpuEvent`] and every buffer hold their stream, so a parent never dies
//! before its children. Handles borrowed from a host engine (a torch_npu
//! stream) are never destroyed by us. `Drop` never panics: failures are
//! recorded in [`drop_errors`].
//!
//! Ordering without host waits: an op queues its work on the stream of its
//! call and returns. What only the device can tell (an HCCL async error, a
//! kernel's status words) is recorded as pending work of that stream and
//! reported by [`NpuStream::check`], the one sync point the caller owns.
//! Handles the device may still use (events of a cross-stream wait) are kept
//! with the stream until its next synchronisation.

use std::collections::HashMap;
use std::ffi::CStr;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use acl_sys::{aclError, aclrtEvent, aclrtStream, Acl};

use super::pool::{Allocator, Pool, Staging};

use crate::{Error, Result};

/// The loaded ACL runtime, or [`Error::Unavailable`] naming every path tried.
pub fn acl() -> Result<&'static Acl> {
    acl_sys::acl().map_err(|e| Error::Unavailable(e.to_string()))
}

/// Resolves one symbol of the ACL function table; a symbol this CANN release
/// lacks is [`Error::Unavailable`].
macro_rules! acl_fn {
    ($api:expr, $name:ident) => {
        $api.lib.$name.as_ref().map_err(|_| {
            $crate::Error::Unavailable(format!(
                "{} is not exported by {}",
                stringify!($name),
                $api.origin.path.to_string_lossy()
            ))
        })
    };
}
pub(crate) use acl_fn;

/// `aclGetRecentErrMsg()`, or an empty string.
pub fn recent_error_message() -> String {
    let Ok(api) = acl() else { return String::new() };
    let Ok(f) = api.lib.aclGetRecentErrMsg.as_ref() else { return String::new() };
    // SAFETY: no arguments; the result is NULL or a NUL-terminated string owned
    // by the runtime, copied out immediately.
    let p = unsafe { f() };
    if p.is_null() {
        return String::new();
    }
    // SAFETY: non-NULL and NUL-terminated per the ACL contract.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().trim().to_string()
}

/// `Ok` for `ACL_SUCCESS`, otherwise [`Error::Acl`] with the vendor message.
pub fn check(call: &'static str, code: aclError) -> Result<()> {
    if code == acl_sys::ACL_SUCCESS as aclError {
        Ok(())
    } else {
        Err(Error::Acl { call, code, msg: recent_error_message() })
    }
}

/// Errors that happened while dropping a handle (where they cannot be
/// returned). Drained by [`take_drop_errors`].
fn drop_error_log() -> &'static Mutex<Vec<Error>> {
    static LOG: OnceLock<Mutex<Vec<Error>>> = OnceLock::new();
    LOG.get_or_init(|| Mutex::new(Vec::new()))
}

/// Records an error raised in a `Drop`.
pub(crate) fn record_drop_error(e: Error) {
    if let Ok(mut log) = drop_error_log().lock() {
        if log.len() < 1024 {
            log.push(e);
        }
    }
}

/// The result of the synchronisation a `Drop` makes before it releases
/// memory or a handle: a timeout (work may still run) stops the release; any
/// other failure is recorded and the release goes on, since a stream whose
/// task failed runs nothing more (its later tasks are skipped and every sync
/// returns the error), so nothing on the device still uses the memory.
pub(crate) fn settled(r: Result<()>) -> Result<()> {
    match r {
        Err(e @ Error::Acl { code, .. }) if code == acl_sys::ACL_ERROR_RT_STREAM_SYNC_TIMEOUT as aclError => Err(e),
        Err(e) => {
            record_drop_error(e);
            Ok(())
        }
        Ok(()) => Ok(()),
    }
}

/// Returns and clears the errors recorded while dropping NPU handles.
pub fn take_drop_errors() -> Vec<Error> {
    drop_error_log().lock().map(|mut l| std::mem::take(&mut *l)).unwrap_or_default()
}

/// Calls `aclInit(NULL)` once per process. A runtime already initialised by
/// the host engine (torch_npu) is fine.
fn init(api: &'static Acl) -> Result<()> {
    static INIT: OnceLock<Result<()>> = OnceLock::new();
    INIT.get_or_init(|| {
        let f = acl_fn!(api, aclInit)?;
        // SAFETY: NULL config path is documented as "no config file".
        let code = unsafe { f(std::ptr::null()) };
        if code == acl_sys::ACL_ERROR_REPEAT_INITIALIZE as aclError {
            return Ok(());
        }
        check("aclInit", code)
    })
    .clone()
}

/// Number of visible devices.
pub fn device_count() -> Result<u32> {
    let api = acl()?;
    init(api)?;
    let mut n = 0u32;
    let f = acl_fn!(api, aclrtGetDeviceCount)?;
    // SAFETY: `n` is a valid out-pointer.
    check("aclrtGetDeviceCount", unsafe { f(&mut n) })?;
    Ok(n)
}

/// Per-device state shared by every handle on that device.
#[derive(Debug)]
pub struct DeviceCtx {
    ordinal: u32,
    api: &'static Acl,
}

impl DeviceCtx {
    /// Loads ACL, initialises it and checks `ordinal` exists.
    pub fn open(ordinal: u32) -> Result<Arc<Self>> {
        let api = acl()?;
        let count = device_count()?;
        if ordinal >= count {
            return Err(Error::invalid(
                "NpuDevice::open",
                "ordinal",
                format!("device {ordinal} does not exist ({count} visible)"),
            ));
        }
        let ctx = Arc::new(DeviceCtx { ordinal, api });
        ctx.bind()?;
        Ok(ctx)
    }

    /// The ordinal.
    pub fn ordinal(&self) -> u32 {
        self.ordinal
    }

    /// The ACL function table.
    pub fn api(&self) -> &'static Acl {
        self.api
    }

    /// Makes this device current on the calling thread. `aclrtSetDevice` is
    /// per thread; it is only called when `aclrtGetDevice` reports another
    /// device (or none), so a host engine that switched the thread's device
    /// behind our back is noticed.
    pub fn bind(&self) -> Result<()> {
        let get = acl_fn!(self.api, aclrtGetDevice)?;
        let mut current = -1i32;
        // SAFETY: valid out-pointer; fails harmlessly when no device is set.
        if unsafe { get(&mut current) } == acl_sys::ACL_SUCCESS as aclError && current == self.ordinal as i32 {
            return Ok(());
        }
        let f = acl_fn!(self.api, aclrtSetDevice)?;
        // SAFETY: plain integer argument, validated against the device count.
        check("aclrtSetDevice", unsafe { f(self.ordinal as i32) })
    }
}

/// Queued work whose outcome only the device knows: a collective (its
/// communicator's async error), a kernel launch (its status words). Recorded
/// when the work is queued, examined by [`NpuStream::check`] after the stream
/// drained.
pub(crate) trait Pending: Send + Sync {
    /// Identifies work that reports the same thing (one communicator and
    /// collective): a repeat replaces nothing and is not recorded again.
    fn key(&self) -> Option<(usize, &'static str)>;
    /// The longest this work may take (a collective's communicator timeout).
    fn timeout(&self) -> Option<Duration>;
    /// The error recorded on the device for this work, once the stream is
    /// drained (or failed to drain: then `wait` holds why).
    fn outcome(&self, wait: Option<&Error>, stream: &NpuStream) -> Result<()>;
}

/// The state shared by every handle on one raw stream: its pending checks,
/// the handles its queued work still uses, and its workspace.
#[derive(Default)]
pub(crate) struct StreamState {
    pending: Vec<Box<dyn Pending>>,
    /// Checks of work captured into a graph: every replay rewrites what they
    /// read, so every check reads them again (they are never drained).
    captured: Vec<Box<dyn Pending>>,
    /// Zeroed record slots for kernel launches captured into a graph:
    /// (device address, slot bytes, slots, slots taken). Reserved outside
    /// capture from the pool; a slot stays with its captured launch.
    records: Option<(usize, usize, usize, usize)>,
    keep: Vec<Box<dyn Send + Sync>>,
    pub(crate) pool: Pool,
    pub(crate) staging: Staging,
    pub(crate) allocator: Option<Allocator>,
}

pub(crate) type StateRef = Arc<Mutex<StreamState>>;

/// One [`StreamState`] per `(device, raw stream)` while a handle of it lives,
/// so two wraps of the host engine's stream share one check and one pool.
type StateMap = HashMap<(u32, usize), std::sync::Weak<Mutex<StreamState>>>;

fn states() -> &'static Mutex<StateMap> {
    static STATES: OnceLock<Mutex<StateMap>> = OnceLock::new();
    STATES.get_or_init(|| Mutex::new(HashMap::new()))
}

fn state_for(ordinal: u32, raw: aclrtStream) -> StateRef {
    let mut map = states().lock().unwrap_or_else(|p| p.into_inner());
    let slot = map.entry((ordinal, raw as usize)).or_default();
    if let Some(s) = slot.upgrade() {
        return s;
    }
    let s = StateRef::default();
    *slot = Arc::downgrade(&s);
    s
}

pub(crate) fn lock(state: &StateRef) -> std::sync::MutexGuard<'_, StreamState> {
    // A panic while holding the lock leaves plain lists behind: still usable.
    state.lock().unwrap_or_else(|p| p.into_inner())
}

struct StreamInner {
    raw: aclrtStream,
    owned: bool,
    ctx: Arc<DeviceCtx>,
    state: StateRef,
}

// SAFETY: an aclrtStream is a runtime handle, not thread-affine: ACL allows
// any thread that has set the stream's device (we bind before every call) to
// launch work on it, and launches on one stream are serialised by the runtime.
unsafe impl Send for StreamInner {}
// SAFETY: as above; shared references only launch work or synchronise.
unsafe impl Sync for StreamInner {}

/// `aclmdlRICaptureGetInfo` (acl_mdl.h of CANN 8.1): true unless the status
/// is `ACL_MODEL_RI_CAPTURE_STATUS_NONE`; false on a runtime without the
/// capture API. The stream's device must be bound.
fn capturing(api: &'static Acl, raw: aclrtStream) -> Result<bool> {
    let Ok(f) = acl_sys::acl_symbol!(api, aclmdlRICaptureGetInfo) else { return Ok(false) };
    let mut status = acl_sys::aclmdlRICaptureStatus::ACL_MODEL_RI_CAPTURE_STATUS_NONE;
    let mut model: acl_sys::aclmdlRI = std::ptr::null_mut();
    // SAFETY: live stream, device bound, valid out-pointers.
    check("aclmdlRICaptureGetInfo", unsafe { f(raw, &mut status, &mut model) })?;
    Ok(status != acl_sys::aclmdlRICaptureStatus::ACL_MODEL_RI_CAPTURE_STATUS_NONE)
}

impl StreamInner {
    /// Frees the workspace pool when this is the last handle of the stream:
    /// the stream is synchronised first (the pool's blocks may still be in
    /// use by queued work), the one synchronisation the pool ever makes.
    fn release_pool(&self, api: &'static Acl) -> Result<()> {
        {
            let st = lock(&self.state);
            if Arc::strong_count(&self.state) > 1 || (st.pool.is_empty() && st.staging.is_empty()) {
                return Ok(());
            }
        }
        // Under capture the sync would invalidate the capture and the blocks
        // may belong to the graph being recorded: they are kept (and reported).
        if capturing(api, self.raw)? {
            return Err(Error::invalid(
                "NpuStream::drop",
                "stream",
                "the last handle of a stream was dropped while it is captured: its workspace pool is kept \
                 (freeing it would synchronise the capture); drop the handle after the capture ends",
            ));
        }
        let sync = acl_fn!(api, aclrtSynchronizeStream)?;
        // SAFETY: `raw` is a live stream (destroyed only after this).
        settled(check("aclrtSynchronizeStream", unsafe { sync(self.raw) }))?;
        let (segments, staged) = {
            let mut st = lock(&self.state);
            (st.pool.take_segments(), st.staging.take_all())
        };
        let free = acl_fn!(api, aclrtFree)?;
        let free_host = acl_fn!(api, aclrtFreeHost)?;
        let mut first = Ok(());
        for (ptr, _) in segments {
            // SAFETY: a segment from aclrtMalloc (`reserve_workspace`), freed
            // once; the stream that used it was synchronised just above.
            first = first.and(check("aclrtFree", unsafe { free(ptr as *mut std::ffi::c_void) }));
        }
        for (ptr, _) in staged {
            // SAFETY: a block from aclrtMallocHost (`staging_block`), freed
            // once; no copy from it is queued any more.
            first = first.and(check("aclrtFreeHost", unsafe { free_host(ptr as *mut std::ffi::c_void) }));
        }
        first
    }
}

impl Drop for StreamInner {
    fn drop(&mut self) {
        let api = self.ctx.api;
        if !self.owned {
            if let Err(e) = self.ctx.bind().and_then(|_| self.release_pool(api)) {
                record_drop_error(e);
            }
            return;
        }
        let result = self.ctx.bind().and_then(|_| {
            // Pending work must finish before the stream is destroyed.
            let sync = acl_fn!(api, aclrtSynchronizeStream)?;
            // SAFETY: `raw` is a live stream we created.
            settled(check("aclrtSynchronizeStream", unsafe { sync(self.raw) }))?;
            let kept = std::mem::take(&mut lock(&self.state).keep);
            drop(kept);
            self.release_pool(api)?;
            if let Ok(mut map) = states().lock() {
                map.remove(&(self.ctx.ordinal, self.raw as usize));
            }
            let destroy = acl_fn!(api, aclrtDestroyStream)?;
            // SAFETY: owned, synchronised, destroyed exactly once.
            check("aclrtDestroyStream", unsafe { destroy(self.raw) })
        });
        if let Err(e) = result {
            record_drop_error(e);
        }
    }
}

/// A stream on one device: created by us (destroyed on drop) or borrowed.
#[derive(Clone)]
pub struct NpuStream {
    inner: Arc<StreamInner>,
}

impl std::fmt::Debug for NpuStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "NpuStream(npu:{}, {:p}, {})",
            self.ordinal(),
            self.inner.raw,
            if self.inner.owned { "owned" } else { "borrowed" }
        )
    }
}

impl NpuStream {
    /// Creates a new stream on `ctx`'s device.
    pub fn create(ctx: &Arc<DeviceCtx>) -> Result<Self> {
        ctx.bind()?;
        let f = acl_fn!(ctx.api, aclrtCreateStream)?;
        let mut raw: aclrtStream = std::ptr::null_mut();
        // SAFETY: `raw` is a valid out-pointer; the device is bound.
        check("aclrtCreateStream", unsafe { f(&mut raw) })?;
        let state = state_for(ctx.ordinal, raw);
        Ok(NpuStream { inner: Arc::new(StreamInner { raw, owned: true, ctx: ctx.clone(), state }) })
    }

    /// Wraps a stream owned by someone else (e.g. `torch.npu.current_stream()`
    /// as a raw pointer). It is never destroyed by us.
    ///
    /// # Safety
    /// `raw` must be a live stream of `ctx`'s device (or NULL, the default
    /// stream) and outlive every use of the returned handle.
    pub unsafe fn borrow_raw(ctx: &Arc<DeviceCtx>, raw: aclrtStream) -> Self {
        let state = state_for(ctx.ordinal, raw);
        NpuStream { inner: Arc::new(StreamInner { raw, owned: false, ctx: ctx.clone(), state }) }
    }

    /// The raw handle.
    pub fn raw(&self) -> aclrtStream {
        self.inner.raw
    }

    /// True when this handle destroys the stream on drop.
    pub fn is_owned(&self) -> bool {
        self.inner.owned
    }

    /// The device context.
    pub fn ctx(&self) -> &Arc<DeviceCtx> {
        &self.inner.ctx
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> u32 {
        self.inner.ctx.ordinal
    }

    /// True if both handles name the same stream.
    pub fn same_as(&self, other: &NpuStream) -> bool {
        self.inner.raw == other.inner.raw && self.ordinal() == other.ordinal()
    }

    /// Binds the device and returns the ACL table.
    pub(crate) fn enter(&self) -> Result<&'static Acl> {
        self.inner.ctx.bind()?;
        Ok(self.inner.ctx.api)
    }

    /// Waits for all work on the stream (a host wait: never inside an op).
    pub fn synchronize(&self) -> Result<()> {
        let api = self.enter()?;
        let f = acl_fn!(api, aclrtSynchronizeStream)?;
        // SAFETY: live stream, device bound.
        check("aclrtSynchronizeStream", unsafe { f(self.raw()) })?;
        self.release_kept();
        Ok(())
    }

    /// Waits for all work on the stream, at most `timeout` (falls back to an
    /// unbounded wait on a CANN without `aclrtSynchronizeStreamWithTimeout`).
    pub fn synchronize_timeout(&self, timeout: Duration) -> Result<()> {
        let api = self.enter()?;
        match api.lib.aclrtSynchronizeStreamWithTimeout.as_ref() {
            Ok(f) => {
                let ms = i32::try_from(timeout.as_millis()).unwrap_or(i32::MAX).max(1);
                // SAFETY: live stream, device bound, positive timeout in ms.
                check("aclrtSynchronizeStreamWithTimeout", unsafe { f(self.raw(), ms) })?;
                self.release_kept();
                Ok(())
            }
            Err(_) => self.synchronize(),
        }
    }

    /// The state shared by the handles of this raw stream.
    pub(crate) fn state(&self) -> &StateRef {
        &self.inner.state
    }

    /// True while the stream is being captured into a graph (status
    /// `ACTIVE`, or `INVALIDATED` until the capture ends), see [`capturing`];
    /// false on a runtime without the capture API, which cannot capture.
    pub fn is_capturing(&self) -> Result<bool> {
        let api = self.enter()?;
        capturing(api, self.raw())
    }

    /// Makes sure the workspace pool of this stream has a free block of at
    /// least `bytes` (adding an `aclrtMalloc` segment when it has not), so
    /// ops of that size can run under graph capture. Refused under capture.
    pub fn reserve_workspace(&self, bytes: usize) -> Result<()> {
        let api = self.enter()?;
        if lock(&self.inner.state).pool.largest_free() >= bytes {
            return Ok(());
        }
        self.refuse_under_capture("reserve_workspace", "reserve before the capture begins")?;
        let len = super::pool::round_up(bytes)?;
        let f = acl_fn!(api, aclrtMalloc)?;
        let mut ptr: *mut std::ffi::c_void = std::ptr::null_mut();
        // SAFETY: valid out-pointer, nonzero size, device bound.
        check("aclrtMalloc", unsafe { f(&mut ptr, len, acl_sys::aclrtMemMallocPolicy::ACL_MEM_MALLOC_HUGE_FIRST) })?;
        lock(&self.inner.state).pool.add_segment(ptr as usize, len);
        Ok(())
    }

    /// A new pinned staging block of at least `bytes` (`aclrtMallocHost`).
    fn staging_block(api: &'static Acl, bytes: usize) -> Result<(usize, usize)> {
        let len = super::pool::round_up(bytes)?;
        let f = acl_fn!(api, aclrtMallocHost)?;
        let mut ptr: *mut std::ffi::c_void = std::ptr::null_mut();
        // SAFETY: valid out-pointer and nonzero size.
        check("aclrtMallocHost", unsafe { f(&mut ptr, len) })?;
        Ok((ptr as usize, len))
    }

    /// An error naming `op` while this stream is captured into a graph.
    fn refuse_under_capture(&self, op: &'static str, advice: &str) -> Result<()> {
        if self.is_capturing()? {
            return Err(Error::invalid(op, "stream", format!("{self:?} is being captured into a graph: {advice}")));
        }
        Ok(())
    }

    /// Makes sure a pinned staging block of at least `bytes` is free (small
    /// host data the native kernel needs: slot offsets, a tiling).
    pub fn reserve_staging(&self, bytes: usize) -> Result<()> {
        let api = self.enter()?;
        self.refuse_under_capture("reserve_staging", "reserve before the capture begins")?;
        if lock(&self.inner.state).staging.has_free(bytes) {
            return Ok(());
        }
        let b = Self::staging_block(api, bytes)?;
        lock(&self.inner.state).staging.add(b, true);
        Ok(())
    }

    /// Serves every workspace block of this stream from `allocator` (`None`:
    /// from the stream's pool again). Blocks already handed out go back where
    /// they came from.
    pub fn set_allocator(&self, allocator: Option<Allocator>) {
        lock(&self.inner.state).allocator = allocator;
    }

    /// Returns a block detached from a workspace buffer to the pool.
    pub(crate) fn give_back_block(&self, ptr: usize, block: usize) {
        lock(&self.inner.state).pool.give_back(ptr, block);
    }

    /// Reads `dst.len()` bytes of device memory at `src` (a drained stream's).
    pub(crate) fn read_drained(&self, src: usize, dst: &mut [u8]) -> Result<()> {
        let api = self.enter()?;
        let f = acl_fn!(api, aclrtMemcpy)?;
        let n = dst.len();
        // SAFETY: `src` is device memory of at least `n` bytes of this device
        // that no queued work writes (the stream drained); `dst` is exclusive.
        check("aclrtMemcpy", unsafe {
            f(
                dst.as_mut_ptr().cast(),
                n,
                src as *const std::ffi::c_void,
                n,
                acl_sys::aclrtMemcpyKind::ACL_MEMCPY_DEVICE_TO_HOST,
            )
        })
    }

    /// What this stream's workspace did so far.
    pub fn workspace_stats(&self) -> super::pool::PoolStats {
        lock(&self.inner.state).pool.stats
    }

    /// Drops the handles queued work used, once the stream drained.
    fn release_kept(&self) {
        let kept = {
            let mut st = lock(&self.inner.state);
            st.staging.drained();
            std::mem::take(&mut st.keep)
        };
        drop(kept);
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
        let api = self.enter()?;
        let taken = lock(&self.inner.state).staging.take_free(data.len());
        let (ptr, _) = match taken {
            Some(b) => b,
            None => {
                self.refuse_under_capture(
                    "stage_to_device",
                    "no pinned staging block is free and none can be allocated; reserve with \
                     amoe_workspace_reserve / NpuStream::reserve_staging before the capture begins",
                )?;
                let b = Self::staging_block(api, data.len())?;
                lock(&self.inner.state).staging.add(b, false);
                b
            }
        };
        // SAFETY: `ptr` is a pinned block of at least `data.len()` bytes that
        // no queued copy reads (it was free), exclusively ours until the sync.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), ptr as *mut u8, data.len()) };
        if self.is_capturing()? {
            // Every replay copies from the block again: it keeps these bytes.
            lock(&self.inner.state).staging.keep_for_graph(ptr);
        }
        let f = acl_fn!(api, aclrtMemcpyAsync)?;
        // SAFETY: `dst` is device memory of `dst_len >= data.len()` bytes; the
        // pinned source stays allocated and unchanged until the stream drained.
        check("aclrtMemcpyAsync", unsafe {
            f(
                dst,
                dst_len,
                ptr as *const std::ffi::c_void,
                data.len(),
                acl_sys::aclrtMemcpyKind::ACL_MEMCPY_HOST_TO_DEVICE,
                self.raw(),
            )
        })
    }

    /// Keeps `handle` alive until this stream's next synchronisation (work
    /// queued on the stream still uses it).
    pub(crate) fn keep_until_sync(&self, handle: Box<dyn Send + Sync>) {
        lock(&self.inner.state).keep.push(handle);
    }

    /// Records queued work whose outcome [`check`](Self::check) reports.
    /// Work with the key of an entry already pending reports through that one.
    pub(crate) fn record_pending(&self, p: Box<dyn Pending>) {
        let mut st = lock(&self.inner.state);
        if let Some(k) = p.key() {
            if st.pending.iter().any(|q| q.key() == Some(k)) {
                return;
            }
        }
        st.pending.push(p);
    }

    /// The sync point the caller owns: waits for every queued work of this
    /// stream (bounded by the longest communicator timeout of the
    /// collectives queued since the last check, else `default_timeout`), then
    /// returns the first error recorded for it since the last check, in
    /// queue order: a collective's HCCL async error (naming the collective,
    /// group and rank), a kernel's status (a bad index with its position and
    /// value), or the failed wait itself. Each error is reported once.
    /// Refused while the stream is captured into a graph.
    pub fn check_with_timeout(&self, default_timeout: Duration) -> Result<()> {
        // A synchronisation would invalidate the capture (CANN's runtime
        // guide, capture restriction 2): refused before anything is taken.
        self.refuse_under_capture("check", "check after the capture ends (e.g. after a replay)")?;
        let pending = std::mem::take(&mut lock(&self.inner.state).pending);
        let timeout = pending.iter().filter_map(|p| p.timeout()).max().unwrap_or(default_timeout);
        let wait = self.synchronize_timeout(timeout).err();
        let mut first = Ok(());
        for p in &pending {
            // Every entry is looked at (and releases what it holds); the
            // first error in queue order is the one returned.
            let r = p.outcome(wait.as_ref(), self);
            if first.is_ok() {
                first = r;
            }
        }
        // Then what graphs captured on this stream left since the last check.
        let captured = std::mem::take(&mut lock(&self.inner.state).captured);
        for p in &captured {
            let r = p.outcome(wait.as_ref(), self);
            if first.is_ok() {
                first = r;
            }
        }
        lock(&self.inner.state).captured.splice(0..0, captured);
        first?;
        match wait {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Keeps `p` for every check from now on: the check of work captured
    /// into a graph, whose replays rewrite what it reads.
    pub(crate) fn record_captured(&self, p: Box<dyn Pending>) {
        lock(&self.inner.state).captured.push(p);
    }

    /// True once the record slots of captured launches are reserved.
    pub(crate) fn has_capture_records(&self) -> bool {
        lock(&self.inner.state).records.is_some()
    }

    /// Takes `slots` record slots of `slot_bytes` at device address `base`
    /// (a detached pool block whose zeroing is queued on this stream) for
    /// the kernel launches captured later.
    pub(crate) fn set_capture_records(&self, base: usize, slot_bytes: usize, slots: usize) {
        lock(&self.inner.state).records = Some((base, slot_bytes, slots, 0));
    }

    /// A zeroed record slot of at least `bytes` for a launch being captured,
    /// kept for the stream's life. An error says how to reserve them when
    /// none are left (or none were reserved: no launch ran before capture).
    pub(crate) fn take_capture_record(&self, bytes: usize) -> Result<usize> {
        let mut st = lock(&self.inner.state);
        match st.records.as_mut() {
            Some((base, slot, slots, used)) if *used < *slots && bytes <= *slot => {
                let p = *base + *used * *slot;
                *used += 1;
                Ok(p)
            }
            other => Err(Error::invalid(
                "capture records",
                "stream",
                match other {
                    None => {
                        "no status records were reserved on this stream: run the op once before capturing it".into()
                    }
                    Some((_, slot, slots, _)) if bytes > *slot => {
                        format!("a launch needs {bytes} bytes of status, a captured record holds {slot}")
                    }
                    Some((_, _, slots, _)) => {
                        format!("all {slots} status records for captured launches are taken by earlier captures on this stream")
                    }
                },
            )),
        }
    }

    /// Writes `len` zero bytes at device address `ptr` (a captured launch's
    /// record, once read) after the stream drained: the check's own write.
    pub(crate) fn zero_drained(&self, ptr: usize, len: usize) -> Result<()> {
        let api = self.enter()?;
        let f = acl_fn!(api, aclrtMemset)?;
        // SAFETY: `ptr` is `len` bytes of this device's memory that no queued
        // work writes (the stream drained).
        check("aclrtMemset", unsafe { f(ptr as *mut std::ffi::c_void, len, 0, len) })
    }

    /// [`check_with_timeout`](Self::check_with_timeout) with the timeout of
    /// `ASCEND_MOE_COMM_TIMEOUT` (or 60 s) when no collective is pending.
    pub fn check(&self) -> Result<()> {
        self.check_with_timeout(crate::CommOptions::from_env().timeout)
    }

    /// Makes this stream wait (on the device) for `event`.
    pub fn wait_event(&self, event: &NpuEvent) -> Result<()> {
        let api = self.enter()?;
        let f = acl_fn!(api, aclrtStreamWaitEvent)?;
        // SAFETY: both handles are live (the event holds its stream).
        check("aclrtStreamWaitEvent", unsafe { f(self.raw(), event.raw) })
    }

    /// Orders this stream after all work currently queued on `other`, on the
    /// device: an event recorded on `other` and waited for here. The host
    /// does not wait; the event is kept until this stream's next
    /// synchronisation, since CANN asks that an event not be destroyed while
    /// a call still uses it (aclrtDestroyEvent, AscendCL API reference).
    pub fn wait_for(&self, other: &NpuStream) -> Result<()> {
        if self.same_as(other) {
            return Ok(());
        }
        let ev = NpuEvent::create(other)?;
        ev.record(other)?;
        self.wait_event(&ev)?;
        self.keep_until_sync(Box::new(ev));
        Ok(())
    }
}

/// An event, created on (and keeping alive) a stream's device.
pub struct NpuEvent {
    raw: aclrtEvent,
    stream: NpuStream,
}

// SAFETY: events are runtime handles usable from any thread bound to their
// device (ACL has no thread affinity for events).
unsafe impl Send for NpuEvent {}
// SAFETY: shared references only record, query or synchronise.
unsafe impl Sync for NpuEvent {}

impl std::fmt::Debug for NpuEvent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NpuEvent({:p} on {:?})", self.raw, self.stream)
    }
}

impl NpuEvent {
    /// Creates an event on `stream`'s device.
    pub fn create(stream: &NpuStream) -> Result<Self> {
        let api = stream.enter()?;
        let f = acl_fn!(api, aclrtCreateEvent)?;
        let mut raw: aclrtEvent = std::ptr::null_mut();
        // SAFETY: valid out-pointer, device bound.
        check("aclrtCreateEvent", unsafe { f(&mut raw) })?;
        Ok(NpuEvent { raw, stream: stream.clone() })
    }

    /// Records the event at the current end of `stream`.
    pub fn record(&self, stream: &NpuStream) -> Result<()> {
        let api = stream.enter()?;
        let f = acl_fn!(api, aclrtRecordEvent)?;
        // SAFETY: live event and stream.
        check("aclrtRecordEvent", unsafe { f(self.raw, stream.raw()) })
    }

    /// Waits until the recorded work completed.
    pub fn synchronize(&self) -> Result<()> {
        let api = self.stream.enter()?;
        let f = acl_fn!(api, aclrtSynchronizeEvent)?;
        // SAFETY: live event.
        check("aclrtSynchronizeEvent", unsafe { f(self.raw) })
    }

    /// True when the recorded work completed.
    pub fn is_complete(&self) -> Result<bool> {
        let api = self.stream.enter()?;
        let f = acl_fn!(api, aclrtQueryEventStatus)?;
        let mut status = acl_sys::aclrtEventRecordedStatus(0);
        // SAFETY: live event, valid out-pointer.
        check("aclrtQueryEventStatus", unsafe { f(self.raw, &mut status) })?;
        Ok(status == acl_sys::aclrtEventRecordedStatus::ACL_EVENT_RECORDED_STATUS_COMPLETE)
    }

    /// Milliseconds between `start` and this event (both recorded and complete).
    pub fn elapsed_ms_since(&self, start: &NpuEvent) -> Result<f32> {
        let api = self.stream.enter()?;
        let f = acl_fn!(api, aclrtEventElapsedTime)?;
        let mut ms = 0f32;
        // SAFETY: live events, valid out-pointer.
        check("aclrtEventElapsedTime", unsafe { f(&mut ms, start.raw, self.raw) })?;
        Ok(ms)
    }
}

impl Drop for NpuEvent {
    fn drop(&mut self) {
        let result = self.stream.enter().and_then(|api| {
            let f = acl_fn!(api, aclrtDestroyEvent)?;
            // SAFETY: created by us, destroyed once.
            check("aclrtDestroyEvent", unsafe { f(self.raw) })
        });
        if let Err(e) = result {
            record_drop_error(e);
        }
    }
}
