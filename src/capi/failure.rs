//! Why an export failed ([`Failure`]: a status code and a message), the
//! stable status code of every [`Error`], and the writers of an export's
//! out-pointer arguments. The leaf of the export machinery: [`super::ffi`]
//! and [`super::handle`] both build on it.

use super::types::amoe_status;
use crate::error::CommErrorKind;
use crate::Error;

/// Why an export failed: a status code plus the message `amoe_last_error_message` returns.
#[derive(Debug, Clone)]
pub(crate) struct Failure {
    pub(crate) status: amoe_status,
    pub(crate) msg: String,
}

impl Failure {
    pub(crate) fn new(status: amoe_status, msg: impl Into<String>) -> Self {
        Failure { status, msg: msg.into() }
    }

    pub(crate) fn null(func: &str, arg: &str) -> Self {
        Failure::new(amoe_status::NullArgument, format!("{func}: `{arg}` is NULL"))
    }

    pub(crate) fn invalid(func: &str, arg: &str, reason: impl std::fmt::Display) -> Self {
        Failure::new(amoe_status::InvalidArgument, format!("{func}: invalid argument `{arg}`: {reason}"))
    }
}

impl From<Error> for Failure {
    fn from(e: Error) -> Self {
        Failure { status: status_of(&e), msg: e.to_string() }
    }
}

/// The stable status code of every [`Error`] variant.
///
/// The match is exhaustive on purpose: a new variant does not compile until it
/// has a code here (and in the header).
pub(crate) fn status_of(e: &Error) -> amoe_status {
    match e {
        Error::InvalidArgument { .. } => amoe_status::InvalidArgument,
        Error::Shape { .. } => amoe_status::Shape,
        Error::DType { .. } => amoe_status::Dtype,
        Error::IndexOutOfRange { .. } => amoe_status::IndexOutOfRange,
        Error::Device { .. } => amoe_status::Device,
        Error::Comm { kind, .. } => match kind {
            CommErrorKind::Mismatch => amoe_status::CommMismatch,
            CommErrorKind::Timeout => amoe_status::CommTimeout,
            CommErrorKind::PeerFailed => amoe_status::CommPeerFailed,
            CommErrorKind::Setup => amoe_status::CommSetup,
        },
        Error::Acl { .. } => amoe_status::Acl,
        Error::Hccl { .. } => amoe_status::Hccl,
        Error::Aclnn { .. } => amoe_status::Aclnn,
        Error::HostMemory { .. } => amoe_status::HostMemory,
        Error::Unavailable(_) => amoe_status::Unavailable,
        Error::Io { .. } => amoe_status::Io,
        Error::Kernel { .. } => amoe_status::Kernel,
        Error::StaleContext { .. } => amoe_status::StaleContext,
    }
}

/// Writes `v` through an out-pointer argument of an export, already checked
/// non-null by `try_out!`.
pub(crate) fn write_out<T>(p: *mut T, v: T) {
    // SAFETY: `p` is an out-pointer argument of the export, non-null, and by
    // the export's contract aligned and writable for a `T`.
    unsafe { p.write(v) }
}

/// Copies `src` to a list out-pointer argument of an export, already checked
/// non-null and holding at least `src.len()` elements.
pub(crate) fn write_slice<T: Copy>(p: *mut T, src: &[T]) {
    // SAFETY: `p` is an out-pointer argument of the export, non-null, and by
    // the export's contract writable for the `src.len()` elements the caller
    // checked it holds; `src` is memory of ours, so they do not overlap.
    unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), p, src.len()) }
}
