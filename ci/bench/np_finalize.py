"""numpy / ml_dtypes peer for `ascend-moe bench finalize`: the same formula, shapes and bytes.

The benchmarked case (also the CLI's): drop-pad mode 2 (row layout, R(i,k) =
expanded_row_idx[i*K + k], a random permutation of T*K rows), a residual x1 [T, H], f32 scales
[T, K], no x2 and no bias:

    out[i, :] = x1[i, :] + sum_k scales[i, k] * expanded_x[R(i, k), :]

accumulated in f32 in SPEC order (x1 first, then k = 0..K-1) and rounded once to the dtype.
The numpy version is the natural vectorised one: one gather + widen + scale + add per k over
all T rows, with an f32 accumulator; f16 uses numpy's float16, bf16 ml_dtypes' bfloat16.
numpy runs these loops on one thread.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

import common  # noqa: E402


def np_dtype(name: str):
    if name == "f32":
        return np.float32
    if name == "f16":
        return np.float16
    if name == "bf16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    raise ValueError(f"unsupported dtype {name!r}")


def make_inputs(tokens: int, topk: int, hidden: int, dtype: str, seed: int = 0):
    """Random inputs of the benchmarked case (values in [-1, 1), a random permutation)."""
    rng = np.random.default_rng(seed)
    dt = np_dtype(dtype)
    expanded_x = rng.random((tokens * topk, hidden), dtype=np.float32)
    expanded_x -= 0.5
    expanded_x = expanded_x.astype(dt) if dt is not np.float32 else expanded_x
    x1 = (rng.random((tokens, hidden), dtype=np.float32) - 0.5).astype(dt)
    scales = rng.random((tokens, topk), dtype=np.float32)
    row_idx = rng.permutation(tokens * topk).astype(np.int32)
    return expanded_x, x1, scales, row_idx


def finalize(expanded_x, x1, scales, row_idx, out=None):
    """out = x1 + sum_k scales[:, k] * expanded_x[row_idx[i*K + k]] (f32 accumulation)."""
    tokens, topk = scales.shape
    idx = row_idx.reshape(tokens, topk)
    acc = x1.astype(np.float32)
    for k in range(topk):
        rows = np.take(expanded_x, idx[:, k], axis=0)
        rows = rows.astype(np.float32, copy=False)
        rows *= scales[:, k : k + 1]
        acc += rows
    if out is None:
        return acc.astype(x1.dtype, copy=False)
    out[...] = acc
    return out


def bench_shape(tokens: int, topk: int, hidden: int, dtype: str, args) -> dict:
    expanded_x, x1, scales, row_idx = make_inputs(tokens, topk, hidden, dtype)
    out = np.empty_like(x1)
    nbytes = common.finalize_bytes(tokens, topk, hidden, dtype)
    iters = args.iters
    for _ in range(args.warmup):
        finalize(expanded_x, x1, scales, row_idx, out)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        finalize(expanded_x, x1, scales, row_idx, out)
        times.append(time.perf_counter() - t0)
    t = min(times) if args.stat == "best" else common.median(times)
    return {
        "op": "finalize",
        "dtype": dtype,
        "tokens": tokens,
        "topk": topk,
        "hidden": hidden,
        "threads": 1,
        "bytes": nbytes,
        "iters": iters,
        "time_us": t * 1e6,
        "gbps": nbytes / t / 1e9,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=",".join(f"{t}x{k}x{h}" for t, k, h in common.FINALIZE_SHAPES))
    p.add_argument("--dtypes", default="f32,f16,bf16")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument(
        "--stat",
        choices=("best", "median"),
        default="best",
        help="per-call statistic reported (best: as `ascend-moe bench finalize` reports its kernel time)",
    )
    p.add_argument("--out", help="write the JSON here instead of stdout")
    args = p.parse_args()

    rows = []
    for dtype in [d for d in args.dtypes.split(",") if d]:
        for shape in [s for s in args.shapes.split(",") if s]:
            t, k, h = common.parse_shape(shape)
            r = bench_shape(t, k, h, dtype, args)
            rows.append(r)
            print(
                f"  numpy finalize {dtype:<4} {shape:>12}  {r['time_us'] / 1e3:9.2f} ms  {r['gbps']:6.2f} GB/s",
                file=sys.stderr,
                flush=True,
            )
    doc = {"bench": "finalize", "impl": "numpy", "numpy": np.__version__, "rows": rows}
    text = json.dumps(doc, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
