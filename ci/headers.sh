#!/usr/bin/env bash
# Checks the acl-sys / hccl-sys bindings against real CANN headers of every
# generation the crate supports.
#
# The torch-npu wheels on PyPI ship CANN's ACL and HCCL headers. For each
# wheel version this script downloads it (headers only are unpacked, to a temp
# dir that is removed), regenerates the bindings through the crates' own
# build scripts (the same bindgen configuration every build uses), and checks
# that the whole workspace compiles against them. The committed bindings are
# those of $COMMITTED (torch-npu 2.14.0, HCCL config version 10); for that
# version the regenerated bindings must also equal the committed ones.
#
# Versions checked (TORCH_NPU_VERSIONS, space-separated, to override):
#   2.14.0  HCCL_COMM_CONFIG_VERSION 10 (the committed bindings)
#   2.9.0   HCCL_COMM_CONFIG_VERSION 6 (no HCCL_COMM_CONFIG_EXEC_TIMEOUT, no
#           hcclExecTimeOut field)
# Each header's HCCL_COMM_CONFIG_VERSION must be one hccl-sys has an
# HcclCommConfigInit for (CommConfigLayout: 5, 6, 8, 10).
#
#   ci/headers.sh            check (CI)
#   ci/headers.sh --update   overwrite the committed bindings with those of $COMMITTED
set -euo pipefail
cd "$(dirname "$0")/.."

COMMITTED=2.14.0
read -r -a versions <<<"${TORCH_NPU_VERSIONS:-2.14.0 2.9.0}"
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

# fetch VERSION DEST: the wheel's ACL and HCCL headers under DEST/torch_npu/include.
fetch() {
    local version="$1" dest="$2"
    echo "headers.sh: downloading torch-npu $version (cp311, manylinux x86_64)"
    "$AMOE_PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 --implementation cp \
        --platform manylinux_2_28_x86_64 "torch-npu==$version" -d "$dest/wheel"
    "$AMOE_PYTHON" - "$(ls "$dest"/wheel/torch_npu-*.whl)" "$dest/unpacked" <<'PY'
import sys, zipfile
wheel, dest = sys.argv[1], sys.argv[2]
prefixes = ("torch_npu/include/third_party/acl/inc/", "torch_npu/include/third_party/hccl/inc/")
with zipfile.ZipFile(wheel) as z:
    names = [n for n in z.namelist() if n.startswith(prefixes) and n.endswith(".h")]
    for n in names:
        z.extract(n, dest)
print(f"headers.sh: unpacked {len(names)} headers")
PY
    rm -rf "$dest/wheel"
}

status=0
for version in "${versions[@]}"; do
    dir="$tmp/$version"
    fetch "$version" "$dir"
    include="$dir/unpacked/torch_npu/include"

    echo "headers.sh: [$version] regenerating the bindings"
    ASCEND_MOE_CANN_INCLUDE="$include" ASCEND_MOE_BINDINGS_DUMP="$dir/out" \
        cargo build -q -p acl-sys -p hccl-sys

    config_version="$(sed -n 's/.*pub const HCCL_COMM_CONFIG_VERSION: u32 = \([0-9]*\);.*/\1/p' "$dir/out/hccl.rs")"
    case "$config_version" in
        5 | 6 | 8 | 10) echo "headers.sh: [$version] HCCL_COMM_CONFIG_VERSION $config_version" ;;
        *)
            echo "headers.sh: [$version] HCCL_COMM_CONFIG_VERSION '${config_version}' has no CommConfigLayout" \
                "in hccl-sys (add its HcclCommConfigInit)" >&2
            status=1
            ;;
    esac

    if [[ "$version" == "$COMMITTED" ]]; then
        for pair in "acl:acl-sys" "hccl:hccl-sys"; do
            name="${pair%%:*}"
            committed="${pair#*:}/src/bindings.rs"
            if ! diff -u "$committed" "$dir/out/$name.rs" >"$dir/$name.diff"; then
                if ((update)); then
                    cp "$dir/out/$name.rs" "$committed"
                    echo "headers.sh: updated $committed"
                else
                    echo "headers.sh: $committed differs from the bindings generated from torch-npu $version:" >&2
                    head -n 60 "$dir/$name.diff" >&2
                    echo "headers.sh: run 'ci/headers.sh --update' and commit the result" >&2
                    status=1
                fi
            else
                echo "headers.sh: $committed matches"
            fi
        done
    fi

    echo "headers.sh: [$version] checking the workspace against the regenerated bindings"
    if ! ASCEND_MOE_CANN_INCLUDE="$include" ASCEND_MOE_BINDINGS_DUMP="$dir/out" cargo check -q --workspace --all-targets; then
        echo "headers.sh: the workspace does not compile against torch-npu $version's headers" >&2
        status=1
    fi
done
exit "$status"
