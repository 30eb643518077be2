#!/usr/bin/env bash
# The public test job: what `.ci/run` runs and what the README tells you to run.
# Installs what it needs (rustfmt / clippy components), then runs the gates,
# cheapest first. No NPU is needed.
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n== %s ==\n' "$*"; }

step "toolchain components"
rustup component add rustfmt clippy >/dev/null 2>&1 || true

step "cargo fmt --check"
cargo fmt --all -- --check

step "cargo clippy"
cargo clippy --workspace --all-targets -- -D warnings

step "cargo test"
cargo test --workspace

step "NPU suite on the simulated CANN runtime"
ci/sim.sh
