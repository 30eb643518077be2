//! The EP/SP finalize and prepare (SPEC sections 3 and 4), and the fused
//! finalize-and-reduce.
//!
//! * [`maybe_pad_and_reduce`]: `[sum(local_sizes), H...]` partials on every EP
//!   rank -> the fully reduced local shard `[local_sizes[rank], H...]`.
//! * [`maybe_all_gather_and_maybe_unpad`]: the local shard -> all gathered rows.
//! * [`finalize_and_reduce`]: the finalize op writes straight into the padded
//!   EP buffer, which is reduce-scattered from there.
//!
//! None of them has a TP all-reduce path: the output rows always equal the
//! shape function's, whatever the caller's model. Padding rows are zeros.

use crate::backend::args::with_rows;
use crate::backend::{Call, FinalizeArgs};
use crate::comm::{joins_empty, moving, Collectives, ReduceOp};
use crate::moe::finalize::{check_out, moe_finalize_routing_output_shape, moe_finalize_routing_shape, FinalizeMeta};
use crate::moe::layout::SpLayout;
use crate::moe::output::{read_apart, write_apart};
use crate::{Device, Error, Result, Tensor};

const PAD_REDUCE: &str = "maybe_pad_and_reduce";
const GATHER_UNPAD: &str = "maybe_all_gather_and_maybe_unpad";
const FINALIZE_REDUCE: &str = "finalize_and_reduce";

fn check_rank(op: &'static str, ep_rank: usize, ep_size: usize) -> Result<()> {
    if ep_size == 0 || ep_rank >= ep_size {
        return Err(Error::invalid(op, "ep_rank", format!("{ep_rank} is not a rank of an EP group of {ep_size}")));
    }
    Ok(())
}

/// The layout a reduce over `rows` gathered rows uses: the given one (checked
/// against the EP size and the row count), or without one the plain
/// reduce-scatter layout (`rows / ep_size` each; rows must divide).
fn reduce_layout(op: &'static str, rows: usize, layout: Option<&SpLayout>, ep_size: usize) -> Result<SpLayout> {
    match layout {
        Some(l) => {
            l.check_ep_size(op, ep_size)?;
            if l.total_rows() != rows {
                return Err(Error::invalid(
                    op,
                    "x",
                    format!(
                        "has {rows} rows, expected sum(local_sizes) = {} for layout {:?}",
                        l.total_rows(),
                        l.local_sizes()
                    ),
                ));
            }
            Ok(l.clone())
        }
        None => {
            if rows % ep_size != 0 {
                return Err(Error::invalid(
                    op,
                    "x",
                    format!("has {rows} rows, which the EP size {ep_size} does not divide (pass a layout for uneven shards)"),
                ));
            }
            SpLayout::uniform(ep_size, rows / ep_size)
        }
    }
}

/// Shape function of [`maybe_pad_and_reduce`]: `[local_sizes[ep_rank], H...]`
/// (or `[rows / ep_size, H...]` without a layout).
pub fn maybe_pad_and_reduce_output_shape(
    x_shape: &[usize],
    layout: Option<&SpLayout>,
    ep_rank: usize,
    ep_size: usize,
) -> Result<Vec<usize>> {
    check_rank(PAD_REDUCE, ep_rank, ep_size)?;
    if x_shape.is_empty() {
        return Err(Error::shape(PAD_REDUCE, "x", "[rows, H...] (at least 1-D)", x_shape));
    }
    let l = reduce_layout(PAD_REDUCE, x_shape[0], layout, ep_size)?;
    with_rows(PAD_REDUCE, "x", x_shape, l.local_size(ep_rank))
}

fn check_device<C: Collectives + ?Sized>(op: &'static str, arg: &'static str, t: &Tensor, ep: &C) -> Result<Device> {
    let d = t.device();
    let want = ep.device();
    if d != want {
        return Err(Error::Device {
            op,
            arg,
            expected: format!("{want} (the EP group's device)"),
            actual: d.to_string(),
        });
    }
    Ok(d)
}

/// Checks the input `x` (named `arg`) and `out` are on the EP group's device
/// and `out` has `out_shape` and the dtype of `x`; returns the device.
fn check_in_out<C: Collectives + ?Sized>(
    op: &'static str,
    arg: &'static str,
    x: &Tensor,
    out: &Tensor,
    out_shape: &[usize],
    ep: &C,
) -> Result<Device> {
    let device = check_device(op, arg, x, ep)?;
    check_device(op, "out", out, ep)?;
    check_out(op, out, out_shape, x.dtype())?;
    Ok(device)
}

/// The collective [`maybe_pad_and_reduce`] makes.
const PAD_REDUCE_CALL: Call<'static> = Call::ReduceScatter(ReduceOp::Sum);

/// The dtypes [`maybe_pad_and_reduce`] takes: those its reduce-scatter sums
/// (f32, f16, bf16, i32, i64), never a one-byte dtype, which is only moved
/// (SPEC section 8). Its shape function in the C ABI refuses the same, so a
/// traced graph fails where the op would.
pub fn maybe_pad_and_reduce_dtype(dtype: crate::DType) -> Result<()> {
    crate::comm::reducible(PAD_REDUCE, "x", PAD_REDUCE_CALL, dtype)
}

/// An allocating SP op: its output shape (from `shape`), then an output
/// tensor of that shape and the dtype of `x` on the EP group's device, which
/// `into` writes and which is returned. A failure before `into` is reported
/// through `call` ([`Collectives::refuse_call`]): a CPU group joins it
/// without data, so every rank fails at once naming this rank's reason
/// instead of waiting for it until the group's timeout; an HCCL group
/// returns the error as it is.
fn with_output<C: Collectives + ?Sized>(
    op: &'static str,
    call: Call<'_>,
    x: &Tensor,
    ep: &C,
    shape: impl FnOnce() -> Result<Vec<usize>>,
    into: impl FnOnce(&mut Tensor) -> Result<()>,
) -> Result<Tensor> {
    let mut out = shape()
        .and_then(|shape| check_device(op, "x", x, ep)?.backend().output(&shape, x.dtype()))
        .map_err(|e| ep.refuse_call(call, x.dtype(), e))?;
    into(&mut out)?;
    Ok(out)
}

/// On a CPU group given a layout, the element counts of its blocks
/// (`row_len` elements a row): the counts of the V collective that moves the
/// blocks as they are. Rank `r` receives the same rows as from its padded
/// slot, without the padded copy, and the group compares every rank's counts
/// before any data moves, so ranks whose layouts disagree (a stale token
/// count on one of them) all fail, naming each rank's counts, instead of
/// summing or gathering misaligned rows. Every rank joins, also when no rank
/// has a row, so that a rank that disagrees there, or fails its own
/// arguments, fails its peers too. An HCCL group compares no counts, and
/// moves the padded buffer as SPEC sections 3 and 4 describe.
fn cpu_block_counts(device: &Device, layout: Option<&SpLayout>, row_len: usize) -> Option<Vec<usize>> {
    if !matches!(device, Device::Cpu) {
        return None;
    }
    Some(layout?.local_sizes().iter().map(|&rows| rows * row_len).collect())
}

/// Whether the SP ops compare their layout, and the shared-expert helpers
/// their token counts, across an HCCL group: `ASCEND_MOE_CHECK_LAYOUT=1`. HCCL compares no counts, so without it ranks
/// whose layouts disagree but share `M` (a stale token count on one of them)
/// reduce or gather misaligned rows, as vLLM-Ascend's ops do. A CPU group
/// needs no check: its V collectives compare every rank's counts
/// ([`cpu_block_counts`]).
pub(crate) fn layout_check_enabled(device: &Device) -> bool {
    !matches!(device, Device::Cpu) && crate::types::env_switch("ASCEND_MOE_CHECK_LAYOUT") == Some(true)
}

/// The SP layout check of an op on `device` ([`layout_check_enabled`]).
fn layout_agrees<C: Collectives + ?Sized>(device: &Device, layout: Option<&SpLayout>, ep: &C) -> Result<()> {
    match layout {
        Some(l) if layout_check_enabled(device) => layout_agreement(l, ep, device),
        _ => Ok(()),
    }
}

/// Checks that every rank of `ep` holds `layout`: one all-gather of a 32-bit
/// fingerprint of its `local_sizes` per rank, compared with this rank's
/// ([`crate::backend::Backend::expect_all_equal`]). On the CPU every rank fails at
/// once naming each rank's fingerprint; on an NPU the fingerprints are
/// compared on the device (one small collective, a staged copy and a guard
/// launch: no host sync, capturable) and every rank's next stream check fails
/// naming a rank whose layout differs. The SP ops run it on an HCCL group
/// with `ASCEND_MOE_CHECK_LAYOUT=1`.
pub fn check_sp_layout_agreement<C: Collectives + ?Sized>(layout: &SpLayout, ep: &C) -> Result<()> {
    layout_agreement(layout, ep, &ep.device())
}

/// [`check_sp_layout_agreement`] on `on`, the device (stream) of the op.
fn layout_agreement<C: Collectives + ?Sized>(layout: &SpLayout, ep: &C, on: &Device) -> Result<()> {
    if ep.world_size() <= 1 {
        return Ok(());
    }
    let sizes = layout.local_sizes();
    let mine = fingerprint(sizes);
    let what = Disagreement { op: "check_sp_layout_agreement", arg: "layout", ranks: "EP", on: "SP layout" };
    crate::comm::expect_group_agrees(ep, on, mine, what.mismatch(ep, mine, format!("local_sizes {sizes:?} have")))
}

/// What a fingerprint agreement over a group compares, for its error.
pub(crate) struct Disagreement {
    /// The op and argument the error names.
    pub(crate) op: &'static str,
    pub(crate) arg: &'static str,
    /// Whose ranks they are ("EP", "TP") and what they disagree on.
    pub(crate) ranks: &'static str,
    pub(crate) on: &'static str,
}

impl Disagreement {
    /// The error of a failed [`crate::comm::expect_group_agrees`] over
    /// `group` whose value on this rank is `mine`, fingerprinting what `own`
    /// says ("local_sizes [..] have"): every rank's fingerprint where they
    /// were read on the host, else the first rank that differs.
    pub(crate) fn mismatch<C: Collectives + ?Sized>(
        self,
        group: &C,
        mine: i32,
        own: String,
    ) -> crate::backend::Mismatch {
        let (name, rank) = (group.name().to_string(), group.rank());
        Box::new(move |all, first, value| {
            let theirs = match all {
                Some(all) => {
                    let each: Vec<String> =
                        all.iter().enumerate().map(|(r, v)| format!("rank {r} {v:#010x}")).collect();
                    format!("fingerprints {}", each.join(", "))
                }
                None => format!("rank {first}'s {} has fingerprint {value:#010x}", self.on),
            };
            Error::invalid(
                self.op,
                self.arg,
                format!(
                    "the {} ranks of group {name:?} disagree on the {}: {theirs}; this is rank {rank}, whose \
                     {own} fingerprint {mine:#010x} (a stale token count on a rank)",
                    self.ranks, self.on
                ),
            )
        })
    }
}

/// FNV-1a of the sizes (as 64-bit little-endian words), folded to 32 bits.
pub(crate) fn fingerprint(sizes: &[usize]) -> i32 {
    let h = sizes
        .iter()
        .flat_map(|&s| (s as u64).to_le_bytes())
        .fold(0xcbf2_9ce4_8422_2325_u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3));
    (h ^ (h >> 32)) as u32 as i32
}

/// Reduce-scatters the padded buffer `[EP * M, H...]` over `ep` and writes the
/// first `local_sizes[rank]` rows of this rank's slot into `out`: straight
/// from the collective when the slot has exactly those rows, else through a
/// scratch slot.
fn reduce_padded_into<C: Collectives + ?Sized>(
    padded: &Tensor,
    l: &SpLayout,
    ep: &C,
    out: &mut Tensor,
    device: &Device,
) -> Result<()> {
    let backend = device.backend();
    let m = l.max_rows();
    let mine = l.local_size(ep.rank());
    if padded.numel() == 0 && !joins_empty(ep) {
        // HCCL refuses empty buffers. Every rank sees the same layout, so
        // every rank skips together; `out` has no elements either. A CPU rank
        // joins with a count of 0, so a peer that has rows fails with it.
        return Ok(());
    }
    if mine == m {
        return ep.reduce_scatter(padded, out, ReduceOp::Sum);
    }
    let mut slot = backend.scratch(&with_rows(PAD_REDUCE, "x", padded.shape(), m)?, padded.dtype())?;
    ep.reduce_scatter(padded, &mut slot, ReduceOp::Sum)?;
    if mine > 0 {
        backend.copy_rows(&slot, 0, out, 0, mine)?;
    }
    Ok(())
}

/// EP/SP finalize (SPEC section 3). `x`: `[sum(local_sizes), H...]`, this
/// rank's partial output for all gathered tokens in EP-rank block order.
/// Packs block `r` into slot `r` of a zero `[EP, M, H...]` buffer,
/// reduce-scatters (sum) over `ep` and returns the first `local_sizes[rank]`
/// rows: the fully reduced local shard. Without a layout: a plain EP
/// reduce-scatter (rows must divide by EP).
pub fn maybe_pad_and_reduce<C: Collectives + ?Sized>(x: &Tensor, layout: Option<&SpLayout>, ep: &C) -> Result<Tensor> {
    with_output(
        PAD_REDUCE,
        PAD_REDUCE_CALL,
        x,
        ep,
        || {
            maybe_pad_and_reduce_dtype(x.dtype())?;
            maybe_pad_and_reduce_output_shape(x.shape(), layout, ep.rank(), ep.world_size())
        },
        |out| maybe_pad_and_reduce_into(x, layout, ep, out),
    )
}

/// [`maybe_pad_and_reduce`] into `out`, which must have the shape of
/// [`maybe_pad_and_reduce_output_shape`] and the dtype of `x`, on the EP
/// group's device; `out` may cover `x` (then read from a copy in
/// workspace). Every element of `out` is
/// written; the reduce-scatter writes `out` directly when this rank's shard
/// fills its whole slot, and always on a CPU group given a layout, which
/// moves the blocks unpadded, with the V collective.
pub fn maybe_pad_and_reduce_into<C: Collectives + ?Sized>(
    x: &Tensor,
    layout: Option<&SpLayout>,
    ep: &C,
    out: &mut Tensor,
) -> Result<()> {
    // `out` may cover `x`: `x` is then read from a copy in workspace (whose
    // allocation may fail, a refusal like any other).
    let copy = read_apart(x, out).map_err(|e| ep.refuse_call(PAD_REDUCE_CALL, x.dtype(), e))?;
    let x = copy.as_ref().unwrap_or(x);
    let shape = maybe_pad_and_reduce_dtype(x.dtype())
        .and_then(|_| maybe_pad_and_reduce_output_shape(x.shape(), layout, ep.rank(), ep.world_size()));
    let checked = shape.and_then(|s| {
        let device = check_in_out(PAD_REDUCE, "x", x, out, &s, ep)?;
        Ok((device, reduce_layout(PAD_REDUCE, x.rows(), layout, ep.world_size())?))
    });
    let (device, l) = checked.map_err(|e| ep.refuse_call(PAD_REDUCE_CALL, x.dtype(), e))?;
    if let Some(counts) = cpu_block_counts(&device, layout, x.row_len()) {
        return ep.reduce_scatter_v(x, out, &counts, ReduceOp::Sum).map_err(moving(PAD_REDUCE, "x"));
    }
    layout_agrees(&device, layout, ep)?;
    if l.is_uniform() {
        // No padding anywhere: x already is the padded buffer.
        return reduce_padded_into(x, &l, ep, out, &device).map_err(moving(PAD_REDUCE, "x"));
    }
    let backend = device.backend();
    let m = l.max_rows();
    let mut padded = backend.scratch(&with_rows(PAD_REDUCE, "x", x.shape(), l.padded_rows())?, x.dtype())?;
    for (r, &rows) in l.local_sizes().iter().enumerate() {
        if rows > 0 {
            backend.copy_rows(x, l.offset(r), &mut padded, r * m, rows)?;
        }
    }
    reduce_padded_into(&padded, &l, ep, out, &device).map_err(moving(PAD_REDUCE, "x"))
}

/// Shape function of [`maybe_all_gather_and_maybe_unpad`]: `[sum(local_sizes), H...]`
/// (or `[rows * ep_size, H...]` without a layout). `x_shape` must have exactly
/// `local_sizes[ep_rank]` rows.
pub fn maybe_all_gather_and_maybe_unpad_output_shape(
    x_shape: &[usize],
    layout: Option<&SpLayout>,
    ep_rank: usize,
    ep_size: usize,
) -> Result<Vec<usize>> {
    check_rank(GATHER_UNPAD, ep_rank, ep_size)?;
    if x_shape.is_empty() {
        return Err(Error::shape(GATHER_UNPAD, "x", "[rows, H...] (at least 1-D)", x_shape));
    }
    match layout {
        Some(l) => {
            l.check_ep_size(GATHER_UNPAD, ep_size)?;
            let want = l.local_size(ep_rank);
            if x_shape[0] != want {
                return Err(Error::shape(
                    GATHER_UNPAD,
                    "x",
                    format!("{want} rows (local_sizes[{ep_rank}] of {:?})", l.local_sizes()),
                    x_shape,
                ));
            }
            with_rows(GATHER_UNPAD, "x", x_shape, l.total_rows())
        }
        None => {
            let rows = x_shape[0].checked_mul(ep_size).ok_or_else(|| {
                Error::shape(GATHER_UNPAD, "x", format!("rows that times the EP size {ep_size} fit in usize"), x_shape)
            })?;
            with_rows(GATHER_UNPAD, "x", x_shape, rows)
        }
    }
}

/// EP/SP prepare (SPEC section 4): pads the local shard to `M` rows with zeros,
/// all-gathers over `ep` and concatenates the first `local_sizes[r]` rows of
/// every rank's block: `[sum(local_sizes), H...]`. The exact inverse of
/// [`maybe_pad_and_reduce`]'s layout.
pub fn maybe_all_gather_and_maybe_unpad<C: Collectives + ?Sized>(
    x: &Tensor,
    layout: Option<&SpLayout>,
    ep: &C,
) -> Result<Tensor> {
    with_output(
        GATHER_UNPAD,
        Call::AllGather,
        x,
        ep,
        || maybe_all_gather_and_maybe_unpad_output_shape(x.shape(), layout, ep.rank(), ep.world_size()),
        |out| maybe_all_gather_and_maybe_unpad_into(x, layout, ep, out),
    )
}

/// [`maybe_all_gather_and_maybe_unpad`] into `out`, which must have the shape
/// of [`maybe_all_gather_and_maybe_unpad_output_shape`] and the dtype of `x`,
/// on the EP group's device; `out` may cover `x` (then read from a copy in
/// workspace). Every element of `out`
/// is written; the all-gather writes `out` directly when no rank is padded,
/// and always on a CPU group given a layout, which moves the blocks unpadded.
pub fn maybe_all_gather_and_maybe_unpad_into<C: Collectives + ?Sized>(
    x: &Tensor,
    layout: Option<&SpLayout>,
    ep: &C,
    out: &mut Tensor,
) -> Result<()> {
    // `out` may cover `x`: `x` is then read from a copy in workspace (whose
    // allocation may fail, a refusal like any other).
    let copy = read_apart(x, out).map_err(|e| ep.refuse_call(Call::AllGather, x.dtype(), e))?;
    let x = copy.as_ref().unwrap_or(x);
    let device = maybe_all_gather_and_maybe_unpad_output_shape(x.shape(), layout, ep.rank(), ep.world_size())
        .and_then(|s| check_in_out(GATHER_UNPAD, "x", x, out, &s, ep))
        .map_err(|e| ep.refuse_call(Call::AllGather, x.dtype(), e))?;
    let backend = device.backend();
    let uniform;
    let l = match layout {
        Some(l) => l,
        None => {
            uniform = SpLayout::uniform(ep.world_size(), x.rows())?;
            &uniform
        }
    };
    if let Some(counts) = cpu_block_counts(&device, layout, x.row_len()) {
        return ep.all_gather_v(x, out, &counts).map_err(moving(GATHER_UNPAD, "x"));
    }
    layout_agrees(&device, layout, ep)?;
    let m = l.max_rows();
    if l.padded_rows().checked_mul(x.row_len()) == Some(0) && !joins_empty(ep) {
        // Nothing to move (`out` has no elements) and HCCL refuses empty
        // buffers; every rank sees the same layout and skips together. A CPU
        // rank joins with a count of 0, so a peer that has rows fails with it.
        return Ok(());
    }
    if l.is_uniform() {
        // No padding anywhere: every rank holds `M` rows, gathered as they are.
        return ep.all_gather(x, out).map_err(moving(GATHER_UNPAD, "x"));
    }
    let mut gathered = backend.scratch(&with_rows(GATHER_UNPAD, "x", x.shape(), l.padded_rows())?, x.dtype())?;
    if x.rows() == m {
        ep.all_gather(x, &mut gathered).map_err(moving(GATHER_UNPAD, "x"))?;
    } else {
        let mut padded = backend.scratch(&with_rows(GATHER_UNPAD, "x", x.shape(), m)?, x.dtype())?;
        if x.rows() > 0 {
            backend.copy_rows(x, 0, &mut padded, 0, x.rows())?;
        }
        ep.all_gather(&padded, &mut gathered).map_err(moving(GATHER_UNPAD, "x"))?;
    }
    for (r, &rows) in l.local_sizes().iter().enumerate() {
        if rows > 0 {
            backend.copy_rows(&gathered, r * m, out, l.offset(r), rows)?;
        }
    }
    Ok(())
}

/// Shape function of [`finalize_and_reduce`] on shapes and dtypes only: the
/// finalize's `[N, H...]` must have `N = sum(local_sizes)` (or divide by EP
/// without a layout); the output is `[local_sizes[ep_rank], H...]`.
pub fn finalize_and_reduce_shape(
    meta: &FinalizeMeta<'_>,
    layout: Option<&SpLayout>,
    ep_rank: usize,
    ep_size: usize,
) -> Result<Vec<usize>> {
    let (shape, _) = moe_finalize_routing_shape(meta)?;
    check_rank(FINALIZE_REDUCE, ep_rank, ep_size)?;
    let l = reduce_layout(FINALIZE_REDUCE, shape[0], layout, ep_size)?;
    with_rows(FINALIZE_REDUCE, "expanded_x", &shape, l.local_size(ep_rank))
}

/// Shape function of [`finalize_and_reduce`] on real arguments.
pub fn finalize_and_reduce_output_shape(
    args: &FinalizeArgs<&Tensor>,
    layout: Option<&SpLayout>,
    ep_rank: usize,
    ep_size: usize,
) -> Result<Vec<usize>> {
    moe_finalize_routing_output_shape(args)?;
    finalize_and_reduce_shape(&FinalizeMeta::of(args), layout, ep_rank, ep_size)
}

/// Finalize routing fused with the EP/SP reduce: the same result as
/// `maybe_pad_and_reduce(&moe_finalize_routing(args)?, layout, ep)`, with less
/// memory traffic where the communicator can do better than the padded
/// two-step path ([`Collectives::finalize_reduce_scatter`]: a CPU
/// communicator computes the rows straight into its staging buffers, so the
/// output never exists as a tensor of its own and an invalid input on one rank
/// fails every rank at once).
///
/// On a CPU communicator the two are equal bit for bit (it reduces in rank
/// order, SPEC section 8). HCCL promises no reduction order unless the
/// communicator is deterministic (`HCCL_DETERMINISTIC=true` or `strict`,
/// hicann/hccl `docs/zh/user_guide/hccl_env/HCCL_DETERMINISTIC.md`), so on the
/// NPU they agree up to the rounding of the sum's order, as two calls of the
/// two-step path do.
pub fn finalize_and_reduce<C: Collectives + ?Sized>(
    args: &FinalizeArgs<&Tensor>,
    layout: Option<&SpLayout>,
    ep: &C,
) -> Result<Tensor> {
    let dtype = args.expanded_x.dtype();
    let mut out = finalize_and_reduce_output_shape(args, layout, ep.rank(), ep.world_size())
        .and_then(|shape| {
            let device = check_device(FINALIZE_REDUCE, "expanded_x", args.expanded_x, ep)?;
            device.backend().output(&shape, dtype)
        })
        .map_err(|e| refuse_reduce(ep, dtype, e))?;
    finalize_and_reduce_into(args, layout, ep, &mut out)?;
    Ok(out)
}

/// A failure found before the fused reduce-scatter, reported through the
/// collective the peers are making ([`Collectives::refuse_call`]): on a CPU
/// communicator every rank fails at once naming this rank's reason, instead
/// of its peers waiting for it until the group's timeout.
fn refuse_reduce<C: Collectives + ?Sized>(ep: &C, dtype: crate::DType, e: Error) -> Error {
    ep.refuse_call(Call::ReduceScatter(ReduceOp::Sum), dtype, e)
}

/// [`finalize_and_reduce`] into `out`, which must have the shape of
/// [`finalize_and_reduce_output_shape`] and the dtype of `expanded_x`, on the
/// EP group's device. Every element of `out` is written.
pub fn finalize_and_reduce_into<C: Collectives + ?Sized>(
    args: &FinalizeArgs<&Tensor>,
    layout: Option<&SpLayout>,
    ep: &C,
    out: &mut Tensor,
) -> Result<()> {
    let checked = finalize_and_reduce_output_shape(args, layout, ep.rank(), ep.world_size()).and_then(|out_shape| {
        let (_, dims) = moe_finalize_routing_output_shape(args)?;
        check_in_out(FINALIZE_REDUCE, "expanded_x", args.expanded_x, out, &out_shape, ep)?;
        Ok((reduce_layout(FINALIZE_REDUCE, dims.n, layout, ep.world_size())?, dims))
    });
    let (l, dims) = checked.map_err(|e| refuse_reduce(ep, args.expanded_x.dtype(), e))?;
    layout_agrees(&args.expanded_x.device(), layout, ep)?;
    // `out` may cover an operand (the residual `x1`, say).
    write_apart(out, args.operands(), |o| ep.finalize_reduce_scatter(args, &dims, l.local_sizes(), o))
        .map_err(moving(FINALIZE_REDUCE, "expanded_x"))
}
