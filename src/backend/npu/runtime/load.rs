//! Loading the ACL runtime, mapping its error codes (the result layer,
//! [`crate::backend::npu::result`], calls through these), and the errors of
//! `Drop`s.

use std::ffi::CStr;
use std::sync::{Mutex, OnceLock};

use acl_sys::{aclError, Acl};

use crate::{Error, Result};

/// The loaded ACL runtime, or [`Error::Unavailable`] naming every path tried.
pub fn acl() -> Result<&'static Acl> {
    acl_sys::acl().map_err(|e| Error::Unavailable(e.to_string()))
}

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
/// memory or a handle. The release goes on only when the wait returned, or
/// failed because the stream's work ended: a runtime error of a task
/// (`ACL_ERROR_RT_*` 5xxxxx: a stream whose task failed runs nothing more,
/// its later tasks are skipped and every sync returns the error) or an
/// aborted device or stream (`ACL_ERROR_RT_DEVICE_TASK_ABORT`,
/// `ACL_ERROR_RT_STREAM_ABORT`); that error is recorded. Every other
/// failure stops the release, which then leaks rather than frees under
/// work that may still run: a timeout, a wait that was refused (1xxxxx: a
/// stream being captured answers `ACL_ERROR_RT_STREAM_CAPTURED`, and its
/// queued work still runs; 2xxxxx resource errors), a capture invalidated
/// meanwhile, an internal error of the runtime or driver (the wait itself
/// may have failed), or an error that is not the runtime's.
pub(crate) fn settled(r: Result<()>) -> Result<()> {
    match r {
        Ok(()) => Ok(()),
        Err(e @ Error::Acl { code, .. }) if task_failed(code) => {
            record_drop_error(e);
            Ok(())
        }
        Err(e) => Err(e),
    }
}

/// Whether a synchronisation's `code` says a task of the stream failed (the
/// stream runs nothing more), rather than that the wait did not happen or
/// did not finish. The classes are those of hicann/runtime v8.5.0
/// `include/external/acl/error_codes/rt_error_codes.h`: 1xxxxx arguments and
/// states (`:21` param invalid, `:43-44` device task and stream aborting),
/// 2xxxxx resources (`:61-65`), 5xxxxx execution (`:82` runtime internal
/// error, `:97` aicore exception, ...).
fn task_failed(code: aclError) -> bool {
    const STILL_RUNS: [i32; 7] = [
        acl_sys::ACL_ERROR_RT_STREAM_SYNC_TIMEOUT,
        acl_sys::ACL_ERROR_RT_EVENT_SYNC_TIMEOUT,
        acl_sys::ACL_ERROR_RT_STREAM_NOT_COMPLETE,
        acl_sys::ACL_ERROR_RT_EVENT_NOT_COMPLETE,
        acl_sys::ACL_ERROR_RT_STREAM_CAPTURE_INVALIDATED,
        acl_sys::ACL_ERROR_RT_INTERNAL_ERROR,
        acl_sys::ACL_ERROR_RT_DRV_INTERNAL_ERROR,
    ];
    const ABORTED: [i32; 2] = [acl_sys::ACL_ERROR_RT_DEVICE_TASK_ABORT, acl_sys::ACL_ERROR_RT_STREAM_ABORT];
    ABORTED.contains(&code) || ((500_000..600_000).contains(&code) && !STILL_RUNS.contains(&code))
}

/// Returns and clears the errors recorded while dropping NPU handles.
pub fn take_drop_errors() -> Vec<Error> {
    drop_error_log().lock().map(|mut l| std::mem::take(&mut *l)).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn acl(code: i32) -> Result<()> {
        Err(Error::Acl { call: "aclrtSynchronizeStreamWithTimeout", code, msg: String::new() })
    }

    /// A drop releases only after its wait returned or a task of the stream
    /// failed; a wait that was refused or did not finish releases nothing.
    #[test]
    fn a_drop_releases_only_after_its_stream_finished_or_failed() {
        assert!(task_failed(acl_sys::ACL_ERROR_RT_AICORE_EXCEPTION));
        assert!(task_failed(acl_sys::ACL_ERROR_RT_COMM_OP_RETRY_FAIL));
        assert!(task_failed(acl_sys::ACL_ERROR_RT_STREAM_ABORT));
        assert!(task_failed(acl_sys::ACL_ERROR_RT_DEVICE_TASK_ABORT));
        for still_runs in [
            acl_sys::ACL_ERROR_RT_STREAM_CAPTURED,
            acl_sys::ACL_ERROR_RT_PARAM_INVALID,
            acl_sys::ACL_ERROR_RT_STREAM_SYNC_TIMEOUT,
            acl_sys::ACL_ERROR_RT_STREAM_CAPTURE_INVALIDATED,
            acl_sys::ACL_ERROR_RT_MEMORY_ALLOCATION,
            acl_sys::ACL_ERROR_RT_INTERNAL_ERROR,
            acl_sys::ACL_ERROR_RT_DRV_INTERNAL_ERROR,
        ] {
            assert!(!task_failed(still_runs), "{still_runs}");
            assert!(settled(acl(still_runs)).is_err(), "{still_runs}");
        }
        assert!(settled(Ok(())).is_ok());
        assert!(settled(Err(Error::invalid("drop", "stream", "captured"))).is_err());
    }
}
