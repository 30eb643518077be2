//! The fused finalize and token unpermute (SPEC section 1, `moe::finalize`)
//! and their shape functions; the ops around an SP layout are in
//! `pad_reduce`, the reduce policy in `reduce`.
//!
//! Every op has an `*_output_shape` twin taking the same descriptors (data
//! pointers ignored) that calls the same Rust shape function the op uses to
//! size its result, so a meta / fake implementation built on it cannot
//! disagree with the real op.

use super::ffi::{ffi, read_meta, try_ref, write_shape, Call, Failure, Meta};
use super::types::{amoe_status, amoe_stream, amoe_tensor};
use crate::backend::FinalizeArgs;
use crate::moe;
use crate::moe::finalize::{drop_pad_mode, FinalizeMeta, TensorMeta};
use crate::Tensor;

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

fn meta_of(m: &Meta) -> TensorMeta<'_> {
    TensorMeta { shape: &m.shape, dtype: m.dtype }
}

/// Owned inputs of a finalize call, read from an `amoe_finalize_args`.
pub(super) struct FinalizeInputs {
    pub(super) x: Tensor,
    idx: Tensor,
    x1: Option<Tensor>,
    x2: Option<Tensor>,
    bias: Option<Tensor>,
    scales: Option<Tensor>,
    expert_idx: Option<Tensor>,
    mode: u32,
    /// The export that reads them, which an invalid `drop_pad_mode` names.
    f: &'static str,
}

impl FinalizeInputs {
    /// The tensors of `a`'s descriptors, converted through the call.
    pub(super) fn read(cx: &Call<'_>, a: *const amoe_finalize_args) -> Result<Self, Failure> {
        let a = try_ref!(cx.f, a, "args");
        Ok(FinalizeInputs {
            x: cx.input("expanded_x", a.expanded_x)?,
            idx: cx.input("expanded_row_idx", a.expanded_row_idx)?,
            x1: cx.input_opt("x1", a.x1)?,
            x2: cx.input_opt("x2", a.x2)?,
            bias: cx.input_opt("bias", a.bias)?,
            scales: cx.input_opt("scales", a.scales)?,
            expert_idx: cx.input_opt("expert_idx", a.expert_idx)?,
            mode: a.drop_pad_mode,
            f: cx.f,
        })
    }

    pub(super) fn args(&self) -> Result<FinalizeArgs<&Tensor>, Failure> {
        Ok(FinalizeArgs {
            expanded_x: &self.x,
            expanded_row_idx: &self.idx,
            x1: self.x1.as_ref(),
            x2: self.x2.as_ref(),
            bias: self.bias.as_ref(),
            scales: self.scales.as_ref(),
            expert_idx: self.expert_idx.as_ref(),
            drop_pad_mode: drop_pad_mode(self.f, self.mode as i64)?,
        })
    }
}

/// Shapes and dtypes of an `amoe_finalize_args` (data pointers ignored).
pub(super) struct FinalizeMetas {
    x: Meta,
    idx: Meta,
    opt: [Option<Meta>; 5],
    mode: u32,
}

impl FinalizeMetas {
    /// The shapes and dtypes of `a`'s descriptors.
    pub(super) fn read(f: &str, a: *const amoe_finalize_args) -> Result<Self, Failure> {
        let a = try_ref!(f, a, "args");
        let opt = |arg: &str, d: *const amoe_tensor| -> Result<Option<Meta>, Failure> {
            if d.is_null() {
                return Ok(None);
            }
            read_meta(f, arg, d).map(Some)
        };
        Ok(FinalizeMetas {
            x: read_meta(f, "expanded_x", a.expanded_x)?,
            idx: read_meta(f, "expanded_row_idx", a.expanded_row_idx)?,
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

    pub(super) fn meta(&self) -> FinalizeMeta<'_> {
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

/// Output shape of `amoe_moe_finalize_routing` (`[N, H...]`, dtype of
/// `expanded_x`) from the shapes and dtypes in `args`; validates every input
/// exactly as the op does. Data pointers are ignored and may be NULL.
///
/// The shape goes to `out_shape` (caller-owned, `cap` entries) and its
/// length to `*out_ndim`; when `cap` is too small only `*out_ndim` is written
/// and `AMOE_STATUS_BUFFER_TOO_SMALL` returned. `AMOE_MAX_NDIM` always suffices.
/// An output whose size in bytes (zero dims counted as 1) would exceed
/// `PTRDIFF_MAX`, which no descriptor can carry, is `AMOE_STATUS_SHAPE`;
/// so for every `*_output_shape` function.
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
        let m = FinalizeMetas::read(F, args)?;
        let (shape, _) = moe::moe_finalize_routing_shape(&m.meta())?;
        write_shape(F, &shape, m.meta().expanded_x.dtype, out_shape, cap, out_ndim)
    })
}

/// Fused MoE finalize routing (SPEC section 1):
/// `out[i] = x1[i] + x2[i] + sum_k s(i,k) * (row(R(i,k)) + bias[expert_idx[i,k]])`.
///
/// Inputs are read from the caller's memory during the call; the result is
/// written into `out`, which the caller allocated with the shape from
/// `amoe_moe_finalize_routing_output_shape` and the dtype of `expanded_x`.
/// An index outside its valid range is an error (`AMOE_STATUS_INDEX_OUT_OF_RANGE`)
/// and `out` is then not written on the host (unspecified on NPU, where it
/// is reported by `amoe_stream_check`). `out` may overlap inputs (the
/// residual `x1` itself, or `expanded_x`): the result is then written to
/// workspace and copied into `out`, one device copy more on an NPU, the
/// same result as into separate memory. The same holds for the ops that
/// take their ownership rules from this one, for an `out` over their `x`.
///
/// NPU tensors, native kernel (the default where it can launch): enqueues on
/// `stream` one memset of the status words, one small copy of the kernel's
/// tiling from a pinned staging block and one kernel launch writing `out`
/// in place (plus, for the padded layout, one small copy of the slot
/// offsets, staged the same way); workspace comes from the stream's pool or allocator. It never reads device data on
/// the host. After the first launch on `stream` (which reserves its status records and pinned
/// staging) it never calls `aclrtMalloc` or `aclrtMallocHost`, however many calls run between
/// two `amoe_stream_check`s, and it waits on the host only when 256 launches ran without a check
/// or its 16 staging blocks are all in flight (README, "NPU ops only enqueue"); a bad index is returned by
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
        let cx = &Call::new(F, stream)?;
        let inputs = FinalizeInputs::read(cx, args)?;
        let a = inputs.args()?;
        let (shape, _) = moe::moe_finalize_routing_output_shape(&a)?;
        let out = cx.out("out", out)?;
        out.check_like(cx, &inputs.x, &shape)?;
        // The op writes the caller's `out` in place, host or NPU memory.
        let mut y = cx.output(&out)?;
        moe::moe_finalize_routing_into(&a, &mut y)?;
        cx.write(&out, y)
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
        let p = read_meta(F, "permuted", permuted)?;
        let s = read_meta(F, "sorted_indices", sorted_indices)?;
        let pr = if probs.is_null() { None } else { Some(read_meta(F, "probs", probs)?) };
        let (shape, _) = moe::moe_token_unpermute_shape(meta_of(&p), meta_of(&s), pr.as_ref().map(meta_of))?;
        write_shape(F, &shape, p.dtype, out_shape, cap, out_ndim)
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
/// `stream` one memset of the status words, one small copy of the kernel's
/// tiling from a pinned staging block and one kernel launch writing `out`;
/// it never reads device data on the host and can be captured into a
/// graph. After the first launch on `stream` it never calls `aclrtMalloc` or
/// `aclrtMallocHost`, however many calls run between two checks, and waits
/// on the host only as `amoe_moe_finalize_routing` says. NPU, aclnn
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
        let cx = &Call::new(F, stream)?;
        let p = cx.input("permuted", permuted)?;
        let s = cx.input("sorted_indices", sorted_indices)?;
        let pr = cx.input_opt("probs", probs)?;
        let (shape, _) = moe::moe_token_unpermute_output_shape(&p, &s, pr.as_ref())?;
        let out = cx.out("out", out)?;
        out.check_like(cx, &p, &shape)?;
        let mut y = cx.output(&out)?;
        moe::moe_token_unpermute_into(&p, &s, pr.as_ref(), &mut y)?;
        cx.write(&out, y)
    })
}
