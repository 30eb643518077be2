//! `ascend-moe bench triad`: the STREAM-like triad that `bench collectives` uses for its
//! floor, on its own, so a report can show the machine's memory bandwidth measured by the
//! same code.

use ascend_moe::testing::bench::{last_level_cache_bytes, triad_array_bytes, MAX_ITERS};

use crate::bench_collectives::{check_triad_memory, triad};

#[derive(clap::Args, Clone)]
pub struct Args {
    /// Threads (default: the available cores).
    #[arg(long)]
    threads: Option<usize>,
    /// MiB per array per thread (three f32 arrays each) [default: all arrays
    /// together three times the last-level cache, at least 32 MiB each].
    #[arg(long)]
    mib: Option<usize>,
    /// Passes (the best is reported).
    #[arg(long, default_value_t = 5)]
    reps: usize,
    /// Print JSON instead of text.
    #[arg(long, conflicts_with = "csv")]
    json: bool,
    /// Print CSV instead of text.
    #[arg(long)]
    csv: bool,
}

pub fn main(a: Args) -> i32 {
    let threads = a.threads.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let bad = [(threads == 0, "--threads 0"), (a.mib == Some(0), "--mib 0"), (a.reps == 0, "--reps 0")];
    if let Some((_, arg)) = bad.iter().find(|b| b.0) {
        eprintln!("error: {arg}: must be at least 1");
        return 2;
    }
    if a.reps > MAX_ITERS {
        eprintln!("error: --reps {}: exceeds the maximum of {MAX_ITERS} repetitions", a.reps);
        return 2;
    }
    let llc = last_level_cache_bytes();
    let array = match a.mib.map_or(Some(triad_array_bytes(threads, llc)), |m| m.checked_mul(1 << 20)) {
        Some(b) => b,
        None => {
            eprintln!("error: --mib {}: more bytes than this machine can address", a.mib.unwrap_or_default());
            return 2;
        }
    };
    if let Err(e) = check_triad_memory(threads, array) {
        eprintln!("error: {e}");
        return 2;
    }
    let cache = llc.map_or("no last-level cache size reported".into(), |c| format!("last-level cache {} MiB", c >> 20));
    eprintln!("measuring the triad with {threads} threads, 3 x {} MiB per thread ({cache}) ...", array >> 20);
    let (bytes, bw) = match triad(threads, array, a.reps) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: {e}");
            return 1;
        }
    };
    if a.json {
        println!("{{\"bench\":\"triad\",\"threads\":{threads},\"bytes\":{bytes},\"gbps\":{:.4}}}", bw / 1e9);
    } else if a.csv {
        println!("threads,bytes,gbps");
        println!("{threads},{bytes},{:.4}", bw / 1e9);
    } else {
        println!("triad (a = b + s * c, f32, best of {}): {:.2} GB/s with {threads} threads", a.reps, bw / 1e9);
    }
    0
}
