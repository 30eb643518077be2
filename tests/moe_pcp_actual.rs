//! SPEC sections 2 and 6: the MC2 mask marks the first `num_actual_tokens`
//! rows of this DP rank (graph padding excluded), and prefill context
//! parallelism (EP rank order DP x PCP x TP, the SP layout, ALLGATHER prepare /
//! finalize over DP then PCP). The multi-rank bodies of at most 4 ranks run on
//! every backend (`backend_test!`).

use ascend_moe::comm::ParallelGroups;
use ascend_moe::moe::layout::SpLayout;
use ascend_moe::moe::prepare_finalize::*;
use ascend_moe::ranks::run_ranks;
use ascend_moe::{Collectives, CommOptions, CommType, Tensor};

mod common;

fn opts() -> CommOptions {
    CommOptions::with_timeout(std::time::Duration::from_secs(30))
}

#[test]
fn mc2_mask_marks_the_first_num_actual_tokens_rows() {
    // DP tokens [6, 3], TP 2: MC2 pads to ceil_to(6, 2) = 6, 3 rows per TP rank.
    // DP rank 0 with 4 actual tokens (2 rows of graph padding):
    // TP rank 0 rows 0..3 all real, TP rank 1 rows 3..6 -> [true, false, false].
    let ctx = MoeContext::new(&[6, 3], 2, 0, 1, false).unwrap().with_num_actual_tokens(4).unwrap();
    assert_eq!(ctx.num_actual_tokens(), 4);
    assert_eq!(mc2_mask(CommType::Mc2, &ctx).unwrap(), vec![true, false, false]);
    assert_eq!(mc2_mask(CommType::FusedMc2, &ctx).unwrap(), vec![true, false, false]);
    let ctx0 = MoeContext::new(&[6, 3], 2, 0, 0, false).unwrap().with_num_actual_tokens(2).unwrap();
    assert_eq!(mc2_mask(CommType::Mc2, &ctx0).unwrap(), vec![true, true, false]);
    // Default: T_d.
    let d = MoeContext::new(&[6, 3], 2, 1, 1, false).unwrap();
    assert_eq!(d.num_actual_tokens(), 3);
    assert_eq!(mc2_mask(CommType::Mc2, &d).unwrap(), vec![false, false, false]);
    let d = MoeContext::new(&[6, 3], 2, 1, 0, false).unwrap();
    assert_eq!(mc2_mask(CommType::Mc2, &d).unwrap(), vec![true, true, true]);
    // 0 actual tokens: nothing is real.
    let z = MoeContext::new(&[6, 3], 2, 0, 0, false).unwrap().with_num_actual_tokens(0).unwrap();
    assert_eq!(mc2_mask(CommType::Mc2, &z).unwrap(), vec![false; 3]);
    // With SP the rank's chunk of the batch: T_d 5, TP 2, chunk 3; 4 actual -> rank 1 [true, false, false].
    let s = MoeContext::new(&[5], 2, 0, 1, true).unwrap().with_num_actual_tokens(4).unwrap();
    assert_eq!(mc2_mask(CommType::Mc2, &s).unwrap(), vec![true, false, false]);
    // Other comm types have no mask.
    assert!(mc2_mask(CommType::AllToAll, &ctx).is_none());
    let e = MoeContext::new(&[6, 3], 2, 1, 0, false).unwrap().with_num_actual_tokens(4).unwrap_err().to_string();
    assert!(e.contains("`num_actual_tokens`") && e.contains('4') && e.contains('3'), "{e}");
}

backend_test!(prepare_returns_the_actual_token_mask_and_dispatch_skips_graph_padding, ranks = 2, |rank, comm| {
    let ctx = MoeContext::new(&[4], 2, 0, rank, false)?.with_num_actual_tokens(3)?;
    let g = MoeGroups::from_world(&comm, 2)?;
    let x = Tensor::from_slice(&[1f32, 2., 3., 4.], &[4, 1])?.to_device(&comm.device())?;
    let p = prepare(&x, CommType::Mc2, &ctx, &g)?;
    let want = if rank == 0 { vec![true, true] } else { vec![true, false] };
    assert_eq!(p.mc2_mask.as_deref(), Some(want.as_slice()), "rank {rank}");
    Ok(())
});

#[test]
fn sp_layout_with_pcp_follows_dp_pcp_tp_order() {
    let l = SpLayout::from_dp_tokens_pcp(&[1, 9], 2, 2).unwrap();
    assert_eq!(l.local_sizes(), &[1, 1, 1, 1, 5, 5, 5, 5]);
    assert_eq!(
        SpLayout::from_dp_tokens_pcp(&[7, 0, 2], 1, 2).unwrap(),
        SpLayout::from_dp_tokens(&[7, 0, 2], 2).unwrap()
    );
    assert_eq!(SpLayout::from_dp_tokens_pcp(&[3], 3, 1).unwrap().local_sizes(), &[3, 3, 3]);
    l.check_dp_pcp_tp("test", 2, 2, 2).unwrap();
    let e = l.check_dp_pcp_tp("test", 2, 1, 2).unwrap_err().to_string();
    assert!(e.contains("DP 2") && e.contains("PCP 1") && e.contains("TP 2") && e.contains('8'), "{e}");
    assert!(SpLayout::from_dp_tokens_pcp(&[1], 0, 2).unwrap_err().to_string().contains("`pcp_size`"));
    let ctx = MoeContext::new(&[1, 9], 2, 1, 1, true).unwrap().with_pcp(2, 1).unwrap();
    assert_eq!(ctx.ep_size(), 8);
    // (dp 1, pcp 1, tp 1) -> (1 * 2 + 1) * 2 + 1 = 7.
    assert_eq!(ctx.ep_rank(), 7);
    assert_eq!(ctx.sp_layout().unwrap().local_sizes(), &[1, 1, 1, 1, 5, 5, 5, 5]);
    assert!(MoeContext::new(&[1], 1, 0, 0, false).unwrap().with_pcp(2, 2).is_err());
}

// CPU only: worlds of 8 and 6 ranks, and the NPU suite runs on 4 devices.
#[test]
fn groups_with_pcp_and_a_world_that_does_not_fit_name_the_three_sizes() {
    // World 8 = DP 2 x PCP 2 x TP 2: rank r = (d * 2 + p) * 2 + t.
    let got = run_ranks(8, &opts(), |rank, comm| {
        let g = ParallelGroups::with_pcp(&comm, 2, 2, 2)?;
        let pcp = g.pcp.as_ref().expect("a PCP group");
        let m = MoeGroups::from_world_pcp(&comm, 2, 2)?;
        let mp = m.pcp.as_ref().expect("a PCP group");
        assert_eq!((mp.rank(), m.dp.rank(), m.tp.rank()), (pcp.rank(), g.dp.rank(), g.tp.rank()));
        // Who is in which group: all-gather the world rank over each.
        let mut out = Vec::new();
        for c in [&g.tp, &g.dp, pcp] {
            let src = Tensor::from_slice(&[rank as i32], &[1])?;
            let mut dst = Tensor::from_slice(&vec![0i32; c.world_size()], &[c.world_size()])?;
            c.all_gather(&src, &mut dst)?;
            out.push(dst.to_vec::<i32>()?);
        }
        Ok(out)
    })
    .unwrap();
    for (r, groups) in got.iter().enumerate() {
        let (d, p, t) = (r / 4, (r / 2) % 2, r % 2);
        let at = |d: usize, p: usize, t: usize| ((d * 2 + p) * 2 + t) as i32;
        assert_eq!(groups[0], vec![at(d, p, 0), at(d, p, 1)], "tp group of {r}");
        assert_eq!(groups[1], vec![at(0, p, t), at(1, p, t)], "dp group of {r}");
        assert_eq!(groups[2], vec![at(d, 0, t), at(d, 1, t)], "pcp group of {r}");
    }
    let errs = run_ranks(6, &opts(), |_, comm| {
        let a = ParallelGroups::with_pcp(&comm, 2, 2, 2).unwrap_err().to_string();
        let b = MoeGroups::from_world_pcp(&comm, 4, 2).unwrap_err().to_string();
        Ok((a, b))
    })
    .unwrap();
    for (a, b) in errs {
        assert!(a.contains("DP 2") && a.contains("PCP 2") && a.contains("TP 2") && a.contains('6'), "{a}");
        assert!(b.contains("PCP 4") && b.contains("TP 2") && b.contains('6'), "{b}");
    }
}

/// Small integers, exact in f32: row `i` of the tokens of (dp, pcp).
fn row(d: usize, p: usize, i: usize, h: usize) -> Vec<f32> {
    (0..h).map(|c| ((i * 7 + d * 13 + p * 5 + c) % 11) as f32 - 5.0).collect()
}

// DP 2 x PCP 2 x TP 1 and DP 2 x PCP 2 x TP 2, tokens [3, 1] (PCP ranks of a
// DP rank hold different token values, the same count). TP 2 is 8 ranks: CPU
// only, as the NPU suite runs on 4 devices.
backend_test!(allgather_with_pcp_gathers_dp_then_pcp_and_finalizes_pcp_then_dp, |on: On| {
    let h = 2;
    for tp in [1usize, 2] {
        let dp_tokens = [3usize, 1];
        let world = 2 * 2 * tp;
        if !on.fits(world) {
            continue;
        }
        let outs = on
            .run(world, &opts(), |rank, comm| {
                let (d, p, t) = (rank / (2 * tp), (rank / tp) % 2, rank % tp);
                let ctx = MoeContext::new(&dp_tokens, tp, d, t, false)?.with_pcp(2, p)?;
                assert_eq!(ctx.ep_rank(), rank);
                let g = MoeGroups::from_world_pcp(&comm, 2, tp)?;
                let x: Vec<f32> = (0..dp_tokens[d]).flat_map(|i| row(d, p, i, h)).collect();
                let xt = Tensor::from_slice(&x, &[dp_tokens[d], h])?.to_device(&comm.device())?;
                let prep = prepare(&xt, CommType::AllGather, &ctx, &g)?;
                assert_eq!(
                    prep.hidden.shape(),
                    prepare_output_shape(xt.shape(), CommType::AllGather, &ctx)?.as_slice()
                );
                let gathered = prep.hidden.to_vec::<f32>()?;
                // The experts' stand-in: scale by (EP rank + 1), so the reduction order shows.
                let y: Vec<f32> = gathered.iter().map(|v| v * (rank + 1) as f32).collect();
                let yt = Tensor::from_slice(&y, prep.hidden.shape())?.to_device(&comm.device())?;
                let out = finalize(yt, CommType::AllGather, &ctx, &g)?;
                assert_eq!(out.shape(), &[dp_tokens[d], h]);
                Ok((gathered, out.to_vec::<f32>()?))
            })
            .unwrap();
        for (rank, (gathered, out)) in outs.iter().enumerate() {
            let (d, p, t) = (rank / (2 * tp), (rank / tp) % 2, rank % tp);
            // Prepare: pad to max 3, DP gather [dp0, dp1] of this PCP rank's
            // peers, then PCP gather: [pcp0: [dp0, dp1], pcp1: [dp0, dp1]].
            let mut want = Vec::new();
            for pp in 0..2 {
                for (dd, &n) in dp_tokens.iter().enumerate() {
                    for i in 0..3 {
                        want.extend(if i < n { row(dd, pp, i, h) } else { vec![0.0; h] });
                    }
                }
            }
            assert_eq!(gathered, &want, "tp {tp} rank {rank}: prepared rows");
            // Finalize: every EP rank (dd, pp, t) with this tp rank contributed
            // (rank' + 1) * its gathered copy, whose block (p, d) is this rank's tokens.
            let scale: f32 = (0..2).flat_map(|dd| (0..2).map(move |pp| ((dd * 2 + pp) * tp + t + 1) as f32)).sum();
            let want: Vec<f32> = (0..dp_tokens[d]).flat_map(|i| row(d, p, i, h)).map(|v| v * scale).collect();
            assert_eq!(out, &want, "tp {tp} rank {rank}: finalized rows");
        }
    }
});

// CPU only: DP 2 x PCP 2 x TP 2 is 8 ranks, and the NPU suite runs on 4 devices.
#[test]
fn sp_and_mc2_with_pcp_round_trip() {
    // DP 2 x PCP 2 x TP 2, tokens [1, 9]: SP layout [1, 1, 1, 1, 5, 5, 5, 5].
    let h = 2;
    let dp_tokens = [1usize, 9];
    run_ranks(8, &opts(), |rank, comm| {
        let (d, p, t) = (rank / 4, (rank / 2) % 2, rank % 2);
        let g = MoeGroups::from_world_pcp(&comm, 2, 2)?;
        for (comm_type, sp) in [(CommType::AllGather, true), (CommType::Mc2, false), (CommType::AllToAll, true)] {
            let ctx = MoeContext::new(&dp_tokens, 2, d, t, sp)?.with_pcp(2, p)?;
            let local = ctx.local_tokens();
            // With SP every rank holds its own shard; without, the TP ranks of
            // (dp, pcp) hold the same batch.
            let seed = if sp { p * 2 + t } else { p };
            let x: Vec<f32> = (0..local).flat_map(|i| row(d, seed, i, h)).collect();
            let xt = Tensor::from_slice(&x, &[local, h])?;
            let prep = prepare(&xt, comm_type, &ctx, &g)?;
            // ALLGATHER + SP gathers sum(layout) = 4 x 1 + 4 x 5 = 24 rows; MC2 takes ceil_to(9, 2) / 2 = 5.
            let want_rows = if comm_type == CommType::AllGather {
                24
            } else if sp {
                local
            } else {
                5
            };
            assert_eq!(prep.hidden.rows(), want_rows, "{comm_type:?} rank {rank}");
            let out = finalize(prep.hidden, comm_type, &ctx, &g)?.to_vec::<f32>()?;
            // ALLGATHER+SP sums every EP rank's identical copy (8); the others return x.
            let factor = if comm_type == CommType::AllGather { 8.0 } else { 1.0 };
            assert_eq!(out, x.iter().map(|v| v * factor).collect::<Vec<_>>(), "{comm_type:?} rank {rank}");
        }
        Ok(())
    })
    .unwrap();
}

// DP2 x TP2: the engine made its TP and DP groups itself.
backend_test!(groups_from_the_engines_communicators_prepare_and_finalize_like_split_ones, ranks = 4, |rank, world| {
    let (dp_rank, tp_rank) = (rank / 2, rank % 2);
    let tp = world.split(&[dp_rank * 2, dp_rank * 2 + 1])?;
    let dp = world.split(&[tp_rank, 2 + tp_rank])?;
    let mine = MoeGroups::from_comms(&world, &tp, &dp, None)?;
    let split = MoeGroups::from_world(&world, 2)?;
    let ctx = MoeContext::new(&[3, 2], 2, dp_rank, tp_rank, false)?;
    let x = Tensor::from_slice(
        &(0..ctx.local_tokens() * 2).map(|i| (rank * 10 + i) as f32).collect::<Vec<_>>(),
        &[ctx.local_tokens(), 2],
    )?
    .to_device(&world.device())?;
    for comm in CommType::ALL {
        let a = prepare(&x, comm, &ctx, &mine)?.hidden;
        let b = prepare(&x, comm, &ctx, &split)?.hidden;
        assert_eq!(a.to_vec::<f32>()?, b.to_vec::<f32>()?, "{comm:?} prepare, rank {rank}");
        let fa = finalize(a, comm, &ctx, &mine)?;
        let fb = finalize(b, comm, &ctx, &split)?;
        assert_eq!(fa.to_vec::<f32>()?, fb.to_vec::<f32>()?, "{comm:?} finalize, rank {rank}");
    }
    // TP and DP swapped: the sizes fit, but ranks 1 and 2 are not where
    // the DP x TP order puts them.
    let swapped = MoeGroups::from_comms(&world, &dp, &tp, None);
    if rank == 1 || rank == 2 {
        let e = swapped.unwrap_err().to_string();
        assert!(e.contains(&format!("EP rank {rank}")) && e.contains("(dp * PCP + pcp) * TP + tp"), "{e}");
    }
    // Groups that do not multiply to the world's size.
    let lone = world.split(&[rank])?;
    let e = MoeGroups::from_comms(&world, &lone, &lone, None).unwrap_err().to_string();
    assert!(e.contains("4 ranks, but DP 1 x PCP 1 x TP 1 is 1"), "{e}");
    Ok(())
});
