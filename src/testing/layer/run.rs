//! Running a case on a backend's ranks and comparing each rank's rows with
//! the single-rank reference.

use super::case::{CaseReport, LayerCase, RankReport};
use super::forward::rank_forward;
use crate::backend::cpu::set_num_threads;
use crate::comm::{Collectives, Comm, CommOptions};
use crate::moe::reduce::SharedMode;
use crate::testing::model::{Model, Spec};
use crate::testing::Rounding;
use crate::{Device, Error, Result};

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
        crate::ranks::run_ranks(world, &opts, |rank, comm| {
            set_num_threads(Some(1));
            body(rank, comm)
        })
    }
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
    let rounding = Rounding::from(case.dtype);
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
        let (want, mag) = m.reference(&m.inputs[d][g * h..(g + 1) * h]);
        r.rows_checked += 1;
        for (col, ((got, w), mg)) in out[j * h..(j + 1) * h].iter().zip(&want).zip(&mag).enumerate() {
            let (err, ratio) = error_ratio(*got, *w, rounding.tol(*w, *mg));
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

/// `|got - want|` and its ratio to `tol`, both infinite where either side is
/// NaN (which `f64::max` would drop and no `> 1.0` would catch).
fn error_ratio(got: f64, want: f64, tol: f64) -> (f64, f64) {
    let err = (got - want).abs();
    if err.is_nan() {
        return (f64::INFINITY, f64::INFINITY);
    }
    (err, err / tol)
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

#[cfg(test)]
mod tests {
    use super::error_ratio;

    #[test]
    fn a_nan_output_is_an_infinite_error_not_a_dropped_one() {
        assert_eq!(error_ratio(1.5, 1.0, 0.25), (0.5, 2.0));
        for (got, want) in [(f64::NAN, 1.0), (1.0, f64::NAN), (f64::INFINITY, f64::INFINITY)] {
            let (err, ratio) = error_ratio(got, want, 0.25);
            assert!(err == f64::INFINITY && ratio > 1.0, "{got} vs {want}: {err} {ratio}");
        }
    }
}
