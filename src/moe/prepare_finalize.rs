//! Prepare / finalize of the token dimension for every MoE comm type
//! (SPEC section 6), and the token exchange (dispatch / combine) that the MC2
//! and ALLTOALL paths use.
//!
//! | comm type | SP | prepare | finalize |
//! |---|---|---|---|
//! | ALLGATHER | on | [`maybe_all_gather_and_maybe_unpad`] | [`maybe_pad_and_reduce`] |
//! | ALLGATHER | off | pad to `max_d T_d`, DP all-gather | DP reduce-scatter, keep `T_d` rows |
//! | MC2, FUSED_MC2 | off | pad to `ceil_to(max_d T_d, TP)`, equal TP split, `mc2_mask` | TP all-gather, keep `T_d` rows |
//! | ALLTOALL | off | pad to TP rows only when `T_d < TP`, uneven TP split | TP all-gather, keep `T_d` rows |
//! | MC2, FUSED_MC2, ALLTOALL | on | none (tokens already sharded) | none |
//!
//! On the CPU backend MC2 / FUSED_MC2 / ALLTOALL dispatch and combine are the
//! same exchange over the EP group done with `all_to_all_v` ([`dispatch`],
//! [`combine`]); the combine's weighted sum is the finalize op in drop-pad row
//! mode. The comm type is a run-time argument of every function here.

use crate::backend::args::with_rows;
use crate::backend::FinalizeArgs;
use crate::comm::{Collectives, Comm, CommType, ReduceOp};
use crate::moe::finalize::moe_finalize_routing;
use crate::moe::layout::SpLayout;
use crate::moe::pad_reduce::{maybe_all_gather_and_maybe_unpad, maybe_pad_and_reduce};
use crate::{DType, DropPadMode, Error, Result, Tensor};

const PREPARE: &str = "moe_prepare";
const FINALIZE: &str = "moe_finalize";

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
        crate::moe::layout::bounded_ep(OP, "tp_size", dp_tokens.len(), tp_size)?;
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
    /// DP rank, this rank being `pcp_rank`. EP rank order is DP x PCP x TP
    /// (SPEC section 2); every PCP rank of a DP rank holds that DP rank's tokens.
    pub fn with_pcp(mut self, pcp_size: usize, pcp_rank: usize) -> Result<Self> {
        const OP: &str = "MoeContext::with_pcp";
        if pcp_size == 0 {
            return Err(Error::invalid(OP, "pcp_size", "expected >= 1, got 0"));
        }
        if pcp_rank >= pcp_size {
            return Err(Error::invalid(OP, "pcp_rank", format!("{pcp_rank} >= PCP size {pcp_size}")));
        }
        let dp_pcp = self.dp_size().saturating_mul(pcp_size);
        crate::moe::layout::bounded_ep(OP, "pcp_size", dp_pcp, self.tp_size)?;
        let max_t = self.dp_tokens.iter().copied().max().unwrap_or(0);
        if max_t.checked_next_multiple_of(self.tp_size).and_then(|p| p.checked_mul(dp_pcp)).is_none() {
            return Err(Error::invalid(OP, "pcp_size", format!("{dp_pcp} DP x PCP ranks of {max_t} tokens overflow")));
        }
        self.pcp_size = pcp_size;
        self.pcp_rank = pcp_rank;
        Ok(self)
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
            let padded = max_t.div_ceil(tp) * tp;
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

/// Shape function of [`prepare`]: `x_shape` must have `ctx.local_tokens()` rows.
pub fn prepare_output_shape(x_shape: &[usize], comm: CommType, ctx: &MoeContext) -> Result<Vec<usize>> {
    check_rows(PREPARE, "x", x_shape, ctx.local_tokens(), "this rank's tokens")?;
    with_rows(PREPARE, "x", x_shape, prepared_rows(&token_plan(comm, ctx), ctx))
}

/// Shape function of [`finalize`]: `y_shape` must have the prepared rows; the
/// output has `ctx.local_tokens()` rows.
pub fn finalize_output_shape(y_shape: &[usize], comm: CommType, ctx: &MoeContext) -> Result<Vec<usize>> {
    check_rows(FINALIZE, "y", y_shape, prepared_rows(&token_plan(comm, ctx), ctx), "the prepared rows")?;
    with_rows(FINALIZE, "y", y_shape, ctx.local_tokens())
}

/// The MC2 mask of this rank's prepared rows: `true` for the first
/// `ctx.num_actual_tokens()` rows of this DP rank's tokens, `false` for graph
/// padding and the TP padding. `Some` for MC2 / FUSED_MC2 only.
pub fn mc2_mask(comm: CommType, ctx: &MoeContext) -> Option<Vec<bool>> {
    if !matches!(comm, CommType::Mc2 | CommType::FusedMc2) {
        return None;
    }
    let t = ctx.num_actual_tokens;
    let (first, rows) = match token_plan(comm, ctx) {
        TokenPlan::TpSplit { sizes, .. } => (sizes[..ctx.tp_rank].iter().sum::<usize>(), sizes[ctx.tp_rank]),
        // With SP, the rank holds chunk tp_rank of the batch padded to a multiple of TP.
        _ => (ctx.tp_rank * ctx.local_tokens(), ctx.local_tokens()),
    };
    Some((first..first + rows).map(|g| g < t).collect())
}

/// The groups a MoE layer communicates over: EP (= the world, DP-major), the
/// TP group of this rank, its DP group and, with PCP, its PCP group.
#[derive(Debug, Clone)]
pub struct MoeGroups {
    /// EP group: every rank, EP rank `(dp * PCP + pcp) * TP + tp`.
    pub ep: Comm,
    /// This rank's TP group (`tp_size` ranks, same DP and PCP rank).
    pub tp: Comm,
    /// This rank's DP group (`dp_size` ranks, same PCP and TP rank).
    pub dp: Comm,
    /// This rank's PCP group (`pcp_size` ranks, same DP and TP rank); `None`
    /// when the PCP size is 1.
    pub pcp: Option<Comm>,
}

impl MoeGroups {
    /// Splits `world` (EP = DP x TP ranks) into TP and DP groups. Every rank calls it.
    pub fn from_world(world: &Comm, tp_size: usize) -> Result<Self> {
        let ep = world.world_size();
        if tp_size == 0 || ep % tp_size != 0 {
            return Err(Error::invalid(
                "MoeGroups::from_world",
                "tp_size",
                format!("{tp_size} does not divide the world size {ep}"),
            ));
        }
        Self::from_world_pcp(world, 1, tp_size)
    }

    /// Splits `world` (EP = DP x PCP x TP ranks, EP rank `(dp * PCP + pcp) * TP
    /// + tp`, as vLLM-Ascend orders them) into TP, DP and PCP groups. Every
    /// rank calls it. An error names the three sizes when the world is not
    /// DP x `pcp_size` x `tp_size`.
    pub fn from_world_pcp(world: &Comm, pcp_size: usize, tp_size: usize) -> Result<Self> {
        let ep = world.world_size();
        let [d, p, t] = crate::comm::dp_pcp_tp_coords("MoeGroups::from_world_pcp", world, pcp_size, tp_size)?;
        let dp_size = ep / (pcp_size * tp_size);
        let at = |d: usize, p: usize, t: usize| (d * pcp_size + p) * tp_size + t;
        let tp_ranks: Vec<usize> = (0..tp_size).map(|i| at(d, p, i)).collect();
        let dp_ranks: Vec<usize> = (0..dp_size).map(|i| at(i, p, t)).collect();
        let tp = world.split(&tp_ranks)?;
        let dp = world.split(&dp_ranks)?;
        let pcp = if pcp_size > 1 {
            let pcp_ranks: Vec<usize> = (0..pcp_size).map(|i| at(d, i, t)).collect();
            Some(world.split(&pcp_ranks)?)
        } else {
            None
        };
        Ok(MoeGroups { ep: world.clone(), tp, dp, pcp })
    }

    /// The groups of communicators the engine already has (vLLM-Ascend's EP,
    /// TP, DP and PCP groups), creating none. They must form the DP x PCP x TP
    /// layout: `ep` has `dp * pcp * tp` ranks and this rank is EP rank
    /// `(dp_rank * pcp + pcp_rank) * tp + tp_rank`; an error names the sizes
    /// and ranks that do not fit. Local: no communication.
    pub fn from_comms(ep: &Comm, tp: &Comm, dp: &Comm, pcp: Option<&Comm>) -> Result<Self> {
        const OP: &str = "MoeGroups::from_comms";
        let (p_size, p_rank) = pcp.map_or((1, 0), |c| (c.world_size(), c.rank()));
        let want = dp.world_size() * p_size * tp.world_size();
        if ep.world_size() != want {
            return Err(Error::invalid(
                OP,
                "ep",
                format!(
                    "{} ranks, but DP {} x PCP {p_size} x TP {} is {want}",
                    ep.world_size(),
                    dp.world_size(),
                    tp.world_size()
                ),
            ));
        }
        let at = (dp.rank() * p_size + p_rank) * tp.world_size() + tp.rank();
        if ep.rank() != at {
            return Err(Error::invalid(
                OP,
                "ep",
                format!(
                    "this rank is EP rank {}, but its DP rank {}, PCP rank {p_rank} and TP rank {} make EP rank {at} \
                     (EP rank = (dp * PCP + pcp) * TP + tp)",
                    ep.rank(),
                    dp.rank(),
                    tp.rank()
                ),
            ));
        }
        if let Some(c) = pcp.filter(|c| c.world_size() == 1) {
            return Err(Error::invalid(OP, "pcp", format!("{:?} has one rank: pass no PCP group", c.name())));
        }
        Ok(MoeGroups { ep: ep.clone(), tp: tp.clone(), dp: dp.clone(), pcp: pcp.cloned() })
    }
}

/// Prepared tokens of one rank.
#[derive(Debug)]
pub struct Prepared {
    /// The tokens this rank routes (`prepare_output_shape` rows).
    pub hidden: Tensor,
    /// MC2 / FUSED_MC2: which prepared rows are real tokens ([`mc2_mask`]).
    pub mc2_mask: Option<Vec<bool>>,
}

fn check_groups(op: &'static str, ctx: &MoeContext, g: &MoeGroups) -> Result<()> {
    if g.ep.world_size() != ctx.ep_size() {
        return Err(Error::invalid(
            op,
            "ep",
            format!(
                "group has {} ranks, the context has DP {} x PCP {} x TP {} = {}",
                g.ep.world_size(),
                ctx.dp_size(),
                ctx.pcp_size,
                ctx.tp_size,
                ctx.ep_size()
            ),
        ));
    }
    let (pcp_size, pcp_rank) = g.pcp.as_ref().map_or((1, 0), |c| (c.world_size(), c.rank()));
    let checks = [
        ("pcp", pcp_size, ctx.pcp_size, pcp_rank, ctx.pcp_rank),
        ("ep", g.ep.world_size(), ctx.ep_size(), g.ep.rank(), ctx.ep_rank()),
        ("tp", g.tp.world_size(), ctx.tp_size, g.tp.rank(), ctx.tp_rank),
        ("dp", g.dp.world_size(), ctx.dp_size(), g.dp.rank(), ctx.dp_rank),
    ];
    for (arg, size, want, rank, want_rank) in checks {
        if size != want || rank != want_rank {
            return Err(Error::invalid(
                op,
                arg,
                format!("group is rank {rank} of {size}, the context says rank {want_rank} of {want}"),
            ));
        }
    }
    Ok(())
}

/// Whether [`prepare`] checks that every EP rank chose the same comm type:
/// always on the CPU communicator; on the NPU only with
/// `ASCEND_MOE_CHECK_COMM_TYPE=1` (there the check is an extra collective,
/// a small copy and a guard launch per layer, compared on the device and
/// reported by the stream check: it never synchronises and can be captured).
/// `ASCEND_MOE_CHECK_COMM_TYPE=0` turns it off everywhere.
fn comm_type_check_enabled(ep: &Comm) -> bool {
    match std::env::var("ASCEND_MOE_CHECK_COMM_TYPE").ok().as_deref().map(str::trim) {
        Some("0") => false,
        Some("1") => true,
        _ => matches!(ep.device(), crate::Device::Cpu),
    }
}

/// Checks that every rank of `ep` chose `comm` for this forward (SPEC section
/// 5: all EP ranks of a forward agree on the comm type). One all-gather of one
/// i32 per rank, then [`crate::backend::Backend::expect_all_equal`]: on the
/// CPU every rank fails at once with the same error naming which ranks chose
/// which type (e.g. DP 0 ALLGATHER, DP 1 MC2); on an NPU the choices are
/// compared on the device and every rank's next stream check fails naming a
/// rank that chose otherwise. Either way the collectives of two different
/// paths never fail with an unrelated mismatch on some ranks and succeed on
/// others unnoticed.
pub fn check_comm_type_agreement<C: Collectives + ?Sized>(comm: CommType, ep: &C) -> Result<()> {
    let world = ep.world_size();
    if world <= 1 {
        return Ok(());
    }
    let device = ep.device();
    let mine = device.backend().scratch_from_host(&Tensor::from_slice(&[comm as i32], &[1])?)?;
    let mut all = device.backend().scratch(&[world], DType::I32)?;
    ep.all_gather(&mine, &mut all)?;
    let (group, rank) = (ep.name().to_string(), ep.rank());
    device.backend().expect_all_equal(
        &all,
        comm as i32,
        Box::new(move |chosen, first, value| comm_type_disagreement(comm, &group, rank, chosen, first, value)),
    )
}

fn comm_type_name(c: i32) -> String {
    CommType::from_u32(c as u32).map_or_else(|_| format!("unknown type {c}"), |t| t.name().to_string())
}

/// The error of ranks that disagree on the comm type: every rank's choice
/// when they were all read (`chosen`), else the first rank that differs.
fn comm_type_disagreement(
    comm: CommType,
    group: &str,
    rank: usize,
    chosen: Option<&[i32]>,
    first: usize,
    value: i32,
) -> Error {
    let what = match chosen {
        Some(chosen) => {
            let mut by_type: Vec<(i32, Vec<usize>)> = Vec::new();
            for (r, &c) in chosen.iter().enumerate() {
                match by_type.iter_mut().find(|(t, _)| *t == c) {
                    Some((_, ranks)) => ranks.push(r),
                    None => by_type.push((c, vec![r])),
                }
            }
            let parts: Vec<String> = by_type
                .iter()
                .map(|(c, ranks)| {
                    let list: Vec<String> = ranks.iter().map(|r| r.to_string()).collect();
                    let who = if ranks.len() == 1 { "rank" } else { "ranks" };
                    format!("{who} {} chose {}", list.join(", "), comm_type_name(*c))
                })
                .collect();
            parts.join("; ")
        }
        None => format!(
            "rank {first} chose {} and rank {rank} chose {} (found on the device)",
            comm_type_name(value),
            comm.name()
        ),
    };
    Error::invalid(
        PREPARE,
        "comm_type",
        format!("the EP ranks of group {group:?} disagree on the MoE comm type of this forward: {what} (this is rank {rank})"),
    )
}

/// Prepare for `comm` (SPEC section 6): the tokens this rank routes.
///
/// The comm type of a forward enters here, at its first collective: when the
/// check is on (see [`check_comm_type_agreement`]; always on the CPU
/// communicator, where it costs one 4-byte all-gather next to the token
/// gathers), every EP rank first learns every other rank's choice, so ranks
/// that disagree all fail with an error naming the choices instead of
/// running the collectives of two different paths.
pub fn prepare(x: &Tensor, comm: CommType, ctx: &MoeContext, groups: &MoeGroups) -> Result<Prepared> {
    let shape = prepare_output_shape(x.shape(), comm, ctx)?;
    check_groups(PREPARE, ctx, groups)?;
    if comm_type_check_enabled(&groups.ep) {
        check_comm_type_agreement(comm, &groups.ep)?;
    }
    let device = x.device();
    let backend = device.backend();
    let hidden = match token_plan(comm, ctx) {
        TokenPlan::SpGather(l) => maybe_all_gather_and_maybe_unpad(x, Some(&l), &groups.ep)?,
        TokenPlan::DpGather { max_tokens } => {
            let mut out = backend.scratch(&shape, x.dtype())?;
            if out.numel() > 0 {
                let mut padded = backend.scratch(&with_rows(PREPARE, "x", x.shape(), max_tokens)?, x.dtype())?;
                if x.rows() > 0 {
                    backend.copy_rows(x, 0, &mut padded, 0, x.rows())?;
                }
                match &groups.pcp {
                    // vLLM-Ascend (`prepare_finalize.py`, `_prepare_with_dp_group`):
                    // the DP all-gather first, then the PCP all-gather of its result.
                    Some(pcp) => {
                        let dp_rows = max_tokens * ctx.dp_size();
                        let mut dp_out = backend.scratch(&with_rows(PREPARE, "x", x.shape(), dp_rows)?, x.dtype())?;
                        groups.dp.all_gather(&padded, &mut dp_out)?;
                        pcp.all_gather(&dp_out, &mut out)?;
                    }
                    None => groups.dp.all_gather(&padded, &mut out)?,
                }
            }
            out
        }
        TokenPlan::TpSplit { sizes, .. } => {
            let first: usize = sizes[..ctx.tp_rank].iter().sum();
            let mut out = backend.scratch(&shape, x.dtype())?;
            // Rows past the real tokens stay zero (the padding).
            let real = x.rows().saturating_sub(first).min(sizes[ctx.tp_rank]);
            if real > 0 {
                backend.copy_rows(x, first, &mut out, 0, real)?;
            }
            out
        }
        TokenPlan::Local => backend.copy_from(x)?,
    };
    Ok(Prepared { hidden, mc2_mask: mc2_mask(comm, ctx) })
}

/// Finalize for `comm` (SPEC section 6): the routed output of the prepared
/// rows back to this rank's `ctx.local_tokens()` rows, in a fresh buffer (or
/// `y` itself where the path is the identity).
pub fn finalize(y: Tensor, comm: CommType, ctx: &MoeContext, groups: &MoeGroups) -> Result<Tensor> {
    let shape = finalize_output_shape(y.shape(), comm, ctx)?;
    check_groups(FINALIZE, ctx, groups)?;
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
            let mut slot = backend.scratch(&with_rows(FINALIZE, "y", y.shape(), max_tokens)?, y.dtype())?;
            if slot.numel() > 0 {
                match &groups.pcp {
                    // vLLM-Ascend (`prepare_finalize.py`, `_finalize_with_dp_group`):
                    // the PCP reduce-scatter to the DP-gathered rows recorded at
                    // prepare, then the DP reduce-scatter to `max_d T_d`.
                    Some(pcp) => {
                        let dp_rows = max_tokens * ctx.dp_size();
                        let mut dp_in = backend.scratch(&with_rows(FINALIZE, "y", y.shape(), dp_rows)?, y.dtype())?;
                        pcp.reduce_scatter(&y, &mut dp_in, ReduceOp::Sum)?;
                        groups.dp.reduce_scatter(&dp_in, &mut slot, ReduceOp::Sum)?;
                    }
                    None => groups.dp.reduce_scatter(&y, &mut slot, ReduceOp::Sum)?,
                }
            }
            keep(slot)
        }
        TokenPlan::TpSplit { padded, sizes } => {
            let mut full = backend.scratch(&with_rows(FINALIZE, "y", y.shape(), padded)?, y.dtype())?;
            if full.numel() > 0 {
                if sizes.iter().all(|s| *s == sizes[0]) {
                    groups.tp.all_gather(&y, &mut full)?;
                } else {
                    let counts: Vec<usize> = sizes.iter().map(|s| s * y.row_len()).collect();
                    groups.tp.all_gather_v(&y, &mut full, &counts)?;
                }
            }
            keep(full)
        }
        TokenPlan::Local => Ok(y),
    }
}

/// Tokens after [`dispatch`]: the rows this rank's experts process.
#[derive(Debug)]
pub struct Dispatched {
    /// Received rows `[R, H...]`, grouped by source rank.
    pub rows: Tensor,
    /// The (global) expert of every received row.
    pub experts: Vec<i32>,
    send_counts: Vec<usize>,
    recv_counts: Vec<usize>,
    /// Per (token, k) slot (row-major): its position in the send order, or -1.
    send_pos: Vec<i32>,
    tokens: usize,
    top_k: usize,
}

fn exchange_counts(ep: &Comm, send: &[usize]) -> Result<Vec<usize>> {
    let world = ep.world_size();
    let s: Vec<i64> = send.iter().map(|&c| c as i64).collect();
    let src = Tensor::from_slice(&s, &[world])?.to_device(&ep.device())?;
    let mut dst = ep.device().backend().scratch(&[world], DType::I64)?;
    ep.all_to_all_v(&src, &vec![1; world], &mut dst, &vec![1; world])?;
    Ok(dst.to_vec::<i64>()?.into_iter().map(|c| c.max(0) as usize).collect())
}

/// MoE dispatch over the EP group: every (token, k) slot of `x` (`[N, H...]`)
/// whose token is real (`mask`, all real when `None`) is sent to the EP rank
/// owning expert `topk_ids[token * K + k]` (experts are split evenly, EP rank
/// `r` owning `[r * E/EP, (r+1) * E/EP)`).
pub fn dispatch(
    x: &Tensor,
    topk_ids: &[i32],
    top_k: usize,
    mask: Option<&[bool]>,
    num_experts: usize,
    ep: &Comm,
) -> Result<Dispatched> {
    const OP: &str = "moe_dispatch";
    let world = ep.world_size();
    let n = x.rows();
    if x.shape().is_empty() {
        return Err(Error::shape(OP, "x", "[N, H...]", x.shape()));
    }
    if top_k == 0 || topk_ids.len() != n * top_k {
        return Err(Error::invalid(OP, "topk_ids", format!("{} ids for {n} tokens x top-k {top_k}", topk_ids.len())));
    }
    if num_experts == 0 || num_experts % world != 0 {
        return Err(Error::invalid(
            OP,
            "num_experts",
            format!("{num_experts} experts do not split over {world} EP ranks"),
        ));
    }
    if let Some(m) = mask {
        if m.len() != n {
            return Err(Error::invalid(OP, "mask", format!("{} entries for {n} tokens", m.len())));
        }
    }
    if let Some(p) = topk_ids.iter().position(|&e| e < 0 || e as usize >= num_experts) {
        return Err(Error::IndexOutOfRange {
            op: OP,
            arg: "topk_ids",
            position: p,
            value: topk_ids[p] as i64,
            valid: format!("[0, {num_experts})"),
        });
    }
    let per_rank = num_experts / world;
    // Send order: by destination rank, then slot order.
    let mut order: Vec<(usize, usize)> = Vec::new();
    for (slot, &e) in topk_ids.iter().enumerate() {
        if mask.map_or(true, |m| m[slot / top_k]) {
            order.push((e as usize / per_rank, slot));
        }
    }
    order.sort_by_key(|&(dst, slot)| (dst, slot));
    let mut send_counts = vec![0usize; world];
    let mut send_pos = vec![-1i32; n * top_k];
    let mut gather = Vec::with_capacity(order.len());
    let mut send_experts = Vec::with_capacity(order.len());
    for (p, &(dst, slot)) in order.iter().enumerate() {
        send_counts[dst] += 1;
        send_pos[slot] = p as i32;
        gather.push((slot / top_k) as i32);
        send_experts.push(topk_ids[slot]);
    }
    let recv_counts = exchange_counts(ep, &send_counts)?;
    let device = x.device();
    let h = x.row_len();
    // Gather the rows to send with the unpermute op (K = 1: a row gather).
    let idx = Tensor::from_slice(&gather, &[gather.len()])?.to_device(&device)?;
    let send = crate::moe::finalize::moe_token_unpermute(x, &idx, None)?;
    let recv_total: usize = recv_counts.iter().sum();
    let mut rows = device.backend().scratch(&with_rows("dispatch", "x", x.shape(), recv_total)?, x.dtype())?;
    let sc: Vec<usize> = send_counts.iter().map(|c| c * h).collect();
    let rc: Vec<usize> = recv_counts.iter().map(|c| c * h).collect();
    ep.all_to_all_v(&send, &sc, &mut rows, &rc)?;
    let se = Tensor::from_slice(&send_experts, &[send_experts.len()])?.to_device(&device)?;
    let mut re = device.backend().scratch(&[recv_total], DType::I32)?;
    ep.all_to_all_v(&se, &send_counts, &mut re, &recv_counts)?;
    Ok(Dispatched { rows, experts: re.to_vec::<i32>()?, send_counts, recv_counts, send_pos, tokens: n, top_k })
}

/// MoE combine: sends every expert output row back to its token's rank and
/// sums `topk_weights[i, k] * row` per token (the finalize op in drop-pad row
/// mode; a masked token gets zeros). Output `[N, H...]`, the full routed sum.
pub fn combine(expert_out: &Tensor, d: &Dispatched, topk_weights: &Tensor, ep: &Comm) -> Result<Tensor> {
    const OP: &str = "moe_combine";
    let recv_total: usize = d.recv_counts.iter().sum();
    if expert_out.shape().first() != Some(&recv_total) || expert_out.row_len() != d.rows.row_len() {
        return Err(Error::shape(
            OP,
            "expert_out",
            format!("{:?} (the dispatched rows)", d.rows.shape()),
            expert_out.shape(),
        ));
    }
    if topk_weights.shape() != [d.tokens, d.top_k] {
        return Err(Error::shape(OP, "topk_weights", format!("[{}, {}]", d.tokens, d.top_k), topk_weights.shape()));
    }
    let device = expert_out.device();
    let h = expert_out.row_len();
    let sent: usize = d.send_counts.iter().sum();
    let mut back_shape = vec![1, sent];
    back_shape.extend_from_slice(&expert_out.shape()[1..]);
    let mut back = device.backend().scratch(&back_shape, expert_out.dtype())?;
    let sc: Vec<usize> = d.recv_counts.iter().map(|c| c * h).collect();
    let rc: Vec<usize> = d.send_counts.iter().map(|c| c * h).collect();
    ep.all_to_all_v(expert_out, &sc, &mut back, &rc)?;
    let idx = Tensor::from_slice(&d.send_pos, &[d.send_pos.len()])?.to_device(&device)?;
    moe_finalize_routing(&FinalizeArgs {
        expanded_x: &back,
        expanded_row_idx: &idx,
        x1: None,
        x2: None,
        bias: None,
        scales: Some(topk_weights),
        expert_idx: None,
        drop_pad_mode: DropPadMode::DropPadRow,
    })
}
