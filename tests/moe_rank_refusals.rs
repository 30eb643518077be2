//! One rank's bad argument to a MoE op (a tensor of the wrong shape, an
//! output that does not fit, a policy for another TP size) is found by that
//! rank alone, before its first collective. Its peers are already waiting in
//! theirs. Each case checks that every rank fails at once: the bad rank with
//! its own error, each peer with a mismatch naming the bad rank and the
//! argument (a peer that waited out the timeout would report a timeout or a
//! failed peer instead, naming neither). As in an engine, every rank keeps
//! its communicator after the call failed.

use std::time::Duration;

use ascend_moe::moe::prepare_finalize::{
    finalize, finalize_into, prepare, prepare_into, prepare_with_mask, prepare_with_mask_into, MoeContext, MoeGroups,
};
use ascend_moe::moe::shared::{shared_gather_unpad, shared_pad_reduce_scatter_into};
use ascend_moe::ranks::run_ranks;
use ascend_moe::{Comm, CommErrorKind, CommOptions, CommType, DType, Error, ReducePolicy, SharedMode, Tensor};

/// The rank whose argument is bad.
const BAD: usize = 1;

fn opts() -> CommOptions {
    CommOptions::with_timeout(Duration::from_secs(30))
}

fn rows(n: usize, h: usize) -> Tensor {
    Tensor::from_slice(&vec![1.0f32; n * h], &[n, h]).expect("a host tensor")
}

/// Runs `op(rank, world)` on `world` CPU ranks and checks the outcome: rank
/// [`BAD`] fails naming `arg`; every other rank fails with a mismatch that
/// names rank [`BAD`] and `arg`.
fn one_bad_rank(case: &str, world: usize, arg: &str, op: impl Fn(usize, &Comm) -> ascend_moe::Result<()> + Sync) {
    let held = std::sync::Barrier::new(world);
    let res = run_ranks(world, &opts(), |rank, comm| {
        let r = op(rank, &comm);
        held.wait();
        Ok(r)
    })
    .expect("the world starts");
    for (rank, r) in res.iter().enumerate() {
        let e = match r {
            Ok(()) => panic!("{case}: rank {rank} succeeded while rank {BAD} passed a bad `{arg}`: {res:?}"),
            Err(e) => e,
        };
        let text = e.to_string();
        assert!(text.contains(arg), "{case}: rank {rank}'s error does not name `{arg}`: {text}");
        if rank != BAD {
            assert!(
                matches!(e, Error::Comm { kind: CommErrorKind::Mismatch, .. }),
                "{case}: rank {rank} did not learn rank {BAD}'s refusal: {text}"
            );
            assert!(
                text.contains(&format!("rank {BAD}")),
                "{case}: rank {rank}'s error does not name rank {BAD}: {text}"
            );
        }
    }
}

/// The context and groups of `rank` in a world of DP `dp_tokens.len()` x TP `tp`.
fn layer(rank: usize, world: &Comm, dp_tokens: &[usize], tp: usize) -> ascend_moe::Result<(MoeContext, MoeGroups)> {
    let ctx = MoeContext::new(dp_tokens, tp, rank / tp, rank % tp, false)?;
    Ok((ctx, MoeGroups::from_world(world, tp)?))
}

/// An MC2 mask of the wrong length on one rank fails every rank at once,
/// whether the prepare writes into `out` or into a tensor of its own.
#[test]
fn prepare_with_a_mask_of_the_wrong_length_on_one_rank_fails_every_rank_at_once() {
    let (dp_tokens, tp) = ([4, 4], 2);
    for into in [false, true] {
        let case = format!("MC2 mask, into {into}");
        one_bad_rank(&case, dp_tokens.len() * tp, "mc2_mask", |rank, world| {
            let (ctx, groups) = layer(rank, world, &dp_tokens, tp)?;
            let x = rows(ctx.local_tokens(), 4);
            let n = 2 + usize::from(rank == BAD);
            let mut mask = Tensor::try_zeros_cpu(&[n], DType::U8)?;
            if into {
                let mut out = rows(2, 4);
                prepare_with_mask_into(&x, CommType::Mc2, &ctx, &groups, &mut out, Some(&mut mask)).map(|_| ())
            } else {
                prepare_with_mask(&x, CommType::Mc2, &ctx, &groups, Some(&mut mask)).map(|_| ())
            }
        });
    }
}

#[test]
fn prepare_of_a_batch_of_the_wrong_size_on_one_rank_fails_every_rank_at_once() {
    // ALLGATHER gathers over DP; MC2 splits over TP without moving a row, so
    // the peers only meet the bad rank in the comm-type agreement.
    for (comm, dp_tokens, tp) in [(CommType::AllGather, [2, 2], 1), (CommType::Mc2, [4, 4], 2)] {
        let case = format!("{comm:?}");
        let world = dp_tokens.len() * tp;
        one_bad_rank(&case, world, "x", |rank, world| {
            let (ctx, groups) = layer(rank, world, &dp_tokens, tp)?;
            let t = ctx.local_tokens() + usize::from(rank == BAD);
            prepare(&rows(t, 4), comm, &ctx, &groups).map(|_| ())
        });
    }
}

#[test]
fn prepare_into_an_output_of_the_wrong_shape_on_one_rank_fails_every_rank_at_once() {
    one_bad_rank("ALLGATHER", 2, "out", |rank, world| {
        let (ctx, groups) = layer(rank, world, &[2, 2], 1)?;
        // DP 2 x 2 rows gathered; the bad rank's output has one row too few.
        let mut out = rows(4 - usize::from(rank == BAD), 4);
        prepare_into(&rows(2, 4), CommType::AllGather, &ctx, &groups, &mut out).map(|_| ())
    });
}

#[test]
fn finalize_of_expert_output_of_the_wrong_size_on_one_rank_fails_every_rank_at_once() {
    // ALLGATHER reduce-scatters over DP, MC2 all-gathers over TP (so with
    // one DP rank every rank is in the bad rank's group).
    for (comm, dp_tokens, tp, prepared) in [(CommType::AllGather, &[2, 2][..], 1, 4), (CommType::Mc2, &[4], 2, 2)] {
        let case = format!("{comm:?}");
        let world = dp_tokens.len() * tp;
        one_bad_rank(&case, world, "y", |rank, world| {
            let (ctx, groups) = layer(rank, world, dp_tokens, tp)?;
            finalize(rows(prepared + usize::from(rank == BAD), 4), comm, &ctx, &groups).map(|_| ())
        });
    }
    one_bad_rank("ALLGATHER into", 2, "out", |rank, world| {
        let (ctx, groups) = layer(rank, world, &[2, 2], 1)?;
        let mut out = rows(2 + usize::from(rank == BAD), 4);
        finalize_into(&rows(4, 4), CommType::AllGather, &ctx, &groups, &mut out)
    });
}

/// ALLGATHER without SP sums the experts' output over DP (and PCP): a
/// one-byte `y` on one rank cannot be summed. It is refused before any
/// collective, so every EP rank fails at once naming it: the ranks of the
/// other DP group too (which would otherwise return), and with PCP the
/// ranks that would otherwise wait out the timeout in the DP reduce-scatter.
#[test]
fn finalize_of_a_one_byte_dtype_on_one_rank_fails_every_rank_at_once() {
    // (DP tokens, PCP, TP): DP 2 x TP 2, and DP 2 x PCP 2.
    let cases: [(&[usize], usize, usize); 2] = [(&[4, 3], 1, 2), (&[2, 2], 2, 1)];
    for ((dp_tokens, pcp, tp), dtype) in cases.iter().flat_map(|c| DType::BYTE_MOVES.map(|d| (c, d))) {
        let world = dp_tokens.len() * pcp * tp;
        for into in [false, true] {
            let case = format!("{dtype} dp {dp_tokens:?} pcp {pcp} tp {tp} into {into}");
            one_bad_rank(&case, world, "`y`", |rank, world| {
                let groups = MoeGroups::from_world_pcp(world, *pcp, *tp)?;
                let dp_rank = rank / (pcp * tp);
                let ctx =
                    MoeContext::new(dp_tokens, *tp, dp_rank, rank % tp, false)?.with_pcp(*pcp, rank / tp % pcp)?;
                let rows = dp_tokens.iter().max().unwrap() * dp_tokens.len() * pcp;
                let dt = if rank == BAD { dtype } else { DType::F32 };
                let y = Tensor::zeros_cpu(&[rows, 4], dt);
                if into {
                    let mut out = Tensor::zeros_cpu(&[ctx.local_tokens(), 4], dt);
                    finalize_into(&y, CommType::AllGather, &ctx, &groups, &mut out)
                } else {
                    finalize(y, CommType::AllGather, &ctx, &groups).map(|_| ())
                }
            });
        }
    }
}

#[test]
fn a_reduction_point_with_a_bad_output_or_policy_on_one_rank_fails_every_rank_at_once() {
    // TP 2 without SP and no shared expert: the final point reduces.
    let policy = |tp| ReducePolicy::new(SharedMode::None, false, false, tp, 2);
    one_bad_rank("output", 2, "out", |rank, tp| {
        let mut out = rows(3 + usize::from(rank == BAD), 4);
        policy(2)?.reduce_final_into(&rows(3, 4), CommType::AllGather, tp, &mut out)
    });
    // A policy for TP 1 on a TP group of two.
    one_bad_rank("policy", 2, "tp", |rank, tp| {
        let p = policy(if rank == BAD { 1 } else { 2 })?;
        p.reduce_final(rows(3, 4), CommType::AllGather, tp).map(|_| ())
    });
}

#[test]
fn a_shared_expert_collective_with_a_bad_shard_on_one_rank_fails_every_rank_at_once() {
    // 5 tokens over TP 2: shards of 3 rows; the bad rank passes 2.
    one_bad_rank("gather_unpad", 2, "x", |rank, tp| {
        shared_gather_unpad(&rows(3 - usize::from(rank == BAD), 4), 5, tp).map(|_| ())
    });
    one_bad_rank("pad_reduce_scatter", 2, "out", |rank, tp| {
        let mut out = Tensor::zeros_cpu(&[3, 4 + usize::from(rank == BAD)], DType::F32);
        shared_pad_reduce_scatter_into(&rows(5, 4), tp, &mut out)
    });
}

#[test]
fn group_sizes_one_rank_gets_wrong_fail_every_rank_at_once() {
    use ascend_moe::comm::ParallelGroups;
    let tp_of_bad = |rank, bad_tp| if rank == BAD { bad_tp } else { 2 };
    // A TP size that does not divide the world, refused through the agreement.
    one_bad_rank("invalid", 2, "tp_size", |rank, world| MoeGroups::from_world(world, tp_of_bad(rank, 3)).map(|_| ()));
    // A valid TP size, but another one: every rank names every rank's sizes.
    one_bad_rank("other", 2, "tp_size", |rank, world| MoeGroups::from_world(world, tp_of_bad(rank, 1)).map(|_| ()));
    one_bad_rank("parallel groups", 4, "dp_size", |rank, world| {
        let tp = tp_of_bad(rank, 1);
        ParallelGroups::new(world, 4 / tp, tp).map(|_| ())
    });
}

/// A rank whose context is stale (its TP rank is not its group's) fails its
/// peers in the comm-type agreement of prepare, which is over the EP group
/// whatever the context says.
#[test]
fn prepare_with_a_context_that_does_not_match_the_groups_on_one_rank_fails_every_rank_at_once() {
    one_bad_rank("stale tp_rank", 4, "`ep`", |rank, world| {
        let (_, groups) = layer(rank, world, &[4, 4], 2)?;
        let tp_rank = if rank == BAD { 0 } else { rank % 2 };
        let ctx = MoeContext::new(&[4, 4], 2, rank / 2, tp_rank, false)?;
        prepare(&rows(4, 4), CommType::AllGather, &ctx, &groups).map(|_| ())
    });
}
