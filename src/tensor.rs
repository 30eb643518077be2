//! [`Tensor`]: dtype + shape + contiguous buffer on a device.
//!
//! Dim 0 is the token dimension; every op acts on rows of `row_len()` elements
//! (the product of the trailing dims). There are no views with strides and no
//! hidden copies: moving data between devices is an explicit call.

pub use crate::backend::args::{checked_bytes, checked_numel};
use crate::backend::cpu::no_memory;
pub use crate::backend::cpu::CpuBuffer;
use crate::backend::npu::NpuBuffer;
use crate::backend::{Backend, Buffer, View, ViewMut};
use crate::types::TensorMeta;
use crate::{DType, Device, Element, Error, Result};

/// Where a tensor's bytes live.
#[derive(Debug)]
pub enum Storage {
    /// Host memory.
    Cpu(CpuBuffer),
    /// Device memory on an Ascend NPU (real or simulated).
    Npu(NpuBuffer),
}

impl Storage {
    /// Its length in bytes.
    pub fn len_bytes(&self) -> usize {
        match self {
            Storage::Cpu(b) => b.len(),
            Storage::Npu(b) => b.len_bytes(),
        }
    }

    /// A host copy of the bytes (for device memory, waiting for them).
    pub fn to_host(&self) -> Result<CpuBuffer> {
        match self {
            Storage::Cpu(b) => CpuBuffer::try_from_bytes("Tensor::to_cpu", b.as_bytes()),
            Storage::Npu(b) => {
                let mut host = CpuBuffer::try_zeros("Tensor::to_cpu", b.len_bytes())?;
                b.copy_to_host(host.as_bytes_mut())?;
                Ok(host)
            }
        }
    }
}

/// A backend buffer a [`Storage`] holds: what lets a tensor lend its bytes to
/// the backend that owns them, as a [`View`].
pub trait StorageBuffer: Buffer + Sized {
    /// The buffer in `storage`, when it is one of this kind.
    fn of(storage: &Storage) -> Option<&Self>;
    /// The buffer in `storage`, mutable, when it is one of this kind.
    fn of_mut(storage: &mut Storage) -> Option<&mut Self>;
    /// The storage holding `self`.
    fn into_storage(self) -> Storage;
}

impl StorageBuffer for CpuBuffer {
    fn of(storage: &Storage) -> Option<&Self> {
        match storage {
            Storage::Cpu(b) => Some(b),
            Storage::Npu(_) => None,
        }
    }
    fn of_mut(storage: &mut Storage) -> Option<&mut Self> {
        match storage {
            Storage::Cpu(b) => Some(b),
            Storage::Npu(_) => None,
        }
    }
    fn into_storage(self) -> Storage {
        Storage::Cpu(self)
    }
}

impl StorageBuffer for NpuBuffer {
    fn of(storage: &Storage) -> Option<&Self> {
        match storage {
            Storage::Npu(b) => Some(b),
            Storage::Cpu(_) => None,
        }
    }
    fn of_mut(storage: &mut Storage) -> Option<&mut Self> {
        match storage {
            Storage::Npu(b) => Some(b),
            Storage::Cpu(_) => None,
        }
    }
    fn into_storage(self) -> Storage {
        Storage::Npu(self)
    }
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
        let have = storage.len_bytes();
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
        match device {
            Device::Cpu => Self::try_zeros_cpu(shape, dtype),
            Device::Npu(d) => {
                let n = checked_bytes("Tensor::zeros", "shape", shape, dtype)?;
                Tensor::from_parts(shape.to_vec(), dtype, Storage::Npu(d.zeros(n)?))
            }
        }
    }

    /// A tensor of `shape` and `dtype` over a backend's buffer `buf`, which
    /// must hold exactly its bytes.
    pub fn from_buffer<B: StorageBuffer>(shape: &[usize], dtype: DType, buf: B) -> Result<Self> {
        Tensor::from_parts(shape.to_vec(), dtype, buf.into_storage())
    }

    /// Shape and dtype.
    pub fn meta(&self) -> TensorMeta<'_> {
        TensorMeta { shape: &self.shape, dtype: self.dtype }
    }

    /// This tensor lent, as argument `arg` of `op`, to a backend whose
    /// buffers are `B` and live at `location`; an error naming both when its
    /// storage is another kind.
    pub fn view<B: StorageBuffer>(&self, op: &'static str, arg: &'static str, location: &str) -> Result<View<'_, B>> {
        match B::of(&self.storage) {
            Some(b) => View::new(op, arg, self.meta(), b),
            None => Err(self.elsewhere(op, arg, location)),
        }
    }

    /// [`view`](Self::view), for an operand the op writes.
    pub fn view_mut<B: StorageBuffer>(
        &mut self,
        op: &'static str,
        arg: &'static str,
        location: &str,
    ) -> Result<ViewMut<'_, B>> {
        if B::of(&self.storage).is_none() {
            return Err(self.elsewhere(op, arg, location));
        }
        let meta = TensorMeta { shape: &self.shape, dtype: self.dtype };
        let buf = B::of_mut(&mut self.storage).expect("the storage kind was checked just above");
        ViewMut::new(op, arg, meta, buf)
    }

    fn elsewhere(&self, op: &'static str, arg: &'static str, location: &str) -> Error {
        Error::Device { op, arg, expected: location.to_string(), actual: self.device().to_string() }
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
        let buf = CpuBuffer::try_from_bytes("Tensor::from_slice", bytemuck::cast_slice(data))?;
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
            Storage::Cpu(b) => {
                let src = b.typed::<T>();
                let mut v = Vec::new();
                v.try_reserve_exact(src.len()).map_err(|_| no_memory("Tensor::to_vec", b.len_bytes()))?;
                v.extend_from_slice(src);
                Ok(v)
            }
            Storage::Npu(_) => self.to_cpu()?.to_vec(),
        }
    }

    /// A host copy of this tensor.
    pub fn to_cpu(&self) -> Result<Tensor> {
        Tensor::from_parts(self.shape.clone(), self.dtype, Storage::Cpu(self.storage.to_host()?))
    }

    /// A copy of this tensor on `device`.
    pub fn to_device(&self, device: &Device) -> Result<Tensor> {
        let storage = match (device, &self.storage) {
            (Device::Cpu, s) => Storage::Cpu(s.to_host()?),
            (Device::Npu(d), Storage::Cpu(b)) => Storage::Npu(d.upload(b.as_bytes())?),
            (Device::Npu(d), Storage::Npu(b)) => Storage::Npu(d.duplicate(b)?),
        };
        Tensor::from_parts(self.shape.clone(), self.dtype, storage)
    }

    /// A deep copy on the same device.
    pub fn try_clone(&self) -> Result<Tensor> {
        self.to_device(&self.device())
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
        t.meta()
    }
}
