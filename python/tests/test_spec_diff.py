"""Differential tests against references written from SPEC.md alone.

The references below are float32 numpy in the order SPEC section 1 fixes
(`acc = x1 (+ x2)`, then `acc += s * (row + bias)` for k = 0..K-1, one final
rounding) and section 8 fixes for the CPU reductions (rank order 0..n-1, f32
accumulation), so results are compared bit for bit, not within a tolerance.
Multi-rank cases run the ranks as threads of this process (ctypes releases
the GIL), each world with a short timeout, so nothing here can hang."""

from __future__ import annotations

import itertools
import threading
import uuid

import ml_dtypes
import numpy as np
import pytest

import ascend_moe as am

F32 = np.float32
BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [np.dtype(F32), np.dtype(np.float16), BF16]
CT = am.CommType


# ------------------------------------------------------------ references


def finalize_ref(ex, idx, x1=None, x2=None, bias=None, scales=None, expert_idx=None, mode=0):
    """SPEC section 1, in f32 and in the stated order; IndexError for a bad index."""
    hs = ex.shape[2:] if mode in (1, 3) else ex.shape[1:]
    h = int(np.prod(hs, dtype=np.int64))
    rows = ex.reshape(-1, h).astype(F32)
    n, k = scales.shape if scales is not None else (idx.shape[0], 1)
    lo = -1 if mode in (1, 3) else 0
    acc = np.zeros((n, h), F32)
    if x1 is not None:
        acc = acc + x1.reshape(n, h).astype(F32)
    if x2 is not None:
        acc = acc + x2.reshape(n, h).astype(F32)
    for j in range(k):
        for i in range(n):
            r = int(idx[j * n + i] if mode in (0, 1) else idx[i * k + j])
            if not lo <= r < rows.shape[0]:
                raise IndexError((i, j, r))
            v = np.zeros(h, F32) if r == -1 else rows[r]
            if bias is not None:
                v = v + bias.reshape(bias.shape[0], h)[int(expert_idx[i, j])].astype(F32)
            s = F32(1) if scales is None else F32(scales[i, j].astype(F32))
            acc[i] = acc[i] + s * v
    return acc.astype(ex.dtype).reshape((n,) + tuple(hs))


def unpermute_ref(p, s, probs=None):
    t, k = probs.shape if probs is not None else (s.shape[0], 1)
    rows = p.reshape(p.shape[0], -1).astype(F32)
    acc = np.zeros((t, rows.shape[1]), F32)
    for i, j in itertools.product(range(t), range(k)):
        r = int(s[i * k + j])
        if 0 <= r < rows.shape[0]:
            acc[i] = acc[i] + (F32(1) if probs is None else F32(probs[i, j].astype(F32))) * rows[r]
    return acc.astype(p.dtype).reshape((t,) + p.shape[1:])


def ceil_div(a, b):
    return -(-a // b)


def sp_sizes(dp_tokens, tp):
    return [ceil_div(t, tp) for t in dp_tokens for _ in range(tp)]


def pad_reduce_ref(xs, sizes, rank):
    off = int(sum(sizes[:rank]))
    acc = np.zeros_like(xs[0][off : off + sizes[rank]], dtype=F32)
    for x in xs:  # rank order, f32
        acc = acc + x[off : off + sizes[rank]].astype(F32)
    return acc.astype(xs[0].dtype)


def run_threads(fn, n, timeout_s=3.0):
    """`fn(comm, rank)` on every rank of a fresh n-rank CPU world (threads);
    returns `{rank: ("ok", value) | ("err", AmoeError)}`; fails on a hang."""
    name, res = f"spec-diff-{uuid.uuid4().hex[:12]}", {}

    def main(r):
        try:
            with am.Comm.cpu(name, n, r, timeout_s=timeout_s) as c:
                res[r] = ("ok", fn(c, r))
        except am.AmoeError as e:
            res[r] = ("err", e)
        except BaseException as e:  # noqa: BLE001 - a wrong exception type is a failure too
            res[r] = ("bug", e)

    ts = [threading.Thread(target=main, args=(r,), daemon=True) for r in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(20 + timeout_s)
    assert len(res) == n, f"ranks {sorted(set(range(n)) - set(res))} hung"
    bugs = {r: v for r, (k, v) in res.items() if k == "bug"}
    assert not bugs, bugs
    return res


def assert_every_rank_fails(res, naming=None):
    """No rank returned; with `naming`, every rank's error contains it."""
    ok = sorted(r for r, (k, _) in res.items() if k == "ok")
    assert not ok, (
        f"ranks {ok} returned although the ranks disagree: "
        + "; ".join(f"rank {r}: {'shape ' + str(v.shape) if k == 'ok' else 'error ' + str(v)[:100]}" for r, (k, v) in sorted(res.items()))
    )
    if naming is not None:
        for r, (_, e) in sorted(res.items()):
            assert naming in str(e), f"rank {r}: {e}"


def rnd(rng, shape, dtype):
    return rng.uniform(-2, 2, size=shape).astype(F32).astype(dtype)


# ------------------------------------------------------- local ops (section 1)


def test_finalize_routing_is_bitwise_the_spec_reference():
    """Every mode, dtype, optional input, f32 or data-dtype scales, N = 0 / 1,
    K = 1..8, H = 1, trailing hidden shapes, duplicate rows, dropped slots."""
    rng = np.random.default_rng(20261204)
    for trial in range(400):
        mode, dt = int(rng.integers(4)), DTYPES[trial % 3]
        n, k = int(rng.choice([0, 1, 2, 5])), int(rng.choice([1, 2, 3, 8]))
        hs, e, cap = [(1,), (4,), (2, 3)][trial % 3], int(rng.integers(1, 4)), int(rng.integers(1, 4))
        with_scales, with_bias = trial % 4 != 0, bool(rng.integers(2))
        k = k if with_scales else 1
        if mode in (1, 3):
            ex, idx = rnd(rng, (e, cap) + hs, dt), rng.integers(-1, e * cap, n * k).astype(np.int32)
        else:
            ex = rnd(rng, (n * k,) + hs, dt)
            idx = (rng.permutation(n * k) if trial % 2 else rng.integers(0, max(n * k, 1), n * k)).astype(np.int32)
        kw = dict(
            x1=rnd(rng, (n,) + hs, dt) if rng.integers(2) else None,
            x2=rnd(rng, (n,) + hs, dt) if rng.integers(2) else None,
            bias=rnd(rng, (e,) + hs, dt) if with_bias else None,
            scales=rnd(rng, (n, k), dt if rng.integers(2) else F32) if with_scales else None,
            expert_idx=rng.integers(0, e, (n, k)).astype(np.int32) if with_bias else None,
        )
        want = finalize_ref(ex, idx, mode=mode, **kw)
        got = am.moe_finalize_routing(ex, idx, drop_pad_mode=mode, **kw)
        assert got.dtype == want.dtype and got.shape == want.shape, (trial, got.shape, want.shape)
        assert got.tobytes() == want.tobytes(), f"trial {trial}: mode {mode} {dt} n={n} k={k} {hs}"


@pytest.mark.parametrize("mode,bad", [(0, -1), (0, 6), (2, -1), (2, 6), (1, -2), (1, 6), (3, -2), (3, 6), (0, -(2**31))])
def test_finalize_index_outside_its_range_is_an_error_naming_position_and_value(mode, bad):
    ex = np.ones((2, 3, 4), F32) if mode in (1, 3) else np.ones((6, 4), F32)
    idx = np.arange(6, dtype=np.int32)
    idx[3] = bad
    with pytest.raises(am.IndexOutOfRangeError, match=rf"\[3\] = {bad}\b"):
        am.moe_finalize_routing(ex, idx, scales=np.ones((3, 2), F32), drop_pad_mode=mode)


def test_finalize_out_may_alias_an_input_and_non_contiguous_inputs_are_read_right():
    rng = np.random.default_rng(3)
    for mode in (0, 2):
        ex, idx = rnd(rng, (8, 3), F32), rng.permutation(8).astype(np.int32)
        sc, x1 = rnd(rng, (4, 2), F32), rnd(rng, (4, 3), F32)
        want = finalize_ref(ex, idx, x1=x1, scales=sc, mode=mode)
        for alias in ("x1", "ex_head", "ex_tail"):
            e, x = ex.copy(), x1.copy()
            out = {"x1": x, "ex_head": e[:4], "ex_tail": e[4:]}[alias]
            got = am.moe_finalize_routing(e, idx, x1=x, scales=sc, drop_pad_mode=mode, out=out)
            assert got.tobytes() == want.tobytes(), (mode, alias)
        # Strided / transposed / reversed views are read by their values.
        wide = np.repeat(ex, 2, axis=1)[:, ::2]
        got = am.moe_finalize_routing(wide, np.repeat(idx, 2)[::2], x1=x1.T.copy().T, scales=sc.T.copy().T, drop_pad_mode=mode)
        assert got.tobytes() == want.tobytes()


def test_token_unpermute_is_bitwise_the_spec_reference():
    rng = np.random.default_rng(5)
    for dt, pdt in itertools.product(DTYPES, (None, "same", F32)):
        t, k = 6, 4
        p = rnd(rng, (t * k, 5), dt)
        s = rng.integers(-3, t * k + 3, t * k).astype(np.int32)  # some out of range: contribute nothing
        probs = None if pdt is None else rnd(rng, (t, k), dt if pdt == "same" else F32)
        if probs is not None:
            probs[0, 1] = np.nan  # at an out-of-range index it contributes nothing
            s[1] = t * k + 7
        else:
            s = s[:t]
        assert am.moe_token_unpermute(p, s, probs).tobytes() == unpermute_ref(p, s, probs).tobytes(), (dt, pdt)


def test_reduce_policy_decisions_are_the_spec_table():
    """Section 5, every valid static policy under every live comm type."""
    modes = ["none", "tensor_parallel", "sequence_parallel_sedp", "sequence_parallel_only", "data_parallel_only"]
    for mode, tr, sp, tp, ep in itertools.product(modes, (False, True), (False, True), (1, 2, 4), (4, 8)):
        if mode.startswith("sequence_parallel") and not sp:
            continue
        if mode == "tensor_parallel" and sp and tp > 1:
            with pytest.raises(am.AmoeError, match="SequenceParallelOnly"):
                am.ReducePolicy(mode, tr, sp, tp, ep)
            continue
        policy = am.ReducePolicy(mode, tr, sp, tp, ep)
        early = mode == "data_parallel_only" or (tr and not sp and (tp > 1 or ep > 1))
        for ct in CT:
            red = ct in (CT.MC2, CT.ALLTOALL, CT.FUSED_MC2) or (ct == CT.ALLGATHER and sp)
            assert am.routed_is_reduced(ct, sp) == red
            want = {
                "early": early,
                "routed": early and not red,
                "shared": (early or red) if mode == "tensor_parallel" else False,
                "final": not sp and not early and not red,
            }
            assert policy.decisions(ct) == want, (mode, tr, sp, tp, ep, ct.name)


# ------------------------------------------------- EP/SP ops (sections 2-4, 6)


@pytest.mark.parametrize("n", [2, 4])
def test_pad_reduce_and_gather_unpad_are_bitwise_the_spec_reference(n):
    rng = np.random.default_rng(n)
    layouts = [[0] * n, [1] + [0] * (n - 1), [int(v) for v in rng.integers(0, 5, n)], sp_sizes([5, 2], n // 2)]
    for li, sizes in enumerate(layouts):
        for dt in DTYPES:
            xs = [rnd(rng, (sum(sizes), 2, 3), dt) for _ in range(n)]
            shards = [rnd(rng, (sizes[r], 2, 3), dt) for r in range(n)]
            res = run_threads(
                lambda c, r: (am.maybe_pad_and_reduce(xs[r], sizes, c), am.maybe_all_gather_and_maybe_unpad(shards[r], sizes, c)), n
            )
            for r in range(n):
                kind, (red, gat) = res[r]
                assert red.tobytes() == pad_reduce_ref(xs, sizes, r).tobytes() and red.shape == (sizes[r], 2, 3)
                assert gat.tobytes() == np.concatenate(shards).tobytes() and gat.shape == (sum(sizes), 2, 3)


def prepare_ref(ct, dp_tokens, tp, d, t, sp, x):
    """This rank's prepared tokens (section 6; no SP: `x` is the DP batch, the same on every TP rank)."""
    if sp:
        return x  # MC2 / ALLTOALL with SP: already sharded (ALLGATHER + SP is section 4, tested above)
    if ct == CT.ALLGATHER:
        raise AssertionError("needs every DP rank's batch")
    rows = ceil_div(max(dp_tokens), tp) * tp if ct in (CT.MC2, CT.FUSED_MC2) else max(dp_tokens[d], tp)
    b = np.zeros((rows,) + x.shape[1:], x.dtype)
    b[: dp_tokens[d]] = x
    base, extra = divmod(rows, tp)
    starts = np.cumsum([0] + [base + (q < extra) for q in range(tp)])
    return b[starts[t] : starts[t + 1]]


def test_mc2_and_alltoall_prepare_finalize_are_the_spec_layout():
    """DP 2 x TP 2, uneven and tiny DP token counts (tokens < TP, 0 tokens)."""
    tp, rng = 2, np.random.default_rng(9)
    for dp_tokens, ct, sp in itertools.product(([5, 2], [1, 0], [0, 3]), (CT.MC2, CT.FUSED_MC2, CT.ALLTOALL), (False, True)):
        batches = [rnd(rng, (ceil_div(t, tp) if sp else t, 3), BF16) for t in dp_tokens for _ in range(tp)]
        if not sp:
            batches = [batches[d * tp] for d in range(2) for _ in range(tp)]

        def body(c, r):
            d, t = divmod(r, tp)
            with am.MoeGroups(c, tp) as g:
                ctx = am.MoeContext(dp_tokens, tp, d, t, sp)
                h, mask = am.token_prepare(batches[r], ct, ctx, g)
                return h, mask, am.token_finalize(h * BF16.type(r + 1), ct, ctx, g)

        res = run_threads(body, 4)
        for r in range(4):
            d, t = divmod(r, tp)
            h, mask, back = res[r][1]
            want = prepare_ref(ct, dp_tokens, tp, d, t, sp, batches[r])
            assert h.shape == want.shape and h.tobytes() == want.tobytes(), (dp_tokens, ct.name, sp, r)
            if ct != CT.ALLTOALL and not sp:
                np.testing.assert_array_equal(mask, [t * len(h) + i < dp_tokens[d] for i in range(len(h))])
            if sp:
                assert back.tobytes() == (batches[r] * BF16.type(r + 1)).tobytes()
            else:
                parts = [prepare_ref(ct, dp_tokens, tp, d, q, sp, batches[r]) * BF16.type(d * tp + q + 1) for q in range(tp)]
                assert back.tobytes() == np.concatenate(parts)[: dp_tokens[d]].tobytes(), (dp_tokens, ct.name, r)


# ------------------------------------ disagreeing arguments across ranks


def test_a_local_argument_error_on_one_rank_fails_every_rank_without_a_hang():
    res = run_threads(lambda c, r: am.maybe_pad_and_reduce(np.ones((4 + (r == 3), 2), F32), [1, 1, 1, 1], c), 4)
    assert_every_rank_fails(res)
    assert isinstance(res[3][1], am.InvalidArgumentError) and "5 rows" in str(res[3][1])


def test_finalize_and_reduce_fails_every_rank_when_layouts_disagree():
    """The fused op compares the ranks' layouts: the behaviour the two tests
    below expect of its unfused halves."""
    res = run_threads(
        lambda c, r: am.finalize_and_reduce(np.ones((3, 2), F32), np.arange(3, dtype=np.int32), [[2, 1], [1, 2]][r], c), 2
    )
    assert_every_rank_fails(res, naming="ranks disagree")


def test_maybe_pad_and_reduce_fails_every_rank_when_layouts_disagree():
    """Section 3 packs by the layout and section 8 forbids silent garbage: rank 0
    passes [2, 1], rank 1 [1, 2] (same M, so the padded reduce-scatter counts
    match). Every rank must fail, naming the counts: summing the padded slots
    would give rank 0 its own value as its second row, not a sum."""
    res = run_threads(lambda c, r: am.maybe_pad_and_reduce(np.full((3, 2), r + 1, F32), [[2, 1], [1, 2]][r], c), 2)
    assert_every_rank_fails(res, naming="counts [4, 2]")


def test_maybe_all_gather_and_maybe_unpad_fails_every_rank_when_layouts_disagree():
    """Same for section 4: rank 0 passes [2, 1], rank 1 [1, 2], each with its
    own 2 rows (same M, so the padded all-gather counts match)."""
    layouts = [[2, 1], [1, 2]]
    res = run_threads(lambda c, r: am.maybe_all_gather_and_maybe_unpad(np.full((2, 2), r + 1, F32), layouts[r], c), 2)
    assert_every_rank_fails(res, naming="counts [4, 2]")


def test_sp_allgather_prepare_fails_every_rank_when_dp_token_counts_disagree():
    """The DP token counts are forward context (section 5) every EP rank must
    share. DP 2 x TP 1 with SP: rank 1 has a stale count (2 instead of 3), so
    the ranks would gather 8 and 7 rows; both must fail instead, at the
    comm-type check, which compares the contexts too."""
    dp = [[5, 3], [5, 2]]

    def body(c, r):
        with am.MoeGroups(c, 1) as g:
            ctx = am.MoeContext(dp[r], 1, r, 0, True)
            return am.token_prepare(np.ones((dp[r][r], 2), F32), CT.ALLGATHER, ctx, g)[0]

    assert_every_rank_fails(run_threads(body, 2), naming="not on the forward context")


@pytest.mark.parametrize("cts,dp_tokens,tp", [((CT.ALLGATHER, CT.MC2), [1], 2), ((CT.MC2, CT.ALLTOALL), [4], 2), ((CT.MC2, CT.ALLGATHER), [1, 1], 1)])
def test_token_finalize_fails_every_rank_when_the_ranks_disagree_on_the_comm_type(cts, dp_tokens, tp):
    """Section 5: all EP ranks of a forward agree on the comm type, and a
    disagreement is an error on every rank naming the choices. Every rank
    prepares with MC2, then the ranks finalize with different comm types
    whose plans take the same expert-output rows (DP 1 x TP 2 with 1 token:
    ALLGATHER keeps the 1 DP-gathered row, MC2 all-gathers 1 row per TP rank;
    4 tokens: MC2 and ALLTOALL both split 2 + 2; DP 2 x TP 1: ALLGATHER's
    reduce-scatter and MC2's local copy). Without a check one rank returns
    while its peer waits in a collective the other never joins, or both
    return from different paths."""

    def body(c, r):
        d, t = divmod(r, tp)
        with am.MoeGroups(c, tp) as g:
            ctx = am.MoeContext(dp_tokens, tp, d, t)
            h, _ = am.token_prepare(np.ones((dp_tokens[d], 2), F32), CT.MC2, ctx, g)
            rows = {CT.ALLGATHER: len(dp_tokens) * max(dp_tokens)}.get(cts[r], len(h))
            return am.token_finalize(np.ones((rows, 2), F32), cts[r], ctx, g)

    assert_every_rank_fails(run_threads(body, len(dp_tokens) * tp), naming="disagree on the MoE comm type")
