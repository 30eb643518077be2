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
//! points) run on the rank's [`Device`], so another backend runs the harness
//! unchanged through its own [`Launcher`].

use crate::backend::cpu::finalize::set_num_threads;
use crate::backend::FinalizeArgs;
use crate::comm::{Collectives, Comm, CommOptions, CommType};
use crate::moe::finalize::moe_finalize_routing;
use crate::moe::finalize::moe_finalize_routing_output_shape;
use crate::moe::pad_reduce::{finalize_and_reduce, finalize_and_reduce_output_shape};
use crate::moe::prepare_finalize::{
    combine, dispatch, finalize, finalize_output_shape, prepare, prepare_output_shape, MoeContext, MoeGroups,
};
use crate::moe::reduce::{ReducePolicy, SharedMode};
use crate::moe::shared::{
    shared_gather_unpad, shared_gather_unpad_output_shape, shared_pad_reduce_scatter,
    shared_pad_reduce_scatter_output_shape, shared_pad_split, shared_pad_split_output_shape,
};
use crate::{with_dtype, DType, Device, DropPadMode, Element, Error, Result, Tensor};

use super::model::{transform, Model, Spec, SHARED_INTER};
pub use super::tolerance;

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
    /// The comm type live when the static policy was built (graph trace); the
    /// policy captures nothing from it, which is the point. `None`: same as `comm`.
    pub trace_comm: Option<CommType>,
    /// Negative control: hand this comm type, instead of the live one, to the
    /// reduction points (the trace-time bug). A correct check then fails
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
            trace_comm: None,
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
        if let Some(t) = self.trace_comm {
            s.push_str(&format!(" traced-under={}", t.name()));
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

    fn validate(&self) -> Result<()> {
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

/// Runs one closure per rank on some backend.
pub trait Launcher: Sync {
    /// The device of `rank`.
    fn device(&self, rank: usize) -> Result<Device>;
    /// Runs `body(rank, world_comm)` on `world` ranks; results in rank order.
    fn launch(
        &self,
        world: usize,
        body: &(dyn Fn(usize, Comm) -> Result<RankReport> + Sync),
    ) -> Result<Vec<RankReport>>;
}

/// Ranks as threads of this process on the CPU backend (`run_ranks`); each rank
/// runs its kernels single-threaded.
#[derive(Debug, Clone, Default)]
pub struct CpuLauncher {
    /// Communicator options.
    pub opts: Option<CommOptions>,
}

impl Launcher for CpuLauncher {
    fn device(&self, _rank: usize) -> Result<Device> {
        Ok(Device::Cpu)
    }
    fn launch(
        &self,
        world: usize,
        body: &(dyn Fn(usize, Comm) -> Result<RankReport> + Sync),
    ) -> Result<Vec<RankReport>> {
        let opts = self.opts.clone().unwrap_or_default();
        crate::backend::cpu::comm::run_ranks(world, &opts, |rank, comm| {
            set_num_threads(Some(1));
            body(rank, comm)
        })
    }
}

fn tensor_of(dtype: DType, v: &[f32], shape: &[usize], device: &Device) -> Result<Tensor> {
    let t = with_dtype!(dtype, T => {
        let d: Vec<T> = v.iter().map(|x| T::from_f32(*x)).collect();
        Tensor::from_slice(&d, shape)?
    });
    t.to_device(device)
}

fn host_f32(t: &Tensor) -> Result<Vec<f32>> {
    let t = t.to_cpu()?;
    Ok(with_dtype!(t.dtype(), T => t.as_slice::<T>()?.iter().map(|v| v.to_f32()).collect()))
}

fn map_tensor(t: &Tensor, f: impl Fn(f32) -> f32) -> Result<Tensor> {
    let v: Vec<f32> = host_f32(t)?.into_iter().map(f).collect();
    tensor_of(t.dtype(), &v, t.shape(), &t.device())
}

fn shape_check(op: &'static str, got: &[usize], want: &[usize], n: &mut usize) -> Result<()> {
    *n += 1;
    if got != want {
        return Err(Error::invalid(
            op,
            "output",
            format!("real shape {got:?} differs from its shape function's {want:?}"),
        ));
    }
    Ok(())
}

/// One rank's forward pass.
fn rank_forward(
    c: &LayerCase,
    m: &Model,
    rank: usize,
    world: Comm,
    device: &Device,
) -> Result<(Vec<f64>, usize, usize)> {
    let (h, tp) = (c.hidden, c.tp);
    let (d, t) = (rank / tp, rank % tp);
    let mut checks = 0;
    // Static, per layer: built "while trace_comm was live"; it takes no comm type.
    let policy = ReducePolicy::new(c.shared, c.routed_transform, c.sp, tp, c.world())?;
    let live = c.comm;
    let reduce_with = c.stale_reduction_comm.unwrap_or(live);
    let ctx = MoeContext::new(&c.dp_tokens, tp, d, t, c.sp)?;
    let groups = MoeGroups::from_world(&world, tp)?;
    let td = c.dp_tokens[d];
    let local = ctx.local_tokens();
    // This rank's input rows: the SP chunk of the batch padded to a multiple of TP, or the batch.
    let batch = &m.inputs[d];
    let first = if c.sp { t * local } else { 0 };
    let mut xv = vec![0f32; local * h];
    for j in 0..local {
        if first + j < td {
            xv[j * h..(j + 1) * h].copy_from_slice(&batch[(first + j) * h..(first + j + 1) * h]);
        }
    }
    let x = tensor_of(c.dtype, &xv, &[local, h], device)?;

    // Shared expert.
    let shared = match c.shared {
        SharedMode::None => None,
        SharedMode::TensorParallel => {
            // TP-partial over this rank's slice of the intermediate size, on the
            // whole DP batch (padded to a multiple of TP under SP).
            let rows = if c.sp { local * tp } else { td };
            let (lo, hi) = (t * SHARED_INTER / tp, (t + 1) * SHARED_INTER / tp);
            let mut s = vec![0f32; rows * h];
            for j in 0..td.min(rows) {
                s[j * h..(j + 1) * h].copy_from_slice(&m.shared(&batch[j * h..(j + 1) * h], lo, hi));
            }
            Some(tensor_of(c.dtype, &s, &[rows, h], device)?)
        }
        SharedMode::SequenceParallelOnly if c.shared_tp_weights && tp > 1 => {
            // TP-sharded weights on sequence shards: gather the DP batch, run
            // this rank's weight shard on it (TP-partial), pad, reduce-scatter.
            let full = shared_gather_unpad(&x, td, &groups.tp)?;
            shape_check(
                "shared_gather_unpad",
                full.shape(),
                &shared_gather_unpad_output_shape(x.shape(), td, tp)?,
                &mut checks,
            )?;
            let rows = host_f32(&full)?;
            let (lo, hi) = (t * SHARED_INTER / tp, (t + 1) * SHARED_INTER / tp);
            let part: Vec<f32> = rows.chunks(h).flat_map(|r| m.shared(r, lo, hi)).collect();
            let part = tensor_of(c.dtype, &part, full.shape(), device)?;
            let s = shared_pad_reduce_scatter(&part, &groups.tp)?;
            shape_check(
                "shared_pad_reduce_scatter",
                s.shape(),
                &shared_pad_reduce_scatter_output_shape(part.shape(), tp)?,
                &mut checks,
            )?;
            Some(s)
        }
        SharedMode::DataParallelOnly if !c.sp && tp > 1 => {
            // Replicated weights on the full batch: each TP rank runs its
            // equal part of the padded batch, the parts are gathered.
            let mine = shared_pad_split(&x, &groups.tp)?;
            shape_check(
                "shared_pad_split",
                mine.shape(),
                &shared_pad_split_output_shape(x.shape(), t, tp)?,
                &mut checks,
            )?;
            let rows = host_f32(&mine)?;
            let y: Vec<f32> = rows.chunks(h).flat_map(|r| m.shared(r, 0, SHARED_INTER)).collect();
            let y = tensor_of(c.dtype, &y, mine.shape(), device)?;
            let s = shared_gather_unpad(&y, td, &groups.tp)?;
            shape_check(
                "shared_gather_unpad",
                s.shape(),
                &shared_gather_unpad_output_shape(y.shape(), td, tp)?,
                &mut checks,
            )?;
            Some(s)
        }
        _ => {
            let mut s = vec![0f32; local * h];
            for j in 0..local {
                s[j * h..(j + 1) * h].copy_from_slice(&m.shared(&xv[j * h..(j + 1) * h], 0, SHARED_INTER));
            }
            Some(tensor_of(c.dtype, &s, &[local, h], device)?)
        }
    };
    let shared = match shared {
        Some(s) => {
            let before = s.shape().to_vec();
            let s = policy.reduce_shared(s, reduce_with, &groups.tp)?;
            shape_check("reduce_shared", s.shape(), &before, &mut checks)?;
            Some(s)
        }
        None => None,
    };

    // Routed experts.
    let prep = prepare(&x, live, &ctx, &groups)?;
    shape_check("prepare", prep.hidden.shape(), &prepare_output_shape(x.shape(), live, &ctx)?, &mut checks)?;
    let tokens = host_f32(&prep.hidden)?;
    let n = prep.hidden.rows();
    let (mut ids, mut weights) = (Vec::with_capacity(n * m.k), Vec::with_capacity(n * m.k));
    for i in 0..n {
        let (e, w) = m.route(&tokens[i * h..(i + 1) * h]);
        ids.extend(e);
        weights.extend(w);
    }
    let wt = Tensor::from_slice(&weights, &[n, m.k])?.to_device(device)?;
    let routed = match live {
        CommType::AllGather => {
            // This EP rank's experts for every gathered token; other slots are dropped (-1).
            let per = c.experts / c.world();
            let mine = rank * per..(rank + 1) * per;
            let mut rows = Vec::new();
            let mut idx = vec![-1i32; n * m.k];
            for (slot, &e) in ids.iter().enumerate() {
                if mine.contains(&(e as usize)) {
                    idx[slot] = (rows.len() / h) as i32;
                    rows.extend(m.expert(e as usize, &tokens[(slot / m.k) * h..(slot / m.k + 1) * h]));
                }
            }
            let p = rows.len() / h;
            let expanded = tensor_of(c.dtype, &rows, &[1, p, h], device)?;
            let it = Tensor::from_slice(&idx, &[n * m.k])?.to_device(device)?;
            let args = FinalizeArgs {
                expanded_x: &expanded,
                expanded_row_idx: &it,
                x1: None,
                x2: None,
                bias: None,
                scales: Some(&wt),
                expert_idx: None,
                drop_pad_mode: DropPadMode::DropPadRow,
            };
            match ctx.sp_layout() {
                Some(l) => {
                    let out = finalize_and_reduce(&args, Some(&l), &groups.ep)?;
                    let want = finalize_and_reduce_output_shape(&args, Some(&l), rank, c.world())?;
                    shape_check("finalize_and_reduce", out.shape(), &want, &mut checks)?;
                    out
                }
                None => {
                    let part = moe_finalize_routing(&args)?;
                    shape_check(
                        "moe_finalize_routing",
                        part.shape(),
                        &moe_finalize_routing_output_shape(&args)?.0,
                        &mut checks,
                    )?;
                    let want = finalize_output_shape(part.shape(), live, &ctx)?;
                    let out = finalize(part, live, &ctx, &groups)?;
                    shape_check("finalize", out.shape(), &want, &mut checks)?;
                    out
                }
            }
        }
        CommType::Mc2 | CommType::FusedMc2 | CommType::AllToAll => {
            let disp = dispatch(&prep.hidden, &ids, m.k, prep.mc2_mask.as_deref(), c.experts, &groups.ep)?;
            let recv = host_f32(&disp.rows)?;
            let mut y = Vec::with_capacity(recv.len());
            for (j, &e) in disp.experts.iter().enumerate() {
                y.extend(m.expert(e as usize, &recv[j * h..(j + 1) * h]));
            }
            let yt = tensor_of(c.dtype, &y, disp.rows.shape(), device)?;
            let combined = combine(&yt, &disp, &wt, &groups.ep)?;
            shape_check("combine", combined.shape(), &[n, h], &mut checks)?;
            let want = finalize_output_shape(combined.shape(), live, &ctx)?;
            let out = finalize(combined, live, &ctx, &groups)?;
            shape_check("finalize", out.shape(), &want, &mut checks)?;
            out
        }
    };
    let before = routed.shape().to_vec();
    let mut routed = policy.reduce_routed_early(routed, reduce_with, &groups.tp)?;
    shape_check("reduce_routed_early", routed.shape(), &before, &mut checks)?;
    if c.routed_transform {
        routed = map_tensor(&routed, transform)?;
    }
    let out = match shared {
        Some(s) => {
            let mut o = Tensor::zeros(routed.shape(), c.dtype, device)?;
            device.backend().add(&s, &routed, &mut o)?;
            o
        }
        None => routed,
    };
    let before = out.shape().to_vec();
    let out = policy.reduce_final(out, reduce_with, &groups.tp)?;
    shape_check("reduce_final", out.shape(), &before, &mut checks)?;
    let rows = out.rows();
    Ok((host_f32(&out)?.into_iter().map(f64::from).collect(), rows, checks))
}

/// Runs this rank's part of `case` (`world` is the case's EP world, `rank`
/// this rank in it) and compares its output rows with the single-rank
/// reference. Every rank of the world calls it. `Err` for an op failure; a
/// numeric mismatch is a report with `passed == false`.
pub fn run_layer_case_rank(case: &LayerCase, rank: usize, world: Comm, device: &Device) -> Result<RankReport> {
    case.validate()?;
    if world.world_size() != case.world() || rank != world.rank() {
        return Err(Error::invalid(
            "run_layer_case_rank",
            "world",
            format!(
                "rank {} of {}, the case needs DP x TP = {} ranks (this is rank {rank})",
                world.rank(),
                world.world_size(),
                case.world()
            ),
        ));
    }
    let m = Model::new(&Spec {
        hidden: case.hidden,
        experts: case.experts,
        top_k: case.top_k,
        seed: case.seed,
        dtype: case.dtype,
        dp_tokens: &case.dp_tokens,
        routed_transform: case.routed_transform,
        shared: case.shared != SharedMode::None,
    });
    let h = case.hidden;
    let (out, rows, shape_checks) = rank_forward(case, &m, rank, world, device)?;
    let (rtol, atol) = tolerance(case.dtype);
    let mut r = RankReport {
        max_abs_err: 0.0,
        worst_ratio: 0.0,
        shape_checks,
        rows_checked: 0,
        passed: true,
        detail: String::new(),
    };
    let (d, t) = (rank / case.tp, rank % case.tp);
    let td = case.dp_tokens[d];
    let (first, want_rows) = if case.sp { (t * td.div_ceil(case.tp), td.div_ceil(case.tp)) } else { (0, td) };
    if rows != want_rows || out.len() != want_rows * h {
        r.passed = false;
        r.detail = format!("rank {rank}: {rows} output rows, expected {want_rows}");
        return Ok(r);
    }
    for j in 0..want_rows {
        let g = first + j;
        if g >= td {
            continue; // SP padding row
        }
        let want = m.reference(&m.inputs[d][g * h..(g + 1) * h]);
        r.rows_checked += 1;
        for (col, (got, w)) in out[j * h..(j + 1) * h].iter().zip(&want).enumerate() {
            let err = (got - w).abs();
            let ratio = err / (rtol * w.abs() + atol);
            r.max_abs_err = r.max_abs_err.max(err);
            r.worst_ratio = r.worst_ratio.max(ratio);
            if ratio > 1.0 && r.passed {
                r.passed = false;
                r.detail = format!("rank {rank} token {g} of DP {d} col {col}: got {got}, want {w}");
            }
        }
    }
    Ok(r)
}

/// Merges the ranks' reports of one case.
pub fn merge_reports(case: &LayerCase, ranks: &[RankReport]) -> CaseReport {
    let mut report = CaseReport {
        name: case.name(),
        max_abs_err: 0.0,
        worst_ratio: 0.0,
        shape_checks: 0,
        rows_checked: 0,
        passed: !ranks.is_empty(),
        detail: String::new(),
    };
    for r in ranks {
        report.max_abs_err = report.max_abs_err.max(r.max_abs_err);
        report.worst_ratio = report.worst_ratio.max(r.worst_ratio);
        report.shape_checks += r.shape_checks;
        report.rows_checked += r.rows_checked;
        if !r.passed && report.passed {
            report.passed = false;
            report.detail = r.detail.clone();
        }
    }
    report
}

/// Runs `case` on `launcher` (one world of `DP x TP` ranks) and merges the
/// ranks' comparisons with the single-rank reference.
pub fn run_layer_case(case: &LayerCase, launcher: &dyn Launcher) -> Result<CaseReport> {
    case.validate()?;
    let body = |rank: usize, comm: Comm| -> Result<RankReport> {
        let device = launcher.device(rank)?;
        run_layer_case_rank(case, rank, comm, &device)
    };
    let ranks = launcher.launch(case.world(), &body)?;
    if ranks.len() != case.world() {
        return Err(Error::invalid(
            "run_layer_case",
            "launcher",
            format!("{} results for {} ranks", ranks.len(), case.world()),
        ));
    }
    Ok(merge_reports(case, &ranks))
}

/// [`run_layer_case`] on the CPU backend.
pub fn run_layer_case_cpu(case: &LayerCase) -> Result<CaseReport> {
    run_layer_case(case, &CpuLauncher::default())
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
