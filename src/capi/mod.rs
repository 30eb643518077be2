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
//! - enum-like inputs (dtype, device kind, reduce op, comm type, shared mode,
//!   drop-pad mode) are passed as `uint32_t` and validated, so an unknown
//!   value is an error rather than undefined behaviour;
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

pub(crate) mod ffi;

mod comm;
mod live;
mod ops;
mod prepare;
mod shared;

pub use comm::*;
pub use live::*;
pub use ops::*;
pub use prepare::*;
pub use shared::*;

use std::ffi::{c_char, c_void};

use ffi::{ffi, try_out, with_last_error, write_out, Failure};

/// Status code of every export. Numbers are fixed forever: a retired code is
/// never reused for something else.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum amoe_status {
    /// Success.
    Ok = 0,
    /// A required pointer argument was NULL.
    NullArgument = 1,
    /// An argument has a value the function does not accept.
    InvalidArgument = 2,
    /// A tensor has the wrong shape.
    Shape = 3,
    /// A tensor has the wrong dtype, or a dtype code is unknown.
    Dtype = 4,
    /// An index tensor holds a value outside its valid range.
    IndexOutOfRange = 5,
    /// A tensor is on the wrong device, or a device kind is unknown.
    Device = 6,
    /// Ranks called different collectives (kind, count, dtype, root, op).
    CommMismatch = 7,
    /// A peer did not arrive within the communicator's timeout.
    CommTimeout = 8,
    /// A peer died or aborted the group.
    CommPeerFailed = 9,
    /// Rendezvous or sub-group construction was invalid.
    CommSetup = 10,
    /// An ACL runtime call failed.
    Acl = 11,
    /// An HCCL call failed.
    Hccl = 12,
    /// An aclnn operator call failed.
    Aclnn = 13,
    /// A runtime library or backend is not available (e.g. no CANN / NPU backend).
    Unavailable = 14,
    /// An operating-system call failed (shared memory, files).
    Io = 15,
    /// A caller-provided buffer is too small; the needed size was written where the function says.
    BufferTooSmall = 16,
    /// The library panicked; this is a bug. The message says where.
    Panic = 17,
    /// A device kernel reported a fault (bad index, tiling, or a simulated hardware rule).
    Kernel = 18,
    /// Work captured for one forward context ran under another (found on the
    /// device by the captured ops' guard, reported by the stream check).
    StaleContext = 19,
}

/// Element type codes of `amoe_tensor::dtype` (the crate's `DType` numbering).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum amoe_dtype {
    /// IEEE binary32.
    F32 = 0,
    /// IEEE binary16.
    F16 = 1,
    /// bfloat16.
    BF16 = 2,
    /// int32 (index tensors).
    I32 = 3,
    /// int64.
    I64 = 4,
    /// int8 (quantized hidden states; moved, never reduced).
    I8 = 5,
    /// uint8 (also packed fp4, two e2m1 values per byte; moved, never reduced).
    U8 = 6,
    /// bool, one byte (masks; moved, never reduced).
    Bool = 7,
    /// float8 e4m3fn (moved, never reduced).
    F8E4M3 = 8,
    /// float8 e5m2 (moved, never reduced).
    F8E5M2 = 9,
}

/// Device kinds of `amoe_tensor::device_kind`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum amoe_device_kind {
    /// Host memory.
    Cpu = 0,
    /// Ascend NPU memory (`device_ordinal` names the device, which must be
    /// the device of the call's `amoe_stream`). Borrowed for the call, never
    /// copied to the host and never freed; `AMOE_STATUS_UNAVAILABLE` when
    /// CANN cannot be loaded.
    Npu = 1,
}

pub(crate) const AMOE_DEVICE_CPU: u32 = amoe_device_kind::Cpu as u32;
pub(crate) const AMOE_DEVICE_NPU: u32 = amoe_device_kind::Npu as u32;

/// Reduction operators of the collectives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum amoe_reduce_op {
    /// Sum (f32 accumulation for f16 / bf16).
    Sum = 0,
    /// Elementwise maximum.
    Max = 1,
    /// Elementwise minimum.
    Min = 2,
}

/// vLLM-Ascend's MoE communication types (SPEC section 5), chosen per forward pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum amoe_comm_type {
    /// DP all-gather of tokens.
    Allgather = 0,
    /// MC2 dispatch / combine.
    Mc2 = 1,
    /// All-to-all dispatch / combine.
    Alltoall = 2,
    /// Fused MC2.
    FusedMc2 = 3,
}

/// Most dimensions an `amoe_tensor` may have.
pub const AMOE_MAX_NDIM: usize = 8;

/// A tensor descriptor: where the bytes are, what they hold, on which device.
///
/// The descriptor is only read. It never transfers ownership: `data`,
/// `shape` and `strides` stay owned by the caller and must stay valid for the
/// duration of the call that receives the descriptor, no longer.
/// - `data`: for inputs, readable for `prod(shape) * dtype_size` bytes; for
///   outputs, writable for that many bytes. May be NULL when the tensor has
///   no elements, and is ignored by `*_output_shape` functions.
/// - `dtype`: an `amoe_dtype` code.
/// - `ndim`: number of dimensions, `0..=AMOE_MAX_NDIM`; 0 is a scalar.
/// - `shape`: `ndim` sizes (may be NULL when `ndim == 0`).
/// - `strides`: NULL for a C-contiguous tensor, else `ndim` strides in
///   elements, which must describe a C-contiguous layout (size-1 dimensions
///   may carry any stride); other layouts are rejected.
/// - `device_kind`: an `amoe_device_kind` code; `device_ordinal` names the NPU.
#[derive(Debug, Clone, Copy)]
#[repr(C)]
pub struct amoe_tensor {
    /// First byte of the elements.
    pub data: *mut c_void,
    /// An `amoe_dtype` code.
    pub dtype: u32,
    /// Number of dimensions.
    pub ndim: usize,
    /// `ndim` sizes.
    pub shape: *const usize,
    /// NULL, or `ndim` strides in elements (must be C-contiguous).
    pub strides: *const isize,
    /// An `amoe_device_kind` code.
    pub device_kind: u32,
    /// NPU ordinal (ignored for host tensors).
    pub device_ordinal: i32,
}

/// The library version as a static NUL-terminated string (`"MAJOR.MINOR.PATCH"`).
/// Owned by the library; never free it.
#[no_mangle]
pub extern "C" fn amoe_version() -> *const c_char {
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr() as *const c_char
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
                // SAFETY: non-null, writable per the contract.
                unsafe { write_out(out_len, n) };
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
    let s: &'static str = match status {
        0 => "ok\0",
        1 => "null argument\0",
        2 => "invalid argument\0",
        3 => "shape mismatch\0",
        4 => "dtype mismatch\0",
        5 => "index out of range\0",
        6 => "wrong device\0",
        7 => "collective mismatch\0",
        8 => "collective timeout\0",
        9 => "peer failed\0",
        10 => "communicator setup failed\0",
        11 => "ACL error\0",
        12 => "HCCL error\0",
        13 => "aclnn error\0",
        14 => "unavailable\0",
        15 => "I/O error\0",
        16 => "buffer too small\0",
        17 => "internal panic\0",
        18 => "kernel fault\0",
        19 => "stale forward context\0",
        _ => "unknown status\0",
    };
    s.as_ptr() as *const c_char
}

/// vLLM-Ascend's name of a comm type (`"ALLGATHER"`, `"MC2"`, `"ALLTOALL"`,
/// `"FUSED_MC2"`) as a static NUL-terminated string into `*out` (owned by the
/// library, never free it). Unknown codes return `AMOE_STATUS_INVALID_ARGUMENT`.
///
/// # Safety
/// `out` must be NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn amoe_comm_type_name(comm_type: u32, out: *mut *const c_char) -> amoe_status {
    const F: &str = "amoe_comm_type_name";
    ffi!(F, {
        let out = try_out!(F, out, "out");
        let name: &'static str = match crate::CommType::from_u32(comm_type)? {
            crate::CommType::AllGather => "ALLGATHER\0",
            crate::CommType::Mc2 => "MC2\0",
            crate::CommType::AllToAll => "ALLTOALL\0",
            crate::CommType::FusedMc2 => "FUSED_MC2\0",
        };
        // SAFETY: checked non-null, writable per the contract.
        unsafe { write_out(out, name.as_ptr() as *const c_char) };
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
        let names: std::collections::HashSet<_> = (0..=17u32)
            .map(|s| {
                // SAFETY: amoe_status_name returns a static NUL-terminated string.
                unsafe { std::ffi::CStr::from_ptr(amoe_status_name(s)) }.to_str().map(str::to_owned)
            })
            .collect::<Result<_, _>>()
            .map_err(|e| e.to_string())
            .unwrap_or_default();
        assert_eq!(names.len(), 18);
    }
}
