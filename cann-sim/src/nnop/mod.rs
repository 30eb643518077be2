//! nnopbase exports: `aclCreateTensor` / `aclDestroyTensor` and
//! `aclCreateScalar` / `aclDestroyScalar`. The tensors and scalars they
//! create, and the tables of live ones, are [`objects`], which the aclnn ops
//! and the leak report read without this module.

#![allow(non_snake_case, clippy::missing_safety_doc)]

pub mod objects;

use std::ffi::c_void;
use std::sync::Arc;

use crate::arena;
use crate::ffi::*;
use crate::status::{self, fail, SimError, SimResult};

use objects::{dtype_name, dtype_size, Scalar, TensorDesc, SCALARS, TENSORS};

unsafe fn slice_i64<'a>(p: *const i64, n: u64, what: &str) -> SimResult<&'a [i64]> {
    if n == 0 {
        return Ok(&[]);
    }
    if p.is_null() {
        return fail(ACLNN_ERR_PARAM_NULLPTR, format!("{what} is NULL but its length is {n}"));
    }
    if n > 25 {
        return fail(ACLNN_ERR_PARAM_INVALID, format!("{what} has {n} dims (at most 25)"));
    }
    // SAFETY: the caller passes `n` readable int64 values at `p` (C contract).
    Ok(unsafe { std::slice::from_raw_parts(p, n as usize) })
}

/// `aclTensor *aclCreateTensor(const int64_t *viewDims, uint64_t viewDimsNum, aclDataType dataType, const int64_t *stride, int64_t offset, aclFormat format, const int64_t *storageDims, uint64_t storageDimsNum, void *tensorData)`.
/// NULL `stride` means row-major contiguous.
#[no_mangle]
pub unsafe extern "C" fn aclCreateTensor(
    view_dims: *const i64,
    view_dims_num: u64,
    data_type: i32,
    stride: *const i64,
    offset: i64,
    format: i32,
    storage_dims: *const i64,
    storage_dims_num: u64,
    tensor_data: *mut c_void,
) -> AclTensor {
    status::ptr("aclCreateTensor", || {
        // SAFETY: C contract of aclCreateTensor (see each helper).
        let dims = unsafe { slice_i64(view_dims, view_dims_num, "viewDims") }?.to_vec();
        let strides = if stride.is_null() {
            let mut s = vec![1i64; dims.len()];
            for i in (0..dims.len().saturating_sub(1)).rev() {
                s[i] = s[i + 1] * dims[i + 1].max(1);
            }
            s
        } else {
            // SAFETY: as above, one stride per view dim.
            unsafe { slice_i64(stride, view_dims_num, "stride") }?.to_vec()
        };
        // SAFETY: as above.
        let storage = unsafe { slice_i64(storage_dims, storage_dims_num, "storageDims") }?.to_vec();
        let Some(es) = dtype_size(data_type) else {
            return fail(ACLNN_ERR_PARAM_INVALID, format!("unsupported {}", dtype_name(data_type)));
        };
        if dims.iter().chain(&strides).chain(&storage).any(|&v| v < 0) || offset < 0 {
            return fail(
                ACLNN_ERR_PARAM_INVALID,
                format!("negative dim, stride or offset (dims {dims:?}, strides {strides:?}, offset {offset})"),
            );
        }
        let t = TensorDesc { dims, dtype: data_type, strides, offset, format, storage, data: tensor_data as usize };
        if t.numel() > 0 {
            let last = t.offset + t.dims.iter().zip(&t.strides).map(|(d, s)| (d - 1) * s).sum::<i64>();
            let storage_numel: i64 = t.storage.iter().product();
            if last >= storage_numel {
                return fail(
                    ACLNN_ERR_PARAM_INVALID,
                    format!(
                        "view (dims {:?}, strides {:?}, offset {}) reaches element {last} of a storage of {storage_numel}",
                        t.dims, t.strides, t.offset
                    ),
                );
            }
            if t.data == 0 {
                return fail(ACLNN_ERR_PARAM_NULLPTR, "tensorData is NULL for a non-empty tensor");
            }
            let bytes = storage_numel as usize * es;
            arena::resolve(t.data, bytes, "tensorData").map_err(|e| SimError::new(ACLNN_ERR_PARAM_INVALID, e.msg))?;
        }
        Ok(TENSORS.insert(Arc::new(t)) as *mut c_void)
    })
}

/// `aclnnStatus aclDestroyTensor(const aclTensor *tensor)`.
#[no_mangle]
pub extern "C" fn aclDestroyTensor(tensor: *const c_void) -> AclnnStatus {
    status::aclnn("aclDestroyTensor", || {
        if tensor.is_null() {
            return Ok(());
        }
        TENSORS.remove(tensor as usize).map(|_| ()).ok_or_else(|| {
            SimError::new(ACLNN_ERR_PARAM_INVALID, format!("{tensor:p} is not a live aclTensor (double destroy?)"))
        })
    })
}

/// `aclScalar *aclCreateScalar(void *value, aclDataType dataType)`.
#[no_mangle]
pub unsafe extern "C" fn aclCreateScalar(value: *mut c_void, data_type: i32) -> AclScalar {
    status::ptr("aclCreateScalar", || {
        if value.is_null() {
            return fail(ACLNN_ERR_PARAM_NULLPTR, "value is NULL");
        }
        let p = value as *const u8;
        // SAFETY: `value` points to one element of `data_type` (C contract);
        // read_unaligned tolerates any alignment.
        let (v, i): (f64, i64) = unsafe {
            match data_type {
                ACL_FLOAT => {
                    let x = (p as *const f32).read_unaligned() as f64;
                    (x, x as i64)
                }
                ACL_DOUBLE => {
                    let x = (p as *const f64).read_unaligned();
                    (x, x as i64)
                }
                ACL_FLOAT16 => {
                    let x = half::f16::from_bits((p as *const u16).read_unaligned()).to_f64();
                    (x, x as i64)
                }
                ACL_BF16 => {
                    let x = half::bf16::from_bits((p as *const u16).read_unaligned()).to_f64();
                    (x, x as i64)
                }
                ACL_INT32 => {
                    let x = (p as *const i32).read_unaligned() as i64;
                    (x as f64, x)
                }
                ACL_INT64 => {
                    let x = (p as *const i64).read_unaligned();
                    (x as f64, x)
                }
                ACL_INT8 => {
                    let x = (p as *const i8).read() as i64;
                    (x as f64, x)
                }
                ACL_UINT8 | ACL_BOOL => {
                    let x = p.read() as i64;
                    (x as f64, x)
                }
                _ => return fail(ACLNN_ERR_PARAM_INVALID, format!("unsupported scalar {}", dtype_name(data_type))),
            }
        };
        Ok(SCALARS.insert(Arc::new(Scalar { dtype: data_type, value: v, int: i })) as *mut c_void)
    })
}

/// `aclnnStatus aclDestroyScalar(const aclScalar *scalar)`.
#[no_mangle]
pub extern "C" fn aclDestroyScalar(scalar: *const c_void) -> AclnnStatus {
    status::aclnn("aclDestroyScalar", || {
        if scalar.is_null() {
            return Ok(());
        }
        SCALARS.remove(scalar as usize).map(|_| ()).ok_or_else(|| {
            SimError::new(ACLNN_ERR_PARAM_INVALID, format!("{scalar:p} is not a live aclScalar (double destroy?)"))
        })
    })
}
