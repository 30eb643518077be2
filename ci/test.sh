#!/usr/bin/env bash
# The public test job: what `.ci/run` runs and what the README tells you to run.
# Installs what it needs (system packages through ci/deps.sh, the rustfmt /
# clippy components, the Python packages in a venv), each found missing by
# trying to use it, then runs the gates, cheapest first. No NPU is needed.
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n== %s ==\n' "$*"; }

# Every test runner's output also goes to this log, so the job can end with
# one total over cargo test, pytest and the simulated-NPU run.
results="$(mktemp)"
trap 'rm -f "$results"' EXIT
record() { tee -a "$results"; }

step "system dependencies (ci/deps.sh)"
# shellcheck source=ci/deps.sh
source ci/deps.sh
deps_all

step "toolchain components"
if ! cargo fmt --version >/dev/null 2>&1 || ! cargo clippy --version >/dev/null 2>&1; then
    rustup component add rustfmt clippy
fi
cargo fmt --version >/dev/null 2>&1 || { echo "ci/test.sh: cargo fmt does not run" >&2; exit 1; }
cargo clippy --version >/dev/null 2>&1 || { echo "ci/test.sh: cargo clippy does not run" >&2; exit 1; }

step "cargo fmt --check"
cargo fmt --all -- --check

step "CANN bindings match the real headers (ci/headers.sh)"
bash ci/headers.sh

step "cargo clippy"
cargo clippy --workspace --all-targets -- -D warnings

step "cargo doc (no broken or private links)"
RUSTDOCFLAGS=-Dwarnings cargo doc --no-deps --workspace

step "cargo test"
# The C ABI fuzz test runs on its own below, for a fixed time.
cargo test --workspace -- --skip random_descriptors_give_clean_errors 2>&1 | record

step "C ABI fuzz test, one minute (tests/capi_fuzz.rs)"
# The same seed every run, so the cases are a prefix of one fixed sequence;
# it prints the cases per second. Longer: AMOE_FUZZ_SECS=600 ci/test.sh.
AMOE_FUZZ_SECS="${AMOE_FUZZ_SECS:-60}" AMOE_FUZZ_CASES=1000000000000 \
    cargo test --test capi_fuzz -- --nocapture 2>&1 | record

step "python wheel + multi-process pytest suite"
# The C header drift check and the C smoke program ran in `cargo test`
# (tests/capi_header.rs, tests/capi_c.rs). Here: build the Python package's
# wheel (setuptools-rust compiles the cdylib into it), check the library is
# inside, install it into a virtualenv and run its suite against it, with no
# ASCEND_MOE_LIB: the installed package must find its own library.
target_dir="$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')"
venv="$target_dir/ci-venv"
py="$venv/bin/python"
# A venv left by an earlier run is reused only if its pip really runs.
if ! "$py" -m pip --version >/dev/null 2>&1; then
    rm -rf "$venv"
    "$AMOE_PYTHON" -m venv "$venv"
fi
"$py" -m pip install --quiet --disable-pip-version-check numpy ml_dtypes pytest
# torch (CPU use only, ~5 GB with its CUDA wheels) for the torch.library custom ops;
# with CI set, python/tests/test_torch_ops.py fails instead of skipping without it.
"$py" -m pip install --quiet --disable-pip-version-check --no-cache-dir torch
"$py" -c 'import numpy, ml_dtypes, pytest, torch; torch.library.custom_op' \
    || { echo "ci/test.sh: the venv's numpy / ml_dtypes / pytest / torch do not import" >&2; exit 1; }
# The wheel is built in cargo's target directory with the dev profile, which
# `cargo test` above already compiled: pip's build finds the library fresh
# (pyproject.toml passes the crate types of Cargo.toml's [lib]). pip's build
# environment gets setuptools and setuptools-rust from the package index, as
# on any fresh machine.
wheel_dir="$target_dir/python-wheel"
rm -rf "$wheel_dir"
wheel_start=$SECONDS
CARGO_TARGET_DIR="$target_dir" SETUPTOOLS_RUST_CARGO_PROFILE=dev \
    "$py" -m pip wheel --quiet --disable-pip-version-check --no-deps --wheel-dir "$wheel_dir" ./python
wheel="$(ls "$wheel_dir"/ascend_moe-*.whl)"
"$py" - "$wheel" <<'PY' || { echo "ci/test.sh: the wheel does not bundle the native library" >&2; exit 1; }
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
libs = [n for n in names if n.startswith("ascend_moe/libascend_moe") and n.endswith(".so")]
print(f"{sys.argv[1]}: {len(names)} files, native library {libs}")
sys.exit(0 if len(libs) == 1 else 1)
PY
echo "wheel built in $((SECONDS - wheel_start)) s"
"$py" -m pip install --quiet --disable-pip-version-check --force-reinstall --no-deps "$wheel"
unset ASCEND_MOE_LIB
# Run from the repository root so the installed package, not python/ascend_moe,
# is imported. pytest's exit code is the job's: 1 = failures, 5 = no tests ran.
# python/tests/test_sim.py (the Python API on simulated NPU memory) runs once,
# in the simulated NPU suite below (ci/npu-4card.sh's Python step), over the
# runtime that suite loaded; test_npu.py skips here (it needs real NPUs).
pytest_rc=0
CI="${CI:-true}" "$py" -m pytest -q -p no:cacheprovider --ignore python/tests/test_sim.py python/tests 2>&1 | record \
    || pytest_rc=$?
if [ "$pytest_rc" -ne 0 ]; then
    echo "pytest failed with exit code $pytest_rc" >&2
    exit "$pytest_rc"
fi

step "NPU suite on the simulated CANN runtime"
# Its Python step runs with the venv's interpreter.
AMOE_TEST_PYTHON="$py" ci/sim.sh 2>&1 | record

step "summary"
# cargo: "test result: ok. N passed; M failed; ..."; pytest: "N passed[, M failed] in Ts".
awk '/^test result:|(passed|failed).* in [0-9.]+s/ {
        for (i = 2; i <= NF; i++) { if ($i ~ /^passed/) p += $(i-1); if ($i ~ /^failed/) f += $(i-1) }
    }
    END { printf "tests: %d passed, %d failed\n", p, f }' "$results"
