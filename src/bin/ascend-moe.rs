//! The `ascend-moe` command-line tool: `info`, `check`, `bench`.
//!
//! This file only parses and dispatches. Each command lives in its own module
//! under `src/bin/ascend_moe/`; a new `check` section is one line in
//! `check::SECTIONS`, a new benchmark one variant of [`BenchCmd`].

#[path = "ascend_moe/bench_collectives.rs"]
mod bench_collectives;
#[path = "ascend_moe/bench_moe.rs"]
mod bench_moe;
#[path = "ascend_moe/bench_triad.rs"]
mod bench_triad;
#[path = "ascend_moe/check.rs"]
mod check;
#[path = "ascend_moe/check_collectives.rs"]
mod check_collectives;
#[path = "ascend_moe/check_moe.rs"]
mod check_moe;
#[path = "ascend_moe/check_spec.rs"]
mod check_spec;
#[path = "ascend_moe/info.rs"]
mod info;
#[path = "ascend_moe/launch.rs"]
mod launch;
#[path = "ascend_moe/progress.rs"]
mod progress;
#[path = "ascend_moe/worker.rs"]
mod worker;

use clap::{Parser, Subcommand};

/// MoE communication and finalize layer for Ascend NPUs, with a CPU fallback.
///
/// Exit status: 0 when everything ran and passed; 1 when a check failed or a
/// run failed part-way; 2 when the arguments were refused before anything ran.
#[derive(Parser)]
#[command(name = "ascend-moe", version, about, long_about)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Which backends are usable here, and what was found.
    Info,
    /// Run every check against a naive reference on a world of ranks; exits
    /// non-zero on any failure.
    Check(check::Args),
    /// Benchmarks.
    #[command(subcommand)]
    Bench(BenchCmd),
    /// One rank of a multi-process world (spawned by `--procs` and by tests).
    #[command(hide = true)]
    Worker(worker::Args),
}

#[derive(Subcommand)]
enum BenchCmd {
    /// nccl-tests style table of the CPU collectives, with memory-bandwidth floors.
    Collectives(bench_collectives::Args),
    /// STREAM-like triad: the memory bandwidth the benchmark floors are measured against.
    Triad(bench_triad::Args),
    /// The CPU finalize kernel against a same-run triad floor.
    Finalize(bench_moe::FinalizeArgs),
    /// Fused finalize-and-reduce against finalize then maybe_pad_and_reduce.
    #[command(name = "finalize_and_reduce", alias = "finalize-and-reduce")]
    FinalizeAndReduce(bench_moe::ReduceArgs),
}

fn main() {
    let cli = Cli::parse();
    let code = match cli.cmd {
        Cmd::Info => info::main(),
        Cmd::Check(a) => check::main(a),
        Cmd::Bench(BenchCmd::Collectives(a)) => bench_collectives::main(a),
        Cmd::Bench(BenchCmd::Triad(a)) => bench_triad::main(a),
        Cmd::Bench(BenchCmd::Finalize(a)) => bench_moe::finalize(a),
        Cmd::Bench(BenchCmd::FinalizeAndReduce(a)) => bench_moe::finalize_and_reduce(a),
        Cmd::Worker(a) => worker::main(a),
    };
    std::process::exit(code);
}
