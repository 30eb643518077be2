//! The `aclmdlRI*` exports and `aclrtSynchronizeDevice`.

use std::sync::{Arc, Mutex};

use crate::context;
use crate::counters;
use crate::ffi::*;
use crate::status::{self, fail, write_out, SimError, SimResult};
use crate::stream::Stream;

use super::codes::*;
use super::hooks::capture_info;
use super::state::*;

pub(super) fn not_null<T>(p: *mut T, what: &str) -> SimResult<()> {
    if p.is_null() {
        return fail(ACL_ERROR_INVALID_PARAM, format!("{what} is NULL"));
    }
    Ok(())
}

pub(super) fn here(s: &Stream) -> SimResult<()> {
    let cur = context::current()?;
    if s.device != cur {
        return fail(
            ACL_ERROR_RT_STREAM_CONTEXT,
            format!("the stream belongs to device {} but the current device is {cur}", s.device),
        );
    }
    Ok(())
}

/// A capture mode: GLOBAL, THREAD_LOCAL or RELAXED (the enum read as
/// unsigned: a negative one is out of range too).
fn check_mode(mode: i32) -> SimResult<()> {
    if !(ACL_MODEL_RI_CAPTURE_MODE_GLOBAL..=ACL_MODEL_RI_CAPTURE_MODE_RELAXED).contains(&mode) {
        return fail(
            ACL_ERROR_RT_PARAM_INVALID,
            format!("aclmdlRICaptureMode {mode} is outside GLOBAL (0) .. RELAXED (2)"),
        );
    }
    Ok(())
}

/// `aclError aclmdlRICaptureBegin(aclrtStream stream, aclmdlRICaptureMode mode)`.
///
/// Refused, in the runtime's order (hicann/runtime v8.5.0): the default
/// stream, NULL (`ACL_ERROR_INVALID_PARAM`, acl `model_ri.cpp:54`; torch_npu's
/// `NPUGraph::capture_begin` requires "a non-default stream"); a mode outside
/// GLOBAL..RELAXED (`ACL_ERROR_RT_PARAM_INVALID`: `ApiErrorDecorator::StreamBeginCapture`,
/// `api_error.cc:5700-5702`, RT_ERROR_INVALID_VALUE; `RT_STREAM_CAPTURE_MODE_MAX`
/// is 3, `pkg_inc/runtime/runtime/stream.h:66-72`); no current device
/// (`ACL_ERROR_RT_CONTEXT_NULL`, `ApiImpl::StreamBeginCapture`,
/// `api_impl.cc:7786-7787`); a stream of another device
/// (`ACL_ERROR_RT_STREAM_CONTEXT`, `:7788-7789`); a stream that already
/// captures (`ACL_ERROR_RT_STREAM_CAPTURED`, `Context::StreamBeginCapture`,
/// `context.cc:4807`).
#[no_mangle]
pub extern "C" fn aclmdlRICaptureBegin(stream: AclrtStream, mode: i32) -> AclError {
    status::acl("aclmdlRICaptureBegin", || {
        if stream.is_null() {
            return fail(ACL_ERROR_INVALID_PARAM, "the default stream (NULL) cannot be captured");
        }
        check_mode(mode)?;
        context::current()?;
        let s = context::resolve_stream(stream as usize)?;
        here(&s)?;
        let mut m = members();
        if member_of(&m, &s).is_some() {
            return fail(ACL_ERROR_RT_STREAM_CAPTURED, "the stream is already capturing");
        }
        let session = Session { mode, thread: std::thread::current().id(), origin: s.clone() };
        let state = ModelState { capture: Some(session), ..ModelState::default() };
        let h = MODELS.insert(Arc::new(Model { device: s.device, state: Mutex::new(state) }));
        // Before the first stream joins a capture, the streams' queues start
        // passing their jobs to the capture.
        crate::stream::install_interceptor(super::hooks::intercept);
        m.push(Member { stream: s, model: h, recorded: 0, joined: 0, waits_last: false });
        Ok(())
    })
}

/// `aclError aclmdlRICaptureGetInfo(aclrtStream stream, aclmdlRICaptureStatus *status, aclmdlRI *modelRI)`:
/// NONE (and a NULL model) for a stream that does not capture, else ACTIVE or
/// INVALIDATED and the model being recorded.
///
/// `aclmdlRICaptureGetInfoImpl` (hicann/runtime `src/acl/aclrt_impl/model_ri.cpp:70-92`,
/// v8.5.0): a NULL stream is `ACL_ERROR_INVALID_PARAM` (`ACL_REQUIRES_NOT_NULL(stream)`,
/// line 73; the default stream is not asked about, it never captures); one
/// of `status` and `modelRI` may be NULL, not both (lines 74-77); each
/// non-NULL one is written (lines 85-92). The query is [`capture_info`].
///
/// After those checks, `ApiImpl::StreamGetCaptureInfo` (hicann/runtime
/// `src/runtime/feature/src/api_impl/api_impl.cc:7830-7836`, v8.5.0) refuses
/// a thread without a current device (`RT_ERROR_CONTEXT_NULL`,
/// `ACL_ERROR_RT_CONTEXT_NULL`) and a stream of another device than the
/// current one (`RT_ERROR_STREAM_CONTEXT`, `ACL_ERROR_RT_STREAM_CONTEXT`,
/// `errcode_manage.cc:195`, `:110`), writing nothing; a refused query leaves
/// the capture as it is.
#[no_mangle]
pub unsafe extern "C" fn aclmdlRICaptureGetInfo(
    stream: AclrtStream,
    status: *mut i32,
    model_ri: *mut AclmdlRI,
) -> AclError {
    status::acl("aclmdlRICaptureGetInfo", || unsafe {
        // The NULL checks of model_ri.cpp:73-77 come first (`capture_info`).
        let args_ok = !stream.is_null() && (!status.is_null() || !model_ri.is_null());
        if args_ok {
            context::current()?;
            let s = context::resolve_stream(stream as usize)?;
            here(&s)?;
        }
        capture_info(stream, status, model_ri)
    })
}

/// `aclError aclmdlRICaptureThreadExchangeMode(aclmdlRICaptureMode *mode)`:
/// sets the calling thread's capture mode to `*mode` and writes the mode it
/// had into `*mode` (every thread starts in GLOBAL). The thread's mode
/// decides with the captures' modes whether its unsafe calls are refused
/// ([`super::hooks::unsafe_call`]); it outlives captures and is the thread's
/// for every device.
///
/// As hicann/runtime v8.5.0 does, in order:
/// - `mode` NULL: `ACL_ERROR_INVALID_PARAM` (`aclmdlRICaptureThreadExchangeModeImpl`,
///   `src/acl/aclrt_impl/model_ri.cpp:152`, `ACL_REQUIRES_NOT_NULL_WITH_INPUT_REPORT`);
/// - the chip lacks ACL graphs: never here, the emulated A2 has them
///   (`rtThreadExchangeCaptureMode`, `src/runtime/feature/src/api/api_c_stream.cc:614-618`);
/// - `*mode`, read as unsigned, not below `RT_STREAM_CAPTURE_MODE_MAX` (3):
///   `ACL_ERROR_RT_PARAM_INVALID` (`ApiErrorDecorator::ThreadExchangeCaptureMode`,
///   `src/runtime/feature/src/api_impl/api_error.cc:5811-5813`, RT_ERROR_INVALID_VALUE);
/// - no current device: `ACL_ERROR_RT_CONTEXT_NULL` (`ApiImpl::ThreadExchangeCaptureMode`,
///   `api_impl.cc:7918-7919`);
/// - then the swap (`Context::ThreadExchangeCaptureMode`, `context.cc:5121-5132`),
///   written back only on success (`model_ri.cpp:154-164`).
#[no_mangle]
pub unsafe extern "C" fn aclmdlRICaptureThreadExchangeMode(mode: *mut i32) -> AclError {
    status::acl("aclmdlRICaptureThreadExchangeMode", || unsafe {
        not_null(mode, "mode")?;
        let new = *mode;
        check_mode(new)?;
        context::current()?;
        *mode = THREAD_MODE.with(|m| m.replace(new));
        Ok(())
    })
}

/// `aclError aclmdlRICaptureEnd(aclrtStream stream, aclmdlRI *modelRI)`.
///
/// Refused: a NULL stream or `modelRI` (`ACL_ERROR_INVALID_PARAM`, acl
/// `model_ri.cpp:101-102`); no current device or a stream of another device
/// (`ApiImpl::StreamEndCapture`, `api_impl.cc:7800-7803`); a stream that does
/// not capture (`ACL_ERROR_RT_STREAM_NOT_CAPTURED`, `context.cc:4972`);
/// a stream that joined a capture begun on another stream
/// (`ACL_ERROR_RT_STREAM_CAPTURE_UNMATCHED`; the reference: Begin and End
/// "must use the same stream"); another thread than the one that began a
/// GLOBAL or THREAD_LOCAL capture (`ACL_ERROR_RT_STREAM_CAPTURE_WRONG_THREAD`;
/// `aclmdlRICaptureEnd` reference), which also ends the capture without a
/// model. Otherwise the capture ends on every
/// stream taking part, and fails with `ACL_ERROR_RT_STREAM_CAPTURE_INVALIDATED`
/// when it was invalidated or `ACL_ERROR_RT_STREAM_UNJOINED` when a joined
/// stream has work the capturing stream never waited for; `*modelRI` is then
/// NULL and the model is gone.
#[no_mangle]
pub unsafe extern "C" fn aclmdlRICaptureEnd(stream: AclrtStream, model_ri: *mut AclmdlRI) -> AclError {
    status::acl("aclmdlRICaptureEnd", || {
        not_null(stream, "stream (the default stream never captures)")?;
        not_null(model_ri, "modelRI")?;
        context::current()?;
        let s = context::resolve_stream(stream as usize)?;
        here(&s)?;
        let mut m = members();
        let Some(h) = member_of(&m, &s).map(|x| x.model) else {
            return fail(ACL_ERROR_RT_STREAM_NOT_CAPTURED, "the stream is not capturing (no aclmdlRICaptureBegin)");
        };
        let model = MODELS.get(h).ok_or_else(|| SimError::new(ACL_ERROR_RT_INTERNAL_ERROR, "capture without model"))?;
        let mut st = model.lock();
        let mut wrong_thread = None;
        if let Some(sess) = &st.capture {
            if !Arc::ptr_eq(&sess.origin, &s) {
                return fail(
                    ACL_ERROR_RT_STREAM_CAPTURE_UNMATCHED,
                    "the capture was begun on another stream (this one joined it through an event)",
                );
            }
            // `Context::StreamEndCapture` (hicann/runtime v8.5.0
            // `src/runtime/feature/src/context/context.cc:4983-4987`): the
            // refusal also takes the stream out of its capture
            // (`CaptureModeExit`, `ClearCaptureModel`) and no model comes of
            // it, so a later end from the right thread finds no capture
            // (RT_ERROR_STREAM_NOT_CAPTURED): the capture ends below.
            if sess.mode != ACL_MODEL_RI_CAPTURE_MODE_RELAXED && sess.thread != std::thread::current().id() {
                wrong_thread = Some(sess.mode);
            }
        }
        // A stream that joined is joined back when its last task is an event
        // record that a capturing stream waited for: work after that record,
        // or a wait after it (the last task is then the wait), leaves it
        // unjoined (hicann/runtime v8.5.0 `src/runtime/feature/src/context/
        // context.cc:4843-4893`, `Context::CheckCaptureModelValidity`, and
        // `src/runtime/feature/src/model/v100/capture_adapt.cc:49-53`: "The
        // last task type is not event record").
        let unjoined = m
            .iter()
            .filter(|x| x.model == h && !Arc::ptr_eq(&x.stream, &s) && (x.recorded > x.joined || x.waits_last))
            .count();
        m.retain(|x| x.model != h);
        st.capture = None;
        let invalid = st.invalid.clone();
        drop(st);
        drop(m);
        captured_events().retain(|c| c.model != h);
        write_out(model_ri, std::ptr::null_mut(), ACL_ERROR_INVALID_PARAM, "modelRI")?;
        if let Some(mode) = wrong_thread {
            MODELS.remove(h);
            return fail(
                ACL_ERROR_RT_STREAM_CAPTURE_WRONG_THREAD,
                format!(
                    "a capture begun in {} must end on the thread that began it; the capture ended without a model",
                    mode_name(mode)
                ),
            );
        }
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

pub(super) fn model(h: AclmdlRI) -> SimResult<Arc<Model>> {
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
/// Refused, in the runtime's order (hicann/runtime v8.5.0): a NULL model
/// (`ACL_ERROR_INVALID_PARAM`, acl `model_ri.cpp:24`); an unknown or destroyed
/// model (`ACL_ERROR_RT_INVALID_HANDLE`); a capturing stream
/// (`ACL_ERROR_RT_STREAM_CAPTURED`: `ApiErrorDecorator::ModelExecute`,
/// `api_error.cc:3132-3133`, "The stream cannot be used for model execution
/// during the capture stage"); no current device (`ApiImpl::ModelExecute`,
/// `api_impl.cc:4036-4037`); a model of another device than the current one
/// (`ACL_ERROR_RT_MODEL_CONTEXT`, `:4039-4040`, RT_ERROR_MODEL_CONTEXT,
/// `errcode_manage.cc:157`); a stream of another device
/// (`ACL_ERROR_RT_STREAM_CONTEXT`, `Model::Execute`, `model.cc:1114-1115`); a
/// model still being captured (`ACL_ERROR_RT_MODEL_CAPTURED`).
#[no_mangle]
pub extern "C" fn aclmdlRIExecuteAsync(model_ri: AclmdlRI, stream: AclrtStream) -> AclError {
    status::acl("aclmdlRIExecuteAsync", || {
        not_null(model_ri, "modelRI")?;
        let model = model(model_ri)?;
        if stream as usize != 0 {
            if let Ok(s) = context::resolve_stream(stream as usize) {
                if member_of(&members(), &s).is_some() {
                    return fail(
                        ACL_ERROR_RT_STREAM_CAPTURED,
                        "the stream is capturing: a model cannot be executed on it",
                    );
                }
            }
        }
        let cur = context::current()?;
        if model.device != cur {
            return fail(
                ACL_ERROR_RT_MODEL_CONTEXT,
                format!("the model was captured on device {} but the current device is {cur}", model.device),
            );
        }
        let s = super::hooks::stream_here(stream as usize)?;
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
/// Before those, as the runtime (v8.5.0) checks: a NULL model
/// (`ACL_ERROR_INVALID_PARAM`, acl `model_ri.cpp:39`); no current device
/// (`ApiImpl::ModelDestroy`, `api_impl.cc:3988-3989`); a model of another
/// device (`ACL_ERROR_RT_MODEL_CONTEXT`, `:3991-3992`). Captured and running:
/// `Context::ModelDestroy`, `context.cc:2918`, `:2925`.
#[no_mangle]
pub extern "C" fn aclmdlRIDestroy(model_ri: AclmdlRI) -> AclError {
    status::acl("aclmdlRIDestroy", || {
        not_null(model_ri, "modelRI")?;
        let model = model(model_ri)?;
        let cur = context::current()?;
        if model.device != cur {
            return fail(
                ACL_ERROR_RT_MODEL_CONTEXT,
                format!("the model was captured on device {} but the current device is {cur}", model.device),
            );
        }
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
