//! The NPU backend: safe ACL / HCCL wrappers and the ops on an Ascend device.
//!
//! Everything here loads CANN at run time; when it is absent every entry point
//! returns [`Error::Unavailable`] naming the paths that were tried.

use crate::backend::{Backend, FinalizeArgs, FinalizeDims, OutputRows};
use crate::{DType, Error, Result, Tensor};

/// One Ascend device (an ordinal plus its runtime state).
#[derive(Debug, Clone)]
pub struct NpuDevice {
    ordinal: u32,
}

impl NpuDevice {
    /// Opens device `ordinal`.
    pub fn open(ordinal: u32) -> Result<Self> {
        let _ = ordinal;
        Err(Error::Unavailable("the NPU backend is not built yet".into()))
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> u32 {
        self.ordinal
    }
}

/// Device memory owned by a tensor.
#[derive(Debug)]
pub struct NpuBuffer {
    device: NpuDevice,
    len: usize,
}

impl NpuBuffer {
    /// Size in bytes.
    pub fn len_bytes(&self) -> usize {
        self.len
    }
    /// The owning device.
    pub fn device(&self) -> &NpuDevice {
        &self.device
    }
}

/// An HCCL communicator.
#[derive(Debug, Clone)]
pub struct HcclComm {
    device: NpuDevice,
}

impl crate::comm::Collectives for HcclComm {
    fn rank(&self) -> usize {
        0
    }
    fn world_size(&self) -> usize {
        1
    }
    fn name(&self) -> &str {
        "hccl"
    }
    fn device(&self) -> crate::Device {
        crate::Device::Npu(self.device.clone())
    }
    fn split(&self, _ranks: &[usize]) -> Result<crate::Comm> {
        Err(unavailable())
    }
    fn all_reduce(&self, _s: &Tensor, _d: &mut Tensor, _op: crate::ReduceOp) -> Result<()> {
        Err(unavailable())
    }
    fn all_reduce_in_place(&self, _b: &mut Tensor, _op: crate::ReduceOp) -> Result<()> {
        Err(unavailable())
    }
    fn reduce_scatter(&self, _s: &Tensor, _d: &mut Tensor, _op: crate::ReduceOp) -> Result<()> {
        Err(unavailable())
    }
    fn all_gather(&self, _s: &Tensor, _d: &mut Tensor) -> Result<()> {
        Err(unavailable())
    }
    fn reduce_scatter_v(&self, _s: &Tensor, _d: &mut Tensor, _c: &[usize], _op: crate::ReduceOp) -> Result<()> {
        Err(unavailable())
    }
    fn all_gather_v(&self, _s: &Tensor, _d: &mut Tensor, _c: &[usize]) -> Result<()> {
        Err(unavailable())
    }
    fn all_to_all_v(&self, _s: &Tensor, _sc: &[usize], _d: &mut Tensor, _rc: &[usize]) -> Result<()> {
        Err(unavailable())
    }
    fn broadcast(&self, _b: &mut Tensor, _root: usize) -> Result<()> {
        Err(unavailable())
    }
    fn barrier(&self) -> Result<()> {
        Err(unavailable())
    }
}

fn unavailable() -> Error {
    Error::Unavailable("the NPU backend is not built yet".into())
}

impl Backend for NpuDevice {
    fn zeros(&self, _shape: &[usize], _dtype: DType) -> Result<Tensor> {
        Err(unavailable())
    }
    fn copy_from(&self, _src: &Tensor) -> Result<Tensor> {
        Err(unavailable())
    }
    fn copy_rows(&self, _src: &Tensor, _sr: usize, _dst: &mut Tensor, _dr: usize, _rows: usize) -> Result<()> {
        Err(unavailable())
    }
    fn add(&self, _a: &Tensor, _b: &Tensor, _out: &mut Tensor) -> Result<()> {
        Err(unavailable())
    }
    fn finalize_routing(
        &self,
        _args: &FinalizeArgs<'_>,
        _dims: &FinalizeDims,
        _out: &mut Tensor,
        _rows: OutputRows<'_>,
    ) -> Result<()> {
        Err(unavailable())
    }
    fn token_unpermute(
        &self,
        _permuted: &Tensor,
        _sorted_indices: &Tensor,
        _probs: Option<&Tensor>,
        _k: usize,
        _out: &mut Tensor,
    ) -> Result<()> {
        Err(unavailable())
    }
}

impl NpuBuffer {
    /// Copies the whole buffer to host memory (synchronising its stream).
    pub fn copy_to_host(&self, _dst: &mut [u8]) -> Result<()> {
        Err(unavailable())
    }
}
