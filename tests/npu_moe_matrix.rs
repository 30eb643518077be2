//! The MoE layer matrix of SPEC sections 3-6 on NPUs: every comm type, SP on
//! and off, every shared-expert mode, f32 and bf16, uneven and zero-token DP
//! ranks, on world 4 as DP2 x TP2 and DP1 x TP4 (EP4), and on world 2. The
//! layer harness (`testing::layer`) runs each case against its single-rank
//! reference; here the ranks are threads on NPUs 0..world through HCCL.
//! Ignored without an NPU (`ci/npu-4card.sh` runs it).

use ascend_moe::backend::npu::npu_run_ranks;
use ascend_moe::testing::layer::{all_layer_cases, run_layer_case, Launcher, LayerCase, RankReport};
use ascend_moe::{Comm, CommOptions, Device, Result};

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

fn run_matrix(dp: usize, tp: usize) {
    let cases: Vec<LayerCase> = all_layer_cases().into_iter().filter(|c| c.dp == dp && c.tp == tp).collect();
    assert!(!cases.is_empty(), "no cases for DP{dp} x TP{tp}");
    let mut failed = Vec::new();
    for c in &cases {
        match run_layer_case(c, &NpuLauncher) {
            Ok(r) if r.passed && r.shape_checks > 0 => {}
            Ok(r) => failed.push(format!("{}: {} (max err {:.3e})", r.name, r.detail, r.max_abs_err)),
            Err(e) => failed.push(format!("{}: error {e}", c.name())),
        }
    }
    assert!(failed.is_empty(), "{} of {} cases failed on NPU:\n{}", failed.len(), cases.len(), failed.join("\n"));
}

#[test]
#[ignore = "needs an Ascend NPU"]
fn npu_matrix_dp2_tp2() {
    run_matrix(2, 2);
}

#[test]
#[ignore = "needs an Ascend NPU"]
fn npu_matrix_dp1_tp4_ep4() {
    run_matrix(1, 4);
}

#[test]
#[ignore = "needs an Ascend NPU"]
fn npu_matrix_dp2_tp1() {
    run_matrix(2, 1);
}

#[test]
#[ignore = "needs an Ascend NPU"]
fn npu_matrix_dp1_tp2() {
    run_matrix(1, 2);
}
