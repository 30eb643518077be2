//! `ascend-moe bench finalize` and `ascend-moe bench finalize_and_reduce`.
//!
//! `finalize`: the CPU finalize kernel (mode 2, f32 scales, x1) against a
//! same-run triad floor: the time a STREAM triad on the same threads takes to
//! move the bytes the kernel must move (`expanded_x` and `x1` read, `out`
//! written, indices and scales read). `vs floor` = floor / kernel time.
//!
//! `finalize_and_reduce`: DP x TP ranks as threads, the fused EP/SP finalize
//! (`finalize_and_reduce`) against `moe_finalize_routing` followed by
//! `maybe_pad_and_reduce`; times are the slowest rank's, best repetition.

use ascend_moe::moe::bench::{bench_finalize, bench_finalize_and_reduce, FinalizeBench, ReduceBench};
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
    /// Kernel threads.
    #[arg(long, default_value_t = 2)]
    threads: usize,
    /// Timed repetitions (best reported).
    #[arg(long, default_value_t = 5)]
    iters: usize,
}

pub fn finalize(a: FinalizeArgs) -> i32 {
    let dtype: DType = match a.dtype.parse() {
        Ok(d) => d,
        Err(e) => {
            eprintln!("error: {e}");
            return 2;
        }
    };
    let cfg =
        FinalizeBench { tokens: a.tokens, top_k: a.top_k, hidden: a.hidden, dtype, threads: a.threads, iters: a.iters };
    match bench_finalize(&cfg) {
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
                a.threads,
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
    match bench_finalize_and_reduce(&cfg) {
        Ok(r) => {
            println!(
                "{:<16} {:>3} {:>3} {:>6} {:<5} {:>10} {:>12} {:>8}",
                "dp_tokens", "tp", "K", "H", "dtype", "fused ms", "two-step ms", "speedup"
            );
            println!(
                "{:<16} {:>3} {:>3} {:>6} {:<5} {:>10.2} {:>12.2} {:>8.2}",
                format!("{:?}", a.dp_tokens),
                a.tp,
                a.top_k,
                a.hidden,
                dtype,
                r.fused_s * 1e3,
                r.unfused_s * 1e3,
                r.speedup()
            );
            0
        }
        Err(e) => {
            eprintln!("error: {e}");
            1
        }
    }
}
