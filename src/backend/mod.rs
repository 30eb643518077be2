//! The backend layer: the [`Backend`] and [`Communicator`] traits with exactly
//! the device-side ops and collectives the MoE layer needs, and their argument
//! types ([`View`], [`ViewMut`], [`FinalizeArgs`]).
//!
//! A backend knows its own buffers ([`Backend::Buffer`]: `CpuBuffer`,
//! `NpuBuffer`) and nothing above it: `Tensor`, `Device` and `Comm` are one
//! layer up and lend their storage to the backend that owns it as views. The
//! CPU backend is the reference for every op; the NPU backend runs the same
//! ops through ACL / aclnn / the native kernel.

pub(crate) mod args;
pub mod cpu;
pub mod npu;
mod view;

use crate::types::TensorMeta;
pub use crate::types::{DropPadMode, FinalizeDims, OutputRows, ReduceOp};
use crate::{Error, Result};
pub use view::{Buffer, View, ViewMut};

/// Inputs of the fused finalize (SPEC section 1), each an operand `T`: a
/// `&Tensor` above the backends, a [`View`] of the backend's buffer below.
/// Validated by `moe::finalize::moe_finalize_routing_output_shape`, which
/// produces the [`FinalizeDims`] every backend receives.
#[derive(Debug, Clone, Copy)]
pub struct FinalizeArgs<T> {
    /// `[N*K, H]` (modes 0/2) or `[E, C, H]` (modes 1/3).
    pub expanded_x: T,
    /// int32 `[N*K]`.
    pub expanded_row_idx: T,
    /// Optional skip input `[N, H]`.
    pub x1: Option<T>,
    /// Optional skip input `[N, H]`.
    pub x2: Option<T>,
    /// Optional `[E, H]`; requires `expert_idx`.
    pub bias: Option<T>,
    /// Optional `[N, K]`, dtype of `expanded_x` or f32.
    pub scales: Option<T>,
    /// Optional int32 `[N, K]`.
    pub expert_idx: Option<T>,
    /// Drop-pad mode.
    pub drop_pad_mode: DropPadMode,
}

impl<T> FinalizeArgs<T> {
    /// The two required operands and the mode; no skips, bias, scales or
    /// expert indices (add them with the `with_*` methods).
    pub fn new(expanded_x: T, expanded_row_idx: T, drop_pad_mode: DropPadMode) -> Self {
        FinalizeArgs {
            expanded_x,
            expanded_row_idx,
            x1: None,
            x2: None,
            bias: None,
            scales: None,
            expert_idx: None,
            drop_pad_mode,
        }
    }
    /// With the skip input `x1` (or none).
    pub fn with_x1(self, x1: impl Into<Option<T>>) -> Self {
        FinalizeArgs { x1: x1.into(), ..self }
    }
    /// With the skip input `x2` (or none).
    pub fn with_x2(self, x2: impl Into<Option<T>>) -> Self {
        FinalizeArgs { x2: x2.into(), ..self }
    }
    /// With `bias` (or none); a bias requires `expert_idx`.
    pub fn with_bias(self, bias: impl Into<Option<T>>) -> Self {
        FinalizeArgs { bias: bias.into(), ..self }
    }
    /// With `scales` (or none).
    pub fn with_scales(self, scales: impl Into<Option<T>>) -> Self {
        FinalizeArgs { scales: scales.into(), ..self }
    }
    /// With `expert_idx` (or none).
    pub fn with_expert_idx(self, expert_idx: impl Into<Option<T>>) -> Self {
        FinalizeArgs { expert_idx: expert_idx.into(), ..self }
    }
}

impl<T: Copy> FinalizeArgs<T> {
    /// Every operand with its argument name, `expanded_x` first; absent
    /// optional ones are `None`.
    pub fn operands(&self) -> [(&'static str, Option<T>); 7] {
        [
            ("expanded_x", Some(self.expanded_x)),
            ("expanded_row_idx", Some(self.expanded_row_idx)),
            ("x1", self.x1),
            ("x2", self.x2),
            ("bias", self.bias),
            ("scales", self.scales),
            ("expert_idx", self.expert_idx),
        ]
    }

    /// Every operand through `f`, which is told the argument's name; the first
    /// error wins.
    pub fn try_map<U>(&self, mut f: impl FnMut(&'static str, T) -> Result<U>) -> Result<FinalizeArgs<U>> {
        let mut opt = |arg: &'static str, t: Option<T>| t.map(|t| f(arg, t)).transpose();
        Ok(FinalizeArgs {
            x1: opt("x1", self.x1)?,
            x2: opt("x2", self.x2)?,
            bias: opt("bias", self.bias)?,
            scales: opt("scales", self.scales)?,
            expert_idx: opt("expert_idx", self.expert_idx)?,
            expanded_x: opt("expanded_x", Some(self.expanded_x))?.expect("a present operand maps to one"),
            expanded_row_idx: opt("expanded_row_idx", Some(self.expanded_row_idx))?
                .expect("a present operand maps to one"),
            drop_pad_mode: self.drop_pad_mode,
        })
    }
}

impl<'a, B: ?Sized> FinalizeArgs<View<'a, B>> {
    /// Shapes and dtypes of every operand.
    pub fn metas(&self) -> FinalizeArgs<TensorMeta<'a>> {
        let m = |v: View<'a, B>| v.meta();
        FinalizeArgs {
            expanded_x: m(self.expanded_x),
            expanded_row_idx: m(self.expanded_row_idx),
            x1: self.x1.map(m),
            x2: self.x2.map(m),
            bias: self.bias.map(m),
            scales: self.scales.map(m),
            expert_idx: self.expert_idx.map(m),
            drop_pad_mode: self.drop_pad_mode,
        }
    }
}

/// What a failed [`Backend::expect_all_equal`] reports. It is called with
/// every value when the backend read them all (`Some`, on the host), else
/// (on the device) with `None`, and always with the first position that
/// differs and its value.
pub type Mismatch = Box<dyn Fn(Option<&[i32]>, usize, i32) -> crate::Error + Send + Sync>;

/// The device-side ops every backend implements, over its own buffers.
///
/// Arguments reaching these methods are already validated by the op layer
/// (shapes, dtypes); every operand is a buffer of this backend, each holding
/// exactly the bytes its view describes; index values are checked by the
/// backend itself, because only it can read them.
pub trait Backend {
    /// The memory this backend computes on.
    type Buffer: Buffer;
    /// Where its buffers live, as errors name it (`"cpu"`, `"npu:0"`).
    fn location(&self) -> String;
    /// `len` zero bytes on this backend.
    fn zeros(&self, len: usize) -> Result<Self::Buffer>;
    /// `len` zero bytes an op makes for itself (an intermediate or its
    /// result): on an NPU, workspace of the stream (its pool or the caller's
    /// allocator), whose release never synchronises; elsewhere [`zeros`](Self::zeros).
    fn scratch(&self, len: usize) -> Result<Self::Buffer> {
        self.zeros(len)
    }
    /// `len` bytes for an op's result that it writes entirely before anyone
    /// reads it, so their contents are unspecified: on the CPU a reused block
    /// of the host pool for large results; elsewhere [`scratch`](Self::scratch).
    fn output(&self, len: usize) -> Result<Self::Buffer> {
        self.scratch(len)
    }
    /// A copy of host bytes on this backend.
    fn upload(&self, bytes: &[u8]) -> Result<Self::Buffer>;
    /// A copy on this backend of small host data an op made itself (a comm
    /// type, a few counts): on an NPU, workspace filled from pinned staging by
    /// an asynchronous copy, so it neither allocates nor synchronises and can
    /// be captured (a graph keeps the bytes it was captured with); elsewhere
    /// [`upload`](Self::upload).
    fn scratch_from_host(&self, bytes: &[u8]) -> Result<Self::Buffer> {
        self.upload(bytes)
    }
    /// A copy of `src`, a buffer of this backend's kind, on this backend.
    fn duplicate(&self, src: &Self::Buffer) -> Result<Self::Buffer>;
    /// Copies `src` into the host bytes `dst` (of its length), waiting for it.
    fn to_host(&self, src: &Self::Buffer, dst: &mut [u8]) -> Result<()>;
    /// Copies `rows` rows of `src` starting at `src_row` into `dst` at `dst_row`.
    /// Same dtype and row length on both sides.
    fn copy_rows(
        &self,
        src: View<'_, Self::Buffer>,
        src_row: usize,
        dst: ViewMut<'_, Self::Buffer>,
        dst_row: usize,
        rows: usize,
    ) -> Result<()>;
    /// `out = a + b` elementwise: integers exactly (wrapping on overflow),
    /// other dtypes in f32, rounded once.
    fn add(&self, a: View<'_, Self::Buffer>, b: View<'_, Self::Buffer>, out: ViewMut<'_, Self::Buffer>) -> Result<()>;
    /// Fused finalize routing (SPEC section 1) into `out`, placed as `rows` says.
    fn finalize_routing(
        &self,
        args: &FinalizeArgs<View<'_, Self::Buffer>>,
        dims: &FinalizeDims,
        out: ViewMut<'_, Self::Buffer>,
        rows: OutputRows<'_>,
    ) -> Result<()>;
    /// Checks that every element of the int32 operand `values` equals
    /// `expected`, else fails with `mismatch`'s error. Here the values are
    /// read now; an NPU compares them on the device and reports a difference
    /// at the caller's next stream check, so the check never synchronises.
    fn expect_all_equal(&self, values: View<'_, Self::Buffer>, expected: i32, mismatch: Mismatch) -> Result<()> {
        const OP: &str = "expect_all_equal";
        if values.dtype() != crate::DType::I32 {
            return Err(Error::dtype(OP, "values", "i32", values.dtype()));
        }
        let mut bytes = vec![0u8; values.len_bytes()];
        self.to_host(values.buf(), &mut bytes)?;
        let v: Vec<i32> = bytes.chunks_exact(4).map(|c| i32::from_ne_bytes([c[0], c[1], c[2], c[3]])).collect();
        match v.iter().position(|&x| x != expected) {
            None => Ok(()),
            Some(p) => Err(mismatch(Some(&v), p, v[p])),
        }
    }
    /// Token unpermute: `out[t] = sum_k probs[t,k] * permuted[idx[t*K + k]]`;
    /// an index outside `[0, permuted.rows)` contributes nothing.
    fn token_unpermute(
        &self,
        permuted: View<'_, Self::Buffer>,
        sorted_indices: View<'_, Self::Buffer>,
        probs: Option<View<'_, Self::Buffer>>,
        k: usize,
        out: ViewMut<'_, Self::Buffer>,
    ) -> Result<()>;
}

/// A collective a rank joins without operands of its own (one was not a
/// buffer of the communicator's backend): see [`Communicator::refuse`].
#[derive(Debug, Clone, Copy)]
pub enum Call<'a> {
    /// [`Communicator::all_reduce`].
    AllReduce(ReduceOp),
    /// [`Communicator::all_reduce_in_place`].
    AllReduceInPlace(ReduceOp),
    /// [`Communicator::reduce_scatter`].
    ReduceScatter(ReduceOp),
    /// [`Communicator::all_gather`].
    AllGather,
    /// [`Communicator::reduce_scatter_v`] with its counts.
    ReduceScatterV(&'a [usize], ReduceOp),
    /// [`Communicator::all_gather_v`] with its counts.
    AllGatherV(&'a [usize]),
    /// [`Communicator::all_to_all_v`] with its send and receive counts.
    AllToAllV(&'a [usize], &'a [usize]),
    /// [`Communicator::broadcast`] from its root.
    Broadcast(usize),
}

impl Call<'_> {
    /// Whether the collective reduces (sums, max, min) rather than moves bytes.
    pub fn reduces(&self) -> bool {
        match self {
            Call::AllReduce(_) | Call::AllReduceInPlace(_) | Call::ReduceScatter(_) | Call::ReduceScatterV(..) => true,
            Call::AllGather | Call::AllGatherV(_) | Call::AllToAllV(..) | Call::Broadcast(_) => false,
        }
    }
}

/// The collectives of SPEC section 8 over one backend's buffers.
///
/// Element counts come from the views: `reduce_scatter` takes `src` with
/// `world * n` elements and `dst` with `n`; `all_gather` the reverse; the `_v`
/// variants take per-rank counts (`counts.len() == world_size`), blocks packed
/// contiguously in rank order. Every collective checks that all ranks called
/// the same thing and fails on every rank when they did not.
pub trait Communicator: Sized {
    /// The backend whose buffers this communicator moves.
    type Backend: Backend;
    /// This rank in the group.
    fn rank(&self) -> usize;
    /// Number of ranks in the group.
    fn world_size(&self) -> usize;
    /// Group name (used in every error message).
    fn name(&self) -> &str;
    /// The backend (device) whose buffers this communicator moves.
    fn backend(&self) -> &Self::Backend;
    /// The backend whose ops on `buf` are ordered with the work already
    /// queued on it: on an NPU, the device handle (and so the stream) `buf`
    /// was made on, which may be the caller's stream rather than this
    /// communicator's.
    fn backend_of(&self, buf: &Buf<Self>) -> Self::Backend;
    /// A sub-communicator of the ranks `ranks` (group-local rank numbers,
    /// distinct, ascending order not required). Called by every member, with the
    /// same list; the new group's rank order is the list order.
    fn split(&self, ranks: &[usize]) -> Result<Self>;
    /// `dst = op(src over ranks)`.
    fn all_reduce(&self, src: View<'_, Buf<Self>>, dst: ViewMut<'_, Buf<Self>>, op: ReduceOp) -> Result<()>;
    /// In-place all-reduce.
    fn all_reduce_in_place(&self, buf: ViewMut<'_, Buf<Self>>, op: ReduceOp) -> Result<()>;
    /// `dst = block rank of op(src over ranks)`.
    fn reduce_scatter(&self, src: View<'_, Buf<Self>>, dst: ViewMut<'_, Buf<Self>>, op: ReduceOp) -> Result<()>;
    /// `dst = concat(src of every rank)`.
    fn all_gather(&self, src: View<'_, Buf<Self>>, dst: ViewMut<'_, Buf<Self>>) -> Result<()>;
    /// Reduce-scatter with per-rank block sizes `counts`.
    fn reduce_scatter_v(
        &self,
        src: View<'_, Buf<Self>>,
        dst: ViewMut<'_, Buf<Self>>,
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<()>;
    /// All-gather with per-rank block sizes `counts`.
    fn all_gather_v(&self, src: View<'_, Buf<Self>>, dst: ViewMut<'_, Buf<Self>>, counts: &[usize]) -> Result<()>;
    /// Personalised exchange: block `j` of `src` (`send_counts[j]` elements) goes
    /// to rank `j`; block `i` of `dst` (`recv_counts[i]`) comes from rank `i`.
    fn all_to_all_v(
        &self,
        src: View<'_, Buf<Self>>,
        send_counts: &[usize],
        dst: ViewMut<'_, Buf<Self>>,
        recv_counts: &[usize],
    ) -> Result<()>;
    /// Copies `buf` of rank `root` into `buf` of every rank.
    fn broadcast(&self, buf: ViewMut<'_, Buf<Self>>, root: usize) -> Result<()>;
    /// Waits for every rank.
    fn barrier(&self) -> Result<()>;
    /// A barrier ordered with the work queued on `on` (a handle of this
    /// communicator's device, possibly on another stream): an NPU queues it
    /// on `on`'s stream and returns, so the work queued after it there runs
    /// once every rank reached it; the default waits now, as [`barrier`](Self::barrier).
    fn barrier_on(&self, on: &Self::Backend) -> Result<()> {
        let _ = on;
        self.barrier()
    }
    /// Finalize routing fused with the EP reduce-scatter (SPEC section 3):
    /// this rank's finalize output (`[N, H...]`, tokens in EP-rank block order,
    /// block `r` = `local_sizes[r]` tokens, `local_sizes.len() == world_size`)
    /// summed over the ranks; `out` (`[local_sizes[rank], H...]`) receives
    /// block `rank` of the sum. `args` and `dims` are validated by the op
    /// layer, `out` has the shape it computed.
    ///
    /// The default materialises the padded `[world * M, H...]` buffer
    /// ([`finalize_then_reduce_scatter`]); a communicator that can compute the
    /// rows straight into its own transfer buffers overrides it, with a result
    /// that is bitwise the same as the default's on that communicator.
    fn finalize_reduce_scatter(
        &self,
        args: &FinalizeArgs<View<'_, Buf<Self>>>,
        dims: &FinalizeDims,
        local_sizes: &[usize],
        out: ViewMut<'_, Buf<Self>>,
    ) -> Result<()> {
        finalize_then_reduce_scatter(self, args, dims, local_sizes, out)
    }
    /// Called instead of `call` when this rank's operands of element type
    /// `dtype` could not be lent to it (`error` says which and why). The
    /// default returns `error`; a communicator that can still take part in the
    /// collective without data does so, so that every rank fails with this
    /// rank's reason instead of waiting for it.
    fn refuse(&self, call: Call<'_>, dtype: crate::DType, error: Error) -> Error {
        let _ = (call, dtype);
        error
    }
}

/// The buffer type of communicator `C`.
pub type Buf<C> = <<C as Communicator>::Backend as Backend>::Buffer;

/// [`Communicator::finalize_reduce_scatter`] in two steps on any backend: the
/// finalize writes each token into its row of the padded `[world * M, H...]`
/// buffer (`M = max(local_sizes)`, padding rows zero), which is then
/// reduce-scattered; the first `local_sizes[rank]` rows of this rank's slot go
/// to `out`.
///
/// A failure before the reduce-scatter (a shape, the scratch buffers, the
/// finalize's own checks of its inputs) is reported through
/// [`Communicator::refuse`], so the peers, already in the collective, fail
/// at once with this rank's reason instead of waiting for it.
pub fn finalize_then_reduce_scatter<C: Communicator>(
    comm: &C,
    args: &FinalizeArgs<View<'_, Buf<C>>>,
    dims: &FinalizeDims,
    local_sizes: &[usize],
    mut out: ViewMut<'_, Buf<C>>,
) -> Result<()> {
    const OP: &str = "finalize_and_reduce";
    let dtype = out.dtype();
    let refuse = |e: Error| comm.refuse(Call::ReduceScatter(ReduceOp::Sum), dtype, e);
    let m = local_sizes.iter().copied().max().unwrap_or(0);
    let shapes = local_sizes
        .get(comm.rank())
        .copied()
        .ok_or_else(|| {
            Error::invalid(
                OP,
                "local_sizes",
                format!("{} entries, but the group has {} ranks", local_sizes.len(), comm.world_size()),
            )
        })
        .and_then(|mine| {
            // As many slots as ranks (checked above), each of the largest size.
            let rows = local_sizes.len().checked_mul(m).ok_or_else(|| {
                Error::invalid(OP, "local_sizes", format!("{} slots of {m} rows overflow usize", local_sizes.len()))
            })?;
            let padded = args::with_rows(OP, "expanded_x", out.shape(), rows)?;
            Ok((mine, padded, args::with_rows(OP, "expanded_x", out.shape(), m)?))
        });
    let (mine, padded_shape, slot_shape) = shapes.map_err(refuse)?;
    let backend = comm.backend_of(out.buf());
    let backend = &backend;
    let padded_meta = TensorMeta { shape: &padded_shape, dtype };
    if padded_meta.numel() == 0 {
        // Every rank sees the same layout, so every rank skips the
        // collective together; `out` is empty as well (no slot rows, or empty
        // rows). The finalize still runs into an empty view of `out`'s
        // buffer, so its inputs are checked as they are when there is data
        // (an NPU reports a bad index at the stream's check).
        let padded = ViewMut::new(OP, "expanded_x", padded_meta, out.buf_mut())?;
        return backend.finalize_routing(args, dims, padded, OutputRows::Padded { local_sizes, slot_rows: m });
    }
    let slot_meta = TensorMeta { shape: &slot_shape, dtype };
    // Everything that can fail locally happens before the collective: the
    // scratch buffers, the finalize, and the checks of the final row copy.
    let scratch = |shape: &[usize]| backend.scratch(args::checked_bytes(OP, "expanded_x", shape, dtype)?);
    let mut bufs = scratch(&padded_shape)
        .and_then(|p| Ok((p, if mine == m { None } else { Some(scratch(&slot_shape)?) })))
        .map_err(refuse)?;
    let (padded_buf, slot_buf) = &mut bufs;
    let rows = OutputRows::Padded { local_sizes, slot_rows: m };
    let padded = ViewMut::new(OP, "expanded_x", padded_meta, padded_buf).and_then(|mut padded| {
        backend.finalize_routing(args, dims, padded.reborrow(), rows)?;
        Ok(padded)
    });
    let padded = padded.map_err(refuse)?;
    let Some(slot_buf) = slot_buf else {
        return comm.reduce_scatter(padded.as_view(), out, ReduceOp::Sum);
    };
    let slot = ViewMut::new(OP, "expanded_x", slot_meta, slot_buf).and_then(|slot| {
        args::check_rows("copy_rows", slot_meta, 0, out.meta(), 0, mine)?;
        Ok(slot)
    });
    let mut slot = slot.map_err(refuse)?;
    comm.reduce_scatter(padded.as_view(), slot.reborrow(), ReduceOp::Sum)?;
    if mine > 0 {
        backend.copy_rows(slot.as_view(), 0, out.reborrow(), 0, mine)?;
    }
    Ok(())
}
