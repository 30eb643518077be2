//! Backend-neutral communication: [`Comm`], [`ReduceOp`], [`CommType`] and the
//! [`Collectives`] trait both backends implement.
//!
//! Counts are in elements. Every collective checks that all ranks called the
//! same thing (kind, counts, dtype, root, op) and fails on every rank with an
//! error naming the collective, group, ranks and sizes when they did not; a
//! CPU communicator also compares the ranks' shapes ([`Collectives`]).
//! Every wait has a timeout.

use crate::backend::cpu::{CpuBackend, CpuComm};
use crate::backend::npu::{HcclComm, NpuDevice};
use crate::backend::{Backend, Buf, Call, Communicator, FinalizeArgs, FinalizeDims, View, ViewMut};
use crate::tensor::StorageBuffer;
use crate::types::{numbered, Numbered};
pub use crate::types::{CommOptions, ReduceOp};
use crate::{DType, Device, Error, Result, Tensor};

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
/// contiguously in rank order. Written once over every [`Communicator`]: each
/// tensor is lent as a view of the communicator's own buffers.
///
/// Shapes: a rank's `src` and `dst` may differ in shape (only their element
/// counts are tied, as above; an all-reduce reduces the elements in order).
/// Across ranks, a CPU communicator also requires the same shape of `src`
/// on every rank (of `buf` for [`Collectives::broadcast`] and
/// [`Collectives::all_reduce_in_place`], which agrees with a peer's
/// out-of-place [`Collectives::all_reduce`] of the same shape; for
/// [`Collectives::all_gather_v`] and [`Collectives::all_to_all_v`] the same
/// dimensions after the first), and otherwise fails on every rank naming
/// each rank's shape: equal counts of differently shaped tensors are
/// usually a bug. An HCCL communicator compares element counts only (HCCL
/// sees no shapes).
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
    /// A barrier ordered on `device`'s stream (a handle of this
    /// communicator's device, e.g. one over the caller's stream): on an NPU it
    /// is queued there and returns at once, the work queued after it running
    /// once every rank reached it (a rank that never does is reported by the
    /// stream's check, after the communicator's timeout; HCCL's barrier
    /// itself has no execution timeout, so the stream stays blocked behind
    /// it); on the CPU it waits as [`Collectives::barrier`]. A
    /// device other than the communicator's is an error naming both, which
    /// on the CPU also fails the peers waiting in the barrier at once.
    fn barrier_on(&self, device: &Device) -> Result<()>;
    /// Finalize routing fused with the EP reduce-scatter (SPEC section 3),
    /// [`Communicator::finalize_reduce_scatter`]: `out`
    /// (`[local_sizes[rank], H...]`, on this communicator's device) receives
    /// block `rank` of the summed finalize output.
    fn finalize_reduce_scatter(
        &self,
        args: &FinalizeArgs<&Tensor>,
        dims: &FinalizeDims,
        local_sizes: &[usize],
        out: &mut Tensor,
    ) -> Result<()>;
    /// Reports `error`, found by this rank before `call` (of `dtype`), to
    /// the peers that are making `call`: [`Communicator::refuse`]. A CPU
    /// communicator joins the collective without data, so every rank fails
    /// at once with this rank's reason; an HCCL one returns `error`.
    fn refuse_call(&self, call: Call<'_>, dtype: crate::DType, error: Error) -> Error;
}

/// Whether a rank with nothing to move or reduce still takes part in the
/// collective: on the CPU communicator it does, so a peer with rows meets a
/// count of 0 (a clear mismatch on every rank) instead of its next call.
/// HCCL refuses the empty buffers, so on an NPU the empty rank skips it, and
/// a peer that expected data waits out the execution timeout, reported by
/// the stream check.
pub(crate) fn joins_empty<C: Collectives + ?Sized>(group: &C) -> bool {
    matches!(group.device(), crate::Device::Cpu)
}

/// The error of the collective that moves the argument `arg` of the op
/// `op` (or rows of it), when the ranks disagreed on the call: names the op
/// and the argument besides the collective, whose text names each rank's
/// counts and shape (`maybe_pad_and_reduce (the reduce_scatter of `x`) on
/// group ...: ranks [0] called reduce_scatter ... src shape [4, 4]; ranks
/// [1] ... src shape [8, 2]`). Any other error is returned as it is.
pub(crate) fn moving(op: &'static str, arg: &'static str) -> impl Fn(Error) -> Error {
    move |e| match e {
        Error::Comm { collective, group, rank, world, detail, kind: crate::CommErrorKind::Mismatch } => Error::Comm {
            collective: format!("{op} (the {collective} of `{arg}`)"),
            group,
            rank,
            world,
            detail,
            kind: crate::CommErrorKind::Mismatch,
        },
        e => e,
    }
}

/// Refuses a reduction (`op` names it, `call` says whether it is one) of a
/// dtype that is only moved: the one-byte dtypes (i8, u8, bool, f8e4m3,
/// f8e5m2) are exact byte moves in all_gather(_v), all_to_all_v and broadcast,
/// never summed (SPEC section 8). Every Tensor-level collective passes here,
/// on [`Comm`] and on each backend's communicator alike.
pub(crate) fn reducible(op: &'static str, arg: &'static str, call: Call<'_>, dtype: crate::DType) -> Result<()> {
    if !call.reduces() || dtype.is_reducible() {
        return Ok(());
    }
    Err(Error::dtype(
        op,
        arg,
        format!("a reducible dtype (f32, f16, bf16, i32, i64); {dtype} is moved as bytes, never reduced"),
        dtype,
    ))
}

/// Lends `src` and `dst` to `comm` and runs `f` on the views; when either is
/// not a buffer of its backend, or `call` reduces a dtype that is only moved,
/// `comm` refuses `call` with that error (so every rank fails at once).
fn lend2<C: Communicator>(
    comm: &C,
    op: &'static str,
    call: Call<'_>,
    src: &Tensor,
    dst: &mut Tensor,
    f: impl FnOnce(View<'_, Buf<C>>, ViewMut<'_, Buf<C>>) -> Result<()>,
) -> Result<()>
where
    Buf<C>: StorageBuffer,
{
    let at = comm.backend().location();
    let views = reducible(op, "src", call, src.dtype())
        .and_then(|_| src.view(op, "src", &at))
        .and_then(|s| Ok((s, dst.view_mut(op, "dst", &at)?)));
    match views {
        Ok((s, d)) => f(s, d),
        Err(e) => Err(comm.refuse(call, src.dtype(), e)),
    }
}

/// [`lend2`] for the one operand of an in-place collective.
fn lend1<C: Communicator>(
    comm: &C,
    op: &'static str,
    call: Call<'_>,
    buf: &mut Tensor,
    f: impl FnOnce(ViewMut<'_, Buf<C>>) -> Result<()>,
) -> Result<()>
where
    Buf<C>: StorageBuffer,
{
    let at = comm.backend().location();
    let dtype = buf.dtype();
    match reducible(op, "buf", call, dtype).and_then(|_| buf.view_mut(op, "buf", &at)) {
        Ok(b) => f(b),
        Err(e) => Err(comm.refuse(call, dtype, e)),
    }
}

/// The backend handle a [`Device`] holds, when it is one of this backend.
pub trait OfDevice: Sized {
    /// `device`'s handle of this backend, or `None` for another backend.
    fn of_device(device: &Device) -> Option<Self>;
}

impl OfDevice for CpuBackend {
    fn of_device(device: &Device) -> Option<Self> {
        matches!(device, Device::Cpu).then_some(CpuBackend)
    }
}

impl OfDevice for NpuDevice {
    fn of_device(device: &Device) -> Option<Self> {
        match device {
            Device::Npu(d) => Some(d.clone()),
            Device::Cpu => None,
        }
    }
}

impl<C> Collectives for C
where
    C: Communicator,
    C::Backend: OfDevice,
    Buf<C>: StorageBuffer,
    C::Backend: Clone,
    Device: From<C::Backend>,
    Comm: From<C>,
{
    fn rank(&self) -> usize {
        Communicator::rank(self)
    }
    fn world_size(&self) -> usize {
        Communicator::world_size(self)
    }
    fn name(&self) -> &str {
        Communicator::name(self)
    }
    fn device(&self) -> Device {
        Device::from(self.backend().clone())
    }
    fn split(&self, ranks: &[usize]) -> Result<Comm> {
        Ok(Comm::from(Communicator::split(self, ranks)?))
    }
    fn all_reduce(&self, src: &Tensor, dst: &mut Tensor, op: ReduceOp) -> Result<()> {
        lend2(self, "all_reduce", Call::AllReduce(op), src, dst, |s, d| Communicator::all_reduce(self, s, d, op))
    }
    fn all_reduce_in_place(&self, buf: &mut Tensor, op: ReduceOp) -> Result<()> {
        lend1(self, "all_reduce", Call::AllReduceInPlace(op), buf, |b| Communicator::all_reduce_in_place(self, b, op))
    }
    fn reduce_scatter(&self, src: &Tensor, dst: &mut Tensor, op: ReduceOp) -> Result<()> {
        let call = Call::ReduceScatter(op);
        lend2(self, "reduce_scatter", call, src, dst, |s, d| Communicator::reduce_scatter(self, s, d, op))
    }
    fn all_gather(&self, src: &Tensor, dst: &mut Tensor) -> Result<()> {
        lend2(self, "all_gather", Call::AllGather, src, dst, |s, d| Communicator::all_gather(self, s, d))
    }
    fn reduce_scatter_v(&self, src: &Tensor, dst: &mut Tensor, counts: &[usize], op: ReduceOp) -> Result<()> {
        let call = Call::ReduceScatterV(counts, op);
        lend2(self, "reduce_scatter_v", call, src, dst, |s, d| Communicator::reduce_scatter_v(self, s, d, counts, op))
    }
    fn all_gather_v(&self, src: &Tensor, dst: &mut Tensor, counts: &[usize]) -> Result<()> {
        let call = Call::AllGatherV(counts);
        lend2(self, "all_gather_v", call, src, dst, |s, d| Communicator::all_gather_v(self, s, d, counts))
    }
    fn all_to_all_v(&self, src: &Tensor, send_counts: &[usize], dst: &mut Tensor, recv_counts: &[usize]) -> Result<()> {
        let call = Call::AllToAllV(send_counts, recv_counts);
        lend2(self, "all_to_all_v", call, src, dst, |s, d| {
            Communicator::all_to_all_v(self, s, send_counts, d, recv_counts)
        })
    }
    fn broadcast(&self, buf: &mut Tensor, root: usize) -> Result<()> {
        lend1(self, "broadcast", Call::Broadcast(root), buf, |b| Communicator::broadcast(self, b, root))
    }
    fn barrier(&self) -> Result<()> {
        Communicator::barrier(self)
    }
    fn barrier_on(&self, device: &Device) -> Result<()> {
        match C::Backend::of_device(device) {
            Some(on) if *device == Collectives::device(self) => Communicator::barrier_on(self, &on),
            _ => {
                let e = Error::Device {
                    op: "barrier",
                    arg: "device",
                    expected: format!("{} (the communicator's device)", Collectives::device(self)),
                    actual: device.to_string(),
                };
                // The peers wait in the barrier: a CPU group fails there at
                // once with this reason (the refusal's kind is not compared).
                Err(Communicator::refuse(self, Call::AllGather, crate::DType::U8, e))
            }
        }
    }
    fn finalize_reduce_scatter(
        &self,
        args: &FinalizeArgs<&Tensor>,
        dims: &FinalizeDims,
        local_sizes: &[usize],
        out: &mut Tensor,
    ) -> Result<()> {
        const OP: &str = "moe_finalize_routing";
        let at = self.backend().location();
        let views = args.try_map(|arg, t| t.view(OP, arg, &at)).and_then(|v| Ok((v, out.view_mut(OP, "out", &at)?)));
        match views {
            Ok((v, o)) => Communicator::finalize_reduce_scatter(self, &v, dims, local_sizes, o),
            Err(e) => Err(Communicator::refuse(self, Call::ReduceScatter(ReduceOp::Sum), args.expanded_x.dtype(), e)),
        }
    }
    fn refuse_call(&self, call: Call<'_>, dtype: crate::DType, error: Error) -> Error {
        Communicator::refuse(self, call, dtype, error)
    }
}

impl From<CpuComm> for Comm {
    fn from(c: CpuComm) -> Self {
        Comm::Cpu(c)
    }
}

impl From<HcclComm> for Comm {
    fn from(c: HcclComm) -> Self {
        Comm::Npu(c)
    }
}

/// A communicator on either backend.
#[derive(Debug, Clone)]
pub enum Comm {
    /// Shared-memory CPU communicator.
    Cpu(CpuComm),
    /// HCCL communicator (real or simulated CANN).
    Npu(HcclComm),
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
        dispatch!(self, c => Collectives::rank(c))
    }
    fn world_size(&self) -> usize {
        dispatch!(self, c => Collectives::world_size(c))
    }
    fn name(&self) -> &str {
        dispatch!(self, c => Collectives::name(c))
    }
    fn device(&self) -> Device {
        dispatch!(self, c => Collectives::device(c))
    }
    fn split(&self, ranks: &[usize]) -> Result<Comm> {
        dispatch!(self, c => Collectives::split(c, ranks))
    }
    fn all_reduce(&self, src: &Tensor, dst: &mut Tensor, op: ReduceOp) -> Result<()> {
        dispatch!(self, c => Collectives::all_reduce(c, src, dst, op))
    }
    fn all_reduce_in_place(&self, buf: &mut Tensor, op: ReduceOp) -> Result<()> {
        dispatch!(self, c => Collectives::all_reduce_in_place(c, buf, op))
    }
    fn reduce_scatter(&self, src: &Tensor, dst: &mut Tensor, op: ReduceOp) -> Result<()> {
        dispatch!(self, c => Collectives::reduce_scatter(c, src, dst, op))
    }
    fn all_gather(&self, src: &Tensor, dst: &mut Tensor) -> Result<()> {
        dispatch!(self, c => Collectives::all_gather(c, src, dst))
    }
    fn reduce_scatter_v(&self, src: &Tensor, dst: &mut Tensor, counts: &[usize], op: ReduceOp) -> Result<()> {
        dispatch!(self, c => Collectives::reduce_scatter_v(c, src, dst, counts, op))
    }
    fn all_gather_v(&self, src: &Tensor, dst: &mut Tensor, counts: &[usize]) -> Result<()> {
        dispatch!(self, c => Collectives::all_gather_v(c, src, dst, counts))
    }
    fn all_to_all_v(&self, src: &Tensor, send_counts: &[usize], dst: &mut Tensor, recv_counts: &[usize]) -> Result<()> {
        dispatch!(self, c => Collectives::all_to_all_v(c, src, send_counts, dst, recv_counts))
    }
    fn broadcast(&self, buf: &mut Tensor, root: usize) -> Result<()> {
        dispatch!(self, c => Collectives::broadcast(c, buf, root))
    }
    fn barrier(&self) -> Result<()> {
        dispatch!(self, c => Collectives::barrier(c))
    }
    fn barrier_on(&self, device: &Device) -> Result<()> {
        dispatch!(self, c => Collectives::barrier_on(c, device))
    }
    fn finalize_reduce_scatter(
        &self,
        args: &FinalizeArgs<&Tensor>,
        dims: &FinalizeDims,
        local_sizes: &[usize],
        out: &mut Tensor,
    ) -> Result<()> {
        dispatch!(self, c => Collectives::finalize_reduce_scatter(c, args, dims, local_sizes, out))
    }
    fn refuse_call(&self, call: Call<'_>, dtype: crate::DType, error: Error) -> Error {
        dispatch!(self, c => Collectives::refuse_call(c, call, dtype, error))
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

/// Checks that every rank of `group` holds `value`: one all-gather of one i32
/// per rank, then [`Backend::expect_all_equal`], both on `on`, the device
/// (on an NPU: the stream) of the op that checks. On the CPU every rank
/// fails at once with `mismatch`'s error (given every rank's value); on an
/// NPU the values are compared on the device and every rank's next check of
/// the op's stream fails with it (given the first rank that differs): no
/// host sync, capturable with the op. (A communicator's own device may have
/// another stream: the C ABI's runs ops on the call's stream.)
pub(crate) fn expect_group_agrees<C: Collectives + ?Sized>(
    group: &C,
    on: &Device,
    value: i32,
    mismatch: crate::backend::Mismatch,
) -> Result<()> {
    let backend = on.backend();
    let mine = backend.scratch_from_host(&Tensor::from_slice(&[value], &[1])?)?;
    let mut all = backend.scratch(&[group.world_size()], DType::I32)?;
    group.all_gather(&mine, &mut all)?;
    backend.expect_all_equal(&all, value, mismatch)
}

/// Before `world` is split into groups: every rank passed the same `sizes`
/// (`(name, value)` pairs), checked on a CPU world with one all-gather of
/// them. Ranks that passed other sizes then fail at once, each naming every
/// rank's sizes, and a rank whose own sizes are invalid (`own`, its check of
/// them) refuses through the all-gather ([`Collectives::refuse_call`]);
/// otherwise `own` is returned. Without it the splits would wait out the
/// timeout for members that ask for other lists, or for none. An HCCL world
/// returns `own` and splits as it is: a member that never comes is reported
/// by HCCL after `HCCL_CONNECT_TIMEOUT` (hicann/hccl
/// `docs/zh/user_guide/hccl_env/HCCL_CONNECT_TIMEOUT.md`: the wait for the
/// peers to join a communicator).
pub(crate) fn agree_on_sizes<T>(
    op: &'static str,
    world: &Comm,
    sizes: &[(&'static str, usize)],
    own: Result<T>,
) -> Result<T> {
    let n = world.world_size();
    if !matches!(world.device(), Device::Cpu) || n < 2 {
        return own;
    }
    // Each size as the 64 bits of an i64.
    let mine: Vec<i64> = sizes.iter().map(|&(_, s)| s as u64 as i64).collect();
    let k = mine.len();
    let staged = own.and_then(|v| Ok((v, Tensor::from_slice(&mine, &[k])?)));
    let (v, staged) = staged.map_err(|e| world.refuse_call(Call::AllGather, DType::I64, e))?;
    let mut all = Tensor::try_zeros_cpu(&[n * k], DType::I64)?;
    world.all_gather(&staged, &mut all)?;
    let all = all.to_vec::<i64>()?;
    if all.chunks(k).all(|c| c == mine) {
        return Ok(v);
    }
    let passed = |c: &[i64]| -> String {
        let each: Vec<String> = sizes.iter().zip(c).map(|((name, _), &v)| format!("{name} {}", v as u64)).collect();
        each.join(", ")
    };
    let ranks: Vec<String> = all.chunks(k).enumerate().map(|(r, c)| format!("rank {r} passed {}", passed(c))).collect();
    Err(Error::Comm {
        collective: op.to_string(),
        group: world.name().to_string(),
        rank: world.rank(),
        world: n,
        detail: format!("the ranks disagree on the group sizes: {}", ranks.join("; ")),
        kind: crate::CommErrorKind::Mismatch,
    })
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
        const OP: &str = "ParallelGroups::new";
        let n = world.world_size();
        let own = if dp_size == 0 || tp_size == 0 || dp_size.checked_mul(tp_size) != Some(n) {
            Err(Error::invalid(
                OP,
                "dp_size",
                format!("dp_size {dp_size} x tp_size {tp_size} must equal the world size {n}"),
            ))
        } else {
            Ok(())
        };
        agree_on_sizes(OP, world, &[("dp_size", dp_size), ("tp_size", tp_size)], own)?;
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
        let coords = if dp_size.checked_mul(pcp_size).and_then(|c| c.checked_mul(tp_size)) != Some(n) || n == 0 {
            Err(Error::invalid(
                OP,
                "dp_size",
                format!("DP {dp_size} x PCP {pcp_size} x TP {tp_size} must equal the world size {n}"),
            ))
        } else {
            dp_pcp_tp_coords(OP, world, pcp_size, tp_size)
        };
        let sizes = [("dp_size", dp_size), ("pcp_size", pcp_size), ("tp_size", tp_size)];
        let [d, p, t] = agree_on_sizes(OP, world, &sizes, coords)?;
        let at = |d: usize, p: usize, t: usize| (d * pcp_size + p) * tp_size + t;
        let tp = world.split(&(0..tp_size).map(|i| at(d, p, i)).collect::<Vec<_>>())?;
        let dp = world.split(&(0..dp_size).map(|i| at(i, p, t)).collect::<Vec<_>>())?;
        let pcp = world.split(&(0..pcp_size).map(|i| at(d, i, t)).collect::<Vec<_>>())?;
        let ep = world.split(&(0..n).collect::<Vec<_>>())?;
        Ok(ParallelGroups { world: world.clone(), tp, dp, ep, pcp: Some(pcp) })
    }
}
