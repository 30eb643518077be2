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
