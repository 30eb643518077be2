//! Host-side call counters, per calling thread: `cannsim_counters` and
//! `cannsim_counters_reset` (simulator only).
//!
//! They let a test assert that an operation makes no host synchronisation,
//! no allocation and no host copy. A call is counted on the thread that makes
//! it, when it is made, whether it succeeds or not; work that a stream runs
//! later (a queued task, a graph replay) counts nothing.

#![allow(clippy::missing_safety_doc)]

use std::cell::Cell;

use crate::arena;
use crate::ffi::*;
use crate::status::{self, write_out};

/// `CannsimCounters`, the C struct `cannsim_counters` fills: ten
/// `uint64_t` in this order, `host_syncs` (`aclrtSynchronizeStream[WithTimeout]`,
/// `aclrtSynchronizeDevice`, `aclrtSynchronizeEvent`, `aclrtMemcpy`,
/// `aclrtMemset`), `device_mallocs`, `device_frees`, `host_mallocs`,
/// `host_frees`, `h2d_copies`, `d2h_copies` (synchronous or asynchronous) and
/// `queries` (`aclrtQueryEventStatus`), `event_creates` (`aclrtCreateEvent`,
/// `aclrtCreateEventExWithFlag`), `d2d_copies`. The one definition is acl-sys's, which
/// the crate reads them through, so the two sides cannot disagree on the layout.
pub use acl_sys::CannsimCounters;

thread_local! {
    static COUNTERS: Cell<CannsimCounters> = const {
        Cell::new(CannsimCounters {
            host_syncs: 0,
            device_mallocs: 0,
            device_frees: 0,
            host_mallocs: 0,
            host_frees: 0,
            h2d_copies: 0,
            d2h_copies: 0,
            queries: 0,
            event_creates: 0,
            d2d_copies: 0,
        })
    };
}

/// Applies `f` to the calling thread's counters.
pub fn bump(f: impl FnOnce(&mut CannsimCounters)) {
    COUNTERS.with(|c| {
        let mut v = c.get();
        f(&mut v);
        c.set(v);
    });
}

/// Counts a host synchronisation.
pub fn host_sync() {
    bump(|c| c.host_syncs += 1);
}

/// Counts a copy of `count` bytes by the direction its operands give.
pub fn copy(dst: usize, src: usize, count: usize) {
    if count == 0 {
        return;
    }
    match (arena::owner(dst).is_some(), arena::owner(src).is_some()) {
        (true, false) => bump(|c| c.h2d_copies += 1),
        (false, true) => bump(|c| c.d2h_copies += 1),
        (true, true) => bump(|c| c.d2d_copies += 1),
        (false, false) => {}
    }
}

/// The calling thread's counters.
pub fn get() -> CannsimCounters {
    COUNTERS.with(|c| c.get())
}

/// `int32_t cannsim_counters(CannsimCounters *out)`: writes the calling
/// thread's counters; `ACL_ERROR_INVALID_PARAM` when `out` is NULL.
#[no_mangle]
pub unsafe extern "C" fn cannsim_counters(out: *mut CannsimCounters) -> AclError {
    status::acl("cannsim_counters", || write_out(out, get(), ACL_ERROR_INVALID_PARAM, "out"))
}

/// `void cannsim_counters_reset(void)`: zeroes the calling thread's counters.
#[no_mangle]
pub extern "C" fn cannsim_counters_reset() {
    status::infallible("cannsim_counters_reset", (), || COUNTERS.with(|c| c.set(CannsimCounters::default())));
}
