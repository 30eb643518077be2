//! The machine-readable outputs of `ascend-moe bench` that ci/bench.sh reads, and the
//! progress it prints on stderr.

use std::process::Command;

const EXE: &str = env!("CARGO_BIN_EXE_ascend-moe");

fn run(args: &[&str]) -> (String, String) {
    let out = Command::new(EXE).args(args).output().expect("run ascend-moe");
    let (stdout, stderr) =
        (String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned());
    assert!(out.status.success(), "ascend-moe {args:?} failed: {}\n{stderr}", out.status);
    (stdout, stderr)
}

/// The number after the first `"key":` in `json`.
/// Bytes of the three triad arrays each of `world` ranks keeps through the
/// rows of `bench collectives`: as large as `bench triad` makes them.
fn triad_bytes(world: usize) -> u64 {
    let array =
        ascend_moe::testing::bench::triad_array_bytes(world, ascend_moe::testing::bench::last_level_cache_bytes());
    3 * array as u64
}

fn json_number(json: &str, key: &str) -> f64 {
    let at = json.find(&format!("\"{key}\":")).unwrap_or_else(|| panic!("no {key} in {json}")) + key.len() + 3;
    let end = json[at..].find([',', '}']).map(|e| at + e).unwrap_or(json.len());
    json[at..end].parse().unwrap_or_else(|e| panic!("{key}: {e}: {json}"))
}

#[test]
fn collectives_csv_rows_and_progress() {
    let (csv, progress) = run(&[
        "bench",
        "collectives",
        "--ranks",
        "2",
        "--ops",
        "all_reduce,all_gather",
        "--dtype",
        "f32",
        "-b",
        "4K",
        "-e",
        "16K",
        "-f",
        "4",
        "--iters",
        "1",
        "--warmup",
        "0",
        "--csv",
    ]);
    let mut lines = csv.lines();
    let header: Vec<&str> = lines.next().expect("a header line").split(',').collect();
    let col = |name: &str| header.iter().position(|h| *h == name).unwrap_or_else(|| panic!("no column {name}"));
    let rows: Vec<Vec<&str>> = lines.map(|l| l.split(',').collect()).collect();
    // 2 collectives x sizes 4 KiB and 16 KiB.
    assert_eq!(rows.len(), 4, "{csv}");
    let mut seen = Vec::new();
    for r in &rows {
        assert_eq!(r.len(), header.len(), "{csv}");
        let num = |name: &str| r[col(name)].parse::<f64>().unwrap_or_else(|e| panic!("{name}: {e}: {csv}"));
        let op = r[col("op")];
        let bytes = num("bytes");
        assert_eq!((num("ranks"), r[col("dtype")], num("wrong")), (2.0, "f32", 0.0), "{csv}");
        assert_eq!(num("count") * 4.0, bytes, "{csv}");
        // nccl-tests: algbw = size / time, busbw = algbw x 2(n-1)/n (all_reduce) or (n-1)/n.
        let algbw = bytes / (num("time_us") * 1e3);
        let factor = if op == "all_reduce" { 1.0 } else { 0.5 };
        assert!((num("algbw_gbps") - algbw).abs() <= 0.002 + 0.01 * algbw, "{op}: {csv}");
        assert!((num("busbw_gbps") - algbw * factor).abs() <= 0.002 + 0.01 * algbw, "{op}: {csv}");
        assert!(num("floor_us") > 0.0, "{csv}");
        seen.push((op.to_string(), bytes as usize));
    }
    let want: Vec<(String, usize)> =
        [("all_reduce", 4096), ("all_reduce", 16384), ("all_gather", 4096), ("all_gather", 16384)]
            .iter()
            .map(|(o, b)| (o.to_string(), *b))
            .collect();
    assert_eq!(seen, want);
    // Not a terminal: one progress line per finished case, counted against the total.
    for i in 1..=4 {
        assert!(progress.contains(&format!("[{i}/4]")), "no progress line {i}/4 in:\n{progress}");
    }
}

/// One-byte dtypes are moved exactly: the bench counts an element wrong only
/// where it differs from the value the dtype holds (a bool holds 2 and 3 as
/// 1), and a reduction of one is refused before anything runs.
#[test]
fn collectives_move_one_byte_dtypes_and_refuse_to_reduce_them() {
    for dtype in ["bool", "f8e4m3", "i8"] {
        let args = ["bench", "collectives", "--ranks", "2", "--ops", "broadcast,all_gather,all_to_all", "--dtype"];
        let tail = ["-b", "1K", "-e", "1K", "--iters", "1", "--warmup", "0", "--csv"];
        let (csv, _) = run(&[&args[..], &[dtype], &tail[..]].concat());
        let mut lines = csv.lines();
        let header: Vec<&str> = lines.next().expect("a header line").split(',').collect();
        let wrong = header.iter().position(|h| *h == "wrong").expect("a wrong column");
        let rows: Vec<&str> = lines.collect();
        assert_eq!(rows.len(), 3, "{csv}");
        for r in rows {
            assert_eq!(r.split(',').nth(wrong), Some("0"), "{dtype}: {csv}");
        }
    }
    refused(
        &["bench", "collectives", "--dtype", "i8"],
        "--dtype i8: all_reduce reduces, and i8 is only moved, never reduced (choose --ops among all_gather, \
         all_to_all, broadcast)",
    );
    refused(
        &["bench", "collectives", "--dtype", "bool", "--ops", "broadcast,reduce_scatter"],
        "reduce_scatter reduces",
    );
}

/// Every row's floor uses its own triad, the mean of the one taken before
/// its iterations and the one after them, and the JSON says all three (in
/// worlds of threads and of processes, whose ranks send theirs over a pipe).
#[test]
fn collectives_floor_uses_the_triads_around_each_row() {
    for procs in [false, true] {
        let mut args = vec!["bench", "collectives", "--ranks", "2", "--ops", "all_reduce,all_gather", "--dtype", "f32"];
        args.extend(["-b", "4K", "-e", "4K", "--iters", "1", "--warmup", "0", "--json"]);
        args.extend(procs.then_some("--procs"));
        let (json, _) = run(&args);
        let rows: Vec<&str> = json.lines().filter(|l| l.contains("\"op\":")).collect();
        assert_eq!(rows.len(), 2, "{json}");
        for (row, op_bytes) in rows.iter().zip([
            // all_reduce on 2 ranks moves 2 x (5 S - S / 2) bytes; S = 4096.
            2.0 * (5.0 * 4096.0 - 2048.0),
            // all_gather: 2 x (2 S + 2 S / 2).
            2.0 * (2.0 * 4096.0 + 4096.0),
        ]) {
            let num = |key: &str| json_number(row, key);
            let (mean, before, after) = (num("triad_gbps"), num("triad_before_gbps"), num("triad_after_gbps"));
            assert!(before > 0.0 && after > 0.0, "{row}");
            assert!((mean - (before + after) / 2.0).abs() <= 0.002, "{row}");
            let floor_us = op_bytes / (mean * 1e3);
            assert!((num("floor_us") - floor_us).abs() <= 0.01 * floor_us, "{row}");
            // vs_floor is printed to 4 decimals.
            let vs_floor = floor_us / num("time_us");
            assert!((num("vs_floor") - vs_floor).abs() <= 0.000_05 + 0.01 * vs_floor, "{row}");
        }
    }
}

#[test]
fn triad_json() {
    let (json, _) = run(&["bench", "triad", "--threads", "1", "--mib", "1", "--reps", "1", "--json"]);
    let json = json.trim();
    assert!(json.starts_with("{\"bench\":\"triad\",\"threads\":1,\"bytes\":3145728,\"gbps\":"), "{json}");
    let gbps: f64 = json.rsplit(':').next().and_then(|v| v.trim_end_matches('}').parse().ok()).expect("gbps");
    assert!(gbps > 0.0 && gbps.is_finite(), "{json}");
}

/// The largest data or unified cache sysfs lists for CPU 0, read here on
/// its own (bytes; 0 when it lists none).
fn sysfs_last_level_cache() -> usize {
    let Ok(dir) = std::fs::read_dir("/sys/devices/system/cpu/cpu0/cache") else { return 0 };
    let mut best = (0, 0);
    for e in dir.flatten().filter(|e| e.file_name().to_string_lossy().starts_with("index")) {
        let read = |f: &str| std::fs::read_to_string(e.path().join(f)).unwrap_or_default().trim().to_string();
        let (size, unit) = match read("size") {
            s if s.ends_with('K') => (s[..s.len() - 1].to_string(), 1024),
            s if s.ends_with('M') => (s[..s.len() - 1].to_string(), 1024 * 1024),
            s => (s, 1),
        };
        let (Ok(level), Ok(size)) = (read("level").parse::<u32>(), size.parse::<usize>()) else { continue };
        if read("type") != "Instruction" {
            best = best.max((level, size * unit));
        }
    }
    best.1
}

/// Without `--mib` the arrays stream from memory: one thread's three arrays
/// hold three times the last-level cache (at least 32 MiB each, at most
/// 4 GiB in all).
#[test]
fn triad_default_arrays_are_sized_from_the_last_level_cache() {
    let (json, progress) = run(&["bench", "triad", "--threads", "1", "--reps", "1", "--json"]);
    let array = sysfs_last_level_cache().clamp(32 << 20, (4usize << 30) / 3);
    assert_eq!(json_number(&json, "bytes"), (3 * array) as f64, "{json}");
    assert!(progress.contains(&format!("3 x {} MiB per thread", array >> 20)), "{progress}");
}

/// `ascend-moe args` exits 2 (refused arguments) before doing anything, and
/// its error names the argument out of range and its value.
fn refused(args: &[&str], says: &str) {
    let out = Command::new(EXE).args(args).output().expect("run ascend-moe");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "ascend-moe {args:?}: {stderr}");
    assert!(stderr.contains(says), "ascend-moe {args:?} does not say {says:?}: {stderr}");
}

#[test]
fn bench_arguments_out_of_range_are_refused_naming_them() {
    refused(&["bench", "triad", "--threads", "0"], "--threads 0: must be at least 1");
    refused(&["bench", "triad", "--mib", "0"], "--mib 0: must be at least 1");
    refused(&["bench", "triad", "--reps", "0"], "--reps 0: must be at least 1");
    refused(&["bench", "finalize", "--threads", "0"], "--threads 0: must be at least 1");
    let coll = |extra: &[&'static str]| [&["bench", "collectives"][..], extra].concat();
    refused(&coll(&["--ranks", "2,0"]), "--ranks [2, 0]: a world needs at least 1 rank");
    refused(&coll(&["--factor", "1"]), "--factor 1: must be at least 2");
    refused(&coll(&["-b", "0"]), "--min-bytes 0: must be at least 1");
    refused(&coll(&["-b", "2M", "-e", "1M"]), "--min-bytes 2097152 exceeds --max-bytes 1048576");
    refused(&coll(&["--iters", "0"]), "--iters 0: must be at least 1");
    // Staging under the minimum was raised to it unsaid.
    refused(&coll(&["--staging-bytes", "0"]), "--staging-bytes 0: must be at least 4096");
    refused(&["check", "--staging-bytes", "1"], "--staging-bytes 1: must be at least 4096");
    // A timeout under a nanosecond became no wait at all: every rendezvous
    // failed at once, and worker processes refused the 0 they were handed.
    refused(&["check", "--timeout", "1e-300"], "less than the least timeout, 1 ns");
    refused(&coll(&["--timeout", "1e-10"]), "less than the least timeout, 1 ns");
    // Counts whose sum wrapped (one untimed call reported as 0 us), or whose
    // vector of times could not be allocated (a panic, an abort).
    refused(&coll(&["--warmup", "18446744073709551614"]), "--warmup 18446744073709551614: exceeds the maximum");
    refused(&coll(&["--iters", "18446744073709551615"]), "--iters 18446744073709551615: exceeds the maximum");
    refused(&coll(&["--iters", "1000001"]), "--iters 1000001: exceeds the maximum of 1000000 repetitions");
    refused(&["bench", "triad", "--reps", "1000001"], "--reps 1000001: exceeds the maximum of 1000000");
    // Rows of no element were timed and reported as 0-byte rows.
    refused(
        &coll(&["--ranks", "4", "-b", "7", "-e", "7"]),
        "--min-bytes 7: a row must hold at least one bf16 element (2 bytes) per rank, 8 bytes on 4 ranks",
    );
    // A size past the address space wrapped around; the largest --max-bytes
    // looped for ever at the saturated size.
    refused(&coll(&["-e", "17179869184G"]), "size \"17179869184G\" is more bytes than this machine can address");
    refused(
        &coll(&["--ranks", "1", "-b", "8", "-e", "18446744073709551615"]),
        &format!(
            "--max-bytes 18446744073709551615: the row of 9223372036854775808 bytes, an input and an output of that \
             size, 12587008 bytes of staging and {} bytes of triad arrays on each of 1 ranks, needs more bytes of \
             host memory than this machine can address",
            triad_bytes(1)
        ),
    );
    // Rows larger than the host's memory were killed part-way, without a word.
    // Per rank: 2 x 4096 GiB of buffers, 3 slots of 1 MiB + 4 KiB of staging
    // segment, and the triad's three arrays.
    refused(
        &coll(&["--ranks", "64", "-b", "4096G", "-e", "4096G", "--staging-bytes", "1048576"]),
        &format!(
            "of triad arrays on each of 64 ranks, needs {} bytes of host memory, more than the",
            64 * (2 * (4096u64 << 30) + 3 * (1 << 20) + 4096 + triad_bytes(64))
        ),
    );
    // A staging segment larger than the host's memory, under small rows:
    // the refusal names --staging-bytes too.
    refused(
        &coll(&["--ranks", "2", "-b", "8", "-e", "8", "--staging-bytes", "1099511627776"]),
        &format!(
            "--max-bytes 8 with --staging-bytes 1099511627776: the row of 8 bytes, an input and an output of that size, 3298534887424 bytes of staging \
             and {} bytes of triad arrays on each of 2 ranks, needs {} bytes of host memory, more than the",
            triad_bytes(2),
            2 * (2 * 8 + 3 * (1u64 << 40) + 4096 + triad_bytes(2))
        ),
    );
    // Triad arrays past the host's memory: an abort in the allocator, or the
    // kernel killing the run; a size past the address space wrapped around.
    refused(
        &["bench", "triad", "--threads", "1000", "--mib", "1000000"],
        "a triad of 1000 threads over 3 arrays of 1048576000000 bytes each needs 3145728000000000 bytes of host \
         memory, more than the",
    );
    refused(&["bench", "triad", "--mib", "18446744073709551615"], "--mib 18446744073709551615: more bytes than");
    // The benches' own inputs: an element count that wrapped (2^61 x 8 rows
    // became 0), int32 row indices past their range, and inputs larger than
    // the host's memory. Unchecked, these built vectors of a wrapped length,
    // allocated gigabytes before failing, or aborted in the allocator.
    let moe = |bench: &'static str, extra: &[&'static str]| [&["bench", bench][..], extra].concat();
    let rows = "expanded rows: int32 row indices reach at most 2147483648 rows";
    refused(
        &moe("finalize", &["--tokens", "2305843009213693952"]),
        &format!("2305843009213693952 tokens x top_k 8 {rows}"),
    );
    refused(&moe("finalize", &["--tokens", "268435457"]), &format!("268435457 tokens x top_k 8 {rows}"));
    refused(
        &moe("finalize", &["--tokens", "268435456", "--hidden", "1048576"]),
        "bench_finalize: invalid argument `shape`: finalize 268435456x8x1048576 bf16 needs ",
    );
    refused(
        &moe("finalize_and_reduce", &["--dp-tokens", "2147483649", "--tp", "1", "--top-k", "1", "--hidden", "2"]),
        "invalid argument `tokens`: 2147483649 tokens x top_k 1 ",
    );
    refused(
        &moe("finalize_and_reduce", &["--dp-tokens", "1073741824", "--hidden", "1048576"]),
        "finalize_and_reduce of 1073741824 tokens x top_k 2 x hidden 1048576 bf16 on 2 ranks needs ",
    );
    // Sizes and dtypes the MoE benchmarks cannot run: refused arguments (2),
    // not a failed run (1).
    refused(&moe("finalize", &["--tokens", "0"]), "bench_finalize: invalid argument `tokens`: must be >= 1");
    refused(&moe("finalize", &["--dtype", "i32"]), "bench_finalize: `dtype` has dtype i32, expected a float dtype");
    refused(&moe("finalize_and_reduce", &["--iters", "0"]), "invalid argument `iters`: must be >= 1");
    // `iters + 1` wrapped: no timed pass, an infinite time printed as JSON.
    let many = "invalid argument `iters`: 18446744073709551615 exceeds the maximum of 1000000 repetitions";
    refused(&moe("finalize", &["--iters", "18446744073709551615"]), many);
    refused(&moe("finalize_and_reduce", &["--iters", "18446744073709551615"]), many);
    refused(&moe("finalize_and_reduce", &["--tp", "0"]), "invalid argument `tp_size`: expected >= 1, got 0");
    refused(&moe("finalize_and_reduce", &["--dtype", "u8"]), "`dtype` has dtype u8, expected a float dtype");
}

/// The value of `"key":` in a flat JSON text (numbers and strings without escapes).
fn field<'a>(json: &'a str, key: &str) -> &'a str {
    let at = json.find(&format!("\"{key}\":")).unwrap_or_else(|| panic!("no {key} in {json}")) + key.len() + 3;
    let rest = &json[at..];
    let end = rest.find([',', '}']).unwrap_or(rest.len());
    rest[..end].trim_matches('"')
}

#[test]
fn finalize_json() {
    let (json, _) = run(&[
        "bench",
        "finalize",
        "--tokens",
        "64",
        "--top-k",
        "4",
        "--hidden",
        "96",
        "--dtype",
        "bf16",
        "--threads",
        "1",
        "--iters",
        "1",
        "--json",
    ]);
    let num = |k: &str| field(&json, k).parse::<f64>().unwrap_or_else(|e| panic!("{k}: {e}: {json}"));
    assert_eq!((field(&json, "op"), field(&json, "dtype")), ("finalize", "bf16"), "{json}");
    assert_eq!((num("tokens"), num("topk"), num("hidden"), num("threads")), (64.0, 4.0, 96.0, 1.0));
    // expanded_x [T*K, H] and x1 [T, H] read, out [T, H] written (2 bytes each), i32 index + f32 scale per (t, k).
    assert_eq!(num("bytes"), (64.0 * 4.0 * 96.0 + 2.0 * 64.0 * 96.0) * 2.0 + 64.0 * 4.0 * 8.0);
    let (t, floor) = (num("time_us"), num("floor_us"));
    assert!(t > 0.0 && floor > 0.0, "{json}");
    assert!((num("floor_ratio") - floor / t).abs() <= 1e-3 * (1.0 + floor / t), "{json}");
    assert!((num("gbps") - num("bytes") / (t * 1e3)).abs() <= 1e-3 * (1.0 + num("gbps")), "{json}");
}

/// Without `--threads` the bench runs the default call: `ASCEND_MOE_NUM_THREADS`
/// threads, but only as many as have 65,536 output elements each, and one for
/// a decode-size call.
#[test]
fn finalize_threads_default_to_the_library_choice() {
    let threads = |tokens: &str, hidden: &str, env: &str| {
        let out = Command::new(EXE)
            .args(["bench", "finalize", "--tokens", tokens, "--top-k", "1", "--hidden", hidden])
            .args(["--dtype", "f32", "--iters", "1", "--json"])
            .env("ASCEND_MOE_NUM_THREADS", env)
            .output()
            .expect("run ascend-moe");
        let json = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(out.status.success(), "{json}{}", String::from_utf8_lossy(&out.stderr));
        field(&json, "threads").parse::<usize>().unwrap_or_else(|e| panic!("threads: {e}: {json}"))
    };
    // [4, 4096]: 16,384 output elements, under one thread's share.
    assert_eq!(threads("4", "4096", "4"), 1);
    // [48, 4096]: 196,608 elements = 3 shares; the variable allows 4.
    assert_eq!(threads("48", "4096", "4"), 3);
    // [64, 4096]: 4 shares, and the variable allows only 2.
    assert_eq!(threads("64", "4096", "2"), 2);
}

#[test]
fn finalize_and_reduce_csv() {
    let (csv, _) = run(&[
        "bench",
        "finalize_and_reduce",
        "--dp-tokens",
        "10,6",
        "--tp",
        "2",
        "--top-k",
        "2",
        "--hidden",
        "32",
        "--dtype",
        "f32",
        "--iters",
        "1",
        "--csv",
    ]);
    let lines: Vec<&str> = csv.lines().collect();
    assert_eq!(lines.len(), 3, "{csv}");
    assert_eq!(lines[0], "op,dtype,tokens,topk,hidden,world,dp_tokens,tp,iters,time_us");
    for (line, op) in lines[1..].iter().zip(["finalize_and_reduce", "finalize_then_pad_reduce"]) {
        assert!(line.starts_with(&format!("{op},f32,16,2,32,4,10 6,2,1,")), "{csv}");
        let t: f64 = line.rsplit(',').next().and_then(|v| v.parse().ok()).expect("time_us");
        assert!(t > 0.0, "{csv}");
    }
}

/// `--json` carries the byte model of both paths: an even layout of 4 ranks at
/// K = 8 with f32 rows of 512 (R = 2048 bytes) moves, on the slowest rank,
/// G = 64*8*(2048+8) bytes for the gather, then N*R + 2*3*16*R + 4*16*R + 16*R
/// (two-step) or N*R + 4*16*R + 16*R (fused) or 16*R (minimum) more; and
/// the fused path's same-run floor.
#[test]
fn finalize_and_reduce_json_has_the_byte_model() {
    let (json, _) = run(&[
        "bench",
        "finalize_and_reduce",
        "--dp-tokens",
        "32,32",
        "--tp",
        "2",
        "--top-k",
        "8",
        "--hidden",
        "512",
        "--dtype",
        "f32",
        "--iters",
        "1",
        "--json",
    ]);
    let fused = json.split("},{").next().expect("the fused row");
    assert!(fused.contains("\"op\":\"finalize_and_reduce\""), "{json}");
    let num = |key: &str| json_number(fused, key);
    let (g, r) = (64.0 * 8.0 * 2056.0, 2048.0);
    assert_eq!(num("two_step_bytes"), g + 64.0 * r + 96.0 * r + 64.0 * r + 16.0 * r, "{json}");
    assert_eq!(num("fused_bytes"), g + 64.0 * r + 64.0 * r + 16.0 * r, "{json}");
    assert_eq!(num("min_bytes"), g + 16.0 * r, "{json}");
    assert!((num("bound") - num("two_step_bytes") / num("fused_bytes")).abs() < 1e-4, "{json}");
    assert!((num("ceiling") - num("two_step_bytes") / num("min_bytes")).abs() < 1e-4, "{json}");
    // The same-run floor of the fused path: a triad time, and the ratio is floor / fused time.
    let floor = num("fused_floor_us");
    assert!(floor > 0.0 && floor.is_finite(), "{json}");
    assert!((num("fused_vs_floor") / (floor / num("time_us")) - 1.0).abs() < 1e-2, "{json}");
    assert!(fused.contains("\"fused_staged\":true"), "{json}");
}

/// A row larger than a staging region (600000 bf16 elements, 1.2 MB, on 4
/// ranks: 1 MiB regions): the fused op runs the two-step path, and the CLI
/// says so, counting that path's bytes for both (bound 1).
#[test]
fn finalize_and_reduce_says_when_the_fused_op_ran_the_two_step_path() {
    let args = ["bench", "finalize_and_reduce", "--dp-tokens", "1,1", "--tp", "2", "--top-k", "1"];
    let long = [&args[..], &["--hidden", "600000", "--iters", "1"]].concat();
    let (json, _) = run(&[&long[..], &["--json"]].concat());
    let fused = json.split("},{").next().expect("the fused row");
    assert!(fused.contains("\"fused_staged\":false"), "{json}");
    assert_eq!(json_number(fused, "fused_bytes"), json_number(fused, "two_step_bytes"), "{json}");
    assert_eq!(json_number(fused, "bound"), 1.0, "{json}");
    let (table, _) = run(&long);
    assert!(table.contains("the fused op ran the two-step path: a row of 600000 bf16 elements"), "{table}");
}

/// The worker's all-reduce task with a count past memory fails naming the
/// tensor (exit 3, a rank's own failure); it aborted on the allocation.
#[test]
fn a_worker_all_reduce_past_memory_fails_instead_of_aborting() {
    let name = format!("cli-worker-{}", std::process::id());
    let out = Command::new(EXE)
        .args(["worker", "--name", &name, "--world", "1", "--rank", "0", "all-reduce", "--count"])
        .arg(usize::MAX.to_string())
        .output()
        .expect("run ascend-moe");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{stderr}");
    assert!(stderr.contains("Tensor::zeros") && stderr.contains("fits in isize"), "{stderr}");
}
