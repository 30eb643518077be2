//! ACL graph capture (`aclmdlRICaptureBegin`, `aclmdlRICaptureGetInfo`,
//! `aclmdlRICaptureEnd`, `aclmdlRIExecuteAsync`, `aclmdlRIDestroy`, and
//! `aclrtSynchronizeDevice`), and the restrictions CANN places on other calls
//! while a stream captures.
//!
//! Between `aclmdlRICaptureBegin` and `aclmdlRICaptureEnd` every task queued
//! on the stream is recorded into a model instead of run (the CANN runtime
//! guide, "Single-Stream Capture" / 基于捕获方式构建模型运行实例). A recorded
//! task is the stream job itself (re-runnable, see [`crate::stream::Job`]), so
//! `aclmdlRIExecuteAsync` runs the same work again on the same buffers, with
//! device and host memory read when the replay runs. An aclnn operator is
//! recorded as the task its second phase launched: its executor is consumed
//! by that launch, as in eager mode, and a replay does not need it (the guide's
//! capture sample launches `aclnnAdd` once inside the capture and executes
//! the model afterwards).
//!
//! A stream that waits (`aclrtStreamWaitEvent`) on an event recorded in a
//! capture joins that capture; its tasks go into the same model. The model
//! keeps every recorded task in the order the host queued them, which
//! respects every dependency between the streams, and a replay runs them in
//! that order on the replay stream.
//!
//! Refused during capture (codes from `rt_error_codes.h`):
//! - synchronising or querying a capturing stream, the device, or an event
//!   recorded in the capture, in every mode (guide, restriction 2);
//! - the unsafe functions (`aclrtMemcpy`, `aclrtMemset`, an
//!   `aclrtMemcpyAsync` with pageable host memory) where the capture mode
//!   forbids them (`aclmdlRICaptureMode`, `aclmdlRICaptureThreadExchangeMode`
//!   reference), and by the simulator also the allocation calls;
//! - work on a device's default stream (guide, restriction 6).
//!
//! A refused call also invalidates the capture it conflicts with (the guide:
//! the check "reports an error and the capture fails"); `aclmdlRICaptureEnd`
//! then returns `ACL_ERROR_RT_STREAM_CAPTURE_INVALIDATED` and no model.

#![allow(non_snake_case, clippy::missing_safety_doc)]

use std::ffi::c_void;
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::ThreadId;

use crate::acl::HOST_BUFS;
use crate::arena;
use crate::context::{self, STREAMS};
use crate::counters;
use crate::ffi::*;
use crate::handles::Table;
use crate::status::{self, fail, write_out, SimError, SimResult};
use crate::stream::{Event, Job, Stream};

/// `aclmdlRI`.
pub type AclmdlRI = *mut c_void;

/// `ACL_ERROR_RT_CAPTURE_DEPENDENCY`: capture dependency failure.
pub const ACL_ERROR_RT_CAPTURE_DEPENDENCY: AclError = 107024;
/// `ACL_ERROR_RT_STREAM_UNJOINED`: invalid capture model (a joined stream was not joined back).
pub const ACL_ERROR_RT_STREAM_UNJOINED: AclError = 107025;
/// `ACL_ERROR_RT_MODEL_CAPTURED`: model is captured.
pub const ACL_ERROR_RT_MODEL_CAPTURED: AclError = 107026;
/// `ACL_ERROR_RT_STREAM_CAPTURED`: stream is captured.
pub const ACL_ERROR_RT_STREAM_CAPTURED: AclError = 107027;
/// `ACL_ERROR_RT_EVENT_CAPTURED`: event is captured.
pub const ACL_ERROR_RT_EVENT_CAPTURED: AclError = 107028;
/// `ACL_ERROR_RT_STREAM_NOT_CAPTURED`: stream is not in capture status.
pub const ACL_ERROR_RT_STREAM_NOT_CAPTURED: AclError = 107029;
/// `ACL_ERROR_RT_CAPTURE_MODE_NOT_SUPPORT`: the current capture mode does not support this operation.
pub const ACL_ERROR_RT_CAPTURE_MODE_NOT_SUPPORT: AclError = 107030;
/// `ACL_ERROR_RT_STREAM_CAPTURE_IMPLICIT`: a disallowed implicit dependency from the default stream.
pub const ACL_ERROR_RT_STREAM_CAPTURE_IMPLICIT: AclError = 107031;
/// `ACL_ERROR_RT_STREAM_CAPTURE_UNMATCHED`: the capture was not initiated in this stream.
pub const ACL_ERROR_RT_STREAM_CAPTURE_UNMATCHED: AclError = 107036;
/// `ACL_ERROR_RT_MODEL_RUNNING`: the model is still running.
pub const ACL_ERROR_RT_MODEL_RUNNING: AclError = 107037;
/// `ACL_ERROR_RT_STREAM_CAPTURE_WRONG_THREAD`: capture ended on another thread than it began.
pub const ACL_ERROR_RT_STREAM_CAPTURE_WRONG_THREAD: AclError = 107038;
/// `ACL_ERROR_RT_STREAM_CAPTURE_INVALIDATED`: capture status is invalidated.
pub const ACL_ERROR_RT_STREAM_CAPTURE_INVALIDATED: AclError = 507903;

/// `ACL_MODEL_RI_CAPTURE_MODE_GLOBAL`: no thread may call unsafe functions.
pub const ACL_MODEL_RI_CAPTURE_MODE_GLOBAL: i32 = 0;
/// `ACL_MODEL_RI_CAPTURE_MODE_THREAD_LOCAL`: the capturing thread may not call unsafe functions.
pub const ACL_MODEL_RI_CAPTURE_MODE_THREAD_LOCAL: i32 = 1;
/// `ACL_MODEL_RI_CAPTURE_MODE_RELAXED`: every thread may call unsafe functions.
pub const ACL_MODEL_RI_CAPTURE_MODE_RELAXED: i32 = 2;

/// `ACL_MODEL_RI_CAPTURE_STATUS_NONE`.
pub const ACL_MODEL_RI_CAPTURE_STATUS_NONE: i32 = 0;
/// `ACL_MODEL_RI_CAPTURE_STATUS_ACTIVE`.
pub const ACL_MODEL_RI_CAPTURE_STATUS_ACTIVE: i32 = 1;
/// `ACL_MODEL_RI_CAPTURE_STATUS_INVALIDATED`.
pub const ACL_MODEL_RI_CAPTURE_STATUS_INVALIDATED: i32 = 2;

fn mode_name(mode: i32) -> &'static str {
    match mode {
        ACL_MODEL_RI_CAPTURE_MODE_GLOBAL => "ACL_MODEL_RI_CAPTURE_MODE_GLOBAL",
        ACL_MODEL_RI_CAPTURE_MODE_THREAD_LOCAL => "ACL_MODEL_RI_CAPTURE_MODE_THREAD_LOCAL",
        _ => "ACL_MODEL_RI_CAPTURE_MODE_RELAXED",
    }
}

/// A recorded task: the call that queued it and its re-runnable job.
type Recorded = (&'static str, Arc<dyn Fn() -> SimResult<()> + Send + Sync>);

/// The capture a model is being recorded by.
struct Session {
    mode: i32,
    thread: ThreadId,
    origin: Arc<Stream>,
}

#[derive(Default)]
struct ModelState {
    tasks: Vec<Recorded>,
    /// Set between `aclmdlRICaptureBegin` and `aclmdlRICaptureEnd`.
    capture: Option<Session>,
    /// Why the capture was invalidated.
    invalid: Option<String>,
    /// Queued replays: (stream, task number).
    replays: Vec<(Arc<Stream>, u64)>,
}

/// A model runtime instance (`aclmdlRI`).
pub struct Model {
    /// Device of the stream that captured it.
    pub device: u32,
    state: Mutex<ModelState>,
}

impl std::fmt::Debug for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "aclmdlRI(device {}, {} tasks)", self.device, self.tasks())
    }
}

impl Model {
    fn lock(&self) -> MutexGuard<'_, ModelState> {
        // Every critical section leaves ModelState consistent.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Number of recorded tasks.
    pub fn tasks(&self) -> usize {
        self.lock().tasks.len()
    }

    /// True while the model is still being captured.
    pub fn capturing(&self) -> bool {
        self.lock().capture.is_some()
    }
}

/// Live models: created by `aclmdlRICaptureBegin` (so `aclmdlRICaptureGetInfo`
/// can name one during the capture), removed by `aclmdlRIDestroy` or a failed
/// `aclmdlRICaptureEnd`.
pub static MODELS: Table<Model> = Table::new("aclmdlRI", 0x5a8);

/// A stream taking part in a capture.
struct Member {
    stream: Arc<Stream>,
    model: usize,
    /// Number of model tasks up to this stream's last recorded one.
    recorded: usize,
    /// Number of model tasks up to the last of this stream's tasks that
    /// another member waited for.
    joined: usize,
}

/// An event whose latest record was captured.
struct CapturedEvent {
    event: Arc<Event>,
    model: usize,
    stream: Arc<Stream>,
    /// Number of model tasks up to the record.
    at: usize,
}

static MEMBERS: Mutex<Vec<Member>> = Mutex::new(Vec::new());
static EVENTS: Mutex<Vec<CapturedEvent>> = Mutex::new(Vec::new());

fn members() -> MutexGuard<'static, Vec<Member>> {
    // Each critical section leaves the list consistent.
    MEMBERS.lock().unwrap_or_else(|e| e.into_inner())
}

fn captured_events() -> MutexGuard<'static, Vec<CapturedEvent>> {
    // Each critical section leaves the list consistent.
    EVENTS.lock().unwrap_or_else(|e| e.into_inner())
}

fn member_of<'a>(m: &'a [Member], s: &Stream) -> Option<&'a Member> {
    m.iter().find(|x| std::ptr::eq(&*x.stream, s))
}

/// Marks the capture of model `h` invalidated (the first reason is kept).
fn invalidate(h: usize, why: &str) {
    if let Some(model) = MODELS.get(h) {
        let mut st = model.lock();
        if st.capture.is_some() && st.invalid.is_none() {
            st.invalid = Some(why.to_string());
        }
    }
}

/// Called by [`Stream::enqueue`]: records `job` when `s` captures (returns
/// None), otherwise hands it back to be queued.
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
    }
    None
}

/// Checks a call that uses stream `s` (every stream resolution of
/// [`context::stream`]):
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

/// Refuses an unsafe function `call` when a capture's mode forbids it on the
/// calling thread: GLOBAL forbids it on every thread, THREAD_LOCAL on the
/// thread that began the capture, RELAXED nowhere (`aclmdlRICaptureMode`,
/// `aclmdlRICaptureThreadExchangeMode` reference). The forbidding captures are
/// invalidated. Code `ACL_ERROR_RT_CAPTURE_MODE_NOT_SUPPORT`, as real
/// `rtMemcpy` returns it (vLLM-Ascend #6002, #10309).
pub fn unsafe_call(call: &str) -> SimResult<()> {
    let me = std::thread::current().id();
    let m = members();
    let mut hits: Vec<(usize, i32)> = Vec::new();
    for x in m.iter() {
        if hits.iter().any(|(h, _)| *h == x.model) {
            continue;
        }
        let Some(model) = MODELS.get(x.model) else { continue };
        let st = model.lock();
        if let Some(sess) = &st.capture {
            let forbids = sess.mode == ACL_MODEL_RI_CAPTURE_MODE_GLOBAL
                || (sess.mode == ACL_MODEL_RI_CAPTURE_MODE_THREAD_LOCAL && sess.thread == me);
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
        format!("{call} is not allowed while a stream captures in {}", mode_name(mode)),
    )
}

/// Hook of the blocking copy `aclrtMemcpy`: a host synchronisation, a copy,
/// and an unsafe function.
pub fn blocking_copy(dst: usize, src: usize, count: usize) -> SimResult<()> {
    counters::host_sync();
    counters::copy(dst, src, count);
    unsafe_call("aclrtMemcpy")
}

/// Hook of the blocking `aclrtMemset`: a host synchronisation and an unsafe function.
pub fn blocking_memset() -> SimResult<()> {
    counters::host_sync();
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

fn pinned(addr: usize) -> bool {
    let bufs = HOST_BUFS.lock().unwrap_or_else(|e| e.into_inner());
    bufs.range(..=addr).next_back().is_some_and(|(base, size)| addr < base + size)
}

/// Hook of `aclrtMemcpyAsync` on stream `s`: counts the copy; a host operand
/// must be page-locked (`aclrtMallocHost`) when `s` captures (guide,
/// restriction 5), and a pageable one is an unsafe function otherwise.
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
            ACL_ERROR_RT_CAPTURE_MODE_NOT_SUPPORT,
            format!(
                "aclrtMemcpyAsync on a capturing stream uses pageable host memory {host:#x}; only aclrtMallocHost \
                 memory may be captured"
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

fn event_check(call: &str, h: usize) -> SimResult<()> {
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

/// Hook of `aclrtRecordEvent`, after the record was queued on `s`: remembers
/// whether the event's latest record belongs to a capture.
pub fn record_event(e: &Arc<Event>, s: &Arc<Stream>) {
    let m = members();
    let mut ev = captured_events();
    ev.retain(|c| !Arc::ptr_eq(&c.event, e));
    if let Some(member) = member_of(&m, s) {
        ev.push(CapturedEvent { event: e.clone(), model: member.model, stream: s.clone(), at: member.recorded });
    }
}

/// Hook of `aclrtStreamWaitEvent(s, e)`. Returns true when the wait belongs to
/// a capture and must not be queued as an eager wait:
/// - `e` was recorded in a capture and `s` does not capture: `s` joins it;
/// - both in the same capture: the recording stream is joined into `s` (the
///   model's task order already puts the record first);
/// - `s` captures and `e` was recorded outside it (eagerly, or by another
///   capture): refused with `ACL_ERROR_RT_CAPTURE_DEPENDENCY`, since a replay
///   could not honour a dependency on work outside the model.
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
            if !MODELS.get(c.model).is_some_and(|x| x.capturing()) {
                return Ok(false);
            }
            m.push(Member { stream: s.clone(), model: c.model, recorded: 0, joined: 0 });
            Ok(true)
        }
        (Some(c), Some(i)) => {
            if m[i].model != c.model {
                let h = m[i].model;
                drop(ev);
                drop(m);
                invalidate(h, "a captured stream waited for an event of another capture");
                return fail(ACL_ERROR_RT_CAPTURE_DEPENDENCY, "the event was recorded by another capture");
            }
            let (at, rec) = (c.at, c.stream.clone());
            if let Some(r) = m.iter_mut().find(|x| Arc::ptr_eq(&x.stream, &rec)) {
                r.joined = r.joined.max(at);
            }
            Ok(true)
        }
    }
}

fn not_null<T>(p: *mut T, what: &str) -> SimResult<()> {
    if p.is_null() {
        return fail(ACL_ERROR_INVALID_PARAM, format!("{what} is NULL"));
    }
    Ok(())
}

fn here(s: &Stream) -> SimResult<()> {
    let cur = context::current()?;
    if s.device != cur {
        return fail(
            ACL_ERROR_RT_STREAM_CONTEXT,
            format!("the stream belongs to device {} but the current device is {cur}", s.device),
        );
    }
    Ok(())
}

/// `aclError aclmdlRICaptureBegin(aclrtStream stream, aclmdlRICaptureMode mode)`.
///
/// Refused: an unknown mode (`ACL_ERROR_INVALID_PARAM`); the default stream
/// (`ACL_ERROR_INVALID_PARAM`: torch_npu's `NPUGraph::capture_begin` requires
/// "a non-default stream", and the guide forbids the default stream during
/// capture); a stream of another device (`ACL_ERROR_RT_STREAM_CONTEXT`); a
/// stream that already captures (`ACL_ERROR_RT_STREAM_CAPTURED`).
#[no_mangle]
pub extern "C" fn aclmdlRICaptureBegin(stream: AclrtStream, mode: i32) -> AclError {
    status::acl("aclmdlRICaptureBegin", || {
        if !(ACL_MODEL_RI_CAPTURE_MODE_GLOBAL..=ACL_MODEL_RI_CAPTURE_MODE_RELAXED).contains(&mode) {
            return fail(ACL_ERROR_INVALID_PARAM, format!("unknown aclmdlRICaptureMode {mode}"));
        }
        if stream.is_null() {
            return fail(ACL_ERROR_INVALID_PARAM, "the default stream (NULL) cannot be captured");
        }
        let s = context::resolve_stream(stream as usize)?;
        here(&s)?;
        let mut m = members();
        if member_of(&m, &s).is_some() {
            return fail(ACL_ERROR_RT_STREAM_CAPTURED, "the stream is already capturing");
        }
        let session = Session { mode, thread: std::thread::current().id(), origin: s.clone() };
        let state = ModelState { capture: Some(session), ..ModelState::default() };
        let h = MODELS.insert(Arc::new(Model { device: s.device, state: Mutex::new(state) }));
        m.push(Member { stream: s, model: h, recorded: 0, joined: 0 });
        Ok(())
    })
}

/// `aclError aclmdlRICaptureGetInfo(aclrtStream stream, aclmdlRICaptureStatus *status, aclmdlRI *modelRI)`:
/// NONE (and a NULL model) for a stream that does not capture, else ACTIVE or
/// INVALIDATED and the model being recorded.
#[no_mangle]
pub unsafe extern "C" fn aclmdlRICaptureGetInfo(
    stream: AclrtStream,
    status: *mut i32,
    model_ri: *mut AclmdlRI,
) -> AclError {
    status::acl("aclmdlRICaptureGetInfo", || {
        not_null(status, "status")?;
        not_null(model_ri, "modelRI")?;
        let s = context::resolve_stream(stream as usize)?;
        let h = member_of(&members(), &s).map(|x| x.model);
        let (st, h) = match h.and_then(|h| MODELS.get(h).map(|m| (h, m))) {
            None => (ACL_MODEL_RI_CAPTURE_STATUS_NONE, 0),
            Some((h, m)) if m.lock().invalid.is_some() => (ACL_MODEL_RI_CAPTURE_STATUS_INVALIDATED, h),
            Some((h, _)) => (ACL_MODEL_RI_CAPTURE_STATUS_ACTIVE, h),
        };
        write_out(status, st, ACL_ERROR_INVALID_PARAM, "status")?;
        write_out(model_ri, h as AclmdlRI, ACL_ERROR_INVALID_PARAM, "modelRI")
    })
}

/// `aclError aclmdlRICaptureEnd(aclrtStream stream, aclmdlRI *modelRI)`.
///
/// Refused: a stream that does not capture (`ACL_ERROR_RT_STREAM_NOT_CAPTURED`);
/// a stream that joined a capture begun on another stream
/// (`ACL_ERROR_RT_STREAM_CAPTURE_UNMATCHED`; the reference: Begin and End
/// "must use the same stream"); another thread than the one that began a
/// GLOBAL or THREAD_LOCAL capture (`ACL_ERROR_RT_STREAM_CAPTURE_WRONG_THREAD`;
/// `aclmdlRICaptureEnd` reference). Otherwise the capture ends on every
/// stream taking part, and fails with `ACL_ERROR_RT_STREAM_CAPTURE_INVALIDATED`
/// when it was invalidated or `ACL_ERROR_RT_STREAM_UNJOINED` when a joined
/// stream has work the capturing stream never waited for; `*modelRI` is then
/// NULL and the model is gone.
#[no_mangle]
pub unsafe extern "C" fn aclmdlRICaptureEnd(stream: AclrtStream, model_ri: *mut AclmdlRI) -> AclError {
    status::acl("aclmdlRICaptureEnd", || {
        not_null(model_ri, "modelRI")?;
        let s = context::resolve_stream(stream as usize)?;
        here(&s)?;
        let mut m = members();
        let Some(h) = member_of(&m, &s).map(|x| x.model) else {
            return fail(ACL_ERROR_RT_STREAM_NOT_CAPTURED, "the stream is not capturing (no aclmdlRICaptureBegin)");
        };
        let model = MODELS.get(h).ok_or_else(|| SimError::new(ACL_ERROR_RT_INTERNAL_ERROR, "capture without model"))?;
        let mut st = model.lock();
        if let Some(sess) = &st.capture {
            if !Arc::ptr_eq(&sess.origin, &s) {
                return fail(
                    ACL_ERROR_RT_STREAM_CAPTURE_UNMATCHED,
                    "the capture was begun on another stream (this one joined it through an event)",
                );
            }
            if sess.mode != ACL_MODEL_RI_CAPTURE_MODE_RELAXED && sess.thread != std::thread::current().id() {
                return fail(
                    ACL_ERROR_RT_STREAM_CAPTURE_WRONG_THREAD,
                    format!("a capture begun in {} must end on the thread that began it", mode_name(sess.mode)),
                );
            }
        }
        let unjoined =
            m.iter().filter(|x| x.model == h && !Arc::ptr_eq(&x.stream, &s) && x.recorded > x.joined).count();
        m.retain(|x| x.model != h);
        st.capture = None;
        let invalid = st.invalid.clone();
        drop(st);
        drop(m);
        captured_events().retain(|c| c.model != h);
        write_out(model_ri, std::ptr::null_mut(), ACL_ERROR_INVALID_PARAM, "modelRI")?;
        if let Some(why) = invalid {
            MODELS.remove(h);
            return fail(ACL_ERROR_RT_STREAM_CAPTURE_INVALIDATED, format!("the capture was invalidated: {why}"));
        }
        if unjoined > 0 {
            MODELS.remove(h);
            return fail(
                ACL_ERROR_RT_STREAM_UNJOINED,
                format!(
                    "{unjoined} stream(s) joined the capture and queued work the capturing stream never waited for"
                ),
            );
        }
        write_out(model_ri, h as AclmdlRI, ACL_ERROR_INVALID_PARAM, "modelRI")
    })
}

fn model(h: AclmdlRI) -> SimResult<Arc<Model>> {
    MODELS.get(h as usize).ok_or_else(|| {
        SimError::new(
            ACL_ERROR_RT_INVALID_HANDLE,
            format!("{h:p} is not a live aclmdlRI (destroyed, or never captured)"),
        )
    })
}

/// `aclError aclmdlRIExecuteAsync(aclmdlRI modelRI, aclrtStream stream)`:
/// queues one task on `stream` that runs the recorded tasks in order and
/// returns. Any stream of the model's device may replay it, the default one
/// included (torch_npu `NPUGraph::replay`: "model_ri_ may be replayed in any
/// stream"). A failing recorded task fails the replay task: a sticky stream
/// error, reported by the next synchronisation like any asynchronous failure.
///
/// Refused: an unknown or destroyed model (`ACL_ERROR_RT_INVALID_HANDLE`); a
/// model still being captured (`ACL_ERROR_RT_MODEL_CAPTURED`); a stream of
/// another device (`ACL_ERROR_RT_STREAM_CONTEXT`); a capturing stream
/// (`ACL_ERROR_RT_CAPTURE_MODE_NOT_SUPPORT`: the simulator does not nest models).
#[no_mangle]
pub extern "C" fn aclmdlRIExecuteAsync(model_ri: AclmdlRI, stream: AclrtStream) -> AclError {
    status::acl("aclmdlRIExecuteAsync", || {
        let model = model(model_ri)?;
        let s = context::stream_here(stream as usize)?;
        if member_of(&members(), &s).is_some() {
            return fail(ACL_ERROR_RT_CAPTURE_MODE_NOT_SUPPORT, "a model cannot be executed on a capturing stream");
        }
        if s.device != model.device {
            return fail(
                ACL_ERROR_RT_STREAM_CONTEXT,
                format!("the model was captured on device {}, the stream belongs to device {}", model.device, s.device),
            );
        }
        let tasks = {
            let st = model.lock();
            if st.capture.is_some() {
                return fail(
                    ACL_ERROR_RT_MODEL_CAPTURED,
                    "the model is still being captured (aclmdlRICaptureEnd first)",
                );
            }
            st.tasks.clone()
        };
        let seq = s.enqueue(
            "aclmdlRIExecuteAsync",
            Box::new(move || {
                for (i, (name, job)) in tasks.iter().enumerate() {
                    job().map_err(|e| SimError::new(e.code, format!("task {i} of the model ({name}): {}", e.msg)))?;
                }
                Ok(())
            }),
        );
        let mut st = model.lock();
        st.replays.retain(|(q, n)| q.done() < *n);
        st.replays.push((s, seq));
        Ok(())
    })
}

/// `aclError aclmdlRIDestroy(aclmdlRI modelRI)`.
///
/// Refused: an unknown or destroyed model (`ACL_ERROR_RT_INVALID_HANDLE`); a
/// model still being captured (`ACL_ERROR_RT_MODEL_CAPTURED`); a model with a
/// replay that has not finished (`ACL_ERROR_RT_MODEL_RUNNING`, "the model is
/// still running"; in lazy stream mode a replay nothing waited for has not run).
#[no_mangle]
pub extern "C" fn aclmdlRIDestroy(model_ri: AclmdlRI) -> AclError {
    status::acl("aclmdlRIDestroy", || {
        let model = model(model_ri)?;
        let st = model.lock();
        if st.capture.is_some() {
            return fail(ACL_ERROR_RT_MODEL_CAPTURED, "the model is still being captured (aclmdlRICaptureEnd first)");
        }
        if st.replays.iter().any(|(s, n)| s.done() < *n) {
            return fail(
                ACL_ERROR_RT_MODEL_RUNNING,
                "a replay of the model has not finished (synchronize its stream first)",
            );
        }
        drop(st);
        MODELS.remove(model_ri as usize);
        Ok(())
    })
}

/// `aclError aclrtSynchronizeDevice(void)`: runs the queued work of every
/// stream of the current device and returns the first sticky error. A host
/// synchronisation; refused with `ACL_ERROR_RT_STREAM_CAPTURED` while a stream
/// of the device captures, which invalidates those captures (guide,
/// restriction 2: device synchronisation is illegal in every mode).
#[no_mangle]
pub extern "C" fn aclrtSynchronizeDevice() -> AclError {
    status::acl("aclrtSynchronizeDevice", || {
        counters::host_sync();
        let d = context::current()?;
        let mut capturing: Vec<usize> = members().iter().filter(|x| x.stream.device == d).map(|x| x.model).collect();
        capturing.dedup();
        if !capturing.is_empty() {
            for h in capturing {
                invalidate(h, "aclrtSynchronizeDevice was called during the capture");
            }
            return fail(ACL_ERROR_RT_STREAM_CAPTURED, format!("a stream of device {d} is capturing"));
        }
        let mut first = Ok(());
        for s in context::device_streams(d) {
            let r = s.synchronize(None);
            if first.is_ok() {
                first = r;
            }
        }
        first
    })
}
