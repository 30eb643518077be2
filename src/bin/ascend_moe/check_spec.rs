//! `check` section `spec`: one row per SPEC op and per regression the crate
//! guards against, each against a reference written here from SPEC.md (naive
//! f64 loops, exact small-integer data, the section 5 numeric oracle):
//!
//! * section 1: finalize routing in every drop-pad mode and the token
//!   unpermute, per dtype (the finalize goldens);
//! * section 2: the SP layout (with and without PCP);
//! * sections 3 / 4: pad-and-reduce, gather-and-unpad, their inverse property
//!   and the fused finalize-and-reduce, on uneven layouts with empty ranks;
//! * section 5: every reduction point for every policy and live comm type, the
//!   shared-expert DP-only / SP-only helpers;
//! * section 6: prepare / finalize per comm type, the actual-token MC2 mask;
//! * regressions: a policy built while comm type A was live run under B (its
//!   constructor takes no comm type; no graph is replayed), the negative
//!   control that decisions made with a stale comm type are caught, the
//!   draft-model finalize (local shard rows, never the global token count).
//!
//! Every rank runs every case, so all ranks report the same rows.

use ascend_moe::backend::FinalizeArgs;
use ascend_moe::moe::prepare_finalize::{finalize, mc2_mask, prepare, MoeContext, MoeGroups};
use ascend_moe::moe::shared::{shared_gather_unpad, shared_pad_reduce_scatter, shared_pad_split};
use ascend_moe::moe::{self, routed_is_reduced, ReducePolicy, SharedMode, SpLayout};
use ascend_moe::{with_dtype, Collectives, Comm, CommType, DType, DropPadMode, Element, Tensor};

use crate::check::Row;

type Check = Result<(), String>;

fn row(case: String, dtype: DType, count: usize, r: Check) -> Row {
    let (ok, detail) = match r {
        Ok(()) => (true, String::new()),
        Err(e) => (false, e),
    };
    Row { section: "spec", case, dtype: dtype.name().into(), count, ok, detail }
}

fn err<E: std::fmt::Display>(e: E) -> String {
    e.to_string()
}

/// Small integers and halves: exact in every data dtype, so sums compare exactly.
fn val(seed: usize, i: usize) -> f32 {
    (((seed * 31 + i * 7) % 9) as f32 - 4.0) * 0.5
}

fn tensor(dtype: DType, v: &[f32], shape: &[usize]) -> ascend_moe::Result<Tensor> {
    with_dtype!(dtype, T => {
        let d: Vec<T> = v.iter().map(|x| T::from_f32(*x)).collect();
        Tensor::from_slice(&d, shape)
    })
}

fn host(t: &Tensor) -> ascend_moe::Result<Vec<f64>> {
    Ok(with_dtype!(t.dtype(), T => t.as_slice::<T>()?.iter().map(|v| v.to_f64()).collect()))
}

/// `|got - want| <= tol * max(1, |want|)` elementwise, and equal lengths; a
/// NaN on either side is outside.
fn close(what: &str, got: &[f64], want: &[f64], tol: f64) -> Check {
    if got.len() != want.len() {
        return Err(format!("{what}: {} values, want {}", got.len(), want.len()));
    }
    let inside = |g: f64, w: f64| (g - w).abs() <= tol * w.abs().max(1.0);
    // A NaN fails the comparison `inside` makes, and so counts as outside.
    match got.iter().zip(want).position(|(g, w)| !inside(*g, *w)) {
        None => Ok(()),
        Some(i) => Err(format!("{what}: value {i} is {}, want {}", got[i], want[i])),
    }
}

fn tol(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => 1e-5,
        DType::F16 => 2e-3,
        _ => 1e-2,
    }
}

/// Section 1: `out[i] = x1 + x2 + sum_k s(i,k) * (row(R(i,k)) + bias[e(i,k)])`.
fn finalize_golden(mode: u32, dtype: DType) -> Check {
    let (n, k, h, e, c) = (5usize, 2usize, 3usize, 4usize, 3usize);
    let drop_pad = mode % 2 == 1;
    let rows = if drop_pad { e * c } else { n * k };
    let round = |v: f32| with_dtype!(dtype, T => T::from_f32(v).to_f32());
    let xs: Vec<f32> = (0..rows * h).map(|i| round(val(1, i))).collect();
    let x1: Vec<f32> = (0..n * h).map(|i| round(val(2, i))).collect();
    let x2: Vec<f32> = (0..n * h).map(|i| round(val(3, i))).collect();
    let bias: Vec<f32> = (0..e * h).map(|i| round(val(4, i))).collect();
    let scales: Vec<f32> = (0..n * k).map(|i| round(0.25 + val(5, i).abs() * 0.5)).collect();
    let experts: Vec<i32> = (0..n * k).map(|i| (i * 3 % e) as i32).collect();
    // A permutation of the rows (drop-less) or slots with some dropped (-1).
    let idx: Vec<i32> =
        (0..n * k).map(|i| if drop_pad && i % 4 == 3 { -1 } else { ((i * 7 + 1) % rows) as i32 }).collect();
    let r_of = |i: usize, j: usize| if mode < 2 { idx[j * n + i] } else { idx[i * k + j] };
    let mut want = vec![0f64; n * h];
    for i in 0..n {
        for col in 0..h {
            let mut acc = x1[i * h + col] as f64 + x2[i * h + col] as f64;
            for j in 0..k {
                let r = r_of(i, j);
                let rowv = if r < 0 { 0.0 } else { xs[r as usize * h + col] as f64 };
                let b = bias[experts[i * k + j] as usize * h + col] as f64;
                acc += scales[i * k + j] as f64 * (rowv + b);
            }
            want[i * h + col] = acc;
        }
    }
    let shape: Vec<usize> = if drop_pad { vec![e, c, h] } else { vec![n * k, h] };
    let x = tensor(dtype, &xs, &shape).map_err(err)?;
    let it = Tensor::from_slice(&idx, &[n * k]).map_err(err)?;
    let (t1, t2) = (tensor(dtype, &x1, &[n, h]).map_err(err)?, tensor(dtype, &x2, &[n, h]).map_err(err)?);
    let tb = tensor(dtype, &bias, &[e, h]).map_err(err)?;
    let ts = tensor(dtype, &scales, &[n, k]).map_err(err)?;
    let te = Tensor::from_slice(&experts, &[n, k]).map_err(err)?;
    let mode = DropPadMode::from_u32(mode).ok_or("bad mode")?;
    let args = FinalizeArgs {
        expanded_x: &x,
        expanded_row_idx: &it,
        x1: Some(&t1),
        x2: Some(&t2),
        bias: Some(&tb),
        scales: Some(&ts),
        expert_idx: Some(&te),
        drop_pad_mode: mode,
    };
    let out = moe::moe_finalize_routing(&args).map_err(err)?;
    close("finalize", &host(&out).map_err(err)?, &want, tol(dtype))
}

/// Section 1: `out[t] = sum_k probs[t,k] * permuted[S[t*K + k]]`, out of range contributes nothing.
fn unpermute_golden(dtype: DType) -> Check {
    let (t, k, h, rows) = (4usize, 2usize, 3usize, 6usize);
    let round = |v: f32| with_dtype!(dtype, T => T::from_f32(v).to_f32());
    let p: Vec<f32> = (0..rows * h).map(|i| round(val(6, i))).collect();
    let probs: Vec<f32> = (0..t * k).map(|i| round(0.5 + val(7, i).abs() * 0.25)).collect();
    let s: Vec<i32> = (0..t * k).map(|i| if i == 5 { rows as i32 } else { ((i * 5) % rows) as i32 }).collect();
    let mut want = vec![0f64; t * h];
    for i in 0..t {
        for j in 0..k {
            let r = s[i * k + j];
            if (0..rows as i32).contains(&r) {
                for col in 0..h {
                    want[i * h + col] += probs[i * k + j] as f64 * p[r as usize * h + col] as f64;
                }
            }
        }
    }
    let pt = tensor(dtype, &p, &[rows, h]).map_err(err)?;
    let st = Tensor::from_slice(&s, &[t * k]).map_err(err)?;
    let prt = tensor(dtype, &probs, &[t, k]).map_err(err)?;
    let out = moe::moe_token_unpermute(&pt, &st, Some(&prt)).map_err(err)?;
    close("unpermute", &host(&out).map_err(err)?, &want, tol(dtype))
}

fn layouts(w: usize) -> Vec<(&'static str, SpLayout)> {
    let uneven: Vec<usize> = (0..w).map(|r| if r % 3 == 1 { 0 } else { r % 4 + 1 }).collect();
    [("uniform", vec![3; w]), ("uneven", uneven), ("empty", vec![0; w])]
        .into_iter()
        .filter_map(|(n, s)| SpLayout::new(&s).ok().map(|l| (n, l)))
        .collect()
}

/// Sections 3 and 4 and their inverse property, on one layout.
fn pad_reduce(comm: &Comm, l: &SpLayout, dtype: DType) -> Check {
    let (r, w, h) = (comm.rank(), comm.world_size(), 2usize);
    let total = l.total_rows();
    let x = tensor(dtype, &(0..total * h).map(|i| val(r, i)).collect::<Vec<_>>(), &[total, h]).map_err(err)?;
    let out = moe::maybe_pad_and_reduce(&x, Some(l), comm).map_err(err)?;
    let want_shape = moe::maybe_pad_and_reduce_output_shape(x.shape(), Some(l), r, w).map_err(err)?;
    if out.shape() != want_shape.as_slice() {
        return Err(format!("rows {:?}, shape function {want_shape:?}", out.shape()));
    }
    let off = l.offset(r) * h;
    let want: Vec<f64> = (off..off + l.local_size(r) * h).map(|i| (0..w).map(|q| val(q, i) as f64).sum()).collect();
    close("pad_and_reduce", &host(&out).map_err(err)?, &want, tol(dtype))
}

fn gather_unpad(comm: &Comm, l: &SpLayout, dtype: DType) -> Check {
    let (r, w, h) = (comm.rank(), comm.world_size(), 2usize);
    let mine = l.local_size(r);
    let x = tensor(dtype, &(0..mine * h).map(|i| val(r + 50, i)).collect::<Vec<_>>(), &[mine, h]).map_err(err)?;
    let out = moe::maybe_all_gather_and_maybe_unpad(&x, Some(l), comm).map_err(err)?;
    let want: Vec<f64> = (0..w).flat_map(|q| (0..l.local_size(q) * h).map(move |i| val(q + 50, i) as f64)).collect();
    close("gather_unpad", &host(&out).map_err(err)?, &want, 0.0)?;
    // Inverse (section 4): reduce of the gathered rows of every rank = world x the local shard.
    let back = moe::maybe_pad_and_reduce(&out, Some(l), comm).map_err(err)?;
    let want: Vec<f64> = (0..mine * h).map(|i| w as f64 * val(r + 50, i) as f64).collect();
    close("gather then reduce", &host(&back).map_err(err)?, &want, tol(dtype))
}

/// The fused op equals finalize followed by pad-and-reduce (one row of the layout per token).
fn finalize_and_reduce(comm: &Comm, l: &SpLayout) -> Check {
    let (r, h) = (comm.rank(), 2usize);
    let n = l.total_rows();
    let xs: Vec<f32> = (0..n * h).map(|i| val(r + 9, i)).collect();
    let x = tensor(DType::F32, &xs, &[n, h]).map_err(err)?;
    let idx = Tensor::from_slice(&(0..n as i32).collect::<Vec<_>>(), &[n]).map_err(err)?;
    let args = FinalizeArgs::new(&x, &idx, DropPadMode::DropLessRow);
    let fused = moe::finalize_and_reduce(&args, Some(l), comm).map_err(err)?;
    let two = moe::maybe_pad_and_reduce(&moe::moe_finalize_routing(&args).map_err(err)?, Some(l), comm).map_err(err)?;
    close("finalize_and_reduce", &host(&fused).map_err(err)?, &host(&two).map_err(err)?, 0.0)
}

/// Section 5 oracle on the TP group `tp`: returns `Err` when the layer output
/// is not `sum_i S_i + f(R)`. `decide` is the comm type handed to the
/// reduction points (`live` for a correct layer).
fn reduction_points(tp: &Comm, p: &ReducePolicy, live: CommType, decide: CommType) -> Check {
    let (t, n) = (tp.rank(), tp.world_size());
    let f = |v: f32| if p.has_routed_transform() { 0.5 * v + v.tanh() } else { v };
    let s_part = |q: usize| 0.25 + q as f32;
    let r_part = |q: usize| 1.5 + 2.0 * q as f32;
    let (s_total, r_total): (f32, f32) = ((0..n).map(s_part).sum(), (0..n).map(r_part).sum());
    let routed = if routed_is_reduced(live, p.sp()) { r_total } else { r_part(t) };
    let shared = match p.shared_mode() {
        SharedMode::None => 0.0,
        SharedMode::TensorParallel => s_part(t),
        _ => s_total,
    };
    let one = |v: f32| Tensor::from_slice(&[v], &[1]).map_err(err);
    let routed = p.reduce_routed_early(one(routed)?, decide, tp).map_err(err)?.to_vec::<f32>().map_err(err)?[0];
    let shared = p.reduce_shared(one(shared)?, decide, tp).map_err(err)?.to_vec::<f32>().map_err(err)?[0];
    let out = p.reduce_final(one(shared + f(routed))?, decide, tp).map_err(err)?.to_vec::<f32>().map_err(err)?[0];
    let want = if p.shared_mode() == SharedMode::None { 0.0 } else { s_total } + f(r_total);
    close("layer output", &[out as f64], &[want as f64], 1e-5)
}

/// A transform needs the full routed sum: `early`, a reduced comm type, or TP 1.
fn transform_sees_full_sum(p: &ReducePolicy, live: CommType) -> bool {
    !p.has_routed_transform() || p.early() || routed_is_reduced(live, p.sp()) || p.tp_size() == 1
}

/// Section 6: finalize(prepare(x)) = x times the ranks that contributed it.
fn prepare_finalize(comm: &Comm, g: &MoeGroups, tp: usize, comm_type: CommType, sp: bool) -> Check {
    let (w, h) = (comm.world_size(), 2usize);
    let (d, t) = (comm.rank() / tp, comm.rank() % tp);
    let dp_tokens: Vec<usize> = (0..w / tp).map(|q| [5, 2, 0, 7][q % 4]).collect();
    let ctx = MoeContext::new(&dp_tokens, tp, d, t, sp).map_err(err)?;
    let local = ctx.local_tokens();
    let first = if sp { t * local } else { 0 };
    let x: Vec<f32> =
        (0..local * h).map(|i| if first + i / h < dp_tokens[d] { val(d, first * h + i) } else { 0.0 }).collect();
    let xt = tensor(DType::F32, &x, &[local, h]).map_err(err)?;
    let p = prepare(&xt, comm_type, &ctx, g).map_err(err)?;
    let out = finalize(p.hidden, comm_type, &ctx, g).map_err(err)?;
    let factor = match (comm_type, sp) {
        (CommType::AllGather, true) => w as f64,
        (CommType::AllGather, false) => (w / tp) as f64,
        _ => 1.0,
    };
    let want: Vec<f64> = x.iter().map(|v| *v as f64 * factor).collect();
    close("round trip", &host(&out).map_err(err)?, &want, 0.0)
}

/// Section 5 shared-expert helpers on the TP group = `comm` (T = 5 tokens).
fn shared_helpers(comm: &Comm) -> [Check; 3] {
    let (r, n, t, h) = (comm.rank(), comm.world_size(), 5usize, 2usize);
    let part = t.div_ceil(n);
    let batch: Vec<f32> = (0..t * h).map(|i| val(3, i)).collect();
    let padded = |i: usize| if i < t * h { batch[i] as f64 } else { 0.0 };
    let split = || -> Check {
        let x = tensor(DType::F32, &batch, &[t, h]).map_err(err)?;
        let got = host(&shared_pad_split(&x, comm).map_err(err)?).map_err(err)?;
        close("pad_split", &got, &(r * part * h..(r + 1) * part * h).map(padded).collect::<Vec<_>>(), 0.0)
    };
    let gather = || -> Check {
        let mine: Vec<f32> = (r * part * h..(r + 1) * part * h).map(|i| padded(i) as f32).collect();
        let x = tensor(DType::F32, &mine, &[part, h]).map_err(err)?;
        let got = host(&shared_gather_unpad(&x, t, comm).map_err(err)?).map_err(err)?;
        close("gather_unpad", &got, &batch.iter().map(|v| *v as f64).collect::<Vec<_>>(), 0.0)
    };
    let scatter = || -> Check {
        let x = tensor(DType::F32, &(0..t * h).map(|i| val(r + 4, i)).collect::<Vec<_>>(), &[t, h]).map_err(err)?;
        let got = host(&shared_pad_reduce_scatter(&x, comm).map_err(err)?).map_err(err)?;
        let sum = |i: usize| if i < t * h { (0..n).map(|q| val(q + 4, i) as f64).sum() } else { 0.0 };
        close("pad_reduce_scatter", &got, &(r * part * h..(r + 1) * part * h).map(sum).collect::<Vec<_>>(), 0.0)
    };
    [split(), gather(), scatter()]
}

pub fn run(comm: &Comm) -> ascend_moe::Result<Vec<Row>> {
    let (w, me) = (comm.world_size(), comm.rank());
    let mut rows = Vec::new();

    // Section 1 (local on every rank): the finalize goldens.
    for dtype in DType::FLOATS {
        for mode in 0..4u32 {
            rows.push(row(format!("1 finalize_routing mode {mode}"), dtype, 10, finalize_golden(mode, dtype)));
        }
        rows.push(row("1 token_unpermute".into(), dtype, 8, unpermute_golden(dtype)));
    }

    // Section 2: layouts.
    let check = |got: ascend_moe::Result<SpLayout>, want: &[usize]| -> Check {
        let got = got.map_err(err)?;
        if got.local_sizes() != want {
            return Err(format!("{:?}, want {want:?}", got.local_sizes()));
        }
        Ok(())
    };
    let l = SpLayout::from_dp_tokens(&[1000, 7], 2);
    rows.push(row("2 sp_layout dp[1000,7] tp2".into(), DType::I64, 4, check(l, &[500, 500, 4, 4])));
    let l = SpLayout::from_dp_tokens_pcp(&[1, 9], 2, 2);
    rows.push(row("2 sp_layout pcp dp[1,9] pcp2 tp2".into(), DType::I64, 8, check(l, &[1, 1, 1, 1, 5, 5, 5, 5])));
    let named = match SpLayout::new(&[1; 6]).and_then(|l| l.check_dp_pcp_tp("check", 2, 2, 2)) {
        Ok(()) => Err("a 6-entry layout was accepted for DP 2 x PCP 2 x TP 2".to_string()),
        Err(e) if e.to_string().contains("PCP 2") => Ok(()),
        Err(e) => Err(format!("the error does not name the sizes: {e}")),
    };
    rows.push(row("2 layout not DPxPCPxTP is named".into(), DType::I64, 6, named));

    // Sections 3 and 4 on the world as the EP group.
    for (name, l) in layouts(w) {
        for dtype in DType::FLOATS {
            let n = l.total_rows();
            rows.push(row(format!("3 pad_and_reduce {name}"), dtype, n, pad_reduce(comm, &l, dtype)));
            rows.push(row(format!("4 gather_unpad {name}"), dtype, n, gather_unpad(comm, &l, dtype)));
        }
        rows.push(row(
            format!("1+3 finalize_and_reduce {name}"),
            DType::F32,
            l.total_rows(),
            finalize_and_reduce(comm, &l),
        ));
    }

    // Regression (bug class 1): a draft / MTP model's finalize returns the
    // local shard (4096 tokens over TP 4: 1024 rows), never the global layout.
    // Its input holds the batch padded to a multiple of TP (section 3:
    // `sum(local_sizes)` rows, 4098 over TP 3).
    for dtype in DType::FLOATS {
        let r = (|| -> Check {
            let l = SpLayout::from_dp_tokens(&[4096], w).map_err(err)?;
            let x = Tensor::zeros_cpu(&[l.total_rows(), 2], dtype);
            let out = moe::maybe_pad_and_reduce(&x, Some(&l), comm).map_err(err)?;
            let meta = moe::maybe_pad_and_reduce_output_shape(x.shape(), Some(&l), me, w).map_err(err)?;
            if out.rows() != 4096_usize.div_ceil(w) || out.shape() != meta.as_slice() {
                return Err(format!("{} rows, meta {:?}, want {}", out.rows(), meta, 4096_usize.div_ceil(w)));
            }
            Ok(())
        })();
        rows.push(row("regression draft-model finalize rows = meta".into(), dtype, 4096, r));
    }

    // Section 5 on the world as the TP group (EP = TP).
    let mut policies = Vec::new();
    for shared in SharedMode::ALL {
        for transform in [false, true] {
            for sp in [false, true] {
                if let Ok(p) = ReducePolicy::new(shared, transform, sp, w, w) {
                    policies.push(p);
                }
            }
        }
    }
    for p in &policies {
        for live in CommType::ALL {
            if !transform_sees_full_sum(p, live) {
                continue;
            }
            let case = format!(
                "5 reduce {} sp={} tr={} {}",
                p.shared_mode().name(),
                u8::from(p.sp()),
                u8::from(p.has_routed_transform()),
                live.name()
            );
            rows.push(row(case, DType::F32, w, reduction_points(comm, p, live, live)));
        }
    }
    let tp_with_sp = match ReducePolicy::new(SharedMode::TensorParallel, false, true, 2, 2) {
        Ok(_) => Err("TensorParallel with SP on and TP 2 was accepted".to_string()),
        Err(e) if e.to_string().contains("SequenceParallelOnly") => Ok(()),
        Err(e) => Err(format!("the error does not say SequenceParallelOnly: {e}")),
    };
    rows.push(row("5 policy tp+sp refused as sp-only".into(), DType::F32, 1, tp_with_sp));
    for (name, r) in ["5 shared pad_split", "5 shared gather_unpad", "5 shared pad_reduce_scatter"]
        .into_iter()
        .zip(shared_helpers(comm))
    {
        rows.push(row(name.into(), DType::F32, 5, r));
    }

    // Regression (bug class 3): a policy built while comm type A was live,
    // run under B, reduces exactly once; deciding with A is caught.
    let built = ReducePolicy::new(SharedMode::TensorParallel, false, false, w, w)?;
    let mut stale_caught = 0;
    for built_under in CommType::ALL {
        for live in CommType::ALL {
            let case = format!("regression policy built under {} run under {}", built_under.name(), live.name());
            rows.push(row(case, DType::F32, w, reduction_points(comm, &built, live, live)));
            if routed_is_reduced(built_under, false) != routed_is_reduced(live, false) {
                stale_caught += usize::from(reduction_points(comm, &built, live, built_under).is_err());
            }
        }
    }
    // With one rank nothing reduces, so a stale decision cannot show.
    let caught = if w == 1 || stale_caught == 6 {
        Ok(())
    } else {
        Err(format!("{stale_caught} of 6 decisions with a stale comm type caught"))
    };
    rows.push(row("regression stale comm type reduction caught".into(), DType::F32, 6, caught));

    // Section 6 on DP x TP = the world (TP 2 when the world is even).
    let tp = if w % 2 == 0 { 2 } else { 1 };
    let groups = MoeGroups::from_world(comm, tp)?;
    for sp in [false, true] {
        for ct in CommType::ALL {
            let case = format!("6 prepare/finalize {} sp={}", ct.name(), u8::from(sp));
            rows.push(row(case, DType::F32, w, prepare_finalize(comm, &groups, tp, ct, sp)));
        }
    }
    let mask = (|| -> Check {
        // DP tokens [6], TP 2, 4 actual: rank 0 [t, t, t], rank 1 [t, f, f].
        let ctx = MoeContext::new(&[6], 2, 0, me % 2, false).and_then(|c| c.with_num_actual_tokens(4)).map_err(err)?;
        let got = mc2_mask(CommType::Mc2, &ctx).ok_or("no mask")?;
        let want = if me % 2 == 0 { vec![true; 3] } else { vec![true, false, false] };
        if got != want {
            return Err(format!("{got:?}, want {want:?}"));
        }
        Ok(())
    })();
    rows.push(row("6 mc2_mask num_actual_tokens".into(), DType::Bool, 3, mask));
    // Section 5: all EP ranks of a forward agree on the comm type; when they
    // do not (DP 0 ALLGATHER, DP 1 MC2), every rank fails naming the choices.
    let disagree = (|| -> Check {
        let (d, t) = (me / tp, me % tp);
        let dp_tokens = vec![2; w / tp];
        let ctx = MoeContext::new(&dp_tokens, tp, d, t, false).map_err(err)?;
        let x = Tensor::zeros_cpu(&[2, 2], DType::F32);
        let ct = if d == 0 { CommType::AllGather } else { CommType::Mc2 };
        match prepare(&x, ct, &ctx, &groups) {
            Err(e) if w / tp == 1 => Err(format!("one DP rank cannot disagree, yet: {e}")),
            Ok(_) if w / tp == 1 => Ok(()),
            Ok(_) => Err("prepare succeeded although the DP ranks chose different comm types".into()),
            Err(e) if e.to_string().contains("chose ALLGATHER") && e.to_string().contains("chose MC2") => Ok(()),
            Err(e) => Err(format!("the error does not name the choices: {e}")),
        }
    })();
    rows.push(row("5 comm type disagreement fails on every rank".into(), DType::I32, w, disagree));
    comm.barrier()?;
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::close;

    #[test]
    fn a_nan_on_either_side_is_outside_the_tolerance() {
        assert!(close("x", &[1.0, 2.0], &[1.0, 2.0 + 1e-7], 1e-5).is_ok());
        let e = close("x", &[1.0, f64::NAN], &[1.0, 2.0], 1e-5).unwrap_err();
        assert!(e.contains("x: value 1 is NaN"), "{e}");
        assert!(close("x", &[1.0], &[f64::NAN], 1e-5).is_err());
        assert!(close("x", &[1.1], &[1.0], 1e-5).is_err());
        assert!(close("x", &[1.0], &[1.0, 2.0], 1e-5).is_err());
    }
}
