//! The process-wide locks a child made by `fork` must find unlocked.
//!
//! `fork` copies only the calling thread: a lock another thread held at that
//! moment stays locked in the child, by no one, and the child's first use of
//! it waits for ever. The C ABI's handle table (every handle made or
//! released) and the host pool's free list (every result of 1 MiB or more)
//! are taken briefly by any thread, so an engine that forks workers (Python's
//! `multiprocessing`, a DataLoader) while another thread calls the library
//! would leave such a child hung. Each registers how to take its lock
//! ([`watch`], at its first use); around `fork` the forking thread takes them
//! all (`pthread_atfork`'s prepare handler, waiting for the threads that hold
//! them, which hold them only for a few statements) and lets go of them in
//! the parent and in the child.

use std::any::Any;
use std::cell::RefCell;
use std::sync::{Once, OnceLock};

/// Takes a lock and returns its guard.
pub(crate) type Take = fn() -> Box<dyn Any>;

/// The slot of the C ABI's handle table.
pub(crate) const HANDLES: usize = 0;
/// The slot of the host pool's free list.
pub(crate) const HOST_POOL: usize = 1;

/// How to take each lock, by slot (taken in slot order).
static TAKE: [OnceLock<Take>; 2] = [OnceLock::new(), OnceLock::new()];

thread_local! {
    /// The guards the forking thread holds across `fork`.
    static HELD: RefCell<Vec<Box<dyn Any>>> = const { RefCell::new(Vec::new()) };
}

extern "C" fn prepare() {
    let guards = TAKE.iter().filter_map(|t| t.get().map(|take| take())).collect();
    HELD.with(|h| *h.borrow_mut() = guards);
}

extern "C" fn release() {
    HELD.with(|h| h.borrow_mut().clear());
}

/// Registers `take` for the lock of `slot`, and the handlers (once per
/// process); called at each use of the lock, so cheap once registered.
pub(crate) fn watch(slot: usize, take: Take) {
    static ONCE: Once = Once::new();
    TAKE[slot].get_or_init(|| take);
    // SAFETY: the handlers run in the forking thread, around `fork`: they
    // only take and drop locks of this crate (which other threads hold for a
    // few statements at a time, never while waiting on the forking thread).
    ONCE.call_once(|| unsafe {
        libc::pthread_atfork(Some(prepare), Some(release), Some(release));
    });
}
