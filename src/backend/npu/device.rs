//! [`NpuDevice`]: one Ascend device plus the stream its backend ops run on.

use std::sync::Arc;

use super::launch::{choose_finalize, FinalizeImpl};
use super::runtime::{DeviceCtx, NpuStream};
use crate::{Error, Result};

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
    /// A stream of another device is refused here, as
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) naming
    /// `raw_stream` and `ordinal`, rather than at its first op: asked about
    /// its capture status (`aclmdlRICaptureGetInfo`, no wait) with `ordinal`
    /// bound, the runtime answers `ACL_ERROR_RT_STREAM_CONTEXT`
    /// (`ApiImpl::StreamGetCaptureInfo`, hicann/runtime
    /// `src/runtime/feature/src/api_impl/api_impl.cc:7835-7836` at v8.5.0).
    /// The default stream, and any stream on a runtime without the capture
    /// API, are not asked.
    ///
    /// # Safety
    /// `raw_stream` must be a live stream of device `ordinal` (or NULL for the
    /// default stream) that outlives every handle derived from this device.
    pub unsafe fn with_borrowed_stream(ordinal: u32, raw_stream: acl_sys::aclrtStream) -> Result<Self> {
        let ctx = DeviceCtx::open(ordinal)?;
        // SAFETY: forwarded from this function's contract.
        let stream = unsafe { NpuStream::borrow_raw(&ctx, raw_stream) };
        stream.is_capturing().map_err(|e| match e {
            Error::Acl { code: acl_sys::ACL_ERROR_RT_STREAM_CONTEXT, msg, .. } => Error::invalid(
                "NpuDevice::with_borrowed_stream",
                "raw_stream",
                format!("{raw_stream:p} is not a stream of NPU {ordinal} (the runtime: {msg})"),
            ),
            e => e,
        })?;
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
        choose_finalize(self.finalize).map(FinalizeImpl::name)
    }

    /// Whether finalize finds a bad index on the device, whichever
    /// implementation runs: true where the native kernel can launch (it
    /// checks the indices itself, or for aclnn into checked copies), and the
    /// op then returns at once and the stream check reports the index; false
    /// where the indices are read and checked on the host first, and the op
    /// itself returns the error.
    pub fn checks_indices_on_device(&self) -> bool {
        super::launch::launcher().is_some()
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

    /// `(free, total)` bytes of device memory.
    pub fn mem_info(&self) -> Result<(usize, usize)> {
        self.stream.enter()?;
        super::result::acl::get_mem_info(acl_sys::aclrtMemAttr::ACL_HBM_MEM)
    }
}
