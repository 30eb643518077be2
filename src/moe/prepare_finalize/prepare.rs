//! Prepare and finalize of the token dimension (SPEC section 6).

use super::groups::{check_groups, comm_type_agreement, comm_type_check_enabled, context_facts, MoeGroups};
use super::plan::{
    finalize_shape_and_dtype, mc2_mask_extent, prepare_output_shape, token_plan, try_mc2_mask, MoeContext, TokenPlan,
};
use super::plan::{FINALIZE, PREPARE};
use crate::backend::args::with_rows;
use crate::backend::Call;
use crate::comm::{joins_empty, Collectives, CommType, ReduceOp};
use crate::moe::finalize::check_out_like;
use crate::moe::output::write_apart;
use crate::moe::pad_reduce::{maybe_all_gather_and_maybe_unpad_into, maybe_pad_and_reduce, maybe_pad_and_reduce_into};
use crate::{DType, Error, Result, Tensor};

/// Prepared tokens of one rank.
#[derive(Debug)]
pub struct Prepared {
    /// The tokens this rank routes (`prepare_output_shape` rows).
    pub hidden: Tensor,
    /// MC2 / FUSED_MC2: which prepared rows are real tokens ([`mc2_mask`](super::mc2_mask)).
    pub mc2_mask: Option<Vec<bool>>,
}

/// Prepare for `comm` (SPEC section 6): the tokens this rank routes.
///
/// The comm type of a forward enters here, at its first collective: when the
/// check is on (see [`check_comm_type_agreement`](super::check_comm_type_agreement);
/// always on the CPU communicator, where it costs one small all-gather next
/// to the token gathers), every EP rank first learns every other rank's
/// choice, and a fingerprint of its forward context (every DP rank's token
/// count, the TP and PCP sizes, SP, the MC2 pad target) and of the dtype and
/// row shape of `x` (finalize: of `y`); on the CPU the TP ranks of a DP rank
/// also compare its actual-token count there. Ranks that disagree on either
/// all fail with an error naming it instead of running the collectives of
/// two different paths, planning other rows, or failing only in the group
/// of their first collective while the other groups return or wait.
pub fn prepare(x: &Tensor, comm: CommType, ctx: &MoeContext, groups: &MoeGroups) -> Result<Prepared> {
    let mut hidden = prepared_tensor(x, comm, ctx, groups, None)?;
    let mc2_mask = prepare_into(x, comm, ctx, groups, &mut hidden)?;
    Ok(Prepared { hidden, mc2_mask })
}

/// [`prepare`] with the MC2 mask written into `mask` (as [`mc2_mask_into`]
/// writes it) instead of returned: the prepared tokens, and whether `mask`
/// was written (comm types without a mask leave it untouched). A `mask` of
/// another dtype or length is refused before anything communicates, to the
/// peers too, as a bad `x` is.
pub fn prepare_with_mask(
    x: &Tensor,
    comm: CommType,
    ctx: &MoeContext,
    groups: &MoeGroups,
    mask: Option<&mut Tensor>,
) -> Result<(Tensor, bool)> {
    let mut hidden = prepared_tensor(x, comm, ctx, groups, mask.as_deref())?;
    let wrote = prepare_with_mask_into(x, comm, ctx, groups, &mut hidden, mask)?;
    Ok((hidden, wrote))
}

/// [`prepare_with_mask`] into `out` (as [`prepare_into`] takes it).
pub fn prepare_with_mask_into(
    x: &Tensor,
    comm: CommType,
    ctx: &MoeContext,
    groups: &MoeGroups,
    out: &mut Tensor,
    mask: Option<&mut Tensor>,
) -> Result<bool> {
    if let Some(m) = mask.as_deref() {
        check_mc2_mask(comm, ctx, m).map_err(|e| refuse_first(Stage::Prepare, comm, ctx, groups, x.dtype(), e))?;
    }
    prepare_tokens_into(x, comm, ctx, groups, out)?;
    match mask {
        Some(m) => mc2_mask_into(comm, ctx, m),
        None => Ok(false),
    }
}

/// The tensor a prepare of `x` writes, after `mask` (if any) is checked:
/// memory this rank cannot have, or a bad mask, fails its peers at once in
/// the collective they make first ([`refuse_first`]) instead of leaving
/// them to wait out the timeout.
fn prepared_tensor(
    x: &Tensor,
    comm: CommType,
    ctx: &MoeContext,
    groups: &MoeGroups,
    mask: Option<&Tensor>,
) -> Result<Tensor> {
    mask.map_or(Ok(None), |m| check_mc2_mask(comm, ctx, m))
        .and_then(|_| prepare_output_shape(x.shape(), comm, ctx))
        .and_then(|shape| x.device().backend().scratch(&shape, x.dtype()))
        .map_err(|e| refuse_first(Stage::Prepare, comm, ctx, groups, x.dtype(), e))
}

/// [`prepare`] into `out` (`prepare_output_shape` rows, dtype and device of
/// `x`; an error naming `out` otherwise), every element of it written; returns
/// the MC2 mask.
pub fn prepare_into(
    x: &Tensor,
    comm: CommType,
    ctx: &MoeContext,
    groups: &MoeGroups,
    out: &mut Tensor,
) -> Result<Option<Vec<bool>>> {
    prepare_tokens_into(x, comm, ctx, groups, out)?;
    try_mc2_mask(comm, ctx)
}

/// [`prepare_into`] without the MC2 mask ([`mc2_mask_into`] writes it).
pub fn prepare_tokens_into(
    x: &Tensor,
    comm: CommType,
    ctx: &MoeContext,
    groups: &MoeGroups,
    out: &mut Tensor,
) -> Result<()> {
    prepare_output_shape(x.shape(), comm, ctx)
        .and_then(|shape| check_out_like(PREPARE, x, out, &shape))
        .and_then(|_| check_groups(PREPARE, ctx, groups))
        .map_err(|e| refuse_first(Stage::Prepare, comm, ctx, groups, x.dtype(), e))?;
    if comm_type_check_enabled(&groups.ep) {
        comm_type_agreement(PREPARE, "EP", comm, Some(context_facts(ctx, "x", x)), &groups.ep, &x.device())?;
    }
    let device = x.device();
    let backend = device.backend();
    match token_plan(comm, ctx) {
        TokenPlan::SpGather(l) => maybe_all_gather_and_maybe_unpad_into(x, Some(&l), &groups.ep, out)?,
        TokenPlan::DpGather { max_tokens } => {
            // A CPU rank with no element to move still joins (count 0), so a
            // peer whose context says rows move fails with it.
            if out.numel() > 0 || joins_empty(&groups.dp) {
                // Memory this rank cannot have fails its peers in the DP
                // all-gather they go on to, at once.
                let scratch = |rows| {
                    let shape = with_rows(PREPARE, "x", x.shape(), rows)?;
                    backend.scratch(&shape, x.dtype()).map_err(|e| groups.dp.refuse_call(Call::AllGather, x.dtype(), e))
                };
                let mut padded = scratch(max_tokens)?;
                if x.rows() > 0 {
                    backend.copy_rows(x, 0, &mut padded, 0, x.rows())?;
                }
                match &groups.pcp {
                    // vLLM-Ascend (`prepare_finalize.py`, `_prepare_with_dp_group`):
                    // the DP all-gather first, then the PCP all-gather of its result.
                    Some(pcp) => {
                        let mut dp_out = scratch(max_tokens * ctx.dp_size())?;
                        groups.dp.all_gather(&padded, &mut dp_out)?;
                        pcp.all_gather(&dp_out, out)?;
                    }
                    None => groups.dp.all_gather(&padded, out)?,
                }
            }
        }
        // These copy rows of `x` into `out`, which may cover bytes of `x`
        // (the C ABI lends the caller's descriptors as two tensors): they
        // then write a workspace result copied into `out`.
        TokenPlan::TpSplit { sizes, .. } => write_apart(out, [("x", Some(x))], |out| {
            let first: usize = sizes[..ctx.tp_rank()].iter().sum();
            let real = x.rows().saturating_sub(first).min(sizes[ctx.tp_rank()]);
            if real > 0 {
                backend.copy_rows(x, first, out, 0, real)?;
            }
            // Rows past the real tokens are zero (the padding); `out` may be
            // the caller's memory, so they are written here.
            let pad = out.rows() - real;
            if pad > 0 && out.row_len() > 0 {
                let zeros = backend.scratch(&with_rows(PREPARE, "out", out.shape(), pad)?, x.dtype())?;
                backend.copy_rows(&zeros, 0, out, real, pad)?;
            }
            Ok(())
        })?,
        TokenPlan::Local => write_apart(out, [("x", Some(x))], |out| copy_all(x, out))?,
    }
    Ok(())
}

/// Writes the MC2 mask of this rank's prepared rows ([`mc2_mask`](super::mc2_mask)) into
/// `mask`, a 1-D `bool` or `u8` tensor of exactly that many entries on any
/// device (for example the engine's own mask buffer, vLLM-Ascend's
/// `_EXTRA_CTX.mc2_mask` sliced to this TP rank), 1 = real token. Returns
/// `false` and leaves `mask` untouched for comm types without a mask. On an
/// NPU the mask is one host-to-device row copy enqueued on the stream of
/// `mask`'s device: no synchronisation, capturable (its values are shapes of
/// the context, known on the host).
pub fn mc2_mask_into(comm: CommType, ctx: &MoeContext, mask: &mut Tensor) -> Result<bool> {
    let Some((n, real)) = check_mc2_mask(comm, ctx, mask)? else {
        return Ok(false);
    };
    if n == 0 {
        return Ok(true);
    }
    // One byte per entry, bool or u8 alike: 1 for the real rows, then 0.
    let mut host = Tensor::try_zeros_cpu(&[n], mask.dtype())?;
    host.cpu_bytes_mut()?[..real].fill(1);
    let device = mask.device();
    let backend = device.backend();
    let staged = backend.scratch_from_host(&host)?;
    backend.copy_rows(&staged, 0, mask, 0, n)?;
    Ok(true)
}

/// Checks `mask` as [`mc2_mask_into`] takes it: a 1-D `bool` or `u8` tensor
/// of this rank's prepared rows. Returns the extent of the mask (rows, real
/// rows), `None` for comm types without one (any `mask` then).
fn check_mc2_mask(comm: CommType, ctx: &MoeContext, mask: &Tensor) -> Result<Option<(usize, usize)>> {
    const ARG: &str = "mc2_mask";
    let Some((n, real)) = mc2_mask_extent(comm, ctx) else {
        return Ok(None);
    };
    if !matches!(mask.dtype(), DType::Bool | DType::U8) {
        return Err(Error::dtype(PREPARE, ARG, "bool or u8", mask.dtype()));
    }
    if mask.shape() != [n] {
        return Err(Error::shape(PREPARE, ARG, format!("[{n}] (this rank's prepared rows)"), mask.shape()));
    }
    Ok(Some((n, real)))
}

/// Which of the two ops a rank found its arguments bad in.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Stage {
    Prepare,
    Finalize,
}

/// Reports `error`, found in this rank's own arguments (the tokens, the
/// output) before `stage` for `comm` communicated, to the peers through the
/// collective they make first ([`Collectives::refuse_call`]): the comm-type
/// agreement (of prepare and of finalize) where the check is on, else the
/// first collective of the token plan. A CPU group then fails on every rank
/// at once, naming this rank's argument, instead of its peers waiting out
/// the timeout. The error is returned as it is where nobody waits for this
/// rank or it cannot tell where they wait: a plan in which the peers move no
/// row (an MC2 or ALLTOALL prepare without the check, a local finalize), or,
/// outside the agreement, groups that do not match the context.
pub(crate) fn refuse_first(
    stage: Stage,
    comm: CommType,
    ctx: &MoeContext,
    groups: &MoeGroups,
    dtype: DType,
    error: Error,
) -> Error {
    let prepare = stage == Stage::Prepare;
    let (gather, reduce) = (Call::AllGather, Call::ReduceScatter(ReduceOp::Sum));
    // The agreement is over the EP group whatever the context says (a stale
    // context is one of the errors reported here); the plan's groups are
    // the context's.
    if comm_type_check_enabled(&groups.ep) {
        return refuse_unread(groups, dtype, error);
    }
    let first = if check_groups(PREPARE, ctx, groups).is_err() {
        None
    } else {
        match token_plan(comm, ctx) {
            TokenPlan::SpGather(_) => Some((&groups.ep, if prepare { gather } else { reduce })),
            TokenPlan::DpGather { .. } if prepare => Some((&groups.dp, gather)),
            // Finalize reduce-scatters over PCP first, where there is one.
            TokenPlan::DpGather { .. } => Some((groups.pcp.as_ref().unwrap_or(&groups.dp), reduce)),
            TokenPlan::TpSplit { .. } if !prepare => Some((&groups.tp, gather)),
            TokenPlan::TpSplit { .. } | TokenPlan::Local => None,
        }
    };
    match first {
        Some((group, call)) => group.refuse_call(call, dtype, error),
        None => error,
    }
}

/// [`refuse_first`] for a prepare or finalize whose comm type or context this
/// rank could not read (an unknown comm type, a NULL or malformed context):
/// the peers' first collective is the comm-type agreement over the EP group
/// where that check is on, whatever their plan; elsewhere it cannot be told,
/// and `error` is returned as it is.
pub(crate) fn refuse_unread(groups: &MoeGroups, dtype: DType, error: Error) -> Error {
    if comm_type_check_enabled(&groups.ep) {
        groups.ep.refuse_call(Call::AllGather, dtype, error)
    } else {
        error
    }
}

/// Where the check is on ([`comm_type_check_enabled`]), every EP rank
/// learns every other rank's comm type before finalize moves a row, as in
/// [`prepare`]: ranks that finalize with different comm types (SPEC
/// section 5) all fail naming the choices, instead of one returning from a
/// path its peers never join (a local copy, a DP group of one) while they
/// wait in another, or two paths that take the same rows both returning.
fn agree_before_finalize(y: &Tensor, comm: CommType, ctx: &MoeContext, groups: &MoeGroups) -> Result<()> {
    if comm_type_check_enabled(&groups.ep) {
        comm_type_agreement(FINALIZE, "EP", comm, Some(context_facts(ctx, "y", y)), &groups.ep, &y.device())?;
    }
    Ok(())
}

/// `rows` rows like `y`'s for a DP-gather finalize, or an error of memory
/// this rank cannot have that fails its peers in the reduce-scatter they go
/// on to (PCP's, where there is one, else DP's) at once.
fn dp_gather_scratch(y: &Tensor, rows: usize, groups: &MoeGroups) -> Result<Tensor> {
    let shape = with_rows(FINALIZE, "y", y.shape(), rows)?;
    let first = groups.pcp.as_ref().unwrap_or(&groups.dp);
    y.device()
        .backend()
        .scratch(&shape, y.dtype())
        .map_err(|e| first.refuse_call(Call::ReduceScatter(ReduceOp::Sum), y.dtype(), e))
}

/// The row counts, in elements, of a TP-split finalize's gather of `sizes`
/// rows like `y`'s; `None` when every rank has as many (a plain all-gather).
fn tp_counts(y: &Tensor, sizes: &[usize]) -> Option<Vec<usize>> {
    let uniform = sizes.iter().all(|s| *s == sizes[0]);
    (!uniform).then(|| sizes.iter().map(|s| s * y.row_len()).collect())
}

/// The `padded` rows a TP-split finalize gathers into, or an error of
/// memory this rank cannot have that fails its TP peers in that gather.
fn tp_split_scratch(y: &Tensor, padded: usize, sizes: &[usize], groups: &MoeGroups) -> Result<Tensor> {
    let shape = with_rows(FINALIZE, "y", y.shape(), padded)?;
    y.device().backend().scratch(&shape, y.dtype()).map_err(|e| {
        let counts = tp_counts(y, sizes);
        let call = counts.as_deref().map_or(Call::AllGather, Call::AllGatherV);
        groups.tp.refuse_call(call, y.dtype(), e)
    })
}

/// A TP-split finalize's gather of every TP rank's rows of `y` into `full`.
fn tp_gather(y: &Tensor, full: &mut Tensor, sizes: &[usize], groups: &MoeGroups) -> Result<()> {
    match tp_counts(y, sizes) {
        None => groups.tp.all_gather(y, full),
        Some(counts) => groups.tp.all_gather_v(y, full, &counts),
    }
}

/// Copies every row of `src` into `dst` (same shape).
fn copy_all(src: &Tensor, dst: &mut Tensor) -> Result<()> {
    if src.numel() > 0 {
        src.device().backend().copy_rows(src, 0, dst, 0, src.rows())?;
    }
    Ok(())
}

/// Finalize for `comm` (SPEC section 6): the routed output of the prepared
/// rows back to this rank's `ctx.local_tokens()` rows, in a fresh buffer (or
/// `y` itself where the path is the identity).
pub fn finalize(y: Tensor, comm: CommType, ctx: &MoeContext, groups: &MoeGroups) -> Result<Tensor> {
    let shape = finalize_shape_and_dtype(y.shape(), y.dtype(), comm, ctx)
        .and_then(|shape| check_groups(FINALIZE, ctx, groups).map(|_| shape))
        .map_err(|e| refuse_first(Stage::Finalize, comm, ctx, groups, y.dtype(), e))?;
    agree_before_finalize(&y, comm, ctx, groups)?;
    let device = y.device();
    let backend = device.backend();
    let keep = |full: Tensor| -> Result<Tensor> {
        if full.rows() == shape[0] {
            return Ok(full);
        }
        let mut out = backend.scratch(&shape, full.dtype())?;
        if shape[0] > 0 {
            backend.copy_rows(&full, 0, &mut out, 0, shape[0])?;
        }
        Ok(out)
    };
    match token_plan(comm, ctx) {
        TokenPlan::SpGather(l) => maybe_pad_and_reduce(&y, Some(&l), &groups.ep),
        TokenPlan::DpGather { max_tokens } => {
            let scratch = |rows| dp_gather_scratch(&y, rows, groups);
            let mut slot = scratch(max_tokens)?;
            if slot.numel() > 0 || joins_empty(&groups.dp) {
                match &groups.pcp {
                    // vLLM-Ascend (`prepare_finalize.py`, `_finalize_with_dp_group`):
                    // the PCP reduce-scatter to the DP-gathered rows recorded at
                    // prepare, then the DP reduce-scatter to `max_d T_d`.
                    Some(pcp) => {
                        let mut dp_in = scratch(max_tokens * ctx.dp_size())?;
                        pcp.reduce_scatter(&y, &mut dp_in, ReduceOp::Sum)?;
                        groups.dp.reduce_scatter(&dp_in, &mut slot, ReduceOp::Sum)?;
                    }
                    None => groups.dp.reduce_scatter(&y, &mut slot, ReduceOp::Sum)?,
                }
            }
            keep(slot)
        }
        TokenPlan::TpSplit { padded, sizes } => {
            let mut full = tp_split_scratch(&y, padded, &sizes, groups)?;
            if full.numel() > 0 || joins_empty(&groups.tp) {
                tp_gather(&y, &mut full, &sizes, groups)?;
            }
            keep(full)
        }
        TokenPlan::Local => Ok(y),
    }
}

/// [`finalize`] into `out` (`finalize_output_shape` rows, dtype and device of
/// `y`; an error naming `out` otherwise), without consuming `y`: the last
/// collective or copy of the path writes `out`. `out` may share `y`'s memory
/// (then `y` is read from a copy in workspace).
pub fn finalize_into(y: &Tensor, comm: CommType, ctx: &MoeContext, groups: &MoeGroups, out: &mut Tensor) -> Result<()> {
    let shape = finalize_shape_and_dtype(y.shape(), y.dtype(), comm, ctx)
        .and_then(|shape| check_out_like(FINALIZE, y, out, &shape).map(|_| shape))
        .and_then(|shape| check_groups(FINALIZE, ctx, groups).map(|_| shape))
        .map_err(|e| refuse_first(Stage::Finalize, comm, ctx, groups, y.dtype(), e))?;
    let device = y.device();
    let backend = device.backend();
    // `out` is (part of) `y`'s memory: `y` is read from a copy in the
    // stream's workspace, so no collective reads what it writes.
    let copy = crate::moe::output::read_apart(y, out)
        .map_err(|e| refuse_first(Stage::Finalize, comm, ctx, groups, y.dtype(), e))?;
    if let Some(copy) = copy {
        return finalize_into(&copy, comm, ctx, groups, out);
    }
    agree_before_finalize(y, comm, ctx, groups)?;
    // The first `out.rows()` rows of `full` into `out`.
    let keep = |full: &Tensor, out: &mut Tensor| -> Result<()> {
        if out.numel() > 0 {
            backend.copy_rows(full, 0, out, 0, out.rows())?;
        }
        Ok(())
    };
    match token_plan(comm, ctx) {
        TokenPlan::SpGather(l) => maybe_pad_and_reduce_into(y, Some(&l), &groups.ep, out),
        TokenPlan::DpGather { max_tokens } => {
            let scratch = |rows| dp_gather_scratch(y, rows, groups);
            let direct = max_tokens == shape[0];
            let mut slot = if direct { None } else { Some(scratch(max_tokens)?) };
            let target = match slot.as_mut() {
                Some(s) => s,
                None => &mut *out,
            };
            if target.numel() > 0 || joins_empty(&groups.dp) {
                match &groups.pcp {
                    // vLLM-Ascend (`prepare_finalize.py`, `_finalize_with_dp_group`):
                    // the PCP reduce-scatter to the DP-gathered rows recorded at
                    // prepare, then the DP reduce-scatter to `max_d T_d`.
                    Some(pcp) => {
                        let mut dp_in = scratch(max_tokens * ctx.dp_size())?;
                        pcp.reduce_scatter(y, &mut dp_in, ReduceOp::Sum)?;
                        groups.dp.reduce_scatter(&dp_in, target, ReduceOp::Sum)?;
                    }
                    None => groups.dp.reduce_scatter(y, target, ReduceOp::Sum)?,
                }
            }
            match &slot {
                Some(s) => keep(s, out),
                None => Ok(()),
            }
        }
        TokenPlan::TpSplit { padded, sizes } => {
            let direct = padded == shape[0];
            let mut full = if direct { None } else { Some(tp_split_scratch(y, padded, &sizes, groups)?) };
            let target = match full.as_mut() {
                Some(f) => f,
                None => &mut *out,
            };
            if target.numel() > 0 || joins_empty(&groups.tp) {
                tp_gather(y, target, &sizes, groups)?;
            }
            match &full {
                Some(f) => keep(f, out),
                None => Ok(()),
            }
        }
        TokenPlan::Local => copy_all(y, out),
    }
}
