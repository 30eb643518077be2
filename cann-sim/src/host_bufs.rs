//! The table of host buffers `aclrtMallocHost` handed out: address -> size.
//!
//! A leaf: the ACL exports fill and empty it, the memset rule and the graph
//! capture's page-locked check read it, and so does the leak report, none of
//! them through another.

use std::collections::BTreeMap;
use std::sync::{Mutex, MutexGuard};

/// Host buffers from `aclrtMallocHost`: address -> size.
pub static HOST_BUFS: Mutex<BTreeMap<usize, usize>> = Mutex::new(BTreeMap::new());

/// The table, locked.
pub fn host_bufs() -> MutexGuard<'static, BTreeMap<usize, usize>> {
    // Each critical section is one insert, remove or read: poisoning cannot
    // leave the map half-updated.
    HOST_BUFS.lock().unwrap_or_else(|e| e.into_inner())
}
