//! Prepare / finalize per comm type and the all_to_all_v dispatch / combine,
//! against properties computed here: finalize(prepare(x)) returns x times the
//! number of ranks that contributed it, and combine(dispatch(x)) with identity
//! experts returns sum_k w_k * x for real tokens, zeros for masked ones. Both
//! run on the CPU communicator and (`npu` cases, ignored without an NPU) on
//! NPUs through HCCL, every world of at most 4 ranks.

mod common;
mod moe_common;

use ascend_moe::moe::prepare_finalize::*;
use ascend_moe::ranks::run_ranks;
use ascend_moe::{Collectives, CommOptions, CommType, Error, Tensor};
use moe_common::*;

fn opts() -> CommOptions {
    CommOptions::with_timeout(std::time::Duration::from_secs(30))
}

/// Small integers, so every sum below is exact in f32.
fn tokens(d: usize, rows: usize, h: usize) -> Vec<f32> {
    (0..rows * h).map(|i| ((i * 7 + d * 13) % 11) as f32 - 5.0).collect()
}

backend_test!(finalize_of_prepare_is_x_times_the_contributing_ranks, |on: On| {
    let h = 3;
    for (dp_tokens, tp) in [(vec![5usize, 2], 2usize), (vec![9, 0], 4), (vec![1, 3], 4), (vec![6], 2), (vec![7, 7], 1)]
    {
        let dp = dp_tokens.len();
        for sp in [false, true] {
            for comm_type in CommType::ALL {
                let world = dp * tp;
                if !on.fits(world) {
                    continue;
                }
                on.run(world, &opts(), |rank, comm| {
                    let (d, t) = (rank / tp, rank % tp);
                    let ctx = MoeContext::new(&dp_tokens, tp, d, t, sp)?;
                    let groups = MoeGroups::from_world(&comm, tp)?;
                    let local = ctx.local_tokens();
                    // This rank's rows: its SP chunk (zero-padded batch) or the whole batch.
                    let batch = tokens(d, dp_tokens[d], h);
                    let first = if sp { t * local } else { 0 };
                    let x: Vec<f32> =
                        (0..local * h).map(|e| batch.get(first * h + e).copied().unwrap_or(0.0)).collect();
                    let xt = Tensor::from_slice(&x, &[local, h])?.to_device(&comm.device())?;
                    let p = prepare(&xt, comm_type, &ctx, &groups)?;
                    assert_eq!(p.hidden.shape(), prepare_output_shape(xt.shape(), comm_type, &ctx)?.as_slice());
                    let want_shape = finalize_output_shape(p.hidden.shape(), comm_type, &ctx)?;
                    let out = finalize(p.hidden, comm_type, &ctx, &groups)?;
                    assert_eq!(out.shape(), want_shape.as_slice());
                    // Reducing paths sum the (identical) prepared copies of every contributor.
                    let factor = match (comm_type, sp) {
                        (CommType::AllGather, true) => world as f32,
                        (CommType::AllGather, false) => dp as f32,
                        _ => 1.0,
                    };
                    let got = out.to_vec::<f32>()?;
                    let want: Vec<f32> = x.iter().map(|v| v * factor).collect();
                    assert_eq!(got, want, "{comm_type:?} sp {sp} tokens {dp_tokens:?} tp {tp} rank {rank}");
                    Ok(())
                })
                .unwrap();
            }
        }
    }
});

/// A tensor of `shape` full of NaN on `device`: an element the op leaves
/// unwritten fails the comparison.
fn nan_out(shape: &[usize], device: &ascend_moe::Device) -> ascend_moe::Result<Tensor> {
    let n: usize = shape.iter().product();
    Tensor::from_slice(&vec![f32::NAN; n], shape)?.to_device(device)
}

fn bits(t: &Tensor) -> ascend_moe::Result<Vec<u32>> {
    Ok(t.to_vec::<f32>()?.iter().map(|v| v.to_bits()).collect())
}

backend_test!(prepare_into_and_finalize_into_equal_the_allocating_ops, |on: On| {
    let h = 3;
    for (dp_tokens, tp) in [(vec![5usize, 2], 2usize), (vec![9, 0], 4), (vec![6], 2), (vec![7, 7], 1)] {
        let dp = dp_tokens.len();
        for sp in [false, true] {
            for comm_type in CommType::ALL {
                let world = dp * tp;
                if !on.fits(world) {
                    continue;
                }
                on.run(world, &opts(), |rank, comm| {
                    let (d, t) = (rank / tp, rank % tp);
                    let ctx = MoeContext::new(&dp_tokens, tp, d, t, sp)?;
                    let groups = MoeGroups::from_world(&comm, tp)?;
                    let dev = comm.device();
                    let local = ctx.local_tokens();
                    let x: Vec<f32> = (0..local * h).map(|i| 0.37 * (i + 11 * rank) as f32 - 1.9).collect();
                    let xt = Tensor::from_slice(&x, &[local, h])?.to_device(&dev)?;
                    let what = format!("{comm_type:?} sp {sp} tokens {dp_tokens:?} tp {tp} rank {rank}");

                    let p = prepare(&xt, comm_type, &ctx, &groups)?;
                    let mut hidden = nan_out(p.hidden.shape(), &dev)?;
                    let mask = prepare_into(&xt, comm_type, &ctx, &groups, &mut hidden)?;
                    assert_eq!(bits(&hidden)?, bits(&p.hidden)?, "prepare_into, {what}");
                    assert_eq!(mask, p.mc2_mask, "prepare_into's mask, {what}");

                    // Routed output that differs per rank and row.
                    let y_host: Vec<f32> =
                        (0..p.hidden.numel()).map(|i| 0.25 * (i % 7) as f32 + 0.5 * rank as f32 - 0.75).collect();
                    let y = Tensor::from_slice(&y_host, p.hidden.shape())?.to_device(&dev)?;
                    let want = finalize(y.try_clone()?, comm_type, &ctx, &groups)?;
                    let mut got = nan_out(want.shape(), &dev)?;
                    finalize_into(&y, comm_type, &ctx, &groups, &mut got)?;
                    assert_eq!(bits(&got)?, bits(&want)?, "finalize_into, {what}");
                    assert_eq!(y.to_vec::<f32>()?, y_host, "finalize_into leaves y unchanged, {what}");
                    Ok(())
                })
                .unwrap();
            }
        }
    }
});

#[test]
fn prepare_into_and_finalize_into_refuse_a_wrong_out() {
    run_ranks(2, &opts(), |rank, comm| {
        let ctx = MoeContext::new(&[4], 2, 0, rank, false)?;
        let groups = MoeGroups::from_world(&comm, 2)?;
        let x = Tensor::from_slice(&[1.0f32; 8], &[4, 2])?;
        for comm_type in CommType::ALL {
            let shape = prepare_output_shape(x.shape(), comm_type, &ctx)?;
            let mut wrong_rows = Tensor::zeros_cpu(&[shape[0] + 1, 2], ascend_moe::DType::F32);
            let e = prepare_into(&x, comm_type, &ctx, &groups, &mut wrong_rows).unwrap_err().to_string();
            assert!(e.contains("`out`"), "{comm_type:?}: {e}");
            let mut wrong_dtype = Tensor::zeros_cpu(&shape, ascend_moe::DType::BF16);
            let e = prepare_into(&x, comm_type, &ctx, &groups, &mut wrong_dtype).unwrap_err().to_string();
            assert!(e.contains("`out`") && e.contains("bf16"), "{comm_type:?}: {e}");
            let y = Tensor::zeros_cpu(&shape, ascend_moe::DType::F32);
            let fshape = finalize_output_shape(y.shape(), comm_type, &ctx)?;
            let mut wrong = Tensor::zeros_cpu(&[fshape[0] + 2, 2], ascend_moe::DType::F32);
            let e = finalize_into(&y, comm_type, &ctx, &groups, &mut wrong).unwrap_err().to_string();
            assert!(e.contains("`out`"), "{comm_type:?}: {e}");
        }
        Ok(())
    })
    .unwrap();
}

backend_test!(dispatch_then_combine_with_identity_experts, |on: On| {
    let (h, k, experts, n) = (4, 3, 8, 6);
    for world in [1, 2, 4] {
        on.run(world, &opts(), |rank, comm| {
            let dev = comm.device();
            let x = tokens(rank, n, h);
            let xt = Tensor::from_slice(&x, &[n, h])?.to_device(&dev)?;
            let mut rng = Rng::new(50 + rank as u64);
            let ids: Vec<i32> = (0..n * k).map(|_| rng.below(experts) as i32).collect();
            let w: Vec<f32> = (0..n * k).map(|i| [0.5f32, 0.25, 2.0][i % 3]).collect();
            let mask: Vec<bool> = (0..n).map(|i| i != 2).collect();
            let d = dispatch(&xt, &ids, k, Some(&mask), experts, &comm)?;
            // Every received row is for an expert this rank owns.
            let per = experts / world;
            assert!(d.experts.iter().all(|e| (*e as usize) / per == rank), "{:?}", d.experts);
            assert_eq!(d.rows.rows(), d.experts.len());
            let wt = Tensor::from_slice(&w, &[n, k])?.to_device(&dev)?;
            let out = combine(&d.rows, &d, &wt, &comm)?.to_vec::<f32>()?;
            for i in 0..n {
                let s: f32 = if mask[i] { w[i * k..(i + 1) * k].iter().sum() } else { 0.0 };
                for j in 0..h {
                    assert_eq!(out[i * h + j], x[i * h + j] * s, "world {world} rank {rank} token {i}");
                }
            }
            // The total received over all ranks is every unmasked slot.
            let mut cnt = Tensor::from_slice(&[d.experts.len() as i64], &[1])?.to_device(&dev)?;
            comm.all_reduce_in_place(&mut cnt, ascend_moe::ReduceOp::Sum)?;
            assert_eq!(cnt.to_vec::<i64>()?[0] as usize, world * (n - 1) * k);
            Ok(())
        })
        .unwrap();
    }
});

#[test]
fn bad_dispatch_and_context_input_is_named() {
    run_ranks(2, &opts(), |rank, comm| {
        let x = Tensor::from_slice(&[0f32; 8], &[2, 4])?;
        match dispatch(&x, &[0, 9], 1, None, 8, &comm) {
            Err(Error::IndexOutOfRange { arg, position, value, .. }) => {
                assert_eq!((arg, position, value), ("topk_ids", 1, 9))
            }
            other => panic!("{other:?}"),
        }
        let e = dispatch(&x, &[0, 1, 2], 1, None, 8, &comm).unwrap_err().to_string();
        assert!(e.contains("`topk_ids`") && e.contains('3'), "{e}");
        let e = dispatch(&x, &[0, 1], 1, None, 3, &comm).unwrap_err().to_string();
        assert!(e.contains("`num_experts`") && e.contains('3') && e.contains('2'), "{e}");
        let ctx = MoeContext::new(&[4], 2, 0, rank, false)?;
        let g = MoeGroups::from_world(&comm, 2)?;
        let e = prepare(&Tensor::from_slice(&[0f32; 12], &[3, 4])?, CommType::Mc2, &ctx, &g).unwrap_err().to_string();
        assert!(e.contains("`x`") && e.contains("4 rows") && e.contains("[3, 4]"), "{e}");
        Ok(())
    })
    .unwrap();
    let e = MoeContext::new(&[4, 4], 2, 2, 0, false).unwrap_err().to_string();
    assert!(e.contains("`dp_rank`") && e.contains('2'), "{e}");
    let e = MoeContext::new(&[4], 2, 0, 2, true).unwrap_err().to_string();
    assert!(e.contains("`tp_rank`"), "{e}");
}

/// EP ranks passing different `num_experts` (rank 1 counts 8 experts where
/// rank 0 counts 4) would place the experts on other ranks: rank 0 sends
/// expert 3's token to rank 1, rank 1 keeps its own expert 3 and they would
/// each return rows of experts the other thinks it owns. Every rank fails in
/// the exchange of the counts, naming both ranks' values.
#[test]
fn dispatch_of_ranks_that_disagree_on_num_experts_fails_on_every_rank() {
    let got = run_ranks(2, &opts(), |rank, comm| {
        let x = Tensor::from_slice(&[1f32; 4], &[2, 2])?;
        let experts = if rank == 1 { 8 } else { 4 };
        Ok(dispatch(&x, &[1, 3], 1, None, experts, &comm).map(|d| d.experts).map_err(|e| e.to_string()))
    })
    .unwrap();
    for (rank, r) in got.iter().enumerate() {
        let e = r.as_ref().expect_err(&format!("rank {rank} must fail"));
        assert!(e.contains("`num_experts`") && e.contains("ranks [0] pass 4, ranks [1] pass 8"), "rank {rank}: {e}");
        assert!(e.contains(&format!("this is rank {rank}")), "rank {rank}: {e}");
    }
}

/// An `out` covering part of `x` (as the C ABI lends the caller's
/// descriptors) gets what separate memory gets, for every comm type, with
/// `out` before and after `x` in one device allocation. NPU only: a host
/// buffer is borrowed only at an aligned address.
#[test]
#[ignore = "needs an Ascend NPU"]
fn prepare_into_an_out_overlapping_x_gives_the_separate_result() {
    use ascend_moe::backend::npu::NpuBuffer;
    use ascend_moe::tensor::Storage;
    use ascend_moe::{DType, Device};
    ascend_moe::ranks::npu_run_ranks(1, &opts(), |_rank, comm| {
        let Device::Npu(npu) = comm.device() else { panic!("an NPU world") };
        let groups = MoeGroups::from_world(&comm, 1)?;
        let (rows, h) = (3usize, 2usize);
        let n = rows * h;
        let base_vals: Vec<f32> = (0..n + 2).map(|i| i as f32 + 1.0).collect();
        // (x's first element, out's first element) in a buffer of n + 2; with
        // SP, MC2, ALLTOALL and FUSED_MC2 copy x (the local path), without it
        // they take this TP rank's rows (the TP split).
        for (xo, oo, sp) in [(2usize, 0usize, false), (0, 2, false), (2, 0, true), (0, 2, true)] {
            let ctx = MoeContext::new(&[3], 1, 0, 0, sp)?;
            for comm_type in CommType::ALL {
                let base = Tensor::from_slice(&base_vals, &[n + 2])?.to_device(&comm.device())?;
                let Storage::Npu(b) = base.storage() else { panic!("device storage") };
                let at = |off: usize| -> ascend_moe::Result<Tensor> {
                    // SAFETY: `base` holds n + 2 f32 and outlives these views.
                    let buf = unsafe { NpuBuffer::borrow_raw(&npu, b.as_ptr().cast::<f32>().add(off).cast(), n * 4) }?;
                    Tensor::from_buffer(&[rows, h], DType::F32, buf)
                };
                let (x, mut out) = (at(xo)?, at(oo)?);
                let apart = Tensor::from_slice(&base_vals[xo..xo + n], &[rows, h])?.to_device(&comm.device())?;
                let want = prepare(&apart, comm_type, &ctx, &groups)?.hidden.to_vec::<f32>()?;
                assert_eq!(out.shape(), prepare_output_shape(x.shape(), comm_type, &ctx)?.as_slice());
                prepare_into(&x, comm_type, &ctx, &groups, &mut out)
                    .unwrap_or_else(|e| panic!("{comm_type:?} sp {sp} x at {xo}, out at {oo}: {e}"));
                assert_eq!(out.to_vec::<f32>()?, want, "{comm_type:?} sp {sp} x at {xo}, out at {oo}");
            }
        }
        Ok(())
    })
    .unwrap();
}
