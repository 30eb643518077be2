#!/usr/bin/env bash
# Runs `.ci/run` the way CI does, on a fresh clone of the current commit, with
# as much hand-installed state hidden as a root user can hide, so that a
# missing install step fails here and not on the next fresh machine.
#
#   ci/fresh-check.sh                       clone HEAD and run .ci/run
#   ci/fresh-check.sh --image-list FILE     also list the Debian packages this
#                                           machine has beyond FILE (lines
#                                           "apt<TAB>name<TAB>version", or one
#                                           package name a line)
#   ci/fresh-check.sh --image-list FILE --purge-extra
#                                           first purge those extra packages
#                                           (root; reproduces the image's
#                                           package set, so ci/deps.sh has to
#                                           install what the run needs)
#   ci/fresh-check.sh --keep                keep the scratch directory
#
# Hidden: the work tree's uncommitted changes (a clone of HEAD), build output
# (a new CARGO_TARGET_DIR), LIBCLANG_PATH / BINDGEN_EXTRA_CLANG_ARGS / CLANG_PATH,
# every ASCEND_* / CANNSIM_* / PYTHON* / VIRTUAL_ENV / PIP_* variable, ~/.local
# and the rest of $HOME (HOME is a new empty directory; cargo and rustup are
# reached through CARGO_HOME and RUSTUP_HOME), the Python user site, and any
# venv an earlier run made (the venv lives in the new target dir).
# Not hidden, and said so at the end: system packages (apt/dpkg), the Rust
# toolchain and its components, cargo's registry cache, pip's system site.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"

image_list=""
keep=0
purge=0
while (($#)); do
    case "$1" in
        --image-list) image_list="$2"; shift ;;
        --keep) keep=1 ;;
        --purge-extra) purge=1 ;;
        *) echo "usage: ci/fresh-check.sh [--image-list FILE [--purge-extra]] [--keep]" >&2; exit 2 ;;
    esac
    shift
done

# Debian packages on this machine beyond the image list.
extra_packages() {
    comm -13 <(awk -F'\t' 'NF==1{print $1} $1=="apt"{sub(/:.*/,"",$2); print $2}' "$image_list" | sort -u) \
        <(dpkg-query -W -f='${Package}\n' | sort -u)
}
if ((purge)); then
    [[ -n "$image_list" ]] || { echo "fresh-check: --purge-extra needs --image-list" >&2; exit 2; }
    mapfile -t extra < <(extra_packages)
    if ((${#extra[@]})); then
        echo "fresh-check: purging ${#extra[@]} package(s) not on the image: ${extra[*]}"
        DEBIAN_FRONTEND=noninteractive apt-get purge -y -qq "${extra[@]}" >/dev/null
        DEBIAN_FRONTEND=noninteractive apt-get autoremove -y -qq --purge >/dev/null
    fi
fi

scratch="$(mktemp -d /tmp/amoe-fresh.XXXXXX)"
((keep)) || trap 'rm -rf "$scratch"' EXIT
commit="$(git -C "$repo" rev-parse HEAD)"
dirty="$(git -C "$repo" status --porcelain | wc -l)"

# CI's layout: the clone, and a read-only copy of shared/ beside it.
git clone -q --no-local "$repo" "$scratch/work/main"
git -C "$scratch/work/main" checkout -q "$commit"
if [[ -d "$repo/../shared" ]]; then
    cp -r "$repo/../shared" "$scratch/work/shared"
    chmod -R a-w "$scratch/work/shared"
fi
mkdir -p "$scratch/home" "$scratch/target"

cargo_home="${CARGO_HOME:-$HOME/.cargo}"
rustup_home="${RUSTUP_HOME:-$HOME/.rustup}"
# PATH without ~/.local (pip --user installs) and with cargo's bin first; the
# rest stays, the machine image's CPython under ~/.pyenv included (a fresh
# CI machine's image ships its CPython 3.11 with pip there).
clean_path="$cargo_home/bin"
IFS=: read -ra parts <<<"$PATH"
for p in "${parts[@]}"; do
    case "$p" in
        "$HOME"/.local* | "$HOME"/.cargo/bin | "$cargo_home/bin" | "") ;;
        *) clean_path="$clean_path:$p" ;;
    esac
done

env_args=(-u LIBCLANG_PATH -u BINDGEN_EXTRA_CLANG_ARGS -u CLANG_PATH -u LLVM_CONFIG_PATH
    -u CARGO_TARGET_DIR -u VIRTUAL_ENV -u PYTHONPATH -u PYTHONHOME -u PYTHONUSERBASE)
while IFS='=' read -r name _; do
    case "$name" in
        ASCEND_* | CANNSIM_* | PIP_* | AMOE_* | CARGO_BUILD_* | RUSTFLAGS | RUSTC_WRAPPER)
            env_args+=(-u "$name") ;;
    esac
done < <(env)

echo "fresh-check: commit $commit in $scratch/work/main"
((dirty == 0)) || echo "fresh-check: note: $dirty uncommitted change(s) in $repo are not in the clone"
start=$(date +%s)
set +e
(cd "$scratch/work/main" && env "${env_args[@]}" \
    HOME="$scratch/home" CARGO_HOME="$cargo_home" RUSTUP_HOME="$rustup_home" \
    CARGO_TARGET_DIR="$scratch/target" PYTHONNOUSERSITE=1 PIP_NO_CACHE_DIR=1 \
    PATH="$clean_path" CI=true bash .ci/run </dev/null) 2>&1 | tee "$scratch/ci.log"
rc=${PIPESTATUS[0]}
set -e
secs=$(($(date +%s) - start))

echo
echo "fresh-check: .ci/run exited $rc after ${secs}s on a fresh clone of $commit"
echo "fresh-check: hidden: uncommitted changes, CARGO_TARGET_DIR (new), LIBCLANG_PATH,"
echo "  BINDGEN_EXTRA_CLANG_ARGS, ASCEND_*/CANNSIM_*/PIP_*/PYTHON* variables, HOME (new, so"
echo "  ~/.local, ~/.cache and the Python user site are gone), PATH entries under ~/.local, old venvs"
echo "fresh-check: NOT hidden: Debian packages installed on this machine, the Rust toolchain and"
echo "  its components, cargo's registry cache ($cargo_home/registry), Python's system site-packages"
if [[ -n "$image_list" ]]; then
    extra="$(extra_packages)"
    if [[ -n "$extra" ]]; then
        echo "fresh-check: Debian packages here beyond $image_list ($(wc -l <<<"$extra")); ci/deps.sh must install any the run used:"
        tr '\n' ' ' <<<"$extra" | fold -s -w 100 | sed 's/^/  /'
        echo
    else
        echo "fresh-check: no Debian packages here beyond $image_list"
    fi
fi
tail -n 1 "$scratch/ci.log" | sed 's/^/fresh-check: last line of .ci\/run: /'
exit "$rc"
