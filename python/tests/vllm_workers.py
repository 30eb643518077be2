"""Rank bodies of the vLLM-Ascend adapter tests: 4 CPU processes, a gloo group
behind each vLLM `GroupCoordinator` stand-in, vLLM-Ascend's pinned code loaded
at run time (`vllm_standins`)."""

import contextlib
import math
import os
import tempfile
import zlib

import numpy as np
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

import vllm_standins as vs

ORIGINAL_FUNCTIONS = (
    "_maybe_all_gather_and_maybe_unpad_impl",
    "_maybe_all_gather_and_maybe_unpad_fake",
    "_maybe_pad_and_reduce_impl",
    "_maybe_pad_and_reduce_fake",
)


_INIT = {}


def init(name, world, rank, tp_size=2):
    """Stand-ins, the gloo world and vLLM's groups for DP x TP = world (EP =
    world), once per process."""
    if _INIT:
        return _INIT["state"]
    vs.setup()
    init_file = os.path.join(tempfile.gettempdir(), f"{name}.gloo")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    dp_size = world // tp_size
    groups = {"ep": vs.GroupCoordinator(range(world), "ep")}
    for d in range(dp_size):
        g = vs.GroupCoordinator([d * tp_size + t for t in range(tp_size)], f"tp:{d}")
        if rank // tp_size == d:
            groups["tp"] = g
    for t in range(tp_size):
        g = vs.GroupCoordinator([d * tp_size + t for d in range(dp_size)], f"dp:{t}")
        if rank % tp_size == t:
            groups["dp"] = g
    vs.set_groups(**groups)
    ops_mod = vs.load("register_custom_ops")
    originals = {n: getattr(ops_mod, n) for n in ORIGINAL_FUNCTIONS}
    _INIT["state"] = (ops_mod, originals, groups)
    return _INIT["state"]


@contextlib.contextmanager
def cpu_comm(kind):
    """The adapter's CPU backend for vLLM's groups while inside: "comm" (a CPU
    world of the group's ranks, what it picks on one host) or "group" (the
    group's own collectives, its fallback when the ranks span hosts)."""
    import ascend_moe.vllm_ascend as av

    os.environ["ASCEND_MOE_VLLM_CPU_COMM"] = kind
    av._BACKENDS.clear()
    try:
        yield
    finally:
        av._BACKENDS.clear()
        os.environ.pop("ASCEND_MOE_VLLM_CPU_COMM", None)


def all_cases(name, world, rank):
    """`adapter_api`, `differential` (on both CPU backends), `pcp`, `mc2` and
    `compiled` in one world (one process start-up)."""
    out = {"api": adapter_api(name, world, rank), "differential": differential(name, world, rank)}
    with cpu_comm("group"):
        out["differential_group"] = differential(name, world, rank, backend="group")
    return out | {
        "pcp": pcp(name, world, rank),
        "mc2": mc2(name, world, rank),
        "compiled": compiled(name, world, rank),
        "point_dtypes": point_dtypes(name, world, rank),
    }


def adapter_api(name, world, rank):
    """install() / uninstall() / status() / register(), the shared-expert
    modes by name and value and the classifier against vLLM-Ascend's own."""
    from types import SimpleNamespace

    import ascend_moe as am
    import ascend_moe.vllm_ascend as av

    ops_mod, orig, groups = init(name, world, rank)
    fm = vs.load("fused_moe")
    se = vs.load("shared_experts")
    done = []

    # Names and values; the classifier against AscendSharedExperts.parallel_mode().
    for theirs in se.SharedExpertParallelMode:
        ours = av.SharedExpertParallelMode[theirs.name]
        assert ours.value == theirs.value, theirs
        assert av.shared_mode_of(theirs) == av.shared_mode_of(ours) == av.shared_mode_of(theirs.value) == av.shared_mode_of(theirs.name)
    assert av.shared_mode_of(se.SharedExpertParallelMode.SHARED_EXPERT_DATA_PARALLEL_ONLY) == am.SharedMode.DATA_PARALLEL_ONLY
    assert av.shared_mode_of(se.SharedExpertParallelMode.SEQUENCE_PARALLEL_SEDP) == am.SharedMode.SEQUENCE_PARALLEL_SEDP
    assert av.shared_mode_of(None) == am.SharedMode.NONE
    try:
        av.shared_mode_of(7)
        raise AssertionError("mode value 7 was accepted")
    except am.AmoeError as e:
        assert "expected 1..=4" in str(e)
    for tp in (1, 2, 4):
        for dp in (False, True):
            for sp in (False, True):
                s = se.AscendSharedExperts.__new__(se.AscendSharedExperts)
                s.weights_replicated = dp
                s.moe_config = SimpleNamespace(is_sequence_parallel=sp, tp_group=SimpleNamespace(world_size=tp))
                assert av.classify_shared_expert_mode(tp, dp, sp).name == s.parallel_mode().name, (tp, dp, sp)
    done.append("modes")

    # install() is idempotent and uninstall() restores vLLM-Ascend's code, fakes included.
    runner = fm.AscendMoERunner
    before = {m: runner.__dict__[m] for m in av.RUNNER_METHODS}
    fields = _ctx([3, 5], tp_size=2, layout=False)
    x = torch.empty(fields["padded_length"] // 2, 3)
    assert not av.status()["active"]
    first = av.install()
    assert av.install() == first and av.status()["active"] and av.status()["replaced"] == first
    assert "torch.ops.vllm.maybe_pad_and_reduce" in first and "AscendMoERunner._maybe_reduce_final_output" in first
    assert all(runner.__dict__[m] is not before[m] for m in av.RUNNER_METHODS)
    with vs.forward_context(**fields):
        ours = _fake_shape(torch.ops.vllm.maybe_all_gather_and_maybe_unpad, x)
    assert av.uninstall() == first and not av.status()["active"] and av.uninstall() == []
    assert all(runner.__dict__[m] is before[m] for m in av.RUNNER_METHODS)
    assert all(getattr(ops_mod, n) is orig[n] for n in ORIGINAL_FUNCTIONS)
    with vs.forward_context(**fields):
        theirs = _fake_shape(torch.ops.vllm.maybe_all_gather_and_maybe_unpad, x)
    assert ours == (8, 3) and theirs == (12, 3), (ours, theirs)
    # Every torch.npu.graph capture first reserves on its capture stream
    # (torch_npu's own side stream without `stream=`) what the warm-up's holds.
    class Graph:
        def __init__(self, stream):
            self.capture_stream, self.entered = stream, False

        def __enter__(self):
            self.entered = True
            return self

        def __exit__(self, *exc):
            return False

    import ascend_moe.streams as streams

    prepared, saved_graph, saved_prepare = [], torch.npu.graph, streams.prepare_capture
    torch.npu.graph, streams.prepare_capture = Graph, lambda stream, device=None: prepared.append(stream)
    try:
        original = Graph.__enter__
        hooked = av.install()
        assert hooked == first + ["torch.npu.graph.__enter__"], hooked
        with Graph("side") as g:
            assert prepared == ["side"] and g.entered, prepared

        def refused(stream, device=None):
            raise am.AmoeError(am.Status.INVALID_ARGUMENT, "no room on the capture stream")

        streams.prepare_capture = refused
        # A capture without MoE ops does not fail for it; status() says why.
        with Graph("full") as g:
            assert g.entered
        assert "no room on the capture stream" in av.status()["errors"]["prepare_capture"], av.status()
        assert av.uninstall() == hooked and Graph.__enter__ is original
        with Graph("again"):
            assert prepared == ["side"], "uninstall() left the capture hook"
    finally:
        torch.npu.graph, streams.prepare_capture = saved_graph, saved_prepare
    done.append("install/uninstall")

    # The plugin entry point installs only with ASCEND_MOE_VLLM=1.
    saved = os.environ.pop(av.SWITCH, None)
    try:
        os.environ[av.SWITCH] = "0"
        av.register()
        assert not av.status()["active"]
        os.environ[av.SWITCH] = "1"
        av.register()
        st = av.status()
        assert st["active"] and st["switch"] == "1" and st["errors"] == {}, st
    finally:
        av.uninstall()
        os.environ.pop(av.SWITCH, None)
        if saved is not None:
            os.environ[av.SWITCH] = saved
    done.append("register")
    return done


def _seed(*parts) -> int:
    """A seed every rank derives alike (str hashes differ between processes)."""
    return zlib.crc32(repr(parts).encode())


def _ints(seed, shape, dtype=torch.float32):
    """Small integers as `dtype`: every sum of four of them is exact."""
    g = np.random.default_rng(seed)
    return torch.from_numpy(g.integers(-8, 9, size=shape).astype(np.float32)).to(dtype)


def _ctx(tokens, local_sizes=None, tp_size=2, layout=True, draft=False, comm_type=None):
    dp_metadata = None
    if tokens is not None:
        dp_metadata = vs.DPMetadata(tokens, local_sizes if layout else None)
    max_tokens = max(tokens) if tokens is not None else 0
    return dict(
        dp_metadata=dp_metadata,
        padded_length=math.ceil(max_tokens / tp_size) * tp_size,
        is_draft_model=draft,
        moe_comm_type=comm_type,
    )


def _fake_shape(op, x):
    with FakeTensorMode() as fm:
        return tuple(op(fm.from_tensor(x)).shape)


def _sp_layout(tokens, tp_size):
    return [math.ceil(t / tp_size) for t in tokens for _ in range(tp_size)]


# Their unit tests' layout, uneven DP, a zero-token DP rank, tokens < TP, random.
def layout_cases(world, tp_size):
    rng = np.random.default_rng(24)
    dp = world // tp_size
    cases = [
        ("their-ut", [1, 5], [1, 1, 3, 3]),
        ("uneven", [5, 3], None),
        ("zero-token", [0, 7], None),
        ("tokens<tp", [1, 1], None),
        ("all-zero", [0, 0], None),
    ]
    for i in range(3):
        cases.append((f"random{i}", [int(t) for t in rng.integers(0, 12, size=dp)], None))
    return [(n, t, ls if ls is not None else _sp_layout(t, tp_size)) for n, t, ls in cases]


def differential(name, world, rank, backend="comm"):
    """vLLM-Ascend's own `_impl` / `_fake` against the adapter's ops, same
    inputs, with the adapter's groups on `backend` (see `cpu_comm`)."""
    import ascend_moe.vllm_ascend as av

    tp_size = 2
    ops_mod, orig, groups = init(name, world, rank, tp_size)
    ops = torch.ops.vllm
    checks = []

    def both(fn_name, x, ctx_fields):
        with vs.forward_context(**ctx_fields):
            theirs = orig[f"_{fn_name}_impl"](x)
            theirs_fake = tuple(orig[f"_{fn_name}_fake"](x).shape)
        av.install()
        try:
            with vs.forward_context(**ctx_fields):
                ours = getattr(ops, fn_name)(x)
                ours_fake = _fake_shape(getattr(ops, fn_name), x)
        finally:
            av.uninstall()
        return theirs, theirs_fake, ours, ours_fake

    # --- SP layout path (dp_metadata with a per-EP layout) and no DP metadata
    for case, tokens, ls in layout_cases(world, tp_size):
        for dtype in (torch.float32, torch.bfloat16):
            fields = _ctx(tokens, ls, tp_size)
            shards = [_ints(_seed("g", case, r), (ls[r], 3), dtype) for r in range(world)]
            theirs, tf, ours, of = both("maybe_all_gather_and_maybe_unpad", shards[rank], fields)
            want = torch.cat(shards)
            assert torch.equal(ours, want), f"{case}: adapter gather != concatenation"
            assert torch.equal(theirs, ours) and tf == of == tuple(want.shape), (case, tf, of)
            parts = [_ints(_seed("r", case, r), (sum(ls), 3), dtype) for r in range(world)]
            theirs, tf, ours, of = both("maybe_pad_and_reduce", parts[rank], fields)
            off = sum(ls[:rank])
            want = sum(p.float() for p in parts)[off : off + ls[rank]].to(dtype)
            assert torch.equal(ours, want), f"{case}: adapter reduce != EP shard of the sum"
            assert torch.equal(theirs, ours) and tf == of == tuple(want.shape), (case, tf, of)
            checks.append(case)

    # Short input (graph padding): zero rows appended, as vLLM-Ascend does; a long one is refused.
    ls = [1, 1, 3, 3]
    fields = _ctx([1, 5], ls, tp_size)
    x = _ints(7 + rank, (min(ls[rank], 1), 3))
    theirs, tf, ours, of = both("maybe_all_gather_and_maybe_unpad", x, fields)
    assert torch.equal(theirs, ours) and tf == of == (8, 3)
    av.install()
    try:
        with vs.forward_context(**fields):
            long_x = _ints(9, (ls[rank] + 1, 3))
            try:
                ops.maybe_all_gather_and_maybe_unpad(long_x)
                raise AssertionError("a long gather input was accepted")
            except RuntimeError as e:
                assert "extra rows would be dropped" in str(e), e
    finally:
        av.uninstall()
    checks.append("short/long")

    # --- no DP metadata: plain EP all-gather / reduce-scatter
    fields = _ctx(None)
    x = _ints(11 + rank, (2, 3))
    theirs, tf, ours, of = both("maybe_all_gather_and_maybe_unpad", x, fields)
    assert torch.equal(theirs, ours) and tf == of == (2 * world, 3)
    x = _ints(12 + rank, (2 * world, 3))
    theirs, tf, ours, of = both("maybe_pad_and_reduce", x, fields)
    assert torch.equal(theirs, ours) and tf == of == (2, 3)
    checks.append("no-dp-metadata")

    # --- padded_length path (DP metadata, no per-EP layout): real == real, our
    # fake == our real; vLLM-Ascend's fake disagrees with its real (8 vs 12, 3 vs 2).
    for tokens in ([3, 5], [0, 4], [1, 1], [6, 2]):
        fields = _ctx(tokens, tp_size=tp_size, layout=False)
        chunk = fields["padded_length"] // tp_size
        d, t = divmod(rank, tp_size)
        x = _ints(_seed("pg", tuple(tokens), rank), (chunk, 3))
        theirs, tf, ours, of = both("maybe_all_gather_and_maybe_unpad", x, fields)
        assert torch.equal(theirs, ours), f"padded path {tokens}: gather differs"
        assert of == tuple(ours.shape) == (sum(tokens), 3), (tokens, of)
        assert tf == (chunk * world, 3)
        parts = [_ints(_seed("pr", tuple(tokens), r), (sum(tokens), 3)) for r in range(world)]
        theirs, tf, ours, of = both("maybe_pad_and_reduce", parts[rank], fields)
        assert torch.equal(theirs, ours), f"padded path {tokens}: reduce differs"
        assert of == tuple(ours.shape) == (chunk, 3), (tokens, of)
        assert tf == (sum(tokens) // world, 3)
        checks.append(f"padded {tokens}")

    # --- seed fix 1: draft model of a VL MoE with SP, DP2 TP2.
    vs.set_vl_model(True)
    try:
        tokens = [6, 3]
        ls = _sp_layout(tokens, tp_size)
        fields = _ctx(tokens, ls, tp_size, draft=True)
        parts = [_ints(_seed("draft", r), (sum(ls), 3)) for r in range(world)]
        theirs, tf, ours, of = both("maybe_pad_and_reduce", parts[rank], fields)
        assert tuple(theirs.shape) == (sum(ls), 3) != tf, "vLLM-Ascend's draft bypass no longer returns the global rows"
        off = sum(ls[:rank])
        want = sum(parts)[off : off + ls[rank]]
        assert torch.equal(ours, want) and of == tf == tuple(want.shape)
        checks.append("draft-vl")
    finally:
        vs.set_vl_model(False)

    # --- MX dtypes: gathered as bytes.
    for dt_name in ("float8_e8m0fnu", "float4_e2m1fn_x2"):
        dt = getattr(torch, dt_name, None)
        if dt is None:
            continue
        ls = _sp_layout([5, 3], tp_size)
        fields = _ctx([5, 3], ls, tp_size)
        shards = [torch.from_numpy(np.random.default_rng(40 + r).integers(0, 255, size=(ls[r], 4)).astype(np.uint8)) for r in range(world)]
        av.install()
        try:
            with vs.forward_context(**fields):
                got = ops.maybe_all_gather_and_maybe_unpad(shards[rank].view(dt))
                shape = _fake_shape(ops.maybe_all_gather_and_maybe_unpad, shards[rank].view(dt))
        finally:
            av.uninstall()
        assert got.dtype == dt and shape == tuple(got.shape)
        assert torch.equal(got.view(torch.uint8), torch.cat(shards)), dt_name
        checks.append(dt_name)

    # --- dtypes the library does not take: vLLM-Ascend's groups move and sum
    # them; the adapter moves them as bytes and sums them on the group's own
    # collectives.
    ls = _sp_layout([5, 3], tp_size)
    fields = _ctx([5, 3], ls, tp_size)
    off = sum(ls[:rank])
    for dtype in (torch.float64, torch.complex64):
        for rest in ((3,), ()):
            shards = [_ints(_seed("g-other", r), (ls[r], *rest)).to(dtype) for r in range(world)]
            theirs, tf, ours, of = both("maybe_all_gather_and_maybe_unpad", shards[rank], fields)
            assert ours.dtype == dtype and torch.equal(ours, torch.cat(shards)), (dtype, rest)
            assert torch.equal(theirs, ours) and tf == of == tuple(ours.shape), (dtype, rest, tf, of)
            parts = [_ints(_seed("r-other", r), (sum(ls), *rest)).to(dtype) for r in range(world)]
            theirs, tf, ours, of = both("maybe_pad_and_reduce", parts[rank], fields)
            assert ours.dtype == dtype and torch.equal(ours, sum(parts)[off : off + ls[rank]]), (dtype, rest)
            assert torch.equal(theirs, ours) and tf == of == tuple(ours.shape), (dtype, rest, tf, of)
        checks.append(str(dtype).replace("torch.", ""))

    # --- hidden size 0: the reduce gives this rank's rows of nothing, the
    # shape both fakes give (vLLM-Ascend's impl raises viewing its padded
    # buffer as [-1, 0]).
    for rest in ((0,), (0, 2)):
        x = torch.ones(sum(ls), *rest)
        with vs.forward_context(**fields):
            their_fake = tuple(orig["_maybe_pad_and_reduce_fake"](x).shape)
        av.install()
        try:
            with vs.forward_context(**fields):
                got = ops.maybe_pad_and_reduce(x)
                shape = _fake_shape(ops.maybe_pad_and_reduce, x)
            # The groups map to `backend`, once each.
            kinds = {g: b for g, _, b in av.mapped_groups()}
            assert kinds.get("ep") == backend, av.mapped_groups()
        finally:
            av.uninstall()
        # uninstall() closed and forgot the communicators it made.
        assert av.mapped_groups() == [], av.mapped_groups()
        assert tuple(got.shape) == shape == their_fake == (ls[rank], *rest), (rest, got.shape, shape, their_fake)
    checks.append("hidden-0")
    dist.all_reduce(torch.zeros(1))  # every rank done before any exits
    return checks


# ------------------------------------------------------------- PCP > 1


def _dp_pcp_tp_groups(world, dp, pcp_size, tp):
    """vLLM's groups for DP x PCP x TP = world (PP 1), global rank
    (d * PCP + p) * TP + t: TP over t, PCP over p, DP over d, EP over all
    ranks in that order, as vLLM v0.27.1 builds them
    (vllm/distributed/parallel_state.py:1821-1827 and 1922-1931, commit
    6e448d0ea). Every rank creates every group, in the same order."""
    assert dp * pcp_size * tp == world
    idx = [(d, p, t) for d in range(dp) for p in range(pcp_size) for t in range(tp)]
    rank = dist.get_rank()
    mine = idx[rank]
    groups = {}
    for key, fixed in (("tp", (0, 1)), ("pcp", (0, 2)), ("dp", (1, 2))):
        seen = {}
        for r, c in enumerate(idx):
            seen.setdefault(tuple(c[i] for i in fixed), []).append(r)
        for k, ranks in seen.items():
            g = vs.GroupCoordinator(ranks, f"{key}:{k}:pcp{pcp_size}dp{dp}")
            if k == tuple(mine[i] for i in fixed):
                groups[key] = g
    return groups, mine


def pcp_cases():
    """(name, DP, PCP, TP, tokens per DP rank, max_tokens_across_pcp - gathered rows)."""
    rng = np.random.default_rng(2402)
    cases = [
        ("dp1pcp2tp2 [7]", 1, 2, 2, [7], 0),
        ("dp1pcp2tp2 [3] zero-token rank", 1, 2, 2, [3], 3),
        ("dp1pcp2tp2 [0]", 1, 2, 2, [0], 2),
        ("dp2pcp2tp1 [3, 8] zero-token rank", 2, 2, 1, [3, 8], 0),
        ("dp2pcp2tp1 [0, 6] zero-token DP rank", 2, 2, 1, [0, 6], 4),
    ]
    for i in range(2):
        # Even maxima, so padded_length splits over the PCP x TP ranks of a DP rank.
        t = [int(v) for v in rng.integers(0, 11, size=2)]
        t[t.index(max(t))] += max(t) % 2
        cases.append((f"dp2pcp2tp1 random{i} {t}", 2, 2, 1, t, int(rng.integers(0, 3))))
    return cases


@contextlib.contextmanager
def _their_ops_on_cpu(orig):
    """vLLM-Ascend's own `_impl`s as the CPU kernels of `torch.ops.vllm.*`
    (they are registered for PrivateUse1 only)."""
    lib = torch.library.Library("vllm", "FRAGMENT")
    for op in ("maybe_all_gather_and_maybe_unpad", "maybe_pad_and_reduce"):
        lib.impl(op, orig[f"_{op}_impl"], "CPU")
    try:
        yield
    finally:
        lib._destroy()


def pcp(name, world, rank):
    """vLLM-Ascend's PCP flow (PrepareAndFinalizeWithAllGather with SP and
    pcp_size 2: the EP ops on the padded_length path, a pad to
    max_tokens_across_pcp and a PCP all-gather / reduce-scatter around them)
    on DP x PCP x TP = 4 ranks, without and with `install()`: identical
    outputs and shapes, both equal to the result worked out from the inputs."""
    from types import SimpleNamespace

    import ascend_moe.vllm_ascend as av

    ops_mod, orig, base = init(name, world, rank)
    pf = vs.load("prepare_finalize")
    fa = vs.load("ascend_forward_context")
    ops = torch.ops.vllm
    H, E = 3, 4
    # Each EP rank's experts contribute c_r = r + 1 times their input.
    coeff = [r + 1 for r in range(world)]
    checks = []
    configs = {}
    for case, dp, pcp_size, tp, tokens, extra in pcp_cases():
        if (dp, pcp_size, tp) not in configs:
            configs[(dp, pcp_size, tp)] = _dp_pcp_tp_groups(world, dp, pcp_size, tp)
        groups, (d, p, t) = configs[(dp, pcp_size, tp)]
        vs.set_groups(ep=base["ep"], **groups)
        padded = math.ceil(max(tokens) / tp) * tp
        per_dp = pcp_size * tp
        assert padded % per_dp == 0, (case, padded)
        chunk = padded // per_dp
        n = sum(tokens)
        fields = dict(
            # vLLM's SP layout over DP x TP: not of the EP size, so vLLM-Ascend ignores it.
            dp_metadata=vs.DPMetadata(tokens, _sp_layout(tokens, tp)),
            padded_length=padded,
            max_tokens_across_pcp=n + extra,
            is_draft_model=False,
            moe_comm_type=fa.MoECommType.ALLGATHER,
        )
        cfg = SimpleNamespace(is_sequence_parallel=True, pcp_size=pcp_size, dp_size=dp, dp_group=groups["dp"],
                              tp_size=tp, ep_size=world)
        for dtype in (torch.float32, torch.bfloat16):
            hs = [_ints(_seed("pcp-h", case, r), (chunk, H), dtype) for r in range(world)]
            lg = [_ints(_seed("pcp-l", case, r), (chunk, E), dtype) for r in range(world)]

            def flow():
                pfo = pf.PrepareAndFinalizeWithAllGather(cfg)
                with vs.forward_context(**fields):
                    prep = pfo.prepare(hs[rank], lg[rank])
                    out = pfo.finalize(prep.hidden_states * coeff[rank], reduce_results=False)
                return prep.hidden_states, prep.router_logits, out

            with _their_ops_on_cpu(orig):
                theirs = flow()
            av.install()
            try:
                ours = flow()
                with vs.forward_context(**fields):
                    gather_fake = _fake_shape(ops.maybe_all_gather_and_maybe_unpad, hs[rank])
                    reduce_fake = _fake_shape(ops.maybe_pad_and_reduce, torch.empty(n, H, dtype=dtype))
            finally:
                av.uninstall()
            with vs.forward_context(**fields):
                their_gather_fake = tuple(orig["_maybe_all_gather_and_maybe_unpad_fake"](hs[rank]).shape)

            # The EP gather: each DP rank's padded batch (its PCP x TP chunks
            # in rank order) cut to its token count, DP ranks in order; padded
            # to max_tokens_across_pcp and gathered over PCP.
            def real_rows(parts, width):
                g = torch.cat([torch.cat(parts[dd * per_dp : (dd + 1) * per_dp])[: tokens[dd]] for dd in range(dp)])
                g = torch.cat([g, torch.zeros(extra, width, dtype=dtype)])
                return torch.cat([g] * pcp_size)

            want_h, want_l = real_rows(hs, H), real_rows(lg, E)
            # Finalize: the PCP reduce-scatter sums the PCP ranks' outputs, the
            # EP reduce-scatter sums over every rank, so each rank gets back
            # its own chunk, rows past its DP rank's token count zero, times
            # PCP x sum(c).
            real = min(max(tokens[d] - (p * tp + t) * chunk, 0), chunk)
            mask = (torch.arange(chunk) < real).unsqueeze(1)
            want_out = (hs[rank].float() * mask * (pcp_size * sum(coeff))).to(dtype)
            for what, th, ou, want in zip(("hidden_states", "router_logits", "output"), theirs, ours, (want_h, want_l, want_out)):
                assert torch.equal(ou, want), f"{case} {dtype}: adapter {what} {ou.tolist()} != {want.tolist()}"
                assert th.shape == ou.shape and torch.equal(th, ou), f"{case} {dtype}: vLLM-Ascend's {what} differs"
            # Our fakes give the shapes the real ops give on this path;
            # vLLM-Ascend's gather fake says chunk x EP rows (its real gives n).
            assert gather_fake == (n, H) and reduce_fake == (chunk, H), (case, gather_fake, reduce_fake)
            assert their_gather_fake == (chunk * world, H), (case, their_gather_fake)
        checks.append(case)
    vs.set_groups(**base)
    dist.all_reduce(torch.zeros(1))  # every rank done before any exits
    return checks


def mc2_cases():
    """(name, tokens per DP rank, real tokens per DP rank, the engine's pad target or None for vLLM-Ascend's rule)."""
    return [
        ("[3, 2]", [3, 2], [3, 2], None),
        ("[3, 2] graph padding", [3, 2], [2, 1], None),
        ("[5, 1] padded to 8", [5, 1], [4, 1], 8),
        ("[1, 0] zero-token DP rank", [1, 0], [1, 0], None),
        ("[4, 4] padded to 6", [4, 4], [4, 3], 6),
    ]


def mc2(name, world, rank):
    """vLLM-Ascend's `PrepareAndFinalizeWithMC2` (TP 2, DP 2) against
    ascend-moe's token prepare / finalize with the context the adapter reads
    from vLLM's forward context: the same rows, padded to the forward
    context's `padded_num_tokens`, and the mask written into the engine's own
    buffer equal to the slice vLLM-Ascend returns of its mask (which the engine
    writes as `set_ascend_forward_context` does)."""
    from types import SimpleNamespace

    import ascend_moe as am
    import ascend_moe.vllm_ascend as av

    _, _, groups = init(name, world, rank)
    pf = vs.load("prepare_finalize")
    fa = vs.load("ascend_forward_context")
    d, t = rank // 2, rank % 2
    cfg = SimpleNamespace(tp_group=groups["tp"], dp_group=groups["dp"], tp_size=2, dp_size=2, ep_size=world, pcp_size=1)
    checks = []
    for case, tokens, actual, target in mc2_cases():
        padded = target if target is not None else math.ceil(max(tokens) / 2) * 2
        # The engine's reserved mask, written as set_ascend_forward_context writes it.
        reserved = torch.zeros(16, dtype=torch.bool)
        engine_mask = reserved[:padded]
        engine_mask[: actual[d]] = True
        engine_mask[actual[d] :] = False
        fields = dict(
            dp_metadata=vs.DPMetadata(tokens),
            padded_num_tokens=padded,
            mc2_mask=engine_mask,
            moe_comm_type=fa.MoECommType.MC2,
        )
        for dtype in (torch.float32, torch.bfloat16):
            x = _ints(_seed("mc2", case, d), (tokens[d], 4), dtype)
            logits = _ints(_seed("mc2-l", case, d), (tokens[d], 3), dtype)
            with vs.forward_context(**fields):
                layer = pf.PrepareAndFinalizeWithMC2(cfg)
                theirs = layer.prepare(x, logits)
                their_back = layer.finalize(
                    theirs.hidden_states, reduce_results=False, padded_hidden_states_shape=theirs.padded_hidden_states_shape
                )
                ctx = av.moe_context(tokens[d], num_actual_tokens=actual[d])
                mg = av.moe_groups()
                # Our buffer starts as the opposite of the mask, so an unwritten entry shows.
                ours_buf = ~engine_mask.clone()
                rows = padded // 2
                hidden, mask = am.token_prepare(x, am.CommType.MC2, ctx, mg, mc2_mask=ours_buf[t * rows : (t + 1) * rows])
                our_logits, _ = am.token_prepare(logits, am.CommType.FUSED_MC2, ctx, mg)
                back = am.token_finalize(hidden, am.CommType.MC2, ctx, mg)
            what = f"{case} {dtype} rank {rank}"
            assert torch.equal(hidden, theirs.hidden_states), what
            assert torch.equal(our_logits, theirs.router_logits), what
            assert torch.equal(mask, theirs.mc2_mask) and mask.data_ptr() == ours_buf.data_ptr() + t * rows, what
            assert torch.equal(ours_buf[(1 - t) * rows : (2 - t) * rows], ~engine_mask[(1 - t) * rows : (2 - t) * rows]), what
            # Worked out from the inputs: rows [t * rows, (t + 1) * rows) of x padded with zeros.
            want = torch.cat([x, torch.zeros(padded - tokens[d], 4, dtype=dtype)])[t * rows : (t + 1) * rows]
            assert torch.equal(hidden, want), what
            assert torch.equal(back, their_back) and torch.equal(back, x), what
        checks.append(case)
    dist.all_reduce(torch.zeros(1))
    return checks


# ------------------------------------------------ reduction points, other dtypes


def point_dtypes(name, world, rank):
    """vLLM-Ascend's reduction points (AscendMoERunner's final and shared
    points, TP 2, a TENSOR_PARALLEL shared expert) against the adapter's, on
    both CPU backends, for dtypes the library does not take: the same
    outputs, each the TP sum where the live comm type reduces and the input
    where it does not."""
    from types import SimpleNamespace

    import ascend_moe.vllm_ascend as av

    _, _, groups = init(name, world, rank)
    fm = vs.load("fused_moe")
    se = vs.load("shared_experts")
    fa = vs.load("ascend_forward_context")
    CT = fa.MoECommType

    def make():
        r = fm.AscendMoERunner.__new__(fm.AscendMoERunner)
        r.moe_config = SimpleNamespace(is_sequence_parallel=False, tp_size=1, ep_size=world, tp_group=groups["tp"])
        r.ascend_shared_experts = SimpleNamespace(parallel_mode=lambda: se.SharedExpertParallelMode.TENSOR_PARALLEL)
        r.routed_output_transform = None
        return r

    def points(x, ct):
        with vs.forward_context(moe_comm_type=ct, dp_metadata=None):
            r = make()
            return r._maybe_reduce_final_output(x, None), r._maybe_reduce_shared_expert_output(x)

    checks = []
    tp_ranks = groups["tp"].ranks
    for dtype in (torch.float64, torch.complex64):
        xs = [_ints(_seed("point", r), (4, 3)).to(dtype) for r in range(world)]
        tp_sum = sum(xs[r] for r in tp_ranks)
        for ct in (CT.ALLGATHER, CT.MC2):
            # Final: reduced unless the routed output is (ALLGATHER without SP
            # leaves it partial); shared (TP weights): reduced when it is.
            want = (tp_sum, xs[rank]) if ct == CT.ALLGATHER else (xs[rank], tp_sum)
            theirs = points(xs[rank], ct)
            for backend in ("comm", "group"):
                with cpu_comm(backend):
                    av.install()
                    try:
                        ours = points(xs[rank], ct)
                    finally:
                        av.uninstall()
                for what, th, ou, w in zip(("final", "shared"), theirs, ours, want):
                    assert torch.equal(th, w), f"{dtype} {ct.name} {what}: vLLM-Ascend's {th} != {w}"
                    assert ou.dtype == dtype and torch.equal(ou, w), f"{dtype} {ct.name} {what} ({backend}): {ou} != {w}"
                checks.append(f"{str(dtype).replace('torch.', '')} {ct.name} {backend}")
    dist.all_reduce(torch.zeros(1))  # every rank done before any exits
    return checks


# ------------------------------------------------ seed fix 2: torch.compile


def _routed_op():
    """The routed experts after vLLM-Ascend's finalize, as the live comm type
    leaves them: the full sum R when the comm type reduces it (MC2, ALLTOALL,
    FUSED_MC2, ALLGATHER with SP), else this TP rank's partial R_t."""
    if hasattr(torch.ops.amoe_vllm_test, "routed") if hasattr(torch.ops, "amoe_vllm_test") else False:
        return torch.ops.amoe_vllm_test.routed

    @torch.library.custom_op("amoe_vllm_test::routed", mutates_args=(), device_types="cpu")
    def routed(x: torch.Tensor, sp: bool, tp_rank: int, tp_size: int) -> torch.Tensor:
        fa = vs.load("ascend_forward_context")
        ct = fa._EXTRA_CTX.moe_comm_type
        full = x * 3.0
        if ct != fa.MoECommType.ALLGATHER or sp:
            return full
        return full * (tp_rank + 1) / (tp_size * (tp_size + 1) / 2)

    @routed.register_fake
    def _(x, sp, tp_rank, tp_size):
        return torch.empty_like(x)

    return torch.ops.amoe_vllm_test.routed


def _compile_once(runner, i, x):
    """`runner.forward` compiled once under the live forward context, returned
    as a callable that always runs that compiled code, without Dynamo's guards:
    the way vLLM dispatches to its compiled code (it captures Dynamo's bytecode
    with a bytecode hook and runs it in place of `forward`), so a graph traced
    under one comm type is replayed under another."""
    import types as _types

    f = type(runner).forward
    code = f.__code__.replace(co_name=f"forward_case{i}")
    fresh = _types.FunctionType(code, f.__globals__, code.co_name, f.__defaults__, f.__closure__)
    captured = []

    def hook(old_code, new_code):
        if old_code is code:
            captured.append(new_code)

    handle = torch._dynamo.convert_frame.register_bytecode_hook(hook)
    try:
        torch.compile(_types.MethodType(fresh, runner), backend="aot_eager")(x, x)
    finally:
        handle.remove()
    assert len(captured) == 1, f"expected one compiled code object, got {len(captured)}"
    compiled_fn = _types.FunctionType(captured[0], f.__globals__, code.co_name, f.__defaults__, f.__closure__)
    return lambda *args: compiled_fn(runner, *args)


def compiled(name, world, rank):
    """A MoE layer compiled under one comm type, run under every other, for
    every shared-expert mode: wrong without the adapter, the eager result with it."""
    import types as _types

    import ascend_moe.vllm_ascend as av

    tp_size = 2
    _, _, groups = init(name, world, rank, tp_size)
    fm = vs.load("fused_moe")
    se = vs.load("shared_experts")
    fa = vs.load("ascend_forward_context")
    Mode, CT = se.SharedExpertParallelMode, fa.MoECommType
    routed = _routed_op()
    tp_rank = groups["tp"].rank_in_group

    class Runner(fm.AscendMoERunner):
        def _forward_impl(self, hidden_states, router_logits, shared_experts_input, input_ids=None):
            full_shared = hidden_states * 2.0
            if self._mode is Mode.TENSOR_PARALLEL:
                shared = full_shared * (tp_rank + 1) / (tp_size * (tp_size + 1) / 2)
            else:
                shared = full_shared
            return shared, routed(hidden_states, self._sp, tp_rank, tp_size)

    def make(mode, sp):
        r = Runner.__new__(Runner)
        if isinstance(r, torch.nn.Module):
            torch.nn.Module.__init__(r)  # the real vllm's MoERunner is a torch Module
        r._mode, r._sp = mode, sp
        r.moe_config = _types.SimpleNamespace(is_sequence_parallel=sp, tp_size=1, ep_size=world, tp_group=groups["tp"], hidden_dim=3)
        r.ascend_shared_experts = _types.SimpleNamespace(parallel_mode=lambda: mode)
        r.routed_output_transform = None
        # What the real MoERunner.forward reads besides the reduction points:
        # no input transform, no hidden-dim padding, no zero expert, scale 1,
        # and its custom-op entry (`_forward_entry`, which looks the layer up
        # by name) calling `_forward_impl` directly.
        r.routed_input_transform = None
        r._shared_experts = r.ascend_shared_experts
        r.routed_experts = _types.SimpleNamespace(quant_method=_types.SimpleNamespace(skip_forward_padding=True, has_unpadded_output=False))
        r.router = None
        r.layer_name = "moe"
        r.routed_scaling_factor = 1.0
        r._forward_entry = lambda hs, logits, shared_in, input_ids, layer_name, unpadded: r._forward_impl(hs, logits, shared_in, input_ids)
        return r

    cts = [CT.ALLGATHER, CT.MC2, CT.ALLTOALL, CT.FUSED_MC2]
    # One trace per class of "already reduced?" (ALLTOALL and FUSED_MC2 trace like MC2).
    TRACED = [CT.ALLGATHER, CT.MC2]
    def tokens(sp):
        # Without SP the ranks of a TP group hold the same tokens; with SP each its own shard.
        return torch.arange(12, dtype=torch.float32).view(4, 3) + (rank if sp else rank // tp_size)
    results = []
    # Without the adapter; with it over a CPU world of the TP group ("comm");
    # with it over the group's own collectives ("group": what the adapter
    # falls back to when the ranks span hosts), where the adapter itself
    # decides whether a point reduces.
    for adapter in (None, "comm", "group"):
        with cpu_comm(adapter) if adapter else contextlib.nullcontext():
            if adapter:
                av.install()
            try:
                for sp in (False, True):
                    modes = [Mode.SEQUENCE_PARALLEL_ONLY, Mode.SEQUENCE_PARALLEL_SEDP] if sp else [Mode.TENSOR_PARALLEL, Mode.SHARED_EXPERT_DATA_PARALLEL_ONLY]
                    x = tokens(sp)
                    want = x * 5.0  # S + R
                    for mode in modes:
                        for traced in TRACED:
                            torch._dynamo.reset()
                            runner = make(mode, sp)
                            with vs.forward_context(moe_comm_type=traced, dp_metadata=None):
                                eager = runner.forward(x, x)
                                fn = _compile_once(runner, len(results), x)
                            assert torch.allclose(eager, want), f"eager reference wrong for {mode} under {traced}"
                            for run in cts:
                                with vs.forward_context(moe_comm_type=run, dp_metadata=None):
                                    got = fn(x, x)
                                ok = torch.allclose(got, want)
                                # vLLM-Ascend's "already reduced?" differs between the two comm types.
                                vllm_differs = (traced == CT.ALLGATHER and not sp) != (run == CT.ALLGATHER and not sp)
                                if adapter:
                                    assert ok, f"adapter ({adapter}): {mode.name} traced {traced.name} run {run.name} (sp={sp}): {got} != {want}"
                                else:
                                    assert ok != vllm_differs, (
                                        f"without adapter: {mode.name} traced {traced.name} run {run.name} (sp={sp}): "
                                        f"expected {'wrong' if vllm_differs else 'right'} result: {got[0].tolist()} vs {want[0].tolist()}"
                                    )
                                results.append((adapter, mode.name, traced.name, run.name, sp, ok))
                if adapter:
                    kind = av.comm_for_group(groups["tp"]).kind
                    assert kind == adapter, f"the TP group ran on the {kind!r} backend, not {adapter!r}"
            finally:
                if adapter:
                    av.uninstall()
    dist.all_reduce(torch.zeros(1))  # every rank done before any exits
    return results
