//! The hooks other calls go through: recording a capturing stream's tasks,
//! resolving the stream a call uses, and refusing what CANN refuses while a
//! stream captures.

use std::sync::Arc;

use crate::arena;
use crate::context::{self, STREAMS};
use crate::counters;
use crate::ffi::{AclrtStream, ACL_ERROR_INVALID_PARAM, ACL_ERROR_RT_INTERNAL_ERROR, ACL_ERROR_RT_STREAM_CONTEXT};
use crate::host_bufs;
use crate::status::{fail, write_out, SimResult};
use crate::stream::{Event, Job, Stream};

use super::codes::*;
use super::state::*;

/// The streams' [`crate::stream::Interceptor`], called by [`Stream::enqueue`]
/// once a capture has begun: records `job` when `s` captures (returns None),
/// otherwise hands it back to be queued.
pub fn intercept(s: &Stream, name: &'static str, job: Job) -> Option<Job> {
    let mut m = members();
    let Some(member) = m.iter_mut().find(|x| std::ptr::eq(&*x.stream, s)) else {
        return Some(job);
    };
    let Some(model) = MODELS.get(member.model) else {
        return Some(job);
    };
    let mut st = model.lock();
    // An invalidated capture records nothing more ([`admit`] refuses the call).
    if st.invalid.is_none() {
        st.tasks.push((name, Arc::from(job)));
        member.recorded = st.tasks.len();
        member.waits_last = false;
    }
    None
}

/// The stream of handle `h` (NULL = the current device's default stream),
/// for a call that uses it: refused while graph capture forbids that use
/// (see [`admit`]).
pub fn stream(h: usize) -> SimResult<Arc<Stream>> {
    let s = context::resolve_stream(h)?;
    admit(&s)?;
    Ok(s)
}

/// The stream of handle `h` for a call that uses it, as [`stream`], which
/// must belong to the calling thread's device (`ApiImpl`:
/// `COND_RETURN_AND_MSG_INVALID_CONTEXT_STREAM`, RT_ERROR_STREAM_CONTEXT).
pub fn stream_here(h: usize) -> SimResult<Arc<Stream>> {
    let cur = context::current()?;
    let s = stream(h)?;
    if s.device != cur {
        return fail(
            ACL_ERROR_RT_STREAM_CONTEXT,
            format!("the stream belongs to device {} but the current device is {cur}", s.device),
        );
    }
    Ok(s)
}

/// Checks a call that uses stream `s` (every stream resolution of
/// [`stream`]):
/// - the default stream of a device on which a stream captures is refused with
///   `ACL_ERROR_RT_STREAM_CAPTURE_IMPLICIT` and invalidates those captures
///   (guide, restriction 6: "operations on the default stream are illegal
///   during capture");
/// - a stream whose capture was invalidated is refused with
///   `ACL_ERROR_RT_STREAM_CAPTURE_INVALIDATED` until the capture is ended.
pub fn admit(s: &Arc<Stream>) -> SimResult<()> {
    let m = members();
    if s.is_default {
        let mut on_device: Vec<usize> = m.iter().filter(|x| x.stream.device == s.device).map(|x| x.model).collect();
        on_device.dedup();
        if !on_device.is_empty() {
            for h in on_device {
                invalidate(h, "the device's default stream was used during the capture");
            }
            return fail(
                ACL_ERROR_RT_STREAM_CAPTURE_IMPLICIT,
                format!("device {}'s default stream (NULL) is used while a stream of the device captures", s.device),
            );
        }
    }
    if let Some(member) = member_of(&m, s) {
        if let Some(why) = MODELS.get(member.model).and_then(|model| model.lock().invalid.clone()) {
            return fail(
                ACL_ERROR_RT_STREAM_CAPTURE_INVALIDATED,
                format!("the stream's capture was invalidated ({why}); end it with aclmdlRICaptureEnd"),
            );
        }
    }
    Ok(())
}

/// Refuses an unsafe function `call` when the captures' modes and the calling
/// thread's own mode (its `THREAD_MODE`, set by
/// `aclmdlRICaptureThreadExchangeMode`) forbid it, as
/// `Context::IsCaptureModeSupport` decides (hicann/runtime v8.5.0
/// `src/runtime/feature/src/context/context.cc:5134-5162`, asked by
/// `ApiImpl::MemCopySync` and `ApiImpl::MemSetSync`, `api_impl.cc:2691-2694`,
/// `:3059-3062`):
/// - a thread in RELAXED mode is never refused (`:5144-5146`), also the one
///   that began a GLOBAL or THREAD_LOCAL capture;
/// - in GLOBAL mode (every thread's default) it is refused while any GLOBAL
///   capture runs, or a THREAD_LOCAL capture this thread began
///   (`:5148-5153`: the context's mode is the strictest of its captures',
///   `Context::CaptureModeEnter`, `:5165-5176`; the thread's the strictest of
///   those it began, `InnerThreadLocalContainer::ThreadCaptureModeEnter`,
///   `src/runtime/feature/src/common/inner_thread_local.cpp:124`);
/// - in THREAD_LOCAL mode, only while a GLOBAL or THREAD_LOCAL capture this
///   thread began runs (`:5155-5160`).
///
/// The runtime asks only the captures of the current context; here every
/// device's count, which is stricter. The captures that forbid the call
/// are invalidated (the runtime leaves them valid: stricter, so a caller
/// that relies on the refusal being harmless is caught). Code
/// `ACL_ERROR_RT_CAPTURE_MODE_NOT_SUPPORT` (RT_ERROR_STREAM_CAPTURE_MODE_NOT_SUPPORT,
/// `errcode_manage.cc:137`), as real `rtMemcpy` returns it (vLLM-Ascend #6002, #10309).
pub fn unsafe_call(call: &str) -> SimResult<()> {
    let me = std::thread::current().id();
    let thread_mode = THREAD_MODE.with(|m| m.get());
    if thread_mode == ACL_MODEL_RI_CAPTURE_MODE_RELAXED {
        return Ok(());
    }
    let m = members();
    let mut hits: Vec<(usize, i32)> = Vec::new();
    for x in m.iter() {
        if hits.iter().any(|(h, _)| *h == x.model) {
            continue;
        }
        let Some(model) = MODELS.get(x.model) else { continue };
        let st = model.lock();
        if let Some(sess) = &st.capture {
            let mine = sess.thread == me;
            let forbids = if thread_mode == ACL_MODEL_RI_CAPTURE_MODE_GLOBAL {
                sess.mode == ACL_MODEL_RI_CAPTURE_MODE_GLOBAL
                    || (sess.mode == ACL_MODEL_RI_CAPTURE_MODE_THREAD_LOCAL && mine)
            } else {
                mine && sess.mode != ACL_MODEL_RI_CAPTURE_MODE_RELAXED
            };
            if forbids {
                hits.push((x.model, sess.mode));
            }
        }
    }
    let Some(&(_, mode)) = hits.first() else { return Ok(()) };
    for (h, _) in &hits {
        invalidate(*h, &format!("{call} was called during the capture"));
    }
    fail(
        ACL_ERROR_RT_CAPTURE_MODE_NOT_SUPPORT,
        format!(
            "{call} is not allowed while a stream captures in {} and this thread's capture mode is {} (a thread \
             whose work does not touch the capture may switch to ACL_MODEL_RI_CAPTURE_MODE_RELAXED with \
             aclmdlRICaptureThreadExchangeMode)",
            mode_name(mode),
            mode_name(thread_mode)
        ),
    )
}

/// Counts a blocking copy `aclrtMemcpy` (a host synchronisation and a copy),
/// at the call, whether it succeeds or not.
pub fn count_blocking_copy(dst: usize, src: usize, count: usize) {
    counters::host_sync();
    counters::copy(dst, src, count);
}

/// Hook of the blocking copy `aclrtMemcpy` once its arguments passed: an
/// unsafe function.
pub fn blocking_copy() -> SimResult<()> {
    unsafe_call("aclrtMemcpy")
}

/// Hook of the blocking `aclrtMemset` once its arguments passed: an unsafe
/// function (the export counts the host synchronisation).
pub fn blocking_memset() -> SimResult<()> {
    unsafe_call("aclrtMemset")
}

/// Hook of `aclrtMalloc`, `aclrtFree`, `aclrtMallocHost` and `aclrtFreeHost`:
/// counted, and refused where the capture mode forbids unsafe functions.
/// Stricter than documented (CANN lists only the copies and memsets as
/// unsafe): device memory used by captured tasks must stay fixed until the
/// model is destroyed (guide, restriction 7), and an allocation inside a
/// captured operation is the mistake this catches.
pub fn allocation(call: &'static str) -> SimResult<()> {
    counters::bump(|c| match call {
        "aclrtMalloc" => c.device_mallocs += 1,
        "aclrtFree" => c.device_frees += 1,
        "aclrtMallocHost" => c.host_mallocs += 1,
        _ => c.host_frees += 1,
    });
    unsafe_call(call)
}

pub(super) fn pinned(addr: usize) -> bool {
    host_bufs::containing(addr).is_some()
}

/// Hook of `aclrtMemcpyAsync` on stream `s`: counts the copy; a host operand
/// must be page-locked (`aclrtMallocHost`) when `s` captures (guide,
/// restriction 5), and a pageable one is an unsafe function otherwise.
///
/// The runtime turns a copy that involves pageable memory into a
/// synchronisation of `s` and a synchronous copy (`ApiErrorDecorator::MemcpyAsync`,
/// hicann/runtime v8.5.0 `src/runtime/feature/src/api_impl/api_error.cc:1661-1664`).
/// On a capturing `s` that synchronisation answers RT_ERROR_STREAM_CAPTURED
/// (`:1010-1011`), 107027; the copy then meets the capture mode as
/// `aclrtMemcpy` does (`ApiImpl::MemCopySync`, `api_impl.cc:2691`). The
/// runtime leaves the capture valid; here it is invalidated, as for every
/// synchronisation of a capturing stream ([`sync_stream`]).
pub fn async_copy(s: &Stream, dst: usize, src: usize, count: usize) -> SimResult<()> {
    counters::copy(dst, src, count);
    if count == 0 {
        return Ok(());
    }
    let host = [dst, src].into_iter().find(|a| arena::owner(*a).is_none());
    let Some(host) = host.filter(|a| !pinned(*a)) else { return Ok(()) };
    let captured = member_of(&members(), s).map(|x| x.model);
    if let Some(h) = captured {
        invalidate(h, "a pageable host buffer was used by a captured aclrtMemcpyAsync");
        return fail(
            ACL_ERROR_RT_STREAM_CAPTURED,
            format!(
                "aclrtMemcpyAsync on a capturing stream uses pageable host memory {host:#x}, which synchronises the \
                 stream; only aclrtMallocHost memory may be captured"
            ),
        );
    }
    unsafe_call("aclrtMemcpyAsync with pageable host memory")
}

/// Hook of `aclrtSynchronizeStream[WithTimeout]` (`call`) on handle `h`: a host
/// synchronisation, refused for a capturing stream with
/// `ACL_ERROR_RT_STREAM_CAPTURED` (guide, restriction 2; real CANN:
/// "synchronize stream failed, runtime result = 107027", vLLM-Ascend #10309),
/// which invalidates the capture.
pub fn sync_stream(call: &str, h: usize) -> SimResult<()> {
    counters::host_sync();
    let Ok(s) = context::resolve_stream(h) else { return Ok(()) };
    let captured = member_of(&members(), &s).map(|x| x.model);
    if let Some(model) = captured {
        invalidate(model, &format!("{call} was called on a capturing stream"));
        return fail(ACL_ERROR_RT_STREAM_CAPTURED, format!("{call}: the stream is capturing (aclmdlRICaptureBegin)"));
    }
    Ok(())
}

/// The query of `aclmdlRICaptureGetInfo(stream, status, modelRI)`: NONE (and
/// a NULL model) for a stream that does not capture, else ACTIVE and the
/// model being recorded, also once the capture is invalidated: the runtime
/// answers with the stream's own status (`Context::StreamGetCaptureInfo`,
/// `src/runtime/feature/src/context/context.cc:5069-5090`, v8.5.0), which
/// becomes INVALIDATED only when the runtime fails to allocate a captured
/// task (`Stream::SingleStreamTerminateCapture`, `stream.cc:3850-3858`, from
/// `:3868`, `:3916`, `:3926`, `:3942`), a failure the simulator never has;
/// every invalidation it models terminates the model only
/// (`CaptureModel::TerminateCapture`, `capture_model.hpp:63-68`), which
/// `aclmdlRICaptureEnd` reports (`context.cc:4999-5004`).
///
/// `aclmdlRICaptureGetInfoImpl` (hicann/runtime `src/acl/aclrt_impl/model_ri.cpp:70-92`,
/// v8.5.0): a NULL stream is `ACL_ERROR_INVALID_PARAM` (`ACL_REQUIRES_NOT_NULL(stream)`,
/// line 73; the default stream is not asked about, it never captures); one
/// of `status` and `modelRI` may be NULL, not both (lines 74-77); each
/// non-NULL one is written (lines 85-92).
pub unsafe fn capture_info(stream: AclrtStream, status: *mut i32, model_ri: *mut AclmdlRI) -> SimResult<()> {
    // model_ri.cpp:73.
    if stream.is_null() {
        return fail(ACL_ERROR_INVALID_PARAM, "stream is NULL (the default stream cannot be asked about)");
    }
    // model_ri.cpp:74-77.
    if status.is_null() && model_ri.is_null() {
        return fail(ACL_ERROR_INVALID_PARAM, "status and modelRI cannot both be NULL");
    }
    let s = context::resolve_stream(stream as usize)?;
    let h = member_of(&members(), &s).map(|x| x.model);
    let (st, h) = match h.and_then(|h| MODELS.get(h).map(|m| (h, m))) {
        None => (ACL_MODEL_RI_CAPTURE_STATUS_NONE, 0),
        Some((h, _)) => (ACL_MODEL_RI_CAPTURE_STATUS_ACTIVE, h),
    };
    // model_ri.cpp:85-92.
    if !status.is_null() {
        write_out(status, st, ACL_ERROR_INVALID_PARAM, "status")?;
    }
    if !model_ri.is_null() {
        write_out(model_ri, h as AclmdlRI, ACL_ERROR_INVALID_PARAM, "modelRI")?;
    }
    Ok(())
}

/// Hook of `aclrtDestroyStream`: a capturing stream cannot be destroyed (and
/// the attempt invalidates its capture, like the other refused calls).
pub fn destroy_stream(h: usize) -> SimResult<()> {
    let Some(s) = STREAMS.get(h) else { return Ok(()) };
    let captured = member_of(&members(), &s).map(|x| x.model);
    if let Some(model) = captured {
        invalidate(model, "aclrtDestroyStream was called on the capturing stream");
        return fail(ACL_ERROR_RT_STREAM_CAPTURED, "the stream is capturing; end the capture first");
    }
    Ok(())
}

pub(super) fn event_check(call: &str, h: usize) -> SimResult<()> {
    let Ok(e) = context::event(h) else { return Ok(()) };
    let model = captured_events().iter().find(|c| Arc::ptr_eq(&c.event, &e)).map(|c| c.model);
    if let Some(model) = model {
        if MODELS.get(model).is_some_and(|m| m.capturing()) {
            invalidate(model, &format!("{call} was called on an event recorded in the capture"));
            return fail(ACL_ERROR_RT_EVENT_CAPTURED, format!("{call}: the event was recorded in an ongoing capture"));
        }
    }
    Ok(())
}

/// Hook of `aclrtSynchronizeEvent`: a host synchronisation, refused for an
/// event recorded in an ongoing capture (guide, restriction 2).
pub fn sync_event(h: usize) -> SimResult<()> {
    counters::host_sync();
    event_check("aclrtSynchronizeEvent", h)
}

/// Hook of `aclrtQueryEventStatus`: a query, refused for an event recorded in
/// an ongoing capture (guide, restriction 2).
pub fn query_event(h: usize) -> SimResult<()> {
    counters::bump(|c| c.queries += 1);
    event_check("aclrtQueryEventStatus", h)
}

/// Hook of `aclrtEventElapsedTime`: refused when either event was recorded
/// in an ongoing capture, before any record or timestamp is looked at
/// (`ApiErrorDecorator::EventElapsedTime`, hicann/runtime v8.5.0
/// `src/runtime/feature/src/api_impl/api_error.cc:1333-1339`, after its NULL
/// checks: RT_ERROR_EVENT_CAPTURED), and like the other queries of such an
/// event it invalidates the capture (guide, restriction 2).
pub fn elapsed_time(start: usize, end: usize) -> SimResult<()> {
    event_check("aclrtEventElapsedTime", start)?;
    event_check("aclrtEventElapsedTime", end)
}

/// True while `s` takes part in a capture that is still being recorded (the
/// runtime's `Event::ToBeCaptured`: the stream has a capture stream whose
/// model captures, `src/runtime/feature/src/event/event.cc:1239-1252`, v8.5.0).
fn to_be_captured(s: &Stream) -> bool {
    let m = members();
    member_of(&m, s).and_then(|x| MODELS.get(x.model)).is_some_and(|model| model.capturing())
}

/// How `aclrtRecordEvent` records an event on a stream ([`check_record`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecordKind {
    /// Not captured: the event's own record moves to the end of the stream.
    Eager,
    /// Captured: the model gets a record task of the runtime's own capture
    /// event; the event itself is not recorded (its latest eager record, if
    /// any, stays what synchronize, query and elapsed time report).
    Captured,
    /// Captured and dropped: nothing is recorded at all.
    Skipped,
}

/// Hook of `aclrtRecordEvent(e, s)`, before the record is queued. On a
/// stream that takes part in a capture (`ApiImpl::EventRecord`,
/// `src/runtime/feature/src/api_impl/api_impl.cc:2113-2123` at v8.5.0; an
/// `RT_EVENT_EXTERNAL` event is never captured, event.cc:1241):
/// - an event of `aclrtCreateEvent` (old mode) is refused with
///   `ACL_ERROR_RT_FEATURE_NOT_SUPPORT` (207000, api_impl.cc:2114-2116; a
///   `COND_RETURN_WARN`, so the capture stays valid);
/// - a new-mode event without a wait task (`aclrtCreateEventExWithFlag`
///   without `ACL_EVENT_SYNC`) succeeds and records nothing
///   (api_impl.cc:2122-2123: `COND_RETURN_WARN(..., RT_ERROR_NONE, ...)`);
/// - any other event is [`RecordKind::Captured`]: `ApiImpl::CaptureEventRecord`
///   (api_impl.cc:2053-2090) binds a new internal event to it
///   (`GetCaptureEvent`, :1440-1484) and records that one
///   (`captureEvt->Record`, :2080), so the event's own `HasRecord` and
///   timestamp are untouched: after the capture a synchronize returns at
///   once (`Event::Synchronize`, `event.cc:962-969`) and an elapsed time
///   over it is `RT_ERROR_EVENT_RECORDER_NULL`, however often the graph ran.
pub fn check_record(e: &Event, s: &Stream) -> SimResult<RecordKind> {
    if e.flag == crate::stream::RT_EVENT_EXTERNAL || !to_be_captured(s) {
        return Ok(RecordKind::Eager);
    }
    if !e.new_mode {
        return fail(
            crate::ffi::ACL_ERROR_RT_FEATURE_NOT_SUPPORT,
            "an event of aclrtCreateEvent cannot be recorded on a capturing stream; create it with \
             aclrtCreateEventExWithFlag(ACL_EVENT_SYNC) (runtime ApiImpl::EventRecord)",
        );
    }
    Ok(if e.without_wait_task() { RecordKind::Skipped } else { RecordKind::Captured })
}

/// Checks of `aclrtStreamWaitEvent(s, e)` that depend on the event's mode
/// (`ApiImpl::StreamWaitEvent`, `src/runtime/feature/src/api_impl/api_impl.cc:1532-1565`
/// at v8.5.0), before [`wait_event`]:
/// - `e` was recorded in an ongoing capture and `s` is a default stream:
///   `ACL_ERROR_RT_STREAM_CAPTURE_IMPLICIT` (api_impl.cc:1537-1539);
/// - `s` takes part in a capture, `e` was not recorded in one and is an
///   old-mode event other than `RT_EVENT_EXTERNAL`:
///   `ACL_ERROR_RT_FEATURE_NOT_SUPPORT` (api_impl.cc:1549-1555, a warning
///   return: the capture stays valid).
pub fn check_wait(s: &Stream, e: &Arc<Event>) -> SimResult<()> {
    let captured = {
        let ev = captured_events();
        ev.iter().find(|c| Arc::ptr_eq(&c.event, e)).map(|c| c.model)
    };
    let captured = captured.and_then(|h| MODELS.get(h)).is_some_and(|m| m.capturing());
    if captured {
        if s.is_default {
            return fail(
                ACL_ERROR_RT_STREAM_CAPTURE_IMPLICIT,
                "a default stream waits for an event recorded in a capture (a disallowed implicit dependency)",
            );
        }
        return Ok(());
    }
    if to_be_captured(s) && !e.new_mode && e.flag != crate::stream::RT_EVENT_EXTERNAL {
        return fail(
            crate::ffi::ACL_ERROR_RT_FEATURE_NOT_SUPPORT,
            "a capturing stream cannot wait for an event of aclrtCreateEvent; create it with \
             aclrtCreateEventExWithFlag(ACL_EVENT_SYNC) (runtime ApiImpl::StreamWaitEvent)",
        );
    }
    Ok(())
}

/// Hook of `aclrtRecordEvent`, after the record was queued on `s`: remembers
/// whether the event's latest record belongs to a capture.
pub fn record_event(e: &Arc<Event>, s: &Arc<Stream>) {
    let m = members();
    let mut ev = captured_events();
    match member_of(&m, s) {
        Some(member) => {
            ev.retain(|c| !Arc::ptr_eq(&c.event, e));
            ev.push(CapturedEvent { event: e.clone(), model: member.model, stream: s.clone(), at: member.recorded });
        }
        // A record outside every capture leaves the event bound to the
        // ongoing capture it was recorded in: the runtime clears an event's
        // capture event only when that capture's model ends or the event is
        // destroyed (hicann/runtime `feature/aclgraph/capture_model.cc:777-779`,
        // `core/src/task/task_info/event/event_task.cc:176-180`), and
        // `Event::IsCapturing` (`feature/aclgraph/event_capture.cc:175-182`)
        // keeps synchronize, query and elapsed time refused until then.
        // (A model captures while it has member streams: both end together.)
        None => ev.retain(|c| !Arc::ptr_eq(&c.event, e) || m.iter().any(|x| x.model == c.model)),
    }
}

/// Hook of `aclrtStreamWaitEvent(s, e)`. Returns true when the wait belongs to
/// a capture and must not be queued as an eager wait:
/// - `e` was recorded in a capture and `s` does not capture: `s` joins it;
/// - both in the same capture: the recording stream is joined into `s` (the
///   model's task order already puts the record first);
/// - `s` captures and `e` was recorded eagerly: refused with
///   `ACL_ERROR_RT_CAPTURE_DEPENDENCY`, since a replay could not honour a
///   dependency on work outside the model;
/// - `s` captures and `e` was recorded in another ongoing capture:
///   `ACL_ERROR_STREAM_CAPTURE_CONFLICT`, and both captures are invalidated.
pub fn wait_event(s: &Arc<Stream>, e: &Arc<Event>) -> SimResult<bool> {
    // Read before taking the capture locks: Event::record holds the event's
    // lock while it queues (and so takes them).
    let eager = e.target().is_some();
    let mut m = members();
    let ev = captured_events();
    let captured = ev.iter().find(|c| Arc::ptr_eq(&c.event, e));
    let waiter = m.iter().position(|x| Arc::ptr_eq(&x.stream, s));
    match (captured, waiter) {
        (None, None) => Ok(false),
        (None, Some(i)) => {
            if !eager {
                return Ok(false);
            }
            let h = m[i].model;
            drop(ev);
            drop(m);
            invalidate(h, "a captured stream waited for an event recorded outside the capture");
            fail(
                ACL_ERROR_RT_CAPTURE_DEPENDENCY,
                "the capturing stream waits for an event recorded outside the capture; a replay could not honour it",
            )
        }
        (Some(c), None) => {
            let Some(model) = MODELS.get(c.model) else { return Ok(false) };
            let state = model.lock();
            if state.capture.is_none() {
                return Ok(false);
            }
            // `Context::StreamAddToCaptureModelProc` refuses to add a stream
            // to an invalidated capture: RT_ERROR_MODEL_CAPTURE_STATUS
            // (hicann/runtime v8.5.0 `src/runtime/feature/src/context/context.cc:4739-4743`),
            // 507000 (`errcode_manage.cc:232`); the stream does not join.
            if let Some(why) = &state.invalid {
                return fail(
                    ACL_ERROR_RT_INTERNAL_ERROR,
                    format!("the event was recorded in a capture that is invalidated ({why}): no stream joins it"),
                );
            }
            drop(state);
            m.push(Member { stream: s.clone(), model: c.model, recorded: 0, joined: 0, waits_last: true });
            Ok(true)
        }
        (Some(c), Some(i)) => {
            if m[i].model != c.model {
                // `ApiImpl::CaptureEventWait`: `IsCrossCaptureModel` is
                // RT_ERROR_STREAM_CAPTURE_CONFLICT (api_impl.cc:1502-1503 at
                // v8.5.0), and `StreamWaitEvent` then terminates the event's
                // capture and the stream's (:1545, `TerminateCapture`,
                // `capture_model_utils.cc`: both become invalidated).
                let (h, other) = (m[i].model, c.model);
                drop(ev);
                drop(m);
                invalidate(h, "a captured stream waited for an event recorded in another capture");
                invalidate(other, "a stream of another capture waited for an event recorded in this one");
                return fail(ACL_ERROR_STREAM_CAPTURE_CONFLICT, "the event was recorded in another ongoing capture");
            }
            let (at, rec) = (c.at, c.stream.clone());
            if let Some(r) = m.iter_mut().find(|x| Arc::ptr_eq(&x.stream, &rec)) {
                r.joined = r.joined.max(at);
            }
            m[i].waits_last = true;
            Ok(true)
        }
    }
}
