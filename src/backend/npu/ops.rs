//! The NPU ops other than the finalize family, and what every op shares:
//! the operand check ([`npu_buf`]), aclnn's phase two, host copies where no
//! kernel can check on the device. Every op queues its work on the stream of
//! its call and returns: workspace comes from the stream's pool (or the
//! caller's allocator) and goes back without a synchronisation, since its
//! next user is queued after this op on the same stream; what the device
//! finds (the kernels' status words) is reported by the stream's check.

use acl_sys::aclnn::{self, aclOpExecutor};

use super::aclnn::{Desc, Scalar};
use super::kernel as kernels;
use super::memory::NpuBuffer;
use super::result::aclnn as nn;
use super::result::aclnn::{op_missing, opapi};
use super::NpuDevice;
use crate::backend::cpu::CpuBuffer;
use crate::backend::{View, ViewMut};
use crate::{DType, Error, Result};

type In<'a> = View<'a, NpuBuffer>;
type Out<'a> = ViewMut<'a, NpuBuffer>;

/// `b`, which must be on `device`, after making `device`'s stream wait for
/// the work queued on `b`'s.
pub(crate) fn npu_buf<'a>(
    device: &NpuDevice,
    op: &'static str,
    arg: &'static str,
    b: &'a NpuBuffer,
) -> Result<&'a NpuBuffer> {
    if b.device().ordinal() != device.ordinal() {
        return Err(Error::Device {
            op,
            arg,
            expected: format!("npu:{}", device.ordinal()),
            actual: format!("npu:{}", b.device().ordinal()),
        });
    }
    device.stream().wait_for(b.stream())?;
    Ok(b)
}

/// Runs phase two with a workspace of `ws` bytes.
pub(super) fn run_phase_two(
    device: &NpuDevice,
    call: &'static str,
    run: aclnn::aclnnRun_fn,
    ws: u64,
    executor: *mut aclOpExecutor,
) -> Result<()> {
    let workspace = NpuBuffer::workspace(device, ws as usize)?;
    let stream = device.stream();
    stream.enter()?;
    // SAFETY: the executor came from phase one of the same op; the workspace
    // holds `ws` bytes (or is NULL for 0); its block is reused only by work
    // queued after this on the same stream.
    unsafe { nn::run(call, run, workspace.as_ptr(), ws, executor, stream.raw()) }
}

/// Reads an int32 index tensor to the host, to validate index values before
/// an aclnn call (aclnn checks shapes and dtypes, never data values) where no
/// native kernel can launch to check them on the device. A device-to-host
/// copy and a stream synchronisation: the one place an op makes them.
/// Refused while the stream is captured into a graph (a host read cannot be
/// captured, and a replay would not repeat it).
pub(super) fn read_indices_to_host_for_validation(device: &NpuDevice, op: &'static str, t: In<'_>) -> Result<Vec<i32>> {
    if device.stream().is_capturing()? {
        return Err(Error::invalid(
            op,
            "stream",
            "the aclnn path validates index values on the host, which cannot be captured into a graph; \
             use the native finalize (ASCEND_MOE_NPU_FINALIZE=native), which checks them on the device",
        ));
    }
    Ok(host_copy(op, t)?.typed::<i32>().to_vec())
}

/// A host copy of `t`'s bytes (waiting for them).
pub(super) fn host_copy(op: &'static str, t: In<'_>) -> Result<CpuBuffer> {
    let mut host = CpuBuffer::try_zeros(op, t.len_bytes())?;
    t.buf().copy_to_host(host.as_bytes_mut())?;
    Ok(host)
}

pub(super) fn check_indices(op: &'static str, arg: &'static str, idx: &[i32], lo: i64, hi: i64) -> Result<()> {
    if let Some((position, &v)) = idx.iter().enumerate().find(|(_, &v)| (v as i64) < lo || (v as i64) >= hi) {
        return Err(Error::IndexOutOfRange { op, arg, position, value: v as i64, valid: format!("[{lo}, {hi})") });
    }
    Ok(())
}

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
    run_phase_two(device, "aclnnAdd", add.run, ws, exec)
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
    use kernels::guard::{decode_guard_status, GuardTiling, CTX_WORDS, GUARD_TILING_MAGIC};
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
        };
        let m = mismatch.clone();
        let decode = Box::new(move |rec: &[u32]| decode_guard_status(OP, rec, |i, v, _| m(None, first + i, v as i32)));
        let at = words.as_ptr().cast::<u8>().wrapping_add(first * 4).cast();
        super::device_check::guard_words(device.stream(), at, &tiling, decode)?;
    }
    Ok(())
}
