//! Error values, the thread-local "recent error" text of `aclGetRecentErrMsg`,
//! and the panic boundary every export runs inside.

use std::cell::RefCell;
use std::ffi::{c_char, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};

use crate::ffi::*;

/// A failed call: the numeric code to return and a message for
/// `aclGetRecentErrMsg`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SimError {
    /// The code (an `aclError`, `HcclResult` or `aclnnStatus`, by family).
    pub code: i32,
    /// What was wrong.
    pub msg: String,
}

impl SimError {
    /// A new error.
    pub fn new(code: i32, msg: impl Into<String>) -> Self {
        SimError { code, msg: msg.into() }
    }
}

/// Result of a simulated call.
pub type SimResult<T> = Result<T, SimError>;

/// Shorthand: `Err(SimError::new(code, msg))`.
pub fn fail<T>(code: i32, msg: impl Into<String>) -> SimResult<T> {
    Err(SimError::new(code, msg))
}

thread_local! {
    static RECENT: RefCell<CString> = RefCell::new(CString::default());
}

/// Records `msg` as this thread's most recent error text.
pub fn set_recent(msg: &str) {
    let c = CString::new(msg.replace('\0', " ")).unwrap_or_default();
    RECENT.with(|r| *r.borrow_mut() = c);
}

/// Whether this thread has no recent error text.
pub fn recent_is_empty() -> bool {
    RECENT.with(|r| r.borrow().as_bytes().is_empty())
}

/// Pointer to this thread's most recent error text; valid until the next
/// simulated call on this thread.
pub fn recent_ptr() -> *const c_char {
    RECENT.with(|r| r.borrow().as_ptr())
}

fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "unknown panic".to_string()
    }
}

/// Reads the configuration before a call runs, so that a configuration the
/// simulator refuses (an unknown `CANNSIM_CANN_VERSION`) fails every call that
/// can fail, `aclInit` included, with the message naming it, not only the calls
/// that happen to read it.
fn configured<T>(f: impl FnOnce() -> T) -> impl FnOnce() -> T {
    move || {
        crate::config::get();
        f()
    }
}

/// Runs `f` for the export `call`; converts an error to its code (recording the
/// message) and a panic to `panic_code`. Nothing unwinds past this function.
pub fn guard(call: &'static str, panic_code: i32, f: impl FnOnce() -> SimResult<()>) -> i32 {
    match catch_unwind(AssertUnwindSafe(configured(f))) {
        Ok(Ok(())) => 0,
        Ok(Err(e)) => {
            set_recent(&format!("{call}: {}", e.msg));
            crate::config::trace(&format!("{call} -> {}: {}", e.code, e.msg));
            e.code
        }
        Err(p) => {
            set_recent(&format!("{call}: internal error in the simulator: {}", panic_text(&*p)));
            panic_code
        }
    }
}

thread_local! {
    static LAST_ERROR: std::cell::Cell<AclError> = const { std::cell::Cell::new(0) };
}

/// ACL-family boundary (panics become `ACL_ERROR_RT_INTERNAL_ERROR`). A
/// failure is also kept as the thread's last error, which
/// `aclrtGetLastError` / `aclrtPeekAtLastError` report.
pub fn acl(call: &'static str, f: impl FnOnce() -> SimResult<()>) -> AclError {
    let code = guard(call, ACL_ERROR_RT_INTERNAL_ERROR, f);
    if code != 0 {
        LAST_ERROR.with(|e| e.set(code));
    }
    code
}

/// The thread's last ACL error; `clear` resets it (`aclrtGetLastError`).
pub fn last_error(clear: bool) -> AclError {
    LAST_ERROR.with(|e| if clear { e.replace(0) } else { e.get() })
}

/// HCCL-family boundary (panics become `HCCL_E_INTERNAL`).
pub fn hccl(call: &'static str, f: impl FnOnce() -> SimResult<()>) -> HcclResult {
    guard(call, HCCL_E_INTERNAL, f)
}

/// aclnn-family boundary (panics become `ACLNN_ERR_INNER`).
pub fn aclnn(call: &'static str, f: impl FnOnce() -> SimResult<()>) -> AclnnStatus {
    guard(call, ACLNN_ERR_INNER, f)
}

/// Boundary for exports returning a pointer: an error or a panic yields null.
pub fn ptr<T>(call: &'static str, f: impl FnOnce() -> SimResult<*mut T>) -> *mut T {
    match catch_unwind(AssertUnwindSafe(configured(f))) {
        Ok(Ok(p)) => p,
        Ok(Err(e)) => {
            set_recent(&format!("{call}: {}", e.msg));
            crate::config::trace(&format!("{call} -> NULL: {}", e.msg));
            std::ptr::null_mut()
        }
        Err(p) => {
            set_recent(&format!("{call}: internal error in the simulator: {}", panic_text(&*p)));
            std::ptr::null_mut()
        }
    }
}

/// Boundary for the exports that report no failure of their own and must keep
/// answering whatever the configuration (`aclGetRecentErrMsg`, which carries
/// the other calls' messages, `HcclGetErrorString`, `cannsim_counters_reset`):
/// the configuration is not read, and a panic yields `fallback`.
pub fn infallible<T>(call: &'static str, fallback: T, f: impl FnOnce() -> T) -> T {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(v) => v,
        Err(p) => {
            set_recent(&format!("{call}: internal error in the simulator: {}", panic_text(&*p)));
            fallback
        }
    }
}

/// Writes `v` through the out-pointer `p` (`arg` names it in the error).
pub(crate) fn write_out<T>(p: *mut T, v: T, code: i32, arg: &str) -> SimResult<()> {
    if p.is_null() {
        return fail(code, format!("{arg} is NULL"));
    }
    // SAFETY: the caller passed a non-null out-pointer to a T, as the C
    // signature requires; we write one T.
    unsafe { p.write(v) };
    Ok(())
}
