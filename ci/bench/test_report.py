"""Tests of the report generator on synthetic results (standard library only; the plot check
runs when matplotlib is installed, the numpy-peer check when numpy is).

    python3 -m unittest -v test_report      (from ci/bench/), or: pytest ci/bench
"""

from __future__ import annotations

import csv
import json
import os
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
import report  # noqa: E402

MIB = 1024 * 1024
S32 = 32 * MIB


def _write(raw, run, name, kind, impl, rows, header=None):
    d = os.path.join(raw, f"run{run}")
    os.makedirs(d, exist_ok=True)
    doc = {
        "kind": kind,
        "impl": impl,
        "run": run,
        "step": name,
        "command": "synthetic",
        "seconds": 1.0,
        "header": header or {},
        "rows": rows,
    }
    with open(os.path.join(d, name + ".json"), "w") as f:
        json.dump(doc, f)


def coll_row(op, dtype, world, nbytes, busbw, transport, floor_us=None, wrong=0):
    """A row as the CLI / mpi_coll.py write it, consistent with busbw."""
    algbw = busbw / common.bus_factor(op, world)
    time_us = nbytes / (algbw * 1e3)
    r = {
        "op": op,
        "dtype": dtype,
        "world": world,
        "transport": transport,
        "bytes": nbytes,
        "count": nbytes // 2,
        "iters": 3,
        "time_us": time_us,
        "algbw_gbps": algbw,
        "busbw_gbps": busbw,
        "wrong": wrong,
    }
    if floor_us is not None:
        r["floor_us"] = floor_us
        r["floor_ratio"] = floor_us / time_us
    return r


class SyntheticReport(unittest.TestCase):
    """Three runs with known numbers; every expected value is computed here by hand."""

    # Per run: ours (threads) all_reduce busbw, OpenMPI busbw, our floor time (us).
    OURS = [10.0, 12.0, 11.0]
    MPI = [1.0, 2.0, 4.0]
    FLOOR_US = [5000.0, 5000.0, 6000.0]
    TRIAD = [20.0, 18.0, 22.0]
    FIN_OURS_US = [20000.0, 25000.0, 21000.0]
    FIN_NUMPY_US = [400000.0, 300000.0, 420000.0]
    FUSED_US = [100.0, 90.0, 110.0]
    UNFUSED_US = [150.0, 99.0, 110.0]
    FUSED_VS_FLOOR = [0.9, 0.8, 0.95]

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        raw = os.path.join(cls.tmp.name, "raw")
        cls.out = os.path.join(cls.tmp.name, "out")
        for i in range(3):
            run = i + 1
            _write(raw, run, "triad", "triad", "ascend-moe", [{"bench": "triad", "gbps": cls.TRIAD[i]}])
            ours = [
                coll_row("all_reduce", "bf16", 4, S32, cls.OURS[i], "threads", floor_us=cls.FLOOR_US[i]),
                coll_row("reduce_scatter", "bf16", 4, S32, 8.0, "threads", floor_us=2000.0),
                coll_row("all_gather", "bf16", 4, S32, 8.0, "threads", floor_us=2000.0, wrong=run - 1),
            ]
            _write(raw, run, "ours", "collectives", "ascend-moe", ours)
            mpi = [
                coll_row("all_reduce", "bf16", 4, S32, cls.MPI[i], "procs"),
                coll_row("reduce_scatter", "bf16", 4, S32, 1.0, "procs"),
            ]
            _write(raw, run, "mpi", "collectives", "openmpi", mpi)
            fin = {"op": "finalize", "dtype": "bf16", "tokens": 4096, "topk": 8, "hidden": 4096}
            nb = common.finalize_bytes(4096, 8, 4096, "bf16")
            _write(
                raw,
                run,
                "fin",
                "finalize",
                "ascend-moe",
                [dict(fin, time_us=cls.FIN_OURS_US[i], gbps=nb / cls.FIN_OURS_US[i] / 1e3, triad_gbps=cls.TRIAD[i])],
            )
            _write(raw, run, "np", "finalize", "numpy", [dict(fin, time_us=cls.FIN_NUMPY_US[i])])
            far = {"dtype": "bf16", "tokens": 4096, "topk": 8, "hidden": 4096, "world": 4}
            _write(
                raw,
                run,
                "far",
                "finalize_and_reduce",
                "ascend-moe",
                [
                    dict(
                        far,
                        op="finalize_and_reduce",
                        time_us=cls.FUSED_US[i],
                        bound=1.1461,
                        ceiling=1.4234,
                        fused_vs_floor=cls.FUSED_VS_FLOOR[i],
                    ),
                    dict(far, op="finalize_then_pad_reduce", time_us=cls.UNFUSED_US[i]),
                ],
            )
        with open(os.path.join(raw, "failures.json"), "w") as f:
            json.dump(
                [
                    {
                        "run": 2,
                        "step": "collectives ascend-moe w8 procs bf16",
                        "problem": "exit status 1",
                        "command": "x",
                    }
                ],
                f,
            )
        cls.info = report.generate(raw, cls.out)
        with open(os.path.join(cls.out, "results.csv")) as f:
            cls.csv = list(csv.DictReader(f))
        with open(os.path.join(cls.out, "report.md")) as f:
            cls.md = f.read()

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def assertAlmostEqual(self, got, want, msg=None):  # noqa: N802 - the CSV keeps 6 significant digits
        self.assertLessEqual(abs(got - want), 1e-5 * max(abs(want), 1e-12), msg or f"{got} != {want}")

    def assertNotAlmostEqual(self, got, want, msg=None):  # noqa: N802
        self.assertGreater(abs(got - want), 1e-5 * max(abs(want), 1e-12), msg or f"{got} == {want}")

    def row(self, **sel):
        hits = [r for r in self.csv if all(r[k] == str(v) for k, v in sel.items())]
        self.assertEqual(len(hits), 1, f"{sel}: {len(hits)} rows")
        return hits[0]

    def test_median_min_max(self):
        r = self.row(suite="collectives", impl="ascend-moe", op="all_reduce", world=4, bytes=S32)
        self.assertAlmostEqual(float(r["busbw_gbps_median"]), 11.0)
        self.assertAlmostEqual(float(r["busbw_gbps_min"]), 10.0)
        self.assertAlmostEqual(float(r["busbw_gbps_max"]), 12.0)
        self.assertEqual(r["runs"], "3")

    def test_ratio_to_peer_is_per_run(self):
        r = self.row(suite="collectives", impl="ascend-moe", op="all_reduce", world=4, bytes=S32)
        per_run = sorted(o / m for o, m in zip(self.OURS, self.MPI))  # 10, 6, 2.75
        self.assertAlmostEqual(float(r["vs_peer_median"]), per_run[1])
        self.assertAlmostEqual(float(r["vs_peer_min"]), per_run[0])
        self.assertAlmostEqual(float(r["vs_peer_max"]), per_run[2])
        # The median of the ratio is not the ratio of the medians (11 / 2 = 5.5).
        self.assertNotAlmostEqual(float(r["vs_peer_median"]), 5.5)

    def test_peer_uses_our_floor_of_the_same_run(self):
        r = self.row(suite="collectives", impl="openmpi", op="all_reduce", world=4, bytes=S32)
        f = common.bus_factor("all_reduce", 4)
        ratios = sorted(fl / (S32 / (m / f * 1e3)) for fl, m in zip(self.FLOOR_US, self.MPI))
        self.assertAlmostEqual(float(r["floor_ratio_median"]), ratios[1])
        ours = self.row(suite="collectives", impl="ascend-moe", op="all_reduce", world=4, bytes=S32)
        ours_ratios = sorted(fl / (S32 / (o / f * 1e3)) for fl, o in zip(self.FLOOR_US, self.OURS))
        self.assertAlmostEqual(float(ours["floor_ratio_median"]), ours_ratios[1])

    def test_finalize_floor_and_numpy(self):
        r = self.row(suite="finalize", impl="ascend-moe", dtype="bf16", tokens=4096)
        nb = common.finalize_bytes(4096, 8, 4096, "bf16")
        self.assertEqual(nb, 4096 * 8 * 4096 * 2 + 2 * 4096 * 4096 * 2 + 4096 * 8 * 8)
        floor = sorted(nb / (g * 1e3) / t for g, t in zip(self.TRIAD, self.FIN_OURS_US))
        self.assertAlmostEqual(float(r["floor_ratio_median"]), floor[1])
        vs = sorted(n / o for n, o in zip(self.FIN_NUMPY_US, self.FIN_OURS_US))
        self.assertAlmostEqual(float(r["vs_peer_median"]), vs[1])

    def test_fused_speedup(self):
        r = self.row(suite="finalize_and_reduce", op="finalize_and_reduce")
        sp = sorted(u / f for u, f in zip(self.UNFUSED_US, self.FUSED_US))  # 1.5, 1.1, 1.0
        self.assertAlmostEqual(float(r["speedup_median"]), sp[1])

    def test_fused_byte_bounds(self):
        r = self.row(suite="finalize_and_reduce", op="finalize_and_reduce")
        self.assertAlmostEqual(float(r["bound_median"]), 1.1461)
        self.assertAlmostEqual(float(r["ceiling_max"]), 1.4234)
        row = [ln for ln in self.md.splitlines() if ln.startswith("| fused finalize+reduce-scatter") and "4 ranks" in ln]
        self.assertEqual(len(row), 1, self.md)
        self.assertIn("bytes allow 1.15 staged, 1.42 for any fused op; fused at 0.9 of its same-run floor", row[0])
        self.assertIn("| 1.1 [1–1.5] | 1.15 | 1.42 | 0.9 [0.8–0.95] |", self.md)
        self.assertAlmostEqual(float(r["floor_ratio_median"]), 0.9)
        self.assertAlmostEqual(float(r["floor_ratio_min"]), 0.8)

    def test_targets_and_failures_in_markdown(self):
        lines = {
            ln.split("|")[1].strip() + "/" + ln.split("|")[2].strip(): ln
            for ln in self.md.splitlines()
            if ln.startswith("| ") and ln.count("|") == 6
        }
        # 6x OpenMPI (median) >= 5: reached; speedup 1.1 < 1.3: not reached; procs: not measured.
        self.assertIn("**reached**", lines["all_reduce 4 ranks bf16 [4096,4096] >= 5x OpenMPI busbw/threads"])
        self.assertIn(
            "not reached", lines["finalize_and_reduce bf16 4096x8x4096 >= 1.3x finalize + maybe_pad_and_reduce/4 ranks"]
        )
        self.assertIn("not measured", lines["all_reduce 4 ranks bf16 [4096,4096] >= 5x OpenMPI busbw/procs"])
        vs = sorted(n / o for n, o in zip(self.FIN_NUMPY_US, self.FIN_OURS_US))[1]  # 15.2
        self.assertIn("**reached**" if vs >= 15 else "not reached", lines["finalize bf16 4096x8x4096 >= 15x numpy/"])
        self.assertIn("- collectives floor: the CLI's own", self.md)
        self.assertIn("- finalize floor: T*K*H*e", self.md)
        self.assertIn("| `ascend-moe bench finalize` (its own triad) | 20 [18–22] |", self.md)
        self.assertIn("collectives ascend-moe w8 procs bf16", self.md)
        self.assertIn("exit status 1", self.md)

    def test_minimum_traffic_floor_uses_the_row_triad(self):
        r = self.row(suite="collectives", impl="ascend-moe", op="all_reduce", world=4, bytes=S32)
        f = common.bus_factor("all_reduce", 4)
        # The rows carry no triad of their own: the run's triad (bench triad) is used, 2 n S bytes.
        want = sorted(2 * 4 * S32 / (g * 1e3) / (S32 / (o / f * 1e3)) for g, o in zip(self.TRIAD, self.OURS))
        self.assertAlmostEqual(float(r["min_floor_ratio_median"]), want[1])

    def test_wrong_elements_are_reported(self):
        r = self.row(suite="collectives", impl="ascend-moe", op="all_gather", world=4, bytes=S32)
        self.assertEqual(r["wrong"], "2")

    def test_plots(self):
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            self.skipTest("matplotlib not installed")
        for name in ("collective_all_reduce_bf16.png", "finalize.png"):
            path = os.path.join(self.out, name)
            self.assertTrue(os.path.getsize(path) > 1000, name)
            with open(path, "rb") as f:
                self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")
            self.assertIn(f"]({name})", self.md)


def _target_lines(md):
    """Target table rows of report.md keyed by "target/case"."""
    return {
        ln.split("|")[1].strip() + "/" + ln.split("|")[2].strip(): ln
        for ln in md.splitlines()
        if ln.startswith("| ") and ln.count("|") == 6
    }


class ApiGlooDecodeReport(unittest.TestCase):
    """Public API rounds, the CLI's own floor, gloo beside OpenMPI, the fused op at two shapes and
    the decode-size table, on synthetic input whose expected values are worked out here."""

    FLOOR_S = 0.1
    PY_S = [0.105, 0.1, 0.12]  # floor / time: 0.952, 1.0, 0.833 -> median 0.952 >= 0.9
    ALLOC_S = [0.1, 0.11, 0.2]  # 1.0, 0.909, 0.5 -> median 0.909 >= 0.85, worst round 0.5 < 0.85
    # Python time / CLI time per round, per op and form.
    API_RATIO = {
        ("all_reduce", "python_s"): [1.0, 1.05, 1.2],  # median 1.05 <= 1.1: reached
        ("all_reduce", "python_alloc_s"): [1.5, 1.4, 1.6],  # not reached
        ("reduce_scatter", "python_s"): [1.2, 1.3, 1.25],  # not reached
        ("reduce_scatter", "python_alloc_s"): [1.0, 1.0, 1.0],
        ("all_gather", "python_s"): [1.0, 1.0, 1.0],
        ("all_gather", "python_alloc_s"): [1.1, 1.0, 1.05],  # median 1.05: reached
    }
    VS_FLOOR = {"all_reduce": 0.73, "reduce_scatter": 0.95, "all_gather": 0.97, "all_to_all": 0.85}
    OURS_AR = [10.0, 12.0, 11.0]  # busbw, procs
    GLOO_AR = [2.0, 4.0, 1.0]  # ours / gloo: 5, 3, 11 -> median 5
    FAR = {(4096, 8, 4096): ([200.0, 190.0, 210.0], 100.0), (1024, 8, 2048): ([16.0, 14.0, 12.0], 10.0)}
    DEC_OURS = [10.0, 12.0, 11.0]  # all_reduce H=4096 rows=16, us
    DEC_GLOO = [100.0, 60.0, 110.0]  # ours / gloo: 0.1, 0.2, 0.1 -> median 0.1
    DEC_MPI = [20.0, 24.0, 44.0]  # 0.5, 0.5, 0.25 -> median 0.5

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        raw = os.path.join(cls.tmp.name, "raw")
        cls.out = os.path.join(cls.tmp.name, "out")
        for i in range(3):
            run = i + 1
            ours = []
            for op, vf in cls.VS_FLOOR.items():
                busbw = cls.OURS_AR[i] if op == "all_reduce" else 8.0
                r = coll_row(op, "bf16", 4, S32, busbw, "procs")
                r["floor_us"] = vf * r["time_us"]
                r["vs_floor"] = vf
                ours.append(r)
            _write(raw, run, "ours", "collectives", "ascend-moe", ours)
            gloo = [coll_row("all_reduce", "bf16", 4, S32, cls.GLOO_AR[i], "procs")]
            _write(raw, run, "gloo", "collectives", "gloo", gloo)
            far_rows = []
            for (t, k, h), (unfused, fused) in cls.FAR.items():
                base = {"dtype": "bf16", "tokens": t, "topk": k, "hidden": h, "world": 4}
                far_rows.append(dict(base, op="finalize_and_reduce", time_us=fused))
                far_rows.append(dict(base, op="finalize_then_pad_reduce", time_us=unfused[i]))
            _write(raw, run, "far", "finalize_and_reduce", "ascend-moe", far_rows)
            nb = 16 * 4096 * 2
            for impl, us in (("ascend-moe", cls.DEC_OURS), ("gloo", cls.DEC_GLOO), ("openmpi", cls.DEC_MPI)):
                row = coll_row("all_reduce", "bf16", 4, nb, 1.0, "procs", wrong=1 if impl == "gloo" else 0)
                row.update(time_us=us[i])
                _write(raw, run, f"decode_{impl}", "decode_collectives", impl, [row])
            fin = {"op": "finalize", "dtype": "bf16", "tokens": 4, "topk": 8, "hidden": 7168}
            _write(raw, run, "decfin", "decode_finalize", "ascend-moe", [dict(fin, time_us=30.0)])
            _write(raw, run, "decfin_np", "decode_finalize", "numpy", [dict(fin, time_us=300.0)])
        api = {
            "load_avg": [1.0, 1.0, 1.0],
            "load_avg_end": [1.0, 1.0, 1.0],
            "finalize": {
                "shape": "4096x8x4096",
                "threads": 2,
                "kernel_ms": 90.0,
                "python_ms": 105.0,
                "python_alloc_ms": 110.0,
                "python_over_kernel": 1.1,
                "python_alloc_over_kernel": 1.2,
                "floor_over_python": 0.95,
                "floor_over_kernel": 1.0,
                "rounds": [
                    {"kernel_s": 0.09, "floor_s": cls.FLOOR_S, "python_s": p, "python_alloc_s": a}
                    for p, a in zip(cls.PY_S, cls.ALLOC_S)
                ],
            },
            "finalize_decode": [
                {"shape": "1x8x4096", "threads": 1, "kernel_us": 4.0, "python_us": 20.0, "python_alloc_us": 30.0,
                 "python_over_kernel": 5.0, "python_alloc_over_kernel": 7.5, "torch_us": 26.0,
                 "torch_over_kernel": 6.5, "rounds": []},
                {"shape": "16x8x4096", "threads": 1, "kernel_us": 10.0, "python_us": 30.0, "python_alloc_us": 40.0,
                 "python_over_kernel": 3.0, "python_alloc_over_kernel": 4.0, "rounds": []},
            ],
            "collectives": {
                "ranks": 4,
                "bytes": S32,
                "rounds": [
                    {
                        op: {"cli_s": 0.01, "python_s": 0.01 * cls.API_RATIO[(op, "python_s")][i],
                             "python_alloc_s": 0.01 * cls.API_RATIO[(op, "python_alloc_s")][i]}
                        for op in common.COLLECTIVES
                    }
                    for i in range(3)
                ],
            },
        }
        for op in common.COLLECTIVES:
            api["collectives"][op] = {"cli_ms": 10.0, "python_ms": 10.0, "python_alloc_ms": 10.0,
                                      "python_over_cli": 1.0, "python_alloc_over_cli": 1.0}
        with open(os.path.join(raw, "api.json"), "w") as f:
            json.dump(api, f)
        cls.API = api
        with open(os.path.join(raw, "plan-000000.json"), "w") as f:
            json.dump({"cli_missing_ops": ["broadcast"]}, f)
        report.generate(raw, cls.out)
        with open(os.path.join(cls.out, "results.csv")) as f:
            cls.csv = list(csv.DictReader(f))
        with open(os.path.join(cls.out, "report.md")) as f:
            cls.md = f.read()
        cls.lines = _target_lines(cls.md)

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def target(self, prefix, case):
        hits = [v for k, v in self.lines.items() if k.startswith(prefix) and k.endswith("/" + case)]
        self.assertEqual(len(hits), 1, f"{prefix} / {case}: {len(hits)} rows")
        return hits[0]

    def test_finalize_through_python_uses_each_round(self):
        ln = self.target("finalize bf16 4096x8x4096 via Python, `out=`", "4096x8x4096, 2 threads, 3 rounds")
        med = sorted(self.FLOOR_S / p for p in self.PY_S)[1]
        self.assertIn(f"| {report._num(med)} [", ln)
        self.assertIn("**reached**", ln)
        # Allocating: the median round passes 0.85, the worst (0.5) does not: not reached.
        ln = self.target("the same, allocating", "4096x8x4096, 2 threads, 3 rounds")
        self.assertGreaterEqual(sorted(self.FLOOR_S / a for a in self.ALLOC_S)[1], 0.85)
        self.assertIn("not reached", ln)
        self.assertIn("worst round 0.5", ln)

    def test_decode_finalize_through_python(self):
        self.assertIn("Decode-size finalize through Python", self.md)
        self.assertIn("| allocating / kernel | torch op (us) | torch op / kernel |", self.md)
        self.assertIn("| 1x8x4096 | 1 | 4 | 20 | 30 | 5 | 7.5 | 26 | 6.5 |", self.md)
        self.assertIn("| 16x8x4096 | 1 | 10 | 30 | 40 | 3 | 4 | – | – |", self.md)  # a row without the torch op
        # Without any torch op timing (no --torch-python) the table has no torch columns.
        api = {"finalize_decode": [dict(d) for d in self.API["finalize_decode"]]}
        for d in api["finalize_decode"]:
            d.pop("torch_us", None)
        md = "\n".join(report.api_section(api))
        self.assertIn("| 1x8x4096 | 1 | 4 | 20 | 30 | 5 | 7.5 |\n", md)
        self.assertNotIn("torch op", md)

    def test_python_collectives_against_the_cli(self):
        for op, key, ok in (
            ("all_reduce", "`out=`", True),
            ("all_reduce", "allocating", False),
            ("reduce_scatter", "`out=`", False),
            ("all_gather", "allocating", True),
        ):
            ln = self.target(f"Python collectives, {key}", f"{op}, 4 procs, 32 MiB")
            self.assertIn("**reached**" if ok else "not reached", ln, (op, key))

    def test_cli_floor_targets_and_a_missing_op(self):
        for op, vf in self.VS_FLOOR.items():
            ln = self.target("CLI ", f"{op} procs")
            self.assertIn("**reached**" if vf >= 0.9 else "not reached", ln, op)
            self.assertIn(f"| {report._num(vf)} [{report._num(vf)}–{report._num(vf)}] |", ln)
        self.assertIn("not measured", self.target("CLI ", "all_to_all threads"))
        self.assertIn("`bench collectives` has no broadcast", self.target("CLI ", "broadcast procs"))

    def test_fused_at_every_shape(self):
        self.assertIn("**reached**", self.target("fused finalize+reduce-scatter", "4096x8x4096 bf16, 4 ranks"))
        self.assertIn("not reached", self.target("fused finalize+reduce-scatter", "1024x8x2048 bf16, 4 ranks"))
        ln = self.target("fused finalize+reduce-scatter", "all 2 shapes")
        self.assertIn("| 1.4 |", ln)  # the worst shape's median: 16/10, 14/10, 12/10
        self.assertIn("not reached", ln)

    def test_gloo_beside_openmpi(self):
        r = [x for x in self.csv if x["suite"] == "collectives" and x["impl"] == "ascend-moe"
             and x["op"] == "all_reduce"]
        self.assertEqual(len(r), 1)
        per_run = sorted(o / g for o, g in zip(self.OURS_AR, self.GLOO_AR))
        self.assertAlmostEqual(float(r[0]["vs_gloo_median"]), per_run[1])
        self.assertAlmostEqual(float(r[0]["vs_gloo_min"]), per_run[0])
        g = [x for x in self.csv if x["suite"] == "collectives" and x["impl"] == "gloo"]
        self.assertEqual(len(g), 1)
        # gloo is measured against our floor time of the same run: floor ratio = ours_ratio * ours_t / gloo_t.
        f = common.bus_factor("all_reduce", 4)
        times = [(S32 / (o / f * 1e3), S32 / (gl / f * 1e3)) for o, gl in zip(self.OURS_AR, self.GLOO_AR)]
        want = sorted(0.73 * ours_t / gloo_t for ours_t, gloo_t in times)
        self.assertAlmostEqual(float(g[0]["floor_ratio_median"]), want[1])
        self.assertIn("| busbw gloo |", self.md.replace("busbw OpenMPI | busbw gloo", "| busbw gloo"))
        self.assertIn("proc/gloo", self.md)

    def test_decode_table(self):
        (line,) = [ln for ln in self.md.splitlines() if ln.startswith("| all_reduce | 4096 | 16 |")]
        cells = [c.strip() for c in line.split("|")[1:-1]]
        self.assertEqual(cells[3], "128 KiB")
        self.assertEqual(cells[4], "11 [10–12]")
        over_gloo = sorted(o / g for o, g in zip(self.DEC_OURS, self.DEC_GLOO))
        self.assertEqual(cells[8], report._num(over_gloo[1]) + " [0.1–0.2]")
        self.assertTrue(cells[9].startswith(report._num(sorted(o / m for o, m in zip(self.DEC_OURS, self.DEC_MPI))[1])))
        self.assertEqual(cells[11], "1")  # gloo's wrong element is counted
        (fin,) = [ln for ln in self.md.splitlines() if ln.startswith("| finalize | 7168 | 4 |")]
        self.assertEqual([c.strip() for c in fin.split("|")[1:-1]][10], "0.1 [0.1–0.1]")
        d = [x for x in self.csv if x["suite"] == "decode" and x["impl"] == "gloo"]
        self.assertEqual((len(d), d[0]["bytes"], d[0]["wrong"]), (1, str(16 * 4096 * 2), "1"))

    def test_plots_include_gloo_and_decode(self):
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            self.skipTest("matplotlib not installed")
        for name in ("collective_all_reduce_bf16.png", "decode_latency.png"):
            with open(os.path.join(self.out, name), "rb") as f:
                self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")
            self.assertIn(f"]({name})", self.md)

    def assertAlmostEqual(self, got, want, msg=None):  # noqa: N802 - the CSV keeps 6 significant digits
        self.assertLessEqual(abs(got - want), 1e-5 * max(abs(want), 1e-12), msg or f"{got} != {want}")


class GlooPeer(unittest.TestCase):
    def test_expected_values_are_the_sum_of_the_inputs(self):
        try:
            import torch

            import gloo_coll
        except ImportError:
            self.skipTest("torch not installed")
        # v_r[i] = r + 1 + (first + i) % 7; over 3 ranks from element 5: i % 7 = 5, 6, 0, 1.
        got = gloo_coll._reduced(torch, 4, 3, 5, torch.bfloat16).tolist()
        self.assertEqual(got, [3 * 5 + 6, 3 * 6 + 6, 0 + 6, 3 + 6])
        total = sum(gloo_coll._values(torch, 4, r, 5, torch.float32) for r in range(3))
        self.assertEqual(total.tolist(), got)


class Definitions(unittest.TestCase):
    def test_bus_factors_match_nccl_tests(self):
        self.assertEqual(common.bus_factor("all_reduce", 4), 1.5)
        self.assertEqual(common.bus_factor("reduce_scatter", 8), 7 / 8)
        self.assertEqual(common.bus_factor("all_gather", 2), 0.5)
        self.assertEqual(common.bus_factor("all_to_all", 4), 0.75)
        self.assertEqual(common.bus_factor("broadcast", 4), 1.0)
        with self.assertRaises(ValueError):
            common.bus_factor("scatter", 4)

    def test_floor_bytes(self):
        self.assertEqual(common.collective_floor_bytes("all_reduce", 100, 4), 800)
        self.assertEqual(common.collective_floor_bytes("reduce_scatter", 100, 4), 500)
        self.assertEqual(common.collective_floor_bytes("all_gather", 100, 4), 500)
        self.assertEqual(common.collective_floor_bytes("all_to_all", 100, 4), 800)
        self.assertEqual(common.collective_floor_bytes("broadcast", 100, 4), 400)
        self.assertEqual(common.decode_sizes(4096), [8192, 32768, 131072, 524288])
        self.assertEqual(common.decode_sizes(7168), [14336, 57344, 229376, 917504])
        self.assertEqual(common.decode_shape(57344), (4, 7168))
        self.assertEqual(common.decode_shape(524288), (64, 4096))
        self.assertIsNone(common.decode_shape(65536))

    def test_ladder_iterations_sizes(self):
        ladder = common.size_ladder(common.parse_bytes("1K"), common.parse_bytes("256M"), 2, extra=[S32])
        self.assertEqual(len(ladder), 19)
        self.assertEqual((ladder[0], ladder[-1]), (1024, 256 * MIB))
        self.assertIn(S32, ladder)
        self.assertEqual(common.iterations(256 * MIB, 10, 3), 3)
        self.assertEqual(common.iterations(16 * MIB, 10, 3), 3)
        self.assertEqual(common.iterations(16 * MIB - 1, 10, 3), 10)
        self.assertEqual((common.warmups(1024, 2), common.warmups(32 * MIB, 2)), (2, 1))
        self.assertEqual(common.element_count("all_gather", 1000, 8, 4), 248)
        with self.assertRaises(ValueError):
            common.parse_bytes("12X")
        with self.assertRaises(ValueError):
            common.parse_shape("4096x8")

    def test_ladders_for_a_cli_without_size_lists(self):
        import run

        m = MIB
        self.assertEqual(run.ladders([m, 4 * m, 16 * m, 32 * m, 64 * m], 4), [[m, 4 * m, 16 * m], [32 * m], [64 * m]])
        self.assertEqual(run.ladders([4, 1, 2], 2), [[1, 2, 4]])

    def test_small_fused_shapes_get_more_calls(self):
        import run

        # T*K*H: 2^27 at 4096x8x4096 (5 calls), 2^24 at 1024x8x2048 (8x, the cap), 2^26 at 2048x8x4096 (2x).
        self.assertEqual(run.far_iters(" 4096x8x4096", 5), 5)
        self.assertEqual(run.far_iters(" 8192x8x7168", 5), 5)
        self.assertEqual(run.far_iters(" 1024x8x2048", 5), 40)
        self.assertEqual(run.far_iters(" 2048x8x4096", 5), 10)
        self.assertEqual(run.far_iters(" 16x8x4096", 3), 24)
        self.assertEqual(run.far_iters("", 5), 5)

    def test_reader_accepts_header_and_synonyms(self):
        text = json.dumps(
            {
                "bench": "collectives",
                "world": 4,
                "transport": "procs",
                "triad": {"gbps": 19.5},
                "rows": [{"op": "all_reduce", "dtype": "f32", "size": "1024", "busbw": 1.5, "time": 2.0}],
            }
        )
        header, rows = common.parse_result_text(text)
        self.assertEqual(rows[0]["bytes"], 1024)
        self.assertEqual(rows[0]["busbw_gbps"], 1.5)
        self.assertEqual(rows[0]["world"], 4)
        self.assertEqual(rows[0]["transport"], "procs")
        self.assertEqual(rows[0]["triad_gbps"], 19.5)
        lines = "\n".join(json.dumps({"op": "finalize", "time_us": t}) for t in (1, 2))
        self.assertEqual([r["time_us"] for r in common.parse_result_text(lines)[1]], [1, 2])
        wip = {
            "staging_bytes": 1,
            "triad": [{"ranks": 2, "gbps": 9.0}, {"ranks": 4, "gbps": 8.0}],
            "results": [{"ranks": 4, "op": "all_gather", "bytes": 4096, "vs_floor": 0.5}],
        }
        (row,) = common.parse_result_text(json.dumps(wip))[1]
        self.assertEqual((row["world"], row["floor_ratio"], row["triad_gbps"]), (4, 0.5, 8.0))
        csv_rows = common.parse_result_text("ranks,op,bytes,time_us\n2,all_reduce,1024,3.5\n")[1]
        self.assertEqual((csv_rows[0]["world"], csv_rows[0]["bytes"], csv_rows[0]["time_us"]), (2, 1024, 3.5))
        triad = common.parse_result_text('{"bench": "triad", "gbps": 20.5}')[1]
        self.assertEqual(triad, [{"op": "triad", "gbps": 20.5}])
        with self.assertRaises(ValueError):
            common.parse_result_text("")


class NumpyPeer(unittest.TestCase):
    def test_finalize_matches_a_naive_loop(self):
        try:
            import numpy as np

            import np_finalize
        except ImportError:
            self.skipTest("numpy not installed")
        t, k, h = 5, 3, 7
        for dtype in ("f32", "f16", "bf16"):
            try:
                ex, x1, sc, idx = np_finalize.make_inputs(t, k, h, dtype, seed=1)
            except ImportError:
                continue  # ml_dtypes missing
            got = np_finalize.finalize(ex, x1, sc, idx).astype(np.float64)
            for i in range(t):
                for j in range(h):
                    acc = float(x1[i, j])
                    for kk in range(k):
                        acc += float(sc[i, kk]) * float(ex[idx[i * k + kk], j])
                    tol = {"f32": 1e-5, "f16": 2e-3, "bf16": 1.6e-2}[dtype] * max(1.0, abs(acc))
                    self.assertLessEqual(abs(got[i, j] - acc), tol, (dtype, i, j))


class RunArguments(unittest.TestCase):
    def _run(self, *args):
        import subprocess

        with tempfile.TemporaryDirectory() as raw:
            here = os.path.dirname(os.path.abspath(__file__))
            cmd = [sys.executable, os.path.join(here, "run.py"), "--raw", raw, *args]
            return subprocess.run(cmd, capture_output=True, text=True, timeout=60)

    def test_runs_under_one_and_unknown_parts_are_refused_naming_them(self):
        r = self._run("--runs", "0")
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("--runs 0: must be at least 1", r.stderr)
        r = self._run("--skip", "triad,colectives")
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("unknown part(s) colectives", r.stderr)


if __name__ == "__main__":
    unittest.main()
