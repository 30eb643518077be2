//! The shared-expert contract (SPEC section 5): a TP-sharded shared expert with
//! SP on and TP > 1 is refused as `TensorParallel` (it is `SequenceParallelOnly`),
//! and the DP-only / SP-only token helpers against a plain model of the TP group,
//! on the CPU communicator and (`npu` cases, ignored without an NPU) on NPUs.

mod common;
mod moe_common;

use ascend_moe::moe::reduce::{ReducePolicy, SharedMode};
use ascend_moe::moe::shared::*;
use ascend_moe::ranks::run_ranks;
use ascend_moe::{Collectives, CommOptions, Tensor};

fn opts() -> CommOptions {
    CommOptions::with_timeout(std::time::Duration::from_secs(30))
}

/// Value of row `i`, column `c` of TP rank `r`'s tensor: distinct per (r, i, c), exact in f32.
fn val(r: usize, i: usize, c: usize) -> f32 {
    (r * 1000 + i * 10 + c) as f32 + 0.5
}

fn data(r: usize, rows: usize, h: usize) -> Vec<f32> {
    (0..rows).flat_map(|i| (0..h).map(move |c| val(r, i, c))).collect()
}

#[test]
fn tensor_parallel_with_sp_and_tp_over_one_is_refused_as_sequence_parallel_only() {
    for (tp, ep) in [(2, 2), (2, 4), (4, 8)] {
        let e = ReducePolicy::new(SharedMode::TensorParallel, false, true, tp, ep).unwrap_err().to_string();
        assert!(e.contains("`shared_mode`"), "{e}");
        assert!(e.contains("SequenceParallelOnly") && e.contains("vLLM-Ascend"), "{e}");
        assert!(e.contains(&format!("tp_size {tp}")), "{e}");
    }
    // TP 1 (nothing is sharded) and SP off stay valid.
    assert!(ReducePolicy::new(SharedMode::TensorParallel, false, true, 1, 4).is_ok());
    assert!(ReducePolicy::new(SharedMode::TensorParallel, true, false, 2, 4).is_ok());
    assert!(ReducePolicy::new(SharedMode::SequenceParallelOnly, false, true, 2, 4).is_ok());
}

#[test]
fn shape_functions_follow_the_spec() {
    // T = 9 tokens on TP 4: parts of ceil(9/4) = 3 rows.
    assert_eq!(shared_pad_split_output_shape(&[9, 5], 3, 4).unwrap(), vec![3, 5]);
    assert_eq!(shared_pad_split_output_shape(&[0, 5], 0, 4).unwrap(), vec![0, 5]);
    assert_eq!(shared_gather_unpad_output_shape(&[3, 5], 9, 4).unwrap(), vec![9, 5]);
    assert_eq!(shared_pad_reduce_scatter_output_shape(&[9, 2, 3], 4).unwrap(), vec![3, 2, 3]);
    assert_eq!(shared_pad_reduce_scatter_output_shape(&[1, 2], 2).unwrap(), vec![1, 2]);
    let e = shared_gather_unpad_output_shape(&[2, 5], 9, 4).unwrap_err().to_string();
    assert!(e.contains("`x`") && e.contains('3') && e.contains('9'), "{e}");
    let e = shared_pad_split_output_shape(&[9, 5], 4, 4).unwrap_err().to_string();
    assert!(e.contains("`tp`") && e.contains('4'), "{e}");
    assert!(shared_pad_reduce_scatter_output_shape(&[], 2).is_err());
    assert!(shared_pad_reduce_scatter_output_shape(&[4], 0).is_err());
}

backend_test!(dp_only_pad_split_then_gather_unpad_matches_the_plain_model, |on: On| {
    let h = 3;
    for (tp, t) in [(1usize, 5usize), (2, 5), (2, 4), (4, 9), (4, 3), (4, 1), (4, 0), (2, 1)] {
        let part = t.div_ceil(tp);
        let outs = on
            .run(tp, &opts(), |r, comm| {
                let dev = comm.device();
                // Every TP rank holds the whole DP batch (the same rows): rank 0's data.
                let x = Tensor::from_slice(&data(0, t, h), &[t, h])?.to_device(&dev)?;
                let mine = shared_pad_split(&x, &comm)?;
                assert_eq!(mine.shape(), shared_pad_split_output_shape(x.shape(), r, tp)?.as_slice());
                let split = mine.to_vec::<f32>()?;
                // The MLP stand-in: a rank-independent map of each row.
                let y: Vec<f32> = split.iter().map(|v| 2.0 * v + 1.0).collect();
                let y = Tensor::from_slice(&y, mine.shape())?.to_device(&dev)?;
                let back = shared_gather_unpad(&y, t, &comm)?;
                assert_eq!(back.shape(), shared_gather_unpad_output_shape(y.shape(), t, tp)?.as_slice());
                Ok((split, back.to_vec::<f32>()?))
            })
            .unwrap();
        for (r, (split, back)) in outs.iter().enumerate() {
            // Plain model: rows [r*part, (r+1)*part) of the batch, zeros past T.
            let want: Vec<f32> = (r * part..(r + 1) * part)
                .flat_map(|i| (0..h).map(move |c| if i < t { val(0, i, c) } else { 0.0 }))
                .collect();
            assert_eq!(split, &want, "tp {tp} T {t} rank {r}: split");
            let want_back: Vec<f32> = data(0, t, h).iter().map(|v| 2.0 * v + 1.0).collect();
            assert_eq!(back, &want_back, "tp {tp} T {t} rank {r}: gather-unpad");
        }
    }
});

backend_test!(sp_only_gather_unpad_then_pad_reduce_scatter_matches_the_plain_model, |on: On| {
    let h = 2;
    for (tp, t) in [(2usize, 5usize), (2, 4), (4, 9), (4, 2), (4, 0), (1, 3)] {
        let part = t.div_ceil(tp);
        // The DP batch, zero-padded to TP * part rows; TP rank r holds chunk r.
        let batch: Vec<f32> =
            data(7, tp * part, h).into_iter().enumerate().map(|(i, v)| if i / h < t { v } else { 0.0 }).collect();
        let outs = on
            .run(tp, &opts(), |r, comm| {
                let dev = comm.device();
                let shard =
                    Tensor::from_slice(&batch[r * part * h..(r + 1) * part * h], &[part, h])?.to_device(&dev)?;
                let full = shared_gather_unpad(&shard, t, &comm)?;
                assert_eq!(full.shape(), &[t, h]);
                let gathered = full.to_vec::<f32>()?;
                // TP-partial of this rank: its own rows of data(r).
                let partial = Tensor::from_slice(&data(r, t, h), &[t, h])?.to_device(&dev)?;
                let out = shared_pad_reduce_scatter(&partial, &comm)?;
                assert_eq!(out.shape(), shared_pad_reduce_scatter_output_shape(partial.shape(), tp)?.as_slice());
                Ok((gathered, out.to_vec::<f32>()?))
            })
            .unwrap();
        for (r, (gathered, out)) in outs.iter().enumerate() {
            assert_eq!(gathered, &batch[..t * h].to_vec(), "tp {tp} T {t} rank {r}: gather-unpad");
            // Plain model: rows [r*part, (r+1)*part) of sum_q data(q), zeros past T.
            let want: Vec<f32> = (r * part..(r + 1) * part)
                .flat_map(|i| {
                    (0..h).map(
                        move |c| if i < t { (0..tp).map(|q| val(q, i, c) as f64).sum::<f64>() as f32 } else { 0.0 },
                    )
                })
                .collect();
            assert_eq!(out, &want, "tp {tp} T {t} rank {r}: pad-reduce-scatter");
        }
    }
});

#[test]
fn gather_unpad_refuses_a_shard_of_the_wrong_size_on_every_rank() {
    let errs = run_ranks(2, &opts(), |r, comm| {
        let rows = if r == 0 { 3 } else { 2 };
        let x = Tensor::from_slice(&data(r, rows, 2), &[rows, 2])?;
        Ok(shared_gather_unpad(&x, 5, &comm).map(|_| ()).map_err(|e| e.to_string()))
    })
    .unwrap();
    // Rank 0's shard (3 rows for 5 tokens on TP 2) is right: it waits and fails with the peer.
    let e = errs[1].as_ref().unwrap_err();
    assert!(e.contains("`x`") && e.contains("3 rows"), "{e}");
    assert!(errs[0].is_err(), "rank 0 must not return a result when its peer refused");
}

/// A tensor of `shape` full of NaN on `dev`: an `out` whose every element the
/// op must overwrite (padding rows included).
fn garbage_out(shape: &[usize], dev: &ascend_moe::Device) -> ascend_moe::Result<Tensor> {
    let n: usize = shape.iter().product();
    Tensor::from_slice(&vec![f32::NAN; n], shape)?.to_device(dev)
}

fn same_bits(a: &Tensor, b: &Tensor) -> ascend_moe::Result<bool> {
    let (a, b) = (a.to_vec::<f32>()?, b.to_vec::<f32>()?);
    Ok(a.len() == b.len() && a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()))
}

backend_test!(into_variants_equal_the_allocating_helpers_bit_for_bit, |on: On| {
    let h = 3;
    for (tp, t) in [(1usize, 5usize), (2, 5), (2, 4), (4, 9), (4, 3), (4, 1), (4, 0), (2, 1)] {
        let part = t.div_ceil(tp);
        on.run(tp, &opts(), |r, comm| {
            let dev = comm.device();
            let batch = Tensor::from_slice(&data(r, t, h), &[t, h])?.to_device(&dev)?;
            let want = shared_pad_split(&batch, &comm)?;
            let mut out = garbage_out(want.shape(), &dev)?;
            shared_pad_split_into(&batch, &comm, &mut out)?;
            assert!(same_bits(&out, &want)?, "tp {tp} T {t} rank {r}: pad_split");

            let shard = Tensor::from_slice(&data(r + 1, part, h), &[part, h])?.to_device(&dev)?;
            let want = shared_gather_unpad(&shard, t, &comm)?;
            let mut out = garbage_out(want.shape(), &dev)?;
            shared_gather_unpad_into(&shard, t, &comm, &mut out)?;
            assert!(same_bits(&out, &want)?, "tp {tp} T {t} rank {r}: gather_unpad");

            let want = shared_pad_reduce_scatter(&batch, &comm)?;
            let mut out = garbage_out(want.shape(), &dev)?;
            shared_pad_reduce_scatter_into(&batch, &comm, &mut out)?;
            assert!(same_bits(&out, &want)?, "tp {tp} T {t} rank {r}: pad_reduce_scatter");
            Ok(())
        })
        .unwrap();
    }
});

#[test]
fn into_variants_refuse_an_out_of_the_wrong_shape_or_dtype_naming_out() {
    let errs = run_ranks(2, &opts(), |r, comm| {
        let x = Tensor::from_slice(&data(r, 5, 2), &[5, 2])?;
        let shard = Tensor::from_slice(&data(r, 3, 2), &[3, 2])?;
        let mut rows = Tensor::zeros_cpu(&[2, 2], ascend_moe::DType::F32);
        let mut dtype = Tensor::zeros_cpu(&[3, 2], ascend_moe::DType::BF16);
        let mut gathered_rows = Tensor::zeros_cpu(&[6, 2], ascend_moe::DType::F32);
        let mut gathered_dtype = Tensor::zeros_cpu(&[5, 2], ascend_moe::DType::F16);
        let e = |r: ascend_moe::Result<()>| r.unwrap_err().to_string();
        Ok(vec![
            ("shared_pad_split", e(shared_pad_split_into(&x, &comm, &mut rows))),
            ("shared_pad_split", e(shared_pad_split_into(&x, &comm, &mut dtype))),
            ("shared_gather_unpad", e(shared_gather_unpad_into(&shard, 5, &comm, &mut gathered_rows))),
            ("shared_gather_unpad", e(shared_gather_unpad_into(&shard, 5, &comm, &mut gathered_dtype))),
            ("shared_pad_reduce_scatter", e(shared_pad_reduce_scatter_into(&x, &comm, &mut rows))),
            ("shared_pad_reduce_scatter", e(shared_pad_reduce_scatter_into(&x, &comm, &mut dtype))),
        ])
    })
    .unwrap();
    for (r, es) in errs.iter().enumerate() {
        for (op, e) in es {
            assert!(e.contains("`out`") && e.contains(op), "rank {r} {op}: {e}");
        }
    }
}

/// TP ranks that disagree on the token count (a stale one on one rank) fail
/// together on a CPU group, naming each rank's counts, also where their parts
/// have the same size (5 and 6 tokens are 3 rows per rank of TP 2 either
/// way), which would otherwise gather or sum misaligned rows unnoticed.
#[test]
fn shared_helpers_of_tp_ranks_that_disagree_on_the_token_count_fail_on_every_rank() {
    let h = 4;
    for gather in [true, false] {
        let got = run_ranks(2, &opts(), |r, comm| {
            let tokens = if r == 1 { 6 } else { 5 };
            let res = if gather {
                let x = Tensor::from_slice(&data(r, 3, h), &[3, h])?;
                shared_gather_unpad(&x, tokens, &comm)
            } else {
                let x = Tensor::from_slice(&data(r, tokens, h), &[tokens, h])?;
                shared_pad_reduce_scatter(&x, &comm)
            };
            Ok(res.map(drop).map_err(|e| e.to_string()))
        })
        .unwrap();
        for (r, res) in got.into_iter().enumerate() {
            let e = res.expect_err(&format!("gather {gather}: rank {r} succeeded"));
            assert!(e.contains("ranks disagree"), "gather {gather}: rank {r}: {e}");
            // Elements per rank: 3 and 2 rows of H against 3 and 3.
            assert!(e.contains("counts [12, 8]") && e.contains("counts [12, 12]"), "gather {gather}: rank {r}: {e}");
            let arg = if gather { "`num_tokens`" } else { "`x`" };
            assert!(e.contains("different token counts") && e.contains(arg), "gather {gather}: rank {r}: {e}");
        }
    }
}
