//! `aclnnMoeFinalizeRoutingV2`.

use std::ffi::c_void;
use std::sync::Arc;

use crate::ffi::*;
use crate::nnop::objects::{dtype_name, TensorDesc};
use crate::status::{self, SimResult};

use super::executor::{check_outs, publish, Op, MOE_WORKSPACE};
use super::launch::launch;
use super::sum::blocked_sum;
use super::tensors::{
    index_error, invalid, is_float, read_f32, read_i32, required, tensor, tiling, tiling_dims, want_dtype, write_f32,
};

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

pub(super) const FINALIZE: &str = "aclnnMoeFinalizeRoutingV2";

/// Phase one of `aclnnMoeFinalizeRoutingV2`, in CANN's order. The op's
/// `GetWorkspaceSize` is generated code: it refuses a NULL required tensor
/// (161001) and a dtype or format outside the op definition
/// (`moe_finalize_routing_v2_def.cpp`, 161002), then runs the tiling, whose
/// `DoGetShapeAttrsInfo` (`moe_finalize_routing_v2_tiling_membase.cpp`)
/// checks the attribute and every shape in the order below (561002). The
/// aclnn doc's codes agree: 161001 null pointer, 161002 dtype or format,
/// 561002 shape. The simulator's own rules (marked) come after CANN's.
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

    // The op definition's dtype combinations for Atlas A2/A3: expandedX,
    // x1, x2, bias and y all f16, f32 or bf16; scales the same, or f32 with
    // bf16 data; the indices int32. The aclnn doc: "in mixed-precision mode
    // scales may be FLOAT32 when expandedX is BFLOAT16; otherwise its dtype
    // must equal expandedX's".
    if !is_float(ex.dtype) {
        return invalid(op, format!("expandedX is {} (expected float32, float16 or bfloat16)", dtype_name(ex.dtype)));
    }
    want_dtype(op, "expandedRowIdx", &ri, ACL_INT32)?;
    for (arg, t) in [("x1Optional", &x1), ("x2Optional", &x2), ("biasOptional", &bias)] {
        if let Some(t) = t {
            want_dtype(op, arg, t, ex.dtype)?;
        }
    }
    if let Some(s) = &scales {
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
    }
    if let Some(e) = &expert_idx {
        want_dtype(op, "expertIdxOptional", e, ACL_INT32)?;
    }
    want_dtype(op, "out", &out, ex.dtype)?;

    // The tiling, in its order.
    if !(0..=3).contains(&mode) {
        return tiling(op, format!("dropPadMode is {mode}: the value of drop_pad_mode should be [0,3]"));
    }
    let drop_pad = mode == 1 || mode == 3;
    let [nk] = ri.dims.as_slice() else {
        return tiling(op, format!("expandedRowIdx has shape {:?}: the expanded_row_idx should be 1D tensor", ri.dims));
    };
    let k = match &scales {
        Some(s) => {
            let [_, k] = s.dims.as_slice() else {
                return tiling(op, format!("scalesOptional has shape {:?}: the scales should be 2D tensor", s.dims));
            };
            if *k == 0 {
                return tiling(op, "scalesOptional has 0 columns: K can not be 0");
            }
            *k
        }
        None => 1,
    };
    // The simulator's own rule: the tiling takes N = N*K / K, rounding down.
    if nk % k != 0 {
        return tiling(op, format!("expandedRowIdx has {nk} entries, not a multiple of K = {k}"));
    }
    let n = nk / k;
    let (rows, h) = match (drop_pad, ex.dims.as_slice()) {
        (false, [r, h]) => (*r, *h),
        (true, [e, c, h]) => (e * c, *h),
        _ => {
            let want = if drop_pad {
                "3D [E, C, H] when drop_pad_mode is 1 or 3"
            } else {
                "2D [N*K, H] when drop_pad_mode is 0 or 2"
            };
            return tiling(op, format!("expandedX has shape {:?}: the expanded_x should be {want}", ex.dims));
        }
    };
    if let Some(t) = &x1 {
        tiling_dims(op, "x1Optional", t, &[n, h])?;
    }
    if let Some(t) = &x2 {
        if x1.is_none() {
            return tiling(op, "In the case of x1 parameter is not input, x2 parameter can't be inputted either");
        }
        tiling_dims(op, "x2Optional", t, &[n, h])?;
    }
    if let Some(b) = &bias {
        if expert_idx.is_none() {
            return tiling(
                op,
                "expertIdxOptional is required when bias is given: the expert_idx must exist when bias exist",
            );
        }
        let [e, bh] = b.dims.as_slice() else {
            return tiling(op, format!("biasOptional has shape {:?}: the bias should be 2D tensor [E, H]", b.dims));
        };
        if drop_pad && *e != ex.dims[0] {
            return tiling(
                op,
                format!(
                    "biasOptional has shape {:?}: the dim 0 of bias should be {} when drop_pad_mode is 1 or 3",
                    b.dims, ex.dims[0]
                ),
            );
        }
        if *bh != h {
            return tiling(op, format!("biasOptional has shape {:?}: the dim 1 of bias should be {h}", b.dims));
        }
    }
    if let Some(e) = &expert_idx {
        tiling_dims(op, "expertIdxOptional", e, &[n, k])?;
    }
    // E >= K comes after expertIdx's shape in the tiling, so it is not
    // folded into the bias block above.
    if let Some(b) = &bias {
        if b.dims[0] < k {
            return tiling(op, format!("E = {} experts (bias rows) is less than K = {k}: E should be >= K", b.dims[0]));
        }
    }
    tiling_dims(op, "out", &out, &[n, h])?;

    // The simulator's own rules, from the op's infershape, which the tiling
    // does not repeat. The scales have a row per token, N = N*K / K ("the dim
    // 0 of skip1, skip2, scales and expert_idx should be same"): the kernel
    // reads N rows of them.
    if let Some(s) = &scales {
        tiling_dims(op, "scalesOptional", s, &[n, k])?;
    }
    // In the drop-less modes expandedX has the N*K rows expandedRowIdx
    // indexes ("the dim 0 of expanded_x and expanded_row_idx should be same").
    if !drop_pad && rows != *nk {
        return tiling(op, format!("expandedX has {rows} rows, expected N*K = {nk} (dropPadMode {mode})"));
    }
    // The aclnn doc's constraint E >= K, also without bias in the drop-pad
    // modes (E is then expandedX's first dimension).
    if drop_pad && bias.is_none() && ex.dims[0] < k {
        return tiling(op, format!("E = {} experts (expandedX's dim 0) is less than K = {k}", ex.dims[0]));
    }
    // Empty inputs: the op's tiling divides the rows among the cores; the
    // simulator refuses 0 tokens or an empty hidden size rather than guess.
    if n == 0 || h == 0 {
        return invalid(op, format!("empty input (N = {n}, H = {h}): call the op only with data"));
    }
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

impl Op for Finalize {
    fn name(&self) -> &'static str {
        FINALIZE
    }

    fn workspace(&self) -> u64 {
        MOE_WORKSPACE
    }

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
            // Term k of element j: s(i,k) * (row(R(i,k)) + bias[expert_idx[i,k]]).
            let term = |kk: usize, j: usize| {
                let slot = if row_layout { i * k + kk } else { kk * n + i };
                let r = ridx[slot];
                let s = scales.as_ref().map_or(1.0, |s| s[i * k + kk]);
                let row = if r < 0 { 0.0 } else { x[r as usize * h + j] };
                let t = match (&bias, &experts) {
                    (Some(b), Some(e)) => row + b[e[i * k + kk] as usize * h + j],
                    _ => row,
                };
                s * t
            };
            blocked_sum(acc, k, term);
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
        publish(Arc::new(f), workspace_size, executor)
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
