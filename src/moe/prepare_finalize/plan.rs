//! The parallel context of a forward and the token path and shapes of each
//! comm type in it.

use crate::backend::args::with_rows;
use crate::backend::Call;
use crate::comm::{CommType, ReduceOp};
use crate::moe::layout::SpLayout;
use crate::{DType, Error, Result};

pub(super) const PREPARE: &str = "moe_prepare";
pub(super) const FINALIZE: &str = "moe_finalize";

/// The parallel context of one forward pass (run-time values).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MoeContext {
    dp_tokens: Vec<usize>,
    tp_size: usize,
    dp_rank: usize,
    tp_rank: usize,
    sp: bool,
    /// Real tokens of this DP rank (the rest of its `T_d` rows are graph padding).
    num_actual_tokens: usize,
    pcp_size: usize,
    pcp_rank: usize,
    /// MC2 / FUSED_MC2 pad target; `None` = `ceil_to(max_d T_d, TP)`.
    padded_num_tokens: Option<usize>,
}

impl MoeContext {
    /// `dp_tokens[d]`: tokens of DP rank `d` in this forward (every rank knows
    /// all of them); this rank is `(dp_rank, tp_rank)`; `sp`: sequence
    /// parallelism on (each TP rank then holds `ceil(T_d / TP)` rows).
    pub fn new(dp_tokens: &[usize], tp_size: usize, dp_rank: usize, tp_rank: usize, sp: bool) -> Result<Self> {
        const OP: &str = "MoeContext::new";
        if dp_tokens.is_empty() {
            return Err(Error::invalid(OP, "dp_tokens", "expected one entry per DP rank, got none"));
        }
        if tp_size == 0 {
            return Err(Error::invalid(OP, "tp_size", "expected >= 1, got 0"));
        }
        crate::moe::layout::bounded_ep(OP, "tp_size", &[("dp_size", dp_tokens.len()), ("tp_size", tp_size)])?;
        // Every token plan's row count is at most DP x ceil_to(max_d T_d, TP).
        let max_t = dp_tokens.iter().copied().max().unwrap_or(0);
        if max_t.checked_next_multiple_of(tp_size).and_then(|p| p.checked_mul(dp_tokens.len())).is_none() {
            return Err(Error::invalid(
                OP,
                "dp_tokens",
                format!("{} DP ranks of up to {max_t} tokens (TP {tp_size}): the row count overflows", dp_tokens.len()),
            ));
        }
        if dp_rank >= dp_tokens.len() {
            return Err(Error::invalid(OP, "dp_rank", format!("{dp_rank} >= DP size {}", dp_tokens.len())));
        }
        if tp_rank >= tp_size {
            return Err(Error::invalid(OP, "tp_rank", format!("{tp_rank} >= TP size {tp_size}")));
        }
        let num_actual_tokens = dp_tokens[dp_rank];
        Ok(MoeContext {
            dp_tokens: dp_tokens.to_vec(),
            tp_size,
            dp_rank,
            tp_rank,
            sp,
            num_actual_tokens,
            pcp_size: 1,
            pcp_rank: 0,
            padded_num_tokens: None,
        })
    }

    /// This context with only the first `n` of this DP rank's `T_d` tokens
    /// real: the MC2 mask marks them and not the graph padding after them, as
    /// vLLM-Ascend's forward context does (`ascend_forward_context.py`: the
    /// mask over `ceil_to(max_d T_d, TP)` rows is true for the first
    /// `num_actual_tokens`, which defaults to the batch's token count).
    /// Errors when `n > T_d`.
    pub fn with_num_actual_tokens(mut self, n: usize) -> Result<Self> {
        let t = self.dp_tokens[self.dp_rank];
        if n > t {
            return Err(Error::invalid(
                "MoeContext::with_num_actual_tokens",
                "num_actual_tokens",
                format!("{n} exceeds the {t} tokens of DP rank {}", self.dp_rank),
            ));
        }
        self.num_actual_tokens = n;
        Ok(self)
    }

    /// This context with prefill context parallelism: `pcp_size` PCP ranks per
    /// DP rank (the world size of the PCP group, as vLLM-Ascend's
    /// `pcp_size`), this rank being `pcp_rank`. EP rank order is DP x PCP x TP
    /// (SPEC section 2); every PCP rank of a DP rank holds that DP rank's tokens.
    /// `pcp_size` 0 or 1 is no PCP (rank 0 only), as in
    /// [`MoeGroups::from_world_pcp`](super::MoeGroups::from_world_pcp); an
    /// error names the `pcp_size` passed.
    pub fn with_pcp(mut self, pcp_size: usize, pcp_rank: usize) -> Result<Self> {
        const OP: &str = "MoeContext::with_pcp";
        let size = pcp_size.max(1);
        if pcp_rank >= size {
            let why = if pcp_size == 0 {
                format!("{pcp_rank} with pcp_size 0 (no PCP: expected 0)")
            } else {
                format!("{pcp_rank} >= PCP size {pcp_size}")
            };
            return Err(Error::invalid(OP, "pcp_rank", why));
        }
        let sizes = [("dp_size", self.dp_size()), ("pcp_size", pcp_size), ("tp_size", self.tp_size)];
        crate::moe::layout::bounded_ep(OP, "pcp_size", &sizes)?;
        let dp_pcp = self.dp_size().saturating_mul(size);
        let max_t = self.dp_tokens.iter().copied().max().unwrap_or(0);
        if max_t.checked_next_multiple_of(self.tp_size).and_then(|p| p.checked_mul(dp_pcp)).is_none() {
            return Err(Error::invalid(OP, "pcp_size", format!("{dp_pcp} DP x PCP ranks of {max_t} tokens overflow")));
        }
        self.pcp_size = size;
        self.pcp_rank = pcp_rank;
        Ok(self)
    }
    /// This context with the rows MC2 / FUSED_MC2 pad every DP rank's tokens
    /// to before the TP split, as the engine chose them (vLLM-Ascend's
    /// `padded_num_tokens`, `ascend_forward_context.py`: the same number on
    /// every DP rank); the default is `ceil_to(max_d T_d, TP)`. It must be a
    /// multiple of the TP size and hold every DP rank's tokens: an error names
    /// the value, the TP size and the largest token count otherwise.
    pub fn with_padded_num_tokens(mut self, n: usize) -> Result<Self> {
        let max_t = self.dp_tokens.iter().copied().max().unwrap_or(0);
        // Every token plan's row count is at most DP x the padded batch.
        if n.checked_mul(self.dp_tokens.len()).is_none() {
            return Err(Error::invalid(
                "MoeContext::with_padded_num_tokens",
                "padded_num_tokens",
                format!("{n} x DP {} rows overflow", self.dp_tokens.len()),
            ));
        }
        if n % self.tp_size != 0 || n < max_t {
            return Err(Error::invalid(
                "MoeContext::with_padded_num_tokens",
                "padded_num_tokens",
                format!(
                    "{n} must be a multiple of the TP size {} and at least the largest DP token count {max_t}",
                    self.tp_size
                ),
            ));
        }
        self.padded_num_tokens = Some(n);
        Ok(self)
    }
    /// The MC2 / FUSED_MC2 pad target: rows every DP rank's tokens are padded
    /// to before the equal TP split.
    pub fn padded_num_tokens(&self) -> usize {
        let max_t = self.dp_tokens.iter().copied().max().unwrap_or(0);
        self.padded_num_tokens.unwrap_or_else(|| max_t.div_ceil(self.tp_size) * self.tp_size)
    }
    /// Real tokens of this DP rank (default `T_d`).
    pub fn num_actual_tokens(&self) -> usize {
        self.num_actual_tokens
    }
    /// PCP size (1 without prefill context parallelism).
    pub fn pcp_size(&self) -> usize {
        self.pcp_size
    }
    /// This rank's PCP rank.
    pub fn pcp_rank(&self) -> usize {
        self.pcp_rank
    }
    /// Tokens of every DP rank.
    pub fn dp_tokens(&self) -> &[usize] {
        &self.dp_tokens
    }
    /// DP size.
    pub fn dp_size(&self) -> usize {
        self.dp_tokens.len()
    }
    /// TP size.
    pub fn tp_size(&self) -> usize {
        self.tp_size
    }
    /// EP size (`DP * PCP * TP`).
    pub fn ep_size(&self) -> usize {
        self.dp_size() * self.pcp_size * self.tp_size
    }
    /// This rank's DP rank.
    pub fn dp_rank(&self) -> usize {
        self.dp_rank
    }
    /// This rank's TP rank.
    pub fn tp_rank(&self) -> usize {
        self.tp_rank
    }
    /// This rank's EP rank (`(dp_rank * PCP + pcp_rank) * TP + tp_rank`).
    pub fn ep_rank(&self) -> usize {
        (self.dp_rank * self.pcp_size + self.pcp_rank) * self.tp_size + self.tp_rank
    }
    /// Sequence parallelism on.
    pub fn sp(&self) -> bool {
        self.sp
    }
    /// The SP layout (`Some` iff SP is on).
    pub fn sp_layout(&self) -> Option<SpLayout> {
        // from_dp_tokens fails only on empty input or tp 0, both excluded by `new`.
        self.sp.then(|| SpLayout::from_dp_tokens_pcp(&self.dp_tokens, self.pcp_size, self.tp_size)).and_then(|r| r.ok())
    }
    /// Rows this rank holds entering and leaving the MoE layer: `ceil(T_d / TP)`
    /// with SP, else `T_d`.
    pub fn local_tokens(&self) -> usize {
        let t = self.dp_tokens[self.dp_rank];
        if self.sp {
            t.div_ceil(self.tp_size)
        } else {
            t
        }
    }
}

/// The token path of one comm type in one context (SPEC section 6).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenPlan {
    /// ALLGATHER + SP: EP all-gather / pad-and-reduce over this layout.
    SpGather(SpLayout),
    /// ALLGATHER without SP: pad to `max_tokens`, DP all-gather (then, with
    /// PCP, PCP all-gather of the DP-gathered rows).
    DpGather {
        /// `max_d T_d`.
        max_tokens: usize,
    },
    /// MC2 / FUSED_MC2 / ALLTOALL without SP: pad to `padded` rows and split
    /// across TP, TP rank `t` taking `sizes[t]` rows from `offsets[t]`.
    TpSplit {
        /// Rows after padding.
        padded: usize,
        /// Rows of every TP rank.
        sizes: Vec<usize>,
    },
    /// MC2 / FUSED_MC2 / ALLTOALL with SP: the local shard as is.
    Local,
}

/// The token path for `comm` in `ctx`.
pub fn token_plan(comm: CommType, ctx: &MoeContext) -> TokenPlan {
    let tp = ctx.tp_size;
    let t = ctx.dp_tokens[ctx.dp_rank];
    let max_t = ctx.dp_tokens.iter().copied().max().unwrap_or(0);
    match (comm, ctx.sp) {
        (CommType::AllGather, true) => match ctx.sp_layout() {
            Some(l) => TokenPlan::SpGather(l),
            None => TokenPlan::Local,
        },
        (CommType::AllGather, false) => TokenPlan::DpGather { max_tokens: max_t },
        (CommType::Mc2 | CommType::FusedMc2, false) => {
            let padded = ctx.padded_num_tokens();
            TokenPlan::TpSplit { padded, sizes: vec![padded / tp; tp] }
        }
        (CommType::AllToAll, false) => {
            let padded = t.max(tp);
            let sizes = (0..tp).map(|r| padded / tp + usize::from(r < padded % tp)).collect();
            TokenPlan::TpSplit { padded, sizes }
        }
        (_, true) => TokenPlan::Local,
    }
}

fn check_rows(op: &'static str, arg: &'static str, shape: &[usize], want: usize, why: &str) -> Result<()> {
    if shape.first() != Some(&want) {
        return Err(Error::shape(op, arg, format!("{want} rows ({why})"), shape));
    }
    Ok(())
}

/// Rows of the prepared tokens under `plan`.
fn prepared_rows(plan: &TokenPlan, ctx: &MoeContext) -> usize {
    match plan {
        TokenPlan::SpGather(l) => l.total_rows(),
        TokenPlan::DpGather { max_tokens } => max_tokens * ctx.dp_size() * ctx.pcp_size,
        TokenPlan::TpSplit { sizes, .. } => sizes[ctx.tp_rank],
        TokenPlan::Local => ctx.local_tokens(),
    }
}

/// Shape function of [`prepare`](super::prepare()): `x_shape` must have `ctx.local_tokens()` rows.
pub fn prepare_output_shape(x_shape: &[usize], comm: CommType, ctx: &MoeContext) -> Result<Vec<usize>> {
    check_rows(PREPARE, "x", x_shape, ctx.local_tokens(), "this rank's tokens")?;
    with_rows(PREPARE, "x", x_shape, prepared_rows(&token_plan(comm, ctx), ctx))
}

/// Shape function of [`finalize`](super::finalize()): `y_shape` must have the prepared rows; the
/// output has `ctx.local_tokens()` rows.
pub fn finalize_output_shape(y_shape: &[usize], comm: CommType, ctx: &MoeContext) -> Result<Vec<usize>> {
    check_rows(FINALIZE, "y", y_shape, prepared_rows(&token_plan(comm, ctx), ctx), "the prepared rows")?;
    with_rows(FINALIZE, "y", y_shape, ctx.local_tokens())
}

/// The dtypes [`finalize`](super::finalize()) takes for `comm` in `ctx`:
/// where its path sums the rows (ALLGATHER, whose EP or DP reduce-scatter
/// adds every rank's partial output) those the reduce-scatter sums (f32,
/// f16, bf16, i32, i64), never a one-byte dtype, which is only moved (SPEC
/// section 8); any dtype where the path only moves rows. The error names `y`
/// and its dtype. Finalize checks it before any collective, so a rank
/// holding such a dtype fails its peers with it instead of some of them
/// returning; the C ABI's shape function refuses the same.
pub fn finalize_dtype(dtype: DType, comm: CommType, ctx: &MoeContext) -> Result<()> {
    match token_plan(comm, ctx) {
        TokenPlan::SpGather(_) | TokenPlan::DpGather { .. } => {
            crate::comm::reducible(FINALIZE, "y", Call::ReduceScatter(ReduceOp::Sum), dtype)
        }
        TokenPlan::TpSplit { .. } | TokenPlan::Local => Ok(()),
    }
}

/// [`finalize_output_shape`] then [`finalize_dtype`] for a `y` of `y_shape`
/// and `dtype`: the output shape, or the first of their errors (the shape's
/// when both fail). The checks of [`finalize`](super::finalize()), its
/// `_into` twin and the C ABI's finalize shape function, kept in one order.
pub(crate) fn finalize_shape_and_dtype(
    y_shape: &[usize],
    dtype: DType,
    comm: CommType,
    ctx: &MoeContext,
) -> Result<Vec<usize>> {
    let shape = finalize_output_shape(y_shape, comm, ctx)?;
    finalize_dtype(dtype, comm, ctx)?;
    Ok(shape)
}

/// The MC2 mask of this rank's prepared rows: `true` for the first
/// `ctx.num_actual_tokens()` rows of this DP rank's tokens, `false` for graph
/// padding and the TP padding. `Some` for MC2 / FUSED_MC2 only. One `bool`
/// per row; [`mc2_mask_extent`] says the same without allocating (the ops
/// that return a mask report one that does not fit in memory as an error).
pub fn mc2_mask(comm: CommType, ctx: &MoeContext) -> Option<Vec<bool>> {
    mc2_mask_extent(comm, ctx).map(|(rows, real)| (0..rows).map(|i| i < real).collect())
}

/// [`mc2_mask`], or an error naming `padded_num_tokens` where the mask does
/// not fit in memory (a context padded to an absurd batch).
pub(crate) fn try_mc2_mask(comm: CommType, ctx: &MoeContext) -> Result<Option<Vec<bool>>> {
    let Some((rows, real)) = mc2_mask_extent(comm, ctx) else {
        return Ok(None);
    };
    let mut mask = Vec::new();
    mask.try_reserve_exact(rows).map_err(|e| {
        Error::invalid(PREPARE, "padded_num_tokens", format!("the MC2 mask of {rows} rows cannot be allocated: {e}"))
    })?;
    mask.extend((0..rows).map(|i| i < real));
    Ok(Some(mask))
}

/// The MC2 mask of [`mc2_mask`] as `(rows, real)`: `rows` entries, of which
/// the first `real` are true (the real tokens come first in every chunk).
pub fn mc2_mask_extent(comm: CommType, ctx: &MoeContext) -> Option<(usize, usize)> {
    if !matches!(comm, CommType::Mc2 | CommType::FusedMc2) {
        return None;
    }
    let (first, rows) = match token_plan(comm, ctx) {
        TokenPlan::TpSplit { sizes, .. } => (sizes[..ctx.tp_rank].iter().sum::<usize>(), sizes[ctx.tp_rank]),
        // With SP, the rank holds chunk tp_rank of the batch padded to a multiple of TP.
        _ => (ctx.tp_rank * ctx.local_tokens(), ctx.local_tokens()),
    };
    // Rows `first..first + rows` of the padded batch; real below num_actual_tokens.
    Some((rows, ctx.num_actual_tokens.saturating_sub(first).min(rows)))
}
