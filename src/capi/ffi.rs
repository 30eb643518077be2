//! The machinery under every export: the panic boundary, the thread-local last
//! error, null checks, and the conversion between C tensor descriptors and
//! [`Tensor`].
//!
//! Descriptors become tensors over the caller's memory, host and NPU alike,
//! for the duration of the call: inputs are read in place and outputs written
//! in place. Host memory is copied only where borrowing it would be unsound
//! or could change a result: a pointer that is not 8-byte aligned, and an
//! output that overlaps another operand of the same call (an in-place call);
//! such an output is computed into scratch and copied out at the end.

use std::cell::RefCell;
use std::ffi::{c_char, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};

use super::types::{
    amoe_status, amoe_stream, amoe_tensor, stream_device, AMOE_DEVICE_CPU, AMOE_DEVICE_NPU, AMOE_MAX_NDIM,
};
use crate::backend::npu::{NpuBuffer, NpuDevice};
use crate::error::CommErrorKind;
use crate::tensor::CpuBuffer;
use crate::tensor::Storage;
use crate::{Comm, DType, Error, Tensor};

/// Why an export failed: a status code plus the message `amoe_last_error_message` returns.
#[derive(Debug, Clone)]
pub(crate) struct Failure {
    pub(crate) status: amoe_status,
    pub(crate) msg: String,
}

impl Failure {
    pub(crate) fn new(status: amoe_status, msg: impl Into<String>) -> Self {
        Failure { status, msg: msg.into() }
    }

    pub(crate) fn null(func: &str, arg: &str) -> Self {
        Failure::new(amoe_status::NullArgument, format!("{func}: `{arg}` is NULL"))
    }

    pub(crate) fn invalid(func: &str, arg: &str, reason: impl std::fmt::Display) -> Self {
        Failure::new(amoe_status::InvalidArgument, format!("{func}: invalid argument `{arg}`: {reason}"))
    }
}

impl From<Error> for Failure {
    fn from(e: Error) -> Self {
        Failure { status: status_of(&e), msg: e.to_string() }
    }
}

/// The stable status code of every [`Error`] variant.
///
/// The match is exhaustive on purpose: a new variant does not compile until it
/// has a code here (and in the header).
pub(crate) fn status_of(e: &Error) -> amoe_status {
    match e {
        Error::InvalidArgument { .. } => amoe_status::InvalidArgument,
        Error::Shape { .. } => amoe_status::Shape,
        Error::DType { .. } => amoe_status::Dtype,
        Error::IndexOutOfRange { .. } => amoe_status::IndexOutOfRange,
        Error::Device { .. } => amoe_status::Device,
        Error::Comm { kind, .. } => match kind {
            CommErrorKind::Mismatch => amoe_status::CommMismatch,
            CommErrorKind::Timeout => amoe_status::CommTimeout,
            CommErrorKind::PeerFailed => amoe_status::CommPeerFailed,
            CommErrorKind::Setup => amoe_status::CommSetup,
        },
        Error::Acl { .. } => amoe_status::Acl,
        Error::Hccl { .. } => amoe_status::Hccl,
        Error::Aclnn { .. } => amoe_status::Aclnn,
        Error::Unavailable(_) => amoe_status::Unavailable,
        Error::Io { .. } => amoe_status::Io,
        Error::Kernel { .. } => amoe_status::Kernel,
        Error::StaleContext { .. } => amoe_status::StaleContext,
    }
}

thread_local! {
    static LAST_ERROR: RefCell<String> = const { RefCell::new(String::new()) };
    /// The host byte ranges `[start, end)` borrowed by the export running on
    /// this thread, with whether each one is written (an output).
    static BORROWED: RefCell<Vec<(usize, usize, bool)>> = const { RefCell::new(Vec::new()) };
    /// The device (with the caller's borrowed stream) of the export running on
    /// this thread, set by [`bind_stream`] for the call's duration.
    static NPU: RefCell<Option<NpuDevice>> = const { RefCell::new(None) };
}

/// Restores the previous per-call NPU device when an export returns.
pub(crate) struct NpuScope(Option<NpuDevice>);

impl Drop for NpuScope {
    fn drop(&mut self) {
        let prev = self.0.take();
        NPU.with(|d| *d.borrow_mut() = prev);
    }
}

/// Makes the device of `stream` (an `amoe_stream_wrap` handle; NULL = none)
/// the one NPU descriptors of this call live on, until the scope drops.
///
/// # Safety
/// `stream` must be NULL or a live handle from `amoe_stream_wrap`.
pub(crate) unsafe fn bind_stream(_func: &str, stream: *const amoe_stream) -> Result<NpuScope, Failure> {
    // SAFETY: the caller's contract.
    let dev = unsafe { stream_device(stream) }.cloned();
    Ok(NpuScope(NPU.with(|d| std::mem::replace(&mut *d.borrow_mut(), dev))))
}

/// The device an NPU descriptor lives on: the call's stream device, which
/// must be `d.device_ordinal`. Without CANN this is UNAVAILABLE with the
/// loader's message.
fn npu_device(func: &str, arg: &str, d: &amoe_tensor) -> Result<NpuDevice, Failure> {
    crate::backend::npu::runtime::acl()
        .map_err(|e| Failure::new(amoe_status::Unavailable, format!("{func}: `{arg}` is an NPU tensor: {e}")))?;
    let dev = NPU.with(|d| d.borrow().clone()).ok_or_else(|| {
        Failure::new(
            amoe_status::Device,
            format!("{func}: `{arg}` is an NPU tensor (npu:{}) but no stream was passed; wrap the engine's stream with amoe_stream_wrap", d.device_ordinal),
        )
    })?;
    if i64::from(dev.ordinal()) != i64::from(d.device_ordinal) {
        return Err(Failure::new(
            amoe_status::Device,
            format!("{func}: `{arg}` is on npu:{}, but the stream is on npu:{}", d.device_ordinal, dev.ordinal()),
        ));
    }
    Ok(dev)
}

/// Checks an HCCL communicator is on the device of the call's stream.
pub(crate) fn check_comm_device(func: &str, c: &Comm) -> Result<(), Failure> {
    if let Comm::Npu(h) = c {
        let comm_ord = h.npu_device().ordinal();
        if let Some(s) = NPU.with(|d| d.borrow().as_ref().map(|d| d.ordinal())) {
            if s != comm_ord {
                return Err(Failure::new(
                    amoe_status::Device,
                    format!("{func}: the communicator is on npu:{comm_ord}, but the stream is on npu:{s}"),
                ));
            }
        }
    }
    Ok(())
}

/// A tensor over the caller's NPU memory, borrowed (no copy; never freed by us).
///
/// # Safety
/// `d.data` must be device memory of the descriptor's device, valid for
/// `m.bytes` bytes for the duration of the call.
unsafe fn borrow_npu(func: &str, arg: &str, d: &amoe_tensor, m: &Meta) -> Result<Tensor, Failure> {
    let dev = npu_device(func, arg, d)?;
    if m.bytes > 0 && d.data.is_null() {
        return Err(Failure::null(func, &format!("{arg}.data")));
    }
    // SAFETY: the caller's contract; the tensor lives only for this call.
    let buf = unsafe { NpuBuffer::borrow_raw(&dev, d.data, m.bytes) }?;
    Ok(Tensor::from_parts(m.shape.clone(), m.dtype, Storage::Npu(buf))?)
}

/// An output tensor over the caller's memory when it is NPU memory (written
/// in place by the op), else a fresh host tensor of the descriptor's shape
/// that [`write_tensor`] copies out.
///
/// # Safety
/// As [`meta`]; NPU `data` as [`borrow_npu`].
pub(crate) unsafe fn out_tensor(func: &str, arg: &str, d: *const amoe_tensor) -> Result<Tensor, Failure> {
    let d = try_ref!(func, d, arg);
    // SAFETY: forwarded contract.
    let m = unsafe { meta(func, arg, d) }?;
    if d.device_kind == AMOE_DEVICE_NPU {
        // SAFETY: forwarded contract.
        return unsafe { borrow_npu(func, arg, d, &m) };
    }
    if m.bytes > 0 && d.data.is_null() {
        return Err(Failure::null(func, &format!("{arg}.data")));
    }
    // SAFETY: forwarded contract (`data` writable for `m.bytes`).
    if let Some(t) = unsafe { borrow_host(d, &m, true) }? {
        return Ok(t);
    }
    Ok(Tensor::try_zeros_cpu(&m.shape, m.dtype)?)
}

/// The output tensor an op computing from `x` writes in place: the caller's
/// memory as [`out_tensor`] gives it (host memory that cannot be borrowed is
/// a fresh tensor [`write_tensor`] copies out), or `None` when `out` is on
/// another kind of device than `x`, or is NPU memory overlapping `x`: then the
/// op computes a result of its own, which [`write_tensor`] copies into `out`.
///
/// # Safety
/// As [`out_tensor`].
pub(crate) unsafe fn out_for(
    func: &str,
    arg: &str,
    d: *const amoe_tensor,
    x: &Tensor,
) -> Result<Option<Tensor>, Failure> {
    let desc = try_ref!(func, d, arg);
    if (desc.device_kind == AMOE_DEVICE_NPU) == x.is_cpu() {
        return Ok(None);
    }
    // SAFETY: forwarded contract.
    let o = unsafe { out_tensor(func, arg, d) }?;
    if let (Storage::Npu(src), Storage::Npu(dst)) = (x.storage(), o.storage()) {
        let (s, e) = (src.as_ptr() as usize, src.as_ptr() as usize + src.len_bytes());
        let (ds, de) = (dst.as_ptr() as usize, dst.as_ptr() as usize + dst.len_bytes());
        if s < de && ds < e {
            return Ok(None);
        }
    }
    Ok(Some(o))
}

/// A tensor over the caller's host memory `d.data` (`m.bytes` bytes), or
/// `None` when it must be copied instead: not 8-byte aligned, or overlapping
/// memory of this call that is written (for an input) or used at all (for an
/// output, `writable`). A borrowed range is recorded until the export returns.
///
/// # Safety
/// `d.data` readable (and, when `writable`, writable) for `m.bytes` bytes for
/// the duration of the call; memory of an output is not read or written by
/// the caller during the call.
unsafe fn borrow_host(d: &amoe_tensor, m: &Meta, writable: bool) -> Result<Option<Tensor>, Failure> {
    if m.bytes == 0 {
        return Ok(None);
    }
    let (start, end) = (d.data as usize, d.data as usize + m.bytes);
    let clash = BORROWED.with(|b| b.borrow().iter().any(|&(s, e, w)| (w || writable) && s < end && start < e));
    if clash {
        return Ok(None);
    }
    // SAFETY: the caller's contract; the range does not overlap any other
    // borrowed range it could conflict with (checked just above), and the
    // tensor lives only for this call (the export drops it before returning).
    let Some(buf) = (unsafe { CpuBuffer::borrow_raw(d.data.cast(), m.bytes, writable) }) else {
        return Ok(None);
    };
    BORROWED.with(|b| b.borrow_mut().push((start, end, writable)));
    Ok(Some(Tensor::from_parts(m.shape.clone(), m.dtype, Storage::Cpu(buf))?))
}

/// Records `msg` as this thread's last error.
pub(crate) fn set_last_error(msg: String) {
    LAST_ERROR.with(|m| *m.borrow_mut() = msg);
}

/// Runs `f` with this thread's last error message.
pub(crate) fn with_last_error<R>(f: impl FnOnce(&str) -> R) -> R {
    LAST_ERROR.with(|m| f(&m.borrow()))
}

/// Converts a body's result into a status, recording the message on failure.
pub(crate) fn finish(r: Result<(), Failure>) -> amoe_status {
    match r {
        Ok(()) => amoe_status::Ok,
        Err(f) => {
            set_last_error(f.msg);
            f.status
        }
    }
}

/// Runs `body` inside the panic boundary: a panic becomes `AMOE_STATUS_PANIC`
/// with the panic message as the last error, never an unwind into C.
pub(crate) fn boundary(func: &str, body: impl FnOnce() -> Result<(), Failure>) -> amoe_status {
    BORROWED.with(|b| b.borrow_mut().clear());
    let r = catch_unwind(AssertUnwindSafe(body));
    BORROWED.with(|b| b.borrow_mut().clear());
    match r {
        Ok(r) => finish(r),
        Err(payload) => {
            let what = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "non-string panic payload".into());
            set_last_error(format!("{func}: internal panic: {what}"));
            amoe_status::Panic
        }
    }
}

/// Every export's body: `ffi!("amoe_x", { ... Ok(()) })` runs the block inside
/// [`boundary`] and returns the status.
macro_rules! ffi {
    ($func:expr, $body:block) => {
        $crate::capi::ffi::boundary($func, move || -> Result<(), $crate::capi::ffi::Failure> { $body })
    };
}
pub(crate) use ffi;

/// `try_ref!(FUNC, ptr, "arg")`: a shared reference, or return NULL_ARGUMENT.
macro_rules! try_ref {
    ($func:expr, $ptr:expr, $arg:expr) => {{
        let p = $ptr;
        if p.is_null() {
            return Err($crate::capi::ffi::Failure::null($func, $arg));
        }
        // SAFETY: non-null; the export's contract makes the caller guarantee it
        // points to a valid, initialised object for the duration of the call.
        unsafe { &*p }
    }};
}
pub(crate) use try_ref;

/// `try_out!(FUNC, ptr, "arg")`: checks an out-pointer is non-null and returns it.
macro_rules! try_out {
    ($func:expr, $ptr:expr, $arg:expr) => {{
        let p = $ptr;
        if p.is_null() {
            return Err($crate::capi::ffi::Failure::null($func, $arg));
        }
        p
    }};
}
pub(crate) use try_out;

/// Writes `v` through an out-pointer already checked by `try_out!`.
///
/// # Safety
/// `p` must be non-null, aligned and valid for a write of `T`.
pub(crate) unsafe fn write_out<T>(p: *mut T, v: T) {
    // SAFETY: the caller's contract, forwarded.
    unsafe { p.write(v) }
}

/// Reads a list of `len` `usize`s; NULL is allowed only when `len == 0`.
///
/// # Safety
/// When non-null, `ptr` must point to `len` readable `size_t`.
pub(crate) unsafe fn read_sizes(func: &str, arg: &str, ptr: *const usize, len: usize) -> Result<Vec<usize>, Failure> {
    if len == 0 {
        return Ok(Vec::new());
    }
    if ptr.is_null() {
        return Err(Failure::null(func, arg));
    }
    if len > isize::MAX as usize / std::mem::size_of::<usize>() {
        return Err(Failure::invalid(func, arg, format!("length {len} is too large")));
    }
    // SAFETY: non-null, and the caller guarantees `len` readable elements.
    Ok(unsafe { std::slice::from_raw_parts(ptr, len) }.to_vec())
}

/// Reads a NUL-terminated UTF-8 string.
///
/// # Safety
/// When non-null, `ptr` must point to a NUL-terminated string.
pub(crate) unsafe fn read_str(func: &str, arg: &str, ptr: *const c_char) -> Result<String, Failure> {
    if ptr.is_null() {
        return Err(Failure::null(func, arg));
    }
    // SAFETY: non-null and NUL-terminated by the caller's contract.
    let s = unsafe { CStr::from_ptr(ptr) };
    s.to_str().map(str::to_owned).map_err(|e| Failure::invalid(func, arg, format!("not UTF-8: {e}")))
}

/// Shape and dtype of a descriptor, validated (the data pointer is not looked at).
pub(crate) struct Meta {
    pub(crate) shape: Vec<usize>,
    pub(crate) dtype: DType,
    pub(crate) bytes: usize,
}

/// Validates everything in a descriptor except the data pointer.
///
/// # Safety
/// `d.shape` (and `d.strides` when non-null) must point to `d.ndim` readable
/// elements when `d.ndim > 0`.
pub(crate) unsafe fn meta(func: &str, arg: &str, d: &amoe_tensor) -> Result<Meta, Failure> {
    let dtype = DType::from_u32(d.dtype).ok_or_else(|| {
        Failure::new(
            amoe_status::Dtype,
            format!(
                "{func}: `{arg}` has dtype code {}, expected one of 0 (f32), 1 (f16), 2 (bf16), 3 (i32), 4 (i64), \
                 5 (i8), 6 (u8), 7 (bool), 8 (f8e4m3), 9 (f8e5m2)",
                d.dtype
            ),
        )
    })?;
    match d.device_kind {
        AMOE_DEVICE_CPU | AMOE_DEVICE_NPU => {}
        k => {
            return Err(Failure::new(
                amoe_status::Device,
                format!("{func}: `{arg}` has device kind {k}, expected 0 (cpu) or 1 (npu)"),
            ))
        }
    }
    if d.ndim > AMOE_MAX_NDIM {
        return Err(Failure::new(
            amoe_status::Shape,
            format!("{func}: `{arg}` has ndim {}, at most {AMOE_MAX_NDIM} is supported", d.ndim),
        ));
    }
    // SAFETY: ndim <= AMOE_MAX_NDIM and the caller's contract for `shape`.
    let shape = unsafe { read_sizes(func, "shape", d.shape, d.ndim) }
        .map_err(|f| Failure::new(f.status, format!("{func}: `{arg}`.shape is NULL with ndim {}", d.ndim)))?;
    // Zero dims are skipped, so every partial product of the dims (which the
    // ops and shape functions compute) fits too, also for empty tensors.
    let span = shape.iter().try_fold(dtype.size(), |acc, &s| acc.checked_mul(s.max(1)));
    if !matches!(span, Some(b) if b <= isize::MAX as usize) {
        return Err(Failure::new(
            amoe_status::Shape,
            format!("{func}: `{arg}` has shape {shape:?}, whose size in bytes overflows"),
        ));
    }
    let bytes = shape.iter().product::<usize>() * dtype.size();
    if !d.strides.is_null() {
        // SAFETY: the caller's contract for `strides` (ndim elements when non-null).
        let strides = unsafe { std::slice::from_raw_parts(d.strides, d.ndim) };
        let mut expect = 1isize;
        for i in (0..d.ndim).rev() {
            // A dimension of size 1 may carry any stride (numpy and torch do this).
            if shape[i] != 1 && strides[i] != expect {
                return Err(Failure::invalid(
                    func,
                    arg,
                    format!("strides {strides:?} (elements) are not contiguous for shape {shape:?}"),
                ));
            }
            expect = expect.saturating_mul(shape[i] as isize);
        }
    }
    Ok(Meta { shape, dtype, bytes })
}

/// Reads an input descriptor: a [`Tensor`] over the caller's memory, host or
/// NPU (on the call's stream device), read in place; host memory is copied
/// only when it cannot be borrowed (see the module docs).
///
/// # Safety
/// `d` must satisfy the `amoe_tensor` contract: `data` readable for the bytes
/// its shape and dtype describe.
pub(crate) unsafe fn read_tensor(func: &str, arg: &str, d: *const amoe_tensor) -> Result<Tensor, Failure> {
    let d = try_ref!(func, d, arg);
    // SAFETY: forwarded contract.
    let m = unsafe { meta(func, arg, d) }?;
    if d.device_kind == AMOE_DEVICE_NPU {
        // SAFETY: forwarded contract.
        return unsafe { borrow_npu(func, arg, d, &m) };
    }
    if m.bytes > 0 && d.data.is_null() {
        return Err(Failure::null(func, &format!("{arg}.data")));
    }
    // SAFETY: forwarded contract (`data` readable for `m.bytes`).
    if let Some(t) = unsafe { borrow_host(d, &m, false) }? {
        return Ok(t);
    }
    let mut t = Tensor::try_zeros_cpu(&m.shape, m.dtype)?;
    if m.bytes > 0 {
        // SAFETY: non-null, `m.bytes <= isize::MAX`, readable per the contract;
        // `t` is a fresh buffer so the ranges cannot overlap.
        let src = unsafe { std::slice::from_raw_parts(d.data as *const u8, m.bytes) };
        t.cpu_bytes_mut()?.copy_from_slice(src);
    }
    Ok(t)
}

/// Reads an input that the op consumes and may write into (the reduction
/// points reduce in place). A host input is borrowed read-only, so the op's
/// first write makes it a private copy; an NPU input
/// is borrowed in place only when `out` names the same memory (the caller asked
/// for an in-place call), otherwise it is copied on the device first, so the
/// caller's input is never modified behind its back.
///
/// # Safety
/// As [`read_tensor`]; `out` is NULL or a valid descriptor.
pub(crate) unsafe fn read_consumed(
    func: &str,
    arg: &str,
    d: *const amoe_tensor,
    out: *const amoe_tensor,
) -> Result<Tensor, Failure> {
    // SAFETY: forwarded contract.
    let t = unsafe { read_tensor(func, arg, d) }?;
    // SAFETY: `read_tensor` succeeded, so `d` is non-null; `out` is NULL or valid.
    let in_place = !out.is_null() && unsafe { (*d).data == (*out).data };
    if t.is_cpu() || in_place {
        return Ok(t);
    }
    Ok(t.try_clone()?)
}

/// Reads an optional input descriptor (NULL = absent).
///
/// # Safety
/// As [`read_tensor`] when non-null.
pub(crate) unsafe fn read_opt(func: &str, arg: &str, d: *const amoe_tensor) -> Result<Option<Tensor>, Failure> {
    if d.is_null() {
        return Ok(None);
    }
    // SAFETY: forwarded contract.
    unsafe { read_tensor(func, arg, d) }.map(Some)
}

/// A zero-size tensor carrying only the shape and dtype of a descriptor, for
/// shape functions (the data pointer is ignored and may be NULL).
///
/// # Safety
/// As [`meta`].
pub(crate) unsafe fn read_meta(func: &str, arg: &str, d: *const amoe_tensor) -> Result<Meta, Failure> {
    let d = try_ref!(func, d, arg);
    // SAFETY: forwarded contract.
    unsafe { meta(func, arg, d) }
}

/// Copies `t` into the caller's output descriptor after checking that its
/// shape and dtype are exactly `t`'s.
///
/// # Safety
/// `d.data` must be writable for the bytes its shape and dtype describe and
/// must not overlap memory the caller expects unchanged.
pub(crate) unsafe fn write_tensor(func: &str, arg: &str, d: *const amoe_tensor, t: &Tensor) -> Result<(), Failure> {
    let d = try_ref!(func, d, arg);
    // SAFETY: forwarded contract.
    let m = unsafe { meta(func, arg, d) }?;
    check_meta(func, arg, d, &m, t.shape(), t.dtype())?;
    if m.bytes == 0 {
        return Ok(());
    }
    if d.device_kind == AMOE_DEVICE_NPU {
        let dev = npu_device(func, arg, d)?;
        // SAFETY: the caller's contract; the buffer lives only for this call.
        let dst = unsafe { NpuBuffer::borrow_raw(&dev, d.data, m.bytes) }?;
        match t.storage() {
            // Written in place by the op (an output from `out_tensor`).
            Storage::Npu(b) if b.as_ptr() == d.data => {}
            // The op allocated its own result: one device-to-device copy,
            // queued on the caller's stream.
            Storage::Npu(b) => dst.copy_from_device(0, b, 0, m.bytes)?,
            Storage::Cpu(b) => dst.copy_from_host_at(0, b.as_bytes())?,
        }
        return Ok(());
    }
    if let Storage::Cpu(b) = t.storage() {
        if b.is_borrowed() && b.as_ptr() == d.data as *const u8 {
            // Written in place by the op (a borrowed output from `out_tensor`).
            return Ok(());
        }
    }
    let host;
    let t = if t.is_cpu() {
        t
    } else {
        host = t.to_cpu()?;
        &host
    };
    {
        let src = t.cpu_bytes()?;
        // SAFETY: non-null, writable for `m.bytes == src.len()` bytes per the
        // contract; `src` may be a borrowed input overlapping `d.data` (an op
        // that returned its input unchanged), so the copy allows overlap.
        unsafe { std::ptr::copy(src.as_ptr(), d.data as *mut u8, src.len()) };
    }
    Ok(())
}

/// Checks an output descriptor against the shape and dtype the op's shape
/// function computed, before any work starts (so no buffer is allocated for
/// an output the caller did not provide).
///
/// # Safety
/// As [`meta`].
pub(crate) unsafe fn check_out(
    func: &str,
    arg: &str,
    d: *const amoe_tensor,
    shape: &[usize],
    dtype: DType,
) -> Result<(), Failure> {
    let d = try_ref!(func, d, arg);
    // SAFETY: forwarded contract.
    let m = unsafe { meta(func, arg, d) }?;
    check_meta(func, arg, d, &m, shape, dtype)
}

fn check_meta(func: &str, arg: &str, d: &amoe_tensor, m: &Meta, shape: &[usize], dtype: DType) -> Result<(), Failure> {
    if m.dtype != dtype {
        return Err(Failure::new(
            amoe_status::Dtype,
            format!("{func}: `{arg}` has dtype {}, expected {dtype}", m.dtype),
        ));
    }
    if m.shape != shape {
        return Err(Failure::new(
            amoe_status::Shape,
            format!("{func}: `{arg}` has shape {:?}, expected {shape:?}", m.shape),
        ));
    }
    if m.bytes > 0 && d.data.is_null() {
        return Err(Failure::null(func, &format!("{arg}.data")));
    }
    Ok(())
}

/// Writes a shape into the caller's `(out_shape, cap, out_ndim)` triple.
///
/// # Safety
/// `out_shape` writable for `cap` elements, `out_ndim` writable.
pub(crate) unsafe fn write_shape(
    func: &str,
    shape: &[usize],
    out_shape: *mut usize,
    cap: usize,
    out_ndim: *mut usize,
) -> Result<(), Failure> {
    let out_ndim = try_out!(func, out_ndim, "out_ndim");
    // SAFETY: checked non-null; writable per the contract.
    unsafe { write_out(out_ndim, shape.len()) };
    if cap < shape.len() {
        return Err(Failure::new(
            amoe_status::BufferTooSmall,
            format!("{func}: `out_shape` holds {cap} dims, the shape {shape:?} needs {}", shape.len()),
        ));
    }
    if !shape.is_empty() {
        let out_shape = try_out!(func, out_shape, "out_shape");
        // SAFETY: non-null and writable for `cap >= shape.len()` elements.
        unsafe { std::ptr::copy_nonoverlapping(shape.as_ptr(), out_shape, shape.len()) };
    }
    Ok(())
}

/// A boolean flag from C: any non-zero value is true.
pub(crate) fn flag(v: u8) -> bool {
    v != 0
}
