//! The transport's error type.
//!
//! A failed collective names the collective, the group, this rank, the group
//! size and what went wrong (the disagreeing ranks and their sizes, the peer
//! that failed, the ranks that did not arrive). Argument errors name the
//! function and the argument.

/// Result alias of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Why a collective failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// Ranks called different collectives (kind, count, dtype, root, op, tag).
    Mismatch,
    /// A peer did not arrive within the timeout.
    Timeout,
    /// A peer died, left or aborted the group.
    PeerFailed,
    /// Rendezvous / group construction was invalid.
    Setup,
}

/// Everything that can go wrong in the transport.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Error {
    /// An argument has a value the call does not accept.
    InvalidArgument {
        /// The function that rejected it.
        op: &'static str,
        /// The argument name.
        arg: &'static str,
        /// What was wrong.
        reason: String,
    },
    /// A collective failed on this rank.
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
        /// The kind of failure.
        kind: ErrorKind,
    },
    /// An operating-system call failed.
    Io {
        /// What was being done.
        what: String,
        /// The OS error text.
        msg: String,
    },
}

impl Error {
    /// Shorthand for [`Error::InvalidArgument`].
    pub fn invalid(op: &'static str, arg: &'static str, reason: impl Into<String>) -> Self {
        Error::InvalidArgument { op, arg, reason: reason.into() }
    }

    /// The last OS error, described by `what`.
    pub(crate) fn os(what: impl Into<String>) -> Self {
        Error::Io { what: what.into(), msg: std::io::Error::last_os_error().to_string() }
    }

    /// The failure kind of a collective error.
    pub fn kind(&self) -> Option<ErrorKind> {
        match self {
            Error::Comm { kind, .. } => Some(*kind),
            _ => None,
        }
    }
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Error::InvalidArgument { op, arg, reason } => write!(f, "{op}: invalid argument `{arg}`: {reason}"),
            Error::Comm { collective, group, rank, world, detail, .. } => {
                write!(f, "{collective} on group {group:?} (rank {rank} of {world}): {detail}")
            }
            Error::Io { what, msg } => write!(f, "{what}: {msg}"),
        }
    }
}

impl std::error::Error for Error {}
