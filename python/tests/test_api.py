"""Single-process checks of the Python API: loading, dtypes, shapes, enums, errors."""

import ctypes
import os
import re
import shutil
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import ascend_moe as am

ROOT = Path(__file__).resolve().parents[2]


def test_version_matches_cargo_toml():
    cargo = (ROOT / "Cargo.toml").read_text()
    want = re.search(r'^version = "([^"]+)"', cargo, re.M).group(1)
    assert am.version() == want


def test_library_is_found_next_to_the_package(tmp_path):
    pkg = tmp_path / "ascend_moe"
    shutil.copytree(Path(am.__file__).parent, pkg, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    shutil.copy(am.library_path(), pkg / "libascend_moe.so")
    env = {k: v for k, v in os.environ.items() if k != "ASCEND_MOE_LIB"}
    env["PYTHONPATH"] = str(tmp_path)
    code = "import ascend_moe as am; print(am.library_path()); print(am.version())"
    run = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    out = run.stdout
    assert out.splitlines()[0] == str(pkg / "libascend_moe.so")


def test_installed_package_bundles_its_library(tmp_path):
    """`pip install ./python` builds the cdylib into the package, where it is
    found with no ASCEND_MOE_LIB (CI runs the suite that way)."""
    pkg = Path(am.__file__).resolve().parent
    if pkg == ROOT / "python" / "ascend_moe" and not os.environ.get("CI"):
        pytest.skip("the suite imports the source tree, not an installed package")
    env = {k: v for k, v in os.environ.items() if k not in ("ASCEND_MOE_LIB", "PYTHONPATH")}
    code = "import ascend_moe as am; print(am.library_path()); print(am.version())"
    run = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    path, version = run.stdout.splitlines()
    assert Path(path).parent == pkg and Path(path).name.startswith("libascend_moe"), path
    assert version == am.version()


def test_missing_library_names_the_paths_tried(tmp_path):
    env = dict(os.environ, ASCEND_MOE_LIB=str(tmp_path / "nope.so"))
    code = "import ascend_moe as am\ntry:\n    am.version()\nexcept OSError as e:\n    print(e)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert "nope.so" in out and "ASCEND_MOE_LIB" in out


def test_enums_have_vllm_numbering():
    assert [int(c) for c in (am.CommType.ALLGATHER, am.CommType.MC2, am.CommType.ALLTOALL, am.CommType.FUSED_MC2)] == [
        0,
        1,
        2,
        3,
    ]
    assert am.SharedMode.parse("tensor_parallel") is am.SharedMode.TENSOR_PARALLEL
    assert am.SharedMode.parse("Data_Parallel_Only") is am.SharedMode.DATA_PARALLEL_ONLY
    assert am.SharedMode.parse(2) is am.SharedMode.SEQUENCE_PARALLEL_SEDP
    with pytest.raises(am.AmoeError, match="unknown shared mode"):
        am.SharedMode.parse("pipeline")


def test_routed_is_reduced_table():
    for ct in am.CommType:
        for sp in (False, True):
            assert am.routed_is_reduced(ct, sp) == (ct != am.CommType.ALLGATHER or sp)
    with pytest.raises(am.AmoeError, match="unknown MoE comm type 7") as e:
        am.routed_is_reduced(7, False)
    assert isinstance(e.value, RuntimeError) and e.value.status == am.Status.INVALID_ARGUMENT


def test_reduce_policy_validates_and_decides():
    p = am.ReducePolicy("data_parallel_only", False, False, 2, 4)
    assert p.early
    assert p.decisions(am.CommType.ALLGATHER)["routed"] and not p.decisions(am.CommType.MC2)["routed"]
    with pytest.raises(am.AmoeError, match="needs sequence parallelism"):
        am.ReducePolicy("sequence_parallel_only", False, False, 2, 4)
    with pytest.raises(am.AmoeError, match="multiple of tp_size"):
        am.ReducePolicy("none", False, False, 2, 3)
    with pytest.raises(am.AmoeError, match="SequenceParallelOnly"):
        am.ReducePolicy("tensor_parallel", False, True, 2, 4)
    am.ReducePolicy("tensor_parallel", False, True, 1, 4)


def test_sp_layout_from_dp_tokens():
    assert am.SpLayout.from_dp_tokens([5, 0, 3], 2).local_sizes == (3, 3, 0, 0, 2, 2)
    assert am.SpLayout.from_dp_tokens([1], 4).local_sizes == (1, 1, 1, 1)
    with pytest.raises(am.AmoeError, match="tp_size"):
        am.SpLayout.from_dp_tokens([4], 0)
    with pytest.raises(am.AmoeError):
        am.SpLayout([])


def test_sp_layout_with_pcp_repeats_each_dp_ranks_rows_over_its_pcp_and_tp_ranks():
    # SPEC section 2's example: DP2 PCP2 TP2 with tokens [1, 9].
    assert am.SpLayout.from_dp_tokens([1, 9], 2, pcp_size=2).local_sizes == (1, 1, 1, 1, 5, 5, 5, 5)
    assert am.SpLayout.from_dp_tokens([5, 0, 3], 2, pcp_size=1).local_sizes == (3, 3, 0, 0, 2, 2)
    assert am.SpLayout.from_dp_tokens([7], 1, pcp_size=3).local_sizes == (7, 7, 7)
    with pytest.raises(am.InvalidArgumentError, match="pcp_size"):
        am.SpLayout.from_dp_tokens([4], 2, pcp_size=0)
    with pytest.raises(am.InvalidArgumentError, match="dp_size 2 x pcp_size 1048576 x tp_size 2 exceeds"):
        am.SpLayout.from_dp_tokens([3, 4], 2, pcp_size=2**20)


def test_a_layout_past_the_ep_bound_is_refused_before_anything_is_allocated_for_it():
    # 10**9 built a 16 GB array for the layout before the library refused it;
    # 2**63 failed in ctypes with an OverflowError naming nothing.
    for tp in (10**9, 2**63, 2**64 - 1):
        with pytest.raises(am.InvalidArgumentError, match=f"tp_size {tp} exceeds the maximum of 1048576 EP ranks"):
            am.SpLayout.from_dp_tokens([3, 4], tp)
    assert am.SpLayout.from_dp_tokens([3, 4], 2**19).ep_size == 2**20


def test_a_layout_cannot_change_under_the_array_it_keeps():
    # An SpLayout hands the library a size_t[] built once; its sizes are read-only.
    layout = am.SpLayout([3, 1])
    with pytest.raises(AttributeError):
        layout.local_sizes = (1, 3)
    assert layout.local_sizes == (3, 1)
    assert am.shapes.maybe_pad_and_reduce(((4, 2), np.float32), layout, (1, 2)) == (1, 2)
    assert am.shapes.maybe_all_gather_and_maybe_unpad(((1, 2), np.float32), [3, 1], (1, 2)) == (4, 2)


def test_a_layout_rebuilt_every_call_is_asked_its_shape_once(monkeypatch):
    # An engine builds its layout anew for every forward. Layouts of equal sizes (SpLayouts or
    # plain lists) share one size_t[], so the table of output shapes, keyed by the array, holds
    # one entry for them instead of one per call; and when the table of arrays starts over,
    # every layout still hands the library its own sizes.
    import importlib

    from ascend_moe import shapes

    _lib = importlib.import_module("ascend_moe._lib")
    x = ((9, 2), np.float32)
    shapes.maybe_pad_and_reduce(x, am.SpLayout([4, 2, 3]), (2, 3))
    before = len(shapes._SHAPES)
    for _ in range(20):
        assert shapes.maybe_pad_and_reduce(x, am.SpLayout([4, 2, 3]), (2, 3)) == (3, 2)
        assert shapes.maybe_pad_and_reduce(x, [4, 2, 3], (2, 3)) == (3, 2)
    assert len(shapes._SHAPES) == before
    monkeypatch.setattr(_lib._SIZE_ARRAYS, "max", 2)
    for k in range(12):
        sizes = [k, 9 - k] if k <= 9 else [1, 8]
        layout = am.SpLayout(sizes) if k % 2 else sizes
        assert shapes.maybe_pad_and_reduce(x, layout, (1, 2)) == (sizes[1], 2), sizes
        assert shapes.maybe_all_gather_and_maybe_unpad(((sizes[0], 2), np.float32), layout, (0, 2)) == (9, 2), sizes
        assert len(_lib._SIZE_ARRAYS) <= 2


def test_a_layout_is_a_value():
    # Sent to another process (pickled), copied or used as a key, a layout is its sizes, and the
    # size_t[] a loaded copy hands the library holds them.
    import copy
    import pickle

    layout = am.SpLayout.from_dp_tokens([5, 2], 2)
    for other in (pickle.loads(pickle.dumps(layout)), copy.deepcopy(layout), copy.copy(layout)):
        assert other == layout and hash(other) == hash(layout) and other.local_sizes == (3, 3, 1, 1)
        assert am.shapes.maybe_pad_and_reduce(((8, 2), np.float32), other, (2, 4)) == (1, 2)
    loaded = pickle.loads(pickle.dumps(layout))
    arr, n = loaded._size_array
    assert (list(arr[:n]), n) == ([3, 3, 1, 1], 4)
    assert {layout: "a"}[am.SpLayout([3, 3, 1, 1])] == "a"
    assert am.SpLayout([3, 1]) != am.SpLayout([1, 3]) and len({am.SpLayout([3, 1]), am.SpLayout([3, 1])}) == 1


@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16])
def test_unpermute_keeps_dtype_and_gathers_rows(dtype):
    x = (np.arange(12, dtype=np.float32).reshape(4, 3) / 4).astype(dtype)
    idx = np.array([2, 0, 3, 1], np.int32)
    y = am.moe_token_unpermute(x, idx)
    assert y.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(y.astype(np.float32), x[idx].astype(np.float32))


def test_shapes_accept_meta_pairs_and_agree_with_ops():
    ex, idx = np.zeros((6, 4), np.float16), np.arange(6, dtype=np.int32)
    scales = np.ones((3, 2), np.float32)
    assert am.shapes.moe_finalize_routing(((6, 4), "float16"), ((6,), "int32"), scales=((3, 2), "float32")) == (3, 4)
    assert am.moe_finalize_routing(ex, idx, scales=scales).shape == (3, 4)
    assert am.shapes.maybe_pad_and_reduce(((8, 2), "float32"), am.SpLayout([3, 1, 0, 4]), (3, 4)) == (4, 2)
    assert am.shapes.maybe_pad_and_reduce(((8, 2), "float32"), None, (1, 4)) == (2, 2)
    assert am.shapes.maybe_all_gather_and_maybe_unpad(((0, 2), "bfloat16"), [3, 1, 0, 4], (2, 4)) == (8, 2)
    # The package's own DType names a dtype too; anything else is a DTypeError
    # (both raised numpy's TypeError).
    assert am.shapes.maybe_all_gather_and_maybe_unpad(((0, 2), am.DType.BF16), [3, 1, 0, 4], (2, 4)) == (8, 2)
    with pytest.raises(am.DTypeError, match="`x` has dtype <object"):
        am.shapes.maybe_pad_and_reduce(((8, 2), object()), None, (1, 4))
    with pytest.raises(am.AmoeError, match="expected 1 rows"):
        am.shapes.maybe_all_gather_and_maybe_unpad(((2, 2), "float32"), [3, 1, 0, 4], (1, 4))
    with pytest.raises(am.AmoeError, match="does not divide"):
        am.shapes.maybe_pad_and_reduce(((7, 2), "float32"), None, (0, 4))


def test_bad_inputs_raise_amoe_error_with_the_library_message():
    with pytest.raises(am.AmoeError, match="drop_pad_mode|drop-pad mode") as e:
        am.moe_finalize_routing(np.zeros((2, 2), np.float32), np.zeros(2, np.int32), drop_pad_mode=9)
    assert e.value.status == am.Status.INVALID_ARGUMENT
    with pytest.raises(am.AmoeError, match="bias") as e:
        am.moe_finalize_routing(np.zeros((2, 2), np.float32), np.zeros(2, np.int32), bias=np.zeros((1, 2), np.float32))
    with pytest.raises(am.AmoeError, match="float64"):
        am.all_reduce(np.zeros(3), None)


def test_integers_outside_the_c_arguments_range_are_refused_not_wrapped():
    # ctypes would pass them modulo 2**32 / 2**64: 2**32 + 2 as mode 2, 2**32 + 1 as MC2.
    x, idx = np.arange(12, dtype=np.float32).reshape(6, 2), np.array([0, 2, 4, 1, 3, 5], np.int32)
    scales = np.ones((3, 2), np.float32)
    for mode in (2**32 + 2, 2**32, -1):
        with pytest.raises(am.InvalidArgumentError, match=f"drop_pad_mode {mode} "):
            am.moe_finalize_routing(x, idx, scales=scales, drop_pad_mode=mode)
    policy = am.ReducePolicy("none", False, False, 1, 1)
    one = am.Comm.cpu(f"pytest-range-{uuid.uuid4().hex[:12]}", 1, 0)
    calls = {
        "comm_type": [
            lambda v: am.routed_is_reduced(v, False),
            policy.decisions,
            lambda v: policy.reduce_final(np.ones(2, np.float32), v, one),
            lambda v: am.shapes.token_prepare(((4, 2), "float32"), v, am.MoeContext([4], 1, 0, 0)),
        ],
        "tp_size": [
            lambda v: am.ReducePolicy("none", False, False, v, 4),
            lambda v: am.SpLayout.from_dp_tokens([4], v),
            lambda v: am.MoeContext([4], v, 0, 0),
        ],
        "ep_size": [lambda v: am.ReducePolicy("none", False, False, 1, v)],
        "op": [lambda v: am.all_reduce(np.ones(2, np.float32), one, v)],
        "root": [lambda v: am.broadcast(np.ones(2, np.float32), one, v)],
        "rank": [lambda v: am.Comm.cpu("pytest-range-never", 1, v)],
    }
    wide = {"comm_type": 2**32 + 1, "op": 2**32}
    for arg, fns in calls.items():
        for v in (-1, wide.get(arg, 2**64 + 2)):
            for f in fns:
                with pytest.raises(am.InvalidArgumentError, match=f"`{arg}` is {v}, outside 0..="):
                    f(v)
    for bad in ([2**64 + 4], [-1]):
        with pytest.raises(am.InvalidArgumentError, match="sizes must be in 0..="):
            am.SpLayout.from_dp_tokens(bad, 1)
    one.close()


def test_argument_errors_are_value_and_type_errors():
    # Raised by the library (its statuses mapped to the classes) and by the package.
    with pytest.raises(ValueError, match="drop_pad_mode|drop-pad mode") as e:
        am.moe_finalize_routing(np.zeros((2, 2), np.float32), np.zeros(2, np.int32), drop_pad_mode=9)
    assert isinstance(e.value, am.InvalidArgumentError) and isinstance(e.value, am.AmoeError)
    with pytest.raises(ValueError, match="expected 1 rows") as e:
        am.shapes.maybe_all_gather_and_maybe_unpad(((2, 2), "float32"), [3, 1, 0, 4], (1, 4))
    assert isinstance(e.value, am.ShapeError) and e.value.status is am.Status.SHAPE
    with pytest.raises(TypeError, match="float64") as e:
        am.all_reduce(np.zeros(3), None)
    assert isinstance(e.value, am.DTypeError) and e.value.status is am.Status.DTYPE


def test_non_native_byte_order_is_refused_not_misread():
    # numpy names '>f4' float32 as well; the library would read its bytes as
    # little-endian floats. A native call first, so the dtype is already known.
    x, idx = np.arange(8, dtype=np.float32).reshape(4, 2), np.array([2, 0, 3, 1], np.int32)
    y = am.moe_token_unpermute(x, idx)
    np.testing.assert_array_equal(y, x[[2, 0, 3, 1]])
    with pytest.raises(TypeError, match=r"`permuted` has dtype float32 in non-native byte order \(>f4\)") as e:
        am.moe_token_unpermute(x.astype(">f4"), idx)
    assert isinstance(e.value, am.DTypeError)
    with pytest.raises(TypeError, match="`sorted_indices` .* non-native byte order"):
        am.moe_token_unpermute(x, idx.astype(">i4"))
    with pytest.raises(TypeError, match="`out` .* non-native byte order"):
        am.moe_token_unpermute(x, idx, out=np.zeros((4, 2), ">f4"))
    np.testing.assert_array_equal(am.moe_token_unpermute(x.astype("<f4"), idx), y)
    with pytest.raises(ValueError, match="unknown MoE comm type 7"):
        am.routed_is_reduced(7, False)
    with pytest.raises(ValueError, match="unknown reduce op 'prod' \\(expected one of sum, max, min\\)"):
        am.all_reduce(np.zeros(3, np.float32), None, op="prod")


def test_descriptors_of_earlier_calls_never_describe_other_memory(monkeypatch):
    # The package keeps the C descriptors it built, by pointer, shape, dtype
    # and device. The same memory seen with another dtype, byte order or
    # shape must get its own descriptor, as must new memory at another address.
    from ascend_moe import _tensor

    buf = np.arange(8, dtype=np.float32)
    x, idx = buf.reshape(4, 2), np.array([2, 0, 3, 1], np.int32)
    np.testing.assert_array_equal(am.moe_token_unpermute(x, idx), x[[2, 0, 3, 1]])
    with pytest.raises(am.DTypeError, match="`permuted` has dtype i32, expected f32"):
        am.moe_token_unpermute(x.view(np.int32), idx)
    with pytest.raises(am.DTypeError, match=r"non-native byte order \(>f4\)"):
        am.moe_token_unpermute(x.view(x.dtype.newbyteorder()), idx)
    wide = buf.reshape(2, 4)  # the same address and dtype, another shape
    np.testing.assert_array_equal(am.moe_token_unpermute(wide, idx[:2] // 2), wide[[1, 0]])
    half = x.view(np.float16)  # same address, [4, 4] float16
    np.testing.assert_array_equal(am.moe_token_unpermute(half, idx), half[[2, 0, 3, 1]])
    out = np.full((4, 2), -1, np.float32)
    am.moe_token_unpermute(x, idx, out=out)
    with pytest.raises(am.ShapeError, match=r"`out` has shape \[2, 4\], the op's output is \[4, 2\]"):
        am.moe_token_unpermute(x, idx, out=out.reshape(2, 4))
    # A full table starts over; every call after it still reads its own arrays.
    monkeypatch.setattr(_tensor._CORES, "max", 3)
    for k in range(6):
        xk = np.arange(4 * (k + 1), dtype=np.float32).reshape(4, k + 1) + 10 * k  # a shape not seen before
        np.testing.assert_array_equal(am.moe_token_unpermute(xk, idx), xk[[2, 0, 3, 1]])
        assert len(_tensor._CORES) <= 3

def test_finalize_args_of_earlier_calls_never_describe_other_operands(monkeypatch):
    # The package keeps each finalize's argument struct, by the descriptors it
    # holds, and the library's answer for its output shape, by the struct. The same memory seen with another shape, an
    # optional input added or dropped, another mode, and a full table that
    # starts over must each describe the call's own operands.
    from ascend_moe import shapes
    from workers import assert_close, finalize_golden

    monkeypatch.setattr(shapes._FINALIZE_ARGS, "max", 4)
    monkeypatch.setattr(shapes._SHAPES, "max", 4)
    rng = np.random.default_rng(7)
    buf = rng.standard_normal(4 * 6 * 8).astype(np.float32)  # every expanded_x is a view of it
    scales_buf = rng.standard_normal(4 * 6).astype(np.float32)
    x1_buf = rng.standard_normal(6 * 8).astype(np.float32)
    for n, k, h in [(6, 4, 8), (4, 6, 8), (6, 4, 2), (2, 3, 8), (6, 4, 8), (3, 1, 4), (4, 6, 8), (6, 4, 8)]:
        ex = buf[: n * k * h].reshape(n * k, h)
        scales = scales_buf[: n * k].reshape(n, k)
        x1 = x1_buf[: n * h].reshape(n, h)
        for mode in (0, 2):
            idx = rng.permutation(n * k).astype(np.int32)
            for kw in ({"scales": scales}, {"scales": scales, "x1": x1}, {"x1": x1} if k == 1 else {"scales": scales}):
                got = am.moe_finalize_routing(ex, idx, drop_pad_mode=mode, **kw)
                want = finalize_golden(ex, idx, kw.get("x1"), None, None, kw.get("scales"), None, mode)
                assert_close(got, want, np.float32, f"N {n} K {k} H {h} mode {mode} {sorted(kw)}")
                assert am.shapes.moe_finalize_routing(ex, idx, drop_pad_mode=mode, **kw) == (n, h)
        assert len(shapes._FINALIZE_ARGS) <= 4 and len(shapes._SHAPES) <= 4
    with pytest.raises(am.ShapeError):
        am.moe_finalize_routing(buf[:48].reshape(6, 8), np.arange(6, dtype=np.int32), scales=scales_buf[:12].reshape(4, 3))


def test_finalize_args_of_freed_descriptors_are_never_found_again():
    # A descriptor over an unhashable shape (symbolic sizes: torch's SymInts
    # while tracing) is built for one call and freed after it. The struct of
    # that call is cached by its pointers' identities; were the entry not to
    # hold them, the next call's pointer could be allocated where the freed
    # one was, find the old struct and be answered with the old operands.
    # `spare` objects freed just before the second call take the places the
    # new descriptor allocates first, so its pointer object is next in line.
    import ctypes

    class Dim:  # an int the shape tuple cannot hash, as a SymInt
        __hash__ = None

        def __init__(self, n):
            self.n = n

        def __index__(self):
            return self.n

    idx = ((6,), "int32")
    for pad in range(5):
        for first, second in ((4, 8), (8, 4)):
            spare = [ctypes.c_size_t() for _ in range(pad)]
            assert am.shapes.moe_finalize_routing(((Dim(6), first), "float32"), idx) == (6, first)
            del spare
            got = am.shapes.moe_finalize_routing(((Dim(6), second), "float32"), idx)
            assert got == (6, second), f"{pad} spare objects: hidden {second} answered as {got}"


def test_array_addresses_are_the_arrays_own_memory():
    # The data pointer comes through the buffer protocol where numpy exports
    # one and from `ctypes.data` where it does not; both must name the first
    # element, whatever the dtype, offset or writability.
    from ascend_moe._tensor import _address

    base = np.arange(64, dtype=np.float32)
    ro = np.frombuffer(base.tobytes(), np.float32)  # read-only
    cases = {
        "f32": base,
        "bf16": base.astype(ml_dtypes.bfloat16),
        "f16 offset view": base.astype(np.float16)[5:37],
        "int8 offset view": base.astype(np.int8)[3:],
        "read-only": ro,
        "read-only bf16 offset": ro.astype(ml_dtypes.bfloat16)[9:],
        "empty": base[:0],
        "0-d": np.array(3.0, np.float32),
        "0-d bf16": np.array(3.0, ml_dtypes.bfloat16),
    }
    cases["read-only bf16 offset"].flags.writeable = False
    for name, a in cases.items():
        assert a.flags.c_contiguous, name
        assert _address(a) == a.ctypes.data, name
    # And ops read them: a read-only bfloat16 input at an offset, a writable one.
    idx = np.array([2, 0, 3, 1], np.int32)
    x = np.arange(16, dtype=np.float32).astype(ml_dtypes.bfloat16)[8:].reshape(4, 2)
    x.flags.writeable = False
    np.testing.assert_array_equal(am.moe_token_unpermute(x, idx), x[[2, 0, 3, 1]])
    out = np.empty((4, 2), ml_dtypes.bfloat16)[:]
    np.testing.assert_array_equal(am.moe_token_unpermute(x.copy(), idx, out=out), x[[2, 0, 3, 1]])


def test_comm_lifecycle_in_threads():
    """Two threads of one process as ranks; ctypes releases the GIL in calls."""
    name = f"pytest-threads-{uuid.uuid4().hex[:12]}"
    out, errs = {}, []

    def rank_main(rank):
        try:
            with am.Comm.cpu(name, 2, rank, timeout_s=20) as c:
                assert (c.rank, c.world_size) == (rank, 2)
                with c.split([1, 0]) as sub:  # reversed order: new rank = position in list
                    assert sub.rank == 1 - rank
                    out[rank] = am.all_gather(np.full((1, 2), rank, np.int32), sub)
            with pytest.raises(am.AmoeError, match="closed"):
                c.rank
        except BaseException as e:  # noqa: BLE001
            errs.append(e)

    ts = [threading.Thread(target=rank_main, args=(r,)) for r in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not errs, errs
    np.testing.assert_array_equal(out[0], np.array([[1, 1], [0, 0]], np.int32))
    np.testing.assert_array_equal(out[1], out[0])


def test_comm_timeouts_read_as_the_c_abi_reads_them():
    """`timeout_s` goes to the C ABI as given: 0, negative and NaN the
    default, inf no limit, under 1 ns refused naming `timeout_s`."""
    for t in [0, 0.0, -1.0, float("nan"), float("inf"), 1e300, 1e-9, 5]:
        with am.Comm.cpu(f"pytest-timeout-{uuid.uuid4().hex[:12]}", 1, 0, timeout_s=t) as c:
            assert c.world_size == 1
    for t, why in [(1e-12, "least timeout, 1 ns"), (1e-300, "least timeout, 1 ns")]:
        with pytest.raises(am.AmoeError) as e:
            am.Comm.cpu(f"pytest-timeout-{uuid.uuid4().hex[:12]}", 1, 0, timeout_s=t)
        assert e.value.status == am.Status.INVALID_ARGUMENT, e.value
        assert "`timeout_s`" in str(e.value) and why in str(e.value), e.value


def test_from_hccl_is_unavailable_without_the_npu_backend():
    # As an int, and as the ctypes pointer vLLM-Ascend's PyHcclCommunicator.comm is.
    for raw in (0x1234, ctypes.c_void_p(0x1234)):
        with pytest.raises(am.AmoeError) as e:
            am.Comm.from_hccl(raw, 0)
        assert e.value.status == am.Status.UNAVAILABLE, raw


def test_comm_types_by_name_are_parsed_and_non_integers_refused():
    """`"mc2"` is CommType.MC2 wherever a comm type is taken; a float is an
    error naming the argument, never truncated (1.7 used to run as 1)."""
    from ascend_moe import ops

    policy = ops.ReducePolicy("none", False, False, 1, 1)
    assert ops.routed_is_reduced("mc2", False) == ops.routed_is_reduced(am.CommType.MC2, False)
    assert policy.decisions("alltoall") == policy.decisions(am.CommType.ALLTOALL)
    with pytest.raises(am.AmoeError, match="unknown comm type 'mc3'"):
        ops.routed_is_reduced("mc3", False)
    for bad in (1.7, 1.0, "1.5"):
        with pytest.raises(am.AmoeError) as e:
            ops.routed_is_reduced(bad, False)
        assert e.value.status == am.Status.INVALID_ARGUMENT and "comm" in str(e.value), e.value
    with pytest.raises(am.AmoeError, match=r"`world_size` is 2.5, expected an integer"):
        am.Comm.cpu("api-float-world", 2.5, 0)


def test_non_integer_counts_ranks_and_modes_are_refused_not_truncated():
    """A float, a numpy float or a string where a count, rank, mode or id is
    taken is an `InvalidArgumentError` naming the argument: `int(...)` would
    run 2.7 as 2."""
    from ascend_moe.forward import ForwardContext, MoeLayer

    x, idx = np.arange(12, dtype=np.float32).reshape(6, 2), np.array([0, 2, 4, 1, 3, 5], np.int32)
    one = am.Comm.cpu(f"pytest-index-{uuid.uuid4().hex[:12]}", 1, 0)
    groups = am.MoeGroups(one, 1)
    layer = MoeLayer(groups, one, 1, 0, 0, experts=lambda h, m, c: h)
    calls = {
        "drop_pad_mode": [
            lambda v: am.moe_finalize_routing(x, idx, scales=np.ones((3, 2), np.float32), drop_pad_mode=v),
            lambda v: am.shapes.moe_finalize_routing(x, idx, scales=np.ones((3, 2), np.float32), drop_pad_mode=v),
        ],
        "local_sizes": [
            lambda v: am.SpLayout([v, 3]),
            lambda v: am.maybe_pad_and_reduce(x, [v, 3], one),
            lambda v: am.shapes.maybe_all_gather_and_maybe_unpad(x, [v], (0, 1)),
        ],
        "num_tokens_across_dp": [lambda v: am.SpLayout.from_dp_tokens([v, 2], 1)],
        "dp_tokens": [
            lambda v: am.MoeContext([v], 1, 0, 0),
            lambda v: ForwardContext(am.CommType.ALLGATHER, (v,)),
        ],
        "num_tokens": [
            lambda v: am.shared_gather_unpad(x, v, one),
            lambda v: am.shapes.shared_gather_unpad(x, v, one),
        ],
        "pcp_size": [lambda v: ForwardContext(am.CommType.ALLGATHER, (4,), pcp_size=v)],
        "num_actual_tokens": [lambda v: ForwardContext(am.CommType.ALLGATHER, (4,), num_actual_tokens=v)],
        "tp_size": [lambda v: MoeLayer(groups, one, v, 0, 0, experts=print)],
        "tp_rank": [lambda v: MoeLayer(groups, one, 1, 0, v, experts=print)],
        "layer_id": [MoeLayer.lookup],
        "handle_id": [am.Comm.lookup],
        "ranks": [lambda v: one.split([v])],
        "device_ordinal": [lambda v: am.Comm.from_hccl(0x1234, v)],
    }
    for arg, fns in calls.items():
        for v in (2.7, np.float64(0.0), "3"):
            for f in fns:
                with pytest.raises(am.InvalidArgumentError, match=f"`{arg}` is {re.escape(repr(v))}, expected an integer"):
                    f(v)
    # A comm type is a member, its number or its name, as every op takes it:
    # a float is no number, and "3" is no name.
    for v in (2.7, np.float64(0.0)):
        with pytest.raises(am.InvalidArgumentError, match=f"`comm_type` is {re.escape(repr(v))}, expected an integer"):
            ForwardContext(v, (4,))
    with pytest.raises(am.InvalidArgumentError, match="unknown comm type '3'"):
        ForwardContext("3", (4,))
    # An id with a fraction never finds the layer or communicator it truncates to.
    with pytest.raises(am.InvalidArgumentError, match="`layer_id` is .*, expected an integer"):
        MoeLayer.lookup(layer.layer_id + 0.5)
    with pytest.raises(am.InvalidArgumentError, match="`handle_id` is .*, expected an integer"):
        am.Comm.lookup(one.handle_id + 0.5)
    # Enum arguments name their kind: a float is no member, whatever its fraction.
    for v in (1.7, np.float64(1.0)):
        with pytest.raises(am.InvalidArgumentError, match="unknown shared mode"):
            am.ReducePolicy(v, False, False, 1, 1)
    # Integers of every kind are still taken as they are.
    assert am.SpLayout([np.int64(3), True]).local_sizes == (3, 1)
    assert ForwardContext(np.int32(1), (np.uint8(4),), pcp_size=np.int64(2)).pcp_size == 2
    assert am.ReducePolicy(np.int64(1), False, False, 1, 1).shared_mode == 1
    layer.close()
    groups.close()
    one.close()


def test_shape_dims_outside_size_t_are_refused_naming_the_argument():
    """ctypes stores a dim of -1 as SIZE_MAX and one of 2**64 as 0 without a
    word (2**64 rows were sized as 0); such a dim, or one that is no integer,
    is a ShapeError naming the operand."""
    idx = ((4,), "int32")
    for dim in (-1, 2**64, 2**64 + 4, 2**65, 2.5):
        for arg, f in (
            ("permuted", lambda d: am.shapes.moe_token_unpermute(((d, 2), "float32"), idx)),
            ("sorted_indices", lambda d: am.shapes.moe_token_unpermute(((4, 2), "float32"), ((d,), "int32"))),
            ("x", lambda d: am.shapes.maybe_pad_and_reduce(((d, 2), "float32"), None, (0, 1))),
            ("x", lambda d: am.shapes.all_gather(((2, d), "float32"), (0, 2))),
            ("x", lambda d: am.shapes.reduce_final(((d,), "float32"))),
        ):
            with pytest.raises(am.ShapeError, match=f"`{arg}` has shape .*whose dims must be"):
                f(dim)
    # The largest size_t dim is a dim: the library sizes it (and names the overflow).
    assert am.shapes.all_reduce(((2**64 - 1, 0), "float32")) == (2**64 - 1, 0)


def test_collective_shapes_of_more_bytes_than_size_t_holds_are_refused():
    """The shape functions of the plain collectives, which never ask the
    library, refuse an operand (or all_gather's output) whose size in bytes
    overflows a size_t, as the library refuses it in every other shape
    function: all_gather of 2**62 f32 rows on 4 ranks gave 2**64 rows."""
    huge = ((2**62, 1), "float32")  # 2**64 bytes
    for arg, f in (
        ("x", lambda: am.shapes.all_gather(huge, (0, 4))),
        ("x", lambda: am.shapes.all_reduce(huge)),
        ("x", lambda: am.shapes.reduce_scatter(huge, (0, 4))),
        ("x", lambda: am.shapes.reduce_final(huge)),
        # x fits (2**63 bytes); the gathered output would hold 2**65.
        ("out", lambda: am.shapes.all_gather(((2**61, 1), "float32"), (0, 4))),
    ):
        with pytest.raises(am.ShapeError, match=f"`{arg}` has shape .*whose size in bytes overflows"):
            f()
    # The library's own shape function says the same of the plain all-gather.
    with pytest.raises(am.ShapeError, match="`x` has shape .*whose size in bytes overflows"):
        am.shapes.maybe_all_gather_and_maybe_unpad(huge, None, (0, 4))
    # A gathered output that fits (2**63 bytes) is a shape.
    assert am.shapes.all_gather(((2**59, 1), "float32"), (0, 4)) == (2**61, 1)


def test_wrong_objects_as_comm_groups_or_context_are_named():
    """An int, None, a handle id or another class where a communicator,
    groups or a context is taken is an `InvalidArgumentError` naming the
    argument, not an AttributeError / TypeError from inside the call."""
    from ascend_moe.forward import ForwardContext, MoeLayer, set_forward_context

    x = np.ones((4, 2), np.float32)
    one = am.Comm.cpu(f"pytest-handles-{uuid.uuid4().hex[:12]}", 1, 0)
    groups = am.MoeGroups(one, 1)
    ctx = am.MoeContext([4], 1, 0, 0)
    policy = am.ReducePolicy("none", False, False, 1, 1)
    fctx = ForwardContext(am.CommType.ALLGATHER, (4,))
    layer = MoeLayer(groups, one, 1, 0, 0, experts=lambda h, m, c: h, policy=policy)
    calls = {
        "comm": [
            lambda v: am.all_reduce(x, v),
            lambda v: am.reduce_scatter(x, v),
            lambda v: am.all_gather(x, v),
            lambda v: am.broadcast(x, v),
            lambda v: am.shapes.all_gather(x, v),
        ],
        "ep_comm": [
            lambda v: am.maybe_pad_and_reduce(x, None, v),
            lambda v: am.maybe_all_gather_and_maybe_unpad(x, None, v),
            lambda v: am.finalize_and_reduce(x, np.arange(4, dtype=np.int32), None, v),
        ],
        "tp_comm": [
            lambda v: am.shared_pad_split(x, v),
            lambda v: am.shared_gather_unpad(x, 4, v),
            lambda v: policy.reduce_final(x, "allgather", v),
            lambda v: MoeLayer(groups, v, 1, 0, 0, experts=lambda h, m, c: h),
        ],
        "ep": [lambda v: am.shapes.maybe_pad_and_reduce(x, None, v)],
        "tp": [lambda v: am.shapes.shared_pad_split(x, v), lambda v: am.MoeGroups.from_comms(one, v, one)],
        "world": [lambda v: am.MoeGroups(v, 1)],
        "groups": [
            lambda v: am.token_prepare(x, "allgather", ctx, v),
            lambda v: am.token_finalize(x, "allgather", ctx, v),
            lambda v: MoeLayer(v, one, 1, 0, 0, experts=lambda h, m, c: h),
        ],
        "ctx": [
            lambda v: am.token_prepare(x, "allgather", v, groups),
            lambda v: am.token_finalize(x, "allgather", v, groups),
            lambda v: am.shapes.token_prepare(x, "allgather", v),
            lambda v: am.shapes.token_finalize(x, "allgather", v),
            lambda v: set_forward_context(v),
            lambda v: layer.context(v),
            lambda v: layer.checked_policy(v),
        ],
    }
    wrong = {  # by argument; a (rank, world_size) pair is an `ep` / `tp` of the shape functions
        "ep": (3, None, groups),
        "tp": (3, None, groups),
        "groups": (3, None, one),
        "ctx": (3, "allgather", one),  # None is the live context where a ForwardContext is taken
    }
    for arg, fns in calls.items():
        for v in wrong.get(arg, (3, None, one.handle_id, groups)):
            for f in fns:
                with pytest.raises(am.InvalidArgumentError, match=f"`{arg}` must be a .*, got {type(v).__name__}"):
                    f(v)
    for f in calls["ctx"][:4]:
        with pytest.raises(am.InvalidArgumentError, match="`ctx` must be a MoeContext, got NoneType"):
            f(None)
    # A MoeContext is no ForwardContext, nor the reverse.
    with pytest.raises(am.InvalidArgumentError, match="`ctx` must be a ForwardContext, got MoeContext"):
        layer.context(ctx)
    with pytest.raises(am.InvalidArgumentError, match="`ctx` must be a MoeContext, got ForwardContext"):
        am.token_prepare(x, "allgather", fctx, groups)
    # A layer is checked when it is registered, its experts too.
    with pytest.raises(am.InvalidArgumentError, match="`experts` must be callable, got int"):
        MoeLayer(groups, one, 1, 0, 0, experts=3)
    set_forward_context(None)
    layer.close()
    groups.close()
    one.close()


def test_an_mc2_mask_that_is_no_array_is_named():
    """`mc2_mask` is memory the op writes: a list, a scalar or a string is
    an `InvalidArgumentError` naming it (under every comm type), where an
    AttributeError on `.shape` used to come out."""
    x = np.arange(8, dtype=np.float32).reshape(4, 2)
    with am.Comm.cpu(f"pytest-mask-{uuid.uuid4().hex[:12]}", 1, 0) as one, am.MoeGroups(one, 1) as groups:
        ctx = am.MoeContext([4], 1, 0, 0, num_actual_tokens=3)
        for mask in ([True, True, True, False], (1, 1, 1, 0), 3, True, "mask"):
            for ct in ("mc2", "fused_mc2", "allgather"):
                with pytest.raises(am.InvalidArgumentError, match=f"`mc2_mask` must be .*got {type(mask).__name__}"):
                    am.token_prepare(x, ct, ctx, groups, mc2_mask=mask)
        mask = np.zeros(4, np.uint8)
        hidden, got = am.token_prepare(x, "mc2", ctx, groups, mc2_mask=mask)
        assert got is mask and mask.tolist() == [1, 1, 1, 0]
        np.testing.assert_array_equal(hidden, x)


def test_set_allocator_needs_both_callbacks():
    """Half an allocator would hand the library's frees to nothing: the device
    memory it allocated would leak without a word."""
    for kw, arg in (({"alloc": lambda n, s: 0}, "free"), ({"free": lambda p, n, s: None}, "alloc")):
        with pytest.raises(am.AmoeError, match=f"`{arg}` is NoneType, expected a callable") as e:
            am.set_allocator(None, **kw)
        assert e.value.status == am.Status.INVALID_ARGUMENT
    with pytest.raises(am.AmoeError, match="`free` is int"):
        am.set_allocator(None, alloc=lambda n, s: 0, free=0)


def test_the_package_is_typed():
    # PEP 561: the marker ships in the package (CI runs this against the installed wheel).
    assert (Path(am.__file__).resolve().parent / "py.typed").is_file()


def test_a_handle_closed_under_a_running_call_is_freed_when_the_call_returns(monkeypatch):
    """`close()` from one thread while another thread's call holds the handle
    (a collective waiting for its peer) frees nothing under that call: new
    calls are refused at once, the running one completes, and the handle is
    freed when it returns, once."""
    comm_mod, lib_mod = sys.modules["ascend_moe.comm"], sys.modules["ascend_moe._lib"]

    freed = []
    real_free = lib_mod.Owned._free
    monkeypatch.setattr(lib_mod.Owned, "_free", lambda self, h: (freed.append(type(self).__name__), real_free(self, h)))
    name = f"pytest-lease-{uuid.uuid4().hex[:12]}"
    comms = [None, None]

    def join(r):
        comms[r] = am.Comm.cpu(name, 2, r)

    t = threading.Thread(target=join, args=(1,))
    t.start()
    join(0)
    t.join()
    c0, c1 = comms
    # Rank 0 waits in a barrier for rank 1 while the main thread closes it.
    entered, result = threading.Event(), []
    real_call = comm_mod.call

    def call(fn, *args):
        if fn == "amoe_barrier" and threading.current_thread() is not threading.main_thread():
            entered.set()
        return real_call(fn, *args)

    monkeypatch.setattr(comm_mod, "call", call)

    def barrier0():
        try:
            c0.barrier()
            result.append("ok")
        except Exception as e:  # noqa: BLE001
            result.append(e)

    t = threading.Thread(target=barrier0)
    t.start()
    assert entered.wait(60)
    c0.close()
    assert freed == [], "the handle was freed under the running barrier"
    with pytest.raises(am.InvalidArgumentError, match="the communicator is closed"):
        c0.barrier()
    c1.barrier()  # rank 1 arrives: rank 0's barrier completes on its held handle
    t.join()
    assert result == ["ok"], result
    assert freed == ["Comm"], freed
    c0.close()
    assert freed == ["Comm"], "closed twice, freed twice"
    # The same for MoE groups, with a lease held by hand.
    alone = c1.split([1])
    groups = am.MoeGroups(alone, 1)
    lease = groups.handle
    groups.close()
    assert freed == ["Comm"]
    with pytest.raises(am.InvalidArgumentError, match="the MoE groups are closed"):
        groups.handle
    del lease
    assert freed == ["Comm", "MoeGroups"], freed
    alone.close()
    c1.close()


def test_leaving_a_forward_context_restores_the_contexts_of_its_entry():
    from ascend_moe import CommType as CT

    am.set_forward_context(am.ForwardContext(CT.ALLGATHER, [8]))
    try:
        # The body sets the next step's context, or clears it: leaving the
        # `with` restores the one set before it, never pops another.
        for inside in (am.ForwardContext(CT.ALLTOALL, [2]), None):
            with am.forward_context(CT.MC2, [4]) as ctx:
                assert am.get_forward_context() is ctx
                with am.forward_context(CT.ALLTOALL, [3]):
                    am.set_forward_context(inside)
                assert am.get_forward_context() is ctx
                am.set_forward_context(inside)
            got = am.get_forward_context()
            assert (got.comm_type, tuple(got.dp_tokens)) == (CT.ALLGATHER, (8,))
        # An error in the body is the error raised, the context restored.
        with pytest.raises(KeyError, match="body"):
            with am.forward_context(CT.MC2, [4]):
                am.set_forward_context(None)
                raise KeyError("body")
        assert am.get_forward_context().comm_type == CT.ALLGATHER
    finally:
        am.set_forward_context(None)
    with am.forward_context(CT.MC2, [4]):
        pass
    with pytest.raises(am.InvalidArgumentError, match="no MoE forward context"):
        am.get_forward_context()


def test_library_errors_survive_pickling_as_a_worker_process_sends_them():
    import copy
    import pickle

    with pytest.raises(am.IndexOutOfRangeError) as info:
        am.moe_finalize_routing(np.ones((4, 3), np.float32), np.array([0, 1, 2, 99], np.int32))
    err = info.value
    err.layer = 3  # an attribute a caller added (as `add_note` adds `__notes__`)
    for back in (pickle.loads(pickle.dumps(err)), copy.deepcopy(err)):
        assert type(back) is am.IndexOutOfRangeError and isinstance(back, ValueError)
        assert (back.status, back.message, str(back)) == (err.status, err.message, str(err))
        assert back.layer == 3


def test_one_integer_where_a_list_of_sizes_belongs_names_the_argument():
    calls = {
        "dp_tokens": lambda: am.ForwardContext(am.CommType.MC2, dp_tokens=8),
        "local_sizes": lambda: am.SpLayout(4),
        "num_tokens_across_dp": lambda: am.SpLayout.from_dp_tokens(8, 2),
    }
    for arg, call in calls.items():
        with pytest.raises(am.InvalidArgumentError, match=f"`{arg}` is 8|`{arg}` is 4"):
            call()
    with pytest.raises(am.InvalidArgumentError, match="`local_sizes` is '12', expected a sequence of integers"):
        am.SpLayout("12")
    with am.Comm.cpu(f"api-scalar-{uuid.uuid4().hex[:8]}", 1, 0) as c:
        with pytest.raises(am.InvalidArgumentError, match="`local_sizes` is 4, expected a sequence"):
            am.maybe_pad_and_reduce(np.ones((4, 2), np.float32), 4, c)
        # The world still works.
        assert am.all_reduce(np.array([2.0], np.float32), c).tolist() == [2.0]


def test_a_world_name_with_a_nul_is_refused_not_cut_short():
    # The C string would end at the NUL: "job\0a" and "job\0b" would join one world.
    with pytest.raises(am.InvalidArgumentError, match="`name` 'job\\\\x00a' holds a NUL character"):
        am.Comm.cpu("job\0a", 1, 0)
