//! An end-to-end MoE layer harness: a small deterministic MoE computed on one
//! rank as the reference, then distributed over DP x TP ranks under every comm
//! type, shared-expert mode and SP setting, through the ops of [`crate::moe`].
//! Used by the tests and by `ascend-moe check`.
//!
//! The model: a gate `[E, H]`, top-k routing with softmax weights over the
//! chosen logits, experts `y = tanh(W_e x)` (`W_e` `[H, H]`), an optional shared
//! expert `W2 tanh(W1 x)` (intermediate size 4, TP-sharded in the
//! `TensorParallel` mode) and an optional routed transform `f(v) = v/2 + tanh(v)`
//! (nonlinear, so applying it to a partial sum is visibly wrong). Dense maths
//! runs on the host in f32; the ops under test (prepare / finalize paths,
//! dispatch / combine, finalize routing, finalize-and-reduce, the reduction
//! points) run on the rank's [`Device`](crate::Device), so another backend runs the harness
//! unchanged through its own [`Launcher`].

mod case;
mod forward;
mod run;

pub use case::{all_layer_cases, shared_modes, token_distributions, CaseReport, LayerCase, RankReport};
pub use run::{merge_reports, run_layer_case, run_layer_case_cpu, run_layer_case_rank, CpuLauncher, Launcher};
