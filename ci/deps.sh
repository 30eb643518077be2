#!/usr/bin/env bash
# The system dependencies of the test suite: each one is probed by using it
# (compile and run a program, generate bindings, create a venv and run its
# pip), installed from Debian's packages only when the probe fails, and probed
# again after installing. A probe that still fails is an error naming what is
# missing. Nothing is decided by looking for file names.
#
#   source ci/deps.sh && deps_all     (what ci/test.sh does)
#   ci/deps.sh [cc] [libclang] [python]   (run directly; default: all three)
#
# After `deps_python`, AMOE_PYTHON is an interpreter whose `-m venv` works.
# AMOE_DEPS_NO_INSTALL=1 only probes (and fails on the first missing piece).

_deps_apt_updated=0

_deps_log() { printf 'deps: %s\n' "$*" >&2; }
_deps_die() { printf 'deps: error: %s\n' "$*" >&2; exit 1; }

# in_scratch FUNC: run FUNC with a fresh scratch directory as $1, then remove it.
in_scratch() {
    local d rc=0
    d="$(mktemp -d)"
    "$1" "$d" || rc=$?
    rm -rf "$d"
    return "$rc"
}

# apt_install PKG...: `apt-get update` once per run, then install.
apt_install() {
    if [[ "${AMOE_DEPS_NO_INSTALL:-0}" == 1 ]]; then
        _deps_die "would install $* (AMOE_DEPS_NO_INSTALL=1)"
    fi
    command -v apt-get >/dev/null || _deps_die "apt-get not found: install $* by hand"
    local sudo=()
    if [[ "$(id -u)" != 0 ]]; then
        command -v sudo >/dev/null || _deps_die "not root and no sudo: install $* by hand"
        sudo=(sudo)
    fi
    export DEBIAN_FRONTEND=noninteractive
    # A machine that is still being provisioned may hold apt's locks for a
    # while: dpkg's lock is waited for by apt itself, the lists lock (which
    # `apt-get update` takes without waiting) by trying again.
    local lock=(-o DPkg::Lock::Timeout=600) err tries=0
    err="$(mktemp)"
    if ((!_deps_apt_updated)); then
        _deps_log "apt-get update"
        until "${sudo[@]}" apt-get "${lock[@]}" update -qq >/dev/null 2>"$err"; do
            if ((++tries >= 60)) || ! grep -qi 'lock' "$err"; then
                cat "$err" >&2
                rm -f "$err"
                _deps_die "apt-get update failed"
            fi
            _deps_log "apt's lists are locked by another process; trying again in 10 s"
            sleep 10
        done
        _deps_apt_updated=1
    fi
    _deps_log "apt-get install $*"
    if ! "${sudo[@]}" apt-get "${lock[@]}" install -y -qq --no-install-recommends "$@" >/dev/null 2>"$err"; then
        cat "$err" >&2
        rm -f "$err"
        _deps_die "apt-get install $* failed"
    fi
    rm -f "$err"
}

# ensure NAME PROBE PKG...: run PROBE; on failure install PKGs and run it again.
ensure() {
    local name="$1" probe="$2"
    shift 2
    local out
    if out="$("$probe" 2>&1)"; then
        _deps_log "$name: ok${out:+ ($out)}"
        return 0
    fi
    _deps_log "$name: missing (${out##*$'\n'}); installing $*"
    apt_install "$@"
    out="$("$probe" 2>&1)" || _deps_die "$name still unusable after installing $*: $out"
    _deps_log "$name: ok after install${out:+ ($out)}"
}

# A C and a C++ compiler that build and link a program that runs (build.rs
# compiles kernels/ with c++, tests/capi_c.rs builds the C smoke program).
_probe_cc_in() {
    local d="$1"
    printf '#include <stdio.h>\n#include <stddef.h>\nint main(void){size_t n=sizeof(int);printf("%%zu",n);return 0;}\n' >"$d/p.c"
    printf '#include <vector>\n#include <cstdio>\nint main(){std::vector<int> v(3);std::printf("%%zu",v.size());return 0;}\n' >"$d/p.cpp"
    "${CC:-cc}" -o "$d/pc" "$d/p.c" || return 1
    "${CXX:-c++}" -o "$d/pcpp" "$d/p.cpp" || return 1
    [[ "$("$d/pc")" == 4 && "$("$d/pcpp")" == 3 ]] || { echo "compiled programs printed the wrong thing"; return 1; }
    echo "${CC:-cc} and ${CXX:-c++}"
}
probe_cc() { in_scratch _probe_cc_in; }

# The sanitizer runtimes of the C compiler (tests/capi_c.rs runs the C smoke
# program under AddressSanitizer, UndefinedBehaviorSanitizer and leak
# detection): a program built with them runs, and a leak is reported.
_probe_sanitizers_in() {
    local d="$1"
    printf '#include <stdlib.h>\nvoid *p;\nint main(void){p=malloc(7);p=0;return 0;}\n' >"$d/l.c"
    "${CC:-cc}" -g -fsanitize=address,undefined -o "$d/l" "$d/l.c" || return 1
    if ASAN_OPTIONS=detect_leaks=1 "$d/l" 2>"$d/err"; then
        echo "a leaking program built with -fsanitize=address ran without a leak report"
        return 1
    fi
    grep -q LeakSanitizer "$d/err" || { cat "$d/err"; return 1; }
    echo "${CC:-cc} -fsanitize=address,undefined with leak detection"
}
probe_sanitizers() { in_scratch _probe_sanitizers_in; }

# bindgen, exactly as the acl-sys / hccl-sys build scripts run it: libclang
# loads and parses a header including <stddef.h> (which needs clang's resource
# headers, not only a libclang*.so).
probe_libclang() {
    local root
    root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
    cargo run -q --manifest-path "$root/Cargo.toml" -p cann-bindgen --bin cann-bindgen-probe
}

# A Python whose venv module creates an environment with a working pip.
_probe_venv_in() {
    local py="$_deps_py" d="$1/venv"
    command -v "$py" >/dev/null || { echo "$py not found"; return 1; }
    "$py" -m venv "$d" || return 1
    "$d/bin/python" -m pip --version >/dev/null || { echo "pip does not run in a venv of $py"; return 1; }
    echo "$("$py" -c 'import sys; print(sys.executable, sys.version.split()[0])')"
}
probe_python() {
    local py out
    for py in ${AMOE_PYTHON:-} python3 /usr/bin/python3; do
        _deps_py="$py"
        if out="$(in_scratch _probe_venv_in 2>&1)"; then
            AMOE_PYTHON="$py"
            echo "$out"
            return 0
        fi
    done
    echo "no python3 with a working venv + pip"
    return 1
}

deps_cc() {
    ensure "C/C++ compiler" probe_cc gcc g++ libc6-dev
    ensure "C sanitizer runtimes" probe_sanitizers libasan8 libubsan1
}
deps_libclang() { ensure "libclang for bindgen" probe_libclang libclang-dev; }
deps_python() {
    ensure "python venv" probe_python python3 python3-venv python3-pip
    # ensure's probe ran in a subshell: pick the interpreter again here.
    probe_python >/dev/null || _deps_die "python venv probe failed"
    export AMOE_PYTHON
}
deps_all() { deps_cc; deps_libclang; deps_python; }

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
    set -euo pipefail
    (($#)) || set -- cc libclang python
    for what in "$@"; do
        case "$what" in
            cc) deps_cc ;;
            libclang) deps_libclang ;;
            python) deps_python ;;
            *) _deps_die "unknown dependency '$what' (cc, libclang, python)" ;;
        esac
    done
fi
