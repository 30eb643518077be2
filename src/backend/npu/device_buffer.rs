//! [`DeviceBuffer`]: typed device memory, `len` elements of `T` over an
//! [`NpuBuffer`], and the typed copies of [`NpuDevice`].

use std::marker::PhantomData;

use super::memory::{NpuBuffer, PinnedHostBuffer};
use super::NpuDevice;
use crate::{Element, Error, Result};

/// Typed device memory: `len` elements of `T`.
pub struct DeviceBuffer<T: Element> {
    buf: NpuBuffer,
    len: usize,
    _t: PhantomData<T>,
}

impl<T: Element> std::fmt::Debug for DeviceBuffer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeviceBuffer<{}>({} elements, {:?})", T::DTYPE, self.len, self.buf)
    }
}

impl<T: Element> DeviceBuffer<T> {
    /// `len` uninitialised elements.
    pub fn alloc(device: &NpuDevice, len: usize) -> Result<Self> {
        let bytes = len.checked_mul(std::mem::size_of::<T>()).ok_or_else(|| {
            Error::invalid("DeviceBuffer::alloc", "len", format!("{len} elements overflow the address space"))
        })?;
        Ok(DeviceBuffer { buf: NpuBuffer::alloc(device, bytes)?, len, _t: PhantomData })
    }

    /// `len` zero elements.
    pub fn zeros(device: &NpuDevice, len: usize) -> Result<Self> {
        let b = Self::alloc(device, len)?;
        b.buf.memset_async(0, 0, b.buf.len_bytes())?;
        Ok(b)
    }

    /// A device copy of `data` (host to device, blocking).
    pub fn from_host(device: &NpuDevice, data: &[T]) -> Result<Self> {
        let b = Self::alloc(device, data.len())?;
        b.buf.copy_from_host_at(0, bytemuck::cast_slice(data))?;
        Ok(b)
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The untyped buffer.
    pub fn as_bytes(&self) -> &NpuBuffer {
        &self.buf
    }

    /// Into the untyped buffer.
    pub fn into_bytes(self) -> NpuBuffer {
        self.buf
    }

    /// Host to device, blocking; `src.len()` must equal `len()`.
    pub fn copy_from_host(&mut self, src: &[T]) -> Result<()> {
        self.same_len("DeviceBuffer::copy_from_host", "src", src.len())?;
        self.buf.copy_from_host_at(0, bytemuck::cast_slice(src))
    }

    /// Device to host, after all queued work; `dst.len()` must equal `len()`.
    pub fn copy_to_host(&self, dst: &mut [T]) -> Result<()> {
        self.same_len("DeviceBuffer::copy_to_host", "dst", dst.len())?;
        self.buf.copy_to_host_at(0, bytemuck::cast_slice_mut(dst))
    }

    /// The elements, copied to a new host vector.
    pub fn to_vec(&self) -> Result<Vec<T>> {
        let mut v = Vec::new();
        let no_memory = |_| crate::backend::cpu::no_memory("DeviceBuffer::to_vec", self.buf.len_bytes());
        v.try_reserve_exact(self.len).map_err(no_memory)?;
        v.resize(self.len, T::default());
        self.copy_to_host(&mut v)?;
        Ok(v)
    }

    /// Device to device on this buffer's stream; `src.len()` must equal `len()`.
    pub fn copy_from_device(&mut self, src: &DeviceBuffer<T>) -> Result<()> {
        self.same_len("DeviceBuffer::copy_from_device", "src", src.len)?;
        self.buf.copy_from_device(0, &src.buf, 0, self.buf.len_bytes())
    }

    /// Host to device from pinned memory, queued on the stream.
    pub fn copy_from_pinned_async(&mut self, src: &PinnedHostBuffer) -> Result<()> {
        self.same_len("DeviceBuffer::copy_from_pinned_async", "src", src.len() / std::mem::size_of::<T>())?;
        self.buf.copy_from_pinned_async(0, src)
    }

    /// Device to pinned host memory, queued on the stream.
    pub fn copy_to_pinned_async(&self, dst: &mut PinnedHostBuffer) -> Result<()> {
        self.same_len("DeviceBuffer::copy_to_pinned_async", "dst", dst.len() / std::mem::size_of::<T>())?;
        self.buf.copy_to_pinned_async(0, dst)
    }

    fn same_len(&self, op: &'static str, arg: &'static str, n: usize) -> Result<()> {
        if n != self.len {
            return Err(Error::invalid(op, arg, format!("{n} elements, expected {}", self.len)));
        }
        Ok(())
    }
}

impl NpuDevice {
    /// `len` zero elements of `T`.
    pub fn alloc_zeros<T: Element>(&self, len: usize) -> Result<DeviceBuffer<T>> {
        DeviceBuffer::zeros(self, len)
    }

    /// A device copy of `data`.
    pub fn clone_htod<T: Element>(&self, data: &[T]) -> Result<DeviceBuffer<T>> {
        DeviceBuffer::from_host(self, data)
    }

    /// The elements of `buf`, copied to the host.
    pub fn clone_dtoh<T: Element>(&self, buf: &DeviceBuffer<T>) -> Result<Vec<T>> {
        buf.to_vec()
    }
}
