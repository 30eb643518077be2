"""Rank bodies of `test_npu.py`: the scenarios of `npu_scenarios` on real
torch_npu tensors and streams, each rank a process on its own NPU
(`world.run_world`), the world torch.distributed's HCCL process group
borrowed with `Comm.from_process_group`, as vLLM-Ascend's groups are. Also
the torch custom ops on NPU tensors (their PrivateUse1 kernels) and the
default stream (torch_npu's current stream) of a call given none.

Imported only where torch_npu imports (`test_npu.py` checks first)."""

from __future__ import annotations

import datetime
import os
import tempfile

import ml_dtypes
import numpy as np
import torch
import torch.distributed as dist
import torch_npu  # noqa: F401  (registers torch.npu and the PrivateUse1 backend)

import ascend_moe as am
import npu_scenarios as sc
from workers import BF16, assert_close, finalize_case, finalize_golden, rand, rng_for

OPS = torch.ops.ascend_moe
# The dtypes numpy takes from ml_dtypes; every other name is numpy's own.
_ML_DTYPES = {"bfloat16", "float8_e4m3fn", "float8_e5m2"}


def torch_dtype(dtype) -> torch.dtype:
    """The torch dtype of numpy / ml_dtypes `dtype` (the two agree on names)."""
    return getattr(torch, np.dtype(dtype).name)


def numpy_dtype(dtype: torch.dtype) -> np.dtype:
    name = str(dtype).removeprefix("torch.")
    return np.dtype(getattr(ml_dtypes, name) if name in _ML_DTYPES else name)


class TorchNpu(sc.Engine):
    """The scenarios' engine on NPU `index` of this process: torch_npu
    tensors, and torch_npu's current stream of the device. Data moves as
    bytes, so every dtype the library takes (fp8 included) crosses
    unchanged whatever copies torch_npu implements for it."""

    def __init__(self, index: int):
        torch.npu.set_device(index)
        self.device = torch.device("npu", index)
        super().__init__(index, torch.npu.current_stream(index))

    def up(self, a):
        a = np.ascontiguousarray(a)
        if a.size == 0:  # no bytes to view as another dtype
            return self.empty(a.shape, a.dtype)
        raw = torch.from_numpy(a.reshape(-1).view(np.uint8).copy())
        return raw.to(self.device).view(torch_dtype(a.dtype)).reshape(a.shape)

    def empty(self, shape, dtype):
        return torch.empty(tuple(shape), dtype=torch_dtype(dtype), device=self.device)

    def down(self, t):
        if t.numel() == 0:
            return np.empty(tuple(t.shape), numpy_dtype(t.dtype))
        raw = t.contiguous().reshape(-1).view(torch.uint8).cpu().numpy()
        return raw.view(numpy_dtype(t.dtype)).reshape(tuple(t.shape))

    def is_device(self, t):
        return isinstance(t, torch.Tensor) and t.device == self.device


def local_ops(name, world, rank, index):
    """finalize and unpermute on NPU `index` (`npu_scenarios`), then the
    same finalize with no `stream=` (torch_npu's current stream) and through
    `torch.ops.ascend_moe.moe_finalize_routing` (its PrivateUse1 kernel)."""
    eng = TorchNpu(index)
    sc.finalize_and_unpermute(eng)
    for dtype in (np.dtype(np.float32), BF16):
        ex, idx, kw = finalize_case(rng_for("npu-fin-default", str(dtype)), 0, dtype)
        kw["scales"] = kw["scales"].astype(np.float32)
        want = finalize_golden(ex, idx, kw["x1"], kw["x2"], kw["bias"], kw["scales"], kw["expert_idx"], 0)
        dev = eng.up_all(kw)
        dex, didx = eng.up(ex), eng.up(idx)
        made = am.moe_finalize_routing(dex, didx, **dev)
        op = OPS.moe_finalize_routing(dex, didx, *(dev[k] for k in ("x1", "x2", "bias", "scales", "expert_idx", "drop_pad_mode")))
        assert eng.is_device(made) and eng.is_device(op), (made.device, op.device)
        eng.sync()
        assert_close(eng.down(made), want, dtype, f"finalize {dtype} on the current stream of npu:{index}")
        assert_close(eng.down(op), want, dtype, f"torch.ops.ascend_moe.moe_finalize_routing {dtype} on npu:{index}")
    return "ok"


def live_context(name, world, rank, index):
    """`npu_scenarios.live_context` on torch_npu's current stream of NPU `index`."""
    eng = TorchNpu(index)
    sc.live_context(eng.stream, index)
    return "ok"


def world_ops(name, world, rank):
    """Rank `rank` on NPU `rank`: torch.distributed's HCCL world (a file
    store in the world's temp dir), borrowed as the scenarios' world
    communicator, runs `npu_scenarios.world_ops`; then the torch custom ops
    of the EP pad / reduce, gather / unpad and a reduction point on NPU
    tensors, against numpy."""
    eng = TorchNpu(rank)
    store = os.path.join(tempfile.gettempdir(), f"{name}.store")
    timeout = datetime.timedelta(seconds=4 * int(os.environ.get("ASCEND_MOE_COMM_TIMEOUT", "120")))
    dist.init_process_group("hccl", init_method=f"file://{store}", world_size=world, rank=rank, timeout=timeout)
    try:
        with am.Comm.from_process_group(None) as comm:
            assert (comm.rank, comm.world_size) == (rank, world), (comm.rank, comm.world_size)
            sc.world_ops(comm, rank, eng)
            torch_ops(comm, rank, eng)
    finally:
        dist.destroy_process_group()
    return "ok"


def torch_ops(comm, rank, eng):
    layout = sc.LAYOUT
    xs = [rand(rng_for("npu-op-pr", q), (layout.total_rows, 4), np.float32) for q in range(sc.WORLD)]
    shards = [rand(rng_for("npu-op-ag", q), (layout.local_sizes[q], 4), np.float32) for q in range(sc.WORLD)]
    pr = OPS.maybe_pad_and_reduce(eng.up(xs[rank]), comm.handle_id, layout.local_sizes)
    ag = OPS.maybe_all_gather_and_maybe_unpad(eng.up(shards[rank]), comm.handle_id, layout.local_sizes)
    eng.sync()
    start = sum(layout.local_sizes[:rank])
    total = np.sum(np.stack(xs).astype(np.float64), axis=0)
    assert_close(eng.down(pr), total[start : start + layout.local_sizes[rank]], np.float32, f"maybe_pad_and_reduce op on npu:{rank}")
    np.testing.assert_array_equal(eng.down(ag), np.concatenate(shards))
    group = rank // 2
    with comm.split([group * 2, group * 2 + 1]) as tp:
        policy = am.ReducePolicy("tensor_parallel", False, False, 2, sc.WORLD)
        parts = [rand(rng_for("npu-op-point", group, q), (3, 4), np.float32) for q in range(2)]
        for ct in am.CommType:
            got = OPS.reduce_final(eng.up(parts[tp.rank]), int(ct), tp.handle_id, *policy.fields)
            eng.sync()
            want = np.sum(parts, axis=0, dtype=np.float64) if policy.decisions(ct)["final"] else parts[tp.rank]
            assert_close(eng.down(got), want, np.float32, f"reduce_final op {ct.name} on npu:{rank}")
