//! Compiles tests/c/smoke.c with the system C compiler against the committed
//! header, links it to the cdylib, and runs it (2 threads: a collective, the
//! finalize op and the error conventions).

use std::path::{Path, PathBuf};
use std::process::Command;

/// `target/<profile>`: the directory holding this test binary's `deps/`.
fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    exe.parent().and_then(Path::parent).expect("target/<profile>/deps/<test>").to_path_buf()
}

#[test]
fn c_program_runs_a_collective_and_an_op() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    // cargo builds the cdylib with the tests; it is uplifted to target/<profile>
    // only by some invocations, so look in deps/ too.
    let profile = profile_dir();
    let lib_dir = [profile.clone(), profile.join("deps")]
        .into_iter()
        .find(|d| d.join("libascend_moe.so").exists())
        .unwrap_or_else(|| panic!("cdylib libascend_moe.so not found in {0} or {0}/deps", profile.display()));
    let exe = Path::new(env!("CARGO_TARGET_TMPDIR")).join("amoe_c_smoke");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let out = Command::new(&cc)
        .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-pedantic"])
        .arg("-I")
        .arg(root.join("include"))
        .arg(root.join("tests/c/smoke.c"))
        .arg("-o")
        .arg(&exe)
        .arg("-L")
        .arg(&lib_dir)
        .arg(format!("-Wl,-rpath,{}", lib_dir.display()))
        .args(["-lascend_moe", "-lpthread", "-lm"])
        .output()
        .unwrap_or_else(|e| panic!("running {cc}: {e}"));
    assert!(out.status.success(), "cc failed:\n{}", String::from_utf8_lossy(&out.stderr));

    let name = format!("amoe-c-smoke-{}", std::process::id());
    let run = Command::new(&exe).arg(&name).output().expect("run the C program");
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(
        run.status.success() && stdout.contains("smoke: ok"),
        "C program failed ({}):\n{stdout}\n{}",
        run.status,
        String::from_utf8_lossy(&run.stderr)
    );
}
