//! [`DeviceOps`]: the backends' ops on [`Tensor`]s, what [`Device::backend`]
//! returns.
//!
//! Written once for every [`Backend`]: each operand is lent to the backend as
//! a view of its own buffer (an error naming the op, the argument and both
//! devices when it lives elsewhere), and results are wrapped as tensors.

use crate::backend::cpu::CpuBackend;
use crate::backend::{Backend, FinalizeArgs, FinalizeDims, Mismatch, OutputRows};
use crate::tensor::{checked_bytes, StorageBuffer};
use crate::{DType, Device, Result, Tensor};

/// The device-side ops the MoE layer needs, on tensors of one device. See
/// [`Backend`] for what each computes.
pub trait DeviceOps {
    /// A zero-filled tensor on this device.
    fn zeros(&self, shape: &[usize], dtype: DType) -> Result<Tensor>;
    /// A zero-filled tensor an op makes for itself ([`Backend::scratch`]).
    fn scratch(&self, shape: &[usize], dtype: DType) -> Result<Tensor>;
    /// A tensor for an op's result that the op writes entirely
    /// ([`Backend::output`]): its contents are unspecified.
    fn output(&self, shape: &[usize], dtype: DType) -> Result<Tensor>;
    /// A copy of `src` (on any device) on this device.
    fn copy_from(&self, src: &Tensor) -> Result<Tensor>;
    /// A copy of the host tensor `src` an op made itself
    /// ([`Backend::scratch_from_host`]).
    fn scratch_from_host(&self, src: &Tensor) -> Result<Tensor>;
    /// [`Backend::copy_rows`].
    fn copy_rows(&self, src: &Tensor, src_row: usize, dst: &mut Tensor, dst_row: usize, rows: usize) -> Result<()>;
    /// [`Backend::add`].
    fn add(&self, a: &Tensor, b: &Tensor, out: &mut Tensor) -> Result<()>;
    /// [`Backend::finalize_routing`].
    fn finalize_routing(
        &self,
        args: &FinalizeArgs<&Tensor>,
        dims: &FinalizeDims,
        out: &mut Tensor,
        rows: OutputRows<'_>,
    ) -> Result<()>;
    /// [`Backend::expect_all_equal`].
    fn expect_all_equal(&self, values: &Tensor, expected: i32, mismatch: Mismatch) -> Result<()>;
    /// [`Backend::token_unpermute`].
    fn token_unpermute(
        &self,
        permuted: &Tensor,
        sorted_indices: &Tensor,
        probs: Option<&Tensor>,
        k: usize,
        out: &mut Tensor,
    ) -> Result<()>;
}

const FINALIZE: &str = "moe_finalize_routing";
const UNPERMUTE: &str = "moe_token_unpermute";

impl<B: Backend> DeviceOps for B
where
    B::Buffer: StorageBuffer,
{
    fn zeros(&self, shape: &[usize], dtype: DType) -> Result<Tensor> {
        let len = checked_bytes("Tensor::zeros", "shape", shape, dtype)?;
        Tensor::from_buffer(shape, dtype, Backend::zeros(self, len)?)
    }

    fn scratch(&self, shape: &[usize], dtype: DType) -> Result<Tensor> {
        let len = checked_bytes("Tensor::zeros", "shape", shape, dtype)?;
        Tensor::from_buffer(shape, dtype, Backend::scratch(self, len)?)
    }

    fn output(&self, shape: &[usize], dtype: DType) -> Result<Tensor> {
        let len = checked_bytes("Tensor::zeros", "shape", shape, dtype)?;
        Tensor::from_buffer(shape, dtype, Backend::output(self, len)?)
    }

    fn copy_from(&self, src: &Tensor) -> Result<Tensor> {
        let buf = match B::Buffer::of(src.storage()) {
            Some(b) => self.duplicate(b)?,
            None => self.upload(src.storage().to_host()?.as_bytes())?,
        };
        Tensor::from_buffer(src.shape(), src.dtype(), buf)
    }

    fn scratch_from_host(&self, src: &Tensor) -> Result<Tensor> {
        let buf = Backend::scratch_from_host(self, src.cpu_bytes()?)?;
        Tensor::from_buffer(src.shape(), src.dtype(), buf)
    }

    fn copy_rows(&self, src: &Tensor, src_row: usize, dst: &mut Tensor, dst_row: usize, rows: usize) -> Result<()> {
        const OP: &str = "copy_rows";
        let at = self.location();
        Backend::copy_rows(self, src.view(OP, "src", &at)?, src_row, dst.view_mut(OP, "dst", &at)?, dst_row, rows)
    }

    fn add(&self, a: &Tensor, b: &Tensor, out: &mut Tensor) -> Result<()> {
        const OP: &str = "add";
        let at = self.location();
        Backend::add(self, a.view(OP, "a", &at)?, b.view(OP, "b", &at)?, out.view_mut(OP, "out", &at)?)
    }

    fn finalize_routing(
        &self,
        args: &FinalizeArgs<&Tensor>,
        dims: &FinalizeDims,
        out: &mut Tensor,
        rows: OutputRows<'_>,
    ) -> Result<()> {
        let at = self.location();
        let views = args.try_map(|arg, t| t.view(FINALIZE, arg, &at))?;
        Backend::finalize_routing(self, &views, dims, out.view_mut(FINALIZE, "out", &at)?, rows)
    }

    fn expect_all_equal(&self, values: &Tensor, expected: i32, mismatch: Mismatch) -> Result<()> {
        let at = self.location();
        Backend::expect_all_equal(self, values.view("expect_all_equal", "values", &at)?, expected, mismatch)
    }

    fn token_unpermute(
        &self,
        permuted: &Tensor,
        sorted_indices: &Tensor,
        probs: Option<&Tensor>,
        k: usize,
        out: &mut Tensor,
    ) -> Result<()> {
        let at = self.location();
        let probs = probs.map(|p| p.view(UNPERMUTE, "probs", &at)).transpose()?;
        let (permuted, sorted_indices) =
            (permuted.view(UNPERMUTE, "permuted", &at)?, sorted_indices.view(UNPERMUTE, "sorted_indices", &at)?);
        Backend::token_unpermute(self, permuted, sorted_indices, probs, k, out.view_mut(UNPERMUTE, "out", &at)?)
    }
}

impl Device {
    /// The ops on tensors of this device.
    pub fn backend(&self) -> &(dyn DeviceOps + '_) {
        match self {
            Device::Cpu => &CpuBackend,
            Device::Npu(d) => d,
        }
    }
}
