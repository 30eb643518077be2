"""The Python API on simulated NPU memory (cann-sim), in a process whose
loader env points at libcann_sim.so (`test_sim.py` sets it up).

The test plays the engine: it owns the device memory (`aclrtMalloc`), the
streams (`aclrtCreateStream`) and the HCCL communicators
(`HcclCommInitRootInfo`), and hands them to the package only as a stand-in
NPU tensor (`device`, `data_ptr()`, `dtype`, `shape`, `is_contiguous()`) and a
stand-in stream (`.npu_stream`), as torch_npu would. The scenarios that
need nothing of the simulator beyond memory and a stream are
`npu_scenarios`'s, which `npu_workers.py` runs on real torch_npu tensors.

    python sim_workers.py SCENARIO     (prints "ok SCENARIO" on success)
    python sim_workers.py rank R ROOT  (one rank of world4_procs)
"""

import ctypes
import os
import subprocess
import sys
import threading

import numpy as np

import ascend_moe as am
import npu_scenarios as sc
from workers import assert_close, finalize_case, finalize_golden, rng_for

ACL_MEMCPY_HOST_TO_DEVICE = 1
ACL_MEMCPY_DEVICE_TO_HOST = 2
ACL_MEMCPY_DEVICE_TO_DEVICE = 3
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
    "aclmdlRICaptureBegin": [ctypes.c_void_p, ctypes.c_int32],
    "aclmdlRICaptureEnd": [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)],
    "aclmdlRIExecuteAsync": [ctypes.c_void_p, ctypes.c_void_p],
    "aclmdlRIDestroy": [ctypes.c_void_p],
    "aclrtMemcpyAsync": [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint32, ctypes.c_void_p],
    "aclrtCreateEvent": [ctypes.POINTER(ctypes.c_void_p)],
    "aclrtRecordEvent": [ctypes.c_void_p, ctypes.c_void_p],
    "aclrtStreamWaitEvent": [ctypes.c_void_p, ctypes.c_void_p],
    "aclrtDestroyEvent": [ctypes.c_void_p],
}.items():
    getattr(SIM, _name).argtypes = _args
    getattr(SIM, _name).restype = ctypes.c_int32


class Counters(ctypes.Structure):
    """`CannsimCounters` (cann-sim/README.md, "Host call counters")."""

    _fields_ = [
        (name, ctypes.c_uint64)
        for name in ("host_syncs", "device_mallocs", "device_frees", "host_mallocs", "host_frees", "h2d_copies", "d2h_copies", "queries", "event_creates", "d2d_copies")
    ]


SIM.cannsim_counters.argtypes = [ctypes.c_void_p]
SIM.cannsim_counters.restype = ctypes.c_int32
SIM.cannsim_counters_reset.argtypes = []
SIM.cannsim_counters_reset.restype = None


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
        # CANN refuses a zero-byte copy (107000), as an engine's empty tensor never copies.
        if a.nbytes:
            check("aclrtMemcpy H2D", SIM.aclrtMemcpy(t.ptr, t.nbytes, a.ctypes.data, a.nbytes, ACL_MEMCPY_HOST_TO_DEVICE))
        return t

    def download(self):
        a = np.empty(self.shape, self.dtype)
        if a.nbytes:
            check("aclrtMemcpy D2H", SIM.aclrtMemcpy(a.ctypes.data, a.nbytes, self.ptr, self.nbytes, ACL_MEMCPY_DEVICE_TO_HOST))
        return a

    def data_ptr(self):
        return self.ptr

    def is_contiguous(self):
        return True

    def new_empty(self, shape, dtype=None):
        return DeviceTensor(shape, self.dtype if dtype is None else dtype, self.device.index)

    @classmethod
    def free_all(cls):
        for t in cls.live:
            check("aclrtFree", SIM.aclrtFree(t.ptr))
        cls.live.clear()


ACL_MODEL_RI_CAPTURE_MODE_GLOBAL = 0


class Graph:
    """An ACL graph of what `body()` enqueues on `stream` (aclmdlRICapture*),
    as torch_npu's NPUGraph captures one."""

    def __init__(self, stream, body):
        check("aclmdlRICaptureBegin", SIM.aclmdlRICaptureBegin(stream.npu_stream, ACL_MODEL_RI_CAPTURE_MODE_GLOBAL))
        try:
            body()
        finally:
            model = ctypes.c_void_p()
            check("aclmdlRICaptureEnd", SIM.aclmdlRICaptureEnd(stream.npu_stream, ctypes.byref(model)))
            self.model = model.value

    def replay(self, stream):
        check("aclmdlRIExecuteAsync", SIM.aclmdlRIExecuteAsync(self.model, stream.npu_stream))

    def destroy(self):
        check("aclmdlRIDestroy", SIM.aclmdlRIDestroy(self.model))


class Stream:
    """torch_npu's Stream: `.npu_stream` is the raw aclrtStream."""

    def __init__(self):
        s = ctypes.c_void_p()
        check("aclrtCreateStream", SIM.aclrtCreateStream(ctypes.byref(s)))
        self.npu_stream = s.value

    def synchronize(self):
        check("aclrtSynchronizeStream", SIM.aclrtSynchronizeStream(self.npu_stream))

    def wait_stream(self, other):
        """Work queued here from now on runs after what `other` has queued (an event)."""
        event = ctypes.c_void_p()
        check("aclrtCreateEvent", SIM.aclrtCreateEvent(ctypes.byref(event)))
        check("aclrtRecordEvent", SIM.aclrtRecordEvent(event, other.npu_stream))
        check("aclrtStreamWaitEvent", SIM.aclrtStreamWaitEvent(self.npu_stream, event))
        self.events = getattr(self, "events", []) + [event.value]

    def destroy(self):
        for event in getattr(self, "events", []):
            check("aclrtDestroyEvent", SIM.aclrtDestroyEvent(event))
        check("aclrtDestroyStream", SIM.aclrtDestroyStream(self.npu_stream))


class SimEngine(sc.Engine):
    """The scenarios' engine over simulator device memory (`DeviceTensor`)."""

    def up(self, a):
        return DeviceTensor.upload(a, self.index)

    def empty(self, shape, dtype):
        return DeviceTensor(shape, dtype, self.index)

    def down(self, t):
        return t.download()

    def is_device(self, t):
        return isinstance(t, DeviceTensor) and t.device.index == self.index


class CurrentStreamTensor(DeviceTensor):
    """torch_npu's tensor as broadcast uses it: `detach().clone()` queues its
    device-to-device copy on the device's current stream (`current`, what
    `torch.npu.current_stream()` returns), and `record_stream` notes the
    streams the tensor was marked in use on."""

    current: dict = {}

    def __init__(self, shape, dtype, index):
        super().__init__(shape, dtype, index)
        self.recorded = []

    def detach(self):
        return self

    def clone(self, memory_format=None):
        t = CurrentStreamTensor(self.shape, self.dtype, self.device.index)
        stream = CurrentStreamTensor.current[self.device.index].npu_stream
        check("aclrtMemcpyAsync D2D", SIM.aclrtMemcpyAsync(t.ptr, t.nbytes, self.ptr, self.nbytes, ACL_MEMCPY_DEVICE_TO_DEVICE, stream))
        return t

    def record_stream(self, stream):
        self.recorded.append(stream)


def local_ops():
    """finalize (into `out=` and allocated) and unpermute on device 1."""
    check("aclrtSetDevice", SIM.aclrtSetDevice(1))
    stream = Stream()
    sc.finalize_and_unpermute(SimEngine(1, stream))
    assert am.release_streams() == 1
    stream.destroy()
    DeviceTensor.free_all()


WORLD = sc.WORLD
# Whether this process sees only its rank's device (world4_visible), whose id
# is then 0, instead of all four (ids 0-3, the rank's own).
ONE_DEVICE = False


def device(rank):
    """The device id of rank `rank` in this process."""
    return 0 if ONE_DEVICE else rank


def rank_body(r, root):
    """Rank `r` of the 4-device world of `root` (an HcclRootInfo): the
    caller's HCCL communicator borrowed with `Comm.from_hccl` as the world,
    running `npu_scenarios.world_ops` on this rank's own stream. Returns
    `(stream, raw_comm)` for the caller to destroy."""
    check("aclrtSetDevice", SIM.aclrtSetDevice(device(r)))
    raw = ctypes.c_void_p()
    check("HcclCommInitRootInfo", SIM.HcclCommInitRootInfo(WORLD, root, r, ctypes.byref(raw)))
    stream = Stream()
    # A communicator made from the root info is a world HCCL may split;
    # passed as the `c_void_p` itself, as vLLM-Ascend's PyHcclCommunicator holds it.
    with am.Comm.from_hccl(raw, device(r), world=True) as comm:
        sc.world_ops(comm, r, SimEngine(device(r), stream))
    return stream, raw.value


def teardown(ranks):
    """Frees the stream handles, then each rank's stream and communicator, then the memory."""
    assert am.release_streams() == len(ranks)
    for r, (stream, raw) in ranks.items():
        check("aclrtSetDevice", SIM.aclrtSetDevice(device(r)))
        stream.destroy()
        check("HcclCommDestroy", SIM.HcclCommDestroy(raw))
    DeviceTensor.free_all()


def root_info():
    check("aclrtSetDevice", SIM.aclrtSetDevice(0))
    root = ctypes.create_string_buffer(HCCL_ROOT_INFO_BYTES)
    check("HcclGetRootInfo", SIM.HcclGetRootInfo(root))
    return root


def world4():
    """4 devices as threads of this process."""
    root = root_info()
    ranks, errors = {}, []

    def rank(r):
        try:
            ranks[r] = rank_body(r, root)
        except Exception as e:  # noqa: BLE001
            errors.append(f"rank {r}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(WORLD)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    teardown(ranks)


def world4_procs(visible=False):
    """4 devices as processes (`sim_workers.py rank R ROOT_HEX`), the root info
    passed to each as hex, as an engine's launcher would. `visible`: each
    process sees only its rank's device (`ASCEND_RT_VISIBLE_DEVICES=R`, as a
    launcher that hands every worker one device sets it) and uses it as
    device 0."""
    root = root_info().raw.hex()

    def env(r):
        return dict(os.environ, ASCEND_RT_VISIBLE_DEVICES=str(r)) if visible else None

    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "rank", str(r), root] + (["visible"] if visible else []),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env(r),
        )
        for r in range(WORLD)
    ]
    outs = [p.communicate(timeout=240)[0] for p in procs]
    bad = [f"rank {r} exit {p.returncode}:\n{o}" for r, (p, o) in enumerate(zip(procs, outs)) if p.returncode or f"ok rank {r}" not in o]
    assert not bad, "\n".join(bad)


def one_rank(r, root_hex):
    root = ctypes.create_string_buffer(bytes.fromhex(root_hex), HCCL_ROOT_INFO_BYTES)
    teardown({r: rank_body(r, root)})
    print(f"ok rank {r}")


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


def live_context():
    """`npu_scenarios.live_context` on a stream of device 2."""
    check("aclrtSetDevice", SIM.aclrtSetDevice(2))
    stream = Stream()
    sc.live_context(stream, 2)
    stream.destroy()


def live_context_records():
    """The guard records of a live context: guards outside capture add
    records when none is free; a graph's guards keep theirs, so records are
    reserved before capture (`reserve`, refused under capture), and a guard
    under capture that finds none free is refused naming `LiveContext.reserve`."""
    check("aclrtSetDevice", SIM.aclrtSetDevice(2))
    stream = Stream()
    live = am.LiveContext(stream, device=2)
    assert (live.capacity, live.guards_in_use) == (128, 0)
    mc2 = am.ForwardContext(am.CommType.MC2, dp_tokens=[4, 4])
    live.set(mc2)
    for _ in range(130):
        live.guard(mc2)
    assert (live.capacity, live.guards_in_use) == (256, 130)
    live.check()
    assert (live.capacity, live.guards_in_use) == (256, 0)
    for bad in (-1, 1.5, "2"):
        try:
            live.reserve(bad)
        except am.AmoeError as e:
            assert e.status == am.Status.INVALID_ARGUMENT and "`guards`" in str(e), e
        else:
            raise AssertionError(f"reserve({bad!r}) was accepted")

    # Guard i built for DP tokens [4, i], 300 of them, each in its own graph
    # (an engine's graphs per batch size), after a reserve.
    n = 300
    live.reserve(n)
    assert live.capacity >= n and live.capacity % 128 == 0, live.capacity
    ctx = [am.ForwardContext(am.CommType.MC2, dp_tokens=[4, i]) for i in range(n)]
    graphs = []
    for i in range(n):
        graphs.append(Graph(stream, lambda i=i: live.guard(ctx[i])))
    assert live.guards_in_use == n
    for i, g in enumerate(graphs):
        live.set(ctx[i])
        g.replay(stream)
    live.check()
    stale = am.ForwardContext(am.CommType.MC2, dp_tokens=[4, 999])
    for i in (0, 200, n - 1):
        live.set(stale)
        graphs[i].replay(stream)
        try:
            live.check()
        except am.AmoeError as e:
            assert e.status == am.Status.STALE_CONTEXT, e
            assert "dp_tokens[1] is 999" in str(e) and f"captured for {i};" in str(e), e
        else:
            raise AssertionError(f"a stale replay of graph {i} was not reported")

    # Fill every record under capture: the next captured guard is refused,
    # naming the Python call, and so is a reserve during the capture.
    free = live.capacity - live.guards_in_use

    def fill():
        for _ in range(free):
            live.guard(mc2)
        refusals = ((lambda: live.guard(mc2), "LiveContext.reserve(N)"), (lambda: live.reserve(1), "before the capture"))
        for refused, words in refusals:
            try:
                refused()
            except am.AmoeError as e:
                assert e.status == am.Status.INVALID_ARGUMENT and words in str(e), e
            else:
                raise AssertionError(f"not refused under capture ({words})")

    graphs.append(Graph(stream, fill))
    assert live.guards_in_use == live.capacity
    live.set(mc2)
    graphs[-1].replay(stream)
    live.check()
    for g in graphs:
        g.destroy()
    live.close()
    assert am.release_streams() == 1
    stream.synchronize()
    stream.destroy()


def release_in_flight():
    """`release_streams` while another thread's calls use a stream handle: a
    handle is freed only when no call is in flight (it was freed under a
    running call: a hang or a crash), and a call that took the handle before
    the release is refused naming `stream`; the results stay right."""
    check("aclrtSetDevice", SIM.aclrtSetDevice(1))
    stream = Stream()
    ex, idx, kw = finalize_case(rng_for("sim-release"), 0, np.dtype(np.float32))
    kw["scales"] = kw["scales"].astype(np.float32)
    want = finalize_golden(ex, idx, kw["x1"], kw["x2"], kw["bias"], kw["scales"], kw["expert_idx"], 0)
    dev = {k: (DeviceTensor.upload(v, 1) if isinstance(v, np.ndarray) else v) for k, v in kw.items()}
    dex, didx = DeviceTensor.upload(ex, 1), DeviceTensor.upload(idx, 1)
    out = DeviceTensor(want.shape, np.float32, 1)
    refused, failed, done = [], [], threading.Event()

    def worker():
        try:
            check("aclrtSetDevice", SIM.aclrtSetDevice(1))
            for _ in range(40):
                try:
                    am.moe_finalize_routing(dex, didx, **dev, out=out, stream=stream)
                    am.stream_check(stream, device=1)
                except am.AmoeError as e:
                    if e.status != am.Status.INVALID_ARGUMENT or "`stream` is not a live" not in str(e):
                        raise
                    refused.append(e)
        except BaseException as e:  # noqa: BLE001 (raised again on the main thread)
            failed.append(e)
        finally:
            done.set()

    t = threading.Thread(target=worker)
    t.start()
    released = 0
    while not done.is_set():
        released += am.release_streams()
    t.join()
    if failed:
        raise failed[0]
    assert released > 0, "the stream was never wrapped while the worker ran"
    am.moe_finalize_routing(dex, didx, **dev, out=out, stream=stream)
    am.stream_check(stream, device=1)
    assert_close(out.download(), want, np.dtype(np.float32), "finalize after the releases")
    am.release_streams()
    stream.destroy()
    DeviceTensor.free_all()


def stream_ops():
    """The stream as the sync point: a bad index found by the device kernel
    leaves the finalize call successful and is reported once by
    `stream_check`; reserved workspace and an engine allocator serve the ops."""
    check("aclrtSetDevice", SIM.aclrtSetDevice(1))
    stream = Stream()
    ex, idx, kw = finalize_case(rng_for("sim-check"), 0, np.dtype(np.float32))
    kw["scales"] = kw["scales"].astype(np.float32)
    bad = idx.copy()
    bad.flat[3] = 10_000
    dev = {k: (DeviceTensor.upload(v, 1) if isinstance(v, np.ndarray) else v) for k, v in kw.items()}
    dex = DeviceTensor.upload(ex, 1)
    out = am.moe_finalize_routing(dex, DeviceTensor.upload(bad, 1), **dev, stream=stream)
    assert isinstance(out, DeviceTensor)
    try:
        am.stream_check(stream, device=1)
    except am.AmoeError as e:
        assert e.status == am.Status.INDEX_OUT_OF_RANGE, e
        assert "expanded_row_idx" in str(e) and "[3] = 10000" in str(e), e
    else:
        raise AssertionError("a bad index on the device was not reported by the stream check")
    am.stream_check(stream, device=1)  # reported once

    # An NPU op called from Python makes no sync, allocation or device-to-host
    # copy; its one host-to-device copy is the kernel's tiling, staged on the
    # stream (as tests/npu_ordered.rs counts it): the simulator's per-thread
    # counters over a second call into `out=`.
    good = DeviceTensor.upload(idx, 1)
    fixed = DeviceTensor(out.shape, np.float32, 1)
    am.moe_finalize_routing(dex, good, **dev, out=fixed, stream=stream)
    am.stream_check(stream, device=1)
    SIM.cannsim_counters_reset()
    am.moe_finalize_routing(dex, good, **dev, out=fixed, stream=stream)
    c = Counters()
    check("cannsim_counters", SIM.cannsim_counters(ctypes.byref(c)))
    seen = {name: getattr(c, name) for name, _ in Counters._fields_}
    want = {name: 0 for name in seen} | {"h2d_copies": 1}
    assert seen == want, f"a Python finalize on NPU inputs touched the host: {seen}"
    am.stream_check(stream, device=1)

    am.workspace_reserve(stream, 1 << 20, device=1)
    # Records for captured launches: reserved outside capture, refused inside
    # (the reservation allocates), and the count must be a whole number.
    am.reserve_capture_records(stream, 1000, device=1)
    for bad in (-1, 2.5):
        try:
            am.reserve_capture_records(stream, bad, device=1)
        except am.AmoeError as e:
            assert e.status == am.Status.INVALID_ARGUMENT and "launches" in str(e), e
        else:
            raise AssertionError(f"reserve_capture_records({bad!r}) was accepted")
    check("aclmdlRICaptureBegin", SIM.aclmdlRICaptureBegin(stream.npu_stream, ACL_MODEL_RI_CAPTURE_MODE_GLOBAL))
    try:
        am.reserve_capture_records(stream, 1000, device=1)
    except am.AmoeError as e:
        refused = e
    else:
        refused = None
    model = ctypes.c_void_p()
    check("aclmdlRICaptureEnd", SIM.aclmdlRICaptureEnd(stream.npu_stream, ctypes.byref(model)))
    check("aclmdlRIDestroy", SIM.aclmdlRIDestroy(model))
    assert refused is not None and refused.status == am.Status.INVALID_ARGUMENT, refused
    assert "captur" in str(refused) and "reserve_capture_records" in str(refused), refused
    calls = {"alloc": 0, "free": []}

    def alloc(nbytes, raw):
        assert raw == stream.npu_stream
        p = ctypes.c_void_p()
        check("aclrtMalloc", SIM.aclrtMalloc(ctypes.byref(p), max(int(nbytes), 1), 0))
        calls["alloc"] += 1
        return p.value

    def free(ptr, nbytes, raw):
        calls["free"].append(ptr)  # returned after the stream ran the work

    am.set_allocator(stream, alloc, free, device=1)
    want = finalize_golden(ex, idx, kw["x1"], kw["x2"], kw["bias"], kw["scales"], kw["expert_idx"], 0)
    got = am.moe_finalize_routing(dex, DeviceTensor.upload(idx, 1), **dev, stream=stream)
    am.stream_check(stream, device=1)
    assert_close(got.download(), want, np.float32, "finalize with the engine's allocator")
    am.set_allocator(stream, device=1)
    assert calls["alloc"] >= 1 and len(calls["free"]) == calls["alloc"], calls
    for p in calls["free"]:
        check("aclrtFree", SIM.aclrtFree(p))
    assert am.release_streams() == 1
    stream.destroy()
    DeviceTensor.free_all()


def capture_stream():
    """Reservations are per stream: a finalize warmed up on one stream and
    first run on another under capture (torch.npu.graph's own side stream)
    is refused, saying so; after `prepare_capture` on the capture stream it
    is captured and every replay gives the golden result."""
    check("aclrtSetDevice", SIM.aclrtSetDevice(1))
    warm, side = Stream(), Stream()
    ex, idx, kw = finalize_case(rng_for("sim-capture-stream"), 0, np.dtype(np.float32))
    kw["scales"] = kw["scales"].astype(np.float32)
    dev = {k: (DeviceTensor.upload(v, 1) if isinstance(v, np.ndarray) else v) for k, v in kw.items()}
    dex, didx = DeviceTensor.upload(ex, 1), DeviceTensor.upload(idx, 1)
    want = finalize_golden(ex, idx, kw["x1"], kw["x2"], kw["bias"], kw["scales"], kw["expert_idx"], 0)
    warmed = am.moe_finalize_routing(dex, didx, **dev, stream=warm)
    am.stream_check(warm, device=1)
    assert_close(warmed.download(), want, np.float32, "the warm-up")
    out = DeviceTensor(want.shape, np.float32, 1)
    refused = []

    def body():
        try:
            am.moe_finalize_routing(dex, didx, **dev, out=out, stream=side)
        except am.AmoeError as e:
            refused.append(e)

    Graph(side, body).destroy()
    assert refused and "per stream" in str(refused[0]) and "torch.npu.graph" in str(refused[0]), refused
    am.prepare_capture(side, device=1)
    graph = Graph(side, lambda: am.moe_finalize_routing(dex, didx, **dev, out=out, stream=side))
    for _ in range(2):
        graph.replay(side)
        am.stream_check(side, device=1)
        assert_close(out.download(), want, np.float32, "a replay on the prepared capture stream")
    graph.destroy()
    assert am.release_streams() == 2
    warm.destroy()
    side.destroy()
    DeviceTensor.free_all()


def side_stream():
    """A collective on a `stream=` other than torch_npu's current stream (a side
    stream, to overlap communication): broadcast's copy of `x`, which torch
    queues on the current stream, is finished before the broadcast on the
    side stream writes it, so every rank ends with the root's data, and the
    result is marked in use on the side stream for torch's allocator."""
    import torch  # noqa: F401  (broadcast names torch.contiguous_format for a tensor's clone)

    import ascend_moe._tensor as tensors

    tensors.default_stream = lambda index: CurrentStreamTensor.current[index]
    root = root_info()
    got, errors = {}, []

    def rank(r):
        try:
            check("aclrtSetDevice", SIM.aclrtSetDevice(device(r)))
            raw = ctypes.c_void_p()
            check("HcclCommInitRootInfo", SIM.HcclCommInitRootInfo(2, root, r, ctypes.byref(raw)))
            current, side = Stream(), Stream()
            CurrentStreamTensor.current[device(r)] = current
            x = CurrentStreamTensor.upload(np.full(4, 10.0 * (r + 1), np.float32), device(r))
            with am.Comm.from_hccl(raw.value, device(r)) as comm:
                y = am.broadcast(x, comm, root=0, stream=side)
                am.stream_check(side, device=device(r))
                current.synchronize()
                got[r] = (y.download(), [s is side for s in y.recorded])
            current.destroy()
            side.destroy()
            check("HcclCommDestroy", SIM.HcclCommDestroy(raw.value))
        except Exception as e:  # noqa: BLE001
            errors.append(f"rank {r}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for r in range(2):
        data = got[r][0].tolist()
        assert data == [10.0] * 4, f"rank {r} got {data}: the broadcast ran before its copy of x"
    for r in range(2):
        recorded = got[r][1]
        assert recorded == [True], f"rank {r}: the result was not marked in use on the side stream ({recorded})"
    assert am.release_streams() == 2
    DeviceTensor.free_all()


if __name__ == "__main__":
    check("aclInit", SIM.aclInit(None))
    scenario = sys.argv[1]
    if scenario == "rank":
        ONE_DEVICE = sys.argv[4:] == ["visible"]
        one_rank(int(sys.argv[2]), sys.argv[3])
        sys.exit(0)
    {"local_ops": local_ops, "world4": world4, "world4_procs": world4_procs, "world4_visible": lambda: world4_procs(True), "missing_stream": missing_stream, "live_context": live_context, "live_context_records": live_context_records, "stream_ops": stream_ops, "release_in_flight": release_in_flight, "side_stream": side_stream, "capture_stream": capture_stream}[scenario]()
    print(f"ok {scenario}")
