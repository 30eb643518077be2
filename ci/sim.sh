#!/usr/bin/env bash
# Runs the NPU test suite (ci/npu-4card.sh) against the simulated CANN runtime
# (cann-sim), so the NPU backend runs on any machine.
#
# Builds libcann_sim.so, points every CANN library the loader opens at it, and
# runs ci/npu-4card.sh with 4 simulated devices. Arguments are passed to
# ci/npu-4card.sh (default: --no-bench). Environment knobs (see cann-sim/README.md):
#   CANNSIM_LEAK_REPORT  1 (default here: print the leak report of every process)
#                        or fail (a process that leaks exits non-zero)
#   CANNSIM_STREAM_MODE  lazy (default: a missing sync always reads stale data) or eager
set -euo pipefail
cd "$(dirname "$0")/.."

profile_dir=debug
cargo build -p cann-sim
target_dir="${CARGO_TARGET_DIR:-target}"
lib="$(cd "$target_dir/$profile_dir" && pwd)/libcann_sim.so"
if [[ ! -f "$lib" ]]; then
    echo "ci/sim.sh: $lib was not built" >&2
    exit 1
fi

export ASCEND_MOE_ACL_LIB="$lib"
export ASCEND_MOE_HCCL_LIB="$lib"
export ASCEND_MOE_NNOPBASE_LIB="$lib"
export ASCEND_MOE_OPAPI_LIB="$lib"
export CANNSIM_DEVICES="${CANNSIM_DEVICES:-4}"
export CANNSIM_LEAK_REPORT="${CANNSIM_LEAK_REPORT:-1}"
# Collectives fail fast instead of waiting a minute when a test breaks a rank.
export ASCEND_MOE_COMM_TIMEOUT="${ASCEND_MOE_COMM_TIMEOUT:-20}"

echo "ci/sim.sh: simulated CANN runtime at $lib ($CANNSIM_DEVICES devices)"
if [[ ! -x ci/npu-4card.sh ]]; then
    echo "ci/sim.sh: ci/npu-4card.sh is not present yet; nothing to run against the simulator" >&2
    exit 0
fi
# Timings under the simulator mean nothing: skip the benches unless asked.
if (($# == 0)); then
    set -- --no-bench
fi
exec ci/npu-4card.sh "$@"
