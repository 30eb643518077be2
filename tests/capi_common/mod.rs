//! Helpers of the C ABI tests: the calling thread's last error message,
//! descriptors and finalize arguments, as a C caller writes them.
#![allow(dead_code)]

use std::ffi::c_void;
use std::ptr::null;

use ascend_moe::capi::*;

/// The calling thread's last error message (`amoe_last_error_message`).
pub fn last_error() -> String {
    let mut buf = vec![0u8; amoe_last_error_length()];
    let mut n = 0usize;
    // SAFETY: `buf` is writable for its length.
    let st = unsafe { amoe_last_error_message(buf.as_mut_ptr().cast(), buf.len(), &mut n) };
    assert_eq!(st, amoe_status::Ok);
    String::from_utf8(buf[..n].to_vec()).expect("UTF-8 message")
}

/// A contiguous host f32 descriptor of `shape` over `data`. It points at
/// both without a lifetime, as a C descriptor does: `data` and `shape` must
/// outlive every call given it (a shape array built in the argument list,
/// `&[n, 4]` with a variable `n`, is a temporary that does not).
pub fn host(data: &mut [f32], shape: &[usize]) -> amoe_tensor {
    desc(data.as_mut_ptr().cast(), amoe_dtype::F32, shape, amoe_device_kind::Cpu, 0)
}

/// A contiguous descriptor of `shape` over `data`, of `dtype`, in the memory
/// of device `kind` `ordinal`; lifetimes as [`host`].
pub fn desc(
    data: *mut c_void,
    dtype: amoe_dtype,
    shape: &[usize],
    kind: amoe_device_kind,
    ordinal: i32,
) -> amoe_tensor {
    amoe_tensor {
        data,
        dtype: dtype as u32,
        ndim: shape.len(),
        shape: shape.as_ptr(),
        strides: null(),
        device_kind: kind as u32,
        device_ordinal: ordinal,
    }
}

/// Finalize arguments over the two tensors every call needs, with no skip
/// terms, bias, scales or expert ids (set those with `..finalize_args(..)`).
pub fn finalize_args(
    expanded_x: &amoe_tensor,
    expanded_row_idx: &amoe_tensor,
    drop_pad_mode: u32,
) -> amoe_finalize_args {
    amoe_finalize_args {
        expanded_x,
        expanded_row_idx,
        x1: null(),
        x2: null(),
        bias: null(),
        scales: null(),
        expert_idx: null(),
        drop_pad_mode,
    }
}
