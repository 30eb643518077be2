"""Turns the raw results of run.py into bench-report/: report.md, results.csv and PNG plots.

    python report.py --raw bench-report/raw --out bench-report

Every figure is the median over runs with min and max. Ratios (ours / OpenMPI, ours / numpy,
time at the floor / time, unfused / fused) are taken within each run, then their median, min
and max over runs. Standard library only; plots need matplotlib and are skipped (with a note)
without it.
"""

from __future__ import annotations

import argparse
import csv
import glob
import json
import math
import os
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402

# Issue targets: (label, suite, selector, metric, threshold).
COLL_TARGET_SIZE = 4096 * 4096 * 2  # bf16 [4096, 4096]
TARGETS = [
    ("finalize bf16 4096x8x4096 >= 0.8x triad floor", "finalize", ("bf16", 4096, 8, 4096), "floor_ratio", 0.8),
    ("finalize bf16 4096x8x4096 >= 15x numpy", "finalize", ("bf16", 4096, 8, 4096), "vs_peer", 15.0),
    ("reduce_scatter 4 ranks bf16 [4096,4096] >= 0.7x floor", "coll", ("reduce_scatter", 4), "floor_ratio", 0.7),
    ("all_gather 4 ranks bf16 [4096,4096] >= 0.7x floor", "coll", ("all_gather", 4), "floor_ratio", 0.7),
    ("all_reduce 4 ranks bf16 [4096,4096] >= 0.6x floor", "coll", ("all_reduce", 4), "floor_ratio", 0.6),
    ("all_reduce 4 ranks bf16 [4096,4096] >= 5x OpenMPI busbw", "coll", ("all_reduce", 4), "vs_peer", 5.0),
    ("reduce_scatter 4 ranks bf16 [4096,4096] >= 5x OpenMPI busbw", "coll", ("reduce_scatter", 4), "vs_peer", 5.0),
    (
        "finalize_and_reduce bf16 4096x8x4096 >= 1.3x finalize + maybe_pad_and_reduce",
        "far",
        ("bf16", 4096, 8, 4096),
        "speedup",
        1.3,
    ),
]


class Stat:
    """Median, min, max of per-run values."""

    def __init__(self, values):
        self.values = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]

    @property
    def ok(self) -> bool:
        return bool(self.values)

    @property
    def med(self) -> float:
        return common.median(self.values)

    @property
    def lo(self) -> float:
        return min(self.values) if self.values else math.nan

    @property
    def hi(self) -> float:
        return max(self.values) if self.values else math.nan

    def fmt(self, digits: int = 3, spread: bool = True) -> str:
        if not self.values:
            return "–"
        f = _num(self.med, digits)
        if spread and len(self.values) > 1:
            f += f" [{_num(self.lo, digits)}–{_num(self.hi, digits)}]"
        return f


def _num(v: float, digits: int = 3) -> str:
    if v is None or math.isnan(v):
        return "–"
    if v == 0:
        return "0"
    a = abs(v)
    if a >= 1000:
        return f"{v:.0f}"
    return f"{v:.{digits}g}"


# ---------------------------------------------------------------------------------------------
# Loading


def load(raw: str):
    """-> (docs, failures, meta): every stored step result of every run."""
    docs = []
    for path in sorted(glob.glob(os.path.join(raw, "run*", "*.json"))):
        with open(path) as f:
            docs.append(json.load(f))
    failures = []
    fpath = os.path.join(raw, "failures.json")
    if os.path.exists(fpath):
        with open(fpath) as f:
            failures = json.load(f)
    meta = {}
    mpath = os.path.join(raw, "meta.json")
    if os.path.exists(mpath):
        with open(mpath) as f:
            meta = json.load(f)
    return docs, failures, meta


def build(docs):
    """Index the rows: triad per run, and per-run values of every series."""
    triad = defaultdict(dict)  # run -> impl -> gbps
    coll = defaultdict(dict)  # (impl, transport, op, dtype, world, bytes) -> run -> row
    fin = defaultdict(dict)  # (impl, dtype, T, K, H) -> run -> row
    far = defaultdict(dict)  # (op, dtype, T, K, H, world) -> run -> row
    dec = defaultdict(dict)  # decode table: (impl, op, H, rows) -> run -> row
    for d in docs:
        run = d["run"]
        for row in d["rows"]:
            kind = d["kind"]
            if kind == "triad":
                triad[run][d["impl"]] = float(row["gbps"])
            elif kind == "collectives":
                if d["impl"] == "ascend-moe" and row.get("triad_gbps"):
                    # The triad the CLI measured for its own floor (per world size: threads = ranks).
                    triad[run].setdefault(f"cli-collectives-{int(row['world'])}", float(row["triad_gbps"]))
                key = (
                    d["impl"],
                    row.get("transport", "threads"),
                    row["op"],
                    row["dtype"],
                    int(row["world"]),
                    int(row["bytes"]),
                )
                coll[key][run] = row
            elif kind == "finalize":
                if d["impl"] == "ascend-moe" and row.get("triad_gbps"):
                    triad[run].setdefault("cli-finalize", float(row["triad_gbps"]))
                key = (d["impl"], row["dtype"], int(row["tokens"]), int(row["topk"]), int(row["hidden"]))
                fin[key][run] = row
            elif kind == "finalize_and_reduce":
                key = (
                    row["op"],
                    row["dtype"],
                    int(row["tokens"]),
                    int(row["topk"]),
                    int(row["hidden"]),
                    int(row.get("world", 0)),
                )
                far[key][run] = row
            elif kind == "decode_collectives":
                shape = common.decode_shape(int(row["bytes"]), row["dtype"])
                if shape is not None:
                    dec[(d["impl"], row["op"], shape[1], shape[0])][run] = row
            elif kind == "decode_finalize":
                dec[(d["impl"], "finalize", int(row["hidden"]), int(row["tokens"]))][run] = row
    return triad, coll, fin, far, dec


def run_triad(triad, run):
    """The floor bandwidth of a run: the CLI's triad (`bench triad`, else the one `bench
    collectives` measured with the fewest threads), else the C one."""
    t = triad.get(run, {})
    coll = sorted((int(k.rsplit("-", 1)[1]), v) for k, v in t.items() if k.startswith("cli-collectives-"))
    return t.get("ascend-moe") or (coll[0][1] if coll else None) or t.get("cli-finalize") or t.get("c-openmp")


def _floor_ratio(row, bytes_moved, triad_gbps):
    """time at the floor / time, from the row's own floor if it has one, else from the triad."""
    t = row.get("time_us")
    if not t:
        return None
    if row.get("floor_ratio") is not None:
        return float(row["floor_ratio"])
    if row.get("floor_us") is not None:
        return float(row["floor_us"]) / float(t)
    g = row.get("triad_gbps") or triad_gbps
    if not g:
        return None
    return common.floor_us(bytes_moved, float(g)) / float(t)


PEERS = ("openmpi", "gloo")


def collective_series(triad, coll):
    """Per (transport-impl, op, dtype, world, bytes): per-run busbw, algbw, time, floor ratio,
    floor busbw, ratio to OpenMPI; plus the OpenMPI rows with the floor of the same run."""
    out = {}
    for key, runs in coll.items():
        impl, transport, op, dtype, world, nbytes = key
        peer = coll.get(("openmpi", "procs", op, dtype, world, nbytes), {})
        gloo = coll.get(("gloo", "procs", op, dtype, world, nbytes), {})
        ours_any = [coll.get(("ascend-moe", tr, op, dtype, world, nbytes), {}) for tr in ("threads", "procs")]
        s = defaultdict(dict)
        for run, row in runs.items():
            floor_b = common.collective_floor_bytes(op, nbytes, world)
            fr = None
            if impl in PEERS:
                # The floor of the same run and case as ours, so both are measured against one number.
                for o in ours_any:
                    if run in o and (o[run].get("floor_us") is not None):
                        fr = float(o[run]["floor_us"]) / float(row["time_us"])
                        break
                    if run in o and o[run].get("floor_ratio") is not None:
                        fr = float(o[run]["floor_ratio"]) * float(o[run]["time_us"]) / float(row["time_us"])
                        break
            if fr is None:
                fr = _floor_ratio(row, floor_b, run_triad(triad, run))
            busbw = float(row["busbw_gbps"])
            g = row.get("triad_gbps") or run_triad(triad, run)
            if impl in PEERS:
                g = next((o[run].get("triad_gbps") for o in ours_any if run in o and o[run].get("triad_gbps")), g)
            if g:
                # Against the minimum traffic (every input read once, every output written once),
                # whatever floor the CLI itself reports.
                s["min_floor_ratio"][run] = common.floor_us(floor_b, float(g)) / float(row["time_us"])
            s["time_us"][run] = float(row["time_us"])
            s["algbw_gbps"][run] = float(row["algbw_gbps"])
            s["busbw_gbps"][run] = busbw
            s["floor_ratio"][run] = fr
            s["floor_busbw_gbps"][run] = busbw / fr if fr else None
            s["wrong"][run] = int(row.get("wrong", 0) or 0)
            s["count"][run] = int(row.get("count", 0) or 0)
            if impl not in PEERS and run in peer and float(peer[run]["busbw_gbps"]) > 0:
                s["vs_peer"][run] = busbw / float(peer[run]["busbw_gbps"])
            if impl not in PEERS and run in gloo and float(gloo[run]["busbw_gbps"]) > 0:
                s["vs_gloo"][run] = busbw / float(gloo[run]["busbw_gbps"])
        out[key] = {m: Stat(list(v.values())) for m, v in s.items()}
    return out


def finalize_series(triad, fin):
    out = {}
    for key, runs in fin.items():
        impl, dtype, t, k, h = key
        peer = fin.get(("numpy", dtype, t, k, h), {})
        s = defaultdict(dict)
        nbytes = common.finalize_bytes(t, k, h, dtype)
        for run, row in runs.items():
            time_us = float(row["time_us"])
            s["time_us"][run] = time_us
            s["gbps"][run] = float(row.get("gbps") or nbytes / time_us / 1e3)
            if impl == "numpy":
                ours = fin.get(("ascend-moe", dtype, t, k, h), {}).get(run)
                if ours is not None and ours.get("floor_us") is not None:
                    s["floor_ratio"][run] = float(ours["floor_us"]) / time_us
                else:
                    s["floor_ratio"][run] = _floor_ratio(row, nbytes, run_triad(triad, run))
            else:
                s["floor_ratio"][run] = _floor_ratio(row, nbytes, run_triad(triad, run))
                if run in peer:
                    s["vs_peer"][run] = float(peer[run]["time_us"]) / time_us
        out[key] = {m: Stat(list(v.values())) for m, v in s.items()}
    return out


FUSED = "finalize_and_reduce"


def far_series(far):
    out = {}
    for key, runs in far.items():
        op, dtype, t, k, h, world = key
        s = defaultdict(dict)
        others = [kk for kk in far if kk[0] != FUSED and kk[1:] == key[1:]]
        for run, row in runs.items():
            s["time_us"][run] = float(row["time_us"])
            if op == FUSED:
                for ok in others:
                    if run in far[ok]:
                        s["speedup"][run] = float(far[ok][run]["time_us"]) / float(row["time_us"])
                # The byte model of both paths (`bench finalize_and_reduce --json`, when it has one).
                for m in ("bound", "ceiling"):
                    if row.get(m) is not None:
                        s[m][run] = float(row[m])
                # The fused path's same-run floor (floor / fused time), when the CLI has one.
                if row.get("fused_vs_floor") is not None:
                    s["floor_ratio"][run] = float(row["fused_vs_floor"])
        out[key] = {m: Stat(list(v.values())) for m, v in s.items()}
    return out


def decode_series(dec):
    """Per (impl, op, H, rows): per-run time (us), #wrong and, for ours, the time ratio to each
    peer of the same run (ours time / peer time: below 1 = ours is faster)."""
    out = {}
    for key, runs in dec.items():
        impl, op, h, nrows = key
        s = defaultdict(dict)
        for run, row in runs.items():
            t = float(row["time_us"])
            s["time_us"][run] = t
            s["wrong"][run] = int(row.get("wrong", 0) or 0)
            if impl == "ascend-moe":
                for peer in ("gloo", "openmpi", "numpy"):
                    prow = dec.get((peer, op, h, nrows), {}).get(run)
                    if prow is not None and float(prow["time_us"]) > 0:
                        s[f"over_{peer}"][run] = t / float(prow["time_us"])
        out[key] = {m: Stat(list(v.values())) for m, v in s.items()}
    return out


# ---------------------------------------------------------------------------------------------
# Output


def write_csv(path, cs, fs, rs, ds=None):
    metrics = ["time_us", "algbw_gbps", "busbw_gbps", "gbps", "floor_ratio", "min_floor_ratio", "vs_peer"]
    metrics += ["vs_gloo", "speedup", "bound", "ceiling"]
    cols = ["suite", "impl", "transport", "op", "dtype", "world", "tokens", "topk", "hidden", "bytes", "runs"]
    for m in metrics:
        cols += [f"{m}_median", f"{m}_min", f"{m}_max"]
    cols.append("wrong")
    rows = []
    for (impl, tr, op, dt, w, nb), st in sorted(cs.items()):
        rows.append(
            (
                {
                    "suite": "collectives",
                    "impl": impl,
                    "transport": tr,
                    "op": op,
                    "dtype": dt,
                    "world": w,
                    "bytes": nb,
                    "wrong": max(st["wrong"].values) if st["wrong"].ok else "",
                },
                st,
            )
        )
    for (impl, dt, t, k, h), st in sorted(fs.items()):
        rows.append(
            (
                {
                    "suite": "finalize",
                    "impl": impl,
                    "op": "finalize",
                    "dtype": dt,
                    "tokens": t,
                    "topk": k,
                    "hidden": h,
                    "bytes": common.finalize_bytes(t, k, h, dt),
                },
                st,
            )
        )
    for (op, dt, t, k, h, w), st in sorted(rs.items()):
        rows.append(
            (
                {
                    "suite": "finalize_and_reduce",
                    "impl": "ascend-moe",
                    "op": op,
                    "dtype": dt,
                    "tokens": t,
                    "topk": k,
                    "hidden": h,
                    "world": w,
                },
                st,
            )
        )
    for (impl, op, h, nrows), st in sorted((ds or {}).items()):
        base = {"suite": "decode", "impl": impl, "transport": "procs", "op": op, "dtype": "bf16", "hidden": h}
        base.update({"tokens": nrows, "topk": common.DECODE_TOPK} if op == "finalize" else {})
        base.update({} if op == "finalize" else {"world": common.DECODE_WORLD, "tokens": nrows})
        if op != "finalize":
            base["bytes"] = nrows * h * common.DTYPE_BYTES["bf16"]
            base["wrong"] = max(st["wrong"].values) if "wrong" in st and st["wrong"].ok else ""
        rows.append((base, st))
    with open(path, "w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=cols)
        wr.writeheader()
        for base, st in rows:
            rec = dict(base)
            rec["runs"] = max((len(s.values) for s in st.values()), default=0)
            for m in metrics:
                if m in st and st[m].ok:
                    rec[f"{m}_median"], rec[f"{m}_min"], rec[f"{m}_max"] = (
                        f"{st[m].med:.6g}",
                        f"{st[m].lo:.6g}",
                        f"{st[m].hi:.6g}",
                    )
            wr.writerow(rec)
    return len(rows)


def _table(headers, rows):
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def evaluate_targets(cs, fs, rs):
    """-> rows (target, transport/impl, measured, reached)."""
    out = []
    for label, suite, sel, metric, thr in TARGETS:
        candidates = []
        if suite == "finalize":
            st = fs.get(("ascend-moe",) + sel)
            candidates.append(("", st))
        elif suite == "coll":
            op, world = sel
            for tr in ("threads", "procs"):
                candidates.append((tr, cs.get(("ascend-moe", tr, op, "bf16", world, COLL_TARGET_SIZE))))
        else:
            dt, t, k, h = sel
            keys = [kk for kk in rs if kk[0] == FUSED and kk[1:5] == (dt, t, k, h)]
            candidates += [(f"{kk[5]} ranks", rs[kk]) for kk in keys] or [("", None)]
        for what, st in candidates:
            extra = st["min_floor_ratio"].fmt() if st and metric == "floor_ratio" and "min_floor_ratio" in st else ""
            if st is None or metric not in st or not st[metric].ok:
                out.append((label, what, "not measured", "n/a", extra))
            else:
                s = st[metric]
                out.append((label, what, s.fmt(), "**reached**" if s.med >= thr else "not reached", extra))
    return out


# Targets on the public API, the CLI's own floor and the fused op: (label, kind, selector, threshold).
API_SHAPE = "4096x8x4096"
API_TARGETS = [
    ("finalize bf16 4096x8x4096 via Python, `out=`: triad floor / time >= 0.9", "api_fin", "python_s", 0.9),
    ("the same, allocating (no `out=`): triad floor / time >= 0.85 every round", "api_fin", "python_alloc_s", 0.85),
]
API_COLL_TARGETS = [
    ("Python collectives, `out=`: time / CLI time <= 1.1x", "python_s", 1.1),
    ("Python collectives, allocating: time / CLI time <= 1.1x", "python_alloc_s", 1.1),
]
FLOOR_TARGETS = [
    ("CLI all_reduce / reduce_scatter 4 ranks bf16 32 MiB: vs_floor >= 0.9", ("all_reduce", "reduce_scatter"), 0.9),
    (
        "CLI all_gather / all_to_all / broadcast 4 ranks bf16 32 MiB: vs_floor >= 0.9",
        ("all_gather", "all_to_all", "broadcast"),
        0.9,
    ),
]
FAR_EVERY_SHAPE = 1.5


def _reached(ok: bool) -> str:
    return "**reached**" if ok else "not reached"


def issue_targets(cs, rs, api, plan=None):
    """-> rows (target, case, measured, result, note) of the targets on the public API
    (ci/bench/api.py), the CLI's own `vs_floor` and the fused finalize + reduce-scatter."""
    plan = plan or {}
    out = []
    f = (api or {}).get("finalize")
    for label, _, key, thr in API_TARGETS:
        if not f or not f.get("rounds"):
            out.append((label, "", "not measured", "n/a", "`ci/bench/api.py` did not run"))
            continue
        per_round = [r["floor_s"] / r[key] for r in f["rounds"] if r.get(key)]
        st = Stat(per_round)
        if not st.ok:
            out.append((label, "", "not measured", "n/a", f"`raw/api.json` has no `{key}` per round"))
            continue
        case = f"{f['shape']}, {f['threads']} threads, {len(per_round)} rounds"
        every = "every round" in label
        worst = f"worst round {_num(st.lo)}"
        if f["shape"] != API_SHAPE:
            out.append((label, case, st.fmt(), "n/a", f"not the target's shape {API_SHAPE}; {worst}"))
            continue
        ok = (st.lo if every else st.med) >= thr
        out.append((label, case, st.fmt(), _reached(ok), worst))
    c = (api or {}).get("collectives")
    for label, key, thr in API_COLL_TARGETS:
        for op in common.COLLECTIVES:
            if not c or op not in c or not c.get("rounds"):
                out.append((label, op, "not measured", "n/a", "`ci/bench/api.py` did not measure it"))
                continue
            st = Stat([r[op][key] / r[op]["cli_s"] for r in c["rounds"] if op in r and r[op].get(key)])
            case = f"{op}, {c['ranks']} procs, {common.fmt_bytes(c['bytes'])}"
            out.append((label, case, st.fmt(), _reached(st.ok and st.med <= thr), f"{len(st.values)} rounds"))
    missing = set(plan.get("cli_missing_ops", []))
    for label, ops, thr in FLOOR_TARGETS:
        for op in ops:
            for tr in ("threads", "procs"):
                st = cs.get(("ascend-moe", tr, op, "bf16", 4, COLL_TARGET_SIZE))
                if op in missing:
                    out.append((label, f"{op} {tr}", "not measured", "n/a", f"`bench collectives` has no {op}"))
                elif st is None or not st["floor_ratio"].ok:
                    out.append((label, f"{op} {tr}", "not measured", "n/a", ""))
                else:
                    fr = st["floor_ratio"]
                    out.append((label, f"{op} {tr}", fr.fmt(), _reached(fr.med >= thr), "the CLI's own floor"))
    label = f"fused finalize+reduce-scatter: unfused / fused >= {FAR_EVERY_SHAPE}x at every shape"
    keys = sorted(k for k in rs if k[0] == FUSED and "speedup" in rs[k] and rs[k]["speedup"].ok)
    for k in keys:
        sp = rs[k]["speedup"]
        case = f"{k[2]}x{k[3]}x{k[4]} {k[1]}, {k[5]} ranks"
        out.append((label, case, sp.fmt(), _reached(sp.med >= FAR_EVERY_SHAPE), _byte_bounds(rs[k])))
    if keys:
        worst = min(rs[k]["speedup"].med for k in keys)
        out.append(
            (
                label,
                f"all {len(keys)} shapes",
                _num(worst),
                _reached(worst >= FAR_EVERY_SHAPE),
                "the worst shape's median",
            )
        )
    else:
        out.append((label, "", "not measured", "n/a", ""))
    return out


def _byte_bounds(st):
    """The note on a fused shape: the speedups its byte model allows (empty without one)."""
    if "bound" not in st or not st["bound"].ok:
        return ""
    note = f"bytes allow {_num(st['bound'].med)} staged, {_num(st['ceiling'].med)} for any fused op"
    if "floor_ratio" in st and st["floor_ratio"].ok:
        note += f"; fused at {_num(st['floor_ratio'].med)} of its same-run floor"
    return note


def plots(out_dir, cs, fs, triad_stat, ds=None):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter, LogLocator
    except ImportError:
        return [], "matplotlib is not installed: no plots"
    files = []
    ops = sorted({k[2] for k in cs})
    dtypes = sorted({k[3] for k in cs})
    worlds = sorted({k[4] for k in cs})
    styles = {
        ("ascend-moe", "threads"): ("C0", "-", "ours (threads)"),
        ("ascend-moe", "procs"): ("C2", "-", "ours (processes)"),
        ("openmpi", "procs"): ("C3", "-", "OpenMPI (sm)"),
        ("gloo", "procs"): ("C4", "-", "gloo (torch.distributed)"),
    }
    for op in ops:
        for dt in dtypes:
            fig, axes = plt.subplots(1, len(worlds), figsize=(5 * len(worlds), 4), squeeze=False)
            for ax, w in zip(axes[0], worlds):
                floor_pts = {}
                for (impl, tr), (color, ls, label) in styles.items():
                    keys = sorted(k for k in cs if k[:5] == (impl, tr, op, dt, w))
                    if not keys:
                        continue
                    xs = [k[5] for k in keys]
                    st = [cs[k]["busbw_gbps"] for k in keys]
                    ax.plot(xs, [s.med for s in st], color=color, ls=ls, marker=".", label=label)
                    ax.fill_between(xs, [s.lo for s in st], [s.hi for s in st], color=color, alpha=0.2)
                    if impl == "ascend-moe":
                        for k in keys:
                            fb = cs[k].get("floor_busbw_gbps")
                            if fb is not None and fb.ok:
                                floor_pts.setdefault(k[5], fb.med)
                if floor_pts:
                    xs = sorted(floor_pts)
                    ax.plot(xs, [floor_pts[x] for x in xs], color="k", ls="--", label="floor (triad)")
                ax.set_xscale("log", base=2)
                # One label per 4x in size: the 1 KiB .. 256 MiB ladder stays readable.
                ax.xaxis.set_major_locator(LogLocator(base=4))
                ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: common.fmt_bytes(v).replace(" ", "")))
                ax.tick_params(axis="x", labelrotation=45)
                ax.set_yscale("log")
                ax.set_title(f"{op} {dt}, {w} ranks")
                ax.set_xlabel("size (bytes)")
                ax.set_ylabel("bus bandwidth (GB/s)")
                ax.grid(True, which="both", alpha=0.3)
                ax.legend(fontsize=8)
            fig.tight_layout()
            name = f"collective_{op}_{dt}.png"
            fig.savefig(os.path.join(out_dir, name), dpi=90)
            plt.close(fig)
            files.append(name)
    if fs:
        fdtypes = sorted({k[1] for k in fs})
        fig, axes = plt.subplots(1, len(fdtypes), figsize=(5 * len(fdtypes), 4), squeeze=False)
        for ax, dt in zip(axes[0], fdtypes):
            for impl, color, label in (("ascend-moe", "C0", "ours"), ("numpy", "C1", "numpy")):
                keys = sorted((k for k in fs if k[0] == impl and k[1] == dt), key=lambda k: k[2] * k[3] * k[4])
                if not keys:
                    continue
                xs = [common.finalize_bytes(k[2], k[3], k[4], dt) for k in keys]
                st = [fs[k]["gbps"] for k in keys]
                ax.plot(xs, [s.med for s in st], color=color, marker="o", label=label)
                ax.fill_between(xs, [s.lo for s in st], [s.hi for s in st], color=color, alpha=0.2)
                if impl == "ascend-moe" or not any(k[0] == "ascend-moe" for k in fs):
                    for x, k in zip(xs, keys):
                        ax.annotate(f"{k[2]}x{k[3]}x{k[4]}", (x, fs[k]["gbps"].med), fontsize=7)
            # The floor as the ratios use it: GB/s at the floor time of each case (the CLI's own
            # triad when it reports one), else the run's triad.
            fkeys = sorted((k for k in fs if k[1] == dt), key=lambda k: k[2] * k[3] * k[4])
            floor_pts = {}
            for k in fkeys:
                st = fs[k]
                if st["floor_ratio"].ok and st["gbps"].ok and st["floor_ratio"].med > 0:
                    x = common.finalize_bytes(k[2], k[3], k[4], dt)
                    floor_pts.setdefault(x, st["gbps"].med / st["floor_ratio"].med)
            if floor_pts:
                xs = sorted(floor_pts)
                ax.plot(xs, [floor_pts[x] for x in xs], color="k", ls="--", label="floor (triad)")
            elif triad_stat.ok:
                ax.axhline(triad_stat.med, color="k", ls="--", label="floor (triad)")
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_title(f"finalize {dt}")
            _label_axes(ax, "bytes moved per call", "GB/s", 8)
        _save(fig, out_dir, "finalize.png", files)
    if ds:
        dops = [o for o in common.COLLECTIVES + ("finalize",) if any(k[1] == o for k in ds)]
        fig, axes = plt.subplots(1, len(dops), figsize=(4.5 * len(dops), 4), squeeze=False)
        colors = {"ascend-moe": "C2", "openmpi": "C3", "gloo": "C4", "numpy": "C1"}
        names = {"ascend-moe": "ours", "openmpi": "OpenMPI", "gloo": "gloo", "numpy": "numpy"}
        for ax, op in zip(axes[0], dops):
            for impl in colors:
                for h, ls in zip(common.DECODE_HIDDEN, ("-", "--")):
                    keys = sorted(k for k in ds if k[:3] == (impl, op, h))
                    if not keys:
                        continue
                    xs = [k[3] for k in keys]
                    st = [ds[k]["time_us"] for k in keys]
                    label = f"{names[impl]} H={h}"
                    ax.plot(xs, [v.med for v in st], color=colors[impl], ls=ls, marker="o", label=label)
                    ax.fill_between(xs, [v.lo for v in st], [v.hi for v in st], color=colors[impl], alpha=0.15)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xticks(list(common.DECODE_ROWS))
            ax.set_xticklabels([str(r) for r in common.DECODE_ROWS])
            ax.set_title(f"{op} bf16" + ("" if op == "finalize" else f", {common.DECODE_WORLD} process ranks"))
            _label_axes(ax, "rows (tokens)", "latency (us)", 7)
        _save(fig, out_dir, "decode_latency.png", files)
    return files, None


def _label_axes(ax, xlabel: str, ylabel: str, legend_size: int) -> None:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=legend_size)


def _save(fig, out_dir: str, name: str, files: list) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, name), dpi=90)
    plt.close(fig)
    files.append(name)


def floor_sources(docs):
    """One line per suite saying which floor the report's ratios use."""
    lines = []
    for kind, formula in (
        ("collectives", "minimum traffic: all_reduce 2nS, reduce_scatter and all_gather (n+1)S"),
        ("finalize", "T*K*H*e + 2*T*H*e + 8*T*K bytes"),
    ):
        ours = [d for d in docs if d["kind"] == kind and d["impl"] == "ascend-moe"]
        if not ours and not any(d["kind"] == kind for d in docs):
            continue
        cli = any(r.get("floor_us") is not None or r.get("floor_ratio") is not None for d in ours for r in d["rows"])
        rules = sorted({str(d["header"]["floor_rule"]) for d in ours if d.get("header", {}).get("floor_rule")})
        if cli:
            lines.append(
                f"- {kind} floor: the CLI's own"
                + (f" ({'; '.join(rules)})" if rules else "")
                + "; peers are measured against the same floor time of the same run"
            )
        else:
            lines.append(f"- {kind} floor: {formula}, at the run's triad bandwidth")
    return lines


def write_report(
    path,
    meta,
    triad,
    cs,
    fs,
    rs,
    failures,
    plot_files,
    plot_note,
    csv_name,
    floor_notes=(),
    api=None,
    ds=None,
    plan=None,
):
    nruns = max([len(st["time_us"].values) for st in list(cs.values()) + list(fs.values())] or [len(triad)])
    L = ["# ascend-moe performance report", ""]
    L.append(
        f"- date: {meta.get('date', '?')}; commit: `{meta.get('commit', '?')}`; command: `{meta.get('command', '?')}`; "
        f"binary: `{meta.get('binary', '?')}`"
    )
    L.append(
        f"- host: {meta.get('cpu', '?')}, {meta.get('cores', '?')} cores, {meta.get('mem', '?')}; "
        f"load average at start {meta.get('load_start', '?')}, at end {meta.get('load_end', '?')}"
    )
    L.append(
        f"- peers: {meta.get('openmpi', 'OpenMPI ?')}, mpi4py {meta.get('mpi4py', '?')}, "
        f"numpy {meta.get('numpy', '?')}, ml_dtypes {meta.get('ml_dtypes', '?')}, "
        f"gloo: {meta.get('torch', 'torch ?')}"
    )
    L.append(f"- every figure: median [min–max] over {nruns} run(s); ratios are taken within a run, then summarised")
    L.append(
        "- the machine is shared and small: treat absolute numbers as noisy; the ratios of one run are the "
        "meaningful figures. Definitions: `ci/bench/README.md`."
    )
    L += list(floor_notes)
    L.append("")
    L.append("## Targets")
    L.append(
        _table(
            ["target", "case", "measured (median [min–max])", "result", "vs minimum-traffic floor / note"],
            evaluate_targets(cs, fs, rs) + issue_targets(cs, rs, api, plan),
        )
    )
    L.append("")
    L.append("## Memory bandwidth (STREAM-like triad, GB/s)")
    trows = []
    impls = [("ascend-moe", "`ascend-moe bench triad`")]
    worlds_seen = sorted(
        {int(k.rsplit("-", 1)[1]) for t in triad.values() for k in t if k.startswith("cli-collectives-")}
    )
    impls += [
        (f"cli-collectives-{w}", f"`ascend-moe bench collectives --ranks {w}` ({w} threads)") for w in worlds_seen
    ]
    impls.append(("cli-finalize", "`ascend-moe bench finalize` (its own triad)"))
    impls.append(("c-openmp", "`ci/bench/triad.c` (C, OpenMP, all cores)"))
    for impl, label in impls:
        st = Stat([triad[r].get(impl) for r in triad])
        if st.ok:
            trows.append((label, st.fmt()))
    L.append(_table(["triad", "GB/s"], trows) if trows else "not measured")
    L.append("")

    # Collectives: summary at key sizes, then everything.
    worlds = sorted({k[4] for k in cs})
    dtypes = sorted({k[3] for k in cs})
    ops = [o for o in common.COLLECTIVES if any(k[2] == o for k in cs)]
    sizes = sorted({k[5] for k in cs})

    def coll_rows(w, dt, size_filter):
        out = []
        for op in ops:
            for nb in sizes:
                if not size_filter(nb):
                    continue
                th = cs.get(("ascend-moe", "threads", op, dt, w, nb))
                pr = cs.get(("ascend-moe", "procs", op, dt, w, nb))
                mp = cs.get(("openmpi", "procs", op, dt, w, nb))
                gl = cs.get(("gloo", "procs", op, dt, w, nb))
                if not (th or pr or mp or gl):
                    continue

                def g(st, m, spread=True):
                    return st[m].fmt(spread=spread) if st and m in st else "–"

                floor_st = (th or pr or mp or gl or {}).get("floor_busbw_gbps")
                wrong = sum(max(st["wrong"].values, default=0) for st in (th, pr, mp, gl) if st and "wrong" in st)
                out.append(
                    (
                        op,
                        common.fmt_bytes(nb),
                        g(th, "busbw_gbps"),
                        g(pr, "busbw_gbps"),
                        g(mp, "busbw_gbps"),
                        g(gl, "busbw_gbps"),
                        floor_st.fmt(spread=False) if floor_st else "–",
                        g(th, "floor_ratio"),
                        g(pr, "floor_ratio"),
                        g(mp, "floor_ratio"),
                        g(gl, "floor_ratio"),
                        g(th, "vs_peer"),
                        g(pr, "vs_peer"),
                        g(th, "vs_gloo"),
                        g(pr, "vs_gloo"),
                        wrong,
                    )
                )
        return out

    hdr = [
        "op",
        "size",
        "busbw ours thr",
        "busbw ours proc",
        "busbw OpenMPI",
        "busbw gloo",
        "busbw floor",
        "thr/floor",
        "proc/floor",
        "OpenMPI/floor",
        "gloo/floor",
        "thr/OpenMPI",
        "proc/OpenMPI",
        "thr/gloo",
        "proc/gloo",
        "#wrong",
    ]
    if cs:
        L.append("## Collectives (bus bandwidth GB/s, nccl-tests definitions)")
        L.append("")
        L.append(
            "Ratios `a/b` are bus-bandwidth ratios of one run (above 1 = `a` is faster); `x/floor` = floor time "
            "/ time. OpenMPI: `mpi_coll.py`; gloo: `gloo_coll.py` (torch.distributed, process ranks)."
        )
        L.append("")
        key_sizes = {1 * common.MIB, COLL_TARGET_SIZE, 256 * common.MIB}
        for w in worlds:
            for dt in dtypes:
                rows = coll_rows(w, dt, lambda nb: nb in key_sizes)
                if rows:
                    shown = ", ".join(common.fmt_bytes(nb) for nb in sorted(key_sizes) if nb in sizes)
                    L.append(f"### {w} ranks, {dt} ({shown})")
                    L.append(_table(hdr, rows))
                    L.append("")
    if fs:
        L.append("## Finalize (GB/s of bytes moved; floor = triad)")
        frows = []
        for (impl, dt, t, k, h), st in sorted(fs.items(), key=lambda kv: (kv[0][1], kv[0][2] * kv[0][4])):
            if impl != "ascend-moe":
                continue
            np_st = fs.get(("numpy", dt, t, k, h), {})
            frows.append(
                (
                    f"{t}x{k}x{h}",
                    dt,
                    common.fmt_bytes(common.finalize_bytes(t, k, h, dt)),
                    st["gbps"].fmt(),
                    np_st["gbps"].fmt() if np_st else "–",
                    st["floor_ratio"].fmt(),
                    np_st["floor_ratio"].fmt() if np_st else "–",
                    st["vs_peer"].fmt() if "vs_peer" in st else "–",
                )
            )
        if not frows:  # numpy only
            for (impl, dt, t, k, h), st in sorted(fs.items(), key=lambda kv: (kv[0][1], kv[0][2] * kv[0][4])):
                frows.append(
                    (
                        f"{t}x{k}x{h}",
                        dt,
                        common.fmt_bytes(common.finalize_bytes(t, k, h, dt)),
                        "–",
                        st["gbps"].fmt(),
                        "–",
                        st["floor_ratio"].fmt(),
                        "–",
                    )
                )
        L.append(
            _table(
                ["T x K x H", "dtype", "moved", "ours GB/s", "numpy GB/s", "ours/floor", "numpy/floor", "ours/numpy"],
                frows,
            )
        )
        L.append("")
    if rs:
        L.append("## finalize_and_reduce vs finalize + maybe_pad_and_reduce")
        rrows = []
        for (op, dt, t, k, h, w), st in sorted(rs.items()):
            extra = [st["speedup"].fmt() if "speedup" in st else ""]
            extra += [st[m].fmt(spread=False) if m in st else "" for m in ("bound", "ceiling")]
            extra += [st["floor_ratio"].fmt() if "floor_ratio" in st else ""]
            rrows.append((f"{t}x{k}x{h}", dt, w, op, st["time_us"].fmt(), *extra))
        heads = ["T x K x H", "dtype", "ranks", "op", "time (us)", "speedup (unfused / fused)"]
        L.append(_table(heads + ["byte bound (staged)", "byte ceiling (any fused op)", "fused vs floor"], rrows))
        L.append(
            "\nThe bounds are the speedups at equal bandwidth from the bytes each path moves on the slowest rank"
            " (`ReduceBytes` in `src/testing/bench.rs`): the fused op as it runs (its rows computed into the"
            " staging buffers), and the least any fused op can move (every source row read once, every output"
            " row written once). Fused vs floor: the time every rank takes at once to stream the fused op's"
            " bytes through a one-thread triad, over the fused op's time, in the same run (1 = at the floor)."
        )
        L.append("")
    if ds:
        L += decode_section(ds)
    if api:
        L += api_section(api)
    if plot_files or plot_note:
        L.append("## Plots")
        L += [f"![{f}]({f})" for f in plot_files]
        if plot_note:
            L.append(plot_note)
        L.append("")
    if cs:
        L.append("## Collectives, every size")
        L.append("")
        for w in worlds:
            for dt in dtypes:
                rows = coll_rows(w, dt, lambda nb: True)
                if rows:
                    L.append(f"### {w} ranks, {dt}")
                    L.append(_table(hdr, rows))
                    L.append("")
    L.append("## Failures")
    if failures:
        L += [f"- run {f['run']}: {f['step']}: {f['problem']} (`{f['command']}`)" for f in failures]
    else:
        L.append("none")
    L.append("")
    L.append(f"All figures with min and max: `{csv_name}`; raw results of every run: `raw/`.")
    with open(path, "w") as f:
        f.write("\n".join(L) + "\n")


def load_api(raw: str):
    """`raw/api.json` (written by `ci/bench/api.py`), or None."""
    path = os.path.join(raw, "api.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def api_section(api) -> list[str]:
    """The "public API vs kernel" table from `ci/bench/api.py`'s document."""
    L = ["## Public API vs kernel", ""]
    la = tuple(" ".join(f"{v:.2f}" for v in x or ()) for x in (api.get("load_avg"), api.get("load_avg_end")))
    L.append(f"Medians over {len(api.get('finalize', api.get('collectives', {})).get('rounds', []))} rounds "
             f"of `ci/bench/api.py`, the API and the CLI alternating; load average {la[0]} -> {la[1]}.")
    L.append("")
    rows = []
    f = api.get("finalize")
    if f:
        case = f"{f['shape']}, {f['threads']} threads"
        rows.append(("finalize (Python, numpy bf16, `out=`)", case,
                     _num(f["kernel_ms"]), _num(f["python_ms"]), _num(f["python_over_kernel"]),
                     f"{_num(f['floor_over_python'])} (kernel {_num(f['floor_over_kernel'])})"))
        if "python_alloc_ms" in f:
            per_round = [r["floor_s"] / r["python_alloc_s"] for r in f.get("rounds", []) if r.get("python_alloc_s")]
            worst = f", worst round {_num(min(per_round))}" if per_round else ""
            rows.append(("finalize (Python, numpy bf16, allocating)", case, _num(f["kernel_ms"]),
                         _num(f["python_alloc_ms"]), _num(f.get("python_alloc_over_kernel", math.nan)),
                         f"{_num(f.get('floor_over_python_alloc', math.nan))}{worst}"))
    c = api.get("collectives")
    if c:
        for op in common.COLLECTIVES:
            o = c.get(op)
            if not o:
                continue
            case = f"{c['ranks']} procs, {common.fmt_bytes(c['bytes'])}"
            rows.append((f"{op} (Python, numpy bf16, `out=`)", case,
                         _num(o["cli_ms"]), _num(o["python_ms"]), _num(o["python_over_cli"]), ""))
            if "python_alloc_ms" in o:
                rows.append((f"{op} (Python, numpy bf16, allocating)", case,
                             _num(o["cli_ms"]), _num(o["python_alloc_ms"]), _num(o["python_alloc_over_cli"]), ""))
    L.append(_table(["op", "case", "kernel / CLI (ms)", "public API (ms)", "API / kernel", "floor / API"], rows))
    L.append("")
    dec = api.get("finalize_decode")
    if dec:
        L.append("Decode-size finalize through Python (numpy bf16; microseconds, medians over the rounds of the best "
                 "call; kernel = `bench finalize` on the threads a default call uses):")
        L.append("")
        torch_op = any("torch_us" in d for d in dec)
        rows = [(d["shape"], d["threads"], _num(d["kernel_us"]), _num(d["python_us"]), _num(d["python_alloc_us"]),
                 _num(d["python_over_kernel"]), _num(d["python_alloc_over_kernel"]))
                + ((_num(d["torch_us"]), _num(d["torch_over_kernel"])) if "torch_us" in d else ("–", "–")) * torch_op
                for d in dec]
        L.append(_table(["case", "threads", "kernel (us)", "`out=` (us)", "allocating (us)", "`out=` / kernel",
                         "allocating / kernel"] + ["torch op (us)", "torch op / kernel"] * torch_op, rows))
        if torch_op:
            L.append("")
            L.append("torch op: `torch.ops.ascend_moe.moe_finalize_routing` on CPU tensors over the same inputs "
                     "(allocating, as a torch op does), in a process of the python with torch, under `torch.inference_mode()` "
                     "as an engine's forward runs.")
        L.append("")
    return L


def decode_section(ds) -> list[str]:
    """The decode-size latency table: one row per op, H and rows."""
    L = ["## Decode-size latency (microseconds, bf16)", ""]
    L.append(
        f"[rows, H] tensors, {common.DECODE_WORLD} process ranks for the collectives (ours: `bench collectives "
        "--procs`; size = the [rows, H] tensor: reduce_scatter's input, all_gather's output); finalize: T = rows, "
        f"K = {common.DECODE_TOPK}, ours `bench finalize` (the threads a default call uses; best call) against "
        "numpy (best call). Collectives: the "
        "median call, slowest rank. Figures: median [min–max] over runs; `ours/x` = ours time / x's time in "
        "the same run (below 1 = ours is faster)."
    )
    L.append("")
    rows = []
    ops = [o for o in common.COLLECTIVES + ("finalize",) if any(k[1] == o for k in ds)]
    for op in ops:
        for h in sorted({k[2] for k in ds if k[1] == op}):
            for nrows in sorted({k[3] for k in ds if k[1] == op and k[2] == h}):

                def g(impl, m, spread=True):
                    st = ds.get((impl, op, h, nrows))
                    return st[m].fmt(spread=spread) if st and m in st and st[m].ok else "–"

                wrong = sum(
                    max(ds[k]["wrong"].values, default=0)
                    for k in ds
                    if k[1:] == (op, h, nrows) and "wrong" in ds[k]
                )
                rows.append(
                    (
                        op,
                        h,
                        nrows,
                        common.fmt_bytes(nrows * h * common.DTYPE_BYTES["bf16"]),
                        g("ascend-moe", "time_us"),
                        g("gloo", "time_us"),
                        g("openmpi", "time_us"),
                        g("numpy", "time_us"),
                        g("ascend-moe", "over_gloo"),
                        g("ascend-moe", "over_openmpi"),
                        g("ascend-moe", "over_numpy"),
                        wrong if op != "finalize" else "",
                    )
                )
    L.append(
        _table(
            ["op", "H", "rows", "tensor", "ours (us)", "gloo (us)", "OpenMPI (us)", "numpy (us)", "ours/gloo",
             "ours/OpenMPI", "ours/numpy", "#wrong"],
            rows,
        )
    )
    L.append("")
    return L


def load_plan(raw: str) -> dict:
    """What run.py's plans say about the CLI: the union of `cli_missing_ops` over plan-*.json."""
    missing: set[str] = set()
    for path in glob.glob(os.path.join(raw, "plan-*.json")):
        with open(path) as f:
            missing.update(json.load(f).get("cli_missing_ops", []))
    return {"cli_missing_ops": sorted(missing)}


def generate(raw: str, out_dir: str) -> dict:
    docs, failures, meta = load(raw)
    triad, coll, fin, far, dec = build(docs)
    cs = collective_series(triad, coll)
    fs = finalize_series(triad, fin)
    rs = far_series(far)
    ds = decode_series(dec)
    os.makedirs(out_dir, exist_ok=True)
    n_csv = write_csv(os.path.join(out_dir, "results.csv"), cs, fs, rs, ds)
    triad_stat = Stat([run_triad(triad, r) for r in triad])
    plot_files, plot_note = plots(out_dir, cs, fs, triad_stat, ds)
    write_report(
        os.path.join(out_dir, "report.md"),
        meta,
        triad,
        cs,
        fs,
        rs,
        failures,
        plot_files,
        plot_note,
        "results.csv",
        floor_sources(docs),
        api=load_api(raw),
        ds=ds,
        plan=load_plan(raw),
    )
    return {"csv_rows": n_csv, "plots": plot_files, "steps": len(docs), "failures": len(failures)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--raw", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    if not glob.glob(os.path.join(args.raw, "run*", "*.json")):
        print(
            f"error: no results under {args.raw}/run*/ (did every step fail? see {args.raw}/failures.json)",
            file=sys.stderr,
        )
        return 1
    info = generate(args.raw, args.out)
    print(
        f"report: {os.path.join(args.out, 'report.md')} ({info['steps']} results, {info['csv_rows']} CSV rows, "
        f"{len(info['plots'])} plots, {info['failures']} failed steps)",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
