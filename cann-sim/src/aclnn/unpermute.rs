//! `aclnnMoeTokenUnpermute`.

use std::ffi::c_void;
use std::sync::Arc;

use crate::ffi::*;
use crate::nnop::objects::{dtype_name, TensorDesc};
use crate::status::{self, SimResult};

use super::executor::{check_outs, publish, Op, MOE_WORKSPACE};
use super::launch::launch;
use super::sum::blocked_sum;
use super::tensors::{
    index_error, invalid, is_float, kernel_trap, read_f32, read_i32, required, tensor, want_dims, want_dtype, write_f32,
};

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

pub(super) const UNPERMUTE: &str = "aclnnMoeTokenUnpermute";

impl Op for Unpermute {
    fn name(&self) -> &'static str {
        UNPERMUTE
    }

    fn workspace(&self) -> u64 {
        MOE_WORKSPACE
    }

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
                return kernel_trap(format!(
                    "{UNPERMUTE}: sortedIndices[{pos}] = {r} repeats an earlier index (duplicates are undefined)"
                ));
            }
        }
        let mut out = vec![0f32; t * h];
        for i in 0..t {
            let acc = &mut out[i * h..(i + 1) * h];
            let term = |kk: usize, j: usize| {
                let r = idx[i * k + kk] as usize;
                probs.as_ref().map_or(1.0, |p| p[i * k + kk]) * x[r * h + j]
            };
            blocked_sum(acc, k, term);
        }
        write_f32(&self.out, &out)
    }
}

/// `aclnnStatus aclnnMoeTokenUnpermuteGetWorkspaceSize(const aclTensor *permutedTokens, const aclTensor *sortedIndices, const aclTensor *probsOptional, bool paddedMode, const aclIntArray *restoreShapeOptional, const aclTensor *out, uint64_t *workspaceSize, aclOpExecutor **executor)`.
///
/// On Atlas A2/A3 the call is the generated `aclnnInner...` one
/// (ops-transformer `moe_token_unpermute/op_host/op_api/aclnn_moe_token_unpermute.cpp`),
/// so the checks run in its order: a NULL required tensor (161001), then the
/// dtypes of the op definition (`moe_token_unpermute_def.cpp`, 161002), then
/// the tiling, which on A2 checks nothing (`moe_token_unpermute_tiling.cpp`,
/// `InputParamCheck`). The checks after the dtypes are the simulator's own
/// (161002): `paddedMode` false and `restoreShapeOptional` NULL, and the
/// shapes of the aclnn doc.
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
        let tokens = required(permuted_tokens, op, "permutedTokens")?;
        let idx = required(sorted_indices, op, "sortedIndices")?;
        let probs = tensor(probs_optional, op, "probsOptional")?;
        let out = required(out, op, "out")?;
        if !is_float(tokens.dtype) {
            return invalid(op, format!("permutedTokens is {}", dtype_name(tokens.dtype)));
        }
        want_dtype(op, "sortedIndices", &idx, ACL_INT32)?;
        // The A2 definition takes probs of any of the three float dtypes;
        // the simulator only those SPEC section 1 allows (the data's, or f32).
        if let Some(p) = probs.as_ref().filter(|p| p.dtype != tokens.dtype && p.dtype != ACL_FLOAT) {
            return invalid(op, format!("probsOptional is {}", dtype_name(p.dtype)));
        }
        want_dtype(op, "out", &out, tokens.dtype)?;
        if padded_mode {
            return invalid(op, "paddedMode = true is not supported");
        }
        if !restore_shape_optional.is_null() {
            return invalid(op, "restoreShapeOptional must be NULL (aclIntArray is not simulated)");
        }
        let [_, h] = tokens.dims.as_slice() else {
            return invalid(op, format!("permutedTokens has shape {:?}, expected [T*K, H]", tokens.dims));
        };
        let [tk] = idx.dims.as_slice() else {
            return invalid(op, format!("sortedIndices has shape {:?}, expected 1-D [T*K]", idx.dims));
        };
        let (t, k) = match &probs {
            Some(p) => {
                let [t, k] = p.dims.as_slice() else {
                    return invalid(op, format!("probsOptional has shape {:?}, expected [T, K]", p.dims));
                };
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
        let u = Unpermute { h: *h as usize, tokens, idx, probs, out, t: t as usize, k: k as usize };
        publish(Arc::new(u), workspace_size, executor)
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
