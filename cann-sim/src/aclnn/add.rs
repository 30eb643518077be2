//! `aclnnAdd`.

use std::ffi::c_void;
use std::sync::Arc;

use crate::ffi::*;
use crate::nnop::objects::{dtype_name, Scalar, TensorDesc, SCALARS};
use crate::status::{self, fail, SimError, SimResult};

use super::executor::{check_outs, publish, Op};
use super::launch::launch;
use super::tensors::{invalid, is_float, read_f32, read_i32, required, want_dims, want_dtype, write_bytes, write_f32};

/// Phase-1 snapshot of `aclnnAdd`.
#[derive(Debug)]
pub struct Add {
    a: TensorDesc,
    b: TensorDesc,
    alpha: Scalar,
    out: TensorDesc,
}

pub(super) const ADD: &str = "aclnnAdd";

impl Op for Add {
    fn name(&self) -> &'static str {
        ADD
    }

    fn workspace(&self) -> u64 {
        0
    }

    fn tensors(&self) -> Vec<&TensorDesc> {
        vec![&self.a, &self.b, &self.out]
    }

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
///
/// The checks run in CANN's order (ops-math `math/add/op_host/op_api/aclnn_add.cpp`,
/// `CheckParams`): `self`, `other`, `alpha`, `out` non-NULL (161001), then
/// the dtypes, then the shapes (161002). CANN promotes mixed dtypes, casts to
/// `out`'s and broadcasts; the simulator takes one dtype and one shape, its
/// own narrower rule.
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
        if alpha.is_null() {
            return fail(ACLNN_ERR_PARAM_NULLPTR, format!("{op}: alpha is NULL"));
        }
        let out = required(out, op, "out")?;
        let alpha = *SCALARS.get(alpha as usize).ok_or_else(|| {
            SimError::new(ACLNN_ERR_PARAM_INVALID, format!("{op}: alpha ({alpha:p}) is not a live aclScalar"))
        })?;
        if !is_float(a.dtype) && a.dtype != ACL_INT32 {
            return invalid(op, format!("self is {}", dtype_name(a.dtype)));
        }
        for (arg, t) in [("other", &b), ("out", &out)] {
            want_dtype(op, arg, t, a.dtype)?;
        }
        for (arg, t) in [("other", &b), ("out", &out)] {
            want_dims(op, arg, t, &a.dims)?;
        }
        publish(Arc::new(Add { a, b, alpha, out }), workspace_size, executor)
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
