//! The cases of the layer matrix and the reports of their runs.

use crate::comm::CommType;
use crate::moe::reduce::SharedMode;
use crate::testing::model::SHARED_INTER;
use crate::{DType, Error, Result};

/// One configuration of the layer matrix.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerCase {
    /// DP size.
    pub dp: usize,
    /// TP size (EP = DP x TP ranks).
    pub tp: usize,
    /// Sequence parallelism.
    pub sp: bool,
    /// The comm type live when the layer runs.
    pub comm: CommType,
    /// The comm type live when the static policy was built. `ReducePolicy::new`
    /// takes no comm type, so this only names the case: it checks that a
    /// policy built while another comm type was live gives the live result
    /// (it replays no captured graph). `None`: same as `comm`.
    pub policy_built_under: Option<CommType>,
    /// Negative control: hand this comm type, instead of the live one, to the
    /// reduction points (a decision made with a stale comm type). A correct check then fails
    /// whenever the two types disagree on `routed_is_reduced`.
    pub stale_reduction_comm: Option<CommType>,
    /// Shared-expert mode.
    pub shared: SharedMode,
    /// The shared expert's weights are TP-sharded: always with `TensorParallel`;
    /// with `SequenceParallelOnly` when TP > 1, the shared expert gathers the
    /// sequence shards, runs its weight shard and reduce-scatters
    /// ([`crate::moe::shared`]). A TP-sharded shared expert with SP on and
    /// TP > 1 is `SequenceParallelOnly`, as vLLM-Ascend classifies it.
    pub shared_tp_weights: bool,
    /// Apply the routed transform.
    pub routed_transform: bool,
    /// Data dtype.
    pub dtype: DType,
    /// Tokens of every DP rank.
    pub dp_tokens: Vec<usize>,
    /// Hidden size.
    pub hidden: usize,
    /// Experts (divisible by EP).
    pub experts: usize,
    /// Top-k.
    pub top_k: usize,
    /// Seed of weights and inputs.
    pub seed: u64,
}

impl LayerCase {
    /// A case with the default model size (H = 8, E = 8, K = 2).
    pub fn new(dp: usize, tp: usize, sp: bool, comm: CommType, shared: SharedMode, dtype: DType) -> Self {
        LayerCase {
            dp,
            tp,
            sp,
            comm,
            policy_built_under: None,
            stale_reduction_comm: None,
            shared,
            shared_tp_weights: shared == SharedMode::TensorParallel,
            routed_transform: false,
            dtype,
            dp_tokens: vec![8; dp],
            hidden: 8,
            experts: 8,
            top_k: 2,
            seed: 7,
        }
    }

    /// One-line name for tables.
    pub fn name(&self) -> String {
        let mut s = format!(
            "dp{} tp{} sp={} {} shared={}{} transform={} {} tokens={:?} H={}",
            self.dp,
            self.tp,
            if self.sp { "on" } else { "off" },
            self.comm.name(),
            self.shared.name(),
            if self.shared == SharedMode::SequenceParallelOnly && self.shared_tp_weights { "(tp-weights)" } else { "" },
            if self.routed_transform { "on" } else { "off" },
            self.dtype,
            self.dp_tokens,
            self.hidden
        );
        if let Some(t) = self.policy_built_under {
            s.push_str(&format!(" policy-built-under={}", t.name()));
        }
        if let Some(t) = self.stale_reduction_comm {
            s.push_str(&format!(" STALE-reductions={}", t.name()));
        }
        s
    }

    /// World size (EP).
    pub fn world(&self) -> usize {
        self.dp * self.tp
    }

    pub(super) fn validate(&self) -> Result<()> {
        const OP: &str = "run_layer_case";
        if self.dp == 0 || self.tp == 0 || self.dp_tokens.len() != self.dp {
            return Err(Error::invalid(
                OP,
                "case",
                format!("dp {} tp {} with dp_tokens {:?}", self.dp, self.tp, self.dp_tokens),
            ));
        }
        if self.experts == 0 || self.experts % self.world() != 0 || self.top_k == 0 || self.top_k > self.experts {
            return Err(Error::invalid(
                OP,
                "case",
                format!("{} experts, top-{} over {} EP ranks", self.experts, self.top_k, self.world()),
            ));
        }
        if SHARED_INTER % self.tp != 0 {
            return Err(Error::invalid(
                OP,
                "case",
                format!("TP {} does not divide the shared size {SHARED_INTER}", self.tp),
            ));
        }
        Ok(())
    }
}

/// The outcome of one case.
#[derive(Debug, Clone)]
pub struct CaseReport {
    /// [`LayerCase::name`].
    pub name: String,
    /// Largest `|got - want|` over all ranks and real rows.
    pub max_abs_err: f64,
    /// Largest `|got - want| / tolerance` (<= 1 passes).
    pub worst_ratio: f64,
    /// Op outputs whose shape was compared with their shape function.
    pub shape_checks: usize,
    /// Rows compared.
    pub rows_checked: usize,
    /// True when every row is within tolerance.
    pub passed: bool,
    /// First mismatch, if any.
    pub detail: String,
}

/// One rank's view of a case: its own rows compared with the reference.
#[derive(Debug, Clone, PartialEq)]
pub struct RankReport {
    /// Largest `|got - want|` over this rank's real rows.
    pub max_abs_err: f64,
    /// Largest `|got - want| / tolerance`.
    pub worst_ratio: f64,
    /// Op outputs whose shape was compared with their shape function.
    pub shape_checks: usize,
    /// Real rows compared.
    pub rows_checked: usize,
    /// True when the rank's output has the right rows and every one is within tolerance.
    pub passed: bool,
    /// First mismatch, if any.
    pub detail: String,
}

/// Token distributions of the matrix for a DP / TP size: even, uneven across
/// DP (1000 and 7, with H = 4), one DP rank with 0 tokens, tokens < TP.
pub fn token_distributions(dp: usize, tp: usize) -> Vec<(&'static str, Vec<usize>, usize)> {
    let mut v = vec![("even", vec![8; dp], 8)];
    if dp == 2 {
        v.push(("uneven", vec![1000, 7], 4));
        v.push(("zero-rank", vec![9, 0], 8));
    }
    if tp > 1 {
        let mut few = vec![tp - 1; dp];
        few[0] = 1;
        v.push(("tokens<tp", few, 8));
    }
    v
}

/// Shared modes valid with and without SP.
pub fn shared_modes(sp: bool) -> Vec<SharedMode> {
    SharedMode::ALL.into_iter().filter(|m| sp || !m.is_sequence_parallel()).collect()
}

/// The whole matrix: DP in {1, 2}, TP in {1, 2, 4}, SP on / off, every comm
/// type, every shared mode valid for the SP setting, f32 and bf16, every token
/// distribution; the routed transform alternates so that every (comm, shared,
/// SP) triple runs with and without it. The TP-sharded shared expert with SP on
/// and TP > 1 runs as `SequenceParallelOnly` with TP-sharded weights
/// ([`LayerCase::shared_tp_weights`]), as `TensorParallel` is refused there.
pub fn all_layer_cases() -> Vec<LayerCase> {
    let mut cases = Vec::new();
    for dp in [1, 2] {
        for tp in [1, 2, 4] {
            for (_, tokens, hidden) in token_distributions(dp, tp) {
                for sp in [false, true] {
                    for mode in shared_modes(sp) {
                        // A TP-sharded shared expert with SP on and TP > 1 is
                        // SequenceParallelOnly (vLLM-Ascend's classification).
                        let reclassified = sp && tp > 1 && mode == SharedMode::TensorParallel;
                        let shared = if reclassified { SharedMode::SequenceParallelOnly } else { mode };
                        for comm in CommType::ALL {
                            for dtype in [DType::F32, DType::BF16] {
                                let mut c = LayerCase::new(dp, tp, sp, comm, shared, dtype);
                                c.shared_tp_weights = mode == SharedMode::TensorParallel;
                                c.dp_tokens = tokens.clone();
                                c.hidden = hidden;
                                c.routed_transform = (dtype == DType::BF16) ^ (comm as u32 % 2 == 1);
                                c.seed = 1000 + cases.len() as u64;
                                cases.push(c);
                            }
                        }
                    }
                }
            }
        }
    }
    cases
}
