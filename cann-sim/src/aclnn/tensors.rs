//! Reading the phase-1 arguments: tensor descriptions, their checks, and
//! the device bytes behind them.

use std::ffi::c_void;

use half::{bf16, f16};

use crate::arena;
use crate::ffi::*;
use crate::nnop::objects::{dtype_name, TensorDesc, TENSORS};
use crate::status::{fail, SimError, SimResult};

pub(super) fn invalid<T>(op: &str, msg: impl std::fmt::Display) -> SimResult<T> {
    fail(ACLNN_ERR_PARAM_INVALID, format!("{op}: {msg}"))
}

pub(super) fn tensor(p: *const c_void, op: &str, arg: &str) -> SimResult<Option<TensorDesc>> {
    if p.is_null() {
        return Ok(None);
    }
    let t = TENSORS.get(p as usize).ok_or_else(|| {
        SimError::new(ACLNN_ERR_PARAM_INVALID, format!("{op}: {arg} ({p:p}) is not a live aclTensor"))
    })?;
    if t.format != ACL_FORMAT_ND {
        return invalid(op, format!("{arg} has aclFormat {} (only ND = 2 is supported)", t.format));
    }
    if !t.is_contiguous() {
        return invalid(op, format!("{arg} is not contiguous (dims {:?}, strides {:?})", t.dims, t.strides));
    }
    Ok(Some((*t).clone()))
}

pub(super) fn required(p: *const c_void, op: &str, arg: &str) -> SimResult<TensorDesc> {
    tensor(p, op, arg)?.ok_or_else(|| SimError::new(ACLNN_ERR_PARAM_NULLPTR, format!("{op}: {arg} is NULL")))
}

pub(super) fn is_float(dt: i32) -> bool {
    matches!(dt, ACL_FLOAT | ACL_FLOAT16 | ACL_BF16)
}

/// `ACLNN_ERR_INNER_TILING_ERROR` for `op`: what an op's tiling refuses
/// (ge::GRAPH_FAILED), its shape and attribute checks alike.
pub(super) fn tiling<T>(op: &str, msg: impl std::fmt::Display) -> SimResult<T> {
    fail(ACLNN_ERR_INNER_TILING_ERROR, format!("{op}: {msg}"))
}

/// `t` has shape `want`, else `code` naming `arg`.
fn dims_or(code: i32, op: &str, arg: &str, t: &TensorDesc, want: &[i64]) -> SimResult<()> {
    if t.dims != want {
        return fail(code, format!("{op}: {arg} has shape {:?}, expected {want:?}", t.dims));
    }
    Ok(())
}

/// `t` has shape `want`, else ACLNN_ERR_PARAM_INVALID naming `arg`.
pub(super) fn want_dims(op: &str, arg: &str, t: &TensorDesc, want: &[i64]) -> SimResult<()> {
    dims_or(ACLNN_ERR_PARAM_INVALID, op, arg, t, want)
}

/// `t` has shape `want`, else a tiling error naming `arg`.
pub(super) fn tiling_dims(op: &str, arg: &str, t: &TensorDesc, want: &[i64]) -> SimResult<()> {
    dims_or(ACLNN_ERR_INNER_TILING_ERROR, op, arg, t, want)
}

pub(super) fn want_dtype(op: &str, arg: &str, t: &TensorDesc, want: i32) -> SimResult<()> {
    if t.dtype != want {
        return invalid(op, format!("{arg} is {}, expected {}", dtype_name(t.dtype), dtype_name(want)));
    }
    Ok(())
}

/// Reads a tensor's elements as f32.
pub(super) fn read_f32(t: &TensorDesc) -> SimResult<Vec<f32>> {
    let bytes = read_bytes(t)?;
    Ok(match t.dtype {
        ACL_FLOAT => bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
        ACL_FLOAT16 => bytes.chunks_exact(2).map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        ACL_BF16 => bytes.chunks_exact(2).map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        other => return fail(ACLNN_ERR_PARAM_INVALID, format!("cannot read {} as float", dtype_name(other))),
    })
}

pub(super) fn read_i32(t: &TensorDesc) -> SimResult<Vec<i32>> {
    Ok(read_bytes(t)?.chunks_exact(4).map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
}

pub(super) fn span(t: &TensorDesc) -> SimResult<Option<arena::Span>> {
    if t.bytes() == 0 {
        return Ok(None);
    }
    arena::resolve(t.addr(), t.bytes(), "tensor data").map(Some)
}

pub(super) fn read_bytes(t: &TensorDesc) -> SimResult<Vec<u8>> {
    let Some(s) = span(t).map_err(|e| SimError::new(ACL_ERROR_RT_DEVICE_MEM_ERROR, e.msg))? else {
        return Ok(Vec::new());
    };
    let mut v = vec![0u8; s.len];
    // SAFETY: `s` was just checked to lie inside a live allocation.
    unsafe { std::ptr::copy_nonoverlapping(s.host, v.as_mut_ptr(), s.len) };
    Ok(v)
}

/// Rounds `vals` once to `t`'s dtype and stores them.
pub(super) fn write_f32(t: &TensorDesc, vals: &[f32]) -> SimResult<()> {
    let bytes: Vec<u8> = match t.dtype {
        ACL_FLOAT => vals.iter().flat_map(|v| v.to_le_bytes()).collect(),
        ACL_FLOAT16 => vals.iter().flat_map(|v| f16::from_f32(*v).to_le_bytes()).collect(),
        ACL_BF16 => vals.iter().flat_map(|v| bf16::from_f32(*v).to_le_bytes()).collect(),
        other => return fail(ACLNN_ERR_PARAM_INVALID, format!("cannot write {} as float", dtype_name(other))),
    };
    write_bytes(t, &bytes)
}

pub(super) fn write_bytes(t: &TensorDesc, bytes: &[u8]) -> SimResult<()> {
    let Some(s) = span(t).map_err(|e| SimError::new(ACL_ERROR_RT_DEVICE_MEM_ERROR, e.msg))? else {
        return Ok(());
    };
    debug_assert_eq!(s.len, bytes.len());
    // SAFETY: `s` lies inside a live allocation and holds exactly bytes.len().
    unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), s.host, s.len.min(bytes.len())) };
    Ok(())
}

/// A bad index met by a running operator: a trap of its kernel, the
/// stream's runtime error (`ACL_ERROR_RT_AICORE_EXCEPTION`, hicann/runtime
/// v8.5.0 `rt_error_codes.h:97`), which the next synchronisation reports as
/// it is: a sync passes on runtime codes only (`src/acl/aclrt_impl/stream.cpp:131-175`).
pub(super) fn kernel_trap<T>(msg: String) -> SimResult<T> {
    fail(ACL_ERROR_RT_AICORE_EXCEPTION, msg)
}

pub(super) fn index_error<T>(op: &str, arg: &str, pos: usize, v: i32, lo: i64, hi: usize) -> SimResult<T> {
    kernel_trap(format!("{op}: {arg}[{pos}] = {v} is outside [{lo}, {hi})"))
}
