//! The shared-expert token helpers of the two shared-expert layouts that move
//! tokens over the TP group (SPEC section 5).
//!
//! vLLM-Ascend (`ops/fused_moe/shared_experts.py`, `SharedExperts.parallel_mode`
//! and its `_prepare_*` / `_finalize_*` helpers) runs a shared expert with TP
//! size > 1 in one of two token layouts:
//!
//! * **DP-only** (replicated weights, full activations): each TP rank pads the
//!   DP batch to a multiple of TP with zero rows, keeps its equal part
//!   ([`shared_pad_split`]), runs the MLP on it, and the parts are TP
//!   all-gathered and the padding dropped ([`shared_gather_unpad`]).
//! * **SP-only** (TP-sharded weights, sequence-sharded activations): each TP
//!   rank TP all-gathers the sequence shards and drops the padding
//!   ([`shared_gather_unpad`]), runs its weight shard on the whole batch (a
//!   TP-partial sum), then pads back to a multiple of TP and reduce-scatters
//!   ([`shared_pad_reduce_scatter`]): each rank ends with its complete shard.
//!
//! Every TP rank of a DP rank holds `ceil(T / TP)` rows in the sharded form
//! (`T` = tokens of the DP rank), which is the SP layout of section 2.
//! Each op sizes its output with its `*_output_shape` function; its `_into`
//! twin writes the result into a caller's tensor of that shape instead.

use crate::backend::args::with_rows;
use crate::backend::Call;
use crate::comm::{joins_empty, Collectives, ReduceOp};
use crate::moe::finalize::check_out_like;
use crate::moe::output::read_apart;
use crate::moe::pad_reduce::{fingerprint, layout_check_enabled, Disagreement};
use crate::{CommErrorKind, Device, Error, Result, Tensor};

const PAD_SPLIT: &str = "shared_pad_split";
const GATHER_UNPAD: &str = "shared_gather_unpad";
const PAD_REDUCE_SCATTER: &str = "shared_pad_reduce_scatter";
/// The collective of [`shared_pad_reduce_scatter`].
const REDUCE_SCATTER: Call<'static> = Call::ReduceScatter(ReduceOp::Sum);

fn check_tp(op: &'static str, tp_rank: usize, tp_size: usize) -> Result<()> {
    if tp_size == 0 || tp_rank >= tp_size {
        return Err(Error::invalid(op, "tp", format!("rank {tp_rank} is not a rank of a TP group of {tp_size}")));
    }
    Ok(())
}

fn rows_of(op: &'static str, arg: &'static str, shape: &[usize]) -> Result<usize> {
    shape.first().copied().ok_or_else(|| Error::shape(op, arg, "[rows, H...] (at least 1-D)", shape))
}

/// Rows of `tp_size` parts of `part_rows` rows each (what the TP all-gather
/// of `op` moves), or an error naming `x` (of `x_shape`) when they do not fit
/// in usize.
fn all_parts(op: &'static str, x_shape: &[usize], part_rows: usize, tp_size: usize) -> Result<usize> {
    part_rows.checked_mul(tp_size).ok_or_else(|| {
        Error::shape(
            op,
            "x",
            format!("{part_rows} rows per TP rank that times the TP size {tp_size} fit in usize"),
            x_shape,
        )
    })
}

/// On a CPU group, how many of the `tokens` rows each TP rank's part of
/// `part` rows holds (the rest is padding), for the V collectives, which
/// compare every rank's counts: ranks that disagree on the token count fail
/// together naming each rank's counts, also where their parts have the same
/// size. `None` elsewhere: HCCL compares no counts ([`tokens_agree`]).
fn cpu_token_rows(device: &Device, tokens: usize, part: usize, tp_size: usize) -> Option<Vec<usize>> {
    // r * part <= (tp_size - 1) * part, which `all_parts` found to fit.
    matches!(device, Device::Cpu).then(|| (0..tp_size).map(|r| tokens.saturating_sub(r * part).min(part)).collect())
}

/// A CPU group's count mismatch in the V collective of `op`, told in its
/// terms: the counts are each TP rank's rows of real tokens times the row
/// length, so the ranks passed different token counts (`arg`). Ranks whose
/// counts agree but whose rows differ in shape are told so, naming `x`.
fn in_tokens(op: &'static str, arg: &str, e: Error) -> Error {
    match e {
        Error::Comm { collective, group, rank, world, detail, kind: CommErrorKind::Mismatch }
            if counts_differ(&detail) =>
        {
            let detail = format!(
                "{detail}; where every rank called {op}, the counts are each TP rank's rows of real tokens \
                 times the row length, so the TP ranks passed different token counts (`{arg}`; a stale one on a \
                 rank)"
            );
            Error::Comm { collective, group, rank, world, detail, kind: CommErrorKind::Mismatch }
        }
        e => crate::comm::moving(op, "x")(e),
    }
}

/// Whether the ranks described in a collective's mismatch `detail` called
/// it with different counts (each rank's `counts [..]`).
fn counts_differ(detail: &str) -> bool {
    let counts: Vec<&str> = detail
        .match_indices(" counts [")
        .map(|(i, _)| {
            let rest = &detail[i..];
            &rest[..rest.find(']').map_or(rest.len(), |j| j + 1)]
        })
        .collect();
    counts.windows(2).any(|w| w[0] != w[1])
}

/// On an HCCL group with `ASCEND_MOE_CHECK_LAYOUT=1`, as for the SP ops:
/// every TP rank passed the same token count (`arg` of `op`), compared on
/// the device ([`crate::comm::expect_group_agrees`]; no host sync,
/// capturable), so that ranks that disagree fail their stream check instead
/// of moving misaligned rows of parts of equal size.
fn tokens_agree<C: Collectives + ?Sized>(
    op: &'static str,
    arg: &'static str,
    device: &Device,
    tokens: usize,
    tp: &C,
) -> Result<()> {
    if tp.world_size() <= 1 || !layout_check_enabled(device) {
        return Ok(());
    }
    let mine = fingerprint(&[tokens]);
    let what = Disagreement { op, arg, ranks: "TP", on: "token count" };
    crate::comm::expect_group_agrees(tp, device, mine, what.mismatch(tp, mine, format!("{tokens} tokens have")))
}

/// Shape function of [`shared_pad_split`]: `x [T, H...]` -> `[ceil(T / tp_size), H...]`.
pub fn shared_pad_split_output_shape(x_shape: &[usize], tp_rank: usize, tp_size: usize) -> Result<Vec<usize>> {
    check_tp(PAD_SPLIT, tp_rank, tp_size)?;
    let t = rows_of(PAD_SPLIT, "x", x_shape)?;
    with_rows(PAD_SPLIT, "x", x_shape, t.div_ceil(tp_size))
}

/// DP-only prepare: zero-pads `x` (`[T, H...]`, the DP batch) to a multiple of
/// the TP size and returns this TP rank's equal part, rows
/// `[r * ceil(T/TP), (r + 1) * ceil(T/TP))` (padding rows are zeros). Local:
/// `tp` gives only this rank's place in the TP group.
pub fn shared_pad_split<C: Collectives + ?Sized>(x: &Tensor, tp: &C) -> Result<Tensor> {
    let shape = shared_pad_split_output_shape(x.shape(), tp.rank(), tp.world_size())?;
    let mut out = x.device().backend().scratch(&shape, x.dtype())?;
    shared_pad_split_into(x, tp, &mut out)?;
    Ok(out)
}

/// [`shared_pad_split`] into `out`, which must have the shape of
/// [`shared_pad_split_output_shape`] and the dtype of `x`, on the device of
/// `x`; `out` may cover `x` (then read from a copy in
/// workspace). Every element of `out` is written: this
/// rank's rows of `x` are copied in and the padding rows set to zero.
pub fn shared_pad_split_into<C: Collectives + ?Sized>(x: &Tensor, tp: &C, out: &mut Tensor) -> Result<()> {
    // `out` may cover `x`: `x` is then read from a copy in workspace.
    let copy = read_apart(x, out)?;
    let x = copy.as_ref().unwrap_or(x);
    let shape = shared_pad_split_output_shape(x.shape(), tp.rank(), tp.world_size())?;
    let device = check_out_like(PAD_SPLIT, x, out, &shape)?;
    let backend = device.backend();
    let first = tp.rank() * shape[0];
    let real = x.rows().saturating_sub(first).min(shape[0]);
    if real > 0 {
        backend.copy_rows(x, first, out, 0, real)?;
    }
    let pad = shape[0] - real;
    if pad > 0 && out.numel() > 0 {
        let zeros = backend.scratch(&with_rows(PAD_SPLIT, "x", x.shape(), pad)?, x.dtype())?;
        backend.copy_rows(&zeros, 0, out, real, pad)?;
    }
    Ok(())
}

/// Shape function of [`shared_gather_unpad`]: `x` must have
/// `ceil(num_tokens / tp_size)` rows; the output has `num_tokens`.
pub fn shared_gather_unpad_output_shape(x_shape: &[usize], num_tokens: usize, tp_size: usize) -> Result<Vec<usize>> {
    check_tp(GATHER_UNPAD, 0, tp_size)?;
    let rows = rows_of(GATHER_UNPAD, "x", x_shape)?;
    let part = num_tokens.div_ceil(tp_size);
    all_parts(GATHER_UNPAD, x_shape, part, tp_size)?;
    if rows != part {
        return Err(Error::shape(
            GATHER_UNPAD,
            "x",
            format!("{part} rows (ceil({num_tokens} tokens / TP {tp_size}))"),
            x_shape,
        ));
    }
    with_rows(GATHER_UNPAD, "x", x_shape, num_tokens)
}

/// DP-only finalize and SP-only prepare: TP all-gathers every rank's
/// `ceil(num_tokens / TP)` rows and keeps the first `num_tokens` (drops the
/// padding). Collective over `tp`; every rank passes the same `num_tokens`:
/// on a CPU group ranks that pass different ones fail together (each sends its real
/// rows, and the all-gather compares every rank's counts; with rows of no
/// elements nothing is compared, nor moved), and on an HCCL
/// group with `ASCEND_MOE_CHECK_LAYOUT=1` their stream check fails.
pub fn shared_gather_unpad<C: Collectives + ?Sized>(x: &Tensor, num_tokens: usize, tp: &C) -> Result<Tensor> {
    let mut out = shared_gather_unpad_output_shape(x.shape(), num_tokens, tp.world_size())
        .and_then(|shape| x.device().backend().scratch(&shape, x.dtype()))
        .map_err(|e| tp.refuse_call(Call::AllGather, x.dtype(), e))?;
    shared_gather_unpad_into(x, num_tokens, tp, &mut out)?;
    Ok(out)
}

/// [`shared_gather_unpad`] into `out`, which must have the shape of
/// [`shared_gather_unpad_output_shape`] and the dtype of `x`, on the device of
/// `x`; `out` may cover `x` (then read from a copy in
/// workspace). Every element of `out` is written; the
/// all-gather writes `out` directly when there is no padding to drop, and
/// always on a CPU group, which gathers the real rows only.
pub fn shared_gather_unpad_into<C: Collectives + ?Sized>(
    x: &Tensor,
    num_tokens: usize,
    tp: &C,
    out: &mut Tensor,
) -> Result<()> {
    // `out` may cover `x`: `x` is then read from a copy in workspace.
    let refuse = |e| tp.refuse_call(Call::AllGather, x.dtype(), e);
    let copy = read_apart(x, out).map_err(refuse)?;
    let x = copy.as_ref().unwrap_or(x);
    let checked = shared_gather_unpad_output_shape(x.shape(), num_tokens, tp.world_size()).and_then(|shape| {
        let device = check_out_like(GATHER_UNPAD, x, out, &shape)?;
        let gathered = all_parts(GATHER_UNPAD, x.shape(), x.rows(), tp.world_size())?;
        Ok((device, with_rows(GATHER_UNPAD, "x", x.shape(), gathered)?))
    });
    // A rank's own bad argument (or memory it cannot have) fails its peers
    // in the all-gather at once.
    let (device, full_shape) = checked.map_err(refuse)?;
    let backend = device.backend();
    if let Some(rows) = cpu_token_rows(&device, num_tokens, x.rows(), tp.world_size()) {
        // Each rank sends its real rows only, straight into `out`.
        let counts: Vec<usize> = rows.iter().map(|&r| r * x.row_len()).collect();
        let own = rows[tp.rank()];
        if own == x.rows() {
            return tp.all_gather_v(x, out, &counts).map_err(|e| in_tokens(GATHER_UNPAD, "num_tokens", e));
        }
        let head = with_rows(GATHER_UNPAD, "x", x.shape(), own)
            .and_then(|shape| backend.scratch(&shape, x.dtype()))
            .and_then(|mut head| {
                if own > 0 {
                    backend.copy_rows(x, 0, &mut head, 0, own)?;
                }
                Ok(head)
            })
            .map_err(refuse)?;
        return tp.all_gather_v(&head, out, &counts).map_err(|e| in_tokens(GATHER_UNPAD, "num_tokens", e));
    }
    tokens_agree(GATHER_UNPAD, "num_tokens", &device, num_tokens, tp)?;
    if full_shape[0] == num_tokens {
        if out.numel() > 0 || joins_empty(tp) {
            tp.all_gather(x, out)?;
        }
        return Ok(());
    }
    let mut full = backend.scratch(&full_shape, x.dtype()).map_err(refuse)?;
    if full.numel() > 0 || joins_empty(tp) {
        tp.all_gather(x, &mut full)?;
    }
    if num_tokens > 0 {
        backend.copy_rows(&full, 0, out, 0, num_tokens)?;
    }
    Ok(())
}

/// Shape function of [`shared_pad_reduce_scatter`]: `x [T, H...]` ->
/// `[ceil(T / tp_size), H...]`.
pub fn shared_pad_reduce_scatter_output_shape(x_shape: &[usize], tp_size: usize) -> Result<Vec<usize>> {
    check_tp(PAD_REDUCE_SCATTER, 0, tp_size)?;
    let t = rows_of(PAD_REDUCE_SCATTER, "x", x_shape)?;
    with_rows(PAD_REDUCE_SCATTER, "x", x_shape, t.div_ceil(tp_size))
}

/// SP-only finalize: zero-pads the TP-partial `x` (`[T, H...]`) to a multiple
/// of the TP size and reduce-scatters (sum) it over `tp`: this rank's complete
/// `ceil(T / TP)` rows. Collective over `tp`; every rank passes the same `T`:
/// on a CPU group ranks that pass different ones fail together (each block is reduced
/// over its real rows only, and the reduce-scatter compares every rank's
/// counts; with rows of no elements nothing is compared, nor moved), and on
/// an HCCL group with `ASCEND_MOE_CHECK_LAYOUT=1` their
/// stream check fails.
pub fn shared_pad_reduce_scatter<C: Collectives + ?Sized>(x: &Tensor, tp: &C) -> Result<Tensor> {
    let mut out = shared_pad_reduce_scatter_output_shape(x.shape(), tp.world_size())
        .and_then(|shape| x.device().backend().scratch(&shape, x.dtype()))
        .map_err(|e| tp.refuse_call(REDUCE_SCATTER, x.dtype(), e))?;
    shared_pad_reduce_scatter_into(x, tp, &mut out)?;
    Ok(out)
}

/// [`shared_pad_reduce_scatter`] into `out`, which must have the shape of
/// [`shared_pad_reduce_scatter_output_shape`] and the dtype of `x`, on the
/// device of `x`; `out` may cover `x` (then read from a copy in
/// workspace). Every element of `out` is written: by the reduce-scatter
/// directly, except on a CPU group for a rank whose part has padding rows
/// (its real rows are reduced into workspace and copied, the rest set to
/// zero).
pub fn shared_pad_reduce_scatter_into<C: Collectives + ?Sized>(x: &Tensor, tp: &C, out: &mut Tensor) -> Result<()> {
    // `out` may cover `x`: `x` is then read from a copy in workspace.
    let refuse = |e| tp.refuse_call(REDUCE_SCATTER, x.dtype(), e);
    let copy = read_apart(x, out).map_err(refuse)?;
    let x = copy.as_ref().unwrap_or(x);
    let checked = shared_pad_reduce_scatter_output_shape(x.shape(), tp.world_size())
        .and_then(|shape| Ok((check_out_like(PAD_REDUCE_SCATTER, x, out, &shape)?, shape)));
    // A rank's own bad argument (or memory it cannot have) fails its peers
    // in the reduce-scatter at once.
    let (device, shape) = checked.map_err(refuse)?;
    let backend = device.backend();
    let part = shape[0];
    if let Some(rows) = cpu_token_rows(&device, x.rows(), part, tp.world_size()) {
        // Each rank's block is its real rows only; its padding rows are zeros.
        let counts: Vec<usize> = rows.iter().map(|&r| r * x.row_len()).collect();
        let own = rows[tp.rank()];
        if own == part {
            return tp
                .reduce_scatter_v(x, out, &counts, ReduceOp::Sum)
                .map_err(|e| in_tokens(PAD_REDUCE_SCATTER, "x", e));
        }
        let block = with_rows(PAD_REDUCE_SCATTER, "x", x.shape(), own).map_err(refuse)?;
        let pad = with_rows(PAD_REDUCE_SCATTER, "x", x.shape(), part - own).map_err(refuse)?;
        let mut head = backend.scratch(&block, x.dtype()).map_err(refuse)?;
        let zeros = backend.scratch(&pad, x.dtype()).map_err(refuse)?;
        tp.reduce_scatter_v(x, &mut head, &counts, ReduceOp::Sum).map_err(|e| in_tokens(PAD_REDUCE_SCATTER, "x", e))?;
        if own > 0 {
            backend.copy_rows(&head, 0, out, 0, own)?;
        }
        if out.numel() > 0 {
            backend.copy_rows(&zeros, 0, out, own, part - own)?;
        }
        return Ok(());
    }
    tokens_agree(PAD_REDUCE_SCATTER, "x", &device, x.rows(), tp)?;
    let padded_rows = part * tp.world_size();
    if out.numel() == 0 && !joins_empty(tp) {
        return Ok(());
    }
    if padded_rows == x.rows() {
        tp.reduce_scatter(x, out, ReduceOp::Sum)?;
    } else {
        let padded_shape = with_rows(PAD_REDUCE_SCATTER, "x", x.shape(), padded_rows)?;
        let mut padded = backend.scratch(&padded_shape, x.dtype()).map_err(refuse)?;
        if x.rows() > 0 {
            backend.copy_rows(x, 0, &mut padded, 0, x.rows())?;
        }
        tp.reduce_scatter(&padded, out, ReduceOp::Sum)?;
    }
    Ok(())
}
