#!/usr/bin/env bash
# The NPU test matrix and benches, on a host with 4 Ascend NPUs.
#
# Runs every test marked #[ignore = "needs an Ascend NPU"] in the workspace
# (the backend ops, HCCL collectives and sub-communicators, and the MoE op
# matrix: world 4 as DP2 x TP2 and EP4, SP on and off, every comm type),
# serially (each multi-rank test uses all four devices), then the Python
# package on NPU memory, then the NPU benches. The Python step runs
# python/tests/test_npu.py on real torch_npu tensors and streams (finalize and
# unpermute against the CPU backend, the live forward context, and on 4 ranks,
# one process each over torch.distributed's HCCL group: the collectives, the
# EP pad / reduce and gather / unpad, token prepare / finalize, the
# shared-expert helpers, the reduction points, the torch custom ops); with
# --sim, python/tests/test_sim.py, the same scenarios on stand-in tensors over
# the simulated runtime. Its interpreter is $AMOE_TEST_PYTHON (default
# python3), which must import numpy, ml_dtypes, pytest and torch (a side-stream
# scenario makes torch streams), and on real hardware torch_npu too (a missing
# one, or fewer than 4 NPUs, fails the step); it loads the library the Rust
# tests built (debug profile).
#
# CANN is found the usual way (LD_LIBRARY_PATH from CANN's set_env.sh,
# ASCEND_HOME_PATH, ...). Setting ASCEND_MOE_ACL_LIB, ASCEND_MOE_HCCL_LIB,
# ASCEND_MOE_NNOPBASE_LIB and ASCEND_MOE_OPAPI_LIB (to one .so if it exports
# everything, like the simulated runtime) points the run elsewhere; a run
# against the simulator also needs --sim (ci/sim.sh passes it).
#
#   ci/npu-4card.sh               tests (Rust, then Python) + benches
#   ci/npu-4card.sh --no-bench    tests only
#   ci/npu-4card.sh -- FILTER     only Rust tests whose name contains FILTER
#                                 (no Python step, no benches)
#   ci/npu-4card.sh --sim ...     against the simulated runtime (ci/sim.sh)
#
# Without --sim the run is for real hardware: its first step fails when the
# runtime it loaded is the simulator (it exports cannsim_* entry points);
# with --sim it fails when the runtime is not the simulator. The tests read
# the mode from ASCEND_MOE_EXPECT_RUNTIME (real or sim), set here.
#
# ASCEND_MOE_COMM_TIMEOUT (seconds, default 120 here) bounds every wait of the
# crate's (a stream check, a drop). HCCL's own bounds are set here too, since
# only CANN 8.5 and later take a per-communicator execution timeout
# (hcclExecTimeOut, HcclCommConfig version 8 on): HCCL_EXEC_TIMEOUT (default 120 here; HCCL's is
# 1836 s on A2, integer seconds in HOST mode) bounds a collective on the
# device, HCCL_CONNECT_TIMEOUT (default 120 here, HCCL's minimum; HCCL waits
# 20 s more) the link setup of a first call (hicann/hccl
# docs/zh/user_guide/hccl_env/HCCL_EXEC_TIMEOUT.md, HCCL_CONNECT_TIMEOUT.md).
# ASCEND_MOE_NATIVE_KERNEL=required (the default here without --sim) makes a
# missing CANN toolkit (ASCEND_HOME_PATH, ASCEND_TOOLKIT_HOME or a default
# install root), an inherited ASCEND_MOE_NO_NPU_KERNEL=1, and a missing or
# failing AI Core build of kernels/ build errors, instead of a warning and a
# silent fall-back to aclnn. The simulator runs the host build of kernels/,
# so --sim needs no toolkit and does not set it.
set -euo pipefail
cd "$(dirname "$0")/.."

bench=1
sim=0
filter=()
while (($#)); do
    case "$1" in
        --no-bench) bench=0 ;;
        --sim) sim=1 ;;
        --) shift; filter=("$@"); break ;;
        *) echo "usage: ci/npu-4card.sh [--sim] [--no-bench] [-- FILTER]" >&2; exit 2 ;;
    esac
    shift
done
# The benches run in their own step; the sim_only_ tests need the simulator's
# own entry points (a kernel launcher, an AI Core fault) and are not run on
# real hardware.
skips=(--skip bench_)
if ((sim)); then
    export ASCEND_MOE_EXPECT_RUNTIME=sim
else
    export ASCEND_MOE_EXPECT_RUNTIME=real
    skips+=(--skip sim_only_)
    # acl-sys and hccl-sys are generated from this host's CANN headers: with
    # ASCEND_MOE_BINDINGS_DUMP set a failed generation is a build error, not a
    # warning and the committed bindings (acl-sys/cann-bindgen), and step 1
    # checks the bindings say "generated". The directory only receives a
    # copy of them; it is a fixed one because a new path each run would make
    # cargo rebuild the crate every run (the variable is rerun-if-env-changed).
    dump_dir="${CARGO_TARGET_DIR:-target}/npu-4card-bindings"
    mkdir -p "$dump_dir"
    ASCEND_MOE_BINDINGS_DUMP="$(cd "$dump_dir" && pwd)"
    export ASCEND_MOE_BINDINGS_DUMP
fi

export ASCEND_MOE_COMM_TIMEOUT="${ASCEND_MOE_COMM_TIMEOUT:-120}"
export HCCL_EXEC_TIMEOUT="${HCCL_EXEC_TIMEOUT:-120}"
export HCCL_CONNECT_TIMEOUT="${HCCL_CONNECT_TIMEOUT:-120}"
if ((!sim)); then
    export ASCEND_MOE_NATIVE_KERNEL="${ASCEND_MOE_NATIVE_KERNEL:-required}"
fi
export ASCEND_MOE_MIN_DEVICES="${ASCEND_MOE_MIN_DEVICES:-4}"
step() { printf '\n== %s ==\n' "$*"; }

# `cargo test ARGS`, failing when it ran no test at all: a test name that
# matches nothing (a typo, a renamed test) is not a green run.
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
tested() {
    local ran
    cargo test "$@" 2>&1 | tee "$log"
    ran="$(grep -Eo '[0-9]+ passed' "$log" | awk '{ s += $1 } END { print s + 0 }')"
    if ((ran == 0)); then
        echo "error: cargo test $* ran no test" >&2
        exit 1
    fi
}

step "CANN found by the loader ($ASCEND_MOE_EXPECT_RUNTIME runtime), and at least $ASCEND_MOE_MIN_DEVICES devices"
tested -q --test npu_loader -- --ignored --exact --nocapture npu_host_has_the_devices

# Every piece the matrix tests must be here: a missing aclnn operator or an
# unbuilt native kernel fails the run (it is never skipped or replaced).
step "every aclnn operator resolves and the native finalize kernel runs"
tested -q --test npu_loader -- --ignored --exact --nocapture npu_host_has_every_piece_the_suite_tests

step "NPU test matrix (every ignored NPU test, serially)"
# Each FILTER names at least one test of the matrix (a typo, or a renamed
# test, is not a green run); arguments starting with - are libtest flags.
names=()
flags=()
for f in ${filter[@]+"${filter[@]}"}; do
    case "$f" in
        -*) flags+=("$f") ;;
        *) names+=("$f") ;;
    esac
done
for f in ${names[@]+"${names[@]}"}; do
    # Listing builds every test binary: a build error is shown and fails the
    # run, not taken for a FILTER that matches nothing.
    if ! listed="$(cargo test -q --workspace -- --ignored --list "${skips[@]}" ${flags[@]+"${flags[@]}"} "$f" 2>"$log")"; then
        cat "$log" >&2
        echo "error: listing the NPU tests to check FILTER $f failed (cargo test --list, errors above)" >&2
        exit 1
    fi
    if ! grep -q ': test$' <<<"$listed"; then
        echo "error: FILTER $f matches no NPU test" >&2
        exit 1
    fi
done
tested --workspace -- --ignored --test-threads=1 "${skips[@]}" ${filter[@]+"${filter[@]}"}

# The Python package (what vLLM-Ascend links) on NPU memory: on real
# hardware python/tests/test_npu.py, on real torch_npu tensors and streams,
# one process per rank over 4 NPUs, failing when torch_npu, its custom ops or
# 4 devices are missing; under --sim python/tests/test_sim.py, the same
# scenarios on stand-in tensors over the runtime this run loaded (the only
# run of test_sim.py in ci/test.sh). Not with a FILTER, which names Rust tests.
if ((${#filter[@]} == 0)); then
    if ((sim)); then pytests=python/tests/test_sim.py; else pytests=python/tests/test_npu.py; fi
    py="${AMOE_TEST_PYTHON:-python3}"
    step "Python package on NPU memory ($pytests, $py)"
    if ! "$py" -c 'import numpy, ml_dtypes, pytest, torch' 2>"$log"; then
        cat "$log" >&2
        echo "error: $py cannot import numpy, ml_dtypes, pytest and torch (errors above); set AMOE_TEST_PYTHON" \
            "to an interpreter that can (on real hardware also torch_npu)" >&2
        exit 1
    fi
    # The library the tests above ran, as the Python package loads it (the
    # same profile and environment: cargo finds it fresh).
    cargo build -q --lib
    target_dir="$(cargo metadata --format-version 1 --no-deps | "$py" -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')"
    # pytest's own exit code fails the run (1: a failure, 4/5: nothing
    # collected); a skipped test fails it too: nothing here may skip.
    ASCEND_MOE_LIB="$target_dir/debug/libascend_moe.so" PYTHONPATH="python${PYTHONPATH:+:$PYTHONPATH}" \
        "$py" -m pytest -q -p no:cacheprovider -rs "$pytests" 2>&1 | tee "$log"
    if grep -Eq '[0-9]+ skipped' "$log"; then
        echo "error: $pytests skipped tests (reasons above); this run must run them all" >&2
        exit 1
    fi
fi

if ((bench)) && ((${#filter[@]} == 0)); then
    step "NPU benches"
    tested --release --test npu_bench -- --ignored --nocapture --test-threads=1
fi
