//! What every NPU op shares: the operand check ([`npu_buf`]), aclnn's phase
//! two, and the host copies and index checks where no kernel can check on
//! the device. Every op queues its work on the stream of its call and
//! returns: workspace comes from the stream's pool (or the caller's
//! allocator) and goes back without a synchronisation, since its next user
//! is queued after this op on the same stream; what the device finds (the
//! kernels' status words) is reported by the stream's check.

use acl_sys::aclnn::{self, aclOpExecutor};

use super::memory::NpuBuffer;
use super::result::aclnn as nn;
use super::runtime::NpuStream;
use super::NpuDevice;
use crate::backend::cpu::CpuBuffer;
use crate::backend::View;
use crate::{Error, Result};

type In<'a> = View<'a, NpuBuffer>;

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

/// The streams of `bufs` (the streams their own work is queued on) other
/// than `op`, the stream the op runs on, each once: empty, and without
/// allocating, when every operand is on `op` (the usual case).
pub(crate) fn streams_of<'a>(op: &NpuStream, bufs: impl IntoIterator<Item = &'a NpuBuffer>) -> Vec<NpuStream> {
    let mut others: Vec<NpuStream> = Vec::new();
    for s in bufs.into_iter().map(NpuBuffer::stream) {
        if !s.same_as(op) && !others.iter().any(|o| o.same_as(s)) {
            others.push(s.clone());
        }
    }
    others
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
