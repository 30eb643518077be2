//! Large host blocks that outlive the result they held, so the next result of
//! the same size reuses them.
//!
//! A result of tens of MiB taken fresh from the system allocator is new
//! mappings on every call: the kernel zeroes and maps every page on its first
//! touch, inside the op that writes it, and the time that costs depends on
//! whether the allocator happened to keep the previous block. A [`Block`] is
//! a whole number of 2 MiB huge pages, aligned to one and advised
//! `MADV_HUGEPAGE`, and when it is dropped it goes to a free list instead of
//! back to the system. Only a dropped block is ever handed out again, so a
//! result the caller still holds is never reused.
//!
//! The free list keeps at most [`keep_bytes`] per process (the setting
//! [`KEEP_VAR`], read once, else [`DEFAULT_KEEP_BYTES`]; 0 keeps none); older
//! blocks beyond that are unmapped. A process that stops making large results
//! keeps what its list holds, so many workers per host may want a smaller
//! bound. A reused block holds the bytes of its previous user (memory of
//! this process only), so it is only for buffers the op writes entirely
//! before anyone reads them; debug builds fill a reused block with
//! [`POISON`] so a test shows an op that does not.

use std::ptr::NonNull;
use std::sync::{Mutex, OnceLock};

use crate::{Error, Result};

/// Results smaller than this come from the system allocator.
pub const MIN_POOLED: usize = 1 << 20;
/// The huge page size on x86-64 and aarch64 (4 KiB base pages).
const HUGE: usize = 2 << 20;
/// Bytes of dropped blocks kept for reuse per process, unless [`KEEP_VAR`]
/// says otherwise.
pub const DEFAULT_KEEP_BYTES: usize = 1 << 30;
/// The setting of how many bytes of dropped blocks a process keeps.
pub const KEEP_VAR: &str = "ASCEND_MOE_HOST_POOL_BYTES";
/// What [`KEEP_VAR`] takes, for messages.
pub const KEEP_WANTED: &str = "a number of bytes (digits, optionally followed by K, M or G for KiB, MiB or GiB; \
                               0 keeps no dropped block)";
/// What debug builds write over a reused block.
pub const POISON: u8 = 0xA5;

/// A mapping of `cap` bytes at `ptr`, owned by no one.
struct Mapping {
    ptr: NonNull<u8>,
    cap: usize,
}

// SAFETY: a `Mapping` is an address range this module alone maps and unmaps;
// whoever holds one has the only access to its bytes.
unsafe impl Send for Mapping {}

impl Mapping {
    /// `cap` bytes (a multiple of [`HUGE`]) of fresh zeroed memory, aligned
    /// to [`HUGE`], advised to use huge pages.
    fn new(cap: usize) -> Option<Mapping> {
        let span = cap.checked_add(HUGE)?;
        // SAFETY: an anonymous private mapping at an address of the kernel's
        // choosing touches no existing memory.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                span,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return None;
        }
        let start = (base as usize).next_multiple_of(HUGE);
        let head = start - base as usize;
        let tail = span - head - cap;
        // SAFETY: the head and tail ranges lie inside the mapping just made
        // and are page-aligned (mmap's result and `start` are); nothing else
        // refers to them. A failed unmap only leaves the range mapped.
        unsafe {
            if head > 0 {
                libc::munmap(base, head);
            }
            if tail > 0 {
                libc::munmap((start + cap) as *mut libc::c_void, tail);
            }
            // Advice only: where the kernel has no huge pages, base pages serve.
            libc::madvise(start as *mut libc::c_void, cap, libc::MADV_HUGEPAGE);
        }
        NonNull::new(start as *mut u8).map(|ptr| Mapping { ptr, cap })
    }

    fn unmap(self) {
        // SAFETY: the range was mapped by `Mapping::new` and is referred to by
        // no live block (this mapping was owned by the free list alone).
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.cap) };
    }
}

/// A byte count as [`KEEP_VAR`] takes it (see [`KEEP_WANTED`]); `None`
/// for anything else, or more than a `usize` holds.
fn parse_bytes(s: &str) -> Option<usize> {
    let s = s.trim();
    let digits = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let shift = match &s[digits..] {
        "" => 0,
        "K" => 10,
        "M" => 20,
        "G" => 30,
        _ => return None,
    };
    let n: usize = s[..digits].parse().ok()?;
    n.checked_mul(1 << shift)
}

/// [`KEEP_VAR`]: `Ok(None)` when unset, its byte count when valid, else
/// `Err` with the value as set (with which every pooled allocation fails).
pub fn env_keep_bytes() -> std::result::Result<Option<usize>, String> {
    crate::types::env_setting(KEEP_VAR, parse_bytes)
}

/// The most bytes of dropped blocks this process keeps: [`KEEP_VAR`] as it
/// was at the first pooled allocation, else [`DEFAULT_KEEP_BYTES`]; `Err`
/// with the value as set when it is not a byte count.
pub fn keep_bytes() -> std::result::Result<usize, &'static str> {
    static KEEP: OnceLock<std::result::Result<usize, String>> = OnceLock::new();
    match KEEP.get_or_init(|| env_keep_bytes().map(|k| k.unwrap_or(DEFAULT_KEEP_BYTES))) {
        Ok(k) => Ok(*k),
        Err(v) => Err(v),
    }
}

/// The error of `op`, whose result needed a block, when [`KEEP_VAR`] is
/// set to `value`, which is no byte count.
fn bad_setting(op: &'static str, value: &str) -> Error {
    Error::invalid(op, KEEP_VAR, format!("the environment variable is set to {value:?}, not {KEEP_WANTED}"))
}

/// Dropped blocks, oldest first.
struct FreeList {
    blocks: Vec<Mapping>,
    bytes: usize,
}

static FREE: Mutex<FreeList> = Mutex::new(FreeList { blocks: Vec::new(), bytes: 0 });

fn free_list() -> std::sync::MutexGuard<'static, FreeList> {
    crate::fork::watch(crate::fork::HOST_POOL, lock_for_fork);
    // The list is consistent between statements: a panic elsewhere while it
    // was held cannot have broken it.
    FREE.lock().unwrap_or_else(|e| e.into_inner())
}

/// The free list's guard, held by the thread that forks ([`crate::fork`]).
pub(crate) fn lock_for_fork() -> Box<dyn std::any::Any> {
    Box::new(FREE.lock().unwrap_or_else(|e| e.into_inner()))
}

/// At least `len` bytes of host memory, aligned to 2 MiB, whose contents are
/// unspecified: zeros when fresh, the previous result's bytes when reused
/// ([`POISON`] in debug builds). Dropping it keeps it for the next caller.
pub struct Block {
    map: Option<Mapping>,
    len: usize,
}

impl Block {
    /// A block of `len` bytes for `op`: a dropped one of the same huge-page
    /// count if there is one, else a new mapping; [`Error::HostMemory`] when
    /// the system has no memory for it, [`Error::InvalidArgument`] naming
    /// [`KEEP_VAR`] when that is set to something other than a byte count.
    pub fn take(op: &'static str, len: usize) -> Result<Block> {
        Self::take_keeping(op, len, keep_bytes())
    }

    /// [`Block::take`] with the pool's bound `keep` (or the bad value set).
    fn take_keeping(op: &'static str, len: usize, keep: std::result::Result<usize, &str>) -> Result<Block> {
        keep.map_err(|v| bad_setting(op, v))?;
        Self::take_any(len).ok_or(Error::HostMemory { op, bytes: len })
    }

    fn take_any(len: usize) -> Option<Block> {
        let cap = len.max(1).checked_next_multiple_of(HUGE)?;
        let reused = {
            let mut free = free_list();
            // The newest fitting block: its pages are the likeliest still cached.
            let i = free.blocks.iter().rposition(|m| m.cap == cap);
            i.map(|i| {
                let m = free.blocks.remove(i);
                free.bytes -= m.cap;
                m
            })
        };
        let map = match reused {
            Some(m) => {
                if cfg!(debug_assertions) {
                    // SAFETY: the mapping is `cap` writable bytes owned by us alone.
                    unsafe { std::ptr::write_bytes(m.ptr.as_ptr(), POISON, m.cap) };
                }
                m
            }
            None => Mapping::new(cap)?,
        };
        Some(Block { map: Some(map), len })
    }

    /// Address of the first byte.
    pub fn as_ptr(&self) -> *mut u8 {
        self.map.as_ref().map_or(NonNull::dangling(), |m| m.ptr).as_ptr()
    }

    /// The bytes.
    pub fn as_bytes(&self) -> &[u8] {
        // SAFETY: the mapping holds at least `len` readable bytes, every one
        // initialised (fresh anonymous memory is zero, reused memory holds
        // what was written), owned by this block alone while it lives.
        unsafe { std::slice::from_raw_parts(self.as_ptr(), self.len) }
    }

    /// The bytes, mutable.
    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as `as_bytes`; `&mut self` makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.as_ptr(), self.len) }
    }
}

impl Drop for Block {
    fn drop(&mut self) {
        let Some(m) = self.map.take() else { return };
        // A block was taken, so the setting was valid.
        give_back(m, keep_bytes().unwrap_or(0));
    }
}

/// Puts a dropped block's mapping on the free list, which keeps at most
/// `keep` bytes (the oldest blocks beyond are unmapped).
fn give_back(m: Mapping, keep: usize) {
    if m.cap > keep {
        return m.unmap();
    }
    let evicted = {
        let mut free = free_list();
        free.bytes += m.cap;
        free.blocks.push(m);
        let mut evicted = Vec::new();
        while free.bytes > keep {
            let old = free.blocks.remove(0);
            free.bytes -= old.cap;
            evicted.push(old);
        }
        evicted
    };
    evicted.into_iter().for_each(Mapping::unmap);
}

#[cfg(test)]
mod tests {
    use super::*;

    // The pool is per process and other tests of this binary use it, so each
    // test asks for a size no other test uses and checks only its own blocks.

    #[test]
    fn a_block_is_reused_only_after_it_is_dropped() {
        let len = 3 * HUGE + 17;
        let a = Block::take("test", len).unwrap();
        let b = Block::take("test", len).unwrap();
        assert_ne!(a.as_ptr(), b.as_ptr(), "two live blocks share memory");
        assert_eq!(a.as_ptr() as usize % HUGE, 0);
        assert_eq!(a.as_bytes().len(), len);
        let pa = a.as_ptr();
        drop(a);
        let c = Block::take("test", len).unwrap();
        assert_eq!(c.as_ptr(), pa, "a dropped block of the same size was not reused");
        assert_ne!(c.as_ptr(), b.as_ptr());
    }

    #[test]
    fn the_pool_bound_is_a_byte_count_and_a_bad_one_fails_the_allocation_naming_it() {
        assert_eq!(parse_bytes(" 0 "), Some(0));
        assert_eq!(parse_bytes("1048576"), Some(1 << 20));
        assert_eq!(parse_bytes("256M"), Some(256 << 20));
        assert_eq!(parse_bytes("3K"), Some(3 << 10));
        assert_eq!(parse_bytes("2G"), Some(2 << 30));
        for bad in ["", "-1", "1.5G", "256MB", "256m", "G", "1e9", "off", "99999999999999999999", "18014398509481984G"]
        {
            assert_eq!(parse_bytes(bad), None, "{bad:?}");
        }
        match Block::take_keeping("op_x", 3 * HUGE, Err("256MB")) {
            Err(Error::InvalidArgument { op: "op_x", arg: KEEP_VAR, reason }) => {
                assert!(reason.contains("\"256MB\"") && reason.contains("0 keeps no dropped block"), "{reason}")
            }
            other => panic!("expected the setting refused, got {:?}", other.map(|b| b.len)),
        }
    }

    #[test]
    fn a_bound_of_zero_keeps_no_dropped_block_nor_does_a_smaller_one() {
        let cap = 7 * HUGE;
        let kept = |p: *mut u8| free_list().blocks.iter().any(|m| m.ptr.as_ptr() == p);
        let a = Mapping::new(cap).unwrap();
        let pa = a.ptr.as_ptr();
        give_back(a, 0);
        assert!(!kept(pa), "a bound of 0 kept a block");
        let b = Mapping::new(cap).unwrap();
        let pb = b.ptr.as_ptr();
        give_back(b, cap - 1);
        assert!(!kept(pb), "a block larger than the bound was kept");
    }

    #[test]
    fn a_fresh_block_is_zero_and_a_reused_one_is_poisoned_in_debug_builds() {
        let len = 5 * HUGE;
        let mut a = Block::take("test", len).unwrap();
        assert!(a.as_bytes().iter().all(|&b| b == 0));
        a.as_bytes_mut().fill(7);
        drop(a);
        let b = Block::take("test", len).unwrap();
        let want = if cfg!(debug_assertions) { POISON } else { 7 };
        assert!(b.as_bytes().iter().all(|&x| x == want));
    }
}
