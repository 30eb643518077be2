//! The forward context (SPEC section 5) in C, and the live context on the
//! device that guards ops captured in an ACL graph against replays under
//! another context.

use std::sync::Arc;

use super::ffi::{ffi, flag, read_sizes, try_out, try_ref, write_out, Call, Failure};
use super::handle::{arc_out, clone_arc, release, try_handle};
use super::types::{amoe_live_context, amoe_status, amoe_stream};
use crate::backend::npu::live_context::LiveContext;
use crate::moe::ForwardContext;
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

/// The Rust forward context of a descriptor argument.
/// `arg` names it in errors.
fn forward_context(f: &str, arg: &str, fc: *const amoe_forward_context) -> Result<ForwardContext, Failure> {
    let c = try_ref!(f, fc, arg);
    Ok(ForwardContext {
        comm_type: CommType::from_u32(c.comm_type)?,
        sp: flag(c.sp),
        dp_tokens: read_sizes(f, &format!("{arg}.dp_tokens"), c.dp_tokens, c.dp_size)?,
        // `AMOE_ALL_TOKENS` (usize::MAX): every token of the DP rank is real.
        num_actual_tokens: (c.num_actual_tokens != usize::MAX).then_some(c.num_actual_tokens),
        pcp_size: c.pcp_size,
    })
}

/// Makes a live context on the device of `stream`: zeroed (never written, so
/// every guard reports it until the engine sets it), with 128 guard records
/// to start with (`amoe_live_context_reserve` adds more before capture; a
/// guard outside capture adds 128 when none is free). Allocates device and
/// pinned memory and synchronises the stream once: call it outside capture.
/// `*out` receives a new handle owned by the caller.
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
        let s = Call::new(F, stream)?.required_stream()?;
        arc_out(out, Arc::new(LiveContext::new(s.device())?));
        Ok(())
    })
}

/// Makes sure `ctx` has at least `guards` free guard records, adding them
/// when it has fewer; the records in use never move. Every guard captured
/// into a graph keeps its record for the context's life, and a guard under
/// capture cannot add records (it fails, naming this function), so call it
/// before capture with the guards the graphs will take: one per guarded op
/// of each graph: per MoE layer a prepare, a finalize and each reduction
/// point whose result depends on the comm type (at most 3), so an engine
/// with a graph per batch size needs at most layers x 5 x batch sizes. A
/// guard outside capture also keeps free as many records as the largest run
/// of captures took (the guards captured between two eager guards), so a
/// graph captured after an eager warm-up needs no call when an earlier graph
/// was as large. Allocates device and pinned memory and zeroes the new records (a
/// blocking memset); refused with `AMOE_STATUS_INVALID_ARGUMENT` while the
/// stream the context was made on captures.
///
/// # Safety
/// `ctx` live.
#[no_mangle]
pub unsafe extern "C" fn amoe_live_context_reserve(ctx: *const amoe_live_context, guards: usize) -> amoe_status {
    const F: &str = "amoe_live_context_reserve";
    ffi!(F, {
        let c = try_handle(F, "ctx", ctx)?;
        Ok(c.reserve(guards)?)
    })
}

/// The guard records of `ctx` into `*capacity`, and those in use (by
/// captured guards, and by guards enqueued outside capture and not yet
/// checked) into `*in_use`; read together.
///
/// # Safety
/// `ctx` live; `capacity` and `in_use` writable.
#[no_mangle]
pub unsafe extern "C" fn amoe_live_context_guards(
    ctx: *const amoe_live_context,
    capacity: *mut usize,
    in_use: *mut usize,
) -> amoe_status {
    const F: &str = "amoe_live_context_guards";
    ffi!(F, {
        let capacity = try_out!(F, capacity, "capacity");
        let in_use = try_out!(F, in_use, "in_use");
        let c = try_handle(F, "ctx", ctx)?;
        let (cap, used) = c.guard_records();
        write_out(capacity, cap);
        write_out(in_use, used);
        Ok(())
    })
}

/// Frees a live context (NULL is a no-op). Outside capture, after the work
/// that reads it has run, and after every graph that captured a guard of
/// this context was destroyed (each replay reads the guard's record and
/// tiling, freed with the context).
///
/// # Safety
/// `ctx` NULL or a live handle not used afterwards.
#[no_mangle]
pub unsafe extern "C" fn amoe_live_context_free(ctx: *mut amoe_live_context) {
    release(ctx);
}

/// Attaches `ctx` to `stream` (NULL `ctx` detaches): from then on every op
/// called with this stream that depends on the forward context
/// (`amoe_token_prepare`, `amoe_token_finalize` with their MoE
/// context; the reduction points with their comm type) first enqueues a
/// guard of its own context, so a graph captured with these ops reports a
/// replay under another context at `amoe_live_context_check`. The stream
/// handle keeps the context alive while attached (also after
/// `amoe_live_context_free` releases the caller's handle), until it is
/// detached or the stream handle is freed.
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
        let s = Call::new(F, stream)?.required_stream()?;
        let live = if ctx.is_null() { None } else { Some(clone_arc(F, "ctx", ctx)?) };
        Ok(s.attach(live)?)
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
        let c = try_handle(F, "ctx", ctx)?;
        write_out(data, c.device_ptr());
        write_out(bytes, crate::backend::npu::live_context::LIVE_BYTES);
        Ok(())
    })
}

/// Enqueues on `stream` the update of the live context to `fc` (a copy from
/// pinned staging the library owns). The engine calls it before each replay,
/// on the replay's stream or on one the replay's stream is ordered after
/// (an event recorded here and waited for there: streams run unordered, so
/// an unordered replay may read the context before the copy wrote it),
/// outside capture (a capturing `stream` is refused,
/// `AMOE_STATUS_INVALID_ARGUMENT`; a stream of another device than `ctx`'s
/// is `AMOE_STATUS_DEVICE`). Creates no event, and never synchronises except
/// to wait for the update 8 updates earlier when the stream has not run it
/// yet (asked first with `aclrtQueryEventStatus`, which does not wait).
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
        let c = try_handle(F, "ctx", ctx)?;
        let w = forward_context(F, "fc", fc)?.words()?;
        let s = Call::new(F, stream)?.required_stream()?;
        Ok(c.set(&w, s.device().stream())?)
    })
}

/// Enqueues on `stream` a guard of the ops that follow it, built for the
/// context `captured_for`: on the device, the live context is compared with
/// it (comm type, SP, PCP size, DP size and every DP rank's tokens, and with
/// `AMOE_GUARD_ACTUAL_TOKENS` in `flags` the actual tokens too), and a
/// difference is recorded. Capture it with the ops: every replay checks the
/// context the engine set for it. Only enqueues (no sync, no host read);
/// `amoe_live_context_check` on this `stream` reports the difference (an
/// eager guard keeps its record until that check: check every stream that
/// takes guards, or the context keeps adding records). It takes a free guard
/// record: outside capture, when none is free, it first adds 128 (device
/// and pinned memory, zeroed by a blocking memset, as
/// `amoe_live_context_new` says); under capture it is refused instead,
/// naming `amoe_live_context_reserve`. A stream of another device than
/// `ctx`'s is `AMOE_STATUS_DEVICE`.
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
        let c = try_handle(F, "ctx", ctx)?;
        let w = forward_context(F, "captured_for", captured_for)?.words()?;
        let s = Call::new(F, stream)?.required_stream()?;
        Ok(c.guard("moe_layer", &w, flags & AMOE_GUARD_ACTUAL_TOKENS != 0, s.device().stream())?)
    })
}

/// The caller's sync point for the guards: synchronises `stream`, then
/// returns `AMOE_STATUS_STALE_CONTEXT` with the field and both values when a
/// guard found the live context different from the one its ops were captured
/// for (the first such guard, in enqueue order; each difference is reported
/// once; a captured guard reports a difference found by any replay since the
/// last check, also when later replays matched), else OK. Outside capture: refused while `stream` captures (the
/// capture stays valid), and for a stream of another device than `ctx`'s.
/// A guard enqueued outside capture is read and its record released by the
/// check of the stream it was enqueued on (a guard on another stream may not
/// have run yet: that stream's check reports it), also by one that fails
/// because the stream failed (its error is returned).
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
        let c = try_handle(F, "ctx", ctx)?;
        let s = Call::new(F, stream)?.required_stream()?;
        Ok(c.synchronize_and_check(s.device().stream())?)
    })
}
