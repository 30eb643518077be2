//! Runtime-aware reductions (SPEC section 5).
//!
//! Whether the routed output is already reduced depends on the MoE
//! communication type, which is chosen per forward pass. So the static
//! [`ReducePolicy`] (built once per layer, e.g. at graph-trace time) holds only
//! what is static, and each of the three reduction points takes the live
//! [`CommType`] as an argument: a graph traced under one comm type and replayed
//! under another reduces exactly once.
//!
//! Ownership: every reduction point consumes its input. When it reduces, it
//! all-reduces in place in that same buffer and returns it; when it does not,
//! it returns the input unchanged. The result never aliases another live
//! tensor. Shape functions of these ops are the identity.
//!
//! Each point also has an `_into` twin that reads `x` and writes the result
//! into `out` of the same shape: a copy of `x`, all-reduced there in place when
//! the point reduces. `out` may be `x` itself (then nothing is copied) and
//! may not overlap it otherwise ([`Output`]). [`ReducePoint`] names the three
//! points, for callers that choose one at run time
//! ([`ReducePolicy::reduces`], [`ReducePolicy::reduce_at`],
//! [`ReducePolicy::reduce_at_into`]).

use crate::backend::Call;
use crate::comm::{joins_empty, moving, Collectives, CommType, ReduceOp};
use crate::moe::finalize::check_out_like;
use crate::moe::output::Output;
use crate::moe::prepare_finalize::{comm_type_agreement, comm_type_check_enabled, Facts};
use crate::types::{numbered, Numbered};
use crate::{Error, Result, Tensor};

/// True when the routed output of a comm type is already the full sum on every
/// rank: `comm in {MC2, ALLTOALL, FUSED_MC2} or (comm == ALLGATHER and sp)`.
/// (ALLGATHER without SP leaves each rank with a TP-partial sum.)
pub fn routed_is_reduced(comm: CommType, sp: bool) -> bool {
    match comm {
        CommType::Mc2 | CommType::AllToAll | CommType::FusedMc2 => true,
        CommType::AllGather => sp,
    }
}

numbered! {
    /// How the shared expert of a layer is parallelised (static).
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    pub enum SharedMode {
        /// No shared expert.
        None = 0 => "NONE",
        /// TP-sharded weights: each TP rank's output is a TP-partial sum.
        TensorParallel = 1 => "TENSOR_PARALLEL",
        /// Sequence parallel (SEDP): output already complete on the shard.
        SequenceParallelSedp = 2 => "SEQUENCE_PARALLEL_SEDP",
        /// Sequence parallel only: output already complete on the shard.
        SequenceParallelOnly = 3 => "SEQUENCE_PARALLEL_ONLY",
        /// Replicated weights: output complete.
        DataParallelOnly = 4 => "DATA_PARALLEL_ONLY",
    }
}

impl SharedMode {
    /// Every mode, in numbering order.
    pub const ALL: [SharedMode; 5] = Self::VARIANTS;

    /// The mode for its number; `Err` names the bad value.
    pub fn from_u32(v: u32) -> Result<Self> {
        Self::try_from(v).map_err(|_| {
            Error::invalid(
                "SharedMode",
                "shared_mode",
                format!("unknown shared-expert mode {v} (expected {})", Self::expected()),
            )
        })
    }

    /// Name for tables.
    pub fn name(self) -> &'static str {
        match self {
            SharedMode::None => "none",
            SharedMode::TensorParallel => "tp",
            SharedMode::SequenceParallelSedp => "sp-sedp",
            SharedMode::SequenceParallelOnly => "sp-only",
            SharedMode::DataParallelOnly => "dp-only",
        }
    }

    /// The two sequence-parallel modes.
    pub fn is_sequence_parallel(self) -> bool {
        matches!(self, SharedMode::SequenceParallelSedp | SharedMode::SequenceParallelOnly)
    }
}

/// One of the three reduction points of SPEC section 5.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReducePoint {
    /// 1: the routed output, before the transform.
    RoutedEarly,
    /// 2: the shared-expert output.
    Shared,
    /// 3: after `out = shared + routed`.
    Final,
}

impl ReducePoint {
    /// The three points, in layer order.
    pub const ALL: [ReducePoint; 3] = [ReducePoint::RoutedEarly, ReducePoint::Shared, ReducePoint::Final];

    /// The op name errors carry (`"reduce_routed_early"`, ...).
    pub fn op(self) -> &'static str {
        match self {
            ReducePoint::RoutedEarly => "reduce_routed_early",
            ReducePoint::Shared => "reduce_shared",
            ReducePoint::Final => "reduce_final",
        }
    }
}

/// The static per-layer reduction policy. It holds no comm type: the decisions
/// that depend on one are made at each reduction point with the live type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ReducePolicy {
    shared_mode: SharedMode,
    has_routed_transform: bool,
    sp: bool,
    tp_size: usize,
    ep_size: usize,
    early: bool,
}

/// Reports `error`, found in this rank's own arguments at a reduction
/// point that reduces when `reduce`, to the TP peers through the
/// collective they make first ([`Collectives::refuse_call`]): the
/// comm-type agreement where the check is on, else the all-reduce. A CPU
/// group then fails on every rank at once, naming this rank's argument,
/// instead of its peers waiting out the timeout. With one rank, or a
/// point no peer communicates at, the error is returned as it is.
pub(crate) fn refuse_at_point<C: Collectives + ?Sized>(
    reduce: bool,
    tp: &C,
    dtype: crate::DType,
    error: Error,
) -> Error {
    if tp.world_size() < 2 {
        return error;
    }
    if comm_type_check_enabled(tp) {
        tp.refuse_call(Call::AllGather, dtype, error)
    } else if reduce {
        tp.refuse_call(Call::AllReduceInPlace(ReduceOp::Sum), dtype, error)
    } else {
        error
    }
}

/// A reduction point's `_into` method: `name(x, comm, tp, out)` is
/// [`ReducePolicy::reduce_at_into`] of its point, `out` possibly `x` itself.
macro_rules! into_point {
    ($(#[$doc:meta])* $name:ident, $point:expr) => {
        $(#[$doc])*
        pub fn $name<C: Collectives + ?Sized>(&self, x: &Tensor, comm: CommType, tp: &C, out: &mut Tensor) -> Result<()> {
            self.reduce_at_out($point, x, comm, tp, out)
        }
    };
}

impl ReducePolicy {
    /// Builds the policy. Errors: a zero size, `ep_size` not a multiple of
    /// `tp_size` (EP = DP x TP), a sequence-parallel shared mode without SP, or
    /// `TensorParallel` with SP on and `tp_size > 1` (that expert is
    /// `SequenceParallelOnly`; see [`crate::moe::shared`]).
    pub fn new(
        shared_mode: SharedMode,
        has_routed_transform: bool,
        sp: bool,
        tp_size: usize,
        ep_size: usize,
    ) -> Result<Self> {
        const OP: &str = "ReducePolicy::new";
        if tp_size == 0 {
            return Err(Error::invalid(OP, "tp_size", "expected >= 1, got 0"));
        }
        if ep_size == 0 || ep_size % tp_size != 0 {
            return Err(Error::invalid(
                OP,
                "ep_size",
                format!("{ep_size} is not a positive multiple of tp_size {tp_size} (EP = DP x TP)"),
            ));
        }
        if shared_mode.is_sequence_parallel() && !sp {
            return Err(Error::invalid(
                OP,
                "shared_mode",
                format!("{} needs sequence parallelism, but sp is false", shared_mode.name()),
            ));
        }
        if shared_mode == SharedMode::TensorParallel && sp && tp_size > 1 {
            // vLLM-Ascend (`ops/fused_moe/shared_experts.py`,
            // `parallel_mode`): with sharded activations and TP-sharded
            // weights the shared expert gathers the shards, runs its weight
            // shard and reduce-scatters, so its output is complete on the shard.
            return Err(Error::invalid(
                OP,
                "shared_mode",
                format!(
                    "a TP-sharded shared expert with sp on and tp_size {tp_size} > 1 is SequenceParallelOnly in \
                     vLLM-Ascend's classification, not TensorParallel: use SequenceParallelOnly with the \
                     shared-expert SP helpers (gather_unpad, then pad_reduce_scatter)"
                ),
            ));
        }
        let early = shared_mode == SharedMode::DataParallelOnly
            || (has_routed_transform && !sp && (tp_size > 1 || ep_size > 1));
        Ok(ReducePolicy { shared_mode, has_routed_transform, sp, tp_size, ep_size, early })
    }

    /// `shared == DataParallelOnly or (has_routed_transform and not sp and (tp > 1 or ep > 1))`:
    /// the routed output is reduced before the transform / the shared add.
    pub fn early(&self) -> bool {
        self.early
    }
    /// The shared-expert mode.
    pub fn shared_mode(&self) -> SharedMode {
        self.shared_mode
    }
    /// Whether a transform is applied to the routed output.
    pub fn has_routed_transform(&self) -> bool {
        self.has_routed_transform
    }
    /// Sequence parallelism on.
    pub fn sp(&self) -> bool {
        self.sp
    }
    /// TP group size.
    pub fn tp_size(&self) -> usize {
        self.tp_size
    }
    /// EP group size.
    pub fn ep_size(&self) -> usize {
        self.ep_size
    }

    /// Point 1 decision: TP all-reduce the routed output before the transform.
    pub fn routed_early_reduces(&self, comm: CommType) -> bool {
        self.early && !routed_is_reduced(comm, self.sp)
    }

    /// Point 2 decision: TP all-reduce the shared output.
    pub fn shared_reduces(&self, comm: CommType) -> bool {
        match self.shared_mode {
            SharedMode::TensorParallel => self.early || routed_is_reduced(comm, self.sp),
            _ => false,
        }
    }

    /// Point 3 decision: TP all-reduce `shared + routed`.
    pub fn final_reduces(&self, comm: CommType) -> bool {
        !self.sp && !self.early && !routed_is_reduced(comm, self.sp)
    }

    /// Whether `point` all-reduces under the live `comm`.
    pub fn reduces(&self, point: ReducePoint, comm: CommType) -> bool {
        match point {
            ReducePoint::RoutedEarly => self.routed_early_reduces(comm),
            ReducePoint::Shared => self.shared_reduces(comm),
            ReducePoint::Final => self.final_reduces(comm),
        }
    }

    /// Whether the result of `point` depends on the live comm type: over
    /// more than one TP rank, where [`ReducePolicy::reduces`] differs between
    /// comm types. Work captured at such a point is valid only for the comm
    /// type it was captured under, so it is what a live-context guard
    /// ([`crate::moe::LiveStream::guard`]) must cover; elsewhere a guard would
    /// hold a record for nothing.
    pub fn depends_on_comm_type(&self, point: ReducePoint) -> bool {
        let first = self.reduces(point, CommType::ALL[0]);
        self.tp_size > 1 && CommType::ALL.iter().any(|&c| self.reduces(point, c) != first)
    }

    /// Reduction point `point` with the live comm type: consumes `x` and
    /// returns it, all-reduced in place when [`ReducePolicy::reduces`].
    pub fn reduce_at<C: Collectives + ?Sized>(
        &self,
        point: ReducePoint,
        x: Tensor,
        comm: CommType,
        tp: &C,
    ) -> Result<Tensor> {
        self.agree(point, comm, tp, &x)?;
        self.reduce_if(self.reduces(point, comm), x, tp).map_err(moving(point.op(), "x"))
    }

    /// What every TP rank must hold alike at a point besides the comm type:
    /// ranks of one layer with other policies would decide differently at a
    /// point, one reducing while another copies, and so would ranks at
    /// different points of one policy (one point reduces where another
    /// only copies). With `x_shape`, also the shape of `x`, which the
    /// all-reduce sums elementwise: equal element counts in other shapes
    /// would sum unrelated elements.
    fn facts(&self, point: ReducePoint, x_shape: Option<&[usize]>) -> Facts {
        let mut v = vec![
            self.shared_mode as usize,
            usize::from(self.has_routed_transform),
            usize::from(self.sp),
            self.tp_size,
            self.ep_size,
            usize::from(self.early),
            point as usize,
        ];
        if let Some(shape) = x_shape {
            v.push(shape.len());
            v.extend(shape);
        }
        let (arg, what) = match x_shape {
            Some(_) => (
                "policy` or `x",
                "layer's reduce policy (shared mode, routed transform, SP, TP and EP sizes), reduction point or \
                 shape of `x`",
            ),
            None => (
                "policy",
                "layer's reduce policy (shared mode, routed transform, SP, TP and EP sizes) and reduction point",
            ),
        };
        let shape = x_shape.map(|s| format!(", `x` of shape {s:?}")).unwrap_or_default();
        Facts {
            arg,
            what: what.into(),
            shown: Box::new({
                let p = *self;
                move || {
                    format!(
                        "shared mode {:?}, routed transform {}, sp {}, tp_size {}, ep_size {}, point {}{shape}",
                        p.shared_mode,
                        p.has_routed_transform,
                        p.sp,
                        p.tp_size,
                        p.ep_size,
                        point.op()
                    )
                }
            }),
            print: crate::moe::pad_reduce::fingerprint(&v),
            actual: None,
        }
    }

    /// Before a reduction point decides: every TP rank chose `comm` (SPEC
    /// section 5), where the check is on
    /// ([`comm_type_check_enabled`]). Ranks that disagree would otherwise
    /// decide differently, one reducing while another copies, and the
    /// reduction would pair with a later collective of its peer. Where the
    /// point reduces, an HCCL group also compares the shape of `x` there
    /// (HCCL compares no shapes); a CPU group compares it in the all-reduce
    /// itself, whose error names every rank's shape. The check runs on the
    /// device of `x`, where the point's own work runs.
    fn agree<C: Collectives + ?Sized>(&self, point: ReducePoint, comm: CommType, tp: &C, x: &Tensor) -> Result<()> {
        let op = point.op();
        // The peers' policies match the group: with more than one rank they
        // agree first, where the check is on, else meet in the all-reduce
        // where the point reduces.
        self.check_tp(op, tp).map_err(|e| refuse_at_point(self.reduces(point, comm), tp, crate::DType::I32, e))?;
        if self.tp_size > 1 && comm_type_check_enabled(tp) {
            // Only where the point reduces: a point that copies moves nothing
            // between the ranks.
            let shape = (!matches!(tp.device(), crate::Device::Cpu) && self.reduces(point, comm)).then_some(x.shape());
            comm_type_agreement(op, "TP", comm, Some(self.facts(point, shape)), tp, &x.device())?;
        }
        Ok(())
    }

    /// Reduction point `point` with the live comm type, written to `output`:
    /// in place, `x` is all-reduced where it is when the point reduces (and
    /// left as it is otherwise); separately, `x` is copied into `out` (shape
    /// and dtype of `x`, on its device) and reduced there.
    pub fn reduce_at_into<C: Collectives + ?Sized>(
        &self,
        point: ReducePoint,
        output: Output<'_>,
        comm: CommType,
        tp: &C,
    ) -> Result<()> {
        let (op, reduce) = (point.op(), self.reduces(point, comm));
        if let Output::Separate { x, out } = &output {
            check_out_like(op, x, out, x.shape()).map_err(|e| refuse_at_point(reduce, tp, x.dtype(), e))?;
        }
        let x = match &output {
            Output::InPlace(x) => &**x,
            Output::Separate { x, .. } => *x,
        };
        self.agree(point, comm, tp, x)?;
        match output {
            Output::InPlace(x) => {
                if reduce && self.tp_size > 1 && (x.numel() > 0 || joins_empty(tp)) {
                    tp.all_reduce_in_place(x, ReduceOp::Sum).map_err(moving(op, "x"))?;
                }
                Ok(())
            }
            Output::Separate { x, out } => self.reduce_if_into(reduce, x, tp, out).map_err(moving(op, "x")),
        }
    }

    /// [`ReducePolicy::reduce_at_into`] with `out` a tensor that is `x`
    /// itself or memory apart from it ([`Output::of`] decides).
    pub fn reduce_at_out<C: Collectives + ?Sized>(
        &self,
        point: ReducePoint,
        x: &Tensor,
        comm: CommType,
        tp: &C,
        out: &mut Tensor,
    ) -> Result<()> {
        let output =
            Output::of(point.op(), x, out).map_err(|e| refuse_at_point(self.reduces(point, comm), tp, x.dtype(), e))?;
        self.reduce_at_into(point, output, comm, tp)
    }

    fn check_tp<C: Collectives + ?Sized>(&self, op: &'static str, tp: &C) -> Result<()> {
        if tp.world_size() != self.tp_size {
            return Err(Error::invalid(
                op,
                "tp",
                format!(
                    "group {:?} has {} ranks, the policy's tp_size is {}",
                    tp.name(),
                    tp.world_size(),
                    self.tp_size
                ),
            ));
        }
        Ok(())
    }

    /// `x`, all-reduced in place when `reduce`. After [`Self::agree`], which
    /// checked `tp`.
    fn reduce_if<C: Collectives + ?Sized>(&self, reduce: bool, mut x: Tensor, tp: &C) -> Result<Tensor> {
        if reduce && self.tp_size > 1 && (x.numel() > 0 || joins_empty(tp)) {
            tp.all_reduce_in_place(&mut x, ReduceOp::Sum)?;
        }
        Ok(x)
    }

    /// `out` = the all-reduce of `x` when `reduce` (one out-of-place
    /// collective, no copy first), else `out` = `x`. `out` has the shape and
    /// dtype of `x`, on its device, and does not overlap it (as
    /// [`Self::reduce_at_into`] checked). After [`Self::agree`], which
    /// checked `tp`.
    fn reduce_if_into<C: Collectives + ?Sized>(
        &self,
        reduce: bool,
        x: &Tensor,
        tp: &C,
        out: &mut Tensor,
    ) -> Result<()> {
        let device = x.device();
        if x.numel() == 0 {
            if reduce && self.tp_size > 1 && joins_empty(tp) {
                tp.all_reduce_in_place(out, ReduceOp::Sum)?;
            }
            return Ok(());
        }
        let reduce = reduce && self.tp_size > 1;
        if reduce && !x.shape().is_empty() {
            return tp.all_reduce(x, out, ReduceOp::Sum);
        }
        if x.shape().is_empty() {
            // A scalar is one row of one element.
            let (src, dst) =
                (x.try_clone()?.reshape(&[1])?, std::mem::replace(out, Tensor::zeros_cpu(&[0], x.dtype())));
            let mut dst = dst.reshape(&[1])?;
            let copied = device.backend().copy_rows(&src, 0, &mut dst, 0, 1);
            *out = dst.reshape(&[])?;
            copied?;
        } else {
            device.backend().copy_rows(x, 0, out, 0, x.rows())?;
        }
        if reduce {
            tp.all_reduce_in_place(out, ReduceOp::Sum)?;
        }
        Ok(())
    }

    /// Reduction point 1 (routed output, before the transform), with the live
    /// comm type. Consumes `x`; reduces in place when
    /// [`ReducePolicy::routed_early_reduces`].
    pub fn reduce_routed_early<C: Collectives + ?Sized>(&self, x: Tensor, comm: CommType, tp: &C) -> Result<Tensor> {
        self.reduce_at(ReducePoint::RoutedEarly, x, comm, tp)
    }

    /// Reduction point 2 (shared-expert output), with the live comm type.
    /// Consumes `x`; reduces in place when [`ReducePolicy::shared_reduces`].
    pub fn reduce_shared<C: Collectives + ?Sized>(&self, x: Tensor, comm: CommType, tp: &C) -> Result<Tensor> {
        self.reduce_at(ReducePoint::Shared, x, comm, tp)
    }

    /// Reduction point 3 (after `out = shared + routed`), with the live comm
    /// type. Consumes `x`; reduces in place when [`ReducePolicy::final_reduces`].
    pub fn reduce_final<C: Collectives + ?Sized>(&self, x: Tensor, comm: CommType, tp: &C) -> Result<Tensor> {
        self.reduce_at(ReducePoint::Final, x, comm, tp)
    }

    into_point! {
        /// [`ReducePolicy::reduce_routed_early`] from `x` into `out`, which
        /// has the shape and dtype of `x`, on its device, and is `x` itself
        /// or memory apart from it ([`Output::of`]): `x` is copied into `out`
        /// (unless it is `out`) and, when the point reduces, all-reduced there
        /// in place.
        reduce_routed_early_into, ReducePoint::RoutedEarly
    }
    into_point! {
        /// [`ReducePolicy::reduce_shared`] from `x` into `out`; as
        /// [`ReducePolicy::reduce_routed_early_into`].
        reduce_shared_into, ReducePoint::Shared
    }
    into_point! {
        /// [`ReducePolicy::reduce_final`] from `x` into `out`; as
        /// [`ReducePolicy::reduce_routed_early_into`].
        reduce_final_into, ReducePoint::Final
    }
}
