//! CPU finalize-routing and token-unpermute kernels (SPEC section 1).
//!
//! Both ops are "gather K rows per token, scale, sum": one kernel serves both.
//! Work is split over output rows into contiguous chunks, one per thread
//! (`std::thread::scope`); each output row is computed by exactly one thread in
//! the SPEC order (`acc = x1 (+ x2)`, then `acc += s * (row + bias)` for
//! k = 0..K-1, all in f32, one final rounding), so the result is bitwise the
//! same for any thread count.
//!
//! The inner loops run over H and vectorise. For f32 and bf16 without bias, up
//! to eight source rows are streamed in one pass (each element still sees the
//! same operations in the same order), and a token with one skip input and
//! K <= 8 goes from its inputs to its rounded output row in a single pass. On
//! x86_64 the same code is also compiled for AVX2 and picked at run time, and
//! bf16 and f16 tokens have hand-written AVX2 and AVX-512 kernels (AVX-512
//! where the CPU has F and BW and the compiler has the intrinsics: stable
//! Rust 1.89 on, checked by `build.rs`);
//! no fused multiply-add is used, so every path gives the same bits.
//! A bf16 or f16 call that moves at least twice the last-level cache writes
//! its output with streaming stores there (same bits; see
//! [`set_streaming_stores`]): it would evict that output before returning
//! anyway, and ordinary stores would first read every output line.
//!
//! The thread count is the calling thread's override ([`set_num_threads`]),
//! else `ASCEND_MOE_NUM_THREADS`, else the machine's parallelism; small calls run
//! on the calling thread.

mod gather;
mod lanes;
mod threads;

use half::{bf16, f16};

use super::CpuBuffer;
use crate::backend::{FinalizeArgs, FinalizeDims, OutputRows, View, ViewMut};
use crate::{DType, Element, Error, Result};

type In<'a> = View<'a, CpuBuffer>;
type Out<'a> = ViewMut<'a, CpuBuffer>;
use gather::{Gather, Store};
use lanes::Lanes;
pub use threads::{
    default_num_threads, env_num_threads, finalize_threads, set_num_threads, set_streaming_stores, set_wide_simd,
};

const FINALIZE: &str = "moe_finalize_routing";
const UNPERMUTE: &str = "moe_token_unpermute";

/// Widens a float tensor (any of the three float dtypes) to f32.
fn widen_any(op: &'static str, arg: &'static str, t: In<'_>) -> Result<Vec<f32>> {
    Ok(match t.dtype() {
        DType::F32 => t.typed::<f32>(op, arg)?.to_vec(),
        DType::F16 => t.typed::<f16>(op, arg)?.iter().map(|v| v.to_f32()).collect(),
        DType::BF16 => t.typed::<bf16>(op, arg)?.iter().map(|v| v.to_f32()).collect(),
        d => return Err(Error::dtype(op, arg, "f32, f16 or bf16", d)),
    })
}

/// The `[N, K]` routing weights `t` widened to f32.
fn weights(op: &'static str, arg: &'static str, t: In<'_>, n: usize, k: usize) -> Result<Vec<f32>> {
    let v = widen_any(op, arg, t)?;
    if v.len() != n * k {
        return Err(Error::shape(op, arg, format!("[{n}, {k}]"), t.shape()));
    }
    Ok(v)
}

/// Index slice of an int32 tensor on the host.
fn indices<'a>(op: &'static str, arg: &'static str, t: In<'a>) -> Result<&'a [i32]> {
    if t.dtype() != DType::I32 {
        return Err(Error::dtype(op, arg, "i32", t.dtype()));
    }
    t.typed::<i32>(op, arg)
}

/// Checks that every index lies in `[lo, hi)`; the first offender names its
/// position and value.
fn check_range(op: &'static str, arg: &'static str, idx: &[i32], lo: i64, hi: usize) -> Result<()> {
    match idx.iter().position(|&v| (v as i64) < lo || (v as i64) >= hi as i64) {
        None => Ok(()),
        Some(position) => Err(Error::IndexOutOfRange {
            op,
            arg,
            position,
            value: idx[position] as i64,
            valid: format!("[{lo}, {hi})"),
        }),
    }
}

/// A typed data slice of `t`, which must have dtype `T` and `len` elements.
fn data<'a, T: Element>(op: &'static str, arg: &'static str, t: In<'a>, len: usize) -> Result<&'a [T]> {
    if t.dtype() != T::DTYPE {
        return Err(Error::dtype(op, arg, T::DTYPE.name(), t.dtype()));
    }
    let s = t.typed::<T>(op, arg)?;
    if s.len() != len {
        return Err(Error::shape(op, arg, format!("{len} elements"), t.shape()));
    }
    Ok(s)
}

/// Fused finalize routing on the host (SPEC section 1).
///
/// `dims` come from the op layer's shape function; this function re-checks
/// every length it relies on (so it never reads out of bounds even when called
/// directly) and every index value.
pub fn finalize_routing(
    args: &FinalizeArgs<In<'_>>,
    dims: &FinalizeDims,
    out: Out<'_>,
    rows: OutputRows<'_>,
) -> Result<()> {
    match args.expanded_x.dtype() {
        DType::F32 => finalize_typed::<f32>(args, dims, out, rows),
        DType::F16 => finalize_typed::<f16>(args, dims, out, rows),
        DType::BF16 => finalize_typed::<bf16>(args, dims, out, rows),
        d => Err(Error::dtype(FINALIZE, "expanded_x", "f32, f16 or bf16", d)),
    }
}

/// `a * b`, or an error naming `dims` and the product `what`.
fn product(what: &str, a: usize, b: usize) -> Result<usize> {
    a.checked_mul(b).ok_or_else(|| Error::invalid(FINALIZE, "dims", format!("{what} = {a}*{b} overflows usize")))
}

/// Validates every input of a finalize (lengths and index values) and
/// collects what each output token gathers.
fn finalize_gather<'a, T: Lanes>(args: &FinalizeArgs<In<'a>>, dims: &FinalizeDims) -> Result<Gather<'a, T>> {
    let FinalizeDims { n, k, h, expanded_rows, experts } = *dims;
    // `dims` may come straight from a caller: every product is checked.
    let nk = product("N*K", n, k)?;
    let nh = product("N*H", n, h)?;
    let x = data::<T>(FINALIZE, "expanded_x", args.expanded_x, product("rows*H", expanded_rows, h)?)?;
    let idx = indices(FINALIZE, "expanded_row_idx", args.expanded_row_idx)?;
    if idx.len() != nk {
        let want = format!("[{nk}] (N*K = {n}*{k})");
        return Err(Error::shape(FINALIZE, "expanded_row_idx", want, args.expanded_row_idx.shape()));
    }
    let x1 = args.x1.map(|t| data::<T>(FINALIZE, "x1", t, nh)).transpose()?;
    let x2 = args.x2.map(|t| data::<T>(FINALIZE, "x2", t, nh)).transpose()?;
    let scales = args.scales.map(|s| weights(FINALIZE, "scales", s, n, k)).transpose()?;
    let bias = match (args.bias, args.expert_idx) {
        (Some(b), Some(e)) => {
            let bv = widen_any(FINALIZE, "bias", b)?;
            if bv.len() != product("experts*H", experts, h)? {
                return Err(Error::shape(FINALIZE, "bias", format!("[{experts}, {h}]"), b.shape()));
            }
            let ev = indices(FINALIZE, "expert_idx", e)?;
            if ev.len() != nk {
                return Err(Error::shape(FINALIZE, "expert_idx", format!("[{n}, {k}]"), e.shape()));
            }
            check_range(FINALIZE, "expert_idx", ev, 0, experts)?;
            Some((bv, ev))
        }
        (Some(_), None) => {
            return Err(Error::invalid(FINALIZE, "expert_idx", "required when bias is given, got none"));
        }
        (None, _) => None,
    };
    let lo = if args.drop_pad_mode.is_drop_pad() { -1 } else { 0 };
    check_range(FINALIZE, "expanded_row_idx", idx, lo, expanded_rows)?;
    Ok(Gather {
        x,
        rows: expanded_rows,
        h,
        x1,
        x2,
        bias,
        scales,
        idx,
        n,
        k,
        row_layout: args.drop_pad_mode.is_row_layout(),
        skip_invalid: false,
    })
}

fn finalize_typed<T: Lanes>(
    args: &FinalizeArgs<In<'_>>,
    dims: &FinalizeDims,
    mut out: Out<'_>,
    rows: OutputRows<'_>,
) -> Result<()> {
    let g = finalize_gather::<T>(args, dims)?;
    let (n, h) = (dims.n, dims.h);
    let out_rows = match rows {
        OutputRows::Dense => n,
        OutputRows::Padded { local_sizes, slot_rows } => {
            let total = local_sizes.iter().try_fold(0usize, |a, &s| a.checked_add(s));
            if total != Some(n) {
                let sum = total.map_or_else(|| "a sum past usize".to_string(), |t| format!("sum {t}"));
                return Err(Error::invalid(
                    FINALIZE,
                    "local_sizes",
                    format!("{sum}, which must equal the token count N = {n}"),
                ));
            }
            if let Some(m) = local_sizes.iter().copied().max().filter(|m| *m > slot_rows) {
                return Err(Error::invalid(
                    FINALIZE,
                    "slot_rows",
                    format!("{slot_rows} is less than the largest local size {m}"),
                ));
            }
            product("ranks*slot_rows", local_sizes.len(), slot_rows)?
        }
    };
    if out.dtype() != T::DTYPE {
        return Err(Error::dtype(FINALIZE, "out", T::DTYPE.name(), out.dtype()));
    }
    if Some(out.numel()) != out_rows.checked_mul(h) {
        return Err(Error::shape(FINALIZE, "out", format!("{out_rows} rows of {h} elements"), out.shape()));
    }
    let o: &mut [T] = bytemuck::cast_slice_mut(out.bytes_mut());
    match rows {
        OutputRows::Dense => g.run(o, out_rows, &Some, Store::MayStream),
        OutputRows::Padded { local_sizes, slot_rows } => {
            let mut offsets = Vec::with_capacity(local_sizes.len());
            let mut acc = 0;
            for &s in local_sizes {
                offsets.push(acc);
                acc += s;
            }
            let token_of = move |j: usize| {
                let (r, off) = (j / slot_rows, j % slot_rows);
                (off < local_sizes[r]).then(|| offsets[r] + off)
            };
            g.run(o, out_rows, &token_of, Store::MayStream)
        }
    }
    Ok(())
}

/// The rows of a finalize fused with the EP reduce-scatter, for a
/// communicator that sums them straight from its staging buffers
/// (`CpuComm::reduce_scatter_rows_with`): this rank's finalize output
/// (`[N, H]`, tokens in EP-rank block order, block `r` = `local_sizes[r]`
/// tokens) is computed row block by row block into the buffers the
/// communicator hands to [`FusedRows::produce`], so it never exists as a
/// buffer of its own. Bitwise the same as the dense finalize.
pub struct FusedRows<'a> {
    /// Element type of the rows (`expanded_x`'s).
    pub dtype: DType,
    /// The validation of every input (lengths and index values); an error
    /// fails the collective on every rank, with this rank's reason.
    pub local: Result<()>,
    produce: Producer<'a>,
}

/// Writes rows `first..` of block `block` into the given bytes.
type Producer<'a> = Box<dyn FnMut(usize, usize, &mut [u8]) + 'a>;

impl FusedRows<'_> {
    /// Writes rows `first..` of block `block` into `bytes` (whole rows of
    /// `dtype`); called only when [`FusedRows::local`] is `Ok`.
    pub fn produce(&mut self, block: usize, first: usize, bytes: &mut [u8]) {
        (self.produce)(block, first, bytes)
    }
}

/// [`FusedRows`] of a finalize whose output blocks are `local_sizes`.
pub fn fused_rows<'a>(args: &FinalizeArgs<In<'a>>, dims: &FinalizeDims, local_sizes: &[usize]) -> FusedRows<'a> {
    let dtype = args.expanded_x.dtype();
    match dtype {
        DType::F32 => fused_typed::<f32>(args, dims, local_sizes),
        DType::F16 => fused_typed::<f16>(args, dims, local_sizes),
        DType::BF16 => fused_typed::<bf16>(args, dims, local_sizes),
        d => FusedRows {
            dtype: d,
            local: Err(Error::dtype(FINALIZE, "expanded_x", "f32, f16 or bf16", d)),
            produce: Box::new(|_, _, _| {}),
        },
    }
}

fn fused_typed<'a, T: Lanes + 'a>(
    args: &FinalizeArgs<In<'a>>,
    dims: &FinalizeDims,
    local_sizes: &[usize],
) -> FusedRows<'a> {
    let h = dims.h;
    let gather = finalize_gather::<T>(args, dims).and_then(|g| {
        let total = local_sizes.iter().try_fold(0usize, |a, &s| a.checked_add(s));
        if total != Some(dims.n) {
            let why = format!("{local_sizes:?} must sum to the token count N = {}", dims.n);
            return Err(Error::invalid(FINALIZE, "local_sizes", why));
        }
        Ok(g)
    });
    let (g, local) = match gather {
        Ok(g) => (Some(g), Ok(())),
        Err(e) => (None, Err(e)),
    };
    let offsets: Vec<usize> = local_sizes
        .iter()
        .scan(0usize, |acc, &s| {
            let o = *acc;
            *acc = acc.saturating_add(s);
            Some(o)
        })
        .collect();
    let produce = move |block: usize, first: usize, bytes: &mut [u8]| {
        // Called only when `local` is Ok, i.e. with `g` present.
        if let Some(g) = &g {
            let o: &mut [T] = bytemuck::cast_slice_mut(bytes);
            let base = offsets[block] + first;
            // Staging the peers read next: ordinary stores, which leave it cached.
            g.run(o, o.len() / h, &|r| Some(base + r), Store::Cached);
        }
    };
    FusedRows { dtype: T::DTYPE, local, produce: Box::new(produce) }
}

/// Token unpermute on the host: `out[t] = sum_k probs[t,k] * permuted[idx[t*K + k]]`;
/// an index outside `[0, permuted.rows)` contributes nothing.
pub fn token_unpermute(
    permuted: In<'_>,
    sorted_indices: In<'_>,
    probs: Option<In<'_>>,
    k: usize,
    out: Out<'_>,
) -> Result<()> {
    match permuted.dtype() {
        DType::F32 => unpermute_typed::<f32>(permuted, sorted_indices, probs, k, out),
        DType::F16 => unpermute_typed::<f16>(permuted, sorted_indices, probs, k, out),
        DType::BF16 => unpermute_typed::<bf16>(permuted, sorted_indices, probs, k, out),
        d => Err(Error::dtype(UNPERMUTE, "permuted", "f32, f16 or bf16", d)),
    }
}

fn unpermute_typed<T: Lanes>(
    permuted: In<'_>,
    sorted_indices: In<'_>,
    probs: Option<In<'_>>,
    k: usize,
    mut out: Out<'_>,
) -> Result<()> {
    let h = permuted.row_len();
    let rows = if permuted.shape().is_empty() { 0 } else { permuted.rows() };
    let x = data::<T>(UNPERMUTE, "permuted", permuted, rows * h)?;
    let idx = indices(UNPERMUTE, "sorted_indices", sorted_indices)?;
    if k == 0 || idx.len() % k != 0 {
        return Err(Error::invalid(UNPERMUTE, "k", format!("{k} does not divide the {} indices", idx.len())));
    }
    let n = idx.len() / k;
    let scales = probs.map(|p| weights(UNPERMUTE, "probs", p, n, k)).transpose()?;
    if out.dtype() != T::DTYPE {
        return Err(Error::dtype(UNPERMUTE, "out", T::DTYPE.name(), out.dtype()));
    }
    if out.numel() != n * h {
        return Err(Error::shape(UNPERMUTE, "out", format!("{n} rows of {h} elements"), out.shape()));
    }
    let o: &mut [T] = bytemuck::cast_slice_mut(out.bytes_mut());
    let g =
        Gather { x, rows, h, x1: None, x2: None, bias: None, scales, idx, n, k, row_layout: true, skip_invalid: true };
    g.run(o, n, &Some, Store::MayStream);
    Ok(())
}
