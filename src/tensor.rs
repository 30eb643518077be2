//! [`Tensor`]: dtype + shape + contiguous buffer on a device.
//!
//! Dim 0 is the token dimension; every op acts on rows of `row_len()` elements
//! (the product of the trailing dims). There are no views with strides and no
//! hidden copies: moving data between devices is an explicit call.

pub use crate::backend::args::{checked_bytes, checked_numel};
use crate::backend::npu::NpuBuffer;
use crate::types::TensorMeta;
use crate::{DType, Device, Element, Error, Result};

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
    /// The caller's memory. Read-only memory is copied into an owned
    /// allocation on the first mutable access, so it is never written.
    Borrowed { ptr: std::ptr::NonNull<u8>, writable: bool },
}

// SAFETY: an owned buffer is a `Vec<u64>`. A borrowed one is, by the contract
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
            HostMem::Borrowed { .. } => Self::from_bytes(self.as_bytes()),
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
        let failed = || Error::invalid(op, "shape", format!("{len} bytes of host memory could not be allocated"));
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

    /// Copies `bytes` into a new buffer.
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
        Some(CpuBuffer { mem: HostMem::Borrowed { ptr, writable }, len })
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
            // SAFETY: `borrow_raw`'s contract: writable for `len` bytes while
            // the buffer lives and lent to it alone; `&mut self` makes this
            // the only live reference.
            HostMem::Borrowed { ptr, .. } => unsafe { std::slice::from_raw_parts_mut(ptr.as_ptr(), len) },
        }
    }

    /// Typed view; `len` must be a multiple of `size_of::<T>()`.
    pub fn typed<T: Element>(&self) -> &[T] {
        // Owned words and borrowed memory are both 8-byte aligned, which
        // satisfies every Element.
        bytemuck::cast_slice(self.as_bytes())
    }

    /// Typed mutable view.
    pub fn typed_mut<T: Element>(&mut self) -> &mut [T] {
        bytemuck::cast_slice_mut(self.as_bytes_mut())
    }
}

impl std::fmt::Debug for CpuBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let how = if self.is_borrowed() { "borrowed" } else { "owned" };
        write!(f, "CpuBuffer({} bytes, {how})", self.len)
    }
}

/// Where a tensor's bytes live.
#[derive(Debug)]
pub enum Storage {
    /// Host memory.
    Cpu(CpuBuffer),
    /// Device memory on an Ascend NPU (real or simulated).
    Npu(NpuBuffer),
}

/// A contiguous tensor.
#[derive(Debug)]
pub struct Tensor {
    shape: Vec<usize>,
    dtype: DType,
    storage: Storage,
}

impl Tensor {
    /// Assembles a tensor from parts; `storage` must hold exactly
    /// `numel * dtype.size()` bytes.
    pub fn from_parts(shape: Vec<usize>, dtype: DType, storage: Storage) -> Result<Self> {
        let need = checked_bytes("Tensor::from_parts", "shape", &shape, dtype)?;
        let have = match &storage {
            Storage::Cpu(b) => b.len(),
            Storage::Npu(b) => b.len_bytes(),
        };
        if need != have {
            return Err(Error::invalid(
                "Tensor::from_parts",
                "storage",
                format!("shape {shape:?} of {dtype} needs {need} bytes, storage holds {have}"),
            ));
        }
        Ok(Tensor { shape, dtype, storage })
    }

    /// A zero-filled tensor on `device`.
    pub fn zeros(shape: &[usize], dtype: DType, device: &Device) -> Result<Self> {
        device.backend().zeros(shape, dtype)
    }

    /// A zero-filled host tensor, for shapes known to be small.
    ///
    /// # Panics
    /// When the size in bytes overflows; [`Tensor::try_zeros_cpu`] returns an
    /// error instead (every op uses that one).
    pub fn zeros_cpu(shape: &[usize], dtype: DType) -> Self {
        match Self::try_zeros_cpu(shape, dtype) {
            Ok(t) => t,
            Err(e) => panic!("{e}"),
        }
    }

    /// A zero-filled host tensor; an error when the size in bytes overflows or
    /// the memory cannot be allocated.
    pub fn try_zeros_cpu(shape: &[usize], dtype: DType) -> Result<Self> {
        const OP: &str = "Tensor::zeros";
        let n = checked_bytes(OP, "shape", shape, dtype)?;
        Ok(Tensor { shape: shape.to_vec(), dtype, storage: Storage::Cpu(CpuBuffer::try_zeros(OP, n)?) })
    }

    /// A host tensor holding a copy of `data`, with the given shape.
    pub fn from_slice<T: Element>(data: &[T], shape: &[usize]) -> Result<Self> {
        let numel = checked_numel("Tensor::from_slice", "shape", shape)?;
        if numel != data.len() {
            return Err(Error::shape(
                "Tensor::from_slice",
                "shape",
                format!("{} elements (the data length)", data.len()),
                shape,
            ));
        }
        let buf = CpuBuffer::from_bytes(bytemuck::cast_slice(data));
        Ok(Tensor { shape: shape.to_vec(), dtype: T::DTYPE, storage: Storage::Cpu(buf) })
    }

    /// Shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Size in bytes.
    pub fn len_bytes(&self) -> usize {
        self.numel() * self.dtype.size()
    }

    /// Rows (dim 0); a 0-d tensor has one row.
    pub fn rows(&self) -> usize {
        self.shape.first().copied().unwrap_or(1)
    }

    /// Elements per row (product of the trailing dims).
    pub fn row_len(&self) -> usize {
        self.shape.iter().skip(1).product()
    }

    /// The storage.
    pub fn storage(&self) -> &Storage {
        &self.storage
    }

    /// The storage, mutable.
    pub fn storage_mut(&mut self) -> &mut Storage {
        &mut self.storage
    }

    /// The device this tensor lives on.
    pub fn device(&self) -> Device {
        match &self.storage {
            Storage::Cpu(_) => Device::Cpu,
            Storage::Npu(b) => Device::Npu(b.device().clone()),
        }
    }

    /// True for host tensors.
    pub fn is_cpu(&self) -> bool {
        matches!(self.storage, Storage::Cpu(_))
    }

    /// Reshapes in place; the element count must not change.
    pub fn reshape(mut self, shape: &[usize]) -> Result<Self> {
        if checked_numel("Tensor::reshape", "shape", shape)? != self.numel() {
            return Err(Error::shape(
                "Tensor::reshape",
                "shape",
                format!("{} elements (shape {:?})", self.numel(), self.shape),
                shape,
            ));
        }
        self.shape = shape.to_vec();
        Ok(self)
    }

    /// The host bytes; an error for device tensors.
    pub fn cpu_bytes(&self) -> Result<&[u8]> {
        match &self.storage {
            Storage::Cpu(b) => Ok(b.as_bytes()),
            Storage::Npu(_) => Err(self.not_host("cpu_bytes")),
        }
    }

    /// The host bytes, mutable; an error for device tensors.
    pub fn cpu_bytes_mut(&mut self) -> Result<&mut [u8]> {
        match &mut self.storage {
            Storage::Cpu(b) => Ok(b.as_bytes_mut()),
            Storage::Npu(_) => Err(Error::Device {
                op: "Tensor::cpu_bytes_mut",
                arg: "self",
                expected: "cpu".into(),
                actual: "npu".into(),
            }),
        }
    }

    /// Typed host view; errors if the dtype is not `T` or the tensor is on a device.
    pub fn as_slice<T: Element>(&self) -> Result<&[T]> {
        self.check_dtype::<T>("Tensor::as_slice")?;
        match &self.storage {
            Storage::Cpu(b) => Ok(b.typed::<T>()),
            Storage::Npu(_) => Err(self.not_host("as_slice")),
        }
    }

    /// Typed mutable host view.
    pub fn as_mut_slice<T: Element>(&mut self) -> Result<&mut [T]> {
        self.check_dtype::<T>("Tensor::as_mut_slice")?;
        match &mut self.storage {
            Storage::Cpu(b) => Ok(b.typed_mut::<T>()),
            Storage::Npu(_) => Err(Error::Device {
                op: "Tensor::as_mut_slice",
                arg: "self",
                expected: "cpu".into(),
                actual: "npu".into(),
            }),
        }
    }

    /// Copies the elements to a host `Vec`, from whatever device.
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>> {
        self.check_dtype::<T>("Tensor::to_vec")?;
        match &self.storage {
            Storage::Cpu(b) => Ok(b.typed::<T>().to_vec()),
            Storage::Npu(_) => self.to_cpu()?.to_vec(),
        }
    }

    /// A host copy of this tensor.
    pub fn to_cpu(&self) -> Result<Tensor> {
        Device::Cpu.backend().copy_from(self)
    }

    /// A copy of this tensor on `device`.
    pub fn to_device(&self, device: &Device) -> Result<Tensor> {
        device.backend().copy_from(self)
    }

    /// A deep copy on the same device.
    pub fn try_clone(&self) -> Result<Tensor> {
        self.device().backend().copy_from(self)
    }

    fn check_dtype<T: Element>(&self, op: &'static str) -> Result<()> {
        if self.dtype != T::DTYPE {
            return Err(Error::dtype(op, "self", T::DTYPE.name(), self.dtype));
        }
        Ok(())
    }

    fn not_host(&self, what: &'static str) -> Error {
        Error::Device { op: "Tensor", arg: what, expected: "cpu".into(), actual: "npu".into() }
    }
}

impl<'a> TensorMeta<'a> {
    /// Shape and dtype of `t`.
    pub fn of(t: &'a Tensor) -> Self {
        TensorMeta { shape: t.shape(), dtype: t.dtype() }
    }
}
