"""The Python API on simulated NPU memory (cann-sim), in a process whose
loader env points at libcann_sim.so (`test_sim.py` sets it up).

The test plays the engine: it owns the device memory (`aclrtMalloc`), the
streams (`aclrtCreateStream`) and the HCCL communicators
(`HcclCommInitRootInfo`), and hands them to the package only as a stand-in
NPU tensor (`device`, `data_ptr()`, `dtype`, `shape`, `is_contiguous()`) and a
stand-in stream (`.npu_stream`), as torch_npu would.

    python sim_workers.py SCENARIO     (prints "ok SCENARIO" on success)
"""

import ctypes
import os
import sys
import threading

import numpy as np

import ascend_moe as am
from workers import BF16, assert_close, finalize_case, finalize_golden, rand, rng_for, unpermute_golden

ACL_MEMCPY_HOST_TO_DEVICE = 1
ACL_MEMCPY_DEVICE_TO_HOST = 2
HCCL_ROOT_INFO_BYTES = 4108

SIM = ctypes.CDLL(os.environ["ASCEND_MOE_ACL_LIB"])
for _name, _args in {
    "aclInit": [ctypes.c_char_p],
    "aclrtSetDevice": [ctypes.c_int32],
    "aclrtMalloc": [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_uint32],
    "aclrtFree": [ctypes.c_void_p],
    "aclrtMemcpy": [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint32],
    "aclrtCreateStream": [ctypes.POINTER(ctypes.c_void_p)],
    "aclrtSynchronizeStream": [ctypes.c_void_p],
    "aclrtDestroyStream": [ctypes.c_void_p],
    "HcclGetRootInfo": [ctypes.c_void_p],
    "HcclCommInitRootInfo": [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_uint32, ctypes.POINTER(ctypes.c_void_p)],
    "HcclCommDestroy": [ctypes.c_void_p],
}.items():
    getattr(SIM, _name).argtypes = _args
    getattr(SIM, _name).restype = ctypes.c_int32


def check(what, code):
    if code != 0:
        raise RuntimeError(f"{what} failed with {code}")


class Device:
    def __init__(self, index):
        self.type, self.index = "npu", index

    def __repr__(self):
        return f"npu:{self.index}"


class DeviceTensor:
    """A stand-in NPU tensor over simulator device memory it allocated (the
    engine's allocator); `new_empty` is how the package allocates outputs."""

    live: list = []

    def __init__(self, shape, dtype, index):
        self.shape, self.dtype, self.device = tuple(int(s) for s in shape), np.dtype(dtype), Device(index)
        self.nbytes = int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize
        p = ctypes.c_void_p()
        check("aclrtMalloc", SIM.aclrtMalloc(ctypes.byref(p), max(self.nbytes, 1), 0))
        self.ptr = p.value
        DeviceTensor.live.append(self)

    @classmethod
    def upload(cls, a, index):
        a = np.ascontiguousarray(a)
        t = cls(a.shape, a.dtype, index)
        check("aclrtMemcpy H2D", SIM.aclrtMemcpy(t.ptr, t.nbytes, a.ctypes.data, a.nbytes, ACL_MEMCPY_HOST_TO_DEVICE))
        return t

    def download(self):
        a = np.empty(self.shape, self.dtype)
        check("aclrtMemcpy D2H", SIM.aclrtMemcpy(a.ctypes.data, a.nbytes, self.ptr, self.nbytes, ACL_MEMCPY_DEVICE_TO_HOST))
        return a

    def data_ptr(self):
        return self.ptr

    def is_contiguous(self):
        return True

    def new_empty(self, shape):
        return DeviceTensor(shape, self.dtype, self.device.index)

    @classmethod
    def free_all(cls):
        for t in cls.live:
            check("aclrtFree", SIM.aclrtFree(t.ptr))
        cls.live.clear()


class Stream:
    """torch_npu's Stream: `.npu_stream` is the raw aclrtStream."""

    def __init__(self):
        s = ctypes.c_void_p()
        check("aclrtCreateStream", SIM.aclrtCreateStream(ctypes.byref(s)))
        self.npu_stream = s.value

    def synchronize(self):
        check("aclrtSynchronizeStream", SIM.aclrtSynchronizeStream(self.npu_stream))

    def destroy(self):
        check("aclrtDestroyStream", SIM.aclrtDestroyStream(self.npu_stream))


def local_ops():
    """finalize (into `out=` and allocated) and unpermute on device 1."""
    check("aclrtSetDevice", SIM.aclrtSetDevice(1))
    stream = Stream()
    for dtype in (np.dtype(np.float32), BF16):
        ex, idx, kw = finalize_case(rng_for("sim-fin", str(dtype)), 0, dtype)
        kw["scales"] = kw["scales"].astype(np.float32)
        want = finalize_golden(ex, idx, kw["x1"], kw["x2"], kw["bias"], kw["scales"], kw["expert_idx"], 0)
        dev = {k: (DeviceTensor.upload(v, 1) if isinstance(v, np.ndarray) else v) for k, v in kw.items()}
        dex, didx = DeviceTensor.upload(ex, 1), DeviceTensor.upload(idx, 1)
        out = DeviceTensor(want.shape, dtype, 1)
        assert am.moe_finalize_routing(dex, didx, **dev, out=out, stream=stream) is out
        made = am.moe_finalize_routing(dex, didx, **dev, stream=stream)
        assert isinstance(made, DeviceTensor) and made.device.index == 1 and made.shape == want.shape
        stream.synchronize()
        assert_close(out.download(), want, dtype, f"finalize {dtype} into out on npu:1")
        assert_close(made.download(), want, dtype, f"finalize {dtype} allocated on npu:1")

        permuted = rand(rng_for("sim-unperm", str(dtype)), (6, 4), dtype)
        sorted_idx = np.array([3, 0, 5, 1, 4, 2], np.int32)
        probs = rand(rng_for("sim-probs", str(dtype)), (3, 2), dtype)
        uout = DeviceTensor((3, 4), dtype, 1)
        got = am.moe_token_unpermute(
            DeviceTensor.upload(permuted, 1), DeviceTensor.upload(sorted_idx, 1), DeviceTensor.upload(probs, 1), out=uout, stream=stream
        )
        assert got is uout
        stream.synchronize()
        assert_close(uout.download(), unpermute_golden(permuted, sorted_idx, probs), dtype, f"unpermute {dtype}")
    assert am.release_streams() == 1
    stream.destroy()
    DeviceTensor.free_all()


def world4():
    """4 devices as threads: HCCL communicators made by the caller, borrowed
    with `Comm.from_hccl`; all_reduce, all_gather and the EP pad/reduce on
    device memory, each rank on its own stream."""
    world = 4
    check("aclrtSetDevice", SIM.aclrtSetDevice(0))
    root = ctypes.create_string_buffer(HCCL_ROOT_INFO_BYTES)
    check("HcclGetRootInfo", SIM.HcclGetRootInfo(root))
    layout = am.SpLayout([3, 1, 0, 2])
    xs = [rand(rng_for("sim-w4", r), (layout.total_rows, 5), np.float32) for r in range(world)]
    gs = [rand(rng_for("sim-w4g", r), (2, 5), np.float32) for r in range(world)]
    results, errors = {}, []

    def rank(r):
        try:
            check("aclrtSetDevice", SIM.aclrtSetDevice(r))
            raw = ctypes.c_void_p()
            check("HcclCommInitRootInfo", SIM.HcclCommInitRootInfo(world, root, r, ctypes.byref(raw)))
            stream = Stream()
            comm = am.Comm.from_hccl(raw.value, r)
            x = DeviceTensor.upload(xs[r], r)
            ar = am.all_reduce(x, comm, stream=stream)
            ag = am.all_gather(DeviceTensor.upload(gs[r], r), comm, stream=stream)
            pr = am.maybe_pad_and_reduce(x, layout, comm, stream=stream)
            stream.synchronize()
            results[r] = (ar.download(), ag.download(), pr.download(), stream, raw.value)
            comm.close()
        except Exception as e:  # noqa: BLE001
            errors.append(f"rank {r}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    total = np.sum(np.stack(xs).astype(np.float64), axis=0)
    starts = np.cumsum([0] + list(layout.local_sizes))
    for r in range(world):
        ar, ag, pr, _, _ = results[r]
        assert_close(ar, total, np.float32, f"all_reduce on npu:{r}")
        assert_close(ag, np.concatenate(gs), np.float32, f"all_gather on npu:{r}")
        assert_close(pr, total[starts[r] : starts[r + 1]], np.float32, f"maybe_pad_and_reduce on npu:{r}")
    assert am.release_streams() == world
    for r in range(world):
        check("aclrtSetDevice", SIM.aclrtSetDevice(r))
        results[r][3].destroy()
        check("HcclCommDestroy", SIM.HcclCommDestroy(results[r][4]))
    DeviceTensor.free_all()


def missing_stream():
    """An NPU operand and no stream (no torch_npu here): a clear error."""
    check("aclrtSetDevice", SIM.aclrtSetDevice(0))
    x = DeviceTensor.upload(np.zeros((4, 2), np.float32), 0)
    idx = DeviceTensor.upload(np.arange(4, dtype=np.int32), 0)
    try:
        am.moe_token_unpermute(x, idx)
    except am.AmoeError as e:
        assert "no stream was given" in str(e) and "npu:0" in str(e), e
    else:
        raise AssertionError("an NPU call without a stream succeeded")
    DeviceTensor.free_all()


if __name__ == "__main__":
    check("aclInit", SIM.aclInit(None))
    scenario = sys.argv[1]
    {"local_ops": local_ops, "world4": world4, "missing_stream": missing_stream}[scenario]()
    print(f"ok {scenario}")
