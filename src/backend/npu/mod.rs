//! The NPU backend: safe ACL / HCCL wrappers and the ops on an Ascend device.
//!
//! Everything here loads CANN at run time (real CANN, or the simulated
//! runtime named by `ASCEND_MOE_{ACL,HCCL,NNOPBASE,OPAPI}_LIB`); when it is
//! absent every entry point returns [`Error::Unavailable`] naming the paths
//! that were tried.
//!
//! | module | holds |
//! |---|---|
//! | [`result`] | the result layer: each ACL, HCCL and aclnn C function wrapped once, returning `Result` |
//! | [`runtime`] | loading, ACL errors, per-thread device binding, [`NpuStream`], [`NpuEvent`] |
//! | [`memory`] | [`NpuBuffer`], [`DeviceBuffer`], [`PinnedHostBuffer`] |
//! | [`live_context`] | `LiveContext`: the live forward context on the device and the guards of captured ops |
//! | [`hccl`] | [`HcclRootInfo`], [`HcclComm`] and its collectives, [`npu_run_ranks`] |
//! | `aclnn` | the aclnn operands: tensor descriptors and scalars, destroyed on drop |
//! | `ops` | aclnn calls behind [`Backend`] |
//! | [`probe`] | [`probe_report`]: which CANN pieces were found, and where we looked |

mod aclnn;
mod device_check;
pub mod hccl;
pub mod kernel;
pub mod live_context;
pub mod memory;
mod ops;
pub mod pool;
pub mod probe;
pub mod result;
pub mod runtime;

use std::sync::Arc;

pub use aclnn::acl_dtype;
pub use hccl::{npu_run_ranks, HcclComm, HcclRootInfo};
pub use memory::{DeviceBuffer, NpuBuffer, PinnedHostBuffer};
pub use ops::{FinalizeImpl, FINALIZE_ENV};
pub use pool::{Allocator, PoolStats, WORKSPACE_ALIGN};
pub use probe::{probe, probe_report, ProbeReport};
pub use runtime::{device_count, take_drop_errors, DeviceCtx, NpuEvent, NpuStream};

use crate::backend::args::check_rows;
use crate::backend::{Backend, FinalizeArgs, FinalizeDims, OutputRows};
use crate::tensor::Storage;
use crate::types::TensorMeta;
use crate::{DType, Element, Error, Result, Tensor};

/// One Ascend device plus the stream its backend ops run on.
///
/// Cheap to clone (shared handles). Every call binds the device to the
/// calling thread first, so a device may be used from any thread.
#[derive(Clone)]
pub struct NpuDevice {
    ctx: Arc<DeviceCtx>,
    stream: NpuStream,
    finalize: Option<FinalizeImpl>,
}

impl std::fmt::Debug for NpuDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NpuDevice(npu:{}, {:?})", self.ordinal(), self.stream)
    }
}

impl NpuDevice {
    /// Opens device `ordinal` with a new stream of its own.
    pub fn open(ordinal: u32) -> Result<Self> {
        let ctx = DeviceCtx::open(ordinal)?;
        let stream = NpuStream::create(&ctx)?;
        Ok(NpuDevice { ctx, stream, finalize: None })
    }

    /// Opens device `ordinal` on a stream owned by the host engine (e.g.
    /// torch_npu's current stream); the stream is never destroyed by us.
    ///
    /// # Safety
    /// `raw_stream` must be a live stream of device `ordinal` (or NULL for the
    /// default stream) that outlives every handle derived from this device.
    pub unsafe fn with_borrowed_stream(ordinal: u32, raw_stream: acl_sys::aclrtStream) -> Result<Self> {
        let ctx = DeviceCtx::open(ordinal)?;
        // SAFETY: forwarded from this function's contract.
        let stream = unsafe { NpuStream::borrow_raw(&ctx, raw_stream) };
        Ok(NpuDevice { ctx, stream, finalize: None })
    }

    /// This handle with its finalize routing forced to `imp` (overriding
    /// `ASCEND_MOE_NPU_FINALIZE` and the automatic choice).
    pub fn with_finalize_impl(mut self, imp: FinalizeImpl) -> Self {
        self.finalize = Some(imp);
        self
    }

    pub(crate) fn finalize_override(&self) -> Option<FinalizeImpl> {
        self.finalize
    }

    /// The finalize implementation this handle uses: `"native"` (the Ascend C
    /// kernel, launched through the AI Core build or the simulated runtime) or
    /// `"aclnn"` (aclnnMoeFinalizeRoutingV2). Forced by
    /// [`with_finalize_impl`](Self::with_finalize_impl), else by
    /// `ASCEND_MOE_NPU_FINALIZE=native|aclnn`, else native when it can be
    /// launched here. An invalid `ASCEND_MOE_NPU_FINALIZE` is reported as an error.
    pub fn finalize_impl(&self) -> Result<&'static str> {
        ops::choose_finalize(self.finalize).map(FinalizeImpl::name)
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> u32 {
        self.ctx.ordinal()
    }

    /// Makes this device current on the calling thread (`aclrtSetDevice`).
    /// Every call of this module does it itself; this is for code that calls
    /// ACL directly.
    pub fn set_current(&self) -> Result<()> {
        self.ctx.bind()
    }

    /// The stream the backend ops of this handle run on.
    pub fn stream(&self) -> &NpuStream {
        &self.stream
    }

    /// A new owned stream on this device.
    pub fn new_stream(&self) -> Result<NpuStream> {
        NpuStream::create(&self.ctx)
    }

    /// Waits for all work queued on this handle's stream.
    pub fn synchronize(&self) -> Result<()> {
        self.stream.synchronize()
    }

    /// The sync point of this handle's stream: waits for its work and returns
    /// the first error the device recorded for it since the last check (see
    /// [`NpuStream::check`]).
    pub fn check(&self) -> Result<()> {
        self.stream.check()
    }

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

    /// `(free, total)` bytes of device memory.
    pub fn mem_info(&self) -> Result<(usize, usize)> {
        self.stream.enter()?;
        result::acl::get_mem_info(acl_sys::aclrtMemAttr::ACL_HBM_MEM)
    }

    /// A device tensor holding a copy of the host tensor `src`.
    pub(crate) fn upload(&self, src: &Tensor) -> Result<Tensor> {
        let buf = NpuBuffer::alloc(self, src.len_bytes())?;
        buf.copy_from_host_at(0, src.cpu_bytes()?)?;
        Tensor::from_parts(src.shape().to_vec(), src.dtype(), Storage::Npu(buf))
    }
}

fn shape_bytes(shape: &[usize], dtype: DType) -> Result<usize> {
    shape
        .iter()
        .try_fold(dtype.size(), |a, &d| a.checked_mul(d))
        .ok_or_else(|| Error::invalid("zeros", "shape", format!("{shape:?} overflows the address space")))
}

impl Backend for NpuDevice {
    fn zeros(&self, shape: &[usize], dtype: DType) -> Result<Tensor> {
        let bytes = shape_bytes(shape, dtype)?;
        let buf = NpuBuffer::zeros(self, bytes)?;
        Tensor::from_parts(shape.to_vec(), dtype, Storage::Npu(buf))
    }

    fn scratch(&self, shape: &[usize], dtype: DType) -> Result<Tensor> {
        let buf = NpuBuffer::workspace_zeros(self, shape_bytes(shape, dtype)?)?;
        Tensor::from_parts(shape.to_vec(), dtype, Storage::Npu(buf))
    }

    fn scratch_from_host(&self, src: &Tensor) -> Result<Tensor> {
        let bytes = src.cpu_bytes()?;
        let buf = NpuBuffer::workspace(self, bytes.len())?;
        self.stream().stage_to_device(bytes, buf.as_ptr(), buf.len_bytes())?;
        Tensor::from_parts(src.shape().to_vec(), src.dtype(), Storage::Npu(buf))
    }

    fn copy_from(&self, src: &Tensor) -> Result<Tensor> {
        match src.storage() {
            Storage::Cpu(_) => self.upload(src),
            // A device copy is an op's own result or intermediate (a consumed
            // input it must not modify): workspace of this stream, like
            // `scratch`, so it neither allocates nor synchronises.
            Storage::Npu(b) => {
                let buf = NpuBuffer::workspace(self, b.len_bytes())?;
                buf.copy_from_device(0, b, 0, b.len_bytes())?;
                Tensor::from_parts(src.shape().to_vec(), src.dtype(), Storage::Npu(buf))
            }
        }
    }

    fn copy_rows(&self, src: &Tensor, src_row: usize, dst: &mut Tensor, dst_row: usize, rows: usize) -> Result<()> {
        const OP: &str = "copy_rows";
        check_rows(OP, TensorMeta::of(src), src_row, TensorMeta::of(dst), dst_row, rows)?;
        let row_bytes = src.row_len() * src.dtype().size();
        let s = ops::npu_buf(self, OP, "src", src)?;
        let d = ops::npu_buf(self, OP, "dst", dst)?;
        d.copy_from_device(dst_row * row_bytes, s, src_row * row_bytes, rows * row_bytes)
    }

    fn add(&self, a: &Tensor, b: &Tensor, out: &mut Tensor) -> Result<()> {
        ops::add(self, a, b, out)
    }

    fn finalize_routing(
        &self,
        args: &FinalizeArgs<'_>,
        dims: &FinalizeDims,
        out: &mut Tensor,
        rows: OutputRows<'_>,
    ) -> Result<()> {
        ops::finalize_routing(self, args, dims, out, rows)
    }

    fn token_unpermute(
        &self,
        permuted: &Tensor,
        sorted_indices: &Tensor,
        probs: Option<&Tensor>,
        k: usize,
        out: &mut Tensor,
    ) -> Result<()> {
        ops::token_unpermute(self, permuted, sorted_indices, probs, k, out)
    }

    fn expect_all_equal(&self, values: &Tensor, expected: i32, mismatch: crate::backend::Mismatch) -> Result<()> {
        ops::expect_all_equal(self, values, expected, mismatch)
    }
}
