//! [`CpuBuffer`]: host memory of the CPU backend, owned or borrowed from the
//! caller for the duration of a call.

use super::host_pool::{self, Block};
use crate::backend::{Buffer, View, ViewMut};
use crate::{Element, Error, Result};

/// Host memory with 8-byte alignment, so it can be viewed as any [`Element`]:
/// either owned, or the caller's memory borrowed for the duration of a call
/// ([`CpuBuffer::borrow_raw`]).
pub struct CpuBuffer {
    mem: HostMem,
    len: usize,
}

/// The bytes of a [`CpuBuffer`].
enum HostMem {
    /// Our own allocation (8-byte words; an empty one still has an aligned
    /// dangling pointer, so empty typed views are valid).
    Owned(Vec<u64>),
    /// A large block of the host pool, kept for reuse when dropped.
    Pooled(Block),
    /// The caller's memory. Read-only memory is copied into an owned
    /// allocation on the first mutable access, so it is never written.
    /// `seal`: in debug builds, a hash of read-only bytes, which the drop
    /// compares to assert `borrow_raw`'s contract (nothing wrote them while
    /// the buffer lived); 0 otherwise.
    Borrowed { ptr: std::ptr::NonNull<u8>, writable: bool, seal: u64 },
}

/// A hash of `bytes` (debug builds' check of read-only borrowed memory).
fn seal_of(bytes: &[u8]) -> u64 {
    use std::hash::Hasher;
    let mut h = std::hash::DefaultHasher::new();
    h.write(bytes);
    h.finish()
}

// SAFETY: an owned buffer is a `Vec<u64>` or a pool block (memory it alone
// refers to, as a Vec's). A borrowed one is, by the contract
// of `CpuBuffer::borrow_raw`, memory lent to this buffer alone for its whole
// life (writable) or not written by anyone while it lives (read-only), and
// it is only accessed through `&self` / `&mut self` of the buffer, exactly
// like the owned case; so moving it to, or sharing it with, another thread is
// as sound as for a `Vec<u8>`.
unsafe impl Send for CpuBuffer {}
// SAFETY: as for `Send` above: `&CpuBuffer` only gives `&[u8]` access.
unsafe impl Sync for CpuBuffer {}

impl Default for CpuBuffer {
    fn default() -> Self {
        CpuBuffer { mem: HostMem::Owned(Vec::new()), len: 0 }
    }
}

impl Clone for CpuBuffer {
    /// A deep copy; the copy of a borrowed buffer is an owned one.
    fn clone(&self) -> Self {
        match &self.mem {
            HostMem::Owned(w) => CpuBuffer { mem: HostMem::Owned(w.clone()), len: self.len },
            HostMem::Pooled(_) | HostMem::Borrowed { .. } => Self::from_bytes(self.as_bytes()),
        }
    }
}

impl CpuBuffer {
    /// The alignment every host buffer has, owned or borrowed.
    pub const ALIGN: usize = 8;

    /// `len` zero bytes (calloc-backed, so large buffers are cheap to create).
    pub fn zeros(len: usize) -> Self {
        if len == 0 {
            return Self::default();
        }
        CpuBuffer { mem: HostMem::Owned(vec![0u64; len.div_ceil(8)]), len }
    }

    /// `len` zero bytes, or an error naming `op` when the allocation fails
    /// (also calloc-backed).
    pub fn try_zeros(op: &'static str, len: usize) -> Result<Self> {
        let words = len.div_ceil(8);
        if words == 0 {
            return Ok(Self::default());
        }
        let failed = || no_memory(op, len);
        let layout = std::alloc::Layout::array::<u64>(words).map_err(|_| failed())?;
        // SAFETY: `layout` has a non-zero size (words >= 1).
        let p = unsafe { std::alloc::alloc_zeroed(layout) }.cast::<u64>();
        if p.is_null() {
            return Err(failed());
        }
        // SAFETY: `p` comes from the global allocator with the layout of `words`
        // u64s (what a Vec of that capacity uses), all zero, which are valid u64s.
        let words = unsafe { Vec::from_raw_parts(p, words, words) };
        Ok(CpuBuffer { mem: HostMem::Owned(words), len })
    }

    /// `len` bytes for a result the op writes entirely before anyone reads
    /// it, or an error naming `op` when the allocation fails. Their contents
    /// are unspecified: from 1 MiB on,
    /// a block of the host pool (a previous, dropped result's memory, so
    /// neither the system allocator nor first-touch page faults are paid
    /// again), else zeros.
    pub fn try_output(op: &'static str, len: usize) -> Result<Self> {
        if len < host_pool::MIN_POOLED {
            return Self::try_zeros(op, len);
        }
        Ok(CpuBuffer { mem: HostMem::Pooled(Block::take(op, len)?), len })
    }

    /// Copies `bytes` into a new buffer, or an error naming `op` when the
    /// allocation fails.
    pub fn try_from_bytes(op: &'static str, bytes: &[u8]) -> Result<Self> {
        let mut b = Self::try_zeros(op, bytes.len())?;
        b.as_bytes_mut().copy_from_slice(bytes);
        Ok(b)
    }

    /// Copies `bytes` into a new buffer.
    ///
    /// # Panics
    /// When the memory cannot be allocated ([`CpuBuffer::try_from_bytes`]
    /// returns an error instead).
    pub fn from_bytes(bytes: &[u8]) -> Self {
        let mut b = Self::zeros(bytes.len());
        b.as_bytes_mut().copy_from_slice(bytes);
        b
    }

    /// The caller's `len` bytes at `ptr`, without a copy; `None` when `ptr`
    /// is null or not [`CpuBuffer::ALIGN`]-aligned (copy the bytes with
    /// [`CpuBuffer::from_bytes`] then). A read-only buffer is never written:
    /// its first mutable access makes an owned copy.
    ///
    /// # Safety
    /// For the whole life of the returned buffer, `ptr` must be readable (and,
    /// when `writable`, writable) for `len` bytes; memory lent `writable` must
    /// not be accessed through any other path, and read-only memory must not
    /// be written through any other path.
    pub unsafe fn borrow_raw(ptr: *mut u8, len: usize, writable: bool) -> Option<Self> {
        if len == 0 {
            return Some(Self::default());
        }
        let ptr = std::ptr::NonNull::new(ptr).filter(|p| p.as_ptr() as usize % Self::ALIGN == 0)?;
        let mut b = CpuBuffer { mem: HostMem::Borrowed { ptr, writable, seal: 0 }, len };
        if cfg!(debug_assertions) && !writable {
            let sealed = seal_of(b.as_bytes());
            if let HostMem::Borrowed { seal, .. } = &mut b.mem {
                *seal = sealed;
            }
        }
        Some(b)
    }

    /// True when the bytes are the caller's memory (see [`CpuBuffer::borrow_raw`]).
    pub fn is_borrowed(&self) -> bool {
        matches!(self.mem, HostMem::Borrowed { .. })
    }

    /// Address of the first byte (dangling but aligned for an empty buffer).
    pub fn as_ptr(&self) -> *const u8 {
        self.as_bytes().as_ptr()
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when the buffer holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The bytes.
    pub fn as_bytes(&self) -> &[u8] {
        match &self.mem {
            HostMem::Owned(w) => &bytemuck::cast_slice(w)[..self.len],
            HostMem::Pooled(b) => b.as_bytes(),
            // SAFETY: `borrow_raw`'s contract: readable for `len` bytes while
            // the buffer lives, and not written elsewhere meanwhile.
            HostMem::Borrowed { ptr, .. } => unsafe { std::slice::from_raw_parts(ptr.as_ptr(), self.len) },
        }
    }

    /// The bytes, mutable. A read-only borrowed buffer becomes an owned copy
    /// first, so the caller's memory is never written.
    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        if let HostMem::Borrowed { writable: false, .. } = self.mem {
            *self = Self::from_bytes(self.as_bytes());
        }
        let len = self.len;
        match &mut self.mem {
            HostMem::Owned(w) => &mut bytemuck::cast_slice_mut(w)[..len],
            HostMem::Pooled(b) => b.as_bytes_mut(),
            // SAFETY: `borrow_raw`'s contract: writable for `len` bytes while
            // the buffer lives and lent to it alone; `&mut self` makes this
            // the only live reference.
            HostMem::Borrowed { ptr, .. } => unsafe { std::slice::from_raw_parts_mut(ptr.as_ptr(), len) },
        }
    }

    /// Typed view; `len` must be a multiple of `size_of::<T>()`.
    pub fn typed<T: Element>(&self) -> &[T] {
        // Owned words, pool blocks and borrowed memory are all 8-byte aligned, which
        // satisfies every Element.
        bytemuck::cast_slice(self.as_bytes())
    }

    /// Typed mutable view.
    pub fn typed_mut<T: Element>(&mut self) -> &mut [T] {
        bytemuck::cast_slice_mut(self.as_bytes_mut())
    }
}

impl Drop for CpuBuffer {
    /// Debug builds assert that read-only borrowed memory was not written
    /// while the buffer lived (`borrow_raw`'s contract, on which every view
    /// of it relies): a caller that breaks it is found by any test that
    /// drives it, not only under Miri.
    fn drop(&mut self) {
        if let HostMem::Borrowed { writable: false, seal, .. } = self.mem {
            if cfg!(debug_assertions) && !std::thread::panicking() {
                assert!(
                    seal_of(self.as_bytes()) == seal,
                    "the {} bytes of host memory lent read-only to a CpuBuffer were written while it lived",
                    self.len
                );
            }
        }
    }
}

impl std::fmt::Debug for CpuBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let how = if self.is_borrowed() { "borrowed" } else { "owned" };
        write!(f, "CpuBuffer({} bytes, {how})", self.len)
    }
}

impl Buffer for CpuBuffer {
    fn len_bytes(&self) -> usize {
        self.len
    }
}

pub(crate) fn no_memory(op: &'static str, len: usize) -> Error {
    Error::HostMemory { op, bytes: len }
}

fn check_dtype<T: Element>(op: &'static str, arg: &'static str, dtype: crate::DType) -> Result<()> {
    if dtype != T::DTYPE {
        return Err(Error::dtype(op, arg, T::DTYPE.name(), dtype));
    }
    Ok(())
}

impl<'a> View<'a, CpuBuffer> {
    /// The bytes.
    pub fn bytes(&self) -> &'a [u8] {
        self.buf().as_bytes()
    }

    /// The elements as `T`; an error naming `op` and `arg` when the dtype is
    /// not `T`.
    pub fn typed<T: Element>(&self, op: &'static str, arg: &'static str) -> Result<&'a [T]> {
        check_dtype::<T>(op, arg, self.dtype())?;
        Ok(self.buf().typed::<T>())
    }
}

impl ViewMut<'_, CpuBuffer> {
    /// The bytes, for writing.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        self.buf_mut().as_bytes_mut()
    }

    /// The elements as `T`, for writing; an error naming `op` and `arg` when
    /// the dtype is not `T`.
    pub fn typed_mut<T: Element>(&mut self, op: &'static str, arg: &'static str) -> Result<&mut [T]> {
        check_dtype::<T>(op, arg, self.dtype())?;
        Ok(self.buf_mut().typed_mut::<T>())
    }
}
