//! opapi exports: `aclnnMoeFinalizeRoutingV2`, `aclnnMoeTokenUnpermute` and
//! `aclnnAdd`, each as the two-phase pair (`...GetWorkspaceSize`, then the op
//! on a stream).
//!
//! Phase 1 validates shapes and dtypes and snapshots the tensor descriptions
//! into an executor; phase 2 checks the workspace and queues the computation
//! on the stream, which reads and writes the device arena when it runs.
//! Arithmetic follows SPEC.md section 1: f32 accumulation in the stated order,
//! one rounding to the output type. An index outside its valid range fails
//! the stream task with `ACLNN_ERR_PARAM_INVALID` (161002), reported by the
//! next synchronisation, and nothing is read out of bounds.

#![allow(non_snake_case, clippy::missing_safety_doc)]

use std::ffi::c_void;
use std::sync::Arc;

use half::{bf16, f16};

use crate::arena;
use crate::context;
use crate::ffi::*;
use crate::handles::Table;
use crate::nnop::{dtype_name, Scalar, TensorDesc, SCALARS, TENSORS};
use crate::status::{self, fail, write_out, SimError, SimResult};

/// Workspace bytes `aclnnMoeFinalizeRoutingV2` and `aclnnMoeTokenUnpermute`
/// ask for (non-zero, so callers exercise their workspace path).
pub const MOE_WORKSPACE: u64 = 32 * 1024;

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

fn invalid<T>(op: &str, msg: impl std::fmt::Display) -> SimResult<T> {
    fail(ACLNN_ERR_PARAM_INVALID, format!("{op}: {msg}"))
}

fn tensor(p: *const c_void, op: &str, arg: &str) -> SimResult<Option<TensorDesc>> {
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

fn required(p: *const c_void, op: &str, arg: &str) -> SimResult<TensorDesc> {
    tensor(p, op, arg)?.ok_or_else(|| SimError::new(ACLNN_ERR_PARAM_NULLPTR, format!("{op}: {arg} is NULL")))
}

fn is_float(dt: i32) -> bool {
    matches!(dt, ACL_FLOAT | ACL_FLOAT16 | ACL_BF16)
}

fn want_dims(op: &str, arg: &str, t: &TensorDesc, want: &[i64]) -> SimResult<()> {
    if t.dims != want {
        return invalid(op, format!("{arg} has shape {:?}, expected {want:?}", t.dims));
    }
    Ok(())
}

fn want_dtype(op: &str, arg: &str, t: &TensorDesc, want: i32) -> SimResult<()> {
    if t.dtype != want {
        return invalid(op, format!("{arg} is {}, expected {}", dtype_name(t.dtype), dtype_name(want)));
    }
    Ok(())
}

/// Reads a tensor's elements as f32.
fn read_f32(t: &TensorDesc) -> SimResult<Vec<f32>> {
    let bytes = read_bytes(t)?;
    Ok(match t.dtype {
        ACL_FLOAT => bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
        ACL_FLOAT16 => bytes.chunks_exact(2).map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        ACL_BF16 => bytes.chunks_exact(2).map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        other => return fail(ACLNN_ERR_PARAM_INVALID, format!("cannot read {} as float", dtype_name(other))),
    })
}

fn read_i32(t: &TensorDesc) -> SimResult<Vec<i32>> {
    Ok(read_bytes(t)?.chunks_exact(4).map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
}

fn span(t: &TensorDesc) -> SimResult<Option<arena::Span>> {
    if t.bytes() == 0 {
        return Ok(None);
    }
    arena::resolve(t.addr(), t.bytes(), "tensor data").map(Some)
}

fn read_bytes(t: &TensorDesc) -> SimResult<Vec<u8>> {
    let Some(s) = span(t).map_err(|e| SimError::new(ACL_ERROR_RT_DEVICE_MEM_ERROR, e.msg))? else {
        return Ok(Vec::new());
    };
    let mut v = vec![0u8; s.len];
    // SAFETY: `s` was just checked to lie inside a live allocation.
    unsafe { std::ptr::copy_nonoverlapping(s.host, v.as_mut_ptr(), s.len) };
    Ok(v)
}

/// Rounds `vals` once to `t`'s dtype and stores them.
fn write_f32(t: &TensorDesc, vals: &[f32]) -> SimResult<()> {
    let bytes: Vec<u8> = match t.dtype {
        ACL_FLOAT => vals.iter().flat_map(|v| v.to_le_bytes()).collect(),
        ACL_FLOAT16 => vals.iter().flat_map(|v| f16::from_f32(*v).to_le_bytes()).collect(),
        ACL_BF16 => vals.iter().flat_map(|v| bf16::from_f32(*v).to_le_bytes()).collect(),
        other => return fail(ACLNN_ERR_PARAM_INVALID, format!("cannot write {} as float", dtype_name(other))),
    };
    write_bytes(t, &bytes)
}

fn write_bytes(t: &TensorDesc, bytes: &[u8]) -> SimResult<()> {
    let Some(s) = span(t).map_err(|e| SimError::new(ACL_ERROR_RT_DEVICE_MEM_ERROR, e.msg))? else {
        return Ok(());
    };
    debug_assert_eq!(s.len, bytes.len());
    // SAFETY: `s` lies inside a live allocation and holds exactly bytes.len().
    unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), s.host, s.len.min(bytes.len())) };
    Ok(())
}

/// Phase-1 snapshot of `aclnnMoeFinalizeRoutingV2`.
#[derive(Debug)]
pub struct Finalize {
    expanded_x: TensorDesc,
    row_idx: TensorDesc,
    x1: Option<TensorDesc>,
    x2: Option<TensorDesc>,
    bias: Option<TensorDesc>,
    scales: Option<TensorDesc>,
    expert_idx: Option<TensorDesc>,
    out: TensorDesc,
    mode: i64,
    n: usize,
    k: usize,
    h: usize,
    rows: usize,
}

const FINALIZE: &str = "aclnnMoeFinalizeRoutingV2";

#[allow(clippy::too_many_arguments)]
fn finalize_prepare(
    expanded_x: *const c_void,
    expanded_row_idx: *const c_void,
    x1: *const c_void,
    x2: *const c_void,
    bias: *const c_void,
    scales: *const c_void,
    expert_idx: *const c_void,
    mode: i64,
    out: *const c_void,
) -> SimResult<Finalize> {
    let op = FINALIZE;
    let ex = required(expanded_x, op, "expandedX")?;
    let ri = required(expanded_row_idx, op, "expandedRowIdx")?;
    let out = required(out, op, "out")?;
    let (x1, x2) = (tensor(x1, op, "x1Optional")?, tensor(x2, op, "x2Optional")?);
    let (bias, scales) = (tensor(bias, op, "biasOptional")?, tensor(scales, op, "scalesOptional")?);
    let expert_idx = tensor(expert_idx, op, "expertIdxOptional")?;
    if !(0..=3).contains(&mode) {
        return invalid(op, format!("dropPadMode {mode} (expected 0..=3)"));
    }
    let drop_pad = mode == 1 || mode == 3;
    if !is_float(ex.dtype) {
        return invalid(op, format!("expandedX is {} (expected float32, float16 or bfloat16)", dtype_name(ex.dtype)));
    }
    let (rows, h) = match (drop_pad, ex.dims.as_slice()) {
        (false, [r, h]) => (*r, *h),
        (true, [e, c, h]) => (e * c, *h),
        _ => {
            let want = if drop_pad { "3-D [E, C, H] (dropPadMode 1/3)" } else { "2-D [N*K, H] (dropPadMode 0/2)" };
            return invalid(op, format!("expandedX has shape {:?}, expected {want}", ex.dims));
        }
    };
    want_dtype(op, "expandedRowIdx", &ri, ACL_INT32)?;
    let [nk] = ri.dims.as_slice() else {
        return invalid(op, format!("expandedRowIdx has shape {:?}, expected 1-D [N*K]", ri.dims));
    };
    let (n, k) = match &scales {
        Some(s) => {
            let [n, k] = s.dims.as_slice() else {
                return invalid(op, format!("scalesOptional has shape {:?}, expected [N, K]", s.dims));
            };
            // The (expandedX, scales) dtype pairs the op definition
            // (`moe_finalize_routing_v2_def.cpp`) registers for Atlas A2/A3:
            // (f16, f16), (f32, f32), (bf16, bf16), (bf16, f32). The aclnn doc:
            // "in mixed-precision mode scales may be FLOAT32 when expandedX is
            // BFLOAT16; otherwise its dtype must equal expandedX's".
            if s.dtype != ex.dtype && !(ex.dtype == ACL_BF16 && s.dtype == ACL_FLOAT) {
                return invalid(
                    op,
                    format!(
                        "scalesOptional is {} with expandedX {}: the only mixed precision is bfloat16 data with \
                         float32 scales",
                        dtype_name(s.dtype),
                        dtype_name(ex.dtype)
                    ),
                );
            }
            (*n, *k)
        }
        None => (*nk, 1),
    };
    if n * k != *nk {
        return invalid(op, format!("expandedRowIdx has {nk} entries but scales say N*K = {n}*{k}"));
    }
    // Empty inputs: the op's tiling divides the rows among the cores; the
    // simulator refuses 0 tokens or an empty hidden size rather than guess.
    if n == 0 || h == 0 {
        return invalid(op, format!("empty input (N = {n}, H = {h}): call the op only with data"));
    }
    // Tiling check (`moe_finalize_routing_v2_tiling_membase.cpp`): "In the
    // case of x1 parameter is not input, x2 parameter can't be inputted
    // either" (ge::GRAPH_FAILED, reported as ACLNN_ERR_INNER_TILING_ERROR).
    if x2.is_some() && x1.is_none() {
        return fail(
            ACLNN_ERR_INNER_TILING_ERROR,
            format!("{op}: In the case of x1 parameter is not input, x2 parameter can't be inputted either"),
        );
    }
    // The aclnn doc's constraints: E (expert count: bias rows, or
    // expandedX's first dimension in drop-pad modes) must be at least K.
    let experts = bias.as_ref().and_then(|b| b.dims.first().copied()).or(drop_pad.then(|| ex.dims[0]));
    if let Some(e) = experts {
        if e < k {
            return fail(ACLNN_ERR_INNER_TILING_ERROR, format!("{op}: E = {e} experts is less than K = {k}"));
        }
    }
    for (arg, t) in [("x1Optional", &x1), ("x2Optional", &x2)] {
        if let Some(t) = t {
            want_dims(op, arg, t, &[n, h])?;
            want_dtype(op, arg, t, ex.dtype)?;
        }
    }
    if let Some(b) = &bias {
        let [_, bh] = b.dims.as_slice() else {
            return invalid(op, format!("biasOptional has shape {:?}, expected [E, H]", b.dims));
        };
        if *bh != h {
            return invalid(op, format!("biasOptional has shape {:?}, expected [E, {h}]", b.dims));
        }
        want_dtype(op, "biasOptional", b, ex.dtype)?;
        if expert_idx.is_none() {
            return fail(ACLNN_ERR_PARAM_NULLPTR, format!("{op}: expertIdxOptional is required when bias is given"));
        }
    }
    if let Some(e) = &expert_idx {
        want_dims(op, "expertIdxOptional", e, &[n, k])?;
        want_dtype(op, "expertIdxOptional", e, ACL_INT32)?;
    }
    want_dims(op, "out", &out, &[n, h])?;
    want_dtype(op, "out", &out, ex.dtype)?;
    Ok(Finalize {
        expanded_x: ex,
        row_idx: ri,
        x1,
        x2,
        bias,
        scales,
        expert_idx,
        out,
        mode,
        n: n as usize,
        k: k as usize,
        h: h as usize,
        rows: rows as usize,
    })
}

fn index_error<T>(op: &str, arg: &str, pos: usize, v: i32, lo: i64, hi: usize) -> SimResult<T> {
    fail(ACLNN_ERR_PARAM_INVALID, format!("{op}: {arg}[{pos}] = {v} is outside [{lo}, {hi})"))
}

impl Finalize {
    fn tensors(&self) -> Vec<&TensorDesc> {
        let mut v = vec![&self.expanded_x, &self.row_idx, &self.out];
        v.extend([&self.x1, &self.x2, &self.bias, &self.scales, &self.expert_idx].into_iter().flatten());
        v
    }

    fn run(&self) -> SimResult<()> {
        let op = FINALIZE;
        let (n, k, h) = (self.n, self.k, self.h);
        let drop_pad = self.mode == 1 || self.mode == 3;
        let row_layout = self.mode >= 2;
        let ridx = read_i32(&self.row_idx)?;
        let lo = if drop_pad { -1 } else { 0 };
        if let Some((p, &v)) = ridx.iter().enumerate().find(|(_, &v)| (v as i64) < lo || v as i64 >= self.rows as i64) {
            return index_error(op, "expandedRowIdx", p, v, lo, self.rows);
        }
        let bias = self.bias.as_ref().map(read_f32).transpose()?;
        let experts = match (&self.bias, &self.expert_idx) {
            (Some(b), Some(e)) => {
                let e_rows = b.dims[0] as usize;
                let idx = read_i32(e)?;
                if let Some((p, &v)) = idx.iter().enumerate().find(|(_, &v)| v < 0 || v as usize >= e_rows) {
                    return index_error(op, "expertIdxOptional", p, v, 0, e_rows);
                }
                Some(idx)
            }
            _ => None,
        };
        let x = read_f32(&self.expanded_x)?;
        let x1 = self.x1.as_ref().map(read_f32).transpose()?;
        let x2 = self.x2.as_ref().map(read_f32).transpose()?;
        let scales = self.scales.as_ref().map(read_f32).transpose()?;
        let mut out = vec![0f32; n * h];
        for i in 0..n {
            let acc = &mut out[i * h..(i + 1) * h];
            match (&x1, &x2) {
                (Some(a), Some(b)) => {
                    for j in 0..h {
                        acc[j] = a[i * h + j] + b[i * h + j];
                    }
                }
                (Some(a), None) | (None, Some(a)) => acc.copy_from_slice(&a[i * h..(i + 1) * h]),
                (None, None) => {}
            }
            for kk in 0..k {
                let slot = if row_layout { i * k + kk } else { kk * n + i };
                let r = ridx[slot];
                let s = scales.as_ref().map_or(1.0, |s| s[i * k + kk]);
                let brow = match (&bias, &experts) {
                    (Some(b), Some(e)) => Some(&b[e[i * k + kk] as usize * h..][..h]),
                    _ => None,
                };
                for j in 0..h {
                    let row = if r < 0 { 0.0 } else { x[r as usize * h + j] };
                    let t = match brow {
                        Some(b) => row + b[j],
                        None => row,
                    };
                    acc[j] += s * t;
                }
            }
        }
        write_f32(&self.out, &out)
    }
}

/// `aclnnStatus aclnnMoeFinalizeRoutingV2GetWorkspaceSize(const aclTensor *expandedX, const aclTensor *expandedRowIdx, const aclTensor *x1Optional, const aclTensor *x2Optional, const aclTensor *biasOptional, const aclTensor *scalesOptional, const aclTensor *expertIdxOptional, int64_t dropPadMode, const aclTensor *out, uint64_t *workspaceSize, aclOpExecutor **executor)`.
#[no_mangle]
pub unsafe extern "C" fn aclnnMoeFinalizeRoutingV2GetWorkspaceSize(
    expanded_x: *const c_void,
    expanded_row_idx: *const c_void,
    x1_optional: *const c_void,
    x2_optional: *const c_void,
    bias_optional: *const c_void,
    scales_optional: *const c_void,
    expert_idx_optional: *const c_void,
    drop_pad_mode: i64,
    out: *const c_void,
    workspace_size: *mut u64,
    executor: *mut AclOpExecutor,
) -> AclnnStatus {
    status::aclnn("aclnnMoeFinalizeRoutingV2GetWorkspaceSize", || {
        check_outs(workspace_size, executor)?;
        let f = finalize_prepare(
            expanded_x,
            expanded_row_idx,
            x1_optional,
            x2_optional,
            bias_optional,
            scales_optional,
            expert_idx_optional,
            drop_pad_mode,
            out,
        )?;
        publish(Executor::Finalize(Box::new(f)), MOE_WORKSPACE, workspace_size, executor)
    })
}

/// `aclnnStatus aclnnMoeFinalizeRoutingV2(void *workspace, uint64_t workspaceSize, aclOpExecutor *executor, aclrtStream stream)`.
#[no_mangle]
pub extern "C" fn aclnnMoeFinalizeRoutingV2(
    workspace: *mut c_void,
    workspace_size: u64,
    executor: AclOpExecutor,
    stream: AclrtStream,
) -> AclnnStatus {
    status::aclnn(FINALIZE, || launch(FINALIZE, workspace, workspace_size, executor, stream))
}

/// Phase-1 snapshot of `aclnnMoeTokenUnpermute`.
#[derive(Debug)]
pub struct Unpermute {
    tokens: TensorDesc,
    idx: TensorDesc,
    probs: Option<TensorDesc>,
    out: TensorDesc,
    t: usize,
    k: usize,
    h: usize,
}

const UNPERMUTE: &str = "aclnnMoeTokenUnpermute";

impl Unpermute {
    fn tensors(&self) -> Vec<&TensorDesc> {
        let mut v = vec![&self.tokens, &self.idx, &self.out];
        v.extend(self.probs.as_ref());
        v
    }

    fn run(&self) -> SimResult<()> {
        let (t, k, h) = (self.t, self.k, self.h);
        let rows = self.tokens.dims[0];
        let x = read_f32(&self.tokens)?;
        let idx = read_i32(&self.idx)?;
        let probs = self.probs.as_ref().map(read_f32).transpose()?;
        // aclnn does not check data values; the simulator does: an index out
        // of [0, T*K) would read outside permutedTokens, and "sortedIndices
        // must not contain duplicates (otherwise the result is undefined)"
        // (the op's documentation).
        let mut seen = vec![false; rows as usize];
        for (pos, &r) in idx.iter().enumerate() {
            if r < 0 || r as i64 >= rows {
                return index_error(UNPERMUTE, "sortedIndices", pos, r, 0, rows as usize);
            }
            if std::mem::replace(&mut seen[r as usize], true) {
                return fail(
                    ACLNN_ERR_PARAM_INVALID,
                    format!(
                        "{UNPERMUTE}: sortedIndices[{pos}] = {r} repeats an earlier index (duplicates are undefined)"
                    ),
                );
            }
        }
        let mut out = vec![0f32; t * h];
        for i in 0..t {
            let acc = &mut out[i * h..(i + 1) * h];
            for kk in 0..k {
                let r = idx[i * k + kk] as i64;
                let p = probs.as_ref().map_or(1.0, |p| p[i * k + kk]);
                let row = &x[r as usize * h..][..h];
                for j in 0..h {
                    acc[j] += p * row[j];
                }
            }
        }
        write_f32(&self.out, &out)
    }
}

/// `aclnnStatus aclnnMoeTokenUnpermuteGetWorkspaceSize(const aclTensor *permutedTokens, const aclTensor *sortedIndices, const aclTensor *probsOptional, bool paddedMode, const aclIntArray *restoreShapeOptional, const aclTensor *out, uint64_t *workspaceSize, aclOpExecutor **executor)`.
/// `paddedMode` must be false; `restoreShapeOptional` must be NULL.
#[no_mangle]
pub unsafe extern "C" fn aclnnMoeTokenUnpermuteGetWorkspaceSize(
    permuted_tokens: *const c_void,
    sorted_indices: *const c_void,
    probs_optional: *const c_void,
    padded_mode: bool,
    restore_shape_optional: *const c_void,
    out: *const c_void,
    workspace_size: *mut u64,
    executor: *mut AclOpExecutor,
) -> AclnnStatus {
    status::aclnn("aclnnMoeTokenUnpermuteGetWorkspaceSize", || {
        let op = UNPERMUTE;
        check_outs(workspace_size, executor)?;
        if padded_mode {
            return invalid(op, "paddedMode = true is not supported");
        }
        if !restore_shape_optional.is_null() {
            return invalid(op, "restoreShapeOptional must be NULL (aclIntArray is not simulated)");
        }
        let tokens = required(permuted_tokens, op, "permutedTokens")?;
        let idx = required(sorted_indices, op, "sortedIndices")?;
        let probs = tensor(probs_optional, op, "probsOptional")?;
        let out = required(out, op, "out")?;
        if !is_float(tokens.dtype) {
            return invalid(op, format!("permutedTokens is {}", dtype_name(tokens.dtype)));
        }
        let [_, h] = tokens.dims.as_slice() else {
            return invalid(op, format!("permutedTokens has shape {:?}, expected [T*K, H]", tokens.dims));
        };
        want_dtype(op, "sortedIndices", &idx, ACL_INT32)?;
        let [tk] = idx.dims.as_slice() else {
            return invalid(op, format!("sortedIndices has shape {:?}, expected 1-D [T*K]", idx.dims));
        };
        let (t, k) = match &probs {
            Some(p) => {
                let [t, k] = p.dims.as_slice() else {
                    return invalid(op, format!("probsOptional has shape {:?}, expected [T, K]", p.dims));
                };
                if p.dtype != tokens.dtype && p.dtype != ACL_FLOAT {
                    return invalid(op, format!("probsOptional is {}", dtype_name(p.dtype)));
                }
                (*t, *k)
            }
            None => (*tk, 1),
        };
        if t * k != *tk {
            return invalid(op, format!("sortedIndices has {tk} entries, expected T*K = {t}*{k}"));
        }
        // The aclnn doc: permutedTokens is [T*K, H] (one row per slot).
        if tokens.dims[0] != *tk {
            return invalid(op, format!("permutedTokens has {} rows, expected T*K = {tk}", tokens.dims[0]));
        }
        if *tk == 0 || *h == 0 {
            return invalid(op, format!("empty input (T*K = {tk}, H = {h}): call the op only with data"));
        }
        want_dims(op, "out", &out, &[t, *h])?;
        want_dtype(op, "out", &out, tokens.dtype)?;
        let u = Unpermute { h: *h as usize, tokens, idx, probs, out, t: t as usize, k: k as usize };
        publish(Executor::Unpermute(Box::new(u)), MOE_WORKSPACE, workspace_size, executor)
    })
}

/// `aclnnStatus aclnnMoeTokenUnpermute(void *workspace, uint64_t workspaceSize, aclOpExecutor *executor, aclrtStream stream)`.
#[no_mangle]
pub extern "C" fn aclnnMoeTokenUnpermute(
    workspace: *mut c_void,
    workspace_size: u64,
    executor: AclOpExecutor,
    stream: AclrtStream,
) -> AclnnStatus {
    status::aclnn(UNPERMUTE, || launch(UNPERMUTE, workspace, workspace_size, executor, stream))
}

/// Phase-1 snapshot of `aclnnAdd`.
#[derive(Debug)]
pub struct Add {
    a: TensorDesc,
    b: TensorDesc,
    alpha: Scalar,
    out: TensorDesc,
}

const ADD: &str = "aclnnAdd";

impl Add {
    fn run(&self) -> SimResult<()> {
        if self.a.dtype == ACL_INT32 {
            let (a, b) = (read_i32(&self.a)?, read_i32(&self.b)?);
            let alpha = self.alpha.int as i32;
            let out: Vec<u8> =
                a.iter().zip(&b).flat_map(|(x, y)| x.wrapping_add(alpha.wrapping_mul(*y)).to_le_bytes()).collect();
            return write_bytes(&self.out, &out);
        }
        let (a, b) = (read_f32(&self.a)?, read_f32(&self.b)?);
        let alpha = self.alpha.value as f32;
        let out: Vec<f32> = if alpha == 1.0 {
            a.iter().zip(&b).map(|(x, y)| x + y).collect()
        } else {
            a.iter().zip(&b).map(|(x, y)| x + alpha * y).collect()
        };
        write_f32(&self.out, &out)
    }
}

/// `aclnnStatus aclnnAddGetWorkspaceSize(const aclTensor *self, const aclTensor *other, const aclScalar *alpha, aclTensor *out, uint64_t *workspaceSize, aclOpExecutor **executor)`:
/// `out = self + alpha * other`, same shapes and dtypes (float32, float16,
/// bfloat16 or int32), no broadcasting.
#[no_mangle]
pub unsafe extern "C" fn aclnnAddGetWorkspaceSize(
    self_: *const c_void,
    other: *const c_void,
    alpha: *const c_void,
    out: *mut c_void,
    workspace_size: *mut u64,
    executor: *mut AclOpExecutor,
) -> AclnnStatus {
    status::aclnn("aclnnAddGetWorkspaceSize", || {
        let op = ADD;
        check_outs(workspace_size, executor)?;
        let a = required(self_, op, "self")?;
        let b = required(other, op, "other")?;
        let out = required(out, op, "out")?;
        if alpha.is_null() {
            return fail(ACLNN_ERR_PARAM_NULLPTR, format!("{op}: alpha is NULL"));
        }
        let alpha = *SCALARS.get(alpha as usize).ok_or_else(|| {
            SimError::new(ACLNN_ERR_PARAM_INVALID, format!("{op}: alpha ({alpha:p}) is not a live aclScalar"))
        })?;
        if !is_float(a.dtype) && a.dtype != ACL_INT32 {
            return invalid(op, format!("self is {}", dtype_name(a.dtype)));
        }
        for (arg, t) in [("other", &b), ("out", &out)] {
            want_dims(op, arg, t, &a.dims)?;
            want_dtype(op, arg, t, a.dtype)?;
        }
        publish(Executor::Add(Box::new(Add { a, b, alpha, out })), 0, workspace_size, executor)
    })
}

/// `aclnnStatus aclnnAdd(void *workspace, uint64_t workspaceSize, aclOpExecutor *executor, aclrtStream stream)`.
#[no_mangle]
pub extern "C" fn aclnnAdd(
    workspace: *mut c_void,
    workspace_size: u64,
    executor: AclOpExecutor,
    stream: AclrtStream,
) -> AclnnStatus {
    status::aclnn(ADD, || launch(ADD, workspace, workspace_size, executor, stream))
}

fn check_outs(workspace_size: *mut u64, executor: *mut AclOpExecutor) -> SimResult<()> {
    if workspace_size.is_null() || executor.is_null() {
        return fail(ACLNN_ERR_PARAM_NULLPTR, "workspaceSize or executor is NULL");
    }
    Ok(())
}

fn publish(exec: Executor, ws: u64, workspace_size: *mut u64, executor: *mut AclOpExecutor) -> SimResult<()> {
    let h = EXECUTORS.insert(Arc::new(exec));
    write_out(workspace_size, ws, ACLNN_ERR_PARAM_NULLPTR, "workspaceSize")?;
    write_out(executor, h as AclOpExecutor, ACLNN_ERR_PARAM_NULLPTR, "executor")
}

fn launch(
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
    let s = context::stream_here(stream as usize).map_err(|e| SimError::new(ACLNN_ERR_RUNTIME_ERROR, e.msg))?;
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
                arena::resolve(ws_addr, need as usize, "workspace").map_err(|e| {
                    SimError::new(
                        ACL_ERROR_RT_DEVICE_MEM_ERROR,
                        format!("{} (freed before the stream used it?)", e.msg),
                    )
                })?;
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
