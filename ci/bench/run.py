"""Runs every measurement of ci/bench.sh, `--runs` times, and stores each result as raw JSON.

One run = triad (CLI and C), then per world size and dtype: our collectives (threads, then
processes) immediately followed by OpenMPI on the same sizes, then finalize (ours, numpy),
then finalize_and_reduce. Running the peers right after ours, inside the same run, keeps the
ratios meaningful on a machine whose speed drifts. Each run goes to RAW/run<N>/; the report
(report.py) takes medians over runs afterwards. Progress goes to stderr; a failing step is
reported with its command and the tail of its stderr, recorded in RAW/failures.json, and the
other steps still run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Runner:
    def __init__(self, args):
        self.args = args
        self.failures: list[dict] = []
        self.steps_total = 0
        self.steps_done = 0
        self.t_start = time.time()
        self.durations: dict[str, float] = {}  # step name -> seconds in the first run (for the ETA)
        self.plan_names: list[str] = []

    def run_step(self, run: int, name: str, kind: str, impl: str, cmd: list[str], meta: dict) -> None:
        """Run one command whose stdout is a JSON result; store it (with `meta`) as raw JSON."""
        self.steps_done += 1
        elapsed = time.time() - self.t_start
        eta = ""
        if run > 1 and self.durations:
            i = self.plan_names.index(name)
            left = sum(self.durations.get(n, 0.0) for n in self.plan_names[i:])
            left += (self.args.runs - run) * sum(self.durations.values())
            eta = f", about {left / 60:.0f} min left"
        log(f"[run {run}/{self.args.runs}] [{self.steps_done}/{self.steps_total}] [{elapsed:6.0f}s{eta}] {name}")
        rundir = os.path.join(self.args.raw, f"run{run}")
        os.makedirs(rundir, exist_ok=True)
        base = os.path.join(rundir, name.replace(" ", "_").replace("/", "-"))
        t0 = time.time()
        try:
            with open(base + ".stderr", "w") as err:
                proc = subprocess.run(
                    cmd, stdout=subprocess.PIPE, stderr=err, text=True, timeout=self.args.step_timeout
                )
            rc, out = proc.returncode, proc.stdout
        except subprocess.TimeoutExpired as e:
            rc, out = "timeout", (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        except OSError as e:
            rc, out = f"cannot start: {e}", ""
        seconds = time.time() - t0
        if run == 1:
            self.durations[name] = seconds
        with open(base + ".out", "w") as f:
            f.write(out)
        problem = None
        rows: list[dict] = []
        header: dict = {}
        try:
            header, rows = common.parse_result_text(out)
        except (ValueError, json.JSONDecodeError) as e:
            problem = f"unreadable output ({e}); stdout kept in {base}.out"
        if not problem and not rows:
            problem = f"no result rows; stdout kept in {base}.out"
        if rc != 0:
            # Rows of a failed command are kept when they parse (a CLI exits 1 on wrong elements).
            problem = f"exit status {rc}" + (f" (its {len(rows)} rows are kept)" if rows else "")
        if problem:
            self.report_failure(run, name, problem, cmd, base)
        if rows:
            self.store(run, name, kind, impl, cmd, meta, header, rows, seconds, base)
            log(f"  done in {seconds:.1f}s ({len(rows)} rows)")

    def report_failure(self, run, name, problem, cmd, base):
        tail = ""
        try:
            with open(base + ".stderr") as f:
                tail = "".join(f.readlines()[-15:])
        except OSError:
            pass
        log(f"  FAILED: {name}: {problem}\n  command: {shlex.join(cmd)}\n  stderr tail ({base}.stderr):\n{tail}")
        self.failures.append({"run": run, "step": name, "problem": problem, "command": shlex.join(cmd)})

    def store(self, run, name, kind, impl, cmd, meta, header, rows, seconds, base):
        doc = {
            "kind": kind,
            "impl": impl,
            "run": run,
            "step": name,
            "command": shlex.join(cmd),
            "seconds": seconds,
            "header": header,
            "rows": [dict(meta, **r) for r in rows],
        }
        with open(base + ".json", "w") as f:
            json.dump(doc, f, indent=1)


def cli_help(binary: str | None, sub: str) -> str | None:
    """The text of `ascend-moe bench <sub> --help`; None if the subcommand does not exist
    (its --help fails)."""
    if not binary:
        return None
    try:
        r = subprocess.run([binary, "bench", sub, "--help"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if r.returncode != 0:
        return None
    return r.stdout + r.stderr


def cli_flags(binary: str | None, sub: str) -> set[str] | None:
    """The long flags that `ascend-moe bench <sub> --help` lists; None if the subcommand
    does not exist."""
    text = cli_help(binary, sub)
    return None if text is None else set(re.findall(r"--[a-z][a-z0-9-]*", text))


def pick(flags: set[str], *alternatives: list[tuple[str, object]]) -> list[str]:
    """The first alternative (a list of (flag, value or None)) whose flags the CLI has, as
    arguments; [] when it has none of them (the CLI's default then applies)."""
    for alt in alternatives:
        if all(f in flags for f, _ in alt):
            return [x for f, v in alt for x in ((f,) if v is None else (f, str(v)))]
    return []


# T*K*H from which a finalize_and_reduce shape gets --fin-iters timed calls (4096x8x4096).
FAR_FULL_ITERS_FROM = 4096 * 8 * 4096


def far_iters(shape: str, fin_iters: int) -> int:
    """Timed calls of the finalize_and_reduce shape `shape` (`TxKxH`; "" when the CLI takes every shape
    in one call): `fin_iters` from FAR_FULL_ITERS_FROM up, and up to 8x more below it. A call of a few
    milliseconds on ranks that share 2 cores is timed as its slowest rank's best call, and 5 calls were
    too few: at 1024x8x2048 one binary gave a speedup of 0.85-1.72 over six runs of 5 calls, and
    1.12-1.25 over six runs of 40."""
    if not shape.strip():
        return fin_iters
    t, k, h = common.parse_shape(shape.strip())
    return fin_iters * max(1, min(8, FAR_FULL_ITERS_FROM // (t * k * h)))


def ladders(sizes: list[int], factor: int) -> list[list[int]]:
    """Sorted sizes cut into runs s, s*factor, s*factor^2, ... (what --min/--max-bytes can ask for)."""
    out: list[list[int]] = []
    for s in sorted(sizes):
        if out and s == out[-1][-1] * factor:
            out[-1].append(s)
        else:
            out.append([s])
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--raw", required=True, help="directory for raw results")
    p.add_argument("--bin", default="", help="the ascend-moe binary ('' = skip our benches)")
    p.add_argument("--python", default=sys.executable, help="python with numpy, ml_dtypes, mpi4py")
    p.add_argument("--mpirun", default="", help="mpirun ('' = skip the OpenMPI peer)")
    p.add_argument("--triad-bin", default="", help="the compiled C triad ('' = skip)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--worlds", default="2,4,8")
    p.add_argument("--transports", default="threads,procs")
    p.add_argument("--ops", default=",".join(common.COLLECTIVES))
    p.add_argument("--dtypes", default="f32,bf16", help="collective dtypes")
    p.add_argument("--min-bytes", type=common.parse_bytes, default=common.parse_bytes("1K"))
    p.add_argument("--max-bytes", type=common.parse_bytes, default=common.parse_bytes("256M"))
    p.add_argument("--step-factor", type=int, default=2)
    p.add_argument(
        "--max-bytes-world",
        default="",
        help="per-world caps on the largest size, e.g. 8=64M (default: none, every world to --max-bytes)",
    )
    p.add_argument("--iters", type=int, default=10, help="timed calls per size below 16 MiB")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls per size below 16 MiB (1 above)")
    p.add_argument("--large-iters", type=int, default=3, help="timed calls per size from 16 MiB on")
    p.add_argument("--fin-iters", type=int, default=5, help="timed finalize calls (after one warmup)")
    p.add_argument("--shapes", default=",".join(f"{t}x{k}x{h}" for t, k, h in common.FINALIZE_SHAPES))
    p.add_argument("--fin-dtypes", default="f32,f16,bf16")
    p.add_argument("--far-world", type=int, default=4)
    p.add_argument("--far-shapes", default=",".join(f"{t}x{k}x{h}" for t, k, h in common.FINALIZE_SHAPES))
    p.add_argument("--far-dtypes", default="f32,f16,bf16")
    p.add_argument("--mpi-bf16-reduce", default="f32", choices=("f32", "userop"))
    p.add_argument(
        "--cli-extra-ops",
        default=",".join(common.CLI_ONLY_COLLECTIVES),
        help="collectives only ours run, added to --ops when `bench collectives --help` names them",
    )
    p.add_argument("--torch-python", default="", help="python with torch for the gloo peer ('' = skip gloo)")
    p.add_argument("--gloo-worlds", default="4", help="world sizes the gloo peer runs (of --worlds)")
    p.add_argument("--decode-iters", type=int, default=20, help="timed calls per case of the decode table")
    p.add_argument(
        "--skip", default="", help="comma list of: triad,collectives,mpi,gloo,finalize,numpy,far,decode"
    )
    p.add_argument("--step-timeout", type=float, default=3600.0)
    args = p.parse_args()

    skip = {s for s in args.skip.split(",") if s}
    parts = {"triad", "collectives", "mpi", "gloo", "finalize", "numpy", "far", "decode"}
    if skip - parts:
        p.error(f"--skip {args.skip}: unknown part(s) {', '.join(sorted(skip - parts))} (parts: {', '.join(sorted(parts))})")
    if args.runs < 1:
        p.error(f"--runs {args.runs}: must be at least 1 (the report takes medians over runs)")
    worlds = [int(w) for w in args.worlds.split(",") if w]
    transports = [t for t in args.transports.split(",") if t]
    dtypes = [d for d in args.dtypes.split(",") if d]
    fin_dtypes = [d for d in args.fin_dtypes.split(",") if d]
    shapes = [s for s in args.shapes.split(",") if s]
    far_shapes = [s for s in args.far_shapes.split(",") if s]
    for s in shapes + far_shapes:
        common.parse_shape(s)
    sizes = common.size_ladder(args.min_bytes, args.max_bytes, args.step_factor, extra=[32 * common.MIB])
    caps = {}
    for item in [i for i in args.max_bytes_world.split(",") if i]:
        w_text, _, cap = item.partition("=")
        caps[int(w_text)] = common.parse_bytes(cap)

    def world_sizes(w):
        return [s for s in sizes if s <= min(args.max_bytes, caps.get(w, args.max_bytes))]

    def size_classes(w):
        """The sizes of world w split into (small, large) by the iteration rule, with their
        (iters, warmup): the CLI is called once per non-empty class."""
        ws = world_sizes(w)
        small = [s for s in ws if s < common.LARGE]
        large = [s for s in ws if s >= common.LARGE]
        return [
            (c, common.iterations(c[0], args.iters, args.large_iters), common.warmups(c[0], args.warmup))
            for c in (small, large)
            if c
        ]

    binary = args.bin or None
    subs = ("triad", "collectives", "finalize", "finalize_and_reduce")
    helps = {sub: cli_help(binary, sub) for sub in subs}
    flags = {sub: None if t is None else set(re.findall(r"--[a-z][a-z0-9-]*", t)) for sub, t in helps.items()}
    # Ours run every op of --ops plus those of --cli-extra-ops that the CLI's help names.
    extra_ops = [o for o in args.cli_extra_ops.split(",") if o and o not in args.ops.split(",")]
    coll_help = helps["collectives"] or ""
    cli_missing_ops = [o for o in extra_ops if not re.search(rf"\b{o}\b", coll_help)]
    ours_ops = ",".join([o for o in args.ops.split(",") if o] + [o for o in extra_ops if o not in cli_missing_ops])
    if binary and helps["collectives"] is not None and cli_missing_ops:
        log(f"note: `bench collectives` does not offer {', '.join(cli_missing_ops)}")
    gloo_worlds = {int(w) for w in args.gloo_worlds.split(",") if w}
    if binary:
        for sub in subs:
            if flags[sub] is None:
                log(f"note: `{os.path.basename(binary)} bench {sub}` is not available: skipping its part")
    py = args.python
    r = Runner(args)
    os.makedirs(args.raw, exist_ok=True)

    def cli(sub, *parts):
        return [binary, "bench", sub, *[x for p in parts for x in p]]

    def out_format(fl):
        return pick(fl, [("--json", None)], [("--csv", None)])

    def dtype_flag(fl, dt):
        return pick(fl, [("--dtypes", dt)], [("--dtype", dt)])

    def iter_flags(fl, iters, warmup):
        return pick(fl, [("--iters", iters)]) + pick(fl, [("--warmup", warmup)])

    def size_flags(fl, cls):
        """Sizes of one class: an explicit list, or the ladder between its ends."""
        lo, hi = cls[0], cls[-1]
        return pick(
            fl,
            [("--sizes", ",".join(map(str, cls)))],
            [("--min-bytes", lo), ("--max-bytes", hi), ("--step-factor", args.step_factor)],
            [("--min-bytes", lo), ("--max-bytes", hi), ("--factor", args.step_factor)],
        )

    def per_shape(fl, shape_list, world=None):
        """[(label, args)]: one call with --shapes, or one call per shape with --tokens/--top-k/--hidden
        (finalize_and_reduce: the T tokens split evenly over DP = world / TP ranks, TP = 2)."""
        if "--shapes" in fl:
            return [("", ["--shapes", ",".join(shape_list)])]
        out = []
        for sh in shape_list:
            t, k, h = common.parse_shape(sh)
            tokens = [("--tokens", t)]
            if world is not None and "--dp-tokens" in fl:
                tp = 2 if world % 2 == 0 else 1
                dp = world // tp
                tokens = [("--dp-tokens", ",".join(str(t // dp + (i < t % dp)) for i in range(dp))), ("--tp", tp)]
            kh = [("--hidden", h)]
            out.append((f" {sh}", pick(fl, tokens + [("--topk", k)] + kh, tokens + [("--top-k", k)] + kh)))
        return out

    # The step list of one run (name, kind, impl, command, meta); the same for every run.
    plan: list[tuple[str, str, str, list[str], dict]] = []
    if "triad" not in skip:
        if flags["triad"] is not None:
            plan.append(("triad ascend-moe", "triad", "ascend-moe", cli("triad", out_format(flags["triad"])), {}))
        if args.triad_bin:
            plan.append(("triad c-openmp", "triad", "c-openmp", [args.triad_bin, "128", "10"], {}))
    fl = flags["collectives"]
    mpirun = [args.mpirun, "--allow-run-as-root", "--oversubscribe", "--mca", "btl", "self,vader"]
    mpirun += ["--mca", "mpi_yield_when_idle", "1"]
    for w in worlds:
        for dt in dtypes:
            if "collectives" not in skip and fl is not None:
                for tr in transports:
                    if tr == "procs" and "--procs" not in fl:
                        log("note: `bench collectives` has no --procs: processes are skipped")
                        continue
                    calls = [
                        (chunk, iters, warmup)
                        for cls, iters, warmup in size_classes(w)
                        for chunk in (ladders(cls, args.step_factor) if "--sizes" not in fl else [cls])
                    ]
                    for cls, iters, warmup in calls:
                        cmd = cli(
                            "collectives",
                            pick(fl, [("--ranks", w)]),
                            ["--procs"] if tr == "procs" else [],
                            pick(fl, [("--ops", ours_ops)]),
                            dtype_flag(fl, dt),
                            size_flags(fl, cls),
                            iter_flags(fl, iters, warmup),
                            out_format(fl),
                        )
                        name = f"collectives ascend-moe w{w} {tr} {dt} {common.fmt_bytes(cls[0]).replace(' ', '')}+"
                        meta = {"impl": "ascend-moe", "world": w, "transport": tr, "dtype": dt}
                        plan.append((name, "collectives", "ascend-moe", cmd, meta))
            if "mpi" not in skip and args.mpirun:
                cmd = [*mpirun, "-np", str(w), py, os.path.join(HERE, "mpi_coll.py"), "--ops", args.ops]
                cmd += ["--dtype", dt, "--sizes", ",".join(map(str, world_sizes(w))), "--iters", str(args.iters)]
                cmd += ["--warmup", str(args.warmup), "--large-iters", str(args.large_iters)]
                cmd += ["--bf16-reduce", args.mpi_bf16_reduce]
                meta = {"impl": "openmpi", "world": w, "transport": "procs"}
                plan.append((f"collectives openmpi w{w} {dt}", "collectives", "openmpi", cmd, meta))
            if "gloo" not in skip and args.torch_python and w in gloo_worlds:
                cmd = [args.torch_python, os.path.join(HERE, "gloo_coll.py"), "--world", str(w), "--ops", args.ops]
                cmd += ["--dtype", dt, "--sizes", ",".join(map(str, world_sizes(w))), "--iters", str(args.iters)]
                cmd += ["--warmup", str(args.warmup), "--large-iters", str(args.large_iters)]
                meta = {"impl": "gloo", "world": w, "transport": "procs"}
                plan.append((f"collectives gloo w{w} {dt}", "collectives", "gloo", cmd, meta))
    fl = flags["finalize"]
    for dt in fin_dtypes:
        if "finalize" not in skip and fl is not None:
            for label, shape_args in per_shape(fl, shapes):
                cmd = cli("finalize", shape_args, dtype_flag(fl, dt), iter_flags(fl, args.fin_iters, 1), out_format(fl))
                plan.append((f"finalize ascend-moe {dt}{label}", "finalize", "ascend-moe", cmd, {"dtype": dt}))
        if "numpy" not in skip:
            cmd = [py, os.path.join(HERE, "np_finalize.py"), "--shapes", ",".join(shapes), "--dtypes", dt]
            cmd += ["--iters", str(args.fin_iters), "--warmup", "1"]
            plan.append((f"finalize numpy {dt}", "finalize", "numpy", cmd, {}))
    fl = flags["finalize_and_reduce"]
    if "far" not in skip and fl is not None and far_shapes:
        for dt in [d for d in args.far_dtypes.split(",") if d]:
            for label, shape_args in per_shape(fl, far_shapes, args.far_world):
                cmd = cli(
                    "finalize_and_reduce",
                    pick(fl, [("--ranks", args.far_world)]) if "--dp-tokens" not in fl else [],
                    shape_args,
                    dtype_flag(fl, dt),
                    iter_flags(fl, far_iters(label, args.fin_iters), 1),
                    out_format(fl),
                )
                meta = {"world": args.far_world, "dtype": dt}
                name = f"finalize_and_reduce ascend-moe w{args.far_world} {dt}{label}"
                plan.append((name, "finalize_and_reduce", "ascend-moe", cmd, meta))

    if "decode" not in skip:
        # Decode-size latency: [rows, H] bf16 for rows in DECODE_ROWS, 4 process ranks, every
        # implementation on the same sizes (one ladder of factor 4 per H); finalize at T = rows.
        dw, it = common.DECODE_WORLD, args.decode_iters
        fl = flags["collectives"]
        for h in common.DECODE_HIDDEN:
            sz = common.decode_sizes(h)
            meta = {"world": dw, "transport": "procs", "dtype": "bf16", "hidden": h}
            if "collectives" not in skip and fl is not None and "--procs" in fl:
                cmd = cli(
                    "collectives",
                    pick(fl, [("--ranks", dw)]),
                    ["--procs"],
                    pick(fl, [("--ops", args.ops)]),
                    dtype_flag(fl, "bf16"),
                    pick(
                        fl,
                        [("--sizes", ",".join(map(str, sz)))],
                        [("--min-bytes", sz[0]), ("--max-bytes", sz[-1]), ("--factor", 4)],
                        [("--min-bytes", sz[0]), ("--max-bytes", sz[-1]), ("--step-factor", 4)],
                    ),
                    iter_flags(fl, it, 2),
                    out_format(fl),
                )
                plan.append((f"decode ascend-moe H{h}", "decode_collectives", "ascend-moe", cmd, meta))
        # The peers take a size list: one call for both H (each size names its [rows, H]:
        # common.decode_shape), so gloo spawns and imports torch once.
        sz = sorted(s for h in common.DECODE_HIDDEN for s in common.decode_sizes(h))
        meta = {"world": dw, "transport": "procs", "dtype": "bf16"}
        peer_args = ["--ops", args.ops, "--dtype", "bf16", "--sizes", ",".join(map(str, sz))]
        peer_args += ["--iters", str(it), "--warmup", "2", "--large-iters", str(it)]
        if "mpi" not in skip and args.mpirun:
            cmd = [*mpirun, "-np", str(dw), py, os.path.join(HERE, "mpi_coll.py"), *peer_args]
            cmd += ["--bf16-reduce", args.mpi_bf16_reduce]
            plan.append(("decode openmpi", "decode_collectives", "openmpi", cmd, meta))
        if "gloo" not in skip and args.torch_python:
            cmd = [args.torch_python, os.path.join(HERE, "gloo_coll.py"), "--world", str(dw), *peer_args]
            plan.append(("decode gloo", "decode_collectives", "gloo", cmd, meta))
        fl = flags["finalize"]
        dshapes = [f"{r}x{common.DECODE_TOPK}x{h}" for h in common.DECODE_HIDDEN for r in common.DECODE_ROWS]
        if "finalize" not in skip and fl is not None:
            for label, shape_args in per_shape(fl, dshapes):
                cmd = cli("finalize", shape_args, dtype_flag(fl, "bf16"), iter_flags(fl, it, 2), out_format(fl))
                name = f"decode finalize ascend-moe{label}"
                plan.append((name, "decode_finalize", "ascend-moe", cmd, {"dtype": "bf16"}))
        if "numpy" not in skip:
            cmd = [py, os.path.join(HERE, "np_finalize.py"), "--shapes", ",".join(dshapes), "--dtypes", "bf16"]
            cmd += ["--iters", str(it), "--warmup", "2"]
            plan.append(("decode finalize numpy", "decode_finalize", "numpy", cmd, {}))

    if not plan:
        log("error: nothing to measure (no CLI bench, no peer enabled)")
        return 2
    r.steps_total = len(plan) * args.runs
    r.plan_names = [name for name, _, _, _, _ in plan]
    log(
        f"{len(plan)} steps per run x {args.runs} runs; sizes {common.fmt_bytes(sizes[0])} .. "
        f"{common.fmt_bytes(sizes[-1])} ({len(sizes)}); worlds {worlds}"
    )
    with open(os.path.join(args.raw, f"plan-{time.strftime('%H%M%S')}.json"), "w") as f:
        json.dump(
            {
                "runs": args.runs,
                "sizes": sizes,
                "worlds": worlds,
                "cli": {k: sorted(v or []) for k, v in flags.items()},
                "cli_ops": ours_ops.split(",") if flags["collectives"] is not None else [],
                "cli_missing_ops": cli_missing_ops if flags["collectives"] is not None else [],
                "steps": [shlex.join(c) for _, _, _, c, _ in plan],
            },
            f,
            indent=1,
        )
    for run in range(1, args.runs + 1):
        for name, kind, impl, cmd, meta in plan:
            r.run_step(run, name, kind, impl, cmd, meta)
    fpath = os.path.join(args.raw, "failures.json")
    earlier = []
    if os.path.exists(fpath):  # an earlier part of the same report (ci/bench.sh --keep-raw)
        with open(fpath) as f:
            earlier = json.load(f)
    with open(fpath, "w") as f:
        json.dump(earlier + r.failures, f, indent=1)
    log(f"measurements done in {time.time() - r.t_start:.0f}s, {len(r.failures)} failed step(s)")
    return 1 if r.failures else 0


if __name__ == "__main__":
    sys.exit(main())
