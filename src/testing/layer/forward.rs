//! One rank's forward pass through the ops under test.

use super::case::LayerCase;
use crate::backend::FinalizeArgs;
use crate::comm::{Comm, CommType};
use crate::moe::finalize::moe_finalize_routing;
use crate::moe::finalize::moe_finalize_routing_output_shape;
use crate::moe::pad_reduce::{finalize_and_reduce, finalize_and_reduce_output_shape};
use crate::moe::prepare_finalize::{
    combine, dispatch, finalize, finalize_output_shape, prepare, prepare_output_shape, MoeContext, MoeGroups,
};
use crate::moe::reduce::{ReducePolicy, SharedMode};
use crate::moe::shared::{
    shared_gather_unpad, shared_gather_unpad_output_shape, shared_pad_reduce_scatter,
    shared_pad_reduce_scatter_output_shape, shared_pad_split, shared_pad_split_output_shape,
};
use crate::testing::model::{transform, Model, SHARED_INTER};
use crate::{with_dtype, DType, Device, DropPadMode, Element, Error, Result, Tensor};

fn tensor_of(dtype: DType, v: &[f32], shape: &[usize], device: &Device) -> Result<Tensor> {
    let t = with_dtype!(dtype, T => {
        let d: Vec<T> = v.iter().map(|x| T::from_f32(*x)).collect();
        Tensor::from_slice(&d, shape)?
    });
    t.to_device(device)
}

fn host_f32(t: &Tensor) -> Result<Vec<f32>> {
    let t = t.to_cpu()?;
    Ok(with_dtype!(t.dtype(), T => t.as_slice::<T>()?.iter().map(|v| v.to_f32()).collect()))
}

fn map_tensor(t: &Tensor, f: impl Fn(f32) -> f32) -> Result<Tensor> {
    let v: Vec<f32> = host_f32(t)?.into_iter().map(f).collect();
    tensor_of(t.dtype(), &v, t.shape(), &t.device())
}

fn shape_check(op: &'static str, got: &[usize], want: &[usize], n: &mut usize) -> Result<()> {
    *n += 1;
    if got != want {
        return Err(Error::invalid(
            op,
            "output",
            format!("real shape {got:?} differs from its shape function's {want:?}"),
        ));
    }
    Ok(())
}

/// One rank's forward pass.
pub(super) fn rank_forward(
    c: &LayerCase,
    m: &Model,
    rank: usize,
    world: Comm,
    device: &Device,
) -> Result<(Vec<f64>, usize, usize)> {
    let (h, tp) = (c.hidden, c.tp);
    let (d, t) = (rank / tp, rank % tp);
    let mut checks = 0;
    // Static, per layer: built while `policy_built_under` was live; it takes no comm type.
    let policy = ReducePolicy::new(c.shared, c.routed_transform, c.sp, tp, c.world())?;
    let live = c.comm;
    let reduce_with = c.stale_reduction_comm.unwrap_or(live);
    let ctx = MoeContext::new(&c.dp_tokens, tp, d, t, c.sp)?;
    let groups = MoeGroups::from_world(&world, tp)?;
    let td = c.dp_tokens[d];
    let local = ctx.local_tokens();
    // This rank's input rows: the SP chunk of the batch padded to a multiple of TP, or the batch.
    let batch = &m.inputs[d];
    let first = if c.sp { t * local } else { 0 };
    let mut xv = vec![0f32; local * h];
    for j in 0..local {
        if first + j < td {
            xv[j * h..(j + 1) * h].copy_from_slice(&batch[(first + j) * h..(first + j + 1) * h]);
        }
    }
    let x = tensor_of(c.dtype, &xv, &[local, h], device)?;

    // Shared expert.
    let shared = match c.shared {
        SharedMode::None => None,
        SharedMode::TensorParallel => {
            // TP-partial over this rank's slice of the intermediate size, on the
            // whole DP batch (padded to a multiple of TP under SP).
            let rows = if c.sp { local * tp } else { td };
            let (lo, hi) = (t * SHARED_INTER / tp, (t + 1) * SHARED_INTER / tp);
            let mut s = vec![0f32; rows * h];
            for j in 0..td.min(rows) {
                s[j * h..(j + 1) * h].copy_from_slice(&m.shared(&batch[j * h..(j + 1) * h], lo, hi));
            }
            Some(tensor_of(c.dtype, &s, &[rows, h], device)?)
        }
        SharedMode::SequenceParallelOnly if c.shared_tp_weights && tp > 1 => {
            // TP-sharded weights on sequence shards: gather the DP batch, run
            // this rank's weight shard on it (TP-partial), pad, reduce-scatter.
            let full = shared_gather_unpad(&x, td, &groups.tp)?;
            shape_check(
                "shared_gather_unpad",
                full.shape(),
                &shared_gather_unpad_output_shape(x.shape(), td, tp)?,
                &mut checks,
            )?;
            let rows = host_f32(&full)?;
            let (lo, hi) = (t * SHARED_INTER / tp, (t + 1) * SHARED_INTER / tp);
            let part: Vec<f32> = rows.chunks(h).flat_map(|r| m.shared(r, lo, hi)).collect();
            let part = tensor_of(c.dtype, &part, full.shape(), device)?;
            let s = shared_pad_reduce_scatter(&part, &groups.tp)?;
            shape_check(
                "shared_pad_reduce_scatter",
                s.shape(),
                &shared_pad_reduce_scatter_output_shape(part.shape(), tp)?,
                &mut checks,
            )?;
            Some(s)
        }
        SharedMode::DataParallelOnly if !c.sp && tp > 1 => {
            // Replicated weights on the full batch: each TP rank runs its
            // equal part of the padded batch, the parts are gathered.
            let mine = shared_pad_split(&x, &groups.tp)?;
            shape_check(
                "shared_pad_split",
                mine.shape(),
                &shared_pad_split_output_shape(x.shape(), t, tp)?,
                &mut checks,
            )?;
            let rows = host_f32(&mine)?;
            let y: Vec<f32> = rows.chunks(h).flat_map(|r| m.shared(r, 0, SHARED_INTER)).collect();
            let y = tensor_of(c.dtype, &y, mine.shape(), device)?;
            let s = shared_gather_unpad(&y, td, &groups.tp)?;
            shape_check(
                "shared_gather_unpad",
                s.shape(),
                &shared_gather_unpad_output_shape(y.shape(), td, tp)?,
                &mut checks,
            )?;
            Some(s)
        }
        _ => {
            let mut s = vec![0f32; local * h];
            for j in 0..local {
                s[j * h..(j + 1) * h].copy_from_slice(&m.shared(&xv[j * h..(j + 1) * h], 0, SHARED_INTER));
            }
            Some(tensor_of(c.dtype, &s, &[local, h], device)?)
        }
    };
    let shared = match shared {
        Some(s) => {
            let before = s.shape().to_vec();
            let s = policy.reduce_shared(s, reduce_with, &groups.tp)?;
            shape_check("reduce_shared", s.shape(), &before, &mut checks)?;
            Some(s)
        }
        None => None,
    };

    // Routed experts.
    let prep = prepare(&x, live, &ctx, &groups)?;
    shape_check("prepare", prep.hidden.shape(), &prepare_output_shape(x.shape(), live, &ctx)?, &mut checks)?;
    let tokens = host_f32(&prep.hidden)?;
    let n = prep.hidden.rows();
    let (mut ids, mut weights) = (Vec::with_capacity(n * m.k), Vec::with_capacity(n * m.k));
    for i in 0..n {
        let (e, w) = m.route(&tokens[i * h..(i + 1) * h]);
        ids.extend(e);
        weights.extend(w);
    }
    let wt = Tensor::from_slice(&weights, &[n, m.k])?.to_device(device)?;
    let routed = match live {
        CommType::AllGather => {
            // This EP rank's experts for every gathered token; other slots are dropped (-1).
            let per = c.experts / c.world();
            let mine = rank * per..(rank + 1) * per;
            let mut rows = Vec::new();
            let mut idx = vec![-1i32; n * m.k];
            for (slot, &e) in ids.iter().enumerate() {
                if mine.contains(&(e as usize)) {
                    idx[slot] = (rows.len() / h) as i32;
                    rows.extend(m.expert(e as usize, &tokens[(slot / m.k) * h..(slot / m.k + 1) * h]));
                }
            }
            let p = rows.len() / h;
            let expanded = tensor_of(c.dtype, &rows, &[1, p, h], device)?;
            let it = Tensor::from_slice(&idx, &[n * m.k])?.to_device(device)?;
            let args = FinalizeArgs {
                expanded_x: &expanded,
                expanded_row_idx: &it,
                x1: None,
                x2: None,
                bias: None,
                scales: Some(&wt),
                expert_idx: None,
                drop_pad_mode: DropPadMode::DropPadRow,
            };
            match ctx.sp_layout() {
                Some(l) => {
                    let out = finalize_and_reduce(&args, Some(&l), &groups.ep)?;
                    let want = finalize_and_reduce_output_shape(&args, Some(&l), rank, c.world())?;
                    shape_check("finalize_and_reduce", out.shape(), &want, &mut checks)?;
                    out
                }
                None => {
                    let part = moe_finalize_routing(&args)?;
                    shape_check(
                        "moe_finalize_routing",
                        part.shape(),
                        &moe_finalize_routing_output_shape(&args)?.0,
                        &mut checks,
                    )?;
                    let want = finalize_output_shape(part.shape(), live, &ctx)?;
                    let out = finalize(part, live, &ctx, &groups)?;
                    shape_check("finalize", out.shape(), &want, &mut checks)?;
                    out
                }
            }
        }
        CommType::Mc2 | CommType::FusedMc2 | CommType::AllToAll => {
            let disp = dispatch(&prep.hidden, &ids, m.k, prep.mc2_mask.as_deref(), c.experts, &groups.ep)?;
            let recv = host_f32(&disp.rows)?;
            let mut y = Vec::with_capacity(recv.len());
            for (j, &e) in disp.experts.iter().enumerate() {
                y.extend(m.expert(e as usize, &recv[j * h..(j + 1) * h]));
            }
            let yt = tensor_of(c.dtype, &y, disp.rows.shape(), device)?;
            let combined = combine(&yt, &disp, &wt, &groups.ep)?;
            shape_check("combine", combined.shape(), &[n, h], &mut checks)?;
            let want = finalize_output_shape(combined.shape(), live, &ctx)?;
            let out = finalize(combined, live, &ctx, &groups)?;
            shape_check("finalize", out.shape(), &want, &mut checks)?;
            out
        }
    };
    let before = routed.shape().to_vec();
    let mut routed = policy.reduce_routed_early(routed, reduce_with, &groups.tp)?;
    shape_check("reduce_routed_early", routed.shape(), &before, &mut checks)?;
    if c.routed_transform {
        routed = map_tensor(&routed, transform)?;
    }
    let out = match shared {
        Some(s) => {
            let mut o = Tensor::zeros(routed.shape(), c.dtype, device)?;
            device.backend().add(&s, &routed, &mut o)?;
            o
        }
        None => routed,
    };
    let before = out.shape().to_vec();
    let out = policy.reduce_final(out, reduce_with, &groups.tp)?;
    shape_check("reduce_final", out.shape(), &before, &mut checks)?;
    let rows = out.rows();
    Ok((host_f32(&out)?.into_iter().map(f64::from).collect(), rows, checks))
}
