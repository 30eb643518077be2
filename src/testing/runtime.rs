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
