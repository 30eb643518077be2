//! The finalize-routing and token-unpermute ops (SPEC section 1) and their
//! shape functions.
//!
//! Each op has one shape function working on shapes and dtypes only
//! ([`moe_finalize_routing_shape`], [`moe_token_unpermute_shape`]); the tensor
//! variants ([`moe_finalize_routing_output_shape`],
//! [`moe_token_unpermute_output_shape`]) add the device check and call it, and
//! the ops size their output with them. The C ABI exports the shape-only
//! functions for the Python meta (fake) implementations, so the real and the
//! meta shape cannot disagree.

use crate::backend::args::{checked_bytes, checked_numel};
use crate::backend::{DropPadMode, FinalizeArgs, FinalizeDims, OutputRows};
use crate::device::Memory;
use crate::moe::output::write_apart;
use crate::types::Numbered;
pub use crate::types::TensorMeta;
use crate::{DType, Device, Error, Result, Tensor};

const FINALIZE: &str = "moe_finalize_routing";
const UNPERMUTE: &str = "moe_token_unpermute";

/// The finalize inputs as shapes and dtypes, with the drop-pad mode as the raw
/// number a caller passed (so an unknown mode is reported, not unrepresentable).
#[derive(Debug, Clone, Copy)]
pub struct FinalizeMeta<'a> {
    /// `[N*K, H...]` (modes 0/2) or `[E, C, H...]` (modes 1/3).
    pub expanded_x: TensorMeta<'a>,
    /// int32 `[N*K]`.
    pub expanded_row_idx: TensorMeta<'a>,
    /// Optional `[N, H...]`.
    pub x1: Option<TensorMeta<'a>>,
    /// Optional `[N, H...]`.
    pub x2: Option<TensorMeta<'a>>,
    /// Optional `[E, H...]`.
    pub bias: Option<TensorMeta<'a>>,
    /// Optional `[N, K]`.
    pub scales: Option<TensorMeta<'a>>,
    /// Optional int32 `[N, K]`.
    pub expert_idx: Option<TensorMeta<'a>>,
    /// Drop-pad mode as passed (valid: 0..=3).
    pub drop_pad_mode: i64,
}

impl<'a> FinalizeMeta<'a> {
    /// The meta of real finalize arguments.
    pub fn of(args: &FinalizeArgs<&'a Tensor>) -> Self {
        FinalizeMeta {
            expanded_x: TensorMeta::of(args.expanded_x),
            expanded_row_idx: TensorMeta::of(args.expanded_row_idx),
            x1: args.x1.map(TensorMeta::of),
            x2: args.x2.map(TensorMeta::of),
            bias: args.bias.map(TensorMeta::of),
            scales: args.scales.map(TensorMeta::of),
            expert_idx: args.expert_idx.map(TensorMeta::of),
            drop_pad_mode: args.drop_pad_mode as i64,
        }
    }
}

/// The drop-pad mode for a raw number; an error names the value otherwise.
pub fn drop_pad_mode(op: &'static str, value: i64) -> Result<DropPadMode> {
    u32::try_from(value).ok().and_then(DropPadMode::from_u32).ok_or_else(|| {
        Error::invalid(
            op,
            "drop_pad_mode",
            format!("unknown drop-pad mode {value} (expected {})", DropPadMode::expected()),
        )
    })
}

fn float_dtype(op: &'static str, arg: &'static str, d: DType) -> Result<()> {
    if d.is_float() {
        Ok(())
    } else {
        Err(Error::dtype(op, arg, "f32, f16 or bf16", d))
    }
}

fn same_dtype(op: &'static str, arg: &'static str, want: DType, got: DType) -> Result<()> {
    if want == got {
        Ok(())
    } else {
        Err(Error::dtype(op, arg, format!("{want} (the dtype of the data)"), got))
    }
}

/// Scales / probs: `[N, K]`, K >= 1, dtype of the data or f32.
fn scale_dims(op: &'static str, arg: &'static str, m: &TensorMeta<'_>, data: DType) -> Result<(usize, usize)> {
    if m.dtype != data && m.dtype != DType::F32 {
        let expected = match data {
            DType::F32 => "f32 (the dtype of the data)".to_string(),
            _ => format!("{data} (the dtype of the data) or f32"),
        };
        return Err(Error::dtype(op, arg, expected, m.dtype));
    }
    match *m.shape {
        [n, k] if k >= 1 => Ok((n, k)),
        _ => Err(Error::shape(op, arg, "[N, K] with K >= 1", m.shape)),
    }
}

fn index_vector(op: &'static str, arg: &'static str, m: &TensorMeta<'_>) -> Result<usize> {
    if m.dtype != DType::I32 {
        return Err(Error::dtype(op, arg, "i32", m.dtype));
    }
    match *m.shape {
        [len] => Ok(len),
        _ => Err(Error::shape(op, arg, "1-D [N*K]", m.shape)),
    }
}

/// The one shape function of the finalize op: validates every input's dtype
/// and shape (bias without expert_idx, scales not `[N, K]`, an unknown mode,
/// ...) and returns the output shape `[N, H...]` with the call's sizes.
pub fn moe_finalize_routing_shape(m: &FinalizeMeta<'_>) -> Result<(Vec<usize>, FinalizeDims)> {
    let op = FINALIZE;
    let mode = drop_pad_mode(op, m.drop_pad_mode)?;
    let xd = m.expanded_x.dtype;
    float_dtype(op, "expanded_x", xd)?;
    let xs = m.expanded_x.shape;
    let (expanded_rows, trailing) = if mode.is_drop_pad() {
        if xs.len() < 3 {
            return Err(Error::shape(
                op,
                "expanded_x",
                format!("[E, C, H] (3-D) in drop-pad mode {}", mode as u32),
                xs,
            ));
        }
        let rows = xs[0]
            .checked_mul(xs[1])
            .ok_or_else(|| Error::shape(op, "expanded_x", "E * C rows that fit in usize", xs))?;
        (rows, &xs[2..])
    } else {
        if xs.len() < 2 {
            return Err(Error::shape(
                op,
                "expanded_x",
                format!("[N*K, H] (2-D) in drop-less mode {}", mode as u32),
                xs,
            ));
        }
        (xs[0], &xs[1..])
    };
    let h = row_len(op, "expanded_x", xs, trailing)?;
    let idx_len = index_vector(op, "expanded_row_idx", &m.expanded_row_idx)?;
    let (n, k) = match &m.scales {
        Some(s) => {
            let (n, k) = scale_dims(op, "scales", s, xd)?;
            checked_numel(op, "scales", s.shape)?;
            if idx_len != n * k {
                return Err(Error::shape(
                    op,
                    "expanded_row_idx",
                    format!("[{}] (N*K from scales [{n}, {k}])", n * k),
                    m.expanded_row_idx.shape,
                ));
            }
            (n, k)
        }
        None => (idx_len, 1),
    };
    if !mode.is_drop_pad() && expanded_rows != n * k {
        return Err(Error::shape(
            op,
            "expanded_x",
            format!("[{}, ...] (N*K = {n}*{k} rows in drop-less mode {})", n * k, mode as u32),
            xs,
        ));
    }
    let mut out = Vec::with_capacity(trailing.len() + 1);
    out.push(n);
    out.extend_from_slice(trailing);
    checked_bytes(op, "expanded_x", &out, xd)?;
    for (arg, t) in [("x1", &m.x1), ("x2", &m.x2)] {
        if let Some(t) = t {
            same_dtype(op, arg, xd, t.dtype)?;
            if t.shape != out.as_slice() {
                return Err(Error::shape(op, arg, format!("{out:?} (the output shape)"), t.shape));
            }
        }
    }
    if let Some(e) = &m.expert_idx {
        if e.dtype != DType::I32 {
            return Err(Error::dtype(op, "expert_idx", "i32", e.dtype));
        }
        if e.shape != [n, k] {
            return Err(Error::shape(op, "expert_idx", format!("[{n}, {k}] (N, K)"), e.shape));
        }
    }
    let experts = match &m.bias {
        Some(b) => {
            same_dtype(op, "bias", xd, b.dtype)?;
            if b.shape.len() != trailing.len() + 1 || &b.shape[1..] != trailing {
                return Err(Error::shape(op, "bias", format!("[E, {}]", dims_str(trailing)), b.shape));
            }
            checked_numel(op, "bias", b.shape)?;
            // In the drop-pad modes expanded_x is [E, C, H]: the bias has a
            // row per expert of it, as the SPEC's shared E says and as
            // ops-transformer's tiling for aclnnMoeFinalizeRoutingV2 demands
            // ("the dim 0 of bias should be E when drop_pad_mode is 1 or 3").
            if mode.is_drop_pad() && b.shape[0] != xs[0] {
                return Err(Error::shape(
                    op,
                    "bias",
                    format!(
                        "[{}, {}] (E = expanded_x's first dim in drop-pad mode {})",
                        xs[0],
                        dims_str(trailing),
                        mode as u32
                    ),
                    b.shape,
                ));
            }
            if m.expert_idx.is_none() {
                return Err(Error::invalid(
                    op,
                    "expert_idx",
                    "required when bias is given (it selects the bias row), got none",
                ));
            }
            b.shape[0]
        }
        None => 0,
    };
    Ok((out, FinalizeDims { n, k, h, expanded_rows, experts }))
}

/// Elements per row (the product of `trailing`, the dims after the rows of
/// `shape`), or an error naming `arg` and its whole shape when it overflows.
fn row_len(op: &'static str, arg: &'static str, shape: &[usize], trailing: &[usize]) -> Result<usize> {
    trailing
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| Error::shape(op, arg, "rows of a size that fits in usize", shape))
}

fn dims_str(d: &[usize]) -> String {
    d.iter().map(|v| v.to_string()).collect::<Vec<_>>().join(", ")
}

/// Checks that every present tensor is on `device`.
fn same_device<'a>(
    op: &'static str,
    device: &Device,
    ts: impl IntoIterator<Item = (&'static str, Option<&'a Tensor>)>,
) -> Result<()> {
    for (arg, t) in ts {
        if let Some(t) = t {
            let d = t.device();
            if &d != device {
                return Err(Error::Device { op, arg, expected: device.to_string(), actual: d.to_string() });
            }
        }
    }
    Ok(())
}

/// The finalize shape function on real arguments: [`moe_finalize_routing_shape`]
/// plus the check that every tensor is on the device of `expanded_x`.
pub fn moe_finalize_routing_output_shape(args: &FinalizeArgs<&Tensor>) -> Result<(Vec<usize>, FinalizeDims)> {
    let r = moe_finalize_routing_shape(&FinalizeMeta::of(args))?;
    same_device(FINALIZE, &args.expanded_x.device(), args.operands().into_iter().skip(1))?;
    Ok(r)
}

/// Fused MoE finalize routing (SPEC section 1): `[N, H...]` in the dtype of
/// `expanded_x`, on its device.
pub fn moe_finalize_routing(args: &FinalizeArgs<&Tensor>) -> Result<Tensor> {
    let (shape, dims) = moe_finalize_routing_output_shape(args)?;
    let device = args.expanded_x.device();
    let backend = device.backend();
    let mut out = backend.output(&shape, args.expanded_x.dtype())?;
    backend.finalize_routing(args, &dims, &mut out, OutputRows::Dense)?;
    Ok(out)
}

/// [`moe_finalize_routing`] into `out` (e.g. caller memory borrowed for the
/// call), which must have the shape of [`moe_finalize_routing_output_shape`]
/// and the dtype of `expanded_x`, on its device. `out` may cover inputs (the
/// residual `x1` itself, say): the result then goes through workspace, one
/// device copy more. Every element is written; on the CPU an invalid index
/// is reported before any is.
pub fn moe_finalize_routing_into(args: &FinalizeArgs<&Tensor>, out: &mut Tensor) -> Result<()> {
    let (shape, dims) = moe_finalize_routing_output_shape(args)?;
    let device = check_out_like(FINALIZE, args.expanded_x, out, &shape)?;
    write_apart(out, args.operands(), |o| device.backend().finalize_routing(args, &dims, o, OutputRows::Dense))
}

/// Checks that the output `out` of `op` has exactly the `shape` and `dtype`
/// its shape function computed.
pub(crate) fn check_out(op: &'static str, out: &Tensor, shape: &[usize], dtype: DType) -> Result<()> {
    check_out_meta(op, "out", out.meta(), shape, dtype)
}

/// [`check_out`] of the output `arg` of `op` from its shape and dtype alone:
/// the dtype, then the shape.
fn check_out_meta(
    op: &'static str,
    arg: &'static str,
    out: TensorMeta<'_>,
    shape: &[usize],
    dtype: DType,
) -> Result<()> {
    if out.dtype != dtype {
        return Err(Error::dtype(op, arg, dtype.name(), out.dtype));
    }
    if out.shape != shape {
        return Err(Error::shape(op, arg, format!("{shape:?}"), out.shape));
    }
    Ok(())
}

/// The one check of an output `arg` of `op` (in `out_memory`, of shape and
/// dtype `out`) against the op's input, in `memory`, and the `shape` and
/// `dtype` its shape function computed, in the order every op checks them:
/// the memory, then the dtype, then the shape. An op never copies its result
/// between host and NPU memory (an NPU op never synchronises the host), so
/// an output elsewhere than its input is DEVICE, naming both. The C ABI
/// checks its output descriptors with it too.
pub(crate) fn check_out_on(
    op: &'static str,
    arg: &'static str,
    out_memory: Memory,
    out: TensorMeta<'_>,
    memory: Memory,
    shape: &[usize],
    dtype: DType,
) -> Result<()> {
    check_out_memory(op, arg, out_memory, memory)?;
    check_out_meta(op, arg, out, shape, dtype)
}

/// The memory part of [`check_out_on`]: the output `arg` of `op` must be in
/// `memory`, its input's.
pub(crate) fn check_out_memory(op: &'static str, arg: &'static str, out_memory: Memory, memory: Memory) -> Result<()> {
    if out_memory != memory {
        return Err(Error::Device {
            op,
            arg,
            expected: format!(
                "{memory} like the op's input (pass `{arg}` there: the op never copies its result between host and \
                 NPU memory)"
            ),
            actual: out_memory.to_string(),
        });
    }
    Ok(())
}

/// [`check_out_on`] against `x`: `out` on the device of `x`, with its dtype
/// and `shape`; returns that device.
pub(crate) fn check_out_like(op: &'static str, x: &Tensor, out: &Tensor, shape: &[usize]) -> Result<Device> {
    let device = x.device();
    check_out_on(op, "out", out.device().memory(), out.meta(), device.memory(), shape, x.dtype())?;
    Ok(device)
}

/// Sizes of a validated unpermute call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UnpermuteDims {
    /// Output tokens.
    pub t: usize,
    /// Top-k.
    pub k: usize,
    /// Elements per row.
    pub h: usize,
    /// Rows of `permuted`.
    pub rows: usize,
}

/// The one shape function of the unpermute op: `permuted [R, H...]` (float),
/// `sorted_indices` int32 `[T*K]`, optional `probs [T, K]` (dtype of `permuted`
/// or f32; without it K = 1). Output `[T, H...]`.
pub fn moe_token_unpermute_shape(
    permuted: TensorMeta<'_>,
    sorted_indices: TensorMeta<'_>,
    probs: Option<TensorMeta<'_>>,
) -> Result<(Vec<usize>, UnpermuteDims)> {
    let op = UNPERMUTE;
    float_dtype(op, "permuted", permuted.dtype)?;
    if permuted.shape.len() < 2 {
        return Err(Error::shape(op, "permuted", "[rows, H] (2-D or more)", permuted.shape));
    }
    let len = index_vector(op, "sorted_indices", &sorted_indices)?;
    let (t, k) = match &probs {
        Some(p) => {
            let (t, k) = scale_dims(op, "probs", p, permuted.dtype)?;
            checked_numel(op, "probs", p.shape)?;
            if len != t * k {
                return Err(Error::shape(
                    op,
                    "sorted_indices",
                    format!("[{}] (T*K from probs [{t}, {k}])", t * k),
                    sorted_indices.shape,
                ));
            }
            (t, k)
        }
        None => (len, 1),
    };
    let trailing = &permuted.shape[1..];
    let h = row_len(op, "permuted", permuted.shape, trailing)?;
    let mut out = vec![t];
    out.extend_from_slice(trailing);
    checked_bytes(op, "permuted", &out, permuted.dtype)?;
    Ok((out, UnpermuteDims { t, k, h, rows: permuted.shape[0] }))
}

/// The unpermute shape function on real tensors (adds the device check).
pub fn moe_token_unpermute_output_shape(
    permuted: &Tensor,
    sorted_indices: &Tensor,
    probs: Option<&Tensor>,
) -> Result<(Vec<usize>, UnpermuteDims)> {
    let r =
        moe_token_unpermute_shape(TensorMeta::of(permuted), TensorMeta::of(sorted_indices), probs.map(TensorMeta::of))?;
    same_device(UNPERMUTE, &permuted.device(), [("sorted_indices", Some(sorted_indices)), ("probs", probs)])?;
    Ok(r)
}

/// Token unpermute: `out[t] = sum_k probs[t,k] * permuted[sorted_indices[t*K + k]]`
/// (probs = 1 when absent); an index outside `[0, rows)` contributes nothing.
/// With K = 1 and no probs it is a row gather.
pub fn moe_token_unpermute(permuted: &Tensor, sorted_indices: &Tensor, probs: Option<&Tensor>) -> Result<Tensor> {
    let (shape, dims) = moe_token_unpermute_output_shape(permuted, sorted_indices, probs)?;
    let device = permuted.device();
    let backend = device.backend();
    let mut out = backend.output(&shape, permuted.dtype())?;
    backend.token_unpermute(permuted, sorted_indices, probs, dims.k, &mut out)?;
    Ok(out)
}

/// [`moe_token_unpermute`] into `out` (e.g. caller memory borrowed for the
/// call), which must have the shape of [`moe_token_unpermute_output_shape`]
/// and the dtype of `permuted`, on its device. `out` may cover inputs, as in
/// [`moe_finalize_routing_into`]. Every element is written.
pub fn moe_token_unpermute_into(
    permuted: &Tensor,
    sorted_indices: &Tensor,
    probs: Option<&Tensor>,
    out: &mut Tensor,
) -> Result<()> {
    let (shape, dims) = moe_token_unpermute_output_shape(permuted, sorted_indices, probs)?;
    let device = check_out_like(UNPERMUTE, permuted, out, &shape)?;
    let inputs = [("permuted", Some(permuted)), ("sorted_indices", Some(sorted_indices)), ("probs", probs)];
    write_apart(out, inputs, |o| device.backend().token_unpermute(permuted, sorted_indices, probs, dims.k, o))
}
