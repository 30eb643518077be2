"""gloo peer for `ascend-moe bench collectives`: torch.distributed with the gloo backend, the
same collectives, sizes and iteration rule, N process ranks on this host, nccl-tests
definitions of time, algbw, busbw (as mpi_coll.py).

    python gloo_coll.py --world 4 --dtype bf16 --sizes 1024,33554432 [--out result.json]

The ranks are spawned processes (torch.multiprocessing, `spawn`) that meet through a FileStore
in a temporary directory (no TCP port). Calls go through torch's public API with preallocated
outputs: `all_reduce` (in place on a copy of the input that is refreshed outside the timed
call), `reduce_scatter_tensor` and `all_gather_into_tensor`. If this torch's gloo lacks
`reduce_scatter_tensor`, reduce_scatter falls back to `all_reduce` of the whole input and a
copy of the rank's chunk into the output (timed together), and the row says so in `method`.
bf16 and f32 are gloo's own types (torch.bfloat16, torch.float32).

Timing: warmups, then for each timed call a barrier, the call, its time; a call's time is the
slowest rank's (MAX over ranks), the median call is reported. Correctness: inputs are small
integers (exact in bf16), every timed call's output is checked after the timed loop (the last
one, as mpi_coll.py does; all_reduce's in-place buffer is re-filled before every call), and the
number of wrong elements is reported as `wrong`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import common  # noqa: E402


def _values(torch, n_elems: int, rank: int, first: int, dtype):
    """v[i] = rank + 1 + (first + i) % 7: small integers, exact in bf16 (sums over <= 8 ranks < 256)."""
    idx = torch.arange(first, first + n_elems, dtype=torch.int64) % 7
    return (idx + rank + 1).to(dtype)


def _reduced(torch, n_elems: int, world: int, first: int, dtype):
    """The sum over ranks of _values: world * ((first + i) % 7) + world (world + 1) / 2."""
    idx = torch.arange(first, first + n_elems, dtype=torch.int64) % 7
    return (idx * world + world * (world + 1) // 2).to(dtype)


def bench_one(torch, dist, op: str, dtype: str, size: int, args, rank: int, world: int) -> dict:
    tdt = torch.bfloat16 if dtype == "bf16" else torch.float32
    elt = common.DTYPE_BYTES[dtype]
    count = common.element_count(op, size, world, elt)
    chunk = count // world
    method = {"all_reduce": "all_reduce", "reduce_scatter": "reduce_scatter_tensor"}.get(op, "all_gather_into_tensor")
    if op == "all_reduce":
        src = _values(torch, count, rank, 0, tdt)
        buf = torch.empty_like(src)

        def prepare():
            buf.copy_(src)

        def call():
            dist.all_reduce(buf)

        def result():
            return buf, _reduced(torch, count, world, 0, tdt)

    elif op == "reduce_scatter":
        src = _values(torch, count, rank, 0, tdt)
        out = torch.empty(chunk, dtype=tdt)
        fallback = not hasattr(dist, "reduce_scatter_tensor")
        if not fallback:
            try:
                dist.reduce_scatter_tensor(out, src)
            except (RuntimeError, NotImplementedError):
                fallback = True
        if fallback:
            method = "all_reduce + copy (gloo has no reduce_scatter_tensor)"
            tmp = torch.empty_like(src)

            def call():
                tmp.copy_(src)
                dist.all_reduce(tmp)
                out.copy_(tmp[rank * chunk : (rank + 1) * chunk])

        else:

            def call():
                dist.reduce_scatter_tensor(out, src)

        def prepare():
            pass

        def result():
            return out, _reduced(torch, chunk, world, rank * chunk, tdt)

    elif op == "all_gather":
        src = _values(torch, chunk, rank, 0, tdt)
        out = torch.empty(count, dtype=tdt)

        def prepare():
            pass

        def call():
            dist.all_gather_into_tensor(out, src)

        def result():
            return out, torch.cat([_values(torch, chunk, r, 0, tdt) for r in range(world)])

    else:
        raise ValueError(f"unknown collective {op!r}")

    nbytes = count * elt
    iters = common.iterations(nbytes, args.iters, args.large_iters)
    for _ in range(common.warmups(nbytes, args.warmup)):
        prepare()
        call()
    times = torch.empty(iters, dtype=torch.float64)
    for i in range(iters):
        prepare()
        dist.barrier()
        t0 = time.perf_counter()
        call()
        times[i] = time.perf_counter() - t0
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    t = common.median(times.tolist())
    got, want = result()
    wrong = torch.tensor([int((got != want).sum())], dtype=torch.int64)
    dist.all_reduce(wrong)
    return common.peer_row(op, dtype, world, nbytes, count, iters, t, int(wrong[0]), method=method)


def _rank_main(rank: int, args, store_path: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # one core per rank, as our ranks and OpenMPI's
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=args.world)
    world = dist.get_world_size()
    ops = [o for o in args.ops.split(",") if o]
    sizes = [common.parse_bytes(s) for s in args.sizes.split(",") if s]
    rows = []
    start = time.time()
    for op in ops:
        for size in sizes:
            if size // common.DTYPE_BYTES[args.dtype] < world:
                continue
            rows.append(bench_one(torch, dist, op, args.dtype, size, args, rank, world))
            if rank == 0:
                r = rows[-1]
                print(
                    f"  gloo np={world} {args.dtype} {op:<14} {common.fmt_bytes(r['bytes']):>9}"
                    f"  {r['time_us']:>11.1f} us  busbw {r['busbw_gbps']:7.3f} GB/s  #wrong {r['wrong']}"
                    f"  [{len(rows)}/{len(ops) * len(sizes)}, {time.time() - start:.0f}s]",
                    file=sys.stderr,
                    flush=True,
                )
    if rank == 0:
        doc = {
            "bench": "collectives",
            "impl": "gloo",
            "library": f"torch {torch.__version__} gloo",
            "world": world,
            "transport": "procs",
            "rows": rows,
        }
        text = json.dumps(doc, indent=1)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text)
        else:
            print(text, flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=4, help="process ranks")
    p.add_argument("--ops", default=",".join(common.COLLECTIVES))
    p.add_argument("--dtype", choices=("f32", "bf16"), required=True)
    p.add_argument("--sizes", required=True, help="comma-separated byte sizes (nccl-tests `size`)")
    p.add_argument("--iters", type=int, default=10, help="timed calls per size below 16 MiB")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls per size below 16 MiB (1 above)")
    p.add_argument("--large-iters", type=int, default=3, help="timed calls per size from 16 MiB on")
    p.add_argument("--out", help="write the JSON here (rank 0) instead of stdout")
    args = p.parse_args()
    if args.world < 1:
        p.error("--world must be at least 1")
    for op in args.ops.split(","):
        if op and op not in common.COLLECTIVES:
            p.error(f"unknown op {op!r} (gloo peer: {', '.join(common.COLLECTIVES)})")
    import torch.multiprocessing as tmp_mp

    with tempfile.TemporaryDirectory(prefix="gloo-bench-") as d:
        tmp_mp.spawn(_rank_main, args=(args, os.path.join(d, "store")), nprocs=args.world, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
