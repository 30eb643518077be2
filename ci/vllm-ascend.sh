#!/usr/bin/env bash
# Opt-in (not run by CI): the vLLM-Ascend adapter tests against the real `vllm`
# package instead of the vllm stand-ins. vLLM-Ascend 182b75e targets vLLM
# v0.27.1; this installs that release with all its dependencies (a CUDA build
# of torch among them: about 8 GB, several minutes) into its own virtualenv,
# or, when it does not install here, the nearest release that does, builds
# the library and runs python/tests/test_vllm_ascend.py with
# ASCEND_MOE_REAL_VLLM=1. What stays stood in with the real vllm: torch_npu,
# triton.runtime's NPU driver (as vLLM-Ascend's tests/ut/conftest.py stubs
# them) and the vLLM-Ascend modules outside the pinned subset; the script
# prints them.
#
# Exits non-zero when no release installs, when the real vllm is not the one
# imported, or when any test fails or is skipped.
#   VLLM_VENV     the virtualenv (default target/vllm-venv)
#   VLLM_VERSIONS the releases to try in order (default "0.27.1 0.27.0 0.28.0")
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."

venv="${VLLM_VENV:-target/vllm-venv}"
versions="${VLLM_VERSIONS:-0.27.1 0.27.0 0.28.0}"
[[ -x "$venv/bin/python" ]] || python3 -m venv "$venv"
"$venv/bin/pip" install -q numpy ml_dtypes pytest
installed=""
for v in $versions; do
    if "$venv/bin/pip" install -q "vllm==$v"; then
        installed="$v"
        break
    fi
    echo "ci/vllm-ascend.sh: vllm==$v does not install here, trying the next" >&2
done
if [[ -z "$installed" ]]; then
    echo "ci/vllm-ascend.sh: none of vllm $versions installs" >&2
    exit 1
fi
"$venv/bin/python" - "$installed" <<'EOF'
import sys

import torch
import vllm

assert vllm.__version__ == sys.argv[1], (vllm.__version__, sys.argv[1])
print(f"ci/vllm-ascend.sh: vllm {vllm.__version__} from {vllm.__file__}, torch {torch.__version__}")
EOF
cargo build -p ascend-moe
# The library just built, wherever CARGO_TARGET_DIR puts it (relative: from
# the repository, where cargo ran).
target="${CARGO_TARGET_DIR:-target}"
[[ $target == /* ]] || target="$PWD/$target"
export ASCEND_MOE_REAL_VLLM=1 ASCEND_MOE_LIB="$target/debug/libascend_moe.so" PYTHONPATH=python:python/tests

# What the pinned files still get from stand-ins, with the real vllm.
"$venv/bin/python" - <<'EOF'
import vllm_standins as vs

vs.setup()
for name in ("register_custom_ops", "fused_moe", "shared_experts", "prepare_finalize", "ascend_forward_context"):
    vs.load(name)
standins = vs.standin_modules()
assert not [m for m in standins if m == "vllm" or m.startswith("vllm.")], standins
print("ci/vllm-ascend.sh: stand-ins with the real vllm:", ", ".join(standins))
EOF

junit="$(mktemp --suffix=.xml)"
trap 'rm -f "$junit"' EXIT
rc=0
"$venv/bin/python" -m pytest -q -rs --junitxml="$junit" python/tests/test_vllm_ascend.py "$@" || rc=$?
[[ -s "$junit" ]] || { echo "ci/vllm-ascend.sh: pytest wrote no report (exit $rc)" >&2; exit 1; }
"$venv/bin/python" - "$junit" "$rc" <<'EOF'
import sys
import xml.etree.ElementTree as ET

root = ET.parse(sys.argv[1]).getroot()
suite = root if root.tag == "testsuite" else root.find("testsuite")
tests, skipped = int(suite.get("tests")), int(suite.get("skipped"))
bad = int(suite.get("failures")) + int(suite.get("errors"))
print(f"ci/vllm-ascend.sh: {tests - skipped - bad} passed, {bad} failed, {skipped} skipped")
sys.exit(0 if tests and not skipped and not bad and sys.argv[2] == "0" else 1)
EOF
