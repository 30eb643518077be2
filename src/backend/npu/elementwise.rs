//! The NPU ops outside the finalize family: `add` (aclnnAdd) and the
//! device-side equality check the agreement checks use. Their operands and
//! aclnn's phase two go through [`super::operands`].

use super::aclnn::{Desc, Scalar};
use super::kernel as kernels;
use super::memory::NpuBuffer;
use super::operands::{npu_buf, run_phase_two, streams_of};
use super::result::aclnn as nn;
use super::result::aclnn::{op_missing, opapi};
use super::NpuDevice;
use crate::backend::{View, ViewMut};
use crate::{DType, Error, Result};

type In<'a> = View<'a, NpuBuffer>;
type Out<'a> = ViewMut<'a, NpuBuffer>;

/// `out = a + b` through aclnnAdd (alpha = 1).
pub(crate) fn add(device: &NpuDevice, a: In<'_>, b: In<'_>, out: Out<'_>) -> Result<()> {
    const OP: &str = "add";
    if a.dtype() != b.dtype() || a.dtype() != out.dtype() {
        return Err(Error::dtype(
            OP,
            if a.dtype() != b.dtype() { "b" } else { "out" },
            a.dtype().name(),
            if a.dtype() != b.dtype() { b.dtype() } else { out.dtype() },
        ));
    }
    if a.shape() != b.shape() || a.shape() != out.shape() {
        let bad = if a.shape() != b.shape() { ("b", b.shape()) } else { ("out", out.shape()) };
        return Err(Error::shape(OP, bad.0, format!("{:?}", a.shape()), bad.1));
    }
    if a.numel() == 0 {
        return Ok(());
    }
    let api = opapi()?;
    let add = api.add.ok_or_else(|| op_missing("aclnnAdd", api))?;
    let shape = [a.numel()];
    let da = Desc::new(npu_buf(device, OP, "a", a.buf())?, a.dtype(), &shape)?;
    let db = Desc::new(npu_buf(device, OP, "b", b.buf())?, b.dtype(), &shape)?;
    let dout = Desc::new(npu_buf(device, OP, "out", out.buf())?, out.dtype(), &shape)?;
    let alpha = Scalar::one(a.dtype())?;
    // SAFETY: all descriptors are live until phase two ran.
    let (ws, exec) = unsafe { nn::add_get_workspace_size(&add, da.raw, db.raw, alpha.raw, dout.raw) }?;
    run_phase_two(device, "aclnnAdd", add.run, ws, exec)?;
    device.stream().order_operand_streams_after(&streams_of(device.stream(), [a.buf(), b.buf(), out.buf()]))
}

/// [`crate::backend::Backend::expect_all_equal`] on the device: the values
/// are copied into windows of `CTX_WORDS` words of workspace and the guard
/// kernel compares each window with `expected`, its record read by the
/// stream check. Enqueues a copy and one launch per window; no sync.
pub(crate) fn expect_all_equal(
    device: &NpuDevice,
    values: In<'_>,
    expected: i32,
    mismatch: crate::backend::Mismatch,
) -> Result<()> {
    const OP: &str = "expect_all_equal";
    use kernels::guard::{decode_guard_status, GuardTiling, CTX_WORDS, GUARD_NO_ALT, GUARD_TILING_MAGIC};
    if values.dtype() != DType::I32 {
        return Err(Error::dtype(OP, "values", "i32", values.dtype()));
    }
    let n = values.numel();
    if n == 0 {
        return Ok(());
    }
    let src = npu_buf(device, OP, "values", values.buf())?;
    let windows = n.div_ceil(CTX_WORDS);
    let words = NpuBuffer::workspace(device, windows * CTX_WORDS * 4)?;
    words.copy_from_device(0, src, 0, n * 4)?;
    let mismatch = std::sync::Arc::new(mismatch);
    for w in 0..windows {
        let first = w * CTX_WORDS;
        let count = (n - first).min(CTX_WORDS);
        let mut mask = [0u32; CTX_WORDS / 32];
        for i in 0..count {
            mask[i / 32] |= 1 << (i % 32);
        }
        let tiling = GuardTiling {
            magic: GUARD_TILING_MAGIC,
            words: CTX_WORDS as u32,
            mask,
            expected: [expected as u32; CTX_WORDS],
            alt_word: GUARD_NO_ALT,
            alt_value: 0,
        };
        let m = mismatch.clone();
        let decode = Box::new(move |rec: &[u32]| decode_guard_status(OP, rec, |i, v, _| m(None, first + i, v as i32)));
        let at = words.as_ptr().cast::<u8>().wrapping_add(first * 4).cast();
        super::device_check::guard_words(device.stream(), at, &tiling, decode)?;
    }
    device.stream().order_operand_streams_after(&streams_of(device.stream(), [src]))
}
