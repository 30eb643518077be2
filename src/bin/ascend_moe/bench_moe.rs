//! `ascend-moe bench finalize` and `ascend-moe bench finalize_and_reduce`.
//!
//! `finalize`: the CPU finalize kernel (mode 2, f32 scales, x1) against a
//! same-run triad floor: the time a STREAM triad on the same threads takes to
//! move the bytes the kernel must move (`expanded_x` and `x1` read, `out`
//! written, indices and scales read), a pass after each call, so both see
//! the same machine. `vs floor` = floor / kernel time.
//!
//! `finalize_and_reduce`: DP x TP ranks as threads, the fused EP/SP finalize
//! (`finalize_and_reduce`) against `moe_finalize_routing` followed by
//! `maybe_pad_and_reduce`; times are the slowest rank's, best repetition.
//! `bound` and `ceiling` are the speedups the bytes each path moves allow
//! (`ReduceBytes`); `vs floor` is the time of a triad moving the fused
//! path's bytes (its passes take turns with the two paths' calls) over the
//! fused time.

use ascend_moe::testing::bench::{bench_finalize, bench_finalize_and_reduce, FinalizeBench, ReduceBench};
use ascend_moe::DType;

#[derive(clap::Args, Clone)]
pub struct FinalizeArgs {
    /// Tokens N.
    #[arg(long, default_value_t = 4096)]
    tokens: usize,
    /// Top-k.
    #[arg(long, default_value_t = 8)]
    top_k: usize,
    /// Hidden size.
    #[arg(long, default_value_t = 4096)]
    hidden: usize,
    /// Data dtype.
    #[arg(long, default_value = "bf16")]
    dtype: String,
    /// Kernel threads [default: the library's own count for the shape:
    /// ASCEND_MOE_NUM_THREADS, else the cores, fewer for a small call]
    #[arg(long)]
    threads: Option<usize>,
    /// Timed repetitions (best reported).
    #[arg(long, default_value_t = 5)]
    iters: usize,
    /// Print JSON instead of the table.
    #[arg(long, conflicts_with = "csv")]
    json: bool,
    /// Print CSV instead of the table.
    #[arg(long)]
    csv: bool,
}

pub fn finalize(a: FinalizeArgs) -> i32 {
    let dtype: DType = match a.dtype.parse() {
        Ok(d) => d,
        Err(e) => {
            eprintln!("error: {e}");
            return 2;
        }
    };
    if a.threads == Some(0) {
        eprintln!("error: --threads 0: must be at least 1");
        return 2;
    }
    let cfg =
        FinalizeBench { tokens: a.tokens, top_k: a.top_k, hidden: a.hidden, dtype, threads: a.threads, iters: a.iters };
    if let Err(e) = cfg.check() {
        eprintln!("error: {e}");
        return 2;
    }
    let on = match a.threads {
        None => "the default threads".to_string(),
        Some(t) if t > a.tokens => format!("{} threads (--threads {t}: at most one per token)", a.tokens),
        Some(t) => format!("{t} threads"),
    };
    eprintln!("finalize {}x{}x{} {dtype} on {on} ...", a.tokens, a.top_k, a.hidden);
    match bench_finalize(&cfg) {
        Ok(r) if a.json || a.csv => {
            // Field names as ci/bench/README.md reads them; floor = the same-run triad moving the same bytes.
            let fields = [
                ("op", "\"finalize\"".to_string()),
                ("dtype", format!("\"{dtype}\"")),
                ("tokens", a.tokens.to_string()),
                ("topk", a.top_k.to_string()),
                ("hidden", a.hidden.to_string()),
                ("threads", r.threads.to_string()),
                ("bytes", r.bytes.to_string()),
                ("iters", a.iters.to_string()),
                ("time_us", format!("{:.3}", r.kernel_s * 1e6)),
                ("gbps", format!("{:.4}", r.kernel_gbps())),
                ("floor_us", format!("{:.3}", r.triad_s * 1e6)),
                ("floor_ratio", format!("{:.4}", r.ratio())),
                ("op_time_us", format!("{:.3}", r.op_s * 1e6)),
                ("triad_gbps", format!("{:.4}", r.triad_gbps())),
            ];
            print_machine(a.json, "finalize", &fields);
            0
        }
        Ok(r) => {
            println!(
                "{:>6} {:>3} {:>6} {:<5} {:>7} {:>9} {:>10} {:>9} {:>10} {:>9} {:>8}",
                "N", "K", "H", "dtype", "threads", "MB moved", "kernel ms", "GB/s", "floor ms", "op ms", "vs floor"
            );
            println!(
                "{:>6} {:>3} {:>6} {:<5} {:>7} {:>9.1} {:>10.2} {:>9.2} {:>10.2} {:>9.2} {:>8.2}",
                a.tokens,
                a.top_k,
                a.hidden,
                dtype,
                r.threads,
                r.bytes as f64 / 1e6,
                r.kernel_s * 1e3,
                r.kernel_gbps(),
                r.triad_s * 1e3,
                r.op_s * 1e3,
                r.ratio()
            );
            0
        }
        Err(e) => {
            eprintln!("error: {e}");
            1
        }
    }
}

#[derive(clap::Args, Clone)]
pub struct ReduceArgs {
    /// Tokens of every DP rank, comma separated (EP = DP x TP ranks).
    #[arg(long, value_delimiter = ',', default_value = "3000,1096")]
    dp_tokens: Vec<usize>,
    /// TP size.
    #[arg(long, default_value_t = 2)]
    tp: usize,
    /// Top-k.
    #[arg(long, default_value_t = 2)]
    top_k: usize,
    /// Hidden size.
    #[arg(long, default_value_t = 2048)]
    hidden: usize,
    /// Data dtype.
    #[arg(long, default_value = "bf16")]
    dtype: String,
    /// Timed repetitions (best reported).
    #[arg(long, default_value_t = 5)]
    iters: usize,
    /// Print JSON instead of the table.
    #[arg(long, conflicts_with = "csv")]
    json: bool,
    /// Print CSV instead of the table.
    #[arg(long)]
    csv: bool,
}

pub fn finalize_and_reduce(a: ReduceArgs) -> i32 {
    let dtype: DType = match a.dtype.parse() {
        Ok(d) => d,
        Err(e) => {
            eprintln!("error: {e}");
            return 2;
        }
    };
    let cfg = ReduceBench {
        dp_tokens: a.dp_tokens.clone(),
        tp: a.tp,
        top_k: a.top_k,
        hidden: a.hidden,
        dtype,
        iters: a.iters,
    };
    if let Err(e) = cfg.check() {
        eprintln!("error: {e}");
        return 2;
    }
    let world = a.dp_tokens.len() * a.tp;
    eprintln!("finalize_and_reduce dp_tokens {:?} tp {} ({world} ranks) ...", a.dp_tokens, a.tp);
    match bench_finalize_and_reduce(&cfg) {
        Ok(r) if a.json || a.csv => {
            let tokens: usize = a.dp_tokens.iter().sum();
            let dp: Vec<String> = a.dp_tokens.iter().map(|t| t.to_string()).collect();
            let rows: Vec<Vec<(&str, String)>> =
                [("finalize_and_reduce", r.fused_s), ("finalize_then_pad_reduce", r.unfused_s)]
                    .iter()
                    .map(|(op, secs)| {
                        vec![
                            ("op", format!("\"{op}\"")),
                            ("dtype", format!("\"{dtype}\"")),
                            ("tokens", tokens.to_string()),
                            ("topk", a.top_k.to_string()),
                            ("hidden", a.hidden.to_string()),
                            ("world", world.to_string()),
                            ("dp_tokens", format!("\"{}\"", dp.join(" "))),
                            ("tp", a.tp.to_string()),
                            ("iters", a.iters.to_string()),
                            ("time_us", format!("{:.3}", secs * 1e6)),
                        ]
                    })
                    .collect();
            if a.json {
                // JSON only (the CSV keeps its columns): the byte model of both paths.
                let b = r.bytes;
                let model = [
                    ("two_step_bytes", b.two_step.to_string()),
                    ("fused_bytes", b.fused.to_string()),
                    ("min_bytes", b.minimum.to_string()),
                    ("bound", format!("{:.4}", b.bound())),
                    ("ceiling", format!("{:.4}", b.ceiling())),
                    ("fused_floor_us", format!("{:.3}", r.floor_s * 1e6)),
                    ("fused_vs_floor", format!("{:.4}", r.vs_floor())),
                    ("fused_staged", r.staged.to_string()),
                ];
                let objs: Vec<String> = rows.iter().map(|f| json_object(&[f.as_slice(), &model].concat())).collect();
                println!("{{\"bench\":\"finalize_and_reduce\",\"world\":{world},\"rows\":[{}]}}", objs.join(","));
            } else {
                print_csv(&rows);
            }
            0
        }
        Ok(r) => {
            println!(
                "{:<16} {:>3} {:>3} {:>6} {:<5} {:>10} {:>12} {:>8} {:>6} {:>8} {:>9} {:>9}",
                "dp_tokens",
                "tp",
                "K",
                "H",
                "dtype",
                "fused ms",
                "two-step ms",
                "speedup",
                "bound",
                "ceiling",
                "floor ms",
                "vs floor"
            );
            println!(
                "{:<16} {:>3} {:>3} {:>6} {:<5} {:>10.2} {:>12.2} {:>8.2} {:>6.2} {:>8.2} {:>9.2} {:>9.2}",
                format!("{:?}", a.dp_tokens),
                a.tp,
                a.top_k,
                a.hidden,
                dtype,
                r.fused_s * 1e3,
                r.unfused_s * 1e3,
                r.speedup(),
                r.bytes.bound(),
                r.bytes.ceiling(),
                r.floor_s * 1e3,
                r.vs_floor()
            );
            println!(
                "bound: the speedup at equal bandwidth from the bytes each path moves ({:.1} and {:.1} MB on the \
                 slowest rank); ceiling: the same for the least any fused op moves ({:.1} MB); floor: every rank \
                 at once streams the fused path's bytes through a one-thread triad, vs floor = floor / fused",
                r.bytes.two_step as f64 / 1e6,
                r.bytes.fused as f64 / 1e6,
                r.bytes.minimum as f64 / 1e6
            );
            if !r.staged {
                println!(
                    "the fused op ran the two-step path: a row of {} {dtype} elements is larger than a staging \
                     region of {world} ranks, so it stages no rows (its bytes, bound and floor are the two-step \
                     path's)",
                    a.hidden
                );
            }
            0
        }
        Err(e) => {
            eprintln!("error: {e}");
            1
        }
    }
}

fn json_object(fields: &[(&str, String)]) -> String {
    let parts: Vec<String> = fields.iter().map(|(k, v)| format!("\"{k}\":{v}")).collect();
    format!("{{{}}}", parts.join(","))
}

/// CSV: a header line and one line per row; string values without their JSON quotes.
fn print_csv(rows: &[Vec<(&str, String)>]) {
    if let Some(first) = rows.first() {
        println!("{}", first.iter().map(|(k, _)| *k).collect::<Vec<_>>().join(","));
    }
    for r in rows {
        println!("{}", r.iter().map(|(_, v)| v.trim_matches('"')).collect::<Vec<_>>().join(","));
    }
}

/// One result in the `--json` (`{"bench": .., "rows": [..]}`) or `--csv` form.
fn print_machine(json: bool, bench: &str, fields: &[(&str, String)]) {
    if json {
        println!("{{\"bench\":\"{bench}\",\"rows\":[{}]}}", json_object(fields));
    } else {
        print_csv(&[fields.to_vec()]);
    }
}
