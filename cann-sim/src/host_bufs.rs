//! The table of host buffers `aclrtMallocHost` handed out: address -> size
//! and allocation number.
//!
//! A leaf: the ACL exports fill and empty it, the memset rule and the graph
//! capture's page-locked check read it, and so do the leak report and the
//! operand checks of queued work ([`crate::lease`]), none of them through
//! another.

use std::collections::BTreeMap;
use std::sync::{Mutex, MutexGuard};

/// One live `aclrtMallocHost` buffer.
#[derive(Debug, Clone, Copy)]
pub struct HostBuf {
    /// Requested size in bytes.
    pub size: usize,
    /// Its number, from the counter device allocations use
    /// ([`crate::arena::next_alloc_id`]).
    pub id: u64,
}

/// Host buffers from `aclrtMallocHost`: address -> buffer.
pub static HOST_BUFS: Mutex<BTreeMap<usize, HostBuf>> = Mutex::new(BTreeMap::new());

/// The table, locked.
pub fn host_bufs() -> MutexGuard<'static, BTreeMap<usize, HostBuf>> {
    // Each critical section is one insert, remove or read: poisoning cannot
    // leave the map half-updated.
    HOST_BUFS.lock().unwrap_or_else(|e| e.into_inner())
}

/// The buffer holding host address `addr`: (its start, the buffer).
pub fn containing(addr: usize) -> Option<(usize, HostBuf)> {
    let bufs = host_bufs();
    let (&base, &b) = bufs.range(..=addr).next_back()?;
    (addr < base + b.size).then_some((base, b))
}
