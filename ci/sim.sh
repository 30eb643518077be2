#!/usr/bin/env bash
# Runs the NPU test suite (ci/npu-4card.sh) against the simulated CANN runtime
# (cann-sim), so the NPU backend runs on any machine.
#
# Builds libcann_sim.so, points every CANN library the loader opens at it, and
# runs ci/npu-4card.sh with 4 simulated devices, for two emulated CANN
# releases (CANNSIM_CANN_VERSION): the whole suite for 8.5 and, for 8.1, the
# tests of what differs between releases (see the end of this script).
# Arguments, when given, are passed to ci/npu-4card.sh and run once, for
# CANNSIM_CANN_VERSION (default 8.5); `ci/sim.sh --bench-short` runs only the
# benches' short form (below). Environment knobs (see cann-sim/README.md):
#   CANNSIM_LEAK_REPORT  fail (default here: a process that leaks anything exits
#                        with CANNSIM_LEAK_EXIT_CODE, 97, failing its test run) or 1
#                        (only print the leak report of every process)
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

# The operator libraries of the emulated release, as files named like CANN's,
# in one directory per release: up to 8.3 every op is in libopapi.so; from 8.5
# the MoE ops are in libopapi_transformer.so and aclnnAdd in libopapi_math.so
# (torch_npu's GetTransformerOpApiLibName), and this directory has no
# libopapi.so at all, so the loader must find each op in its split library.
# Each name is a symlink to the one simulator library (a copy would be a
# second, separate simulator instance).
op_dir() {
    local version="$1" dir
    dir="$(cd "$target_dir" && pwd)/cann-sim-ops/$version"
    rm -rf "$dir"
    mkdir -p "$dir"
    case "$version" in
        8.5) ln -s "$lib" "$dir/libopapi_transformer.so"; ln -s "$lib" "$dir/libopapi_math.so" ;;
        *) ln -s "$lib" "$dir/libopapi.so" ;;
    esac
    echo "$dir"
}

export ASCEND_MOE_ACL_LIB="$lib"
export ASCEND_MOE_HCCL_LIB="$lib"
export ASCEND_MOE_NNOPBASE_LIB="$lib"
export CANNSIM_DEVICES="${CANNSIM_DEVICES:-4}"
export CANNSIM_LEAK_REPORT="${CANNSIM_LEAK_REPORT:-fail}"
# Collectives fail fast instead of waiting minutes when a test breaks a rank:
# the crate's own waits, and HCCL's execution timeout (the simulator, like
# HCCL, reads only HCCL's variables and, on 8.5, the communicator's config).
export ASCEND_MOE_COMM_TIMEOUT="${ASCEND_MOE_COMM_TIMEOUT:-20}"
export HCCL_EXEC_TIMEOUT="${HCCL_EXEC_TIMEOUT:-20}"

if [[ ! -x ci/npu-4card.sh ]]; then
    echo "ci/sim.sh: ci/npu-4card.sh is not present" >&2
    exit 1
fi

# run VERSION ARGS...: ci/npu-4card.sh ARGS against the simulator emulating CANN VERSION.
run() {
    local version="$1"
    shift
    export CANNSIM_CANN_VERSION="$version"
    ASCEND_MOE_OPAPI_LIB="$(op_dir "$version")/libopapi.so"
    export ASCEND_MOE_OPAPI_LIB
    echo "ci/sim.sh: simulated CANN $version runtime at $lib ($CANNSIM_DEVICES devices)"
    ci/npu-4card.sh --sim "$@"
}

# The benches (tests/npu_bench.rs) in their short form, ASCEND_MOE_BENCH_SHORT=1:
# small sizes and two iterations. Timings under the simulator mean nothing,
# but every result a bench times is checked against its reference.
bench_short() {
    export CANNSIM_CANN_VERSION="${CANNSIM_CANN_VERSION:-8.5}"
    ASCEND_MOE_OPAPI_LIB="$(op_dir "$CANNSIM_CANN_VERSION")/libopapi.so"
    export ASCEND_MOE_OPAPI_LIB
    echo "ci/sim.sh: the benches' short form on simulated CANN $CANNSIM_CANN_VERSION"
    ASCEND_MOE_BENCH_SHORT=1 cargo test -q --test npu_bench -- --ignored --nocapture --test-threads=1
}

if [[ "${1:-}" == --bench-short ]]; then
    bench_short
    exit
fi
# The full-size benches are not run here (timings mean nothing), only their
# short form, after the suite.
if (($# > 0)); then
    run "${CANNSIM_CANN_VERSION:-8.5}" "$@"
    exit
fi
# The bounded hangs and teardown, on every release (only 8.5 takes the
# communicator's own execution timeout).
timeouts=(a_rank_that_never_joins_is_reported_by_the_check_never_a_hang
    teardown_after_a_rank_never_joined_ends_with_a_recorded_timeout)
# The current release runs the whole suite, and the Python step of
# ci/npu-4card.sh (python/tests/test_sim.py, once per CI run: the later runs
# name a FILTER, which skips it); the old one (CANN 8.1: HCCL config
# version 5, capability 4, no "not set" values, one libopapi.so) runs what
# differs between releases: communicator creation with its config, the
# sub-communicators and the collectives (the V ones with zero counts), and the
# loader.
run 8.5 --no-bench
bench_short
run 8.1 --no-bench -- reductions_in_every_dtype_and_op gathers_broadcast_barrier v_variants_with_uneven_and_zero_counts \
    dp2_tp2_and_ep4_sub_communicators root_info_travels_as_hex_between_ranks mismatched_sizes_fail_with_a_clear_error \
    loader_takes_each_op_from_the_library_that_ships_it "${timeouts[@]}"
# CANN 8.3 (config version 6): no hcclExecTimeOut either, so HCCL_EXEC_TIMEOUT
# bounds its collectives.
run 8.3 --no-bench -- "${timeouts[@]}"
