//! Phase 2 of every aclnn operator: the executor, the workspace and the
//! stream checked, then the op queued on the stream.

use std::ffi::c_void;

use crate::arena;
use crate::capture;
use crate::ffi::*;
use crate::lease::{self, Lease};
use crate::nnop::objects::TensorDesc;
use crate::status::{SimError, SimResult};

use super::executor::EXECUTORS;
use super::tensors::{invalid, span};

/// The byte an aclnn operator leaves in every byte of its workspace.
pub const WORKSPACE_SCRIBBLE: u8 = 0xA7;

/// Phase 2 of operator `op`: takes the executor out of the table, checks the
/// workspace, the stream and the tensors' devices, then queues the op.
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
    let (need, tensors, name_ok): (u64, Vec<&TensorDesc>, bool) = (exec.workspace(), exec.tensors(), exec.name() == op);
    if !name_ok {
        return invalid(op, "the executor was prepared for a different operator");
    }
    let s = capture::stream_here(stream as usize).map_err(|e| SimError::new(ACLNN_ERR_RUNTIME_ERROR, e.msg))?;
    // The allocations of the workspace and of every tensor, checked again
    // when the op runs (see [`crate::lease`]).
    let mut leases = Vec::new();
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
        leases.push(Lease::device(&w, "workspace"));
    }
    for t in tensors {
        if let Some(sp) = span(t).map_err(|e| SimError::new(ACLNN_ERR_PARAM_INVALID, format!("{op}: {}", e.msg)))? {
            if sp.device != s.device {
                return invalid(op, format!("a tensor is on device {}, the stream on device {}", sp.device, s.device));
            }
            leases.push(Lease::device(&sp, "tensor data"));
        }
    }
    let ws_addr = workspace as usize;
    s.enqueue(
        op,
        Box::new(move || {
            lease::check_all(&leases)?;
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
            exec.run()
        }),
    );
    Ok(())
}
