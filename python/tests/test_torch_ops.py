"""The torch custom ops (`torch.ops.ascend_moe.*`): schemas and fake kernels
checked by `torch.library.opcheck`, fake / meta shapes against the real ones,
numerics against the numpy goldens of `workers`, a compiled graph that takes
the comm type at run time, and the collectives across 4 processes.

Skipped only when torch is not importable outside CI; under CI (`$CI` set)
a missing torch fails the run instead of skipping it."""

import math
import os
import re
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import numpy as np
import pytest

import ascend_moe as am

from workers import require, torch_ops_missing  # noqa: E402

require("torch custom-op", torch_ops_missing())

import torch  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

import torch_workers  # noqa: E402
from torch_workers import to_numpy, to_torch  # noqa: E402
from workers import DTYPES, assert_close, finalize_case, finalize_golden, rand, rng_for, unpermute_golden  # noqa: E402
from world import run_world  # noqa: E402

OPS = torch.ops.ascend_moe
ALL_OPS = [
    "moe_finalize_routing",
    "moe_token_unpermute",
    "all_reduce",
    "reduce_scatter",
    "all_gather",
    "maybe_pad_and_reduce",
    "maybe_all_gather_and_maybe_unpad",
    "reduce_routed_early",
    "reduce_shared",
    "reduce_final",
]


def finalize_inputs(mode, dtype, seed, **flags):
    """`(args, kwargs, golden)` of one finalize case, as tensors."""
    ex, idx, kw = finalize_case(rng_for("torch-fin", mode, str(dtype), seed), mode, dtype, **flags)
    want = finalize_golden(ex, idx, kw["x1"], kw["x2"], kw["bias"], kw["scales"], kw["expert_idx"], mode)
    tkw = {k: (to_torch(v) if isinstance(v, np.ndarray) else v) for k, v in kw.items()}
    return (to_torch(ex), to_torch(idx)), tkw, want


FIN_FLAGS = [
    dict(x1=True, x2=True, bias=True, scales=True),
    dict(x1=False, x2=False, bias=False, scales=False),
    dict(x1=True, x2=False, bias=False, scales=True),
]


def test_every_op_is_registered_with_int_handles():
    for name in ALL_OPS:
        assert hasattr(OPS, name), name
    schema = str(OPS.reduce_final.default._schema)
    # The comm type and the communicator are plain (Sym)Int arguments: run-time values in a graph.
    assert "comm_type" in schema and "tp_comm" in schema and "Tensor x" in schema, schema
    assert "int[]? local_sizes" in str(OPS.maybe_pad_and_reduce.default._schema).replace("SymInt", "int")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", [0, 1, 2, 3])
def test_opcheck_finalize(dtype, mode):
    for i, flags in enumerate(FIN_FLAGS):
        args, kwargs, _ = finalize_inputs(mode, dtype, i, **flags)
        torch.library.opcheck(OPS.moe_finalize_routing.default, args, kwargs)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_opcheck_unpermute(dtype):
    g = rng_for("torch-unperm", str(dtype))
    permuted = rand(g, (12, 4), dtype)
    idx = g.permutation(12).astype(np.int32)
    probs = rand(g, (4, 3), dtype)
    torch.library.opcheck(OPS.moe_token_unpermute.default, (to_torch(permuted), to_torch(idx), to_torch(probs)))
    torch.library.opcheck(OPS.moe_token_unpermute.default, (to_torch(permuted), to_torch(idx[:4])))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_local_ops_match_the_numpy_goldens(dtype):
    for mode in range(4):
        for i, flags in enumerate(FIN_FLAGS):
            args, kwargs, want = finalize_inputs(mode, dtype, 10 + i, **flags)
            got = OPS.moe_finalize_routing(*args, **kwargs)
            assert got.dtype == args[0].dtype
            assert_close(to_numpy(got), want, dtype, f"torch finalize mode {mode} {flags}")
    g = rng_for("torch-unperm-golden", str(dtype))
    t, k = 5, 3
    permuted = rand(g, (t * k, 2, 3), dtype)
    idx = g.integers(-2, t * k + 2, size=t * k).astype(np.int32)  # out-of-range rows contribute 0
    probs = rand(g, (t, k), dtype)
    got = OPS.moe_token_unpermute(to_torch(permuted), to_torch(idx), to_torch(probs))
    assert got.dtype == to_torch(permuted).dtype
    assert_close(to_numpy(got), unpermute_golden(permuted, idx, probs), dtype, "torch unpermute")


def test_fake_and_meta_shapes_match_the_real_op():
    for dtype in DTYPES:
        for mode in range(4):
            args, kwargs, _ = finalize_inputs(mode, dtype, 20)
            real = OPS.moe_finalize_routing(*args, **kwargs)
            with FakeTensorMode() as fm:
                fargs = [fm.from_tensor(a) for a in args]
                fkw = {k: fm.from_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
                fake = OPS.moe_finalize_routing(*fargs, **fkw)
            meta = OPS.moe_finalize_routing(
                *[a.to("meta") for a in args],
                **{k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()},
            )
            for out in (fake, meta):
                assert (tuple(out.shape), out.dtype) == (tuple(real.shape), real.dtype), (mode, dtype)
    permuted, idx = torch.zeros(6, 4, dtype=torch.bfloat16), torch.arange(6, dtype=torch.int32)
    probs = torch.ones(3, 2)
    real = OPS.moe_token_unpermute(permuted, idx, probs)
    meta = OPS.moe_token_unpermute(permuted.to("meta"), idx.to("meta"), probs.to("meta"))
    assert tuple(meta.shape) == tuple(real.shape) == (3, 4) and meta.dtype == real.dtype == torch.bfloat16


def test_fake_rejects_a_bad_shape_with_the_library_message():
    # 7 indices without scales: N = 7, K = 1, so expanded_x needs 7 rows, not 8.
    ex, idx, x1 = torch.zeros(8, 3), torch.arange(7, dtype=torch.int32), torch.zeros(7, 3)
    with pytest.raises(am.AmoeError) as real:
        OPS.moe_finalize_routing(ex, idx, x1=x1)
    with FakeTensorMode() as fm:
        with pytest.raises(am.AmoeError) as fake:
            OPS.moe_finalize_routing(fm.from_tensor(ex), fm.from_tensor(idx), x1=fm.from_tensor(x1))
    assert fake.value.status == real.value.status == am.Status.SHAPE
    assert str(fake.value) == str(real.value)
    assert "moe_finalize_routing" in str(fake.value) and "[8, 3]" in str(fake.value), str(fake.value)
    with pytest.raises(am.AmoeError, match="expanded_x` has dtype float64"):
        OPS.moe_finalize_routing(torch.zeros(7, 2, device="meta", dtype=torch.float64), idx.to("meta"))
    with pytest.raises(am.AmoeError, match="moe_token_unpermute"):
        OPS.moe_token_unpermute(torch.zeros(6, 2, device="meta"), idx.to("meta"), torch.zeros(3, 2, device="meta"))


def test_stale_comm_handle_fails_in_fake_and_real():
    with am.Comm.cpu(f"torch-stale-{uuid.uuid4().hex[:8]}", 1, 0) as c:
        hid = c.handle_id
        assert am.Comm.lookup(hid) is c
    with pytest.raises(am.AmoeError, match=f"handle_id {hid}"):
        OPS.all_reduce(torch.ones(2), hid)
    with pytest.raises(am.AmoeError, match=f"handle_id {hid}"):
        OPS.all_gather(torch.ones(2, device="meta"), hid)


def test_missing_names_what_this_torch_lacks(monkeypatch):
    """The ops need schema inference (public from torch 2.5; torch 2.4's
    private one also serves), fake kernels, libraries and the guard below
    autograd; without them `import ascend_moe` leaves the ops out and
    TORCH_OPS_ERROR names what is missing."""
    import torch._library.infer_schema as private

    from ascend_moe import _torch_ops

    assert _torch_ops.missing() == []
    monkeypatch.delattr(torch.library, "infer_schema")
    assert _torch_ops.missing() == []
    assert _torch_ops._infer_schema() is private.infer_schema
    monkeypatch.delattr(private, "infer_schema")
    monkeypatch.delattr(torch._C, "_AutoDispatchBelowAutograd")
    assert _torch_ops.missing() == ["torch.library.infer_schema", "torch._C._AutoDispatchBelowAutograd"]
    assert _torch_ops.register() is False


def test_ops_have_no_gradient_and_say_so():
    """The ops are not differentiable: with an input that requires grad the
    forward runs (grad mode on or off) and gives the op's values, and a
    backward through it fails naming the op, never a silent None gradient."""
    (ex, idx), kw, want = finalize_inputs(2, np.float32, 0)
    x = ex.clone().requires_grad_(True)
    y = OPS.moe_finalize_routing(x, idx, **kw)
    assert y.requires_grad
    assert_close(to_numpy(y.detach()), want, np.float32, "finalize with an input requiring grad")
    with pytest.raises(RuntimeError, match="ascend_moe::moe_finalize_routing has no gradient"):
        y.sum().backward()
    assert x.grad is None
    with torch.no_grad():
        z = OPS.moe_finalize_routing(x, idx, **kw)
    assert not z.requires_grad
    assert_close(to_numpy(z), want, np.float32, "finalize under no_grad")
    with am.Comm.cpu(f"torch-grad-{uuid.uuid4().hex[:8]}", 1, 0) as c:
        r = OPS.all_reduce(torch.ones(3, requires_grad=True), c.handle_id)
        with pytest.raises(RuntimeError, match="ascend_moe::all_reduce has no gradient"):
            r.sum().backward()


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_ops_with_an_input_requiring_grad_run_as_eager(backend):
    """torch.compile traces the backward of a forward with an input that
    requires grad when it compiles: the no-gradient backward traces, so the
    compiled forward gives eager's values, with an output that requires grad,
    and a backward, eager or compiled, fails naming the op."""
    (ex, idx), kw, _ = finalize_inputs(2, np.float32, 0)
    kw["scales"] = kw["scales"].clone().requires_grad_(True)  # beside `idx`, an int tensor
    x = ex.clone().requires_grad_(True)
    with am.Comm.cpu(f"torch-grad-compile-{uuid.uuid4().hex[:8]}", 1, 0) as c:

        def fn(x):
            return OPS.all_reduce(OPS.moe_finalize_routing(x, idx, **kw), c.handle_id) * 2

        torch._dynamo.reset()
        compiled = torch.compile(fn, backend=backend, fullgraph=True)
        want, got = fn(x), compiled(x)
        assert want.requires_grad and got.requires_grad
        assert torch.equal(got.detach(), want.detach())
        for y in (want, got):
            with pytest.raises(RuntimeError, match="ascend_moe::all_reduce has no gradient"):
                y.sum().backward()
        torch._dynamo.reset()
        y = torch.compile(lambda x: OPS.moe_finalize_routing(x, idx, **kw), backend=backend, fullgraph=True)(x)
        with pytest.raises(RuntimeError, match="ascend_moe::moe_finalize_routing has no gradient"):
            y.sum().backward()
    assert x.grad is None and kw["scales"].grad is None


def test_the_no_gradient_backward_raises_when_it_runs_never_when_traced():
    # What a backward returns for an input of an op: traced (a fake, even of a
    # gradient FakeTensorMode made itself, which it runs untagged ops on) it
    # is an empty gradient of the input's shape and dtype; run, it raises.
    with FakeTensorMode():
        g = OPS._no_gradient(torch.tensor([1.0]), [1], torch.bfloat16, "ascend_moe::all_reduce")
    assert (tuple(g.shape), g.dtype) == ((1,), torch.bfloat16)
    with pytest.raises(RuntimeError, match="ascend_moe::all_reduce has no gradient"):
        OPS._no_gradient(torch.ones(1, 2), [1, 2], torch.bfloat16, "ascend_moe::all_reduce")


def test_opcheck_collectives_on_a_world_of_one():
    """Schema, fake and AOT checks of every communicating op on one rank (the
    4-process test runs them where the collectives do real work)."""
    with am.Comm.cpu(f"torch-one-{uuid.uuid4().hex[:8]}", 1, 0) as c:
        torch_workers.opcheck_comm_ops(c, rank=0, world_size=1)


def test_compiled_finalize_then_reduce_takes_the_comm_type_at_run_time():
    """Rank 0 runs a compiled finalize + TP reduction (one graph, comm type a
    graph input); rank 1 is a thread of this process running the numpy API.
    Policy `tensor_parallel`, no transform, no SP, TP 2: under ALLGATHER the
    routed outputs are TP-partial, so the output is S0 + S1 + R0 + R1; under
    MC2 / ALLTOALL each rank's routed output is already complete, so it is
    S0 + S1 + R_rank (SPEC section 5)."""
    comm_types = [am.CommType.ALLGATHER, am.CommType.MC2, am.CommType.ALLTOALL, am.CommType.ALLGATHER]
    policy = am.ReducePolicy("tensor_parallel", False, False, 2, 2)

    def inputs(rank):
        ex, idx, kw = finalize_case(rng_for("torch-compile", rank), 0, np.float32, n=4, k=2, h=(3,))
        shared = rand(rng_for("torch-compile-shared", rank), (4, 3), np.float32)
        return ex, idx, kw, shared

    def opt(kw):
        return [kw[k] for k in ("x1", "x2", "bias", "scales", "expert_idx")]

    routed = [finalize_golden(ex, idx, *opt(kw), 0) for ex, idx, kw, _ in map(inputs, (0, 1))]
    shared_sum = inputs(0)[3].astype(np.float64) + inputs(1)[3]

    def golden(ct, rank):
        return shared_sum + (routed[0] + routed[1] if ct == am.CommType.ALLGATHER else routed[rank])

    name = f"torch-compile-{uuid.uuid4().hex[:8]}"
    peer_out, peer_err = [], []

    def peer():
        try:
            with am.Comm.cpu(name, 2, 1, timeout_s=120.0) as tp:
                ex, idx, kw, shared = inputs(1)
                for ct in comm_types:
                    r = policy.reduce_routed_early(am.moe_finalize_routing(ex, idx, **kw), ct, tp)
                    s = policy.reduce_shared(shared, ct, tp)
                    peer_out.append(policy.reduce_final(s + r, ct, tp))
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            peer_err.append(e)

    graphs = []

    def backend(gm, example_inputs):  # eager execution, keeping the graph to inspect
        graphs.append(gm)
        return gm.forward

    def layer(ex, idx, x1, x2, bias, scales, expert_idx, shared, comm_type: int, tp: int):
        routed = OPS.moe_finalize_routing(ex, idx, x1, x2, bias, scales, expert_idx, 0)
        routed = OPS.reduce_routed_early(routed, comm_type, tp, *policy.fields)
        shared = OPS.reduce_shared(shared, comm_type, tp, *policy.fields)
        return OPS.reduce_final(shared + routed, comm_type, tp, *policy.fields)

    compiled = torch.compile(layer, fullgraph=True, backend=backend, dynamic=True)
    t = threading.Thread(target=peer, daemon=True)
    t.start()
    try:
        with am.Comm.cpu(name, 2, 0, timeout_s=120.0) as tp:
            ex, idx, kw, shared = inputs(0)
            targs = [to_torch(a) for a in (ex, idx, *opt(kw), shared)]
            for ct in comm_types:
                got = compiled(*targs, int(ct), tp.handle_id)
                assert_close(got.numpy(), golden(ct, 0), np.float32, f"compiled layer under {ct.name}")
    finally:
        t.join(timeout=150.0)
    assert not peer_err, peer_err
    assert len(peer_out) == len(comm_types)
    for ct, out in zip(comm_types, peer_out):
        assert_close(out, golden(ct, 1), np.float32, f"peer under {ct.name}")
    # One graph served every comm type, with the comm type as one of its inputs.
    assert len(graphs) == 1, [g.code for g in graphs]
    placeholders = [n for n in graphs[0].graph.nodes if n.op == "placeholder"]
    assert any("comm_type" in n.name for n in placeholders), graphs[0].code


def test_torch_ops_across_4_processes():
    results, _ = run_world(torch_workers.torch_world, 4, deadline_s=180.0, torch_ops=True)
    counts = set(results.values())
    assert len(counts) == 1 and counts.pop() >= 40, results



def test_ascend_moe_torch_0_keeps_torch_out_of_the_process():
    code = "import sys, ascend_moe as am; print(am.TORCH_OPS, 'torch' in sys.modules, am.TORCH_OPS_ERROR)"
    env = dict(os.environ, ASCEND_MOE_TORCH="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split(maxsplit=2)[:2] == ["False", "False"] and "ASCEND_MOE_TORCH=0" in out, out


def test_ascend_moe_torch_other_values_are_warned_about_and_taken_as_unset():
    code = "import ascend_moe as am; print(am.TORCH_OPS_ERROR != 'torch custom ops disabled by ASCEND_MOE_TORCH=0')"
    env = dict(os.environ, ASCEND_MOE_TORCH="false")
    run = subprocess.run([sys.executable, "-W", "always", "-c", code], env=env, capture_output=True, text=True, check=True)
    assert run.stdout.strip() == "True", run
    assert "ASCEND_MOE_TORCH='false' is ignored" in run.stderr, run.stderr


def test_compiled_layer_reads_the_forward_context_at_run_time():
    """SPEC section 5, forward context: DP 2 x TP 2 as 4 threads of this
    process; rank 0 runs `moe_layer_fc` + `reduce_final_fc` compiled once with
    the default, non-dynamic `torch.compile(fullgraph=True)` under ALLGATHER
    and DP tokens [6, 3], the others run the same ops eagerly. Then every other
    comm type, and DP tokens that change the other rank's count and the
    gathered row count, reuse that graph and give the right result (the real
    ops read the live context; their output shapes depend on the input only).
    Tokens that change rank 0's own rows change the input shape: Dynamo's shape
    guard retraces, so the fake sees the new context; a context that does not
    fit the input is an error, never a silent result.

    Experts: `2 h + 1` per token. Under ALLGATHER every EP rank returns its
    share `w_rank * (2 h + 1)` (the shares sum to 1 over the 4 ranks, as local
    experts' contributions do); under MC2 / ALLTOALL / FUSED_MC2 dispatch and
    combine give each token the whole `2 h + 1`. Policy: no shared expert, no
    transform, no SP, TP 2: reduce_final all-reduces exactly when ALLGATHER."""
    import torch._dynamo

    world, tp_size = 4, 2
    share = [0.1, 0.2, 0.3, 0.4]
    steps = [
        (am.CommType.ALLGATHER, (6, 3)),
        (am.CommType.MC2, (6, 3)),
        (am.CommType.ALLTOALL, (6, 3)),
        (am.CommType.FUSED_MC2, (6, 3)),
        (am.CommType.ALLGATHER, (6, 7)),  # the gathered rows change, rank 0's do not
        (am.CommType.MC2, (6, 7)),
        (am.CommType.ALLGATHER, (4, 3)),  # rank 0's rows change: a retrace
        (am.CommType.MC2, (4, 3)),
    ]
    name = f"torch-fc-{uuid.uuid4().hex[:8]}"
    outs = {r: [] for r in range(world)}
    errors, graphs_seen = [], []
    graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]

    def tokens(d, n):
        return rand(rng_for("torch-fc", d), (n, 3), np.float32)

    def rank_body(rank, compiled_fn=None):
        d, t = rank // tp_size, rank % tp_size
        with am.Comm.cpu(name, world, rank, timeout_s=120.0) as w, am.MoeGroups(w, tp_size) as groups:
            with w.split([d * tp_size + i for i in range(tp_size)]) as tp:
                policy = am.ReducePolicy("none", False, False, tp_size, world)

                def experts(hidden, mask, ct):
                    y = (2.0 * hidden.astype(np.float64) + 1.0).astype(np.float32)
                    return y * np.float32(share[rank]) if ct == am.CommType.ALLGATHER else y

                layer = am.MoeLayer(groups, tp, tp_size, d, t, experts, policy)
                lid = layer.layer_id

                def fwd(x):
                    return OPS.reduce_final_fc(OPS.moe_layer_fc(x, lid), lid)

                fn = torch.compile(fwd, fullgraph=True) if compiled_fn else fwd
                for ct, dp_tokens in steps:
                    with am.forward_context(ct, dp_tokens):
                        outs[rank].append(fn(to_torch(tokens(d, dp_tokens[d]))).numpy())
                if compiled_fn:
                    graphs_seen.append(torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs_before)
                    # A context that does not fit the input: rank 0 has 6 rows, the context says 5.
                    with am.forward_context(am.CommType.MC2, (5, 3)):
                        with pytest.raises(Exception, match="5 rows"):
                            fn(to_torch(tokens(0, 6)))
                layer.close()

    def peer(rank):
        try:
            rank_body(rank)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append((rank, e))

    threads = [threading.Thread(target=peer, args=(r,), daemon=True) for r in range(1, world)]
    for th in threads:
        th.start()
    try:
        rank_body(0, compiled_fn=True)
    finally:
        for th in threads:
            th.join(timeout=200.0)
    assert not errors, errors
    for rank in range(world):
        d = rank // tp_size
        for (ct, dp_tokens), got in zip(steps, outs[rank]):
            want = 2.0 * tokens(d, dp_tokens[d]).astype(np.float64) + 1.0
            if ct == am.CommType.ALLGATHER:
                # DP reduce-scatter sums the shares of (0, t) and (1, t); the TP all-reduce the two t.
                want = want * sum(share)
            assert_close(got, want, np.float32, f"rank {rank} under {ct.name} tokens {dp_tokens}")
    # One graph for the first six steps (every comm type, new DP tokens), one
    # retrace when rank 0's input rows changed.
    assert graphs_seen == [2], graphs_seen


def test_quantized_torch_dtypes_move_as_bytes():
    """torch.int8 / uint8 / bool / float8_e4m3fn / float8_e5m2 through the
    torch gather ops (exact bytes, fake shapes agree); a reduction refuses them."""
    with am.Comm.cpu(f"torch-bytes-{uuid.uuid4().hex[:8]}", 1, 0) as c:
        hid = c.handle_id
        base = torch.arange(24, dtype=torch.uint8).reshape(8, 3) * 11
        for dt in (torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2):
            x = (base % 2).to(torch.bool) if dt == torch.bool else base.view(dt)
            for op, args in ((OPS.all_gather, (hid,)), (OPS.maybe_all_gather_and_maybe_unpad, (hid, [8]))):
                got = op(x, *args)
                assert got.dtype == dt and tuple(got.shape) == torch_workers._fake_shape(op, x, *args)
                assert torch.equal(got.view(torch.uint8), x.view(torch.uint8)), (dt, op)
            with pytest.raises(am.AmoeError, match="never reduced"):
                OPS.all_reduce(x, hid)


def test_forward_context_ops_pass_opcheck_and_need_a_context():
    """Schema / fake / AOT checks of the context-reading ops on one rank, and a
    clear error (never a default) when no forward context is set."""
    with am.Comm.cpu(f"torch-fc1-{uuid.uuid4().hex[:8]}", 1, 0) as c, am.MoeGroups(c, 1) as groups:
        policy = am.ReducePolicy("none", False, False, 1, 1)
        layer = am.MoeLayer(groups, c, 1, 0, 0, lambda h, mask, ct: h * np.float32(2.0), policy)
        x = torch.arange(12, dtype=torch.float32).reshape(4, 3)
        try:
            with pytest.raises(am.AmoeError, match="no MoE forward context"):
                OPS.moe_layer_fc(x, layer.layer_id)
            for ct in am.CommType:
                with am.forward_context(ct, [4]):
                    torch.library.opcheck(OPS.moe_layer_fc.default, (x, layer.layer_id))
                    torch.library.opcheck(OPS.reduce_final_fc.default, (x, layer.layer_id))
                    assert torch.equal(OPS.moe_layer_fc(x, layer.layer_id), x * 2)
            with am.forward_context(am.CommType.MC2, [4], sp=True):
                with pytest.raises(am.AmoeError, match="sp=False"):
                    OPS.reduce_final_fc(x, layer.layer_id)
        finally:
            layer.close()
        with pytest.raises(am.AmoeError, match=f"no MoE layer is registered under id {layer.layer_id}"):
            with am.forward_context(am.CommType.MC2, [4]):
                OPS.moe_layer_fc(x, layer.layer_id)
        # A closed layer's id is never handed out again: the stale id keeps failing.
        later = am.MoeLayer(groups, c, 1, 0, 0, lambda h, mask, ct: h * np.float32(3.0), policy)
        try:
            assert later.layer_id != layer.layer_id
            with pytest.raises(am.AmoeError, match=f"no MoE layer is registered under id {layer.layer_id}"):
                with am.forward_context(am.CommType.MC2, [4]):
                    OPS.moe_layer_fc(x, layer.layer_id)
        finally:
            later.close()


def test_experts_that_change_the_dtype_are_refused_not_reinterpreted():
    """The routed output keeps the tokens' dtype: float32 experts under bfloat16
    tokens would otherwise have their bytes read as bfloat16 pairs (a result of
    another shape than the fake's)."""
    with am.Comm.cpu(f"torch-fc2-{uuid.uuid4().hex[:8]}", 1, 0) as c, am.MoeGroups(c, 1) as groups:
        policy = am.ReducePolicy("none", False, False, 1, 1)
        layer = am.MoeLayer(groups, c, 1, 0, 0, lambda h, mask, ct: h.astype(np.float32) * 2, policy)
        try:
            x = torch.arange(6, dtype=torch.bfloat16).reshape(3, 2)
            with am.forward_context(am.CommType.ALLTOALL, [3]):
                with pytest.raises(am.AmoeError, match="experts returned float32 for bfloat16 tokens") as e:
                    OPS.moe_layer_fc(x, layer.layer_id)
            assert e.value.status == am.Status.DTYPE
        finally:
            layer.close()


def test_experts_that_change_the_hidden_shape_are_refused():
    """The fake of `moe_layer_fc` sizes its output from the input alone: the
    routed output has the prepared rows and the tokens' hidden shape. Experts
    that return another hidden shape (fewer or more columns, an extra dim)
    would make the real op return a tensor of another shape than the fake's
    (4 x 3 here), which a compiled graph cannot hold: the real op refuses it
    with a ShapeError naming both shapes, under every comm type."""
    with am.Comm.cpu(f"torch-fc-shape-{uuid.uuid4().hex[:8]}", 1, 0) as c, am.MoeGroups(c, 1) as groups:
        policy = am.ReducePolicy("none", False, False, 1, 1)
        x = torch.arange(12, dtype=torch.float32).reshape(4, 3)
        bad = {
            "[4, 2]": lambda h, mask, ct: np.ascontiguousarray(h[:, :2]),
            "[4, 6]": lambda h, mask, ct: np.concatenate([h, h], axis=1),
            "[4, 3, 1]": lambda h, mask, ct: h.reshape(h.shape[0], 3, 1),
        }
        for shape, experts in bad.items():
            layer = am.MoeLayer(groups, c, 1, 0, 0, experts, policy)
            try:
                for ct in am.CommType:
                    with am.forward_context(ct, [4]):
                        with FakeTensorMode() as fm:
                            assert OPS.moe_layer_fc(fm.from_tensor(x), layer.layer_id).shape == (4, 3)
                        with pytest.raises(am.ShapeError, match=f"experts returned shape {re.escape(shape)}.*\\[4, 3\\]"):
                            OPS.moe_layer_fc(x, layer.layer_id)
            finally:
                layer.close()


def test_moe_layer_fc_refuses_dtypes_numpy_cannot_hold_as_its_fake_does():
    """The CPU kernel of `moe_layer_fc` hands the experts numpy views of the
    tokens. A dtype the library does not take and numpy cannot represent
    (fnuz fp8, e8m0, bits8) is refused with the DTypeError naming `x`
    that the fake raises, not a bare TypeError from `Tensor.numpy()`."""
    with am.Comm.cpu(f"torch-fc-dtype-{uuid.uuid4().hex[:8]}", 1, 0) as c, am.MoeGroups(c, 1) as groups:
        policy = am.ReducePolicy("none", False, False, 1, 1)
        layer = am.MoeLayer(groups, c, 1, 0, 0, lambda h, mask, ct: h, policy)
        dtypes = [torch.float8_e4m3fnuz, torch.float8_e5m2fnuz, torch.bits8]
        dtypes += [d for d in (getattr(torch, "float8_e8m0fnu", None),) if d is not None]
        try:
            with am.forward_context(am.CommType.MC2, [4]):
                for dtype in dtypes:
                    x = torch.zeros(4, 3, dtype=torch.uint8).view(dtype)
                    with pytest.raises(am.DTypeError) as meta:
                        OPS.moe_layer_fc(x.to("meta"), layer.layer_id)
                    with pytest.raises(am.DTypeError) as real:
                        OPS.moe_layer_fc(x, layer.layer_id)
                    assert str(real.value) == str(meta.value), dtype
                    assert str(real.value).startswith(f"`x` has dtype {str(dtype)[len('torch.'):]}"), str(real.value)
        finally:
            layer.close()


def test_context_ops_of_a_layer_with_closed_groups_fail_at_trace_time():
    """A layer whose MoE groups or TP communicator were closed cannot run:
    `moe_layer_fc` needs the groups, the `*_fc` reduction points the TP
    communicator. As the collectives' fakes refuse a stale handle, the fakes
    of these ops refuse such a layer with the real op's error, so a trace
    (meta tensors, FakeTensorMode) fails instead of a graph that fails later."""
    with am.Comm.cpu(f"torch-fc-closed-{uuid.uuid4().hex[:8]}", 1, 0) as c:
        groups, tp = am.MoeGroups(c, 1), c.split([0])
        layer = am.MoeLayer(groups, tp, 1, 0, 0, lambda h, mask, ct: h, am.ReducePolicy("none", False, False, 1, 1))
        x = torch.ones(4, 3)
        try:
            with am.forward_context(am.CommType.ALLGATHER, [4]):
                tp.close()
                for op in (OPS.reduce_routed_early_fc, OPS.reduce_shared_fc, OPS.reduce_final_fc):
                    for t in (x, x.to("meta")):
                        with pytest.raises(am.InvalidArgumentError, match="the communicator is closed"):
                            op(t, layer.layer_id)
                    with FakeTensorMode():
                        with pytest.raises(am.InvalidArgumentError, match="the communicator is closed"):
                            op(torch.ones(4, 3), layer.layer_id)
                assert torch.equal(OPS.moe_layer_fc(x, layer.layer_id), x)  # needs no TP communicator
                groups.close()
                for t in (x, x.to("meta")):
                    with pytest.raises(am.InvalidArgumentError, match="the MoE groups are closed"):
                        OPS.moe_layer_fc(t, layer.layer_id)
                with FakeTensorMode():
                    with pytest.raises(am.InvalidArgumentError, match="the MoE groups are closed"):
                        OPS.moe_layer_fc(torch.ones(4, 3), layer.layer_id)
        finally:
            layer.close()


def test_layers_created_on_several_threads_get_distinct_ids():
    with am.Comm.cpu(f"torch-fc3-{uuid.uuid4().hex[:8]}", 1, 0) as c, am.MoeGroups(c, 1) as groups:
        policy = am.ReducePolicy("none", False, False, 1, 1)
        made = [[] for _ in range(4)]

        def create(out):
            for _ in range(500):
                out.append(am.MoeLayer(groups, c, 1, 0, 0, lambda h, mask, ct: h, policy))

        threads = [threading.Thread(target=create, args=(m,)) for m in made]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        layers = [layer for m in made for layer in m]
        try:
            assert len({layer.layer_id for layer in layers}) == len(layers) == 2000
            assert all(am.MoeLayer.lookup(layer.layer_id) is layer for layer in layers)
        finally:
            for layer in layers:
                layer.close()


def test_inputs_that_require_grad_never_lose_their_gradient_silently():
    """The ops have no gradient. Through the Python API, an input that
    requires grad (grad mode on) gives a result that autograd links to it and
    whose backward fails naming it, as the torch custom ops do, instead of a
    result cut off from its inputs; `out=` is refused, as torch refuses
    `out=` there. Under no_grad nothing changes."""
    idx = torch.tensor([2, 0, 3, 1], dtype=torch.int32)
    with am.Comm.cpu(f"torch-grad-{uuid.uuid4().hex[:8]}", 1, 0) as c:
        calls = [
            ("x", lambda x, **kw: am.all_reduce(x, c, **kw)),
            # broadcast's result was a clone of `x` whose backward passed the
            # gradient through, as if every rank's result were its own `x`.
            ("x", lambda x, **kw: am.broadcast(x, c, **kw)),
            ("permuted", lambda x, **kw: am.moe_token_unpermute(x, idx, **kw)),
            ("expanded_x", lambda x, **kw: am.moe_finalize_routing(x, idx, scales=torch.ones(4, 1), **kw)),
        ]
        for arg, call in calls:
            x = torch.arange(8, dtype=torch.float32).reshape(4, 2).requires_grad_()
            want = call(x.detach())
            y = call(x)
            assert y.requires_grad and torch.equal(y, want), arg
            with pytest.raises(RuntimeError, match=f"no gradient: a backward reached an op whose `{arg}` required grad"):
                (y * 2).sum().backward()
            assert x.grad is None, arg
            with pytest.raises(am.InvalidArgumentError, match=f"`{arg}` requires grad and grad mode is on.*`out`"):
                call(x, out=torch.zeros_like(want))
            with torch.no_grad():
                y = call(x)
                assert not y.requires_grad and torch.equal(y, want), arg
                out = torch.zeros_like(want)
                assert call(x, out=out) is out and torch.equal(out, want), arg


def test_out_tensors_written_in_place_keep_autograd_honest():
    """The library writes a caller's `out` (and `mc2_mask`) through its data
    pointer, where autograd cannot see it. One that requires grad while grad
    mode is on is refused naming it; any other has its version bumped, so a
    backward that saved it before the write fails instead of computing a
    gradient from the values written after."""
    x, idx = torch.arange(8, dtype=torch.float32).reshape(4, 2), torch.tensor([2, 0, 3, 1], dtype=torch.int32)
    with am.Comm.cpu(f"torch-out-{uuid.uuid4().hex[:8]}", 1, 0) as c, am.MoeGroups(c, 1) as groups:
        ctx = am.MoeContext([4], 1, 0, 0, num_actual_tokens=3)
        writes = {
            "out": [
                lambda out: am.moe_token_unpermute(x, idx, out=out),
                lambda out: am.all_reduce(x, c, out=out),
                lambda out: am.broadcast(x, c, out=out),
                lambda out: am.broadcast(out, c, out=out),
                lambda out: am.token_prepare(x, "allgather", ctx, groups, out=out),
                lambda out: am.ReducePolicy("none", False, False, 1, 1).reduce_final(x, "mc2", c, out=out),
            ],
            "mc2_mask": [lambda m: am.token_prepare(x, "mc2", ctx, groups, mc2_mask=m)],
        }
        like = {"out": lambda: torch.zeros(4, 2), "mc2_mask": lambda: torch.zeros(4, dtype=torch.float32)}
        for arg, fns in writes.items():
            for i, write in enumerate(fns):
                # A leaf and a non-leaf that require grad.
                leaf = like[arg]().requires_grad_()
                for target in (leaf, leaf * 1):
                    with pytest.raises(am.InvalidArgumentError, match=f"`{arg}` requires grad and grad mode is on"):
                        write(target)
                assert leaf.grad is None and not leaf.detach().any(), f"{arg} {i}: written although refused"
                # Saved for backward by `w * out`, then written by the op.
                out = like[arg]() if arg == "out" else torch.zeros(4, dtype=torch.bool)
                w = torch.ones(out.shape, requires_grad=True)
                y = w * out
                before = out._version
                write(out)
                assert out._version > before, f"{arg} {i}: version {out._version}"
                with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                    y.sum().backward()
        # Under no_grad a tensor that requires grad may take the result, as
        # torch's own in-place ops allow (an optimizer step).
        leaf = torch.zeros(4, 2, requires_grad=True)
        with torch.no_grad():
            am.moe_token_unpermute(x, idx, out=leaf)
        assert torch.equal(leaf.detach(), x[[2, 0, 3, 1]])


def _refused_alike(name, op, dtype) -> str:
    """`op` of a `[4, 2]` tensor of `dtype` raises a DTypeError on a real,
    a meta and a fake tensor alike; its text."""
    with pytest.raises(am.DTypeError) as real:
        op(torch.zeros(4, 2, dtype=dtype))
    with pytest.raises(am.DTypeError) as meta:
        op(torch.zeros(4, 2, dtype=dtype, device="meta"))
    with FakeTensorMode():
        with pytest.raises(am.DTypeError) as fake:
            op(torch.zeros(4, 2, dtype=dtype))
    assert str(meta.value) == str(fake.value) == str(real.value), (name, dtype)
    return str(real.value)


def test_fakes_of_the_collectives_refuse_the_dtypes_the_real_ops_refuse():
    """A dtype the library does not know fails at trace time (FakeTensorMode
    and meta tensors) with the error the real op raises, instead of tracing a
    graph that fails when it runs."""
    with am.Comm.cpu(f"torch-fake-dtype-{uuid.uuid4().hex[:8]}", 1, 0) as c:
        h = c.handle_id
        ops = {
            "all_reduce": lambda t: OPS.all_reduce(t, h),
            "reduce_scatter": lambda t: OPS.reduce_scatter(t, h),
            "all_gather": lambda t: OPS.all_gather(t, h),
            "reduce_routed_early": lambda t: OPS.reduce_routed_early(t, 0, h, 0, False, False, 1, 1),
            "reduce_final": lambda t: OPS.reduce_final(t, 0, h, 0, False, False, 1, 1),
        }
        for dtype in (torch.float64, torch.int16, torch.complex64):
            for name, op in ops.items():
                text = _refused_alike(name, op, dtype)
                assert "`x`" in text, text
            # and a dtype it knows still traces
            with FakeTensorMode():
                assert OPS.all_gather(torch.zeros(4, 2, dtype=torch.float32), h).shape == (4, 2)


def test_fakes_of_the_reductions_refuse_the_dtypes_that_are_only_moved():
    """int8, uint8, bool and fp8 are moved as bytes, never summed: the fakes of
    all_reduce, reduce_scatter and maybe_pad_and_reduce refuse them at trace
    time with the error the real op raises, and all_gather traces them."""
    with am.Comm.cpu(f"torch-fake-moved-{uuid.uuid4().hex[:8]}", 1, 0) as c:
        h = c.handle_id
        ops = {
            "all_reduce": lambda t: OPS.all_reduce(t, h),
            "reduce_scatter": lambda t: OPS.reduce_scatter(t, h),
            "maybe_pad_and_reduce": lambda t: OPS.maybe_pad_and_reduce(t, h, [4]),
        }
        for dtype, name in ((torch.int8, "i8"), (torch.uint8, "u8"), (torch.bool, "bool"), (torch.float8_e4m3fn, "f8e4m3")):
            texts = {}
            for op_name, op in ops.items():
                texts[op_name] = _refused_alike(op_name, op, dtype)
            # maybe_pad_and_reduce's text is the library's, named by the
            # export that refused it; the plain collectives' fakes say the
            # same of their `src`.
            lib = texts["maybe_pad_and_reduce"]
            export = "amoe_maybe_pad_and_reduce_output_shape: "
            assert lib.startswith(f"{export}maybe_pad_and_reduce: `x` has dtype {name}, expected a reducible dtype"), lib
            for op_name in ("all_reduce", "reduce_scatter"):
                want = lib[len(export) :].replace("maybe_pad_and_reduce: `x`", f"{op_name}: `src`", 1)
                assert texts[op_name] == want, texts
            with FakeTensorMode():
                assert OPS.all_gather(torch.zeros(4, 2, dtype=dtype), h).shape == (4, 2)


def test_fakes_refuse_an_unknown_reduce_op_as_the_real_ops_do():
    """`op` of all_reduce / reduce_scatter is 0 sum, 1 max or 2 min; the real
    ops refuse any other number, so their fakes (meta tensors, FakeTensorMode,
    tracing) refuse it too, naming `op` and the value, instead of tracing a
    graph that fails when it runs. The three known ops still trace."""
    with am.Comm.cpu(f"torch-fake-op-{uuid.uuid4().hex[:8]}", 1, 0) as c:
        h = c.handle_id
        for op in (OPS.all_reduce, OPS.reduce_scatter):
            for bad in (3, 99, -1):
                with pytest.raises(am.InvalidArgumentError, match=f"`op`.*{bad}|{bad}.*`op`"):
                    op(torch.ones(4, 2), h, bad)
                with pytest.raises(am.InvalidArgumentError, match=f"`op`.*{bad}|{bad}.*`op`"):
                    op(torch.ones(4, 2, device="meta"), h, bad)
                with FakeTensorMode():
                    with pytest.raises(am.InvalidArgumentError, match=f"`op`.*{bad}|{bad}.*`op`"):
                        op(torch.ones(4, 2), h, bad)
            for good in (0, 1, 2):
                assert op(torch.ones(4, 2, device="meta"), h, good).shape == (4, 2)


def test_fakes_of_the_reduction_points_refuse_an_unknown_comm_type():
    """The comm type is a run-time argument, but a number that names no comm
    type (SPEC section 5: 0..3) is refused by the real reduction points; their
    fakes refuse the same plain ints, naming the value, so a meta call or a
    trace never succeeds where the op cannot."""
    with am.Comm.cpu(f"torch-fake-ct-{uuid.uuid4().hex[:8]}", 1, 0) as c:
        h = c.handle_id
        for name in ("reduce_routed_early", "reduce_shared", "reduce_final"):
            op = getattr(OPS, name)
            for bad in (4, 9, -1):
                for dev in ("cpu", "meta"):
                    with pytest.raises(am.InvalidArgumentError, match=f"comm.type.*{bad}|{bad}.*comm.type"):
                        op(torch.ones(4, 2, device=dev), bad, h, 0, False, False, 1, 1)
                with FakeTensorMode():
                    with pytest.raises(am.InvalidArgumentError, match=f"comm.type.*{bad}|{bad}.*comm.type"):
                        op(torch.ones(4, 2), bad, h, 0, False, False, 1, 1)
            for ct in am.CommType:
                assert op(torch.ones(4, 2, device="meta"), int(ct), h, 0, False, False, 1, 1).shape == (4, 2)


def test_meta_operands_beside_real_ones_are_refused_not_given_an_empty_result():
    """A meta tensor has no data. Mixed with CPU tensors, torch dispatches the
    call to the Meta kernel (the fake), which must not hand back an
    uninitialised CPU tensor as if the op had run: the call is refused with
    a DeviceError naming the meta operand, whichever operand it is."""
    ex = torch.arange(8, dtype=torch.float32).reshape(4, 2)
    idx = torch.tensor([2, 0, 3, 1], dtype=torch.int32)
    x1 = torch.ones(4, 2)
    calls = {
        "expanded_row_idx": lambda m: OPS.moe_finalize_routing(ex, m(idx)),
        "expanded_x": lambda m: OPS.moe_finalize_routing(m(ex), idx),
        "x1": lambda m: OPS.moe_finalize_routing(ex, idx, m(x1)),
        "scales": lambda m: OPS.moe_finalize_routing(ex, idx, None, None, None, m(torch.ones(4, 1))),
        "sorted_indices": lambda m: OPS.moe_token_unpermute(ex, m(idx)),
        "permuted": lambda m: OPS.moe_token_unpermute(m(ex), idx),
        "probs": lambda m: OPS.moe_token_unpermute(ex, idx, m(torch.ones(4, 1))),
    }
    for arg, call in calls.items():
        with pytest.raises(am.DeviceError, match=f"`{arg}` is a meta tensor"):
            call(lambda t: t.to("meta"))
        # All on the CPU, or all meta, the calls run as before.
        assert call(lambda t: t).device.type == "cpu"
    meta = lambda t: t.to("meta")  # noqa: E731
    assert OPS.moe_finalize_routing(meta(ex), meta(idx), meta(x1)).device.type == "meta"
    assert OPS.moe_token_unpermute(meta(ex), meta(idx), meta(torch.ones(4, 1))).device.type == "meta"


def test_vllm_reduce_point_refuses_an_unknown_point_or_layer_as_its_fake_does(monkeypatch):
    """`torch.ops.ascend_moe.vllm_reduce_point(x, point, layer)` takes point
    0..2 and a layer id the adapter registered. Its fake refuses anything else;
    the real op refuses the same with the same InvalidArgumentError, instead
    of a KeyError for an unknown layer or running point 2 for point -1 (a
    Python negative index)."""
    from ascend_moe import vllm_ascend

    vllm_ascend._register_point_op()
    layer = max(vllm_ascend._POLICIES, default=0) + 1000
    monkeypatch.setitem(vllm_ascend._POLICIES, layer, (am.ReducePolicy("none", False, False, 1, 1), None))
    x = torch.ones(4, 2)
    for point, lid in ((-1, layer), (3, layer), (0, layer + 1), (-3, layer)):
        texts = []
        for dev in ("cpu", "meta"):
            with pytest.raises(am.InvalidArgumentError) as e:
                OPS.vllm_reduce_point(x.to(dev), point, lid)
            texts.append(str(e.value))
        assert texts[0] == texts[1] and f"no point {point} of layer {lid}" in texts[0], texts


class _BypassGroup:
    """vLLM's GroupCoordinator as one rank sees it, every other rank holding
    the same tensor, with vLLM's bypass: on a group of one rank `all_gather`,
    `reduce_scatter` and `all_reduce` return their input itself."""

    def __init__(self, world_size, name):
        self.world_size, self.rank_in_group, self.unique_name = world_size, 0, name

    def all_gather(self, x, dim=0):
        return x if self.world_size == 1 else torch.cat([x] * self.world_size, dim=dim)

    def reduce_scatter(self, x, dim=0):
        n = self.world_size
        return x if n == 1 else (x * n).tensor_split(n, dim=0)[0].clone()

    def all_reduce(self, x):
        return x if self.world_size == 1 else x * self.world_size


@pytest.fixture
def vllm_engine(monkeypatch):
    """The adapter installed over stand-in vLLM-Ascend modules whose groups
    are `_BypassGroup`s taken through their own collectives."""
    import vllm_standins

    groups = (_BypassGroup(1, "ep"), _BypassGroup(1, "dp"), _BypassGroup(1, "tp"))
    with vllm_standins.adapter_over_modules(monkeypatch, *groups) as st:
        yield st


def _shares_memory(a, b) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_vllm_ops_never_hand_back_their_input_on_a_group_of_one(vllm_engine, monkeypatch, dtype):
    """The adapter's ops are declared functional (no alias annotation): their
    output never shares memory with their input. On a group of one rank
    vLLM's collectives return their input itself; the gather of one rank is
    the input, the reduce-scatter and the TP all-reduce of one rank are the
    input, so the ops return a copy of it (a new tensor), and opcheck's
    schema check (which flags an undeclared alias) passes."""
    import ascend_moe.vllm_ascend as av

    av._register_point_op()
    lid = max(av._POLICIES, default=0) + 1000
    # data_parallel_only: point 1 all-reduces over TP under ALLGATHER without SP (SPEC section 5).
    monkeypatch.setitem(av._POLICIES, lid, (am.ReducePolicy("data_parallel_only", False, False, 1, 1), None))
    vllm_engine.extra.moe_comm_type = int(am.CommType.ALLGATHER)
    x = torch.arange(12, dtype=dtype).reshape(3, 4)
    want = x.clone()
    calls = {
        "gather": (torch.ops.vllm.maybe_all_gather_and_maybe_unpad.default, (x,)),
        "reduce": (torch.ops.vllm.maybe_pad_and_reduce.default, (x,)),
        "point": (OPS.vllm_reduce_point.default, (x, 0, lid)),
    }
    for what, (op, args) in calls.items():
        got = op(*args)
        assert torch.equal(got, want), what
        assert not _shares_memory(got, x), f"{what}: the output is the input's memory"
        torch.library.opcheck(op, args)


@pytest.mark.parametrize("ct", [am.CommType.ALLGATHER, am.CommType.MC2], ids=lambda c: c.name)
def test_vllm_reduce_point_gives_the_contiguous_output_its_fake_gives(vllm_engine, monkeypatch, ct):
    """A non-contiguous input (a transposed view) through the group path of
    `vllm_reduce_point`: the fake's output is contiguous (`new_empty`), so the
    real one is too, whether the point reduces or copies. Policy
    tensor_parallel, no transform, no SP, TP 2 (SPEC section 5): point 1
    never reduces (not early); point 2 reduces iff routed_is_reduced (MC2);
    point 3 iff not (ALLGATHER). The stand-in TP group of 2 holds the same
    tensor on both ranks, so a reduction doubles it."""
    import ascend_moe.vllm_ascend as av

    vllm_engine.tp = _BypassGroup(2, "tp")
    vllm_engine.extra.moe_comm_type = int(ct)
    av._register_point_op()
    lid = max(av._POLICIES, default=0) + 1000
    monkeypatch.setitem(av._POLICIES, lid, (am.ReducePolicy("tensor_parallel", False, False, 2, 2), None))
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    x = base.t()
    reduces = {0: False, 1: ct == am.CommType.MC2, 2: ct == am.CommType.ALLGATHER}
    for point, reduced in reduces.items():
        got = OPS.vllm_reduce_point(x, point, lid)
        with FakeTensorMode() as fm:
            fake = OPS.vllm_reduce_point(fm.from_tensor(x), point, lid)
        assert got.is_contiguous() and got.stride() == fake.stride() == (3, 1), (point, got.stride())
        assert torch.equal(got, base.t() * (2 if reduced else 1)), point
        torch.library.opcheck(OPS.vllm_reduce_point.default, (x, point, lid))


class _Runner:
    """vLLM-Ascend's AscendMoERunner as the adapter reads it: TP-sharded
    shared experts, no routed transform, no SP, TP 2 (the TP group given)."""

    def __init__(self, tp_group):
        from types import SimpleNamespace

        from ascend_moe.vllm_ascend import SharedExpertParallelMode

        self.moe_config = SimpleNamespace(tp_group=tp_group, ep_size=2, is_sequence_parallel=False)
        self.ascend_shared_experts = object()
        self.routed_output_transform = None
        self._mode = SharedExpertParallelMode.TENSOR_PARALLEL

    def _get_shared_expert_parallel_mode(self):
        return self._mode


def test_runner_reduction_points_compile_in_one_graph_on_the_first_forward(vllm_engine, monkeypatch):
    """The adapter's runner methods, compiled with `fullgraph=True` on the
    engine's first forward after `install()` (nothing ran eagerly before):
    no graph break, and one graph takes the live comm type. Policy
    tensor_parallel, TP 2 (SPEC section 5): under ALLGATHER the shared output
    is folded into the final all-reduce, `2 (S + R)`; under MC2 / ALLTOALL it
    is reduced alone and the routed output is complete, `2 S + R`. The
    stand-in TP group holds the same tensor on both ranks."""
    import ascend_moe.vllm_ascend as av

    monkeypatch.setattr(av, "_CONSTANT_LAYER", None)  # a process whose first forward is traced
    av._register_point_op()  # what install() runs
    vllm_engine.tp = _BypassGroup(2, "tp")
    runner = _Runner(vllm_engine.tp)

    def forward(routed, shared):
        s = av._maybe_reduce_shared_expert_output(runner, shared, False)
        r, _ = av._routed_before_transform(runner, routed, False)
        return av._maybe_reduce_final_output(runner, s + r, None)

    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(forward, backend=backend, fullgraph=True, dynamic=True)
    routed, shared = torch.full((4, 3), 1.0), torch.full((4, 3), 10.0)
    for ct in (am.CommType.ALLGATHER, am.CommType.MC2, am.CommType.ALLTOALL, am.CommType.ALLGATHER):
        vllm_engine.extra.moe_comm_type = int(ct)
        want = 2 * (shared + routed) if ct == am.CommType.ALLGATHER else 2 * shared + routed
        assert torch.equal(compiled(routed, shared), want), ct.name
    assert len(graphs) == 1, len(graphs)


def test_out_tensors_made_in_inference_mode_are_written_only_in_inference_mode():
    """torch refuses an in-place update of an inference tensor outside
    `torch.inference_mode()` (it has no version counter). The library writes
    a caller's `out` / `mc2_mask` through its data pointer, where torch
    cannot check it, so the ops refuse such a tensor themselves, naming it,
    before anything is written; inside inference mode it takes the result."""
    x, idx = torch.arange(8, dtype=torch.float32).reshape(4, 2), torch.tensor([2, 0, 3, 1], dtype=torch.int32)
    with am.Comm.cpu(f"torch-inf-{uuid.uuid4().hex[:8]}", 1, 0) as c, am.MoeGroups(c, 1) as groups:
        ctx = am.MoeContext([4], 1, 0, 0, num_actual_tokens=3)
        writes = {
            "out": [
                (lambda out: am.moe_token_unpermute(x, idx, out=out), x[idx.long()]),
                (lambda out: am.all_reduce(x, c, out=out), x),  # one rank: the sum is x
                (lambda out: am.broadcast(x, c, out=out), x),
                (lambda out: am.ReducePolicy("none", False, False, 1, 1).reduce_final(x, "mc2", c, out=out), x),
            ],
            # MC2 mask: the first num_actual_tokens rows are real.
            "mc2_mask": [(lambda m: am.token_prepare(x, "mc2", ctx, groups, mc2_mask=m), torch.tensor([True, True, True, False]))],
        }
        for arg, fns in writes.items():
            for i, (write, want) in enumerate(fns):
                with torch.inference_mode():
                    target = torch.zeros(want.shape, dtype=want.dtype)
                with pytest.raises(am.InvalidArgumentError, match=f"`{arg}` is an inference tensor"):
                    write(target)
                assert not target.any(), f"{arg} {i}: written although refused"
                with torch.inference_mode():
                    target = torch.zeros(want.shape, dtype=want.dtype)
                    write(target)
                    assert torch.equal(target, want), f"{arg} {i}"


def test_vllm_ops_keep_the_hidden_dims_dynamic(vllm_engine, monkeypatch):
    """The adapter's ops under `torch.compile(fullgraph=True)` with dims 0 and
    1 of the input marked dynamic, as the ascend_moe ops allow: a fake that
    made the hidden size a constant fails to compile
    (ConstraintViolationError). One graph serves [4, 3] and [6, 5]. EP and TP
    groups of 2 whose ranks hold the same tensor: the gather is `[x; x]`, the
    reduce-scatter rank 0's half of `2 x`, and point 3 of a tensor_parallel
    TP 2 policy under ALLGATHER the all-reduce `2 x` (SPEC sections 3-5)."""
    import ascend_moe.vllm_ascend as av

    vllm_engine.ep, vllm_engine.tp = _BypassGroup(2, "ep"), _BypassGroup(2, "tp")
    vllm_engine.extra.moe_comm_type = int(am.CommType.ALLGATHER)
    av._register_point_op()
    lid = max(av._POLICIES, default=0) + 1000
    monkeypatch.setitem(av._POLICIES, lid, (am.ReducePolicy("tensor_parallel", False, False, 2, 2), None))
    cases = {
        "gather": (lambda x: torch.ops.vllm.maybe_all_gather_and_maybe_unpad(x), lambda x: torch.cat([x, x])),
        "reduce": (lambda x: torch.ops.vllm.maybe_pad_and_reduce(x), lambda x: (2 * x)[: x.shape[0] // 2]),
        "point": (lambda x: OPS.vllm_reduce_point(x, 2, lid), lambda x: 2 * x),
    }
    for what, (op, golden) in cases.items():
        torch._dynamo.reset()
        graphs = []

        def backend(gm, example_inputs):
            graphs.append(gm)
            return gm.forward

        compiled = torch.compile(lambda x: op(x) + 1, backend=backend, fullgraph=True)
        for rows, hidden in ((4, 3), (6, 5)):
            x = torch.arange(rows * hidden, dtype=torch.float32).reshape(rows, hidden)
            torch._dynamo.mark_dynamic(x, 0)
            torch._dynamo.mark_dynamic(x, 1)
            assert torch.equal(compiled(x), golden(x) + 1), (what, rows, hidden)
        assert len(graphs) == 1, (what, len(graphs))


def test_outputs_are_fresh_tensors_not_views_whatever_their_size():
    """An op's output is a fresh tensor (`._base` None), as `torch.empty`
    gives: small ones, large ones over the library's host pool (>= 1 MiB),
    bfloat16 ones the experts of `moe_layer_fc` return as numpy, and the
    Python API's result for an input that requires grad. Autograd refuses an
    in-place update of a view made inside a custom Function, so a view there
    made `y.add_(1)` fail for some sizes and dtypes only. The update gives
    `x + 1` (one rank: the sum is x), and a backward still fails naming the op."""
    with am.Comm.cpu(f"torch-fresh-{uuid.uuid4().hex[:8]}", 1, 0) as c, am.MoeGroups(c, 1) as groups:
        layer = am.MoeLayer(groups, c, 1, 0, 0, lambda h, mask, ct: h, am.ReducePolicy("none", False, False, 1, 1))
        try:
            calls = {
                "small": (lambda x: OPS.all_reduce(x, c.handle_id), torch.float32, (4, 3)),
                "pooled": (lambda x: OPS.all_reduce(x, c.handle_id), torch.float32, (4096, 64)),  # 1 MiB
                "pooled bf16": (lambda x: OPS.all_gather(x, c.handle_id), torch.bfloat16, (8192, 64)),
                "experts bf16": (lambda x: OPS.moe_layer_fc(x, layer.layer_id), torch.bfloat16, (4, 3)),
                "api": (lambda x: am.all_reduce(x, c), torch.float32, (4, 3)),
                "api pooled": (lambda x: am.all_reduce(x, c), torch.float32, (4096, 64)),
            }
            with am.forward_context(am.CommType.ALLTOALL, [4]):
                for what, (op, dtype, shape) in calls.items():
                    base = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape).remainder(7).to(dtype)
                    y = op(base)
                    assert y._base is None and torch.equal(y, base), what
                    x = base.clone().requires_grad_()
                    y = op(x)
                    assert y._base is None and y.requires_grad, what
                    y.add_(1)
                    assert torch.equal(y.detach(), base + 1), what
                    with pytest.raises(RuntimeError, match="no gradient"):
                        y.sum().backward()
        finally:
            layer.close()


def test_real_kernels_hand_the_library_contiguous_tensors(monkeypatch):
    """The fakes take inputs of any strides, as torch ops do, so a graph
    traced on a slice or a transpose calls the real kernel with it. The
    library takes C-contiguous memory: the Python API copies a non-contiguous
    CPU input itself but refuses a non-contiguous NPU tensor, so the real
    kernels (CPU and PrivateUse1 alike) make their tensor operands contiguous
    before they reach the Python API. Recorded here at the Python API, with
    the results checked against torch's own indexing (one rank: a collective
    is the identity)."""
    from ascend_moe import comm as amcomm
    from ascend_moe import ops as amops

    seen = []

    def recording(fn):
        def call(*args, **kwargs):
            seen.extend(a.is_contiguous() for a in args if isinstance(a, torch.Tensor))
            return fn(*args, **kwargs)

        return call

    monkeypatch.setattr(amops, "moe_token_unpermute", recording(amops.moe_token_unpermute))
    monkeypatch.setattr(amops, "moe_finalize_routing", recording(amops.moe_finalize_routing))
    monkeypatch.setattr(amcomm, "all_gather", recording(amcomm.all_gather))
    x = torch.arange(24, dtype=torch.float32).reshape(4, 6)[:, ::2]  # [4, 3], strides (6, 2)
    idx = torch.tensor([3, 1, 0, 2], dtype=torch.int32)
    scales = torch.ones(2, 4)[0].reshape(4, 1).expand(4, 1)
    probs = torch.ones(4, 2)[:, :1]  # [4, 1], strides (2, 1)
    with am.Comm.cpu(f"torch-dense-{uuid.uuid4().hex[:8]}", 1, 0) as c:
        results = [
            (OPS.moe_token_unpermute(x, idx, probs), x[idx.long()]),
            (OPS.moe_finalize_routing(x.t().contiguous().t(), idx, x, None, None, scales, None, 2), x[idx.long()] + x),
            (OPS.all_gather(x.t(), c.handle_id), x.t()),
        ]
    for i, (got, want) in enumerate(results):
        assert torch.equal(got, want), i
    assert len(seen) >= 7 and all(seen), seen


def test_vllm_pad_and_reduce_output_takes_an_in_place_update(vllm_engine):
    """`torch.ops.vllm.maybe_pad_and_reduce` with an SP layout over the
    group's own collectives keeps the first `local_sizes[rank]` rows of the
    reduce-scatter: a fresh tensor, not a view of the scattered block, so an
    input that requires grad still leaves an output the caller may update in
    place (autograd refuses that for a view made inside a custom Function).
    EP 2, layout [3, 1], both ranks holding x (SPEC section 3): rank 0 gets
    `2 x[:3]`."""
    from test_vllm_diff import DPMetadata

    vllm_engine.ep = _BypassGroup(2, "ep")
    vllm_engine.ctx.dp_metadata = DPMetadata([4], [3, 1])
    x = torch.arange(8, dtype=torch.float32).reshape(4, 2).requires_grad_()
    y = torch.ops.vllm.maybe_pad_and_reduce(x)
    assert y._base is None and y.requires_grad
    y.add_(1)
    assert torch.equal(y.detach(), 2 * x.detach()[:3] + 1)
    with pytest.raises(RuntimeError, match="no gradient"):
        y.sum().backward()


def test_a_fake_pass_or_a_compile_never_runs_a_collective_on_constant_inputs(monkeypatch):
    # FakeTensorMode runs the real kernel of an untagged op whose tensor
    # inputs are constants it made (`torch.tensor` inside the mode): a shape
    # probe would run the collective on this rank alone.
    import ascend_moe.comm as comm_mod
    import ascend_moe.ops as ops_mod

    calls = []

    def counted(mod, name):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, **k: (calls.append(name), real(*a, **k))[1])

    counted(comm_mod, "all_reduce")
    counted(ops_mod, "maybe_pad_and_reduce")
    with am.Comm.cpu(f"torch-const-{uuid.uuid4().hex[:8]}", 1, 0) as c:
        with FakeTensorMode():
            r = OPS.all_reduce(torch.tensor([2.0]), c.handle_id)
            p = OPS.maybe_pad_and_reduce(torch.tensor([[1.0, 2.0]]), c.handle_id, [1])
        assert (tuple(r.shape), tuple(p.shape)) == ((1,), (1, 2))
        assert calls == [], "a fake pass ran a collective"

        def f(x):
            return x + OPS.all_reduce(torch.tensor([2.0]), c.handle_id)

        out = torch.compile(f, backend="aot_eager", fullgraph=True)(torch.zeros(1))
        assert out.tolist() == [2.0]
        assert calls == ["all_reduce"], "one compiled call runs its collective once, at run time"
    # Every op that joins a collective carries the tag, and `_no_gradient`,
    # whose real kernel raises when a backward runs; the local ones do not.
    local = {"moe_finalize_routing", "moe_token_unpermute"}
    for name in dir(OPS):
        packet = getattr(OPS, name)
        if not isinstance(packet, torch._ops.OpOverloadPacket):
            continue
        tagged = torch.Tag.nondeterministic_seeded in packet.default.tags
        assert tagged == (name not in local), name


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_a_compiled_graph_keeps_every_collective_call_used_or_not(monkeypatch, dynamic):
    """A collective runs wherever the program calls it: a compiled graph
    keeps a call whose result is unused, and two identical calls stay two,
    in order. AOTAutograd's dead-code elimination removed the unused
    all_gather (the tag alone did not keep it), and this rank then met its
    peers' all_gather with its all_reduce."""
    import ascend_moe.comm as comm_mod

    calls = []
    for name in ("all_reduce", "all_gather"):
        real = getattr(comm_mod, name)
        monkeypatch.setattr(comm_mod, name, lambda *a, _n=name, _r=real, **k: (calls.append(_n), _r(*a, **k))[1])
    with am.Comm.cpu(f"torch-dce-{uuid.uuid4().hex[:8]}", 1, 0) as c:
        h = c.handle_id

        def f(x):
            a = OPS.all_reduce(x, h)
            OPS.all_gather(x, h)  # unused
            b = OPS.all_reduce(x, h)  # the same call again
            return a + b

        x = torch.randn(4, 3)
        g = torch.compile(f, backend="aot_eager", fullgraph=True, dynamic=dynamic)
        g(x)
        calls.clear()
        out = g(x)
        assert calls == ["all_reduce", "all_gather", "all_reduce"], calls
        assert torch.equal(out, 2 * x)


def test_a_compiled_graph_keeps_the_adapters_collectives_used_or_not(vllm_engine, monkeypatch):
    """The same for the adapter's `torch.ops.vllm` collectives, whose schema
    (vLLM-Ascend's or the adapter's) carries no tag: unused, both were
    removed from an aot_eager graph."""
    import ascend_moe.vllm_ascend as av

    calls = []
    real = av.comm_for_group
    monkeypatch.setattr(av, "comm_for_group", lambda *a, **k: (calls.append(1), real(*a, **k))[1])

    def f(x):
        torch.ops.vllm.maybe_all_gather_and_maybe_unpad(x)  # unused
        torch.ops.vllm.maybe_pad_and_reduce(x)  # unused
        return x + 1

    x = torch.randn(4, 3)
    f(x)
    eager, calls[:] = len(calls), []
    g = torch.compile(f, backend="aot_eager", fullgraph=True)
    g(x)
    calls.clear()
    g(x)
    assert eager > 0 and len(calls) == eager, (eager, calls)


def test_a_reduction_point_fake_refuses_a_tp_group_the_policy_contradicts():
    # The real op refuses a TP group whose size is not the policy's tp_size
    # before it runs: the fake does too, so a misconfigured layer fails its
    # compile, not its first run.
    with am.Comm.cpu(f"torch-tp-{uuid.uuid4().hex[:8]}", 1, 0) as c:
        fields = (0, False, False, 2, 2)  # shared mode, transform, sp, tp_size 2, ep_size 2
        for name in ("reduce_routed_early", "reduce_shared", "reduce_final"):
            op = getattr(OPS, name)
            with pytest.raises(am.InvalidArgumentError, match="has 1 ranks, the policy's tp_size is 2"):
                op(torch.ones(3, 4), 0, c.handle_id, *fields)
            with FakeTensorMode() as mode:
                with pytest.raises(am.InvalidArgumentError, match="has 1 ranks, the policy's tp_size is 2"):
                    op(mode.from_tensor(torch.ones(3, 4)), 0, c.handle_id, *fields)
            ok = (0, False, False, 1, 1)
            with FakeTensorMode() as mode:
                assert tuple(op(mode.from_tensor(torch.ones(3, 4)), 0, c.handle_id, *ok).shape) == (3, 4)


def test_a_large_pooled_cpu_result_is_documented_not_to_grow():
    # A CPU result of 1 MiB or more lies on a block of the host pool, which
    # cannot be resized (the README says so); a smaller one is torch's own.
    idx = torch.arange(4096, dtype=torch.int32)
    small = OPS.moe_finalize_routing(torch.randn(4096, 8), idx)
    big = OPS.moe_finalize_routing(torch.randn(4096, 1024), idx)
    assert small.resize_(8192, 8).shape == (8192, 8)
    grown = big.clone()
    assert grown.resize_(8192, 1024).shape == (8192, 1024)
    with pytest.raises(RuntimeError, match="not resizable"):
        big.resize_(8192, 1024)
    del big  # torch left it claiming 8192 rows over 4096 rows of storage
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert "Trying to resize storage that is not resizable" in readme
