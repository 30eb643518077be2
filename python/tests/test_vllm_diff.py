"""The vLLM-Ascend adapter (`ascend_moe.vllm_ascend`) on the values an engine
hands it, in this process: vLLM-Ascend's module behind the two ops
(`get_forward_context`, `get_ep_group`, `get_dp_group`, `_EXTRA_CTX`) and
its MoE runner module are plain stand-in modules, and the groups are
single-process stand-ins of vLLM's `GroupCoordinator` (so the adapter takes
the groups' own collectives). Expected values come from vLLM-Ascend's code
at 182b75e and SPEC.md, not from the adapter."""

import enum
import math
import sys
import types
from types import SimpleNamespace

import numpy as np
import pytest

import ascend_moe as am

from workers import require, torch_ops_missing  # noqa: E402

require("vLLM-Ascend adapter", torch_ops_missing())

import torch  # noqa: E402

import ascend_moe.vllm_ascend as av  # noqa: E402
import vllm_standins  # noqa: E402


class Group:
    """vLLM's GroupCoordinator as one rank of it sees it, in one process: every
    other rank holds the same tensor as this one."""

    def __init__(self, world_size=1, rank_in_group=0, name="g"):
        self.world_size, self.rank_in_group, self.unique_name = world_size, rank_in_group, name

    def all_gather(self, x, dim=0):
        return torch.cat([x] * int(self.world_size), dim=dim)

    def reduce_scatter(self, x, dim=0):
        n = int(self.world_size)
        return (x * n).tensor_split(n, dim=0)[int(self.rank_in_group)].clone()

    def all_reduce(self, x):
        return x * int(self.world_size)


class DPMetadata:
    def __init__(self, tokens, local_sizes=None):
        self.num_tokens_across_dp_cpu = tokens if isinstance(tokens, torch.Tensor) else torch.tensor(tokens)
        self.local_sizes = local_sizes

    def get_chunk_sizes_across_dp_rank(self):
        assert self.local_sizes is not None
        return self.local_sizes


@pytest.fixture
def engine(monkeypatch):
    """The engine's state the adapter reads (`.ctx`, `.extra`, `.ep`, `.dp`,
    `.tp`), with the adapter installed over stand-in modules."""
    groups = (Group(1, 0, "ep"), Group(1, 0, "dp"), Group(1, 0, "tp"))
    with vllm_standins.adapter_over_modules(monkeypatch, *groups) as st:
        yield st


# --------------------------------------------------------- engine integers

NOT_INTEGERS = [2.7, 2.0, True, False, "2", np.float64(2.0), np.bool_(True), torch.tensor(2.0), torch.tensor(True), None]


def test_engine_int_takes_integers_by_index():
    for v, want in ((3, 3), (np.int64(3), 3), (np.int32(0), 0), (torch.tensor(3), 3), (torch.tensor(5, dtype=torch.int32), 5)):
        got = av.engine_int("world_size", v)
        assert got == want and type(got) is int, (v, got)


@pytest.mark.parametrize("v", NOT_INTEGERS, ids=repr)
def test_engine_int_refuses_what_is_no_integer(v):
    with pytest.raises(am.InvalidArgumentError) as e:
        av.engine_int("padded_length", v)
    assert "padded_length" in str(e.value) and repr(v) in str(e.value)


def test_engine_int_refuses_a_device_tensor_without_reading_it():
    class NpuScalar:
        # A one-element NPU tensor: `operator.index` would read it to the host.
        device = types.SimpleNamespace(type="npu", index=0)
        dtype = "torch.int64"

        def __index__(self):
            raise AssertionError("a device tensor was read on the host")

        def __str__(self):
            return "npu:0"

    with pytest.raises(am.InvalidArgumentError) as e:
        av.engine_int("world_size", NpuScalar())
    assert "world_size is a tensor on" in str(e.value) and "synchronise" in str(e.value), e.value


def test_float_padded_length_is_refused_not_truncated(engine):
    # DP2 TP1 (EP 2) without an SP layout: the padded_length path. 5.7 was
    # taken as 5, which fits the batch, so the gather ran on a wrong value.
    engine.ep, engine.dp = Group(2, 0, "ep"), Group(2, 0, "dp")
    engine.ctx.dp_metadata = DPMetadata([3, 5])
    engine.extra.padded_length = 5.7
    with pytest.raises(am.InvalidArgumentError, match=r"padded_length.*5\.7"):
        torch.ops.vllm.maybe_all_gather_and_maybe_unpad(torch.ones(5, 2))
    with pytest.raises(am.InvalidArgumentError, match=r"padded_length.*5\.7"):
        torch.ops.vllm.maybe_pad_and_reduce(torch.ones(8, 2))
    # An integer padded_length of any integer type keeps working.
    for padded in (5, np.int64(5), torch.tensor(5)):
        engine.extra.padded_length = padded
        out = torch.ops.vllm.maybe_all_gather_and_maybe_unpad(torch.arange(10.0).view(5, 2))
        assert out.shape == (8, 2), padded  # vLLM-Ascend: num_tokens_across_dp_cpu.sum() rows


@pytest.mark.parametrize("field", ["world_size", "rank_in_group"])
@pytest.mark.parametrize("v", [True, 1.0, 1.5], ids=repr)
def test_group_sizes_and_ranks_must_be_integers(engine, field, v):
    setattr(engine.ep, field, v)
    with pytest.raises(am.InvalidArgumentError, match=f"{field}.*{v!r}"):
        torch.ops.vllm.maybe_pad_and_reduce(torch.ones(4, 2))
    engine.ep = Group(1, 0, "ep")
    setattr(engine.tp, field, v)
    with pytest.raises(am.InvalidArgumentError, match=f"{field}.*{v!r}"):
        av.moe_context(4)


@pytest.mark.parametrize("rank", [2, -1])
def test_ep_ranks_outside_the_group_are_refused_by_both_ops_and_their_fakes(engine, rank):
    # An EP rank indexes the SP layout: rank 2 of 2 raised a bare IndexError,
    # and -1 took the last rank's rows in the real gather (its fake failed
    # otherwise). As the library's shape functions refuse an ep_rank past
    # the group ("2 is not a rank of an EP group of 2"), every path refuses
    # it, naming the field and the world size, real and fake alike.
    engine.dp = Group(2, 0, "dp")
    engine.extra.padded_length = 5
    refused = rf"ep_group\.rank_in_group is {rank}: {rank} is not a rank of an EP group of 2$"
    for ctx, gather_rows, reduce_rows in (
        (DPMetadata([3, 5], local_sizes=[3, 5]), 5, 8),  # SP layout
        (DPMetadata([3, 5]), 5, 8),  # padded_length path
        (None, 4, 8),  # no DP metadata: plain all-gather / reduce-scatter
    ):
        engine.ctx.dp_metadata = ctx
        engine.ep = Group(2, rank, "ep")
        for op, rows in (
            (torch.ops.vllm.maybe_all_gather_and_maybe_unpad, gather_rows),
            (torch.ops.vllm.maybe_pad_and_reduce, reduce_rows),
        ):
            _real_and_fake_refuse(op, torch.ones(rows, 2), refused)


@pytest.mark.parametrize("role", ["ep", "dp", "tp"])
@pytest.mark.parametrize("rank, world, refused", [
    (2, 2, "rank_in_group is 2: 2 is not a rank of {} group of 2$"),
    (-1, 2, "rank_in_group is -1: -1 is not a rank of {} group of 2$"),
    (0, 0, "world_size is 0: a group has at least one rank"),
])
def test_every_group_the_adapter_reads_is_checked_for_its_rank_and_size(engine, role, rank, world, refused):
    # The EP, DP and TP groups' ranks index per-rank tables (the SP layout,
    # num_tokens_across_dp_cpu: DP rank -1 read the last DP rank's count)
    # and their sizes divide: each is refused where it is read, naming it.
    kind = {"ep": "an EP", "dp": "a DP", "tp": "a TP"}[role]
    refused = rf"{role}_group\.{refused.format(kind)}"
    engine.ep, engine.dp, engine.tp = Group(2, 0, "ep"), Group(2, 0, "dp"), Group(1, 0, "tp")
    engine.ctx.dp_metadata = DPMetadata([3, 5])
    engine.extra.padded_length = 5
    setattr(engine, role, Group(world, rank, role))
    if role != "ep":  # moe_context reads the TP and DP groups
        with pytest.raises(am.InvalidArgumentError, match=refused):
            av.moe_context(3)
    if role == "tp":
        with pytest.raises(am.InvalidArgumentError, match=refused):
            av._runner_policy(_point_runner(engine.tp))
        return
    for op, rows in ((torch.ops.vllm.maybe_all_gather_and_maybe_unpad, 5), (torch.ops.vllm.maybe_pad_and_reduce, 8)):
        _real_and_fake_refuse(op, torch.ones(rows, 2), refused)


def test_float_dp_token_counts_are_refused(engine):
    engine.ep, engine.dp = Group(2, 0, "ep"), Group(2, 0, "dp")
    engine.extra.padded_length = 6
    engine.ctx.dp_metadata = DPMetadata(torch.tensor([3.0, 5.0]))
    with pytest.raises(am.InvalidArgumentError, match=r"num_tokens_across_dp_cpu is 3\.0"):
        torch.ops.vllm.maybe_all_gather_and_maybe_unpad(torch.ones(6, 2))
    with pytest.raises(am.InvalidArgumentError, match=r"num_tokens_across_dp_cpu is 3\.0"):
        av.moe_context(3)
    # A bool layout entry is no row count either.
    engine.ctx.dp_metadata = DPMetadata([1, 1], local_sizes=[True, True])
    with pytest.raises(am.InvalidArgumentError, match="get_chunk_sizes_across_dp_rank"):
        torch.ops.vllm.maybe_all_gather_and_maybe_unpad(torch.ones(1, 2))


@pytest.mark.parametrize("tokens, dp_rank, count", [([-2, 6], 0, -2), ([3, -1], 1, -1)])
def test_negative_dp_token_counts_are_refused_not_read_as_zero(engine, tokens, dp_rank, count):
    # DP2 TP1 (EP 2) without an SP layout: the padded_length path, where a
    # DP rank's real rows are the first min(T_d, chunk) of its chunk. A
    # negative T_d is no token count (ascend_moe.ForwardContext: "dp_tokens
    # must be one count >= 0 per DP rank"); it was taken as 0 rows. Refused
    # by the real ops and their fakes alike, and by moe_context, naming the
    # field, the DP rank and the count.
    engine.ep, engine.dp = Group(2, 0, "ep"), Group(2, 0, "dp")
    engine.extra.padded_length = 6
    engine.ctx.dp_metadata = DPMetadata(tokens)
    refused = rf"num_tokens_across_dp_cpu must be one count >= 0 per DP rank.*DP rank {dp_rank} has {count}\b"
    for op, rows in (
        (torch.ops.vllm.maybe_all_gather_and_maybe_unpad, 6),  # padded_length / (EP / DP) rows
        (torch.ops.vllm.maybe_pad_and_reduce, sum(max(t, 0) for t in tokens)),  # the rows a count of 0 gives
    ):
        _real_and_fake_refuse(op, torch.ones(rows, 2), refused)
    with pytest.raises(am.InvalidArgumentError, match=refused):
        av.moe_context(max(tokens[0], 0))


def test_negative_sp_chunk_sizes_are_refused_naming_the_layout(engine):
    # With an SP layout (get_chunk_sizes_across_dp_rank) a negative size is
    # refused by both ops and their fakes as an invalid argument naming it,
    # before any row count is compared with it.
    engine.ep, engine.dp = Group(2, 0, "ep"), Group(2, 0, "dp")
    for sizes, rank in (([-1, 5], 0), ([5, -1], 1)):
        engine.ctx.dp_metadata = DPMetadata([3, 5], local_sizes=sizes)
        refused = rf"get_chunk_sizes_across_dp_rank\(\) must be one count >= 0 per EP rank.*EP rank {rank} has -1"
        for op, rows in ((torch.ops.vllm.maybe_all_gather_and_maybe_unpad, 6), (torch.ops.vllm.maybe_pad_and_reduce, 4)):
            _real_and_fake_refuse(op, torch.ones(rows, 2), refused)


def test_register_without_vllm_ascend_fails_only_when_switched_on(monkeypatch):
    # README: with ASCEND_MOE_VLLM=1 and no importable vLLM-Ascend,
    # register() raises naming the import; without the switch it does nothing.
    av.uninstall()
    monkeypatch.setitem(sys.modules, av.OPS_MODULE, None)  # an import of it fails
    monkeypatch.delenv("ASCEND_MOE_VLLM", raising=False)
    av.register()
    assert av.status()["active"] is False and av.status()["switch"] is None
    monkeypatch.setenv("ASCEND_MOE_VLLM", "1")
    with pytest.raises(am.AmoeError, match=f"importing {av.OPS_MODULE} failed") as e:
        av.register()
    assert e.value.status == am.Status.UNAVAILABLE
    assert av.status()["active"] is False and av.status()["switch"] == "1"


def test_status_says_whether_the_native_kernels_can_launch(engine):
    # Installed over stand-ins on a host without an NPU runtime: no native
    # kernel, and the reason names the AI Core library.
    nk = av.status()["native_kernel"]
    assert nk == am.native_kernel(), nk
    assert nk["available"] is False and "AI Core kernel library is not loaded" in nk["reason"], nk
    assert "amoe_native_kernel_check" in nk["reason"], nk


def test_the_tp_group_is_found_without_vllm_ascends_runner_module(engine, monkeypatch):
    # vLLM-Ascend's runner module not loaded (or without get_tp_group), and
    # its ops module importing no get_tp_group: the TP group is vLLM's. The
    # fallback called the group it had found ("object is not callable").
    engine.tp = Group(2, 1, "tp")
    monkeypatch.delattr(sys.modules[av.RUNNER_MODULE], "get_tp_group")
    monkeypatch.delattr(sys.modules[av.OPS_MODULE], "get_tp_group")
    vd = types.ModuleType("vllm.distributed")
    vd.get_tp_group = lambda: engine.tp
    vllm = types.ModuleType("vllm")
    vllm.distributed = vd
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.distributed", vd)
    ctx = av.moe_context(4)
    assert (ctx.dp_tokens, ctx.tp_size, ctx.tp_rank) == ((4,), 2, 1)
    monkeypatch.delitem(sys.modules, av.RUNNER_MODULE)
    assert av.moe_context(4).tp_size == 2


def test_moe_context_takes_the_dp_ranks_tokens_also_with_sp(engine):
    # With SP a TP rank holds ceil(T_d / TP) rows; moe_context takes T_d,
    # and says so to a caller who passes the shard's rows.
    engine.ep, engine.dp, engine.tp = Group(4, 0, "ep"), Group(2, 0, "dp"), Group(2, 0, "tp")
    engine.ctx.dp_metadata = DPMetadata([5, 3])
    ctx = av.moe_context(5, sp=True)
    assert (ctx.dp_tokens, ctx.sp) == ((5, 3), True)
    with pytest.raises(am.ShapeError, match="with sp, pass the DP rank's 5 tokens, not the 3 rows"):
        av.moe_context(3, sp=True)
    with pytest.raises(am.ShapeError, match="DP rank 0 has 5$"):
        av.moe_context(3)


def test_moe_context_takes_numpy_and_tensor_integers(engine):
    engine.tp = Group(np.int64(2), torch.tensor(1), "tp")
    engine.extra.padded_num_tokens = np.int64(6)
    ctx = av.moe_context(torch.tensor(5), num_actual_tokens=np.int32(4))
    assert (ctx.dp_tokens, ctx.tp_size, ctx.tp_rank, ctx.num_actual_tokens, ctx.padded_num_tokens) == ((5,), 2, 1, 4, 6)
    for field, v in (("num_tokens", 5.0), ("num_actual_tokens", True), ("padded_num_tokens", 6.0)):
        engine.extra.padded_num_tokens = v if field == "padded_num_tokens" else 6
        with pytest.raises(am.InvalidArgumentError, match=field):
            av.moe_context(v if field == "num_tokens" else 5, num_actual_tokens=v if field == "num_actual_tokens" else None)


def test_shared_expert_mode_values_must_be_integers():
    se = av.SharedExpertParallelMode
    assert av.shared_mode_of(np.int64(2)) == av.shared_mode_of(se.SHARED_EXPERT_DATA_PARALLEL_ONLY)
    for v in (True, 2.7, 1.0):
        with pytest.raises(am.InvalidArgumentError, match="shared-expert mode"):
            av.shared_mode_of(v)
    # AscendSharedExperts.parallel_mode() compares the TP size itself: 1.5 > 1,
    # so replicated weights are SHARED_EXPERT_DATA_PARALLEL_ONLY there; int(1.5)
    # made it TENSOR_PARALLEL. A TP size is an integer: refused.
    with pytest.raises(am.InvalidArgumentError, match="tp_size"):
        av.classify_shared_expert_mode(1.5, True, False)
    with pytest.raises(am.InvalidArgumentError, match="tp_size"):
        av.classify_shared_expert_mode(True, True, False)
    assert av.classify_shared_expert_mode(np.int64(2), True, False) is se.SHARED_EXPERT_DATA_PARALLEL_ONLY


class MoECommType(enum.Enum):
    """vLLM-Ascend's (ascend_forward_context.py)."""

    ALLGATHER = 0
    MC2 = 1
    ALLTOALL = 2
    FUSED_MC2 = 3


def test_comm_type_by_member_name_checked_against_value(engine):
    for theirs in MoECommType:
        engine.extra.moe_comm_type = theirs
        assert av._live_comm_type() == int(am.CommType[theirs.name])
    assert av.comm_type_of(np.int64(2)) is am.CommType.ALLTOALL
    # Another numbering or a type ascend-moe does not know is no comm type of
    # ascend-moe's: refused, not read by value (NAIVE_MULTICAST = 3 was FUSED_MC2).
    other = enum.Enum("MoECommType", "ALLGATHER MC2 ALLTOALL FUSED_MC2")  # 1..4
    legacy = enum.Enum("MoECommType", {"ALLGATHER": 0, "MC2": 1, "ALLTOALL": 2, "NAIVE_MULTICAST": 3})
    for ct in (other.ALLGATHER, legacy.NAIVE_MULTICAST, True, 1.0, 7, "mc2"):
        engine.extra.moe_comm_type = ct
        with pytest.raises(am.InvalidArgumentError, match="comm.type"):
            av._live_comm_type()


# ------------------------------------------- a dynamic token dimension


def _compiled_rows(fn, rows_list, cols=2):
    """`fn` compiled with its input's dim 0 marked dynamic (as vLLM marks the
    token dimension), run on inputs of each row count; the output shapes.
    A fake that turned the token count into a constant fails to compile."""
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    return [tuple(compiled(_token_input(rows, cols)).shape) for rows in rows_list]


def _token_input(rows, cols=2):
    """A `[rows, cols]` input with its token dimension (dim 0) marked dynamic."""
    x = torch.arange(rows * cols, dtype=torch.float32).view(rows, cols)
    torch._dynamo.mark_dynamic(x, 0)
    return x


def test_ops_keep_the_token_dimension_dynamic_without_dp_metadata(engine):
    # vLLM-Ascend's fakes: x.shape[0] * ep_group.world_size and
    # x.shape[0] // ep_group.world_size (register_custom_ops.py:120, :134),
    # symbolic in the token count; a graph traced at 6 rows runs at 10.
    engine.ep = Group(2, 0, "ep")
    got = _compiled_rows(lambda x: torch.ops.vllm.maybe_all_gather_and_maybe_unpad(x) + 1, [6, 10])
    assert got == [(12, 2), (20, 2)]
    got = _compiled_rows(lambda x: torch.ops.vllm.maybe_pad_and_reduce(x) + 1, [6, 10])
    assert got == [(3, 2), (5, 2)]


def test_ops_keep_the_token_dimension_dynamic_with_dp_metadata(engine):
    # With an SP layout and with padded_length, vLLM-Ascend's output rows come
    # from the forward context (sum(local_sizes), local_sizes[rank]; the
    # padded path: num_tokens_across_dp_cpu.sum() and padded_length / (EP / DP)),
    # and its fakes never read the input's token count as a constant.
    engine.ep, engine.dp = Group(2, 0, "ep"), Group(2, 0, "dp")
    engine.ctx.dp_metadata = DPMetadata([3, 5], local_sizes=[3, 5])
    assert _compiled_rows(lambda x: torch.ops.vllm.maybe_all_gather_and_maybe_unpad(x) + 1, [3]) == [(8, 2)]
    assert _compiled_rows(lambda x: torch.ops.vllm.maybe_pad_and_reduce(x) + 1, [8]) == [(3, 2)]
    engine.ctx.dp_metadata = DPMetadata([3, 5])
    engine.extra.padded_length = 5
    assert _compiled_rows(lambda x: torch.ops.vllm.maybe_all_gather_and_maybe_unpad(x) + 1, [5]) == [(8, 2)]
    assert _compiled_rows(lambda x: torch.ops.vllm.maybe_pad_and_reduce(x) + 1, [8]) == [(5, 2)]


# Forward contexts a graph compiled once runs under (SPEC section 5: the DP
# token counts are read when the op runs), EP rank 0 of 2, DP 2: two token
# counts, then a layout change at a fixed token count. A case is (DP token
# counts, padded_length, rows in, rows out). padded_length None: the SP
# layout, local_sizes = the counts; the gather takes local_sizes[0] rows and
# gives sum(local_sizes), the reduce the reverse. Else the padded_length
# path: the gather takes padded_length rows (one EP rank per DP rank) and
# gives the counts' sum, the reduce the reverse.
CONTEXTS = {
    ("gather", "sp"): [([3, 3], None, 3, 6), ([5, 5], None, 5, 10), ([3, 5], None, 3, 8), ([3, 7], None, 3, 10)],
    ("reduce", "sp"): [([3, 3], None, 6, 3), ([5, 5], None, 10, 5), ([3, 5], None, 8, 3), ([4, 4], None, 8, 4)],
    ("gather", "padded"): [([3, 3], 3, 3, 6), ([5, 5], 5, 5, 10), ([3, 5], 5, 5, 8), ([4, 5], 5, 5, 9)],
    ("reduce", "padded"): [([3, 3], 3, 6, 3), ([5, 5], 5, 10, 5), ([3, 5], 5, 8, 5), ([4, 4], 4, 8, 4)],
}


def _set_context(engine, tokens, padded_length):
    engine.ctx.dp_metadata = DPMetadata(tokens, local_sizes=tokens if padded_length is None else None)
    engine.extra.padded_length = padded_length


def _op_then_ones(op):
    """The EP op `op` ("gather", "reduce") followed by a tensor the graph
    shapes like its output (ones), so a fake's rows show in the result under
    a backend that does not check real sizes against the fakes'."""
    name = "maybe_all_gather_and_maybe_unpad" if op == "gather" else "maybe_pad_and_reduce"

    def fn(x):
        y = getattr(torch.ops.vllm, name)(x)
        return y * 2 + y.new_ones(y.shape)

    return fn


@pytest.mark.parametrize("backend", ["inductor", "aot_eager"])
@pytest.mark.parametrize("op, path", list(CONTEXTS))
def test_compiled_ops_take_the_rows_of_the_forward_context_they_run_under(engine, backend, op, path):
    # A graph compiled at one forward context with a dynamic token dimension
    # runs under others: the output rows are the live context's, never the
    # trace-time ones. Inductor checks the real outputs' sizes against the
    # fakes'; aot_eager does not, but a tensor the graph shapes like the
    # output (the ones) has the fake's rows there.
    engine.ep, engine.dp = Group(2, 0, "ep"), Group(2, 0, "dp")
    fn = _op_then_ones(op)
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=backend, fullgraph=True)
    for tokens, padded_length, rows, want in CONTEXTS[(op, path)]:
        _set_context(engine, tokens, padded_length)
        x = _token_input(rows)
        got = compiled(x)
        assert got.shape == (want, 2) and torch.equal(got, fn(x)), (tokens, padded_length, rows, got.shape)


# A graph compiled with static shapes (vLLM's compile_sizes specialise one
# per batch size) at one token count: the layout changes under it. Cases as
# CONTEXTS, every one at the same input rows.
STATIC_CONTEXTS = {
    "gather": [([3, 5], None, 3, 8), ([3, 7], None, 3, 10), ([3, 5], 5, 5, 8), ([3, 4], 5, 5, 7)],
    "reduce": [([3, 5], None, 8, 3), ([4, 4], None, 8, 4), ([3, 5], 5, 8, 5), ([4, 4], 5, 8, 5)],
}


@pytest.mark.parametrize("backend", ["inductor", "aot_eager"])
@pytest.mark.parametrize("op", list(STATIC_CONTEXTS))
def test_a_graph_compiled_for_one_token_count_takes_the_rows_of_the_live_layout(engine, backend, op):
    engine.ep, engine.dp = Group(2, 0, "ep"), Group(2, 0, "dp")
    fn = _op_then_ones(op)
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)
    for tokens, padded_length, rows, want in STATIC_CONTEXTS[op]:
        _set_context(engine, tokens, padded_length)
        x = torch.arange(rows * 2, dtype=torch.float32).view(rows, 2)
        got = compiled(x)
        assert got.shape == (want, 2) and torch.equal(got, fn(x)), (tokens, padded_length, got.shape)


@pytest.mark.parametrize("op, rows, want", [("gather", 6, 12), ("reduce", 6, 3)])
def test_without_dp_metadata_a_static_graph_keeps_the_rows_its_input_gives(engine, op, rows, want):
    # No DP metadata: a plain all-gather or reduce-scatter over EP 2, whose
    # rows follow x's (rows * 2, rows / 2), not the forward context: a static
    # compile keeps them concrete, so code that branches on them compiles.
    engine.ep = Group(2, 0, "ep")
    op_fn = _op_then_ones(op)

    def fn(x):
        y = op_fn(x)
        return y + 1 if y.shape[0] > 4 else y - 1

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True, dynamic=False)
    x = torch.arange(rows * 2, dtype=torch.float32).view(rows, 2)
    got = compiled(x)
    assert got.shape == (want, 2) and torch.equal(got, fn(x))


def test_compiled_moe_layer_tokens_take_the_rows_of_the_forward_context(engine):
    # vLLM-Ascend's flow around the experts: gather (prepare), the experts,
    # reduce (finalize) back to this rank's tokens, added to its input. The
    # reduced rows, of the live context, meet the input's symbolic ones.
    engine.ep, engine.dp = Group(2, 0, "ep"), Group(2, 0, "dp")

    def layer(x):
        gathered = torch.ops.vllm.maybe_all_gather_and_maybe_unpad(x)
        return torch.ops.vllm.maybe_pad_and_reduce(gathered * 2 + 1) + x

    torch._dynamo.reset()
    compiled = torch.compile(layer, backend="inductor", fullgraph=True)
    for tokens, padded_length in (([3, 3], None), ([5, 5], None), ([3, 7], None), ([3, 5], 5), ([4, 5], 5)):
        _set_context(engine, tokens, padded_length)
        x = _token_input(tokens[0] if padded_length is None else padded_length)
        got = compiled(x)
        assert got.shape == x.shape and torch.equal(got, layer(x)), (tokens, padded_length)


def test_reduction_point_keeps_the_token_dimension_dynamic(engine):
    # The runner's reductions are TP all-reduces (fused_moe.py:197): the
    # identity shape, whatever the token count.
    engine.tp = Group(2, 0, "tp")
    engine.extra.moe_comm_type = MoECommType.ALLGATHER
    runner = SimpleNamespace(
        moe_config=SimpleNamespace(tp_group=engine.tp, ep_size=2, is_sequence_parallel=False),
        ascend_shared_experts=None,
        routed_output_transform=None,
    )
    pid = av._runner_policy(runner)
    final = 2
    got = _compiled_rows(lambda x: torch.ops.ascend_moe.vllm_reduce_point(x, final, pid) + 1, [6, 10])
    assert got == [(6, 2), (10, 2)]


@pytest.mark.parametrize("dp", [1, 2])
def test_reduction_points_without_expert_parallelism_reduce_as_vllm_ascend_does(engine, dp):
    # vLLM without EP sets moe_config.ep_size 1 and moe_config.tp_size to the
    # flattened DP x TP (FusedMoEParallelConfig.make); vLLM-Ascend takes
    # ALLGATHER there (ascend_forward_context.py:313), and its final point
    # all-reduces the routed partial sum over TP (fused_moe.py:193-199), as
    # the other points leave it unreduced: here every rank holds x, so x * 2.
    engine.tp = Group(2, 0, "tp")
    engine.extra.moe_comm_type = MoECommType.ALLGATHER
    runner = SimpleNamespace(
        moe_config=SimpleNamespace(tp_group=engine.tp, tp_size=2 * dp, ep_size=1, is_sequence_parallel=False),
        ascend_shared_experts=None,
        routed_output_transform=None,
    )
    pid = av._runner_policy(runner)
    x = (torch.arange(12.0) - 3).view(4, 3)
    early, shared, final = 0, 1, 2
    assert torch.equal(torch.ops.ascend_moe.vllm_reduce_point(x, early, pid), x)
    assert torch.equal(torch.ops.ascend_moe.vllm_reduce_point(x, shared, pid), x)
    assert torch.equal(torch.ops.ascend_moe.vllm_reduce_point(x, final, pid), x * 2)


def test_a_runner_configuration_the_library_refuses_raises_its_error_at_every_call(engine):
    # A TP-sharded shared expert with SP on and TP 2 is refused by
    # ReducePolicy (it is SequenceParallelOnly in vLLM-Ascend's terms); the
    # second call must say so again, not fail on a policy id left behind.
    engine.tp = Group(2, 0, "tp")
    runner = SimpleNamespace(
        moe_config=SimpleNamespace(tp_group=engine.tp, ep_size=2, is_sequence_parallel=True),
        ascend_shared_experts=SimpleNamespace(),
        routed_output_transform=None,
        _get_shared_expert_parallel_mode=lambda: av.SharedMode.TENSOR_PARALLEL,
    )
    for _ in range(2):
        with pytest.raises(am.AmoeError, match="SequenceParallelOnly"):
            av._runner_policy(runner)


def test_compiled_ops_check_the_token_count_when_they_run(engine):
    # A dynamic graph takes any count at trace time; the real op refuses the
    # ones its layout cannot hold (SPEC sections 3 and 4), eager or compiled.
    engine.ep, engine.dp = Group(2, 0, "ep"), Group(2, 0, "dp")
    engine.ctx.dp_metadata = DPMetadata([3, 5], local_sizes=[3, 5])
    gather = torch.compile(lambda x: torch.ops.vllm.maybe_all_gather_and_maybe_unpad(x) + 1, backend="aot_eager", fullgraph=True)
    reduce = torch.compile(lambda x: torch.ops.vllm.maybe_pad_and_reduce(x) + 1, backend="aot_eager", fullgraph=True)
    for fn, ok, bad in ((gather, 3, 4), (reduce, 8, 9)):
        torch._dynamo.reset()
        x = torch.ones(ok, 2)
        torch._dynamo.mark_dynamic(x, 0)
        fn(x)
        with pytest.raises(am.ShapeError):
            fn(torch.ones(bad, 2))
    engine.ctx.dp_metadata = DPMetadata([3, 5])
    engine.extra.padded_length = 5
    with pytest.raises(am.ShapeError, match="holds 4 rows, not the 5"):
        torch.ops.vllm.maybe_all_gather_and_maybe_unpad(torch.ones(4, 2))


def test_adapter_errors_are_the_packages_typed_errors(engine):
    # A bad shape is a ShapeError (a ValueError), a bad argument an
    # InvalidArgumentError, as everywhere else in the package.
    engine.ep, engine.dp = Group(2, 0, "ep"), Group(2, 0, "dp")
    engine.ctx.dp_metadata = DPMetadata([3, 5], local_sizes=[3, 5])
    with pytest.raises(am.ShapeError):
        torch.ops.vllm.maybe_pad_and_reduce(torch.ones(7, 2))
    engine.ctx.dp_metadata = DPMetadata([3, 5])
    with pytest.raises(am.InvalidArgumentError, match="no padded_length"):
        torch.ops.vllm.maybe_all_gather_and_maybe_unpad(torch.ones(5, 2))
    with pytest.raises(am.InvalidArgumentError, match="no padded_length"):
        torch.ops.vllm.maybe_pad_and_reduce(torch.ones(8, 2))
    with pytest.raises(am.ShapeError, match="DP rank 0 has 3"):
        av.moe_context(4)
    for bad in ("sideways", 7, enum.Enum("Other", {"X": 1}).X):
        with pytest.raises(am.InvalidArgumentError):
            av.shared_mode_of(bad)
    engine.extra.moe_comm_type = None
    with pytest.raises(am.InvalidArgumentError, match="moe_comm_type is None"):
        av._live_comm_type()


def test_reduce_without_layout_refuses_rows_the_ep_size_does_not_divide(engine):
    # SPEC section 3: without a layout a plain EP reduce-scatter, whose rows
    # must divide by EP, else a clear error (vLLM-Ascend's reduce_scatter
    # cannot split them either), on the groups' own collectives too.
    engine.ep = Group(2, 0, "ep")
    assert torch.ops.vllm.maybe_pad_and_reduce(torch.ones(6, 2)).shape == (3, 2)
    with pytest.raises(am.ShapeError, match="EP size 2 does not divide"):
        torch.ops.vllm.maybe_pad_and_reduce(torch.ones(5, 2))


def _real_and_fake_refuse(op, x, refused):
    """`op` refuses `x` with an InvalidArgumentError matching `refused`, and
    so does its fake."""
    with pytest.raises(am.InvalidArgumentError, match=refused):
        op(x)
    with pytest.raises(am.InvalidArgumentError, match=refused):
        _fake_shape(op, x)


def _fake_shape(op, x):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as fm:
        return tuple(op(fm.from_tensor(x)).shape)


def test_reduce_with_hidden_size_zero_returns_the_empty_shard(engine):
    # An empty trailing dimension: this rank's rows of nothing, as the fake
    # says. (vLLM-Ascend's impl raises here, viewing its zero-element padded
    # buffer as [-1, 0]; its fake gives these shapes.)
    engine.ep, engine.dp = Group(2, 0, "ep"), Group(2, 0, "dp")
    reduce = torch.ops.vllm.maybe_pad_and_reduce
    for fields, want_rows in (
        (dict(local_sizes=[3, 5]), 3),  # SP layout: local_sizes[rank]
        (dict(), 5),  # padded_length path: padded_length / (EP / DP)
    ):
        engine.ctx.dp_metadata = DPMetadata([3, 5], **fields)
        engine.extra.padded_length = 5
        for rest in ((0,), (0, 2), (2, 0)):
            x = torch.ones(8, *rest)
            got = reduce(x)
            assert got.shape == (want_rows, *rest) and got.dtype == x.dtype, (fields, rest, got.shape)
            assert _fake_shape(reduce, x) == tuple(got.shape)


def test_zero_dim_input_is_refused_naming_the_token_dimension(engine):
    # Both ops act on dim 0 (tokens): a 0-d tensor is a clear ShapeError in
    # the real op and its fake, with and without a layout.
    engine.ep = Group(2, 0, "ep")
    x = torch.tensor(1.0)
    for ctx in (None, DPMetadata([1, 1], local_sizes=[1, 1])):
        engine.dp = Group(1 if ctx is None else 2, 0, "dp")
        engine.ctx.dp_metadata = ctx
        for op in (torch.ops.vllm.maybe_all_gather_and_maybe_unpad, torch.ops.vllm.maybe_pad_and_reduce):
            with pytest.raises(am.ShapeError, match="0-d"):
                op(x)
            with pytest.raises(am.ShapeError, match="0-d"):
                _fake_shape(op, x)


@pytest.mark.parametrize("dtype", ["int8", "uint8", "bool", "float8_e4m3fn"])
def test_reduce_refuses_dtypes_it_never_sums_also_on_the_groups_collectives(engine, dtype):
    # SPEC section 8: these are moved as bytes, never reduced. The fake
    # refuses them, so the real op does too, whichever collectives it runs
    # on (vLLM-Ascend sums int8 with wrap-around).
    dtype = getattr(torch, dtype)
    engine.ep = Group(2, 0, "ep")
    reduce = torch.ops.vllm.maybe_pad_and_reduce
    x = torch.ones(4, 3).to(dtype)
    for ctx in (None, DPMetadata([2, 2], local_sizes=[2, 2])):
        engine.dp = Group(1 if ctx is None else 2, 0, "dp")
        engine.ctx.dp_metadata = ctx
        with pytest.raises(am.DTypeError, match="never reduced"):
            _fake_shape(reduce, x)
        with pytest.raises(am.DTypeError, match="never reduced"):
            reduce(x)


@pytest.mark.parametrize("dtype", ["float64", "complex64", "int16"])
def test_dtypes_the_library_does_not_take_move_and_sum_as_vllm_ascend_does(engine, dtype):
    # vLLM-Ascend gathers and reduce-scatters any dtype its groups take; the
    # adapter moves such a dtype as bytes and sums it on the group's own
    # collectives, its fakes giving the shapes the real ops give.
    dtype = getattr(torch, dtype)
    engine.ep, engine.dp = Group(2, 1, "ep"), Group(2, 1, "dp")
    gather, reduce = torch.ops.vllm.maybe_all_gather_and_maybe_unpad, torch.ops.vllm.maybe_pad_and_reduce
    for ctx in (None, DPMetadata([3, 5], local_sizes=[3, 5])):
        engine.ctx.dp_metadata = ctx
        for rest in ((3,), (), (2, 0)):
            x = (torch.arange(5 * math.prod(rest)) - 4).view(5, *rest).to(dtype)
            got = gather(x)
            want = torch.cat([x, x]) if ctx is None else torch.cat([x[:3], x[:5]])  # every rank holds x
            assert got.dtype == dtype and torch.equal(got, want), (ctx, rest)
            assert _fake_shape(gather, x) == tuple(want.shape)
            x = (torch.arange(8 * math.prod(rest)) - 4).view(8, *rest).to(dtype)
            got = reduce(x)
            want = (x * 2)[4:] if ctx is None else (x * 2)[3:8]  # EP rank 1's rows of the sum
            assert got.dtype == dtype and torch.equal(got, want), (ctx, rest)
            assert _fake_shape(reduce, x) == tuple(want.shape)


def _point_runner(tp):
    return SimpleNamespace(
        moe_config=SimpleNamespace(tp_group=tp, ep_size=int(tp.world_size), is_sequence_parallel=False),
        ascend_shared_experts=None,
        routed_output_transform=None,
    )


@pytest.mark.parametrize(
    "dtype, refusal",
    [
        ("int8", "never reduced"),
        ("bool", "never reduced"),
        ("float8_e4m3fn", "never reduced"),
        # MX scales are refused as maybe_pad_and_reduce refuses them; before,
        # vLLM's TP all-reduce summed their bytes.
        ("float8_e8m0fnu", "cannot sum torch.float8_e8m0fnu values"),
        ("float4_e2m1fn_x2", "cannot sum torch.float4_e2m1fn_x2 values"),
    ],
)
def test_reduction_point_never_sums_a_dtype_that_is_only_moved(engine, dtype, refusal):
    # SPEC section 8, as on a communicator (whose all-reduce refuses them):
    # the final point of a TP-2 layer without SP or early reduction
    # all-reduces under ALLGATHER (SPEC section 5, point 3) and refuses to sum
    # these there, without calling vLLM's all-reduce; under MC2 the routed
    # output is already reduced and the point returns the bytes unchanged.
    if not hasattr(torch, dtype):
        pytest.skip(f"torch {torch.__version__} has no {dtype}")
    dtype = getattr(torch, dtype)
    engine.tp = Group(2, 0, "tp")
    summed = []
    engine.tp.all_reduce = lambda t: summed.append(t.dtype) or t.view(torch.uint8).mul(2).view(t.dtype)
    pid = av._runner_policy(_point_runner(engine.tp))
    final = 2
    x = torch.tensor([[1, 0, 1]], dtype=torch.uint8).view(dtype)  # bytes every dtype here holds
    engine.extra.moe_comm_type = MoECommType.ALLGATHER
    with pytest.raises(am.DTypeError, match=refusal):
        torch.ops.ascend_moe.vllm_reduce_point(x, final, pid)
    assert summed == []
    engine.extra.moe_comm_type = MoECommType.MC2
    got = torch.ops.ascend_moe.vllm_reduce_point(x, final, pid)
    assert got.dtype == dtype and got.view(torch.uint8).tolist() == [[1, 0, 1]] and summed == []


@pytest.mark.parametrize("dtype", ["float8_e8m0fnu", "int8"])
def test_reduction_point_fake_refuses_a_dtype_it_never_sums_where_every_comm_type_reduces(engine, dtype):
    # A TP-sharded shared expert with a routed transform, no SP, TP 2 is
    # early, so its shared point all-reduces whatever the comm type (SPEC
    # section 5, point 2): a trace knows it reduces there and refuses a dtype
    # that is only moved (SPEC section 8) as the real op does under every
    # comm type. Its routed point all-reduces only under ALLGATHER (point 1):
    # the fake cannot know the run's comm type and gives the identity shape.
    from torch._subclasses.fake_tensor import FakeTensorMode

    if not hasattr(torch, dtype):
        pytest.skip(f"torch {torch.__version__} has no {dtype}")
    dtype = getattr(torch, dtype)
    engine.tp = Group(2, 0, "tp")
    runner = SimpleNamespace(
        moe_config=SimpleNamespace(tp_group=engine.tp, ep_size=2, is_sequence_parallel=False),
        ascend_shared_experts=SimpleNamespace(),
        routed_output_transform=lambda t: t,
        _get_shared_expert_parallel_mode=lambda: av.SharedMode.TENSOR_PARALLEL,
    )
    pid = av._runner_policy(runner)
    routed, shared = 0, 1
    x = torch.ones(4, 3, dtype=torch.uint8).view(dtype)
    refused = "cannot sum" if dtype == torch.float8_e8m0fnu else "never reduced"
    op = torch.ops.ascend_moe.vllm_reduce_point
    for ct in MoECommType:
        engine.extra.moe_comm_type = ct
        with pytest.raises(am.DTypeError, match=refused):
            op(x, shared, pid)
        with pytest.raises(am.DTypeError, match=refused):
            with FakeTensorMode() as fm:
                op(fm.from_tensor(x), shared, pid)
        with FakeTensorMode() as fm:
            fake = op(fm.from_tensor(x), routed, pid)
        assert fake.shape == x.shape and fake.dtype == dtype, ct


@pytest.mark.parametrize("dtype", ["float64", "complex64"])
def test_reduction_point_on_a_communicator_takes_dtypes_the_library_does_not(engine, dtype):
    # vLLM-Ascend's points return the output itself or its TP all-reduce,
    # whatever the dtype; on a CPU world (one TP rank here) the point went to
    # the library, which refused float64 and complex64 even where it only
    # copies.
    import uuid

    dtype = getattr(torch, dtype)
    comm = am.Comm.cpu(f"pytest-point-{uuid.uuid4().hex[:12]}", 1, 0)
    av._remember_backend(engine.tp, "cpu", av._CommBackend(comm))
    try:
        pid = av._runner_policy(_point_runner(engine.tp))
        x = (torch.arange(12) - 4).view(4, 3).to(dtype)
        for ct in MoECommType:
            engine.extra.moe_comm_type = ct
            for point in range(3):
                got = torch.ops.ascend_moe.vllm_reduce_point(x, point, pid)
                assert got.dtype == dtype and torch.equal(got, x) and got.data_ptr() != x.data_ptr(), (ct, point)
    finally:
        av._BACKENDS.clear()
        comm.close()


def test_ep_ops_have_no_gradient_and_say_so(engine):
    # The ops are not differentiable. vLLM-Ascend's have no autograd kernel:
    # torch warns and backpropagates through the local padding and slicing
    # as if the collective were not there. The adapter's, on every backend,
    # give the values with an input that requires grad and fail a backward
    # naming the op, as ascend-moe's own torch ops do.
    engine.ep, engine.dp = Group(2, 0, "ep"), Group(2, 0, "dp")
    engine.ctx.dp_metadata = DPMetadata([3, 5], local_sizes=[3, 5])
    for name, rows, want in (
        ("maybe_all_gather_and_maybe_unpad", 3, lambda x: torch.cat([x[:3], x[:3], torch.zeros(2, 2)])),
        ("maybe_pad_and_reduce", 8, lambda x: (x * 2)[:3]),
    ):
        op = getattr(torch.ops.vllm, name)
        x = torch.arange(rows * 2.0).view(rows, 2).requires_grad_(True)
        y = op(x)
        assert y.requires_grad and torch.equal(y.detach(), want(x.detach())), name
        with pytest.raises(RuntimeError, match=f"vllm::{name} has no gradient"):
            y.sum().backward()
        assert x.grad is None
        with torch.no_grad():
            assert not op(x).requires_grad


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_ep_ops_with_an_input_requiring_grad_run_as_eager(engine, backend):
    # torch.compile traces the backward of a forward with an input that
    # requires grad when it compiles: the compiled ops give eager's values
    # and a backward, eager or compiled, fails naming the op.
    engine.ep, engine.dp = Group(2, 0, "ep"), Group(2, 0, "dp")
    engine.ctx.dp_metadata = DPMetadata([3, 5], local_sizes=[3, 5])
    for op, name, rows in (("gather", "maybe_all_gather_and_maybe_unpad", 3), ("reduce", "maybe_pad_and_reduce", 8)):
        fn = _op_then_ones(op)
        x = torch.arange(rows * 2.0).view(rows, 2).requires_grad_(True)
        torch._dynamo.reset()
        want, got = fn(x), torch.compile(fn, backend=backend, fullgraph=True)(x)
        assert got.requires_grad and torch.equal(got.detach(), want.detach()), name
        for y in (want, got):
            with pytest.raises(RuntimeError, match=f"vllm::{name} has no gradient"):
                y.sum().backward()
        assert x.grad is None, name


@pytest.mark.parametrize("kind", ["float64", "complex64", "0-d"])
def test_reduction_point_fake_gives_the_shape_the_real_point_gives(engine, kind):
    # vLLM-Ascend's points return the tensor or its TP all-reduce, whatever
    # its dtype or rank; the adapter's real point does the same, and its fake
    # (what torch.compile traces) gives that shape instead of refusing the
    # dtype or reading dim 0 of a 0-d tensor.
    from torch._subclasses.fake_tensor import FakeTensorMode

    engine.tp = Group(2, 0, "tp")
    pid = av._runner_policy(_point_runner(engine.tp))
    x = torch.tensor(2.0) if kind == "0-d" else torch.ones(4, 3, dtype=getattr(torch, kind))
    op = torch.ops.ascend_moe.vllm_reduce_point
    for ct in (MoECommType.ALLGATHER, MoECommType.MC2):
        engine.extra.moe_comm_type = ct
        for point in range(3):
            real = op(x, point, pid)
            # No shared expert, no transform: only the final point reduces, under
            # ALLGATHER without SP (the Group stand-in sums 2 equal ranks).
            want = x * 2 if ct == MoECommType.ALLGATHER and point == 2 else x
            assert real.dtype == x.dtype and torch.equal(real, want), (ct, point)
            with FakeTensorMode() as fm:
                fake = op(fm.from_tensor(x), point, pid)
            assert fake.shape == real.shape and fake.dtype == real.dtype, (ct, point)
