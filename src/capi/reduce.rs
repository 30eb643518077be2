//! The runtime-aware reduce policy (SPEC section 5): its decisions and the
//! three reduction points, evaluated with the live comm type.

use std::ffi::c_char;

use super::ffi::{ffi, flag, refusing, send_refusal, try_out, try_ref, write_out, Call, Failure};
use super::handle::try_handle;
use super::types::{amoe_comm, amoe_status, amoe_stream, amoe_tensor};
use crate::moe::{self, ReducePoint, ReducePolicy, SharedMode};
use crate::{CommType, DType};

/// The static part of a layer's reduction policy (SPEC section 5). The live
/// MoE comm type is passed to each reduction point separately.
#[derive(Debug, Clone, Copy)]
#[repr(C)]
pub struct amoe_reduce_policy {
    /// An `amoe_shared_mode` code.
    pub shared_mode: u32,
    /// Non-zero when a transform follows the routed experts.
    pub has_routed_transform: u8,
    /// Non-zero when MoE sequence parallelism is on.
    pub sp: u8,
    /// TP group size (>= 1).
    pub tp_size: usize,
    /// EP group size (a positive multiple of `tp_size`).
    pub ep_size: usize,
}

/// Whether the routed output of `comm_type` is already the full sum
/// (SPEC section 5): `comm in {MC2, ALLTOALL, FUSED_MC2} or (ALLGATHER and sp)`.
/// Writes 1 or 0 to `*out`.
///
/// # Safety
/// `out` writable.
#[no_mangle]
pub unsafe extern "C" fn amoe_routed_is_reduced(comm_type: u32, sp: u8, out: *mut u8) -> amoe_status {
    const F: &str = "amoe_routed_is_reduced";
    ffi!(F, {
        let out = try_out!(F, out, "out");
        let r = moe::routed_is_reduced(CommType::from_u32(comm_type)?, flag(sp));
        write_out(out, r as u8);
        Ok(())
    })
}

fn policy(f: &str, p: *const amoe_reduce_policy) -> Result<ReducePolicy, Failure> {
    let p = try_ref!(f, p, "policy");
    Ok(ReducePolicy::new(
        SharedMode::from_u32(p.shared_mode)?,
        flag(p.has_routed_transform),
        flag(p.sp),
        p.tp_size,
        p.ep_size,
    )?)
}

/// Validates a policy and writes its decisions for the live `comm_type`:
/// `*early` (reduce the routed output before the transform), and whether
/// each of the three reduction points all-reduces (`*routed`, `*shared`,
/// `*final_`). Any out-pointer may be NULL to skip it.
///
/// # Safety
/// `policy` valid; non-NULL out-pointers writable.
#[no_mangle]
pub unsafe extern "C" fn amoe_reduce_policy_decisions(
    policy: *const amoe_reduce_policy,
    comm_type: u32,
    early: *mut u8,
    routed: *mut u8,
    shared: *mut u8,
    final_: *mut u8,
) -> amoe_status {
    const F: &str = "amoe_reduce_policy_decisions";
    ffi!(F, {
        let p = self::policy(F, policy)?;
        let c = CommType::from_u32(comm_type)?;
        for (ptr, v) in [
            (early, p.early()),
            (routed, p.routed_early_reduces(c)),
            (shared, p.shared_reduces(c)),
            (final_, p.final_reduces(c)),
        ] {
            if !ptr.is_null() {
                write_out(ptr, v as u8);
            }
        }
        Ok(())
    })
}

/// The body of the reduction-point exports: the point's `_into` form over
/// the caller's `x` and `out`, which may be the same memory ([`Output::of`]
/// decides).
#[allow(clippy::too_many_arguments)] // the export's arguments, plus its name and point
fn reduce_point(
    f: &'static str,
    stream: *const amoe_stream,
    point: ReducePoint,
    p: *const amoe_reduce_policy,
    x: *const amoe_tensor,
    comm_type: u32,
    tp_comm: *const amoe_comm,
    out: *const amoe_tensor,
) -> Result<(), Failure> {
    // The TP peers wait in the comm-type agreement (or the all-reduce), also
    // when `stream` is no live stream handle.
    let tp = try_handle(f, "tp_comm", tp_comm)?;
    // Where the policy and comm type can be read, a point that reduces is
    // refused through its all-reduce also where the agreement is off.
    let reduces_here =
        || policy(f, p).ok().zip(CommType::from_u32(comm_type).ok()).is_some_and(|(p, c)| p.reduces(point, c));
    let cx = &refusing(Call::new(f, stream), |e| moe::reduce::refuse_at_point(reduces_here(), tp, DType::I32, e))?;
    let tp = cx.comm("tp_comm", tp_comm)?;
    let mut reduces = false;
    let checked = (|| {
        let p = policy(cx.f, p)?;
        let c = CommType::from_u32(comm_type)?;
        reduces = p.reduces(point, c);
        // Guarded only where the result depends on the comm type (each guard
        // holds one of the live context's records).
        if p.depends_on_comm_type(point) {
            cx.guard(c, None, false)?;
        }
        let x_in = cx.input("x", x)?;
        let out = cx.out("out", out)?;
        out.check_like(cx, &x_in, x_in.shape())?;
        let o = cx.output(&out)?;
        Ok((p, c, x_in, out, o))
    })();
    // The TP peers wait in the comm-type agreement (or the all-reduce).
    let (p, c, x_in, out, mut o) = refusing(checked, |e| moe::reduce::refuse_at_point(reduces, tp, DType::I32, e))?;
    p.reduce_at_out(point, &x_in, c, tp, &mut o)?;
    // In place on the host, `o` is a buffer of the call's own (the caller's
    // memory is lent to `x_in`, read-only): `boundary` copies it into `out`
    // once `x_in` is dropped.
    cx.write(&out, o)
}

/// Reports `message`, an error this rank found in its own arguments at a
/// reduction point that it will therefore not run, to its TP peers (for a
/// binding that checks arguments before it calls the library). `reduces`
/// (0, or non-zero for 1): whether the point reduces under the policy and comm type
/// (`amoe_reduce_policy_decisions`; 0 when they are unknown). The peers'
/// first collective over `tp_comm` is the comm-type agreement where that
/// check is on (a CPU communicator unless `ASCEND_MOE_CHECK_COMM_TYPE=0`),
/// else the all-reduce of a point that reduces: a CPU communicator joins it
/// as a refusal, so each peer fails at once with `AMOE_STATUS_COMM_MISMATCH`
/// quoting `message`, and this returns OK. Nothing is sent on an HCCL
/// communicator, over one rank, or where no peer communicates (OK).
///
/// # Safety
/// `tp_comm` live; `message` a NUL-terminated UTF-8 string.
#[no_mangle]
pub unsafe extern "C" fn amoe_reduce_refuse(
    tp_comm: *const amoe_comm,
    reduces: u8,
    message: *const c_char,
) -> amoe_status {
    const F: &str = "amoe_reduce_refuse";
    ffi!(F, {
        let tp = try_handle(F, "tp_comm", tp_comm)?;
        send_refusal(F, message, |e| moe::reduce::refuse_at_point(flag(reduces), tp, DType::I32, e))
    })
}

/// Reduction point 1 (routed output, before the transform) with the live
/// `comm_type`: `out` = TP all-reduce of `x` when the policy says so for this
/// comm type, else a copy of `x`. Shape and dtype of `out` equal `x`'s (the
/// shape function is the identity); `x` and `out` may be the same memory.
/// Collective over `tp_comm` when it reduces. Ownership as `amoe_all_reduce`.
/// With TP > 1 on a CPU communicator (on an NPU with
/// `ASCEND_MOE_CHECK_COMM_TYPE=1`) the TP ranks first all-gather their
/// `comm_type`, with a fingerprint of their policy: ranks that disagree on
/// either all fail, naming who chose what (or that the policies differ). A rank
/// with an empty `x` still meets its peers in the CPU all-reduce, so a peer
/// with rows fails the call on every rank.
///
/// NPU (this and the other two reduction points): enqueues on `stream` one
/// device copy of `x` into `out` (none when they are the same memory) and,
/// when the point reduces, one in-place HCCL all-reduce of `out`; never
/// synchronises, never allocates, never reads device data on the host.
///
/// # Safety
/// `policy` valid; `x`, `out` valid descriptors; `tp_comm` live.
#[no_mangle]
pub unsafe extern "C" fn amoe_reduce_routed_early(
    policy: *const amoe_reduce_policy,
    x: *const amoe_tensor,
    comm_type: u32,
    tp_comm: *const amoe_comm,
    out: *const amoe_tensor,
    stream: *const amoe_stream,
) -> amoe_status {
    const F: &str = "amoe_reduce_routed_early";
    ffi!(F, { reduce_point(F, stream, ReducePoint::RoutedEarly, policy, x, comm_type, tp_comm, out) })
}

/// Reduction point 2 (shared-expert output) with the live `comm_type`.
/// As `amoe_reduce_routed_early`.
///
/// # Safety
/// As `amoe_reduce_routed_early`.
#[no_mangle]
pub unsafe extern "C" fn amoe_reduce_shared(
    policy: *const amoe_reduce_policy,
    x: *const amoe_tensor,
    comm_type: u32,
    tp_comm: *const amoe_comm,
    out: *const amoe_tensor,
    stream: *const amoe_stream,
) -> amoe_status {
    const F: &str = "amoe_reduce_shared";
    ffi!(F, { reduce_point(F, stream, ReducePoint::Shared, policy, x, comm_type, tp_comm, out) })
}

/// Reduction point 3 (after `shared + routed`) with the live `comm_type`.
/// As `amoe_reduce_routed_early`.
///
/// # Safety
/// As `amoe_reduce_routed_early`.
#[no_mangle]
pub unsafe extern "C" fn amoe_reduce_final(
    policy: *const amoe_reduce_policy,
    x: *const amoe_tensor,
    comm_type: u32,
    tp_comm: *const amoe_comm,
    out: *const amoe_tensor,
    stream: *const amoe_stream,
) -> amoe_status {
    const F: &str = "amoe_reduce_final";
    ffi!(F, { reduce_point(F, stream, ReducePoint::Final, policy, x, comm_type, tp_comm, out) })
}
