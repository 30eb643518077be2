//! Compiles tests/c/smoke.c with the system C compiler against the committed
//! header, links it to the cdylib, and runs it (2 threads: a collective, the
//! finalize op and the error conventions): once plain, and once built with
//! AddressSanitizer and UndefinedBehaviorSanitizer and run with leak detection.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// `target/<profile>`: the directory holding this test binary's `deps/`.
fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    exe.parent().and_then(Path::parent).expect("target/<profile>/deps/<test>").to_path_buf()
}

/// The directory holding the cdylib.
fn lib_dir() -> PathBuf {
    // cargo builds the cdylib with the tests; it is uplifted to target/<profile>
    // only by some invocations, so look in deps/ too.
    let profile = profile_dir();
    [profile.clone(), profile.join("deps")]
        .into_iter()
        .find(|d| d.join("libascend_moe.so").exists())
        .unwrap_or_else(|| panic!("cdylib libascend_moe.so not found in {0} or {0}/deps", profile.display()))
}

/// The sanitizers of the checked build; errors are fatal, not recovered.
const SANITIZE: &[&str] =
    &["-g", "-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-fno-sanitize-recover=all"];

/// Compiles `source` to `exe` with `extra` flags, linked to the cdylib.
fn compile(source: &Path, exe: &str, extra: &[&str]) -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let lib_dir = lib_dir();
    let exe = Path::new(env!("CARGO_TARGET_TMPDIR")).join(exe);
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let out = Command::new(&cc)
        .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-pedantic"])
        .args(extra)
        .arg("-I")
        .arg(root.join("include"))
        .arg(source)
        .arg("-o")
        .arg(&exe)
        .arg("-L")
        .arg(&lib_dir)
        .arg(format!("-Wl,-rpath,{}", lib_dir.display()))
        .args(["-lascend_moe", "-lpthread", "-lm"])
        .output()
        .unwrap_or_else(|e| panic!("running {cc}: {e}"));
    assert!(out.status.success(), "cc {extra:?} failed:\n{}", String::from_utf8_lossy(&out.stderr));
    exe
}

/// Runs `exe` with the sanitizers' options: leak detection on, the first
/// report ends the run with a failure.
fn run_checked(exe: &Path, args: &[&str]) -> Output {
    Command::new(exe)
        .args(args)
        .env("ASAN_OPTIONS", "detect_leaks=1:halt_on_error=1:exitcode=23")
        .env("UBSAN_OPTIONS", "halt_on_error=1:print_stacktrace=1")
        .output()
        .expect("run the C program")
}

fn smoke_source() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/c/smoke.c")
}

#[test]
fn c_program_runs_a_collective_and_an_op() {
    let exe = compile(&smoke_source(), "amoe_c_smoke", &[]);
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

#[test]
fn c_program_is_clean_under_address_undefined_and_leak_sanitizers() {
    // The sanitizers are live here: a program that leaks, built and run the
    // same way, must fail with a leak report.
    let leak = Path::new(env!("CARGO_TARGET_TMPDIR")).join("amoe_c_leak.c");
    std::fs::write(
        &leak,
        "#include <stdlib.h>\n#include <ascend_moe.h>\nvoid *kept;\n\
         int main(void) { kept = malloc(77); kept = 0; return amoe_version() == 0; }\n",
    )
    .unwrap();
    let leaky = run_checked(&compile(&leak, "amoe_c_leak", SANITIZE), &[]);
    let report = String::from_utf8_lossy(&leaky.stderr);
    assert!(
        !leaky.status.success() && report.contains("LeakSanitizer") && report.contains("77 byte"),
        "a leaking program passed the checked run ({}): the sanitizers are not live\n{report}",
        leaky.status
    );

    let exe = compile(&smoke_source(), "amoe_c_smoke_sanitized", SANITIZE);
    let name = format!("amoe-c-asan-{}", std::process::id());
    let run = run_checked(&exe, &[&name]);
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(
        run.status.success() && stdout.contains("smoke: ok"),
        "C program failed under the sanitizers ({}):\n{stdout}\n{}",
        run.status,
        String::from_utf8_lossy(&run.stderr)
    );
}
