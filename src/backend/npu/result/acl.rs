//! `libascendcl`: one function per ACL call, named for the call without its
//! `aclrt` prefix (`aclrtCreateStream` is [`create_stream`]), plus the
//! kernel launchers only the simulated runtime exports.
//!
//! Every wrapper resolves its symbol in the loaded runtime (`acl()`) and
//! maps the status with [`check`]. The device must be bound on the calling
//! thread ([`set_device`]) for every call that acts on a device.

use std::ffi::{c_void, CStr};

use acl_sys::{
    aclError, aclmdlRICaptureMode, aclmdlRICaptureStatus, aclrtEvent, aclrtEventRecordedStatus, aclrtMemAttr,
    aclrtMemMallocPolicy, aclrtMemcpyKind, aclrtStream, CannsimKernelEntry, CannsimKernelEntryEx,
    CannsimLaunchKernelExFn, CannsimLaunchKernelFn,
};

use super::{require, status_fns, sym};
use crate::backend::npu::runtime::load::acl;
pub use crate::backend::npu::runtime::load::check;
use crate::Result;

/// `aclInit(NULL)` (NULL: no config file). A runtime already initialised,
/// e.g. by the host engine (torch_npu), is success
/// (`ACL_ERROR_REPEAT_INITIALIZE`).
pub fn init() -> Result<()> {
    let api = acl()?;
    let f = sym!(api, aclInit)?;
    // SAFETY: NULL config path is documented as "no config file".
    let code = unsafe { f(std::ptr::null()) };
    if code == acl_sys::ACL_ERROR_REPEAT_INITIALIZE as aclError {
        return Ok(());
    }
    check("aclInit", code)
}

/// `aclrtGetDeviceCount`: the number of visible devices.
pub fn get_device_count() -> Result<u32> {
    let f = sym!(acl()?, aclrtGetDeviceCount)?;
    let mut n = 0u32;
    // SAFETY: `n` is a valid out-pointer.
    check("aclrtGetDeviceCount", unsafe { f(&mut n) })?;
    Ok(n)
}

/// `aclrtGetDevice`: the device bound to the calling thread, `None` when
/// the call fails (no device is set); that failure is not an error and the
/// runtime's message is left alone.
pub fn get_device() -> Result<Option<i32>> {
    let f = sym!(acl()?, aclrtGetDevice)?;
    let mut current = -1i32;
    // SAFETY: valid out-pointer; fails harmlessly when no device is set.
    let code = unsafe { f(&mut current) };
    Ok((code == acl_sys::ACL_SUCCESS as aclError).then_some(current))
}

/// `aclrtSetDevice`: binds `device` to the calling thread (the binding is
/// per thread).
pub fn set_device(device: i32) -> Result<()> {
    let f = sym!(acl()?, aclrtSetDevice)?;
    // SAFETY: plain integer argument; the runtime rejects an unknown device.
    check("aclrtSetDevice", unsafe { f(device) })
}

/// `aclrtGetMemInfo(attr)`: `(free, total)` bytes.
pub fn get_mem_info(attr: aclrtMemAttr) -> Result<(usize, usize)> {
    let f = sym!(acl()?, aclrtGetMemInfo)?;
    let (mut free, mut total) = (0usize, 0usize);
    // SAFETY: valid out-pointers.
    check("aclrtGetMemInfo", unsafe { f(attr, &mut free, &mut total) })?;
    Ok((free, total))
}

/// `aclrtGetVersion`: `(major, minor, patch)` of the runtime, `None` when it
/// lacks the call or the call fails.
pub fn get_version() -> Option<(i32, i32, i32)> {
    let f = acl().ok()?.lib.aclrtGetVersion.as_ref().ok()?;
    let (mut a, mut b, mut c) = (0, 0, 0);
    // SAFETY: valid out-pointers.
    (unsafe { f(&mut a, &mut b, &mut c) } == 0).then_some((a, b, c))
}

/// `aclrtGetSocName`: the chip's name, `None` when the runtime lacks the
/// call or has no name.
pub fn get_soc_name() -> Option<String> {
    let f = acl().ok()?.lib.aclrtGetSocName.as_ref().ok()?;
    // SAFETY: no arguments; NULL or a runtime-owned C string.
    let p = unsafe { f() };
    // SAFETY: non-NULL, NUL-terminated.
    (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
}

/// `aclrtCreateStream`: a new stream on the bound device.
pub fn create_stream() -> Result<aclrtStream> {
    let f = sym!(acl()?, aclrtCreateStream)?;
    let mut raw: aclrtStream = std::ptr::null_mut();
    // SAFETY: `raw` is a valid out-pointer.
    check("aclrtCreateStream", unsafe { f(&mut raw) })?;
    Ok(raw)
}

status_fns! { acl, check;
    /// `aclrtDestroyStream`.
    ///
    /// # Safety
    /// `stream` was created by [`create_stream`], is destroyed once, and no
    /// queued work is left on it.
    pub unsafe fn destroy_stream = aclrtDestroyStream(stream: aclrtStream);

    /// `aclrtSynchronizeStream`: waits on the host for all work on `stream`.
    ///
    /// # Safety
    /// `stream` is a live stream of the bound device (or NULL, the default stream).
    pub unsafe fn synchronize_stream = aclrtSynchronizeStream(stream: aclrtStream);

    /// `aclrtFree`.
    ///
    /// # Safety
    /// `ptr` came from [`malloc`], is freed once, and no queued work uses it.
    pub unsafe fn free = aclrtFree(ptr: *mut c_void);

    /// `aclrtFreeHost`.
    ///
    /// # Safety
    /// `ptr` came from [`malloc_host`], is freed once, and no queued copy uses it.
    pub unsafe fn free_host = aclrtFreeHost(ptr: *mut c_void);

    /// `aclrtMemcpy(dst, dst_max, src, count, kind)`: a blocking copy.
    ///
    /// # Safety
    /// `dst` holds `dst_max >= count` bytes and `src` `count` bytes, of the
    /// memory kinds `kind` names, and no queued work writes either.
    pub unsafe fn memcpy = aclrtMemcpy(
        dst: *mut c_void,
        dst_max: usize,
        src: *const c_void,
        count: usize,
        kind: aclrtMemcpyKind,
    );

    /// `aclrtMemcpyAsync(dst, dst_max, src, count, kind, stream)`: a copy queued
    /// on `stream`.
    ///
    /// # Safety
    /// As [`memcpy`], and both ranges stay allocated (a host source unchanged)
    /// until the stream has run the copy; `stream` is live.
    pub unsafe fn memcpy_async = aclrtMemcpyAsync(
        dst: *mut c_void,
        dst_max: usize,
        src: *const c_void,
        count: usize,
        kind: aclrtMemcpyKind,
        stream: aclrtStream,
    );

    /// `aclrtMemset(ptr, max, value, count)`: a blocking memset.
    ///
    /// # Safety
    /// `ptr` is `max >= count` bytes of device memory of the bound device that
    /// no queued work uses.
    pub unsafe fn memset = aclrtMemset(ptr: *mut c_void, max: usize, value: i32, count: usize);

    /// `aclrtMemsetAsync(ptr, max, value, count, stream)`: a memset queued on `stream`.
    ///
    /// # Safety
    /// `ptr` is `max >= count` bytes of device memory of the bound device that
    /// stay allocated until the stream has run the memset; `stream` is live.
    pub unsafe fn memset_async = aclrtMemsetAsync(
        ptr: *mut c_void,
        max: usize,
        value: i32,
        count: usize,
        stream: aclrtStream,
    );

    /// `aclrtRecordEvent(event, stream)`.
    ///
    /// # Safety
    /// `event` and `stream` are live, of the bound device.
    pub unsafe fn record_event = aclrtRecordEvent(event: aclrtEvent, stream: aclrtStream);

    /// `aclrtSynchronizeEvent`: waits on the host until the recorded work completed.
    ///
    /// # Safety
    /// `event` is live.
    pub unsafe fn synchronize_event = aclrtSynchronizeEvent(event: aclrtEvent);

    /// `aclrtDestroyEvent`.
    ///
    /// # Safety
    /// `event` was created by [`create_event`], is destroyed once, and no call
    /// still uses it (aclrtDestroyEvent, AscendCL API reference).
    pub unsafe fn destroy_event = aclrtDestroyEvent(event: aclrtEvent);

    /// `aclrtStreamWaitEvent(stream, event)`: `stream` waits on the device for `event`.
    ///
    /// # Safety
    /// Both handles are live, of the bound device.
    pub unsafe fn stream_wait_event = aclrtStreamWaitEvent(stream: aclrtStream, event: aclrtEvent);
}

/// `aclrtSynchronizeStreamWithTimeout(stream, timeout_ms)`, `Ok(None)` on a
/// runtime without it (a newer call than the others).
///
/// # Safety
/// As [`synchronize_stream`]; `timeout_ms` is positive.
pub unsafe fn synchronize_stream_with_timeout(stream: aclrtStream, timeout_ms: i32) -> Result<Option<()>> {
    let Ok(f) = acl()?.lib.aclrtSynchronizeStreamWithTimeout.as_ref() else { return Ok(None) };
    // SAFETY: the caller's contract.
    check("aclrtSynchronizeStreamWithTimeout", unsafe { f(stream, timeout_ms) }).map(Some)
}

/// `aclmdlRICaptureGetInfo` (acl_mdl.h of CANN 8.1): the capture status of
/// `stream` and the model it captures into (NULL when it captures none),
/// `Ok(None)` on a runtime without the capture API (which cannot capture).
///
/// # Safety
/// `stream` is a live stream of the bound device.
pub unsafe fn capture_get_info(stream: aclrtStream) -> Result<Option<(aclmdlRICaptureStatus, acl_sys::aclmdlRI)>> {
    let api = acl()?;
    let Ok(f) = acl_sys::acl_symbol!(api, aclmdlRICaptureGetInfo) else { return Ok(None) };
    let mut status = aclmdlRICaptureStatus::ACL_MODEL_RI_CAPTURE_STATUS_NONE;
    let mut model: acl_sys::aclmdlRI = std::ptr::null_mut();
    // SAFETY: the caller's contract; valid out-pointers.
    check("aclmdlRICaptureGetInfo", unsafe { f(stream, &mut status, &mut model) })?;
    Ok(Some((status, model)))
}

/// The calling thread switched to `ACL_MODEL_RI_CAPTURE_MODE_RELAXED` by
/// [`relaxed_capture_mode`]; dropping it (also on an early return or a
/// panic) switches the thread back to the mode it had. A guard taken while
/// the thread holds one switches nothing: the outermost guard is the one
/// that switches, and it must be the last dropped (a plain `let` in the
/// outer scope).
#[must_use = "the thread goes back to its mode when this is dropped"]
pub(crate) struct RelaxedCaptureMode {
    /// The switch and the mode to restore; `None` when nothing was switched
    /// (an inner guard, or a runtime or chip without the switch).
    restore: Option<(ExchangeMode, aclmdlRICaptureMode)>,
    /// The mode is the calling thread's: the guard stays on that thread.
    _thread: std::marker::PhantomData<*const ()>,
}

/// `aclmdlRICaptureThreadExchangeMode`.
type ExchangeMode = unsafe extern "C" fn(*mut aclmdlRICaptureMode) -> aclError;

thread_local! {
    /// True while a [`RelaxedCaptureMode`] of this thread holds the switch.
    static RELAXED_HELD: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Set once the runtime answered the switch with
/// `ACL_ERROR_RT_FEATURE_NOT_SUPPORT`: a property of the process, not of a
/// device or thread. `rtThreadExchangeCaptureMode` decides it from
/// `Runtime::Instance()->GetChipType()` alone (hicann/runtime v8.5.0
/// `src/runtime/feature/src/api/api_c_stream.cc:612-619`), the runtime
/// singleton's chip type, set once when the runtime initialises
/// (`Runtime::InitSocType`, `src/runtime/feature/src/runtime.cc:508-521`;
/// `Runtime::GetChipType`, `:178-184`). Remembering it spares every later
/// check the call and the warning CANN logs for each refusal
/// (`aclmdlRICaptureThreadExchangeModeImpl`, `src/acl/aclrt_impl/model_ri.cpp:157-158`).
static EXCHANGE_UNSUPPORTED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

impl RelaxedCaptureMode {
    fn new(restore: Option<(ExchangeMode, aclmdlRICaptureMode)>) -> Self {
        RelaxedCaptureMode { restore, _thread: std::marker::PhantomData }
    }
}

/// Switches the calling thread to `ACL_MODEL_RI_CAPTURE_MODE_RELAXED` with
/// `aclmdlRICaptureThreadExchangeMode` until the returned guard drops, for a
/// blocking call that does not touch any captured work (a check reading
/// status records of finished launches).
///
/// CANN refuses a blocking copy or memset on every thread while any stream
/// of the context captures in GLOBAL mode (torch_npu's default,
/// `NPUGraph::capture_begin`), and on the thread that began a THREAD_LOCAL
/// capture, unless the calling thread's own mode is RELAXED
/// (`Context::IsCaptureModeSupport`, hicann/runtime v8.5.0
/// `src/runtime/feature/src/context/context.cc:5134-5162`, asked by
/// `ApiImpl::MemCopySync` and `MemSetSync`, `api_impl.cc:2691-2694` and
/// `:3059-3062`); the thread's mode is per thread and starts GLOBAL
/// (`inner_thread_local.cpp:22`). CANN's remedy for a call known not to
/// affect the capture is this switch and a switch back (the call's
/// reference, v8.5.0 `docs/api_docs/aclmdlRICaptureThreadExchangeMode.md`;
/// the runtime guide of v9.2.0-beta.1,
/// `docs/zh/dev_guide/04-01_single_stream_capture.md:15` and its sample at
/// `:115-125`).
///
/// On a runtime without the call (older than the capture mode switch;
/// its symbol is looked up once, when the runtime is loaded) and on a chip
/// without ACL graphs (`ACL_ERROR_RT_FEATURE_NOT_SUPPORT`,
/// `rtThreadExchangeCaptureMode`, `src/runtime/feature/src/api/api_c_stream.cc:614-618`;
/// asked once per process, [`EXCHANGE_UNSUPPORTED`]), nothing is switched
/// and the call runs as before. Nor is anything while the thread holds a
/// guard already, so a check takes one for all its reads. The device must
/// be bound (`ApiImpl::ThreadExchangeCaptureMode` needs a current context,
/// `api_impl.cc:7918-7919`).
pub(crate) fn relaxed_capture_mode() -> Result<RelaxedCaptureMode> {
    if RELAXED_HELD.get() {
        return Ok(RelaxedCaptureMode::new(None));
    }
    let Ok(&f) = acl()?.lib.aclmdlRICaptureThreadExchangeMode.as_ref() else {
        return Ok(RelaxedCaptureMode::new(None));
    };
    switch_to_relaxed(f, &EXCHANGE_UNSUPPORTED)
}

/// The switch of [`relaxed_capture_mode`] with the call `f`, once the
/// thread holds none; `unsupported` remembers a chip without it.
fn switch_to_relaxed(f: ExchangeMode, unsupported: &std::sync::atomic::AtomicBool) -> Result<RelaxedCaptureMode> {
    use std::sync::atomic::Ordering::Relaxed;
    if unsupported.load(Relaxed) {
        return Ok(RelaxedCaptureMode::new(None));
    }
    let mut mode = aclmdlRICaptureMode::ACL_MODEL_RI_CAPTURE_MODE_RELAXED;
    // SAFETY: a valid in/out pointer to a mode in range.
    let code = unsafe { f(&mut mode) };
    if code == acl_sys::ACL_ERROR_RT_FEATURE_NOT_SUPPORT as aclError {
        unsupported.store(true, Relaxed);
        return Ok(RelaxedCaptureMode::new(None));
    }
    check("aclmdlRICaptureThreadExchangeMode", code)?;
    RELAXED_HELD.set(true);
    Ok(RelaxedCaptureMode::new(Some((f, mode))))
}

impl Drop for RelaxedCaptureMode {
    fn drop(&mut self) {
        if let Some((f, mut mode)) = self.restore.take() {
            // SAFETY: as in `relaxed_capture_mode`. The switch back cannot be
            // refused where the switch succeeded: the same thread, a mode the
            // runtime itself handed out (checked only against the range,
            // `api_error.cc:5811-5813`), and the device still bound.
            let _ = unsafe { f(&mut mode) };
            RELAXED_HELD.set(false);
        }
    }
}

/// `aclrtMalloc(len, policy)`: `len` bytes of device memory on the bound device.
pub fn malloc(len: usize, policy: aclrtMemMallocPolicy) -> Result<*mut c_void> {
    let f = sym!(acl()?, aclrtMalloc)?;
    let mut ptr: *mut c_void = std::ptr::null_mut();
    // SAFETY: valid out-pointer.
    check("aclrtMalloc", unsafe { f(&mut ptr, len, policy) })?;
    Ok(ptr)
}

/// `aclrtMallocHost(len)`: `len` bytes of pinned host memory.
pub fn malloc_host(len: usize) -> Result<*mut c_void> {
    let f = sym!(acl()?, aclrtMallocHost)?;
    let mut ptr: *mut c_void = std::ptr::null_mut();
    // SAFETY: valid out-pointer.
    check("aclrtMallocHost", unsafe { f(&mut ptr, len) })?;
    Ok(ptr)
}

/// `aclrtCreateEvent`: a new event on the bound device.
pub fn create_event() -> Result<aclrtEvent> {
    let f = sym!(acl()?, aclrtCreateEvent)?;
    let mut raw: aclrtEvent = std::ptr::null_mut();
    // SAFETY: valid out-pointer.
    check("aclrtCreateEvent", unsafe { f(&mut raw) })?;
    Ok(raw)
}

/// `aclrtCreateEventExWithFlag(ACL_EVENT_SYNC)`: a new event on the bound
/// device that other streams can wait for, also inside a graph capture, or
/// `Ok(None)` on a runtime without the call. An `aclrtCreateEvent` event
/// cannot be recorded on, or waited for by, a capturing stream
/// (`ApiImpl::EventRecord` / `ApiImpl::StreamWaitEvent` return
/// `RT_ERROR_FEATURE_NOT_SUPPORT`: hicann/runtime
/// `src/runtime/feature/src/api_impl/api_impl.cc:2113-2116` and `:1549-1555`
/// at v8.5.0); the runtime guide's cross-stream capture page asks for this
/// call with `ACL_EVENT_SYNC`, without which a record inside a capture is
/// skipped (api_impl.cc:2122).
pub fn create_sync_event() -> Result<Option<aclrtEvent>> {
    let api = acl()?;
    let Ok(f) = acl_sys::acl_symbol!(api, aclrtCreateEventExWithFlag) else { return Ok(None) };
    let mut raw: aclrtEvent = std::ptr::null_mut();
    // SAFETY: valid out-pointer; ACL_EVENT_SYNC is a documented flag.
    check("aclrtCreateEventExWithFlag", unsafe { f(&mut raw, acl_sys::ACL_EVENT_SYNC) })?;
    Ok(Some(raw))
}

/// `aclrtQueryEventStatus`: whether the recorded work completed.
///
/// # Safety
/// `event` is live.
pub unsafe fn query_event_status(event: aclrtEvent) -> Result<aclrtEventRecordedStatus> {
    let f = sym!(acl()?, aclrtQueryEventStatus)?;
    let mut status = aclrtEventRecordedStatus(0);
    // SAFETY: the caller's contract; valid out-pointer.
    check("aclrtQueryEventStatus", unsafe { f(event, &mut status) })?;
    Ok(status)
}

/// `aclrtEventElapsedTime(start, end)`: milliseconds between two events.
///
/// # Safety
/// Both events are live, recorded and complete.
pub unsafe fn event_elapsed_time(start: aclrtEvent, end: aclrtEvent) -> Result<f32> {
    let f = sym!(acl()?, aclrtEventElapsedTime)?;
    let mut ms = 0f32;
    // SAFETY: the caller's contract; valid out-pointer.
    check("aclrtEventElapsedTime", unsafe { f(&mut ms, start, end) })?;
    Ok(ms)
}

/// `cannsim_launch_kernel` of the simulated runtime (`launch`, from
/// [`acl_sys::Acl::cannsim_launch_kernel`]): queues `entry` on `stream` for
/// `block_dim` blocks with the device pointers `gm` and a copy of `tiling`.
///
/// # Safety
/// `stream` is live; every non-NULL pointer of `gm` is device memory of the
/// stream's device, sized for what `entry` reads and writes under `tiling`,
/// that stays allocated until the stream has run the launch.
pub unsafe fn sim_launch_kernel(
    launch: CannsimLaunchKernelFn,
    stream: aclrtStream,
    block_dim: u32,
    entry: CannsimKernelEntry,
    gm: &[*mut c_void],
    tiling: &[u8],
) -> Result<()> {
    // SAFETY: the caller's contract; `gm` and `tiling` are live for the call,
    // which copies the tiling bytes at enqueue.
    let code = unsafe { launch(stream, block_dim, entry, gm.as_ptr(), gm.len(), tiling.as_ptr().cast(), tiling.len()) };
    check("cannsim_launch_kernel", code)
}

/// [`sim_launch_kernel`] with the tiling in device memory (`tiling_len`
/// bytes at `tiling`), which the simulator reads when the task runs, as a
/// kernel reads its tiling from GM.
///
/// # Safety
/// As [`sim_launch_kernel`]; `tiling` is device memory of the stream's device
/// that stays allocated until the task ran.
pub unsafe fn sim_launch_kernel_device_tiling(
    launch: CannsimLaunchKernelFn,
    stream: aclrtStream,
    block_dim: u32,
    entry: CannsimKernelEntry,
    gm: &[*mut c_void],
    tiling: *const c_void,
    tiling_len: usize,
) -> Result<()> {
    // SAFETY: the caller's contract.
    let code = unsafe { launch(stream, block_dim, entry, gm.as_ptr(), gm.len(), tiling, tiling_len) };
    check("cannsim_launch_kernel", code)
}

/// `cannsim_launch_kernel_ex` of the simulated runtime (`launch`, from
/// [`acl_sys::Acl::cannsim_launch_kernel_ex`]): as [`sim_launch_kernel`], for
/// an entry that can fault.
///
/// # Safety
/// As [`sim_launch_kernel`].
pub unsafe fn sim_launch_kernel_ex(
    launch: CannsimLaunchKernelExFn,
    stream: aclrtStream,
    block_dim: u32,
    entry: CannsimKernelEntryEx,
    gm: &[*mut c_void],
    tiling: &[u8],
) -> Result<()> {
    // SAFETY: as in `sim_launch_kernel`.
    let code = unsafe { launch(stream, block_dim, entry, gm.as_ptr(), gm.len(), tiling.as_ptr().cast(), tiling.len()) };
    check("cannsim_launch_kernel_ex", code)
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

    use super::*;

    const GLOBAL: aclmdlRICaptureMode = aclmdlRICaptureMode::ACL_MODEL_RI_CAPTURE_MODE_GLOBAL;
    const RELAXED: aclmdlRICaptureMode = aclmdlRICaptureMode::ACL_MODEL_RI_CAPTURE_MODE_RELAXED;

    thread_local! {
        /// The mode a fake switch keeps for this thread, and its calls.
        static MODE: Cell<(aclmdlRICaptureMode, usize)> = const { Cell::new((GLOBAL, 0)) };
    }

    /// A runtime's switch: swaps this thread's mode.
    unsafe extern "C" fn exchange(mode: *mut aclmdlRICaptureMode) -> aclError {
        let (old, calls) = MODE.get();
        // SAFETY: the caller passes a valid in/out pointer.
        MODE.set((unsafe { *mode }, calls + 1));
        unsafe { *mode = old };
        0
    }

    static REFUSALS: AtomicUsize = AtomicUsize::new(0);

    /// A runtime on a chip without ACL graphs.
    unsafe extern "C" fn refuse(_mode: *mut aclmdlRICaptureMode) -> aclError {
        REFUSALS.fetch_add(1, Ordering::SeqCst);
        acl_sys::ACL_ERROR_RT_FEATURE_NOT_SUPPORT as aclError
    }

    #[test]
    fn the_outer_guard_switches_once_and_inner_ones_do_nothing() {
        let unsupported = AtomicBool::new(false);
        let outer = switch_to_relaxed(exchange, &unsupported).unwrap();
        assert_eq!(MODE.get(), (RELAXED, 1));
        for _ in 0..3 {
            // What every read under a check does: no call to the runtime.
            let inner = relaxed_capture_mode().unwrap();
            assert!(inner.restore.is_none());
            drop(inner);
            assert_eq!(MODE.get(), (RELAXED, 1), "an inner guard neither switched nor switched back");
        }
        drop(outer);
        assert_eq!(MODE.get(), (GLOBAL, 2), "the outer guard restored the thread's mode");
        assert!(!RELAXED_HELD.get());
        // A later check switches again.
        drop(switch_to_relaxed(exchange, &unsupported).unwrap());
        assert_eq!(MODE.get(), (GLOBAL, 4));
    }

    #[test]
    fn a_chip_without_the_switch_is_asked_once() {
        let unsupported = AtomicBool::new(false);
        for _ in 0..3 {
            let g = switch_to_relaxed(refuse, &unsupported).unwrap();
            assert!(g.restore.is_none());
            assert!(!RELAXED_HELD.get());
        }
        assert_eq!(REFUSALS.load(Ordering::SeqCst), 1);
    }
}
