"""What the package holds, and for how long: a failed call lets go of its
handles at once, a dropped MoE layer or vLLM group takes its communicators
with it, and handle ids do not run out in a long-lived process."""

import gc
import itertools
import sys
import types
import uuid
import weakref

import numpy as np
import pytest

import ascend_moe as am

comm_mod = sys.modules["ascend_moe.comm"]
lib_mod = sys.modules["ascend_moe._lib"]


def _name(tag: str) -> str:
    return f"pytest-{tag}-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def freed(monkeypatch):
    """The class names of the handles freed, in order."""
    out = []
    real_free = lib_mod.Owned._free
    monkeypatch.setattr(lib_mod.Owned, "_free", lambda self, h: (out.append(type(self).__name__), real_free(self, h)))
    return out


def _failing_calls(c, groups):
    """Calls over `c` (a 1-rank world) and `groups` that each fail on an
    argument after taking the handle."""
    x = np.ones((4, 2), np.float32)
    bad = np.ones((3, 2), np.float32)
    ctx = am.MoeContext([4], 1, 0, 0)
    policy = am.ReducePolicy("none", False, False, 1, 1)
    return {
        "all_reduce": lambda: am.all_reduce(x, c, out=bad),
        "all_gather": lambda: am.all_gather(x, c, out=bad),
        "broadcast": lambda: am.broadcast(x, c, out=bad),
        "barrier": lambda: c.barrier(stream=object()),
        "maybe_pad_and_reduce": lambda: am.maybe_pad_and_reduce(x, am.SpLayout([5]), c),
        "maybe_all_gather_and_maybe_unpad": lambda: am.maybe_all_gather_and_maybe_unpad(x, am.SpLayout([5]), c),
        "shared_gather_unpad": lambda: am.shared_gather_unpad(x, 4, c, out=bad),
        "reduce_final": lambda: policy.reduce_final(x, am.CommType.ALLGATHER, c, out=bad),
        "token_prepare": lambda: am.token_prepare(x, am.CommType.ALLGATHER, ctx, groups, out=bad),
        "token_finalize": lambda: am.token_finalize(x, am.CommType.ALLGATHER, ctx, groups, out=bad),
        "from_comms": lambda: am.MoeGroups.from_comms(c, c, c, pcp="not a comm"),
    }


def test_a_failed_call_releases_its_handles_even_while_its_error_is_kept(freed):
    """An error kept by the caller (logged, stored in a future) holds the
    frames of the failed call; the handles that call leased are released
    all the same, so `close()` frees them at once and the peers' next call
    fails at once instead of waiting out the timeout."""
    c = am.Comm.cpu(_name("kept"), 1, 0)
    groups = am.MoeGroups(c, 1)
    kept = {}
    for what, fn in _failing_calls(c, groups).items():
        with pytest.raises(am.AmoeError) as e:
            fn()
        kept[what] = e.value
        held = {"comm": c._leases, "groups": groups._leases}
        assert held == {"comm": 0, "groups": 0}, f"{what}: leases still held while its error is kept: {held}"
    # A caller's checks between prepare and finalize that fail: the groups
    # it held for the block are released with it.
    with pytest.raises(ValueError) as e:
        with sys.modules["ascend_moe.prepare"].finalize_refusing(am.CommType.ALLGATHER, am.MoeContext([4], 1, 0, 0), groups):
            raise ValueError("the experts failed")
    kept["finalize_refusing"] = e.value
    assert groups._leases == 0
    groups.close()
    c.close()
    assert freed == ["MoeGroups", "Comm"], f"close() freed {freed} while the errors are kept"
    del kept


def test_a_peer_that_left_after_a_kept_error_is_seen_at_once():
    """Rank 0's refused call raises on both ranks; rank 0 keeps its error and
    closes: rank 1's next call fails at once naming rank 0's leaving (a
    lease kept by the error used to keep rank 0 in the world, and rank 1
    waited out the whole timeout)."""
    import threading
    import time

    name, timeout = _name("left"), 30.0
    comms = [None, None]
    t = threading.Thread(target=lambda: comms.__setitem__(1, am.Comm.cpu(name, 2, 1, timeout_s=timeout)))
    t.start()
    comms[0] = am.Comm.cpu(name, 2, 0, timeout_s=timeout)
    t.join()
    errors, kept = {}, []

    def rank(r):
        try:
            am.all_reduce(np.ones(4, np.float32), comms[r], out=np.ones(3 if r == 0 else 4, np.float32))
        except am.AmoeError as e:
            errors[r] = e
            if r == 0:
                kept.append(e)

    ts = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert set(errors) == {0, 1}, errors
    comms[0].close()
    t0 = time.monotonic()
    with pytest.raises(am.AmoeError, match="rank 0 left the group"):
        comms[1].barrier()
    assert time.monotonic() - t0 < timeout / 2
    comms[1].close()
    del kept


def test_a_dropped_moe_layer_is_not_kept_by_the_registry(freed):
    """The layer registry holds layers weakly: a model rebuilt without
    closing its layers leaks neither the layers nor their groups and
    communicators. `with` closes a layer; a dropped or closed id is refused."""
    refs = []
    for _ in range(3):
        w = am.Comm.cpu(_name("layer"), 1, 0)
        layer = am.MoeLayer(am.MoeGroups(w, 1), w, 1, 0, 0, experts=lambda h, m, ct: h)
        refs.append((weakref.ref(layer), layer.layer_id))
        assert am.MoeLayer.lookup(layer.layer_id) is layer
        del w, layer
    gc.collect()
    assert [r() for r, _ in refs] == [None] * 3
    assert sorted(freed) == ["Comm"] * 3 + ["MoeGroups"] * 3, freed
    for _, lid in refs:
        with pytest.raises(am.InvalidArgumentError, match=f"no MoE layer is registered under id {lid}"):
            am.MoeLayer.lookup(lid)
    with am.Comm.cpu(_name("layer"), 1, 0) as w, am.MoeGroups(w, 1) as g:
        with am.MoeLayer(g, w, 1, 0, 0, experts=lambda h, m, ct: h) as layer:
            assert am.MoeLayer.lookup(layer.layer_id) is layer
        with pytest.raises(am.InvalidArgumentError, match="no MoE layer is registered"):
            am.MoeLayer.lookup(layer.layer_id)


def test_handle_ids_last_for_two_billion_communicators(monkeypatch):
    """A handle id holds 31 bits of sequence, and rank and world size for
    every world HCCL forms (up to 65536 ranks), within a non-negative int64;
    past the last sequence number a new communicator is refused by name."""
    assert comm_mod._ID_SEQ_MAX >= 2**31 - 1
    monkeypatch.setattr(comm_mod, "_NEXT_ID", itertools.count(comm_mod._ID_SEQ_MAX))
    with am.Comm.cpu(_name("ids"), 1, 0) as last:
        assert 0 < last.handle_id < 2**63
        assert am.Comm.lookup(last.handle_id) is last
    with pytest.raises(am.InvalidArgumentError, match=f"opened more than {comm_mod._ID_SEQ_MAX} communicators"):
        am.Comm.cpu(_name("ids"), 1, 0)
    hid = comm_mod._handle_id
    top = hid(comm_mod._ID_SEQ_MAX, 65536, 65535)
    assert 0 < top < 2**63
    # Rank and world size are each part of the id.
    ids = {hid(7, w, r) for w in (1, 2, 3, 65536) for r in {0, 1, w - 1} if r < w}
    assert len(ids) == len({(w, r) for w in (1, 2, 3, 65536) for r in {0, 1, w - 1} if r < w})
    with pytest.raises(am.InvalidArgumentError, match="worlds of 1..=65536 ranks"):
        hid(1, 65537, 0)


# ------------------------------------------------------------ vLLM groups


class _Group:
    """The fields of vLLM's GroupCoordinator the adapter reads (one rank)."""

    def __init__(self, name):
        self.cpu_group, self.rank_in_group, self.world_size, self.ranks = object(), 0, 1, [0]
        self.unique_name = name


@pytest.fixture
def adapter(monkeypatch):
    """The adapter with its caches empty and torch.distributed "initialized"
    (a group of one rank makes a CPU world of one without asking it)."""
    pytest.importorskip("torch")
    import torch.distributed as dist

    import ascend_moe.vllm_ascend as av

    monkeypatch.setattr(dist, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.delenv("ASCEND_MOE_VLLM_CPU_COMM", raising=False)
    for cache in ("_BACKENDS", "_MOE_GROUPS", "_POLICIES", "_POLICY_IDS", "_RELEASED"):
        monkeypatch.setattr(av, cache, {})
    yield av
    av._release_all()


def _engine_groups(monkeypatch, av) -> dict:
    """vLLM's group getters as the adapter reads them, answering with what
    the returned dict holds under "ep", "tp" and "dp"."""
    now = {}
    ops = types.ModuleType(av.OPS_MODULE)
    ops.get_ep_group, ops.get_tp_group, ops.get_dp_group = (lambda: now["ep"]), (lambda: now["tp"]), (lambda: now["dp"])
    monkeypatch.setitem(sys.modules, av.OPS_MODULE, ops)
    monkeypatch.delitem(sys.modules, av.RUNNER_MODULE, raising=False)
    return now


def _runner(tp_group):
    cfg = types.SimpleNamespace(tp_group=tp_group, ep_size=1, tp_size=1, is_sequence_parallel=False)
    return types.SimpleNamespace(moe_config=cfg, ascend_shared_experts=None, routed_output_transform=None)


def test_vllm_groups_that_go_take_their_communicators(adapter, monkeypatch):
    """A vLLM group destroyed and dropped (re-sharding, elastic EP, RL
    weight-sync groups) is not kept alive by the adapter's caches, and its
    communicator, the MoE groups built on it and the policies of its TP
    group are closed and forgotten when it is collected."""
    av = adapter
    engine = _engine_groups(monkeypatch, av)
    for i in range(3):
        ep, tp, dp = _Group(f"ep:{i}"), _Group(f"tp:{i}"), _Group(f"dp:{i}")
        engine.update(ep=ep, tp=tp, dp=dp)
        b = av.comm_for_group(ep, "cpu", "ep")
        assert b.kind == "comm" and av.comm_for_group(ep, "cpu", "ep") is b
        groups = av.moe_groups("cpu")
        assert av.moe_groups("cpu") is groups
        pid = av._runner_policy(_runner(tp))
        assert pid in av._POLICIES
        comms = [av.comm_for_group(g, "cpu").comm for g in (ep, tp, dp)]
        assert sorted(n for n, _, _ in av.mapped_groups()) == sorted([f"ep:{i}", f"tp:{i}", f"dp:{i}"])
        refs = [weakref.ref(g) for g in (ep, tp, dp)]
        engine.clear()
        del ep, tp, dp, b
        gc.collect()
        assert [r() for r in refs] == [None] * 3, "the adapter keeps dropped vLLM groups alive"
        assert all(c.closed for c in comms) and groups.closed
        assert av.mapped_groups() == [] and av._MOE_GROUPS == {} and pid not in av._POLICIES
        # A compiled graph keeps the id: its call names the cause.
        with pytest.raises(am.InvalidArgumentError, match=f"TP group of layer {pid} was released"):
            av._checked_point(2, pid)


def test_a_reduction_point_of_a_released_tp_group_names_the_release(adapter, monkeypatch):
    """A compiled graph keeps a policy id as a constant: called after its TP
    group was released, the point says so (not that the id is unknown), and
    an id never made is still refused as unknown."""
    av = adapter
    engine = _engine_groups(monkeypatch, av)
    tp = _Group("tp:released")
    engine.update(tp=tp)
    pid = av._runner_policy(_runner(tp))
    x = np.zeros((2, 4), np.float32)
    assert av.release_group(tp) and pid not in av._POLICIES
    for call in (lambda: av._point_impl(x, 2, pid), lambda: av._checked_point(0, pid)):
        with pytest.raises(am.InvalidArgumentError, match=f"the TP group of layer {pid} was released"):
            call()
    with pytest.raises(am.InvalidArgumentError, match=f"no point 2 of layer {pid + 1000}"):
        av._point_impl(x, 2, pid + 1000)


def test_a_policy_dropped_after_its_check_is_still_a_clear_error(adapter, monkeypatch):
    """The garbage collector may drop a policy in another thread between the
    point's check and its use: the use then names the release too (no bare
    KeyError)."""
    av = adapter
    engine = _engine_groups(monkeypatch, av)
    tp = _Group("tp:raced")
    engine.update(tp=tp)
    pid = av._runner_policy(_runner(tp))
    checked = av._checked_point

    def check_then_drop(point, layer):
        out = checked(point, layer)
        av.release_group(tp)  # as a collection in another thread would, here
        return out

    monkeypatch.setattr(av, "_checked_point", check_then_drop)
    with pytest.raises(am.InvalidArgumentError, match=f"the TP group of layer {pid} was released"):
        av._point_impl(np.zeros((2, 4), np.float32), 2, pid)


def test_a_destroyed_or_released_vllm_group_leaves_its_communicator_at_once(adapter, monkeypatch):
    """Still referenced (by a model's config), a group vLLM destroys leaves
    its communicator at its `destroy()` (hooked by `install()`), as
    `release_group` does; the next use builds a new one. `uninstall()`
    closes every communicator the adapter made."""
    av = adapter
    module = types.ModuleType(av.GROUPS_MODULE)
    destroyed = []

    class GroupCoordinator(_Group):
        def destroy(self):
            destroyed.append(self.unique_name)

    module.GroupCoordinator = GroupCoordinator
    monkeypatch.setitem(sys.modules, av.GROUPS_MODULE, module)
    hook = av._hook_group_destroy()
    try:
        assert hook is not None and hook[0] is GroupCoordinator
        assert av._hook_group_destroy() is None  # hooked once
        g = GroupCoordinator("ep:0")
        first = av.comm_for_group(g, "cpu").comm
        g.destroy()
        assert destroyed == ["ep:0"] and first.closed and av.mapped_groups() == []
        again = av.comm_for_group(g, "cpu").comm
        assert again is not first and not again.closed
        assert av.release_group(g) and again.closed and not av.release_group(g)
        kept = [GroupCoordinator("tp:0"), _Group("dp:0")]
        live = [av.comm_for_group(k, "cpu").comm for k in kept]
        assert len(av.mapped_groups()) == 2
        av.uninstall()
        assert all(c.closed for c in live) and av.mapped_groups() == []
    finally:
        if hook is not None:
            hook[0].destroy = hook[1]


def test_a_vllm_group_on_its_own_collectives_is_not_kept_either(adapter, monkeypatch):
    """Served by its own collectives (ranks on several hosts), a group is
    mapped once, used through itself, and not kept alive by the mapping."""
    av = adapter
    monkeypatch.setenv("ASCEND_MOE_VLLM_CPU_COMM", "group")
    g = _Group("ep:own")
    b = av.comm_for_group(g, "cpu", "ep")
    assert b.kind == "group" and b.group is g
    assert av.comm_for_group(g, "cpu", "ep").group is g
    assert av.mapped_groups() == [("ep:own", "cpu", "group")]
    ref = weakref.ref(g)
    del g, b
    gc.collect()
    assert ref() is None and av.mapped_groups() == []
