"""Rank bodies run in separate processes by `world.run_world`, and the numpy
goldens they check against. Goldens are naive float64 loops written from
SPEC.md, independent of the library."""

from __future__ import annotations

import os
import time
import zlib

import ml_dtypes
import numpy as np

import ascend_moe as am

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [np.dtype(np.float32), np.dtype(np.float16), BF16]
# (rtol, atol) against a float64 golden: one rounding to the output dtype.
TOL = {np.dtype(np.float32): (1e-5, 1e-5), np.dtype(np.float16): (2e-3, 2e-3), BF16: (1e-2, 1e-2)}
SHORT_TIMEOUT_S = 3.0


def require(what: str, missing) -> None:
    """Ends the collection of a test module whose `what` tests need something
    `missing` names (None: nothing is missing): under CI (`$CI` set) the run
    fails, elsewhere the module is skipped."""
    if missing is None:
        return
    import pytest

    if os.environ.get("CI"):
        pytest.fail(f"CI must run the {what} tests, but {missing}", pytrace=False)
    pytest.skip(missing, allow_module_level=True)


def torch_ops_missing():
    """Why the torch custom ops are unavailable, or None when they are registered."""
    return None if am.TORCH_OPS else (am.TORCH_OPS_ERROR or "torch custom ops not registered")


def assert_close(got, want, dtype, what):
    rtol, atol = TOL[np.dtype(dtype)]
    got64 = np.asarray(got).astype(np.float64)
    want64 = np.asarray(want, dtype=np.float64)
    assert got64.shape == want64.shape, f"{what}: shape {got64.shape}, want {want64.shape}"
    scale = max(1.0, float(np.max(np.abs(want64)))) if want64.size else 1.0
    err = np.abs(got64 - want64)
    ok = err <= atol * scale + rtol * np.abs(want64)
    assert ok.all(), f"{what}: max error {err.max()} at {np.unravel_index(err.argmax(), err.shape)}"


def rng_for(*key):
    """A generator every process derives identically from `key` (str hashes are per-process, crc32 is not)."""
    return np.random.default_rng([zlib.crc32(k.encode()) if isinstance(k, str) else int(k) for k in key])


def rand(rng, shape, dtype):
    return rng.uniform(-1.0, 1.0, size=shape).astype(np.float32).astype(dtype)


# ----------------------------------------------------------------- goldens


def finalize_golden(ex, idx, x1, x2, bias, scales, expert_idx, mode):
    h_shape = ex.shape[2:] if mode in (1, 3) else ex.shape[1:]
    rows = ex.reshape(-1, int(np.prod(h_shape, dtype=np.int64))).astype(np.float64)
    n, k = scales.shape if scales is not None else (idx.shape[0], 1)
    out = np.zeros((n, rows.shape[1]))
    for i in range(n):
        acc = np.zeros(rows.shape[1])
        if x1 is not None:
            acc += x1.reshape(n, -1)[i].astype(np.float64)
        if x2 is not None:
            acc += x2.reshape(n, -1)[i].astype(np.float64)
        for j in range(k):
            r = int(idx[j * n + i] if mode in (0, 1) else idx[i * k + j])
            row = np.zeros(rows.shape[1]) if (mode in (1, 3) and r == -1) else rows[r]
            b = bias.reshape(bias.shape[0], -1)[int(expert_idx[i, j])].astype(np.float64) if bias is not None else 0.0
            s = float(scales[i, j]) if scales is not None else 1.0
            acc += s * (row + b)
        out[i] = acc
    return out.reshape((n,) + tuple(h_shape))


def unpermute_golden(permuted, idx, probs):
    t, k = probs.shape if probs is not None else (idx.shape[0], 1)
    p = permuted.reshape(permuted.shape[0], -1).astype(np.float64)
    out = np.zeros((t, p.shape[1]))
    for i in range(t):
        for j in range(k):
            r = int(idx[i * k + j])
            if 0 <= r < p.shape[0]:
                out[i] += (float(probs[i, j]) if probs is not None else 1.0) * p[r]
    return out.reshape((t,) + permuted.shape[1:])


def finalize_case(rng, mode, dtype, n=5, k=2, h=(3, 2), experts=3, cap=4, x1=True, x2=True, bias=True, scales=True):
    """Random finalize inputs (every optional input switchable; without scales K = 1)."""
    if not scales:
        k = 1
    if mode in (1, 3):
        ex = rand(rng, (experts, cap) + h, dtype)
        idx = rng.integers(-1, experts * cap, size=n * k).astype(np.int32)  # -1 = dropped slot
    else:
        ex = rand(rng, (n * k,) + h, dtype)
        idx = rng.permutation(n * k).astype(np.int32)
    kw = dict(
        x1=rand(rng, (n,) + h, dtype) if x1 else None,
        x2=rand(rng, (n,) + h, dtype) if x2 else None,
        bias=rand(rng, (experts,) + h, dtype) if bias else None,
        scales=rand(rng, (n, k), dtype if rng.integers(2) else np.float32) if scales else None,
        expert_idx=rng.integers(0, experts, size=(n, k)).astype(np.int32) if bias else None,
        drop_pad_mode=mode,
    )
    return ex, idx, kw


# ------------------------------------------------------------ rank bodies


def _tp_split(world, rank, tp):
    """The TP group of `rank` (consecutive ranks, EP rank = dp * TP + tp)."""
    base = rank // tp * tp
    return world.split(list(range(base, base + tp)))


def op_matrix(name, world_size, rank):
    """Collectives, the local ops, the EP/SP ops and the reduce policy across
    `world_size` processes, each against a golden. Returns the number of checks."""
    checks = 0
    with am.Comm.cpu(name, world_size, rank, timeout_s=30.0) as world:
        assert (world.rank, world.world_size) == (rank, world_size)

        # Collectives: each rank's input is reproducible by every rank.
        for dtype in DTYPES + [np.dtype(np.int32)]:
            def x_of(r):
                g = rng_for("coll", str(dtype), r)
                if dtype.kind == "i":
                    return g.integers(-100, 100, size=(world_size * 2, 3)).astype(dtype)
                return rand(g, (world_size * 2, 3), dtype)

            xs = [x_of(r) for r in range(world_size)]
            total = np.sum([x.astype(np.float64) for x in xs], axis=0)
            for op, want in (("sum", total), ("max", np.max(xs, axis=0)), ("min", np.min(xs, axis=0))):
                got = am.all_reduce(xs[rank], world, op=op)
                assert got.dtype == dtype and got.shape == xs[rank].shape
                if dtype.kind == "i":
                    np.testing.assert_array_equal(got, want)
                else:
                    assert_close(got, want, dtype, f"all_reduce {op} {dtype}")
                checks += 1
            rs = am.reduce_scatter(xs[rank], world)
            want = total[rank * 2 : rank * 2 + 2]
            np.testing.assert_array_equal(rs, want) if dtype.kind == "i" else assert_close(rs, want, dtype, "rs")
            ag = am.all_gather(xs[rank], world)
            np.testing.assert_array_equal(ag, np.concatenate(xs))
            checks += 2
        b = am.broadcast(np.full((3,), rank, np.float32), world, root=2)
        np.testing.assert_array_equal(b, np.full((3,), 2, np.float32))

        # Local ops: every mode, dtype and optional-input combination.
        g = rng_for("local", rank)
        for mode in range(4):
            for dtype in DTYPES:
                for opts in range(16):
                    flags = dict(x1=bool(opts & 1), x2=bool(opts & 2), bias=bool(opts & 4), scales=bool(opts & 8))
                    ex, idx, kw = finalize_case(g, mode, dtype, **flags)
                    got = am.moe_finalize_routing(ex, idx, **kw)
                    assert got.dtype == dtype
                    assert got.shape == am.shapes.moe_finalize_routing(ex, idx, **kw)
                    want = finalize_golden(ex, idx, kw["x1"], kw["x2"], kw["bias"], kw["scales"], kw["expert_idx"], mode)
                    assert_close(got, want, dtype, f"finalize mode {mode} {dtype} {flags}")
                    checks += 1
            for dtype in DTYPES:
                for with_probs in (False, True):
                    t, k = 6, 3
                    permuted = rand(g, (t * k, 4), dtype)
                    idx = g.integers(-2, t * k + 2, size=t * k).astype(np.int32)  # some out of range: contribute 0
                    probs = rand(g, (t, k), dtype) if with_probs else None
                    if not with_probs:
                        idx = idx[:t]
                    got = am.moe_token_unpermute(permuted, idx, probs)
                    assert_close(got, unpermute_golden(permuted, idx, probs), dtype, "unpermute")
                    checks += 1

        # EP/SP pad-reduce and gather-unpad over the whole world (EP = world).
        layouts = [
            am.SpLayout.from_dp_tokens([5, 3], 2),  # uneven DP
            am.SpLayout([4, 0, 1, 3]),  # zero-token rank
            am.SpLayout.from_dp_tokens([1, 0], 2),  # tokens < TP
            am.SpLayout([0, 0, 0, 0]),  # M = 0
            None,  # plain reduce-scatter, 8 rows
        ]
        for li, layout in enumerate(layouts):
            sizes = layout.local_sizes if layout is not None else (2,) * world_size
            offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
            for dtype in DTYPES:
                def partial(r):
                    return rand(rng_for("pad", li, str(dtype), r), (int(offsets[-1]), 2, 3), dtype)

                total = np.sum([partial(r).astype(np.float64) for r in range(world_size)], axis=0)
                got = am.maybe_pad_and_reduce(partial(rank), layout, world)
                assert got.shape == am.shapes.maybe_pad_and_reduce(partial(rank), layout, world)
                assert_close(got, total[offsets[rank] : offsets[rank + 1]], dtype, f"pad_reduce {layout}")

                def shard(r):
                    return rand(rng_for("gather", li, str(dtype), r), (sizes[r], 2, 3), dtype)

                got = am.maybe_all_gather_and_maybe_unpad(shard(rank), layout, world)
                np.testing.assert_array_equal(got, np.concatenate([shard(r) for r in range(world_size)]))
                checks += 2

            # Fused finalize + reduce: each rank's finalize over all tokens, summed, sharded.
            n = int(offsets[-1])
            if n:
                def fin_args(r):
                    gg = rng_for("fin-red", li, r)
                    ex, idx, kw = finalize_case(gg, 0, np.float32, n=n, k=2)
                    return ex, idx, kw

                total = np.sum(
                    [
                        finalize_golden(a[0], a[1], a[2]["x1"], a[2]["x2"], a[2]["bias"], a[2]["scales"], a[2]["expert_idx"], 0)
                        for a in map(fin_args, range(world_size))
                    ],
                    axis=0,
                )
                ex, idx, kw = fin_args(rank)
                got = am.finalize_and_reduce(ex, idx, layout, world, **kw)
                assert_close(got, total[offsets[rank] : offsets[rank + 1]], np.float32, "finalize_and_reduce")
                checks += 1

        # Reduce policy over TP groups of 2 (EP = world): for every static policy
        # and every live comm type the layer output is sum_i S_i + R.
        tp_size = 2
        with _tp_split(world, rank, tp_size) as tp:
            tp_rank = tp.rank
            group = rank // tp_size
            for sp in (False, True):
                # With SP on and TP > 1 a TP-sharded shared expert is
                # sequence_parallel_only (SPEC section 5): tensor_parallel is refused.
                modes = ["none", "data_parallel_only"] + ([] if sp else ["tensor_parallel"])
                if sp:
                    modes += ["sequence_parallel_sedp", "sequence_parallel_only"]
                    try:
                        am.ReducePolicy("tensor_parallel", False, True, tp_size, world_size)
                        raise AssertionError("tensor_parallel with sp and tp 2 was accepted")
                    except am.AmoeError as e:
                        assert "SequenceParallelOnly" in str(e), str(e)
                for mode in modes:
                    for transform in (False, True):
                        policy = am.ReducePolicy(mode, transform, sp, tp_size, world_size)
                        for ct in am.CommType:
                            gg = rng_for("policy", group, int(ct), mode, int(sp), int(transform))
                            shared, s_full, routed_parts, r_full = policy_case(gg, mode, tp_size, tp_rank)
                            routed = (
                                r_full.astype(np.float32) if am.routed_is_reduced(ct, sp) else routed_parts[tp_rank]
                            )
                            routed = policy.reduce_routed_early(routed, ct, tp)
                            shared = policy.reduce_shared(shared, ct, tp)
                            out = policy.reduce_final(shared + routed, ct, tp)
                            assert_close(out, s_full + r_full, np.float32, f"policy {policy} under {ct.name}")
                            checks += 1
        world.barrier()
    return checks


def policy_case(gg, mode, tp_size, tp_rank):
    """One reduction-point case of a TP group: this rank's shared-expert output
    for `mode` and its exact sum over the group, and every rank's routed
    partial with their exact sum. Returns `(shared, s_full, routed_parts, r_full)`."""
    shared_parts = [rand(gg, (4, 3), np.float32) for _ in range(tp_size)]
    routed_parts = [rand(gg, (4, 3), np.float32) for _ in range(tp_size)]
    r_full = np.sum(routed_parts, axis=0, dtype=np.float64)
    if mode == "none":
        shared, s_full = np.zeros((4, 3), np.float32), 0.0
    elif mode == "tensor_parallel":
        shared, s_full = shared_parts[tp_rank], np.sum(shared_parts, axis=0, dtype=np.float64)
    else:  # complete on every rank
        shared, s_full = shared_parts[0], shared_parts[0].astype(np.float64)
    return shared, s_full, routed_parts, r_full


def _expect_error(fn, *args, **kw):
    """Runs `fn`, which must raise AmoeError; returns (status name, seconds, message)."""
    t0 = time.monotonic()
    try:
        fn(*args, **kw)
    except am.AmoeError as e:
        return (am.Status(e.status).name, time.monotonic() - t0, str(e))
    raise AssertionError(f"{getattr(fn, '__name__', fn)} did not raise AmoeError")


def error_paths(name, world_size, rank):
    """Each case in a fresh world with a short timeout; returns what every
    rank observed: {case: (status, seconds, message)}."""
    seen = {}
    x = np.ones((world_size * 2, 3), np.float32)

    # Bad dtype, local: float64 is not a library dtype; int32 data into finalize.
    seen["numpy_float64"] = _expect_error(am.moe_token_unpermute, x.astype(np.float64), np.zeros(2, np.int32))
    seen["int_data"] = _expect_error(am.moe_finalize_routing, x.astype(np.int32), np.arange(8, dtype=np.int32))
    seen["index_out_of_range"] = _expect_error(
        am.moe_finalize_routing, x, np.array([0, 1, 2, 3, 4, 5, 6, 99], np.int32)
    )

    # Bad dtype in a collective: rank 1 sends f16 while the others send f32.
    with am.Comm.cpu(name + "-dtype", world_size, rank, timeout_s=SHORT_TIMEOUT_S) as c:
        seen["collective_dtype"] = _expect_error(am.all_reduce, x.astype(np.float16) if rank == 1 else x, c)

    # Wrong row count: rank 1 passes one row too many to gather-unpad.
    layout = am.SpLayout([2, 3, 1, 2])
    with am.Comm.cpu(name + "-rows", world_size, rank, timeout_s=SHORT_TIMEOUT_S) as c:
        rows = layout.local_sizes[rank] + (1 if rank == 1 else 0)
        seen["wrong_rows"] = _expect_error(am.maybe_all_gather_and_maybe_unpad, np.ones((rows, 4), np.float32), layout, c)

    # Mismatched collective: rank 0 all-gathers, the others all-reduce.
    with am.Comm.cpu(name + "-mismatch", world_size, rank, timeout_s=SHORT_TIMEOUT_S) as c:
        seen["mismatch"] = _expect_error(am.all_gather if rank == 0 else am.all_reduce, x, c)
    return seen


def killed_peer(name, world_size, rank):
    """The last rank exits right after joining; the others' next collective
    must fail (not hang) within the timeout."""
    with am.Comm.cpu(name, world_size, rank, timeout_s=SHORT_TIMEOUT_S) as c:
        c.barrier()
        if rank == world_size - 1:
            os._exit(17)
        return _expect_error(am.all_reduce, np.ones(4, np.float32), c)


def prepare_finalize(name, world_size, rank):
    """Token prepare then finalize with identity experts, every comm type, with
    and without SP (SPEC section 6): ALLGATHER returns `DP * x` without SP (the
    DP reduce-scatter sums the DP copies) and `EP * x` with SP (the EP
    reduce-scatter sums every rank's copy); MC2 / ALLTOALL return `x`."""
    tp, dp_tokens = 2, [3, 1]
    dp_size = world_size // tp
    d, t = rank // tp, rank % tp
    checks = 0
    with am.Comm.cpu(name, world_size, rank, timeout_s=30.0) as world, am.MoeGroups(world, tp) as groups:
        for sp in (False, True):
            ctx = am.MoeContext(dp_tokens, tp, d, t, sp)
            rows = -(-dp_tokens[d] // tp) if sp else dp_tokens[d]
            x = rand(rng_for("prep", rank if sp else d, int(sp)), (rows, 4), np.float32)
            for ct in am.CommType:
                hidden, mask = am.token_prepare(x, ct, ctx, groups)
                assert hidden.shape == am.shapes.token_prepare(x, ct, ctx)
                if ct in (am.CommType.MC2, am.CommType.FUSED_MC2) and not sp:
                    chunk = -(-max(dp_tokens) // tp)
                    np.testing.assert_array_equal(mask, [t * chunk + i < dp_tokens[d] for i in range(chunk)])
                else:
                    assert mask is None or ct in (am.CommType.MC2, am.CommType.FUSED_MC2)
                back = am.token_finalize(hidden, ct, ctx, groups)
                factor = (world_size if sp else dp_size) if ct == am.CommType.ALLGATHER else 1
                assert_close(back, x.astype(np.float64) * factor, np.float32, f"round trip {ct.name} sp={sp}")
                checks += 1
    return checks


def shared_helpers(name, world_size, rank):
    """The shared-expert token helpers over TP groups of 2 against numpy
    (SPEC section 5): DP-only pad/split then gather/unpad returns the MLP of
    every row; SP-only gather/unpad returns the DP batch, pad/reduce-scatter
    this rank's chunk of the sum of the TP partials."""
    tp_size, checks = 2, 0
    with am.Comm.cpu(name, world_size, rank, timeout_s=30.0) as world, _tp_split(world, rank, tp_size) as tp:
        t, group = tp.rank, rank // tp_size
        for tokens in (0, 1, 4, 5):
            part = -(-tokens // tp_size)
            batch = rand(rng_for("shared-batch", group, tokens), (tokens, 3), np.float32)
            padded = np.zeros((part * tp_size, 3), np.float32)
            padded[:tokens] = batch
            mine = am.shared_pad_split(batch, tp)
            assert mine.shape == am.shapes.shared_pad_split(batch, tp) == (part, 3)
            np.testing.assert_array_equal(mine, padded[t * part : (t + 1) * part])
            back = am.shared_gather_unpad(mine * 2.0, tokens, tp)
            np.testing.assert_array_equal(back, batch * 2.0)
            full = am.shared_gather_unpad(padded[t * part : (t + 1) * part], tokens, tp)
            np.testing.assert_array_equal(full, batch)
            partials = [rand(rng_for("shared-part", group, tokens, q), (tokens, 3), np.float32) for q in range(tp_size)]
            got = am.shared_pad_reduce_scatter(partials[t], tp)
            total = np.zeros((part * tp_size, 3))
            total[:tokens] = np.sum(partials, axis=0, dtype=np.float64)
            assert got.shape == am.shapes.shared_pad_reduce_scatter(partials[t], tp)
            assert_close(got, total[t * part : (t + 1) * part], np.float32, f"pad_reduce_scatter T={tokens}")
            checks += 4
        try:
            am.shared_gather_unpad(np.zeros((2, 3), np.float32), 5, tp)
            raise AssertionError("a 2-row shard for 5 tokens on TP 2 was accepted")
        except am.AmoeError as e:
            assert "3 rows" in str(e), str(e)
        world.barrier()
    return checks


def pcp_actual(name, world_size, rank):
    """DP 2 x PCP 2 x TP 1 (EP rank `(dp * 2 + pcp)`): ALLGATHER without SP
    gathers DP then PCP and finalizes PCP then DP (SPEC section 6); the MC2 mask
    on TP groups of 2 marks the first `num_actual_tokens` rows."""
    dp_tokens = [3, 1]
    d, p = rank // 2, rank % 2
    with am.Comm.cpu(name, world_size, rank, timeout_s=30.0) as world:
        with am.MoeGroups(world, 1, pcp_size=2) as groups:
            ctx = am.MoeContext(dp_tokens, 1, d, 0, False, pcp_size=2, pcp_rank=p)
            tok = lambda dd, pp: rand(rng_for("pcp", dd, pp), (dp_tokens[dd], 2), np.float32)  # noqa: E731
            hidden, _ = am.token_prepare(tok(d, p), am.CommType.ALLGATHER, ctx, groups)
            blocks = []
            for pp in range(2):
                for dd in range(2):
                    b = np.zeros((3, 2), np.float32)
                    b[: dp_tokens[dd]] = tok(dd, pp)
                    blocks.append(b)
            np.testing.assert_array_equal(hidden, np.concatenate(blocks))
            back = am.token_finalize(hidden * np.float32(rank + 1), am.CommType.ALLGATHER, ctx, groups)
            assert_close(back, tok(d, p).astype(np.float64) * (1 + 2 + 3 + 4), np.float32, "pcp finalize")
        with am.MoeGroups(world, 2) as groups:
            # DP 2 x TP 2, tokens [6, 3]: MC2 pads to 6, 3 rows per TP rank; DP 0 has 4 real tokens.
            t = rank % 2
            ctx = am.MoeContext([6, 3], 2, d, t, False, num_actual_tokens=4 if d == 0 else None)
            x = rand(rng_for("actual", d), ([6, 3][d], 2), np.float32)
            _, mask = am.token_prepare(x, am.CommType.MC2, ctx, groups)
            want = {(0, 0): [True, True, True], (0, 1): [True, False, False], (1, 0): [True, True, True], (1, 1): [False] * 3}
            np.testing.assert_array_equal(mask, want[(d, t)])
            # The engine pads to 8 rows (vLLM-Ascend's padded_num_tokens) and
            # owns the mask buffer: this TP rank's slice of it is written in place.
            ctx8 = am.MoeContext([6, 3], 2, d, t, False, num_actual_tokens=4 if d == 0 else None, padded_num_tokens=8)
            engine = np.full(8, 7, dtype=np.uint8)
            hidden, got = am.token_prepare(x, am.CommType.FUSED_MC2, ctx8, groups, mc2_mask=engine[4 * t : 4 * t + 4])
            assert got.base is engine or got.base is engine.base, "the mask is the engine's buffer"
            real = [4, 3][d]
            want8 = [1 if 4 * t + i < real else 0 for i in range(4)]
            np.testing.assert_array_equal(engine[4 * t : 4 * t + 4], want8)
            assert (engine[4 * (1 - t) : 4 * (1 - t) + 4] == 7).all(), "the other TP rank's slice is untouched"
            rows = [x[4 * t + i] if 4 * t + i < x.shape[0] else np.zeros(2, np.float32) for i in range(4)]
            np.testing.assert_array_equal(hidden, np.stack(rows))
            np.testing.assert_array_equal(am.token_finalize(hidden, am.CommType.FUSED_MC2, ctx8, groups), x)
            for bad, why in ((np.zeros(3, np.uint8), "length"), (np.zeros(4, np.float32), "dtype")):
                try:
                    am.token_prepare(x, am.CommType.MC2, ctx8, groups, mc2_mask=bad)
                except am.AmoeError as e:
                    assert "mc2_mask" in str(e), (why, e)
                else:
                    raise AssertionError(f"a mask buffer of the wrong {why} was accepted")
        world.barrier()
    return 2


def comm_type_disagreement(name, world_size, rank):
    """DP 2 x TP 2 where DP 0 picks ALLGATHER and DP 1 MC2 (vLLM-Ascend
    #12195): every rank's token_prepare must raise, naming the choices."""
    tp = 2
    d, t = rank // tp, rank % tp
    with am.Comm.cpu(name, world_size, rank, timeout_s=SHORT_TIMEOUT_S) as world, am.MoeGroups(world, tp) as groups:
        ctx = am.MoeContext([6, 3], tp, d, t, False)
        x = np.ones(([6, 3][d], 4), np.float32)
        ct = am.CommType.ALLGATHER if d == 0 else am.CommType.MC2
        return _expect_error(am.token_prepare, x, ct, ctx, groups)


def reduction_point_disagreements(name, world_size, rank):
    """TP groups of 2 (ranks {0, 1}, {2, 3}). Group 0: TP rank 0 passes
    ALLGATHER (reduce_final reduces) and TP rank 1 MC2 (it copies). Group 1:
    TP rank 0 has no rows, TP rank 1 four. Both are errors on every rank of
    the group, never a rank that returns (an unreduced value, or a sum that
    pairs with its peer's next call)."""
    tp_rank = rank % 2
    with am.Comm.cpu(name, world_size, rank, timeout_s=SHORT_TIMEOUT_S) as world:
        with world.split([rank - tp_rank, rank - tp_rank + 1]) as tp:
            policy = am.ReducePolicy(None, False, False, 2, 2)
            if rank < 2:
                x = np.full((2, 3), 10.0 ** tp_rank, np.float32)
                ct = am.CommType.ALLGATHER if tp_rank == 0 else am.CommType.MC2
                first = _expect_error(policy.reduce_final, x, ct, tp)
            else:
                x = np.ones((4 * tp_rank, 3), np.float32)
                first = _expect_error(policy.reduce_final, x, am.CommType.ALLGATHER, tp)
            # The shared-expert helpers with one empty rank fail on both ranks too.
            rows = np.ones((2 * tp_rank, 3), np.float32)
            helpers = [
                _expect_error(am.shared_pad_reduce_scatter, rows, tp)[0],
                _expect_error(am.shared_gather_unpad, rows, 4 * tp_rank, tp)[0],
            ]
            return first, helpers


def byte_moves(name, world_size, rank):
    """SPEC section 8: int8, uint8 (packed fp4), bool and fp8 arrays, and 1-D
    f32 per-token scales, through all_gather, broadcast and the SP gather as
    exact bytes; a reduction of them is refused on every rank."""
    layout = am.SpLayout([3, 0, 2, 4][:world_size])
    rows = layout.local_sizes[rank]
    dtypes = [np.int8, np.uint8, np.bool_, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2]

    def raw(r, n):
        return ((np.arange(n) * 13 + r * 77 + 5) % 256).astype(np.uint8)

    checks = 0
    with am.Comm.cpu(name, world_size, rank, timeout_s=30.0) as c:
        for dt in dtypes:
            if dt is np.bool_:
                cast = lambda b: (b % 2).astype(np.bool_)  # noqa: E731 - numpy bools are 0 / 1
            else:
                cast = lambda b, dt=dt: b.view(dt)  # noqa: E731
            x = cast(raw(rank, 12).reshape(4, 3))
            got = am.all_gather(x, c)
            want = np.concatenate([cast(raw(q, 12).reshape(4, 3)) for q in range(world_size)])
            assert got.dtype == np.dtype(dt) and got.tobytes() == want.tobytes(), dt
            got = am.broadcast(x, c, root=world_size - 1)
            assert got.tobytes() == cast(raw(world_size - 1, 12).reshape(4, 3)).tobytes(), dt
            shard = cast(raw(rank, rows * 6).reshape(rows, 6))
            got = am.maybe_all_gather_and_maybe_unpad(shard, layout, c)
            want = np.concatenate([cast(raw(q, layout.local_sizes[q] * 6).reshape(-1, 6)) for q in range(world_size)])
            assert got.tobytes() == want.tobytes(), dt
            seen = _expect_error(am.all_reduce, x, c)
            assert seen[0] == "DTYPE" and "never reduced" in seen[2], seen
            checks += 4
        scales = (np.arange(rows, dtype=np.float32) + 10 * rank) / 8
        got = am.maybe_all_gather_and_maybe_unpad(scales, layout, c)
        want = np.concatenate([(np.arange(n, dtype=np.float32) + 10 * q) / 8 for q, n in enumerate(layout.local_sizes)])
        np.testing.assert_array_equal(got, want)
        c.barrier()
    return checks + 1


def first_handle_id(name, world_size, rank):
    """The handle id of this process's first communicator."""
    with am.Comm.cpu(name, world_size, rank) as c:
        return c.handle_id
