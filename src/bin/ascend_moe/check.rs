//! `ascend-moe check`: every section on a world of ranks, one table row per case.
//!
//! A section is `fn(&Comm) -> Result<Vec<Row>>`, run by every rank of the world
//! (threads, or processes with `--procs`); each rank must return the same cases
//! in the same order. A case fails if it failed on any rank.

use std::time::Duration;

use ascend_moe::backend::cpu::{check_world_size, CpuCommConfig};
use ascend_moe::ranks::run_ranks_with;
use ascend_moe::{Comm, CommOptions};

use crate::launch;

/// One checked case, as seen by one rank.
#[derive(Debug, Clone)]
pub struct Row {
    pub section: &'static str,
    pub case: String,
    pub dtype: String,
    pub count: usize,
    pub ok: bool,
    pub detail: String,
}

/// A check section run by every rank.
pub type Section = fn(&Comm) -> ascend_moe::Result<Vec<Row>>;

/// Every section, in run order. A new section is one line here.
pub const SECTIONS: &[(&str, Section)] =
    &[("collectives", crate::check_collectives::run), ("spec", crate::check_spec::run), ("moe", crate::check_moe::run)];

#[derive(clap::Args)]
pub struct Args {
    /// Ranks in the world.
    #[arg(long, default_value_t = 4)]
    world: usize,
    /// Run ranks as separate processes instead of threads.
    #[arg(long)]
    procs: bool,
    /// Timeout of every wait, in seconds (default or 0: ASCEND_MOE_COMM_TIMEOUT, else 60; inf: no limit).
    #[arg(long, value_parser = launch::parse_timeout)]
    timeout: Option<Duration>,
    /// Only these sections (repeatable); default: all.
    #[arg(long)]
    section: Vec<String>,
    /// Staging bytes per slot of every communicator of the check (default
    /// 1 MiB: the largest collective cases then take several staging rounds,
    /// and 4 ranks with their sub-groups fit in a 64 MiB /dev/shm).
    #[arg(long, default_value_t = CHECK_STAGING)]
    staging_bytes: usize,
}

/// The check's default staging bytes per slot.
pub const CHECK_STAGING: usize = 1 << 20;

/// The sections selected by name (all when `names` is empty).
pub fn selected(names: &[String]) -> Result<Vec<(&'static str, Section)>, String> {
    for n in names {
        if !SECTIONS.iter().any(|(s, _)| s == n) {
            let all: Vec<_> = SECTIONS.iter().map(|(s, _)| *s).collect();
            return Err(format!("unknown check section {n:?} (sections: {})", all.join(", ")));
        }
    }
    Ok(SECTIONS.iter().filter(|(s, _)| names.is_empty() || names.iter().any(|n| n == s)).copied().collect())
}

/// Runs the selected sections on one rank; an unknown section is an error
/// naming `section`, a section's own error is returned as it is.
pub fn run_rank(comm: &Comm, names: &[String]) -> ascend_moe::Result<Vec<Row>> {
    let mut rows = Vec::new();
    for (_, f) in selected(names).map_err(|e| ascend_moe::Error::invalid("check", "section", e))? {
        rows.extend(f(comm)?);
    }
    Ok(rows)
}

/// Worker-side line format: `ROW\tsection\tcase\tdtype\tcount\tok\tdetail`.
pub fn encode(r: &Row) -> String {
    let clean = |s: &str| s.replace(['\t', '\n'], " ");
    format!("ROW\t{}\t{}\t{}\t{}\t{}\t{}", r.section, clean(&r.case), r.dtype, r.count, r.ok as u8, clean(&r.detail))
}

fn decode(line: &str) -> Option<Row> {
    let f: Vec<&str> = line.splitn(7, '\t').collect();
    if f.len() != 7 || f[0] != "ROW" {
        return None;
    }
    let section = SECTIONS.iter().find(|(s, _)| *s == f[1]).map_or("?", |(s, _)| *s);
    Some(Row {
        section,
        case: f[2].into(),
        dtype: f[3].into(),
        count: f[4].parse().ok()?,
        ok: f[5] == "1",
        detail: f[6].into(),
    })
}

pub fn main(a: Args) -> i32 {
    if let Err(e) = selected(&a.section) {
        eprintln!("error: {e}");
        return 2;
    }
    if let Err(why) = check_world_size(a.world) {
        eprintln!("error: --world {}: {why}", a.world);
        return 2;
    }
    if let Some(why) = launch::staging_refusal(a.staging_bytes) {
        eprintln!("error: {why}");
        return 2;
    }
    let timeout = a.timeout.unwrap_or(CommOptions::from_env().timeout);
    let mode = if a.procs { "processes" } else { "threads" };
    let cfg = CpuCommConfig { staging_bytes: a.staging_bytes };
    eprintln!(
        "checking on a world of {} ranks ({mode}), timeout {:?}, staging {} KiB x 3 slots per rank",
        a.world,
        timeout,
        cfg.effective_staging() / 1024
    );
    let per_rank: Result<Vec<Vec<Row>>, String> = if a.procs {
        let mut task = vec!["check".to_string()];
        for s in &a.section {
            task.extend(["--section".to_string(), s.clone()]);
        }
        launch::spawn_world(a.world, timeout, Some(a.staging_bytes), &task).and_then(|outs| {
            // Exit 1: the rank ran every case, some failed (in its rows).
            if let Some(o) = launch::culprit(&outs, |s| !s.success() && s.code() != Some(1)) {
                return Err(format!("rank {} exited with {}", o.rank, o.status));
            }
            Ok(outs.into_iter().map(|o| o.stdout.lines().filter_map(decode).collect()).collect())
        })
    } else {
        let names = a.section.clone();
        run_ranks_with(a.world, &CommOptions::with_timeout(timeout), &cfg, |_, comm| run_rank(&comm, &names))
            .map_err(|e| e.to_string())
    };
    let per_rank = match per_rank {
        Ok(p) => p,
        Err(e) => {
            eprintln!("error: {e}");
            return 1;
        }
    };
    print_table(&per_rank)
}

/// Merges the ranks' rows, prints the table, returns the exit code.
fn print_table(per_rank: &[Vec<Row>]) -> i32 {
    let Some(first) = per_rank.first() else { return 1 };
    if per_rank.iter().any(|r| r.len() != first.len()) {
        let lens: Vec<usize> = per_rank.iter().map(|r| r.len()).collect();
        eprintln!("error: ranks reported different numbers of cases: {lens:?}");
        return 1;
    }
    // The case column fits the longest case name (the MoE layer cases run
    // past 32 characters), so the columns after it line up on every row.
    let w = first.iter().map(|r| r.case.len()).max().unwrap_or(0).max(32);
    println!("{:<12} {:<w$} {:<5} {:>9}  {:<6} detail", "section", "case", "dtype", "count", "result");
    let mut failed = 0;
    for (i, row) in first.iter().enumerate() {
        let bad: Vec<(usize, &Row)> =
            per_rank.iter().enumerate().map(|(r, rows)| (r, &rows[i])).filter(|(_, x)| !x.ok).collect();
        let (result, detail) = match bad.first() {
            None => ("ok", String::new()),
            Some((r, x)) => {
                failed += 1;
                ("FAIL", format!("rank {r}: {} ({} ranks failed)", x.detail, bad.len()))
            }
        };
        println!("{:<12} {:<w$} {:<5} {:>9}  {:<6} {detail}", row.section, row.case, row.dtype, row.count, result);
    }
    println!();
    if failed == 0 {
        println!("all {} cases passed on {} ranks", first.len(), per_rank.len());
        0
    } else {
        println!("{failed} of {} cases FAILED", first.len());
        1
    }
}
