//! [`Backend`] for [`NpuDevice`]: device memory of the device, ops on its
//! stream (see `ops`).

use super::memory::NpuBuffer;
use super::NpuDevice;
use super::{elementwise, finalize, operands};
use crate::backend::args::check_rows;
use crate::backend::{Backend, FinalizeArgs, FinalizeDims, OutputRows, View, ViewMut};
use crate::Result;

type In<'a> = View<'a, NpuBuffer>;
type Out<'a> = ViewMut<'a, NpuBuffer>;

impl Backend for NpuDevice {
    type Buffer = NpuBuffer;

    fn location(&self) -> String {
        format!("npu:{}", self.ordinal())
    }

    fn zeros(&self, len: usize) -> Result<NpuBuffer> {
        NpuBuffer::zeros(self, len)
    }

    fn scratch(&self, len: usize) -> Result<NpuBuffer> {
        NpuBuffer::workspace_zeros(self, len)
    }

    fn upload(&self, bytes: &[u8]) -> Result<NpuBuffer> {
        let buf = NpuBuffer::alloc(self, bytes.len())?;
        buf.copy_from_host_at(0, bytes)?;
        Ok(buf)
    }

    fn scratch_from_host(&self, bytes: &[u8]) -> Result<NpuBuffer> {
        let buf = NpuBuffer::workspace(self, bytes.len())?;
        self.stream().stage_to_device(bytes, buf.as_ptr(), buf.len_bytes())?;
        Ok(buf)
    }

    // A device copy is an op's own result or intermediate (a consumed input
    // it must not modify): workspace of this stream, like `scratch`, so it
    // neither allocates nor synchronises.
    fn duplicate(&self, src: &NpuBuffer) -> Result<NpuBuffer> {
        let buf = NpuBuffer::workspace(self, src.len_bytes())?;
        buf.copy_from_device(0, src, 0, src.len_bytes())?;
        Ok(buf)
    }

    fn to_host(&self, src: &NpuBuffer, dst: &mut [u8]) -> Result<()> {
        src.copy_to_host(dst)
    }

    fn copy_rows(&self, src: In<'_>, src_row: usize, dst: Out<'_>, dst_row: usize, rows: usize) -> Result<()> {
        const OP: &str = "copy_rows";
        check_rows(OP, src.meta(), src_row, dst.meta(), dst_row, rows)?;
        let row_bytes = src.row_len() * src.dtype().size();
        let s = operands::npu_buf(self, OP, "src", src.buf())?;
        let d = operands::npu_buf(self, OP, "dst", dst.buf())?;
        d.copy_from_device(dst_row * row_bytes, s, src_row * row_bytes, rows * row_bytes)
    }

    fn add(&self, a: In<'_>, b: In<'_>, out: Out<'_>) -> Result<()> {
        elementwise::add(self, a, b, out)
    }

    fn finalize_routing(
        &self,
        args: &FinalizeArgs<In<'_>>,
        dims: &FinalizeDims,
        out: Out<'_>,
        rows: OutputRows<'_>,
    ) -> Result<()> {
        finalize::finalize_routing(self, args, dims, out, rows)
    }

    fn token_unpermute(
        &self,
        permuted: In<'_>,
        sorted_indices: In<'_>,
        probs: Option<In<'_>>,
        k: usize,
        out: Out<'_>,
    ) -> Result<()> {
        finalize::token_unpermute(self, permuted, sorted_indices, probs, k, out)
    }

    fn expect_all_equal(&self, values: In<'_>, expected: i32, mismatch: crate::backend::Mismatch) -> Result<()> {
        elementwise::expect_all_equal(self, values, expected, mismatch)
    }
}
