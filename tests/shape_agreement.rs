//! Ranks whose tensors hold the same number of elements in different shapes
//! (`[4, 4]` on some, `[8, 2]` on others) on a CPU world: the transport
//! compares element counts, which agree, so each call also posts the shape
//! every rank must pass alike. Every rank must fail, with an error naming
//! the argument and both shapes with their ranks; none may return rows that
//! mix other ranks' rows. Uneven token counts that a layout describes stay
//! legal. The TP ranks of one DP rank must also count its real tokens alike.

use std::time::Duration;

use ascend_moe::backend::FinalizeArgs;
use ascend_moe::moe::layout::SpLayout;
use ascend_moe::moe::pad_reduce::{finalize_and_reduce, maybe_all_gather_and_maybe_unpad, maybe_pad_and_reduce};
use ascend_moe::moe::prepare_finalize::{prepare, MoeContext, MoeGroups};
use ascend_moe::moe::shared::shared_gather_unpad;
use ascend_moe::ranks::run_ranks;
use ascend_moe::{
    Collectives, Comm, CommErrorKind, CommOptions, CommType, DropPadMode, Error, ReduceOp, ReducePolicy, SharedMode,
    Tensor,
};

fn opts() -> CommOptions {
    CommOptions::with_timeout(Duration::from_secs(30))
}

fn ones(shape: &[usize]) -> Tensor {
    Tensor::from_slice(&vec![1.0f32; shape.iter().product()], shape).expect("a host tensor")
}

/// Runs `op(rank, world, shape)` on `world` CPU ranks, rank `r` given
/// `shapes[r % 2]`, and checks every rank failed with a mismatch naming
/// `arg` and both shapes (their rows, past dim 0, with `rows`), each with
/// the ranks that passed it. Returns every rank's error text.
fn every_rank_fails(
    case: &str,
    world: usize,
    shapes: [&[usize]; 2],
    rows: bool,
    arg: &str,
    op: impl Fn(usize, &Comm, &[usize]) -> ascend_moe::Result<()> + Sync,
) -> Vec<String> {
    let res = run_ranks(world, &opts(), |rank, comm| Ok(op(rank, &comm, shapes[rank % 2]))).expect("the world starts");
    let evens: Vec<usize> = (0..world).step_by(2).collect();
    let odds: Vec<usize> = (1..world).step_by(2).collect();
    let mut texts = Vec::new();
    for (rank, r) in res.iter().enumerate() {
        let e = match r {
            Ok(()) => panic!("{case}: rank {rank} succeeded while the ranks passed shapes {shapes:?}: {res:?}"),
            Err(e) => e,
        };
        let text = e.to_string();
        assert!(
            matches!(e, Error::Comm { kind: CommErrorKind::Mismatch, .. }),
            "{case}: rank {rank} did not fail with a mismatch: {text}"
        );
        assert!(text.contains(arg), "{case}: rank {rank}'s error does not name {arg}: {text}");
        for (ranks, shape) in [(&evens, shapes[0]), (&odds, shapes[1])] {
            let want = format!("ranks {ranks:?} called");
            let at = text.find(&want).unwrap_or_else(|| panic!("{case}: rank {rank}'s error lacks `{want}`: {text}"));
            let theirs = &text[at..];
            let end = theirs.find(';').unwrap_or(theirs.len());
            let shape = if rows { &shape[1..] } else { shape };
            assert!(
                theirs[..end].contains(&format!("shape {shape:?}")),
                "{case}: rank {rank}'s error does not give ranks {ranks:?} shape {shape:?}: {text}"
            );
        }
        texts.push(text);
    }
    texts
}

const SQUARE: &[usize] = &[4, 4];
const TALL: &[usize] = &[8, 2];

#[test]
fn gather_and_unpad_without_a_layout_fails_every_rank_whose_x_has_another_shape() {
    every_rank_fails("maybe_all_gather_and_maybe_unpad", 2, [SQUARE, TALL], false, "`x`", |_, ep, shape| {
        maybe_all_gather_and_maybe_unpad(&ones(shape), None, ep).map(drop)
    });
}

#[test]
fn pad_and_reduce_without_a_layout_fails_every_rank_whose_x_has_another_shape() {
    every_rank_fails("maybe_pad_and_reduce", 2, [SQUARE, TALL], false, "`x`", |_, ep, shape| {
        maybe_pad_and_reduce(&ones(shape), None, ep).map(drop)
    });
}

#[test]
fn pad_and_reduce_with_a_layout_fails_every_rank_whose_rows_have_another_shape() {
    // The layout's counts agree (4 rows of 4 elements each): the rows do not.
    let l = SpLayout::new(&[2, 2]).unwrap();
    every_rank_fails("maybe_pad_and_reduce", 2, [&[4, 2, 2], &[4, 4, 1]], false, "`x`", |_, ep, shape| {
        maybe_pad_and_reduce(&ones(shape), Some(&l), ep).map(drop)
    });
    every_rank_fails("maybe_all_gather_and_maybe_unpad", 2, [&[2, 2, 2], &[2, 4, 1]], true, "`x`", |_, ep, shape| {
        maybe_all_gather_and_maybe_unpad(&ones(shape), Some(&l), ep).map(drop)
    });
}

#[test]
fn finalize_and_reduce_fails_every_rank_whose_hidden_shape_differs() {
    // Two tokens, K = 1, H = 4 as [2, 2] on some ranks and [4, 1] on others.
    every_rank_fails("finalize_and_reduce", 2, [&[2, 2, 2], &[2, 4, 1]], true, "`expanded_x`", |_, ep, shape| {
        let x = ones(shape);
        let idx = Tensor::from_slice(&[0i32, 1], &[2])?;
        let args = FinalizeArgs {
            expanded_x: &x,
            expanded_row_idx: &idx,
            x1: None,
            x2: None,
            bias: None,
            scales: None,
            expert_idx: None,
            drop_pad_mode: DropPadMode::DropLessRow,
        };
        finalize_and_reduce(&args, None, ep).map(drop)
    });
}

#[test]
fn the_shared_expert_gather_fails_every_rank_whose_rows_have_another_shape_naming_no_token_count() {
    // 4 tokens over TP 2: 2 rows a rank, of 4 elements as [2, 2] or [4, 1].
    // The token counts agree, so the error must not blame them.
    let texts = every_rank_fails("shared_gather_unpad", 2, [&[2, 2, 2], &[2, 4, 1]], true, "`x`", |_, tp, s| {
        shared_gather_unpad(&ones(s), 4, tp).map(drop)
    });
    for (rank, text) in texts.iter().enumerate() {
        assert!(!text.contains("token counts"), "rank {rank}: {text}");
    }
}

#[test]
fn a_reduction_point_fails_every_rank_whose_x_has_another_shape() {
    let policy = ReducePolicy::new(SharedMode::None, false, false, 2, 2).unwrap();
    every_rank_fails("reduce_final", 2, [SQUARE, TALL], false, "`x`", |_, tp, shape| {
        policy.reduce_final(ones(shape), CommType::AllGather, tp).map(drop)
    });
    every_rank_fails("reduce_final_into", 2, [SQUARE, TALL], false, "`x`", |_, tp, shape| {
        let mut out = ones(shape);
        policy.reduce_final_into(&ones(shape), CommType::AllGather, tp, &mut out)
    });
}

#[test]
fn the_tensor_collectives_fail_every_rank_whose_tensor_has_another_shape() {
    let w = 2;
    every_rank_fails("all_reduce", w, [SQUARE, TALL], false, "src", |_, c, s| {
        c.all_reduce(&ones(s), &mut ones(s), ReduceOp::Sum)
    });
    every_rank_fails("all_reduce_in_place", w, [SQUARE, TALL], false, "buf", |_, c, s| {
        c.all_reduce_in_place(&mut ones(s), ReduceOp::Sum)
    });
    every_rank_fails("broadcast", w, [SQUARE, TALL], false, "buf", |_, c, s| c.broadcast(&mut ones(s), 0));
    every_rank_fails("all_gather", w, [SQUARE, TALL], false, "src", |_, c, s| c.all_gather(&ones(s), &mut ones(&[32])));
    every_rank_fails("reduce_scatter", w, [SQUARE, TALL], false, "src", |_, c, s| {
        c.reduce_scatter(&ones(s), &mut ones(&[8]), ReduceOp::Sum)
    });
    every_rank_fails("reduce_scatter_v", w, [SQUARE, TALL], false, "src", |_, c, s| {
        c.reduce_scatter_v(&ones(s), &mut ones(&[8]), &[8, 8], ReduceOp::Sum)
    });
    // The V moves take other row counts per rank, but rows of one shape.
    every_rank_fails("all_gather_v", w, [&[1, 2, 4], &[1, 4, 2]], true, "src row", |r, c, s| {
        c.all_gather_v(&ones(&[1 + r, s[1], s[2]]), &mut ones(&[24]), &[8, 16])
    });
    every_rank_fails("all_to_all_v", w, [&[2, 2, 4], &[2, 8]], true, "src row", |_, c, s| {
        c.all_to_all_v(&ones(s), &[8, 8], &mut ones(&[16]), &[8, 8])
    });
}

#[test]
fn v_moves_of_other_row_counts_in_one_row_shape_still_pass() {
    let res = run_ranks(3, &opts(), |r, c| {
        let mine = Tensor::from_slice(&vec![r as f32; r * 4], &[r, 2, 2])?;
        let mut all = ones(&[3, 2, 2]);
        c.all_gather_v(&mine, &mut all, &[0, 4, 8])?;
        let l = SpLayout::new(&[0, 1, 2]).unwrap();
        let gathered = maybe_all_gather_and_maybe_unpad(&mine, Some(&l), &c)?;
        let reduced = maybe_pad_and_reduce(&gathered, Some(&l), &c)?;
        Ok((all.to_vec::<f32>()?, reduced.to_vec::<f32>()?))
    })
    .expect("every rank passes");
    for (r, (all, reduced)) in res.iter().enumerate() {
        assert_eq!(all, &[1., 1., 1., 1., 2., 2., 2., 2., 2., 2., 2., 2.], "rank {r}");
        assert_eq!(reduced, &vec![3.0 * r as f32; r * 4], "rank {r}");
    }
}

/// The MoE context of `rank` in a world of DP `dp_tokens.len()` x TP `tp`,
/// with `actual` real tokens of its DP rank.
fn context(rank: usize, dp_tokens: &[usize], tp: usize, actual: usize) -> ascend_moe::Result<MoeContext> {
    MoeContext::new(dp_tokens, tp, rank / tp, rank % tp, false)?.with_num_actual_tokens(actual)
}

#[test]
fn tp_ranks_that_count_other_actual_tokens_all_fail_naming_each_count() {
    // DP 2 x TP 2; DP rank 1's TP ranks (world ranks 2 and 3) count 1 and 3
    // real tokens of its 4: each would mark other rows of the MC2 mask real.
    let dp_tokens = [4, 4];
    let res = run_ranks(4, &opts(), |rank, world| {
        let groups = MoeGroups::from_world(&world, 2)?;
        let ctx = context(rank, &dp_tokens, 2, [4, 4, 1, 3][rank])?;
        Ok(prepare(&ones(&[4, 2]), CommType::Mc2, &ctx, &groups).map(|p| p.mc2_mask))
    })
    .expect("the world starts");
    for (rank, r) in res.iter().enumerate() {
        let text = match r {
            Ok(mask) => panic!("rank {rank} prepared (mask {mask:?}) while DP rank 1's TP ranks disagree: {res:?}"),
            Err(e) => e.to_string(),
        };
        assert!(text.contains("num_actual_tokens"), "rank {rank}: {text}");
        assert!(text.contains("DP rank 1: ranks [2] count 1, ranks [3] count 3"), "rank {rank}: {text}");
    }
    // DP ranks may count other real tokens, and a DP rank's TP ranks that
    // agree get masks that mark its first real rows.
    let res = run_ranks(4, &opts(), |rank, world| {
        let groups = MoeGroups::from_world(&world, 2)?;
        let ctx = context(rank, &dp_tokens, 2, [3, 3, 1, 1][rank])?;
        Ok(prepare(&ones(&[4, 2]), CommType::Mc2, &ctx, &groups)?.mc2_mask)
    })
    .expect("every rank prepares");
    let want = [[true, true], [true, false], [true, false], [false, false]];
    for (rank, mask) in res.iter().enumerate() {
        assert_eq!(mask.as_deref(), Some(&want[rank][..]), "rank {rank}");
    }
}

/// Under ALLGATHER without SP the first token collective is in the DP
/// group, which the ranks of the other DP group never share with rank 1:
/// its rows of another shape (4 elements as [2, 2] where its peers' are
/// [4]) must fail every rank in the EP agreement, which compares the row
/// shape, not only the row length. (Over HCCL the same fingerprint is what
/// the opt-in device check compares.)
#[test]
fn prepare_fails_every_rank_when_one_has_rows_of_another_shape() {
    let res = run_ranks(4, &opts(), |rank, world| {
        let groups = MoeGroups::from_world(&world, 2)?;
        let ctx = context(rank, &[2, 2], 2, 2)?;
        let x = if rank == 1 { ones(&[2, 2, 2]) } else { ones(&[2, 4]) };
        Ok(prepare(&x, CommType::AllGather, &ctx, &groups).map(drop))
    })
    .expect("the world starts");
    for (rank, r) in res.iter().enumerate() {
        let text = match r {
            Ok(()) => panic!("rank {rank} prepared while rank 1's rows are [2, 2]: {res:?}"),
            Err(e) => e.to_string(),
        };
        assert!(text.contains("`ctx` or `x`") && text.contains("[0, 2, 3] and [1]"), "rank {rank}: {text}");
        let own = if rank == 1 { "rows of 4 elements (shape [2, 2])" } else { "rows of 4 elements (shape [4])" };
        assert!(text.contains(own), "rank {rank}: {text}");
    }
}

/// Over HCCL, which compares no shapes, a reduction point's opt-in device
/// check (`ASCEND_MOE_CHECK_COMM_TYPE=1`) carries the shape of `x` in the
/// fingerprint it already sends: TP ranks whose `x` is `[4, 4]` and `[8, 2]`
/// fail every rank's stream check naming `x`, while agreeing shapes pass.
/// Without the variable nothing is compared (the opt-in default).
#[test]
#[ignore = "needs an Ascend NPU"]
fn npu_reduction_points_compare_the_shape_of_x_with_the_comm_type_check() {
    use ascend_moe::backend::npu::NpuDevice;
    use ascend_moe::Device;
    const VAR: &str = "ASCEND_MOE_CHECK_COMM_TYPE";
    fn npu(d: &Device) -> &NpuDevice {
        match d {
            Device::Npu(n) => n,
            Device::Cpu => panic!("an NPU device"),
        }
    }
    let run = |odd: bool| {
        ascend_moe::ranks::npu_run_ranks(4, &CommOptions::from_env(), |rank, tp| {
            let policy = ReducePolicy::new(SharedMode::None, false, false, 4, 4)?;
            let shape = if odd && rank >= 2 { TALL } else { SQUARE };
            let x = ones(shape).to_device(&tp.device())?;
            policy.reduce_final(x, CommType::AllGather, &tp)?;
            Ok(npu(&tp.device()).check().map_err(|e| e.to_string()))
        })
        .expect("the world runs")
    };
    // SAFETY: run alone (--ignored --test-threads=1, as ci/sim.sh does); the
    // variable is set before the rank threads start and removed after they joined.
    std::env::set_var(VAR, "1");
    let (agreeing, odd) = (run(false), run(true));
    std::env::remove_var(VAR);
    let unchecked = run(true);
    for (rank, r) in agreeing.iter().enumerate() {
        assert_eq!(r, &Ok(()), "rank {rank}");
    }
    for (rank, r) in odd.iter().enumerate() {
        let e = r.as_ref().expect_err("the shapes of x differ");
        assert!(e.contains("`policy` or `x`") && e.contains("shape of `x`"), "rank {rank}: {e}");
    }
    for (rank, r) in unchecked.iter().enumerate() {
        assert_eq!(r, &Ok(()), "rank {rank}: unchecked");
    }
}
