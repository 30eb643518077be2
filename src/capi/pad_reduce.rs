//! The ops around an SP layout (SPEC sections 3-4, `moe::pad_reduce`):
//! pad-and-reduce, gather-and-unpad and the fused finalize-and-reduce, each
//! with its `*_output_shape` twin.

use super::ffi::{ffi, read_meta, read_sizes, refusing_on, write_shape, Call, Failure};
use super::finalize::{amoe_finalize_args, FinalizeInputs, FinalizeMetas};
use super::types::{amoe_comm, amoe_status, amoe_stream, amoe_tensor};
use crate::moe::{self, SpLayout};
use crate::{Collectives, Comm, Tensor};

/// An optional SP layout: `n` 0 means none (plain EP reduce-scatter /
/// all-gather), whatever `local_sizes` is (an empty list may come as NULL or
/// not); otherwise `n` entries, one per EP rank, and NULL is NULL_ARGUMENT.
fn layout(f: &str, local_sizes: *const usize, n: usize) -> Result<Option<SpLayout>, Failure> {
    if n == 0 {
        return Ok(None);
    }
    if local_sizes.is_null() {
        return Err(Failure::new(
            amoe_status::NullArgument,
            format!("{f}: `local_sizes` is NULL with n = {n} (no layout is n = 0)"),
        ));
    }
    let sizes = read_sizes(f, "local_sizes", local_sizes, n)?;
    Ok(Some(SpLayout::new(&sizes)?))
}

/// Shape function of an EP/SP layout op: `(x shape, layout, ep_rank, ep_size)`.
type LayoutShape = fn(&[usize], Option<&SpLayout>, usize, usize) -> crate::Result<Vec<usize>>;

/// The `_into` form of an EP/SP layout op: `(x, layout, ep_comm, out)`.
type LayoutInto = fn(&Tensor, Option<&SpLayout>, &Comm, &mut Tensor) -> crate::Result<()>;

/// The dtype check of an op that takes every dtype.
fn any_dtype(_: crate::DType) -> crate::Result<()> {
    Ok(())
}

/// The body of the `*_output_shape` export of an EP/SP layout op: its
/// dtype check, then its shape function.
#[allow(clippy::too_many_arguments)]
fn layout_op_shape(
    f: &'static str,
    (dtype_of, shape_of): (fn(crate::DType) -> crate::Result<()>, LayoutShape),
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
        let m = read_meta(f, "x", x)?;
        dtype_of(m.dtype)?;
        let l = layout(f, local_sizes, n)?;
        let shape = shape_of(&m.shape, l.as_ref(), ep_rank, ep_size)?;
        write_shape(f, &shape, m.dtype, out_shape, cap, out_ndim)
    })
}

/// The body of an EP/SP layout op's export: `into(x, layout, ep_comm, out)`
/// after `out` is checked against `shape_of`, writing the caller's `out` in
/// place (its intermediates are workspace of the stream's pool on NPU;
/// nothing synchronises or allocates outside the pool).
#[allow(clippy::too_many_arguments)]
fn layout_op(
    f: &'static str,
    shape_of: LayoutShape,
    into: LayoutInto,
    x: *const amoe_tensor,
    local_sizes: *const usize,
    n: usize,
    ep_comm: *const amoe_comm,
    out: *const amoe_tensor,
    stream: *const amoe_stream,
) -> amoe_status {
    ffi!(f, {
        let (cx, c) = Call::on_comm(f, stream, "ep_comm", ep_comm)?;
        let cx = &cx;
        let checked = (|| {
            let x = cx.input("x", x)?;
            let l = layout(f, local_sizes, n)?;
            let shape = shape_of(x.shape(), l.as_ref(), c.rank(), c.world_size())?;
            let out = cx.out("out", out)?;
            out.check_like(cx, &x, &shape)?;
            let o = cx.output(&out)?;
            Ok((x, l, out, o))
        })();
        // A CPU rank always joins the op's collective, so its peers wait there.
        let (x, l, out, mut y) = refusing_on(c, checked)?;
        into(&x, l.as_ref(), c, &mut y)?;
        cx.write(&out, y)
    })
}

/// Output shape of `amoe_maybe_pad_and_reduce` on EP rank `ep_rank` of
/// `ep_size`: `[local_sizes[ep_rank], H...]`, or `[rows / ep_size, H...]`
/// without a layout: `n` 0, whatever `local_sizes` is (NULL or not, as an
/// empty list may come); NULL with `n` > 0 is `AMOE_STATUS_NULL_ARGUMENT`.
/// `x`'s data pointer is ignored.
/// Out-pointers as `amoe_moe_finalize_routing_output_shape`.
///
/// # Safety
/// `x` valid; `local_sizes` readable for `n` (any value when `n` is 0); out-pointers writable.
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
    let shape_of =
        (moe::maybe_pad_and_reduce_dtype as fn(_) -> _, moe::maybe_pad_and_reduce_output_shape as LayoutShape);
    layout_op_shape(F, shape_of, x, local_sizes, n, ep_rank, ep_size, out_shape, cap, out_ndim)
}

/// EP/SP finalize (SPEC section 3): pad each EP rank's block of `x`
/// (`sum(local_sizes)` rows, EP-rank block order) to `M = max(local_sizes)`
/// rows, reduce-scatter (sum) over `ep_comm`, keep this rank's
/// `local_sizes[rank]` rows. `n` 0 (NULL or not `local_sizes`) = plain EP
/// reduce-scatter.
/// Collective: every rank of `ep_comm` calls it with the same layout.
/// Ownership as `amoe_moe_finalize_routing`.
///
/// NPU (this and `amoe_maybe_all_gather_and_maybe_unpad`): enqueues on
/// `stream` the row copies into a padded workspace buffer, one HCCL
/// collective and, where the layout pads this rank's rows, the copies of
/// the kept rows into `out` (without padding the collective writes `out`
/// itself); never
/// synchronises, never allocates outside the stream's pool, never reads
/// device data on the host. A mismatch between ranks is returned by
/// `amoe_stream_check`.
///
/// # Safety
/// `x`, `out` valid descriptors; `local_sizes` readable for `n` (any value when `n` is 0); `ep_comm` live.
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
    let (shape_of, into) = (moe::maybe_pad_and_reduce_output_shape, moe::maybe_pad_and_reduce_into::<Comm>);
    layout_op(F, shape_of, into, x, local_sizes, n, ep_comm, out, stream)
}

/// Output shape of `amoe_maybe_all_gather_and_maybe_unpad`:
/// `[sum(local_sizes), H...]` (`x` must have `local_sizes[ep_rank]` rows), or
/// `[rows * ep_size, H...]` without a layout (`n` 0, NULL or not `local_sizes`).
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
    // A gather moves every dtype as bytes.
    let shape_of = (any_dtype as fn(_) -> _, moe::maybe_all_gather_and_maybe_unpad_output_shape as LayoutShape);
    layout_op_shape(F, shape_of, x, local_sizes, n, ep_rank, ep_size, out_shape, cap, out_ndim)
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
    let into = moe::maybe_all_gather_and_maybe_unpad_into::<Comm>;
    layout_op(F, shape_of, into, x, local_sizes, n, ep_comm, out, stream)
}

/// Output shape of `amoe_finalize_and_reduce`: the finalize's `[N, H...]`
/// with `N = sum(local_sizes)` becomes `[local_sizes[ep_rank], H...]`.
/// Out-pointers as `amoe_moe_finalize_routing_output_shape`.
///
/// # Safety
/// As `amoe_moe_finalize_routing_output_shape`; `local_sizes` readable for `n` (any value when `n` is 0).
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
        let m = FinalizeMetas::read(F, args)?;
        let l = layout(F, local_sizes, n)?;
        let shape = moe::finalize_and_reduce_shape(&m.meta(), l.as_ref(), ep_rank, ep_size)?;
        write_shape(F, &shape, m.meta().expanded_x.dtype, out_shape, cap, out_ndim)
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
        let (cx, c) = Call::on_comm(F, stream, "ep_comm", ep_comm)?;
        let cx = &cx;
        let checked = (|| {
            let inputs = FinalizeInputs::read(cx, args)?;
            let l = layout(F, local_sizes, n)?;
            let shape = moe::finalize_and_reduce_output_shape(&inputs.args()?, l.as_ref(), c.rank(), c.world_size())?;
            let out = cx.out("out", out)?;
            out.check_like(cx, &inputs.x, &shape)?;
            let o = cx.output(&out)?;
            Ok((inputs, l, out, o))
        })();
        let (inputs, l, out, mut y) = refusing_on(c, checked)?;
        moe::finalize_and_reduce_into(&inputs.args()?, l.as_ref(), c, &mut y)?;
        // `inputs` (the tensors over the caller's inputs) are dropped with
        // the body, before `boundary` copies a host result out.
        cx.write(&out, y)
    })
}
