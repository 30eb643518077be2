#!/usr/bin/env bash
# Opt-in (not run by CI): the vLLM-Ascend adapter tests against the real `vllm`
# package instead of the vllm stand-ins. vLLM-Ascend 182b75e targets vLLM
# v0.27.1; this installs that release (or, when it does not install here, the
# nearest one that does) into its own virtualenv, builds the library and runs
# python/tests/test_vllm_ascend.py with ASCEND_MOE_REAL_VLLM=1.
#   VLLM_VENV     the virtualenv (default target/vllm-venv)
#   VLLM_VERSIONS the releases to try in order (default "0.27.1 0.27.0 0.28.0")
set -euo pipefail
cd "$(dirname "$0")/.."

venv="${VLLM_VENV:-target/vllm-venv}"
versions="${VLLM_VERSIONS:-0.27.1 0.27.0 0.28.0}"
python3 -m venv "$venv"
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
echo "ci/vllm-ascend.sh: vllm $installed"
cargo build -p ascend-moe
ASCEND_MOE_REAL_VLLM=1 ASCEND_MOE_LIB="$PWD/target/debug/libascend_moe.so" PYTHONPATH=python \
    "$venv/bin/python" -m pytest -q python/tests/test_vllm_ascend.py "$@"
