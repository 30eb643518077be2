"""Rank bodies and helpers for the torch custom-op tests (imported only when
torch is importable). Goldens are the numpy ones of `workers`."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import ascend_moe as am
from workers import DTYPES, _tp_split, assert_close, policy_case, rand, rng_for

OPS = torch.ops.ascend_moe


def to_torch(a):
    """A numpy array (float32 / float16 / ml_dtypes.bfloat16 / int32) as a CPU tensor; None stays None."""
    if a is None:
        return None
    a = np.ascontiguousarray(a)
    if a.dtype == np.dtype(ml_dtypes.bfloat16):
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(a.copy())


def to_numpy(t):
    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def opcheck_comm_ops(comm, rank, world_size):
    """`torch.library.opcheck` on every communicating op. Every rank makes the
    same calls in the same order (opcheck runs each op a fixed number of times),
    so the collectives inside pair up."""
    hid = comm.handle_id
    g = rng_for("opcheck", rank)
    x = to_torch(rand(g, (world_size * 2, 3), np.float32))
    torch.library.opcheck(OPS.all_reduce.default, (x, hid))
    torch.library.opcheck(OPS.all_reduce.default, (x.to(torch.bfloat16), hid, int(am.ReduceOp.MAX)))
    torch.library.opcheck(OPS.reduce_scatter.default, (x, hid))
    torch.library.opcheck(OPS.all_gather.default, (x.to(torch.float16), hid))
    sizes = [(r % 3) + 1 for r in range(world_size)]  # uneven layout
    partial = to_torch(rand(g, (sum(sizes), 2), np.float32))
    torch.library.opcheck(OPS.maybe_pad_and_reduce.default, (partial, hid, sizes))
    torch.library.opcheck(OPS.maybe_pad_and_reduce.default, (x, hid, None))
    shard = to_torch(rand(g, (sizes[rank], 2), np.float32))
    torch.library.opcheck(OPS.maybe_all_gather_and_maybe_unpad.default, (shard, hid, sizes))
    torch.library.opcheck(OPS.maybe_all_gather_and_maybe_unpad.default, (x, hid))
    fields = am.ReducePolicy("tensor_parallel", False, False, world_size, world_size).fields
    for name in ("reduce_routed_early", "reduce_shared", "reduce_final"):
        for ct in (am.CommType.ALLGATHER, am.CommType.MC2):
            torch.library.opcheck(getattr(OPS, name).default, (x, int(ct), hid) + fields)


def _fake_shape(op, x, *args):
    with FakeTensorMode() as fm:
        return tuple(op(fm.from_tensor(x), *args).shape)


def torch_world(name, world_size, rank):
    """Every communicating torch op across `world_size` processes against a
    golden, fake shapes against real ones, then opcheck. Returns the number of checks."""
    checks = 0
    with am.Comm.cpu(name, world_size, rank, timeout_s=60.0) as world:
        hid = world.handle_id

        # Collectives, each rank's input reproducible by every rank.
        for dtype in DTYPES + [np.dtype(np.int32)]:
            def x_of(r):
                g = rng_for("torch-coll", str(dtype), r)
                if dtype.kind == "i":
                    return g.integers(-100, 100, size=(world_size * 2, 3)).astype(dtype)
                return rand(g, (world_size * 2, 3), dtype)

            xs = [x_of(r) for r in range(world_size)]
            x = to_torch(xs[rank])
            total = np.sum([a.astype(np.float64) for a in xs], axis=0)
            tol_dtype = np.float32 if dtype.kind == "i" else dtype  # int results are exact; f32 tolerance is < 1
            for op, want in ((am.ReduceOp.SUM, total), (am.ReduceOp.MAX, np.max(xs, axis=0))):
                got = OPS.all_reduce(x, hid, int(op))
                assert got.dtype == x.dtype and got.shape == x.shape
                assert_close(to_numpy(got), want, tol_dtype, f"all_reduce {op} {dtype}")
                checks += 1
            rs = OPS.reduce_scatter(x, hid)
            assert tuple(rs.shape) == _fake_shape(OPS.reduce_scatter, x, hid)
            want = total[rank * 2 : rank * 2 + 2]
            assert_close(to_numpy(rs), want, tol_dtype, f"reduce_scatter {dtype}")
            ag = OPS.all_gather(x, hid)
            assert tuple(ag.shape) == _fake_shape(OPS.all_gather, x, hid)
            np.testing.assert_array_equal(to_numpy(ag), np.concatenate(xs))
            checks += 2

        # EP/SP pad-reduce and gather-unpad: uneven DP, a zero-token rank, no layout.
        layouts = [am.SpLayout.from_dp_tokens([5, 3], 2).local_sizes, [4, 0, 1, 3], None]
        for li, sizes in enumerate(layouts):
            rows = list(sizes) if sizes is not None else [2] * world_size
            offsets = np.concatenate([[0], np.cumsum(rows)]).astype(int)
            ls = list(sizes) if sizes is not None else None
            for dtype in DTYPES:
                def partial(r):
                    return rand(rng_for("torch-pad", li, str(dtype), r), (int(offsets[-1]), 2, 3), dtype)

                total = np.sum([partial(r).astype(np.float64) for r in range(world_size)], axis=0)
                x = to_torch(partial(rank))
                got = OPS.maybe_pad_and_reduce(x, hid, ls)
                assert tuple(got.shape) == _fake_shape(OPS.maybe_pad_and_reduce, x, hid, ls)
                assert_close(to_numpy(got), total[offsets[rank] : offsets[rank + 1]], dtype, f"pad_reduce {ls}")

                def shard(r):
                    return rand(rng_for("torch-gather", li, str(dtype), r), (rows[r], 2, 3), dtype)

                s = to_torch(shard(rank))
                got = OPS.maybe_all_gather_and_maybe_unpad(s, hid, ls)
                assert tuple(got.shape) == _fake_shape(OPS.maybe_all_gather_and_maybe_unpad, s, hid, ls)
                np.testing.assert_array_equal(to_numpy(got), np.concatenate([shard(r) for r in range(world_size)]))
                checks += 2

        # Reduction points over TP groups of 2: the layer output is sum_i S_i + R
        # for every static policy and every live comm type (SPEC section 5).
        tp_size = 2
        with _tp_split(world, rank, tp_size) as tp:
            tp_rank, group = tp.rank, rank // tp_size
            for sp in (False, True):
                # tensor_parallel with SP on and TP > 1 is refused (SPEC section 5).
                modes = ["none", "data_parallel_only"] + (["sequence_parallel_only"] if sp else ["tensor_parallel"])
                for mode in modes:
                    for transform in (False, True):
                        fields = am.ReducePolicy(mode, transform, sp, tp_size, world_size).fields
                        for ct in am.CommType:
                            gg = rng_for("torch-policy", group, int(ct), mode, int(sp), int(transform))
                            shared, s_full, routed_parts, r_full = policy_case(gg, mode, tp_size, tp_rank)
                            reduced = ct != am.CommType.ALLGATHER or sp  # routed_is_reduced, SPEC section 5
                            routed = r_full.astype(np.float32) if reduced else routed_parts[tp_rank]
                            r = OPS.reduce_routed_early(to_torch(routed), int(ct), tp.handle_id, *fields)
                            s = OPS.reduce_shared(to_torch(shared), int(ct), tp.handle_id, *fields)
                            out = OPS.reduce_final(s + r, int(ct), tp.handle_id, *fields)
                            what = f"policy {mode} sp={sp} transform={transform} under {ct.name}"
                            assert_close(out.numpy(), s_full + r_full, np.float32, what)
                            checks += 1

        opcheck_comm_ops(world, rank, world_size)
        checks += 1
        world.barrier()
    return checks
