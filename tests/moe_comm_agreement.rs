//! SPEC section 5: every EP rank of a forward must agree on the MoE comm type.
//! When DP ranks disagree (vLLM-Ascend #12195: DP 0 picks ALLGATHER, DP 1 MC2),
//! the prepare op fails on every rank with an error naming which ranks chose
//! which type, instead of an unrelated collective error on some ranks and
//! success on others.

use ascend_moe::moe::prepare_finalize::*;
use ascend_moe::ranks::run_ranks;
use ascend_moe::{CommOptions, CommType, Tensor};

fn opts() -> CommOptions {
    CommOptions::with_timeout(std::time::Duration::from_secs(30))
}

/// Runs prepare on DP 2 x TP 2 with `choice(rank)` as each rank's comm type;
/// returns every rank's outcome (Ok rows or the error message).
fn prepare_with(choice: fn(usize) -> CommType, sp: bool) -> Vec<Result<usize, String>> {
    run_ranks(4, &opts(), |rank, comm| {
        let (d, t) = (rank / 2, rank % 2);
        let ctx = MoeContext::new(&[6, 3], 2, d, t, sp)?;
        let groups = MoeGroups::from_world(&comm, 2)?;
        let local = ctx.local_tokens();
        let x = Tensor::from_slice(&vec![1f32; local * 4], &[local, 4])?;
        Ok(prepare(&x, choice(rank), &ctx, &groups).map(|p| p.hidden.rows()).map_err(|e| e.to_string()))
    })
    .unwrap()
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
fn agreeing_ranks_prepare_as_before() {
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
        assert!(got.iter().all(|r| r.is_ok()), "{ct:?}: {got:?}");
    }
}
