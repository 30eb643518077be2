#!/usr/bin/env bash
# Checks the committed acl-sys / hccl-sys bindings against real CANN headers.
#
# The torch-npu wheel on PyPI ships CANN's ACL and HCCL headers. This script
# downloads it (headers only are unpacked, to a temp dir that is removed),
# makes sure bindgen can run (ci/deps.sh), regenerates the bindings through the
# crates' own build scripts (the same bindgen configuration every build
# uses), fails if they differ from the committed ones, and checks that the
# whole workspace compiles against the regenerated bindings.
#
#   ci/headers.sh            check (CI)
#   ci/headers.sh --update   overwrite the committed bindings with the regenerated ones
#
# TORCH_NPU_VERSION selects the wheel (default: the version the committed
# bindings come from).
set -euo pipefail
cd "$(dirname "$0")/.."

version="${TORCH_NPU_VERSION:-2.14.0}"
update=0
[[ "${1:-}" == "--update" ]] && update=1

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

# bindgen must really parse a header (libclang plus clang's resource
# headers): ci/deps.sh probes that and installs libclang-dev if it cannot.
# shellcheck source=ci/deps.sh
source ci/deps.sh
deps_libclang
deps_python

echo "headers.sh: downloading torch-npu $version (cp311, manylinux x86_64)"
"$AMOE_PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 --implementation cp \
    --platform manylinux_2_28_x86_64 "torch-npu==$version" -d "$tmp/wheel"
wheel="$(ls "$tmp"/wheel/torch_npu-*.whl)"
"$AMOE_PYTHON" - "$wheel" "$tmp/unpacked" <<'PY'
import sys, zipfile
wheel, dest = sys.argv[1], sys.argv[2]
prefixes = ("torch_npu/include/third_party/acl/inc/", "torch_npu/include/third_party/hccl/inc/")
with zipfile.ZipFile(wheel) as z:
    names = [n for n in z.namelist() if n.startswith(prefixes) and n.endswith(".h")]
    for n in names:
        z.extract(n, dest)
print(f"headers.sh: unpacked {len(names)} headers")
PY
include="$tmp/unpacked/torch_npu/include"

echo "headers.sh: regenerating the bindings"
ASCEND_MOE_CANN_INCLUDE="$include" ASCEND_MOE_BINDINGS_DUMP="$tmp/out" \
    cargo build -q -p acl-sys -p hccl-sys

status=0
for pair in "acl:acl-sys" "hccl:hccl-sys"; do
    name="${pair%%:*}"
    committed="${pair#*:}/src/bindings.rs"
    if ! diff -u "$committed" "$tmp/out/$name.rs" >"$tmp/$name.diff"; then
        if (( update )); then
            cp "$tmp/out/$name.rs" "$committed"
            echo "headers.sh: updated $committed"
        else
            echo "headers.sh: $committed differs from the bindings generated from torch-npu $version:" >&2
            head -n 60 "$tmp/$name.diff" >&2
            status=1
        fi
    else
        echo "headers.sh: $committed matches"
    fi
done
if (( status )); then
    echo "headers.sh: run 'ci/headers.sh --update' and commit the result" >&2
    exit 1
fi

echo "headers.sh: checking the workspace against the regenerated bindings"
ASCEND_MOE_CANN_INCLUDE="$include" cargo check -q --workspace --all-targets
echo "headers.sh: ok"
