"""Operands where they live: NPU descriptors from tensor-likes (a stand-in NPU
tensor and stream with only the attributes torch_npu's have), the stream
default and its error, the stream-handle cache, `out=` on numpy and torch CPU,
and no numpy round trip for torch CPU tensors. Needs no NPU and no torch_npu:
the library call is recorded, not run, for the NPU descriptors."""

import ml_dtypes
import numpy as np
import pytest

import ascend_moe as am
from ascend_moe import _tensor
from workers import assert_close, finalize_case, finalize_golden, rng_for

BF16 = np.dtype(ml_dtypes.bfloat16)


class Device:
    """`torch.device`'s two attributes."""

    def __init__(self, type_, index):
        self.type, self.index = type_, index

    def __repr__(self):
        return f"{self.type}:{self.index}"


class NpuTensor:
    """Only what the package may use of an NPU tensor: `device`, `data_ptr()`,
    `dtype`, `shape`, `is_contiguous()` (no `new_empty`, no `numpy`)."""

    def __init__(self, shape, dtype, ptr, index=0, contiguous=True):
        self.shape, self.dtype, self._ptr = tuple(shape), np.dtype(dtype), ptr
        self.device = Device("npu", index)
        self._contiguous = contiguous

    def data_ptr(self):
        return self._ptr

    def is_contiguous(self):
        return self._contiguous


class AllocatingNpuTensor(NpuTensor):
    """A stand-in whose `new_empty` (torch's allocator entry point) is recorded."""

    allocated: list = []

    def new_empty(self, shape):
        t = AllocatingNpuTensor(shape, self.dtype, 0x7000_0000 + 0x1000 * len(self.allocated), self.device.index)
        AllocatingNpuTensor.allocated.append(t)
        return t


class Stream:
    """torch_npu's `Stream`: `.npu_stream` is the raw aclrtStream."""

    def __init__(self, raw):
        self.npu_stream = raw


def _desc(p):
    """`amoe_tensor` fields of a descriptor pointer (None for NULL)."""
    if not p:
        return None
    c = p.contents
    return dict(
        data=c.data, dtype=c.dtype, shape=tuple(c.shape[i] for i in range(c.ndim)), kind=c.device_kind, ordinal=c.device_ordinal
    )


@pytest.fixture
def recorded(monkeypatch):
    """Records the op calls (never run) and wraps streams into fake handles,
    counting `amoe_stream_wrap` calls."""
    calls, wraps = [], []
    real_call = _tensor.call

    def fake_call(name, *args):
        if name == "amoe_stream_wrap":
            raw, device, out = args
            wraps.append((raw.value, device))
            out._obj.value = 0x5000 + len(wraps)
            return
        if name.endswith("_output_shape") or name.startswith("amoe_comm_") or name == "amoe_reduce_policy_decisions":
            return real_call(name, *args)
        calls.append((name, args))

    monkeypatch.setattr(_tensor, "_STREAMS", {})
    monkeypatch.setattr(_tensor, "call", fake_call)
    for mod in (am.ops, am.comm, am.prepare):
        monkeypatch.setattr(mod, "call", fake_call)
    return calls, wraps


def test_npu_tensors_become_npu_descriptors_of_their_own_memory(recorded):
    calls, wraps = recorded
    ex = NpuTensor((6, 4), BF16, 0x1000_0000, index=2)
    idx = NpuTensor((6,), np.int32, 0x1100_0000, index=2)
    scales = NpuTensor((3, 2), np.float32, 0x1200_0000, index=2)
    out = NpuTensor((3, 4), BF16, 0x1300_0000, index=2)
    got = am.moe_finalize_routing(ex, idx, scales=scales, out=out, stream=Stream(0xABC0))
    assert got is out
    [(name, (args, out_ptr, stream))] = calls
    assert name == "amoe_moe_finalize_routing"
    want = {
        "expanded_x": (0x1000_0000, 2, (6, 4)),
        "expanded_row_idx": (0x1100_0000, 3, (6,)),
        "scales": (0x1200_0000, 0, (3, 2)),
    }
    for field, (ptr, dtype, shape) in want.items():
        d = _desc(getattr(args, field))
        assert d == dict(data=ptr, dtype=dtype, shape=shape, kind=1, ordinal=2), field
    for field in ("x1", "x2", "bias", "expert_idx"):
        assert not getattr(args, field), field
    assert _desc(out_ptr) == dict(data=0x1300_0000, dtype=2, shape=(3, 4), kind=1, ordinal=2)
    assert wraps == [(0xABC0, 2)] and stream.value == 0x5001


def test_a_stream_is_wrapped_once_per_raw_stream_and_device(recorded):
    calls, wraps = recorded
    x = NpuTensor((4, 2), np.float32, 0x2000_0000, index=1)
    policy = am.ReducePolicy("none", False, False, 1, 1)
    with am.Comm.cpu("tensors-stream-cache", 1, 0) as c:
        for raw in (0xAA00, 0xAA00, 0xBB00, 0xAA00):
            out = NpuTensor((4, 2), np.float32, 0x2100_0000, index=1)
            assert policy.reduce_final(x, am.CommType.MC2, c, out=out, stream=Stream(raw)) is out
    assert wraps == [(0xAA00, 1), (0xBB00, 1)]
    assert [a[-1].value for _, a in calls] == [0x5001, 0x5001, 0x5002, 0x5001]


def test_outputs_of_npu_tensors_come_from_their_allocator(recorded):
    calls, _ = recorded
    AllocatingNpuTensor.allocated.clear()
    x = AllocatingNpuTensor((5, 3), np.float16, 0x3000_0000, index=0)
    idx = NpuTensor((5,), np.int32, 0x3100_0000, index=0)
    y = am.moe_token_unpermute(x, idx, stream=Stream(0x10))
    assert AllocatingNpuTensor.allocated == [y] and y.shape == (5, 3) and y.dtype == np.float16
    assert _desc(calls[0][1][3])["data"] == y.data_ptr()


def test_npu_outputs_need_out_without_an_allocator(recorded):
    x = NpuTensor((4, 2), np.float32, 0x4000_0000)
    idx = NpuTensor((4,), np.int32, 0x4100_0000)
    with pytest.raises(am.AmoeError, match=r"`permuted` \(NpuTensor on npu:0\) has no `new_empty`.*pass `out=`"):
        am.moe_token_unpermute(x, idx, stream=Stream(0x10))
    assert recorded[0] == []


def test_an_npu_tensor_without_a_stream_is_a_clear_error(recorded):
    try:
        import torch_npu  # noqa: F401
    except Exception:
        pass
    else:
        pytest.skip("torch_npu is importable: the default stream exists")
    x = NpuTensor((4, 2), np.float32, 0x4000_0000, index=3)
    out = NpuTensor((4, 2), np.float32, 0x4100_0000, index=3)
    with am.Comm.cpu("tensors-no-stream", 1, 0) as c:
        with pytest.raises(am.AmoeError, match=r"`x` is an NPU tensor \(npu:3\) but no stream was given: pass `stream=`") as e:
            am.all_reduce(x, c, out=out)
    assert "torch_npu" in str(e.value) and "npu_stream" in str(e.value)
    with pytest.raises(am.AmoeError, match="non-null .npu_stream"):
        am.moe_token_unpermute(x, NpuTensor((4,), np.int32, 0x10, index=3), out=out, stream=object())
    assert recorded == ([], [])


def test_unusable_tensors_are_refused_before_the_library_is_called(recorded):
    x = NpuTensor((4, 2), np.float32, 0x4000_0000, contiguous=False)
    idx = NpuTensor((4,), np.int32, 0x4100_0000)
    out = NpuTensor((4, 2), np.float32, 0x4200_0000)
    with pytest.raises(am.AmoeError, match="`permuted` is an NPU tensor that is not contiguous"):
        am.moe_token_unpermute(x, idx, out=out, stream=Stream(1))
    cuda = NpuTensor((4, 2), np.float32, 0x4000_0000)
    cuda.device = Device("cuda", 0)
    with pytest.raises(am.AmoeError, match="`permuted` is on device cuda:0; expected a cpu or npu tensor"):
        am.moe_token_unpermute(cuda, idx, out=out, stream=Stream(1))
    good = NpuTensor((4, 2), np.float32, 0x4000_0000)
    with pytest.raises(am.AmoeError, match=r"`out` has shape \[3, 2\], the op's output is \[4, 2\]"):
        am.moe_token_unpermute(good, idx, out=NpuTensor((3, 2), np.float32, 1), stream=Stream(1))
    with pytest.raises(am.AmoeError, match="`out` has dtype float16, the op's output is float32"):
        am.moe_token_unpermute(good, idx, out=NpuTensor((4, 2), np.float16, 1), stream=Stream(1))
    assert recorded == ([], [])


def test_a_stream_of_another_device_is_refused(recorded):
    x = NpuTensor((4, 2), np.float32, 0x4000_0000, index=1)
    idx = NpuTensor((4,), np.int32, 0x4100_0000, index=1)
    out = NpuTensor((4, 2), np.float32, 0x4200_0000, index=1)
    stream = Stream(0x99)
    stream.device = Device("npu", 2)
    with pytest.raises(am.AmoeError, match="`stream` is on npu:2, but `permuted` is on npu:1"):
        am.moe_token_unpermute(x, idx, out=out, stream=stream)
    stream.device = Device("npu", 1)
    assert am.moe_token_unpermute(x, idx, out=out, stream=stream) is out
    assert recorded[1] == [(0x99, 1)]


def _finalize_numpy(seed, dtype=np.float32):
    ex, idx, kw = finalize_case(rng_for("tensors-out", seed), 0, dtype)
    want = finalize_golden(ex, idx, kw["x1"], kw["x2"], kw["bias"], kw["scales"], kw["expert_idx"], 0)
    return ex, idx, kw, want


@pytest.mark.parametrize("dtype", [np.dtype(np.float32), BF16], ids=str)
def test_out_is_written_and_returned_for_numpy(dtype):
    ex, idx, kw, want = _finalize_numpy(1, dtype)
    out = np.full(want.shape, 7, dtype)
    got = am.moe_finalize_routing(ex, idx, **kw, out=out)
    assert got is out
    assert_close(out, want, dtype, "finalize into out")
    # A second call reuses the same buffer and overwrites it.
    out[...] = 0
    assert am.moe_finalize_routing(ex, idx, **kw, out=out) is out
    assert_close(out, want, dtype, "finalize into a reused out")
    with pytest.raises(am.ShapeError, match="`out` must be a C-contiguous numpy array"):
        am.moe_finalize_routing(ex, idx, **kw, out=np.zeros((want.shape[0] * 2,) + want.shape[1:], dtype)[::2])
    # Read-only is its own error: shape, dtype and layout are right.
    frozen = np.zeros(want.shape, dtype)
    frozen.flags.writeable = False
    with pytest.raises(am.InvalidArgumentError, match="`out` is a read-only numpy array"):
        am.moe_finalize_routing(ex, idx, **kw, out=frozen)
    with pytest.raises(am.AmoeError, match="`out` has dtype float16"):
        am.moe_finalize_routing(ex, idx, **kw, out=np.zeros(want.shape, np.float16))


def test_collectives_and_reduction_points_take_out():
    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    with am.Comm.cpu("tensors-out-coll", 1, 0) as c:
        for fn in (lambda o: am.all_reduce(x, c, out=o), lambda o: am.all_gather(x, c, out=o)):
            out = np.zeros_like(x)
            assert fn(out) is out
            np.testing.assert_array_equal(out, x)
        policy = am.ReducePolicy("none", False, False, 1, 1)
        out = np.zeros_like(x)
        assert policy.reduce_final(x, am.CommType.ALLGATHER, c, out=out) is out
        np.testing.assert_array_equal(out, x)
        y = x.copy()
        assert am.broadcast(y, c, 0, out=y) is y
        np.testing.assert_array_equal(y, x)
        # A numpy scalar is 0-d, and so is its result.
        for fn in (lambda v: am.all_reduce(v, c), lambda v: am.broadcast(v, c)):
            got = fn(np.float32(2.5))
            assert got.shape == () and got == np.float32(2.5), got
        # An `out` of another dtype or shape is refused, never converted or broadcast into.
        with pytest.raises(am.AmoeError, match=r"`out` is float16 \[4, 3\], `x` is float32") as e:
            am.broadcast(x, c, 0, out=np.zeros((4, 3), np.float16))
        assert e.value.status == am.Status.DTYPE
        with pytest.raises(am.AmoeError, match=r"`out` is float32 \[2, 4, 3\]") as e:
            am.broadcast(x, c, 0, out=np.zeros((2, 4, 3), np.float32))
        assert e.value.status == am.Status.SHAPE


torch = pytest.importorskip("torch") if am.TORCH_OPS else None


@pytest.fixture
def no_numpy_round_trip(monkeypatch):
    """Any tensor -> numpy conversion fails the test."""

    def refuse(*_a, **_k):
        raise AssertionError("a torch tensor went through numpy")

    monkeypatch.setattr(torch.Tensor, "numpy", refuse)
    monkeypatch.setattr(torch.Tensor, "__array__", refuse)


def _finalize_torch(seed, dtype):
    ex, idx, kw, want = _finalize_numpy(seed, dtype)
    from torch_workers import to_torch

    tkw = {k: (to_torch(v) if isinstance(v, np.ndarray) else v) for k, v in kw.items()}
    return to_torch(ex), to_torch(idx), tkw, want


@pytest.mark.skipif(not am.TORCH_OPS, reason="torch not importable")
@pytest.mark.parametrize("dtype", [np.dtype(np.float32), BF16], ids=str)
def test_torch_cpu_tensors_pass_by_data_ptr_into_out(dtype, no_numpy_round_trip):
    ex, idx, kw, want = _finalize_torch(2, dtype)
    out = torch.full(want.shape, 7.0, dtype=ex.dtype)
    ptr = out.data_ptr()
    got = am.moe_finalize_routing(ex, idx, **kw, out=out)
    assert got is out and got.data_ptr() == ptr
    fresh = am.moe_finalize_routing(ex, idx, **kw)
    assert isinstance(fresh, torch.Tensor) and fresh.device.type == "cpu" and fresh.dtype == ex.dtype
    assert torch.equal(fresh, out)
    assert_close(_listed(out, dtype), want, dtype, "finalize of torch tensors into out")


def _listed(t, dtype):
    """`t` as a numpy array through `tolist()` (no numpy view of the tensor)."""
    return np.array(t.float().tolist(), np.float32).astype(dtype)


@pytest.mark.skipif(not am.TORCH_OPS, reason="torch not importable")
def test_non_contiguous_torch_inputs_are_made_contiguous_but_outputs_are_refused():
    x = torch.arange(24, dtype=torch.float32).reshape(4, 6)[:, ::2]
    assert not x.is_contiguous()
    idx = torch.tensor([3, 1, 0, 2], dtype=torch.int32)
    y = am.moe_token_unpermute(x, idx)
    assert torch.equal(y, x[idx.long()])
    with pytest.raises(am.AmoeError, match="`out` is a CPU tensor that is not contiguous"):
        am.moe_token_unpermute(x.contiguous(), idx, out=torch.zeros(4, 6)[:, ::2])
    # broadcast's default `out` is a dense copy, whatever x's strides.
    with am.Comm.cpu("tensors-broadcast-transposed", 1, 0) as c:
        t = torch.arange(6, dtype=torch.float32).reshape(2, 3).T
        got = am.broadcast(t, c)
        assert got.is_contiguous() and torch.equal(got, t) and got.data_ptr() != t.data_ptr()
        dense = t.contiguous()
        got = am.broadcast(dense, c)
        assert torch.equal(got, dense) and got.data_ptr() != dense.data_ptr()


@pytest.mark.skipif(not am.TORCH_OPS, reason="torch not importable")
def test_negated_views_are_read_as_their_values_and_refused_as_outputs():
    # torch's negative bit: a contiguous view whose values are its memory
    # negated (`.conj().imag` of one element, `_neg_view`). The library read
    # the memory, [1, 1] for a tensor of [-1, -1].
    one = torch.complex(torch.ones(1), torch.full((1,), 3.0)).conj().imag
    assert one.is_neg() and one.is_contiguous()
    with am.Comm.cpu("tensors-neg-bit", 1, 0) as c:
        for x in (torch.ones(2)._neg_view(), one):
            assert torch.equal(am.all_gather(x, c), x.resolve_neg()), x
            assert torch.equal(am.broadcast(x, c), x.resolve_neg()), x
        with pytest.raises(am.InvalidArgumentError, match="`out` has torch's negative bit"):
            am.all_gather(torch.ones(2), c, out=torch.zeros(2)._neg_view())


@pytest.mark.skipif(not am.TORCH_OPS, reason="torch not importable")
def test_broadcast_copies_an_array_into_a_tensor_out():
    # `out.copy_(x)` of a numpy `x` raised torch's TypeError.
    with am.Comm.cpu("tensors-broadcast-array", 1, 0) as c:
        for dtype, tdtype in ((np.float32, torch.float32), (BF16, torch.bfloat16), (np.bool_, torch.bool)):
            x = (np.arange(6).reshape(2, 3) % 2).astype(dtype)
            out = torch.zeros(2, 3, dtype=tdtype)
            assert am.broadcast(x, c, out=out) is out
            assert out.float().tolist() == x.astype(np.float32).tolist(), dtype


@pytest.mark.skipif(not am.TORCH_OPS, reason="torch not importable")
def test_broadcast_copies_a_tensor_into_an_array_out():
    # `out[...] = np.asarray(x)` raised torch's TypeError for bf16 and fp8 and
    # a RuntimeError for a negated view.
    F8 = np.dtype(ml_dtypes.float8_e4m3fn)
    with am.Comm.cpu("tensors-broadcast-tensor", 1, 0) as c:
        for tdtype, dtype in ((torch.float32, np.float32), (torch.bfloat16, BF16), (torch.float8_e4m3fn, F8), (torch.bool, np.bool_)):
            x = (torch.arange(6).reshape(2, 3) % 3).to(tdtype)
            out = np.full((2, 3), 7, dtype)
            assert am.broadcast(x, c, out=out) is out
            want = [[0, 1, 1], [0, 1, 1]] if tdtype is torch.bool else [[0, 1, 2], [0, 1, 2]]
            assert out.astype(np.float32).tolist() == want, tdtype
        neg = torch.complex(torch.zeros(3), torch.tensor([1.0, 2.0, 3.0])).conj().imag
        out = np.zeros(3, np.float32)
        assert am.broadcast(neg, c, out=out) is out and out.tolist() == [-1.0, -2.0, -3.0]
        t = torch.arange(6, dtype=torch.float32).reshape(2, 3).T
        out = np.zeros((3, 2), np.float32)
        assert am.broadcast(t, c, out=out) is out and out.tolist() == [[0, 3], [1, 4], [2, 5]]


@pytest.mark.skipif(not am.TORCH_OPS, reason="torch not importable")
def test_tensors_that_are_not_dense_are_refused_naming_their_layout():
    # A sparse or mkldnn tensor failed in torch (`.contiguous()`, `data_ptr()`)
    # with a RuntimeError naming no argument, also after a dense tensor had
    # put torch.Tensor on the short path.
    sparse = torch.eye(3).to_sparse()
    cases = [(sparse, "layout torch.sparse_coo"), (torch.eye(3).to_sparse_csr(), "layout torch.sparse_csr")]
    if torch.backends.mkldnn.is_available():
        cases.append((torch.eye(3).to_mkldnn(), "layout torch._mkldnn"))
    cases.append((torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]), "nested tensor"))
    with am.Comm.cpu("tensors-not-dense", 1, 0) as c:
        for first_dense in (False, True):
            if first_dense:
                assert am.all_reduce(torch.ones(3, 3), c).tolist() == torch.ones(3, 3).tolist()
            for x, what in cases:
                with pytest.raises(am.InvalidArgumentError, match=f"`x` is a {what}" if "nested" in what else f"`x` is a tensor of {what}"):
                    am.all_reduce(x, c)
                with pytest.raises(am.InvalidArgumentError, match="`out`"):
                    am.all_gather(torch.ones(3, 3), c, out=x)
                for out in (None, torch.zeros(3, 3), np.zeros((3, 3), np.float32)):
                    with pytest.raises(am.InvalidArgumentError, match="`x` is a"):
                        am.broadcast(x, c, out=out)


def test_arguments_of_the_wrong_kind_are_the_packages_errors():
    # Each raised a bare AttributeError / ValueError, or was taken as True.
    with pytest.raises(am.InvalidArgumentError, match="`name` is 123, expected a str"):
        am.Comm.cpu(123, 1, 0)
    with pytest.raises(am.InvalidArgumentError, match="`timeout_s` is 'soon'"):
        am.Comm.cpu("tensors-kinds", 1, 0, timeout_s="soon")
    for bad in ("False", "no", 0.0, None, 2):
        with pytest.raises(am.InvalidArgumentError, match=f"`sp` is {bad!r}, expected a bool"):
            am.ReducePolicy("none", False, bad, 1, 1)
        with pytest.raises(am.InvalidArgumentError, match="`sp`"):
            am.routed_is_reduced("allgather", bad)
        with pytest.raises(am.InvalidArgumentError, match="`sp`"):
            am.MoeContext([4], 1, 0, 0, sp=bad)
    # padded_num_tokens=0 reached the library as its "default" and was taken
    # as ceil_to(max T_d, TP); it pads nothing, so it is refused as 5 is.
    with pytest.raises(am.InvalidArgumentError, match="`padded_num_tokens`: 0 rows hold none of the largest DP rank's 6 tokens"):
        am.MoeContext([6, 3], 2, 0, 0, padded_num_tokens=0)
    assert am.MoeContext([0, 0], 2, 0, 0, padded_num_tokens=0).padded_num_tokens == 0
    with pytest.raises(am.InvalidArgumentError, match="`has_routed_transform`"):
        am.ReducePolicy("none", "yes", False, 1, 1)
    for ok, want in ((True, True), (np.bool_(False), False), (1, True), (np.int64(0), False)):
        assert am.ReducePolicy("none", False, ok, 1, 1).sp is want
        assert am.ForwardContext(0, [4], sp=ok).sp is want
    # A comm type by name, as every other op takes it.
    for name, ct in (("mc2", am.CommType.MC2), ("ALLTOALL", am.CommType.ALLTOALL)):
        assert am.ForwardContext(name, [4]).comm_type is ct
    with pytest.raises(am.InvalidArgumentError, match="unknown"):
        am.ForwardContext("sideways", [4])


def test_an_unknown_numpy_dtype_lists_every_dtype_and_where_bfloat16_comes_from():
    with pytest.raises(am.DTypeError, match="`permuted` has dtype float64, expected one of float32, ") as e:
        am.moe_token_unpermute(np.zeros((2, 2)), np.zeros(2, np.int32))
    for name in ("float16", "bfloat16", "int32", "int64", "int8", "uint8", "bool", "float8_e4m3fn", "float8_e5m2"):
        assert f" {name}," in str(e.value) or f" {name} " in str(e.value), (name, str(e.value))
    assert str(e.value).endswith("(bfloat16 and the float8 types from ml_dtypes)"), str(e.value)


@pytest.mark.skipif(not am.TORCH_OPS, reason="torch not importable")
def test_torch_tensors_after_the_first_are_checked_as_the_first_was():
    # Once a call has passed a torch CPU tensor, later ones take a shorter
    # way through the descriptors: it must refuse what the first call refuses.
    idx = torch.tensor([1, 0], dtype=torch.int32)
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    assert torch.equal(am.moe_token_unpermute(x, idx), x[idx.long()])
    with pytest.raises(am.AmoeError, match="`permuted` has dtype float64") as e:
        am.moe_token_unpermute(x.double(), idx)
    assert e.value.status == am.Status.DTYPE
    # A torch caller is told torch's names, not where numpy finds bfloat16.
    assert "ml_dtypes" not in str(e.value) and "bfloat16" in str(e.value), str(e.value)
    with pytest.raises(am.AmoeError, match="`sorted_indices` has dtype complex64"):
        am.moe_token_unpermute(x, idx.to(torch.complex64))
    with pytest.raises(am.AmoeError, match="`permuted` is a meta tensor"):
        am.moe_token_unpermute(x.to("meta"), idx)
    with pytest.raises(am.AmoeError, match="`out` has dtype float64"):
        am.moe_token_unpermute(x, idx, out=torch.zeros(2, 2, dtype=torch.float64))
    with pytest.raises(am.AmoeError, match="`out` has shape \\[3, 2\\]"):
        am.moe_token_unpermute(x, idx, out=torch.zeros(3, 2))
    with pytest.raises(am.AmoeError, match="`out` is a CPU tensor that is not contiguous"):
        am.moe_token_unpermute(x, idx, out=torch.zeros(2, 4)[:, ::2])
    out = torch.full((2, 2), 9.0)
    assert am.moe_token_unpermute(x, idx, out=out) is out and torch.equal(out, x[idx.long()])


@pytest.mark.skipif(not am.TORCH_OPS, reason="torch not importable")
def test_torch_ops_have_cpu_and_privateuse1_kernels_only():
    from test_torch_ops import ALL_OPS

    names = ALL_OPS + ["moe_layer_fc", "reduce_routed_early_fc", "reduce_shared_fc", "reduce_final_fc"]
    for name in names:
        qual = f"ascend_moe::{name}"
        assert torch._C._dispatch_has_kernel_for_dispatch_key(qual, "CPU"), name
        assert torch._C._dispatch_has_kernel_for_dispatch_key(qual, "PrivateUse1"), name
        assert torch._C._dispatch_has_kernel_for_dispatch_key(qual, "Meta"), name
        # No catch-all real kernel: a CUDA (or any other) tensor finds none.
        assert not torch._C._dispatch_has_kernel_for_dispatch_key(qual, "CUDA"), name
        assert not torch._C._dispatch_has_kernel_for_dispatch_key(qual, "CompositeExplicitAutograd"), name


@pytest.mark.skipif(not am.TORCH_OPS, reason="torch not importable")
def test_torch_op_real_kernel_reads_tensor_memory_in_place(no_numpy_round_trip):
    ex, idx, kw, want = _finalize_torch(3, np.dtype(np.float32))
    got = torch.ops.ascend_moe.moe_finalize_routing(ex, idx, **kw)
    assert_close(_listed(got, np.float32), want, np.dtype(np.float32), "torch op finalize")
    x = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    with am.Comm.cpu("tensors-torch-op", 1, 0) as c:
        y = torch.ops.ascend_moe.all_reduce(x, c.handle_id)
        assert torch.equal(y, x) and y.data_ptr() != x.data_ptr()


@pytest.mark.skipif(not am.TORCH_OPS, reason="torch not importable")
def test_from_process_group_refuses_a_non_hccl_group():
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(am.AmoeError, match="uses the 'gloo' backend; only an HCCL group") as e:
            am.Comm.from_process_group(dist.group.WORLD)
        assert e.value.status == am.Status.INVALID_ARGUMENT
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not am.TORCH_OPS, reason="torch not importable")
def test_from_process_group_borrows_the_groups_hccl_comm(monkeypatch):
    """The glue to torch_npu's ProcessGroupHCCL, with a stand-in group: the
    group's comm is asked for with the local device (torch_npu keys it by
    `rankid % device_count()`), not the rank in the group, and goes to
    `Comm.from_hccl` with the device."""
    import types

    import torch.distributed as dist

    asked, wrapped = [], []

    class HcclBackend:
        def __init__(self, raw):
            self.raw = raw

        def get_hccl_comm(self, rank):
            asked.append(rank)
            return self.raw

    class Group:
        def __init__(self, raw):
            self.backend = HcclBackend(raw)

        def _get_backend(self, device):
            assert device.type in ("npu", "privateuseone")
            return self.backend

    def from_hccl(cls, raw, device, world=False):
        wrapped.append((raw, device, world))
        return types.SimpleNamespace()

    monkeypatch.setattr(dist, "get_backend", lambda pg: "hccl")
    monkeypatch.setattr(dist, "get_rank", lambda pg: 3)
    monkeypatch.setattr(am.Comm, "from_hccl", classmethod(from_hccl))
    pg = Group(0x7F00_1234)
    comm = am.Comm.from_process_group(pg, device_ordinal=5)
    # The group rank is 3, the local device 5: the device is what is asked; a
    # group other than torch's world may be a sub-communicator (not splittable).
    assert asked == [5] and wrapped == [(0x7F00_1234, 5, False)] and comm._owner is pg
    with pytest.raises(am.AmoeError, match="returned a null HcclComm"):
        am.Comm.from_process_group(Group(0), device_ordinal=5)
    assert wrapped == [(0x7F00_1234, 5, False)]
    # torch's default group is its world: borrowed as one, so it may be split.
    world = Group(0x7F00_5678)
    monkeypatch.setattr(am.comm, "_is_torch_world", lambda pg: pg is world)
    am.Comm.from_process_group(world, device_ordinal=5)
    assert wrapped[-1] == (0x7F00_5678, 5, True)
    # None is the default group, as torch.distributed takes it.
    monkeypatch.setattr(dist, "group", types.SimpleNamespace(WORLD=world))
    comm = am.Comm.from_process_group(None, device_ordinal=5)
    assert wrapped[-1] == (0x7F00_5678, 5, True) and comm._owner is world


@pytest.mark.skipif(not am.TORCH_OPS, reason="torch not importable")
def test_only_torchs_default_group_counts_as_the_world():
    import torch.distributed as dist

    # Before init_process_group, WORLD is None: the default group is the world.
    assert am.comm._is_torch_world(dist.group.WORLD)
    assert not am.comm._is_torch_world(object())
