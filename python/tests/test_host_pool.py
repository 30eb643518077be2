"""Large outputs allocated by the package come from the library's host pool
(`amoe_host_block_new`): a result's memory is handed out again only after the
last array, view or torch tensor over it is gone, and a reused block is
written entirely by the op."""

import ctypes

import ml_dtypes
import numpy as np
import pytest

import ascend_moe as am
from ascend_moe import _tensor
from ascend_moe._lib import last_error, lib
from workers import assert_close, finalize_case, finalize_golden, rng_for

BF16 = np.dtype(ml_dtypes.bfloat16)
MIN = lib().amoe_host_block_min_len()


def _big_case(seed, dtype):
    """A finalize whose [N, H] output is above the pooled size (x1 only, so
    the reference is cheap)."""
    n, h = 256, MIN // 256 // dtype.itemsize + 8
    ex, idx, kw = finalize_case(rng_for("host-pool", seed), 2, dtype, n=n, k=2, h=(h,), x2=False, bias=False)
    want = finalize_golden(ex, idx, kw["x1"], kw["x2"], kw["bias"], kw["scales"], kw["expert_idx"], 2)
    return ex, idx, kw, want


def _addr(a):
    return a.__array_interface__["data"][0]


@pytest.mark.parametrize("dtype", [np.dtype(np.float32), BF16], ids=str)
def test_a_held_result_is_never_reused_and_a_dropped_one_is(dtype):
    ex, idx, kw, want = _big_case(1, dtype)
    ex2, idx2, kw2, want2 = _big_case(2, dtype)
    a = am.moe_finalize_routing(ex, idx, **kw)
    assert a.nbytes >= MIN
    b = am.moe_finalize_routing(ex2, idx2, **kw2)
    assert not np.shares_memory(a, b)
    assert_close(a, want, dtype, "the held result after another call")
    assert_close(b, want2, dtype, "the second result")
    # A view keeps the block: the next result may not take it.
    view = a[100:]
    old = _addr(a)
    del a
    c = am.moe_finalize_routing(ex2, idx2, **kw2)
    assert not np.shares_memory(view, c)
    assert_close(view, want[100:], dtype, "a view of a dropped result")
    assert_close(c, want2, dtype, "a result while a view of another lives")
    # Once the view goes too, the block serves the next output of its size,
    # which the op writes entirely.
    del view
    d = am.moe_finalize_routing(ex, idx, **kw)
    assert _addr(d) == old, "a dropped block was not reused"
    assert_close(d, want, dtype, "a result in a reused block")


def test_small_outputs_are_ordinary_numpy_arrays():
    x = np.arange(12, dtype=np.float32)
    with am.Comm.cpu("host-pool-small", 1, 0) as c:
        y = am.all_reduce(x, c)
    assert y.base is None or isinstance(y.base, np.ndarray)
    np.testing.assert_array_equal(y, x)


def test_collective_results_use_the_pool_and_stay_correct():
    n = MIN // 4 + 1024
    x = np.arange(n, dtype=np.float32)
    with am.Comm.cpu("host-pool-coll", 1, 0) as c:
        r1 = am.all_reduce(x, c)
        r2 = am.all_gather(x * 2, c)
        assert not np.shares_memory(r1, r2)
        np.testing.assert_array_equal(r1, x)
        np.testing.assert_array_equal(r2, x * 2)
        old = _addr(r1)
        del r1
        r3 = am.all_reduce(x + 1, c)
        assert _addr(r3) == old
        np.testing.assert_array_equal(r3, x + 1)


def test_host_block_arguments_are_checked():
    lb = lib()
    data, out = ctypes.c_void_p(), ctypes.c_void_p()
    assert lb.amoe_host_block_new(0, ctypes.byref(data), ctypes.byref(out)) == am.Status.INVALID_ARGUMENT
    assert "at least one byte" in last_error()
    assert lb.amoe_host_block_new(64, None, ctypes.byref(out)) == am.Status.NULL_ARGUMENT
    assert lb.amoe_host_block_new(64, ctypes.byref(data), None) == am.Status.NULL_ARGUMENT
    assert lb.amoe_host_block_new(MIN, ctypes.byref(data), ctypes.byref(out)) == am.Status.OK
    assert data.value % (2 << 20) == 0
    lb.amoe_host_block_free(out)
    lb.amoe_host_block_free(None)


torch = pytest.importorskip("torch") if am.TORCH_OPS else None


@pytest.mark.skipif(not am.TORCH_OPS, reason="torch not importable")
def test_torch_cpu_results_come_from_the_pool_and_views_keep_them():
    from torch_workers import to_torch

    ex, idx, kw, want = _big_case(3, np.dtype(np.float32))
    tex, tidx = to_torch(ex), to_torch(idx)
    tkw = {k: (to_torch(v) if isinstance(v, np.ndarray) else v) for k, v in kw.items()}
    a = am.moe_finalize_routing(tex, tidx, **tkw)
    assert isinstance(a, torch.Tensor) and a.dtype == torch.float32 and tuple(a.shape) == want.shape
    view = a[10:]
    ptr = a.data_ptr()
    del a
    b = am.moe_finalize_routing(tex, tidx, **tkw)
    assert b.data_ptr() != ptr, "a block a torch view still uses was reused"
    assert_close(np.array(view.tolist()), want[10:], np.float32, "a torch view of a dropped result")
    del view
    c = am.moe_finalize_routing(tex, tidx, **tkw)
    assert c.data_ptr() == ptr, "a dropped torch result's block was not reused"
    assert_close(np.array(c.tolist()), want, np.float32, "a torch result in a reused block")
    assert torch.equal(b, c)


def test_host_empty_gives_the_shape_and_dtype_asked_for():
    a = _tensor.host_empty((3, MIN // 6 + 5), BF16)
    assert a.shape == (3, MIN // 6 + 5) and a.dtype == BF16 and a.flags.c_contiguous and a.flags.writeable
    b = _tensor.host_empty((2, 3), np.float32)
    assert b.shape == (2, 3) and b.dtype == np.float32


def test_a_block_that_cannot_be_had_is_a_clear_error(monkeypatch):
    import gc
    import sys

    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    with pytest.raises(MemoryError, match=f"{1 << 62} bytes of host memory could not be allocated") as e:
        _tensor._HostBlock(1 << 62)
    assert isinstance(e.value, am.HostMemoryError) and e.value.status is am.Status.HOST_MEMORY
    # Past size_t: ctypes passed it modulo 2**64 (2**64 as 0, "at least one
    # byte"; 2**64 + 4 as a 4-byte block).
    for n in (1 << 64, (1 << 64) + 4, 1 << 82):
        with pytest.raises(am.HostMemoryError, match=f"{n} bytes of host memory could not be allocated"):
            _tensor._HostBlock(n)
    with pytest.raises(am.HostMemoryError, match=f"{1 << 82} bytes"):
        _tensor.host_empty((1 << 40, 1 << 40), np.float32)
    gc.collect()
    assert not unraisable, "the half-made block failed in __del__"


def _with_pool_setting(value, code):
    """Runs `code` in a fresh interpreter (the library reads the pool's bound
    once per process) with ASCEND_MOE_HOST_POOL_BYTES set to `value`."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, ASCEND_MOE_HOST_POOL_BYTES=value)
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    return run.stdout


def test_a_bad_pool_bound_fails_large_results_naming_it_and_small_ones_still_work():
    code = (
        "import numpy as np, ascend_moe as am\n"
        "x = np.arange(MIN // 4 + 1024, dtype=np.float32)\n"
        "with am.Comm.cpu('host-pool-bad-bound', 1, 0) as c:\n"
        "    print('small', am.all_reduce(x[:8], c).tolist() == x[:8].tolist())\n"
        "    try:\n"
        "        am.all_reduce(x, c)\n"
        "        print('large: no error')\n"
        "    except am.AmoeError as e:\n"
        "        print('large:', type(e).__name__, e)\n"
    ).replace("MIN", str(MIN))
    out = _with_pool_setting("1.5G", code)
    assert "small True" in out, out
    line = next(l for l in out.splitlines() if l.startswith("large:"))
    assert "ASCEND_MOE_HOST_POOL_BYTES" in line and '"1.5G"' in line, line
    assert line.startswith("large: InvalidArgumentError"), line


def test_a_pool_bound_as_set_lets_large_results_work():
    code = (
        "import numpy as np, ascend_moe as am\n"
        "x = np.arange(MIN // 4 + 1024, dtype=np.float32)\n"
        "with am.Comm.cpu('host-pool-bound', 1, 0) as c:\n"
        "    for _ in range(3):\n"
        "        r = am.all_reduce(x, c)\n"
        "        assert (r == x).all()\n"
        "        del r\n"
        "print('ok')\n"
    ).replace("MIN", str(MIN))
    for value in ["0", "3M", "1048576"]:
        assert _with_pool_setting(value, code).strip().endswith("ok"), value


def test_a_child_forked_while_another_thread_holds_the_packages_locks_still_calls_the_library():
    """`fork` copies only the forking thread: a lock another thread held then
    (the count of calls in flight, the stream cache) would stay held in the
    child for ever. The child re-creates them and makes a pooled result."""
    import importlib
    import os
    import threading
    import time

    calls = importlib.import_module("ascend_moe._lib")

    ex, idx, kw = finalize_case(rng_for("fork"), 0, np.dtype(np.float32), n=512, k=2, h=(512,))
    want = finalize_golden(ex, idx, kw["x1"], kw["x2"], kw["bias"], kw["scales"], kw["expert_idx"], 0)
    held, release = threading.Event(), threading.Event()

    def holder():
        with calls._INFLIGHT_LOCK, _tensor._STREAMS_LOCK:
            held.set()
            release.wait(5)

    t = threading.Thread(target=holder)
    t.start()
    assert held.wait(10), "the holder never took the locks"
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            got = am.moe_finalize_routing(ex, idx, **kw)
            code = 0 if got.nbytes >= 1 << 20 and np.allclose(got, want, rtol=1e-5, atol=1e-5) else 2
        finally:
            os._exit(code)
    release.set()
    t.join()
    deadline = time.monotonic() + 20
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the child hung on a lock another thread held at the fork")
        time.sleep(0.005)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
