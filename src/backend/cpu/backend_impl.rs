//! [`Backend`] for [`CpuBackend`]: host memory, and the reference ops.

use super::finalize;
use super::CpuBuffer;
use crate::backend::args::check_rows;
use crate::backend::{Backend, FinalizeArgs, FinalizeDims, OutputRows, View, ViewMut};
use crate::{with_dtype, DType, Element, Error, Result};

/// The CPU backend.
#[derive(Debug, Clone, Copy, Default)]
pub struct CpuBackend;

type In<'a> = View<'a, CpuBuffer>;
type Out<'a> = ViewMut<'a, CpuBuffer>;

impl Backend for CpuBackend {
    type Buffer = CpuBuffer;

    fn location(&self) -> String {
        "cpu".into()
    }

    fn zeros(&self, len: usize) -> Result<CpuBuffer> {
        CpuBuffer::try_zeros("Tensor::zeros", len)
    }

    fn output(&self, len: usize) -> Result<CpuBuffer> {
        CpuBuffer::try_output("Tensor::output", len)
    }

    fn upload(&self, bytes: &[u8]) -> Result<CpuBuffer> {
        CpuBuffer::try_from_bytes("copy_from", bytes)
    }

    fn duplicate(&self, src: &CpuBuffer) -> Result<CpuBuffer> {
        CpuBuffer::try_from_bytes("Tensor::try_clone", src.as_bytes())
    }

    fn to_host(&self, src: &CpuBuffer, dst: &mut [u8]) -> Result<()> {
        if dst.len() != src.len() {
            return Err(Error::invalid("to_host", "dst", format!("{} bytes for a buffer of {}", dst.len(), src.len())));
        }
        dst.copy_from_slice(src.as_bytes());
        Ok(())
    }

    fn copy_rows(&self, src: In<'_>, src_row: usize, mut dst: Out<'_>, dst_row: usize, rows: usize) -> Result<()> {
        const OP: &str = "copy_rows";
        check_rows(OP, src.meta(), src_row, dst.meta(), dst_row, rows)?;
        let row_bytes = src.row_len() * src.dtype().size();
        let s = src.bytes();
        dst.bytes_mut()[dst_row * row_bytes..(dst_row + rows) * row_bytes]
            .copy_from_slice(&s[src_row * row_bytes..(src_row + rows) * row_bytes]);
        Ok(())
    }

    fn add(&self, a: In<'_>, b: In<'_>, mut out: Out<'_>) -> Result<()> {
        const OP: &str = "add";
        check_same(OP, "b", &a, &b)?;
        check_same(OP, "out", &a, &out.as_view())?;
        // Integers add exactly (an f32 holds only 24 bits of them), wrapping
        // on overflow; every other dtype through f32, rounded once.
        macro_rules! exact {
            ($T:ty) => {{
                let (x, y) = (a.typed::<$T>(OP, "a")?, b.typed::<$T>(OP, "b")?);
                for ((o, x), y) in out.typed_mut::<$T>(OP, "out")?.iter_mut().zip(x).zip(y) {
                    *o = x.wrapping_add(*y);
                }
            }};
        }
        match a.dtype() {
            DType::I32 => exact!(i32),
            DType::I64 => exact!(i64),
            DType::I8 => exact!(i8),
            DType::U8 => exact!(u8),
            d => with_dtype!(d, T => {
                let (x, y) = (a.typed::<T>(OP, "a")?, b.typed::<T>(OP, "b")?);
                let o = out.typed_mut::<T>(OP, "out")?;
                for ((o, x), y) in o.iter_mut().zip(x).zip(y) {
                    *o = T::from_f32(x.to_f32() + y.to_f32());
                }
            }),
        }
        Ok(())
    }

    fn finalize_routing(
        &self,
        args: &FinalizeArgs<In<'_>>,
        dims: &FinalizeDims,
        out: Out<'_>,
        rows: OutputRows<'_>,
    ) -> Result<()> {
        finalize::finalize_routing(args, dims, out, rows)
    }

    fn token_unpermute(
        &self,
        permuted: In<'_>,
        sorted_indices: In<'_>,
        probs: Option<In<'_>>,
        k: usize,
        out: Out<'_>,
    ) -> Result<()> {
        finalize::token_unpermute(permuted, sorted_indices, probs, k, out)
    }
}

fn check_same(op: &'static str, arg: &'static str, a: &In<'_>, b: &In<'_>) -> Result<()> {
    if a.dtype() != b.dtype() {
        return Err(Error::dtype(op, arg, a.dtype().name(), b.dtype()));
    }
    if a.shape() != b.shape() {
        return Err(Error::shape(op, arg, format!("{:?}", a.shape()), b.shape()));
    }
    Ok(())
}
