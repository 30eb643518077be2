//! `ascend-moe bench collectives`: an nccl-tests style table for the CPU
//! communicator, with a memory-bandwidth floor measured in the same run.
//!
//! Columns: size (bytes of the largest buffer of one rank: the all_reduce
//! buffer, the reduce_scatter input, the all_gather output, the all_to_all send
//! buffer, the broadcast buffer), element count of that buffer, dtype, median
//! time over the iterations (each iteration's time is the slowest rank's),
//! algbw = size / time, busbw = algbw x (2(n-1)/n for all_reduce, (n-1)/n for
//! reduce_scatter / all_gather / all_to_all, 1 for broadcast), #wrong elements
//! (summed over ranks, checked after the timed iterations against exact values).
//!
//! Floor: a STREAM-like triad (`a[i] = b[i] + s * c[i]` on f32, arrays that
//! together hold three times the last-level cache, at least 32 MiB each,
//! one thread per rank: every rank passes over its own arrays at once, counting
//! 12 bytes per element), taken before and again after each row (best of
//! [`ROW_TRIAD_PASSES`] passes each, a pass's time the slowest rank's), gives
//! the machine's memory bandwidth B for that row as the mean of the two: a
//! shared machine's bandwidth drifts over the seconds a run of rows takes, and
//! a row compared with a triad taken seconds away is compared with another
//! machine. The floor of a
//! collective is (bytes it must move through memory) / B, summed over ranks,
//! where the bytes are those of the staged shared-memory algorithm: user
//! buffers are private, so every input byte that a peer needs is read once and
//! written once into shared staging, every reduction reads each contribution
//! once and writes its result once, and every output byte is read once (from
//! staging, or from the rank's own input for its own block) and written once.
//! A rank's own block of a reduction or an all_to_all is never staged. With
//! size S and n ranks that is, per rank:
//!
//! | collective | bytes per rank |
//! |---|---|
//! | all_reduce | 5 S - S / n (stage 2 S (n-1)/n, reduce S + S / n, copy out 2 S) |
//! | reduce_scatter | 3 S - S / n (stage 2 S (n-1)/n, reduce S + S / n) |
//! | all_gather | 2 S + 2 S / n |
//! | all_to_all | 4 S - 2 S / n (stage and copy out 2 S (n-1)/n each, own block 2 S / n) |
//! | broadcast | 2 S (the root stages, the others copy out) |
//!
//! `vs floor` = floor time / measured time (1.0 = as fast as the triad moves
//! those bytes; it can exceed 1 when staging stays in the last-level cache).

use std::sync::{Barrier, Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

use ascend_moe::backend::cpu::{CpuCommConfig, MAX_WORLD};
use ascend_moe::ranks::run_ranks_with;
use ascend_moe::testing::bench::{
    bytes_of, last_level_cache_bytes, memory_available, memory_shortfall, triad_array_bytes, Triad, MAX_ITERS,
};
use ascend_moe::{with_dtype, Collectives, Comm, CommOptions, DType, Element, ReduceOp, Tensor};

use crate::launch;
use crate::progress::Progress;

/// Triad passes every rank makes before a row's iterations, and again after
/// them; the best of each is kept.
const ROW_TRIAD_PASSES: usize = 2;

const OPS: [&str; 5] = ["all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast"];
/// The collectives of [`OPS`] that reduce (and so take only reducible dtypes).
const REDUCTIONS: [&str; 2] = ["all_reduce", "reduce_scatter"];

#[derive(clap::Args, Clone)]
pub struct Args {
    /// World sizes to run, comma separated (e.g. 2,4,8).
    #[arg(long, value_delimiter = ',', default_value = "4")]
    ranks: Vec<usize>,
    /// Collectives, comma separated.
    #[arg(long, value_delimiter = ',', default_value = "all_reduce,reduce_scatter,all_gather,all_to_all,broadcast")]
    ops: Vec<String>,
    /// Element type. The one-byte types (i8, u8, bool, f8e4m3, f8e5m2) are only
    /// moved: with them, pick --ops among all_gather, all_to_all, broadcast.
    #[arg(long, default_value = "bf16")]
    dtype: String,
    /// Smallest size in bytes (suffixes K, M, G).
    #[arg(short = 'b', long, default_value = "64K", value_parser = parse_size)]
    min_bytes: usize,
    /// Largest size in bytes (bf16 [4096, 4096] is 32M).
    #[arg(short = 'e', long, default_value = "32M", value_parser = parse_size)]
    max_bytes: usize,
    /// Size multiplication factor between rows.
    #[arg(short = 'f', long, default_value_t = 8)]
    factor: usize,
    /// Timed iterations per row (the median is reported).
    #[arg(long, default_value_t = 5)]
    iters: usize,
    /// Untimed warm-up iterations per row.
    #[arg(long, default_value_t = 1)]
    warmup: usize,
    /// Run ranks as separate processes instead of threads.
    #[arg(long)]
    procs: bool,
    /// Timeout of every wait, in seconds (default or 0: ASCEND_MOE_COMM_TIMEOUT, else 60; inf: no limit).
    #[arg(long, value_parser = launch::parse_timeout)]
    timeout: Option<Duration>,
    /// Staging bytes per slot (default: the communicator's default).
    #[arg(long)]
    staging_bytes: Option<usize>,
    /// Print JSON instead of the table.
    #[arg(long, conflicts_with = "csv")]
    json: bool,
    /// Print CSV instead of the table.
    #[arg(long)]
    csv: bool,
}

/// What a worker process runs (`worker ... bench`).
#[derive(clap::Args, Clone)]
pub struct WorkerArgs {
    #[arg(long, value_delimiter = ',')]
    ops: Vec<String>,
    #[arg(long)]
    dtype: String,
    #[arg(long, value_delimiter = ',')]
    sizes: Vec<usize>,
    #[arg(long)]
    iters: usize,
    #[arg(long)]
    warmup: usize,
}

fn parse_size(s: &str) -> Result<usize, String> {
    let s = s.trim();
    let (num, mult) = match s.chars().last().map(|c| c.to_ascii_uppercase()) {
        Some('K') => (&s[..s.len() - 1], 1usize << 10),
        Some('M') => (&s[..s.len() - 1], 1 << 20),
        Some('G') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    let n = num.parse::<usize>().map_err(|e| format!("bad size {s:?}: {e}"))?;
    n.checked_mul(mult).ok_or_else(|| format!("size {s:?} is more bytes than this machine can address"))
}

/// One measured row (as rank 0 reports it).
#[derive(Debug, Clone)]
pub struct Meas {
    op: String,
    bytes: usize,
    count: usize,
    time_ns: i64,
    wrong: i64,
    /// Bytes one triad pass of all ranks moves.
    triad_bytes: usize,
    /// Best pass time (the slowest rank's) of the triad before and after the row.
    triad_ns: [i64; 2],
}

impl Meas {
    /// The row's triad bandwidth, bytes/s: the mean of the one before the
    /// row and the one after it.
    fn triad_bandwidth(&self) -> f64 {
        let bw = |ns: i64| self.triad_bytes as f64 / (ns.max(1) as f64 / 1e9);
        (bw(self.triad_ns[0]) + bw(self.triad_ns[1])) / 2.0
    }
}

/// Element count of the size-S buffer for `op` on `w` ranks (a multiple of `w`).
fn count_for(bytes: usize, esz: usize, w: usize) -> usize {
    (bytes / esz) / w * w
}

fn value(i: usize, rank: usize) -> f32 {
    ((i + rank) % 4) as f32
}

fn fill<T: Element>(n: usize, f: impl Fn(usize) -> f32) -> ascend_moe::Result<Tensor> {
    let mut t = zeros::<T>(n)?;
    for (i, x) in t.as_mut_slice::<T>()?.iter_mut().enumerate() {
        *x = T::from_f32(f(i));
    }
    Ok(t)
}

/// `n` zeros, or an error when the memory cannot be had.
fn zeros<T: Element>(n: usize) -> ascend_moe::Result<Tensor> {
    Tensor::try_zeros_cpu(&[n], T::DTYPE)
}

/// Elements of `t` that differ from `want` as `T` holds it (a bool holds
/// every non-zero value as 1, an 8-bit float its nearest code).
fn wrong<T: Element>(t: &Tensor, want: impl Fn(usize) -> f32) -> ascend_moe::Result<i64> {
    let held = |i: usize| T::from_f32(want(i)).to_f32();
    Ok(t.as_slice::<T>()?.iter().enumerate().filter(|&(i, x)| x.to_f32() != held(i)).count() as i64)
}

/// Runs every (op, size) on this rank; every rank returns the same numbers.
pub fn bench_rank(comm: &Comm, w: &WorkerArgs, progress: bool) -> ascend_moe::Result<Vec<Meas>> {
    let dtype: DType = w.dtype.parse()?;
    with_dtype!(dtype, T => bench_typed::<T>(comm, w, progress))
}

fn bench_typed<T: Element>(comm: &Comm, w: &WorkerArgs, progress: bool) -> ascend_moe::Result<Vec<Meas>> {
    let (rank, n) = (comm.rank(), comm.world_size());
    let esz = T::DTYPE.size();
    let mut out = Vec::new();
    let mut bar = (progress && rank == 0).then(|| Progress::new(w.ops.len() * w.sizes.len()));
    // This rank's share of the triad: three arrays, the size `bench triad`
    // gives each of `n` threads; one untimed pass faults their pages in.
    let mut triad = Triad::try_new(3 * triad_array_bytes(n, last_level_cache_bytes()))?;
    triad.pass(1, 1.0);
    let triad_bytes = n * triad.bytes();
    for op in &w.ops {
        for &bytes in &w.sizes {
            let count = count_for(bytes, esz, n);
            let per = count / n;
            // Per iteration the rank's time; then its triad pass times, before and after the row.
            let mut times = Vec::with_capacity(w.iters + 2 * ROW_TRIAD_PASSES);
            let bad;
            macro_rules! timed {
                ($body:expr) => {{
                    let mut triad_before = Vec::with_capacity(ROW_TRIAD_PASSES);
                    for _ in 0..ROW_TRIAD_PASSES {
                        triad_before.push(triad_pass(comm, &mut triad)?);
                    }
                    for it in 0..w.warmup + w.iters {
                        comm.barrier()?;
                        let t0 = Instant::now();
                        $body;
                        let dt = t0.elapsed().as_nanos() as i64;
                        if it >= w.warmup {
                            times.push(dt);
                        }
                    }
                    times.extend(triad_before);
                    for _ in 0..ROW_TRIAD_PASSES {
                        times.push(triad_pass(comm, &mut triad)?);
                    }
                }};
            }
            match op.as_str() {
                "all_reduce" => {
                    let src = fill::<T>(count, |i| value(i, rank))?;
                    let mut dst = zeros::<T>(count)?;
                    timed!(comm.all_reduce(&src, &mut dst, ReduceOp::Sum)?);
                    bad = wrong::<T>(&dst, |i| (0..n).map(|r| value(i, r)).sum())?;
                }
                "reduce_scatter" => {
                    let src = fill::<T>(count, |i| value(i, rank))?;
                    let mut dst = zeros::<T>(per)?;
                    timed!(comm.reduce_scatter(&src, &mut dst, ReduceOp::Sum)?);
                    bad = wrong::<T>(&dst, |j| (0..n).map(|r| value(rank * per + j, r)).sum())?;
                }
                "all_gather" => {
                    let src = fill::<T>(per, |j| value(j, rank))?;
                    let mut dst = zeros::<T>(count)?;
                    timed!(comm.all_gather(&src, &mut dst)?);
                    bad = wrong::<T>(&dst, |g| value(g % per.max(1), g / per.max(1)))?;
                }
                "all_to_all" => {
                    let src = fill::<T>(count, |i| value(i, rank))?;
                    let mut dst = zeros::<T>(count)?;
                    let counts = vec![per; n];
                    timed!(comm.all_to_all_v(&src, &counts, &mut dst, &counts)?);
                    // Block i of dst is block `rank` of rank i's src.
                    bad = wrong::<T>(&dst, |g| value(rank * per + g % per.max(1), g / per.max(1)))?;
                }
                "broadcast" => {
                    let mut buf = fill::<T>(count, |i| value(i, rank))?;
                    timed!(comm.broadcast(&mut buf, 0)?);
                    bad = wrong::<T>(&buf, |i| value(i, 0))?;
                }
                other => {
                    return Err(ascend_moe::Error::invalid(
                        "bench collectives",
                        "ops",
                        format!("unknown collective {other:?} (known: {})", OPS.join(", ")),
                    ))
                }
            }
            // The slowest rank's time per iteration and per triad pass, and the total of wrong elements.
            let mut t = Tensor::from_slice(&times, &[times.len()])?;
            comm.all_reduce_in_place(&mut t, ReduceOp::Max)?;
            let mut times = t.to_vec::<i64>()?;
            let after = times.split_off(w.iters + ROW_TRIAD_PASSES);
            let before = times.split_off(w.iters);
            let best = |v: &[i64]| v.iter().copied().min().unwrap_or(1);
            let triad_ns = [best(&before), best(&after)];
            times.sort_unstable();
            let median = median_ns(&times);
            let mut b = Tensor::from_slice(&[bad], &[1])?;
            comm.all_reduce_in_place(&mut b, ReduceOp::Sum)?;
            let wrong = b.to_vec::<i64>()?[0];
            if let Some(bar) = bar.as_mut() {
                bar.step(&format!(
                    "{n} ranks {op:<14} {:>10} B  {:>10.1} us  wrong {wrong}",
                    count * esz,
                    median as f64 / 1e3
                ));
            }
            out.push(Meas { op: op.clone(), bytes: count * esz, count, time_ns: median, wrong, triad_bytes, triad_ns });
        }
    }
    if let Some(bar) = &bar {
        bar.finish();
    }
    Ok(out)
}

/// The time of one triad pass over this rank's arrays, started together
/// with every other rank's, in ns.
fn triad_pass(comm: &Comm, triad: &mut Triad) -> ascend_moe::Result<i64> {
    comm.barrier()?;
    let t0 = Instant::now();
    triad.pass(1, 3.0);
    Ok(t0.elapsed().as_nanos() as i64)
}

/// The median of `sorted` (ascending): the middle value, or the mean of the
/// two middle ones of an even count, as the peers' `np.median` takes it; 0
/// for none.
fn median_ns(sorted: &[i64]) -> i64 {
    let n = sorted.len();
    match n {
        0 => 0,
        _ if n % 2 == 1 => sorted[n / 2],
        _ => ((i128::from(sorted[n / 2 - 1]) + i128::from(sorted[n / 2])) / 2) as i64,
    }
}

/// Worker line format:
/// `BENCH\top\tbytes\tcount\ttime_ns\twrong\ttriad_bytes\ttriad_before_ns\ttriad_after_ns`.
pub fn encode(m: &Meas) -> String {
    let [before, after] = m.triad_ns;
    format!(
        "BENCH\t{}\t{}\t{}\t{}\t{}\t{}\t{before}\t{after}",
        m.op, m.bytes, m.count, m.time_ns, m.wrong, m.triad_bytes
    )
}

fn decode(line: &str) -> Option<Meas> {
    let f: Vec<&str> = line.split('\t').collect();
    if f.len() != 9 || f[0] != "BENCH" {
        return None;
    }
    Some(Meas {
        op: f[1].into(),
        bytes: f[2].parse().ok()?,
        count: f[3].parse().ok()?,
        time_ns: f[4].parse().ok()?,
        wrong: f[5].parse().ok()?,
        triad_bytes: f[6].parse().ok()?,
        triad_ns: [f[7].parse().ok()?, f[8].parse().ok()?],
    })
}

/// Refuses a triad of `threads` threads over three arrays of `array_bytes`
/// bytes each that does not fit in the memory available here.
pub fn check_triad_memory(threads: usize, array_bytes: usize) -> Result<(), String> {
    let what = format!("a triad of {threads} threads over 3 arrays of {array_bytes} bytes each");
    memory_shortfall(&what, bytes_of(&[&[3, threads, array_bytes]]), memory_available()).map_or(Ok(()), Err)
}

/// `(bytes a pass moves, bytes/s)` of `threads` concurrent threads, each
/// passing over its own three f32 arrays of `array_bytes` bytes (rounded down
/// to whole elements) on its own: the aggregate bandwidth, best of `reps`.
/// A thread the system refuses to start is an error (the others, which wait
/// for all of them before their first pass, end without one).
pub fn triad(threads: usize, array_bytes: usize, reps: usize) -> Result<(usize, f64), String> {
    let elems = (array_bytes / 4).max(1);
    let barrier = Barrier::new(threads);
    // Whether every thread started: `None` until the last spawn.
    let started = (Mutex::new(None::<bool>), Condvar::new());
    let all_started = || {
        let lock = started.0.lock().unwrap_or_else(PoisonError::into_inner);
        let state = started.1.wait_while(lock, |s| s.is_none()).unwrap_or_else(PoisonError::into_inner);
        *state == Some(true)
    };
    let per_rep: Vec<Vec<Duration>> = std::thread::scope(|s| {
        let mut hs = Vec::with_capacity(threads);
        let mut refused = None;
        for i in 0..threads {
            let (barrier, all_started) = (&barrier, &all_started);
            let h = std::thread::Builder::new().spawn_scoped(s, move || {
                let mut ds = Vec::new();
                if !all_started() {
                    return Ok(ds);
                }
                // Each thread touches its own arrays first (where a NUMA host
                // places them); one that cannot have them still meets the
                // others at every barrier, then fails the run.
                let mut t = Triad::try_new(elems * 12);
                for _ in 0..reps {
                    barrier.wait();
                    if let Ok(t) = &mut t {
                        let t0 = Instant::now();
                        t.pass(1, 3.0);
                        ds.push(t0.elapsed());
                    }
                }
                t.map(|_| ds).map_err(|e| e.to_string())
            });
            match h {
                Ok(h) => hs.push(h),
                Err(e) => {
                    refused = Some(format!("starting triad thread {} of {threads}: {e}", i + 1));
                    break;
                }
            }
        }
        *started.0.lock().unwrap_or_else(PoisonError::into_inner) = Some(refused.is_none());
        started.1.notify_all();
        let per_rep = hs.into_iter().map(|h| h.join().unwrap_or_else(|_| Err("a triad thread panicked".into())));
        let per_rep: Result<Vec<_>, String> = per_rep.collect();
        refused.map_or(per_rep, Err)
    })?;
    let bytes = threads * elems * 12;
    let best = (0..reps)
        .map(|r| {
            let slowest = per_rep.iter().filter_map(|d| d.get(r)).max().copied().unwrap_or(Duration::from_secs(1));
            bytes as f64 / slowest.as_secs_f64().max(1e-9)
        })
        .fold(0.0, f64::max);
    Ok((bytes, best))
}

fn bus_factor(op: &str, n: usize) -> f64 {
    let n = n as f64;
    match op {
        "all_reduce" => 2.0 * (n - 1.0) / n,
        "broadcast" => 1.0,
        _ => (n - 1.0) / n,
    }
}

/// Bytes moved through memory, summed over ranks (see the module docs).
fn floor_bytes(op: &str, s: f64, n: usize) -> f64 {
    let nf = n as f64;
    match op {
        "all_reduce" => nf * (5.0 * s - s / nf),
        "reduce_scatter" => nf * (3.0 * s - s / nf),
        "all_gather" => nf * (2.0 * s + 2.0 * s / nf),
        "all_to_all" => nf * (4.0 * s - 2.0 * s / nf),
        _ => 2.0 * nf * s,
    }
}

struct Line {
    world: usize,
    dtype: String,
    m: Meas,
    /// The row's triad bandwidth, bytes/s.
    triad: f64,
    algbw: f64,
    busbw: f64,
    floor_us: f64,
    ratio: f64,
}

/// Refuses rows whose buffers do not fit in `available` bytes: every rank
/// holds an input and an output of up to the row's size at once (all_reduce
/// and all_to_all: both of it), maps its share of the world's staging
/// segment and keeps its triad arrays (`triad_bytes`), so the largest row
/// takes twice its size plus `segment_bytes` plus `triad_bytes` on each of
/// `world` ranks. A run that needs more would be killed by the kernel
/// part-way, without a word.
fn fits_in_memory(
    (max_bytes, staging_bytes): (usize, Option<usize>),
    sizes: &[usize],
    world: usize,
    [segment_bytes, triad_bytes]: [usize; 2],
    available: Option<usize>,
) -> Result<(), String> {
    let Some(&largest) = sizes.last() else { return Ok(()) };
    let given = staging_bytes.map_or(String::new(), |s| format!(" with --staging-bytes {s}"));
    let what = format!(
        "--max-bytes {max_bytes}{given}: the row of {largest} bytes, an input and an output of that size, \
         {segment_bytes} bytes of staging and {triad_bytes} bytes of triad arrays on each of {world} ranks,"
    );
    let need = bytes_of(&[&[2, world, largest], &[world, segment_bytes], &[world, triad_bytes]]);
    memory_shortfall(&what, need, available).map_or(Ok(()), Err)
}

/// The first argument out of range, named with its value.
fn check_args(a: &Args) -> Result<(), String> {
    let fail = |what: String| Err(what);
    if a.ranks.contains(&0) {
        return fail(format!("--ranks {:?}: a world needs at least 1 rank", a.ranks));
    }
    if a.factor < 2 {
        return fail(format!("--factor {}: must be at least 2 (the size grows by it from row to row)", a.factor));
    }
    if a.min_bytes == 0 {
        return fail("--min-bytes 0: must be at least 1".into());
    }
    if a.min_bytes > a.max_bytes {
        return fail(format!("--min-bytes {} exceeds --max-bytes {}", a.min_bytes, a.max_bytes));
    }
    if a.iters == 0 {
        return fail("--iters 0: must be at least 1 (the median of the timed iterations is reported)".into());
    }
    if let Some(why) = a.staging_bytes.and_then(launch::staging_refusal) {
        return fail(why);
    }
    for (arg, v) in [("--iters", a.iters), ("--warmup", a.warmup)] {
        if v > MAX_ITERS {
            return fail(format!("{arg} {v}: exceeds the maximum of {MAX_ITERS} repetitions"));
        }
    }
    Ok(())
}

pub fn main(a: Args) -> i32 {
    let dtype: DType = match a.dtype.parse() {
        Ok(d) => d,
        Err(e) => {
            eprintln!("error: {e}");
            return 2;
        }
    };
    if let Some(bad) = a.ops.iter().find(|o| !OPS.contains(&o.as_str())) {
        eprintln!("error: unknown collective {bad:?} (known: {})", OPS.join(", "));
        return 2;
    }
    if let Err(why) = check_args(&a) {
        eprintln!("error: {why}");
        return 2;
    }
    if let Some(op) = a.ops.iter().find(|o| REDUCTIONS.contains(&o.as_str())).filter(|_| !dtype.is_reducible()) {
        eprintln!(
            "error: --dtype {dtype}: {op} reduces, and {dtype} is only moved, never reduced (choose --ops among {})",
            OPS.iter().filter(|o| !REDUCTIONS.contains(o)).copied().collect::<Vec<_>>().join(", ")
        );
        return 2;
    }
    if let Some(big) = a.ranks.iter().find(|&&r| r > MAX_WORLD) {
        eprintln!("error: {big} ranks exceed the CPU communicator's limit of {MAX_WORLD}");
        return 2;
    }
    let largest_world = a.ranks.iter().copied().max().unwrap_or(1);
    if a.min_bytes < dtype.size() * largest_world {
        eprintln!(
            "error: --min-bytes {}: a row must hold at least one {dtype} element ({} bytes) per rank, {} bytes on \
             {largest_world} ranks",
            a.min_bytes,
            dtype.size(),
            dtype.size() * largest_world
        );
        return 2;
    }
    let mut sizes = vec![a.min_bytes];
    while let Some(s) = sizes.last().and_then(|s| s.checked_mul(a.factor)).filter(|&s| s <= a.max_bytes) {
        sizes.push(s);
    }
    let cfg = a.staging_bytes.map(|b| CpuCommConfig { staging_bytes: b }).unwrap_or_default();
    let llc = last_level_cache_bytes();
    let triad_bytes = 3 * triad_array_bytes(largest_world, llc);
    let per_rank = [cfg.bytes_per_rank(), triad_bytes];
    if let Err(why) =
        fits_in_memory((a.max_bytes, a.staging_bytes), &sizes, largest_world, per_rank, memory_available())
    {
        eprintln!("error: {why}");
        return 2;
    }
    let timeout = a.timeout.unwrap_or(CommOptions::from_env().timeout);
    let w = WorkerArgs { ops: a.ops.clone(), dtype: a.dtype.clone(), sizes, iters: a.iters, warmup: a.warmup };
    let mut lines = Vec::new();
    for &world in &a.ranks {
        eprintln!("running {world} ranks as {} ...", if a.procs { "processes" } else { "threads" });
        let meas = if a.procs {
            let mut task =
                vec!["bench".to_string(), "--ops".into(), w.ops.join(","), "--dtype".into(), w.dtype.clone()];
            let sz: Vec<String> = w.sizes.iter().map(|s| s.to_string()).collect();
            task.extend(["--sizes".into(), sz.join(","), "--iters".into(), w.iters.to_string()]);
            task.extend(["--warmup".into(), w.warmup.to_string()]);
            launch::spawn_world(world, timeout, a.staging_bytes, &task).and_then(|outs| {
                if let Some(bad) = launch::culprit(&outs, |s| !s.success()) {
                    return Err(format!("rank {} exited with {}", bad.rank, bad.status));
                }
                Ok(outs[0].stdout.lines().filter_map(decode).collect::<Vec<_>>())
            })
        } else {
            run_ranks_with(world, &CommOptions::with_timeout(timeout), &cfg, |_, comm| bench_rank(&comm, &w, true))
                .map(|mut v| v.swap_remove(0))
                .map_err(|e| e.to_string())
        };
        let meas = match meas {
            Ok(m) => m,
            Err(e) => {
                eprintln!("error: {e}");
                return 1;
            }
        };
        for m in meas {
            let t = (m.time_ns as f64 / 1e9).max(1e-12);
            let algbw = m.bytes as f64 / t / 1e9;
            let triad = m.triad_bandwidth();
            let floor = floor_bytes(&m.op, m.bytes as f64, world) / triad;
            lines.push(Line {
                world,
                dtype: dtype.name().into(),
                triad,
                algbw,
                busbw: algbw * bus_factor(&m.op, world),
                floor_us: floor * 1e6,
                ratio: floor / t,
                m,
            });
        }
    }
    if a.json {
        print_json(&lines, &cfg);
    } else if a.csv {
        println!("ranks,op,bytes,count,dtype,time_us,algbw_gbps,busbw_gbps,wrong,floor_us,vs_floor,triad_gbps");
        for l in &lines {
            println!(
                "{},{},{},{},{},{:.2},{:.3},{:.3},{},{:.2},{:.3},{:.3}",
                l.world,
                l.m.op,
                l.m.bytes,
                l.m.count,
                l.dtype,
                l.m.time_ns as f64 / 1e3,
                l.algbw,
                l.busbw,
                l.m.wrong,
                l.floor_us,
                l.ratio,
                l.triad / 1e9
            );
        }
    } else {
        print_table(&lines, &cfg);
    }
    if lines.iter().any(|l| l.m.wrong != 0) {
        1
    } else {
        0
    }
}

const FLOOR_RULE: &str = "floor = bytes moved by the staged shared-memory algorithm / triad bandwidth; \
bytes per rank with size S on n ranks: all_reduce 5S-S/n, reduce_scatter 3S-S/n, all_gather 2S+2S/n, \
all_to_all 4S-2S/n, broadcast 2S";

/// How a row's triad is taken (the table's and the JSON's words).
fn triad_rule() -> String {
    format!(
        "triad = a = b + s * c over f32 arrays, one thread per rank, all at once; a row's triad bandwidth is the \
         mean of the best of {ROW_TRIAD_PASSES} passes before its iterations and the best of {ROW_TRIAD_PASSES} after"
    )
}

fn print_table(lines: &[Line], cfg: &CpuCommConfig) {
    println!(
        "# ascend-moe bench collectives (CPU shared memory, staging {} KiB x 3 slots per rank)",
        cfg.effective_staging() / 1024
    );
    if let Ok(l) = std::fs::read_to_string("/proc/loadavg") {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let avg: Vec<&str> = l.split_whitespace().take(3).collect();
        println!("# load average {} on {cores} cores (other load skews both the triad and the times)", avg.join(" "));
    }
    println!("# {}", triad_rule());
    println!("# {FLOOR_RULE}");
    println!("# time = median over iterations of the slowest rank; vs floor = floor / time");
    let mut last = 0;
    for l in lines {
        if l.world != last {
            println!();
            println!("# {} ranks", l.world);
            println!(
                "{:>12} {:>10} {:>5} {:<14} {:>11} {:>10} {:>10} {:>7} {:>11} {:>11} {:>8}",
                "size(B)",
                "count",
                "type",
                "op",
                "time(us)",
                "algbw",
                "busbw",
                "#wrong",
                "triad GB/s",
                "floor(us)",
                "vs floor"
            );
            last = l.world;
        }
        println!(
            "{:>12} {:>10} {:>5} {:<14} {:>11.1} {:>10.2} {:>10.2} {:>7} {:>11.2} {:>11.1} {:>8.2}",
            l.m.bytes,
            l.m.count,
            l.dtype,
            l.m.op,
            l.m.time_ns as f64 / 1e3,
            l.algbw,
            l.busbw,
            l.m.wrong,
            l.triad / 1e9,
            l.floor_us,
            l.ratio
        );
    }
}

fn print_json(lines: &[Line], cfg: &CpuCommConfig) {
    let rows: Vec<String> = lines
        .iter()
        .map(|l| {
            let triad = |ns: i64| l.m.triad_bytes as f64 / ns.max(1) as f64;
            format!(
                "{{\"ranks\":{},\"op\":\"{}\",\"bytes\":{},\"count\":{},\"dtype\":\"{}\",\"time_us\":{:.3},\"algbw_gbps\":{:.4},\"busbw_gbps\":{:.4},\"wrong\":{},\"triad_gbps\":{:.3},\"triad_before_gbps\":{:.3},\"triad_after_gbps\":{:.3},\"floor_us\":{:.3},\"vs_floor\":{:.4}}}",
                l.world, l.m.op, l.m.bytes, l.m.count, l.dtype, l.m.time_ns as f64 / 1e3, l.algbw, l.busbw, l.m.wrong,
                l.triad / 1e9, triad(l.m.triad_ns[0]), triad(l.m.triad_ns[1]), l.floor_us, l.ratio
            )
        })
        .collect();
    println!(
        "{{\"staging_bytes\":{},\"triad_rule\":\"{}\",\"floor_rule\":\"{FLOOR_RULE}\",\"results\":[\n  {}\n]}}",
        cfg.effective_staging(),
        triad_rule(),
        rows.join(",\n  ")
    );
}

#[cfg(test)]
mod tests {
    use super::median_ns;

    #[test]
    fn the_median_of_an_even_count_is_the_mean_of_the_middle_two() {
        assert_eq!(median_ns(&[]), 0);
        assert_eq!(median_ns(&[7]), 7);
        assert_eq!(median_ns(&[1, 5, 9]), 5);
        // np.median([89034, 89564, 461984, 493390]) = 275774.0
        assert_eq!(median_ns(&[89_034, 89_564, 461_984, 493_390]), 275_774);
        assert_eq!(median_ns(&[i64::MAX - 1, i64::MAX]), i64::MAX - 1);
    }
}
