//! Stream-ordered NPU ops on 4 simulated devices: after a warm-up call (and
//! the stream check that follows it), several more calls of each op with no
//! check in between make no host synchronisation, no device or host
//! allocation or free, no event creation and no copy between host and
//! device, as the simulator's per-thread counters (`cannsim_counters`) count
//! them; and the workspace pool and the caller's allocator behave as
//! documented. Ignored without an NPU; on real CANN, which has no counters,
//! the counting tests check only results; under the simulator
//! (`ci/npu-4card.sh --sim`) missing counters fail them.

mod common;

use std::ffi::c_void;
use std::sync::atomic::{AtomicUsize, Ordering};

use ascend_moe::backend::npu::{FinalizeImpl, NpuDevice, WorkspaceAllocator};
use ascend_moe::backend::{DropPadMode, FinalizeArgs, FinalizeDims, OutputRows};
use ascend_moe::moe::prepare_finalize::{finalize, prepare, MoeContext, MoeGroups};
use ascend_moe::moe::shared::{shared_gather_unpad, shared_pad_reduce_scatter, shared_pad_split};
use ascend_moe::moe::{
    check_sp_layout_agreement, finalize_and_reduce, maybe_all_gather_and_maybe_unpad, maybe_pad_and_reduce, Output,
    ReducePoint, ReducePolicy, SharedMode, SpLayout,
};
use ascend_moe::ranks::npu_run_ranks;
use ascend_moe::{Collectives, CommOptions, CommType, DType, Device, ReduceOp, Result, Tensor};

const WORLD: usize = 4;

/// The simulator's counters of the calling thread; `None` on real CANN, a
/// failure when the run expects the simulator (`ci/npu-4card.sh --sim`).
fn counters() -> Option<acl_sys::CannsimCounters> {
    ascend_moe::testing::runtime::sim_counters()
}

fn reset() {
    if let Ok(api) = acl_sys::acl() {
        api.reset_counters();
    }
}

fn npu(d: &Device) -> &NpuDevice {
    match d {
        Device::Npu(n) => n,
        Device::Cpu => panic!("an NPU device"),
    }
}

/// Calls of an op [`measure`] counts after the warm-up, with no stream check
/// in between: an engine runs many layers between two checks.
const CALLS: u64 = 4;

/// Runs `f` once to warm the pool, the staging blocks and the status records
/// up, then the stream check, then [`CALLS`] more times without a check,
/// counting those; returns the problems found, naming the op. Every count
/// must be zero.
fn measure(dev: &NpuDevice, op: &str, f: impl FnMut() -> Result<()>) -> Vec<String> {
    measure_with_staging(dev, op, 0, f)
}

/// [`measure`] for an op that stages `staged` small host-to-device copies of
/// host data per call through pinned memory (a native kernel's tiling, which
/// it reads from device memory; the padded finalize's slot offsets, one
/// 32-bit word per slot), never tensor data.
fn measure_with_staging(dev: &NpuDevice, op: &str, staged: u64, mut f: impl FnMut() -> Result<()>) -> Vec<String> {
    let mut problems = Vec::new();
    if let Err(e) = f().and_then(|_| dev.check()) {
        return vec![format!("{op}: warm-up failed: {e}")];
    }
    reset();
    let r = (0..CALLS).try_for_each(|_| f());
    let c = counters();
    let staged = staged * CALLS;
    if let Err(e) = r.and_then(|_| dev.check()) {
        problems.push(format!("{op}: {e}"));
    }
    if let Some(c) = c {
        let bad = [
            ("host syncs", c.host_syncs),
            ("device mallocs", c.device_mallocs),
            ("device frees", c.device_frees),
            ("host mallocs", c.host_mallocs),
            ("host frees", c.host_frees),
            ("host-to-device copies beyond the staged ones", c.h2d_copies.saturating_sub(staged)),
            ("device-to-host copies", c.d2h_copies),
            ("event queries", c.queries),
            ("event creations", c.event_creates),
        ];
        if c.h2d_copies < staged {
            problems.push(format!("{op}: {} host-to-device copies, {staged} staged ones expected", c.h2d_copies));
        }
        for (what, n) in bad {
            if n != 0 {
                problems.push(format!("{op}: {n} {what}"));
            }
        }
    }
    problems
}

/// Fails with every rank's problems, each prefixed with its rank.
fn assert_no_problems(reports: Vec<Vec<String>>) {
    let problems: Vec<String> = reports
        .into_iter()
        .enumerate()
        .flat_map(|(r, p)| p.into_iter().map(move |s| format!("rank {r}: {s}")))
        .collect();
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// The values [`filled`] puts in a tensor of `n` elements: small integers,
/// so every sum and product the ops below make is exact in f32.
fn fv(n: usize, seed: usize) -> Vec<f32> {
    (0..n).map(|i| ((i * 7 + seed * 13) % 11) as f32 - 5.0).collect()
}

fn filled(dev: &Device, shape: &[usize], seed: usize) -> Result<Tensor> {
    Tensor::from_slice(&fv(shape.iter().product(), seed), shape)?.to_device(dev)
}

/// Element-wise sum of `f(r)` over the ranks.
fn over_ranks(f: impl Fn(usize) -> Vec<f32>) -> Vec<f32> {
    let mut acc = f(0);
    for r in 1..WORLD {
        for (a, b) in acc.iter_mut().zip(f(r)) {
            *a += b;
        }
    }
    acc
}

/// Rows `[from, from + count)` of the row-major `v` with `h` columns.
fn rows(v: &[f32], h: usize, from: usize, count: usize) -> Vec<f32> {
    v[from * h..(from + count) * h].to_vec()
}

/// SPEC section 1 in drop-less column mode (0) without skips or bias:
/// `out[i] = sum_k s(i,k) * row(idx[k*N + i])`.
fn finalize_column(ex: &[f32], idx: &[i32], scales: &[f32], n: usize, k: usize, h: usize) -> Vec<f32> {
    let mut out = vec![0f32; n * h];
    for i in 0..n {
        for kk in 0..k {
            let r = idx[kk * n + i] as usize;
            for c in 0..h {
                out[i * h + c] += scales[i * k + kk] * ex[r * h + c];
            }
        }
    }
    out
}

/// Records a problem when `t` does not hold exactly `want` (every expected
/// value is a small integer, exact in f32).
fn expect(p: &mut Vec<String>, op: &str, t: &Tensor, want: &[f32]) {
    match t.to_vec::<f32>() {
        Err(e) => p.push(format!("{op}: reading the output: {e}")),
        Ok(got) if got.len() != want.len() => p.push(format!("{op}: {} values, {} expected", got.len(), want.len())),
        Ok(got) => {
            if let Some(i) = got.iter().zip(want).position(|(g, w)| g != w) {
                p.push(format!("{op}: value {i} is {}, {} expected", got[i], want[i]));
            }
        }
    }
}

/// finalize(prepare(x)) of SPEC section 6 on DP2 x TP2 with tokens [5, 1],
/// every rank's `x` its own `fv` values: the reducing ALLGATHER paths sum the
/// identical gathered copies (EP size with SP, DP size without); MC2 /
/// FUSED_MC2 / ALLTOALL without SP give back each DP row from the TP rank
/// whose slice held it (zero past that rank's rows); with SP they are the
/// identity.
fn prepare_finalize_want(ct: CommType, sp: bool, rank: usize, local: usize, width: usize) -> Vec<f32> {
    let mine = fv(local * width, rank);
    let times = |k: f32| mine.iter().map(|v| v * k).collect::<Vec<f32>>();
    match (ct, sp) {
        (CommType::AllGather, true) => times(WORLD as f32),
        (CommType::AllGather, false) => times(2.0),
        (_, true) => mine,
        (_, false) => {
            let (d, t_d) = (rank / 2, [5usize, 1][rank / 2]);
            let sizes: Vec<usize> = if ct == CommType::AllToAll {
                let n = t_d.max(2);
                (0..2).map(|q| n / 2 + usize::from(q < n % 2)).collect()
            } else {
                vec![5usize.div_ceil(2); 2]
            };
            (0..t_d)
                .flat_map(|j| {
                    let q = usize::from(j >= sizes[0]);
                    // Rank (d, q) holds t_d rows of its own values.
                    let src = fv(t_d * width, 2 * d + q);
                    rows(&src, width, j, 1)
                })
                .collect()
        }
    }
}

#[test]
#[ignore = "needs an Ascend NPU"]
fn repeated_calls_of_every_op_between_checks_make_no_host_sync_allocation_or_host_copy() {
    // Under the simulator, missing counters fail here, before the ranks start.
    counters();
    let reports = npu_run_ranks(WORLD, &CommOptions::from_env(), |rank, comm| -> Result<Vec<String>> {
        let dev = comm.device();
        let nd = npu(&dev).clone();
        let h = 16; // 64-byte rows: every row copy goes to aclrtMemcpyAsync
        let mut p = Vec::new();

        // Collectives.
        let src = filled(&dev, &[WORLD * 4, h], rank)?;
        let mut same = Tensor::zeros(&[WORLD * 4, h], DType::F32, &dev)?;
        let mut part = Tensor::zeros(&[4, h], DType::F32, &dev)?;
        let mut all = Tensor::zeros(&[WORLD * WORLD * 4, h], DType::F32, &dev)?;
        let counts = [3 * h, 0, 5 * h, h];
        let total: usize = counts.iter().sum();
        let vsrc = filled(&dev, &[total / h, h], rank)?;
        let vmine = filled(&dev, &[counts[rank] / h, h], rank)?;
        let mut vdst = Tensor::zeros(&[counts[rank] / h, h], DType::F32, &dev)?;
        let mut vall = Tensor::zeros(&[total / h, h], DType::F32, &dev)?;
        let sc = [h; WORLD];
        let mut a2a = Tensor::zeros(&[WORLD, h], DType::F32, &dev)?;
        let a2a_src = filled(&dev, &[WORLD, h], rank)?;
        // What each collective must leave, from SPEC section 8's definitions.
        let src_sum = over_ranks(|r| fv(WORLD * 4 * h, r));
        let offset: usize = counts[..rank].iter().sum();
        p.extend(measure(&nd, "all_reduce", || comm.all_reduce(&src, &mut same, ReduceOp::Sum)));
        expect(&mut p, "all_reduce", &same, &src_sum);
        // The max over ranks of the same sum is that sum.
        p.extend(measure(&nd, "all_reduce_in_place", || comm.all_reduce_in_place(&mut same, ReduceOp::Max)));
        expect(&mut p, "all_reduce_in_place", &same, &src_sum);
        p.extend(measure(&nd, "reduce_scatter", || comm.reduce_scatter(&src, &mut part, ReduceOp::Sum)));
        expect(&mut p, "reduce_scatter", &part, &rows(&src_sum, h, rank * 4, 4));
        p.extend(measure(&nd, "all_gather", || comm.all_gather(&src, &mut all)));
        expect(&mut p, "all_gather", &all, &(0..WORLD).flat_map(|r| fv(WORLD * 4 * h, r)).collect::<Vec<_>>());
        p.extend(measure(&nd, "reduce_scatter_v", || comm.reduce_scatter_v(&vsrc, &mut vdst, &counts, ReduceOp::Sum)));
        let vsum = over_ranks(|r| fv(total, r));
        expect(&mut p, "reduce_scatter_v", &vdst, &vsum[offset..offset + counts[rank]]);
        p.extend(measure(&nd, "all_gather_v", || comm.all_gather_v(&vmine, &mut vall, &counts)));
        expect(&mut p, "all_gather_v", &vall, &(0..WORLD).flat_map(|r| fv(counts[r], r)).collect::<Vec<_>>());
        p.extend(measure(&nd, "all_to_all_v", || comm.all_to_all_v(&a2a_src, &sc, &mut a2a, &sc)));
        // Block s of this rank's output is block `rank` of rank s's input.
        let a2a_want: Vec<f32> = (0..WORLD).flat_map(|s| rows(&fv(WORLD * h, s), h, rank, 1)).collect();
        expect(&mut p, "all_to_all_v", &a2a, &a2a_want);
        p.extend(measure(&nd, "broadcast", || comm.broadcast(&mut part, 1)));
        // Rank 1's part of the reduce-scatter, on every rank.
        expect(&mut p, "broadcast", &part, &rows(&src_sum, h, 4, 4));
        p.extend(measure(&nd, "barrier", || comm.barrier()));

        // Backend ops.
        let b = dev.backend();
        let x = filled(&dev, &[8, h], rank)?;
        let y = filled(&dev, &[8, h], rank + 1)?;
        let mut sum = Tensor::zeros(&[8, h], DType::F32, &dev)?;
        let (xv, yv) = (fv(8 * h, rank), fv(8 * h, rank + 1));
        let added: Vec<f32> = xv.iter().zip(&yv).map(|(a, b)| a + b).collect();
        p.extend(measure(&nd, "add", || b.add(&x, &y, &mut sum)));
        expect(&mut p, "add", &sum, &added);
        p.extend(measure(&nd, "copy_rows", || b.copy_rows(&x, 4, &mut sum, 0, 4)));
        // Rows 0..4 are x's rows 4..8; rows 4..8 keep the sum.
        expect(&mut p, "copy_rows", &sum, &[rows(&xv, h, 4, 4), rows(&added, h, 4, 4)].concat());
        // 16-byte rows (H = 4 f32) start off 64-byte boundaries, which
        // aclrtMemcpyAsync refuses: the byte-copy kernel takes them.
        let narrow = filled(&dev, &[8, 4], rank)?;
        let mut narrow_out = Tensor::zeros(&[8, 4], DType::F32, &dev)?;
        p.extend(measure(&nd, "copy_rows (16-byte rows)", || b.copy_rows(&narrow, 1, &mut narrow_out, 3, 5)));
        let narrow_want = [vec![0f32; 3 * 4], rows(&fv(8 * 4, rank), 4, 1, 5)].concat();
        expect(&mut p, "copy_rows (16-byte rows)", &narrow_out, &narrow_want);

        // Native finalize, dense and into the padded EP buffer.
        let (n, k) = (6usize, 2usize);
        let ex = filled(&dev, &[n * k, h], rank)?;
        let idx_v: Vec<i32> = (0..(n * k) as i32).rev().collect();
        let idx = Tensor::from_slice(&idx_v, &[n * k])?.to_device(&dev)?;
        // SPEC section 1 on every rank's own expanded_x (the scales are the same everywhere).
        let dense_of = |r: usize| finalize_column(&fv(n * k * h, r), &idx_v, &fv(n * k, 3), n, k, h);
        let dense_want = dense_of(rank);
        let scales = filled(&dev, &[n, k], 3)?;
        let args = FinalizeArgs::new(&ex, &idx, DropPadMode::DropLessColumn).with_scales(&scales);
        let dims = FinalizeDims { n, k, h, expanded_rows: n * k, experts: 0 };
        let mut dense = Tensor::zeros(&[n, h], DType::F32, &dev)?;
        // One staged copy: the kernel's tiling.
        p.extend(measure_with_staging(&nd, "finalize_routing (native, dense)", 1, || {
            b.finalize_routing(&args, &dims, &mut dense, OutputRows::Dense)
        }));
        expect(&mut p, "finalize_routing (native, dense)", &dense, &dense_want);
        // Native token unpermute, with repeated and out-of-range indices
        // (SPEC section 1: they contribute nothing), which aclnn cannot take.
        let wild_v: Vec<i32> = vec![3, 3, -1, 11, 40, 0, 7, 7, 2, 1, 5, 9];
        let wild = Tensor::from_slice(&wild_v, &[n * k])?.to_device(&dev)?;
        let mut unpermuted = Tensor::zeros(&[n, h], DType::F32, &dev)?;
        p.extend(measure_with_staging(&nd, "token_unpermute (native)", 1, || {
            b.token_unpermute(&ex, &wild, Some(&scales), k, &mut unpermuted)
        }));
        let (exv, sv) = (fv(n * k * h, rank), fv(n * k, 3));
        let mut unpermute_want = vec![0f32; n * h];
        for t in 0..n {
            for kk in 0..k {
                let s = wild_v[t * k + kk];
                if (0..(n * k) as i32).contains(&s) {
                    for c in 0..h {
                        unpermute_want[t * h + c] += sv[t * k + kk] * exv[s as usize * h + c];
                    }
                }
            }
        }
        expect(&mut p, "token_unpermute (native)", &unpermuted, &unpermute_want);
        // The aclnn finalize: its indices are checked on the device first
        // (by the native kernel, whose tiling is staged).
        let aclnn = Device::Npu(nd.clone().with_finalize_impl(FinalizeImpl::Aclnn));
        let mut dense = Tensor::zeros(&[n, h], DType::F32, &dev)?;
        p.extend(measure_with_staging(&nd, "finalize_routing (aclnn, dense)", 1, || {
            aclnn.backend().finalize_routing(&args, &dims, &mut dense, OutputRows::Dense)
        }));
        expect(&mut p, "finalize_routing (aclnn, dense)", &dense, &dense_want);
        let local_sizes = [2usize, 0, 3, 1];
        let mut padded = Tensor::zeros(&[4 * 3, h], DType::F32, &dev)?;
        // The slot offsets and the tiling.
        p.extend(measure_with_staging(&nd, "finalize_routing (native, padded)", 2, || {
            b.finalize_routing(
                &args,
                &dims,
                &mut padded,
                OutputRows::Padded { local_sizes: &local_sizes, slot_rows: 3 },
            )
        }));
        // Block r of the tokens at row 3r of slot r, zeros elsewhere.
        let mut padded_want = vec![0f32; 4 * 3 * h];
        let mut first = 0;
        for (r, &size) in local_sizes.iter().enumerate() {
            padded_want[r * 3 * h..(r * 3 + size) * h].copy_from_slice(&rows(&dense_want, h, first, size));
            first += size;
        }
        expect(&mut p, "finalize_routing (native, padded)", &padded, &padded_want);

        // The SP pad/reduce and gather/unpad pair, and finalize_and_reduce.
        let layout = SpLayout::new(&local_sizes)?;
        let full = filled(&dev, &[n, h], rank)?;
        let shard = filled(&dev, &[local_sizes[rank], h], rank)?;
        // SPEC sections 3 and 4: this rank's block of the sum over ranks, and
        // every rank's shard in rank order.
        let mine = local_sizes[rank];
        let first: usize = local_sizes[..rank].iter().sum();
        let mut got = None;
        p.extend(measure(&nd, "maybe_pad_and_reduce", || {
            got = Some(maybe_pad_and_reduce(&full, Some(&layout), &comm)?);
            Ok(())
        }));
        let reduced_want = |width: usize| rows(&over_ranks(|r| fv(n * width, r)), width, first, mine);
        if let Some(t) = &got {
            expect(&mut p, "maybe_pad_and_reduce", t, &reduced_want(h));
        }
        let gathered_want =
            |width: usize| -> Vec<f32> { (0..WORLD).flat_map(|r| fv(local_sizes[r] * width, r)).collect() };
        p.extend(measure(&nd, "maybe_all_gather_and_maybe_unpad", || {
            got = Some(maybe_all_gather_and_maybe_unpad(&shard, Some(&layout), &comm)?);
            Ok(())
        }));
        if let Some(t) = &got {
            expect(&mut p, "maybe_all_gather_and_maybe_unpad", t, &gathered_want(h));
        }
        p.extend(measure_with_staging(&nd, "finalize_and_reduce", 2, || {
            got = Some(finalize_and_reduce(&args, Some(&layout), &comm)?);
            Ok(())
        }));
        if let Some(t) = &got {
            expect(&mut p, "finalize_and_reduce", t, &rows(&over_ranks(dense_of), h, first, mine));
        }

        // The same pair with 20-byte rows: every row copy is unaligned and
        // goes through the copy kernel.
        let odd = 5;
        let full_odd = filled(&dev, &[n, odd], rank)?;
        let shard_odd = filled(&dev, &[local_sizes[rank], odd], rank)?;
        p.extend(measure(&nd, "maybe_pad_and_reduce (20-byte rows)", || {
            got = Some(maybe_pad_and_reduce(&full_odd, Some(&layout), &comm)?);
            Ok(())
        }));
        if let Some(t) = &got {
            expect(&mut p, "maybe_pad_and_reduce (20-byte rows)", t, &reduced_want(odd));
        }
        p.extend(measure(&nd, "maybe_all_gather_and_maybe_unpad (20-byte rows)", || {
            got = Some(maybe_all_gather_and_maybe_unpad(&shard_odd, Some(&layout), &comm)?);
            Ok(())
        }));
        if let Some(t) = &got {
            expect(&mut p, "maybe_all_gather_and_maybe_unpad (20-byte rows)", t, &gathered_want(odd));
        }

        // Token prepare and finalize of every comm type, DP2 x TP2, SP on
        // and off (uneven DP tokens, fewer than TP on DP rank 1), with 64-
        // and 20-byte rows.
        let groups = MoeGroups::from_world(&comm, 2)?;
        let dp_tokens = [5usize, 1];
        for (sp, width) in [(false, h), (true, h), (false, odd), (true, odd)] {
            let ctx = MoeContext::new(&dp_tokens, 2, rank / 2, rank % 2, sp)?;
            let local = ctx.local_tokens();
            let x = filled(&dev, &[local, width], rank)?;
            for ct in CommType::ALL {
                let op = format!("prepare + finalize {} sp {sp} h {width}", ct.name());
                let mut back = None;
                p.extend(measure(&nd, &op, || {
                    let prepared = prepare(&x, ct, &ctx, &groups)?;
                    back = Some(finalize(prepared.hidden, ct, &ctx, &groups)?);
                    Ok(())
                }));
                if let Some(t) = &back {
                    expect(&mut p, &op, t, &prepare_finalize_want(ct, sp, rank, local, width));
                }
            }
        }

        // The shared-expert TP ops (SPEC section 6's split and gather for a
        // sequence-parallel shared expert), over the TP pairs.
        let tp = &groups.tp;
        let tokens = filled(&dev, &[5, h], rank)?;
        let part = shared_pad_split(&tokens, tp)?;
        // TP pairs are EP ranks (2d, 2d + 1); each pads its 5 tokens to 6 and
        // TP rank t holds rows [3t, 3t + 3).
        let padded_of = |r: usize| [fv(5 * h, r), vec![0f32; h]].concat();
        let pair = [rank - rank % 2, rank - rank % 2 + 1];
        p.extend(measure(&nd, "shared_pad_split", || {
            got = Some(shared_pad_split(&tokens, tp)?);
            Ok(())
        }));
        if let Some(t) = &got {
            expect(&mut p, "shared_pad_split", t, &rows(&padded_of(rank), h, 3 * (rank % 2), 3));
        }
        p.extend(measure(&nd, "shared_gather_unpad", || {
            got = Some(shared_gather_unpad(&part, 5, tp)?);
            Ok(())
        }));
        let gathered: Vec<f32> = pair.iter().flat_map(|&q| rows(&padded_of(q), h, 3 * (q % 2), 3)).collect();
        if let Some(t) = &got {
            expect(&mut p, "shared_gather_unpad", t, &gathered[..5 * h]);
        }
        p.extend(measure(&nd, "shared_pad_reduce_scatter", || {
            got = Some(shared_pad_reduce_scatter(&tokens, tp)?);
            Ok(())
        }));
        let pair_sum: Vec<f32> = padded_of(pair[0]).iter().zip(padded_of(pair[1])).map(|(a, b)| a + b).collect();
        if let Some(t) = &got {
            expect(&mut p, "shared_pad_reduce_scatter", t, &rows(&pair_sum, h, 3 * (rank % 2), 3));
        }

        // The three reduction points, each on a policy where it reduces (TP 4).
        let early = ReducePolicy::new(SharedMode::TensorParallel, true, false, WORLD, WORLD)?;
        let late = ReducePolicy::new(SharedMode::TensorParallel, false, false, WORLD, WORLD)?;
        let ag = CommType::AllGather;
        assert!(early.routed_early_reduces(ag) && early.shared_reduces(ag) && late.final_reduces(ag));
        let mut held = Some(filled(&dev, &[8, h], rank)?);
        let mut point = |name: &str, f: &dyn Fn(Tensor) -> Result<Tensor>| {
            measure(&nd, name, || {
                let t = held.take().expect("the tensor goes through every point");
                held = Some(f(t)?);
                Ok(())
            })
        };
        p.extend(point("reduce_routed_early", &|t| early.reduce_routed_early(t, ag, &comm)));
        p.extend(point("reduce_shared", &|t| early.reduce_shared(t, ag, &comm)));
        p.extend(point("reduce_final", &|t| late.reduce_final(t, ag, &comm)));
        // 3 * (1 + CALLS) TP all-reduces over the 4 ranks (each point ran
        // 1 + CALLS times): the sum over ranks, then times 4 for each of the
        // others (exact: small integers times a power of two).
        let times = 4f32.powi(3 * (1 + CALLS as i32) - 1);
        let reduced: Vec<f32> = over_ranks(|r| fv(8 * h, r)).iter().map(|v| v * times).collect();
        match &held {
            Some(t) => expect(&mut p, "reduce_routed_early, reduce_shared, reduce_final", t, &reduced),
            None => p.push("the reduction points lost the tensor".into()),
        }
        // A point that reduces into a separate output is one out-of-place
        // all-reduce: no copy of `x` into `out` first.
        let x = filled(&dev, &[8, h], rank)?;
        let mut out = Tensor::zeros(&[8, h], DType::F32, &dev)?;
        p.extend(measure(&nd, "reduce_at_into", || {
            late.reduce_at_into(ReducePoint::Final, Output::Separate { x: &x, out: &mut out }, ag, &comm)
        }));
        if let Some(c) = counters() {
            if c.d2d_copies != 0 {
                p.push(format!("reduce_at_into: {} device-to-device copies before the all-reduce", c.d2d_copies));
            }
        }
        expect(&mut p, "reduce_at_into", &out, &over_ranks(|r| fv(8 * h, r)));
        Ok(p)
    })
    .unwrap();
    assert_no_problems(reports);
}

/// Dispatch and combine read the row counts and the received experts on the
/// host (their results are host values), but move their own index arrays
/// through the stream's staging: after a warm-up, a call allocates and
/// frees no device memory (an upload per index array did both, with a
/// synchronisation before each free).
#[test]
#[ignore = "needs an Ascend NPU"]
fn dispatch_and_combine_allocate_no_device_memory_per_call() {
    use ascend_moe::moe::prepare_finalize::{combine, dispatch};
    let reports = npu_run_ranks(2, &CommOptions::default(), |rank, comm| {
        let dev = comm.device();
        let (n, k, h, experts) = (4usize, 2usize, 8usize, 4usize);
        let x = filled(&dev, &[n, h], rank)?;
        let ids: Vec<i32> = (0..n * k).map(|i| ((i + rank) % experts) as i32).collect();
        let w = filled(&dev, &[n, k], 7)?;
        let round = || -> Result<Vec<f32>> {
            let d = dispatch(&x, &ids, k, None, experts, &comm)?;
            combine(&d.rows, &d, &w, &comm)?.to_vec::<f32>()
        };
        let first = round()?;
        reset();
        let again = round()?;
        let mut p = Vec::new();
        if again != first {
            p.push("dispatch + combine: a second call gave another result".to_string());
        }
        if let Some(c) = counters() {
            if (c.device_mallocs, c.device_frees) != (0, 0) {
                p.push(format!("dispatch + combine: {} device mallocs, {} frees", c.device_mallocs, c.device_frees));
            }
        }
        Ok(p)
    })
    .unwrap();
    assert_no_problems(reports);
}

/// An engine that checks rarely: 600 native finalize launches without a
/// check in between (more than the 256 status records and the 16 pinned
/// staging blocks a stream keeps) allocate nothing and create no event once
/// the first call and its check warmed the stream up: the oldest records and
/// staging blocks are freed once their work completed. A bad index in one of
/// the first launches, whose record is read before the check, is still
/// reported by the check, once, and every output is right. The check reads
/// the records it finds in one or two copies.
#[test]
#[ignore = "needs an Ascend NPU"]
fn many_launches_without_a_check_reuse_their_records_and_staging_and_report_a_bad_index() {
    const LAUNCHES: usize = 600;
    const BAD: usize = 5;
    let nd = NpuDevice::open(2).unwrap().with_finalize_impl(FinalizeImpl::Native);
    let dev = Device::Npu(nd.clone());
    let b = dev.backend();
    let (n, k, h) = (4usize, 2usize, 16usize);
    let ex = filled(&dev, &[n * k, h], 1).unwrap();
    let idx_v: Vec<i32> = (0..(n * k) as i32).collect();
    let idx = Tensor::from_slice(&idx_v, &[n * k]).unwrap().to_device(&dev).unwrap();
    let mut bad_v = idx_v.clone();
    bad_v[3] = 99;
    let bad = Tensor::from_slice(&bad_v, &[n * k]).unwrap().to_device(&dev).unwrap();
    let scales = filled(&dev, &[n, k], 3).unwrap();
    let dims = FinalizeDims { n, k, h, expanded_rows: n * k, experts: 0 };
    let good = FinalizeArgs::new(&ex, &idx, DropPadMode::DropLessColumn).with_scales(&scales);
    let wrong = FinalizeArgs::new(&ex, &bad, DropPadMode::DropLessColumn).with_scales(&scales);
    let mut out = Tensor::zeros(&[n, h], DType::F32, &dev).unwrap();
    b.finalize_routing(&good, &dims, &mut out, OutputRows::Dense).unwrap();
    nd.check().unwrap();
    reset();
    for i in 0..LAUNCHES {
        let args = if i == BAD { &wrong } else { &good };
        b.finalize_routing(args, &dims, &mut out, OutputRows::Dense).unwrap();
    }
    let c = counters();
    match nd.check() {
        Err(ascend_moe::Error::IndexOutOfRange { arg, position, value, .. }) => {
            assert_eq!((arg, position, value), ("expanded_row_idx", 3, 99))
        }
        other => panic!("expected the bad index of launch {BAD}, got {other:?}"),
    }
    if let (Some(before), Some(after)) = (c, counters()) {
        // The check reads the records still held (up to 256, in ring order:
        // at most two runs) in a copy per run, not one per launch.
        let copies = after.d2h_copies - before.d2h_copies;
        assert!(copies <= 2, "the check made {copies} device-to-host copies");
    }
    nd.check().expect("reported once");
    if let Some(c) = c {
        assert_eq!(
            (c.device_mallocs, c.device_frees, c.host_mallocs, c.host_frees, c.event_creates),
            (0, 0, 0, 0, 0),
            "{c:?}"
        );
        assert_eq!(c.h2d_copies, LAUNCHES as u64, "one staged tiling per launch: {c:?}");
    }
    let want = finalize_column(&fv(n * k * h, 1), &idx_v, &fv(n * k, 3), n, k, h);
    assert_eq!(out.to_vec::<f32>().unwrap(), want);
}

static ALLOCS: AtomicUsize = AtomicUsize::new(0);
static FREES: AtomicUsize = AtomicUsize::new(0);

/// A test allocator over aclrtMalloc/aclrtFree (what an engine's caching
/// allocator would do once and then cache), counting its calls.
struct TestAllocator {
    tag: usize,
}

impl WorkspaceAllocator for TestAllocator {
    fn alloc(&self, bytes: usize, _stream: acl_sys::aclrtStream) -> Option<std::ptr::NonNull<c_void>> {
        assert_eq!(self.tag, 0xC0FFEE, "the allocator the stream was given is the one called");
        ALLOCS.fetch_add(1, Ordering::SeqCst);
        let api = acl_sys::acl().unwrap();
        let mut p = std::ptr::null_mut();
        // SAFETY: valid out-pointer, nonzero size, the op's device is bound.
        let rc = unsafe {
            (api.lib.aclrtMalloc.as_ref().unwrap())(
                &mut p,
                bytes,
                acl_sys::aclrtMemMallocPolicy::ACL_MEM_MALLOC_HUGE_FIRST,
            )
        };
        if rc == 0 {
            std::ptr::NonNull::new(p)
        } else {
            None
        }
    }

    fn free(&self, ptr: std::ptr::NonNull<c_void>, _bytes: usize, stream: acl_sys::aclrtStream) {
        FREES.fetch_add(1, Ordering::SeqCst);
        let api = acl_sys::acl().unwrap();
        // SAFETY: a live stream of the bound device; the test allocator frees
        // only after the stream drained (a caching allocator would keep the block).
        unsafe {
            (api.lib.aclrtSynchronizeStream.as_ref().unwrap())(stream);
            (api.lib.aclrtFree.as_ref().unwrap())(ptr.as_ptr());
        }
    }
}

#[test]
#[ignore = "needs an Ascend NPU"]
fn the_callers_allocator_serves_the_workspace_and_gets_every_block_back() {
    let dev = NpuDevice::open(0).unwrap();
    let d = Device::Npu(dev.clone());
    let (a0, f0) = (ALLOCS.load(Ordering::SeqCst), FREES.load(Ordering::SeqCst));
    dev.stream().set_allocator(Some(std::sync::Arc::new(TestAllocator { tag: 0xC0FFEE })));
    let before = dev.stream().workspace_stats();
    let x = filled(&d, &[6, 16], 1).unwrap();
    let y = filled(&d, &[6, 16], 2).unwrap();
    let mut out = Tensor::zeros(&[6, 16], DType::F32, &d).unwrap();
    // The padded layout of a non-native finalize needs a scratch buffer; add
    // needs its aclnn workspace when it has one: count what was asked.
    d.backend().add(&x, &y, &mut out).unwrap();
    let scratch = d.backend().scratch(&[64, 16], DType::F32).unwrap();
    assert!(ALLOCS.load(Ordering::SeqCst) > a0, "the allocator was not called");
    drop(scratch);
    dev.check().unwrap();
    dev.stream().set_allocator(None);
    let after = dev.stream().workspace_stats();
    assert_eq!(after.segments, before.segments, "the pool did not grow while the allocator served");
    assert_eq!(
        ALLOCS.load(Ordering::SeqCst) - a0,
        FREES.load(Ordering::SeqCst) - f0,
        "every block went back to the allocator"
    );
    let want: Vec<f32> =
        x.to_vec::<f32>().unwrap().iter().zip(y.to_vec::<f32>().unwrap()).map(|(a, b)| a + b).collect();
    assert_eq!(out.to_vec::<f32>().unwrap(), want);
}

#[test]
#[ignore = "needs an Ascend NPU"]
fn the_pool_reserves_ahead_reuses_blocks_and_never_grows_under_capture() {
    let dev = NpuDevice::open(1).unwrap();
    let d = Device::Npu(dev.clone());
    dev.stream().reserve_workspace(1 << 20).unwrap();
    let s0 = dev.stream().workspace_stats();
    assert_eq!(s0.segments, 1);
    assert!(s0.reserved_bytes >= 1 << 20);
    // Reserved: taking and returning blocks adds no segment.
    for _ in 0..3 {
        let a = d.backend().scratch(&[256, 256], DType::F32).unwrap(); // 256 KiB
        let b = d.backend().scratch(&[256, 256], DType::F32).unwrap();
        drop((a, b));
    }
    assert_eq!(dev.stream().workspace_stats().segments, 1, "the reserved segment served every block");

    // Under capture a request no free block holds fails clearly, without malloc.
    let api = acl_sys::acl().unwrap();
    let begin = acl_sys::acl_symbol!(api, aclmdlRICaptureBegin).expect("the graph capture API this test exercises");
    let end = acl_sys::acl_symbol!(api, aclmdlRICaptureEnd).unwrap();
    let destroy = acl_sys::acl_symbol!(api, aclmdlRIDestroy).unwrap();
    dev.set_current().unwrap();
    // SAFETY: a live non-default stream of the bound device.
    assert_eq!(
        unsafe { begin(dev.stream().raw(), acl_sys::aclmdlRICaptureMode::ACL_MODEL_RI_CAPTURE_MODE_RELAXED) },
        0
    );
    assert!(dev.stream().is_capturing().unwrap());
    let fits = d.backend().scratch(&[256, 256], DType::F32);
    assert!(fits.is_ok(), "a reserved block is served under capture: {:?}", fits.err());
    let err = d.backend().scratch(&[1024, 1024], DType::F32).expect_err("4 MiB do not fit the 1 MiB reserve");
    let msg = err.to_string();
    assert!(msg.contains("captured") && msg.contains("reserve"), "{msg}");
    assert!(dev.stream().reserve_workspace(8 << 20).is_err(), "no reserve under capture");
    let err = dev.check().expect_err("a check would synchronise the capturing stream");
    assert!(err.to_string().contains("captured"), "{err}");
    drop(fits);
    let mut model: acl_sys::aclmdlRI = std::ptr::null_mut();
    // SAFETY: the stream began the capture; valid out-pointer.
    assert_eq!(unsafe { end(dev.stream().raw(), &mut model) }, 0);
    assert!(!dev.stream().is_capturing().unwrap());
    // SAFETY: the model just ended, never replayed.
    assert_eq!(unsafe { destroy(model) }, 0);
    assert_eq!(dev.stream().workspace_stats().segments, 1, "the pool did not grow under capture");
    // Outside capture it grows on demand.
    drop(d.backend().scratch(&[1024, 1024], DType::F32).unwrap());
    assert_eq!(dev.stream().workspace_stats().segments, 2);
}

/// A device agreement check `check` that the ranks disagree on: its stream
/// check fails once, with a message `named` accepts, and a graph capturing it
/// fails on every replay, once each, with a message containing `replayed`.
/// Problems go to `p`.
fn disagreement_reported(
    nd: &NpuDevice,
    p: &mut Vec<String>,
    check: &dyn Fn() -> Result<()>,
    named: &dyn Fn(&str) -> bool,
    replayed: &str,
) -> Result<()> {
    check()?;
    match nd.check() {
        Err(e) if named(&e.to_string()) => {}
        other => p.push(format!("a disagreement was reported as {other:?}")),
    }
    nd.check().map_err(|e| ascend_moe::Error::invalid("test", "check", format!("reported twice: {e}")))?;
    nd.set_current()?;
    let graph = ascend_moe::testing::graph::Graph::capture(nd.stream().raw(), || check().expect("captured check"));
    for round in 0..2 {
        graph.replay(nd.stream().raw());
        match nd.check() {
            Err(e) if e.to_string().contains(replayed) => {}
            other => p.push(format!("replay {round}: {other:?}")),
        }
    }
    Ok(())
}

/// The comm-type agreement check of `prepare` on the NPU compares the
/// gathered choices on the device: the call only enqueues (no sync, no host
/// read), ranks that agree pass their stream check, and when two DP groups
/// disagree every rank's stream check fails naming a rank of the other
/// choice. It can be captured and replayed.
#[test]
#[ignore = "needs an Ascend NPU"]
fn the_comm_type_agreement_check_runs_on_the_device() {
    use ascend_moe::moe::prepare_finalize::check_comm_type_agreement;
    let reports = npu_run_ranks(WORLD, &CommOptions::from_env(), |rank, comm| -> Result<Vec<String>> {
        let nd = npu(&comm.device()).clone();
        // Two staged copies: this rank's choice, from pinned memory, and the
        // device check's tiling.
        let mut p = measure_with_staging(&nd, "agreeing ranks", 2, || check_comm_type_agreement(CommType::Mc2, &comm));
        let mine = if rank < 2 { CommType::AllGather } else { CommType::Mc2 };
        let other = if rank < 2 { "MC2" } else { "ALLGATHER" };
        let named =
            |msg: &str| msg.contains("disagree") && msg.contains(other) && msg.contains(&format!("rank {rank}"));
        disagreement_reported(&nd, &mut p, &|| check_comm_type_agreement(mine, &comm), &named, "disagree")?;
        Ok(p)
    })
    .unwrap();
    assert_no_problems(reports);
}

/// The SP layout check (`ASCEND_MOE_CHECK_LAYOUT=1` runs it in the SP ops on
/// HCCL) compares the layouts' fingerprints on the device: the call only
/// enqueues (no sync, no host read), ranks that agree pass their stream
/// check, and when two ranks hold a stale layout (equal `M`, so HCCL itself
/// would move misaligned rows without complaint) every rank's stream check
/// fails naming the disagreement. It can be captured and replayed.
#[test]
#[ignore = "needs an Ascend NPU"]
fn the_sp_layout_agreement_check_runs_on_the_device() {
    let reports = npu_run_ranks(WORLD, &CommOptions::from_env(), |rank, comm| -> Result<Vec<String>> {
        let nd = npu(&comm.device()).clone();
        let agreed = SpLayout::new(&[3, 1, 2, 2])?;
        // Two staged copies: this rank's fingerprint, and the device check's tiling.
        let mut p = measure_with_staging(&nd, "agreeing ranks", 2, || check_sp_layout_agreement(&agreed, &comm));
        let mine = SpLayout::new(if rank < 2 { &[3, 1, 2, 2] } else { &[3, 2, 1, 2] })?;
        const SAYS: &str = "disagree on the SP layout";
        let named = |msg: &str| msg.contains(SAYS);
        disagreement_reported(&nd, &mut p, &|| check_sp_layout_agreement(&mine, &comm), &named, SAYS)?;
        Ok(p)
    })
    .unwrap();
    assert_no_problems(reports);
}

/// With `ASCEND_MOE_CHECK_LAYOUT=1` the shared-expert helpers on an HCCL
/// group compare the TP ranks' token counts first: ranks holding a stale
/// count whose parts have the same size (13 and 14 tokens are 4 rows per
/// rank of TP 4), which HCCL itself would move without complaint, fail every
/// rank's stream check in both helpers, and ranks that agree pass. Without
/// the variable the same calls pass the check (the opt-in default).
#[test]
#[ignore = "needs an Ascend NPU"]
fn the_shared_helpers_compare_their_token_counts_with_ascend_moe_check_layout() {
    const VAR: &str = "ASCEND_MOE_CHECK_LAYOUT";
    let run = |checked: bool, stale: bool| {
        npu_run_ranks(WORLD, &CommOptions::from_env(), |rank, comm| -> Result<Vec<String>> {
            let nd = npu(&comm.device()).clone();
            let mut p = Vec::new();
            let tokens = if stale && rank >= 2 { 14 } else { 13 };
            let h = 4;
            let dev = comm.device();
            let part = filled(&dev, &[4, h], rank)?;
            let full = filled(&dev, &[tokens, h], rank)?;
            let ops: [(&str, &dyn Fn() -> Result<()>); 2] = [
                ("shared_gather_unpad", &|| shared_gather_unpad(&part, tokens, &comm).map(drop)),
                ("shared_pad_reduce_scatter", &|| shared_pad_reduce_scatter(&full, &comm).map(drop)),
            ];
            for (op, f) in ops {
                f()?;
                match (checked && stale, nd.check()) {
                    (true, Err(e)) if e.to_string().contains("disagree on the token count") => {}
                    (false, Ok(())) => {}
                    (_, other) => p.push(format!("{op}, check {checked}, stale {stale}: {other:?}")),
                }
            }
            Ok(p)
        })
        .unwrap()
    };
    assert_no_problems(run(false, true));
    // SAFETY: ci/npu-4card.sh runs these tests one at a time (--test-threads=1);
    // the variable is set before the rank threads start and removed after they joined.
    std::env::set_var(VAR, "1");
    let agreeing = run(true, false);
    let stale = run(true, true);
    std::env::remove_var(VAR);
    assert_no_problems(agreeing);
    assert_no_problems(stale);
}

/// With `ASCEND_MOE_CHECK_LAYOUT=1` the SP ops on an HCCL group compare
/// their layouts first: ranks holding a stale layout of equal `M` (which
/// HCCL itself would move without complaint) fail every rank's stream check
/// in each of the three ops, and ranks that agree pass. Without the variable
/// the same calls pass the check (the opt-in default).
#[test]
#[ignore = "needs an Ascend NPU"]
fn the_sp_ops_compare_their_layouts_with_ascend_moe_check_layout() {
    const VAR: &str = "ASCEND_MOE_CHECK_LAYOUT";
    let run = |checked: bool| {
        npu_run_ranks(WORLD, &CommOptions::from_env(), |rank, comm| -> Result<Vec<String>> {
            let nd = npu(&comm.device()).clone();
            let mut p = Vec::new();
            // Equal M = 3 and 8 rows in all on every rank; ranks 2 and 3 hold a stale layout.
            let layout = SpLayout::new(if rank < 2 { &[3, 1, 2, 2] } else { &[3, 2, 1, 2] })?;
            let h = 4;
            let dev = comm.device();
            let full = filled(&dev, &[8, h], rank)?;
            let shard = filled(&dev, &[layout.local_size(rank), h], rank)?;
            let xs = filled(&dev, &[8, h], rank)?;
            let idx = Tensor::from_slice(&(0..8).collect::<Vec<i32>>(), &[8])?.to_device(&dev)?;
            let args = FinalizeArgs::new(&xs, &idx, DropPadMode::DropLessRow);
            let ops: [(&str, &dyn Fn() -> Result<()>); 3] = [
                ("maybe_pad_and_reduce", &|| maybe_pad_and_reduce(&full, Some(&layout), &comm).map(drop)),
                ("maybe_all_gather_and_maybe_unpad", &|| {
                    maybe_all_gather_and_maybe_unpad(&shard, Some(&layout), &comm).map(drop)
                }),
                ("finalize_and_reduce", &|| finalize_and_reduce(&args, Some(&layout), &comm).map(drop)),
            ];
            for (op, f) in ops {
                f()?;
                match (checked, nd.check()) {
                    (true, Err(e)) if e.to_string().contains("disagree on the SP layout") => {}
                    (false, Ok(())) => {}
                    (_, other) => p.push(format!("{op}, check {checked}: {other:?}")),
                }
            }
            Ok(p)
        })
        .unwrap()
    };
    assert_no_problems(run(false));
    // SAFETY: ci/npu-4card.sh runs these tests one at a time (--test-threads=1);
    // the variable is set before the rank threads start and removed after they joined.
    std::env::set_var(VAR, "1");
    let reports = run(true);
    std::env::remove_var(VAR);
    assert_no_problems(reports);
}
