//! The CPU backend: the reference implementation of every op, and the
//! production fallback where no NPU is present.

pub mod comm;
pub mod finalize;

use crate::backend::args::check_rows;
use crate::backend::{Backend, FinalizeArgs, FinalizeDims, OutputRows};
use crate::tensor::{CpuBuffer, Storage};
use crate::types::TensorMeta;
use crate::{with_dtype, DType, Element, Error, Result, Tensor};

pub use comm::CpuComm;

/// The CPU backend (stateless; threads come from the global pool).
#[derive(Debug, Clone, Copy, Default)]
pub struct CpuBackend;

/// Host bytes of `t`, or a device error naming `arg`.
pub(crate) fn host<'a>(op: &'static str, arg: &'static str, t: &'a Tensor) -> Result<&'a [u8]> {
    t.cpu_bytes().map_err(|_| Error::Device { op, arg, expected: "cpu".into(), actual: t.device().to_string() })
}

/// Host bytes of `t`, mutable.
pub(crate) fn host_mut<'a>(op: &'static str, arg: &'static str, t: &'a mut Tensor) -> Result<&'a mut [u8]> {
    let dev = t.device().to_string();
    t.cpu_bytes_mut().map_err(|_| Error::Device { op, arg, expected: "cpu".into(), actual: dev })
}

impl Backend for CpuBackend {
    fn zeros(&self, shape: &[usize], dtype: DType) -> Result<Tensor> {
        Tensor::try_zeros_cpu(shape, dtype)
    }

    fn copy_from(&self, src: &Tensor) -> Result<Tensor> {
        match src.storage() {
            Storage::Cpu(b) => Tensor::from_parts(src.shape().to_vec(), src.dtype(), Storage::Cpu(b.clone())),
            Storage::Npu(b) => {
                let mut host = CpuBuffer::zeros(src.len_bytes());
                b.copy_to_host(host.as_bytes_mut())?;
                Tensor::from_parts(src.shape().to_vec(), src.dtype(), Storage::Cpu(host))
            }
        }
    }

    fn copy_rows(&self, src: &Tensor, src_row: usize, dst: &mut Tensor, dst_row: usize, rows: usize) -> Result<()> {
        const OP: &str = "copy_rows";
        check_rows(OP, TensorMeta::of(src), src_row, TensorMeta::of(dst), dst_row, rows)?;
        let row_bytes = src.row_len() * src.dtype().size();
        let s = host(OP, "src", src)?;
        let d = host_mut(OP, "dst", dst)?;
        d[dst_row * row_bytes..(dst_row + rows) * row_bytes]
            .copy_from_slice(&s[src_row * row_bytes..(src_row + rows) * row_bytes]);
        Ok(())
    }

    fn add(&self, a: &Tensor, b: &Tensor, out: &mut Tensor) -> Result<()> {
        const OP: &str = "add";
        check_same(OP, "b", a, b)?;
        check_same(OP, "out", a, out)?;
        with_dtype!(a.dtype(), T => {
            let (x, y) = (a.as_slice::<T>()?, b.as_slice::<T>()?);
            let o = out.as_mut_slice::<T>()?;
            for ((o, x), y) in o.iter_mut().zip(x).zip(y) {
                *o = T::from_f32(x.to_f32() + y.to_f32());
            }
        });
        Ok(())
    }

    fn finalize_routing(
        &self,
        args: &FinalizeArgs<'_>,
        dims: &FinalizeDims,
        out: &mut Tensor,
        rows: OutputRows<'_>,
    ) -> Result<()> {
        finalize::finalize_routing(args, dims, out, rows)
    }

    fn token_unpermute(
        &self,
        permuted: &Tensor,
        sorted_indices: &Tensor,
        probs: Option<&Tensor>,
        k: usize,
        out: &mut Tensor,
    ) -> Result<()> {
        finalize::token_unpermute(permuted, sorted_indices, probs, k, out)
    }
}

fn check_same(op: &'static str, arg: &'static str, a: &Tensor, b: &Tensor) -> Result<()> {
    if a.dtype() != b.dtype() {
        return Err(Error::dtype(op, arg, a.dtype().name(), b.dtype()));
    }
    if a.shape() != b.shape() {
        return Err(Error::shape(op, arg, format!("{:?}", a.shape()), b.shape()));
    }
    Ok(())
}
