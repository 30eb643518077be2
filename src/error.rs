//! The crate's one error type.
//!
//! Every variant names what was wrong: the op or collective, the argument, the
//! expected and the actual value. Vendor failures keep the call name, the
//! numeric code and the vendor's own message as typed fields.

use crate::types::DType;

/// Result alias used throughout the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in ascend-moe.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An argument has a value the op does not accept.
    #[error("{op}: invalid argument `{arg}`: {reason}")]
    InvalidArgument {
        /// The op or function that rejected it.
        op: &'static str,
        /// The argument name.
        arg: &'static str,
        /// What was wrong.
        reason: String,
    },
    /// A tensor has the wrong shape.
    #[error("{op}: `{arg}` has shape {actual:?}, expected {expected}")]
    Shape {
        /// The op.
        op: &'static str,
        /// The argument name.
        arg: &'static str,
        /// The expected shape, described.
        expected: String,
        /// The actual shape.
        actual: Vec<usize>,
    },
    /// A tensor has the wrong dtype.
    #[error("{op}: `{arg}` has dtype {actual}, expected {expected}")]
    DType {
        /// The op.
        op: &'static str,
        /// The argument name.
        arg: &'static str,
        /// The expected dtype(s), described.
        expected: String,
        /// The actual dtype.
        actual: DType,
    },
    /// An index tensor holds a value outside its valid range.
    #[error("{op}: `{arg}`[{position}] = {value} is out of range {valid}")]
    IndexOutOfRange {
        /// The op.
        op: &'static str,
        /// The index tensor.
        arg: &'static str,
        /// Flat position of the offending entry.
        position: usize,
        /// The offending value.
        value: i64,
        /// The valid range, described (e.g. `[0, 4096)`).
        valid: String,
    },
    /// A tensor lives on a device the op cannot use with the others.
    #[error("{op}: `{arg}` is on {actual}, expected {expected}")]
    Device {
        /// The op.
        op: &'static str,
        /// The argument name.
        arg: &'static str,
        /// The expected device.
        expected: String,
        /// The actual device.
        actual: String,
    },
    /// A collective failed: mismatched calls across ranks, a timeout, a dead peer,
    /// or a bad rendezvous.
    #[error("{collective} on group {group:?} (rank {rank} of {world}): {detail}")]
    Comm {
        /// The collective (`all_reduce`, `rendezvous`, ...).
        collective: String,
        /// The group name.
        group: String,
        /// This rank within the group.
        rank: usize,
        /// The group size.
        world: usize,
        /// What went wrong, naming the ranks and sizes involved.
        detail: String,
        /// The kind of failure, for status codes.
        kind: CommErrorKind,
    },
    /// An ACL runtime call failed.
    #[error("{call} failed: ACL error {code}: {msg}")]
    Acl {
        /// The C function.
        call: &'static str,
        /// `aclError` value.
        code: i32,
        /// `aclGetRecentErrMsg()` text, if any.
        msg: String,
    },
    /// An HCCL call failed.
    #[error("{call} failed: HCCL error {code}: {msg}")]
    Hccl {
        /// The C function.
        call: &'static str,
        /// `HcclResult` value.
        code: i32,
        /// `HcclGetErrorString()` text, if any.
        msg: String,
    },
    /// An aclnn operator call failed.
    #[error("{call} failed: aclnn status {code}: {msg}")]
    Aclnn {
        /// The C function.
        call: &'static str,
        /// `aclnnStatus` value.
        code: i32,
        /// The vendor message, if any.
        msg: String,
    },
    /// Host memory could not be allocated: the system refused it (a limit on
    /// the process's address space or memory, or none left). Device memory
    /// the ACL runtime refuses is [`Error::Acl`], with ACL's code.
    #[error("{op}: {bytes} bytes of host memory could not be allocated")]
    HostMemory {
        /// The op or function that needed it.
        op: &'static str,
        /// The size it asked for.
        bytes: usize,
    },
    /// A runtime library (CANN) could not be loaded.
    #[error("{0}")]
    Unavailable(String),
    /// An operating-system call failed (shared memory, files).
    #[error("{what}: {msg}")]
    Io {
        /// What was being done.
        what: String,
        /// The OS error text.
        msg: String,
    },
    /// A native kernel failed in a way that is not bad input: a fault it
    /// reported itself, or a hardware rule its host simulation enforces
    /// (unified-buffer capacity, copy alignment, queue discipline).
    #[error("{kernel} kernel, block {block}: {detail}")]
    Kernel {
        /// The kernel.
        kernel: &'static str,
        /// The core (block index) that reported it.
        block: u32,
        /// What went wrong.
        detail: String,
    },
    /// Work captured for one forward context ran under another: the live
    /// context the engine set before a graph replay differs from the one the
    /// graph's ops were captured for, so their layout or reductions no
    /// longer apply. Found on the device, reported at the next stream check.
    #[error("{op}: the forward context changed since these ops were captured: {field} is {live}, the graph was captured for {captured}; capture a graph for this context or set the context it was captured for")]
    StaleContext {
        /// The captured op (or layer) whose guard found it.
        op: &'static str,
        /// The context field that differs.
        field: String,
        /// Its value when the ops were captured.
        captured: String,
        /// Its live value.
        live: String,
    },
}

/// Why a collective failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CommErrorKind {
    /// Ranks called different collectives (kind, count, dtype, root, op).
    Mismatch,
    /// A peer did not arrive within the timeout.
    Timeout,
    /// A peer died or aborted the group.
    PeerFailed,
    /// Rendezvous / group construction was invalid.
    Setup,
}

impl Error {
    /// Shorthand for [`Error::InvalidArgument`].
    pub fn invalid(op: &'static str, arg: &'static str, reason: impl Into<String>) -> Self {
        Error::InvalidArgument { op, arg, reason: reason.into() }
    }

    /// Shorthand for [`Error::Shape`].
    pub fn shape(op: &'static str, arg: &'static str, expected: impl Into<String>, actual: &[usize]) -> Self {
        Error::Shape { op, arg, expected: expected.into(), actual: actual.to_vec() }
    }

    /// Shorthand for [`Error::DType`].
    pub fn dtype(op: &'static str, arg: &'static str, expected: impl Into<String>, actual: DType) -> Self {
        Error::DType { op, arg, expected: expected.into(), actual }
    }

    /// Wraps an OS error.
    pub fn io(what: impl Into<String>, err: impl std::fmt::Display) -> Self {
        Error::Io { what: what.into(), msg: err.to_string() }
    }
}

/// Parsing a dtype name lives here, with [`Error`], so that [`crate::types`]
/// stays a leaf.
impl std::str::FromStr for DType {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        DType::EVERY.into_iter().find(|d| d.name().eq_ignore_ascii_case(s)).ok_or_else(|| {
            let names: Vec<&str> = DType::EVERY.iter().map(|d| d.name()).collect();
            Error::invalid(
                "DType::from_str",
                "dtype",
                format!("unknown dtype {s:?} (expected one of {})", names.join(", ")),
            )
        })
    }
}
