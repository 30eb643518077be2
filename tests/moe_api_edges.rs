//! Public-API edges on the CPU backend: huge zero-byte shapes whose row
//! arithmetic overflows must be errors naming the argument (never a panic),
//! a rank whose input is empty must not return `Ok` while a peer that has
//! rows fails, and a rank's bad dispatch / combine arguments fail its peers
//! at once.

use std::time::Duration;

use ascend_moe::comm::ParallelGroups;
use ascend_moe::moe::pad_reduce::{maybe_all_gather_and_maybe_unpad, maybe_pad_and_reduce};
use ascend_moe::moe::prepare_finalize::{dispatch, finalize, prepare, MoeContext, MoeGroups};
use ascend_moe::moe::shared::shared_gather_unpad;
use ascend_moe::ranks::run_ranks;
use ascend_moe::{CommOptions, CommType, DType, Error, Tensor};

fn opts() -> CommOptions {
    CommOptions::with_timeout(Duration::from_secs(20))
}

/// The `Error::Invalid` / `Error::Shape` text of `e`, checked to name `arg`.
fn names(e: &Error, arg: &str) {
    let s = e.to_string();
    assert!(s.contains(arg), "error {s:?} does not name `{arg}`");
}

#[test]
fn parallel_groups_with_overflowing_sizes_is_an_error() {
    // dp_size * tp_size passes usize::MAX: no world has that many ranks.
    let res = run_ranks(1, &opts(), |_, world| Ok(ParallelGroups::new(&world, usize::MAX, 2).map(|_| ())));
    let per_rank = res.expect("the world starts");
    let e = per_rank[0].as_ref().expect_err("dp_size usize::MAX x tp_size 2 is no world of 1 rank");
    names(e, "dp_size");
}

#[test]
fn shared_gather_unpad_of_a_huge_zero_byte_shard_is_an_error_not_an_overflow() {
    // ceil(usize::MAX / 4) = 2^62 rows per rank (zero bytes each), four
    // ranks: 2^64 gathered rows before the unpad, which no shape holds.
    let res = run_ranks(4, &opts(), |_, tp| {
        let x = Tensor::zeros_cpu(&[1 << 62, 0], DType::U8);
        Ok(shared_gather_unpad(&x, usize::MAX, &tp).map(|t| t.shape().to_vec()))
    })
    .expect("the world starts");
    for r in &res {
        names(r.as_ref().expect_err("2^64 gathered rows"), "x");
    }
}

#[test]
fn dispatch_with_tokens_times_top_k_overflowing_is_an_error() {
    // 2^62 zero-byte tokens x top-k 4 = 2^64 slots; no id slice has them.
    let res = run_ranks(1, &opts(), |_, ep| {
        let x = Tensor::zeros_cpu(&[1 << 62, 0], DType::U8);
        Ok(dispatch(&x, &[], 4, None, 1, &ep).map(|_| ()))
    })
    .expect("the world starts");
    names(res[0].as_ref().expect_err("no ids for 2^64 slots"), "topk_ids");
}

/// Runs `op` on two ranks, rank 0 with an empty `[0, 4]` input and rank 1
/// with `rank1_rows` rows: inputs no single EP call can take, so no rank may
/// succeed (SPEC section 8: a rank that calls a different collective yields
/// an error on every rank).
fn empty_rank_against_a_rank_with_rows(
    rank1_rows: usize,
    op: impl Fn(&Tensor, &ascend_moe::Comm) -> ascend_moe::Result<Tensor> + Sync,
) {
    let res = run_ranks(2, &opts(), |rank, ep| {
        let rows = if rank == 0 { 0 } else { rank1_rows };
        let x = Tensor::from_slice(&vec![1.0f32; rows * 4], &[rows, 4])?;
        Ok(op(&x, &ep).map(|t| t.shape().to_vec()))
    })
    .expect("the world starts");
    for (rank, r) in res.iter().enumerate() {
        assert!(r.is_err(), "rank {rank} succeeded with {r:?} while its peer's input differs: {res:?}");
    }
}

#[test]
fn gather_without_layout_fails_on_the_empty_rank_too() {
    empty_rank_against_a_rank_with_rows(2, |x, ep| maybe_all_gather_and_maybe_unpad(x, None, ep));
}

#[test]
fn pad_and_reduce_without_layout_fails_on_the_empty_rank_too() {
    empty_rank_against_a_rank_with_rows(4, |x, ep| maybe_pad_and_reduce(x, None, ep));
}

/// Two DP ranks (TP 1) under ALLGATHER without SP whose contexts disagree on
/// DP rank 1's tokens: rank 0 was given a stale count of 0 (so it sees no
/// row to move anywhere), rank 1 the real count of 2. Rank 0 holds 0 tokens
/// in both views. No rank may succeed.
fn stale_dp_tokens(
    op: impl Fn(&MoeContext, &MoeGroups, usize) -> ascend_moe::Result<Vec<usize>> + Sync,
) -> Vec<ascend_moe::Result<Vec<usize>>> {
    run_ranks(2, &opts(), |rank, world| {
        let dp_tokens: &[usize] = if rank == 0 { &[0, 0] } else { &[0, 2] };
        let ctx = MoeContext::new(dp_tokens, 1, rank, 0, false)?;
        let groups = MoeGroups::from_world(&world, 1)?;
        Ok(op(&ctx, &groups, dp_tokens[rank]))
    })
    .expect("the world starts")
}

#[test]
fn allgather_prepare_fails_on_every_rank_when_one_rank_sees_no_rows() {
    let res = stale_dp_tokens(|ctx, groups, t| {
        let x = Tensor::from_slice(&vec![1.0f32; t * 4], &[t, 4])?;
        prepare(&x, CommType::AllGather, ctx, groups).map(|p| p.hidden.shape().to_vec())
    });
    for (rank, r) in res.iter().enumerate() {
        assert!(r.is_err(), "rank {rank} succeeded with {r:?} while the contexts disagree: {res:?}");
    }
}

#[test]
fn allgather_finalize_fails_on_every_rank_when_one_rank_sees_no_rows() {
    let res = stale_dp_tokens(|ctx, groups, _| {
        // The DP-gathered rows of this rank's context: DP x max_d T_d.
        let rows = ctx.dp_size() * ctx.dp_tokens().iter().max().copied().unwrap_or(0);
        let y = Tensor::from_slice(&vec![1.0f32; rows * 4], &[rows, 4])?;
        finalize(y, CommType::AllGather, ctx, groups).map(|t| t.shape().to_vec())
    });
    for (rank, r) in res.iter().enumerate() {
        assert!(r.is_err(), "rank {rank} succeeded with {r:?} while the contexts disagree: {res:?}");
    }
}

/// A rank whose dispatch or combine arguments are invalid reports them
/// through the exchange its peers are already in: every rank fails at once
/// (well before the timeout), the peers naming that rank and its argument.
#[test]
fn a_bad_dispatch_or_combine_on_one_rank_fails_every_rank_at_once() {
    use ascend_moe::moe::prepare_finalize::combine;
    for bad_combine in [false, true] {
        let start = std::time::Instant::now();
        let res = run_ranks(3, &opts(), |r, ep| {
            let x = Tensor::from_slice(&[1f32; 8], &[2, 4])?;
            // Rank 1 routes a token to expert 9 of 6 unless it is combine that fails.
            let ids: [i32; 2] = if r == 1 && !bad_combine { [0, 9] } else { [0, 5] };
            let d = match dispatch(&x, &ids, 1, None, 6, &ep) {
                Ok(d) => d,
                Err(e) => return Ok(Err(e.to_string())),
            };
            // Rank 1 passes weights for 3 tokens where it dispatched 2.
            let tokens = if r == 1 && bad_combine { 3 } else { 2 };
            let w = Tensor::from_slice(&vec![1f32; tokens], &[tokens, 1])?;
            Ok(combine(&d.rows, &d, &w, &ep).map(|_| ()).map_err(|e| e.to_string()))
        })
        .expect("the world starts");
        let arg = if bad_combine { "topk_weights" } else { "topk_ids" };
        for (r, res) in res.iter().enumerate() {
            let e = res.as_ref().expect_err("every rank fails");
            assert!(e.contains(arg), "combine {bad_combine}: rank {r}: {e}");
            if r != 1 {
                assert!(e.contains("rank 1"), "combine {bad_combine}: rank {r} names rank 1: {e}");
            }
        }
        assert!(start.elapsed() < opts().timeout / 4, "combine {bad_combine}: took {:?}", start.elapsed());
    }
}

/// A context padded to an absurd batch of empty rows: the MC2 prepare's
/// output has no byte, but its mask would have one per row. An error naming
/// the padding, not an abort; a padding whose DP rows overflow is refused
/// when the context is made.
#[test]
fn an_mc2_prepare_padded_past_memory_is_an_error_not_an_abort() {
    let e =
        MoeContext::new(&[4, 4], 2, 0, 0, false).and_then(|c| c.with_padded_num_tokens(usize::MAX - 1)).unwrap_err();
    names(&e, "padded_num_tokens");
    // 2^62 tokens over TP 2: 2^61 prepared rows of no element per rank.
    let huge = 1 << 62;
    let res = run_ranks(2, &opts(), |rank, world| {
        let ctx = MoeContext::new(&[4], 2, 0, rank, false)?.with_padded_num_tokens(huge)?;
        let groups = MoeGroups::from_world(&world, 2)?;
        let x = Tensor::zeros_cpu(&[4, 0], DType::U8);
        let mut out = Tensor::zeros_cpu(&[huge / 2, 0], DType::U8);
        Ok(ascend_moe::moe::prepare_finalize::prepare_into(&x, CommType::Mc2, &ctx, &groups, &mut out).map(|_| ()))
    })
    .expect("the world starts");
    for r in res {
        names(&r.expect_err("no mask of 2^61 rows"), "padded_num_tokens");
    }
}

/// A shape no tensor has (its product overflows) gives a saturated count,
/// never a panic or a wrapped one; a zero dimension still makes it empty.
#[test]
fn the_element_count_of_an_overflowing_meta_saturates() {
    use ascend_moe::types::TensorMeta;
    let meta = |shape| TensorMeta { shape, dtype: DType::F32 };
    assert_eq!(meta(&[usize::MAX, 2]).numel(), usize::MAX);
    assert_eq!(meta(&[3, usize::MAX, 2]).row_len(), usize::MAX);
    assert_eq!(meta(&[usize::MAX, 2, 0]).numel(), 0);
    assert_eq!(meta(&[1 << 32, 1 << 31]).numel(), 1 << 63);
}

#[test]
fn an_ep_world_too_large_with_pcp_names_each_size_the_caller_passed() {
    use ascend_moe::SpLayout;
    let tp = 1usize << 18;
    // 4 x 262144 = 2^20 EP ranks fits; a PCP size of 2 doubles it.
    let ctx = MoeContext::new(&[1; 4], tp, 0, 0, false).expect("2^20 EP ranks");
    let want = format!("dp_size 4 x pcp_size 2 x tp_size {tp} exceeds the maximum of 1048576 EP ranks");
    let e = ctx.with_pcp(2, 0).expect_err("2^21 EP ranks");
    assert!(e.to_string().contains(&want) && e.to_string().contains("`pcp_size`"), "{e}");
    let e = SpLayout::from_dp_tokens_pcp(&[1; 4], 2, tp).expect_err("2^21 EP ranks");
    assert!(e.to_string().contains(&want), "{e}");
    // A product past usize names the sizes as passed, not a saturated one.
    let e = SpLayout::from_dp_tokens_pcp(&[1; 4], 1 << 62, 8).expect_err("2^67 EP ranks");
    assert!(e.to_string().contains(&format!("dp_size 4 x pcp_size {} x tp_size 8", 1usize << 62)), "{e}");
}

/// `pcp_size` is the world size of the PCP group: 0 and 1 are both no PCP
/// (the context's and the groups' constructors read them alike), and a PCP
/// rank past it names the size the caller passed.
#[test]
fn a_pcp_size_of_0_or_1_is_no_pcp_and_errors_name_the_size_passed() {
    let ctx = MoeContext::new(&[3, 5], 2, 1, 1, false).expect("DP 2 x TP 2");
    for size in [0, 1] {
        let c = ctx.clone().with_pcp(size, 0).expect("no PCP");
        assert_eq!((c.pcp_size(), c.pcp_rank(), c.ep_size(), c.ep_rank()), (1, 0, 4, 3), "pcp_size {size}");
    }
    let e = ctx.clone().with_pcp(0, 1).expect_err("rank 1 without PCP").to_string();
    assert!(e.contains("`pcp_rank`: 1 with pcp_size 0") && !e.contains("size 1"), "{e}");
    let e = ctx.with_pcp(2, 2).expect_err("rank 2 of 2").to_string();
    assert!(e.contains("`pcp_rank`: 2 >= PCP size 2"), "{e}");
    let res = run_ranks(2, &opts(), |_, world| {
        use ascend_moe::Collectives;
        let sizes = |g: &MoeGroups| (g.tp.world_size(), g.dp.world_size(), g.pcp.is_some());
        let zero = MoeGroups::from_world_pcp(&world, 0, 2)?;
        let one = MoeGroups::from_world_pcp(&world, 1, 2)?;
        Ok((sizes(&zero), sizes(&one)))
    });
    for r in res.expect("groups") {
        assert_eq!(r, ((2, 1, false), (2, 1, false)));
    }
}

/// `FinalizeDims` reaches the backend's finalize and the fused finalize +
/// reduce-scatter straight from a caller: dims whose products (or padded
/// slots) overflow are errors naming them, on every rank of the collective.
#[test]
fn finalize_dims_whose_products_overflow_are_errors() {
    use ascend_moe::backend::{FinalizeArgs, FinalizeDims, OutputRows};
    use ascend_moe::{Collectives, Device, DropPadMode};
    let x = Tensor::zeros_cpu(&[0, 4], DType::F32);
    let idx = Tensor::zeros_cpu(&[0], DType::I32);
    let args = FinalizeArgs::new(&x, &idx, DropPadMode::DropLessRow);
    let fits = FinalizeDims { n: 0, k: 1, h: 4, expanded_rows: 0, experts: 0 };
    let tokens = FinalizeDims { n: 1 << 63, k: 2, ..fits };
    let mut out = Tensor::zeros_cpu(&[0, 4], DType::F32);
    let e = Device::Cpu.backend().finalize_routing(&args, &tokens, &mut out, OutputRows::Dense).unwrap_err();
    assert!(e.to_string().contains("`dims`") && e.to_string().contains("N*K"), "{e}");
    let padded = |local_sizes: &[usize], slot_rows| {
        let mut out = Tensor::zeros_cpu(&[0, 4], DType::F32);
        let rows = OutputRows::Padded { local_sizes, slot_rows };
        Device::Cpu.backend().finalize_routing(&args, &fits, &mut out, rows).unwrap_err().to_string()
    };
    let e = padded(&[usize::MAX, 1], usize::MAX);
    assert!(e.contains("`local_sizes`") && e.contains("a sum past usize"), "{e}");
    let e = padded(&[0, 0], usize::MAX);
    assert!(e.contains("`dims`") && e.contains("ranks*slot_rows"), "{e}");
    let res = run_ranks(2, &opts(), |_, ep| {
        let mut out = Tensor::zeros_cpu(&[0, 4], DType::F32);
        Ok(ep.finalize_reduce_scatter(&args, &tokens, &[0, 0], &mut out).map_err(|e| e.to_string()))
    })
    .expect("the world starts");
    for (r, res) in res.iter().enumerate() {
        let e = res.as_ref().expect_err("every rank fails");
        assert!(e.contains("N*K"), "rank {r}: {e}");
    }
}

/// EP ranks whose rows differ in length: the receiving rank's room for
/// another rank's rows at its own length is no number. Every rank fails
/// with that reason, none panics.
#[test]
fn dispatch_from_ranks_whose_rows_differ_past_usize_fails_every_rank() {
    let res = run_ranks(2, &opts(), |r, ep| {
        let (x, ids) = if r == 0 {
            (Tensor::zeros_cpu(&[0, 1 << 60], DType::F32), vec![])
        } else {
            (Tensor::zeros_cpu(&[16, 1], DType::F32), vec![0; 16])
        };
        Ok(dispatch(&x, &ids, 1, None, 2, &ep).map(|_| ()).map_err(|e| e.to_string()))
    })
    .expect("the world starts");
    for (r, res) in res.iter().enumerate() {
        let e = res.as_ref().expect_err("every rank fails");
        assert!(e.contains("`x`"), "rank {r}: {e}");
    }
}
