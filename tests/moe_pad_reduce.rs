//! Multi-rank tests of the EP/SP pad-and-reduce, gather-and-unpad and the
//! fused finalize-and-reduce (SPEC sections 3 and 4), against a naive
//! per-rank model written here. The bodies run on the CPU communicator and
//! (`npu` cases, ignored without an NPU) on 4 NPUs through HCCL, every layout
//! of at most 4 ranks.

mod common;
mod moe_common;

use ascend_moe::backend::cpu::CpuCommConfig;
use ascend_moe::backend::FinalizeArgs;
use ascend_moe::moe::finalize::moe_finalize_routing;
use ascend_moe::moe::layout::SpLayout;
use ascend_moe::moe::pad_reduce::*;
use ascend_moe::ranks::{run_ranks, run_ranks_with};
use ascend_moe::{Collectives, Comm, CommOptions, DType, DropPadMode, Tensor};
use common::On;
use moe_common::*;

fn opts() -> CommOptions {
    CommOptions::with_timeout(std::time::Duration::from_secs(30))
}

/// Per-rank data `[rows, h]` of rank `r`, reproducible from `(seed, r)`.
fn rank_data(seed: u64, r: usize, rows: usize, h: usize) -> Vec<f32> {
    let mut rng = Rng::new(seed * 131 + r as u64);
    (0..rows * h).map(|_| rng.unit()).collect()
}

fn layouts() -> Vec<SpLayout> {
    let mut rng = Rng::new(21);
    let mut v: Vec<SpLayout> =
        [vec![4usize], vec![3, 3], vec![5, 0], vec![0, 0, 0], vec![1, 4, 0, 2], vec![0, 7, 7, 1, 0, 2, 3, 3]]
            .iter()
            .map(|s| SpLayout::new(s).unwrap())
            .collect();
    for _ in 0..6 {
        let ep = 1 + rng.below(8);
        let s: Vec<usize> = (0..ep).map(|_| if rng.below(3) == 0 { 0 } else { rng.below(6) }).collect();
        v.push(SpLayout::new(&s).unwrap());
    }
    v.push(SpLayout::from_dp_tokens(&[1000, 7], 2).unwrap());
    v
}

backend_test!(pad_and_reduce_matches_naive_model, |on: On| {
    let h = 5;
    for (li, l) in layouts().into_iter().enumerate() {
        let ep = l.ep_size();
        if !on.fits(ep) {
            continue;
        }
        let total = l.total_rows();
        let seed = 100 + li as u64;
        let outs = on
            .run(ep, &opts(), |r, comm| {
                let x = Tensor::from_slice(&rank_data(seed, r, total, h), &[total, h])?.to_device(&comm.device())?;
                let out = maybe_pad_and_reduce(&x, Some(&l), &comm)?;
                assert_eq!(out.shape(), maybe_pad_and_reduce_output_shape(x.shape(), Some(&l), r, ep)?.as_slice());
                out.to_vec::<f32>()
            })
            .unwrap();
        let data: Vec<Vec<f32>> = (0..ep).map(|q| rank_data(seed, q, total, h)).collect();
        for (r, out) in outs.iter().enumerate() {
            let (off, rows) = (l.offset(r), l.local_size(r));
            assert_eq!(out.len(), rows * h, "layout {:?} rank {r}", l.local_sizes());
            let want: Vec<f64> = (off * h..(off + rows) * h).map(|i| data.iter().map(|d| d[i] as f64).sum()).collect();
            let mag: Vec<f64> =
                (off * h..(off + rows) * h).map(|i| data.iter().map(|d| (d[i] as f64).abs()).sum()).collect();
            let got: Vec<f64> = out.iter().map(|v| *v as f64).collect();
            assert_within_rounding("pad_and_reduce", DType::F32, &got, &want, &mag);
        }
    }
});

backend_test!(all_gather_and_unpad_matches_naive_model, |on: On| {
    let h = 3;
    for (li, l) in layouts().into_iter().enumerate() {
        let ep = l.ep_size();
        if !on.fits(ep) {
            continue;
        }
        let seed = 200 + li as u64;
        let outs = on
            .run(ep, &opts(), |r, comm| {
                let x = from_f32(&rank_data(seed, r, l.local_size(r), h), &[l.local_size(r), h], DType::BF16)
                    .to_device(&comm.device())?;
                let out = maybe_all_gather_and_maybe_unpad(&x, Some(&l), &comm)?;
                assert_eq!(
                    out.shape(),
                    maybe_all_gather_and_maybe_unpad_output_shape(x.shape(), Some(&l), r, ep)?.as_slice()
                );
                Ok(to_f64(&out))
            })
            .unwrap();
        let want: Vec<f64> = (0..ep)
            .flat_map(|q| rank_data(seed, q, l.local_size(q), h))
            .map(|v| ascend_moe::half::bf16::from_f32(v).to_f64())
            .collect();
        for out in outs {
            assert_eq!(out, want, "layout {:?}", l.local_sizes());
        }
    }
});

backend_test!(gather_then_reduce_of_partials_is_the_local_shard_of_their_sum, |on: On| {
    let h = 4;
    for (li, l) in layouts().into_iter().enumerate() {
        let ep = l.ep_size();
        if !on.fits(ep) {
            continue;
        }
        let seed = 300 + li as u64;
        let outs = on
            .run(ep, &opts(), |r, comm| {
                let shard = Tensor::from_slice(&rank_data(seed, r, l.local_size(r), h), &[l.local_size(r), h])?
                    .to_device(&comm.device())?;
                let gathered = maybe_all_gather_and_maybe_unpad(&shard, Some(&l), &comm)?;
                // Rank r's partial: (r + 1) * gathered, so the sum over ranks is
                // ep * (ep + 1) / 2 * gathered.
                let part: Vec<f32> = gathered.to_vec::<f32>()?.iter().map(|v| v * (r + 1) as f32).collect();
                let part = Tensor::from_slice(&part, gathered.shape())?.to_device(&comm.device())?;
                maybe_pad_and_reduce(&part, Some(&l), &comm)?.to_vec::<f32>()
            })
            .unwrap();
        let factor = (ep * (ep + 1) / 2) as f64;
        for (r, out) in outs.iter().enumerate() {
            let want: Vec<f64> = rank_data(seed, r, l.local_size(r), h).iter().map(|v| *v as f64 * factor).collect();
            let mag: Vec<f64> = want.iter().map(|w| w.abs()).collect();
            let got: Vec<f64> = out.iter().map(|v| *v as f64).collect();
            assert_within_rounding("gather+reduce", DType::F32, &got, &want, &mag);
        }
    }
});

backend_test!(without_layout_it_is_a_plain_reduce_scatter_and_all_gather, |on: On| {
    let (ep, h, rows) = (4, 2, 8);
    let outs = on
        .run(ep, &opts(), |r, comm| {
            let x = Tensor::from_slice(&rank_data(7, r, rows, h), &[rows, h])?.to_device(&comm.device())?;
            let red = maybe_pad_and_reduce(&x, None, &comm)?.to_vec::<f32>()?;
            let gat = maybe_all_gather_and_maybe_unpad(&x, None, &comm)?;
            assert_eq!(gat.shape(), &[rows * ep, h]);
            let bad = Tensor::from_slice(&[0f32; 10], &[5, 2])?.to_device(&comm.device())?;
            let e = maybe_pad_and_reduce(&bad, None, &comm).unwrap_err().to_string();
            assert!(e.contains("`x`") && e.contains('5') && e.contains('4'), "{e}");
            Ok(red)
        })
        .unwrap();
    let data: Vec<Vec<f32>> = (0..ep).map(|q| rank_data(7, q, rows, h)).collect();
    for (r, out) in outs.iter().enumerate() {
        let q = rows / ep;
        let want: Vec<f64> = (r * q * h..(r + 1) * q * h).map(|i| data.iter().map(|d| d[i] as f64).sum()).collect();
        let mag: Vec<f64> =
            (r * q * h..(r + 1) * q * h).map(|i| data.iter().map(|d| (d[i] as f64).abs()).sum()).collect();
        let got: Vec<f64> = out.iter().map(|v| *v as f64).collect();
        assert_within_rounding("reduce_scatter", DType::F32, &got, &want, &mag);
    }
});

backend_test!(layout_that_does_not_match_the_group_is_refused_on_every_rank, |on: On| {
    let l = SpLayout::new(&[2, 2, 2]).unwrap();
    let errs = on
        .run(4, &opts(), |r, comm| {
            let dev = comm.device();
            let x = Tensor::from_slice(&[0f32; 12], &[6, 2])?.to_device(&dev)?;
            let e1 = maybe_pad_and_reduce(&x, Some(&l), &comm).unwrap_err().to_string();
            let y = Tensor::from_slice(&[0f32; 4], &[2, 2])?.to_device(&dev)?;
            let e2 = maybe_all_gather_and_maybe_unpad(&y, Some(&l), &comm).unwrap_err().to_string();
            let good = SpLayout::new(&[2, 2, 2, 1]).unwrap();
            let e3 = maybe_pad_and_reduce(&x, Some(&good), &comm).unwrap_err().to_string();
            let wrong = Tensor::from_slice(&[0f32; 6], &[3, 2])?.to_device(&dev)?;
            let e4 = maybe_all_gather_and_maybe_unpad(&wrong, Some(&good), &comm).unwrap_err().to_string();
            let _ = r;
            Ok([e1, e2, e3, e4])
        })
        .unwrap();
    for [e1, e2, e3, e4] in errs {
        assert!(e1.contains("`layout`") && e1.contains("3 entries") && e1.contains("(4)"), "{e1}");
        assert!(e2.contains("`layout`"), "{e2}");
        assert!(e3.contains("`x`") && e3.contains("6 rows") && e3.contains('7'), "{e3}");
        assert!(e4.contains("`x`") && e4.contains("[3, 2]"), "{e4}");
    }
});

/// Finalize inputs of one rank: `n` gathered tokens, drop-less row layout.
struct RankFinalize {
    x: Tensor,
    idx: Tensor,
    scales: Tensor,
    x1: Tensor,
}

fn rank_finalize(seed: u64, r: usize, n: usize, k: usize, h: usize, dtype: DType) -> RankFinalize {
    let mut rng = Rng::new(seed * 977 + r as u64);
    let x = random(&mut rng, &[n * k, h], dtype);
    let mut p: Vec<i32> = (0..(n * k) as i32).collect();
    rng.shuffle(&mut p);
    RankFinalize {
        x,
        idx: i32_tensor(&p, &[n * k]),
        scales: random(&mut rng, &[n, k], DType::F32),
        x1: random(&mut rng, &[n, h], dtype),
    }
}

impl RankFinalize {
    /// The same inputs on `dev`.
    fn on(self, dev: &ascend_moe::Device) -> ascend_moe::Result<RankFinalize> {
        Ok(RankFinalize {
            x: self.x.to_device(dev)?,
            idx: self.idx.to_device(dev)?,
            scales: self.scales.to_device(dev)?,
            x1: self.x1.to_device(dev)?,
        })
    }

    fn args(&self) -> FinalizeArgs<&Tensor> {
        FinalizeArgs::new(&self.x, &self.idx, DropPadMode::DropLessRow).with_x1(&self.x1).with_scales(&self.scales)
    }
}

/// SPEC section 1 in f64 for `f` (mode 2: `R(i, k) = idx[i * K + k]`, x1,
/// scales): `out[i] = x1[i] + sum_k s(i, k) * x[R(i, k)]`, and the sum of the
/// terms' magnitudes (for the tolerance).
fn finalize_reference(f: &RankFinalize, n: usize, k: usize, h: usize) -> (Vec<f64>, Vec<f64>) {
    let (x, x1, s) = (to_f64(&f.x), to_f64(&f.x1), to_f64(&f.scales));
    let idx = f.idx.to_vec::<i32>().unwrap();
    let (mut out, mut mag) = (x1.clone(), x1.iter().map(|v| v.abs()).collect::<Vec<f64>>());
    for i in 0..n {
        for kk in 0..k {
            let row = idx[i * k + kk] as usize;
            for j in 0..h {
                let term = s[i * k + kk] * x[row * h + j];
                out[i * h + j] += term;
                mag[i * h + j] += term.abs();
            }
        }
    }
    (out, mag)
}

backend_test!(finalize_and_reduce_equals_finalize_then_pad_and_reduce, |on: On| {
    let (k, h) = (2, 6);
    for dtype in [DType::F32, DType::BF16] {
        for (li, l) in layouts().into_iter().enumerate() {
            let ep = l.ep_size();
            if !on.fits(ep) {
                continue;
            }
            let seed = 400 + li as u64;
            let n = l.total_rows();
            let outs = on
                .run(ep, &opts(), |r, comm| {
                    let f = rank_finalize(seed, r, n, k, h, dtype).on(&comm.device())?;
                    let fused = finalize_and_reduce(&f.args(), Some(&l), &comm)?;
                    assert_eq!(fused.shape(), finalize_and_reduce_output_shape(&f.args(), Some(&l), r, ep)?.as_slice());
                    assert_eq!(fused.shape(), &[l.local_size(r), h]);
                    let two_step = maybe_pad_and_reduce(&moe_finalize_routing(&f.args())?, Some(&l), &comm)?;
                    // The CPU communicator reduces in rank order, so the two
                    // paths agree bit for bit; HCCL promises no reduction
                    // order, so on the NPU each is checked against the
                    // reference below instead.
                    if on == On::Cpu {
                        assert!(bits(&fused) == bits(&two_step), "layout {:?} rank {r} {dtype}", l.local_sizes());
                    }
                    Ok([to_f64(&fused), to_f64(&two_step)])
                })
                .unwrap();
            // An independent reference: SPEC section 1 (mode 2, row layout) per
            // rank in f64, then section 4 (the sum of every rank's rows, the
            // local shard kept).
            let fin: Vec<(Vec<f64>, Vec<f64>)> =
                (0..ep).map(|q| finalize_reference(&rank_finalize(seed, q, n, k, h, dtype), n, k, h)).collect();
            for (r, [fused, two_step]) in outs.iter().enumerate() {
                let rows = (l.offset(r) * h)..((l.offset(r) + l.local_size(r)) * h);
                let want: Vec<f64> = rows.clone().map(|e| fin.iter().map(|(v, _)| v[e]).sum()).collect();
                // One rounding to `dtype` per rank's finalize and per partial sum.
                let mag: Vec<f64> = rows.map(|e| fin.iter().map(|(_, m)| m[e]).sum()).collect();
                for (what, got) in [("fused", fused), ("two-step", two_step)] {
                    let what = format!("{what} layout {:?} rank {r} {dtype}", l.local_sizes());
                    assert_within_rounding(&what, dtype, got, &want, &mag);
                }
            }
        }
    }
    // Without a layout (rows divide by EP): a plain reduce-scatter of the
    // finalize outputs, rank r keeping rows [2r, 2r + 2).
    let outs = on
        .run(4, &opts(), |_, comm| {
            let f = rank_finalize(5, comm.rank(), 8, k, h, DType::BF16).on(&comm.device())?;
            let fused = finalize_and_reduce(&f.args(), None, &comm)?;
            let two_step = maybe_pad_and_reduce(&moe_finalize_routing(&f.args())?, None, &comm)?;
            if on == On::Cpu {
                assert!(bits(&fused) == bits(&two_step));
            }
            Ok([to_f64(&fused), to_f64(&two_step)])
        })
        .unwrap();
    let fin: Vec<(Vec<f64>, Vec<f64>)> =
        (0..4).map(|q| finalize_reference(&rank_finalize(5, q, 8, k, h, DType::BF16), 8, k, h)).collect();
    for (r, [fused, two_step]) in outs.iter().enumerate() {
        let rows = (2 * r * h)..((2 * r + 2) * h);
        let want: Vec<f64> = rows.clone().map(|e| fin.iter().map(|(v, _)| v[e]).sum()).collect();
        let mag: Vec<f64> = rows.map(|e| fin.iter().map(|(_, m)| m[e]).sum()).collect();
        for (what, got) in [("fused", fused), ("two-step", two_step)] {
            assert_within_rounding(&format!("{what} without layout rank {r}"), DType::BF16, got, &want, &mag);
        }
    }
});

/// Staging small enough that the fused finalize-and-reduce on a CPU
/// communicator takes several rounds per call, and, for wide rows, does not fit
/// a staging region at all (then it finalizes into a buffer and
/// reduce-scatters its blocks). Both must give the two-step result bit for
/// bit, for every dtype and uneven layout.
#[test]
fn finalize_and_reduce_in_staging_rounds_and_for_rows_too_wide_for_staging() {
    let small = CpuCommConfig { staging_bytes: 4096 };
    let k = 3;
    let cases: [&[usize]; 4] = [&[30, 17, 0, 25], &[9, 0], &[1, 40, 2], &[13, 13, 13, 13, 13, 13, 13, 12]];
    for (ci, sizes) in cases.iter().enumerate() {
        let l = SpLayout::new(sizes).unwrap();
        let ep = l.ep_size();
        let n = l.total_rows();
        let region = (small.effective_staging() / ep) / 64 * 64;
        // h = 40: a few rows per region (several rounds); the wide h: no row fits.
        let wide = region / 2 + 1;
        for h in [40, wide] {
            for dtype in [DType::F32, DType::F16, DType::BF16] {
                let per_region = region / (h * dtype.size());
                assert_eq!(per_region == 0, h == wide || dtype == DType::F32 && h * 4 > region);
                run_ranks_with(ep, &opts(), &small, |r, comm| {
                    let Comm::Cpu(cpu) = &comm else { panic!("run_ranks gives CPU communicators") };
                    assert_eq!(cpu.rows_per_region(h, dtype), per_region);
                    let f = rank_finalize(700 + ci as u64, r, n, k, h, dtype);
                    let fused = finalize_and_reduce(&f.args(), Some(&l), &comm)?;
                    let two_step = maybe_pad_and_reduce(&moe_finalize_routing(&f.args())?, Some(&l), &comm)?;
                    assert_eq!(fused.shape(), &[l.local_size(r), h]);
                    assert!(bits(&fused) == bits(&two_step), "{sizes:?} h {h} {dtype} rank {r}");
                    Ok(())
                })
                .unwrap();
            }
        }
    }
}

/// With the default staging, a block of more rows than one round of the
/// fused finalize-and-reduce stages (rounds are capped below a whole staging
/// region) takes several rounds, its last one partial, while other blocks
/// end earlier or are empty: bit for bit the two-step result, every dtype.
#[test]
fn finalize_and_reduce_in_capped_rounds_of_the_default_staging() {
    let sizes = [100, 7, 0, 50];
    let l = SpLayout::new(&sizes).unwrap();
    let (n, k, h) = (l.total_rows(), 2, 2000);
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        run_ranks(l.ep_size(), &opts(), |r, comm| {
            let Comm::Cpu(cpu) = &comm else { panic!("run_ranks gives CPU communicators") };
            // A whole region holds every block: only the cap makes rounds.
            assert!(cpu.rows_per_region(h, dtype) > sizes[0], "{dtype}");
            let f = rank_finalize(900, r, n, k, h, dtype);
            let fused = finalize_and_reduce(&f.args(), Some(&l), &comm)?;
            let two_step = maybe_pad_and_reduce(&moe_finalize_routing(&f.args())?, Some(&l), &comm)?;
            assert_eq!(fused.shape(), &[l.local_size(r), h]);
            assert!(bits(&fused) == bits(&two_step), "{dtype} rank {r}");
            Ok(())
        })
        .unwrap();
    }
}

/// An out-of-range index on one rank fails the fused finalize-and-reduce on
/// every rank at once (the finalize runs inside the collective), with the
/// offending rank and argument named, well before the group's timeout.
#[test]
fn finalize_and_reduce_bad_index_on_one_rank_fails_every_rank_fast() {
    let l = SpLayout::new(&[3, 5, 2, 4]).unwrap();
    let (n, k, h) = (l.total_rows(), 2, 8);
    let timeout = std::time::Duration::from_secs(60);
    let start = std::time::Instant::now();
    let errs = run_ranks(4, &CommOptions::with_timeout(timeout), |r, comm| {
        let mut f = rank_finalize(31, r, n, k, h, DType::BF16);
        if r == 2 {
            let mut idx = f.idx.to_vec::<i32>()?;
            idx[5] = (n * k) as i32 + 7;
            f.idx = i32_tensor(&idx, &[n * k]);
        }
        Ok(finalize_and_reduce(&f.args(), Some(&l), &comm).unwrap_err().to_string())
    })
    .unwrap();
    assert!(start.elapsed() < timeout / 4, "took {:?}", start.elapsed());
    for (r, e) in errs.iter().enumerate() {
        assert!(e.contains("expanded_row_idx"), "rank {r}: {e}");
        if r != 2 {
            assert!(e.contains("rank 2"), "rank {r} must name the failing rank: {e}");
        }
    }
}

/// The same on the two-step path (rows too wide for a staging
/// region): the rank whose finalize refuses its input still joins the
/// reduce-scatter with its reason, so its peers fail at once naming it
/// instead of waiting for it until the group's timeout.
#[test]
fn finalize_and_reduce_bad_index_on_one_rank_fails_every_rank_fast_in_the_two_step_path() {
    let small = CpuCommConfig { staging_bytes: 4096 };
    let l = SpLayout::new(&[3, 5, 2, 4]).unwrap();
    let (n, k) = (l.total_rows(), 2);
    let h = small.effective_staging() / l.ep_size() + 1;
    let timeout = std::time::Duration::from_secs(30);
    let start = std::time::Instant::now();
    let errs = run_ranks_with(4, &CommOptions::with_timeout(timeout), &small, |r, comm| {
        let Comm::Cpu(cpu) = &comm else { panic!("run_ranks gives CPU communicators") };
        assert_eq!(cpu.rows_per_region(h, DType::F32), 0, "the two-step path");
        let mut f = rank_finalize(32, r, n, k, h, DType::F32);
        if r == 1 {
            let mut idx = f.idx.to_vec::<i32>()?;
            idx[3] = (n * k) as i32;
            f.idx = i32_tensor(&idx, &[n * k]);
        }
        Ok(finalize_and_reduce(&f.args(), Some(&l), &comm).expect_err("rank 1's index is out of range"))
    })
    .unwrap();
    assert!(start.elapsed() < timeout / 4, "took {:?}", start.elapsed());
    for (r, e) in errs.iter().enumerate() {
        let s = e.to_string();
        assert!(s.contains("expanded_row_idx"), "rank {r}: {s}");
        assert!(s.contains(&format!("{}", n * k)), "rank {r} names the value: {s}");
        if r != 1 {
            assert!(s.contains("rank 1"), "rank {r} must name the failing rank: {s}");
            let kind = match e {
                ascend_moe::Error::Comm { kind, .. } => Some(*kind),
                _ => None,
            };
            assert_eq!(kind, Some(ascend_moe::CommErrorKind::Mismatch), "rank {r}: {s}");
        }
    }
}

/// Runs `call(rank, comm, into)` on 3 CPU ranks (staging `staging`), allocating
/// (`into` false) and into `out`, where rank 2's arguments do not fit the
/// layout (a row too many in its input, or in its `out`): every rank must
/// fail before a quarter of the timeout, naming the argument (`x` or
/// `out`), and the peers naming rank 2.
fn rank_2_fails_every_rank_fast(
    what: &str,
    staging: CpuCommConfig,
    call: impl Fn(usize, &Comm, bool) -> ascend_moe::Result<()> + Sync,
) {
    let timeout = std::time::Duration::from_secs(30);
    for into in [false, true] {
        let start = std::time::Instant::now();
        let errs = run_ranks_with(3, &CommOptions::with_timeout(timeout), &staging, |r, comm| {
            Ok(call(r, &comm, into).expect_err("rank 2's arguments do not fit the layout"))
        })
        .unwrap();
        let what = format!("{what} into {into}");
        assert!(start.elapsed() < timeout / 4, "{what}: took {:?}", start.elapsed());
        let arg = if into { "out" } else { "x" };
        for (r, e) in errs.iter().enumerate() {
            let s = e.to_string();
            assert!(s.contains(&format!("`{arg}`")), "{what} rank {r} names `{arg}`: {s}");
            if r != 2 {
                assert!(s.contains("rank 2"), "{what} rank {r} must name rank 2: {s}");
            }
        }
    }
}

/// A rank whose arguments fail the op's own checks (its finalize has a row
/// more than the layout gives it, or its `out` has the wrong shape) still
/// joins the reduce-scatter its peers are in, so every rank fails at once
/// naming that rank and the argument: on the fused path and on the padded
/// two-step one, allocating and into `out`.
#[test]
fn finalize_and_reduce_shape_error_on_one_rank_fails_every_rank_fast() {
    let l = SpLayout::new(&[2, 3, 1]).unwrap();
    let (n, k) = (l.total_rows(), 2);
    for (staging, h) in [(CpuCommConfig::default(), 8), (CpuCommConfig { staging_bytes: 4096 }, 4096 / 3 + 1)] {
        rank_2_fails_every_rank_fast(&format!("staging {}", staging.staging_bytes), staging, |r, comm, into| {
            let extra = usize::from(r == 2);
            let f = rank_finalize(34, r, if into { n } else { n + extra }, k, h, DType::F32);
            if into {
                let mut out = Tensor::zeros_cpu(&[l.local_size(r) + extra, h], DType::F32);
                finalize_and_reduce_into(&f.args(), Some(&l), comm, &mut out)
            } else {
                finalize_and_reduce(&f.args(), Some(&l), comm).map(drop)
            }
        });
    }
}

/// The same for the two SP ops: a rank whose `x` does not fit the layout
/// (allocating form) or whose `out` has a row too many (into form) still
/// joins the reduce-scatter or all-gather its peers are in, so every rank
/// fails at once naming that rank and the argument.
/// Also when no rank has a row: a CPU group joins the collective all the
/// same, so rank 2 does not fail alone while its peers return.
#[test]
fn sp_op_shape_error_on_one_rank_fails_every_rank_fast() {
    let h = 4;
    for (l, reduce) in [[2, 3, 1], [0, 0, 0]].iter().flat_map(|s| [true, false].map(|r| (SpLayout::new(s).unwrap(), r)))
    {
        let what = format!("layout {:?} reduce {reduce}", l.local_sizes());
        rank_2_fails_every_rank_fast(&what, CpuCommConfig::default(), |r, comm, into| {
            let extra = usize::from(r == 2);
            let (rows_in, rows_out) =
                if reduce { (l.total_rows(), l.local_size(r)) } else { (l.local_size(r), l.total_rows()) };
            let x = Tensor::zeros_cpu(&[rows_in + if into { 0 } else { extra }, h], DType::F32);
            match (reduce, into) {
                (true, false) => maybe_pad_and_reduce(&x, Some(&l), comm).map(drop),
                (false, false) => maybe_all_gather_and_maybe_unpad(&x, Some(&l), comm).map(drop),
                (_, true) => {
                    let mut out = Tensor::zeros_cpu(&[rows_out + extra, h], DType::F32);
                    if reduce {
                        maybe_pad_and_reduce_into(&x, Some(&l), comm, &mut out)
                    } else {
                        maybe_all_gather_and_maybe_unpad_into(&x, Some(&l), comm, &mut out)
                    }
                }
            }
        });
    }
}

/// Ranks whose layouts disagree (one rank holding a stale token count):
/// rank 2 passes [1, 3, 2] where its peers pass [2, 3, 1], the same `M`, so
/// a padded reduce-scatter or all-gather would move equal counts and return
/// misaligned rows on every rank; or rank 2 passes [0, 0, 0] where its peers
/// pass [1, 0, 0], so it would move nothing and return while they wait for
/// it. Each op fails on every rank, at once, naming both lists of counts.
#[test]
fn sp_ops_of_ranks_whose_layouts_disagree_fail_on_every_rank_naming_the_counts() {
    let h = 4;
    let cases: [(&[usize], &[usize], &str, &str); 2] = [
        (&[2, 3, 1], &[1, 3, 2], "counts [8, 12, 4]", "counts [4, 12, 8]"),
        (&[1, 0, 0], &[0, 0, 0], "counts [4, 0, 0]", "counts [0, 0, 0]"),
    ];
    for ((peers, odd, peers_counts, odd_counts), reduce) in cases.iter().flat_map(|c| [true, false].map(|r| (c, r))) {
        let layout = |r: usize| SpLayout::new(if r == 2 { odd } else { peers }).unwrap();
        let start = std::time::Instant::now();
        let got = run_ranks(3, &opts(), |r, comm| {
            let l = layout(r);
            let rows = if reduce { l.total_rows() } else { l.local_size(r) };
            let x = Tensor::zeros_cpu(&[rows, h], DType::F32);
            let res = if reduce {
                maybe_pad_and_reduce(&x, Some(&l), &comm)
            } else {
                maybe_all_gather_and_maybe_unpad(&x, Some(&l), &comm)
            };
            Ok(res.map(drop).map_err(|e| e.to_string()))
        })
        .unwrap();
        for (r, res) in got.into_iter().enumerate() {
            let e = res.expect_err(&format!("reduce {reduce}: rank {r} must fail"));
            assert!(e.contains("ranks disagree"), "reduce {reduce}: rank {r}: {e}");
            assert!(e.contains(peers_counts) && e.contains(odd_counts), "reduce {reduce}: rank {r}: {e}");
        }
        assert!(start.elapsed() < opts().timeout / 4, "{odd:?}, reduce {reduce}: took {:?}", start.elapsed());
    }
}

/// The fused finalize-and-reduce of ranks whose layouts disagree in all but
/// `M` (rank 1 passes [3, 1] where rank 0 passes [3, 3]): a padded
/// reduce-scatter would move equal counts and return a shard of another
/// shape on each rank. It fails on every rank, at once, naming both ranks'
/// counts, on the staged path and on the two-step one of rows too wide for
/// a staging region.
#[test]
fn finalize_and_reduce_of_ranks_whose_layouts_share_only_m_fails_on_every_rank() {
    let small = CpuCommConfig { staging_bytes: 4096 };
    let k = 2;
    for (staging, h) in [(CpuCommConfig::default(), 4), (small, small.effective_staging() / 2 + 1)] {
        let start = std::time::Instant::now();
        let got = run_ranks_with(2, &opts(), &staging, |r, comm| {
            let Comm::Cpu(cpu) = &comm else { panic!("run_ranks gives CPU communicators") };
            let staged = cpu.stages_rows(h, DType::F32);
            let l = SpLayout::new(if r == 1 { &[3, 1] } else { &[3, 3] }).unwrap();
            let f = rank_finalize(42, r, l.total_rows(), k, h, DType::F32);
            let res = finalize_and_reduce(&f.args(), Some(&l), &comm);
            Ok((staged, res.map(|t| t.shape().to_vec()).map_err(|e| e.to_string())))
        })
        .unwrap();
        let what = format!("staging {} h {h}", staging.staging_bytes);
        assert_eq!(got[0].0, h == 4, "{what}: which path");
        let (peers, odd) = (format!("counts [{}, {}]", 3 * h, 3 * h), format!("counts [{}, {}]", 3 * h, h));
        for (r, (_, res)) in got.into_iter().enumerate() {
            let e = res.expect_err(&format!("{what}: rank {r} must fail"));
            assert!(e.contains("ranks disagree") && e.contains(&peers) && e.contains(&odd), "{what}: rank {r}: {e}");
        }
        assert!(start.elapsed() < opts().timeout / 4, "{what}: took {:?}", start.elapsed());
    }
}

/// With empty rows (H = 0) nothing is reduced, yet the inputs are still
/// checked: an out-of-range index on one rank fails that rank and every
/// peer (naming it), in a world of one as in a world of three.
#[test]
fn finalize_and_reduce_of_empty_rows_still_refuses_a_bad_index_on_every_rank() {
    for sizes in [&[4usize][..], &[3, 0, 2]] {
        let l = SpLayout::new(sizes).unwrap();
        let (ep, n, k, h) = (l.ep_size(), l.total_rows(), 2, 0);
        let bad = ep - 1;
        let timeout = std::time::Duration::from_secs(30);
        let start = std::time::Instant::now();
        let errs = run_ranks(ep, &CommOptions::with_timeout(timeout), |r, comm| {
            let mut f = rank_finalize(33, r, n, k, h, DType::F32);
            if r == bad {
                let mut idx = f.idx.to_vec::<i32>()?;
                idx[1] = -1;
                f.idx = i32_tensor(&idx, &[n * k]);
            }
            Ok(finalize_and_reduce(&f.args(), Some(&l), &comm).expect_err("an index is out of range"))
        })
        .unwrap();
        assert!(start.elapsed() < timeout / 4, "{sizes:?} took {:?}", start.elapsed());
        for (r, e) in errs.iter().enumerate() {
            let s = e.to_string();
            assert!(s.contains("expanded_row_idx") && s.contains("-1"), "{sizes:?} rank {r}: {s}");
            if r != bad {
                assert!(s.contains(&format!("rank {bad}")), "{sizes:?} rank {r} must name rank {bad}: {s}");
            }
        }
    }
}

/// One rank fusing while its peer runs the two-step path is a mismatched
/// collective, reported on both ranks (on the CPU the two-step path with a
/// layout reduce-scatters the blocks as they are, `reduce_scatter_v`).
#[test]
fn finalize_and_reduce_against_a_peer_in_the_two_step_path_is_a_mismatch() {
    let l = SpLayout::new(&[4, 4]).unwrap();
    let errs = run_ranks(2, &opts(), |r, comm| {
        let f = rank_finalize(41, r, 8, 2, 16, DType::F32);
        let res = if r == 0 {
            finalize_and_reduce(&f.args(), Some(&l), &comm)
        } else {
            maybe_pad_and_reduce(&moe_finalize_routing(&f.args())?, Some(&l), &comm)
        };
        Ok(res.unwrap_err().to_string())
    })
    .unwrap();
    for e in &errs {
        assert!(e.contains("reduce_scatter_rows") && e.contains("reduce_scatter_v "), "{e}");
    }
}

// The draft-model regression: the EP/SP finalize of a draft (MTP) model of a
// vision-language MoE on DP=2 TP=2 EP=4 with SP and 4096 gathered tokens
// returns `local_sizes[rank]` rows, the fully reduced shard, never the 4096
// rows of the global layout.
backend_test!(draft_model_finalize_returns_the_local_shard, |on: On| {
    let (tp, k, h) = (2, 2, 16);
    for dp_tokens in [[2048usize, 2048], [3000, 1096]] {
        let l = SpLayout::from_dp_tokens(&dp_tokens, tp).unwrap();
        assert_eq!(l.total_rows(), 4096);
        let n = 4096;
        let outs = on
            .run(4, &opts(), |r, comm| {
                let f = rank_finalize(9, r, n, k, h, DType::BF16).on(&comm.device())?;
                let meta = finalize_and_reduce_output_shape(&f.args(), Some(&l), r, 4)?;
                let fused = finalize_and_reduce(&f.args(), Some(&l), &comm)?;
                let unfused = maybe_pad_and_reduce(&moe_finalize_routing(&f.args())?, Some(&l), &comm)?;
                assert_eq!(meta, vec![l.local_sizes()[r], h]);
                assert_eq!(fused.shape(), meta.as_slice());
                assert_eq!(unfused.shape(), meta.as_slice());
                Ok(to_f64(&fused))
            })
            .unwrap();
        // Naive: every rank's finalize in f64, summed over ranks, this
        // rank's rows; the magnitudes are every rank's terms'.
        let (mut want_all, mut mag_all) = (vec![0f64; n * h], vec![0f64; n * h]);
        for q in 0..4 {
            let f = rank_finalize(9, q, n, k, h, DType::BF16);
            let (x, idx, s, x1) = (to_f64(&f.x), f.idx.to_vec::<i32>().unwrap(), to_f64(&f.scales), to_f64(&f.x1));
            for e in 0..n * h {
                let (i, j) = (e / h, e % h);
                let terms = (0..k).map(|kk| s[i * k + kk] * x[idx[i * k + kk] as usize * h + j]);
                want_all[e] += x1[e] + terms.clone().sum::<f64>();
                mag_all[e] += x1[e].abs() + terms.map(f64::abs).sum::<f64>();
            }
        }
        for (r, out) in outs.iter().enumerate() {
            let (off, rows) = (l.offset(r), l.local_size(r));
            assert_eq!(out.len(), rows * h);
            let e = off * h..(off + rows) * h;
            let what = format!("draft rank {r} {dp_tokens:?}");
            assert_within_rounding(&what, DType::BF16, out, &want_all[e.clone()], &mag_all[e]);
        }
    }
});

/// A tensor of `shape` full of NaN bits on `comm`'s device: an `out` whose
/// every element the op must overwrite.
fn garbage_out(shape: &[usize], dtype: DType, comm: &Comm) -> ascend_moe::Result<Tensor> {
    let n: usize = shape.iter().product();
    from_f32(&vec![f32::NAN; n], shape, dtype).to_device(&comm.device())
}

/// Checks a reduced `[rows, h]` block against the f64 sum over `ranks` of
/// their `rank_data(seed, q, total, h)` rounded to `dtype`, rows from `first`.
#[allow(clippy::too_many_arguments)]
fn expect_sum_of_ranks(
    what: &str,
    got: &Tensor,
    seed: u64,
    ranks: usize,
    total: usize,
    h: usize,
    first: usize,
    dtype: DType,
) {
    let data: Vec<Vec<f64>> =
        (0..ranks).map(|q| to_f64(&from_f32(&rank_data(seed, q, total, h), &[total, h], dtype))).collect();
    let elems = (first * h)..(first * h + got.numel());
    let want: Vec<f64> = elems.clone().map(|e| data.iter().map(|d| d[e]).sum()).collect();
    // One rounding to `dtype` per partial sum, whatever the order.
    let mag: Vec<f64> = elems.map(|e| data.iter().map(|d| d[e].abs()).sum()).collect();
    assert_within_rounding(what, dtype, &to_f64(got), &want, &mag);
}

// The `_into` variants write what the allocating ops return: bit for bit on
// the CPU communicator (rank-order reductions) and for the gathers (data
// movement); the NPU's reductions, whose order HCCL does not promise, are
// each checked against an f64 reference instead.
backend_test!(into_variants_equal_the_allocating_ops, |on: On| {
    let h = 4;
    let fitting = layouts().into_iter().enumerate().filter(|(_, l)| on.fits(l.ep_size()));
    for (li, l) in fitting {
        on.run(l.ep_size(), &opts(), |r, comm| {
            let (dev, seed, total, mine) = (comm.device(), 600 + li as u64, l.total_rows(), l.local_size(r));
            for dtype in [DType::F32, DType::BF16] {
                let x = from_f32(&rank_data(seed, r, total, h), &[total, h], dtype).to_device(&dev)?;
                let want = maybe_pad_and_reduce(&x, Some(&l), &comm)?;
                let mut out = garbage_out(want.shape(), dtype, &comm)?;
                maybe_pad_and_reduce_into(&x, Some(&l), &comm, &mut out)?;
                let what = format!("pad_and_reduce layout {:?} rank {r} {dtype}", l.local_sizes());
                if on == On::Cpu {
                    assert!(bits(&out) == bits(&want), "{what}");
                }
                for (which, t) in [("into", &out), ("allocating", &want)] {
                    let what = format!("{what} {which}");
                    expect_sum_of_ranks(&what, t, seed, l.ep_size(), total, h, l.offset(r), dtype);
                }

                let x = from_f32(&rank_data(seed + 1, r, mine, h), &[mine, h], dtype).to_device(&dev)?;
                let want = maybe_all_gather_and_maybe_unpad(&x, Some(&l), &comm)?;
                let mut out = garbage_out(want.shape(), dtype, &comm)?;
                maybe_all_gather_and_maybe_unpad_into(&x, Some(&l), &comm, &mut out)?;
                assert!(bits(&out) == bits(&want), "gather_unpad layout {:?} rank {r} {dtype}", l.local_sizes());
            }
            Ok(())
        })
        .unwrap();
    }
    // Without a layout (a plain reduce-scatter and all-gather), also on one rank.
    for ep in [1, 4] {
        on.run(ep, &opts(), |r, comm| {
            let x = Tensor::from_slice(&rank_data(9, r, 8, h), &[8, h])?.to_device(&comm.device())?;
            let want = maybe_pad_and_reduce(&x, None, &comm)?;
            let mut out = garbage_out(want.shape(), DType::F32, &comm)?;
            maybe_pad_and_reduce_into(&x, None, &comm, &mut out)?;
            if on == On::Cpu {
                assert!(bits(&out) == bits(&want), "pad_and_reduce without layout, EP {ep}");
            }
            for (which, t) in [("into", &out), ("allocating", &want)] {
                let what = format!("pad_and_reduce without layout, EP {ep} {which}");
                expect_sum_of_ranks(&what, t, 9, ep, 8, h, r * 8 / ep, DType::F32);
            }
            let want = maybe_all_gather_and_maybe_unpad(&x, None, &comm)?;
            let mut out = garbage_out(want.shape(), DType::F32, &comm)?;
            maybe_all_gather_and_maybe_unpad_into(&x, None, &comm, &mut out)?;
            assert!(bits(&out) == bits(&want), "gather_unpad without layout, EP {ep}");
            Ok(())
        })
        .unwrap();
    }
});

#[test]
fn into_variants_refuse_an_out_of_the_wrong_shape_or_dtype_naming_out() {
    let l = SpLayout::new(&[3, 1]).unwrap();
    let errs = run_ranks(2, &opts(), |r, comm| {
        let x = Tensor::from_slice(&rank_data(3, r, 4, 2), &[4, 2])?;
        let mut wrong_rows = Tensor::zeros_cpu(&[l.local_size(r) + 1, 2], DType::F32);
        let mut wrong_dtype = Tensor::zeros_cpu(&[l.local_size(r), 2], DType::BF16);
        let a = maybe_pad_and_reduce_into(&x, Some(&l), &comm, &mut wrong_rows).unwrap_err().to_string();
        let b = maybe_pad_and_reduce_into(&x, Some(&l), &comm, &mut wrong_dtype).unwrap_err().to_string();
        let mine = l.local_size(r);
        let y = Tensor::from_slice(&rank_data(4, r, mine, 2), &[mine, 2])?;
        let mut wrong_rows = Tensor::zeros_cpu(&[3, 2], DType::F32);
        let mut wrong_dtype = Tensor::zeros_cpu(&[4, 2], DType::F16);
        let c = maybe_all_gather_and_maybe_unpad_into(&y, Some(&l), &comm, &mut wrong_rows).unwrap_err().to_string();
        let d = maybe_all_gather_and_maybe_unpad_into(&y, Some(&l), &comm, &mut wrong_dtype).unwrap_err().to_string();
        Ok([a, b, c, d])
    })
    .unwrap();
    for (r, es) in errs.iter().enumerate() {
        for (i, e) in es.iter().enumerate() {
            assert!(e.contains("`out`"), "rank {r} case {i}: {e}");
            let op = if i < 2 { "maybe_pad_and_reduce" } else { "maybe_all_gather_and_maybe_unpad" };
            assert!(e.contains(op), "rank {r} case {i}: {e}");
        }
        assert!(es[0].contains(&format!("[{}, 2]", l.local_size(r))), "{}", es[0]);
        assert!(es[1].contains("f32") || es[1].contains("F32"), "{}", es[1]);
    }
}

// With H = 0 there is no output element, yet a bad index is reported, by
// the plain finalize and by the fused one, as when there is data: at once
// on the CPU, at the stream's check on an NPU.
backend_test!(an_empty_row_finalize_still_reports_a_bad_index, |on: On| {
    let l = SpLayout::new(&[4]).unwrap();
    let (n, k) = (4, 2);
    on.run(1, &opts(), |r, comm| {
        let mut f = rank_finalize(35, r, n, k, 0, DType::F32);
        let mut idx = f.idx.to_vec::<i32>()?;
        idx[5] = (n * k) as i32;
        f.idx = i32_tensor(&idx, &[n * k]);
        let f = f.on(&comm.device())?;
        let check = || match comm.device() {
            ascend_moe::Device::Npu(d) => d.check(),
            ascend_moe::Device::Cpu => Ok(()),
        };
        let plain = moe_finalize_routing(&f.args()).map(drop);
        let plain = plain.and_then(|_| check());
        let fused = finalize_and_reduce(&f.args(), Some(&l), &comm).map(drop);
        let fused = fused.and_then(|_| check());
        for (what, res) in [("plain", plain), ("fused", fused)] {
            match res {
                Err(ascend_moe::Error::IndexOutOfRange { arg, position, value, .. }) => {
                    assert_eq!((arg, position, value), ("expanded_row_idx", 5, 8), "{what}")
                }
                other => panic!("{what}: expected expanded_row_idx[5] = 8 out of range, got {other:?}"),
            }
        }
        Ok(())
    })
    .unwrap();
});

/// The SP layout check on CPU ranks: agreeing ranks pass, and ranks whose
/// layouts differ (equal `M`) all fail at once, naming every rank's
/// fingerprint.
#[test]
fn the_sp_layout_check_fails_every_rank_whose_layout_differs() {
    let res = run_ranks(3, &CommOptions::with_timeout(std::time::Duration::from_secs(20)), |rank, ep| {
        let agreed = SpLayout::new(&[2, 1, 1])?;
        check_sp_layout_agreement(&agreed, &ep)?;
        let mine = SpLayout::new(if rank == 0 { &[2, 1, 1] } else { &[1, 2, 1] })?;
        Ok(check_sp_layout_agreement(&mine, &ep).map_err(|e| e.to_string()))
    })
    .expect("the world starts");
    for (rank, r) in res.iter().enumerate() {
        let e = r.as_ref().expect_err("the layouts differ");
        assert!(e.contains("disagree on the SP layout") && e.contains("rank 2"), "rank {rank}: {e}");
    }
}
