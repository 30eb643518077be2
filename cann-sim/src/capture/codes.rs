//! The error codes, capture modes and capture statuses of the capture API.

use std::ffi::c_void;

use crate::ffi::*;

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
/// `ACL_ERROR_STREAM_CAPTURE_CONFLICT`: the event and the stream belong to
/// different captures (`rt_error_codes.h:53`, `errcode_manage.cc:161`).
pub const ACL_ERROR_STREAM_CAPTURE_CONFLICT: AclError = 107032;
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

pub(super) fn mode_name(mode: i32) -> &'static str {
    match mode {
        ACL_MODEL_RI_CAPTURE_MODE_GLOBAL => "ACL_MODEL_RI_CAPTURE_MODE_GLOBAL",
        ACL_MODEL_RI_CAPTURE_MODE_THREAD_LOCAL => "ACL_MODEL_RI_CAPTURE_MODE_THREAD_LOCAL",
        _ => "ACL_MODEL_RI_CAPTURE_MODE_RELAXED",
    }
}
/// `ACL_ERROR_RT_MODEL_CONTEXT`: model not in current context
/// (`include/external/acl/error_codes/rt_error_codes.h:25`, v8.5.0).
pub const ACL_ERROR_RT_MODEL_CONTEXT: AclError = 107004;
