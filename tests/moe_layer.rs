//! The end-to-end MoE layer matrix of SPEC sections 3-6 (every comm type, SP
//! on and off, every shared-expert mode, f32 and bf16, uneven and zero-token
//! DP ranks), a policy built while another comm type was live, and a negative
//! control showing the check catches reductions decided with a stale comm
//! type: each body on the CPU backend and, ignored without an NPU, on NPUs
//! through HCCL (`backend_test!`; ranks are threads on NPUs 0..world;
//! `ci/sim.sh` runs them on the simulated runtime).

use ascend_moe::moe::reduce::{routed_is_reduced, SharedMode};
use ascend_moe::ranks::npu_run_ranks;
use ascend_moe::testing::layer::{all_layer_cases, run_layer_case, CpuLauncher, Launcher, LayerCase, RankReport};
use ascend_moe::{Comm, CommOptions, CommType, DType, Device, Result};

mod common;
use common::On;

/// Rank `r` on NPU `r`, one HCCL world per case.
struct NpuLauncher;

impl Launcher for NpuLauncher {
    fn device(&self, rank: usize) -> Result<Device> {
        Device::npu(rank as u32)
    }
    fn launch(
        &self,
        world: usize,
        body: &(dyn Fn(usize, Comm) -> Result<RankReport> + Sync),
    ) -> Result<Vec<RankReport>> {
        npu_run_ranks(world, &CommOptions::from_env(), body)
    }
}

/// The launcher of `on`'s backend.
fn launcher(on: On) -> &'static dyn Launcher {
    static CPU: CpuLauncher = CpuLauncher { opts: None };
    match on {
        On::Cpu => &CPU,
        On::Npu => &NpuLauncher,
    }
}

/// Runs every case of DP `dp` x TP `tp` on `on`'s backend.
fn run_matrix(on: On, dp: usize, tp: usize) {
    let cases: Vec<LayerCase> = all_layer_cases().into_iter().filter(|c| c.dp == dp && c.tp == tp).collect();
    assert!(!cases.is_empty(), "no cases for DP{dp} x TP{tp}");
    let mut failed = Vec::new();
    for c in &cases {
        match run_layer_case(c, launcher(on)) {
            Ok(r) if r.passed && r.shape_checks > 0 => {}
            Ok(r) => failed.push(format!("{}: {} (max err {:.3e})", r.name, r.detail, r.max_abs_err)),
            Err(e) => failed.push(format!("{}: error {e}", c.name())),
        }
    }
    assert!(failed.is_empty(), "{} of {} cases failed:\n{}", failed.len(), cases.len(), failed.join("\n"));
}

backend_test!(matrix_dp1_tp1, |on: On| run_matrix(on, 1, 1));
backend_test!(matrix_dp1_tp2, |on: On| run_matrix(on, 1, 2));
backend_test!(matrix_dp1_tp4, |on: On| run_matrix(on, 1, 4));
backend_test!(matrix_dp2_tp1, |on: On| run_matrix(on, 2, 1));
backend_test!(matrix_dp2_tp2, |on: On| run_matrix(on, 2, 2));

// CPU only: DP2 x TP4 is 8 ranks, and the NPU suite runs on 4 devices.
#[test]
fn matrix_dp2_tp4() {
    run_matrix(On::Cpu, 2, 4);
}

#[test]
fn matrix_covers_the_issue() {
    let cases = all_layer_cases();
    for comm in CommType::ALL {
        for sp in [false, true] {
            for shared in SharedMode::ALL {
                if shared.is_sequence_parallel() && !sp {
                    continue;
                }
                for transform in [false, true] {
                    assert!(
                        cases.iter().any(|c| c.comm == comm
                            && c.sp == sp
                            && c.shared == shared
                            && c.routed_transform == transform),
                        "{comm:?} sp {sp} {shared:?} transform {transform}"
                    );
                }
            }
        }
    }
    for dtype in [DType::F32, DType::BF16] {
        assert!(cases.iter().any(|c| c.dtype == dtype));
    }
    assert!(cases.iter().any(|c| c.dp_tokens == [1000, 7]));
    assert!(cases.iter().any(|c| c.dp_tokens.contains(&0)));
    assert!(cases.iter().any(|c| c.dp_tokens.iter().any(|t| *t < c.tp)));
    assert!(cases.iter().all(|c| c.world() <= 8));
}

backend_test!(report_counts_every_real_token_and_shape, |on: On| {
    let mut c = LayerCase::new(2, 2, true, CommType::AllGather, SharedMode::SequenceParallelOnly, DType::F32);
    c.shared_tp_weights = true;
    c.dp_tokens = vec![5, 3];
    let r = run_layer_case(&c, launcher(on)).unwrap();
    assert!(r.passed, "{}", r.detail);
    assert_eq!(r.rows_checked, 8);
    assert!(r.shape_checks >= 4 * 4, "{}", r.shape_checks);
});

// For every pair (A, B) of comm types: the policy built while A was live,
// run with B live, gives the result under B: sum S_i + R. The policy's
// constructor takes no comm type, so A changes nothing it could capture;
// captured graphs replayed under another comm type are tested in
// `npu_graph_capture`.
backend_test!(a_policy_built_while_another_comm_type_was_live_gives_the_live_result, |on: On| {
    for (dp, tp, sp, shared, transform) in [
        (2, 2, false, SharedMode::TensorParallel, false),
        (1, 4, false, SharedMode::TensorParallel, true),
        (2, 2, false, SharedMode::DataParallelOnly, false),
        (2, 2, true, SharedMode::SequenceParallelOnly, false),
        (2, 2, true, SharedMode::SequenceParallelSedp, true),
    ] {
        for a in CommType::ALL {
            for b in CommType::ALL {
                let mut c = LayerCase::new(dp, tp, sp, b, shared, DType::F32);
                // The TP-sharded shared expert under SP (SequenceParallelOnly).
                c.shared_tp_weights = shared == SharedMode::SequenceParallelOnly || c.shared_tp_weights;
                c.policy_built_under = Some(a);
                c.routed_transform = transform;
                c.dp_tokens = if dp == 2 { vec![6, 3] } else { vec![5] };
                let r = run_layer_case(&c, launcher(on)).unwrap();
                assert!(r.passed, "{}: {}", r.name, r.detail);
            }
        }
    }
});

// Negative control: reductions decided with a stale comm type A while
// B is live must be caught by the same check whenever A and B disagree on
// `routed_is_reduced` (sum S_i + TP x R, or a missing reduction).
backend_test!(reductions_decided_with_a_stale_comm_type_are_caught, |on: On| {
    let mut caught = 0;
    for a in CommType::ALL {
        for b in CommType::ALL {
            let mut c = LayerCase::new(2, 2, false, b, SharedMode::TensorParallel, DType::F32);
            c.stale_reduction_comm = Some(a);
            c.dp_tokens = vec![6, 3];
            let r = run_layer_case(&c, launcher(on)).unwrap();
            let same = routed_is_reduced(a, false) == routed_is_reduced(b, false);
            assert_eq!(r.passed, same, "{}: {}", r.name, r.detail);
            caught += usize::from(!same);
        }
    }
    assert_eq!(caught, 6);
});

// A TP-sharded shared expert declared `TensorParallel` with SP on and TP > 1
// is refused (it is `SequenceParallelOnly` in vLLM-Ascend); the same expert
// declared `SequenceParallelOnly` runs through the shared-expert SP helpers and
// gives the single-rank result, under every comm type.
backend_test!(tensor_parallel_shared_expert_under_sp_is_sequence_parallel_only, |on: On| {
    let mut c = LayerCase::new(2, 2, true, CommType::AllGather, SharedMode::TensorParallel, DType::F32);
    c.dp_tokens = vec![5, 3];
    let e = run_layer_case(&c, launcher(on)).unwrap_err().to_string();
    assert!(e.contains("SequenceParallelOnly"), "{e}");
    for comm in CommType::ALL {
        let mut c = LayerCase::new(2, 2, true, comm, SharedMode::SequenceParallelOnly, DType::F32);
        c.shared_tp_weights = true;
        c.dp_tokens = vec![5, 3];
        let r = run_layer_case(&c, launcher(on)).unwrap();
        assert!(r.passed && r.name.contains("sp-only(tp-weights)"), "{}: {}", r.name, r.detail);
    }
});
