//! The argument rules of the real ACL runtime that the simulated one enforces,
//! as functions over the raw C arguments. Each exported ACL function calls its
//! rule once, at its entry, before it does anything else, so a violation is
//! refused with CANN's code whatever the implementation behind the export
//! does. Every check names its source next to it.
//!
//! Sources, cited below by short name:
//! - "acl `memory.cpp`" etc.: the ACL layer of the open-source CANN runtime
//!   (`hicann/runtime`, `src/acl/aclrt_impl/`), the `aclrt*Impl` functions the
//!   exports forward to;
//! - "`ApiErrorDecorator`" / "`ApiImpl`": its runtime layer
//!   (`src/runtime/feature/src/api_impl/api_error.cc`, `api_impl.cc` at
//!   v8.5.0), which checks the
//!   arguments and the calling thread's context before the work is queued;
//! - "`errcode_manage.cc`": its map from runtime errors to `aclError`
//!   (`RT_ERROR_INVALID_VALUE` -> `ACL_ERROR_RT_PARAM_INVALID`,
//!   `RT_ERROR_CONTEXT_NULL` -> `ACL_ERROR_RT_CONTEXT_NULL`,
//!   `RT_ERROR_STREAM_CONTEXT` -> `ACL_ERROR_RT_STREAM_CONTEXT`, ...);
//! - "the API reference": the CANN application-development API pages of the
//!   same names (`docs/api_docs/<call>.md` in the same repository).
//!
//! A rule that returns `Ok(Proceed::Done)` has found a call CANN completes
//! without doing anything (a synchronous copy onto itself); the export then
//! returns success.

#![allow(clippy::missing_safety_doc)]

use std::ffi::c_void;

use crate::arena;
use crate::context;
use crate::ffi::*;
use crate::host_bufs;
use crate::status::{fail, SimResult};

/// What the export does after its rule passed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Proceed {
    /// Go on with the call.
    Run,
    /// CANN returns success here without doing anything.
    Done,
}

/// The padding `aclrtMalloc` adds: the size is rounded up to 32 bytes and 32
/// more are added (acl `memory.cpp`, `GetAlignedAndPaddingSize`).
const MALLOC_APPEND: usize = 32 + 32;

fn not_null(p: *const c_void, what: &str) -> SimResult<()> {
    // acl `*.cpp`: `ACL_REQUIRES_NOT_NULL_WITH_INPUT_REPORT(...)` returns
    // ACL_ERROR_INVALID_PARAM before the runtime is called.
    if p.is_null() {
        return fail(ACL_ERROR_INVALID_PARAM, format!("{what} is NULL"));
    }
    Ok(())
}

/// The copy kinds the ACL layer accepts. acl `memory.cpp`,
/// `MemcpyKindTranslate`, maps HOST_TO_HOST, HOST_TO_DEVICE, DEVICE_TO_HOST,
/// DEVICE_TO_DEVICE, DEFAULT and HOST_TO_BUF_TO_DEVICE; any other value
/// (INNER_/INTER_DEVICE_TO_DEVICE included) is ACL_ERROR_INVALID_PARAM.
fn copy_kind(kind: i32) -> SimResult<()> {
    if !(ACL_MEMCPY_HOST_TO_HOST..=ACL_MEMCPY_HOST_TO_BUF_TO_DEVICE).contains(&kind) {
        return fail(
            ACL_ERROR_INVALID_PARAM,
            format!(
                "aclrtMemcpyKind {kind} is not accepted (expected ACL_MEMCPY_HOST_TO_HOST .. \
                 ACL_MEMCPY_HOST_TO_BUF_TO_DEVICE, 0..=5)"
            ),
        );
    }
    Ok(())
}

fn count_within(count: usize, max: usize, max_name: &str) -> SimResult<()> {
    // `ApiErrorDecorator::MemCopySync` / `MemcpyAsync` / `MemsetAsync`:
    // `cnt > destMax` is RT_ERROR_INVALID_VALUE, i.e. ACL_ERROR_RT_PARAM_INVALID.
    if count > max {
        return fail(ACL_ERROR_RT_PARAM_INVALID, format!("count {count} exceeds {max_name} {max}"));
    }
    Ok(())
}

fn current_device(call: &str) -> SimResult<u32> {
    // `ApiImpl::*`: `CHECK_CONTEXT_VALID_WITH_RETURN(curCtx, RT_ERROR_CONTEXT_NULL)`;
    // the context is per thread (`aclrtSetDevice` binds it to the calling thread).
    context::current().map_err(|mut e| {
        e.msg = format!("{call} needs a current device on this thread: {}", e.msg);
        e
    })
}

/// `aclrtMalloc(devPtr, size, policy)`.
///
/// Any `policy` is accepted: acl `memory.cpp`, `aclMallocMemInner`, maps an
/// unknown policy to the default flags, and the API reference of
/// `aclrtMallocAlign32` (same path) says an out-of-range policy allocates
/// huge pages from 2 MB and normal pages below.
pub fn malloc(dev_ptr: *mut *mut c_void, size: usize, _policy: i32) -> SimResult<()> {
    // acl `memory.cpp:145` (`aclMallocMemInner`).
    not_null(dev_ptr as *const c_void, "devPtr")?;
    // `memory.cpp:147-152`: "size must be greater than zero"; API reference:
    // "size must not be 0".
    if size == 0 {
        return fail(ACL_ERROR_INVALID_PARAM, "size must not be 0");
    }
    // `memory.cpp:129-132` (`GetAlignedAndPaddingSize`): "size too large"
    // when size + padding overflows.
    if size.checked_add(MALLOC_APPEND).is_none() {
        return fail(ACL_ERROR_INVALID_PARAM, format!("size {size} overflows with its 64 bytes of alignment padding"));
    }
    // `ApiImpl::DevMalloc`, `api_impl.cc:2320-2321`: the thread's context.
    current_device("aclrtMalloc").map(drop)
}

/// `aclrtFreeHost(hostPtr)`: only `aclrtMallocHost` memory.
pub fn free_host(host_ptr: *mut c_void) -> SimResult<()> {
    // acl `memory.cpp:478`; no context is needed (`ApiImpl::HostFree`,
    // `api_impl.cc:2474-2481`, falls back to the NPU driver).
    not_null(host_ptr, "hostPtr")?;
    // `ApiImpl::HostFree`, `api_impl.cc:2486-2491`: a pointer whose location
    // is not host memory is RT_ERROR_INVALID_VALUE ("is not host memory").
    if arena::owner(host_ptr as usize).is_some() {
        return fail(
            ACL_ERROR_RT_PARAM_INVALID,
            format!("{host_ptr:p} is device memory: aclrtFreeHost frees only aclrtMallocHost memory"),
        );
    }
    Ok(())
}

/// `aclrtMemcpy(dst, destMax, src, count, kind)` (`sync`) and the same
/// arguments of `aclrtMemcpyAsync`, in CANN's order (hicann/runtime v8.5.0).
/// The stricter owner-vs-kind check, the host-to-host refusal, the
/// same-address shortcut, the stream's device and the 64-byte alignment of the
/// asynchronous copy are checked by the export (see acl.rs).
pub fn copy(
    call: &str,
    dst: *mut c_void,
    dest_max: usize,
    src: *const c_void,
    count: usize,
    kind: i32,
    sync: bool,
) -> SimResult<Proceed> {
    // acl `memory.cpp:528-529` (sync) / `:572-573` (async):
    // `ACL_REQUIRES_NOT_NULL_WITH_INPUT_REPORT(dst)`, `(src)`, whatever the count.
    not_null(dst, "dst")?;
    not_null(src, "src")?;
    // `memory.cpp:532` / `:575`: `MemcpyKindTranslate` (`:41-77`).
    copy_kind(kind)?;
    // `ApiErrorDecorator::MemCopySync`, `api_error.cc:1569` (sync only):
    // `ZERO_RETURN_AND_MSG_OUTER(destMax)` is RT_ERROR_INVALID_VALUE
    // (`error_message_manage.hpp:132-134`), ACL_ERROR_RT_PARAM_INVALID
    // (`errcode_manage.cc:285`).
    if sync && dest_max == 0 {
        return fail(ACL_ERROR_RT_PARAM_INVALID, "destMax is 0 (expected > 0)");
    }
    // `api_error.cc:1570` (sync) / `:1612` (async): `ZERO_RETURN_AND_MSG_OUTER(cnt)`:
    // a zero-byte copy is refused, not skipped.
    if count == 0 {
        return fail(ACL_ERROR_RT_PARAM_INVALID, "count is 0 (expected > 0)");
    }
    // `api_error.cc:1572-1573` / `:1613-1614`: `cnt > destMax`.
    count_within(count, dest_max, "destMax")?;
    // `api_error.cc:1577`: the synchronous copy onto itself succeeds here,
    // before the runtime looks for a context.
    if sync && std::ptr::eq(dst as *const c_void, src) {
        return Ok(Proceed::Done);
    }
    // Sync: `ApiImpl::MemCopySync`, `api_impl.cc:2684-2685`, needs the thread's
    // context even for host memory; async: `MemcpyAsyncCheckLocation`,
    // `api_error.cc:2099-2100`.
    current_device(call)?;
    Ok(Proceed::Run)
}

/// The host side of a memset: the API reference of `aclrtMemset` says memory
/// "on the host not allocated by an acl interface (e.g. aclrtMallocHost)"
/// gives undefined behaviour, so it is refused.
fn memset_target(dev_ptr: *mut c_void, count: usize) -> SimResult<()> {
    let addr = dev_ptr as usize;
    if arena::owner(addr).is_some() {
        return Ok(());
    }
    let inside = host_bufs::containing(addr).is_some_and(|(base, b)| addr.saturating_add(count) <= base + b.size);
    if !inside {
        return fail(
            ACL_ERROR_RT_PARAM_INVALID,
            format!(
                "devPtr {dev_ptr:p} is host memory not allocated by aclrtMallocHost (or {count} bytes overrun it): \
                 memset of such memory is undefined"
            ),
        );
    }
    Ok(())
}

/// `aclrtMemset(devPtr, maxCount, value, count)`, up to the context check;
/// the capture-mode check follows in the export, then [`memset_range`].
pub fn memset(dev_ptr: *mut c_void, count: usize) -> SimResult<()> {
    // acl `memory.cpp:552`: `ACL_REQUIRES_NOT_NULL_WITH_INPUT_REPORT(devPtr)`.
    not_null(dev_ptr, "devPtr")?;
    // `ApiErrorDecorator::MemSetSync`, `api_error.cc:2362`:
    // `ZERO_RETURN_AND_MSG_OUTER(cnt)`, RT_ERROR_INVALID_VALUE.
    if count == 0 {
        return fail(ACL_ERROR_RT_PARAM_INVALID, "count is 0 (expected > 0)");
    }
    // `ApiImpl::MemSetSync`, `api_impl.cc:3054-3055`: the thread's context.
    current_device("aclrtMemset").map(drop)
}

/// The range of a synchronous memset. The runtime hands `maxCount` to the
/// driver's memset (`api_impl.cc:3064`), which bounds the write; its code is
/// not in the open source, so the simulator refuses as `MemsetAsync` does.
pub fn memset_range(dev_ptr: *mut c_void, max_count: usize, count: usize) -> SimResult<()> {
    count_within(count, max_count, "maxCount")?;
    memset_target(dev_ptr, count)
}

/// `aclrtMemsetAsync(devPtr, maxCount, value, count, stream)`.
pub fn memset_async(dev_ptr: *mut c_void, max_count: usize, count: usize) -> SimResult<()> {
    // acl `memory.cpp:627`: `ACL_REQUIRES_NOT_NULL_WITH_INPUT_REPORT(devPtr)`.
    not_null(dev_ptr, "devPtr")?;
    // `ApiErrorDecorator::MemsetAsync`, `api_error.cc:2373`: `ZERO_RETURN_AND_MSG_OUTER(cnt)`.
    if count == 0 {
        return fail(ACL_ERROR_RT_PARAM_INVALID, "count is 0 (expected > 0)");
    }
    // `api_error.cc:2374-2375`: `cnt > destMax` is RT_ERROR_INVALID_VALUE.
    count_within(count, max_count, "maxCount")?;
    // `ApiImpl::MemsetAsync`, `api_impl.cc:3071-3072`: the thread's context.
    current_device("aclrtMemsetAsync")?;
    memset_target(dev_ptr, count)
}

/// `aclrtDestroyStream(stream)`.
pub fn destroy_stream(stream: AclrtStream) -> SimResult<()> {
    // acl `stream.cpp:102`: `ACL_REQUIRES_NOT_NULL_WITH_INPUT_REPORT(stream)`.
    not_null(stream, "stream (the default stream cannot be destroyed)")?;
    // `ApiErrorDecorator::StreamDestroy`, `api_error.cc:977-979`: a capturing
    // stream is RT_ERROR_STREAM_CAPTURED (`errcode_manage.cc:133`), before
    // any context check.
    crate::capture::destroy_stream(stream as usize)?;
    // `ApiImpl::StreamDestroy`, `api_impl.cc:1431-1434`: the thread's context,
    // and the stream must belong to it (RT_ERROR_STREAM_CONTEXT,
    // `errcode_manage.cc:110`); API reference: "make sure the stream is in
    // the current context".
    current_device("aclrtDestroyStream")?;
    crate::capture::stream_here(stream as usize).map(drop)
}

/// `aclrtSynchronizeStream(stream)`, after the capture check
/// (`ApiErrorDecorator::StreamSynchronize`, `api_error.cc:1010-1011`), which
/// the export makes first.
pub fn synchronize_stream(_stream: AclrtStream) -> SimResult<()> {
    // `ApiImpl::StreamSynchronize`, `api_impl.cc:1580-1581`: the thread needs
    // a context even when the stream is explicit; a stream of another device
    // is synchronised by switching to its context (`:1602-1608`).
    current_device("aclrtSynchronizeStream").map(drop)
}

/// `aclrtSynchronizeStreamWithTimeout(stream, timeout)`.
pub fn synchronize_stream_with_timeout(_stream: AclrtStream, timeout: i32) -> SimResult<()> {
    // acl `stream.cpp:157-160` (`aclrtSynchronizeStreamWithTimeoutImpl`):
    // timeout < -1 is ACL_ERROR_RT_PARAM_INVALID; `ApiErrorDecorator::StreamSynchronize`,
    // `api_error.cc:1002-1003`: "greater than or equal to -1 and not equal
    // to 0" (RT_ERROR_INVALID_VALUE). The API reference lists -1 (wait
    // forever) and > 0 ms only.
    if timeout < -1 || timeout == 0 {
        return fail(ACL_ERROR_RT_PARAM_INVALID, format!("timeout {timeout} ms (expected -1 or > 0)"));
    }
    current_device("aclrtSynchronizeStreamWithTimeout").map(drop)
}

/// `aclrtStreamWaitEvent(stream, event)`.
pub fn stream_wait_event(_stream: AclrtStream, event: AclrtEvent) -> SimResult<()> {
    // acl `aclrtStreamWaitEventImpl`: `ACL_REQUIRES_NOT_NULL(event)`.
    not_null(event, "event")
}

/// `aclrtRecordEvent(event, stream)`.
pub fn record_event(event: AclrtEvent, _stream: AclrtStream) -> SimResult<()> {
    // acl `aclrtRecordEventImpl`: `ACL_REQUIRES_NOT_NULL(event)`.
    not_null(event, "event")
}

/// `aclrtSynchronizeEvent(event)`, `aclrtDestroyEvent(event)`.
pub fn event_handle(event: AclrtEvent) -> SimResult<()> {
    // acl `aclrtSynchronizeEventImpl`, `aclrtDestroyEventImpl`: `ACL_REQUIRES_NOT_NULL(event)`.
    not_null(event, "event")
}

/// `aclrtQueryEventStatus(event, status)`.
pub fn query_event_status(event: AclrtEvent, status: *mut i32) -> SimResult<()> {
    // acl `aclrtQueryEventStatusImpl`: both arguments non-NULL.
    not_null(event, "event")?;
    not_null(status as *const c_void, "status")
}

/// `aclrtEventElapsedTime(ms, startEvent, endEvent)`.
pub fn event_elapsed_time(ms: *mut f32, start: AclrtEvent, end: AclrtEvent) -> SimResult<()> {
    // acl `aclrtEventElapsedTimeImpl`: all three non-NULL.
    not_null(ms as *const c_void, "ms")?;
    not_null(start, "startEvent")?;
    not_null(end, "endEvent")?;
    crate::capture::elapsed_time(start as usize, end as usize)?;
    let events = [("startEvent", context::event(start as usize)?), ("endEvent", context::event(end as usize)?)];
    // Runtime `Event::ElapsedTime` checks both records before any timestamp:
    // an event without a record is RT_ERROR_EVENT_RECORDER_NULL
    // (ACL_ERROR_RT_INTERNAL_ERROR).
    if let Some((what, _)) = events.iter().find(|(_, e)| e.target().is_none()) {
        return fail(ACL_ERROR_RT_INTERNAL_ERROR, format!("{what} was never recorded (aclrtRecordEvent)"));
    }
    // An event created without ACL_EVENT_TIME_LINE keeps no timestamp
    // ("ACL_EVENT_TIME_LINE: the event records timestamp information",
    // `docs/api_docs/aclrtCreateEventExWithFlag.md:27`, v8.5.0; aclrtCreateEvent's
    // RT_EVENT_DEFAULT carries it, `pkg_inc/runtime/runtime/event.h:62`). The
    // runtime takes a timeline for a record only when the event has the bit
    // (`event_task.cc:31-32`), so where it reads timelines the time stays
    // UINT64_MAX and `Event::ElapsedTime` fails with
    // RT_ERROR_EVENT_TIMESTAMP_INVALID (`event.cc:1129-1142`); on STARS chips
    // the record reports a completion with its time only for such an event
    // or one that needs the report for another reason (`event_task.cc:247-248`),
    // and a time otherwise is not one the API promises. Refused everywhere
    // with that code: stricter than a chip that happens to report a time.
    if let Some((what, e)) = events.iter().find(|(_, e)| e.flag & crate::stream::RT_EVENT_TIME_LINE == 0) {
        return fail(
            ACL_ERROR_RT_EVENT_TIMESTAMP_INVALID,
            format!(
                "{what} was created with flag {:#x}, without ACL_EVENT_TIME_LINE (0x8): it keeps no timestamp",
                e.flag
            ),
        );
    }
    // A record that has not run has no timestamp (UINT64_MAX):
    // RT_ERROR_EVENT_TIMESTAMP_INVALID (ACL_ERROR_RT_EVENT_TIMESTAMP_INVALID).
    // API reference: record both, synchronise, then ask for the time.
    if let Some((what, _)) = events.iter().find(|(_, e)| e.time().is_none()) {
        return fail(
            ACL_ERROR_RT_EVENT_TIMESTAMP_INVALID,
            format!("{what}'s record has not completed (synchronise its stream first)"),
        );
    }
    Ok(())
}
