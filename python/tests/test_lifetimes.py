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
