//! The forward-context guard kernel (`kernels/guard_kernel.cpp`), host build
//! over the real Ascend C headers: it passes a live context equal to the one
//! it was captured for, reports the first differing word with both values,
//! ignores the words its mask leaves out, and refuses a foreign tiling.
//! Tests of the crate's internals, so they live here rather than in `tests/`.

use crate::backend::npu::kernel::guard::*;
use crate::backend::npu::kernel::STATUS_WORDS;
use crate::Error;

const MC2: u32 = 1;
const ALLTOALL: u32 = 2;

fn ctx(comm: u32, actual: Option<usize>, dp: &[usize]) -> ContextWords {
    ContextWords::encode(comm, false, 1, actual, dp).expect("encodes")
}

fn stale(r: crate::Result<()>) -> (String, String, String) {
    match r {
        Err(Error::StaleContext { op, field, captured, live }) => {
            assert_eq!(op, "moe_layer");
            (field, captured, live)
        }
        other => panic!("expected a stale-context error, got {other:?}"),
    }
}

#[test]
fn the_words_follow_the_header_layout() {
    let w = ContextWords::encode(ALLTOALL, true, 2, Some(5), &[6, 3, 9]).unwrap().0;
    assert_eq!(&w[..10], &[0x4346_4D41, 1, 2, 1, 2, 5, 3, 6, 3, 9]);
    assert!(w[10..].iter().all(|&x| x == 0));
    assert_eq!(ctx(MC2, None, &[4]).0[W_ACTUAL], u32::MAX);
    assert!(ContextWords::encode(MC2, false, 1, None, &[]).is_err());
    assert!(ContextWords::encode(MC2, false, 1, None, &[1; CTX_MAX_DP + 1]).is_err());
    assert!(ContextWords::encode(MC2, false, 1, Some(u32::MAX as usize), &[1]).is_err());
}

#[test]
fn tiling_layout_matches_the_c_header() {
    let c = c_guard_tiling_layout().expect("host kernel built");
    let alt = 16 + 4 * CTX_WORDS as u32;
    assert_eq!(c, vec![0, 4, 8, 16, alt, alt + 4, alt + 8]);
    assert_eq!(std::mem::size_of::<GuardTiling>(), alt as usize + 8);
}

#[test]
fn an_unchanged_context_passes() {
    let c = ctx(MC2, Some(3), &[4, 4]);
    let t = GuardTiling::new(&c, true);
    let status = guard_host_status(&c.0, &t).unwrap();
    assert_eq!(status[0], 0, "status {:?}", &status[..4]);
    guard_host("moe_layer", &c.0, &t).unwrap();
}

#[test]
fn a_replay_under_another_comm_type_is_reported_with_both_values() {
    let captured = ctx(MC2, None, &[4, 4]);
    let live = ctx(ALLTOALL, None, &[4, 4]);
    let (field, was, now) = stale(guard_host("moe_layer", &live.0, &GuardTiling::new(&captured, false)));
    assert_eq!(field, "comm_type");
    assert_eq!(was, "1 (MC2)");
    assert_eq!(now, "2 (ALLTOALL)");
}

#[test]
fn new_dp_token_counts_are_reported_at_the_first_differing_rank() {
    let captured = ctx(MC2, None, &[4, 4, 4]);
    let live = ctx(MC2, None, &[4, 7, 2]);
    let (field, was, now) = stale(guard_host("moe_layer", &live.0, &GuardTiling::new(&captured, false)));
    assert_eq!((field.as_str(), was.as_str(), now.as_str()), ("dp_tokens[1]", "4", "7"));
    let fewer = ctx(MC2, None, &[4, 4]);
    let (field, ..) = stale(guard_host("moe_layer", &fewer.0, &GuardTiling::new(&captured, false)));
    assert_eq!(field, "the DP size");
}

#[test]
fn the_actual_token_count_is_compared_only_when_asked() {
    let captured = ctx(MC2, Some(3), &[4, 4]);
    let live = ctx(MC2, Some(2), &[4, 4]);
    guard_host("moe_layer", &live.0, &GuardTiling::new(&captured, false)).unwrap();
    let (field, was, now) = stale(guard_host("moe_layer", &live.0, &GuardTiling::new(&captured, true)));
    assert_eq!((field.as_str(), was.as_str(), now.as_str()), ("num_actual_tokens", "3", "2"));
}

/// The guard of ops writing an MC2 mask: captured with padding (3 of 4
/// real), another count is stale and so is "all"; captured with every token
/// real, the live context may say "all" or the count, and a smaller count is
/// stale (the captured mask would mark its padding real).
#[test]
fn an_mc2_mask_guard_compares_the_actual_tokens_and_takes_all_either_way() {
    let padded = GuardTiling::with_actual_tokens(&ctx(MC2, None, &[4, 4]), 3, 4).unwrap();
    guard_host("moe_layer", &ctx(MC2, Some(3), &[4, 4]).0, &padded).unwrap();
    for live in [Some(2), Some(4), None] {
        let (field, was, _) = stale(guard_host("moe_layer", &ctx(MC2, live, &[4, 4]).0, &padded));
        assert_eq!((field.as_str(), was.as_str()), ("num_actual_tokens", "3"), "live {live:?}");
    }
    let full = GuardTiling::with_actual_tokens(&ctx(MC2, None, &[4, 4]), 4, 4).unwrap();
    for live in [None, Some(4)] {
        guard_host("moe_layer", &ctx(MC2, live, &[4, 4]).0, &full).unwrap();
    }
    let (field, was, now) = stale(guard_host("moe_layer", &ctx(MC2, Some(3), &[4, 4]).0, &full));
    assert_eq!((field.as_str(), was.as_str(), now.as_str()), ("num_actual_tokens", "all", "3"));
}

#[test]
fn a_context_never_written_is_reported() {
    let captured = ctx(MC2, None, &[4]);
    let (field, _, now) = stale(guard_host("moe_layer", &[0; CTX_WORDS], &GuardTiling::new(&captured, false)));
    assert_eq!(field, "the context header (magic)");
    assert!(now.contains("never written"), "{now}");
}

#[test]
fn a_foreign_tiling_is_refused_by_the_kernel() {
    let c = ctx(MC2, None, &[4]);
    let mut t = GuardTiling::new(&c, false);
    t.magic ^= 1;
    let status = guard_host_status(&c.0, &t).unwrap();
    assert_eq!(status.len(), STATUS_WORDS);
    assert_eq!(status[0], 4, "AMOE_FIN_ST_BAD_TILING");
    assert!(matches!(guard_host("moe_layer", &c.0, &t), Err(Error::Kernel { .. })));
    let mut t = GuardTiling::new(&c, false);
    t.words = CTX_WORDS as u32 + 1;
    assert_eq!(guard_host_status(&c.0, &t).unwrap()[0], 4);
}
