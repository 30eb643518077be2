//! Communicator and stream handles, and the collectives (SPEC section 8).

use std::ffi::{c_char, c_void};
use std::ptr::NonNull;
use std::sync::Arc;

use acl_sys::aclrtStream;

use super::ffi::{
    ffi, read_sizes, read_str, refuse_on, refusing, refusing_on, send_refusal, try_out, write_out, Call, Failure,
};
use super::handle::{box_out, release, try_handle};
use super::types::{amoe_comm, amoe_status, amoe_stream, amoe_tensor, AMOE_HCCL_WORLD};
use crate::backend::cpu::CpuComm;
use crate::backend::npu::{Allocator, HcclComm, NpuDevice, WorkspaceAllocator};
use crate::moe::LiveStream;
use crate::{Collectives, Comm, CommOptions, Device, ReduceOp};

/// Joins (or creates) the CPU shared-memory world `name` of `world_size`
/// ranks as `rank`. Every rank calls it with the same `name` and
/// `world_size`, from threads of one process or from separate processes;
/// the call returns once all ranks arrived or the timeout passed.
///
/// `timeout_s` bounds every wait of this communicator (rendezvous and each
/// collective), in seconds: 0, a negative value or NaN means
/// `ASCEND_MOE_COMM_TIMEOUT` or 60 s; infinity (`INFINITY`), or more seconds
/// than a duration holds, means no limit; a positive value under 1e-9 (1 ns,
/// the least timeout) is `AMOE_STATUS_INVALID_ARGUMENT`. The same rule reads
/// `ASCEND_MOE_COMM_TIMEOUT` and the CLI's `--timeout`
/// (`CommOptions::timeout_from_secs`).
/// On success `*out` receives a new handle owned by the caller (free it with
/// `amoe_comm_free`); on failure `*out` is not written.
///
/// # Safety
/// `name` must be a NUL-terminated UTF-8 string; `out` must be writable.
#[no_mangle]
pub unsafe extern "C" fn amoe_comm_cpu_new(
    name: *const c_char,
    world_size: usize,
    rank: usize,
    timeout_s: f64,
    out: *mut *mut amoe_comm,
) -> amoe_status {
    const F: &str = "amoe_comm_cpu_new";
    ffi!(F, {
        let out = try_out!(F, out, "out");
        let name = read_str(F, "name", name)?;
        let opts = CommOptions::from_secs(timeout_s).map_err(|why| Failure::invalid(F, "timeout_s", why))?;
        let c = CpuComm::rendezvous(&name, world_size, rank, &opts)?;
        box_out(out, Comm::Cpu(c));
        Ok(())
    })
}

/// Wraps an HCCL communicator created by the engine (`HcclComm`, e.g. torch
/// ProcessGroupHCCL's) on NPU `device_ordinal`, without taking ownership: the
/// returned handle borrows `raw_hccl_comm`, `amoe_comm_free` releases only the
/// handle, and the engine must keep the HCCL communicator alive until then.
///
/// Collectives are enqueued on the `amoe_stream` of each call (whose device
/// must be `device_ordinal`) and return without waiting; the wait of
/// `amoe_stream_check` is bounded by `ASCEND_MOE_COMM_TIMEOUT` (or 60 s).
/// Returns `AMOE_STATUS_UNAVAILABLE` (with the loader's message) when CANN
/// cannot be loaded; `*out` is then not written.
///
/// `flags` is 0 or `AMOE_HCCL_WORLD` (the communicator is the engine's world,
/// so `amoe_comm_split` may split it); other bits are refused.
///
/// # Safety
/// `raw_hccl_comm` must be a live `HcclComm` of NPU `device_ordinal` that
/// outlives the handle (and a global one when `flags` says so); `out` must be
/// writable.
#[no_mangle]
pub unsafe extern "C" fn amoe_comm_from_hccl(
    raw_hccl_comm: *mut c_void,
    device_ordinal: u32,
    flags: u32,
    out: *mut *mut amoe_comm,
) -> amoe_status {
    const F: &str = "amoe_comm_from_hccl";
    ffi!(F, {
        let out = try_out!(F, out, "out");
        if raw_hccl_comm.is_null() {
            return Err(Failure::null(F, "raw_hccl_comm"));
        }
        if flags & !AMOE_HCCL_WORLD != 0 {
            return Err(Failure::invalid(F, "flags", format!("{flags:#x} has bits other than AMOE_HCCL_WORLD")));
        }
        let _device = crate::backend::npu::runtime::ThreadDevice::kept_loading();
        let dev = NpuDevice::open(device_ordinal)?;
        let opts = CommOptions::from_env();
        // SAFETY: the caller guarantees a live communicator of this device that
        // outlives the handle (a global one with AMOE_HCCL_WORLD); neither
        // borrow destroys it.
        let h = unsafe {
            if flags & AMOE_HCCL_WORLD != 0 {
                HcclComm::borrow_raw_world(&dev, raw_hccl_comm, &opts)
            } else {
                HcclComm::borrow_raw(&dev, raw_hccl_comm, &opts)
            }
        }?;
        box_out(out, Comm::Npu(h));
        Ok(())
    })
}

/// A sub-communicator of the ranks `ranks[0..n]` (group-local rank numbers of
/// `comm`, distinct; the new group's rank order is the list order). Every
/// listed rank calls it with the same list; ranks not in the list must not
/// call it. `*out` receives a new handle owned by the caller; `comm` stays
/// valid and owned by the caller. On a CPU communicator, a listed rank that
/// calls a collective on `comm` instead fails at once with
/// `AMOE_STATUS_COMM_MISMATCH` naming the split, and the listed ranks waiting
/// for it with one naming its collective (they take part in it to fail it);
/// listed ranks that pass different lists fail at once with one naming both
/// lists.
///
/// # Safety
/// `comm` must be a live handle; `ranks` readable for `n` elements; `out` writable.
#[no_mangle]
pub unsafe extern "C" fn amoe_comm_split(
    comm: *const amoe_comm,
    ranks: *const usize,
    n: usize,
    out: *mut *mut amoe_comm,
) -> amoe_status {
    const F: &str = "amoe_comm_split";
    ffi!(F, {
        let c = try_handle(F, "comm", comm)?;
        let checked = (|| Ok((try_out!(F, out, "out"), read_sizes(F, "ranks", ranks, n)?)))();
        // A member that cannot take part leaves the split as one whose list
        // is invalid: the empty list, refused before any exchange, so the
        // members waiting for it fail at once.
        let (out, ranks) = refusing(checked, |e| c.split(&[]).err().unwrap_or(e))?;
        box_out(out, c.split(&ranks)?);
        Ok(())
    })
}

/// Reports `message`, an error this rank found in its own arguments to a
/// call over `comm` that it will therefore not make, to the peers waiting in
/// that call (for a binding that checks arguments before it calls the
/// library). On a CPU communicator it joins their collective as a refusal:
/// each peer fails at once with `AMOE_STATUS_COMM_MISMATCH`, naming this rank
/// and quoting `message`, and this call returns OK. On an HCCL communicator
/// nothing is sent (OK). The call must be one in which the peers' first
/// collective is over `comm` (a collective, an EP/SP op, a shared-expert
/// gather or reduce-scatter); otherwise this waits out the timeout.
///
/// # Safety
/// `comm` must be a live handle; `message` a NUL-terminated UTF-8 string.
#[no_mangle]
pub unsafe extern "C" fn amoe_comm_refuse(comm: *const amoe_comm, message: *const c_char) -> amoe_status {
    const F: &str = "amoe_comm_refuse";
    ffi!(F, {
        let c = try_handle(F, "comm", comm)?;
        send_refusal(F, message, refuse_on(c))
    })
}

/// This rank's number in `comm`, into `*out`.
///
/// # Safety
/// `comm` must be a live handle; `out` writable.
#[no_mangle]
pub unsafe extern "C" fn amoe_comm_rank(comm: *const amoe_comm, out: *mut usize) -> amoe_status {
    const F: &str = "amoe_comm_rank";
    ffi!(F, {
        let c = try_handle(F, "comm", comm)?;
        let out = try_out!(F, out, "out");
        write_out(out, c.rank());
        Ok(())
    })
}

/// The number of ranks in `comm`, into `*out`.
///
/// # Safety
/// `comm` must be a live handle; `out` writable.
#[no_mangle]
pub unsafe extern "C" fn amoe_comm_world_size(comm: *const amoe_comm, out: *mut usize) -> amoe_status {
    const F: &str = "amoe_comm_world_size";
    ffi!(F, {
        let c = try_handle(F, "comm", comm)?;
        let out = try_out!(F, out, "out");
        write_out(out, c.world_size());
        Ok(())
    })
}

/// Releases a handle from `amoe_comm_cpu_new`, `amoe_comm_split` or
/// `amoe_comm_from_hccl`. NULL is a no-op. Sub-groups and their parent may be
/// freed in any order. A wrapped HCCL communicator is not destroyed.
///
/// # Safety
/// `comm` must be NULL or a live handle not used afterwards.
#[no_mangle]
pub unsafe extern "C" fn amoe_comm_free(comm: *mut amoe_comm) {
    release(comm);
}

/// Wraps an engine-owned `aclrtStream` on NPU `device_ordinal` without taking
/// ownership: `amoe_stream_free` releases only the handle, never the stream,
/// and the engine must keep the stream alive until then.
///
/// Returns `AMOE_STATUS_UNAVAILABLE` (with the loader's message) when CANN
/// cannot be loaded, and `AMOE_STATUS_INVALID_ARGUMENT` when the runtime
/// says the stream belongs to another device (asked without a wait, on a
/// runtime with the graph-capture API); `*out` is then not written.
///
/// # Safety
/// `raw_acl_stream` must be a live stream of that device; `out` writable.
#[no_mangle]
pub unsafe extern "C" fn amoe_stream_wrap(
    raw_acl_stream: *mut c_void,
    device_ordinal: u32,
    out: *mut *mut amoe_stream,
) -> amoe_status {
    const F: &str = "amoe_stream_wrap";
    ffi!(F, {
        let out = try_out!(F, out, "out");
        if raw_acl_stream.is_null() {
            return Err(Failure::null(F, "raw_acl_stream"));
        }
        let _device = crate::backend::npu::runtime::ThreadDevice::kept_loading();
        // SAFETY: the caller guarantees a live stream of this device that
        // outlives the handle; a borrowed stream is never destroyed by us.
        let dev = unsafe { NpuDevice::with_borrowed_stream(device_ordinal, raw_acl_stream) }?;
        box_out(out, LiveStream::new(dev));
        Ok(())
    })
}

/// Releases a stream handle (never the engine's stream). NULL is a no-op.
/// The last handle of a stream also frees its workspace (after
/// synchronising the stream), including the blocks, status records and
/// pinned staging of work captured into graphs, which every replay uses:
/// destroy those graphs (`aclmdlRIDestroy`) first. What a captured task uses
/// must stay valid until its model is destroyed (runtime guide, single-stream
/// capture, restriction 7), and the library does not see the destruction.
///
/// # Safety
/// `stream` must be NULL or a live handle not used afterwards.
#[no_mangle]
pub unsafe extern "C" fn amoe_stream_free(stream: *mut amoe_stream) {
    // The handle's stream is borrowed, so dropping it leaves the engine's
    // stream alone; an attached live context loses this reference.
    release(stream);
}

/// Reads per-rank element counts; their sum must fit in `usize` (it sizes
/// the tensor the counts describe).
fn read_counts(func: &str, arg: &str, ptr: *const usize, n: usize) -> Result<Vec<usize>, Failure> {
    let counts = read_sizes(func, arg, ptr, n)?;
    if counts.iter().try_fold(0usize, |a, &c| a.checked_add(c)).is_none() {
        return Err(Failure::invalid(func, arg, format!("the counts {counts:?} overflow when summed")));
    }
    Ok(counts)
}

fn reduce_op(func: &str, op: u32) -> Result<ReduceOp, Failure> {
    ReduceOp::from_u32(op)
        .ok_or_else(|| Failure::invalid(func, "op", format!("unknown reduce op {op} (expected 0 sum, 1 max, 2 min)")))
}

/// The body of a collective export (cbindgen reads the signatures, so they
/// stay written out): converts `comm`, `src` and `dst` and evaluates `$args`
/// (the export's other arguments, a `Result<_, Failure>`), then runs `$run`
/// on them and writes `dst`. A bad argument is refused to the peers, which
/// are waiting in the collective ([`refusing_on`]).
macro_rules! collective {
    ($f:expr, $comm:ident, $src:ident, $dst:ident, $stream:ident, $args:expr,
     |$c:ident, $s:ident, $d:ident, $a:pat_param| $run:expr) => {
        ffi!($f, {
            let (cx, $c) = Call::on_comm($f, $stream, "comm", $comm)?;
            let cx = &cx;
            let checked = (|| {
                let s = cx.input("src", $src)?;
                let out = cx.out("dst", $dst)?;
                out.check_memory(cx, &s)?;
                let d = cx.output(&out)?;
                Ok((s, out, d, $args?))
            })();
            let ($s, out, mut $d, $a) = refusing_on($c, checked)?;
            $run?;
            cx.write(&out, $d)
        })
    };
}

/// `dst = op(src over all ranks)`. `src` and `dst` have the same dtype and
/// number of elements on every rank, and may be the same memory (in place).
/// One rank's `src` and `dst` may differ in shape (the elements are reduced
/// in order).
///
/// Shapes across ranks (this collective and those below): the ranks agree
/// on the counts (the same `numel(src)`, or the same count lists for the
/// `_v` collectives). A CPU communicator also requires the same shape
/// of `src` on every rank (of `buf` for `amoe_broadcast`; for
/// `amoe_all_gather_v` and `amoe_all_to_all_v` the same dimensions after the
/// first), and otherwise fails on every rank with
/// `AMOE_STATUS_COMM_MISMATCH` naming each rank's shape. An HCCL
/// communicator compares element counts only (HCCL sees no shapes).
///
/// How every collective runs (this one and those below):
/// - CPU communicator (host tensors): the call returns when every rank
///   called it, or fails on every rank (mismatch, timeout, dead peer); host
///   memory is read and written during the call only, nothing is retained.
///   A rank whose own arguments are bad (a NULL or malformed descriptor or
///   list, an unknown op, a `dst` of the wrong size) returns that error, and
///   its peers fail at once with `AMOE_STATUS_COMM_MISMATCH` naming the rank
///   and its error. So do the other exports that communicate (the MoE ops,
///   `amoe_comm_split`).
/// - HCCL communicator (NPU tensors): the collective is enqueued on `stream`
///   (one HCCL call, after the communicator's previous collective) and the
///   call returns. It never synchronises, never allocates device memory,
///   never copies or reads device data on the host; `dst` is written in
///   place by HCCL. Errors of the arguments (sizes, dtypes, devices) are
///   returned; what only the device learns (a size mismatch between ranks,
///   a hung or dead peer) is returned by `amoe_stream_check(stream)`, naming
///   the collective, the group and the rank.
///
/// # Safety
/// `comm` live; `src` and `dst` valid descriptors (see `amoe_tensor`).
#[no_mangle]
pub unsafe extern "C" fn amoe_all_reduce(
    comm: *const amoe_comm,
    src: *const amoe_tensor,
    dst: *const amoe_tensor,
    op: u32,
    stream: *const amoe_stream,
) -> amoe_status {
    const F: &str = "amoe_all_reduce";
    collective!(F, comm, src, dst, stream, reduce_op(F, op), |c, s, d, op| c.all_reduce(&s, &mut d, op))
}

/// `dst = block `rank` of op(src over all ranks)`: `src` holds
/// `world_size * numel(dst)` elements, split into equal blocks in rank order.
/// Ownership as `amoe_all_reduce`.
///
/// # Safety
/// `comm` live; `src` and `dst` valid descriptors.
#[no_mangle]
pub unsafe extern "C" fn amoe_reduce_scatter(
    comm: *const amoe_comm,
    src: *const amoe_tensor,
    dst: *const amoe_tensor,
    op: u32,
    stream: *const amoe_stream,
) -> amoe_status {
    const F: &str = "amoe_reduce_scatter";
    collective!(F, comm, src, dst, stream, reduce_op(F, op), |c, s, d, op| c.reduce_scatter(&s, &mut d, op))
}

/// `dst = concat(src of every rank)` in rank order: `dst` holds
/// `world_size * numel(src)` elements. Ownership as `amoe_all_reduce`.
///
/// # Safety
/// `comm` live; `src` and `dst` valid descriptors.
#[no_mangle]
pub unsafe extern "C" fn amoe_all_gather(
    comm: *const amoe_comm,
    src: *const amoe_tensor,
    dst: *const amoe_tensor,
    stream: *const amoe_stream,
) -> amoe_status {
    const F: &str = "amoe_all_gather";
    collective!(F, comm, src, dst, stream, Ok::<_, Failure>(()), |c, s, d, ()| c.all_gather(&s, &mut d))
}

/// Reduce-scatter with per-rank block sizes: `counts[0..n]` (elements, `n ==
/// world_size`) partition `src`; `dst` holds `counts[rank]` elements.
/// Ownership as `amoe_all_reduce`.
/// On a CPU communicator `dst` may overlap `src`; on an HCCL communicator
/// it may not (HCCL runs no V collective in place):
/// `AMOE_STATUS_INVALID_ARGUMENT`, naming the overlap.
///
/// # Safety
/// `comm` live; descriptors valid; `counts` readable for `n` elements.
#[no_mangle]
pub unsafe extern "C" fn amoe_reduce_scatter_v(
    comm: *const amoe_comm,
    src: *const amoe_tensor,
    dst: *const amoe_tensor,
    counts: *const usize,
    n: usize,
    op: u32,
    stream: *const amoe_stream,
) -> amoe_status {
    const F: &str = "amoe_reduce_scatter_v";
    let args = || Ok::<_, Failure>((read_counts(F, "counts", counts, n)?, reduce_op(F, op)?));
    collective!(F, comm, src, dst, stream, args(), |c, s, d, (counts, op)| c.reduce_scatter_v(&s, &mut d, &counts, op))
}

/// All-gather with per-rank block sizes `counts[0..n]` (elements, `n ==
/// world_size`): `src` holds `counts[rank]`, `dst` their sum.
/// Ownership as `amoe_all_reduce`.
/// On a CPU communicator `dst` may overlap `src`; on an HCCL communicator
/// it may not (HCCL runs no V collective in place):
/// `AMOE_STATUS_INVALID_ARGUMENT`, naming the overlap.
///
/// # Safety
/// `comm` live; descriptors valid; `counts` readable for `n` elements.
#[no_mangle]
pub unsafe extern "C" fn amoe_all_gather_v(
    comm: *const amoe_comm,
    src: *const amoe_tensor,
    dst: *const amoe_tensor,
    counts: *const usize,
    n: usize,
    stream: *const amoe_stream,
) -> amoe_status {
    const F: &str = "amoe_all_gather_v";
    let counts = || read_counts(F, "counts", counts, n);
    collective!(F, comm, src, dst, stream, counts(), |c, s, d, counts| c.all_gather_v(&s, &mut d, &counts))
}

/// Personalised exchange: block `j` of `src` (`send_counts[j]` elements) goes
/// to rank `j`; block `i` of `dst` (`recv_counts[i]`) comes from rank `i`.
/// Both count lists have `world_size` entries. Ownership as `amoe_all_reduce`.
/// On a CPU communicator `dst` may overlap `src`; on an HCCL communicator
/// it may not (HCCL runs no V collective in place):
/// `AMOE_STATUS_INVALID_ARGUMENT`, naming the overlap.
///
/// # Safety
/// `comm` live; descriptors valid; count lists readable for their lengths.
#[no_mangle]
pub unsafe extern "C" fn amoe_all_to_all_v(
    comm: *const amoe_comm,
    src: *const amoe_tensor,
    send_counts: *const usize,
    n_send: usize,
    dst: *const amoe_tensor,
    recv_counts: *const usize,
    n_recv: usize,
    stream: *const amoe_stream,
) -> amoe_status {
    const F: &str = "amoe_all_to_all_v";
    let args = || {
        let sc = read_counts(F, "send_counts", send_counts, n_send)?;
        Ok::<_, Failure>((sc, read_counts(F, "recv_counts", recv_counts, n_recv)?))
    };
    collective!(F, comm, src, dst, stream, args(), |c, s, d, (sc, rc)| c.all_to_all_v(&s, &sc, &mut d, &rc))
}

/// Copies `buf` of rank `root` into `buf` of every rank (read on `root`,
/// written on every rank). Ownership as `amoe_all_reduce`.
///
/// # Safety
/// `comm` live; `buf` a valid descriptor, readable and writable.
#[no_mangle]
pub unsafe extern "C" fn amoe_broadcast(
    comm: *const amoe_comm,
    buf: *const amoe_tensor,
    root: usize,
    stream: *const amoe_stream,
) -> amoe_status {
    const F: &str = "amoe_broadcast";
    ffi!(F, {
        let (cx, c) = Call::on_comm(F, stream, "comm", comm)?;
        let cx = &cx;
        let (mut b, out) = refusing_on(c, (|| Ok((cx.input("buf", buf)?, cx.out("buf", buf)?)))())?;
        c.broadcast(&mut b, root)?;
        cx.write(&out, b)
    })
}

/// A barrier over `comm`. CPU communicator: returns once every rank called
/// it (or the timeout passed); pass NULL for `stream` (a stream is refused,
/// `AMOE_STATUS_DEVICE`, and the peers waiting in the barrier fail at once
/// with `AMOE_STATUS_COMM_MISMATCH` quoting it). HCCL communicator: enqueues `HcclBarrier` on
/// `stream` (the communicator's device stream when NULL) and returns; work
/// queued after it on that stream runs once every rank reached it, and
/// `amoe_stream_check` reports a rank that never does.
///
/// # Safety
/// `comm` live.
#[no_mangle]
pub unsafe extern "C" fn amoe_barrier(comm: *const amoe_comm, stream: *const amoe_stream) -> amoe_status {
    const F: &str = "amoe_barrier";
    ffi!(F, {
        let (cx, c) = Call::on_comm(F, stream, "comm", comm)?;
        match cx.stream() {
            Some(s) => c.barrier_on(&Device::Npu(s.device().clone()))?,
            None => c.barrier()?,
        }
        Ok(())
    })
}

/// Reserves workspace on `stream` ahead of use: afterwards its pool holds a
/// free block of at least `bytes` device bytes and a pinned staging block of
/// at least `staging_bytes` host bytes (small host data the native kernel
/// needs: slot offsets, a tiling; a few KiB cover every call; outside capture
/// a stream also stages through an arena of its own made at its first staged
/// copy, and reuses its blocks once their copies completed), and at least
/// `staging_bytes` are left for the copies captured into graphs later (each
/// keeps its bytes, in 64-byte pieces, for the stream's life; a stream keeps
/// 256 KiB, or the most its largest run of captures took). Ops take their
/// intermediates from that pool without `aclrtMalloc`; under graph capture the
/// pool cannot grow, so reserve (or run each op once) before capturing. Size
/// `bytes` from the ops' shape functions (the largest intermediate of a call
/// is about the size of its largest tensor, times two for the padded paths).
/// Refused while the stream is captured (`AMOE_STATUS_INVALID_ARGUMENT`).
/// The memory is released when the last handle of the stream is freed,
/// after one synchronisation of the stream.
///
/// # Safety
/// `stream` must be a live handle from `amoe_stream_wrap`.
#[no_mangle]
pub unsafe extern "C" fn amoe_workspace_reserve(
    stream: *const amoe_stream,
    bytes: usize,
    staging_bytes: usize,
) -> amoe_status {
    const F: &str = "amoe_workspace_reserve";
    ffi!(F, {
        let dev = try_handle(F, "stream", stream)?.device();
        dev.stream().reserve_workspace(bytes)?;
        if staging_bytes > 0 {
            dev.stream().reserve_staging(staging_bytes)?;
        }
        Ok(())
    })
}

/// Reserves, before graph capture, the status records of `launches` native
/// kernel launches captured on `stream`: a captured launch (a native
/// finalize, unpermute, index check or guard) keeps its record for the
/// stream's life, since every replay rewrites it and every
/// `amoe_stream_check` reads it. Outside capture a stream keeps at least
/// 256 free, or as many as its largest run of captures took (the launches
/// captured between two eager launches), so a model whose graphs are each
/// captured after an eager warm-up needs no call; reserve for a first
/// capture of more launches (a layer's ops times the layers). Refused while
/// the stream is captured (`AMOE_STATUS_INVALID_ARGUMENT`). The records are
/// released when the last handle of the stream is freed.
///
/// # Safety
/// `stream` must be a live handle from `amoe_stream_wrap`.
#[no_mangle]
pub unsafe extern "C" fn amoe_capture_records_reserve(stream: *const amoe_stream, launches: usize) -> amoe_status {
    const F: &str = "amoe_capture_records_reserve";
    ffi!(F, {
        let dev = try_handle(F, "stream", stream)?.device();
        Ok(dev.stream().reserve_capture_records(launches)?)
    })
}

/// Reserves on `stream` what `warm` (a stream of the same device) reserved
/// by running ops eagerly: the records of captured launches, the pinned
/// staging and workspace up to what `warm`'s pool holds (an allocator set on
/// `warm` is not copied), so that ops first run on `stream` under graph
/// capture find them. Reservations are per
/// stream: call it before capturing on a stream other than the one the
/// warm-up ran on (such as the side stream `torch.npu.graph` captures on when
/// given no `stream=`). Refused while `stream` is captured, and for streams
/// of two devices (`AMOE_STATUS_INVALID_ARGUMENT`).
///
/// # Safety
/// `stream` and `warm` must be live handles from `amoe_stream_wrap`.
#[no_mangle]
pub unsafe extern "C" fn amoe_stream_reserve_like(stream: *const amoe_stream, warm: *const amoe_stream) -> amoe_status {
    const F: &str = "amoe_stream_reserve_like";
    ffi!(F, {
        let dev = try_handle(F, "stream", stream)?.device();
        let warm = try_handle(F, "warm", warm)?.device();
        Ok(dev.stream().reserve_like(warm.stream())?)
    })
}

/// `alloc(ctx, bytes, raw_stream)`: device memory of at least `bytes` usable by
/// work queued on `raw_stream` (an `aclrtStream`), or NULL when there is none.
pub type amoe_alloc_fn =
    Option<unsafe extern "C" fn(ctx: *mut c_void, bytes: usize, raw_stream: *mut c_void) -> *mut c_void>;
/// `free(ctx, ptr, bytes, raw_stream)`: gives back a block from `alloc`. Work
/// queued on `raw_stream` before the call may still use it, so the allocator
/// must reuse it only in stream order (as torch's caching allocator does).
pub type amoe_free_fn =
    Option<unsafe extern "C" fn(ctx: *mut c_void, ptr: *mut c_void, bytes: usize, raw_stream: *mut c_void)>;

/// The C allocator callbacks as a [`WorkspaceAllocator`].
struct CallbackAllocator {
    alloc: unsafe extern "C" fn(ctx: *mut c_void, bytes: usize, raw_stream: *mut c_void) -> *mut c_void,
    free: unsafe extern "C" fn(ctx: *mut c_void, ptr: *mut c_void, bytes: usize, raw_stream: *mut c_void),
    ctx: *mut c_void,
}

// SAFETY: `amoe_stream_set_allocator`'s contract: the callbacks may be called
// from any thread with their `ctx`, which is opaque here.
unsafe impl Send for CallbackAllocator {}
// SAFETY: as above; the value is only read and its callbacks called.
unsafe impl Sync for CallbackAllocator {}

impl WorkspaceAllocator for CallbackAllocator {
    fn alloc(&self, bytes: usize, stream: aclrtStream) -> Option<NonNull<c_void>> {
        // SAFETY: the contract of `amoe_stream_set_allocator`: callable from
        // any thread with its `ctx`, a size and the raw stream.
        NonNull::new(unsafe { (self.alloc)(self.ctx, bytes, stream) })
    }

    fn free(&self, ptr: NonNull<c_void>, bytes: usize, stream: aclrtStream) {
        // SAFETY: as `alloc`; `ptr` came from `alloc` with `bytes`, once.
        unsafe { (self.free)(self.ctx, ptr.as_ptr(), bytes, stream) }
    }
}

/// Serves every workspace block of the ops queued on `stream` from the
/// engine's allocator (e.g. torch_npu's caching allocator) instead of the
/// stream's pool: `alloc` is called inside ops, also under graph capture, and
/// `free` when the op no longer needs the block (its work may still be
/// queued). Both may be called from any thread that runs an op on `stream`,
/// and must not call back into this library. Passing NULL for both goes back
/// to the pool; passing only one is `AMOE_STATUS_NULL_ARGUMENT`. Blocks
/// already handed out return to where they came from.
///
/// # Safety
/// `stream` must be a live handle; `alloc`/`free` valid for as long as ops run
/// on `stream`, `ctx` valid for both.
#[no_mangle]
pub unsafe extern "C" fn amoe_stream_set_allocator(
    stream: *const amoe_stream,
    alloc: amoe_alloc_fn,
    free: amoe_free_fn,
    ctx: *mut c_void,
) -> amoe_status {
    const F: &str = "amoe_stream_set_allocator";
    ffi!(F, {
        let dev = try_handle(F, "stream", stream)?.device();
        let a = match (alloc, free) {
            (Some(alloc), Some(free)) => Some(Arc::new(CallbackAllocator { alloc, free, ctx }) as Allocator),
            (None, None) => None,
            (None, Some(_)) => return Err(Failure::null(F, "alloc")),
            (Some(_), None) => return Err(Failure::null(F, "free")),
        };
        dev.stream().set_allocator(a);
        Ok(())
    })
}

/// The sync point the caller owns: waits for the work queued on `stream`
/// (bounded by the timeout of the communicators whose collectives were queued
/// there since the last check, else `ASCEND_MOE_COMM_TIMEOUT` or 60 s: a hung
/// collective is `AMOE_STATUS_COMM_TIMEOUT`, never a hang), then returns the
/// first error the device recorded for that work since the last check, in
/// queue order, naming the op and the position: a kernel's bad index
/// (`AMOE_STATUS_INDEX_OUT_OF_RANGE` with the argument, position and value),
/// a collective's HCCL async error (`HcclGetCommAsyncError`: mismatch,
/// timeout, dead peer, naming the collective, the group and the rank). Each
/// error is reported once. A graph may be replayed on another stream than
/// the one it was captured on (`torch.npu.graph` replays on the current
/// stream): the check also reads what graphs captured on the device's other
/// streams recorded, so a replay's bad index is reported by the check of the
/// stream it ran on (or by whichever check reads it first; a record of a
/// replay still running elsewhere is left for a later check, as is every
/// other stream's while a stream of the device captures). With a live
/// forward context attached to `stream` (`amoe_stream_attach_live_context`),
/// its guards are read after the wait: a replay under another forward
/// context is `AMOE_STATUS_STALE_CONTEXT` naming the field and both values.
/// NULL (host-only work) returns `AMOE_STATUS_OK`.
///
/// It is the sync point of the stream-ordered functions (those whose docs
/// say they never synchronise); call it where the engine synchronises anyway
/// (e.g. once per step). While `stream`
/// is being captured into a graph it is refused
/// (`AMOE_STATUS_INVALID_ARGUMENT`) and nothing is waited for or reported:
/// check after the capture ends.
///
/// # Safety
/// `stream` must be NULL or a live handle from `amoe_stream_wrap`.
#[no_mangle]
pub unsafe extern "C" fn amoe_stream_check(stream: *const amoe_stream) -> amoe_status {
    const F: &str = "amoe_stream_check";
    ffi!(F, {
        match Call::new(F, stream)?.stream() {
            Some(s) => Ok(s.check()?),
            None => Ok(()),
        }
    })
}
