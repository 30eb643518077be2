//! The forward context (SPEC section 5) in C, and the live context on the
//! device that guards ops captured in an ACL graph against replays under
//! another context.

use std::sync::{Arc, Mutex};

use super::ffi::{ffi, read_sizes, try_out, try_ref, write_out, Failure};
use super::types::{amoe_live_context, amoe_status, amoe_stream, stream_device};
use crate::backend::npu::kernel::guard::{ContextWords, GuardTiling};
use crate::backend::npu::live_context::LiveContext;
use crate::backend::npu::NpuDevice;
use crate::moe::prepare_finalize::MoeContext;
use crate::CommType;

/// One forward pass's context (SPEC section 5): the live comm type, the
/// tokens of every DP rank, this DP rank's actual tokens (rows past them are
/// graph padding), SP on/off and the PCP size. Read only; `dp_tokens` stays
/// owned by the caller and is read during the call only.
#[derive(Debug, Clone, Copy)]
#[repr(C)]
pub struct amoe_forward_context {
    /// An `amoe_comm_type` code.
    pub comm_type: u32,
    /// Non-zero when MoE sequence parallelism is on.
    pub sp: u8,
    /// Tokens of each DP rank, `dp_size` entries.
    pub dp_tokens: *const usize,
    /// Number of DP ranks (1 to 57 for a live context).
    pub dp_size: usize,
    /// Real tokens of this DP rank; `AMOE_ALL_TOKENS` = all of them.
    pub num_actual_tokens: usize,
    /// PCP size (0 or 1 = no prefill context parallelism).
    pub pcp_size: usize,
}

/// `amoe_live_context_guard` flag: the guarded ops also depend on
/// `num_actual_tokens` (for example an MC2 mask of the real rows).
pub const AMOE_GUARD_ACTUAL_TOKENS: u32 = 1;

/// # Safety
/// `fc` NULL or valid, with `dp_tokens` readable for `dp_size` entries.
unsafe fn words(f: &str, fc: *const amoe_forward_context) -> Result<ContextWords, Failure> {
    let c = try_ref!(f, fc, "ctx");
    let comm = CommType::from_u32(c.comm_type)?;
    // SAFETY: the contract for `dp_tokens`.
    let dp = unsafe { read_sizes(f, "ctx.dp_tokens", c.dp_tokens, c.dp_size) }?;
    // `AMOE_ALL_TOKENS` (usize::MAX): every token of the DP rank is real.
    let actual = (c.num_actual_tokens != usize::MAX).then_some(c.num_actual_tokens);
    if let Some(n) = actual {
        if dp.iter().all(|&t| n > t) {
            return Err(Failure::invalid(
                f,
                "ctx.num_actual_tokens",
                format!("{n} is more than any DP rank's tokens {dp:?}"),
            ));
        }
    }
    Ok(ContextWords::encode(comm as u32, c.sp != 0, c.pcp_size.max(1), actual, &dp)?)
}

/// # Safety
/// `stream` NULL or a live handle from `amoe_stream_wrap`.
unsafe fn required_stream(f: &str, stream: *const amoe_stream) -> Result<NpuDevice, Failure> {
    // SAFETY: the caller's contract.
    unsafe { stream_device(stream) }.cloned().ok_or_else(|| Failure::null(f, "stream"))
}

/// # Safety
/// `ctx` NULL or a live handle.
unsafe fn live<'a>(f: &str, ctx: *const amoe_live_context) -> Result<&'a LiveContext, Failure> {
    if ctx.is_null() {
        return Err(Failure::null(f, "ctx"));
    }
    // SAFETY: a live handle is an `Arc::into_raw` of a LiveContext from
    // `amoe_live_context_new`, kept alive by that reference until freed.
    Ok(unsafe { &*(ctx as *const LiveContext) })
}

/// Live contexts attached to stream handles: (stream handle, context).
static ATTACHED: Mutex<Vec<(usize, Arc<LiveContext>)>> = Mutex::new(Vec::new());

fn attached_lock() -> std::sync::MutexGuard<'static, Vec<(usize, Arc<LiveContext>)>> {
    // Each critical section is a single push, retain or lookup.
    ATTACHED.lock().unwrap_or_else(|e| e.into_inner())
}

/// Forgets the live context attached to `stream` (its handle is being freed).
pub(crate) fn detach_stream(stream: *const amoe_stream) {
    attached_lock().retain(|(s, _)| *s != stream as usize);
}

fn attached(stream: *const amoe_stream) -> Option<Arc<LiveContext>> {
    attached_lock().iter().find(|(s, _)| *s == stream as usize).map(|(_, c)| c.clone())
}

/// Reads the guards of the live context attached to `stream`, if any (after
/// the stream was synchronised): the second half of `amoe_stream_check`.
pub(crate) fn check_attached(stream: *const amoe_stream) -> Result<(), Failure> {
    match attached(stream) {
        Some(live) => Ok(live.check()?),
        None => Ok(()),
    }
}

/// The guard an op that depends on the forward context enqueues first, when
/// a live context is attached to its stream: against `ctx` (the MoE context
/// the call was made with) or, without one, the comm type alone.
///
/// # Safety
/// `stream` NULL or a live handle.
pub(crate) unsafe fn guard_op(
    f: &'static str,
    stream: *const amoe_stream,
    comm: CommType,
    ctx: Option<&MoeContext>,
) -> Result<(), Failure> {
    let Some(live) = attached(stream) else { return Ok(()) };
    // SAFETY: the caller's contract.
    let dev = unsafe { required_stream(f, stream) }?;
    let tiling = match ctx {
        Some(c) => GuardTiling::new(
            &ContextWords::encode(comm as u32, c.sp(), c.pcp_size().max(1), None, c.dp_tokens())?,
            false,
        ),
        None => GuardTiling::comm_type_only(comm as u32),
    };
    live.guard_with(f, &tiling, dev.stream())?;
    Ok(())
}

/// Makes a live context on the device of `stream`: zeroed (never written, so
/// every guard reports it until the engine sets it), with 128 guard records.
/// Allocates device and pinned memory and synchronises the stream once: call
/// it outside capture. `*out` receives a new handle owned by the caller.
///
/// # Safety
/// `stream` a live handle; `out` writable.
#[no_mangle]
pub unsafe extern "C" fn amoe_live_context_new(
    stream: *const amoe_stream,
    out: *mut *mut amoe_live_context,
) -> amoe_status {
    const F: &str = "amoe_live_context_new";
    ffi!(F, {
        let out = try_out!(F, out, "out");
        // SAFETY: the export's contract.
        let dev = unsafe { required_stream(F, stream) }?;
        let ctx = Arc::new(LiveContext::new(&dev)?);
        // SAFETY: `out` checked non-null; writable per the contract.
        unsafe { write_out(out, Arc::into_raw(ctx) as *mut amoe_live_context) };
        Ok(())
    })
}

/// Frees a live context (NULL is a no-op). Outside capture, after the work
/// that reads it has run.
///
/// # Safety
/// `ctx` NULL or a live handle not used afterwards.
#[no_mangle]
pub unsafe extern "C" fn amoe_live_context_free(ctx: *mut amoe_live_context) {
    if ctx.is_null() {
        return;
    }
    let _ = std::panic::catch_unwind(|| {
        let p = ctx as *const LiveContext;
        attached_lock().retain(|(_, c)| !std::ptr::eq(Arc::as_ptr(c), p));
        // SAFETY: a live handle from `amoe_live_context_new` (Arc::into_raw),
        // not used again.
        drop(unsafe { Arc::from_raw(p) });
    });
}

/// Attaches `ctx` to `stream` (NULL `ctx` detaches): from then on every op
/// called with this stream that depends on the forward context
/// (`amoe_token_prepare[_ex]`, `amoe_token_finalize[_ex]` with their MoE
/// context; the reduction points with their comm type) first enqueues a
/// guard of its own context, so a graph captured with these ops reports a
/// replay under another context at `amoe_live_context_check`. The stream
/// handle keeps the context alive while attached.
///
/// # Safety
/// `stream` live; `ctx` NULL or live.
#[no_mangle]
pub unsafe extern "C" fn amoe_stream_attach_live_context(
    stream: *const amoe_stream,
    ctx: *const amoe_live_context,
) -> amoe_status {
    const F: &str = "amoe_stream_attach_live_context";
    ffi!(F, {
        // SAFETY: the export's contract.
        let dev = unsafe { required_stream(F, stream) }?;
        detach_stream(stream);
        if ctx.is_null() {
            return Ok(());
        }
        // SAFETY: the export's contract.
        let c = unsafe { live(F, ctx) }?;
        if c.ordinal() != dev.ordinal() {
            return Err(Failure::from(crate::Error::Device {
                op: F,
                arg: "ctx",
                expected: format!("npu:{}", dev.ordinal()),
                actual: format!("npu:{}", c.ordinal()),
            }));
        }
        // SAFETY: a live handle is an Arc::into_raw; one more reference for the table.
        let arc = unsafe {
            Arc::increment_strong_count(ctx as *const LiveContext);
            Arc::from_raw(ctx as *const LiveContext)
        };
        attached_lock().push((stream as usize, arc));
        Ok(())
    })
}

/// The live buffer's device address and size (256 bytes), for an engine that
/// writes it with its own copies. Layout: 64 `uint32_t` words, `[0]` =
/// 0x43464D41, `[1]` = 1, `[2]` comm type, `[3]` SP (0/1), `[4]` PCP size,
/// `[5]` actual tokens (0xFFFFFFFF = all), `[6]` DP size, `[7..]` the tokens
/// of each DP rank, the rest zero. `amoe_live_context_set` writes exactly this.
///
/// # Safety
/// `ctx` live; `data` and `bytes` writable.
#[no_mangle]
pub unsafe extern "C" fn amoe_live_context_device_ptr(
    ctx: *const amoe_live_context,
    data: *mut *mut std::ffi::c_void,
    bytes: *mut usize,
) -> amoe_status {
    const F: &str = "amoe_live_context_device_ptr";
    ffi!(F, {
        let data = try_out!(F, data, "data");
        let bytes = try_out!(F, bytes, "bytes");
        // SAFETY: the export's contract.
        let c = unsafe { live(F, ctx) }?;
        // SAFETY: both checked non-null; writable per the contract.
        unsafe {
            write_out(data, c.device_ptr());
            write_out(bytes, crate::backend::npu::live_context::LIVE_BYTES);
        }
        Ok(())
    })
}

/// Enqueues on `stream` the update of the live context to `fc` (a copy from
/// pinned staging the library owns). The engine calls it before each replay,
/// outside capture. Never synchronises, except to wait for the oldest of 8
/// earlier updates that the stream has not run yet.
///
/// # Safety
/// `ctx`, `stream` live; `fc` valid.
#[no_mangle]
pub unsafe extern "C" fn amoe_live_context_set(
    ctx: *const amoe_live_context,
    fc: *const amoe_forward_context,
    stream: *const amoe_stream,
) -> amoe_status {
    const F: &str = "amoe_live_context_set";
    ffi!(F, {
        // SAFETY: the export's contracts.
        let (c, w, dev) = unsafe { (live(F, ctx)?, words(F, fc)?, required_stream(F, stream)?) };
        c.set(&w, dev.stream())?;
        Ok(())
    })
}

/// Enqueues on `stream` a guard of the ops that follow it, built for the
/// context `captured_for`: on the device, the live context is compared with
/// it (comm type, SP, PCP size, DP size and every DP rank's tokens, and with
/// `AMOE_GUARD_ACTUAL_TOKENS` in `flags` the actual tokens too), and a
/// difference is recorded. Capture it with the ops: every replay checks the
/// context the engine set for it. Only enqueues (no sync, no allocation, no
/// host read); `amoe_live_context_check` reports the difference.
///
/// # Safety
/// `ctx`, `stream` live; `captured_for` valid.
#[no_mangle]
pub unsafe extern "C" fn amoe_live_context_guard(
    ctx: *const amoe_live_context,
    captured_for: *const amoe_forward_context,
    flags: u32,
    stream: *const amoe_stream,
) -> amoe_status {
    const F: &str = "amoe_live_context_guard";
    ffi!(F, {
        if flags & !AMOE_GUARD_ACTUAL_TOKENS != 0 {
            return Err(Failure::invalid(F, "flags", format!("{flags:#x} has unknown bits")));
        }
        // SAFETY: the export's contracts.
        let (c, w, dev) = unsafe { (live(F, ctx)?, words(F, captured_for)?, required_stream(F, stream)?) };
        c.guard("moe_layer", &w, flags & AMOE_GUARD_ACTUAL_TOKENS != 0, dev.stream())?;
        Ok(())
    })
}

/// The caller's sync point for the guards: synchronises `stream`, then
/// returns `AMOE_STATUS_STALE_CONTEXT` with the field and both values when a
/// guard found the live context different from the one its ops were captured
/// for (the first such guard, in enqueue order; each difference is reported
/// once), else OK. Outside capture.
///
/// # Safety
/// `ctx`, `stream` live.
#[no_mangle]
pub unsafe extern "C" fn amoe_live_context_check(
    ctx: *const amoe_live_context,
    stream: *const amoe_stream,
) -> amoe_status {
    const F: &str = "amoe_live_context_check";
    ffi!(F, {
        // SAFETY: the export's contracts.
        let (c, dev) = unsafe { (live(F, ctx)?, required_stream(F, stream)?) };
        dev.synchronize()?;
        c.check()?;
        Ok(())
    })
}
