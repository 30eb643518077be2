"""The torch custom ops under a dynamic token dimension, as vLLM compiles its
model: `torch.compile(fullgraph=True)` with the input's dim 0 marked dynamic
(`torch._dynamo.mark_dynamic`). A fake that turned the token count into a
constant of the graph fails to compile (ConstraintViolationError); one graph
then runs at several token counts, with the outputs of the real ops, and a
token count the op cannot take still fails when the op runs.

Skipped only when torch is not importable outside CI; under CI (`$CI` set)
a missing torch fails the run instead of skipping it."""

import threading
import uuid

import numpy as np
import pytest

import ascend_moe as am

from workers import require, torch_ops_missing  # noqa: E402

require("torch custom-op", torch_ops_missing())

import torch  # noqa: E402

from torch_workers import to_numpy, to_torch  # noqa: E402
from workers import assert_close, finalize_case, finalize_golden, rand, rng_for, unpermute_golden  # noqa: E402

OPS = torch.ops.ascend_moe
ROWS = (4, 8)


def _compile(fn):
    torch._dynamo.reset()
    return torch.compile(fn, backend="aot_eager", fullgraph=True)


def _dynamic(*tensors):
    """`tensors` with dim 0 marked dynamic (all of them: each its own symbol)."""
    for t in tensors:
        torch._dynamo.mark_dynamic(t, 0)
    return tensors


def _plus_one(y, rows):
    """`y + 1` through ones of `rows` rows, an expression of the graph's input
    sizes: traced, the fake's output must have those rows (symbolically, or
    the add does not trace), and run, the real op's."""
    return y + torch.ones((rows, *y.shape[1:]), dtype=y.dtype)


def _tokens(rows, rank=0, cols=2):
    return torch.arange(rows * cols, dtype=torch.float32).view(rows, cols) + 100.0 * rank


def _name(what):
    return f"torch-dyn-{what}-{uuid.uuid4().hex[:8]}"


ONE_RANK_OPS = [
    "all_reduce",
    "reduce_scatter",
    "all_gather",
    "maybe_pad_and_reduce",
    "maybe_all_gather_and_maybe_unpad",
    "reduce_routed_early",
    "reduce_shared",
    "reduce_final",
]


@pytest.mark.parametrize("name", ONE_RANK_OPS)
def test_collectives_and_reduction_points_keep_the_token_dimension_dynamic_on_one_rank(name):
    policy = am.ReducePolicy("tensor_parallel", False, False, 1, 1)
    op = getattr(OPS, name)
    with am.Comm.cpu(_name("one"), 1, 0) as c:
        h = c.handle_id
        if name.startswith("reduce_") and name != "reduce_scatter":
            args = (int(am.CommType.ALLGATHER), h, *policy.fields)
        else:
            args = (h,)
        compiled = _compile(lambda x: _plus_one(op(x, *args), x.shape[0]))
        for rows in ROWS:
            (x,) = _dynamic(_tokens(rows))
            got = compiled(x)
            # One rank: every one of them is the identity.
            assert tuple(got.shape) == (rows, 2), rows
            assert torch.equal(got, x + 1)


def _two_ranks(name, peer_body, body):
    """Runs `body(comm)` on rank 0 (this thread) and `peer_body(comm)` on rank 1
    (a thread) of a 2-rank CPU communicator; the peer's errors are raised."""
    errors = []

    def peer():
        try:
            with am.Comm.cpu(name, 2, 1, timeout_s=120.0) as c:
                peer_body(c)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    t = threading.Thread(target=peer, daemon=True)
    t.start()
    try:
        with am.Comm.cpu(name, 2, 0, timeout_s=120.0) as c:
            body(c)
    finally:
        t.join(timeout=150.0)
    assert not t.is_alive(), "rank 1 did not finish"
    assert not errors, errors


def test_collectives_scale_the_symbolic_token_count_across_two_ranks():
    """The gathers give `rows * 2` rows, the reductions `rows / 2`, from one
    graph each at 4 and 8 rows; 5 rows, which 2 ranks cannot split, fail when
    the reductions run. Rank 1 runs the same collectives through the numpy API."""

    def peer_steps(comm, x):
        return [
            am.all_gather(x, comm),
            am.reduce_scatter(x, comm),
            am.maybe_all_gather_and_maybe_unpad(x, None, comm),
            am.maybe_pad_and_reduce(x, None, comm),
        ]

    def peer(comm):
        for rows in ROWS:
            peer_steps(comm, _tokens(rows, 1).numpy())
        for reduce in (am.reduce_scatter, lambda x, c: am.maybe_pad_and_reduce(x, None, c)):
            with pytest.raises(am.AmoeError, match="does not divide"):
                reduce(_tokens(5, 1).numpy(), comm)

    def main(comm):
        h = comm.handle_id
        ops = [
            lambda x: _plus_one(OPS.all_gather(x, h), x.shape[0] * 2),
            lambda x: _plus_one(OPS.reduce_scatter(x, h), x.shape[0] // 2),
            lambda x: _plus_one(OPS.maybe_all_gather_and_maybe_unpad(x, h), x.shape[0] * 2),
            lambda x: _plus_one(OPS.maybe_pad_and_reduce(x, h), x.shape[0] // 2),
        ]
        torch._dynamo.reset()
        compiled = [torch.compile(op, backend="aot_eager", fullgraph=True) for op in ops]
        for rows in ROWS:
            x0, x1 = _tokens(rows, 0).numpy(), _tokens(rows, 1).numpy()
            gathered = np.concatenate([x0, x1])
            scattered = (x0 + x1)[: rows // 2]  # rank 0's half of the sum
            for fn, want in zip(compiled, (gathered, scattered, gathered, scattered)):
                (x,) = _dynamic(_tokens(rows))
                np.testing.assert_array_equal(fn(x).numpy(), want + 1)
        for fn in compiled[1::2]:
            with pytest.raises(am.AmoeError, match="does not divide"):
                fn(_tokens(5))

    _two_ranks(_name("two"), peer, main)


@pytest.mark.parametrize("name", ["maybe_all_gather_and_maybe_unpad", "maybe_pad_and_reduce"])
def test_ep_ops_with_a_layout_take_its_rows_and_keep_the_input_dynamic(name):
    """With an SP layout the output rows are the layout's (a constant of the
    graph), the input's stay symbolic; an input the layout does not fit fails
    when the op runs."""
    op = getattr(OPS, name)
    with am.Comm.cpu(_name("layout"), 1, 0) as c:
        h = c.handle_id
        for rows in ROWS:
            compiled = _compile(lambda x, rows=rows: _plus_one(op(x, h, [rows]), rows))
            (x,) = _dynamic(_tokens(rows))
            got = compiled(x)
            assert tuple(got.shape) == (rows, 2), rows
            assert torch.equal(got, x + 1)
            with pytest.raises(am.AmoeError, match=f"{rows} rows|{rows + 1} rows"):
                compiled(_tokens(rows + 1))


def _finalize_inputs(mode, n):
    ex, idx, kw = finalize_case(rng_for("torch-dyn-fin", mode, n), mode, np.float32, n=n, k=2, h=(3,))
    want = finalize_golden(ex, idx, kw["x1"], kw["x2"], kw["bias"], kw["scales"], kw["expert_idx"], mode)
    names = ("x1", "x2", "bias", "scales", "expert_idx")
    return [to_torch(ex), to_torch(idx)] + [to_torch(kw[k]) for k in names], want


@pytest.mark.parametrize("mode", [0, 1, 2, 3])
def test_finalize_keeps_the_token_dimension_dynamic(mode):
    """Every operand with N (or N*K) rows has its dim 0 dynamic; the output
    has N rows, from the one graph at N = 4 and 8. Scales whose N*K does not
    match the indices fail when the op runs."""
    compiled = _compile(lambda *a: _plus_one(OPS.moe_finalize_routing(*a, mode), a[5].shape[0]))  # scales: [N, K]
    drop_pad = mode in (1, 3)  # expanded_x is [E, C, H]: no token dimension
    for n in ROWS:
        args, want = _finalize_inputs(mode, n)
        ex, idx, x1, x2, bias, scales, expert_idx = args
        _dynamic(*([] if drop_pad else [ex]), idx, x1, x2, scales, expert_idx)
        got = compiled(*args)
        assert tuple(got.shape) == want.shape, (mode, n)
        assert_close(to_numpy(got), want + 1, np.float32, f"compiled finalize mode {mode}, N {n}")
    args, _ = _finalize_inputs(mode, 4)
    args[5] = args[5][:3]  # scales of 3 tokens, indices of 4
    with pytest.raises(am.ShapeError):
        compiled(*args)


def test_unpermute_keeps_the_token_dimension_dynamic():
    """`[T*K, H]` permuted rows back to `[T, H]` from one graph at T = 4 and 8,
    with probs and without; probs that do not match the indices fail when the
    op runs."""
    with_probs = _compile(lambda p, i, pr: _plus_one(OPS.moe_token_unpermute(p, i, pr), pr.shape[0]))
    without = _compile(lambda p, i: _plus_one(OPS.moe_token_unpermute(p, i), i.shape[0]))
    for t in ROWS:
        g = rng_for("torch-dyn-unperm", t)
        permuted = rand(g, (t * 2, 3), np.float32)
        idx = g.permutation(t * 2).astype(np.int32)
        probs = rand(g, (t, 2), np.float32)
        p, i, pr = _dynamic(to_torch(permuted), to_torch(idx), to_torch(probs))
        got = with_probs(p, i, pr)
        assert tuple(got.shape) == (t, 3)
        assert_close(to_numpy(got), unpermute_golden(permuted, idx, probs) + 1, np.float32, f"unpermute T {t}")
        p, i = _dynamic(to_torch(permuted), to_torch(idx))
        got = without(p, i)
        assert tuple(got.shape) == (t * 2, 3)
        assert_close(to_numpy(got), unpermute_golden(permuted, idx, None) + 1, np.float32, f"unpermute K 1, T {t}")
    with pytest.raises(am.ShapeError):
        with_probs(to_torch(permuted), to_torch(idx), to_torch(probs[:3]))


def _one_rank_layer(c, groups):
    policy = am.ReducePolicy("none", False, False, 1, 1)
    return am.MoeLayer(groups, c, 1, 0, 0, lambda h, mask, ct: h * np.float32(2.0), policy)


def test_moe_layer_fc_keeps_the_token_dimension_dynamic():
    """The layer returns this rank's tokens, as many rows as it takes, from one
    graph at 4 and 8 tokens under every comm type; a context that gives this
    rank another count fails when the op runs."""
    with am.Comm.cpu(_name("fc"), 1, 0) as c, am.MoeGroups(c, 1) as groups:
        layer = _one_rank_layer(c, groups)
        lid = layer.layer_id
        try:
            compiled = _compile(lambda x: _plus_one(OPS.moe_layer_fc(x, lid), x.shape[0]))
            for ct in am.CommType:
                for rows in ROWS:
                    (x,) = _dynamic(_tokens(rows))
                    with am.forward_context(ct, [rows]):
                        got = compiled(x)
                    assert tuple(got.shape) == (rows, 2), (ct, rows)
                    assert torch.equal(got, x * 2 + 1), (ct, rows)
            with am.forward_context(am.CommType.MC2, [5]):
                with pytest.raises(am.ShapeError, match="5 rows"):
                    compiled(_tokens(4))
        finally:
            layer.close()


@pytest.mark.parametrize("name", ["reduce_routed_early_fc", "reduce_shared_fc", "reduce_final_fc"])
def test_reduction_points_of_a_layer_keep_the_token_dimension_dynamic(name):
    op = getattr(OPS, name)
    with am.Comm.cpu(_name("fc-point"), 1, 0) as c, am.MoeGroups(c, 1) as groups:
        layer = _one_rank_layer(c, groups)
        lid = layer.layer_id
        try:
            compiled = _compile(lambda x: _plus_one(op(x, lid), x.shape[0]))
            for rows in ROWS:
                (x,) = _dynamic(_tokens(rows))
                with am.forward_context(am.CommType.ALLGATHER, [rows]):
                    got = compiled(x)
                assert tuple(got.shape) == (rows, 2), rows
                assert torch.equal(got, x + 1)
        finally:
            layer.close()


def test_data_dependent_token_counts_trace():
    """Token counts known only when the graph runs (`x[mask]`: an unbacked
    size `u0`, no traced value): the fakes check the operands with sizes that
    keep their relations (`2*u0` indices for `u0` tokens of top-2 probs, an SP
    layout's rows), instead of one placeholder size per dimension that makes
    consistent operands look inconsistent, and one graph gives the goldens."""
    keep_rows = [0, 2, 3]  # rows whose first column is positive
    y = torch.tensor([[1.0, 2.0, 0.5], [-1.0, 3.0, 1.5], [2.0, 5.0, -2.0], [3.0, 1.0, 4.0]])
    s_np = y.numpy()[keep_rows]
    t, k = len(keep_rows), 2

    def selected(y):
        return y[y[:, 0] > 0]

    def unpermute(y):
        s = selected(y)
        permuted = torch.cat([s, s * 2.0])  # [2*u0, H]
        idx = torch.arange(permuted.shape[0] - 1, -1, -1, dtype=torch.int32)  # reversed
        probs = torch.full((s.shape[0], 2), 0.5) + torch.arange(2.0)  # [u0, 2]: 0.5, 1.5
        return OPS.moe_token_unpermute(permuted, idx, probs)

    def finalize(y):
        s = selected(y)
        ex = torch.cat([s, s * 3.0])  # [2*u0, H]
        idx = torch.arange(ex.shape[0], dtype=torch.int32)
        scales = torch.ones(s.shape[0], 2) * torch.tensor([1.0, 0.25])  # [u0, 2]
        return OPS.moe_finalize_routing(ex, idx, None, None, None, scales, None, 2)

    permuted = np.concatenate([s_np, s_np * 2.0])
    probs = np.tile(np.array([[0.5, 1.5]], np.float32), (t, 1))
    want_unpermute = unpermute_golden(permuted, np.arange(2 * t - 1, -1, -1).astype(np.int32), probs)
    ex = np.concatenate([s_np, s_np * 3.0])
    scales = np.tile(np.array([[1.0, 0.25]], np.float32), (t, 1))
    want_finalize = finalize_golden(ex, np.arange(2 * t).astype(np.int32), None, None, None, scales, None, 2)

    with am.Comm.cpu(_name("unbacked"), 1, 0) as c:
        h = c.handle_id
        cases = [
            (unpermute, want_unpermute),
            (finalize, want_finalize),
            (lambda y: OPS.maybe_pad_and_reduce(selected(y), h, [t]), s_np),
            (lambda y: OPS.maybe_all_gather_and_maybe_unpad(selected(y), h, [t]), s_np),
            (lambda y: OPS.maybe_pad_and_reduce(torch.cat([selected(y)] * 2), h, [2 * t]), np.concatenate([s_np] * 2)),
            (lambda y: OPS.reduce_scatter(torch.cat([selected(y)] * 2), h), np.concatenate([s_np] * 2)),
        ]
        with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True, capture_scalar_outputs=True):
            for i, (fn, want) in enumerate(cases):
                got = _compile(fn)(y)
                assert tuple(got.shape) == want.shape, i
                assert_close(to_numpy(got), want, np.float32, f"data-dependent token count, case {i}")


def test_moe_layer_fc_traces_a_data_dependent_token_count():
    """`moe_layer_fc` on tokens selected by a mask (an unbacked row count):
    the fake checks them at the count the forward context gives this rank
    (its DP tokens, over TP with SP), not at a placeholder row count the
    context refuses; one rank, experts `2 h`, under every comm type, with and
    without SP. A context that gives this rank another count fails when the
    op runs."""
    y = torch.tensor([[1.0, 2.0], [-1.0, 3.0], [2.0, 5.0], [3.0, 1.0]])
    want = 2 * y[[0, 2, 3]]
    with am.Comm.cpu(_name("fc-unbacked"), 1, 0) as c, am.MoeGroups(c, 1) as groups:
        layer = _one_rank_layer(c, groups)
        lid = layer.layer_id
        try:
            with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
                compiled = _compile(lambda y: OPS.moe_layer_fc(y[y[:, 0] > 0], lid))
                for sp in (False, True):
                    for ct in am.CommType:
                        with am.forward_context(ct, [3], sp=sp):
                            assert torch.equal(compiled(y), want), (sp, ct)
                with am.forward_context(am.CommType.MC2, [4]):
                    with pytest.raises(am.ShapeError):
                        compiled(y)
        finally:
            layer.close()
