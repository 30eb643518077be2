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
//! The free list keeps at most [`KEEP_BYTES`]; older blocks beyond that are
//! unmapped. A reused block holds the bytes of its previous user (memory of
//! this process only), so it is only for buffers the op writes entirely
//! before anyone reads them; debug builds fill a reused block with
//! [`POISON`] so a test shows an op that does not.

use std::ptr::NonNull;
use std::sync::Mutex;

/// Results smaller than this come from the system allocator.
pub const MIN_POOLED: usize = 1 << 20;
/// The huge page size on x86-64 and aarch64 (4 KiB base pages).
const HUGE: usize = 2 << 20;
/// Bytes of dropped blocks kept for reuse, per process.
pub const KEEP_BYTES: usize = 1 << 30;
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

/// Dropped blocks, oldest first.
struct FreeList {
    blocks: Vec<Mapping>,
    bytes: usize,
}

static FREE: Mutex<FreeList> = Mutex::new(FreeList { blocks: Vec::new(), bytes: 0 });

fn free_list() -> std::sync::MutexGuard<'static, FreeList> {
    // The list is consistent between statements: a panic elsewhere while it
    // was held cannot have broken it.
    FREE.lock().unwrap_or_else(|e| e.into_inner())
}

/// At least `len` bytes of host memory, aligned to 2 MiB, whose contents are
/// unspecified: zeros when fresh, the previous result's bytes when reused
/// ([`POISON`] in debug builds). Dropping it keeps it for the next caller.
pub struct Block {
    map: Option<Mapping>,
    len: usize,
}

impl Block {
    /// A block of `len` bytes: a dropped one of the same huge-page count if
    /// there is one, else a new mapping; `None` when the system has no memory
    /// for it.
    pub fn take(len: usize) -> Option<Block> {
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
        if m.cap > KEEP_BYTES {
            return m.unmap();
        }
        let evicted = {
            let mut free = free_list();
            free.bytes += m.cap;
            free.blocks.push(m);
            let mut evicted = Vec::new();
            while free.bytes > KEEP_BYTES {
                let old = free.blocks.remove(0);
                free.bytes -= old.cap;
                evicted.push(old);
            }
            evicted
        };
        evicted.into_iter().for_each(Mapping::unmap);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // The pool is per process and other tests of this binary use it, so each
    // test asks for a size no other test uses and checks only its own blocks.

    #[test]
    fn a_block_is_reused_only_after_it_is_dropped() {
        let len = 3 * HUGE + 17;
        let a = Block::take(len).unwrap();
        let b = Block::take(len).unwrap();
        assert_ne!(a.as_ptr(), b.as_ptr(), "two live blocks share memory");
        assert_eq!(a.as_ptr() as usize % HUGE, 0);
        assert_eq!(a.as_bytes().len(), len);
        let pa = a.as_ptr();
        drop(a);
        let c = Block::take(len).unwrap();
        assert_eq!(c.as_ptr(), pa, "a dropped block of the same size was not reused");
        assert_ne!(c.as_ptr(), b.as_ptr());
    }

    #[test]
    fn a_fresh_block_is_zero_and_a_reused_one_is_poisoned_in_debug_builds() {
        let len = 5 * HUGE;
        let mut a = Block::take(len).unwrap();
        assert!(a.as_bytes().iter().all(|&b| b == 0));
        a.as_bytes_mut().fill(7);
        drop(a);
        let b = Block::take(len).unwrap();
        let want = if cfg!(debug_assertions) { POISON } else { 7 };
        assert!(b.as_bytes().iter().all(|&x| x == want));
    }
}
