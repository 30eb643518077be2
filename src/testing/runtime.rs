//! Which CANN runtime an NPU test run expects, so a test that needs the
//! simulator's hooks fails when they are missing instead of checking less.
//!
//! `ci/npu-4card.sh` states it in [`EXPECT_RUNTIME_ENV`]: `real` on an Ascend
//! host, `sim` when `ci/sim.sh` runs it against the simulated runtime.
//! Outside that script a set `CANNSIM_CANN_VERSION` (which only the
//! simulator reads) also means the simulator.

use std::env::{self, VarError};

/// The variable `ci/npu-4card.sh` sets: `real` or `sim`.
pub const EXPECT_RUNTIME_ENV: &str = "ASCEND_MOE_EXPECT_RUNTIME";

/// The runtime a run expects.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpectedRuntime {
    /// CANN on an Ascend host.
    Real,
    /// The simulated CANN runtime (cann-sim).
    Simulator,
}

/// The runtime this run expects ([`EXPECT_RUNTIME_ENV`], else the simulator
/// when `CANNSIM_CANN_VERSION` is set), `None` when nothing says. Panics on
/// a value of [`EXPECT_RUNTIME_ENV`] other than `real` or `sim`.
pub fn expected_runtime() -> Option<ExpectedRuntime> {
    match env::var(EXPECT_RUNTIME_ENV) {
        Ok(v) if v == "real" => Some(ExpectedRuntime::Real),
        Ok(v) if v == "sim" => Some(ExpectedRuntime::Simulator),
        Ok(v) => panic!("{EXPECT_RUNTIME_ENV}={v:?}: expected `real` or `sim`"),
        Err(VarError::NotUnicode(v)) => panic!("{EXPECT_RUNTIME_ENV}={v:?}: expected `real` or `sim`"),
        Err(VarError::NotPresent) => env::var_os("CANNSIM_CANN_VERSION").map(|_| ExpectedRuntime::Simulator),
    }
}

/// Whether this run expects the simulated runtime: then a missing simulator
/// hook is a failure.
pub fn expects_simulator() -> bool {
    expected_runtime() == Some(ExpectedRuntime::Simulator)
}

/// `hook` (a simulator-only entry point named `name`), or `None` on a
/// runtime without it; panics when the run expects the simulator and the
/// hook is missing.
pub fn sim_hook<T>(name: &str, hook: Option<T>) -> Option<T> {
    if hook.is_none() && expects_simulator() {
        panic!(
            "the run expects the simulated runtime ({EXPECT_RUNTIME_ENV} or CANNSIM_CANN_VERSION), but the loaded \
             runtime does not export {name}"
        );
    }
    hook
}

/// The simulator's per-thread call counters (`cannsim_counters`), `None` on
/// a runtime without them (real CANN); panics when the run expects the
/// simulator and they are missing, so a counting assertion is never skipped
/// there.
pub fn sim_counters() -> Option<acl_sys::CannsimCounters> {
    let api = acl_sys::acl().unwrap_or_else(|e| panic!("the ACL runtime is not loaded: {e}"));
    sim_hook("cannsim_counters", api.counters())
}

/// Marks the child process [`in_child_that_may_leak`] starts: the name of
/// the test it runs.
const LEAKING_CHILD_ENV: &str = "AMOE_TEST_LEAKING_CHILD";

/// For an NPU test that leaves runtime objects allocated by design (work
/// that never completes, a stream that fails or is captured at a drop: the
/// crate leaks rather than frees under queued work): runs the test `name`
/// (its full libtest name) again, alone, in a child process of this test
/// binary in which the simulator only prints its leak report
/// (`CANNSIM_LEAK_REPORT=1`), so that `ci/sim.sh`, where a process that
/// leaks fails, still fails every other test binary that leaks. Returns
/// `true` in the child, which then runs the test's body, and `false` in the
/// caller once the child passed; under the simulator the child must have
/// printed its leak report.
pub fn in_child_that_may_leak(name: &str) -> bool {
    if env::var(LEAKING_CHILD_ENV).as_deref() == Ok(name) {
        return true;
    }
    let (o, e) = run_ignored_test_in_child(name, &[(LEAKING_CHILD_ENV, name), ("CANNSIM_LEAK_REPORT", "1")]);
    if expects_simulator() {
        assert!(e.contains("cann-sim leak report:"), "the child running {name} printed no leak report:\n{o}\n{e}");
    }
    false
}

/// Runs the ignored test `name` (its full libtest name) of this test binary
/// again, alone, in a child process with `env` added (a setting read once
/// per process, a runtime no other test loaded first), and asserts that it
/// passed there; returns the child's standard output and error. The test
/// tells the child by a variable of `env`.
pub fn run_ignored_test_in_child(name: &str, env: &[(&str, &str)]) -> (String, String) {
    let exe = std::env::current_exe().expect("this test binary");
    let out = std::process::Command::new(exe)
        .args([name, "--exact", "--ignored", "--nocapture", "--test-threads=1"])
        .envs(env.iter().copied())
        .output()
        .unwrap_or_else(|e| panic!("running {name} in a child: {e}"));
    let (o, e) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && o.contains("1 passed"), "{name} failed in its child ({}):\n{o}\n{e}", out.status);
    (o.into_owned(), e.into_owned())
}
