//! The finalize family on the NPU (SPEC section 1): the fused finalize
//! through the native kernel or aclnnMoeFinalizeRoutingV2, the aclnn path's
//! index check on the device, and token unpermute (the kernel's row mode, or
//! aclnnMoeTokenUnpermute). Describing an aclnn call's operands, sizing its
//! workspace and building its executor is phase one; [`super::operands`] runs
//! phase two on the device stream.

use std::ffi::c_void;

use super::aclnn::{opt, Desc};
use super::device_check::{Record, MAX_RECORD_CORES};
use super::kernel as kernels;
use super::launch::{choose_finalize, launcher, native_unavailable, native_unavailable_reason, FinalizeImpl, Launcher};
use super::memory::NpuBuffer;
use super::operands::{
    check_indices, host_copy, npu_buf, read_indices_to_host_for_validation, run_phase_two, streams_of,
};
use super::result::aclnn::{op_missing, opapi};
use super::result::{acl as rt, aclnn as nn};
use super::NpuDevice;
use crate::backend::cpu::CpuBuffer;
use crate::backend::{FinalizeArgs, FinalizeDims, OutputRows, View, ViewMut};
use crate::types::TensorMeta;
use crate::{DType, DropPadMode, Error, Result};

type In<'a> = View<'a, NpuBuffer>;
type Out<'a> = ViewMut<'a, NpuBuffer>;

/// Cores the native kernel spreads the output rows over (the vector cores of
/// a 910B are more; 8 keeps small calls cheap and still splits large ones).
const NATIVE_BLOCK_DIM: u32 = 8;
// A launch's status records fit one captured record slot.
const _: () = assert!(NATIVE_BLOCK_DIM as usize <= MAX_RECORD_CORES);

/// Fused finalize through the native kernel: tiling, launch checks, one
/// launch on the device stream, then the per-core status records.
fn finalize_native(
    device: &NpuDevice,
    args: &FinalizeArgs<In<'_>>,
    dims: &FinalizeDims,
    out: Out<'_>,
    rows: OutputRows<'_>,
) -> Result<()> {
    launch_native(device, args, dims, out, rows, 0)
}

/// [`finalize_native`] with `extra_flags` (`kernels::FLAG_*`) added to the
/// tiling's.
fn launch_native(
    device: &NpuDevice,
    args: &FinalizeArgs<In<'_>>,
    dims: &FinalizeDims,
    out: Out<'_>,
    rows: OutputRows<'_>,
    extra_flags: u32,
) -> Result<()> {
    const OP: &str = "finalize_routing";
    let launcher = launcher().ok_or_else(|| native_unavailable("native finalize"))?;
    let mut tiling = kernels::finalize_tiling(&kernels::TilingParams::from_args(
        &args.metas(),
        dims,
        rows,
        NATIVE_BLOCK_DIM,
        kernels::UB_BYTES_910B,
    ))?;
    tiling.flags |= extra_flags;
    kernels::check_launch(&args.metas(), out.meta(), rows, &tiling)?;
    let out_buf = npu_buf(device, OP, "out", out.buf())?;
    if out_buf.len_bytes() == 0 {
        // No output element (H = 0), yet the caller's indices are checked as
        // when there is data: one index-check launch, whose status the
        // stream's check reports.
        if extra_flags & kernels::FLAG_CHECK_INDICES == 0 && args.expanded_row_idx.numel() > 0 {
            checked_indices(device, args, dims)?;
        }
        return Ok(());
    }
    if dims.n == 0 {
        // No tokens: every row of the (padded) output is padding.
        return out_buf.memset_async(0, 0, out_buf.len_bytes());
    }
    let ptr = |arg: &'static str, t: Option<In<'_>>| -> Result<*mut c_void> {
        Ok(match t {
            Some(t) => npu_buf(device, OP, arg, t.buf())?.as_ptr(),
            None => std::ptr::null_mut(),
        })
    };
    let mut gm = [std::ptr::null_mut::<c_void>(); kernels::GM_COUNT];
    gm[kernels::GM_EXPANDED_X] = ptr("expanded_x", Some(args.expanded_x))?;
    gm[kernels::GM_ROW_IDX] = ptr("expanded_row_idx", Some(args.expanded_row_idx))?;
    gm[kernels::GM_X1] = ptr("x1", args.x1)?;
    gm[kernels::GM_X2] = ptr("x2", args.x2)?;
    gm[kernels::GM_BIAS] = ptr("bias", args.bias)?;
    gm[kernels::GM_SCALES] = ptr("scales", args.scales)?;
    gm[kernels::GM_EXPERT_IDX] = ptr("expert_idx", args.expert_idx)?;
    gm[kernels::GM_OUT] = out_buf.as_ptr();
    let stream = device.stream();
    let offsets = kernels::slot_offsets(rows)?;
    let offsets_buf = NpuBuffer::workspace(device, offsets.len() * 4)?;
    if !offsets.is_empty() {
        stream.stage_to_device(bytemuck::cast_slice(&offsets), offsets_buf.as_ptr(), offsets_buf.len_bytes())?;
        gm[kernels::GM_SLOT_OFFSETS] = offsets_buf.as_ptr();
    }
    // The status record: a slot of the stream's ring the check frees, or
    // under capture a zeroed slot the graph keeps (see `device_check`).
    let record = Record::begin(stream, tiling.status_words())?;
    gm[kernels::GM_STATUS] = record.ptr();

    let tiling_bytes = tiling.as_bytes();
    match launcher {
        Launcher::Sim(launch, entry) => {
            // The tiling goes to device workspace as on the NPU, and the
            // simulator reads it there when the task runs (every replay too).
            let t = NpuBuffer::workspace(device, tiling_bytes.len())?;
            stream.stage_to_device(tiling_bytes, t.as_ptr(), t.len_bytes())?;
            stream.enter()?;
            // SAFETY: every non-NULL pointer of `gm` is live device memory of
            // this stream's device, sized as check_launch verified against the
            // tiling (slot offsets and status sized by the tiling too), NULL
            // exactly where the tiling marks an input absent; the tiling is
            // `tiling_bytes.len()` bytes of device workspace (`t`); the
            // workspace blocks are reused only by work queued after this
            // launch, and the status block is held by the stream's check
            // until it was read.
            unsafe {
                rt::sim_launch_kernel_device_tiling(
                    launch,
                    stream.raw(),
                    tiling.block_dim,
                    Some(entry),
                    &gm,
                    t.as_ptr(),
                    tiling_bytes.len(),
                )
            }?;
        }
        Launcher::Npu(lib) => {
            let t = NpuBuffer::workspace(device, tiling_bytes.len())?;
            stream.stage_to_device(tiling_bytes, t.as_ptr(), t.len_bytes())?;
            stream.enter()?;
            // SAFETY: as above, with the tiling in device workspace (`t`,
            // reused only by work queued after the launch) and block_dim the tiling's.
            unsafe { lib.launch(tiling.block_dim, stream.raw(), &gm, t.as_ptr())? };
        }
    }
    record.finish(Box::new(move |words: &[u32]| kernels::check_status(words, &tiling)));
    Ok(())
}

/// Fused finalize: the native kernel or aclnnMoeFinalizeRoutingV2, as
/// [`choose_finalize`] decides; the operands' streams are then ordered after
/// it.
pub(crate) fn finalize_routing(
    device: &NpuDevice,
    args: &FinalizeArgs<In<'_>>,
    dims: &FinalizeDims,
    out: Out<'_>,
    rows: OutputRows<'_>,
) -> Result<()> {
    let inputs = args.operands().into_iter().filter_map(|(_, t)| t.map(|t| t.buf()));
    let streams = streams_of(device.stream(), inputs.chain([out.buf()]));
    finalize_routing_on(device, args, dims, out, rows)?;
    device.stream().order_operand_streams_after(&streams)
}

fn finalize_routing_on(
    device: &NpuDevice,
    args: &FinalizeArgs<In<'_>>,
    dims: &FinalizeDims,
    out: Out<'_>,
    rows: OutputRows<'_>,
) -> Result<()> {
    if args.expanded_x.dtype() != out.dtype() {
        return Err(Error::dtype("finalize_routing", "out", args.expanded_x.dtype().name(), out.dtype()));
    }
    // Without a bias the expert ids index nothing (SPEC section 1), so they
    // are not read, as on the CPU; vLLM-Ascend passes them on every call
    // (`export_for_source_row`), bias or not. The kernel's tiling, and so its
    // launch check, has them only with a bias.
    let without_ids;
    let args = if args.bias.is_none() && args.expert_idx.is_some() {
        without_ids = FinalizeArgs { expert_idx: None, ..*args };
        &without_ids
    } else {
        args
    };
    match choose_finalize(device.finalize_override())? {
        FinalizeImpl::Native => finalize_native(device, args, dims, out, rows),
        FinalizeImpl::Aclnn => match aclnn_refuses(args, dims) {
            None => finalize_aclnn(device, args, dims, out, rows),
            // A call aclnn would refuse goes to the native kernel instead.
            Some(rule) => match launcher() {
                Some(_) => finalize_native(device, args, dims, out, rows),
                None => Err(Error::Unavailable(format!(
                    "finalize_routing: aclnnMoeFinalizeRoutingV2 does not accept this call ({rule}) and the \
                     native kernel is not available ({})",
                    native_unavailable_reason()
                ))),
            },
        },
    }
}

/// Why `aclnnMoeFinalizeRoutingV2` would refuse these arguments (`None`: it
/// accepts them, possibly after the rewrites [`finalize_aclnn`] makes). From
/// ops-transformer's `moe_finalize_routing_v2` op definition and aclnn doc.
fn aclnn_refuses(args: &FinalizeArgs<In<'_>>, dims: &FinalizeDims) -> Option<&'static str> {
    let data = args.expanded_x.dtype();
    // `moe_finalize_routing_v2_def.cpp` registers (expandedX, scales) as
    // (f16, f16), (f32, f32), (bf16, bf16) and (bf16, f32) on Atlas A2/A3.
    if let Some(s) = args.scales {
        if s.dtype() != data && !(data == DType::BF16 && s.dtype() == DType::F32) {
            return Some("the only mixed precision is bf16 data with f32 scales");
        }
    }
    // aclnn doc constraint: E >= K (E: bias rows, or expandedX's first
    // dimension in the drop-pad modes). Without scales the op's K is 1.
    let k = if args.scales.is_some() { dims.k } else { 1 };
    let experts = if args.bias.is_some() {
        Some(dims.experts)
    } else if args.drop_pad_mode.is_drop_pad() {
        args.expanded_x.shape().first().copied()
    } else {
        None
    };
    if experts.is_some_and(|e| e < k) {
        return Some("the expert count E must be at least K");
    }
    None
}

/// Fused finalize through aclnnMoeFinalizeRoutingV2.
fn finalize_aclnn(
    device: &NpuDevice,
    args: &FinalizeArgs<In<'_>>,
    dims: &FinalizeDims,
    out: Out<'_>,
    rows: OutputRows<'_>,
) -> Result<()> {
    const OP: &str = "finalize_routing";
    let (n, k, h) = (dims.n, dims.k, dims.h);
    let x = args.expanded_x;
    let dt = x.dtype();
    if out.dtype() != dt {
        return Err(Error::dtype(OP, "out", dt.name(), out.dtype()));
    }
    // Index values: aclnn does not check them (a bad one reads outside
    // expandedX or bias). Where the native kernel can launch they are checked
    // on the device: one launch copies them, every bad value replaced by a
    // safe one and the first recorded for the stream check, and aclnn reads
    // the copies. Elsewhere they are read and checked on the host first.
    let mode = args.drop_pad_mode;
    let nk = args.expanded_row_idx.numel();
    let checked = match launcher() {
        Some(_) if nk > 0 => Some(checked_indices(device, args, dims)?),
        Some(_) => None,
        None => {
            let idx = read_indices_to_host_for_validation(device, OP, args.expanded_row_idx)?;
            let lo = if mode.is_drop_pad() { -1 } else { 0 };
            check_indices(OP, "expanded_row_idx", &idx, lo, dims.expanded_rows as i64)?;
            if let (Some(_), Some(e)) = (args.bias, args.expert_idx) {
                let experts = read_indices_to_host_for_validation(device, OP, e)?;
                check_indices(OP, "expert_idx", &experts, 0, dims.experts as i64)?;
            }
            None
        }
    };
    // The index buffers aclnn reads: the checked copies, or the caller's.
    let idx_buf = match &checked {
        Some(c) => npu_buf(device, OP, "expanded_row_idx", c)?,
        None => npu_buf(device, OP, "expanded_row_idx", args.expanded_row_idx.buf())?,
    };
    let expert_view = match (&checked, args.bias.and(args.expert_idx)) {
        (Some(c), Some(_)) => {
            let base = npu_buf(device, OP, "expert_idx", c)?;
            // Global memory has no alignment rule for operands (CANN TIK
            // "General Restrictions", Global Memory: no alignment
            // requirement); the copy still starts on a 512-byte boundary
            // of the workspace block, like a fresh allocation.
            let at = kernels::checked_expert_offset(nk) * 4;
            // SAFETY: the checked buffer holds checked_indices_len(nk, true)
            // int32, so [at, at + 4 * nk) is inside it; `c` outlives the view.
            Some(unsafe { NpuBuffer::borrow_raw(device, base.as_ptr().cast::<u8>().add(at).cast(), nk * 4) }?)
        }
        _ => None,
    };

    let out_buf = npu_buf(device, OP, "out", out.buf())?;
    let (target, scratch) = match rows {
        OutputRows::Dense => {
            if out.numel() != n * h {
                return Err(Error::shape(OP, "out", format!("[{n}, {h}]"), out.shape()));
            }
            (None, None)
        }
        OutputRows::Padded { local_sizes, slot_rows } => {
            let total: usize = local_sizes.iter().sum();
            if total != n || local_sizes.iter().any(|&s| s > slot_rows) {
                return Err(Error::invalid(
                    OP,
                    "local_sizes",
                    format!("{local_sizes:?} must sum to N = {n} with each at most slot_rows = {slot_rows}"),
                ));
            }
            if out.numel() != local_sizes.len() * slot_rows * h {
                return Err(Error::shape(
                    OP,
                    "out",
                    format!("[{} * {slot_rows}, {h}]", local_sizes.len()),
                    out.shape(),
                ));
            }
            (Some((local_sizes, slot_rows)), Some(NpuBuffer::workspace(device, n * h * dt.size())?))
        }
    };
    let dst: &NpuBuffer = scratch.as_ref().unwrap_or(out_buf);

    if n > 0 && h > 0 {
        let api = opapi()?;
        let fin = api.moe_finalize_routing_v2.ok_or_else(|| op_missing("aclnnMoeFinalizeRoutingV2", api))?;
        let x_shape: Vec<usize> = if mode.is_drop_pad() {
            let e = x.shape().first().copied().unwrap_or(1).max(1);
            vec![e, dims.expanded_rows / e, h]
        } else {
            vec![dims.expanded_rows, h]
        };
        let dx = Desc::new(npu_buf(device, OP, "expanded_x", x.buf())?, dt, &x_shape)?;
        let didx = Desc::new(idx_buf, DType::I32, &[nk])?;
        let nh = [n, h];
        // The op's tiling refuses x2 without x1 ("In the case of x1 parameter
        // is not input, x2 parameter can't be inputted either"); the sum is the
        // same with x2 passed as x1.
        let (x1, x2) = match (args.x1, args.x2) {
            (None, Some(only)) => (Some(only), None),
            pair => pair,
        };
        let d1 = x1.map(|t| Desc::new(npu_buf(device, OP, "x1", t.buf())?, t.dtype(), &nh)).transpose()?;
        let d2 = x2.map(|t| Desc::new(npu_buf(device, OP, "x2", t.buf())?, t.dtype(), &nh)).transpose()?;
        let dbias = args
            .bias
            .map(|t| Desc::new(npu_buf(device, OP, "bias", t.buf())?, t.dtype(), &[dims.experts, h]))
            .transpose()?;
        let dscales =
            args.scales.map(|t| Desc::new(npu_buf(device, OP, "scales", t.buf())?, t.dtype(), &[n, k])).transpose()?;
        let dexp = match (&expert_view, args.expert_idx) {
            (Some(view), _) => Some(Desc::new(view, DType::I32, &[n, k])?),
            (None, Some(t)) => Some(Desc::new(npu_buf(device, OP, "expert_idx", t.buf())?, DType::I32, &[n, k])?),
            (None, None) => None,
        };
        let dout = Desc::new(dst, dt, &nh)?;
        // SAFETY: every descriptor is live until phase two ran (optional ones NULL).
        let (ws, exec) = unsafe {
            nn::moe_finalize_routing_v2_get_workspace_size(
                &fin,
                dx.raw,
                didx.raw,
                opt(&d1),
                opt(&d2),
                opt(&dbias),
                opt(&dscales),
                opt(&dexp),
                mode as u32 as i64,
                dout.raw,
            )
        }?;
        run_phase_two(device, "aclnnMoeFinalizeRoutingV2", fin.run, ws, exec)?;
    }

    if let (Some((local_sizes, slot_rows)), Some(scratch)) = (target, scratch.as_ref()) {
        let row_bytes = h * dt.size();
        out_buf.memset_async(0, 0, out_buf.len_bytes())?;
        let mut src_row = 0;
        for (r, &rows_r) in local_sizes.iter().enumerate() {
            out_buf.copy_from_device(r * slot_rows * row_bytes, scratch, src_row * row_bytes, rows_r * row_bytes)?;
            src_row += rows_r;
        }
    }
    Ok(())
}

/// The index check of the aclnn finalize on the device: one launch of the
/// native kernel with [`kernels::FLAG_CHECK_INDICES`] into workspace, whose
/// status the stream check reports like a native finalize's. The workspace
/// is not zeroed: the launch writes both copies, and the gap between them is
/// never read.
fn checked_indices(device: &NpuDevice, args: &FinalizeArgs<In<'_>>, dims: &FinalizeDims) -> Result<NpuBuffer> {
    let len = kernels::checked_indices_len(args.expanded_row_idx.numel(), args.bias.is_some());
    let mut buf = NpuBuffer::workspace(device, len * DType::I32.size())?;
    let meta = TensorMeta { shape: &[len], dtype: DType::I32 };
    let out = ViewMut::new("finalize_routing", "expanded_row_idx", meta, &mut buf)?;
    launch_native(device, args, dims, out, OutputRows::Dense, kernels::FLAG_CHECK_INDICES)?;
    Ok(buf)
}

/// Token unpermute (SPEC section 1): `out[t] = sum_k probs[t,k] * permuted[S[t*K + k]]`,
/// an index outside `[0, rows)` contributing nothing.
///
/// With the native kernel (the default where it can launch) this is one
/// launch of the finalize kernel in row mode with `probs` as scales and
/// [`kernels::FLAG_SKIP_INVALID_ROWS`]: enqueued on the stream, no host read,
/// no synchronisation, capturable. Otherwise (`ASCEND_MOE_NPU_FINALIZE=aclnn`,
/// or no kernel can launch here) `aclnnMoeTokenUnpermute` is used when its
/// input contract holds, which only a host read of the indices can tell.
///
/// The op's documentation: `permutedTokens` has T*K rows and `sortedIndices`
/// holds no duplicates ("otherwise the result is undefined"); aclnn does not
/// check index values, and an index outside `[0, T*K)` would read outside
/// `permutedTokens`. SPEC section 1 lets an index outside `[0, rows)`
/// contribute nothing and allows repeated indices, which the op cannot
/// express: such inputs are computed by [`token_unpermute_on_host`].
/// The operands' streams are then ordered after the op.
pub(crate) fn token_unpermute(
    device: &NpuDevice,
    permuted: In<'_>,
    sorted_indices: In<'_>,
    probs: Option<In<'_>>,
    k: usize,
    out: Out<'_>,
) -> Result<()> {
    let inputs = [Some(permuted), Some(sorted_indices), probs].into_iter().flatten().map(|t| t.buf());
    let streams = streams_of(device.stream(), inputs.chain([out.buf()]));
    token_unpermute_on(device, permuted, sorted_indices, probs, k, out)?;
    device.stream().order_operand_streams_after(&streams)
}

fn token_unpermute_on(
    device: &NpuDevice,
    permuted: In<'_>,
    sorted_indices: In<'_>,
    probs: Option<In<'_>>,
    k: usize,
    out: Out<'_>,
) -> Result<()> {
    const OP: &str = "token_unpermute";
    let dt = permuted.dtype();
    let (rows, h) = (permuted.rows(), permuted.row_len());
    if sorted_indices.dtype() != DType::I32 {
        return Err(Error::dtype(OP, "sorted_indices", "i32", sorted_indices.dtype()));
    }
    let slots = sorted_indices.numel();
    if k == 0 || slots % k != 0 {
        return Err(Error::invalid(OP, "k", format!("k = {k} must divide the {slots} indices")));
    }
    let t = slots / k;
    if out.dtype() != dt {
        return Err(Error::dtype(OP, "out", dt.name(), out.dtype()));
    }
    if out.numel() != t * h {
        return Err(Error::shape(OP, "out", format!("[{t}, {h}]"), out.shape()));
    }
    if let Some(p) = probs {
        if p.numel() != t * k {
            return Err(Error::shape(OP, "probs", format!("[{t}, {k}]"), p.shape()));
        }
    }
    // Empty input: nothing to compute, and the op is never called with it.
    if t == 0 || h == 0 {
        return Ok(());
    }
    let native_takes_probs = probs.map_or(true, |p| p.dtype() == dt || p.dtype() == DType::F32);
    if dt.is_float() && native_takes_probs && choose_finalize(device.finalize_override())? == FinalizeImpl::Native {
        let args = FinalizeArgs {
            expanded_x: permuted,
            expanded_row_idx: sorted_indices,
            x1: None,
            x2: None,
            bias: None,
            scales: probs,
            expert_idx: None,
            drop_pad_mode: DropPadMode::DropLessRow,
        };
        let dims = FinalizeDims { n: t, k, h, expanded_rows: rows, experts: 0 };
        return launch_native(device, &args, &dims, out, OutputRows::Dense, kernels::FLAG_SKIP_INVALID_ROWS);
    }
    let idx = read_indices_to_host_for_validation(device, OP, sorted_indices)?;
    let mut seen = vec![false; rows];
    // Without probs the op's K is 1 (it takes K from probs' shape).
    let op_accepts = rows == t * k
        && (probs.is_some() || k == 1)
        && idx.iter().all(|&v| v >= 0 && (v as usize) < rows && !std::mem::replace(&mut seen[v as usize], true));
    if !op_accepts {
        return token_unpermute_on_host(device, permuted, sorted_indices, probs, k, out);
    }

    let api = opapi()?;
    let op = api.moe_token_unpermute.ok_or_else(|| op_missing("aclnnMoeTokenUnpermute", api))?;
    let dperm = Desc::new(npu_buf(device, OP, "permuted", permuted.buf())?, dt, &[rows, h])?;
    let didx = Desc::new(npu_buf(device, OP, "sorted_indices", sorted_indices.buf())?, DType::I32, &[idx.len()])?;
    let dprobs = probs.map(|p| Desc::new(npu_buf(device, OP, "probs", p.buf())?, p.dtype(), &[t, k])).transpose()?;
    let dout = Desc::new(npu_buf(device, OP, "out", out.buf())?, dt, &[t, h])?;
    // SAFETY: live descriptors, NULL restore shape (not padded mode); the
    // indices are distinct and inside permutedTokens' T*K rows.
    let (ws, exec) = unsafe {
        nn::moe_token_unpermute_get_workspace_size(
            &op,
            dperm.raw,
            didx.raw,
            opt(&dprobs),
            false,
            std::ptr::null(),
            dout.raw,
        )
    }?;
    run_phase_two(device, "aclnnMoeTokenUnpermute", op.run, ws, exec)
}

/// Token unpermute of inputs aclnnMoeTokenUnpermute cannot take (repeated or
/// out-of-range indices, or a permuted buffer without T*K rows): the operands
/// are copied to the host, computed by the CPU backend (SPEC section 1) and
/// the result copied back. A device-to-host round trip, used only for these
/// inputs.
fn token_unpermute_on_host(
    device: &NpuDevice,
    permuted: In<'_>,
    sorted_indices: In<'_>,
    probs: Option<In<'_>>,
    k: usize,
    out: Out<'_>,
) -> Result<()> {
    const OP: &str = "token_unpermute";
    let (p, i) = (host_copy(OP, permuted)?, host_copy(OP, sorted_indices)?);
    let w = probs.map(|p| Ok::<_, Error>((p.meta(), host_copy(OP, p)?))).transpose()?;
    let mut host_out = CpuBuffer::try_zeros(OP, out.len_bytes())?;
    let view = |arg, meta, buf| View::new(OP, arg, meta, buf);
    crate::backend::cpu::finalize::token_unpermute(
        view("permuted", permuted.meta(), &p)?,
        view("sorted_indices", sorted_indices.meta(), &i)?,
        w.as_ref().map(|(meta, b)| view("probs", *meta, b)).transpose()?,
        k,
        ViewMut::new(OP, "out", out.meta(), &mut host_out)?,
    )?;
    let dst = npu_buf(device, OP, "out", out.buf())?;
    dst.copy_from_host_at(0, host_out.as_bytes())
}
