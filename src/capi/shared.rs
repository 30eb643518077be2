//! The shared-expert token helpers (SPEC section 5, `crate::moe::shared`):
//! DP-only = `amoe_shared_pad_split`, MLP, `amoe_shared_gather_unpad`;
//! SP-only = `amoe_shared_gather_unpad`, MLP, `amoe_shared_pad_reduce_scatter`.
//! Each op has an `*_output_shape` twin calling the Rust shape function the op
//! sizes its output with.

use super::ffi::{ffi, read_meta, refusing_on, write_shape, Call};
use super::types::{amoe_comm, amoe_status, amoe_stream, amoe_tensor};
use crate::moe::shared;
use crate::{Collectives, Comm, Tensor};

/// The body of a shape export: `shape_of(x shape)` written to the out-pointers.
fn shape_body(
    f: &'static str,
    x: *const amoe_tensor,
    shape_of: impl FnOnce(&[usize]) -> crate::Result<Vec<usize>>,
    out_shape: *mut usize,
    cap: usize,
    out_ndim: *mut usize,
) -> amoe_status {
    ffi!(f, {
        let m = read_meta(f, "x", x)?;
        let shape = shape_of(&m.shape)?;
        write_shape(f, &shape, m.dtype, out_shape, cap, out_ndim)
    })
}

/// The body of an op export: `into(x, tp, out)` after `out` is checked
/// against `x` and `shape_of(x shape, tp rank, tp size)`, writing the
/// caller's `out` in place. A `collective` op refuses a bad argument to its
/// peers ([`refusing_on`]).
#[allow(clippy::too_many_arguments)] // the export's arguments, plus the op's two forms
fn op_body(
    f: &'static str,
    collective: bool,
    x: *const amoe_tensor,
    tp_comm: *const amoe_comm,
    out: *const amoe_tensor,
    stream: *const amoe_stream,
    shape_of: impl FnOnce(&[usize], usize, usize) -> crate::Result<Vec<usize>>,
    into: impl FnOnce(&Tensor, &Comm, &mut Tensor) -> crate::Result<()>,
) -> amoe_status {
    ffi!(f, {
        let (cx, tp) = if collective {
            Call::on_comm(f, stream, "tp_comm", tp_comm)?
        } else {
            let cx = Call::new(f, stream)?;
            let tp = cx.comm("tp_comm", tp_comm)?;
            (cx, tp)
        };
        let cx = &cx;
        let checked = (|| {
            let x = cx.input("x", x)?;
            let shape = shape_of(x.shape(), tp.rank(), tp.world_size())?;
            let out = cx.out("out", out)?;
            out.check_like(cx, &x, &shape)?;
            let o = cx.output(&out)?;
            Ok((x, out, o))
        })();
        // The peers of a collective op wait in it (a CPU rank always joins).
        let (x, out, mut y) = if collective { refusing_on(tp, checked)? } else { checked? };
        into(&x, tp, &mut y)?;
        cx.write(&out, y)
    })
}

/// Output shape of `amoe_shared_pad_split` on TP rank `tp_rank` of `tp_size`:
/// `x [T, H...]` -> `[ceil(T / tp_size), H...]`. Out-pointers as
/// `amoe_moe_finalize_routing_output_shape`.
///
/// # Safety
/// `x` valid; out-pointers writable.
#[no_mangle]
pub unsafe extern "C" fn amoe_shared_pad_split_output_shape(
    x: *const amoe_tensor,
    tp_rank: usize,
    tp_size: usize,
    out_shape: *mut usize,
    cap: usize,
    out_ndim: *mut usize,
) -> amoe_status {
    const F: &str = "amoe_shared_pad_split_output_shape";
    let shape_of = |s: &[usize]| shared::shared_pad_split_output_shape(s, tp_rank, tp_size);
    shape_body(F, x, shape_of, out_shape, cap, out_ndim)
}

/// DP-only shared-expert prepare: zero-pad the DP batch `x [T, H...]` to a
/// multiple of the TP size and write this TP rank's equal part. Local (no
/// communication); `tp_comm` gives the rank and size. Ownership as
/// `amoe_moe_finalize_routing`.
///
/// NPU: enqueues on `stream` a copy of this rank's rows into `out` and, for
/// padding rows, one copy of zeros from workspace; never
/// synchronises, never allocates outside the stream's pool (or allocator),
/// never reads device data on the host; can be captured into a graph.
///
/// # Safety
/// `x`, `out` valid descriptors; `tp_comm` live; `stream` NULL or live.
#[no_mangle]
pub unsafe extern "C" fn amoe_shared_pad_split(
    x: *const amoe_tensor,
    tp_comm: *const amoe_comm,
    out: *const amoe_tensor,
    stream: *const amoe_stream,
) -> amoe_status {
    const F: &str = "amoe_shared_pad_split";
    let into = |x: &Tensor, tp: &Comm, o: &mut Tensor| shared::shared_pad_split_into(x, tp, o);
    op_body(F, false, x, tp_comm, out, stream, shared::shared_pad_split_output_shape, into)
}

/// Output shape of `amoe_shared_gather_unpad`: `x` must have
/// `ceil(num_tokens / tp_size)` rows; the output has `num_tokens`.
///
/// # Safety
/// `x` valid; out-pointers writable.
#[no_mangle]
pub unsafe extern "C" fn amoe_shared_gather_unpad_output_shape(
    x: *const amoe_tensor,
    num_tokens: usize,
    tp_size: usize,
    out_shape: *mut usize,
    cap: usize,
    out_ndim: *mut usize,
) -> amoe_status {
    const F: &str = "amoe_shared_gather_unpad_output_shape";
    let shape_of = |s: &[usize]| shared::shared_gather_unpad_output_shape(s, num_tokens, tp_size);
    shape_body(F, x, shape_of, out_shape, cap, out_ndim)
}

/// DP-only shared-expert finalize and SP-only prepare: TP all-gather every
/// rank's `ceil(num_tokens / TP)` rows and keep the first `num_tokens`.
/// Collective over `tp_comm`; every rank passes the same `num_tokens` (a CPU
/// group fails every rank when they differ; an HCCL group compares them
/// with `ASCEND_MOE_CHECK_LAYOUT=1`, reported by `amoe_stream_check`).
/// Ownership as `amoe_moe_finalize_routing`.
///
/// NPU: enqueues on `stream` one HCCL all-gather, into `out` itself when no
/// padding is cut, else into workspace followed by a copy of the kept rows
/// into `out` (with `ASCEND_MOE_CHECK_LAYOUT=1` first an all-gather of the
/// ranks' token-count fingerprints and their comparison on the device); never
/// synchronises, never allocates outside the stream's pool (or allocator),
/// never reads device data on the host; can be captured into a graph. A
/// mismatch between ranks is returned by `amoe_stream_check`.
///
/// # Safety
/// As `amoe_shared_pad_split`.
#[no_mangle]
pub unsafe extern "C" fn amoe_shared_gather_unpad(
    x: *const amoe_tensor,
    num_tokens: usize,
    tp_comm: *const amoe_comm,
    out: *const amoe_tensor,
    stream: *const amoe_stream,
) -> amoe_status {
    const F: &str = "amoe_shared_gather_unpad";
    let shape_of =
        |s: &[usize], _rank: usize, size: usize| shared::shared_gather_unpad_output_shape(s, num_tokens, size);
    let into = |x: &Tensor, tp: &Comm, o: &mut Tensor| shared::shared_gather_unpad_into(x, num_tokens, tp, o);
    op_body(F, true, x, tp_comm, out, stream, shape_of, into)
}

/// Output shape of `amoe_shared_pad_reduce_scatter`: `x [T, H...]` ->
/// `[ceil(T / tp_size), H...]`.
///
/// # Safety
/// `x` valid; out-pointers writable.
#[no_mangle]
pub unsafe extern "C" fn amoe_shared_pad_reduce_scatter_output_shape(
    x: *const amoe_tensor,
    tp_size: usize,
    out_shape: *mut usize,
    cap: usize,
    out_ndim: *mut usize,
) -> amoe_status {
    const F: &str = "amoe_shared_pad_reduce_scatter_output_shape";
    let shape_of = |s: &[usize]| shared::shared_pad_reduce_scatter_output_shape(s, tp_size);
    shape_body(F, x, shape_of, out_shape, cap, out_ndim)
}

/// SP-only shared-expert finalize: zero-pad the TP-partial `x [T, H...]` to a
/// multiple of the TP size and reduce-scatter (sum) over `tp_comm`: this rank's
/// complete `ceil(T / TP)` rows. Collective; every rank passes the same `T`
/// (a CPU group fails every rank when they differ; an HCCL group compares
/// them with `ASCEND_MOE_CHECK_LAYOUT=1`, reported by `amoe_stream_check`).
/// Ownership as `amoe_moe_finalize_routing`.
///
/// NPU: enqueues on `stream` a copy into a zeroed padded workspace buffer
/// (when `T` is not a multiple of TP) and one HCCL reduce-scatter into
/// `out` (with `ASCEND_MOE_CHECK_LAYOUT=1` first an all-gather of the ranks'
/// token-count fingerprints and their comparison on the device); never synchronises, never allocates outside the
/// stream's pool (or allocator), never reads device data on the host; can be
/// captured into a graph. A mismatch between ranks is returned by
/// `amoe_stream_check`.
///
/// # Safety
/// As `amoe_shared_pad_split`.
#[no_mangle]
pub unsafe extern "C" fn amoe_shared_pad_reduce_scatter(
    x: *const amoe_tensor,
    tp_comm: *const amoe_comm,
    out: *const amoe_tensor,
    stream: *const amoe_stream,
) -> amoe_status {
    const F: &str = "amoe_shared_pad_reduce_scatter";
    let shape_of = |s: &[usize], _rank: usize, size: usize| shared::shared_pad_reduce_scatter_output_shape(s, size);
    let into = |x: &Tensor, tp: &Comm, o: &mut Tensor| shared::shared_pad_reduce_scatter_into(x, tp, o);
    op_body(F, true, x, tp_comm, out, stream, shape_of, into)
}
