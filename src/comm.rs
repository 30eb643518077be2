//! Backend-neutral communication: [`Comm`], [`ReduceOp`], [`CommType`] and the
//! [`Collectives`] trait both backends implement.
//!
//! Counts are in elements. Every collective checks that all ranks called the
//! same thing (kind, counts, dtype, root, op) and fails on every rank with an
//! error naming the collective, group, ranks and sizes when they did not.
//! Every wait has a timeout.

use crate::backend::args::with_rows;
use crate::backend::cpu::CpuComm;
use crate::backend::npu::HcclComm;
use crate::backend::{FinalizeArgs, FinalizeDims, OutputRows};
use crate::types::{numbered, Numbered};
pub use crate::types::{CommOptions, ReduceOp};
use crate::{Device, Error, Result, Tensor};

numbered! {
    /// vLLM-Ascend's MoE communication type, chosen per forward pass (SPEC section 5).
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    pub enum CommType {
        /// DP all-gather of tokens; routed output is TP-partial unless SP is on.
        AllGather = 0 => "ALLGATHER",
        /// MC2 dispatch / combine.
        Mc2 = 1 => "MC2",
        /// All-to-all dispatch / combine.
        AllToAll = 2 => "ALLTOALL",
        /// Fused MC2.
        FusedMc2 = 3 => "FUSED_MC2",
    }
}

impl CommType {
    /// Every comm type, in vLLM-Ascend's numbering.
    pub const ALL: [CommType; 4] = Self::VARIANTS;
    /// The comm type for its number; `Err` names the bad value.
    pub fn from_u32(v: u32) -> Result<Self> {
        Self::try_from(v).map_err(|_| {
            Error::invalid(
                "CommType",
                "comm_type",
                format!("unknown MoE comm type {v} (expected {})", Self::expected()),
            )
        })
    }
    /// vLLM-Ascend's name (`"ALLGATHER"`, `"FUSED_MC2"`, ...).
    pub fn name(self) -> &'static str {
        self.variant().name
    }
}

/// The collectives of SPEC section 8, on tensors of the communicator's device.
///
/// Element counts come from the tensors: `reduce_scatter` takes `src` with
/// `world * n` elements and `dst` with `n`; `all_gather` the reverse; the `_v`
/// variants take per-rank counts (`counts.len() == world_size`), blocks packed
/// contiguously in rank order.
pub trait Collectives {
    /// This rank in the group.
    fn rank(&self) -> usize;
    /// Number of ranks in the group.
    fn world_size(&self) -> usize;
    /// Group name (used in every error message).
    fn name(&self) -> &str;
    /// The device whose tensors this communicator moves.
    fn device(&self) -> Device;
    /// A sub-communicator of the ranks `ranks` (group-local rank numbers,
    /// distinct, ascending order not required). Called by every member, with the
    /// same list; the new group's rank order is the list order.
    fn split(&self, ranks: &[usize]) -> Result<Comm>;
    /// `dst = op(src over ranks)`.
    fn all_reduce(&self, src: &Tensor, dst: &mut Tensor, op: ReduceOp) -> Result<()>;
    /// In-place all-reduce.
    fn all_reduce_in_place(&self, buf: &mut Tensor, op: ReduceOp) -> Result<()>;
    /// `dst = block rank of op(src over ranks)`.
    fn reduce_scatter(&self, src: &Tensor, dst: &mut Tensor, op: ReduceOp) -> Result<()>;
    /// `dst = concat(src of every rank)`.
    fn all_gather(&self, src: &Tensor, dst: &mut Tensor) -> Result<()>;
    /// Reduce-scatter with per-rank block sizes `counts`.
    fn reduce_scatter_v(&self, src: &Tensor, dst: &mut Tensor, counts: &[usize], op: ReduceOp) -> Result<()>;
    /// All-gather with per-rank block sizes `counts`.
    fn all_gather_v(&self, src: &Tensor, dst: &mut Tensor, counts: &[usize]) -> Result<()>;
    /// Personalised exchange: block `j` of `src` (`send_counts[j]` elements) goes
    /// to rank `j`; block `i` of `dst` (`recv_counts[i]`) comes from rank `i`.
    fn all_to_all_v(&self, src: &Tensor, send_counts: &[usize], dst: &mut Tensor, recv_counts: &[usize]) -> Result<()>;
    /// Copies `buf` of rank `root` into `buf` of every rank.
    fn broadcast(&self, buf: &mut Tensor, root: usize) -> Result<()>;
    /// Waits for every rank.
    fn barrier(&self) -> Result<()>;
    /// Finalize routing fused with the EP reduce-scatter (SPEC section 3):
    /// this rank's finalize output (`[N, H...]`, tokens in EP-rank block order,
    /// block `r` = `local_sizes[r]` tokens, `local_sizes.len() == world_size`)
    /// summed over the ranks; `out` (`[local_sizes[rank], H...]`, on this
    /// communicator's device) receives block `rank` of the sum. `args` and
    /// `dims` are validated by the op layer, `out` has the shape it computed.
    ///
    /// The default materialises the padded `[world * M, H...]` buffer
    /// ([`finalize_then_reduce_scatter`]); a communicator that can compute the
    /// rows straight into its own transfer buffers overrides it, with a result
    /// that is bitwise the same.
    fn finalize_reduce_scatter(
        &self,
        args: &FinalizeArgs<'_>,
        dims: &FinalizeDims,
        local_sizes: &[usize],
        out: &mut Tensor,
    ) -> Result<()> {
        finalize_then_reduce_scatter(self, args, dims, local_sizes, out)
    }
}

/// [`Collectives::finalize_reduce_scatter`] in two steps on any backend: the
/// finalize writes each token into its row of the padded `[world * M, H...]`
/// buffer (`M = max(local_sizes)`, padding rows zero), which is then
/// reduce-scattered; the first `local_sizes[rank]` rows of this rank's slot go
/// to `out`.
pub fn finalize_then_reduce_scatter<C: Collectives + ?Sized>(
    comm: &C,
    args: &FinalizeArgs<'_>,
    dims: &FinalizeDims,
    local_sizes: &[usize],
    out: &mut Tensor,
) -> Result<()> {
    const OP: &str = "finalize_and_reduce";
    let m = local_sizes.iter().copied().max().unwrap_or(0);
    let mine = local_sizes.get(comm.rank()).copied().ok_or_else(|| {
        Error::invalid(
            OP,
            "local_sizes",
            format!("{} entries, but the group has {} ranks", local_sizes.len(), comm.world_size()),
        )
    })?;
    let padded_shape = with_rows(OP, "expanded_x", out.shape(), local_sizes.len() * m)?;
    let slot_shape = with_rows(OP, "expanded_x", out.shape(), m)?;
    let device = out.device();
    let backend = device.backend();
    let mut padded = backend.scratch(&padded_shape, out.dtype())?;
    if padded.numel() == 0 {
        // Every rank sees the same layout, so every rank skips together; `out`
        // is empty as well (no slot rows, or empty rows).
        return Ok(());
    }
    backend.finalize_routing(args, dims, &mut padded, OutputRows::Padded { local_sizes, slot_rows: m })?;
    if mine == m {
        return comm.reduce_scatter(&padded, out, ReduceOp::Sum);
    }
    let mut slot = backend.scratch(&slot_shape, out.dtype())?;
    comm.reduce_scatter(&padded, &mut slot, ReduceOp::Sum)?;
    if mine > 0 {
        backend.copy_rows(&slot, 0, out, 0, mine)?;
    }
    Ok(())
}

/// A communicator on either backend.
#[derive(Debug, Clone)]
pub enum Comm {
    /// Shared-memory CPU communicator.
    Cpu(CpuComm),
    /// HCCL communicator (real or simulated CANN).
    Npu(HcclComm),
}

/// Refuses a reduction (`op` names it) of a dtype that is only moved: the
/// one-byte dtypes (i8, u8, bool, f8e4m3, f8e5m2) are exact byte moves in
/// all_gather(_v), all_to_all_v and broadcast, never summed (SPEC section 8).
pub(crate) fn check_reducible(op: &'static str, arg: &'static str, dtype: crate::DType) -> Result<()> {
    if dtype.is_reducible() {
        return Ok(());
    }
    Err(Error::dtype(
        op,
        arg,
        format!("a reducible dtype (f32, f16, bf16, i32, i64); {dtype} is moved as bytes, never reduced"),
        dtype,
    ))
}

macro_rules! dispatch {
    ($self:ident, $c:ident => $e:expr) => {
        match $self {
            Comm::Cpu($c) => $e,
            Comm::Npu($c) => $e,
        }
    };
}

impl Collectives for Comm {
    fn rank(&self) -> usize {
        dispatch!(self, c => c.rank())
    }
    fn world_size(&self) -> usize {
        dispatch!(self, c => c.world_size())
    }
    fn name(&self) -> &str {
        dispatch!(self, c => c.name())
    }
    fn device(&self) -> Device {
        dispatch!(self, c => c.device())
    }
    fn split(&self, ranks: &[usize]) -> Result<Comm> {
        dispatch!(self, c => c.split(ranks))
    }
    fn all_reduce(&self, src: &Tensor, dst: &mut Tensor, op: ReduceOp) -> Result<()> {
        check_reducible("all_reduce", "src", src.dtype())?;
        dispatch!(self, c => c.all_reduce(src, dst, op))
    }
    fn all_reduce_in_place(&self, buf: &mut Tensor, op: ReduceOp) -> Result<()> {
        check_reducible("all_reduce", "buf", buf.dtype())?;
        dispatch!(self, c => c.all_reduce_in_place(buf, op))
    }
    fn reduce_scatter(&self, src: &Tensor, dst: &mut Tensor, op: ReduceOp) -> Result<()> {
        check_reducible("reduce_scatter", "src", src.dtype())?;
        dispatch!(self, c => c.reduce_scatter(src, dst, op))
    }
    fn all_gather(&self, src: &Tensor, dst: &mut Tensor) -> Result<()> {
        dispatch!(self, c => c.all_gather(src, dst))
    }
    fn reduce_scatter_v(&self, src: &Tensor, dst: &mut Tensor, counts: &[usize], op: ReduceOp) -> Result<()> {
        check_reducible("reduce_scatter_v", "src", src.dtype())?;
        dispatch!(self, c => c.reduce_scatter_v(src, dst, counts, op))
    }
    fn all_gather_v(&self, src: &Tensor, dst: &mut Tensor, counts: &[usize]) -> Result<()> {
        dispatch!(self, c => c.all_gather_v(src, dst, counts))
    }
    fn all_to_all_v(&self, src: &Tensor, send_counts: &[usize], dst: &mut Tensor, recv_counts: &[usize]) -> Result<()> {
        dispatch!(self, c => c.all_to_all_v(src, send_counts, dst, recv_counts))
    }
    fn broadcast(&self, buf: &mut Tensor, root: usize) -> Result<()> {
        dispatch!(self, c => c.broadcast(buf, root))
    }
    fn barrier(&self) -> Result<()> {
        dispatch!(self, c => c.barrier())
    }
    fn finalize_reduce_scatter(
        &self,
        args: &FinalizeArgs<'_>,
        dims: &FinalizeDims,
        local_sizes: &[usize],
        out: &mut Tensor,
    ) -> Result<()> {
        dispatch!(self, c => c.finalize_reduce_scatter(args, dims, local_sizes, out))
    }
}

/// `[dp_rank, pcp_rank, tp_rank]` of `world`'s rank in the DP x PCP x TP
/// order (`rank = (dp * PCP + pcp) * TP + tp`). An error naming the three sizes
/// when the world size is not `DP * pcp_size * tp_size` for a whole DP size.
pub(crate) fn dp_pcp_tp_coords(op: &'static str, world: &Comm, pcp_size: usize, tp_size: usize) -> Result<[usize; 3]> {
    let n = world.world_size();
    let cell = pcp_size.checked_mul(tp_size).unwrap_or(0);
    if cell == 0 || n % cell != 0 {
        return Err(Error::invalid(
            op,
            "pcp_size",
            format!("the world of {n} ranks is not DP x PCP {pcp_size} x TP {tp_size} for any DP size"),
        ));
    }
    let r = world.rank();
    Ok([r / cell, (r / tp_size) % pcp_size, r % tp_size])
}

/// The TP, DP and EP groups of a world of `dp * tp` ranks.
///
/// World rank `r` has `dp_rank = r / tp`, `tp_rank = r % tp`; its TP group is
/// the `tp` consecutive ranks of its DP replica, its DP group the ranks with its
/// `tp_rank`, and its EP group the whole world with EP rank `dp_rank * tp +
/// tp_rank` (equal to the world rank).
#[derive(Debug, Clone)]
pub struct ParallelGroups {
    /// The whole world.
    pub world: Comm,
    /// Tensor-parallel group (size `tp`).
    pub tp: Comm,
    /// Data-parallel group (size `dp`).
    pub dp: Comm,
    /// Expert-parallel group (size `dp * tp`, or `dp * pcp * tp` with PCP).
    pub ep: Comm,
    /// Prefill-context-parallel group (size `pcp`, same DP and TP rank); `None`
    /// when built without PCP ([`ParallelGroups::new`]).
    pub pcp: Option<Comm>,
}

impl ParallelGroups {
    /// Builds the groups; called by every rank of `world` with the same sizes.
    pub fn new(world: &Comm, dp_size: usize, tp_size: usize) -> Result<Self> {
        let n = world.world_size();
        if dp_size == 0 || tp_size == 0 || dp_size * tp_size != n {
            return Err(Error::invalid(
                "ParallelGroups::new",
                "dp_size",
                format!("dp_size {dp_size} x tp_size {tp_size} must equal the world size {n}"),
            ));
        }
        let r = world.rank();
        let (dp_rank, tp_rank) = (r / tp_size, r % tp_size);
        let tp_ranks: Vec<usize> = (0..tp_size).map(|t| dp_rank * tp_size + t).collect();
        let dp_ranks: Vec<usize> = (0..dp_size).map(|d| d * tp_size + tp_rank).collect();
        let ep_ranks: Vec<usize> = (0..n).collect();
        let tp = world.split(&tp_ranks)?;
        let dp = world.split(&dp_ranks)?;
        let ep = world.split(&ep_ranks)?;
        Ok(ParallelGroups { world: world.clone(), tp, dp, ep, pcp: None })
    }

    /// The groups of a world of `dp * pcp * tp` ranks in vLLM-Ascend's order
    /// DP x PCP x TP: world rank `(dp_rank * pcp + pcp_rank) * tp + tp_rank`
    /// (equal to the EP rank). TP groups are `tp` consecutive ranks, DP groups
    /// share (pcp_rank, tp_rank), PCP groups share (dp_rank, tp_rank). Called by
    /// every rank with the same sizes; an error names the three sizes when
    /// they do not multiply to the world size.
    pub fn with_pcp(world: &Comm, dp_size: usize, pcp_size: usize, tp_size: usize) -> Result<Self> {
        const OP: &str = "ParallelGroups::with_pcp";
        let n = world.world_size();
        if dp_size.checked_mul(pcp_size).and_then(|c| c.checked_mul(tp_size)) != Some(n) || n == 0 {
            return Err(Error::invalid(
                OP,
                "dp_size",
                format!("DP {dp_size} x PCP {pcp_size} x TP {tp_size} must equal the world size {n}"),
            ));
        }
        let [d, p, t] = dp_pcp_tp_coords(OP, world, pcp_size, tp_size)?;
        let at = |d: usize, p: usize, t: usize| (d * pcp_size + p) * tp_size + t;
        let tp = world.split(&(0..tp_size).map(|i| at(d, p, i)).collect::<Vec<_>>())?;
        let dp = world.split(&(0..dp_size).map(|i| at(i, p, t)).collect::<Vec<_>>())?;
        let pcp = world.split(&(0..pcp_size).map(|i| at(d, i, t)).collect::<Vec<_>>())?;
        let ep = world.split(&(0..n).collect::<Vec<_>>())?;
        Ok(ParallelGroups { world: world.clone(), tp, dp, ep, pcp: Some(pcp) })
    }
}
