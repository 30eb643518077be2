"""Runs one function in N separate Python processes (multiprocessing spawn),
each as a rank of a fresh CPU world, and collects what every rank returned."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import shutil
import tempfile
import time
import traceback
import uuid


def _entry(fn, name, world, rank, q, args):
    try:
        q.put((rank, "ok", fn(name, world, rank, *args)))
    except BaseException as e:  # noqa: BLE001 - report everything to the parent
        q.put((rank, "err", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def run_world(fn, world=4, args=(), deadline_s=120.0, expect_exit=(), torch_ops=False):
    """Runs `fn(name, world, rank, *args)` in `world` processes; returns
    `(results by rank, exit codes by rank)`. Ranks in `expect_exit` may die
    without reporting. Fails when a rank raised, or when the deadline passed
    (every process is then terminated). Without `torch_ops` the processes do
    not import torch (`ASCEND_MOE_TORCH=0`), which saves seconds per process.
    The processes' temp dir (`TMPDIR`) is the world's own, removed at the end
    with whatever they left there (a gloo store file, for one)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    name = f"pytest-{uuid.uuid4().hex[:16]}"
    tmp = tempfile.mkdtemp(prefix=f"{name}-")
    procs = [ctx.Process(target=_entry, args=(fn, name, world, r, q, args)) for r in range(world)]
    # Spawned children inherit the environment at start.
    child_env = {"TMPDIR": tmp} | ({} if torch_ops else {"ASCEND_MOE_TORCH": "0"})
    saved = {k: os.environ.get(k) for k in child_env}
    os.environ.update(child_env)
    try:
        for p in procs:
            p.start()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    results, errors = {}, {}
    end = time.monotonic() + deadline_s
    try:
        want = world - len(expect_exit)
        while len(results) + len(errors) < want:
            left = end - time.monotonic()
            if left <= 0:
                raise AssertionError(f"ranks {sorted(set(range(world)) - set(results) - set(errors))} did not finish within {deadline_s} s")
            try:
                rank, kind, value = q.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [
                    r
                    for r, p in enumerate(procs)
                    if p.exitcode not in (None, 0) and r not in expect_exit and r not in results and r not in errors
                ]
                if dead:
                    raise AssertionError(f"ranks {dead} died (exit codes {[procs[r].exitcode for r in dead]})")
                continue
            (results if kind == "ok" else errors)[rank] = value
        for p in procs:
            p.join(timeout=max(end - time.monotonic(), 1.0))
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join()
        shutil.rmtree(tmp, ignore_errors=True)
    assert not errors, "\n".join(f"rank {r} failed: {e}" for r, e in sorted(errors.items()))
    return results, [p.exitcode for p in procs]
