//! The result layer: every ACL, HCCL and aclnn C function the crate calls,
//! wrapped once.
//!
//! A wrapper resolves its symbol (a symbol the loaded release lacks is
//! [`Error::Unavailable`] naming it and the
//! library), calls it and turns the status into a [`Result`]
//! carrying the vendor code and message; out-parameters are return values.
//! Wrappers that take raw pointers or handles are `unsafe`: their validity is
//! the caller's job. Nothing here owns anything: the safe types of
//! `runtime`, `memory` and `hccl` ([`NpuStream`](super::NpuStream),
//! [`NpuBuffer`](super::NpuBuffer), [`HcclComm`](super::HcclComm), ...) are
//! built on these functions alone.
//!
//! | module | wraps |
//! |---|---|
//! | [`acl`] | `libascendcl` (and the simulated runtime's kernel launchers) |
//! | [`hccl`] | `libhccl` |
//! | [`aclnn`] | `libnnopbase` and the operators of `libopapi` |

pub mod acl;
pub mod aclnn;
pub mod hccl;

use std::ffi::OsStr;

use crate::{Error, Result};

/// The function of `symbol`, or [`Error::Unavailable`] saying that the
/// library at `path` does not export `name`.
fn require<'a, T, E>(symbol: &'a std::result::Result<T, E>, name: &str, path: &OsStr) -> Result<&'a T> {
    symbol.as_ref().map_err(|_| Error::Unavailable(format!("{name} is not exported by {}", path.to_string_lossy())))
}

/// `sym!(api, aclrtMalloc)`: [`require`] (in scope where it is used) on the
/// field of `api.lib` of that name, for a loaded library `api` with an `origin`.
macro_rules! sym {
    ($api:expr, $name:ident) => {
        require(&$api.lib.$name, stringify!($name), &$api.origin.path)
    };
}
use sym;

/// `status_fns! { lib, check; /// docs  pub unsafe fn name = CSymbol(arg: Type, ...); ... }`:
/// wrappers of calls whose only result is a status. Each resolves `CSymbol`
/// in `lib()`, calls it with its arguments and maps the status with
/// `check("CSymbol", ..)`; its `# Safety` doc states the caller's contract.
macro_rules! status_fns {
    ($lib:ident, $check:ident;
     $( $(#[$attr:meta])* $vis:vis unsafe fn $name:ident = $sym:ident ( $($arg:ident : $ty:ty),* $(,)? ); )*) => {
        $(
            $(#[$attr])*
            $vis unsafe fn $name($($arg: $ty),*) -> Result<()> {
                let f = sym!($lib()?, $sym)?;
                // SAFETY: the caller's contract (`# Safety` above).
                $check(stringify!($sym), unsafe { f($($arg),*) })
            }
        )*
    };
}
use status_fns;
