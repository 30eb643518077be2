//! The CLI's MoE parts: the `moe` check section on separate processes, and the
//! two MoE benchmarks on tiny sizes (smoke only; they are not timed here).

use std::process::Command;

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
