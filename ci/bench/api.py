"""The public API against the kernel, measured in one run: the Python package
(ctypes over the C ABI, numpy buffers passed without copies) against
`ascend-moe bench finalize` and `ascend-moe bench collectives --procs`.

Finalize (the CLI's case: mode 2, f32 scales, x1): every round runs the
CLI (kernel time and its same-run triad floor), the Python op on the same
shape and threads, and the CLI again: the host's bandwidth drifts between
processes, and the two CLI runs bracket the Python calls. The round's
kernel time is the mean of the two runs', its floor the finalize's bytes
over the mean of their triad bandwidths. The op writes into a reused
`out=` array and allocates its output, call for call in turn; each form is
the best of its `--iters` calls, and the report gives the medians over
`--rounds` rounds of: kernel, floor, Python (`out=`), Python (allocating),
Python / kernel and floor / Python (both forms; every round keeps its own
floor / Python, and the worst allocating round is given).

Decode-size finalize (`--decode-tokens`, default 1 and 16 rows of the same
K and H): the same two forms against the CLI's kernel, both on the threads a
default call uses (the CLI without `--threads`), best of `--decode-iters`
calls each, medians over the rounds in microseconds: what the package adds to
a call whose kernel takes microseconds. With `--torch-python` (a python with
torch), every round also times `torch.ops.ascend_moe.moe_finalize_routing`
on CPU tensors over the same inputs (allocating, as a torch op does), in a
process of that python, under `torch.inference_mode()` as an engine's forward
runs: what an engine calling the registered op pays.

Collectives: `--ranks` Python processes, each a rank of one CPU world, time
all_reduce, reduce_scatter and all_gather of `--bytes` per rank (bf16; the
reduce_scatter output and all_gather's per-rank input are bytes / ranks, as
the CLI sizes them) with a barrier before each call,
once into a reused `out=` array (as the CLI reuses its destination) and once
allocating the result, each form after one untimed call of its own (as the
CLI warms up);
a call's time is the slowest rank's, and the median call is reported (as
the CLI does). Rounds alternate with
`ascend-moe bench collectives --procs` at the same size.

Prints one JSON document (and a table on stderr). Needs numpy and ml_dtypes,
ASCEND_MOE_BIN the release binary (or --bin), and ASCEND_MOE_LIB naming the
release libascend_moe.so (default: the one beside the binary). A Python rank
that dies fails the run at once, with its error on stderr.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import subprocess
import sys
import time
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))

import numpy as np  # noqa: E402

import common  # noqa: E402
import np_finalize  # noqa: E402


def median(xs):
    return common.median(list(xs))


def cli_json(cmd: list[str]) -> list[dict]:
    """The rows of a `bench ... --json` document (`rows` or `results`)."""
    doc = json.loads(subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout)
    return doc.get("rows") or doc.get("results") or []


def python_finalize_s(inputs, iters: int) -> tuple[float, float]:
    """Best call times of the Python op, `(out=, allocating)`: `iters` calls of
    each, alternating. The `out=` form writes the same array every call (as
    an engine reusing its buffers does), the other allocates its output every
    call. Alternating keeps both forms on the same machine: a host that
    changes speed during the timing changes both, not the one timed then."""
    import ascend_moe

    expanded_x, x1, scales, row_idx = inputs
    alloc = dict(x1=x1, scales=scales, drop_pad_mode=2)
    reuse = dict(alloc, out=ascend_moe.moe_finalize_routing(expanded_x, row_idx, **alloc))  # also a warm-up
    ascend_moe.moe_finalize_routing(expanded_x, row_idx, **alloc)  # the allocating form's warm-up
    best = [float("inf"), float("inf")]
    for _ in range(iters):
        for i, args in enumerate((reuse, alloc)):
            t0 = time.perf_counter()
            ascend_moe.moe_finalize_routing(expanded_x, row_idx, **args)
            best[i] = min(best[i], time.perf_counter() - t0)
    return best[0], best[1]


def finalize_cmd(a, tokens: int, iters: int, extra=()) -> list[str]:
    """`ascend-moe bench finalize --json` on bf16 `[tokens, --topk, --hidden]`."""
    cmd = [a.bin, "bench", "finalize", "--tokens", str(tokens), "--top-k", str(a.topk), "--hidden", str(a.hidden)]
    return cmd + ["--dtype", "bf16", *extra, "--iters", str(iters), "--json"]


def bench_finalize(a) -> dict:
    inputs = np_finalize.make_inputs(a.tokens, a.topk, a.hidden, "bf16")
    cmd = finalize_cmd(a, a.tokens, a.iters, ["--threads", str(a.threads)])
    rounds = []
    for _ in range(a.rounds):
        # The CLI runs before and after the Python op's calls (this host's
        # bandwidth drifts between one process and the next). The round's
        # floor is the bytes over the mean of the two runs' triad bandwidths
        # (the harmonic mean of their floor times), as `bench collectives`
        # brackets its rows with the triad; its kernel time the mean of theirs.
        before = cli_json(cmd)[0]
        py, alloc = python_finalize_s(inputs, a.iters)
        after = cli_json(cmd)[0]
        fb, fa = before["floor_us"] / 1e6, after["floor_us"] / 1e6
        kb, ka = before["time_us"] / 1e6, after["time_us"] / 1e6
        rounds.append(
            {
                "kernel_s": (kb + ka) / 2,
                "floor_s": 2 / (1 / fb + 1 / fa),
                "kernel_before_s": kb,
                "kernel_after_s": ka,
                "floor_before_s": fb,
                "floor_after_s": fa,
                "python_s": py,
                "python_alloc_s": alloc,
            }
        )
    for r in rounds:
        r["floor_over_python"] = r["floor_s"] / r["python_s"]
        r["floor_over_python_alloc"] = r["floor_s"] / r["python_alloc_s"]
    med = {k: median(r[k] for r in rounds) for k in ("kernel_s", "floor_s", "python_s", "python_alloc_s")}
    return {
        "op": "finalize",
        "shape": f"{a.tokens}x{a.topk}x{a.hidden}",
        "threads": a.threads,
        "rounds": rounds,
        "kernel_ms": med["kernel_s"] * 1e3,
        "floor_ms": med["floor_s"] * 1e3,
        "python_ms": med["python_s"] * 1e3,
        "python_alloc_ms": med["python_alloc_s"] * 1e3,
        "python_over_kernel": median(r["python_s"] / r["kernel_s"] for r in rounds),
        "python_alloc_over_kernel": median(r["python_alloc_s"] / r["kernel_s"] for r in rounds),
        "floor_over_python": median(r["floor_over_python"] for r in rounds),
        "floor_over_python_alloc": median(r["floor_over_python_alloc"] for r in rounds),
        "floor_over_python_alloc_min": min(r["floor_over_python_alloc"] for r in rounds),
        "floor_over_kernel": median(r["floor_s"] / r["kernel_s"] for r in rounds),
    }


def torch_finalize_s(tokens: int, topk: int, hidden: int, iters: int) -> float:
    """Best call time of `torch.ops.ascend_moe.moe_finalize_routing` on CPU
    tensors over `np_finalize.make_inputs` (run in a python with torch), under
    `torch.inference_mode()`, as vLLM's model runners run a forward
    (`execute_model`)."""
    import torch

    import ascend_moe

    if not ascend_moe.TORCH_OPS:
        raise SystemExit(f"torch ops unavailable: {ascend_moe.TORCH_OPS_ERROR}")
    expanded_x, x1, scales, row_idx = np_finalize.make_inputs(tokens, topk, hidden, "bf16")

    def bf16(a):
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)

    args = (bf16(expanded_x), torch.from_numpy(row_idx), bf16(x1), None, None, torch.from_numpy(scales), None, 2)
    op = torch.ops.ascend_moe.moe_finalize_routing
    best = float("inf")
    with torch.inference_mode():
        op(*args)  # warm-up
        for _ in range(iters):
            t0 = time.perf_counter()
            op(*args)
            best = min(best, time.perf_counter() - t0)
    return best


def torch_finalize_in(python: str, tokens: int, a) -> float:
    """`torch_finalize_s` in a process of `python` (this one's library and threads)."""
    cmd = [python, os.path.abspath(__file__), "--torch-finalize", str(tokens), "--topk", str(a.topk)]
    cmd += ["--hidden", str(a.hidden), "--decode-iters", str(a.decode_iters)]
    env = dict(os.environ, ASCEND_MOE_TORCH="1")
    out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True, env=env).stdout
    return float(out.split()[-1])


def bench_finalize_decode(a) -> list[dict]:
    """Decode-size finalize: the Python op (`out=` and allocating, and the
    torch op with `--torch-python`) against the CLI's kernel on the threads a
    default call uses, per row count."""
    res = []
    forms = ("kernel_s", "python_s", "python_alloc_s") + (("torch_s",) if a.torch_python else ())
    for tokens in a.decode_tokens:
        inputs = np_finalize.make_inputs(tokens, a.topk, a.hidden, "bf16")
        cmd = finalize_cmd(a, tokens, a.decode_iters)
        rounds = []
        for _ in range(a.rounds):
            r = cli_json(cmd)[0]
            py, alloc = python_finalize_s(inputs, a.decode_iters)
            rounds.append({"kernel_s": r["time_us"] / 1e6, "threads": r["threads"], "python_s": py, "python_alloc_s": alloc})
            if a.torch_python:
                rounds[-1]["torch_s"] = torch_finalize_in(a.torch_python, tokens, a)
        res.append(
            {
                "shape": f"{tokens}x{a.topk}x{a.hidden}",
                "threads": rounds[0]["threads"],
                "rounds": rounds,
                **{f"{k[:-2]}_us": median(r[k] for r in rounds) * 1e6 for k in forms},
                **{
                    f"{k[:-2]}_over_kernel": median(r[k] / r["kernel_s"] for r in rounds)
                    for k in forms
                    if k != "kernel_s"
                },
            }
        )
    return res


OPS = ("all_reduce", "reduce_scatter", "all_gather")


def _rank(name, world, rank, nbytes, iters, q):
    import ml_dtypes

    import ascend_moe

    comm = ascend_moe.Comm.cpu(name, world, rank)
    n = nbytes // 2
    n -= n % world
    x = np.full(n, rank + 1, dtype=ml_dtypes.bfloat16)
    g = np.full(n // world, rank + 1, dtype=ml_dtypes.bfloat16)
    times = {(op, how): [] for op in OPS for how in ("out", "alloc")}
    for op, arg in (("all_reduce", x), ("reduce_scatter", x), ("all_gather", g)):
        fn = getattr(ascend_moe, op)
        out = fn(arg, comm)  # warm-up; its result is the reused `out=` array
        for how in ("out", "alloc"):
            if how == "alloc":
                # The allocating form's own warm-up, dropped at once: its block is
                # what the timed calls reuse, as every later call of an engine's
                # loop does. Without it the first timed call maps and faults a
                # new block (0.1-0.35 s for 8-32 MiB on a freshly booted VM,
                # whose host backs each guest page on first touch), which
                # decided the median of a 5-call row.
                fn(arg, comm)
            for _ in range(iters):
                comm.barrier()
                t0 = time.perf_counter()
                if how == "out":
                    fn(arg, comm, out=out)
                else:
                    fn(arg, comm)
                times[(op, how)].append(time.perf_counter() - t0)
    q.put((rank, times))


def _results(procs, q, deadline_s) -> list:
    """One result per process from `q`; fails as soon as a process died
    without one (its traceback is on stderr) or the deadline passed."""
    got, end = [], time.monotonic() + deadline_s
    while len(got) < len(procs):
        try:
            got.append(q.get(timeout=1.0))
        except queue.Empty:
            dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"Python ranks died (rank, exit code): {dead}; see their errors above") from None
            if time.monotonic() > end:
                raise RuntimeError(f"Python ranks did not finish within {deadline_s} s") from None
    return got


def python_collectives(a) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    name = f"bench-api-{uuid.uuid4().hex[:12]}"
    procs = [ctx.Process(target=_rank, args=(name, a.ranks, r, a.bytes, a.iters, q)) for r in range(a.ranks)]
    for p in procs:
        p.start()
    try:
        per_rank = _results(procs, q, deadline_s=600)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
            p.join()
    out = {}
    for key in per_rank[0][1]:
        # Per call, the slowest rank; then the median call (as the CLI reports).
        calls = zip(*[t[key] for _, t in per_rank])
        out[key] = median(max(c) for c in calls)
    return out


def cli_collectives(a) -> dict:
    cmd = [a.bin, "bench", "collectives", "--procs", "--ranks", str(a.ranks), "--ops", ",".join(OPS)]
    cmd += ["--dtype", "bf16", "--iters", str(a.iters), "--json"]
    cmd += ["--min-bytes", str(a.bytes), "--max-bytes", str(a.bytes)]
    docs = cli_json(cmd)
    return {d["op"]: d["time_us"] / 1e6 for d in docs if d.get("op") in OPS}


def bench_collectives(a) -> dict:
    rounds = []
    for _ in range(a.rounds):
        c = cli_collectives(a)
        p = python_collectives(a)
        rounds.append(
            {
                op: {"cli_s": c[op], "python_s": p[(op, "out")], "python_alloc_s": p[(op, "alloc")]}
                for op in OPS
            }
        )
    res = {"ranks": a.ranks, "bytes": a.bytes, "rounds": rounds}
    for op in OPS:
        res[op] = {
            "cli_ms": median(r[op]["cli_s"] for r in rounds) * 1e3,
            "python_ms": median(r[op]["python_s"] for r in rounds) * 1e3,
            "python_alloc_ms": median(r[op]["python_alloc_s"] for r in rounds) * 1e3,
            "python_over_cli": median(r[op]["python_s"] / r[op]["cli_s"] for r in rounds),
            "python_alloc_over_cli": median(r[op]["python_alloc_s"] / r[op]["cli_s"] for r in rounds),
        }
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bin", default=os.environ.get("ASCEND_MOE_BIN"), help="the release ascend-moe binary")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--bytes", type=int, default=32 << 20, help="bytes per rank of the collectives")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--decode-tokens", type=lambda s: [int(t) for t in s.split(",") if t], default=[1, 16])
    p.add_argument("--decode-iters", type=int, default=200)
    p.add_argument("--skip", default="", help="finalize,decode,collectives")
    p.add_argument("--torch-python", help="a python with torch: the decode table adds the torch op")
    p.add_argument("--torch-finalize", type=int, metavar="TOKENS", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.torch_finalize is not None:  # the torch op's timing, in a process of --torch-python
        print(torch_finalize_s(a.torch_finalize, a.topk, a.hidden, a.decode_iters))
        return 0
    if not a.bin:
        p.error("--bin or ASCEND_MOE_BIN is required")
    beside = os.path.join(os.path.dirname(os.path.abspath(a.bin)), "libascend_moe.so")
    if "ASCEND_MOE_LIB" not in os.environ and os.path.exists(beside):
        os.environ["ASCEND_MOE_LIB"] = beside  # the Python ranks inherit it
    os.environ["ASCEND_MOE_NUM_THREADS"] = str(a.threads)
    os.environ.setdefault("ASCEND_MOE_TORCH", "0")
    doc = {"load_avg": os.getloadavg()}
    if "finalize" not in a.skip:
        f = bench_finalize(a)
        doc["finalize"] = f
        print(
            f"finalize {f['shape']} bf16, {f['threads']} threads: kernel {f['kernel_ms']:.2f} ms, "
            f"python out= {f['python_ms']:.2f} ms ({f['python_over_kernel']:.3f}x kernel), "
            f"python allocating {f['python_alloc_ms']:.2f} ms ({f['python_alloc_over_kernel']:.3f}x; floor / it "
            f"{f['floor_over_python_alloc']:.3f}, worst round {f['floor_over_python_alloc_min']:.3f}), "
            f"floor {f['floor_ms']:.2f} ms: python {f['floor_over_python']:.3f} of floor "
            f"(kernel {f['floor_over_kernel']:.3f})",
            file=sys.stderr,
        )
    if "decode" not in a.skip:
        doc["finalize_decode"] = bench_finalize_decode(a)
        for d in doc["finalize_decode"]:
            print(
                f"finalize {d['shape']} bf16, {d['threads']} thread(s): kernel {d['kernel_us']:.1f} us, "
                f"python out= {d['python_us']:.1f} us, allocating {d['python_alloc_us']:.1f} us"
                + (f", torch op {d['torch_us']:.1f} us" if "torch_us" in d else ""),
                file=sys.stderr,
            )
    if "collectives" not in a.skip:
        c = bench_collectives(a)
        doc["collectives"] = c
        for op in OPS:
            o = c[op]
            print(
                f"{op} {a.ranks} procs bf16 {a.bytes >> 20} MiB: cli {o['cli_ms']:.2f} ms, "
                f"python out= {o['python_ms']:.2f} ms ({o['python_over_cli']:.3f}x), "
                f"python allocating {o['python_alloc_ms']:.2f} ms ({o['python_alloc_over_cli']:.3f}x)",
                file=sys.stderr,
            )
    doc["load_avg_end"] = os.getloadavg()
    json.dump(doc, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
