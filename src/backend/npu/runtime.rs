//! The ACL runtime, safely: loading, error mapping, per-thread device
//! binding, streams and events.
//!
//! Ownership: a [`NpuStream`] holds an `Arc` of its device context, an
//! [`NpuEvent`] and every buffer hold their stream, so a parent never dies
//! before its children. Handles borrowed from a host engine (a torch_npu
//! stream) are never destroyed by us. `Drop` never panics: failures are
//! recorded in [`drop_errors`].

use std::ffi::CStr;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use acl_sys::{aclError, aclrtEvent, aclrtStream, Acl};

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

struct StreamInner {
    raw: aclrtStream,
    owned: bool,
    ctx: Arc<DeviceCtx>,
}

// SAFETY: an aclrtStream is a runtime handle, not thread-affine: ACL allows
// any thread that has set the stream's device (we bind before every call) to
// launch work on it, and launches on one stream are serialised by the runtime.
unsafe impl Send for StreamInner {}
// SAFETY: as above; shared references only launch work or synchronise.
unsafe impl Sync for StreamInner {}

impl Drop for StreamInner {
    fn drop(&mut self) {
        if !self.owned {
            return;
        }
        let api = self.ctx.api;
        let result = self.ctx.bind().and_then(|_| {
            // Pending work must finish before the stream is destroyed.
            let sync = acl_fn!(api, aclrtSynchronizeStream)?;
            // SAFETY: `raw` is a live stream we created.
            check("aclrtSynchronizeStream", unsafe { sync(self.raw) })?;
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
        Ok(NpuStream { inner: Arc::new(StreamInner { raw, owned: true, ctx: ctx.clone() }) })
    }

    /// Wraps a stream owned by someone else (e.g. `torch.npu.current_stream()`
    /// as a raw pointer). It is never destroyed by us.
    ///
    /// # Safety
    /// `raw` must be a live stream of `ctx`'s device (or NULL, the default
    /// stream) and outlive every use of the returned handle.
    pub unsafe fn borrow_raw(ctx: &Arc<DeviceCtx>, raw: aclrtStream) -> Self {
        NpuStream { inner: Arc::new(StreamInner { raw, owned: false, ctx: ctx.clone() }) }
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

    /// Waits for all work on the stream.
    pub fn synchronize(&self) -> Result<()> {
        let api = self.enter()?;
        let f = acl_fn!(api, aclrtSynchronizeStream)?;
        // SAFETY: live stream, device bound.
        check("aclrtSynchronizeStream", unsafe { f(self.raw()) })
    }

    /// Waits for all work on the stream, at most `timeout` (falls back to an
    /// unbounded wait on a CANN without `aclrtSynchronizeStreamWithTimeout`).
    pub fn synchronize_timeout(&self, timeout: Duration) -> Result<()> {
        let api = self.enter()?;
        match api.lib.aclrtSynchronizeStreamWithTimeout.as_ref() {
            Ok(f) => {
                let ms = i32::try_from(timeout.as_millis()).unwrap_or(i32::MAX).max(1);
                // SAFETY: live stream, device bound, positive timeout in ms.
                check("aclrtSynchronizeStreamWithTimeout", unsafe { f(self.raw(), ms) })
            }
            Err(_) => self.synchronize(),
        }
    }

    /// Makes this stream wait (on the device) for `event`.
    pub fn wait_event(&self, event: &NpuEvent) -> Result<()> {
        let api = self.enter()?;
        let f = acl_fn!(api, aclrtStreamWaitEvent)?;
        // SAFETY: both handles are live (the event holds its stream).
        check("aclrtStreamWaitEvent", unsafe { f(self.raw(), event.raw) })
    }

    /// Orders this stream after all work currently queued on `other`.
    pub fn wait_for(&self, other: &NpuStream) -> Result<()> {
        if self.same_as(other) {
            return Ok(());
        }
        let ev = NpuEvent::create(other)?;
        ev.record(other)?;
        self.wait_event(&ev)?;
        // The wait must be consumed before the event may be destroyed.
        self.synchronize()
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
