#!/usr/bin/env bash
# One command, one performance report: ascend-moe against OpenMPI and gloo (collectives), numpy (finalize)
# and the machine's memory bandwidth (a STREAM-like triad), all measured in the same run.
# Writes bench-report/report.md, bench-report/results.csv and PNG plots. Not part of CI.
#
#   ci/bench.sh                 full run (3 runs of everything; long on a small machine)
#   ci/bench.sh --quick         smoke test: small sizes, one run, a few minutes
#   ci/bench.sh --help          all options
#
# It installs what it needs: Debian's openmpi-bin + libopenmpi-dev (apt-get), and numpy,
# ml_dtypes, matplotlib, mpi4py in a venv ($BENCH_VENV, default ~/.cache/ascend-moe-bench/venv),
# plus torch (for the gloo peer) unless a venv with it is found (see --help).
# Method and the JSON/CSV schema: ci/bench/README.md.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
# The directory cargo builds into: cargo runs in the repository, so a
# relative CARGO_TARGET_DIR is taken from there, not from the caller's directory.
TARGET="${CARGO_TARGET_DIR:-target}"
[[ $TARGET == /* ]] || TARGET="$ROOT/$TARGET"
COMMAND="ci/bench.sh $*"
HERE="$ROOT/ci/bench"

OUT="$ROOT/bench-report"
QUICK=0
RUNS=""
SKIP=""
INSTALL=1
SELF_TEST=0
KEEP_RAW=0
EXTRA=()

usage() {
    cat <<'EOF'
usage: ci/bench.sh [options] [-- extra options for ci/bench/run.py]
  --quick           small sizes (1 KiB .. 1 MiB), 2 and 4 ranks, the smallest finalize shape, 1 run
  --runs N          runs of every measurement (default 3; medians with min and max)
  --out DIR         output directory (default bench-report/; its raw/ is replaced)
  --skip LIST       leave out parts: triad,collectives,mpi,gloo,finalize,numpy,far,decode,api
  --peers-only      only the peers and the C triad (no cargo build): OpenMPI, gloo, numpy
  --no-install      do not apt-get / pip install anything (use what is there)
  --keep-raw        add to the raw results already in DIR/raw (e.g. measure the parts
                    one at a time with --skip) instead of starting afresh
  --self-test       run the report generator's test on synthetic input and exit
Extra run.py options (after --), e.g. -- --worlds 4 --max-bytes 64M --dtypes bf16
  (see: python3 ci/bench/run.py --help)
Environment: CARGO_TARGET_DIR (where the binary is built), ASCEND_MOE_BIN (use this binary
instead of building one), BENCH_VENV (the Python venv), BENCH_TORCH_PYTHON (a python with
torch for the gloo peer; default: the bench venv's, else ci/test.sh's venv, else torch is
installed into the bench venv).
EOF
}

while [[ $# -gt 0 ]]; do
    case "$1" in
        --quick) QUICK=1 ;;
        --runs) RUNS="${2:?--runs needs a number}"; shift ;;
        --out) OUT="${2:?--out needs a directory}"; shift ;;
        --skip) SKIP="${2:?--skip needs a list}"; shift ;;
        --peers-only) SKIP="${SKIP:+$SKIP,}collectives,finalize,far"; PEERS_ONLY=1 ;;
        --no-install) INSTALL=0 ;;
        --keep-raw) KEEP_RAW=1 ;;
        --self-test) SELF_TEST=1 ;;
        -h|--help) usage; exit 0 ;;
        --) shift; EXTRA=("$@"); break ;;
        *) echo "ci/bench.sh: unknown option '$1' (see --help)" >&2; exit 2 ;;
    esac
    shift
done
PEERS_ONLY="${PEERS_ONLY:-0}"
if [[ -n "$RUNS" && ! "$RUNS" =~ ^[1-9][0-9]*$ ]]; then
    echo "ci/bench.sh: --runs $RUNS: must be a whole number, at least 1 (the report takes medians over runs)" >&2
    exit 2
fi

say() { printf '\n== %s ==\n' "$*" >&2; }
die() { printf 'ci/bench.sh: error: %s\n' "$*" >&2; exit 1; }
skipping() { [[ ",$SKIP," == *",$1,"* ]]; }

# ---------------------------------------------------------------- Python venv with the peers' deps
VENV="${BENCH_VENV:-$HOME/.cache/ascend-moe-bench/venv}"
PY="$VENV/bin/python"
py_deps_ok() { [[ -x "$PY" ]] && "$PY" -c 'import numpy, ml_dtypes, matplotlib, mpi4py' 2>/dev/null; }

if [[ $SELF_TEST == 1 ]]; then
    # The test needs only the standard library (matplotlib is used when present).
    TPY=python3
    py_deps_ok && TPY="$PY"
    cd "$HERE" && exec "$TPY" -m unittest -v test_report
fi

say "prerequisites"
if ! skipping mpi && ! command -v mpirun >/dev/null; then
    [[ $INSTALL == 1 ]] || die "mpirun not found and --no-install given (install openmpi-bin, or --skip mpi)"
    echo "installing Debian's openmpi-bin libopenmpi-dev (apt-get)..." >&2
    export DEBIAN_FRONTEND=noninteractive
    # Another apt-get may hold the lock for a while: wait for it rather than fail.
    APT=(apt-get -o DPkg::Lock::Timeout=600 -qq)
    if [[ $(id -u) != 0 ]]; then command -v sudo >/dev/null && APT=(sudo "${APT[@]}"); fi
    { "${APT[@]}" update && "${APT[@]}" install -y openmpi-bin libopenmpi-dev; } >&2 \
        || die "could not install openmpi-bin libopenmpi-dev with apt-get (run as root, or --skip mpi)"
    command -v mpirun >/dev/null || die "openmpi-bin installed but mpirun is not on PATH"
fi
if ! py_deps_ok; then
    [[ $INSTALL == 1 ]] || die "venv $VENV lacks numpy/ml_dtypes/matplotlib/mpi4py and --no-install given"
    echo "creating the venv $VENV (numpy ml_dtypes matplotlib mpi4py)..." >&2
    [[ -x "$PY" ]] || python3 -m venv "$VENV" || die "python3 -m venv $VENV failed (Debian: apt-get install python3-venv)"
    "$PY" -m pip install -q --upgrade pip >&2 || true
    "$PY" -m pip install -q numpy ml_dtypes matplotlib mpi4py >&2 \
        || die "pip install numpy ml_dtypes matplotlib mpi4py failed in $VENV (mpi4py needs libopenmpi-dev if no wheel fits)"
    py_deps_ok || die "the venv $VENV still cannot import numpy, ml_dtypes, matplotlib and mpi4py"
fi
echo "python: $("$PY" -c 'import sys, numpy, ml_dtypes, matplotlib, mpi4py; print(sys.version.split()[0], "numpy", numpy.__version__, "ml_dtypes", ml_dtypes.__version__, "matplotlib", matplotlib.__version__, "mpi4py", mpi4py.__version__)')" >&2

# The gloo peer needs torch: the first python that has it with gloo, of $BENCH_TORCH_PYTHON,
# the bench venv and the venv ci/test.sh builds; else torch is installed into the bench venv
# the way ci/test.sh installs it (PyPI, ~5 GB with its CUDA wheels; only its CPU side is used).
TORCH_PY=""
torch_ok() { [[ -n $1 && -x $1 ]] && "$1" -c 'import torch.distributed as d; assert d.is_gloo_available()' 2>/dev/null; }
if ! skipping gloo; then
    for cand in "${BENCH_TORCH_PYTHON:-}" "$PY" "$TARGET/ci-venv/bin/python"; do
        if torch_ok "$cand"; then TORCH_PY="$cand"; break; fi
    done
    if [[ -z $TORCH_PY && $INSTALL == 1 ]]; then
        echo "installing torch into $VENV for the gloo peer (as ci/test.sh does)..." >&2
        "$PY" -m pip install --quiet --disable-pip-version-check --no-cache-dir torch >&2 \
            && torch_ok "$PY" && TORCH_PY="$PY"
    fi
    if [[ -n $TORCH_PY ]]; then
        echo "gloo peer: $TORCH_PY (torch $("$TORCH_PY" -c 'import torch; print(torch.__version__)'))" >&2
    else
        die "no python with torch + gloo for the gloo peer (set BENCH_TORCH_PYTHON, drop --no-install, or --skip gloo)"
    fi
fi
TORCH_VER="not measured"
[[ -n $TORCH_PY ]] && TORCH_VER="torch $("$TORCH_PY" -c 'import torch; print(torch.__version__)')"

mkdir -p "$OUT"
[[ $KEEP_RAW == 1 ]] || rm -rf "$OUT/raw"
rm -f "$OUT"/*.png
mkdir -p "$OUT/raw" "$OUT/.build"

BIN=""
if [[ -n ${ASCEND_MOE_BIN:-} ]]; then
    BIN="$ASCEND_MOE_BIN"
    [[ -x "$BIN" ]] || die "ASCEND_MOE_BIN=$BIN is not an executable"
    echo "using the prebuilt $BIN (ASCEND_MOE_BIN)" >&2
elif [[ $PEERS_ONLY == 0 ]] && ! { skipping collectives && skipping finalize && skipping far && skipping triad; }; then
    say "cargo build --release --bin ascend-moe"
    (cd "$ROOT" && cargo build --release --bin ascend-moe --lib >&2) \
        || die "cargo build failed (see above); --peers-only measures the peers without our binary"
    BIN="$TARGET/release/ascend-moe"
    [[ -x "$BIN" ]] || die "built, but $BIN does not exist (is CARGO_TARGET_DIR the one cargo used?)"
    "$BIN" bench --help >/dev/null 2>&1 || echo "note: '$BIN bench' is not available: our benches are skipped" >&2
fi
# The public API table needs the library beside the binary: checked before anything is measured.
if [[ -n $BIN ]] && ! skipping api && [[ ! -f "$(dirname "$BIN")/libascend_moe.so" ]]; then
    die "$(dirname "$BIN")/libascend_moe.so not found beside $BIN: the public API table needs it (or --skip api)"
fi

TRIAD=""
if ! skipping triad || [[ $PEERS_ONLY == 1 ]]; then
    if command -v gcc >/dev/null && gcc -O3 -march=native -fopenmp -o "$OUT/.build/triad" "$HERE/triad.c" >&2; then
        TRIAD="$OUT/.build/triad"
    else
        echo "warning: could not compile ci/bench/triad.c with gcc -fopenmp: no standalone C triad" >&2
    fi
fi

# ---------------------------------------------------------------- host facts for the report
load() { cut -d' ' -f1-3 /proc/loadavg; }
"$PY" - "$OUT/raw/meta.json" "$(load)" "$COMMAND" "$ROOT" "${BIN:-none}" "$KEEP_RAW" "$TORCH_VER" <<'EOF'
import json, os, platform, subprocess, sys, datetime
os.chdir(sys.argv[4])
def sh(cmd):
    try:
        return subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=20).stdout.strip()
    except Exception:
        return ""
import numpy, ml_dtypes, mpi4py
cpu = sh("grep -m1 'model name' /proc/cpuinfo | cut -d: -f2").strip() or platform.processor()
mem = sh("awk '/MemTotal/ {printf \"%.0f GiB\", $2/1048576}' /proc/meminfo")
meta = {
    "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    "commit": sh("git rev-parse --short HEAD") + (" (dirty)" if sh("git status --porcelain --untracked-files=no") else ""),
    "cpu": cpu, "cores": os.cpu_count(), "mem": mem, "load_start": sys.argv[2],
    "command": sys.argv[3].strip(), "binary": sys.argv[5],
    "openmpi": (sh("mpirun --version").splitlines() or ["OpenMPI: not installed"])[0],
    "mpi4py": mpi4py.__version__, "numpy": numpy.__version__, "ml_dtypes": ml_dtypes.__version__,
    "torch": sys.argv[7],
}
if sys.argv[6] == "1" and os.path.exists(sys.argv[1]):  # a later part of the same report
    old = json.load(open(sys.argv[1]))
    old["command"] = old.get("command", "?") + "; then " + meta["command"]
    old["binary"] = meta["binary"]
    meta = old
json.dump(meta, open(sys.argv[1], "w"), indent=1)
EOF

# ---------------------------------------------------------------- measure
ARGS=(--raw "$OUT/raw" --bin "$BIN" --python "$PY" --triad-bin "$TRIAD")
skipping mpi || ARGS+=(--mpirun "$(command -v mpirun)")
[[ -n $TORCH_PY ]] && ARGS+=(--torch-python "$TORCH_PY")
[[ -n $SKIP ]] && ARGS+=(--skip "$SKIP")
if [[ $QUICK == 1 ]]; then
    # shellcheck disable=SC2054 # "2,4" is one argument
    ARGS+=(--runs "${RUNS:-1}" --worlds 2,4 --min-bytes 1K --max-bytes 1M --step-factor 4 --iters 5 --warmup 1
           --shapes 1024x8x2048 --far-world 2 --far-shapes 1024x8x2048 --far-dtypes bf16 --decode-iters 10)
else
    ARGS+=(--runs "${RUNS:-3}")
fi
say "measuring (progress below; raw results in $OUT/raw)"
set +e
"$PY" "$HERE/run.py" "${ARGS[@]}" "${EXTRA[@]}"
RC=$?
set -e
[[ $RC == 2 ]] && die "nothing was measured (see above)"
if ! skipping api && [[ -n $BIN ]]; then
    say "public API vs kernel (ci/bench/api.py)"
    LIB="$(dirname "$BIN")/libascend_moe.so"
    API_ARGS=(--bin "$BIN" --rounds "${RUNS:-3}")
    [[ $QUICK == 1 ]] && API_ARGS=(--bin "$BIN" --rounds 1 --tokens 1024 --hidden 2048 --bytes 1048576)
    [[ -n $TORCH_PY ]] && API_ARGS+=(--torch-python "$TORCH_PY")
    ASCEND_MOE_LIB="$LIB" "$PY" "$HERE/api.py" "${API_ARGS[@]}" > "$OUT/raw/api.json" || { RC=1; rm -f "$OUT/raw/api.json"; }
fi
"$PY" - "$OUT/raw/meta.json" "$(load)" <<'EOF'
import json, sys
m = json.load(open(sys.argv[1])); m["load_end"] = sys.argv[2]; json.dump(m, open(sys.argv[1], "w"), indent=1)
EOF

say "report"
"$PY" "$HERE/report.py" --raw "$OUT/raw" --out "$OUT" || die "report generation failed"
echo "$OUT/report.md" >&2
if [[ $RC != 0 ]]; then
    echo "ci/bench.sh: some measurements failed; the report lists them under 'Failures'" >&2
    exit 1
fi
