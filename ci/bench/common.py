"""Definitions shared by the benchmark drivers, the peers and the report.

Everything that decides what a number means lives here, once: the size ladder, the
iteration rule, nccl-tests' bus-bandwidth factors, the bytes a collective or a finalize
must move (the floor), and the normalisation of result rows read from the CLI.
Standard library only, so the report and its test run without numpy.
"""

from __future__ import annotations

import csv
import json
import math
import re
from typing import Any, Iterable

KIB = 1024
MIB = 1024 * 1024
GIB = 1024 * 1024 * 1024

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather")
# Collectives only `ascend-moe bench collectives` runs (the peers do the three above).
CLI_ONLY_COLLECTIVES = ("all_to_all", "broadcast")
DTYPE_BYTES = {"f32": 4, "f16": 2, "bf16": 2, "i32": 4, "i64": 8}

# Finalize shapes of the issue: T x K x H.
FINALIZE_SHAPES = ((1024, 8, 2048), (4096, 8, 4096), (8192, 8, 7168))

# Decode-size latency table: [rows, H] bf16 tensors, 4 process ranks; finalize at T = rows, K = 8.
DECODE_ROWS = (1, 4, 16, 64)
DECODE_HIDDEN = (4096, 7168)
DECODE_TOPK = 8
DECODE_WORLD = 4


def parse_bytes(text: str) -> int:
    """`1K`, `256M`, `1G`, `4096` (binary units) -> bytes."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if not m:
        raise ValueError(f"not a byte size: {text!r} (expected e.g. 4096, 1K, 256M, 1G)")
    unit = {"": 1, "K": KIB, "M": MIB, "G": GIB}[m.group(2).upper()]
    return int(m.group(1)) * unit


def fmt_bytes(n: float) -> str:
    """Bytes as the shortest exact binary unit: 1 KiB, 32 MiB, 1.5 MiB."""
    for unit, scale in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if n >= scale:
            v = n / scale
            return f"{v:g} {unit}" if v == int(v) else f"{v:.3g} {unit}"
    return f"{int(n)} B"


def parse_shape(text: str) -> tuple[int, int, int]:
    """`4096x8x4096` -> (T, K, H)."""
    parts = text.lower().split("x")
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"not a finalize shape: {text!r} (expected TxKxH, e.g. 4096x8x4096)")
    t, k, h = (int(p) for p in parts)
    return t, k, h


def size_ladder(min_bytes: int, max_bytes: int, factor: int, extra: Iterable[int] = ()) -> list[int]:
    """min, min*factor, ... <= max, plus `extra` sizes inside [min, max], sorted, unique."""
    if min_bytes <= 0 or max_bytes < min_bytes or factor < 2:
        raise ValueError(f"bad size ladder: min {min_bytes} max {max_bytes} factor {factor}")
    sizes = set()
    s = min_bytes
    while s <= max_bytes:
        sizes.add(s)
        s *= factor
    sizes.update(e for e in extra if min_bytes <= e <= max_bytes)
    return sorted(sizes)


# Buffers from this size on count as large: fewer timed calls, one warmup.
LARGE = 16 * MIB


def iterations(size_bytes: int, iters: int, large_iters: int) -> int:
    """Timed calls for one size: `iters` below LARGE, `large_iters` from LARGE on.
    ci/bench runs the CLI once per class, so ours and every peer follow this rule."""
    return iters if size_bytes < LARGE else large_iters


def warmups(size_bytes: int, warmup: int) -> int:
    """Untimed calls before the timed ones: `warmup` below LARGE, 1 from LARGE on."""
    return warmup if size_bytes < LARGE else min(warmup, 1)


def element_count(op: str, size_bytes: int, world: int, elt: int) -> int:
    """Elements of the larger buffer (nccl-tests' `count`): for reduce_scatter and all_gather
    it is rounded down to a multiple of the world size so that every rank's chunk is equal."""
    count = size_bytes // elt
    if op in ("reduce_scatter", "all_gather"):
        count -= count % world
    return count


def peer_row(op: str, dtype: str, world: int, nbytes: int, count: int, iters: int, t: float, wrong: int, **extra) -> dict:
    """One collective result of a peer (OpenMPI, gloo) in the rows' format:
    median call time `t` in seconds, the wrong elements over every rank."""
    algbw = nbytes / t / 1e9 if t > 0 else 0.0
    row = {
        "op": op,
        "dtype": dtype,
        "world": world,
        "transport": "procs",
        "bytes": nbytes,
        "count": count,
        "iters": iters,
        "time_us": t * 1e6,
        "algbw_gbps": algbw,
        "busbw_gbps": algbw * bus_factor(op, world),
        "wrong": wrong,
    }
    row.update(extra)
    return row


def bus_factor(op: str, world: int) -> float:
    """nccl-tests' busbw = algbw * factor."""
    if world <= 1:
        return 1.0
    if op == "all_reduce":
        return 2.0 * (world - 1) / world
    if op in ("reduce_scatter", "all_gather", "all_to_all"):
        return (world - 1) / world
    if op == "broadcast":
        return 1.0
    raise ValueError(f"unknown collective {op!r}")


def collective_floor_bytes(op: str, size_bytes: int, world: int) -> int:
    """Memory traffic (whole machine) that no shared-memory implementation can avoid, with
    `size_bytes` the larger buffer as in nccl-tests: every input byte of every rank read once,
    every output byte of every rank written once.
    all_reduce: n*S read + n*S written; reduce_scatter: n*S read + S written (n chunks of S/n);
    all_gather: S read (n chunks of S/n) + n*S written; all_to_all: n*S read + n*S written;
    broadcast: the root's S read + S written by each of the n - 1 others."""
    n = world
    if op in ("all_reduce", "all_to_all"):
        return 2 * n * size_bytes
    if op in ("reduce_scatter", "all_gather"):
        return (n + 1) * size_bytes
    if op == "broadcast":
        return n * size_bytes
    raise ValueError(f"unknown collective {op!r}")


def finalize_bytes(tokens: int, topk: int, hidden: int, dtype: str) -> int:
    """Bytes the benchmarked finalize moves: expanded_x [T*K, H] read, x1 [T, H] read,
    out [T, H] written (all in `dtype`), expanded_row_idx [T*K] i32 and scales [T, K] f32 read."""
    e = DTYPE_BYTES[dtype]
    return tokens * topk * hidden * e + 2 * tokens * hidden * e + tokens * topk * (4 + 4)


def decode_sizes(hidden: int, dtype: str = "bf16") -> list[int]:
    """nccl-tests sizes of the decode table for one H: a [rows, H] tensor for every rows in
    DECODE_ROWS (a ladder of factor 4)."""
    return [r * hidden * DTYPE_BYTES[dtype] for r in DECODE_ROWS]


def decode_shape(size_bytes: int, dtype: str = "bf16") -> tuple[int, int] | None:
    """(rows, H) of a decode-table size, or None if no [rows, H] of the table has that size
    (the table's sizes are distinct: common.decode_sizes)."""
    e = DTYPE_BYTES[dtype]
    hits = [(r, h) for h in DECODE_HIDDEN for r in DECODE_ROWS if r * h * e == size_bytes]
    return hits[0] if len(hits) == 1 else None


def floor_us(bytes_moved: float, triad_gbps: float) -> float:
    """Time to move `bytes_moved` at the triad bandwidth (GB/s = 1e9 B/s), in microseconds."""
    return bytes_moved / (triad_gbps * 1e3)


# ---------------------------------------------------------------------------------------------
# Reading results. The CLI writes the schema of ci/bench/README.md; the reader tolerates the
# obvious spellings of each field so that a renamed key is a one-line change here.

_ALIASES = {
    "op": ("op", "collective", "name", "bench"),
    "dtype": ("dtype", "type"),
    "world": ("world", "ranks", "world_size", "nranks"),
    "transport": ("transport", "mode"),
    "bytes": ("bytes", "size", "size_bytes"),
    "count": ("count", "elements"),
    "iters": ("iters", "iterations"),
    "time_us": ("time_us", "time", "us"),
    "algbw_gbps": ("algbw_gbps", "algbw"),
    "busbw_gbps": ("busbw_gbps", "busbw"),
    "gbps": ("gbps", "bw_gbps", "bandwidth_gbps"),
    "floor_us": ("floor_us",),
    "floor_ratio": ("floor_ratio", "vs_floor", "floor", "ratio_to_floor"),
    "wrong": ("wrong", "#wrong", "errors", "n_wrong"),
    "triad_gbps": ("triad_gbps", "triad"),
    "tokens": ("tokens", "t"),
    "topk": ("topk", "k"),
    "hidden": ("hidden", "h"),
    "threads": ("threads",),
}

_NUMERIC = {
    "world",
    "bytes",
    "count",
    "iters",
    "time_us",
    "algbw_gbps",
    "busbw_gbps",
    "gbps",
    "floor_us",
    "floor_ratio",
    "wrong",
    "triad_gbps",
    "tokens",
    "topk",
    "hidden",
    "threads",
}


def normalize_row(raw: dict[str, Any], defaults: dict[str, Any] | None = None) -> dict[str, Any]:
    """One result row with canonical keys; unknown keys are kept as they are."""
    out: dict[str, Any] = dict(defaults or {})
    lowered = {str(k).lower(): v for k, v in raw.items()}
    used = set()
    for canon, names in _ALIASES.items():
        for name in names:
            if name in lowered and lowered[name] is not None:
                out[canon] = lowered[name]
                used.add(name)
                break
    for k, v in lowered.items():
        if k not in used and k not in out:
            out[k] = v
    for k in _NUMERIC:
        if k in out and isinstance(out[k], str):
            try:
                out[k] = float(out[k]) if re.search(r"[.eE]", out[k]) else int(out[k])
            except ValueError:
                pass
    return out


def _parse_csv(text: str) -> list[dict[str, Any]]:
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]
    if len(lines) < 2 or "," not in lines[0]:
        raise ValueError("neither JSON nor CSV with a header line")
    return list(csv.DictReader(lines))


def parse_result_text(text: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The stdout of a `--json` run: one object with `rows` (or `results`; header fields go to
    every row), a single result object, a list of rows, JSON lines, or CSV with a header.
    Returns (header, rows)."""
    text = text.strip()
    if not text:
        raise ValueError("empty output")
    try:
        doc: Any = json.loads(text)
    except json.JSONDecodeError:
        lines = [ln for ln in text.splitlines() if ln.strip().startswith("{")]
        if lines:
            doc = [json.loads(ln) for ln in lines]
            if len(doc) == 1:
                doc = doc[0]
        else:
            doc = _parse_csv(text)
    if isinstance(doc, dict) and "results" in doc and "rows" not in doc:
        doc = dict(doc, rows=doc.pop("results"))
    if isinstance(doc, dict) and "rows" not in doc:
        doc = [doc]  # a single result (triad)
    triad_by_world: dict[int, float] = {}
    if isinstance(doc, dict):
        header = {k: v for k, v in doc.items() if k != "rows" and not isinstance(v, (list, dict))}
        rows = doc["rows"]
        triad = doc.get("triad")
        if isinstance(triad, dict) and "gbps" in triad:
            header["triad_gbps"] = triad["gbps"]
        elif isinstance(triad, list):  # one triad per world size: [{"ranks": 4, "gbps": 20.1}, ...]
            for t in triad:
                t = normalize_row(t)
                if "world" in t and "gbps" in t:
                    triad_by_world[int(t["world"])] = float(t["gbps"])
    else:
        header, rows = {}, doc
    if not isinstance(rows, list):
        raise ValueError("`rows` is not a list")
    defaults = {k: v for k, v in normalize_row(header).items() if k in ("world", "transport", "triad_gbps", "threads")}
    out = [normalize_row(r, defaults) for r in rows]
    for r in out:
        if "triad_gbps" not in r and triad_by_world and int(r.get("world", -1)) in triad_by_world:
            r["triad_gbps"] = triad_by_world[int(r["world"])]
    return header, out


def median(values: list[float]) -> float:
    v = sorted(values)
    n = len(v)
    if n == 0:
        return math.nan
    return v[n // 2] if n % 2 else 0.5 * (v[n // 2 - 1] + v[n // 2])
