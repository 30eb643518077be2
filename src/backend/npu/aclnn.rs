//! The operands of aclnn calls, safely: tensor descriptors ([`Desc`]) over
//! device memory and scalars ([`Scalar`]), each destroyed on drop, and ACL's
//! code for a dtype.

use std::ffi::c_void;

use acl_sys::aclnn::{aclScalar, aclTensor};
use acl_sys::{aclDataType, aclFormat};

use super::result::aclnn::{create_scalar, create_tensor, destroy_scalar, destroy_tensor, nnopbase};
use super::runtime::record_drop_error;
use crate::{with_dtype, DType, Element, Error, Result};

/// ACL's code for a dtype.
pub fn acl_dtype(d: DType) -> aclDataType {
    match d {
        DType::F32 => aclDataType::ACL_FLOAT,
        DType::F16 => aclDataType::ACL_FLOAT16,
        DType::BF16 => aclDataType::ACL_BF16,
        DType::I32 => aclDataType::ACL_INT32,
        DType::I64 => aclDataType::ACL_INT64,
        DType::I8 => aclDataType::ACL_INT8,
        DType::U8 => aclDataType::ACL_UINT8,
        DType::Bool => aclDataType::ACL_BOOL,
        // Raw codes: `ACL_FLOAT8_E5M2 = 35` and `ACL_FLOAT8_E4M3FN = 36` in the
        // `aclDataType` of acl_base.h from the torch-npu 2.11.0+ headers on; the
        // 2.9.0 (CANN 8.1-era) headers have no such variants, and the crate
        // must build against them too.
        DType::F8E4M3 => aclDataType(ACL_FLOAT8_E4M3FN as _),
        DType::F8E5M2 => aclDataType(ACL_FLOAT8_E5M2 as _),
    }
}

/// `aclDataType` code of fp8 e5m2 (acl_base.h, torch-npu 2.11.0+ headers).
const ACL_FLOAT8_E5M2: i32 = 35;
/// `aclDataType` code of fp8 e4m3fn (acl_base.h, torch-npu 2.11.0+ headers).
const ACL_FLOAT8_E4M3FN: i32 = 36;

/// Device memory a descriptor can view: its address and its size.
pub(crate) trait DeviceMemory {
    /// The device address (NULL when empty).
    fn device_ptr(&self) -> *mut c_void;
    /// Size in bytes.
    fn size_bytes(&self) -> usize;
}

/// An `aclTensor` descriptor, destroyed on drop.
pub(crate) struct Desc {
    pub(crate) raw: *mut aclTensor,
}

impl Desc {
    /// A contiguous ND descriptor of `shape` over `buf` (which must hold it).
    pub(crate) fn new(buf: &impl DeviceMemory, dtype: DType, shape: &[usize]) -> Result<Desc> {
        nnopbase()?;
        let dims: Vec<i64> = shape.iter().map(|&d| d as i64).collect();
        let mut strides = vec![1i64; dims.len()];
        for i in (0..dims.len().saturating_sub(1)).rev() {
            strides[i] = strides[i + 1] * dims[i + 1].max(1);
        }
        let need = shape.iter().product::<usize>() * dtype.size();
        if need > buf.size_bytes() {
            return Err(Error::invalid(
                "aclCreateTensor",
                "shape",
                format!("{shape:?} of {dtype} needs {need} bytes, the buffer has {}", buf.size_bytes()),
            ));
        }
        // SAFETY: the data pointer is device memory holding the whole view
        // (checked above), live while the descriptor is used.
        let raw = unsafe {
            create_tensor(&dims, acl_dtype(dtype), &strides, 0, aclFormat::ACL_FORMAT_ND, &dims, buf.device_ptr())
        }?;
        Ok(Desc { raw })
    }
}

impl Drop for Desc {
    fn drop(&mut self) {
        // SAFETY: created by aclCreateTensor, destroyed once, after phase two.
        if let Err(e) = unsafe { destroy_tensor(self.raw) } {
            record_drop_error(e);
        }
    }
}

/// An `aclScalar`, destroyed on drop.
pub(crate) struct Scalar {
    pub(crate) raw: *mut aclScalar,
}

impl Scalar {
    /// The scalar one of `dtype`.
    pub(crate) fn one(dtype: DType) -> Result<Scalar> {
        nnopbase()?;
        let mut bytes = [0u8; 8];
        with_dtype!(dtype, T => {
            let one = T::from_f32(1.0);
            bytes[..dtype.size()].copy_from_slice(bytemuck::bytes_of(&one));
        });
        // SAFETY: `bytes` holds one value of `dtype`; aclCreateScalar copies it.
        let raw = unsafe { create_scalar(bytes.as_mut_ptr().cast::<c_void>(), acl_dtype(dtype)) }?;
        Ok(Scalar { raw })
    }
}

impl Drop for Scalar {
    fn drop(&mut self) {
        // SAFETY: created by aclCreateScalar, destroyed once.
        if let Err(e) = unsafe { destroy_scalar(self.raw) } {
            record_drop_error(e);
        }
    }
}

/// The descriptor of an optional operand, NULL when absent.
pub(crate) fn opt(d: &Option<Desc>) -> *const aclTensor {
    d.as_ref().map_or(std::ptr::null(), |d| d.raw)
}
