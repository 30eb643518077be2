//! SpLayout and the shape functions of the pad/reduce and prepare/finalize
//! ops, against the SPEC rules written out here, over random layouts.

mod moe_common;

use ascend_moe::moe::layout::SpLayout;
use ascend_moe::moe::pad_reduce::*;
use ascend_moe::moe::prepare_finalize::{
    finalize_output_shape, mc2_mask, mc2_mask_extent, prepare_output_shape, MoeContext,
};
use ascend_moe::CommType;
use moe_common::Rng;

#[test]
fn layout_from_dp_tokens_follows_spec() {
    let l = SpLayout::from_dp_tokens(&[1000, 7], 2).unwrap();
    assert_eq!(l.local_sizes(), &[500, 500, 4, 4]);
    assert_eq!((l.max_rows(), l.total_rows(), l.ep_size(), l.padded_rows()), (500, 1008, 4, 2000));
    assert_eq!(l.offsets(), &[0, 500, 1000, 1004, 1008]);
    let l = SpLayout::from_dp_tokens(&[9, 0], 4).unwrap();
    assert_eq!(l.local_sizes(), &[3, 3, 3, 3, 0, 0, 0, 0]);
    let l = SpLayout::from_dp_tokens(&[0, 0], 2).unwrap();
    assert_eq!((l.max_rows(), l.total_rows()), (0, 0));
    let l = SpLayout::from_dp_tokens(&[1], 4).unwrap();
    assert_eq!(l.local_sizes(), &[1, 1, 1, 1]);
    let l = SpLayout::new(&[3, 0, 5]).unwrap();
    assert_eq!((l.offset(2), l.local_size(1), l.max_rows(), l.is_uniform()), (3, 0, 5, false));
    assert!(SpLayout::new(&[]).unwrap_err().to_string().contains("local_sizes"));
    assert!(SpLayout::from_dp_tokens(&[4], 0).unwrap_err().to_string().contains("tp_size"));
    assert!(SpLayout::from_dp_tokens(&[], 2).unwrap_err().to_string().contains("dp_tokens"));
}

fn random_layout(rng: &mut Rng) -> SpLayout {
    let ep = 1 + rng.below(8);
    let sizes: Vec<usize> = (0..ep).map(|_| if rng.below(4) == 0 { 0 } else { rng.below(9) }).collect();
    SpLayout::new(&sizes).unwrap()
}

#[test]
fn pad_reduce_and_gather_shapes_over_random_layouts() {
    let mut rng = Rng::new(11);
    for _ in 0..500 {
        let l = random_layout(&mut rng);
        let ep = l.ep_size();
        let total: usize = l.local_sizes().iter().sum();
        for r in 0..ep {
            let s = maybe_pad_and_reduce_output_shape(&[total, 3, 2], Some(&l), r, ep).unwrap();
            assert_eq!(s, vec![l.local_sizes()[r], 3, 2]);
            let g = maybe_all_gather_and_maybe_unpad_output_shape(&[l.local_sizes()[r], 5], Some(&l), r, ep).unwrap();
            assert_eq!(g, vec![total, 5]);
        }
    }
    // Without a layout: a plain reduce-scatter / all-gather.
    assert_eq!(maybe_pad_and_reduce_output_shape(&[12, 4], None, 1, 4).unwrap(), vec![3, 4]);
    assert_eq!(maybe_all_gather_and_maybe_unpad_output_shape(&[3, 4], None, 1, 4).unwrap(), vec![12, 4]);
}

fn msg<T: std::fmt::Debug>(r: ascend_moe::Result<T>) -> String {
    r.expect_err("bad input accepted").to_string()
}

#[test]
fn pad_reduce_bad_input_names_argument_expected_and_actual() {
    let l = SpLayout::new(&[3, 0, 5]).unwrap();
    let m = msg(maybe_pad_and_reduce_output_shape(&[8, 4], Some(&l), 0, 4));
    assert!(m.contains("`layout`") && m.contains("3 entries") && m.contains("(4)"), "{m}");
    let m = msg(maybe_pad_and_reduce_output_shape(&[9, 4], Some(&l), 0, 3));
    assert!(m.contains("`x`") && m.contains("9 rows") && m.contains("8"), "{m}");
    let m = msg(maybe_pad_and_reduce_output_shape(&[10, 4], None, 0, 4));
    assert!(m.contains("`x`") && m.contains("10") && m.contains("4"), "{m}");
    let m = msg(maybe_all_gather_and_maybe_unpad_output_shape(&[4, 4], Some(&l), 2, 3));
    assert!(m.contains("`x`") && m.contains("[4, 4]") && m.contains("5 rows"), "{m}");
    let m = msg(maybe_all_gather_and_maybe_unpad_output_shape(&[4, 4], Some(&l), 2, 5));
    assert!(m.contains("`layout`") && m.contains("(5)"), "{m}");
    let m = msg(maybe_pad_and_reduce_output_shape(&[8, 4], Some(&l), 3, 3));
    assert!(m.contains("`ep_rank`") && m.contains('3'), "{m}");
    let m = msg(maybe_pad_and_reduce_output_shape(&[], Some(&l), 0, 3));
    assert!(m.contains("`x`"), "{m}");
}

/// SPEC section 6 rows, written out independently: (prepared rows, output rows).
fn spec_rows(comm: CommType, dp_tokens: &[usize], tp: usize, d: usize, t: usize, sp: bool) -> (usize, usize) {
    let td = dp_tokens[d];
    let max_t = *dp_tokens.iter().max().unwrap();
    let local = if sp { td.div_ceil(tp) } else { td };
    let prepared = match (comm, sp) {
        (CommType::AllGather, true) => dp_tokens.iter().map(|x| x.div_ceil(tp) * tp).sum(),
        (CommType::AllGather, false) => max_t * dp_tokens.len(),
        (CommType::Mc2 | CommType::FusedMc2, false) => max_t.div_ceil(tp),
        (CommType::AllToAll, false) => {
            let p = if td < tp { tp } else { td };
            p / tp + usize::from(t < p % tp)
        }
        (_, true) => local,
    };
    (prepared, local)
}

#[test]
fn prepare_finalize_shapes_follow_spec_for_random_contexts() {
    let mut rng = Rng::new(12);
    for _ in 0..300 {
        let dp = 1 + rng.below(3);
        let tp = [1, 2, 4][rng.below(3)];
        let dp_tokens: Vec<usize> = (0..dp)
            .map(|_| match rng.below(4) {
                0 => 0,
                1 => rng.below(tp + 1),
                _ => rng.below(40),
            })
            .collect();
        let sp = rng.below(2) == 1;
        for d in 0..dp {
            for t in 0..tp {
                let ctx = MoeContext::new(&dp_tokens, tp, d, t, sp).unwrap();
                for comm in CommType::ALL {
                    let (prep, out) = spec_rows(comm, &dp_tokens, tp, d, t, sp);
                    let what = format!("{comm:?} tokens {dp_tokens:?} tp {tp} rank ({d},{t}) sp {sp}");
                    let p = prepare_output_shape(&[ctx.local_tokens(), 6], comm, &ctx).unwrap();
                    assert_eq!(p, vec![prep, 6], "{what}");
                    assert_eq!(finalize_output_shape(&p, comm, &ctx).unwrap(), vec![out, 6], "{what}");
                    // A wrong row count is refused by both.
                    assert!(prepare_output_shape(&[ctx.local_tokens() + 1, 6], comm, &ctx).is_err());
                    assert!(finalize_output_shape(&[prep + 1, 6], comm, &ctx).is_err());
                    let mask = mc2_mask(comm, &ctx);
                    if matches!(comm, CommType::Mc2 | CommType::FusedMc2) {
                        let mask = mask.unwrap();
                        assert_eq!(mask.len(), prep, "{what}");
                        // Real rows: the global padded-row indices of this chunk below T_d.
                        let first = t * prep;
                        let real = (first..first + prep).filter(|g| *g < dp_tokens[d]).count();
                        assert_eq!(mask.iter().filter(|m| **m).count(), real, "{what}");
                        assert!(mask.windows(2).all(|w| w[0] >= w[1]), "{what}: real rows first");
                        assert_eq!(mc2_mask_extent(comm, &ctx), Some((prep, real)), "{what}");
                    } else {
                        assert!(mask.is_none() && mc2_mask_extent(comm, &ctx).is_none());
                    }
                }
            }
        }
    }
}

#[test]
fn huge_ep_sizes_and_token_counts_are_errors_not_panics() {
    use ascend_moe::moe::layout::MAX_EP_RANKS;
    let mut rng = Rng::new(31);
    for case in 0..200 {
        let dp = 1 + rng.below(4);
        let dp_tokens: Vec<usize> = (0..dp).map(|_| rng.below(1000)).collect();
        // A TP size past the EP bound: just over it, near usize::MAX, or a random huge one.
        let tp = match case % 3 {
            0 => MAX_EP_RANKS / dp + 1,
            1 => usize::MAX - rng.below(1000),
            _ => (1usize << 21) + rng.below(1 << 40),
        };
        assert!(dp.checked_mul(tp).map_or(true, |ep| ep > MAX_EP_RANKS), "case {case}");
        let res = std::panic::catch_unwind(|| SpLayout::from_dp_tokens(&dp_tokens, tp))
            .unwrap_or_else(|_| panic!("case {case}: from_dp_tokens({dp_tokens:?}, {tp}) panicked"));
        let e = res.expect_err("EP size past the bound").to_string();
        assert!(e.contains("`tp_size`") && e.contains(&tp.to_string()), "case {case}: {e}");
        let res = std::panic::catch_unwind(|| MoeContext::new(&dp_tokens, tp, 0, 0, true))
            .unwrap_or_else(|_| panic!("case {case}: MoeContext::new panicked"));
        let e = res.expect_err("EP size past the bound").to_string();
        assert!(e.contains("`tp_size`") && e.contains(&MAX_EP_RANKS.to_string()), "case {case}: {e}");
    }
    // At the bound the layout is built.
    let l = SpLayout::from_dp_tokens(&[3], MAX_EP_RANKS).unwrap();
    assert_eq!((l.ep_size(), l.total_rows()), (MAX_EP_RANKS, MAX_EP_RANKS));
    assert!(SpLayout::uniform(MAX_EP_RANKS + 1, 1).unwrap_err().to_string().contains("`ep_size`"));
    // Token counts whose padded rows overflow.
    let e = MoeContext::new(&[usize::MAX, 1], 2, 0, 0, false).unwrap_err().to_string();
    assert!(e.contains("`dp_tokens`"), "{e}");
    let e = SpLayout::new(&[usize::MAX / 2 + 1, 3]).unwrap_err().to_string();
    assert!(e.contains("`local_sizes`"), "{e}");
}
