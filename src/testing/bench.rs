//! Benchmarks of the finalize op and of the fused finalize-and-reduce, used by
//! `ascend-moe bench finalize` and `ascend-moe bench finalize_and_reduce`.
//!
//! The finalize is memory-bound, so it is measured against a same-run "triad
//! floor": the time a STREAM-style triad (`a = b + s * c`, f32) on the same
//! number of threads takes to move the same number of bytes. A ratio of 1.0
//! means the kernel streams at the machine's triad bandwidth.

use std::time::Instant;

pub use crate::backend::cpu::last_level_cache_bytes;
use crate::backend::cpu::{check_world_size, finalize_threads, no_memory, set_num_threads, CpuCommConfig};
use crate::backend::{FinalizeArgs, OutputRows};
use crate::comm::{Collectives, CommOptions};
use crate::moe::finalize::{moe_finalize_routing, moe_finalize_routing_output_shape};
use crate::moe::layout::SpLayout;
use crate::moe::pad_reduce::{finalize_and_reduce, maybe_pad_and_reduce};
use crate::ranks::run_ranks;
use crate::{with_dtype, DType, Device, DropPadMode, Element, Error, Result, Tensor};

/// Sizes of the finalize benchmark.
#[derive(Debug, Clone)]
pub struct FinalizeBench {
    /// Tokens N.
    pub tokens: usize,
    /// Top-k.
    pub top_k: usize,
    /// Hidden size.
    pub hidden: usize,
    /// Data dtype.
    pub dtype: DType,
    /// Kernel threads; `None` runs the default call, on the threads the
    /// library picks for the shape ([`finalize_threads`]).
    pub threads: Option<usize>,
    /// Timed repetitions (the best is reported).
    pub iters: usize,
}

impl Default for FinalizeBench {
    fn default() -> Self {
        FinalizeBench { tokens: 4096, top_k: 8, hidden: 4096, dtype: DType::BF16, threads: None, iters: 5 }
    }
}

impl FinalizeBench {
    /// Refuses sizes the benchmark cannot run, before it builds anything: a
    /// count of 0, a dtype that is not a float, more expanded rows than
    /// [`MAX_ROWS`], or more host memory than is available here.
    pub fn check(&self) -> Result<()> {
        const OP: &str = "bench_finalize";
        let (n, k, h) = (self.tokens, self.top_k, self.hidden);
        let counts = [("tokens", n), ("top_k", k), ("hidden", h), ("threads", self.threads.unwrap_or(1))];
        check_config(OP, &counts, self.iters, self.dtype)?;
        check_rows(OP, n, k)?;
        // Inputs built in vectors and copied into tensors (x, x1, scales:
        // twice), the permutation (its (key, index) pairs, the indices and
        // their tensor), the op's two outputs, and the triad floor (as many
        // bytes as the op moves).
        let es = self.dtype.size();
        let need = bytes_of(&[&[3, n, k, h, es], &[6, n, h, es], &[n, k, 4 + 4 + 8 + 4 + 4 + 8]]);
        check_memory(OP, &format!("finalize {n}x{k}x{h} {}", self.dtype.name()), need, memory_available())
    }
}

/// Result of [`bench_finalize`].
#[derive(Debug, Clone)]
pub struct FinalizeReport {
    /// Threads the kernel and the triad ran on.
    pub threads: usize,
    /// Bytes the kernel must move (expanded_x + x1 read, out written; indices and scales).
    pub bytes: usize,
    /// Best kernel time into a preallocated output, seconds.
    pub kernel_s: f64,
    /// Best time of the whole op (`moe_finalize_routing`, allocating its output), seconds.
    pub op_s: f64,
    /// Best triad time for the same bytes on the same threads, seconds; its
    /// passes take turns with the kernel's calls.
    pub triad_s: f64,
}

impl FinalizeReport {
    /// `triad_s / kernel_s`: the fraction of the triad floor reached.
    pub fn ratio(&self) -> f64 {
        self.triad_s / self.kernel_s
    }
    /// Kernel bandwidth, GB/s.
    pub fn kernel_gbps(&self) -> f64 {
        self.bytes as f64 / self.kernel_s / 1e9
    }
    /// Triad bandwidth, GB/s.
    pub fn triad_gbps(&self) -> f64 {
        self.bytes as f64 / self.triad_s / 1e9
    }
}

/// `n` elements `f(i)` in a vector, or a [`Error::HostMemory`] naming `op`.
fn try_collect<T>(op: &'static str, n: usize, f: impl Fn(usize) -> T) -> Result<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| no_memory(op, n.saturating_mul(std::mem::size_of::<T>())))?;
    v.extend((0..n).map(f));
    Ok(v)
}

/// A cheap deterministic fill (the values do not matter for timing, only that
/// they are finite and not all equal).
fn filled(shape: &[usize], dtype: DType, salt: u32) -> Result<Tensor> {
    let n: usize = shape.iter().product();
    with_dtype!(dtype, T => {
        let v: Vec<T> = try_collect("bench input", n, |i| {
            let i = i as u32;
            T::from_f32(((i.wrapping_mul(2_654_435_761).wrapping_add(salt) >> 20) as f32) / 4096.0 - 0.5)
        })?;
        Tensor::from_slice(&v, shape)
    })
}

/// A permutation of `0..n` (multiplicative hash, full period for odd multipliers on powers of two;
/// otherwise sorted by hash); `n` is at most [`MAX_ROWS`].
fn permutation(n: usize) -> Result<Vec<i32>> {
    let key = |i: usize| ((i as u32).wrapping_mul(2_246_822_519).rotate_left(13), i as i32);
    let mut v: Vec<(u32, i32)> = try_collect("bench row indices", n, key)?;
    v.sort_unstable();
    try_collect("bench row indices", n, |j| v[j].1)
}

/// Most expanded rows a benchmark builds: its row indices are int32.
pub const MAX_ROWS: usize = 1 << 31;

/// The bytes this process can still have: `MemAvailable` of `/proc/meminfo`,
/// or less where a memory cgroup of the process limits it (a container's
/// limit, whose excess the kernel's OOM killer ends without a word); `None`
/// where neither can be read.
pub fn memory_available() -> Option<usize> {
    let read = |p: &std::path::Path| std::fs::read_to_string(p).ok();
    let meminfo = read("/proc/meminfo".as_ref()).and_then(|info| {
        let kib = info.lines().find_map(|l| l.strip_prefix("MemAvailable:"))?.trim().strip_suffix("kB")?;
        kib.trim().parse::<usize>().ok()?.checked_mul(1024)
    });
    let cgroup = read("/proc/self/cgroup".as_ref()).and_then(|c| cgroup_headroom(&c, "/sys/fs/cgroup".as_ref(), read));
    match (meminfo, cgroup) {
        (Some(m), Some(c)) => Some(m.min(c)),
        (m, c) => m.or(c),
    }
}

/// The least headroom of the memory cgroups of `proc_cgroup` (the text of
/// `/proc/self/cgroup`) and their ancestors under `root`: limit minus the
/// working set (usage less inactive file pages, which the kernel reclaims
/// before it kills). cgroup v2 (`0::/path`: `memory.max`, `memory.current`,
/// `inactive_file` of `memory.stat`) and v1 (`N:memory:/path` under
/// `root/memory`: `memory.limit_in_bytes`, `memory.usage_in_bytes`,
/// `total_inactive_file`). `None` without a limit.
fn cgroup_headroom(
    proc_cgroup: &str,
    root: &std::path::Path,
    read: impl Fn(&std::path::Path) -> Option<String>,
) -> Option<usize> {
    let number = |s: Option<String>| s.and_then(|s| s.trim().parse::<usize>().ok());
    let stat = |dir: &std::path::Path, key: &str| {
        read(&dir.join("memory.stat"))?.lines().find_map(|l| l.strip_prefix(key)?.strip_prefix(' ')?.parse().ok())
    };
    let mut least: Option<usize> = None;
    for line in proc_cgroup.lines() {
        let mut f = line.splitn(3, ':');
        let (_, controllers, path) = (f.next(), f.next().unwrap_or(""), f.next().unwrap_or(""));
        let (base, files) = if controllers.is_empty() {
            (root.to_path_buf(), ["memory.max", "memory.current", "inactive_file"])
        } else if controllers.split(',').any(|c| c == "memory") {
            (root.join("memory"), ["memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"])
        } else {
            continue;
        };
        // The process's group, then each ancestor up to the hierarchy's root
        // (in a cgroup namespace the path is `/` and the group is the root).
        let mut dir = base.join(path.trim_start_matches('/'));
        loop {
            if let (Some(limit), Some(usage)) = (number(read(&dir.join(files[0]))), number(read(&dir.join(files[1])))) {
                // v1 says "no limit" with a page-rounded i64::MAX.
                if limit < (1 << 62) {
                    let working = usage.saturating_sub(stat(&dir, files[2]).unwrap_or(0));
                    let room = limit.saturating_sub(working);
                    least = Some(least.map_or(room, |l| l.min(room)));
                }
            }
            if dir == base || !dir.pop() {
                break;
            }
        }
    }
    least
}

/// A sum of products of counts, or `None` where it does not fit in a `usize`.
pub fn bytes_of(terms: &[&[usize]]) -> Option<usize> {
    terms.iter().try_fold(0usize, |sum, t| sum.checked_add(t.iter().try_fold(1usize, |p, &f| p.checked_mul(f))?))
}

/// Why a benchmark of `what` that needs `need` bytes of host memory (`None`:
/// more than a `usize` counts) cannot run where `available` bytes are
/// (`None`: unknown, so only an uncountable need is refused); `None` if it
/// can. A run that needs more would be killed by the kernel part-way,
/// without a word.
pub fn memory_shortfall(what: &str, need: Option<usize>, available: Option<usize>) -> Option<String> {
    match (need, available) {
        (None, _) => Some(format!("{what} needs more bytes of host memory than this machine can address")),
        (Some(n), Some(a)) if n > a => {
            Some(format!("{what} needs {n} bytes of host memory, more than the {a} bytes available here"))
        }
        _ => None,
    }
}

/// [`memory_shortfall`] as an error of `op` naming its `shape`.
fn check_memory(op: &'static str, what: &str, need: Option<usize>, available: Option<usize>) -> Result<()> {
    memory_shortfall(what, need, available).map_or(Ok(()), |why| Err(Error::invalid(op, "shape", why)))
}

/// Refuses `tokens` x `top_k` expanded rows past [`MAX_ROWS`].
fn check_rows(op: &'static str, tokens: usize, top_k: usize) -> Result<()> {
    match tokens.checked_mul(top_k) {
        Some(r) if r <= MAX_ROWS => Ok(()),
        _ => Err(Error::invalid(
            op,
            "tokens",
            format!("{tokens} tokens x top_k {top_k} expanded rows: int32 row indices reach at most {MAX_ROWS} rows"),
        )),
    }
}

/// STREAM-style triad arrays (`a = b + s * c`, f32) moving `bytes` bytes a
/// pass: the memory floor of every CPU benchmark (`bench finalize`,
/// `bench finalize_and_reduce`, `bench collectives`, `bench triad`).
pub struct Triad {
    a: Vec<f32>,
    b: Vec<f32>,
    c: Vec<f32>,
}

impl Triad {
    /// Arrays of `bytes / 12` elements each (at least one), or an
    /// [`Error::HostMemory`] when they cannot be had.
    pub fn try_new(bytes: usize) -> Result<Self> {
        let n = (bytes / 12).max(1);
        let array = |v: f32| try_collect("triad", n, |_| v);
        Ok(Triad { a: array(0.0)?, b: array(1.0)?, c: array(2.0)? })
    }

    /// Bytes one pass moves: 12 per element (STREAM's count: two arrays
    /// read, one written).
    pub fn bytes(&self) -> usize {
        12 * self.a.len()
    }

    /// One pass on `threads` threads, started as the CPU finalize starts them:
    /// the calling thread takes the first chunk and starts a thread for each
    /// other one, so one thread runs on the calling thread alone.
    pub fn pass(&mut self, threads: usize, s: f32) {
        let chunk = self.a.len().div_ceil(threads.max(1));
        let triad = move |a: &mut [f32], b: &[f32], c: &[f32]| {
            for ((a, b), c) in a.iter_mut().zip(b).zip(c) {
                *a = *b + s * *c;
            }
        };
        std::thread::scope(|sc| {
            let mut chunks = self.a.chunks_mut(chunk).zip(self.b.chunks(chunk)).zip(self.c.chunks(chunk));
            let first = chunks.next();
            for ((a, b), c) in chunks {
                sc.spawn(move || triad(a, b, c));
            }
            if let Some(((a, b), c)) = first {
                triad(a, b, c);
            }
        });
        std::hint::black_box(&self.a);
    }
}

/// Least bytes of one triad array.
const TRIAD_MIN_ARRAY: usize = 32 << 20;
/// Most bytes of all triad arrays together.
const TRIAD_MAX_TOTAL: usize = 4 << 30;

/// Bytes of each of the three triad arrays of each of `threads` threads for
/// a triad that streams from memory: all arrays together hold three times the
/// last-level cache of `llc` bytes (a triad over less runs partly from it: on a
/// machine with a 480 MiB L3, 4 threads moved 61 GB/s over 192 MiB of arrays,
/// 34 over 336 MiB and 29 over 1.5 GiB), at least 32 MiB each and at most
/// 4 GiB in all.
pub fn triad_array_bytes(threads: usize, llc: Option<usize>) -> usize {
    let threads = threads.max(1);
    let want = llc.map_or(0, |c| c.div_ceil(threads));
    want.min(TRIAD_MAX_TOTAL / (3 * threads)).max(TRIAD_MIN_ARRAY)
}

/// The most timed repetitions a benchmark takes (`--iters`, `--warmup`,
/// `--reps`): far more than any median or best needs, and small enough that
/// no count of them, plus the untimed first pass, can wrap around.
pub const MAX_ITERS: usize = 1_000_000;

/// Refuses a benchmark configuration with a count of 0, `iters` outside
/// `1..=MAX_ITERS` or a dtype that is not a float, naming the field.
fn check_config(op: &'static str, counts: &[(&'static str, usize)], iters: usize, dtype: DType) -> Result<()> {
    if let Some((name, _)) = counts.iter().chain(&[("iters", iters)]).find(|(_, v)| *v == 0) {
        return Err(Error::invalid(op, name, "must be >= 1"));
    }
    if iters > MAX_ITERS {
        return Err(Error::invalid(op, "iters", format!("{iters} exceeds the maximum of {MAX_ITERS} repetitions")));
    }
    if !dtype.is_float() {
        return Err(Error::dtype(op, "dtype", "a float dtype", dtype));
    }
    Ok(())
}

/// Runs the finalize benchmark on the CPU backend (mode 2, a random
/// permutation, f32 scales, x1 present).
pub fn bench_finalize(cfg: &FinalizeBench) -> Result<FinalizeReport> {
    cfg.check()?;
    let (n, k, h) = (cfg.tokens, cfg.top_k, cfg.hidden);
    let es = cfg.dtype.size();
    let x = filled(&[n * k, h], cfg.dtype, 1)?;
    let x1 = filled(&[n, h], cfg.dtype, 2)?;
    let scales = filled(&[n, k], DType::F32, 3)?;
    let p = permutation(n * k)?;
    let idx = Tensor::from_slice(&p, &[n * k])?;
    let args = FinalizeArgs {
        expanded_x: &x,
        expanded_row_idx: &idx,
        x1: Some(&x1),
        x2: None,
        bias: None,
        scales: Some(&scales),
        expert_idx: None,
        drop_pad_mode: DropPadMode::DropLessRow,
    };
    let bytes = (n * k * h + 2 * n * h) * es + n * k * 8;
    set_num_threads(cfg.threads);
    let threads = finalize_threads(n, h);
    let (shape, dims) = moe_finalize_routing_output_shape(&args)?;
    let backend = Device::Cpu.backend();
    let mut out = backend.zeros(&shape, cfg.dtype)?;
    // The triad's passes take turns with the kernel's calls: a shared host's
    // bandwidth drifts within a second, and a floor measured after all the
    // calls would compare them with another machine. The untimed first round
    // also faults the triad's pages in.
    let mut triad = Triad::try_new(bytes)?;
    let mut kernel = |_| backend.finalize_routing(&args, &dims, &mut out, OutputRows::Dense);
    let mut op = |_| moe_finalize_routing(&args).map(|o| drop(std::hint::black_box(o)));
    let mut floor = |it: usize| {
        triad.pass(threads, 0.5 + it as f32);
        Ok(())
    };
    let r = best_in_turns(cfg.iters, [&mut kernel, &mut op, &mut floor]);
    set_num_threads(None);
    let [kernel_s, op_s, triad_s] = r?;
    Ok(FinalizeReport { threads, bytes, kernel_s, op_s, triad_s })
}

/// The best time in seconds of each of `steps` over `iters` rounds in which
/// they run in turn (each is passed the round), after one untimed round:
/// steps that take turns are measured on the same machine, however a shared
/// host's speed drifts.
fn best_in_turns<const N: usize>(
    iters: usize,
    mut steps: [&mut dyn FnMut(usize) -> Result<()>; N],
) -> Result<[f64; N]> {
    let mut best = [f64::INFINITY; N];
    for round in 0..iters + 1 {
        for (step, best) in steps.iter_mut().zip(&mut best) {
            let t0 = Instant::now();
            step(round)?;
            if round > 0 {
                *best = best.min(t0.elapsed().as_secs_f64());
            }
        }
    }
    Ok(best)
}

/// Sizes of the finalize-and-reduce benchmark.
#[derive(Debug, Clone)]
pub struct ReduceBench {
    /// Tokens of every DP rank (EP = DP x TP ranks run as threads).
    pub dp_tokens: Vec<usize>,
    /// TP size.
    pub tp: usize,
    /// Top-k.
    pub top_k: usize,
    /// Hidden size.
    pub hidden: usize,
    /// Data dtype.
    pub dtype: DType,
    /// Timed repetitions (the best is reported).
    pub iters: usize,
}

impl Default for ReduceBench {
    fn default() -> Self {
        ReduceBench { dp_tokens: vec![3000, 1096], tp: 2, top_k: 2, hidden: 2048, dtype: DType::BF16, iters: 5 }
    }
}

impl ReduceBench {
    /// Refuses sizes the benchmark cannot run, before it builds anything: a
    /// layout [`SpLayout::from_dp_tokens`] refuses, a count of 0, a dtype that
    /// is not a float, more expanded rows than [`MAX_ROWS`], or more host
    /// memory than is available here.
    pub fn check(&self) -> Result<()> {
        self.plan().map(drop)
    }

    /// [`ReduceBench::check`], returning the layout and its byte model.
    fn plan(&self) -> Result<(SpLayout, ReduceBytes)> {
        const OP: &str = "bench_finalize_and_reduce";
        let layout = SpLayout::from_dp_tokens(&self.dp_tokens, self.tp)?;
        let ep = layout.ep_size();
        check_world_size(ep).map_err(|why| Error::invalid(OP, "dp_tokens", format!("{ep} ranks (DP x TP): {why}")))?;
        let (n, k, h) = (layout.total_rows(), self.top_k, self.hidden);
        check_config(OP, &[("top_k", k), ("hidden", h)], self.iters, self.dtype)?;
        check_rows(OP, n, k)?;
        // On each rank: x and the scales built in vectors and copied into
        // tensors, the permutation (pairs, indices, tensor), the two-step
        // path's finalized rows and every result (within four times the
        // rows), and its share of the world's staging segment.
        let es = self.dtype.size();
        let segment = CpuCommConfig::default().bytes_per_rank();
        let inputs =
            bytes_of(&[&[2, ep, n, k, h, es], &[ep, n, k, 4 + 4 + 8 + 4 + 4], &[4, ep, n, h, es], &[ep, segment]]);
        let what =
            format!("finalize_and_reduce of {n} tokens x top_k {k} x hidden {h} {} on {ep} ranks", self.dtype.name());
        let available = memory_available();
        check_memory(OP, &what, inputs, available)?;
        // Within the inputs' count, which fits, so no product of it overflows.
        let bytes = ReduceBytes::new(&layout, k, h, self.dtype);
        // And each rank's floor triad: arrays of at most FLOOR_ARRAYS bytes.
        let need = inputs.and_then(|b| bytes_of(&[&[ep, bytes.fused.min(FLOOR_ARRAYS)]])?.checked_add(b));
        check_memory(OP, &what, need, available)?;
        Ok((layout, bytes))
    }
}

/// Result of [`bench_finalize_and_reduce`] (times are the slowest rank's, best repetition).
#[derive(Debug, Clone)]
pub struct ReduceReport {
    /// `finalize_and_reduce`, seconds.
    pub fused_s: f64,
    /// `moe_finalize_routing` then `maybe_pad_and_reduce`, seconds.
    pub unfused_s: f64,
    /// Bytes the slowest rank moves on each path.
    pub bytes: ReduceBytes,
    /// The fused path's floor: every rank at once runs a one-thread triad
    /// moving [`ReduceBytes::fused`] (over arrays of at most 256 MiB, passed
    /// over as often as that takes), timed like the paths (a barrier before
    /// and after, slowest rank, best repetition), seconds.
    pub floor_s: f64,
    /// False where a row is larger than a staging region of a world of more
    /// than one rank, so that the fused op ran the two-step path; `bytes`
    /// then counts that path's bytes for it ([`ReduceBytes::unstaged`]).
    pub staged: bool,
}

impl ReduceReport {
    /// `unfused_s / fused_s`.
    pub fn speedup(&self) -> f64 {
        self.unfused_s / self.fused_s
    }

    /// `floor_s / fused_s`: the fraction of the same-run triad bandwidth the
    /// fused path moves its bytes at (1.0: at the floor).
    pub fn vs_floor(&self) -> f64 {
        self.floor_s / self.fused_s
    }
}

/// Bytes the slowest rank (the one with the most rows) reads and writes on
/// each path of [`bench_finalize_and_reduce`], counting every pass over
/// memory once. Both paths are memory-bound, so at one bandwidth the speedup
/// cannot pass [`ReduceBytes::bound`], and no fused op whatever can pass
/// [`ReduceBytes::ceiling`].
///
/// With `N` rows in all, `M` on the slowest rank, `n` ranks, top-k `K`, a row
/// of `R` bytes and `G = N*K*(R + 8)` for the gather (the source rows, an i32
/// index and an f32 scale per slot):
/// - `two_step = G + N*R` (finalize writes its output) `+ 2*(N-M)*R` (the
///   reduce-scatter of the blocks as they are, a CPU group's path with a
///   layout, stages the peers' blocks; its own block is read in place)
///   `+ n*M*R + M*R` (it reads one block from every rank and writes the shard);
/// - `fused = G + N*R` (the rows are computed straight into the staging
///   buffers) `+ n*M*R + M*R`;
/// - `minimum = G + M*R`: a rank's share of the least traffic, every source
///   row read once and every output row written once.
///
/// For an even layout and a large `R`: `two_step / fused -> (K+4-1/n) /
/// (K+2+1/n)` and `two_step / minimum -> (K+4-1/n) / (K+1/n)`; an uneven
/// one stages fewer rows than `N-M = (n-1)*M`, so both are lower. On one rank
/// both come out equal: the fused op runs the two-step code there. The model
/// assumes a row fits a staging region (1 MiB on 4 ranks: H up to 512 Ki
/// bf16 elements); a longer row takes the two-step path in the fused op too.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReduceBytes {
    /// `moe_finalize_routing` then `maybe_pad_and_reduce`.
    pub two_step: usize,
    /// `finalize_and_reduce` as the CPU backend runs it (staged).
    pub fused: usize,
    /// The least any fused implementation can move.
    pub minimum: usize,
}

impl ReduceBytes {
    /// The model of [`ReduceBytes`] for `layout`, top-k `top_k` and rows of
    /// `hidden` elements of `dtype`.
    pub fn new(layout: &SpLayout, top_k: usize, hidden: usize, dtype: DType) -> Self {
        let (n, total, m) = (layout.ep_size(), layout.total_rows(), layout.max_rows());
        let row = hidden * dtype.size();
        let gather = total * top_k * (row + 8);
        let collect = n * m * row + m * row;
        ReduceBytes {
            two_step: gather + total * row + 2 * (total - m) * row + collect,
            fused: gather + total * row + collect,
            minimum: gather + m * row,
        }
    }

    /// The model where the fused op cannot stage a row (one row is larger
    /// than a staging region of the world): it runs the two-step path, so it
    /// moves the two-step bytes and `bound` is 1.
    pub fn unstaged(self) -> Self {
        ReduceBytes { fused: self.two_step, ..self }
    }

    /// `two_step / fused`: the speedup of the staged fused path at equal
    /// bandwidth (1 without tokens, when no path moves a byte).
    pub fn bound(&self) -> f64 {
        ratio(self.two_step, self.fused)
    }

    /// `two_step / minimum`: the speedup no fused implementation can pass (1
    /// without tokens).
    pub fn ceiling(&self) -> f64 {
        ratio(self.two_step, self.minimum)
    }
}

/// `a / b` of byte counts; 1 when both are 0 (every count of a batch without
/// tokens is 0, and every count of one with tokens is positive).
fn ratio(a: usize, b: usize) -> f64 {
    if a == 0 && b == 0 {
        1.0
    } else {
        a as f64 / b as f64
    }
}

/// Most bytes a rank's floor triad keeps in its arrays; more bytes are moved
/// in more passes over them (on 4 ranks, at most 1 GiB of arrays in all).
const FLOOR_ARRAYS: usize = 256 << 20;

/// Runs the fused and the two-step EP/SP finalize on `DP x TP` CPU ranks
/// (threads; each rank's kernel single-threaded).
pub fn bench_finalize_and_reduce(cfg: &ReduceBench) -> Result<ReduceReport> {
    let (layout, bytes) = cfg.plan()?;
    let ep = layout.ep_size();
    let (n, k, h) = (layout.total_rows(), cfg.top_k, cfg.hidden);
    let times = run_ranks(ep, &CommOptions::default(), |rank, comm| {
        set_num_threads(Some(1));
        // The path the CPU communicator's fused op takes (run_ranks forms a
        // CPU world); one rank runs the two-step code, whose bytes the model
        // already counts for both there.
        let staged = ep == 1 || !matches!(&comm, crate::Comm::Cpu(c) if !c.stages_rows(h, cfg.dtype));
        let bytes = if staged { bytes } else { bytes.unstaged() };
        let x = filled(&[n * k, h], cfg.dtype, rank as u32)?;
        let scales = filled(&[n, k], DType::F32, 7)?;
        let idx = Tensor::from_slice(&permutation(n * k)?, &[n * k])?;
        let args = FinalizeArgs {
            expanded_x: &x,
            expanded_row_idx: &idx,
            x1: None,
            x2: None,
            bias: None,
            scales: Some(&scales),
            expert_idx: None,
            drop_pad_mode: DropPadMode::DropLessRow,
        };
        // Every repetition's time on this rank; the report takes the slowest
        // rank's of each repetition, then the best repetition.
        let (mut fused, mut unfused) = (Vec::with_capacity(cfg.iters), Vec::with_capacity(cfg.iters));
        let time_fused = || -> Result<f64> {
            comm.barrier()?;
            let t0 = Instant::now();
            let a = finalize_and_reduce(&args, Some(&layout), &comm)?;
            comm.barrier()?;
            std::hint::black_box(&a);
            Ok(t0.elapsed().as_secs_f64())
        };
        let time_two_step = || -> Result<f64> {
            comm.barrier()?;
            let t0 = Instant::now();
            let b = maybe_pad_and_reduce(&moe_finalize_routing(&args)?, Some(&layout), &comm)?;
            comm.barrier()?;
            std::hint::black_box(&b);
            Ok(t0.elapsed().as_secs_f64())
        };
        // Both must give the same bits before either is timed.
        let a = finalize_and_reduce(&args, Some(&layout), &comm)?;
        let b = maybe_pad_and_reduce(&moe_finalize_routing(&args)?, Some(&layout), &comm)?;
        if a.cpu_bytes()? != b.cpu_bytes()? {
            return Err(Error::invalid(
                "bench_finalize_and_reduce",
                "result",
                format!("rank {rank}: the fused result differs from the two-step result"),
            ));
        }
        // The floor, on the same rank threads at once. Arrays of at most
        // FLOOR_ARRAYS bytes, passed over `reps` times, so the floor never
        // doubles the memory of a large shape. Its passes take turns with the
        // two variants, so all three see the same machine.
        let reps = bytes.fused.div_ceil(FLOOR_ARRAYS).max(1);
        let mut triad = Triad::try_new(bytes.fused / reps)?;
        let mut time_floor = |it: usize| -> Result<f64> {
            comm.barrier()?;
            let t0 = Instant::now();
            for r in 0..reps {
                triad.pass(1, 0.5 + (it * reps + r) as f32);
            }
            comm.barrier()?;
            Ok(t0.elapsed().as_secs_f64())
        };
        let mut floor = Vec::with_capacity(cfg.iters);
        // Alternate which variant goes first; the first pass of each (and the
        // floor's, which faults its pages in) warms up.
        for it in 0..cfg.iters + 1 {
            let (df, du) = if it % 2 == 0 {
                let f = time_fused()?;
                (f, time_two_step()?)
            } else {
                let u = time_two_step()?;
                (time_fused()?, u)
            };
            let dt = time_floor(it)?;
            if it > 0 {
                fused.push(df);
                unfused.push(du);
                floor.push(dt);
            }
        }
        Ok((fused, unfused, floor, staged, bytes))
    })?;
    type RankTimes = (Vec<f64>, Vec<f64>, Vec<f64>, bool, ReduceBytes);
    // A repetition takes as long as its slowest rank; the best repetition is
    // reported. (Not each rank's best, then the slowest of those: with more
    // ranks than cores, a rank that is scheduled late after the opening
    // barrier times only the end of the call, and each rank's best can come
    // from another repetition, so that figure is shorter than any repetition
    // took, and shortest for the path with the longest stretch between two
    // synchronisations.)
    let slowest = |f: fn(&RankTimes) -> &[f64]| {
        (0..cfg.iters)
            .map(|i| times.iter().map(|t| f(t).get(i).copied().unwrap_or(0.0)).fold(0.0, f64::max))
            .fold(f64::INFINITY, f64::min)
    };
    // Every rank of the world takes the same path (one staging size, one row).
    let (staged, bytes) = times.first().map_or((true, bytes), |t| (t.3, t.4));
    Ok(ReduceReport {
        fused_s: slowest(|t| &t.0),
        unfused_s: slowest(|t| &t.1),
        bytes,
        floor_s: slowest(|t| &t.2),
        staged,
    })
}

#[cfg(test)]
mod tests {

    fn fake<'a>(files: &'a [(&'a str, &'a str)]) -> impl Fn(&std::path::Path) -> Option<String> + 'a {
        move |p| files.iter().find(|(f, _)| std::path::Path::new(f) == p).map(|(_, t)| t.to_string())
    }

    #[test]
    fn a_memory_cgroups_limit_bounds_the_memory_available() {
        let root = std::path::Path::new("/cg");
        // v2: the group's limit less its working set; a tighter ancestor wins.
        let v2 = [
            ("/cg/a/b/memory.max", "1000\n"),
            ("/cg/a/b/memory.current", "700\n"),
            ("/cg/a/b/memory.stat", "anon 500\ninactive_file 200\nactive_file 0\n"),
            ("/cg/a/memory.max", "max\n"),
            ("/cg/a/memory.current", "900\n"),
        ];
        assert_eq!(cgroup_headroom("0::/a/b\n", root, fake(&v2)), Some(1000 - (700 - 200)));
        let tighter = [("/cg/a/memory.max", "600"), ("/cg/a/memory.current", "550"), v2[0], v2[1], v2[2]];
        assert_eq!(cgroup_headroom("0::/a/b\n", root, fake(&tighter)), Some(50));
        // Usage past the limit leaves no room (not a wrap).
        let over = [("/cg/memory.max", "100"), ("/cg/memory.current", "300")];
        assert_eq!(cgroup_headroom("0::/\n", root, fake(&over)), Some(0));
        // v1: the memory controller's line, its files under root/memory; a
        // page-rounded i64::MAX is no limit.
        let v1 = [
            ("/cg/memory/pa/x/memory.limit_in_bytes", "4096"),
            ("/cg/memory/pa/x/memory.usage_in_bytes", "3000"),
            ("/cg/memory/pa/x/memory.stat", "cache 10\ntotal_inactive_file 1000\n"),
            ("/cg/memory/pa/memory.limit_in_bytes", "9223372036854771712"),
            ("/cg/memory/pa/memory.usage_in_bytes", "3000"),
        ];
        let text = "5:devices:/\n4:memory:/pa/x\n0::/\n";
        assert_eq!(cgroup_headroom(text, root, fake(&v1)), Some(4096 - 2000));
        // No limit anywhere, or no memory controller: none.
        assert_eq!(cgroup_headroom(text, root, fake(&v1[3..])), None);
        assert_eq!(cgroup_headroom("3:cpu:/\n", root, fake(&v1)), None);
    }

    use super::*;

    /// The limits in the doc of [`ReduceBytes`], for even layouts of 2, 4
    /// and 8 ranks at top-k 8 and 2, with rows long enough that the index and
    /// scale bytes are under 0.1% of a row.
    #[test]
    fn reduce_bytes_reach_the_even_layout_limits() {
        for (ranks, k) in [(2usize, 8usize), (4, 8), (8, 8), (4, 2)] {
            let layout = SpLayout::new(&vec![64; ranks]).unwrap();
            let b = ReduceBytes::new(&layout, k, 1 << 16, DType::BF16);
            let (k, n) = (k as f64, ranks as f64);
            let bound = (k + 4.0 - 1.0 / n) / (k + 2.0 + 1.0 / n);
            let ceiling = (k + 4.0 - 1.0 / n) / (k + 1.0 / n);
            assert!((b.bound() / bound - 1.0).abs() < 1e-3, "{ranks} ranks, K {k}: {} vs {bound}", b.bound());
            assert!((b.ceiling() / ceiling - 1.0).abs() < 1e-3, "{ranks} ranks, K {k}: {} vs {ceiling}", b.ceiling());
        }
        // 4 ranks at K = 8, the shapes of `ci/bench.sh`: no fused op reaches 1.5x.
        let b = ReduceBytes::new(&SpLayout::from_dp_tokens(&[2048, 2048], 2).unwrap(), 8, 4096, DType::BF16);
        assert!(b.ceiling() < 1.43 && b.bound() < 1.15, "{b:?}");
    }

    /// The arrays of a memory triad hold three times the last-level cache in
    /// all, within the per-array floor and the total cap.
    #[test]
    fn triad_arrays_are_three_times_the_last_level_cache() {
        let total = |threads: usize, llc: Option<usize>| 3 * threads * triad_array_bytes(threads, llc);
        for threads in [1usize, 2, 4, 8] {
            assert_eq!(total(threads, Some(480 << 20)), ((3 * 480) << 20).max(3 * threads * (32 << 20)), "{threads}");
            assert_eq!(triad_array_bytes(threads, None), 32 << 20);
            assert_eq!(triad_array_bytes(threads, Some(1 << 20)), 32 << 20);
            assert!(total(threads, Some(64 << 30)) <= 4 << 30);
        }
    }

    /// Counts are summed and multiplied without wrapping; a need past the
    /// memory available, or past what a `usize` counts, is refused, naming
    /// the need and what is available.
    #[test]
    fn memory_needs_are_counted_without_wrapping_and_refused_past_what_is_available() {
        assert_eq!(bytes_of(&[&[3, 4], &[5], &[]]), Some(18));
        assert_eq!(bytes_of(&[&[1 << 32, 1 << 32]]), None);
        assert_eq!(bytes_of(&[&[usize::MAX], &[1]]), None);
        assert_eq!(memory_shortfall("x", Some(10), Some(10)), None);
        assert_eq!(memory_shortfall("x", Some(10), None), None);
        let over = "x needs 11 bytes of host memory, more than the 10 bytes available here";
        assert_eq!(memory_shortfall("x", Some(11), Some(10)).as_deref(), Some(over));
        let uncountable = "x needs more bytes of host memory than this machine can address";
        assert_eq!(memory_shortfall("x", None, None).as_deref(), Some(uncountable));
    }

    /// The bench's row indices hold every row once.
    #[test]
    fn timed_steps_take_turns_after_one_untimed_round() {
        let calls = std::cell::RefCell::new(Vec::new());
        let mut a = |r| {
            calls.borrow_mut().push(('a', r));
            Ok(())
        };
        let mut b = |r| {
            calls.borrow_mut().push(('b', r));
            Ok(())
        };
        let best = best_in_turns(2, [&mut a, &mut b]).unwrap();
        assert_eq!(*calls.borrow(), [('a', 0), ('b', 0), ('a', 1), ('b', 1), ('a', 2), ('b', 2)]);
        assert!(best.iter().all(|t| t.is_finite() && *t >= 0.0), "{best:?}");
        // A failing step ends the rounds with its error.
        let mut fail = |r| if r == 1 { Err(Error::invalid("step", "round", "1")) } else { Ok(()) };
        let e = best_in_turns(3, [&mut fail]).unwrap_err().to_string();
        assert!(e.contains("round"), "{e}");
    }

    #[test]
    fn permutations_hold_every_row_once() {
        for n in [0usize, 1, 7, 4096, 10_000] {
            let mut p = permutation(n).unwrap();
            p.sort_unstable();
            assert!(p.iter().copied().eq(0..n as i32), "{n}");
        }
    }

    /// A zero count or an integer dtype is refused with the field's name.
    #[test]
    fn bad_configs_name_the_field() {
        let zero = FinalizeBench { threads: Some(0), ..FinalizeBench::default() };
        let e = bench_finalize(&zero).unwrap_err().to_string();
        assert!(e.contains("threads") && e.contains(">= 1"), "{e}");
        let int = FinalizeBench { dtype: DType::I32, tokens: 1, ..FinalizeBench::default() };
        let e = bench_finalize(&int).unwrap_err().to_string();
        assert!(e.contains("dtype") && e.contains("float"), "{e}");
        let zero = ReduceBench { top_k: 0, ..ReduceBench::default() };
        let e = bench_finalize_and_reduce(&zero).unwrap_err().to_string();
        assert!(e.contains("top_k") && e.contains(">= 1"), "{e}");
    }

    /// A batch without tokens is a valid call of both paths: the bench runs
    /// it (no bytes to move, so its floor is a one-element triad and both
    /// byte ratios are 1, not NaN, which JSON cannot carry).
    #[test]
    fn a_batch_without_tokens_runs() {
        let cfg = ReduceBench { dp_tokens: vec![0, 0], hidden: 8, iters: 1, ..ReduceBench::default() };
        let r = bench_finalize_and_reduce(&cfg).unwrap();
        assert_eq!((r.bytes.minimum, r.bytes.bound(), r.bytes.ceiling()), (0, 1.0, 1.0));
        assert!(r.floor_s.is_finite() && r.fused_s.is_finite() && r.unfused_s.is_finite(), "{r:?}");
    }

    /// Rows too long for a staging region make the fused op run the two-step
    /// path: the report says so and counts that path's bytes for both (bound
    /// 1), where a short row is staged and bound above 1.
    #[test]
    fn a_row_longer_than_a_staging_region_is_reported_as_the_two_step_path() {
        // 4 ranks: a staging region of 1 MiB, a row of 600000 bf16 is 1.2 MB.
        let long =
            ReduceBench { dp_tokens: vec![1, 1], tp: 2, top_k: 1, hidden: 600_000, iters: 1, ..Default::default() };
        let r = bench_finalize_and_reduce(&long).unwrap();
        assert!(!r.staged, "{r:?}");
        assert_eq!((r.bytes.fused, r.bytes.bound()), (r.bytes.two_step, 1.0), "{r:?}");
        let short = ReduceBench { hidden: 64, ..long.clone() };
        let r = bench_finalize_and_reduce(&short).unwrap();
        assert!(r.staged && r.bytes.bound() > 1.0, "{r:?}");
        // One rank has nothing to stage, whatever the row: not reported as unstaged.
        let one = ReduceBench { dp_tokens: vec![2], tp: 1, ..long };
        assert!(bench_finalize_and_reduce(&one).unwrap().staged);
    }

    /// An uneven layout, counted by hand: rows [3, 1] (N = 4, M = 3, n = 2),
    /// K = 2, 4 f32 elements a row (R = 16 bytes).
    #[test]
    fn reduce_bytes_of_an_uneven_layout() {
        let b = ReduceBytes::new(&SpLayout::new(&[3, 1]).unwrap(), 2, 4, DType::F32);
        // G = 4*2*(16+8) = 192; N*R = 64; staging the peer's block of 1 row
        // 2*1*16 = 32; reading one block per rank 2*3*16 = 96; the shard 48.
        assert_eq!(b, ReduceBytes { two_step: 192 + 64 + 32 + 96 + 48, fused: 192 + 64 + 96 + 48, minimum: 240 });
    }
}
