//! Simulated device memory.
//!
//! Each device owns two virtual ranges of `CANNSIM_DEVICE_MEM` bytes: an
//! inaccessible reservation (`PROT_NONE`) whose addresses are handed out as
//! device pointers, and a lazily committed backing range holding the bytes.
//! A device pointer is therefore never a usable host pointer: dereferencing it
//! on the host faults, and every simulated call translates it explicitly,
//! checking that the whole access lies inside one live allocation.
//!
//! Allocation follows the documented `aclrtMalloc` rules: the start address is
//! 64-byte aligned and the footprint is `ALIGN_UP(size, 32) + 32` bytes. Fresh
//! memory is filled with `CANNSIM_MALLOC_FILL` (0xFF: NaN in every float
//! type) because real device memory is not zeroed.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};

use crate::config;
use crate::ffi::*;
use crate::status::{fail, SimError, SimResult};

const ALIGN: usize = 64;

fn align_up(v: usize, a: usize) -> usize {
    v.div_ceil(a) * a
}

/// One live allocation.
#[derive(Debug, Clone, Copy)]
pub struct Alloc {
    /// Requested size in bytes (the accessible extent for copies).
    pub size: usize,
    /// Bytes consumed in the arena (the extent a kernel may touch).
    pub footprint: usize,
    /// This allocation's number (see [`next_alloc_id`]).
    pub id: u64,
}

/// A number never handed out before, for a new device or pinned host
/// allocation: an allocation made at a freed one's address has another
/// number, so work queued against the old one can tell them apart
/// (see [`crate::lease`]).
pub fn next_alloc_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

#[derive(Debug, Default)]
struct ArenaState {
    /// Free blocks: offset -> length.
    free: BTreeMap<usize, usize>,
    /// Live allocations by offset.
    allocs: BTreeMap<usize, Alloc>,
    used: usize,
}

/// The memory of one simulated device.
#[derive(Debug)]
pub struct Arena {
    /// Device ordinal.
    pub device: u32,
    dev_base: usize,
    host_base: usize,
    size: usize,
    state: Mutex<ArenaState>,
}

fn map(size: usize, prot: libc::c_int) -> SimResult<usize> {
    // SAFETY: an anonymous private mapping with no fixed address has no
    // preconditions; the result is checked against MAP_FAILED.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            size,
            prot,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return fail(
            ACL_ERROR_RT_MEMORY_ALLOCATION,
            format!("could not reserve {size} bytes of address space for a simulated device"),
        );
    }
    Ok(p as usize)
}

impl Arena {
    fn new(device: u32, size: usize) -> SimResult<Arena> {
        let dev_base = map(size, libc::PROT_NONE)?;
        let host_base = map(size, libc::PROT_READ | libc::PROT_WRITE)?;
        let mut st = ArenaState::default();
        st.free.insert(0, size);
        Ok(Arena { device, dev_base, host_base, size, state: Mutex::new(st) })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, ArenaState> {
        // A poisoned lock only means a panic elsewhere; the maps stay consistent
        // because every mutation below is completed before unlocking.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// True if `addr` lies in this device's address range.
    pub fn contains(&self, addr: usize) -> bool {
        addr >= self.dev_base && addr < self.dev_base + self.size
    }

    /// Total bytes.
    pub fn total(&self) -> usize {
        self.size
    }

    /// Bytes not in use.
    pub fn free_bytes(&self) -> usize {
        self.size - self.lock().used
    }

    /// Allocates `size` bytes; returns the device address.
    pub fn alloc(&self, size: usize) -> SimResult<usize> {
        if size == 0 {
            return fail(ACL_ERROR_INVALID_PARAM, "size must not be 0");
        }
        let footprint = align_up(align_up(size, 32) + 32, ALIGN);
        let mut st = self.lock();
        let Some((&off, &len)) = st.free.iter().find(|(_, &len)| len >= footprint) else {
            return fail(
                ACL_ERROR_RT_MEMORY_ALLOCATION,
                format!(
                    "device {}: out of memory: {size} bytes requested ({footprint} with padding), {} of {} bytes in use",
                    self.device, st.used, self.size
                ),
            );
        };
        // Asked only once nothing else can fail, so that it counts successful
        // allocations, as `CANNSIM_FAIL_MALLOC_AFTER` is documented.
        if !config::malloc_allowed() {
            return fail(
                ACL_ERROR_RT_MEMORY_ALLOCATION,
                format!("device {}: allocation of {size} bytes failed (CANNSIM_FAIL_MALLOC_AFTER)", self.device),
            );
        }
        st.free.remove(&off);
        if len > footprint {
            st.free.insert(off + footprint, len - footprint);
        }
        st.allocs.insert(off, Alloc { size, footprint, id: next_alloc_id() });
        st.used += footprint;
        drop(st);
        if let Some(b) = config::get().malloc_fill {
            // SAFETY: [off, off + footprint) lies inside the backing mapping
            // (the free list only holds ranges of it) and was just reserved for
            // this allocation, so nobody else accesses it.
            unsafe { std::ptr::write_bytes((self.host_base + off) as *mut u8, b, footprint) };
        }
        Ok(self.dev_base + off)
    }

    /// Frees the allocation starting at `addr`.
    pub fn free(&self, addr: usize) -> SimResult<()> {
        let off = addr - self.dev_base;
        let mut st = self.lock();
        let Some(a) = st.allocs.remove(&off) else {
            return fail(
                ACL_ERROR_RT_PARAM_INVALID,
                format!("{addr:#x} is not the start of a live allocation on device {}", self.device),
            );
        };
        st.used -= a.footprint;
        // Coalesce with the neighbours.
        let mut start = off;
        let mut len = a.footprint;
        if let Some((&p, &plen)) = st.free.range(..off).next_back() {
            if p + plen == off {
                st.free.remove(&p);
                start = p;
                len += plen;
            }
        }
        if let Some(&nlen) = st.free.get(&(off + a.footprint)) {
            st.free.remove(&(off + a.footprint));
            len += nlen;
        }
        st.free.insert(start, len);
        drop(st);
        // Give whole pages of large frees back to the OS.
        let page = 4096;
        let lo = align_up(self.host_base + off, page);
        let hi = (self.host_base + off + a.footprint) & !(page - 1);
        if hi > lo + (1 << 20) {
            // SAFETY: [lo, hi) is inside the backing mapping and no longer part
            // of any allocation; MADV_DONTNEED on private anonymous memory just
            // drops the pages (they read back as zeros).
            unsafe { libc::madvise(lo as *mut libc::c_void, hi - lo, libc::MADV_DONTNEED) };
        }
        Ok(())
    }

    /// The live allocation containing `addr`: (start address, allocation).
    pub fn find(&self, addr: usize) -> Option<(usize, Alloc)> {
        let off = addr.checked_sub(self.dev_base)?;
        let st = self.lock();
        let (&start, &a) = st.allocs.range(..=off).next_back()?;
        (off < start + a.footprint).then_some((self.dev_base + start, a))
    }

    /// Host address of device address `addr` (no checks).
    fn host(&self, addr: usize) -> *mut u8 {
        (self.host_base + (addr - self.dev_base)) as *mut u8
    }

    /// Live allocations: (device address, requested size).
    pub fn live(&self) -> Vec<(usize, usize)> {
        self.lock().allocs.iter().map(|(o, a)| (self.dev_base + o, a.size)).collect()
    }
}

static ARENAS: OnceLock<Vec<OnceLock<Result<Arena, SimError>>>> = OnceLock::new();

fn slots() -> &'static [OnceLock<Result<Arena, SimError>>] {
    ARENAS.get_or_init(|| (0..config::get().devices).map(|_| OnceLock::new()).collect())
}

/// The arena of `device`, creating it on first use.
pub fn arena(device: u32) -> SimResult<&'static Arena> {
    let slot = slots().get(device as usize).ok_or_else(|| {
        SimError::new(
            ACL_ERROR_RT_INVALID_DEVICEID,
            format!("device {device} does not exist ({} simulated devices)", config::get().devices),
        )
    })?;
    slot.get_or_init(|| Arena::new(device, config::get().device_mem)).as_ref().map_err(Clone::clone)
}

/// Every arena created so far.
pub fn created() -> impl Iterator<Item = &'static Arena> {
    slots().iter().filter_map(|s| s.get().and_then(|r| r.as_ref().ok()))
}

/// The device whose address range holds `addr`, if any.
pub fn owner(addr: usize) -> Option<u32> {
    created().find(|a| a.contains(addr)).map(|a| a.device)
}

/// A checked device access: `len` bytes at a device address.
#[derive(Debug, Clone, Copy)]
pub struct Span {
    /// Device ordinal.
    pub device: u32,
    /// Device address.
    pub addr: usize,
    /// Host address of the first byte inside the arena.
    pub host: *mut u8,
    /// Length in bytes.
    pub len: usize,
    /// Device address of the allocation the access lies in.
    pub base: usize,
    /// Number of that allocation ([`Alloc::id`]).
    pub id: u64,
}

// SAFETY: a Span is an address range inside a process-lifetime mapping; the
// simulated device (like real hardware) leaves synchronisation of accesses to
// the caller's stream ordering.
unsafe impl Send for Span {}

/// Checks that `[addr, addr + len)` lies inside one live allocation's
/// requested extent (`footprint` extent when `kernel`), and returns it.
/// `what` names the argument in the error.
pub fn resolve_ext(addr: usize, len: usize, what: &str, kernel: bool) -> SimResult<Span> {
    let Some(a) = created().find(|a| a.contains(addr)) else {
        return fail(ACL_ERROR_RT_PARAM_INVALID, format!("{what} ({addr:#x}) is not device memory"));
    };
    let Some((start, al)) = a.find(addr) else {
        return fail(
            ACL_ERROR_RT_PARAM_INVALID,
            format!(
                "{what} ({addr:#x}) is not inside a live allocation on device {} (freed or never allocated)",
                a.device
            ),
        );
    };
    let extent = if kernel { al.footprint } else { al.size };
    let end = addr.saturating_add(len);
    if end > start + extent {
        return fail(
            ACL_ERROR_RT_PARAM_INVALID,
            format!(
                "{what}: {len} bytes at offset {} overrun the {}-byte allocation at {start:#x} on device {}",
                addr - start,
                al.size,
                a.device
            ),
        );
    }
    Ok(Span { device: a.device, addr, host: a.host(addr), len, base: start, id: al.id })
}

/// [`resolve_ext`] for copies (requested extent).
pub fn resolve(addr: usize, len: usize, what: &str) -> SimResult<Span> {
    resolve_ext(addr, len, what, false)
}
