//! The executors of the two-phase aclnn calls: what phase 1 of an operator
//! prepared, as the [`Op`] each operator file implements, and the table of
//! live executors phase 2 consumes.
//!
//! A leaf of aclnn: the operator files implement [`Op`] and register their
//! executors here, the launch ([`super::launch`]) takes them out, and the
//! leak report reads the table, none of them through the others.

use std::sync::Arc;

use crate::ffi::*;
use crate::handles::Table;
use crate::nnop::objects::TensorDesc;
use crate::status::{fail, write_out, SimResult};

/// Workspace bytes `aclnnMoeFinalizeRoutingV2` and `aclnnMoeTokenUnpermute`
/// ask for (non-zero, so callers exercise their workspace path).
pub const MOE_WORKSPACE: u64 = 32 * 1024;

/// A prepared op, created by phase 1 and consumed by phase 2.
pub trait Op: std::fmt::Debug + Send + Sync {
    /// The operator, as its phase-2 export is named (`aclnnAdd`, ...): only
    /// that export may launch the executor.
    fn name(&self) -> &'static str;
    /// Workspace bytes phase 1 asks for (phase 2 checks the caller's).
    fn workspace(&self) -> u64;
    /// Every tensor the op reads or writes.
    fn tensors(&self) -> Vec<&TensorDesc>;
    /// The computation, run by the stream's worker (again at every replay of
    /// a captured launch).
    fn run(&self) -> SimResult<()>;
}

/// Live executors (phase 1 done, phase 2 not yet).
pub static EXECUTORS: Table<dyn Op> = Table::new("aclOpExecutor", 0x5a5);

/// Phase 1's out-pointers: both non-NULL.
pub(super) fn check_outs(workspace_size: *mut u64, executor: *mut AclOpExecutor) -> SimResult<()> {
    if workspace_size.is_null() || executor.is_null() {
        return fail(ACLNN_ERR_PARAM_NULLPTR, "workspaceSize or executor is NULL");
    }
    Ok(())
}

/// Registers the executor `exec` phase 1 prepared; writes the workspace size
/// it asks for and its handle through the out-pointers.
pub(super) fn publish(exec: Arc<dyn Op>, workspace_size: *mut u64, executor: *mut AclOpExecutor) -> SimResult<()> {
    let ws = exec.workspace();
    let h = EXECUTORS.insert(exec);
    write_out(workspace_size, ws, ACLNN_ERR_PARAM_NULLPTR, "workspaceSize")?;
    write_out(executor, h as AclOpExecutor, ACLNN_ERR_PARAM_NULLPTR, "executor")
}
