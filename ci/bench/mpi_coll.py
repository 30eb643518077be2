"""OpenMPI peer for `ascend-moe bench collectives`: the same collectives, sizes and iteration
rule over MPI (shared memory between processes), nccl-tests definitions of time, algbw, busbw.

Run under mpirun, e.g.
    mpirun --allow-run-as-root --oversubscribe -np 4 --mca btl self,vader \
        python mpi_coll.py --dtype bf16 --sizes 1024,33554432 --out result.json

bf16: MPI has no bf16 type. Buffers hold the same bytes as ours (16-bit elements, MPI_UINT16_T);
all_gather moves them as they are. Reductions, chosen by --bf16-reduce:
- `f32` (default): widen the input to f32, MPI_SUM over MPI_FLOAT (twice the bytes on the
  wire, OpenMPI's native vectorised op), round the result back to bf16 (nearest even); both
  conversions are inside the timed call. On this machine it is the faster of the two (about
  2x at 64 MiB), so it is the peer's best effort.
- `userop`: a user-defined commutative MPI op (numpy) that widens both operands to f32, adds
  and rounds the sum back to bf16 at every pairwise step; MPI moves the same bytes as ours,
  but every reduction step is a Python call.
Either way the reported `bytes` are the bf16 bytes, as for ours.

Correctness: inputs are small integers (exact in bf16), every output is checked after the timed
loop and the number of wrong elements is reported as `wrong`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

import common  # noqa: E402


def _bf16_widen(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def bf16_round(x: np.ndarray) -> np.ndarray:
    """f32 -> bf16 bits, round to nearest even (inputs here are finite)."""
    u = x.view(np.uint32)
    return ((u + (0x7FFF + ((u >> 16) & 1))) >> 16).astype(np.uint16)


def _bf16_sum(inbuf, inoutbuf, datatype):  # MPI user op: inout = in + inout
    a = np.frombuffer(inbuf, dtype=np.uint16)
    b = np.frombuffer(inoutbuf, dtype=np.uint16)
    b[:] = bf16_round(_bf16_widen(a) + _bf16_widen(b))


def _periodic(n_elems: int, first: int, scale: float, offset: float) -> np.ndarray:
    """f32 array v[i] = offset + scale * ((first + i) % 7), built without index temporaries."""
    pattern = offset + scale * ((first + np.arange(7)) % 7).astype(np.float32)
    return np.resize(pattern.astype(np.float32), n_elems)


def _values(n_elems: int, rank: int, dtype: str) -> np.ndarray:
    """Rank-dependent small integers (i % 7 + rank + 1): exact in f32 and bf16; sums over
    <= 8 ranks stay below 256."""
    v = _periodic(n_elems, 0, 1.0, rank + 1.0)
    return v if dtype == "f32" else bf16_round(v)


def _as_f32(buf: np.ndarray, dtype: str) -> np.ndarray:
    return buf if dtype == "f32" else _bf16_widen(buf)


def bench_one(comm, op: str, dtype: str, size: int, args, bf16_op) -> dict:
    n, rank = comm.size, comm.rank
    elt = common.DTYPE_BYTES[dtype]
    count = common.element_count(op, size, n, elt)
    npdt = np.float32 if dtype == "f32" else np.uint16
    widen = dtype == "bf16" and args.bf16_reduce == "f32"
    mpi_op = bf16_op if dtype == "bf16" and not widen else MPI.SUM
    if op in ("all_reduce", "reduce_scatter"):
        out_count = count if op == "all_reduce" else count // n
        send, recv = _values(count, rank, dtype), np.empty(out_count, npdt)
        mpi_call = comm.Allreduce if op == "all_reduce" else comm.Reduce_scatter_block
        if widen:
            recv32 = np.empty(out_count, np.float32)

            def call():
                mpi_call(_bf16_widen(send), recv32, op=MPI.SUM)
                recv[:] = bf16_round(recv32)

        else:

            def call():
                mpi_call(send, recv, op=mpi_op)

    elif op == "all_gather":
        send, recv = _values(count // n, rank, dtype), np.empty(count, npdt)

        def call():
            comm.Allgather(send, recv)

    else:
        raise ValueError(f"unknown collective {op!r}")

    nbytes = count * elt
    iters = common.iterations(nbytes, args.iters, args.large_iters)
    for _ in range(common.warmups(nbytes, args.warmup)):
        call()
    # As the CLI times: a barrier before every call, each call's time is the slowest rank's,
    # the median over the timed calls is reported.
    times = np.empty(iters)
    for i in range(iters):
        comm.Barrier()
        t0 = MPI.Wtime()
        call()
        times[i] = MPI.Wtime() - t0
    slowest = np.empty_like(times)
    comm.Allreduce(times, slowest, op=MPI.MAX)
    t = float(np.median(slowest))

    # Check the last result against the closed form of the inputs.
    got = _as_f32(recv, dtype)
    chunk = count // n
    tri = n * (n + 1) / 2
    if op == "all_reduce":
        wrong = int(np.count_nonzero(got != _periodic(count, 0, n, tri)))
    elif op == "reduce_scatter":
        wrong = int(np.count_nonzero(got != _periodic(chunk, rank * chunk, n, tri)))
    else:
        wrong = sum(
            int(np.count_nonzero(got[r * chunk : (r + 1) * chunk] != _periodic(chunk, 0, 1.0, r + 1.0)))
            for r in range(n)
        )
    wrong = comm.allreduce(wrong, op=MPI.SUM)

    return common.peer_row(op, dtype, n, nbytes, count, iters, t, wrong)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", default=",".join(common.COLLECTIVES))
    p.add_argument("--dtype", choices=("f32", "bf16"), required=True)
    p.add_argument("--sizes", required=True, help="comma-separated byte sizes (nccl-tests `size`)")
    p.add_argument("--iters", type=int, default=10, help="timed calls per size below 16 MiB")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls per size below 16 MiB (1 above)")
    p.add_argument("--large-iters", type=int, default=3, help="timed calls per size from 16 MiB on")
    p.add_argument(
        "--bf16-reduce",
        choices=("userop", "f32"),
        default="f32",
        help="bf16 reductions: widen to f32 + MPI_SUM + round back (default), or a user-defined bf16 MPI op",
    )
    p.add_argument("--out", help="write the JSON here (rank 0) instead of stdout")
    args = p.parse_args()

    comm = MPI.COMM_WORLD
    ops = [o for o in args.ops.split(",") if o]
    sizes = [common.parse_bytes(s) for s in args.sizes.split(",") if s]
    bf16_op = MPI.Op.Create(_bf16_sum, commute=True)
    rows = []
    total = len(ops) * len(sizes)
    start = time.time()
    for op in ops:
        for size in sizes:
            if size // common.DTYPE_BYTES[args.dtype] < comm.size:
                continue
            rows.append(bench_one(comm, op, args.dtype, size, args, bf16_op))
            if comm.rank == 0:
                r = rows[-1]
                print(
                    f"  openmpi np={comm.size} {args.dtype} {op:<14} {common.fmt_bytes(r['bytes']):>9}"
                    f"  {r['time_us']:>11.1f} us  busbw {r['busbw_gbps']:7.3f} GB/s"
                    f"  [{len(rows)}/{total}, {time.time() - start:.0f}s]",
                    file=sys.stderr,
                    flush=True,
                )
    bf16_op.Free()
    if comm.rank == 0:
        doc = {
            "bench": "collectives",
            "impl": "openmpi",
            "library": MPI.Get_library_version().splitlines()[0].strip(),
            "mpi4py": __import__("mpi4py").__version__,
            "world": comm.size,
            "transport": "procs",
            "bf16_reduce": args.bf16_reduce,
            "rows": rows,
        }
        text = json.dumps(doc, indent=1)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text)
        else:
            print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
