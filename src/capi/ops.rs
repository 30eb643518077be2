//! The MoE ops (SPEC sections 1-5), their shape functions, and the
//! runtime-aware reduce policy.
//!
//! Every op has an `*_output_shape` twin taking the same descriptors (data
//! pointers ignored) that calls the same Rust shape function the op uses to
//! size its result, so a meta / fake implementation built on it cannot
//! disagree with the real op.

use super::comm::comm_ref;
use super::ffi::{
    check_out, ffi, flag, read_meta, read_opt, read_sizes, read_tensor, try_out, try_ref, write_out, write_shape,
    write_tensor, Failure, Meta,
};
use super::types::{amoe_comm, amoe_status, amoe_stream, amoe_tensor};
use crate::backend::FinalizeArgs;
use crate::moe::finalize::{drop_pad_mode, FinalizeMeta, TensorMeta};
use crate::moe::{self, ReducePolicy, SharedMode, SpLayout};
use crate::tensor::Storage;
use crate::{Collectives, Comm, CommType, Tensor};

/// The inputs of the fused finalize (SPEC section 1). All tensors are read
/// only; optional ones may be NULL. Ownership of every descriptor stays with
/// the caller.
#[derive(Debug, Clone, Copy)]
#[repr(C)]
pub struct amoe_finalize_args {
    /// `[N*K, H...]` (modes 0/2) or `[E, C, H...]` (modes 1/3); f32, f16 or bf16.
    pub expanded_x: *const amoe_tensor,
    /// int32 `[N*K]`.
    pub expanded_row_idx: *const amoe_tensor,
    /// Optional skip input `[N, H...]` (NULL = none).
    pub x1: *const amoe_tensor,
    /// Optional skip input `[N, H...]` (NULL = none).
    pub x2: *const amoe_tensor,
    /// Optional `[E, H...]` (NULL = none); requires `expert_idx`.
    pub bias: *const amoe_tensor,
    /// Optional `[N, K]`, dtype of `expanded_x` or f32 (NULL = all ones, K = 1).
    pub scales: *const amoe_tensor,
    /// Optional int32 `[N, K]` (NULL = none).
    pub expert_idx: *const amoe_tensor,
    /// An `amoe_drop_pad_mode` code, 0..=3.
    pub drop_pad_mode: u32,
}

/// The static part of a layer's reduction policy (SPEC section 5). The live
/// MoE comm type is passed to each reduction point separately.
#[derive(Debug, Clone, Copy)]
#[repr(C)]
pub struct amoe_reduce_policy {
    /// An `amoe_shared_mode` code.
    pub shared_mode: u32,
    /// Non-zero when a transform follows the routed experts.
    pub has_routed_transform: u8,
    /// Non-zero when MoE sequence parallelism is on.
    pub sp: u8,
    /// TP group size (>= 1).
    pub tp_size: usize,
    /// EP group size (a positive multiple of `tp_size`).
    pub ep_size: usize,
}

/// The output tensor of a finalize over the caller's host memory (see
/// `ffi::out_tensor`), or `None` for an NPU output: an NPU finalize computes
/// into a buffer of its own that is copied into `out` only on success, so an
/// invalid index leaves `out` unwritten on every device, as documented.
///
/// # Safety
/// `out` a valid descriptor, already checked by `check_out`.
unsafe fn host_out(f: &str, out: *const amoe_tensor) -> Result<Option<Tensor>, Failure> {
    let d = try_ref!(f, out, "out");
    if d.device_kind != super::AMOE_DEVICE_CPU {
        return Ok(None);
    }
    // SAFETY: forwarded contract.
    unsafe { super::ffi::out_tensor(f, "out", out) }.map(Some)
}

fn meta_of(m: &Meta) -> TensorMeta<'_> {
    TensorMeta { shape: &m.shape, dtype: m.dtype }
}

/// Owned inputs of a finalize call, read from an `amoe_finalize_args`.
struct FinalizeInputs {
    x: Tensor,
    idx: Tensor,
    x1: Option<Tensor>,
    x2: Option<Tensor>,
    bias: Option<Tensor>,
    scales: Option<Tensor>,
    expert_idx: Option<Tensor>,
    mode: u32,
}

impl FinalizeInputs {
    /// # Safety
    /// Every non-NULL descriptor in `a` must satisfy the `amoe_tensor` contract.
    unsafe fn read(f: &str, a: *const amoe_finalize_args) -> Result<Self, Failure> {
        let a = try_ref!(f, a, "args");
        // SAFETY (all reads below): the caller's descriptor contract.
        Ok(FinalizeInputs {
            x: unsafe { read_tensor(f, "expanded_x", a.expanded_x) }?,
            // SAFETY: `expanded_row_idx` is a valid descriptor, per the export's contract.
            idx: unsafe { read_tensor(f, "expanded_row_idx", a.expanded_row_idx) }?,
            x1: unsafe { read_opt(f, "x1", a.x1) }?,
            // SAFETY: `x2` is a valid descriptor, per the export's contract.
            x2: unsafe { read_opt(f, "x2", a.x2) }?,
            bias: unsafe { read_opt(f, "bias", a.bias) }?,
            // SAFETY: `scales` is a valid descriptor, per the export's contract.
            scales: unsafe { read_opt(f, "scales", a.scales) }?,
            expert_idx: unsafe { read_opt(f, "expert_idx", a.expert_idx) }?,
            mode: a.drop_pad_mode,
        })
    }

    fn args(&self) -> Result<FinalizeArgs<'_>, Failure> {
        Ok(FinalizeArgs {
            expanded_x: &self.x,
            expanded_row_idx: &self.idx,
            x1: self.x1.as_ref(),
            x2: self.x2.as_ref(),
            bias: self.bias.as_ref(),
            scales: self.scales.as_ref(),
            expert_idx: self.expert_idx.as_ref(),
            drop_pad_mode: drop_pad_mode("moe_finalize_routing", self.mode as i64)?,
        })
    }
}

/// Shapes and dtypes of an `amoe_finalize_args` (data pointers ignored).
struct FinalizeMetas {
    x: Meta,
    idx: Meta,
    opt: [Option<Meta>; 5],
    mode: u32,
}

impl FinalizeMetas {
    /// # Safety
    /// As `ffi::meta` for every non-NULL descriptor in `a`.
    unsafe fn read(f: &str, a: *const amoe_finalize_args) -> Result<Self, Failure> {
        let a = try_ref!(f, a, "args");
        let opt = |arg: &str, d: *const amoe_tensor| -> Result<Option<Meta>, Failure> {
            if d.is_null() {
                return Ok(None);
            }
            // SAFETY: the caller's descriptor contract.
            unsafe { read_meta(f, arg, d) }.map(Some)
        };
        Ok(FinalizeMetas {
            // SAFETY: the caller's descriptor contract.
            x: unsafe { read_meta(f, "expanded_x", a.expanded_x) }?,
            // SAFETY: the caller's descriptor contract.
            idx: unsafe { read_meta(f, "expanded_row_idx", a.expanded_row_idx) }?,
            opt: [
                opt("x1", a.x1)?,
                opt("x2", a.x2)?,
                opt("bias", a.bias)?,
                opt("scales", a.scales)?,
                opt("expert_idx", a.expert_idx)?,
            ],
            mode: a.drop_pad_mode,
        })
    }

    fn meta(&self) -> FinalizeMeta<'_> {
        let [x1, x2, bias, scales, expert_idx] = &self.opt;
        FinalizeMeta {
            expanded_x: meta_of(&self.x),
            expanded_row_idx: meta_of(&self.idx),
            x1: x1.as_ref().map(meta_of),
            x2: x2.as_ref().map(meta_of),
            bias: bias.as_ref().map(meta_of),
            scales: scales.as_ref().map(meta_of),
            expert_idx: expert_idx.as_ref().map(meta_of),
            drop_pad_mode: self.mode as i64,
        }
    }
}

/// An optional SP layout: NULL `local_sizes` means none (plain EP
/// reduce-scatter / all-gather); otherwise `n` entries, one per EP rank.
///
/// # Safety
/// `local_sizes` readable for `n` elements when non-NULL.
unsafe fn layout(f: &str, local_sizes: *const usize, n: usize) -> Result<Option<SpLayout>, Failure> {
    if local_sizes.is_null() {
        return Ok(None);
    }
    // SAFETY: the caller's contract.
    let sizes = unsafe { read_sizes(f, "local_sizes", local_sizes, n) }?;
    Ok(Some(SpLayout::new(&sizes)?))
}

/// Shape function of an EP/SP layout op: `(x shape, layout, ep_rank, ep_size)`.
type LayoutShape = fn(&[usize], Option<&SpLayout>, usize, usize) -> crate::Result<Vec<usize>>;

/// The body of the `*_output_shape` export of an EP/SP layout op.
///
/// # Safety
/// `x` valid; `local_sizes` NULL or readable for `n`; out-pointers writable.
#[allow(clippy::too_many_arguments)]
unsafe fn layout_op_shape(
    f: &'static str,
    shape_of: LayoutShape,
    x: *const amoe_tensor,
    local_sizes: *const usize,
    n: usize,
    ep_rank: usize,
    ep_size: usize,
    out_shape: *mut usize,
    cap: usize,
    out_ndim: *mut usize,
) -> amoe_status {
    ffi!(f, {
        // SAFETY: the caller's contracts.
        let m = unsafe { read_meta(f, "x", x) }?;
        // SAFETY: as above.
        let l = unsafe { layout(f, local_sizes, n) }?;
        let shape = shape_of(&m.shape, l.as_ref(), ep_rank, ep_size)?;
        // SAFETY: the caller's contracts for the out-pointers.
        unsafe { write_shape(f, &shape, out_shape, cap, out_ndim) }
    })
}

/// The body of an EP/SP layout op's export: `out = op(x, layout, ep_comm)`,
/// after `out` is checked against `shape_of`. On NPU the op computes into
/// workspace of the stream's pool and its result is copied into `out` by one
/// device copy queued on the stream; nothing synchronises or allocates
/// outside the pool.
///
/// # Safety
/// `x`, `out` valid descriptors; `local_sizes` NULL or readable for `n`;
/// `ep_comm` live; `stream` NULL or a live handle.
#[allow(clippy::too_many_arguments)]
unsafe fn layout_op(
    f: &'static str,
    shape_of: LayoutShape,
    op: fn(&Tensor, Option<&SpLayout>, &Comm) -> crate::Result<Tensor>,
    x: *const amoe_tensor,
    local_sizes: *const usize,
    n: usize,
    ep_comm: *const amoe_comm,
    out: *const amoe_tensor,
    stream: *const amoe_stream,
) -> amoe_status {
    ffi!(f, {
        // SAFETY: `stream` is NULL or a live handle, per the caller's contract.
        let _npu = unsafe { super::ffi::bind_stream(f, stream) }?;
        // SAFETY: the caller's contracts, for every call below.
        let c = unsafe { comm_ref(f, ep_comm) }?;
        let x = unsafe { read_tensor(f, "x", x) }?;
        // SAFETY: `local_sizes` is NULL or readable for `n` entries, per the caller's contract.
        let l = unsafe { layout(f, local_sizes, n) }?;
        let shape = shape_of(x.shape(), l.as_ref(), c.rank(), c.world_size())?;
        // SAFETY: `out` is a valid descriptor, per the caller's contract.
        unsafe { check_out(f, "out", out, &shape, x.dtype()) }?;
        let y = op(&x, l.as_ref(), c)?;
        // SAFETY: `out` is a valid descriptor, per the caller's contract.
        unsafe { write_tensor(f, "out", out, &y) }
    })
}

/// Output shape of `amoe_moe_finalize_routing` (`[N, H...]`, dtype of
/// `expanded_x`) from the shapes and dtypes in `args`; validates every input
/// exactly as the op does. Data pointers are ignored and may be NULL.
///
/// The shape goes to `out_shape` (caller-owned, `cap` entries) and its
/// length to `*out_ndim`; when `cap` is too small only `*out_ndim` is written
/// and `AMOE_STATUS_BUFFER_TOO_SMALL` returned. `AMOE_MAX_NDIM` always suffices.
///
/// # Safety
/// `args` and its non-NULL descriptors valid; `out_shape` writable for `cap`; `out_ndim` writable.
#[no_mangle]
pub unsafe extern "C" fn amoe_moe_finalize_routing_output_shape(
    args: *const amoe_finalize_args,
    out_shape: *mut usize,
    cap: usize,
    out_ndim: *mut usize,
) -> amoe_status {
    const F: &str = "amoe_moe_finalize_routing_output_shape";
    ffi!(F, {
        // SAFETY: the caller's contracts.
        let m = unsafe { FinalizeMetas::read(F, args) }?;
        let (shape, _) = moe::moe_finalize_routing_shape(&m.meta())?;
        // SAFETY: the caller's contracts for the out-pointers.
        unsafe { write_shape(F, &shape, out_shape, cap, out_ndim) }
    })
}

/// Fused MoE finalize routing (SPEC section 1):
/// `out[i] = x1[i] + x2[i] + sum_k s(i,k) * (row(R(i,k)) + bias[expert_idx[i,k]])`.
///
/// Inputs are read from the caller's memory during the call; the result is
/// written into `out`, which the caller allocated with the shape from
/// `amoe_moe_finalize_routing_output_shape` and the dtype of `expanded_x`.
/// An index outside its valid range is an error (`AMOE_STATUS_INDEX_OUT_OF_RANGE`)
/// and `out` is then not written (unspecified on NPU).
///
/// NPU tensors, native kernel (the default where it can launch): enqueues on
/// `stream` one memset of the status words and one kernel launch writing
/// `out` in place (plus, for the padded layout, one small copy of the slot
/// offsets from a pinned staging block); workspace comes from the stream's
/// pool or allocator. It never synchronises, never calls `aclrtMalloc`, never
/// reads device data on the host; a bad index is returned by
/// `amoe_stream_check(stream)` with its argument, position and value. NPU
/// tensors, aclnn (`ASCEND_MOE_NPU_FINALIZE=aclnn`): where the native kernel
/// can launch, one launch of it first checks the index tensors into
/// workspace (bad values replaced by safe ones, the first reported by
/// `amoe_stream_check`), then `aclnnMoeFinalizeRoutingV2` is enqueued over
/// the checked copies: no synchronisation, no host read, capturable. Without
/// the native kernel the indices are read and checked on the host first (one
/// device-to-host copy and synchronisation; refused while `stream` is
/// captured).
///
/// # Safety
/// `args` and its descriptors valid; `out` a valid, writable descriptor.
#[no_mangle]
pub unsafe extern "C" fn amoe_moe_finalize_routing(
    args: *const amoe_finalize_args,
    out: *const amoe_tensor,
    stream: *const amoe_stream,
) -> amoe_status {
    const F: &str = "amoe_moe_finalize_routing";
    ffi!(F, {
        // SAFETY: `stream` is NULL or a live handle, per the export's contract.
        let _npu = unsafe { super::ffi::bind_stream(F, stream) }?;
        // SAFETY: the caller's contracts.
        let inputs = unsafe { FinalizeInputs::read(F, args) }?;
        let a = inputs.args()?;
        let (shape, _) = moe::moe_finalize_routing_output_shape(&a)?;
        // SAFETY: the caller's contract for `out`.
        unsafe { check_out(F, "out", out, &shape, inputs.x.dtype()) }?;
        // SAFETY: the caller's contract for `out`.
        let y = match unsafe { host_out(F, out) }? {
            Some(mut o) => {
                moe::moe_finalize_routing_into(&a, &mut o)?;
                o
            }
            None => moe::moe_finalize_routing(&a)?,
        };
        // SAFETY: the caller's contract for `out`.
        unsafe { write_tensor(F, "out", out, &y) }
    })
}

/// Output shape of `amoe_moe_token_unpermute` (`[T, H...]`, dtype of
/// `permuted`). `probs` may be NULL (K = 1). Data pointers are ignored.
/// Out-pointers as `amoe_moe_finalize_routing_output_shape`.
///
/// # Safety
/// Descriptors valid; `out_shape` writable for `cap`; `out_ndim` writable.
#[no_mangle]
pub unsafe extern "C" fn amoe_moe_token_unpermute_output_shape(
    permuted: *const amoe_tensor,
    sorted_indices: *const amoe_tensor,
    probs: *const amoe_tensor,
    out_shape: *mut usize,
    cap: usize,
    out_ndim: *mut usize,
) -> amoe_status {
    const F: &str = "amoe_moe_token_unpermute_output_shape";
    ffi!(F, {
        // SAFETY: the caller's descriptor contracts.
        let p = unsafe { read_meta(F, "permuted", permuted) }?;
        // SAFETY: as above.
        let s = unsafe { read_meta(F, "sorted_indices", sorted_indices) }?;
        let pr = if probs.is_null() {
            None
        } else {
            // SAFETY: as above.
            Some(unsafe { read_meta(F, "probs", probs) }?)
        };
        let (shape, _) = moe::moe_token_unpermute_shape(meta_of(&p), meta_of(&s), pr.as_ref().map(meta_of))?;
        // SAFETY: the caller's contracts for the out-pointers.
        unsafe { write_shape(F, &shape, out_shape, cap, out_ndim) }
    })
}

/// Token unpermute: `out[t] = sum_k probs[t,k] * permuted[sorted_indices[t*K + k]]`
/// (`probs` NULL = ones, K = 1); an index outside `[0, rows)` contributes
/// nothing. Ownership as `amoe_moe_finalize_routing`.
///
/// The result is written into `out` in place (host memory that cannot be
/// borrowed goes through a copy).
///
/// NPU, native kernel (the default where it can launch): enqueues on
/// `stream` one memset of the status words and one kernel launch writing
/// `out`; it never synchronises, never calls `aclrtMalloc`, never reads device
/// data on the host, and can be captured into a graph. NPU, aclnn
/// (`ASCEND_MOE_NPU_FINALIZE=aclnn`, or no native kernel): the indices are
/// read on the host (one device-to-host copy and synchronisation) to decide
/// whether `aclnnMoeTokenUnpermute` accepts them (T*K rows, distinct, in
/// range), which is then enqueued; other inputs are computed on the host and
/// copied back. Refused while `stream` is captured into a graph.
///
/// # Safety
/// Descriptors valid; `out` writable.
#[no_mangle]
pub unsafe extern "C" fn amoe_moe_token_unpermute(
    permuted: *const amoe_tensor,
    sorted_indices: *const amoe_tensor,
    probs: *const amoe_tensor,
    out: *const amoe_tensor,
    stream: *const amoe_stream,
) -> amoe_status {
    const F: &str = "amoe_moe_token_unpermute";
    ffi!(F, {
        // SAFETY: `stream` is NULL or a live handle, per the export's contract.
        let _npu = unsafe { super::ffi::bind_stream(F, stream) }?;
        // SAFETY: the caller's descriptor contracts.
        let p = unsafe { read_tensor(F, "permuted", permuted) }?;
        // SAFETY: as above.
        let s = unsafe { read_tensor(F, "sorted_indices", sorted_indices) }?;
        // SAFETY: as above.
        let pr = unsafe { read_opt(F, "probs", probs) }?;
        let (shape, _) = moe::moe_token_unpermute_output_shape(&p, &s, pr.as_ref())?;
        // SAFETY: the caller's contract for `out`.
        unsafe { check_out(F, "out", out, &shape, p.dtype()) }?;
        // SAFETY: the caller's contract for `out`.
        let mut y = unsafe { super::ffi::out_tensor(F, "out", out) }?;
        moe::moe_token_unpermute_into(&p, &s, pr.as_ref(), &mut y)?;
        // SAFETY: the caller's contract for `out` (a no-op when written in place).
        unsafe { write_tensor(F, "out", out, &y) }
    })
}

/// The SP layout of DP token counts (SPEC section 2):
/// `local_sizes[d * tp_size + t] = ceil(dp_tokens[d] / tp_size)`.
/// Writes `n * tp_size` entries to the caller-owned `out` (`cap` entries) and
/// the count to `*out_len`; when `cap` is too small only `*out_len` is written
/// and `AMOE_STATUS_BUFFER_TOO_SMALL` returned.
///
/// # Safety
/// `dp_tokens` readable for `n`; `out` writable for `cap`; `out_len` writable.
#[no_mangle]
pub unsafe extern "C" fn amoe_sp_layout_from_dp_tokens(
    dp_tokens: *const usize,
    n: usize,
    tp_size: usize,
    out: *mut usize,
    cap: usize,
    out_len: *mut usize,
) -> amoe_status {
    const F: &str = "amoe_sp_layout_from_dp_tokens";
    ffi!(F, {
        let out_len = try_out!(F, out_len, "out_len");
        // SAFETY: the caller's contract.
        let dp = unsafe { read_sizes(F, "dp_tokens", dp_tokens, n) }?;
        // The layout has n * tp_size entries: check it fits the caller's
        // buffer before building it, so its size is bounded by real memory.
        let Some(need) = n.checked_mul(tp_size) else {
            return Err(Failure::invalid(F, "tp_size", format!("{n} DP ranks x {tp_size} TP ranks overflows")));
        };
        // SAFETY: checked non-null, writable per the contract.
        unsafe { write_out(out_len, need) };
        if cap < need {
            return Err(Failure::new(
                amoe_status::BufferTooSmall,
                format!("{F}: `out` holds {cap} entries, the layout has {need}"),
            ));
        }
        let l = SpLayout::from_dp_tokens(&dp, tp_size)?;
        let sizes = l.local_sizes();
        let out = try_out!(F, out, "out");
        // SAFETY: non-null, writable for `cap >= sizes.len()` elements.
        unsafe { std::ptr::copy_nonoverlapping(sizes.as_ptr(), out, sizes.len()) };
        Ok(())
    })
}

/// Output shape of `amoe_maybe_pad_and_reduce` on EP rank `ep_rank` of
/// `ep_size`: `[local_sizes[ep_rank], H...]`, or `[rows / ep_size, H...]`
/// when `local_sizes` is NULL. `x`'s data pointer is ignored.
/// Out-pointers as `amoe_moe_finalize_routing_output_shape`.
///
/// # Safety
/// `x` valid; `local_sizes` NULL or readable for `n`; out-pointers writable.
#[no_mangle]
pub unsafe extern "C" fn amoe_maybe_pad_and_reduce_output_shape(
    x: *const amoe_tensor,
    local_sizes: *const usize,
    n: usize,
    ep_rank: usize,
    ep_size: usize,
    out_shape: *mut usize,
    cap: usize,
    out_ndim: *mut usize,
) -> amoe_status {
    const F: &str = "amoe_maybe_pad_and_reduce_output_shape";
    let shape_of = moe::maybe_pad_and_reduce_output_shape;
    // SAFETY: the caller's contracts.
    unsafe { layout_op_shape(F, shape_of, x, local_sizes, n, ep_rank, ep_size, out_shape, cap, out_ndim) }
}

/// EP/SP finalize (SPEC section 3): pad each EP rank's block of `x`
/// (`sum(local_sizes)` rows, EP-rank block order) to `M = max(local_sizes)`
/// rows, reduce-scatter (sum) over `ep_comm`, keep this rank's
/// `local_sizes[rank]` rows. `local_sizes` NULL = plain EP reduce-scatter.
/// Collective: every rank of `ep_comm` calls it with the same layout.
/// Ownership as `amoe_moe_finalize_routing`.
///
/// NPU (this and `amoe_maybe_all_gather_and_maybe_unpad`): enqueues on
/// `stream` the row copies into a padded workspace buffer, one HCCL
/// collective and one device copy of the result into `out`; never
/// synchronises, never allocates outside the stream's pool, never reads
/// device data on the host. A mismatch between ranks is returned by
/// `amoe_stream_check`.
///
/// # Safety
/// `x`, `out` valid descriptors; `local_sizes` NULL or readable for `n`; `ep_comm` live.
#[no_mangle]
pub unsafe extern "C" fn amoe_maybe_pad_and_reduce(
    x: *const amoe_tensor,
    local_sizes: *const usize,
    n: usize,
    ep_comm: *const amoe_comm,
    out: *const amoe_tensor,
    stream: *const amoe_stream,
) -> amoe_status {
    const F: &str = "amoe_maybe_pad_and_reduce";
    let (shape_of, op) = (moe::maybe_pad_and_reduce_output_shape, moe::maybe_pad_and_reduce::<Comm>);
    // SAFETY: the caller's contracts.
    unsafe { layout_op(F, shape_of, op, x, local_sizes, n, ep_comm, out, stream) }
}

/// Output shape of `amoe_maybe_all_gather_and_maybe_unpad`:
/// `[sum(local_sizes), H...]` (`x` must have `local_sizes[ep_rank]` rows), or
/// `[rows * ep_size, H...]` when `local_sizes` is NULL.
/// Out-pointers as `amoe_moe_finalize_routing_output_shape`.
///
/// # Safety
/// As `amoe_maybe_pad_and_reduce_output_shape`.
#[no_mangle]
pub unsafe extern "C" fn amoe_maybe_all_gather_and_maybe_unpad_output_shape(
    x: *const amoe_tensor,
    local_sizes: *const usize,
    n: usize,
    ep_rank: usize,
    ep_size: usize,
    out_shape: *mut usize,
    cap: usize,
    out_ndim: *mut usize,
) -> amoe_status {
    const F: &str = "amoe_maybe_all_gather_and_maybe_unpad_output_shape";
    let shape_of = moe::maybe_all_gather_and_maybe_unpad_output_shape;
    // SAFETY: the caller's contracts.
    unsafe { layout_op_shape(F, shape_of, x, local_sizes, n, ep_rank, ep_size, out_shape, cap, out_ndim) }
}

/// EP/SP prepare (SPEC section 4): pad `x` (exactly `local_sizes[rank]` rows)
/// to `M` rows, all-gather over `ep_comm`, keep the first `local_sizes[r]`
/// rows of each rank's block. Collective; ownership as `amoe_moe_finalize_routing`.
///
/// # Safety
/// As `amoe_maybe_pad_and_reduce`.
#[no_mangle]
pub unsafe extern "C" fn amoe_maybe_all_gather_and_maybe_unpad(
    x: *const amoe_tensor,
    local_sizes: *const usize,
    n: usize,
    ep_comm: *const amoe_comm,
    out: *const amoe_tensor,
    stream: *const amoe_stream,
) -> amoe_status {
    const F: &str = "amoe_maybe_all_gather_and_maybe_unpad";
    let shape_of = moe::maybe_all_gather_and_maybe_unpad_output_shape;
    let op = moe::maybe_all_gather_and_maybe_unpad::<Comm>;
    // SAFETY: the caller's contracts.
    unsafe { layout_op(F, shape_of, op, x, local_sizes, n, ep_comm, out, stream) }
}

/// Output shape of `amoe_finalize_and_reduce`: the finalize's `[N, H...]`
/// with `N = sum(local_sizes)` becomes `[local_sizes[ep_rank], H...]`.
/// Out-pointers as `amoe_moe_finalize_routing_output_shape`.
///
/// # Safety
/// As `amoe_moe_finalize_routing_output_shape`; `local_sizes` NULL or readable for `n`.
#[no_mangle]
pub unsafe extern "C" fn amoe_finalize_and_reduce_output_shape(
    args: *const amoe_finalize_args,
    local_sizes: *const usize,
    n: usize,
    ep_rank: usize,
    ep_size: usize,
    out_shape: *mut usize,
    cap: usize,
    out_ndim: *mut usize,
) -> amoe_status {
    const F: &str = "amoe_finalize_and_reduce_output_shape";
    ffi!(F, {
        // SAFETY: the caller's contracts.
        let m = unsafe { FinalizeMetas::read(F, args) }?;
        // SAFETY: as above.
        let l = unsafe { layout(F, local_sizes, n) }?;
        let shape = moe::finalize_and_reduce_shape(&m.meta(), l.as_ref(), ep_rank, ep_size)?;
        // SAFETY: the caller's contracts for the out-pointers.
        unsafe { write_shape(F, &shape, out_shape, cap, out_ndim) }
    })
}

/// Finalize routing fused with the EP/SP reduce: the result of
/// `amoe_maybe_pad_and_reduce(finalize(args))` without the intermediate
/// buffer. Collective over `ep_comm`; ownership as `amoe_moe_finalize_routing`.
///
/// NPU: enqueues the finalize into a padded workspace buffer (as
/// `amoe_moe_finalize_routing`), the HCCL reduce-scatter, and at most one
/// device copy of this rank's rows into `out`; never synchronises, never
/// allocates outside the stream's pool, never reads device data on the host.
/// Device-found errors come from `amoe_stream_check`.
///
/// # Safety
/// As `amoe_moe_finalize_routing` and `amoe_maybe_pad_and_reduce`.
#[no_mangle]
pub unsafe extern "C" fn amoe_finalize_and_reduce(
    args: *const amoe_finalize_args,
    local_sizes: *const usize,
    n: usize,
    ep_comm: *const amoe_comm,
    out: *const amoe_tensor,
    stream: *const amoe_stream,
) -> amoe_status {
    const F: &str = "amoe_finalize_and_reduce";
    ffi!(F, {
        // SAFETY: `stream` is NULL or a live handle, per the export's contract.
        let _npu = unsafe { super::ffi::bind_stream(F, stream) }?;
        // SAFETY: the caller's contracts, for every call below.
        let c = unsafe { comm_ref(F, ep_comm) }?;
        let inputs = unsafe { FinalizeInputs::read(F, args) }?;
        // SAFETY: `local_sizes` is NULL or readable for `n` entries, per the export's contract.
        let l = unsafe { layout(F, local_sizes, n) }?;
        let a = inputs.args()?;
        let shape = moe::finalize_and_reduce_output_shape(&a, l.as_ref(), c.rank(), c.world_size())?;
        // SAFETY: `out` is a valid descriptor, per the export's contract.
        unsafe { check_out(F, "out", out, &shape, inputs.x.dtype()) }?;
        // SAFETY: `out` is a valid descriptor, per the export's contract.
        let y = match unsafe { host_out(F, out) }? {
            Some(mut o) => {
                moe::finalize_and_reduce_into(&a, l.as_ref(), c, &mut o)?;
                o
            }
            None => moe::finalize_and_reduce(&a, l.as_ref(), c)?,
        };
        // SAFETY: `out` is a valid descriptor, per the export's contract.
        unsafe { write_tensor(F, "out", out, &y) }
    })
}

/// Whether the routed output of `comm_type` is already the full sum
/// (SPEC section 5): `comm in {MC2, ALLTOALL, FUSED_MC2} or (ALLGATHER and sp)`.
/// Writes 1 or 0 to `*out`.
///
/// # Safety
/// `out` writable.
#[no_mangle]
pub unsafe extern "C" fn amoe_routed_is_reduced(comm_type: u32, sp: u8, out: *mut u8) -> amoe_status {
    const F: &str = "amoe_routed_is_reduced";
    ffi!(F, {
        let out = try_out!(F, out, "out");
        let r = moe::routed_is_reduced(CommType::from_u32(comm_type)?, flag(sp));
        // SAFETY: checked non-null, writable per the contract.
        unsafe { write_out(out, r as u8) };
        Ok(())
    })
}

fn policy(f: &str, p: *const amoe_reduce_policy) -> Result<ReducePolicy, Failure> {
    let p = try_ref!(f, p, "policy");
    Ok(ReducePolicy::new(
        SharedMode::from_u32(p.shared_mode)?,
        flag(p.has_routed_transform),
        flag(p.sp),
        p.tp_size,
        p.ep_size,
    )?)
}

/// Validates a policy and writes its decisions for the live `comm_type`:
/// `*early` (reduce the routed output before the transform), and whether
/// each of the three reduction points all-reduces (`*routed`, `*shared`,
/// `*final_`). Any out-pointer may be NULL to skip it.
///
/// # Safety
/// `policy` valid; non-NULL out-pointers writable.
#[no_mangle]
pub unsafe extern "C" fn amoe_reduce_policy_decisions(
    policy: *const amoe_reduce_policy,
    comm_type: u32,
    early: *mut u8,
    routed: *mut u8,
    shared: *mut u8,
    final_: *mut u8,
) -> amoe_status {
    const F: &str = "amoe_reduce_policy_decisions";
    ffi!(F, {
        let p = self::policy(F, policy)?;
        let c = CommType::from_u32(comm_type)?;
        for (ptr, v) in [
            (early, p.early()),
            (routed, p.routed_early_reduces(c)),
            (shared, p.shared_reduces(c)),
            (final_, p.final_reduces(c)),
        ] {
            if !ptr.is_null() {
                // SAFETY: non-null, writable per the contract.
                unsafe { write_out(ptr, v as u8) };
            }
        }
        Ok(())
    })
}

/// Which of the three reduction points a call runs.
#[derive(Clone, Copy)]
enum Point {
    RoutedEarly,
    Shared,
    Final,
}

/// # Safety
/// As the reduction-point exports.
#[allow(clippy::too_many_arguments)] // the export's arguments, plus which point it is
unsafe fn reduce_point(
    f: &'static str,
    point: Point,
    p: *const amoe_reduce_policy,
    x: *const amoe_tensor,
    comm_type: u32,
    tp_comm: *const amoe_comm,
    out: *const amoe_tensor,
    stream: *const amoe_stream,
) -> Result<(), Failure> {
    let p = policy(f, p)?;
    let c = CommType::from_u32(comm_type)?;
    // SAFETY: `stream` is NULL or a live handle, per the caller's contract.
    unsafe { super::live::guard_op(f, stream, c, None) }?;
    // SAFETY: the caller's contracts, for every call below.
    let tp = unsafe { comm_ref(f, tp_comm) }?;
    let x_in = unsafe { read_tensor(f, "x", x) }?;
    // SAFETY: `out` is a valid descriptor, per the export's contract.
    unsafe { check_out(f, "out", out, x_in.shape(), x_in.dtype()) }?;
    let x = if x_in.is_cpu() {
        // A host input is borrowed read-only: the op's first write makes it
        // a private copy.
        x_in
    } else {
        // An NPU input is reduced in the caller's `out`: `x` is copied there
        // on the stream (nothing when they are the same memory), so no
        // buffer is allocated and the result needs no copy.
        // SAFETY: `out` is a valid descriptor over NPU memory of the stream's device.
        let o = unsafe { super::ffi::out_tensor(f, "out", out) }?;
        if let (Storage::Npu(src), Storage::Npu(dst)) = (x_in.storage(), o.storage()) {
            if src.as_ptr() != dst.as_ptr() {
                dst.copy_from_device(0, src, 0, src.len_bytes())?;
            }
        } else {
            return Err(Failure::new(
                amoe_status::Device,
                format!("{f}: `x` is an NPU tensor, so `out` must be one too (on the stream's device)"),
            ));
        }
        o
    };
    let y = match point {
        Point::RoutedEarly => p.reduce_routed_early(x, c, tp)?,
        Point::Shared => p.reduce_shared(x, c, tp)?,
        Point::Final => p.reduce_final(x, c, tp)?,
    };
    // SAFETY: `out` is a valid descriptor, per the export's contract.
    unsafe { write_tensor(f, "out", out, &y) }
}

/// Reduction point 1 (routed output, before the transform) with the live
/// `comm_type`: `out` = TP all-reduce of `x` when the policy says so for this
/// comm type, else a copy of `x`. Shape and dtype of `out` equal `x`'s (the
/// shape function is the identity); `x` and `out` may be the same memory.
/// Collective over `tp_comm` when it reduces. Ownership as `amoe_all_reduce`.
///
/// NPU (this and the other two reduction points): enqueues on `stream` one
/// device copy of `x` into `out` (none when they are the same memory) and,
/// when the point reduces, one in-place HCCL all-reduce of `out`; never
/// synchronises, never allocates, never reads device data on the host.
///
/// # Safety
/// `policy` valid; `x`, `out` valid descriptors; `tp_comm` live.
#[no_mangle]
pub unsafe extern "C" fn amoe_reduce_routed_early(
    policy: *const amoe_reduce_policy,
    x: *const amoe_tensor,
    comm_type: u32,
    tp_comm: *const amoe_comm,
    out: *const amoe_tensor,
    stream: *const amoe_stream,
) -> amoe_status {
    const F: &str = "amoe_reduce_routed_early";
    ffi!(F, {
        // SAFETY: `stream` is NULL or a live handle, per the export's contract.
        let _npu = unsafe { super::ffi::bind_stream(F, stream) }?;
        // SAFETY: the caller's contracts, forwarded.
        unsafe { reduce_point(F, Point::RoutedEarly, policy, x, comm_type, tp_comm, out, stream) }
    })
}

/// Reduction point 2 (shared-expert output) with the live `comm_type`.
/// As `amoe_reduce_routed_early`.
///
/// # Safety
/// As `amoe_reduce_routed_early`.
#[no_mangle]
pub unsafe extern "C" fn amoe_reduce_shared(
    policy: *const amoe_reduce_policy,
    x: *const amoe_tensor,
    comm_type: u32,
    tp_comm: *const amoe_comm,
    out: *const amoe_tensor,
    stream: *const amoe_stream,
) -> amoe_status {
    const F: &str = "amoe_reduce_shared";
    ffi!(F, {
        // SAFETY: `stream` is NULL or a live handle, per the export's contract.
        let _npu = unsafe { super::ffi::bind_stream(F, stream) }?;
        // SAFETY: the caller's contracts, forwarded.
        unsafe { reduce_point(F, Point::Shared, policy, x, comm_type, tp_comm, out, stream) }
    })
}

/// Reduction point 3 (after `shared + routed`) with the live `comm_type`.
/// As `amoe_reduce_routed_early`.
///
/// # Safety
/// As `amoe_reduce_routed_early`.
#[no_mangle]
pub unsafe extern "C" fn amoe_reduce_final(
    policy: *const amoe_reduce_policy,
    x: *const amoe_tensor,
    comm_type: u32,
    tp_comm: *const amoe_comm,
    out: *const amoe_tensor,
    stream: *const amoe_stream,
) -> amoe_status {
    const F: &str = "amoe_reduce_final";
    ffi!(F, {
        // SAFETY: `stream` is NULL or a live handle, per the export's contract.
        let _npu = unsafe { super::ffi::bind_stream(F, stream) }?;
        // SAFETY: the caller's contracts, forwarded.
        unsafe { reduce_point(F, Point::Final, policy, x, comm_type, tp_comm, out, stream) }
    })
}
