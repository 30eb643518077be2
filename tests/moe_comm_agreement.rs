//! SPEC section 5: every EP rank of a forward must agree on the MoE comm type.
//! When DP ranks disagree (vLLM-Ascend #12195: DP 0 picks ALLGATHER, DP 1 MC2),
//! the prepare op (and so does finalize, when the ranks finalize with
//! different comm types) fails on every rank with an error naming which
//! ranks chose which type, instead of an unrelated collective error on some
//! ranks and success on others.

use ascend_moe::moe::prepare_finalize::*;
use ascend_moe::ranks::run_ranks;
use ascend_moe::{CommOptions, CommType, DType, Tensor};

fn opts() -> CommOptions {
    CommOptions::with_timeout(std::time::Duration::from_secs(30))
}

const DP_TOKENS: [usize; 2] = [6, 3];
const TP: usize = 2;
const H: usize = 4;

/// Row `i` of DP rank `d`'s tokens (the same on each of its TP ranks), values
/// that name the rank and the row.
fn token(d: usize, i: usize) -> Vec<f32> {
    (0..H).map(|j| (d * 100 + i * H + j) as f32).collect()
}

/// What one rank prepared: the hidden rows, flattened, and the MC2 mask.
type Outcome = Result<(Vec<f32>, Option<Vec<bool>>), String>;

/// Runs prepare on DP 2 x TP 2 (tokens [6, 3]) with `choice(rank)` as each
/// rank's comm type; returns every rank's outcome (or the error message).
fn prepare_with(choice: fn(usize) -> CommType, sp: bool) -> Vec<Outcome> {
    run_ranks(4, &opts(), |rank, comm| {
        let (d, t) = (rank / TP, rank % TP);
        let ctx = MoeContext::new(&DP_TOKENS, TP, d, t, sp)?;
        let groups = MoeGroups::from_world(&comm, TP)?;
        let local = ctx.local_tokens();
        let rows: Vec<f32> = (0..local).flat_map(|i| token(d, i)).collect();
        let x = Tensor::from_slice(&rows, &[local, H])?;
        Ok(match prepare(&x, choice(rank), &ctx, &groups) {
            Ok(p) => Ok((p.hidden.to_vec::<f32>()?, p.mc2_mask)),
            Err(e) => Err(e.to_string()),
        })
    })
    .unwrap()
}

/// SPEC section 6 without SP, for the rank `(d, t)`: the rows it prepares
/// (zero rows are padding) and, for MC2 / FUSED_MC2, which of them are real.
fn expected(ct: CommType, d: usize, t: usize) -> (Vec<f32>, Option<Vec<bool>>) {
    let max = *DP_TOKENS.iter().max().unwrap();
    let own = DP_TOKENS[d];
    let row = |dd: usize, i: usize| if i < DP_TOKENS[dd] { token(dd, i) } else { vec![0.0; H] };
    match ct {
        // Pad to the largest DP rank, all-gather over DP.
        CommType::AllGather => {
            ((0..DP_TOKENS.len()).flat_map(|dd| (0..max).flat_map(move |i| row(dd, i))).collect(), None)
        }
        // Pad to a multiple of TP of the largest, this TP rank's equal part.
        CommType::Mc2 | CommType::FusedMc2 => {
            let part = max.div_ceil(TP);
            let rows = t * part..(t + 1) * part;
            (rows.clone().flat_map(|i| row(d, i)).collect(), Some(rows.map(|i| i < own).collect()))
        }
        // Pad to TP rows only when fewer; parts differ by one, the larger first.
        CommType::AllToAll => {
            let n = own.max(TP);
            let size = |k: usize| n / TP + usize::from(k < n % TP);
            let start: usize = (0..t).map(size).sum();
            ((start..start + size(t)).flat_map(|i| row(d, i)).collect(), None)
        }
    }
}

#[test]
fn dp_ranks_choosing_allgather_and_mc2_fail_on_every_rank_naming_the_choice() {
    for sp in [false, true] {
        let got = prepare_with(|r| if r < 2 { CommType::AllGather } else { CommType::Mc2 }, sp);
        for (rank, r) in got.iter().enumerate() {
            let e = r.as_ref().expect_err(&format!("rank {rank} must fail (sp {sp})"));
            assert!(e.contains("ranks 0, 1 chose ALLGATHER") && e.contains("ranks 2, 3 chose MC2"), "rank {rank}: {e}");
            assert!(e.contains("comm type"), "{e}");
        }
    }
}

#[test]
fn a_single_rank_that_disagrees_is_named_on_every_rank() {
    let got = prepare_with(|r| if r == 3 { CommType::AllToAll } else { CommType::FusedMc2 }, false);
    for (rank, r) in got.iter().enumerate() {
        let e = r.as_ref().expect_err(&format!("rank {rank} must fail"));
        assert!(e.contains("ranks 0, 1, 2 chose FUSED_MC2") && e.contains("rank 3 chose ALLTOALL"), "rank {rank}: {e}");
    }
}

#[test]
fn agreeing_ranks_prepare_the_rows_of_spec_section_6() {
    for ct in CommType::ALL {
        let got = prepare_with(
            match ct {
                CommType::AllGather => |_| CommType::AllGather,
                CommType::Mc2 => |_| CommType::Mc2,
                CommType::AllToAll => |_| CommType::AllToAll,
                CommType::FusedMc2 => |_| CommType::FusedMc2,
            },
            false,
        );
        for (rank, r) in got.into_iter().enumerate() {
            let (hidden, mask) = r.unwrap_or_else(|e| panic!("{ct:?} rank {rank}: {e}"));
            let (want, want_mask) = expected(ct, rank / TP, rank % TP);
            assert_eq!(hidden, want, "{ct:?} rank {rank}: prepared rows");
            assert_eq!(mask, want_mask, "{ct:?} rank {rank}: mc2 mask");
        }
    }
}

#[test]
fn ranks_finalizing_with_different_comm_types_fail_on_every_rank_naming_the_choice() {
    // DP 1 x TP 2, 4 tokens: MC2 and ALLTOALL both give each TP rank 2
    // prepared rows and both finalize with a TP all-gather of 2 + 2 rows; DP
    // 1 x TP 2, 1 token: ALLGATHER finalizes its 1 row over a DP group of one
    // (no peer), MC2 all-gathers 1 row per TP rank.
    for (tokens, rows, choice) in
        [(4, 2, [CommType::Mc2, CommType::AllToAll]), (1, 1, [CommType::AllGather, CommType::Mc2])]
    {
        let got = run_ranks(2, &opts(), |rank, comm| {
            let ctx = MoeContext::new(&[tokens], 2, 0, rank, false)?;
            let groups = MoeGroups::from_world(&comm, 2)?;
            let y = Tensor::from_slice(&vec![1.0f32; rows * H], &[rows, H])?;
            Ok(finalize(y, choice[rank], &ctx, &groups).map(|_| ()).map_err(|e| e.to_string()))
        })
        .unwrap();
        let names = [choice[0], choice[1]].map(|c| c.name());
        for (rank, r) in got.iter().enumerate() {
            let e = r.as_ref().expect_err(&format!("rank {rank} must fail ({names:?})"));
            let want = [format!("rank 0 chose {}", names[0]), format!("rank 1 chose {}", names[1])];
            assert!(e.contains("comm type") && want.iter().all(|w| e.contains(w.as_str())), "rank {rank}: {e}");
        }
    }
}

/// Ranks that chose one comm type but see other forward contexts: a stale DP
/// token count (DP 2 x TP 1, MC2: rank 0 sees [4, 4], rank 1 [4, 2]; MC2's
/// prepare is a local pad that no collective compares) and SP on one rank
/// only (DP 1 x TP 2, MC2). Every rank fails at prepare and at finalize,
/// naming the context and what it sees, instead of going on with another
/// layout or waiting for a peer that took another path.
#[test]
fn ranks_seeing_other_forward_contexts_fail_at_prepare_and_finalize() {
    type Case = (usize, fn(usize) -> ascend_moe::Result<MoeContext>, &'static str);
    let cases: [Case; 2] = [
        (1, |rank| MoeContext::new(if rank == 0 { &[4, 4] } else { &[4, 2] }, 1, rank, 0, false), "dp_tokens [4, 2]"),
        (2, |rank| MoeContext::new(&[4], 2, 0, rank, rank == 0), "sp false"),
    ];
    for (tp, ctx_of, shown_by_1) in cases {
        let got = run_ranks(2, &opts(), |rank, comm| {
            let ctx = ctx_of(rank)?;
            let groups = MoeGroups::from_world(&comm, tp)?;
            let local = ctx.local_tokens();
            let x = Tensor::from_slice(&vec![1.0f32; local * H], &[local, H])?;
            let prepared = prepare(&x, CommType::Mc2, &ctx, &groups).map(|_| ()).map_err(|e| e.to_string());
            let rows = ascend_moe::moe::prepare_finalize::prepare_output_shape(&[local, H], CommType::Mc2, &ctx)?[0];
            let y = Tensor::from_slice(&vec![1.0f32; rows * H], &[rows, H])?;
            let finalized = finalize(y, CommType::Mc2, &ctx, &groups).map(|_| ()).map_err(|e| e.to_string());
            Ok([prepared, finalized])
        })
        .unwrap();
        for (rank, ops) in got.iter().enumerate() {
            for (op, r) in ["prepare", "finalize"].iter().zip(ops) {
                let e = r.as_ref().expect_err(&format!("TP {tp}: rank {rank}'s {op} must fail"));
                assert!(e.contains("not on the forward context"), "TP {tp}, rank {rank}, {op}: {e}");
                assert!(e.contains("[0] and [1]"), "TP {tp}, rank {rank}, {op}: {e}");
                if rank == 1 {
                    assert!(e.contains(shown_by_1), "TP {tp}, rank 1, {op}: {e}");
                }
            }
        }
    }
}

/// Ranks that agree on the comm type and the context but whose tokens
/// differ (rank 1's hidden size is 3 where its peers' is 4, or its dtype
/// f16): under ALLGATHER without SP the first collective is in the DP group
/// (the PCP group, for finalize with PCP), which the ranks of the other
/// groups never share with rank 1, so they would return or, in the two-stage
/// PCP path, wait for it until the timeout. Every rank fails at prepare and
/// at finalize, at once, in the agreement, naming rank 1's tokens.
#[test]
fn ranks_whose_tokens_differ_fail_at_prepare_and_finalize_on_every_rank() {
    // (PCP, TP) of a DP 2 world: DP 2 x PCP 2, and DP 2 x TP 2.
    for (pcp, tp) in [(2, 1), (1, 2)] {
        for (odd_h, odd_dtype, shown) in [(3, DType::F32, "rows of 3 elements"), (H, DType::F16, "dtype f16")] {
            let what = format!("pcp {pcp} tp {tp}, rank 1 {shown}");
            let start = std::time::Instant::now();
            let got = run_ranks(2 * pcp * tp, &opts(), |rank, comm| {
                let groups = MoeGroups::from_world_pcp(&comm, pcp, tp)?;
                let ctx = MoeContext::new(&[2, 2], tp, rank / (pcp * tp), rank % tp, false)?
                    .with_pcp(pcp, rank / tp % pcp)?;
                let (h, dtype) = if rank == 1 { (odd_h, odd_dtype) } else { (H, DType::F32) };
                let x = Tensor::zeros_cpu(&[ctx.local_tokens(), h], dtype);
                let prepared = prepare(&x, CommType::AllGather, &ctx, &groups).map(|_| ()).map_err(|e| e.to_string());
                let rows = prepare_output_shape(&[ctx.local_tokens(), h], CommType::AllGather, &ctx)?[0];
                let y = Tensor::zeros_cpu(&[rows, h], dtype);
                let finalized = finalize(y, CommType::AllGather, &ctx, &groups).map(|_| ()).map_err(|e| e.to_string());
                Ok([prepared, finalized])
            })
            .unwrap();
            for (rank, ops) in got.iter().enumerate() {
                for (op, r) in ["prepare", "finalize"].iter().zip(ops) {
                    let e = r.as_ref().expect_err(&format!("{what}: rank {rank}'s {op} must fail"));
                    let tokens = if *op == "prepare" { "`ctx` or `x`" } else { "`ctx` or `y`" };
                    assert!(e.contains(tokens) && e.contains("[0, 2, 3] and [1]"), "{what}, rank {rank}, {op}: {e}");
                    if rank == 1 {
                        assert!(e.contains(shown), "{what}, rank 1, {op}: {e}");
                    }
                }
            }
            assert!(start.elapsed() < opts().timeout / 4, "{what}: took {:?}", start.elapsed());
        }
    }
}

/// TP ranks of one layer whose policies differ (a routed transform on rank 0
/// only, TP 2 with a tensor-parallel shared expert) would decide differently
/// at the routed-early point: rank 0 all-reduces, rank 1 copies. Both fail
/// naming the policy.
#[test]
fn tp_ranks_with_other_reduce_policies_fail_at_the_point_naming_it() {
    use ascend_moe::moe::reduce::{ReducePoint, ReducePolicy, SharedMode};
    let got = run_ranks(2, &opts(), |rank, comm| {
        let p = ReducePolicy::new(SharedMode::TensorParallel, rank == 0, false, 2, 2)?;
        let x = Tensor::from_slice(&[1.0f32; 3 * H], &[3, H])?;
        Ok(p.reduce_at(ReducePoint::RoutedEarly, x, CommType::AllGather, &comm).map(|_| ()).map_err(|e| e.to_string()))
    })
    .unwrap();
    for (rank, r) in got.iter().enumerate() {
        let e = r.as_ref().expect_err(&format!("rank {rank} must fail"));
        assert!(
            e.contains("`policy`") && e.contains("not on the layer's reduce policy") && e.contains("[0] and [1]"),
            "rank {rank}: {e}"
        );
        assert!(e.contains(&format!("routed transform {}", rank == 0)), "rank {rank}: {e}");
    }
}

/// TP ranks of one layer at different reduction points (rank 1 at the
/// shared point, rank 0 at the final one; with a tensor-parallel shared
/// expert under ALLGATHER the final point all-reduces and the shared one
/// only copies): both fail at once naming the point each is at, instead of
/// rank 1 returning a copy while rank 0 waits in an all-reduce.
#[test]
fn tp_ranks_at_other_reduction_points_fail_naming_them() {
    use ascend_moe::moe::reduce::{ReducePoint, ReducePolicy, SharedMode};
    let points = [ReducePoint::Final, ReducePoint::Shared];
    let got = run_ranks(2, &opts(), |rank, comm| {
        let p = ReducePolicy::new(SharedMode::TensorParallel, false, false, 2, 2)?;
        let x = Tensor::from_slice(&[1.0f32; 3 * H], &[3, H])?;
        Ok(p.reduce_at(points[rank], x, CommType::AllGather, &comm).map(|_| ()).map_err(|e| e.to_string()))
    })
    .unwrap();
    for (rank, r) in got.iter().enumerate() {
        let e = r.as_ref().expect_err(&format!("rank {rank} must fail"));
        assert!(e.contains("reduction point") && e.contains("[0] and [1]"), "rank {rank}: {e}");
        assert!(e.contains(&format!("point {}", points[rank].op())), "rank {rank}: {e}");
    }
}
