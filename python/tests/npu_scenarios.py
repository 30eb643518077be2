"""Scenarios of the Python API on NPU memory, written once for any engine:
the simulator's stand-in tensors and streams (`sim_workers.py`, run by
`test_sim.py`) and real torch_npu tensors and streams (`npu_workers.py`, run
by `test_npu.py` on an Ascend host).

A scenario gets an `Engine` for one rank: `up(a)` puts numpy array `a` in the
rank's device memory as the engine's NPU tensor, `empty(shape, dtype)`
allocates one, `down(t)` reads one back as a numpy array of its dtype,
`is_device(t)` says whether `t` is such a tensor on the rank's device, and
`stream` (an object with `.npu_stream`) is the stream the ops run on. Results
are checked against the numpy goldens of `workers`; a finalize also against
the CPU backend's result on the same inputs."""

from __future__ import annotations

import ctypes
import sys

import ml_dtypes
import numpy as np

import ascend_moe as am
from workers import BF16, assert_close, finalize_case, finalize_golden, rand, rng_for, unpermute_golden

WORLD = 4
LAYOUT = am.SpLayout([3, 1, 0, 2])


class Engine:
    """One rank's device `index` and `stream`; subclasses move the data."""

    def __init__(self, index: int, stream):
        self.index, self.stream = index, stream

    def sync(self):
        """Waits for the stream, raising the first error the device recorded on it."""
        am.stream_check(self.stream, device=self.index)

    def up_all(self, kw: dict) -> dict:
        """`kw` with every numpy array put on the device."""
        return {k: (self.up(v) if isinstance(v, np.ndarray) else v) for k, v in kw.items()}


def finalize_and_unpermute(eng: Engine):
    """finalize (into `out=` and allocated) and unpermute on the device,
    f32 and bf16, against the golden and the CPU backend's result."""
    for dtype in (np.dtype(np.float32), BF16):
        ex, idx, kw = finalize_case(rng_for("sim-fin", str(dtype)), 0, dtype)
        kw["scales"] = kw["scales"].astype(np.float32)
        want = finalize_golden(ex, idx, kw["x1"], kw["x2"], kw["bias"], kw["scales"], kw["expert_idx"], 0)
        on_cpu = am.moe_finalize_routing(ex, idx, **kw)
        dev = eng.up_all(kw)
        dex, didx = eng.up(ex), eng.up(idx)
        out = eng.empty(want.shape, dtype)
        assert am.moe_finalize_routing(dex, didx, **dev, out=out, stream=eng.stream) is out
        made = am.moe_finalize_routing(dex, didx, **dev, stream=eng.stream)
        assert eng.is_device(made) and tuple(made.shape) == want.shape, (type(made), made.shape)
        eng.sync()
        for what, got in (("into out", out), ("allocated", made)):
            got = eng.down(got)
            assert got.dtype == dtype, (got.dtype, dtype)
            assert_close(got, want, dtype, f"finalize {dtype} {what} on npu:{eng.index}")
            assert_close(got, on_cpu, dtype, f"finalize {dtype} {what} on npu:{eng.index} against the CPU backend")

        permuted = rand(rng_for("sim-unperm", str(dtype)), (6, 4), dtype)
        sorted_idx = np.array([3, 0, 5, 1, 4, 2], np.int32)
        probs = rand(rng_for("sim-probs", str(dtype)), (3, 2), dtype)
        uout = eng.empty((3, 4), dtype)
        got = am.moe_token_unpermute(eng.up(permuted), eng.up(sorted_idx), eng.up(probs), out=uout, stream=eng.stream)
        assert got is uout
        eng.sync()
        assert_close(eng.down(uout), unpermute_golden(permuted, sorted_idx, probs), dtype, f"unpermute {dtype}")


def world_ops(world, rank: int, eng: Engine):
    """Rank `rank` of a 4-device `world` (a communicator HCCL may split):
    all_reduce, all_gather, the EP pad / reduce and gather / unpad, the token
    prepare / finalize round trips, the shared-expert helpers, a reduction
    point and the fused finalize + reduce on device memory."""
    xs = [rand(rng_for("sim-w4", q), (LAYOUT.total_rows, 5), np.float32) for q in range(WORLD)]
    gs = [rand(rng_for("sim-w4g", q), (2, 5), np.float32) for q in range(WORLD)]
    x = eng.up(xs[rank])
    ar = am.all_reduce(x, world, stream=eng.stream)
    ag = am.all_gather(eng.up(gs[rank]), world, stream=eng.stream)
    pr = am.maybe_pad_and_reduce(x, LAYOUT, world, stream=eng.stream)
    eng.sync()
    total = np.sum(np.stack(xs).astype(np.float64), axis=0)
    start = sum(LAYOUT.local_sizes[:rank])
    assert_close(eng.down(ar), total, np.float32, f"all_reduce on npu:{eng.index}")
    assert_close(eng.down(ag), np.concatenate(gs), np.float32, f"all_gather on npu:{eng.index}")
    assert_close(eng.down(pr), total[start : start + LAYOUT.local_sizes[rank]], np.float32, f"maybe_pad_and_reduce on npu:{eng.index}")
    # The EP prepare: every rank's shard (rank 2's has no rows) gathered in
    # rank order, an exact move in every dtype.
    for dtype in (np.dtype(np.float32), BF16):
        shards = [rand(rng_for("sim-w4-shard", str(dtype), q), (LAYOUT.local_sizes[q], 3), dtype) for q in range(WORLD)]
        gathered = am.maybe_all_gather_and_maybe_unpad(eng.up(shards[rank]), LAYOUT, world, stream=eng.stream)
        eng.sync()
        got = eng.down(gathered)
        assert got.dtype == dtype and got.tobytes() == np.concatenate(shards).tobytes(), (
            f"maybe_all_gather_and_maybe_unpad {dtype} on npu:{eng.index}: {got}"
        )
    layer_round_trips(world, rank, eng)
    tp_ops(world, rank, eng)
    fused_finalize(world, rank, eng)


def layer_round_trips(world, rank: int, eng: Engine):
    """Token prepare then finalize with identity experts on device memory,
    every comm type, with and without SP, DP 2 x TP 2 (groups split from the
    caller's HCCL world): ALLGATHER returns `DP * x` without SP and `EP * x`
    with SP, the others `x` (SPEC section 6)."""
    tp, dp_tokens, size = 2, [3, 1], world.world_size
    d, t = rank // tp, rank % tp
    # The engine's own TP and DP groups, handed over without creating any.
    tp_comm, dp_comm = world.split([d * tp, d * tp + 1]), world.split([t, tp + t])
    for groups in (am.MoeGroups(world, tp), am.MoeGroups.from_comms(world, tp_comm, dp_comm)):
        for sp in (False, True):
            ctx = am.MoeContext(dp_tokens, tp, d, t, sp)
            rows = -(-dp_tokens[d] // tp) if sp else dp_tokens[d]
            x = rand(rng_for("sim-prep", rank if sp else d, int(sp)), (rows, 4), np.float32)
            dx = eng.up(x)
            for ct in am.CommType:
                hidden, _mask = am.token_prepare(dx, ct, ctx, groups, stream=eng.stream)
                assert eng.is_device(hidden) and tuple(hidden.shape) == am.shapes.token_prepare(x, ct, ctx)
                back = am.token_finalize(hidden, ct, ctx, groups, stream=eng.stream)
                eng.sync()
                factor = (size if sp else size // tp) if ct == am.CommType.ALLGATHER else 1
                assert_close(eng.down(back), x.astype(np.float64) * factor, np.float32, f"npu:{eng.index} {ct.name} sp={sp}")
        groups.close()
    try:
        am.MoeGroups.from_comms(world, dp_comm, tp_comm)
    except am.AmoeError as e:
        assert rank in (1, 2) and "(dp * PCP + pcp) * TP + tp" in str(e), e
    else:
        assert rank in (0, 3), "TP and DP swapped were accepted where they cannot fit"
    tp_comm.close()
    dp_comm.close()


def tp_ops(world, rank: int, eng: Engine):
    """Over the TP pair of `rank` (a sub-communicator of the caller's world):
    the shared-expert helpers and a reduction point, on device memory."""
    tp_size, group = 2, rank // 2
    with world.split([group * 2, group * 2 + 1]) as tp:
        t = tp.rank
        for tokens in (1, 5):
            part = -(-tokens // tp_size)
            batch = rand(rng_for("sim-shared", group, tokens), (tokens, 3), np.float32)
            padded = np.zeros((part * tp_size, 3), np.float32)
            padded[:tokens] = batch
            mine = am.shared_pad_split(eng.up(batch), tp, stream=eng.stream)
            back = am.shared_gather_unpad(mine, tokens, tp, stream=eng.stream)
            partials = [rand(rng_for("sim-part", group, tokens, q), (tokens, 3), np.float32) for q in range(tp_size)]
            rs = am.shared_pad_reduce_scatter(eng.up(partials[t]), tp, stream=eng.stream)
            eng.sync()
            np.testing.assert_array_equal(eng.down(mine), padded[t * part : (t + 1) * part])
            np.testing.assert_array_equal(eng.down(back), batch)
            total = np.zeros((part * tp_size, 3))
            total[:tokens] = np.sum(partials, axis=0, dtype=np.float64)
            assert_close(eng.down(rs), total[t * part : (t + 1) * part], np.float32, f"pad_reduce_scatter T={tokens}")
        # Quantize before gather: one-byte hidden states, packed fp4, masks and
        # 1-D per-token f32 scales travel as exact byte moves on the device.
        g = rng_for("sim-bytes", group)
        for dtype, shape in (
            (np.int8, (5, 4)),
            (np.uint8, (5, 4)),
            (np.bool_, (5, 4)),
            (ml_dtypes.float8_e4m3fn, (5, 4)),
            (ml_dtypes.float8_e5m2, (5, 4)),
            (np.float32, (5,)),
        ):
            raw = g.integers(0, 256, size=int(np.prod(shape)), dtype=np.uint8)
            if np.dtype(dtype) == np.bool_:
                batch = (raw % 2).astype(np.bool_).reshape(shape)
            elif np.dtype(dtype).itemsize == 1:
                batch = raw.view(dtype).reshape(shape)
            else:
                batch = g.standard_normal(shape).astype(dtype)
            mine = am.shared_pad_split(eng.up(batch), tp, stream=eng.stream)
            back = am.shared_gather_unpad(mine, 5, tp, stream=eng.stream)
            eng.sync()
            got = eng.down(back)
            assert got.dtype == np.dtype(dtype), (got.dtype, dtype)
            assert got.tobytes() == batch.tobytes(), f"{np.dtype(dtype)} gather on npu:{eng.index} is not an exact byte move"
        policy = am.ReducePolicy("tensor_parallel", False, False, tp_size, WORLD)
        xs = [rand(rng_for("sim-point", group, q), (4, 3), np.float32) for q in range(tp_size)]
        for ct in am.CommType:
            got = policy.reduce_shared(eng.up(xs[t]), ct, tp, stream=eng.stream)
            eng.sync()
            want = np.sum(xs, axis=0, dtype=np.float64) if policy.decisions(ct)["shared"] else xs[t]
            assert_close(eng.down(got), want, np.float32, f"reduce_shared {ct.name} on npu:{eng.index}")


def fused_finalize(world, rank: int, eng: Engine):
    """`finalize_and_reduce` over the world: every rank's finalize summed, this
    rank's layout rows kept."""
    cases = []
    for q in range(WORLD):
        ex, idx, kw = finalize_case(rng_for("sim-far", q), 0, np.float32, n=LAYOUT.total_rows)
        cases.append((ex, idx, kw))
    total = sum(finalize_golden(ex, idx, *[kw[k] for k in ("x1", "x2", "bias", "scales", "expert_idx")], 0) for ex, idx, kw in cases)
    ex, idx, kw = cases[rank]
    got = am.finalize_and_reduce(eng.up(ex), eng.up(idx), LAYOUT, world, **eng.up_all(kw), stream=eng.stream)
    eng.sync()
    start = sum(LAYOUT.local_sizes[:rank])
    assert_close(eng.down(got), total[start : start + LAYOUT.local_sizes[rank]], np.float32, f"finalize_and_reduce npu:{eng.index}")


def raises(call, *parts, status=None, otherwise):
    """`call()` raises an AmoeError (of `status`, when given) whose text has
    every one of `parts`; else AssertionError(`otherwise`)."""
    try:
        call()
    except am.AmoeError as e:
        assert status is None or e.status == status, e
        assert all(p in str(e) for p in parts), e
    else:
        raise AssertionError(otherwise)


def live_context(stream, device: int):
    """The live forward context on `stream` of NPU `device`, the only stream
    the package wrapped in this process: a guard passes under its context; a
    guard of MC2 ops run while the live context says ALLTOALL is reported
    once, naming both; an attached context makes the reduction points guard
    themselves. Ends with the stream's handle released (the caller destroys
    the stream)."""
    live = am.LiveContext(stream, device=device)
    ptr, nbytes = live.device_ptr
    assert ptr and nbytes == 256, (ptr, nbytes)
    mc2 = am.ForwardContext(am.CommType.MC2, dp_tokens=[4, 4])
    live.set(mc2)
    live.guard(mc2)
    live.check()
    live.set(am.ForwardContext(am.CommType.ALLTOALL, dp_tokens=[4, 4]))
    live.guard(mc2)
    raises(
        live.check,
        "comm_type is 2 (ALLTOALL)",
        "captured for 1 (MC2)",
        status=am.Status.STALE_CONTEXT,
        otherwise="a guard of MC2 ops under ALLTOALL was not reported",
    )
    live.check()  # reported once
    live.set(mc2)
    live.guard(am.ForwardContext(am.CommType.MC2, dp_tokens=[4, 4], num_actual_tokens=3), actual_tokens=True)
    raises(
        live.check,
        "num_actual_tokens is all",
        "captured for 3",
        otherwise="a guard of the actual-token count was not reported",
    )
    # The open context keeps its stream handle (the ops on the stream share
    # it): releasing the streams is refused, freeing nothing, until it closes.
    held = "release_streams freed the handle of an open LiveContext"
    raises(am.release_streams, "open LiveContext", status=am.Status.INVALID_ARGUMENT, otherwise=held)
    live.set(mc2)
    live.check()
    # Closed while another call holds it (a `check()` waiting on the stream
    # in another thread): new calls are refused at once, and the context and
    # its stream handle live until the holding call lets go.
    lease = live._lease()
    live.close()
    closed = "a closed LiveContext took a call"
    raises(live.check, "the live context was closed", status=am.Status.INVALID_ARGUMENT, otherwise=closed)
    raises(am.release_streams, "open LiveContext", otherwise=held)
    n = ctypes.c_size_t()
    guards = sys.modules["ascend_moe._lib"].lib().amoe_live_context_guards
    code = guards(lease, ctypes.byref(n), ctypes.byref(ctypes.c_size_t()))
    assert code == 0, f"amoe_live_context_guards failed with {code}"
    assert n.value >= 128, n.value
    del lease
    live.close()  # closing again frees nothing twice
    assert am.release_streams() == 1
