//! The allocations a queued task's operands lie in, noted when the task is
//! queued (or captured) and checked again when it runs.
//!
//! `aclrtFree` and `aclrtFreeHost` free at once and do not wait for queued
//! work (API reference `aclrtFree`), so a task queued before the free runs
//! against memory that is gone, or that a later allocation at the same
//! address now owns. Every device allocation and every `aclrtMallocHost`
//! buffer has a number never used again ([`arena::next_alloc_id`]); a task
//! whose operand's allocation is no longer the one with the noted number is
//! not run, and its stream fails with [`ACL_ERROR_RT_DEVICE_MEM_ERROR`].
//!
//! The code is the runtime's for a task that faulted on device memory:
//! hicann/runtime v8.5.0 `src/runtime/feature/src/common/error_code.cc:139`
//! (an AI Core MTE error) and `:145`, `:149` (SDMA DDRC and poison errors,
//! the copy engine's) become `RT_ERROR_DEVICE_MEM_ERROR` /
//! `RT_ERROR_SDMA_POISON_ERROR`, both reported as
//! `ACL_ERROR_RT_DEVICE_MEM_ERROR` (`errcode_manage.cc:100-101`). Stricter
//! than the hardware: when the address was allocated again, the real task
//! writes into the new owner's bytes and nothing is reported.
//!
//! Pageable host memory has no allocation the simulator knows, so it is not
//! checked.

use crate::arena;
use crate::ffi::*;
use crate::host_bufs;
use crate::status::{fail, SimResult};

/// Where a leased operand lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Place {
    Device(u32),
    PinnedHost,
}

/// One operand of a queued task: `len` bytes at `addr`, inside the
/// allocation that starts at `base` and had number `id` when the task was
/// queued.
#[derive(Debug, Clone)]
pub struct Lease {
    what: String,
    addr: usize,
    len: usize,
    base: usize,
    id: u64,
    place: Place,
}

impl Lease {
    /// The lease of a device access already checked by [`arena::resolve_ext`].
    pub fn device(span: &arena::Span, what: impl Into<String>) -> Lease {
        Lease {
            what: what.into(),
            addr: span.addr,
            len: span.len,
            base: span.base,
            id: span.id,
            place: Place::Device(span.device),
        }
    }

    /// The lease of host address `addr` when it lies in an `aclrtMallocHost`
    /// buffer; None for pageable memory.
    pub fn pinned(addr: usize, len: usize, what: impl Into<String>) -> Option<Lease> {
        let (base, b) = host_bufs::containing(addr)?;
        Some(Lease { what: what.into(), addr, len, base, id: b.id, place: Place::PinnedHost })
    }

    /// The lease of operand `addr` (`len` bytes) wherever it lives: device
    /// memory (checked to lie in one live allocation), an `aclrtMallocHost`
    /// buffer, or None for pageable host memory.
    pub fn of(addr: usize, len: usize, what: &str) -> SimResult<Option<Lease>> {
        if arena::owner(addr).is_some() {
            return Ok(Some(Lease::device(&arena::resolve(addr, len, what)?, what)));
        }
        Ok(Lease::pinned(addr, len, what))
    }

    /// Ok while the allocation is still the one the task was queued against.
    pub fn check(&self) -> SimResult<()> {
        let now = match self.place {
            Place::Device(d) => {
                arena::arena(d)?.find(self.addr).filter(|(start, _)| *start == self.base).map(|(_, a)| a.id)
            }
            Place::PinnedHost => host_bufs::host_bufs().get(&self.base).map(|b| b.id),
        };
        if now == Some(self.id) {
            return Ok(());
        }
        let (memory, free) = match self.place {
            Place::Device(d) => (format!("device {d} memory"), "aclrtFree"),
            Place::PinnedHost => ("aclrtMallocHost memory".to_string(), "aclrtFreeHost"),
        };
        let since = if now.is_some() || self.reallocated() {
            "; the address belongs to a newer allocation now, whose bytes the task would have overwritten or read"
        } else {
            ""
        };
        fail(
            ACL_ERROR_RT_DEVICE_MEM_ERROR,
            format!(
                "{} {:#x} ({} bytes of the {memory} allocated at {:#x}) was freed ({free}) while the task was still \
                 pending on the stream{since}; the task was not run",
                self.what, self.addr, self.len, self.base
            ),
        )
    }

    /// True when a live allocation other than the leased one holds the address.
    fn reallocated(&self) -> bool {
        match self.place {
            Place::Device(d) => arena::arena(d).ok().and_then(|a| a.find(self.addr)).is_some(),
            Place::PinnedHost => host_bufs::containing(self.addr).is_some(),
        }
    }
}

/// Checks every lease of a task before it runs.
pub fn check_all(leases: &[Lease]) -> SimResult<()> {
    leases.iter().try_for_each(Lease::check)
}
