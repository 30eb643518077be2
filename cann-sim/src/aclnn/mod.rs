//! opapi exports: `aclnnMoeFinalizeRoutingV2`, `aclnnMoeTokenUnpermute` and
//! `aclnnAdd`, each as the two-phase pair (`...GetWorkspaceSize`, then the op
//! on a stream).
//!
//! Phase 1 validates shapes and dtypes and snapshots the tensor descriptions
//! into an executor; phase 2 checks the workspace and queues the computation
//! on the stream, which reads and writes the device arena when it runs.
//! Arithmetic is SPEC.md section 1's in f32, rounded once to the output type,
//! but not in SPEC's order: [`blocked_sum`] adds the experts' terms in pairs
//! from the last, and finalize adds that sum to `x1 + x2` last. An index outside its valid range fails
//! the stream task with `ACLNN_ERR_PARAM_INVALID` (161002), reported by the
//! next synchronisation, and nothing is read out of bounds.

#![allow(non_snake_case, clippy::missing_safety_doc)]

mod add;
mod finalize;
mod tensors;
mod unpermute;

use std::ffi::c_void;
use std::sync::Arc;

use crate::arena;
use crate::capture;
use crate::ffi::*;
use crate::handles::Table;
use crate::nnop::TensorDesc;
use crate::status::{fail, write_out, SimError, SimResult};

use add::ADD;
pub use add::{aclnnAdd, aclnnAddGetWorkspaceSize, Add};
use finalize::FINALIZE;
pub use finalize::{aclnnMoeFinalizeRoutingV2, aclnnMoeFinalizeRoutingV2GetWorkspaceSize, Finalize};
use tensors::{invalid, span};
use unpermute::UNPERMUTE;
pub use unpermute::{aclnnMoeTokenUnpermute, aclnnMoeTokenUnpermuteGetWorkspaceSize, Unpermute};

/// Workspace bytes `aclnnMoeFinalizeRoutingV2` and `aclnnMoeTokenUnpermute`
/// ask for (non-zero, so callers exercise their workspace path).
pub const MOE_WORKSPACE: u64 = 32 * 1024;

/// `terms(k, j)` for `k < K`, summed into `acc[j]` (`j < acc.len()`) in pairs
/// from the last: `acc += (t[K-1] + t[K-2]) + (t[K-3] + t[K-4]) + ...`, an
/// odd one added alone at the end, all in f32.
///
/// The aclnn MoE ops promise neither an accumulation order nor, unless the
/// context asks with `aclrtCtxSetSysParamOpt(ACL_OPT_DETERMINISTIC, 1)`
/// (hicann/runtime v8.5.0 `docs/api_docs/aclSysParamOpt.md`: by default
/// "the accumulation order of floats may change" between runs), repeatable
/// bits; SPEC.md
/// section 1 fixes an order for the crate's own kernels only. The simulator
/// therefore accumulates in an order of its own: from K = 3 on, and from
/// K = 2 when added to skips, its bits differ from SPEC order's wherever
/// rounding depends on the order, so a caller that expects SPEC's bits from
/// an aclnn op fails here rather than on a device. The order is the same on
/// every run (a deterministic context would get exactly this).
pub(super) fn blocked_sum(acc: &mut [f32], k: usize, terms: impl Fn(usize, usize) -> f32) {
    let mut sum = vec![0f32; acc.len()];
    let mut hi = k;
    let mut first = true;
    while hi > 0 {
        let lo = hi.saturating_sub(2);
        for (j, s) in sum.iter_mut().enumerate() {
            let pair = if hi - lo == 2 { terms(hi - 1, j) + terms(lo, j) } else { terms(lo, j) };
            *s = if first { pair } else { *s + pair };
        }
        first = false;
        hi = lo;
    }
    acc.iter_mut().zip(sum).for_each(|(a, s)| *a += s);
}

/// A prepared op, created by phase 1 and consumed by phase 2.
#[derive(Debug)]
pub enum Executor {
    /// `aclnnMoeFinalizeRoutingV2`.
    Finalize(Box<Finalize>),
    /// `aclnnMoeTokenUnpermute`.
    Unpermute(Box<Unpermute>),
    /// `aclnnAdd`.
    Add(Box<Add>),
}

/// Live executors (phase 1 done, phase 2 not yet).
pub static EXECUTORS: Table<Executor> = Table::new("aclOpExecutor", 0x5a5);

pub(super) fn check_outs(workspace_size: *mut u64, executor: *mut AclOpExecutor) -> SimResult<()> {
    if workspace_size.is_null() || executor.is_null() {
        return fail(ACLNN_ERR_PARAM_NULLPTR, "workspaceSize or executor is NULL");
    }
    Ok(())
}

pub(super) fn publish(
    exec: Executor,
    ws: u64,
    workspace_size: *mut u64,
    executor: *mut AclOpExecutor,
) -> SimResult<()> {
    let h = EXECUTORS.insert(Arc::new(exec));
    write_out(workspace_size, ws, ACLNN_ERR_PARAM_NULLPTR, "workspaceSize")?;
    write_out(executor, h as AclOpExecutor, ACLNN_ERR_PARAM_NULLPTR, "executor")
}

/// The byte an aclnn operator leaves in every byte of its workspace.
pub const WORKSPACE_SCRIBBLE: u8 = 0xA7;

pub(super) fn launch(
    op: &'static str,
    workspace: *mut c_void,
    ws_size: u64,
    executor: AclOpExecutor,
    stream: AclrtStream,
) -> SimResult<()> {
    let exec = EXECUTORS.remove(executor as usize).ok_or_else(|| {
        SimError::new(
            ACLNN_ERR_PARAM_INVALID,
            format!("{op}: executor {executor:p} is not live (GetWorkspaceSize not called, or already launched)"),
        )
    })?;
    let (need, tensors, name_ok): (u64, Vec<&TensorDesc>, bool) = match &*exec {
        Executor::Finalize(f) => (MOE_WORKSPACE, f.tensors(), op == FINALIZE),
        Executor::Unpermute(u) => (MOE_WORKSPACE, u.tensors(), op == UNPERMUTE),
        Executor::Add(a) => (0, vec![&a.a, &a.b, &a.out], op == ADD),
    };
    if !name_ok {
        return invalid(op, "the executor was prepared for a different operator");
    }
    let s = capture::stream_here(stream as usize).map_err(|e| SimError::new(ACLNN_ERR_RUNTIME_ERROR, e.msg))?;
    if need > 0 {
        if ws_size < need {
            return invalid(
                op,
                format!("workspaceSize {ws_size} is smaller than the {need} bytes GetWorkspaceSize asked for"),
            );
        }
        let w = arena::resolve(workspace as usize, need as usize, "workspace")
            .map_err(|e| SimError::new(ACLNN_ERR_PARAM_INVALID, format!("{op}: {}", e.msg)))?;
        if w.device != s.device {
            return invalid(op, format!("workspace is on device {}, the stream on device {}", w.device, s.device));
        }
    }
    for t in tensors {
        if let Some(sp) = span(t).map_err(|e| SimError::new(ACLNN_ERR_PARAM_INVALID, format!("{op}: {}", e.msg)))? {
            if sp.device != s.device {
                return invalid(op, format!("a tensor is on device {}, the stream on device {}", sp.device, s.device));
            }
        }
    }
    let ws_addr = workspace as usize;
    s.enqueue(
        op,
        Box::new(move || {
            if need > 0 {
                let w = arena::resolve(ws_addr, need as usize, "workspace").map_err(|e| {
                    SimError::new(
                        ACL_ERROR_RT_DEVICE_MEM_ERROR,
                        format!("{} (freed before the stream used it?)", e.msg),
                    )
                })?;
                // A real operator uses its workspace as scratch: every run
                // (a replay of a captured launch included) overwrites all of
                // it, so memory handed to other work while the launch can
                // still run (an eager block reused while a graph that
                // captured the launch lives) shows as corrupted data.
                // SAFETY: `w` was just resolved as `need` bytes of a live allocation.
                unsafe { std::ptr::write_bytes(w.host, WORKSPACE_SCRIBBLE, need as usize) };
            }
            match &*exec {
                Executor::Finalize(f) => f.run(),
                Executor::Unpermute(u) => u.run(),
                Executor::Add(a) => a.run(),
            }
        }),
    );
    Ok(())
}
