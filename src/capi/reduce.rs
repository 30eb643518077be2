//! The runtime-aware reduce policy (SPEC section 5): its decisions and the
//! three reduction points, evaluated with the live comm type.

use super::comm::comm_ref;
use super::ffi::{check_out, ffi, flag, read_tensor, try_out, try_ref, write_out, write_tensor, Failure};
use super::types::{amoe_comm, amoe_status, amoe_stream, amoe_tensor};
use crate::moe::{self, ReducePolicy, SharedMode};
use crate::tensor::Storage;
use crate::CommType;

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
        // SAFETY: checked non-null, writable per the contract.
        unsafe { write_out(out, r as u8) };
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
                // SAFETY: non-null, writable per the contract.
                unsafe { write_out(ptr, v as u8) };
            }
        }
        Ok(())
    })
}

/// Which of the three reduction points a call runs.
#[derive(Clone, Copy)]
enum Point {
    RoutedEarly,
    Shared,
    Final,
}

/// # Safety
/// As the reduction-point exports.
#[allow(clippy::too_many_arguments)] // the export's arguments, plus which point it is
unsafe fn reduce_point(
    f: &'static str,
    point: Point,
    p: *const amoe_reduce_policy,
    x: *const amoe_tensor,
    comm_type: u32,
    tp_comm: *const amoe_comm,
    out: *const amoe_tensor,
    stream: *const amoe_stream,
) -> Result<(), Failure> {
    let p = policy(f, p)?;
    let c = CommType::from_u32(comm_type)?;
    // SAFETY: `stream` is NULL or a live handle, per the caller's contract.
    unsafe { super::live::guard_op(f, stream, c, None) }?;
    // SAFETY: the caller's contracts, for every call below.
    let tp = unsafe { comm_ref(f, tp_comm) }?;
    let x_in = unsafe { read_tensor(f, "x", x) }?;
    // SAFETY: `out` is a valid descriptor, per the export's contract.
    unsafe { check_out(f, "out", out, x_in.shape(), x_in.dtype()) }?;
    let run = |x: crate::Tensor| match point {
        Point::RoutedEarly => p.reduce_routed_early(x, c, tp),
        Point::Shared => p.reduce_shared(x, c, tp),
        Point::Final => p.reduce_final(x, c, tp),
    };
    let into = |x: &crate::Tensor, o: &mut crate::Tensor| match point {
        Point::RoutedEarly => p.reduce_routed_early_into(x, c, tp, o),
        Point::Shared => p.reduce_shared_into(x, c, tp, o),
        Point::Final => p.reduce_final_into(x, c, tp, o),
    };
    let y = if x_in.is_cpu() {
        // A host input is read in place and copied into the caller's `out`
        // (or, for an NPU `out`, reduced on the host and copied there), where
        // the point reduces it.
        // SAFETY: `out` is a valid descriptor, per the export's contract.
        match unsafe { super::ffi::out_for(f, "out", out, &x_in) }? {
            Some(mut o) => {
                into(&x_in, &mut o)?;
                o
            }
            None => run(x_in)?,
        }
    } else {
        // An NPU input is reduced in the caller's `out`: `x` is copied there
        // on the stream (nothing when they are the same memory), so no
        // buffer is allocated and the result needs no copy.
        // SAFETY: `out` is a valid descriptor over NPU memory of the stream's device.
        let mut o = unsafe { super::ffi::out_tensor(f, "out", out) }?;
        match (x_in.storage(), o.storage()) {
            (Storage::Npu(src), Storage::Npu(dst)) if src.as_ptr() == dst.as_ptr() => run(o)?,
            (Storage::Npu(_), Storage::Npu(_)) => {
                into(&x_in, &mut o)?;
                o
            }
            _ => {
                return Err(Failure::new(
                    amoe_status::Device,
                    format!("{f}: `x` is an NPU tensor, so `out` must be one too (on the stream's device)"),
                ))
            }
        }
    };
    // SAFETY: `out` is a valid descriptor, per the export's contract.
    unsafe { write_tensor(f, "out", out, &y) }
}

/// Reduction point 1 (routed output, before the transform) with the live
/// `comm_type`: `out` = TP all-reduce of `x` when the policy says so for this
/// comm type, else a copy of `x`. Shape and dtype of `out` equal `x`'s (the
/// shape function is the identity); `x` and `out` may be the same memory.
/// Collective over `tp_comm` when it reduces. Ownership as `amoe_all_reduce`.
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
    ffi!(F, {
        // SAFETY: `stream` is NULL or a live handle, per the export's contract.
        let _npu = unsafe { super::ffi::bind_stream(F, stream) }?;
        // SAFETY: the caller's contracts, forwarded.
        unsafe { reduce_point(F, Point::RoutedEarly, policy, x, comm_type, tp_comm, out, stream) }
    })
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
    ffi!(F, {
        // SAFETY: `stream` is NULL or a live handle, per the export's contract.
        let _npu = unsafe { super::ffi::bind_stream(F, stream) }?;
        // SAFETY: the caller's contracts, forwarded.
        unsafe { reduce_point(F, Point::Shared, policy, x, comm_type, tp_comm, out, stream) }
    })
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
    ffi!(F, {
        // SAFETY: `stream` is NULL or a live handle, per the export's contract.
        let _npu = unsafe { super::ffi::bind_stream(F, stream) }?;
        // SAFETY: the caller's contracts, forwarded.
        unsafe { reduce_point(F, Point::Final, policy, x, comm_type, tp_comm, out, stream) }
    })
}
