//! Token prepare / finalize per MoE comm type (SPEC section 6): the token
//! padding, splitting and gathering around the experts of one MoE layer.

use std::ffi::c_char;

use super::ffi::{
    ffi, flag, read_meta, read_sizes, refusing, refusing_on, send_refusal, try_out, try_ref, write_out, write_shape,
    Call, Failure,
};
use super::handle::{box_out, release, try_handle};
use super::types::{amoe_comm, amoe_moe_groups, amoe_status, amoe_stream, amoe_tensor};
use crate::moe::prepare_finalize::{self as pf, MoeContext, MoeGroups};
use crate::{CommType, DType};

/// Most EP ranks (`dp_size * pcp_size * tp_size`) an `amoe_moe_context` may describe.
pub const AMOE_MAX_EP_RANKS: usize = 1 << 20;
// The header needs the literal; the Rust API's bound is the same number.
const _: () = assert!(AMOE_MAX_EP_RANKS == crate::moe::layout::MAX_EP_RANKS);

/// `amoe_moe_context::num_actual_tokens` for "every token of the DP rank is real".
// Spelled so that the header gets it (`(size_t)~0`, which is `SIZE_MAX`):
// the generator writes no value for `usize::MAX`, and keeps the cast.
#[allow(clippy::unnecessary_cast)]
pub const AMOE_ALL_TOKENS: usize = !0 as usize;
const _: () = assert!(AMOE_ALL_TOKENS == usize::MAX);

/// The run-time parallel context of one forward pass (SPEC sections 2 and 6).
/// Read only; the caller owns `dp_tokens`, which must stay valid for the
/// call. `dp_size * pcp_size * tp_size` is at most `AMOE_MAX_EP_RANKS`. Fill
/// it with `amoe_moe_context_init` first (which sets `struct_size` and the
/// defaults: every token real, no PCP), then set the fields.
#[derive(Debug, Clone, Copy)]
#[repr(C)]
pub struct amoe_moe_context {
    /// `sizeof(amoe_moe_context)` of the header the caller was built with
    /// (a later version adds fields at the end); any other value is refused.
    pub struct_size: usize,
    /// Tokens of every DP rank in this forward (`dp_size` entries).
    pub dp_tokens: *const usize,
    /// Number of DP ranks.
    pub dp_size: usize,
    /// TP group size.
    pub tp_size: usize,
    /// This rank's DP rank.
    pub dp_rank: usize,
    /// This rank's TP rank.
    pub tp_rank: usize,
    /// Non-zero when MoE sequence parallelism is on.
    pub sp: u8,
    /// Real tokens of this DP rank, at most its `dp_tokens` entry (rows past
    /// it are graph padding; the MC2 mask marks only the first ones);
    /// `AMOE_ALL_TOKENS` = all of them.
    pub num_actual_tokens: usize,
    /// PCP size (0 or 1 = no prefill context parallelism; EP rank order is
    /// DP x PCP x TP).
    pub pcp_size: usize,
    /// This rank's PCP rank (< `pcp_size`; 0 without PCP).
    pub pcp_rank: usize,
    /// Rows MC2 / FUSED_MC2 pad every DP rank's tokens to before the TP split
    /// (the engine's choice, e.g. vLLM-Ascend's `padded_num_tokens`): a
    /// multiple of `tp_size`, at least every `dp_tokens` entry. 0 = the
    /// default, `ceil_to(max dp_tokens, tp_size)`.
    pub padded_num_tokens: usize,
}

/// Fills `*ctx` with its defaults: `struct_size` of this library, no DP
/// tokens (`dp_tokens` NULL, `dp_size` 0), TP size 1, ranks 0, no SP, every
/// token real (`AMOE_ALL_TOKENS`), no PCP, the default MC2 pad target (0).
///
/// # Safety
/// `ctx` writable.
#[no_mangle]
pub unsafe extern "C" fn amoe_moe_context_init(ctx: *mut amoe_moe_context) -> amoe_status {
    const F: &str = "amoe_moe_context_init";
    ffi!(F, {
        let ctx = try_out!(F, ctx, "ctx");
        write_out(ctx, amoe_moe_context::default());
        Ok(())
    })
}

impl Default for amoe_moe_context {
    /// What `amoe_moe_context_init` writes.
    fn default() -> Self {
        amoe_moe_context {
            struct_size: std::mem::size_of::<amoe_moe_context>(),
            dp_tokens: std::ptr::null(),
            dp_size: 0,
            tp_size: 1,
            dp_rank: 0,
            tp_rank: 0,
            sp: 0,
            num_actual_tokens: AMOE_ALL_TOKENS,
            pcp_size: 1,
            pcp_rank: 0,
            padded_num_tokens: 0,
        }
    }
}

/// The refusal of a token prepare or finalize that fails before it made its
/// plan (a bad stream, a guard that fails): through the call its peers make
/// first, found from `ctx` and `comm_type` where both can be read
/// ([`pf::refuse_first`]: the comm-type agreement where that check is on,
/// else the plan's first collective), else through the agreement alone
/// ([`pf::refuse_unread`]; with the check off nothing can be sent).
fn refuse_early<'g>(
    stage: pf::Stage,
    f: &'static str,
    ctx: *const amoe_moe_context,
    comm_type: u32,
    g: &'g MoeGroups,
) -> impl FnOnce(crate::Error) -> crate::Error + 'g {
    move |e| match (context(f, ctx), CommType::from_u32(comm_type)) {
        (Ok(c), Ok(ct)) => pf::refuse_first(stage, ct, &c, g, DType::U8, e),
        _ => pf::refuse_unread(g, DType::U8, e),
    }
}

fn context(f: &str, ctx: *const amoe_moe_context) -> Result<MoeContext, Failure> {
    let c = try_ref!(f, ctx, "ctx");
    let want = std::mem::size_of::<amoe_moe_context>();
    if c.struct_size != want {
        return Err(Failure::invalid(
            f,
            "ctx.struct_size",
            format!(
                "is {}, this library's amoe_moe_context has {want} bytes (fill it with amoe_moe_context_init)",
                c.struct_size
            ),
        ));
    }
    let dp = read_sizes(f, "ctx.dp_tokens", c.dp_tokens, c.dp_size)?;
    // MoeContext::new bounds dp_size * tp_size by AMOE_MAX_EP_RANKS before
    // anything builds per-rank tables.
    let mut m = MoeContext::new(&dp, c.tp_size, c.dp_rank, c.tp_rank, flag(c.sp))?;
    if c.num_actual_tokens != AMOE_ALL_TOKENS {
        m = m.with_num_actual_tokens(c.num_actual_tokens)?;
    }
    // `with_pcp` reads `pcp_size` 0 or 1 as no PCP.
    m = m.with_pcp(c.pcp_size, c.pcp_rank)?;
    if c.padded_num_tokens != 0 {
        m = m.with_padded_num_tokens(c.padded_num_tokens)?;
    }
    Ok(m)
}

/// Splits `world` (EP = DP x PCP x TP ranks, EP rank `(dp * pcp_size + pcp) *
/// tp_size + tp`; `pcp_size` 0 or 1 = no PCP, EP rank `dp * tp_size + tp`)
/// into this rank's TP, DP and (with PCP) PCP groups. Collective: every rank
/// of `world` calls it. An error names the sizes when the world is not DP x
/// PCP x TP. `*out` receives a new handle owned by the caller; `world` stays
/// the caller's.
///
/// # Safety
/// `world` live; `out` writable.
#[no_mangle]
pub unsafe extern "C" fn amoe_moe_groups_new(
    world: *const amoe_comm,
    pcp_size: usize,
    tp_size: usize,
    out: *mut *mut amoe_moe_groups,
) -> amoe_status {
    const F: &str = "amoe_moe_groups_new";
    ffi!(F, {
        let w = try_handle(F, "world", world)?;
        // The peers wait in the groups' agreement on the sizes.
        let out = refusing_on(w, (|| Ok(try_out!(F, out, "out")))())?;
        let g = MoeGroups::from_world_pcp(w, pcp_size, tp_size)?;
        box_out(out, g);
        Ok(())
    })
}

/// The groups of communicators the engine already has (EP, TP, DP and,
/// NULL for none, PCP), creating none: local, no communication. They must
/// form the DP x PCP x TP layout (EP rank `(dp * pcp_size + pcp) * tp_size +
/// tp`); an error names what does not fit. The handles are shared: the
/// communicators stay usable through their own handles, and the groups keep
/// them alive until `amoe_moe_groups_free` (borrowed HCCL communicators must
/// outlive both). `*out` receives a new handle owned by the caller.
///
/// # Safety
/// `ep`, `tp`, `dp` live; `pcp` NULL or live; `out` writable.
#[no_mangle]
pub unsafe extern "C" fn amoe_moe_groups_from_comms(
    ep: *const amoe_comm,
    tp: *const amoe_comm,
    dp: *const amoe_comm,
    pcp: *const amoe_comm,
    out: *mut *mut amoe_moe_groups,
) -> amoe_status {
    const F: &str = "amoe_moe_groups_from_comms";
    ffi!(F, {
        let out = try_out!(F, out, "out");
        let (e, t, d) = (try_handle(F, "ep", ep)?, try_handle(F, "tp", tp)?, try_handle(F, "dp", dp)?);
        let p = if pcp.is_null() { None } else { Some(try_handle(F, "pcp", pcp)?) };
        let g = MoeGroups::from_comms(e, t, d, p)?;
        box_out(out, g);
        Ok(())
    })
}

/// Releases groups from `amoe_moe_groups_new` or `amoe_moe_groups_from_comms`. NULL is a no-op.
///
/// # Safety
/// `groups` NULL or a live handle not used afterwards.
#[no_mangle]
pub unsafe extern "C" fn amoe_moe_groups_free(groups: *mut amoe_moe_groups) {
    release(groups);
}

/// A prepare / finalize shape function: the input's shape and dtype, the
/// comm type and the context to the output's shape.
type PlanShape = fn(&[usize], DType, CommType, &MoeContext) -> crate::Result<Vec<usize>>;

/// The body of the prepare / finalize shape exports.
#[allow(clippy::too_many_arguments)]
fn plan_shape(
    f: &'static str,
    arg: &'static str,
    shape_of: PlanShape,
    x: *const amoe_tensor,
    comm_type: u32,
    ctx: *const amoe_moe_context,
    out_shape: *mut usize,
    cap: usize,
    out_ndim: *mut usize,
) -> amoe_status {
    ffi!(f, {
        let m = read_meta(f, arg, x)?;
        let c = context(f, ctx)?;
        let shape = shape_of(&m.shape, m.dtype, CommType::from_u32(comm_type)?, &c)?;
        write_shape(f, &shape, m.dtype, out_shape, cap, out_ndim)
    })
}

/// Output shape of `amoe_token_prepare` for this rank's `x` (`[T_d or the SP
/// shard, H...]`). Out-pointers as `amoe_moe_finalize_routing_output_shape`.
///
/// # Safety
/// `x`, `ctx` valid; out-pointers writable.
#[no_mangle]
pub unsafe extern "C" fn amoe_token_prepare_output_shape(
    x: *const amoe_tensor,
    comm_type: u32,
    ctx: *const amoe_moe_context,
    out_shape: *mut usize,
    cap: usize,
    out_ndim: *mut usize,
) -> amoe_status {
    const F: &str = "amoe_token_prepare_output_shape";
    let shape_of = |x: &[usize], _, ct, c: &MoeContext| pf::prepare_output_shape(x, ct, c);
    plan_shape(F, "x", shape_of, x, comm_type, ctx, out_shape, cap, out_ndim)
}

/// Prepares this rank's tokens for the experts under the live `comm_type`
/// (pad, DP all-gather or TP split; SPEC section 6). Collective over the
/// groups. `out` has the shape from `amoe_token_prepare_output_shape`.
/// For MC2 / FUSED_MC2 the mask of this rank's prepared rows is written into
/// `mc2_mask` (NULL to skip it): a caller-owned 1-D `BOOL` or `U8` tensor of
/// exactly `out`'s row count, host or NPU memory (for example the engine's
/// own mask buffer), 1 for the first `num_actual_tokens` rows of this DP
/// rank, 0 for graph and TP padding. Other comm types leave it untouched. A
/// mask of another dtype (`AMOE_STATUS_DTYPE`) or length
/// (`AMOE_STATUS_SHAPE`), or one that overlaps `out`
/// (`AMOE_STATUS_INVALID_ARGUMENT`, naming both), is refused before any
/// communication. So are an unknown `comm_type` and a NULL or malformed
/// `ctx`; on a CPU group with the comm-type check on, the peers (waiting in
/// that check) fail with them at once, as with any other bad argument.
/// With a live context attached to `stream`, the call first queues a guard of
/// `ctx`; when it writes a mask, the guard compares the actual tokens too (a
/// captured mask is replayed as written), where "all" and this DP rank's
/// token count are the same value.
/// With `pcp_size > 1` (groups from `amoe_moe_groups_new` with the same PCP
/// size) ALLGATHER without SP gathers over DP then PCP, and
/// `amoe_token_finalize` is a PCP reduce-scatter then a DP reduce-scatter.
///
/// NPU (this and `amoe_token_finalize`): the row copies and the HCCL
/// collectives are enqueued on `stream`, intermediates come from its pool,
/// and the last collective or row copy writes `out` itself (an `out` that
/// overlaps the input gets the result by one device copy; `amoe_token_finalize`
/// with `out` naming `y`'s memory runs in place). It never synchronises,
/// never allocates outside the stream's pool (or allocator), never reads
/// device data on the host, and can be captured into a graph: every count is
/// a shape, known on the host. With `ASCEND_MOE_CHECK_COMM_TYPE=1` every EP
/// rank first all-gathers its `comm_type` and a fingerprint of `ctx` (every
/// DP rank's tokens, TP and PCP sizes, SP, the MC2 pad target) and of the
/// dtype and row shape of `x` (of `y` in `amoe_token_finalize`), compared
/// on the device; ranks that disagree on either fail their next
/// `amoe_stream_check` (on a CPU group, where the check is on by default,
/// the call fails on every rank at once, and the TP ranks of each DP rank
/// also compare its `num_actual_tokens` there).
///
/// # Safety
/// Descriptors valid (`mc2_mask` NULL or valid); `ctx` valid; `groups` live.
#[no_mangle]
pub unsafe extern "C" fn amoe_token_prepare(
    x: *const amoe_tensor,
    comm_type: u32,
    ctx: *const amoe_moe_context,
    groups: *const amoe_moe_groups,
    out: *const amoe_tensor,
    mc2_mask: *const amoe_tensor,
    stream: *const amoe_stream,
) -> amoe_status {
    const F: &str = "amoe_token_prepare";
    ffi!(F, {
        let g = try_handle(F, "groups", groups)?;
        let cx = &refusing(Call::new(F, stream), refuse_early(pf::Stage::Prepare, F, ctx, comm_type, g))?;
        // Without a comm type or context this rank cannot plan; its peers
        // still wait in the comm-type agreement where that check is on.
        let read = (|| {
            let c = context(F, ctx)?;
            let ct = CommType::from_u32(comm_type)?;
            // A mask written for the captured actual tokens would be replayed
            // for others: the guard compares them too.
            let writes_mask = !mc2_mask.is_null() && pf::mc2_mask_extent(ct, &c).is_some();
            cx.guard(ct, Some(&c), writes_mask)?;
            Ok((c, ct, writes_mask))
        })();
        let (c, ct, writes_mask) = refusing(read, refuse_early(pf::Stage::Prepare, F, ctx, comm_type, g))?;
        let checked = (|| {
            let x = cx.input("x", x)?;
            let shape = pf::prepare_output_shape(x.shape(), ct, &c)?;
            let out = cx.out("out", out)?;
            out.check_like(cx, &x, &shape)?;
            let mask_out = if writes_mask {
                let m = cx.out("mc2_mask", mc2_mask)?;
                m.apart_from(cx, &out)?;
                Some(m)
            } else {
                None
            };
            let o = cx.output(&out)?;
            let mask = mask_out.as_ref().map(|m| cx.output(m)).transpose()?;
            Ok((x, out, o, mask_out, mask))
        })();
        let refuse = |e| pf::refuse_first(pf::Stage::Prepare, ct, &c, g, DType::U8, e);
        let (x, out, o, mask_out, mut mask) = refusing(checked, refuse)?;
        // The tokens go straight into the caller's `out` where it can be lent
        // (else into a host buffer of the call's own, copied into `out`); the
        // Rust API checks the mask, and refuses it and its own memory to the
        // peers.
        let mut hidden = o;
        pf::prepare_with_mask_into(&x, ct, &c, g, &mut hidden, mask.as_mut())?;
        cx.write(&out, hidden)?;
        if let (Some(m), Some(mask)) = (mask_out, mask) {
            cx.write(&m, mask)?;
        }
        Ok(())
    })
}

/// Reports `message`, an error this rank found in its own arguments to
/// `amoe_token_prepare` (`finalize` 0) or `amoe_token_finalize` (non-zero) that it
/// will therefore not make, to the peers (for a binding that checks
/// arguments before it calls the library). The peers' first collective is
/// the comm-type agreement over the EP group where that check is on (a CPU
/// communicator unless `ASCEND_MOE_CHECK_COMM_TYPE=0`; prepare and
/// finalize), else the first collective of the token plan: a CPU group joins
/// it as a refusal, so each peer fails at once with
/// `AMOE_STATUS_COMM_MISMATCH` quoting `message`, and this returns OK.
/// Nothing is sent on HCCL, where no peer communicates (an MC2 or ALLTOALL
/// prepare without the check, a local finalize), or, outside the agreement,
/// when `groups` do not match `ctx` (OK). An unknown `comm_type` or a NULL or
/// malformed `ctx` is sent through the agreement where it is on, else
/// returned as the error it is.
///
/// # Safety
/// `ctx` valid; `groups` live; `message` a NUL-terminated UTF-8 string.
#[no_mangle]
pub unsafe extern "C" fn amoe_token_refuse(
    comm_type: u32,
    ctx: *const amoe_moe_context,
    groups: *const amoe_moe_groups,
    finalize: u8,
    message: *const c_char,
) -> amoe_status {
    const F: &str = "amoe_token_refuse";
    ffi!(F, {
        let g = try_handle(F, "groups", groups)?;
        let stage = if flag(finalize) { pf::Stage::Finalize } else { pf::Stage::Prepare };
        match (|| Ok::<_, Failure>((context(F, ctx)?, CommType::from_u32(comm_type)?)))() {
            Ok((c, ct)) => send_refusal(F, message, |e| pf::refuse_first(stage, ct, &c, g, DType::U8, e)),
            // The peers of a prepare or finalize wait in the comm-type
            // agreement where it is on, whatever this rank's comm type or
            // context would be.
            Err(_) if pf::comm_type_check_enabled(&g.ep) => {
                send_refusal(F, message, |e| pf::refuse_unread(g, DType::U8, e))
            }
            Err(failure) => Err(failure),
        }
    })
}

/// Output shape of `amoe_token_finalize` for the experts' output `y` (the
/// prepared rows): `[this rank's tokens, H...]`. Where that path sums the
/// rows (ALLGATHER) `y` must have a dtype it sums (f32, f16, bf16, i32,
/// i64): a one-byte dtype is `AMOE_STATUS_DTYPE`, as `amoe_token_finalize`
/// refuses it. Out-pointers as `amoe_moe_finalize_routing_output_shape`.
///
/// # Safety
/// As `amoe_token_prepare_output_shape`.
#[no_mangle]
pub unsafe extern "C" fn amoe_token_finalize_output_shape(
    y: *const amoe_tensor,
    comm_type: u32,
    ctx: *const amoe_moe_context,
    out_shape: *mut usize,
    cap: usize,
    out_ndim: *mut usize,
) -> amoe_status {
    const F: &str = "amoe_token_finalize_output_shape";
    plan_shape(F, "y", pf::finalize_shape_and_dtype, y, comm_type, ctx, out_shape, cap, out_ndim)
}

/// Returns the experts' output `y` to this rank's token layout under the
/// live `comm_type` (DP reduce-scatter, TP all-gather, unpad; SPEC section
/// 6). Collective over the groups. `out` has the shape from
/// `amoe_token_finalize_output_shape`; ownership as `amoe_moe_finalize_routing`.
///
/// # Safety
/// As `amoe_token_prepare`.
#[no_mangle]
pub unsafe extern "C" fn amoe_token_finalize(
    y: *const amoe_tensor,
    comm_type: u32,
    ctx: *const amoe_moe_context,
    groups: *const amoe_moe_groups,
    out: *const amoe_tensor,
    stream: *const amoe_stream,
) -> amoe_status {
    const F: &str = "amoe_token_finalize";
    ffi!(F, {
        let g = try_handle(F, "groups", groups)?;
        let cx = &refusing(Call::new(F, stream), refuse_early(pf::Stage::Finalize, F, ctx, comm_type, g))?;
        // Without a comm type or context this rank cannot plan; its peers
        // still wait in the comm-type agreement where that check is on.
        let read = (|| {
            let c = context(F, ctx)?;
            let ct = CommType::from_u32(comm_type)?;
            cx.guard(ct, Some(&c), false)?;
            Ok((c, ct))
        })();
        let (c, ct) = refusing(read, refuse_early(pf::Stage::Finalize, F, ctx, comm_type, g))?;
        let checked = (|| {
            let yt = cx.input("y", y)?;
            // `y`'s own checks before `out`'s, as the shape function: a `y`
            // this path cannot sum is named as such, not as `out`'s dtype.
            let shape = pf::finalize_shape_and_dtype(yt.shape(), yt.dtype(), ct, &c)?;
            let out = cx.out("out", out)?;
            out.check_like(cx, &yt, &shape)?;
            let o = cx.output(&out)?;
            Ok((yt, out, o))
        })();
        let refuse = |e| pf::refuse_first(pf::Stage::Finalize, ct, &c, g, DType::U8, e);
        let (yt, out, mut r) = refusing(checked, refuse)?;
        // The last collective or copy writes the caller's `out` (which may be
        // `y`'s memory: the op then reads `y` from a copy of its own).
        pf::finalize_into(&yt, ct, &c, g, &mut r)?;
        cx.write(&out, r)
    })
}
