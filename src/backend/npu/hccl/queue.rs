//! Queuing a collective on a stream, and the check that reports what HCCL
//! recorded for it on the device.

use std::sync::Arc;

use hccl_sys::HcclResult;

use crate::backend::npu::memory::NpuBuffer;
use crate::backend::npu::result::hccl::{self as hc, error_string, hccl};
use crate::backend::npu::runtime::{NpuStream, Pending};
use crate::{Error, Result};

use super::{CommInner, HcclComm};

impl HcclComm {
    /// Queues one HCCL call on the stream of the call (the first operand's;
    /// the communicator's device stream when there is none), ordered after the
    /// other operands' streams and after this communicator's previous
    /// collective, records it for [`NpuStream::check`] and returns without
    /// waiting.
    pub(super) fn run(
        &self,
        call: &'static str,
        operands: &[&NpuBuffer],
        launch: impl FnOnce(acl_sys::aclrtStream) -> Result<()>,
    ) -> Result<()> {
        let stream = operands.first().map_or_else(|| self.inner.device.stream(), |b| b.stream()).clone();
        self.run_on(&stream, call, operands, launch)
    }

    pub(super) fn run_on(
        &self,
        stream: &NpuStream,
        call: &'static str,
        operands: &[&NpuBuffer],
        launch: impl FnOnce(acl_sys::aclrtStream) -> Result<()>,
    ) -> Result<()> {
        hccl()?;
        if stream.ordinal() != self.inner.device.ordinal() {
            return Err(Error::Device {
                op: call,
                arg: "stream",
                expected: format!("npu:{}", self.inner.device.ordinal()),
                actual: format!("npu:{}", stream.ordinal()),
            });
        }
        for b in operands {
            stream.wait_for(b.stream())?;
        }
        let mut last = self.inner.last_stream.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(prev) = last.as_ref() {
            stream.wait_for(prev)?;
        }
        stream.enter()?;
        launch(stream.raw()).map_err(|e| self.enqueue_error(call, e))?;
        *last = Some(stream.clone());
        drop(last);
        stream.record_pending(Box::new(QueuedCollective { call, comm: Arc::downgrade(&self.inner) }));
        let operands = crate::backend::npu::operands::streams_of(stream, operands.iter().copied());
        stream.order_operand_streams_after(&operands)
    }

    /// What a refused HCCL call means for the group. The crate checks this
    /// rank's arguments before the call, so `HCCL_E_PARA` from a collective is
    /// HCCL's parameter consistency check at link setup, made inside the first
    /// call of each collective on a communicator: another rank passed other
    /// arguments (EI0005; hicann/hccl `src/common/inconsistent_check.cc:72-196`
    /// at v9.1.0). `HCCL_E_TIMEOUT` is the link setup waiting for a rank that
    /// never made the call (HCCL_CONNECT_TIMEOUT; hicann/hccl
    /// `docs/zh/user_guide/fault_diagnosis/param_link_stage.md`, EI0006).
    fn enqueue_error(&self, call: &'static str, e: Error) -> Error {
        let kind = match &e {
            Error::Hccl { code, .. } if *code == HcclResult::HCCL_E_PARA.0 as i32 => crate::CommErrorKind::Mismatch,
            Error::Hccl { code, .. } if *code == HcclResult::HCCL_E_TIMEOUT.0 as i32 => crate::CommErrorKind::Timeout,
            Error::Hccl { code, .. } if *code == HcclResult::HCCL_E_REMOTE.0 as i32 => crate::CommErrorKind::PeerFailed,
            _ => return e,
        };
        Error::Comm {
            collective: call.to_string(),
            group: self.inner.name.clone(),
            rank: self.inner.rank,
            world: self.inner.world,
            detail: format!("HCCL refused the call: {e}"),
            kind,
        }
    }

    /// [`Collectives::barrier`](crate::comm::Collectives::barrier) queued on `stream` (a stream of this
    /// communicator's device, e.g. the caller's) instead of the device's own.
    ///
    /// Refused while `stream` is captured into a graph: HCCL lists no barrier
    /// among the operators of the aclgraph capture mode ("operators and modes
    /// not listed are not supported": hicann/hccl v9.1.0
    /// `docs/zh/user_guide/comm_ops_support_list/comm_ops_support_a2.md:13`).
    pub fn barrier_on(&self, stream: &NpuStream) -> Result<()> {
        if stream.is_capturing()? {
            return Err(Error::invalid(
                "barrier",
                "stream",
                format!(
                    "{stream:?} is being captured into a graph, and HcclBarrier is not supported under graph \
                     capture (HCCL's A2 operator list for aclgraph); order the graph's work with the collectives \
                     themselves, or barrier outside the capture"
                ),
            ));
        }
        self.run_on(stream, "barrier", &[], |raw| {
            // SAFETY: live communicator and stream of its device.
            unsafe { hc::barrier(self.inner.raw, raw) }
        })
    }
}

/// A collective queued on a stream, reported by that stream's check.
struct QueuedCollective {
    call: &'static str,
    comm: std::sync::Weak<CommInner>,
}

impl CommInner {
    /// The error HCCL recorded for this communicator (a collective that
    /// failed on the device, [`hc::get_comm_async_error`]), `None` when there
    /// is none.
    fn async_error(&self) -> Option<HcclResult> {
        // SAFETY: live communicator (held by the caller).
        unsafe { hc::get_comm_async_error(self.raw) }.filter(|&code| code != HcclResult::HCCL_SUCCESS)
    }
}

impl Pending for QueuedCollective {
    fn key(&self) -> Option<(usize, &'static str)> {
        Some((self.comm.as_ptr() as usize, self.call))
    }

    fn timeout(&self) -> Option<std::time::Duration> {
        self.comm.upgrade().map(|c| c.opts.timeout)
    }

    fn outcome(&self, wait: Option<&Error>, _stream: &NpuStream) -> Result<()> {
        // A destroyed communicator waited for its work and reported any
        // failure as a drop error.
        let Some(c) = self.comm.upgrade() else { return Ok(()) };
        let err = |kind, detail: String| Error::Comm {
            collective: self.call.to_string(),
            group: c.name.clone(),
            rank: c.rank,
            world: c.world,
            detail,
            kind,
        };
        // HcclGetCommAsyncError reports the error CQE of a failed link to a
        // peer (HCCL_E_REMOTE) or, where there is none and HCCL's
        // inconsistent-op check is on (`HCCL_DFS_CONFIG=inconsistent_check:on`,
        // off by default), HCCL_E_PARA for ranks whose calls differ in type,
        // dtype, operation, root or count: hcomm v8.5.0
        // `src/framework/op_base/src/op_base.cc:3191-3204`,
        // `cluster_maintenance/health/heartbeat/heartbeat.cc:982-1023,1941-1956`.
        // A timeout shows only as the stream's failed wait, below.
        if let Some(code) = c.async_error() {
            let how = wait.map(|e| format!(" (the stream reported: {e})")).unwrap_or_default();
            let (kind, what) = if code == HcclResult::HCCL_E_PARA {
                (
                    crate::CommErrorKind::Mismatch,
                    "HCCL's inconsistent-op check found ranks of the group calling different collectives \
                     (type, dtype, operation, root or count; HCCL's log names both calls): ",
                )
            } else {
                (crate::CommErrorKind::PeerFailed, "")
            };
            return Err(err(kind, format!("{what}HCCL async error {}: {}{how}", code.0, error_string(code))));
        }
        // A wait that timed out with no error recorded by HCCL: this
        // collective (the first one queued since the last check) is named.
        match wait {
            Some(e @ Error::Acl { code, .. }) if *code == acl_sys::ACL_ERROR_RT_STREAM_SYNC_TIMEOUT => Err(err(
                crate::CommErrorKind::Timeout,
                format!("waiting for the stream (timeout {:?}) failed: {e}", c.opts.timeout),
            )),
            _ => Ok(()),
        }
    }
}
