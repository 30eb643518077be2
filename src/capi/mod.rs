//! The C ABI (`include/ascend_moe.h`): `extern "C"` shims over the Rust API, nothing more.
//!
//! Conventions, the same for every export:
//! - every symbol and type starts with `amoe_`;
//! - every function returns an `amoe_status` (0 = `AMOE_STATUS_OK`) and
//!   writes results through out-pointers; on failure the message is kept per
//!   thread and read with `amoe_last_error_message`;
//! - every body runs inside a panic boundary: a panic returns
//!   `AMOE_STATUS_PANIC`, it never unwinds into C;
//! - every pointer is checked: NULL where a value is required returns
//!   `AMOE_STATUS_NULL_ARGUMENT`; `*_free` functions accept NULL;
//! - every handle carries its type (`handle`): a handle of another type
//!   passed in its place returns `AMOE_STATUS_INVALID_ARGUMENT` naming the
//!   argument, and a `*_free` function leaves it alone;
//! - enum-like inputs (dtype, device kind, reduce op, comm type, shared mode,
//!   drop-pad mode) are passed as `uint32_t` and validated, so an unknown
//!   value is an error rather than undefined behaviour; their numbers are the
//!   Rust enums' (`types::ENUMS`), which `amoe_enum_*` also give at run time;
//! - tensors cross as `amoe_tensor` descriptors. Host (CPU) inputs are read
//!   from the caller's memory during the call only; outputs are written into
//!   memory the caller allocated with the shape the matching
//!   `*_output_shape` function returns. NPU tensors (device memory, e.g. a
//!   torch_npu tensor's `data_ptr()`) are used in place, without copies to
//!   the host: inputs are read on the call's stream, outputs are written by
//!   the op directly or, when the op computes into its own buffer, by one
//!   device-to-device copy queued on the call's stream. The library never
//!   keeps a pointer to caller memory after a call returns, and never frees
//!   or destroys caller memory, streams or HCCL communicators.

#![allow(non_camel_case_types)]

mod failure;
pub(crate) mod ffi;
pub(crate) mod handle;

mod comm;
mod finalize;
mod host;
mod layout;
mod live;
mod pad_reduce;
mod prepare_finalize;
mod reduce;
mod shared;
mod types;

pub use comm::*;
pub use finalize::*;
pub use host::*;
pub use layout::*;
pub use live::*;
pub use pad_reduce::*;
pub use prepare_finalize::*;
pub use reduce::*;
pub use shared::*;
pub use types::*;

use std::ffi::c_char;

use crate::types::Numbered;
use ffi::{ffi, try_out, with_last_error, write_out, Failure};

/// The library version as a static NUL-terminated string (`"MAJOR.MINOR.PATCH"`).
/// Owned by the library; never free it.
#[no_mangle]
pub extern "C" fn amoe_version() -> *const c_char {
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr() as *const c_char
}

/// Whether the native kernels (`kernels/`) can launch here: `AMOE_STATUS_OK`
/// when they can (the AI Core kernel library is loaded, or a simulated
/// runtime runs their host build), else `AMOE_STATUS_UNAVAILABLE` with why as
/// this thread's last error. Without them NPU finalize and unpermute calls
/// use aclnn, which reads the index tensors on the host at every call (a
/// stream synchronisation and a blocking copy) and cannot be captured. The
/// first call loads the library (once per process); later ones answer at
/// once.
#[no_mangle]
pub extern "C" fn amoe_native_kernel_check() -> amoe_status {
    const F: &str = "amoe_native_kernel_check";
    ffi!(F, { Ok(crate::backend::npu::native_kernel_check(F)?) })
}

/// Length in bytes of this thread's last error message, plus one for the
/// terminating NUL: the buffer size `amoe_last_error_message` needs.
#[no_mangle]
pub extern "C" fn amoe_last_error_length() -> usize {
    std::panic::catch_unwind(|| with_last_error(|m| m.len() + 1)).unwrap_or(1)
}

/// Copies this thread's last error message (the one of the most recent call
/// on this thread that did not return `AMOE_STATUS_OK`; empty if none) into
/// `buf`, NUL-terminated.
///
/// `buf` is owned by the caller and holds `len` bytes. At most `len - 1`
/// bytes of the message are written (cut at a UTF-8 character boundary),
/// then a NUL; `*out_len` (if non-NULL) receives the number of message bytes
/// written, without the NUL. Returns `AMOE_STATUS_BUFFER_TOO_SMALL` when the
/// message was cut (including `len == 0`, when nothing is written). Reading
/// the message does not clear it, and this function never changes it.
///
/// # Safety
/// `buf` must be writable for `len` bytes; `out_len` must be NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn amoe_last_error_message(buf: *mut c_char, len: usize, out_len: *mut usize) -> amoe_status {
    // Reading the message must not overwrite it, so failures here do not go
    // through `ffi!` (which records its own message).
    let r = std::panic::catch_unwind(|| {
        with_last_error(|msg| -> Result<amoe_status, Failure> {
            if len > 0 && buf.is_null() {
                return Ok(amoe_status::NullArgument);
            }
            let mut n = msg.len().min(len.saturating_sub(1));
            while !msg.is_char_boundary(n) {
                n -= 1;
            }
            if len > 0 {
                // SAFETY: `buf` is non-null and writable for `len > n` bytes; the
                // message is our own allocation, so they do not overlap.
                unsafe {
                    std::ptr::copy_nonoverlapping(msg.as_ptr(), buf as *mut u8, n);
                    *buf.add(n) = 0;
                }
            }
            if !out_len.is_null() {
                write_out(out_len, n);
            }
            Ok(if n < msg.len() || len == 0 { amoe_status::BufferTooSmall } else { amoe_status::Ok })
        })
    });
    match r {
        Ok(Ok(s)) => s,
        Ok(Err(f)) => f.status,
        Err(_) => amoe_status::Panic,
    }
}

/// The message text of a status code, as a static NUL-terminated string
/// owned by the library (never free it). Unknown codes give `"unknown status"`.
#[no_mangle]
pub extern "C" fn amoe_status_name(status: u32) -> *const c_char {
    amoe_status::try_from(status).map_or(c"unknown status", amoe_status::message).as_ptr()
}

/// The number of enums the C ABI numbers (`amoe_status`, `amoe_dtype`, ...):
/// `amoe_enum_info` and `amoe_enum_entry` take `0..amoe_enum_count()`, in
/// the order of the header's `enum` blocks. The tables are the library's
/// own numbering, from which the header was generated; bindings read them
/// instead of repeating the numbers.
#[no_mangle]
pub extern "C" fn amoe_enum_count() -> usize {
    ENUMS.len()
}

/// Entry `index` of [`ENUMS`]; an error names the valid range.
fn c_enum(f: &str, index: usize) -> Result<&'static CEnum, Failure> {
    ENUMS.get(index).ok_or_else(|| {
        Failure::invalid(f, "index", format!("{index} is not an enum index (expected 0..{})", ENUMS.len()))
    })
}

/// The C type name of enum `index` (`"amoe_dtype"`, a static NUL-terminated
/// string owned by the library, never free it) into `*out_name`, and its
/// number of variants into `*out_len`. `index >= amoe_enum_count()` returns
/// `AMOE_STATUS_INVALID_ARGUMENT`.
///
/// # Safety
/// `out_name` and `out_len` must be writable (NULL is refused with
/// `AMOE_STATUS_NULL_ARGUMENT`).
#[no_mangle]
pub unsafe extern "C" fn amoe_enum_info(
    index: usize,
    out_name: *mut *const c_char,
    out_len: *mut usize,
) -> amoe_status {
    const F: &str = "amoe_enum_info";
    ffi!(F, {
        let out_name = try_out!(F, out_name, "out_name");
        let out_len = try_out!(F, out_len, "out_len");
        let e = c_enum(F, index)?;
        write_out(out_name, e.name.as_ptr());
        write_out(out_len, e.variants.len());
        Ok(())
    })
}

/// Variant `variant` of enum `index`: its name without the enum's prefix
/// (`"BF16"` for `AMOE_DTYPE_BF16`; a static NUL-terminated string owned by
/// the library, never free it) into `*out_name` and its value into
/// `*out_value`. Variants are in numbering order. An index out of range
/// returns `AMOE_STATUS_INVALID_ARGUMENT`.
///
/// # Safety
/// `out_name` and `out_value` must be writable (NULL is refused with
/// `AMOE_STATUS_NULL_ARGUMENT`).
#[no_mangle]
pub unsafe extern "C" fn amoe_enum_entry(
    index: usize,
    variant: usize,
    out_name: *mut *const c_char,
    out_value: *mut u32,
) -> amoe_status {
    const F: &str = "amoe_enum_entry";
    ffi!(F, {
        let out_name = try_out!(F, out_name, "out_name");
        let out_value = try_out!(F, out_value, "out_value");
        let e = c_enum(F, index)?;
        let v = e.variants.get(variant).ok_or_else(|| {
            Failure::invalid(
                F,
                "variant",
                format!(
                    "{variant} is not a variant of {} (expected 0..{})",
                    e.name.to_string_lossy(),
                    e.variants.len()
                ),
            )
        })?;
        write_out(out_name, v.c_name.as_ptr());
        write_out(out_value, v.value);
        Ok(())
    })
}

/// vLLM-Ascend's name of a comm type (`"ALLGATHER"`, `"MC2"`, `"ALLTOALL"`,
/// `"FUSED_MC2"`) as a static NUL-terminated string into `*out` (owned by the
/// library, never free it). Unknown codes return `AMOE_STATUS_INVALID_ARGUMENT`.
///
/// # Safety
/// `out` must be writable (NULL is refused with `AMOE_STATUS_NULL_ARGUMENT`).
#[no_mangle]
pub unsafe extern "C" fn amoe_comm_type_name(comm_type: u32, out: *mut *const c_char) -> amoe_status {
    const F: &str = "amoe_comm_type_name";
    ffi!(F, {
        let out = try_out!(F, out, "out");
        let name = crate::CommType::from_u32(comm_type)?.variant().c_name;
        write_out(out, name.as_ptr());
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn panic_becomes_status_and_message() {
        let s = ffi!("amoe_test", {
            let v: Vec<u8> = Vec::new();
            let i = v.len() + 3;
            #[allow(clippy::out_of_bounds_indexing)]
            let _ = v[i];
            Ok(())
        });
        assert_eq!(s, amoe_status::Panic);
        with_last_error(|m| {
            assert!(m.starts_with("amoe_test: internal panic"), "{m}");
            assert!(m.contains("index out of bounds"), "{m}");
        });
    }

    #[test]
    fn every_status_has_a_distinct_name() {
        let name = |s: u32| {
            // SAFETY: amoe_status_name returns a static NUL-terminated string.
            unsafe { std::ffi::CStr::from_ptr(amoe_status_name(s)) }.to_string_lossy().into_owned()
        };
        let names: std::collections::HashSet<String> = amoe_status::TABLE.iter().map(|v| name(v.value)).collect();
        assert_eq!(names.len(), amoe_status::VARIANTS.len(), "{names:?}");
        assert!(!names.contains("unknown status"), "{names:?}");
        let past = amoe_status::TABLE.iter().map(|v| v.value).max().unwrap_or(0) + 1;
        assert_eq!(name(past), "unknown status");
    }
}
