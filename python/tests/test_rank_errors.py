"""A bad argument on one rank of a collective or MoE op fails every rank at once.

One rank passes something wrong (an `out` of the wrong shape or dtype, a
dtype a reduction never takes, rows the world size does not divide, an
unknown op or comm type) while its peers call the op correctly. That rank
must raise an error naming the argument, and each peer must fail promptly
with the bad rank's reason: never wait out the communicator's timeout,
never return. Where the package checks an argument before the library sees
it, it reports the refusal to the peers itself (`amoe_*_refuse`); the
peers quote its message.

Ranks run as threads of this process, each keeping its communicator open
until every rank is done (as an engine whose rank caught the error would):
a rank that closes it at once fails its peers through the closed group,
which would hide a refusal that never reached them."""

from __future__ import annotations

import threading
import time
import uuid

import numpy as np
import pytest

import ascend_moe as am

TIMEOUT_S = 20.0
F32 = np.float32
BAD = 1


def run_with_one_bad_rank(fn, n=2):
    """`fn(comm, rank)` on every rank of a fresh n-rank CPU world (threads);
    returns `{rank: ("ok", value, secs) | ("err", AmoeError, secs)}`. Every
    rank keeps its communicator open until all of them returned or raised."""
    name, res = f"rank-errors-{uuid.uuid4().hex[:12]}", {}
    done = threading.Barrier(n)

    def main(r):
        try:
            with am.Comm.cpu(name, n, r, timeout_s=TIMEOUT_S) as c:
                t0 = time.monotonic()
                try:
                    res[r] = ("ok", fn(c, r), time.monotonic() - t0)
                except am.AmoeError as e:
                    res[r] = ("err", e, time.monotonic() - t0)
                except BaseException as e:  # noqa: BLE001 - a wrong exception type is a failure too
                    res[r] = ("bug", e, time.monotonic() - t0)
                try:
                    done.wait(3 * TIMEOUT_S + 5)
                except threading.BrokenBarrierError:
                    pass
        except BaseException as e:  # noqa: BLE001
            res.setdefault(r, ("bug", e, 0.0))

    ts = [threading.Thread(target=main, args=(r,), daemon=True) for r in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(4 * TIMEOUT_S + 10)
    assert len(res) == n, f"ranks {sorted(set(range(n)) - set(res))} hung"
    bugs = {r: v for r, (k, v, _) in res.items() if k == "bug"}
    assert not bugs, bugs
    return res


def assert_refused_everywhere(res, bad_naming, peer_naming):
    """The bad rank raised naming `bad_naming`; every peer raised promptly
    (not a timeout) naming the bad rank and `peer_naming`."""
    ok = sorted(r for r, (k, _, _) in res.items() if k == "ok")
    assert not ok, f"ranks {ok} returned while rank {BAD} passed a bad argument: {res}"
    kind, e, _ = res[BAD]
    assert bad_naming in str(e), f"rank {BAD}: {e}"
    for r, (_, e, secs) in sorted(res.items()):
        if r == BAD:
            continue
        assert e.status != am.Status.COMM_TIMEOUT, f"rank {r} waited out the timeout instead of being refused: {e}"
        assert secs < TIMEOUT_S, f"rank {r} failed after {secs:.2f} s: {e}"
        names_bad = f"rank {BAD}" in str(e) or f"ranks [{BAD}]" in str(e)
        assert names_bad and peer_naming in str(e), f"rank {r}: {e}"


X = np.arange(12, dtype=F32).reshape(4, 3)


def _bad(r, good, bad):
    return bad if r == BAD else good


# (id, the call every rank makes, what both the bad rank's error and its peers' name; the
# peers quote the bad rank's error)
CASES = [
    (
        "all_reduce out of the wrong shape",
        lambda c, r: am.all_reduce(X, c, out=_bad(r, None, np.empty((5, 3), F32))),
        "`out`",
    ),
    (
        "all_reduce out of the wrong dtype",
        lambda c, r: am.all_reduce(X, c, out=_bad(r, None, np.empty((4, 3), np.float16))),
        "`out`",
    ),
    (
        "all_reduce of int8, which is never reduced",
        lambda c, r: am.all_reduce(_bad(r, X, X.astype(np.int8)), c),
        "never reduced",
    ),
    (
        "reduce_scatter of rows the world size does not divide",
        lambda c, r: am.reduce_scatter(_bad(r, X, np.ones((3, 3), F32)), c),
        "does not divide",
    ),
    (
        "reduce_scatter of int8",
        lambda c, r: am.reduce_scatter(_bad(r, X, X.astype(np.int8)), c),
        "never reduced",
    ),
    (
        "reduce_scatter out of the wrong shape",
        lambda c, r: am.reduce_scatter(X, c, out=_bad(r, None, np.empty((4, 3), F32))),
        "`out`",
    ),
    (
        "all_gather out of the wrong shape",
        lambda c, r: am.all_gather(X, c, out=_bad(r, None, np.empty((9, 3), F32))),
        "`out`",
    ),
    (
        "all_gather out of the wrong dtype",
        lambda c, r: am.all_gather(X, c, out=_bad(r, None, np.empty((8, 3), np.float16))),
        "`out`",
    ),
    (
        "broadcast out of the wrong shape",
        lambda c, r: am.broadcast(X, c, out=_bad(r, None, np.empty((5, 3), F32))),
        "`out`",
    ),
    (
        "all_reduce with an unknown op number",
        lambda c, r: am.all_reduce(X, c, op=_bad(r, 0, 7)),
        "unknown reduce op 7",
    ),
    (
        "all_reduce of float64, which the library does not take",
        lambda c, r: am.all_reduce(_bad(r, X, X.astype(np.float64)), c),
        "float64",
    ),
    # A stream was resolved after the refusal block: the peers waited out
    # the timeout.
    (
        "all_gather on something that is no stream",
        lambda c, r: am.all_gather(X, c, stream=_bad(r, None, object())),
        "`stream`",
    ),
    (
        "barrier on something that is no stream",
        lambda c, r: c.barrier(stream=_bad(r, None, object())),
        "`stream`",
    ),
    (
        "broadcast on something that is no stream",
        lambda c, r: am.broadcast(X, c, stream=_bad(r, None, object())),
        "`stream`",
    ),
    # Lists and sizes the package converts before the library sees them: the
    # peers waited in the split or the groups' agreement for the timeout.
    (
        "split of a list with a negative rank",
        lambda c, r: c.split(_bad(r, [0, 1], [0, -1])),
        "`ranks`",
    ),
    (
        "split of something that is no list",
        lambda c, r: c.split(_bad(r, [0, 1], "01")),
        "`ranks`",
    ),
    (
        "MoeGroups of a negative tp_size",
        lambda c, r: am.MoeGroups(c, _bad(r, 1, -2)),
        "`tp_size`",
    ),
    (
        "MoeGroups of a pcp_size that is no integer",
        lambda c, r: am.MoeGroups(c, 1, pcp_size=_bad(r, 1, 1.5)),
        "`pcp_size`",
    ),
]

LAYOUT = am.SpLayout([2, 3])

# MoE ops over two ranks: (id, the call every rank makes, what both the bad
# rank's error and its peers' name).
MOE_CASES = [
    (
        "maybe_pad_and_reduce with a row too many",
        lambda c, r: am.maybe_pad_and_reduce(np.ones((_bad(r, 5, 6), 2), F32), LAYOUT, c),
        "rows",
    ),
    (
        "maybe_all_gather_and_maybe_unpad with rows of another rank",
        lambda c, r: am.maybe_all_gather_and_maybe_unpad(np.ones((_bad(r, LAYOUT.local_sizes[r], 4), 2), F32), LAYOUT, c),
        "rows",
    ),
    (
        "finalize_and_reduce with a layout of another total",
        lambda c, r: am.finalize_and_reduce(
            np.ones((10, 3), F32), np.arange(10, dtype=np.int32), _bad(r, LAYOUT, am.SpLayout([3, 3])), c,
            scales=np.ones((5, 2), F32),
        ),
        "6",
    ),
    (
        "shared_gather_unpad with a shard of the wrong rows",
        lambda c, r: am.shared_gather_unpad(np.ones((_bad(r, 3, 2), 3), F32), 5, c),
        "rows",
    ),
    (
        "maybe_pad_and_reduce on something that is no stream",
        lambda c, r: am.maybe_pad_and_reduce(np.ones((5, 2), F32), LAYOUT, c, stream=_bad(r, None, object())),
        "`stream`",
    ),
    (
        "reduce_final on something that is no stream",
        lambda c, r: am.ReducePolicy(None, False, False, 2, 2).reduce_final(
            np.ones((4, 3), F32), 0, c, stream=_bad(r, None, object())
        ),
        "`stream`",
    ),
    (
        "reduce_final with an unknown comm type",
        lambda c, r: am.ReducePolicy(None, False, False, 2, 2).reduce_final(np.ones((4, 3), F32), _bad(r, 0, 9), c),
        "comm type 9",
    ),
    (
        "reduce_final into an out of the wrong shape",
        lambda c, r: am.ReducePolicy(None, False, False, 2, 2).reduce_final(
            np.ones((4, 3), F32), 0, c, out=np.empty((_bad(r, 4, 5), 3), F32)
        ),
        "`out`",
    ),
]


@pytest.mark.parametrize(
    "bad",
    [
        ("a root out of range", lambda: {"root": 2, "out": np.zeros((4, 3), F32)}),
        ("an out in non-native byte order", lambda: {"root": 0, "out": np.zeros((4, 3), ">f4")}),
    ],
    ids=lambda b: b[0],
)
def test_a_refused_broadcast_leaves_the_out_it_was_given_as_it_was(bad):
    """A broadcast into an `out` other than `x` copies `x` there first; a
    call refused (on one rank, or on every rank for the root) left `out`
    holding `x` although nothing was broadcast. The checks run before the
    copy: the refused rank's `out` is as the caller had it."""
    outs = {}

    def body(c, r):
        kw = bad[1]() if r == BAD else {"root": 0, "out": np.zeros((4, 3), F32)}
        outs[r] = kw["out"]
        return am.broadcast(X, c, **kw)

    res = run_with_one_bad_rank(body)
    assert res[BAD][0] == "err", res[BAD]
    assert not outs[BAD].any(), f"rank {BAD}'s refused out was written: {outs[BAD]}"
    assert res[0][0] == "err", f"rank 0 returned {res[0][1]!r} while rank {BAD} refused"


def test_a_broadcast_root_with_a_bad_out_never_sends_memory_it_did_not_fill():
    """The root refuses an `out` that does not take its `x`; its peers'
    buffers happen to have out's shape. Whatever the peers then see, none
    returns a buffer the root never filled (the refusal is not passed on
    from the root: its buffer would be sent)."""

    def body(c, r):
        if r == 0:
            return am.broadcast(X, c, root=0, out=np.empty((5, 3), F32))
        return am.broadcast(np.full((5, 3), -1.0, F32), c, root=0)

    res = run_with_one_bad_rank(body)
    assert res[0][0] == "err" and "`out`" in str(res[0][1]), res[0]
    assert res[1][0] == "err", f"rank 1 returned {res[1][1]!r}, a broadcast its root refused"


@pytest.mark.parametrize("call,naming", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_bad_collective_argument_on_one_rank_fails_every_rank_at_once(call, naming):
    assert_refused_everywhere(run_with_one_bad_rank(call), naming, naming)


@pytest.mark.parametrize("call,naming", [c[1:] for c in MOE_CASES], ids=[c[0] for c in MOE_CASES])
def test_a_bad_moe_op_argument_on_one_rank_fails_every_rank_at_once(call, naming):
    assert_refused_everywhere(run_with_one_bad_rank(call), naming, naming)


@pytest.mark.skipif(not am.TORCH_OPS, reason="torch not importable")
@pytest.mark.parametrize("kind", ["sparse", "nested"])
def test_a_tensor_that_is_not_dense_on_one_rank_fails_every_rank_at_once(kind):
    """torch's own error on such a tensor (a RuntimeError) never reached the
    peers, which waited out the timeout."""
    import torch

    def bad():
        if kind == "sparse":
            return torch.ones(4, 3).to_sparse()
        return torch.nested.nested_tensor([torch.ones(3), torch.ones(2)])

    res = run_with_one_bad_rank(lambda c, r: am.all_reduce(bad() if r == BAD else torch.ones(4, 3), c))
    assert_refused_everywhere(res, "`x` is a", "`x` is a")


def _token_prepare_with_a_stale_context(c, r):
    """Token prepare on DP 2 x TP 2, rank `BAD` with a context whose TP rank
    is not its group's."""
    with am.MoeGroups(c, 2) as g:
        d, t = r // 2, r % 2
        ctx = am.MoeContext([4, 3], 2, d, _bad(r, t, 0), False)
        return am.token_prepare(np.ones(([4, 3][d], 4), F32), am.CommType.ALLGATHER, ctx, g)[0]


def _token_finalize_of_the_wrong_rows(c, r):
    """Token finalize (ALLGATHER, DP 2 x TP 1): rank `BAD`'s expert output
    has a row too many."""
    with am.MoeGroups(c, 1) as g:
        ctx = am.MoeContext([2, 2], 1, r, 0, False)
        return am.token_finalize(np.ones((_bad(r, 4, 5), 4), F32), am.CommType.ALLGATHER, ctx, g)


def _token_finalize_of_int8(c, r):
    """Token finalize (ALLGATHER, DP 2 x TP 2), which sums over DP: rank
    `BAD`'s expert output is int8, which no reduction takes. The ranks of
    the other DP group never share a collective with it but must fail too."""
    with am.MoeGroups(c, 2) as g:
        ctx = am.MoeContext([4, 3], 2, r // 2, r % 2, False)
        return am.token_finalize(np.ones((8, 4), _bad(r, F32, np.int8)), am.CommType.ALLGATHER, ctx, g)


def test_token_prepare_or_finalize_refused_on_one_rank_fails_every_rank_at_once():
    assert_refused_everywhere(run_with_one_bad_rank(_token_prepare_with_a_stale_context, n=4), "`ep`", "`ep`")
    assert_refused_everywhere(run_with_one_bad_rank(_token_finalize_of_the_wrong_rows), "rows", "rows")
    assert_refused_everywhere(run_with_one_bad_rank(_token_finalize_of_int8, n=4), "i8", "i8")


def _token_prepare_without(what):
    """Token prepare (ALLGATHER, DP 2 x TP 1), rank `BAD` with no comm type
    or no context: it cannot plan, but its peers wait in the comm-type
    agreement."""

    def body(c, r):
        with am.MoeGroups(c, 1) as g:
            ctx = am.MoeContext([2, 2], 1, r, 0, False)
            ct = _bad(r, am.CommType.ALLGATHER, "BROADCAST") if what == "comm_type" else am.CommType.ALLGATHER
            return am.token_prepare(np.ones((2, 4), F32), ct, _bad(r, ctx, None) if what == "ctx" else ctx, g)[0]

    return body


def _token_finalize_without(what):
    """Token finalize (ALLGATHER, DP 2 x TP 1), rank `BAD` with no comm type
    or no context: its peers wait in the comm-type agreement."""

    def body(c, r):
        with am.MoeGroups(c, 1) as g:
            ctx = am.MoeContext([2, 2], 1, r, 0, False)
            ct = _bad(r, am.CommType.ALLGATHER, "BROADCAST") if what == "comm_type" else am.CommType.ALLGATHER
            return am.token_finalize(np.ones((4, 4), F32), ct, _bad(r, ctx, None) if what == "ctx" else ctx, g)

    return body


@pytest.mark.parametrize("what,naming", [("comm_type", "BROADCAST"), ("ctx", "`ctx`")])
@pytest.mark.parametrize("op", [_token_prepare_without, _token_finalize_without], ids=["prepare", "finalize"])
def test_token_op_without_a_comm_type_or_context_on_one_rank_fails_every_rank_at_once(op, what, naming):
    assert_refused_everywhere(run_with_one_bad_rank(op(what)), naming, naming)


def _layer_whose_experts_return_float16_on_one_rank(c, r):
    """A MoE layer (DP 2 x TP 1, ALLGATHER) whose experts on rank `BAD`
    return float16 for float32 tokens: that rank refuses before token
    finalize, which its peer is already in."""
    with am.MoeGroups(c, 1) as groups, c.split([r]) as tp:
        experts = lambda h, mask, ct: h.astype(_bad(r, np.float32, np.float16))  # noqa: E731
        layer = am.MoeLayer(groups, tp, 1, r, 0, experts)
        try:
            with am.forward_context(am.CommType.ALLGATHER, [2, 2]):
                return layer.forward(np.ones((2, 4), F32))
        finally:
            layer.close()


def test_a_layer_whose_experts_fail_on_one_rank_fails_every_rank_at_once():
    assert_refused_everywhere(run_with_one_bad_rank(_layer_whose_experts_return_float16_on_one_rank), "float16", "float16")


def _layer_whose_experts_raise_on_one_rank(exc):
    """A MoE layer (DP n x TP 1, ALLGATHER) whose experts on rank `BAD`
    raise `exc` (an error of the caller's code, not an argument error) after
    token prepare, while its peers are already in token finalize. The bad
    rank returns `("raised", its exception)` when the exception reached it
    unchanged."""

    def body(c, r):
        def experts(h, mask, ct):
            if r == BAD:
                raise exc("the experts failed on this rank")
            return h

        with am.MoeGroups(c, 1) as groups, c.split([r]) as tp:
            layer = am.MoeLayer(groups, tp, 1, r, 0, experts)
            try:
                with am.forward_context(am.CommType.ALLGATHER, [2] * c.world_size):
                    return layer.forward(np.ones((2, 4), F32))
            except exc as e:
                if r != BAD or isinstance(e, am.AmoeError):
                    raise
                return ("raised", e)
            finally:
                layer.close()

    return body


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("exc", [RuntimeError, KeyError], ids=["RuntimeError", "KeyError"])
def test_a_layer_whose_experts_raise_on_one_rank_fails_every_rank_at_once(exc, n):
    """The experts are the caller's code: whatever they raise on one rank
    reaches that rank as it is, and its peers fail at once quoting it
    instead of waiting out the timeout in token finalize."""
    res = run_with_one_bad_rank(_layer_whose_experts_raise_on_one_rank(exc), n=n)
    kind, v, _ = res[BAD]
    assert kind == "ok" and v[0] == "raised" and type(v[1]) is exc, res[BAD]
    for r, (kind, e, secs) in sorted(res.items()):
        if r == BAD:
            continue
        assert kind == "err", f"rank {r} returned {e!r} while rank {BAD}'s experts raised"
        assert e.status != am.Status.COMM_TIMEOUT, f"rank {r} waited out the timeout: {e}"
        assert secs < TIMEOUT_S, (r, secs, e)
        assert f"rank {BAD}" in str(e) and exc.__name__ in str(e) and "the experts failed" in str(e), (r, e)


def _reduction_point_fc_without_a_context_on_one_rank(c, r):
    """`torch.ops.ascend_moe.reduce_final_fc` on TP 2, where the final point
    reduces; rank `BAD` runs it outside any forward context."""
    import torch

    with am.MoeGroups(c, 2) as groups:
        layer = am.MoeLayer(groups, c, 2, 0, r, lambda h, mask, ct: h, am.ReducePolicy(None, False, False, 2, 2))
        try:
            x = torch.ones(4, 3)
            if r == BAD:
                return torch.ops.ascend_moe.reduce_final_fc(x, layer.layer_id)
            with am.forward_context(am.CommType.ALLGATHER, [4]):
                return torch.ops.ascend_moe.reduce_final_fc(x, layer.layer_id)
        finally:
            layer.close()


def test_a_context_reading_reduction_point_refused_on_one_rank_fails_every_rank_at_once():
    from workers import torch_ops_missing

    missing = torch_ops_missing()
    if missing:
        pytest.fail(missing) if __import__("os").environ.get("CI") else pytest.skip(missing)
    res = run_with_one_bad_rank(_reduction_point_fc_without_a_context_on_one_rank)
    assert_refused_everywhere(res, "no MoE forward context", "no MoE forward context")


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize(
    "transform,points",
    [
        # Under ALLGATHER the final point of this policy all-reduces and the
        # shared point only copies: the copying rank would return while its
        # peers wait in the final all-reduce for it.
        (False, ("reduce_final", "reduce_shared")),
        # Both reduce here: without the check, the routed point's all-reduce
        # would pair with the shared point's of its peer.
        (True, ("reduce_routed_early", "reduce_shared")),
    ],
    ids=["final vs shared", "routed early vs shared"],
)
def test_tp_ranks_at_different_reduction_points_fail_every_rank_at_once(transform, points, n):
    """One TP rank calls another reduction point of the same layer than its
    peers (a tensor-parallel shared expert, TP = the world). Every rank
    fails at once naming the reduction point it is at."""
    policy = am.ReducePolicy("tensor_parallel", transform, False, n, n)

    def body(c, r):
        point = points[1] if r == BAD else points[0]
        return getattr(policy, point)(np.full((2, 3), float(r + 1), F32), am.CommType.ALLGATHER, c)

    res = run_with_one_bad_rank(body, n=n)
    for r, (kind, e, secs) in sorted(res.items()):
        assert kind == "err", f"rank {r} returned {e!r} while rank {BAD} was at another reduction point: {res}"
        assert e.status == am.Status.INVALID_ARGUMENT, (r, e)
        assert secs < TIMEOUT_S, (r, secs, e)
        mine = points[1] if r == BAD else points[0]
        assert "reduction point" in str(e) and f"point {mine}" in str(e), (r, e)


@pytest.mark.parametrize(
    "lists",
    [
        [[0, 1], [1, 0]],
        [[0, 1, 2], [2, 1, 0], [0, 1, 2]],
        [[0, 1], [0, 1, 2], [0, 1, 2]],
    ],
    ids=["order of 2", "order of 3", "members of 3"],
)
def test_members_splitting_different_lists_fail_at_once_naming_both(lists):
    """Rank r splits `lists[r]`; rank 0's list and rank 1's differ and each
    holds the other rank: each waits for the other in a sub-group the other
    never joins. Every rank fails at once (not at the timeout) naming both
    lists; the group stays usable."""

    def body(c, r):
        try:
            c.split(lists[r]).close()
        except am.AmoeError as e:
            return e, am.all_reduce(np.ones(2, F32), c)
        return None, None

    res = run_with_one_bad_rank(body, n=len(lists))
    for r, (kind, v, secs) in sorted(res.items()):
        assert kind == "ok", (r, v)
        e, after = v
        assert e is not None, f"rank {r} split {lists[r]} while rank {BAD} split {lists[BAD]}"
        assert e.status == am.Status.COMM_MISMATCH, (r, e)
        assert str(lists[0]) in str(e) and str(lists[1]) in str(e), (r, e)
        assert secs < TIMEOUT_S, (r, secs, e)
        np.testing.assert_array_equal(after, np.full(2, len(lists), F32))


def _split_after_a_member_exits(name, world, rank):
    """A rank body (`world.run_world`): rank `BAD`'s process exits without
    closing anything; the others split the whole world. Returns `(status,
    seconds, message)`."""
    import os

    with am.Comm.cpu(name, world, rank, timeout_s=TIMEOUT_S) as c:
        if rank == BAD:
            os._exit(3)
        t0 = time.monotonic()
        try:
            c.split(list(range(world))).close()
            return ("ok", time.monotonic() - t0, "")
        except am.AmoeError as e:
            return (am.Status(e.status).name, time.monotonic() - t0, str(e))


def _split_after_a_member_left(c, r):
    """Rank `BAD` closes its communicator; the others split the whole world."""
    if r == BAD:
        c.close()
        return None
    return c.split(list(range(c.world_size)))


@pytest.mark.parametrize("n", [2, 3])
def test_a_split_waiting_for_a_member_that_is_gone_fails_at_once_naming_it(n):
    """A member whose process exited, or that closed its communicator, never
    splits: the members waiting for it fail at once naming it, instead of
    waiting out the timeout."""
    from world import run_world

    results, codes = run_world(_split_after_a_member_exits, n, deadline_s=TIMEOUT_S + 20, expect_exit=(BAD,))
    assert codes[BAD] == 3, codes
    for r, (status, secs, msg) in sorted(results.items()):
        assert status == "COMM_PEER_FAILED" and f"rank {BAD} (pid" in msg and "died" in msg, (r, status, msg)
        assert secs < TIMEOUT_S, (r, secs, msg)
    res = run_with_one_bad_rank(_split_after_a_member_left, n=n)
    for r, (kind, e, secs) in sorted(res.items()):
        if r == BAD:
            continue
        assert kind == "err" and e.status == am.Status.COMM_PEER_FAILED, (r, kind, e)
        assert f"rank {BAD} left the group" in str(e), (r, e)
        assert secs < TIMEOUT_S, (r, secs, e)


def test_the_refusal_leaves_the_group_usable():
    """After a refused call every rank's next collective pairs with its
    peers' next one: the refusal took exactly one call on every rank."""

    def body(c, r):
        try:
            am.all_reduce(X, c, out=_bad(r, None, np.empty((5, 3), F32)))
        except am.AmoeError:
            pass
        return am.all_reduce(np.full(2, r + 1, F32), c)

    res = run_with_one_bad_rank(body)
    for r, (kind, v, _) in res.items():
        assert kind == "ok", (r, v)
        np.testing.assert_array_equal(v, [3.0, 3.0])


def test_the_bad_rank_never_writes_its_out():
    """A refused `out` keeps its contents."""
    mine = np.full((5, 3), 7.0, F32)

    def body(c, r):
        return am.all_reduce(X, c, out=_bad(r, None, mine))

    run_with_one_bad_rank(body)
    assert (mine == 7.0).all()


def test_a_cpu_world_made_without_a_timeout_waits_as_long_as_the_environment_says(monkeypatch):
    """`Comm.cpu` without `timeout_s` takes `$ASCEND_MOE_COMM_TIMEOUT`, as the
    C ABI, the Rust API and the CLI do, not a fixed 60 s."""
    monkeypatch.setenv("ASCEND_MOE_COMM_TIMEOUT", "0.5")
    t0 = time.monotonic()
    with pytest.raises(am.AmoeError) as e:
        am.Comm.cpu(f"env-timeout-{uuid.uuid4().hex}", 2, 0)  # rank 1 never comes
    secs = time.monotonic() - t0
    assert e.value.status == am.Status.COMM_TIMEOUT and "after 500ms" in str(e.value), e.value
    assert secs < 10, secs


def test_the_vllm_adapter_cpu_world_waits_as_long_as_the_environment_says(monkeypatch):
    """The vLLM adapter makes its CPU worlds itself: `$ASCEND_MOE_COMM_TIMEOUT`
    is the one way an engine sets how long a rank waits there for a peer that
    failed, so a world made for a group must take it (not a fixed 60 s)."""
    import torch.distributed as dist

    import ascend_moe.vllm_ascend as av

    token = uuid.uuid4().hex
    monkeypatch.setenv("ASCEND_MOE_COMM_TIMEOUT", "1")
    monkeypatch.setattr(dist, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_global_rank", lambda group, rank: rank, raising=False)
    monkeypatch.setattr(dist, "all_gather_object", lambda out, obj, group=None: out.__setitem__(slice(None), [obj] * len(out)))
    monkeypatch.setattr(dist, "broadcast_object_list", lambda objs, src=0, group=None: objs.__setitem__(0, token))
    groups = [
        type("Group", (), dict(cpu_group=object(), rank_in_group=r, world_size=2, ranks=[0, 1], unique_name=f"ep:{r}"))()
        for r in range(2)
    ]
    made, seen = {}, {}

    def rank(r):
        made[r] = av._build_backend(groups[r], "cpu")
        if r == 0:  # rank 1 never comes: rank 0 waits out the timeout
            t0 = time.monotonic()
            try:
                am.all_reduce(np.ones(2, F32), made[r].comm)
            except am.AmoeError as e:
                seen["err"] = (e, time.monotonic() - t0)

    ts = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(2)]
    for t in ts:
        t.start()
    ts[0].join(70)
    try:
        assert "err" in seen, "rank 0's all_reduce did not fail"
        e, secs = seen["err"]
        assert e.status == am.Status.COMM_TIMEOUT and "after 1s" in str(e), e
        assert secs < 10, secs
    finally:
        ts[1].join(5)
        for b in made.values():
            b.comm.close()


def _vllm_first_call_refused_on_one_rank(name, world, rank, op):
    """A rank body (`world.run_world`): vLLM's groups on the CPU, the adapter
    installed, and a first `torch.ops.vllm.<op>` whose input rank `BAD`
    refuses (one row too many). Returns `(status, seconds, message)`; the
    process then stays, with its communicators, until every rank returned."""
    import os
    import tempfile

    import torch

    import ascend_moe.vllm_ascend as av
    import vllm_standins as vs
    import vllm_workers as vw

    vw.init(name, world, rank, 2)
    local = vw._sp_layout([5, 3], 2)
    extra = 1 if rank == BAD else 0
    av.install()
    try:
        with vs.forward_context(**vw._ctx([5, 3], local, 2)):
            t0 = time.monotonic()
            try:
                if op == "gather":
                    torch.ops.vllm.maybe_all_gather_and_maybe_unpad(torch.ones(local[rank] + extra, 3))
                else:
                    torch.ops.vllm.maybe_pad_and_reduce(torch.ones(sum(local) + extra, 3))
                seen = ("ok", time.monotonic() - t0, "")
            except am.AmoeError as e:
                seen = (am.Status(e.status).name, time.monotonic() - t0, str(e))
    finally:
        av.uninstall()
    here = tempfile.gettempdir()  # the world's own (`run_world`)
    open(os.path.join(here, f"{name}.done.{rank}"), "w").close()
    end = time.monotonic() + 60
    while time.monotonic() < end and not all(os.path.exists(os.path.join(here, f"{name}.done.{r}")) for r in range(world)):
        time.sleep(0.01)
    return seen


@pytest.mark.parametrize("op", ["gather", "reduce"])
def test_a_refused_first_vllm_op_on_one_rank_never_strands_its_peers_in_gloo(op, monkeypatch):
    """The adapter maps vLLM's EP group to a CPU world on its first op, a
    collective over the group's gloo group. A rank whose input the op
    refuses still takes part in it, so its peers reach the op's collective
    and fail there within `$ASCEND_MOE_COMM_TIMEOUT`, instead of waiting in
    gloo (30 minutes by default) for a rank that already raised."""
    import vllm_standins

    if not vllm_standins.pinned_available():
        missing = f"vLLM-Ascend's pinned files are not at {vllm_standins.PINNED}"
        pytest.fail(missing) if __import__("os").environ.get("CI") else pytest.skip(missing)
    from world import run_world

    monkeypatch.setenv("ASCEND_MOE_COMM_TIMEOUT", "2")
    results, _ = run_world(_vllm_first_call_refused_on_one_rank, 4, args=(op,), deadline_s=40, torch_ops=True)
    for rank, (status, secs, msg) in sorted(results.items()):
        if rank == BAD:
            assert status == "SHAPE" and "rows" in msg, (rank, status, msg)
        else:
            # The adapter's op reports the refusal: every peer fails at once quoting it.
            assert status == "COMM_MISMATCH" and "rows" in msg, (rank, status, msg)
            assert secs < 15, (rank, secs, msg)


def _vllm_point_on_two_tp_ranks(monkeypatch, cts, dtypes):
    """`torch.ops.ascend_moe.vllm_reduce_point` (the final point of a TP-2
    layer) on two TP ranks of a CPU world, rank r with live comm type
    `cts[r]` and an input of dtype `dtypes[r]`; returns
    `{rank: ("ok", value, secs) | ("err", AmoeError, secs)}`."""
    import sys
    import types

    import torch
    import torch.distributed as dist

    import ascend_moe.vllm_ascend as av

    local = threading.local()
    token = uuid.uuid4().hex
    monkeypatch.setenv("ASCEND_MOE_COMM_TIMEOUT", str(TIMEOUT_S))
    monkeypatch.setattr(dist, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_global_rank", lambda group, rank: rank, raising=False)
    monkeypatch.setattr(dist, "all_gather_object", lambda out, obj, group=None: out.__setitem__(slice(None), [obj] * len(out)))
    monkeypatch.setattr(dist, "broadcast_object_list", lambda objs, src=0, group=None: objs.__setitem__(0, token))
    runner = types.ModuleType(av.RUNNER_MODULE)
    runner._EXTRA_CTX = type("ExtraCtx", (), {"moe_comm_type": property(lambda self: local.ct)})()
    runner.get_tp_group = lambda: local.group
    monkeypatch.setitem(sys.modules, av.RUNNER_MODULE, runner)
    monkeypatch.setattr(av, "_BACKENDS", {})
    layer = max(av._POLICIES, default=0) + 1000
    monkeypatch.setitem(av._POLICIES, layer, (am.ReducePolicy(None, False, False, 2, 2), None))
    op = av._register_point_op()
    final = 2
    groups = [
        type("Group", (), dict(cpu_group=object(), rank_in_group=r, world_size=2, ranks=[0, 1], unique_name=f"tp:{r}"))()
        for r in range(2)
    ]
    res, done = {}, threading.Barrier(2)

    def rank(r):
        local.ct, local.group = cts[r], groups[r]
        # What comm_for_group builds on the first use, built here: its lock
        # is per process, and these ranks are threads of one.
        av._remember_backend(groups[r], "cpu", av._build_backend(groups[r], "cpu"))
        t0 = time.monotonic()
        try:
            x = torch.full((2, 3), float(r + 1), dtype=dtypes[r])
            res[r] = ("ok", op(x, final, layer), time.monotonic() - t0)
        except am.AmoeError as e:
            res[r] = ("err", e, time.monotonic() - t0)
        except BaseException as e:  # noqa: BLE001
            res[r] = ("bug", e, time.monotonic() - t0)
        try:
            done.wait(3 * TIMEOUT_S + 5)
        except threading.BrokenBarrierError:
            pass

    ts = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(4 * TIMEOUT_S + 10)
    try:
        assert len(res) == 2, f"ranks {sorted({0, 1} - set(res))} hung"
        return res
    finally:
        for _, backend in av._BACKENDS.values():
            backend.comm.close()


def test_a_vllm_reduction_point_fails_every_tp_rank_when_one_chose_another_comm_type(monkeypatch):
    """Live comm types ALLGATHER (the final point all-reduces) and MC2 (it
    leaves the output as it is). Both fail, naming the choices (SPEC section
    5), as the Python API's reduction points do: the rank that would only
    copy never returns while its peer waits for it."""
    import torch

    res = _vllm_point_on_two_tp_ranks(monkeypatch, (am.CommType.ALLGATHER, am.CommType.MC2), (torch.float32,) * 2)
    for r, (kind, v, secs) in sorted(res.items()):
        assert kind == "err", f"rank {r} returned {v!r} while the TP ranks disagree: {res}"
        assert v.status == am.Status.INVALID_ARGUMENT, (r, v)
        assert "chose ALLGATHER" in str(v) and "chose MC2" in str(v), (r, v)
        assert secs < TIMEOUT_S, (r, secs, v)


@pytest.mark.parametrize(
    "cts,dtypes",
    [
        # float64 goes to vLLM's own all-reduce, float32 to the library's:
        # without the exchange before the float64 rank leaves, each would
        # wait for the other in another transport.
        (("ALLGATHER", "ALLGATHER"), ("float32", "float64")),
        # Both float64 (neither through the library's comm-type check): the
        # exchange carries the comm type too, and MC2 would only copy.
        (("ALLGATHER", "MC2"), ("float64", "float64")),
    ],
    ids=["dtypes differ", "comm types differ in float64"],
)
def test_a_vllm_reduction_point_of_a_dtype_the_library_does_not_take_fails_with_a_disagreeing_peer(
    monkeypatch, cts, dtypes
):
    import torch

    cts = tuple(getattr(am.CommType, c) for c in cts)
    res = _vllm_point_on_two_tp_ranks(monkeypatch, cts, tuple(getattr(torch, d) for d in dtypes))
    for r, (kind, v, secs) in sorted(res.items()):
        assert kind == "err", f"rank {r} returned {v!r} while the TP ranks disagree: {res}"
        assert v.status == am.Status.COMM_MISMATCH, (r, v)
        assert secs < TIMEOUT_S, (r, secs, v)
    if dtypes[0] == dtypes[1]:
        # Each names both ranks' comm types.
        for r, (_, v, _) in res.items():
            assert f"comm type {int(cts[0])}" in str(v) and f"comm type {int(cts[1])}" in str(v), (r, v)


def _vllm_point_without_comm_type_on_one_rank(name, world, rank):
    """A rank body (`world.run_world`): the first `vllm_reduce_point` of a
    layer whose final point all-reduces over TP groups of 2, where rank `BAD`
    has no live comm type. Returns `(status, seconds, message)`; the process
    then stays until every rank returned."""
    import os
    import tempfile

    import torch

    import ascend_moe.vllm_ascend as av
    import vllm_standins as vs
    import vllm_workers as vw

    vw.init(name, world, rank, 2)
    vs.load("fused_moe")
    fa = vs.load("ascend_forward_context")
    layer = max(av._POLICIES, default=0) + 1000
    av._POLICIES[layer] = (am.ReducePolicy(None, False, False, 2, world), None)
    op = av._register_point_op()
    ct = None if rank == BAD else fa.MoECommType.ALLGATHER
    with vs.forward_context(**vw._ctx([4, 4], tp_size=2, layout=False, comm_type=ct)):
        t0 = time.monotonic()
        try:
            op(torch.ones(2, 3), 2, layer)
            seen = ("ok", time.monotonic() - t0, "")
        except am.AmoeError as e:
            seen = (am.Status(e.status).name, time.monotonic() - t0, str(e))
    here = tempfile.gettempdir()  # the world's own (`run_world`)
    open(os.path.join(here, f"{name}.done.{rank}"), "w").close()
    end = time.monotonic() + 60
    while time.monotonic() < end and not all(os.path.exists(os.path.join(here, f"{name}.done.{r}")) for r in range(world)):
        time.sleep(0.01)
    return seen


def test_a_vllm_reduction_point_refused_on_one_rank_never_strands_its_tp_peer_in_gloo(monkeypatch):
    """The first reduction point maps vLLM's TP group to a CPU world, a
    collective over the group's gloo group. A rank without a live comm type
    still takes part in it, so its TP peer reaches the all-reduce and fails
    within `$ASCEND_MOE_COMM_TIMEOUT` instead of waiting in gloo; the other
    TP group, whose ranks agree, reduces."""
    import vllm_standins

    if not vllm_standins.pinned_available():
        missing = f"vLLM-Ascend's pinned files are not at {vllm_standins.PINNED}"
        pytest.fail(missing) if __import__("os").environ.get("CI") else pytest.skip(missing)
    from world import run_world

    monkeypatch.setenv("ASCEND_MOE_COMM_TIMEOUT", "2")
    results, _ = run_world(_vllm_point_without_comm_type_on_one_rank, 4, deadline_s=40, torch_ops=True)
    assert results[BAD][0] == "INVALID_ARGUMENT" and "comm type" in results[BAD][2], results[BAD]
    peer = BAD ^ 1
    assert results[peer][0] == "COMM_MISMATCH" and "comm type" in results[peer][2], results[peer]
    assert results[peer][1] < 15, results[peer]
    assert all(results[r][0] == "ok" for r in range(4) if r // 2 != BAD // 2), results
