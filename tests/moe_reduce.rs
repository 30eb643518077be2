//! Runtime-aware reductions (SPEC section 5): the truth table, the policy, and
//! the invariant "layer output = sum_i S_i + R" for every static policy and
//! every live comm type, also when the policy was built under another comm
//! type, checked on a numeric model of the TP ranks; and the reduction points
//! themselves on every backend (`backend_test!`).

use ascend_moe::moe::reduce::{routed_is_reduced, ReducePoint, ReducePolicy, SharedMode};
use ascend_moe::moe::Output;
use ascend_moe::{Collectives, CommOptions, CommType, DType, Tensor};

mod common;

#[test]
fn routed_is_reduced_truth_table() {
    use CommType::*;
    let table = [
        (AllGather, false, false),
        (AllGather, true, true),
        (Mc2, false, true),
        (Mc2, true, true),
        (AllToAll, false, true),
        (AllToAll, true, true),
        (FusedMc2, false, true),
        (FusedMc2, true, true),
    ];
    for (c, sp, want) in table {
        assert_eq!(routed_is_reduced(c, sp), want, "{c:?} sp {sp}");
    }
    assert!(CommType::from_u32(4).unwrap_err().to_string().contains('4'));
}

fn policies() -> Vec<ReducePolicy> {
    let mut v = Vec::new();
    for shared in SharedMode::ALL {
        for transform in [false, true] {
            for sp in [false, true] {
                for (tp, ep) in [(1, 1), (1, 2), (2, 2), (2, 4), (4, 4), (4, 8)] {
                    if let Ok(p) = ReducePolicy::new(shared, transform, sp, tp, ep) {
                        v.push(p);
                    }
                }
            }
        }
    }
    v
}

/// Whether a point's result depends on the live comm type, which decides
/// whether it needs a guard of the live context: only over more than one TP
/// rank, and only where the SPEC section 5 decision differs between comm
/// types (ALLGATHER without SP leaves the routed output TP-partial, every
/// other comm type reduces it).
#[test]
fn a_point_depends_on_the_comm_type_only_where_its_decision_differs_over_tp() {
    use ReducePoint::*;
    use SharedMode::*;
    // (shared mode, transform, sp, tp, ep) -> [routed early, shared, final]
    let table = [
        // No early reduce: the final point reduces only under ALLGATHER.
        ((None, false, false, 2, 2), [false, false, true]),
        // One TP rank: nothing to reduce, whatever the comm type.
        ((None, false, false, 1, 2), [false, false, false]),
        // TP-sharded shared expert: the shared point follows the routed output.
        ((TensorParallel, false, false, 2, 4), [false, true, true]),
        // Early reduce (DP-only shared expert): the routed point, and not the final one.
        ((DataParallelOnly, false, false, 2, 2), [true, false, false]),
        // SP: the routed output is complete under every comm type.
        ((SequenceParallelOnly, false, true, 2, 2), [false, false, false]),
    ];
    for ((mode, transform, sp, tp, ep), want) in table {
        let p = ReducePolicy::new(mode, transform, sp, tp, ep).expect("valid policy");
        let got = [RoutedEarly, Shared, Final].map(|pt| p.depends_on_comm_type(pt));
        assert_eq!(got, want, "{mode:?} transform {transform} sp {sp} tp {tp} ep {ep}");
    }
}

#[test]
fn early_follows_spec() {
    for p in policies() {
        let want = p.shared_mode() == SharedMode::DataParallelOnly
            || (p.has_routed_transform() && !p.sp() && (p.tp_size() > 1 || p.ep_size() > 1));
        assert_eq!(p.early(), want, "{p:?}");
    }
}

#[test]
fn bad_policy_input_is_named() {
    let e = ReducePolicy::new(SharedMode::SequenceParallelOnly, false, false, 2, 4).unwrap_err().to_string();
    assert!(e.contains("`shared_mode`") && e.contains("sp"), "{e}");
    let e = ReducePolicy::new(SharedMode::None, false, false, 2, 3).unwrap_err().to_string();
    assert!(e.contains("`ep_size`") && e.contains('3') && e.contains('2'), "{e}");
    let e = ReducePolicy::new(SharedMode::None, false, false, 0, 3).unwrap_err().to_string();
    assert!(e.contains("`tp_size`"), "{e}");
    assert!(SharedMode::from_u32(9).unwrap_err().to_string().contains('9'));
}

/// A numeric model of one token on `tp` ranks: shared partials `s[t]` (their
/// sum is the shared output when TP-sharded, else every rank holds the whole
/// `S`), routed partials `r[t]` summing to `R`. Runs the three reduction points
/// with `decide` as the comm type given to them and `live` as the comm type
/// that produced the routed output; returns each rank's output.
fn simulate(p: &ReducePolicy, live: CommType, decide: CommType) -> (Vec<f64>, f64) {
    let tp = p.tp_size();
    let s_part: Vec<f64> = (0..tp).map(|t| 0.25 + t as f64).collect();
    let r_part: Vec<f64> = (0..tp).map(|t| 1.5 + 2.0 * t as f64).collect();
    let (s_total, r_total) = (s_part.iter().sum::<f64>(), r_part.iter().sum::<f64>());
    let f = |v: f64| if p.has_routed_transform() { v * v + 1.0 } else { v };
    let all_reduce = |v: &mut Vec<f64>| {
        let s: f64 = v.iter().sum();
        v.iter_mut().for_each(|x| *x = s);
    };
    let mut routed: Vec<f64> = if routed_is_reduced(live, p.sp()) { vec![r_total; tp] } else { r_part.clone() };
    let mut shared: Vec<f64> = match p.shared_mode() {
        SharedMode::None => vec![0.0; tp],
        SharedMode::TensorParallel => s_part.clone(),
        _ => vec![s_total; tp],
    };
    let want = if p.shared_mode() == SharedMode::None { 0.0 } else { s_total } + f(r_total);
    if p.routed_early_reduces(decide) {
        all_reduce(&mut routed);
    }
    let routed: Vec<f64> = routed.into_iter().map(f).collect();
    if p.shared_reduces(decide) {
        all_reduce(&mut shared);
    }
    let mut out: Vec<f64> = shared.iter().zip(&routed).map(|(a, b)| a + b).collect();
    if p.final_reduces(decide) {
        all_reduce(&mut out);
    }
    (out, want)
}

/// A policy is only meaningful where its transform sees a complete routed sum:
/// the SPEC's `early` covers transforms without SP; with SP every comm type
/// returns the full sum.
fn transform_sees_full_sum(p: &ReducePolicy, live: CommType) -> bool {
    !p.has_routed_transform() || p.early() || routed_is_reduced(live, p.sp()) || p.tp_size() == 1
}

#[test]
fn a_policy_built_while_another_comm_type_was_live_reduces_exactly_once() {
    let mut checked = 0;
    for p in policies() {
        // The policy is built while some comm type is live and then run under
        // every live comm type. Its constructor takes no comm type, so the
        // one built under each type equals the others; this loop replays no
        // captured graph (that is npu_graph_capture's).
        for built_under in CommType::ALL {
            let built =
                ReducePolicy::new(p.shared_mode(), p.has_routed_transform(), p.sp(), p.tp_size(), p.ep_size()).unwrap();
            assert_eq!(built, p, "a policy built while {built_under:?} was live differs");
            for live in CommType::ALL {
                if !transform_sees_full_sum(&p, live) {
                    continue;
                }
                let (out, want) = simulate(&built, live, live);
                for (t, o) in out.iter().enumerate() {
                    assert!(
                        (o - want).abs() < 1e-12,
                        "{p:?} built under {built_under:?} live {live:?}: rank {t} got {o}, want {want}"
                    );
                }
                checked += 1;
            }
        }
    }
    assert!(checked > 500, "{checked}");
}

#[test]
fn decisions_made_with_a_stale_comm_type_would_be_caught() {
    // The bug class the API removes: deciding with a comm type that is no
    // longer the live one (e.g. the one live when a graph was captured).
    // The same model shows sum S + TP*R or a missing reduction for it.
    let p = ReducePolicy::new(SharedMode::TensorParallel, false, false, 2, 4).unwrap();
    let (out, want) = simulate(&p, CommType::Mc2, CommType::AllGather);
    let tp_r = 0.25 + 1.25 + 2.0 * (1.5 + 3.5);
    assert!((out[0] - tp_r).abs() < 1e-12 && (out[0] - want).abs() > 1.0, "{out:?} vs {want}");
    let (out, want) = simulate(&p, CommType::AllGather, CommType::Mc2);
    assert!((out[0] - want).abs() > 1.0, "missing reduction must show: {out:?} vs {want}");
}

// Every reduction point's `_into` twin gives the consuming point's result
// bit for bit, into an `out` full of NaN, for every policy of TP 1 or 2 and
// every live comm type, and leaves `x` unchanged. Bit for bit on every
// backend: a sum over at most two ranks is the same in either order.
backend_test!(into_reduction_points_equal_the_consuming_ones_bit_for_bit, |on: On| {
    let opts = CommOptions::with_timeout(std::time::Duration::from_secs(30));
    for tp in [1usize, 2] {
        let ps: Vec<ReducePolicy> = policies().into_iter().filter(|p| p.tp_size() == tp).collect();
        assert!(!ps.is_empty());
        on.run(tp, &opts, |r, comm| {
            let dev = comm.device();
            let x: Vec<f32> = (0..24).map(|i| (i * (r + 3)) as f32 * 0.37 - 2.0).collect();
            for p in &ps {
                for c in CommType::ALL {
                    for point in 0..3 {
                        let xt = Tensor::from_slice(&x, &[4, 6])?.to_device(&dev)?;
                        let mut out = Tensor::from_slice(&[f32::NAN; 24], &[4, 6])?.to_device(&dev)?;
                        let want = match point {
                            0 => p.reduce_routed_early(xt.try_clone()?, c, &comm)?,
                            1 => p.reduce_shared(xt.try_clone()?, c, &comm)?,
                            _ => p.reduce_final(xt.try_clone()?, c, &comm)?,
                        };
                        match point {
                            0 => p.reduce_routed_early_into(&xt, c, &comm, &mut out)?,
                            1 => p.reduce_shared_into(&xt, c, &comm, &mut out)?,
                            _ => p.reduce_final_into(&xt, c, &comm, &mut out)?,
                        }
                        let (got, want) = (out.to_vec::<f32>()?, want.to_vec::<f32>()?);
                        assert!(
                            got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()),
                            "{p:?} {c:?} point {point}: {got:?} vs {want:?}"
                        );
                        assert_eq!(xt.to_vec::<f32>()?, x, "x is read, never written");
                    }
                }
            }
            Ok(())
        })
        .unwrap();
    }
});

backend_test!(into_reduction_points_refuse_an_out_of_the_wrong_shape_or_dtype_naming_out, ranks = 1, |_, comm| {
    let p = ReducePolicy::new(SharedMode::TensorParallel, false, false, 1, 1).unwrap();
    let dev = comm.device();
    let x = Tensor::from_slice(&[1f32; 6], &[2, 3])?.to_device(&dev)?;
    for mut bad in [Tensor::zeros(&[3, 2], DType::F32, &dev)?, Tensor::zeros(&[2, 3], DType::BF16, &dev)?] {
        for (op, e) in [
            ("reduce_routed_early", p.reduce_routed_early_into(&x, CommType::AllGather, &comm, &mut bad)),
            ("reduce_shared", p.reduce_shared_into(&x, CommType::AllGather, &comm, &mut bad)),
            ("reduce_final", p.reduce_final_into(&x, CommType::AllGather, &comm, &mut bad)),
        ] {
            let e = e.unwrap_err().to_string();
            assert!(e.contains("`out`") && e.contains(op), "{op}: {e}");
        }
    }
    Ok(())
});

backend_test!(into_reduction_points_copy_and_reduce_a_scalar_too, |on: On| {
    let p = ReducePolicy::new(SharedMode::TensorParallel, false, false, 2, 2).unwrap();
    assert!(p.final_reduces(CommType::AllGather) && !p.final_reduces(CommType::Mc2));
    let outs = on
        .run(2, &CommOptions::with_timeout(std::time::Duration::from_secs(30)), |r, comm| {
            let dev = comm.device();
            let x = Tensor::from_slice(&[1.5f32 + r as f32], &[])?.to_device(&dev)?;
            let mut reduced = Tensor::from_slice(&[f32::NAN], &[])?.to_device(&dev)?;
            p.reduce_final_into(&x, CommType::AllGather, &comm, &mut reduced)?;
            let mut copied = Tensor::from_slice(&[f32::NAN], &[])?.to_device(&dev)?;
            p.reduce_final_into(&x, CommType::Mc2, &comm, &mut copied)?;
            assert!(reduced.shape().is_empty() && copied.shape().is_empty());
            Ok((reduced.to_vec::<f32>()?, copied.to_vec::<f32>()?))
        })
        .unwrap();
    for (r, (reduced, copied)) in outs.into_iter().enumerate() {
        assert_eq!(reduced, vec![4.0], "rank {r}");
        assert_eq!(copied, vec![1.5 + r as f32], "rank {r}");
    }
});

backend_test!(reduction_points_refuse_a_tp_group_of_another_size_naming_tp, ranks = 1, |_, comm| {
    // A policy for TP 2 given a one-rank group: every form fails before any
    // collective, naming `tp` and both sizes.
    let p = ReducePolicy::new(SharedMode::TensorParallel, false, false, 2, 2).unwrap();
    let dev = comm.device();
    let x = Tensor::from_slice(&[1f32; 6], &[2, 3])?.to_device(&dev)?;
    for point in [ReducePoint::RoutedEarly, ReducePoint::Shared, ReducePoint::Final] {
        for comm_type in [CommType::AllGather, CommType::Mc2] {
            let mut inplace = x.try_clone()?;
            let mut out = Tensor::zeros(&[2, 3], DType::F32, &dev)?;
            for e in [
                p.reduce_at(point, x.try_clone()?, comm_type, &comm).map(|_| ()),
                p.reduce_at_into(point, Output::InPlace(&mut inplace), comm_type, &comm),
                p.reduce_at_into(point, Output::Separate { x: &x, out: &mut out }, comm_type, &comm),
            ] {
                let e = e.unwrap_err().to_string();
                assert!(
                    e.contains(point.op()) && e.contains("`tp`") && e.contains("1 ranks") && e.contains("tp_size is 2"),
                    "{point:?} {comm_type:?}: {e}"
                );
            }
        }
    }
    Ok(())
});
