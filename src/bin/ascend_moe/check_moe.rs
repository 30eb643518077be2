//! `check` section `moe`: the end-to-end MoE layer matrix
//! (`ascend_moe::testing::layer::all_layer_cases`), one row per case.
//!
//! Every case needs DP x TP ranks; it runs on the first DP x TP ranks of the
//! check world (a sub-group), so cases larger than the world are skipped: run
//! `check --world 8` for the whole matrix. The other ranks wait; every rank
//! then learns the case's outcome through two small all-reduces, so all ranks
//! report the same rows.

use std::collections::BTreeMap;

use ascend_moe::moe::SharedMode;
use ascend_moe::testing::layer::{all_layer_cases, run_layer_case_rank, RankReport};
use ascend_moe::{Collectives, Comm, Device, ReduceOp, Tensor};

use crate::check::Row;

pub fn run(comm: &Comm) -> ascend_moe::Result<Vec<Row>> {
    let (world, me) = (comm.world_size(), comm.rank());
    let cases: Vec<_> = all_layer_cases().into_iter().filter(|c| c.world() <= world).collect();
    // One sub-group per case size, made once.
    let mut groups: BTreeMap<usize, Option<Comm>> = BTreeMap::new();
    for c in &cases {
        let n = c.world();
        if let std::collections::btree_map::Entry::Vacant(e) = groups.entry(n) {
            e.insert(match n {
                _ if n == world => Some(comm.clone()),
                _ if me < n => Some(comm.split(&(0..n).collect::<Vec<_>>())?),
                _ => None,
            });
        }
    }
    let mut rows = Vec::with_capacity(cases.len());
    for c in &cases {
        let mine: Option<RankReport> = groups[&c.world()].as_ref().map(|g| {
            run_layer_case_rank(c, me, g.clone(), &Device::Cpu).unwrap_or_else(|e| RankReport {
                max_abs_err: f64::INFINITY,
                worst_ratio: f64::INFINITY,
                shape_checks: 0,
                rows_checked: 0,
                passed: false,
                detail: format!("error: {e}"),
            })
        });
        // [failed, rows checked, shape checks, worst error as ordered bits (>= 0)]
        let v = match &mine {
            Some(r) => [
                i64::from(!r.passed),
                r.rows_checked as i64,
                r.shape_checks as i64,
                r.max_abs_err.min(f64::MAX).to_bits() as i64,
            ],
            None => [0, 0, 0, 0],
        };
        let mut sum = Tensor::from_slice(&v[..3], &[3])?;
        comm.all_reduce_in_place(&mut sum, ReduceOp::Sum)?;
        let mut max = Tensor::from_slice(&v[3..], &[1])?;
        comm.all_reduce_in_place(&mut max, ReduceOp::Max)?;
        let (s, m) = (sum.to_vec::<i64>()?, max.to_vec::<i64>()?);
        let failed_ranks = s[0];
        let own_failure = mine.as_ref().filter(|r| !r.passed).map(|r| r.detail.clone());
        let detail = match (failed_ranks, own_failure) {
            (0, _) => format!("{} rows, {} shapes, max err {:.2e}", s[1], s[2], f64::from_bits(m[0] as u64)),
            (_, Some(d)) => d,
            (n, None) => format!("failed on {n} other rank(s)"),
        };
        rows.push(Row {
            section: "moe",
            case: short_name(c),
            dtype: c.dtype.name().to_string(),
            count: c.dp_tokens.iter().sum(),
            ok: failed_ranks == 0,
            detail,
        });
    }
    Ok(rows)
}

/// The case name without the dtype and the token list (they have columns).
fn short_name(c: &ascend_moe::testing::layer::LayerCase) -> String {
    format!(
        "dp{} tp{} sp={} {} shared={}{}{}",
        c.dp,
        c.tp,
        if c.sp { "on" } else { "off" },
        c.comm.name(),
        c.shared.name(),
        if c.shared == SharedMode::SequenceParallelOnly && c.shared_tp_weights { "(tp-weights)" } else { "" },
        if c.routed_transform { " +transform" } else { "" }
    )
}
