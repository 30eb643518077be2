//! `libnnopbase` (tensor and scalar descriptors) and the aclnn operators of
//! `libopapi`: loading, status mapping, and one function per call.
//!
//! An operator runs in two phases: `aclnnXxxGetWorkspaceSize` describes the
//! call and returns the workspace size and an executor, then [`run`] queues
//! it on a stream with that workspace.

use std::ffi::c_void;

use acl_sys::aclnn::{
    self, aclIntArray, aclOpExecutor, aclScalar, aclTensor, aclnnAddGetWorkspaceSize_fn,
    aclnnMoeFinalizeRoutingV2GetWorkspaceSize_fn, aclnnMoeTokenUnpermuteGetWorkspaceSize_fn, aclnnRun_fn, aclnnStatus,
    Nnopbase, Op, OpApi,
};
use acl_sys::{aclDataType, aclFormat, aclrtStream};

use crate::backend::npu::runtime::load::recent_error_message;
use crate::{Error, Result};

/// The loaded `libnnopbase`, or [`Error::Unavailable`] naming every path tried.
pub fn nnopbase() -> Result<&'static Nnopbase> {
    aclnn::nnopbase().map_err(|e| Error::Unavailable(e.to_string()))
}

/// The loaded operators, or [`Error::Unavailable`] naming every path tried.
pub fn opapi() -> Result<&'static OpApi> {
    aclnn::opapi().map_err(|e| Error::Unavailable(e.to_string()))
}

/// `Ok` for `ACLNN_SUCCESS`, otherwise [`Error::Aclnn`] with the vendor message.
pub fn check(call: &'static str, code: aclnnStatus) -> Result<()> {
    if code == aclnn::ACLNN_SUCCESS {
        Ok(())
    } else {
        Err(Error::Aclnn { call, code, msg: recent_error_message() })
    }
}

/// `raw` from the constructor `call`, or [`Error::Aclnn`] (code -1, the
/// vendor message) when it returned NULL.
fn created<T>(call: &'static str, raw: *mut T) -> Result<*mut T> {
    if raw.is_null() {
        return Err(Error::Aclnn { call, code: -1, msg: recent_error_message() });
    }
    Ok(raw)
}

/// The error for an operator `name` that `api` does not have.
pub fn op_missing(name: &str, api: &OpApi) -> Error {
    Error::Unavailable(format!(
        "{name} (and its GetWorkspaceSize) is not exported by {} or the aclnn feature libraries",
        api.origin.path.to_string_lossy()
    ))
}

/// `aclCreateTensor(dims, dtype, strides, offset, format, storage_dims, data)`:
/// a tensor descriptor over device memory.
///
/// # Safety
/// `data` is device memory holding the whole view the shapes describe, live
/// while the descriptor is used.
pub unsafe fn create_tensor(
    dims: &[i64],
    dtype: aclDataType,
    strides: &[i64],
    offset: i64,
    format: aclFormat,
    storage_dims: &[i64],
    data: *mut c_void,
) -> Result<*mut aclTensor> {
    let nn = nnopbase()?;
    // SAFETY: the caller's contract; `dims`, `strides` and `storage_dims` are
    // live arrays (`strides` of `dims.len()` elements, as the call reads).
    let raw = unsafe {
        (nn.aclCreateTensor)(
            dims.as_ptr(),
            dims.len() as u64,
            dtype,
            strides.as_ptr(),
            offset,
            format,
            storage_dims.as_ptr(),
            storage_dims.len() as u64,
            data,
        )
    };
    created("aclCreateTensor", raw)
}

/// `aclDestroyTensor`.
///
/// # Safety
/// `tensor` came from [`create_tensor`], is destroyed once, after phase two
/// of every call that uses it.
pub unsafe fn destroy_tensor(tensor: *const aclTensor) -> Result<()> {
    let nn = nnopbase()?;
    // SAFETY: the caller's contract.
    check("aclDestroyTensor", unsafe { (nn.aclDestroyTensor)(tensor) })
}

/// `aclCreateScalar(value, dtype)`: a scalar descriptor holding a copy of
/// the value at `value`.
///
/// # Safety
/// `value` points to one value of `dtype`.
pub unsafe fn create_scalar(value: *mut c_void, dtype: aclDataType) -> Result<*mut aclScalar> {
    let nn = nnopbase()?;
    // SAFETY: the caller's contract; aclCreateScalar copies the value.
    let raw = unsafe { (nn.aclCreateScalar)(value, dtype) };
    created("aclCreateScalar", raw)
}

/// `aclDestroyScalar`.
///
/// # Safety
/// `scalar` came from [`create_scalar`] and is destroyed once.
pub unsafe fn destroy_scalar(scalar: *const aclScalar) -> Result<()> {
    let nn = nnopbase()?;
    // SAFETY: the caller's contract.
    check("aclDestroyScalar", unsafe { (nn.aclDestroyScalar)(scalar) })
}

/// Phase two of any operator: queues `executor` (from the operator's phase
/// one, whose name `call` is without `GetWorkspaceSize`) on `stream` with
/// `workspace_size` bytes at `workspace`.
///
/// # Safety
/// `executor` came from phase one of the same operator, run once; the
/// workspace holds `workspace_size` bytes of the stream's device (or is NULL
/// for 0) and stays reserved for work queued after this; the stream's device
/// is bound.
pub unsafe fn run(
    call: &'static str,
    run: aclnnRun_fn,
    workspace: *mut c_void,
    workspace_size: u64,
    executor: *mut aclOpExecutor,
    stream: aclrtStream,
) -> Result<()> {
    // SAFETY: the caller's contract.
    check(call, unsafe { run(workspace, workspace_size, executor, stream) })
}

/// Phase one through `f`, which calls `call` with the out-pointers of the
/// workspace size and the executor: both, or the error of its status.
fn phase_one(
    call: &'static str,
    f: impl FnOnce(*mut u64, *mut *mut aclOpExecutor) -> aclnnStatus,
) -> Result<(u64, *mut aclOpExecutor)> {
    let (mut ws, mut exec) = (0u64, std::ptr::null_mut());
    check(call, f(&mut ws, &mut exec))?;
    Ok((ws, exec))
}

/// `aclnnAddGetWorkspaceSize(self, other, alpha, out)` of `op`: `out = self +
/// alpha * other`; the workspace size and the executor.
///
/// # Safety
/// Every descriptor is live until phase two ran.
pub unsafe fn add_get_workspace_size(
    op: &Op<aclnnAddGetWorkspaceSize_fn>,
    self_: *const aclTensor,
    other: *const aclTensor,
    alpha: *const aclScalar,
    out: *mut aclTensor,
) -> Result<(u64, *mut aclOpExecutor)> {
    phase_one("aclnnAddGetWorkspaceSize", |ws, exec| {
        // SAFETY: the caller's contract; `ws` and `exec` are valid out-pointers.
        unsafe { (op.get_workspace_size)(self_, other, alpha, out, ws, exec) }
    })
}

/// `aclnnMoeFinalizeRoutingV2GetWorkspaceSize(expandedX, expandedRowIdx,
/// x1Optional, x2Optional, biasOptional, scalesOptional, expertIdxOptional,
/// dropPadMode, out)` of `op`; the workspace size and the executor.
///
/// # Safety
/// Every descriptor is live until phase two ran (optional ones may be NULL).
#[allow(clippy::too_many_arguments)]
pub unsafe fn moe_finalize_routing_v2_get_workspace_size(
    op: &Op<aclnnMoeFinalizeRoutingV2GetWorkspaceSize_fn>,
    expanded_x: *const aclTensor,
    expanded_row_idx: *const aclTensor,
    x1: *const aclTensor,
    x2: *const aclTensor,
    bias: *const aclTensor,
    scales: *const aclTensor,
    expert_idx: *const aclTensor,
    drop_pad_mode: i64,
    out: *const aclTensor,
) -> Result<(u64, *mut aclOpExecutor)> {
    phase_one("aclnnMoeFinalizeRoutingV2GetWorkspaceSize", |ws, exec| {
        // SAFETY: the caller's contract; `ws` and `exec` are valid out-pointers.
        unsafe {
            (op.get_workspace_size)(
                expanded_x,
                expanded_row_idx,
                x1,
                x2,
                bias,
                scales,
                expert_idx,
                drop_pad_mode,
                out,
                ws,
                exec,
            )
        }
    })
}

/// `aclnnMoeTokenUnpermuteGetWorkspaceSize(permutedTokens, sortedIndices,
/// probsOptional, paddedMode, restoreShapeOptional, out)` of `op`; the
/// workspace size and the executor.
///
/// # Safety
/// Every descriptor is live until phase two ran (optional ones may be NULL);
/// the op's documentation asks that `sortedIndices` hold distinct indices of
/// rows of `permutedTokens`, since aclnn does not check index values.
pub unsafe fn moe_token_unpermute_get_workspace_size(
    op: &Op<aclnnMoeTokenUnpermuteGetWorkspaceSize_fn>,
    permuted_tokens: *const aclTensor,
    sorted_indices: *const aclTensor,
    probs: *const aclTensor,
    padded_mode: bool,
    restore_shape: *const aclIntArray,
    out: *const aclTensor,
) -> Result<(u64, *mut aclOpExecutor)> {
    phase_one("aclnnMoeTokenUnpermuteGetWorkspaceSize", |ws, exec| {
        // SAFETY: the caller's contract; `ws` and `exec` are valid out-pointers.
        unsafe {
            (op.get_workspace_size)(permuted_tokens, sorted_indices, probs, padded_mode, restore_shape, out, ws, exec)
        }
    })
}
