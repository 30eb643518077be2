//! The CLI's MoE parts: the `moe` check section on separate processes, and the
//! two MoE benchmarks on tiny sizes (smoke only; they are not timed here).

use std::process::Command;

use ascend_moe::backend::cpu::MAX_WORLD;
use ascend_moe::testing::layer::all_layer_cases;

const EXE: &str = env!("CARGO_BIN_EXE_ascend-moe");

#[test]
fn check_moe_section_passes_on_processes_one_row_per_case() {
    let o = Command::new(EXE)
        .args(["check", "--world", "2", "--procs", "--timeout", "60", "--section", "moe"])
        .output()
        .expect("run check");
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{out}\n{}", String::from_utf8_lossy(&o.stderr));
    let cases = all_layer_cases().into_iter().filter(|c| c.world() <= 2).count();
    assert!(out.contains(&format!("all {cases} cases passed on 2 ranks")), "{out}");
    assert_eq!(out.lines().filter(|l| l.starts_with("moe ")).count(), cases, "{out}");
    // The columns line up: the dtype of every row (and the header's) starts
    // where the header's does, however long the case name.
    let header = out.lines().find(|l| l.starts_with("section ")).expect("a header row");
    let col = header.find(" dtype ").expect("a dtype column") + 1;
    for l in out.lines().filter(|l| l.starts_with("moe ")) {
        assert_eq!(&l[col - 1..col], " ", "the case runs into the dtype column: {l:?}\n{header:?}");
        assert!(l[col..].starts_with("f32 ") || l[col..].starts_with("bf16 "), "dtype not at column {col}: {l:?}");
    }
}

/// `check --staging-bytes`: every collective case passes when each takes
/// many staging rounds, on threads and on processes, and the header says the
/// size the world used (1 MiB unless told: a 64 MiB /dev/shm holds it).
#[test]
fn check_collectives_pass_with_the_staging_size_given() {
    for (staging, procs) in [(Some("16384"), false), (Some("16384"), true), (None, false)] {
        let mut cmd = Command::new(EXE);
        cmd.args(["check", "--world", "3", "--section", "collectives"]);
        if let Some(s) = staging {
            cmd.args(["--staging-bytes", s]);
        }
        if procs {
            cmd.arg("--procs");
        }
        let o = cmd.output().expect("run check");
        let (out, err) = (String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
        assert!(o.status.success() && out.contains("cases passed on 3 ranks"), "{out}\n{err}");
        let want = if staging.is_some() { "staging 16 KiB x 3 slots per rank" } else { "staging 1024 KiB x 3" };
        assert!(err.contains(want), "{staging:?} procs {procs}: {err}");
    }
}

#[test]
fn moe_benchmarks_run() {
    let o = Command::new(EXE)
        .args(["bench", "finalize", "--tokens", "64", "--top-k", "4", "--hidden", "96", "--iters", "1"])
        .output()
        .expect("run bench");
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success() && out.contains("vs floor"), "{out}\n{}", String::from_utf8_lossy(&o.stderr));
    let o = Command::new(EXE)
        .args(["bench", "finalize_and_reduce", "--dp-tokens", "30,7", "--tp", "2", "--hidden", "16", "--iters", "1"])
        .output()
        .expect("run bench");
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success() && out.contains("speedup"), "{out}\n{}", String::from_utf8_lossy(&o.stderr));
    let o = Command::new(EXE).args(["bench", "finalize", "--dtype", "i32"]).output().expect("run bench");
    assert!(!o.status.success());
}

/// The `spec` section prints a row per SPEC op and per regression it covers,
/// and every one passes, on 1 rank (where nothing reduces), on 2 ranks and on
/// 3 (a world that divides no power-of-two token count).
#[test]
fn check_spec_section_has_a_row_per_op_and_regression() {
    for world in ["1", "2", "3"] {
        let o = Command::new(EXE).args(["check", "--world", world, "--section", "spec"]).output().expect("run check");
        let out = String::from_utf8_lossy(&o.stdout);
        assert!(o.status.success(), "{out}\n{}", String::from_utf8_lossy(&o.stderr));
        let rows: Vec<&str> = out.lines().filter(|l| l.starts_with("spec ")).collect();
        for want in [
            "1 finalize_routing mode 0",
            "1 finalize_routing mode 3",
            "1 token_unpermute",
            "2 sp_layout pcp",
            "3 pad_and_reduce uneven",
            "4 gather_unpad uneven",
            "1+3 finalize_and_reduce",
            "5 reduce tp sp=0",
            "5 reduce sp-only sp=1",
            "5 policy tp+sp refused as sp-only",
            "5 shared pad_reduce_scatter",
            "5 comm type disagreement",
            "6 prepare/finalize MC2 sp=1",
            "6 mc2_mask num_actual_tokens",
            "regression policy built under MC2 run under ALLGATHER",
            "regression stale comm type reduction caught",
            "regression draft-model finalize rows = meta",
        ] {
            assert!(rows.iter().any(|r| r.contains(want)), "no row {want:?} on {world} rank(s):\n{out}");
        }
        assert!(rows.iter().all(|r| r.contains(" ok ")), "{out}");
        assert!(out.contains(&format!("all {} cases passed on {world} ", rows.len())), "{out}");
    }
}

/// A world over the CPU communicator's limit, or of no rank, is refused
/// before any rank starts, as threads and as processes, by `check` and both
/// benchmarks that start worlds (a very large one used to exhaust memory
/// starting them), with the exit status of refused arguments, 2 (a failed
/// check is 1).
#[test]
fn worlds_over_the_limit_are_refused_before_they_start() {
    let over = (MAX_WORLD + 1).to_string();
    let limit = format!("world size {over} exceeds the CPU communicator's limit of {MAX_WORLD} ranks");
    let check = format!("error: --world {over}: {limit}");
    let empty = "error: --world 0: world size 0: a group needs at least one rank";
    let bench = format!("error: {over} ranks exceed the CPU communicator's limit of {MAX_WORLD}");
    let reduce =
        format!("error: bench_finalize_and_reduce: invalid argument `dp_tokens`: {over} ranks (DP x TP): {limit}");
    let sizes = ["--min-bytes", "1K", "--max-bytes", "1K"];
    let runs: [(Vec<&str>, &str); 7] = [
        (vec!["check", "--world", &over], &check),
        (vec!["check", "--world", &over, "--procs"], &check),
        (vec!["check", "--world", "0"], empty),
        (vec!["check", "--world", "0", "--procs"], empty),
        ([&["bench", "collectives", "--ranks", &over][..], &sizes].concat(), &bench),
        ([&["bench", "collectives", "--ranks", &over, "--procs"][..], &sizes].concat(), &bench),
        (vec!["bench", "finalize_and_reduce", "--dp-tokens", "1", "--tp", &over], &reduce),
    ];
    for (args, want) in runs {
        let out = Command::new(EXE).args(&args).output().expect("run ascend-moe");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert_eq!(err.lines().last(), Some(want), "{args:?}: {err}");
    }
}

/// `--timeout` takes a positive number of seconds: NaN, zero and negative
/// values are refused by name (they used to run with a 1 ms timeout), and
/// `inf` waits without practical bound (it used to panic).
#[test]
fn timeouts_are_positive_seconds_and_inf_is_unbounded() {
    for cmd in [&["check", "--world", "1"][..], &["bench", "collectives", "--ranks", "1", "-b", "1K", "-e", "1K"]] {
        for bad in ["nan", "0", "-1", "soon"] {
            let out = Command::new(EXE).args(cmd).arg(format!("--timeout={bad}")).output().expect("run ascend-moe");
            let err = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(2), "{cmd:?} --timeout {bad}: {err}");
            assert!(err.contains("--timeout") && err.contains(bad), "{cmd:?} --timeout {bad}: {err}");
        }
    }
    let out = Command::new(EXE)
        .args(["check", "--world", "1", "--section", "collectives", "--timeout", "inf"])
        .output()
        .expect("run ascend-moe");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

/// The output of a successful `ascend-moe info` with each variable of
/// `vars` set to its value, or removed where it has none.
fn info_with(vars: &[(&str, Option<&str>)]) -> String {
    let mut c = Command::new(EXE);
    c.arg("info");
    for (var, value) in vars {
        match value {
            Some(v) => c.env(var, v),
            None => c.env_remove(var),
        };
    }
    let o = c.output().expect("run info");
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(o.status.success(), "{out}\n{}", String::from_utf8_lossy(&o.stderr));
    out
}

/// `info` says where the kernel thread count and the comm timeout come from,
/// and names a setting that is ignored because it is not a valid value (a
/// typo such as `30s` left the 60 s default in force without a word).
#[test]
fn info_names_the_thread_and_timeout_settings_it_ignores() {
    let info =
        |threads, timeout| info_with(&[("ASCEND_MOE_NUM_THREADS", threads), ("ASCEND_MOE_COMM_TIMEOUT", timeout)]);
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let out = info(None, None);
    assert!(
        out.contains(&format!("kernel threads       up to {cores} (the cores: ASCEND_MOE_NUM_THREADS not set)")),
        "{out}"
    );
    assert!(out.contains("comm timeout         60s (the default: ASCEND_MOE_COMM_TIMEOUT not set)"), "{out}");
    let out = info(Some("3"), Some("2.5"));
    assert!(out.contains("kernel threads       up to 3 (ASCEND_MOE_NUM_THREADS)\n"), "{out}");
    assert!(out.contains("comm timeout         2.5s (ASCEND_MOE_COMM_TIMEOUT)\n"), "{out}");
    let out = info(Some("0"), Some("30s"));
    let threads = format!("up to {cores} (the cores: ASCEND_MOE_NUM_THREADS=\"0\" ignored, not a positive integer)");
    assert!(out.contains(&threads), "{out}");
    let timeout = "60s (the default: ASCEND_MOE_COMM_TIMEOUT=\"30s\" ignored, not a positive number of seconds)";
    assert!(out.contains(timeout), "{out}");
}

/// `info` shows whether the opt-in checks are on, and names a switch value
/// it ignores (`=true` left a check someone meant to turn on off).
#[test]
fn info_shows_the_check_switches_and_the_values_it_ignores() {
    let info = |comm, layout| info_with(&[("ASCEND_MOE_CHECK_COMM_TYPE", comm), ("ASCEND_MOE_CHECK_LAYOUT", layout)]);
    let out = info(None, None);
    assert!(
        out.contains("comm-type check      on for CPU groups, off over HCCL (ASCEND_MOE_CHECK_COMM_TYPE not set)"),
        "{out}"
    );
    assert!(
        out.contains("layout check         off over HCCL, CPU groups compare counts (ASCEND_MOE_CHECK_LAYOUT not set)"),
        "{out}"
    );
    let out = info(Some(" 0 "), Some("1"));
    assert!(out.contains("comm-type check      off (ASCEND_MOE_CHECK_COMM_TYPE=0)\n"), "{out}");
    assert!(out.contains("layout check         on (ASCEND_MOE_CHECK_LAYOUT=1)\n"), "{out}");
    let out = info(Some("yes"), Some("true"));
    assert!(out.contains("(ASCEND_MOE_CHECK_COMM_TYPE=\"yes\" ignored, not 1 or 0)"), "{out}");
    assert!(out.contains("(ASCEND_MOE_CHECK_LAYOUT=\"true\" ignored, not 1 or 0)"), "{out}");
}

/// `ascend-moe info` shows the host pool's bound and where it comes from,
/// and says that a bad `ASCEND_MOE_HOST_POOL_BYTES` fails allocations.
#[test]
fn info_shows_the_host_pool_bound_and_a_bad_setting() {
    let info = |pool| info_with(&[("ASCEND_MOE_HOST_POOL_BYTES", pool)]);
    let out = info(None);
    assert!(out.contains("host pool            keeps up to 1024 MiB of dropped results (the default:"), "{out}");
    let out = info(Some("256M"));
    assert!(
        out.contains("host pool            keeps up to 256 MiB of dropped results (ASCEND_MOE_HOST_POOL_BYTES)\n"),
        "{out}"
    );
    let out = info(Some("0"));
    assert!(out.contains("host pool            keeps no dropped results (ASCEND_MOE_HOST_POOL_BYTES=0)\n"), "{out}");
    let out = info(Some("3K"));
    assert!(out.contains("keeps up to 3072 bytes of dropped results (ASCEND_MOE_HOST_POOL_BYTES)"), "{out}");
    let out = info(Some("256MB"));
    assert!(out.contains("ASCEND_MOE_HOST_POOL_BYTES=\"256MB\" is not a number of bytes"), "{out}");
    assert!(out.contains("fail to allocate"), "{out}");
}
