//! The machinery under every export: the panic boundary, the thread-local last
//! error, null checks, and [`Call`], the one context of an export's call,
//! through which C tensor descriptors become [`Tensor`]s.
//!
//! The functions here take the pointer arguments of exports, which each
//! export's contract makes valid (`amoe_tensor`, out-pointers, lists): they
//! are the only places such a pointer is read or written, each once, so the
//! export bodies are safe code.
//!
//! Descriptors become tensors over the caller's memory, host and NPU alike,
//! for the duration of the call: inputs are read in place and outputs written
//! in place. Host memory is copied only where borrowing it would be unsound
//! or could change a result: a pointer that is not 8-byte aligned, and an
//! output that overlaps another operand of the same call (an in-place call);
//! such an output is computed into scratch and copied out by [`boundary`]
//! once the export's body has returned, when every tensor of the call (the
//! borrowed inputs among them) is gone: borrowed memory is never written
//! while a tensor over it lives, except through the one writable tensor it
//! is lent to.
//!
//! An output is in the memory of the op's input (host, or the NPU of the
//! call's stream): the ops never copy a result between host and NPU memory,
//! so either mix is DEVICE naming the output and both memories, before any
//! work ([`Out::check_like`], the check of the Rust ops).

use std::cell::RefCell;
use std::ffi::{c_char, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};

pub(crate) use super::failure::{write_out, write_slice, Failure};
use super::handle;
use super::types::{amoe_comm, amoe_status, amoe_stream, amoe_tensor, AMOE_DEVICE_CPU, AMOE_DEVICE_NPU, AMOE_MAX_NDIM};
use crate::backend::npu::{NpuBuffer, NpuDevice};
use crate::device::Memory;
use crate::moe::finalize::{check_out_memory, check_out_on};
use crate::moe::prepare_finalize::MoeContext;
use crate::moe::LiveStream;
use crate::tensor::{CpuBuffer, Storage};
use crate::{Comm, CommType, DType, Tensor};

thread_local! {
    static LAST_ERROR: RefCell<String> = const { RefCell::new(String::new()) };
    /// Host results of the running export's body, each with the caller's
    /// memory it goes to ([`Call::write`]): copied there by [`boundary`]
    /// once the body returned OK, dropped otherwise.
    static PENDING: RefCell<Vec<(*mut u8, CpuBuffer)>> = const { RefCell::new(Vec::new()) };
}

/// One export's call: its name, the stream its NPU work is queued on (with
/// the live context attached to it), and the host memory it has borrowed.
/// Made once at the top of an export; every descriptor and handle of the
/// call is converted through it, so NPU descriptors live on its stream's
/// device and communicators are checked against it.
pub(crate) struct Call<'a> {
    /// The export's name, which every error of the call starts with.
    pub(crate) f: &'static str,
    stream: Option<&'a LiveStream>,
    /// The host byte ranges `[start, end)` borrowed so far, with whether each
    /// one is written (an output).
    borrowed: RefCell<Vec<(usize, usize, bool)>>,
}

impl<'a> Call<'a> {
    /// The call of export `f` on `stream` (NULL: host tensors only); a
    /// pointer that is not a live stream handle is INVALID_ARGUMENT.
    pub(crate) fn new(f: &'static str, stream: *const amoe_stream) -> Result<Self, Failure> {
        Ok(Call { f, stream: handle::opt_ref(f, "stream", stream)?, borrowed: RefCell::new(Vec::new()) })
    }

    /// The call's stream, if one was passed.
    pub(crate) fn stream(&self) -> Option<&'a LiveStream> {
        self.stream
    }

    /// The call's stream; NULL is NULL_ARGUMENT.
    pub(crate) fn required_stream(&self) -> Result<&'a LiveStream, Failure> {
        self.stream.ok_or_else(|| Failure::null(self.f, "stream"))
    }

    /// The guard an op that depends on the forward context queues first when
    /// a live context is attached to the call's stream ([`LiveStream::guard`];
    /// `actual`: the op writes what depends on the actual tokens).
    pub(crate) fn guard(&self, comm: CommType, ctx: Option<&MoeContext>, actual: bool) -> Result<(), Failure> {
        match self.stream {
            Some(s) => Ok(s.guard(self.f, comm, ctx, actual)?),
            None => Ok(()),
        }
    }

    /// The call of export `f` on `stream`, and the communicator behind `p`
    /// (the argument `arg`), on which the peers wait in a collective whatever
    /// this rank's arguments. The communicator is read first, so a `stream`
    /// that is no live stream handle is refused through it too: the peers
    /// fail at once instead of waiting out the timeout.
    pub(crate) fn on_comm(
        f: &'static str,
        stream: *const amoe_stream,
        arg: &'static str,
        p: *const amoe_comm,
    ) -> Result<(Self, &'a Comm), Failure> {
        let c = handle::try_handle(f, arg, p)?;
        let cx = refusing_on(c, Self::new(f, stream))?;
        let c = cx.on_stream_device(c)?;
        Ok((cx, c))
    }

    /// The communicator behind `p` (the argument `arg`), which must be on the
    /// call's stream device.
    pub(crate) fn comm(&self, arg: &'static str, p: *const amoe_comm) -> Result<&'a Comm, Failure> {
        self.on_stream_device(handle::try_handle(self.f, arg, p)?)
    }

    /// `c`, which must be on the call's stream device.
    fn on_stream_device(&self, c: &'a Comm) -> Result<&'a Comm, Failure> {
        if let (Comm::Npu(h), Some(s)) = (c, self.stream) {
            let (comm_ord, s) = (h.npu_device().ordinal(), s.device().ordinal());
            if s != comm_ord {
                return Err(Failure::new(
                    amoe_status::Device,
                    format!("{}: the communicator is on npu:{comm_ord}, but the stream is on npu:{s}", self.f),
                ));
            }
        }
        Ok(c)
    }

    /// The device an NPU descriptor lives on: the call's stream device, which
    /// must be `d.device_ordinal`. Without CANN this is UNAVAILABLE with the
    /// loader's message.
    fn npu_device(&self, arg: &str, d: &amoe_tensor) -> Result<&'a NpuDevice, Failure> {
        let func = self.f;
        crate::backend::npu::runtime::acl()
            .map_err(|e| Failure::new(amoe_status::Unavailable, format!("{func}: `{arg}` is an NPU tensor: {e}")))?;
        let dev = self.stream.map(LiveStream::device).ok_or_else(|| {
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

    /// A tensor over the caller's NPU memory, borrowed (no copy; never freed by us).
    fn borrow_npu(&self, arg: &str, d: &amoe_tensor, m: &Meta) -> Result<Tensor, Failure> {
        let dev = self.npu_device(arg, d)?;
        if m.bytes > 0 && d.data.is_null() {
            return Err(Failure::null(self.f, &format!("{arg}.data")));
        }
        // SAFETY: `d` is a descriptor argument of the export, so `data` is
        // device memory of its device valid for `m.bytes` bytes during the
        // call (the `amoe_tensor` contract); the tensor lives only for the call.
        let buf = unsafe { NpuBuffer::borrow_raw(dev, d.data, m.bytes) }?;
        Ok(Tensor::from_parts(m.shape.clone(), m.dtype, Storage::Npu(buf))?)
    }

    /// A tensor over the caller's host memory `d.data` (`m.bytes` bytes), or
    /// `None` when it must be copied instead: not 8-byte aligned, or
    /// overlapping memory of this call that is written (for an input) or used
    /// at all (for an output, `writable`). A borrowed range is recorded for
    /// the rest of the call.
    fn borrow_host(&self, d: &amoe_tensor, m: &Meta, writable: bool) -> Result<Option<Tensor>, Failure> {
        if m.bytes == 0 {
            return Ok(None);
        }
        let (start, end) = (d.data as usize, d.data as usize + m.bytes);
        let clash = self.borrowed.borrow().iter().any(|&(s, e, w)| (w || writable) && s < end && start < e);
        if clash {
            return Ok(None);
        }
        // SAFETY: `d` is a descriptor argument of the export: `data` readable
        // (and, for an output, writable) for `m.bytes` bytes during the call;
        // the range overlaps no other borrowed range it could conflict with
        // (checked just above), and the tensor lives only for the call. The
        // caller's memory is otherwise written only by `boundary`'s copies of
        // results, after the export's body (which owns every tensor of the
        // call) has returned.
        let Some(buf) = (unsafe { CpuBuffer::borrow_raw(d.data.cast(), m.bytes, writable) }) else {
            return Ok(None);
        };
        self.borrowed.borrow_mut().push((start, end, writable));
        Ok(Some(Tensor::from_parts(m.shape.clone(), m.dtype, Storage::Cpu(buf))?))
    }

    /// An input descriptor: a [`Tensor`] over the caller's memory, host or
    /// NPU (on the call's stream device), read in place; host memory is
    /// copied only when it cannot be borrowed (see the module docs).
    pub(crate) fn input(&self, arg: &str, d: *const amoe_tensor) -> Result<Tensor, Failure> {
        let d = try_ref!(self.f, d, arg);
        let m = meta(self.f, arg, d)?;
        if d.device_kind == AMOE_DEVICE_NPU {
            return self.borrow_npu(arg, d, &m);
        }
        if m.bytes > 0 && d.data.is_null() {
            return Err(Failure::null(self.f, &format!("{arg}.data")));
        }
        if let Some(t) = self.borrow_host(d, &m, false)? {
            return Ok(t);
        }
        let mut t = Tensor::try_zeros_cpu(&m.shape, m.dtype)?;
        if m.bytes > 0 {
            t.cpu_bytes_mut()?.copy_from_slice(host_bytes(d, m.bytes));
        }
        Ok(t)
    }

    /// An optional input descriptor (NULL = absent).
    pub(crate) fn input_opt(&self, arg: &str, d: *const amoe_tensor) -> Result<Option<Tensor>, Failure> {
        if d.is_null() {
            return Ok(None);
        }
        self.input(arg, d).map(Some)
    }

    /// An output descriptor, parsed once for the whole call.
    pub(crate) fn out(&self, arg: &'static str, d: *const amoe_tensor) -> Result<Out<'a>, Failure> {
        let d: &'a amoe_tensor = try_ref!(self.f, d, arg);
        let meta = meta(self.f, arg, d)?;
        Ok(Out { arg, d, meta })
    }

    /// An output tensor over the caller's memory when it can be lent (NPU
    /// memory, written in place by the op; aligned host memory no other
    /// operand of the call uses), else a fresh host tensor of the
    /// descriptor's shape that [`Call::write`] copies out. An output computed
    /// from an input is first checked against it ([`Out::check_like`]).
    pub(crate) fn output(&self, o: &Out<'_>) -> Result<Tensor, Failure> {
        let (d, m) = (o.d, &o.meta);
        if d.device_kind == AMOE_DEVICE_NPU {
            return self.borrow_npu(o.arg, d, m);
        }
        if m.bytes > 0 && d.data.is_null() {
            return Err(Failure::null(self.f, &format!("{}.data", o.arg)));
        }
        if let Some(t) = self.borrow_host(d, m, true)? {
            return Ok(t);
        }
        Ok(Tensor::try_zeros_cpu(&m.shape, m.dtype)?)
    }

    /// Puts the result `t` into the caller's output after checking that it
    /// is in the output's memory with exactly its shape and dtype: nothing
    /// when `t` already is the caller's memory (an output from
    /// [`Call::output`]); one device copy queued on the stream for another
    /// NPU tensor; a host result is copied by [`boundary`] once the export's
    /// body has returned (every tensor of the call gone), so borrowed memory
    /// is never written under a live tensor.
    pub(crate) fn write(&self, o: &Out<'_>, mut t: Tensor) -> Result<(), Failure> {
        let (d, m) = (o.d, &o.meta);
        check_out_on(self.f, o.arg, o.memory(), m.of(), t.device().memory(), t.shape(), t.dtype())?;
        check_data(self.f, o.arg, d, m)?;
        if m.bytes == 0 {
            return Ok(());
        }
        // `t` is in the output's memory (checked above): NPU storage for an
        // NPU descriptor, host storage for a host one.
        match t.storage_mut() {
            // Written in place by the op.
            Storage::Npu(b) if b.as_ptr() == d.data => Ok(()),
            Storage::Npu(b) => {
                let dev = self.npu_device(o.arg, d)?;
                // SAFETY: `d` is a descriptor argument of the export: NPU
                // memory of the stream's device, writable for `m.bytes`
                // bytes; the buffer lives only for this call.
                let dst = unsafe { NpuBuffer::borrow_raw(dev, d.data, m.bytes) }?;
                // The op made its own result: one device-to-device copy,
                // queued on the caller's stream.
                Ok(dst.copy_from_device(0, b, 0, m.bytes)?)
            }
            // Written in place by the op.
            Storage::Cpu(b) if b.is_borrowed() && b.as_ptr() == d.data as *const u8 => Ok(()),
            Storage::Cpu(b) => {
                // A result of our own, taken out of `t`; a borrowed one (an
                // input the op returned, over other memory of the caller) is
                // copied, so no borrowed buffer outlives the body.
                let b =
                    if b.is_borrowed() { CpuBuffer::try_from_bytes(self.f, b.as_bytes())? } else { std::mem::take(b) };
                PENDING.with(|p| p.borrow_mut().push((d.data.cast(), b)));
                Ok(())
            }
        }
    }
}

/// An output descriptor of a call, parsed once ([`Call::out`]).
pub(crate) struct Out<'a> {
    arg: &'static str,
    d: &'a amoe_tensor,
    meta: Meta,
}

impl Out<'_> {
    /// Checks the descriptor of an output computed from `x` as the Rust ops
    /// check theirs ([`check_out_on`]): in `x`'s memory, then of `x`'s dtype,
    /// then of `shape`, before any work starts.
    pub(crate) fn check_like(&self, cx: &Call<'_>, x: &Tensor, shape: &[usize]) -> Result<(), Failure> {
        check_out_on(cx.f, self.arg, self.memory(), self.meta.of(), x.device().memory(), shape, x.dtype())?;
        check_data(cx.f, self.arg, self.d, &self.meta)
    }

    /// Checks only that the descriptor is in `x`'s memory, as
    /// [`Out::check_like`] does first (for an output whose shape and dtype
    /// the op checks itself: the collectives').
    pub(crate) fn check_memory(&self, cx: &Call<'_>, x: &Tensor) -> Result<(), Failure> {
        Ok(check_out_memory(cx.f, self.arg, self.memory(), x.device().memory())?)
    }

    /// The memory the descriptor names.
    fn memory(&self) -> Memory {
        match self.d.device_kind {
            AMOE_DEVICE_NPU => Memory::Npu(i64::from(self.d.device_ordinal)),
            _ => Memory::Host,
        }
    }

    /// The bytes `[start, end)` the descriptor names, with the memory they
    /// are addresses of (host: `None`; NPU: its ordinal).
    fn span(&self) -> (Option<i32>, usize, usize) {
        let kind = (self.d.device_kind == AMOE_DEVICE_NPU).then_some(self.d.device_ordinal);
        let start = self.d.data as usize;
        (kind, start, start.saturating_add(self.meta.bytes))
    }

    /// Whether this output and `other` name common bytes of the same memory.
    pub(crate) fn overlaps(&self, other: &Out<'_>) -> bool {
        let ((ak, as_, ae), (bk, bs, be)) = (self.span(), other.span());
        ak == bk && as_ < be && bs < ae && self.meta.bytes > 0 && other.meta.bytes > 0
    }

    /// Refuses an output that overlaps the output `other` of the same call:
    /// whichever is written last would overwrite part of the other.
    /// INVALID_ARGUMENT naming both, before any work starts.
    pub(crate) fn apart_from(&self, cx: &Call<'_>, other: &Out<'_>) -> Result<(), Failure> {
        if !self.overlaps(other) {
            return Ok(());
        }
        let ((_, s, e), (_, os, oe)) = (self.span(), other.span());
        Err(crate::Error::invalid(
            cx.f,
            self.arg,
            format!(
                "covers bytes {s:#x}..{e:#x}, which overlap the output `{}` ({os:#x}..{oe:#x}): pass memory apart from it",
                other.arg
            ),
        )
        .into())
    }
}

/// The `len` host bytes of an input descriptor `d` (non-null `data`).
fn host_bytes(d: &amoe_tensor, len: usize) -> &[u8] {
    // SAFETY: `d` is a descriptor argument of an export: `data` non-null
    // (checked by the caller), readable for `len <= isize::MAX` bytes (the
    // size `meta` validated) during the call.
    unsafe { std::slice::from_raw_parts(d.data as *const u8, len) }
}

/// Records `msg` as this thread's last error.
pub(crate) fn set_last_error(msg: String) {
    LAST_ERROR.with(|m| *m.borrow_mut() = msg);
}

/// Runs `f` with this thread's last error message.
pub(crate) fn with_last_error<R>(f: impl FnOnce(&str) -> R) -> R {
    LAST_ERROR.with(|m| f(&m.borrow()))
}

/// Converts the result of export `func`'s body into a status, recording the
/// message on failure. Every message starts with the export's name, which
/// is added to one from a layer below that names its own function (so C
/// and Python callers see which call failed).
fn finish(func: &str, r: Result<(), Failure>) -> amoe_status {
    match r {
        Ok(()) => amoe_status::Ok,
        Err(f) => {
            let named = f.msg.strip_prefix(func).is_some_and(|rest| rest.starts_with(':'));
            set_last_error(if named { f.msg } else { format!("{func}: {}", f.msg) });
            f.status
        }
    }
}

/// Runs `body` inside the panic boundary: a panic becomes `AMOE_STATUS_PANIC`
/// with the panic message as the last error, never an unwind into C. The
/// device current on the calling thread is current again when it returns.
pub(crate) fn boundary(func: &str, body: impl FnOnce() -> Result<(), Failure>) -> amoe_status {
    // The caller's current device, current again when the export returns.
    let _device = crate::backend::npu::runtime::ThreadDevice::kept();
    let r = catch_unwind(AssertUnwindSafe(body));
    // The body has returned: every tensor it made over the caller's memory
    // is dropped, so the host results it put aside can be written there.
    let pending = PENDING.with(|p| std::mem::take(&mut *p.borrow_mut()));
    match r {
        Ok(Ok(())) => {
            for (dst, b) in pending {
                // SAFETY: `dst` is the `data` of an output descriptor of this
                // export (`Call::write`), writable for `b.len()` bytes (its
                // checked size) until the export returns; no tensor over the
                // caller's memory is alive any more (the body that owned them
                // returned), and `b` is our own allocation, apart from it.
                unsafe { std::ptr::copy_nonoverlapping(b.as_ptr(), dst, b.len()) };
            }
            finish(func, Ok(()))
        }
        Ok(r) => finish(func, r),
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

/// `checked`, the export's arguments read and checked, or the reason
/// they are bad, reported by `refuse` before it is returned (with its
/// status) on this rank. The peers the export communicates with are
/// already waiting in its first collective; with
/// [`crate::Collectives::refuse_call`] behind `refuse`, a CPU group fails
/// on every rank at once, naming this rank and its argument, instead of
/// waiting out the timeout (HCCL sends nothing).
pub(crate) fn refusing<T>(
    checked: Result<T, Failure>,
    refuse: impl FnOnce(crate::Error) -> crate::Error,
) -> Result<T, Failure> {
    // Only the message travels (the peers quote it); this rank returns the
    // failure itself.
    checked.inspect_err(|failure| drop(refuse(refusal_of(failure.msg.clone()))))
}

/// The error a refusal carries to the peers: only its text travels (they
/// quote it), so it is the message as it is.
fn refusal_of(message: String) -> crate::Error {
    crate::Error::Unavailable(message)
}

/// The body of the `amoe_*_refuse` exports: `message` (a caller's own error,
/// found before a call its peers are making) sent through `refuse`. OK once
/// the peers have it, or where nothing is sent (an HCCL group, a call in
/// which no peer waits); else the group's own error (a peer died meanwhile,
/// the timeout passed).
pub(crate) fn send_refusal(
    f: &str,
    message: *const c_char,
    refuse: impl FnOnce(crate::Error) -> crate::Error,
) -> Result<(), Failure> {
    // A message that cannot be read still releases the peers, with what can
    // be made of it; this rank then returns the message's own error.
    let read = read_cstr(f, "message", message);
    let text = match &read {
        Ok(s) => s.to_string_lossy().into_owned(),
        Err(_) => format!("{f} was called with a NULL message"),
    };
    let sent = match refuse(refusal_of(text.clone())) {
        crate::Error::Unavailable(t) if t == text => Ok(()),
        e => Err(e.into()),
    };
    read.and_then(|s| str_of(f, "message", s))?;
    sent
}

/// [`refusing`] for an export whose peers make a collective on
/// `comm` first whatever their own arguments: a collective, or an op
/// whose CPU ranks always join ([`crate::comm::joins_empty`]).
pub(crate) fn refusing_on<T>(comm: &Comm, checked: Result<T, Failure>) -> Result<T, Failure> {
    refusing(checked, refuse_on(comm))
}

/// The refusal through a collective on `comm`
/// ([`crate::Collectives::refuse_call`]). Its kind does not matter: the
/// peers see a refusal before they compare what each rank called.
pub(crate) fn refuse_on(comm: &Comm) -> impl FnOnce(crate::Error) -> crate::Error + '_ {
    use crate::Collectives;
    move |e| comm.refuse_call(crate::backend::Call::AllGather, DType::U8, e)
}

/// `try_ref!(FUNC, ptr, "arg")`: a shared reference, or return NULL_ARGUMENT.
macro_rules! try_ref {
    ($func:expr, $ptr:expr, $arg:expr) => {{
        let p = $ptr;
        if p.is_null() {
            return Err($crate::capi::ffi::Failure::null($func, $arg));
        }
        // SAFETY: a pointer argument of the export, non-null; the export's
        // contract makes it point to a valid, initialised object for the call.
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

/// Reads a list argument of `len` `usize`s; NULL is allowed only when `len == 0`.
pub(crate) fn read_sizes(func: &str, arg: &str, ptr: *const usize, len: usize) -> Result<Vec<usize>, Failure> {
    if len == 0 {
        return Ok(Vec::new());
    }
    if ptr.is_null() {
        return Err(Failure::null(func, arg));
    }
    if len > isize::MAX as usize / std::mem::size_of::<usize>() {
        return Err(Failure::invalid(func, arg, format!("length {len} is too large")));
    }
    // SAFETY: a list argument of the export, non-null, readable for `len`
    // elements by the export's contract.
    Ok(unsafe { std::slice::from_raw_parts(ptr, len) }.to_vec())
}

/// Reads a NUL-terminated UTF-8 string argument.
pub(crate) fn read_str(func: &str, arg: &str, ptr: *const c_char) -> Result<String, Failure> {
    read_cstr(func, arg, ptr).and_then(|s| str_of(func, arg, s))
}

/// The C string argument `arg` at `ptr`, or NULL_ARGUMENT.
fn read_cstr<'a>(func: &str, arg: &str, ptr: *const c_char) -> Result<&'a CStr, Failure> {
    if ptr.is_null() {
        return Err(Failure::null(func, arg));
    }
    // SAFETY: a string argument of the export, non-null, NUL-terminated by
    // the export's contract, and alive for the call.
    Ok(unsafe { CStr::from_ptr(ptr) })
}

/// `s` as an owned UTF-8 string, or INVALID_ARGUMENT naming `arg`.
fn str_of(func: &str, arg: &str, s: &CStr) -> Result<String, Failure> {
    s.to_str().map(str::to_owned).map_err(|e| Failure::invalid(func, arg, format!("not UTF-8: {e}")))
}

/// Shape and dtype of a descriptor, validated (the data pointer is not looked at).
pub(crate) struct Meta {
    pub(crate) shape: Vec<usize>,
    pub(crate) dtype: DType,
    pub(crate) bytes: usize,
}

impl Meta {
    /// The shape and dtype as the Rust checks take them.
    pub(crate) fn of(&self) -> crate::types::TensorMeta<'_> {
        crate::types::TensorMeta { shape: &self.shape, dtype: self.dtype }
    }
}

/// Validates everything in a descriptor argument except the data pointer.
pub(crate) fn meta(func: &str, arg: &str, d: &amoe_tensor) -> Result<Meta, Failure> {
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
    let shape = read_sizes(func, "shape", d.shape, d.ndim)
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
    // A tensor without elements is contiguous whatever its strides say (torch
    // and numpy give [2, 0, 3] strides (3, 3, 1) and (0, 0, 0)).
    if !d.strides.is_null() && bytes > 0 {
        // SAFETY: a descriptor argument's `strides`, non-null, readable for
        // `ndim <= AMOE_MAX_NDIM` elements by the `amoe_tensor` contract.
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

/// The shape and dtype of a descriptor argument, for shape functions (the
/// data pointer is ignored and may be NULL).
pub(crate) fn read_meta(func: &str, arg: &str, d: *const amoe_tensor) -> Result<Meta, Failure> {
    let d = try_ref!(func, d, arg);
    meta(func, arg, d)
}

/// NULL_ARGUMENT for a descriptor with elements and a NULL `data`.
fn check_data(func: &str, arg: &str, d: &amoe_tensor, m: &Meta) -> Result<(), Failure> {
    if m.bytes > 0 && d.data.is_null() {
        return Err(Failure::null(func, &format!("{arg}.data")));
    }
    Ok(())
}

/// Writes the shape of an output of `dtype` into the caller's `(out_shape,
/// cap, out_ndim)` triple; refuses one whose bytes no descriptor can carry
/// (see [`meta`]), which the op would then refuse.
pub(crate) fn write_shape(
    func: &'static str,
    shape: &[usize],
    dtype: DType,
    out_shape: *mut usize,
    cap: usize,
    out_ndim: *mut usize,
) -> Result<(), Failure> {
    crate::backend::args::checked_bytes(func, "out", shape, dtype)?;
    let out_ndim = try_out!(func, out_ndim, "out_ndim");
    write_out(out_ndim, shape.len());
    if cap < shape.len() {
        return Err(Failure::new(
            amoe_status::BufferTooSmall,
            format!("{func}: `out_shape` holds {cap} dims, the shape {shape:?} needs {}", shape.len()),
        ));
    }
    if !shape.is_empty() {
        write_slice(try_out!(func, out_shape, "out_shape"), shape);
    }
    Ok(())
}

/// A boolean flag from C: any non-zero value is true.
pub(crate) fn flag(v: u8) -> bool {
    v != 0
}
